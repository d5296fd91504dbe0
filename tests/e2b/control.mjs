// E2B's control plane through the unmodified npm `e2b` package, against Locker: create,
// info, list by metadata, kill. Run by tests/e2b_control.rs with E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY set, from the directory `e2b` is installed in
// (`node control.mjs`); prints `ok npm` when every check held.
import { Sandbox } from 'e2b'
import assert from 'node:assert/strict'

const tag = `npm-${process.pid}-${Date.now()}`
const sbx = await Sandbox.create({ timeoutMs: 60_000, metadata: { suite: tag } })
try {
  assert.match(sbx.sandboxId, /^sb_/)
  const info = await sbx.getInfo()
  assert.equal(info.state, 'running')
  assert.deepEqual(info.metadata, { suite: tag })
  const page = await Sandbox.list({ query: { metadata: { suite: tag } } }).nextItems()
  assert.deepEqual(page.map((s) => s.sandboxId), [sbx.sandboxId])
} finally {
  assert.equal(await Sandbox.kill(sbx.sandboxId), true)
}
assert.equal(await Sandbox.kill(sbx.sandboxId), false)
console.log('ok npm')
