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
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use locker_proto::{AgentError, Chan, EndBody, ErrorCode, Reply, DATA_CHUNK, MAX_PAYLOAD};
use locker_types::{Entry, EntryType};

use crate::conn::{Inbound, Recv, Stream};
use crate::{sys, Agent};

/// A cleaned absolute path: its components, none of them empty, `.` or `..`.
struct CleanPath {
    comps: Vec<String>,
}

impl CleanPath {
    fn parse(path: &str) -> Result<CleanPath, AgentError> {
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

    fn display(&self) -> String {
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

fn bad(msg: impl Into<String>) -> AgentError {
    AgentError::new(ErrorCode::BadRequest, msg)
}

/// Maps an OS error of `what` on `path` onto the error classes the host understands.
fn os_err(what: &str, path: &str, e: io::Error) -> AgentError {
    let code = match e.raw_os_error().unwrap_or(0) {
        libc::ENOENT | libc::ENOTDIR => ErrorCode::NotFound,
        libc::EEXIST | libc::ENOTEMPTY | libc::EBUSY => ErrorCode::Conflict,
        libc::ENOSPC | libc::EDQUOT | libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EFBIG => {
            ErrorCode::Exhausted
        }
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

fn open_dir(agent: &Agent, comps: &[String]) -> io::Result<OwnedFd> {
    open(agent, comps, libc::O_RDONLY | libc::O_DIRECTORY)
}

fn kind_of(mode: u32) -> EntryType {
    match mode & libc::S_IFMT {
        libc::S_IFREG => EntryType::File,
        libc::S_IFDIR => EntryType::Dir,
        libc::S_IFLNK => EntryType::Symlink,
        _ => EntryType::Other,
    }
}

fn entry(path: String, name: String, st: &libc::stat) -> Entry {
    Entry {
        path,
        name,
        kind: kind_of(st.st_mode),
        size: st.st_size.max(0) as u64,
        mode: st.st_mode & 0o7777,
        mtime: locker_types::rfc3339(st.st_mtime),
    }
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
    Ok(entry(
        path,
        p.comps.last().cloned().unwrap_or_default(),
        &st,
    ))
}

/// Creates `comps` and its missing parents; returns the directory opened.
fn mkdir_p(agent: &Agent, comps: &[String], display: &str) -> Result<OwnedFd, AgentError> {
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

fn read_file_inner(agent: &Agent, s: &Stream, path: &str) -> Result<(), AgentError> {
    let p = CleanPath::parse(path)?;
    let shown = p.display();
    // O_NONBLOCK: opening a FIFO must not hang; it is refused below anyway.
    let fd = open(agent, &p.comps, libc::O_RDONLY | libc::O_NONBLOCK)
        .map_err(|e| os_err("read", &shown, e))?;
    let st = sys::fstat(fd.as_raw_fd()).map_err(|e| os_err("read", &shown, e))?;
    match kind_of(st.st_mode) {
        EntryType::File => {}
        EntryType::Dir => return Err(bad(format!("read {shown}: is a directory"))),
        _ => return Err(bad(format!("read {shown}: not a regular file"))),
    }
    let name = p.comps.last().cloned().unwrap_or_else(|| "/".into());
    if s.msg(Reply::Entry(entry(shown.clone(), name, &st)))
        .is_err()
    {
        return Ok(());
    }
    let mut f = File::from(fd);
    let mut buf = vec![0u8; DATA_CHUNK];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(os_err("read", &shown, e)),
        };
        if s.data(Chan::Bytes, &buf[..n]).is_err() {
            return Ok(());
        }
    }
    s.end(EndBody::Ok);
    Ok(())
}

/// Serves `Request::WriteFile`.
pub fn write_file(agent: &Agent, s: &Stream, path: &str, mode: Option<u32>) {
    match write_file_inner(agent, s, path, mode) {
        Ok(Some(e)) => s.end(EndBody::Entry(e)),
        Ok(None) => {}
        Err(e) => s.fail(e),
    }
}

/// Removes a temporary file when dropped, unless disarmed.
struct TempGuard {
    dir: RawFd,
    name: Option<CString>,
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
) -> Result<Option<Entry>, AgentError> {
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
    sys::fsync(f.as_raw_fd()).map_err(|e| os_err("write", &shown, e))?;
    drop(f);
    sys::renameat(dir.as_raw_fd(), &tmp, dir.as_raw_fd(), &name)
        .map_err(|e| os_err("write", &shown, e))?;
    guard.name = None;
    let _ = sys::fsync(dir.as_raw_fd());
    let st = sys::lstatat(dir.as_raw_fd(), &name).map_err(|e| os_err("write", &shown, e))?;
    Ok(Some(entry(
        shown,
        p.comps.last().cloned().unwrap_or_default(),
        &st,
    )))
}

/// Serves `Request::Stat`.
pub fn stat(agent: &Agent, s: &Stream, path: &str) {
    match CleanPath::parse(path).and_then(|p| lstat_entry(agent, &p)) {
        Ok(e) => s.end(EndBody::Entry(e)),
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
                    "remove {shown}: the directory is not empty (pass recursive to remove it all)"
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

fn sorted_names(fd: &OwnedFd) -> io::Result<Vec<CString>> {
    let mut names = sys::read_dir_names(fd.try_clone()?)?;
    // Descending, so popping yields ascending order.
    names.sort_by(|a, b| b.as_bytes().cmp(a.as_bytes()));
    Ok(names)
}

fn open_child_dir(dir: RawFd, name: &CString) -> io::Result<OwnedFd> {
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

fn list_inner(agent: &Agent, s: &Stream, path: &str, depth: u32) -> Result<(), AgentError> {
    struct Level {
        fd: OwnedFd,
        path: String,
        names: Vec<CString>,
        level: u32,
    }
    let p = CleanPath::parse(path)?;
    let shown = p.display();
    let probe = open(agent, &p.comps, libc::O_PATH).map_err(|e| os_err("list", &shown, e))?;
    let st = sys::fstat(probe.as_raw_fd()).map_err(|e| os_err("list", &shown, e))?;
    if kind_of(st.st_mode) != EntryType::Dir {
        return Err(bad(format!("list {shown}: not a directory")));
    }
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
    let mut batch: Vec<Entry> = Vec::new();
    let mut size = 0usize;
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
        let e = entry(child_path.clone(), shown_name, &st);
        let n = serde_json::to_vec(&e).map(|v| v.len()).unwrap_or(0) + 1;
        if size + n > MAX_PAYLOAD / 2 {
            if s.msg(Reply::Entries {
                entries: std::mem::take(&mut batch),
            })
            .is_err()
            {
                return Ok(());
            }
            size = 0;
        }
        size += n;
        batch.push(e);
        if kind_of(st.st_mode) == EntryType::Dir && top.level < depth {
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
    s.end(EndBody::Entries(batch));
    Ok(())
}
