//! File system helpers of this room: `locker-sys`'s atomic writes, synced directories, tree
//! removal and hex with this room's errors; the mounts under a path; digests.

use serde::Serialize;
use std::collections::HashSet;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::*;

/// Disk space of a tree in bytes, counting each hard-linked inode once.
pub(super) fn disk_usage(root: &Path) -> Result<u64, TemplateError> {
    let mut total = 0u64;
    let mut seen = HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).map_err(io_err("cannot list", &dir))? {
            let entry = entry.map_err(io_err("cannot list", &dir))?;
            let meta = entry
                .metadata()
                .map_err(io_err("cannot stat", &entry.path()))?;
            if meta.nlink() > 1 && !meta.is_dir() && !seen.insert((meta.dev(), meta.ino())) {
                continue;
            }
            total += meta.blocks() * 512;
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    Ok(total)
}

/// Unmounts everything mounted at or under `path`, then removes it.
pub(super) fn remove_tree(path: &Path) -> Result<(), TemplateError> {
    let mounts = mounts_under(path);
    for m in &mounts {
        if let Err(e) = sys::umount_detach(m) {
            tracing::warn!(mount = %m.display(), "cannot unmount: {e}");
        }
    }
    if let Some(m) = mounts_under(path).first() {
        // Removing across a mount point would delete the mounted filesystem's files.
        return Err(TemplateError::Io {
            what: "refusing to remove a build with a mount still under it:",
            path: m.clone(),
            err: io::ErrorKind::ResourceBusy.into(),
        });
    }
    locker_sys::fs::remove_tree(path).map_err(io_err("cannot remove", path))
}

/// Mount points at or under `path` in this mount namespace, deepest first.
pub(super) fn mounts_under(path: &Path) -> Vec<PathBuf> {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape_mountinfo(m)))
        .filter(|m| m.starts_with(path))
        .collect();
    out.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    out.dedup();
    out
}

/// Undoes the octal escapes (`\040` for a space) of /proc/self/mountinfo.
pub(super) fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(super) fn write_json_atomic(path: &Path, value: &impl Serialize) -> Result<(), TemplateError> {
    let mut bytes = serde_json::to_vec_pretty(value).expect("metadata always serializes");
    bytes.push(b'\n');
    write_atomic(path, &bytes)
}

/// Writes `bytes` to a temporary name beside `path`, fsyncs, renames, fsyncs the directory.
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TemplateError> {
    locker_sys::fs::write_atomic(path, bytes, locker_sys::fs::Durability::Disk)
        .map_err(io_err("cannot write", path))
}

pub(super) fn fsync_dir(dir: &Path) -> Result<(), TemplateError> {
    locker_sys::fs::fsync_dir(dir).map_err(io_err("cannot sync", dir))
}

pub(super) fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

pub(super) use locker_sys::hex::{encode as hex, is_lower_digit as is_lower_hex};

pub(super) fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(is_lower_hex)
}

pub(super) fn one_line(s: &str) -> String {
    let first = s
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let mut out: String = first.chars().take(50).collect();
    if out.len() < first.len() || s.trim().lines().count() > 1 {
        out.push('…');
    }
    out
}
