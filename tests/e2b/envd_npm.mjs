// E2B's npm package `e2b`, unmodified, against Locker's envd data plane (driven by
// tests/e2b_envd.rs with E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY set): a command, a
// background command, a file and a watch (connect-es needs the end-of-stream envelope), and
// a sandbox killed under a command (the stream is cut; the SDK probes /health and says so).
import { Sandbox, TimeoutError } from 'e2b'

function eq(got, want, what) {
  const g = JSON.stringify(got)
  const w = JSON.stringify(want)
  if (g !== w) throw new Error(`${what}: got ${g}, want ${w}`)
}

const sbx = await Sandbox.create()
try {
  await sbx.commands.run('id user >/dev/null 2>&1 || useradd -m -s /bin/bash user', { user: 'root' })
  const r = await sbx.commands.run('echo hi from node; echo $X', { envs: { X: 'y' } })
  eq([r.stdout, r.exitCode], ['hi from node\ny\n', 0], 'run')
  console.log('ok run')

  const h = await sbx.commands.run('sleep 600', { background: true })
  const listed = (await sbx.commands.list()).map((p) => p.pid)
  if (!listed.includes(h.pid)) throw new Error(`pid ${h.pid} not in ${listed}`)
  eq(await sbx.commands.kill(h.pid), true, 'kill')
  console.log('ok background')

  await sbx.files.write('/tmp/node.txt', 'from node')
  eq(await sbx.files.read('/tmp/node.txt'), 'from node', 'read')
  eq((await sbx.files.list('/tmp')).some((e) => e.name === 'node.txt'), true, 'list')
  console.log('ok files')

  await sbx.files.makeDir('/tmp/nwatch')
  const events = []
  const w = await sbx.files.watchDir('/tmp/nwatch', (e) => events.push(e))
  await sbx.files.write('/tmp/nwatch/a.txt', 'a')
  for (let i = 0; i < 50 && !events.some((e) => e.name === 'a.txt'); i++) {
    await new Promise((r) => setTimeout(r, 100))
  }
  await w.stop()
  if (!events.some((e) => e.name === 'a.txt' && e.type === 'create')) {
    throw new Error(`watch events: ${JSON.stringify(events)}`)
  }
  console.log('ok watch')
} finally {
  await sbx.kill()
}

const doomed = await Sandbox.create()
try {
  const cmd = await doomed.commands.run('sleep 60', { background: true })
  await doomed.kill()
  const err = await cmd.wait().then(() => new Error('wait() returned'), (e) => e)
  if (!(err instanceof TimeoutError) ||
      !err.message.includes('sandbox was killed or reached its end of life')) {
    throw new Error(`a command killed with its sandbox: ${err?.constructor?.name}: ${err?.message}`)
  }
  console.log('ok killed')
} finally {
  await doomed.kill()
}
