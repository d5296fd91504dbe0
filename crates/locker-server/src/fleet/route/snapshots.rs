//! Snapshots and forks of sandboxes on nodes, through the router.
//!
//! A snapshot's files stay on the node that took it (its disk holds them; a sandbox started
//! from it stands on them there), and the fleet knows where that is:
//! - a snapshot taken on a joined node is recorded in the fleet's store too, as the node
//!   answered it, with the node as its `host` (the node keeps its own record and files); a
//!   control replica's own node records its snapshots in the fleet's store itself;
//! - `GET /v1/snapshots` reads the fleet's store (every node's snapshots, as one host
//!   lists its own);
//! - `DELETE /v1/snapshots/{id}` (E2B's `DELETE /templates/{id}`) goes to the snapshot's node, and the fleet's copy goes
//!   once the node let go of it (a node removed from the fleet took the files with it);
//! - a create `from_snapshot` is placed on the snapshot's node only (`create`).
//!
//! A fork's children are placed before they are made: one reservation each on their
//! parent's node (they stand on its disk), sent with the fork ([`PLACEMENT_HEADER`], the ids
//! in order), so that the node reports what it made for each as it does for a create, and
//! each child is recorded with its placement like a created sandbox (any replica routes to
//! it). A fork that fails gives every reservation back.

use super::create::quota;
use super::*;
use locker_store::SnapshotRecord;

/// The tenant's snapshot `id` in the fleet's store.
pub(super) async fn find(
    app: &AppState,
    tenant: &str,
    id: &str,
) -> Result<Option<SnapshotRecord>, ApiError> {
    let (store, t, s) = (app.store.clone(), tenant.to_owned(), id.to_owned());
    Ok(
        tokio::task::spawn_blocking(move || store.get_snapshot(&t, &s))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??,
    )
}

/// Node `id` as the router's node table has it (`placement::nodes`, read at most every
/// 500 ms), and whether its engine writes the fleet's store itself (a control replica's
/// own). `None`: the fleet has no such node (it was removed).
async fn node_of(
    app: &AppState,
    id: &str,
) -> Result<Option<(locker_store::NodeRecord, bool)>, ApiError> {
    let (nodes, _) = placement::nodes(app, false).await?;
    let rows = placement::row_nodes(&nodes);
    Ok(nodes
        .into_iter()
        .find(|n| n.id == id)
        .map(|n| (n, rows.contains(id))))
}

/// Whether node `id`'s engine writes the fleet's store itself (a control replica's own).
async fn shares_store(app: &AppState, id: &str) -> Result<bool, ApiError> {
    let local = app.fleet.as_ref().and_then(|c| c.local_node_id());
    if local.as_deref() == Some(id) {
        return Ok(true);
    }
    Ok(node_of(app, id).await?.is_some_and(|(_, shared)| shared))
}

/// `POST /v1/sandboxes/{id}/snapshots` (or E2B's `POST /sandboxes/{id}/snapshots`) of a
/// sandbox on another node: taken there, and, when that node is a joined one, recorded here
/// as the node shows it.
pub(in crate::fleet) async fn snapshot(
    app: &AppState,
    route: &Route,
    id: &str,
    req: Request,
) -> Response {
    let resp = forward(app, route.clone(), id, req).await;
    if resp.status() != StatusCode::CREATED {
        return resp;
    }
    match shares_store(app, route.node_id()).await {
        Ok(true) => return resp,
        Ok(false) => {}
        Err(e) => return e.into_response(),
    }
    let (parts, body) = resp.into_parts();
    let view = match axum::body::to_bytes(body, KEEP_BODY).await {
        Ok(b) => b,
        Err(e) => return ApiError::bad_gateway(format!("the node's answer: {e}")).into_response(),
    };
    let mut v: Value = serde_json::from_slice(&view).unwrap_or(Value::Null);
    // E2B's answer names the snapshot only: the node's own view of it is read.
    if let (Some(snap), true) = (v["snapshotID"].as_str(), v["sandbox_id"].is_null()) {
        match listed_on(app, route, snap).await {
            Ok(found) => v = found,
            Err(e) => {
                tracing::warn!(snapshot = %snap, error = %e, "the node's view of a snapshot could not be read")
            }
        }
    }
    let (store, route2, sb) = (app.store.clone(), route.clone(), id.to_owned());
    let kept = tokio::task::spawn_blocking(move || {
        let sizes: Value = store
            .get_placement(&sb)?
            .and_then(|p| serde_json::from_str(&p.view).ok())
            .unwrap_or(Value::Null);
        let rec = record_of(&v, &sizes, &route2).ok_or_else(|| {
            locker_store::StoreError::Invalid("the node's answer is not a snapshot".into())
        })?;
        store.insert_snapshot(&rec)?;
        Ok::<_, locker_store::StoreError>(rec.id)
    })
    .await;
    match kept {
        Ok(Ok(snap)) => {
            crate::fleet::restart::keep(app, route.node_id(), route.tenant(), id, &snap);
            Response::from_parts(parts, Body::from(view))
        }
        other => {
            // Not recorded: the node lets go of it, so nothing is left that none can see.
            let why = match other {
                Ok(Err(e)) => e.to_string(),
                Err(e) => e.to_string(),
                Ok(Ok(_)) => unreachable!(),
            };
            let snap = serde_json::from_slice::<Value>(&view).ok().and_then(|v| {
                v["id"]
                    .as_str()
                    .or(v["snapshotID"].as_str())
                    .map(str::to_owned)
            });
            if let Some(snap) = snap {
                let _ = delete_on(app, route.node_id(), route.tenant(), &snap).await;
            }
            ApiError::unavailable(format!(
                "the snapshot of sandbox {id} was taken on node {} but could not be recorded \
                 ({why}); it was deleted again: retry",
                route.node_id()
            ))
            .into_response()
        }
    }
}

/// Snapshot `snap` as node `route` lists it (the API's view; `Null` when it does not).
async fn listed_on(app: &AppState, route: &Route, snap: &str) -> Result<Value, String> {
    let c = app.fleet.as_ref().expect("fleet control");
    let (parts, _) = axum::http::Request::get("/v1/snapshots")
        .body(())
        .map_err(|e| e.to_string())?
        .into_parts();
    let r = send(c, route, &parts, Body::empty(), Some(CONNECT))
        .await
        .map_err(|e| e.to_string())?;
    if r.status() != StatusCode::OK {
        return Err(format!("the node answered {}", r.status()));
    }
    let b = axum::body::to_bytes(r.into_body(), 16 << 20)
        .await
        .map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_slice(&b).map_err(|e| e.to_string())?;
    Ok(v["snapshots"]
        .as_array()
        .and_then(|l| l.iter().find(|s| s["id"] == snap))
        .cloned()
        .unwrap_or(Value::Null))
}

/// The fleet's record of a snapshot node `route` answered (`view`, the API's view of it),
/// with its sandbox's sizes from the placement's view.
fn record_of(view: &Value, sizes: &Value, route: &Route) -> Option<SnapshotRecord> {
    let text = |k: &str| view[k].as_str().map(str::to_owned);
    Some(SnapshotRecord {
        id: text("id")?,
        tenant: route.tenant().to_owned(),
        sandbox_id: text("sandbox_id")?,
        template: text("template")?,
        template_digest: text("template_digest")?,
        runtime: text("runtime")?,
        size_bytes: view["size_bytes"].as_u64()?,
        has_memory: view["has_memory"].as_bool()?,
        cpus: sizes["cpus"].as_f64().unwrap_or(1.0),
        memory_mb: sizes["memory_mb"].as_u64().unwrap_or(512),
        disk_mb: view["disk_mb"].as_u64()?,
        created_at: text("created_at")?,
        // The files are the node's: nothing on this host.
        path: String::new(),
        host: route.node_id().to_owned(),
    })
}

/// Asks node `node_id` to delete snapshot `snap` of `tenant`: `Ok(true)` when it is gone
/// there (deleted now, or already), `Ok(false)` when the fleet no longer has that node.
async fn delete_on(
    app: &AppState,
    node_id: &str,
    tenant: &str,
    snap: &str,
) -> Result<bool, ApiError> {
    let c = app.fleet.as_ref().expect("fleet control");
    let Some((node, _)) = node_of(app, node_id).await? else {
        return Ok(false);
    };
    let (parts, _) = axum::http::Request::delete(format!("/v1/snapshots/{snap}"))
        .body(())
        .map_err(|e| ApiError::internal(e.to_string()))?
        .into_parts();
    let route = node_route(&node, tenant, node.epoch);
    match send(c, &route, &parts, Body::empty(), Some(CONNECT)).await {
        Ok(r) if r.status().is_success() || r.status() == StatusCode::NOT_FOUND => Ok(true),
        Ok(r) => Err(ApiError::bad_gateway(format!(
            "node {} holding snapshot {snap} answered {} to its deletion; retry",
            node.name,
            r.status()
        ))),
        Err(e) => Err(ApiError::unavailable(format!(
            "node {} holding snapshot {snap} did not answer ({e}): its files are there; retry \
             when the node is back",
            node.name
        ))),
    }
}

/// `DELETE /v1/snapshots/{id}` on a control plane: this server's own snapshots (and those
/// it does not know) by its handler; another node's on that node, then its record here.
pub(super) async fn remove(
    app: &AppState,
    snap: &str,
    req: Request,
    next: Next,
    surface: Surface,
) -> Response {
    let caller = match surface {
        Surface::Locker => crate::auth::caller_of(app, req.headers()).ok(),
        Surface::E2b => crate::e2b::api_key_caller(app, req.headers()).ok(),
    };
    let Some(caller) = caller else {
        return next.run(req).await;
    };
    let rec = match find(app, &caller.tenant, snap).await {
        Ok(Some(r)) if !r.is_on(&app.host_id) => r,
        Ok(_) => return next.run(req).await,
        Err(e) => return e.into_response(),
    };
    let shared = match shares_store(app, &rec.host).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    match delete_on(app, &rec.host, &caller.tenant, snap).await {
        // Another replica's own node deleted the fleet's record with its files.
        Ok(true) if shared => {}
        Ok(_) => {
            let (store, t, s) = (app.store.clone(), caller.tenant.clone(), snap.to_owned());
            match tokio::task::spawn_blocking(move || store.delete_snapshot(&t, &s)).await {
                Ok(Ok(_)) => crate::fleet::restart::forget(app, snap),
                Ok(Err(e)) => return ApiError::from(e).into_response(),
                Err(e) => return ApiError::internal(e.to_string()).into_response(),
            }
        }
        Err(e) => return e.into_response(),
    }
    StatusCode::NO_CONTENT.into_response()
}

/// `POST /v1/sandboxes/{id}/fork` (or E2B's `POST /sandboxes/{id}/fork`) of a placed
/// sandbox (this server's own node's or another's): the children placed on its node first,
/// made there, recorded each with its placement.
pub(in crate::fleet) async fn fork(
    app: &AppState,
    route: &Route,
    id: &str,
    req: Request,
    next: Next,
) -> Response {
    let (mut parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, KEEP_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return ApiError::too_large("the request body is larger than 1 MiB").into_response()
        }
    };
    let count = if bytes.iter().all(u8::is_ascii_whitespace) {
        Some(1)
    } else {
        serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| match &v["count"] {
                Value::Null => Some(1),
                c => c.as_u64(),
            })
    };
    let as_is = |parts, bytes| Request::from_parts(parts, Body::from(bytes));
    // A body or count the handler refuses: it says why, and nothing is made.
    let Some(count) = count.filter(|c| (1..=crate::snapshots::MAX_FORK).contains(c)) else {
        return if route.local {
            next.run(as_is(parts, bytes)).await
        } else {
            forward(app, route.clone(), id, as_is(parts, bytes)).await
        };
    };
    let places = match reserve(app, route, id, count).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let ids: Vec<String> = places.iter().map(|p| p.id.clone()).collect();
    let joined = HeaderValue::from_str(&ids.join(",")).expect("placement ids are ASCII");
    // The rest runs to its end even if the caller goes away: every reservation is either
    // recorded with its child or given back.
    let (app2, route2, id2) = (app.clone(), route.clone(), id.to_owned());
    let done = tokio::spawn(async move {
        let made = if route2.local {
            for p in &ids {
                app2.fleet_creates.begin(p);
            }
            let r = next.run(as_is(parts, bytes)).await;
            for p in &ids {
                app2.fleet_creates.end(p, None);
            }
            Ok(r)
        } else {
            parts.extensions.insert(Extra(vec![(
                PLACEMENT_HEADER.parse().expect("name"),
                joined,
            )]));
            let c = app2.fleet.as_ref().expect("fleet control");
            send(c, &route2, &parts, Body::from(bytes), Some(CREATE)).await
        };
        record_children(&app2, &route2, &id2, &places, made).await
    });
    match done.await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => e.into_response(),
        Err(e) => ApiError::internal(format!("the fork failed: {e}")).into_response(),
    }
}

/// One reservation per child of a fork of sandbox `id`, on its node; none when the node
/// (or the tenant's quota) has no room for all of them.
async fn reserve(
    app: &AppState,
    route: &Route,
    id: &str,
    count: u64,
) -> Result<Vec<PlacementRecord>, ApiError> {
    let (store, sb) = (app.store.clone(), id.to_owned());
    let parent = tokio::task::spawn_blocking(move || store.get_placement(&sb))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??
        .ok_or_else(|| ApiError::not_found(format!("sandbox {id} does not exist")))?;
    let view: Value = serde_json::from_str(&parent.view).unwrap_or(Value::Null);
    let memory_mb = u64::try_from(parent.memory_mb).unwrap_or(0);
    let (nodes, _) = placement::nodes(app, false).await?;
    quota(
        app,
        &route.tenant,
        (count, memory_mb),
        placement::row_nodes(&nodes),
    )
    .await?;
    let ask = Ask {
        memory_mb: parent.memory_mb,
        disk_mb: view["disk_mb"]
            .as_u64()
            .unwrap_or(crate::sandboxes::DEFAULT_DISK_MB),
        template_digest: None,
        only: Some(route.node_id.clone()),
        carried: false,
    };
    let mut places = Vec::new();
    for _ in 0..count {
        match placement::place(app, &route.tenant, &ask).await {
            Ok((p, _)) => places.push(p),
            Err(e) => {
                give_back(app, &places).await;
                let room = places.len();
                return Err(ApiError::new(
                    e.status,
                    format!(
                        "a fork's children run on their parent's node ({}), which has room for \
                         {room} more of them now, not {count}: fork fewer, or free room there \
                         ({})",
                        route.node_id, e.message
                    ),
                ));
            }
        }
    }
    Ok(places)
}

/// A fork's end: each child the node made recorded with its reservation, in order (201); or
/// every reservation given back (anything else, passed on).
async fn record_children(
    app: &AppState,
    route: &Route,
    id: &str,
    places: &[PlacementRecord],
    made: Result<Response, SendError>,
) -> Result<Response, ApiError> {
    let resp = match made {
        Ok(r) if r.status() == StatusCode::CREATED => r,
        Ok(r) => {
            give_back(app, places).await;
            return Ok(r);
        }
        Err(e) => {
            give_back(app, places).await;
            return Err(ApiError::bad_gateway(format!(
                "node {} did not answer the fork of sandbox {id}: {e}; retry",
                route.node_id
            )));
        }
    };
    let (mut rparts, body) = resp.into_parts();
    let answer = axum::body::to_bytes(body, KEEP_BODY)
        .await
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    let Some(mut answer) = answer.filter(|a| a["sandboxes"].is_array() || a.is_array()) else {
        give_back(app, places).await;
        return Err(ApiError::bad_gateway(format!(
            "node {}'s answer to the fork of sandbox {id} could not be read",
            route.node_id
        )));
    };
    let children = match children_of(app, route, places, &mut answer).await {
        Ok(c) => c,
        Err(e) => {
            give_back(app, places).await;
            return Err(e);
        }
    };
    let (store, ids) = (
        app.store.clone(),
        places.iter().map(|p| p.id.clone()).collect::<Vec<_>>(),
    );
    let pairs: Vec<(String, (String, String))> = ids.into_iter().zip(children).collect();
    let n = pairs.len();
    let recorded = tokio::task::spawn_blocking(move || {
        let mut done = Vec::new();
        for (p, (sb, view)) in &pairs {
            if store.set_placed(p, sb, view)? {
                done.push(p.clone());
            }
        }
        Ok::<_, locker_store::StoreError>(done)
    })
    .await;
    let done = match recorded {
        Ok(Ok(d)) => d,
        other => {
            tracing::warn!(sandbox = %id, result = ?other.map(|r| r.map_err(|e| e.to_string())), "a fork's children could not be recorded with their placements");
            Vec::new()
        }
    };
    if done.len() != n || n != places.len() {
        // All or none, as on one host: every reservation goes back, and the leader destroys
        // the children no placement names (`placement::orphans`).
        give_back(app, places).await;
        return Err(ApiError::unavailable(format!(
            "the fork of sandbox {id} made {n} of {} children on node {} and {} could be \
             recorded; the rest are removed: retry",
            places.len(),
            route.node_id,
            done.len()
        )));
    }
    rparts.headers.remove(header::CONTENT_LENGTH);
    Ok(Response::from_parts(rparts, Body::from(answer.to_string())))
}

/// The children a fork's answer made, in order, each with the view lists show of it (the
/// answer, [`localized`]): the API's `{"sandboxes": [view…]}`, or E2B's
/// `[{"sandbox": …}…]`, whose views are read from the node (E2B's are not the API's).
async fn children_of(
    app: &AppState,
    route: &Route,
    places: &[PlacementRecord],
    answer: &mut Value,
) -> Result<Vec<(String, String)>, ApiError> {
    let mut children = Vec::new();
    // (`get_mut`: indexing an array by a key for writing panics.)
    if let Some(list) = answer.get_mut("sandboxes").and_then(Value::as_array_mut) {
        for child in list {
            localized(app, child);
            if let Some(sb) = child["id"].as_str() {
                children.push((sb.to_owned(), child.to_string()));
            }
        }
        return Ok(children);
    }
    let mut made = Vec::new();
    for item in answer.as_array_mut().into_iter().flatten() {
        localized(app, &mut item["sandbox"]);
        if let Some(sb) = item["sandbox"]["sandboxID"].as_str() {
            made.push((sb.to_owned(), item["sandbox"].to_string()));
        }
    }
    if route.local {
        // This server's own: rows of the store, listed as such.
        return Ok(made);
    }
    let (node, _) = node_of(app, &route.node_id)
        .await?
        .ok_or_else(|| ApiError::unavailable(format!("node {} left the fleet", route.node_id)))?;
    for ((sb, e2b_view), p) in made.into_iter().zip(places) {
        let view = match view_on_node(app, &node, p, &sb).await {
            Ok(Some(v)) => v,
            other => {
                tracing::warn!(sandbox = %sb, node = %node.name, result = ?other, "the view of a child of E2B's fork could not be read; lists show it once it is read again");
                e2b_view
            }
        };
        children.push((sb, view));
    }
    Ok(children)
}

/// Gives a fork's reservations back.
async fn give_back(app: &AppState, places: &[PlacementRecord]) {
    for p in places {
        placement::unplace(app, &p.id).await;
    }
}
