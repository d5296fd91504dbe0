//! Issue 23's dashboard figures with many sandboxes: a real `locker serve` holding
//! `--ui-sandboxes` (1,000) real idle jails of one tenant, the server's list answer whole
//! and one page at a time, and the sandboxes page loaded cold in headless Chromium
//! (`tests/ui/bench.mjs`, playwright-core from `tests/ui/node_modules`, which `npm ci`
//! installs on first use) for that tenant and for an empty one: the page and its assets
//! (`load`) and the first screen with its data.
//!
//! Owns the server and the sandboxes it fills it with: they are deleted at the end (and by
//! the server's guard if the run stops early). Holding hundreds of sandboxes takes memory
//! other work on the host may need: the fill starts only with 10 GiB available and stops
//! early below 4 GiB (the rows then say how many there were).

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use locker_tests::server::{Api, Server};
use locker_tests::tools::{npm_unreachable, run_logged};
use serde_json::{json, Value};

use crate::host::meminfo_kib;
use crate::server::{create_with, delete};
use crate::stats::{Row, Target};
use crate::{check_stop, stopping, Args};

const GIB_KIB: u64 = 1024 * 1024;
const PAGE: usize = 50;

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Times `GET path` `n` times after `warmup` untimed ones; each answer must be 200.
fn timed_get(api: &Api, path: &str, warmup: usize, n: usize) -> anyhow::Result<Vec<f64>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..warmup + n {
        check_stop()?;
        let t = Instant::now();
        let r = api
            .try_request("GET", path, &[], ())
            .with_context(|| format!("GET {path}"))?;
        let took = ms(t);
        if r.status != 200 {
            bail!("GET {path}: HTTP {}: {}", r.status, r.text());
        }
        if i >= warmup {
            out.push(took);
        }
    }
    Ok(out)
}

/// Creates up to `n` idle sandboxes with `api`, four at a time, stopping early when the host
/// runs low on memory; returns their ids.
fn fill(api: &Api, n: usize) -> anyhow::Result<Vec<String>> {
    let made = std::sync::Mutex::new(Vec::with_capacity(n));
    let low = std::sync::atomic::AtomicBool::new(false);
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| -> anyhow::Result<()> {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<()> {
                    use std::sync::atomic::Ordering::Relaxed;
                    while next.fetch_add(1, Relaxed) < n {
                        if stopping() || low.load(Relaxed) {
                            return Ok(());
                        }
                        if meminfo_kib("MemAvailable") < 4 * GIB_KIB {
                            low.store(true, Relaxed);
                            return Ok(());
                        }
                        let id = create_with(api, &json!({"memory_mb": 128}))?;
                        made.lock().unwrap_or_else(|e| e.into_inner()).push(id);
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| anyhow::anyhow!("a fill thread panicked"))??;
        }
        Ok(())
    })?;
    let ids = made.into_inner().unwrap_or_else(|e| e.into_inner());
    if low.into_inner() {
        println!(
            "  stopped the fill at {} sandboxes: less than 4 GiB of memory available",
            ids.len()
        );
    }
    Ok(ids)
}

/// Deletes `ids`, four at a time.
fn delete_all(api: &Api, ids: &[String]) {
    std::thread::scope(|s| {
        for chunk in ids.chunks(ids.len().div_ceil(4).max(1)) {
            s.spawn(move || {
                for id in chunk {
                    if let Err(e) = delete(api, id) {
                        println!("  warning: {e:#}");
                    }
                }
            });
        }
    });
}

/// `tests/ui/node_modules` has playwright-core (installed with `npm ci` if not), and
/// Chromium is there; else why not.
fn browser_ready() -> Result<(), String> {
    if !std::path::Path::new("/usr/bin/chromium").exists() {
        return Err("Debian's chromium is not installed (`scripts/setup test` installs it)".into());
    }
    let dir = locker_tests::root().join("tests/ui");
    if dir
        .join("node_modules/playwright-core/package.json")
        .exists()
    {
        return Ok(());
    }
    let (ok, log) =
        run_logged(
            Command::new("npm")
                .current_dir(&dir)
                .args(["ci", "--no-audit", "--no-fund"]),
        );
    match (ok, npm_unreachable(&log)) {
        (true, _) => Ok(()),
        (false, true) => {
            Err("playwright-core cannot be installed: the npm registry is unreachable".into())
        }
        (false, false) => Err(format!("npm ci in tests/ui failed: {log}")),
    }
}

pub fn rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let want = args.ui_sandboxes.max(1);
    let avail = meminfo_kib("MemAvailable");
    if want > 300 && avail < 10 * GIB_KIB {
        rows.push(Row::skipped(
            format!("ui GET /v1/sandboxes, all {want}"),
            format!(
                "holding {want} sandboxes needs 10 GiB of memory available; this host had {:.1} GiB (--ui-sandboxes 300 or fewer runs with less)",
                avail as f64 / GIB_KIB as f64
            ),
        ));
        return Ok(());
    }
    let q = crate::scale::big_quotas(want);
    let q: Vec<&str> = q.iter().map(String::as_str).collect();
    let srv = Server::start_with(&q);
    let admin = srv.admin();
    let tenant = |name: &str| -> anyhow::Result<String> {
        let r = admin.post("/v1/tenants", &json!({ "name": name }));
        if r.status != 201 {
            bail!("create tenant {name}: HTTP {}: {}", r.status, r.text());
        }
        let key = r.json()["api_key"].as_str().context("api_key")?.to_owned();
        srv.remember_key(&key);
        Ok(key)
    };
    let (many_key, empty_key) = (tenant("ui-many")?, tenant("ui-empty")?);
    let api = srv.api_with(&many_key);
    let t0 = Instant::now();
    let ids = fill(&api, want)?;
    let n = ids.len();
    println!(
        "  {n} idle sandboxes created in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let result = measure(args, rows, &srv, &api, n, &many_key, &empty_key);
    let t1 = Instant::now();
    delete_all(&api, &ids);
    println!(
        "  {n} sandboxes deleted in {:.1} s",
        t1.elapsed().as_secs_f64()
    );
    result
}

fn measure(
    args: &Args,
    rows: &mut Vec<Row>,
    srv: &Server,
    api: &Api,
    n: usize,
    many_key: &str,
    empty_key: &str,
) -> anyhow::Result<()> {
    let iters = args.fast();
    let held = format!("{n} idle jails of one tenant (128 MB limit each), every one live");
    // The whole list: every sandbox's view (its live usage read from its cgroup).
    let all = timed_get(api, "/v1/sandboxes", args.warmup.min(3), iters.min(50))?;
    let body_kb = api.get("/v1/sandboxes").body.len() as f64 / 1024.0;
    rows.push(
        Row::new(format!("ui GET /v1/sandboxes, all {n}"), "ms", all, args.warmup.min(3))
            .note(format!("the unpaged list the dashboard read before this issue: {body_kb:.0} KB of JSON; client on loopback, one connection kept alive"))
            .note(&held),
    );
    let first = timed_get(
        api,
        &format!("/v1/sandboxes?limit={PAGE}&order=newest"),
        args.warmup,
        iters,
    )?;
    rows.push(
        Row::new(format!("ui GET /v1/sandboxes?limit={PAGE}, first page of {n}"), "ms", first, args.warmup)
            .note("what the sandboxes page reads for its first screen and on each live refresh (newest first, with the total)")
            .note(&held)
            .vs(&format!("ui GET /v1/sandboxes, all {n}")),
    );
    let last_offset = n.saturating_sub(1) / PAGE * PAGE;
    let last = timed_get(
        api,
        &format!("/v1/sandboxes?limit={PAGE}&order=newest&offset={last_offset}"),
        args.warmup,
        iters,
    )?;
    rows.push(
        Row::new(
            format!("ui GET /v1/sandboxes?limit={PAGE}, last page of {n}"),
            "ms",
            last,
            args.warmup,
        )
        .note(format!(
            "offset {last_offset}: SQLite skips the rows before it"
        ))
        .note(&held),
    );

    let loads = args.ui_loads.max(1);
    let names = [
        (
            format!("ui sandboxes page: first screen with {n} sandboxes"),
            format!("ui first load with {n} sandboxes (page and every asset)"),
            "many",
        ),
        (
            "ui sandboxes page: first screen, no sandboxes".to_owned(),
            "ui first load (page and every asset, cold)".to_owned(),
            "empty",
        ),
    ];
    if let Err(why) = browser_ready() {
        for (screen, load, _) in names {
            rows.push(Row::skipped(screen, why.clone()));
            rows.push(Row::skipped(load, why.clone()));
        }
        return Ok(());
    }
    check_stop()?;
    let dir = locker_tests::root().join("tests/ui");
    let (ok, out) = run_logged(
        Command::new("node")
            .current_dir(&dir)
            .arg("bench.mjs")
            .env("LOCKER_URL", &srv.url)
            .env(
                "UI_TENANTS",
                json!({"many": many_key, "empty": empty_key}).to_string(),
            )
            .env("UI_LOADS", loads.to_string())
            .env_remove("NODE_OPTIONS"),
    );
    let figures: Option<Value> = out.lines().rev().find_map(|l| {
        serde_json::from_str::<Value>(l.trim())
            .ok()
            .filter(|v| v["tenants"].is_object())
    });
    let Some(figures) = figures.filter(|_| ok) else {
        for (screen, load, _) in names {
            rows.push(Row::skipped(
                screen,
                format!("tests/ui/bench.mjs failed: {out}"),
            ));
            rows.push(Row::skipped(load, "tests/ui/bench.mjs failed"));
        }
        return Ok(());
    };
    let chromium = figures["chromium"].as_str().unwrap_or("?").to_owned();
    for (screen, load, key) in names {
        let t = &figures["tenants"][key];
        let series = |k: &str| -> Vec<f64> {
            t["runs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r[k].as_f64())
                .collect()
        };
        let bytes = series("bytes").into_iter().fold(0.0, f64::max);
        let requests = series("requests").into_iter().fold(0.0, f64::max);
        let how = format!("cold (a fresh browser context each: no cache, no storage; the key in sessionStorage as a signed-in tab has it) in headless Chromium {chromium}, after one load not counted; times from the navigation's start, read in the page");
        rows.push(
            Row::new(screen, "ms", series("first_screen_ms"), 1)
                .note("the sandboxes table filled with its first page of data (the page's own mark, set as it fills the table)")
                .note(&how)
                .target(Target::P50(200.0)),
        );
        rows.push(
            Row::new(load, "ms", series("load_ms"), 1)
                .note(format!("the `load` event: the page and every file it loads fetched, parsed and run; {:.1} KB compressed, {requests:.0} requests in all (API calls included)", bytes / 1024.0))
                .note(&how)
                .target(Target::P50(200.0)),
        );
    }
    Ok(())
}
