//! The router (`FLEET.md` §4.2 "Data plane"): a request about a sandbox placed on another
//! node goes to that node, whichever control replica it reached.
//!
//! [`dispatch`] runs before the API's handlers on a control plane (`--fleet-listen`):
//! - `POST /v1/sandboxes`: placed (`placement::place`) unless this server is no node and
//!   the fleet has none (then it creates as one host does), then made by the chosen node
//!   (forwarded, with the placement's id) or by this server when it is the node chosen
//!   (`--node local`); the placement records the sandbox's id. A create bound to this
//!   host's data (volumes, secrets, a snapshot) goes to this server's own node only;
//! - `/v1/sandboxes/{id}` and everything under it, for a sandbox with a placement: the
//!   caller's key is checked here, then the request goes to the sandbox's node over the
//!   node's HTTP/2 with mutual TLS (`fleet::node`; another replica's own node too, on its
//!   node listener), carrying the tenant and the epoch the sandbox was placed at; bodies
//!   stream both ways;
//! - anything else, and calls another replica routed to this server's node listener: this
//!   server's own handlers, as on one host.
//!
//! Routes are cached (`sandbox → node, address, epoch`); a miss reads the placement. A node
//! that answers that the route is stale (409 with `STALE_HEADER`) has the route read again
//! and the request sent once more, when its body was small enough to keep (1 MiB).
//!
//! A WebSocket (the PTY) goes to the node as a stream of the same HTTP/2 connection
//! (extended CONNECT, RFC 8441) and the two sides are joined byte for byte.
//!
//! Not routed yet: snapshots and forks of a remote sandbox (501, saying so); a browser's
//! terminal ticket (minted and redeemed on different servers); preview hosts and port
//! routes, the E2B and MCP surfaces (a remote sandbox is unknown there).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use locker_store::{PlacementRecord, PlacementState};
use serde_json::Value;

use super::node::{EPOCH_HEADER, PLACEMENT_HEADER, STALE_HEADER, TENANT_HEADER};
use super::pki;
use super::placement::{self, Ask};
use crate::error::ApiError;
use crate::state::AppState;

/// A body kept for a retry at most this big (the API's own body limit).
const KEEP_BODY: usize = 1 << 20;
/// How long a node may take to accept a connection, and to answer a create.
const CONNECT: Duration = Duration::from_secs(5);
const CREATE: Duration = Duration::from_secs(120);

/// Where a sandbox lives.
#[derive(Debug, Clone)]
struct Route {
    placement: String,
    tenant: String,
    node_id: String,
    address: String,
    epoch: i64,
    state: PlacementState,
    /// This server is its node (`--node local`).
    local: bool,
}

/// A node's connection, when one is open (its lock held while one is being made).
type Slot = Arc<tokio::sync::Mutex<Option<SendRequest<Body>>>>;

/// The router's state: the control plane's TLS towards nodes, a connection per node, the
/// route cache.
pub struct Routes {
    tls: Arc<rustls::ClientConfig>,
    /// A slot per node: connecting to one node (up to [`CONNECT`] for a dead one) holds only
    /// that node's slot, never the others'.
    links: Mutex<HashMap<String, Slot>>,
    cache: Mutex<HashMap<String, Route>>,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Routes(..)")
    }
}

impl Routes {
    pub fn new(tls: Arc<rustls::ClientConfig>) -> Routes {
        Routes {
            tls,
            links: Default::default(),
            cache: Default::default(),
        }
    }

    /// Drops a sandbox's cached route (it moved, was lost or ended).
    pub fn forget(&self, sandbox_id: &str) {
        self.cache.lock().expect("routes").remove(sandbox_id);
    }

    /// A connection to `node` (the one held, else a new one).
    async fn link(&self, node_id: &str, address: &str) -> Result<SendRequest<Body>, String> {
        let slot = self
            .links
            .lock()
            .expect("links")
            .entry(node_id.to_owned())
            .or_default()
            .clone();
        let mut held = slot.lock().await;
        if let Some(l) = held.as_ref() {
            if !l.is_closed() {
                return Ok(l.clone());
            }
        }
        let tcp = tokio::time::timeout(CONNECT, tokio::net::TcpStream::connect(address))
            .await
            .map_err(|_| format!("connecting to {address}: timed out"))?
            .map_err(|e| format!("connecting to {address}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let name = rustls::pki_types::ServerName::try_from(pki::node_name(node_id))
            .map_err(|e| e.to_string())?;
        let tls = tokio::time::timeout(
            CONNECT,
            tokio_rustls::TlsConnector::from(self.tls.clone()).connect(name, tcp),
        )
        .await
        .map_err(|_| format!("TLS with {address}: timed out"))?
        .map_err(|e| format!("TLS with {address}: {e}"))?;
        let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(Some(Duration::from_secs(10)))
            .keep_alive_timeout(Duration::from_secs(10))
            .handshake(TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP/2 with {address}: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        *held = Some(sender.clone());
        Ok(sender)
    }

    fn drop_link(&self, node_id: &str) {
        self.links.lock().expect("links").remove(node_id);
    }
}

/// The sandbox id a path is about (`/v1/sandboxes/{id}` and below).
fn sandbox_of(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/sandboxes/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// The volume (id or name) a path is about (`/v1/volumes/{id}` and below: its files, runs,
/// snapshots, fork, restore).
fn volume_of(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/volumes/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// A call about a volume whose files another control replica holds (`VolumeRecord::host`):
/// sent to that replica's node listener (`--node local`), once; a volume of this server,
/// or of none, is this server's to answer.
async fn volume_call(app: &AppState, volume: &str, req: Request, next: Next) -> Response {
    let Ok(caller) = crate::auth::caller_of(app, req.headers()) else {
        return next.run(req).await;
    };
    let (store, t, v) = (app.store.clone(), caller.tenant.clone(), volume.to_owned());
    let found = tokio::task::spawn_blocking(move || {
        let Some(r) = store.get_volume(&t, &v)? else {
            return Ok(None);
        };
        let node = store.get_node(&r.host)?;
        Ok::<_, locker_store::StoreError>(Some((r, node)))
    })
    .await;
    let (rec, node) = match found {
        Ok(Ok(Some(x))) => x,
        Ok(Ok(None)) => return next.run(req).await,
        Ok(Err(e)) => return ApiError::from(e).into_response(),
        Err(e) => return ApiError::internal(e.to_string()).into_response(),
    };
    if rec.host.is_empty() || rec.host == app.host_id {
        return next.run(req).await;
    }
    let alive = |n: &locker_store::NodeRecord| {
        n.state == locker_store::NodeState::Ready && n.cert_sha256 == super::local::LOCAL_CERT
    };
    let Some(n) = node.filter(alive) else {
        return ApiError::unavailable(format!(
            "volume {volume} lives on another server of the fleet ({}), which does not answer \
             as a node now (it runs with --node local when it can; retry when it is back)",
            rec.host
        ))
        .into_response();
    };
    let route = node_route(&n, &caller.tenant, n.epoch);
    let (parts, body) = req.into_parts();
    let body = match payload(&parts, body).await {
        Ok(Payload::Kept(b)) => Body::from(b),
        Ok(Payload::Stream(b)) => b,
        Err(r) => return r,
    };
    let c = app.fleet.as_ref().expect("fleet control");
    match send(c, &route, &parts, body, None).await {
        Ok(r) if r.status() == StatusCode::CONFLICT && r.headers().contains_key(STALE_HEADER) => {
            ApiError::unavailable(format!(
                "volume {volume}'s server {} just returned to the fleet: retry",
                rec.host
            ))
            .into_response()
        }
        Ok(r) => r,
        Err(e) => {
            c.routes.drop_link(&n.id);
            ApiError::bad_gateway(format!(
                "volume {volume}'s server {} did not answer: {e}",
                rec.host
            ))
            .into_response()
        }
    }
}

/// The middleware (see the module doc).
pub async fn dispatch(State(app): State<AppState>, req: Request, next: Next) -> Response {
    if app.fleet.is_none() || req.extensions().get::<super::node::Forwarded>().is_some() {
        // One host, or a call another replica routed to this server's node listener: this
        // server's own engine answers.
        return next.run(req).await;
    }
    let path = req.uri().path();
    if path == "/v1/sandboxes" && req.method() == Method::POST {
        return create(&app, req, next).await;
    }
    if let Some(v) = volume_of(path).map(str::to_owned) {
        return volume_call(&app, &v, req, next).await;
    }
    let Some(id) = sandbox_of(path).map(str::to_owned) else {
        return next.run(req).await;
    };
    // A sandbox this server runs is its own (no lookup on the hot path), unless it is being
    // deleted: then its placement, if it has one, is given back.
    let deleting = req.method() == Method::DELETE && path == format!("/v1/sandboxes/{id}");
    if !deleting && app.live.read().await.contains_key(&id) {
        return next.run(req).await;
    }
    let pty = req.uri().path() == format!("/v1/sandboxes/{id}/pty");
    let caller = match crate::auth::caller_of(&app, req.headers()) {
        Ok(c) => c,
        // A browser's terminal, with a ticket this server minted for a sandbox on another
        // node: redeemed here (its origin checked against this server's), then routed.
        // For this server's own sandboxes the handler redeems it.
        Err(_) if pty && crate::ui::has_ticket(req.headers()) => match route_of(&app, &id).await {
            Ok(Some(r)) if !r.local && r.state == PlacementState::Placed => {
                match crate::ui::pty_caller(&app, req.headers(), &id).await {
                    Ok(c) => c,
                    Err(e) => return e.into_response(),
                }
            }
            _ => return next.run(req).await,
        },
        // A caller without a good key gets the handlers' own answer.
        Err(_) => return next.run(req).await,
    };
    let route = match route_of(&app, &id).await {
        Ok(Some(r)) if r.tenant == caller.tenant => r,
        Ok(_) => return next.run(req).await,
        Err(e) => return e.into_response(),
    };
    let whole = req.uri().path() == format!("/v1/sandboxes/{id}");
    let method = req.method().clone();
    // A terminal ticket for a sandbox on another node is this server's to mint: the
    // browser's handshake comes here.
    if !route.local
        && route.state == PlacementState::Placed
        && method == Method::POST
        && req.uri().path() == format!("/v1/sandboxes/{id}/pty/ticket")
    {
        return crate::ui::ticket_answer(&app, caller, &id)
            .await
            .unwrap_or_else(IntoResponse::into_response);
    }
    if route.state == PlacementState::Lost {
        return lost(&app, &route, &id, whole, &method).await;
    }
    let resp = if route.local {
        next.run(req).await
    } else if let Some(what) = not_routed(req.uri().path(), &id) {
        ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!(
                "sandbox {id} runs on fleet node {}: {what} of a sandbox on a remote node are \
                 not supported yet (the control plane would not know what they made)",
                route.node_id
            ),
        )
        .into_response()
    } else {
        forward(&app, route.clone(), &id, req).await
    };
    if whole {
        after(&app, &route, &id, &method, resp).await
    } else {
        resp
    }
}

/// The calls about a remote sandbox that would make objects the control plane does not
/// know of (snapshots and forks live in the node's store): what they are, if `path` is one.
fn not_routed(path: &str, id: &str) -> Option<&'static str> {
    let rest = path.strip_prefix(&format!("/v1/sandboxes/{id}/"))?;
    match rest.split('/').next() {
        Some("fork") => Some("forks"),
        Some("snapshots") => Some("snapshots"),
        _ => None,
    }
}

/// What a sandbox's own path answered, kept: a delete gives the placement back, a view
/// refreshes the listed one.
async fn after(
    app: &AppState,
    route: &Route,
    id: &str,
    method: &Method,
    resp: Response,
) -> Response {
    if *method == Method::DELETE
        && (resp.status().is_success() || resp.status() == StatusCode::NOT_FOUND)
    {
        placement::unplace(app, &route.placement).await;
        return resp;
    }
    if route.local || !resp.status().is_success() || *method == Method::DELETE {
        return resp;
    }
    // Keep the view the list shows (small JSON bodies only).
    let (parts, body) = resp.into_parts();
    let bytes = match axum::body::to_bytes(body, KEEP_BODY).await {
        Ok(b) => b,
        Err(e) => return ApiError::bad_gateway(format!("the node's answer: {e}")).into_response(),
    };
    if serde_json::from_slice::<Value>(&bytes).is_ok_and(|v| v["id"] == id) {
        let (store, sb, view) = (
            app.store.clone(),
            id.to_owned(),
            String::from_utf8_lossy(&bytes).into_owned(),
        );
        let _ = tokio::task::spawn_blocking(move || store.set_placement_view(&sb, &view)).await;
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// A lost sandbox: its last view (state `lost`) on GET, its placement removed on DELETE,
/// 410 for anything else.
async fn lost(app: &AppState, route: &Route, id: &str, whole: bool, method: &Method) -> Response {
    if whole && *method == Method::DELETE {
        placement::unplace(app, &route.placement).await;
        return StatusCode::NO_CONTENT.into_response();
    }
    if whole && *method == Method::GET {
        let (store, sb) = (app.store.clone(), id.to_owned());
        if let Ok(Ok(Some(p))) = tokio::task::spawn_blocking(move || store.get_placement(&sb)).await
        {
            return axum::Json(view_of(&p)).into_response();
        }
    }
    ApiError::new(
        StatusCode::GONE,
        format!(
            "sandbox {id} was lost with its node ({}): the node was declared dead or removed; \
             delete it, and create another",
            route.node_id
        ),
    )
    .into_response()
}

/// A placed sandbox as lists show it: the view its node last answered, with the state a
/// lost one is in.
pub fn view_of(p: &PlacementRecord) -> Value {
    let mut v: Value = serde_json::from_str(&p.view).unwrap_or(Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.insert("node".into(), Value::String(p.node_id.clone()));
        if p.state == PlacementState::Lost {
            o.insert("state".into(), Value::String("lost".into()));
        }
    }
    v
}

/// The placed sandboxes of `tenant` on joined nodes, as lists show them (those of control
/// replicas' own nodes are rows of this store, listed as such).
pub fn remote_views(app: &AppState, tenant: &str) -> Result<Vec<Value>, ApiError> {
    if app.fleet.is_none() {
        return Ok(Vec::new());
    }
    let rows = placement::row_nodes(&app.store.list_nodes()?);
    Ok(app
        .store
        .list_placements(Some(tenant), None)?
        .into_iter()
        .filter(|p| p.sandbox_id.is_some() && !rows.contains(&p.node_id))
        .map(|p| view_of(&p))
        .collect())
}

/// The route of sandbox `id`: cached, else from its placement; `None` if it has none.
async fn route_of(app: &AppState, id: &str) -> Result<Option<Route>, ApiError> {
    let c = app.fleet.as_ref().expect("fleet control");
    if let Some(r) = c.routes.cache.lock().expect("routes").get(id) {
        return Ok(Some(r.clone()));
    }
    let (store, sb) = (app.store.clone(), id.to_owned());
    let found = tokio::task::spawn_blocking(move || {
        let Some(p) = store.get_placement(&sb)? else {
            return Ok(None);
        };
        let node = store.get_node(&p.node_id)?;
        Ok::<_, locker_store::StoreError>(Some((p, node)))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let Some((p, node)) = found else {
        return Ok(None);
    };
    let local = c.local_node_id();
    let route = Route {
        placement: p.id.clone(),
        tenant: p.tenant.clone(),
        node_id: p.node_id.clone(),
        address: node.as_ref().map(|n| n.address.clone()).unwrap_or_default(),
        epoch: p.epoch,
        state: p.state,
        local: Some(p.node_id.as_str()) == local.as_deref(),
    };
    if route.state == PlacementState::Placed {
        c.routes
            .cache
            .lock()
            .expect("routes")
            .insert(id.to_owned(), route.clone());
    }
    Ok(Some(route))
}

/// Headers a hop does not pass on (RFC 9110 §7.6.1), those only control may set, and a
/// browser's site headers (control checked them against its own origin; the node's host is
/// another).
fn strip(h: &mut HeaderMap) {
    for name in [
        header::ORIGIN,
        header::REFERER,
        header::CONNECTION,
        header::HOST,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::AUTHORIZATION,
    ] {
        h.remove(name);
    }
    for name in [
        "sec-fetch-site",
        "sec-fetch-mode",
        "sec-fetch-dest",
        "sec-fetch-user",
        "keep-alive",
        "proxy-connection",
        TENANT_HEADER,
        EPOCH_HEADER,
        STALE_HEADER,
        PLACEMENT_HEADER,
    ] {
        h.remove(name);
    }
}

/// A request's body: kept whole when small (so it can be sent twice), else streamed once.
enum Payload {
    Kept(bytes::Bytes),
    Stream(Body),
}

async fn payload(parts: &axum::http::request::Parts, body: Body) -> Result<Payload, Response> {
    let small = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .is_some_and(|n| n <= KEEP_BODY);
    let bodiless = matches!(
        parts.method,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
    ) && !parts.headers.contains_key(header::TRANSFER_ENCODING);
    if small || bodiless {
        axum::body::to_bytes(body, KEEP_BODY)
            .await
            .map(Payload::Kept)
            .map_err(|e| {
                ApiError::bad_request(format!("reading the request's body: {e}")).into_response()
            })
    } else {
        Ok(Payload::Stream(body))
    }
}

/// Sends a request to the sandbox's node; once more on a stale route (or a broken
/// connection) when its body was kept.
async fn forward(app: &AppState, mut route: Route, id: &str, mut req: Request) -> Response {
    let mut ws = match websocket_of(&mut req) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let (mut parts, body) = req.into_parts();
    // Only a kept body can be sent twice; a streamed one goes once, whatever happens.
    let (kept, mut stream) = match payload(&parts, body).await {
        Ok(Payload::Kept(b)) => (Some(b), None),
        Ok(Payload::Stream(b)) => (None, Some(b)),
        Err(r) => return r,
    };
    if ws.is_some() {
        // To the node, the same WebSocket as a stream of the HTTP/2 connection (RFC 8441).
        parts.method = Method::CONNECT;
        parts
            .extensions
            .insert(hyper::ext::Protocol::from_static("websocket"));
        parts.headers.remove(header::SEC_WEBSOCKET_KEY);
        parts.headers.remove(header::SEC_WEBSOCKET_EXTENSIONS);
    }
    let c = app.fleet.as_ref().expect("fleet control");
    for attempt in 0..2 {
        let body = match &kept {
            Some(b) => Body::from(b.clone()),
            None => stream.take().unwrap_or_else(Body::empty),
        };
        let retriable = kept.is_some() && attempt == 0;
        match send(c, &route, &parts, body, None).await {
            Ok(resp)
                if resp.status() == StatusCode::CONFLICT
                    && resp.headers().contains_key(STALE_HEADER) =>
            {
                // The node refused before doing anything: safe to send again.
                c.routes.forget(id);
                let fresh = match route_of(app, id).await {
                    Ok(Some(r)) if r.tenant == route.tenant => r,
                    Ok(_) => {
                        return ApiError::not_found(format!("sandbox {id} does not exist"))
                            .into_response()
                    }
                    Err(e) => return e.into_response(),
                };
                if fresh.state == PlacementState::Lost {
                    let whole = parts.uri.path() == format!("/v1/sandboxes/{id}");
                    return lost(app, &fresh, id, whole, &parts.method).await;
                }
                if !retriable || (fresh.node_id == route.node_id && fresh.epoch == route.epoch) {
                    return ApiError::unavailable(format!(
                        "sandbox {id}'s node {} refuses calls at epoch {}: it was declared dead \
                         and came back; the sandbox is being marked lost",
                        route.node_id, route.epoch
                    ))
                    .into_response();
                }
                route = fresh;
            }
            Ok(resp) => {
                return match ws.take() {
                    Some(w) => bridge(w, resp),
                    None => resp,
                }
            }
            // Never sent (no connection, or none ready): safe to try once more, on the
            // route as the store has it now (another replica may have declared the node dead
            // and the sandbox lost since this one cached it).
            Err(SendError::NotSent(e)) => {
                c.routes.drop_link(&route.node_id);
                c.routes.forget(id);
                if let Ok(Some(fresh)) = route_of(app, id).await {
                    if fresh.state == PlacementState::Lost && fresh.tenant == route.tenant {
                        let whole = parts.uri.path() == format!("/v1/sandboxes/{id}");
                        return lost(app, &fresh, id, whole, &parts.method).await;
                    }
                    if fresh.tenant == route.tenant {
                        route = fresh;
                    }
                }
                if !retriable {
                    return ApiError::bad_gateway(format!(
                        "sandbox {id}'s node {} cannot be reached: {e}",
                        route.node_id
                    ))
                    .into_response();
                }
            }
            // Sent, and the answer was lost: the node may have acted; never sent twice.
            Err(SendError::Lost(e)) => {
                c.routes.drop_link(&route.node_id);
                return ApiError::bad_gateway(format!(
                    "sandbox {id}'s node {} did not answer (the call may have run): {e}",
                    route.node_id
                ))
                .into_response();
            }
        }
    }
    ApiError::bad_gateway(format!(
        "sandbox {id}'s node {} did not answer",
        route.node_id
    ))
    .into_response()
}

/// A client's WebSocket handshake (HTTP/1.1 `Upgrade: websocket`): its key, and its side
/// of the connection once the answer is sent.
struct ClientSocket {
    key: HeaderValue,
    upgrade: hyper::upgrade::OnUpgrade,
}

/// The WebSocket a request opens, if it asks for one; a refusal for an upgrade that is not
/// a well-formed WebSocket handshake.
fn websocket_of(req: &mut Request) -> Result<Option<ClientSocket>, ApiError> {
    let Some(up) = req.headers().get(header::UPGRADE) else {
        return Ok(None);
    };
    if !up.as_bytes().eq_ignore_ascii_case(b"websocket") {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "only WebSocket upgrades are routed to fleet nodes",
        ));
    }
    let key = req
        .headers()
        .get(header::SEC_WEBSOCKET_KEY)
        .cloned()
        .ok_or_else(|| ApiError::bad_request("a WebSocket handshake carries Sec-WebSocket-Key"))?;
    Ok(Some(ClientSocket {
        key,
        upgrade: hyper::upgrade::on(req),
    }))
}

/// The answer to a client's WebSocket handshake from the node's answer to its stream: the
/// node's refusal as it is, or `101` and the two sides joined byte for byte (the frames
/// are the same over HTTP/1.1 and HTTP/2).
fn bridge(client: ClientSocket, node: Response) -> Response {
    if node.status() != StatusCode::OK {
        return node;
    }
    let protocol = node.headers().get(header::SEC_WEBSOCKET_PROTOCOL).cloned();
    let accept = accept_key(client.key.as_bytes());
    let node_side = hyper::upgrade::on(node);
    tokio::spawn(async move {
        let (Ok(c), Ok(n)) = tokio::join!(client.upgrade, node_side) else {
            return;
        };
        let (mut c, mut n) = (TokioIo::new(c), TokioIo::new(n));
        let _ = tokio::io::copy_bidirectional(&mut c, &mut n).await;
    });
    let mut r = Response::new(Body::empty());
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    if let Ok(v) = HeaderValue::from_str(&accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    if let Some(p) = protocol {
        h.insert(header::SEC_WEBSOCKET_PROTOCOL, p);
    }
    r
}

/// `Sec-WebSocket-Accept` for a client's key (RFC 6455 §4.2.2).
fn accept_key(key: &[u8]) -> String {
    use sha1::Digest as _;
    let mut h = sha1::Sha1::new();
    h.update(key);
    h.update(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
    locker_types::base64::encode(&h.finalize())
}

/// Why a request to a node has no answer.
#[derive(Debug)]
enum SendError {
    /// It never left (no connection, or none ready in time): it can be sent again.
    NotSent(String),
    /// It was sent and its answer was lost or late: the node may have acted on it.
    Lost(String),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::NotSent(e) | SendError::Lost(e) => f.write_str(e),
        }
    }
}

/// How long a call waits for room on a node's connection (its streams all busy).
const READY: Duration = Duration::from_secs(5);

/// One request to a node: the caller's, with the tenant and epoch; the node's answer.
async fn send(
    c: &super::control::Control,
    route: &Route,
    parts: &axum::http::request::Parts,
    body: Body,
    timeout: Option<Duration>,
) -> Result<Response, SendError> {
    let mut link = c
        .routes
        .link(&route.node_id, &route.address)
        .await
        .map_err(SendError::NotSent)?;
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req = hyper::Request::builder()
        .method(parts.method.clone())
        .uri(format!("https://{}{pq}", route.address))
        .body(body)
        .map_err(|e| SendError::NotSent(e.to_string()))?;
    let mut headers = parts.headers.clone();
    strip(&mut headers);
    headers.insert(
        TENANT_HEADER,
        HeaderValue::from_str(&route.tenant).map_err(|e| SendError::NotSent(e.to_string()))?,
    );
    headers.insert(EPOCH_HEADER, HeaderValue::from(route.epoch));
    // A WebSocket's stream (RFC 8441's `:protocol`).
    if let Some(p) = parts.extensions.get::<hyper::ext::Protocol>() {
        req.extensions_mut().insert(p.clone());
    }
    // A create (its route is still starting): the node reports what it made for it.
    if route.state == PlacementState::Starting && !route.placement.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&route.placement) {
            headers.insert(PLACEMENT_HEADER, v);
        }
    }
    *req.headers_mut() = headers;
    match tokio::time::timeout(READY, link.ready()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(SendError::NotSent(e.to_string())),
        Err(_) => {
            return Err(SendError::NotSent(format!(
                "the node's connection had no free stream within {}s",
                READY.as_secs()
            )))
        }
    }
    let sent = link.send_request(req);
    let resp = match timeout {
        Some(t) => tokio::time::timeout(t, sent)
            .await
            .map_err(|_| SendError::Lost(format!("no answer within {}s", t.as_secs())))?,
        None => sent.await,
    }
    .map_err(|e| SendError::Lost(e.to_string()))?;
    let (mut parts, body) = resp.into_parts();
    for name in [header::CONNECTION, header::TRANSFER_ENCODING] {
        parts.headers.remove(name);
    }
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// A route to node `n` for control's own calls (not a caller's).
fn node_route(n: &locker_store::NodeRecord, tenant: &str, epoch: i64) -> Route {
    Route {
        placement: String::new(),
        tenant: tenant.to_owned(),
        node_id: n.id.clone(),
        address: n.address.clone(),
        epoch,
        state: PlacementState::Placed,
        local: false,
    }
}

/// Sandbox `sb` of placement `p` as node `n` shows it now (`None`: the node has no such
/// sandbox), for the leader finishing a create whose replica went away.
pub async fn view_on_node(
    app: &AppState,
    n: &locker_store::NodeRecord,
    p: &PlacementRecord,
    sb: &str,
) -> Result<Option<String>, String> {
    let c = app.fleet.as_ref().expect("fleet control");
    let route = node_route(n, &p.tenant, p.epoch);
    let (parts, _) = axum::http::Request::get(format!("/v1/sandboxes/{sb}"))
        .body(())
        .map_err(|e| e.to_string())?
        .into_parts();
    let r = send(c, &route, &parts, Body::empty(), Some(CONNECT))
        .await
        .map_err(|e| e.to_string())?;
    match r.status() {
        StatusCode::OK => {
            let b = axum::body::to_bytes(r.into_body(), KEEP_BODY)
                .await
                .map_err(|e| e.to_string())?;
            Ok(Some(String::from_utf8_lossy(&b).into_owned()))
        }
        StatusCode::NOT_FOUND => Ok(None),
        s => Err(format!("the node answered {s}")),
    }
}

/// Asks node `n` to destroy sandbox `sb`, which no placement names (`placement::orphans`).
pub async fn destroy_orphan(
    app: &AppState,
    n: &locker_store::NodeRecord,
    sb: &str,
) -> Result<(), String> {
    let c = app.fleet.as_ref().expect("fleet control");
    let route = node_route(n, "_fleet", n.epoch);
    let (parts, _) = axum::http::Request::delete(format!("{}{sb}", super::node::ORPHAN_PATH))
        .body(())
        .map_err(|e| e.to_string())?
        .into_parts();
    match send(c, &route, &parts, Body::empty(), Some(CREATE)).await {
        Ok(r) if r.status().is_success() || r.status() == StatusCode::NOT_FOUND => Ok(()),
        Ok(r) => Err(format!("the node answered {}", r.status())),
        Err(e) => Err(e.to_string()),
    }
}

/// A create on a control plane with remote nodes (see the module doc).
async fn create(app: &AppState, req: Request, next: Next) -> Response {
    let Ok(caller) = crate::auth::caller_of(app, req.headers()) else {
        return next.run(req).await;
    };
    let c = app.fleet.as_ref().expect("fleet control");
    let local = c.local_node_id();
    let (nodes, _) = match placement::nodes(app, false).await {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    // A control plane that is no node and has none creates as one host does; every other
    // create is placed (a replica's own node too: other replicas then find its sandboxes).
    if local.is_none() && nodes.is_empty() {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, KEEP_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return ApiError::too_large("the request body is larger than 1 MiB").into_response()
        }
    };
    let rebuilt = |b: &bytes::Bytes| Request::from_parts(parts.clone(), Body::from(b.clone()));
    // A body the handler would refuse: let it say why.
    let Ok(spec) = serde_json::from_slice::<Value>(&bytes) else {
        return next.run(rebuilt(&bytes)).await;
    };
    let bound = host_bound(&spec);
    // A sandbox's volumes live on one server: it is placed there (its node).
    let volume_host = match volumes_host(app, &caller.tenant, &spec).await {
        Ok(h) => h,
        Err(e) => return e.into_response(),
    };
    let bound = match (&volume_host, bound) {
        (Some(h), _) if *h != app.host_id => None,
        (_, b) => b,
    };
    if let (Some(why), None) = (bound, &local) {
        return ApiError::bad_request(format!(
            "{why} cannot be placed on a remote fleet node yet (their data lives on the control \
             plane's host): start this server with --node local to run such sandboxes here"
        ))
        .into_response();
    }
    let memory_mb = match &spec["memory_mb"] {
        Value::Null => 512,
        v => match v.as_u64() {
            Some(m) if (crate::limits::MEMORY_MB.0..=crate::limits::MEMORY_MB.1).contains(&m) => m,
            // Out of range or not a number: the handler says what is allowed.
            _ => return next.run(rebuilt(&bytes)).await,
        },
    };
    if let Err(e) = quota(app, &caller.tenant, memory_mb, placement::row_nodes(&nodes)).await {
        return e.into_response();
    }
    let template = spec["template"].as_str().unwrap_or("default");
    let disk_mb = match &spec["disk_mb"] {
        Value::Null => crate::sandboxes::DEFAULT_DISK_MB,
        v => match v.as_u64() {
            Some(d) if (crate::limits::DISK_MB.0..=crate::limits::DISK_MB.1).contains(&d) => d,
            // Out of range or not a number: the handler says what is allowed.
            _ => return next.run(rebuilt(&bytes)).await,
        },
    };
    let ask = Ask {
        memory_mb: i64::try_from(memory_mb).unwrap_or(i64::MAX),
        disk_mb,
        template_digest: crate::templates::resolve_for(app, &caller.tenant, template)
            .ok()
            .flatten()
            .map(|t| t.digest),
        // Bound to a host's data: placed on the volumes' server, or on this server's own node
        // (`--node local`) for its secrets and snapshots.
        only: match volume_host.filter(|h| *h != app.host_id) {
            Some(h) => Some(h),
            None => bound.and(local.clone()),
        },
    };
    let t_place = std::time::Instant::now();
    let (p, node) = match placement::place(app, &caller.tenant, &ask).await {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let place_ms = t_place.elapsed().as_secs_f64() * 1e3;
    // The rest runs to its end even if the caller goes away: a reservation is always either
    // recorded with its sandbox or given back.
    let here = Some(node.id.as_str()) == local.as_deref();
    let (app2, node_name) = (app.clone(), node.name.clone());
    let done = tokio::spawn(async move {
        let t_node = std::time::Instant::now();
        let made = if here {
            // Reported like a remote node's create, so the leader leaves its placement be.
            app2.fleet_creates.begin(&p.id);
            let r = next
                .run(Request::from_parts(parts, Body::from(bytes)))
                .await;
            app2.fleet_creates.end(&p.id, None);
            Ok(r)
        } else {
            let route = Route {
                placement: p.id.clone(),
                tenant: p.tenant.clone(),
                node_id: node.id.clone(),
                address: node.address.clone(),
                epoch: p.epoch,
                state: PlacementState::Starting,
                local: false,
            };
            let c = app2.fleet.as_ref().expect("fleet control");
            send(c, &route, &parts, Body::from(bytes), Some(CREATE))
                .await
                .inspect_err(|_| c.routes.drop_link(&node.id))
        };
        let out = record(&app2, &p, &node, made).await;
        (out, t_node.elapsed())
    });
    let (out, node_time) = match done.await {
        Ok(x) => x,
        Err(e) => return ApiError::internal(format!("the create failed: {e}")).into_response(),
    };
    let mut out = match out {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Ok(v) = HeaderValue::from_str(&node_name) {
        out.headers_mut().insert("x-locker-node", v);
    }
    // Where the create's time went (RFC Server-Timing): choosing and reserving a node, then
    // the node making the sandbox.
    let node_ms = node_time.as_secs_f64() * 1e3;
    if let Ok(v) = HeaderValue::from_str(&format!("place;dur={place_ms:.3}, node;dur={node_ms:.3}"))
    {
        out.headers_mut().insert("server-timing", v);
    }
    out
}

/// A placed create's end: the node's answer recorded with the placement (201), or the
/// placement given back (anything else, passed on; or why it could not be recorded).
async fn record(
    app: &AppState,
    p: &PlacementRecord,
    node: &locker_store::NodeRecord,
    made: Result<Response, SendError>,
) -> Result<Response, ApiError> {
    let resp = match made {
        Ok(r) if r.status() == StatusCode::CREATED => r,
        Ok(r) => {
            placement::unplace(app, &p.id).await;
            return Ok(r);
        }
        Err(e) => {
            placement::unplace(app, &p.id).await;
            return Err(ApiError::bad_gateway(format!(
                "node {} did not answer the create: {e}; retry (another node may take it)",
                node.name
            )));
        }
    };
    let (rparts, body) = resp.into_parts();
    let answer = axum::body::to_bytes(body, KEEP_BODY).await.ok();
    let id = answer
        .as_ref()
        .and_then(|a| serde_json::from_slice::<Value>(a).ok())
        .and_then(|v| v["id"].as_str().map(str::to_owned));
    let (Some(answer), Some(sb)) = (answer, id) else {
        placement::unplace(app, &p.id).await;
        return Err(ApiError::bad_gateway(format!(
            "node {}'s answer to the create could not be read",
            node.name
        )));
    };
    let (store, pid, text) = (
        app.store.clone(),
        p.id.clone(),
        String::from_utf8_lossy(&answer).into_owned(),
    );
    let sb2 = sb.clone();
    match tokio::task::spawn_blocking(move || store.set_placed(&pid, &sb2, &text)).await {
        Ok(Ok(true)) => Ok(Response::from_parts(rparts, Body::from(answer))),
        // The node was declared dead while it made the sandbox (its placement is lost): the
        // node destroys it when it returns.
        Ok(Ok(false)) => {
            placement::unplace(app, &p.id).await;
            Err(ApiError::unavailable(format!(
                "node {} was declared dead while it made sandbox {sb}; retry",
                node.name
            )))
        }
        other => {
            placement::unplace(app, &p.id).await;
            tracing::warn!(placement = %p.id, sandbox = %sb, result = ?other.map(|r| r.map_err(|e| e.to_string())), "a created sandbox's placement could not be recorded");
            Err(ApiError::unavailable(format!(
                "sandbox {sb} was made on node {} but could not be recorded; retry",
                node.name
            )))
        }
    }
}

/// The server whose data dir holds the volumes a create mounts (`None`: none, or volumes
/// the handler will refuse); 400 when they live on different servers.
async fn volumes_host(
    app: &AppState,
    tenant: &str,
    spec: &Value,
) -> Result<Option<String>, ApiError> {
    let names: Vec<String> = spec["volumes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m["volume"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    if names.is_empty() {
        return Ok(None);
    }
    let (store, t) = (app.store.clone(), tenant.to_owned());
    let hosts = tokio::task::spawn_blocking(move || {
        let mut hosts = std::collections::BTreeSet::new();
        for n in &names {
            if let Some(r) = store.get_volume(&t, n)? {
                hosts.insert(r.host);
            }
        }
        Ok::<_, locker_store::StoreError>(hosts)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    if hosts.len() > 1 {
        return Err(ApiError::bad_request(
            "the volumes of one sandbox must live on one server of the fleet (they live where \
             they were created): mount volumes of one server",
        ));
    }
    Ok(hosts.into_iter().next())
}

/// What ties a create to the data on this server's host (volumes, secrets, snapshots), if
/// anything.
fn host_bound(spec: &Value) -> Option<&'static str> {
    let some = |k: &str| match &spec[k] {
        Value::Null => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::String(s) => !s.is_empty(),
        _ => true,
    };
    if some("volumes") {
        Some("a sandbox with volumes")
    } else if some("secrets") {
        Some("a sandbox with secrets")
    } else if some("from_snapshot") {
        Some("a sandbox from a snapshot")
    } else {
        None
    }
}

/// The tenant's quotas of sandboxes and of their memory, counting its sandboxes on every
/// node: the rows of this store (this and other replicas' own sandboxes) and the placements
/// on joined nodes (`rows`: the nodes whose sandboxes are rows). Read, then placed: two
/// creates racing for the last unit of quota can both pass.
async fn quota(
    app: &AppState,
    tenant: &str,
    memory_mb: u64,
    rows: std::collections::HashSet<String>,
) -> Result<(), ApiError> {
    let (store, t) = (app.store.clone(), tenant.to_owned());
    let (placed, placed_mb, here, here_mb) = tokio::task::spawn_blocking(move || {
        let remote: Vec<_> = store
            .list_placements(Some(&t), None)?
            .into_iter()
            .filter(|p| p.state != PlacementState::Lost && !rows.contains(&p.node_id))
            .collect();
        let mb = remote
            .iter()
            .map(|p| p.memory_mb.max(0) as u64)
            .sum::<u64>();
        Ok::<_, locker_store::StoreError>((
            remote.len() as u64,
            mb,
            store.count_running(&t)?,
            store.sum_memory_mb(&t)?,
        ))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let q = &app.cfg.quotas;
    if placed + here >= q.sandboxes {
        return Err(ApiError::quota(format!(
            "quota exceeded: tenant {tenant} may have {} sandboxes at once across the fleet; \
             delete some first",
            q.sandboxes
        )));
    }
    let used = placed_mb + here_mb;
    if used + memory_mb > q.memory_mb {
        return Err(ApiError::quota(format!(
            "quota exceeded: tenant {tenant} may use {} MB of sandbox memory in all across the \
             fleet ({used} MB in use)",
            q.memory_mb
        )));
    }
    Ok(())
}
