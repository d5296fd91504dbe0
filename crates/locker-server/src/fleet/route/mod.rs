//! The router (`FLEET.md` §4.2 "Data plane"): a request about a sandbox placed on another
//! node goes to that node, whichever control replica it reached.
//!
//! [`dispatch`] runs before the API's handlers on a control plane (`--fleet-listen`):
//! - `POST /v1/sandboxes`: placed (`placement::place`) unless this server is no node and
//!   the fleet has none (then it creates as one host does), then made by the chosen node
//!   (forwarded, with the placement's id) or by this server when it is the node chosen
//!   (`--node local`); the placement records the sandbox's id. A create bound to this
//!   host's data (volumes, secrets, a snapshot) goes to this server's own node only;
//! - `/v1/volumes` and everything under a volume: to the volume's home, and a new volume
//!   gets one (`volumes`);
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
//! Preview hosts and E2B's surfaces name a sandbox otherwise (host, header, E2B's paths):
//! `data_plane` routes those, with this module's routes and [`forward`]. MCP's tools call
//! this router in-process, so they reach remote sandboxes as the API does.
//!
//! Snapshots stay on the node that took them and forks' children are placed on their
//! parent's node before they are made (`snapshots`).

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

use super::node::{
    APP_AUTH_HEADER, EPOCH_HEADER, PLACEMENT_HEADER, PREVIEW_HEADER, PREVIEW_KEY_HEADER,
    STALE_HEADER, TENANT_HEADER, VOLUME_HEADER,
};
use super::pki;
use super::placement::{self, Ask};
use crate::error::ApiError;
use crate::state::AppState;

mod create;
mod forward;
mod snapshots;
mod volume_move;
mod volumes;

pub(in crate::fleet) use create::e2b_shaped;
pub(in crate::fleet) use create::made_id;
use create::{create, Surface};
pub(in crate::fleet) use forward::forward;
pub use forward::{call_node, call_node_with, destroy_orphan, view_on_node};
use forward::{node_route, payload, send, Payload, SendError};
pub(in crate::fleet) use snapshots::{fork, snapshot};
pub use volume_move::{between as move_volume, move_off};
use volumes::{create_volume, volume_call, volume_of};

/// A body kept for a retry at most this big (the API's own body limit).
const KEEP_BODY: usize = 1 << 20;
/// How long a node may take to accept a connection, and to answer a create.
const CONNECT: Duration = Duration::from_secs(5);
const CREATE: Duration = Duration::from_secs(120);

/// Where a sandbox lives.
#[derive(Debug, Clone)]
pub(super) struct Route {
    placement: String,
    tenant: String,
    node_id: String,
    address: String,
    epoch: i64,
    pub(super) state: PlacementState,
    /// This server is its node (`--node local`).
    pub(super) local: bool,
}

impl Route {
    pub(super) fn tenant(&self) -> &str {
        &self.tenant
    }
    pub(super) fn node_id(&self) -> &str {
        &self.node_id
    }
    pub(super) fn placement(&self) -> &str {
        &self.placement
    }
}

/// Headers control itself adds to a request it routes, after the caller's own were
/// stripped (a routed preview request's target and credentials: `data_plane`).
#[derive(Debug, Clone, Default)]
pub(super) struct Extra(pub Vec<(axum::http::HeaderName, HeaderValue)>);

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

/// The middleware (see the module doc).
pub async fn dispatch(State(app): State<AppState>, req: Request, next: Next) -> Response {
    if app.fleet.is_none() || req.extensions().get::<super::node::Forwarded>().is_some() {
        // One host, or a call another replica routed to this server's node listener: this
        // server's own engine answers.
        return next.run(req).await;
    }
    let path = req.uri().path();
    if req.method() == Method::POST {
        match path {
            "/v1/sandboxes" => return create(&app, req, next, Surface::Locker).await,
            "/v1/volumes" => return create_volume(&app, req, next).await,
            "/sandboxes" | "/v2/sandboxes" => {
                let resp = create(&app, req, next, Surface::E2b).await;
                return e2b_shaped(resp).await;
            }
            _ => {}
        }
    }
    if let Some(v) = volume_of(path).map(str::to_owned) {
        return volume_call(&app, &v, req, next).await;
    }
    if req.method() == Method::DELETE {
        if let Some(snap) = path.strip_prefix("/v1/snapshots/").map(str::to_owned) {
            return snapshots::remove(&app, &snap, req, next, Surface::Locker).await;
        }
        let e2b_snapshot = path
            .strip_prefix("/templates/")
            .filter(|s| s.starts_with("snap_"));
        if let Some(snap) = e2b_snapshot.map(str::to_owned) {
            let resp = snapshots::remove(&app, &snap, req, next, Surface::E2b).await;
            return e2b_shaped(resp).await;
        }
    }
    let Some(id) = sandbox_of(path).map(str::to_owned) else {
        return next.run(req).await;
    };
    // A sandbox this server runs is its own (no lookup on the hot path), unless it is being
    // deleted: then its placement, if it has one, is given back.
    let deleting = req.method() == Method::DELETE && path == format!("/v1/sandboxes/{id}");
    // A fork's children are placed, this server's own sandbox's too.
    let forking = req.method() == Method::POST && path == format!("/v1/sandboxes/{id}/fork");
    // After a stall, which sandboxes are this server's is known only after its node's next
    // beat (and fence): the decision waits for it (`fleet::local::Awake`).
    if let Err(e) = app.awake.wait_open().await {
        return e.into_response();
    }
    if !deleting && !forking && app.live.read().await.contains_key(&id) {
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
    // Calls that change what the view shows answer the sandbox: their answer is kept too.
    let changes_view = req.method() == Method::POST
        && req
            .uri()
            .path()
            .strip_prefix(&format!("/v1/sandboxes/{id}/"))
            .is_some_and(|tail| matches!(tail, "ttl" | "pause" | "resume"));
    let rotation = req.uri().path() == format!("/v1/sandboxes/{id}/preview-token");
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
    let snapshotting =
        method == Method::POST && req.uri().path() == format!("/v1/sandboxes/{id}/snapshots");
    let resp = if forking && route.state == PlacementState::Placed {
        snapshots::fork(&app, &route, &id, req, next).await
    } else if route.local {
        next.run(req).await
    } else if snapshotting {
        snapshots::snapshot(&app, &route, &id, req).await
    } else {
        forward(&app, route.clone(), &id, req).await
    };
    if whole || changes_view {
        after(&app, &route, &id, &method, resp).await
    } else if !route.local && method == Method::POST && rotation {
        rotated(&app, &id, resp).await
    } else {
        resp
    }
}

/// A preview token rotated on a sandbox's node: the new one kept in the placement's view
/// (E2B's `/files` calls are found by it, `data_plane`), and the answer's preview URL this
/// server's.
async fn rotated(app: &AppState, id: &str, resp: Response) -> Response {
    if !resp.status().is_success() {
        return resp;
    }
    let mut token = None;
    let resp = edit_json(resp, |v| {
        v["preview_url"] = app
            .cfg
            .preview
            .as_ref()
            .map_or(Value::Null, |d| Value::String(d.template(id)));
        token = v["preview_token"].as_str().map(str::to_owned);
        true
    })
    .await;
    if let Some(token) = token {
        let (store, sb) = (app.store.clone(), id.to_owned());
        let kept = tokio::task::spawn_blocking(move || {
            let Some(p) = store.get_placement(&sb)? else {
                return Ok(());
            };
            let mut view: Value = serde_json::from_str(&p.view).unwrap_or(Value::Null);
            if view.is_object() {
                view["preview_token"] = Value::String(token);
                store.set_placement_view(&sb, &view.to_string())?;
            }
            Ok::<_, locker_store::StoreError>(())
        })
        .await;
        if !matches!(kept, Ok(Ok(()))) {
            tracing::warn!(sandbox = %id, "a rotated preview token could not be kept in the placement's view: E2B's token-only calls find the sandbox once its view is read again");
        }
    }
    resp
}

/// Reads sandbox `id`'s view again from its node and keeps it (after a call that changed
/// it without answering it: E2B's timeout, pause, resume and connect answer no sandbox).
/// Best effort: a view not refreshed is refreshed by the next call that answers it.
pub(in crate::fleet) async fn refresh_view(app: &AppState, id: &str) {
    let (store, sb) = (app.store.clone(), id.to_owned());
    let found = tokio::task::spawn_blocking(move || {
        let Some(p) = store.get_placement(&sb)? else {
            return Ok(None);
        };
        Ok::<_, locker_store::StoreError>(store.get_node(&p.node_id)?.map(|n| (p, n)))
    })
    .await;
    let Ok(Ok(Some((p, n)))) = found else {
        return;
    };
    if p.state != PlacementState::Placed || n.epoch != p.epoch {
        return;
    }
    let view = match view_on_node(app, &n, &p, id).await {
        Ok(Some(v)) => v,
        Ok(None) => return,
        Err(e) => {
            return tracing::debug!(sandbox = %id, error = %e, "the view could not be read again")
        }
    };
    let Ok(mut v) = serde_json::from_str::<Value>(&view) else {
        return;
    };
    if v["id"] != id {
        return;
    }
    localized(app, &mut v);
    let (store, sb) = (app.store.clone(), id.to_owned());
    let _ =
        tokio::task::spawn_blocking(move || store.set_placement_view(&sb, &v.to_string())).await;
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
    let mut view = None;
    let resp = edit_json(resp, |v| {
        if v["id"] != id {
            return false;
        }
        localized(app, v);
        view = Some(v.to_string());
        true
    })
    .await;
    if let Some(view) = view {
        let (store, sb) = (app.store.clone(), id.to_owned());
        let _ = tokio::task::spawn_blocking(move || store.set_placement_view(&sb, &view)).await;
    }
    resp
}

/// A node's answer read whole (small bodies: [`KEEP_BODY`]) and, when it is JSON, edited by
/// `edit`, which says whether it changed it (then the body is the new one, its length
/// dropped from the headers); anything else passes as it came.
pub(super) async fn edit_json(resp: Response, edit: impl FnOnce(&mut Value) -> bool) -> Response {
    let (mut parts, body) = resp.into_parts();
    let bytes = match axum::body::to_bytes(body, KEEP_BODY).await {
        Ok(b) => b,
        Err(e) => return ApiError::bad_gateway(format!("the node's answer: {e}")).into_response(),
    };
    if let Ok(mut v) = serde_json::from_slice::<Value>(&bytes) {
        if edit(&mut v) {
            parts.headers.remove(header::CONTENT_LENGTH);
            return Response::from_parts(parts, Body::from(v.to_string()));
        }
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// A node's answer about a sandbox as this server shows it: the preview URL (Locker's view)
/// or preview domain (E2B's `domain`) of this server's `--preview-domain`, not the node's
/// (which may have none): preview hosts are served by the control replicas.
pub(super) fn localized(app: &AppState, v: &mut Value) {
    let Some(o) = v.as_object_mut() else {
        return;
    };
    let preview = app.cfg.preview.as_ref();
    let id = o.get("id").and_then(Value::as_str).map(str::to_owned);
    if let (Some(id), true) = (id, o.contains_key("preview_url")) {
        let url = preview.map_or(Value::Null, |d| Value::String(d.template(&id)));
        o.insert("preview_url".into(), url);
    }
    if o.contains_key("sandboxID") && o.contains_key("domain") {
        let domain = preview.map_or(Value::Null, |d| Value::String(d.authority()));
        o.insert("domain".into(), domain);
    }
}

/// A node's JSON answer (2xx, small), [`localized`]; any other answer as it is.
pub(super) async fn localized_answer(app: &AppState, resp: Response) -> Response {
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
    if !resp.status().is_success() || !json {
        return resp;
    }
    edit_json(resp, |v| {
        localized(app, v);
        true
    })
    .await
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
            return axum::Json(view_of(app, &p)).into_response();
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
pub fn view_of(app: &AppState, p: &PlacementRecord) -> Value {
    let mut v: Value = serde_json::from_str(&p.view).unwrap_or(Value::Null);
    localized(app, &mut v);
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
        .map(|p| view_of(app, &p))
        .collect())
}

/// The route of sandbox `id`: cached, else from its placement; `None` if it has none.
pub(super) async fn route_of(app: &AppState, id: &str) -> Result<Option<Route>, ApiError> {
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
    // This server's own node's routes are not kept: a sandbox it runs is found in its
    // machines before any route is read, so one read here is one being made, or one that
    // left (a drain) and whose next route is another node's.
    if route.state == PlacementState::Placed && !route.local {
        c.routes
            .cache
            .lock()
            .expect("routes")
            .insert(id.to_owned(), route.clone());
    }
    Ok(Some(route))
}
