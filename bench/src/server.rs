//! The HTTP server measured from outside: a real `locker serve` (the release binary) on a
//! free port with a temporary data dir, driven over HTTP and through the `locker` CLI.
//!
//! Owns the servers it starts, through the tests' [`Server`] guard: on drop it deletes every
//! sandbox through the API, kills the server and destroys whatever machine is left.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use locker_tests::server::{rss_kib, Api, Server};
use serde_json::Value;

use crate::jail::{CREATE_TRUE, EXEC_TRUE};
use crate::stats::{percentile, tail_note, Row, Target};
use crate::{check_stop, stopping, Args};

pub const HTTP_EXEC: &str = "server HTTP exec true (warm)";
pub const HTTP_EXEC_PAUSED: &str = "server HTTP exec true (warm, after a 100 ms pause)";
pub const HTTP_CREATE_EXEC: &str = "server HTTP create→exec true";
const TRUE_BODY: &[u8] = br#"{"cmd":["true"]}"#;

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Runs `true` in sandbox `id`; returns the server's own `timings.total_ms` and the agent's
/// `timings.start_ms` (cgroup + fork/exec inside the machine).
pub(crate) fn http_exec(api: &Api, id: &str) -> anyhow::Result<(f64, f64)> {
    let r = api
        .try_request(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            &[("Content-Type", "application/json")],
            TRUE_BODY,
        )
        .with_context(|| format!("POST /v1/sandboxes/{id}/exec"))?;
    if r.status != 200 {
        bail!("exec in {id}: HTTP {}: {}", r.status, r.text());
    }
    let v: Value = serde_json::from_slice(&r.body)
        .with_context(|| format!("exec in {id}: not JSON: {}", r.text()))?;
    if v["exit_code"] != 0 {
        bail!("`true` in {id} did not exit 0: {v}");
    }
    let t = &v["timings"];
    Ok((
        t["total_ms"].as_f64().unwrap_or(f64::NAN),
        t["start_ms"].as_f64().unwrap_or(f64::NAN),
    ))
}

pub(crate) fn create(api: &Api) -> anyhow::Result<String> {
    create_with(api, &serde_json::json!({}))
}

/// Creates a sandbox from `body` (the create route's JSON); returns its id.
pub(crate) fn create_with(api: &Api, body: &Value) -> anyhow::Result<String> {
    let r = api
        .try_request(
            "POST",
            "/v1/sandboxes",
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
        .context("POST /v1/sandboxes")?;
    if r.status != 201 {
        bail!("create a sandbox: HTTP {}: {}", r.status, r.text());
    }
    let v: Value = serde_json::from_slice(&r.body).context("create: not JSON")?;
    Ok(v["id"].as_str().context("create: no id")?.to_owned())
}

pub(crate) fn delete(api: &Api, id: &str) -> anyhow::Result<()> {
    let r = api
        .try_request("DELETE", &format!("/v1/sandboxes/{id}"), &[], ())
        .with_context(|| format!("DELETE /v1/sandboxes/{id}"))?;
    if r.status != 204 {
        bail!("delete {id}: HTTP {}: {}", r.status, r.text());
    }
    Ok(())
}

pub fn server_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let srv = Server::start();
    let api = srv.api();
    let rss_idle = rss_kib(srv.pid());

    // Exec in one warm sandbox.
    let (warm, n) = (args.warmup, args.fast());
    let id = create(&api)?;
    let (mut lat, mut inside, mut starts) = (vec![], vec![], vec![]);
    for i in 0..warm + n {
        check_stop()?;
        let t0 = Instant::now();
        let (server_ms, start_ms) = http_exec(&api, &id)?;
        let t = ms(t0);
        if i >= warm {
            lat.push(t);
            inside.push(server_ms);
            starts.push(start_ms);
        }
    }
    let s50 = percentile(&inside, 50.0);
    let tail = tail_note(&lat, &starts);
    println!(
        "  {HTTP_EXEC}: p50 {:.2} ms p99 {:.2} ms (server-reported total p50 {s50:.2} ms)",
        percentile(&lat, 50.0),
        percentile(&lat, 99.0)
    );
    rows.push(
        Row::new(HTTP_EXEC, "ms", lat, warm)
            .note("POST /v1/sandboxes/{id}/exec {\"cmd\":[\"true\"]}, JSON answer, default tenant key; the tests' ureq agent, which opens a connection per request (no pooling)")
            .note(format!("the server's own timings.total_ms p50 {s50:.2} ms (auth, lookup, agent round trip, call record queued); the rest is HTTP on loopback and the client"))
            .note(tail)
            .target(Target::P50(3.0))
            .target(Target::P99(10.0))
            .vs(EXEC_TRUE),
    );

    // The same after a pause before each call, as an agent's calls come (a model turn
    // between tool calls): the first move of a process into a cgroup after a quiet spell
    // can wait an RCU grace period, which back-to-back calls never see.
    let pause = Duration::from_millis(100);
    let paused_n = n.min(40);
    let (mut after, mut after_starts) = (vec![], vec![]);
    for i in 0..2 + paused_n {
        check_stop()?;
        std::thread::sleep(pause);
        let t0 = Instant::now();
        let (_, start_ms) = http_exec(&api, &id)?;
        if i >= 2 {
            after.push(ms(t0));
            after_starts.push(start_ms);
        }
    }
    println!(
        "  {HTTP_EXEC_PAUSED}: p50 {:.2} ms (agent-reported start p50 {:.2} ms)",
        percentile(&after, 50.0),
        percentile(&after_starts, 50.0)
    );
    rows.push(
        Row::new(HTTP_EXEC_PAUSED, "ms", after, 2)
            .note("as the warm row, with 100 ms of nothing before each call (no other call in flight on the host)")
            .note(format!("agent-reported start (cgroup + fork/exec inside the machine) p50 {:.2} ms: where a cgroup move waits, it shows here", percentile(&after_starts, 50.0)))
            .target(Target::P50(3.0))
            .vs(HTTP_EXEC),
    );

    // The same through the CLI, a new process per call.
    let tmp = locker_tests::TempDir::new("locker-bench-cli");
    let locker_cli = crate::jail::locker_alias(tmp.path())?;
    let mut cli = vec![];
    for i in 0..warm + n {
        check_stop()?;
        let t0 = Instant::now();
        let st = Command::new(&locker_cli)
            .args(["exec", &id, "--", "true"])
            .env("LOCKER_URL", &srv.url)
            .env("LOCKER_API_KEY", &srv.api_key)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .context("run locker exec")?;
        if !st.status.success() {
            bail!(
                "locker exec {id} -- true failed ({}): {}",
                st.status,
                String::from_utf8_lossy(&st.stderr)
            );
        }
        if i >= warm {
            cli.push(ms(t0));
        }
    }
    println!("  CLI locker exec: p50 {:.2} ms", percentile(&cli, 50.0));
    rows.push(Row::new("server CLI locker exec SB -- true", "ms", cli, warm).note("the release `locker` binary as a new process per call (LOCKER_URL, LOCKER_API_KEY): process start + one HTTP exec").vs(HTTP_EXEC));
    delete(&api, &id)?;

    // Create → first exec → delete, one sandbox at a time.
    let (warm, n) = (args.create_warmup(), args.creates());
    let (mut c, mut ce, mut d) = (vec![], vec![], vec![]);
    for i in 0..warm + n {
        check_stop()?;
        let t0 = Instant::now();
        let id = create(&api)?;
        let t_create = ms(t0);
        http_exec(&api, &id)?;
        let t_first = ms(t0);
        let t1 = Instant::now();
        delete(&api, &id)?;
        if i >= warm {
            c.push(t_create);
            ce.push(t_first);
            d.push(ms(t1));
        }
    }
    println!(
        "  HTTP create→exec: p50 {:.2} ms (create {:.2}), delete p50 {:.2} ms",
        percentile(&ce, 50.0),
        percentile(&c, 50.0),
        percentile(&d, 50.0)
    );
    rows.push(Row::new(HTTP_CREATE_EXEC, "ms", ce, warm).note("POST /v1/sandboxes {} (default template, 1 cpu, 512 MB, 2048 MB disk) answered, then POST exec true answered").vs(CREATE_TRUE));
    rows.push(
        Row::new("server HTTP create", "ms", c, warm)
            .note("POST /v1/sandboxes until 201: store insert, Node::create, state update"),
    );
    rows.push(
        Row::new("server HTTP delete", "ms", d, warm).note(
            "DELETE /v1/sandboxes/{id} until 204 (the machine is destroyed before the answer)",
        ),
    );
    let rss_after = rss_kib(srv.pid());
    rows.push(
        Row::new("server RSS idle → after server rows", "KiB", vec![rss_idle as f64, rss_after as f64], 0)
            .note(format!("VmRSS of locker serve right after start ({rss_idle} KiB) and after every row above ({rss_after} KiB)")),
    );
    Ok(())
}

/// What the soak's threads share.
struct Soak {
    latencies: Mutex<Vec<f64>>,
    errors: Mutex<Vec<String>>,
    error_count: std::sync::atomic::AtomicU64,
    done: AtomicBool,
}

pub fn soak_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let m = args.soak_sandboxes.max(1);
    let quota = (m + 10).to_string();
    let mem = ((m as u64 + 10) * 512).to_string();
    let srv = Server::start_with(&["--quota-sandboxes", &quota, "--quota-memory-mb", &mem]);
    let api = srv.api();
    let pid = srv.pid();
    std::thread::sleep(Duration::from_millis(200));
    let rss_idle = rss_kib(pid);

    let t0 = Instant::now();
    let mut ids = Vec::with_capacity(m);
    let mut creates = Vec::with_capacity(m);
    for _ in 0..m {
        check_stop()?;
        let t = Instant::now();
        ids.push(create(&api)?);
        creates.push(ms(t));
    }
    println!(
        "  created {m} sandboxes in {:.1} s (p50 {:.1} ms each)",
        t0.elapsed().as_secs_f64(),
        percentile(&creates, 50.0)
    );
    // One exec each so every connection and machine is warm before the clock starts.
    for id in &ids {
        http_exec(&api, id)?;
    }
    let rss_start = rss_kib(pid);

    let shared = Arc::new(Soak {
        latencies: Mutex::new(Vec::new()),
        errors: Mutex::new(Vec::new()),
        error_count: 0.into(),
        done: AtomicBool::new(false),
    });
    let rss_samples = Arc::new(Mutex::new(vec![rss_start as f64]));
    let monitor = {
        let (shared, rss) = (shared.clone(), rss_samples.clone());
        std::thread::spawn(move || {
            while !shared.done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(250));
                rss.lock().expect("rss").push(rss_kib(pid) as f64);
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(args.soak_seconds);
    let started = Instant::now();
    let workers: Vec<_> = ids
        .iter()
        .map(|id| {
            let (shared, id) = (shared.clone(), id.clone());
            // Each worker its own client (the tests' agent opens a connection per request).
            let api = Api::new(&srv.url, Some(&srv.api_key));
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                while Instant::now() < deadline && !stopping() {
                    let t = Instant::now();
                    match http_exec(&api, &id) {
                        Ok(_) => mine.push(ms(t)),
                        Err(e) => {
                            shared.error_count.fetch_add(1, Ordering::Relaxed);
                            let mut errs = shared.errors.lock().expect("errors");
                            if errs.len() < 5 {
                                errs.push(format!("{e:#}"));
                            }
                        }
                    }
                }
                shared.latencies.lock().expect("latencies").extend(mine);
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    let elapsed = started.elapsed().as_secs_f64();
    shared.done.store(true, Ordering::Relaxed);
    let _ = monitor.join();
    let rss_end = rss_kib(pid);
    check_stop()?;

    let mut deletes = Vec::with_capacity(m);
    for id in &ids {
        let t = Instant::now();
        delete(&api, id)?;
        deletes.push(ms(t));
    }
    std::thread::sleep(Duration::from_millis(500));
    let rss_deleted = rss_kib(pid);

    let lat = std::mem::take(&mut *shared.latencies.lock().expect("latencies"));
    let errors = shared.error_count.load(Ordering::Relaxed);
    let first_errors = shared.errors.lock().expect("errors").clone();
    let total = lat.len() as u64 + errors;
    let rss = std::mem::take(&mut *rss_samples.lock().expect("rss"));
    let peak = rss.iter().copied().fold(0.0, f64::max) as u64;
    println!(
        "  {total} execs in {elapsed:.1} s ({:.0}/s), {errors} errors, p50 {:.2} ms p99 {:.2} ms; RSS KiB idle {rss_idle} start {rss_start} peak {peak} end {rss_end} after delete {rss_deleted}",
        total as f64 / elapsed,
        percentile(&lat, 50.0),
        percentile(&lat, 99.0)
    );
    rows.push(
        Row::new(format!("soak HTTP exec true ({m} sandboxes at once)"), "ms", lat, 0)
            .note(format!("{m} threads, one sandbox and one HTTP client each (a connection per request), `true` in a loop for {elapsed:.1} s after one warm-up exec each; {total} execs, {:.0} execs/s, {errors} errors", total as f64 / elapsed))
            .vs(HTTP_EXEC),
    );
    let mut err_row = Row::new("soak errors", "count", vec![errors as f64], 0)
        .note(format!("failed execs out of {total} (expected 0)"));
    if !first_errors.is_empty() {
        err_row = err_row.note(format!("first errors: {}", first_errors.join(" | ")));
    }
    rows.push(err_row);
    rows.push(
        Row::new("soak execs total", "count", vec![total as f64], 0).note(format!(
            "{:.0} execs/s over {elapsed:.1} s",
            total as f64 / elapsed
        )),
    );
    rows.push(
        Row::new("soak server RSS", "KiB", rss, 0).note(format!(
            "VmRSS of locker serve every 250 ms during the soak; idle {rss_idle} KiB, with {m} sandboxes {rss_start} KiB (start), peak {peak} KiB, end {rss_end} KiB, after deleting them all {rss_deleted} KiB"
        )),
    );
    rows.push(Row::new(format!("soak HTTP create ({m} in a row)"), "ms", creates, 0).note("sequential creates filling the server before the soak; the nth create runs beside n-1 idle machines"));
    rows.push(Row::new(
        format!("soak HTTP delete ({m} in a row)"),
        "ms",
        deletes,
        0,
    ));
    Ok(())
}
