//! `files put -r` and `files get -r`: a local directory tree to and from a directory in the
//! sandbox (or volume), as a tar archive streamed through the files API's tar mode. The
//! archive is built and extracted on the fly: never a temporary file of the tree, never
//! the whole archive in memory.
//!
//! Extraction here is as careful as the agent's: archive paths must be relative without
//! `..`; no entry is written through a symlink or a non-directory (a path component that is
//! not a real directory is refused); symlinks are created, never followed; a file appears
//! under its name only once complete (a temporary name, then a rename). It must not write
//! anything outside the local directory it was given.

use std::ffi::OsStr;
use std::fs::{self, File, FileTimes};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use locker_proto::tar_guard::TarGuard;
use serde_json::{json, Value};

use super::super::{Client, ClientError};

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ClientError {
    let what = what.into();
    move |e| ClientError::io(what, e)
}

fn header(kind: tar::EntryType, m: &fs::Metadata, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(m.mode() & 0o7777);
    h.set_mtime(m.mtime().max(0) as u64);
    h
}

/// The tree under a local directory as a tar archive, made as it is read: regular files,
/// directories and symlinks (as links), depth first, names sorted; sockets, FIFOs and
/// devices are left out with a note on stderr. It holds one header and one read's worth of
/// a file at a time; a local failure ends the read with an error and is kept in `failed`.
struct TreeReader {
    root: PathBuf,
    /// Directory entries left to visit, per level, in descending order (popped ascending).
    stack: Vec<Vec<PathBuf>>,
    /// Makes the header records (GNU long names included) into its buffer.
    headers: tar::Builder<Vec<u8>>,
    /// Bytes made and not yet read, from `pos`.
    buf: Vec<u8>,
    pos: usize,
    /// The file being sent: its reader and the bytes left of its announced size.
    file: Option<(File, u64)>,
    /// Zeros owed after the current file's data (padding to 512).
    pad: usize,
    done: bool,
    failed: Option<ClientError>,
}

fn sorted(dir: &Path) -> Result<Vec<PathBuf>, ClientError> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io_err(format!("cannot read {}", dir.display())))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(io_err(format!("cannot read {}", dir.display())))?;
    v.sort_by(|a, b| b.as_os_str().as_bytes().cmp(a.as_os_str().as_bytes()));
    Ok(v)
}

impl TreeReader {
    fn new(root: &Path) -> Result<TreeReader, ClientError> {
        Ok(TreeReader {
            root: root.to_path_buf(),
            stack: vec![sorted(root)?],
            headers: tar::Builder::new(Vec::new()),
            buf: Vec::new(),
            pos: 0,
            file: None,
            pad: 0,
            done: false,
            failed: None,
        })
    }

    /// Appends the header of `rel` (and, for a file, no data: that is streamed after it).
    fn header(&mut self, h: &mut tar::Header, rel: &Path, link: Option<&Path>) -> io::Result<()> {
        match link {
            Some(t) => self.headers.append_link(h, rel, t)?,
            None => self.headers.append_data(h, rel, io::empty())?,
        }
        self.buf = std::mem::take(self.headers.get_mut());
        self.pos = 0;
        Ok(())
    }

    /// Makes the next entry's header (and opens its file); false at the end of the tree.
    fn next_entry(&mut self) -> Result<bool, ClientError> {
        loop {
            let Some(top) = self.stack.last_mut() else {
                return Ok(false);
            };
            let Some(p) = top.pop() else {
                self.stack.pop();
                continue;
            };
            let rel = p.strip_prefix(&self.root).unwrap_or(&p).to_path_buf();
            let shown = p.display().to_string();
            let m = fs::symlink_metadata(&p).map_err(io_err(format!("cannot read {shown}")))?;
            let ft = m.file_type();
            let w = io_err(format!("cannot send {shown}"));
            if ft.is_dir() {
                let mut h = header(tar::EntryType::Directory, &m, 0);
                self.header(&mut h, &rel, None).map_err(w)?;
                self.stack.push(sorted(&p)?);
            } else if ft.is_file() {
                let f = fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&p)
                    .map_err(io_err(format!("cannot open {shown}")))?;
                let m = f
                    .metadata()
                    .map_err(io_err(format!("cannot read {shown}")))?;
                let mut h = header(tar::EntryType::Regular, &m, m.len());
                self.header(&mut h, &rel, None).map_err(w)?;
                self.pad = ((512 - m.len() % 512) % 512) as usize;
                self.file = Some((f, m.len()));
            } else if ft.is_symlink() {
                let target = fs::read_link(&p).map_err(io_err(format!("cannot read {shown}")))?;
                let mut h = header(tar::EntryType::Symlink, &m, 0);
                self.header(&mut h, &rel, Some(&target)).map_err(w)?;
            } else {
                eprintln!("locker: left out {shown}: not a file, directory or symlink");
                continue;
            }
            return Ok(true);
        }
    }

    fn fill(&mut self, out: &mut [u8]) -> Result<usize, ClientError> {
        loop {
            if self.pos < self.buf.len() {
                let n = out.len().min(self.buf.len() - self.pos);
                out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
                self.pos += n;
                return Ok(n);
            }
            if let Some((f, left)) = &mut self.file {
                if *left > 0 {
                    let want = out.len().min((*left).min(usize::MAX as u64) as usize);
                    let n = match f.read(&mut out[..want]) {
                        // A file that shrank while it is sent is padded to the size its
                        // header announced, one that grew is cut: the archive stays whole.
                        Ok(0) => {
                            out[..want].fill(0);
                            want
                        }
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(ClientError::io("cannot read a file to send", e)),
                    };
                    *left -= n as u64;
                    return Ok(n);
                }
                self.file = None;
                self.buf = vec![0u8; self.pad];
                self.pos = 0;
                continue;
            }
            if self.done {
                return Ok(0);
            }
            if !self.next_entry()? {
                self.done = true;
                self.headers
                    .finish()
                    .map_err(io_err("cannot end the archive".to_string()))?;
                self.buf = std::mem::take(self.headers.get_mut());
                self.pos = 0;
            }
        }
    }
}

impl Read for TreeReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        self.fill(out).map_err(|e| {
            let io = io::Error::other(e.to_string());
            self.failed = Some(e);
            io
        })
    }
}

/// `files put -r LOCAL PATH`: the tree under the local directory `local` goes into the
/// directory `path` (created if missing). Returns the server's answer.
pub fn send_tree(
    c: &Client,
    url_path: &str,
    local: &Path,
    path: &str,
) -> Result<Value, ClientError> {
    let m = fs::metadata(local).map_err(io_err(format!("cannot read {}", local.display())))?;
    if !m.is_dir() {
        return Err(ClientError::Usage(format!(
            "{} is not a directory: `files put -r` sends a directory (leave out -r for a file)",
            local.display()
        )));
    }
    let mut r = TreeReader::new(local)?;
    let sent = c.put_body(
        url_path,
        &[("path", path.to_string()), ("format", "tar".to_string())],
        ureq::SendBody::from_reader(&mut r),
    );
    // A local failure explains a broken upload better than the server's answer to it.
    match r.failed.take() {
        Some(e) => Err(e),
        None => sent,
    }
}

/// `files get -r PATH LOCAL`: the tree under the directory `path` goes into the local
/// directory `local` (created if missing). Returns the entries and file bytes written.
pub fn fetch_tree(
    c: &Client,
    url_path: &str,
    path: &str,
    local: &Path,
) -> Result<Value, ClientError> {
    let r = c.get_stream(
        url_path,
        &[("path", path.to_string()), ("format", "tar".to_string())],
    )?;
    match fs::symlink_metadata(local) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(ClientError::Usage(format!(
                "{} is not a directory: `files get -r` writes into a directory",
                local.display()
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => fs::create_dir_all(local)
            .map_err(io_err(format!("cannot create {}", local.display())))?,
        Err(e) => {
            return Err(ClientError::io(
                format!("cannot read {}", local.display()),
                e,
            ))
        }
    }
    let mut ex = Extractor {
        root: local.to_path_buf(),
        entries: 0,
        bytes: 0,
        dirs: Vec::new(),
    };
    let r = ex.run(&mut tar::Archive::new(TarGuard::new(r)));
    ex.finish();
    r?;
    Ok(json!({ "path": local.display().to_string(), "entries": ex.entries, "bytes": ex.bytes }))
}

struct Extractor {
    root: PathBuf,
    entries: u64,
    bytes: u64,
    dirs: Vec<(PathBuf, u32, u64)>,
}

/// An archive path's components: relative, no `..`.
fn components(raw: &[u8]) -> Result<Vec<&OsStr>, &'static str> {
    if raw.first() == Some(&b'/') {
        return Err("an absolute path (refused)");
    }
    let mut v = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("a `..` component (refused)"),
            c => v.push(OsStr::from_bytes(c)),
        }
    }
    Ok(v)
}

fn temp_beside(p: &Path) -> PathBuf {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().chars().take(64).collect::<String>())
        .unwrap_or_default();
    p.with_file_name(format!(".{name}.{}.locker-part", std::process::id()))
}

fn mtime_of(secs: u64) -> FileTimes {
    FileTimes::new().set_modified(UNIX_EPOCH + Duration::from_secs(secs.min(i64::MAX as u64)))
}

impl Extractor {
    fn bad(&self, what: &str, why: impl std::fmt::Display) -> ClientError {
        ClientError::Protocol(format!("the archive's {what}: {why}"))
    }

    /// The local parent directory of `comps`, made if missing; every component must be a
    /// real directory (a symlink or file there is refused, never followed).
    fn parent(&self, comps: &[&OsStr], what: &str) -> Result<PathBuf, ClientError> {
        let mut p = self.root.clone();
        for c in comps {
            p.push(c);
            match fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(self.bad(
                        what,
                        format!(
                            "{} is not a directory (a symlink or file; refused)",
                            p.display()
                        ),
                    ))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fs::create_dir(&p).map_err(io_err(format!("cannot create {}", p.display())))?
                }
                Err(e) => return Err(ClientError::io(format!("cannot read {}", p.display()), e)),
            }
        }
        Ok(p)
    }

    fn not_a_dir(&self, p: &Path, what: &str) -> Result<(), ClientError> {
        match fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => Err(self.bad(what, format!("{} is a directory", p.display()))),
            _ => Ok(()),
        }
    }

    fn run<R: Read>(&mut self, a: &mut tar::Archive<R>) -> Result<(), ClientError> {
        let broken = |e: io::Error| ClientError::Io {
            what: "the download broke or is not a well-formed tar".into(),
            source: e,
        };
        for item in a.entries().map_err(broken)? {
            let mut e = item.map_err(broken)?;
            let raw = e.path_bytes().into_owned();
            let what = format!("entry {:?}", String::from_utf8_lossy(&raw));
            let kind = e.header().entry_type();
            if kind == tar::EntryType::XGlobalHeader {
                continue;
            }
            let comps = components(&raw).map_err(|why| self.bad(&what, why))?;
            let Some((name, parents)) = comps.split_last() else {
                continue;
            };
            let mode = e.header().mode().unwrap_or(0o644) & 0o777;
            let mtime = e.header().mtime().unwrap_or(0);
            let dir = self.parent(parents, &what)?;
            let dest = dir.join(name);
            match kind {
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    self.not_a_dir(&dest, &what)?;
                    let tmp = temp_beside(&dest);
                    let shown = dest.display().to_string();
                    let mut f = fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .custom_flags(libc::O_NOFOLLOW)
                        .open(&tmp)
                        .map_err(io_err(format!("cannot create {}", tmp.display())))?;
                    let copied = copy(&mut e, &mut f, &shown).and_then(|n| {
                        f.set_permissions(fs::Permissions::from_mode(mode))
                            .and_then(|()| f.set_times(mtime_of(mtime)))
                            .map_err(io_err(format!("cannot write {shown}")))?;
                        fs::rename(&tmp, &dest).map_err(io_err(format!("cannot write {shown}")))?;
                        Ok(n)
                    });
                    match copied {
                        Ok(n) => self.bytes += n,
                        Err(err) => {
                            let _ = fs::remove_file(&tmp);
                            return Err(err);
                        }
                    }
                }
                tar::EntryType::Directory => {
                    match fs::symlink_metadata(&dest) {
                        Ok(m) if m.is_dir() => {}
                        Ok(_) => {
                            fs::remove_file(&dest)
                                .map_err(io_err(format!("cannot replace {}", dest.display())))?;
                            fs::create_dir(&dest)
                                .map_err(io_err(format!("cannot create {}", dest.display())))?;
                        }
                        Err(_) => fs::create_dir(&dest)
                            .map_err(io_err(format!("cannot create {}", dest.display())))?,
                    }
                    self.dirs.push((dest, mode, mtime));
                }
                tar::EntryType::Symlink => {
                    let target = e
                        .link_name_bytes()
                        .ok_or_else(|| self.bad(&what, "a symlink without a target"))?
                        .into_owned();
                    self.not_a_dir(&dest, &what)?;
                    let tmp = temp_beside(&dest);
                    std::os::unix::fs::symlink(OsStr::from_bytes(&target), &tmp)
                        .and_then(|()| fs::rename(&tmp, &dest))
                        .map_err(io_err(format!("cannot create {}", dest.display())))?;
                }
                tar::EntryType::Link => {
                    let target = e
                        .link_name_bytes()
                        .ok_or_else(|| self.bad(&what, "a hardlink without a target"))?
                        .into_owned();
                    let t = components(&target).map_err(|why| self.bad(&what, why))?;
                    let Some((tname, tparents)) = t.split_last() else {
                        return Err(self.bad(&what, "a hardlink to the directory itself"));
                    };
                    let src = self.parent(tparents, &what)?.join(tname);
                    self.not_a_dir(&dest, &what)?;
                    let tmp = temp_beside(&dest);
                    fs::hard_link(&src, &tmp)
                        .and_then(|()| fs::rename(&tmp, &dest))
                        .map_err(io_err(format!("cannot link {}", dest.display())))?;
                }
                _ => {
                    return Err(self.bad(
                        &what,
                        "not a file, directory or link (device nodes and FIFOs are refused)",
                    ))
                }
            }
            self.entries += 1;
        }
        Ok(())
    }

    /// Gives directories their modes and mtimes once their children are written.
    fn finish(&mut self) {
        for (p, mode, mtime) in self.dirs.drain(..).rev() {
            let _ = fs::set_permissions(&p, fs::Permissions::from_mode(mode | 0o700));
            if let Ok(f) = File::open(&p) {
                let _ = f.set_times(mtime_of(mtime));
            }
            let _ = fs::set_permissions(&p, fs::Permissions::from_mode(mode));
        }
    }
}

fn copy(r: &mut impl Read, w: &mut File, shown: &str) -> Result<u64, ClientError> {
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(ClientError::Io {
                    what: format!("the download broke in {shown}"),
                    source: e,
                })
            }
        };
        w.write_all(&buf[..n])
            .map_err(io_err(format!("cannot write {shown}")))?;
        total += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::components;

    #[test]
    fn archive_paths_stay_relative() {
        assert_eq!(components(b"./a//b/").unwrap().len(), 2);
        assert!(components(b"/etc/passwd").is_err());
        assert!(components(b"a/../../x").is_err());
    }
}
