//! Ops on directories: opendir and readdir.

use super::Channel;
use crate::fuse::codec::*;
use crate::fuse::nodes::*;
use crate::fuse::raw;
use crate::fuse::wire::*;
use crate::fuse::*;

impl Channel {
    pub(super) fn opendir(&mut self, id: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
        take::<OpenIn>(body)?;
        let dir = self.nodes.dir(id)?;
        let fd = raw::reopen(self.proc_fd, dir, libc::O_RDONLY | libc::O_DIRECTORY)?;
        let fh = self.add_handle(id, Open::Dir(DirStream::new(fd)))?;
        put_open(out, fh);
        Ok(())
    }

    pub(super) fn readdir(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
        let (r, _) = take::<ReadIn>(body)?;
        match self.handles.get_mut(&r.fh).map(|h| &mut h.open) {
            Some(Open::Dir(d)) => d.read(r.offset, (r.size as usize).min(MAX_READ), out),
            _ => Err(Errno(libc::EBADF)),
        }
    }
}
