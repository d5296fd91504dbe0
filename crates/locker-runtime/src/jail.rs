//! The jail runtime: a machine made of Linux namespaces on the host's kernel.
//!
//! Owns starting, finding and destroying jailed machines. It does not own the agent's
//! protocol (see [`crate::agent`]) nor the template store (see [`crate::template`]).
//!
//! # How a jail starts
//! The caller (the server, in a multi-threaded process) never forks into namespaces itself:
//! it runs `locker __jail-init <dir>/jail.json`, a fresh single-threaded process (the
//! *shim*) that:
//! 1. binds the agent's listening socket at `<dir>/agent.sock` (host side only);
//! 2. creates the machine's user namespace (root inside = host uid `uid_base`, 65536 ids)
//!    with a throwaway child, and keeps a handle to it;
//! 3. creates the machine's cgroup with its limits, delegated to the machine's root;
//! 4. formats the machine's disk, a sparse ext4 image of `disk_mb` (the disk quota);
//! 5. unshares mount, net, ipc, uts and pid namespaces and forks the machine's PID 1, which
//!    enters the cgroup and a cgroup namespace, mounts the disk and an overlay root
//!    (the template below through an id-mapped read-only mount, the machine's layer above),
//!    a fresh /proc, a minimal /dev, tmpfs /tmp, its cgroup at /sys/fs/cgroup, the view of
//!    its own CPUs and memory (see [`crate::view`]); brings up loopback (its only
//!    interface); pivots into the root; then joins the user namespace,
//!    drops capabilities to the usual container set, sets `no_new_privs`, installs the
//!    seccomp filter and executes `locker-agent` with the socket as fd 3.
//!
//! The shim prints `{"agent_pid":…,"shim_pid":…}`, copies the agent's output (a pipe: its
//! stdout and stderr) into `<dir>/machine.log` up to [`LOG_HEAD`] bytes plus a tail, and
//! waits for PID 1. The log is a host file, so nothing of the machine writes it directly:
//! the agent is non-dumpable and the filter refuses `pidfd_getfd` and `ptrace`, so no
//! command reaches the pipe either. PID 1 is exempt from the OOM killer (set while it is
//! still the host's root, through the legacy `oom_adj` so that its commands, which reset
//! theirs to 0, cannot lower theirs again). Every mount lives
//! only in the machine's mount namespaces, so none is ever visible on the host and all
//! vanish with the machine's last process; the loop device detaches itself (autoclear).
//! Overlays are mounted from paths relative to the machine's directory (the set-up runs
//! in it), so the machine's mount table names nothing of the host's data dir.
//! The mount, network and pid namespaces belong to the host's user namespace, so the
//! machine's root can neither mount nor reconfigure its network.

use std::ffi::CString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cgroup::{Layout, Limits, MachineCgroup};
use crate::sys;

/// How much of the agent's output `machine.log` keeps from the start.
pub const LOG_HEAD: u64 = 1 << 20;
/// How much of the agent's last output past [`LOG_HEAD`] is kept (in the shim's memory)
/// and written when the machine stops.
const LOG_TAIL: usize = 64 << 10;

/// Ids per machine user namespace.
pub const UID_RANGE: u32 = 65_536;
/// The first slot's uid base is `FIRST_SLOT * UID_RANGE`, well above any host account.
const FIRST_SLOT: u32 = 16;

/// The uid base of allocation slot `slot` (0-based).
pub fn uid_base(slot: u32) -> u32 {
    (FIRST_SLOT + slot) * UID_RANGE
}

/// Where blank disk images are kept: `$LOCKER_CACHE_DIR/disks` (default
/// `/var/cache/locker/disks`), shared by every data dir like the templates.
pub fn blank_disks_dir() -> PathBuf {
    std::env::var_os("LOCKER_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/locker"))
        .join("disks")
}

/// Errors of the jail runtime; each names the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("{step}: {source}")]
    Io { step: String, source: io::Error },
    #[error("starting the machine failed: {0}")]
    Init(String),
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::CgroupError),
    #[error(transparent)]
    View(#[from] crate::view::ViewError),
    #[error("the machine did not stop within {0:?}")]
    StopTimeout(Duration),
}

fn step(s: impl Into<String>) -> impl FnOnce(io::Error) -> JailError {
    let s = s.into();
    move |source| JailError::Io { step: s, source }
}

/// Everything the shim needs to build one machine (written as `<dir>/jail.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JailSpec {
    pub id: String,
    /// The template's root filesystem (never written to).
    pub template_rootfs: PathBuf,
    /// The machine's own directory on the host; created by [`start`], removed by [`destroy`].
    pub dir: PathBuf,
    pub uid_base: u32,
    pub cpus: f64,
    pub memory_mb: u64,
    pub pids: u64,
    pub disk_mb: u64,
    /// Start from a copy of this disk image (a snapshot) instead of an empty disk.
    #[serde(default)]
    pub disk_from: Option<PathBuf>,
    /// The (static) agent binary, executed inside the machine.
    pub agent_path: PathBuf,
    pub hostname: String,
    /// Extra overlay mounts (a volume under a run's private copy-on-write layer), mounted
    /// in the machine's root before it pivots.
    #[serde(default)]
    pub mounts: Vec<OverlayMount>,
    /// Host directories bound into the machine (a volume's live tree), id-mapped.
    #[serde(default)]
    pub binds: Vec<BindMount>,
}

/// A host directory (canonical ids) bound into a machine at `target`, id-mapped so the
/// machine's root owns what the host's root owns; every machine binding it sees one live
/// tree.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BindMount {
    pub source: PathBuf,
    /// An absolute path inside the machine (not `/`).
    pub target: PathBuf,
    pub read_only: bool,
}

/// An overlay mounted in a machine at `target`: `lower` (host tree, canonical ids, never
/// written) under `upper` (host directory, canonical ids) with `work` beside it. `upper`
/// and `work` must share their parent directory: that parent is bound read-write, `lower`
/// read-only, both id-mapped into the machine, so the files keep canonical ids on the host.
/// Mounted with `redirect_dir=off,index=off,metacopy=off`: a renamed lower directory is
/// copied (plus a whiteout), so the upper layer is plain files, directories, whiteouts
/// (character devices 0:0) and opaque directories (`trusted.overlay.opaque=y`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct OverlayMount {
    pub lower: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    /// An absolute path inside the machine (not `/`).
    pub target: PathBuf,
}

/// A running jail as the host knows it (`<dir>/state.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JailState {
    pub id: String,
    pub dir: PathBuf,
    pub agent_pid: i32,
    pub shim_pid: i32,
    pub uid_base: u32,
}

impl JailState {
    /// The agent's socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }

    /// Reads the state a started jail left in its directory.
    pub fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&fs::read(dir.join("state.json")).ok()?).ok()
    }

    /// The host path of the machine's writable layer (through the shim's mount namespace),
    /// readable while the machine runs.
    pub fn upper_dir(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.shim_pid))
            .join(self.dir.strip_prefix("/").unwrap_or(&self.dir))
            .join("disk/upper")
    }
}

/// Starts a machine: runs the shim (`init_exe __jail-init`) and waits until the agent's
/// socket exists. Returns the state and the shim's process (the caller reaps it).
pub async fn start(
    spec: &JailSpec,
    init_exe: &Path,
) -> Result<(JailState, tokio::process::Child), JailError> {
    fs::create_dir_all(&spec.dir).map_err(step(format!("create {}", spec.dir.display())))?;
    let spec_path = spec.dir.join("jail.json");
    fs::write(
        &spec_path,
        serde_json::to_vec(spec).expect("spec serializes"),
    )
    .map_err(step("write jail.json"))?;
    let log = fs::File::create(spec.dir.join("machine.log")).map_err(step("create machine.log"))?;
    let mut cmd = tokio::process::Command::new(init_exe);
    cmd.arg("__jail-init")
        .arg(&spec_path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(log);
    // The shim gets its own session: a Ctrl-C at the server's terminal must not kill machines.
    cmd.process_group(0);
    let mut child = cmd
        .spawn()
        .map_err(step(format!("run {} __jail-init", init_exe.display())))?;
    let mut out = child.stdout.take().expect("piped stdout");
    let mut line = Vec::new();
    {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 512];
        loop {
            let n = out
                .read(&mut buf)
                .await
                .map_err(step("read from the jail's init"))?;
            if n == 0 {
                break;
            }
            line.extend_from_slice(&buf[..n]);
            if line.contains(&b'\n') {
                break;
            }
        }
    }
    #[derive(Deserialize)]
    struct Ready {
        agent_pid: Option<i32>,
        shim_pid: Option<i32>,
        error: Option<String>,
    }
    let ready: Ready =
        match serde_json::from_slice(line.split(|b| *b == b'\n').next().unwrap_or(&[])) {
            Ok(r) => r,
            Err(_) => {
                let _ = child.wait().await;
                let log = fs::read_to_string(spec.dir.join("machine.log")).unwrap_or_default();
                return Err(JailError::Init(format!(
                    "the jail's init exited without reporting: {}",
                    log.trim()
                )));
            }
        };
    match (ready.agent_pid, ready.shim_pid, ready.error) {
        (Some(agent_pid), Some(shim_pid), None) => {
            let state = JailState {
                id: spec.id.clone(),
                dir: spec.dir.clone(),
                agent_pid,
                shim_pid,
                uid_base: spec.uid_base,
            };
            write_atomic(
                &spec.dir.join("state.json"),
                &serde_json::to_vec(&state).expect("state serializes"),
            )
            .map_err(step("write state.json"))?;
            Ok((state, child))
        }
        (_, _, err) => {
            let _ = child.wait().await;
            Err(JailError::Init(
                err.unwrap_or_else(|| "the jail's init gave no pid".into()),
            ))
        }
    }
}

/// Writes `path` whole or not at all. No fsync: the file must survive the server's death
/// (the page cache does), not the host's (which takes the machine with it).
fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = fs::File::create(&tmp)?;
    f.write_all(data)?;
    fs::rename(tmp, path)
}

/// Stops a machine and removes every trace of it: its processes (the whole pid namespace
/// dies with its PID 1), its cgroup, its directory (disk image included). Mounts and the
/// loop device go with the namespaces. Works on a half-started machine too, and on one
/// whose shim belongs to an earlier server process.
pub fn destroy(id: &str, dir: &Path, layout: &Layout) -> Result<(), JailError> {
    let cg = MachineCgroup::new(layout.clone(), id);
    let state = JailState::load(dir);
    kill_processes(id, &cg, state.as_ref())?;
    if let Some(s) = &state {
        // The shim exits right after its PID 1; wait so its mount namespace is gone too.
        let deadline = Instant::now() + Duration::from_secs(10);
        while is_shim(s.shim_pid, dir) {
            if Instant::now() > deadline {
                return Err(JailError::StopTimeout(Duration::from_secs(10)));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    cg.remove()?;
    // Egress (if the machine had any): its veth and subnet lease.
    crate::net::detach(dir, None);
    finish_destroy(dir)
}

/// Ends every process of a machine (its files stop changing) without tearing down the
/// rest: what a run needs before it reads the machine's layer. [`destroy`] does the rest.
pub fn stop(id: &str, dir: &Path, layout: &Layout) -> Result<(), JailError> {
    kill_processes(
        id,
        &MachineCgroup::new(layout.clone(), id),
        JailState::load(dir).as_ref(),
    )
}

fn kill_processes(
    id: &str,
    cg: &MachineCgroup,
    state: Option<&JailState>,
) -> Result<(), JailError> {
    if let Some(s) = state {
        if owns_pid(s.agent_pid, id) {
            let _ = sys::kill(s.agent_pid, libc::SIGKILL);
            // PID 1's death takes its whole pid namespace down: give the kernel a moment
            // before falling back to freezing and killing what is left one by one.
            let deadline = Instant::now() + Duration::from_millis(200);
            while !cg.pids().is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
    }
    Ok(cg.kill_all()?)
}

/// Waits for the loop device to go and removes the machine's directory.
fn finish_destroy(dir: &Path) -> Result<(), JailError> {
    // The kernel tears a dead mount namespace down asynchronously; the loop device detaches
    // once the disk is unmounted. Wait for it so "destroyed" means nothing is left.
    // The devices are found once (a scan of every loop device), then only they are
    // watched: with many machines going at once, a scan per poll would cost each of them
    // a read per loop device on the host, every poll.
    let img = dir.join("disk.img");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut devs = loops_backing(&img);
    while !devs.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
        devs.retain(|d| backs(d, &img));
    }
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(JailError::Io {
            step: format!("remove {}", dir.display()),
            source: e,
        }),
    }
}

/// The loop devices (`/sys/block/loopN`) backed by `img`.
fn loops_backing(img: &Path) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    rd.flatten()
        .map(|e| e.path())
        .filter(|d| backs(d, img))
        .collect()
}

/// Whether the block device `dev` (`/sys/block/loopN`) is a loop device backed by `img`.
fn backs(dev: &Path, img: &Path) -> bool {
    fs::read(dev.join("loop/backing_file"))
        .is_ok_and(|b| b.starts_with(img.as_os_str().as_encoded_bytes()))
}

/// Whether `pid` is a live (not zombie) process inside machine `id`'s cgroup.
fn owns_pid(pid: i32, id: &str) -> bool {
    let cg = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    cg.lines().any(|l| {
        l.ends_with(&format!("/{}/{id}", crate::cgroup::PARENT))
            || l.contains(&format!("/{}/{id}/", crate::cgroup::PARENT))
    })
}

/// Whether `pid` is still the shim of the machine in `dir` (and not a zombie or a reused pid).
pub fn is_shim(pid: i32, dir: &Path) -> bool {
    let needle = dir.join("jail.json");
    is_running(pid)
        && cmdline(pid)
            .split(|b| *b == 0)
            .any(|a| a == needle.as_os_str().as_encoded_bytes())
}

/// Whether `pid` exists and is neither a zombie nor dead.
pub(crate) fn is_running(pid: i32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or("Z");
    state != "Z" && state != "X"
}

/// The NUL-separated command line of `pid` (empty if it is gone): to tell a machine's
/// process from a reused pid.
pub(crate) fn cmdline(pid: i32) -> Vec<u8> {
    fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default()
}

/// Whether a machine found on disk is still alive (its shim and agent run).
pub fn is_alive(state: &JailState) -> bool {
    is_shim(state.shim_pid, &state.dir) && owns_pid(state.agent_pid, &state.id)
}

// ---------------------------------------------------------------------------------------
// The shim: runs as `locker __jail-init <spec>` in a fresh single-threaded process.
// ---------------------------------------------------------------------------------------

/// Capabilities root inside a machine keeps (in its own user namespace only): the set
/// container runtimes grant by default.
const KEEP_CAPS: &[u32] = &[
    0,  // CHOWN
    1,  // DAC_OVERRIDE
    3,  // FOWNER
    4,  // FSETID
    5,  // KILL
    6,  // SETGID
    7,  // SETUID
    8,  // SETPCAP
    10, // NET_BIND_SERVICE
    13, // NET_RAW
    18, // SYS_CHROOT
    27, // MKNOD
    29, // AUDIT_WRITE
    31, // SETFCAP
];

/// The shim's entry point. Never returns: exits with PID 1's status.
pub fn init_main(spec_path: &Path) -> ! {
    let code = match run_shim(spec_path) {
        Ok(code) => code,
        Err(e) => {
            // The caller wraps this in its own `JailError::Init`: send the bare reason.
            let reason = match &e {
                JailError::Init(m) => m.clone(),
                e => e.to_string(),
            };
            let msg = serde_json::json!({ "error": reason });
            println!("{msg}");
            eprintln!("locker jail init: {e}");
            1
        }
    };
    std::process::exit(code)
}

fn run_shim(spec_path: &Path) -> Result<i32, JailError> {
    let spec: JailSpec =
        serde_json::from_slice(&fs::read(spec_path).map_err(step("read jail.json"))?)
            .map_err(|e| JailError::Init(format!("bad jail.json: {e}")))?;
    let dir = &spec.dir;

    // 1. The agent's socket: bound here, on the host side, handed to the agent as fd 3.
    let sock_path = dir.join("agent.sock");
    let _ = fs::remove_file(&sock_path);
    let listener =
        std::os::unix::net::UnixListener::bind(&sock_path).map_err(step("bind agent.sock"))?;
    fs::set_permissions(&sock_path, fs::Permissions::from_mode(0o600))
        .map_err(step("chmod agent.sock"))?;

    // 2. The user namespace.
    let userns = make_userns(spec.uid_base)?;

    // 3. The cgroup.
    let layout = Layout::host()?;
    let cg = MachineCgroup::new(layout, &spec.id);
    let limits = Limits {
        cpus: spec.cpus,
        memory_bytes: spec.memory_mb << 20,
        pids: spec.pids,
    };
    cg.create(limits, spec.uid_base)?;
    // Where the machine runs: its count is what `nproc` and `os.cpu_count()` will say.
    let cpus = crate::view::pick_cpus(spec.cpus);

    // 4. The disk: a fresh image, or a copy of a snapshot's.
    let img = dir.join("disk.img");
    match &spec.disk_from {
        Some(from) => {
            crate::disk::copy_ephemeral(from, &img)
                .map_err(step(format!("copy the disk image {}", from.display())))?;
        }
        None => crate::disk::make_from_blank(&img, spec.disk_mb, &blank_disks_dir())
            .map_err(step("make the disk image"))?,
    }
    let seccomp = crate::seccomp::programs().map_err(|e| JailError::Init(e.to_string()))?;
    let agent = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&spec.agent_path)
        .map_err(step(format!(
            "open the agent {}",
            spec.agent_path.display()
        )))?;

    // 5. The namespaces and PID 1.
    sys::unshare(
        libc::CLONE_NEWNS
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWPID,
    )
    .map_err(step("unshare namespaces"))?;
    let (ready_r, ready_w) = sys::pipe().map_err(step("pipe"))?;
    let (log_r, log_w) = sys::pipe().map_err(step("pipe"))?;
    // SAFETY: the shim is single-threaded (no runtime, no threads were started).
    let pid = unsafe { sys::fork() }.map_err(step("fork the machine's PID 1"))?;
    if pid == 0 {
        drop(ready_r);
        drop(log_r);
        let mut w = fs::File::from(ready_w);
        let handed = Handed {
            listener,
            agent,
            log: log_w,
        };
        let err = machine_init(
            &spec,
            &cg,
            cpus.as_deref(),
            userns,
            handed,
            &seccomp,
            &mut w,
        );
        let _ = writeln!(w, "{err}");
        // SAFETY: leaving the child without running the parent's destructors.
        unsafe { libc::_exit(1) };
    }
    drop(ready_w);
    // The log pipe must have no writer but the agent, or its end would never be seen.
    drop(log_w);
    drop(listener);
    drop(agent);
    let mut report = String::new();
    let _ = fs::File::from(ready_r).read_to_string(&mut report);
    if !report.is_empty() {
        let _ = sys::waitpid(pid);
        return Err(JailError::Init(report.trim().to_owned()));
    }
    println!(
        "{}",
        serde_json::json!({ "agent_pid": pid, "shim_pid": std::process::id() })
    );
    let _ = io::stdout().flush();
    // Nothing more goes to the caller's pipe: let it see EOF.
    if let Ok(null) = fs::OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: dup2 onto stdout of this single-threaded process.
        unsafe { libc::dup2(null.as_raw_fd(), 1) };
    }
    copy_log(log_r);
    let status = sys::waitpid(pid).map_err(step("wait for the machine"))?;
    Ok(if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    })
}

/// Copies the agent's output from `from` into the shim's stderr (`machine.log`) until the
/// agent is gone: the first [`LOG_HEAD`] bytes as they come, then a note, and at the end
/// the last [`LOG_TAIL`] bytes with the count of what was dropped. Always reads on, so the
/// agent never blocks on its own log.
fn copy_log(from: OwnedFd) {
    let mut from = fs::File::from(from);
    let mut to = io::stderr().lock();
    let mut buf = vec![0u8; 64 << 10];
    let mut head_left = LOG_HEAD;
    let mut dropped: u64 = 0;
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let head = n.min(usize::try_from(head_left).unwrap_or(usize::MAX));
        if head > 0 {
            let _ = to.write_all(&buf[..head]);
            head_left -= head as u64;
        }
        let rest = &buf[head..n];
        if rest.is_empty() {
            continue;
        }
        if dropped == 0 {
            let _ = writeln!(
                to,
                "\n[locker: the agent's log passed {LOG_HEAD} bytes; the rest is dropped but for \
                 its last {LOG_TAIL} bytes, written when the machine stops]"
            );
        }
        dropped += rest.len() as u64;
        tail.extend_from_slice(rest);
        if tail.len() > 2 * LOG_TAIL {
            tail.drain(..tail.len() - LOG_TAIL);
        }
    }
    if dropped > 0 {
        let keep = tail.len().min(LOG_TAIL);
        let _ = writeln!(
            to,
            "[locker: {} bytes of the agent's log were dropped; its last {keep} bytes follow]",
            dropped - keep as u64
        );
        let _ = to.write_all(&tail[tail.len() - keep..]);
    }
}

/// Creates a user namespace mapping 0..65536 inside to `uid_base..` outside and returns a
/// handle to it. A throwaway child owns it while the maps are written.
fn make_userns(uid_base: u32) -> Result<OwnedFd, JailError> {
    let (r1, w1) = sys::pipe().map_err(step("pipe"))?;
    let (r2, w2) = sys::pipe().map_err(step("pipe"))?;
    // SAFETY: the shim is single-threaded.
    let pid = unsafe { sys::fork() }.map_err(step("fork"))?;
    if pid == 0 {
        drop(r1);
        drop(w2);
        let ok = sys::unshare(libc::CLONE_NEWUSER).is_ok();
        let _ = fs::File::from(w1).write_all(if ok { b"1" } else { b"0" });
        let mut b = [0u8; 1];
        let _ = fs::File::from(r2).read(&mut b);
        // SAFETY: leaving the child without running destructors.
        unsafe { libc::_exit(0) };
    }
    drop(w1);
    drop(r2);
    let mut b = [0u8; 1];
    let _ = fs::File::from(r1).read(&mut b);
    let result = (|| {
        if b[0] != b'1' {
            return Err(JailError::Init("cannot create a user namespace (is kernel.unprivileged_userns_clone or user.max_user_namespaces 0?)".into()));
        }
        let map = format!("0 {uid_base} {UID_RANGE}\n");
        fs::write(format!("/proc/{pid}/uid_map"), &map).map_err(step("write uid_map"))?;
        fs::write(format!("/proc/{pid}/gid_map"), &map).map_err(step("write gid_map"))?;
        let ns = fs::File::open(format!("/proc/{pid}/ns/user"))
            .map_err(step("open the user namespace"))?;
        Ok(OwnedFd::from(ns))
    })();
    drop(w2);
    let _ = sys::waitpid(pid);
    result
}

/// What the shim hands to PID 1: the agent's listening socket, the agent's binary and the
/// write end of the log pipe. The shim drops its copies once PID 1 is forked.
struct Handed {
    listener: std::os::unix::net::UnixListener,
    agent: fs::File,
    log: OwnedFd,
}

/// PID 1's set-up, ending in the agent. Returns only on failure, with the reason.
fn machine_init(
    spec: &JailSpec,
    cg: &MachineCgroup,
    cpus: Option<&[usize]>,
    userns: OwnedFd,
    handed: Handed,
    seccomp: &[seccompiler::BpfProgram],
    ready: &mut fs::File,
) -> String {
    let Handed {
        listener,
        agent,
        log,
    } = handed;
    let view = match machine_setup(spec, cg, cpus, &userns) {
        Ok(v) => v,
        Err(e) => return e.to_string(),
    };
    // Still the host's root: exempt PID 1 from the OOM killer, so a machine that fills its
    // memory (a full /tmp, a bomb) loses a command, never its agent. Through the legacy
    // file on purpose: `oom_score_adj` written with CAP_SYS_RESOURCE also lowers the floor
    // the agent's children inherit (`oom_score_adj_min`), and a command could then make
    // itself unkillable again after the agent reset it to 0; `oom_adj` leaves the floor at 0.
    // A host root without CAP_SYS_RESOURCE (some container hosts) cannot: the machine still
    // starts, /tmp and /dev/shm are sized to leave its processes room, and the log says so.
    if let Err(e) = fs::write("/proc/self/oom_adj", "-17") {
        eprintln!(
            "locker jail init: the agent is not exempt from the OOM killer (the host's root \
             lacks CAP_SYS_RESOURCE?): {e}"
        );
    }
    // Enter the machine's user namespace: from here on we are its root, nobody on the host.
    if let Err(e) = sys::setns(userns.as_raw_fd(), libc::CLONE_NEWUSER) {
        return format!("join the user namespace: {e}");
    }
    drop(userns);
    // SAFETY: plain credential syscalls on this single-threaded process.
    let ids_ok = unsafe {
        libc::setgroups(0, std::ptr::null()) == 0
            && libc::setresgid(0, 0, 0) == 0
            && libc::setresuid(0, 0, 0) == 0
    };
    if !ids_ok {
        return format!("become root of the machine: {}", io::Error::last_os_error());
    }
    if let Err(e) = sys::restrict_capabilities(KEEP_CAPS) {
        return format!("drop capabilities: {e}");
    }
    if let Err(e) = sys::set_no_new_privs() {
        return format!("set no_new_privs: {e}");
    }
    if let Err(e) = crate::seccomp::install(seccomp) {
        return e.to_string();
    }
    // Tell the shim we made it; the pipe closes on exec, so an exec failure is reported too.
    let _ = ready.flush();
    if let Err(e) = sys::keep_fds(&[(listener.as_raw_fd(), 3), (view.as_raw_fd(), 4)]) {
        return format!("hand the socket and the view to the agent: {e}");
    }
    let mut env: Vec<String> = [
        "LOCKER_AGENT_FD=3",
        "LOCKER_VIEW_FD=4",
        "LOCKER_CGROUP_ROOT=/sys/fs/cgroup",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME=/root",
    ]
    .map(String::from)
    .to_vec();
    // The agent pins every command to these (not itself: its own threads run where the
    // host has room).
    if let Some(cpus) = cpus {
        env.push(format!("LOCKER_CPUS={}", crate::view::cpu_list(cpus)));
    }
    let env: Vec<CString> = env
        .into_iter()
        .map(|s| CString::new(s).expect("no NUL in the agent's env"))
        .collect();
    let argv = [CString::new("locker-agent").expect("static")];
    // stdout and stderr go to the shim's log pipe, never to the shim's caller nor straight
    // into the host's machine.log (which nothing would bound).
    // SAFETY: dup2 of a pipe we own onto stdout and stderr of this single-threaded process.
    unsafe {
        libc::dup2(log.as_raw_fd(), 1);
        libc::dup2(log.as_raw_fd(), 2);
    }
    if let Ok(null) = fs::File::open("/dev/null") {
        // SAFETY: dup2 onto stdin.
        unsafe { libc::dup2(null.as_raw_fd(), 0) };
    }
    let e = sys::execveat(agent.as_raw_fd(), &argv, &env);
    format!("execute the agent: {e}")
}

/// Builds the machine's root and pivots into it. Returns the agent's write descriptor on
/// the machine's `/proc/meminfo` view (see [`crate::view`]).
fn machine_setup(
    spec: &JailSpec,
    cg: &MachineCgroup,
    cpus: Option<&[usize]>,
    userns: &OwnedFd,
) -> Result<OwnedFd, JailError> {
    let dir = &spec.dir;
    let base = spec.uid_base;
    // Enter the cgroup, then give the machine a cgroup namespace rooted there. On v2 the
    // namespace root must be the machine's own cgroup (not its `init` leaf): with the
    // usual `nsdelegate` mount option a process may only move processes inside its
    // namespace, and the agent moves each command into a sibling of `init`. So: enter the
    // machine's cgroup, unshare, step into `init`, and only then enable the controllers for
    // its children (v2 allows no process in a cgroup that delegates controllers).
    for (_, d) in cg.dirs() {
        fs::write(d.join("cgroup.procs"), "0").map_err(step("enter the cgroup"))?;
    }
    sys::unshare(libc::CLONE_NEWCGROUP).map_err(step("unshare the cgroup namespace"))?;
    if cg.layout().version == crate::cgroup::Version::V2 {
        for (_, d) in cg.dirs() {
            fs::write(d.join("init/cgroup.procs"), "0").map_err(step("enter the init cgroup"))?;
            fs::write(d.join("cgroup.subtree_control"), "+memory +pids +cpu")
                .map_err(step("delegate the controllers"))?;
        }
    }
    sys::make_mounts_private().map_err(step("make mounts private"))?;

    // Every overlay is mounted from paths relative to here: its options show in the
    // machine's mount table, and must name nothing of the host.
    std::env::set_current_dir(dir).map_err(step(format!("enter {}", dir.display())))?;

    // The disk (quota = its size) holds the machine's writable layer. It stores canonical
    // ids (root = 0) and reaches the overlay through an id-mapped mount, so a disk image
    // (a snapshot) can start a machine with any uid range.
    let disk = dir.join("disk");
    let mapped = dir.join("disk-mapped");
    let lower = dir.join("lower");
    let root = dir.join("root");
    for d in [&disk, &mapped, &lower, &root] {
        fs::create_dir_all(d).map_err(step(format!("create {}", d.display())))?;
    }
    let (dev, lo) = sys::loop_attach(&dir.join("disk.img"))
        .map_err(step("attach the disk to a loop device"))?;
    sys::mount(
        dev.to_str(),
        &disk,
        Some("ext4"),
        libc::MS_NODEV | libc::MS_NOSUID,
        None,
    )
    .map_err(step("mount the disk"))?;
    drop(lo);
    for d in [disk.join("upper"), disk.join("work")] {
        fs::create_dir_all(&d).map_err(step("create the writable layer"))?;
    }
    // Mount points a template may lack (a minimal root filesystem without /proc, /sys,
    // /dev or /tmp) are made in the writable layer here, on the raw disk, where ids are
    // canonical: through the overlay the host's root is not mapped and mkdir fails with
    // EOVERFLOW.
    for (p, mode) in [
        ("proc", 0o555),
        ("sys", 0o555),
        ("dev", 0o755),
        ("tmp", 0o1777),
    ] {
        let upper = disk.join("upper").join(p);
        if fs::symlink_metadata(spec.template_rootfs.join(p)).is_err()
            && fs::symlink_metadata(&upper).is_err()
        {
            fs::create_dir(&upper).map_err(step(format!("create the mount point /{p}")))?;
            fs::set_permissions(&upper, fs::Permissions::from_mode(mode))
                .map_err(step(format!("create the mount point /{p}")))?;
        }
    }
    sys::idmapped_bind(&disk, &mapped, userns.as_raw_fd(), false)
        .map_err(step("id-map the disk"))?;
    sys::idmapped_bind(&spec.template_rootfs, &lower, userns.as_raw_fd(), true)
        .map_err(step("id-map the template"))?;
    mount_overlay(
        Path::new("lower"),
        Path::new("disk-mapped/upper"),
        Path::new("disk-mapped/work"),
        &root,
        libc::MS_NODEV,
        "",
        base,
    )
    .map_err(step("mount the overlay root"))?;
    mount_overlays(spec, &root, userns)?;
    mount_binds(spec, &root, userns)?;

    let r = |p: &str| root.join(p);
    let mkdir = |p: &Path| fs::create_dir_all(p).map_err(step(format!("create {}", p.display())));
    let nodev = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mkdir(&r("proc"))?;
    sys::mount(Some("proc"), &r("proc"), Some("proc"), nodev, None).map_err(step("mount /proc"))?;
    for p in [
        "proc/keys",
        "proc/timer_list",
        "proc/kcore",
        "proc/sched_debug",
        "proc/sysrq-trigger",
    ] {
        if r(p).exists() {
            let _ = sys::bind(Path::new("/dev/null"), &r(p), libc::MS_RDONLY);
        }
    }
    mkdir(&r("sys"))?;
    sys::mount(
        Some("sysfs"),
        &r("sys"),
        Some("sysfs"),
        nodev | libc::MS_RDONLY,
        None,
    )
    .map_err(step("mount /sys"))?;
    sys::mount(
        Some("cgroup-root"),
        &r("sys/fs/cgroup"),
        Some("tmpfs"),
        nodev,
        Some("mode=755,size=64k"),
    )
    .map_err(step("mount /sys/fs/cgroup"))?;
    for (host, inside) in cg.binds() {
        mkdir(&root.join(&inside))?;
        sys::bind(&host, &root.join(&inside), 0)
            .map_err(step(format!("bind the cgroup {}", host.display())))?;
    }
    let view = crate::view::mount(dir, &root, cpus)?;
    // The host's loop devices name their backing files (every machine's disk image, every
    // volume's) in sysfs, and `mount` would show them: the machine sees no block device.
    if r("sys/devices/virtual/block").exists() {
        let _ = sys::mount(
            Some("none"),
            &r("sys/devices/virtual/block"),
            Some("tmpfs"),
            nodev | libc::MS_RDONLY,
            Some("size=4k"),
        );
    }
    if r("sys/firmware").exists() {
        let _ = sys::mount(
            Some("none"),
            &r("sys/firmware"),
            Some("tmpfs"),
            nodev | libc::MS_RDONLY,
            Some("size=4k"),
        );
    }

    mkdir(&r("dev"))?;
    sys::mount(
        Some("dev"),
        &r("dev"),
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=755,size=64k"),
    )
    .map_err(step("mount /dev"))?;
    for d in ["null", "zero", "full", "random", "urandom", "tty"] {
        let t = r("dev").join(d);
        fs::File::create(&t).map_err(step(format!("create /dev/{d}")))?;
        sys::bind(&Path::new("/dev").join(d), &t, 0).map_err(step(format!("bind /dev/{d}")))?;
    }
    mkdir(&r("dev/pts"))?;
    sys::mount(
        Some("devpts"),
        &r("dev/pts"),
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )
    .map_err(step("mount /dev/pts"))?;
    mkdir(&r("dev/shm"))?;
    let owned = format!("mode=1777,uid={base},gid={base}");
    // tmpfs pages are charged to the machine's memory and cannot be reclaimed (no swap):
    // together /tmp (half the memory) and /dev/shm (a quarter, at most 64 MiB) leave a
    // quarter for the processes, so filling them ends in ENOSPC, not in an OOM kill.
    let (tmp_mb, shm_mb) = tmpfs_sizes(spec.memory_mb);
    sys::mount(
        Some("shm"),
        &r("dev/shm"),
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&format!("{owned},size={shm_mb}m")),
    )
    .map_err(step("mount /dev/shm"))?;
    for (link, to) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(to, r("dev").join(link))
            .map_err(step(format!("link /dev/{link}")))?;
    }
    mkdir(&r("tmp"))?;
    sys::mount(
        Some("tmp"),
        &r("tmp"),
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&format!("{owned},size={tmp_mb}m")),
    )
    .map_err(step("mount /tmp"))?;

    sys::sethostname(&spec.hostname).map_err(step("set the hostname"))?;
    sys::loopback_up().map_err(step("bring up loopback"))?;

    // A mount namespace of its own, so pivoting does not move the shim's root.
    sys::unshare(libc::CLONE_NEWNS).map_err(step("unshare the mount namespace"))?;
    std::env::set_current_dir(&root).map_err(step("enter the root"))?;
    sys::pivot_to_cwd().map_err(step("pivot into the root"))?;
    Ok(view)
}

/// The sizes of `/tmp` and `/dev/shm` (MiB) of a machine with `memory_mb` of memory.
fn tmpfs_sizes(memory_mb: u64) -> (u64, u64) {
    ((memory_mb / 2).clamp(8, 1024), (memory_mb / 4).clamp(4, 64))
}

/// The machine-relative path of a mount target: absolute, not `/`, no `..`.
fn target_rel(target: &Path) -> Result<&Path, JailError> {
    let rel = target.strip_prefix("/").unwrap_or(target);
    if !target.is_absolute()
        || rel.as_os_str().is_empty()
        || rel
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(JailError::Init(format!(
            "bad mount target {}",
            target.display()
        )));
    }
    Ok(rel)
}

/// Binds `spec.binds` into the machine's root (see [`BindMount`]).
fn mount_binds(spec: &JailSpec, root: &Path, userns: &OwnedFd) -> Result<(), JailError> {
    for b in &spec.binds {
        let target = root.join(target_rel(&b.target)?);
        // Created as the machine's root, so the directory is root's inside.
        sys::with_fs_ids(spec.uid_base, || fs::create_dir_all(&target))
            .and_then(|r| r)
            .map_err(step(format!("create {}", b.target.display())))?;
        sys::idmapped_bind(&b.source, &target, userns.as_raw_fd(), b.read_only).map_err(step(
            format!("bind {} at {}", b.source.display(), b.target.display()),
        ))?;
    }
    Ok(())
}

/// Mounts `spec.mounts` in the machine's root (see [`OverlayMount`]). Runs in the
/// machine's directory: the layers are named relative to it.
fn mount_overlays(spec: &JailSpec, root: &Path, userns: &OwnedFd) -> Result<(), JailError> {
    for (i, m) in spec.mounts.iter().enumerate() {
        let (rel, rw, up, wk) = overlay_parts(m)?;
        let lower = PathBuf::from(format!("mnt{i}-lower"));
        let rw_at = PathBuf::from(format!("mnt{i}-rw"));
        for d in [&lower, &rw_at] {
            fs::create_dir_all(d).map_err(step(format!("create {}", d.display())))?;
        }
        sys::idmapped_bind(&m.lower, &lower, userns.as_raw_fd(), true)
            .map_err(step(format!("id-map {}", m.lower.display())))?;
        sys::idmapped_bind(rw, &rw_at, userns.as_raw_fd(), false)
            .map_err(step(format!("id-map {}", rw.display())))?;
        mount_overlay_at(
            &lower,
            &rw_at.join(up),
            &rw_at.join(wk),
            &root.join(rel),
            &m.target,
            spec.uid_base,
        )?;
    }
    Ok(())
}

/// Checks an overlay mount: its target relative to the machine's root, and the directory
/// holding `upper` and `work` with their names.
fn overlay_parts(
    m: &OverlayMount,
) -> Result<(&Path, &Path, &std::ffi::OsStr, &std::ffi::OsStr), JailError> {
    let rel = target_rel(&m.target)?;
    let (Some(rw), Some(up), Some(wk)) =
        (m.upper.parent(), m.upper.file_name(), m.work.file_name())
    else {
        return Err(JailError::Init("bad overlay upper/work".into()));
    };
    if m.work.parent() != Some(rw) {
        return Err(JailError::Init(
            "an overlay's upper and work must share their parent".into(),
        ));
    }
    Ok((rel, rw, up, wk))
}

/// Mounts the overlay `lower` + `upper` (+ `work`) at `target` with the machine's
/// filesystem ids (`base`), creating `target` as the machine's root.
fn mount_overlay_at(
    lower: &Path,
    upper: &Path,
    work: &Path,
    target: &Path,
    shown: &Path,
    base: u32,
) -> Result<(), JailError> {
    sys::with_fs_ids(base, || fs::create_dir_all(target))
        .and_then(|r| r)
        .map_err(step(format!("create {}", shown.display())))?;
    mount_overlay(
        lower,
        upper,
        work,
        target,
        libc::MS_NODEV | libc::MS_NOSUID,
        ",redirect_dir=off,index=off,metacopy=off",
        base,
    )
    .map_err(step(format!("mount the overlay at {}", shown.display())))
}

/// Mounts a run's overlay on the host side at `at` (canonical ids; the microVM file
/// server's private root, see [`crate::vm_fs`]) with the options a jail run's has, so its
/// upper layer reads the same.
pub(crate) fn mount_run_overlay(m: &OverlayMount, at: &Path) -> io::Result<()> {
    mount_overlay(
        &m.lower,
        &m.upper,
        &m.work,
        at,
        libc::MS_NODEV | libc::MS_NOSUID,
        ",redirect_dir=off,index=off,metacopy=off",
        0,
    )
}

/// The one place overlays are mounted: `lower` under `upper` (+ `work`) at `target`, with
/// the machine's filesystem ids (`base`: the id-mapped upper layer needs a mounter whose
/// ids it maps) and `extra` options appended.
fn mount_overlay(
    lower: &Path,
    upper: &Path,
    work: &Path,
    target: &Path,
    flags: libc::c_ulong,
    extra: &str,
    base: u32,
) -> io::Result<()> {
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}{extra}",
        lower.display(),
        upper.display(),
        work.display()
    );
    sys::with_fs_ids(base, || {
        sys::mount(Some("overlay"), target, Some("overlay"), flags, Some(&opts))
    })
    .and_then(|r| r)
}

/// What `locker __jail-attach` mounts into a running machine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttachSpec {
    pub agent_pid: i32,
    pub uid_base: u32,
    pub mount: OverlayMount,
}

/// Mounts an overlay into a running machine (a pooled machine a run claims). Runs as
/// `locker __jail-attach <json>`: `setns` into a mount namespace needs a single-threaded
/// process. The layers are id-mapped on the host side first, then the process enters the
/// machine's mount namespace, attaches them under a private staging directory of its
/// `/dev` (a tmpfs), mounts the overlay at the target, and detaches the staging mounts
/// (the overlay keeps its own references). Exits 0, or 1 with the reason on stderr.
pub fn attach_main(arg: &str) -> ! {
    let code = match serde_json::from_str::<AttachSpec>(arg)
        .map_err(|e| JailError::Init(format!("bad attach spec: {e}")))
        .and_then(|s| run_attach(&s))
    {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    };
    std::process::exit(code)
}

fn run_attach(a: &AttachSpec) -> Result<(), JailError> {
    let m = &a.mount;
    let (rel, rw, up, wk) = overlay_parts(m)?;
    let userns = fs::File::open(format!("/proc/{}/ns/user", a.agent_pid))
        .map_err(step("open the machine's user namespace"))?;
    let mntns = fs::File::open(format!("/proc/{}/ns/mnt", a.agent_pid))
        .map_err(step("open the machine's mount namespace"))?;
    let lower = sys::idmapped_tree(&m.lower, userns.as_raw_fd(), true)
        .map_err(step(format!("id-map {}", m.lower.display())))?;
    let rw_tree = sys::idmapped_tree(rw, userns.as_raw_fd(), false)
        .map_err(step(format!("id-map {}", rw.display())))?;
    sys::setns(mntns.as_raw_fd(), libc::CLONE_NEWNS)
        .map_err(step("enter the machine's mount namespace"))?;
    std::env::set_current_dir("/").map_err(step("enter the machine's root"))?;
    let stage = PathBuf::from(format!("/dev/.locker-attach-{}", std::process::id()));
    let (l, r) = (stage.join("l"), stage.join("rw"));
    for d in [&l, &r] {
        fs::create_dir_all(d).map_err(step(format!("create {}", d.display())))?;
    }
    let result = (|| {
        sys::attach_tree(&lower, &l).map_err(step("attach the lower layer"))?;
        sys::attach_tree(&rw_tree, &r).map_err(step("attach the upper layer"))?;
        mount_overlay_at(
            &l,
            &r.join(up),
            &r.join(wk),
            &Path::new("/").join(rel),
            &m.target,
            a.uid_base,
        )
    })();
    let _ = sys::umount(&l, libc::MNT_DETACH);
    let _ = sys::umount(&r, libc::MNT_DETACH);
    let _ = fs::remove_dir_all(&stage);
    result
}

/// Removes what a crash left: every machine directory under `machines_dir` whose id is
/// not in `keep`, killing any process still in its cgroup and removing the cgroup. Only
/// machines of this `machines_dir` are touched: other data dirs on the host keep theirs.
/// Returns the ids removed.
pub fn cleanup_orphans(machines_dir: &Path, keep: &[String], layout: &Layout) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(rd) = fs::read_dir(machines_dir) else {
        return removed;
    };
    for e in rd.flatten() {
        let id = e.file_name().to_string_lossy().into_owned();
        if keep.contains(&id) || !e.path().is_dir() {
            continue;
        }
        match destroy(&id, &e.path(), layout) {
            Ok(()) => removed.push(id),
            Err(err) => {
                tracing::warn!(machine = %id, error = %err, "could not clean up an orphaned machine")
            }
        }
    }
    removed
}
