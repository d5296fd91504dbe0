//! Snapshots and forks of sandboxes.
//!
//! A jail snapshot is a copy of the sandbox's disk image (its writable layer; the template
//! is shared by digest), taken with the sandbox frozen and its filesystem flushed, so it is
//! one consistent point even while commands run. The copy is a reflink where the data dir's
//! filesystem allows (btrfs, XFS), otherwise a sparse copy. `/tmp` (memory) and processes
//! are not part of it: the jail has no memory snapshots (`has_memory: false`).
//! A sandbox started from a snapshot (or forked) copies nothing: the snapshot's image, and
//! those of the snapshots beneath it, are read-only lower layers of its overlay, linked
//! into its directory (see `locker_runtime::disk::stack_of`).
//! A microVM snapshot holds the guest's memory and device state (`memory`) and its disk
//! the same way: the sandbox's own image (a raw `disk.img`, or the qcow2 overlay
//! `disk.qcow2` of a sandbox that stood on a snapshot) over the layers it stood on, linked;
//! a sandbox started from it stands on those under a blank overlay of its own (see
//! `locker_runtime::vm`, "Disks"). Snapshots are root's alone (the directory is 0700): a
//! microVM's QEMU, which runs as its machine's uid, reads its layers through its own
//! directory only.
//! A snapshot lives on after its sandbox is deleted, until it is deleted itself; deleting
//! it while sandboxes or later snapshots stand on it is allowed: they hold links to its
//! image, whose blocks go with the last of them.
//!
//! A snapshot's directory (`<data-dir>/snapshots/<id>/`) is whole once its record exists:
//! the record is written after the copy. A server killed during a copy leaves a directory
//! without a record (or a fork's point, `.fork-…`); the next start removes those
//! ([`cleanup`]), and the sandbox, frozen for the copy, is thawed when it is adopted.

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{delete, get, post};
use axum::Router;
use locker_store::SnapshotRecord;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::Json;
use crate::lifecycle::{launch, live_quiet, record_of, NewSandbox};
use crate::sandboxes::view;
use crate::state::{new_id, now_s, AppState, Live};
use locker_types::Runtime;

/// The most sandboxes one fork makes.
pub const MAX_FORK: u64 = 100;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/snapshots", post(create))
        .route("/v1/sandboxes/{id}/fork", post(fork))
        .route("/v1/snapshots", get(list))
        .route("/v1/snapshots/{id}", delete(remove))
}

/// The API's view of a snapshot.
pub fn snapshot_view(s: &SnapshotRecord) -> Value {
    json!({
        "id": s.id,
        "sandbox_id": s.sandbox_id,
        "template": s.template,
        "template_digest": s.template_digest,
        "runtime": s.runtime,
        "size_bytes": s.size_bytes,
        "has_memory": s.has_memory,
        "disk_mb": s.disk_mb,
        "created_at": s.created_at,
    })
}

/// Creates snapshot directory `dir`, its parent (every snapshot's) root's alone: a
/// microVM's QEMU reads the layers it stands on through its own directory, and no
/// machine's uid may reach another's snapshots (nor the memory they hold).
pub(crate) fn make_dir(dir: &std::path::Path) -> Result<(), ApiError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| ApiError::internal(format!("create {}: {e}", dir.display())))?;
    if let Some(all) = dir.parent() {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(all, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| ApiError::internal(format!("chmod {}: {e}", all.display())))?;
    }
    Ok(())
}

/// Takes a snapshot of `live` into `dir` (created; removed again on failure): the bytes it
/// takes and whether it holds memory (a microVM's). A microVM whose volumes are mounted
/// holds their requests for the moment of its save, and its file server's table goes in
/// the snapshot (`Node::hold_shares`): a sandbox from it starts with the same volumes at
/// the same paths, its guest's open files and directories going on in them as they are
/// by then.
pub(crate) async fn take(
    app: &AppState,
    live: &Live,
    dir: PathBuf,
) -> Result<(u64, bool), ApiError> {
    let taken = take_for_move(app, live, dir).await;
    if taken.is_ok() {
        release_shares(app, live).await;
    }
    taken
}

/// [`take`] for a move (`carry`): a microVM whose volumes are mounted is snapshotted too,
/// its mounts held and its file server's table taken along (`Node::hold_shares`; the
/// volumes move with it). The hold lasts until the move ends: [`release_shares`] if it
/// stays.
pub(crate) async fn take_for_move(
    app: &AppState,
    live: &Live,
    dir: PathBuf,
) -> Result<(u64, bool), ApiError> {
    make_dir(&dir)?;
    if let Err(e) = app.node.hold_shares(&live.machine, &dir).await {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(held_refused(e));
    }
    let taken = take_into(app, live, &dir).await;
    if taken.is_err() {
        release_shares(app, live).await;
    }
    taken
}

/// Why the volume mounts of a microVM could not be held: an agent of an earlier release
/// cannot (409); anything else is the node's failure.
fn held_refused(e: locker_runtime::node::NodeError) -> ApiError {
    match e {
        locker_runtime::node::NodeError::Unavailable(_, why) => ApiError::conflict(format!(
            "the sandbox's volume mounts cannot be held for its snapshot: {why}"
        )),
        e => ApiError::during("holding the sandbox's volume mounts for its snapshot")(e),
    }
}

/// Lifts a move's hold of a microVM's volume mounts ([`take_for_move`]): it stays.
pub(crate) async fn release_shares(app: &AppState, live: &Live) {
    if let Err(e) = app.node.release_shares(&live.machine).await {
        tracing::warn!(sandbox = %live.id, error = %e, "the volume mounts of a microVM that stays could not be let go: its volume calls wait");
    }
}

async fn take_into(
    app: &AppState,
    live: &Live,
    dir: &std::path::Path,
) -> Result<(u64, bool), ApiError> {
    match app.node.snapshot(&live.machine, dir).await {
        Ok(r) => Ok(r),
        Err(e) => {
            let _ = std::fs::remove_dir_all(dir);
            Err(ApiError::during("taking the snapshot failed")(e))
        }
    }
}

async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let snap = snapshot_sandbox(&app, &caller, &id).await?;
    Ok((StatusCode::CREATED, axum::Json(snapshot_view(&snap))))
}

/// Takes a snapshot of the caller's sandbox `id` and records it: the door for other
/// protocols' snapshots (`e2b`).
pub(crate) async fn snapshot_sandbox(
    app: &AppState,
    caller: &Caller,
    id: &str,
) -> Result<SnapshotRecord, ApiError> {
    let live = live_quiet(app, caller, id).await?;
    let rec = record_of(app, caller, id)?;
    let snap_id = new_id("snap_");
    let dir = app.snapshots_dir().join(&snap_id);
    let (size_bytes, has_memory) = take(app, &live, dir.clone()).await?;
    // The secrets go with it by name (and placeholder), never by value.
    if let Err(e) = crate::secrets::save_for_snapshot(&dir, &rec.env) {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(ApiError::internal(e));
    }
    let snap = SnapshotRecord {
        id: snap_id,
        tenant: caller.tenant.clone(),
        sandbox_id: id.to_owned(),
        template: rec.template,
        template_digest: rec.template_digest,
        runtime: rec.runtime,
        size_bytes,
        has_memory,
        cpus: rec.cpus,
        memory_mb: rec.memory_mb,
        disk_mb: rec.disk_mb,
        created_at: locker_types::rfc3339(now_s()),
        path: dir.display().to_string(),
        host: app.host_id.clone(),
    };
    if let Err(e) = app.store.insert_snapshot(&snap) {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(e.into());
    }
    // A control replica's own node keeps a copy for a restart elsewhere, as control does
    // for joined nodes' snapshots (`fleet::restart`).
    crate::fleet::restart::keep_here(app, &caller.tenant, id, &snap.id);
    app.events.emit(
        &caller.tenant,
        crate::events::Kind::SandboxSnapshotted,
        id,
        json!({"snapshot": snap.id, "size_bytes": snap.size_bytes, "has_memory": snap.has_memory}),
    );
    Ok(snap)
}

/// At start (no request is served yet): removes snapshot directories without a record, the
/// partial copies of snapshots and the fork points a killed server left.
pub async fn cleanup(app: &AppState) {
    let dir = app.snapshots_dir();
    let mut known = std::collections::HashSet::new();
    let tenants = match app.store.list_tenants() {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list snapshots: partial snapshots stay");
            return;
        }
    };
    for t in tenants {
        match app.store.list_snapshots(&t) {
            Ok(snaps) => known.extend(snaps.into_iter().map(|s| s.id)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot list snapshots: partial snapshots stay");
                return;
            }
        }
    }
    let app2 = app.clone();
    let removed = tokio::task::spawn_blocking(move || {
        let app = app2;
        let mut removed = Vec::new();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if known.contains(&name) || crate::carry::keeps(&app, &name) {
                continue;
            }
            match std::fs::remove_dir_all(e.path()) {
                Ok(()) => removed.push(name),
                Err(err) => {
                    tracing::warn!(path = %e.path().display(), error = %err, "cannot remove a partial snapshot")
                }
            }
        }
        removed
    })
    .await
    .unwrap_or_default();
    if !removed.is_empty() {
        tracing::info!(count = removed.len(), snapshots = ?removed, "removed snapshots a stopped server left unfinished");
    }
    crate::carry::watch_released(app);
}

async fn list(State(app): State<AppState>, caller: Caller) -> Result<impl IntoResponse, ApiError> {
    let snaps = app.store.list_snapshots(&caller.tenant)?;
    Ok(axum::Json(
        json!({"snapshots": snaps.iter().map(snapshot_view).collect::<Vec<_>>()}),
    ))
}

async fn remove(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    remove_snapshot(&app, &caller, &id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Deletes the caller's snapshot `id` (404 when it has none of that id).
pub(crate) fn remove_snapshot(app: &AppState, caller: &Caller, id: &str) -> Result<(), ApiError> {
    let snap = app
        .store
        .get_snapshot(&caller.tenant, id)?
        .ok_or_else(|| ApiError::not_found(format!("snapshot {id} does not exist")))?;
    elsewhere(app, &snap)?;
    // Sandboxes started from it, and snapshots of those, hold their own hard links to its
    // image: removing it never affects them, and its blocks go with the last of them.
    app.store.delete_snapshot(&caller.tenant, id)?;
    let _ = std::fs::remove_dir_all(&snap.path);
    Ok(())
}

/// Refuses a snapshot whose files are on another node of the fleet (its control plane
/// routes what is about it there; this server cannot reach them).
pub(crate) fn elsewhere(app: &AppState, snap: &SnapshotRecord) -> Result<(), ApiError> {
    if snap.is_on(&app.host_id) {
        return Ok(());
    }
    Err(ApiError::conflict(format!(
        "snapshot {} lives on fleet node {}, not on this server: use it through the fleet's \
         control plane, which sends what is about it to that node",
        snap.id, snap.host
    )))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    #[serde(default = "one")]
    count: u64,
}

fn one() -> u64 {
    1
}

async fn fork(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(body): Json<ForkBody>,
) -> Result<impl IntoResponse, ApiError> {
    let ok = fork_sandbox(&app, &caller, &id, body.count).await?;
    let items: Vec<Value> = ok.iter().map(|(r, l)| view(&app, r, Some(l))).collect();
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({ "sandboxes": items })),
    ))
}

/// Forks the caller's sandbox `id` into `count` new sandboxes from one consistent point,
/// all or none: the door for other protocols' forks (`e2b`).
pub(crate) async fn fork_sandbox(
    app: &AppState,
    caller: &Caller,
    id: &str,
    count: u64,
) -> Result<Vec<(locker_store::SandboxRecord, Arc<Live>)>, ApiError> {
    if !(1..=MAX_FORK).contains(&count) {
        return Err(ApiError::bad_request(format!(
            "`count` must be between 1 and {MAX_FORK}"
        )));
    }
    let live = live_quiet(app, caller, id).await?;
    let rec = record_of(app, caller, id)?;
    let q = &app.cfg.quotas;
    let running = app.store.count_running(&caller.tenant)?;
    if running + count > q.sandboxes {
        return Err(ApiError::quota(format!(
            "quota exceeded: tenant {} may have {} sandboxes at once ({running} now); fork fewer",
            caller.tenant, q.sandboxes
        )));
    }
    {
        let _guard = app.create_lock.lock().await;
        crate::lifecycle::check_disk_quota(
            app,
            &caller.tenant,
            rec.disk_mb * count,
            &format!("fork of {count} sandboxes"),
        )?;
    }
    let template =
        crate::templates::by_digest(app, &rec.template_digest, &format!("sandbox {id}"))?;
    // One consistent point for every child; the point itself is not kept.
    let point = app.snapshots_dir().join(format!(".fork-{}", new_id("")));
    take(app, &live, point.clone()).await?;
    let new = NewSandbox {
        template_name: rec.template.clone(),
        template,
        runtime: if rec.runtime == Runtime::Microvm.as_str() {
            Runtime::Microvm
        } else {
            Runtime::Jail
        },
        cpus: rec.cpus,
        memory_mb: rec.memory_mb,
        disk_mb: rec.disk_mb,
        ttl_s: rec.ttl_s,
        idle_timeout_s: rec.idle_timeout_s,
        env: rec.env.clone(),
        network: rec.network.clone(),
        metadata: rec.metadata.clone(),
        volumes: crate::sandboxes::resolve_volumes(app, caller, &recorded_volumes(&rec)?)?,
    };
    let children = futures_util::future::join_all(
        (0..count).map(|_| launch(app, caller, &new, Some(point.clone()))),
    )
    .await;
    let _ = std::fs::remove_dir_all(&point);
    let (ok, failed): (Vec<_>, Vec<_>) = children.into_iter().partition(Result::is_ok);
    let ok: Vec<(locker_store::SandboxRecord, Arc<Live>)> =
        ok.into_iter().map(|r| r.expect("partitioned")).collect();
    if let Some(Err(e)) = failed.into_iter().next() {
        // All or nothing: a fork that could not make every child leaves none.
        // They were never announced (no `sandbox.forked`): no `sandbox.deleted` either.
        for (r, _) in &ok {
            let _ = crate::lifecycle::discard(app, r).await;
        }
        return Err(e);
    }
    for (r, _) in &ok {
        app.events.emit(
            &caller.tenant,
            crate::events::Kind::SandboxForked,
            &r.id,
            json!({"from": id}),
        );
    }
    Ok(ok)
}

/// The volumes a sandbox's record says it mounts, as a create's body would name them.
pub(crate) fn recorded_volumes(
    rec: &locker_store::SandboxRecord,
) -> Result<Vec<locker_types::VolumeMount>, ApiError> {
    let list = rec.volumes.as_array().cloned().unwrap_or_default();
    locker_types::VolumeMounts::try_from(list)
        .map(|v| v.0)
        .map_err(|e| ApiError::internal(format!("the record of sandbox {}: {e}", rec.id)))
}
