//! Where sandboxes' disks and snapshots live, so that snapshots and forks share blocks
//! instead of copying them on any host.
//!
//! A snapshot of a jail is its disk image taken at one point; a fork takes one such point
//! for all its children. Where the data dir's filesystem can reflink (XFS, btrfs) that is
//! a metadata operation. On ext4, the common root filesystem, it is a copy of every byte the
//! sandbox wrote (a fork of a sandbox with 200 MB written: 3.5× ten creates), and this
//! kernel family often lacks device-mapper's block-level snapshots. So on such a host
//! Locker keeps the sandboxes' machine directories and the snapshots on a filesystem of
//! its own, as LXD and Incus do with their loop-backed storage pools: an XFS filesystem
//! with reflinks in a sparse image beside the rest of the data dir, `<data-dir>/disks.xfs`,
//! loop-mounted at `<data-dir>/disks` (`sandboxes/` and `snapshots/` in it). Hard links
//! and reflinks need both on one mount, which is why they move together.
//!
//! [`place`] decides, once per server start, and never moves existing data:
//! - an image already there is mounted (or its mount adopted after a crash) and used,
//!   whatever the mode: the records of the sandboxes and snapshots in it point there;
//! - otherwise, with [`Mode::Auto`], a data dir whose filesystem reflinks keeps the plain
//!   layout (`<data-dir>/sandboxes`, `<data-dir>/snapshots`); one that cannot and holds no
//!   sandbox or snapshot yet gets the image (sized as the host filesystem, sparse: it
//!   takes what is written, and `discard` gives deleted blocks back to the host); one that
//!   already holds some keeps the plain layout and copies (said in the log and by
//!   `locker doctor`);
//! - [`Mode::Off`] keeps the plain layout.
//!
//! The trade-off, stated in docs/operations.md: the image's filesystem believes it has the
//! host filesystem's whole size; if the host filesystem fills up, writes into the image
//! fail and XFS shuts the image's filesystem down (every sandbox's disk with it) until it
//! is remounted. The per-disk free-space check at create (which reads the host
//! filesystem) and the disk quota are what keep the host from filling.
//!
//! The mount is made in the host's mount namespace; a stopping server unmounts it when no
//! sandbox is left on it ([`release`]), else it outlives the server with its sandboxes and
//! the next start adopts it. The loop device detaches itself on the last unmount. This room does not know
//! sandboxes, snapshots or the API.

use std::fs;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The image beside the data dir's other contents.
pub const IMAGE: &str = "disks.xfs";
/// Where the image is mounted in the data dir.
pub const MOUNT: &str = "disks";
const MOUNT_OPTIONS: &str = "discard";

/// Whether [`place`] may make the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Make it on a data dir that cannot reflink and holds no sandbox yet.
    #[default]
    Auto,
    /// Never make it (one already made is still used).
    Off,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Mode::Auto),
            "off" => Ok(Mode::Off),
            _ => Err(format!("{s:?}: expected `auto` or `off`")),
        }
    }
}

/// How snapshots and forks get their data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sharing {
    /// The data dir's own filesystem reflinks.
    Reflinks,
    /// Locker's XFS image at `<data-dir>/disks` reflinks.
    Image,
    /// Copies, for the reason given.
    Copies(String),
}

/// Where sandboxes' machine directories and snapshots go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub sandboxes: PathBuf,
    pub snapshots: PathBuf,
    pub sharing: Sharing,
}

impl Placement {
    /// One line for logs and `locker doctor`.
    pub fn describe(&self) -> String {
        match &self.sharing {
            Sharing::Reflinks => {
                "snapshots and forks share blocks (the data dir's filesystem reflinks)".into()
            }
            Sharing::Image => format!(
                "snapshots and forks share blocks (Locker's XFS image, mounted at {})",
                self.sandboxes.parent().unwrap_or(Path::new("")).display()
            ),
            Sharing::Copies(why) => format!("snapshots and forks copy the sandbox's disk: {why}"),
        }
    }
}

/// What [`place`] will do with a data dir (which need not exist yet: the filesystem of its
/// nearest existing parent is probed). Changes nothing.
pub fn decide(data_dir: &Path, mode: Mode) -> Sharing {
    if data_dir.join(IMAGE).exists() {
        return Sharing::Image;
    }
    let existing = data_dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    if reflinks(existing) {
        return Sharing::Reflinks;
    }
    if mode == Mode::Off {
        return Sharing::Copies(
            "the data dir's filesystem cannot reflink and `--cow-disks off` keeps disks on it"
                .into(),
        );
    }
    if has_entries(&data_dir.join("sandboxes")) || has_entries(&data_dir.join("snapshots")) {
        return Sharing::Copies(
            "the data dir's filesystem cannot reflink, and it holds sandboxes or snapshots made before Locker's XFS image (a fresh data dir gets one)".into(),
        );
    }
    match support() {
        Ok(()) => Sharing::Image,
        Err(why) => Sharing::Copies(format!(
            "the data dir's filesystem cannot reflink, and {why}"
        )),
    }
}

/// Decides where sandboxes and snapshots live in `data_dir` (which exists), making or
/// mounting the image as the module doc says, and creates both directories.
pub fn place(data_dir: &Path, mode: Mode) -> io::Result<Placement> {
    let (img, mnt) = (data_dir.join(IMAGE), data_dir.join(MOUNT));
    let (base, sharing) = match decide(data_dir, mode) {
        Sharing::Image => {
            if !img.exists() {
                make(&img, data_dir)?;
            }
            crate::volume_fs::mount_image(&img, &mnt, "xfs", MOUNT_OPTIONS)?;
            (mnt, Sharing::Image)
        }
        other => (data_dir.to_path_buf(), other),
    };
    let p = Placement {
        sandboxes: base.join("sandboxes"),
        snapshots: base.join("snapshots"),
        sharing,
    };
    fs::create_dir_all(&p.sandboxes)?;
    fs::create_dir_all(&p.snapshots)?;
    Ok(p)
}

/// Whether this host can make the image: `Err(what is missing)`.
pub fn support() -> Result<(), String> {
    crate::volume_fs::loop_fs_support("xfs", "xfsprogs")
}

/// Whether files in `dir` can share blocks (`FICLONE` of a small file made there).
pub fn reflinks(dir: &Path) -> bool {
    let probe = dir.join(format!(".reflink-probe-{}", std::process::id()));
    let (a, b) = (probe.with_extension("a"), probe.with_extension("b"));
    let r = (|| -> io::Result<bool> {
        fs::write(&a, [0u8; 4096])?;
        let from = fs::File::open(&a)?;
        let to = fs::File::create(&b)?;
        Ok(locker_sys::ioctl::reflink(&from, &to))
    })();
    let _ = fs::remove_file(&a);
    let _ = fs::remove_file(&b);
    r.unwrap_or(false)
}

fn has_entries(dir: &Path) -> bool {
    fs::read_dir(dir).is_ok_and(|mut rd| rd.next().is_some())
}

/// Makes the image at `img`: sparse, the size of the filesystem holding `data_dir`, XFS
/// with reflinks. Made under a temporary name and renamed when whole, so a crash never
/// leaves a half-made image that a later start would take.
fn make(img: &Path, data_dir: &Path) -> io::Result<()> {
    let size = host_bytes(data_dir)?;
    let tmp = img.with_extension("xfs.tmp");
    let _ = fs::remove_file(&tmp);
    let r = (|| {
        // Root's alone: it holds every sandbox's disk (a microVM's QEMU runs as its
        // machine's uid and must not read it).
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?
            .set_len(size)?;
        let mkfs = crate::doctor::which("mkfs.xfs").ok_or_else(|| {
            io::Error::other("mkfs.xfs is not installed (apt-get install xfsprogs)")
        })?;
        let out = std::process::Command::new(mkfs)
            .args(["-q", "-f", "-m", "reflink=1"])
            .arg(&tmp)
            .stdin(std::process::Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "mkfs.xfs failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        fs::File::open(&tmp)?.sync_all()?;
        fs::rename(&tmp, img)?;
        fs::File::open(data_dir)?.sync_all()
    })();
    if r.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    r
}

/// The size of the filesystem holding `dir`.
fn host_bytes(dir: &Path) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    let d = fs::File::open(dir)?;
    let st = locker_sys::fd::fstatvfs(d.as_raw_fd())?;
    Ok(st.f_blocks * st.f_frsize)
}

/// Unmounts the image of `data_dir` when nothing uses it any more (a stopping server's last
/// step: sandboxes that keep running hold their disks on it, and then it stays mounted for
/// the next start). Whether it was unmounted; not mounted is `Ok(false)`.
pub fn release(data_dir: &Path) -> io::Result<bool> {
    let target = data_dir.join(MOUNT);
    if !crate::volume_fs::is_mounted(&target) {
        return Ok(false);
    }
    match crate::sys::umount(&target, 0) {
        Ok(()) => {
            // "Stopped" means the loop device is gone too (a user may remove the data dir
            // next, or a test look for debris).
            let img = data_dir.join(IMAGE);
            if !crate::volume_fs::wait_detached(&img, std::time::Duration::from_secs(5)) {
                tracing::warn!(image = %img.display(), "the disks image's loop device is still attached 5 s after its unmount");
            }
            Ok(true)
        }
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Unmounts the image of `data_dir` if it is mounted (for tests and `locker` tools that
/// remove a data dir; a server leaves it mounted). Lazily when still in use.
pub fn unmount(data_dir: &Path) -> io::Result<()> {
    crate::volume_fs::unmount_at(&data_dir.join(MOUNT))
}
