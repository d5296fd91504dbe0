//! Device and filesystem `ioctl`s: `FICLONE` reflinks, `chattr +T`, loop devices, btrfs
//! snapshots. Owns the kernel structs and request numbers the `libc` crate lacks.

use std::ffi::CStr;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::{check, check_int};

/// `FICLONE` (`_IOW(0x94, 9, int)`), not in the `libc` crate.
const FICLONE: libc::c_ulong = 0x4004_9409;

/// Makes `to` share `from`'s blocks copy-on-write (`FICLONE`); false where the filesystem
/// cannot (ext4, tmpfs, two filesystems), and the caller copies instead.
pub fn reflink(from: &File, to: &File) -> bool {
    // SAFETY: FICLONE between two fds we own; the argument is an fd, not a pointer.
    unsafe { libc::ioctl(to.as_raw_fd(), FICLONE, from.as_raw_fd()) == 0 }
}

/// `FS_TOPDIR_FL` (`chattr +T`), not in the `libc` crate.
const FS_TOPDIR_FL: libc::c_int = 0x0002_0000;

/// Marks the directory `dir` as the top of a hierarchy (`chattr +T`): ext4 then spreads
/// the directories made in it over its block groups (the Orlov allocator, as at the root)
/// instead of packing them, and the files in them, into its own group. A filesystem
/// without the flag answers an error (`ENOTTY`, `EOPNOTSUPP`).
pub fn set_topdir(dir: &Path) -> io::Result<()> {
    let f = File::open(dir)?;
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes an int to the one we own (the kernel's size, not the
    // `long` its number encodes); the fd is open for the call.
    check_int(unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) })?;
    if flags & FS_TOPDIR_FL != 0 {
        return Ok(());
    }
    flags |= FS_TOPDIR_FL;
    // SAFETY: FS_IOC_SETFLAGS reads an int we own; the fd is open for the call.
    check_int(unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags) })
}

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_READ_ONLY: u32 = 1;
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

fn open_rw(p: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(p)
}

/// Drops the clean pages a block device's own page cache holds (`BLKFLSBUF`, after writing
/// back its dirty ones): what was read through the device before its backing file changed
/// (a probe by udev of a loop device whose file was filled after the attach) is read anew.
pub fn flush_buffers(dev: &File) -> io::Result<()> {
    const BLKFLSBUF: libc::c_ulong = 0x1261;
    // SAFETY: ioctl on an open block device fd with no argument.
    check(unsafe { libc::ioctl(dev.as_raw_fd(), BLKFLSBUF, 0) }.into()).map(drop)
}

/// Attaches `image` to a free loop device that detaches itself when its last user goes
/// (autoclear), and returns the device path with an open fd on it. Keep the fd until the
/// device is mounted: autoclear detaches the device as soon as its last opener closes it.
pub fn loop_attach(image: &Path) -> io::Result<(PathBuf, File)> {
    loop_attach_with(image, false)
}

/// [`loop_attach`] of a device that refuses writes (`LO_FLAGS_READ_ONLY`), the image opened
/// read-only: a filesystem on it can be mounted only read-only, and ext4 then leaves even
/// its orphan list alone (it writes to a read-only *mount* of a writable device).
pub fn loop_attach_read_only(image: &Path) -> io::Result<(PathBuf, File)> {
    loop_attach_with(image, true)
}

fn loop_attach_with(image: &Path, read_only: bool) -> io::Result<(PathBuf, File)> {
    let ctl = open_rw(Path::new("/dev/loop-control"))?;
    let backing = if read_only {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(image)?
    } else {
        open_rw(image)?
    };
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
    crate::fs::lock_exclusive(&lock)?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        // SAFETY: ioctl on the loop control fd with no argument.
        let n = check(unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) }.into())?;
        let dev = PathBuf::from(format!("/dev/loop{n}"));
        if !dev.exists() {
            // Containers often ship a /dev with only the first few loop nodes.
            match crate::fs::mknod(&dev, libc::S_IFBLK | 0o660, libc::makedev(7, n as u32)) {
                Err(e) if e.raw_os_error() != Some(libc::EEXIST) => return Err(e),
                _ => {}
            }
        }
        let lo = open_rw(&dev)?;
        // SAFETY: LoopConfig is plain old data; zeroed is valid.
        let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
        cfg.fd = backing.as_raw_fd() as u32;
        cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR | if read_only { LO_FLAGS_READ_ONLY } else { 0 };
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

const BTRFS_IOC_SNAP_CREATE_V2: libc::c_ulong = 0x5000_9417;
const BTRFS_IOC_SNAP_DESTROY: libc::c_ulong = 0x5000_940F;
const BTRFS_SUBVOL_RDONLY: u64 = 1 << 1;

/// `struct btrfs_ioctl_vol_args_v2` (4096 bytes).
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; 4040],
}

/// `struct btrfs_ioctl_vol_args` (4096 bytes).
#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; 4088],
}

/// A subvolume name that fits the kernel's structs with its NUL (one component).
fn subvolume_name(name: &CStr) -> io::Result<&[u8]> {
    let b = name.to_bytes();
    if b.is_empty() || b.len() >= 4000 || b.contains(&b'/') {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    Ok(b)
}

/// Makes `name` in the directory `dir` a snapshot of the subvolume whose root `src` is
/// open on (read-only if asked): `BTRFS_IOC_SNAP_CREATE_V2`.
pub fn btrfs_snapshot(src: RawFd, dir: RawFd, name: &CStr, read_only: bool) -> io::Result<()> {
    let name = subvolume_name(name)?;
    let mut args = VolArgsV2 {
        fd: i64::from(src),
        transid: 0,
        flags: if read_only { BTRFS_SUBVOL_RDONLY } else { 0 },
        unused: [0; 4],
        name: [0; 4040],
    };
    args.name[..name.len()].copy_from_slice(name);
    // SAFETY: the ioctl reads the args struct we own, laid out as the kernel's; both fds
    // are the caller's and open for the call.
    check_int(unsafe { libc::ioctl(dir, BTRFS_IOC_SNAP_CREATE_V2, &args as *const VolArgsV2) })
}

/// Deletes the subvolume `name` in the directory `dir`, read-only or not:
/// `BTRFS_IOC_SNAP_DESTROY`.
pub fn btrfs_delete_subvolume(dir: RawFd, name: &CStr) -> io::Result<()> {
    let name = subvolume_name(name)?;
    let mut args = VolArgs {
        fd: 0,
        name: [0; 4088],
    };
    args.name[..name.len()].copy_from_slice(name);
    // SAFETY: the ioctl reads the args struct we own, laid out as the kernel's.
    check_int(unsafe { libc::ioctl(dir, BTRFS_IOC_SNAP_DESTROY, &args as *const VolArgs) })
}
