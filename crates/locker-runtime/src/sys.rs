//! Raw system calls the jail needs that `std` does not offer.
//!
//! Every `unsafe` block of the runtime lives here, each with its invariant, so the jail reads
//! as policy. Functions return `io::Error` from `errno`; callers add what step failed.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// `mount(2)` with optional source, fstype and data.
pub fn mount(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let src = src.map(|s| CString::new(s).expect("no NUL in mount source"));
    let fstype = fstype.map(|s| CString::new(s).expect("no NUL in fstype"));
    let data = data.map(|s| CString::new(s).expect("no NUL in mount data"));
    let target = cstr(target)?;
    let p = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is either null or a live NUL-terminated string for the call.
    let rc = unsafe { libc::mount(p(&src), target.as_ptr(), p(&fstype), flags, p(&data).cast()) };
    check(rc.into()).map(drop)
}

/// Makes every mount of this mount namespace private (nothing propagates to or from the
/// host's): the first step in a namespace of one's own.
pub fn make_mounts_private() -> io::Result<()> {
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
}

/// Bind-mounts `src` on `target`, then applies `flags` (e.g. read-only) with a remount.
pub fn bind(src: &Path, target: &Path, extra: libc::c_ulong) -> io::Result<()> {
    let s = src
        .to_str()
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    mount(Some(s), target, None, libc::MS_BIND | libc::MS_REC, None)?;
    if extra != 0 {
        mount(
            None,
            target,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | extra,
            None,
        )?;
    }
    Ok(())
}

/// `umount2(2)`.
pub fn umount(target: &Path, flags: libc::c_int) -> io::Result<()> {
    let t = cstr(target)?;
    // SAFETY: `t` is a live NUL-terminated path.
    check(unsafe { libc::umount2(t.as_ptr(), flags) }.into()).map(drop)
}

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const OPEN_TREE_CLONE: libc::c_uint = 1;
const AT_RECURSIVE: libc::c_uint = 0x8000;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

/// Mounts `src` on `target` id-mapped through the user namespace `userns` (read-only if asked):
/// files owned by uid N on disk appear owned by the host uid that N maps to in `userns`.
/// This is how a root-owned template appears root-owned inside a machine whose root is an
/// unprivileged host uid, without copying or chowning the template.
pub fn idmapped_bind(src: &Path, target: &Path, userns: RawFd, read_only: bool) -> io::Result<()> {
    let tree = idmapped_tree(src, userns, read_only)?;
    attach_tree(&tree, target)
}

/// A detached, id-mapped copy of the mount tree at `src` (see [`idmapped_bind`]), to be
/// attached later with [`attach_tree`], possibly in another mount namespace.
pub fn idmapped_tree(src: &Path, userns: RawFd, read_only: bool) -> io::Result<OwnedFd> {
    let s = cstr(src)?;
    // SAFETY: open_tree with a valid path string; returns a new fd we take ownership of.
    let fd = check(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            s.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as u32 | AT_RECURSIVE,
        )
    })?;
    // SAFETY: the syscall returned a fresh fd owned by nobody else.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP | if read_only { MOUNT_ATTR_RDONLY } else { 0 },
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns as u64,
    };
    let empty = c"";
    // SAFETY: `attr` lives across the call and its size is passed; `tree` is a valid fd.
    check(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint | AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    })?;
    Ok(tree)
}

/// Attaches a detached mount tree at `target` in the caller's mount namespace.
pub fn attach_tree(tree: &OwnedFd, target: &Path) -> io::Result<()> {
    let t = cstr(target)?;
    let empty = c"";
    // SAFETY: both fds and strings are valid for the call.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    })?;
    Ok(())
}

/// `pivot_root(".", ".")` in the current directory, then detaches the old root: the
/// current directory becomes `/` and nothing of the old tree stays reachable.
pub fn pivot_to_cwd() -> io::Result<()> {
    let dot = c".";
    // SAFETY: both arguments are the static string ".".
    check(unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) })?;
    umount(Path::new("."), libc::MNT_DETACH)?;
    // SAFETY: chdir to a static string.
    check(unsafe { libc::chdir(c"/".as_ptr()) }.into()).map(drop)
}

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

/// A pipe whose ends are closed on exec.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two fds pipe2 writes.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }.into())?;
    // SAFETY: pipe2 returned two fresh fds that nobody else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// `sethostname(2)`.
pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: pointer and length describe `name`'s bytes.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }.into()).map(drop)
}

/// Brings the loopback interface of the current network namespace up.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: socket() with constant arguments.
    let s = check(
        unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) }.into(),
    )?;
    // SAFETY: fresh fd.
    let sock = unsafe { OwnedFd::from_raw_fd(s as RawFd) };
    // SAFETY: ifreq is plain old data; zeroed is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we own.
    unsafe {
        check(libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr).into())?;
        ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        check(libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr).into())?;
    }
    Ok(())
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

/// Fills `buf` from the kernel's random source (`getrandom(2)`); on failure (a kernel
/// without it) `buf` keeps what it held.
pub fn random_bytes(buf: &mut [u8]) {
    // SAFETY: the kernel writes at most `buf.len()` bytes into the live buffer.
    unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
}

/// Takes an exclusive `flock(2)` on `file`, waiting for it; released when the file closes.
pub fn lock_exclusive(file: &std::fs::File) -> io::Result<()> {
    loop {
        // SAFETY: plain syscall on a descriptor the caller keeps open.
        match check(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) }.into()) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r.map(drop),
        }
    }
}

/// Sends `sig` to `pid`.
pub fn kill(pid: libc::pid_t, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall.
    check(unsafe { libc::kill(pid, sig) }.into()).map(drop)
}

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Attaches `image` to a free loop device that detaches itself when its last user goes
/// (autoclear), and returns the device path with an open fd on it. Keep the fd until the
/// device is mounted: autoclear detaches the device as soon as its last opener closes it.
pub fn loop_attach(image: &Path) -> io::Result<(std::path::PathBuf, std::fs::File)> {
    use std::fs::OpenOptions;
    use std::os::unix::fs::OpenOptionsExt;
    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/loop-control")?;
    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(image)?;
    // Every free-device query answers the same device to concurrent callers, so machines
    // starting at once would mostly lose the race: take turns, host-wide (shims are separate
    // processes), and retry against other software until a deadline.
    std::fs::create_dir_all("/run/locker")?;
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/run/locker/loop.lock")?;
    // SAFETY: flock on an fd we own; released when `lock` is dropped at return.
    check(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }.into())?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        // SAFETY: ioctl on the loop control fd with no argument.
        let n = check(unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) }.into())?;
        let dev = std::path::PathBuf::from(format!("/dev/loop{n}"));
        if !dev.exists() {
            // Containers often ship a /dev with only the first few loop nodes.
            let d = cstr(&dev)?;
            // SAFETY: mknod of a block device node at a path string we own.
            let rc = unsafe {
                libc::mknod(
                    d.as_ptr(),
                    libc::S_IFBLK | 0o660,
                    libc::makedev(7, n as u32),
                )
            };
            if rc < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
                return Err(io::Error::last_os_error());
            }
        }
        let lo = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&dev)?;
        // SAFETY: LoopConfig is plain old data; zeroed is valid.
        let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
        cfg.fd = backing.as_raw_fd() as u32;
        cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR;
        // SAFETY: LOOP_CONFIGURE reads the config struct we own.
        let rc = unsafe { libc::ioctl(lo.as_raw_fd(), LOOP_CONFIGURE, &cfg as *const LoopConfig) };
        if rc == 0 {
            return Ok((dev, lo));
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(e);
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    Err(io::Error::other("no free loop device within 10 s"))
}

/// Sets the access and modification times of `path` itself (a symlink is not followed).
pub fn set_times_nofollow(path: &Path, atime: (i64, i64), mtime: (i64, i64)) -> io::Result<()> {
    let p = cstr(path)?;
    let ts = [
        libc::timespec {
            tv_sec: atime.0,
            tv_nsec: atime.1,
        },
        libc::timespec {
            tv_sec: mtime.0,
            tv_nsec: mtime.1,
        },
    ];
    // SAFETY: a NUL-terminated path and two timespecs we own, for the duration of the call.
    check(unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            p.as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    } as libc::c_long)
    .map(drop)
}

/// `FS_TOPDIR_FL` (`chattr +T`), not in the `libc` crate.
const FS_TOPDIR_FL: libc::c_int = 0x0002_0000;

/// Marks the directory `dir` as the top of a hierarchy (`chattr +T`): ext4 then spreads
/// the directories made in it over its block groups (the Orlov allocator, as at the root)
/// instead of packing them, and the files in them, into its own group. A filesystem
/// without the flag answers an error (`ENOTTY`, `EOPNOTSUPP`).
pub fn set_topdir(dir: &Path) -> io::Result<()> {
    let f = std::fs::File::open(dir)?;
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes an int to the one we own (the kernel's size, not the
    // `long` its number encodes); the fd is open for the call.
    check(unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) }.into())?;
    if flags & FS_TOPDIR_FL != 0 {
        return Ok(());
    }
    flags |= FS_TOPDIR_FL;
    // SAFETY: FS_IOC_SETFLAGS reads an int we own; the fd is open for the call.
    check(unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags) }.into()).map(drop)
}
