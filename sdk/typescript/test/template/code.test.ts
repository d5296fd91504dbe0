// The code interpreter through the SDK, on a sandbox of the `code-interpreter` template
// (tests/typescript_sdk.rs builds it, then runs this directory apart from the main suite):
// contexts keep state, a chart comes back as a PNG, an exception is a result, streaming
// yields output as it comes, interrupt/restart/delete, and the default context.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { CodeContext, Conflict, NotFound, type Sandbox } from "locker-sandbox";
import { client, unique } from "../helpers.js";

const c = client();
let sbx: Sandbox;

before(async () => {
  sbx = await c.sandboxes.create({ template: "code-interpreter", ttlSeconds: 900, metadata: { suite: unique("code") } });
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
});

test("a context keeps state, returns values, charts as PNG and exceptions as results", async () => {
  const ctx = await sbx.createCodeContext({ language: "python" });
  assert.ok(ctx instanceof CodeContext);
  assert.match(ctx.id, /^ctx_/);
  assert.equal(ctx.language, "python");
  let ex = await ctx.runCode("import math\nx = math.factorial(5)\nprint('x is', x)");
  assert.equal(ex.stdout, "x is 120\n");
  assert.equal(ex.error, null);
  assert.equal(ex.reason, "finished");
  assert.equal(ex.context, ctx.id);
  ex = await ctx.runCode("{'x_plus_one': x + 1}");
  assert.equal(ex.text, "{'x_plus_one': 121}");
  const chart = await ctx.runCode("import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.show()");
  const pngs = chart.results.filter((r) => r.png);
  assert.equal(pngs.length, 1, JSON.stringify(chart.results.map((r) => r.formats())));
  assert.ok(pngs[0]!.formats().includes("png"));
  assert.deepEqual([...pngs[0]!.pngBytes().subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
  assert.throws(() => ex.results[0]!.pngBytes(), /no PNG \(its formats: text/);
  const json = await ctx.runCode("from IPython.display import JSON, display\ndisplay(JSON({'snake_key': [1, 2]}))");
  assert.deepEqual(json.results[0]?.json, { snake_key: [1, 2] }, "a result's JSON keeps its keys");
  const bad = await ctx.runCode("undefined_name");
  assert.equal(bad.error?.name, "NameError");
  assert.equal(bad.reason, "error");
  assert.match(bad.error!.traceback, /undefined_name/);
  const slow = await ctx.runCode("import time\ny = 7\ntime.sleep(30)", { timeoutMs: 1500 });
  assert.equal(slow.reason, "timeout");
  assert.equal((await ctx.runCode("y")).text, "7", "a timed-out cell keeps the context's state");

  // Streamed: callbacks, and the async iterator.
  const streamed: string[] = [];
  ex = await ctx.runCode("print('a', flush=True)\nimport sys; print('e', file=sys.stderr)\nprint('b')", { onStdout: (t) => streamed.push(t) });
  assert.equal(streamed.join(""), "a\nb\n");
  assert.equal(ex.stdout, "a\nb\n");
  assert.equal(ex.stderr, "e\n");
  const events: string[] = [];
  for await (const ev of ctx.runCodeStream("print('one', flush=True)\n6 * 7")) {
    events.push(ev.type === "execution" ? `execution:${ev.execution.text}` : ev.type === "result" ? `result:${ev.result.text}` : `${ev.type}:${"text" in ev ? ev.text : ""}`);
  }
  assert.deepEqual(events, ["stdout:one\n", "result:42", "execution:42"]);
  const raised: string[] = [];
  for await (const ev of ctx.runCodeStream("print('before', flush=True)\n1 / 0")) {
    raised.push(ev.type === "error" ? `error:${ev.error.name}` : ev.type === "execution" ? `execution:${ev.execution.reason}` : ev.type);
  }
  assert.deepEqual(raised, ["stdout", "error:ZeroDivisionError", "execution:error"], "a cell's exception is an event of the stream, not a failure of the call");

  assert.equal(await ctx.interrupt(), false, "no cell was running");
  await ctx.restart();
  assert.equal((await ctx.runCode("'x' in globals()")).text, "False", "restart cleared the state");
  assert.deepEqual((await sbx.codeContexts()).map((k) => k.id), [ctx.id]);
  await ctx.delete();
  await assert.rejects(ctx.runCode("1"), NotFound);
});

test("the default context, an interrupted cell, and `await using` on a context", async () => {
  await sbx.runCode("z = 5");
  assert.equal((await sbx.runCode("z * 2")).text, "10");
  {
    await using ctx = await sbx.createCodeContext();
    // Interrupt once the cell is running (it says so on stdout, streamed as it comes).
    let started!: () => void;
    const running = new Promise<void>((r) => (started = r));
    const cell = ctx.runCode("import time\nprint('started', flush=True)\ntime.sleep(60)", {
      timeoutMs: 120_000,
      onStdout: (t) => t.includes("started") && started(),
    });
    await running;
    assert.equal(await ctx.interrupt(), true, "a cell was running");
    const ex = await cell;
    assert.equal(ex.reason, "interrupted");
    assert.equal(ex.error?.name, "KeyboardInterrupt");
    assert.ok((await sbx.codeContexts()).some((k) => k.id === ctx.id));
  }
  assert.ok(!(await sbx.codeContexts()).some((k) => !k.id.startsWith("ctx_default")), "await using deleted the context");
});

test("a sandbox without a kernel says which template to use", async () => {
  await using plain = await c.sandboxes.create({ workdir: null });
  const e = await plain.runCode("1").catch((x: unknown) => x);
  assert.ok(e instanceof Conflict, String(e));
  assert.match(e.message, /code-interpreter/);
});
