//! Locker's system calls, each wrapped once, with the invariant its `unsafe` relies on.
//!
//! Owns: every raw system call and `ioctl` that the runtime, the agent and the CLI make, and
//! the few file helpers every crate needs exactly once (atomic writes, synced directories,
//! tree removal, random bytes and ids, hex). Callers get `io::Result` with the OS error
//! intact and add what step failed; the policy (which flags, which retries, what an error
//! means for a machine) stays with them. It must not know machines, sandboxes, HTTP or
//! templates, and it depends on `libc` alone.
//!
//! Why `libc` and not `rustix`: rustix's safe wrappers would remove most of the `unsafe`
//! here, but every call below is a thin, already-audited wrapper (each block has its
//! `// SAFETY:` note, enforced by the workspace's `undocumented_unsafe_blocks` lint), and
//! several have no safe wrapper in rustix (`LOOP_CONFIGURE`, the btrfs snapshot ioctls,
//! `RNDADDENTROPY`, `SIOCADDRT`, `FS_IOC_SETFLAGS`, the raw `rt_sigaction` between fork and
//! exec): they would stay `unsafe` through its generic `ioctl` escape. So rustix would add a
//! second way to make system calls rather than replace the first, and a large dependency
//! (tens of thousands of lines with its raw-syscall backend) that every build here, the
//! static agent's `+crt-static` one included, compiles on a shared 2-core host. One small crate on `libc` keeps
//! the agent's dependency list as it was (`libc` was already there) and puts the unsafe in
//! one place that a reviewer reads end to end.
//!
//! Modules by concern:
//! - [`mount`]: mount, bind, id-mapped trees, unmount, pivot;
//! - [`fd`]: `openat2` and the `*at` calls on directory fds, stat, read, poll;
//! - [`fs`]: path-level helpers: [`fs::write_atomic`], [`fs::fsync_dir`],
//!   [`fs::remove_tree`], `flock`, `syncfs`, times, the filesystem type;
//! - [`xattr`]: extended attributes of a path itself (symlinks not followed);
//! - [`ioctl`]: `FICLONE` reflinks, `chattr +T`, loop devices, btrfs snapshots;
//! - [`net`]: interface addresses, flags and the default route, by `ioctl`;
//! - [`proc`]: processes: namespaces, fork/wait/kill, capabilities, exec, CPU sets;
//! - [`host`]: the hostname, the clock, memory, the effective uid;
//! - [`random`]: the kernel's random bytes, ids, entropy for a restored guest;
//! - [`term`]: terminals: raw mode, window size, pseudo-terminals, signals as bytes;
//! - [`hex`]: lowercase hexadecimal, both ways.

use std::ffi::CString;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub mod fd;
pub mod fs;
pub mod hex;
pub mod host;
pub mod ioctl;
pub mod mount;
pub mod net;
pub mod proc;
pub mod random;
pub mod term;
pub mod xattr;

/// `Err(errno)` for a negative return, else the value.
pub(crate) fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// [`check`] for calls that return an `int` and nothing worth keeping.
pub(crate) fn check_int(rc: libc::c_int) -> io::Result<()> {
    check(rc.into()).map(drop)
}

/// Takes ownership of the descriptor a successful call returned.
pub(crate) fn owned(rc: libc::c_long) -> io::Result<OwnedFd> {
    let fd = check(rc)? as RawFd;
    // SAFETY: the kernel just returned `fd`, a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A path as a C string; a path with a NUL byte is `InvalidInput`.
pub(crate) fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// A string as a C string; one with a NUL byte is `InvalidInput`.
pub(crate) fn cstring(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}
