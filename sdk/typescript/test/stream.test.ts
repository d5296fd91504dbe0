// Streaming exec (NDJSON) and cancellation: output arrives before the command ends, the
// result comes last, and aborting the signal (or leaving the loop) closes the stream,
// which kills the command in the sandbox.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import type { Sandbox, StreamEvent } from "locker-sandbox";
import { client, unique, waitFor } from "./helpers.js";

const c = client();
let sbx: Sandbox;

before(async () => {
  sbx = await c.sandboxes.create({ metadata: { suite: unique("stream") } });
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
});

/** A sleep duration no other command uses: its command line marks it. */
function sleepFor(): string {
  return `1200.${Math.floor(Math.random() * 1e6)}`;
}

/** Whether a process whose command line contains `marker` runs in the sandbox. */
async function running(marker: string): Promise<boolean> {
  const r = await sbx.exec(["sh", "-c", `ps -eo args | grep -v grep | grep -c -- '${marker}' || true`]);
  return r.stdout.trim() !== "0";
}

test("execStream yields output as it arrives and the result last", async () => {
  const t0 = Date.now();
  const seen: { ev: StreamEvent; at: number }[] = [];
  for await (const ev of sbx.execStream(["sh", "-c", "echo one; echo two >&2; sleep 1.5; echo three"])) {
    seen.push({ ev, at: Date.now() - t0 });
  }
  const last = seen.at(-1)!.ev;
  assert.equal(last.type, "result");
  assert.equal(last.type === "result" && last.result.exitCode, 0);
  assert.equal(last.type === "result" && last.result.stdout, "one\nthree\n");
  const first = seen.find((s) => s.ev.type === "stdout")!;
  assert.equal(first.ev.type === "stdout" && first.ev.data, "one\n");
  assert.ok(first.at < seen.at(-1)!.at - 1000, `the first chunk came before the sleep ended: ${JSON.stringify(seen.map((s) => s.at))}`);
  assert.ok(seen.some((s) => s.ev.type === "stderr" && s.ev.data === "two\n"));
});

test("binary chunks keep their exact bytes", async () => {
  const chunks: Uint8Array[] = [];
  for await (const ev of sbx.execStream(["printf", "\\377\\000\\001"])) {
    if (ev.type === "stdout") chunks.push(ev.bytes());
  }
  assert.deepEqual(Array.from(Buffer.concat(chunks)), [255, 0, 1]);
});

test("aborting the signal kills the command", async () => {
  const marker = sleepFor();
  const ac = new AbortController();
  const events: string[] = [];
  await assert.rejects(
    (async () => {
      for await (const ev of sbx.execStream(["sh", "-c", `echo started; exec sleep ${marker}`], { signal: ac.signal })) {
        events.push(ev.type);
        if (ev.type === "stdout") {
          await waitFor("the command to run", () => running(marker));
          ac.abort();
        }
      }
    })(),
    (e: unknown) => e instanceof Error && e.name === "AbortError",
  );
  assert.deepEqual(events, ["stdout"]);
  await waitFor("the aborted command to be killed", async () => !(await running(marker)));
});

test("leaving the loop early kills the command", async () => {
  const marker = sleepFor();
  for await (const ev of sbx.execStream(["sh", "-c", `echo started; exec sleep ${marker}`])) {
    assert.equal(ev.type, "stdout");
    await waitFor("the command to run", () => running(marker));
    break;
  }
  await waitFor("the abandoned command to be killed", async () => !(await running(marker)));
});

test("aborting a whole (not streamed) exec kills the command too", async () => {
  const marker = sleepFor();
  const ac = new AbortController();
  const call = sbx.exec(["sleep", marker], { signal: ac.signal });
  await waitFor("the command to run", () => running(marker));
  ac.abort();
  await assert.rejects(call, (e: unknown) => e instanceof Error && e.name === "AbortError");
  await waitFor("the aborted command to be killed", async () => !(await running(marker)));
});
