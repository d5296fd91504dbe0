// Seed 002's example (examples/seed002.ts), verbatim but for the import, run as a program.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { NotFound } from "locker-sandbox";
import { client } from "./helpers.js";

test("seed 002's example prints the tool's typed result and deletes its sandbox", async () => {
  const c = client();
  const before = new Set((await c.calls({ limit: 1000 })).map((r) => r.id));
  const script = fileURLToPath(new URL("../examples/seed002.js", import.meta.url));
  const { stdout } = await promisify(execFile)(process.execPath, [script], { env: process.env, timeout: 120_000 });
  assert.match(stdout, /exitCode: 0/);
  assert.match(stdout, /stdout: '45\\n'/);
  assert.match(stdout, /stderr: ''/);
  assert.match(stdout, /timedOut: false/);
  const mine = (await c.calls({ limit: 1000 })).filter(
    (r) => !before.has(r.id) && JSON.stringify(r.command) === JSON.stringify(["python3", "cell.py"]),
  );
  assert.equal(mine.length, 1, "the example's exec is recorded once");
  assert.equal(mine[0]!.cwd, "/workspace");
  await assert.rejects(c.sandboxes.get(String(mine[0]!.sandboxId)), NotFound, "await using deleted the example's sandbox");
});
