//! A node's listener (`locker node`, `FLEET.md` §4.2 "Control → node: push"): this host's
//! engine (the same routes `locker serve` answers) served to the fleet's control plane and
//! to nobody else.
//!
//! The socket speaks TLS with the node's certificate from its join, and HTTP/2. Every client
//! must show a certificate from the fleet CA naming the control plane (`pki::CONTROL_NAME`):
//! the handshake refuses anything else, another node's certificate included. Control
//! authenticated the API caller already; it says which tenant the call is for
//! ([`TENANT_HEADER`]) and at which of this node's epochs the sandbox was placed
//! ([`EPOCH_HEADER`]). A call at an epoch other than the node's current one is refused with
//! 409 and [`STALE_HEADER`] (a node the fleet declared dead and that came back serves
//! nothing it ran before; control re-reads the route and retries once).
//!
//! Owns the listener and the checks of each call's headers; what a call does is the
//! engine's (the handlers' rooms), and which tenant it is for is control's word.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use crate::error::ApiError;
use crate::state::AppState;

/// The tenant a call is for (control's word, over control's certificate only).
pub const TENANT_HEADER: &str = "x-locker-tenant";
/// The node epoch the sandbox of a call was placed at.
pub const EPOCH_HEADER: &str = "x-locker-node-epoch";
/// Set on a node's refusal of a stale epoch (`409`): the route is stale, not the request.
pub const STALE_HEADER: &str = "x-locker-stale-route";
/// The placement a forwarded create is for: the node reports which create made which
/// sandbox ([`Creates`]).
pub const PLACEMENT_HEADER: &str = "x-locker-placement";
/// A preview host's request routed by control (`fleet::data_plane`): `{sandbox} {port}
/// {scheme} {authority}`, what the node's own preview domain would have read off the host.
pub const PREVIEW_HEADER: &str = "x-locker-preview";
/// Set with [`PREVIEW_HEADER`] when control let the request through by the tenant's API key
/// (which it took off the request: nodes hold no keys).
pub const PREVIEW_KEY_HEADER: &str = "x-locker-preview-key";
/// A preview request's own `Authorization` (the app's, not Locker's), carried across the
/// hop that drops every `Authorization`.
pub const APP_AUTH_HEADER: &str = "x-locker-app-authorization";
/// The id control chose for a volume a forwarded create or fork makes on this node: its
/// record in the fleet's store, which holds the name's uniqueness across nodes, is
/// reserved under that id before the node is asked (`fleet::route::volumes`).
pub const VOLUME_HEADER: &str = "x-locker-volume";
/// How long a finished create stays in the node's reports: longer than the leader takes to
/// see it (`placement::CREATE_GRACE_MS` and a reconciliation).
const MADE_KEPT: Duration = Duration::from_secs(120);

/// Streams one control connection carries at once (control multiplexes every API call it
/// forwards to this node over few connections).
const MAX_STREAMS: u32 = 1024;
const KEEPALIVE: Duration = Duration::from_secs(10);
/// Connections held at once (control replicas hold one or a few each).
const MAX_CONNECTIONS: usize = 1024;

/// A call forwarded by the control plane: the tenant it authenticated. Set only by this
/// listener, read by the API's caller extractor (`auth`).
#[derive(Debug, Clone)]
pub struct Forwarded {
    pub tenant: String,
    /// The id of the volume a create or fork makes, when control chose it
    /// ([`VOLUME_HEADER`]; a well-formed `vol_…` id, else none).
    pub volume: Option<String>,
}

/// The creates control asked of this node, by placement: those running, and those finished
/// lately with the sandbox each made. Every report carries them, so that the fleet's leader
/// can finish recording a create whose control replica died while the node made it, and
/// give back the reservation of one that never arrived.
#[derive(Debug, Default)]
pub struct Creates {
    inner: Mutex<CreatesInner>,
}

#[derive(Debug, Default)]
struct CreatesInner {
    running: HashSet<String>,
    made: HashMap<String, (String, Instant)>,
}

impl Creates {
    pub fn begin(&self, placement: &str) {
        let mut i = self.inner.lock().expect("creates");
        i.running.insert(placement.to_owned());
    }

    pub fn end(&self, placement: &str, made: Option<String>) {
        let mut i = self.inner.lock().expect("creates");
        i.running.remove(placement);
        if let Some(sb) = made {
            i.made.insert(placement.to_owned(), (sb, Instant::now()));
        }
    }

    /// The creates running, and those made within [`MADE_KEPT`] (older ones forgotten).
    pub fn report(&self) -> (Vec<String>, BTreeMap<String, String>) {
        let mut i = self.inner.lock().expect("creates");
        i.made.retain(|_, (_, at)| at.elapsed() < MADE_KEPT);
        let mut running: Vec<String> = i.running.iter().cloned().collect();
        running.sort();
        let made = i
            .made
            .iter()
            .map(|(p, (sb, _))| (p.clone(), sb.clone()))
            .collect();
        (running, made)
    }
}

/// The node's current epoch, shared by the listener (checks every call) and the member
/// (moves it when the node returns after being declared dead).
pub type Epoch = Arc<AtomicI64>;

/// Serves the engine behind `app` on `listener` until `quitting`.
pub fn serve(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: AppState,
    epoch: Epoch,
    quitting: tokio::sync::watch::Receiver<bool>,
) {
    let routes = crate::app::router(app.clone());
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let tenants: Arc<Mutex<HashSet<String>>> = Arc::default();
    super::accept_loop(
        listener,
        "node listener",
        MAX_CONNECTIONS,
        quitting,
        move |tcp| {
            let (acceptor, routes, app, epoch, tenants) = (
                acceptor.clone(),
                routes.clone(),
                app.clone(),
                epoch.clone(),
                tenants.clone(),
            );
            async move {
                let tls = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp))
                    .await
                {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => {
                        tracing::info!(error = %e, "node listener: refused a connection");
                        return;
                    }
                    Err(_) => return,
                };
                let svc = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let (routes, app, epoch, tenants) =
                            (routes.clone(), app.clone(), epoch.clone(), tenants.clone());
                        async move {
                            Ok::<_, std::convert::Infallible>(
                                call(routes, &app, &epoch, &tenants, req).await,
                            )
                        }
                    },
                );
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .timer(TokioTimer::new())
                    // WebSockets (PTY) over HTTP/2 (RFC 8441): control opens them as streams.
                    .enable_connect_protocol()
                    .keep_alive_interval(Some(KEEPALIVE))
                    .keep_alive_timeout(KEEPALIVE)
                    .max_concurrent_streams(MAX_STREAMS)
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            }
        },
    );
}

/// One forwarded call: its epoch and tenant checked, then the engine's routes.
async fn call(
    mut routes: axum::Router,
    app: &AppState,
    epoch: &Epoch,
    tenants: &Mutex<HashSet<String>>,
    req: hyper::Request<hyper::body::Incoming>,
) -> Response {
    let (mut parts, body) = req.into_parts();
    let current = epoch.load(Ordering::Acquire);
    let asked = parts
        .headers
        .get(EPOCH_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok());
    match asked {
        Some(e) if e == current => {}
        Some(e) => return stale(e, current),
        None => {
            return ApiError::bad_request(format!("a node call carries {EPOCH_HEADER}"))
                .into_response()
        }
    }
    // The control plane's own call: a sandbox it has no placement for (an orphan of a
    // create it never finished), whoever's it is.
    if let Some(id) = parts.uri.path().strip_prefix(ORPHAN_PATH) {
        if parts.method == axum::http::Method::DELETE {
            return destroy_orphan(app, id).await;
        }
    }
    let Some(tenant) = parts
        .headers
        .get(TENANT_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return ApiError::bad_request(format!("a node call carries {TENANT_HEADER}"))
            .into_response();
    };
    // The engine's rows name their tenant: make it here the first time one is seen.
    let known = tenants.lock().expect("tenants").contains(&tenant);
    if !known {
        let (store, t) = (app.store.clone(), tenant.clone());
        match tokio::task::spawn_blocking(move || store.ensure_tenant(&t)).await {
            Ok(Ok(_)) => {
                tenants.lock().expect("tenants").insert(tenant.clone());
            }
            Ok(Err(e)) => return ApiError::from(e).into_response(),
            Err(e) => return ApiError::internal(e.to_string()).into_response(),
        }
    }
    // Control moving a volume here or away (`volumes::moving`, `volumes::handoff`).
    if let Some(rest) = parts
        .uri
        .path()
        .strip_prefix(crate::volumes::moving::RECEIVE_PATH)
    {
        let body = axum::body::Body::new(body);
        let (method, query) = (parts.method.clone(), parts.uri.query().map(str::to_owned));
        let record = parts
            .headers
            .get(crate::volumes::handoff::RECORD_HEADER)
            .and_then(|v| serde_json::from_slice(v.as_bytes()).ok());
        return crate::volumes::moving::received(
            app,
            &tenant,
            (&method, rest, query.as_deref()),
            record,
            body,
        )
        .await;
    }
    // Control carrying a sandbox to or from this node (a drain, `carry`).
    if let Some(rest) = parts.uri.path().strip_prefix(crate::carry::PATH) {
        let body = axum::body::Body::new(body);
        let (method, query) = (parts.method.clone(), parts.uri.query().map(str::to_owned));
        return crate::carry::handle(app, &tenant, &method, rest, query.as_deref(), body).await;
    }
    parts.headers.remove(axum::http::header::AUTHORIZATION);
    if let Some(app_auth) = parts.headers.remove(APP_AUTH_HEADER) {
        parts
            .headers
            .insert(axum::http::header::AUTHORIZATION, app_auth);
    }
    parts.headers.remove(TENANT_HEADER);
    parts.headers.remove(EPOCH_HEADER);
    let placement = parts
        .headers
        .remove(PLACEMENT_HEADER)
        .and_then(|v| v.to_str().ok().map(str::to_owned))
        .filter(|_| {
            parts.method == axum::http::Method::POST
                && (matches!(
                    parts.uri.path(),
                    "/v1/sandboxes" | "/sandboxes" | "/v2/sandboxes"
                ) || parts.uri.path().ends_with("/fork"))
        });
    let volume = parts
        .headers
        .remove(VOLUME_HEADER)
        .and_then(|v| v.to_str().ok().map(str::to_owned))
        .filter(|id| crate::ids::is_id(id, "vol_"))
        .filter(|_| {
            let path = parts.uri.path();
            parts.method == axum::http::Method::POST
                && (path == "/v1/volumes"
                    || (path.starts_with("/v1/volumes/") && path.ends_with("/fork")))
        });
    parts.extensions.insert(Forwarded { tenant, volume });
    let req = axum::extract::Request::from_parts(parts, axum::body::Body::new(body));
    let Some(placement) = placement else {
        return match tower_service::Service::call(&mut routes, req).await {
            Ok(r) => r,
            Err(e) => match e {},
        };
    };
    // A placed create (or fork: a placement per child, in order) runs to its end here even
    // if control goes away meanwhile, and says what it made in the next reports.
    let placements: Vec<String> = placement.split(',').map(str::to_owned).collect();
    let app = app.clone();
    let made = tokio::spawn(async move {
        for p in &placements {
            app.fleet_creates.begin(p);
        }
        let resp = match tower_service::Service::call(&mut routes, req).await {
            Ok(r) => r,
            Err(e) => match e {},
        };
        if resp.status() != StatusCode::CREATED {
            for p in &placements {
                app.fleet_creates.end(p, None);
            }
            return resp;
        }
        let (parts, body) = resp.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20)
            .await
            .unwrap_or_default();
        let answer = serde_json::from_slice::<serde_json::Value>(&bytes).unwrap_or_default();
        // A fork's children: the API's `{"sandboxes": […]}` or E2B's `[{"sandbox": …}…]`.
        let made: Vec<Option<String>> = match (answer["sandboxes"].as_array(), answer.as_array()) {
            (Some(children), _) => children
                .iter()
                .map(|c| c["id"].as_str().map(str::to_owned))
                .collect(),
            (None, Some(children)) => children
                .iter()
                .map(|c| c["sandbox"]["sandboxID"].as_str().map(str::to_owned))
                .collect(),
            (None, None) => vec![super::route::made_id(&answer)],
        };
        for (i, p) in placements.iter().enumerate() {
            app.fleet_creates.end(p, made.get(i).cloned().flatten());
        }
        Response::from_parts(parts, axum::body::Body::from(bytes))
    });
    made.await
        .unwrap_or_else(|e| ApiError::internal(format!("the create failed: {e}")).into_response())
}

/// Where the control plane deletes a sandbox it has no placement for
/// (`DELETE /internal/orphans/{id}`).
pub const ORPHAN_PATH: &str = "/internal/orphans/";

async fn destroy_orphan(app: &AppState, id: &str) -> Response {
    let (store, sb) = (app.store.clone(), id.to_owned());
    let rec = match tokio::task::spawn_blocking(move || store.get_sandbox_any(&sb)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return ApiError::from(e).into_response(),
        Err(e) => return ApiError::internal(e.to_string()).into_response(),
    };
    match rec {
        Some(r) if app.live.read().await.contains_key(id) => {
            tracing::warn!(sandbox = %id, tenant = %r.tenant, "destroying a sandbox the fleet has no placement for (a create the control plane never finished)");
            match crate::lifecycle::destroy(app, &r, "deleted").await {
                Ok(()) => StatusCode::NO_CONTENT.into_response(),
                Err(e) => e.into_response(),
            }
        }
        _ => ApiError::not_found(format!("sandbox {id} does not run here")).into_response(),
    }
}

/// The refusal of a call at another epoch than the node's.
fn stale(asked: i64, current: i64) -> Response {
    let mut r = ApiError::conflict(format!(
        "this node is at epoch {current}, the call is for epoch {asked}: the sandbox is no \
         longer this node's (it was declared dead and returned)"
    ))
    .into_response();
    r.headers_mut()
        .insert(STALE_HEADER, HeaderValue::from_static("1"));
    *r.status_mut() = StatusCode::CONFLICT;
    r
}
