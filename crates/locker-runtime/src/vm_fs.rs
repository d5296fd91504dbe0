//! Volumes in microVMs, the host's half: one file server per microVM with volumes.
//!
//! A microVM has no host directory it could bind: its guest kernel mounts each volume
//! through FUSE, and the guest's agent relays the FUSE requests over the VM's file port
//! (`fs.sock` on the host, see `locker_proto::fs_frame`). This room starts and describes
//! the process that answers them, `locker __vm-fs <spec>`:
//! - in the machine's cgroup, so stopping or destroying the machine kills it with QEMU,
//!   and outliving a server restart like QEMU does (adoption needs nothing);
//! - in a mount namespace of its own, holding only what it serves: a tmpfs with each
//!   volume bound at `/<channel>` (read-only mounts bound read-only), or a run's overlay
//!   (the view below, the run's layer above, exactly as a jail run mounts it, so the
//!   run's changes are read and committed the same way) mounted there;
//! - chrooted into that tmpfs, with no capabilities beyond those of file ownership, and
//!   `no_new_privs`; the FUSE server itself ([`crate::fuse`]) resolves every name
//!   beneath its export and opens nothing but regular files and directories.
//!
//! When the process ends its mount namespace goes with it: nothing is mounted on the host.
//!
//! **Moves.** The server answers its table (`crate::fuse::Table`: the nodes and open files
//! the guest's mounts hold) on a control socket, `fs-ctl.sock` in the machine's directory
//! (root's, mode 0600; [`table`] checks that root serves it, since the machine's uid owns
//! the directory). A microVM that moves takes that table along (its relay holds every
//! request meanwhile, see the agent's `share`), and the new host's server starts from it
//! ([`Spec::carried`]) before the guest runs: the guest's mounts go on as they were.
//! The guest side (mounting, relaying) is the agent's `share` module.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::AsyncBufReadExt;

use crate::machine::{BindMount, OverlayMount};
use crate::sys;

/// The file server's spec, written to `<dir>/vm-fs.json` too (a machine with shares).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Spec {
    /// The VM's file port (`<dir>/fs.sock`).
    pub socket: PathBuf,
    /// Where the server's private root is mounted (an empty directory of the machine).
    pub stage: PathBuf,
    /// Live trees, channels `0..binds.len()`.
    pub binds: Vec<BindMount>,
    /// Runs' overlays, the channels after the binds.
    pub overlays: Vec<OverlayMount>,
    /// The [`Carried`] file of a snapshot of the guest: the server starts with its table's
    /// nodes and handles (the guest mounted already: it moved, or is a snapshot's copy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carried: Option<PathBuf>,
}

/// One mount for the guest to make.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestMount {
    pub channel: u32,
    pub target: String,
    pub read_only: bool,
}

impl Spec {
    /// The mounts the guest makes, by channel.
    pub fn guest_mounts(&self) -> Vec<GuestMount> {
        let binds = self.binds.iter().map(|b| (&b.target, b.read_only));
        let overlays = self.overlays.iter().map(|o| (&o.target, false));
        binds
            .chain(overlays)
            .enumerate()
            .map(|(i, (t, ro))| GuestMount {
                channel: i as u32,
                target: t.display().to_string(),
                read_only: ro,
            })
            .collect()
    }
}

/// The spec's file in a machine's directory: present exactly when the machine has shares.
pub const SPEC_FILE: &str = "vm-fs.json";

/// The file server's control socket in a machine's directory.
pub const CONTROL_SOCKET: &str = "fs-ctl.sock";

/// What a guest's mounts are, taken for its snapshot (a move's, or its user's): where the
/// guest mounted each channel, and the file server's table. A machine restored from that
/// snapshot must serve the same mounts (the guest holds them), and its file server starts
/// from the table ([`Spec::carried`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Carried {
    pub mounts: Vec<GuestMount>,
    pub table: crate::fuse::Table,
}

impl Carried {
    /// The mounts and table of the file server of the machine in `dir`, read while the
    /// guest's relay holds its requests.
    pub fn take(dir: &Path) -> io::Result<Self> {
        let spec: Spec = serde_json::from_slice(&fs::read(dir.join(SPEC_FILE))?)
            .map_err(|e| io::Error::other(format!("{SPEC_FILE}: {e}")))?;
        Ok(Carried {
            mounts: spec.guest_mounts(),
            table: table(dir)?,
        })
    }

    /// The mounts a snapshot's carried file (`path`) names, if it is one; `Err` when it
    /// cannot be read.
    pub fn mounts_in(path: &Path) -> io::Result<Option<Vec<GuestMount>>> {
        match fs::read(path) {
            Ok(b) => serde_json::from_slice::<Carried>(&b)
                .map(|c| Some(c.mounts))
                .map_err(|e| io::Error::other(format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// The table of the file server of the machine in `dir`, read while the guest's relay holds
/// its requests. Refuses a socket root does not serve.
fn table(dir: &Path) -> io::Result<crate::fuse::Table> {
    let mut conn = UnixStream::connect(dir.join(CONTROL_SOCKET))?;
    if locker_sys::fd::peer_uid(std::os::fd::AsRawFd::as_raw_fd(&conn))? != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the file server's control socket is not served by root",
        ));
    }
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    conn.write_all(b"table\n")?;
    serde_json::from_reader(io::BufReader::new(conn))
        .map_err(|e| io::Error::other(format!("the file server's table: {e}")))
}

/// Whether the machine in `dir` has volumes served to it.
pub fn has_shares(dir: &Path) -> bool {
    dir.join(SPEC_FILE).exists()
}

/// Starts the file server of the machine in `dir` (its QEMU runs) as `exe __vm-fs` in the
/// cgroup whose `cgroup.procs` files are `procs`, and waits until it serves.
pub async fn start(exe: &Path, dir: &Path, spec: &Spec, procs: &[PathBuf]) -> io::Result<()> {
    let json = serde_json::to_string(spec).expect("spec serializes");
    fs::create_dir_all(&spec.stage)?;
    fs::write(dir.join(SPEC_FILE), &json)?;
    let log = fs::File::create(dir.join("vm-fs.log"))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("__vm-fs")
        .arg(&json)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log);
    let procs = crate::cgroup::c_paths(procs);
    // SAFETY: only async-signal-safe calls (open, write, close) on memory prepared before
    // the fork.
    unsafe {
        cmd.pre_exec(move || {
            for p in &procs {
                crate::cgroup::enter_cgroup(p)?;
            }
            Ok(())
        });
    }
    let mut child = tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn()?;
    let out = child.stdout.take().expect("piped");
    let mut line = String::new();
    let mut out = tokio::io::BufReader::new(out);
    match tokio::time::timeout(Duration::from_secs(20), out.read_line(&mut line)).await {
        Ok(r) => drop(r?),
        Err(_) => line.clear(),
    }
    if line.trim() != "ready" {
        let _ = child.start_kill();
        let _ = child.wait().await;
        let mut why = String::new();
        let _ = fs::File::open(dir.join("vm-fs.log")).and_then(|mut f| f.read_to_string(&mut why));
        return Err(io::Error::other(format!(
            "the file server failed: {}",
            why.trim()
        )));
    }
    // Reaped when it ends (with the machine); a server restart leaves it to run on.
    let dir = dir.to_owned();
    tokio::spawn(async move {
        match child.wait().await {
            Ok(st) if st.success() => {}
            // Killed with its machine (stop, destroy) or ended with an error: its log says.
            st => {
                tracing::info!(dir = %dir.display(), status = ?st, "a microVM's file server ended")
            }
        }
    });
    Ok(())
}

/// `locker __vm-fs <spec>`: in new mount and pid namespaces, sets up the private root,
/// says `ready` on stdout, serves until the VM's end of the port goes away. Exits 0, or 1
/// with the reason on stderr.
///
/// The server is PID 1 of its own pid namespace, so the `proc` it opens `/proc/self/fd`
/// in (mounted `subset=pid`) holds nothing but itself: no other process, no `/proc/sys`.
pub fn main(arg: &str) -> ! {
    let r = serde_json::from_str::<Spec>(arg)
        .map_err(|e| io::Error::other(format!("bad spec: {e}")))
        .and_then(|s| {
            sys::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWPID)
                .map_err(ctx("unshare the mount and pid namespaces"))?;
            // SAFETY: this process is single-threaded here, so the child may run on after
            // the fork.
            match unsafe { sys::fork() }.map_err(ctx("fork"))? {
                0 => serve_main(&s),
                child => std::process::exit(wait_exit(child)),
            }
        });
    match r {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("locker __vm-fs: {e}");
            std::process::exit(1)
        }
    }
}

/// The exit code of `pid` (128 + the signal that killed it).
fn wait_exit(pid: libc::pid_t) -> i32 {
    let Ok(status) = sys::waitpid(pid) else {
        return 1;
    };
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    }
}

/// PID 1 of the new namespace: sets up, says `ready`, serves.
fn serve_main(s: &Spec) -> io::Result<()> {
    let (conn, server, control) = prepare(s)?;
    let reader = server.table_reader();
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || answer_tables(&control, &reader))?;
    let mut out = io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    // The pipe the parent waits on is closed for good; fd 1 goes to the log (stderr), so
    // no file the server opens later takes its number.
    let _ = locker_sys::proc::dup2(2, 1);
    server.run(conn)
}

/// Answers every connection of the control socket with the server's table.
fn answer_tables(control: &std::os::unix::net::UnixListener, reader: &crate::fuse::TableReader) {
    for conn in control.incoming() {
        let Ok(mut conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
        let mut ask = [0u8; 6];
        if conn.read_exact(&mut ask).is_err() || &ask != b"table\n" {
            continue;
        }
        match reader.table() {
            Ok(t) => {
                let _ = serde_json::to_writer(&mut conn, &t);
            }
            Err(e) => eprintln!("locker __vm-fs: reading the table: {e}"),
        }
    }
}

/// Raises this process's open files limit to `want`, or as far as the hard limit goes when
/// raising that is not allowed.
fn raise_fd_limit(want: u64) -> io::Result<()> {
    use locker_sys::proc::{nofile_limit, set_nofile_limit};
    let (soft, hard) = nofile_limit()?;
    if set_nofile_limit(want.max(soft), want.max(hard)).is_ok() {
        return Ok(());
    }
    set_nofile_limit(hard, hard)
}

fn ctx(what: impl std::fmt::Display) -> impl FnOnce(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Files the server may hold open: every node the guest's kernel remembers (until it
/// forgets it) and every open file is one host fd (at most the kernel's `nr_open`).
const MAX_FDS: u64 = 1 << 17;

/// The private root with every share in it, the connected port, the server with its
/// exports open (and a carried table taken in), and the control socket.
fn prepare(
    s: &Spec,
) -> io::Result<(
    UnixStream,
    crate::fuse::Server,
    std::os::unix::net::UnixListener,
)> {
    let nr_open = fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(MAX_FDS);
    sys::make_mounts_private().map_err(ctx("make mounts private"))?;
    let stage = &s.stage;
    let nosuid = libc::MS_NOSUID | libc::MS_NODEV;
    sys::mount(
        Some("locker-vm-fs"),
        stage,
        Some("tmpfs"),
        nosuid | libc::MS_NOEXEC,
        Some("mode=0755,size=1m"),
    )
    .map_err(ctx("mount the private root"))?;
    let mut exports = Vec::new();
    for m in s.guest_mounts() {
        let at = stage.join(m.channel.to_string());
        fs::create_dir(&at).map_err(ctx(format!("create {}", at.display())))?;
        exports.push(crate::fuse::Export {
            channel: m.channel,
            root: Path::new("/").join(m.channel.to_string()),
            read_only: m.read_only,
        });
    }
    for (i, b) in s.binds.iter().enumerate() {
        let at = stage.join(i.to_string());
        let ro = if b.read_only { libc::MS_RDONLY } else { 0 };
        sys::bind(&b.source, &at, nosuid | ro)
            .map_err(ctx(format!("bind {}", b.source.display())))?;
    }
    for (i, o) in s.overlays.iter().enumerate() {
        let at = stage.join((s.binds.len() + i).to_string());
        crate::machine::mounts::mount_run_overlay(o, &at)
            .map_err(ctx(format!("mount the overlay of {}", o.lower.display())))?;
    }
    let carried = match &s.carried {
        Some(p) => Some(
            fs::read(p)
                .and_then(|b| {
                    serde_json::from_slice::<Carried>(&b)
                        .map(|c| c.table)
                        .map_err(io::Error::other)
                })
                .map_err(ctx(format!("read the carried table {}", p.display())))?,
        ),
        None => None,
    };
    let control_at = s.socket.with_file_name(CONTROL_SOCKET);
    let _ = fs::remove_file(&control_at);
    let control = std::os::unix::net::UnixListener::bind(&control_at)
        .map_err(ctx(format!("bind {}", control_at.display())))?;
    fs::set_permissions(
        &control_at,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .map_err(ctx("chmod the control socket"))?;
    let conn = UnixStream::connect(&s.socket)
        .map_err(ctx(format!("connect to {}", s.socket.display())))?;
    // The server reopens files through /proc/self/fd: a proc of this pid namespace,
    // showing processes only (this one).
    let proc_at = stage.join("proc");
    fs::create_dir(&proc_at).map_err(ctx("create proc"))?;
    sys::mount(
        Some("proc"),
        &proc_at,
        Some("proc"),
        nosuid | libc::MS_NOEXEC,
        Some("subset=pid,hidepid=invisible"),
    )
    .map_err(ctx("mount proc"))?;
    std::env::set_current_dir(stage).map_err(ctx("enter the private root"))?;
    locker_sys::mount::chroot_cwd().map_err(ctx("chroot"))?;
    std::env::set_current_dir("/").map_err(ctx("enter the private root"))?;
    let server = match &carried {
        None => crate::fuse::Server::open(&exports).map_err(ctx("open the exports"))?,
        Some(t) => {
            let (server, r) =
                crate::fuse::Server::open_carried(&exports, t).map_err(ctx("open the exports"))?;
            eprintln!(
                "locker __vm-fs: took a carried table in: {} nodes and {} open files back, {} nodes and {} open files lost (unnamed, or gone)",
                r.nodes, r.handles, r.lost_nodes, r.lost_handles
            );
            server
        }
    };
    // The server holds `/proc/self/fd` open: the path itself goes.
    sys::umount(Path::new("/proc"), libc::MNT_DETACH).map_err(ctx("unmount /proc"))?;
    fs::remove_dir("/proc").map_err(ctx("remove /proc"))?;
    raise_fd_limit(MAX_FDS.min(nr_open)).map_err(ctx("raise the open files limit"))?;
    // What serving files as their owners needs, and nothing else.
    // CAP_CHOWN 0, CAP_DAC_OVERRIDE 1, CAP_FOWNER 3, CAP_FSETID 4 (linux/capability.h).
    // Not CAP_DAC_READ_SEARCH: it opens files by handle, outside any root.
    sys::restrict_capabilities(&[0, 1, 3, 4]).map_err(ctx("drop capabilities"))?;
    locker_sys::proc::set_no_new_privs().map_err(ctx("no_new_privs"))?;
    Ok((conn, server, control))
}
