//! Issue 22's client rows: `exec(["true"])` on a warm sandbox through the TypeScript SDK
//! beside a raw `fetch` of the same route from the same Node process (interleaved, so both
//! see the same machine and connection pool), and bursts of 100 parallel execs from one
//! SDK client (the wall time of each burst, and each exec's latency within it).
//!
//! The measuring is `sdk/typescript/bench/exec.ts` (built to `build/bench/exec.js`), run
//! with `--json`; this module starts the server, runs it and turns its samples into rows.
//! It does not install or build the package: without the build the rows are skipped and
//! say what to run.

use std::process::Command;

use anyhow::{bail, Context};
use locker_tests::server::Server;
use serde_json::Value;

use crate::stats::{fmt_num, percentile, Row};
use crate::{check_stop, Args};

const SDK: &str = "TS SDK exec([\"true\"]), warm sandbox (HTTP)";
const FETCH: &str = "raw fetch exec([\"true\"]), same route and process";
const BURST_WALL: &str = "TS SDK burst of 100 parallel execs, wall";
const BURST_EACH: &str = "TS SDK exec within a burst of 100";

fn samples(v: &Value, key: &str) -> anyhow::Result<Vec<f64>> {
    v[key]
        .as_array()
        .with_context(|| format!("no `{key}` in the bench program's output"))?
        .iter()
        .map(|x| x.as_f64().context("a sample that is not a number"))
        .collect()
}

pub fn sdk_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let pkg = locker_tests::root().join("sdk/typescript");
    let script = pkg.join("build/bench/exec.js");
    if !script.is_file() || !pkg.join("dist/index.js").is_file() {
        let why = "the TypeScript SDK is not built: `cd sdk/typescript && npm ci && npm run build && npm run build:test`";
        for name in [SDK, FETCH, BURST_WALL, BURST_EACH] {
            rows.push(Row::skipped(name, why));
        }
        return Ok(());
    }
    check_stop()?;
    let srv = Server::start();
    let n = args.fast();
    let bursts = 5;
    let out = Command::new("node")
        .current_dir(&pkg)
        .arg(&script)
        .arg(n.to_string())
        .args(["--warmup", &args.warmup.max(1).to_string()])
        .args(["--bursts", &bursts.to_string()])
        .arg("--json")
        .env("LOCKER_URL", &srv.url)
        .env("LOCKER_API_KEY", &srv.api_key)
        .env_remove("NODE_OPTIONS")
        .output()
        .context("run node (the TypeScript SDK's bench program)")?;
    if !out.status.success() {
        bail!(
            "node build/bench/exec.js failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.lines().last().unwrap_or(""))
        .with_context(|| format!("the bench program's output is not JSON: {text}"))?;
    let warmup = v["warmup"].as_u64().unwrap_or(0) as usize;
    let sdk = samples(&v, "sdk")?;
    let fetch = samples(&v, "fetch")?;
    let diff = percentile(&sdk, 50.0) - percentile(&fetch, 50.0);
    let node = Command::new("node")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    rows.push(
        Row::new(SDK, "ms", sdk, warmup)
            .note(format!("`sbx.exec([\"true\"])` (locker-sandbox on Node {node}): POST …/exec, JSON result to a typed ExecResult; p50 − raw fetch p50 = {} ms (issue 22: within 1 ms)", fmt_num(diff)))
            .vs(FETCH),
    );
    rows.push(
        Row::new(FETCH, "ms", fetch, warmup)
            .note("`fetch` of the same body the SDK sends (`{\"cmd\":[\"true\"],\"cwd\":\"/workspace\"}`) and `res.json()`, alternating with the SDK's calls"),
    );
    let failed = v["burstFailed"].as_u64().unwrap_or(0);
    rows.push(
        Row::new(BURST_WALL, "ms", samples(&v, "burstWall")?, 0)
            .note(format!("{bursts} bursts of `Promise.all` over 100 `sbx.exec([\"true\"])` on one sandbox from one client; {failed} execs failed")),
    );
    rows.push(
        Row::new(BURST_EACH, "ms", samples(&v, "burstEach")?, 0)
            .note("each exec's own latency within the bursts above (queued behind the others on 2 cores)")
            .vs(SDK),
    );
    drop(srv);
    Ok(())
}
