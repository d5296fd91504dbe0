//! The agent's system calls, by the names its rooms use.
//!
//! Every call is written once, with the invariant its `unsafe` relies on, in `locker-sys`
//! (which the static agent links like any crate: it depends on `libc` alone); this module
//! re-exports the ones the agent makes and adapts a few to the agent's idiom. Functions
//! return `io::Result` with the OS error intact; the callers decide what an error means for
//! the host.
//!
//! What stays here is the code that runs between `fork` and `exec` ([`spawn`], which clones
//! a command straight into its cgroup v2 where it can, [`child_setup`] and their helpers).
//! It must be async-signal-safe (no allocation, no lock: the forked child of a
//! multi-threaded agent may find the allocator's lock held by a thread that no longer
//! exists), and that is a property of the whole sequence and of the [`ChildPlan`] built
//! for it in the parent, not of any one call; so the sequence is kept whole, beside its
//! plan, with raw `libc` calls that visibly allocate nothing, rather than spread over
//! `locker-sys` helpers that are free to allocate (their errors, their `CString`s).

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

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

/// Runs in the forked child before `exec`: keep stray fds from the command, join the cgroups
/// (when `join`: a child cloned into its cgroup is there already),
/// start a new session (and so a new process group), take the terminal, drop to the user,
/// enter the working directory, reset signal dispositions.
///
/// Async-signal-safe: only system calls on data prepared in the parent.
pub fn child_setup(plan: &ChildPlan, join: bool) -> io::Result<()> {
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
    for &fd in plan.cgroup_procs.iter().filter(|_| join) {
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
        // The raw system calls: glibc's wrappers make every thread of the process change
        // ids together (signalling each under a lock of its thread list), and a child
        // cloned with the raw clone3 is one thread whose copy of that list and lock is the
        // parent's as it was (fork's handlers, which reset them, do not run for it). The
        // kernel's calls change this thread's ids, which here are the process's.
        // SAFETY: the groups vector was built in the parent and is only read here.
        let r = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
        cvt(r as libc::c_int)?;
        // SAFETY: integer arguments only.
        cvt(unsafe { libc::syscall(libc::SYS_setgid, *gid) } as libc::c_int)?;
        // SAFETY: integer arguments only.
        cvt(unsafe { libc::syscall(libc::SYS_setuid, *uid) } as libc::c_int)?;
    }
    // SAFETY: cwd is NUL-terminated and owned by the plan, alive for the call.
    cvt(unsafe { libc::chdir(plan.cwd.as_ptr()) })?;
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

/// Where a command's fds 0, 1 and 2 come from.
pub enum ChildStdio {
    /// Pipes to the agent for stdout and stderr, and for stdin when `stdin` (else
    /// `/dev/null`).
    Pipes { stdin: bool },
    /// A terminal's slave end for all three.
    Tty(OwnedFd),
}

/// A started command: its pid and the agent's ends of its pipes.
pub struct Spawned {
    pub pid: i32,
    pub stdin: Option<OwnedFd>,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
}

/// Set once `clone3(CLONE_INTO_CGROUP)` was refused here (a jail's seccomp policy answers
/// clone3 ENOSYS; kernels before 5.7 do not have it): commands are then forked and join.
static NO_CLONE_INTO: AtomicBool = AtomicBool::new(false);

extern "C" {
    /// The C library's environment, which `execvp` searches `PATH` in.
    static mut environ: *const *const libc::c_char;
}

/// Starts `argv` with exactly the environment `env`, set up by `plan` ([`child_setup`]).
/// Given the descriptor of its cgroup v2 directory, the child is cloned into that cgroup
/// (`clone3(CLONE_INTO_CGROUP)`: no move, so no wait on the kernel's cgroup lock); else, or
/// where clone3 is refused, it is forked and joins through `plan.cgroup_procs`. The program
/// is found as `execvp` finds it, in `env`'s `PATH`. An error is the exec's (a missing
/// program: `NotFound`), after the child is reaped; call under the reaper's lock.
pub fn spawn(
    argv: &[String],
    env: &[(String, String)],
    stdio: ChildStdio,
    plan: &ChildPlan,
    cgroup: Option<RawFd>,
) -> io::Result<Spawned> {
    let nul = |_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the command");
    let args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()).map_err(nul))
        .collect::<io::Result<_>>()?;
    let vars: Vec<CString> = env
        .iter()
        .map(|(k, v)| CString::new(format!("{k}={v}")).map_err(nul))
        .collect::<io::Result<_>>()?;
    if args.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "an empty command",
        ));
    }
    let mut argp: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argp.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = vars.iter().map(|v| v.as_ptr()).collect();
    envp.push(std::ptr::null());

    // The child's ends are numbered 3 and up, so putting them at 0, 1 and 2 never
    // overwrites one not yet placed.
    let above = |fd: OwnedFd| locker_sys::proc::dup_above(fd.as_raw_fd(), 3);
    let pipe = || -> io::Result<(OwnedFd, OwnedFd)> {
        let (r, w) = locker_sys::fd::pipe()?;
        Ok((above(r)?, above(w)?))
    };
    let (mut ours_in, mut ours_out, mut ours_err) = (None, None, None);
    let theirs: [OwnedFd; 3] = match stdio {
        ChildStdio::Tty(slave) => {
            let slave = above(slave)?;
            [slave.try_clone()?, slave.try_clone()?, slave]
        }
        ChildStdio::Pipes { stdin } => {
            let child_in = if stdin {
                let (r, w) = pipe()?;
                ours_in = Some(w);
                r
            } else {
                above(OwnedFd::from(
                    std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open("/dev/null")?,
                ))?
            };
            let (out_r, out_w) = pipe()?;
            let (err_r, err_w) = pipe()?;
            ours_out = Some(out_r);
            ours_err = Some(err_r);
            [child_in, out_w, err_w]
        }
    };
    let (report_r, report_w) = locker_sys::fd::pipe()?;
    let fds = [
        theirs[0].as_raw_fd(),
        theirs[1].as_raw_fd(),
        theirs[2].as_raw_fd(),
    ];

    let mut cloned_in = false;
    let mut pid = None;
    if let Some(dir) = cgroup.filter(|_| !NO_CLONE_INTO.load(Ordering::Relaxed)) {
        // SAFETY: the child runs `child_main` only: async-signal-safe calls on data made
        // above, then exec or _exit.
        match unsafe { locker_sys::proc::fork_into_cgroup(dir) } {
            Ok(p) => {
                cloned_in = true;
                pid = Some(p);
            }
            Err(e) => {
                if matches!(
                    e.raw_os_error(),
                    Some(
                        libc::ENOSYS | libc::EINVAL | libc::E2BIG | libc::EPERM | libc::EOPNOTSUPP
                    )
                ) {
                    NO_CLONE_INTO.store(true, Ordering::Relaxed);
                }
            }
        }
    }
    let pid = match pid {
        Some(p) => p,
        // SAFETY: as above; glibc's fork handlers keep its own state sound in the child.
        None => cvt(unsafe { libc::fork() })?,
    };
    if pid == 0 {
        child_main(&fds, plan, !cloned_in, &argp, &envp, report_w.as_raw_fd());
    }
    drop(theirs);
    drop(report_w);
    // Nothing before EOF: the exec happened (the descriptor closed with it). Else the
    // child's errno, 4 bytes.
    let mut report = Vec::new();
    let _ = io::Read::read_to_end(&mut std::fs::File::from(report_r), &mut report);
    if report.is_empty() {
        return Ok(Spawned {
            pid,
            stdin: ours_in,
            stdout: ours_out,
            stderr: ours_err,
        });
    }
    // The exec failed: the child said why and exits; reap it here (the caller holds the
    // reaper's lock, so the reaper cannot take it first).
    let _ = locker_sys::proc::waitpid(pid);
    Err(match <[u8; 4]>::try_from(report) {
        Ok(errno) => io::Error::from_raw_os_error(i32::from_ne_bytes(errno)),
        Err(_) => io::Error::other("the command's child ended before it could exec"),
    })
}

/// The child's side of [`spawn`]: stdio in place, [`child_setup`], then `execvp`; on any
/// failure the errno goes to `report` and the child exits 127. Async-signal-safe.
fn child_main(
    fds: &[RawFd; 3],
    plan: &ChildPlan,
    join: bool,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    report: RawFd,
) -> ! {
    let fail = |e: io::Error| -> ! {
        let errno = e.raw_os_error().unwrap_or(libc::EIO).to_ne_bytes();
        // SAFETY: writes 4 bytes from a live buffer; then leaves without unwinding or
        // running the parent's exit handlers.
        unsafe {
            libc::write(report, errno.as_ptr().cast(), 4);
            libc::_exit(127)
        }
    };
    // Signals blocked in the spawning thread stay blocked across exec: unblock them all.
    let empty = 0u64;
    // SAFETY: an 8-byte kernel sigset, no old set asked for.
    unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &empty as *const u64,
            std::ptr::null_mut::<u64>(),
            8,
        )
    };
    for (to, &from) in fds.iter().enumerate() {
        // SAFETY: integer arguments only; `from` is open (3 or above), `to` is 0, 1 or 2.
        if unsafe { libc::dup2(from, to as RawFd) } < 0 {
            fail(io::Error::last_os_error());
        }
    }
    if let Err(e) = child_setup(plan, join) {
        fail(e);
    }
    // SAFETY: `envp` and `argv` are NULL-terminated arrays of live C strings, made before
    // the fork; `environ` is this child's alone, and execvp reads PATH from it.
    unsafe {
        environ = envp.as_ptr();
        libc::execvp(argv[0], argv.as_ptr());
    }
    fail(io::Error::last_os_error())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn plan() -> ChildPlan {
        ChildPlan {
            cgroup_procs: Vec::new(),
            controlling_tty: false,
            user: None,
            cwd: CString::new("/").unwrap(),
            reset_oom: false,
            cpus: None,
        }
    }

    fn output(s: Spawned) -> String {
        let mut out = String::new();
        std::fs::File::from(s.stdout.unwrap())
            .read_to_string(&mut out)
            .unwrap();
        let _ = locker_sys::proc::waitpid(s.pid);
        out
    }

    /// Given a cgroup v2 directory and no `cgroup.procs` to write, the child can only be in
    /// that cgroup if it was cloned there (`CLONE_INTO_CGROUP`). On a hybrid host the v2
    /// hierarchy is `unified`, without controllers: enough for membership.
    #[test]
    fn a_command_starts_in_its_cgroup_v2_without_moving_there() {
        let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
            .iter()
            .map(std::path::Path::new)
            .find(|p| p.join("cgroup.controllers").exists())
            .expect("no cgroup v2 hierarchy on this host");
        let name = format!("locker-agent-spawn-test-{}", std::process::id());
        let dir = root.join(&name);
        std::fs::create_dir(&dir).unwrap();
        let fd = OwnedFd::from(std::fs::File::open(&dir).unwrap());
        let argv = [
            "sh".to_owned(),
            "-c".to_owned(),
            "cat /proc/self/cgroup; echo $FOO".to_owned(),
        ];
        let env = [
            ("PATH".to_owned(), "/usr/bin:/bin".to_owned()),
            ("FOO".to_owned(), "bar".to_owned()),
        ];
        let s = spawn(
            &argv,
            &env,
            ChildStdio::Pipes { stdin: false },
            &plan(),
            Some(fd.as_raw_fd()),
        )
        .unwrap();
        let out = output(s);
        let _ = std::fs::remove_dir(&dir);
        assert!(
            out.lines()
                .any(|l| l.starts_with("0::/") && l.ends_with(&name)),
            "{out}"
        );
        assert!(out.ends_with("bar\n"), "{out}");

        // Without a cgroup: forked, where the agent is; a missing program is NotFound.
        let out = output(
            spawn(
                &argv,
                &env,
                ChildStdio::Pipes { stdin: false },
                &plan(),
                None,
            )
            .unwrap(),
        );
        assert!(!out.contains(&name), "{out}");
        let e = spawn(
            &["no-such-program-here".to_owned()],
            &env,
            ChildStdio::Pipes { stdin: false },
            &plan(),
            None,
        )
        .err()
        .unwrap();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    }
}
