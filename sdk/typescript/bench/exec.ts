// exec(["true"]) on a warm sandbox through the SDK against a raw fetch of the same route
// (N calls each, interleaved so both see the same machine), and bursts of 100 parallel
// execs from one client. Not a test: it prints numbers (with --json, every sample as one
// JSON object, which `locker-bench --only sdk` reads).
//
//   LOCKER_URL=… LOCKER_API_KEY=… node build/bench/exec.js [N] [--warmup W] [--bursts B] [--json]
import { Client } from "locker-sandbox";

const argv = process.argv.slice(2);
const flag = (name: string, dflt: number) => {
  const i = argv.indexOf(name);
  return i >= 0 ? Number(argv[i + 1]) : dflt;
};
const json = argv.includes("--json");
const n = Number(argv.find((a, i) => /^\d+$/.test(a) && !argv[i - 1]?.startsWith("--")) ?? 200);
const warmup = flag("--warmup", 20);
const bursts = flag("--bursts", 5);
const BURST = 100;

const c = new Client();
const sbx = await c.sandboxes.create({ metadata: { bench: "ts-exec" } });
try {
  const url = `${c.url}/v1/sandboxes/${sbx.id}/exec`;
  const headers = { Authorization: `Bearer ${process.env.LOCKER_API_KEY}`, "Content-Type": "application/json" };
  // The same request the SDK sends (its default cwd included), parsed the same way.
  const raw = async () => {
    const res = await fetch(url, { method: "POST", headers, body: JSON.stringify({ cmd: ["true"], cwd: "/workspace" }) });
    const r = (await res.json()) as { exit_code: number };
    if (r.exit_code !== 0) throw new Error("raw exec failed");
  };
  const viaSdk = async () => {
    const r = await sbx.exec(["true"]);
    if (r.exitCode !== 0) throw new Error("sdk exec failed");
  };
  for (let i = 0; i < warmup; i++) {
    await raw();
    await viaSdk();
  }
  const times: Record<"sdk" | "fetch", number[]> = { sdk: [], fetch: [] };
  for (let i = 0; i < n; i++) {
    // Alternate which goes first, so neither always follows the other.
    const order = i % 2 ? ([["fetch", raw], ["sdk", viaSdk]] as const) : ([["sdk", viaSdk], ["fetch", raw]] as const);
    for (const [k, f] of order) {
      const t0 = performance.now();
      await f();
      times[k].push(performance.now() - t0);
    }
  }
  // Bursts: the wall time of 100 execs started at once, and each exec's own latency.
  const burstWall: number[] = [];
  const burstEach: number[] = [];
  let burstFailed = 0;
  for (let b = 0; b < bursts; b++) {
    const t0 = performance.now();
    const each = await Promise.all(
      Array.from({ length: BURST }, async () => {
        const s = performance.now();
        const r = await sbx.exec(["true"]);
        if (r.exitCode !== 0) burstFailed++;
        return performance.now() - s;
      }),
    );
    burstWall.push(performance.now() - t0);
    burstEach.push(...each);
  }
  if (json) {
    console.log(JSON.stringify({ warmup, sdk: times.sdk, fetch: times.fetch, burst: BURST, burstWall, burstEach, burstFailed }));
  } else {
    const pct = (xs: number[], p: number) => [...xs].sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor(xs.length * p))]!;
    for (const k of ["fetch", "sdk"] as const) {
      console.log(`${k.padEnd(5)} exec(["true"]) n=${n} p50=${pct(times[k], 0.5).toFixed(2)} ms p99=${pct(times[k], 0.99).toFixed(2)} ms`);
    }
    console.log(`sdk - fetch p50: ${(pct(times.sdk, 0.5) - pct(times.fetch, 0.5)).toFixed(2)} ms`);
    console.log(
      `bursts of ${BURST} parallel execs: wall p50 ${pct(burstWall, 0.5).toFixed(0)} ms, each exec p50 ${pct(burstEach, 0.5).toFixed(1)} ms p99 ${pct(burstEach, 0.99).toFixed(1)} ms, ${burstFailed} failed`,
    );
  }
} finally {
  await sbx.delete();
}
