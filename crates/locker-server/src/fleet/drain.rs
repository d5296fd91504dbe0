//! Draining a node (`locker fleet drain NODE`, `POST /v1/fleet/nodes/{node}/drain`,
//! `FLEET.md` §4.7): the node is cordoned, then each of its sandboxes is carried to another
//! node under its own id, and the answer says what moved, what did not and why.
//!
//! One sandbox's move, driven from here (the nodes never call each other):
//! 1. a reservation on the new node (`placement::place` with [`Ask::carried`]: a joined node
//!    that holds the template and has room; a `starting` placement the new node reports as
//!    a create in progress while it imports, so no reconciliation gives it back);
//! 2. the old node freezes the sandbox (calls answer 503 "moving", to be called again) and
//!    streams a snapshot of it (`carry`'s bundle), which this server pipes into the new
//!    node, which keeps it aside;
//! 3. the old node destroys the machine (keeping the snapshot), the volumes it mounts
//!    move to the new node (`route::volume_move`, all or none), then the new node starts
//!    the sandbox from its copy, its volumes mounted: never two machines of one sandbox at
//!    once;
//! 4. one transaction (`Store::move_placement`) makes the new node the sandbox's, at that
//!    node's epoch, and gives the old node's reservation back; only if the placement is
//!    still the old node's (a sandbox deleted or lost meanwhile is not resurrected: the new
//!    copy is destroyed);
//! 5. the old node drops its snapshot.
//!
//! Then each volume homed on the node moves to another node (`route::volume_move`; one a
//! sandbox that stayed mounts stays with it).
//!
//! A control replica's own node (`--node local`, "several identical hosts") drains the same
//! way: its steps are served on its node listener, as a joined node's are. Its sandboxes'
//! rows are the fleet's own: the release forgets the old row before the new node starts the
//! sandbox, which writes its own (a row node's) or keeps it in its store (a joined node's).
//! A sandbox made while its server ran alone has no placement and stays (the report says
//! so).
//!
//! A failure before step 4 gives the reservation back, drops what the new node received
//! or made, and lets the sandbox run on where it was (started again from the old node's
//! snapshot when its machine had gone already). Other replicas that cached the old route are
//! answered 404 by the old node and read the route again (`route::forward`).
//!
//! A jail moves cold: its disk comes along, its processes and `/tmp` do not (CRIU does not
//! run on this kernel). A microVM moves with its memory, from a snapshot; on nodes with
//! QEMU 10 or later (or `LOCKER_CARRY_LIVE=1`; `=0` turns it off) a running one moves live: step 2's stream is
//! QEMU's pre-copy migration while its guest runs (`carry`'s live bundle), so the guest
//! stops only for the last copy, the release and the new node's start; its processes go on
//! where they were. The new node restores from the stream landed in a file, not into a
//! QEMU waiting for it (see `docs/deployment.md`).
//!
//! Owns the drain's order and the move's steps; the bundle and the nodes' side are `carry`'s.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, StatusCode};
use locker_store::{NodeRecord, NodeState, PlacementRecord, PlacementState, VolumeRecord};
use serde_json::{json, Value};

use super::placement::{self, Ask};
use super::route::{call_node, destroy_orphan};
use crate::carry::PATH;
use crate::error::ApiError;
use crate::state::AppState;

/// How long a node may take to freeze and snapshot a sandbox before answering.
const EXPORT: Duration = Duration::from_secs(120);
/// How long the new node may take to receive a sandbox and start it.
const IMPORT: Duration = Duration::from_secs(600);
/// Passes over the node's placements: a create another replica placed just before it saw
/// the cordon lands after the first.
const PASSES: usize = 3;
/// The most of a node's answer read (a sandbox's view, an error).
const ANSWER_MAX: usize = 1 << 20;

/// One sandbox moved.
struct Moved {
    to: NodeRecord,
    ms: u64,
    /// Where the time went, in ms: the copy (from the old node's export until the new node
    /// had it all: a microVM's live migration is in it), the old machine's release, the
    /// new one's start, the switch in the store.
    steps: Value,
}

/// Milliseconds since `t`.
fn ms_since(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Drains node `node` (cordoned first): the report `POST /v1/fleet/nodes/{node}/drain`
/// answers.
pub async fn drain(app: &AppState, node: &NodeRecord) -> Result<Value, ApiError> {
    if node.state != NodeState::Ready {
        return Err(ApiError::conflict(format!(
            "node {} is {}: its sandboxes are lost, not drained (see `locker fleet nodes`)",
            node.name,
            node.state.as_str()
        )));
    }
    let started = Instant::now();
    let mut moved = Vec::new();
    // By placement: the last failure of each that did not move in the end.
    let mut failed: std::collections::BTreeMap<String, Value> = Default::default();
    // A sandbox whose move failed is tried once more in the next pass (a microVM whose
    // live move was given up moves cold then).
    let mut tried: std::collections::HashMap<String, usize> = Default::default();
    for pass in 0..PASSES {
        if pass > 0 {
            // Other replicas see the cordon within their node table's age.
            tokio::time::sleep(placement::TABLE_TTL).await;
        }
        let todo: Vec<PlacementRecord> = placements_on(app, &node.id)
            .await?
            .into_iter()
            .filter(|p| {
                p.state == PlacementState::Placed && tried.get(&p.id).is_none_or(|t| *t < 2)
            })
            .collect();
        if todo.is_empty() && pass > 0 {
            break;
        }
        for p in todo {
            *tried.entry(p.id.clone()).or_default() += 1;
            let sb = p.sandbox_id.clone().unwrap_or_default();
            match move_one(app, node, &p).await {
                Ok(m) => {
                    tracing::info!(sandbox = %sb, from = %node.name, to = %m.to.name, ms = m.ms, steps = %m.steps, "sandbox moved");
                    app.events.emit(
                        &p.tenant,
                        crate::events::Kind::SandboxMoved,
                        &sb,
                        json!({"from": node.id, "from_name": node.name, "to": m.to.id, "to_name": m.to.name, "ms": m.ms}),
                    );
                    moved.push(json!({"sandbox": sb, "tenant": p.tenant, "to": m.to.id, "to_name": m.to.name, "ms": m.ms, "steps": m.steps}));
                    failed.remove(&p.id);
                }
                Err(e) => {
                    tracing::warn!(sandbox = %sb, node = %node.name, error = %e, "sandbox not moved");
                    failed.insert(
                        p.id.clone(),
                        json!({"sandbox": sb, "tenant": p.tenant, "error": e}),
                    );
                }
            }
        }
    }
    let mut left = placements_on(app, &node.id).await?.len();
    for (sb, tenant) in unplaced_on(app, node).await? {
        left += 1;
        failed.insert(
            sb.clone(),
            json!({"sandbox": sb, "tenant": tenant, "error": "it was made before its server \
                was a node of the fleet and has no placement, so it does not move: delete it \
                or let it end"}),
        );
    }
    let volumes = volumes_off(app, node).await?;
    Ok(json!({
        "node": node.id,
        "name": node.name,
        "moved": moved,
        "failed": failed.into_values().collect::<Vec<_>>(),
        "left": left,
        "volumes": volumes,
        "ms": u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    }))
}

/// The drain's second part: each volume homed on `node` moved to another joined node
/// (`route::move_off`), after the sandboxes (one that stayed keeps the volumes it mounts
/// there). `{"moved": [{"volume", "name", "tenant", "to", "to_name", "ms"}], "failed":
/// [{"volume", "name", "tenant", "error"}]}`.
async fn volumes_off(app: &AppState, node: &NodeRecord) -> Result<Value, ApiError> {
    let store = app.store.clone();
    let all = tokio::task::spawn_blocking(move || store.list_all_volumes())
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    let (mut moved, mut failed) = (Vec::new(), Vec::new());
    for v in all.into_iter().filter(|v| v.host == node.id) {
        let t = Instant::now();
        match super::route::move_off(app, &v, node).await {
            Ok(to) => {
                tracing::info!(volume = %v.id, from = %node.name, to = %to.name, "volume moved off a drained node");
                moved.push(json!({"volume": v.id, "name": v.name, "tenant": v.tenant, "to": to.id, "to_name": to.name, "ms": ms_since(t)}));
            }
            Err(e) => {
                tracing::warn!(volume = %v.id, node = %node.name, error = %e.message, "volume not moved off a drained node");
                failed.push(
                    json!({"volume": v.id, "name": v.name, "tenant": v.tenant, "error": e.message}),
                );
            }
        }
    }
    Ok(json!({"moved": moved, "failed": failed}))
}

/// The live sandboxes of control replica `node`'s own node (`--node local`) that have no
/// placement (made while its server ran alone, before it joined the fleet): `(id, tenant)`.
async fn unplaced_on(app: &AppState, node: &NodeRecord) -> Result<Vec<(String, String)>, ApiError> {
    if !super::local::is_own_node(node) {
        return Ok(Vec::new());
    }
    let (store, n) = (app.store.clone(), node.id.clone());
    let rows = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        for r in store.list_live_sandboxes()? {
            if r.host == n && store.get_placement(&r.id)?.is_none() {
                out.push((r.id, r.tenant));
            }
        }
        Ok::<_, locker_store::StoreError>(out)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok(rows)
}

async fn placements_on(app: &AppState, node: &str) -> Result<Vec<PlacementRecord>, ApiError> {
    let (store, n) = (app.store.clone(), node.to_owned());
    Ok(
        tokio::task::spawn_blocking(move || store.list_placements(None, Some(&n)))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??,
    )
}

/// A node's answer's body, as text (an error's message when it is the API's JSON).
async fn answer_text(resp: axum::response::Response) -> (StatusCode, String) {
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), ANSWER_MAX)
        .await
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let text = v["error"]["message"]
        .as_str()
        .or(v["message"].as_str())
        .map_or_else(
            || String::from_utf8_lossy(&bytes).into_owned(),
            str::to_owned,
        );
    (status, text)
}

/// Carries placed sandbox `p` from `from` to another node.
async fn move_one(app: &AppState, from: &NodeRecord, p: &PlacementRecord) -> Result<Moved, String> {
    let started = Instant::now();
    let sb = p
        .sandbox_id
        .clone()
        .ok_or("the placement names no sandbox")?;
    let view: Value = serde_json::from_str(&p.view).unwrap_or(Value::Null);
    let mounts = mounted_volumes(&view);
    let ask = Ask {
        memory_mb: p.memory_mb,
        disk_mb: view["disk_mb"].as_u64().unwrap_or(0),
        template_digest: view["template_digest"].as_str().map(str::to_owned),
        only: None,
        carried: true,
    };
    let (into, to) = placement::place(app, &p.tenant, &ask)
        .await
        .map_err(|e| format!("no node can take it: {}", e.message))?;
    let give_back = |why: String| {
        let id = into.id.clone();
        async move {
            placement::unplace(app, &id).await;
            why
        }
    };
    let placed = format!("placement={}", into.id);
    let t_copy = Instant::now();
    // 2. Frozen and streamed from the old node into the new one, which keeps it aside.
    let export = match call(
        app,
        &p.tenant,
        from,
        Method::POST,
        format!("{PATH}{sb}/export"),
        Body::empty(),
        EXPORT,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => return Err(give_back(format!("its node would not give it up: {e}")).await),
    };
    let received = call(
        app,
        &p.tenant,
        &to,
        Method::POST,
        format!("{PATH}receive?{placed}"),
        export.into_body(),
        IMPORT,
    )
    .await;
    if let Err(e) = received {
        stay(app, from, p, &sb).await;
        return Err(give_back(format!("the copy did not arrive: {e}")).await);
    }
    let copy_ms = ms_since(t_copy);
    let t_release = Instant::now();
    // 3. The old machine goes before the new one starts (the old node keeps the snapshot
    // until the end).
    if let Err(e) = call(
        app,
        &p.tenant,
        from,
        Method::POST,
        format!("{PATH}{sb}/release"),
        Body::empty(),
        EXPORT,
    )
    .await
    {
        drop_received(app, &p.tenant, &to, &sb, &placed).await;
        stay(app, from, p, &sb).await;
        return Err(give_back(format!("its node would not let it go: {e}")).await);
    }
    let release_ms = ms_since(t_release);
    // The volumes it mounts go first, its machine gone (their files leave while nothing
    // writes them).
    let t_volumes = Instant::now();
    if let Err(e) = volumes_along(app, &p.tenant, &mounts, (from, &to)).await {
        drop_received(app, &p.tenant, &to, &sb, &placed).await;
        stay(app, from, p, &sb).await;
        return Err(give_back(format!("its volumes did not move: {e}")).await);
    }
    let volumes_ms = ms_since(t_volumes);
    let t_start = Instant::now();
    let view = match start_on(app, &p.tenant, &to, &sb, &placed).await {
        Ok(v) => v,
        Err(e) => {
            // Its volumes back where it runs on.
            if let Err(back) = volumes_along(app, &p.tenant, &mounts, (&to, from)).await {
                tracing::warn!(sandbox = %sb, error = %back, "the volumes of a sandbox that did not move stay on the node it was to go to");
            }
            stay(app, from, p, &sb).await;
            return Err(give_back(e).await);
        }
    };
    let start_ms = ms_since(t_start);
    let t_switch = Instant::now();
    // 4. The switch, only if the sandbox is still the old node's.
    let (store, pid, from_id, epoch, into_id, v) = (
        app.store.clone(),
        p.id.clone(),
        from.id.clone(),
        p.epoch,
        into.id.clone(),
        view,
    );
    let switched = tokio::task::spawn_blocking(move || {
        store.move_placement(
            &pid,
            (&from_id, epoch, PlacementState::Placed),
            &into_id,
            &v,
        )
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r.map_err(|e| e.to_string()));
    let failed = match switched {
        Ok(Some(_)) => None,
        // Deleted or lost while it moved: the new copy goes, and the old stays gone.
        Ok(None) => Some("it was deleted or lost while it moved".to_owned()),
        Err(e) => Some(format!("recording its new node failed: {e}")),
    };
    if let Some(c) = app.fleet.as_ref() {
        c.routes.forget(&sb);
    }
    if let Some(why) = failed {
        let _ = destroy_orphan(app, &to, &sb).await;
        if why.starts_with("recording") {
            stay(app, from, p, &sb).await;
        } else {
            let _ = call(
                app,
                &p.tenant,
                from,
                Method::POST,
                format!("{PATH}{sb}/moved"),
                Body::empty(),
                EXPORT,
            )
            .await;
        }
        return Err(give_back(why).await);
    }
    // 5. The old node lets go of its snapshot.
    if let Err(e) = call(
        app,
        &p.tenant,
        from,
        Method::POST,
        format!("{PATH}{sb}/moved"),
        Body::empty(),
        EXPORT,
    )
    .await
    {
        tracing::warn!(sandbox = %sb, node = %from.name, error = %e, "the old node keeps a moved sandbox's snapshot until its next start");
    }
    let switch_ms = ms_since(t_switch);
    Ok(Moved {
        to,
        ms: ms_since(started),
        steps: json!({"copy_ms": copy_ms, "release_ms": release_ms, "volumes_ms": volumes_ms, "start_ms": start_ms, "switch_ms": switch_ms}),
    })
}

/// The ids of the volumes a sandbox's view says it mounts.
fn mounted_volumes(view: &Value) -> Vec<String> {
    view["volumes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(|m| m["volume"].as_str().map(str::to_owned))
        .collect()
}

/// Moves volumes `ids` of `tenant` from `from` to `to` (`route::move_volume`), all or none:
/// those moved go back when one does not.
async fn volumes_along(
    app: &AppState,
    tenant: &str,
    ids: &[String],
    (from, to): (&NodeRecord, &NodeRecord),
) -> Result<(), String> {
    let mut moved: Vec<VolumeRecord> = Vec::new();
    let mut failed = None;
    for id in ids {
        let (store, t, v) = (app.store.clone(), tenant.to_owned(), id.clone());
        let rec = match tokio::task::spawn_blocking(move || store.get_volume(&t, &v)).await {
            Ok(Ok(Some(r))) if r.host == from.id => r,
            Ok(Ok(Some(r))) if r.host == to.id => continue,
            Ok(Ok(_)) => {
                failed = Some(format!("volume {id} is not on node {}", from.name));
                break;
            }
            Ok(Err(e)) => {
                failed = Some(e.to_string());
                break;
            }
            Err(e) => {
                failed = Some(e.to_string());
                break;
            }
        };
        match super::route::move_volume(app, &rec, from, to).await {
            Ok(()) => moved.push(rec),
            Err(e) => {
                failed = Some(format!("volume {}: {}", rec.name, e.message));
                break;
            }
        }
    }
    let Some(why) = failed else {
        return Ok(());
    };
    for rec in moved {
        if let Err(e) = super::route::move_volume(app, &rec, to, from).await {
            tracing::warn!(volume = %rec.id, error = %e.message, "a volume of a sandbox that did not move stays on the node it was to go to");
        }
    }
    Err(why)
}

/// Node `to` starts sandbox `sb` from what it received for placement query `placed`: the
/// sandbox's view as `to` answered it, or why not (a copy whose answer was cut is
/// destroyed there).
pub(super) async fn start_on(
    app: &AppState,
    tenant: &str,
    to: &NodeRecord,
    sb: &str,
    placed: &str,
) -> Result<String, String> {
    let path = format!("{PATH}{sb}/start?{placed}");
    let r = call(app, tenant, to, Method::POST, path, Body::empty(), IMPORT)
        .await
        .map_err(|e| format!("it did not start: {e}"))?;
    match axum::body::to_bytes(r.into_body(), ANSWER_MAX).await {
        Ok(v) => Ok(String::from_utf8_lossy(&v).into_owned()),
        Err(_) => {
            let _ = destroy_orphan(app, to, sb).await;
            Err(format!("node {}'s answer was cut", to.name))
        }
    }
}

/// Node `to` drops what it received of sandbox `sb` for placement query `placed`.
pub(super) async fn drop_received(
    app: &AppState,
    tenant: &str,
    to: &NodeRecord,
    sb: &str,
    placed: &str,
) {
    let path = format!("{PATH}{sb}?{placed}");
    let _ = call(app, tenant, to, Method::DELETE, path, Body::empty(), EXPORT).await;
}

/// The move failed after the old node froze the sandbox: it runs on there.
async fn stay(app: &AppState, from: &NodeRecord, p: &PlacementRecord, sb: &str) {
    let path = format!("{PATH}{sb}/stay");
    if let Err(e) = call(
        app,
        &p.tenant,
        from,
        Method::POST,
        path,
        Body::empty(),
        EXPORT,
    )
    .await
    {
        tracing::warn!(sandbox = %sb, node = %from.name, error = %e, "a sandbox that did not move may stay frozen");
    }
}

/// Control's call to node `n` for `tenant`: its answer when it succeeded, else why not.
pub(super) async fn call(
    app: &AppState,
    tenant: &str,
    n: &NodeRecord,
    method: Method,
    path: String,
    body: Body,
    wait: Duration,
) -> Result<axum::response::Response, String> {
    match call_node(app, n, tenant, (method, &path), body, Some(wait)).await {
        Ok(r) if r.status().is_success() => Ok(r),
        Ok(r) => {
            let (s, m) = answer_text(r).await;
            Err(format!("node {} answered {s}: {m}", n.name))
        }
        Err(e) => Err(format!("node {} cannot be reached: {e}", n.name)),
    }
}
