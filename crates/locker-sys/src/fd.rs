//! Calls on descriptors: `openat2` and the other `*at` calls relative to a directory fd,
//! stat, reads, `poll`, descriptor flags. Paths are `&CStr` the caller made (usually one
//! checked component); fds are borrowed for the call unless a function says it consumes one.

use std::ffi::{CStr, CString};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd};

use crate::{check, check_int, owned};

/// `openat2(2)`: `path` opened relative to `dir` with `flags | O_CLOEXEC` (and `mode` when
/// creating) under the `RESOLVE_*` rules in `resolve`. `EAGAIN` (a concurrent rename or
/// mount made the kernel unsure the walk kept to the rules) is retried a few times.
pub fn openat2(
    dir: RawFd,
    path: &CStr,
    flags: libc::c_int,
    mode: u32,
    resolve: u64,
) -> io::Result<OwnedFd> {
    // SAFETY: open_how is a plain C struct of integers; all-zero is a valid value.
    let mut how: libc::open_how = unsafe { MaybeUninit::zeroed().assume_init() };
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
        let r = owned(unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir,
                path.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        });
        match r {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && tries < 16 => tries += 1,
            r => return r,
        }
    }
}

/// [`openat2`] with `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`: `path` (relative) is resolved
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

/// [`openat2`] with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`: `path` (relative) must stay
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

/// `openat(2)` relative to a directory fd, always close-on-exec.
pub fn openat(dir: RawFd, name: &CStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: `name` is NUL-terminated; mode is passed as the variadic argument openat expects.
    owned(
        unsafe {
            libc::openat(
                dir,
                name.as_ptr(),
                flags | libc::O_CLOEXEC,
                mode as libc::c_uint,
            )
        }
        .into(),
    )
}

/// Opens a host directory as an `O_PATH` fd (a root to resolve beneath, `/proc/self/fd`).
pub fn open_dir_path(path: &std::path::Path) -> io::Result<OwnedFd> {
    let p = crate::cstr(path)?;
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC;
    // SAFETY: `p` is a NUL-terminated string alive for the call.
    owned(unsafe { libc::open(p.as_ptr(), flags) }.into())
}

/// Opens the file behind `fd` anew with `flags`, through `/proc/self/fd/<fd>` (opened
/// as `proc`): how an `O_PATH` fd becomes one for I/O. Callers check the file type
/// first: this follows the magic link to whatever `fd` is.
pub fn reopen(proc: RawFd, fd: RawFd, flags: libc::c_int) -> io::Result<OwnedFd> {
    let name = fd_name(fd);
    // SAFETY: `name` is NUL-terminated; no mode is read without O_CREAT.
    owned(unsafe { libc::openat(proc, name.as_ptr(), flags | libc::O_CLOEXEC) }.into())
}

/// The name of `fd` in `/proc/self/fd`.
fn fd_name(fd: RawFd) -> CString {
    CString::new(fd.to_string()).expect("digits have no NUL")
}

/// `fstat(2)`.
pub fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: the kernel fills `st` on success, which is the only case we read it.
    check_int(unsafe { libc::fstat(fd, st.as_mut_ptr()) })?;
    // SAFETY: initialized by the successful call above.
    Ok(unsafe { st.assume_init() })
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`; an empty `name` adds `AT_EMPTY_PATH`, which
/// stats `dir` itself, `O_PATH` fds included.
pub fn lstatat(dir: RawFd, name: &CStr) -> io::Result<libc::stat> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    let mut flags = libc::AT_SYMLINK_NOFOLLOW;
    if name.is_empty() {
        flags |= libc::AT_EMPTY_PATH;
    }
    // SAFETY: the kernel fills `st` on success; `name` is NUL-terminated.
    check_int(unsafe { libc::fstatat(dir, name.as_ptr(), st.as_mut_ptr(), flags) })?;
    // SAFETY: initialized by the successful call above.
    Ok(unsafe { st.assume_init() })
}

/// `fstatvfs(3)` (works on `O_PATH` fds).
pub fn fstatvfs(fd: RawFd) -> io::Result<libc::statvfs> {
    let mut st = MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `st` is writable for a statvfs.
    check_int(unsafe { libc::fstatvfs(fd, st.as_mut_ptr()) })?;
    // SAFETY: fstatvfs succeeded, so it filled `st`.
    Ok(unsafe { st.assume_init() })
}

/// The filesystem type (`f_type` of `fstatfs(2)`) of the file `fd` is open on.
pub fn fs_type(fd: RawFd) -> io::Result<i64> {
    let mut st = MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: the kernel fills `st` on success, which is the only case we read it.
    check_int(unsafe { libc::fstatfs(fd, st.as_mut_ptr()) })?;
    // SAFETY: initialized by the successful call above.
    let st = unsafe { st.assume_init() };
    // `f_type`'s width differs between libcs and architectures.
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64)
}

/// `fchownat(fd, "", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`: the inode of an
/// `O_PATH` fd itself (a symlink stays unfollowed); `u32::MAX` leaves an id as it is.
pub fn fchown_empty(fd: RawFd, uid: u32, gid: u32) -> io::Result<()> {
    let flags = libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW;
    // SAFETY: integers and an empty NUL-terminated path.
    check_int(unsafe { libc::fchownat(fd, c"".as_ptr(), uid, gid, flags) })
}

/// chmod of the inode behind an `O_PATH` fd, through its `/proc/self/fd` link (chmod of
/// a node opens nothing, whatever its type).
pub fn chmod_via_proc(proc: RawFd, fd: RawFd, mode: u32) -> io::Result<()> {
    let name = fd_name(fd);
    // SAFETY: `name` is NUL-terminated; integers otherwise.
    check_int(unsafe { libc::fchmodat(proc, name.as_ptr(), mode, 0) })
}

/// `fchmod(2)` of an fd open for I/O.
pub fn fchmod(fd: RawFd, mode: u32) -> io::Result<()> {
    // SAFETY: integer arguments only.
    check_int(unsafe { libc::fchmod(fd, mode as libc::mode_t) })
}

/// `utimensat(dir, name, times, AT_SYMLINK_NOFOLLOW)`; an empty `name` adds
/// `AT_EMPTY_PATH` (the times of `dir` itself, an `O_PATH` fd included).
pub fn set_times_at(dir: RawFd, name: &CStr, times: &[libc::timespec; 2]) -> io::Result<()> {
    let mut flags = libc::AT_SYMLINK_NOFOLLOW;
    if name.is_empty() {
        flags |= libc::AT_EMPTY_PATH;
    }
    // SAFETY: `times` points at two timespecs; `name` is NUL-terminated.
    check_int(unsafe { libc::utimensat(dir, name.as_ptr(), times.as_ptr(), flags) })
}

/// `futimens(3)`: the times of the file `fd` is open on.
pub fn futimens(fd: RawFd, times: &[libc::timespec; 2]) -> io::Result<()> {
    // SAFETY: `times` holds the two timespecs futimens reads.
    check_int(unsafe { libc::futimens(fd, times.as_ptr()) })
}

/// `mkdirat(2)`.
pub fn mkdirat(dir: RawFd, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated.
    check_int(unsafe { libc::mkdirat(dir, name.as_ptr(), mode as libc::mode_t) })
}

/// `mkfifoat(3)`: a FIFO `name` in `dir` (the only special file image layers may hold).
pub fn mkfifoat(dir: RawFd, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated; integers otherwise.
    check_int(unsafe { libc::mkfifoat(dir, name.as_ptr(), mode as libc::mode_t) })
}

/// `symlinkat(2)`: `name` in `dir`, pointing at `target` (stored as given, never followed).
pub fn symlinkat(target: &CStr, dir: RawFd, name: &CStr) -> io::Result<()> {
    // SAFETY: both strings are NUL-terminated.
    check_int(unsafe { libc::symlinkat(target.as_ptr(), dir, name.as_ptr()) })
}

/// `unlinkat(2)`; `flags` is 0 or `AT_REMOVEDIR`.
pub fn unlinkat(dir: RawFd, name: &CStr, flags: libc::c_int) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated.
    check_int(unsafe { libc::unlinkat(dir, name.as_ptr(), flags) })
}

/// `renameat2(2)`; `flags` 0 is plain `renameat`.
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

/// `linkat(2)` without following a final symlink of `from`.
pub fn linkat(from_dir: RawFd, from: &CStr, to_dir: RawFd, to: &CStr) -> io::Result<()> {
    // SAFETY: both names are NUL-terminated.
    check_int(unsafe { libc::linkat(from_dir, from.as_ptr(), to_dir, to.as_ptr(), 0) })
}

/// A new name `name` under `dir` for the inode behind the `O_PATH` fd `fd`, through
/// its `/proc/self/fd` entry (`AT_EMPTY_PATH` would need `CAP_DAC_READ_SEARCH`, which
/// also opens files by handle). A symlink's fd links the symlink itself.
pub fn link_fd(proc_fd: RawFd, fd: RawFd, dir: RawFd, name: &CStr) -> io::Result<()> {
    let n = fd_name(fd);
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

/// `readlinkat(2)`: the target of the symlink `name` in `dir` (empty `name`: the symlink
/// behind the `O_PATH` fd `dir` itself).
pub fn readlinkat(dir: RawFd, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    // SAFETY: `buf` is writable for its full length, which is what we pass.
    let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    buf.truncate(check(n as libc::c_long)? as usize);
    Ok(buf)
}

/// `lseek(2)`.
pub fn seek(fd: RawFd, offset: i64, whence: libc::c_int) -> io::Result<u64> {
    // SAFETY: integers only.
    check(unsafe { libc::lseek(fd, offset, whence) }).map(|o| o as u64)
}

/// One `getdents64(2)` into `buf`; 0 at the end of the directory.
pub fn getdents64(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is writable for its length.
    check(unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len()) })
        .map(|n| n as usize)
}

/// The names in a directory (without `.` and `..`), unsorted. Consumes the descriptor.
pub fn read_dir_names(fd: OwnedFd) -> io::Result<Vec<CString>> {
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

/// `read(2)` on a raw descriptor, unbuffered, retried when a signal interrupts it.
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

/// One `write(2)` of `buf`: the bytes written, which may be fewer than `buf.len()`.
pub fn write(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of its length.
    check(unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) } as libc::c_long)
        .map(|n| n as usize)
}

/// `poll(2)`: waits until one of `fds` is ready or `timeout_ms` passed (-1: no limit);
/// an interruption by a signal counts as nothing ready.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: `fds` is a valid, writable slice of pollfd of the length passed.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if n >= 0 {
        return Ok(n as usize);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::Interrupted {
        Ok(0)
    } else {
        Err(e)
    }
}

/// Sleeps until something changes on `fd`, not while it merely stays ready: an
/// edge-triggered `epoll(7)` of `fd` for input, output and hang-up. What `poll` cannot do
/// on a file whose state is "ready" for a long time (a virtio-serial port reads as hung up
/// at once while its host side is closed, so `poll` returns at once too).
#[derive(Debug)]
pub struct EdgeWait {
    ep: OwnedFd,
}

impl EdgeWait {
    /// Watches `fd` (borrowed: it must outlive the watcher, which does not close it).
    /// The first [`EdgeWait::wait`] returns at once if `fd` is ready when this is made.
    pub fn new(fd: RawFd) -> io::Result<Self> {
        // SAFETY: integer argument only.
        let ep = owned(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }.into())?;
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLHUP | libc::EPOLLET) as u32,
            u64: 0,
        };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call.
        check_int(unsafe {
            libc::epoll_ctl(
                std::os::fd::AsRawFd::as_raw_fd(&ep),
                libc::EPOLL_CTL_ADD,
                fd,
                &mut ev,
            )
        })?;
        Ok(Self { ep })
    }

    /// Waits for the next change on the fd, or `timeout_ms` (-1: no limit); whether one
    /// came. An interruption by a signal counts as none.
    pub fn wait(&self, timeout_ms: i32) -> io::Result<bool> {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: room for exactly one event, as passed.
        let n = unsafe {
            libc::epoll_wait(
                std::os::fd::AsRawFd::as_raw_fd(&self.ep),
                &mut ev,
                1,
                timeout_ms,
            )
        };
        if n >= 0 {
            return Ok(n > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        }
    }
}

/// `fsync(2)`.
pub fn fsync(fd: RawFd) -> io::Result<()> {
    // SAFETY: integer argument only.
    check_int(unsafe { libc::fsync(fd) })
}

/// `syncfs(2)`: flushes the whole filesystem `fd` is on.
pub fn syncfs(fd: RawFd) -> io::Result<()> {
    // SAFETY: integer argument only.
    check_int(unsafe { libc::syncfs(fd) })
}

/// `fallocate(2)`.
pub fn fallocate(fd: RawFd, mode: libc::c_int, offset: i64, len: i64) -> io::Result<()> {
    // SAFETY: integers only.
    check_int(unsafe { libc::fallocate(fd, mode, offset, len) })
}

/// `copy_file_range(2)` from `off_in` to `off_out` (the fds' own offsets stay as they
/// are); the bytes copied, 0 at the end of `from`.
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

/// Sets `FD_CLOEXEC` on a descriptor we were handed.
pub fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an integer fd; a bad fd is an error, not undefined behaviour.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    check(flags.into())?;
    // SAFETY: as above.
    check_int(unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) })
}

/// The file status flags of an open file (`fcntl(F_GETFL)`: access mode, `O_SYNC`, …).
pub fn status_flags(fd: RawFd) -> io::Result<libc::c_int> {
    // SAFETY: fcntl on an integer fd; a bad fd is an error, not undefined behaviour.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    check(flags.into()).map(|f| f as libc::c_int)
}

/// Marks every descriptor from 3 up close-on-exec (`close_range(2)`; a walk of
/// `/proc/self/fd` on kernels before 5.11).
pub fn cloexec_from_3() {
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

/// `shutdown(2)` both ways (a socket's peer sees the end; blocked reads return).
pub fn shutdown(fd: RawFd) -> io::Result<()> {
    // SAFETY: integer arguments only.
    check_int(unsafe { libc::shutdown(fd, libc::SHUT_RDWR) })
}

/// `shutdown(2)` of the sending side only: the peer reads the end of the stream while this
/// side can still read what the peer sends (a lingering close).
pub fn shutdown_write(fd: RawFd) -> io::Result<()> {
    // SAFETY: integer arguments only.
    check_int(unsafe { libc::shutdown(fd, libc::SHUT_WR) })
}

/// Starts writing back `len` bytes of `file` from `offset` (`sync_file_range(2)`,
/// `SYNC_FILE_RANGE_WRITE`) without waiting: a later `fsync` finds less to do. Best effort.
pub fn start_writeback(file: &impl std::os::fd::AsRawFd, offset: u64, len: u64) {
    // SAFETY: integer arguments only.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// A pipe (read end, write end) whose ends are closed on exec.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    pipe_with(0)
}

/// [`pipe`] with extra `pipe2(2)` flags (`O_NONBLOCK`).
pub fn pipe_with(flags: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two fds pipe2 writes.
    check_int(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | flags) })?;
    // SAFETY: pipe2 returned two fresh fds that nobody else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends `data` on the unix socket `sock` with the descriptor `fd` attached
/// (`SCM_RIGHTS`): how QEMU is handed a file it may not open itself. Returns the bytes
/// sent, which may be fewer than `data.len()`: the caller writes the rest plainly (the
/// descriptor went with the first byte).
pub fn send_with_fd(sock: RawFd, data: &[u8], fd: RawFd) -> io::Result<usize> {
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut _,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `cbuf`, which has room for one cmsg carrying one fd
    // (CMSG_SPACE above), so CMSG_FIRSTHDR is non-null and CMSG_DATA lies inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::copy_nonoverlapping(
            (&fd as *const RawFd).cast::<u8>(),
            libc::CMSG_DATA(c),
            std::mem::size_of::<RawFd>(),
        );
    }
    // SAFETY: `msg` and everything it points at (`iov` over `data`, `cbuf`) live across
    // the call.
    check(unsafe { libc::sendmsg(sock, &msg, 0) } as libc::c_long).map(|n| n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn open_beneath_refuses_a_walk_out_and_in_root_stays_in() {
        let d = std::env::temp_dir().join(format!("locker-sys-fd-{}", std::process::id()));
        std::fs::create_dir_all(d.join("in")).unwrap();
        std::os::unix::fs::symlink("/etc", d.join("in/out")).unwrap();
        let root = open_dir_path(&d.join("in")).unwrap();
        let e = open_beneath(root.as_raw_fd(), c"out/passwd", libc::O_RDONLY).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EXDEV));
        // In root, `/etc` is `in/etc`, which does not exist.
        let e = open_in_root(root.as_raw_fd(), c"out/passwd", libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        let names = read_dir_names(open_beneath(root.as_raw_fd(), c".", libc::O_RDONLY).unwrap());
        assert_eq!(names.unwrap(), vec![CString::new("out").unwrap()]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_edge_wait_wakes_on_changes_not_on_a_lasting_state() {
        let (r, w) = pipe().unwrap();
        let e = EdgeWait::new(r.as_raw_fd()).unwrap();
        assert!(!e.wait(0).unwrap(), "an empty pipe has nothing to say");
        write(w.as_raw_fd(), b"x").unwrap();
        assert!(e.wait(0).unwrap(), "data arrived");
        // Still readable, but nothing new: a level-triggered wait would spin here.
        assert!(
            !e.wait(20).unwrap(),
            "no new edge while the data sits unread"
        );
        drop(w);
        // A child another test forks meanwhile holds a copy of the write end until it
        // execs or exits (`fs`'s lock test keeps one for a moment): the hang-up comes when
        // the last copy goes, so wait for it rather than look once.
        assert!(e.wait(10_000).unwrap(), "the writer went away");
        assert!(!e.wait(20).unwrap(), "a lasting hang-up is not a new edge");
    }
}

/// The uid of the process at the other end of the unix socket `fd` (`SO_PEERCRED`: the
/// credentials it had when it connected, or listened).
pub fn peer_uid(fd: RawFd) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are our own locals, of the size we pass.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    check_int(rc)?;
    Ok(cred.uid)
}
