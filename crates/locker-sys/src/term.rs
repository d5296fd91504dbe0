//! Terminals: the local one of `locker shell` (raw mode, window size, signals as readable
//! bytes) and the pseudo-terminals the agent gives commands.
//!
//! Raw mode is held by a guard ([`RawMode`]) whose `Drop` puts the saved settings back, so
//! the terminal is restored on every way out of the shell loop: a normal end, an error
//! returned with `?`, a panic (the release profile unwinds), and SIGTERM/SIGHUP, which
//! [`Signals`] turns into bytes the loop reads and ends on, instead of killing the process
//! with the terminal still raw.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::check_int;
use std::sync::atomic::{AtomicI32, Ordering};

/// The terminal settings saved on entering raw mode; put back when dropped.
pub struct RawMode {
    fd: RawFd,
    saved: libc::termios,
}

impl RawMode {
    /// Puts the terminal on `fd` in raw mode: no echo, no line editing, no signals from
    /// Ctrl-C/Ctrl-Z (those bytes go to the sandbox's terminal instead).
    pub fn enter(fd: RawFd) -> io::Result<RawMode> {
        // SAFETY: termios is plain old data; an all-zero value is a valid buffer for
        // tcgetattr to fill.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid, writable termios for the duration of the call.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut raw = saved;
        // SAFETY: `raw` is a valid termios, which cfmakeraw only edits in place.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: `raw` is a valid termios that outlives the call.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(RawMode { fd, saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: `saved` is the termios tcgetattr filled for this same fd.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}

/// The size of the terminal on `fd` as (columns, rows), if it is a terminal.
pub fn window_size(fd: RawFd) -> Option<(u16, u16)> {
    // SAFETY: winsize is plain old data; all-zero is a valid value.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes one winsize into the pointer, which is valid and writable.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_col > 0 && ws.ws_row > 0).then_some((ws.ws_col, ws.ws_row))
}

/// What a signal delivered to [`Signals`] asks for.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    /// The window changed size (SIGWINCH).
    pub resized: bool,
    /// The process was asked to end (SIGTERM, SIGHUP).
    pub terminate: bool,
}

/// The write end of the self-pipe, for the signal handler; -1 when none is installed.
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(sig: libc::c_int) {
    let fd = SIGNAL_PIPE.load(Ordering::Relaxed);
    if fd < 0 {
        return;
    }
    let byte: u8 = if sig == libc::SIGWINCH { b'W' } else { b'T' };
    // SAFETY: errno is thread-local and __errno_location always returns a valid pointer;
    // write(2) is async-signal-safe and the byte outlives the call. errno is saved and
    // restored so the interrupted code does not see the handler's. A full pipe drops the
    // byte, which is harmless: one pending byte already wakes the loop.
    unsafe {
        let errno = *libc::__errno_location();
        libc::write(fd, (&byte as *const u8).cast(), 1);
        *libc::__errno_location() = errno;
    }
}

/// SIGWINCH, SIGTERM and SIGHUP as bytes on a pipe that `poll` can wait on together with
/// the terminal and the socket (the self-pipe trick). Dropping it puts the default
/// handlers back.
pub struct Signals {
    read: OwnedFd,
    /// Held open for the handler, which writes to it by its raw number.
    _write: OwnedFd,
}

const HANDLED: [libc::c_int; 3] = [libc::SIGWINCH, libc::SIGTERM, libc::SIGHUP];

impl Signals {
    /// Installs the handlers. Only one `Signals` may exist at a time.
    pub fn install() -> io::Result<Signals> {
        let (read, write) = crate::fd::pipe_with(libc::O_NONBLOCK)?;
        SIGNAL_PIPE.store(write.as_raw_fd(), Ordering::Relaxed);
        for sig in HANDLED {
            // SAFETY: sigaction is plain old data (all-zero is valid); the handler is an
            // `extern "C" fn(c_int)` that only does async-signal-safe work.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        Ok(Signals {
            read,
            _write: write,
        })
    }

    /// The descriptor to poll for readability.
    pub fn fd(&self) -> RawFd {
        self.read.as_raw_fd()
    }

    /// Reads every pending signal byte.
    pub fn take(&self) -> Pending {
        let mut p = Pending::default();
        let mut buf = [0u8; 64];
        loop {
            match crate::fd::read(self.read.as_raw_fd(), &mut buf) {
                Ok(0) | Err(_) => return p,
                Ok(n) => {
                    for b in &buf[..n] {
                        match b {
                            b'W' => p.resized = true,
                            _ => p.terminate = true,
                        }
                    }
                }
            }
        }
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        for sig in HANDLED {
            // SAFETY: restoring the default disposition is always valid.
            unsafe { libc::signal(sig, libc::SIG_DFL) };
        }
        // The fields (and so the pipe) close after this body, once no handler can write.
        SIGNAL_PIPE.store(-1, Ordering::Relaxed);
    }
}

/// Runs `then(signal)` on a thread of its own when SIGINT, SIGTERM or SIGHUP arrives,
/// instead of their default of ending the process at once: for a command that lives on
/// the server beyond this process's connection, which must be told to end first. Call it
/// before starting other threads: they inherit the blocked signals, so only this thread
/// takes them.
pub fn on_interrupt(then: impl FnOnce(libc::c_int) + Send + 'static) -> io::Result<()> {
    // SAFETY: sigset_t is plain old data (all-zero is valid) and is initialised by
    // sigemptyset before use; pthread_sigmask only changes this thread's mask.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        set
    };
    std::thread::Builder::new()
        .name("interrupt".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is an initialised signal set and `sig` outlives the call.
            if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                then(sig);
            }
        })?;
    Ok(())
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
    check_int(unsafe {
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
    crate::fd::set_cloexec(m.as_raw_fd())?;
    crate::fd::set_cloexec(s.as_raw_fd())?;
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
    check_int(unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) }).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_arrive_as_pending_flags() {
        let s = Signals::install().unwrap();
        assert_eq!(s.take(), Pending::default());
        // SAFETY: raising a signal whose handler is installed just above.
        unsafe { libc::raise(libc::SIGWINCH) };
        let mut fds = [libc::pollfd {
            fd: s.fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        assert_eq!(crate::fd::poll(&mut fds, 1000).unwrap(), 1);
        assert_eq!(
            s.take(),
            Pending {
                resized: true,
                terminate: false
            }
        );
    }

    #[test]
    fn no_window_size_without_a_terminal() {
        let f = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(window_size(f.as_raw_fd()), None);
        assert!(RawMode::enter(f.as_raw_fd()).is_err());
    }
}
