//! Step templates: the root filesystems a layered build (a Dockerfile) makes one step at a
//! time, each stored under the digest of its input like any other template.
//!
//! A step's tree starts as a hard-linked copy of its parent's ([`link_tree`]: directories
//! are new, every other entry is a link to the parent's inode, so the copy costs one
//! directory walk and no data), and the step's changes are then written over it as new
//! inodes ([`apply_upper`] for a machine's writable layer, [`copy_into`] for files from a
//! build context). Nothing ever writes through a link: a changed file is unlinked and
//! written anew, so the parent stays as it was. The tree is made in the cache's temporary
//! directory and renamed into place only when complete ([`TemplateStore::make_layer`]),
//! so no half-made template is ever visible.
//!
//! Paths inside the tree being made are resolved by [`resolve_in_root`], which follows
//! the tree's own symlinks as the machine would (an absolute target starts again at the
//! tree's root, `..` stops there) and never leaves it.
//!
//! This room does not run anything and does not know about Dockerfiles: the server's
//! template builds decide what a step is and call it.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use super::fsutil::*;
use super::progress::*;
use super::store::*;
use super::*;

/// Symlinks followed at most while resolving one path (as Linux's `MAXSYMLINKS`).
const MAX_SYMLINKS: usize = 40;

impl TemplateStore {
    /// The built template `digest` (64 hex digits), under no name.
    pub fn by_digest(&self, digest: &str) -> Result<Option<Template>, TemplateError> {
        if !is_digest(digest) {
            return Ok(None);
        }
        self.load(digest, "")
    }

    /// The template `digest`, made on template `parent` unless already built: `fill`
    /// writes its root filesystem into an empty path (which does not exist yet) in the
    /// cache's temporary directory; the result is renamed into place with `packages`,
    /// `config` and `parent` as its metadata. The digest's lock makes two builders of one
    /// digest make it once. Until a name points at it, it is a step template, which
    /// [`TemplateStore::prune_steps`] may remove.
    pub fn make_layer(
        &self,
        digest: &str,
        parent: &str,
        packages: Vec<String>,
        config: RunConfig,
        fill: impl FnOnce(&Path) -> Result<(), TemplateError>,
    ) -> Result<Template, TemplateError> {
        if !is_digest(digest) {
            return Err(TemplateError::InvalidSpec(format!(
                "{digest:?} is not a digest"
            )));
        }
        if self.is_built(digest) {
            return self.must_load(digest, "");
        }
        let lock = self.lock(digest, &mut NoProgress)?;
        if !self.is_built(digest) {
            let tmp = TmpDir::create(&self.templates, digest)?;
            fill(&tmp.path.join("rootfs"))?;
            let mut meta = Meta::new(digest, "", None, None, packages);
            meta.names.clear();
            meta.config = config;
            meta.parent = Some(parent.to_string());
            self.commit(tmp, meta, &mut NoProgress)?;
        }
        drop(lock);
        self.must_load(digest, "")
    }

    /// Points `name` at the built template `digest` and returns it under that name.
    pub fn name_digest(&self, name: &str, digest: &str) -> Result<Template, TemplateError> {
        validate_name(name)?;
        if !self.is_built(digest) {
            return Err(TemplateError::InvalidSpec(format!(
                "template {digest} is not built"
            )));
        }
        self.set_name(name, digest)?;
        self.must_load(digest, name)
    }
}

/// Makes `dst` (which must not exist) a copy of the tree `src` in which every entry but a
/// directory is a hard link to `src`'s. Directories get `src`'s owner, mode, times and
/// extended attributes.
pub fn link_tree(src: &Path, dst: &Path) -> io::Result<()> {
    let m = src.symlink_metadata()?;
    if !m.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a directory", src.display()),
        ));
    }
    fs::create_dir(dst)?;
    let mut dirs = vec![(src.to_path_buf(), dst.to_path_buf(), m)];
    let mut done = Vec::new();
    while let Some((s, d, m)) = dirs.pop() {
        for entry in fs::read_dir(&s)? {
            let entry = entry?;
            let (sp, dp) = (entry.path(), d.join(entry.file_name()));
            let em = sp.symlink_metadata()?;
            if em.is_dir() {
                fs::create_dir(&dp)?;
                dirs.push((sp, dp, em));
            } else {
                fs::hard_link(&sp, &dp)?;
            }
        }
        done.push((s, d, m));
    }
    // Attributes last, deepest first: a directory's times change as entries are added.
    for (s, d, m) in done.into_iter().rev() {
        copy_xattrs(&s, &d)?;
        set_attrs(&d, &m)?;
    }
    Ok(())
}

/// What [`apply_upper`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Paths written (files, symlinks, directories).
    pub written: u64,
    /// Paths deleted (whiteouts).
    pub deleted: u64,
    /// Bytes of file data copied.
    pub bytes: u64,
}

/// Writes an overlay's writable layer `upper` (plain: no redirects, no metacopy) over the
/// tree `root`: a whiteout deletes the path, an opaque directory replaces the one below,
/// any other directory is merged, files, symlinks, FIFOs and device nodes other than
/// whiteouts are copied in as new inodes with their owner, mode, times and extended
/// attributes (the overlay's own `trusted.overlay.*` left out). `skip` names paths
/// (relative, `/`-separated) that are the machine's own and not the build's.
pub fn apply_upper(upper: &Path, root: &Path, skip: &[&str]) -> io::Result<Applied> {
    let mut out = Applied::default();
    merge_dir(upper, root, "", skip, &mut out)?;
    Ok(out)
}

fn merge_dir(
    udir: &Path,
    root: &Path,
    rel: &str,
    skip: &[&str],
    out: &mut Applied,
) -> io::Result<()> {
    let mut names: Vec<_> = fs::read_dir(udir)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<io::Result<_>>()?;
    names.sort();
    for name in names {
        let r = if rel.is_empty() {
            name.to_string_lossy().into_owned()
        } else {
            format!("{rel}/{}", name.to_string_lossy())
        };
        if skip.contains(&r.as_str()) {
            continue;
        }
        let up = udir.join(&name);
        let dest = root.join(&r);
        let m = up.symlink_metadata()?;
        refuse_overlay_extras(&up)?;
        if m.file_type().is_char_device() && m.rdev() == 0 {
            if remove_any(&dest)? {
                out.deleted += 1;
            }
            continue;
        }
        if m.is_dir() {
            let below = dest.symlink_metadata().ok();
            let merge = below.as_ref().is_some_and(|b| b.is_dir()) && !is_opaque(&up);
            if !merge {
                remove_any(&dest)?;
                fs::create_dir(&dest)?;
            }
            merge_dir(&up, root, &r, skip, out)?;
            replace_xattrs(&up, &dest)?;
            set_attrs(&dest, &m)?;
            out.written += 1;
            continue;
        }
        remove_any(&dest)?;
        out.bytes += copy_entry(&up, &dest, &m)?;
        out.written += 1;
    }
    Ok(())
}

/// Refuses what a plain upper layer never holds: a directory renamed from below
/// (`redirect`) or a file whose data stayed below (`metacopy`).
fn refuse_overlay_extras(p: &Path) -> io::Result<()> {
    for name in [c"trusted.overlay.redirect", c"trusted.overlay.metacopy"] {
        let mut v = [0u8; 1];
        match locker_sys::xattr::get(p, name, &mut v) {
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => {}
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "{} carries {name:?}: the machine's overlay was mounted with redirects or metacopy, which a build cannot apply",
                        p.display()
                    ),
                ))
            }
        }
    }
    Ok(())
}

fn is_opaque(p: &Path) -> bool {
    let mut v = [0u8; 4];
    matches!(
        locker_sys::xattr::get(p, c"trusted.overlay.opaque", &mut v),
        Ok([b'y', ..])
    )
}

/// Removes whatever is at `p` (a directory with its contents); whether anything was there.
fn remove_any(p: &Path) -> io::Result<bool> {
    match p.symlink_metadata() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
        Ok(m) if m.is_dir() => locker_sys::fs::remove_tree(p).map(|()| true),
        Ok(_) => fs::remove_file(p).map(|()| true),
    }
}

/// Copies one non-directory entry to `dest` (which does not exist) with its attributes;
/// the bytes of data copied.
fn copy_entry(src: &Path, dest: &Path, m: &fs::Metadata) -> io::Result<u64> {
    let ft = m.file_type();
    let mut bytes = 0;
    if ft.is_symlink() {
        std::os::unix::fs::symlink(fs::read_link(src)?, dest)?;
    } else if ft.is_file() {
        let mut from = File::open(src)?;
        let mut to = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(dest)?;
        bytes = io::copy(&mut from, &mut to)?;
    } else if ft.is_fifo() || ft.is_char_device() || ft.is_block_device() {
        locker_sys::fs::mknod(dest, m.mode(), m.rdev())?;
    } else {
        // A socket means nothing in a root filesystem: left out.
        return Ok(0);
    }
    replace_xattrs(src, dest)?;
    set_attrs(dest, m)?;
    Ok(bytes)
}

/// Copies the regular file, symlink or directory tree `src` (on the host, outside any
/// machine) to `dest` inside a tree being made, which must not exist, owned by `owner`
/// when given (else by root, as Docker's COPY does) and with the mode `chmod` when given.
/// Symlinks are copied as symlinks, never followed; anything but a file, a symlink or a
/// directory is refused. Returns the bytes of data copied.
pub fn copy_into(
    src: &Path,
    dest: &Path,
    owner: Option<(u32, u32)>,
    chmod: Option<u32>,
) -> io::Result<u64> {
    let m = src.symlink_metadata()?;
    let (uid, gid) = owner.unwrap_or((0, 0));
    let ft = m.file_type();
    if ft.is_dir() {
        if dest.symlink_metadata().is_err() {
            fs::create_dir(dest)?;
        }
        let mut bytes = 0;
        let mut names: Vec<_> = fs::read_dir(src)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<_>>()?;
        names.sort();
        for name in names {
            let d = dest.join(&name);
            remove_any(&d)?;
            bytes += copy_into(&src.join(&name), &d, owner, chmod)?;
        }
        std::os::unix::fs::lchown(dest, Some(uid), Some(gid))?;
        let mode = chmod.unwrap_or(m.mode() & 0o7777);
        fs::set_permissions(dest, fs::Permissions::from_mode(mode))?;
        return Ok(bytes);
    }
    let bytes = if ft.is_symlink() {
        std::os::unix::fs::symlink(fs::read_link(src)?, dest)?;
        0
    } else if ft.is_file() {
        let mut from = File::open(src)?;
        let mut to = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(dest)?;
        io::copy(&mut from, &mut to)?
    } else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is neither a file, a symlink nor a directory",
                src.display()
            ),
        ));
    };
    std::os::unix::fs::lchown(dest, Some(uid), Some(gid))?;
    if !ft.is_symlink() {
        let mode = chmod.unwrap_or(m.mode() & 0o7777);
        fs::set_permissions(dest, fs::Permissions::from_mode(mode))?;
    }
    locker_sys::fs::set_times_nofollow(
        dest,
        (m.atime(), m.atime_nsec()),
        (m.mtime(), m.mtime_nsec()),
    )?;
    Ok(bytes)
}

/// Resolves `path` (absolute, as the machine would see it) inside the tree `root` the way
/// the machine would: symlinks in the tree are followed (an absolute target starts again
/// at `root`), `..` never climbs above `root`. The last component is followed too when
/// `follow_last`. Missing components are kept as they are (the result may not exist).
/// Fails on a symlink loop.
pub fn resolve_in_root(root: &Path, path: &str, follow_last: bool) -> io::Result<PathBuf> {
    let mut todo: Vec<PathBuf> = Vec::new();
    let mut parts: Vec<std::ffi::OsString> = Vec::new();
    push_components(Path::new(path), &mut todo);
    todo.reverse();
    let mut hops = 0;
    while let Some(c) = todo.pop() {
        let name = c.as_os_str();
        if name == OsStr::new("..") {
            parts.pop();
            continue;
        }
        let mut here = root.to_path_buf();
        here.extend(&parts);
        here.push(name);
        let last = todo.is_empty();
        match here.symlink_metadata() {
            Ok(m) if m.file_type().is_symlink() && (!last || follow_last) => {
                hops += 1;
                if hops > MAX_SYMLINKS {
                    return Err(io::Error::from_raw_os_error(libc::ELOOP));
                }
                let target = fs::read_link(&here)?;
                if target.is_absolute() {
                    parts.clear();
                }
                let mut more = Vec::new();
                push_components(&target, &mut more);
                todo.extend(more.into_iter().rev());
            }
            _ => parts.push(name.to_os_string()),
        }
    }
    let mut out = root.to_path_buf();
    out.extend(&parts);
    Ok(out)
}

fn push_components(p: &Path, out: &mut Vec<PathBuf>) {
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(PathBuf::from(n)),
            Component::ParentDir => out.push(PathBuf::from("..")),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
}

/// Owner, mode (not for a symlink) and times of `m` on `path`, without following it.
fn set_attrs(path: &Path, m: &fs::Metadata) -> io::Result<()> {
    std::os::unix::fs::lchown(path, Some(m.uid()), Some(m.gid()))?;
    if !m.file_type().is_symlink() {
        fs::set_permissions(path, fs::Permissions::from_mode(m.mode() & 0o7777))?;
    }
    locker_sys::fs::set_times_nofollow(
        path,
        (m.atime(), m.atime_nsec()),
        (m.mtime(), m.mtime_nsec()),
    )
}

/// Extended attributes of `src` onto `dst`, the overlay's own left out.
fn copy_xattrs(src: &Path, dst: &Path) -> io::Result<()> {
    let names = match locker_sys::xattr::list(src) {
        Ok(n) => n,
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut buf = vec![0u8; 64 * 1024];
    for name in names {
        if name.as_bytes().starts_with(b"trusted.overlay.") {
            continue;
        }
        let v = locker_sys::xattr::get(src, &name, &mut buf)?.to_vec();
        locker_sys::xattr::set(dst, &name, &v)?;
    }
    Ok(())
}

/// `dst`'s extended attributes made `src`'s (a merged directory keeps none of the old).
fn replace_xattrs(src: &Path, dst: &Path) -> io::Result<()> {
    if let Ok(old) = locker_sys::xattr::list(dst) {
        for name in old {
            let _ = locker_sys::xattr::remove(dst, &name);
        }
    }
    copy_xattrs(src, dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("locker-layer-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn resolve_stays_in_the_root() {
        let root = tmp("resolve");
        fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::os::unix::fs::symlink("usr/bin", root.join("bin")).unwrap();
        std::os::unix::fs::symlink("/../../etc", root.join("out")).unwrap();
        std::os::unix::fs::symlink("loop", root.join("loop")).unwrap();
        assert_eq!(
            resolve_in_root(&root, "/bin/sh", true).unwrap(),
            root.join("usr/bin/sh")
        );
        assert_eq!(
            resolve_in_root(&root, "/../../../x", true).unwrap(),
            root.join("x")
        );
        assert_eq!(
            resolve_in_root(&root, "/out/passwd", true).unwrap(),
            root.join("etc/passwd")
        );
        assert_eq!(
            resolve_in_root(&root, "/bin", false).unwrap(),
            root.join("bin")
        );
        assert!(resolve_in_root(&root, "/loop/x", true).is_err());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn link_then_apply_leaves_the_parent_alone() {
        let d = tmp("apply");
        let (parent, child, upper) = (d.join("parent"), d.join("child"), d.join("upper"));
        fs::create_dir_all(parent.join("etc")).unwrap();
        fs::write(parent.join("etc/a"), "old").unwrap();
        fs::write(parent.join("etc/gone"), "x").unwrap();
        link_tree(&parent, &child).unwrap();
        assert_eq!(
            fs::metadata(parent.join("etc/a")).unwrap().ino(),
            fs::metadata(child.join("etc/a")).unwrap().ino()
        );
        fs::create_dir_all(upper.join("etc")).unwrap();
        fs::create_dir_all(upper.join("new/dir")).unwrap();
        fs::write(upper.join("etc/a"), "new").unwrap();
        fs::write(upper.join("new/dir/f"), "f").unwrap();
        fs::write(upper.join("hostname"), "machine").unwrap();
        let applied = apply_upper(&upper, &child, &["hostname"]).unwrap();
        assert_eq!(fs::read_to_string(child.join("etc/a")).unwrap(), "new");
        assert_eq!(fs::read_to_string(parent.join("etc/a")).unwrap(), "old");
        assert_eq!(fs::read_to_string(child.join("new/dir/f")).unwrap(), "f");
        assert!(!child.join("hostname").exists());
        assert!(applied.bytes >= 4);
        fs::remove_dir_all(&d).unwrap();
    }
}
