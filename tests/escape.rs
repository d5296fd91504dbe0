//! A hostile command against its own machine's boundary, through the real server.
//!
//! Each test starts its own `locker serve` (fresh data dir) and a jail sandbox, runs what a
//! prompt-injected tool call could run (python's ctypes, raw system calls, writes into
//! cgroup and proc files), and checks from the outside that the machine kept its shape:
//! - the agent (PID 1) belongs to the host: no command traces it, reads or writes its
//!   memory, or takes its file descriptors;
//! - the agent's log is a bounded host file that no command can write into;
//! - only unix, inet, inet6 and netlink sockets open (no vsock: its port space is the
//!   host's; no packet sockets);
//! - a command cannot leave its per-command cgroup to outlive its exec's timeout, nor hide
//!   in an idle one kept for reuse;
//! - the filter refuses x32 system call numbers as it refuses the x86-64 ones;
//! - the mount table names nothing of the host's data dir or template cache;
//! - filling `/tmp` cannot take the agent with it.
//!
//! Run as root after `scripts/setup build`: `cargo test --release -p locker-tests --test escape`.

use std::io::Write;
use std::time::{Duration, Instant};

use locker_tests::cache_dir;
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

/// A jail sandbox of the default tenant (memory in MiB), and its id.
fn sandbox(api: &Api, body: Value) -> String {
    let mut body = body;
    body["runtime"] = json!("jail");
    let v = api.create_sandbox(&body);
    v["id"].as_str().expect("an id").to_owned()
}

/// Writes `script` into the machine and runs it with python3; returns the ExecResult.
fn python(api: &Api, id: &str, script: &str, timeout_ms: u64) -> Value {
    let path = format!("/root/t{}.py", script.len());
    api.write_file(id, &path, script.as_bytes())
        .expect(200, "upload a script");
    api.exec(
        id,
        &json!({"cmd": ["python3", path], "timeout_ms": timeout_ms}),
    )
}

/// The JSON a test script printed on its last line of stdout.
fn printed(r: &Value) -> Value {
    let out = r["stdout"].as_str().unwrap_or_default();
    let last = out.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("no JSON from the script ({e}): {r}"))
}

/// The machine's PID 1 as the host sees it (from the jail's `state.json`).
fn agent_pid(srv: &Server, id: &str) -> i32 {
    let state: Value = serde_json::from_slice(
        &std::fs::read(srv.machine_dir(id).join("state.json")).expect("state.json"),
    )
    .expect("state.json is JSON");
    state["agent_pid"].as_i64().expect("agent_pid") as i32
}

const PRELUDE: &str = r#"
import ctypes, json, os, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def err():
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
out = {}
"#;

#[test]
fn a_command_cannot_trace_or_read_the_agent() {
    let srv = Server::start();
    let api = srv.api();
    let id = sandbox(&api, json!({}));
    let script = format!(
        "{PRELUDE}{}",
        r#"
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long
out["seize"] = "ok" if libc.ptrace(0x4206, 1, None, None) == 0 else err()
out["attach"] = "ok" if libc.ptrace(16, 1, None, None) == 0 else err()
pfd = libc.syscall(434, 1, 0)
out["pidfd_open"] = "ok" if pfd >= 0 else err()
try:
    names = [int(n) for n in os.listdir("/proc/1/fd")]
    out["list_fds"] = "ok"
except OSError as e:
    names = list(range(16))
    out["list_fds"] = errno.errorcode[e.errno]
got = []
for n in names:
    fd = libc.syscall(438, pfd, n, 0)
    if fd >= 0:
        got.append(n)
    else:
        out["getfd_errno"] = err()
out["getfd"] = got
buf = ctypes.create_string_buffer(64)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
local = iovec(ctypes.cast(buf, ctypes.c_void_p), 64)
remote = iovec(0x400000, 64)
r = libc.syscall(310, 1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
out["vm_readv"] = "ok" if r >= 0 else err()
r = libc.syscall(311, 1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
out["vm_writev"] = "ok" if r >= 0 else err()
for p in ["/proc/1/mem", "/proc/1/environ", "/proc/1/fd/1", "/proc/1/fd/3"]:
    try:
        open(p, "rb").close()
        out[p] = "ok"
    except OSError as e:
        out[p] = errno.errorcode.get(e.errno, str(e.errno))
try:
    out["readlink"] = os.readlink("/proc/1/fd/1")
except OSError as e:
    out["readlink"] = errno.errorcode[e.errno]
# What a command does to itself and its own children still works.
out["self_fds"] = len(os.listdir("/proc/self/fd")) > 0
out["self_exe"] = os.readlink("/proc/self/exe")
out["self_status"] = "Name:" in open("/proc/self/status").read()
import subprocess
out["child"] = subprocess.run(["sh", "-c", "cat /proc/self/cmdline | tr '\\0' ' '"], capture_output=True, text=True).stdout
print(json.dumps(out))
"#
    );
    let r = python(&api, &id, &script, 30_000);
    assert_eq!(r["exit_code"], 0, "{r}");
    let o = printed(&r);
    for k in ["seize", "attach", "vm_readv", "vm_writev"] {
        assert_eq!(o[k], "EPERM", "{k} on the agent must be refused: {o}");
    }
    assert_eq!(
        o["getfd"],
        json!([]),
        "no fd of the agent may be taken: {o}"
    );
    assert_eq!(o["getfd_errno"], "EPERM", "{o}");
    // The numbers in /proc/1/fd may be listed (the directory is the machine root's, as
    // for any non-dumpable process); none of them opens or resolves.
    for k in [
        "/proc/1/mem",
        "/proc/1/environ",
        "/proc/1/fd/1",
        "/proc/1/fd/3",
        "readlink",
    ] {
        assert_eq!(o[k], "EACCES", "{k} of the agent must be closed: {o}");
    }
    assert_eq!(o["self_fds"], true, "{o}");
    assert!(
        o["self_exe"].as_str().unwrap_or("").contains("python3"),
        "{o}"
    );
    assert_eq!(o["self_status"], true, "{o}");
    assert_eq!(o["child"], "cat /proc/self/cmdline ", "{o}");
    // The machine still serves after all of that.
    assert_eq!(api.sh(&id, "echo alive"), "alive\n");
}

#[test]
fn a_command_cannot_write_into_the_agents_host_log() {
    let srv = Server::start();
    let api = srv.api();
    let id = sandbox(&api, json!({}));
    let log = srv.machine_dir(&id).join("machine.log");
    let script = format!(
        "{PRELUDE}{}",
        r#"
block = b"x" * (1 << 20)
pfd = libc.syscall(434, 1, 0)
fds = {}
for n in (1, 2):
    fd = libc.syscall(438, pfd, n, 0)
    if fd >= 0:
        fds["getfd%d" % n] = fd
for p in ["/proc/1/fd/1", "/proc/1/fd/2", "/dev/console", "/dev/kmsg", "/dev/tty",
          "/proc/1/root/dev/stderr", "/proc/1/cwd/dev/stderr"]:
    try:
        fds[p] = os.open(p, os.O_WRONLY | os.O_APPEND)
    except OSError as e:
        out[p] = errno.errorcode.get(e.errno, str(e.errno))
for name, fd in fds.items():
    n = 0
    try:
        for _ in range(50):
            n += os.write(fd, block)
    except OSError as e:
        pass
    out[name] = n
print(json.dumps(out))
"#
    );
    let r = python(&api, &id, &script, 60_000);
    assert_eq!(r["exit_code"], 0, "{r}");
    let o = printed(&r);
    let size = std::fs::metadata(&log).expect("machine.log").len();
    assert!(
        size < 1 << 20,
        "a command wrote {size} bytes into the host's machine.log: {o}"
    );
    for k in ["/proc/1/fd/1", "/proc/1/fd/2"] {
        assert_eq!(o[k], "EACCES", "{o}");
    }
    assert_eq!(api.sh(&id, "echo alive"), "alive\n");
}

#[test]
fn the_agent_log_is_capped_whatever_the_agent_prints() {
    let srv = Server::start();
    let api = srv.api();
    let id = sandbox(&api, json!({}));
    let log = srv.machine_dir(&id).join("machine.log");
    // Only the agent itself can write to its stderr now; the host (root) can reach the
    // same descriptor, so it plays an agent that prints 50 MiB.
    let pid = agent_pid(&srv, &id);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/fd/2"))
        .expect("open the agent's stderr from the host");
    let line =
        [b"locker-agent: a line the agent printed, again and again\n".as_slice(); 1024].concat();
    let mut written = 0usize;
    let t0 = Instant::now();
    while written < 50 << 20 {
        f.write_all(&line)
            .expect("the agent's stderr takes all it prints");
        written += line.len();
    }
    drop(f);
    // The shim copies as it reads; give it a moment to drain the pipe.
    std::thread::sleep(Duration::from_millis(300));
    let size = std::fs::metadata(&log).expect("machine.log").len();
    assert!(
        size <= (1 << 20) + 4096,
        "machine.log grew to {size} bytes after the agent printed {written} ({:?})",
        t0.elapsed()
    );
    let text =
        String::from_utf8_lossy(&std::fs::read(&log).expect("read machine.log")).into_owned();
    assert!(text.contains("locker-agent: a line"), "the head is kept");
    assert!(
        text.contains("dropped"),
        "the log says that it dropped output: {}",
        &text[text.len().saturating_sub(500)..]
    );
    assert_eq!(api.sh(&id, "echo alive"), "alive\n");
}

#[test]
fn a_machine_opens_only_unix_inet_and_netlink_sockets() {
    let srv = Server::start();
    let api = srv.api();
    let id = sandbox(&api, json!({}));
    let script = format!(
        "{PRELUDE}{}",
        r#"
import socket
def try_socket(fam, typ, proto=0):
    fd = libc.socket(fam, typ, proto)
    if fd >= 0:
        os.close(fd)
        return "ok"
    return err()
def try_pair(fam, typ):
    sv = (ctypes.c_int * 2)()
    if libc.socketpair(fam, typ, 0, sv) == 0:
        os.close(sv[0]); os.close(sv[1])
        return "ok"
    return err()
# Refused families (vsock's port space is the host's; the rest have no business here).
for name, fam, typ in [("vsock", 40, 1), ("packet", 17, 3), ("packet_dgram", 17, 2),
                       ("key", 15, 3), ("alg", 38, 5), ("tipc", 30, 5), ("bluetooth", 31, 1),
                       ("can", 29, 3), ("rds", 21, 5), ("xdp", 44, 3), ("family_255", 255, 1)]:
    out[name] = try_socket(fam, typ)
out["vsock_pair"] = try_pair(40, 1)
out["packet_pair"] = try_pair(17, 3)
# Allowed families.
out["unix"] = try_socket(1, 1)
out["inet"] = try_socket(2, 1)
out["inet_raw"] = try_socket(2, 3, 1)
out["inet6"] = try_socket(10, 2)
out["netlink"] = try_socket(16, 3, 0)
out["unix_pair"] = try_pair(1, 1)
out["unix_pair_cloexec"] = try_pair(1, 1 | 0o2000000)
print(json.dumps(out))
"#
    );
    let r = python(&api, &id, &script, 30_000);
    assert_eq!(r["exit_code"], 0, "{r}");
    let o = printed(&r);
    for k in [
        "vsock",
        "packet",
        "packet_dgram",
        "key",
        "alg",
        "tipc",
        "bluetooth",
        "can",
        "rds",
        "xdp",
        "family_255",
        "vsock_pair",
        "packet_pair",
    ] {
        assert_eq!(o[k], "EAFNOSUPPORT", "{k}: {o}");
    }
    // Raw inet sockets are the network namespace's to refuse (it is the host user
    // namespace's), not the filter's.
    assert_ne!(o["inet_raw"], "EAFNOSUPPORT", "{o}");
    for k in [
        "unix",
        "inet",
        "inet6",
        "netlink",
        "unix_pair",
        "unix_pair_cloexec",
    ] {
        assert_eq!(o[k], "ok", "{k}: {o}");
    }
    // Tools that speak netlink keep working.
    let addrs = api.sh(&id, "ip addr show lo");
    assert!(addrs.contains("127.0.0.1"), "{addrs}");
}

#[test]
fn the_filter_refuses_x32_syscall_numbers() {
    let srv = Server::start();
    let api = srv.api();
    let id = sandbox(&api, json!({}));
    let script = format!(
        "{PRELUDE}{}",
        r#"
X32 = 0x40000000
for name, nr, args in [("unshare", 272, (0x10000000,)), ("mount", 165, (0, 0, 0, 0, 0)),
                       ("bpf", 321, (0, 0, 0)), ("io_uring_setup", 425, (1, 0)),
                       ("getpid", 39, ()), ("setns", 308, (0, 0))]:
    r = libc.syscall(ctypes.c_long(X32 | nr), *[ctypes.c_long(a) for a in args])
    out[name] = "ok" if r >= 0 else err()
out["native_getpid"] = libc.syscall(39) > 0
print(json.dumps(out))
"#
    );
    let r = python(&api, &id, &script, 30_000);
    assert_eq!(r["exit_code"], 0, "{r}");
    let o = printed(&r);
    for k in [
        "unshare",
        "mount",
        "bpf",
        "io_uring_setup",
        "getpid",
        "setns",
    ] {
        assert_eq!(o[k], "EPERM", "x32 {k} must be refused by the filter: {o}");
    }
    assert_eq!(o["native_getpid"], true, "{o}");
}

/// Every line of `text` that names something of the host's.
fn host_paths(text: &str, srv: &Server, id: Option<&str>) -> Vec<String> {
    let mut needles = vec![
        srv.data_dir.display().to_string(),
        cache_dir().display().to_string(),
        "/var/cache/locker".to_owned(),
        "sandboxes/".to_owned(),
        "volumes/".to_owned(),
    ];
    if let Some(id) = id {
        needles.push(srv.machine_dir(id).display().to_string());
    }
    if let Some(parent) = srv.data_dir.parent() {
        needles.push(parent.display().to_string());
    }
    text.lines()
        .filter(|l| needles.iter().any(|n| l.contains(n.as_str())))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_mount_table_names_nothing_of_the_host() {
    let srv = Server::start();
    let api = srv.api();
    let vol = api
        .post("/v1/volumes", &json!({"name": "mounts"}))
        .expect(201, "create a volume")["id"]
        .as_str()
        .expect("volume id")
        .to_owned();
    let id = sandbox(
        &api,
        json!({"volumes": [{"volume": vol, "path": "/workspace"}]}),
    );
    let table = api.sh(&id, "cat /proc/self/mountinfo; mount");
    assert!(
        table.contains(" /workspace "),
        "the volume is mounted: {table}"
    );
    assert!(table.contains("overlay"), "{table}");
    let leaks = host_paths(&table, &srv, Some(&id));
    assert!(
        leaks.is_empty(),
        "the sandbox's mount table names the host: {leaks:#?}"
    );
    // Runs: a pooled machine (the first shape) and a fresh one (another shape).
    for body in [
        json!({"shell": "cat /proc/self/mountinfo; mount; hostname"}),
        json!({"shell": "cat /proc/self/mountinfo; mount; hostname", "memory_mb": 256}),
        json!({"shell": "cat /proc/self/mountinfo; mount; hostname"}),
    ] {
        let r = api
            .post(&format!("/v1/volumes/{vol}/run"), &body)
            .expect(200, "run");
        assert_eq!(r["exit_code"], 0, "{r}");
        let table = r["stdout"].as_str().expect("stdout");
        assert!(table.contains("overlay"), "{table}");
        let leaks = host_paths(table, &srv, None);
        assert!(
            leaks.is_empty(),
            "a run's mount table names the host: {leaks:#?}"
        );
    }
}

/// The pids (in the machine) of processes whose command line contains `needle`.
fn machine_pids(api: &Api, id: &str, needle: &str) -> String {
    api.sh(
        id,
        &format!("ps -eo pid,args | grep -F '{needle}' | grep -v grep || true"),
    )
}

#[test]
fn a_command_cannot_leave_its_cgroup_to_outlive_its_execs_timeout() {
    let srv = Server::start();
    let api = srv.api();
    let id = sandbox(&api, json!({}));
    // Three ways out of a command's cgroup: the machine's root cgroup (the report's
    // reproduction), a cgroup of its own beside the commands', one below its own.
    let escapes = [
        "for c in /sys/fs/cgroup/*/cgroup.procs /sys/fs/cgroup/cgroup.procs; do echo $$ > $c; done; exec sleep 777",
        "for d in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do mkdir -p $d/esc && echo $$ > $d/esc/cgroup.procs; done; exec sleep 778",
        "for l in $(cut -d: -f2,3 /proc/self/cgroup); do c=${l%%:*}; p=${l#*:}; c=${c#name=}; \
         for d in /sys/fs/cgroup/$c$p /sys/fs/cgroup$p; do [ -d $d ] && mkdir -p $d/sub && echo $$ > $d/sub/cgroup.procs; done; done; exec sleep 779",
    ];
    for (i, esc) in escapes.iter().enumerate() {
        let tag = format!("sleep 77{}", 7 + i);
        // Ends by timeout.
        let script = format!("(setsid sh -c '{esc}' 2>/dev/null &) ; sleep 30");
        let t0 = Instant::now();
        let r = api.exec(&id, &json!({"shell": script, "timeout_ms": 1500}));
        assert_eq!(r["reason"], "timeout", "{r}");
        assert!(t0.elapsed() < Duration::from_secs(15), "{r}");
        let left = machine_pids(&api, &id, &tag);
        assert!(
            left.is_empty(),
            "`{tag}` outlived its exec's timeout: {left}"
        );
        // Ends by itself: what it left running is a job and lives on (API.md, "Jobs that
        // outlive their exec") if it stayed in or below its command's cgroup; one that moved
        // to a cgroup of its own beside the commands' is a stray and dies with the command.
        let script = format!("(setsid sh -c '{esc}' 2>/dev/null &) ; sleep 1");
        let r = api.exec(&id, &json!({"shell": script, "timeout_ms": 20_000}));
        assert_eq!(r["reason"], "exited", "{r}");
        let left = machine_pids(&api, &id, &tag);
        if i == 1 {
            assert!(
                left.is_empty(),
                "`{tag}` outlived its exec as a stray: {left}"
            );
        } else {
            assert!(!left.is_empty(), "`{tag}` did not outlive its exec");
            api.sh(&id, "pkill -x sleep || true");
        }
    }
    // Commands still get their own cgroups and the machine still works.
    let own = api.sh(&id, "cat /proc/self/cgroup");
    assert!(own.contains("cmd-"), "{own}");
}

/// Ended command cgroups are kept for later commands (the agent reuses them): one of them
/// is no hiding place. A process a command moves into an idle one dies when the command ends.
#[test]
fn a_command_cannot_hide_in_an_idle_command_cgroup() {
    let srv = Server::start();
    let api = srv.api();
    let id = sandbox(&api, json!({}));
    // Two commands at once leave two cgroups idle: while the next runs in one, the other
    // is there to move into.
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| api.sh(&id, "sleep 0.5"));
        }
    });
    let esc = "own=$(grep -o cmd-[0-9]* /proc/self/cgroup | head -1); \
               for d in /sys/fs/cgroup/*/cmd-*/ /sys/fs/cgroup/cmd-*/; do case $d in *$own/) ;; \
               *) echo $$ > ${d}cgroup.procs 2>/dev/null;; esac; done; \
               cat /proc/self/cgroup > /tmp/hid.txt; exec sleep 781";
    let r = api.exec(
        &id,
        &json!({"shell": format!("grep -o 'cmd-[0-9]*' /proc/self/cgroup | head -1; (setsid sh -c '{esc}' 2>/dev/null &) ; sleep 1"), "timeout_ms": 20_000}),
    );
    assert_eq!(r["reason"], "exited", "{r}");
    let own = r["stdout"].as_str().expect("stdout").trim().to_owned();
    assert!(own.starts_with("cmd-"), "{r}");
    let hid = api.sh(&id, "cat /tmp/hid.txt");
    let left = machine_pids(&api, &id, "sleep 781");
    if locker_tests::cgroups_reused() {
        assert!(
            hid.contains("cmd-") && !hid.contains(&format!("{own}\n")),
            "the process did not move out of {own}: {hid}"
        );
        assert!(
            left.is_empty(),
            "hid in an idle cgroup and outlived its exec: {left}"
        );
    } else {
        // No ended cgroup is kept here (v2 before Linux 6.12): there is none to hide in,
        // and the process stays its command's job (jobs outlive their exec).
        assert!(hid.contains(&format!("{own}\n")), "it moved: {hid}");
        assert!(!left.is_empty(), "the job did not outlive its exec");
        api.sh(&id, "pkill -x sleep || true");
    }
    // Commands still run, each in a cgroup of its own.
    let own = api.sh(&id, "cat /proc/self/cgroup");
    assert!(own.contains("cmd-"), "{own}");
}

#[test]
fn filling_tmp_does_not_take_the_agent() {
    let srv = Server::start();
    let api = srv.api();
    let id = sandbox(&api, json!({"memory_mb": 128}));
    let pid = agent_pid(&srv, &id);
    let adj = || {
        std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
            .expect("the agent is there")
            .trim()
            .to_owned()
    };
    // Exempting a process from the OOM killer takes CAP_SYS_RESOURCE, which the host's root
    // lacks on some container hosts; there the sizes of /tmp and /dev/shm alone must do.
    let exempt = can_exempt_from_oom();
    if exempt {
        assert_eq!(adj(), "-1000", "the agent is not the OOM killer's to take");
    } else {
        eprintln!("this host's root lacks CAP_SYS_RESOURCE: the agent cannot be exempted");
        assert_eq!(adj(), "0");
    }
    // Commands stay killable, and cannot make themselves unkillable.
    let r = api.exec(
        &id,
        &json!({"shell": "cat /proc/self/oom_score_adj; echo -1000 > /proc/self/oom_score_adj && echo lowered"}),
    );
    let out = r["stdout"].as_str().expect("stdout");
    assert!(out.starts_with("0\n"), "a command starts at 0: {r}");
    assert!(!out.contains("lowered"), "a command lowered itself: {r}");

    let r = api.exec(
        &id,
        &json!({"shell": "head -c 600M /dev/zero > /tmp/x; echo rc=$?; df -m /tmp | tail -1", "timeout_ms": 60_000}),
    );
    let failed = r["reason"] == "oom" || r["stdout"].as_str().unwrap_or("").contains("rc=1");
    assert!(
        failed,
        "filling /tmp neither failed nor was OOM-killed: {r}"
    );
    assert_eq!(api.sh(&id, "echo alive"), "alive\n");
    let sb = api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get");
    assert_eq!(sb["state"], "running", "{sb}");
    // /tmp full, a memory bomb is still what the OOM killer takes.
    let r = api.exec(
        &id,
        &json!({"cmd": ["python3", "-c", "b = bytearray(600 << 20)"], "timeout_ms": 60_000}),
    );
    assert_eq!(r["reason"], "oom", "{r}");
    api.sh(&id, "rm -f /tmp/x");
    let r = api.exec(
        &id,
        &json!({"cmd": ["python3", "-c", "b = bytearray(600 << 20)"], "timeout_ms": 60_000}),
    );
    assert_eq!(r["reason"], "oom", "{r}");
    assert_eq!(api.sh(&id, "echo alive"), "alive\n");
    assert_eq!(adj(), if exempt { "-1000" } else { "0" });
}

/// Whether this process (the host's root) has CAP_SYS_RESOURCE.
fn can_exempt_from_oom() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .expect("CapEff");
    eff & (1 << 24) != 0 // CAP_SYS_RESOURCE
}
