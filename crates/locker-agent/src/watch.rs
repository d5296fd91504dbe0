//! Watching a directory with inotify (`Request::Watch`): the host's E2B layer serves envd's
//! `WatchDir` and watchers with it.
//!
//! The directory (and, recursive, each directory under it, and each one created later) is
//! opened inside the agent's root like every other file operation, and watched through its
//! descriptor (`/proc/self/fd/N`), so no path or symlink reaches outside the root. Events go
//! to the host as JSON lines of [`FsEvent`] batches on `Chan::Stdout`, under the stream's
//! credit: a host that stops reading stops the agent, and the kernel's bounded queue
//! overflows (reported as one event named `""`) instead of anything growing here. At most
//! [`MAX_DIRS`] directories are watched per request. The watch ends when the host cancels
//! the stream or the watched directory goes.

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use locker_proto::{AgentError, Chan, EndBody, ErrorCode, FsEvent, FsOp, Reply};

use crate::conn::Stream;
use crate::files::{open_dir, os_err, CleanPath};
use crate::Agent;

/// The most directories one recursive watch follows.
pub const MAX_DIRS: usize = 4096;
/// The most events sent in one batch.
const MAX_BATCH: usize = 256;

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_DELETE_SELF
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_MOVE_SELF
    | libc::IN_ATTRIB
    | libc::IN_ONLYDIR;

struct Watch {
    fd: OwnedFd,
    /// Watch descriptor -> (the directory's fd, its path relative to the watched one).
    dirs: HashMap<i32, (OwnedFd, String)>,
    recursive: bool,
}

impl Watch {
    /// Watches the directory `dir` (relative path `rel`) and, if recursive, those under it.
    fn add(&mut self, dir: OwnedFd, rel: String) -> io::Result<()> {
        if self.dirs.len() >= MAX_DIRS {
            return Ok(());
        }
        let path =
            CString::new(format!("/proc/self/fd/{}", dir.as_raw_fd())).expect("no NUL in a number");
        // SAFETY: a valid inotify fd and a NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), path.as_ptr(), MASK) };
        if wd < 0 {
            return Err(io::Error::last_os_error());
        }
        let children = if self.recursive {
            subdirs(dir.as_raw_fd())
        } else {
            Vec::new()
        };
        self.dirs.insert(wd, (dir, rel.clone()));
        for (name, fd) in children {
            let child = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let _ = self.add(fd, child);
        }
        Ok(())
    }
}

/// The subdirectories of `dir` (not following links), opened.
fn subdirs(dir: RawFd) -> Vec<(String, OwnedFd)> {
    let mut out = Vec::new();
    // SAFETY: dup of a valid fd; fdopendir takes ownership of the duplicate.
    let dup = unsafe { libc::dup(dir) };
    if dup < 0 {
        return out;
    }
    // SAFETY: `dup` is a directory fd we own.
    let d = unsafe { libc::fdopendir(dup) };
    if d.is_null() {
        // SAFETY: still ours.
        unsafe { libc::close(dup) };
        return out;
    }
    loop {
        // SAFETY: `d` is an open DIR stream.
        let ent = unsafe { libc::readdir(d) };
        if ent.is_null() {
            break;
        }
        // SAFETY: readdir returned a valid entry with a NUL-terminated name.
        let (name, kind) = unsafe {
            (
                std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()).to_owned(),
                (*ent).d_type,
            )
        };
        let bytes = name.as_bytes();
        if bytes == b"." || bytes == b".." || (kind != libc::DT_DIR && kind != libc::DT_UNKNOWN) {
            continue;
        }
        if let Some(fd) = open_child_dir(dir, &name) {
            out.push((String::from_utf8_lossy(bytes).into_owned(), fd));
        }
    }
    // SAFETY: closes the stream and its fd.
    unsafe { libc::closedir(d) };
    out
}

fn open_child_dir(dir: RawFd, name: &std::ffi::CStr) -> Option<OwnedFd> {
    // SAFETY: a valid dir fd and a NUL-terminated name; O_NOFOLLOW keeps links out.
    let fd = unsafe {
        libc::openat(
            dir,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    // SAFETY: a fresh fd we own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Serves `Request::Watch`: `Msg(Entry)` of the directory once it is watched, then event
/// batches as JSON lines on `Chan::Stdout` until cancelled; `End(Ok)` when the directory
/// goes.
pub fn watch(agent: &Agent, s: &Stream, path: &str, recursive: bool) {
    let p = match CleanPath::parse(path) {
        Ok(p) => p,
        Err(e) => return s.fail(e),
    };
    let shown = p.display();
    let dir = match open_dir(agent, &p.comps) {
        Ok(d) => d,
        Err(e) => return s.fail(os_err("watch", &shown, e)),
    };
    // SAFETY: plain syscall.
    let ifd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if ifd < 0 {
        return s.fail(AgentError::new(
            ErrorCode::Busy,
            format!("watch {shown}: inotify: {}", io::Error::last_os_error()),
        ));
    }
    let mut w = Watch {
        // SAFETY: a fresh fd we own.
        fd: unsafe { OwnedFd::from_raw_fd(ifd) },
        dirs: HashMap::new(),
        recursive,
    };
    if let Err(e) = w.add(dir, String::new()) {
        return s.fail(os_err("watch", &shown, e));
    }
    let st = match crate::sys::fstat(w.dirs.values().next().expect("added").0.as_raw_fd()) {
        Ok(st) => st,
        Err(e) => return s.fail(os_err("watch", &shown, e)),
    };
    let name = p.comps.last().cloned().unwrap_or_else(|| "/".into());
    if s.msg(Reply::Entry(crate::files::entry(shown.clone(), name, &st)))
        .is_err()
    {
        return;
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if s.is_cancelled() {
            return;
        }
        let mut pfd = libc::pollfd {
            fd: w.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, 200) };
        if r <= 0 {
            continue;
        }
        // SAFETY: reading into our buffer.
        let n = unsafe { libc::read(w.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            continue;
        }
        let (events, gone) = decode(&mut w, &buf[..n as usize]);
        for chunk in events.chunks(MAX_BATCH) {
            let mut line = serde_json::to_vec(chunk).expect("events serialize");
            line.push(b'\n');
            if s.data(Chan::Stdout, &line).is_err() {
                return;
            }
        }
        if gone {
            return s.end(EndBody::Ok);
        }
    }
}

/// Turns a buffer of inotify records into events (and adds watches on new directories);
/// true when the watched directory itself is gone.
fn decode(w: &mut Watch, mut b: &[u8]) -> (Vec<FsEvent>, bool) {
    const HDR: usize = std::mem::size_of::<libc::inotify_event>();
    let mut out = Vec::new();
    let mut gone = false;
    while b.len() >= HDR {
        // SAFETY: at least HDR bytes; read_unaligned copes with any alignment.
        let ev: libc::inotify_event = unsafe { std::ptr::read_unaligned(b.as_ptr().cast()) };
        let len = ev.len as usize;
        if b.len() < HDR + len {
            break;
        }
        let raw = &b[HDR..HDR + len];
        let name =
            String::from_utf8_lossy(raw.split(|&c| c == 0).next().unwrap_or(&[])).into_owned();
        b = &b[HDR + len..];
        if ev.mask & libc::IN_Q_OVERFLOW != 0 {
            out.push(FsEvent {
                name: String::new(),
                op: FsOp::Write,
            });
            continue;
        }
        if ev.mask & libc::IN_IGNORED != 0 {
            if let Some((_, rel)) = w.dirs.remove(&ev.wd) {
                if rel.is_empty() {
                    gone = true;
                }
            }
            continue;
        }
        let Some((dirfd, rel)) = w.dirs.get(&ev.wd) else {
            continue;
        };
        if name.is_empty() {
            // An event on a watched directory itself: its removal shows in its parent.
            if ev.mask & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF) != 0 && rel.is_empty() {
                gone = true;
            }
            continue;
        }
        let full = if rel.is_empty() {
            name.clone()
        } else {
            format!("{rel}/{name}")
        };
        let op = if ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
            FsOp::Create
        } else if ev.mask & libc::IN_MODIFY != 0 {
            FsOp::Write
        } else if ev.mask & libc::IN_DELETE != 0 {
            FsOp::Remove
        } else if ev.mask & libc::IN_MOVED_FROM != 0 {
            FsOp::Rename
        } else if ev.mask & libc::IN_ATTRIB != 0 {
            FsOp::Chmod
        } else {
            continue;
        };
        // A new directory under a recursive watch is watched too.
        if w.recursive && op == FsOp::Create && ev.mask & libc::IN_ISDIR != 0 {
            let parent = dirfd.as_raw_fd();
            if let Ok(c) = CString::new(name.as_bytes()) {
                if let Some(fd) = open_child_dir(parent, &c) {
                    let _ = w.add(fd, full.clone());
                }
            }
        }
        out.push(FsEvent { name: full, op });
    }
    (out, gone)
}
