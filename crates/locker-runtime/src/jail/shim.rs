//! The shim, `locker __jail-init <dir>/jail.json`: a fresh single-threaded process that
//! makes a jail's user namespace, cgroup and disk, forks its PID 1, and copies the agent's
//! log. PID 1 builds its root ([`super::setup`]), drops its privileges and executes the
//! agent. Nothing here runs in the server's process.

use std::ffi::CString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use super::setup::machine_setup;
use super::spec::JailSpec;
use super::{step, JailError, LOG_HEAD};
use crate::cgroup::{Layout, Limits, MachineCgroup};
use crate::machine::{blank_disks_dir, slots::UID_RANGE, Scratch};
use crate::sys;

/// How much of the agent's last output past [`LOG_HEAD`] is kept (in the shim's memory)
/// and written when the machine stops.
const LOG_TAIL: usize = 64 << 10;

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
    let cg = MachineCgroup::new(layout, &spec.id, &spec.dir);
    let limits = Limits {
        cpus: spec.cpus,
        memory_bytes: spec.memory_mb << 20,
        pids: spec.pids,
    };
    cg.create(limits, spec.uid_base)?;
    // Where the machine runs: its count is what `nproc` and `os.cpu_count()` will say.
    let cpus = crate::view::pick_cpus(spec.cpus);

    // 4. The disk: a fresh image; a snapshot's layers are linked beside it (read-only).
    // Filled by PID 1 once attached (see `disk::place_blank`), unless a reflink made it
    // whole. A machine whose layer is in memory has no image.
    let fill = match spec.scratch {
        Scratch::Disk => {
            crate::disk::place_blank(&dir.join("disk.img"), spec.disk_mb, &blank_disks_dir())
                .map_err(step("make the disk image"))?
        }
        Scratch::Memory => None,
    };
    crate::disk::link_stack(&spec.layers, &dir.join(crate::disk::MACHINE_LAYERS), 0)
        .map_err(step("link the snapshot's layers"))?;
    let seccomp = crate::seccomp::programs().map_err(|e| JailError::Init(e.to_string()))?;
    let agent = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&spec.agent_path)
        .map_err(step(format!(
            "open the agent {}",
            spec.agent_path.display()
        )))?;

    // 5. The namespaces and PID 1. The pid namespace is PID 1's own (see `start_pid1`):
    // the others are the shim's too, so the shim sees the machine's mounts (its layer is
    // read through `/proc/<shim>/root`).
    sys::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS)
        .map_err(step("unshare namespaces"))?;
    let (ready_r, ready_w) = sys::pipe().map_err(step("pipe"))?;
    let (log_r, log_w) = sys::pipe().map_err(step("pipe"))?;
    // What PID 1 keeps or closes; each side takes its own (the closure runs in PID 1 only).
    let (mut ready_r, mut ready_w) = (Some(ready_r), Some(ready_w));
    let (mut log_r, mut log_w) = (Some(log_r), Some(log_w));
    let mut listener = Some(listener);
    let mut agent = Some(agent);
    // SAFETY: the shim is single-threaded (no runtime, no threads were started).
    let pid = unsafe {
        start_pid1(&cg, |entered| {
            drop(ready_r.take());
            drop(log_r.take());
            let mut w = fs::File::from(ready_w.take().expect("once"));
            let handed = Handed {
                listener: listener.take().expect("once"),
                agent: agent.take().expect("once"),
                log: log_w.take().expect("once"),
            };
            let err = machine_init(
                &spec,
                &cg,
                entered,
                fill.as_ref(),
                cpus.as_deref(),
                userns,
                handed,
                &seccomp,
                &mut w,
            );
            let _ = writeln!(w, "{err}");
        })
    }?;
    drop(ready_w);
    // The log pipe must have no writer but the agent, or its end would never be seen.
    drop(log_w);
    drop(listener);
    drop(agent);
    let mut report = String::new();
    let _ = fs::File::from(ready_r.take().expect("the shim's")).read_to_string(&mut report);
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
        let _ = locker_sys::proc::dup2(null.as_raw_fd(), 1);
    }
    copy_log(log_r.take().expect("the shim's"));
    let status = sys::waitpid(pid).map_err(step("wait for the machine"))?;
    Ok(if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    })
}

/// How PID 1 got into the machine's cgroup (see [`start_pid1`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Entered {
    /// Cloned into `init` by a helper standing in the machine's cgroup (cgroup v2): no
    /// move, and its cgroup namespace is rooted at the machine's cgroup already. The
    /// controllers for the machine's children are still to be enabled, once the helper
    /// has left the machine's cgroup.
    Cloned,
    /// Forked beside the shim: it moves itself in and makes its cgroup namespace (v1, or
    /// a kernel that refused the clone).
    Forked,
}

/// Starts the machine's PID 1, in a new pid namespace, runs `pid1` in it, and returns its
/// pid (in the shim's namespace; it is the shim's child either way).
///
/// On cgroup v2 PID 1 is born where it lives, in the machine's `init` leaf, with a cgroup
/// namespace rooted at the machine's cgroup (the commands' cgroups are siblings of
/// `init`): a helper is cloned into the machine's cgroup with a new cgroup namespace
/// (`CLONE_INTO_CGROUP | CLONE_NEWCGROUP`: the namespace is rooted where the child is
/// born), and clones PID 1 into `init` with `CLONE_NEWPID | CLONE_PARENT` (PID 1 keeps the
/// helper's cgroup namespace, and the shim is its parent), tells the shim its pid and
/// exits. Nothing is moved between cgroups, so no create waits on the kernel's
/// `cgroup_threadgroup_rwsem` (an RCU grace period after a quiet spell, unless the host
/// favours dynamic moves). On v1, or where the clone fails (kernels before 5.7), PID 1 is
/// forked and moves itself (see [`Entered::Forked`]); the fall-back is noted in
/// `machine.log`.
///
/// # Safety
/// The caller is single-threaded. `pid1` runs in the child; when it returns (it failed),
/// the child exits with status 1 without running the parent's destructors.
unsafe fn start_pid1(cg: &MachineCgroup, pid1: impl FnOnce(Entered)) -> Result<i32, JailError> {
    let mut pid1 = Some(pid1);
    if cg.layout().version == crate::cgroup::Version::V2 {
        // SAFETY: single-threaded, upheld by the caller.
        match unsafe { clone_in_place(cg) } {
            Ok(Some(pid)) => return Ok(pid),
            Ok(None) => {
                (pid1.take().expect("once"))(Entered::Cloned);
                locker_sys::proc::exit_now(1)
            }
            Err(e) => eprintln!(
                "locker jail init: PID 1 could not be cloned into its cgroup ({e}); it moves there instead"
            ),
        }
    }
    sys::unshare(libc::CLONE_NEWPID).map_err(step("unshare the pid namespace"))?;
    // SAFETY: single-threaded, upheld by the caller.
    let pid = unsafe { sys::fork() }.map_err(step("fork the machine's PID 1"))?;
    if pid == 0 {
        (pid1.take().expect("once"))(Entered::Forked);
        locker_sys::proc::exit_now(1)
    }
    Ok(pid)
}

/// The v2 half of [`start_pid1`]: `Ok(Some(pid))` in the shim, `Ok(None)` in PID 1, an
/// error (in the shim) when the helper or PID 1 could not be cloned.
///
/// # Safety
/// The caller is single-threaded.
unsafe fn clone_in_place(cg: &MachineCgroup) -> io::Result<Option<i32>> {
    let open_dir = |p: &Path| {
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(p)
    };
    let (_, machine) = cg
        .dirs()
        .into_iter()
        .next()
        .ok_or(io::ErrorKind::NotFound)?;
    let machine_fd = open_dir(&machine)?;
    let init_fd = open_dir(&machine.join("init"))?;
    let (pid_r, pid_w) = sys::pipe()?;
    // SAFETY: single-threaded (upheld by the caller): the helper owns a consistent copy.
    let helper =
        unsafe { sys::clone_into_cgroup(machine_fd.as_raw_fd(), libc::CLONE_NEWCGROUP as u64) }?;
    if helper == 0 {
        drop(pid_r);
        let flags = (libc::CLONE_NEWPID | libc::CLONE_PARENT) as u64;
        // SAFETY: the helper is single-threaded; PID 1 goes on as the shim's fork would.
        let said = match unsafe { sys::clone_into_cgroup(init_fd.as_raw_fd(), flags) } {
            Ok(0) => return Ok(None),
            Ok(pid) => pid,
            Err(e) => -e.raw_os_error().unwrap_or(libc::EINVAL),
        };
        let _ = fs::File::from(pid_w).write_all(&said.to_ne_bytes());
        locker_sys::proc::exit_now(0);
    }
    drop(pid_w);
    let mut said = [0u8; 4];
    let got = fs::File::from(pid_r).read_exact(&mut said);
    let _ = sys::waitpid(helper);
    got?;
    match i32::from_ne_bytes(said) {
        pid if pid > 0 => Ok(Some(pid)),
        errno => Err(io::Error::from_raw_os_error(-errno)),
    }
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
        // Leaving the child without running destructors.
        locker_sys::proc::exit_now(0);
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
#[allow(clippy::too_many_arguments)]
fn machine_init(
    spec: &JailSpec,
    cg: &MachineCgroup,
    entered: Entered,
    fill: Option<&crate::disk::Fill>,
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
    let view = match machine_setup(spec, cg, entered, fill, cpus, &userns) {
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
    if let Err(e) = locker_sys::proc::become_root() {
        return format!("become root of the machine: {e}");
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
    let _ = locker_sys::proc::dup2(log.as_raw_fd(), 1);
    let _ = locker_sys::proc::dup2(log.as_raw_fd(), 2);
    if let Ok(null) = fs::File::open("/dev/null") {
        let _ = locker_sys::proc::dup2(null.as_raw_fd(), 0);
    }
    let e = sys::execveat(agent.as_raw_fd(), &argv, &env);
    format!("execute the agent: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::{Layout, Version};

    /// Reads `path` into `buf` with raw calls only (the child of a fork in the test
    /// harness's multi-threaded process may not allocate). Returns the length read.
    fn raw_read(path: &std::ffi::CStr, buf: &mut [u8]) -> usize {
        // SAFETY: plain syscalls on a NUL-terminated path and a live buffer.
        unsafe {
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY);
            if fd < 0 {
                return 0;
            }
            let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            libc::close(fd);
            n.max(0) as usize
        }
    }

    /// On cgroup v2 PID 1 is born in the machine's `init` leaf, PID 1 of a new pid
    /// namespace, with a cgroup namespace rooted at the machine's cgroup, and is the
    /// shim's own child. The host's v2 hierarchy (on a hybrid host `unified`, without
    /// controllers: enough for membership) is where the test makes the machine's cgroup.
    #[test]
    fn pid1_is_cloned_into_init_with_its_cgroup_namespace_at_the_machine() {
        let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .iter()
            .map(Path::new)
            .find(|p| p.join("cgroup.controllers").exists())
            .expect("no cgroup v2 hierarchy on this host");
        let id = format!("shim-test-{}", std::process::id());
        let cg = MachineCgroup::new(
            Layout {
                version: Version::V2,
                root: root.to_owned(),
            },
            &id,
            Path::new("/nonexistent"),
        );
        let (_, machine) = cg.dirs().remove(0);
        fs::create_dir_all(machine.join("init")).unwrap();
        let (r, w) = sys::pipe().unwrap();
        let mut w = Some(w);
        // SAFETY: the closure runs in the child and makes raw calls only.
        let pid = unsafe {
            start_pid1(&cg, |entered| {
                let mut out = [0u8; 512];
                out[0] = (entered == Entered::Cloned) as u8;
                out[1] = (libc::getpid() == 1) as u8;
                let n = raw_read(c"/proc/self/cgroup", &mut out[2..]);
                let w = w.take().expect("once");
                libc::write(w.as_raw_fd(), out.as_ptr().cast(), n + 2);
            })
        }
        .unwrap();
        drop(w);
        let mut got = Vec::new();
        fs::File::from(r).read_to_end(&mut got).unwrap();
        // The shim's child: its own waitpid reaps it.
        let status = sys::waitpid(pid).unwrap();
        let _ = fs::remove_dir(machine.join("init"));
        let _ = fs::remove_dir(&machine);
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        assert_eq!(got.first(), Some(&1), "PID 1 fell back to a move");
        assert_eq!(got.get(1), Some(&1), "not PID 1 of its namespace");
        let inside = String::from_utf8_lossy(&got[2..]);
        assert!(
            inside.lines().any(|l| l == "0::/init"),
            "its cgroup as PID 1 sees it: {inside}"
        );
    }
}
