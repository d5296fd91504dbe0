//! The mounts a machine is given besides its root: a host tree bound live ([`BindMount`])
//! and a copy-on-write overlay ([`OverlayMount`]), their checks, and the one place an
//! overlay is mounted (a jail's root, a run's overlay in a jail or in a microVM's file
//! server). Also where blank disk images are cached.
//!
//! It mounts only where its caller already stands (a jail's set-up, the file server's
//! private namespace): it never enters a namespace itself.

use std::ffi::OsStr;
use std::io;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sys;

/// The overlay options of every overlay but a jail's root: a renamed lower directory is
/// copied, so the upper layer is plain files, whiteouts and opaque directories.
pub(crate) const PLAIN_UPPER: &str = ",redirect_dir=off,index=off,metacopy=off";

/// A run's overlay (every [`OverlayMount`]) is [`PLAIN_UPPER`] and also `volatile` (Linux
/// 5.10): the overlay passes no sync to the volume's filesystem below it, neither a
/// command's `fsync` nor the whole-filesystem sync at its unmount, which on btrfs was one
/// transaction commit per run at its machine's teardown. Nothing is lost by it: the upper layer is the run's own,
/// never mounted again, and a commit flushes the volume's filesystem itself (`syncfs` on
/// the host, `crate::commit`) before its journal names any of the layer's files; a layer
/// that is not committed is thrown away. Kernels without the option mount it without.
const VOLATILE: &str = ",volatile";

/// Whether the kernel refused `volatile` once in this process (then it is not asked again).
static NO_VOLATILE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Mounts a run's overlay ([`PLAIN_UPPER`] and [`VOLATILE`], or without the latter where the
/// kernel does not know it) with [`mount_overlay`]'s arguments.
pub(crate) fn mount_run_layers(
    lower: &Path,
    upper: &Path,
    work: &Path,
    target: &Path,
    flags: libc::c_ulong,
    base: u32,
) -> io::Result<()> {
    use std::sync::atomic::Ordering;
    if NO_VOLATILE.load(Ordering::Relaxed) {
        return mount_overlay(lower, upper, work, target, flags, PLAIN_UPPER, base);
    }
    let volatile = format!("{PLAIN_UPPER}{VOLATILE}");
    match mount_overlay(lower, upper, work, target, flags, &volatile, base) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            // Only a mount that works without the option says the kernel lacks it.
            mount_overlay(lower, upper, work, target, flags, PLAIN_UPPER, base)?;
            NO_VOLATILE.store(true, Ordering::Relaxed);
            Ok(())
        }
        done => done,
    }
}

/// A mount that cannot be made as asked.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("bad mount target {}", .0.display())]
    BadTarget(PathBuf),
    #[error("bad overlay upper/work")]
    BadLayers,
    #[error("an overlay's upper and work must share their parent")]
    SplitLayers,
}

/// Where blank disk images are kept: `$LOCKER_CACHE_DIR/disks` (default
/// `/var/cache/locker/disks`), shared by every data dir like the templates.
pub fn blank_disks_dir() -> PathBuf {
    std::env::var_os("LOCKER_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/locker"))
        .join("disks")
}

/// A host directory (canonical ids) bound into a machine at `target`, id-mapped so the
/// machine's root owns what the host's root owns; every machine binding it sees one live
/// tree.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BindMount {
    pub source: PathBuf,
    /// An absolute path inside the machine (not `/`).
    pub target: PathBuf,
    pub read_only: bool,
}

/// An overlay mounted in a machine at `target`: `lower` (host tree, canonical ids, never
/// written) under `upper` (host directory, canonical ids) with `work` beside it. `upper`
/// and `work` must share their parent directory: that parent is bound read-write, `lower`
/// read-only, both id-mapped into the machine, so the files keep canonical ids on the host.
/// Mounted with `redirect_dir=off,index=off,metacopy=off`: a renamed lower directory is
/// copied (plus a whiteout), so the upper layer is plain files, directories, whiteouts
/// (character devices 0:0) and opaque directories (`trusted.overlay.opaque=y`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct OverlayMount {
    pub lower: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    /// An absolute path inside the machine (not `/`).
    pub target: PathBuf,
}

/// An overlay's parts once checked: its target relative to the machine's root, the
/// directory holding `upper` and `work`, and their names in it.
pub(crate) struct OverlayParts<'a> {
    pub rel: &'a Path,
    pub rw: &'a Path,
    pub upper: &'a OsStr,
    pub work: &'a OsStr,
}

impl OverlayMount {
    /// Checks the overlay: a good target, and `upper` and `work` in one directory.
    pub(crate) fn parts(&self) -> Result<OverlayParts<'_>, MountError> {
        let rel = target_rel(&self.target)?;
        let (Some(rw), Some(upper), Some(work)) = (
            self.upper.parent(),
            self.upper.file_name(),
            self.work.file_name(),
        ) else {
            return Err(MountError::BadLayers);
        };
        if self.work.parent() != Some(rw) {
            return Err(MountError::SplitLayers);
        }
        Ok(OverlayParts {
            rel,
            rw,
            upper,
            work,
        })
    }
}

/// The machine-relative path of a mount target: absolute, not `/`, no `..`.
pub(crate) fn target_rel(target: &Path) -> Result<&Path, MountError> {
    let rel = target.strip_prefix("/").unwrap_or(target);
    if !target.is_absolute()
        || rel.as_os_str().is_empty()
        || rel.components().any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err(MountError::BadTarget(target.to_owned()));
    }
    Ok(rel)
}

/// Mounts a run's overlay on the host side at `at` (canonical ids; the microVM file
/// server's private root, see [`crate::vm_fs`]) with the options a jail run's has, so its
/// upper layer reads the same.
pub(crate) fn mount_run_overlay(m: &OverlayMount, at: &Path) -> io::Result<()> {
    mount_run_layers(
        &m.lower,
        &m.upper,
        &m.work,
        at,
        libc::MS_NODEV | libc::MS_NOSUID,
        0,
    )
}

/// The one place overlays are mounted: `lower` under `upper` (+ `work`) at `target`, with
/// the machine's filesystem ids (`base`: the id-mapped upper layer needs a mounter whose
/// ids it maps) and `extra` options appended.
pub(crate) fn mount_overlay(
    lower: &Path,
    upper: &Path,
    work: &Path,
    target: &Path,
    flags: libc::c_ulong,
    extra: &str,
    base: u32,
) -> io::Result<()> {
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}{extra}",
        lower.display(),
        upper.display(),
        work.display()
    );
    sys::with_fs_ids(base, || {
        sys::mount(Some("overlay"), target, Some("overlay"), flags, Some(&opts))
    })
    .and_then(|r| r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_targets_must_be_absolute_and_below_the_root() {
        for bad in ["", "/", "rel", "/a/../b"] {
            assert!(target_rel(Path::new(bad)).is_err(), "{bad:?} is refused");
        }
        assert_eq!(target_rel(Path::new("/a/b")).unwrap(), Path::new("a/b"));
    }

    #[test]
    fn an_overlays_upper_and_work_must_share_their_parent() {
        let m = |upper: &str, work: &str| OverlayMount {
            lower: "/l".into(),
            upper: upper.into(),
            work: work.into(),
            target: "/t".into(),
        };
        assert!(matches!(
            m("/x/up", "/y/wk").parts(),
            Err(MountError::SplitLayers)
        ));
        let ok = m("/x/up", "/x/wk");
        let p = ok.parts().unwrap();
        assert_eq!(
            (p.rel, p.rw, p.upper, p.work),
            (
                Path::new("t"),
                Path::new("/x"),
                OsStr::new("up"),
                OsStr::new("wk")
            )
        );
    }
}
