//! Volumes: a tenant's persistent directory trees, and their files API with no machine.
//!
//! A volume is a filesystem of its own, a sparse btrfs image of `size_mb`
//! (`<data-dir>/volumes/<id>/disk.img`, mounted at `fs/` on the host; see
//! `locker_runtime::volume_fs`), whose live tree `fs/live/` carries canonical ids (root = 0
//! on disk), plus its record in the store. Sandboxes mount the live tree directly (an
//! id-mapped bind); serverless runs see a private copy-on-write view of it under a layer of
//! their own, both in `fs/runs/<call>/` (see `runs`). Beside `fs/`:
//! - `agent.sock` (+ `.pid`): the volume's host-side agent, started on first use of its
//!   files API (one per volume; see `locker_runtime::host_agent`), stopped on delete and at
//!   shutdown; a stale one is stopped and its socket removed when the server starts;
//! - `private/`: the agent's log, output dir and empty cgroup root.
//!
//! The filesystem's size holds every writer to `size_mb` (a sandbox writing in place gets
//! `ENOSPC`); the files API also keeps a [`Space`] (the bytes in use, measured at start and
//! kept up to date by its writes) so it can refuse a write with a clear error before it
//! starts. Snapshots are read-only btrfs snapshots in `fs/snapshots/<snap_id>/` (constant
//! time; they share blocks with the volume, so blocks only they still hold count against
//! its size); a fork copies such a snapshot's tree into the new volume's own filesystem
//! (a copy of the data: two volumes never share blocks). Both hold the
//! volume's write gate only for the snapshot, so they see one consistent point of
//! everything written through the API.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use locker_runtime::agent::AgentClient;
use locker_runtime::host_agent::{HostAgent, HostAgentPaths};
use locker_store::{VolumeRecord, VolumeSnapshotRecord};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::Json;
use crate::files::{FilesTarget, Space};
use crate::state::{new_id, now_s, AppState};

pub mod handoff;
pub mod moving;

/// `size_mb` when a request gives none, and the range a request may ask for.
pub const DEFAULT_SIZE_MB: u64 = 10_240;
pub const SIZE_MB: (u64, u64) = (1, 1_048_576);

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/volumes", post(create).get(list))
        .route("/v1/volumes/{id}", get(get_one).delete(delete))
        .route(
            "/v1/volumes/{id}/snapshots",
            post(snapshot).get(list_snapshots),
        )
        .route(
            "/v1/volumes/{id}/snapshots/{snap}",
            axum::routing::delete(delete_snapshot),
        )
        .route("/v1/volumes/{id}/restore", post(restore))
        .route("/v1/volumes/{id}/fork", post(fork))
        .route("/v1/volumes/{id}/move", post(moving::move_volume))
        .merge(crate::files::routes_for::<VolumeFiles>("/v1/volumes/{id}"))
}

/// A volume this server serves: its tree, its space and its agent (once started).
#[derive(Debug)]
pub struct Volume {
    pub id: String,
    pub dir: PathBuf,
    pub space: Space,
    /// Regular files the volume held at the last run's view (or more than that, when the
    /// view gave up): decides between a reflink view and a subvolume snapshot (`runs`).
    pub files_hint: std::sync::atomic::AtomicU64,
    /// Runs that took a snapshot because of `files_hint` (see `runs`).
    pub view_tries: std::sync::atomic::AtomicU64,
    /// Runs waiting for a view of the volume (see `runs`).
    pub views: crate::runs::Views,
    agent: tokio::sync::Mutex<Option<HostAgent>>,
    /// What changed when: files-API writes and run commits (see [`CommitLog`]).
    pub log: std::sync::Mutex<CommitLog>,
    /// A move of the volume to another server is under way (`moving`): one at a time.
    moving: std::sync::atomic::AtomicBool,
    /// Creates that mount the volume between their check that it is not moving and their
    /// record's write ([`MountClaim`]): a move does not start while there is one.
    mounting: std::sync::atomic::AtomicUsize,
}

/// A create's claim on a volume it mounts, from its check that the volume is not moving
/// until the sandbox's record is written (the claim dropped with the create's request):
/// a move checks mounts from records (`running_sandbox_mounting`), so a sandbox in that
/// instant would mount a volume that leaves. The claim and a move's start
/// ([`Volume::start_moving`]) each write their flag, then read the other's (sequentially
/// consistent): at least one of the two sees the other and gives way.
pub struct MountClaim(Arc<Volume>);

impl MountClaim {
    /// A claim on `v`, unless a move of it is under way.
    pub fn take(v: &Arc<Volume>) -> Option<MountClaim> {
        use std::sync::atomic::Ordering::SeqCst;
        v.mounting.fetch_add(1, SeqCst);
        if v.moving.load(SeqCst) {
            v.mounting.fetch_sub(1, SeqCst);
            return None;
        }
        Some(MountClaim(v.clone()))
    }
}

impl Drop for MountClaim {
    fn drop(&mut self) {
        self.0
            .mounting
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl std::fmt::Debug for MountClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MountClaim({})", self.0.id)
    }
}

/// A volume's in-memory log of changes, `(seq, paths)`: every files-API write, delete,
/// mkdir and move and every run commit appends one entry under the volume's write gate.
/// A run notes the sequence number when it snapshots the volume; at commit, a path it
/// changed that equals, contains or is contained in a path logged after that number is a
/// conflict. Entries no run in flight can need are dropped. In memory only: a restarted
/// server has no run in flight.
#[derive(Debug, Default)]
pub struct CommitLog {
    seq: u64,
    entries: std::collections::VecDeque<(u64, Vec<String>)>,
    /// Start sequence numbers of runs in flight (with their counts).
    active: std::collections::BTreeMap<u64, usize>,
}

/// `p` made canonical: a leading `/`, no empty, `.` or `..` components, no trailing `/`.
pub fn normalize(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

/// Whether `a` and `b` are the same path or one contains the other.
pub fn overlaps(a: &str, b: &str) -> bool {
    let within =
        |x: &str, y: &str| y == "/" || x.strip_prefix(y).is_some_and(|r| r.starts_with('/'));
    a == b || within(a, b) || within(b, a)
}

impl CommitLog {
    /// Appends a change; returns its sequence number.
    pub fn append(&mut self, paths: Vec<String>) -> u64 {
        self.seq += 1;
        if !self.active.is_empty() {
            self.entries.push_back((self.seq, paths));
        }
        self.seq
    }

    /// A run starts now: its start sequence number.
    pub fn begin(&mut self) -> u64 {
        *self.active.entry(self.seq).or_default() += 1;
        self.seq
    }

    /// The run that started at `start` is over.
    pub fn end(&mut self, start: u64) {
        if let Some(n) = self.active.get_mut(&start) {
            *n -= 1;
            if *n == 0 {
                self.active.remove(&start);
            }
        }
        match self.active.keys().next() {
            None => self.entries.clear(),
            Some(&oldest) => {
                while self.entries.front().is_some_and(|(s, _)| *s <= oldest) {
                    self.entries.pop_front();
                }
            }
        }
    }

    /// Those of `paths` that overlap a path changed after `start`.
    pub fn conflicts(&self, start: u64, paths: &[String]) -> Vec<String> {
        let later: Vec<&String> = self
            .entries
            .iter()
            .filter(|(s, _)| *s > start)
            .flat_map(|(_, p)| p)
            .collect();
        if later.is_empty() {
            return Vec::new();
        }
        paths
            .iter()
            .filter(|p| later.iter().any(|q| overlaps(p, q)))
            .cloned()
            .collect()
    }
}

impl Volume {
    /// The root of the volume's filesystem (its top-level subvolume): `live/`, `runs/`,
    /// `snapshots/` and the commit journal.
    /// Whether a move of the volume to another server is under way (no sandbox mounts it
    /// meanwhile: its files are about to leave).
    pub fn is_moving(&self) -> bool {
        self.moving.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks a move of the volume under way: refused (409) while another one is, or while a
    /// create that mounts it holds a [`MountClaim`].
    pub(crate) fn start_moving(&self, name: &str) -> Result<(), ApiError> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.moving.swap(true, SeqCst) {
            return Err(ApiError::conflict(format!(
                "volume {name} is being moved already"
            )));
        }
        if self.mounting.load(SeqCst) > 0 {
            self.moving.store(false, SeqCst);
            return Err(ApiError::conflict(format!(
                "a sandbox that mounts volume {name} is being created: move it once that \
                 sandbox is deleted"
            )));
        }
        Ok(())
    }

    pub fn root(&self) -> PathBuf {
        locker_runtime::volume_fs::root(&self.dir)
    }

    /// The live tree: what sandboxes mount and the files API serves.
    pub fn live(&self) -> PathBuf {
        locker_runtime::volume_fs::live(&self.dir)
    }

    fn paths(&self) -> HostAgentPaths {
        HostAgentPaths {
            root: self.live(),
            socket: self.dir.join("agent.sock"),
            private: self.dir.join("private"),
        }
    }

    /// The connection to the volume's agent, starting it on first use (or again if it died).
    async fn agent(&self, exe: &std::path::Path) -> Result<AgentClient, ApiError> {
        let mut slot = self.agent.lock().await;
        if let Some(a) = slot.as_ref().filter(|a| a.is_alive()) {
            return Ok(a.client.clone());
        }
        if let Some(dead) = slot.take() {
            dead.stop().await;
        }
        let a = HostAgent::start(exe, &self.paths()).await.map_err(|e| {
            ApiError::internal(format!(
                "the files service of volume {} could not start: {e}",
                self.id
            ))
        })?;
        let client = a.client.clone();
        *slot = Some(a);
        Ok(client)
    }

    /// Stops the volume's agent, if it runs.
    async fn stop_agent(&self) {
        if let Some(a) = self.agent.lock().await.take() {
            a.stop().await;
        }
    }
}

/// The volumes of this server, by id.
pub struct Volumes {
    pub(crate) root: PathBuf,
    agent_exe: PathBuf,
    open: RwLock<HashMap<String, Arc<Volume>>>,
    /// Serverless runs in flight, per tenant (the `runs` quota).
    pub(crate) runs_inflight: std::sync::Mutex<HashMap<String, u64>>,
    /// Disk granted to volumes being made (not stored yet), per tenant (the disk quota).
    pub(crate) pending_mb: crate::capacity::Pending,
    /// Moves between joined nodes under way here (`handoff`).
    pub moves: handoff::Moves,
}

impl Volumes {
    /// Opens every volume of the store: mounts its filesystem (or adopts the mount a
    /// previous server left), stops agents it left, finishes a commit it left, removes the
    /// runs it left, measures each tree. A volume made before volumes had a filesystem of
    /// their own (a plain `live/` directory) is moved into one. A volume whose image is
    /// missing is served empty after a warning.
    ///
    /// `fleet_member`: this is a joined node, whose records a move may have written before
    /// the fleet's switched (`handoff`). Also answered: the ids of copies a move left here
    /// that are not this server's, now removed (`moving::sweep`).
    pub async fn open(
        data_dir: &std::path::Path,
        agent_exe: PathBuf,
        records: Vec<VolumeRecord>,
        fleet_member: bool,
    ) -> std::io::Result<(Volumes, Vec<String>)> {
        let root = data_dir.join("volumes");
        std::fs::create_dir_all(&root)?;
        let v = Volumes {
            root,
            agent_exe,
            open: RwLock::new(HashMap::new()),
            runs_inflight: Default::default(),
            pending_mb: Default::default(),
            moves: Default::default(),
        };
        let (marked, removed) = moving::sweep(&v.root, &records, fleet_member);
        for r in records {
            let dir = v.root.join(&r.id);
            let vol = v.make(&r, 0);
            locker_runtime::host_agent::stop_stale(&vol.paths());
            let (d, size_mb, id) = (dir.clone(), r.size_mb, r.id.clone());
            tokio::task::spawn_blocking(move || open_fs(&d, size_mb, &id))
                .await
                .map_err(std::io::Error::other)??;
            let live = vol.live();
            let used =
                tokio::task::spawn_blocking(move || locker_runtime::tree::allocated_bytes(&live))
                    .await
                    .map_err(std::io::Error::other)??;
            vol.space.recount_to(used);
            v.open
                .write()
                .expect("volumes lock")
                .insert(r.id.clone(), vol);
        }
        handoff::adopt(&v, marked).await;
        Ok((v, removed))
    }

    fn make(&self, r: &VolumeRecord, used: u64) -> Arc<Volume> {
        let dir = self.root.join(&r.id);
        Arc::new(Volume {
            id: r.id.clone(),
            files_hint: Default::default(),
            view_tries: Default::default(),
            views: Default::default(),
            space: Space::new(
                locker_runtime::volume_fs::live(&dir),
                format!("volume {}", r.name),
                r.size_mb << 20,
                used,
            ),
            dir,
            agent: Default::default(),
            log: Default::default(),
            moving: Default::default(),
            mounting: Default::default(),
        })
    }

    pub(crate) fn get(&self, id: &str) -> Option<Arc<Volume>> {
        self.open.read().expect("volumes lock").get(id).cloned()
    }

    /// Unmounts every volume's filesystem (at shutdown, after the agents stopped): a stopped
    /// server leaves no volume mounted on the host, and its loop device goes with the last
    /// user (a sandbox that mounts the volume keeps it until it ends or is adopted). The next
    /// start mounts them again.
    pub async fn unmount_all(&self) {
        let dirs: Vec<(String, PathBuf)> = self
            .open
            .read()
            .expect("volumes lock")
            .values()
            .map(|v| (v.id.clone(), v.dir.clone()))
            .collect();
        let _ = tokio::task::spawn_blocking(move || {
            for (id, dir) in dirs {
                if let Err(e) = locker_runtime::volume_fs::unmount(&dir) {
                    tracing::warn!(volume = %id, error = %e, "cannot unmount a volume");
                }
            }
        })
        .await;
    }

    /// Stops every volume's agent (at shutdown).
    pub async fn stop_agents(&self) {
        let all: Vec<Arc<Volume>> = self
            .open
            .read()
            .expect("volumes lock")
            .values()
            .cloned()
            .collect();
        for v in all {
            v.stop_agent().await;
        }
    }
}

/// Makes the volume in `dir` ready to serve: its filesystem mounted (made, and a plain
/// `live/` of an older server moved into it, if it has none), a commit a killed server
/// left finished, the runs it left removed.
fn open_fs(dir: &std::path::Path, size_mb: u64, id: &str) -> std::io::Result<()> {
    use locker_runtime::volume_fs;
    let legacy = dir.join("live");
    if !volume_fs::image(dir).exists() {
        // The old layout: the journal sits beside a plain `live/`.
        locker_runtime::commit::replay_journal(dir)?;
        let _ = std::fs::remove_dir_all(volume_fs::root(dir));
        volume_fs::create(dir, size_mb)?;
        if legacy.is_dir() {
            tracing::warn!(volume = %id, "moving a volume into a filesystem of its own");
            let live = volume_fs::live(dir);
            std::fs::remove_dir(&live)?;
            locker_runtime::tree::copy(&legacy, &live)?;
            std::fs::remove_dir_all(&legacy)?;
        } else {
            tracing::warn!(volume = %id, "a volume's image is missing; serving it empty");
        }
    }
    volume_fs::mount(dir)?;
    let root = volume_fs::root(dir);
    locker_runtime::commit::replay_journal(&root)?;
    let runs = root.join("runs");
    std::fs::create_dir_all(&runs)?;
    for e in std::fs::read_dir(&runs)? {
        volume_fs::remove_tree(&e?.path())?;
    }
    Ok(())
}

/// A live sandbox (starting, running or paused) that mounts volume `id`, if any: such a
/// volume cannot be deleted.
pub fn running_sandbox_mounting(app: &AppState, volume_id: &str) -> Option<String> {
    let live = app.store.list_live_sandboxes().ok()?;
    live.into_iter()
        .find(|r| {
            r.volumes
                .as_array()
                .is_some_and(|v| v.iter().any(|m| m["volume"] == volume_id))
        })
        .map(|r| r.id)
}

/// The API's view of a volume.
fn view(app: &AppState, r: &VolumeRecord, v: &Volume) -> Value {
    let mut out = json!({"id": r.id, "name": r.name, "size_mb": r.size_mb, "used_bytes": v.space.used_bytes(), "created_at": r.created_at});
    // A control replica that is a node of its fleet names its node, as the volumes other
    // servers hold are listed with theirs.
    if app.cfg.local_node.is_some() {
        out["node"] = json!(app.host_id);
    }
    out
}

/// The caller's volume by id or name, with its state; 404 for another tenant's.
pub(crate) fn lookup(
    app: &AppState,
    caller: &Caller,
    id_or_name: &str,
) -> Result<(VolumeRecord, Arc<Volume>), ApiError> {
    let missing = || match app.volumes.moves.moved_away(id_or_name) {
        // A call routed here just before the volume's move switched.
        true => ApiError::unavailable(format!(
            "volume {id_or_name} moved to another node of the fleet while this call was on its \
             way: nothing was done; call again (it goes to the new home)"
        )),
        false => ApiError::not_found(format!("volume {id_or_name} does not exist")),
    };
    let r = app
        .store
        .get_volume(&caller.tenant, id_or_name)?
        .ok_or_else(missing)?;
    let v = app.volumes.get(&r.id).ok_or_else(missing)?;
    Ok((r, v))
}

/// A volume as a target of the files API.
pub struct VolumeFiles {
    vol: Arc<Volume>,
    agent: AgentClient,
}

impl FilesTarget for VolumeFiles {
    async fn resolve(app: &AppState, caller: &Caller, id: &str) -> Result<Self, ApiError> {
        let (_, vol) = lookup(app, caller, id)?;
        let agent = vol.agent(&app.volumes.agent_exe).await?;
        Ok(VolumeFiles { vol, agent })
    }
    fn agent(&self) -> &AgentClient {
        &self.agent
    }
    fn space(&self) -> Option<&Space> {
        Some(&self.vol.space)
    }
    fn changed(&self, paths: &[&str]) {
        let paths = paths.iter().map(|p| normalize(p)).collect();
        self.vol.log.lock().expect("commit log").append(paths);
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateVolume {
    name: Option<String>,
    size_mb: Option<u64>,
}

impl CreateVolume {
    /// The new volume's name and size, checked.
    fn checked(&self) -> Result<(String, u64), ApiError> {
        let name = check_name(self.name.as_deref())?;
        let size_mb = self.size_mb.unwrap_or(DEFAULT_SIZE_MB);
        if !(SIZE_MB.0..=SIZE_MB.1).contains(&size_mb) {
            return Err(ApiError::bad_request(format!(
                "`size_mb` must be between {} and {}",
                SIZE_MB.0, SIZE_MB.1
            )));
        }
        Ok((name, size_mb))
    }
}

/// The name and size of the volume a create's body asks for, `None` when the handler would
/// refuse the body (it then says why): for the fleet's control plane, which reserves the
/// volume's record before a node makes it (`fleet::route::volumes`).
pub(crate) fn create_asks(body: &[u8]) -> Option<(String, u64)> {
    serde_json::from_slice::<CreateVolume>(body)
        .ok()?
        .checked()
        .ok()
}

/// The name a fork's body gives its new volume, `None` when the handler would refuse it.
pub(crate) fn fork_asks(body: &[u8]) -> Option<String> {
    check_name(
        serde_json::from_slice::<ForkBody>(body)
            .ok()?
            .name
            .as_deref(),
    )
    .ok()
}

/// Checks a new volume's name: the store's rule, and not shaped like an id (a name can
/// stand in for an id in every route, so `vol_…` stays unambiguous).
fn check_name(name: Option<&str>) -> Result<String, ApiError> {
    let name = name
        .ok_or_else(|| ApiError::bad_request("`name` is required (a volume name like \"repo\")"))?;
    locker_store::validate_volume_name(name)?;
    if name.starts_with("vol_") {
        return Err(ApiError::bad_request(format!(
            "`name` must not start with `vol_` (ids do), got {name:?}"
        )));
    }
    Ok(name.to_owned())
}

/// Makes a new volume (its directories and filesystem), stores its record and serves it.
/// `fill` fills the empty `live/` it is given and returns the bytes it holds; everything is
/// unmounted and removed again when anything fails.
async fn add(
    app: &AppState,
    rec: VolumeRecord,
    fill: impl FnOnce(&std::path::Path) -> std::io::Result<u64> + Send + 'static,
) -> Result<Arc<Volume>, ApiError> {
    use locker_runtime::volume_fs;
    volume_fs::support().map_err(|why| {
        ApiError::unavailable(format!(
            "volumes get a filesystem of their own, which this host cannot make: {why} (`locker doctor` tells)"
        ))
    })?;
    let dir = app.volumes.root.join(&rec.id);
    let d = dir.clone();
    let size_mb = rec.size_mb;
    let made = tokio::task::spawn_blocking(move || -> std::io::Result<u64> {
        std::fs::create_dir_all(d.join("private"))?;
        volume_fs::create(&d, size_mb)?;
        fill(&volume_fs::live(&d))
    })
    .await
    .map_err(|e| ApiError::internal(format!("making volume {}: {e}", rec.id)));
    let discard = |dir: PathBuf| async move {
        let _ = tokio::task::spawn_blocking(move || volume_fs::remove(&dir)).await;
    };
    let used = match made {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => {
            discard(dir).await;
            return Err(ApiError::internal(format!(
                "making the filesystem of volume {}: {e}",
                rec.id
            )));
        }
        Err(e) => {
            discard(dir).await;
            return Err(e);
        }
    };
    if let Err(e) = app.store.insert_volume(&rec) {
        discard(dir).await;
        return Err(e.into());
    }
    let vol = app.volumes.make(&rec, used);
    app.volumes
        .open
        .write()
        .expect("volumes lock")
        .insert(rec.id.clone(), vol.clone());
    Ok(vol)
}

/// The id control chose for a volume that a forwarded create or fork makes on this node
/// (`fleet::node::VOLUME_HEADER`), if any.
type Chosen = Option<axum::Extension<crate::fleet::node::Forwarded>>;

/// The record of a new volume named `name` (409 if the caller already has one so named),
/// with the id control chose for it when it came forwarded with one.
fn new_record(
    app: &AppState,
    caller: &Caller,
    name: String,
    size_mb: u64,
    chosen: Chosen,
) -> Result<VolumeRecord, ApiError> {
    if app.store.get_volume(&caller.tenant, &name)?.is_some() {
        return Err(ApiError::conflict(format!(
            "a volume named {name:?} already exists"
        )));
    }
    let id = chosen
        .and_then(|axum::Extension(f)| f.volume)
        .unwrap_or_else(|| new_id("vol_"));
    Ok(VolumeRecord {
        id,
        tenant: caller.tenant.clone(),
        name,
        size_mb,
        created_at: locker_types::rfc3339(now_s()),
        host: app.host_id.clone(),
    })
}

/// Admits a new volume of `size_mb` for `tenant`: refused past the data dir's free space
/// (422) or the tenant's disk quota (429). The grant counts against the quota until it is
/// dropped, which is once the volume's record is stored (or its making failed).
async fn admit(
    app: &AppState,
    tenant: &str,
    size_mb: u64,
) -> Result<crate::capacity::PendingGrant, ApiError> {
    crate::capacity::admit_disk(&app.cfg.data_dir, "`size_mb`", size_mb)?;
    let _guard = app.create_lock.lock().await;
    crate::lifecycle::check_disk_quota(app, tenant, size_mb, "volume")?;
    Ok(app.volumes.pending_mb.hold(tenant, size_mb))
}

async fn create(
    State(app): State<AppState>,
    caller: Caller,
    chosen: Chosen,
    Json(body): Json<CreateVolume>,
) -> Result<impl IntoResponse, ApiError> {
    let (name, size_mb) = body.checked()?;
    let rec = new_record(&app, &caller, name, size_mb, chosen)?;
    let grant = admit(&app, &caller.tenant, size_mb).await?;
    let vol = add(&app, rec.clone(), |_| Ok(0)).await?;
    drop(grant);
    Ok((StatusCode::CREATED, axum::Json(view(&app, &rec, &vol))))
}

async fn list(State(app): State<AppState>, caller: Caller) -> Result<impl IntoResponse, ApiError> {
    let recs = app.store.list_volumes(&caller.tenant)?;
    // Volumes another server of the fleet holds are listed from their records, with that
    // server's id as `node` (their use is that server's to say).
    let items: Vec<Value> = recs
        .iter()
        .filter_map(|r| match app.volumes.get(&r.id) {
            Some(v) => Some(view(&app, r, &v)),
            None if !r.host.is_empty() && r.host != app.host_id => Some(json!({
                "id": r.id, "name": r.name, "size_mb": r.size_mb, "used_bytes": null,
                "created_at": r.created_at, "node": r.host,
            })),
            None => None,
        })
        .collect();
    Ok(axum::Json(json!({ "volumes": items })))
}

async fn get_one(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let (r, v) = lookup(&app, &caller, &id)?;
    Ok(axum::Json(view(&app, &r, &v)))
}

async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let (r, v) = lookup(&app, &caller, &id)?;
    if let Some(sb) = running_sandbox_mounting(&app, &r.id) {
        return Err(ApiError::conflict(format!(
            "volume {} is mounted by running sandbox {sb}: delete the sandbox first",
            r.name
        )));
    }
    // Wait for writes in flight; none starts after (the volume leaves the map first).
    app.volumes
        .open
        .write()
        .expect("volumes lock")
        .remove(&r.id);
    let _all = v.space.gate.write().await;
    v.stop_agent().await;
    app.store.delete_volume(&caller.tenant, &r.id)?;
    let dir = v.dir.clone();
    tokio::task::spawn_blocking(move || locker_runtime::volume_fs::remove(&dir))
        .await
        .map_err(|e| ApiError::internal(format!("removing volume {}: {e}", r.id)))?
        .map_err(|e| ApiError::internal(format!("removing the files of volume {}: {e}", r.id)))?;
    Ok(StatusCode::NO_CONTENT)
}

/// Makes `to` (in the volume's `snapshots/`) a read-only snapshot of the volume's whole
/// filesystem at one consistent point (no files-API write in flight); its tree is
/// `to/live`.
async fn snapshot_live(v: &Volume, to: PathBuf) -> Result<(), ApiError> {
    let _all = v.space.gate.write().await;
    if v.space.is_closed() {
        return Err(v.space.moved());
    }
    snapshot_held(v, to).await
}

/// [`snapshot_live`] for a caller that holds the volume's gate already.
async fn snapshot_held(v: &Volume, to: PathBuf) -> Result<(), ApiError> {
    let root = v.root();
    tokio::task::spawn_blocking(move || locker_runtime::volume_fs::snapshot(&root, &to))
        .await
        .map_err(|e| ApiError::internal(format!("snapshotting volume {}: {e}", v.id)))?
        .map_err(|e| ApiError::internal(format!("snapshotting volume {}: {e}", v.id)))
}

/// Removes a snapshot of the volume's filesystem (after a failure, or a fork's).
async fn drop_snapshot(at: PathBuf) {
    let _ = tokio::task::spawn_blocking(move || locker_runtime::volume_fs::remove_tree(&at)).await;
}

async fn snapshot(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let (r, v) = lookup(&app, &caller, &id)?;
    let snap_id = new_id("snap_");
    let dir = v.root().join("snapshots").join(&snap_id);
    // The gate is kept (shared: writes go on) until the record is written: a move that
    // holds the gate meanwhile lists every snapshot made before (`handoff::hold`).
    let all = v.space.gate.write().await;
    if v.space.is_closed() {
        return Err(v.space.moved());
    }
    snapshot_held(&v, dir.clone()).await?;
    let _shared = all.downgrade();
    let tree = dir.join("live");
    let measured =
        tokio::task::spawn_blocking(move || locker_runtime::tree::allocated_bytes(&tree)).await;
    let size_bytes = match measured {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => {
            drop_snapshot(dir).await;
            return Err(ApiError::internal(format!("measuring a snapshot: {e}")));
        }
        Err(e) => {
            drop_snapshot(dir).await;
            return Err(ApiError::internal(format!("measuring a snapshot: {e}")));
        }
    };
    let snap = VolumeSnapshotRecord {
        id: snap_id,
        tenant: caller.tenant.clone(),
        volume_id: r.id.clone(),
        size_bytes,
        created_at: locker_types::rfc3339(now_s()),
        path: dir.display().to_string(),
    };
    if let Err(e) = app.store.insert_volume_snapshot(&snap) {
        drop_snapshot(dir).await;
        return Err(e.into());
    }
    Ok((StatusCode::CREATED, axum::Json(snapshot_view(&snap))))
}

fn snapshot_view(s: &VolumeSnapshotRecord) -> Value {
    json!({"id": s.id, "volume_id": s.volume_id, "size_bytes": s.size_bytes, "created_at": s.created_at})
}

/// The caller's snapshot `snap` of volume `r`; 404 for another volume's or tenant's.
fn snapshot_of(
    app: &AppState,
    caller: &Caller,
    r: &VolumeRecord,
    snap: &str,
) -> Result<VolumeSnapshotRecord, ApiError> {
    app.store
        .get_volume_snapshot(&caller.tenant, snap)?
        .filter(|s| s.volume_id == r.id)
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "volume {} has no snapshot {snap} (`GET /v1/volumes/{}/snapshots` lists them)",
                r.name, r.name
            ))
        })
}

async fn list_snapshots(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let (r, _) = lookup(&app, &caller, &id)?;
    let snaps = app.store.list_volume_snapshots(&caller.tenant, &r.id)?;
    let list: Vec<Value> = snaps.iter().map(snapshot_view).collect();
    Ok(axum::Json(json!({ "snapshots": list })))
}

async fn delete_snapshot(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, snap)): Path<(String, String)>,
) -> Result<impl IntoResponse, ApiError> {
    let (r, _) = lookup(&app, &caller, &id)?;
    let s = snapshot_of(&app, &caller, &r, &snap)?;
    // The record goes first: a crash in between leaves a directory nothing names, which
    // costs space but never a record without its files.
    app.store.delete_volume_snapshot(&caller.tenant, &s.id)?;
    drop_snapshot(PathBuf::from(&s.path)).await;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RestoreBody {
    snapshot: String,
}

/// `POST /v1/volumes/{id}/restore {"snapshot"}`: the volume's tree becomes the snapshot's.
/// Refused while a running sandbox mounts the volume (it would keep the old tree). Runs in
/// flight see every path as changed (their commits conflict rather than mix two trees).
/// The new tree is copied beside the live one first and swapped in by two renames under
/// the volume's gate, so a failure leaves the volume as it was.
async fn restore(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(body): Json<RestoreBody>,
) -> Result<impl IntoResponse, ApiError> {
    let (r, v) = lookup(&app, &caller, &id)?;
    let s = snapshot_of(&app, &caller, &r, &body.snapshot)?;
    if let Some(sb) = running_sandbox_mounting(&app, &r.id) {
        return Err(ApiError::conflict(format!(
            "volume {} is mounted by running sandbox {sb}: delete the sandbox before restoring a snapshot",
            r.name
        )));
    }
    let _all = v.space.gate.write().await;
    if v.space.is_closed() {
        return Err(v.space.moved());
    }
    // The files API's agent holds the old tree open: it starts again on the next call.
    v.stop_agent().await;
    let (live, root, from) = (v.live(), v.root(), PathBuf::from(&s.path).join("live"));
    let staged = root.join(format!(".restore-{}", s.id));
    let old = root.join(format!(".restored-from-{}", s.id));
    let used = tokio::task::spawn_blocking(move || -> std::io::Result<u64> {
        locker_runtime::volume_fs::remove_tree(&staged)?;
        locker_runtime::volume_fs::remove_tree(&old)?;
        let copied = locker_runtime::tree::copy(&from, &staged)?;
        std::fs::rename(&live, &old)?;
        if let Err(e) = std::fs::rename(&staged, &live) {
            let _ = std::fs::rename(&old, &live);
            return Err(e);
        }
        locker_runtime::volume_fs::remove_tree(&old)?;
        Ok(copied.bytes)
    })
    .await
    .map_err(|e| ApiError::internal(format!("restoring volume {}: {e}", r.id)))?
    .map_err(|e| ApiError::internal(format!("restoring volume {} from {}: {e}", r.id, s.id)))?;
    v.space.recount_to(used);
    v.log.lock().expect("commit log").append(vec!["/".into()]);
    Ok(axum::Json(view(&app, &r, &v)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    name: Option<String>,
    /// Fork from this snapshot of the volume instead of from its tree now.
    snapshot: Option<String>,
}

async fn fork(
    State(app): State<AppState>,
    caller: Caller,
    chosen: Chosen,
    Path(id): Path<String>,
    Json(body): Json<ForkBody>,
) -> Result<impl IntoResponse, ApiError> {
    let name = check_name(body.name.as_deref())?;
    let (r, v) = lookup(&app, &caller, &id)?;
    let from_snapshot = match &body.snapshot {
        Some(snap) => Some(snapshot_of(&app, &caller, &r, snap)?),
        None => None,
    };
    let rec = new_record(&app, &caller, name, r.size_mb, chosen)?;
    let grant = admit(&app, &caller.tenant, r.size_mb).await?;
    // A snapshot of the source (under its gate, constant time; or the one asked for),
    // copied into the new volume's filesystem without holding the gate; a snapshot taken
    // for the fork is dropped after.
    let point = match &from_snapshot {
        Some(s) => PathBuf::from(&s.path),
        None => {
            let p = v.root().join("snapshots").join(format!(".fork-{}", rec.id));
            snapshot_live(&v, p.clone()).await?;
            p
        }
    };
    let from = point.join("live");
    let vol = add(&app, rec.clone(), move |live| {
        std::fs::remove_dir(live)?;
        locker_runtime::tree::copy(&from, live).map(|s| s.bytes)
    })
    .await;
    if from_snapshot.is_none() {
        drop_snapshot(point).await;
    }
    drop(grant);
    let vol = vol?;
    Ok((StatusCode::CREATED, axum::Json(view(&app, &rec, &vol))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume() -> Arc<Volume> {
        let v = Volumes {
            root: PathBuf::from("/nonexistent/volumes"),
            agent_exe: PathBuf::new(),
            open: RwLock::new(HashMap::new()),
            runs_inflight: Default::default(),
            pending_mb: Default::default(),
            moves: Default::default(),
        };
        v.make(
            &VolumeRecord {
                id: "vol_test".into(),
                tenant: "t".into(),
                name: "work".into(),
                size_mb: 64,
                created_at: "2026-12-07T00:00:00Z".into(),
                host: String::new(),
            },
            0,
        )
    }

    #[test]
    fn a_move_and_a_create_that_mounts_the_volume_never_both_go_ahead() {
        let v = volume();
        // A create's claim held: no move starts, and says why.
        let claim = MountClaim::take(&v).expect("a claim on a still volume");
        let e = v.start_moving("work").unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::CONFLICT);
        assert!(e.message.contains("being created"), "{}", e.message);
        assert!(!v.is_moving(), "a refused move leaves no mark");
        // Two creates at once, then both done: the move goes.
        let second = MountClaim::take(&v).expect("a second claim");
        drop(claim);
        assert!(v.start_moving("work").is_err());
        drop(second);
        v.start_moving("work").expect("no claim left");
        // Moving: no create claims it, and a second move is refused.
        assert!(MountClaim::take(&v).is_none());
        let e = v.start_moving("work").unwrap_err();
        assert!(e.message.contains("being moved already"), "{}", e.message);
    }
}
