//! What idle machines cost while nothing happens: many idle jail sandboxes cost the server
//! and the host (almost) no CPU and no wake-ups per sandbox, and an idle microVM sleeps,
//! also once its server is gone, instead of spinning; the server's warm microVMs do not
//! outlive it.
//!
//! Each test starts its own server; the [`Server`] guard deletes every sandbox and
//! destroys whatever machine is left, even when the test fails.
//!
//! Run as root after `scripts/setup build`:
//! `cargo test --release -p locker-tests --test density`.

use std::path::Path;
use std::time::{Duration, Instant};

use locker_tests::server::Server;
use locker_tests::{become_subreaper, procs_naming};
use serde_json::json;

/// Idle jail sandboxes held at once by the idle-cost test.
const IDLE_SANDBOXES: usize = 200;

/// User + system CPU time of process `pid` so far, in ms (0 when it is gone).
fn cpu_ms(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the command name.
    (ticks(11) + ticks(12)) * 1e3 / hz
}

/// Context switches of every thread of process `pid` so far (each sleep that ends is one:
/// a timer firing, a wake-up), 0 when it is gone.
fn switches(pid: i32) -> u64 {
    let mut n = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        n += status
            .lines()
            .filter_map(|l| {
                l.strip_prefix("voluntary_ctxt_switches:")
                    .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
            })
            .filter_map(|v| v.trim().parse::<u64>().ok())
            .sum::<u64>();
    }
    n
}

/// The processes in machine `id`'s cgroup and below it (the agent, and any command).
fn machine_procs(id: &str) -> Vec<i32> {
    fn walk(d: &Path, out: &mut Vec<i32>) {
        let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
        out.extend(procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                walk(&e.path(), out);
            }
        }
    }
    let mut out = Vec::new();
    for root in ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"] {
        if let Some(d) = locker_tests::machine_cgroup(Path::new(root), id) {
            walk(&d, &mut out);
            break;
        }
    }
    out
}

/// CPU (% of one core) and wake-ups per second of a set of processes over `window`.
#[derive(Debug, Clone, Copy)]
struct Idle {
    cpu_pct: f64,
    wakeups_per_s: f64,
}

fn watch(pids: &[i32], window: Duration) -> Idle {
    let cpu = |p: &[i32]| p.iter().map(|&x| cpu_ms(x)).sum::<f64>();
    let sw = |p: &[i32]| p.iter().map(|&x| switches(x)).sum::<u64>();
    let (c0, s0) = (cpu(pids), sw(pids));
    let t0 = Instant::now();
    std::thread::sleep(window);
    let (c1, s1) = (cpu(pids), sw(pids));
    let wall = t0.elapsed().as_secs_f64();
    Idle {
        cpu_pct: 100.0 * (c1 - c0).max(0.0) / (wall * 1e3),
        wakeups_per_s: s1.saturating_sub(s0) as f64 / wall,
    }
}

/// Holds [`IDLE_SANDBOXES`] idle jail sandboxes and watches for 5 s: the server, the
/// machines' shims and their agents must not wake per sandbox (no per-sandbox timers on
/// either side), so what they use stays far below what a timer per sandbox would cost.
#[test]
fn many_idle_sandboxes_cost_almost_no_cpu_and_no_wakeups_per_sandbox() {
    become_subreaper();
    let n = IDLE_SANDBOXES;
    let srv = Server::start_with(&[
        "--quota-sandboxes",
        &(n + 10).to_string(),
        "--quota-memory-mb",
        "1000000",
        "--quota-disk-mb",
        "1000000",
    ]);
    let api = srv.api();
    // The server alone first: its own timers with nothing to look after.
    std::thread::sleep(Duration::from_secs(1));
    let alone = watch(&[srv.pid() as i32], Duration::from_secs(3));
    let t0 = Instant::now();
    let ids: Vec<String> = (0..n)
        .map(|_| {
            api.create_sandbox(&json!({}))["id"]
                .as_str()
                .expect("id")
                .to_owned()
        })
        .collect();
    eprintln!("{n} sandboxes created in {:?}", t0.elapsed());
    // Each was made (and its first command's tail is done) before the window opens.
    std::thread::sleep(Duration::from_secs(2));
    let machines = srv.data_dir.join("sandboxes");
    let agents: Vec<i32> = ids.iter().flat_map(|id| machine_procs(id)).collect();
    let shims: Vec<i32> = procs_naming(&machines)
        .into_iter()
        .filter(|p| !agents.contains(p))
        .collect();
    assert!(
        shims.len() >= n && agents.len() >= n,
        "every machine has its shim and its agent: {} shims, {} agents for {n}",
        shims.len(),
        agents.len()
    );
    let window = Duration::from_secs(5);
    let server = srv.pid() as i32;
    // One window for all three, so they are measured under the same host load.
    let all: Vec<i32> = std::iter::once(server)
        .chain(shims.iter().copied())
        .chain(agents.iter().copied())
        .collect();
    let cpu0: Vec<f64> = all.iter().map(|&p| cpu_ms(p)).collect();
    let sw0: Vec<u64> = all.iter().map(|&p| switches(p)).collect();
    let t = Instant::now();
    std::thread::sleep(window);
    let wall = t.elapsed().as_secs_f64();
    let part = |range: std::ops::Range<usize>| Idle {
        cpu_pct: 100.0
            * range
                .clone()
                .map(|i| (cpu_ms(all[i]) - cpu0[i]).max(0.0))
                .sum::<f64>()
            / (wall * 1e3),
        wakeups_per_s: range
            .map(|i| switches(all[i]).saturating_sub(sw0[i]))
            .sum::<u64>() as f64
            / wall,
    };
    let srv_idle = part(0..1);
    let shim_idle = part(1..1 + shims.len());
    let agent_idle = part(1 + shims.len()..all.len());
    eprintln!(
        "alone: server {:.2}% of a core, {:.1} wake-ups/s; with {n} idle sandboxes over {window:?}: server {:.2}%, {:.1}/s; {} shims {:.3}%, {:.1}/s; {} agents {:.3}%, {:.1}/s",
        alone.cpu_pct,
        alone.wakeups_per_s,
        srv_idle.cpu_pct,
        srv_idle.wakeups_per_s,
        shims.len(),
        shim_idle.cpu_pct,
        shim_idle.wakeups_per_s,
        agents.len(),
        agent_idle.cpu_pct,
        agent_idle.wakeups_per_s,
    );
    // A timer per sandbox, even once a second, is 200 wake-ups a second here. The server's
    // own timers (the reaper's second, the time splits every 10 s) are not per sandbox.
    assert!(
        srv_idle.wakeups_per_s < alone.wakeups_per_s + n as f64 / 4.0,
        "the server wakes per sandbox while they idle: {:.1}/s with {n}, {:.1}/s alone",
        srv_idle.wakeups_per_s,
        alone.wakeups_per_s
    );
    assert!(
        srv_idle.cpu_pct < 3.0,
        "the server used {:.2}% of a core while {n} sandboxes idled",
        srv_idle.cpu_pct
    );
    // The shims wait for their machine's end; the agents for a connection or a command (an
    // agent's reaper that looked every 5 s made 200 idle machines wake 42 times a second).
    assert!(
        shim_idle.wakeups_per_s + agent_idle.wakeups_per_s < n as f64 / 10.0,
        "idle machines wake up: shims {:.1}/s, agents {:.1}/s for {n}",
        shim_idle.wakeups_per_s,
        agent_idle.wakeups_per_s
    );
    assert!(
        shim_idle.cpu_pct + agent_idle.cpu_pct < 1.0,
        "{n} idle machines used {:.2}% of a core",
        shim_idle.cpu_pct + agent_idle.cpu_pct
    );
    // And they still serve.
    for id in [&ids[0], &ids[n - 1]] {
        assert_eq!(api.sh(id, "echo ok").trim(), "ok");
    }
}

/// The QEMU process of the machine in `dir`, if one runs.
fn qemu_of(dir: &Path) -> Option<i32> {
    procs_naming(dir).into_iter().find(|&p| {
        std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.starts_with("qemu"))
            && !locker_tests::exited(p as u32)
    })
}

/// The machines in `sandboxes` that no sandbox of `ids` owns (the pool's).
fn pooled(sandboxes: &Path, ids: &[&str]) -> Vec<String> {
    std::fs::read_dir(sandboxes)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !ids.contains(&n.as_str()))
        .collect()
}

/// Waits until one pooled microVM runs and is idle (its restore and warm-up done): its pid.
fn idle_pool_machine(srv: &Server, ids: &[&str]) -> (String, i32) {
    let sandboxes = srv.data_dir.join("sandboxes");
    locker_tests::wait_for(Duration::from_secs(120), "a pooled microVM, idle", || {
        let p = pooled(&sandboxes, ids);
        let [one] = p.as_slice() else {
            return None;
        };
        let pid = qemu_of(&sandboxes.join(one))?;
        let before = cpu_ms(pid);
        std::thread::sleep(Duration::from_millis(500));
        (cpu_ms(pid) - before < 100.0).then(|| (one.clone(), pid))
    })
}

/// Most of one core an idle microVM's QEMU may use (under TCG, where every guest wake-up is
/// emulated): its guest's own idle ticks are well under this; a guest spinning is not.
const VM_IDLE_PCT: f64 = 5.0;

/// How long an idle microVM's CPU is watched.
const VM_WINDOW: Duration = Duration::from_secs(10);

/// An idle microVM's QEMU uses little CPU with its server connected, with its server
/// stopped (its agent waits for the next server without spinning), and the next server
/// adopts it at once. A stopped server destroys its pool's waiting microVM; a killed one
/// leaves it, idle, to the next start, which destroys it.
#[test]
fn an_idle_microvm_sleeps_with_or_without_its_server_and_the_pool_goes_with_the_server() {
    become_subreaper();
    let mut srv = Server::start();
    let api = srv.api();
    let body = json!({"runtime": "microvm", "memory_mb": 256});
    let a = api.create_sandbox(&body)["id"]
        .as_str()
        .expect("id")
        .to_owned();
    assert_eq!(api.sh(&a, "echo up").trim(), "up");
    let a_dir = srv.machine_dir(&a);
    let qa = qemu_of(&a_dir).expect("the sandbox's QEMU");
    let (p, qp) = idle_pool_machine(&srv, &[&a]);

    let connected = watch(&[qa], VM_WINDOW);
    let waiting = watch(&[qp], VM_WINDOW);
    eprintln!(
        "idle microVM, server connected: {:.2}% of a core ({:.1} wake-ups/s); pooled: {:.2}%",
        connected.cpu_pct, connected.wakeups_per_s, waiting.cpu_pct
    );

    // A stop: the pool's machine goes with the server, the sandbox's stays, waiting.
    srv.terminate();
    locker_tests::wait_for(
        Duration::from_secs(30),
        "the pooled microVM destroyed at the stop",
        || (qemu_of(&srv.data_dir.join("sandboxes").join(&p)).is_none()).then_some(()),
    );
    assert_eq!(
        qemu_of(&a_dir),
        Some(qa),
        "the sandbox's microVM outlives the stop"
    );
    std::thread::sleep(Duration::from_secs(1));
    let orphaned = watch(&[qa], VM_WINDOW);
    eprintln!(
        "idle microVM, server stopped: {:.2}% of a core ({:.1} wake-ups/s)",
        orphaned.cpu_pct, orphaned.wakeups_per_s
    );

    // The next server adopts it: the agent answers as soon as the host connects.
    srv.restart();
    let t = Instant::now();
    assert_eq!(srv.api().sh(&a, "echo back").trim(), "back");
    let readopted = t.elapsed();
    eprintln!("first command after the restart: {readopted:?}");

    // A kill: the waiting pool machine is left behind, idle, for the next start.
    let api = srv.api();
    let b = api.create_sandbox(&body)["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let (p2, qp2) = idle_pool_machine(&srv, &[&a, &b]);
    srv.kill9();
    std::thread::sleep(Duration::from_secs(1));
    let left = watch(&[qp2], VM_WINDOW);
    eprintln!(
        "pooled microVM of a killed server: {:.2}% of a core ({:.1} wake-ups/s)",
        left.cpu_pct, left.wakeups_per_s
    );
    srv.restart();
    locker_tests::wait_for(
        Duration::from_secs(60),
        "the killed server's pooled microVM destroyed by the next start",
        || (qemu_of(&srv.data_dir.join("sandboxes").join(&p2)).is_none()).then_some(()),
    );
    assert_eq!(srv.api().sh(&b, "echo b").trim(), "b");

    for (what, idle) in [
        ("with its server connected", connected),
        ("waiting in the pool", waiting),
        ("after its server stopped", orphaned),
        ("in the pool of a killed server", left),
    ] {
        assert!(
            idle.cpu_pct < VM_IDLE_PCT,
            "an idle microVM {what} used {:.2}% of a core",
            idle.cpu_pct
        );
    }
    assert!(
        readopted < Duration::from_secs(10),
        "the adopted microVM's first command took {readopted:?}"
    );
}
