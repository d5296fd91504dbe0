//! MCP servers inside a sandbox: a stdio MCP server started in the machine and served as
//! Streamable HTTP at `/v1/sandboxes/{id}/mcp/{name}`.
//!
//! Owns the routes (`POST|GET /v1/sandboxes/{id}/mcp`, `POST|GET|DELETE …/mcp/{name}`), the
//! sandbox's table of bridged servers ([`Servers`], held by its `Live`, so it dies with
//! the sandbox) and the rules of a server's life. Must not touch the agent's machinery
//! beyond the public background-process requests (Spawn, ProcessStdin, ProcessOutput,
//! SignalProcess): the process is an ordinary background process of the sandbox (listed by
//! `GET …/processes`), so it runs under the sandbox's cgroup, limits and egress policy and
//! dies with it. The bridge only carries traffic in; it gives the machine no way out.
//!
//! Sharing rule: one process per name, shared by every session. The bridge initializes the
//! process once and answers each session's `initialize` (or `server/discover`) with the
//! process's own answer; requests are forwarded with their JSON-RPC ids (and progress
//! tokens) rewritten, so answers go back to the session that asked; the server's
//! notifications go to every session-based client's GET stream. Why one process and not
//! one per session: MCP servers are stateful resources (a browser, a database connection,
//! a checkout) that an agent and its user both want to see, many are heavy to start
//! (`npx`, a browser), and a sandbox's memory is small; a process per session would
//! multiply both and make "the fs server" mean different things to different clients.
//! The cost: server-to-client requests (sampling, roots, elicitation) cannot be routed to
//! one client and are refused (ping is answered).
//!
//! `DELETE …/mcp/{name}` with an `Mcp-Session-Id` header ends that MCP session (the
//! Streamable HTTP rule); without one it stops the server.

mod session;
mod upstream;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use axum::Router;
use locker_mcp::rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use locker_mcp::rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use locker_types::ExecRequest;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::auth::Caller;
use crate::command::{build_spec, Wait};
use crate::error::ApiError;
use crate::extract::Json;
use crate::failed::result;
use crate::ids::{new_id, now_s};
use crate::lifecycle::live_of;
use crate::state::AppState;
use session::BridgeSession;
use upstream::Upstream;

/// Bridged servers per sandbox.
pub const MAX_SERVERS: usize = 16;
/// A request's deadline unless the server was started with `request_timeout_s`.
pub const DEFAULT_REQUEST_TIMEOUT_S: u64 = 300;
const MAX_REQUEST_TIMEOUT_S: u64 = 3600;
/// The largest request body one session may POST.
const MAX_BODY: usize = 16 << 20;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/mcp", post(start).get(list))
        .route("/v1/sandboxes/{id}/mcp/{name}", any(endpoint))
}

/// One bridged server.
struct Bridge {
    name: String,
    cmd: Vec<String>,
    started_at: String,
    up: Arc<Upstream>,
    http: StreamableHttpService<BridgeSession, LocalSessionManager>,
    /// Ends every open session of this server (their SSE streams close).
    sessions: CancellationToken,
}

/// The MCP servers of one sandbox.
#[derive(Default)]
pub struct Servers {
    map: Mutex<BTreeMap<String, Arc<Bridge>>>,
}

impl Servers {
    fn get(&self, name: &str) -> Option<Arc<Bridge>> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    fn take(&self, name: &str) -> Option<Arc<Bridge>> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
    }

    fn all(&self) -> Vec<Arc<Bridge>> {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

impl std::fmt::Debug for Servers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.all().iter().map(|b| b.name.clone()).collect();
        f.debug_struct("Servers").field("names", &names).finish()
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        // The sandbox is gone: its processes died with it; close the sessions.
        for b in self.all() {
            b.sessions.cancel();
        }
    }
}

fn check_name(name: &str) -> Result<(), ApiError> {
    if (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "MCP server name {name:?} is not valid: use 1-64 characters from a-z, 0-9, - and _"
        )))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartBody {
    name: String,
    cmd: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    /// How long one request may wait for the server's answer (default 300).
    request_timeout_s: Option<u64>,
}

fn base_url(headers: &HeaderMap) -> String {
    headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(|h| format!("http://{h}"))
        .unwrap_or_default()
}

fn describe(b: &Bridge, sandbox: &str, base: &str) -> Value {
    let gone = b.up.gone();
    let mut v = json!({
        "name": b.name,
        "url": format!("{base}/v1/sandboxes/{sandbox}/mcp/{}", b.name),
        "state": if gone.is_some() { "exited" } else { "running" },
        "cmd": b.cmd,
        "process_id": b.up.proc_id,
        "pid": b.up.pid,
        "started_at": b.started_at,
        "server_info": b.up.info().map(|i| &i.server_info),
        "dropped_lines": b.up.dropped.load(std::sync::atomic::Ordering::Relaxed),
    });
    if let Some(g) = gone {
        v["error"] = json!(b.up.explain(&g));
    }
    v
}

async fn start(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<StartBody>,
) -> Result<Response, ApiError> {
    check_name(&body.name)?;
    if body.cmd.is_empty() || body.cmd[0].is_empty() {
        return Err(ApiError::bad_request(
            "`cmd` must name a program: [\"npx\", \"-y\", \"@modelcontextprotocol/server-filesystem\", \"/workspace\"]",
        ));
    }
    let timeout_s = body.request_timeout_s.unwrap_or(DEFAULT_REQUEST_TIMEOUT_S);
    if !(1..=MAX_REQUEST_TIMEOUT_S).contains(&timeout_s) {
        return Err(ApiError::bad_request(format!(
            "`request_timeout_s` must be 1-{MAX_REQUEST_TIMEOUT_S}"
        )));
    }
    let live = live_of(&app, &caller, &id).await?;
    {
        let map = live.mcp.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = map.get(&body.name) {
            if b.up.gone().is_none() {
                return Err(ApiError::conflict(format!(
                    "an MCP server named {:?} already runs in {id}: DELETE /v1/sandboxes/{id}/mcp/{} first or pick another name",
                    body.name, body.name
                )));
            }
        }
        if map.len() >= MAX_SERVERS && !map.contains_key(&body.name) {
            return Err(ApiError::conflict(format!(
                "{id} already has {MAX_SERVERS} MCP servers: DELETE one first"
            )));
        }
    }
    let req = ExecRequest {
        cmd: Some(body.cmd.clone()),
        cwd: body.cwd.clone(),
        env: body.env.clone(),
        ..Default::default()
    };
    let (mut spec, _) = build_spec(&live.env, &req, &new_id("call_"), Wait::Background)?;
    spec.stdin = true;
    let agent = live.machine.agent.clone();
    let (proc_id, pid) = result(&app, &live, agent.spawn(spec).await).await?;
    let up = Upstream::attach(agent, proc_id, pid, Duration::from_secs(timeout_s));
    if let Err(e) = up.initialize().await {
        // Why the process is gone (its exit code and stderr) says more than the request's error.
        let why = up
            .gone()
            .map_or_else(|| e.message.to_string(), |g| up.explain(&g));
        up.shutdown().await;
        return Err(ApiError::bad_gateway(format!(
            "the MCP server {:?} did not complete the initialize handshake: {why}",
            body.name
        )));
    }
    let sessions = CancellationToken::new();
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_legacy_session_mode(true)
        .with_max_request_body_bytes(MAX_BODY)
        .with_cancellation_token(sessions.clone());
    let up2 = up.clone();
    let http = StreamableHttpService::new(
        move || Ok(BridgeSession { up: up2.clone() }),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let bridge = Arc::new(Bridge {
        name: body.name.clone(),
        cmd: body.cmd,
        started_at: locker_types::rfc3339(now_s()),
        up,
        http,
        sessions,
    });
    let replaced = {
        let mut map = live.mcp.map.lock().unwrap_or_else(|e| e.into_inner());
        match map.get(&body.name) {
            // Another start of the same name won the race while this one initialized.
            Some(b) if b.up.gone().is_none() => Some(bridge.clone()),
            _ => map.insert(body.name.clone(), bridge.clone()),
        }
    };
    if let Some(old) = replaced {
        old.sessions.cancel();
        if Arc::ptr_eq(&old, &bridge) {
            bridge.up.shutdown().await;
            return Err(ApiError::conflict(format!(
                "an MCP server named {:?} was started in {id} at the same time",
                body.name
            )));
        }
    }
    let v = describe(&bridge, &id, &base_url(&headers));
    Ok((StatusCode::CREATED, axum::Json(v)).into_response())
}

async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ApiError> {
    let live = live_of(&app, &caller, &id).await?;
    let base = base_url(&headers);
    let servers: Vec<Value> = live
        .mcp
        .all()
        .iter()
        .map(|b| describe(b, &id, &base))
        .collect();
    Ok(axum::Json(json!({ "servers": servers })))
}

/// The server itself: Streamable HTTP for MCP clients, or (DELETE without a session) stop.
async fn endpoint(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, name)): Path<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    let method = req.method().clone();
    if ![Method::POST, Method::GET, Method::DELETE].contains(&method) {
        return Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "an MCP server takes POST (messages), GET (its event stream) and DELETE",
        ));
    }
    let live = live_of(&app, &caller, &id).await?;
    let missing = || {
        ApiError::not_found(format!(
            "no MCP server named {name:?} in {id}: POST /v1/sandboxes/{id}/mcp starts one"
        ))
    };
    let session = req.headers().contains_key("mcp-session-id");
    if method == Method::DELETE && !session {
        let b = live.mcp.take(&name).ok_or_else(missing)?;
        b.sessions.cancel();
        b.up.shutdown().await;
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let b = live.mcp.get(&name).ok_or_else(missing)?;
    if let Some(g) = b.up.gone() {
        return Err(ApiError::bad_gateway(format!(
            "MCP server {name:?} is not running: {}; DELETE /v1/sandboxes/{id}/mcp/{name} and start it again",
            b.up.explain(&g)
        )));
    }
    let resp = b.http.handle(req).await;
    let (mut parts, body) = resp.into_parts();
    // rmcp answers a session's DELETE with 202; clients expect 200 or 204 (as `/mcp`).
    if method == Method::DELETE && parts.status == StatusCode::ACCEPTED {
        parts.status = StatusCode::NO_CONTENT;
    }
    let body = if method == Method::POST {
        // A POST's answer (maybe an SSE stream) is a call in flight until it ends, so the
        // idle policy does not pause the sandbox under a tool call. The GET stream is not:
        // an idle client must not keep the sandbox awake.
        let busy = live;
        let stream =
            futures_util::StreamExt::map(http_body_util::BodyDataStream::new(body), move |chunk| {
                let _held = &busy;
                chunk
            });
        Body::from_stream(stream)
    } else {
        Body::new(body)
    };
    Ok(Response::from_parts(parts, body))
}
