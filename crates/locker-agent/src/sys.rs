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
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
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

/// Arranges for `cmd`'s child to run [`child_setup`] with `plan` between fork and exec.
pub fn set_child_setup(cmd: &mut std::process::Command, plan: ChildPlan) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure only calls `child_setup`, which is async-signal-safe: it makes
    // system calls on data prepared before the fork, allocates nothing and takes no locks.
    unsafe {
        cmd.pre_exec(move || child_setup(&plan));
    }
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
