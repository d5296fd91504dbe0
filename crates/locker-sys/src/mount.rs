//! Mounts: `mount(2)`, binds, id-mapped trees (the new mount API), unmounts and the pivot
//! into a new root. Owns the kernel structs of the mount API; which mounts a machine gets
//! is the caller's business.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;

use crate::{check, cstr, cstring, owned};

/// `mount(2)` with optional source, fstype and data.
pub fn mount(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let src = src.map(cstring).transpose()?;
    let fstype = fstype.map(cstring).transpose()?;
    let data = data.map(cstring).transpose()?;
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

/// Bind-mounts `src` on `target`, then applies `extra` flags (e.g. read-only) with a remount.
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

/// Detaches the mount at `path` (`MNT_DETACH`: gone from the tree now, freed when unused).
pub fn umount_detach(path: &Path) -> io::Result<()> {
    umount(path, libc::MNT_DETACH)
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
    // SAFETY: open_tree with a valid path string; `owned` takes the new fd it returns.
    let tree = owned(unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            s.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as u32 | AT_RECURSIVE,
        )
    })?;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP | if read_only { MOUNT_ATTR_RDONLY } else { 0 },
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns as u64,
    };
    // SAFETY: `attr` lives across the call and its size is passed; `tree` is a valid fd.
    check(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
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
    // SAFETY: both fds and strings are valid for the call.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
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

/// `chroot(".")`: the current directory becomes this process's `/` (its mounts stay
/// reachable through open fds, so callers that mean it detach or drop those first).
pub fn chroot_cwd() -> io::Result<()> {
    // SAFETY: a static string.
    check(unsafe { libc::chroot(c".".as_ptr()) }.into()).map(drop)
}

/// Moves the mount at the current directory onto `/` and makes it the root
/// (`mount --move . /; chroot .`): how an initramfs hands over to the real root, where
/// `pivot_root` is not allowed.
pub fn move_to_root() -> io::Result<()> {
    let (dot, slash) = (c".".as_ptr(), c"/".as_ptr());
    let none = std::ptr::null();
    // SAFETY: static strings and null pointers; MS_MOVE of the caller's own mount.
    let rc = unsafe { libc::mount(dot, slash, none, libc::MS_MOVE, none.cast()) };
    check(rc.into())?;
    chroot_cwd()
}
