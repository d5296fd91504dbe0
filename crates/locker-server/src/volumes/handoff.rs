//! A volume moving under control's direction (between joined nodes, `locker node`, or
//! between a joined node and a control replica's own node): this node's side, as the
//! volume's home or as its target. The control plane drives the move (`fleet::route::volume_move`)
//! and relays every stream; nodes never call each other. The steps, each a call of
//! control's on the node listener's [`RECEIVE_PATH`] (`POST …/{id}?stage=…` here, the
//! target's `PUT`s and `DELETE` in `moving`):
//!
//! 1. home `send`: the first point taken (the volume in use meanwhile) and answered as the
//!    `btrfs send` of the volume's snapshots and the point ([`POINT_HEADER`] names it);
//!    control pipes it into the target's `PUT ?stage=first` (the fleet's record of the
//!    volume in [`RECORD_HEADER`]: the target has none of its own).
//! 2. home `hold`: the volume's gate taken and kept across calls (a task holds it; writes
//!    and commits wait), the last point taken, the directory marked [`OUTGOING`]; answered
//!    with the point's name, the volume's snapshot records and how long this node waits.
//! 3. home `send-last`: what changed since the first point, piped into the target's
//!    `PUT ?stage=last`, which makes the live tree but serves nothing yet.
//! 4. target `open` (its body the snapshot records): the node's own records written, the
//!    volume served; its directory stays marked [`INCOMING`].
//! 5. control switches the fleet's record of the volume from the home to the target (the
//!    one truth: every call goes where it says), then target `confirm` (the mark goes) and
//!    home `moved` (the volume closed under the held gate, so that a write that waited is
//!    refused with nothing written, its records and files removed). A failure before the
//!    switch is home `stay` (gate released, points dropped) and target `DELETE`.
//!
//! **Control gone half way.** Each node notes its last step (a stream's end, for one it
//! sends). The home with no gate held gives the move up by itself after [`wait_limit`]
//! (nothing can have switched). A home
//! holding the gate, and a target holding a copy, cannot know alone whether the record
//! switched: past the wait each asks the fleet with its heartbeats (`Report::
//! volumes_in_doubt`), keeping everything as it is until answered (`BeatAnswer::
//! volumes_here`): still the home's → `stay` / discard; the target's → `moved` / `confirm`.
//! Control switches only within half the shorter of the two nodes' waits after it asked
//! for the hold, so that an answer given after a node's wait cannot be overtaken by a
//! switch. A node restarted in the middle finds its mark: a marked home keeps its volume
//! held and asks the same; a marked target with records of its own serves and asks; one
//! without (the move never reached `open`) is removed (`moving::sweep`).
//!
//! **A control replica's own node** (`--node local`) takes either side of such a move with
//! a joined node at the other end: its records are the fleet's store's, so as the target
//! its `open` writes only the snapshots' records (with its paths; the volume's record is
//! the fleet's and names the home until the switch), and as the home its `moved` (or a
//! dropped copy) removes only the snapshots' records with its paths. It settles a move in
//! doubt by reading the fleet's record itself (`fleet::local`). Restarted after it died as
//! a target, it removes a copy the fleet's record does not name with the snapshots' records
//! its `open` wrote ([`forget_left_copies`]).
//!
//! Owns the nodes' steps and the notes of moves under way. Not which node is the home (the
//! fleet's record, control's), not the streams' format (`moving`).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use locker_store::{VolumeRecord, VolumeSnapshotRecord};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::oneshot;

use super::moving::{mark, point_name, send_all, unmark, INCOMING, OUTGOING, POINT};
use super::{lookup, running_sandbox_mounting, Volume};
use crate::auth::Caller;
use crate::carry::wait_limit;
use crate::error::ApiError;
use crate::state::AppState;

/// The fleet's record of a volume moving to a node, on the target's first and `open` calls.
pub const RECORD_HEADER: &str = "x-locker-volume-record";

/// The home's answer to `hold`, and what control passes on to the target's `open`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Held {
    /// The last point's name (the target names it in its `PUT ?stage=last`).
    pub point: String,
    /// The volume's snapshot records at the home, oldest first.
    pub snapshots: Vec<VolumeSnapshotRecord>,
    /// How long the node waits for the next step before it asks the fleet.
    pub wait_ms: u64,
}

/// A volume the fleet is asked about (`Report::volumes_in_doubt`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeKey {
    pub tenant: String,
    pub id: String,
}

/// What this node is in a move under way.
enum Role {
    /// The home, its first point sent (or sending); no gate held.
    Sending,
    /// The home, its gate held by a task until `release` is sent; `last` taken.
    Holding {
        last: Option<String>,
        release: oneshot::Sender<()>,
    },
    /// The target: a copy marked [`INCOMING`], served once `opened`; `used` its live tree's
    /// bytes.
    Target { used: u64, opened: bool },
}

struct Move {
    tenant: String,
    /// The home's first point.
    first: Option<String>,
    /// The home's snapshots at `send`, by id (a change before `hold` fails the move).
    snapshots: Vec<String>,
    role: Role,
    /// This node's last step.
    since: Instant,
    /// A stream of the home's is still being sent (its wait starts when it ends).
    sending: bool,
}

/// The moves under way on this node, by volume id.
#[derive(Default)]
pub struct Moves {
    inner: Mutex<HashMap<String, Move>>,
    /// Volumes that moved away from here, by id and name (since this start; a few bytes
    /// each): a call still on its way to this node is answered 503 "call again", not 404.
    gone: Mutex<std::collections::HashSet<String>>,
}

impl Moves {
    /// Whether volume `id_or_name` moved away from this node.
    pub fn moved_away(&self, id_or_name: &str) -> bool {
        self.gone.lock().expect("moves").contains(id_or_name)
    }

    fn touch(&self, id: &str) {
        if let Some(m) = self.inner.lock().expect("moves").get_mut(id) {
            m.since = Instant::now();
            m.sending = false;
        }
    }

    fn take(&self, id: &str) -> Option<Move> {
        self.inner.lock().expect("moves").remove(id)
    }

    fn put(&self, id: &str, m: Move) {
        self.inner.lock().expect("moves").insert(id.to_owned(), m);
    }
}

fn caller(tenant: &str) -> Caller {
    Caller {
        tenant: tenant.to_owned(),
        key_id: "fleet".into(),
    }
}

fn not_under_way(id: &str, stage: &str) -> ApiError {
    ApiError::conflict(format!(
        "no move of volume {id} is under way on this node at stage {stage}: the move starts over"
    ))
}

fn points(v: &Volume, names: impl IntoIterator<Item = String>) -> Vec<std::path::PathBuf> {
    names
        .into_iter()
        .map(|n| v.root().join("snapshots").join(n))
        .collect()
}

async fn drop_points(v: &Volume, names: impl IntoIterator<Item = String>) {
    for p in points(v, names) {
        super::drop_snapshot(p).await;
    }
}

/// A stream of `btrfs send`s of `chain` (on `base`) as a 200's body; when it ends, the
/// move's step is done here (its wait starts).
fn stream(
    app: &AppState,
    id: &str,
    (chain, base): (Vec<std::path::PathBuf>, Option<std::path::PathBuf>),
) -> Response {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(8);
    let (app, vid) = (app.clone(), id.to_owned());
    tokio::spawn(async move {
        if let Err(e) = send_all(chain, base, &tx).await {
            tracing::warn!(volume = %vid, error = %e, "a moving volume's stream stopped");
        }
        app.volumes.moves.touch(&vid);
    });
    let body = Body::from_stream(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    (StatusCode::OK, body).into_response()
}

// ---- the home ----

/// Step 1 at the home: the first point, and the stream of the snapshots and it.
pub(super) async fn send(app: &AppState, tenant: &str, id: &str) -> Result<Response, ApiError> {
    let (r, v) = lookup(app, &caller(tenant), id)?;
    if let Some(sb) = running_sandbox_mounting(app, &r.id) {
        return Err(super::moving::mounted(&r, &sb));
    }
    v.start_moving(&r.name)?;
    let first = point_name();
    let made = super::snapshot_live(&v, v.root().join("snapshots").join(&first)).await;
    let snaps = match made.and_then(|()| Ok(app.store.list_volume_snapshots(tenant, &r.id)?)) {
        Ok(mut s) => {
            s.reverse();
            s
        }
        Err(e) => {
            drop_points(&v, [first]).await;
            v.moving.store(false, Ordering::Release);
            return Err(e);
        }
    };
    let mut chain: Vec<_> = snaps.iter().map(|s| s.path.clone().into()).collect();
    chain.extend(points(&v, [first.clone()]));
    app.volumes.moves.put(
        &r.id,
        Move {
            tenant: tenant.to_owned(),
            first: Some(first.clone()),
            snapshots: snaps.into_iter().map(|s| s.id).collect(),
            role: Role::Sending,
            since: Instant::now(),
            sending: true,
        },
    );
    Ok(stream(app, &r.id, (chain, None)))
}

/// Step 2 at the home: the gate taken and held, the last point taken, the mark made.
pub(super) async fn hold(app: &AppState, tenant: &str, id: &str) -> Result<Response, ApiError> {
    let (r, v) = lookup(app, &caller(tenant), id)?;
    let Some(mut m) = app.volumes.moves.take(&r.id) else {
        return Err(not_under_way(id, "hold"));
    };
    if !matches!(m.role, Role::Sending) || m.tenant != tenant {
        app.volumes.moves.put(&r.id, m);
        return Err(not_under_way(id, "hold"));
    }
    let release = hold_gate(&v).await;
    let last = point_name();
    m.role = Role::Holding {
        last: Some(last.clone()),
        release,
    };
    m.since = Instant::now();
    let checked = async {
        if let Some(sb) = running_sandbox_mounting(app, &r.id) {
            return Err(super::moving::mounted(&r, &sb));
        }
        let mut snaps = app.store.list_volume_snapshots(tenant, &r.id)?;
        snaps.reverse();
        if snaps.iter().map(|s| &s.id).ne(m.snapshots.iter()) {
            return Err(ApiError::conflict(format!(
                "volume {}'s snapshots changed during the move: move it again",
                r.name
            )));
        }
        super::snapshot_held(&v, v.root().join("snapshots").join(&last)).await?;
        Ok(snaps)
    }
    .await;
    let snapshots = match checked {
        Ok(s) => s,
        Err(e) => {
            stay_with(&v, m).await;
            return Err(e);
        }
    };
    mark(&v.dir, OUTGOING).await;
    app.volumes.moves.put(&r.id, m);
    Ok(axum::Json(Held {
        point: last,
        snapshots,
        wait_ms: wait_limit().as_millis() as u64,
    })
    .into_response())
}

/// Takes `v`'s gate in a task of its own, which keeps it until the sender answered is
/// used or dropped.
async fn hold_gate(v: &Arc<Volume>) -> oneshot::Sender<()> {
    let (held_tx, held_rx) = oneshot::channel();
    let (release, released) = oneshot::channel::<()>();
    let v = v.clone();
    tokio::spawn(async move {
        let _all = v.space.gate.write().await;
        let _ = held_tx.send(());
        let _ = released.await;
    });
    let _ = held_rx.await;
    release
}

/// Step 3 at the home: what changed since the first point.
pub(super) async fn send_last(
    app: &AppState,
    tenant: &str,
    id: &str,
) -> Result<Response, ApiError> {
    let (r, v) = lookup(app, &caller(tenant), id)?;
    let inner = app.volumes.moves.inner.lock().expect("moves");
    let (first, last) = match inner.get(&r.id) {
        Some(Move {
            first: Some(f),
            role: Role::Holding { last: Some(l), .. },
            tenant: t,
            ..
        }) if t == tenant => (f.clone(), l.clone()),
        _ => return Err(not_under_way(id, "send-last")),
    };
    drop(inner);
    let mut first = points(&v, [first]);
    let chain = (points(&v, [last]), first.pop());
    Ok(stream(app, &r.id, chain))
}

/// Step 5 at the home: the fleet made the target the volume's home. The volume is closed
/// while its gate is still held (a write that waited is refused, nothing written), then
/// its records and files go. Done already is fine.
pub(super) async fn moved(app: &AppState, tenant: &str, id: &str) -> Result<Response, ApiError> {
    let Some(v) = app.volumes.get(id) else {
        app.volumes.moves.take(id);
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let m = app.volumes.moves.take(id);
    let release = match m.map(|m| m.role) {
        Some(Role::Holding { release, .. }) => Some(release),
        _ => None,
    };
    let Some(release) = release else {
        return Err(not_under_way(id, "moved"));
    };
    forget(app, tenant, &v, release).await?;
    tracing::info!(volume = %id, "volume moved away: its files here are gone");
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The volume leaves this node: closed (its gate is held by `release`'s task), its records
/// and files removed.
async fn forget(
    app: &AppState,
    tenant: &str,
    v: &Arc<Volume>,
    release: oneshot::Sender<()>,
) -> Result<(), ApiError> {
    v.space.close();
    if let Ok(Some(r)) = app.store.get_volume(tenant, &v.id) {
        app.volumes
            .moves
            .gone
            .lock()
            .expect("moves")
            .extend([r.id, r.name]);
    }
    app.volumes
        .open
        .write()
        .expect("volumes lock")
        .remove(&v.id);
    let _ = release.send(());
    v.stop_agent().await;
    forget_records(app, tenant, &v.id)?;
    let dir = v.dir.clone();
    tokio::task::spawn_blocking(move || locker_runtime::volume_fs::remove(&dir))
        .await
        .map_err(|e| ApiError::internal(format!("removing a moved volume: {e}")))?
        .map_err(|e| ApiError::internal(format!("removing a moved volume: {e}")))
}

/// A failed move at the home: the volume goes on here as before. Done already is fine.
pub(super) async fn stay(app: &AppState, id: &str) -> Result<Response, ApiError> {
    let m = app.volumes.moves.take(id);
    if let (Some(m), Some(v)) = (m, app.volumes.get(id)) {
        stay_with(&v, m).await;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn stay_with(v: &Volume, m: Move) {
    let mut names: Vec<String> = m.first.into_iter().collect();
    if let Role::Holding { last, release } = m.role {
        names.extend(last);
        unmark(&v.dir, OUTGOING).await;
        let _ = release.send(());
    }
    drop_points(v, names).await;
    v.moving.store(false, Ordering::Release);
    tracing::info!(volume = %v.id, "a move of the volume was given up: it stays here");
}

// ---- the target ----

/// Notes a copy received at the target (steps 1 and 3), with its live tree's bytes once
/// known.
pub(super) fn received(app: &AppState, tenant: &str, id: &str, used: Option<u64>) {
    app.volumes.moves.put(
        id,
        Move {
            tenant: tenant.to_owned(),
            first: None,
            snapshots: Vec::new(),
            role: Role::Target {
                used: used.unwrap_or(0),
                opened: false,
            },
            since: Instant::now(),
            sending: false,
        },
    );
}

/// Whether this node is the target of a move control drives of volume `id` (its copy
/// received at least in part).
pub(super) fn is_target(app: &AppState, id: &str) -> bool {
    matches!(
        app.volumes.moves.inner.lock().expect("moves").get(id),
        Some(Move {
            role: Role::Target { .. },
            ..
        })
    )
}

#[derive(Deserialize)]
struct OpenBody {
    snapshots: Vec<VolumeSnapshotRecord>,
}

/// Step 4 at the target: its own records of the volume and its snapshots (paths here),
/// and the volume served, still marked.
pub(super) async fn open(
    app: &AppState,
    tenant: &str,
    id: &str,
    record: Option<VolumeRecord>,
    body: Body,
) -> Result<Response, ApiError> {
    let r = record
        .filter(|r| r.id == id && r.tenant == tenant)
        .ok_or_else(|| ApiError::bad_request(format!("open names the volume ({RECORD_HEADER})")))?;
    let bytes = axum::body::to_bytes(body, 16 << 20)
        .await
        .map_err(|e| ApiError::bad_request(format!("open's body: {e}")))?;
    let asked: OpenBody = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("open's body: {e}")))?;
    // Each names a subvolume under this node's `snapshots/`: an id, never a path.
    if let Some(bad) = asked
        .snapshots
        .iter()
        .find(|s| !crate::ids::is_id(&s.id, "snap_"))
    {
        return Err(ApiError::bad_request(format!(
            "open's snapshot {:?} is not a snapshot id",
            bad.id
        )));
    }
    let used = match app.volumes.moves.inner.lock().expect("moves").get(id) {
        Some(Move {
            role: Role::Target {
                used,
                opened: false,
            },
            ..
        }) => *used,
        _ => return Err(not_under_way(id, "open")),
    };
    let dir = app.volumes.root.join(id);
    let root = locker_runtime::volume_fs::root(&dir);
    let mine = VolumeRecord {
        host: app.host_id.clone(),
        ..r
    };
    // A joined node writes its own record; a control replica's own node shares the fleet's,
    // which names the old home until control switches it.
    let shared = !app.cfg.fleet_member;
    if !shared {
        app.store.insert_volume(&mine)?;
    }
    for s in asked.snapshots {
        let s = VolumeSnapshotRecord {
            path: root.join("snapshots").join(&s.id).display().to_string(),
            tenant: tenant.to_owned(),
            volume_id: id.to_owned(),
            ..s
        };
        if let Err(e) = app.store.insert_volume_snapshot(&s) {
            let _ = forget_records(app, tenant, id);
            return Err(e.into());
        }
    }
    let vol = app.volumes.make(&mine, used);
    app.volumes
        .open
        .write()
        .expect("volumes lock")
        .insert(id.to_owned(), vol);
    if let Some(Move {
        role: Role::Target { opened, .. },
        since,
        ..
    }) = app.volumes.moves.inner.lock().expect("moves").get_mut(id)
    {
        *opened = true;
        *since = Instant::now();
    }
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({"wait_ms": wait_limit().as_millis() as u64})),
    )
        .into_response())
}

/// Step 5 at the target: the volume is this node's (the fleet's record says so). Done
/// already is fine.
pub(super) async fn confirm(app: &AppState, id: &str) -> Result<Response, ApiError> {
    if app.volumes.get(id).is_none() {
        return Err(not_under_way(id, "confirm"));
    }
    app.volumes.moves.take(id);
    unmark(&app.volumes.root.join(id), INCOMING).await;
    tracing::info!(volume = %id, "volume moved here");
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A copy at the target that is not to be this node's (a move that did not switch): its
/// records, if `open` wrote them, and its files go. The caller checked its [`INCOMING`]
/// mark.
pub(super) async fn drop_copy(app: &AppState, tenant: &str, id: &str) -> Result<(), ApiError> {
    app.volumes.moves.take(id);
    let old = app.volumes.open.write().expect("volumes lock").remove(id);
    if let Some(v) = old {
        v.space.close();
        v.stop_agent().await;
    }
    forget_records(app, tenant, id)?;
    let dir = app.volumes.root.join(id);
    tokio::task::spawn_blocking(move || locker_runtime::volume_fs::remove(&dir))
        .await
        .map_err(|e| ApiError::internal(format!("removing a moved copy: {e}")))?
        .map_err(|e| ApiError::internal(format!("removing a moved copy: {e}")))
}

/// Removes this node's records of volume `id`, which is not (or no longer) this node's: a
/// joined node's own record and its snapshots'; on a control replica's own node, whose
/// store is the fleet's, only the snapshot records with this node's paths (the volume's
/// record is the fleet's, and names its home).
fn forget_records(app: &AppState, tenant: &str, id: &str) -> Result<(), ApiError> {
    if app.cfg.fleet_member {
        app.store.delete_volume(tenant, id)?;
        return Ok(());
    }
    for s in app.store.list_volume_snapshots(tenant, id)? {
        if s.path
            .starts_with(&format!("{}/", app.volumes.root.display()))
        {
            app.store.delete_volume_snapshot(tenant, &s.id)?;
        }
    }
    Ok(())
}

/// At a control replica's start: the copies a move left here that are not this server's
/// (`moving::sweep` removed them) take with them the snapshot records with this server's
/// paths that the move's `open` wrote into the fleet's store (a replica that died as a
/// move's target after `open`, the switch never made). A joined node's own records of such
/// a copy were never written without its files.
pub fn forget_left_copies(
    store: &dyn locker_store::Store,
    root: &std::path::Path,
    removed: &[String],
) -> Result<usize, locker_store::StoreError> {
    if removed.is_empty() {
        return Ok(0);
    }
    let under = format!("{}/", root.display());
    let mut n = 0;
    for v in store.list_all_volumes()? {
        if !removed.contains(&v.id) {
            continue;
        }
        for s in store.list_volume_snapshots(&v.tenant, &v.id)? {
            if s.path.starts_with(&under) && store.delete_volume_snapshot(&v.tenant, &s.id)? {
                n += 1;
            }
        }
    }
    Ok(n)
}

// ---- in doubt ----

/// Called before each heartbeat: a home's move with no gate held whose wait ran out is
/// given up here; the volumes held or received whose wait ran out are answered, for the
/// fleet to say whose they are.
pub async fn in_doubt(app: &AppState) -> Vec<VolumeKey> {
    let wait = wait_limit();
    let (mut asked, mut give_up) = (Vec::new(), Vec::new());
    for (id, m) in app.volumes.moves.inner.lock().expect("moves").iter() {
        if m.sending || m.since.elapsed() < wait {
            continue;
        }
        match m.role {
            Role::Sending => give_up.push(id.clone()),
            _ => asked.push(VolumeKey {
                tenant: m.tenant.clone(),
                id: id.clone(),
            }),
        }
    }
    for id in give_up {
        tracing::warn!(volume = %id, "a move's control plane went away before the volume was held: the move is given up");
        let _ = stay(app, &id).await;
    }
    asked
}

/// The fleet's answer about `asked` (those of them whose record names this node: `here`):
/// each held volume stays or goes, each copy is kept or dropped.
pub async fn settle(app: &AppState, asked: &[VolumeKey], here: &[String]) {
    for k in asked {
        let mine = here.contains(&k.id);
        let target = matches!(
            app.volumes.moves.inner.lock().expect("moves").get(&k.id),
            Some(Move {
                role: Role::Target { .. },
                ..
            })
        );
        let done = match (target, mine) {
            (false, true) => stay(app, &k.id).await.map(drop),
            (false, false) => moved(app, &k.tenant, &k.id).await.map(drop),
            (true, true) => confirm(app, &k.id).await.map(drop),
            (true, false) => drop_copy(app, &k.tenant, &k.id).await,
        };
        tracing::warn!(volume = %k.id, this_nodes = mine, result = ?done.err().map(|e| e.to_string()), "a move whose control plane went away was settled by the fleet's record");
    }
}

/// At a joined node's start, once its volumes are open: a volume whose directory a move
/// left marked (`marked`, by id) is in doubt until the fleet answers: a home's is held
/// again (its points dropped), a target's served as received.
pub(super) async fn adopt(volumes: &super::Volumes, marked: Vec<(VolumeRecord, &'static str)>) {
    for (r, marker) in marked {
        let Some(v) = volumes.get(&r.id) else {
            continue;
        };
        let role = if marker == OUTGOING {
            v.moving.store(true, Ordering::Release);
            let snaps = v.root().join("snapshots");
            let left: Vec<String> = std::fs::read_dir(&snaps)
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|n| n.starts_with(POINT))
                        .collect()
                })
                .unwrap_or_default();
            drop_points(&v, left).await;
            Role::Holding {
                last: None,
                release: hold_gate(&v).await,
            }
        } else {
            Role::Target {
                used: v.space.used_bytes(),
                opened: true,
            }
        };
        tracing::warn!(volume = %r.id, marker, "a move of this volume was under way when the node stopped: it waits for the fleet to say whose it is");
        volumes.moves.put(
            &r.id,
            Move {
                tenant: r.tenant.clone(),
                first: None,
                snapshots: Vec::new(),
                role,
                since: Instant::now(),
                sending: false,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::forget_left_copies;
    use locker_store::{SqliteStore, Store, VolumeRecord, VolumeSnapshotRecord};

    #[test]
    fn a_copy_left_by_a_move_takes_only_this_servers_snapshot_records_along() {
        let dir = std::env::temp_dir().join(format!("locker-left-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = SqliteStore::open(dir.join("db.sqlite")).unwrap();
        store.ensure_tenant("t").unwrap();
        let volume = |id: &str| VolumeRecord {
            id: id.into(),
            tenant: "t".into(),
            name: id.replace('_', "-"),
            size_mb: 16,
            created_at: locker_types::rfc3339(1),
            host: "home".into(),
        };
        let snap = |id: &str, vol: &str, path: &str| VolumeSnapshotRecord {
            id: id.into(),
            tenant: "t".into(),
            volume_id: vol.into(),
            size_bytes: 1,
            created_at: locker_types::rfc3339(2),
            path: path.into(),
        };
        for v in ["vol_left", "vol_other"] {
            store.insert_volume(&volume(v)).unwrap();
        }
        // What this server's `open` wrote (its paths), the home's own, and another
        // volume's record with this server's paths (not a left copy: kept).
        for s in [
            snap(
                "snap_here",
                "vol_left",
                "/here/volumes/vol_left/snapshots/a",
            ),
            snap(
                "snap_home",
                "vol_left",
                "/home-host/volumes/vol_left/snapshots/a",
            ),
            snap(
                "snap_kept",
                "vol_other",
                "/here/volumes/vol_other/snapshots/b",
            ),
            // A sibling directory whose name only begins like the root.
            snap(
                "snap_near",
                "vol_left",
                "/here/volumes2/vol_left/snapshots/c",
            ),
        ] {
            store.insert_volume_snapshot(&s).unwrap();
        }
        let root = std::path::Path::new("/here/volumes");
        assert_eq!(forget_left_copies(&store, root, &[]).unwrap(), 0);
        assert_eq!(
            forget_left_copies(&store, root, &["vol_left".into()]).unwrap(),
            1
        );
        let ids = |v: &str| -> Vec<String> {
            let mut l: Vec<String> = store
                .list_volume_snapshots("t", v)
                .unwrap()
                .into_iter()
                .map(|s| s.id)
                .collect();
            l.sort();
            l
        };
        assert_eq!(ids("vol_left"), ["snap_home", "snap_near"]);
        assert_eq!(ids("vol_other"), ["snap_kept"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
