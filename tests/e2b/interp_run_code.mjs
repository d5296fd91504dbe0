// Drives E2B's unmodified npm `@e2b/code-interpreter` against Locker: runCode with state,
// an output callback and an error. Prints what it saw as one JSON line for
// tests/e2b_interp.rs. Environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, and
// E2B_NPM_DIR (where the package is installed).
import { join } from 'node:path'
import { pathToFileURL } from 'node:url'

const entry = join(process.env.E2B_NPM_DIR, 'node_modules/@e2b/code-interpreter/dist/index.mjs')
const { Sandbox } = await import(pathToFileURL(entry).href)

const seen = {}
const sbx = await Sandbox.create()
try {
  await sbx.runCode('x = 20')
  const out = []
  const ex = await sbx.runCode('print("from node")\nx * 2 + 2', {
    onStdout: (m) => out.push(m.line),
  })
  seen.text = ex.text
  seen.stdout = ex.logs.stdout
  seen.callback = out
  seen.count = ex.executionCount
  const bad = await sbx.runCode('raise ValueError("bad value")')
  seen.error = bad.error ? { name: bad.error.name, value: bad.error.value } : null
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  seen.context_cwd = (await sbx.runCode('import os\nos.getcwd()', { context: ctx })).text
  seen.contexts = (await sbx.listCodeContexts()).map((c) => c.id).includes(ctx.id)
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(seen))
