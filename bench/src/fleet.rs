//! Issue 25's rows, for what fleet mode has so far (nodes joining and beating): how long a
//! join takes, what a heartbeat costs the control plane, and how soon a dead node is
//! declared (`FLEET.md` §5.3: "failure detection: kill → dead ≤ lease + 0.5 s").
//!
//! The fabric is the tests' (`locker_tests::fabric`): `locker node` processes in network
//! namespaces on a private bridge, a real PostgreSQL cluster of this process for the
//! control server's state. There is no peer to compare with here (a Nomad or Kubernetes
//! control plane is not installable on this host); the rows compare with the design's
//! targets.
//!
//! Owns the server, the nodes, the namespaces and the database it makes (guards remove
//! them).

use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use locker_tests::fabric::Fabric;
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

use crate::stats::{Row, Target};
use crate::{check_stop, Args};

const JOIN: &str = "fleet join: `locker node --join` start → joined (identity written)";
const FIRST: &str = "fleet join: `locker node --join` start → listed alive";
const DETECT: &str = "fleet failure detection: SIGKILL of a node → declared dead";
const DETECT_BEAT: &str = "fleet failure detection: its last heartbeat → declared dead";
const BEAT_CPU: &str = "fleet heartbeat: control server CPU per heartbeat";
/// The lease the server keeps (`fleet::LEASE`).
const LEASE_MS: f64 = 3000.0;

/// A node process in a namespace of the fabric, killed on drop.
struct NodeProc(Option<Child>);

impl Drop for NodeProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn nodes(admin: &Api) -> Vec<Value> {
    admin.get("/v1/fleet/nodes").json()["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn start_node(
    fab: &Fabric,
    i: usize,
    dir: &std::path::Path,
    join: Option<(&str, &str)>,
) -> NodeProc {
    let data = dir.join(format!("n{i}"));
    let log = dir.join(format!("n{i}.log"));
    let (name, data_s) = (format!("n{i}"), data.display().to_string());
    let mut args = vec![
        "node",
        "--name",
        &name,
        "--slots",
        "8",
        "--data-dir",
        &data_s,
    ];
    if let Some((url, token)) = join {
        args.extend(["--join", url, "--token", token]);
    }
    NodeProc(Some(fab.spawn(i, &locker_tests::locker_bin(), &args, &log)))
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
    let (_db, pg_url) = locker_tests::postgres::cluster().new_database();
    let port = std::net::TcpListener::bind(format!("{}:0", fab.control_ip()))?
        .local_addr()?
        .port();
    let listen = format!("{}:{port}", fab.control_ip());
    let mut srv = Server::start_with(&[
        "--database",
        pg_url.as_str(),
        "--fleet-listen",
        &listen,
        "--warm-pool",
        "0",
    ]);
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
    for k in 0..joins {
        check_stop()?;
        let dir = scratch.join(format!("join{k}"));
        std::fs::create_dir_all(&dir)?;
        let (url, token) = mint(&admin)?;
        let t0 = Instant::now();
        let node = start_node(&fab, 0, &dir, Some((&url, &token)));
        let ident = dir.join("n0/fleet/identity.json");
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
                bail!(
                    "node n0 did not join within 20 s: {}",
                    std::fs::read_to_string(dir.join("n0.log")).unwrap_or_default()
                );
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
        let dir = scratch.join("fleet");
        std::fs::create_dir_all(&dir)?;
        procs.push(start_node(&fab, i, &dir, Some((&url, &token))));
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
        drop(std::mem::replace(&mut procs[i], NodeProc(None)));
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
        procs[i] = start_node(&fab, i, &scratch.join("fleet"), None);
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

/// A scratch directory of this run.
fn tempdir() -> anyhow::Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("locker-bench-fleet-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
