//! A volume's own filesystem: one sparse btrfs image per volume, mounted on the host.
//!
//! Owns making, mounting (and adopting after a restart), unmounting and removing a
//! volume's filesystem, and its btrfs subvolume snapshots. It knows nothing of runs,
//! commits or the API: the server decides what goes where.
//!
//! Why a filesystem per volume: its size is the volume's `size_mb`, so every writer (the
//! files API, a run, a sandbox that mounts the volume and writes in place) meets the same
//! limit, as `ENOSPC` from the kernel; and copy-on-write is real: a run's view of the
//! volume is a reflink copy or a read-only snapshot, never a hard link that an in-place
//! write would show through.
//!
//! Layout of a volume directory `<dir>`:
//! - `disk.img`: the sparse image (its size: `size_mb`, at least [`MIN_SIZE_MB`]);
//! - `fs/`: where it is mounted (`nodev,nosuid,max_inline=0,discard=async`); in it, all in
//!   the top-level subvolume so a commit can rename from a run's layer into the tree:
//!   `live/` (the tree), `runs/<call>/` (a run's layer and view), `snapshots/<id>/`
//!   (read-only snapshots of the top-level subvolume) and `commit.journal` while a commit
//!   is applied.
//!
//! `max_inline=0` keeps every file's data in blocks of its own, so a tree's measured size
//! (its blocks) means what it means on ext4. Images smaller than 1 GiB use mixed block
//! groups (data and metadata share space, the only way below 109 MiB); metadata is kept
//! once (`single`), so the image's size is what the volume can hold, less its metadata.
//!
//! A mount is made in the host's mount namespace; a server unmounts it when it stops, and
//! one killed leaves it: [`mount`] adopts a mount that is already there. Loop devices detach
//! themselves on the last unmount (autoclear); attaching one is serialized host-wide
//! (`sys::loop_attach`). While anything else still mounts the filesystem (a sandbox that
//! binds the volume and outlived its server), its loop device stays, and [`mount`] mounts
//! that device again: a second loop device on the same image would be a second writer
//! (btrfs refuses it anyway, a device of a mounted filesystem under another path).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::sys;

/// The smallest image btrfs can be formatted on (mixed block groups).
pub const MIN_SIZE_MB: u64 = 16;
/// Images below this size use mixed block groups.
const MIXED_BELOW_MB: u64 = 1024;
const MOUNT_OPTIONS: &str = "max_inline=0,discard=async";

/// The image of the volume in `dir`.
pub fn image(dir: &Path) -> PathBuf {
    dir.join("disk.img")
}

/// Where the volume's filesystem is mounted.
pub fn root(dir: &Path) -> PathBuf {
    dir.join("fs")
}

/// The volume's live tree.
pub fn live(dir: &Path) -> PathBuf {
    root(dir).join("live")
}

/// Whether this host can give volumes a filesystem of their own: `Ok(what they get)` or
/// `Err(what is missing)`. Cheap: looks for the tools and the kernel's support only.
pub fn support() -> Result<String, String> {
    loop_fs_support("btrfs", "btrfs-progs")?;
    Ok("a btrfs image per volume: size_mb enforced by the filesystem (ENOSPC), runs see a reflink copy or a read-only subvolume snapshot, volume snapshots are subvolume snapshots".into())
}

/// Whether a filesystem of type `fstype` can be made in an image and loop-mounted here: the
/// kernel knows it, `mkfs.<fstype>` is installed (from Debian's `package`), and loop
/// devices exist; `Err(what is missing)`.
pub fn loop_fs_support(fstype: &str, package: &str) -> Result<(), String> {
    let fss = fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fss.split_whitespace().any(|f| f == fstype) {
        return Err(format!("the kernel has no {fstype} (modprobe {fstype})"));
    }
    if crate::doctor::which(&format!("mkfs.{fstype}")).is_none() {
        return Err(format!(
            "mkfs.{fstype} not found (apt-get install {package})"
        ));
    }
    if !Path::new("/dev/loop-control").exists() {
        return Err("/dev/loop-control is missing (modprobe loop)".into());
    }
    Ok(())
}

/// Makes the filesystem of a new volume in `dir` (which must exist), mounts it and creates
/// an empty `live/` (root's, mode 0755). On failure nothing of it is left mounted.
pub fn create(dir: &Path, size_mb: u64) -> io::Result<()> {
    let img = image(dir);
    let size_mb = size_mb.max(MIN_SIZE_MB);
    {
        let f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&img)?;
        f.set_len(size_mb << 20)?;
    }
    let mkfs = crate::doctor::which("mkfs.btrfs").ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "mkfs.btrfs not found: volumes need btrfs-progs (apt-get install btrfs-progs)",
        )
    })?;
    let mut cmd = std::process::Command::new(mkfs);
    cmd.args(["-q", "-f", "-K", "-m", "single", "-d", "single"]);
    if size_mb < MIXED_BELOW_MB {
        cmd.arg("--mixed");
    }
    let out = cmd.arg(&img).stdin(std::process::Stdio::null()).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "mkfs.btrfs failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    mount(dir)?;
    let r = (|| {
        let top = root(dir);
        fs::create_dir(live(dir))?;
        fs::create_dir(top.join("runs"))?;
        fs::create_dir(top.join("snapshots"))?;
        crate::disk::flush(&top)
    })();
    if r.is_err() {
        let _ = unmount(dir);
    }
    r
}

/// Mounts the volume's image at `fs/`, unless it is mounted there already (a server was
/// killed: the mount outlives it). A loop device already attached to the image (the
/// filesystem is still mounted elsewhere) is mounted again rather than a second one made.
pub fn mount(dir: &Path) -> io::Result<()> {
    mount_image(&image(dir), &root(dir), "btrfs", MOUNT_OPTIONS)
}

/// Mounts the filesystem image `img` (of type `fstype`, `nodev,nosuid` and `options`) at
/// `target` (created), through a loop device that detaches itself on the last unmount,
/// unless it is mounted there already; a loop device already attached to the image is
/// mounted again rather than a second one made (two writers of one filesystem).
pub fn mount_image(img: &Path, target: &Path, fstype: &str, options: &str) -> io::Result<()> {
    if is_mounted(target) {
        return Ok(());
    }
    fs::create_dir_all(target)?;
    let mount_dev = |dev: &Path| {
        sys::mount(
            dev.to_str(),
            target,
            Some(fstype),
            libc::MS_NODEV | libc::MS_NOSUID,
            Some(options),
        )
        .map_err(|e| io::Error::new(e.kind(), format!("mount {}: {e}", target.display())))
    };
    if let Some(dev) = attached_loop(img) {
        match mount_dev(&dev) {
            Ok(()) => return Ok(()),
            // It detached itself in between (its last user went): attach a fresh one.
            Err(_) if attached_loop(img).is_none() => {}
            Err(e) => return Err(e),
        }
    }
    let (dev, lo) = sys::loop_attach(img)?;
    let r = mount_dev(&dev);
    // The mount holds the device now; closing our fd lets autoclear detach it on unmount.
    drop(lo);
    r
}

/// The loop device attached to `img`, if one is (`/sys/block/loopN/loop/backing_file`
/// names the image as it was when attached; a file replaced or moved since reads
/// `… (deleted)` or another path, and is not taken for it).
pub fn attached_loop(img: &Path) -> Option<PathBuf> {
    let want = img.canonicalize().ok()?;
    for e in fs::read_dir("/sys/block").ok()?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(backing) = fs::read(e.path().join("loop/backing_file")) else {
            continue;
        };
        let backing = backing.strip_suffix(b"\n").unwrap_or(&backing);
        if backing == want.as_os_str().as_encoded_bytes() {
            return Some(PathBuf::from("/dev").join(name));
        }
    }
    None
}

/// Waits up to `limit` for the loop device of `img` to go, after the unmount that released
/// it: the kernel detaches an autoclear device when its last user closes it, and newer
/// kernels do that after `umount` returns. Whether it went.
pub fn wait_detached(img: &Path, limit: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if attached_loop(img).is_none() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Whether `path` is a mount point in this mount namespace.
pub fn is_mounted(path: &Path) -> bool {
    let Ok(canon) = path.canonicalize() else {
        return false;
    };
    let want = canon.as_os_str().as_encoded_bytes();
    let info = fs::read("/proc/self/mountinfo").unwrap_or_default();
    info.split(|b| *b == b'\n').any(|line| {
        // Field 5 is the mount point, with spaces and the like octal-escaped.
        line.split(|b| *b == b' ')
            .nth(4)
            .is_some_and(|m| unescape(m) == want)
    })
}

fn unescape(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'\\' && i + 4 <= s.len() {
            let oct = &s[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                out.push((oct[0] - b'0') * 64 + (oct[1] - b'0') * 8 + (oct[2] - b'0'));
                i += 4;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

/// Unmounts the volume's filesystem (lazily when something still holds it: the image is
/// released, and its loop device detached, when the last user goes). Not mounted is fine.
pub fn unmount(dir: &Path) -> io::Result<()> {
    unmount_at(&root(dir))
}

/// Unmounts whatever is mounted at `target`, as [`unmount`] does.
pub fn unmount_at(target: &Path) -> io::Result<()> {
    while is_mounted(target) {
        if let Err(e) = sys::umount(target, 0) {
            if e.raw_os_error() == Some(libc::EBUSY) {
                sys::umount(target, libc::MNT_DETACH)?;
            } else if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Unmounts the volume's filesystem and removes the directory `dir` with its image.
pub fn remove(dir: &Path) -> io::Result<()> {
    unmount(dir)?;
    locker_sys::fs::remove_tree(dir)
}

/// The inode number of every btrfs subvolume's root directory.
const BTRFS_FIRST_FREE_OBJECTID: u64 = 256;

/// The parent directory of `p`, open, and `p`'s last component.
fn parent_and_name(p: &Path) -> io::Result<(fs::File, CString)> {
    let parent = p
        .parent()
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let name = p
        .file_name()
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let name = CString::new(name.as_encoded_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    Ok((fs::File::open(parent)?, name))
}

/// Makes `dst` (which must not exist; its parent must) a read-only snapshot of the
/// subvolume whose root is `src` (the volume's top level: `fs/`). Constant time whatever
/// the tree holds; commits a btrfs transaction (a flush of the image).
pub fn snapshot(src: &Path, dst: &Path) -> io::Result<()> {
    let (d, name) = parent_and_name(dst)?;
    let s = fs::File::open(src)?;
    locker_sys::ioctl::btrfs_snapshot(s.as_raw_fd(), d.as_raw_fd(), &name, true).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("snapshot {} at {}: {e}", src.display(), dst.display()),
        )
    })
}

/// Whether `p` is the root of a btrfs subvolume (a snapshot).
pub fn is_subvolume(p: &Path) -> bool {
    p.symlink_metadata()
        .is_ok_and(|m| m.is_dir() && m.ino() == BTRFS_FIRST_FREE_OBJECTID)
}

/// Deletes the subvolume (snapshot) whose root is `p`, read-only or not. Its space comes
/// back in the background.
pub fn delete_subvolume(p: &Path) -> io::Result<()> {
    let (d, name) = parent_and_name(p)?;
    locker_sys::ioctl::btrfs_delete_subvolume(d.as_raw_fd(), &name)
        .map_err(|e| io::Error::new(e.kind(), format!("delete subvolume {}: {e}", p.display())))
}

/// Removes the tree at `p` (nothing there is fine), deleting the subvolumes in it (which
/// a plain removal cannot: a read-only snapshot refuses unlinks).
pub fn remove_tree(p: &Path) -> io::Result<()> {
    let m = match p.symlink_metadata() {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !m.is_dir() {
        return fs::remove_file(p);
    }
    // A subvolume's root: inode 256, on a device of its own.
    let own_dev = p
        .parent()
        .and_then(|q| q.symlink_metadata().ok())
        .is_some_and(|pm| pm.dev() != m.dev());
    if m.ino() == BTRFS_FIRST_FREE_OBJECTID && own_dev {
        return delete_subvolume(p);
    }
    for e in fs::read_dir(p)? {
        remove_tree(&e?.path())?;
    }
    fs::remove_dir(p)
}

#[cfg(test)]
mod tests {
    #[test]
    fn mountinfo_escapes_are_read() {
        assert_eq!(super::unescape(br"/a\040b"), b"/a b");
        assert_eq!(super::unescape(br"/plain"), b"/plain");
        assert_eq!(super::unescape(br"/x\"), b"/x\\");
    }
}
