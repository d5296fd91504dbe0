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
//!
//! A microVM's stack ([`vm_stack_of`], [`vm_machine_layers`], [`link_vm_stack`]) is the
//! same, but its images are block devices for QEMU, in one of two [`Format`]s: raw (a
//! machine restored from a base writes its disk directly) or qcow2 (the copy-on-write
//! overlay of a machine that stands on layers, [`make_qcow2_from_blank`]). The host knows
//! each file's format from the name it gave it (`*.img` raw, `*.qcow2` qcow2), never from
//! its bytes: a guest writes whatever it likes into a raw disk, a qcow2 header included.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

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
    copy_ephemeral(&blank_image(size_mb, blanks)?, img).map(drop)
}

/// The blank image of `size_mb` in `blanks`, made first if there is none.
fn blank_image(size_mb: u64, blanks: &Path) -> io::Result<PathBuf> {
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
    Ok(blank)
}

/// [`make_from_blank`] in two steps where a copy would write: Linux (6.18 on this project's
/// hosts, in `loop_configure`) writes back a file's dirty pages when a loop device is
/// attached to it, so a disk copied and then attached costs a synchronous write of the
/// blank's metadata (about 0.4 ms and 0.7 MB per machine here). Attached empty and filled
/// after, a machine's disk is only written back if it lives long enough for the kernel's
/// writeback (a run's never is). `None`: a reflink made the disk whole (its blocks shared
/// and clean); else an empty sparse file of the disk's size, to [`Fill::run`] once it is
/// attached.
pub fn place_blank(img: &Path, size_mb: u64, blanks: &Path) -> io::Result<Option<Fill>> {
    let blank = fs::File::open(blank_image(size_mb, blanks)?)?;
    let disk = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(img)?;
    if reflink(&blank, &disk) {
        return Ok(None);
    }
    if let Err(e) = blank.metadata().and_then(|m| disk.set_len(m.len())) {
        let _ = fs::remove_file(img);
        return Err(e);
    }
    Ok(Some(Fill { blank, disk }))
}

/// An empty disk [`place_blank`] made and the blank it is to hold, both open: the process
/// that attaches the disk (PID 1, a fork of the shim that placed it) fills it without
/// opening either again.
#[derive(Debug)]
pub struct Fill {
    blank: fs::File,
    disk: fs::File,
}

impl Fill {
    /// Copies the blank's data extents into the disk (the holes are there already).
    pub fn run(&self) -> io::Result<()> {
        copy_into(&self.blank, &self.disk).map(drop)
    }
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
    use std::os::unix::fs::OpenOptionsExt;
    // Never through a symlink: a microVM's directory belongs to its QEMU's uid, which could
    // put one where its disk was to have the host copy a file of its choosing.
    let from = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(src)?;
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

/// The data extents of `file` (offset, length), in order: its holes are left out (a
/// filesystem without `SEEK_DATA` reports the whole file as one extent).
pub fn data_extents(file: &fs::File) -> io::Result<Vec<(u64, u64)>> {
    let len = file.metadata()?.len();
    let fd = file.as_raw_fd();
    let (mut out, mut off) = (Vec::new(), 0i64);
    while (off as u64) < len {
        let data = match sys_fd::seek(fd, off, libc::SEEK_DATA) {
            Ok(d) => d as i64,
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => break,
            Err(e) => return Err(e),
        };
        let end = sys_fd::seek(fd, data, libc::SEEK_HOLE).map_or(len as i64, |h| h as i64);
        if end > data {
            out.push((data as u64, (end - data) as u64));
        }
        off = end.max(data + 1);
    }
    Ok(out)
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
        stack.extend(numbered(&dir.join(SNAPSHOT_LOWERS), &[Format::Raw]));
    }
    stack
}

/// The layer images of a machine's directory `dir`, top first.
pub fn machine_layers(dir: &Path) -> Vec<std::path::PathBuf> {
    numbered(&dir.join(MACHINE_LAYERS), &[Format::Raw])
}

/// The files `<n>.<ext>` in `dir` of the formats `formats`, by `n`.
fn numbered(dir: &Path, formats: &[Format]) -> Vec<std::path::PathBuf> {
    let mut found: Vec<(u32, std::path::PathBuf)> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            let f = Format::of(&p)?;
            let n = p.file_stem()?.to_str()?.parse().ok()?;
            formats.contains(&f).then_some((n, p))
        })
        .collect();
    found.sort();
    found.into_iter().map(|(_, p)| p).collect()
}

/// A disk image's format, as the host named the file it wrote: `*.img` raw, `*.qcow2`
/// qcow2. Nothing reads a format from an image's bytes (QEMU is always told it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Raw,
    Qcow2,
}

impl Format {
    /// The format of the image at `path`, by its name's extension.
    pub fn of(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()? {
            "img" => Some(Format::Raw),
            "qcow2" => Some(Format::Qcow2),
            _ => None,
        }
    }

    /// The extension of a file of this format.
    pub fn ext(self) -> &'static str {
        match self {
            Format::Raw => "img",
            Format::Qcow2 => "qcow2",
        }
    }
}

/// A microVM snapshot's layer stack, top first, given its image path `img`
/// (`<snapshot>/disk.img`, as [`stack_of`] takes it): its own image, which is `disk.img`
/// (raw: a machine restored from a base, or a snapshot older than layered microVMs) or
/// else `disk.qcow2` beside it (the overlay of a machine that stood on layers), then the
/// images in `lower/` (`<n>.img` or `<n>.qcow2`). The bottom one is always raw.
pub fn vm_stack_of(img: &Path) -> io::Result<Vec<std::path::PathBuf>> {
    let qcow2 = img.with_extension(Format::Qcow2.ext());
    let top = match (regular(img), regular(&qcow2)) {
        (true, false) => img.to_owned(),
        (false, true) => qcow2,
        (true, true) => {
            return Err(io::Error::other(format!(
                "{} holds both a raw and a qcow2 image",
                img.parent().unwrap_or(img).display()
            )))
        }
        (false, false) => {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no disk image at {} (nor .qcow2)", img.display()),
            ))
        }
    };
    let mut stack = vec![top];
    if let Some(dir) = img.parent() {
        stack.extend(vm_lower_images(&dir.join(SNAPSHOT_LOWERS))?);
    }
    check_vm_stack(&stack)?;
    Ok(stack)
}

/// The layer images a microVM machine in `dir` stands on (`layers/<n>.img|qcow2`), top
/// first: empty for one restored from a base.
pub fn vm_machine_layers(dir: &Path) -> Vec<std::path::PathBuf> {
    numbered(&dir.join(MACHINE_LAYERS), &[Format::Raw, Format::Qcow2])
}

/// The images a snapshot's stack names beneath its own in `lower` (`1.img|qcow2`, …), in
/// order, numbered from 1 one by one.
pub fn vm_lower_images(lower: &Path) -> io::Result<Vec<std::path::PathBuf>> {
    let images = numbered(lower, &[Format::Raw, Format::Qcow2]);
    check_numbered_from(&images, 1)?;
    Ok(images)
}

/// Refuses numbered images that are not `first`, `first + 1`, … one each (a layer
/// missing or there twice, as `3.img` and `3.qcow2`, would stack the wrong disk).
pub fn check_numbered_from(images: &[std::path::PathBuf], first: usize) -> io::Result<()> {
    for (i, p) in images.iter().enumerate() {
        let n: Option<usize> = p.file_stem().and_then(|s| s.to_str()?.parse().ok());
        if n != Some(first + i) {
            return Err(io::Error::other(format!(
                "the layers in {} are not numbered from {first} one by one",
                p.parent().unwrap_or(p).display()
            )));
        }
    }
    Ok(())
}

/// Whether `p` is a regular file itself (not through a symlink).
fn regular(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_file())
}

/// Checks a microVM's layer stack (top first) before QEMU opens it: at most
/// [`MAX_LAYERS`] images, each a regular file the host made (owned by root: a machine's
/// QEMU, which owns its machine's directory, can put files of its own or symlinks there,
/// never a root-owned file it may not read), a raw image at the bottom (the chain's
/// virtual size is its length), and no qcow2 header naming an external data file (QEMU
/// would open that file by name: a QEMU that wrote its own overlay's header could point
/// the next machine's at a file of its choosing).
pub fn check_vm_stack(stack: &[std::path::PathBuf]) -> io::Result<()> {
    if stack.len() > MAX_LAYERS {
        return Err(io::Error::other(format!(
            "{} layers: a machine stands on at most {MAX_LAYERS}",
            stack.len()
        )));
    }
    check_vm_images(stack)
}

/// [`check_vm_stack`] but for its length: each image a regular file root made, of a known
/// format, no qcow2 naming an external data file, the bottom raw.
pub fn check_vm_images(stack: &[std::path::PathBuf]) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    for p in stack {
        let m = fs::symlink_metadata(p)?;
        if !m.file_type().is_file() || m.uid() != 0 {
            return Err(io::Error::other(format!(
                "the layer {} is not a regular file the host made",
                p.display()
            )));
        }
        match Format::of(p) {
            Some(Format::Qcow2) => check_qcow2_header(p)?,
            Some(Format::Raw) => {}
            None => {
                return Err(io::Error::other(format!(
                    "the layer {} has no known format",
                    p.display()
                )))
            }
        }
    }
    if stack.last().and_then(|p| Format::of(p)) != Some(Format::Raw) {
        return Err(io::Error::other("a layer stack must end in a raw image"));
    }
    Ok(())
}

/// Refuses a qcow2 image whose header sets the external data file bit (incompatible
/// feature bit 2, in the big-endian word at offset 72 of a version 3 header).
fn check_qcow2_header(p: &Path) -> io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(p)?;
    let mut h = [0u8; 80];
    f.read_exact_at(&mut h, 0)?;
    let version = u32::from_be_bytes(h[4..8].try_into().expect("4 bytes"));
    let incompatible = u64::from_be_bytes(h[72..80].try_into().expect("8 bytes"));
    if &h[..4] != b"QFI\xfb" || version < 3 || incompatible & (1 << 2) != 0 {
        return Err(io::Error::other(format!(
            "the qcow2 layer {} is not an image this host makes (version {version}, incompatible features {incompatible:#x})",
            p.display()
        )));
    }
    Ok(())
}

/// [`link_stack`] for a microVM: each image of `stack` linked into `dir` as
/// `<first + i>.<ext>`, keeping its format's extension.
pub fn link_vm_stack(stack: &[std::path::PathBuf], dir: &Path, first: usize) -> io::Result<()> {
    link_named(stack, dir, |i, src| {
        let ext = Format::of(src).map_or("img", Format::ext);
        format!("{}.{ext}", first + i)
    })
}

/// Creates a blank qcow2 overlay of virtual size `size` bytes at `img` (which must not
/// exist, and is not synced: a machine's own disk): a copy of a blank image of that size
/// kept in `blanks` (made once per size by `qemu-img`, atomically), so no machine start
/// runs `qemu-img`. Its header names no backing file: QEMU is told its backing node.
pub fn make_qcow2_from_blank(img: &Path, size: u64, blanks: &Path) -> io::Result<()> {
    let blank = ensure_qcow2_blank(size, blanks)?;
    copy_ephemeral(&blank, img).map(drop)
}

/// The blank qcow2 image of virtual size `size` in `blanks`, made now if missing.
pub fn ensure_qcow2_blank(size: u64, blanks: &Path) -> io::Result<std::path::PathBuf> {
    let blank = blanks.join(format!("blank-{size}.qcow2"));
    if blank.exists() {
        return Ok(blank);
    }
    fs::create_dir_all(blanks)?;
    let tmp = blanks.join(format!(".tmp-{size}-{}.qcow2", std::process::id()));
    let _ = fs::remove_file(&tmp);
    qemu_img(
        &[
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            tmp.as_ref(),
            size.to_string().as_ref(),
        ],
        &tmp,
    )?;
    fs::File::open(&tmp)?.sync_all()?;
    // Whoever renames last wins; every candidate is a valid blank image.
    fs::rename(&tmp, &blank)?;
    Ok(blank)
}

/// Runs `qemu-img` with `args` (its subcommand first), which writes `out`: on failure `out`
/// is removed and the error carries what `qemu-img` said.
pub fn qemu_img(args: &[&std::ffi::OsStr], out: &Path) -> io::Result<()> {
    let qemu_img = crate::doctor::which("qemu-img").ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "qemu-img is not installed (apt-get install qemu-utils; scripts/setup does)",
        )
    })?;
    let done = std::process::Command::new(qemu_img)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("run qemu-img: {e}")))?;
    if !done.status.success() {
        let _ = fs::remove_file(out);
        return Err(io::Error::other(format!(
            "qemu-img {} failed: {}",
            args.first().map_or("".into(), |a| a.to_string_lossy()),
            String::from_utf8_lossy(&done.stderr).trim()
        )));
    }
    Ok(())
}

/// Links each image of `stack` into `dir` (created) as `<first + i>.img`: a hard link,
/// so the image is stored once, or a copy where `dir` is on another filesystem.
pub fn link_stack(stack: &[std::path::PathBuf], dir: &Path, first: usize) -> io::Result<()> {
    link_named(stack, dir, |i, _| format!("{}.img", first + i))
}

/// Links each image of `stack` into `dir` (created) under the name `name(i, image)`.
fn link_named(
    stack: &[std::path::PathBuf],
    dir: &Path,
    name: impl Fn(usize, &Path) -> String,
) -> io::Result<()> {
    if stack.is_empty() {
        return Ok(());
    }
    fs::create_dir_all(dir)?;
    for (i, src) in stack.iter().enumerate() {
        link_or_copy(src, &dir.join(name(i, src)))?;
    }
    Ok(())
}

/// Hard-links the image `src` as `dst` (which must not exist): stored once; or copies it
/// where `dst` is on another filesystem.
pub fn link_or_copy(src: &Path, dst: &Path) -> io::Result<()> {
    match fs::hard_link(src, dst) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => copy_ephemeral(src, dst).map(drop),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("link the layer {}: {e}", src.display()),
        )),
    }
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

    /// A disk placed where no reflink is possible is an empty sparse file of the blank's
    /// size (nothing to write back when a loop device attaches it); filled, it is the
    /// blank byte for byte, holes kept. A second placement of the same path is refused.
    #[test]
    fn a_placed_disk_is_empty_until_filled_then_it_is_the_blank() {
        let dir = std::env::temp_dir().join(format!("locker-place-test-{}", std::process::id()));
        let blanks = dir.join("blanks");
        fs::create_dir_all(&blanks).unwrap();
        let img = dir.join("disk.img");
        let placed = place_blank(&img, 64, &blanks).unwrap();
        let blank = blanks.join("blank-ext4-64m.img");
        // None: a temp dir on btrfs or XFS, where the reflink is the whole disk at once.
        if let Some(fill) = placed {
            assert_eq!(fs::metadata(&img).unwrap().len(), 64 << 20);
            assert_eq!(allocated_bytes(&img), 0, "nothing written before the fill");
            fill.run().unwrap();
        }
        assert_eq!(fs::read(&img).unwrap(), fs::read(&blank).unwrap());
        assert!(allocated_bytes(&img) < 8 << 20, "holes stay holes");
        assert!(
            place_blank(&img, 64, &blanks).is_err(),
            "the disk must not exist"
        );
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

    /// The first bytes of a version 3 qcow2 header with `incompatible` feature bits.
    fn qcow2_header(incompatible: u64) -> Vec<u8> {
        let mut h = vec![0u8; 104];
        h[..4].copy_from_slice(b"QFI\xfb");
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[72..80].copy_from_slice(&incompatible.to_be_bytes());
        h
    }

    #[test]
    fn a_vm_stack_knows_each_format_by_name_and_refuses_what_the_host_did_not_make() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("locker-vmstack-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let snap = dir.join("snap");
        let lower = snap.join(SNAPSHOT_LOWERS);
        fs::create_dir_all(&lower).unwrap();
        // A raw image that starts like a qcow2 one (a guest wrote that): still raw.
        fs::write(lower.join("2.img"), qcow2_header(0)).unwrap();
        fs::write(lower.join("1.qcow2"), qcow2_header(0)).unwrap();
        fs::write(snap.join("disk.qcow2"), qcow2_header(0)).unwrap();
        let img = snap.join("disk.img");
        let stack = vm_stack_of(&img).unwrap();
        assert_eq!(
            stack,
            [
                snap.join("disk.qcow2"),
                lower.join("1.qcow2"),
                lower.join("2.img")
            ]
        );
        let formats: Vec<_> = stack.iter().map(|p| Format::of(p).unwrap()).collect();
        assert_eq!(formats, [Format::Qcow2, Format::Qcow2, Format::Raw]);
        // Linked into a machine with their extensions, one inode each.
        let m = dir.join("machine");
        link_vm_stack(&stack, &m.join(MACHINE_LAYERS), 0).unwrap();
        let linked = vm_machine_layers(&m);
        assert_eq!(
            linked,
            ["0.qcow2", "1.qcow2", "2.img"].map(|n| m.join(MACHINE_LAYERS).join(n))
        );
        for (a, b) in stack.iter().zip(&linked) {
            assert_eq!(
                fs::metadata(a).unwrap().ino(),
                fs::metadata(b).unwrap().ino()
            );
        }
        // A jail's view of the same directory sees raw images only.
        assert_eq!(machine_layers(&m), [m.join(MACHINE_LAYERS).join("2.img")]);
        // Both a raw and a qcow2 top: refused.
        fs::write(&img, b"raw").unwrap();
        assert!(vm_stack_of(&img).is_err());
        fs::remove_file(&img).unwrap();
        // One layer there twice, or one missing: refused.
        fs::write(lower.join("2.qcow2"), qcow2_header(0)).unwrap();
        assert!(vm_stack_of(&img).is_err());
        fs::rename(lower.join("2.qcow2"), lower.join("3.qcow2")).unwrap();
        fs::remove_file(lower.join("2.img")).unwrap();
        assert!(vm_stack_of(&img).is_err());
        fs::remove_file(lower.join("3.qcow2")).unwrap();
        fs::write(lower.join("2.img"), qcow2_header(0)).unwrap();
        assert!(vm_stack_of(&img).is_ok());
        // A qcow2 header naming an external data file: refused.
        fs::write(lower.join("1.qcow2"), qcow2_header(1 << 2)).unwrap();
        assert!(vm_stack_of(&img).is_err());
        fs::write(lower.join("1.qcow2"), qcow2_header(0)).unwrap();
        // A symlink where a layer was: refused.
        fs::remove_file(lower.join("2.img")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", lower.join("2.img")).unwrap();
        assert!(vm_stack_of(&img).is_err());
        // A stack ending in a qcow2 image: refused (its size is its raw bottom's).
        fs::remove_file(lower.join("2.img")).unwrap();
        assert!(vm_stack_of(&img).is_err());
        // An old snapshot: a raw image alone.
        let old = dir.join("old");
        fs::create_dir_all(&old).unwrap();
        fs::write(old.join("disk.img"), b"raw").unwrap();
        assert_eq!(
            vm_stack_of(&old.join("disk.img")).unwrap(),
            [old.join("disk.img")]
        );
        assert!(vm_stack_of(&dir.join("none/disk.img")).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_copy_never_follows_a_symlink() {
        let dir = std::env::temp_dir().join(format!("locker-nofollow-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.join("disk.img")).unwrap();
        assert!(copy(&dir.join("disk.img"), &dir.join("copy.img")).is_err());
        assert!(!dir.join("copy.img").exists());
        fs::remove_dir_all(&dir).unwrap();
    }
}
