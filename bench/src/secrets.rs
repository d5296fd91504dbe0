//! Issue 21's rows: what putting a secret into requests costs. The same HTTPS request from
//! inside a jail to the same test host, once intercepted (the sandbox holds a secret for
//! the host: the proxy terminates TLS with the machine's CA, swaps the placeholder in the
//! `Authorization` header and opens its own verified TLS to the host) and once passed
//! through by SNI (a sandbox that only allows the host: the proxy relays bytes), for a new
//! connection per request, for requests on one kept-alive connection, and for a 100 MB
//! download.
//!
//! The test host is the secrets test's Node server (`tests/data/secrets_echo.js`: HTTP/2
//! and HTTP/1.1 over TLS, `/big?mb=N` streams N MiB) in a network namespace of its own,
//! with a CA made by openssl that the server trusts through `--egress-ca`. The client is
//! curl inside the machine; its own timings (`-w`) leave out its process start. Both
//! sandboxes give curl the same CA bundle (the machine's store plus the test CA), so that
//! loading it costs the same on both sides.
//!
//! Owns the server, the sandboxes and the test host it starts (guards remove them).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use locker_tests::egress::{ns_listens, wait_egress_ok, wire_namespace, Pki};
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

use crate::stats::{fmt_num, percentile, Row, Target};
use crate::{check_stop, Args};

const HOST: &str = "allowed.test";
const VALUE: &str = "sk-bench-0123456789abcdef0123456789abcdef";
const NEW_I: &str = "secrets HTTPS GET, new connection, intercepted";
const NEW_P: &str = "secrets HTTPS GET, new connection, passed through by SNI";
const KEPT_I: &str = "secrets HTTPS GET, kept-alive, intercepted";
const KEPT_P: &str = "secrets HTTPS GET, kept-alive, passed through by SNI";
const DL_I: &str = "secrets 100 MB download, intercepted";
const DL_P: &str = "secrets 100 MB download, passed through by SNI";

/// The echo host in a network namespace of its own; removed on drop.
struct EchoHost {
    ns: String,
    link: String,
    child: Option<std::process::Child>,
}

impl EchoHost {
    fn start(pki: &Pki) -> anyhow::Result<(EchoHost, std::net::Ipv4Addr)> {
        let pid = std::process::id();
        let ns = format!("lbsec-{pid}");
        let link = format!("lb{}s", pid % 100_000);
        let (srv, host) = (
            std::net::Ipv4Addr::new(198, 19, 252, 1),
            std::net::Ipv4Addr::new(198, 19, 252, 2),
        );
        let mut h = EchoHost {
            ns: ns.clone(),
            link: link.clone(),
            child: None,
        };
        wire_namespace(&ns, &link, host, srv);
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/secrets_echo.js");
        let child = Command::new("ip")
            .args(["netns", "exec", &ns, "node"])
            .arg(&script)
            .arg(srv.to_string())
            .arg("bench")
            .arg(pki.dir.path().join("srv.pem"))
            .arg(pki.dir.path().join("srv.key"))
            .arg("/dev/null")
            .env("SECRET_VALUE_1", VALUE)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("start node (the test host; apt-get install nodejs)")?;
        locker_tests::register_child(child.id());
        h.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while !(ns_listens(&ns, 443) && ns_listens(&ns, 80)) {
            if Instant::now() > deadline {
                bail!("the test host did not listen within 15 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok((h, srv))
    }
}

impl Drop for EchoHost {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// Runs `script` in sandbox `id`; its stdout (it must exit 0).
fn sh(api: &Api, id: &str, script: &str) -> anyhow::Result<String> {
    let body = json!({"shell": script, "timeout_ms": 600_000});
    let r = api
        .try_request(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
        .context("exec")?;
    let v: Value = serde_json::from_slice(&r.body).context("exec: not JSON")?;
    if r.status != 200 || v["exit_code"] != 0 {
        bail!("exec in {id}: HTTP {}: {v}", r.status);
    }
    Ok(v["stdout"].as_str().unwrap_or_default().to_owned())
}

/// The curl options both sides share: the same CA bundle, the key header, HTTP/1.1 (what
/// Python's clients speak; the proxy and the host offer HTTP/2 too).
const CURL: &str =
    "curl -sS --http1.1 -m 60 --cacert /tmp/both.pem -H \"Authorization: Bearer $BENCH_KEY\"";

/// `n` requests each on a new connection: curl's `time_total` of each, in ms.
fn new_connections(api: &Api, id: &str, n: usize) -> anyhow::Result<Vec<f64>> {
    let out = sh(
        api,
        id,
        &format!("for i in $(seq {n}); do {CURL} -o /dev/null -w '%{{time_total}}\\n' https://{HOST}/small; done"),
    )?;
    parse(&out, n)
}

/// `n + 1` requests on one connection: the `time_total` of the `n` after the first (which
/// opens it), in ms, and how many of those made a connection (0 when kept alive).
fn kept_alive(api: &Api, id: &str, n: usize) -> anyhow::Result<(Vec<f64>, u64)> {
    let urls: String = (0..=n)
        .map(|i| format!(" -o /dev/null https://{HOST}/k{i}"))
        .collect();
    let out = sh(
        api,
        id,
        &format!("{CURL} -w '%{{time_total}} %{{num_connects}}\\n'{urls}"),
    )?;
    let mut times = Vec::new();
    let mut connects = 0;
    for l in out.lines().skip(1) {
        let mut f = l.split_whitespace();
        let t: f64 = f.next().context("a time")?.parse().context("a time")?;
        connects += f.next().and_then(|c| c.parse::<u64>().ok()).unwrap_or(1);
        times.push(t * 1e3);
    }
    if times.len() != n {
        bail!(
            "expected {n} kept-alive timings, got {}: {out}",
            times.len()
        );
    }
    Ok((times, connects))
}

fn parse(out: &str, n: usize) -> anyhow::Result<Vec<f64>> {
    let v: Vec<f64> = out
        .lines()
        .filter_map(|l| l.trim().parse::<f64>().ok())
        .map(|s| s * 1e3)
        .collect();
    if v.len() != n {
        bail!("expected {n} timings, got {}: {out}", v.len());
    }
    Ok(v)
}

/// One 100 MiB download: MB/s.
fn download(api: &Api, id: &str) -> anyhow::Result<f64> {
    let out = sh(
        api,
        id,
        &format!("{CURL} -o /dev/null -w '%{{size_download}} %{{time_total}}\\n' 'https://{HOST}/big?mb=100'"),
    )?;
    let mut f = out.split_whitespace();
    let bytes: f64 = f.next().context("size")?.parse()?;
    let secs: f64 = f.next().context("time")?.parse()?;
    if bytes < (100u64 << 20) as f64 {
        bail!("a short download: {out}");
    }
    Ok(bytes / 1e6 / secs)
}

pub fn rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let pki = Pki::new();
    let (_host, addr) = EchoHost::start(&pki)?;
    let ca = pki.dir.path().join("ca.pem").display().to_string();
    let pin = format!("{HOST}={addr}");
    let srv = Server::start_with(&["--egress-ca", &ca, "--egress-resolve", &pin]);
    wait_egress_ok(&srv);
    let api = srv.api();
    let r = api
        .try_request(
            "POST",
            "/v1/secrets",
            &[("Content-Type", "application/json")],
            json!({"name": "bench", "value": VALUE, "hosts": [HOST], "env": "BENCH_KEY"})
                .to_string()
                .as_bytes(),
        )
        .context("create the secret")?;
    if r.status != 201 {
        bail!("create the secret: HTTP {}: {}", r.status, r.text());
    }
    let icpt = crate::server::create_with(&api, &json!({"secrets": ["bench"]}))?;
    // A key as long as a placeholder, so both requests carry as many bytes.
    let dummy = format!("unused-secret-bench-{}", "0".repeat(32));
    let pass = crate::server::create_with(
        &api,
        &json!({"network": {"egress": "allow", "allow": [HOST]}, "env": {"BENCH_KEY": dummy}}),
    )?;
    for id in [&icpt, &pass] {
        let put = api
            .try_request(
                "PUT",
                &format!("/v1/sandboxes/{id}/files?path=/tmp/test-ca.pem"),
                &[("Content-Type", "application/octet-stream")],
                pki.ca(),
            )
            .context("upload the test CA")?;
        if put.status != 200 {
            bail!("upload the test CA: HTTP {}", put.status);
        }
        sh(
            &api,
            id,
            "cat /etc/ssl/certs/ca-certificates.crt /tmp/test-ca.pem > /tmp/both.pem",
        )?;
    }
    // Each side does what it says: the intercepted one's host sees the value.
    let seen = |id: &str| -> anyhow::Result<String> {
        sh(&api, id, &format!("{CURL} https://{HOST}/check"))
    };
    let (a, b) = (seen(&icpt)?, seen(&pass)?);
    if !a.contains("Bearer [value-1]") || b.contains("[value-1]") {
        bail!(
            "interception is not what the rows assume: intercepted saw {a}; passed through saw {b}"
        );
    }

    let (warm, n) = (args.warmup, args.fast());
    let rounds = 4;
    let per = n.div_ceil(rounds);
    let (mut ni, mut np, mut ki, mut kp) = (vec![], vec![], vec![], vec![]);
    let (mut ci, mut cp) = (0, 0);
    new_connections(&api, &icpt, warm)?;
    new_connections(&api, &pass, warm)?;
    kept_alive(&api, &icpt, warm)?;
    kept_alive(&api, &pass, warm)?;
    // Alternated in rounds, so both sides see the same weather on a shared host.
    for _ in 0..rounds {
        check_stop()?;
        ni.extend(new_connections(&api, &icpt, per)?);
        np.extend(new_connections(&api, &pass, per)?);
        let (t, c) = kept_alive(&api, &icpt, per)?;
        ki.extend(t);
        ci += c;
        let (t, c) = kept_alive(&api, &pass, per)?;
        kp.extend(t);
        cp += c;
    }
    let added = |a: &[f64], b: &[f64], q: f64| percentile(a, q) - percentile(b, q);
    let (new50, new99) = (added(&ni, &np, 50.0), added(&ni, &np, 99.0));
    let (kept50, kept99) = (added(&ki, &kp, 50.0), added(&ki, &kp, 99.0));
    println!(
        "  new connection: intercepted p50 {:.3} ms, passed through p50 {:.3} ms: added {new50:.3} ms (p99 {new99:.3})",
        percentile(&ni, 50.0),
        percentile(&np, 50.0)
    );
    println!(
        "  kept-alive: intercepted p50 {:.3} ms, passed through p50 {:.3} ms: added {kept50:.3} ms (p99 {kept99:.3})",
        percentile(&ki, 50.0),
        percentile(&kp, 50.0)
    );
    let what = format!("curl --http1.1 in a jail, GET https://{HOST}/small with `Authorization: Bearer $BENCH_KEY` (the echo host answers ~600 bytes of JSON), curl's time_total (its process start left out)");
    rows.push(
        Row::new(NEW_I, "ms", ni, warm)
            .note(format!("{what}; a new curl and connection per request: TCP to the proxy, TLS with the proxy (the machine's CA), the proxy's TCP and TLS to the host (verified with --egress-ca), the placeholder swapped in the header"))
            .vs(NEW_P),
    );
    rows.push(
        Row::new(NEW_P, "ms", np, warm)
            .note(format!("{what}; a sandbox without the secret: the proxy reads the SNI, dials the host and relays; TLS is end to end")),
    );
    rows.push(
        Row::new(KEPT_I, "ms", ki, warm)
            .note(format!("{what}; {per} requests per curl on one connection (the first, which opens it, not counted); connections made in the counted requests: {ci}"))
            .vs(KEPT_P),
    );
    rows.push(
        Row::new(KEPT_P, "ms", kp, warm)
            .note(format!("{what}; the same on one passed-through connection; connections made in the counted requests: {cp}")),
    );
    rows.push(
        Row::new(
            "secrets added latency, new connection (p50 intercepted − p50 passed through)",
            "ms",
            vec![new50],
            0,
        )
        .note(format!(
            "p50 of {NEW_I:?} minus p50 of {NEW_P:?}, interleaved in {rounds} rounds; at p99 {} ms",
            fmt_num(new99)
        ))
        .target(Target::P50(2.0)),
    );
    rows.push(
        Row::new("secrets added latency, kept-alive (p50 intercepted − p50 passed through)", "ms", vec![kept50], 0)
            .note(format!("p50 of {KEPT_I:?} minus p50 of {KEPT_P:?}, interleaved in {rounds} rounds; at p99 {} ms", fmt_num(kept99)))
            .target(Target::P50(0.3)),
    );

    // Throughput: alternated downloads after one warm-up each.
    download(&api, &icpt)?;
    download(&api, &pass)?;
    let (mut di, mut dp) = (vec![], vec![]);
    for _ in 0..args.downloads.max(1) {
        check_stop()?;
        di.push(download(&api, &icpt)?);
        dp.push(download(&api, &pass)?);
    }
    println!(
        "  100 MiB download: intercepted p50 {:.0} MB/s, passed through p50 {:.0} MB/s",
        percentile(&di, 50.0),
        percentile(&dp, 50.0)
    );
    let dl = format!("curl --http1.1 in a jail, GET https://{HOST}/big?mb=100 (104.9 MB, written to /dev/null), size_download / time_total, {} downloads each way alternated after one warm-up each", args.downloads.max(1));
    rows.push(
        Row::new(DL_I, "MB/s", di, 1)
            .note(format!("{dl}; the proxy decrypts and re-encrypts every byte (rustls both ways, hyper between)"))
            .vs(DL_P),
    );
    rows.push(Row::new(DL_P, "MB/s", dp, 1).note(format!("{dl}; the proxy relays the TLS bytes")));
    Ok(())
}
