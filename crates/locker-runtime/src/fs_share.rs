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
//!   connection only at its root (every other nodeid is then unknown, `ENOENT`).
//! - Every node and open handle holds a host fd: [`MAX_NODES`] and [`MAX_HANDLES`] bound
//!   them per channel (`ENFILE`/`EMFILE` beyond), and the process's `RLIMIT_NOFILE` must
//!   leave room for them.

use std::collections::HashMap;
use std::ffi::CStr;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use locker_proto::fs_frame;

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

// Opcodes (`enum fuse_opcode`).
const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const SETATTR: u32 = 4;
const READLINK: u32 = 5;
const SYMLINK: u32 = 6;
const MKNOD: u32 = 8;
const MKDIR: u32 = 9;
const UNLINK: u32 = 10;
const RMDIR: u32 = 11;
const RENAME: u32 = 12;
const LINK: u32 = 13;
const OPEN: u32 = 14;
const READ: u32 = 15;
const WRITE: u32 = 16;
const STATFS: u32 = 17;
const RELEASE: u32 = 18;
const FSYNC: u32 = 20;
const FLUSH: u32 = 25;
const INIT: u32 = 26;
const OPENDIR: u32 = 27;
const READDIR: u32 = 28;
const RELEASEDIR: u32 = 29;
const FSYNCDIR: u32 = 30;
const ACCESS: u32 = 34;
const CREATE: u32 = 35;
const INTERRUPT: u32 = 36;
const DESTROY: u32 = 38;
const NOTIFY_REPLY: u32 = 41;
const BATCH_FORGET: u32 = 42;
const FALLOCATE: u32 = 43;
const RENAME2: u32 = 45;
const LSEEK: u32 = 46;
const COPY_FILE_RANGE: u32 = 47;

// INIT flags.
const FUSE_ASYNC_READ: u32 = 1 << 0;
const FUSE_ATOMIC_O_TRUNC: u32 = 1 << 3;
const FUSE_BIG_WRITES: u32 = 1 << 5;
const FUSE_AUTO_INVAL_DATA: u32 = 1 << 12;
const FUSE_PARALLEL_DIROPS: u32 = 1 << 18;
const FUSE_MAX_PAGES: u32 = 1 << 22;
/// What the server asks for, of what the kernel offers.
const WANTED_FLAGS: u32 = FUSE_ASYNC_READ
    | FUSE_ATOMIC_O_TRUNC
    | FUSE_BIG_WRITES
    | FUSE_AUTO_INVAL_DATA
    | FUSE_PARALLEL_DIROPS
    | FUSE_MAX_PAGES;

// SETATTR `valid` bits.
const FATTR_MODE: u32 = 1 << 0;
const FATTR_UID: u32 = 1 << 1;
const FATTR_GID: u32 = 1 << 2;
const FATTR_SIZE: u32 = 1 << 3;
const FATTR_ATIME: u32 = 1 << 4;
const FATTR_MTIME: u32 = 1 << 5;
const FATTR_FH: u32 = 1 << 6;
const FATTR_ATIME_NOW: u32 = 1 << 7;
const FATTR_MTIME_NOW: u32 = 1 << 8;

const FUSE_FSYNC_FDATASYNC: u32 = 1 << 0;

/// A little-endian wire value: an integer, an array of them, or a `#[repr(C)]` mirror of a
/// `fuse.h` struct made by [`wire!`].
trait Le: Sized {
    /// Its size on the wire.
    const N: usize;
    /// Reads it from the front of `b`, which holds at least `N` bytes.
    fn get(b: &[u8]) -> Self;
    /// Appends it to `out`.
    fn put(&self, out: &mut Vec<u8>);
}

macro_rules! le_int {
    ($($t:ty),*) => {$(
        impl Le for $t {
            const N: usize = std::mem::size_of::<$t>();
            fn get(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(&b[..Self::N]);
                <$t>::from_le_bytes(a)
            }
            fn put(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
le_int!(u16, u32, u64, i32);

impl<const K: usize> Le for [u32; K] {
    const N: usize = 4 * K;
    fn get(b: &[u8]) -> Self {
        std::array::from_fn(|i| u32::get(&b[4 * i..]))
    }
    fn put(&self, out: &mut Vec<u8>) {
        self.iter().for_each(|v| v.put(out));
    }
}

/// Mirrors a `fuse.h` struct: `#[repr(C)]` with its fields in order, read and written field
/// by field in little-endian. The size check refuses a mirror with hidden padding, so the
/// wire size is the C size.
macro_rules! wire {
    ($(#[$m:meta])* struct $name:ident { $($f:ident: $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Debug, Default, Clone, Copy)]
        #[allow(dead_code)] // padding and fields the kernel sends but the server ignores
        struct $name { $($f: $t),* }

        impl Le for $name {
            const N: usize = {
                let n = 0 $(+ <$t as Le>::N)*;
                assert!(n == std::mem::size_of::<$name>(), "padding in a wire struct");
                n
            };
            #[allow(unused_assignments)]
            fn get(b: &[u8]) -> Self {
                let mut at = 0;
                $(let $f = <$t as Le>::get(&b[at..]); at += <$t as Le>::N;)*
                Self { $($f),* }
            }
            fn put(&self, out: &mut Vec<u8>) {
                $(self.$f.put(out);)*
            }
        }
    };
}

wire!(
    /// `struct fuse_in_header`.
    struct InHeader {
        len: u32,
        opcode: u32,
        unique: u64,
        nodeid: u64,
        uid: u32,
        gid: u32,
        pid: u32,
        total_extlen: u16,
        padding: u16,
    }
);
wire!(
    /// `struct fuse_out_header`.
    struct OutHeader {
        len: u32,
        error: i32,
        unique: u64,
    }
);
wire!(
    /// `struct fuse_attr`.
    struct Attr {
        ino: u64,
        size: u64,
        blocks: u64,
        atime: u64,
        mtime: u64,
        ctime: u64,
        atimensec: u32,
        mtimensec: u32,
        ctimensec: u32,
        mode: u32,
        nlink: u32,
        uid: u32,
        gid: u32,
        rdev: u32,
        blksize: u32,
        flags: u32,
    }
);
wire!(
    /// `struct fuse_entry_out`.
    struct EntryOut {
        nodeid: u64,
        generation: u64,
        entry_valid: u64,
        attr_valid: u64,
        entry_valid_nsec: u32,
        attr_valid_nsec: u32,
        attr: Attr,
    }
);
wire!(
    /// `struct fuse_attr_out`.
    struct AttrOut {
        attr_valid: u64,
        attr_valid_nsec: u32,
        dummy: u32,
        attr: Attr,
    }
);
wire!(
    /// The head of `struct fuse_init_in` (flags2 and the rest follow; unused here).
    struct InitIn {
        major: u32,
        minor: u32,
        max_readahead: u32,
        flags: u32,
    }
);
wire!(
    /// `struct fuse_init_out` (its full size, minor 23 and later).
    struct InitOut {
        major: u32,
        minor: u32,
        max_readahead: u32,
        flags: u32,
        max_background: u16,
        congestion_threshold: u16,
        max_write: u32,
        time_gran: u32,
        max_pages: u16,
        map_alignment: u16,
        flags2: u32,
        unused: [u32; 7],
    }
);
wire!(
    /// `struct fuse_forget_in`.
    struct ForgetIn {
        nlookup: u64,
    }
);
wire!(
    /// `struct fuse_forget_one`.
    struct ForgetOne {
        nodeid: u64,
        nlookup: u64,
    }
);
wire!(
    /// `struct fuse_batch_forget_in`.
    struct BatchForgetIn {
        count: u32,
        dummy: u32,
    }
);
wire!(
    /// `struct fuse_getattr_in`.
    struct GetattrIn {
        getattr_flags: u32,
        dummy: u32,
        fh: u64,
    }
);
wire!(
    /// `struct fuse_setattr_in`.
    struct SetattrIn {
        valid: u32,
        padding: u32,
        fh: u64,
        size: u64,
        lock_owner: u64,
        atime: u64,
        mtime: u64,
        ctime: u64,
        atimensec: u32,
        mtimensec: u32,
        ctimensec: u32,
        mode: u32,
        unused4: u32,
        uid: u32,
        gid: u32,
        unused5: u32,
    }
);
wire!(
    /// `struct fuse_mknod_in`.
    struct MknodIn {
        mode: u32,
        rdev: u32,
        umask: u32,
        padding: u32,
    }
);
wire!(
    /// `struct fuse_mkdir_in`.
    struct MkdirIn {
        mode: u32,
        umask: u32,
    }
);
wire!(
    /// `struct fuse_rename_in`.
    struct RenameIn {
        newdir: u64,
    }
);
wire!(
    /// `struct fuse_rename2_in`.
    struct Rename2In {
        newdir: u64,
        flags: u32,
        padding: u32,
    }
);
wire!(
    /// `struct fuse_link_in`.
    struct LinkIn {
        oldnodeid: u64,
    }
);
wire!(
    /// `struct fuse_open_in`.
    struct OpenIn {
        flags: u32,
        open_flags: u32,
    }
);
wire!(
    /// `struct fuse_create_in`.
    struct CreateIn {
        flags: u32,
        mode: u32,
        umask: u32,
        open_flags: u32,
    }
);
wire!(
    /// `struct fuse_open_out`.
    struct OpenOut {
        fh: u64,
        open_flags: u32,
        padding: u32,
    }
);
wire!(
    /// `struct fuse_release_in`.
    struct ReleaseIn {
        fh: u64,
        flags: u32,
        release_flags: u32,
        lock_owner: u64,
    }
);
wire!(
    /// `struct fuse_flush_in`.
    struct FlushIn {
        fh: u64,
        unused: u32,
        padding: u32,
        lock_owner: u64,
    }
);
wire!(
    /// `struct fuse_read_in`.
    struct ReadIn {
        fh: u64,
        offset: u64,
        size: u32,
        read_flags: u32,
        lock_owner: u64,
        flags: u32,
        padding: u32,
    }
);
wire!(
    /// `struct fuse_write_in`.
    struct WriteIn {
        fh: u64,
        offset: u64,
        size: u32,
        write_flags: u32,
        lock_owner: u64,
        flags: u32,
        padding: u32,
    }
);
wire!(
    /// `struct fuse_write_out`.
    struct WriteOut {
        size: u32,
        padding: u32,
    }
);
wire!(
    /// `struct fuse_kstatfs` (the whole of `struct fuse_statfs_out`).
    struct Kstatfs {
        blocks: u64,
        bfree: u64,
        bavail: u64,
        files: u64,
        ffree: u64,
        bsize: u32,
        namelen: u32,
        frsize: u32,
        padding: u32,
        spare: [u32; 6],
    }
);
wire!(
    /// `struct fuse_fsync_in`.
    struct FsyncIn {
        fh: u64,
        fsync_flags: u32,
        padding: u32,
    }
);
wire!(
    /// `struct fuse_fallocate_in`.
    struct FallocateIn {
        fh: u64,
        offset: u64,
        length: u64,
        mode: u32,
        padding: u32,
    }
);
wire!(
    /// `struct fuse_lseek_in`.
    struct LseekIn {
        fh: u64,
        offset: u64,
        whence: u32,
        padding: u32,
    }
);
wire!(
    /// `struct fuse_lseek_out`.
    struct LseekOut {
        offset: u64,
    }
);
wire!(
    /// `struct fuse_copy_file_range_in`.
    struct CopyFileRangeIn {
        fh_in: u64,
        off_in: u64,
        nodeid_out: u64,
        fh_out: u64,
        off_out: u64,
        len: u64,
        flags: u64,
    }
);
wire!(
    /// The fixed head of `struct fuse_dirent`; the name and padding to 8 bytes follow.
    struct Dirent {
        ino: u64,
        off: u64,
        namelen: u32,
        typ: u32,
    }
);

/// An error for the guest: the errno its reply carries (negated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Errno(i32);

impl From<io::Error> for Errno {
    fn from(e: io::Error) -> Self {
        // The kernel refuses replies with errors outside 1..512; those become EIO.
        Errno(
            e.raw_os_error()
                .filter(|n| (1..512).contains(n))
                .unwrap_or(libc::EIO),
        )
    }
}

type Res<T = ()> = Result<T, Errno>;

/// Reads a `T` from the front of `b` and returns it with the rest; `EINVAL` if too short.
fn take<T: Le>(b: &[u8]) -> Res<(T, &[u8])> {
    if b.len() < T::N {
        return Err(Errno(libc::EINVAL));
    }
    Ok((T::get(b), &b[T::N..]))
}

/// A name component as the kernel sends it: exactly `name\0`, and a plain name.
fn one_name(b: &[u8]) -> Res<&CStr> {
    let name = CStr::from_bytes_with_nul(b).map_err(|_| Errno(libc::EINVAL))?;
    check_name(name)
}

/// Two NUL-terminated strings back to back (`a\0b\0`), neither checked as a name.
fn two_strings(b: &[u8]) -> Res<(&CStr, &CStr)> {
    let nul = b.iter().position(|&c| c == 0).ok_or(Errno(libc::EINVAL))?;
    let a = CStr::from_bytes_with_nul(&b[..=nul]).map_err(|_| Errno(libc::EINVAL))?;
    let z = CStr::from_bytes_with_nul(&b[nul + 1..]).map_err(|_| Errno(libc::EINVAL))?;
    Ok((a, z))
}

/// Refuses what is not one plain component: empty (`ENOENT`), `.`, `..` or with `/`
/// (`EINVAL`), too long (`ENAMETOOLONG`).
fn check_name(name: &CStr) -> Res<&CStr> {
    let b = name.to_bytes();
    match b {
        [] => Err(Errno(libc::ENOENT)),
        b"." | b".." => Err(Errno(libc::EINVAL)),
        _ if b.contains(&b'/') => Err(Errno(libc::EINVAL)),
        _ if b.len() > NAME_MAX => Err(Errno(libc::ENAMETOOLONG)),
        _ => Ok(name),
    }
}

/// A guest offset as a host one: `EINVAL` past `i64::MAX`.
fn offset(v: u64) -> Res<i64> {
    i64::try_from(v).map_err(|_| Errno(libc::EINVAL))
}

fn attr_of(st: &libc::stat) -> Attr {
    Attr {
        ino: st.st_ino,
        size: st.st_size as u64,
        blocks: st.st_blocks as u64,
        atime: st.st_atime as u64,
        mtime: st.st_mtime as u64,
        ctime: st.st_ctime as u64,
        atimensec: st.st_atime_nsec as u32,
        mtimensec: st.st_mtime_nsec as u32,
        ctimensec: st.st_ctime_nsec as u32,
        mode: st.st_mode,
        nlink: u32::try_from(st.st_nlink).unwrap_or(u32::MAX),
        uid: st.st_uid,
        gid: st.st_gid,
        // A 32-bit `new_encode_dev`, which glibc's encoding equals for majors below 4096.
        rdev: st.st_rdev as u32,
        blksize: st.st_blksize as u32,
        flags: 0,
    }
}

fn put_entry(out: &mut Vec<u8>, nodeid: u64, st: &libc::stat) {
    EntryOut {
        nodeid,
        generation: 0,
        entry_valid: TTL_SECS,
        attr_valid: TTL_SECS,
        entry_valid_nsec: 0,
        attr_valid_nsec: 0,
        attr: attr_of(st),
    }
    .put(out);
}

fn put_attr(out: &mut Vec<u8>, st: &libc::stat) {
    AttrOut {
        attr_valid: TTL_SECS,
        attr_valid_nsec: 0,
        dummy: 0,
        attr: attr_of(st),
    }
    .put(out);
}

/// The file type bits of a mode.
fn kind(mode: u32) -> u32 {
    mode & libc::S_IFMT
}

/// One inode the guest knows: its `O_PATH` fd and how many lookups the guest holds.
struct Node {
    fd: OwnedFd,
    refs: u64,
    /// The file type (`S_IFMT` bits), fixed for the inode's life.
    kind: u32,
    key: (u64, u64),
}

/// A channel's nodes, by nodeid and by `(st_dev, st_ino)`.
struct Nodes {
    by_id: HashMap<u64, Node>,
    by_key: HashMap<(u64, u64), u64>,
    next: u64,
}

impl Nodes {
    fn new(root: OwnedFd, st: &libc::stat) -> Self {
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
    fn reset(&mut self) {
        self.by_id.retain(|&id, _| id == ROOT_ID);
        self.by_key.retain(|_, &mut id| id == ROOT_ID);
    }

    fn get(&self, id: u64) -> Res<&Node> {
        self.by_id.get(&id).ok_or(Errno(libc::ENOENT))
    }

    /// The node's fd, which must be a directory's.
    fn dir(&self, id: u64) -> Res<RawFd> {
        let n = self.get(id)?;
        if n.kind != libc::S_IFDIR {
            return Err(Errno(libc::ENOTDIR));
        }
        Ok(n.fd.as_raw_fd())
    }

    /// Counts one lookup of the inode behind `fd`: the known node for its `(dev, ino)`, or a
    /// new one holding `fd`. Returns the nodeid and a fresh stat.
    fn adopt(&mut self, fd: OwnedFd) -> Res<(u64, libc::stat)> {
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

    /// Drops `n` lookups of a node; at none it goes (the root never does).
    fn forget(&mut self, id: u64, n: u64) {
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
            self.by_key.remove(&key);
        }
    }
}

/// An open file or directory of the guest's.
struct Handle {
    node: u64,
    open: Open,
}

enum Open {
    File(File),
    Dir(DirStream),
}

/// A directory being read: its fd, positioned by the `d_off` cookies of getdents64, and
/// the entries read from the host but not yet sent.
struct DirStream {
    fd: OwnedFd,
    buf: Vec<u8>,
    at: usize,
    end: usize,
    /// The cookie of the stream's position: where the next unsent entry is.
    pos: u64,
}

/// The fixed part of `struct linux_dirent64` before the name.
const DIRENT64_NAME: usize = 19;

impl DirStream {
    fn new(fd: OwnedFd) -> Self {
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
    fn read(&mut self, from: u64, size: usize, out: &mut Vec<u8>) -> Res {
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
struct Undo<'a> {
    dir: RawFd,
    name: &'a CStr,
    flags: libc::c_int,
    armed: bool,
}

impl<'a> Undo<'a> {
    fn new(dir: RawFd, name: &'a CStr, flags: libc::c_int) -> Self {
        Undo {
            dir,
            name,
            flags,
            armed: true,
        }
    }
    fn disarm(mut self) {
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

/// One export served on one channel.
struct Channel {
    read_only: bool,
    proc_fd: RawFd,
    nodes: Nodes,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
    /// INIT answered: anything else before it gets `EIO`.
    ready: bool,
}

impl Channel {
    fn new(e: &Export, proc_fd: RawFd) -> io::Result<Self> {
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

    fn writable(&self) -> Res {
        if self.read_only {
            Err(Errno(libc::EROFS))
        } else {
            Ok(())
        }
    }

    fn add_handle(&mut self, node: u64, open: Open) -> Res<u64> {
        if self.handles.len() >= MAX_HANDLES {
            return Err(Errno(libc::EMFILE));
        }
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, Handle { node, open });
        Ok(fh)
    }

    fn file(&self, fh: u64) -> Res<&File> {
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
    fn dispatch(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn init(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn batch_forget(&mut self, body: &[u8]) -> Res {
        let (b, mut rest) = take::<BatchForgetIn>(body)?;
        for _ in 0..b.count {
            let (f, r) = take::<ForgetOne>(rest)?;
            self.nodes.forget(f.nodeid, f.nlookup);
            rest = r;
        }
        Ok(())
    }

    /// Opens `name` under `parent` as an `O_PATH` fd, never following a symlink.
    fn open_child(&self, parent: u64, name: &CStr) -> Res<OwnedFd> {
        let dir = self.nodes.dir(parent)?;
        Ok(raw::open_beneath(
            dir,
            name,
            libc::O_PATH | libc::O_NOFOLLOW,
            0,
        )?)
    }

    fn lookup(&mut self, parent: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
        let name = one_name(body)?;
        let fd = self.open_child(parent, name)?;
        let (id, st) = self.nodes.adopt(fd)?;
        put_entry(out, id, &st);
        Ok(())
    }

    /// Who owns what a request creates under `dir`: the caller, with the directory's
    /// group when it is set-group-id (as the kernel does). Also says whether it is.
    fn owner(&self, h: &InHeader, dir: RawFd) -> Res<(u32, u32, bool)> {
        let st = raw::stat(dir)?;
        if st.st_mode & libc::S_ISGID != 0 {
            Ok((h.uid, st.st_gid, true))
        } else {
            Ok((h.uid, h.gid, false))
        }
    }

    fn mkdir(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn mknod(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
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
    fn own_new_file(
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

    fn symlink(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn remove(&mut self, parent: u64, body: &[u8], flags: libc::c_int) -> Res {
        self.writable()?;
        let name = one_name(body)?;
        let dir = self.nodes.dir(parent)?;
        Ok(raw::unlinkat(dir, name, flags)?)
    }

    fn rename(&mut self, parent: u64, newparent: u64, flags: u32, names: &[u8]) -> Res {
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

    fn link(&mut self, newparent: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn readlink(&mut self, id: u64, out: &mut Vec<u8>) -> Res {
        let n = self.nodes.get(id)?;
        if n.kind != libc::S_IFLNK {
            return Err(Errno(libc::EINVAL));
        }
        out.extend_from_slice(&raw::readlink(n.fd.as_raw_fd())?);
        Ok(())
    }

    /// Host open flags for a guest's: the access mode, `O_TRUNC` and the sync bits; never
    /// `O_APPEND` (offsets come with every write), `O_DIRECT`, `O_CREAT` or `O_EXCL`.
    fn host_flags(&self, flags: u32) -> Res<libc::c_int> {
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

    fn open(&mut self, id: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn create(&mut self, h: &InHeader, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn read(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn write(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn setattr(&mut self, id: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn statfs(&mut self, id: u64, out: &mut Vec<u8>) -> Res {
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

    fn fsync(&mut self, body: &[u8]) -> Res {
        let (f, _) = take::<FsyncIn>(body)?;
        let data_only = f.fsync_flags & FUSE_FSYNC_FDATASYNC != 0;
        match self.handles.get(&f.fh).map(|h| &h.open) {
            Some(Open::File(file)) if data_only => Ok(file.sync_data()?),
            Some(Open::File(file)) => Ok(file.sync_all()?),
            Some(Open::Dir(d)) => Ok(raw::fsync(d.fd.as_raw_fd())?),
            None => Err(Errno(libc::EBADF)),
        }
    }

    fn opendir(&mut self, id: u64, body: &[u8], out: &mut Vec<u8>) -> Res {
        take::<OpenIn>(body)?;
        let dir = self.nodes.dir(id)?;
        let fd = raw::reopen(self.proc_fd, dir, libc::O_RDONLY | libc::O_DIRECTORY)?;
        let fh = self.add_handle(id, Open::Dir(DirStream::new(fd)))?;
        put_open(out, fh);
        Ok(())
    }

    fn readdir(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
        let (r, _) = take::<ReadIn>(body)?;
        match self.handles.get_mut(&r.fh).map(|h| &mut h.open) {
            Some(Open::Dir(d)) => d.read(r.offset, (r.size as usize).min(MAX_READ), out),
            _ => Err(Errno(libc::EBADF)),
        }
    }

    fn fallocate(&mut self, body: &[u8]) -> Res {
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

    fn lseek(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
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

    fn copy_file_range(&mut self, body: &[u8], out: &mut Vec<u8>) -> Res {
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

/// Reads one frame into `payload`; `None` at end of stream between frames.
fn read_frame(r: &mut impl BufRead, payload: &mut Vec<u8>) -> io::Result<Option<u32>> {
    loop {
        match r.fill_buf() {
            Ok([]) => return Ok(None),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let mut head = [0u8; fs_frame::HEADER_LEN];
    r.read_exact(&mut head)?;
    let Some((len, channel)) = fs_frame::parse_header(&head) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a frame of {} bytes: more than {MAX_PAYLOAD}",
                u32::get(&head)
            ),
        ));
    };
    payload.resize(len, 0);
    r.read_exact(payload)?;
    Ok(Some(channel))
}

/// Where a reply's `fuse_out_header` starts in the frame.
const FRAME_HEAD: usize = fs_frame::HEADER_LEN;

/// Answers one request into `out` as a whole frame; false when it takes no reply (or has
/// no header to reply to).
fn handle_frame(
    channels: &mut HashMap<u32, Channel>,
    channel: u32,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> bool {
    if payload.len() < InHeader::N {
        tracing::warn!(
            channel,
            len = payload.len(),
            "fs_share: a request shorter than its header, dropped"
        );
        return false;
    }
    let h = InHeader::get(payload);
    out.clear();
    out.resize(FRAME_HEAD + OutHeader::N, 0);
    let result = match channels.get_mut(&channel) {
        None => Err(Errno(libc::ENODEV)),
        Some(ch) => body_of(&h, payload).and_then(|body| ch.dispatch(&h, body, out)),
    };
    if matches!(h.opcode, FORGET | BATCH_FORGET | INTERRUPT | NOTIFY_REPLY) {
        return false;
    }
    let error = match result {
        Ok(()) => 0,
        Err(Errno(e)) => {
            if e == libc::ENOSYS {
                tracing::debug!(channel, opcode = h.opcode, "fs_share: not served");
            }
            out.truncate(FRAME_HEAD + OutHeader::N);
            -e
        }
    };
    let len = out.len() - FRAME_HEAD;
    out[..FRAME_HEAD].copy_from_slice(&fs_frame::header(channel, len));
    let mut head = Vec::with_capacity(OutHeader::N);
    OutHeader {
        len: len as u32,
        error,
        unique: h.unique,
    }
    .put(&mut head);
    out[FRAME_HEAD..FRAME_HEAD + OutHeader::N].copy_from_slice(&head);
    true
}

/// The reply to an open: the new handle, no flags.
fn put_open(out: &mut Vec<u8>, fh: u64) {
    OpenOut {
        fh,
        open_flags: 0,
        padding: 0,
    }
    .put(out);
}

/// The request's body: after the header, before any extensions (`total_extlen`).
fn body_of<'a>(h: &InHeader, payload: &'a [u8]) -> Res<&'a [u8]> {
    if h.len as usize != payload.len() {
        return Err(Errno(libc::EINVAL));
    }
    let ext = usize::from(h.total_extlen) * 8;
    let end = payload.len().checked_sub(ext).filter(|&e| e >= InHeader::N);
    Ok(&payload[InHeader::N..end.ok_or(Errno(libc::EINVAL))?])
}

/// Serves FUSE requests arriving on `conn` until it reaches EOF (Ok) or fails.
///
/// Fails at once when an export's root cannot be opened or two exports share a channel,
/// later on a read or write error of `conn` or a frame bigger than [`MAX_PAYLOAD`].
pub fn serve(conn: UnixStream, exports: &[Export]) -> io::Result<()> {
    Server::open(exports)?.run(conn)
}

/// A server with its exports' roots and `/proc/self/fd` open: after [`Server::open`] it
/// needs no path of the host any more (its caller may unmount `/proc`).
pub struct Server {
    channels: HashMap<u32, Channel>,
    /// Every channel reopens files through this directory (its raw fd is theirs too).
    _proc_fd: OwnedFd,
}

impl Server {
    /// Opens `/proc/self/fd` and every export's root; fails when a root cannot be opened or
    /// two exports share a channel.
    pub fn open(exports: &[Export]) -> io::Result<Self> {
        let proc_fd = raw::open_dir(Path::new("/proc/self/fd"))?;
        let mut channels = HashMap::new();
        for e in exports {
            let ch = Channel::new(e, proc_fd.as_raw_fd())?;
            if channels.insert(e.channel, ch).is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("channel {} is exported twice", e.channel),
                ));
            }
        }
        Ok(Self {
            channels,
            _proc_fd: proc_fd,
        })
    }

    /// Serves until `conn` reaches its end between frames, or its peer goes away while a
    /// reply is written (Ok), or it fails.
    pub fn run(mut self, conn: UnixStream) -> io::Result<()> {
        let mut reader = BufReader::with_capacity(256 * 1024, &conn);
        let mut writer = &conn;
        let mut payload = Vec::new();
        let mut reply = Vec::new();
        while let Some(channel) = read_frame(&mut reader, &mut payload)? {
            if handle_frame(&mut self.channels, channel, &payload, &mut reply) {
                match writer.write_all(&reply) {
                    Ok(()) => {}
                    // The guest's end closed with requests in flight (an unmount, a VM
                    // that stopped): nobody waits for the reply.
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                        ) =>
                    {
                        return Ok(())
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }
}

/// The system calls of this room, each with its invariant. Paths are single components
/// checked by the caller, or fixed host paths; fds are borrowed for the call.
mod raw {
    use std::ffi::{CStr, CString};
    use std::io;
    use std::mem::MaybeUninit;
    use std::os::fd::{FromRawFd, OwnedFd, RawFd};
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    }

    fn check_int(rc: libc::c_int) -> io::Result<()> {
        check(rc.into()).map(drop)
    }

    fn owned(rc: libc::c_long) -> io::Result<OwnedFd> {
        let fd = check(rc)? as RawFd;
        // SAFETY: the kernel just returned `fd`, a new descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Opens a host directory (an export's root, `/proc/self/fd`) as an `O_PATH` fd.
    pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
        let p = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC;
        // SAFETY: `p` is a NUL-terminated string alive for the call.
        owned(unsafe { libc::open(p.as_ptr(), flags) }.into())
    }

    /// `openat2(dir, name, flags | O_CLOEXEC, mode)` that stays beneath `dir`, crosses no
    /// mount and follows no symlink of any kind; plain `openat` with `O_NOFOLLOW` where the
    /// kernel has no openat2 (`name` is one component, so that is as strict but for mounts).
    pub fn open_beneath(
        dir: RawFd,
        name: &CStr,
        flags: libc::c_int,
        mode: u32,
    ) -> io::Result<OwnedFd> {
        let mut how: libc::open_how = unsafe_zeroed_how();
        how.flags = (flags | libc::O_CLOEXEC) as u64;
        how.mode = if flags & libc::O_CREAT != 0 {
            u64::from(mode)
        } else {
            0
        };
        how.resolve = libc::RESOLVE_BENEATH
            | libc::RESOLVE_NO_SYMLINKS
            | libc::RESOLVE_NO_MAGICLINKS
            | libc::RESOLVE_NO_XDEV;
        let call = || {
            // SAFETY: `name` is NUL-terminated and `how` a valid open_how of the size passed.
            owned(unsafe {
                libc::syscall(
                    libc::SYS_openat2,
                    dir,
                    name.as_ptr(),
                    &how as *const libc::open_how,
                    std::mem::size_of::<libc::open_how>(),
                )
            })
        };
        // EAGAIN: a concurrent rename made the kernel unsure the walk stayed beneath; the
        // walk is one component, so a retry settles it.
        let mut r = call();
        for _ in 0..3 {
            match &r {
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => r = call(),
                _ => break,
            }
        }
        match r {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                let flags = flags | libc::O_CLOEXEC | libc::O_NOFOLLOW;
                // SAFETY: as above; `mode` is read only with O_CREAT.
                owned(unsafe { libc::openat(dir, name.as_ptr(), flags, mode) }.into())
            }
            r => r,
        }
    }

    fn unsafe_zeroed_how() -> libc::open_how {
        // SAFETY: open_how is plain integers, for which all zeroes is valid.
        unsafe { std::mem::zeroed() }
    }

    /// Opens the file behind `fd` anew with `flags`, through `/proc/self/fd/<fd>` (opened
    /// as `proc`): how an `O_PATH` fd becomes one for I/O. Callers check the file type
    /// first: this follows the magic link to whatever `fd` is.
    pub fn reopen(proc: RawFd, fd: RawFd, flags: libc::c_int) -> io::Result<OwnedFd> {
        let name = CString::new(fd.to_string()).expect("digits");
        // SAFETY: `name` is NUL-terminated; no mode is read without O_CREAT.
        owned(unsafe { libc::openat(proc, name.as_ptr(), flags | libc::O_CLOEXEC) }.into())
    }

    /// `fstatat(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`: works on `O_PATH` fds.
    pub fn stat(fd: RawFd) -> io::Result<libc::stat> {
        let mut st = MaybeUninit::<libc::stat>::uninit();
        let flags = libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW;
        // SAFETY: `st` is writable for a stat; the path is an empty NUL-terminated string.
        check_int(unsafe { libc::fstatat(fd, c"".as_ptr(), st.as_mut_ptr(), flags) })?;
        // SAFETY: fstatat succeeded, so it filled `st`.
        Ok(unsafe { st.assume_init() })
    }

    /// `fstatvfs` (works on `O_PATH` fds).
    pub fn statvfs(fd: RawFd) -> io::Result<libc::statvfs> {
        let mut st = MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `st` is writable for a statvfs.
        check_int(unsafe { libc::fstatvfs(fd, st.as_mut_ptr()) })?;
        // SAFETY: fstatvfs succeeded, so it filled `st`.
        Ok(unsafe { st.assume_init() })
    }

    /// `fchownat(fd, "", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`: the inode of an
    /// `O_PATH` fd itself (a symlink stays unfollowed); `u32::MAX` leaves an id as it is.
    /// Ids of 65536 and above are refused (`EOVERFLOW`, as an id-mapped mount does): a
    /// volume holds canonical ids, which a jail maps from 0..65536 only, and the host's
    /// own ids above that are machines' uid ranges.
    pub fn chown(fd: RawFd, uid: u32, gid: u32) -> io::Result<()> {
        if [uid, gid].iter().any(|&id| id != u32::MAX && id >= 1 << 16) {
            return Err(io::Error::from_raw_os_error(libc::EOVERFLOW));
        }
        let flags = libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW;
        // SAFETY: integers and an empty NUL-terminated path.
        check_int(unsafe { libc::fchownat(fd, c"".as_ptr(), uid, gid, flags) })
    }

    /// chmod of the inode behind an `O_PATH` fd, through its `/proc/self/fd` link (chmod of
    /// a node opens nothing, whatever its type).
    pub fn chmod_via_proc(proc: RawFd, fd: RawFd, mode: u32) -> io::Result<()> {
        let name = CString::new(fd.to_string()).expect("digits");
        // SAFETY: `name` is NUL-terminated; integers otherwise.
        check_int(unsafe { libc::fchmodat(proc, name.as_ptr(), mode, 0) })
    }

    /// `fchmod` of an fd open for I/O.
    pub fn fchmod(fd: RawFd, mode: u32) -> io::Result<()> {
        // SAFETY: integers only.
        check_int(unsafe { libc::fchmod(fd, mode) })
    }

    /// `utimensat(fd, "", times, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`.
    pub fn set_times(fd: RawFd, times: &[libc::timespec; 2]) -> io::Result<()> {
        let flags = libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW;
        // SAFETY: `times` points at two timespecs; the path is an empty string.
        check_int(unsafe { libc::utimensat(fd, c"".as_ptr(), times.as_ptr(), flags) })
    }

    pub fn mkdirat(dir: RawFd, name: &CStr, mode: u32) -> io::Result<()> {
        // SAFETY: `name` is NUL-terminated.
        check_int(unsafe { libc::mkdirat(dir, name.as_ptr(), mode) })
    }

    pub fn symlinkat(target: &CStr, dir: RawFd, name: &CStr) -> io::Result<()> {
        // SAFETY: both strings are NUL-terminated.
        check_int(unsafe { libc::symlinkat(target.as_ptr(), dir, name.as_ptr()) })
    }

    pub fn unlinkat(dir: RawFd, name: &CStr, flags: libc::c_int) -> io::Result<()> {
        // SAFETY: `name` is NUL-terminated.
        check_int(unsafe { libc::unlinkat(dir, name.as_ptr(), flags) })
    }

    pub fn renameat2(from: RawFd, old: &CStr, to: RawFd, new: &CStr, flags: u32) -> io::Result<()> {
        // SAFETY: both names are NUL-terminated; integers otherwise.
        check(unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                from,
                old.as_ptr(),
                to,
                new.as_ptr(),
                flags,
            )
        })
        .map(drop)
    }

    /// A new name `name` under `dir` for the inode behind the `O_PATH` fd `fd`, through
    /// its `/proc/self/fd` entry (`AT_EMPTY_PATH` would need `CAP_DAC_READ_SEARCH`, which
    /// also opens files by handle: the server does not keep it). A symlink's fd links the
    /// symlink itself.
    pub fn link_fd(proc_fd: RawFd, fd: RawFd, dir: RawFd, name: &CStr) -> io::Result<()> {
        let n = CString::new(fd.to_string()).expect("digits");
        // SAFETY: both paths are NUL-terminated strings.
        check_int(unsafe {
            libc::linkat(
                proc_fd,
                n.as_ptr(),
                dir,
                name.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        })
    }

    /// The target of the symlink behind the `O_PATH` fd `fd`.
    pub fn readlink(fd: RawFd) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
        // SAFETY: `buf` is writable for its length; the path is an empty string.
        let n = unsafe { libc::readlinkat(fd, c"".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        buf.truncate(check(n as libc::c_long)? as usize);
        Ok(buf)
    }

    pub fn seek(fd: RawFd, offset: i64, whence: libc::c_int) -> io::Result<u64> {
        // SAFETY: integers only.
        check(unsafe { libc::lseek(fd, offset, whence) }).map(|o| o as u64)
    }

    /// One `getdents64` into `buf`; 0 at the end of the directory.
    pub fn getdents64(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is writable for its length.
        check(unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len()) })
            .map(|n| n as usize)
    }

    pub fn fsync(fd: RawFd) -> io::Result<()> {
        // SAFETY: integers only.
        check_int(unsafe { libc::fsync(fd) })
    }

    pub fn fallocate(fd: RawFd, mode: libc::c_int, offset: i64, len: i64) -> io::Result<()> {
        // SAFETY: integers only.
        check_int(unsafe { libc::fallocate(fd, mode, offset, len) })
    }

    pub fn copy_file_range(
        from: RawFd,
        off_in: i64,
        to: RawFd,
        off_out: i64,
        len: usize,
    ) -> io::Result<usize> {
        let (mut a, mut b) = (off_in, off_out);
        // SAFETY: the offsets are our own locals, updated by the kernel.
        let n = unsafe { libc::copy_file_range(from, &mut a, to, &mut b, len, 0) };
        check(n as libc::c_long).map(|n| n as usize)
    }
}

#[cfg(test)]
mod tests {
    //! The protocol spoken raw over a socket pair: what a hostile guest may send.

    use super::*;
    use std::ffi::CString;
    use std::io::Read;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::thread::JoinHandle;
    use std::time::Duration;

    /// A directory under the temp dir, removed when the guard goes.
    struct Tmp(PathBuf);

    impl Tmp {
        fn new(tag: &str) -> Self {
            static N: AtomicU64 = AtomicU64::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!("fs-share-{tag}-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&p).unwrap();
            Tmp(p)
        }
    }

    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The guest end of a connection: sends raw requests, reads raw replies.
    struct Guest {
        conn: UnixStream,
        unique: u64,
        server: Option<JoinHandle<io::Result<()>>>,
    }

    struct Reply {
        unique: u64,
        error: i32,
        body: Vec<u8>,
    }

    impl Guest {
        fn start(exports: Vec<Export>) -> Self {
            let (host, conn) = UnixStream::pair().unwrap();
            conn.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let server = std::thread::spawn(move || serve(host, &exports));
            Guest {
                conn,
                unique: 0,
                server: Some(server),
            }
        }

        fn send_raw(&mut self, channel: u32, payload: &[u8]) {
            let mut f = Vec::new();
            (payload.len() as u32).put(&mut f);
            channel.put(&mut f);
            f.extend_from_slice(payload);
            self.conn.write_all(&f).unwrap();
        }

        fn send(&mut self, channel: u32, opcode: u32, nodeid: u64, body: &[u8]) -> u64 {
            self.unique += 1;
            let mut p = Vec::new();
            InHeader {
                len: (InHeader::N + body.len()) as u32,
                opcode,
                unique: self.unique,
                nodeid,
                uid: 0,
                gid: 0,
                pid: 1,
                total_extlen: 0,
                padding: 0,
            }
            .put(&mut p);
            p.extend_from_slice(body);
            self.send_raw(channel, &p);
            self.unique
        }

        fn recv(&mut self) -> Reply {
            let mut head = [0u8; 8];
            self.conn.read_exact(&mut head).unwrap();
            let mut p = vec![0u8; u32::get(&head) as usize];
            self.conn.read_exact(&mut p).unwrap();
            let h = OutHeader::get(&p);
            assert_eq!(
                h.len as usize,
                p.len(),
                "out header length is the payload's"
            );
            Reply {
                unique: h.unique,
                error: h.error,
                body: p[OutHeader::N..].to_vec(),
            }
        }

        /// One request and its reply on channel 7.
        fn call(&mut self, opcode: u32, nodeid: u64, body: &[u8]) -> Reply {
            let u = self.send(7, opcode, nodeid, body);
            let r = self.recv();
            assert_eq!(r.unique, u, "the reply echoes the request's unique");
            r
        }

        fn init(&mut self) -> InitOut {
            let mut b = Vec::new();
            InitIn {
                major: 7,
                minor: 38,
                max_readahead: 65536,
                flags: u32::MAX,
            }
            .put(&mut b);
            b.resize(64, 0);
            let r = self.call(INIT, 0, &b);
            assert_eq!(r.error, 0);
            assert_eq!(r.body.len(), InitOut::N);
            InitOut::get(&r.body)
        }

        fn lookup(&mut self, parent: u64, name: &[u8]) -> Result<EntryOut, i32> {
            let mut b = name.to_vec();
            b.push(0);
            let r = self.call(LOOKUP, parent, &b);
            if r.error != 0 {
                return Err(r.error);
            }
            Ok(EntryOut::get(&r.body))
        }

        fn open(&mut self, node: u64, flags: i32) -> Result<u64, i32> {
            let mut b = Vec::new();
            OpenIn {
                flags: flags as u32,
                open_flags: 0,
            }
            .put(&mut b);
            let r = self.call(OPEN, node, &b);
            if r.error != 0 {
                return Err(r.error);
            }
            Ok(OpenOut::get(&r.body).fh)
        }

        /// Closes the guest end and returns what `serve` returned.
        fn finish(mut self) -> io::Result<()> {
            self.conn.shutdown(std::net::Shutdown::Both).unwrap();
            self.server.take().unwrap().join().unwrap()
        }
    }

    fn export(root: &Path, read_only: bool) -> Vec<Export> {
        vec![Export {
            channel: 7,
            root: root.to_owned(),
            read_only,
        }]
    }

    #[test]
    fn init_negotiates_what_the_server_implements() {
        let dir = Tmp::new("init");
        let mut g = Guest::start(export(&dir.0, false));
        // Nothing is served before INIT.
        assert_eq!(g.call(GETATTR, ROOT_ID, &[0; 16]).error, -libc::EIO);
        let i = g.init();
        assert_eq!((i.major, i.minor), (7, 38));
        assert_eq!(i.max_write, MAX_WRITE);
        assert_eq!(i.max_pages, MAX_PAGES);
        assert_eq!(i.max_readahead, 65536);
        assert_eq!(i.flags, WANTED_FLAGS);
        // A newer kernel minor gets ours; an older one than we accept is refused.
        let mut b = Vec::new();
        InitIn {
            major: 7,
            minor: 44,
            max_readahead: 4096,
            flags: FUSE_ASYNC_READ,
        }
        .put(&mut b);
        let r = g.call(INIT, 0, &b);
        assert_eq!(InitOut::get(&r.body).minor, 38);
        assert_eq!(InitOut::get(&r.body).flags, FUSE_ASYNC_READ);
        let mut b = Vec::new();
        InitIn {
            major: 7,
            minor: 20,
            max_readahead: 4096,
            flags: 0,
        }
        .put(&mut b);
        assert_eq!(g.call(INIT, 0, &b).error, -libc::EPROTO);
        g.finish().unwrap();
    }

    #[test]
    fn names_that_are_not_one_component_are_refused() {
        let dir = Tmp::new("names");
        std::fs::create_dir(dir.0.join("a")).unwrap();
        std::fs::write(dir.0.join("a/b"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc", dir.0.join("link")).unwrap();
        let mut g = Guest::start(export(&dir.0, false));
        g.init();
        assert_eq!(g.lookup(ROOT_ID, b"..").unwrap_err(), -libc::EINVAL);
        assert_eq!(g.lookup(ROOT_ID, b".").unwrap_err(), -libc::EINVAL);
        assert_eq!(g.lookup(ROOT_ID, b"a/b").unwrap_err(), -libc::EINVAL);
        assert_eq!(g.lookup(ROOT_ID, b"/etc").unwrap_err(), -libc::EINVAL);
        assert_eq!(g.lookup(ROOT_ID, b"").unwrap_err(), -libc::ENOENT);
        assert_eq!(
            g.lookup(ROOT_ID, &[b'a'; 256]).unwrap_err(),
            -libc::ENAMETOOLONG
        );
        // A name with a NUL inside, or none at the end.
        assert_eq!(g.call(LOOKUP, ROOT_ID, b"a\0b\0").error, -libc::EINVAL);
        assert_eq!(g.call(LOOKUP, ROOT_ID, b"a").error, -libc::EINVAL);
        // The plain name works, and a relookup is the same node.
        let a = g.lookup(ROOT_ID, b"a").unwrap();
        assert_eq!(a.nodeid, g.lookup(ROOT_ID, b"a").unwrap().nodeid);
        assert!(g.lookup(a.nodeid, b"b").is_ok());
        // A symlink is a node of its own, never a way through.
        let link = g.lookup(ROOT_ID, b"link").unwrap();
        assert_eq!(kind(link.attr.mode), libc::S_IFLNK);
        assert_eq!(
            g.lookup(link.nodeid, b"passwd").unwrap_err(),
            -libc::ENOTDIR
        );
        assert_eq!(g.call(OPENDIR, link.nodeid, &[0; 8]).error, -libc::ENOTDIR);
        assert_eq!(
            g.open(link.nodeid, libc::O_RDONLY).unwrap_err(),
            -libc::EACCES
        );
        let r = g.call(READLINK, link.nodeid, &[]);
        assert_eq!((r.error, r.body.as_slice()), (0, &b"/etc"[..]));
        // Making entries with bad names: MKDIR "..", RENAME to "a/b".
        let mut b = Vec::new();
        MkdirIn {
            mode: 0o755,
            umask: 0,
        }
        .put(&mut b);
        b.extend_from_slice(b"..\0");
        assert_eq!(g.call(MKDIR, ROOT_ID, &b).error, -libc::EINVAL);
        let mut b = Vec::new();
        RenameIn { newdir: ROOT_ID }.put(&mut b);
        b.extend_from_slice(b"link\0a/c\0");
        assert_eq!(g.call(RENAME, ROOT_ID, &b).error, -libc::EINVAL);
        g.finish().unwrap();
    }

    #[test]
    fn device_nodes_and_fifos_are_never_opened() {
        let dir = Tmp::new("dev");
        let null = CString::new(dir.0.join("null").as_os_str().as_bytes()).unwrap();
        let fifo = CString::new(dir.0.join("fifo").as_os_str().as_bytes()).unwrap();
        // SAFETY: NUL-terminated paths and integers.
        let rc = unsafe { libc::mknod(null.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        assert_eq!(rc, 0, "mknod (run as root): {}", io::Error::last_os_error());
        // SAFETY: as above.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0);
        let mut g = Guest::start(export(&dir.0, false));
        g.init();
        let dev = g.lookup(ROOT_ID, b"null").unwrap();
        assert_eq!(kind(dev.attr.mode), libc::S_IFCHR);
        assert_eq!(g.open(dev.nodeid, libc::O_RDWR).unwrap_err(), -libc::EACCES);
        assert_eq!(g.call(OPENDIR, dev.nodeid, &[0; 8]).error, -libc::ENOTDIR);
        // Truncating goes through an open too.
        let mut b = Vec::new();
        SetattrIn {
            valid: FATTR_SIZE,
            ..Default::default()
        }
        .put(&mut b);
        assert_eq!(g.call(SETATTR, dev.nodeid, &b).error, -libc::EINVAL);
        // A FIFO would block the server if it were opened.
        let f = g.lookup(ROOT_ID, b"fifo").unwrap();
        assert_eq!(g.open(f.nodeid, libc::O_RDONLY).unwrap_err(), -libc::EACCES);
        // MKNOD makes regular files only.
        for mode in [libc::S_IFCHR, libc::S_IFBLK, libc::S_IFIFO, libc::S_IFSOCK] {
            let mut b = Vec::new();
            MknodIn {
                mode: mode | 0o644,
                rdev: 0x103,
                umask: 0,
                padding: 0,
            }
            .put(&mut b);
            b.extend_from_slice(b"made\0");
            assert_eq!(g.call(MKNOD, ROOT_ID, &b).error, -libc::EPERM);
        }
        assert!(!dir.0.join("made").exists());
        let mut b = Vec::new();
        MknodIn {
            mode: libc::S_IFREG | 0o640,
            rdev: 0,
            umask: 0o022,
            padding: 0,
        }
        .put(&mut b);
        b.extend_from_slice(b"made\0");
        let r = g.call(MKNOD, ROOT_ID, &b);
        assert_eq!(r.error, 0);
        let m = std::fs::symlink_metadata(dir.0.join("made")).unwrap();
        assert!(m.file_type().is_file());
        assert_eq!(m.mode() & 0o7777, 0o640);
        g.finish().unwrap();
    }

    #[test]
    fn bogus_ids_short_bodies_and_unknown_channels_get_errors() {
        let dir = Tmp::new("bogus");
        std::fs::write(dir.0.join("f"), b"hello").unwrap();
        let mut g = Guest::start(export(&dir.0, false));
        g.init();
        assert_eq!(g.call(GETATTR, 9999, &[0; 16]).error, -libc::ENOENT);
        assert_eq!(g.lookup(9999, b"f").unwrap_err(), -libc::ENOENT);
        // Truncated bodies.
        assert_eq!(g.call(GETATTR, ROOT_ID, &[0; 3]).error, -libc::EINVAL);
        assert_eq!(g.call(READ, ROOT_ID, &[0; 8]).error, -libc::EINVAL);
        assert_eq!(g.call(SETATTR, ROOT_ID, &[0; 87]).error, -libc::EINVAL);
        let mut b = Vec::new();
        BatchForgetIn {
            count: 1000,
            dummy: 0,
        }
        .put(&mut b);
        g.send(7, BATCH_FORGET, 0, &b);
        // A header whose length is not the payload's.
        let mut p = Vec::new();
        InHeader {
            len: 1000,
            opcode: GETATTR,
            unique: 77,
            nodeid: 1,
            ..Default::default()
        }
        .put(&mut p);
        p.extend_from_slice(&[0; 16]);
        g.send_raw(7, &p);
        let r = g.recv();
        assert_eq!((r.unique, r.error), (77, -libc::EINVAL));
        // Extensions longer than the request.
        let mut p = Vec::new();
        InHeader {
            len: 56,
            opcode: GETATTR,
            unique: 78,
            nodeid: 1,
            total_extlen: 9,
            ..Default::default()
        }
        .put(&mut p);
        p.extend_from_slice(&[0; 16]);
        g.send_raw(7, &p);
        assert_eq!(g.recv().error, -libc::EINVAL);
        // A payload too short for a header gets no reply, and the connection goes on.
        g.send_raw(7, &[1, 2, 3]);
        // Unknown channel, opcode, handles; reads past any sane size.
        let u = g.send(8, GETATTR, ROOT_ID, &[0; 16]);
        let r = g.recv();
        assert_eq!((r.unique, r.error), (u, -libc::ENODEV));
        assert_eq!(g.call(4242, ROOT_ID, &[]).error, -libc::ENOSYS);
        assert_eq!(
            g.call(22, ROOT_ID, &[0; 8]).error,
            -libc::ENOSYS,
            "GETXATTR"
        );
        let mut b = Vec::new();
        ReadIn {
            fh: 31337,
            size: 10,
            ..Default::default()
        }
        .put(&mut b);
        assert_eq!(g.call(READ, ROOT_ID, &b).error, -libc::EBADF);
        let f = g.lookup(ROOT_ID, b"f").unwrap();
        let fh = g.open(f.nodeid, libc::O_RDONLY).unwrap();
        let mut b = Vec::new();
        ReadIn {
            fh,
            size: u32::MAX,
            ..Default::default()
        }
        .put(&mut b);
        let r = g.call(READ, f.nodeid, &b);
        assert_eq!((r.error, r.body.as_slice()), (0, &b"hello"[..]));
        let mut b = Vec::new();
        ReadIn {
            fh,
            offset: u64::MAX,
            size: 10,
            ..Default::default()
        }
        .put(&mut b);
        assert_eq!(g.call(READ, f.nodeid, &b).error, -libc::EINVAL);
        let mut b = Vec::new();
        ReadIn {
            fh,
            offset: 1 << 40,
            size: 10,
            ..Default::default()
        }
        .put(&mut b);
        let r = g.call(READ, f.nodeid, &b);
        assert_eq!((r.error, r.body.len()), (0, 0));
        // A WRITE whose data is shorter than its size; a write on a read-only handle.
        let mut b = Vec::new();
        WriteIn {
            fh,
            size: 100,
            ..Default::default()
        }
        .put(&mut b);
        b.extend_from_slice(b"abc");
        assert_eq!(g.call(WRITE, f.nodeid, &b).error, -libc::EINVAL);
        let mut b = Vec::new();
        WriteIn {
            fh,
            size: 3,
            ..Default::default()
        }
        .put(&mut b);
        b.extend_from_slice(b"abc");
        assert_eq!(g.call(WRITE, f.nodeid, &b).error, -libc::EBADF);
        // Forgetting more than was looked up, or a node never given, is harmless.
        let mut b = Vec::new();
        ForgetIn { nlookup: u64::MAX }.put(&mut b);
        g.send(7, FORGET, f.nodeid, &b);
        g.send(7, FORGET, 123456, &b);
        g.send(7, FORGET, ROOT_ID, &b);
        g.send(7, INTERRUPT, 0, &[0; 8]);
        assert_eq!(g.call(GETATTR, f.nodeid, &[0; 16]).error, -libc::ENOENT);
        assert_eq!(g.call(GETATTR, ROOT_ID, &[0; 16]).error, 0);
        // The open handle outlives its node.
        let mut b = Vec::new();
        ReadIn {
            fh,
            size: 5,
            ..Default::default()
        }
        .put(&mut b);
        assert_eq!(g.call(READ, f.nodeid, &b).body, b"hello");
        g.finish().unwrap();
    }

    #[test]
    fn a_frame_too_big_ends_the_connection() {
        let dir = Tmp::new("big");
        let mut g = Guest::start(export(&dir.0, false));
        let mut f = Vec::new();
        (MAX_PAYLOAD as u32 + 1).put(&mut f);
        7u32.put(&mut f);
        g.conn.write_all(&f).unwrap();
        let err = g.server.take().unwrap().join().unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn read_only_exports_refuse_every_change() {
        let dir = Tmp::new("ro");
        std::fs::write(dir.0.join("f"), b"keep").unwrap();
        let mut g = Guest::start(export(&dir.0, true));
        g.init();
        let f = g.lookup(ROOT_ID, b"f").unwrap();
        assert_eq!(g.open(f.nodeid, libc::O_WRONLY).unwrap_err(), -libc::EROFS);
        assert_eq!(
            g.open(f.nodeid, libc::O_RDONLY | libc::O_TRUNC)
                .unwrap_err(),
            -libc::EROFS
        );
        let mut b = Vec::new();
        SetattrIn {
            valid: FATTR_MODE,
            mode: 0o777,
            ..Default::default()
        }
        .put(&mut b);
        assert_eq!(g.call(SETATTR, f.nodeid, &b).error, -libc::EROFS);
        assert_eq!(g.call(UNLINK, ROOT_ID, b"f\0").error, -libc::EROFS);
        let mut b = Vec::new();
        CreateIn {
            flags: libc::O_WRONLY as u32,
            mode: 0o644,
            umask: 0,
            open_flags: 0,
        }
        .put(&mut b);
        b.extend_from_slice(b"new\0");
        assert_eq!(g.call(CREATE, ROOT_ID, &b).error, -libc::EROFS);
        assert_eq!(std::fs::read(dir.0.join("f")).unwrap(), b"keep");
        assert!(!dir.0.join("new").exists());
        g.finish().unwrap();
    }

    #[test]
    fn random_requests_get_replies_and_stay_in_the_export() {
        let top = Tmp::new("fuzz");
        let root = top.0.join("export");
        std::fs::create_dir_all(root.join("d/e")).unwrap();
        std::fs::write(root.join("f"), b"some bytes").unwrap();
        std::fs::write(top.0.join("outside"), b"keep").unwrap();
        let mut g = Guest::start(export(&root, false));
        g.init();
        for name in [&b"d"[..], b"f"] {
            let n = g.lookup(ROOT_ID, name).unwrap().nodeid;
            let _ = g.open(n, libc::O_RDWR);
            let _ = g.call(OPENDIR, n, &[0; 8]);
        }
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        // Every opcode but FALLOCATE (a huge one could fill the host's disk) and DESTROY
        // (which ends the session), with bodies of random bytes, names or none.
        let opcodes: Vec<u32> = (1..=52)
            .filter(|&o| o != FALLOCATE && o != DESTROY)
            .collect();
        for _ in 0..20_000 {
            let op = opcodes[(rnd() % opcodes.len() as u64) as usize];
            let node = [0, ROOT_ID, 2, 3, 4, u64::MAX][(rnd() % 6) as usize];
            let len = (rnd() % 120) as usize;
            let mut body: Vec<u8> = (0..len).map(|_| rnd() as u8).collect();
            match rnd() % 4 {
                // Small numbers where handles and nodeids go, and a plain name at the end.
                0 => {
                    for b in body.iter_mut() {
                        *b %= 4;
                    }
                    body.extend_from_slice(b"n\0");
                }
                1 => body.extend_from_slice(b"..\0"),
                _ => {}
            }
            let u = g.send(7, op, node, &body);
            if !matches!(op, FORGET | BATCH_FORGET | INTERRUPT | NOTIFY_REPLY) {
                let r = g.recv();
                assert_eq!(r.unique, u, "opcode {op}");
                assert!(r.error <= 0 && r.error > -512, "opcode {op}: {}", r.error);
            }
        }
        assert_eq!(std::fs::read(top.0.join("outside")).unwrap(), b"keep");
        let names: Vec<_> = std::fs::read_dir(&top.0)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "nothing made beside the export: {names:?}");
        g.finish().unwrap();
    }

    #[test]
    fn names_are_checked_like_linux() {
        let ok = |b: &[u8]| one_name(b).map(|c| c.to_bytes().to_vec());
        assert_eq!(ok(b"abc\0"), Ok(b"abc".to_vec()));
        assert_eq!(ok(b"\0"), Err(Errno(libc::ENOENT)));
        assert_eq!(ok(b"..\0"), Err(Errno(libc::EINVAL)));
        assert_eq!(ok(b"a/b\0"), Err(Errno(libc::EINVAL)));
        assert_eq!(ok(b"abc"), Err(Errno(libc::EINVAL)));
        assert_eq!(ok(b"a\0\0"), Err(Errno(libc::EINVAL)));
        assert_eq!(
            two_strings(b"a\0b/c\0").map(|(a, b)| (a.to_bytes(), b.to_bytes())),
            Ok((&b"a"[..], &b"b/c"[..]))
        );
        assert!(two_strings(b"a\0b").is_err());
        assert_eq!(EntryOut::N, 128);
        assert_eq!(AttrOut::N, 104);
        assert_eq!(InitOut::N, 64);
        assert_eq!(SetattrIn::N, 88);
        assert_eq!(Kstatfs::N, 80);
        assert_eq!(MIN_DEV_READ, 131_152);
    }
}
