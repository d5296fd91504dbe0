//! Calls about a volume whose files another control replica holds (`VolumeRecord::host`):
//! sent to that replica's node listener, once.

use super::*;

/// The volume (id or name) a path is about (`/v1/volumes/{id}` and below: its files, runs,
/// snapshots, fork, restore).
pub(super) fn volume_of(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/volumes/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// A call about a volume whose files another control replica holds (`VolumeRecord::host`):
/// sent to that replica's node listener (`--node local`), once; a volume of this server,
/// or of none, is this server's to answer.
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
        n.state == locker_store::NodeState::Ready
            && n.cert_sha256 == crate::fleet::local::LOCAL_CERT
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
