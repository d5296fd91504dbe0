//! envd's `/files`: `GET` streams a file out of the machine (one byte range when asked,
//! gzip when the client accepts it), `POST` streams files in (multipart with one or several
//! files, or a raw `application/octet-stream` body, gzip-compressed or not). Nothing is
//! held whole in memory: bodies pass through in chunks, multipart is parsed as it streams,
//! and a gzip body is inflated a little at a time against [`MAX_INFLATED`] (gzip bombs end
//! in 413, the partial file is thrown away by the agent).
//!
//! Let through by the sandbox's access token, or by a `v1_` signature of the path, the
//! operation, the user and (optionally) an expiry (`download_url()`/`upload_url()`).
//! Errors are E2B's REST shape `{"code": <status>, "message": …}`.

use std::io::Write;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, Bytes, BytesMut};
use futures_util::StreamExt;
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::{check_user, resolve_path};
use crate::auth::constant_time_eq;
use crate::e2b::{E2bError, Target};
use crate::error::ApiError;
use crate::lifecycle::live_of;
use crate::state::{AppState, Busy};

/// The most bytes a gzip upload may inflate to (per request).
pub const MAX_INFLATED: u64 = 1 << 30;
/// The most files one multipart upload may carry.
const MAX_PARTS: usize = 1000;
/// The longest header block of a multipart part.
const MAX_PART_HEADERS: usize = 16 << 10;

struct Query {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    expiration: Option<String>,
}

fn query(req: &Request) -> Query {
    parse_query(req.uri().query().unwrap_or(""))
}

fn parse_query(raw: &str) -> Query {
    let mut q = Query {
        path: None,
        username: None,
        signature: None,
        expiration: None,
    };
    for (k, v) in form_urlencoded::parse(raw.as_bytes()) {
        let v = Some(v.into_owned());
        match &*k {
            "path" => q.path = v,
            "username" => q.username = v,
            "signature" => q.signature = v,
            "signature_expiration" => q.expiration = v,
            _ => {}
        }
    }
    q
}

/// The `v1_` signature of a file URL (`e2b/sandbox/signature.py`).
fn signature(path: &str, op: &str, user: &str, token: &str, expiration: Option<&str>) -> String {
    let raw = match expiration {
        None => format!("{path}:{op}:{user}:{token}"),
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    let b64 = locker_types::base64::encode(&digest);
    format!("v1_{}", b64.trim_end_matches('='))
}

/// The sandbox a signed `/files` URL without routing headers is for (the SDKs build signed
/// URLs on `E2B_SANDBOX_URL` when it is set, with neither the sandbox's id nor its token):
/// the one whose access token the signature was made with. Expiry is checked afterwards,
/// with the rest of the access check, so an expired URL is answered 401 by its sandbox.
pub(super) async fn sandbox_of_signature(
    app: &AppState,
    method: &axum::http::Method,
    raw_query: &str,
) -> Option<String> {
    let tokens: Vec<(String, String)> = {
        let live = app.live.read().await;
        live.values()
            .map(|l| {
                (
                    l.id.clone(),
                    l.preview.read().expect("preview lock").token.clone(),
                )
            })
            .collect()
    };
    signed_by(method, raw_query, tokens)
}

/// Which of `tokens` (sandbox, access token) signed a `/files` URL's query (`None`: none,
/// or no signature).
pub(crate) fn signed_by(
    method: &axum::http::Method,
    raw_query: &str,
    tokens: impl IntoIterator<Item = (String, String)>,
) -> Option<String> {
    let q = parse_query(raw_query);
    let sig = q.signature?;
    let op = if method == axum::http::Method::GET {
        "read"
    } else {
        "write"
    };
    tokens
        .into_iter()
        .find(|(_, token)| {
            !token.is_empty() && {
                let want = signature(
                    q.path.as_deref().unwrap_or(""),
                    op,
                    q.username.as_deref().unwrap_or(""),
                    token,
                    q.expiration.as_deref(),
                );
                constant_time_eq(sig.as_bytes(), want.as_bytes())
            }
        })
        .map(|(id, _)| id)
}

fn check_access(t: &Target, q: &Query, op: &str) -> Result<(), E2bError> {
    if t.authorized {
        return Ok(());
    }
    let Some(sig) = &q.signature else {
        return Err(E2bError::unauthorized(
            "missing or wrong X-Access-Token: use the sandbox's envdAccessToken, or a signed URL",
        ));
    };
    let token = t.live.preview.read().expect("preview lock").token.clone();
    if token.is_empty() {
        return Err(E2bError::unauthorized(
            "this sandbox has no access token to sign with",
        ));
    }
    if let Some(e) = &q.expiration {
        let at: i64 = e
            .parse()
            .map_err(|_| E2bError::bad_request("signature_expiration must be a Unix time"))?;
        if at < crate::state::now_s() {
            return Err(E2bError::unauthorized("signature is already expired"));
        }
    }
    let want = signature(
        q.path.as_deref().unwrap_or(""),
        op,
        q.username.as_deref().unwrap_or(""),
        &token,
        q.expiration.as_deref(),
    );
    if constant_time_eq(sig.as_bytes(), want.as_bytes()) {
        Ok(())
    } else {
        Err(E2bError::unauthorized(format!(
            "the signature does not match this path, {op} and user"
        )))
    }
}

fn user_of(q: &Query, t: &Target) -> Result<String, E2bError> {
    match q.username.as_deref() {
        None | Some("") => Ok(super::default_user(&t.live.id)),
        Some(u) => {
            check_user(u).map_err(E2bError::bad_request)?;
            Ok(u.into())
        }
    }
}

pub(super) async fn serve(app: AppState, t: Target, req: Request) -> Response {
    let r = match *req.method() {
        Method::GET => download(app, t, req).await,
        Method::POST => upload(app, t, req).await,
        _ => Err(E2bError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "/files takes GET or POST",
        )),
    };
    r.unwrap_or_else(IntoResponse::into_response)
}

/// Locker's failures in E2B's shape; a missing path reads as envd says it.
fn agent_error(e: ApiError, path: &str) -> E2bError {
    if e.status == StatusCode::NOT_FOUND {
        return E2bError::not_found(format!("path '{path}' does not exist"));
    }
    if e.status == StatusCode::PAYLOAD_TOO_LARGE {
        return E2bError::new(StatusCode::INSUFFICIENT_STORAGE, e.message);
    }
    e.into()
}

async fn busy(app: &AppState, t: &Target) -> Result<Busy, E2bError> {
    Ok(live_of(app, &t.caller, &t.live.id).await?)
}

/// A single byte range of a file of `size` bytes: `(start, end inclusive)`; `Err` when it
/// cannot be satisfied; `None` for a header this server does not serve (then the whole file).
fn range(h: &HeaderMap, size: u64) -> Option<Result<(u64, u64), ()>> {
    let v = h.get(header::RANGE)?.to_str().ok()?.trim();
    let spec = v.strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    let r = if a.is_empty() {
        let n: u64 = b.parse().ok()?;
        if n == 0 || size == 0 {
            return Some(Err(()));
        }
        (size.saturating_sub(n), size - 1)
    } else {
        let start: u64 = a.parse().ok()?;
        let end = if b.is_empty() {
            size.saturating_sub(1)
        } else {
            b.parse::<u64>().ok()?.min(size.saturating_sub(1))
        };
        if start >= size || end < start {
            return Some(Err(()));
        }
        (start, end)
    };
    Some(Ok(r))
}

fn accepts_gzip(h: &HeaderMap) -> bool {
    h.get_all(header::ACCEPT_ENCODING).iter().any(|v| {
        v.to_str().unwrap_or("").split(',').any(|p| {
            let mut it = p.split(';');
            let name = it.next().unwrap_or("").trim();
            let q0 = it.any(|x| matches!(x.trim(), "q=0" | "q=0.0" | "q=0.00" | "q=0.000"));
            name.eq_ignore_ascii_case("gzip") && !q0
        })
    })
}

async fn download(app: AppState, t: Target, req: Request) -> Result<Response, E2bError> {
    let q = query(&req);
    check_access(&t, &q, "read")?;
    let user = user_of(&q, &t)?;
    let raw = q.path.clone().unwrap_or_default();
    if raw.is_empty() {
        return Err(E2bError::bad_request("`path` is required"));
    }
    let path = resolve_path(&user, &raw).map_err(E2bError::bad_request)?;
    let live = busy(&app, &t).await?;
    let agent = live.machine.agent.clone();
    let r = agent.read_file(&path).await;
    let (entry, mut reader) = crate::failed::result(&app, &live, r)
        .await
        .map_err(|e| agent_error(e, &path))?;
    let size = entry.size;
    let wanted = range(req.headers(), size);
    if let Some(Err(())) = wanted {
        let mut resp = E2bError::new(
            StatusCode::RANGE_NOT_SATISFIABLE,
            format!("the range is outside the file's {size} bytes"),
        )
        .into_response();
        if let Ok(v) = HeaderValue::from_str(&format!("bytes */{size}")) {
            resp.headers_mut().insert(header::CONTENT_RANGE, v);
        }
        return Ok(resp);
    }
    let span = wanted.and_then(Result::ok);
    let gzip = span.is_none() && accepts_gzip(req.headers());
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::spawn(async move {
        let _live = live;
        let (mut skip, mut left) = match span {
            Some((a, b)) => (a, b - a + 1),
            None => (0, u64::MAX),
        };
        let mut gz =
            gzip.then(|| flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        loop {
            let chunk = match reader.next_chunk().await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => {
                    let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                    return;
                }
            };
            let mut c = &chunk[..];
            if skip > 0 {
                let n = skip.min(c.len() as u64) as usize;
                skip -= n as u64;
                c = &c[n..];
            }
            let n = left.min(c.len() as u64) as usize;
            left -= n as u64;
            let c = &c[..n];
            let out = match &mut gz {
                Some(g) => {
                    let _ = g.write_all(c);
                    std::mem::take(g.get_mut())
                }
                None => c.to_vec(),
            };
            if !out.is_empty() && tx.send(Ok(out.into())).await.is_err() {
                return;
            }
            if left == 0 {
                break;
            }
        }
        if let Some(g) = gz {
            if let Ok(rest) = g.finish() {
                let _ = tx.send(Ok(rest.into())).await;
            }
        }
    });
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (b, rx))
    }));
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    let name = entry.name.replace(['"', '\\', '\r', '\n'], "_");
    if let Ok(v) = HeaderValue::from_str(&format!("inline; filename=\"{name}\"")) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if gzip {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    match span {
        Some((a, b)) => {
            *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
            let h = resp.headers_mut();
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(b - a + 1));
            if let Ok(v) = HeaderValue::from_str(&format!("bytes {a}-{b}/{size}")) {
                h.insert(header::CONTENT_RANGE, v);
            }
        }
        None if !gzip => {
            resp.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(size));
        }
        None => {}
    }
    Ok(resp)
}

/// Chunks of a file on their way to the machine (an error aborts the write).
type Chunks = mpsc::Sender<Result<Bytes, std::io::Error>>;
/// A file write in the machine, answering the file's entry.
type WriteTask =
    tokio::task::JoinHandle<Result<locker_types::Entry, locker_runtime::agent::AgentClientError>>;

/// Writes one file, given `metadata`, from chunks sent on the returned sender; the task
/// answers its entry.
fn start_write(
    agent: locker_runtime::agent::AgentClient,
    path: String,
    metadata: Metadata,
) -> (Chunks, WriteTask) {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    let reader = channel_reader(rx);
    let task = tokio::spawn(async move {
        agent
            .write_file_with_metadata(&path, None, metadata, reader)
            .await
    });
    (tx, task)
}

/// A file's user metadata (envd's `X-Metadata-*` upload headers; extended attributes in the
/// `user.e2b.` namespace in the machine).
pub(super) type Metadata = std::collections::BTreeMap<String, String>;

/// The namespace metadata keys are stored under, counted against [`MAX_METADATA`].
const METADATA_PREFIX: &str = "user.e2b.";
/// The most bytes of metadata on one file (keys with the prefix, and values), as envd.
const MAX_METADATA: usize = 4096;

/// The metadata an upload gives its files: each `X-Metadata-<key>: <value>` header, the key
/// lowercased, the first value of a repeated key; checked as envd checks it (printable
/// US-ASCII, keys of 1 to 246 bytes, 4096 bytes in all counting the prefix per key).
pub(super) fn metadata_of(h: &HeaderMap) -> Result<Metadata, E2bError> {
    let mut out = Metadata::new();
    let mut total = 0usize;
    for (name, value) in h {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else {
            continue;
        };
        if out.contains_key(key) {
            continue;
        }
        let max_key = 255 - METADATA_PREFIX.len();
        if key.is_empty() || key.len() > max_key {
            return Err(E2bError::bad_request(format!(
                "metadata key {key:?}: keys are 1 to {max_key} bytes"
            )));
        }
        let v = value
            .to_str()
            .ok()
            .filter(|v| v.bytes().all(|b| (0x20..=0x7e).contains(&b)))
            .ok_or_else(|| {
                E2bError::bad_request(format!(
                    "metadata value of {key:?}: values are printable US-ASCII"
                ))
            })?;
        total += METADATA_PREFIX.len() + key.len() + v.len();
        if total > MAX_METADATA {
            return Err(E2bError::bad_request(format!(
                "metadata over {MAX_METADATA} bytes (keys with the `{METADATA_PREFIX}` prefix, and \
                 values)"
            )));
        }
        out.insert(key.to_owned(), v.to_owned());
    }
    Ok(out)
}

/// The bytes sent on `rx` as a reader (an error sent ends it with that error).
pub(super) fn channel_reader(
    rx: mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> impl tokio::io::AsyncRead + Unpin + Send {
    tokio_util::io::StreamReader::new(Box::pin(futures_util::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|b| (b, rx)) },
    )))
}

/// Inflates gzip a little at a time, counting against [`MAX_INFLATED`].
struct Inflate {
    dec: flate2::write::GzDecoder<Vec<u8>>,
    total: u64,
}

impl Inflate {
    fn new() -> Self {
        Self {
            dec: flate2::write::GzDecoder::new(Vec::new()),
            total: 0,
        }
    }

    /// Feeds compressed bytes in 4 KiB steps (so one step inflates to a few MiB at most)
    /// and hands each step's output to `out`.
    async fn feed(
        &mut self,
        mut data: &[u8],
        out: &mpsc::Sender<Result<Bytes, std::io::Error>>,
    ) -> Result<(), E2bError> {
        while !data.is_empty() {
            let n = data.len().min(4096);
            self.dec.write_all(&data[..n]).map_err(|e| {
                E2bError::bad_request(format!("the gzip body is not valid gzip: {e}"))
            })?;
            data = &data[n..];
            self.flush_out(out).await?;
        }
        Ok(())
    }

    async fn flush_out(
        &mut self,
        out: &mpsc::Sender<Result<Bytes, std::io::Error>>,
    ) -> Result<(), E2bError> {
        let chunk = std::mem::take(self.dec.get_mut());
        self.total += chunk.len() as u64;
        if self.total > MAX_INFLATED {
            let _ = out
                .send(Err(std::io::Error::other(
                    "gzip body inflates past the limit",
                )))
                .await;
            return Err(E2bError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the gzip body inflates to more than {} GiB",
                    MAX_INFLATED >> 30
                ),
            ));
        }
        if !chunk.is_empty() {
            let _ = out.send(Ok(chunk.into())).await;
        }
        Ok(())
    }

    async fn finish(
        mut self,
        out: &mpsc::Sender<Result<Bytes, std::io::Error>>,
    ) -> Result<(), E2bError> {
        self.dec
            .try_finish()
            .map_err(|e| E2bError::bad_request(format!("the gzip body is truncated: {e}")))?;
        self.flush_out(out).await
    }
}

fn content_encoding_gzip(h: &HeaderMap) -> Result<bool, E2bError> {
    match h
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
    {
        None | Some("") | Some("identity") => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("gzip") => Ok(true),
        Some(v) => Err(E2bError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("Content-Encoding {v:?}: uploads take gzip or none"),
        )),
    }
}

async fn upload(app: AppState, t: Target, req: Request) -> Result<Response, E2bError> {
    let q = query(&req);
    check_access(&t, &q, "write")?;
    let user = user_of(&q, &t)?;
    let gzip = content_encoding_gzip(req.headers())?;
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mt = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let metadata = metadata_of(req.headers())?;
    let live = busy(&app, &t).await?;
    let written = if mt == "multipart/form-data" {
        let boundary = ct
            .split(';')
            .skip(1)
            .filter_map(|p| p.trim().split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
            .map(|(_, v)| v.trim().trim_matches('"').to_owned())
            .filter(|b| !b.is_empty() && b.len() <= 200)
            .ok_or_else(|| E2bError::bad_request("multipart/form-data without a boundary"))?;
        let path = match q.path.as_deref() {
            None | Some("") => None,
            Some(p) => Some(resolve_path(&user, p).map_err(E2bError::bad_request)?),
        };
        let to = Dest {
            user: &user,
            path,
            metadata: &metadata,
        };
        multipart(&app, &live, to, &boundary, gzip, req.into_body()).await?
    } else if mt == "application/octet-stream" || mt.is_empty() {
        let raw = q.path.clone().unwrap_or_default();
        if raw.is_empty() {
            return Err(E2bError::bad_request(
                "`path` is required for an octet-stream upload",
            ));
        }
        let path = resolve_path(&user, &raw).map_err(E2bError::bad_request)?;
        let made = super::missing_dirs(&live.machine.agent, &path, false).await;
        let (tx, task) = start_write(live.machine.agent.clone(), path.clone(), metadata);
        let mut body = req.into_body().into_data_stream();
        let mut inflate = gzip.then(Inflate::new);
        let fed: Result<(), E2bError> = async {
            while let Some(chunk) = body.next().await {
                let chunk =
                    chunk.map_err(|e| E2bError::bad_request(format!("reading the body: {e}")))?;
                match &mut inflate {
                    Some(i) => i.feed(&chunk, &tx).await?,
                    None => {
                        if tx.send(Ok(chunk)).await.is_err() {
                            break;
                        }
                    }
                }
            }
            if let Some(i) = inflate {
                i.finish(&tx).await?;
            }
            Ok(())
        }
        .await;
        if let Err(e) = fed {
            let _ = tx.send(Err(std::io::Error::other(e.message.clone()))).await;
            drop(tx);
            let _ = task.await;
            return Err(e);
        }
        drop(tx);
        let entry = finish_write(&app, &live, task, &path).await?;
        own(&app, &live, &user, &made, &path).await?;
        vec![entry]
    } else {
        return Err(E2bError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "Content-Type {mt:?}: upload with multipart/form-data or application/octet-stream"
            ),
        ));
    };
    let list: Vec<_> = written.iter().map(written_json).collect();
    Ok(axum::Json(list).into_response())
}

/// A written file as envd's upload answers it (`EntryInfo` of its REST API).
pub(super) fn written_json(e: &locker_types::Entry) -> serde_json::Value {
    let mut v = json!({"name": e.name, "type": "file", "path": e.path});
    if !e.metadata.is_empty() {
        v["metadata"] = json!(e.metadata);
    }
    v
}

/// envd's `ComposeRequest`.
#[derive(serde::Deserialize)]
struct Compose {
    source_paths: Vec<String>,
    destination: String,
    #[serde(default)]
    username: Option<String>,
}

/// The most source files one compose may join.
const MAX_COMPOSE_SOURCES: usize = 1000;

/// `POST /files/compose`: the source files joined in order into the destination (written
/// whole or not at all, as every write), then the sources removed (a source that is also
/// the destination stays, as the result). Answers the destination's `EntryInfo`. envd
/// joins by reflink where the filesystem can; the agent copies the bytes through, a
/// chunk at a time.
pub(super) async fn compose(app: AppState, t: Target, req: Request) -> Result<Response, E2bError> {
    let bytes = axum::body::to_bytes(req.into_body(), 4 << 20)
        .await
        .map_err(|e| E2bError::bad_request(format!("compose body: {e} (at most 4 MiB)")))?;
    let c: Compose = serde_json::from_slice(&bytes).map_err(|e| {
        E2bError::bad_request(format!(
            "compose body: {e}; send {{\"source_paths\": [...], \"destination\": \"...\"}}"
        ))
    })?;
    let user = match c.username.as_deref() {
        None | Some("") => super::default_user(&t.live.id),
        Some(u) => {
            check_user(u).map_err(E2bError::bad_request)?;
            u.to_owned()
        }
    };
    if c.source_paths.is_empty() || c.source_paths.len() > MAX_COMPOSE_SOURCES {
        return Err(E2bError::bad_request(format!(
            "`source_paths` must name 1 to {MAX_COMPOSE_SOURCES} files"
        )));
    }
    if c.destination.is_empty() {
        return Err(E2bError::bad_request("`destination` is required"));
    }
    let dest = resolve_path(&user, &c.destination).map_err(E2bError::bad_request)?;
    let sources = c
        .source_paths
        .iter()
        .map(|p| resolve_path(&user, p))
        .collect::<Result<Vec<_>, _>>()
        .map_err(E2bError::bad_request)?;
    let live = busy(&app, &t).await?;
    let agent = live.machine.agent.clone();
    // Every source is a file before anything is written.
    for src in &sources {
        let r = agent.stat(src).await;
        let e = crate::failed::result(&app, &live, r)
            .await
            .map_err(|e| agent_error(e, src))?;
        if e.kind != locker_types::EntryType::File {
            return Err(E2bError::bad_request(format!("path '{src}' is not a file")));
        }
    }
    let made = super::missing_dirs(&agent, &dest, false).await;
    let (tx, task) = start_write(agent.clone(), dest.clone(), Metadata::new());
    let fed: Result<(), E2bError> = async {
        for src in &sources {
            let r = agent.read_file(src).await;
            let (_, mut reader) = crate::failed::result(&app, &live, r)
                .await
                .map_err(|e| agent_error(e, src))?;
            loop {
                match reader.next_chunk().await {
                    Ok(Some(c)) => {
                        if tx.send(Ok(c.into())).await.is_err() {
                            return Ok(());
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        return Err(E2bError::new(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            format!("reading '{src}': {e}"),
                        ))
                    }
                }
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = fed {
        let _ = tx.send(Err(std::io::Error::other(e.message.clone()))).await;
        drop(tx);
        let _ = task.await;
        return Err(e);
    }
    drop(tx);
    let entry = finish_write(&app, &live, task, &dest).await?;
    own(&app, &live, &user, &made, &dest).await?;
    for src in sources.iter().filter(|s| **s != dest) {
        match agent.remove(src, false).await {
            Ok(()) => {}
            Err(locker_runtime::agent::AgentClientError::Agent(e))
                if e.code == locker_proto::ErrorCode::NotFound => {}
            Err(e) => {
                let e = crate::failed::check(&app, &live, e).await;
                return Err(agent_error(e, src));
            }
        }
    }
    Ok(axum::Json(written_json(&entry)).into_response())
}

async fn finish_write(
    app: &AppState,
    live: &Busy,
    task: WriteTask,
    path: &str,
) -> Result<locker_types::Entry, E2bError> {
    let r = task.await.map_err(|e| {
        E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the write task failed: {e}"),
        )
    })?;
    crate::failed::result(app, live, r)
        .await
        .map_err(|e| agent_error(e, path))
}

/// Gives a written file and the directories made for it to the call's user.
async fn own(
    app: &AppState,
    live: &Busy,
    user: &str,
    made: &[String],
    file: &str,
) -> Result<(), E2bError> {
    let mut paths = made.to_vec();
    paths.push(file.to_owned());
    let r = super::give_to(&live.machine.agent, user, &paths).await;
    crate::failed::result(app, live, r)
        .await
        .map_err(|e| agent_error(e, file))
}

/// Where a multipart upload's files go: as `user`, to `path` (one file) or each part's
/// filename, with `metadata`.
struct Dest<'a> {
    user: &'a str,
    path: Option<String>,
    metadata: &'a Metadata,
}

/// Streams a multipart body: each part with a file goes to its own file (the `path`
/// query for a single file, else the part's filename, relative to the user's home).
async fn multipart(
    app: &AppState,
    live: &Busy,
    to: Dest<'_>,
    boundary: &str,
    gzip: bool,
    body: Body,
) -> Result<Vec<locker_types::Entry>, E2bError> {
    if gzip {
        return Err(E2bError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "a gzip body must be an application/octet-stream upload (as the SDKs send it)",
        ));
    }
    let Dest {
        user,
        path,
        metadata,
    } = to;
    let mut p = Parts {
        body: body.into_data_stream(),
        buf: BytesMut::new(),
        ended: false,
    };
    let open = format!("--{boundary}");
    let delim = format!("\r\n--{boundary}");
    // The preamble, up to the first boundary line.
    p.skip_until(open.as_bytes(), 64 << 10).await?;
    let mut written = Vec::new();
    loop {
        // After a boundary: `--` ends the body, CRLF starts a part.
        p.fill(2).await?;
        if p.buf.starts_with(b"--") {
            break;
        }
        if !p.buf.starts_with(b"\r\n") {
            return Err(E2bError::bad_request(
                "multipart: a boundary line must end with CRLF",
            ));
        }
        p.buf.advance(2);
        let headers = p.take_until(b"\r\n\r\n", MAX_PART_HEADERS).await?;
        let headers = String::from_utf8_lossy(&headers).into_owned();
        let filename = part_filename(&headers);
        if written.len() >= MAX_PARTS {
            return Err(E2bError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("multipart: more than {MAX_PARTS} files in one upload"),
            ));
        }
        let dest = match (&path, filename) {
            (Some(p), _) if written.is_empty() => p.clone(),
            (Some(_), _) => {
                return Err(E2bError::bad_request(
                    "`path` names one file: upload several files without it, each named by its filename",
                ))
            }
            (None, Some(f)) if !f.is_empty() => resolve_path(user, &f).map_err(E2bError::bad_request)?,
            (None, _) => {
                return Err(E2bError::bad_request(
                    "multipart: each part needs a filename (its destination path) when `path` is not given",
                ))
            }
        };
        let made = super::missing_dirs(&live.machine.agent, &dest, false).await;
        let (tx, task) = start_write(live.machine.agent.clone(), dest.clone(), metadata.clone());
        let streamed = p.stream_until(delim.as_bytes(), &tx).await;
        if let Err(e) = streamed {
            let _ = tx.send(Err(std::io::Error::other(e.message.clone()))).await;
            drop(tx);
            // The machine's own refusal (a directory there, a full disk) says more than
            // the end of the stream it then caused; a failure of the body stays its own.
            return Err(match finish_write(app, live, task, &dest).await {
                Err(agent) if !agent.status.is_server_error() => agent,
                _ => e,
            });
        }
        drop(tx);
        written.push(finish_write(app, live, task, &dest).await?);
        own(app, live, user, &made, &dest).await?;
    }
    if written.is_empty() {
        return Err(E2bError::bad_request("multipart: the body holds no file"));
    }
    Ok(written)
}

/// `filename="…"` of a part's `Content-Disposition`.
fn part_filename(headers: &str) -> Option<String> {
    let line = headers
        .split("\r\n")
        .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))?;
    let i = line.find("filename=")?;
    let rest = &line[i + "filename=".len()..];
    let name = if let Some(r) = rest.strip_prefix('"') {
        r.split('"').next().unwrap_or("")
    } else {
        rest.split(';').next().unwrap_or("").trim()
    };
    Some(
        name.replace("%22", "\"")
            .replace("%0D", "\r")
            .replace("%0A", "\n"),
    )
}

struct Parts {
    body: axum::body::BodyDataStream,
    buf: BytesMut,
    ended: bool,
}

impl Parts {
    async fn more(&mut self) -> Result<bool, E2bError> {
        if self.ended {
            return Ok(false);
        }
        match self.body.next().await {
            Some(Ok(c)) => {
                self.buf.extend_from_slice(&c);
                Ok(true)
            }
            Some(Err(e)) => Err(E2bError::bad_request(format!("reading the body: {e}"))),
            None => {
                self.ended = true;
                Ok(false)
            }
        }
    }

    async fn fill(&mut self, n: usize) -> Result<(), E2bError> {
        while self.buf.len() < n {
            if !self.more().await? {
                return Err(E2bError::bad_request(
                    "multipart: the body ends before its closing boundary",
                ));
            }
        }
        Ok(())
    }

    fn find(&self, pat: &[u8]) -> Option<usize> {
        self.buf.windows(pat.len()).position(|w| w == pat)
    }

    /// Drops bytes up to and including `pat` (at most `limit` before it).
    async fn skip_until(&mut self, pat: &[u8], limit: usize) -> Result<(), E2bError> {
        loop {
            if let Some(i) = self.find(pat) {
                self.buf.advance(i + pat.len());
                return Ok(());
            }
            if self.buf.len() > limit {
                return Err(E2bError::bad_request(
                    "multipart: no boundary where one was expected",
                ));
            }
            if !self.more().await? {
                return Err(E2bError::bad_request(
                    "multipart: the body holds no boundary",
                ));
            }
        }
    }

    /// The bytes up to `pat` (consumed with it), at most `limit` of them.
    async fn take_until(&mut self, pat: &[u8], limit: usize) -> Result<Bytes, E2bError> {
        loop {
            if let Some(i) = self.find(pat) {
                let out = self.buf.split_to(i).freeze();
                self.buf.advance(pat.len());
                return Ok(out);
            }
            if self.buf.len() > limit {
                return Err(E2bError::bad_request(
                    "multipart: a part's headers are too long",
                ));
            }
            if !self.more().await? {
                return Err(E2bError::bad_request(
                    "multipart: the body ends inside a part's headers",
                ));
            }
        }
    }

    /// Sends the bytes up to `pat` on `out` as they come, then consumes `pat`.
    async fn stream_until(
        &mut self,
        pat: &[u8],
        out: &mpsc::Sender<Result<Bytes, std::io::Error>>,
    ) -> Result<(), E2bError> {
        loop {
            if let Some(i) = self.find(pat) {
                let chunk = self.buf.split_to(i).freeze();
                self.buf.advance(pat.len());
                if !chunk.is_empty() {
                    let _ = out.send(Ok(chunk)).await;
                }
                return Ok(());
            }
            // Everything but a tail that may hold the start of the delimiter can go.
            let keep = pat.len() - 1;
            if self.buf.len() > keep {
                let chunk = self.buf.split_to(self.buf.len() - keep).freeze();
                if out.send(Ok(chunk)).await.is_err() {
                    return Err(E2bError::new(
                        StatusCode::BAD_GATEWAY,
                        "the machine stopped taking the file",
                    ));
                }
            }
            if !self.more().await? {
                return Err(E2bError::bad_request(
                    "multipart: the body ends inside a part",
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_depend_on_every_part() {
        // The SDK's own signatures are checked end to end (tests/e2b_envd.rs signs a URL
        // with Python's hashlib, as `e2b/sandbox/signature.py` does).
        let s = signature("/a", "read", "", "tok", None);
        assert!(s.starts_with("v1_") && !s.ends_with('='));
        assert_ne!(s, signature("/a", "write", "", "tok", None));
        assert_ne!(s, signature("/a", "read", "", "tok", Some("1")));
    }

    #[test]
    fn ranges_parse() {
        let mut h = HeaderMap::new();
        assert!(range(&h, 10).is_none());
        h.insert(header::RANGE, HeaderValue::from_static("bytes=2-4"));
        assert_eq!(range(&h, 10), Some(Ok((2, 4))));
        h.insert(header::RANGE, HeaderValue::from_static("bytes=-3"));
        assert_eq!(range(&h, 10), Some(Ok((7, 9))));
        h.insert(header::RANGE, HeaderValue::from_static("bytes=5-"));
        assert_eq!(range(&h, 10), Some(Ok((5, 9))));
        h.insert(header::RANGE, HeaderValue::from_static("bytes=10-"));
        assert_eq!(range(&h, 10), Some(Err(())));
    }

    #[test]
    fn filenames_come_from_the_disposition() {
        let h = "Content-Disposition: form-data; name=\"file\"; filename=\"/tmp/a b.txt\"\r\nContent-Type: text/plain";
        assert_eq!(part_filename(h).as_deref(), Some("/tmp/a b.txt"));
        assert_eq!(part_filename("Content-Type: x"), None);
    }
}
