//! Volumes on other servers of the fleet (`FLEET.md` §4.6): every call about a volume goes
//! to its home (`VolumeRecord::host`), and new volumes get one.
//!
//! A volume's home is the server whose disk holds its filesystem:
//! - **a joined node** (`locker node`): the volumes of a control plane that is no node itself
//!   (the split and Kubernetes layouts). A create is given the joined node that can grant
//!   the most disk; its record is reserved in the fleet's store first (the id chosen here, the
//!   name unique across the fleet, the tenant's disk quota counted across it), then the node
//!   makes it under that id ([`VOLUME_HEADER`]) and keeps its own record of it in its own
//!   store. A fork is made on its source's node the same way, and a delete the node answered
//!   removes the reserved record. A record whose node never made the volume (its create's
//!   answer lost and the node unreachable since) answers 404 from the node; deleting it
//!   removes it.
//! - **another control replica that is a node** (`--node local`): its engine reads the fleet's
//!   store itself, so calls are only sent there (its node listener);
//! - **this server**: its own handlers, as on one host (a replica that is a node keeps making
//!   volumes on its own disk: the one-host experience).
//!
//! While a volume's home is not alive its calls answer 503 (never an empty volume); a joined
//! node removed from the fleet takes its volumes' records with it (`control::remove_node`).
//! Moving a volume (`…/move`) is between servers that are nodes (`volumes::moving`), or
//! between joined nodes (`volume_move`).

use super::*;
use crate::fleet::local::LOCAL_CERT;
use locker_store::{NodeRecord, VolumeRecord};

/// The volume (id or name) a path is about (`/v1/volumes/{id}` and below: its files, runs,
/// snapshots, fork, restore).
pub(super) fn volume_of(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/volumes/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// Whether a node is a joined one (`locker node`), whose engine keeps its own store.
fn joined(n: &NodeRecord) -> bool {
    n.cert_sha256 != LOCAL_CERT
}

/// `POST /v1/volumes` on a control plane: made on a joined node when this server is no node
/// and the fleet has joined nodes (see the module doc), else here.
pub(super) async fn create_volume(app: &AppState, req: Request, next: Next) -> Response {
    let c = app.fleet.as_ref().expect("fleet control");
    if c.local_node_id().is_some() {
        return next.run(req).await;
    }
    let Ok(caller) = crate::auth::caller_of(app, req.headers()) else {
        return next.run(req).await;
    };
    let (nodes, now_ms) = match placement::nodes(app, false).await {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    let homes: Vec<&NodeRecord> = nodes.iter().filter(|n| joined(n)).collect();
    if homes.is_empty() {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, KEEP_BODY).await else {
        return ApiError::too_large("the request body is larger than 1 MiB").into_response();
    };
    let Some((name, size_mb)) = crate::volumes::create_asks(&bytes) else {
        // A body the handler refuses: it says why.
        return next
            .run(Request::from_parts(parts, Body::from(bytes)))
            .await;
    };
    if let Err(e) = crate::lifecycle::check_disk_quota(app, &caller.tenant, size_mb, "volume") {
        return e.into_response();
    }
    let Some(home) = home_for(&homes, size_mb, now_ms) else {
        return ApiError::quota(format!(
            "no capacity: no node of the fleet can hold a volume of {size_mb} MB now (none is \
             alive and open with that much disk to grant); ask for less, or retry when nodes \
             have room"
        ))
        .into_response();
    };
    let rec = VolumeRecord {
        id: crate::state::new_id("vol_"),
        tenant: caller.tenant.clone(),
        name,
        size_mb,
        created_at: locker_types::rfc3339(crate::state::now_s()),
        host: home.id.clone(),
    };
    made_on(app, rec, home, parts, bytes).await
}

/// The joined node a new volume of `size_mb` goes to: alive, open (not cordoned), with the
/// most disk to grant, and at least `size_mb` of it.
pub(super) fn home_for<'a>(
    homes: &[&'a NodeRecord],
    size_mb: u64,
    now_ms: i64,
) -> Option<&'a NodeRecord> {
    homes
        .iter()
        .filter(|n| placement::alive(n, now_ms) && !n.cordoned)
        .filter_map(|n| {
            let r: crate::fleet::wire::Report = serde_json::from_str(&n.report).ok()?;
            let grantable = r.disk_grantable_mb.unwrap_or(r.disk_free_mb);
            (grantable >= size_mb).then_some((grantable, *n))
        })
        .max_by_key(|(g, _)| *g)
        .map(|(_, n)| n)
}

/// A new volume `rec` made on joined node `home` by the request (`parts`, `bytes`: a
/// create, or a fork of a volume there): its record reserved in the fleet's store, the node
/// asked to make it under its id, the record removed again when the node did not.
async fn made_on(
    app: &AppState,
    rec: VolumeRecord,
    home: &NodeRecord,
    mut parts: axum::http::request::Parts,
    bytes: bytes::Bytes,
) -> Response {
    let (store, r) = (app.store.clone(), rec.clone());
    let reserved = tokio::task::spawn_blocking(move || {
        if store.get_volume(&r.tenant, &r.name)?.is_some() {
            return Ok(false);
        }
        store.insert_volume(&r).map(|()| true)
    })
    .await;
    match reserved {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => {
            return ApiError::conflict(format!("a volume named {:?} already exists", rec.name))
                .into_response()
        }
        Ok(Err(e)) => return ApiError::from(e).into_response(),
        Err(e) => return ApiError::internal(e.to_string()).into_response(),
    }
    let id = HeaderValue::from_str(&rec.id).expect("an id is a header value");
    parts.extensions.insert(Extra(vec![(
        axum::http::HeaderName::from_static(VOLUME_HEADER),
        id,
    )]));
    let c = app.fleet.as_ref().expect("fleet control");
    let route = node_route(home, &rec.tenant, home.epoch);
    let made = send(c, &route, &parts, Body::from(bytes), Some(CREATE)).await;
    let lost = match made {
        Ok(mut r) if r.status() == StatusCode::CREATED => {
            if let Ok(v) = HeaderValue::from_str(&home.name) {
                r.headers_mut().insert("x-locker-node", v);
            }
            tracing::info!(volume = %rec.id, node = %home.name, "a volume was made on a joined node");
            return r;
        }
        Ok(r) => {
            unreserve(app, &rec).await;
            return r;
        }
        Err(SendError::NotSent(e)) => {
            c.routes.drop_link(&home.id);
            unreserve(app, &rec).await;
            return ApiError::bad_gateway(format!(
                "node {} did not take the volume's create: {e}; retry",
                home.name
            ))
            .into_response();
        }
        Err(SendError::Lost(e)) => e,
    };
    // The node may have made it: ask it to remove it, and keep the record unless it did (or
    // never had it), so that no volume is left on a disk without one.
    c.routes.drop_link(&home.id);
    let mut gone = false;
    if let Ok(del) = Request::delete(format!("/v1/volumes/{}", rec.id)).body(()) {
        let (dparts, ()) = del.into_parts();
        if let Ok(r) = send(c, &route, &dparts, Body::empty(), Some(CONNECT)).await {
            gone = r.status() == StatusCode::NO_CONTENT || r.status() == StatusCode::NOT_FOUND;
        }
    }
    if gone {
        unreserve(app, &rec).await;
    }
    ApiError::bad_gateway(format!(
        "node {}'s answer to the volume's create was lost ({lost}); {}",
        home.name,
        if gone {
            "nothing was kept: retry".to_owned()
        } else {
            format!(
                "volume {} may exist: read it, or delete it and retry",
                rec.id
            )
        }
    ))
    .into_response()
}

/// Removes a volume's record from the fleet's store (its node does not hold it).
async fn unreserve(app: &AppState, rec: &VolumeRecord) {
    let (store, t, id) = (app.store.clone(), rec.tenant.clone(), rec.id.clone());
    match tokio::task::spawn_blocking(move || store.delete_volume(&t, &id)).await {
        Ok(Ok(_)) => {}
        other => {
            tracing::warn!(volume = %rec.id, result = ?other.map(|r| r.map_err(|e| e.to_string())), "a volume's record could not be removed")
        }
    }
}

/// A call about a volume whose files another server of the fleet holds
/// (`VolumeRecord::host`): sent to that server's node listener, once; a volume of this
/// server, or of none, is this server's to answer.
pub(super) async fn volume_call(
    app: &AppState,
    volume: &str,
    req: Request,
    next: Next,
) -> Response {
    let Ok(caller) = crate::auth::caller_of(app, req.headers()) else {
        return next.run(req).await;
    };
    let (store, t, v) = (app.store.clone(), caller.tenant.clone(), volume.to_owned());
    let rec = match tokio::task::spawn_blocking(move || store.get_volume(&t, &v)).await {
        Ok(Ok(Some(r))) => r,
        Ok(Ok(None)) => return next.run(req).await,
        Ok(Err(e)) => return ApiError::from(e).into_response(),
        Err(e) => return ApiError::internal(e.to_string()).into_response(),
    };
    if rec.host.is_empty() || rec.host == app.host_id {
        return next.run(req).await;
    }
    let (nodes, now_ms) = match placement::nodes(app, false).await {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    let home = nodes
        .iter()
        .find(|n| n.id == rec.host && placement::alive(n, now_ms));
    let Some(n) = home.cloned() else {
        return unavailable(volume, &rec.host, "does not answer as a node now");
    };
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let on_joined = joined(&n);
    if on_joined && method == Method::POST {
        if path == format!("/v1/volumes/{volume}/move") {
            return super::volume_move::move_joined(app, &rec, &n, req.into_body()).await;
        }
        if path == format!("/v1/volumes/{volume}/fork") {
            return fork_on(app, &rec, &n, req, next).await;
        }
    }
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
        Ok(mut r) => {
            if let Ok(v) = HeaderValue::from_str(&n.name) {
                r.headers_mut().insert("x-locker-node", v);
            }
            let deleted = method == Method::DELETE
                && path == format!("/v1/volumes/{volume}")
                && (r.status() == StatusCode::NO_CONTENT || r.status() == StatusCode::NOT_FOUND);
            if on_joined && deleted {
                unreserve(app, &rec).await;
                if r.status() == StatusCode::NOT_FOUND {
                    // Its node never made it (a create whose answer was lost): the record
                    // was all there was.
                    return StatusCode::NO_CONTENT.into_response();
                }
            }
            r
        }
        Err(SendError::NotSent(e)) => {
            c.routes.drop_link(&n.id);
            unavailable(volume, &rec.host, &format!("cannot be reached ({e})"))
        }
        Err(SendError::Lost(e)) => {
            c.routes.drop_link(&n.id);
            ApiError::bad_gateway(format!(
                "volume {volume}'s server {} did not answer: {e}",
                rec.host
            ))
            .into_response()
        }
    }
}

/// The 503 of a volume whose home is away (`why`): never an empty volume.
fn unavailable(volume: &str, host: &str, why: &str) -> Response {
    ApiError::unavailable(format!(
        "volume {volume} is unavailable: it lives on another server of the fleet ({host}), \
         which {why}; its files are on that server's disk: retry when it is back"
    ))
    .into_response()
}

/// A fork of volume `src`, which lives on joined node `home`: the new volume is made there,
/// its record reserved first (as a create's).
async fn fork_on(
    app: &AppState,
    src: &VolumeRecord,
    home: &NodeRecord,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, KEEP_BODY).await else {
        return ApiError::too_large("the request body is larger than 1 MiB").into_response();
    };
    let Some(name) = crate::volumes::fork_asks(&bytes) else {
        // A body the handler refuses: it says why (the same checks as the node's).
        return next
            .run(Request::from_parts(parts, Body::from(bytes)))
            .await;
    };
    if let Err(e) = crate::lifecycle::check_disk_quota(app, &src.tenant, src.size_mb, "volume") {
        return e.into_response();
    }
    let rec = VolumeRecord {
        id: crate::state::new_id("vol_"),
        tenant: src.tenant.clone(),
        name,
        size_mb: src.size_mb,
        created_at: locker_types::rfc3339(crate::state::now_s()),
        host: home.id.clone(),
    };
    made_on(app, rec, home, parts, bytes).await
}
