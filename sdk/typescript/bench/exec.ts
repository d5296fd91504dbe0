// exec(["true"]) on a warm sandbox through the SDK against a raw fetch of the same route
// (p50, p90 of N calls each, interleaved so both see the same machine), and a burst of 100
// parallel execs from one client. Not a test: it prints numbers.
//
//   LOCKER_URL=… LOCKER_API_KEY=… node build/bench/exec.js [N]
import { Client } from "locker-sandbox";

const n = Number(process.argv[2] ?? 200);
const c = new Client();
const sbx = await c.sandboxes.create({ metadata: { bench: "ts-exec" } });
try {
  const url = `${c.url}/v1/sandboxes/${sbx.id}/exec`;
  const headers = { Authorization: `Bearer ${process.env.LOCKER_API_KEY}`, "Content-Type": "application/json" };
  const raw = async () => {
    const res = await fetch(url, { method: "POST", headers, body: JSON.stringify({ cmd: ["true"], cwd: "/workspace" }) });
    const r = (await res.json()) as { exit_code: number };
    if (r.exit_code !== 0) throw new Error("raw exec failed");
  };
  const viaSdk = async () => {
    const r = await sbx.exec(["true"]);
    if (r.exitCode !== 0) throw new Error("sdk exec failed");
  };
  for (let i = 0; i < 20; i++) {
    await raw();
    await viaSdk();
  }
  const times: Record<"sdk" | "fetch", number[]> = { sdk: [], fetch: [] };
  for (let i = 0; i < n; i++) {
    for (const [k, f] of [["fetch", raw], ["sdk", viaSdk]] as const) {
      const t0 = performance.now();
      await f();
      times[k].push(performance.now() - t0);
    }
  }
  const pct = (xs: number[], p: number) => [...xs].sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor(xs.length * p))]!;
  for (const k of ["fetch", "sdk"] as const) {
    console.log(`${k.padEnd(5)} exec(["true"]) n=${n} p50=${pct(times[k], 0.5).toFixed(2)} ms p90=${pct(times[k], 0.9).toFixed(2)} ms`);
  }
  console.log(`sdk - fetch p50: ${(pct(times.sdk, 0.5) - pct(times.fetch, 0.5)).toFixed(2)} ms`);
  const t0 = performance.now();
  const burst = await Promise.all(Array.from({ length: 100 }, () => sbx.exec(["true"])));
  const wall = performance.now() - t0;
  const failed = burst.filter((r) => r.exitCode !== 0).length;
  console.log(`burst of 100 parallel execs: ${wall.toFixed(0)} ms wall, ${failed} failed`);
} finally {
  await sbx.delete();
}
