//! The FUSE wire: opcodes, flags, and little-endian mirrors of `fuse.h` structs.
//!
//! Pure data: nothing here reads a socket or touches the host.

// Opcodes (`enum fuse_opcode`).
pub(super) const LOOKUP: u32 = 1;
pub(super) const FORGET: u32 = 2;
pub(super) const GETATTR: u32 = 3;
pub(super) const SETATTR: u32 = 4;
pub(super) const READLINK: u32 = 5;
pub(super) const SYMLINK: u32 = 6;
pub(super) const MKNOD: u32 = 8;
pub(super) const MKDIR: u32 = 9;
pub(super) const UNLINK: u32 = 10;
pub(super) const RMDIR: u32 = 11;
pub(super) const RENAME: u32 = 12;
pub(super) const LINK: u32 = 13;
pub(super) const OPEN: u32 = 14;
pub(super) const READ: u32 = 15;
pub(super) const WRITE: u32 = 16;
pub(super) const STATFS: u32 = 17;
pub(super) const RELEASE: u32 = 18;
pub(super) const FSYNC: u32 = 20;
pub(super) const FLUSH: u32 = 25;
pub(super) const INIT: u32 = 26;
pub(super) const OPENDIR: u32 = 27;
pub(super) const READDIR: u32 = 28;
pub(super) const RELEASEDIR: u32 = 29;
pub(super) const FSYNCDIR: u32 = 30;
pub(super) const ACCESS: u32 = 34;
pub(super) const CREATE: u32 = 35;
pub(super) const INTERRUPT: u32 = 36;
pub(super) const DESTROY: u32 = 38;
pub(super) const NOTIFY_REPLY: u32 = 41;
pub(super) const BATCH_FORGET: u32 = 42;
pub(super) const FALLOCATE: u32 = 43;
pub(super) const RENAME2: u32 = 45;
pub(super) const LSEEK: u32 = 46;
pub(super) const COPY_FILE_RANGE: u32 = 47;

// INIT flags.
pub(super) const FUSE_ASYNC_READ: u32 = 1 << 0;
pub(super) const FUSE_ATOMIC_O_TRUNC: u32 = 1 << 3;
pub(super) const FUSE_BIG_WRITES: u32 = 1 << 5;
pub(super) const FUSE_AUTO_INVAL_DATA: u32 = 1 << 12;
pub(super) const FUSE_PARALLEL_DIROPS: u32 = 1 << 18;
pub(super) const FUSE_MAX_PAGES: u32 = 1 << 22;
/// What the server asks for, of what the kernel offers.
pub(super) const WANTED_FLAGS: u32 = FUSE_ASYNC_READ
    | FUSE_ATOMIC_O_TRUNC
    | FUSE_BIG_WRITES
    | FUSE_AUTO_INVAL_DATA
    | FUSE_PARALLEL_DIROPS
    | FUSE_MAX_PAGES;

// SETATTR `valid` bits.
pub(super) const FATTR_MODE: u32 = 1 << 0;
pub(super) const FATTR_UID: u32 = 1 << 1;
pub(super) const FATTR_GID: u32 = 1 << 2;
pub(super) const FATTR_SIZE: u32 = 1 << 3;
pub(super) const FATTR_ATIME: u32 = 1 << 4;
pub(super) const FATTR_MTIME: u32 = 1 << 5;
pub(super) const FATTR_FH: u32 = 1 << 6;
pub(super) const FATTR_ATIME_NOW: u32 = 1 << 7;
pub(super) const FATTR_MTIME_NOW: u32 = 1 << 8;

pub(super) const FUSE_FSYNC_FDATASYNC: u32 = 1 << 0;

/// A little-endian wire value: an integer, an array of them, or a `#[repr(C)]` mirror of a
/// `fuse.h` struct made by [`wire!`].
pub(super) trait Le: Sized {
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
        pub(super) struct $name { $(pub(super) $f: $t),* }

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
