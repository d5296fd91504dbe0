//! Issue 18's code interpreter rows, over HTTP against a real server with the
//! `code-interpreter` template: a warm cell `x + 1`, a new sandbox's first cell (create +
//! `1+1`) with a kernel the warm pool started beforehand and with a cold one (a server with
//! `--vm-pool 0`: the driver and the kernel start in the cell), on the jail and on the
//! microVM, a warm matplotlib chart cell, and the memory of an idle context.
//!
//! Owns the servers and sandboxes it starts (the tests' [`Server`] guard deletes them). It
//! does not build the template: without it the rows are skipped and say how to build it.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

use crate::server::delete;
use crate::stats::{fmt_num, percentile, Row, Target};
use crate::{check_stop, Args};

const WARM: &str = "code warm cell x + 1 (HTTP)";
const FIRST_POOLED: &str = "code create + first cell 1+1, kernel pre-started (HTTP, --vm-pool 1)";
const FIRST_COLD: &str = "code create + first cell 1+1, cold kernel (HTTP, --vm-pool 0)";
const FIRST_VM_POOLED: &str =
    "code microVM create + first cell 1+1, kernel pre-started (HTTP, --vm-pool 1)";
const FIRST_VM_COLD: &str = "code microVM create + first cell 1+1, cold kernel (HTTP, --vm-pool 0)";
const CHART: &str = "code chart cell (100-point line to PNG), warm";
const PSS: &str = "code PSS per idle context (its kernel)";
const FIT: &str = "code idle contexts that fit in a 512 MB sandbox";

/// Prints how many seconds ago the cell's kernel process started.
const KERNEL_AGE: &str = "import os\n\
    with open('/proc/self/stat') as f: ticks = int(f.read().rsplit(')', 1)[1].split()[19])\n\
    with open('/proc/uptime') as f: up = float(f.read().split()[0])\n\
    print(round(up - ticks / os.sysconf('SC_CLK_TCK'), 3))";

/// The PSS (KiB) of each kernel (`k`) and of the driver (`d`) in the machine.
const PSS_SCRIPT: &str = "for p in /proc/[0-9]*; do [ ${p#/proc/} = $$ ] && continue; \
    c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); \
    case \"$c\" in *ipykernel_launcher*) t=k;; *' - --start'*) t=d;; *) continue;; esac; \
    echo $t $(awk '/^Pss:/{print $2}' $p/smaps_rollup); done";

fn post(api: &Api, path: &str, body: &Value) -> anyhow::Result<Value> {
    let r = api
        .try_request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
        .with_context(|| format!("POST {path}"))?;
    if !(200..300).contains(&r.status) {
        bail!("POST {path} {body}: HTTP {}: {}", r.status, r.text());
    }
    serde_json::from_slice(&r.body).context("not JSON")
}

/// A jail of the `code-interpreter` template.
fn jail() -> Value {
    json!({ "template": "code-interpreter" })
}

/// A microVM of the `code-interpreter` template (egress `none`, as the pool makes them).
fn microvm() -> Value {
    json!({ "template": "code-interpreter", "runtime": "microvm" })
}

/// A new sandbox of `body`; `None` when the host has no such template.
fn create(api: &Api, body: &Value) -> anyhow::Result<Option<String>> {
    let r = api
        .try_request(
            "POST",
            "/v1/sandboxes",
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
        .context("POST /v1/sandboxes")?;
    if r.status == 400 && r.text().contains("unknown template") {
        return Ok(None);
    }
    if r.status != 201 {
        bail!(
            "create a code-interpreter sandbox: HTTP {}: {}",
            r.status,
            r.text()
        );
    }
    let v: Value = serde_json::from_slice(&r.body)?;
    Ok(Some(v["id"].as_str().context("no id")?.to_owned()))
}

/// Runs a cell; checks it finished; returns the Execution.
fn cell(api: &Api, id: &str, body: &Value) -> anyhow::Result<Value> {
    let v = post(api, &format!("/v1/sandboxes/{id}/code"), body)?;
    if v["reason"] != "finished" {
        bail!("cell {body} in {id} did not finish: {v}");
    }
    Ok(v)
}

fn text_of(v: &Value) -> &str {
    v["results"][0]["text"].as_str().unwrap_or("")
}

/// Create (of `body`) + first cell, `n` times after `warm` untimed ones, each sandbox
/// deleted after; `gap` between creates (not counted) lets the pool refill. Returns the
/// samples and how many of them got a kernel older than their sandbox.
fn firsts(
    api: &Api,
    body: &Value,
    warm: usize,
    n: usize,
    gap: Duration,
) -> anyhow::Result<(Vec<f64>, usize)> {
    let (mut samples, mut pooled) = (Vec::new(), 0);
    for i in 0..warm + n {
        check_stop()?;
        std::thread::sleep(gap);
        let t0 = Instant::now();
        let id = create(api, body)?.context("the code-interpreter template went away")?;
        let v = cell(api, &id, &json!({ "code": "1+1" }))?;
        let t = t0.elapsed().as_secs_f64();
        if text_of(&v) != "2" {
            bail!("1+1 gave {v}");
        }
        let age = cell(api, &id, &json!({ "code": KERNEL_AGE }))?;
        let age: f64 = age["stdout"]
            .as_str()
            .unwrap_or("")
            .trim()
            .parse()
            .unwrap_or(0.0);
        if i >= warm {
            samples.push(t * 1e3);
            pooled += usize::from(age > t + 0.05);
        }
        delete(api, &id)?;
    }
    Ok((samples, pooled))
}

pub fn code_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let srv = Server::start();
    let api = srv.api();
    let Some(id) = create(&api, &jail())? else {
        let why = "no code-interpreter template on this host: build it with `sudo locker template build code-interpreter` (about 6 minutes, once)";
        for name in [
            WARM,
            FIRST_POOLED,
            FIRST_COLD,
            FIRST_VM_POOLED,
            FIRST_VM_COLD,
            CHART,
            PSS,
            FIT,
        ] {
            rows.push(Row::skipped(name, why));
        }
        return Ok(());
    };
    let client = "the tests' ureq agent (a connection per request), JSON answers";

    // A warm context.
    let ctx = post(&api, &format!("/v1/sandboxes/{id}/contexts"), &json!({}))?;
    let ctx = ctx["id"].as_str().context("a context id")?.to_owned();
    cell(&api, &id, &json!({ "context": ctx, "code": "x = 1" }))?;
    let (warm, n) = (args.warmup, args.fast());
    let (mut lat, mut server) = (Vec::new(), Vec::new());
    for i in 0..warm + n {
        check_stop()?;
        let t0 = Instant::now();
        let v = cell(&api, &id, &json!({ "context": ctx, "code": "x + 1" }))?;
        let t = t0.elapsed().as_secs_f64() * 1e3;
        if text_of(&v) != "2" {
            bail!("x + 1 gave {v}");
        }
        if i >= warm {
            lat.push(t);
            server.push(v["timings"]["total_ms"].as_f64().unwrap_or(f64::NAN));
        }
    }
    let server_p50 = percentile(&server, 50.0);
    rows.push(
        Row::new(WARM, "ms", lat, warm)
            .note(format!("POST /v1/sandboxes/{{id}}/code in one context, {client}; the server's timings.total_ms p50 {} ms", fmt_num(server_p50)))
            .target(Target::P50(10.0))
            .target(Target::P99(30.0)),
    );

    // A warm chart cell.
    cell(
        &api,
        &id,
        &json!({ "context": ctx, "code": "import matplotlib.pyplot as plt" }),
    )?;
    let charts = n.clamp(1, 50);
    let mut lat = Vec::new();
    for i in 0..2 + charts {
        check_stop()?;
        let t0 = Instant::now();
        let v = cell(
            &api,
            &id,
            &json!({ "context": ctx, "code": "plt.plot(range(100))\nplt.show()" }),
        )?;
        let t = t0.elapsed().as_secs_f64() * 1e3;
        if v["results"][0]["png"].as_str().is_none_or(str::is_empty) {
            bail!("the chart cell gave no PNG: {v}");
        }
        if i >= 2 {
            lat.push(t);
        }
    }
    rows.push(
        Row::new(CHART, "ms", lat, 2)
            .note("`plt.plot(range(100)); plt.show()` in a context that imported matplotlib (inline backend), the PNG in the answer")
            .vs(WARM),
    );

    // Idle contexts' memory.
    for _ in 0..4 {
        let c = post(&api, &format!("/v1/sandboxes/{id}/contexts"), &json!({}))?;
        cell(&api, &id, &json!({ "context": c["id"], "code": "1" }))?;
    }
    std::thread::sleep(Duration::from_secs(2));
    let out = post(
        &api,
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({ "shell": PSS_SCRIPT }),
    )?;
    let (mut kernels, mut driver) = (Vec::new(), 0.0);
    for line in out["stdout"].as_str().unwrap_or("").lines() {
        let mut w = line.split_whitespace();
        let (Some(t), Some(kib)) = (w.next(), w.next().and_then(|k| k.parse::<f64>().ok())) else {
            continue;
        };
        if t == "k" {
            kernels.push(kib / 1024.0);
        } else {
            driver += kib / 1024.0;
        }
    }
    if kernels.is_empty() {
        bail!("no kernel's PSS was read: {out}");
    }
    let per = percentile(&kernels, 50.0);
    let fit = ((512.0 - driver) / per).floor();
    rows.push(
        Row::new(PSS, "MB", kernels.clone(), 0)
            .note(format!("PSS of each ipykernel process of a sandbox with {} idle Python contexts (one cell `1` run in each; matplotlib imported in one); the driver's own PSS {} MB", kernels.len(), fmt_num(driver))),
    );
    rows.push(
        Row::new(FIT, "contexts", vec![fit], 0)
            .note("computed, not filled: (512 MB − the driver's PSS) / the median kernel PSS; pandas or a chart in a context grows it"),
    );
    delete(&api, &id)?;

    // New sandboxes' first cells: with a pre-started kernel (this server's pool) ...
    let creates = args.creates().min(30);
    let (samples, pooled) = firsts(
        &api,
        &jail(),
        args.create_warmup(),
        creates,
        Duration::from_secs(4),
    )?;
    rows.push(
        Row::new(FIRST_POOLED, "ms", samples, args.create_warmup())
            .note(format!("POST /v1/sandboxes {{\"template\": \"code-interpreter\"}} then POST …/code {{\"code\": \"1+1\"}} (the default context); {pooled} of {creates} got a kernel started before their sandbox; 4 s (not counted) between creates let the pool refill"))
            .target(Target::P50(300.0))
            .vs(FIRST_COLD),
    );
    // The same on the microVM: the pool restores one, warms it and starts its kernel.
    let vm_creates = args.creates().min(15);
    let (samples, pooled) = firsts(
        &api,
        &microvm(),
        args.create_warmup(),
        vm_creates,
        Duration::from_secs(args.code_vm_gap_s),
    )?;
    rows.push(
        Row::new(FIRST_VM_POOLED, "ms", samples, args.create_warmup())
            .note(format!("POST /v1/sandboxes {{\"template\": \"code-interpreter\", \"runtime\": \"microvm\"}} then POST …/code {{\"code\": \"1+1\"}}; {pooled} of {vm_creates} got a kernel started before their sandbox; {} s (not counted, --code-vm-gap-s) between creates let the pool restore one and start its kernel", args.code_vm_gap_s))
            .vs(FIRST_VM_COLD)
            .vs(FIRST_POOLED),
    );
    drop(srv);

    // ... and cold, where the cell starts the driver and a kernel.
    let cold = Server::start_with(&["--vm-pool", "0"]);
    let api = cold.api();
    let creates = args.creates().min(15);
    let (samples, _) = firsts(
        &api,
        &jail(),
        args.create_warmup().min(1),
        creates,
        Duration::ZERO,
    )?;
    rows.push(
        Row::new(FIRST_COLD, "ms", samples, args.create_warmup().min(1))
            .note("the same on a server with no pool: the first cell starts the driver (python3, jupyter_client) and an ipykernel"),
    );
    let (samples, _) = firsts(
        &api,
        &microvm(),
        args.create_warmup().min(1),
        vm_creates,
        Duration::ZERO,
    )?;
    rows.push(
        Row::new(FIRST_VM_COLD, "ms", samples, args.create_warmup().min(1))
            .note("the microVM on a server with no pool: a restore from the template's base, then the first cell starts the driver and an ipykernel in the guest"),
    );
    Ok(())
}
