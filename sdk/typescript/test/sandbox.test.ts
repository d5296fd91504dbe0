// Sandboxes through the SDK against the real server: create/get/list with filters, exec's
// typed result (exit codes, timeouts as results, stdin, env, binary output, the default
// working directory), TTL, network and metadata changes, pause/resume, snapshots and
// forks, call records and usage, `await using` disposal.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { NotFound, Sandbox } from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();
const tag = unique("sbx");
let sbx: Sandbox;

before(async () => {
  sbx = await c.sandboxes.create({ metadata: { suite: tag, role: "main" }, network: { internet: false }, ttlSeconds: 600 });
});

after(async () => {
  await sbx?.delete().catch(() => undefined);
});

test("a created sandbox is running, described in camelCase with its metadata as given", async () => {
  assert.match(sbx.id, /^sb_/);
  assert.equal(sbx.state, "running");
  assert.deepEqual(sbx.info.metadata, { suite: tag, role: "main" });
  assert.equal(sbx.info.network.egress, "none");
  assert.equal(typeof sbx.info.memoryMb, "number");
  assert.equal(typeof sbx.info.createdAt, "string");
  const again = await c.sandboxes.get(sbx.id);
  assert.equal(again.id, sbx.id);
  assert.equal(again.info.template, sbx.info.template);
});

test("list filters by state and metadata", async () => {
  const mine = await c.sandboxes.list({ metadata: { suite: tag } });
  assert.deepEqual(mine.map((s) => s.id), [sbx.id]);
  assert.deepEqual(await c.sandboxes.list({ metadata: { suite: tag, role: "other" } }), []);
  const running = await Sandbox.list({ state: "running", metadata: { suite: tag } }, { transport: c.transport });
  assert.deepEqual(running.map((s) => s.id), [sbx.id]);
  assert.deepEqual(await c.sandboxes.list({ state: "paused", metadata: { suite: tag } }), []);
});

test("exec returns a typed result; a failing command is a result, not an exception", async () => {
  const r = await sbx.exec(["sh", "-c", "echo out; echo err >&2; exit 3"]);
  assert.equal(r.exitCode, 3);
  assert.equal(r.stdout, "out\n");
  assert.equal(r.stderr, "err\n");
  assert.equal(r.reason, "exited");
  assert.equal(r.ok, false);
  assert.equal(r.timedOut, false);
  assert.match(r.callId, /^call_/);
  assert.equal(typeof r.timings.totalMs, "number");
  assert.equal(r.stdoutTruncated, false);
  const sh = await sbx.exec("echo $((6*7)) | tr 4 X");
  assert.equal(sh.stdout, "X2\n");
  assert.ok(sh.ok);
});

test("a timeout answers timedOut with the output so far instead of throwing", async () => {
  const t0 = Date.now();
  const r = await sbx.exec(["sh", "-c", "echo before; sleep 30; echo after"], { timeoutMs: 700 });
  assert.equal(r.timedOut, true);
  assert.equal(r.reason, "timeout");
  assert.equal(r.exitCode, null);
  assert.equal(r.stdout, "before\n");
  assert.ok(Date.now() - t0 < 20_000, "the command was killed at its timeout");
});

test("commands start in /workspace, made at create; cwd, env, user and stdin pass through", async () => {
  assert.equal((await sbx.exec(["pwd"])).stdout, "/workspace\n");
  assert.equal((await sbx.exec(["pwd"], { cwd: "/tmp" })).stdout, "/tmp\n");
  assert.equal((await sbx.exec("echo $GREETING", { env: { GREETING: "hi there" } })).stdout, "hi there\n");
  assert.equal((await sbx.exec(["cat"], { stdin: "from stdin" })).stdout, "from stdin");
  const bytes = new Uint8Array([0, 1, 2, 255, 254, 10]);
  const echoed = await sbx.exec(["cat"], { stdin: bytes });
  assert.deepEqual(echoed.stdoutRaw(), bytes, "binary stdin and stdout survive");
  assert.ok(echoed.stdoutB64, "non-UTF-8 output also comes as base64");
  assert.equal((await sbx.exec(["id", "-u"], { user: "nobody" })).stdout.trim(), "65534");
  const bad = await sbx.exec(["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' a"], { maxOutputBytes: 1000 });
  assert.equal(bad.stdoutTruncated, true);
  assert.equal(bad.stdoutBytes, 100000);
  assert.ok(bad.outputPath);
});

test("a sandbox created with workdir null runs commands in the user's home", async () => {
  await using s = await c.sandboxes.create({ workdir: null, metadata: { suite: tag, role: "home" } });
  assert.equal(s.workdir, undefined);
  assert.equal((await s.exec(["pwd"])).stdout, "/root\n");
  assert.equal(await s.files.exists("/workspace"), false);
});

test("ttl, metadata and network change on a running sandbox", async () => {
  const before = Date.parse(sbx.info.expiresAt);
  const info = await sbx.setTtl(3600);
  assert.ok(Date.parse(info.expiresAt) > before, "expires later");
  const up = await sbx.update({ metadata: { suite: tag, role: "main", extra: "yes" } });
  assert.equal(up.metadata["extra"], "yes");
  const open = await sbx.update({ network: { allow: ["pypi.org"] } });
  assert.deepEqual(open.network, { egress: "allow", allow: ["pypi.org"] });
  const closed = await sbx.update({ network: { internet: false } });
  assert.equal(closed.network.egress, "none");
});

test("pause freezes and resume thaws", async () => {
  await sbx.pause();
  assert.equal((await sbx.refresh()).state, "paused");
  await sbx.resume();
  assert.equal((await sbx.refresh()).state, "running");
  assert.equal((await sbx.exec(["true"])).exitCode, 0);
});

test("a snapshot and a fork carry the sandbox's files", async () => {
  await sbx.files.write("/workspace/state.txt", "forked state");
  const snap = await sbx.snapshot();
  try {
    assert.match(snap.id, /^snap_/);
    assert.equal(snap.sandboxId, sbx.id);
    assert.ok((await c.snapshots.list()).some((s) => s.id === snap.id));
    await using fromSnap = await c.sandboxes.create({ fromSnapshot: snap.id, metadata: { suite: tag, role: "snap" } });
    assert.equal(await fromSnap.files.readText("/workspace/state.txt"), "forked state");
  } finally {
    await c.snapshots.delete(snap.id);
  }
  assert.ok(!(await c.snapshots.list()).some((s) => s.id === snap.id));
  const forks = await sbx.fork(1);
  try {
    assert.equal(forks.length, 1);
    assert.notEqual(forks[0]!.id, sbx.id);
    assert.equal((await forks[0]!.exec(["cat", "state.txt"])).stdout, "forked state");
  } finally {
    for (const f of forks) await f.delete().catch(() => undefined);
  }
});

test("call records list the sandbox's execs and usage counts them", async () => {
  const r = await sbx.exec(["echo", "recorded"]);
  const calls = await sbx.calls({ limit: 50 });
  const rec = calls.find((x) => x.id === r.callId);
  assert.ok(rec, `the exec ${r.callId} is in the records: ${JSON.stringify(calls.slice(0, 2))}`);
  assert.deepEqual(rec.command, ["echo", "recorded"]);
  assert.equal(rec.kind, "exec");
  assert.equal(rec.sandboxId, sbx.id);
  assert.equal(rec.cwd, "/workspace");
  assert.equal(rec.result?.["exit_code"] ?? rec.result?.["exitCode"], 0);
  const viaClient = await c.calls({ sandboxId: sbx.id, limit: 1 });
  assert.equal(viaClient.length, 1);
  const usage = await c.usage({ since: new Date(Date.now() - 3600_000) });
  assert.ok(usage.execs >= 1, JSON.stringify(usage));
  assert.equal(typeof usage.cpuMs, "number");
});

test("await using deletes the sandbox at the end of the block", async () => {
  let id: string;
  {
    await using s = await Sandbox.create({ metadata: { suite: tag, role: "disposed" } });
    id = s.id;
    assert.equal((await s.exec(["true"])).exitCode, 0);
  }
  await assert.rejects(c.sandboxes.get(id), (e: unknown) => e instanceof NotFound && /deleted/.test(e.message));
});
