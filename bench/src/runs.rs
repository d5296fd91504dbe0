//! Serverless runs on a volume (`POST /v1/volumes/{id}/run`): a fresh machine per call
//! that sees the volume, runs one command and is destroyed; beside a fresh `bwrap` per call
//! with a writable bind of a directory, doing the same.
//!
//! The route is detected at run time: a server without it answers 404 `no such route`, and
//! the rows are then skipped with that reason. Owns its server (the tests' [`Server`] guard
//! deletes the volume and kills the server on drop) and a temporary directory.

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use locker_tests::server::{Api, Resp, Server};
use locker_tests::{default_rootfs, TempDir};
use serde_json::{json, Value};

use crate::jail::bwrap;
use crate::scale::{all_at_once, bwrap_argv, spawn_wait};
use crate::server::HTTP_CREATE_EXEC;
use crate::stats::{percentile, Row, Target};
use crate::{check_stop, stopping, Args};

const WAIT: &str = "run: wait before the command starts";
pub(crate) const TOTAL: &str = "run true: whole call (HTTP)";
const WAIT_COLD: &str = "run: wait before the command starts (--warm-pool 0)";
const TOTAL_COLD: &str = "run true: whole call (HTTP, --warm-pool 0)";
const PEER: &str = "peer bwrap per call true (writable bind)";
const PEER_BURST: &str = "peer bwrap per call true (writable bind, burst)";
const CPU: &str = "run true: host CPU per call, one at a time";
const PEER_CPU: &str = "peer bwrap: host CPU per call, one at a time";

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn run_true(api: &Api, vol: &str) -> Result<Resp, String> {
    api.try_request(
        "POST",
        &format!("/v1/volumes/{vol}/run"),
        &[("Content-Type", "application/json")],
        &br#"{"cmd":["true"]}"#[..],
    )
    .map_err(|e| format!("POST /v1/volumes/{vol}/run: {e}"))
}

/// (client wall ms, server queue_ms + start_ms, server total_ms) of one run of `true`.
fn timed_run(api: &Api, vol: &str) -> Result<(f64, f64, f64), String> {
    let t0 = Instant::now();
    let r = run_true(api, vol)?;
    let wall = ms(t0);
    if r.status != 200 {
        return Err(format!("run: HTTP {}: {}", r.status, r.text()));
    }
    let v: Value = serde_json::from_slice(&r.body)
        .map_err(|e| format!("run: not JSON ({e}): {}", r.text()))?;
    if v["exit_code"] != 0 {
        return Err(format!("`true` in a run did not exit 0: {v}"));
    }
    let t = &v["timings"];
    let f = |k: &str| t[k].as_f64().unwrap_or(f64::NAN);
    Ok((wall, f("queue_ms") + f("start_ms"), f("total_ms")))
}

fn skip_all(rows: &mut Vec<Row>, n: usize, why: &str) {
    for name in [
        WAIT.to_owned(),
        TOTAL.to_owned(),
        CPU.to_owned(),
        format!("run true ({n} at once, HTTP)"),
        WAIT_COLD.to_owned(),
        TOTAL_COLD.to_owned(),
    ] {
        rows.push(Row::skipped(name, why));
    }
}

/// Whether `locker serve` takes `flag` (an older binary would refuse to start with it).
fn serve_takes(flag: &str) -> bool {
    // Through a link not named `locker`: see [`crate::jail::locker_alias`].
    let tmp = TempDir::new("locker-bench-help");
    let Ok(cli) = crate::jail::locker_alias(tmp.path()) else {
        return false;
    };
    Command::new(cli)
        .args(["serve", "--help"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(flag))
        .unwrap_or(false)
}

fn start(n_burst: usize, extra: &[&str]) -> Server {
    let mut q = crate::scale::big_quotas(n_burst);
    q.extend(extra.iter().map(|s| s.to_string()));
    let q: Vec<&str> = q.iter().map(String::as_str).collect();
    Server::start_with(&q)
}

/// A volume on `api`'s server and one probe run of `true` in it: the volume's id, or why
/// runs cannot be measured on this server (no route, no volumes).
fn volume_and_probe(api: &Api) -> anyhow::Result<Result<String, String>> {
    let r = api
        .try_request(
            "POST",
            "/v1/volumes",
            &[("Content-Type", "application/json")],
            serde_json::to_vec(&json!({"name": "bench"}))?.as_slice(),
        )
        .context("POST /v1/volumes")?;
    if r.status != 201 {
        return Ok(Err(format!(
            "this server cannot create a volume: POST /v1/volumes answered HTTP {}: {}",
            r.status,
            r.text().trim()
        )));
    }
    let vol = serde_json::from_slice::<Value>(&r.body)?["id"]
        .as_str()
        .context("volume: no id")?
        .to_owned();
    let probe = run_true(api, &vol).map_err(anyhow::Error::msg)?;
    if probe.status == 404 && probe.text().contains("no such route") {
        return Ok(Err(format!(
            "this server has no POST /v1/volumes/{{id}}/run yet (HTTP 404: {})",
            probe.text().trim()
        )));
    }
    if probe.status != 200 {
        bail!(
            "a run of `true` failed: HTTP {}: {}",
            probe.status,
            probe.text()
        );
    }
    Ok(Ok(vol))
}

/// Runs of `true` one at a time, after the probe.
struct Sequential {
    /// Warm-up runs, the probe included.
    warm: usize,
    /// Client wall ms.
    total: Vec<f64>,
    /// The server's queue_ms + start_ms.
    wait: Vec<f64>,
    /// The server's total_ms.
    server_total: Vec<f64>,
    /// The host's busy CPU per run over the measured runs, all processes (the server, the
    /// machines, the kernel's workers, the client), in ms.
    cpu_ms: f64,
}

fn one_at_a_time(args: &Args, api: &Api, vol: &str) -> anyhow::Result<Sequential> {
    let (n, more_warm) = (args.creates(), args.create_warmup().saturating_sub(1));
    let (mut wait, mut total, mut server_total) = (vec![], vec![], vec![]);
    let mut busy_from = 0.0;
    for i in 0..more_warm + n {
        check_stop()?;
        if i == more_warm {
            busy_from = crate::host::host_busy_ms();
        }
        let (w, s, t) = timed_run(api, vol).map_err(anyhow::Error::msg)?;
        if i >= more_warm {
            total.push(w);
            wait.push(s);
            server_total.push(t);
        }
    }
    // Each run leaves its machine's teardown and the pool's refill behind it: the last
    // one's are left out, the first one's predecessor's counted (one run's worth).
    let cpu_ms = (crate::host::host_busy_ms() - busy_from) / n.max(1) as f64;
    Ok(Sequential {
        warm: more_warm + 1,
        total,
        wait,
        server_total,
        cpu_ms,
    })
}

pub fn run_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let n_burst = args.burst.max(1);
    let pool = serve_takes("--warm-pool");
    let srv = start(n_burst, &[]);
    let api = srv.api();
    let vol = match volume_and_probe(&api)? {
        Ok(v) => v,
        Err(why) => {
            println!("  skipped: {why}");
            skip_all(rows, n_burst, &why);
            return peers(args, n_burst, rows);
        }
    };
    let Sequential {
        warm,
        total,
        wait,
        server_total,
        cpu_ms,
    } = one_at_a_time(args, &api, &vol)?;
    println!(
        "  {TOTAL}: p50 {:.2} ms (wait before the command p50 {:.2} ms)",
        percentile(&total, 50.0),
        percentile(&wait, 50.0)
    );
    check_stop()?;

    // All at once.
    let (url, key, v) = (srv.url.clone(), srv.api_key.clone(), vol.clone());
    let (outcomes, wall) = all_at_once(n_burst, move |_| {
        if stopping() {
            return Err("interrupted".to_owned());
        }
        let api = Api::new(&url, Some(&key));
        timed_run(&api, &v).map(|(w, _, _)| w)
    });
    let ok: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.as_ref().ok().copied())
        .collect();
    let errs: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    println!(
        "  run true, {n_burst} at once: {} complete, {} errors, p99 {:.1} ms, all done in {wall:.0} ms",
        ok.len(),
        errs.len(),
        percentile(&ok, 99.0)
    );
    drop(srv);
    check_stop()?;

    let pool_note = if pool {
        "the server's default warm pool (--warm-pool 2: ready machines of the default shape, the run's volume layer mounted into one; refilled in the background), so a run finds a ready machine unless the refill lags behind"
    } else {
        "this server has no warm pool: a fresh jail per run"
    };
    rows.push(
        Row::new(WAIT, "ms", wait, warm)
            .note("the server's timings.queue_ms + timings.start_ms of a run of `true`, one at a time: from the request's arrival until the command's process started (the volume's copy-on-write view, a machine with the volume's overlay at /workspace, the agent's start of the command)")
            .note(pool_note)
            .target(Target::P50(10.0)),
    );
    let total_len = total.len();
    rows.push(
        Row::new(TOTAL, "ms", total, warm)
            .note(format!("POST /v1/volumes/{{id}}/run {{\"cmd\":[\"true\"]}} until answered, one at a time: machine, `true`, machine torn down, changes listed and committed (none); the server's own timings.total_ms p50 {:.2} ms", percentile(&server_total, 50.0)))
            .note(pool_note)
            .target(Target::P50(20.0))
            .vs(PEER)
            .vs(HTTP_CREATE_EXEC),
    );
    rows.push(
        Row::new(CPU, "ms", vec![cpu_ms], 0)
            .note(format!("the host's busy CPU time (/proc/stat, every process and kernel worker) over the {} runs of the row above, divided by their number: the run, its machine's teardown, the warm pool's refill; one at a time, the runs are bound by it once it exceeds a core's worth of the call", total_len))
            .vs(PEER_CPU),
    );
    let mut r = Row::new(format!("run true ({n_burst} at once, HTTP)"), "ms", ok, 0)
        .note(format!("{n_burst} threads released together, one HTTP client each, one run of `true` each on the same volume; {} of {n_burst} complete, {} errors; all done in {wall:.0} ms; server started with {} (the warm pool holds only a few, the rest start fresh; runs that wait for a view of the volume together share one)", n_burst - errs.len(), errs.len(), crate::scale::big_quotas(n_burst).join(" ")))
        .vs(PEER_BURST);
    if n_burst == 100 {
        // Issue 4: 100 concurrent runs of `true` all complete, p99 <= 1 s on 2 cores.
        r = r.target(Target::P99(1000.0));
    }
    if !errs.is_empty() {
        let first: Vec<&str> = errs.iter().take(3).map(|s| s.as_str()).collect();
        r = r.note(format!("first errors: {}", first.join(" | ")));
    }
    rows.push(r);

    // The same one at a time without the warm pool: a fresh jail per run.
    if pool {
        let srv = start(n_burst, &["--warm-pool", "0"]);
        let api = srv.api();
        match volume_and_probe(&api)? {
            Ok(vol) => {
                let Sequential {
                    warm, total, wait, ..
                } = one_at_a_time(args, &api, &vol)?;
                println!(
                    "  {TOTAL_COLD}: p50 {:.2} ms (wait p50 {:.2} ms)",
                    percentile(&total, 50.0),
                    percentile(&wait, 50.0)
                );
                rows.push(Row::new(WAIT_COLD, "ms", wait, warm).note("as the row without --warm-pool 0, on a server started with --warm-pool 0: each run starts a fresh jail with the volume's overlay").vs(WAIT));
                rows.push(Row::new(TOTAL_COLD, "ms", total, warm).note("as the row without --warm-pool 0, on a server started with --warm-pool 0").vs(TOTAL).vs(PEER));
            }
            Err(why) => {
                rows.push(Row::skipped(WAIT_COLD, &why));
                rows.push(Row::skipped(TOTAL_COLD, why));
            }
        }
    } else {
        let why = "this server has no --warm-pool: the rows above are already a fresh jail per run";
        rows.push(Row::skipped(WAIT_COLD, why));
        rows.push(Row::skipped(TOTAL_COLD, why));
    }
    peers(args, n_burst, rows)
}

/// A fresh `bwrap` per call with a writable bind of a directory, one at a time and all at
/// once.
fn peers(args: &Args, n_burst: usize, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let b = match bwrap() {
        Ok(b) => b,
        Err(e) => {
            rows.push(Row::skipped(PEER, e.clone()));
            rows.push(Row::skipped(PEER_CPU, e.clone()));
            rows.push(Row::skipped(PEER_BURST, e));
            return Ok(());
        }
    };
    let tmp = TempDir::new("locker-bench-bwrap-vol");
    let dir = tmp
        .path()
        .to_str()
        .context("temp dir not UTF-8")?
        .to_owned();
    let root = default_rootfs();
    let root = root
        .to_str()
        .context("the template path is not UTF-8")?
        .to_owned();
    // /mnt: the template is bound read-only, so the mount point must exist in it.
    let argv = bwrap_argv(
        &root,
        &["--bind", &dir, "/mnt", "--chdir", "/mnt"],
        &["true"],
    );
    let (warm, n) = (args.create_warmup(), args.creates());
    let mut s = vec![];
    let mut busy_from = 0.0;
    for i in 0..warm + n {
        check_stop()?;
        if i == warm {
            busy_from = crate::host::host_busy_ms();
        }
        let t = spawn_wait(&b, &argv).map_err(anyhow::Error::msg)?;
        if i >= warm {
            s.push(t);
        }
    }
    let peer_cpu = (crate::host::host_busy_ms() - busy_from) / n.max(1) as f64;
    println!(
        "  {PEER}: p50 {:.2} ms, host CPU {peer_cpu:.2} ms per call",
        percentile(&s, 50.0)
    );
    rows.push(Row::new(PEER_CPU, "ms", vec![peer_cpu], 0).note(format!(
        "the host's busy CPU time over the {n} calls of the row below, divided by their number (namespaces made and torn down, the kernel's workers included)"
    )));
    rows.push(Row::new(PEER, "ms", s, warm).note(format!(
        "bwrap --unshare-all --die-with-parent --ro-bind <default template> / --proc /proc --dev /dev --bind {dir} /mnt --chdir /mnt true, one at a time: namespaces and a writable directory; no cgroup, no disk, no agent, no snapshot or commit of changes"
    )));
    check_stop()?;
    let (outcomes, wall) = all_at_once(n_burst, move |_| spawn_wait(&b, &argv));
    let ok: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.as_ref().ok().copied())
        .collect();
    let errs = outcomes.len() - ok.len();
    println!(
        "  {PEER_BURST}: p99 {:.1} ms, all done in {wall:.0} ms, {errs} errors",
        percentile(&ok, 99.0)
    );
    rows.push(Row::new(PEER_BURST, "ms", ok, 0).note(format!(
        "the same bwrap, {n_burst} at once (threads released together); all done in {wall:.0} ms; {errs} errors"
    )));
    drop(tmp);
    Ok(())
}
