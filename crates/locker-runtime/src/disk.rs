//! Machine disks: the sparse ext4 image that holds a machine's writable layer.
//!
//! Owns making a fresh image (the disk quota is its size), copying one (a snapshot, a
//! fork, a machine started from a snapshot) as cheaply as the filesystem allows, and
//! flushing a mounted one so a copy is consistent. Images store canonical ids (root = 0):
//! the jail maps them onto each machine's uid range, so any image can start any machine.
//!
//! Also a snapshot's **layer stack** ([`stack_of`], [`link_stack`]): a jail snapshot is its
//! machine's disk image (`disk.img`, whose `upper` is the top layer) over the images its
//! machine itself stood on (`lower/1.img`, `lower/2.img`, … top first), each a hard link
//! to the one image every snapshot, fork and machine of that chain shares. A machine
//! started from the snapshot links the stack into its own directory (`layers/0.img`, …)
//! and mounts each read-only beneath its own blank disk. The links are the reference
//! count: an image's blocks go when its last snapshot and its last machine have gone.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use locker_sys::fd as sys_fd;

/// How an image was copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// A reflink: instant, blocks shared copy-on-write (btrfs, XFS with reflink).
    Reflink,
    /// Only the allocated extents were copied; holes stay holes.
    Sparse,
}

/// Creates an empty disk of `size_mb` at `img`: a copy of a blank image of that size kept
/// in `blanks` (made once per size, atomically), so no machine start pays for `mkfs`.
pub fn make_from_blank(img: &Path, size_mb: u64, blanks: &Path) -> io::Result<()> {
    let blank = blanks.join(format!("blank-ext4-{size_mb}m.img"));
    if !blank.exists() {
        fs::create_dir_all(blanks)?;
        let tmp = blanks.join(format!(".tmp-{size_mb}m-{}", std::process::id()));
        let _ = fs::remove_file(&tmp);
        make(&tmp, size_mb)?;
        fs::File::open(&tmp)?.sync_all()?;
        // Whoever renames last wins; every candidate is a valid blank image.
        fs::rename(&tmp, &blank)?;
    }
    copy_ephemeral(&blank, img).map(drop)
}

/// Creates a sparse ext4 image of `size_mb` at `img` whose root directory belongs to root.
pub fn make(img: &Path, size_mb: u64) -> io::Result<()> {
    let f = fs::File::create(img)?;
    f.set_len(size_mb << 20)?;
    drop(f);
    let mkfs = crate::doctor::which("mkfs.ext4").unwrap_or_else(|| "mkfs.ext4".into());
    let out = std::process::Command::new(mkfs)
        // No journal: a machine's disk does not outlive a host crash, and copies of it are
        // only taken flushed and frozen.
        .args([
            "-q",
            "-F",
            "-O",
            "^has_journal",
            "-m",
            "0",
            "-E",
            "lazy_itable_init=1,nodiscard,root_owner=0:0",
        ])
        .arg(img)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("run mkfs.ext4 (apt-get install e2fsprogs): {e}"),
            )
        })?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "mkfs.ext4 failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Copies the image `src` to `dst` (created; must not exist), by reflink when the
/// filesystem allows, else extent by extent so holes stay holes, and makes it durable
/// (a snapshot must survive a host crash). On failure `dst` is removed.
pub fn copy(src: &Path, dst: &Path) -> io::Result<CopyKind> {
    copy_with(src, dst, true)
}

/// [`copy`] without the final fsync: for a machine's own disk, which a host crash ends anyway.
pub fn copy_ephemeral(src: &Path, dst: &Path) -> io::Result<CopyKind> {
    copy_with(src, dst, false)
}

fn copy_with(src: &Path, dst: &Path, durable: bool) -> io::Result<CopyKind> {
    let from = fs::File::open(src)?;
    let to = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)?;
    let r = copy_into(&from, &to).and_then(|k| {
        if durable {
            to.sync_all()?;
        }
        Ok(k)
    });
    if r.is_err() {
        let _ = fs::remove_file(dst);
    }
    r
}

pub use locker_sys::ioctl::reflink;

fn copy_into(from: &fs::File, to: &fs::File) -> io::Result<CopyKind> {
    if reflink(from, to) {
        return Ok(CopyKind::Reflink);
    }
    let len = from.metadata()?.len();
    to.set_len(len)?;
    let (src, dst) = (from.as_raw_fd(), to.as_raw_fd());
    let mut off: i64 = 0;
    while (off as u64) < len {
        let data = match sys_fd::seek(src, off, libc::SEEK_DATA) {
            Ok(d) => d as i64,
            // Only a hole is left.
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => break,
            Err(e) => return Err(e),
        };
        let end = sys_fd::seek(src, data, libc::SEEK_HOLE).map_or(len as i64, |h| h as i64);
        let mut i = data;
        while i < end {
            match sys_fd::copy_file_range(src, i, dst, i, (end - i) as usize) {
                Ok(0) => break,
                Ok(n) => i += n as i64,
                // Across filesystems (a blank on ext4, a data dir on XFS) the kernel refuses.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EXDEV)
                            | Some(libc::EINVAL)
                            | Some(libc::EOPNOTSUPP)
                            | Some(libc::ENOSYS)
                    ) =>
                {
                    copy_range_plain(from, to, i as u64, end as u64)?;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        off = end;
    }
    Ok(CopyKind::Sparse)
}

/// Copies bytes `[off, end)` with plain reads and writes.
fn copy_range_plain(from: &fs::File, to: &fs::File, mut off: u64, end: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    while off < end {
        let want = ((end - off) as usize).min(buf.len());
        let n = from.read_at(&mut buf[..want], off)?;
        if n == 0 {
            break;
        }
        to.write_all_at(&buf[..n], off)?;
        off += n as u64;
    }
    Ok(())
}

/// Flushes the filesystem mounted at `mountpoint` (`syncfs`), so the image under it holds
/// everything written so far.
pub fn flush(mountpoint: &Path) -> io::Result<()> {
    locker_sys::fs::syncfs(&fs::File::open(mountpoint)?)
}

/// The most layer images a machine stands on (beneath its own disk): each is a loop device
/// and a mount at every start, so a chain of snapshots of snapshots ends here with a clear
/// refusal instead of at the kernel's limits.
pub const MAX_LAYERS: usize = 32;

/// Where a machine keeps the layer images it stands on (`layers/<n>.img`, top first).
pub const MACHINE_LAYERS: &str = "layers";
/// Where a snapshot keeps the layers beneath its own `disk.img` (`lower/<n>.img`, n ≥ 1).
pub const SNAPSHOT_LOWERS: &str = "lower";

/// A snapshot's layer stack, top first: its image `img` (`<snapshot>/disk.img`), then the
/// images recorded beside it in `lower/` in order. A snapshot without `lower/` (one
/// taken of a machine that stood on no snapshot, or before layers) is its image alone.
pub fn stack_of(img: &Path) -> Vec<std::path::PathBuf> {
    let mut stack = vec![img.to_owned()];
    if let Some(dir) = img.parent() {
        stack.extend(numbered(&dir.join(SNAPSHOT_LOWERS)));
    }
    stack
}

/// The layer images of a machine's directory `dir`, top first.
pub fn machine_layers(dir: &Path) -> Vec<std::path::PathBuf> {
    numbered(&dir.join(MACHINE_LAYERS))
}

/// The files `<n>.img` in `dir`, by `n`.
fn numbered(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found: Vec<(u32, std::path::PathBuf)> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let n = name.to_str()?.strip_suffix(".img")?.parse().ok()?;
            Some((n, e.path()))
        })
        .collect();
    found.sort();
    found.into_iter().map(|(_, p)| p).collect()
}

/// Links each image of `stack` into `dir` (created) as `<first + i>.img`: a hard link,
/// so the image is stored once, or a copy where `dir` is on another filesystem.
pub fn link_stack(stack: &[std::path::PathBuf], dir: &Path, first: usize) -> io::Result<()> {
    if stack.is_empty() {
        return Ok(());
    }
    fs::create_dir_all(dir)?;
    for (i, src) in stack.iter().enumerate() {
        let dst = dir.join(format!("{}.img", first + i));
        match fs::hard_link(src, &dst) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                copy_ephemeral(src, &dst)?;
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("link the layer {}: {e}", src.display()),
                ))
            }
        }
    }
    Ok(())
}

/// Bytes an image really occupies (its allocated blocks).
pub fn allocated_bytes(img: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(img).map(|m| m.blocks() * 512).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_copy_keeps_holes_and_bytes() {
        let dir = std::env::temp_dir().join(format!("locker-disk-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let a = dir.join("a.img");
        let f = fs::File::create(&a).unwrap();
        f.set_len(64 << 20).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(b"head", 0).unwrap();
        f.write_all_at(&vec![7u8; 1 << 20], 32 << 20).unwrap();
        f.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        f.sync_all().unwrap();
        let b = dir.join("b.img");
        copy(&a, &b).unwrap();
        assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap());
        assert!(
            allocated_bytes(&b) < 8 << 20,
            "holes stay holes: {}",
            allocated_bytes(&b)
        );
        assert!(copy(&a, &b).is_err(), "the destination must not exist");
        assert!(b.exists(), "a refused copy leaves the existing file alone");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_stack_is_the_image_then_its_lowers_in_order_and_links_share_the_inode() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("locker-stack-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let snap = dir.join("snap");
        fs::create_dir_all(snap.join(SNAPSHOT_LOWERS)).unwrap();
        fs::write(snap.join("disk.img"), b"top").unwrap();
        // Numbered, not sorted by name: 10 comes after 2.
        for n in [10, 1, 2] {
            fs::write(
                snap.join(SNAPSHOT_LOWERS).join(format!("{n}.img")),
                n.to_string(),
            )
            .unwrap();
        }
        fs::write(snap.join(SNAPSHOT_LOWERS).join("junk"), b"").unwrap();
        let stack = stack_of(&snap.join("disk.img"));
        let names: Vec<String> = stack
            .iter()
            .map(|p| fs::read_to_string(p).unwrap())
            .collect();
        assert_eq!(names, ["top", "1", "2", "10"]);
        let m = dir.join("machine");
        link_stack(&stack, &m.join(MACHINE_LAYERS), 0).unwrap();
        let linked = machine_layers(&m);
        assert_eq!(linked.len(), 4);
        for (a, b) in stack.iter().zip(&linked) {
            assert_eq!(
                fs::metadata(a).unwrap().ino(),
                fs::metadata(b).unwrap().ino()
            );
        }
        assert_eq!(stack_of(&dir.join("none/disk.img")).len(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
