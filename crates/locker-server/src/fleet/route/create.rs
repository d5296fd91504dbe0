//! A create on a control plane with nodes: placed, made by the chosen node (or this
//! server's own), recorded with its placement; from the API or from E2B's API.

use super::*;

/// The API a create came through: Locker's own, or E2B's (`POST /sandboxes`,
/// `/v2/sandboxes`: its key in `X-API-KEY`, its body E2B's, its answer `sandboxID`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Surface {
    Locker,
    E2b,
}

/// An answer in E2B's error shape (`{"code", "message"}`) where it was Locker's
/// (`{"error": {…}}`, from this router); the node's own answers to E2B's create are E2B's
/// already.
pub(in crate::fleet) async fn e2b_shaped(resp: Response) -> Response {
    if resp.status().is_success() {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, KEEP_BODY).await else {
        return crate::e2b::E2bError::new(parts.status, "the answer could not be read")
            .into_response();
    };
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(v) if v["error"]["message"].is_string() => crate::e2b::E2bError::new(
            parts.status,
            v["error"]["message"].as_str().unwrap_or_default(),
        )
        .into_response(),
        _ => Response::from_parts(parts, Body::from(bytes)),
    }
}

/// A create on a control plane with remote nodes (see the module doc).
pub(super) async fn create(app: &AppState, req: Request, next: Next, surface: Surface) -> Response {
    let caller = match surface {
        Surface::Locker => crate::auth::caller_of(app, req.headers()).ok(),
        Surface::E2b => crate::e2b::api_key_caller(app, req.headers()).ok(),
    };
    let Some(caller) = caller else {
        return next.run(req).await;
    };
    let c = app.fleet.as_ref().expect("fleet control");
    let local = c.local_node_id();
    let (nodes, now_ms) = match placement::nodes(app, false).await {
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
    // E2B's body, in Locker's words where placing reads it.
    let spec = match surface {
        Surface::Locker => spec,
        Surface::E2b => match crate::e2b::placement_spec(&spec) {
            Some(s) => s,
            None => return next.run(rebuilt(&bytes)).await,
        },
    };
    let snapshot = match spec["from_snapshot"].as_str() {
        Some(s) => match super::snapshots::find(app, &caller.tenant, s).await {
            Ok(Some(snap)) => Some(snap),
            // No such snapshot: the handler says so, and nothing is reserved.
            Ok(None) => return next.run(rebuilt(&bytes)).await,
            Err(e) => return e.into_response(),
        },
        None => None,
    };
    let volume_host = match volumes_host(app, &caller.tenant, &spec).await {
        Ok(h) => h,
        Err(e) => return e.into_response(),
    };
    let rows = placement::row_nodes(&nodes);
    let only = match bound_to(app, volume_host, snapshot.as_ref(), local.as_deref()) {
        Ok(o) => o,
        Err(e) => return e.into_response(),
    };
    if let Some((node, what)) = &only {
        let alive = nodes
            .iter()
            .any(|n| n.id == *node && placement::alive(n, now_ms));
        if !alive {
            return ApiError::unavailable(format!(
                "{what} on fleet node {node}, which is not alive now (its data is on that node's \
                 disk): retry when the node is back"
            ))
            .into_response();
        }
    }
    let memory_mb = match &spec["memory_mb"] {
        Value::Null => snapshot.as_ref().map_or(512, |s| s.memory_mb),
        v => match v.as_u64() {
            Some(m) if (crate::limits::MEMORY_MB.0..=crate::limits::MEMORY_MB.1).contains(&m) => m,
            // Out of range or not a number: the handler says what is allowed.
            _ => return next.run(rebuilt(&bytes)).await,
        },
    };
    if let Err(e) = quota(app, &caller.tenant, (1, memory_mb), rows).await {
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
        only: only.map(|(n, _)| n),
        carried: false,
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
    let (mut rparts, body) = resp.into_parts();
    let made = axum::body::to_bytes(body, KEEP_BODY)
        .await
        .ok()
        .and_then(|a| serde_json::from_slice::<Value>(&a).ok())
        .and_then(|v| made_id(&v).map(|sb| (v, sb)));
    let Some((mut made, sb)) = made else {
        placement::unplace(app, &p.id).await;
        return Err(ApiError::bad_gateway(format!(
            "node {}'s answer to the create could not be read",
            node.name
        )));
    };
    // E2B's answer has no `id`: it is not the view lists show.
    let e2b = made["id"].is_null();
    localized(app, &mut made);
    let answer = made.to_string();
    // The answer is rewritten: its length is the new body's.
    rparts.headers.remove(header::CONTENT_LENGTH);
    let mut text = answer.clone();
    // E2B's: the node's view of what it made, read now (a sandbox of this server's own node
    // is a row of the store: listed as such).
    let own = app.fleet.as_ref().and_then(|c| c.local_node_id()) == Some(node.id.clone());
    if e2b && !own {
        match view_on_node(app, node, p, &sb).await {
            Ok(Some(v)) => text = v,
            other => {
                tracing::warn!(sandbox = %sb, node = %node.name, result = ?other, "the view of a sandbox made by E2B's create could not be read; lists show it once it is read again")
            }
        }
    }
    let (store, pid) = (app.store.clone(), p.id.clone());
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

/// The sandbox a create's answer made: Locker's `id`, or E2B's `sandboxID`.
pub(in crate::fleet) fn made_id(answer: &Value) -> Option<String> {
    answer["id"]
        .as_str()
        .or_else(|| answer["sandboxID"].as_str())
        .map(str::to_owned)
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

/// The one node a create may go to, and why, when its data ties it to one: its volumes'
/// home, its snapshot's node (where their files are). 400 when they point to different
/// nodes. Secrets tie it to none: a joined node gets them from control
/// (`secrets::remote`).
fn bound_to(
    app: &AppState,
    volume_host: Option<String>,
    snapshot: Option<&locker_store::SnapshotRecord>,
    local: Option<&str>,
) -> Result<Option<(String, String)>, ApiError> {
    let snapshot_node = snapshot.map(|s| {
        let node = if s.host.is_empty() {
            app.host_id.clone()
        } else {
            s.host.clone()
        };
        (node, format!("snapshot {} lives", s.id))
    });
    let volume_node = volume_host.map(|h| (h, "its volumes live".to_owned()));
    let only = match (volume_node, snapshot_node) {
        (Some((v, _)), Some((s, _))) if v != s => {
            return Err(ApiError::bad_request(format!(
                "its volumes live on fleet node {v} and its snapshot on node {s}: a sandbox runs \
                 where both are; mount volumes of the snapshot's node, or none"
            )))
        }
        (v, s) => v.or(s),
    };
    match only {
        Some((n, what)) if n == app.host_id && local.is_none() => {
            Err(ApiError::bad_request(format!(
            "{what} on this server, which runs no sandboxes of the fleet: start it with --node \
             local to run such sandboxes here"
        )))
        }
        o => Ok(o),
    }
}

/// The tenant's quotas of sandboxes and of their memory for `count` more sandboxes of
/// `memory_mb` each, counting its sandboxes on every node: the rows of this store (this and
/// other replicas' own sandboxes) and the placements on joined nodes (`rows`: the nodes
/// whose sandboxes are rows). Read, then placed: two creates racing for the last unit of
/// quota can both pass.
pub(super) async fn quota(
    app: &AppState,
    tenant: &str,
    (count, memory_mb): (u64, u64),
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
    if placed + here + count > q.sandboxes {
        return Err(ApiError::quota(format!(
            "quota exceeded: tenant {tenant} may have {} sandboxes at once across the fleet; \
             delete some first",
            q.sandboxes
        )));
    }
    let used = placed_mb + here_mb;
    if used + memory_mb * count > q.memory_mb {
        return Err(ApiError::quota(format!(
            "quota exceeded: tenant {tenant} may use {} MB of sandbox memory in all across the \
             fleet ({used} MB in use)",
            q.memory_mb
        )));
    }
    Ok(())
}
