//! Raw system calls, in one place.
//!
//! Every `unsafe` block of the agent lives here, each with the invariant it relies on, so the
//! other modules read as policy. Functions return `io::Result` with the OS error intact; the
//! callers decide what an error means for the host. The `child_*` functions run between
//! `fork` and `exec` and are async-signal-safe: they allocate nothing and take no locks.

use std::ffi::{CStr, CString};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Makes this process non-dumpable: its `/proc/<pid>` files become root's of the host's
/// choosing and `ptrace_may_access` refuses whoever lacks `CAP_SYS_PTRACE` (no command
/// has it), so no command traces the agent, reads its memory or opens its descriptors.
/// Children inherit it until they execute a program (exec resets it).
pub fn set_non_dumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments touches no memory of ours.
    cvt(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }).map(drop)
}

/// This process's `oom_score_adj` (0 where it cannot be read).
pub fn oom_score_adj() -> i32 {
    std::fs::read_to_string("/proc/self/oom_score_adj")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Makes this process the reaper of its orphaned descendants (as PID 1 is anyway).
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments touches no memory of ours.
    cvt(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }).map(drop)
}

/// Marks every descriptor from 3 up close-on-exec: what the agent inherited from whoever
/// started it (a jobserver pipe, a log file) must not reach its commands.
pub fn cloexec_inherited() {
    // SAFETY: integer arguments only.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if r == 0 {
        return;
    }
    // Kernels before 5.11: walk /proc/self/fd.
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        let fds: Vec<RawFd> = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        for fd in fds.into_iter().filter(|&fd| fd >= 3) {
            let _ = set_cloexec(fd);
        }
    }
}

/// The host's (in a jail) or the guest's memory: (total, free) bytes, from `sysinfo(2)`.
pub fn host_memory() -> Option<(u64, u64)> {
    // SAFETY: a zeroed sysinfo struct is valid; the kernel fills it.
    let mut si: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `si` is a live sysinfo struct for the call.
    if unsafe { libc::sysinfo(&mut si) } != 0 {
        return None;
    }
    let unit = u64::from(si.mem_unit.max(1));
    Some((
        (si.totalram as u64).saturating_mul(unit),
        (si.freeram as u64).saturating_mul(unit),
    ))
}

/// Sets `FD_CLOEXEC` on a descriptor we were handed.
pub fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an integer fd; a bad fd is an error, not undefined behaviour.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) }).map(drop)
}

/// `openat2(2)` with `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`: `path` (relative) is resolved
/// as if `root` were `/`, so neither `..` nor any symlink can leave it.
pub fn open_in_root(root: RawFd, path: &CStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    openat2(
        root,
        path,
        flags,
        mode,
        libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS,
    )
}

/// `openat2(2)` with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`: `path` (relative) must stay
/// under `dir` all the way; `..` above it, an absolute symlink or one leading out fail with
/// `EXDEV`.
pub fn open_beneath(dir: RawFd, path: &CStr, flags: i32) -> io::Result<OwnedFd> {
    openat2(
        dir,
        path,
        flags,
        0,
        libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
    )
}

fn openat2(root: RawFd, path: &CStr, flags: i32, mode: u32, resolve: u64) -> io::Result<OwnedFd> {
    let mut how: libc::open_how = {
        // SAFETY: open_how is a plain C struct of integers; all-zero is a valid value.
        unsafe { MaybeUninit::zeroed().assume_init() }
    };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = if flags & (libc::O_CREAT | libc::O_TMPFILE) != 0 {
        u64::from(mode)
    } else {
        0
    };
    how.resolve = resolve;
    let mut tries = 0;
    loop {
        // SAFETY: `path` is NUL-terminated and `how` lives across the call with its true size.
        let r = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                root,
                path.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if r >= 0 {
            // SAFETY: the kernel just gave us this descriptor; nobody else owns it.
            return Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) });
        }
        let e = io::Error::last_os_error();
        // EAGAIN: a racing rename or mount was seen during resolution; trying again is safe.
        if e.raw_os_error() == Some(libc::EAGAIN) && tries < 16 {
            tries += 1;
            continue;
        }
        return Err(e);
    }
}

/// `openat(2)` relative to a directory fd, always close-on-exec.
pub fn openat(dir: RawFd, name: &CStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: `name` is NUL-terminated; mode is passed as the variadic argument openat expects.
    let fd = cvt(unsafe {
        libc::openat(
            dir,
            name.as_ptr(),
            flags | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    })?;
    // SAFETY: a fresh descriptor from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fstat(2)`.
pub fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: the kernel fills `st` on success, which is the only case we read it.
    cvt(unsafe { libc::fstat(fd, st.as_mut_ptr()) })?;
    // SAFETY: initialized by the successful call above.
    Ok(unsafe { st.assume_init() })
}

/// The filesystem type (`f_type` of `fstatfs(2)`) of the file `fd` is open on.
pub fn fs_type(fd: RawFd) -> io::Result<i64> {
    let mut st = MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: the kernel fills `st` on success, which is the only case we read it.
    cvt(unsafe { libc::fstatfs(fd, st.as_mut_ptr()) })?;
    // SAFETY: initialized by the successful call above.
    let st = unsafe { st.assume_init() };
    // `f_type`'s width differs between libcs and architectures.
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64)
}

/// `fstatat(2)` of `name` in `dir`, not following a final symlink.
pub fn lstatat(dir: RawFd, name: &CStr) -> io::Result<libc::stat> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: as fstat; `name` is NUL-terminated.
    cvt(unsafe {
        libc::fstatat(
            dir,
            name.as_ptr(),
            st.as_mut_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    // SAFETY: initialized by the successful call above.
    Ok(unsafe { st.assume_init() })
}

/// `mkdirat(2)`.
pub fn mkdirat(dir: RawFd, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated.
    cvt(unsafe { libc::mkdirat(dir, name.as_ptr(), mode as libc::mode_t) }).map(drop)
}

/// `unlinkat(2)`; `dir_flag` removes a directory.
pub fn unlinkat(dir: RawFd, name: &CStr, remove_dir: bool) -> io::Result<()> {
    let flags = if remove_dir { libc::AT_REMOVEDIR } else { 0 };
    // SAFETY: `name` is NUL-terminated.
    cvt(unsafe { libc::unlinkat(dir, name.as_ptr(), flags) }).map(drop)
}

/// `renameat(2)`.
pub fn renameat(from_dir: RawFd, from: &CStr, to_dir: RawFd, to: &CStr) -> io::Result<()> {
    // SAFETY: both names are NUL-terminated.
    cvt(unsafe { libc::renameat(from_dir, from.as_ptr(), to_dir, to.as_ptr()) }).map(drop)
}

/// `fchmod(2)`.
pub fn fchmod(fd: RawFd, mode: u32) -> io::Result<()> {
    // SAFETY: integer arguments only.
    cvt(unsafe { libc::fchmod(fd, mode as libc::mode_t) }).map(drop)
}

/// `fsync(2)`.
pub fn fsync(fd: RawFd) -> io::Result<()> {
    // SAFETY: integer argument only.
    cvt(unsafe { libc::fsync(fd) }).map(drop)
}

/// `syncfs(2)`: flushes the whole filesystem `fd` is on.
pub fn syncfs(fd: RawFd) -> io::Result<()> {
    // SAFETY: integer argument only.
    cvt(unsafe { libc::syncfs(fd) }).map(drop)
}

/// `symlinkat(2)`: `name` in `dir`, pointing at `target` (stored as given, never followed).
pub fn symlinkat(target: &CStr, dir: RawFd, name: &CStr) -> io::Result<()> {
    // SAFETY: both strings are NUL-terminated.
    cvt(unsafe { libc::symlinkat(target.as_ptr(), dir, name.as_ptr()) }).map(drop)
}

/// `linkat(2)` without following a final symlink of `from`.
pub fn linkat(from_dir: RawFd, from: &CStr, to_dir: RawFd, to: &CStr) -> io::Result<()> {
    // SAFETY: both names are NUL-terminated.
    cvt(unsafe { libc::linkat(from_dir, from.as_ptr(), to_dir, to.as_ptr(), 0) }).map(drop)
}

/// `readlinkat(2)`: the target of the symlink `name` in `dir`.
pub fn readlinkat(dir: RawFd, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    // SAFETY: `buf` is writable for its full length, which is what we pass.
    let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// Sets the modification (and access) time of `name` in `dir` (`None`: the file `dir` is
/// itself) to `mtime` seconds, not following a final symlink.
pub fn set_mtime(dir: RawFd, name: Option<&CStr>, mtime: i64) -> io::Result<()> {
    let t = libc::timespec {
        tv_sec: mtime as libc::time_t,
        tv_nsec: 0,
    };
    let times = [t, t];
    match name {
        // SAFETY: `times` holds the two timespecs futimens(3) reads.
        None => cvt(unsafe { libc::futimens(dir, times.as_ptr()) }).map(drop),
        // SAFETY: as above; `n` is NUL-terminated.
        Some(n) => cvt(unsafe {
            libc::utimensat(dir, n.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW)
        })
        .map(drop),
    }
}

/// The names in a directory (without `.` and `..`), unsorted. Consumes the descriptor.
pub fn read_dir_names(fd: OwnedFd) -> io::Result<Vec<CString>> {
    use std::os::fd::IntoRawFd;
    let raw = fd.into_raw_fd();
    // SAFETY: fdopendir takes ownership of `raw` on success; on failure we still own it.
    let dir = unsafe { libc::fdopendir(raw) };
    if dir.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so `raw` is still ours to close.
        unsafe { libc::close(raw) };
        return Err(e);
    }
    let mut names = Vec::new();
    let result = loop {
        // SAFETY: errno is thread-local; readdir signals the end by NULL with errno untouched.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: `dir` is a valid DIR* until closedir below.
        let ent = unsafe { libc::readdir64(dir) };
        if ent.is_null() {
            let e = io::Error::last_os_error();
            break if e.raw_os_error() == Some(0) {
                Ok(())
            } else {
                Err(e)
            };
        }
        // SAFETY: d_name is a NUL-terminated array inside the entry readdir returned, valid
        // until the next readdir call; we copy it out at once.
        let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) };
        let b = name.to_bytes();
        if b != b"." && b != b".." {
            names.push(name.to_owned());
        }
    };
    // SAFETY: `dir` came from fdopendir and is closed exactly once.
    unsafe { libc::closedir(dir) };
    result.map(|()| names)
}

/// `kill(2)`; `pid` may be negative for a process group.
pub fn kill(pid: i32, sig: i32) -> io::Result<()> {
    // SAFETY: integer arguments only.
    cvt(unsafe { libc::kill(pid, sig) }).map(drop)
}

/// Blocks until some child has exited and returns its pid without reaping it (`WNOWAIT`).
pub fn wait_any_exited_peek() -> io::Result<i32> {
    let mut info = MaybeUninit::<libc::siginfo_t>::zeroed();
    // SAFETY: the kernel fills `info`; it is zeroed first, as waitid(2) advises.
    cvt(unsafe {
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
    let r = cvt(unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, ru.as_mut_ptr()) })?;
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

/// A pseudo-terminal pair (master, slave), both close-on-exec, with the given size.
pub fn openpty(cols: u16, rows: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut master = -1;
    let mut slave = -1;
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: out-pointers are valid; name is NULL (not wanted); termios NULL means defaults.
    cvt(unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    })?;
    // SAFETY: two fresh descriptors from the kernel, owned by nobody else.
    let (m, s) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    set_cloexec(m.as_raw_fd())?;
    set_cloexec(s.as_raw_fd())?;
    Ok((m, s))
}

/// `TIOCSWINSZ`: tells the terminal (and its foreground job, by SIGWINCH) its new size.
pub fn set_winsize(fd: RawFd, cols: u16, rows: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from the pointer, which is valid.
    cvt(unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) }).map(drop)
}

/// `poll(2)` on (fd, events) pairs; returns the revents of each.
pub fn poll(fds: &[RawFd], timeout_ms: i32) -> io::Result<Vec<i16>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: the array is valid for p.len() entries.
    let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(vec![0; fds.len()]);
        }
        return Err(e);
    }
    Ok(p.iter().map(|x| x.revents).collect())
}

/// `read(2)` into a buffer.
pub fn read(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for writes of its length.
        let r = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Fills `buf` with random bytes from the kernel.
pub fn random_bytes(buf: &mut [u8]) {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: the remainder of `buf` is valid for writes.
        let r =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if r > 0 {
            filled += r as usize;
        } else if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            // getrandom cannot fail on kernels with openat2; fall back to the clock anyway.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            for (i, b) in buf[filled..].iter_mut().enumerate() {
                *b = (t.as_nanos() >> ((i % 16) * 8)) as u8;
            }
            return;
        }
    }
}

/// `geteuid(2)`.
pub fn geteuid() -> u32 {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::geteuid() }
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

    /// How many CPUs the set holds.
    pub fn count(&self) -> usize {
        // SAFETY: CPU_COUNT reads the live set.
        unsafe { libc::CPU_COUNT(&self.0) as usize }
    }
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
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &cpus.0)
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

/// `struct rtentry` of `<net/route.h>` (the libc crate has it for uClibc only).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

fn sockaddr_v4(ip: std::net::Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes; every bit pattern is valid.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// An `ifreq` for `name` with `data` (an address or flags) in its union.
fn ifreq(name: &str, data: &[u8]) -> io::Result<[u8; 40]> {
    if name.is_empty() || name.len() > 15 || name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "bad interface name",
        ));
    }
    let mut r = [0u8; 40];
    r[..name.len()].copy_from_slice(name.as_bytes());
    r[16..16 + data.len()].copy_from_slice(data);
    Ok(r)
}

fn sockaddr_bytes(sa: &libc::sockaddr) -> [u8; 16] {
    // SAFETY: a sockaddr is 16 plain bytes.
    unsafe { std::mem::transmute_copy::<libc::sockaddr, [u8; 16]>(sa) }
}

/// Gives `iface` the address `addr/prefix`, brings it and `lo` up and makes `gw` the
/// default route (replacing any earlier one): a microVM guest's network, with the plain
/// ioctls `ifconfig` and `route` use.
pub fn configure_net(
    iface: &str,
    addr: std::net::Ipv4Addr,
    prefix: u8,
    gw: std::net::Ipv4Addr,
) -> io::Result<()> {
    // SAFETY: socket(2) with constant arguments.
    let fd = cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: a new fd nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let ioctl = |req: libc::c_ulong, arg: *mut libc::c_void| -> io::Result<()> {
        // SAFETY: `arg` points at a buffer of the size `req` reads and writes.
        cvt(unsafe { libc::ioctl(sock.as_raw_fd(), req, arg) }).map(drop)
    };
    let up = |name: &str| -> io::Result<()> {
        let mut r = ifreq(name, &[])?;
        ioctl(libc::SIOCGIFFLAGS, r.as_mut_ptr().cast())?;
        let flags = i16::from_ne_bytes([r[16], r[17]]) | libc::IFF_UP as i16;
        r[16..18].copy_from_slice(&flags.to_ne_bytes());
        ioctl(libc::SIOCSIFFLAGS, r.as_mut_ptr().cast())
    };
    up("lo")?;
    let mut r = ifreq(iface, &sockaddr_bytes(&sockaddr_v4(addr)))?;
    ioctl(libc::SIOCSIFADDR, r.as_mut_ptr().cast())?;
    let mask = std::net::Ipv4Addr::from(
        u32::MAX
            .checked_shl(32 - u32::from(prefix.min(32)))
            .unwrap_or(0),
    );
    let mut r = ifreq(iface, &sockaddr_bytes(&sockaddr_v4(mask)))?;
    ioctl(libc::SIOCSIFNETMASK, r.as_mut_ptr().cast())?;
    up(iface)?;
    let any = std::net::Ipv4Addr::UNSPECIFIED;
    let mut dev = CString::new(iface)
        .map_err(|_| io::ErrorKind::InvalidInput)?
        .into_bytes_with_nul();
    let mut rt = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_v4(any),
        rt_gateway: sockaddr_v4(gw),
        rt_genmask: sockaddr_v4(any),
        rt_flags: (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: dev.as_mut_ptr().cast(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    // An earlier default route (a snapshot's guest had another address) goes first.
    let mut old = RtEntry {
        rt_dev: std::ptr::null_mut(),
        rt_flags: libc::RTF_UP as libc::c_ushort,
        rt_gateway: sockaddr_v4(any),
        ..rt
    };
    while ioctl(libc::SIOCDELRT, (&mut old as *mut RtEntry).cast()).is_ok() {}
    ioctl(libc::SIOCADDRT, (&mut rt as *mut RtEntry).cast())
}

/// Sets the wall clock to `unix_ns` and mixes `entropy` into the kernel's pool, crediting
/// it, then reseeds the CRNG: what a microVM restored from a snapshot needs first.
pub fn refresh(unix_ns: u64, entropy: &[u8], hostname: &str) -> io::Result<()> {
    if !hostname.is_empty() {
        // SAFETY: a valid buffer of the given length.
        cvt(unsafe { libc::sethostname(hostname.as_ptr().cast(), hostname.len()) })?;
    }
    let ts = libc::timespec {
        tv_sec: (unix_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (unix_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: a valid timespec.
    cvt(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) })?;
    if entropy.is_empty() {
        return Ok(());
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + entropy.len());
    info.extend_from_slice(&((entropy.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(entropy.len() as i32).to_ne_bytes());
    info.extend_from_slice(entropy);
    info.resize(8 + entropy.len().div_ceil(4) * 4, 0);
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    // SAFETY: the buffer is a rand_pool_info of the length it declares.
    cvt(unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) })?;
    // SAFETY: no argument.
    cvt(unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG, 0) })?;
    Ok(())
}
