//! The bundle a sandbox travels in between nodes (`carry`'s wire format), and the marks
//! beside a carried snapshot: writing one from a snapshot's directory, reading one (as
//! hostile input: paths, sizes, frames and tenant checked) into a directory.
//!
//! `LOCKER-CARRY 1\n`, one line of JSON (`{"record": <the sandbox's record>, "files":
//! [{"path", "size"}…], "paused"?}`), then each file's data in the header's order: frames
//! of offset (u64, big-endian), length (u64) and that many bytes, ended by a frame of
//! offset `u64::MAX` and length 0. Holes are not sent and stay holes. Paths are relative,
//! one or two plain names deep (`disk.img`, `lower/1.img`, `memory`); sizes are bounded by
//! the sandbox's own disk and memory.

use std::io;
use std::path::Path;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use futures_util::TryStreamExt;
use locker_store::SandboxRecord;
use serde::{Deserialize, Serialize};
#[cfg(test)]
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

use super::refusal;
use crate::error::ApiError;

const MAGIC: &[u8] = b"LOCKER-CARRY 1\n";
/// The header line's longest.
const HEADER_MAX: u64 = 1 << 20;
/// Bytes per frame, and per chunk of the answer.
const CHUNK: usize = 1 << 20;
/// The end of a file's frames.
const END: u64 = u64::MAX;
/// Files a bundle holds at most (a disk, its layers, memory and marks).
const FILES_MAX: usize = 2 * locker_runtime::disk::MAX_LAYERS + 8;

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    record: SandboxRecord,
    files: Vec<FileEntry>,
    /// Paused when it left (`true`: by the idle policy, `false`: by its caller): it comes
    /// back paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    paused: Option<bool>,
}

#[derive(Debug, Serialize, Deserialize)]
struct FileEntry {
    path: String,
    size: u64,
}

/// The answer that streams the bundle of the snapshot in `dir` with `rec` (`paused` as
/// [`Header::paused`]); `done` is told when it was all sent, or failed to be.
pub(super) fn bundle(
    dir: &Path,
    rec: SandboxRecord,
    paused: Option<bool>,
    done: Option<tokio::sync::oneshot::Sender<()>>,
) -> Result<Response, ApiError> {
    let header = listing(dir)
        .and_then(|files| {
            serde_json::to_vec(&Header {
                record: rec,
                files,
                paused,
            })
            .map_err(io::Error::other)
        })
        .map_err(|e| ApiError::internal(format!("listing the sandbox's snapshot: {e}")))?;
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(4);
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut send = |b: Bytes| {
            tx.blocking_send(Ok(b))
                .map_err(|_| io::Error::other("the receiver went away"))
        };
        if let Err(e) = write_bundle(&dir, &header, &mut send) {
            let _ = tx.blocking_send(Err(e));
        }
        if let Some(done) = done {
            let _ = done.send(());
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Ok((StatusCode::OK, Body::from_stream(stream)).into_response())
}

/// The snapshot's files, relative to `dir` (one level of directories), sorted; a link or
/// anything but a plain file is refused.
fn listing(dir: &Path) -> io::Result<Vec<FileEntry>> {
    fn walk(dir: &Path, prefix: &str, depth: u32, out: &mut Vec<FileEntry>) -> io::Result<()> {
        let mut names: Vec<_> = std::fs::read_dir(dir)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<_>>()?;
        names.sort();
        for name in names {
            let name = name.to_string_lossy().into_owned();
            if name.starts_with('.') {
                // The kept record (`RECORD`): the header carries it.
                continue;
            }
            let path = dir.join(&name);
            let meta = std::fs::symlink_metadata(&path)?;
            let rel = format!("{prefix}{name}");
            if meta.is_dir() && depth == 0 {
                walk(&path, &format!("{rel}/"), 1, out)?;
            } else if meta.is_file() {
                out.push(FileEntry {
                    path: rel,
                    size: meta.len(),
                });
            } else {
                return Err(io::Error::other(format!("{rel} is not a plain file")));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, "", 0, &mut out)?;
    Ok(out)
}

/// Writes the bundle of the files `header` lists, under `dir`, to `send` in chunks.
fn write_bundle(
    dir: &Path,
    header: &[u8],
    send: &mut dyn FnMut(Bytes) -> io::Result<()>,
) -> io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let parsed: Header = serde_json::from_slice(header).map_err(io::Error::other)?;
    let mut buf = BytesMut::with_capacity(2 * CHUNK);
    buf.put_slice(MAGIC);
    buf.put_slice(header);
    buf.put_u8(b'\n');
    let mut flush = |buf: &mut BytesMut, all: bool| -> io::Result<()> {
        if all || buf.len() >= CHUNK {
            send(buf.split().freeze())?;
        }
        Ok(())
    };
    let mut chunk = vec![0u8; CHUNK];
    for f in &parsed.files {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(dir.join(&f.path))?;
        for (off, len) in locker_runtime::disk::data_extents(&file)? {
            let end = (off + len).min(f.size);
            let mut at = off;
            while at < end {
                let want = ((end - at) as usize).min(CHUNK);
                let n = file.read_at(&mut chunk[..want], at)?;
                if n == 0 {
                    break;
                }
                buf.put_u64(at);
                buf.put_u64(n as u64);
                buf.put_slice(&chunk[..n]);
                at += n as u64;
                flush(&mut buf, false)?;
            }
        }
        buf.put_u64(END);
        buf.put_u64(0);
    }
    flush(&mut buf, true)
}

/// The record a bundle kept in file `path` carries (its header's).
pub fn record_in(path: &Path) -> io::Result<SandboxRecord> {
    use std::io::{BufRead, Read};
    let mut r = io::BufReader::new(std::fs::File::open(path)?);
    let mut magic = vec![0u8; MAGIC.len()];
    r.read_exact(&mut magic)?;
    if magic != MAGIC {
        return Err(io::Error::other("not a carry bundle"));
    }
    let mut line = Vec::new();
    r.take(HEADER_MAX).read_until(b'\n', &mut line)?;
    let header: Header = serde_json::from_slice(&line).map_err(io::Error::other)?;
    Ok(header.record)
}

/// Whether `id` is shaped like a sandbox's id (it names directories here).
pub(super) fn sandbox_id(id: &str) -> bool {
    id.strip_prefix("sb_").is_some_and(|rest| {
        (1..=64).contains(&rest.len()) && rest.bytes().all(|b| b.is_ascii_alphanumeric())
    })
}

/// Whether `path` is a bundle's file path: one or two plain names.
fn plain_path(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    (1..=2).contains(&parts.len())
        && parts.iter().all(|p| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.len() <= 64
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        })
}

/// Reads a bundle from `body` into `dir` (created): the sandbox's record (its pause, if
/// it was paused, marked in `dir`: [`mark_paused`]).
pub(super) async fn read_bundle(
    body: Body,
    dir: &Path,
    tenant: &str,
) -> Result<SandboxRecord, ApiError> {
    let bad = |m: String| ApiError::bad_request(format!("the carried sandbox's bundle: {m}"));
    let stream = body.into_data_stream().map_err(io::Error::other);
    let mut r =
        tokio::io::BufReader::with_capacity(CHUNK, tokio_util::io::StreamReader::new(stream));
    let mut magic = vec![0u8; MAGIC.len()];
    r.read_exact(&mut magic)
        .await
        .map_err(|e| bad(e.to_string()))?;
    if magic != MAGIC {
        return Err(bad("it does not start as one".into()));
    }
    let mut line = Vec::new();
    (&mut r)
        .take(HEADER_MAX)
        .read_until(b'\n', &mut line)
        .await
        .map_err(|e| bad(e.to_string()))?;
    let header: Header =
        serde_json::from_slice(&line).map_err(|e| bad(format!("its header: {e}")))?;
    let rec = header.record;
    if rec.tenant != tenant {
        return Err(bad(format!("sandbox {} is not of tenant {tenant}", rec.id)));
    }
    if !sandbox_id(&rec.id) {
        return Err(bad(format!("{:?} is not a sandbox id", rec.id)));
    }
    if let Some(why) = refusal(&rec) {
        return Err(ApiError::conflict(why));
    }
    if header.files.len() > FILES_MAX {
        return Err(bad(format!("{} files", header.files.len())));
    }
    let most = (rec.disk_mb + rec.memory_mb + 256) << 20;
    std::fs::create_dir_all(dir)
        .and_then(|()| mark_paused(dir, header.paused))
        .map_err(|e| ApiError::internal(format!("create {}: {e}", dir.display())))?;
    for f in &header.files {
        if !plain_path(&f.path) || f.size > most {
            return Err(bad(format!("file {:?} of {} bytes", f.path, f.size)));
        }
        let path = dir.join(&f.path);
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| ApiError::internal(format!("create {}: {e}", parent.display())))?;
        }
        let mut out = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .await
            .map_err(|e| bad(format!("file {:?}: {e}", f.path)))?;
        out.set_len(f.size)
            .await
            .map_err(|e| ApiError::internal(format!("sizing {}: {e}", path.display())))?;
        let mut next = 0u64;
        loop {
            let off = r.read_u64().await.map_err(|e| bad(e.to_string()))?;
            let len = r.read_u64().await.map_err(|e| bad(e.to_string()))?;
            if off == END && len == 0 {
                break;
            }
            if off < next || len == 0 || len > CHUNK as u64 || off.saturating_add(len) > f.size {
                return Err(bad(format!(
                    "file {:?}: a frame of {len} bytes at {off} (the file has {})",
                    f.path, f.size
                )));
            }
            out.seek(io::SeekFrom::Start(off))
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?;
            let copied = tokio::io::copy(&mut (&mut r).take(len), &mut out)
                .await
                .map_err(|e| bad(e.to_string()))?;
            if copied != len {
                return Err(bad(format!("file {:?} ends early", f.path)));
            }
            next = off + len;
        }
        out.flush()
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
    }
    Ok(rec)
}

/// Beside a carried snapshot when its sandbox was paused: `idle` or `caller`.
pub(super) const PAUSED: &str = ".paused";

/// Notes in `dir` that the sandbox of its snapshot was paused (`Some(by_idle)`), if it was.
pub(super) fn mark_paused(dir: &Path, paused: Option<bool>) -> io::Result<()> {
    match paused {
        Some(by_idle) => std::fs::write(dir.join(PAUSED), if by_idle { "idle" } else { "caller" }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> SandboxRecord {
        serde_json::from_value(json!({
            "id": "sb_0123abcd", "tenant": "t", "state": "running", "template": "default",
            "template_digest": "sha256:00", "runtime": "jail", "cpus": 1.0, "memory_mb": 256,
            "disk_mb": 64, "network": {}, "volumes": [], "metadata": {}, "env": {},
            "ttl_s": 60, "idle_timeout_s": null, "created_at": "2026-01-01T00:00:00Z",
            "expires_at": "2026-01-01T00:01:00Z", "last_active_at": "2026-01-01T00:00:00Z",
            "machine_dir": "/x", "cpu_ms": 0, "peak_memory_bytes": 0, "preview_token": "p",
            "public_ports": [], "host": "h"
        }))
        .expect("a record")
    }

    #[tokio::test]
    async fn a_bundle_carries_sparse_files_byte_for_byte_and_bad_ones_are_refused() {
        use std::os::unix::fs::FileExt;
        let root = std::env::temp_dir().join(format!("carry-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (src, dst) = (root.join("src"), root.join("dst"));
        std::fs::create_dir_all(src.join("lower")).unwrap();
        let disk = std::fs::File::create(src.join("disk.img")).unwrap();
        disk.set_len(40 << 20).unwrap();
        disk.write_all_at(&vec![7u8; 3 << 20], 1 << 20).unwrap();
        disk.write_all_at(b"end", (40 << 20) - 3).unwrap();
        std::fs::write(src.join("lower/1.img"), b"lower layer").unwrap();
        let header = serde_json::to_vec(&Header {
            record: record(),
            files: listing(&src).unwrap(),
            paused: None,
        })
        .unwrap();
        let mut bytes = Vec::new();
        write_bundle(&src, &header, &mut |b| {
            bytes.extend_from_slice(&b);
            Ok(())
        })
        .unwrap();
        assert!(bytes.len() < 5 << 20, "holes are not sent: {}", bytes.len());
        let rec = read_bundle(Body::from(bytes.clone()), &dst, "t")
            .await
            .unwrap();
        assert_eq!(rec.id, "sb_0123abcd");
        for f in ["disk.img", "lower/1.img"] {
            assert_eq!(
                std::fs::read(src.join(f)).unwrap(),
                std::fs::read(dst.join(f)).unwrap(),
                "{f}"
            );
        }
        // Another tenant's, cut short, or not a bundle: refused.
        let again = root.join("again");
        assert!(read_bundle(Body::from(bytes.clone()), &again, "u")
            .await
            .is_err());
        let _ = std::fs::remove_dir_all(&again);
        let cut = bytes[..bytes.len() - 10].to_vec();
        assert!(read_bundle(Body::from(cut), &again, "t").await.is_err());
        let _ = std::fs::remove_dir_all(&again);
        assert!(read_bundle(Body::from("GET / HTTP/1.1\n"), &again, "t")
            .await
            .is_err());
        for bad in ["../x", "/etc/x", "a/b/c", ".hidden", "lower/..", ""] {
            assert!(!plain_path(bad), "{bad}");
        }
        assert!(plain_path("lower/12.qcow2") && plain_path("memory"));
        let _ = std::fs::remove_dir_all(&root);
    }
}
