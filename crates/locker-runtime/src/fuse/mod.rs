//! The host side of a microVM's volume mounts: a FUSE passthrough server.
//!
//! Inside a microVM, the agent's relay opens `/dev/fuse`, mounts `fuse` where a volume goes,
//! and forwards every raw FUSE request it reads over a virtio-serial port; on the host that
//! port is a unix socket, and [`serve`] answers the requests by operating on a host
//! directory (an [`Export`]). It is a small virtiofsd whose transport is a byte stream.
//!
//! **Wire** (`locker_proto::fs_frame`). A frame is
//! `[u32 LE payload_len][u32 LE channel][payload]`, the payload at most [`MAX_PAYLOAD`]
//! bytes (a bigger one ends the connection). Guest to host, the payload is one request as
//! read from `/dev/fuse` (`fuse_in_header` and body); host to guest, it is one reply
//! (`fuse_out_header` and body) for the relay to write to `/dev/fuse` in one `write()`.
//! FORGET, BATCH_FORGET, INTERRUPT and NOTIFY_REPLY get no reply. One channel is one mount
//! of one export; one connection carries several. A request on a channel no export names
//! gets `-ENODEV`.
//!
//! **What this room owns:** the protocol (negotiation, decoding, replies), a node table per
//! channel (nodeid to an `O_PATH` fd, deduplicated by `(st_dev, st_ino)` and counted by
//! lookups) and a table of open handles. It decides nothing about which directory is served
//! or where: the caller (the microVM runtime) does.
//!
//! **What it must not touch.** The guest is hostile: every byte of a request is checked
//! before use, and a malformed one gets an error reply, never a panic. The server
//! - never resolves a guest-supplied path: every name is one component (not empty, `.`,
//!   `..`, and without `/`), resolved with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//!   RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)` under its parent's `O_PATH` fd, so it never
//!   follows a symlink and never leaves the export or crosses into a mount inside it;
//! - never opens a device node, FIFO or socket: files are opened for I/O only by reopening a
//!   node's `O_PATH` fd through `/proc/self/fd`, and only once the node is known to be a
//!   regular file or directory; MKNOD makes regular files only;
//! - makes what it creates the caller's (`uid`/`gid` of the request, or the parent's group
//!   under a set-group-id directory) before anyone else can open it: entries are created
//!   with mode 0, chowned, then given their mode; what cannot be finished is removed.
//!
//! Permission checks are the guest kernel's (the mount uses `default_permissions`); the
//! server runs as root and checks no modes itself. A read-only export refuses every change
//! with `EROFS`.
//!
//! **Choices worth knowing.**
//! - Host fds are opened without `O_APPEND` (and without `O_DIRECT`): the guest kernel sends
//!   the offset of every write, an appending one included, and the server writes there.
//! - Attributes and entries are valid for one second: other machines may change the same
//!   volume at the same time.
//! - The host must not move a directory out of a served tree while it is served: a node
//!   the guest holds follows its inode, wherever it goes.
//! - Nodeids live as long as the connection: a guest mount outlives a new `serve` on a new
//!   connection only at its root (every other nodeid is then unknown, `ENOENT`), unless
//!   the new server took the old one's table (`carry`: a microVM that moved).
//! - Every node and open handle holds a host fd: [`MAX_NODES`] and [`MAX_HANDLES`] bound
//!   them per channel (`ENFILE`/`EMFILE` beyond), and the process's `RLIMIT_NOFILE` must
//!   leave room for them.
//!
//! **Rooms.** `wire` (opcodes, flags, the `fuse.h` mirrors: pure data), `codec` (the checks a
//! request's bytes pass before an op sees them, and the reply shapes), `nodes` (the node and
//! handle tables), `ops` (a channel and its one `match` per opcode, with the ops by family:
//! `entry`, `file`, `attr`, `dir`), `server` (frames in, replies out), `carry` (a channel's
//! state written down by name and taken in by another server), `raw` (the system
//! calls, each with its invariant), `tests` (the protocol spoken raw, as a hostile guest).

mod carry;
mod codec;
mod nodes;
mod ops;
mod raw;
mod server;
#[cfg(test)]
mod tests;
mod wire;

use std::path::PathBuf;

use locker_proto::fs_frame;

pub use carry::{ChannelTable, Restored, Table};
pub use server::{serve, Server, TableReader};
use wire::{InHeader, Le, WriteIn};

/// One tree served on one channel.
#[derive(Debug, Clone)]
pub struct Export {
    /// The channel of the frames that carry this mount's requests and replies.
    pub channel: u32,
    /// The host directory served as the mount's root.
    pub root: PathBuf,
    /// Refuse every change with `EROFS`.
    pub read_only: bool,
}

/// The largest frame payload either way (`locker_proto::fs_frame`); a bigger frame ends
/// the connection.
pub const MAX_PAYLOAD: usize = fs_frame::MAX_PAYLOAD;
/// The largest WRITE the server accepts (negotiated at INIT).
pub const MAX_WRITE: u32 = 128 * 1024;
/// The most pages in one request (negotiated at INIT): `MAX_WRITE` in 4 KiB pages.
pub const MAX_PAGES: u16 = 32;
/// The smallest buffer the relay may read `/dev/fuse` with: the kernel refuses a read
/// smaller than `fuse_in_header + fuse_write_in + max_write` (and 8 KiB).
pub const MIN_DEV_READ: usize = InHeader::N + WriteIn::N + MAX_WRITE as usize;
/// Open nodes (host `O_PATH` fds) one channel may hold.
pub const MAX_NODES: usize = 1 << 16;
/// Open files and directories one channel may hold.
pub const MAX_HANDLES: usize = 1 << 14;

/// The minor protocol version this server speaks (Linux 6.2; a 6.1 guest asks for 37).
const OUR_MINOR: u32 = 38;
/// The oldest minor accepted: `FUSE_MAX_PAGES` and the full `fuse_init_out`.
const MIN_MINOR: u32 = 31;
/// The most bytes one READ or READDIR returns, whatever the request asks.
const MAX_READ: usize = 1 << 20;
/// Seconds the guest may cache entries and attributes.
const TTL_SECS: u64 = 1;
/// The most bytes one COPY_FILE_RANGE copies (the guest loops), so one request cannot hold
/// the connection for long.
const MAX_COPY: u64 = 64 << 20;
/// The nodeid of the export's root.
const ROOT_ID: u64 = 1;
/// The longest name one component may have.
const NAME_MAX: usize = 255;
/// The longest symlink target.
const PATH_MAX: usize = 4095;
