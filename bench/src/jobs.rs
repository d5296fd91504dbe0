//! Issue 17's job row: a process an exec leaves running costs that exec nothing. HTTP exec
//! of `sh -c 'sleep 100 & echo ok'` beside `sh -c 'echo ok'` and `echo ok`, interleaved in
//! one warm jail, so the three rows share the host's weather.
//!
//! Owns the server and sandbox it starts (the tests' [`Server`] guard deletes them). The
//! sleeps it leaves are the point of the row; every 50 rounds an untimed exec kills them, so
//! the machine's pids limit is never the thing measured.

use std::time::Instant;

use anyhow::{bail, Context};
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

use crate::server::{create, delete};
use crate::stats::{fmt_num, percentile, Row, Target};
use crate::{check_stop, Args};

const ECHO: &str = "jobs HTTP exec echo ok";
const SH_ECHO: &str = "jobs HTTP exec sh -c 'echo ok'";
const SH_JOB: &str = "jobs HTTP exec sh -c 'sleep 100 & echo ok'";

/// Kills the `sleep`s earlier rounds left (no pkill in every template: /proc by hand).
const KILL_SLEEPS: &str =
    "for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = sleep ] && kill ${p#/proc/}; done; true";
/// Counts the `sleep`s alive in the machine.
const COUNT_SLEEPS: &str =
    "n=0; for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = sleep ] && n=$((n+1)); done; echo $n";

/// Runs `body` in `id`; checks it printed `ok`; returns the server's `timings.total_ms`.
fn exec(api: &Api, id: &str, body: &Value) -> anyhow::Result<(f64, String)> {
    let r = api
        .try_request(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
        .with_context(|| format!("POST /v1/sandboxes/{id}/exec {body}"))?;
    if r.status != 200 {
        bail!("exec {body} in {id}: HTTP {}: {}", r.status, r.text());
    }
    let v: Value = serde_json::from_slice(&r.body).context("exec: not JSON")?;
    if v["exit_code"] != 0 {
        bail!("exec {body} in {id} did not exit 0: {v}");
    }
    Ok((
        v["timings"]["total_ms"].as_f64().unwrap_or(f64::NAN),
        v["stdout"].as_str().unwrap_or("").to_owned(),
    ))
}

pub fn job_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let srv = Server::start();
    let api = srv.api();
    let id = create(&api)?;
    let bodies = [
        json!({"cmd": ["echo", "ok"]}),
        json!({"cmd": ["sh", "-c", "echo ok"]}),
        json!({"cmd": ["sh", "-c", "sleep 100 & echo ok"]}),
    ];
    // The row means something only if the job outlives its exec here.
    exec(&api, &id, &bodies[2])?;
    let (_, alive) = exec(&api, &id, &json!({"shell": COUNT_SLEEPS}))?;
    if alive.trim().parse::<u32>().unwrap_or(0) == 0 {
        bail!("`sleep 100 &` did not outlive its exec in {id}: this build kills an exec's jobs, so the jobs row would not measure a job");
    }
    exec(&api, &id, &json!({"shell": KILL_SLEEPS}))?;

    let (warm, n) = (args.warmup, args.fast());
    let mut lat: [Vec<f64>; 3] = Default::default();
    let mut server: [Vec<f64>; 3] = Default::default();
    for i in 0..warm + n {
        check_stop()?;
        // Each round starts with another command, so none is always first after the gap.
        for k in (0..3).map(|j| (i + j) % 3) {
            let body = &bodies[k];
            let t0 = Instant::now();
            let (total_ms, out) = exec(&api, &id, body)?;
            let t = t0.elapsed().as_secs_f64() * 1e3;
            if out != "ok\n" {
                bail!("exec {body} printed {out:?}, not \"ok\\n\"");
            }
            if i >= warm {
                lat[k].push(t);
                server[k].push(total_ms);
            }
        }
        if i % 50 == 49 {
            exec(&api, &id, &json!({"shell": KILL_SLEEPS}))?;
        }
    }
    delete(&api, &id)?;

    let pct: Vec<[f64; 2]> = lat
        .iter()
        .map(|l| [percentile(l, 50.0), percentile(l, 99.0)])
        .collect();
    let p = |k: usize, q: f64| pct[k][usize::from(q > 50.0)];
    println!(
        "  echo ok p50 {:.2} p99 {:.2}; sh -c echo p50 {:.2} p99 {:.2}; sh -c 'sleep 100 & echo ok' p50 {:.2} p99 {:.2} ms",
        p(0, 50.0), p(0, 99.0), p(1, 50.0), p(1, 99.0), p(2, 50.0), p(2, 99.0)
    );
    let client = "POST /v1/sandboxes/{id}/exec, JSON answer, the tests' ureq agent (a connection per request), one warm jail; the three commands interleaved round by round, each round starting with the next one";
    let names = [ECHO, SH_ECHO, SH_JOB];
    for k in 0..3 {
        let mut row = Row::new(names[k], "ms", std::mem::take(&mut lat[k]), warm)
            .note(client)
            .note(format!(
                "the server's own timings.total_ms p50 {} ms",
                fmt_num(percentile(&server[k], 50.0))
            ));
        if k == 2 {
            row = row
                .note("each round leaves a `sleep 100` running (checked once before the rounds); an untimed exec kills them every 50 rounds")
                .vs(ECHO)
                .vs(SH_ECHO);
        }
        if k == 1 {
            row = row.vs(ECHO);
        }
        rows.push(row);
    }
    rows.push(
        Row::new("jobs added by the left job (p50 job − p50 echo ok)", "ms", vec![p(2, 50.0) - p(0, 50.0)], 0)
            .note(format!(
                "p50 of {SH_JOB} minus p50 of {ECHO} (the issue's comparison; the shell's own start is in it); minus p50 of {SH_ECHO} instead: {} ms; at p99 {} ms and {} ms",
                fmt_num(p(2, 50.0) - p(1, 50.0)),
                fmt_num(p(2, 99.0) - p(0, 99.0)),
                fmt_num(p(2, 99.0) - p(1, 99.0))
            ))
            .target(Target::P50(1.0)),
    );
    Ok(())
}
