//! Facts and settings of the host (or the guest) as a whole: the effective uid, memory,
//! the hostname, the wall clock.

use std::io;

use crate::check_int;

/// The effective uid of this process (`geteuid(2)`).
pub fn geteuid() -> u32 {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    geteuid() == 0
}

/// The memory of the kernel this runs on: (total, free) bytes, from `sysinfo(2)`.
pub fn memory() -> Option<(u64, u64)> {
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

/// `sethostname(2)` in the caller's UTS namespace.
pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: pointer and length describe `name`'s bytes.
    check_int(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
}

/// Sets the wall clock (`CLOCK_REALTIME`) to `unix_ns` nanoseconds since the epoch.
pub fn set_realtime(unix_ns: u64) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: (unix_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (unix_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: a valid timespec, alive for the call.
    check_int(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) })
}

/// Flushes every filesystem (`sync(2)`).
pub fn sync() {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::sync() }
}

/// Flushes every filesystem and powers the machine off (`reboot(RB_POWER_OFF)`); returns
/// only on failure (not PID 1 of a namespace that may, no `CAP_SYS_BOOT`).
pub fn power_off() -> io::Error {
    sync();
    // SAFETY: an integer argument; on success the kernel never returns.
    unsafe { libc::reboot(libc::RB_POWER_OFF) };
    io::Error::last_os_error()
}

/// Loads the kernel module in `file` (`finit_module(2)`, no parameters); `EEXIST` if it
/// is loaded already or built in.
pub fn load_module(file: &std::fs::File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: an open fd and an empty, static parameter string.
    crate::check(unsafe {
        libc::syscall(libc::SYS_finit_module, file.as_raw_fd(), c"".as_ptr(), 0)
    })
    .map(drop)
}
