//! Issue 25's rows: how long a join takes, what a heartbeat costs the control plane, how
//! soon a dead node is declared (`FLEET.md` §5.3: "failure detection: kill → dead ≤ lease +
//! 0.5 s"), and placement and routing: scheduling latency at 8 concurrent creates (target
//! p50 ≤ 3 ms, p99 ≤ 15 ms), create → first command across nodes beside one host (within
//! 5 ms p50), the router's overhead on a command (≤ 1 ms p50, ≤ 3 ms p99).
//!
//! The fabric is the tests' (`locker_tests::fabric`): `locker node` processes in network
//! namespaces on a private bridge, a real PostgreSQL cluster of this process for the
//! control server's state. The peer for placement and routing is one host: a plain `locker
//! serve` (SQLite, no fleet) on the same machine in the same run. There is no other fleet
//! to compare with here (a Nomad or Kubernetes control plane is not installable on this
//! host); the other rows compare with the design's targets.
//!
//! Owns the servers, the nodes, the namespaces and the database it makes (guards remove
//! them).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use locker_tests::fabric::{Fabric, NodeProc};
use locker_tests::server::{Api, Resp, Server};
use serde_json::{json, Value};

use crate::stats::{percentile, Row, Target};
use crate::{check_stop, Args};

const JOIN: &str = "fleet join: `locker node --join` start → joined (identity written)";
const FIRST: &str = "fleet join: `locker node --join` start → listed alive";
const DETECT: &str = "fleet failure detection: SIGKILL of a node → declared dead";
const DETECT_BEAT: &str = "fleet failure detection: its last heartbeat → declared dead";
const BEAT_CPU: &str = "fleet heartbeat: control server CPU per heartbeat";
const SCHED: &str = "fleet scheduling: choose + reserve a node, 8 concurrent creates";
const CREATE_FLEET: &str =
    "fleet create (8 concurrent): POST /v1/sandboxes → 201, through control to a node";
const CREATE_ONE: &str = "one host create (8 concurrent): POST /v1/sandboxes → 201";
const FIRST_FLEET: &str = "fleet create → first command (`echo`), across nodes";
const FIRST_ONE: &str = "one host create → first command (`echo`)";
const EXEC_FLEET: &str = "fleet exec `true`: through the router to the sandbox's node";
const EXEC_ONE: &str = "one host exec `true`";
const ROUTER: &str = "fleet router overhead on exec: p50 through the router − p50 on one host";
/// The lease the server keeps (`fleet::LEASE`).
const LEASE_MS: f64 = 3000.0;

fn nodes(admin: &Api) -> Vec<Value> {
    admin.get("/v1/fleet/nodes").json()["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// CPU time of every thread of a process (`/proc/PID/task/*/schedstat`), in ms.
fn cpu_ms(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return f64::NAN;
    };
    let ns: u64 = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum();
    ns as f64 / 1e6
}

/// The server's CPU over `window`, in ms.
fn cpu_over(pid: u32, window: Duration) -> f64 {
    let c0 = cpu_ms(pid);
    std::thread::sleep(window);
    cpu_ms(pid) - c0
}

pub fn rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let n_nodes = 4;
    let joins = args.iterations.unwrap_or(10).clamp(1, 20);
    let trials = (args.iterations.unwrap_or(5)).clamp(1, 10);
    let fab = Fabric::new(n_nodes);
    let mut srv = control_server(&fab)?;
    let admin = srv.admin();
    let scratch = tempdir()?;
    // The server's own idle work without nodes (the sweeper's query every 250 ms, timers).
    const WINDOW: Duration = Duration::from_secs(10);
    let baseline = cpu_over(srv.pid(), WINDOW);
    let mint = |admin: &Api| -> anyhow::Result<(String, String)> {
        let t = admin
            .post("/v1/fleet/tokens", &json!({"ttl_s": 600}))
            .expect(201, "mint a join token");
        Ok((
            t["url"].as_str().context("url")?.to_owned(),
            t["token"].as_str().context("token")?.to_owned(),
        ))
    };

    // Joins: a fresh data dir each time in namespace 0; the node is removed after.
    let (mut joined, mut listed) = (Vec::new(), Vec::new());
    for _ in 0..joins {
        check_stop()?;
        let (url, token) = mint(&admin)?;
        let t0 = Instant::now();
        let mut node = NodeProc::new(0, "n0");
        node.start(&fab, Some((&url, &token)), 8);
        let ident = node.data_dir().join("fleet/identity.json");
        let mut t_join = None;
        let deadline = t0 + Duration::from_secs(20);
        loop {
            if t_join.is_none() && ident.exists() {
                t_join = Some(t0.elapsed().as_secs_f64() * 1e3);
            }
            if t_join.is_some()
                && nodes(&admin)
                    .iter()
                    .any(|n| n["name"] == "n0" && n["alive"] == true)
            {
                break;
            }
            if Instant::now() > deadline {
                bail!("node n0 did not join within 20 s: {}", node.log_text());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        listed.push(t0.elapsed().as_secs_f64() * 1e3);
        joined.extend(t_join);
        drop(node);
        admin
            .delete("/v1/fleet/nodes/n0")
            .expect(204, "remove the node");
    }
    rows.push(
        Row::new(JOIN, "ms", joined, 0)
            .note("process start, a P-256 key, TLS with the CA the token pins, the register call (token redeemed and node inserted in one Postgres transaction, its certificate signed), the identity files written"),
    );
    rows.push(Row::new(FIRST, "ms", listed, 0).note("the row above plus the first heartbeat landing and GET /v1/fleet/nodes seeing it (polled every 2 ms)"));

    // Heartbeat cost: the server's CPU over 10 s of 4 nodes beating, per heartbeat.
    let mut procs = Vec::new();
    for i in 0..n_nodes {
        let (url, token) = mint(&admin)?;
        let mut p = NodeProc::new(i, &format!("n{i}"));
        p.start(&fab, Some((&url, &token)), 8);
        procs.push(p);
    }
    let all_alive = |admin: &Api| {
        let l = nodes(admin);
        l.len() == n_nodes && l.iter().all(|n| n["alive"] == true)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !all_alive(&admin) {
        if Instant::now() > deadline {
            bail!("the nodes did not all join");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let busy = cpu_over(srv.pid(), WINDOW);
    let beats = n_nodes as f64 * WINDOW.as_secs_f64();
    rows.push(
        Row::new(BEAT_CPU, "ms", vec![(busy - baseline) / beats], 0).note(format!(
            "the server process's CPU (every thread's schedstat) over {} s with {n_nodes} nodes beating every second ({busy:.1} ms), less the same window with no node ({baseline:.1} ms: the sweeper's query every 250 ms, timers), divided by the heartbeats ({beats:.0}): TLS, HTTP/2, the handler and the store's one UPDATE on Postgres",
            WINDOW.as_secs()
        )),
    );

    placement_rows(args, &srv, rows)?;

    // Detection: each trial restarts the server (a fresh rate-limit window: max(1, 10%)
    // a minute) and waits out its grace, then kills one node.
    let (mut detect, mut from_beat) = (Vec::new(), Vec::new());
    for k in 0..trials {
        check_stop()?;
        let i = k % n_nodes;
        srv.kill9();
        srv.restart();
        let admin = srv.admin();
        std::thread::sleep(Duration::from_millis(LEASE_MS as u64 + 1500));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !all_alive(&admin) {
            if Instant::now() > deadline {
                bail!("the nodes did not all come back after a restart");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let t0 = Instant::now();
        procs[i].stop();
        let name = format!("n{i}");
        let deadline = t0 + Duration::from_secs(20);
        loop {
            let l = nodes(&admin);
            if let Some(n) = l
                .iter()
                .find(|n| n["name"] == name.as_str() && n["state"] == "dead")
            {
                detect.push(t0.elapsed().as_secs_f64() * 1e3);
                from_beat.push(n["last_heartbeat_ms_ago"].as_f64().unwrap_or(f64::NAN));
                break;
            }
            if Instant::now() > deadline {
                bail!("{name} was not declared dead within 20 s");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // It comes back (fenced, at its new epoch) for the next trials.
        procs[i].start(&fab, None, 8);
    }
    rows.push(
        Row::new(DETECT, "ms", detect, 0)
            .note(format!("lease {LEASE_MS:.0} ms, heartbeats every 1 s, the sweeper every 250 ms; the kill lands anywhere in a heartbeat period, so this is lease − (time since the last beat) + the sweep's wait; polled every 5 ms"))
            .target(Target::P99(LEASE_MS + 500.0)),
    );
    rows.push(
        Row::new(DETECT_BEAT, "ms", from_beat, 0)
            .note("the node's last heartbeat (the store's clock) to the first listing that shows it dead: what the lease promises")
            .target(Target::P99(LEASE_MS + 500.0)),
    );
    drop(procs);
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

/// A control server for `fab`'s nodes, on a new database of this process's PostgreSQL
/// cluster, with no warm pool.
pub(crate) fn control_server(fab: &Fabric) -> anyhow::Result<Server> {
    let (_db, pg_url) = locker_tests::postgres::cluster().new_database();
    let port = std::net::TcpListener::bind(format!("{}:0", fab.control_ip()))?
        .local_addr()?
        .port();
    let listen = format!("{}:{port}", fab.control_ip());
    Ok(Server::start_with(&[
        "--database",
        pg_url.as_str(),
        "--fleet-listen",
        &listen,
        "--warm-pool",
        "0",
    ]))
}

/// `Server-Timing`'s `place` duration of a create's answer (ms).
fn place_ms(r: &Resp) -> Option<f64> {
    let v = r.headers.get("server-timing")?.to_str().ok()?;
    v.split(',')
        .find_map(|m| m.trim().strip_prefix("place;dur="))
        .and_then(|d| d.parse().ok())
}

fn create_body() -> Value {
    json!({"runtime": "jail", "memory_mb": 256, "ttl_s": 600})
}

/// Eight creates at once on `api`: each one's latency (ms), answer and id.
fn eight_at_once(api: &Api) -> anyhow::Result<Vec<(f64, Resp, String)>> {
    let out: Vec<(f64, Resp)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    let t0 = Instant::now();
                    let r = api.post("/v1/sandboxes", &create_body());
                    (t0.elapsed().as_secs_f64() * 1e3, r)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a creator"))
            .collect()
    });
    out.into_iter()
        .map(|(ms, r)| {
            if r.status != 201 {
                bail!("a create answered {}: {}", r.status, r.text());
            }
            let id = r.json()["id"].as_str().context("id")?.to_owned();
            Ok((ms, r, id))
        })
        .collect()
}

/// One exec of `true`: its latency (ms).
fn exec_true(api: &Api, id: &str) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let r = api.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"cmd": ["true"]}),
    );
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    if r.status != 200 || r.json()["exit_code"] != 0 {
        bail!("exec answered {}: {}", r.status, r.text());
    }
    Ok(ms)
}

/// Placement and routing on the fleet (`fleet`: 4 nodes of 8 slots), beside one host.
fn placement_rows(args: &Args, fleet: &Server, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let rounds = args.iterations.unwrap_or(5).clamp(1, 20);
    let firsts = args.iterations.unwrap_or(10).clamp(1, 40);
    let execs = args.iterations.map_or(200, |n| n * 20).clamp(20, 2000);
    let one = Server::start_with(&["--warm-pool", "0", "--vm-pool", "0"]);
    let peers = [(fleet.api(), true), (one.api(), false)];
    let (mut sched, mut c_fleet, mut c_one) = (Vec::new(), Vec::new(), Vec::new());
    let (mut f_fleet, mut f_one, mut e_fleet, mut e_one) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        for (api, is_fleet) in &peers {
            check_stop()?;
            let made = eight_at_once(api)?;
            for (ms, r, _) in &made {
                if *is_fleet {
                    c_fleet.push(*ms);
                    sched.extend(place_ms(r));
                } else {
                    c_one.push(*ms);
                }
            }
            // Commands on the first of them (the sandbox's node, through the router).
            let id = &made[0].2;
            for _ in 0..execs / rounds {
                let ms = exec_true(api, id)?;
                if *is_fleet {
                    e_fleet.push(ms);
                } else {
                    e_one.push(ms);
                }
            }
            for (_, _, id) in &made {
                api.delete(&format!("/v1/sandboxes/{id}"));
            }
        }
    }
    for _ in 0..firsts {
        for (api, is_fleet) in &peers {
            check_stop()?;
            let t0 = Instant::now();
            let r = api.post("/v1/sandboxes", &create_body());
            if r.status != 201 {
                bail!("a create answered {}: {}", r.status, r.text());
            }
            let id = r.json()["id"].as_str().context("id")?.to_owned();
            let out = api.post(
                &format!("/v1/sandboxes/{id}/exec"),
                &json!({"cmd": ["echo", "hi"]}),
            );
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            if out.json()["stdout"] != "hi\n" {
                bail!("echo answered {}", out.text());
            }
            if *is_fleet {
                f_fleet.push(ms)
            } else {
                f_one.push(ms)
            }
            api.delete(&format!("/v1/sandboxes/{id}"));
        }
    }
    rows.push(
        Row::new(SCHED, "ms", sched, 0)
            .note("the control plane's own time in a create before the node is asked (Server-Timing `place`): the node table (read at most every 500 ms), filter, score, best of 2, and the reservation's one Postgres transaction (UPDATE nodes … WHERE reserved + r <= capacity, INSERT placements); 8 creators at once on 4 nodes of 8 slots")
            .target(Target::P50(3.0))
            .target(Target::P99(15.0)),
    );
    rows.push(Row::new(CREATE_FLEET, "ms", c_fleet, 0).vs(CREATE_ONE).note("placement, the node's create over HTTP/2 with mutual TLS, the placement's second transaction (the sandbox's id); jails, no warm pool on either side"));
    rows.push(
        Row::new(CREATE_ONE, "ms", c_one, 0).note("a plain `locker serve` on SQLite, no warm pool"),
    );
    let gap = percentile(&f_fleet, 50.0) - percentile(&f_one, 50.0);
    rows.push(
        Row::new(FIRST_FLEET, "ms", f_fleet, 0)
            .vs(FIRST_ONE)
            .note(format!("one create, then one exec of `echo hi`, sequential; p50 {gap:+.2} ms beside one host (target: within 5 ms)")),
    );
    rows.push(Row::new(FIRST_ONE, "ms", f_one, 0));
    let (p50, p99) = (
        percentile(&e_fleet, 50.0) - percentile(&e_one, 50.0),
        percentile(&e_fleet, 99.0) - percentile(&e_one, 99.0),
    );
    rows.push(Row::new(EXEC_FLEET, "ms", e_fleet, 0).vs(EXEC_ONE).note("the caller's key checked and the route found on the control plane (cached), the request and its answer over the node's HTTP/2 connection, the node's epoch check"));
    rows.push(Row::new(EXEC_ONE, "ms", e_one, 0));
    rows.push(
        Row::new(ROUTER, "ms", vec![p50], 0)
            .note(format!("the difference of the two rows above at p50 (at p99: {p99:+.2} ms); targets ≤ 1 ms p50, ≤ 3 ms p99"))
            .target(Target::P50(1.0)),
    );
    Ok(())
}

/// A scratch directory of this run.
fn tempdir() -> anyhow::Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("locker-bench-fleet-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
