//! The agent's system calls, by the names its rooms use.
//!
//! Every call is written once, with the invariant its `unsafe` relies on, in `locker-sys`
//! (which the static agent links like any crate: it depends on `libc` alone); this module
//! re-exports the ones the agent makes and adapts a few to the agent's idiom. Functions
//! return `io::Result` with the OS error intact; the callers decide what an error means for
//! the host.
//!
//! What stays here is the code that runs between `fork` and `exec` ([`child_setup`] and
//! its helpers). It must be async-signal-safe (no allocation, no lock: the forked child of
//! a multi-threaded agent may find the allocator's lock held by a thread that no longer
//! exists), and that is a property of the whole sequence and of the [`ChildPlan`] built
//! for it in the parent, not of any one call; so the sequence is kept whole, beside its
//! plan, with raw `libc` calls that visibly allocate nothing, rather than spread over
//! `locker-sys` helpers that are free to allocate (their errors, their `CString`s).

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::RawFd;

pub use locker_sys::fd::{
    cloexec_from_3 as cloexec_inherited, fchmod, fchown_empty, fs_type, fstat, fsync, linkat,
    lstatat, mkdirat, open_beneath, open_in_root, openat, read, read_dir_names, readlinkat,
    set_cloexec, symlinkat, syncfs,
};
pub use locker_sys::host::{geteuid, memory as host_memory};
pub use locker_sys::net::configure as configure_net;
pub use locker_sys::proc::{
    kill, reap, rusage_cpu_ms, self_usage, set_child_subreaper, set_non_dumpable, signal_name,
    wait_any_exited_peek, CpuSet,
};
pub use locker_sys::term::{openpty, set_winsize};

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// This process's `oom_score_adj` (0 where it cannot be read).
pub fn oom_score_adj() -> i32 {
    std::fs::read_to_string("/proc/self/oom_score_adj")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// `unlinkat(2)`; `remove_dir` removes a directory.
pub fn unlinkat(dir: RawFd, name: &CStr, remove_dir: bool) -> io::Result<()> {
    let flags = if remove_dir { libc::AT_REMOVEDIR } else { 0 };
    locker_sys::fd::unlinkat(dir, name, flags)
}

/// `renameat(2)`.
pub fn renameat(from_dir: RawFd, from: &CStr, to_dir: RawFd, to: &CStr) -> io::Result<()> {
    locker_sys::fd::renameat2(from_dir, from, to_dir, to, 0)
}

/// Sets the modification (and access) time of `name` in `dir` (`None`: the file `dir` is
/// itself) to `mtime` seconds, not following a final symlink.
pub fn set_mtime(dir: RawFd, name: Option<&CStr>, mtime: i64) -> io::Result<()> {
    let t = libc::timespec {
        tv_sec: mtime as libc::time_t,
        tv_nsec: 0,
    };
    match name {
        None => locker_sys::fd::futimens(dir, &[t, t]),
        Some(n) => locker_sys::fd::set_times_at(dir, n, &[t, t]),
    }
}

/// `poll(2)` for input on each of `fds`; returns the revents of each (all 0 when a signal
/// interrupted the wait).
pub fn poll(fds: &[RawFd], timeout_ms: i32) -> io::Result<Vec<i16>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    locker_sys::fd::poll(&mut p, timeout_ms)?;
    Ok(p.iter().map(|x| x.revents).collect())
}

/// Sets the hostname (if given) and the wall clock to `unix_ns`, and mixes `entropy` into
/// the kernel's pool, crediting it, then reseeds the CRNG: what a microVM restored from a
/// snapshot needs first.
pub fn refresh(unix_ns: u64, entropy: &[u8], hostname: &str) -> io::Result<()> {
    if !hostname.is_empty() {
        locker_sys::host::sethostname(hostname)?;
    }
    locker_sys::host::set_realtime(unix_ns)?;
    locker_sys::random::credit_entropy(entropy)
}

/// What the child does between `fork` and `exec` (see [`child_setup`]). Built in the parent:
/// the child only reads it.
pub struct ChildPlan {
    /// Open `cgroup.procs` files of the command's cgroups; the child writes "0" to each.
    pub cgroup_procs: Vec<RawFd>,
    /// Make fd 0 (a terminal) the controlling terminal of the new session.
    pub controlling_tty: bool,
    /// (uid, gid, supplementary groups) to switch to, if different from the agent's.
    pub user: Option<(u32, u32, Vec<libc::gid_t>)>,
    pub cwd: CString,
    /// Set `oom_score_adj` back to 0: the agent is exempt from the OOM killer, its commands
    /// must not be.
    pub reset_oom: bool,
    /// The machine's CPUs: the command runs on these (see `view`).
    pub cpus: Option<CpuSet>,
}

/// Runs in the forked child before `exec`: keep stray fds from the command, join the cgroups,
/// start a new session (and so a new process group), take the terminal, drop to the user,
/// enter the working directory, reset signal dispositions.
///
/// Async-signal-safe: only system calls on data prepared in the parent.
pub fn child_setup(plan: &ChildPlan) -> io::Result<()> {
    // Whatever fds another thread opened without CLOEXEC, or the agent inherited, stay here.
    // SAFETY: integer arguments only; on kernels before 5.11 this fails harmlessly.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    for &fd in &plan.cgroup_procs {
        // SAFETY: writes one byte from a static buffer. A failure is ignored on purpose: the
        // parent kills by process group too, so a command outside its cgroup still dies.
        unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
    }
    if let Some(cpus) = &plan.cpus {
        // SAFETY: a live cpu_set_t of the size passed, prepared before the fork.
        cvt(unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), cpus.as_raw())
        })?;
    }
    if plan.reset_oom {
        // Before dropping to the user: until exec the child is non-dumpable like the agent,
        // so its /proc files are root's.
        child_write_file(c"/proc/self/oom_score_adj", b"0")?;
    }
    // SAFETY: no arguments.
    cvt(unsafe { libc::setsid() })?;
    if plan.controlling_tty {
        // SAFETY: fd 0 is the terminal's slave end, dup2'ed there by the spawner.
        cvt(unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) })?;
    }
    if let Some((uid, gid, groups)) = &plan.user {
        // SAFETY: the groups vector was built in the parent and is only read here.
        cvt(unsafe { libc::setgroups(groups.len(), groups.as_ptr()) })?;
        // SAFETY: integer arguments only.
        cvt(unsafe { libc::setgid(*gid) })?;
        // SAFETY: integer arguments only.
        cvt(unsafe { libc::setuid(*uid) })?;
    }
    // SAFETY: cwd is NUL-terminated and owned by the plan, alive for the call.
    cvt(unsafe { libc::chdir(plan.cwd.as_ptr()) })?;
    // Last, so glibc's setuid (which may use signal 33) is done with its signals.
    // Ignored signals stay ignored across exec, and whoever started the agent may have
    // ignored some (a shell's `&` ignores SIGINT and SIGQUIT). Commands start with defaults.
    // The raw system call, because glibc's wrapper refuses its internal signals 32 and 33.
    // An all-zero kernel sigaction is SIG_DFL, no flags, an empty mask, on every layout.
    let dfl = [0u64; 4];
    for sig in 1..=64 {
        if sig != libc::SIGKILL && sig != libc::SIGSTOP {
            // SAFETY: `dfl` outlives the call and is at least as large as the kernel's struct
            // sigaction; the old action is not asked for; 8 is the kernel's sigset size.
            unsafe {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    sig,
                    dfl.as_ptr(),
                    std::ptr::null::<u64>(),
                    8,
                )
            };
        }
    }
    Ok(())
}

/// Writes `data` to the existing file `path`; async-signal-safe.
fn child_write_file(path: &CStr, data: &[u8]) -> io::Result<()> {
    // SAFETY: `path` is NUL-terminated and alive for the call.
    let fd = cvt(unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) })?;
    // SAFETY: `data` is valid for `data.len()` bytes.
    let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
    let err = io::Error::last_os_error();
    // SAFETY: closing the fd opened above.
    unsafe { libc::close(fd) };
    if n == data.len() as isize {
        Ok(())
    } else {
        Err(err)
    }
}

/// Arranges for `cmd`'s child to run [`child_setup`] with `plan` between fork and exec.
pub fn set_child_setup(cmd: &mut std::process::Command, plan: ChildPlan) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure only calls `child_setup`, which is async-signal-safe: it makes
    // system calls on data prepared before the fork, allocates nothing and takes no locks.
    unsafe {
        cmd.pre_exec(move || child_setup(&plan));
    }
}
