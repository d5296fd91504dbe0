//! Issue 17's port rows: Locker's path proxy (`/v1/sandboxes/{id}/ports/{port}/…`) beside
//! a direct connection into the machine's network namespace, for a small request, a large
//! download, and the first request to a sandbox its idle policy paused.
//!
//! The direct side is a socket made inside the jail's network namespace from this process
//! ([`NetnsDialer`], what `nsenter --net` gives a client), talking to the same
//! server on the machine's loopback with the same client code: the fair baseline, because
//! it leaves out exactly what the proxy adds (the client's hop to `locker serve`, its HTTP
//! and auth, the agent tunnel, the agent's connection to the port) and adds nothing else. A
//! client run inside the machine by exec would add a process, an interpreter and the exec
//! path to the baseline, and measure another client.
//!
//! Owns the server and sandboxes it starts (the tests' [`Server`] guard deletes them);
//! the server inside each machine is an asyncio HTTP/1.1 server started as a job of an exec.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use locker_tests::server::{enc, Api, Server};
use serde_json::{json, Value};

use crate::http1::{sandbox_pid, Conn, NetnsDialer};
use crate::server::delete;
use crate::stats::{fmt_num, percentile, Row, Target};
use crate::{check_stop, Args};

/// The server in the machine: `GET /big?n=N` streams N bytes (1 MiB writes, flow-controlled),
/// anything else answers `ok`; HTTP/1.1 keep-alive, Content-Length framing, no logging.
const SERVER_PY: &str = r#"
import asyncio, sys
BLOCK = memoryview(b"x" * (1 << 20))
OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"

async def serve(r, w):
    try:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            target = head.split(b" ", 2)[1]
            if target.startswith(b"/big"):
                n = int(target.split(b"n=", 1)[1])
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % n)
                while n > 0:
                    k = min(n, len(BLOCK))
                    w.write(BLOCK[:k])
                    n -= k
                    await w.drain()
            else:
                w.write(OK)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        w.close()

async def main():
    srv = await asyncio.start_server(serve, "0.0.0.0", int(sys.argv[1]))
    async with srv:
        await srv.serve_forever()

asyncio.run(main())
"#;
const SCRIPT: &str = "/root/locker-bench-srv.py";
const PORT: u16 = 8000;

pub const PROXY_SMALL: &str = "ports proxy GET small (kept-alive client)";
pub const DIRECT_SMALL: &str = "ports direct GET small (kept-alive, machine netns)";
const DIRECT_FRESH: &str = "ports direct GET small (new connection each, machine netns)";
const SERVER_GET: &str = "ports server GET /v1/sandboxes/{id} (kept-alive)";
const PROXY_DOWNLOAD: &str = "ports proxy download";
const DIRECT_DOWNLOAD: &str = "ports direct download (machine netns)";
const WAKE: &str = "ports first byte after wake (idle-paused)";
const RUNNING_FIRST: &str = "ports first byte, running (new connection)";

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A sandbox created with `body`, running the bench's server on [`PORT`] as a job of an exec,
/// once the port is listed; returns its id and the host pid of the server (whose network
/// namespace the direct rows enter).
fn serving(api: &Api, body: &Value) -> anyhow::Result<(String, u32)> {
    let id = crate::server::create_with(api, body)?;
    let r = api
        .try_request(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path={}", enc(SCRIPT)),
            &[("Content-Type", "application/octet-stream")],
            SERVER_PY.as_bytes(),
        )
        .context("upload the server")?;
    if r.status != 200 {
        bail!("upload {SCRIPT} to {id}: HTTP {}: {}", r.status, r.text());
    }
    let start = json!({"shell": format!("python3 {SCRIPT} {PORT} >/dev/null 2>&1 &")});
    let r = api
        .try_request(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            &[("Content-Type", "application/json")],
            start.to_string().as_bytes(),
        )
        .context("start the server")?;
    if r.status != 200 || !r.text().contains("\"exit_code\":0") {
        bail!("start the server in {id}: HTTP {}: {}", r.status, r.text());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        check_stop()?;
        let r = api
            .try_request("GET", &format!("/v1/sandboxes/{id}/ports"), &[], ())
            .context("list ports")?;
        let listed: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        let up = listed["ports"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["port"] == PORT));
        if up {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the server in {id} did not listen on {PORT} within 30 s: {}",
                r.text()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = sandbox_pid(&id, SCRIPT).with_context(|| {
        format!("no process running {SCRIPT} in the cgroup of sandbox {id} on this host")
    })?;
    Ok((id, pid))
}

fn proxied(id: &str, rest: &str) -> String {
    format!("/v1/sandboxes/{id}/ports/{PORT}{rest}")
}

fn direct(ns: &NetnsDialer) -> anyhow::Result<Conn> {
    Ok(Conn::new(
        ns.connect(PORT)?,
        &format!("127.0.0.1:{PORT}"),
        None,
    )?)
}

/// User + system CPU time of a process so far, in ms (0 when it is gone).
fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the command name.
    (ticks(11) + ticks(12)) * 1e3 / hz
}

pub fn port_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let srv = Server::start();
    let api = srv.api();
    let (id, pid) = serving(&api, &json!({}))?;
    println!("  sandbox {id}: the server in it is host pid {pid}");
    let ns = NetnsDialer::enter(pid)?;
    small_rows(args, &srv, &id, &ns, rows)?;
    download_rows(args, &srv, &id, &ns, rows)?;
    drop(ns);
    delete(&api, &id)?;
    wake_rows(args, &srv, rows)
}

/// The same small GET, interleaved: through the proxy on a kept-alive connection to the
/// server, directly on a kept-alive connection in the machine, directly on a new connection
/// each time (what the proxy does inside the machine per request), and a plain API GET on a
/// kept-alive connection (the server's HTTP and auth without the machine).
fn small_rows(
    args: &Args,
    srv: &Server,
    id: &str,
    ns: &NetnsDialer,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let (warm, n) = (args.warmup, args.port_requests.max(1));
    let key = Some(srv.api_key.as_str());
    let mut proxy = Conn::to(srv.addr, key)?;
    let mut api_conn = Conn::to(srv.addr, key)?;
    let mut near = direct(ns)?;
    let (path, api_path) = (proxied(id, "/small"), format!("/v1/sandboxes/{id}"));
    let (mut p, mut d, mut f, mut g) = (vec![], vec![], vec![], vec![]);
    for i in 0..warm + n {
        check_stop()?;
        let tp = proxy.get(&path).context("through the proxy")?.total;
        let td = near.get("/small").context("direct")?.total;
        let t0 = Instant::now();
        direct(ns)?
            .get("/small")
            .context("direct, new connection")?;
        let tf = t0.elapsed();
        let tg = api_conn.get(&api_path).context("GET the sandbox")?.total;
        if i >= warm {
            p.push(ms(tp));
            d.push(ms(td));
            f.push(ms(tf));
            g.push(ms(tg));
        }
    }
    let added = |q: f64| percentile(&p, q) - percentile(&d, q);
    let (a50, a99) = (added(50.0), added(99.0));
    println!(
        "  small GET: proxy p50 {:.3} ms, direct p50 {:.3} ms: added p50 {a50:.3} ms, p99 {a99:.3} ms",
        percentile(&p, 50.0),
        percentile(&d, 50.0)
    );
    let client = "the bench's own HTTP/1.1 client (same code both ways), Nagle off";
    rows.push(
        Row::new(PROXY_SMALL, "ms", p, warm)
            .note(format!("GET /v1/sandboxes/{{id}}/ports/{PORT}/small with the API key on one kept-alive connection to locker serve on loopback, answered `ok` (2 bytes) by an asyncio HTTP/1.1 server in a jail; {n} requests interleaved with the direct ones; {client}"))
            .note("per request the proxy opens an agent tunnel (Connect) and a new TCP connection to the port inside the machine, and speaks HTTP/1.1 on it")
            .vs(DIRECT_SMALL),
    );
    rows.push(
        Row::new(DIRECT_SMALL, "ms", d, warm)
            .note(format!("the same GET /small to 127.0.0.1:{PORT} on one kept-alive connection made inside the jail's network namespace (a bench thread that did setns into /proc/<server pid>/ns/net, like nsenter --net); {client}")),
    );
    rows.push(
        Row::new(DIRECT_FRESH, "ms", f, warm)
            .note("the same, connecting anew inside the namespace for each request (a channel round trip to the bench's thread inside the namespace, the TCP handshake on the machine's loopback, the GET): what the machine's side of the proxy's per-request connection costs at most")
            .vs(DIRECT_SMALL),
    );
    rows.push(
        Row::new(SERVER_GET, "ms", g, warm)
            .note("GET /v1/sandboxes/{id} with the API key on a kept-alive connection: locker serve's HTTP, auth and a store read, no agent round trip; a floor for any proxied request")
            .vs(DIRECT_SMALL),
    );
    rows.push(
        Row::new("ports proxy added latency (p50 proxy − p50 direct)", "ms", vec![a50], 0)
            .note(format!("p50 of {PROXY_SMALL} minus p50 of {DIRECT_SMALL}, same run, interleaved; at p99 the difference is {} ms", fmt_num(a99)))
            .target(Target::P50(1.0)),
    );
    Ok(())
}

/// The processes a download passes through, for the CPU each spends on it.
struct Cpus {
    who: Vec<(&'static str, u32)>,
}

impl Cpus {
    fn now(&self) -> Vec<f64> {
        self.who.iter().map(|(_, pid)| cpu_ms(*pid)).collect()
    }

    /// "locker serve 812 ms, …" per GiB moved, from two [`Cpus::now`] samples.
    fn per_gib(&self, before: &[f64], after: &[f64], bytes: u64) -> String {
        let gib = bytes as f64 / f64::from(1u32 << 30);
        self.who
            .iter()
            .zip(before.iter().zip(after))
            .map(|((name, _), (b, a))| format!("{name} {:.0} ms", (a - b) / gib))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `--downloads` downloads of `--download-mib` MiB each through the proxy and directly,
/// alternating, after a 64 MiB warm-up on each connection; with the CPU each process on the way spent per GiB.
fn download_rows(
    args: &Args,
    srv: &Server,
    id: &str,
    ns: &NetnsDialer,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let bytes = args.download_mib.max(1) << 20;
    let big = format!("/big?n={bytes}");
    let warm = format!("/big?n={}", 64u64 << 20);
    let mut who = vec![("locker serve", srv.pid())];
    if let Some(agent) = sandbox_pid(id, "locker-agent") {
        who.push(("the agent", agent));
    }
    if let Some(py) = sandbox_pid(id, SCRIPT) {
        who.push(("the asyncio server", py));
    }
    who.push(("the bench's client", std::process::id()));
    let cpus = Cpus { who };

    let mut near = direct(ns)?;
    near.get(&warm).context("direct warm-up download")?;
    let mut proxy = Conn::to(srv.addr, Some(&srv.api_key))?;
    proxy
        .get(&proxied(id, &warm))
        .context("proxied warm-up download")?;
    // Alternated, so both sides see the same weather on a shared host.
    let runs = args.downloads.max(1);
    let (mut d_mbs, mut p_mbs, mut p_first) = (vec![], vec![], vec![]);
    let (mut d_cpu, mut p_cpu) = (vec![0.0; cpus.who.len()], vec![0.0; cpus.who.len()]);
    let add = |acc: &mut Vec<f64>, before: Vec<f64>, after: Vec<f64>| {
        for (k, (b, a)) in before.iter().zip(after).enumerate() {
            acc[k] += a - b;
        }
    };
    for _ in 0..runs {
        check_stop()?;
        let c0 = cpus.now();
        let t0 = Instant::now();
        let a = near.get(&big).context("direct download")?;
        d_mbs.push(a.body_bytes as f64 / 1e6 / t0.elapsed().as_secs_f64());
        add(&mut d_cpu, c0, cpus.now());
        check_stop()?;
        let c0 = cpus.now();
        let t0 = Instant::now();
        let b = proxy.get(&proxied(id, &big)).context("proxied download")?;
        p_mbs.push(b.body_bytes as f64 / 1e6 / t0.elapsed().as_secs_f64());
        p_first.push(ms(b.first_byte));
        add(&mut p_cpu, c0, cpus.now());
    }
    let zero = vec![0.0; cpus.who.len()];
    let moved = bytes * runs as u64;
    let (direct_cpu, proxy_cpu) = (
        cpus.per_gib(&zero, &d_cpu, moved),
        cpus.per_gib(&zero, &p_cpu, moved),
    );
    let (d50, p50) = (percentile(&d_mbs, 50.0), percentile(&p_mbs, 50.0));
    let share = 100.0 * p50 / d50;
    println!(
        "  {} MiB download ×{runs}: proxy p50 {p50:.0} MB/s, direct p50 {d50:.0} MB/s ({share:.0}%)\n    CPU per GiB, proxied: {proxy_cpu}\n    CPU per GiB, direct: {direct_cpu}",
        args.download_mib
    );
    let what = format!("GET /big?n={bytes} ({} MiB, written in 1 MiB blocks by the asyncio server), read and discarded in 1 MiB reads; {runs} downloads each way, alternating direct and proxied, after a 64 MiB warm-up on each connection", args.download_mib);
    rows.push(
        Row::new(PROXY_DOWNLOAD, "MB/s", p_mbs, 1)
            .note(format!("{what}; through the proxy on one kept-alive connection to locker serve on loopback; first byte after {} ms p50; CPU (user + system) per GiB: {proxy_cpu}", fmt_num(percentile(&p_first, 50.0))))
            .vs(DIRECT_DOWNLOAD),
    );
    rows.push(
        Row::new(DIRECT_DOWNLOAD, "MB/s", d_mbs, 1).note(format!(
            "{what}; on one kept-alive connection in the jail's network namespace; CPU (user + system) per GiB: {direct_cpu}"
        )),
    );
    rows.push(
        Row::new("ports proxy download ÷ direct", "%", vec![share], 0)
            .note(format!(
                "p50 of {PROXY_DOWNLOAD} as a share of p50 of {DIRECT_DOWNLOAD}, same run"
            ))
            .target(Target::P50AtLeast(50.0)),
    );
    Ok(())
}

/// Pause/wake cycles: a sandbox with `idle_timeout_s: 1` is left alone until its idle policy
/// pauses it, then a new connection asks the proxy for `/small`; the time to the answer's
/// first byte is the wake row. A second new connection right after (the sandbox running)
/// is its peer.
fn wake_rows(args: &Args, srv: &Server, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let api = srv.api();
    let (id, _) = serving(&api, &json!({"idle_timeout_s": 1}))?;
    let (warm, n) = (1, args.wake_cycles.max(1));
    let path = proxied(&id, "/small");
    let key = Some(srv.api_key.as_str());
    let (mut wake, mut running, mut waited) = (vec![], vec![], vec![]);
    for i in 0..warm + n {
        check_stop()?;
        let t0 = Instant::now();
        loop {
            check_stop()?;
            let state = api
                .try_request("GET", &format!("/v1/sandboxes/{id}"), &[], ())
                .context("GET the sandbox")?;
            let v: Value = serde_json::from_slice(&state.body).unwrap_or(Value::Null);
            if v["state"] == "paused" && locker_tests::frozen(&id) == Some(true) {
                break;
            }
            if t0.elapsed() > Duration::from_secs(30) {
                bail!("sandbox {id} was not paused by its idle policy within 30 s: {v}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let idle = t0.elapsed();
        let mut c = Conn::to(srv.addr, key)?;
        let w = c.get(&path).context("the first request after the pause")?;
        let mut c2 = Conn::to(srv.addr, key)?;
        let r = c2.get(&path).context("a request to the running sandbox")?;
        if locker_tests::frozen(&id) != Some(false) {
            bail!("sandbox {id} answered but its cgroup is not thawed");
        }
        if i >= warm {
            wake.push(ms(w.first_byte));
            running.push(ms(r.first_byte));
            waited.push(idle.as_secs_f64());
        }
    }
    println!(
        "  first byte after wake: p50 {:.2} ms p99 {:.2} ms (running: p50 {:.2} ms)",
        percentile(&wake, 50.0),
        percentile(&wake, 99.0),
        percentile(&running, 50.0)
    );
    rows.push(
        Row::new(WAKE, "ms", wake, warm)
            .note(format!("{n} cycles: a jail created with idle_timeout_s 1 runs the asyncio server; once GET shows it `paused` and its freezer cgroup is FROZEN (after {:.1} s p50 of quiet), a new connection to locker serve sends GET …/ports/{PORT}/small; the time from sending it to the answer's first byte (thaw, state written back, tunnel, answer)", percentile(&waited, 50.0)))
            .target(Target::P50(20.0))
            .vs(RUNNING_FIRST),
    );
    rows.push(Row::new(RUNNING_FIRST, "ms", running, warm).note(
        "the same request on another new connection right after the wake, the sandbox running",
    ));
    delete(&api, &id)
}
