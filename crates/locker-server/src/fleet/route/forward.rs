//! Sending a request to a sandbox's node: the caller's headers stripped and control's own
//! set (tenant, epoch, [`Extra`]), bodies kept for a retry when small, a stale route read
//! again and sent once more, WebSockets joined over HTTP/2 streams; and control's own calls
//! to a node (a view, an orphan's destruction).

use super::*;

/// Headers a hop does not pass on (RFC 9110 §7.6.1), those only control may set, and a
/// browser's site headers (control checked them against its own origin; the node's host is
/// another).
pub(super) fn strip(h: &mut HeaderMap) {
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
        "x-api-key",
        TENANT_HEADER,
        EPOCH_HEADER,
        STALE_HEADER,
        PLACEMENT_HEADER,
        PREVIEW_HEADER,
        PREVIEW_KEY_HEADER,
        APP_AUTH_HEADER,
        VOLUME_HEADER,
    ] {
        h.remove(name);
    }
}

/// A request's body: kept whole when small (so it can be sent twice), else streamed once.
pub(super) enum Payload {
    Kept(bytes::Bytes),
    Stream(Body),
}

pub(super) async fn payload(
    parts: &axum::http::request::Parts,
    body: Body,
) -> Result<Payload, Response> {
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
pub(in crate::fleet) async fn forward(
    app: &AppState,
    mut route: Route,
    id: &str,
    mut req: Request,
) -> Response {
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
            Ok(resp) if resp.status() == StatusCode::NOT_FOUND && retriable && ws.is_none() => {
                // The sandbox may have moved to another node (a drain) since this replica
                // cached its route: its old node no longer knows it.
                c.routes.forget(id);
                match route_of(app, id).await {
                    Ok(Some(fresh))
                        if fresh.tenant == route.tenant
                            && fresh.state == PlacementState::Placed
                            && (fresh.node_id != route.node_id || fresh.epoch != route.epoch) =>
                    {
                        route = fresh;
                    }
                    _ => return resp,
                }
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
pub(super) enum SendError {
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
pub(super) async fn send(
    c: &crate::fleet::control::Control,
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
    if let Some(Extra(extra)) = parts.extensions.get::<Extra>() {
        for (name, value) in extra {
            headers.insert(name.clone(), value.clone());
        }
    }
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
pub(super) fn node_route(n: &locker_store::NodeRecord, tenant: &str, epoch: i64) -> Route {
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

/// Control's own call `method path` with `body` to node `n` (a control replica's node
/// listener too) for `tenant`, at the node's current epoch; `timeout` bounds the wait for
/// the answer's head.
pub async fn call_node(
    app: &AppState,
    n: &locker_store::NodeRecord,
    tenant: &str,
    (method, path): (axum::http::Method, &str),
    body: Body,
    timeout: Option<Duration>,
) -> Result<Response, String> {
    call_node_with(app, n, tenant, (method, path), Vec::new(), body, timeout).await
}

/// [`call_node`] with headers of control's own (`extra`).
pub async fn call_node_with(
    app: &AppState,
    n: &locker_store::NodeRecord,
    tenant: &str,
    (method, path): (axum::http::Method, &str),
    extra: Vec<(axum::http::HeaderName, HeaderValue)>,
    body: Body,
    timeout: Option<Duration>,
) -> Result<Response, String> {
    let c = app
        .fleet
        .as_ref()
        .ok_or("this server is no control plane of a fleet")?;
    let route = node_route(n, tenant, n.epoch);
    let (mut parts, _) = axum::http::Request::builder()
        .method(method)
        .uri(path)
        .body(())
        .map_err(|e| e.to_string())?
        .into_parts();
    parts.extensions.insert(Extra(extra));
    send(c, &route, &parts, body, timeout).await.map_err(|e| {
        c.routes.drop_link(&n.id);
        e.to_string()
    })
}

/// Asks node `n` to destroy sandbox `sb`, which no placement names (`placement::orphans`).
pub async fn destroy_orphan(
    app: &AppState,
    n: &locker_store::NodeRecord,
    sb: &str,
) -> Result<(), String> {
    let path = format!("{}{sb}", crate::fleet::node::ORPHAN_PATH);
    let r = call_node(
        app,
        n,
        "_fleet",
        (Method::DELETE, &path),
        Body::empty(),
        Some(CREATE),
    )
    .await?;
    if r.status().is_success() || r.status() == StatusCode::NOT_FOUND {
        Ok(())
    } else {
        Err(format!("the node answered {}", r.status()))
    }
}
