// One sandbox per agent session (SessionSandboxes): a session's calls reuse its sandbox, a
// second worker (a fresh SessionSandboxes) finds it again by its metadata, sessions do not
// see each other's files, and `end` deletes the sandbox; the hosted-loop worker example
// (examples/session-worker.ts) run with its stand-in of the vendor's side.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { SESSION_KEY, SessionSandboxes } from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();

test("each session gets its own sandbox, found again by another worker, deleted at its end", async () => {
  const tag = unique("sessions");
  const worker = new SessionSandboxes({ metadata: { suite: tag } });
  const a = await worker.get(`${tag}-a`);
  const b = await worker.get(`${tag}-b`);
  try {
    assert.notEqual(a.id, b.id);
    assert.equal((await worker.get(`${tag}-a`)).id, a.id, "the same sandbox for the session's next call");
    assert.equal(a.info.metadata[SESSION_KEY], `${tag}-a`);
    assert.deepEqual(a.info.network, { egress: "none" });
    await a.files.write("/workspace/mine.txt", "a");
    assert.equal(await b.files.exists("/workspace/mine.txt"), false, "sessions do not share files");
    // Another worker process (or this one after a restart) finds the session's sandbox.
    const again = await new SessionSandboxes({ metadata: { suite: tag } }).get(`${tag}-a`);
    assert.equal(again.id, a.id);
    assert.equal((await again.exec(["cat", "mine.txt"])).stdout, "a", "its workdir is /workspace");
    await a.pause();
    const resumed = await new SessionSandboxes().get(`${tag}-a`);
    assert.equal(resumed.id, a.id);
    assert.equal((await resumed.refresh()).state, "running", "a paused session's sandbox is resumed");
    assert.deepEqual(worker.sessions().sort(), [`${tag}-a`, `${tag}-b`]);
    await new SessionSandboxes().end(`${tag}-a`);
    assert.deepEqual((await c.sandboxes.list({ metadata: { suite: tag } })).map((s) => s.id), [b.id], "end deleted a's sandbox, from any worker");
    const fresh = await new SessionSandboxes({ metadata: { suite: tag } }).get(`${tag}-a`);
    assert.notEqual(fresh.id, a.id, "an ended session starts afresh");
    await worker.end(`${tag}-a`);
  } finally {
    await worker.end(`${tag}-b`);
    await worker.end(`${tag}-a`).catch(() => undefined);
  }
  assert.deepEqual(await c.sandboxes.list({ metadata: { suite: tag } }), []);
  assert.throws(() => worker.get(""), TypeError);
});

test("the hosted-loop worker example keeps each session in its own sandbox", async () => {
  const script = fileURLToPath(new URL("../examples/session-worker.js", import.meta.url));
  const { stdout } = await promisify(execFile)(process.execPath, [script, "--offline"], { env: process.env, timeout: 120_000 });
  assert.match(stdout, /\[sess-a\] bash: "\/tmp\\na\\na\\n"/, "session a kept its cwd, its variable and its file");
  assert.match(stdout, /\[sess-b\] str_replace_based_edit_tool: ".*1\\tb"/, "session b sees its own file");
  assert.match(stdout, /sessions ended/);
  assert.deepEqual((await c.sandboxes.list({ metadata: { example: "session-worker" } })).map((s) => s.id), [], "the ended sessions' sandboxes are gone");
});
