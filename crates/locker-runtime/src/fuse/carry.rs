//! A server's state handed to another: what lets a guest's mounts go on when its microVM
//! moves to another host, or starts again from a move's snapshot.
//!
//! The guest's kernel keeps the nodeids and file handles this server gave out; a fresh
//! server would know none of them. [`Table`] writes each channel's down by name: every
//! node as its path beneath the export (with its lookup count), every open handle as its
//! node and access mode. [`Channel::restore`] opens them again beneath the new server's
//! export, under the same numbers, and goes on counting from where the old one was.
//!
//! The table is taken while the guest's relay holds every request (the agent's
//! `share::hold`): nothing is in flight, so the table is the whole state, and the export
//! it names (a volume, moved with the VM) is not written meanwhile.
//!
//! What does not come along, said here because the guest notices: a node whose inode
//! has no name any more (unlinked while the guest held it open) or whose path is gone on
//! the new side is unknown to the new server (`ENOENT`, and `EBADF` for a handle on it);
//! a directory being read starts again from its beginning; inode numbers are the new
//! filesystem's. Paths are resolved one component at a time beneath the export, as a
//! guest's names are (no symlink followed, no mount crossed): a table, wherever it was
//! read from, reaches nothing outside the export.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use serde::{Deserialize, Serialize};

use super::nodes::{DirStream, Node, Open};
use super::ops::Channel;
use super::raw;
use super::{MAX_HANDLES, MAX_NODES, ROOT_ID};

/// Every channel's state, as [`super::Server::table`] writes it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Table {
    pub channels: Vec<ChannelTable>,
}

/// One channel's nodes and handles.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ChannelTable {
    pub channel: u32,
    /// The guest's INIT was answered (a restored channel does not see it again).
    pub ready: bool,
    pub next_id: u64,
    pub next_fh: u64,
    pub nodes: Vec<NodeEntry>,
    pub handles: Vec<HandleEntry>,
    /// Nodes left out: their inode had no name any more.
    pub unnamed: u64,
}

/// A node: its path beneath the export (hex of its bytes; empty for the root).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeEntry {
    pub id: u64,
    pub path: String,
    pub refs: u64,
}

/// An open handle: its node, and the host flags of a file (access mode, sync bits).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HandleEntry {
    pub fh: u64,
    pub node: u64,
    pub dir: bool,
    pub flags: i32,
}

/// What a restore could not bring back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Restored {
    pub nodes: usize,
    pub handles: usize,
    /// Nodes unnamed in the table or not found beneath the new export.
    pub lost_nodes: u64,
    pub lost_handles: u64,
}

/// The host flags a file handle keeps across a restore.
const KEPT_FLAGS: libc::c_int = libc::O_ACCMODE | libc::O_SYNC | libc::O_DSYNC;

impl Channel {
    /// This channel's state, by name.
    pub(super) fn table(&self, channel: u32) -> io::Result<ChannelTable> {
        let root = self
            .nodes
            .get(ROOT_ID)
            .map_err(|_| io::Error::from_raw_os_error(libc::ENOENT))?;
        let root_at = self.path_of(root)?;
        let mut t = ChannelTable {
            channel,
            ready: self.ready,
            next_id: self.nodes.next,
            next_fh: self.next_fh,
            ..Default::default()
        };
        for (&id, node) in &self.nodes.by_id {
            let path = if id == ROOT_ID {
                Vec::new()
            } else {
                // No name (unlinked: no links left, or a path too long to read back):
                // left out, counted.
                let named = raw::stat(node.fd.as_raw_fd())
                    .ok()
                    .filter(|st| st.st_nlink > 0)
                    .and_then(|_| self.path_of(node).ok());
                match named
                    .as_deref()
                    .and_then(|at| at.strip_prefix(root_at.as_slice()))
                {
                    Some([b'/', rel @ ..]) if !rel.is_empty() => rel.to_vec(),
                    _ => {
                        t.unnamed += 1;
                        continue;
                    }
                }
            };
            t.nodes.push(NodeEntry {
                id,
                path: locker_sys::hex::encode(&path),
                refs: node.refs,
            });
        }
        for (&fh, h) in &self.handles {
            let (dir, flags) = match &h.open {
                Open::File(f) => (
                    false,
                    locker_sys::fd::status_flags(f.as_raw_fd())? & KEPT_FLAGS,
                ),
                Open::Dir(_) => (true, 0),
            };
            t.handles.push(HandleEntry {
                fh,
                node: h.node,
                dir,
                flags,
            });
        }
        t.nodes.sort_by_key(|n| n.id);
        t.handles.sort_by_key(|h| h.fh);
        Ok(t)
    }

    /// Where the node's inode is now, as this process sees it (its root is the private
    /// root the file server runs in).
    fn path_of(&self, node: &Node) -> io::Result<Vec<u8>> {
        let name = CString::new(node.fd.as_raw_fd().to_string()).expect("digits");
        locker_sys::fd::readlinkat(self.proc_fd, &name)
    }

    /// Takes `t`'s nodes and handles, opened beneath this channel's export.
    pub(super) fn restore(&mut self, t: &ChannelTable) -> Restored {
        let mut r = Restored {
            lost_nodes: t.unnamed,
            ..Default::default()
        };
        self.ready = t.ready;
        for n in &t.nodes {
            if n.id == ROOT_ID {
                if let Some(root) = self.nodes.by_id.get_mut(&ROOT_ID) {
                    root.refs = n.refs.max(1);
                }
                continue;
            }
            match locker_sys::hex::decode(&n.path).and_then(|p| self.open_path(&p)) {
                Some(fd) if self.nodes.by_id.len() < MAX_NODES => {
                    if self.nodes.insert(n.id, fd, n.refs).is_ok() {
                        r.nodes += 1;
                    } else {
                        r.lost_nodes += 1;
                    }
                }
                _ => r.lost_nodes += 1,
            }
        }
        for h in &t.handles {
            let open = self.nodes.by_id.get(&h.node).and_then(|node| {
                let fd = node.fd.as_raw_fd();
                match (h.dir, node.kind) {
                    (true, libc::S_IFDIR) => {
                        raw::reopen(self.proc_fd, fd, libc::O_RDONLY | libc::O_DIRECTORY)
                            .ok()
                            .map(|d| Open::Dir(DirStream::new(d)))
                    }
                    (false, libc::S_IFREG) => {
                        let flags = h.flags & KEPT_FLAGS;
                        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
                        if self.read_only && writes {
                            return None;
                        }
                        raw::reopen(self.proc_fd, fd, flags)
                            .ok()
                            .map(|f| Open::File(File::from(f)))
                    }
                    _ => None,
                }
            });
            match open {
                Some(open) if self.handles.len() < MAX_HANDLES => {
                    self.handles
                        .insert(h.fh, super::nodes::Handle { node: h.node, open });
                    r.handles += 1;
                }
                _ => r.lost_handles += 1,
            }
        }
        self.nodes.next = self.nodes.next.max(t.next_id);
        self.next_fh = self.next_fh.max(t.next_fh);
        r
    }

    /// The `O_PATH` fd of `path` beneath the export, one component at a time.
    fn open_path(&self, path: &[u8]) -> Option<OwnedFd> {
        let root = self.nodes.get(ROOT_ID).ok()?.fd.as_raw_fd();
        let mut at: Option<OwnedFd> = None;
        for part in path.split(|&c| c == b'/') {
            if part.is_empty() || part == b"." || part == b".." || part.len() > super::NAME_MAX {
                return None;
            }
            let name = CString::new(part).ok()?;
            let dir = at.as_ref().map_or(root, |f| f.as_raw_fd());
            at = Some(raw::open_beneath(dir, &name, libc::O_PATH | libc::O_NOFOLLOW, 0).ok()?);
        }
        at
    }
}
