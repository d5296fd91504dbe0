//! The bundle a sandbox travels in between nodes (`carry`'s wire format), and the marks
//! beside a carried snapshot: writing one from a snapshot's directory, reading one (as
//! hostile input: paths, sizes, frames and tenant checked) into a directory.
//!
//! `LOCKER-CARRY 1\n`, one line of JSON (`{"record": <the sandbox's record>, "files":
//! [{"path", "size"}…], "paused"?}`), then each file's data in the header's order: frames
//! of offset (u64, big-endian), length (u64) and that many bytes, ended by a frame of
//! offset `u64::MAX` and length 0. Holes are not sent and stay holes. A file the header
//! marks `"stream": true` had no size when the header left (a microVM's memory as QEMU
//! migrates it live, and the image its guest wrote meanwhile: [`bundle_live`]): its end
//! frame is followed by its size (u64). Paths are relative, one or two plain names deep
//! (`disk.img`, `lower/1.img`, `memory`); sizes are bounded by the sandbox's own disk and
//! memory (a live stream's by [`locker_runtime::vm::live::STREAM_FACTOR`] times its
//! memory).

use std::io;
use std::path::Path;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use futures_util::TryStreamExt;
use locker_runtime::vm::{live, VmState};
use locker_store::SandboxRecord;
use serde::{Deserialize, Serialize};
#[cfg(test)]
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

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
    /// Sized at its end, not here (see the module doc).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
}

/// The answer that streams the bundle of the snapshot in `dir` with `rec` (`paused` as
/// [`Header::paused`]); `done` is told when it was all sent, or failed to be.
pub(super) fn bundle(
    dir: &Path,
    rec: SandboxRecord,
    paused: Option<bool>,
    done: Option<tokio::sync::oneshot::Sender<()>>,
) -> Result<Response, ApiError> {
    let header = header_of(dir, rec, paused, Vec::new())?;
    let dir = dir.to_path_buf();
    Ok(stream_answer(move |send| {
        let r = write_bundle(&dir, &header, send);
        if let Some(done) = done {
            let _ = done.send(());
        }
        r
    }))
}

/// The answer that streams running microVM `vm` out live (see
/// [`locker_runtime::vm::live`]), its point taken (`out`) and its layers in `dir`: they go
/// first, while the guest runs; then its memory as QEMU migrates it (also written to
/// `dir/memory`), then the image it wrote meanwhile (copied into `dir`). `dir` then holds a
/// memory snapshot of the sandbox as it left. `done` is told what the migration measured,
/// or why it failed, once it is over.
pub(super) fn bundle_live(
    dir: &Path,
    rec: SandboxRecord,
    vm: VmState,
    out: live::Outgoing,
    done: tokio::sync::oneshot::Sender<Result<live::LiveStats, String>>,
) -> Result<Response, ApiError> {
    let streamed = ["memory".to_owned(), live::own_image_name(&out)]
        .into_iter()
        .map(|path| FileEntry {
            path,
            size: 0,
            stream: true,
        })
        .collect();
    let header = header_of(dir, rec, None, streamed)?;
    let dir = dir.to_path_buf();
    Ok(stream_answer(move |send| {
        let r = write_live(&dir, &header, &vm, &out, send);
        let _ = done.send(r.as_ref().map(|s| *s).map_err(ToString::to_string));
        r.map(drop)
    }))
}

/// The header of a bundle of the files in `dir`, then `streamed`.
fn header_of(
    dir: &Path,
    rec: SandboxRecord,
    paused: Option<bool>,
    streamed: Vec<FileEntry>,
) -> Result<Vec<u8>, ApiError> {
    listing(dir)
        .and_then(|mut files| {
            files.extend(streamed);
            serde_json::to_vec(&Header {
                record: rec,
                files,
                paused,
            })
            .map_err(io::Error::other)
        })
        .map_err(|e| ApiError::internal(format!("listing the sandbox's snapshot: {e}")))
}

/// A 200 whose body `write` produces, from a blocking task, in chunks; an error it returns
/// cuts the body.
fn stream_answer(
    write: impl FnOnce(&mut dyn FnMut(Bytes) -> io::Result<()>) -> io::Result<()> + Send + 'static,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(4);
    tokio::task::spawn_blocking(move || {
        let mut send = |b: Bytes| {
            tx.blocking_send(Ok(b))
                .map_err(|_| io::Error::other("the receiver went away"))
        };
        if let Err(e) = write(&mut send) {
            let _ = tx.blocking_send(Err(e));
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    (StatusCode::OK, Body::from_stream(stream)).into_response()
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
                    stream: false,
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

/// The frames of a bundle on their way out, sent in chunks of about [`CHUNK`].
struct Framer<'a> {
    buf: BytesMut,
    send: &'a mut dyn FnMut(Bytes) -> io::Result<()>,
}

impl<'a> Framer<'a> {
    /// A bundle's start: the magic line and `header`.
    fn start(header: &[u8], send: &'a mut dyn FnMut(Bytes) -> io::Result<()>) -> Self {
        let mut buf = BytesMut::with_capacity(2 * CHUNK);
        buf.put_slice(MAGIC);
        buf.put_slice(header);
        buf.put_u8(b'\n');
        Self { buf, send }
    }

    fn frame(&mut self, at: u64, data: &[u8]) -> io::Result<()> {
        self.buf.put_u64(at);
        self.buf.put_u64(data.len() as u64);
        self.buf.put_slice(data);
        if self.buf.len() >= CHUNK {
            (self.send)(self.buf.split().freeze())?;
        }
        Ok(())
    }

    /// A file's end; a streamed file's size follows it.
    fn end(&mut self, streamed_size: Option<u64>) {
        self.buf.put_u64(END);
        self.buf.put_u64(0);
        if let Some(size) = streamed_size {
            self.buf.put_u64(size);
        }
    }

    /// File `f` of `dir`: its data frames (holes skipped), then its end.
    fn file(&mut self, dir: &Path, f: &FileEntry) -> io::Result<()> {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(dir.join(&f.path))?;
        let size = if f.stream {
            file.metadata()?.len()
        } else {
            f.size
        };
        let mut chunk = vec![0u8; CHUNK];
        for (off, len) in locker_runtime::disk::data_extents(&file)? {
            let end = (off + len).min(size);
            let mut at = off;
            while at < end {
                let want = ((end - at) as usize).min(CHUNK);
                let n = file.read_at(&mut chunk[..want], at)?;
                if n == 0 {
                    break;
                }
                self.frame(at, &chunk[..n])?;
                at += n as u64;
            }
        }
        self.end(f.stream.then_some(size));
        Ok(())
    }

    fn finish(mut self) -> io::Result<()> {
        (self.send)(self.buf.split().freeze())
    }
}

/// Writes the bundle of the files `header` lists, under `dir`, to `send` in chunks.
fn write_bundle(
    dir: &Path,
    header: &[u8],
    send: &mut dyn FnMut(Bytes) -> io::Result<()>,
) -> io::Result<()> {
    let parsed: Header = serde_json::from_slice(header).map_err(io::Error::other)?;
    let mut out = Framer::start(header, send);
    for f in &parsed.files {
        out.file(dir, f)?;
    }
    out.finish()
}

/// Writes the bundle of a live move (see [`bundle_live`]): the files in `dir`, the memory
/// as it leaves, the image written meanwhile.
fn write_live(
    dir: &Path,
    header: &[u8],
    vm: &VmState,
    out: &live::Outgoing,
    send: &mut dyn FnMut(Bytes) -> io::Result<()>,
) -> io::Result<live::LiveStats> {
    let parsed: Header = serde_json::from_slice(header).map_err(io::Error::other)?;
    let (fixed, streamed): (Vec<_>, Vec<_>) = parsed.files.iter().partition(|f| !f.stream);
    let mut framer = Framer::start(header, send);
    for f in fixed {
        framer.file(dir, f)?;
    }
    let mut at = 0u64;
    let (stats, _) = live::migrate_out(vm, dir, out, &mut |data: &[u8]| {
        framer.frame(at, data)?;
        at += data.len() as u64;
        Ok(())
    })
    .map_err(io::Error::other)?;
    framer.end(Some(at));
    // The memory, then the image.
    if let Some(image) = streamed.get(1) {
        framer.file(dir, image)?;
    }
    framer.finish()?;
    Ok(stats)
}

/// The record a bundle carries (its header's), read from its start.
pub fn record_in(bundle: impl io::Read) -> io::Result<SandboxRecord> {
    use std::io::{BufRead, Read};
    let mut r = io::BufReader::new(bundle);
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
    if header.files.len() > FILES_MAX {
        return Err(bad(format!("{} files", header.files.len())));
    }
    let most = (rec.disk_mb + rec.memory_mb + 256) << 20;
    let most_streamed = (rec.disk_mb + (live::STREAM_FACTOR + 1) * rec.memory_mb + 256) << 20;
    std::fs::create_dir_all(dir)
        .and_then(|()| mark_paused(dir, header.paused))
        .map_err(|e| ApiError::internal(format!("create {}: {e}", dir.display())))?;
    for f in &header.files {
        let bound = if f.stream { most_streamed } else { f.size };
        if !plain_path(&f.path) || f.size > most || (f.stream && f.size != 0) {
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
            if off < next || len == 0 || len > CHUNK as u64 || off.saturating_add(len) > bound {
                return Err(bad(format!(
                    "file {:?}: a frame of {len} bytes at {off} (the file has at most {bound})",
                    f.path
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
        if f.stream {
            let size = r.read_u64().await.map_err(|e| bad(e.to_string()))?;
            if size < next || size > bound {
                return Err(bad(format!(
                    "file {:?}: {size} bytes, with data up to {next} (at most {bound})",
                    f.path
                )));
            }
            out.set_len(size)
                .await
                .map_err(|e| ApiError::internal(format!("sizing {}: {e}", path.display())))?;
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

    /// A live bundle's streamed files (memory as it leaves, sized at its end) arrive whole,
    /// trailing hole included; one whose size or frames pass its bound is refused.
    #[tokio::test]
    async fn a_streamed_file_is_sized_at_its_end_and_bounded() {
        let root = std::env::temp_dir().join(format!("carry-stream-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let src = root.join("src");
        std::fs::create_dir_all(src.join("lower")).unwrap();
        std::fs::write(src.join("lower/1.img"), b"layer").unwrap();
        let streamed = vec![FileEntry {
            path: "memory".into(),
            size: 0,
            stream: true,
        }];
        let header = header_of(&src, record(), None, streamed).unwrap();
        let parsed: Header = serde_json::from_slice(&header).unwrap();
        let bundle_with = |frames: &[(u64, Vec<u8>)], size: u64| {
            let mut bytes = Vec::new();
            let mut send = |b: Bytes| {
                bytes.extend_from_slice(&b);
                Ok(())
            };
            let mut out = Framer::start(&header, &mut send);
            out.file(&src, &parsed.files[0]).unwrap();
            for (at, data) in frames {
                out.frame(*at, data).unwrap();
            }
            out.end(Some(size));
            out.finish().unwrap();
            bytes
        };
        let memory = [(0, vec![1u8; 1000]), (4096, vec![2u8; 10])];
        let dst = root.join("dst");
        read_bundle(Body::from(bundle_with(&memory, 8192)), &dst, "t")
            .await
            .unwrap();
        let got = std::fs::read(dst.join("memory")).unwrap();
        assert_eq!(got.len(), 8192);
        assert!(got[..1000].iter().all(|&b| b == 1) && got[4096..4106].iter().all(|&b| b == 2));
        assert_eq!(std::fs::read(dst.join("lower/1.img")).unwrap(), b"layer");
        // Sized below its data, or past the bound (disk 64 + 4 × memory 256 + 256 MB).
        for (i, (frames, size)) in [
            (memory.to_vec(), 100),
            (memory.to_vec(), 2000 << 20),
            (vec![(1500 << 20, vec![0u8; 8])], 1600 << 20),
        ]
        .into_iter()
        .enumerate()
        {
            let at = root.join(format!("bad{i}"));
            assert!(
                read_bundle(Body::from(bundle_with(&frames, size)), &at, "t")
                    .await
                    .is_err(),
                "case {i}"
            );
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}
