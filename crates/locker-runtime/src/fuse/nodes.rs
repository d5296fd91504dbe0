//! What a channel holds for the guest: the node table (nodeid to an `O_PATH` fd,
//! deduplicated by inode and counted by lookups), open handles, directory streams, and
//! the undo guard for entries a failed create leaves half made.

use std::collections::HashMap;
use std::ffi::CStr;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use super::codec::*;
use super::raw;
use super::wire::*;
use super::*;

/// One inode the guest knows: its `O_PATH` fd and how many lookups the guest holds.
pub(super) struct Node {
    pub(super) fd: OwnedFd,
    pub(super) refs: u64,
    /// The file type (`S_IFMT` bits), fixed for the inode's life.
    pub(super) kind: u32,
    pub(super) key: (u64, u64),
}

/// A channel's nodes, by nodeid and by `(st_dev, st_ino)`.
pub(super) struct Nodes {
    pub(super) by_id: HashMap<u64, Node>,
    pub(super) by_key: HashMap<(u64, u64), u64>,
    pub(super) next: u64,
}

impl Nodes {
    pub(super) fn new(root: OwnedFd, st: &libc::stat) -> Self {
        let key = (st.st_dev, st.st_ino);
        let root = Node {
            fd: root,
            refs: 1,
            kind: kind(st.st_mode),
            key,
        };
        Nodes {
            by_id: HashMap::from([(ROOT_ID, root)]),
            by_key: HashMap::from([(key, ROOT_ID)]),
            next: ROOT_ID + 1,
        }
    }

    /// Forgets every node but the root (DESTROY).
    pub(super) fn reset(&mut self) {
        self.by_id.retain(|&id, _| id == ROOT_ID);
        self.by_key.retain(|_, &mut id| id == ROOT_ID);
    }

    pub(super) fn get(&self, id: u64) -> Res<&Node> {
        self.by_id.get(&id).ok_or(Errno(libc::ENOENT))
    }

    /// The node's fd, which must be a directory's.
    pub(super) fn dir(&self, id: u64) -> Res<RawFd> {
        let n = self.get(id)?;
        if n.kind != libc::S_IFDIR {
            return Err(Errno(libc::ENOTDIR));
        }
        Ok(n.fd.as_raw_fd())
    }

    /// Counts one lookup of the inode behind `fd`: the known node for its `(dev, ino)`, or a
    /// new one holding `fd`. Returns the nodeid and a fresh stat.
    pub(super) fn adopt(&mut self, fd: OwnedFd) -> Res<(u64, libc::stat)> {
        let st = raw::stat(fd.as_raw_fd())?;
        let key = (st.st_dev, st.st_ino);
        if let Some(&id) = self.by_key.get(&key) {
            let n = self.by_id.get_mut(&id).expect("by_key and by_id agree");
            n.refs = n.refs.saturating_add(1);
            return Ok((id, st));
        }
        if self.by_id.len() >= MAX_NODES {
            return Err(Errno(libc::ENFILE));
        }
        let id = self.next;
        self.next += 1;
        let node = Node {
            fd,
            refs: 1,
            kind: kind(st.st_mode),
            key,
        };
        self.by_id.insert(id, node);
        self.by_key.insert(key, id);
        Ok((id, st))
    }

    /// Takes a node a carried table names, under its old nodeid (see `carry`). Two nodeids
    /// of one inode (hard links the old side knew apart) both stay; lookups find the first.
    pub(super) fn insert(&mut self, id: u64, fd: OwnedFd, refs: u64) -> Res {
        if id == 0 || self.by_id.contains_key(&id) {
            return Err(Errno(libc::EEXIST));
        }
        let st = raw::stat(fd.as_raw_fd())?;
        let key = (st.st_dev, st.st_ino);
        self.by_key.entry(key).or_insert(id);
        self.by_id.insert(
            id,
            Node {
                fd,
                refs: refs.max(1),
                kind: kind(st.st_mode),
                key,
            },
        );
        Ok(())
    }

    /// Drops `n` lookups of a node; at none it goes (the root never does).
    pub(super) fn forget(&mut self, id: u64, n: u64) {
        if id == ROOT_ID {
            return;
        }
        let Some(node) = self.by_id.get_mut(&id) else {
            return;
        };
        node.refs = node.refs.saturating_sub(n);
        if node.refs == 0 {
            let key = node.key;
            self.by_id.remove(&id);
            if self.by_key.get(&key) == Some(&id) {
                self.by_key.remove(&key);
            }
        }
    }
}

/// An open file or directory of the guest's.
pub(super) struct Handle {
    pub(super) node: u64,
    pub(super) open: Open,
}

pub(super) enum Open {
    File(File),
    Dir(DirStream),
}

/// A directory being read: its fd, positioned by the `d_off` cookies of getdents64, and
/// the entries read from the host but not yet sent.
pub(super) struct DirStream {
    pub(super) fd: OwnedFd,
    pub(super) buf: Vec<u8>,
    pub(super) at: usize,
    pub(super) end: usize,
    /// The cookie of the stream's position: where the next unsent entry is.
    pub(super) pos: u64,
}

/// The fixed part of `struct linux_dirent64` before the name.
pub(super) const DIRENT64_NAME: usize = 19;

impl DirStream {
    pub(super) fn new(fd: OwnedFd) -> Self {
        DirStream {
            fd,
            buf: Vec::new(),
            at: 0,
            end: 0,
            pos: 0,
        }
    }

    /// Appends `fuse_dirent` records from `offset` on to `out` until the next would take
    /// it past `size` bytes (or the directory ends).
    pub(super) fn read(&mut self, from: u64, size: usize, out: &mut Vec<u8>) -> Res {
        if from != self.pos {
            raw::seek(self.fd.as_raw_fd(), offset(from)?, libc::SEEK_SET)?;
            self.at = 0;
            self.end = 0;
            self.pos = from;
        }
        let limit = out.len() + size;
        loop {
            if self.at == self.end {
                if self.buf.is_empty() {
                    self.buf = vec![0; 32 * 1024];
                }
                let n = raw::getdents64(self.fd.as_raw_fd(), &mut self.buf)?;
                if n == 0 {
                    return Ok(());
                }
                self.at = 0;
                self.end = n;
            }
            let e = &self.buf[self.at..self.end];
            if e.len() < DIRENT64_NAME + 1 {
                return Err(Errno(libc::EIO));
            }
            let ino = u64::get(e);
            let off = u64::get(&e[8..]);
            let reclen = usize::from(u16::get(&e[16..]));
            let typ = e[18];
            if reclen <= DIRENT64_NAME || reclen > e.len() {
                return Err(Errno(libc::EIO));
            }
            let name = &e[DIRENT64_NAME..reclen];
            let name = &name[..name.iter().position(|&c| c == 0).unwrap_or(name.len())];
            let rec = (Dirent::N + name.len() + 7) & !7;
            if out.len() + rec > limit {
                return Ok(());
            }
            let start = out.len();
            Dirent {
                ino,
                off,
                namelen: name.len() as u32,
                typ: u32::from(typ),
            }
            .put(out);
            out.extend_from_slice(name);
            out.resize(start + rec, 0);
            self.at += reclen;
            self.pos = off;
        }
    }
}

/// Removes an entry just created unless disarmed: what the server makes ends up the
/// caller's, or does not stay.
pub(super) struct Undo<'a> {
    pub(super) dir: RawFd,
    pub(super) name: &'a CStr,
    pub(super) flags: libc::c_int,
    pub(super) armed: bool,
}

impl<'a> Undo<'a> {
    pub(super) fn new(dir: RawFd, name: &'a CStr, flags: libc::c_int) -> Self {
        Undo {
            dir,
            name,
            flags,
            armed: true,
        }
    }
    pub(super) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = raw::unlinkat(self.dir, self.name, self.flags);
        }
    }
}
