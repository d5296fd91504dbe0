//! The files API, one implementation for two kinds of target: a sandbox (its machine's
//! agent) and a volume (a host-side agent confined to the volume's tree; see `volumes`).
//! Streamed download and upload, list, stat, mkdir, move, remove. Paths are resolved by the
//! agent with `openat2(RESOLVE_IN_ROOT)`, so nothing outside the target's root is reachable
//! whatever the path or symlinks say. Bodies are streamed both ways: a 1 GiB file never
//! sits in the server's memory. A directory goes either way as a tar archive when the call
//! asks for it (see `files_tar`).
//!
//! A target that has a [`Space`] (a volume) gets its size limit enforced here, on every
//! write, while the body streams: a write that would pass the limit is aborted (the agent
//! throws its temporary file away) and answered 413.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::{StreamExt, TryStreamExt};
use locker_runtime::agent::{AgentClient, AgentClientError};
use locker_types::EntryType;
use serde::Deserialize;
use serde_json::json;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::{check_path, Json, Query};
use crate::files_tar;
use crate::state::{AppState, Busy};

/// The files routes of sandboxes.
pub fn routes() -> Router<AppState> {
    routes_for::<Busy>("/v1/sandboxes/{id}")
}

/// The files routes under `base` (a path with an `{id}` segment) for targets of kind `T`.
pub fn routes_for<T: FilesTarget>(base: &str) -> Router<AppState> {
    Router::new()
        .route(
            &format!("{base}/files"),
            get(download::<T>)
                .put(upload::<T>)
                .delete(remove::<T>)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route(&format!("{base}/files/list"), get(list::<T>))
        .route(&format!("{base}/files/stat"), get(stat::<T>))
        .route(&format!("{base}/files/mkdir"), post(mkdir::<T>))
        .route(&format!("{base}/files/move"), post(rename::<T>))
}

/// What the files routes work on. A resolved target is held for the whole call (a sandbox
/// counts the call in flight, so it is never paused under it).
pub trait FilesTarget: Sized + Send + Sync + 'static {
    /// The caller's target `id`; 404 for another tenant's or a missing one.
    fn resolve(
        app: &AppState,
        caller: &Caller,
        id: &str,
    ) -> impl Future<Output = Result<Self, ApiError>> + Send;
    /// The agent that serves its files.
    fn agent(&self) -> &AgentClient;
    /// Its size accounting, if the server enforces one (a volume). A sandbox has none
    /// here: its disk is a filesystem of its quota's size, which refuses the write itself.
    fn space(&self) -> Option<&Space> {
        None
    }
    /// Called after a write, delete, mkdir or move changed `paths` (as the caller gave
    /// them), while the target's write gate is still held: a volume appends them to its
    /// commit log, against which runs detect conflicts.
    fn changed(&self, _paths: &[&str]) {}
    /// The answer for an agent error; a sandbox whose agent is gone or stopped answering
    /// is marked failed here.
    fn failed(
        &self,
        _app: &AppState,
        e: AgentClientError,
    ) -> impl Future<Output = ApiError> + Send {
        std::future::ready(e.into())
    }
}

/// `r`, with an agent error answered as the target says (see [`FilesTarget::failed`]).
pub(crate) async fn agent_result<T: FilesTarget, R>(
    app: &AppState,
    target: &T,
    r: Result<R, AgentClientError>,
) -> Result<R, ApiError> {
    match r {
        Ok(v) => Ok(v),
        Err(e) => Err(target.failed(app, e).await),
    }
}

impl FilesTarget for Busy {
    async fn resolve(app: &AppState, caller: &Caller, id: &str) -> Result<Self, ApiError> {
        crate::lifecycle::live_of(app, caller, id).await
    }
    fn agent(&self) -> &AgentClient {
        &self.machine.agent
    }
    async fn failed(&self, app: &AppState, e: AgentClientError) -> ApiError {
        crate::failed::check(app, self, e).await
    }
}

/// Bytes a directory entry is counted for: its size rounded up to 4 KiB blocks.
pub fn blocks_of(size: u64) -> i64 {
    size.div_ceil(4096)
        .saturating_mul(4096)
        .min(i64::MAX as u64) as i64
}

/// The size accounting of a tree whose writes go through the files API: a limit, the bytes
/// in use (allocated blocks, measured with a walk when the tree is opened and kept up to
/// date by every write and delete; exact to within a block per file), and the gate that
/// lets a snapshot see one consistent point.
#[derive(Debug)]
pub struct Space {
    /// The tree on the host (for a new walk after a recursive delete).
    pub root: PathBuf,
    /// What to call it in messages (`volume repo`).
    pub what: String,
    pub limit_bytes: u64,
    used: AtomicI64,
    /// Writes hold it shared; a snapshot or a fork holds it exclusively.
    pub gate: tokio::sync::RwLock<()>,
    /// The tree is no longer this server's (a volume moved to another server): writes that
    /// waited for the gate are refused.
    closed: std::sync::atomic::AtomicBool,
}

impl Space {
    pub fn new(root: PathBuf, what: String, limit_bytes: u64, used: u64) -> Self {
        Self {
            root,
            what,
            limit_bytes,
            used: AtomicI64::new(used as i64),
            gate: Default::default(),
            closed: Default::default(),
        }
    }

    /// Holds the gate shared for a write; refused (503) once the tree is [`closed`]
    /// (`Self::close`).
    pub async fn writing(&self) -> Result<tokio::sync::RwLockReadGuard<'_, ()>, ApiError> {
        let held = self.gate.read().await;
        if self.is_closed() {
            return Err(self.moved());
        }
        Ok(held)
    }

    /// Marks the tree as no longer this server's (with the gate held exclusively).
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The refusal of a write that waited while the tree moved away.
    pub fn moved(&self) -> ApiError {
        ApiError::unavailable(format!(
            "{} moved to another server of the fleet while this call waited: nothing was \
             written; call again (it goes to the new home)",
            self.what
        ))
    }

    /// Bytes in use now (including bytes of uploads in flight).
    pub fn used_bytes(&self) -> u64 {
        self.used.load(Ordering::Relaxed).max(0) as u64
    }

    pub(crate) fn add(&self, n: i64) -> i64 {
        self.used.fetch_add(n, Ordering::SeqCst) + n
    }

    /// Sets the bytes in use to a measured value.
    pub fn recount_to(&self, used: u64) {
        self.used.store(used as i64, Ordering::SeqCst);
    }

    /// Measures the tree again (after a delete whose size is unknown beforehand).
    pub async fn recount(&self) -> Result<(), ApiError> {
        let _all = self.gate.write().await;
        let root = self.root.clone();
        let n = tokio::task::spawn_blocking(move || locker_runtime::tree::allocated_bytes(&root))
            .await
            .map_err(|e| ApiError::internal(format!("measuring {}: {e}", self.what)))?
            .map_err(|e| ApiError::internal(format!("measuring {}: {e}", self.what)))?;
        self.used.store(n as i64, Ordering::SeqCst);
        Ok(())
    }

    pub(crate) fn full(&self, path: &str) -> ApiError {
        ApiError::too_large(format!(
            "{} is full: writing {path} would take it past its size_mb ({} MiB; {} bytes in use). \
             Delete files, or create a volume with a larger size_mb",
            self.what,
            self.limit_bytes >> 20,
            self.used_bytes()
        ))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PathQuery {
    path: Option<String>,
}

fn required(p: Option<String>) -> Result<String, ApiError> {
    let p = p.ok_or_else(|| {
        ApiError::bad_request("the `path` query parameter is required (an absolute path)")
    })?;
    check_path("path", &p)?;
    Ok(p)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetQuery {
    path: Option<String>,
    format: Option<String>,
}

async fn download<T: FilesTarget>(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<GetQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let path = required(q.path)?;
    let tar = files_tar::asked(q.format.as_deref(), &headers, header::ACCEPT)?;
    let target = T::resolve(&app, &caller, &id).await?;
    if tar {
        return files_tar::download(&app, target, &path).await;
    }
    let (entry, reader) = match target.agent().read_file(&path).await {
        Ok(v) => v,
        // Only on this error path: is it a directory, to say how to download one?
        Err(AgentClientError::Agent(e))
            if e.code == locker_proto::ErrorCode::BadRequest
                && target
                    .agent()
                    .stat(&path)
                    .await
                    .is_ok_and(|s| s.kind == EntryType::Dir) =>
        {
            return Err(files_tar::directory_hint(&path));
        }
        Err(e) => return Err(target.failed(&app, e).await),
    };
    if entry.kind == EntryType::Dir {
        return Err(files_tar::directory_hint(&path));
    }
    let stream = tokio_util::io::ReaderStream::with_capacity(reader, locker_proto::DATA_CHUNK)
        .map_ok(move |b| {
            // The target stays held (a sandbox busy) for as long as the body streams.
            let _ = &target;
            b
        });
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (
                header::HeaderName::from_static("x-locker-size"),
                entry.size.to_string(),
            ),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PutQuery {
    path: Option<String>,
    mode: Option<String>,
    format: Option<String>,
}

/// Parses an octal mode (`0644`, `644`, `0o644`).
fn parse_mode(m: &str) -> Result<u32, ApiError> {
    let digits = m.trim_start_matches("0o");
    u32::from_str_radix(digits, 8)
        .ok()
        .filter(|v| *v <= 0o7777)
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "`mode` must be octal permission bits like 0644, got {m:?}"
            ))
        })
}

/// Bytes the file at `path` is counted for now (0 when it is missing or not a file): what
/// overwriting it frees.
async fn counted(agent: &AgentClient, path: &str) -> i64 {
    match agent.stat(path).await {
        Ok(e) if e.kind == EntryType::File => blocks_of(e.size),
        _ => 0,
    }
}

async fn upload<T: FilesTarget>(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<PutQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let path = required(q.path)?;
    let mode = q.mode.as_deref().map(parse_mode).transpose()?;
    let tar = files_tar::asked(q.format.as_deref(), &headers, header::CONTENT_TYPE)?;
    if tar && mode.is_some() {
        return Err(ApiError::bad_request(
            "`mode` does not apply to a tar upload: each entry of the archive carries its own",
        ));
    }
    let target = T::resolve(&app, &caller, &id).await?;
    if tar {
        return files_tar::upload(&app, target, &path, &headers, body).await;
    }
    let agent = target.agent();
    let mut stream = body.into_data_stream().map_err(std::io::Error::other);
    let Some(space) = target.space() else {
        let r = agent
            .write_file(&path, mode, tokio_util::io::StreamReader::new(&mut stream))
            .await;
        if r.is_err() {
            // A full disk is answered while the client may still be sending: it should
            // read the 413, not a reset connection.
            drain(&mut stream).await;
        }
        return Ok(axum::Json(agent_result(&app, &target, r).await?).into_response());
    };
    let _writing = space.writing().await?;
    let old = counted(agent, &path).await;
    let limit = space.limit_bytes as i64;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared {
        if space.used_bytes() as i64 + blocks_of(len) - old > limit {
            drain(&mut stream).await;
            return Err(space.full(&path));
        }
    }
    // Bytes are reserved as they arrive, so parallel uploads cannot pass the limit together.
    let reserved = AtomicI64::new(0);
    let tripped = AtomicBool::new(false);
    let mut metered = stream.map(|chunk| {
        let chunk = chunk?;
        if tripped.load(Ordering::SeqCst) {
            return Ok(chunk); // being drained
        }
        let n = chunk.len() as i64;
        reserved.fetch_add(n, Ordering::SeqCst);
        if space.add(n) - old > limit {
            tripped.store(true, Ordering::SeqCst);
            return Err(std::io::Error::other("the volume's size limit was reached"));
        }
        Ok(chunk)
    });
    let result = agent
        .write_file(&path, mode, tokio_util::io::StreamReader::new(&mut metered))
        .await;
    let reserved = reserved.load(Ordering::SeqCst);
    match result {
        Ok(entry) => {
            space.add(blocks_of(entry.size) - reserved - old);
            target.changed(&[&path]);
            Ok(axum::Json(entry).into_response())
        }
        Err(e) => {
            space.add(-reserved);
            if tripped.load(Ordering::SeqCst) && matches!(e, AgentClientError::Input(_)) {
                drain(&mut metered).await;
                Err(space.full(&path))
            } else {
                Err(e.into())
            }
        }
    }
}

/// Reads and drops what is left of a refused upload (up to 64 MiB or 10 s), so the client,
/// still sending, reads the answer instead of a reset connection.
pub(crate) async fn drain<S, E>(stream: &mut S)
where
    S: futures_util::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
{
    let mut left: usize = 64 << 20;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while let Some(Ok(b)) = stream.next().await {
            left = left.saturating_sub(b.len());
            if left == 0 {
                break;
            }
        }
    })
    .await;
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveQuery {
    path: Option<String>,
    #[serde(default)]
    recursive: bool,
}

async fn remove<T: FilesTarget>(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<RemoveQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let path = required(q.path)?;
    if path == "/" {
        return Err(ApiError::bad_request("refusing to remove `/`"));
    }
    let target = T::resolve(&app, &caller, &id).await?;
    let agent = target.agent();
    let Some(space) = target.space() else {
        agent_result(&app, &target, agent.remove(&path, q.recursive).await).await?;
        return Ok(StatusCode::NO_CONTENT);
    };
    let writing = space.writing().await?;
    let before = agent.stat(&path).await?;
    agent.remove(&path, q.recursive).await?;
    target.changed(&[&path]);
    drop(writing);
    match before.kind {
        EntryType::Dir => space.recount().await?,
        EntryType::File => {
            space.add(-blocks_of(before.size));
        }
        _ => {}
    }
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    path: Option<String>,
    depth: Option<u32>,
}

async fn list<T: FilesTarget>(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let path = required(q.path)?;
    let depth = q.depth.unwrap_or(1);
    if !(1..=16).contains(&depth) {
        return Err(ApiError::bad_request("`depth` must be between 1 and 16"));
    }
    let target = T::resolve(&app, &caller, &id).await?;
    let entries = agent_result(&app, &target, target.agent().list(&path, depth).await).await?;
    Ok(entries_body(entries))
}

/// Entries serialized per this many while the body is sent, not all at once.
const ENTRIES_PER_CHUNK: usize = 512;

/// `{"entries": [...]}`, serialized chunk by chunk as the client reads it: a listing near
/// the bound (64 MiB of entries) is held once, not twice.
fn entries_body(entries: Vec<locker_types::Entry>) -> Response {
    if entries.len() <= ENTRIES_PER_CHUNK {
        return axum::Json(json!({ "entries": entries })).into_response();
    }
    let total = entries.len();
    let chunks = futures_util::stream::unfold(
        (entries.into_iter(), 0usize),
        move |(mut it, done)| async move {
            if done > total {
                return None;
            }
            let mut buf = Vec::with_capacity(64 << 10);
            if done == 0 {
                buf.extend_from_slice(b"{\"entries\":[");
            }
            let mut n = 0;
            for e in it.by_ref().take(ENTRIES_PER_CHUNK) {
                if done + n > 0 {
                    buf.push(b',');
                }
                serde_json::to_writer(&mut buf, &e).expect("an entry serializes");
                n += 1;
            }
            let done = done + n;
            if done == total {
                buf.extend_from_slice(b"]}");
                // One past the end: the next call ends the stream.
                return Some((
                    Ok::<_, std::convert::Infallible>(bytes::Bytes::from(buf)),
                    (it, total + 1),
                ));
            }
            Some((Ok(bytes::Bytes::from(buf)), (it, done)))
        },
    );
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(chunks),
    )
        .into_response()
}

async fn stat<T: FilesTarget>(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let path = required(q.path)?;
    let target = T::resolve(&app, &caller, &id).await?;
    let entry = agent_result(&app, &target, target.agent().stat(&path).await).await?;
    Ok(axum::Json(entry))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MkdirBody {
    path: String,
}

async fn mkdir<T: FilesTarget>(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(b): Json<MkdirBody>,
) -> Result<impl IntoResponse, ApiError> {
    check_path("path", &b.path)?;
    let target = T::resolve(&app, &caller, &id).await?;
    let agent = target.agent();
    let Some(space) = target.space() else {
        let entry = agent_result(&app, &target, agent.mkdir(&b.path).await).await?;
        return Ok(axum::Json(entry));
    };
    let _writing = space.writing().await?;
    let existed = agent.stat(&b.path).await.is_ok();
    if !existed && space.used_bytes() + 4096 > space.limit_bytes {
        return Err(space.full(&b.path));
    }
    let entry = agent.mkdir(&b.path).await?;
    if !existed {
        space.add(4096);
        target.changed(&[&b.path]);
    }
    Ok(axum::Json(entry))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveBody {
    from: String,
    to: String,
}

async fn rename<T: FilesTarget>(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(b): Json<MoveBody>,
) -> Result<impl IntoResponse, ApiError> {
    check_path("from", &b.from)?;
    check_path("to", &b.to)?;
    let target = T::resolve(&app, &caller, &id).await?;
    let agent = target.agent();
    let Some(space) = target.space() else {
        let entry = agent_result(&app, &target, agent.rename(&b.from, &b.to).await).await?;
        return Ok(axum::Json(entry));
    };
    let _writing = space.writing().await?;
    // A file moved over another frees the one it replaces.
    let replaced = if b.from == b.to {
        0
    } else {
        counted(agent, &b.to).await
    };
    let entry = agent.rename(&b.from, &b.to).await?;
    space.add(-replaced);
    target.changed(&[&b.from, &b.to]);
    Ok(axum::Json(entry))
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

    #[test]
    fn sizes_count_whole_blocks() {
        assert_eq!(super::blocks_of(0), 0);
        assert_eq!(super::blocks_of(1), 4096);
        assert_eq!(super::blocks_of(4096), 4096);
        assert_eq!(super::blocks_of(4097), 8192);
    }
}
