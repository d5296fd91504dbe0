//! Ops on names: lookup, mkdir, mknod, symlink, remove, rename, link, readlink.

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use super::Channel;
use crate::fuse::codec::*;
use crate::fuse::nodes::*;
use crate::fuse::raw;
use crate::fuse::wire::*;
use crate::fuse::*;

impl Channel {
    /// Opens `name` under `parent` as an `O_PATH` fd, never following a symlink.
    pub(super) fn open_child(&self, parent: u64, name: &CStr) -> Res<OwnedFd> {
        let dir = self.nodes.dir(parent)?;
        Ok(raw::open_beneath(
            dir,
            name,
            libc::O_PATH | libc::O_NOFOLLOW,
            0,
        )?)
    }

    pub(super) fn lookup(&mut self, parent: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
        let name = one_name(body)?;
        let fd = self.open_child(parent, name)?;
        let (id, st) = self.nodes.adopt(fd)?;
        put_entry(out, id, &st);
        Ok(())
    }

    /// Who owns what a request creates under `dir`: the caller, with the directory's
    /// group when it is set-group-id (as the kernel does). Also says whether it is.
    pub(super) fn owner(&self, h: &InHeader, dir: RawFd) -> Res<(u32, u32, bool)> {
        let st = raw::stat(dir)?;
        if st.st_mode & libc::S_ISGID != 0 {
            Ok((h.uid, st.st_gid, true))
        } else {
            Ok((h.uid, h.gid, false))
        }
    }

    pub(super) fn mkdir(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
        self.writable()?;
        let (m, rest) = take::<MkdirIn>(body)?;
        let name = one_name(rest)?;
        let dir = self.nodes.dir(h.nodeid)?;
        let (uid, gid, sgid) = self.owner(h, dir)?;
        let mut mode = m.mode & !m.umask & 0o7777;
        if sgid {
            mode |= libc::S_ISGID;
        }
        raw::mkdirat(dir, name, 0)?;
        let undo = Undo::new(dir, name, libc::AT_REMOVEDIR);
        let fd = raw::open_beneath(
            dir,
            name,
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_DIRECTORY,
            0,
        )?;
        raw::chown(fd.as_raw_fd(), uid, gid)?;
        raw::chmod_via_proc(self.proc_fd, fd.as_raw_fd(), mode)?;
        let (id, st) = self.nodes.adopt(fd)?;
        undo.disarm();
        put_entry(out, id, &st);
        Ok(())
    }

    pub(super) fn mknod(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
        self.writable()?;
        let (m, rest) = take::<MknodIn>(body)?;
        let name = one_name(rest)?;
        // Regular files only: a device node, FIFO or socket made here would be one on the
        // host too.
        if !matches!(kind(m.mode), 0 | libc::S_IFREG) {
            return Err(Errno(libc::EPERM));
        }
        let dir = self.nodes.dir(h.nodeid)?;
        let (uid, gid, _) = self.owner(h, dir)?;
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
        let file = File::from(raw::open_beneath(dir, name, flags, 0)?);
        let undo = Undo::new(dir, name, 0);
        let (id, st) = self.own_new_file(&file, uid, gid, m.mode & !m.umask & 0o7777)?;
        undo.disarm();
        put_entry(out, id, &st);
        Ok(())
    }

    /// Makes a file just created (mode 0) the caller's with `mode`, and a node of it.
    pub(super) fn own_new_file(
        &mut self,
        file: &File,
        uid: u32,
        gid: u32,
        mode: u32,
    ) -> Res<(u64, libc::stat)> {
        raw::chown(file.as_raw_fd(), uid, gid)?;
        // After the chown: a chown drops set-user-id and set-group-id bits.
        raw::fchmod(file.as_raw_fd(), mode)?;
        let path = raw::reopen(self.proc_fd, file.as_raw_fd(), libc::O_PATH)?;
        self.nodes.adopt(path)
    }

    pub(super) fn symlink(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
        self.writable()?;
        let (name, target) = two_strings(body)?;
        let name = check_name(name)?;
        if target.is_empty() {
            return Err(Errno(libc::ENOENT));
        }
        if target.to_bytes().len() > PATH_MAX {
            return Err(Errno(libc::ENAMETOOLONG));
        }
        let dir = self.nodes.dir(h.nodeid)?;
        let (uid, gid, _) = self.owner(h, dir)?;
        raw::symlinkat(target, dir, name)?;
        let undo = Undo::new(dir, name, 0);
        let fd = raw::open_beneath(dir, name, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        if kind(raw::stat(fd.as_raw_fd())?.st_mode) != libc::S_IFLNK {
            // Replaced under us (another machine on the same volume): not ours to remove.
            undo.disarm();
            return Err(Errno(libc::EEXIST));
        }
        raw::chown(fd.as_raw_fd(), uid, gid)?;
        let (id, st) = self.nodes.adopt(fd)?;
        undo.disarm();
        put_entry(out, id, &st);
        Ok(())
    }

    pub(super) fn remove(&mut self, parent: u64, body: &[u8], flags: libc::c_int) -> Res {
        self.writable()?;
        let name = one_name(body)?;
        let dir = self.nodes.dir(parent)?;
        Ok(raw::unlinkat(dir, name, flags)?)
    }

    pub(super) fn rename(&mut self, parent: u64, newparent: u64, flags: u32, names: &[u8]) -> Res {
        self.writable()?;
        // RENAME_WHITEOUT (overlayfs's) and unknown bits are refused.
        if flags & !(libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE) != 0 {
            return Err(Errno(libc::EINVAL));
        }
        let (old, new) = two_strings(names)?;
        let (old, new) = (check_name(old)?, check_name(new)?);
        let from = self.nodes.dir(parent)?;
        let to = self.nodes.dir(newparent)?;
        Ok(raw::renameat2(from, old, to, new, flags)?)
    }

    pub(super) fn link(&mut self, newparent: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
        self.writable()?;
        let (l, rest) = take::<LinkIn>(body)?;
        let name = one_name(rest)?;
        let old = self.nodes.get(l.oldnodeid)?;
        if old.kind == libc::S_IFDIR {
            return Err(Errno(libc::EPERM));
        }
        let dir = self.nodes.dir(newparent)?;
        raw::link_fd(self.proc_fd, old.fd.as_raw_fd(), dir, name)?;
        let fd = self.open_child(newparent, name)?;
        let (id, st) = self.nodes.adopt(fd)?;
        put_entry(out, id, &st);
        Ok(())
    }

    pub(super) fn readlink(&mut self, id: u64, out: &mut Vec<u8>) -> Res {
        let n = self.nodes.get(id)?;
        if n.kind != libc::S_IFLNK {
            return Err(Errno(libc::EINVAL));
        }
        out.extend_from_slice(&raw::readlink(n.fd.as_raw_fd())?);
        Ok(())
    }
}
