//! The protocol spoken raw over a socket pair: what a hostile guest may send.

use super::codec::*;
use super::server::*;
use super::wire::*;
use super::*;
use std::ffi::CString;
use std::io::Read;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
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
        Self::with(Server::open(&exports).unwrap())
    }

    /// The guest end of `server`, which serves in a thread of its own.
    fn with(server: Server) -> Self {
        let (host, conn) = UnixStream::pair().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let server = std::thread::spawn(move || server.run(host));
        Guest {
            conn,
            unique: 0,
            server: Some(server),
        }
    }

    fn read(&mut self, node: u64, fh: u64) -> Result<Vec<u8>, i32> {
        let mut b = Vec::new();
        ReadIn {
            fh,
            size: 4096,
            ..Default::default()
        }
        .put(&mut b);
        let r = self.call(READ, node, &b);
        if r.error != 0 {
            return Err(r.error);
        }
        Ok(r.body)
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

/// A table taken from a serving server and taken in by a new one over a copy of the export
/// (a volume that moved with its microVM): the guest's nodeids and open files go on under
/// the same numbers, no INIT again; a node whose file was unlinked is lost (ENOENT), a
/// handle on it too (EBADF); new nodeids and handles do not reuse old ones.
#[test]
fn a_carried_table_keeps_the_guests_nodes_and_open_files() {
    let a = Tmp::new("carry-a");
    std::fs::create_dir(a.0.join("d")).unwrap();
    std::fs::write(a.0.join("d/f"), b"hello").unwrap();
    std::fs::write(a.0.join("gone"), b"x").unwrap();
    let server = Server::open(&export(&a.0, false)).unwrap();
    let reader = server.table_reader();
    let mut g = Guest::with(server);
    g.init();
    let d = g.lookup(ROOT_ID, b"d").unwrap();
    let f = g.lookup(d.nodeid, b"f").unwrap();
    let fh = g.open(f.nodeid, libc::O_RDWR).unwrap();
    let gone = g.lookup(ROOT_ID, b"gone").unwrap();
    let gone_fh = g.open(gone.nodeid, libc::O_RDONLY).unwrap();
    std::fs::remove_file(a.0.join("gone")).unwrap();
    let table = reader.table().unwrap();
    let table: carry::Table =
        serde_json::from_str(&serde_json::to_string(&table).unwrap()).unwrap();
    assert_eq!(table.channels.len(), 1);
    assert_eq!(table.channels[0].unnamed, 1, "{table:?}");
    assert!(table.channels[0].ready);
    g.finish().unwrap();

    let b = Tmp::new("carry-b");
    std::fs::create_dir(b.0.join("d")).unwrap();
    std::fs::write(b.0.join("d/f"), b"hello").unwrap();
    let (server, r) = Server::open_carried(&export(&b.0, false), &table).unwrap();
    assert_eq!(
        (r.nodes, r.handles, r.lost_nodes, r.lost_handles),
        (2, 1, 1, 1)
    );
    let mut g = Guest::with(server);
    assert_eq!(g.read(f.nodeid, fh).unwrap(), b"hello");
    let mut w = Vec::new();
    WriteIn {
        fh,
        size: 5,
        ..Default::default()
    }
    .put(&mut w);
    w.extend_from_slice(b"HELLO");
    assert_eq!(g.call(WRITE, f.nodeid, &w).error, 0);
    assert_eq!(std::fs::read(b.0.join("d/f")).unwrap(), b"HELLO");
    assert_eq!(g.call(GETATTR, gone.nodeid, &[0; 16]).error, -libc::ENOENT);
    assert_eq!(g.read(gone.nodeid, gone_fh), Err(-libc::EBADF));
    assert_eq!(g.lookup(d.nodeid, b"f").unwrap().nodeid, f.nodeid);
    std::fs::write(b.0.join("new"), b"").unwrap();
    let new = g.lookup(ROOT_ID, b"new").unwrap();
    assert!(new.nodeid > gone.nodeid, "a new nodeid: {}", new.nodeid);
    assert!(g.open(new.nodeid, libc::O_RDONLY).unwrap() > gone_fh);
    g.finish().unwrap();
}

/// A table naming paths that lead out of the export (`..`, a symlink) brings nothing back.
#[test]
fn a_carried_table_reaches_nothing_outside_its_export() {
    let outside = Tmp::new("carry-out");
    std::fs::write(outside.0.join("secret"), b"s").unwrap();
    let root = Tmp::new("carry-root");
    std::os::unix::fs::symlink(&outside.0, root.0.join("link")).unwrap();
    let node = |id: u64, p: &[u8]| carry::NodeEntry {
        id,
        path: locker_sys::hex::encode(p),
        refs: 1,
    };
    let name = outside.0.file_name().unwrap().as_bytes().to_vec();
    let mut up = b"../".to_vec();
    up.extend_from_slice(&name);
    up.extend_from_slice(b"/secret");
    let table = carry::Table {
        channels: vec![carry::ChannelTable {
            channel: 7,
            ready: true,
            next_id: 10,
            next_fh: 10,
            nodes: vec![
                node(2, &up),
                node(3, b"link/secret"),
                node(4, b"link"),
                node(5, outside.0.as_os_str().as_bytes()),
                node(6, b"zz"),
            ],
            handles: vec![carry::HandleEntry {
                fh: 1,
                node: 3,
                dir: false,
                flags: libc::O_RDONLY,
            }],
            unnamed: 0,
        }],
    };
    let (server, r) = Server::open_carried(&export(&root.0, false), &table).unwrap();
    // Only the symlink itself, as a node (never followed).
    assert_eq!(
        (r.nodes, r.handles, r.lost_nodes, r.lost_handles),
        (1, 0, 4, 1)
    );
    let mut g = Guest::with(server);
    assert_eq!(g.open(4, libc::O_RDONLY), Err(-libc::EACCES));
    for id in [2, 3, 5, 6] {
        assert_eq!(
            g.call(GETATTR, id, &[0; 16]).error,
            -libc::ENOENT,
            "node {id}"
        );
    }
    g.finish().unwrap();
}
