//! Ops on attributes: setattr and statfs.

use std::fs::File;
use std::os::fd::AsRawFd;

use super::Channel;
use crate::fuse::codec::*;
use crate::fuse::nodes::*;
use crate::fuse::raw;
use crate::fuse::wire::*;

impl Channel {
    pub(super) fn setattr(&mut self, id: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
        let (s, _) = take::<SetattrIn>(body)?;
        let changes = FATTR_MODE
            | FATTR_UID
            | FATTR_GID
            | FATTR_SIZE
            | FATTR_ATIME
            | FATTR_MTIME
            | FATTR_ATIME_NOW
            | FATTR_MTIME_NOW;
        if s.valid & changes != 0 {
            self.writable()?;
        }
        let n = self.nodes.get(id)?;
        let fd = n.fd.as_raw_fd();
        // Owner first: a chown drops set-id bits a mode in the same request may set.
        if s.valid & (FATTR_UID | FATTR_GID) != 0 {
            let uid = if s.valid & FATTR_UID != 0 {
                s.uid
            } else {
                u32::MAX
            };
            let gid = if s.valid & FATTR_GID != 0 {
                s.gid
            } else {
                u32::MAX
            };
            raw::chown(fd, uid, gid)?;
        }
        if s.valid & FATTR_MODE != 0 {
            if n.kind == libc::S_IFLNK {
                return Err(Errno(libc::EOPNOTSUPP));
            }
            raw::chmod_via_proc(self.proc_fd, fd, s.mode & 0o7777)?;
        }
        if s.valid & FATTR_SIZE != 0 {
            let size = offset(s.size)?;
            match n.kind {
                libc::S_IFREG => {}
                libc::S_IFDIR => return Err(Errno(libc::EISDIR)),
                _ => return Err(Errno(libc::EINVAL)),
            }
            let by_handle = match self.handles.get(&s.fh) {
                Some(Handle {
                    node,
                    open: Open::File(f),
                }) if s.valid & FATTR_FH != 0 && *node == id => f.set_len(size as u64).is_ok(),
                _ => false,
            };
            if !by_handle {
                let f = File::from(raw::reopen(self.proc_fd, fd, libc::O_WRONLY)?);
                f.set_len(size as u64)?;
            }
        }
        let time = |now: u32, set: u32, sec: u64, nsec: u32| -> Res<libc::timespec> {
            if s.valid & now != 0 {
                Ok(libc::timespec {
                    tv_sec: 0,
                    tv_nsec: libc::UTIME_NOW,
                })
            } else if s.valid & set != 0 {
                if nsec >= 1_000_000_000 {
                    return Err(Errno(libc::EINVAL));
                }
                Ok(libc::timespec {
                    tv_sec: sec as i64,
                    tv_nsec: i64::from(nsec),
                })
            } else {
                Ok(libc::timespec {
                    tv_sec: 0,
                    tv_nsec: libc::UTIME_OMIT,
                })
            }
        };
        if s.valid & (FATTR_ATIME | FATTR_MTIME | FATTR_ATIME_NOW | FATTR_MTIME_NOW) != 0 {
            let times = [
                time(FATTR_ATIME_NOW, FATTR_ATIME, s.atime, s.atimensec)?,
                time(FATTR_MTIME_NOW, FATTR_MTIME, s.mtime, s.mtimensec)?,
            ];
            raw::set_times(fd, &times)?;
        }
        put_attr(out, &raw::stat(fd)?);
        Ok(())
    }

    pub(super) fn statfs(&mut self, id: u64, out: &mut Vec<u8>) -> Res {
        let s = raw::statvfs(self.nodes.get(id)?.fd.as_raw_fd())?;
        Kstatfs {
            blocks: s.f_blocks,
            bfree: s.f_bfree,
            bavail: s.f_bavail,
            files: s.f_files,
            ffree: s.f_ffree,
            bsize: s.f_bsize as u32,
            namelen: s.f_namemax as u32,
            frsize: s.f_frsize as u32,
            padding: 0,
            spare: [0; 6],
        }
        .put(out);
        Ok(())
    }
}
