//! Directories as tar archives for the files API: `ReadTar` streams a directory's tree as
//! an archive, `WriteTar` extracts an archive into a directory. Both stream: nothing holds
//! more than a frame of the archive at a time.
//!
//! The directory itself is found as every files-API path is (inside the agent's root; see
//! `files`). Below it, every entry of an extraction is resolved from the directory's fd with
//! `openat2(RESOLVE_BENEATH)`: a path whose `..` or symlinks (the archive's own included:
//! `a -> /etc`, then `a/passwd`) would lead out of the directory is refused, never followed.
//! Final names are created with the `*at` calls on their parent's fd and never followed
//! either: a file or symlink is made under a temporary name and renamed over the old one.
//! What an archive may hold: regular files (mode, mtime kept), directories, symlinks and
//! hardlinks to entries inside the directory; absolute paths, `..`, device nodes, FIFOs and
//! anything else are refused with the entry's name. Must not touch anything outside the
//! target directory.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use locker_proto::tar_guard::TarGuard;
use locker_proto::{AgentError, Chan, EndBody, Reply, DATA_CHUNK};
use locker_types::EntryType;

use crate::conn::{Inbound, Recv, Stream};
use crate::files::{bad, entry, kind_of, mkdir_p, open_dir, os_err, sorted_names, CleanPath};
use crate::files::{open_child_dir, TempGuard, PSEUDO_FS};
use crate::{sys, Agent};

/// Directories whose mode and mtime are set at the end of an extraction (after their
/// children were written); past this many, a directory's mode is set at once and its mtime
/// left as the extraction made it.
const MAX_DEFERRED_DIRS: usize = 1 << 16;

/// Serves `Request::ReadTar`.
pub fn read_tar(agent: &Agent, s: &Stream, path: &str) {
    if let Err(e) = read_tar_inner(agent, s, path) {
        s.fail(e);
    }
}

/// The archive's bytes on their way to the host, cut into frames.
struct Sender<'a> {
    s: &'a Stream,
    buf: Vec<u8>,
    gone: bool,
}

impl Sender<'_> {
    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        if self.s.data(Chan::Bytes, &self.buf).is_err() {
            self.gone = true;
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the host went away",
            ));
        }
        self.buf.clear();
        Ok(())
    }
}

impl Write for Sender<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= DATA_CHUNK {
            self.send()?;
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

/// A file's bytes as its header announced them: a file that shrank while it was read is
/// padded with zeros, one that grew is cut, so the archive stays well formed.
struct Exactly<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exactly<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = buf.len().min(self.left.min(usize::MAX as u64) as usize);
        if want == 0 {
            return Ok(0);
        }
        let n = match self.inner.read(&mut buf[..want])? {
            0 => {
                buf[..want].fill(0);
                want
            }
            n => n,
        };
        self.left -= n as u64;
        Ok(n)
    }
}

fn header(kind: tar::EntryType, st: &libc::stat, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(st.st_mode & 0o7777);
    h.set_mtime(st.st_mtime.max(0) as u64);
    h.set_uid(u64::from(st.st_uid));
    h.set_gid(u64::from(st.st_gid));
    h
}

fn read_tar_inner(agent: &Agent, s: &Stream, path: &str) -> Result<(), AgentError> {
    let p = CleanPath::parse(path)?;
    let shown = p.display();
    let root = open_dir(agent, &p.comps).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOTDIR) => bad(format!(
            "{shown} is not a directory: download a file without the tar format"
        )),
        _ => os_err("read", &shown, e),
    })?;
    let st = sys::fstat(root.as_raw_fd()).map_err(|e| os_err("read", &shown, e))?;
    let name = p.comps.last().cloned().unwrap_or_else(|| "/".into());
    if s.msg(Reply::Entry(entry(shown.clone(), name, &st)))
        .is_err()
    {
        return Ok(());
    }
    let mut b = tar::Builder::new(Sender {
        s,
        buf: Vec::with_capacity(DATA_CHUNK * 2),
        gone: false,
    });
    let r = archive_tree(&mut b, root).and_then(|()| b.finish());
    let sender = b.get_mut();
    if sender.gone {
        return Ok(());
    }
    r.and_then(|()| sender.flush())
        .map_err(|e| os_err("read", &shown, e))?;
    s.end(EndBody::Ok);
    Ok(())
}

/// Whether `fd` is on a filesystem whose files the kernel makes up (procfs, sysfs...):
/// their sizes mean nothing (`/proc/kcore`) and some never end, so they are left out.
fn pseudo(fd: &OwnedFd) -> bool {
    sys::fs_type(fd.as_raw_fd()).is_ok_and(|t| PSEUDO_FS.contains(&t))
}

/// Appends everything under `root` to `b`, depth first, each directory's entries sorted
/// by name, never following a symlink. Sockets, FIFOs, devices and whatever is on a pseudo
/// filesystem (a `/proc` below the directory) are left out; an entry that vanishes while
/// it is read is skipped.
fn archive_tree(b: &mut tar::Builder<Sender<'_>>, root: OwnedFd) -> io::Result<()> {
    struct Level {
        fd: OwnedFd,
        prefix: Vec<u8>,
        names: Vec<CString>,
    }
    if pseudo(&root) {
        return Ok(());
    }
    let names = sorted_names(&root)?;
    let mut stack = vec![Level {
        fd: root,
        prefix: Vec::new(),
        names,
    }];
    while let Some(top) = stack.last_mut() {
        let Some(name) = top.names.pop() else {
            stack.pop();
            continue;
        };
        let dir = top.fd.as_raw_fd();
        let st = match sys::lstatat(dir, &name) {
            Ok(st) => st,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => return Err(e),
        };
        let mut rel = top.prefix.clone();
        rel.extend_from_slice(name.as_bytes());
        match kind_of(st.st_mode) {
            EntryType::Dir => {
                let fd = match open_child_dir(dir, &name) {
                    Ok(fd) => fd,
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                    Err(e) => return Err(e),
                };
                if pseudo(&fd) {
                    continue;
                }
                rel.push(b'/');
                let mut h = header(tar::EntryType::Directory, &st, 0);
                b.append_data(&mut h, Path::new(OsStr::from_bytes(&rel)), io::empty())?;
                let names = sorted_names(&fd)?;
                stack.push(Level {
                    fd,
                    prefix: rel,
                    names,
                });
            }
            EntryType::File => {
                let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
                let fd = match sys::openat(dir, &name, flags, 0) {
                    Ok(fd) => fd,
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                    Err(e) => return Err(e),
                };
                let st = sys::fstat(fd.as_raw_fd())?;
                if kind_of(st.st_mode) != EntryType::File {
                    continue;
                }
                let size = st.st_size.max(0) as u64;
                let mut h = header(tar::EntryType::Regular, &st, size);
                let data = Exactly {
                    inner: File::from(fd),
                    left: size,
                };
                b.append_data(&mut h, Path::new(OsStr::from_bytes(&rel)), data)?;
            }
            EntryType::Symlink => {
                let target = match sys::readlinkat(dir, &name) {
                    Ok(t) => t,
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                    Err(e) => return Err(e),
                };
                let mut h = header(tar::EntryType::Symlink, &st, 0);
                b.append_link(
                    &mut h,
                    Path::new(OsStr::from_bytes(&rel)),
                    Path::new(OsStr::from_bytes(&target)),
                )?;
            }
            EntryType::Other => {}
        }
    }
    Ok(())
}

/// Serves `Request::WriteTar`.
pub fn write_tar(agent: &Agent, s: &Stream, path: &str) {
    match write_tar_inner(agent, s, path) {
        Ok(Some(body)) => s.end(body),
        Ok(None) => {}
        Err(e) => s.fail(e),
    }
}

/// The archive's bytes as the host sends them.
struct Receiver<'a> {
    s: &'a Stream,
    cur: Vec<u8>,
    pos: usize,
    eof: bool,
    gone: bool,
}

impl Read for Receiver<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.pos < self.cur.len() {
                let n = buf.len().min(self.cur.len() - self.pos);
                buf[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
                self.pos += n;
                return Ok(n);
            }
            if self.eof {
                return Ok(0);
            }
            match self.s.recv(None) {
                Recv::Item(Inbound::Data(chan, bytes)) => {
                    self.s.credit(chan, bytes.len());
                    if chan == Chan::Bytes {
                        self.cur = bytes;
                        self.pos = 0;
                    }
                }
                Recv::Item(Inbound::Eof(Chan::Bytes)) => self.eof = true,
                Recv::Item(_) | Recv::Timeout => {}
                Recv::Gone => {
                    self.gone = true;
                    return Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "the host went away",
                    ));
                }
            }
        }
    }
}

fn write_tar_inner(agent: &Agent, s: &Stream, path: &str) -> Result<Option<EndBody>, AgentError> {
    let p = CleanPath::parse(path)?;
    let shown = p.display();
    let dir = mkdir_p(agent, &p.comps, &shown)?;
    let mut rx = Receiver {
        s,
        cur: Vec::new(),
        pos: 0,
        eof: false,
        gone: false,
    };
    let mut ex = Extractor {
        root: dir,
        shown: shown.clone(),
        entries: 0,
        bytes: 0,
        dirs: Vec::new(),
    };
    let r = ex.run(&mut tar::Archive::new(TarGuard::new(&mut rx)));
    if rx.gone {
        return Ok(None);
    }
    r?;
    // What follows the archive's end (a tar's padding to its record size) is read and
    // dropped, so the host's upload ends cleanly.
    if io::copy(&mut rx, &mut io::sink()).is_err() && rx.gone {
        return Ok(None);
    }
    ex.finish();
    let st = sys::fstat(ex.root.as_raw_fd()).map_err(|e| os_err("write", &shown, e))?;
    let name = p.comps.last().cloned().unwrap_or_else(|| "/".into());
    Ok(Some(EndBody::Extracted {
        entry: entry(shown, name, &st),
        entries: ex.entries,
        bytes: ex.bytes,
    }))
}

/// One extraction into the directory `root`.
struct Extractor {
    root: OwnedFd,
    shown: String,
    entries: u64,
    bytes: u64,
    /// Directories made or met, with the mode and mtime to give them at the end.
    dirs: Vec<(CString, u32, i64)>,
}

/// An archive path's components: relative, no `..`.
fn components(raw: &[u8]) -> Result<Vec<CString>, &'static str> {
    if raw.first() == Some(&b'/') {
        return Err("absolute paths are refused (archive paths relative to the directory)");
    }
    let mut comps = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("`..` components are refused"),
            c => comps.push(CString::new(c).map_err(|_| "the path holds a NUL byte")?),
        }
    }
    Ok(comps)
}

fn joined(comps: &[CString]) -> CString {
    if comps.is_empty() {
        return CString::from(c".");
    }
    let v: Vec<&[u8]> = comps.iter().map(|c| c.as_bytes()).collect();
    // Components hold no NUL (checked in `components`).
    CString::new(v.join(&b'/')).unwrap_or_default()
}

fn temp_name(name: &CString) -> CString {
    let base: String = String::from_utf8_lossy(name.as_bytes())
        .chars()
        .take(64)
        .collect();
    CString::new(format!(".{base}.{}.locker-tmp", crate::random_id("")))
        .unwrap_or_else(|_| CString::from(c".locker-tmp"))
}

impl Extractor {
    fn run<R: Read>(&mut self, archive: &mut tar::Archive<R>) -> Result<(), AgentError> {
        let entries = archive.entries().map_err(|e| self.malformed(e))?;
        for item in entries {
            let mut e = item.map_err(|e| self.malformed(e))?;
            let raw = e.path_bytes().into_owned();
            let what = format!("entry {:?}", String::from_utf8_lossy(&raw));
            let kind = e.header().entry_type();
            if kind == tar::EntryType::XGlobalHeader {
                continue;
            }
            let comps = components(&raw).map_err(|why| bad(format!("{what}: {why}")))?;
            let Some((name, parents)) = comps.split_last() else {
                if kind == tar::EntryType::Directory {
                    continue; // `./`: the directory itself
                }
                return Err(bad(format!("{what}: names the directory itself")));
            };
            let mode = e.header().mode().unwrap_or(0o644) & 0o7777;
            let mtime = e.header().mtime().unwrap_or(0).min(i64::MAX as u64) as i64;
            match kind {
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    let dir = self.parent(parents, &what)?;
                    self.file(&dir, name, &mut e, mode, mtime, &what)?;
                }
                tar::EntryType::Directory => {
                    let dir = self.parent(parents, &what)?;
                    self.dir(&dir, name, &comps, mode, mtime, &what)?;
                }
                tar::EntryType::Symlink => {
                    let target = e
                        .link_name_bytes()
                        .ok_or_else(|| bad(format!("{what}: a symlink without a target")))?;
                    let target = CString::new(target.into_owned())
                        .map_err(|_| bad(format!("{what}: the link target holds a NUL byte")))?;
                    let dir = self.parent(parents, &what)?;
                    self.replace(&dir, name, &what, |tmp| {
                        sys::symlinkat(&target, dir.as_raw_fd(), tmp)
                    })?;
                }
                tar::EntryType::Link => {
                    let target = e
                        .link_name_bytes()
                        .ok_or_else(|| bad(format!("{what}: a hardlink without a target")))?;
                    self.hardlink(parents, name, &target, &what)?;
                }
                tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                    return Err(bad(format!(
                        "{what}: device nodes and FIFOs are refused (only files, directories, \
                         symlinks and hardlinks can be extracted)"
                    )))
                }
                other => {
                    return Err(bad(format!(
                        "{what}: entries of type {:?} are refused (only files, directories, \
                         symlinks and hardlinks can be extracted)",
                        other.as_byte() as char
                    )))
                }
            }
            self.entries += 1;
        }
        Ok(())
    }

    fn malformed(&self, e: io::Error) -> AgentError {
        bad(format!("malformed tar after {} entries: {e}", self.entries))
    }

    /// Opens `path` (relative) under the root, refusing a way out.
    fn open(&self, path: &[CString], flags: i32, what: &str) -> Result<OwnedFd, AgentError> {
        sys::open_beneath(self.root.as_raw_fd(), &joined(path), flags)
            .map_err(|e| self.resolve_err(e, what))
    }

    fn resolve_err(&self, e: io::Error, what: &str) -> AgentError {
        match e.raw_os_error() {
            Some(libc::EXDEV) => bad(format!(
                "{what}: its path leads out of {} (through a symlink); refused",
                self.shown
            )),
            Some(libc::ELOOP) => bad(format!("{what}: too many symlinks in its path")),
            Some(libc::ENOTDIR) => bad(format!("{what}: a parent is not a directory")),
            _ => os_err("extract", &format!("{} ({what})", self.shown), e),
        }
    }

    /// The parent directory `comps` of an entry, made (with its missing parents) if absent.
    fn parent(&self, comps: &[CString], what: &str) -> Result<OwnedFd, AgentError> {
        let flags = libc::O_RDONLY | libc::O_DIRECTORY;
        match sys::open_beneath(self.root.as_raw_fd(), &joined(comps), flags) {
            Ok(fd) => return Ok(fd),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(self.resolve_err(e, what)),
        }
        let mut dir = self.open(&[], flags, what)?;
        for i in 0..comps.len() {
            match sys::mkdirat(dir.as_raw_fd(), &comps[i], 0o755) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(self.resolve_err(e, what)),
            }
            // From the root again: a symlinked component is followed only beneath it.
            dir = self.open(&comps[..=i], flags, what)?;
        }
        Ok(dir)
    }

    /// Makes `name` in `dir` with `make(temporary name)`, then renames it over whatever
    /// was there (never into a directory that is in the way).
    fn replace(
        &self,
        dir: &OwnedFd,
        name: &CString,
        what: &str,
        make: impl FnOnce(&CString) -> io::Result<()>,
    ) -> Result<(), AgentError> {
        if let Ok(st) = sys::lstatat(dir.as_raw_fd(), name) {
            if kind_of(st.st_mode) == EntryType::Dir {
                return Err(bad(format!("{what}: a directory is in the way")));
            }
        }
        let tmp = temp_name(name);
        make(&tmp).map_err(|e| self.resolve_err(e, what))?;
        let mut guard = TempGuard {
            dir: dir.as_raw_fd(),
            name: Some(tmp.clone()),
        };
        sys::renameat(dir.as_raw_fd(), &tmp, dir.as_raw_fd(), name)
            .map_err(|e| self.resolve_err(e, what))?;
        guard.name = None;
        Ok(())
    }

    fn file(
        &mut self,
        dir: &OwnedFd,
        name: &CString,
        data: &mut impl Read,
        mode: u32,
        mtime: i64,
        what: &str,
    ) -> Result<(), AgentError> {
        if let Ok(st) = sys::lstatat(dir.as_raw_fd(), name) {
            if kind_of(st.st_mode) == EntryType::Dir {
                return Err(bad(format!("{what}: a directory is in the way")));
            }
        }
        let tmp = temp_name(name);
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
        let fd = sys::openat(dir.as_raw_fd(), &tmp, flags, 0o600)
            .map_err(|e| self.resolve_err(e, what))?;
        let mut guard = TempGuard {
            dir: dir.as_raw_fd(),
            name: Some(tmp.clone()),
        };
        let mut f = File::from(fd);
        let mut buf = vec![0u8; DATA_CHUNK];
        loop {
            let n = match data.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.malformed(e)),
            };
            f.write_all(&buf[..n])
                .map_err(|e| os_err("write", &format!("{} ({what})", self.shown), e))?;
            self.bytes += n as u64;
        }
        let fail = |e| os_err("write", &format!("{} ({what})", self.shown), e);
        sys::fchmod(f.as_raw_fd(), mode).map_err(fail)?;
        sys::set_mtime(f.as_raw_fd(), None, mtime).map_err(fail)?;
        drop(f);
        sys::renameat(dir.as_raw_fd(), &tmp, dir.as_raw_fd(), name).map_err(fail)?;
        guard.name = None;
        Ok(())
    }

    fn dir(
        &mut self,
        dir: &OwnedFd,
        name: &CString,
        comps: &[CString],
        mode: u32,
        mtime: i64,
        what: &str,
    ) -> Result<(), AgentError> {
        match sys::mkdirat(dir.as_raw_fd(), name, 0o755) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let st =
                    sys::lstatat(dir.as_raw_fd(), name).map_err(|e| self.resolve_err(e, what))?;
                if kind_of(st.st_mode) != EntryType::Dir {
                    // A file or symlink in the way is replaced, as tar does.
                    sys::unlinkat(dir.as_raw_fd(), name, false)
                        .and_then(|()| sys::mkdirat(dir.as_raw_fd(), name, 0o755))
                        .map_err(|e| self.resolve_err(e, what))?;
                }
            }
            Err(e) => return Err(self.resolve_err(e, what)),
        }
        if self.dirs.len() < MAX_DEFERRED_DIRS {
            self.dirs.push((joined(comps), mode, mtime));
        } else {
            let fd =
                open_child_dir(dir.as_raw_fd(), name).map_err(|e| self.resolve_err(e, what))?;
            sys::fchmod(fd.as_raw_fd(), mode).map_err(|e| self.resolve_err(e, what))?;
        }
        Ok(())
    }

    fn hardlink(
        &self,
        parents: &[CString],
        name: &CString,
        target: &[u8],
        what: &str,
    ) -> Result<(), AgentError> {
        let shown_target = String::from_utf8_lossy(target).into_owned();
        let tcomps = components(target)
            .map_err(|why| bad(format!("{what}: a hardlink to {shown_target:?}: {why}")))?;
        let Some((tname, tparents)) = tcomps.split_last() else {
            return Err(bad(format!("{what}: a hardlink to the directory itself")));
        };
        let flags = libc::O_RDONLY | libc::O_DIRECTORY;
        let tdir = self.open(tparents, flags, what)?;
        match sys::lstatat(tdir.as_raw_fd(), tname) {
            Ok(st) if kind_of(st.st_mode) == EntryType::Dir => {
                return Err(bad(format!(
                    "{what}: a hardlink to {shown_target:?}, a directory"
                )))
            }
            Ok(_) => {}
            Err(_) => {
                return Err(bad(format!(
                    "{what}: a hardlink to {shown_target:?}, which is not in {} (hardlinks must \
                     point at an entry extracted before them)",
                    self.shown
                )))
            }
        }
        let dir = self.parent(parents, what)?;
        self.replace(&dir, name, what, |tmp| {
            sys::linkat(tdir.as_raw_fd(), tname, dir.as_raw_fd(), tmp)
        })
    }

    /// Gives the directories their modes and mtimes (now that their children are written)
    /// and flushes the filesystem, so what was answered is on disk.
    fn finish(&mut self) {
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
        for (path, mode, mtime) in self.dirs.drain(..).rev() {
            if let Ok(fd) = sys::open_beneath(self.root.as_raw_fd(), &path, flags) {
                let _ = sys::fchmod(fd.as_raw_fd(), mode);
                let _ = sys::set_mtime(fd.as_raw_fd(), None, mtime);
            }
        }
        let _ = sys::syncfs(self.root.as_raw_fd());
    }
}

#[cfg(test)]
mod tests {
    use super::components;

    #[test]
    fn archive_paths_stay_relative() {
        assert_eq!(components(b"./a//b/./c").unwrap().len(), 3);
        assert!(components(b"/etc/passwd").is_err());
        assert!(components(b"a/../../x").is_err());
        assert!(components(b"..").is_err());
        assert!(components(b"./").unwrap().is_empty());
    }
}
