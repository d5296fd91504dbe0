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

/// Writes the tree under `root` as a tar archive to `out`: regular files, directories and
/// symlinks (as links), depth first, names sorted; sockets, FIFOs and devices are left out
/// with a note on stderr.
fn archive(root: &Path, out: impl Write) -> Result<(), ClientError> {
    let mut b = tar::Builder::new(out);
    let sorted = |dir: &Path| -> Result<Vec<PathBuf>, ClientError> {
        let mut v: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(io_err(format!("cannot read {}", dir.display())))?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()
            .map_err(io_err(format!("cannot read {}", dir.display())))?;
        // Descending, so popping yields ascending order.
        v.sort_by(|a, b| b.as_os_str().as_bytes().cmp(a.as_os_str().as_bytes()));
        Ok(v)
    };
    let mut stack = vec![sorted(root)?];
    while let Some(top) = stack.last_mut() {
        let Some(p) = top.pop() else {
            stack.pop();
            continue;
        };
        let rel = p.strip_prefix(root).unwrap_or(&p).to_path_buf();
        let shown = p.display().to_string();
        let m = fs::symlink_metadata(&p).map_err(io_err(format!("cannot read {shown}")))?;
        let ft = m.file_type();
        let w = io_err(format!("cannot send {shown}"));
        if ft.is_dir() {
            let mut h = header(tar::EntryType::Directory, &m, 0);
            b.append_data(&mut h, &rel, io::empty()).map_err(w)?;
            stack.push(sorted(&p)?);
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
            // A file that changes size while it is sent would break the archive: it is
            // sent as long as it was when its header was written.
            b.append_data(&mut h, &rel, Exactly(f.take(m.len()), m.len()))
                .map_err(w)?;
        } else if ft.is_symlink() {
            let target = fs::read_link(&p).map_err(io_err(format!("cannot read {shown}")))?;
            let mut h = header(tar::EntryType::Symlink, &m, 0);
            b.append_link(&mut h, &rel, &target).map_err(w)?;
        } else {
            eprintln!("locker: left out {shown}: not a file, directory or symlink");
        }
    }
    b.finish()
        .map_err(io_err("cannot send the archive".to_string()))
}

/// A reader padded with zeros up to its announced length.
struct Exactly<R>(R, u64);

impl<R: Read> Read for Exactly<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = buf.len().min(self.1.min(usize::MAX as u64) as usize);
        if want == 0 {
            return Ok(0);
        }
        let n = match self.0.read(&mut buf[..want])? {
            0 => {
                buf[..want].fill(0);
                want
            }
            n => n,
        };
        self.1 -= n as u64;
        Ok(n)
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
    let (rx, tx) = io::pipe().map_err(io_err("cannot make a pipe".to_string()))?;
    let root = local.to_path_buf();
    let maker = std::thread::spawn(move || archive(&root, tx));
    let sent = c.put_body(
        url_path,
        &[("path", path.to_string()), ("format", "tar".to_string())],
        ureq::SendBody::from_owned_reader(rx),
    );
    // A local failure explains a broken upload better than the server's answer to it.
    match maker.join() {
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ClientError::Protocol("building the archive failed".into())),
        Ok(Ok(())) => sent,
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
