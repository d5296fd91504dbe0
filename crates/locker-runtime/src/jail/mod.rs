//! The jail runtime: a machine made of Linux namespaces on the host's kernel.
//!
//! Owns starting and finding jailed machines: [`spec`] (what the shim is told), [`shim`]
//! (the `__jail-init` process and PID 1 up to the agent), [`setup`] (PID 1's root, in
//! named steps), [`attach`] (an overlay mounted into a running jail). It does not own
//! tearing machines down (see [`crate::machine`], shared with the microVM), the agent's
//! protocol (see [`crate::agent`]) nor the template store (see [`crate::template`]).
//!
//! # How a jail starts
//! The caller (the server, in a multi-threaded process) never forks into namespaces itself:
//! it runs `locker-jail __jail-init <dir>/jail.json` (`locker` itself where no
//! `locker-jail` of the same build is found: see `node::config::find_shim`), a fresh
//! single-threaded process (the *shim*) that:
//! 1. binds the agent's listening socket at `<dir>/agent.sock` (host side only);
//! 2. creates the machine's user namespace (root inside = host uid `uid_base`, 65536 ids)
//!    with a throwaway child, and keeps a handle to it;
//! 3. creates the machine's cgroup with its limits, delegated to the machine's root;
//! 4. formats the machine's disk, a sparse ext4 image of `disk_mb` (the disk quota), unless
//!    its writable layer is to be in memory (a run's: [`crate::machine::Scratch::Memory`],
//!    a tmpfs PID 1 mounts instead), and links the layer images of the snapshot it starts
//!    from into `<dir>/layers/`;
//! 5. unshares mount, net, ipc, uts and pid namespaces and forks the machine's PID 1, which
//!    enters the cgroup and a cgroup namespace, mounts the disk and an overlay root
//!    (the template below through an id-mapped read-only mount, a snapshot's layers above
//!    it, each a read-only loop device and mount, the machine's layer on top),
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

/// Whether this host's kernel can give a jail its writable layer in memory
/// ([`crate::machine::Scratch::Memory`]): the layer reaches the machine through an id-mapped
/// mount, which tmpfs allows from Linux 6.3. Read once.
pub fn memory_scratch() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .is_ok_and(|r| crate::doctor::kernel_at_least(r.trim(), 6, 3))
    })
}

/// The build of the shim's code (a hash of its sources; see `build.rs`): `locker-jail
/// --build-id` prints it, and a node runs that binary only if it matches its own.
pub const SHIM_BUILD: &str = env!("LOCKER_SHIM_BUILD");

mod attach;
mod setup;
mod shim;
mod spec;

pub use attach::attach;
pub use shim::init_main;
pub use spec::{AttachSpec, JailSpec};

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::machine::{cmdline, is_running};

/// How much of the agent's output `machine.log` keeps from the start.
pub const LOG_HEAD: u64 = 1 << 20;

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
    #[error(transparent)]
    Mount(#[from] crate::machine::mounts::MountError),
}

fn step(s: impl Into<String>) -> impl FnOnce(io::Error) -> JailError {
    let s = s.into();
    move |source| JailError::Io { step: s, source }
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

/// Starts a machine: runs the shim (`shim_exe __jail-init`) and waits until the agent's
/// socket exists. Returns the state and the shim's process (the caller reaps it).
pub async fn start(
    spec: &JailSpec,
    shim_exe: &Path,
) -> Result<(JailState, tokio::process::Child), JailError> {
    fs::create_dir_all(&spec.dir).map_err(step(format!("create {}", spec.dir.display())))?;
    let spec_path = spec.dir.join("jail.json");
    fs::write(
        &spec_path,
        serde_json::to_vec(spec).expect("spec serializes"),
    )
    .map_err(step("write jail.json"))?;
    let log = fs::File::create(spec.dir.join("machine.log")).map_err(step("create machine.log"))?;
    let mut cmd = tokio::process::Command::new(shim_exe);
    cmd.arg("__jail-init")
        .arg(&spec_path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(log);
    // The shim gets its own session: a Ctrl-C at the server's terminal must not kill machines.
    cmd.process_group(0);
    let mut child = cmd
        .spawn()
        .map_err(step(format!("run {} __jail-init", shim_exe.display())))?;
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

/// Whether `pid` is a live (not zombie) process inside the machine cgroup `name`.
pub(crate) fn owns_pid(pid: i32, name: &str) -> bool {
    let cg = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    cg.lines().any(|l| {
        l.ends_with(&format!("/{}/{name}", crate::cgroup::PARENT))
            || l.contains(&format!("/{}/{name}/", crate::cgroup::PARENT))
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

/// Whether a machine found on disk is still alive (its shim and agent run).
pub fn is_alive(state: &JailState) -> bool {
    // The cgroup's name as this build makes it, or the bare id of an earlier release's.
    is_shim(state.shim_pid, &state.dir)
        && (owns_pid(
            state.agent_pid,
            &crate::cgroup::machine_name(&state.id, &state.dir),
        ) || owns_pid(state.agent_pid, &state.id))
}
