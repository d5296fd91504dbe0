//! The system calls of this room, by the names its ops use. Paths are single components
//! checked by the caller, or fixed host paths; fds are borrowed for the call.
//!
//! The calls themselves, and their `unsafe`, live in `locker-sys`; what stays here is this
//! room's policy on top of them: how strictly a guest's name is resolved
//! ([`open_beneath`]) and which owners a guest may give a file ([`chown`]).

use std::ffi::CStr;
use std::io;
use std::os::fd::{OwnedFd, RawFd};

pub use locker_sys::fd::{
    chmod_via_proc, copy_file_range, fallocate, fchmod, fsync, getdents64, link_fd, mkdirat,
    open_dir_path as open_dir, renameat2, reopen, seek, symlinkat, unlinkat,
};

/// `openat2(dir, name, flags | O_CLOEXEC, mode)` that stays beneath `dir`, crosses no
/// mount and follows no symlink of any kind; plain `openat` with `O_NOFOLLOW` where the
/// kernel has no openat2 (`name` is one component, so that is as strict but for mounts).
pub fn open_beneath(dir: RawFd, name: &CStr, flags: libc::c_int, mode: u32) -> io::Result<OwnedFd> {
    let resolve = libc::RESOLVE_BENEATH
        | libc::RESOLVE_NO_SYMLINKS
        | libc::RESOLVE_NO_MAGICLINKS
        | libc::RESOLVE_NO_XDEV;
    match locker_sys::fd::openat2(dir, name, flags, mode, resolve) {
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            locker_sys::fd::openat(dir, name, flags | libc::O_NOFOLLOW, mode)
        }
        r => r,
    }
}

/// `fstatat(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`: works on `O_PATH` fds.
pub fn stat(fd: RawFd) -> io::Result<libc::stat> {
    locker_sys::fd::lstatat(fd, c"")
}

/// `fstatvfs` (works on `O_PATH` fds).
pub fn statvfs(fd: RawFd) -> io::Result<libc::statvfs> {
    locker_sys::fd::fstatvfs(fd)
}

/// The owner of the inode behind an `O_PATH` fd itself (a symlink stays unfollowed);
/// `u32::MAX` leaves an id as it is. Ids of 65536 and above are refused (`EOVERFLOW`, as
/// an id-mapped mount does): a volume holds canonical ids, which a jail maps from
/// 0..65536 only, and the host's own ids above that are machines' uid ranges.
pub fn chown(fd: RawFd, uid: u32, gid: u32) -> io::Result<()> {
    if [uid, gid].iter().any(|&id| id != u32::MAX && id >= 1 << 16) {
        return Err(io::Error::from_raw_os_error(libc::EOVERFLOW));
    }
    locker_sys::fd::fchown_empty(fd, uid, gid)
}

/// `utimensat(fd, "", times, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`.
pub fn set_times(fd: RawFd, times: &[libc::timespec; 2]) -> io::Result<()> {
    locker_sys::fd::set_times_at(fd, c"", times)
}

/// The target of the symlink behind the `O_PATH` fd `fd`.
pub fn readlink(fd: RawFd) -> io::Result<Vec<u8>> {
    locker_sys::fd::readlinkat(fd, c"")
}
