// The terminal: a program runs on a real tty, typed input reaches it, a resize is seen by
// it, and its exit result arrives; without a WebSocket in the runtime, pty() says so.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { LockerError, type Sandbox } from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();
let sbx: Sandbox;
const hasWebSocket = typeof (globalThis as { WebSocket?: unknown }).WebSocket === "function";

before(async () => {
  sbx = await c.sandboxes.create({ metadata: { suite: unique("pty") } });
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
});

test("a terminal runs a program on a tty, takes input and a resize, and ends with its result", { skip: !hasWebSocket && "no WebSocket here: the next test covers it" }, async () => {
  const pty = await sbx.pty({ cols: 100, rows: 30, cmd: "tty; stty size; read x; stty size; echo got:$x; exit 5" });
  let out = "";
  const dec = new TextDecoder();
  let typed = false;
  for await (const chunk of pty) {
    out += dec.decode(chunk, { stream: true });
    if (!typed && out.includes("30 100")) {
      typed = true;
      pty.resize(120, 40);
      await new Promise((r) => setTimeout(r, 200));
      pty.write("hello\r");
    }
  }
  const r = await pty.exited;
  assert.match(out, /\/dev\/pts\/\d+/);
  assert.match(out, /40 120/);
  assert.match(out, /got:hello/);
  assert.equal(r?.exitCode, 5);
});

test("pty() without a WebSocket in the runtime rejects saying what to use", async () => {
  const saved = (globalThis as { WebSocket?: unknown }).WebSocket;
  (globalThis as { WebSocket?: unknown }).WebSocket = undefined;
  try {
    await assert.rejects(sbx.pty(), (e: unknown) => e instanceof LockerError && /no WebSocket/.test(e.message));
  } finally {
    (globalThis as { WebSocket?: unknown }).WebSocket = saved;
  }
});
