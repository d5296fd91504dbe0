//! Moving a volume to another server of the fleet (`locker volume move`, `FLEET.md` §4.6):
//! both ends of the move.
//!
//! A volume's files live on one server (its home, `VolumeRecord::host`); every call about
//! it is routed there (`fleet::route::volumes`), so the home answers
//! `POST /v1/volumes/{id}/move {"node"}`, and the target is another control replica that
//! is a node (`--node local`: the servers that hold volumes); to a joined node the home
//! drives the move as control does (`fleet::route::volume_move`, `handoff`). Like a live
//! migration's
//! pre-copy, most of the data moves while the volume is in use:
//!
//! 1. **Copy.** The home takes a read-only snapshot of the volume's filesystem (the first
//!    point; the volume's gate is held only for it) and streams `btrfs send` of the
//!    volume's snapshots, oldest first, each incremental on the one before, then of the
//!    point, to the target's node listener ([`RECEIVE_PATH`], stage `first`). The target
//!    makes a filesystem of the volume's size, its directory marked [`INCOMING`], and
//!    `btrfs receive`s the stream into its `snapshots/` (confined there). Writes and runs go
//!    on meanwhile.
//! 2. **Catch up.** The home takes the gate (writes and commits wait from here), takes the
//!    last point and sends only what changed since the first (stage `last`); the target
//!    receives it, makes the live tree from it (reflinks: no second copy of the data) and
//!    drops both points.
//! 3. **Switch.** Still under the gate, one transaction makes the target the volume's home
//!    (only if it is still this server) and its snapshots' paths the target's. This server
//!    then closes the volume (`Space::close`: a write or a run's commit that waited for
//!    the gate is refused with 503 and nothing written; called again it goes to the new
//!    home), forgets it and removes its files. Runs still running then fail at their
//!    commit, nothing committed.
//!
//! A failure anywhere before the switch leaves the volume where it was and asks the target
//! to discard its copy. A server that stops in the middle leaves a marked directory: at
//! start ([`sweep`]) a copy marked [`INCOMING`] or [`OUTGOING`] is kept only if the fleet's
//! record says the volume is this server's, and removed otherwise. The record is the one
//! truth: a volume is never served by two servers, and never lost while its record names
//! a server that holds it.
//!
//! Owns: the move's handler, the receiving end and the markers. Not the routing (the
//! fleet's), not the filesystem's making (`locker_runtime::volume_fs`).

use std::path::{Path as FsPath, PathBuf};
use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use locker_store::{NodeRecord, NodeState, VolumeRecord, VolumeSnapshotRecord};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{handoff, lookup, running_sandbox_mounting, view, Volume};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::Json;
use crate::state::AppState;

/// Where a node listener receives a moved volume (`PUT …/{id}?stage=first`, then
/// `PUT …/{id}?stage=last&point=NAME`, each with its stream as the body) and discards a
/// copy whose move did not switch (`DELETE …/{id}`).
pub const RECEIVE_PATH: &str = "/internal/volumes/";
/// A volume's directory holding a copy that came by a move not yet switched.
pub const INCOMING: &str = "incoming";
/// A volume's directory whose move away is switching.
pub const OUTGOING: &str = "outgoing";
/// The name of a move's points, in the volume's `snapshots/`.
pub(super) const POINT: &str = ".move-";
/// How long the target may take to answer once the copy's stream is sent.
const COPIED: Duration = Duration::from_secs(600);
/// How long it may take once the catch-up's stream is sent (writes wait meanwhile).
const CAUGHT_UP: Duration = Duration::from_secs(120);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MoveBody {
    /// The target: a node's name or id (`GET /v1/fleet/nodes`).
    node: String,
}

/// `POST /v1/volumes/{id}/move {"node"}`: see the module doc. 200 with the volume (its
/// `node`: the new home) once the home switched.
pub(super) async fn move_volume(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(body): Json<MoveBody>,
) -> Result<Response, ApiError> {
    let (r, v) = lookup(&app, &caller, &id)?;
    if app.fleet.is_none() {
        return Err(ApiError::conflict(
            "a volume moves between the servers of a fleet, and this server runs alone \
             (docs/deployment.md: several hosts on one Postgres, each with --fleet-listen and --node local)",
        ));
    }
    let target = target_node(&app, &body.node)?;
    let answer = |node: &str| {
        let mut out = view(&app, &r, &v);
        out["node"] = json!(node);
        axum::Json(out).into_response()
    };
    if target.id == app.host_id {
        return Ok(answer(&target.id));
    }
    if let Some(sb) = running_sandbox_mounting(&app, &r.id) {
        return Err(mounted(&r, &sb));
    }
    // To a joined node: this replica drives the move as control does between joined nodes
    // (`fleet::route::volume_move`), this server's node the home.
    if !crate::fleet::local::is_own_node(&target) {
        let home = app.store.get_node(&app.host_id)?.ok_or_else(|| {
            ApiError::conflict(
                "this server is no node of the fleet (--node local): its volumes move only \
                 between replicas that are nodes",
            )
        })?;
        let started = std::time::Instant::now();
        crate::fleet::route::move_volume(&app, &r, &home, &target).await?;
        tracing::info!(volume = %r.id, to = %target.name, ms = started.elapsed().as_millis() as u64, "volume moved to a joined node");
        return Ok(answer(&target.id));
    }
    v.start_moving(&r.name)?;
    let started = std::time::Instant::now();
    let moved = move_to(&app, &caller.tenant, &r, &v, &target).await;
    v.moving.store(false, Ordering::Release);
    moved?;
    tracing::info!(volume = %r.id, to = %target.name, ms = started.elapsed().as_millis() as u64, "volume moved");
    Ok(answer(&target.id))
}

/// The module doc's three steps; on success the volume is the target's and this server's
/// copy is gone.
async fn move_to(
    app: &AppState,
    tenant: &str,
    r: &VolumeRecord,
    v: &Volume,
    target: &NodeRecord,
) -> Result<(), ApiError> {
    let mut snaps = app.store.list_volume_snapshots(tenant, &r.id)?;
    snaps.reverse();
    let first = v.root().join("snapshots").join(point_name());
    super::snapshot_live(v, first.clone()).await?;
    let mut chain: Vec<PathBuf> = snaps.iter().map(|s| PathBuf::from(&s.path)).collect();
    chain.push(first.clone());
    if let Err(e) = ship(app, tenant, r, target, (chain, None), "stage=first", COPIED).await {
        super::drop_snapshot(first).await;
        discard_on(app, tenant, &r.id, target).await;
        return Err(e);
    }
    let all = v.space.gate.write().await;
    let switched = catch_up_and_switch(app, tenant, r, v, target, &snaps, &first).await;
    super::drop_snapshot(first).await;
    if let Err(e) = switched {
        drop(all);
        discard_on(app, tenant, &r.id, target).await;
        return Err(e);
    }
    v.space.close();
    app.volumes
        .open
        .write()
        .expect("volumes lock")
        .remove(&r.id);
    drop(all);
    v.stop_agent().await;
    let dir = v.dir.clone();
    let removed =
        tokio::task::spawn_blocking(move || locker_runtime::volume_fs::remove(&dir)).await;
    if !matches!(removed, Ok(Ok(()))) {
        tracing::warn!(volume = %r.id, ?removed, "the moved volume's old files stay (removed at the next start)");
    }
    Ok(())
}

/// Steps 2 and 3 (the caller holds the volume's gate): what changed since `first` goes to
/// the target, then the record switches.
async fn catch_up_and_switch(
    app: &AppState,
    tenant: &str,
    r: &VolumeRecord,
    v: &Volume,
    target: &NodeRecord,
    snaps: &[VolumeSnapshotRecord],
    first: &FsPath,
) -> Result<(), ApiError> {
    if let Some(sb) = running_sandbox_mounting(app, &r.id) {
        return Err(mounted(r, &sb));
    }
    // A snapshot made since the copy began (its record is written under the gate) did not
    // go: the move is refused rather than leave it behind.
    let mut now = app.store.list_volume_snapshots(tenant, &r.id)?;
    now.reverse();
    if now.iter().map(|s| &s.id).ne(snaps.iter().map(|s| &s.id)) {
        return Err(ApiError::conflict(format!(
            "volume {}'s snapshots changed during the move: move it again",
            r.name
        )));
    }
    let name = point_name();
    let last = v.root().join("snapshots").join(&name);
    super::snapshot_held(v, last.clone()).await?;
    let query = format!("stage=last&point={name}");
    let chain = (vec![last.clone()], Some(first.to_owned()));
    let shipped = ship(app, tenant, r, target, chain, &query, CAUGHT_UP).await;
    super::drop_snapshot(last).await;
    let root = shipped?["root"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ApiError::bad_gateway(format!("node {} named no root", target.name)))?;
    let moved: Vec<VolumeSnapshotRecord> = snaps
        .iter()
        .map(|s| VolumeSnapshotRecord {
            path: format!("{root}/snapshots/{}", s.id),
            ..s.clone()
        })
        .collect();
    mark(&v.dir, OUTGOING).await;
    let switched = app
        .store
        .move_volume(tenant, &r.id, &app.host_id, &target.id, &moved);
    if !matches!(switched, Ok(true)) {
        unmark(&v.dir, OUTGOING).await;
    }
    match switched? {
        true => Ok(()),
        false => Err(ApiError::conflict(format!(
            "volume {} changed homes or went away during the move",
            r.name
        ))),
    }
}

pub(super) fn point_name() -> String {
    crate::state::new_id(POINT)
}

pub(super) fn mounted(r: &VolumeRecord, sb: &str) -> ApiError {
    ApiError::conflict(format!(
        "volume {} is mounted by running sandbox {sb}: delete the sandbox before moving the volume",
        r.name
    ))
}

/// The node a move names: another node of the fleet, alive (a joined one not cordoned).
fn target_node(app: &AppState, name: &str) -> Result<NodeRecord, ApiError> {
    let n = app.store.get_node(name)?.ok_or_else(|| {
        ApiError::not_found(format!(
            "no node {name:?} in the fleet (`GET /v1/fleet/nodes` lists them)"
        ))
    })?;
    if n.state != NodeState::Ready {
        return Err(ApiError::unavailable(format!(
            "node {} is not alive now: move the volume when it is back",
            n.name
        )));
    }
    if n.cordoned && !crate::fleet::local::is_own_node(&n) {
        return Err(ApiError::conflict(format!(
            "node {} is cordoned: it takes no new work (uncordon it, or name another)",
            n.name
        )));
    }
    Ok(n)
}

/// Streams `btrfs send` of `chain` (each subvolume incremental on the one before, the
/// first on `base` when given) to `target` with `query`; the target's answer (201).
async fn ship(
    app: &AppState,
    tenant: &str,
    r: &VolumeRecord,
    target: &NodeRecord,
    (chain, base): (Vec<PathBuf>, Option<PathBuf>),
    query: &str,
    answer_within: Duration,
) -> Result<Value, ApiError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(8);
    let sender = tokio::spawn(async move { send_all(chain, base, &tx).await });
    let body = Body::from_stream(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    let path = format!("{RECEIVE_PATH}{}?{query}", r.id);
    let sent = crate::fleet::route::call_node(
        app,
        target,
        tenant,
        (Method::PUT, &path),
        body,
        Some(answer_within),
    )
    .await;
    let sending = sender
        .await
        .unwrap_or_else(|e| Err(format!("the sender stopped: {e}")));
    let resp = sent.map_err(|e| {
        ApiError::bad_gateway(format!("node {} did not take the volume: {e}", target.name))
    })?;
    let status = resp.status();
    let text = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    if let Err(e) = sending {
        return Err(ApiError::internal(format!(
            "sending volume {}'s files: {e}",
            r.id
        )));
    }
    if status != StatusCode::CREATED {
        let why = String::from_utf8_lossy(&text);
        return Err(ApiError::bad_gateway(format!(
            "node {} refused the volume ({status}): {why}",
            target.name
        )));
    }
    serde_json::from_slice(&text)
        .map_err(|e| ApiError::bad_gateway(format!("node {}'s answer: {e}", target.name)))
}

/// `btrfs send` of each subvolume in turn (the first whole or on `base`, each later one on
/// the one before), as one stream into `tx`.
/// A failure is sent into the stream too, so that the receiving end never takes a cut
/// stream for a whole one.
pub(super) async fn send_all(
    subvols: Vec<PathBuf>,
    base: Option<PathBuf>,
    tx: &tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
) -> Result<(), String> {
    let sent = send_each(subvols, base, tx).await;
    if let Err(why) = &sent {
        let _ = tx.send(Err(std::io::Error::other(why.clone()))).await;
    }
    sent
}

async fn send_each(
    subvols: Vec<PathBuf>,
    base: Option<PathBuf>,
    tx: &tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
) -> Result<(), String> {
    let btrfs = locker_runtime::doctor::which("btrfs")
        .ok_or("btrfs not found: moving volumes needs btrfs-progs (apt-get install btrfs-progs)")?;
    for (i, s) in subvols.iter().enumerate() {
        let mut cmd = tokio::process::Command::new(&btrfs);
        cmd.args(["-q", "send"]);
        if let Some(parent) = i.checked_sub(1).map(|p| &subvols[p]).or(base.as_ref()) {
            cmd.arg("-p").arg(parent);
        }
        let mut child = cmd
            .arg(s)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("btrfs send: {e}"))?;
        let mut out = child.stdout.take().expect("piped");
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = out
                .read(&mut buf)
                .await
                .map_err(|e| format!("btrfs send: {e}"))?;
            if n == 0 {
                break;
            }
            if tx
                .send(Ok(Bytes::copy_from_slice(&buf[..n])))
                .await
                .is_err()
            {
                return Err("the target stopped reading".into());
            }
        }
        let done = child
            .wait_with_output()
            .await
            .map_err(|e| format!("btrfs send: {e}"))?;
        if !done.status.success() {
            return Err(format!(
                "btrfs send {}: {}",
                s.display(),
                String::from_utf8_lossy(&done.stderr).trim()
            ));
        }
    }
    Ok(())
}

/// Asks `target` to drop a copy whose move did not switch (best effort: a copy left there
/// is removed at its next start, [`sweep`]).
async fn discard_on(app: &AppState, tenant: &str, id: &str, target: &NodeRecord) {
    let path = format!("{RECEIVE_PATH}{id}");
    let done = crate::fleet::route::call_node(
        app,
        target,
        tenant,
        (Method::DELETE, &path),
        Body::empty(),
        Some(Duration::from_secs(60)),
    )
    .await;
    if !matches!(&done, Ok(r) if r.status().is_success()) {
        tracing::warn!(volume = %id, node = %target.name, "the target kept the copy of a move that did not switch (removed at its next start)");
    }
}

pub(super) async fn mark(dir: &FsPath, marker: &'static str) {
    let at = dir.join(marker);
    let _ = tokio::task::spawn_blocking(move || std::fs::write(at, b"")).await;
}

pub(super) async fn unmark(dir: &FsPath, marker: &'static str) {
    let at = dir.join(marker);
    let _ = tokio::task::spawn_blocking(move || std::fs::remove_file(at)).await;
}

// ---- the receiving end ----

/// A call on this node listener's [`RECEIVE_PATH`]: `rest` is `{id}`; `record` the
/// fleet's record of the volume, when control sent it (`handoff::RECORD_HEADER`: a joined
/// node has none of its own of a volume moving to it).
pub async fn received(
    app: &AppState,
    tenant: &str,
    (method, rest, query): (&Method, &str, Option<&str>),
    record: Option<VolumeRecord>,
    body: Body,
) -> Response {
    let id = rest.to_owned();
    // A path under this server's volumes: an id, never a path.
    if !crate::ids::is_id(&id, "vol_") {
        return ApiError::bad_request(format!("{RECEIVE_PATH}{{id}} takes a volume id"))
            .into_response();
    }
    let arg = |name: &str| crate::extract::query_arg(query, name);
    // In a task of its own: a control replica that goes away does not cut a step in the
    // middle (a gate taken and not noted, a volume half forgotten).
    let (app, tenant, stage) = (app.clone(), tenant.to_owned(), arg("stage"));
    let (method, point) = (method.clone(), arg("point"));
    let done = tokio::spawn(async move {
        let (app, tenant) = (&app, tenant.as_str());
        match (&method, stage.as_deref()) {
            (&Method::PUT, Some("first")) => copy(app, tenant, &id, record, body).await,
            (&Method::PUT, Some("last")) => catch_up(app, tenant, &id, point, body).await,
            (&Method::DELETE, _) => discard(app, tenant, &id)
                .await
                .map(|()| StatusCode::NO_CONTENT.into_response()),
            (&Method::POST, Some("send")) => handoff::send(app, tenant, &id).await,
            (&Method::POST, Some("hold")) => handoff::hold(app, tenant, &id).await,
            (&Method::POST, Some("send-last")) => handoff::send_last(app, tenant, &id).await,
            (&Method::POST, Some("moved")) => handoff::moved(app, tenant, &id).await,
            (&Method::POST, Some("stay")) => handoff::stay(app, &id).await,
            (&Method::POST, Some("open")) => handoff::open(app, tenant, &id, record, body).await,
            (&Method::POST, Some("confirm")) => handoff::confirm(app, &id).await,
            _ => Err(ApiError::bad_request(format!(
                "{RECEIVE_PATH}{{id}} takes PUT ?stage=first, PUT ?stage=last&point=NAME, \
                 DELETE, and POST ?stage= send, hold, send-last, moved, stay, open or confirm"
            ))),
        }
    })
    .await
    .unwrap_or_else(|e| Err(ApiError::internal(format!("the move's step failed: {e}"))));
    done.unwrap_or_else(IntoResponse::into_response)
}

/// The volume's record, which must name another server as its home: the fleet's, read
/// from the store a control replica shares, or given by control to a joined node
/// (`given`), which must hold no record of its own of it.
fn moving_record(
    app: &AppState,
    tenant: &str,
    id: &str,
    given: Option<VolumeRecord>,
) -> Result<VolumeRecord, ApiError> {
    let own = app.store.get_volume(tenant, id)?.filter(|r| r.id == id);
    let r = match (app.cfg.fleet_member, own, given) {
        (true, None, Some(g)) if g.id == id && g.tenant == tenant => g,
        (true, Some(_), _) => {
            return Err(ApiError::conflict(format!(
                "volume {id} is this node's already"
            )))
        }
        (true, None, _) => {
            return Err(ApiError::bad_request(format!(
                "a move to a joined node names the volume ({})",
                handoff::RECORD_HEADER
            )))
        }
        (false, own, _) => {
            own.ok_or_else(|| ApiError::not_found(format!("volume {id} does not exist")))?
        }
    };
    if r.host == app.host_id {
        return Err(ApiError::conflict(format!(
            "volume {id} is this server's already"
        )));
    }
    Ok(r)
}

/// Step 1 at the target: a filesystem of the volume's size, marked [`INCOMING`], with the
/// stream received into it. 201 `{}`.
async fn copy(
    app: &AppState,
    tenant: &str,
    id: &str,
    given: Option<VolumeRecord>,
    body: Body,
) -> Result<Response, ApiError> {
    let controlled = given.is_some();
    let r = moving_record(app, tenant, id, given)?;
    // A copy of an earlier try (its discard did not arrive) goes first.
    discard(app, tenant, id).await?;
    crate::capacity::admit_disk(&app.cfg.data_dir, "the moved volume's `size_mb`", r.size_mb)?;
    let dir = app.volumes.root.join(&r.id);
    let (d, size_mb) = (dir.clone(), r.size_mb);
    let made = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        std::fs::create_dir_all(d.join("private"))?;
        std::fs::write(d.join(INCOMING), b"")?;
        locker_runtime::volume_fs::create(&d, size_mb)
    })
    .await
    .map_err(|e| ApiError::internal(format!("making volume {id}: {e}")))
    .and_then(|r| {
        r.map_err(|e| ApiError::internal(format!("making volume {id}'s filesystem: {e}")))
    });
    let received = match made {
        Ok(()) => take_stream(&dir, body).await,
        Err(e) => Err(e),
    };
    if let Err(e) = received {
        remove_copy(dir).await;
        return Err(e);
    }
    // Control drives the move (`handoff`): it names the volume, which a home that drives
    // its own move never does.
    if app.cfg.fleet_member || controlled {
        handoff::received(app, tenant, id, None);
    }
    Ok((StatusCode::CREATED, axum::Json(json!({}))).into_response())
}

/// Steps 2 at the target: the catch-up received, the live tree made from the last point
/// (named `point`), the points dropped, the volume served. 201 `{"root", "used_bytes"}`.
async fn catch_up(
    app: &AppState,
    tenant: &str,
    id: &str,
    point: Option<String>,
    body: Body,
) -> Result<Response, ApiError> {
    let point = point
        .filter(|p| p.starts_with(POINT) && !p.contains('/') && p.len() < 100)
        .ok_or_else(|| {
            ApiError::bad_request(format!("the last stage names its point (?point={POINT}…)"))
        })?;
    let dir = app.volumes.root.join(id);
    // A joined node, or a replica that control moves a joined node's volume to, serves it
    // once control sends its records (`handoff::open`).
    let r = if app.cfg.fleet_member {
        None
    } else {
        let r = moving_record(app, tenant, id, None)?;
        (!handoff::is_target(app, id)).then_some(r)
    };
    if !dir.join(INCOMING).exists() || app.volumes.get(id).is_some() {
        return Err(ApiError::conflict(format!(
            "volume {id}'s copy is not here: the move's first stage comes first"
        )));
    }
    let made = match take_stream(&dir, body).await {
        Ok(()) => make_live(&dir, &point).await,
        Err(e) => Err(e),
    };
    let used = match made {
        Ok(n) => n,
        Err(e) => {
            remove_copy(dir).await;
            return Err(e);
        }
    };
    let Some(r) = r else {
        handoff::received(app, tenant, id, Some(used));
        return Ok((StatusCode::CREATED, axum::Json(json!({"used_bytes": used}))).into_response());
    };
    let vol = app.volumes.make(&r, used);
    app.volumes
        .open
        .write()
        .expect("volumes lock")
        .insert(r.id.clone(), vol);
    let root = locker_runtime::volume_fs::root(&dir);
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({"root": root.display().to_string(), "used_bytes": used})),
    )
        .into_response())
}

async fn remove_copy(dir: PathBuf) {
    let _ = tokio::task::spawn_blocking(move || locker_runtime::volume_fs::remove(&dir)).await;
}

/// Makes `live/` (empty until now) from the received `point` and drops every point; the
/// bytes the live tree holds.
async fn make_live(dir: &FsPath, point: &str) -> Result<u64, ApiError> {
    let (snaps, live) = (
        locker_runtime::volume_fs::root(dir).join("snapshots"),
        locker_runtime::volume_fs::live(dir),
    );
    let from = snaps.join(point).join("live");
    tokio::task::spawn_blocking(move || -> std::io::Result<u64> {
        std::fs::remove_dir(&live)?;
        let copied = locker_runtime::tree::copy(&from, &live)?;
        for e in std::fs::read_dir(&snaps)?.flatten() {
            if e.file_name().to_string_lossy().starts_with(POINT) {
                locker_runtime::volume_fs::delete_subvolume(&e.path())?;
            }
        }
        Ok(copied.bytes)
    })
    .await
    .map_err(|e| ApiError::internal(format!("making the moved live tree: {e}")))?
    .map_err(|e| ApiError::internal(format!("making the moved live tree: {e}")))
}

/// `btrfs receive`s the body into the volume's `snapshots/` (confined there).
async fn take_stream(dir: &FsPath, body: Body) -> Result<(), ApiError> {
    let btrfs = locker_runtime::doctor::which("btrfs").ok_or_else(|| {
        ApiError::unavailable("btrfs not found: receiving a volume needs btrfs-progs")
    })?;
    let root = locker_runtime::volume_fs::root(dir);
    let mut child = tokio::process::Command::new(btrfs)
        .args(["-q", "receive", "-C"])
        .arg(root.join("snapshots"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| ApiError::internal(format!("btrfs receive: {e}")))?;
    let mut input = child.stdin.take().expect("piped");
    let mut stream = body.into_data_stream();
    let mut failed = None;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(b) => {
                if let Err(e) = input.write_all(&b).await {
                    failed = Some(format!("btrfs receive stopped reading: {e}"));
                    break;
                }
            }
            Err(e) => {
                failed = Some(format!("the stream broke off: {e}"));
                break;
            }
        }
    }
    drop(input);
    if let Some(why) = failed {
        let _ = child.kill().await;
        return Err(ApiError::bad_request(format!(
            "receiving the volume: {why}"
        )));
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| ApiError::internal(format!("btrfs receive: {e}")))?;
    if !out.status.success() {
        return Err(ApiError::bad_request(format!(
            "btrfs receive: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Drops a copy of a volume that is not this server's by its record: received for a move
/// that did not switch, or left by a move away (nothing there is fine).
async fn discard(app: &AppState, tenant: &str, id: &str) -> Result<(), ApiError> {
    let dir = app.volumes.root.join(id);
    if app.cfg.fleet_member || handoff::is_target(app, id) {
        // Its records, if any, are those `handoff::open` wrote for the copy.
        if !dir.join(INCOMING).exists() {
            return Ok(());
        }
        return handoff::drop_copy(app, tenant, id).await;
    }
    moving_record(app, tenant, id, None)?;
    // A copy that came here (`INCOMING`), or the old copy of a move away from here whose
    // removal failed (`OUTGOING`): neither is this server's by the record.
    if !dir.join(INCOMING).exists() && !dir.join(OUTGOING).exists() {
        return Ok(());
    }
    let old = app.volumes.open.write().expect("volumes lock").remove(id);
    if let Some(v) = old {
        v.stop_agent().await;
    }
    tokio::task::spawn_blocking(move || locker_runtime::volume_fs::remove(&dir))
        .await
        .map_err(|e| ApiError::internal(format!("removing a moved copy: {e}")))?
        .map_err(|e| ApiError::internal(format!("removing a moved copy: {e}")))
}

/// At start, before the volumes open: a directory a move left marked is kept if `mine`
/// names it, and removed otherwise. Unmarked directories are never touched. On a control
/// replica `mine` is what the fleet's records say is this server's: the kept ones are
/// unmarked. On a joined node (`in_doubt`) `mine` is its own records, which a move may have
/// written before the fleet's switched: the kept ones stay marked and are answered, for
/// the fleet to say whose they are (`handoff::adopt`). Also answered: the ids of the
/// copies removed (their snapshot records with this server's paths are the caller's to
/// forget: `handoff::forget_left_copies`).
pub fn sweep(
    root: &FsPath,
    mine: &[VolumeRecord],
    in_doubt: bool,
) -> (Vec<(VolumeRecord, &'static str)>, Vec<String>) {
    let (mut kept, mut removed) = (Vec::new(), Vec::new());
    let Ok(entries) = std::fs::read_dir(root) else {
        return (kept, removed);
    };
    for e in entries.flatten() {
        let dir = e.path();
        let marked: Vec<&'static str> = [INCOMING, OUTGOING]
            .into_iter()
            .filter(|m| dir.join(m).exists())
            .collect();
        if marked.is_empty() {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(r) = mine.iter().find(|r| r.id == name) {
            if in_doubt {
                kept.push((r.clone(), marked[0]));
                continue;
            }
            for m in marked {
                let _ = std::fs::remove_file(dir.join(m));
            }
        } else {
            tracing::warn!(volume = %name, "removing the copy of a volume a move left (the fleet's record names another server)");
            if let Err(e) = locker_runtime::volume_fs::remove(&dir) {
                tracing::warn!(volume = %name, error = %e, "could not remove a moved volume's copy");
            }
            removed.push(name);
        }
    }
    (kept, removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> VolumeRecord {
        VolumeRecord {
            id: id.into(),
            tenant: "t".into(),
            name: id.replace('_', "-"),
            size_mb: 16,
            created_at: locker_types::rfc3339(1),
            host: "here".into(),
        }
    }

    #[test]
    fn sweep_keeps_marked_copies_the_record_names_and_only_removes_marked_ones() {
        let root = std::env::temp_dir().join(format!("locker-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let made = |id: &str, marker: Option<&str>| {
            let d = root.join(id);
            std::fs::create_dir_all(d.join("private")).unwrap();
            std::fs::write(d.join("disk.img"), b"image").unwrap();
            if let Some(m) = marker {
                std::fs::write(d.join(m), b"").unwrap();
            }
        };
        made("vol_in_mine", Some(INCOMING));
        made("vol_in_theirs", Some(INCOMING));
        made("vol_out_mine", Some(OUTGOING));
        made("vol_out_theirs", Some(OUTGOING));
        made("vol_plain", None);
        let (kept, mut removed) = sweep(
            &root,
            &[record("vol_in_mine"), record("vol_out_mine")],
            false,
        );
        assert!(kept.is_empty(), "a control replica keeps no move in doubt");
        removed.sort();
        assert_eq!(removed, ["vol_in_theirs", "vol_out_theirs"]);
        for kept in ["vol_in_mine", "vol_out_mine"] {
            let d = root.join(kept);
            assert!(d.join("disk.img").exists(), "{kept} removed");
            assert!(!d.join(INCOMING).exists() && !d.join(OUTGOING).exists());
        }
        for gone in ["vol_in_theirs", "vol_out_theirs"] {
            assert!(!root.join(gone).exists(), "{gone} kept");
        }
        assert!(
            root.join("vol_plain/disk.img").exists(),
            "an unmarked directory is never touched, whatever the records say"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
