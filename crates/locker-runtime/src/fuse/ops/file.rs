//! Ops on open files: open, create, read, write, fsync, fallocate, lseek, copy_file_range.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use super::Channel;
use crate::fuse::codec::*;
use crate::fuse::nodes::*;
use crate::fuse::raw;
use crate::fuse::wire::*;
use crate::fuse::*;

impl Channel {
    /// Host open flags for a guest's: the access mode, `O_TRUNC` and the sync bits; never
    /// `O_APPEND` (offsets come with every write), `O_DIRECT`, `O_CREAT` or `O_EXCL`.
    pub(super) fn host_flags(&self, flags: u32) -> Res<libc::c_int> {
        let flags = flags as libc::c_int;
        let access = flags & libc::O_ACCMODE;
        if access == libc::O_ACCMODE {
            return Err(Errno(libc::EINVAL));
        }
        if self.read_only && (access != libc::O_RDONLY || flags & libc::O_TRUNC != 0) {
            return Err(Errno(libc::EROFS));
        }
        Ok(access | (flags & (libc::O_TRUNC | libc::O_SYNC | libc::O_DSYNC)))
    }

    pub(super) fn open(&mut self, id: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
        let (o, _) = take::<OpenIn>(body)?;
        let flags = self.host_flags(o.flags)?;
        let n = self.nodes.get(id)?;
        let file = match n.kind {
            libc::S_IFREG => File::from(raw::reopen(self.proc_fd, n.fd.as_raw_fd(), flags)?),
            libc::S_IFDIR => return Err(Errno(libc::EISDIR)),
            // Device nodes, FIFOs, sockets and symlinks are never opened on the host.
            _ => return Err(Errno(libc::EACCES)),
        };
        let fh = self.add_handle(id, Open::File(file))?;
        put_open(out, fh);
        Ok(())
    }

    pub(super) fn create(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
        self.writable()?;
        let (c, rest) = take::<CreateIn>(body)?;
        let name = one_name(rest)?;
        let flags = self.host_flags(c.flags)?;
        let dir = self.nodes.dir(h.nodeid)?;
        let (uid, gid, _) = self.owner(h, dir)?;
        let create = (flags & !libc::O_TRUNC) | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
        let (id, st, file) = match raw::open_beneath(dir, name, create, 0) {
            Ok(fd) => {
                let file = File::from(fd);
                let undo = Undo::new(dir, name, 0);
                let (id, st) = self.own_new_file(&file, uid, gid, c.mode & !c.umask & 0o7777)?;
                undo.disarm();
                (id, st, file)
            }
            // It appeared since the guest looked (another machine): open it as OPEN would.
            Err(e)
                if e.raw_os_error() == Some(libc::EEXIST) && c.flags as i32 & libc::O_EXCL == 0 =>
            {
                let path = self.open_child(h.nodeid, name)?;
                let st = raw::stat(path.as_raw_fd())?;
                match kind(st.st_mode) {
                    libc::S_IFREG => {}
                    libc::S_IFDIR => return Err(Errno(libc::EISDIR)),
                    _ => return Err(Errno(libc::EACCES)),
                }
                let file = File::from(raw::reopen(self.proc_fd, path.as_raw_fd(), flags)?);
                let (id, st) = self.nodes.adopt(path)?;
                (id, st, file)
            }
            Err(e) => return Err(e.into()),
        };
        let fh = match self.add_handle(id, Open::File(file)) {
            Ok(fh) => fh,
            Err(e) => {
                self.nodes.forget(id, 1);
                return Err(e);
            }
        };
        put_entry(out, id, &st);
        put_open(out, fh);
        Ok(())
    }

    pub(super) fn read(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
        let (r, _) = take::<ReadIn>(body)?;
        let file = self.file(r.fh)?;
        let mut at = offset(r.offset)?;
        let size = (r.size as usize).min(MAX_READ);
        let start = out.len();
        out.resize(start + size, 0);
        let mut got = 0;
        // A short reply means end of file to the kernel: fill it unless the file ends.
        while got < size {
            match file.read_at(&mut out[start + got..], at as u64) {
                Ok(0) => break,
                Ok(n) => {
                    got += n;
                    at = at.checked_add(n as i64).ok_or(Errno(libc::EOVERFLOW))?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    out.truncate(start);
                    return Err(e.into());
                }
            }
        }
        out.truncate(start + got);
        Ok(())
    }

    pub(super) fn write(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
        self.writable()?;
        let (w, data) = take::<WriteIn>(body)?;
        if data.len() != w.size as usize {
            return Err(Errno(libc::EINVAL));
        }
        let at = offset(w.offset)?;
        at.checked_add(data.len() as i64)
            .ok_or(Errno(libc::EFBIG))?;
        self.file(w.fh)?.write_all_at(data, at as u64)?;
        WriteOut {
            size: w.size,
            padding: 0,
        }
        .put(out);
        Ok(())
    }

    pub(super) fn fsync(&mut self, body: &[u8]) -> Res {
        let (f, _) = take::<FsyncIn>(body)?;
        let data_only = f.fsync_flags & FUSE_FSYNC_FDATASYNC != 0;
        match self.handles.get(&f.fh).map(|h| &h.open) {
            Some(Open::File(file)) if data_only => Ok(file.sync_data()?),
            Some(Open::File(file)) => Ok(file.sync_all()?),
            Some(Open::Dir(d)) => Ok(raw::fsync(d.fd.as_raw_fd())?),
            None => Err(Errno(libc::EBADF)),
        }
    }

    pub(super) fn fallocate(&mut self, body: &[u8]) -> Res {
        self.writable()?;
        let (f, _) = take::<FallocateIn>(body)?;
        let file = self.file(f.fh)?;
        Ok(raw::fallocate(
            file.as_raw_fd(),
            f.mode as i32,
            offset(f.offset)?,
            offset(f.length)?,
        )?)
    }

    pub(super) fn lseek(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
        let (l, _) = take::<LseekIn>(body)?;
        let whence = l.whence as libc::c_int;
        // The kernel answers SEEK_SET, SEEK_CUR and SEEK_END itself.
        if whence != libc::SEEK_DATA && whence != libc::SEEK_HOLE {
            return Err(Errno(libc::EINVAL));
        }
        let file = self.file(l.fh)?;
        let at = raw::seek(file.as_raw_fd(), offset(l.offset)?, whence)?;
        LseekOut { offset: at }.put(out);
        Ok(())
    }

    pub(super) fn copy_file_range(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
        self.writable()?;
        let (c, _) = take::<CopyFileRangeIn>(body)?;
        if c.flags != 0 {
            return Err(Errno(libc::EINVAL));
        }
        match self.handles.get(&c.fh_out) {
            Some(h) if h.node == c.nodeid_out => {}
            _ => return Err(Errno(libc::EBADF)),
        }
        let from = self.file(c.fh_in)?.as_raw_fd();
        let to = self.file(c.fh_out)?.as_raw_fd();
        let len = c.len.min(MAX_COPY) as usize;
        let n = raw::copy_file_range(from, offset(c.off_in)?, to, offset(c.off_out)?, len)?;
        WriteOut {
            size: n as u32,
            padding: 0,
        }
        .put(out);
        Ok(())
    }
}
