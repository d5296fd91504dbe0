//! Build contexts: `POST /v1/templates/contexts` takes a tar body (bounded), unpacks it
//! into a directory of the data dir that only builds read, and answers its `context_id`.
//!
//! An upload is hostile until unpacked: entries with absolute paths or `..`, paths through
//! a symlink of the archive, hard links to names it has not unpacked, device nodes,
//! FIFOs, too many entries or too many bytes are refused with a 4xx and nothing left
//! behind. Symlinks are kept as symlinks; a build resolves them inside the context only.
//! Contexts live [`CONTEXT_TTL_S`] after their upload.
//!
//! This room does not build: `steps` reads the directory.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};

use axum::body::Body;
use axum::extract::State;
use axum::response::IntoResponse;
use futures_util::TryStreamExt as _;
use serde_json::json;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::{new_id, AppState};

/// The largest context body accepted.
pub const MAX_CONTEXT_BYTES: u64 = 256 << 20;
/// The most bytes a context unpacks to (sizes of its files).
pub const MAX_UNPACKED_BYTES: u64 = 1 << 30;
/// The most entries one context holds.
pub const MAX_ENTRIES: u64 = 100_000;
/// How long an uploaded context is kept.
pub const CONTEXT_TTL_S: u64 = 24 * 3600;

/// The directory of `tenant`'s contexts.
fn tenant_dir(app: &AppState, tenant: &str) -> PathBuf {
    app.cfg
        .data_dir
        .join("template-contexts")
        .join(super::tenant_tag(tenant))
}

/// The unpacked context `id` of `tenant`, if it exists.
pub fn find(app: &AppState, tenant: &str, id: &str) -> Result<PathBuf, ApiError> {
    let ok = id.strip_prefix("ctx_").is_some_and(|r| {
        !r.is_empty() && r.len() <= 64 && r.bytes().all(|b| b.is_ascii_alphanumeric())
    });
    let dir = tenant_dir(app, tenant).join(id).join("root");
    if !ok || !dir.is_dir() {
        return Err(ApiError::not_found(format!(
            "build context {id:?} does not exist (contexts are kept {} hours): upload it again with POST /v1/templates/contexts",
            CONTEXT_TTL_S / 3600
        )));
    }
    Ok(dir)
}

pub async fn upload(
    State(app): State<AppState>,
    caller: Caller,
    body: Body,
) -> Result<impl IntoResponse, ApiError> {
    let dir = tenant_dir(&app, &caller.tenant);
    fs::create_dir_all(&dir)
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
    expire(&dir);
    let id = new_id("ctx_");
    let ctx = dir.join(&id);
    let staging = dir.join(format!(".tmp-{id}"));
    fs::create_dir(&staging)
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", staging.display())))?;
    let result = receive(body, &staging).await;
    let result = match result {
        Ok(()) => {
            let s = staging.clone();
            tokio::task::spawn_blocking(move || unpack(&s.join("context.tar"), &s.join("root")))
                .await
                .map_err(|e| ApiError::internal(format!("unpacking the context: {e}")))
                .and_then(|r| r)
        }
        Err(e) => Err(e),
    };
    let _ = fs::remove_file(staging.join("context.tar"));
    match result {
        Ok(stats) => {
            fs::rename(&staging, &ctx)
                .map_err(|e| ApiError::internal(format!("saving the context: {e}")))?;
            Ok((
                axum::http::StatusCode::CREATED,
                axum::Json(json!({
                    "context_id": id,
                    "files": stats.0,
                    "bytes": stats.1,
                })),
            ))
        }
        Err(e) => {
            let _ = locker_sys::fs::remove_tree(&staging);
            Err(e)
        }
    }
}

/// Streams the body into `staging/context.tar`, refusing it past [`MAX_CONTEXT_BYTES`].
async fn receive(body: Body, staging: &Path) -> Result<(), ApiError> {
    use tokio::io::AsyncWriteExt as _;
    let path = staging.join("context.tar");
    let mut f = tokio::fs::File::create(&path)
        .await
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", path.display())))?;
    let mut stream = body.into_data_stream();
    let mut total = 0u64;
    while let Some(chunk) = stream
        .try_next()
        .await
        .map_err(|e| ApiError::bad_request(format!("reading the context body: {e}")))?
    {
        total += chunk.len() as u64;
        if total > MAX_CONTEXT_BYTES {
            // Read on (a while) so the client gets the 413, not a reset connection.
            let mut extra = 0u64;
            while let Ok(Some(c)) = stream.try_next().await {
                extra += c.len() as u64;
                if extra > 4 * MAX_CONTEXT_BYTES {
                    break;
                }
            }
            return Err(ApiError::too_large(format!(
                "the build context is larger than {} MiB: leave out what the build does not need (a .dockerignore is not read: send only the files COPY uses)",
                MAX_CONTEXT_BYTES >> 20
            )));
        }
        f.write_all(&chunk)
            .await
            .map_err(|e| ApiError::internal(format!("writing the context: {e}")))?;
    }
    f.flush()
        .await
        .map_err(|e| ApiError::internal(format!("writing the context: {e}")))?;
    if total == 0 {
        return Err(ApiError::bad_request(
            "the body is empty: send the build context as a tar archive",
        ));
    }
    Ok(())
}

/// Unpacks `tar` into `root` (created); the files and bytes it holds.
fn unpack(tar: &Path, root: &Path) -> Result<(u64, u64), ApiError> {
    fs::create_dir(root).map_err(|e| ApiError::internal(format!("creating the context: {e}")))?;
    let f = fs::File::open(tar).map_err(|e| ApiError::internal(format!("reading: {e}")))?;
    let mut archive = tar::Archive::new(locker_proto::tar_guard::TarGuard::new(f));
    let bad = |m: String| ApiError::bad_request(format!("the build context: {m}"));
    let (mut files, mut bytes) = (0u64, 0u64);
    let entries = archive
        .entries()
        .map_err(|e| bad(format!("not a tar archive: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(format!("not a valid tar archive: {e}")))?;
        files += 1;
        if files > MAX_ENTRIES {
            return Err(bad(format!("more than {MAX_ENTRIES} entries")));
        }
        let raw = entry
            .path()
            .map_err(|e| bad(format!("an entry has a bad path: {e}")))?
            .into_owned();
        let Some(rel) = clean(&raw) else {
            return Err(bad(format!(
                "entry {} leaves the context (absolute or `..`): send paths relative to the context",
                raw.display()
            )));
        };
        if rel.as_os_str().is_empty() {
            continue;
        }
        let dest = root.join(&rel);
        let parent = dest.parent().unwrap_or(root);
        ensure_dirs(root, parent).map_err(|e| bad(format!("entry {}: {e}", rel.display())))?;
        let mode = entry.header().mode().unwrap_or(0o644) & 0o7777;
        let kind = entry.header().entry_type();
        if fs::symlink_metadata(&dest).is_ok_and(|m| !(m.is_dir() && kind.is_dir())) {
            remove(&dest).map_err(|e| bad(format!("entry {}: {e}", rel.display())))?;
        }
        match kind {
            k if k.is_dir() => {
                if !dest.is_dir() {
                    fs::create_dir(&dest)
                        .map_err(|e| bad(format!("entry {}: {e}", rel.display())))?;
                }
                set_mode(&dest, (mode | 0o700) & 0o7777)?;
            }
            k if k.is_file() => {
                let size = entry.header().size().unwrap_or(0);
                bytes += size;
                if bytes > MAX_UNPACKED_BYTES {
                    return Err(ApiError::too_large(format!(
                        "the build context unpacks to more than {} MiB",
                        MAX_UNPACKED_BYTES >> 20
                    )));
                }
                let mut out = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&dest)
                    .map_err(|e| bad(format!("entry {}: {e}", rel.display())))?;
                copy_limited(&mut entry, &mut out, size)
                    .map_err(|e| bad(format!("entry {}: {e}", rel.display())))?;
                set_mode(&dest, mode)?;
            }
            k if k.is_symlink() => {
                let target = entry
                    .link_name()
                    .map_err(|e| bad(format!("entry {}: {e}", rel.display())))?
                    .ok_or_else(|| bad(format!("symlink {} has no target", rel.display())))?;
                std::os::unix::fs::symlink(&target, &dest)
                    .map_err(|e| bad(format!("entry {}: {e}", rel.display())))?;
            }
            k if k.is_hard_link() => {
                let target = entry
                    .link_name()
                    .map_err(|e| bad(format!("entry {}: {e}", rel.display())))?
                    .ok_or_else(|| bad(format!("hard link {} has no target", rel.display())))?;
                let t = clean(&target).ok_or_else(|| {
                    bad(format!(
                        "hard link {} points out of the context",
                        rel.display()
                    ))
                })?;
                let src = root.join(&t);
                // Only a regular file unpacked before it, reached without a symlink.
                ensure_dirs(root, src.parent().unwrap_or(root))
                    .map_err(|e| bad(format!("hard link {}: {e}", rel.display())))?;
                if !fs::symlink_metadata(&src).is_ok_and(|m| m.is_file()) {
                    return Err(bad(format!(
                        "hard link {} names {}, which is not a file unpacked before it",
                        rel.display(),
                        t.display()
                    )));
                }
                fs::copy(&src, &dest).map_err(|e| bad(format!("entry {}: {e}", rel.display())))?;
            }
            k if k.is_pax_global_extensions() || k.is_pax_local_extensions() => {}
            other => {
                return Err(bad(format!(
                    "entry {} is a {other:?}: a context holds files, directories and symlinks only",
                    rel.display()
                )))
            }
        }
    }
    Ok((files, bytes))
}

/// A relative path without `.`, or `None` if absolute or with `..`.
fn clean(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::RootDir | Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Makes `dir` under `root`, refusing to pass through a symlink or a file.
fn ensure_dirs(root: &Path, dir: &Path) -> io::Result<()> {
    let rel = dir
        .strip_prefix(root)
        .map_err(|_| io::Error::other("outside the context"))?;
    let mut at = root.to_path_buf();
    for c in rel.components() {
        at.push(c);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(io::Error::other(format!(
                    "it goes through the symlink {}",
                    at.strip_prefix(root).unwrap_or(&at).display()
                )))
            }
            Ok(_) => return Err(io::Error::other("a parent is not a directory")),
            Err(_) => fs::create_dir(&at)?,
        }
    }
    Ok(())
}

fn remove(p: &Path) -> io::Result<()> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => locker_sys::fs::remove_tree(p),
        Ok(_) => fs::remove_file(p),
        Err(_) => Ok(()),
    }
}

fn set_mode(p: &Path, mode: u32) -> Result<(), ApiError> {
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(p, fs::Permissions::from_mode(mode))
        .map_err(|e| ApiError::internal(format!("setting the mode of {}: {e}", p.display())))
}

fn copy_limited(r: &mut impl Read, w: &mut impl Write, size: u64) -> io::Result<()> {
    let n = io::copy(&mut r.take(size), w)?;
    if n != size {
        return Err(io::Error::other("the archive ends inside this file"));
    }
    Ok(())
}

/// Removes contexts older than [`CONTEXT_TTL_S`] and staging directories of uploads that
/// died (older than an hour).
fn expire(dir: &Path) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let age = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .map_or(0, |d| d.as_secs());
        let staging = e.file_name().to_string_lossy().starts_with(".tmp-");
        if age > CONTEXT_TTL_S || (staging && age > 3600) {
            let _ = locker_sys::fs::remove_tree(&e.path());
        }
    }
}
