//! Processes and their privileges: namespaces, fork, wait, kill, exec, capabilities,
//! `prctl` flags, CPU affinity, resource usage, signal names. What runs *between* fork and
//! exec is the caller's (it must be async-signal-safe); the helpers here that touch a
//! `Command` say so.

use std::ffi::{CStr, CString};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;

use crate::{check, check_int};

/// `unshare(2)`.
pub fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall with integer flags.
    check(unsafe { libc::unshare(flags) }.into()).map(drop)
}

/// `setns(2)`.
pub fn setns(fd: RawFd, nstype: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall; an invalid fd yields EBADF.
    check(unsafe { libc::setns(fd, nstype) }.into()).map(drop)
}

/// `fork(2)`. Only for single-threaded callers (the jail's init helper).
///
/// # Safety
/// The caller must be single-threaded, so the child owns a consistent copy of all state.
pub unsafe fn fork() -> io::Result<libc::pid_t> {
    // SAFETY: upheld by the caller.
    let pid = unsafe { libc::fork() };
    check(pid.into()).map(|p| p as libc::pid_t)
}

/// `clone3(2)` with `CLONE_INTO_CGROUP`: a fork whose child starts in the cgroup v2
/// directory `cgroup` (an open descriptor of it) instead of its parent's, so nothing has to
/// move it there afterwards. A move takes the kernel's `cgroup_threadgroup_rwsem` for
/// writing, which after a quiet spell waits an RCU grace period (unless the host mounts a
/// hierarchy with `favordynmods`); a child cloned into its cgroup takes only the read side.
/// Returns 0 in the child, the child's pid in the parent. Fails with `ENOSYS` where clone3
/// is missing or filtered (a machine's seccomp policy answers it so), `EINVAL`/`E2BIG` on
/// kernels before 5.7, `EBADF`/`EOPNOTSUPP` where `cgroup` is no v2 cgroup: callers fall
/// back to [`fork`] and a write to `cgroup.procs`.
///
/// # Safety
/// As for a fork in a multi-threaded process: until it execs or exits, the child may only
/// make async-signal-safe calls (no allocation, no locks another thread may have held).
/// glibc's fork handlers do not run.
pub unsafe fn fork_into_cgroup(cgroup: RawFd) -> io::Result<libc::pid_t> {
    // SAFETY: upheld by the caller.
    unsafe { clone_into_cgroup(cgroup, 0) }
}

/// [`fork_into_cgroup`] with more `clone(2)` flags: new namespaces (`CLONE_NEWPID`;
/// `CLONE_NEWCGROUP`, whose root is then `cgroup`, where the child is born), `CLONE_PARENT` (the child is the caller's sibling, reported to the caller's
/// parent; its exit signal is the caller's own). No flag that shares memory or needs a
/// stack (`CLONE_VM`, `CLONE_THREAD`…).
///
/// # Safety
/// As [`fork_into_cgroup`]. glibc's cached thread id in the child is the caller's (its
/// fork wrapper would have set it): `raise` and `pthread_kill` in the child signal the
/// wrong thread until it executes a program.
pub unsafe fn clone_into_cgroup(cgroup: RawFd, flags: u64) -> io::Result<libc::pid_t> {
    // libc's own constant overflows its type (libc #3584).
    const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;
    let parent = flags & libc::CLONE_PARENT as u64 != 0;
    let args = libc::clone_args {
        flags: flags | CLONE_INTO_CGROUP,
        pidfd: 0,
        child_tid: 0,
        parent_tid: 0,
        // clone3 takes no exit signal with CLONE_PARENT: the child gets the caller's.
        exit_signal: if parent { 0 } else { libc::SIGCHLD as u64 },
        stack: 0,
        stack_size: 0,
        tls: 0,
        set_tid: 0,
        set_tid_size: 0,
        cgroup: cgroup as u64,
    };
    // SAFETY: `args` is a live, fully initialised clone_args of the size passed; without
    // CLONE_VM or a stack the child runs on a copy of this stack, as after fork. The
    // caller upholds what the child may do.
    let r = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const libc::clone_args,
            std::mem::size_of::<libc::clone_args>(),
        )
    };
    check(r).map(|p| p as libc::pid_t)
}

/// Waits for `pid` and returns its raw wait status.
pub fn waitpid(pid: libc::pid_t) -> io::Result<libc::c_int> {
    let mut status = 0;
    loop {
        // SAFETY: `status` is a valid out-pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        if rc >= 0 {
            return Ok(status);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `prctl(PR_SET_NO_NEW_PRIVS, 1)`.
pub fn set_no_new_privs() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }.into()).map(drop)
}

/// Drops every capability not in `keep` from the bounding set and from the effective,
/// permitted and inheritable sets of this thread.
pub fn restrict_capabilities(keep: &[u32]) -> io::Result<()> {
    let last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(40);
    let mut mask: u64 = 0;
    for cap in 0..=last {
        if keep.contains(&cap) {
            mask |= 1 << cap;
            continue;
        }
        // SAFETY: prctl with integer arguments; EINVAL for caps the kernel lacks is ignored.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if rc < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return Err(io::Error::last_os_error());
        }
    }
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let (lo, hi) = (mask as u32, (mask >> 32) as u32);
    let hdr = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let data = [
        Data {
            effective: lo,
            permitted: lo,
            inheritable: 0,
        },
        Data {
            effective: hi,
            permitted: hi,
            inheritable: 0,
        },
    ];
    // SAFETY: capset reads one header and two data structs (version 3 layout) we own.
    check(unsafe { libc::syscall(libc::SYS_capset, &hdr as *const Header, data.as_ptr()) })
        .map(drop)
}

/// Runs `f` with the filesystem ids set to `id` (uid and gid) and every permitted
/// capability effective, then returns to fsuid/fsgid 0. A mount made inside keeps these
/// credentials: overlayfs then writes its upper layer as `id`, which an id-mapped upper
/// mount needs (host root has no mapping there).
pub fn with_fs_ids<T>(id: u32, f: impl FnOnce() -> T) -> io::Result<T> {
    // SAFETY: setfsuid/setfsgid take integers; they never fail, and we restore them below.
    unsafe {
        libc::setfsgid(id);
        libc::setfsuid(id);
    }
    raise_effective_caps()?;
    let out = f();
    // SAFETY: as above.
    unsafe {
        libc::setfsuid(0);
        libc::setfsgid(0);
    }
    raise_effective_caps()?;
    Ok(out)
}

/// Makes every permitted capability effective again (changing fsuid away from 0 clears the
/// file-related ones).
fn raise_effective_caps() -> io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut hdr = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget fills two data structs (version 3 layout) we own.
    check(unsafe { libc::syscall(libc::SYS_capget, &mut hdr as *mut Header, data.as_mut_ptr()) })?;
    for d in &mut data {
        d.effective = d.permitted;
    }
    // SAFETY: capset reads the header and the two structs we own.
    check(unsafe { libc::syscall(libc::SYS_capset, &hdr as *const Header, data.as_ptr()) })
        .map(drop)
}

/// Executes the program behind `fd` (opened before the root changed) with `argv` and `envp`.
/// Returns only on failure.
pub fn execveat(fd: RawFd, argv: &[CString], envp: &[CString]) -> io::Error {
    let mut a: Vec<*const libc::c_char> = argv.iter().map(|s| s.as_ptr()).collect();
    a.push(std::ptr::null());
    let mut e: Vec<*const libc::c_char> = envp.iter().map(|s| s.as_ptr()).collect();
    e.push(std::ptr::null());
    let empty: &CStr = c"";
    // SAFETY: argv/envp are NULL-terminated arrays of live strings; on success this never returns.
    unsafe {
        libc::syscall(
            libc::SYS_execveat,
            fd,
            empty.as_ptr(),
            a.as_ptr(),
            e.as_ptr(),
            libc::AT_EMPTY_PATH,
        )
    };
    io::Error::last_os_error()
}

/// Makes each `(fd, to)`'s `fd` available as number `to` across exec and marks every
/// other fd above 2 close-on-exec, so the next program starts with stdio and the `to`s
/// only. Owned fds stay valid until the exec (nothing is closed under their owners' feet).
/// The targets must be distinct and below 100.
pub fn keep_fds(fds: &[(RawFd, RawFd)]) -> io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range in CLOEXEC mode only sets flags on fds.
    check(unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        )
    })?;
    // Copies first, above every target, so that one source sitting on another's target
    // number is not overwritten before it is moved.
    let mut copies = Vec::with_capacity(fds.len());
    for (fd, _) in fds {
        // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor we own; `fd` is the caller's.
        let c = check(unsafe { libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 100) }.into())?;
        copies.push(c as RawFd);
    }
    for (c, (_, to)) in copies.into_iter().zip(fds) {
        // SAFETY: dup2 onto `to`, which the caller reserved for this purpose; the copy has
        // no close-on-exec flag. The temporary copy is ours to close (it is close-on-exec
        // anyway, closing it just keeps the table small).
        check(unsafe { libc::dup2(c, *to) }.into())?;
        // SAFETY: `c` is the temporary descriptor made above; nothing else refers to it.
        unsafe { libc::close(c) };
    }
    Ok(())
}

/// The CPUs this process may run on (`sched_getaffinity(2)`), in ascending order.
pub fn affinity() -> io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the kernel fills at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a live cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_getaffinity(0, size, &mut set) };
    check(rc.into())?;
    let mut cpus = Vec::new();
    for c in 0..8 * size {
        // SAFETY: CPU_ISSET reads a bit of the live set, within its size.
        if unsafe { libc::CPU_ISSET(c, &set) } {
            cpus.push(c);
        }
    }
    Ok(cpus)
}

/// Sends `sig` to `pid`.
pub fn kill(pid: libc::pid_t, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall.
    check(unsafe { libc::kill(pid, sig) }.into()).map(drop)
}

/// A descriptor for process `pid` (`pidfd_open(2)`): it names that process even after its
/// pid is reused, and becomes readable once the process has exited.
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall; on success the kernel gives us a new descriptor we own.
    let fd = check(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Waits until the process behind `pidfd` has exited, at most `timeout`. `Ok(true)` once it
/// has (for a pid namespace's PID 1 that also means every other process of the namespace
/// is gone: the kernel reaps them before it reports PID 1's exit), `Ok(false)` on timeout.
pub fn pidfd_wait_exit(
    pidfd: &std::os::fd::OwnedFd,
    timeout: std::time::Duration,
) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut p = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `p` is one valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc > 0 {
            return Ok(true);
        }
        if rc == 0 {
            return Ok(false);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Makes this process non-dumpable: its `/proc/<pid>` files become root's of the host's
/// choosing and `ptrace_may_access` refuses whoever lacks `CAP_SYS_PTRACE` (no command
/// has it), so no command traces the agent, reads its memory or opens its descriptors.
/// Children inherit it until they execute a program (exec resets it).
pub fn set_non_dumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments touches no memory of ours.
    check_int(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }).map(drop)
}

/// Makes this process the reaper of its orphaned descendants (as PID 1 is anyway).
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments touches no memory of ours.
    check_int(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }).map(drop)
}

/// Blocks until some child has exited and returns its pid without reaping it (`WNOWAIT`).
pub fn wait_any_exited_peek() -> io::Result<i32> {
    let mut info = MaybeUninit::<libc::siginfo_t>::zeroed();
    // SAFETY: the kernel fills `info`; it is zeroed first, as waitid(2) advises.
    check_int(unsafe {
        libc::waitid(
            libc::P_ALL,
            0,
            info.as_mut_ptr(),
            libc::WEXITED | libc::WNOWAIT,
        )
    })?;
    // SAFETY: zero-initialized and then filled by the kernel.
    let info = unsafe { info.assume_init() };
    // SAFETY: for CLD_* events si_pid is the valid union member.
    Ok(unsafe { info.si_pid() })
}

/// Reaps `pid` if it has exited: its wait status and resource usage.
pub fn reap(pid: i32) -> io::Result<Option<(i32, libc::rusage)>> {
    let mut status = 0;
    let mut ru = MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: both out-pointers are valid for writes.
    let r = check(unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, ru.as_mut_ptr()) }.into())?;
    if r == 0 {
        return Ok(None);
    }
    // SAFETY: zeroed, then filled by a successful wait4.
    Ok(Some((status, unsafe { ru.assume_init() })))
}

/// Resource usage of this process and its reaped children together: (cpu ms, max rss bytes).
pub fn self_usage() -> (u64, u64) {
    let mut total = (0u64, 0u64);
    for who in [libc::RUSAGE_SELF, libc::RUSAGE_CHILDREN] {
        let mut ru = MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: `ru` is valid for writes.
        if unsafe { libc::getrusage(who, ru.as_mut_ptr()) } == 0 {
            // SAFETY: zeroed, then filled by a successful getrusage.
            let ru = unsafe { ru.assume_init() };
            total.0 += rusage_cpu_ms(&ru);
            total.1 = total.1.max(ru.ru_maxrss.max(0) as u64 * 1024);
        }
    }
    total
}

/// User plus system CPU time of a `rusage`, in milliseconds.
pub fn rusage_cpu_ms(ru: &libc::rusage) -> u64 {
    let us = |t: libc::timeval| t.tv_sec.max(0) as u64 * 1_000_000 + t.tv_usec.max(0) as u64;
    (us(ru.ru_utime) + us(ru.ru_stime)) / 1000
}

/// The conventional name of a signal number (`SIGKILL`), or `SIG<n>`.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGCHLD => "SIGCHLD",
        libc::SIGCONT => "SIGCONT",
        libc::SIGSTOP => "SIGSTOP",
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGTTIN => "SIGTTIN",
        libc::SIGTTOU => "SIGTTOU",
        libc::SIGURG => "SIGURG",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGVTALRM => "SIGVTALRM",
        libc::SIGPROF => "SIGPROF",
        libc::SIGWINCH => "SIGWINCH",
        libc::SIGIO => "SIGIO",
        libc::SIGPWR => "SIGPWR",
        libc::SIGSYS => "SIGSYS",
        other => return format!("SIG{other}"),
    };
    name.to_string()
}

/// A set of CPUs, ready for `sched_setaffinity(2)` (no allocation between fork and exec).
#[derive(Clone, Copy)]
pub struct CpuSet(libc::cpu_set_t);

impl CpuSet {
    /// Parses a kernel CPU list (`0-3,6`); `None` if it is malformed or empty.
    pub fn parse(list: &str) -> Option<CpuSet> {
        // SAFETY: a zeroed cpu_set_t is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
        let mut any = false;
        for part in list.trim().split(',') {
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
                None => {
                    let a = part.parse::<usize>().ok()?;
                    (a, a)
                }
            };
            if a > b || b >= max {
                return None;
            }
            for c in a..=b {
                // SAFETY: `c` is below the set's size (checked above).
                unsafe { libc::CPU_SET(c, &mut set) };
                any = true;
            }
        }
        any.then_some(CpuSet(set))
    }

    /// The set as the kernel reads it (`sched_setaffinity(2)`).
    pub fn as_raw(&self) -> &libc::cpu_set_t {
        &self.0
    }

    /// How many CPUs the set holds.
    pub fn count(&self) -> usize {
        // SAFETY: CPU_COUNT reads the live set.
        unsafe { libc::CPU_COUNT(&self.0) as usize }
    }
}

/// Makes the child of `cmd` get `signal` when the spawning thread dies, and keep
/// `keep_fd` (a held flock) open across exec, so that the lock stays held for as long
/// as the child may still write into the build directory.
///
/// The death signal follows the *thread* that spawns: spawn from a thread that waits
/// for the child (as every caller here does).
pub fn die_with_parent(cmd: &mut Command, keep_fd: RawFd, signal: libc::c_int) {
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (prctl, getppid, fcntl), allocating nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                // The parent died before prctl took effect.
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            if libc::fcntl(keep_fd, libc::F_SETFD, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Ends this process at once with `code`, running no destructors and flushing nothing:
/// how a forked child that must not touch its parent's state leaves (`_exit(2)`).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit takes an integer and never returns.
    unsafe { libc::_exit(code) }
}

/// `dup2(2)`: makes `to` a copy of `from` (closing what `to` was), without close-on-exec.
pub fn dup2(from: RawFd, to: RawFd) -> io::Result<()> {
    // SAFETY: integer arguments; `to` is a number the caller reserved for this.
    check(unsafe { libc::dup2(from, to) }.into()).map(drop)
}

/// A close-on-exec duplicate of `fd` numbered `min` or above (`F_DUPFD_CLOEXEC`).
pub fn dup_above(fd: RawFd, min: RawFd) -> io::Result<std::os::fd::OwnedFd> {
    // SAFETY: fcntl on the caller's fd; `owned` takes the new fd it returns.
    crate::owned(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, min) }.into())
}

/// Becomes uid and gid 0 with no supplementary groups (`setgroups(0)`, `setresgid`,
/// `setresuid`): root of the user namespace just joined.
pub fn become_root() -> io::Result<()> {
    // SAFETY: a null list of length 0 and integer arguments.
    check_int(unsafe { libc::setgroups(0, std::ptr::null()) })?;
    // SAFETY: integer arguments only.
    check_int(unsafe { libc::setresgid(0, 0, 0) })?;
    // SAFETY: integer arguments only.
    check_int(unsafe { libc::setresuid(0, 0, 0) })
}

/// The open files limit of this process: (soft, hard); `RLIM_INFINITY` for none.
pub fn nofile_limit() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we own.
    check_int(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) })?;
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// Sets the open files limit of this process (raising the hard one needs
/// `CAP_SYS_RESOURCE`).
pub fn set_nofile_limit(soft: u64, hard: u64) -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: setrlimit reads the struct we own.
    check_int(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(CpuSet::parse("0-3,6").map(|s| s.count()), Some(5));
        assert_eq!(CpuSet::parse("2\n").map(|s| s.count()), Some(1));
        for bad in ["", "3-1", "x", "0-99999", "1,,2"] {
            assert!(CpuSet::parse(bad).is_none(), "{bad:?}");
        }
        assert!(!affinity().unwrap().is_empty());
    }

    #[test]
    fn the_open_files_limit_reads_back_as_set() {
        let (soft, hard) = nofile_limit().unwrap();
        let lower = soft.min(hard).min(1 << 16) - 1;
        set_nofile_limit(lower, hard).unwrap();
        assert_eq!(nofile_limit().unwrap(), (lower, hard));
        set_nofile_limit(soft, hard).unwrap();
        let copy = dup_above(2, 100).unwrap();
        use std::os::fd::AsRawFd;
        assert!(copy.as_raw_fd() >= 100);
    }

    #[test]
    fn signals_have_their_names_and_a_child_is_waited_for() {
        assert_eq!(signal_name(libc::SIGKILL), "SIGKILL");
        assert_eq!(signal_name(40), "SIG40");
        let mut child = Command::new("true").spawn().unwrap();
        let status = waitpid(child.id() as libc::pid_t).unwrap();
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert_eq!(
            kill(child.id() as libc::pid_t, 0)
                .unwrap_err()
                .raw_os_error(),
            Some(libc::ESRCH)
        );
        // Reaped above: std's own wait only finds it gone.
        assert!(child.wait().is_err());
    }
}
