//! A dead node's sandboxes started again elsewhere from their last snapshot (`FLEET.md`
//! §4.5, "restart from a snapshot in shared storage").
//!
//! With `--snapshot-store DIR` (a directory every control replica of the fleet can read and
//! write: an NFS or CephFS mount, a mounted bucket; one replica's disk for a fleet with one
//! replica):
//! - each snapshot a joined node takes of a sandbox ([`keep`], after the node answered it
//!   and the fleet recorded it), or a control replica's own node (`--node local`,
//!   [`keep_here`], from its own disk once it recorded it), is kept there as a carry bundle
//!   with the sandbox's record as it was then, dated when the snapshot was taken, stored
//!   once per distinct piece (`snapshot_store`: a sandbox's snapshots, and sandboxes of one
//!   template, share what they have in common); deleting the snapshot lets it go
//!   ([`forget`]);
//! - when a node is declared dead, the leader's sweeper ([`lost`]) takes each of its lost
//!   sandboxes that has such a copy (its newest), places it on another joined node that
//!   holds its template ([`Ask::carried`]), sends it there (`carry`'s `receive` and
//!   `start`: the sandbox's own id, times, metadata and preview token), then one
//!   transaction (`Store::move_placement` from `lost`) makes it that node's, placed again
//!   (a replica's own node left the sandbox's row in this store: it is removed before the
//!   start, and written back if the start fails);
//!   a `sandbox.restarted` event says so. A jail comes back with the files of its snapshot
//!   (not what it wrote since), a microVM with its memory too (its processes as they were
//!   then). A sandbox without a copy stays lost; one whose restart failed (no node had
//!   room) is tried again every [`RETRY`] while it is lost and has not expired.
//!
//! A returning dead node destroys its old copy (its placement is no longer the node's:
//! `control`'s return). The copy is taken after the snapshot's answer, so a node that dies
//! within that copy's time is restarted from the snapshot before (or lost).
//!
//! Owns the files under the snapshot store. Placement is `placement`'s, the bundle and the
//! nodes' side `carry`'s.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Method;
use locker_store::{NodeRecord, PlacementRecord, PlacementState};
use serde_json::{json, Value};

use super::drain::call;
use super::placement::{self, Ask};
use super::route::destroy_orphan;
use super::snapshot_store;
use crate::carry::PATH;
use crate::state::{now_s, AppState};

/// How long a node may take to answer a snapshot's bundle, or to take a sandbox in.
const COPY: Duration = Duration::from_secs(600);
/// How soon a failed restart is tried again.
pub const RETRY: Duration = Duration::from_secs(10);

/// The snapshot store, when this server has one.
fn store_dir(app: &AppState) -> Option<&Path> {
    app.fleet.as_ref()?.snapshot_store.as_deref()
}

/// Whether `snap` is shaped like a snapshot id (it names a file here).
fn snapshot_id(snap: &str) -> bool {
    snap.strip_prefix("snap_").is_some_and(|rest| {
        (1..=64).contains(&rest.len()) && rest.bytes().all(|b| b.is_ascii_alphanumeric())
    })
}

/// Copies snapshot `snap` of `tenant`'s sandbox `sandbox`, just taken on joined node
/// `node_id`, into the snapshot store (in the background; nothing without a store).
pub fn keep(app: &AppState, node_id: &str, tenant: &str, sandbox: &str, snap: &str) {
    let Some(dir) = store_dir(app).map(Path::to_path_buf) else {
        return;
    };
    if !snapshot_id(snap) {
        return;
    }
    let (app, node_id, tenant, sandbox, snap) = (
        app.clone(),
        node_id.to_owned(),
        tenant.to_owned(),
        sandbox.to_owned(),
        snap.to_owned(),
    );
    let taken = std::time::SystemTime::now();
    tokio::spawn(async move {
        let started = Instant::now();
        match copy(&app, &dir, (&node_id, &tenant, &sandbox, &snap), taken).await {
            Ok(bytes) => tracing::info!(
                snapshot = %snap, sandbox = %sandbox, bytes,
                ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                "snapshot kept in the snapshot store"
            ),
            Err(e) => {
                tracing::warn!(snapshot = %snap, sandbox = %sandbox, error = %e, "snapshot not kept in the snapshot store: its sandbox cannot be restarted from it should its node die")
            }
        }
    });
}

/// Copies snapshot `snap` of `tenant`'s sandbox `sandbox`, just taken here by this control
/// replica's own node (`--node local`), into the snapshot store, from this server's own
/// disk (in the background; nothing without a store or without an own node).
pub fn keep_here(app: &AppState, tenant: &str, sandbox: &str, snap: &str) {
    let own = app.fleet.as_ref().and_then(|c| c.local_node_id());
    let (Some(dir), Some(_)) = (store_dir(app).map(Path::to_path_buf), own) else {
        return;
    };
    let (app, tenant, sandbox, snap) = (
        app.clone(),
        tenant.to_owned(),
        sandbox.to_owned(),
        snap.to_owned(),
    );
    let taken = std::time::SystemTime::now();
    tokio::spawn(async move {
        let caller = crate::auth::Caller {
            tenant,
            key_id: "fleet".into(),
        };
        let bundle = crate::carry::snapshot_bundle(&app, &caller, &sandbox, &snap)
            .await
            .map_err(|e| e.message);
        let written = match bundle {
            Ok(resp) => write_bundle(&dir, &snap, resp, taken).await,
            Err(e) => Err(e),
        };
        match written {
            Ok(bytes) => {
                tracing::info!(snapshot = %snap, sandbox = %sandbox, bytes, "snapshot kept in the snapshot store")
            }
            Err(e) => {
                tracing::warn!(snapshot = %snap, sandbox = %sandbox, error = %e, "snapshot not kept in the snapshot store: its sandbox cannot be restarted from it should this server die")
            }
        }
    });
}

/// [`keep`]'s copy of snapshot `snap` of `tenant`'s `sandbox` on node `node_id`, dated
/// `taken` (the file's modification time orders a sandbox's snapshots): the bytes written.
async fn copy(
    app: &AppState,
    dir: &Path,
    (node_id, tenant, sandbox, snap): (&str, &str, &str, &str),
    taken: std::time::SystemTime,
) -> Result<u64, String> {
    let (nodes, _) = placement::nodes(app, false).await.map_err(|e| e.message)?;
    let node = nodes
        .into_iter()
        .find(|n| n.id == node_id)
        .ok_or_else(|| format!("node {node_id} left the fleet"))?;
    let resp = call(
        app,
        tenant,
        &node,
        Method::GET,
        format!("{PATH}{sandbox}/snapshots/{snap}"),
        Body::empty(),
        COPY,
    )
    .await?;
    write_bundle(dir, snap, resp, taken).await
}

/// Keeps bundle `resp` of snapshot `snap` in the store `dir`, dated `taken`: the bytes it
/// holds (and, logged, how many of them the store did not hold yet).
async fn write_bundle(
    dir: &Path,
    snap: &str,
    resp: axum::response::Response,
    taken: std::time::SystemTime,
) -> Result<u64, String> {
    let body = resp.into_body().into_data_stream();
    let put = snapshot_store::put(dir, snap, body, taken)
        .await
        .map_err(|e| format!("writing into {}: {e}", dir.display()))?;
    tracing::debug!(snapshot = %snap, bytes = put.bytes, new_bytes = put.new_bytes, pieces = put.pieces, "snapshot store: pieces written");
    Ok(put.bytes)
}

/// Lets go of snapshot `snap`'s copy (the snapshot was deleted), then, in the background, of
/// the pieces only it held.
pub fn forget(app: &AppState, snap: &str) {
    if let Some(dir) = store_dir(app).map(Path::to_path_buf) {
        if snapshot_id(snap) {
            snapshot_store::forget(&dir, snap);
            tokio::task::spawn_blocking(move || snapshot_store::sweep_pieces(&dir));
        }
    }
}

/// Restarts, elsewhere, the lost sandboxes that have a copy of a snapshot in the store
/// (the leader's sweeper calls it after each death, and every [`RETRY`]); one at a time
/// per sandbox, each in its own task.
pub async fn lost(app: &AppState) {
    let (Some(dir), Some(c)) = (store_dir(app).map(Path::to_path_buf), app.fleet.as_ref()) else {
        return;
    };
    let store = app.store.clone();
    let found = tokio::task::spawn_blocking(move || {
        let lost: Vec<PlacementRecord> = store
            .list_placements(None, None)?
            .into_iter()
            .filter(|p| p.state == PlacementState::Lost && p.sandbox_id.is_some())
            .collect();
        let mut out = Vec::new();
        let mut snaps: HashMap<String, Vec<locker_store::SnapshotRecord>> = HashMap::new();
        for p in lost {
            if !snaps.contains_key(&p.tenant) {
                snaps.insert(p.tenant.clone(), store.list_snapshots(&p.tenant)?);
            }
            let sb = p.sandbox_id.as_deref().unwrap_or_default();
            // Newest by when it was taken (its copy's time: `created_at` counts seconds).
            let newest = snaps[&p.tenant]
                .iter()
                .filter(|s| s.sandbox_id == sb)
                .filter_map(|s| snapshot_store::find(&dir, &s.id))
                .max_by_key(|k| k.taken);
            if let Some(kept) = newest {
                out.push((p, kept));
            }
        }
        Ok::<_, locker_store::StoreError>(out)
    })
    .await;
    let found = match found {
        Ok(Ok(f)) => f,
        Ok(Err(e)) => {
            return tracing::warn!(error = %e, "cannot read the lost sandboxes to restart")
        }
        Err(e) => return tracing::warn!(error = %e, "cannot read the lost sandboxes to restart"),
    };
    for (p, kept) in found {
        let sb = p.sandbox_id.clone().unwrap_or_default();
        {
            let mut tries = c.restarts.lock().expect("restarts lock");
            if tries.get(&sb).is_some_and(|t| t.elapsed() < RETRY) {
                continue;
            }
            tries.insert(sb.clone(), Instant::now());
        }
        let app = app.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            match restart(&app, &p, &kept).await {
                Ok(Some(to)) => {
                    let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                    let snapshot = &kept.snap;
                    tracing::warn!(sandbox = %sb, to = %to.name, snapshot, ms, "a sandbox lost with its node restarted elsewhere from its snapshot");
                    app.events.emit(
                        &p.tenant,
                        crate::events::Kind::SandboxRestarted,
                        &sb,
                        json!({"from": p.node_id, "to": to.id, "to_name": to.name, "snapshot": snapshot, "ms": ms}),
                    );
                    if let Some(c) = app.fleet.as_ref() {
                        c.restarts.lock().expect("restarts lock").remove(&sb);
                    }
                }
                // Expired, or deleted meanwhile: it stays as it is.
                Ok(None) => {
                    if let Some(c) = app.fleet.as_ref() {
                        c.restarts.lock().expect("restarts lock").remove(&sb);
                    }
                }
                Err(e) => {
                    tracing::warn!(sandbox = %sb, error = %e, "a sandbox lost with its node could not be restarted elsewhere: trying again in {}s", RETRY.as_secs())
                }
            }
        });
    }
}

/// Restarts lost placement `p` from its snapshot's copy `kept`: the node it runs on now, or
/// `None` when there is nothing to do (expired; deleted or restarted meanwhile).
async fn restart(
    app: &AppState,
    p: &PlacementRecord,
    kept: &snapshot_store::Kept,
) -> Result<Option<NodeRecord>, String> {
    let sb = p.sandbox_id.clone().unwrap_or_default();
    let copy = kept.clone();
    let rec = tokio::task::spawn_blocking(move || crate::carry::record_in(copy.reader()?))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("the copy of snapshot {}: {e}", kept.snap))?;
    if rec.id != sb || rec.tenant != p.tenant {
        return Err(format!(
            "the copy of snapshot {} holds another sandbox",
            kept.snap
        ));
    }
    if locker_types::parse_rfc3339(&rec.expires_at).is_some_and(|exp| exp <= now_s()) {
        return Ok(None);
    }
    let view: Value = serde_json::from_str(&p.view).unwrap_or(Value::Null);
    let ask = Ask {
        memory_mb: p.memory_mb,
        disk_mb: view["disk_mb"].as_u64().unwrap_or(rec.disk_mb),
        template_digest: Some(rec.template_digest.clone()),
        only: None,
        carried: true,
    };
    let (into, to) = placement::place(app, &p.tenant, &ask)
        .await
        .map_err(|e| format!("no node can take it: {}", e.message))?;
    let placed = format!("placement={}", into.id);
    let landed = async {
        let body = kept
            .body()
            .await
            .map_err(|e| format!("the copy of snapshot {}: {e}", kept.snap))?;
        call(
            app,
            &p.tenant,
            &to,
            Method::POST,
            format!("{PATH}receive?{placed}"),
            body,
            COPY,
        )
        .await?;
        // A control replica's own node wrote the sandbox's row into this store: it goes
        // before the new node starts the sandbox (a replica's node writes its own).
        let row = take_row(app, &sb, &p.node_id).await?;
        let started = super::drain::start_on(app, &p.tenant, &to, &sb, &placed).await;
        if let (Err(_), Some(row)) = (&started, row) {
            put_row_back(app, row).await;
        }
        started
    }
    .await;
    let view = match landed {
        Ok(v) => v,
        Err(e) => {
            super::drain::drop_received(app, &p.tenant, &to, &sb, &placed).await;
            let _ = destroy_orphan(app, &to, &sb).await;
            placement::unplace(app, &into.id).await;
            return Err(e);
        }
    };
    let (store, pid, from, epoch, into_id) = (
        app.store.clone(),
        p.id.clone(),
        p.node_id.clone(),
        p.epoch,
        into.id.clone(),
    );
    let switched = tokio::task::spawn_blocking(move || {
        store.move_placement(&pid, (&from, epoch, PlacementState::Lost), &into_id, &view)
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r.map_err(|e| e.to_string()));
    if let Some(c) = app.fleet.as_ref() {
        c.routes.forget(&sb);
    }
    match switched {
        Ok(Some(_)) => Ok(Some(to)),
        other => {
            let _ = destroy_orphan(app, &to, &sb).await;
            placement::unplace(app, &into.id).await;
            match other {
                Ok(_) => Ok(None),
                Err(e) => Err(format!("recording its new node failed: {e}")),
            }
        }
    }
}

/// The row dead node `node` (a control replica's own) left of sandbox `sb` in this store,
/// removed; `None` when there is none (a joined node keeps its rows in its own store).
async fn take_row(
    app: &AppState,
    sb: &str,
    node: &str,
) -> Result<Option<locker_store::SandboxRecord>, String> {
    let (store, sb, node) = (app.store.clone(), sb.to_owned(), node.to_owned());
    tokio::task::spawn_blocking(move || {
        let Some(row) = store.get_sandbox_any(&sb)?.filter(|r| r.host == node) else {
            return Ok(None);
        };
        store.forget_sandbox(&sb)?;
        Ok(Some(row))
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e: locker_store::StoreError| format!("removing the dead node's row: {e}"))
}

/// [`take_row`]'s row written back: the restart failed, the sandbox stays lost with it.
async fn put_row_back(app: &AppState, row: locker_store::SandboxRecord) {
    let (store, id) = (app.store.clone(), row.id.clone());
    let back = tokio::task::spawn_blocking(move || {
        // What a start that failed half way left of it on the new node.
        store.forget_sandbox(&row.id)?;
        store.insert_sandbox(&row)
    })
    .await;
    if !matches!(back, Ok(Ok(()))) {
        tracing::warn!(sandbox = %id, result = ?back, "the row of a lost sandbox whose restart failed could not be written back");
    }
}

/// Removes what a copy cut short left, copies of snapshots the fleet no longer has, and the
/// pieces no copy names (`snapshot_store::sweep`); once per start of a control replica.
pub async fn tidy(app: &AppState) {
    let Some(dir) = store_dir(app).map(Path::to_path_buf) else {
        return;
    };
    let store = app.store.clone();
    let r = tokio::task::spawn_blocking(move || {
        let mut known = std::collections::HashSet::new();
        for t in store.list_tenants()? {
            known.extend(store.list_snapshots(&t)?.into_iter().map(|s| s.id));
        }
        // Old enough that no copy of another replica is under way (a shared store).
        snapshot_store::sweep(&dir, |s| !snapshot_id(s) || known.contains(s), COPY * 2)
            .map_err(|e| locker_store::StoreError::Invalid(e.to_string()))
    })
    .await;
    match r {
        Ok(Ok(s)) if s.copies + s.pieces > 0 => tracing::info!(
            copies = s.copies,
            pieces = s.pieces,
            bytes = s.bytes,
            "the snapshot store let go of copies no snapshot has, and of pieces no copy names"
        ),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "the snapshot store could not be tidied"),
        Err(e) => tracing::warn!(error = %e, "the snapshot store could not be tidied"),
    }
}
