//! Shared helpers of the integration tests: finding the built binaries and the default
//! template, unique names, and guards that clean up even when a test fails.
//!
//! The tests run as root on a host prepared by `scripts/setup test` (which builds
//! `target/release/locker`, the static `locker-agent` beside it, and the default template).

/// A test server for machines (python3, stdlib only; `python3 srv.py PORT`): echoes requests
/// as JSON (method, path, length, sha256 and headers of the body), streams `/big?n=`, sends
/// events on `/sse`, answers garbage on `/garbage`, echoes WebSocket frames on `/ws`.
pub const HTTP_SERVER_PY: &str = include_str!("http_server.py");

/// A new sandbox (created with `body`) running [`HTTP_SERVER_PY`] on `port`, started with
/// `&` (a job of its exec), once the port is listed.
pub fn serving_http(api: &server::Api, body: &serde_json::Value, port: u16) -> String {
    let id = api.create_sandbox(body)["id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned();
    api.put(
        &format!(
            "/v1/sandboxes/{id}/files?path={}",
            server::enc("/root/srv.py")
        ),
        HTTP_SERVER_PY.as_bytes(),
    )
    .expect(200, "upload the server");
    let r = api.exec(
        &id,
        &serde_json::json!({"shell": format!("python3 /root/srv.py {port} &")}),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    wait_for(
        std::time::Duration::from_secs(60),
        "the port to be listed",
        || {
            let ports = api
                .get(&format!("/v1/sandboxes/{id}/ports"))
                .expect(200, "list ports");
            ports["ports"]
                .as_array()
                .is_some_and(|a| a.iter().any(|p| p["port"] == port))
                .then_some(())
        },
    );
    id
}

/// A WebSocket to `/ws` of `port` in sandbox `id` through the path proxy, with the server's
/// key; reads wait at most `read_timeout`.
pub fn port_websocket(
    s: &server::Server,
    id: &str,
    port: u16,
    read_timeout: std::time::Duration,
) -> tungstenite::WebSocket<std::net::TcpStream> {
    use tungstenite::client::IntoClientRequest;
    let addr = s
        .url
        .strip_prefix("http://")
        .expect("an http URL")
        .to_owned();
    let mut req = format!("ws://{addr}/v1/sandboxes/{id}/ports/{port}/ws")
        .into_client_request()
        .expect("a WebSocket request");
    req.headers_mut().insert(
        "Authorization",
        format!("Bearer {}", s.api_key)
            .parse()
            .expect("a header value"),
    );
    let stream = std::net::TcpStream::connect(&addr).expect("connect to the server");
    stream
        .set_read_timeout(Some(read_timeout))
        .expect("a read timeout");
    let (ws, resp) = tungstenite::client(req, stream).expect("a WebSocket through the proxy");
    assert_eq!(resp.status().as_u16(), 101);
    ws
}

/// Checks that `ws` (to [`HTTP_SERVER_PY`]'s `/ws` or the like) echoes a short and a 100 KB
/// text frame and a binary one, then closes it.
pub fn websocket_echoes(mut ws: tungstenite::WebSocket<std::net::TcpStream>) {
    for msg in ["hello", &"y".repeat(100_000)] {
        ws.send(tungstenite::Message::Text(msg.into())).unwrap();
        match ws.read().unwrap() {
            tungstenite::Message::Text(t) => assert_eq!(t.as_str(), msg),
            other => panic!("not an echo: {other:?}"),
        }
    }
    ws.send(tungstenite::Message::Binary(vec![0u8, 1, 2, 255].into()))
        .unwrap();
    assert_eq!(
        ws.read().unwrap(),
        tungstenite::Message::Binary(vec![0u8, 1, 2, 255].into())
    );
    let _ = ws.close(None);
}

pub mod answers;
pub mod echo;
pub mod egress;
pub mod fabric;
pub mod fleet;
pub mod images;
pub mod patroni;
pub mod postgres;
pub mod server;
pub mod shared;
pub mod streams;
pub mod tools;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_owned()
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// Builds the `code-interpreter` template once per host (a no-op when it is cached).
pub fn code_interpreter_template() {
    static BUILT: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let started = std::time::Instant::now();
        // A spawn can meet a passing ETXTBSY while another test's thread writes a file
        // (fork and exec race in a threaded process): a few tries, then the error.
        let mut tries = 0;
        let child = loop {
            match std::process::Command::new(locker_bin())
                .args(["template", "build", "code-interpreter"])
                .stdout(std::process::Stdio::inherit())
                .stderr(std::process::Stdio::inherit())
                .spawn()
            {
                Ok(c) => break c,
                Err(e) if tries < 5 => {
                    eprintln!("start `locker template build code-interpreter`: {e}; again");
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
                Err(e) => panic!("start `locker template build code-interpreter`: {e}"),
            }
        };
        register_child(child.id());
        let out = child
            .wait_with_output()
            .expect("wait for the template build");
        assert!(
            out.status.success(),
            "building the code-interpreter template failed"
        );
        eprintln!(
            "the code-interpreter template is ready ({:.1} s)",
            started.elapsed().as_secs_f64()
        );
    });
}

/// The `locker` binary: `$LOCKER_BIN`, else the release build, else the debug build.
pub fn locker_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("LOCKER_BIN") {
        return PathBuf::from(p);
    }
    for profile in ["release", "debug"] {
        let p = target_dir().join(profile).join("locker");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "the locker binary is not built: run `scripts/setup build` (or cargo build -p locker-cli)"
    )
}

/// The static agent: `$LOCKER_AGENT_BIN`, else the static release build.
pub fn agent_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("LOCKER_AGENT_BIN") {
        return PathBuf::from(p);
    }
    for p in [
        target_dir().join("x86_64-unknown-linux-gnu/release/locker-agent"),
        target_dir().join("x86_64-unknown-linux-gnu/debug/locker-agent"),
    ] {
        if locker_runtime::node::is_static_elf(&p) {
            return p;
        }
    }
    panic!("the static locker-agent is not built: run `scripts/setup build`")
}

/// The host's template cache (`$LOCKER_CACHE_DIR`, default `/var/cache/locker`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("LOCKER_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/locker"))
}

/// The default template's root filesystem.
pub fn default_rootfs() -> PathBuf {
    let store = locker_runtime::template::TemplateStore::open(cache_dir())
        .expect("open the template cache");
    let t = store
        .resolve("default")
        .expect("read the template cache")
        .expect("the default template is not built: run `scripts/setup build` (locker template build default)");
    t.rootfs
}

/// Whether machines' agents reuse ended command cgroups on this host: everywhere but on a
/// cgroup v2 memory controller before Linux 6.12, whose `memory.peak` cannot be reset
/// (there each command gets a new cgroup, removed when it ends).
pub fn cgroups_reused() -> bool {
    let v2_memory = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
        .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"));
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    !v2_memory || (major, minor) >= (6, 12)
}

/// A name unique to this test process and call: `<prefix>-<pid>-<n>`.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Makes this test process a child subreaper, so shims orphaned by a killed server are
/// reaped here instead of lingering as zombies (some container inits never reap).
pub fn become_subreaper() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        std::thread::spawn(|| loop {
            // Reap only children that are not ours to wait for explicitly: orphans adopted
            // through the subreaper flag have a parent pid of ours but no Child handle.
            reap_adopted_orphans();
            std::thread::sleep(std::time::Duration::from_millis(50));
        });
    });
}

static OWN_CHILDREN: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

/// Registers a child the test waits for itself (a server it started), so the orphan
/// reaper leaves it alone.
pub fn register_child(pid: u32) {
    OWN_CHILDREN.lock().expect("lock").push(pid as i32);
}

/// The machines' helpers (`locker __jail-init`, `locker __vm-fs`) seen alive, by pid: only
/// those are reaped as orphans. A `locker` a test runs itself (`Command::output`) is a
/// child of ours by the same name, and reaping its zombie would take its exit status from
/// the test (`ECHILD`).
static HELPERS: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

fn reap_adopted_orphans() {
    let me = std::process::id() as i32;
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    let mut helpers = HELPERS.lock().expect("lock");
    // A pid seen once as a helper is kept while it exists (a zombie's cmdline is empty).
    helpers.retain(|p| Path::new(&format!("/proc/{p}")).exists());
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rsplit(')').next() else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let state = f.next().unwrap_or("");
        let ppid: i32 = f.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let comm = stat
            .split_once('(')
            .and_then(|(_, r)| r.rsplit_once(')'))
            .map(|(c, _)| c)
            .unwrap_or("");
        if comm != "locker" {
            continue;
        }
        if state != "Z" && !helpers.contains(&pid) {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let helper = |name: &[u8]| cmd.windows(name.len()).any(|w| w == name);
            if helper(b"__jail-init\0") || helper(b"__vm-fs\0") {
                helpers.push(pid);
            }
        }
        // Only zombie helpers of machines that no test waits for itself.
        let mine = OWN_CHILDREN
            .lock()
            .map(|v| v.contains(&pid))
            .unwrap_or(true);
        if ppid == me && state == "Z" && helpers.contains(&pid) && !mine {
            let mut status = 0;
            // SAFETY: waitpid on a zombie child of ours.
            unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        }
    }
}

/// A machine's freezer state on the host: `Some(true)` when frozen, `None` when it has no
/// cgroup (v1: `freezer.state`; v2: the `frozen` line of `cgroup.events`, the state reached
/// rather than the one asked for).
pub fn frozen(id: &str) -> Option<bool> {
    let v1 = machine_cgroup(Path::new("/sys/fs/cgroup/freezer"), id)
        .and_then(|d| std::fs::read_to_string(d.join("freezer.state")).ok());
    if let Some(s) = v1 {
        return Some(s.trim() == "FROZEN");
    }
    let v2 = machine_cgroup(Path::new("/sys/fs/cgroup"), id)?.join("cgroup.events");
    std::fs::read_to_string(v2)
        .ok()
        .map(|s| s.lines().any(|l| l == "frozen 1"))
}

/// Whether process `pid` has exited (gone, or a zombie nobody reaped yet).
pub fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            .is_some_and(|st| st == "Z" || st == "X"),
    }
}

/// A guest's clock logged every 20 ms into `/dev/shm/t` (bash's `$EPOCHREALTIME`, one line
/// per tick), with shell builtins only (a fork under TCG takes longer than a tick): run it
/// with `bash -c`; [`guest_stop`] reads the log.
pub const GUEST_CLOCK: &str = "mkfifo /dev/shm/w; exec 3<>/dev/shm/w; \
    while :; do echo $EPOCHREALTIME >> /dev/shm/t; read -t 0.02 -u 3; done";

/// In a guest's log of its clock ([`GUEST_CLOCK`]) around something asked for at `asked`
/// ([`unix_ns`]): how long the guest ran after `asked` before its longest stop, and that
/// stop, in ms.
pub fn guest_stop(log: &str, asked: u128) -> (u64, u64) {
    let ticks: Vec<u128> = log
        .lines()
        .filter_map(|l| {
            let (s, us) = l.trim().split_once('.')?;
            Some(s.parse::<u128>().ok()? * 1_000_000_000 + us.parse::<u128>().ok()? * 1000)
        })
        .filter(|&t| t + 1_000_000_000 >= asked)
        .collect();
    let (at, gap) = ticks
        .windows(2)
        .map(|w| (w[0], w[1].saturating_sub(w[0])))
        .max_by_key(|&(_, g)| g)
        .expect("ticks around the move");
    (
        (at.saturating_sub(asked) / 1_000_000) as u64,
        (gap / 1_000_000) as u64,
    )
}

/// The host's time now, in nanoseconds since the epoch (to compare with a guest's
/// `date +%s%N`).
pub fn unix_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_nanos()
}

/// Polls `f` every 50 ms until it returns `Some`, or panics with `what` after `limit`.
#[track_caller]
pub fn wait_for<T>(limit: std::time::Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Self {
        let p = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // A server started on a data dir in here may have mounted Locker's XFS image
        // (`<data-dir>/disks`) or volumes, and a killed one leaves them: unmounted first
        // (deepest first, lazily), so nothing of it stays mounted or attached.
        for m in mounts_under(&self.0) {
            let _ = locker_runtime::volume_fs::unmount_at(&m);
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Mount points at or below `dir` in this mount namespace, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(canon) = dir.canonicalize() else {
        return Vec::new();
    };
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut v: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(m.replace("\\040", " ")))
        .filter(|m| m.starts_with(&canon))
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    v.dedup();
    v
}

/// The cgroup of sandbox `id`'s machine under the hierarchy `root` (`/sys/fs/cgroup/pids`,
/// or `/sys/fs/cgroup` on v2), whatever server runs it: `locker/<id>.<tag>` (see
/// `locker_runtime::cgroup::machine_name`), or `locker/<id>` as earlier releases named it.
/// An id holds no dot, so the first such directory is the machine's.
pub fn machine_cgroup(root: &Path, id: &str) -> Option<PathBuf> {
    let tagged = format!("{id}.");
    std::fs::read_dir(root.join("locker"))
        .ok()?
        .flatten()
        .find(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            (n == id || n.starts_with(&tagged)) && e.path().is_dir()
        })
        .map(|e| e.path())
}

/// Host-side traces of a machine: mounts naming its directory, its cgroups, its directory.
pub fn traces_of(id: &str, dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let d = dir.display().to_string();
    for l in mounts.lines().filter(|l| l.contains(&d)) {
        out.push(format!("mount: {l}"));
    }
    for c in ["memory", "pids", "cpu", "cpuacct", "freezer", "unified", ""] {
        let parent = Path::new("/sys/fs/cgroup").join(c).join("locker");
        // This build's name, and the bare id an earlier release's machine has.
        for name in [locker_runtime::cgroup::machine_name(id, dir), id.to_owned()] {
            let p = parent.join(name);
            if p.exists() {
                out.push(format!("cgroup: {}", p.display()));
            }
        }
    }
    if dir.exists() {
        out.push(format!("dir: {}", dir.display()));
    }
    let loops = std::process::Command::new("losetup")
        .arg("-a")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for l in loops.lines().filter(|l| l.contains(&d)) {
        out.push(format!("loop: {l}"));
    }
    out
}

/// Host pids whose real uid lies in `[base, base + 65536)`.
pub fn pids_with_uid_in(base: u32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse::<u32>().ok());
        if uid.is_some_and(|u| u >= base && u < base + 65_536) {
            out.push(pid);
        }
    }
    out
}

/// Pids of the processes whose command line names `dir` (a machine's QEMU names its directory).
pub fn procs_naming(dir: &Path) -> Vec<i32> {
    let needle = dir.as_os_str().as_encoded_bytes();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle))
        })
        .collect()
}

/// The SHA-256 of `data` in hex (`sha256sum`).
pub fn hex_sha256(data: &[u8]) -> String {
    use std::io::Write;
    let mut c = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("sha256sum");
    c.stdin.take().unwrap().write_all(data).unwrap();
    let out = c.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}
