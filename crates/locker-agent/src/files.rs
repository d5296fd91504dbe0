//! The files API inside the machine: read, write, list, stat, mkdir, move, remove.
//!
//! Every path is resolved relative to a root directory fd taken at start
//! (`$LOCKER_AGENT_ROOT`, default `/`) with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`:
//! `..`, absolute symlinks and symlink chains resolve as if that directory were `/`, so no
//! path can reach a file outside it. Operations on a final name (mkdir, unlink, rename, lstat)
//! use the `*at` calls on its parent directory fd, opened the same way. Paths from the host are
//! first cleaned lexically (`/a/./b/../c` is `/a/c`).
//!
//! Writes are all-or-nothing: data goes to a temporary name in the same directory, is
//! fsynced, then renamed over the target.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::ops::ControlFlow;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use locker_proto::{
    entry_cost, AgentError, Chan, EndBody, ErrorCode, Reply, DATA_CHUNK, MAX_LIST_BYTES,
    MAX_LIST_ENTRIES, MAX_PAYLOAD,
};
use locker_types::{Entry, EntryType};

use crate::conn::{Inbound, Recv, Stream};
use crate::{sys, Agent};

/// A cleaned absolute path: its components, none of them empty, `.` or `..`.
pub(crate) struct CleanPath {
    pub(crate) comps: Vec<String>,
}

impl CleanPath {
    pub(crate) fn parse(path: &str) -> Result<CleanPath, AgentError> {
        if !path.starts_with('/') {
            return Err(bad(format!("path must be absolute, got {path:?}")));
        }
        if path.contains('\0') {
            return Err(bad("path must not contain NUL bytes"));
        }
        let mut comps: Vec<String> = Vec::new();
        for c in path.split('/') {
            match c {
                "" | "." => {}
                ".." => {
                    comps.pop();
                }
                c => comps.push(c.to_string()),
            }
        }
        Ok(CleanPath { comps })
    }

    pub(crate) fn display(&self) -> String {
        format!("/{}", self.comps.join("/"))
    }

    fn rel(comps: &[String]) -> CString {
        let s = if comps.is_empty() {
            ".".to_string()
        } else {
            comps.join("/")
        };
        // Components come from a string already checked for NUL.
        CString::new(s).unwrap_or_default()
    }

    fn name(&self) -> Option<CString> {
        self.comps
            .last()
            .and_then(|n| CString::new(n.as_str()).ok())
    }

    fn parent(&self) -> &[String] {
        &self.comps[..self.comps.len().saturating_sub(1)]
    }
}

pub(crate) fn bad(msg: impl Into<String>) -> AgentError {
    AgentError::new(ErrorCode::BadRequest, msg)
}

/// Maps an OS error of `what` on `path` onto the error classes the host understands.
pub(crate) fn os_err(what: &str, path: &str, e: io::Error) -> AgentError {
    let code = match e.raw_os_error().unwrap_or(0) {
        libc::ENOENT | libc::ENOTDIR => ErrorCode::NotFound,
        libc::EEXIST | libc::ENOTEMPTY | libc::EBUSY => ErrorCode::Conflict,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ErrorCode::Exhausted,
        libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN => ErrorCode::Busy,
        // A socket, or a device without a driver: not a file whose bytes can be read.
        libc::ENXIO => ErrorCode::BadRequest,
        libc::EISDIR
        | libc::EINVAL
        | libc::ENAMETOOLONG
        | libc::ELOOP
        | libc::EXDEV
        | libc::EACCES
        | libc::EPERM
        | libc::EROFS
        | libc::ETXTBSY => ErrorCode::BadRequest,
        _ => ErrorCode::Internal,
    };
    AgentError::new(code, format!("{what} {path}: {e}"))
}

fn open(agent: &Agent, comps: &[String], flags: i32) -> io::Result<OwnedFd> {
    sys::open_in_root(agent.root.as_raw_fd(), &CleanPath::rel(comps), flags, 0)
}

pub(crate) fn open_dir(agent: &Agent, comps: &[String]) -> io::Result<OwnedFd> {
    open(agent, comps, libc::O_RDONLY | libc::O_DIRECTORY)
}

pub(crate) fn kind_of(mode: u32) -> EntryType {
    match mode & libc::S_IFMT {
        libc::S_IFREG => EntryType::File,
        libc::S_IFDIR => EntryType::Dir,
        libc::S_IFLNK => EntryType::Symlink,
        _ => EntryType::Other,
    }
}

pub(crate) fn entry(path: String, name: String, st: &libc::stat) -> Entry {
    Entry {
        path,
        name,
        kind: kind_of(st.st_mode),
        size: st.st_size.max(0) as u64,
        mode: st.st_mode & 0o7777,
        mtime: locker_types::rfc3339(st.st_mtime),
        uid: Some(st.st_uid),
        gid: Some(st.st_gid),
        target: None,
        metadata: Default::default(),
    }
}

/// The namespace of the extended attributes that are a file's user metadata (E2B's).
const META_PREFIX: &str = "user.e2b.";
/// The most bytes of metadata one file may be given (names with the prefix, and values),
/// as envd: the filesystem's per-inode budget for attributes.
const META_MAX_BYTES: usize = 4096;

/// `e` (of `name` in `dir`) with what `entry` leaves out: a symlink's target, a regular
/// file's user metadata. Best effort: what cannot be read is left out.
pub(crate) fn describe(dir: RawFd, name: &std::ffi::CStr, mut e: Entry) -> Entry {
    match e.kind {
        EntryType::Symlink => {
            e.target = sys::readlinkat(dir, name)
                .ok()
                .map(|t| String::from_utf8_lossy(&t).into_owned());
        }
        EntryType::File => {
            // O_NONBLOCK: the entry was a regular file when stat'ed, but may have become a
            // FIFO since; O_NOFOLLOW: or a symlink.
            let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;
            if let Ok(fd) = sys::openat(dir, name, flags, 0) {
                e.metadata = metadata_of(fd.as_raw_fd());
            }
        }
        _ => {}
    }
    e
}

/// The user metadata of the file `fd` is open on.
fn metadata_of(fd: RawFd) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(names) = locker_sys::xattr::flist(fd) else {
        return out;
    };
    let mut buf = vec![0u8; META_MAX_BYTES];
    for n in names {
        let Some(key) = n.to_str().ok().and_then(|k| k.strip_prefix(META_PREFIX)) else {
            continue;
        };
        if let Ok(v) = locker_sys::xattr::fget(fd, &n, &mut buf) {
            out.insert(key.to_owned(), String::from_utf8_lossy(v).into_owned());
        }
    }
    out
}

/// Checks user metadata as envd does: keys and values printable US-ASCII, keys not empty
/// and at most 246 bytes (the kernel's 255 less the prefix), the whole at most
/// [`META_MAX_BYTES`] counting the prefix once per key.
fn check_metadata(m: &std::collections::BTreeMap<String, String>) -> Result<(), AgentError> {
    let printable = |s: &str| s.bytes().all(|b| (0x20..=0x7e).contains(&b));
    let mut total = 0;
    for (k, v) in m {
        if k.is_empty() || k.len() > 255 - META_PREFIX.len() || !printable(k) {
            return Err(bad(format!(
                "metadata key {k:?}: keys are 1 to {} printable ASCII bytes",
                255 - META_PREFIX.len()
            )));
        }
        if !printable(v) {
            return Err(bad(format!(
                "metadata value of {k:?}: values are printable ASCII"
            )));
        }
        total += META_PREFIX.len() + k.len() + v.len();
    }
    if total > META_MAX_BYTES {
        return Err(bad(format!(
            "metadata of {total} bytes (keys with the `{META_PREFIX}` prefix, and values): \
             at most {META_MAX_BYTES}"
        )));
    }
    Ok(())
}

/// Describes `p` without following a final symlink.
fn lstat_entry(agent: &Agent, p: &CleanPath) -> Result<Entry, AgentError> {
    let path = p.display();
    let Some(name) = p.name() else {
        let st = sys::fstat(agent.root.as_raw_fd()).map_err(|e| os_err("stat", &path, e))?;
        return Ok(entry(path, "/".into(), &st));
    };
    let dir = open_dir(agent, p.parent()).map_err(|e| os_err("stat", &path, e))?;
    let st = sys::lstatat(dir.as_raw_fd(), &name).map_err(|e| os_err("stat", &path, e))?;
    let e = entry(path, p.comps.last().cloned().unwrap_or_default(), &st);
    Ok(describe(dir.as_raw_fd(), &name, e))
}

/// Creates `comps` and its missing parents; returns the directory opened.
pub(crate) fn mkdir_p(
    agent: &Agent,
    comps: &[String],
    display: &str,
) -> Result<OwnedFd, AgentError> {
    match open_dir(agent, comps) {
        Ok(fd) => return Ok(fd),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            return Err(AgentError::new(
                ErrorCode::Conflict,
                format!("mkdir {display}: a path component is not a directory"),
            ))
        }
        Err(e) => return Err(os_err("mkdir", display, e)),
    }
    let mut dir = open_dir(agent, &[]).map_err(|e| os_err("mkdir", display, e))?;
    for i in 0..comps.len() {
        let name = CString::new(comps[i].as_str()).map_err(|_| bad("path contains NUL"))?;
        match sys::mkdirat(dir.as_raw_fd(), &name, 0o755) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(os_err("mkdir", display, e)),
        }
        // Re-resolve from the root, so a symlinked component is followed inside the root.
        dir = open_dir(agent, &comps[..=i]).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTDIR) => AgentError::new(
                ErrorCode::Conflict,
                format!("mkdir {display}: a path component is not a directory"),
            ),
            _ => os_err("mkdir", display, e),
        })?;
    }
    Ok(dir)
}

/// Serves `Request::ReadFile`.
pub fn read_file(agent: &Agent, s: &Stream, path: &str) {
    if let Err(e) = read_file_inner(agent, s, path) {
        s.fail(e);
    }
}

/// Bytes served at most from a file on a pseudo filesystem (procfs, sysfs, debugfs...):
/// such files say size 0 and some never end (`/proc/self/pagemap`), so they are read up to
/// this and no further. Their real contents are a few KiB.
pub const MAX_PSEUDO_FILE_BYTES: u64 = 4 << 20;

/// `f_type`s of filesystems whose files are generated by the kernel, not stored.
pub(crate) const PSEUDO_FS: &[i64] = &[
    0x9fa0,      // procfs
    0x6265_6572, // sysfs
    0x6462_6720, // debugfs
    0x7472_6163, // tracefs
    0x0027_e0eb, // cgroup v1
    0x6367_7270, // cgroup2
    0xcafe_4a11, // bpf
    0x7363_6673, // securityfs
];

fn read_file_inner(agent: &Agent, s: &Stream, path: &str) -> Result<(), AgentError> {
    let p = CleanPath::parse(path)?;
    let shown = p.display();
    let not_regular = || {
        bad(format!("read {shown}: not a regular file (a socket, FIFO or device); only regular files can be downloaded"))
    };
    // O_NONBLOCK: opening a FIFO must not hang; it is refused below anyway.
    let fd = match open(agent, &p.comps, libc::O_RDONLY | libc::O_NONBLOCK) {
        Ok(fd) => fd,
        // What opening a socket file answers.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Err(not_regular()),
        Err(e) => return Err(os_err("read", &shown, e)),
    };
    let st = sys::fstat(fd.as_raw_fd()).map_err(|e| os_err("read", &shown, e))?;
    match kind_of(st.st_mode) {
        EntryType::File => {}
        EntryType::Dir => return Err(bad(format!("read {shown}: is a directory"))),
        _ => return Err(not_regular()),
    }
    let pseudo = sys::fs_type(fd.as_raw_fd()).is_ok_and(|t| PSEUDO_FS.contains(&t));
    let mut left = if pseudo {
        MAX_PSEUDO_FILE_BYTES
    } else {
        u64::MAX
    };
    let mut f = File::from(fd);
    let mut buf = vec![0u8; DATA_CHUNK];
    // The first chunk is read before anything is sent, so a file that cannot be read at all
    // (`/proc/self/mem`) is a clean error instead of a download cut after its header.
    let read = |f: &mut File, buf: &mut [u8], left: u64| -> Result<usize, AgentError> {
        let want = buf.len().min(left.min(usize::MAX as u64) as usize);
        loop {
            match f.read(&mut buf[..want]) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if pseudo => {
                    return Err(bad(format!(
                        "read {shown}: {e} (a kernel file that cannot be read this way)"
                    )))
                }
                Err(e) => return Err(os_err("read", &shown, e)),
            }
        }
    };
    let mut n = read(&mut f, &mut buf, left)?;
    let name = p.comps.last().cloned().unwrap_or_else(|| "/".into());
    if s.msg(Reply::Entry(entry(shown.clone(), name, &st)))
        .is_err()
    {
        return Ok(());
    }
    while n > 0 {
        if s.data(Chan::Bytes, &buf[..n]).is_err() {
            return Ok(());
        }
        left -= n as u64;
        if left == 0 {
            break;
        }
        n = read(&mut f, &mut buf, left)?;
    }
    s.end(EndBody::Ok);
    Ok(())
}

/// Serves `Request::WriteFile`.
pub fn write_file(
    agent: &Agent,
    s: &Stream,
    path: &str,
    mode: Option<u32>,
    metadata: &std::collections::BTreeMap<String, String>,
) {
    match write_file_inner(agent, s, path, mode, metadata) {
        Ok(Some(e)) => s.end(EndBody::Entry(e)),
        Ok(None) => {}
        Err(e) => s.fail(e),
    }
}

/// Removes a temporary file when dropped, unless disarmed.
pub(crate) struct TempGuard {
    pub(crate) dir: RawFd,
    pub(crate) name: Option<CString>,
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(n) = self.name.take() {
            let _ = sys::unlinkat(self.dir, &n, false);
        }
    }
}

fn write_file_inner(
    agent: &Agent,
    s: &Stream,
    path: &str,
    mode: Option<u32>,
    metadata: &std::collections::BTreeMap<String, String>,
) -> Result<Option<Entry>, AgentError> {
    check_metadata(metadata)?;
    let p = CleanPath::parse(path)?;
    let shown = p.display();
    let name = p
        .name()
        .ok_or_else(|| bad("cannot write to the root directory"))?;
    let dir = mkdir_p(agent, p.parent(), &shown)?;
    let existing = match sys::lstatat(dir.as_raw_fd(), &name) {
        Ok(st) => Some(st),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => None,
        Err(e) => return Err(os_err("write", &shown, e)),
    };
    if let Some(st) = &existing {
        if kind_of(st.st_mode) == EntryType::Dir {
            return Err(bad(format!("write {shown}: is a directory")));
        }
    }
    let mode = mode
        .or_else(|| {
            existing
                .filter(|st| kind_of(st.st_mode) == EntryType::File)
                .map(|st| st.st_mode)
        })
        .unwrap_or(0o644)
        & 0o7777;
    let base: String = p
        .comps
        .last()
        .map(|n| n.chars().take(64).collect())
        .unwrap_or_default();
    let tmp = CString::new(format!(".{base}.{}.locker-tmp", crate::random_id("")))
        .map_err(|_| bad("bad name"))?;
    let fd = sys::openat(
        dir.as_raw_fd(),
        &tmp,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
        0o600,
    )
    .map_err(|e| os_err("write", &shown, e))?;
    let mut guard = TempGuard {
        dir: dir.as_raw_fd(),
        name: Some(tmp.clone()),
    };
    let mut f = File::from(fd);
    loop {
        match s.recv(None) {
            Recv::Item(Inbound::Data(chan, bytes)) => {
                if chan == Chan::Bytes {
                    f.write_all(&bytes)
                        .map_err(|e| os_err("write", &shown, e))?;
                }
                s.credit(chan, bytes.len());
            }
            Recv::Item(Inbound::Eof(Chan::Bytes)) => break,
            Recv::Item(_) | Recv::Timeout => {}
            Recv::Gone => return Ok(None),
        }
    }
    sys::fchmod(f.as_raw_fd(), mode).map_err(|e| os_err("write", &shown, e))?;
    for (k, v) in metadata {
        let n = CString::new(format!("{META_PREFIX}{k}")).map_err(|_| bad("bad metadata key"))?;
        locker_sys::xattr::fset(f.as_raw_fd(), &n, v.as_bytes()).map_err(|e| {
            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                bad(format!(
                    "write {shown}: its filesystem keeps no user extended attributes, so no metadata"
                ))
            } else {
                os_err("write metadata of", &shown, e)
            }
        })?;
    }
    sys::fsync(f.as_raw_fd()).map_err(|e| os_err("write", &shown, e))?;
    drop(f);
    sys::renameat(dir.as_raw_fd(), &tmp, dir.as_raw_fd(), &name)
        .map_err(|e| os_err("write", &shown, e))?;
    guard.name = None;
    let _ = sys::fsync(dir.as_raw_fd());
    let st = sys::lstatat(dir.as_raw_fd(), &name).map_err(|e| os_err("write", &shown, e))?;
    let e = entry(shown, p.comps.last().cloned().unwrap_or_default(), &st);
    Ok(Some(describe(dir.as_raw_fd(), &name, e)))
}

/// Serves `Request::Stat`.
pub fn stat(agent: &Agent, s: &Stream, path: &str) {
    match CleanPath::parse(path).and_then(|p| lstat_entry(agent, &p)) {
        Ok(e) => s.end(EndBody::Entry(e)),
        Err(e) => s.fail(e),
    }
}

/// Serves `Request::Chown`.
pub fn chown(agent: &Agent, s: &Stream, path: &str, user: &str) {
    let r = (|| {
        let u = crate::users::resolve(Some(user)).map_err(bad)?;
        let p = CleanPath::parse(path)?;
        let shown = p.display();
        let fd = open(agent, &p.comps, libc::O_PATH | libc::O_NOFOLLOW)
            .map_err(|e| os_err("chown", &shown, e))?;
        sys::fchown_empty(fd.as_raw_fd(), u.uid, u.gid).map_err(|e| os_err("chown", &shown, e))
    })();
    match r {
        Ok(()) => s.end(EndBody::Ok),
        Err(e) => s.fail(e),
    }
}

/// Serves `Request::Mkdir`.
pub fn mkdir(agent: &Agent, s: &Stream, path: &str) {
    let r = CleanPath::parse(path).and_then(|p| {
        mkdir_p(agent, &p.comps, &p.display())?;
        lstat_entry(agent, &p)
    });
    match r {
        Ok(e) => s.end(EndBody::Entry(e)),
        Err(e) => s.fail(e),
    }
}

/// Serves `Request::Move`: a rename; the destination's parents are created.
pub fn rename(agent: &Agent, s: &Stream, from: &str, to: &str) {
    let r = (|| {
        let f = CleanPath::parse(from)?;
        let t = CleanPath::parse(to)?;
        let (Some(fname), Some(tname)) = (f.name(), t.name()) else {
            return Err(bad("cannot move the root directory"));
        };
        let shown = f.display();
        let fdir = open_dir(agent, f.parent()).map_err(|e| os_err("move", &shown, e))?;
        sys::lstatat(fdir.as_raw_fd(), &fname).map_err(|e| os_err("move", &shown, e))?;
        let tdir = mkdir_p(agent, t.parent(), &t.display())?;
        sys::renameat(fdir.as_raw_fd(), &fname, tdir.as_raw_fd(), &tname).map_err(|e| {
            let what = format!("move {shown} to");
            os_err(&what, &t.display(), e)
        })?;
        lstat_entry(agent, &t)
    })();
    match r {
        Ok(e) => s.end(EndBody::Entry(e)),
        Err(e) => s.fail(e),
    }
}

/// Serves `Request::Remove`.
pub fn remove(agent: &Agent, s: &Stream, path: &str, recursive: bool) {
    let r = (|| {
        let p = CleanPath::parse(path)?;
        let shown = p.display();
        let name = p
            .name()
            .ok_or_else(|| bad("refusing to remove the root directory"))?;
        let dir = open_dir(agent, p.parent()).map_err(|e| os_err("remove", &shown, e))?;
        let st = sys::lstatat(dir.as_raw_fd(), &name).map_err(|e| os_err("remove", &shown, e))?;
        if kind_of(st.st_mode) != EntryType::Dir {
            return sys::unlinkat(dir.as_raw_fd(), &name, false)
                .map_err(|e| os_err("remove", &shown, e));
        }
        if recursive {
            return remove_tree(dir.as_raw_fd(), &name).map_err(|e| os_err("remove", &shown, e));
        }
        sys::unlinkat(dir.as_raw_fd(), &name, true).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTEMPTY | libc::EEXIST) => AgentError::new(
                ErrorCode::Conflict,
                format!(
                    "remove {shown}: the directory is not empty (pass recursive=true, or `-r` on the command line, to remove it all)"
                ),
            ),
            _ => os_err("remove", &shown, e),
        })
    })();
    match r {
        Ok(()) => s.end(EndBody::Ok),
        Err(e) => s.fail(e),
    }
}

pub(crate) fn sorted_names(fd: &OwnedFd) -> io::Result<Vec<CString>> {
    let mut names = sys::read_dir_names(fd.try_clone()?)?;
    // Descending, so popping yields ascending order.
    names.sort_by(|a, b| b.as_bytes().cmp(a.as_bytes()));
    Ok(names)
}

pub(crate) fn open_child_dir(dir: RawFd, name: &CString) -> io::Result<OwnedFd> {
    sys::openat(
        dir,
        name,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
    )
}

/// Removes the directory `name` in `parent` and everything below it, never following a
/// symlink; iterative, so depth costs file descriptors, not stack.
fn remove_tree(parent: RawFd, name: &CString) -> io::Result<()> {
    struct Level {
        name: CString,
        fd: OwnedFd,
        names: Vec<CString>,
    }
    let fd = open_child_dir(parent, name)?;
    let names = sorted_names(&fd)?;
    let mut stack = vec![Level {
        name: name.clone(),
        fd,
        names,
    }];
    while let Some(top) = stack.last_mut() {
        match top.names.pop() {
            Some(child) => {
                let st = match sys::lstatat(top.fd.as_raw_fd(), &child) {
                    Ok(st) => st,
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                    Err(e) => return Err(e),
                };
                if kind_of(st.st_mode) == EntryType::Dir {
                    let fd = open_child_dir(top.fd.as_raw_fd(), &child)?;
                    let names = sorted_names(&fd)?;
                    stack.push(Level {
                        name: child,
                        fd,
                        names,
                    });
                } else {
                    sys::unlinkat(top.fd.as_raw_fd(), &child, false)?;
                }
            }
            None => {
                let done = stack.pop().map(|l| l.name).unwrap_or_default();
                let up = stack.last().map(|l| l.fd.as_raw_fd()).unwrap_or(parent);
                match sys::unlinkat(up, &done, true) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(())
}

/// Serves `Request::List`: entries in depth-first order, each directory's sorted by name,
/// down to `depth` levels; long answers come in `Msg(Entries)` batches.
pub fn list(agent: &Agent, s: &Stream, path: &str, depth: u32) {
    if let Err(e) = list_inner(agent, s, path, depth.max(1)) {
        s.fail(e);
    }
}

/// Entry bytes (see [`entry_cost`]) a listing gathers before it stops to count: under
/// this, one walk serves the answer; over it, a counting walk first makes sure the whole
/// answer is within the protocol's bounds before any entry is sent.
const LIST_GATHER_BYTES: usize = 4 << 20;

fn list_inner(agent: &Agent, s: &Stream, path: &str, depth: u32) -> Result<(), AgentError> {
    let p = CleanPath::parse(path)?;
    let shown = p.display();
    let probe = open(agent, &p.comps, libc::O_PATH).map_err(|e| os_err("list", &shown, e))?;
    let st = sys::fstat(probe.as_raw_fd()).map_err(|e| os_err("list", &shown, e))?;
    if kind_of(st.st_mode) != EntryType::Dir {
        return Err(bad(format!("list {shown}: not a directory")));
    }
    // Gather a small answer whole; count a large one before sending it.
    let mut gathered = Vec::new();
    let (mut count, mut bytes) = (0usize, 0usize);
    let mut small = true;
    walk(agent, &p, depth, |e| {
        count += 1;
        bytes += entry_cost(&e);
        if count > MAX_LIST_ENTRIES || bytes > MAX_LIST_BYTES {
            return ControlFlow::Break(());
        }
        if small && bytes <= LIST_GATHER_BYTES {
            gathered.push(e);
        } else if small {
            small = false;
            gathered = Vec::new();
        }
        ControlFlow::Continue(())
    })?;
    if count > MAX_LIST_ENTRIES || bytes > MAX_LIST_BYTES {
        return Err(AgentError::new(
            ErrorCode::Exhausted,
            format!(
                "list {shown} at depth {depth}: more than {MAX_LIST_ENTRIES} entries or {} MiB; \
                 list a subdirectory or use a smaller depth",
                MAX_LIST_BYTES >> 20
            ),
        ));
    }
    let mut batch: Vec<Entry> = Vec::new();
    let mut size = 0usize;
    let mut gone = false;
    let mut send = |e: Entry| {
        // Batches are cut by their exact JSON size: escaped names can be longer than counted.
        let n = serde_json::to_vec(&e).map(|v| v.len()).unwrap_or(0) + 1;
        if size + n > MAX_PAYLOAD / 2 && !batch.is_empty() {
            if s.msg(Reply::Entries {
                entries: std::mem::take(&mut batch),
            })
            .is_err()
            {
                gone = true;
                return ControlFlow::Break(());
            }
            size = 0;
        }
        size += n;
        batch.push(e);
        ControlFlow::Continue(())
    };
    if small {
        let _ = gathered.into_iter().try_for_each(&mut send);
    } else {
        // The tree may have grown since it was counted; the host's own bound holds then.
        walk(agent, &p, depth, &mut send)?;
    }
    if !gone {
        s.end(EndBody::Entries(batch));
    }
    Ok(())
}

/// Calls `f` with every entry under `p` down to `depth` levels, depth first, each
/// directory's entries sorted by name, until `f` breaks.
fn walk(
    agent: &Agent,
    p: &CleanPath,
    depth: u32,
    mut f: impl FnMut(Entry) -> ControlFlow<()>,
) -> Result<(), AgentError> {
    struct Level {
        fd: OwnedFd,
        path: String,
        names: Vec<CString>,
        level: u32,
    }
    let shown = p.display();
    let fd = open_dir(agent, &p.comps).map_err(|e| os_err("list", &shown, e))?;
    let names = sorted_names(&fd).map_err(|e| os_err("list", &shown, e))?;
    let base = if p.comps.is_empty() {
        String::new()
    } else {
        shown.clone()
    };
    let mut stack = vec![Level {
        fd,
        path: base,
        names,
        level: 1,
    }];
    while let Some(top) = stack.last_mut() {
        let Some(name) = top.names.pop() else {
            stack.pop();
            continue;
        };
        let Ok(st) = sys::lstatat(top.fd.as_raw_fd(), &name) else {
            continue;
        };
        let shown_name = String::from_utf8_lossy(name.as_bytes()).into_owned();
        let child_path = format!("{}/{}", top.path, shown_name);
        let descend = kind_of(st.st_mode) == EntryType::Dir && top.level < depth;
        let e = describe(
            top.fd.as_raw_fd(),
            &name,
            entry(child_path.clone(), shown_name, &st),
        );
        if f(e).is_break() {
            return Ok(());
        }
        if descend {
            let level = top.level + 1;
            if let Ok(fd) = open_child_dir(top.fd.as_raw_fd(), &name) {
                if let Ok(names) = sorted_names(&fd) {
                    stack.push(Level {
                        fd,
                        path: child_path,
                        names,
                        level,
                    });
                }
            }
        }
    }
    Ok(())
}
