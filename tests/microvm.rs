//! The microVM runtime, tested for real: QEMU `microvm` machines with their own kernel,
//! restored from a booted base (under TCG on hosts without usable KVM).
//!
//! VM tests run one at a time (a lock), each destroys its machines through a guard, and a
//! final check finds no QEMU left that any of them started.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use locker_proto::ExecSpec;
use locker_runtime::node::{Attach, Machine, MachineSpec, Node, NodeConfig, RuntimeKind};
use locker_tests::{
    agent_bin, become_subreaper, default_rootfs, locker_bin, procs_naming, unique, TempDir,
};
use locker_types::{ExecResult, Reason};

/// One VM test at a time: TCG on two cores has no room for more.
static SERIAL: Mutex<()> = Mutex::new(());

fn node() -> Node {
    become_subreaper();
    Node::new(NodeConfig {
        init_exe: locker_bin(),
        shim_exe: locker_runtime::node::find_shim(&locker_bin()),
        agent_exe: agent_bin(),
    })
    .expect("a node on this host")
}

/// Machines destroyed when the guard goes, whatever happened.
struct Vms {
    node: Node,
    dir: TempDir,
    machines: Vec<Machine>,
}

impl Vms {
    fn new() -> Self {
        Self {
            node: node(),
            dir: TempDir::new("locker-vm-test"),
            machines: Vec::new(),
        }
    }

    fn spec(&self, memory_mb: u64) -> MachineSpec {
        let id = unique("vm").replace('-', "_");
        MachineSpec {
            dir: self.dir.path().join("machines").join(&id),
            id,
            template_rootfs: default_rootfs(),
            cpus: 1.0,
            memory_mb,
            disk_mb: 1024,
            pids: 512,
        }
    }

    /// Starts a microVM (from `snapshot`, a directory [`Node::snapshot`] filled, if given).
    async fn start(&mut self, snapshot: Option<&Path>) -> usize {
        let spec = self.spec(256);
        let attach = Attach {
            runtime: RuntimeKind::Microvm,
            disk_from: snapshot.map(|d| d.join("disk.img")),
            memory_from: snapshot.map(|d| d.join("memory")),
            ..Default::default()
        };
        let m = self
            .node
            .create_attached(spec, attach)
            .await
            .expect("start a microVM");
        assert_eq!(m.kind(), RuntimeKind::Microvm);
        self.machines.push(m);
        self.machines.len() - 1
    }

    fn m(&self, i: usize) -> &Machine {
        &self.machines[i]
    }
}

impl Drop for Vms {
    fn drop(&mut self) {
        for m in self.machines.drain(..) {
            let _ = locker_runtime::machine::destroy(&m.id, &m.dir, self.node.layout());
        }
    }
}

fn sh(script: &str, timeout_ms: u64) -> ExecSpec {
    ExecSpec {
        call_id: unique("call").replace('-', "_"),
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        max_output_bytes: 1 << 20,
        timeout_ms: Some(timeout_ms),
        ..Default::default()
    }
}

async fn run(m: &Machine, script: &str) -> ExecResult {
    m.agent
        .exec(sh(script, 60_000), None, None)
        .await
        .expect("exec")
}

// The lock only orders whole tests (each on its own runtime); holding it across awaits is
// the point.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvm_runs_its_own_kernel_and_serves_exec_and_files() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut vms = Vms::new();
    let t0 = Instant::now();
    let i = vms.start(None).await;
    eprintln!("first microVM (base boot included) in {:?}", t0.elapsed());
    let m = vms.m(i);

    // Its own kernel: not the host's.
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let r = run(m, "uname -r; hostname; cat /proc/1/comm").await;
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let mut lines = r.stdout.lines();
    let guest = lines.next().unwrap_or_default();
    assert!(
        !guest.is_empty() && guest != host.trim(),
        "guest kernel {guest:?} vs host {host:?}"
    );
    assert_eq!(
        lines.next(),
        Some(m.id.as_str()),
        "hostname is the machine id: {r:?}"
    );
    // The clock was re-seeded after the restore.
    let r = run(m, "date +%s").await;
    let guest_now: i64 = r.stdout.trim().parse().expect("a number");
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (guest_now - host_now).abs() <= 5,
        "guest clock {guest_now} vs host {host_now}"
    );

    // Streaming output arrives while the command runs.
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let spec = sh("for i in 1 2 3; do echo line$i; sleep 0.3; done", 30_000);
    let agent = &m.agent;
    let exec = agent.exec(spec, None, Some(tx));
    let collect = async {
        let mut got = Vec::new();
        while let Some((_, chunk)) = rx.recv().await {
            got.push((Instant::now(), chunk));
        }
        got
    };
    let (r, chunks) = tokio::join!(exec, collect);
    let r = r.expect("streaming exec");
    assert_eq!(r.exit_code, Some(0));
    assert!(chunks.len() >= 2, "output came in pieces: {chunks:?}");
    let spread = chunks.last().unwrap().0 - chunks[0].0;
    assert!(
        spread >= Duration::from_millis(300),
        "chunks arrived as they were written"
    );

    // A timeout kills the whole tree.
    let t = Instant::now();
    let r = m
        .agent
        .exec(sh("sleep 300 & sleep 300; wait", 1500), None, None)
        .await
        .expect("exec with timeout");
    assert_eq!(r.reason, Reason::Timeout, "{r:?}");
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "timeout took {:?}",
        t.elapsed()
    );
    let r = run(m, "pgrep -c sleep || true").await;
    assert_eq!(r.stdout.trim(), "0", "the tree is gone: {r:?}");

    // Files round trip through the agent.
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    m.agent
        .write_file("/root/blob.bin", Some(0o600), &data[..])
        .await
        .expect("write a file");
    let r = run(m, "sha256sum /root/blob.bin | cut -d' ' -f1").await;
    use locker_tests::hex_sha256;
    assert_eq!(r.stdout.trim(), hex_sha256(&data));
    let (entry, mut reader) = m.agent.read_file("/root/blob.bin").await.expect("read");
    assert_eq!(entry.size, data.len() as u64);
    let mut back = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut reader, &mut back)
        .await
        .unwrap();
    assert_eq!(back, data);

    // Destroy leaves nothing: no QEMU, no directory, no cgroup.
    let m = vms.machines.pop().unwrap();
    let dir = m.dir.clone();
    vms.node.destroy(&m).await.expect("destroy");
    assert!(!dir.exists(), "the machine's directory is gone");
    assert!(procs_naming(&dir).is_empty(), "no QEMU left");
    assert!(
        !vms.node
            .layout()
            .machine_names()
            .contains(&locker_runtime::cgroup::machine_name(&m.id, &dir)),
        "no cgroup left"
    );
}

// The lock only orders whole tests (each on its own runtime); holding it across awaits is
// the point.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn microvm_snapshot_keeps_memory_and_forks_carry_it_on() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut vms = Vms::new();
    let i = vms.start(None).await;
    // A background process counting in memory only (no file): it survives only if the
    // snapshot carries the VM's memory.
    let m = vms.m(i);
    let mut counter = sh(
        "n=0; while true; do n=$((n+1)); echo $n > /dev/shm/count.new; mv /dev/shm/count.new /dev/shm/count; sleep 0.1; done",
        0,
    );
    counter.timeout_ms = None;
    m.agent.spawn(counter).await.expect("spawn the counter");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let snap = vms.dir.path().join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    let t = Instant::now();
    let (size, has_memory) = vms.node.snapshot(m, &snap).await.expect("snapshot");
    eprintln!("snapshot with memory: {size} bytes in {:?}", t.elapsed());
    assert!(has_memory);
    let before: u64 = run(m, "cat /dev/shm/count")
        .await
        .stdout
        .trim()
        .parse()
        .unwrap();
    assert!(before > 0);

    let t = Instant::now();
    let c = vms.start(Some(&snap)).await;
    eprintln!("restore from the snapshot in {:?}", t.elapsed());
    let child = vms.m(c);
    let a: u64 = run(child, "cat /dev/shm/count")
        .await
        .stdout
        .trim()
        .parse()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let b: u64 = run(child, "cat /dev/shm/count")
        .await
        .stdout
        .trim()
        .parse()
        .unwrap();
    assert!(
        a > 0 && b > a,
        "the counter continues in the child: {a} then {b}"
    );
    let r = run(child, "hostname").await;
    assert_eq!(r.stdout.trim(), child.id, "the child has its own name");

    // Crash: kill QEMU; destroy still removes everything.
    let dirs: Vec<PathBuf> = vms.machines.iter().map(|m| m.dir.clone()).collect();
    for pid in procs_naming(&dirs[1]) {
        // SAFETY: kill(2) on a pid; no memory is involved.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while vms.m(c).is_alive() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!vms.m(c).is_alive(), "a killed QEMU is seen as dead");
    for m in std::mem::take(&mut vms.machines) {
        vms.node.destroy(&m).await.expect("destroy");
    }
    for d in &dirs {
        assert!(!d.exists(), "{} is gone", d.display());
        assert!(procs_naming(d).is_empty());
    }
}

/// Through the real server: microVM sandboxes, their memory snapshots and forks, adoption
/// after a server SIGKILL, clear refusals for what microVMs do not do yet.
/// A machine that no [`Machine`] handle holds, destroyed when the guard goes.
struct Loose {
    id: String,
    dir: PathBuf,
    layout: locker_runtime::cgroup::Layout,
}

impl Drop for Loose {
    fn drop(&mut self) {
        let _ = locker_runtime::machine::destroy(&self.id, &self.dir, &self.layout);
    }
}

/// The uid-range lease files naming `dir` as their owner.
fn leases_of(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir("/run/locker/uid-slots")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read(p).is_ok_and(|o| o == dir.as_os_str().as_encoded_bytes()))
        .collect()
}

// A start given up half way (its caller went away, as an HTTP client that hangs up does)
// leaves nothing of the machine: no QEMU, no cgroup, no directory, no uid lease.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_microvm_start_given_up_half_way_leaves_nothing() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut vms = Vms::new();
    // The base is booted (or found) first, so the start given up below is a restore.
    vms.start(None).await;
    let spec = vms.spec(256);
    let loose = Loose {
        id: spec.id.clone(),
        dir: spec.dir.clone(),
        layout: vms.node.layout().clone(),
    };
    let attach = Attach {
        runtime: RuntimeKind::Microvm,
        ..Default::default()
    };
    let mut create = Box::pin(vms.node.create_attached(spec, attach));
    // QEMU's control socket: QEMU runs, in the machine's cgroup, as the machine's uid.
    let qmp = loose.dir.join("qmp.sock");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !qmp.exists() {
        assert!(Instant::now() < deadline, "QEMU never started");
        tokio::select! {
            r = &mut create => {
                if let Ok(m) = r {
                    vms.machines.push(m);
                }
                panic!("the start ended before QEMU was seen");
            }
            _ = tokio::time::sleep(Duration::from_millis(1)) => {}
        }
    }
    assert!(!procs_naming(&loose.dir).is_empty(), "QEMU runs");
    assert_eq!(
        leases_of(&loose.dir).len(),
        1,
        "the machine holds a uid lease"
    );
    drop(create);

    let cgroup =
        locker_runtime::cgroup::MachineCgroup::new(loose.layout.clone(), &loose.id, &loose.dir);
    let what = "the machine given up is torn down (QEMU, cgroup, directory, uid lease)";
    tokio::task::spawn_blocking(move || {
        locker_tests::wait_for(Duration::from_secs(20), what, || {
            let left = !procs_naming(&loose.dir).is_empty()
                || cgroup.dirs().iter().any(|(_, d)| d.exists())
                || loose.dir.exists()
                || !leases_of(&loose.dir).is_empty();
            (!left).then_some(())
        });
        drop(loose);
    })
    .await
    .expect("the wait");
}

#[test]
fn microvm_sandboxes_through_the_api() {
    use locker_tests::server::Server;
    use serde_json::json;
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    become_subreaper();
    let mut srv = Server::start();
    let api = srv.api();
    let sb = api.create_sandbox(&json!({"runtime": "microvm", "memory_mb": 256}));
    assert_eq!(sb["runtime"], "microvm", "{sb}");
    let sb = sb["id"].as_str().unwrap().to_owned();
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let guest = api.sh(&sb, "uname -r");
    assert_ne!(guest.trim(), host.trim(), "a kernel of its own");

    // Files API.
    api.write_file(&sb, "/root/hello.txt", b"from the host")
        .expect(200, "write a file");
    assert_eq!(api.sh(&sb, "cat /root/hello.txt"), "from the host");
    assert_eq!(
        api.read_file(&sb, "/root/hello.txt").text(),
        "from the host"
    );

    // The pool: after the first create of a shape, one restored and warmed microVM waits
    // (a directory under sandboxes/ no sandbox owns); the next create takes it, under that
    // machine's id, with its own name and a fresh clock.
    let sandboxes = srv.machine_dir(&sb).parent().unwrap().to_owned();
    let waiting = || -> Vec<String> {
        std::fs::read_dir(&sandboxes)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| *n != sb)
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while waiting().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let pooled = waiting();
    assert_eq!(pooled.len(), 1, "one pooled microVM waits: {pooled:?}");
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    let second = api.create_sandbox(&json!({"runtime": "microvm", "memory_mb": 256}));
    let took = t.elapsed();
    let second = second["id"].as_str().unwrap().to_owned();
    assert_eq!(second, pooled[0], "the create took the pooled machine");
    assert_eq!(api.sh(&second, "hostname").trim(), second.as_str());
    let guest_now: i64 = api.sh(&second, "date +%s").trim().parse().unwrap();
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (guest_now - host_now).abs() <= 2,
        "clock refreshed at take: {guest_now} vs {host_now}"
    );
    eprintln!("create from the pool took {took:?}");
    api.delete(&format!("/v1/sandboxes/{second}"))
        .expect(204, "delete the pooled one");

    // A background counter in memory; a snapshot carries it; forks continue it.
    api.post(
        &format!("/v1/sandboxes/{sb}/processes"),
        &json!({"shell": "n=0; while :; do n=$((n+1)); echo $n > /dev/shm/n.new; mv /dev/shm/n.new /dev/shm/n; sleep 0.1; done"}),
    )
    .expect(200, "counter");
    api.sh(&sb, "while [ ! -s /dev/shm/n ]; do sleep 0.05; done");
    let snap = api
        .post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
        .expect(201, "snapshot");
    assert_eq!(snap["has_memory"], true, "{snap}");
    assert_eq!(snap["runtime"], "microvm", "{snap}");
    let forks = api
        .post(&format!("/v1/sandboxes/{sb}/fork"), &json!({"count": 2}))
        .expect(201, "fork");
    let kids: Vec<String> = forks["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kids.len(), 2);
    for k in &kids {
        let a: u64 = api.sh(k, "cat /dev/shm/n").trim().parse().unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let b: u64 = api.sh(k, "cat /dev/shm/n").trim().parse().unwrap();
        assert!(
            a > 0 && b > a,
            "fork {k}: the counter continues ({a} then {b})"
        );
        assert_eq!(api.sh(k, "hostname").trim(), k.as_str());
    }
    let from_snap = api.create_sandbox(&json!({"from_snapshot": snap["id"]}));
    assert_eq!(from_snap["runtime"], "microvm", "{from_snap}");
    let fs_id = from_snap["id"].as_str().unwrap().to_owned();
    assert!(
        api.sh(&fs_id, "cat /dev/shm/n")
            .trim()
            .parse::<u64>()
            .unwrap()
            > 0
    );
    // A memory snapshot cannot start a jail.
    api.post(
        "/v1/sandboxes",
        &json!({"from_snapshot": snap["id"], "runtime": "jail"}),
    )
    .expect_error(400, "bad_request", "jail from a memory snapshot");

    // The snapshot names the QEMU that wrote its memory; one another QEMU version wrote
    // (the host's QEMU upgraded since) is refused with a 409 that says so, before any
    // machine is made (QEMU's own failure would be "Size mismatch: pc.bios").
    let snap_dir = srv
        .machine_dir(&sb)
        .parent()
        .and_then(Path::parent)
        .expect("the sandboxes' directory")
        .join("snapshots")
        .join(snap["id"].as_str().unwrap());
    let mark = snap_dir.join("memory.qemu");
    let wrote = std::fs::read_to_string(&mark).expect("the snapshot's QEMU version");
    let qemu = std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .unwrap();
    let qemu = String::from_utf8_lossy(&qemu.stdout).into_owned();
    assert!(
        qemu.starts_with(&format!("QEMU emulator version {}.", wrote.trim())),
        "{wrote:?} is the host's: {qemu}"
    );
    let listed = |api: &locker_tests::server::Api| {
        api.get("/v1/sandboxes").expect(200, "list")["sandboxes"]
            .as_array()
            .unwrap()
            .len()
    };
    let before = listed(&api);
    std::fs::write(&mark, "7.1\n").unwrap();
    let e = api
        .post("/v1/sandboxes", &json!({"from_snapshot": snap["id"]}))
        .expect_error(409, "conflict", "memory of another QEMU");
    assert!(
        e.contains("written by QEMU 7.1") && e.contains("copy its files"),
        "{e}"
    );
    assert_eq!(
        listed(&api),
        before,
        "no sandbox left by the refused create: {}",
        api.get("/v1/sandboxes").text()
    );
    std::fs::write(&mark, wrote).unwrap();

    // Pause and resume freeze the whole VM.
    api.post_empty(&format!("/v1/sandboxes/{sb}/pause"))
        .expect(200, "pause");
    assert_eq!(api.sh(&sb, "echo awake"), "awake\n", "a call resumes it");

    // The server dies; the VMs live on and the next server adopts them.
    srv.restart();
    let api = srv.api();
    assert_eq!(api.sh(&sb, "echo adopted"), "adopted\n");

    // A microVM created with egress `none` has no network device: no other policy fits.
    let e = api
        .patch(
            &format!("/v1/sandboxes/{sb}"),
            &json!({"network": {"egress": "all"}}),
        )
        .expect_error(409, "conflict", "egress for a microVM without a NIC");
    assert!(e.contains("network device"), "{e}");
    assert_eq!(
        api.sh(&sb, "ls /sys/class/net | tr '\\n' ' '").trim(),
        "lo",
        "no network device at all"
    );

    // Deleting leaves no QEMU behind.
    let data = srv.machine_dir(&sb).parent().unwrap().to_owned();
    for id in kids.iter().chain([&sb, &fs_id]) {
        api.delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete");
    }
    assert!(
        procs_naming(&data).is_empty(),
        "no QEMU left under {}",
        data.display()
    );
}

/// Egress of microVM sandboxes, through the real server: the same host rules as a jail's.
/// `all` reaches a test server on the host (in a namespace of its own) but not the
/// metadata address nor Locker's port; `allow` reaches an allowed name through the proxy
/// and is refused another (recorded in the call); a policy change applies; destroy leaves
/// no namespace, link, table or lease.
#[test]
fn microvm_egress_all_and_allow_through_the_api() {
    use locker_tests::egress::{
        denied_of, host_address, lease, reach, run_sh, wait_egress_ok, TestNet, GREETING, REFUSED,
    };
    use locker_tests::server::Server;
    use serde_json::json;
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    become_subreaper();
    let (a, b) = (TestNet::start(), TestNet::start());
    let mut srv = Server::start_with(&[
        "--egress-resolve",
        &format!("allowed.test={}", a.addr),
        "--egress-resolve",
        &format!("other.test={}", b.addr),
    ]);
    wait_egress_ok(&srv);
    let api = srv.api();
    // The first create of a shape boots its base (seconds): time the second.
    let create = |network: serde_json::Value| -> (String, Duration) {
        let t = Instant::now();
        let sb = api
            .create_sandbox(&json!({"runtime": "microvm", "memory_mb": 256, "network": network}));
        assert_eq!(sb["runtime"], "microvm", "{sb}");
        (sb["id"].as_str().unwrap().to_owned(), t.elapsed())
    };
    for network in [json!({"egress": "all"}), json!({"egress": "none"})] {
        let (warm, _) = create(network);
        api.delete(&format!("/v1/sandboxes/{warm}"))
            .expect(204, "delete");
    }
    let (none, t_none) = create(json!({"egress": "none"}));
    let (all, t_all) = create(json!({"egress": "all"}));
    eprintln!("microVM create: egress none {t_none:?}, egress all {t_all:?}");

    // all: the test server, by address; nothing of the host, no metadata.
    let (slot, link, mip) = lease(&srv, &all).expect("egress all: a lease");
    let netns = format!("/run/netns/locker-lk{slot}");
    assert!(Path::new("/sys/class/net").join(&link).exists(), "its veth");
    assert!(Path::new(&netns).exists(), "its namespace");
    assert!(
        api.sh(&all, "cat /proc/net/fib_trie").contains(&mip),
        "the guest owns the machine address"
    );
    assert_eq!(reach(&api, &all, &a.addr.to_string(), a.port), GREETING);
    let gw = {
        let ip: std::net::Ipv4Addr = mip.parse().unwrap();
        std::net::Ipv4Addr::from(u32::from(ip) - 1).to_string()
    };
    let locker_port = srv.addr.port();
    for (addr, port, what) in [
        ("169.254.169.254", 80, "the metadata address"),
        (gw.as_str(), locker_port, "Locker's port on the host end"),
        (
            host_address().as_str(),
            locker_port,
            "Locker's port on the uplink",
        ),
    ] {
        assert_eq!(
            reach(&api, &all, addr, port),
            "FAILED",
            "{what} ({addr}:{port})"
        );
    }
    // Its resolver is the host end, which answers names (`all` resolves everything).
    assert_eq!(
        api.sh(&all, "getent hosts allowed.test | cut -d' ' -f1")
            .trim(),
        a.addr.to_string()
    );

    // none: a microVM without any network device.
    assert_eq!(
        api.sh(&none, "ls /sys/class/net | tr '\\n' ' '").trim(),
        "lo",
        "egress none: no network device"
    );

    // PATCH to allow: the allowed name through the proxy, another refused and recorded.
    let p = api
        .patch(
            &format!("/v1/sandboxes/{all}"),
            &json!({"network": {"egress": "allow", "allow": ["allowed.test"]}}),
        )
        .expect(200, "patch to allow");
    assert_eq!(p["network"]["egress"], "allow", "{p}");
    let (code, out, _, _) = run_sh(&api, &all, "curl -sS -m 5 http://allowed.test/");
    assert_eq!((code, out.trim()), (0, a.name.as_str()), "the allowed name");
    let (code, _, err, call) = run_sh(&api, &all, "curl -sS -m 5 http://other.test/");
    assert_ne!(code, 0, "another name is refused: {err}");
    assert!(
        denied_of(&api, &format!("sandbox_id={all}"), &call).contains(&"other.test".to_owned()),
        "the refusal is recorded"
    );
    let (_, out, err, _) = run_sh(&api, &all, &format!("curl -sS -m 5 http://{}/", a.addr));
    assert!(
        !out.contains(&a.name) && (out.contains(REFUSED) || !err.is_empty()),
        "a bare address is refused: {out} {err}"
    );
    // PATCH to none keeps the device and closes the link; back to all opens it again.
    api.patch(
        &format!("/v1/sandboxes/{all}"),
        &json!({"network": {"egress": "none"}}),
    )
    .expect(200, "patch to none");
    assert_eq!(
        reach(&api, &all, &a.addr.to_string(), a.port),
        "FAILED",
        "closed"
    );
    api.patch(
        &format!("/v1/sandboxes/{all}"),
        &json!({"network": {"egress": "all"}}),
    )
    .expect(200, "patch back to all");
    assert_eq!(
        reach(&api, &all, &a.addr.to_string(), a.port),
        GREETING,
        "open again"
    );

    // The server dies by SIGKILL; the next one adopts the VM and steers its link to its
    // own proxy and DNS responder.
    srv.restart();
    let api = srv.api();
    assert_eq!(
        reach(&api, &all, &a.addr.to_string(), a.port),
        GREETING,
        "adopted with its egress"
    );
    assert_eq!(
        api.sh(&all, "getent hosts allowed.test | cut -d' ' -f1")
            .trim(),
        a.addr.to_string(),
        "the new server's DNS responder answers"
    );

    // A fork carries the NIC in its memory; the child gets a link of its own (another
    // lease) and reaches the same server, the parent keeps its own.
    let forks = api
        .post(&format!("/v1/sandboxes/{all}/fork"), &json!({"count": 1}))
        .expect(201, "fork a microVM with a NIC");
    let child = forks["sandboxes"][0]["id"].as_str().unwrap().to_owned();
    assert_eq!(forks["sandboxes"][0]["network"]["egress"], "all", "{forks}");
    assert_eq!(
        reach(&api, &child, &a.addr.to_string(), a.port),
        GREETING,
        "the fork reaches out through its own link"
    );
    let (child_lease, _, _) = lease(&srv, &child).expect("the fork has a lease");
    assert_ne!(child_lease, slot, "the fork has its own subnet");
    assert_eq!(
        reach(&api, &all, &a.addr.to_string(), a.port),
        GREETING,
        "the parent still does"
    );
    api.delete(&format!("/v1/sandboxes/{child}"))
        .expect(204, "delete the fork");
    assert!(
        !Path::new("/run/locker/net-slots")
            .join(child_lease.to_string())
            .exists(),
        "no lease of the fork left"
    );

    // Destroy leaves nothing of its network.
    for id in [&all, &none] {
        api.delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete");
    }
    assert!(!Path::new(&netns).exists(), "no namespace left");
    assert!(
        !Path::new("/sys/class/net").join(&link).exists(),
        "no veth left"
    );
    assert!(
        !Path::new("/run/locker/net-slots")
            .join(slot.to_string())
            .exists(),
        "no lease left"
    );
    let tables = std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&tables.stdout).contains(&format!("locker_{link}")),
        "no host table left"
    );
    drop(b);
}

/// Volumes in microVMs, through the real server: sandboxes mount a volume live (read-write
/// and read-only, beside a jail on the same volume), the guest kernel checks permissions,
/// the volume's size holds, the file server survives a server restart and goes with its
/// machine; a microVM run sees its private layer and commits like a jail's; a snapshot of
/// a microVM with volumes restores with the same mounts, its guest's processes working on
/// in the volume.
#[test]
fn microvm_volumes_in_sandboxes_and_runs() {
    use locker_tests::server::{enc, Server};
    use serde_json::json;
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    become_subreaper();
    let mut srv = Server::start();
    let api = srv.api();
    let vol = api
        .post("/v1/volumes", &json!({"name": "vmvol", "size_mb": 64}))
        .expect(201, "create a volume");
    let vol = vol["id"].as_str().unwrap().to_owned();
    let put = |path: &str, data: &[u8]| {
        api.put(&format!("/v1/volumes/{vol}/files?path={}", enc(path)), data)
            .expect(200, "upload");
    };
    let get = |path: &str| api.get(&format!("/v1/volumes/{vol}/files?path={}", enc(path)));
    put("/seed.txt", b"seeded");

    let a = api.create_sandbox(&json!({
        "runtime": "microvm", "memory_mb": 256,
        "volumes": [{"volume": vol, "path": "/workspace"}],
    }));
    assert_eq!(a["runtime"], "microvm", "{a}");
    let a = a["id"].as_str().unwrap().to_owned();
    let b = api.create_sandbox(&json!({
        "runtime": "microvm", "memory_mb": 256,
        "volumes": [{"volume": vol, "path": "/data", "read_only": true}],
    }))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let c = api.create_sandbox(&json!({
        "runtime": "jail",
        "volumes": [{"volume": vol, "path": "/workspace"}],
    }))["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // Live, both ways, across machines and runtimes.
    assert_eq!(api.sh(&a, "cat /workspace/seed.txt"), "seeded");
    api.sh(
        &a,
        "cd /workspace && echo from-vm > a.txt && mkdir -p d/e \
         && for i in $(seq 1 300); do : > d/e/f$i; done && mv a.txt a2.txt && ln a2.txt hard \
         && ln -s a2.txt link && test \"$(readlink link)\" = a2.txt",
    );
    assert_eq!(get("/a2.txt").text(), "from-vm\n");
    assert_eq!(
        api.sh(&c, "cat /workspace/link /workspace/hard"),
        "from-vm\nfrom-vm\n"
    );
    assert_eq!(api.sh(&a, "ls /workspace/d/e | wc -l").trim(), "300");
    api.sh(&c, "echo from-jail > /workspace/j.txt");
    assert_eq!(api.sh(&a, "cat /workspace/j.txt"), "from-jail\n");
    assert_eq!(api.sh(&b, "cat /data/a2.txt"), "from-vm\n");
    // Data through FUSE both ways, checked by another runtime.
    let sum = api.sh(
        &a,
        "head -c 6000000 /dev/urandom > /workspace/big && sha256sum < /workspace/big",
    );
    assert_eq!(api.sh(&c, "sha256sum < /workspace/big"), sum);
    // Ownership and permissions: the guest's ids land on the host's canonical ids, and the
    // guest kernel refuses what the modes forbid.
    api.sh(
        &a,
        "touch /workspace/owned && chown 1234:1234 /workspace/owned && chmod 600 /workspace/owned",
    );
    let r = api.exec(&a, &json!({"shell": "chown 70000 /workspace/owned"}));
    assert_ne!(r["exit_code"], 0, "ids past 65535 are refused: {r}");
    assert_eq!(
        api.sh(&c, "stat -c %u:%g:%a /workspace/owned").trim(),
        "1234:1234:600"
    );
    let r = api.exec(
        &a,
        &json!({"shell": "setpriv --reuid 65534 --regid 65534 --clear-groups cat /workspace/owned"}),
    );
    assert_ne!(
        r["exit_code"], 0,
        "nobody may not read a 600 file of uid 1234: {r}"
    );
    assert!(
        r["stderr"].as_str().unwrap().contains("Permission denied"),
        "{r}"
    );
    // Read-only stays read-only.
    let r = api.exec(&b, &json!({"shell": "touch /data/nope"}));
    assert_ne!(r["exit_code"], 0, "{r}");
    assert!(r["stderr"].as_str().unwrap().contains("Read-only"), "{r}");
    assert_eq!(get("/nope").status, 404);
    // The volume's size holds through a microVM too.
    let r = api.exec(
        &a,
        &json!({"shell": "dd if=/dev/zero of=/workspace/fill bs=1M count=100 2>&1; rm -f /workspace/fill", "timeout_ms": 120000}),
    );
    assert!(
        r["stdout"].as_str().unwrap().contains("No space left"),
        "{r}"
    );
    assert_eq!(api.sh(&a, "cat /workspace/seed.txt"), "seeded");
    // The guest's files API reaches the volume through its mount.
    assert_eq!(api.read_file(&a, "/workspace/j.txt").text(), "from-jail\n");

    // A snapshot holds the guest's volume mounts with its memory: a sandbox from it mounts
    // the same paths (anything else is refused, saying which), and its processes' working
    // directories and names in the volume go on. The sandbox snapshotted goes on too.
    api.post(
        &format!("/v1/sandboxes/{a}/processes"),
        &json!({"shell": "cd /workspace/d && while :; do if [ -e go ]; then echo \"alive in $(basename $PWD)\" >> out; rm -f go; fi; sleep 0.1; done"}),
    )
    .expect(200, "a process working in the volume");
    let snap = api
        .post_empty(&format!("/v1/sandboxes/{a}/snapshots"))
        .expect(201, "snapshot of a microVM with volumes");
    let snap = snap["id"].as_str().unwrap().to_owned();
    api.sh(
        &a,
        "pkill -f 'if \\[ -e go' ; echo after > /workspace/after.txt",
    );
    for (volumes, what) in [
        (json!([]), "no volume"),
        (
            json!([{"volume": vol, "path": "/elsewhere"}]),
            "another path",
        ),
        (
            json!([{"volume": vol, "path": "/workspace", "read_only": true}]),
            "read-only",
        ),
    ] {
        let e = api
            .post(
                "/v1/sandboxes",
                &json!({"from_snapshot": snap, "volumes": volumes}),
            )
            .expect_error(400, "bad_request", what);
        assert!(e.contains("mounted at /workspace"), "{what}: {e}");
    }
    let r = api.create_sandbox(&json!({
        "from_snapshot": snap,
        "volumes": [{"volume": vol, "path": "/workspace"}],
    }));
    assert_eq!(r["runtime"], "microvm", "{r}");
    let r = r["id"].as_str().unwrap().to_owned();
    assert_eq!(api.sh(&r, "cat /workspace/after.txt"), "after\n");
    let holders = |id: &str| api.sh(id, "pgrep -f 'if \\[ -e go' | wc -l");
    assert_eq!((holders(&a).trim(), holders(&r).trim()), ("0", "1"));
    put("/d/go", b"");
    locker_tests::wait_for(
        Duration::from_secs(30),
        "the restored process at work",
        || {
            let out = get("/d/out");
            (out.status == 200 && out.text().ends_with('\n')).then(|| out.text())
        },
    );
    assert_eq!(get("/d/out").text(), "alive in d\n");
    assert_eq!(api.delete(&format!("/v1/sandboxes/{r}")).status, 204);
    // A fork's child mounts its parent's volumes where the parent does.
    let kids = api
        .post(&format!("/v1/sandboxes/{a}/fork"), &json!({"count": 1}))
        .expect(201, "fork of a microVM with volumes");
    let kid = kids["sandboxes"][0]["id"].as_str().unwrap().to_owned();
    assert_eq!(
        api.sh(
            &kid,
            "cat /workspace/after.txt && echo kid > /workspace/kid.txt"
        ),
        "after\n"
    );
    assert_eq!(get("/kid.txt").text(), "kid\n");
    assert_eq!(api.delete(&format!("/v1/sandboxes/{kid}")).status, 204);

    // The server dies; the file servers live on with their VMs.
    srv.restart();
    let api = srv.api();
    let get = |path: &str| api.get(&format!("/v1/volumes/{vol}/files?path={}", enc(path)));
    assert_eq!(api.sh(&a, "cat /workspace/seed.txt"), "seeded");

    // A microVM run: its own layer, committed like a jail run's.
    let r = api
        .post(
            &format!("/v1/volumes/{vol}/run"),
            &json!({"runtime": "microvm", "memory_mb": 256,
                    "shell": "cat seed.txt && echo run > r.txt && rm seed.txt && uname -r"}),
        )
        .expect(200, "a microVM run");
    assert_eq!(r["exit_code"], 0, "{r}");
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert!(r["stdout"].as_str().unwrap().starts_with("seeded"), "{r}");
    assert!(
        !r["stdout"].as_str().unwrap().contains(host.trim()),
        "its own kernel: {r}"
    );
    assert_eq!(r["changes"]["committed"], true, "{r}");
    assert_eq!(r["changes"]["added"], json!(["/r.txt"]), "{r}");
    assert_eq!(r["changes"]["deleted"], json!(["/seed.txt"]), "{r}");
    assert_eq!(get("/r.txt").text(), "run\n");
    assert_eq!(get("/seed.txt").status, 404);
    assert_eq!(
        api.sh(&a, "cat /workspace/r.txt"),
        "run\n",
        "a commit shows in live mounts"
    );
    // A run with egress needs a network device: a fresh microVM restored with one, its
    // layer served at start.
    let r = api
        .post(
            &format!("/v1/volumes/{vol}/run"),
            &json!({"runtime": "microvm", "memory_mb": 256, "network": {"egress": "all"},
                    "shell": "ls /sys/class/net | grep -c eth; cat r.txt; echo n > net.txt"}),
        )
        .expect(200, "a microVM run with egress");
    assert_eq!(r["stdout"], "1\nrun\n", "{r}");
    assert_eq!(r["changes"]["added"], json!(["/net.txt"]), "{r}");
    // on_success with a failing command commits nothing.
    let r = api
        .post(
            &format!("/v1/volumes/{vol}/run"),
            &json!({"runtime": "microvm", "memory_mb": 256, "commit": "on_success",
                    "shell": "echo lost > lost.txt; exit 3"}),
        )
        .expect(200, "a failing microVM run");
    assert_eq!(r["exit_code"], 3, "{r}");
    assert_eq!(r["changes"]["committed"], false, "{r}");
    assert_eq!(get("/lost.txt").status, 404);
    // `locker run --runtime microvm`, with the changes on stderr.
    let out = std::process::Command::new(locker_bin())
        .args([
            "run",
            "--volume",
            "vmvol",
            "--runtime",
            "microvm",
            "--memory-mb",
            "256",
        ])
        .args(["--", "sh", "-c", "cat r.txt; echo c > cli.txt"])
        .env("LOCKER_URL", &srv.url)
        .env("LOCKER_API_KEY", &srv.api_key)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "run\n");
    assert!(err.contains("+ /cli.txt"), "{err}");
    assert_eq!(get("/cli.txt").text(), "c\n");

    // A file server that dies fails its mounts at once (ENOTCONN), never hangs them.
    let servers: Vec<i32> = procs_naming(&srv.machine_dir(&b))
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("__vm-fs"))
        })
        .collect();
    assert!(!servers.is_empty(), "b has a file server");
    // The serving process (PID 1 of its own pid namespace) sees only its exports, with the
    // file-owner capabilities only (CHOWN, DAC_OVERRIDE, FOWNER, FSETID).
    let serving: Vec<&i32> = servers
        .iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/status"))
                .unwrap_or_default()
                .lines()
                .any(|l| l.starts_with("NSpid:") && l.split_whitespace().last() == Some("1"))
        })
        .collect();
    assert_eq!(
        serving.len(),
        1,
        "one server in its own pid namespace: {servers:?}"
    );
    let status = std::fs::read_to_string(format!("/proc/{}/status", serving[0])).unwrap();
    assert!(status.contains("CapEff:\t000000000000001b"), "{status}");
    let root: Vec<String> = std::fs::read_dir(format!("/proc/{}/root", serving[0]))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        root,
        vec!["0".to_owned()],
        "its root holds its one export only"
    );
    for p in &servers {
        // SAFETY: a signal to a pid we found.
        unsafe { libc::kill(*p, libc::SIGKILL) };
    }
    let r = api.exec(
        &b,
        &json!({"shell": "ls /data 2>&1; cat /data/r.txt 2>&1", "timeout_ms": 20000}),
    );
    assert_eq!(r["reason"], "exited", "no hang: {r}");
    assert!(
        r["stdout"].as_str().unwrap().contains("not connected"),
        "{r}"
    );
    assert_eq!(
        api.sh(&b, "echo alive"),
        "alive\n",
        "the VM itself lives on"
    );

    // Nothing of the machines is left: no QEMU, no file server.
    let data = srv
        .machine_dir(&a)
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_owned();
    for id in [&a, &b, &c] {
        api.delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !procs_naming(&data).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<String> = procs_naming(&data)
        .iter()
        .map(|p| {
            String::from_utf8_lossy(
                &std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default(),
            )
            .replace('\0', " ")
        })
        .collect();
    // The pool's waiting machine is the server's; anything else is debris.
    assert!(
        left.iter().all(|c| !c.contains("__vm-fs")),
        "no file server left: {left:?}"
    );
    api.delete(&format!("/v1/volumes/{vol}"))
        .expect(204, "delete the volume");
}
