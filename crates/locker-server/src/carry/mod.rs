//! Carrying a sandbox to another node (a drain, `fleet::drain`; a restart elsewhere,
//! `fleet::restart`): this node's side, served on the node listener only (control's calls
//! under [`PATH`], `fleet::node`).
//!
//! A jail moves cold (its disk; processes and `/tmp` do not survive, as CRIU cannot run
//! here), a microVM with its memory (its processes go on where they were): a running one
//! live, not frozen but admitting no call, its bundle a QEMU migration while its guest
//! runs (`bundle::bundle_live`, the runtime's `vm::live`), which leaves its QEMU holding
//! the guest stopped, when the node's QEMU is 10.0 or later or it runs with
//! `LOCKER_CARRY_LIVE=1` (see [`live_moves`]); otherwise, and for a paused one or one whose disk has no room for
//! another layer, cold. A microVM that mounts volumes holds their requests in its guest
//! first, and its file server's table goes in its snapshot (`snapshots::take_for_move`,
//! the runtime's `Node::hold_shares`): the new node's file server starts from it, so the
//! guest's mounts go on; the hold is lifted where the sandbox stays.
//! The old copy's machine is gone before the new one starts: never two running at once
//! (nor their cgroups and names colliding when two nodes share a host):
//! - `POST {PATH}{id}/export` (old node): the sandbox is frozen (a running microVM is
//!   not: it leaves live) and admits no call from then on (503 "moving",
//!   `state::Busy::enter`; no pause either); a snapshot of it, the same a user takes
//!   (`snapshots::take`; a live one made as it streams), goes into `snapshots/.carry-{id}`
//!   (kept, with its record, until the move ends) and is answered as a bundle;
//! - `POST {PATH}receive?placement=P` (new node): a bundle written into
//!   `snapshots/.carry-in-{id}`; answered 200. From then until `start` or `drop`, the node
//!   reports placement `P` (the reservation control made for the move) as a create in
//!   progress, so that no reconciliation gives it back;
//! - `POST {PATH}{id}/release` (old node): its machine is destroyed, its row forgotten (the
//!   sandbox did not end: no event), its snapshot kept;
//! - `POST {PATH}{id}/start?placement=P` (new node): the sandbox started from what was
//!   received, under its own id, with its record's times, preview token and public ports
//!   (`lifecycle::launch_carried`); answered 201 with its view; `DELETE {PATH}{id}` drops
//!   what was received instead;
//! - `POST {PATH}{id}/moved` (old node): the fleet made the new node the sandbox's: the
//!   kept snapshot goes (and the machine, had it not been released);
//! - `POST {PATH}{id}/stay` (old node): the move failed: the sandbox admits calls again
//!   (thawed unless it was paused before; a microVM's guest a live move stopped runs on),
//!   or, released already, starts again here from the kept snapshot.
//! - `GET {PATH}{id}/snapshots/{snap}`: the bundle of a snapshot the user took, with the
//!   sandbox's record as it is now, the sandbox undisturbed: control keeps it, to start the
//!   sandbox on another node (`receive` and `start`) should this one die (`fleet::restart`).
//!
//! A move whose control replica goes away half way is given up by the nodes themselves,
//! `LOCKER_CARRY_WAIT_S` (300 s) after their own step: the old node thaws a sandbox it
//! sent but was neither told to release nor to keep (until its release, the move can go
//! back), the new node drops what it received but was never told to start. A start after
//! a crash removes the `.carry-*` directories with every other snapshot directory without
//! a record (`snapshots::cleanup`), and a sandbox frozen for a move that never finished is
//! thawed when it is adopted.
//!
//! The bundle's format is `bundle`'s.
//!
//! Owns the node's steps of a move and the moving mark's life. The machine is the runtime's; which node a
//! sandbox is on is control's (`fleet::drain`), never decided here.

use std::io;
use std::path::Path;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use locker_store::SandboxRecord;

mod bundle;

pub use bundle::record_in;
use bundle::{bundle, bundle_live, mark_paused, read_bundle, sandbox_id, PAUSED};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::{now_s, AppState, Live};

/// Where control's carry calls arrive on the node listener.
pub const PATH: &str = "/internal/carry/";

/// One carry call from control (`rest` is the path after [`PATH`]).
pub async fn handle(
    app: &AppState,
    tenant: &str,
    method: &Method,
    rest: &str,
    query: Option<&str>,
    body: Body,
) -> Response {
    let caller = Caller {
        tenant: tenant.to_owned(),
        key_id: "fleet".into(),
    };
    let placement = crate::extract::query_arg(query, "placement");
    // In a task of its own: a caller that goes away (a control replica that died) does not
    // cut a step in the middle (a machine half destroyed, a start half made).
    let (app, method, rest) = (app.clone(), method.clone(), rest.to_owned());
    tokio::spawn(async move { step(&app, &caller, &method, &rest, placement, body).await })
        .await
        .unwrap_or_else(|e| {
            ApiError::internal(format!("the carry step failed: {e}")).into_response()
        })
}

/// One carry call, as [`handle`] dispatches it.
async fn step(
    app: &AppState,
    caller: &Caller,
    method: &Method,
    rest: &str,
    placement: Option<String>,
    body: Body,
) -> Response {
    let caller = caller.clone();
    let done = match (method, rest.split_once('/')) {
        (&Method::POST, None) if rest == "receive" => receive(app, &caller, placement, body).await,
        (&Method::DELETE, None) => drop_received(app, rest, placement).await,
        (&Method::POST, Some((id, "export"))) => export(app, &caller, id).await,
        (&Method::POST, Some((id, "release"))) => release(app, &caller, id).await,
        (&Method::POST, Some((id, "start"))) => start(app, &caller, id, placement).await,
        (&Method::POST, Some((id, "moved"))) => moved(app, &caller, id).await,
        (&Method::POST, Some((id, "stay"))) => stay(app, &caller, id).await,
        (&Method::GET, Some((id, snap))) if snap.starts_with("snapshots/") => {
            snapshot_bundle(app, &caller, id, &snap["snapshots/".len()..]).await
        }
        _ => Err(ApiError::bad_request(format!(
            "{PATH} takes POST {{id}}/export, POST receive, POST {{id}}/release, POST \
             {{id}}/start, DELETE {{id}}, POST {{id}}/moved, POST {{id}}/stay and GET \
             {{id}}/snapshots/{{snapshot}}"
        ))),
    };
    done.unwrap_or_else(IntoResponse::into_response)
}

/// The caller's sandbox `id` running here: its record and live side.
async fn running(
    app: &AppState,
    caller: &Caller,
    id: &str,
) -> Result<(SandboxRecord, Arc<Live>), ApiError> {
    let rec = crate::lifecycle::record_of(app, caller, id)?;
    Ok((rec, crate::lifecycle::live_quiet(app, caller, id).await?))
}

/// Freezes `live` for its move (no call admitted from now on); whether it was paused, and
/// if so by the idle policy.
/// `freeze`: frozen too (a cold move); else it runs on, and only calls are refused (a
/// live one).
fn mark_moving(live: &Live, freeze: bool) -> Result<Option<bool>, ApiError> {
    let mut st = live.pause.lock().expect("pause lock");
    if st.moving.is_some() {
        return Err(ApiError::conflict(format!(
            "sandbox {} is already moving",
            live.id
        )));
    }
    let was_paused = st.since.is_some();
    let paused = was_paused.then_some(st.by_idle);
    if !was_paused && freeze {
        freeze_locked(live, &mut st)?;
    }
    st.moving = Some(was_paused);
    st.moves += 1;
    Ok(paused)
}

fn freeze_locked(live: &Live, st: &mut crate::state::PauseState) -> Result<(), ApiError> {
    live.machine
        .pause()
        .map_err(ApiError::during("freezing the sandbox for its move"))?;
    st.since = Some(now_s());
    live.clock.lock().expect("clock lock").paused(true);
    Ok(())
}

/// Freezes a sandbox marked moving that was left running for a live move which cannot be
/// (it moves cold).
fn freeze_moving(live: &Live) -> Result<(), ApiError> {
    let mut st = live.pause.lock().expect("pause lock");
    if st.since.is_none() {
        freeze_locked(live, &mut st)?;
    }
    Ok(())
}

/// [`unmark`], and a microVM's guest stopped by a live move that did not happen runs again
/// (a guest left paused by its caller stays so), its volume mounts no longer held.
async fn unmark_running(app: &AppState, live: &Live) {
    unmark(live);
    run_on(live).await;
    crate::snapshots::release_shares(app, live).await;
}

/// Lets a running sandbox's microVM guest run where a live move stopped it.
async fn run_on(live: &Live) {
    let running = live.pause.lock().expect("pause lock").since.is_none();
    if let (true, Some(vm)) = (running, live.machine.vm().cloned()) {
        let id = live.id.clone();
        let r = tokio::task::spawn_blocking(move || locker_runtime::vm::ensure_running(&vm)).await;
        if let Ok(Err(e)) = r {
            tracing::warn!(sandbox = %id, error = %e, "the guest of a microVM that did not move could not run again");
        }
    }
}

/// Lifts the moving mark: calls are admitted again, and the sandbox runs unless it was
/// paused before its move.
fn unmark(live: &Live) {
    unmark_locked(live, &mut live.pause.lock().expect("pause lock"));
}

fn unmark_locked(live: &Live, st: &mut crate::state::PauseState) {
    st.leaving = false;
    let Some(was_paused) = st.moving.take() else {
        return;
    };
    if !was_paused && live.machine.resume().is_ok() {
        st.since = None;
        live.clock.lock().expect("clock lock").paused(false);
    }
}

/// How long a node waits for the next step of a move once its own step is done (the
/// bundle sent, or received) before it gives the move up: the control replica driving it
/// died, or lost its way. `LOCKER_CARRY_WAIT_S`, 300 s by default.
pub(crate) fn wait_limit() -> std::time::Duration {
    let s = std::env::var("LOCKER_CARRY_WAIT_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    std::time::Duration::from_secs(s)
}

/// The old node's side of an abandoned move: sandbox `id`, frozen for a move whose
/// bundle went out (or failed to) `wait_limit()` ago and which was neither released nor
/// told to stay, runs here again (as it was) and its kept snapshot goes.
async fn abandon_export(app: AppState, id: String, live: Arc<Live>) {
    let watched = live.pause.lock().expect("pause lock").moves;
    tokio::time::sleep(wait_limit()).await;
    if !app
        .live
        .read()
        .await
        .get(&id)
        .is_some_and(|l| Arc::ptr_eq(l, &live))
    {
        return;
    }
    let abandoned = {
        let mut st = live.pause.lock().expect("pause lock");
        let stuck = st.moving.is_some() && !st.leaving && st.moves == watched;
        if stuck {
            unmark_locked(&live, &mut st);
        }
        stuck
    };
    if abandoned {
        run_on(&live).await;
        crate::snapshots::release_shares(&app, &live).await;
        let _ = tokio::fs::remove_dir_all(kept_dir(&app, &id)).await;
        tracing::warn!(sandbox = %id, wait_s = wait_limit().as_secs(), "a move of this sandbox was abandoned half way (its control replica went away): it runs here again");
    }
}

/// The new node's side of an abandoned move: what was received of sandbox `id` for
/// placement `placement`, neither started nor dropped within `wait_limit()`, goes, and the
/// placement is no longer reported as a create in progress (reconciliation gives its
/// reservation back).
async fn abandon_received(app: AppState, id: String, placement: Option<String>) {
    tokio::time::sleep(wait_limit()).await;
    let Some(dir) = claim(&app, &id).await else {
        return;
    };
    if tokio::fs::remove_dir_all(dir).await.is_ok() {
        if let Some(p) = &placement {
            app.fleet_creates.end(p, None);
        }
        tracing::warn!(sandbox = %id, wait_s = wait_limit().as_secs(), "a sandbox received from another node was never started (its control replica went away): dropped");
    }
}

/// The old node's side of a move its control replica left after the release: sandbox
/// `id`, released (its machine gone, its snapshot kept) `wait_limit()` ago, was neither
/// told it moved nor to stay: it starts again here from its kept snapshot. Safe whichever
/// way the move went: if the fleet had made the new node the sandbox's, this copy is one
/// no placement names, which the fleet's reconciliation destroys (and the new node's copy
/// is, if the fleet had not).
async fn abandon_released(app: AppState, id: String) {
    // The release watched (a later move of the same sandbox has a mark of its own).
    let mark = kept_dir(&app, &id).join(RELEASED);
    let watched = std::fs::read(&mark).ok();
    tokio::time::sleep(wait_limit()).await;
    if watched.is_none() || std::fs::read(&mark).ok() != watched {
        return;
    }
    let Some(dir) = claim_kept(&app, &id).await else {
        return;
    };
    let r = match std::fs::read(dir.join(RECORD))
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice::<SandboxRecord>(&b).map_err(|e| e.to_string()))
    {
        Ok(rec) => {
            let caller = Caller {
                tenant: rec.tenant.clone(),
                key_id: "fleet".into(),
            };
            launch_from(&app, &caller, &dir, &rec)
                .await
                .map(|_| ())
                .map_err(|e| e.message)
        }
        Err(e) => Err(e),
    };
    let _ = tokio::fs::remove_dir_all(&dir).await;
    match r {
        Ok(()) => {
            tracing::warn!(sandbox = %id, wait_s = wait_limit().as_secs(), "a move of this sandbox was abandoned after its release (its control replica went away): it runs here again from its snapshot")
        }
        Err(e) => {
            tracing::error!(sandbox = %id, error = %e, "a sandbox released for a move that was abandoned could not start again here")
        }
    }
}

/// Sandboxes this node released for a move not finished yet: it reports them as its own
/// until the move ends (no reconciliation gives their placement back meanwhile).
pub fn released(app: &AppState) -> Vec<String> {
    std::fs::read_dir(app.snapshots_dir())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| released_id(app, &e.file_name().to_string_lossy()).map(str::to_owned))
        .collect()
}

/// At a start: whether the snapshot directory `name` is a released sandbox's kept snapshot
/// (`snapshots::cleanup` leaves it, and [`watch_released`] watches it).
pub fn keeps(app: &AppState, name: &str) -> bool {
    released_id(app, name).is_some()
}

/// The sandbox whose released kept snapshot the snapshot directory `name` is, if it is one.
fn released_id<'a>(app: &AppState, name: &'a str) -> Option<&'a str> {
    let id = name.strip_prefix(".carry-")?;
    (sandbox_id(id) && app.snapshots_dir().join(name).join(RELEASED).exists()).then_some(id)
}

/// Watches the released sandboxes' kept snapshots found at a start ([`keeps`]).
pub fn watch_released(app: &AppState) {
    for id in released(app) {
        tokio::spawn(abandon_released(app.clone(), id));
    }
}

/// Takes the old node's kept snapshot of sandbox `id` for one use (moved, stay, or
/// abandoned after release), as [`claim`] does for the new node's.
async fn claim_kept(app: &AppState, id: &str) -> Option<std::path::PathBuf> {
    take_aside(app, kept_dir(app, id), ".carry-out-").await
}

/// Takes what was received of sandbox `id` for one use (a start, a drop, its abandonment):
/// moved aside under a name of its own, so that only one of them has it.
async fn claim(app: &AppState, id: &str) -> Option<std::path::PathBuf> {
    take_aside(app, received_dir(app, id), ".carry-in-").await
}

/// Renames `dir` to a new name of `prefix` among the snapshots: the new path, if it was
/// there to take.
async fn take_aside(
    app: &AppState,
    dir: std::path::PathBuf,
    prefix: &str,
) -> Option<std::path::PathBuf> {
    let claimed = app
        .snapshots_dir()
        .join(format!("{prefix}{}", crate::ids::new_id("")));
    tokio::fs::rename(dir, &claimed)
        .await
        .ok()
        .map(|()| claimed)
}

async fn export(app: &AppState, caller: &Caller, id: &str) -> Result<Response, ApiError> {
    let (rec, live) = running(app, caller, id).await?;
    // A running microVM leaves live: it is frozen only if it cannot, or if a live move of
    // its QEMU failed before.
    let can_live = live.machine.vm().is_some() && live_moves(app).await;
    let try_live = can_live && !live_failed_before(id);
    if can_live && !try_live {
        tracing::info!(sandbox = %id, "a microVM moves cold: a live move of its QEMU failed before");
    }
    let paused = mark_moving(&live, !try_live)?;
    let dir = kept_dir(app, id);
    let _ = std::fs::remove_dir_all(&dir);
    if try_live && paused.is_none() {
        match export_live(app, &live, &dir, &rec).await {
            Ok(Some(answer)) => return Ok(answer),
            Ok(None) => {
                let _ = std::fs::remove_dir_all(&dir);
                if let Err(e) = freeze_moving(&live) {
                    unmark(&live);
                    return Err(e);
                }
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                unmark_running(app, &live).await;
                return Err(e);
            }
        }
    }
    if let Err(e) = crate::snapshots::take_for_move(app, &live, dir.clone()).await {
        unmark(&live);
        return Err(e);
    }
    let kept = serde_json::to_vec(&rec)
        .map_err(io::Error::other)
        .and_then(|r| std::fs::write(dir.join(RECORD), r))
        .and_then(|()| mark_paused(&dir, paused));
    let (done, sent) = tokio::sync::oneshot::channel();
    let answer = match kept {
        Ok(()) => bundle(&dir, rec, paused, Some(done)),
        Err(e) => Err(ApiError::internal(format!(
            "keeping the sandbox's record: {e}"
        ))),
    };
    if answer.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
        unmark(&live);
    } else {
        let (app, id, live) = (app.clone(), id.to_owned(), live.clone());
        tokio::spawn(async move {
            let _ = sent.await;
            abandon_export(app, id, live).await;
        });
    }
    answer
}

/// Whether running microVMs move live: on QEMU 10 or later unless the node runs with
/// `LOCKER_CARRY_LIVE=0`, on an older one only with `LOCKER_CARRY_LIVE=1`
/// ([`locker_runtime::vm::live_moves`]: QEMU 7.2's live migration under TCG restored about
/// one guest in ten with memory that did not match); otherwise they move cold as jails do
/// (frozen, from a snapshot).
async fn live_moves(app: &AppState) -> bool {
    match app.node.vm_assets().await {
        Ok(a) => locker_runtime::vm::live_moves(a.qemu_version).0,
        Err(_) => false,
    }
}

/// The sandboxes whose QEMU's live move failed here. Such a QEMU moves cold from then on:
/// the first guests seen crashing after a live move had been restored from a second
/// migration of a QEMU whose first had failed (QEMU 7.2 under TCG, whose live migrations
/// were later found to go wrong about one in ten anyway); a cold move's single pass over a
/// stopped guest asks the least of a QEMU whose migration state a failure left behind.
/// Kept in this process's memory: a restarted node forgets it.
static LIVE_FAILED: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Whether a live move of sandbox `id`'s QEMU failed before ([`LIVE_FAILED`]).
fn live_failed_before(id: &str) -> bool {
    LIVE_FAILED.lock().expect("live moves failed").contains(id)
}

/// Notes that a live move of sandbox `id`'s QEMU just failed ([`LIVE_FAILED`]).
fn note_live_failed(id: &str) {
    LIVE_FAILED
        .lock()
        .expect("live moves failed")
        .insert(id.to_owned());
}

/// The export of running microVM `live` (not frozen: calls are refused already) as a live
/// move ([`bundle::bundle_live`]), into its kept snapshot `dir`; `None` when it cannot
/// (its disk has no room for another layer): it moves cold.
async fn export_live(
    app: &AppState,
    live: &Arc<Live>,
    dir: &Path,
    rec: &SandboxRecord,
) -> Result<Option<Response>, ApiError> {
    let vm = live
        .machine
        .vm()
        .cloned()
        .ok_or_else(|| ApiError::internal("not a microVM"))?;
    crate::snapshots::make_dir(dir)?;
    // Volume mounts held first, their file server's table taken into the bundle (the
    // guest's volume calls wait from here until it runs on the new node).
    app.node
        .hold_shares(&live.machine, dir)
        .await
        .map_err(ApiError::during(
            "holding the sandbox's volume mounts for its move",
        ))?;
    let Some(out) = app
        .node
        .live_out(&live.machine, dir)
        .await
        .map_err(ApiError::during("preparing the sandbox's live move"))?
    else {
        return Ok(None);
    };
    serde_json::to_vec(rec)
        .map_err(io::Error::other)
        .and_then(|r| std::fs::write(dir.join(RECORD), r))
        .map_err(|e| ApiError::internal(format!("keeping the sandbox's record: {e}")))?;
    let (done, over) = tokio::sync::oneshot::channel();
    let answer = bundle_live(dir, rec.clone(), vm, out, done)?;
    let (app, id, live) = (app.clone(), rec.id.clone(), live.clone());
    tokio::spawn(async move {
        let failed = match over.await {
            Ok(Ok(st)) => {
                tracing::info!(
                    sandbox = %id,
                    downtime_ms = st.downtime_ms,
                    migration_ms = st.total_ms,
                    bytes = st.bytes,
                    passes = st.passes,
                    finish_ms = st.finish_ms,
                    "a microVM's memory left live"
                );
                None
            }
            Ok(Err(why)) => Some(why),
            Err(_) => Some("the migration's task went away".to_owned()),
        };
        if let Some(why) = failed {
            // It runs on here (a guest the host stopped to end the migration, too);
            // control's `stay` lifts the mark.
            tracing::warn!(sandbox = %id, error = %why, "a microVM's live move failed before it left: it moves cold from now on");
            note_live_failed(&id);
            run_on(&live).await;
        }
        abandon_export(app, id, live).await;
    });
    Ok(Some(answer))
}

/// `GET {PATH}{id}/snapshots/{snap}`: the bundle of the caller's snapshot `snap` of sandbox
/// `id`, which runs here, with the sandbox's record as it is now (control keeps it, to
/// start the sandbox elsewhere from it should this node die: `fleet::restart`). The
/// sandbox goes on undisturbed. Not for a sandbox that mounts volumes: they live on this
/// node and die with it, so no other node could start it (it stays lost instead of being
/// tried again and again).
pub(crate) async fn snapshot_bundle(
    app: &AppState,
    caller: &Caller,
    id: &str,
    snap: &str,
) -> Result<Response, ApiError> {
    let rec = crate::lifecycle::record_of(app, caller, id)?;
    if rec.volumes.as_array().is_some_and(|v| !v.is_empty()) {
        return Err(ApiError::conflict(format!(
            "sandbox {id} mounts volumes, which live on its node: it cannot start on another \
             node should this one die, so its snapshots are not kept for that"
        )));
    }
    let known = app.store.get_snapshot(&caller.tenant, snap)?;
    if known.is_none_or(|s| s.sandbox_id != id) {
        return Err(ApiError::not_found(format!(
            "sandbox {id} has no snapshot {snap} here"
        )));
    }
    bundle(&app.snapshots_dir().join(snap), rec, None, None)
}

/// The old node's kept snapshot of sandbox `id` (its record beside, as [`RECORD`]).
fn kept_dir(app: &AppState, id: &str) -> std::path::PathBuf {
    app.snapshots_dir().join(format!(".carry-{id}"))
}

/// What the new node received of sandbox `id`.
fn received_dir(app: &AppState, id: &str) -> std::path::PathBuf {
    app.snapshots_dir().join(format!(".carry-in-{id}"))
}

/// The record kept beside the old node's snapshot.
const RECORD: &str = ".record.json";
/// Beside the old node's kept snapshot once the sandbox's machine was released.
const RELEASED: &str = ".released";

async fn receive(
    app: &AppState,
    caller: &Caller,
    placement: Option<String>,
    body: Body,
) -> Result<Response, ApiError> {
    if let Some(p) = &placement {
        app.fleet_creates.begin(p);
    }
    let end = |app: &AppState| {
        if let Some(p) = &placement {
            app.fleet_creates.end(p, None);
        }
    };
    // Root's alone, as every snapshot (`snapshots::take`).
    let all = app.snapshots_dir();
    {
        use std::os::unix::fs::PermissionsExt;
        if let Err(e) = std::fs::create_dir_all(&all)
            .and_then(|()| std::fs::set_permissions(&all, std::fs::Permissions::from_mode(0o700)))
        {
            end(app);
            return Err(ApiError::internal(format!("{}: {e}", all.display())));
        }
    }
    let landing = all.join(format!(".carry-in-{}", crate::ids::new_id("")));
    let r = read_bundle(body, &landing, &caller.tenant).await;
    let r = r.and_then(|rec| {
        // A control replica's own node shares the fleet's store: the row of the node the
        // sandbox leaves is there until that node releases it, before the start here.
        if app
            .store
            .get_sandbox_any(&rec.id)?
            .is_some_and(|r| r.host == app.host_id || r.host.is_empty())
        {
            return Err(ApiError::conflict(format!(
                "sandbox {} already runs on this node",
                rec.id
            )));
        }
        std::fs::write(
            landing.join(RECORD),
            serde_json::to_vec(&rec).unwrap_or_default(),
        )
        .map_err(|e| ApiError::internal(e.to_string()))?;
        let dir = received_dir(app, &rec.id);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&landing, &dir).map_err(|e| ApiError::internal(e.to_string()))?;
        Ok(rec)
    });
    match r {
        Ok(rec) => {
            tokio::spawn(abandon_received(app.clone(), rec.id.clone(), placement));
            Ok(axum::Json(serde_json::json!({"received": rec.id})).into_response())
        }
        Err(e) => {
            let _ = tokio::fs::remove_dir_all(&landing).await;
            end(app);
            Err(e)
        }
    }
}

/// The record kept in `dir` (as [`RECORD`]), of `tenant`.
fn kept_record(dir: &Path, tenant: &str, id: &str) -> Result<SandboxRecord, ApiError> {
    let bytes = std::fs::read(dir.join(RECORD))
        .map_err(|_| ApiError::not_found(format!("nothing of sandbox {id} is kept here")))?;
    let rec: SandboxRecord =
        serde_json::from_slice(&bytes).map_err(|e| ApiError::internal(e.to_string()))?;
    if rec.tenant != tenant || rec.id != id {
        return Err(ApiError::not_found(format!(
            "nothing of sandbox {id} is kept here"
        )));
    }
    Ok(rec)
}

async fn start(
    app: &AppState,
    caller: &Caller,
    id: &str,
    placement: Option<String>,
) -> Result<Response, ApiError> {
    if !sandbox_id(id) {
        return Err(ApiError::bad_request(format!("{id:?} is not a sandbox id")));
    }
    let Some(dir) = claim(app, id).await else {
        return Err(ApiError::not_found(format!(
            "nothing of sandbox {id} was received here (or it waited too long and was dropped)"
        )));
    };
    let r = match kept_record(&dir, &caller.tenant, id) {
        Ok(rec) => launch_from(app, caller, &dir, &rec).await,
        Err(e) => Err(e),
    };
    let _ = tokio::fs::remove_dir_all(&dir).await;
    if let Some(p) = &placement {
        app.fleet_creates.end(p, None);
    }
    let (made, live) = r?;
    tracing::info!(sandbox = %made.id, "a sandbox carried from another node runs here");
    Ok((
        StatusCode::CREATED,
        axum::Json(crate::sandboxes::view(app, &made, Some(&live))),
    )
        .into_response())
}

async fn drop_received(
    app: &AppState,
    id: &str,
    placement: Option<String>,
) -> Result<Response, ApiError> {
    if !sandbox_id(id) {
        return Err(ApiError::bad_request(format!("{id:?} is not a sandbox id")));
    }
    if let Some(dir) = claim(app, id).await {
        let _ = tokio::fs::remove_dir_all(dir).await;
        if let Some(p) = &placement {
            app.fleet_creates.end(p, None);
        }
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Starts carried sandbox `rec` from the snapshot in `dir` (this node's copy of it).
async fn launch_from(
    app: &AppState,
    caller: &Caller,
    dir: &Path,
    rec: &SandboxRecord,
) -> Result<(SandboxRecord, Arc<Live>), ApiError> {
    if let Some(r) = app.store.get_sandbox_any(&rec.id)? {
        let on = match r.host == app.host_id || r.host.is_empty() {
            true => "this node".to_owned(),
            // The fleet's store, shared by control replicas' own nodes: another one's row.
            false => format!("node {} (its row is there)", r.host),
        };
        return Err(ApiError::conflict(format!(
            "sandbox {} already runs on {on}",
            rec.id
        )));
    }
    let runtime = match rec.runtime.as_str() {
        "jail" => locker_types::Runtime::Jail,
        "microvm" => {
            crate::limits::require_microvm(&app.node).await?;
            locker_types::Runtime::Microvm
        }
        other => return Err(ApiError::bad_request(format!("runtime {other:?}"))),
    };
    let template =
        crate::templates::by_digest(app, &rec.template_digest, &format!("sandbox {}", rec.id))?;
    let ttl_left = locker_types::parse_rfc3339(&rec.expires_at)
        .map_or(rec.ttl_s, |exp| (exp - now_s()).max(1) as u64);
    let new = crate::lifecycle::NewSandbox {
        template_name: rec.template.clone(),
        template,
        runtime,
        cpus: rec.cpus,
        memory_mb: rec.memory_mb,
        disk_mb: rec.disk_mb,
        ttl_s: ttl_left,
        idle_timeout_s: rec.idle_timeout_s,
        env: rec.env.clone(),
        network: rec.network.clone(),
        metadata: rec.metadata.clone(),
        // Its volumes are this node's by now (moved before it starts).
        volumes: crate::sandboxes::resolve_volumes(
            app,
            caller,
            &crate::snapshots::recorded_volumes(rec)?,
        )?,
    };
    // A row it left here when it went elsewhere before.
    app.store.forget_sandbox(&rec.id)?;
    let paused = std::fs::read_to_string(dir.join(PAUSED)).ok();
    let (made, live) =
        crate::lifecycle::launch_carried(app, caller, &new, dir.to_path_buf(), rec).await?;
    // Paused when it left: paused again, as it was.
    let Some(by) = paused else {
        return Ok((made, live));
    };
    if let Err(e) = crate::sandboxes::freeze(app, &live, by.trim() == "idle") {
        tracing::warn!(sandbox = %rec.id, error = %e.message, "a sandbox paused when it left its node runs on its new one");
        return Ok((made, live));
    }
    Ok((crate::lifecycle::record_of(app, caller, &rec.id)?, live))
}

/// Destroys the machine of sandbox `id` here and forgets its row (it did not end). On a
/// control replica's own node the store is the fleet's: a row another node wrote there
/// (the sandbox runs there now) is left alone.
async fn let_go(app: &AppState, caller: &Caller, id: &str) -> Result<(), ApiError> {
    match crate::lifecycle::record_of(app, caller, id) {
        Ok(rec) if !rec.host.is_empty() && rec.host != app.host_id => return Ok(()),
        Ok(rec) => crate::lifecycle::discard(app, &rec).await?,
        Err(e) if e.status == StatusCode::NOT_FOUND && app.fleet.is_some() => return Ok(()),
        Err(e) if e.status == StatusCode::NOT_FOUND => {}
        Err(e) => return Err(e),
    }
    app.store.forget_sandbox(id)?;
    Ok(())
}

async fn release(app: &AppState, caller: &Caller, id: &str) -> Result<Response, ApiError> {
    kept_record(&kept_dir(app, id), &caller.tenant, id)?;
    if let Some(live) = app.live.read().await.get(id).cloned() {
        let mut st = live.pause.lock().expect("pause lock");
        if st.moving.is_none() {
            return Err(ApiError::conflict(format!(
                "sandbox {id} is not moving: its move waited too long and was abandoned; \
                 it runs here"
            )));
        }
        st.leaving = true;
    }
    std::fs::write(kept_dir(app, id).join(RELEASED), crate::ids::new_id("rel_"))
        .map_err(|e| ApiError::internal(format!("marking the kept snapshot released: {e}")))?;
    let_go(app, caller, id).await?;
    tokio::spawn(abandon_released(app.clone(), id.to_owned()));
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn moved(app: &AppState, caller: &Caller, id: &str) -> Result<Response, ApiError> {
    kept_record(&kept_dir(app, id), &caller.tenant, id)?;
    let_go(app, caller, id).await?;
    if let Some(dir) = claim_kept(app, id).await {
        let _ = tokio::fs::remove_dir_all(&dir).await;
    }
    tracing::info!(sandbox = %id, "a sandbox moved to another node: nothing of it is left here");
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn stay(app: &AppState, caller: &Caller, id: &str) -> Result<Response, ApiError> {
    let dir = kept_dir(app, id);
    let live = app.live.read().await.get(id).cloned();
    let r = match live {
        Some(live) if live.tenant == caller.tenant => {
            unmark_running(app, &live).await;
            Ok(())
        }
        Some(_) => Err(ApiError::not_found(format!(
            "sandbox {id} does not run here"
        ))),
        // Released already: it starts again here from its kept snapshot.
        None => {
            let rec = kept_record(&dir, &caller.tenant, id)?;
            let Some(claimed) = claim_kept(app, id).await else {
                return Err(ApiError::not_found(format!(
                    "nothing of sandbox {id} is kept here"
                )));
            };
            let r = launch_from(app, caller, &claimed, &rec).await.map(|_| {
                tracing::warn!(sandbox = %id, "a sandbox that could not move started again on its node from its snapshot");
            });
            let _ = tokio::fs::remove_dir_all(&claimed).await;
            r
        }
    };
    let _ = tokio::fs::remove_dir_all(&dir).await;
    r.map(|()| StatusCode::NO_CONTENT.into_response())
}
