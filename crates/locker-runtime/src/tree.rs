//! Directory trees on the host: what a volume is made of.
//!
//! Owns measuring a tree (the blocks it allocates, a hard-linked file counted once) and
//! copying one as cheaply as the filesystem allows: each regular file by reflink
//! (`FICLONE`: instant, blocks shared copy-on-write on btrfs and XFS), else by an in-kernel
//! copy (`copy_file_range`). A copy keeps what a later machine mounting it would see:
//! hard links, symlinks, modes, owners (canonical ids: root is 0) and modification times.
//! Extended attributes, sockets, FIFOs and device nodes are not copied (the files API makes
//! none of them). A copy is flushed once at the end (`syncfs`), not file by file; a
//! [`cow_view`] (a run's private view of a volume, thrown away after it) is not flushed.
//!
//! It never follows a symlink: a tree is read and written with `lstat`, `lchown` and
//! no-follow times, so a link pointing out of the tree leads nowhere on the host.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// How a tree was copied.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CopyStats {
    /// Regular files copied (hard links to one counted once).
    pub files: u64,
    /// Of those, how many were reflinked (shared blocks) rather than copied.
    pub reflinked: u64,
    /// Bytes the copy allocates, as [`allocated_bytes`] counts them.
    pub bytes: u64,
}

/// Bytes the tree under `root` allocates (its blocks), `root` itself excluded; a file with
/// several hard links is counted once. Entries that vanish during the walk are skipped.
pub fn allocated_bytes(root: &Path) -> io::Result<u64> {
    let mut seen: HashMap<(u64, u64), ()> = HashMap::new();
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound && dir != root => continue,
            Err(e) => return Err(e),
        };
        for e in rd {
            let e = e?;
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            if m.nlink() > 1 && !m.is_dir() && seen.insert((m.dev(), m.ino()), ()).is_some() {
                continue;
            }
            total += m.blocks() * 512;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    Ok(total)
}

/// Copies the tree under `src` to `dst`, which must not exist (it is created with `src`'s
/// mode, owner and times). On failure `dst` is removed again.
pub fn copy(src: &Path, dst: &Path) -> io::Result<CopyStats> {
    let stats = copy_with(src, dst, u64::MAX)?.expect("no file limit");
    crate::disk::flush(dst).inspect_err(|_| {
        let _ = fs::remove_dir_all(dst);
    })?;
    Ok(stats)
}

/// A private view of the tree under `src` at `dst` (which must not exist) for as long as
/// it lives: [`copy`] without the final flush (a view does not outlive a crash), given up
/// (`Ok(None)`, `dst` removed) when the tree holds more than `max_files` regular files.
/// On a filesystem with reflinks every file is one (no data is copied), so a writer that
/// later modifies a file of `src` in place leaves the view as it was, unlike hard links.
pub fn cow_view(src: &Path, dst: &Path, max_files: u64) -> io::Result<Option<CopyStats>> {
    copy_with(src, dst, max_files)
}

fn copy_with(src: &Path, dst: &Path, max_files: u64) -> io::Result<Option<CopyStats>> {
    let mut st = Copier {
        links: HashMap::new(),
        stats: CopyStats::default(),
        max_files,
    };
    let meta = src.symlink_metadata()?;
    if !meta.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a directory", src.display()),
        ));
    }
    fs::create_dir(dst)?;
    let opened = open_nofollow(src, libc::O_DIRECTORY).and_then(|d| {
        let m = d.metadata()?;
        Ok((d, m))
    });
    let walked = opened.and_then(|(d, m)| st.dir(&d, dst, &m));
    match walked {
        Ok(()) => {}
        Err(e) => {
            let _ = fs::remove_dir_all(dst);
            return match e.kind() {
                io::ErrorKind::FileTooLarge if st.stats.files > max_files => Ok(None),
                _ => Err(e),
            };
        }
    }
    st.stats.bytes = allocated_bytes(dst)?;
    Ok(Some(st.stats))
}

struct Copier {
    /// (dev, inode) of a multiply-linked source file → its first copy.
    links: HashMap<(u64, u64), PathBuf>,
    stats: CopyStats,
    /// More regular files than this: give up (with `FileTooLarge`).
    max_files: u64,
}

/// Opens `path` read-only without following it if it is a symlink (`ELOOP`) and without
/// blocking on a FIFO, with `extra` flags.
fn open_nofollow(path: &Path, extra: libc::c_int) -> io::Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | extra)
        .open(path)
}

/// `/proc/self/fd/<f>`: the open directory `f` itself, whatever its path is now.
fn fd_path(f: &fs::File) -> PathBuf {
    use std::os::fd::AsRawFd;
    Path::new("/proc/self/fd").join(f.as_raw_fd().to_string())
}

/// An entry that vanished, or was swapped for a symlink, between listing and opening: a
/// tree others write to changes under the walk; what is gone is not copied.
fn changed_meanwhile(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ELOOP)
}

impl Copier {
    /// Fills the existing directory `dst` from the open directory `src`, then gives it
    /// `meta`'s attributes. The source may be a tree others write to (a volume's live
    /// tree under a run's view): every directory is walked through its own open fd and
    /// every file read through an fd opened without following symlinks, so a directory
    /// swapped for a symlink mid-walk never leads the copy out of the tree.
    fn dir(&mut self, src: &fs::File, dst: &Path, meta: &fs::Metadata) -> io::Result<()> {
        let base = fd_path(src);
        for e in fs::read_dir(&base)? {
            let e = e?;
            let (from, to) = (base.join(e.file_name()), dst.join(e.file_name()));
            if to.symlink_metadata().is_ok() {
                // Listed twice: renamed away and back while the directory was read.
                continue;
            }
            let m = match from.symlink_metadata() {
                Ok(m) => m,
                Err(e) if changed_meanwhile(&e) => continue,
                Err(e) => return Err(e),
            };
            let ft = m.file_type();
            if ft.is_dir() {
                let sub = match open_nofollow(&from, libc::O_DIRECTORY) {
                    Ok(d) => d,
                    Err(e) if changed_meanwhile(&e) || e.raw_os_error() == Some(libc::ENOTDIR) => {
                        continue
                    }
                    Err(e) => return Err(e),
                };
                let m = sub.metadata()?;
                fs::create_dir(&to)?;
                self.dir(&sub, &to, &m)?;
            } else if ft.is_symlink() {
                let target = match fs::read_link(&from) {
                    Ok(t) => t,
                    Err(e) if changed_meanwhile(&e) || e.kind() == io::ErrorKind::InvalidInput => {
                        continue
                    }
                    Err(e) => return Err(e),
                };
                symlink(target, &to)?;
                attrs(&to, &m, false)?;
            } else if ft.is_file() {
                let f = match open_nofollow(&from, 0) {
                    Ok(f) => f,
                    Err(e) if changed_meanwhile(&e) => continue,
                    Err(e) => return Err(e),
                };
                // What was opened, not what was listed.
                let m = f.metadata()?;
                if m.is_file() {
                    self.file(f, &to, &m)?;
                }
            }
        }
        attrs(dst, meta, true)
    }

    fn file(&mut self, src: fs::File, to: &Path, m: &fs::Metadata) -> io::Result<()> {
        if m.nlink() > 1 {
            if let Some(first) = self.links.get(&(m.dev(), m.ino())) {
                return fs::hard_link(first, to);
            }
            self.links.insert((m.dev(), m.ino()), to.to_path_buf());
        }
        if self.stats.files >= self.max_files {
            self.stats.files += 1;
            return Err(io::Error::from(io::ErrorKind::FileTooLarge));
        }
        let mut dst = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(to)?;
        if crate::disk::reflink(&src, &dst) {
            self.stats.reflinked += 1;
        } else {
            io::copy(&mut &src, &mut dst)?;
        }
        self.stats.files += 1;
        drop(dst);
        attrs(to, m, true)
    }
}

/// Has the filesystem spread the directories made in `dir` (and the files in them) over
/// its space rather than pack them next to `dir`: `chattr +T` on ext4 (see
/// `sys::set_topdir`). For a directory whose subdirectories come and go by the hundred,
/// such as machines': ext4 without a journal skips every inode freed in the last minute
/// when it allocates one, so in one packed group each new inode costs a walk past all of
/// them. Fails on filesystems without the flag (they do not need it).
pub fn spread_subdirs(dir: &Path) -> io::Result<()> {
    crate::sys::set_topdir(dir)
}

/// Gives `path` the owner, mode and times of `m` (a directory or a file; the mode is not
/// set on a symlink).
pub fn copy_attrs(path: &Path, m: &fs::Metadata) -> io::Result<()> {
    attrs(path, m, !m.file_type().is_symlink())
}

/// Gives `path` the owner, mode (not for a symlink) and times of `m`. Owner first: a chown
/// clears set-id bits, which the mode then puts back.
fn attrs(path: &Path, m: &fs::Metadata, with_mode: bool) -> io::Result<()> {
    std::os::unix::fs::lchown(path, Some(m.uid()), Some(m.gid()))?;
    if with_mode {
        fs::set_permissions(path, fs::Permissions::from_mode(m.mode() & 0o7777))?;
    }
    crate::sys::set_times_nofollow(
        path,
        (m.atime(), m.atime_nsec()),
        (m.mtime(), m.mtime_nsec()),
    )
}

/// The directory holding `rel` (a path relative to `root`, `/`-separated, no `..`), opened
/// `O_PATH` without following any symlink on the way and without leaving `root`
/// (`openat2`: `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`), and the
/// last component's name. A tree others write to at the same time (a volume's live tree
/// under a commit) can swap a directory for a symlink at any moment: a path joined and
/// resolved the plain way would then lead anywhere on the host. Fails with `ELOOP` when a
/// component is a symlink, `ENOTDIR` or `ENOENT` when it is not a directory or missing,
/// `EINVAL` for an empty name or `..`.
pub fn parent_beneath(
    root: &fs::File,
    rel: &str,
) -> io::Result<(std::os::fd::OwnedFd, std::ffi::CString)> {
    use std::os::fd::AsRawFd;
    let rel = rel.trim_matches('/');
    let (dir, name) = rel.rsplit_once('/').unwrap_or(("", rel));
    if name.is_empty() || name == "." || name == ".." || rel.split('/').any(|c| c == "..") {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let dir = std::ffi::CString::new(if dir.is_empty() { "." } else { dir })
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let name =
        std::ffi::CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    let flags = libc::O_PATH | libc::O_DIRECTORY;
    let fd = locker_sys::fd::openat2(root.as_raw_fd(), &dir, flags, 0, resolve)?;
    Ok((fd, name))
}

/// `/proc/self/fd/<dir>/<name>`: a path whose every component but the last is the directory
/// `dir` itself (the kernel follows that magic link to the open directory, never a symlink
/// in the tree), for calls that take paths and do not follow their last component.
pub fn path_at(dir: &std::os::fd::OwnedFd, name: &std::ffi::CStr) -> PathBuf {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    Path::new("/proc/self/fd")
        .join(dir.as_raw_fd().to_string())
        .join(std::ffi::OsStr::from_bytes(name.to_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_keeps_links_modes_owners_times_and_is_independent() {
        let base = std::env::temp_dir().join(format!("locker-tree-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let (src, dst) = (base.join("src"), base.join("dst"));
        fs::create_dir_all(src.join("a/b")).unwrap();
        fs::write(src.join("a/b/f"), vec![7u8; 100_000]).unwrap();
        fs::set_permissions(src.join("a/b/f"), fs::Permissions::from_mode(0o751)).unwrap();
        fs::hard_link(src.join("a/b/f"), src.join("hl")).unwrap();
        symlink("/etc/passwd", src.join("out")).unwrap();
        crate::sys::set_times_nofollow(&src.join("a/b/f"), (1000, 0), (2000, 5)).unwrap();

        let stats = copy(&src, &dst).unwrap();
        assert_eq!(stats.files, 1, "a hard-linked file is copied once");
        assert!(stats.bytes >= 100_000);
        let f = dst.join("a/b/f").symlink_metadata().unwrap();
        assert_eq!(f.mode() & 0o7777, 0o751);
        assert_eq!((f.mtime(), f.mtime_nsec()), (2000, 5));
        assert_eq!(
            f.ino(),
            dst.join("hl").symlink_metadata().unwrap().ino(),
            "hard links stay linked"
        );
        assert_eq!(
            fs::read_link(dst.join("out")).unwrap(),
            Path::new("/etc/passwd")
        );
        assert_eq!(allocated_bytes(&dst).unwrap(), stats.bytes);

        fs::write(dst.join("a/b/f"), b"changed").unwrap();
        assert_eq!(
            fs::read(src.join("a/b/f")).unwrap().len(),
            100_000,
            "the copy is independent"
        );
        assert!(copy(&src, &dst).is_err(), "the target must not exist");
        let view = base.join("view");
        assert_eq!(cow_view(&src, &view, 1).unwrap().map(|s| s.files), Some(1));
        fs::write(src.join("second"), b"2").unwrap();
        fs::remove_dir_all(&view).unwrap();
        assert_eq!(cow_view(&src, &view, 1).unwrap(), None, "too many files");
        assert!(!view.exists(), "a view given up leaves nothing");
        assert!(
            dst.exists(),
            "a refused copy leaves the existing target alone"
        );
        fs::remove_dir_all(&base).unwrap();
    }
}
