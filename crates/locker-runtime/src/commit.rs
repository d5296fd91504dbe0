//! A run's commit: the changes a copy-on-write layer holds, listed, journalled and applied
//! to a volume all or nothing, across a crash.
//!
//! [`scan`] reads an overlay's upper directory: whiteouts (character devices 0:0) are
//! deletions, opaque directories replaced the lower one, files and symlinks are added or
//! modified, directories that exist only because of a copy-up are walked. The [`Op`]s it
//! returns go to a journal ([`write_journal`]: `commit.journal` at the root of the volume's
//! filesystem, fsynced; its rename is the commit point), are applied idempotently
//! ([`apply`]), flushed, and the journal removed ([`finish_journal`]). Whoever finds a
//! journal (a server that died mid-apply, at its next start) replays it
//! ([`replay_journal`]) before anything else touches the volume.
//!
//! This room knows paths and files only: which run, which volume record, conflicts between
//! runs and the HTTP answer are the server's (`locker-server/src/runs.rs`).

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path as FsPath, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The journal of a commit in progress, at the root of the volume's filesystem.
const JOURNAL: &str = "commit.journal";

/// One step of a commit; every step can be applied again with the same outcome.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Remove `path` (a file, or a directory with its contents).
    Delete { path: String },
    /// Make sure `path` is a directory with this mode and owner.
    Mkdir {
        path: String,
        mode: u32,
        uid: u32,
        gid: u32,
    },
    /// Rename the file or symlink `from` (in the run's layer) to `path`.
    Put { path: String, from: PathBuf },
    /// Replace whatever is at `path` by the directory `from` (in the run's layer).
    ReplaceDir { path: String, from: PathBuf },
}

/// What a run's layer holds.
#[derive(Debug, Default)]
pub struct Scan {
    pub added: Vec<String>,
    pub modified: Vec<String>,
    pub deleted: Vec<String>,
    pub ops: Vec<Op>,
}

fn is_whiteout(m: &fs::Metadata) -> bool {
    m.file_type().is_char_device() && m.rdev() == 0
}

/// Whether `p` carries `trusted.overlay.opaque=y`.
fn is_opaque(p: &FsPath) -> bool {
    let mut v = [0u8; 4];
    matches!(
        locker_sys::xattr::get(p, c"trusted.overlay.opaque", &mut v),
        Ok([b'y', ..])
    )
}

/// Removes the overlay's own attributes (`trusted.overlay.*`) from `p`, so a file or
/// directory moved into the volume carries none into the next run's lower layer.
fn strip_overlay_xattrs(p: &FsPath) {
    for name in locker_sys::xattr::list(p).unwrap_or_default() {
        if name.as_bytes().starts_with(b"trusted.overlay.") {
            let _ = locker_sys::xattr::remove(p, &name);
        }
    }
}

fn join(rel: &str, name: &str) -> String {
    if rel.is_empty() {
        format!("/{name}")
    } else {
        format!("{rel}/{name}")
    }
}

/// Lists the changes of the overlay layer `upper` over `base` and the ops that apply them.
/// Sorted paths, relative to the volume's root with a leading `/`. Entries of types a volume
/// does not keep (FIFOs, sockets, devices other than whiteouts) are removed from the layer.
pub fn scan(base: &FsPath, upper: &FsPath) -> io::Result<Scan> {
    let mut s = Scan::default();
    walk(base, upper, "", &mut s)?;
    s.added.sort();
    s.modified.sort();
    s.deleted.sort();
    Ok(s)
}

fn walk(base: &FsPath, upper: &FsPath, rel: &str, s: &mut Scan) -> io::Result<()> {
    let udir = upper.join(rel.trim_start_matches('/'));
    let mut names: Vec<_> = fs::read_dir(&udir)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<io::Result<_>>()?;
    names.sort();
    for name in names {
        let p = join(rel, &name.to_string_lossy());
        let (up, bp) = (udir.join(&name), base.join(p.trim_start_matches('/')));
        let m = up.symlink_metadata()?;
        let bm = bp.symlink_metadata().ok();
        let ft = m.file_type();
        if is_whiteout(&m) {
            if bm.is_some() {
                s.deleted.push(p.clone());
                s.ops.push(Op::Delete { path: p });
            }
        } else if ft.is_dir() {
            let was_dir = bm.as_ref().is_some_and(|b| b.is_dir());
            if was_dir && !is_opaque(&up) {
                strip_overlay_xattrs(&up);
                s.ops.push(Op::Mkdir {
                    path: p.clone(),
                    mode: m.mode() & 0o7777,
                    uid: m.uid(),
                    gid: m.gid(),
                });
                walk(base, upper, &p, s)?;
            } else {
                // New, or replacing the lower directory (opaque): moved in whole.
                if bm.is_none() {
                    s.added.push(p.clone());
                } else if !was_dir {
                    s.modified.push(p.clone());
                }
                replaced(&up, was_dir.then_some(bp.as_path()), &p, s)?;
                s.ops.push(Op::ReplaceDir { path: p, from: up });
            }
        } else if ft.is_file() || ft.is_symlink() {
            strip_overlay_xattrs(&up);
            if bm.is_some() {
                s.modified.push(p.clone());
            } else {
                s.added.push(p.clone());
            }
            s.ops.push(Op::Put { path: p, from: up });
        } else {
            fs::remove_file(&up)?;
        }
    }
    Ok(())
}

/// Lists the changes of the directory `up`, which replaces `bp` (None: nothing before),
/// at path `p`; cleans what it holds for the move.
fn replaced(up: &FsPath, bp: Option<&FsPath>, p: &str, s: &mut Scan) -> io::Result<()> {
    strip_overlay_xattrs(up);
    let mut seen = std::collections::HashSet::new();
    for e in fs::read_dir(up)? {
        let e = e?;
        let name = e.file_name();
        let (u, q) = (e.path(), join(p, &name.to_string_lossy()));
        let m = u.symlink_metadata()?;
        let ft = m.file_type();
        let b = bp.map(|b| b.join(&name));
        let bm = b.as_ref().and_then(|b| b.symlink_metadata().ok());
        if ft.is_dir() {
            seen.insert(name);
            let was_dir = bm.as_ref().is_some_and(|m| m.is_dir());
            if bm.is_none() {
                s.added.push(q.clone());
            } else if !was_dir {
                s.modified.push(q.clone());
            }
            replaced(&u, b.as_deref().filter(|_| was_dir), &q, s)?;
        } else if ft.is_file() || ft.is_symlink() {
            seen.insert(name);
            strip_overlay_xattrs(&u);
            if bm.is_some() {
                s.modified.push(q);
            } else {
                s.added.push(q);
            }
        } else {
            fs::remove_file(&u)?;
        }
    }
    if let Some(bp) = bp {
        for e in fs::read_dir(bp)? {
            let e = e?;
            if !seen.contains(&e.file_name()) {
                s.deleted.push(join(p, &e.file_name().to_string_lossy()));
            }
        }
    }
    Ok(())
}

/// Bytes the volume grows by (negative: shrinks) when `ops` are applied to `live`.
pub fn size_delta(live: &FsPath, ops: &[Op]) -> i64 {
    let size = |p: &FsPath| -> i64 {
        match p.symlink_metadata() {
            Ok(m) if m.is_dir() => {
                (crate::tree::allocated_bytes(p).unwrap_or(0) + m.blocks() * 512) as i64
            }
            Ok(m) => (m.blocks() * 512) as i64,
            Err(_) => 0,
        }
    };
    let at = |path: &str| live.join(path.trim_start_matches('/'));
    ops.iter()
        .map(|op| match op {
            Op::Delete { path } => -size(&at(path)),
            Op::Mkdir { path, .. } => {
                if at(path).is_dir() {
                    0
                } else {
                    4096
                }
            }
            Op::Put { path, from } | Op::ReplaceDir { path, from } => size(from) - size(&at(path)),
        })
        .sum()
}

#[derive(Serialize, Deserialize)]
struct Journal {
    ops: Vec<Op>,
}

/// Makes the ops durable as `<vol_dir>/commit.journal`: the commit point. The layer's
/// files are flushed first, so the journal never names data that a crash could lose.
/// `vol_dir` is the root of the volume's filesystem (the layers are on it too). On an
/// error (a full filesystem: `StorageFull`) nothing was applied and no journal is left.
pub fn write_journal(vol_dir: &FsPath, ops: &[Op]) -> io::Result<()> {
    flush_volume(vol_dir).map_err(step("flush the run's layer"))?;
    let tmp = vol_dir.join(format!("{JOURNAL}.tmp"));
    let data = serde_json::to_vec(&Journal { ops: ops.to_vec() }).map_err(io::Error::other)?;
    (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&data)?;
        f.sync_all()
    })()
    .map_err(|e| {
        // Before the commit point: nothing was applied, and no half journal may stay.
        let _ = fs::remove_file(&tmp);
        step("write the commit journal")(e)
    })?;
    fs::rename(&tmp, vol_dir.join(JOURNAL)).map_err(step("rename the commit journal"))?;
    locker_sys::fs::fsync_dir(vol_dir).map_err(step("flush the commit journal"))
}

/// Flushes the volume's filesystem (`syncfs`). A writeback error nobody has seen yet is
/// reported to the first `syncfs` after it, whoever caused it: typically a sandbox that
/// wrote past `size_mb` through its mount. Such an error is logged and the flush made
/// again, which reports only errors of the writes since. A run's own writes had their
/// space reserved when they were made (btrfs), so they are not what fails here.
fn flush_volume(dir: &FsPath) -> io::Result<()> {
    match crate::disk::flush(dir) {
        Ok(()) => Ok(()),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "a writeback error on a volume's filesystem, from an earlier write; flushing again");
            crate::disk::flush(dir)
        }
    }
}

/// Names the step of a commit that failed in its error.
fn step(what: &'static str) -> impl Fn(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Applies the journal's ops to `<vol_dir>/live`, flushes, removes the journal.
pub fn finish_journal(vol_dir: &FsPath, ops: &[Op]) -> io::Result<()> {
    let live = vol_dir.join("live");
    let live_dir = fs::File::open(&live).map_err(step("open the live tree"))?;
    let delay = std::env::var("LOCKER_TEST_COMMIT_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis);
    for op in ops {
        apply(&live_dir, op).map_err(|e| io::Error::new(e.kind(), format!("apply {op:?}: {e}")))?;
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
    }
    flush_volume(&live).map_err(step("flush the applied commit"))?;
    fs::remove_file(vol_dir.join(JOURNAL)).map_err(step("remove the commit journal"))?;
    locker_sys::fs::fsync_dir(vol_dir).map_err(step("flush the journal's removal"))
}

fn missing(p: &FsPath) -> bool {
    matches!(p.symlink_metadata(), Err(e) if e.kind() == io::ErrorKind::NotFound)
}

/// Removes whatever is at `p` (nothing there is fine).
fn remove_any(p: &FsPath) -> io::Result<()> {
    match p.symlink_metadata() {
        Ok(m) if m.is_dir() => fs::remove_dir_all(p),
        Ok(_) => fs::remove_file(p),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Applies one op, idempotently: a `Put` or `ReplaceDir` whose source is gone was done.
///
/// Sandboxes may write the live tree while a commit is applied, and may put a symlink
/// where a directory was: every op reaches its path's parent without following any symlink
/// (`tree::parent_beneath`) and acts on the last component without following it. An op
/// whose parent is no longer a directory of the tree (a symlink, a file, gone) is skipped:
/// the sandbox's change to that parent came last.
pub fn apply(live: &fs::File, op: &Op) -> io::Result<()> {
    let (Op::Delete { path }
    | Op::Mkdir { path, .. }
    | Op::Put { path, .. }
    | Op::ReplaceDir { path, .. }) = op;
    let (dir, name) = match crate::tree::parent_beneath(live, path) {
        Ok(p) => p,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ELOOP) | Some(libc::ENOTDIR) | Some(libc::ENOENT)
            ) =>
        {
            tracing::warn!(path = %path, error = %e, "a commit step skipped: its parent is no longer a directory of the volume");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let t = crate::tree::path_at(&dir, &name);
    match op {
        Op::Delete { .. } => remove_any(&t),
        Op::Mkdir { mode, uid, gid, .. } => {
            if !t.symlink_metadata().is_ok_and(|m| m.is_dir()) {
                remove_any(&t)?;
                fs::create_dir(&t)?;
            }
            // The directory itself, never what a symlink put there meanwhile points at.
            let d = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
                .open(&t)?;
            std::os::unix::fs::fchown(&d, Some(*uid), Some(*gid))?;
            d.set_permissions(fs::Permissions::from_mode(*mode))
        }
        Op::Put { from, .. } => {
            if missing(from) {
                return Ok(());
            }
            if t.symlink_metadata().is_ok_and(|m| m.is_dir()) {
                fs::remove_dir_all(&t)?;
            }
            fs::rename(from, t)
        }
        Op::ReplaceDir { from, .. } => {
            if missing(from) {
                return Ok(());
            }
            remove_any(&t)?;
            fs::rename(from, t)
        }
    }
}

/// At start, before serving: finishes a commit a killed server left in `vol_dir` (the root
/// of a volume's filesystem, or a volume directory of the layout before it had one; its
/// journal exists: the commit point was passed) and drops one it had not reached.
pub fn replay_journal(vol_dir: &FsPath) -> io::Result<()> {
    let _ = fs::remove_file(vol_dir.join(format!("{JOURNAL}.tmp")));
    let j = vol_dir.join(JOURNAL);
    let data = match fs::read(&j) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let journal: Journal = serde_json::from_slice(&data).map_err(|e| {
        io::Error::other(format!(
            "the commit journal {} is unreadable: {e}",
            j.display()
        ))
    })?;
    tracing::warn!(volume = %vol_dir.display(), ops = journal.ops.len(), "finishing a commit a stopped server left");
    finish_journal(vol_dir, &journal.ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_is_scanned_and_applied_idempotently() {
        let t = std::env::temp_dir().join(format!("locker-runs-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&t);
        let (live, upper) = (t.join("vol/live"), t.join("upper"));
        fs::create_dir_all(live.join("d/sub")).unwrap();
        fs::create_dir_all(live.join("gone")).unwrap();
        fs::write(live.join("d/f"), b"old").unwrap();
        fs::write(live.join("d/sub/x"), b"x").unwrap();
        fs::write(live.join("keep"), b"k").unwrap();
        fs::write(live.join("gone/y"), b"y").unwrap();
        let base = t.join("base");
        crate::tree::cow_view(&live, &base, 100).unwrap().unwrap();
        fs::create_dir_all(upper.join("d")).unwrap();
        fs::write(upper.join("d/f"), b"new").unwrap();
        fs::write(upper.join("n"), b"n").unwrap();
        fs::create_dir_all(upper.join("nd/e")).unwrap();
        fs::write(upper.join("nd/e/z"), b"z").unwrap();
        // A whiteout needs CAP_MKNOD: the tests run as root.
        locker_sys::fs::mknod(&upper.join("gone"), libc::S_IFCHR | 0o600, 0).unwrap();
        let s = scan(&base, &upper).unwrap();
        assert_eq!(s.added, vec!["/n", "/nd", "/nd/e", "/nd/e/z"]);
        assert_eq!(s.modified, vec!["/d/f"]);
        assert_eq!(s.deleted, vec!["/gone"]);
        let vol = t.join("vol");
        write_journal(&vol, &s.ops).unwrap();
        let live_dir = fs::File::open(&live).unwrap();
        for op in &s.ops {
            apply(&live_dir, op).unwrap();
        }
        // A crash after applying: the replay does it all again, to the same end.
        replay_journal(&vol).unwrap();
        assert!(!vol.join(JOURNAL).exists());
        assert_eq!(fs::read(live.join("d/f")).unwrap(), b"new");
        assert_eq!(
            fs::read(base.join("d/f")).unwrap(),
            b"old",
            "the base is untouched"
        );
        assert_eq!(fs::read(live.join("d/sub/x")).unwrap(), b"x");
        assert_eq!(fs::read(live.join("nd/e/z")).unwrap(), b"z");
        assert!(!live.join("gone").exists());
        assert_eq!(fs::read(live.join("keep")).unwrap(), b"k");
        fs::remove_dir_all(&t).unwrap();
    }
}
