//! How the MCP server reaches Locker: its public HTTP API, nothing else.
//!
//! Owns the one seam between the tools and a Locker server. [`Api`] sends one request
//! (method, path, the caller's key, a body) and returns status and body. Two ways exist:
//! - [`HttpApi`]: over the network to `LOCKER_URL` (what `locker mcp` uses on stdio);
//! - [`TowerApi`]: through any tower service that speaks HTTP, such as `locker serve`'s own
//!   router: the same requests, paths, auth and answers, minus the socket.
//!
//! Must not know any tool: it moves bytes.

use std::future::Future;
use std::io::Read;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};

/// The most bytes of an answer read into memory (file reads, process output).
pub const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// A boxed future, as [`Api::send`] returns it.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One API request.
#[derive(Debug, Clone)]
pub struct ApiRequest {
    pub method: http::Method,
    /// Path and query, `/v1/…?…`, already percent-encoded.
    pub path: String,
    /// The caller's API key (sent as `Authorization: Bearer …`).
    pub key: Option<String>,
    pub content_type: Option<&'static str>,
    pub body: Bytes,
}

/// The answer: status and the whole body.
#[derive(Debug, Clone)]
pub struct ApiResponse {
    pub status: u16,
    pub body: Bytes,
}

/// The request did not get an answer.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("cannot reach the Locker server at {url}: {cause} (is `locker serve` running there? set LOCKER_URL)")]
    Unreachable { url: String, cause: String },
    #[error("the exchange with the Locker server broke: {0}")]
    Transport(String),
    #[error("the Locker server's answer is larger than {MAX_RESPONSE_BYTES} bytes")]
    TooLarge,
}

/// Something that answers Locker API requests.
pub trait Api: Send + Sync + 'static {
    fn send(&self, req: ApiRequest) -> BoxFuture<'_, Result<ApiResponse, ApiError>>;
    /// The Locker URL requests go to, when there is one (not in-process).
    fn base_url(&self) -> Option<&str> {
        None
    }
}

/// Locker over the network (plain HTTP, like the CLI).
pub struct HttpApi {
    base: String,
    agent: ureq::Agent,
}

impl HttpApi {
    /// `base` is `http://host:port` (a trailing slash is dropped).
    pub fn new(base: &str) -> Result<HttpApi, String> {
        let base = base.trim_end_matches('/').to_owned();
        if !base.starts_with("http://") || base.len() <= "http://".len() {
            return Err(format!(
                "LOCKER_URL {base:?} is not an http:// URL (for example http://127.0.0.1:7070)"
            ));
        }
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .max_redirects(0)
            .timeout_connect(Some(Duration::from_secs(10)))
            .user_agent(concat!("locker-mcp/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Ok(HttpApi { base, agent })
    }

    fn send_blocking(&self, req: ApiRequest) -> Result<ApiResponse, ApiError> {
        let url = format!("{}{}", self.base, req.path);
        let mut b = http::Request::builder().method(req.method).uri(&url);
        if let Some(k) = &req.key {
            b = b.header("Authorization", format!("Bearer {}", k.trim()));
        }
        if let Some(ct) = req.content_type {
            b = b.header("Content-Type", ct);
        }
        let request = b
            .body(req.body.to_vec())
            .map_err(|e| ApiError::Transport(e.to_string()))?;
        let mut resp = self.agent.run(request).map_err(|e| match e {
            ureq::Error::Io(io) => ApiError::Unreachable {
                url: self.base.clone(),
                cause: io.to_string(),
            },
            ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => ApiError::Unreachable {
                url: self.base.clone(),
                cause: e.to_string(),
            },
            other => ApiError::Transport(other.to_string()),
        })?;
        let status = resp.status().as_u16();
        let mut buf = Vec::new();
        resp.body_mut()
            .with_config()
            .limit(MAX_RESPONSE_BYTES as u64 + 1)
            .reader()
            .read_to_end(&mut buf)
            .map_err(|e| ApiError::Transport(format!("reading the answer: {e}")))?;
        if buf.len() > MAX_RESPONSE_BYTES {
            return Err(ApiError::TooLarge);
        }
        Ok(ApiResponse {
            status,
            body: buf.into(),
        })
    }
}

impl Api for std::sync::Arc<HttpApi> {
    fn base_url(&self) -> Option<&str> {
        Some(&self.base)
    }
    fn send(&self, req: ApiRequest) -> BoxFuture<'_, Result<ApiResponse, ApiError>> {
        let me = self.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || me.send_blocking(req))
                .await
                .map_err(|e| ApiError::Transport(format!("the request task failed: {e}")))?
        })
    }
}

/// Locker through a tower service that serves its HTTP API (in-process).
pub struct TowerApi<S> {
    svc: S,
}

impl<S> TowerApi<S> {
    pub fn new(svc: S) -> Self {
        TowerApi { svc }
    }
}

impl<S, B> Api for TowerApi<S>
where
    S: tower_service::Service<http::Request<Full<Bytes>>, Response = http::Response<B>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn send(&self, req: ApiRequest) -> BoxFuture<'_, Result<ApiResponse, ApiError>> {
        let mut svc = self.svc.clone();
        Box::pin(async move {
            let mut b = http::Request::builder()
                .method(req.method)
                .uri(&req.path)
                .header("Host", "localhost");
            if let Some(k) = &req.key {
                b = b.header("Authorization", format!("Bearer {}", k.trim()));
            }
            if let Some(ct) = req.content_type {
                b = b.header("Content-Type", ct);
            }
            let request = b
                .body(Full::new(req.body))
                .map_err(|e| ApiError::Transport(e.to_string()))?;
            std::future::poll_fn(|cx| svc.poll_ready(cx))
                .await
                .map_err(|e| ApiError::Transport(e.to_string()))?;
            let resp = svc
                .call(request)
                .await
                .map_err(|e| ApiError::Transport(e.to_string()))?;
            let status = resp.status().as_u16();
            let body = Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        ApiError::TooLarge
                    } else {
                        ApiError::Transport(format!("reading the answer: {e}"))
                    }
                })?
                .to_bytes();
            Ok(ApiResponse { status, body })
        })
    }
}
