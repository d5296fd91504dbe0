//! The jail runtime, tested for real: machines from the default template, as root.
//!
//! Each test starts its own machine through the node (the same path the server takes) and
//! destroys it through a guard, so nothing is left behind even when an assertion fails.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use locker_proto::ExecSpec;
use locker_runtime::node::{Machine, MachineSpec, Node, NodeConfig};
use locker_tests::{
    agent_bin, become_subreaper, default_rootfs, locker_bin, pids_with_uid_in, traces_of, unique,
    TempDir,
};
use locker_types::{ExecResult, Reason};

/// A machine that is destroyed when the guard goes, whatever happened.
struct Guard {
    node: Node,
    machine: Option<Machine>,
    _dir: TempDir,
}

impl Guard {
    fn m(&self) -> &Machine {
        self.machine.as_ref().expect("machine")
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(m) = self.machine.take() {
            let _ = locker_runtime::machine::destroy(&m.id, &m.dir, self.node.layout());
        }
    }
}

fn node() -> Node {
    become_subreaper();
    Node::new(NodeConfig {
        init_exe: locker_bin(),
        shim_exe: locker_runtime::node::find_shim(&locker_bin()),
        agent_exe: agent_bin(),
    })
    .expect("a node on this host")
}

async fn machine(memory_mb: u64, pids: u64) -> Guard {
    let node = node();
    let dir = TempDir::new("locker-jail-test");
    let id = unique("jt").replace('-', "_");
    let spec = MachineSpec {
        id: id.clone(),
        dir: dir.path().join("machines").join(&id),
        template_rootfs: default_rootfs(),
        cpus: 1.0,
        memory_mb,
        disk_mb: 1024,
        pids,
    };
    let m = node.create(spec).await.expect("create a machine");
    Guard {
        node,
        machine: Some(m),
        _dir: dir,
    }
}

fn sh(script: &str) -> ExecSpec {
    ExecSpec {
        call_id: unique("call").replace('-', "_"),
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        max_output_bytes: 65_536,
        timeout_ms: Some(30_000),
        ..Default::default()
    }
}

async fn run(g: &Guard, script: &str) -> ExecResult {
    g.m()
        .agent
        .exec(sh(script), None, None)
        .await
        .expect("exec")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_cannot_see_host_processes_files_or_network() {
    let g = machine(256, 256).await;
    let host_secret = PathBuf::from("/var/tmp").join(unique("locker-host-secret"));
    std::fs::write(&host_secret, "host-only").unwrap();
    let _cleanup = scopeguard(host_secret.clone());

    // Processes: PID 1 is the agent; the test process's pid means nothing inside.
    let r = run(&g, "cat /proc/1/comm; ls -d /proc/[0-9]* | wc -l").await;
    let mut lines = r.stdout.lines();
    assert_eq!(lines.next(), Some("locker-agent"), "{r:?}");
    let n: usize = lines.next().unwrap().trim().parse().unwrap();
    assert!(
        n <= 5,
        "only the agent and this command's processes are visible, saw {n}: {r:?}"
    );
    let r = run(
        &g,
        &format!("kill -0 {} 2>&1 || echo gone", std::process::id()),
    )
    .await;
    assert!(r.stdout.contains("gone"), "host pid reachable: {r:?}");

    // Files: the host's /var/tmp is not the machine's.
    let r = run(
        &g,
        &format!("cat {} 2>&1; echo rc=$?", host_secret.display()),
    )
    .await;
    assert!(
        !r.stdout.contains("host-only") && r.stdout.contains("rc=1"),
        "{r:?}"
    );

    // Network: loopback only, and the host's loopback services are not reachable.
    let r = run(&g, "ip -o link | awk -F': ' '{print $2}'").await;
    assert_eq!(r.stdout.trim(), "lo", "{r:?}");
    let host_listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = host_listener.local_addr().unwrap().port();
    let script = format!(
        "python3 -c 'import socket\nfor h in (\"127.0.0.1\", \"10.0.2.2\", \"172.17.0.1\"):\n  s=socket.socket(); s.settimeout(1)\n  try:\n    s.connect((h,{port})); print(\"CONNECTED\", h)\n  except Exception as e: print(\"no\", h, type(e).__name__)'"
    );
    let r = run(&g, &script).await;
    assert!(!r.stdout.contains("CONNECTED"), "reached the host: {r:?}");
    assert_eq!(r.stdout.lines().count(), 3, "{r:?}");
}

/// Removes a host file on drop.
fn scopeguard(p: PathBuf) -> impl Drop {
    struct G(PathBuf);
    impl Drop for G {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    G(p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_inside_is_nobody_outside() {
    let g = machine(256, 256).await;
    let r = run(&g, "id -u; touch /etc/written && echo wrote-etc").await;
    assert_eq!(
        r.stdout, "0\nwrote-etc\n",
        "root inside can use its own files: {r:?}"
    );
    // The machine's disk stores canonical ids (root = 0), whatever the machine's uid range,
    // so a disk image can start another machine (snapshots, forks).
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(g.m().upper_dir().expect("a jail").join("etc/written"))
        .expect("the file is in the machine's layer");
    assert_eq!((meta.uid(), meta.gid()), (0, 0));
    // On the host the agent runs as the machine's unprivileged uid.
    let status = std::fs::read_to_string(format!(
        "/proc/{}/status",
        g.m().jail().expect("a jail").agent_pid
    ))
    .unwrap();
    let uid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(uid, g.m().uid_base());
    assert!(uid >= 65_536 * 16, "uid {uid} is in an unprivileged range");
    // What only real root could do fails.
    for (what, script) in [
        ("mount", "mount -t tmpfs x /mnt"),
        ("new namespaces", "unshare -U -r true"),
        ("sysctl", "echo 1 > /proc/sys/kernel/domainname"),
        ("hostname", "hostname evil"),
        ("kernel modules", "python3 -c 'import ctypes; l=ctypes.CDLL(None); import sys; sys.exit(0 if l.syscall(175, 0, 0, 0) == 0 else 1)'"),
        ("raw block devices", "ls /dev/vda /dev/sda /dev/loop0 2>/dev/null | grep ."),
    ] {
        let r = run(&g, script).await;
        assert_ne!(r.exit_code, Some(0), "{what} must fail inside a machine: {r:?}");
    }
    let r = run(&g, "grep -E 'NoNewPrivs|Seccomp:' /proc/self/status").await;
    assert!(
        r.stdout.contains("NoNewPrivs:\t1") && r.stdout.contains("Seccomp:\t2"),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_bomb_is_contained_and_the_host_stays_responsive() {
    let g = machine(256, 128).await;
    let bomb = g.m().agent.exec(
        ExecSpec {
            timeout_ms: Some(4000),
            // The bomb runs in a subshell, so the shell that stays (as `sleep`) forks once,
            // before the pids are full: it never hits "Cannot fork" itself.
            ..sh("(bomb() { bomb | bomb & }; bomb); exec sleep 100")
        },
        None,
        None,
    );
    let probe = tokio::task::spawn_blocking(|| {
        std::thread::sleep(Duration::from_millis(1500));
        let t = Instant::now();
        let ok = std::process::Command::new("true")
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        (ok, t.elapsed())
    });
    let r = bomb.await.expect("exec");
    let (ok, took) = probe.await.unwrap();
    assert!(
        ok && took < Duration::from_secs(2),
        "the host could not start a process in time: {took:?}"
    );
    assert_eq!(r.reason, Reason::Timeout, "{r:?}");
    // The machine survived and its tree is gone.
    let r = run(&g, "echo alive").await;
    assert_eq!(r.stdout, "alive\n");
    assert_eq!(
        g.m().pids().len(),
        1,
        "only the agent is left: {:?}",
        g.m().pids()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_hog_ends_with_reason_oom() {
    let g = machine(128, 256).await;
    let r = run(
        &g,
        "python3 -c 'b = bytearray(600 * 1024 * 1024); print(len(b))'",
    )
    .await;
    assert_eq!(r.reason, Reason::Oom, "{r:?}");
    // Without a shell in between there is no exit code at all.
    let r = g
        .m()
        .agent
        .exec(
            ExecSpec {
                argv: vec![
                    "python3".into(),
                    "-c".into(),
                    "b = bytearray(600 << 20)".into(),
                ],
                ..sh("")
            },
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        (r.reason, r.exit_code, r.signal.as_deref()),
        (Reason::Oom, None, Some("SIGKILL")),
        "{r:?}"
    );
    let r = run(&g, "echo fine").await;
    assert_eq!(r.stdout, "fine\n", "the machine lives on after an OOM kill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_kills_setsid_and_double_forked_descendants() {
    let g = machine(256, 256).await;
    let r = g
        .m()
        .agent
        .exec(
            ExecSpec {
                timeout_ms: Some(700),
                ..sh("setsid sleep 1000 & (sh -c 'sleep 1001 &' &); nohup sleep 1002 >/dev/null 2>&1 & echo started; sleep 60")
            },
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.reason, Reason::Timeout, "{r:?}");
    assert_eq!(r.stdout, "started\n", "output before the kill is kept");
    assert!(r.timings.run_ms < 5000.0, "{r:?}");
    let deadline = Instant::now() + Duration::from_secs(3);
    while g.m().pids().len() > 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        g.m().pids().len(),
        1,
        "descendants survived the timeout: {:?}",
        g.m().pids()
    );
    let r = run(&g, "ps -e -o comm= | grep -c sleep").await;
    assert_eq!(r.stdout.trim(), "0", "{r:?}");
}

fn rss_kb(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_megabytes_of_output_come_back_capped_with_memory_flat() {
    let g = machine(512, 256).await;
    let before = rss_kb(std::process::id());
    let r = g
        .m()
        .agent
        .exec(
            ExecSpec {
                max_output_bytes: 65_536,
                ..sh("head -c 100000000 /dev/zero | tr '\\0' 'a'; echo; echo THE-END")
            },
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.reason, Reason::Exited, "{r:?}");
    assert!(r.stdout_truncated);
    assert_eq!(r.stdout_bytes, 100_000_000 + 1 + 8);
    assert!(r.stdout.starts_with("aaaa"), "head kept");
    assert!(r.stdout.ends_with("THE-END\n"), "tail kept");
    assert!(
        r.stdout.contains("bytes omitted]"),
        "marker between head and tail"
    );
    assert!(r.stdout.len() < 70_000, "capped: {} bytes", r.stdout.len());
    let path = r
        .output_path
        .clone()
        .expect("full output kept in the machine");
    let e = g.m().agent.stat(&path).await.unwrap();
    assert_eq!(e.size, r.stdout_bytes, "the spill file holds every byte");
    let grown = rss_kb(std::process::id()).saturating_sub(before);
    assert!(grown < 60_000, "the host side grew by {grown} KiB");
    let agent_rss = rss_kb(g.m().jail().expect("a jail").agent_pid as u32);
    assert!(agent_rss < 60_000, "the agent holds {agent_rss} KiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_round_trip_byte_for_byte_and_never_reach_the_host() {
    let g = machine(256, 256).await;
    let a = &g.m().agent;
    let mut data = vec![0u8; 5 << 20];
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    for name in [
        "/root/plain.bin",
        "/root/with space.bin",
        "/root/ünï ☃.bin",
        "/root/new\nline.bin",
        "/tmp/deep/er/dir/file",
    ] {
        let e = a
            .write_file(name, Some(0o600), &data[..])
            .await
            .expect(name);
        assert_eq!(e.size, data.len() as u64);
        assert_eq!(e.mode & 0o777, 0o600);
        let (_, mut rd) = a.read_file(name).await.unwrap();
        let mut back = Vec::new();
        while let Some(c) = rd.next_chunk().await.unwrap() {
            back.extend_from_slice(&c);
        }
        assert!(back == data, "{name:?} did not round-trip");
    }
    // Escapes: the host's secret stays out of reach whatever the path says.
    let host_secret = PathBuf::from("/var/tmp").join(unique("locker-host-secret"));
    std::fs::write(&host_secret, "host-only").unwrap();
    let _cleanup = scopeguard(host_secret.clone());
    let hs = host_secret.display().to_string();
    run(&g, &format!("ln -s {hs} /root/abs-link; ln -s ../../../../../..{hs} /root/rel-link; ln -s /proc/1/root{hs} /root/magic-link")).await;
    for p in [
        "/root/abs-link",
        "/root/rel-link",
        "/root/magic-link",
        &format!("/../../..{hs}"),
        &format!("/root/../../..{hs}"),
    ] {
        if let Ok((_, mut rd)) = a.read_file(p).await {
            let mut back = Vec::new();
            while let Ok(Some(c)) = rd.next_chunk().await {
                back.extend_from_slice(&c);
            }
            assert!(!back.starts_with(b"host-only"), "{p} read the host's file");
        }
    }
    assert!(
        a.write_file("relative/path", None, &b"x"[..])
            .await
            .is_err(),
        "relative paths are refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destroy_and_orphan_cleanup_leave_nothing() {
    let node = node();
    let dir = TempDir::new("locker-jail-test");
    let machines = dir.path().join("machines");
    let mut made = Vec::new();
    for _ in 0..2 {
        let id = unique("jt").replace('-', "_");
        let spec = MachineSpec {
            id: id.clone(),
            dir: machines.join(&id),
            template_rootfs: default_rootfs(),
            cpus: 1.0,
            memory_mb: 128,
            disk_mb: 256,
            pids: 256,
        };
        let m = node.create(spec).await.unwrap();
        m.agent
            .exec(sh("sleep 100 & echo x > /root/f"), None, None)
            .await
            .unwrap();
        made.push(m);
    }
    // One destroyed the normal way.
    let m = made.remove(0);
    let (id, mdir, base) = (m.id.clone(), m.dir.clone(), m.uid_base());
    node.destroy(&m).await.unwrap();
    let t = traces_of(&id, &mdir);
    assert!(t.is_empty(), "{t:?}");
    assert!(
        pids_with_uid_in(base).is_empty(),
        "processes of the machine survived"
    );
    // One "forgotten" as if the server crashed, then found by the orphan sweep.
    let m = made.remove(0);
    let (id, mdir, base) = (m.id.clone(), m.dir.clone(), m.uid_base());
    std::mem::forget(m);
    let removed = node.cleanup_orphans(&machines, vec![]).await;
    assert_eq!(removed, vec![id.clone()]);
    let t = traces_of(&id, &mdir);
    assert!(t.is_empty(), "{t:?}");
    assert!(
        pids_with_uid_in(base).is_empty(),
        "processes of the orphan survived"
    );
}

/// What a run relies on to read its layer without stopping the machine first: the node
/// tells "nothing but the agent is left" from the machine's cgroups, and a job, a `setsid`
/// double fork or a process that moved to a cgroup of its own all count against it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_agent_left_is_told_from_the_machines_cgroups() {
    let g = machine(128, 256).await;
    assert!(
        g.node.only_agent_left(g.m()),
        "a new machine runs its agent alone"
    );
    run(&g, "true").await;
    assert!(
        g.node.only_agent_left(g.m()),
        "after a command that left nothing"
    );
    for left in [
        "sleep 300 &",
        "setsid sh -c 'sleep 300 &'",
        "(setsid sh -c 'for d in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do mkdir -p $d/own && echo $$ > $d/own/cgroup.procs; done 2>/dev/null; exec sleep 300' &); sleep 0.3",
    ] {
        let mut s = sh(left);
        s.kill_jobs = false;
        g.m().agent.exec(s, None, None).await.expect("exec");
        // The one that moved is a stray, killed when the command ended: a job's tree is
        // what stays.
        let stays = !left.contains("/own");
        assert_eq!(
            g.node.only_agent_left(g.m()),
            !stays,
            "after `{left}`"
        );
        run(&g, "pkill -x sleep; true").await;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !g.node.only_agent_left(g.m()) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(g.node.only_agent_left(g.m()), "after `{left}` was killed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_started_all_at_once_all_start() {
    // Loop devices are handed out one free device at a time: concurrent starts must take
    // turns, not fail (a burst of 100 once lost a few machines this way).
    let node = std::sync::Arc::new(node());
    let dir = TempDir::new("locker-jail-test");
    let rootfs = default_rootfs();
    let starts = (0..24).map(|_| {
        let (node, machines, rootfs) = (node.clone(), dir.path().join("machines"), rootfs.clone());
        tokio::spawn(async move {
            let id = unique("jt").replace('-', "_");
            let spec = MachineSpec {
                id: id.clone(),
                dir: machines.join(&id),
                template_rootfs: rootfs,
                cpus: 1.0,
                memory_mb: 64,
                disk_mb: 64,
                pids: 256,
            };
            node.create(spec).await
        })
    });
    let results: Vec<_> = futures_join(starts.collect()).await;
    let mut failed = Vec::new();
    for r in results {
        match r {
            Ok(m) => {
                let _ = node.destroy(&m).await;
            }
            Err(e) => failed.push(e.to_string()),
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 24 machines failed to start: {:?}",
        failed.len(),
        failed.first()
    );
}

async fn futures_join<T>(handles: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("task"));
    }
    out
}
