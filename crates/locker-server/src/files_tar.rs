//! The files API's tar mode, content negotiation on the files route (see `files`): a
//! directory downloaded as a tar archive (`Accept: application/x-tar` or `?format=tar`), an
//! archive uploaded into a directory (`Content-Type: application/x-tar` or `?format=tar`).
//!
//! The target's agent makes and extracts the archive and resolves every entry inside the
//! directory (nothing an archive holds can write outside it); this module only streams the
//! bytes both ways, never holding an archive, and for a volume meters the upload against
//! its size. It must not parse archives itself.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName};
use axum::response::{IntoResponse, Response};
use futures_util::{StreamExt, TryStreamExt};
use locker_runtime::agent::AgentClientError;

use crate::error::ApiError;
use crate::files::{agent_result, blocks_of, drain, FilesTarget};
use crate::state::AppState;

/// The media type of a tar archive.
pub const TAR: &str = "application/x-tar";

/// Whether the call asks for the tar mode: `format=tar`, or the media type in `header`
/// (`Accept` of a download, `Content-Type` of an upload).
pub fn asked(
    format: Option<&str>,
    headers: &HeaderMap,
    name: HeaderName,
) -> Result<bool, ApiError> {
    match format {
        Some("tar") => return Ok(true),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "`format` must be `tar` (a directory as a tar archive) or left out, got {other:?}"
            )))
        }
        None => {}
    }
    Ok(headers.get_all(name).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',').any(|t| {
                t.split(';')
                    .next()
                    .is_some_and(|m| m.trim().eq_ignore_ascii_case(TAR))
            })
        })
    }))
}

/// The 400 of a plain download of a directory, saying how to ask for it as a tar.
pub fn directory_hint(path: &str) -> ApiError {
    ApiError::bad_request(format!(
        "{path} is a directory: download it as a tar archive with `Accept: {TAR}` or \
         `?format=tar` (`locker files get -r`), or list it with files/list"
    ))
}

/// Streams the directory `path` of `target` as a tar archive.
pub async fn download<T: FilesTarget>(
    app: &AppState,
    target: T,
    path: &str,
) -> Result<Response, ApiError> {
    let (entry, reader) = agent_result(app, &target, target.agent().read_tar(path).await).await?;
    let name = if entry.name == "/" {
        "root".to_string()
    } else {
        entry.name.replace(['"', '\\', '\r', '\n'], "_")
    };
    let stream = tokio_util::io::ReaderStream::with_capacity(reader, locker_proto::DATA_CHUNK)
        .map_ok(move |b| {
            // The target stays held (a sandbox busy) for as long as the body streams.
            let _ = &target;
            b
        });
    Ok((
        [
            (header::CONTENT_TYPE, TAR.to_owned()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{name}.tar\""),
            ),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// The answer of an upload: the directory's Entry with `entries` (files, directories and
/// links written) and `bytes` (file data written).
fn answer(entry: locker_types::Entry, entries: u64, bytes: u64) -> Response {
    let mut v = serde_json::to_value(&entry).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.insert("entries".into(), entries.into());
        o.insert("bytes".into(), bytes.into());
    }
    axum::Json(v).into_response()
}

/// Extracts the tar archive in `body` into the directory `path` of `target`, streamed.
pub async fn upload<T: FilesTarget>(
    app: &AppState,
    target: T,
    path: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let agent = target.agent();
    let mut stream = body.into_data_stream().map_err(std::io::Error::other);
    let Some(space) = target.space() else {
        let r = agent
            .write_tar(path, tokio_util::io::StreamReader::new(&mut stream))
            .await;
        if r.is_err() {
            // The client may still be sending: it should read the refusal, not a reset.
            drain(&mut stream).await;
        }
        let (entry, entries, bytes) = agent_result(app, &target, r).await?;
        return Ok(answer(entry, entries, bytes));
    };
    let writing = space.gate.read().await;
    let limit = space.limit_bytes as i64;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared {
        if space.used_bytes() as i64 + blocks_of(len) > limit {
            drain(&mut stream).await;
            return Err(space.full(path));
        }
    }
    // The archive's bytes are reserved as they arrive (a little more than its files take:
    // headers count too), so parallel uploads cannot pass the limit together; the tree is
    // measured again once the extraction is over.
    let reserved = AtomicI64::new(0);
    let tripped = AtomicBool::new(false);
    let mut metered = stream.map(|chunk| {
        let chunk = chunk?;
        if tripped.load(Ordering::SeqCst) {
            return Ok(chunk); // being drained
        }
        let n = chunk.len() as i64;
        reserved.fetch_add(n, Ordering::SeqCst);
        if space.add(n) > limit {
            tripped.store(true, Ordering::SeqCst);
            return Err(std::io::Error::other("the volume's size limit was reached"));
        }
        Ok(chunk)
    });
    let result = agent
        .write_tar(path, tokio_util::io::StreamReader::new(&mut metered))
        .await;
    space.add(-reserved.load(Ordering::SeqCst));
    // Whatever was extracted before a failure stays, so it is logged and counted too.
    target.changed(&[path]);
    let over = tripped.load(Ordering::SeqCst) && matches!(result, Err(AgentClientError::Input(_)));
    if result.is_err() {
        drain(&mut metered).await;
    }
    drop(writing);
    space.recount().await?;
    if over {
        return Err(space.full(path));
    }
    let (entry, entries, bytes) = result?;
    Ok(answer(entry, entries, bytes))
}
