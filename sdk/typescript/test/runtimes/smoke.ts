// The SDK under another runtime (Bun, Deno; Node as the control): a program, not a node:test
// file, that uses nothing but the web platform and the built package, so the same file runs
// under each. It checks a real subset against the server of LOCKER_URL/LOCKER_API_KEY:
// create, exec's typed result and a timeout as a result, streaming and its cancellation
// (the command is killed), files as text and bytes with list/stat/move/remove, `await
// using` disposal, typed errors. Prints one TAP line per check and exits 1 if any failed.
//
//   bun build/test/runtimes/smoke.js
//   deno run --allow-net --allow-env --allow-read build/test/runtimes/smoke.js
//   node build/test/runtimes/smoke.js
import type * as Sdk from "locker-sandbox";

// The built package by its path: every runtime resolves a file URL the same way.
const sdk = (await import(new URL("../../../dist/index.js", import.meta.url).href)) as typeof Sdk;

const g = globalThis as unknown as {
  Bun?: { version: string };
  Deno?: { version: { deno: string }; exit(code: number): never };
  process?: { versions?: { node?: string }; exit(code: number): never };
};
const runtime = g.Bun ? `bun ${g.Bun.version}` : g.Deno ? `deno ${g.Deno.version.deno}` : `node ${g.process?.versions?.node}`;

function check(ok: unknown, what: string): asserts ok {
  if (!ok) throw new Error(what);
}
function equal<T>(got: T, want: T, what: string): void {
  check(JSON.stringify(got) === JSON.stringify(want), `${what}: got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`);
}
async function rejects(p: Promise<unknown>, test: (e: unknown) => boolean, what: string): Promise<void> {
  try {
    await p;
  } catch (e) {
    check(test(e), `${what}: threw ${String(e)}`);
    return;
  }
  throw new Error(`${what}: did not throw`);
}
async function waitFor(what: string, f: () => Promise<boolean>, ms = 15_000): Promise<void> {
  const end = Date.now() + ms;
  while (!(await f())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

// The client reads LOCKER_URL and LOCKER_API_KEY itself (through `process.env`, which
// Bun and Deno also have).
const c = new sdk.Client();
const tag = `smoke-${Date.now().toString(36)}`;
const checks: [string, (sbx: Sdk.Sandbox) => Promise<void>][] = [
  [
    "exec returns the typed result; a failing command is a result",
    async (sbx) => {
      const r = await sbx.exec(["sh", "-c", "echo out; echo err >&2; exit 3"]);
      equal([r.exitCode, r.stdout, r.stderr, r.ok, r.timedOut], [3, "out\n", "err\n", false, false], "result");
      equal((await sbx.exec(["pwd"])).stdout, "/workspace\n", "default cwd");
      equal((await sbx.exec(["cat"], { stdin: "in" })).stdout, "in", "stdin");
    },
  ],
  [
    "a timeout is timedOut with the output so far",
    async (sbx) => {
      const t0 = Date.now();
      const r = await sbx.exec(["sh", "-c", "echo before; sleep 30"], { timeoutMs: 700 });
      equal([r.timedOut, r.exitCode, r.stdout], [true, null, "before\n"], "timed out");
      check(Date.now() - t0 < 20_000, "killed at its timeout");
    },
  ],
  [
    "execStream yields output before the end and the result last",
    async (sbx) => {
      const types: string[] = [];
      let result: Sdk.ExecResult | undefined;
      for await (const ev of sbx.execStream(["sh", "-c", "echo one; sleep 0.5; echo two"])) {
        types.push(ev.type);
        if (ev.type === "result") result = ev.result;
      }
      equal(types, ["stdout", "stdout", "result"], "events");
      equal(result?.stdout, "one\ntwo\n", "result");
    },
  ],
  [
    "aborting a stream kills the command",
    async (sbx) => {
      const marker = `1200.${Math.floor(Math.random() * 1e6)}`;
      const running = async () =>
        (await sbx.exec(["sh", "-c", `ps -eo args | grep -v grep | grep -c -- '${marker}' || true`])).stdout.trim() !== "0";
      const ac = new AbortController();
      await rejects(
        (async () => {
          for await (const ev of sbx.execStream(["sh", "-c", `echo started; exec sleep ${marker}`], { signal: ac.signal })) {
            if (ev.type === "stdout") {
              await waitFor("the command to run", running);
              ac.abort();
            }
          }
        })(),
        (e) => e instanceof Error && e.name === "AbortError",
        "the aborted loop",
      );
      await waitFor("the command to be killed", async () => !(await running()));
    },
  ],
  [
    "files as text and bytes; list, stat, move, remove",
    async (sbx) => {
      await sbx.files.write("/workspace/d/a.txt", "hello\n");
      equal(await sbx.files.readText("/workspace/d/a.txt"), "hello\n", "text");
      const bytes = new Uint8Array([0, 255, 1, 254]);
      await sbx.files.write("/workspace/d/b.bin", bytes);
      equal(Array.from(await sbx.files.read("/workspace/d/b.bin")), [0, 255, 1, 254], "bytes");
      equal((await sbx.files.list("/workspace/d")).map((e) => e.name).sort(), ["a.txt", "b.bin"], "list");
      equal((await sbx.files.stat("/workspace/d/a.txt")).size, 6, "stat");
      await sbx.files.move("/workspace/d/a.txt", "/workspace/d/c.txt");
      await sbx.files.remove("/workspace/d/b.bin");
      equal((await sbx.files.list("/workspace/d")).map((e) => e.name), ["c.txt"], "after move and remove");
    },
  ],
  [
    "typed errors carry the server's code and message",
    async () => {
      await rejects(
        c.sandboxes.get("sb_doesnotexist"),
        (e) => e instanceof sdk.NotFound && e.status === 404 && e.code === "not_found" && e.message.length > 0,
        "an unknown sandbox",
      );
      await rejects(c.sandboxes.create({ cpus: 1000 }), (e) => e instanceof sdk.LockerError && e.status >= 400 && e.status < 500, "a bad create");
      const down = new sdk.Client({ url: "http://127.0.0.1:1", apiKey: "x" });
      await rejects(down.health(), (e) => e instanceof sdk.ConnectionError && e.code === "unreachable", "no server");
    },
  ],
];

let failed = 0;
let n = 0;
let id = "";
console.log(`# ${runtime}`);
try {
  {
    await using sbx = await c.sandboxes.create({ metadata: { suite: tag }, network: { internet: false } });
    id = sbx.id;
    for (const [name, f] of checks) {
      n++;
      try {
        await f(sbx);
        console.log(`ok ${n} - ${name}`);
      } catch (e) {
        failed++;
        console.log(`not ok ${n} - ${name}\n# ${String(e instanceof Error ? e.stack ?? e.message : e).replace(/\n/g, "\n# ")}`);
      }
    }
  }
  n++;
  try {
    await rejects(c.sandboxes.get(id), (e) => e instanceof sdk.NotFound, "the sandbox after its scope");
    console.log(`ok ${n} - await using deleted the sandbox`);
  } catch (e) {
    failed++;
    console.log(`not ok ${n} - await using deleted the sandbox\n# ${String(e)}`);
  }
} catch (e) {
  failed++;
  console.log(`not ok ${n + 1} - the run stopped: ${String(e instanceof Error ? e.stack : e)}`);
}
console.log(`1..${n}\n# pass ${n - failed}\n# fail ${failed}`);
if (g.Deno) g.Deno.exit(failed ? 1 : 0);
else g.process!.exit(failed ? 1 : 0);
