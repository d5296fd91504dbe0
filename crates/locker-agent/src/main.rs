//! `locker-agent`: PID 1 of every Locker machine.
//!
//! It serves the host over `locker-proto` (one unix stream socket, many connections, many
//! multiplexed streams per connection) and does, inside the machine, what the host asks:
//! run commands (`exec`), keep background processes (`procs`), move files (`files`), report
//! usage. It reaps every orphan (`reaper`), gives every command its own cgroup so its whole
//! tree can be killed (`cgroup`), and never holds a whole file or output stream in memory
//! (`capture`). In a jail it pins every command to the machine's CPUs and keeps the
//! machine's `/proc/meminfo` view (`view`). Raw system calls live in `sys`.
//!
//! Start-up:
//! - `LOCKER_VM=1` as PID 1: a microVM's init (see `vm`): it builds the root filesystem,
//!   then serves the host over a virtio-serial port instead of a socket.
//! - `LOCKER_AGENT_FD=<n>`: fd `n` is an already-listening unix stream socket (the machine's
//!   init hands it over); else `--listen PATH` binds one (tests, debugging).
//! - `LOCKER_AGENT_ROOT` (default `/`): the directory the files API resolves paths in.
//! - `LOCKER_OUTPUT_DIR` (default `/var/tmp/locker`): spill and spool files of output.
//! - `LOCKER_MAX_SPILL_BYTES` (default 1 GiB): per stream; past it the command is killed.
//! - `LOCKER_CGROUP_ROOT` (default `/sys/fs/cgroup`), `LOCKER_CGROUP_PARENT` (default empty):
//!   where command cgroups are created (see `cgroup`).
//! - `LOCKER_VIEW_FD=<n>` (jails): fd `n` writes the machine's `/proc/meminfo` (see `view`).
//! - `LOCKER_CPUS=<list>` (jails): every command is pinned to these CPUs (see `view`).
//!
//! It only depends on `locker-types`, `locker-proto`, serde and libc, and builds as a static
//! binary (it reads `/etc/passwd` itself instead of using NSS).

mod archive;
mod capture;
mod cgroup;
mod conn;
mod exec;
mod files;
mod jobs;
mod ports;
mod procs;
mod reaper;
mod share;
mod spills;
mod sys;
mod users;
mod view;
mod vm;
mod watch;

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

/// Everything the agent's rooms share.
pub struct Agent {
    pub reaper: reaper::Reaper,
    pub cgroups: cgroup::Cgroups,
    /// The files API's root directory (`O_PATH`).
    pub root: OwnedFd,
    pub output_dir: PathBuf,
    pub max_spill_bytes: u64,
    pub procs: procs::Procs,
    /// What ended commands left running.
    pub jobs: jobs::Jobs,
    /// Tunnels to ports open now (bounded).
    pub tunnels: std::sync::atomic::AtomicUsize,
    /// Whether commands reset their `oom_score_adj` to 0 (the agent's own is not 0: a
    /// jail's agent is exempt from the OOM killer).
    pub reset_oom: bool,
    /// The machine's `/proc/meminfo` view (jails only).
    pub view: Option<Arc<view::View>>,
    /// The CPUs every command is pinned to (jails smaller than the host only).
    pub cpus: Option<sys::CpuSet>,
}

/// A fresh id with the given prefix: 16 random hex digits.
pub fn random_id(prefix: &str) -> String {
    locker_sys::random::new_id(prefix, 8)
}

fn usage() -> ! {
    eprintln!("usage: locker-agent [--listen PATH]   (or LOCKER_AGENT_FD=<listening socket fd>)");
    std::process::exit(2);
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_string())
}

fn main() {
    // First: from here on no command of the machine can trace this process or open its
    // /proc files (memory, descriptors). In a microVM the guest's root owns the agent by
    // design; it is harmless there.
    if let Err(e) = sys::set_non_dumpable() {
        eprintln!("locker-agent: cannot make itself non-dumpable: {e}");
        std::process::exit(1);
    }
    sys::cloexec_inherited();
    let in_vm = vm::is_vm_init();
    if in_vm {
        if let Err(e) = vm::init() {
            eprintln!("locker-agent: microVM init failed: {e}");
            vm::power_off();
        }
    }
    let mut listen: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--listen" => listen = Some(args.next().map(PathBuf::from).unwrap_or_else(|| usage())),
            "--version" => {
                println!("locker-agent {}", env!("CARGO_PKG_VERSION"));
                return;
            }
            _ => usage(),
        }
    }
    let listener = if in_vm {
        None
    } else {
        Some(bind_listener(listen))
    };
    if let Err(e) = sys::set_child_subreaper() {
        eprintln!("locker-agent: cannot become a child subreaper: {e}");
    }
    let reaper = match reaper::Reaper::start() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("locker-agent: cannot start the reaper: {e}");
            std::process::exit(1);
        }
    };
    let root_path = env_or("LOCKER_AGENT_ROOT", "/");
    let root = match std::fs::File::open(&root_path) {
        Ok(f) if f.metadata().map(|m| m.is_dir()).unwrap_or(false) => OwnedFd::from(f),
        _ => {
            eprintln!("locker-agent: LOCKER_AGENT_ROOT={root_path} is not a directory");
            std::process::exit(1);
        }
    };
    let cgroups = cgroup::Cgroups::detect(
        std::path::Path::new(&env_or("LOCKER_CGROUP_ROOT", "/sys/fs/cgroup")),
        &std::env::var("LOCKER_CGROUP_PARENT").unwrap_or_default(),
        !in_vm,
    );
    let max_spill_bytes = env_or("LOCKER_MAX_SPILL_BYTES", "1073741824")
        .parse()
        .unwrap_or(1 << 30);
    let agent = Arc::new(Agent {
        reaper,
        cgroups,
        root,
        output_dir: PathBuf::from(env_or("LOCKER_OUTPUT_DIR", "/var/tmp/locker")),
        max_spill_bytes,
        procs: procs::Procs::default(),
        jobs: jobs::Jobs::default(),
        tunnels: std::sync::atomic::AtomicUsize::new(0),
        reset_oom: sys::oom_score_adj() != 0,
        view: if in_vm { None } else { view::View::from_env() },
        cpus: if in_vm { None } else { view::cpus_from_env() },
    });
    {
        // One command cgroup made ahead, off the first command's path (a warm machine's
        // first command is a run's only one).
        let a = agent.clone();
        let spawned = std::thread::Builder::new()
            .name("cgroup".into())
            .stack_size(64 * 1024)
            .spawn(move || a.cgroups.prepare());
        if let Err(e) = spawned {
            eprintln!("locker-agent: cannot start the cgroup thread: {e}");
        }
    }
    if let Some(v) = &agent.view {
        // Before the first call is served: no command ever reads an empty file.
        v.refresh(&agent);
        let a = agent.clone();
        let spawned = std::thread::Builder::new()
            .name("view".into())
            .stack_size(128 * 1024)
            .spawn(move || view::serve(a));
        if let Err(e) = spawned {
            eprintln!("locker-agent: cannot start the view's refresher: {e}");
        }
    }
    let Some(listener) = listener else {
        vm::serve_port(agent);
    };
    loop {
        match listener.accept() {
            Ok((sock, _)) => {
                let agent = agent.clone();
                let sock = std::fs::File::from(OwnedFd::from(sock));
                let spawned = std::thread::Builder::new()
                    .name("conn".into())
                    .stack_size(512 * 1024)
                    .spawn(move || conn::serve(agent, sock));
                if let Err(e) = spawned {
                    eprintln!("locker-agent: cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                eprintln!("locker-agent: accept failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }
}

/// The socket to accept host connections on: `LOCKER_AGENT_FD` or `--listen PATH`.
fn bind_listener(listen: Option<PathBuf>) -> UnixListener {
    match std::env::var("LOCKER_AGENT_FD")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    {
        Some(fd) => {
            if let Err(e) = sys::set_cloexec(fd) {
                eprintln!("locker-agent: LOCKER_AGENT_FD={fd} is not usable: {e}");
                std::process::exit(1);
            }
            // SAFETY: the fd was handed to us for exactly this purpose and nothing else owns it.
            unsafe { UnixListener::from_raw_fd(fd) }
        }
        None => {
            let Some(path) = listen else { usage() };
            let _ = std::fs::remove_file(&path);
            match UnixListener::bind(&path) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("locker-agent: cannot listen on {}: {e}", path.display());
                    std::process::exit(1);
                }
            }
        }
    }
}
