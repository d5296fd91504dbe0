//! The system calls of this room, each with its invariant. Paths are single components
//! checked by the caller, or fixed host paths; fds are borrowed for the call.

use std::ffi::{CStr, CString};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn check_int(rc: libc::c_int) -> io::Result<()> {
    check(rc.into()).map(drop)
}

fn owned(rc: libc::c_long) -> io::Result<OwnedFd> {
    let fd = check(rc)? as RawFd;
    // SAFETY: the kernel just returned `fd`, a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens a host directory (an export's root, `/proc/self/fd`) as an `O_PATH` fd.
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    let p = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC;
    // SAFETY: `p` is a NUL-terminated string alive for the call.
    owned(unsafe { libc::open(p.as_ptr(), flags) }.into())
}

/// `openat2(dir, name, flags | O_CLOEXEC, mode)` that stays beneath `dir`, crosses no
/// mount and follows no symlink of any kind; plain `openat` with `O_NOFOLLOW` where the
/// kernel has no openat2 (`name` is one component, so that is as strict but for mounts).
pub fn open_beneath(dir: RawFd, name: &CStr, flags: libc::c_int, mode: u32) -> io::Result<OwnedFd> {
    let mut how: libc::open_how = unsafe_zeroed_how();
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = if flags & libc::O_CREAT != 0 {
        u64::from(mode)
    } else {
        0
    };
    how.resolve = libc::RESOLVE_BENEATH
        | libc::RESOLVE_NO_SYMLINKS
        | libc::RESOLVE_NO_MAGICLINKS
        | libc::RESOLVE_NO_XDEV;
    let call = || {
        // SAFETY: `name` is NUL-terminated and `how` a valid open_how of the size passed.
        owned(unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir,
                name.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        })
    };
    // EAGAIN: a concurrent rename made the kernel unsure the walk stayed beneath; the
    // walk is one component, so a retry settles it.
    let mut r = call();
    for _ in 0..3 {
        match &r {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => r = call(),
            _ => break,
        }
    }
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            let flags = flags | libc::O_CLOEXEC | libc::O_NOFOLLOW;
            // SAFETY: as above; `mode` is read only with O_CREAT.
            owned(unsafe { libc::openat(dir, name.as_ptr(), flags, mode) }.into())
        }
        r => r,
    }
}

fn unsafe_zeroed_how() -> libc::open_how {
    // SAFETY: open_how is plain integers, for which all zeroes is valid.
    unsafe { std::mem::zeroed() }
}

/// Opens the file behind `fd` anew with `flags`, through `/proc/self/fd/<fd>` (opened
/// as `proc`): how an `O_PATH` fd becomes one for I/O. Callers check the file type
/// first: this follows the magic link to whatever `fd` is.
pub fn reopen(proc: RawFd, fd: RawFd, flags: libc::c_int) -> io::Result<OwnedFd> {
    let name = CString::new(fd.to_string()).expect("digits");
    // SAFETY: `name` is NUL-terminated; no mode is read without O_CREAT.
    owned(unsafe { libc::openat(proc, name.as_ptr(), flags | libc::O_CLOEXEC) }.into())
}

/// `fstatat(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`: works on `O_PATH` fds.
pub fn stat(fd: RawFd) -> io::Result<libc::stat> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    let flags = libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW;
    // SAFETY: `st` is writable for a stat; the path is an empty NUL-terminated string.
    check_int(unsafe { libc::fstatat(fd, c"".as_ptr(), st.as_mut_ptr(), flags) })?;
    // SAFETY: fstatat succeeded, so it filled `st`.
    Ok(unsafe { st.assume_init() })
}

/// `fstatvfs` (works on `O_PATH` fds).
pub fn statvfs(fd: RawFd) -> io::Result<libc::statvfs> {
    let mut st = MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `st` is writable for a statvfs.
    check_int(unsafe { libc::fstatvfs(fd, st.as_mut_ptr()) })?;
    // SAFETY: fstatvfs succeeded, so it filled `st`.
    Ok(unsafe { st.assume_init() })
}

/// `fchownat(fd, "", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`: the inode of an
/// `O_PATH` fd itself (a symlink stays unfollowed); `u32::MAX` leaves an id as it is.
/// Ids of 65536 and above are refused (`EOVERFLOW`, as an id-mapped mount does): a
/// volume holds canonical ids, which a jail maps from 0..65536 only, and the host's
/// own ids above that are machines' uid ranges.
pub fn chown(fd: RawFd, uid: u32, gid: u32) -> io::Result<()> {
    if [uid, gid].iter().any(|&id| id != u32::MAX && id >= 1 << 16) {
        return Err(io::Error::from_raw_os_error(libc::EOVERFLOW));
    }
    let flags = libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW;
    // SAFETY: integers and an empty NUL-terminated path.
    check_int(unsafe { libc::fchownat(fd, c"".as_ptr(), uid, gid, flags) })
}

/// chmod of the inode behind an `O_PATH` fd, through its `/proc/self/fd` link (chmod of
/// a node opens nothing, whatever its type).
pub fn chmod_via_proc(proc: RawFd, fd: RawFd, mode: u32) -> io::Result<()> {
    let name = CString::new(fd.to_string()).expect("digits");
    // SAFETY: `name` is NUL-terminated; integers otherwise.
    check_int(unsafe { libc::fchmodat(proc, name.as_ptr(), mode, 0) })
}

/// `fchmod` of an fd open for I/O.
pub fn fchmod(fd: RawFd, mode: u32) -> io::Result<()> {
    // SAFETY: integers only.
    check_int(unsafe { libc::fchmod(fd, mode) })
}

/// `utimensat(fd, "", times, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`.
pub fn set_times(fd: RawFd, times: &[libc::timespec; 2]) -> io::Result<()> {
    let flags = libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW;
    // SAFETY: `times` points at two timespecs; the path is an empty string.
    check_int(unsafe { libc::utimensat(fd, c"".as_ptr(), times.as_ptr(), flags) })
}

pub fn mkdirat(dir: RawFd, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated.
    check_int(unsafe { libc::mkdirat(dir, name.as_ptr(), mode) })
}

pub fn symlinkat(target: &CStr, dir: RawFd, name: &CStr) -> io::Result<()> {
    // SAFETY: both strings are NUL-terminated.
    check_int(unsafe { libc::symlinkat(target.as_ptr(), dir, name.as_ptr()) })
}

pub fn unlinkat(dir: RawFd, name: &CStr, flags: libc::c_int) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated.
    check_int(unsafe { libc::unlinkat(dir, name.as_ptr(), flags) })
}

pub fn renameat2(from: RawFd, old: &CStr, to: RawFd, new: &CStr, flags: u32) -> io::Result<()> {
    // SAFETY: both names are NUL-terminated; integers otherwise.
    check(unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            from,
            old.as_ptr(),
            to,
            new.as_ptr(),
            flags,
        )
    })
    .map(drop)
}

/// A new name `name` under `dir` for the inode behind the `O_PATH` fd `fd`, through
/// its `/proc/self/fd` entry (`AT_EMPTY_PATH` would need `CAP_DAC_READ_SEARCH`, which
/// also opens files by handle: the server does not keep it). A symlink's fd links the
/// symlink itself.
pub fn link_fd(proc_fd: RawFd, fd: RawFd, dir: RawFd, name: &CStr) -> io::Result<()> {
    let n = CString::new(fd.to_string()).expect("digits");
    // SAFETY: both paths are NUL-terminated strings.
    check_int(unsafe {
        libc::linkat(
            proc_fd,
            n.as_ptr(),
            dir,
            name.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    })
}

/// The target of the symlink behind the `O_PATH` fd `fd`.
pub fn readlink(fd: RawFd) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    // SAFETY: `buf` is writable for its length; the path is an empty string.
    let n = unsafe { libc::readlinkat(fd, c"".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    buf.truncate(check(n as libc::c_long)? as usize);
    Ok(buf)
}

pub fn seek(fd: RawFd, offset: i64, whence: libc::c_int) -> io::Result<u64> {
    // SAFETY: integers only.
    check(unsafe { libc::lseek(fd, offset, whence) }).map(|o| o as u64)
}

/// One `getdents64` into `buf`; 0 at the end of the directory.
pub fn getdents64(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is writable for its length.
    check(unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len()) })
        .map(|n| n as usize)
}

pub fn fsync(fd: RawFd) -> io::Result<()> {
    // SAFETY: integers only.
    check_int(unsafe { libc::fsync(fd) })
}

pub fn fallocate(fd: RawFd, mode: libc::c_int, offset: i64, len: i64) -> io::Result<()> {
    // SAFETY: integers only.
    check_int(unsafe { libc::fallocate(fd, mode, offset, len) })
}

pub fn copy_file_range(
    from: RawFd,
    off_in: i64,
    to: RawFd,
    off_out: i64,
    len: usize,
) -> io::Result<usize> {
    let (mut a, mut b) = (off_in, off_out);
    // SAFETY: the offsets are our own locals, updated by the kernel.
    let n = unsafe { libc::copy_file_range(from, &mut a, to, &mut b, len, 0) };
    check(n as libc::c_long).map(|n| n as usize)
}
