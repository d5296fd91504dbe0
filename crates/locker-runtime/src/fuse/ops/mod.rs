//! A channel (one export served on one channel) and its dispatch: one `match` per opcode.
//! The ops live by family: [`entry`] (names: lookup, create, remove, rename, link),
//! [`file`] (open, read, write, sync, allocate, seek, copy), [`attr`] (setattr, statfs),
//! [`dir`] (opendir, readdir).

mod attr;
mod dir;
mod entry;
mod file;

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use super::codec::*;
use super::nodes::*;
use super::raw;
use super::wire::*;
use super::*;

/// One export served on one channel.
pub(super) struct Channel {
    pub(super) read_only: bool,
    pub(super) proc_fd: RawFd,
    pub(super) nodes: Nodes,
    pub(super) handles: HashMap<u64, Handle>,
    pub(super) next_fh: u64,
    /// INIT answered: anything else before it gets `EIO`.
    pub(super) ready: bool,
}

impl Channel {
    pub(super) fn new(e: &Export, proc_fd: RawFd) -> io::Result<Self> {
        let what = |err: io::Error| {
            io::Error::new(
                err.kind(),
                format!(
                    "opening export {} (channel {}): {err}",
                    e.root.display(),
                    e.channel
                ),
            )
        };
        let root = raw::open_dir(&e.root).map_err(what)?;
        let st = raw::stat(root.as_raw_fd()).map_err(what)?;
        Ok(Channel {
            read_only: e.read_only,
            proc_fd,
            nodes: Nodes::new(root, &st),
            handles: HashMap::new(),
            next_fh: 1,
            ready: false,
        })
    }

    pub(super) fn writable(&self) -> Res {
        if self.read_only {
            Err(Errno(libc::EROFS))
        } else {
            Ok(())
        }
    }

    pub(super) fn add_handle(&mut self, node: u64, open: Open) -> Res<u64> {
        if self.handles.len() >= MAX_HANDLES {
            return Err(Errno(libc::EMFILE));
        }
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, Handle { node, open });
        Ok(fh)
    }

    pub(super) fn file(&self, fh: u64) -> Res<&File> {
        match self.handles.get(&fh) {
            Some(Handle {
                open: Open::File(f),
                ..
            }) => Ok(f),
            _ => Err(Errno(libc::EBADF)),
        }
    }

    /// Answers one request into `out` (after the reserved headers). Requests that take
    /// no reply come here too; what they return is dropped.
    pub(super) fn dispatch(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
        if h.opcode == INIT {
            return self.init(body, out);
        }
        if !self.ready {
            return Err(Errno(libc::EIO));
        }
        let id = h.nodeid;
        match h.opcode {
            LOOKUP => self.lookup(id, body, out),
            FORGET => {
                let (f, _) = take::<ForgetIn>(body)?;
                self.nodes.forget(id, f.nlookup);
                Ok(())
            }
            BATCH_FORGET => self.batch_forget(body),
            INTERRUPT | NOTIFY_REPLY => Ok(()),
            DESTROY => {
                self.handles.clear();
                self.nodes.reset();
                self.ready = false;
                Ok(())
            }
            GETATTR => {
                take::<GetattrIn>(body)?;
                put_attr(out, &raw::stat(self.nodes.get(id)?.fd.as_raw_fd())?);
                Ok(())
            }
            SETATTR => self.setattr(id, body, out),
            READLINK => self.readlink(id, out),
            SYMLINK => self.symlink(h, body, out),
            MKNOD => self.mknod(h, body, out),
            MKDIR => self.mkdir(h, body, out),
            UNLINK => self.remove(id, body, 0),
            RMDIR => self.remove(id, body, libc::AT_REMOVEDIR),
            RENAME => {
                let (r, names) = take::<RenameIn>(body)?;
                self.rename(id, r.newdir, 0, names)
            }
            RENAME2 => {
                let (r, names) = take::<Rename2In>(body)?;
                self.rename(id, r.newdir, r.flags, names)
            }
            LINK => self.link(id, body, out),
            OPEN => self.open(id, body, out),
            CREATE => self.create(h, body, out),
            READ => self.read(body, out),
            WRITE => self.write(body, out),
            STATFS => self.statfs(id, out),
            RELEASE | RELEASEDIR => {
                let (r, _) = take::<ReleaseIn>(body)?;
                self.handles
                    .remove(&r.fh)
                    .map(drop)
                    .ok_or(Errno(libc::EBADF))
            }
            // Nothing to do at a close (no locks are served): ENOSYS makes the kernel stop
            // sending FLUSH, one round trip less per close.
            FLUSH => Err(Errno(libc::ENOSYS)),
            FSYNC | FSYNCDIR => self.fsync(body),
            OPENDIR => self.opendir(id, body, out),
            READDIR => self.readdir(body, out),
            // The guest kernel checks permissions itself (`default_permissions`).
            ACCESS => self.nodes.get(id).map(drop),
            FALLOCATE => self.fallocate(body),
            LSEEK => self.lseek(body, out),
            COPY_FILE_RANGE => self.copy_file_range(body, out),
            // Extended attributes (and everything else) are not served: ENOSYS makes the
            // kernel stop asking.
            _ => Err(Errno(libc::ENOSYS)),
        }
    }

    pub(super) fn init(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
        let (i, _) = take::<InitIn>(body)?;
        if i.major < 7 {
            return Err(Errno(libc::EPROTO));
        }
        if i.major > 7 {
            // The kernel then asks again with major 7.
            InitOut {
                major: 7,
                minor: OUR_MINOR,
                ..Default::default()
            }
            .put(out);
            return Ok(());
        }
        if i.minor < MIN_MINOR {
            return Err(Errno(libc::EPROTO));
        }
        InitOut {
            major: 7,
            minor: i.minor.min(OUR_MINOR),
            max_readahead: i.max_readahead,
            flags: i.flags & WANTED_FLAGS,
            max_background: 16,
            congestion_threshold: 12,
            max_write: MAX_WRITE,
            time_gran: 1,
            max_pages: MAX_PAGES,
            map_alignment: 0,
            flags2: 0,
            unused: [0; 7],
        }
        .put(out);
        self.ready = true;
        Ok(())
    }

    pub(super) fn batch_forget(&mut self, body: &[u8]) -> Res {
        let (b, mut rest) = take::<BatchForgetIn>(body)?;
        for _ in 0..b.count {
            let (f, r) = take::<ForgetOne>(rest)?;
            self.nodes.forget(f.nodeid, f.nlookup);
            rest = r;
        }
        Ok(())
    }
}
