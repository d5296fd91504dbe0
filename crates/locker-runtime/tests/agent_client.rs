//! The agent channel end to end: the real `locker-agent` binary, started on this host with
//! `--listen`, driven through [`AgentClient`].
//!
//! Each test starts its own agent with its own parent cgroup (`locker-test-<pid>-<n>`, made
//! here and removed at the end, killing whatever is left in it, also when the test fails) and
//! its own temporary directory (socket, files root, output dir). Needs root and cgroups.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use locker_proto::{Chan, EndBody, ErrorCode, ExecSpec, PtySize, Reply, Request};
use locker_runtime::agent::{AgentClient, AgentClientError, AgentStream, StreamEvent};
use locker_types::{EntryType, Reason};
use tokio::sync::mpsc;

static NEXT: AtomicU32 = AtomicU32::new(1);

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The agent binary, built (once per test run) with the profile of this test.
fn agent_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(p) = std::env::var("LOCKER_AGENT_BIN") {
            return PathBuf::from(p);
        }
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "-q", "-p", "locker-agent"])
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
        if profile_dir.ends_with("release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo to build locker-agent");
        assert!(status.success(), "building locker-agent failed");
        let bin = profile_dir.join("locker-agent");
        assert!(bin.exists(), "{} was not built", bin.display());
        bin
    })
    .clone()
}

/// A parent cgroup for one test's agent; everything in it is killed and removed on drop.
struct TestCgroups {
    name: String,
    dirs: Vec<PathBuf>,
}

impl TestCgroups {
    fn create(memory_limit: Option<u64>) -> TestCgroups {
        Self::create_in(Path::new("/sys/fs/cgroup"), memory_limit)
    }

    fn create_in(root: &Path, memory_limit: Option<u64>) -> TestCgroups {
        let name = unique("locker-test-");
        let mut dirs = Vec::new();
        if root.join("cgroup.controllers").exists() {
            let d = root.join(&name);
            fs::create_dir(&d).unwrap();
            let _ = fs::write(d.join("cgroup.subtree_control"), "+memory +cpu +pids");
            if let Some(l) = memory_limit {
                fs::write(d.join("memory.max"), l.to_string()).unwrap();
            }
            dirs.push(d);
        } else {
            for c in ["memory", "pids", "cpu", "cpuacct", "freezer"] {
                let base = root.join(c);
                if !base.join("cgroup.procs").exists() {
                    continue;
                }
                let d = base.join(&name);
                if fs::create_dir(&d).is_ok() {
                    if c == "memory" {
                        if let Some(l) = memory_limit {
                            fs::write(d.join("memory.limit_in_bytes"), l.to_string()).unwrap();
                        }
                    }
                    dirs.push(d);
                }
            }
        }
        assert!(!dirs.is_empty(), "no cgroup controllers to test with");
        TestCgroups { name, dirs }
    }

    /// The command cgroups (`cmd-*`) that exist now.
    fn command_cgroups(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for d in &self.dirs {
            for e in fs::read_dir(d).into_iter().flatten().flatten() {
                if e.path().is_dir() {
                    out.push(e.path());
                }
            }
        }
        out
    }

    /// Asserts that no command cgroup holds a process or a cgroup below it, and that no
    /// more are kept than the agent keeps for later commands (it reuses them).
    fn assert_only_idle(&self) {
        let mut names = std::collections::HashSet::new();
        for c in self.command_cgroups() {
            let procs = fs::read_to_string(c.join("cgroup.procs")).unwrap_or_default();
            assert!(procs.trim().is_empty(), "{} holds {procs}", c.display());
            let below = fs::read_dir(&c)
                .unwrap()
                .flatten()
                .filter(|e| e.path().is_dir())
                .count();
            assert_eq!(below, 0, "cgroups below {}", c.display());
            names.insert(c.file_name().unwrap().to_owned());
        }
        assert!(
            names.len() <= 4,
            "more idle command cgroups than kept: {names:?}"
        );
    }
}

fn kill_cgroup(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        let pids: Vec<i32> = procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if pids.is_empty() {
            break;
        }
        for p in pids {
            // SAFETY: kill with integer arguments only.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn rmdir_retry(dir: &Path) {
    for _ in 0..200 {
        if fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!("could not remove {}", dir.display());
}

impl Drop for TestCgroups {
    fn drop(&mut self) {
        for sub in self.command_cgroups() {
            kill_cgroup(&sub);
            rmdir_retry(&sub);
        }
        for d in &self.dirs {
            kill_cgroup(d);
            rmdir_retry(d);
        }
    }
}

#[derive(Default)]
struct Opts {
    memory_limit: Option<u64>,
    max_spill: Option<u64>,
    /// Point the agent at a cgroup root that does not exist: the process-group fallback.
    no_cgroups: bool,
    /// Another cgroup root (the parent cgroup is made there).
    cgroup_root: Option<PathBuf>,
}

/// What one test started: killed and removed on drop, also when the test fails.
struct Guard {
    child: Child,
    cgroups: Option<TestCgroups>,
    dir: PathBuf,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        drop(self.cgroups.take());
        if std::thread::panicking() || std::env::var_os("LOCKER_TEST_AGENT_LOG").is_some() {
            let log = fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default();
            eprintln!("--- agent log ---\n{log}--- end ---");
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// One running agent with its cgroups and directories.
struct TestAgent {
    client: AgentClient,
    dir: PathBuf,
    root: PathBuf,
    out: PathBuf,
    sock: PathBuf,
    guard: Guard,
}

impl TestAgent {
    async fn start(opts: Opts) -> TestAgent {
        let dir = std::env::temp_dir().join(unique("locker-agent-test-"));
        let root = dir.join("root");
        let out = dir.join("out");
        fs::create_dir_all(&root).unwrap();
        let cgroups = match &opts.cgroup_root {
            Some(r) => TestCgroups::create_in(r, opts.memory_limit),
            None => TestCgroups::create(opts.memory_limit),
        };
        let sock = dir.join("agent.sock");
        let log = fs::File::create(dir.join("agent.log")).unwrap();
        let mut cmd = Command::new(agent_bin());
        cmd.arg("--listen")
            .arg(&sock)
            .env("LOCKER_CGROUP_PARENT", &cgroups.name)
            .env("LOCKER_AGENT_ROOT", &root)
            .env("LOCKER_OUTPUT_DIR", &out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(r) = &opts.cgroup_root {
            cmd.env("LOCKER_CGROUP_ROOT", r);
        }
        if opts.no_cgroups {
            cmd.env("LOCKER_CGROUP_ROOT", dir.join("no-cgroups-here"));
        }
        if let Some(m) = opts.max_spill {
            cmd.env("LOCKER_MAX_SPILL_BYTES", m.to_string());
        }
        let child = cmd.spawn().expect("start locker-agent");
        let guard = Guard {
            child,
            cgroups: Some(cgroups),
            dir: dir.clone(),
        };
        let client = AgentClient::connect(&sock, Duration::from_secs(20))
            .await
            .expect("connect to the agent");
        TestAgent {
            client,
            dir,
            root,
            out,
            sock,
            guard,
        }
    }

    fn pid(&self) -> i32 {
        self.guard.child.id() as i32
    }

    fn cgroups(&self) -> &TestCgroups {
        self.guard.cgroups.as_ref().unwrap()
    }

    /// The agent's peak resident memory so far.
    fn peak_rss(&self) -> u64 {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: u64 = status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap();
        kb * 1024
    }
}

fn spec(argv: &[&str]) -> ExecSpec {
    ExecSpec {
        call_id: unique("call_t"),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        max_output_bytes: 65_536,
        timeout_ms: Some(60_000),
        ..Default::default()
    }
}

fn sh(script: &str) -> ExecSpec {
    spec(&["/bin/sh", "-c", script])
}

fn alive(pid: i32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

fn gone_within(pid: i32, t: Duration) -> bool {
    let deadline = Instant::now() + t;
    while Instant::now() < deadline {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    !alive(pid)
}

fn agent_code(e: AgentClientError) -> ErrorCode {
    match e {
        AgentClientError::Agent(a) => a.code,
        other => panic!("expected an agent error, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_runs_argv_shell_env_cwd_stdin_and_users() {
    let a = TestAgent::start(Opts::default()).await;
    let c = &a.client;
    c.ping().await.unwrap();

    let r = c
        .exec(spec(&["echo", "hello", "world"]), None, None)
        .await
        .unwrap();
    assert_eq!(
        (r.exit_code, r.reason, r.stdout.as_str()),
        (Some(0), Reason::Exited, "hello world\n")
    );
    assert!(
        r.timings.start_ms > 0.0 && r.timings.run_ms > 0.0,
        "{:?}",
        r.timings
    );
    assert!(r.call_id.starts_with("call_t"));

    let r = c.exec(sh("env | sort"), None, None).await.unwrap();
    for want in [
        "HOME=/root",
        "USER=root",
        "LANG=C.UTF-8",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ] {
        assert!(
            r.stdout.lines().any(|l| l == want),
            "{want} missing in {}",
            r.stdout
        );
    }
    assert!(
        !r.stdout.contains("TERM="),
        "no TERM without a terminal: {}",
        r.stdout
    );

    let mut s = sh("echo \"$GREETING\"; pwd; echo oops >&2; exit 3");
    s.env = vec![
        ("GREETING".into(), "hi there".into()),
        ("LANG".into(), "C".into()),
    ];
    s.cwd = Some("/tmp".into());
    let r = c.exec(s, None, None).await.unwrap();
    assert_eq!(r.stdout, "hi there\n/tmp\n");
    assert_eq!(
        (r.stderr.as_str(), r.exit_code, r.reason),
        ("oops\n", Some(3), Reason::Exited)
    );

    let r = c
        .exec(
            sh("cat; echo; echo $LANG"),
            Some(b"from stdin".to_vec()),
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "from stdin\nC.UTF-8\n");
    // Without stdin the command reads /dev/null: end of file at once.
    let r = c.exec(spec(&["cat"]), None, None).await.unwrap();
    assert_eq!((r.stdout.as_str(), r.exit_code), ("", Some(0)));
    // Large stdin goes through flow control in both directions.
    let big: Vec<u8> = (0..5_000_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let r = c.exec(spec(&["wc", "-c"]), Some(big), None).await.unwrap();
    assert_eq!(r.stdout.trim(), "5000000");

    // Children start with default signal dispositions and an empty mask (the agent ignores
    // SIGPIPE itself; its commands must not inherit that).
    let r = c
        .exec(sh("grep -E '^Sig(Ign|Blk)' /proc/self/status"), None, None)
        .await
        .unwrap();
    assert_eq!(
        r.stdout,
        "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"
    );

    // An exec ends when its command does: what it left running is a job that keeps running,
    // and is not waited for; with `kill_jobs` (a run's machine) it is killed with the command.
    for kill_jobs in [false, true] {
        let pidfile = a.dir.join(format!("bg-{kill_jobs}.pid"));
        let t = Instant::now();
        let mut spec = sh(&format!(
            "sleep 300 & echo $! > {}; echo bg",
            pidfile.display()
        ));
        spec.kill_jobs = kill_jobs;
        let r = c.exec(spec, None, None).await.unwrap();
        assert_eq!(r.stdout, "bg\n");
        assert!(t.elapsed() < Duration::from_secs(10));
        let pid: i32 = fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        if kill_jobs {
            assert!(
                gone_within(pid, Duration::from_secs(3)),
                "leftover {pid} survived its exec with kill_jobs"
            );
        } else {
            std::thread::sleep(Duration::from_millis(300));
            assert!(
                !gone_within(pid, Duration::from_millis(200)),
                "job {pid} died with its exec"
            );
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }

    let r = c.exec(sh("kill -TERM $$"), None, None).await.unwrap();
    assert_eq!(
        (r.exit_code, r.signal.as_deref(), r.reason),
        (None, Some("SIGTERM"), Reason::Signaled)
    );

    let r = c
        .exec(spec(&["no-such-program-here"]), None, None)
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(127));
    assert!(r.stderr.contains("no-such-program-here"), "{}", r.stderr);

    let mut s = spec(&["true"]);
    s.cwd = Some("/no/such/dir".into());
    assert_eq!(
        agent_code(c.exec(s, None, None).await.unwrap_err()),
        ErrorCode::BadRequest
    );

    let mut s = spec(&["id", "-u"]);
    s.user = Some("nobody".into());
    let r = c.exec(s, None, None).await.unwrap();
    assert_eq!(r.stdout.trim(), "65534");
    let mut s = spec(&["sh", "-c", "id -u; id -g; echo $HOME"]);
    s.user = Some("4321".into());
    let r = c.exec(s, None, None).await.unwrap();
    assert_eq!(r.stdout, "4321\n4321\n/\n");
    let mut s = spec(&["true"]);
    s.user = Some("no-such-user".into());
    assert_eq!(
        agent_code(c.exec(s, None, None).await.unwrap_err()),
        ErrorCode::BadRequest
    );

    let r = c.exec(spec(&["python3", "-c", "sum(range(30_000_000)); x = bytearray(50 << 20); x[::4096] = b'y' * len(x[::4096])"]), None, None).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{}", r.stderr);
    assert!(r.usage.cpu_ms >= 100, "{:?}", r.usage);
    assert!(r.usage.peak_memory_bytes >= 50 << 20, "{:?}", r.usage);
    let m = c.machine_usage().await.unwrap();
    assert!(m.cpu_ms >= r.usage.cpu_ms, "{m:?} vs {:?}", r.usage);

    // Every command cgroup is empty (kept for reuse, or gone) once its command is.
    a.cgroups().assert_only_idle();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_started_message_comes_first_and_end_last() {
    let a = TestAgent::start(Opts::default()).await;
    let mut s = a
        .client
        .open(Request::Exec(sh("echo one; sleep 0.2; echo two >&2")))
        .unwrap();
    let mut got = Vec::new();
    while let Some(ev) = s.recv().await.unwrap() {
        got.push(ev);
    }
    assert!(
        matches!(got.first(), Some(StreamEvent::Msg(Reply::Started { pid, .. })) if *pid > 0),
        "{got:?}"
    );
    match got.last() {
        Some(StreamEvent::End(EndBody::Exec(r))) => {
            assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("one\n", "two\n"))
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_kills_a_setsid_double_forked_grandchild() {
    let a = TestAgent::start(Opts::default()).await;
    let pidfile = a.dir.join("grandchild.pid");
    let mut s = sh(&format!(
        "echo started; setsid sh -c 'sleep 300 & echo $! > {}'; sleep 300",
        pidfile.display()
    ));
    s.timeout_ms = Some(1000);
    let t = Instant::now();
    let r = a.client.exec(s, None, None).await.unwrap();
    assert_eq!(
        (r.reason, r.exit_code, r.signal.as_deref()),
        (Reason::Timeout, None, Some("SIGKILL"))
    );
    assert_eq!(r.stdout, "started\n", "output before the kill is kept");
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(r.timings.run_ms >= 900.0, "{:?}", r.timings);
    let pid: i32 = fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        gone_within(pid, Duration::from_secs(3)),
        "the setsid'd grandchild {pid} survived the timeout"
    );
    a.cgroups().assert_only_idle();
}

/// The command cgroup a command ran in (`cmd-<n>`), from its `/proc/self/cgroup`.
fn cmd_cgroup(proc_self_cgroup: &str) -> String {
    let at = proc_self_cgroup
        .find("cmd-")
        .unwrap_or_else(|| panic!("no command cgroup in {proc_self_cgroup}"));
    proc_self_cgroup[at..]
        .chars()
        .take_while(|c| *c != '\n' && *c != '/')
        .collect()
}

/// Whether the agent reuses command cgroups on this host: everywhere but on a cgroup v2
/// memory controller before Linux 6.12, whose `memory.peak` cannot be reset (the agent then
/// makes a new cgroup per command, and says so once).
fn cgroups_reused() -> bool {
    let v2_memory = fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
        .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    !v2_memory || (major, minor) >= (6, 12)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_command_cgroup_is_reused_with_its_counters_started_over() {
    // Where cgroups are not reused, each command gets a new one, measured from nothing.
    let reused = cgroups_reused();
    let same = |got: String, first: &str, what: &str| {
        if reused {
            assert_eq!(got, first, "{what}: the ended cgroup was not reused");
        } else {
            assert_ne!(
                got, first,
                "{what}: a cgroup was reused where its peak cannot be reset"
            );
        }
    };
    let a = TestAgent::start(Opts::default()).await;
    let c = &a.client;
    let first = c
        .exec(sh("cat /proc/self/cgroup"), None, None)
        .await
        .unwrap();
    let name = cmd_cgroup(&first.stdout);
    // A command that used CPU and memory, and left page cache charged to its cgroup.
    let file = a.dir.join("cache.bin");
    let r = c
        .exec(
            spec(&[
                "python3",
                "-c",
                &format!(
                    "sum(range(20_000_000)); x = bytearray(60 << 20); x[::4096] = b'y' * len(x[::4096]); \
                     open('{}', 'wb').write(bytes(32 << 20)); print(open('/proc/self/cgroup').read())",
                    file.display()
                ),
            ]),
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "{}", r.stderr);
    same(cmd_cgroup(&r.stdout), &name, "the second command");
    assert!(r.usage.cpu_ms >= 50, "{:?}", r.usage);
    assert!(r.usage.peak_memory_bytes >= 60 << 20, "{:?}", r.usage);
    let heavy = r.usage.cpu_ms;
    // The next command in the same cgroup is measured from its own start: neither the
    // CPU, nor the peak, nor the page cache of the one before count (the CPU bound is
    // relative: under TCG a `cat` alone takes 100 ms).
    let r = c
        .exec(sh("cat /proc/self/cgroup"), None, None)
        .await
        .unwrap();
    same(cmd_cgroup(&r.stdout), &name, "the third command");
    assert!(r.usage.cpu_ms < heavy / 4, "{:?} after {heavy} ms", r.usage);
    assert!(r.usage.peak_memory_bytes < 16 << 20, "{:?}", r.usage);
    // And a big one after a small one is measured whole.
    let r = c
        .exec(
            spec(&[
                "python3",
                "-c",
                "x = bytearray(80 << 20); x[::4096] = b'y' * len(x[::4096])",
            ]),
            None,
            None,
        )
        .await
        .unwrap();
    assert!(r.usage.peak_memory_bytes >= 80 << 20, "{:?}", r.usage);

    // Two at once take two cgroups; both are kept.
    let (x, y) = tokio::join!(
        c.exec(sh("sleep 0.3; cat /proc/self/cgroup"), None, None),
        c.exec(sh("sleep 0.3; cat /proc/self/cgroup"), None, None)
    );
    let (x, y) = (
        cmd_cgroup(&x.unwrap().stdout),
        cmd_cgroup(&y.unwrap().stdout),
    );
    assert_ne!(x, y);
    a.cgroups().assert_only_idle();

    // A command that changes its own cgroup's limits leaves it unfit for the next command:
    // that one gets a cgroup as new, whatever the one before did to its own. (Its pids
    // limit: a `memory.max` of 4 bytes would kill the command itself on v2.)
    let dirs: Vec<String> = a
        .cgroups()
        .dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    let script = format!(
        "c=$(grep -o 'cmd-[0-9]*' /proc/self/cgroup | head -1); n=0; \
         for d in {}; do for f in pids.max; do \
         [ -f $d/$c/$f ] && echo 4 > $d/$c/$f 2>/dev/null || true; done; \
         [ -f $d/$c/pids.max ] && [ \"$(cat $d/$c/pids.max)\" = 4 ] && n=1; done; echo $c $n",
        dirs.join(" ")
    );
    let r = c.exec(sh(&script), None, None).await.unwrap();
    let (limited, changed) = r
        .stdout
        .trim()
        .split_once(' ')
        .unwrap_or_else(|| panic!("no name and flag: {r:?}"));
    assert_eq!(
        changed, "1",
        "the command could not change its pids.max: {r:?}"
    );
    for _ in 0..3 {
        let r = c
            .exec(
                sh("for i in 1 2 3 4 5 6 7 8; do sleep 0.05 & done; wait; cat /proc/self/cgroup"),
                None,
                None,
            )
            .await
            .unwrap();
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        assert_ne!(
            cmd_cgroup(&r.stdout),
            limited,
            "a changed cgroup was reused"
        );
    }
    a.cgroups().assert_only_idle();
}

fn pattern_file(path: &Path, mib: usize) -> Vec<u8> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let block: Vec<u8> = (0..1 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b"abcdefghijklmnopqrstuvwxyz0123456789\n"[(x % 37) as usize]
        })
        .collect();
    let mut f = fs::File::create(path).unwrap();
    for i in 0..mib {
        let mut b = block.clone();
        b[..12].copy_from_slice(format!("{i:011}\n").as_bytes());
        f.write_all(&b).unwrap();
    }
    block
}

fn files_equal(a: &Path, b: &Path) -> bool {
    let (mut fa, mut fb) = (fs::File::open(a).unwrap(), fs::File::open(b).unwrap());
    if fa.metadata().unwrap().len() != fb.metadata().unwrap().len() {
        return false;
    }
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = fa.read(&mut ba).unwrap();
        if n == 0 {
            return true;
        }
        fb.read_exact(&mut bb[..n]).unwrap();
        if ba[..n] != bb[..n] {
            return false;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_megabytes_of_output_are_capped_spilled_and_cheap() {
    let a = TestAgent::start(Opts::default()).await;
    let src = a.dir.join("big.txt");
    pattern_file(&src, 100);
    let total = 100u64 << 20;
    let s = spec(&["cat", src.to_str().unwrap()]);
    let call_id = s.call_id.clone();
    let r = a.client.exec(s, None, None).await.unwrap();
    assert_eq!((r.exit_code, r.reason), (Some(0), Reason::Exited));
    assert!(r.stdout_truncated && !r.stderr_truncated);
    assert_eq!(r.stdout_bytes, total);
    let marker = format!("…[locker: {} bytes omitted]…", total - 65_536);
    assert!(
        r.stdout.contains(&marker),
        "marker missing: {}",
        &r.stdout[32_000..33_000]
    );
    let data = fs::read(&src).unwrap();
    assert!(r
        .stdout
        .starts_with(std::str::from_utf8(&data[..32_768]).unwrap()));
    assert!(r
        .stdout
        .ends_with(std::str::from_utf8(&data[data.len() - 32_768..]).unwrap()));
    drop(data);
    let out = a.out.join(format!("{call_id}.stdout"));
    assert_eq!(r.output_path.as_deref(), Some(out.to_str().unwrap()));
    assert!(
        files_equal(&src, &out),
        "the spill file must hold every byte"
    );
    let rss = a.peak_rss();
    assert!(rss < 48 << 20, "agent peak RSS {} MiB", rss >> 20);

    // Small output leaves no file.
    let s = spec(&["echo", "small"]);
    let id = s.call_id.clone();
    let r = a.client.exec(s, None, None).await.unwrap();
    assert_eq!((r.output_path, r.stdout_truncated), (None, false));
    assert!(!a.out.join(format!("{id}.stdout")).exists());

    // Truncated stderr only: the path names the stderr file.
    let mut s = sh("head -c 3000 /dev/zero | tr '\\0' e >&2; echo ok");
    s.max_output_bytes = 1000;
    let r = a.client.exec(s, None, None).await.unwrap();
    assert!(r.stderr_truncated && !r.stdout_truncated);
    assert!(r.output_path.as_deref().unwrap().ends_with(".stderr"));
    assert!(
        r.stderr.contains("…[locker: 2000 bytes omitted]…"),
        "{}",
        r.stderr
    );
    assert_eq!(fs::metadata(r.output_path.unwrap()).unwrap().len(), 3000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_past_the_spill_limit_kills_with_output_limit() {
    let a = TestAgent::start(Opts {
        max_spill: Some(1 << 20),
        ..Default::default()
    })
    .await;
    let r = a.client.exec(spec(&["yes"]), None, None).await.unwrap();
    assert_eq!(r.reason, Reason::OutputLimit);
    assert_eq!(r.exit_code, None);
    assert!(r.stdout_truncated && r.stdout_bytes >= 1 << 20);
    assert_eq!(fs::metadata(r.output_path.unwrap()).unwrap().len(), 1 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_hog_over_the_parent_limit_ends_with_oom() {
    let a = TestAgent::start(Opts {
        memory_limit: Some(64 << 20),
        ..Default::default()
    })
    .await;
    let r = a
        .client
        .exec(
            spec(&["python3", "-c", "a = b'x' * (200 << 20); print(len(a))"]),
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        (r.reason, r.signal.as_deref(), r.exit_code),
        (Reason::Oom, Some("SIGKILL"), None),
        "{r:?}"
    );
    // A kill that is not the OOM killer's stays `signaled`.
    let r = a
        .client
        .exec(sh("kill -KILL $$"), None, None)
        .await
        .unwrap();
    assert_eq!(r.reason, Reason::Signaled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_output_arrives_in_order_and_while_running() {
    let a = TestAgent::start(Opts::default()).await;
    let (tx, mut rx) = mpsc::channel(64);
    let c = a.client.clone();
    let t0 = Instant::now();
    let job = tokio::spawn(async move {
        c.exec(
            sh("for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; done; sleep 1; echo last"),
            None,
            Some(tx),
        )
        .await
    });
    let mut chunks = vec![rx.recv().await.unwrap()];
    let first_at = t0.elapsed();
    while let Some(x) = rx.recv().await {
        chunks.push(x);
    }
    let r = job.await.unwrap().unwrap();
    let done_at = t0.elapsed();
    assert!(
        first_at + Duration::from_millis(700) < done_at,
        "first output at {first_at:?}, end at {done_at:?}"
    );
    let (mut out, mut err) = (Vec::new(), Vec::new());
    for (chan, b) in chunks {
        match chan {
            Chan::Stdout => out.extend(b),
            Chan::Stderr => err.extend(b),
            other => panic!("data on {other:?}"),
        }
    }
    assert_eq!(
        String::from_utf8(out).unwrap(),
        r.stdout,
        "streamed stdout equals the result's"
    );
    assert_eq!(
        String::from_utf8(err).unwrap(),
        r.stderr,
        "streamed stderr equals the result's"
    );
    assert_eq!(r.stdout, "out1\nout2\nout3\nout4\nout5\nlast\n");
    assert_eq!(r.stderr, "err1\nerr2\nerr3\nerr4\nerr5\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_processes_replay_follow_take_stdin_and_signals() {
    let a = TestAgent::start(Opts::default()).await;
    let c = &a.client;
    let mut s = sh("echo hello; echo warn >&2; read line; echo got:$line; sleep 300");
    s.stdin = true;
    let (id, pid) = c.spawn(s).await.unwrap();
    assert!(id.starts_with("proc_") && pid > 0);
    let listed = c.list_processes().await.unwrap();
    assert!(
        listed.iter().any(|p| p.id == id && p.state == "running"),
        "{listed:?}"
    );
    // An idle stdin request must not hold anything up (it is dropped at the end).
    let idle_stdin = c.open(Request::ProcessStdin { id: id.clone() }).unwrap();

    // Replay without follow: what is there now, then the current state.
    let (tx, mut rx) = mpsc::channel(16);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen = String::new();
    while !seen.contains("hello") && Instant::now() < deadline {
        let info = c.process_output(&id, false, tx.clone()).await.unwrap();
        assert_eq!(info.state, "running");
        seen.clear();
        while let Ok((chan, b)) = rx.try_recv() {
            if chan == Chan::Stdout {
                seen.push_str(&String::from_utf8_lossy(&b));
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen, "hello\n");

    // Follow in the background while we feed stdin and then signal it.
    let (ftx, mut frx) = mpsc::channel(16);
    let fc = c.clone();
    let fid = id.clone();
    let follower = tokio::spawn(async move { fc.process_output(&fid, true, ftx).await });
    c.process_stdin(&id, &b"world\n"[..], false).await.unwrap();
    let mut followed = String::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !followed.contains("got:world") && Instant::now() < deadline {
        if let Ok(Some((Chan::Stdout, b))) =
            tokio::time::timeout(Duration::from_millis(200), frx.recv()).await
        {
            followed.push_str(&String::from_utf8_lossy(&b));
        }
    }
    assert_eq!(followed, "hello\ngot:world\n");
    assert!(!follower.is_finished());
    c.signal_process(&id, libc::SIGTERM).await.unwrap();
    let info = tokio::time::timeout(Duration::from_secs(10), follower)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(info.state, "exited");
    let r = info.result.unwrap();
    assert_eq!(
        (r.reason, r.signal.as_deref()),
        (Reason::Killed, Some("SIGTERM"))
    );
    assert_eq!(
        (r.stdout.as_str(), r.stderr.as_str()),
        ("hello\ngot:world\n", "warn\n")
    );
    assert!(gone_within(pid, Duration::from_secs(3)));
    assert_eq!(c.get_process(&id).await.unwrap().state, "exited");
    drop(idle_stdin);
    assert_eq!(
        agent_code(c.signal_process(&id, libc::SIGTERM).await.unwrap_err()),
        ErrorCode::Conflict
    );
    assert_eq!(
        agent_code(c.get_process("proc_nope").await.unwrap_err()),
        ErrorCode::NotFound
    );

    // Closing stdin ends a reader; its whole output replays after the end.
    let mut s = spec(&["cat"]);
    s.stdin = true;
    let (id2, _) = c.spawn(s).await.unwrap();
    c.process_stdin(&id2, &b"abc"[..], false).await.unwrap();
    c.process_stdin(&id2, &b"def"[..], true).await.unwrap();
    let (tx, mut rx) = mpsc::channel(16);
    let info = tokio::time::timeout(Duration::from_secs(10), c.process_output(&id2, true, tx))
        .await
        .unwrap()
        .unwrap();
    let r = info.result.unwrap();
    assert_eq!(
        (r.reason, r.exit_code, r.stdout.as_str()),
        (Reason::Exited, Some(0), "abcdef")
    );
    let mut replay = Vec::new();
    while let Ok((_, b)) = rx.try_recv() {
        replay.extend(b);
    }
    assert_eq!(replay, b"abcdef");
    assert_eq!(
        agent_code(c.process_stdin(&id2, &b"x"[..], false).await.unwrap_err()),
        ErrorCode::Conflict
    );
}

async fn read_until(s: &mut AgentStream, acc: &mut String, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !acc.contains(needle) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.recv()).await {
            Ok(Ok(Some(StreamEvent::Data(Chan::Bytes, b)))) => {
                acc.push_str(&String::from_utf8_lossy(&b))
            }
            Ok(Ok(Some(StreamEvent::Msg(_)))) => {}
            other => panic!("waiting for {needle:?} in {acc:?}: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_echoes_resizes_and_ends_with_the_exit_code() {
    let a = TestAgent::start(Opts::default()).await;
    let mut s = spec(&["/bin/sh"]);
    s.pty = Some(PtySize { cols: 80, rows: 24 });
    let mut st = a.client.open(Request::Exec(s)).unwrap();
    let mut acc = String::new();
    st.send_data(Chan::Bytes, b"stty size; echo term=$TERM; tty\n")
        .await
        .unwrap();
    read_until(&mut st, &mut acc, "24 80").await;
    read_until(&mut st, &mut acc, "term=xterm-256color").await;
    read_until(&mut st, &mut acc, "/dev/pts/").await;
    st.resize(PtySize {
        cols: 100,
        rows: 30,
    })
    .unwrap();
    acc.clear();
    st.send_data(Chan::Bytes, b"stty size\n").await.unwrap();
    read_until(&mut st, &mut acc, "30 100").await;
    st.send_data(Chan::Bytes, b"exit 3\n").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout(
            deadline.saturating_duration_since(Instant::now()),
            st.recv(),
        )
        .await
        {
            Ok(Ok(Some(StreamEvent::End(EndBody::Exec(r))))) => {
                assert_eq!(r.exit_code, Some(3));
                assert!(r.stdout.contains("30 100"), "{}", r.stdout);
                break;
            }
            Ok(Ok(Some(_))) => {}
            other => panic!("{other:?}"),
        }
    }
}

async fn read_all(c: &AgentClient, path: &str) -> Result<Vec<u8>, AgentClientError> {
    let (_, mut r) = c.read_file(path).await?;
    let mut v = Vec::new();
    while let Some(chunk) = r.next_chunk().await? {
        v.extend(chunk);
    }
    Ok(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_round_trip_binary_big_and_odd_names() {
    let a = TestAgent::start(Opts::default()).await;
    let c = &a.client;
    let mut x: u32 = 12345;
    let big: Vec<u8> = (0..20 << 20)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (x >> 16) as u8
        })
        .collect();
    let e = c
        .write_file("/data/deep/big.bin", Some(0o600), &big[..])
        .await
        .unwrap();
    assert_eq!(
        (e.path.as_str(), e.name.as_str(), e.kind, e.size, e.mode),
        (
            "/data/deep/big.bin",
            "big.bin",
            EntryType::File,
            20 << 20,
            0o600
        )
    );
    assert_eq!(
        fs::read(a.root.join("data/deep/big.bin")).unwrap(),
        big,
        "written inside LOCKER_AGENT_ROOT"
    );
    assert_eq!(
        fs::metadata(a.root.join("data/deep/big.bin"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    // Read back through the AsyncRead side.
    let (entry, mut reader) = c.read_file("/data/deep/big.bin").await.unwrap();
    assert_eq!(entry.size, 20 << 20);
    let mut back = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut reader, &mut back)
        .await
        .unwrap();
    assert!(back == big, "20 MiB round trip differs");
    let rss = a.peak_rss();
    assert!(rss < 48 << 20, "agent peak RSS {} MiB", rss >> 20);

    let odd = [
        "/odd dir/naïve ünïcødé 🚀.txt",
        "/odd dir/line\nbreak.txt",
        "/odd dir/ spaces  .txt",
        "/odd dir/-dash",
    ];
    for (i, p) in odd.iter().enumerate() {
        c.write_file(p, None, format!("content {i}").as_bytes())
            .await
            .unwrap();
    }
    for (i, p) in odd.iter().enumerate() {
        assert_eq!(
            read_all(c, p).await.unwrap(),
            format!("content {i}").as_bytes()
        );
        assert_eq!(c.stat(p).await.unwrap().mode, 0o644);
    }
    let listed = c.list("/odd dir", 1).await.unwrap();
    let mut names: Vec<&str> = listed.iter().map(|e| e.name.as_str()).collect();
    names.sort();
    let mut want: Vec<&str> = odd.iter().map(|p| &p[9..]).collect();
    want.sort();
    assert_eq!(names, want);
    // Overwrite keeps the old mode unless one is given; the write is atomic (no temp left).
    c.write_file("/data/deep/big.bin", None, &b"small"[..])
        .await
        .unwrap();
    assert_eq!(c.stat("/data/deep/big.bin").await.unwrap().mode, 0o600);
    assert_eq!(fs::read_dir(a.root.join("data/deep")).unwrap().count(), 1);
    // An empty file.
    assert_eq!(
        c.write_file("/empty", None, &b""[..]).await.unwrap().size,
        0
    );
    assert!(read_all(c, "/empty").await.unwrap().is_empty());

    let tree = c.list("/", 3).await.unwrap();
    let paths: Vec<&str> = tree.iter().map(|e| e.path.as_str()).collect();
    assert!(
        paths.contains(&"/data")
            && paths.contains(&"/data/deep")
            && paths.contains(&"/data/deep/big.bin"),
        "{paths:?}"
    );
    assert_eq!(
        c.list("/", 1).await.unwrap().len(),
        3,
        "depth 1 is children only"
    );

    let d = c.mkdir("/m/n/o").await.unwrap();
    assert_eq!((d.kind, d.path.as_str()), (EntryType::Dir, "/m/n/o"));
    assert_eq!(
        c.mkdir("/m/n/o").await.unwrap().kind,
        EntryType::Dir,
        "mkdir -p is idempotent"
    );
    assert_eq!(
        agent_code(c.mkdir("/empty/sub").await.unwrap_err()),
        ErrorCode::Conflict
    );
    let moved = c.rename("/odd dir/-dash", "/m/n/o/moved").await.unwrap();
    assert_eq!(
        (moved.path.as_str(), moved.kind),
        ("/m/n/o/moved", EntryType::File)
    );
    assert_eq!(
        agent_code(c.stat("/odd dir/-dash").await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        agent_code(c.remove("/m", false).await.unwrap_err()),
        ErrorCode::Conflict
    );
    c.remove("/m", true).await.unwrap();
    assert!(!a.root.join("m").exists());
    c.remove("/empty", false).await.unwrap();
    assert_eq!(
        agent_code(c.remove("/empty", false).await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        agent_code(read_all(c, "/missing").await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        agent_code(read_all(c, "/data").await.unwrap_err()),
        ErrorCode::BadRequest
    );
    assert_eq!(
        agent_code(c.list("/odd dir/ spaces  .txt", 1).await.unwrap_err()),
        ErrorCode::BadRequest
    );
    assert_eq!(
        agent_code(c.stat("relative/path").await.unwrap_err()),
        ErrorCode::BadRequest
    );
    assert_eq!(
        agent_code(c.write_file("/data", None, &b"x"[..]).await.unwrap_err()),
        ErrorCode::BadRequest
    );
    assert_eq!(
        agent_code(c.remove("/", true).await.unwrap_err()),
        ErrorCode::BadRequest
    );
    assert_eq!(c.stat("/").await.unwrap().kind, EntryType::Dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlinks_and_dotdot_never_leave_the_root() {
    let a = TestAgent::start(Opts::default()).await;
    let c = &a.client;
    let outside = a.dir.join("secret.txt");
    fs::write(&outside, "host secret").unwrap();
    fs::create_dir_all(a.root.join("etc")).unwrap();
    fs::write(a.root.join("etc/passwd"), "inside").unwrap();
    let link =
        |target: &str, name: &str| std::os::unix::fs::symlink(target, a.root.join(name)).unwrap();
    link("/etc", "abs");
    link("../../../../..", "up");
    link("../secret.txt", "rel_secret");
    link(outside.to_str().unwrap(), "abs_secret");
    link("chain2", "chain1");
    link("/up/../rel_secret", "chain2");

    assert_eq!(read_all(c, "/abs/passwd").await.unwrap(), b"inside");
    assert_eq!(read_all(c, "/up/up/etc/passwd").await.unwrap(), b"inside");
    for p in [
        "/rel_secret",
        "/abs_secret",
        "/chain1",
        "/../secret.txt",
        "/up/secret.txt",
        "/../../../..".to_string().as_str(),
    ] {
        match read_all(c, p).await {
            Ok(bytes) => assert_ne!(bytes, b"host secret", "{p} reached the host's file"),
            Err(e) => assert!(matches!(
                agent_code(e),
                ErrorCode::NotFound | ErrorCode::BadRequest
            )),
        }
    }
    // Writes through escaping links land inside the root.
    c.write_file("/up/escaped.txt", None, &b"x"[..])
        .await
        .unwrap();
    assert!(a.root.join("escaped.txt").exists());
    assert!(!a.dir.join("escaped.txt").exists() && !Path::new("/escaped.txt").exists());
    c.mkdir("/abs/newdir").await.unwrap();
    assert!(a.root.join("etc/newdir").is_dir());
    let listed = c.list("/up", 1).await.unwrap();
    assert!(listed.iter().any(|e| e.name == "escaped.txt"), "{listed:?}");
    // Removing a link removes the link, never its target.
    assert_eq!(
        c.stat("/abs_secret").await.unwrap().kind,
        EntryType::Symlink
    );
    c.remove("/abs_secret", false).await.unwrap();
    c.remove("/abs", true).await.unwrap();
    assert_eq!(fs::read_to_string(&outside).unwrap(), "host secret");
    assert!(a.root.join("etc/passwd").exists());
    // Moving through links stays inside too.
    c.rename("/up/escaped.txt", "/up/../../moved.txt")
        .await
        .unwrap();
    assert!(a.root.join("moved.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_frame_drops_only_its_connection() {
    use std::os::unix::net::UnixStream;
    let a = TestAgent::start(Opts::default()).await;
    let sock = a.sock.clone();
    let other = a.client.clone();
    // A long command on the healthy connection keeps running through it all.
    let long =
        tokio::spawn(async move { other.exec(sh("sleep 1; echo survived"), None, None).await });
    let garbage: Vec<Vec<u8>> = vec![
        vec![0, 0, 0, 0, 1, 0, 0, 0, 77, 0, 0, 0], // unknown kind
        vec![0xff, 0xff, 0xff, 0x7f, 1, 0, 0, 0, 4, 2, 0, 0], // oversized length
        vec![
            5, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, b'{', b'"', b'o', b'p', b'}',
        ], // bad JSON Open
        vec![0, 0, 0, 0, 1, 0, 0, 0, 9, 0, 0, 0],  // End from the host
    ];
    for (i, g) in garbage.iter().enumerate() {
        let sock = sock.clone();
        let g = g.clone();
        let closed = tokio::task::spawn_blocking(move || {
            let mut s = UnixStream::connect(&sock).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut scratch = Vec::new();
            let hello = locker_proto::read_frame(&mut s, &mut scratch).unwrap();
            assert!(matches!(hello, Some(locker_proto::Frame::Hello(_))));
            if i % 2 == 0 {
                let mut b = Vec::new();
                locker_proto::Frame::Hello(locker_proto::Hello {
                    version: locker_proto::PROTOCOL_VERSION,
                    peer: "t".into(),
                    features: Vec::new(),
                })
                .encode(&mut b)
                .unwrap();
                s.write_all(&b).unwrap();
            }
            s.write_all(&g).unwrap();
            let mut buf = [0u8; 64];
            matches!(s.read(&mut buf), Ok(0))
        })
        .await
        .unwrap();
        assert!(closed, "garbage #{i} must close its connection");
    }
    // A wrong protocol version is refused too.
    let refused = tokio::task::spawn_blocking(move || {
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = Vec::new();
        locker_proto::Frame::Hello(locker_proto::Hello {
            version: 99,
            peer: "future".into(),
            features: Vec::new(),
        })
        .encode(&mut b)
        .unwrap();
        s.write_all(&b).unwrap();
        let mut scratch = Vec::new();
        let _ = locker_proto::read_frame(&mut s, &mut scratch);
        matches!(locker_proto::read_frame(&mut s, &mut scratch), Ok(None))
    })
    .await
    .unwrap();
    assert!(refused);
    a.client.ping().await.unwrap();
    let fresh = AgentClient::connect(&a.sock, Duration::from_secs(5))
        .await
        .unwrap();
    fresh.ping().await.unwrap();
    let r = long.await.unwrap().unwrap();
    assert_eq!(r.stdout, "survived\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_blocks_only_its_own_stream() {
    let a = TestAgent::start(Opts::default()).await;
    let c = a.client.clone();
    fs::write(a.root.join("f.txt"), "file body").unwrap();
    let pidfile = a.dir.join("stalled.pid");
    let (tx, rx_kept) = mpsc::channel(1);
    let stalled_spec = sh(&format!(
        "echo $$ > {}; head -c 200000000 /dev/zero; echo finished",
        pidfile.display()
    ));
    let stalled = tokio::spawn(async move { c.exec(stalled_spec, None, Some(tx)).await });
    // A stalled file download on the same connection, too.
    let (_, stalled_file) = a.client.read_file("/f.txt").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..3 {
        let t = Instant::now();
        let r = a.client.exec(sh("echo hi"), None, None).await.unwrap();
        assert_eq!(r.stdout, "hi\n");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the other stream took {:?}",
            t.elapsed()
        );
        assert_eq!(read_all(&a.client, "/f.txt").await.unwrap(), b"file body");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !stalled.is_finished(),
        "the stalled stream cannot have finished"
    );
    let rss = a.peak_rss();
    assert!(
        rss < 48 << 20,
        "the agent buffered the stalled output: peak RSS {} MiB",
        rss >> 20
    );
    let pid: i32 = fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(pid));
    // Dropping the exec future cancels the command: its tree dies and its cgroup goes.
    stalled.abort();
    drop(rx_kept);
    drop(stalled_file);
    assert!(
        gone_within(pid, Duration::from_secs(5)),
        "cancelled command {pid} still runs"
    );
    let busy = || {
        a.cgroups().command_cgroups().iter().any(|c| {
            !fs::read_to_string(c.join("cgroup.procs"))
                .unwrap_or_default()
                .trim()
                .is_empty()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while busy() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.cgroups().assert_only_idle();
    a.client.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_shrink_to_fit_one_frame_and_keep_everything_in_the_file() {
    let a = TestAgent::start(Opts::default()).await;
    // 1.5 MB of NUL bytes: under the cap, but six JSON bytes each ("\u0000").
    let mut s = sh("head -c 1500000 /dev/zero");
    s.max_output_bytes = 2_000_000;
    let r = a.client.exec(s, None, None).await.unwrap();
    assert_eq!((r.exit_code, r.stdout_bytes), (Some(0), 1_500_000));
    assert!(r.stdout_truncated, "shown text had to shrink");
    assert!(serde_json::to_vec(&r).unwrap().len() < locker_proto::MAX_PAYLOAD);
    assert!(r.stdout.contains("bytes omitted]…"));
    let path = r.output_path.expect("the full output is in a file");
    assert_eq!(fs::read(path).unwrap(), vec![0u8; 1_500_000]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_lists_come_in_batches() {
    let a = TestAgent::start(Opts::default()).await;
    let many = a.root.join("many");
    fs::create_dir(&many).unwrap();
    let long = "n".repeat(150);
    for i in 0..6000 {
        fs::write(many.join(format!("{long}-{i:05}")), "").unwrap();
    }
    let entries = a.client.list("/many", 1).await.unwrap();
    assert_eq!(entries.len(), 6000);
    assert!(
        serde_json::to_vec(&entries).unwrap().len() > locker_proto::MAX_PAYLOAD,
        "needs batches"
    );
    assert!(
        entries.windows(2).all(|w| w[0].name < w[1].name),
        "sorted by name"
    );
    assert_eq!(entries[0].path, format!("/many/{long}-00000"));

    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(
            a.client
                .spawn(sh("head -c 60000 /dev/zero | tr '\\0' x"))
                .await
                .unwrap()
                .0,
        );
    }
    for id in &ids {
        let (tx, _rx) = mpsc::channel(1024);
        let info = tokio::time::timeout(
            Duration::from_secs(20),
            a.client.process_output(id, true, tx),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(info.result.unwrap().stdout.len(), 60_000);
    }
    let procs = a.client.list_processes().await.unwrap();
    assert_eq!(procs.len(), 20);
    assert!(
        serde_json::to_vec(&procs).unwrap().len() > locker_proto::MAX_PAYLOAD,
        "needs batches"
    );
    assert!(procs
        .iter()
        .all(|p| p.state == "exited" && p.result.as_ref().unwrap().stdout.len() == 60_000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cgroups_commands_still_run_and_time_out() {
    let a = TestAgent::start(Opts {
        no_cgroups: true,
        ..Default::default()
    })
    .await;
    let r = a
        .client
        .exec(sh("echo $$; exec cat /proc/self/cgroup"), None, None)
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0));
    let mut s = sh("echo before; sleep 300");
    s.timeout_ms = Some(500);
    let t = Instant::now();
    let r = a.client.exec(s, None, None).await.unwrap();
    assert_eq!((r.reason, r.stdout.as_str()), (Reason::Timeout, "before\n"));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    let r = a
        .client
        .exec(
            spec(&["python3", "-c", "sum(range(20_000_000))"]),
            None,
            None,
        )
        .await
        .unwrap();
    assert!(
        r.usage.cpu_ms > 50 && r.usage.peak_memory_bytes > 1 << 20,
        "rusage fallback: {:?}",
        r.usage
    );
    assert!(a.client.machine_usage().await.unwrap().cpu_ms >= r.usage.cpu_ms);
    assert!(
        a.cgroups().command_cgroups().is_empty(),
        "no cgroups were used"
    );
    let log = fs::read_to_string(a.dir.join("agent.log")).unwrap();
    assert!(log.contains("no usable cgroups"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_still_gets_the_tail_after_the_command_exits() {
    let a = TestAgent::start(Opts::default()).await;
    // More than the window plus a pipe's worth, so output is still in the pipe (and the agent
    // still waits for credit) when the command has long exited.
    let (tx, mut rx) = mpsc::channel(1);
    let c = a.client.clone();
    let job = tokio::spawn(async move {
        c.exec(
            sh("head -c 1150000 /dev/zero; echo THE-END"),
            None,
            Some(tx),
        )
        .await
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut streamed = Vec::new();
    while let Some((_, b)) = rx.recv().await {
        streamed.extend(b);
    }
    let r = job.await.unwrap().unwrap();
    assert_eq!(r.stdout_bytes, 1_150_008);
    assert_eq!(streamed.len(), 1_150_008);
    assert!(streamed.ends_with(b"THE-END\n"));
    assert!(r.stdout.ends_with("THE-END\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_listening_fd_works_and_no_agent_fd_leaks_into_commands() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let dir = std::env::temp_dir().join(unique("locker-agent-fd-"));
    fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("handed.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let cgroups = TestCgroups::create(None);
    let lfd = listener.as_raw_fd();
    let mut cmd = Command::new(agent_bin());
    cmd.env("LOCKER_AGENT_FD", "3")
        .env("LOCKER_CGROUP_PARENT", &cgroups.name)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(dir.join("agent.log")).unwrap());
    // SAFETY: dup2 is async-signal-safe; it puts the listener on fd 3 without CLOEXEC, the way
    // a machine's init hands it over.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(lfd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(listener);
    let guard = Guard {
        child,
        cgroups: Some(cgroups),
        dir: dir.clone(),
    };
    let client = AgentClient::connect(&sock, Duration::from_secs(20))
        .await
        .unwrap();
    client.ping().await.unwrap();
    // The command sees its three standard fds and nothing of the agent's (sockets, cgroup
    // files, the files root, other commands' pipes).
    let other = client.clone();
    let busy = tokio::spawn(async move { other.exec(sh("sleep 2"), None, None).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = client.exec(sh("ls /proc/$$/fd"), None, None).await.unwrap();
    assert_eq!(r.stdout, "0\n1\n2\n", "leaked descriptors: {}", r.stdout);
    let r = client
        .exec(sh("ls -l /proc/$$/fd | grep -c socket || true"), None, None)
        .await
        .unwrap();
    assert_eq!(r.stdout.trim(), "0");
    busy.await.unwrap().unwrap();
    drop(guard);
}

/// A small tmpfs mounted for one test; lazily unmounted on drop.
struct SmallFs(PathBuf);

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_exhausted_and_leaves_no_temp_file() {
    let a = TestAgent::start(Opts::default()).await;
    let small = a.root.join("small");
    fs::create_dir(&small).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&small)
        .status()
        .unwrap();
    assert!(ok.success(), "mounting a tmpfs needs root");
    let _mounted = SmallFs(small.clone());
    let big = vec![7u8; 3 << 20];
    let err = a
        .client
        .write_file("/small/big.bin", None, &big[..])
        .await
        .unwrap_err();
    assert_eq!(agent_code(err), ErrorCode::Exhausted);
    assert_eq!(
        fs::read_dir(&small).unwrap().count(),
        0,
        "the temporary file was removed"
    );
    // The connection and the disk are still usable.
    a.client
        .write_file("/small/ok.txt", None, &b"fits"[..])
        .await
        .unwrap();
    assert_eq!(read_all(&a.client, "/small/ok.txt").await.unwrap(), b"fits");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_times_out_and_a_dead_agent_fails_calls_in_flight() {
    let t = Instant::now();
    let err = AgentClient::connect(
        Path::new("/nonexistent/agent.sock"),
        Duration::from_millis(300),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, AgentClientError::Timeout(_)), "{err}");
    assert!(t.elapsed() < Duration::from_secs(3));

    let mut a = TestAgent::start(Opts::default()).await;
    let c = a.client.clone();
    let running = tokio::spawn(async move { c.exec(sh("sleep 30"), None, None).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.guard.child.kill().unwrap();
    let err = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, AgentClientError::ConnectionLost(_)), "{err}");
    assert!(a.client.is_closed());
    assert!(matches!(
        a.client.ping().await.unwrap_err(),
        AgentClientError::ConnectionLost(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cgroup_v2_layout_kills_trees_and_accounts() {
    // On a hybrid host (like Debian's here) the v2 hierarchy is `unified`, without
    // controllers, but cgroup.kill, membership and cpu.stat work there: enough to exercise
    // the v2 code path. On a pure v2 host it is the cgroup root itself.
    let unified = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("cgroup.controllers").exists())
        .expect("no cgroup v2 hierarchy to test with");
    let a = TestAgent::start(Opts {
        cgroup_root: Some(unified),
        ..Default::default()
    })
    .await;
    let r = a
        .client
        .exec(sh("cat /proc/self/cgroup"), None, None)
        .await
        .unwrap();
    let name = &a.cgroups().name;
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with("0::/") && l.contains(name.as_str())),
        "{}",
        r.stdout
    );
    let pidfile = a.dir.join("grandchild.pid");
    let mut s = sh(&format!(
        "setsid sh -c 'sleep 300 & echo $! > {}'; sleep 300",
        pidfile.display()
    ));
    s.timeout_ms = Some(700);
    let r = a.client.exec(s, None, None).await.unwrap();
    assert_eq!(r.reason, Reason::Timeout);
    let pid: i32 = fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        gone_within(pid, Duration::from_secs(3)),
        "grandchild {pid} survived"
    );
    // The next command runs whole: the agent clones it into its cgroup on v2, and Linux
    // 6.18 kills at birth a child cloned into a cgroup once killed through `cgroup.kill`,
    // so the timed-out command's cgroup must not be the one reused.
    let r = a
        .client
        .exec(
            spec(&["python3", "-c", "sum(range(20_000_000))"]),
            None,
            None,
        )
        .await
        .unwrap();
    assert!(r.usage.cpu_ms > 50, "cpu.stat: {:?}", r.usage);
    assert!(
        r.usage.peak_memory_bytes > 1 << 20,
        "rusage fallback without memory.peak: {:?}",
        r.usage
    );
    assert!(a.client.machine_usage().await.unwrap().cpu_ms >= r.usage.cpu_ms);
    a.cgroups().assert_only_idle();
}

/// A fake agent on a unix socket: answers `Hello`, then hands each frame the host sends to
/// `serve` with a writer (the host's side is the real [`AgentClient`]).
struct FakePeer {
    dir: PathBuf,
    /// Bytes the fake wrote after `Hello`.
    sent: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Set when the host cancelled a stream.
    cancelled: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl FakePeer {
    /// Starts a fake whose answer to the first `Open` is `answer(stream, write)`, called
    /// until it returns false or the host cancels.
    fn start(
        answer: impl Fn(u32, &mut dyn FnMut(&locker_proto::Frame) -> bool) -> bool + Send + 'static,
    ) -> (FakePeer, PathBuf) {
        use std::os::unix::net::UnixListener;
        use std::sync::atomic::{AtomicBool, AtomicU64};
        use std::sync::Arc;
        let dir = std::env::temp_dir().join(unique("locker-fake-peer"));
        fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("agent.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let sent = Arc::new(AtomicU64::new(0));
        let cancelled = Arc::new(AtomicBool::new(false));
        let (sent2, cancelled2) = (sent.clone(), cancelled.clone());
        std::thread::spawn(move || {
            let Ok((mut s, _)) = listener.accept() else {
                return;
            };
            let mut scratch = Vec::new();
            let Ok(Some(locker_proto::Frame::Hello(_))) =
                locker_proto::read_frame(&mut s, &mut scratch)
            else {
                return;
            };
            let mut b = Vec::new();
            locker_proto::Frame::Hello(locker_proto::Hello {
                version: locker_proto::PROTOCOL_VERSION,
                peer: "fake".into(),
                features: Vec::new(),
            })
            .encode(&mut b)
            .unwrap();
            s.write_all(&b).unwrap();
            let Ok(Some(locker_proto::Frame::Open { stream, .. })) =
                locker_proto::read_frame(&mut s, &mut scratch)
            else {
                return;
            };
            // The host's later frames (Cancel) are watched from a second thread.
            let mut r = s.try_clone().unwrap();
            let c = cancelled2.clone();
            std::thread::spawn(move || {
                let mut scratch = Vec::new();
                while let Ok(Some(f)) = locker_proto::read_frame(&mut r, &mut scratch) {
                    if matches!(f, locker_proto::Frame::Cancel { .. }) {
                        c.store(true, Ordering::SeqCst);
                    }
                }
                c.store(true, Ordering::SeqCst);
            });
            let mut write = |f: &locker_proto::Frame| -> bool {
                if cancelled2.load(Ordering::SeqCst) {
                    return false;
                }
                let mut b = Vec::new();
                f.encode(&mut b).unwrap();
                sent2.fetch_add(b.len() as u64, Ordering::SeqCst);
                s.write_all(&b).is_ok()
            };
            while answer(stream, &mut write) {}
            // Keep the connection open (a stopped agent neither answers nor closes).
            std::thread::sleep(Duration::from_secs(30));
        });
        (
            FakePeer {
                dir,
                sent,
                cancelled,
            },
            sock,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_agent_answering_a_list_without_end_is_cut_at_the_bound() {
    // Batches of long entries, without end (the report's 300 MiB answer, and more).
    let entry = locker_types::Entry {
        path: format!("/{}", "p".repeat(4000)),
        name: "p".repeat(250),
        kind: EntryType::File,
        size: 0,
        mode: 0o644,
        mtime: "2026-12-01T00:00:00Z".into(),
        uid: None,
        gid: None,
        target: None,
        metadata: Default::default(),
    };
    let batch: Vec<_> = std::iter::repeat_n(entry, 120).collect();
    // Without end, as far as a host without a bound would see: 256 MiB, then an `End`
    // (so a host that buffers everything fails this test instead of the machine).
    let pushed = std::sync::atomic::AtomicU64::new(0);
    let (peer, sock) = FakePeer::start(move |stream, write| {
        if pushed.fetch_add(1, Ordering::SeqCst) >= 512 {
            write(&locker_proto::Frame::End {
                stream,
                body: EndBody::Entries(vec![]),
            });
            return false;
        }
        write(&locker_proto::Frame::Msg {
            stream,
            msg: Reply::Entries {
                entries: batch.clone(),
            },
        })
    });
    let client = AgentClient::connect(&sock, Duration::from_secs(5))
        .await
        .unwrap();
    let t = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(60), client.list("/", 16))
        .await
        .expect("the list ends")
        .unwrap_err();
    assert!(matches!(err, AgentClientError::TooLarge(_)), "{err}");
    assert!(err.to_string().contains("subdirectory"), "{err}");
    // The host stopped reading at the bound: it cancelled, and the agent could not push
    // much more than the bound before that (what sits in the socket's buffers).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        peer.cancelled.load(Ordering::SeqCst),
        "the host cancelled the stream"
    );
    let sent = peer.sent.load(Ordering::SeqCst);
    println!(
        "hostile list: refused after {:?}, the fake sent {} MiB",
        t.elapsed(),
        sent >> 20
    );
    assert!(
        sent < (locker_runtime::agent::MAX_LIST_BYTES as u64) + (16 << 20),
        "the fake pushed {sent} bytes"
    );
    // The connection is still usable for other streams (the fake only answered one).
    assert!(!client.is_closed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_on_a_silent_agent_ends_after_its_timeout_and_grace() {
    // The fake takes the exec and never answers, like a stopped agent.
    let (_peer, sock) = FakePeer::start(|_, _| false);
    let client = AgentClient::connect(&sock, Duration::from_secs(5))
        .await
        .unwrap();
    let mut s = sh("sleep 100");
    s.timeout_ms = Some(500);
    let t = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(20), client.exec(s, None, None))
        .await
        .expect("the exec ends")
        .unwrap_err();
    let took = t.elapsed();
    assert!(matches!(err, AgentClientError::Unresponsive(_)), "{err}");
    let grace = locker_runtime::agent::EXEC_GRACE;
    assert!(
        took >= Duration::from_millis(500) + grace && took < Duration::from_millis(1500) + grace,
        "the exec failed after {took:?}"
    );
}
