//! The files API of a sandbox: streamed download and upload, list, stat, mkdir, move,
//! remove. Paths are resolved by the agent inside the machine, so nothing outside its root
//! is reachable whatever the path or symlinks say. Bodies are streamed both ways: a 1 GiB
//! file never sits in the server's memory.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::TryStreamExt;
use serde::Deserialize;
use serde_json::json;

use crate::app::AppState;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::{check_path, Json, Query};
use crate::sandboxes::live_of;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/sandboxes/{id}/files",
            get(download).put(upload).delete(remove).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/v1/sandboxes/{id}/files/list", get(list))
        .route("/v1/sandboxes/{id}/files/stat", get(stat))
        .route("/v1/sandboxes/{id}/files/mkdir", post(mkdir))
        .route("/v1/sandboxes/{id}/files/move", post(rename))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PathQuery {
    path: Option<String>,
}

fn required(p: Option<String>) -> Result<String, ApiError> {
    let p = p.ok_or_else(|| ApiError::bad_request("the `path` query parameter is required (an absolute path)"))?;
    check_path("path", &p)?;
    Ok(p)
}

async fn download(State(app): State<AppState>, caller: Caller, Path(id): Path<String>, Query(q): Query<PathQuery>) -> Result<Response, ApiError> {
    let path = required(q.path)?;
    let live = live_of(&app, &caller, &id).await?;
    let (entry, reader) = live.machine.agent.read_file(&path).await?;
    if entry.kind == locker_types::EntryType::Dir {
        return Err(ApiError::bad_request(format!("{path} is a directory: list it with files/list")));
    }
    let stream = tokio_util::io::ReaderStream::with_capacity(reader, locker_proto::DATA_CHUNK).map_ok(move |b| {
        // The sandbox is busy for as long as the body streams.
        let _ = &live;
        b
    });
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream".to_owned()), (header::HeaderName::from_static("x-locker-size"), entry.size.to_string())],
        Body::from_stream(stream),
    )
        .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutQuery {
    path: Option<String>,
    mode: Option<String>,
}

/// Parses an octal mode (`0644`, `644`, `0o644`).
fn parse_mode(m: &str) -> Result<u32, ApiError> {
    let digits = m.trim_start_matches("0o");
    u32::from_str_radix(digits, 8)
        .ok()
        .filter(|v| *v <= 0o7777)
        .ok_or_else(|| ApiError::bad_request(format!("`mode` must be octal permission bits like 0644, got {m:?}")))
}

async fn upload(State(app): State<AppState>, caller: Caller, Path(id): Path<String>, Query(q): Query<PutQuery>, body: Body) -> Result<impl IntoResponse, ApiError> {
    let path = required(q.path)?;
    let mode = q.mode.as_deref().map(parse_mode).transpose()?;
    let live = live_of(&app, &caller, &id).await?;
    let stream = body.into_data_stream().map_err(std::io::Error::other);
    let reader = tokio_util::io::StreamReader::new(stream);
    let entry = live.machine.agent.write_file(&path, mode, reader).await?;
    Ok(axum::Json(entry))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveQuery {
    path: Option<String>,
    #[serde(default)]
    recursive: bool,
}

async fn remove(State(app): State<AppState>, caller: Caller, Path(id): Path<String>, Query(q): Query<RemoveQuery>) -> Result<impl IntoResponse, ApiError> {
    let path = required(q.path)?;
    if path == "/" {
        return Err(ApiError::bad_request("refusing to remove `/`"));
    }
    let live = live_of(&app, &caller, &id).await?;
    live.machine.agent.remove(&path, q.recursive).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    path: Option<String>,
    depth: Option<u32>,
}

async fn list(State(app): State<AppState>, caller: Caller, Path(id): Path<String>, Query(q): Query<ListQuery>) -> Result<impl IntoResponse, ApiError> {
    let path = required(q.path)?;
    let depth = q.depth.unwrap_or(1);
    if !(1..=16).contains(&depth) {
        return Err(ApiError::bad_request("`depth` must be between 1 and 16"));
    }
    let live = live_of(&app, &caller, &id).await?;
    let entries = live.machine.agent.list(&path, depth).await?;
    Ok(axum::Json(json!({ "entries": entries })))
}

async fn stat(State(app): State<AppState>, caller: Caller, Path(id): Path<String>, Query(q): Query<PathQuery>) -> Result<impl IntoResponse, ApiError> {
    let path = required(q.path)?;
    let live = live_of(&app, &caller, &id).await?;
    Ok(axum::Json(live.machine.agent.stat(&path).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MkdirBody {
    path: String,
}

async fn mkdir(State(app): State<AppState>, caller: Caller, Path(id): Path<String>, Json(b): Json<MkdirBody>) -> Result<impl IntoResponse, ApiError> {
    check_path("path", &b.path)?;
    let live = live_of(&app, &caller, &id).await?;
    Ok(axum::Json(live.machine.agent.mkdir(&b.path).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveBody {
    from: String,
    to: String,
}

async fn rename(State(app): State<AppState>, caller: Caller, Path(id): Path<String>, Json(b): Json<MoveBody>) -> Result<impl IntoResponse, ApiError> {
    check_path("from", &b.from)?;
    check_path("to", &b.to)?;
    let live = live_of(&app, &caller, &id).await?;
    Ok(axum::Json(live.machine.agent.rename(&b.from, &b.to).await?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn modes_parse_as_octal() {
        assert_eq!(super::parse_mode("0644").unwrap(), 0o644);
        assert_eq!(super::parse_mode("755").unwrap(), 0o755);
        assert_eq!(super::parse_mode("0o600").unwrap(), 0o600);
        assert!(super::parse_mode("9").is_err());
        assert!(super::parse_mode("77777").is_err());
    }
}
