// Background processes: start returns at once; list, info, output followed as it comes,
// stdin (with close), signals to the whole tree, and wait for the result.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import type { Sandbox } from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();
let sbx: Sandbox;

before(async () => {
  sbx = await c.sandboxes.create({ metadata: { suite: unique("proc") } });
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
});

test("a process reads its stdin, is listed while it runs, and wait gives its result", async () => {
  const p = await sbx.processes.start(["sh", "-c", "read line; echo got $line; exit 4"]);
  assert.match(p.id, /^proc_/);
  assert.equal(typeof p.pid, "number");
  const listed = await sbx.processes.list();
  assert.ok(listed.some((x) => x.id === p.id && x.state === "running"), JSON.stringify(listed));
  await p.writeStdin("hello\n", { close: true });
  const r = await p.wait();
  assert.equal(r.exitCode, 4);
  assert.equal(r.stdout, "got hello\n");
  const info = await p.info();
  assert.equal(info.state, "exited");
  assert.equal(info.result?.exitCode, 4);
  assert.equal((await sbx.processes.get(p.id).info()).id, p.id);
});

test("output is replayed from the start and followed until the end", async () => {
  const p = await sbx.processes.start("for i in 1 2 3; do echo line$i; sleep 0.3; done");
  const out: string[] = [];
  let exit: number | null | undefined;
  for await (const ev of p.output()) {
    if (ev.type === "stdout") out.push(ev.data);
    if (ev.type === "result") exit = ev.result.exitCode;
  }
  assert.equal(out.join(""), "line1\nline2\nline3\n");
  assert.equal(exit, 0);
  const replay: string[] = [];
  for await (const ev of p.output({ follow: false })) if (ev.type === "stdout") replay.push(ev.data);
  assert.equal(replay.join(""), "line1\nline2\nline3\n");
});

test("a signal ends a process and its result says so; kill sends SIGKILL", async () => {
  const p = await sbx.processes.start(["sleep", "300"]);
  await p.signal("SIGTERM");
  const r = await p.wait();
  // Ended on request through the API: "killed", with the signal that did it.
  assert.equal(r.reason, "killed");
  assert.equal(r.signal, "SIGTERM");
  assert.equal(r.exitCode, null);
  const q = await sbx.processes.start(["sh", "-c", "trap '' TERM; sleep 300"]);
  await q.kill();
  assert.equal((await q.wait()).signal, "SIGKILL");
});

test("streaming stdin in several writes", async () => {
  const p = await sbx.processes.start(["wc", "-c"]);
  const chunk = new Uint8Array(1 << 20).fill(97);
  for (let i = 0; i < 3; i++) await p.writeStdin(chunk);
  await p.closeStdin();
  assert.equal((await p.wait()).stdout.trim(), String(3 << 20));
});

test("exec feeds a streamed stdin of any size, and stops feeding when the command ends", async () => {
  const mib = new Uint8Array(1 << 20).fill(122);
  async function* three() {
    for (let i = 0; i < 3; i++) yield mib;
  }
  const counted = await sbx.exec(["wc", "-c"], { stdin: three() });
  assert.equal(counted.stdout.trim(), String(3 << 20));
  assert.equal(counted.exitCode, 0);
  let sent = 0;
  async function* endless() {
    for (;;) {
      sent++;
      yield new TextEncoder().encode("line\n");
    }
  }
  const t0 = Date.now();
  const head = await sbx.exec(["head", "-n", "2"], { stdin: endless() });
  assert.equal(head.stdout, "line\nline\n");
  assert.ok(Date.now() - t0 < 30_000, "head returned without the endless source ending");
  const afterwards = sent;
  await new Promise((r) => setTimeout(r, 300));
  assert.equal(sent, afterwards, "feeding stopped when the command ended");
  const rs = new ReadableStream<Uint8Array>({
    start(ctl) {
      ctl.enqueue(new TextEncoder().encode("from a "));
      ctl.enqueue(new TextEncoder().encode("ReadableStream"));
      ctl.close();
    },
  });
  assert.equal((await sbx.exec(["cat"], { stdin: rs })).stdout, "from a ReadableStream");
  assert.throws(() => sbx.execStream(["cat"], { stdin: three() }), TypeError);
});
