//! `POST /v1/volumes/{id}/run`: the serverless call. A fresh machine per call sees the
//! volume through a private copy-on-write layer, runs one command and is destroyed; its
//! changes are then listed and committed to the volume atomically (all or none), or not.
//!
//! 1. **View**: under the volume's write gate, the run gets a copy-on-write view of the
//!    live tree in `runs/view_<id>/` on the volume's own filesystem, shared with the runs
//!    that waited for a view with it (see [`view`]), and notes the volume's commit sequence
//!    number; its own layer is `runs/<call>/layer/`. A small tree is copied by reflink
//!    (`base/`: no data copied, and no flush); a bigger one is a read-only btrfs snapshot
//!    of the volume's filesystem (`snap/`, its tree `snap/live`: constant time, one
//!    transaction commit). Either way nothing written to `live/` later shows through, in
//!    place or not.
//! 2. **Machine**: a jail like a sandbox's with an overlay at `mount_path`: the view below
//!    (read-only), `layer/upper` above (see `locker_runtime::machine::OverlayMount`), on the
//!    volume's filesystem too, so the run's writes are held to `size_mb` and a commit is
//!    a rename.
//! 3. **Run**: the exec body, as in a sandbox (`command::build_spec`), NDJSON too; then the
//!    machine is destroyed, so `layer/upper` is stable.
//! 4. **Changes**: `locker_runtime::commit::scan` reads `upper/`: whiteouts (character devices 0:0) are deletions,
//!    opaque directories replaced the lower one, files and symlinks are added or modified,
//!    directories that exist only because of a copy-up are walked.
//! 5. **Commit** under the gate (a run that changed nothing needs neither): conflicts
//!    against the volume's [`CommitLog`]; the ops go to a journal (`fs/commit.journal` on
//!    the volume's filesystem, fsynced; its rename is the commit point), are applied
//!    idempotently, flushed, and the journal removed. A server that dies mid-apply
//!    replays the journal at its next start (`locker_runtime::commit`), before serving.
//!
//! [`CommitLog`]: crate::volumes::CommitLog

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use locker_proto::{Chan, ExecSpec};
use locker_runtime::commit::{finish_journal, scan, size_delta, write_journal};
use locker_runtime::machine::OverlayMount;
use locker_runtime::node::MachineSpec;
use locker_store::{CallKind, CallRecord, VolumeRecord};
use locker_types::{Changes, CommitMode, ExecRequest, ExecResult, RunRequest, Runtime};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::auth::Caller;
use crate::command::{build_spec, Wait};
use crate::error::ApiError;
use crate::extract::Json;
use crate::pool::pool_dir;
use crate::state::{ms_since, new_id, now_s, AppState};
use crate::stream::{error_line, ndjson_response, pump, send_line, typed, wants_ndjson};
use crate::volumes::Volume;

/// The longest a run may take, and its default.
pub const MAX_RUN_TIMEOUT_MS: u64 = 300_000;
pub const DEFAULT_RUN_TIMEOUT_MS: u64 = 60_000;
/// The machine's own writable layer (its root's; the volume is not on it): a microVM's
/// disk of this size; a jail's layer is in memory, half the run's memory at most
/// (`locker_runtime::machine::Scratch::Memory`; a disk of this size on kernels before 6.3).
pub const RUN_DISK_MB: u64 = 2048;
/// A run's view of a volume is a reflink copy up to this many files, else a snapshot: a
/// reflink costs tens of microseconds a file, a btrfs snapshot a transaction commit (a
/// flush of the image: milliseconds; see docs/benchmarks.md).
const VIEW_MAX_FILES: u64 = 256;
/// A volume known to be too big for a reflink view is tried again every this many runs
/// (it may have shrunk).
const VIEW_RETRY_EVERY: u64 = 32;

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/volumes/{id}/run", post(run))
}

/// A checked run.
struct Plan {
    rec: VolumeRecord,
    vol: Arc<Volume>,
    req: ExecRequest,
    template: locker_runtime::template::Template,
    cpus: f64,
    memory_mb: u64,
    mount_path: String,
    commit: CommitMode,
    /// The checked network policy of the run's machine.
    network: Value,
    runtime: Runtime,
}

/// Checks `mount_path`: absolute, normalized, not `/` nor under the machine's own mounts.
fn check_mount_path(p: Option<&str>) -> Result<String, ApiError> {
    let p = p.unwrap_or("/workspace");
    crate::extract::check_path("mount_path", p)?;
    let norm = crate::volumes::normalize(p);
    if p.split('/').any(|c| c == "..") {
        return Err(ApiError::bad_request(format!(
            "`mount_path` must not contain `..`, got {p:?}"
        )));
    }
    if norm == "/" {
        return Err(ApiError::bad_request(
            "`mount_path` must not be `/`: use a directory like /workspace",
        ));
    }
    let first = norm.trim_start_matches('/').split('/').next().unwrap_or("");
    if ["proc", "sys", "dev", "tmp"].contains(&first) {
        return Err(ApiError::bad_request(format!(
            "`mount_path` must not be under /{first} (the machine mounts its own there), got {p:?}"
        )));
    }
    Ok(norm)
}

fn check(app: &AppState, caller: &Caller, id: &str, body: RunRequest) -> Result<Plan, ApiError> {
    let (mut req, b) = body.split();
    if let Some(t) = req.timeout_ms {
        if t == 0 || t > MAX_RUN_TIMEOUT_MS {
            return Err(ApiError::bad_request(format!(
                "`timeout_ms` of a run must be between 1 and {MAX_RUN_TIMEOUT_MS} (long commands belong in a sandbox), got {t}"
            )));
        }
    }
    let mount_path = check_mount_path(b.mount_path.as_deref())?;
    let commit = b.commit.unwrap_or_default();
    // `auto` is the jail: a run's start time is most of its cost.
    let runtime = crate::limits::resolve_runtime(b.runtime.unwrap_or_default())?;
    let cpus = b.cpus.unwrap_or(1.0);
    let max_cpus = crate::limits::MAX_CPUS;
    if !(cpus > 0.0 && cpus <= max_cpus) {
        return Err(ApiError::bad_request(format!(
            "`cpus` must be more than 0 and at most {max_cpus}"
        )));
    }
    let memory_mb = b.memory_mb.unwrap_or(512);
    let (lo, hi) = crate::limits::MEMORY_MB;
    if !(lo..=hi).contains(&memory_mb) {
        return Err(ApiError::bad_request(format!(
            "`memory_mb` must be between {lo} and {hi}"
        )));
    }
    let mut network = crate::limits::check_network(b.network.as_ref())?;
    crate::limits::check_env(&req.env)?;
    crate::secrets::resolve(
        app,
        &caller.tenant,
        &b.secrets,
        &mut req.env,
        &mut network,
        b.network.is_some(),
    )?;
    req.cwd = Some(req.cwd.unwrap_or_else(|| mount_path.clone()));
    req.timeout_ms = Some(req.timeout_ms.unwrap_or(DEFAULT_RUN_TIMEOUT_MS));
    req.validate().map_err(ApiError::bad_request)?;
    let (rec, vol) = crate::volumes::lookup(app, caller, id)?;
    let name = b.template.unwrap_or_else(|| "default".into());
    let template = crate::templates::resolve_for(app, &caller.tenant, &name)?
        .ok_or_else(|| crate::default_template::unknown(app, &name))?;
    Ok(Plan {
        rec,
        vol,
        req,
        template,
        cpus,
        memory_mb,
        mount_path,
        commit,
        network,
        runtime,
    })
}

/// One run counted against its tenant's `runs` quota while it lives.
struct RunSlot {
    app: AppState,
    tenant: String,
}

impl RunSlot {
    fn take(app: &AppState, tenant: &str) -> Result<RunSlot, ApiError> {
        let mut m = app.volumes.runs_inflight.lock().expect("runs lock");
        let n = m.entry(tenant.to_owned()).or_default();
        let q = app.cfg.quotas.runs;
        if *n >= q {
            return Err(ApiError::quota(format!(
                "quota exceeded: tenant {tenant} may have {q} runs in flight at once; wait for one to end"
            )));
        }
        *n += 1;
        Ok(RunSlot {
            app: app.clone(),
            tenant: tenant.to_owned(),
        })
    }
}

impl Drop for RunSlot {
    fn drop(&mut self) {
        let mut m = self.app.volumes.runs_inflight.lock().expect("runs lock");
        if let Some(n) = m.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.tenant);
            }
        }
    }
}

async fn run(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<RunRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let stream = wants_ndjson(&headers);
    app.secrets.ensure(&caller.tenant, &body.secrets).await?;
    let plan = check(&app, &caller, &id, body)?;
    crate::limits::require_egress(&plan.network).await?;
    if plan.runtime == Runtime::Microvm {
        crate::limits::require_microvm(&app.node).await?;
    }
    let call_id = new_id("call_");
    let (mut spec, stdin) =
        build_spec(&BTreeMap::new(), &plan.req, &call_id, Wait::Call { stream })?;
    // A run's machine ends with its command: nothing the command left running may write to
    // the volume after the commit has begun.
    spec.kill_jobs = true;
    crate::templates::apply_defaults(&app, &plan.template.digest, &mut spec);
    crate::capacity::admit_disk(&app.cfg.data_dir, "a run's machine disk", RUN_DISK_MB)?;
    let slot = RunSlot::take(&app, &caller.tenant)?;
    if !stream {
        // A task of its own: a client that goes away never leaves a machine behind.
        let task = tokio::spawn(async move {
            let r = execute(&app, &caller, &plan, spec, stdin, None, arrived).await;
            drop(slot);
            r
        });
        let res = task
            .await
            .map_err(|e| ApiError::internal(format!("the run failed: {e}")))??;
        return Ok(axum::Json(res).into_response());
    }
    let (body_tx, response) = ndjson_response();
    tokio::spawn(async move {
        let r = execute(&app, &caller, &plan, spec, stdin, Some(&body_tx), arrived).await;
        drop(slot);
        let last = match r {
            Ok(res) => typed("result", &res),
            Err(e) => error_line(e),
        };
        send_line(&body_tx, &last).await;
    });
    Ok(response)
}

/// Snapshot, machine, command, changes, commit, record; the run's directory is removed
/// whatever happens.
async fn execute(
    app: &AppState,
    caller: &Caller,
    plan: &Plan,
    spec: ExecSpec,
    stdin: Option<Vec<u8>>,
    body: Option<&mpsc::Sender<Bytes>>,
    arrived: Instant,
) -> Result<ExecResult, ApiError> {
    let vol = &plan.vol;
    let run_dir = vol.root().join("runs").join(&spec.call_id);
    let call_id = spec.call_id.clone();
    let mut phases = Phases::new(arrived);
    let r = match view(vol).await {
        Ok(view) => {
            phases.mark("view");
            let r = match layer(&run_dir, &view.base).await {
                Ok(()) => {
                    phases.mark("layer");
                    in_machine(
                        app,
                        plan,
                        &run_dir,
                        &view.base,
                        spec,
                        stdin,
                        body,
                        &mut phases,
                        view.seq,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            vol.log.lock().expect("commit log").end(view.seq);
            r
        }
        Err(e) => Err(e),
    };
    // The machine is the run's alone: everything it was refused is this call's.
    let secrets_seen = app.egress.disarm(&call_id);
    let egress_denied = app.egress.forget(&call_id);
    // The layer goes after the answer (what a commit took from it is in `live/` already);
    // the view goes with the last run that uses it.
    let d = run_dir.clone();
    tokio::task::spawn_blocking(move || {
        if let Err(e) = locker_runtime::volume_fs::remove_tree(&d) {
            tracing::warn!(dir = %d.display(), error = %e, "removing a run's layer failed");
        }
    });
    let (mut res, changes) = r?;
    res.timings.total_ms = ms_since(arrived);
    app.metrics.exec_seconds.observe(res.timings.total_ms / 1e3);
    app.metrics.add_cpu(&caller.tenant, res.usage.cpu_ms);
    let mut record = call_record(caller, plan, &res, changes.as_ref());
    record.egress_denied = egress_denied;
    (record.secrets_used, record.secret_misuse) = secrets_seen;
    app.recorder.record(record);
    if let Some(c) = &changes {
        app.events.emit(
            &caller.tenant,
            crate::events::Kind::RunCommitted,
            &res.call_id,
            run_event(&plan.rec.id, res.exit_code, c),
        );
    }
    res.changes = changes;
    phases.mark("record");
    tracing::debug!(call = %res.call_id, phases = %phases, "run phases (ms)");
    Ok(res)
}

/// Where a run's time went, phase by phase, logged at debug level
/// (`LOCKER_LOG=locker_server::runs=debug`): how docs/benchmarks.md splits a run's call.
struct Phases {
    arrived: Instant,
    last: Instant,
    marks: Vec<(&'static str, f64)>,
}

impl Phases {
    fn new(arrived: Instant) -> Self {
        Phases {
            arrived,
            last: arrived,
            marks: Vec::with_capacity(10),
        }
    }

    /// Ends the phase `name` now.
    fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.marks
            .push((name, (now - self.last).as_secs_f64() * 1e3));
        self.last = now;
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (name, ms) in &self.marks {
            write!(f, "{name}={ms:.3} ")?;
        }
        write!(f, "total={:.3}", ms_since(self.arrived))
    }
}

fn runs_dir(app: &AppState) -> PathBuf {
    app.cfg.data_dir.join("runs")
}

/// A private, copy-on-write view of a volume's live tree in `runs/<view id>/` on the
/// volume's own filesystem: `base/`, a reflink copy, for a tree of at most
/// [`VIEW_MAX_FILES`] files; else `snap/`, a read-only snapshot of the volume's filesystem.
/// Shared by the runs that asked for a view while the one before was being made (see
/// [`view`]); removed, in the background, when the last of them drops it.
#[derive(Debug)]
struct View {
    dir: PathBuf,
    /// The tree the runs' overlays lay their layers over: `base/` or `snap/live`.
    base: PathBuf,
    /// The volume's commit sequence number when the view was taken.
    seq: u64,
}

impl Drop for View {
    fn drop(&mut self) {
        let d = std::mem::take(&mut self.dir);
        let remove = move || {
            if let Err(e) = locker_runtime::volume_fs::remove_tree(&d) {
                tracing::warn!(dir = %d.display(), error = %e, "removing a run's view failed");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

/// A volume's runs waiting for a view: the batch the next view will serve, while one is
/// forming (see [`view`]).
#[derive(Debug, Default)]
pub struct Views {
    forming: std::sync::Mutex<Option<Arc<Batch>>>,
}

/// Runs that will share one view.
#[derive(Debug, Default)]
struct Batch {
    /// How many; counted under [`Views::forming`], final once the batch is closed.
    members: std::sync::atomic::AtomicU64,
    view: tokio::sync::OnceCell<Result<Arc<View>, String>>,
}

impl Views {
    /// The batch forming now, joined (a new one if none is).
    fn join(&self) -> Arc<Batch> {
        let mut forming = self.forming.lock().expect("views");
        let b = forming.get_or_insert_with(Default::default).clone();
        b.members.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        b
    }

    /// Closes `b` to newcomers (they form the next batch); returns how many it has.
    fn close(&self, b: &Arc<Batch>) -> u64 {
        let mut forming = self.forming.lock().expect("views");
        if forming.as_ref().is_some_and(|f| Arc::ptr_eq(f, b)) {
            *forming = None;
        }
        b.members.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The run's view of the volume as of its start, and the volume's commit sequence number
/// then. Runs that arrive while a view is being made wait together and share the next one:
/// each of them arrived before it began, and it is taken under the volume's write gate, so
/// it is the volume as of each one's start, just as a view of its own would be. A burst of
/// runs on one volume thus makes a few views, not one after another per run.
async fn view(vol: &Arc<Volume>) -> Result<Arc<View>, ApiError> {
    let batch = vol.views.join();
    batch
        .view
        .get_or_init(|| make_view(vol, &batch))
        .await
        .clone()
        .map_err(|e| ApiError::internal(format!("snapshotting volume {}: {e}", vol.id)))
}

/// Makes the view of a batch (see [`View`]) under the volume's write gate (no files-API
/// write, commit or other view in flight), and begins its runs in the commit log.
async fn make_view(vol: &Arc<Volume>, batch: &Arc<Batch>) -> Result<Arc<View>, String> {
    use std::sync::atomic::Ordering;
    let _all = vol.space.gate.write().await;
    if vol.space.is_closed() {
        return Err(vol.space.moved().to_string());
    }
    let members = vol.views.close(batch);
    let (root, live) = (vol.root(), vol.live());
    let dir = root.join("runs").join(new_id("view_"));
    let hint = vol.files_hint.load(Ordering::Relaxed);
    let try_copy = hint <= VIEW_MAX_FILES || {
        let n = vol.view_tries.fetch_add(1, Ordering::Relaxed);
        n % VIEW_RETRY_EVERY == VIEW_RETRY_EVERY - 1
    };
    let d = dir.clone();
    let made = tokio::task::spawn_blocking(move || -> io::Result<(PathBuf, Option<u64>)> {
        let r = (|| {
            fs::create_dir(&d)?;
            if try_copy {
                let base = d.join("base");
                if let Some(st) = locker_runtime::tree::cow_view(&live, &base, VIEW_MAX_FILES)? {
                    return Ok((base, Some(st.files)));
                }
            }
            let snap = d.join("snap");
            locker_runtime::volume_fs::snapshot(&root, &snap)?;
            Ok((snap.join("live"), try_copy.then_some(u64::MAX)))
        })();
        if r.is_err() {
            let _ = locker_runtime::volume_fs::remove_tree(&d);
        }
        r
    })
    .await
    .map_err(|e| e.to_string())?;
    let (base, files) = made.map_err(|e| e.to_string())?;
    if let Some(n) = files {
        vol.files_hint.store(n, Ordering::Relaxed);
    }
    let mut log = vol.log.lock().expect("commit log");
    let seq = log.begin();
    for _ in 1..members {
        log.begin();
    }
    Ok(Arc::new(View { dir, base, seq }))
}

/// Makes the run's own layer, `run_dir/layer/{upper,work}`, on the volume's filesystem,
/// its root looking like the view's (the mount point shows it).
async fn layer(run_dir: &FsPath, base: &FsPath) -> Result<(), ApiError> {
    let (rd, base) = (run_dir.to_owned(), base.to_owned());
    tokio::task::spawn_blocking(move || -> io::Result<()> {
        fs::create_dir_all(rd.join("layer/work"))?;
        let upper = rd.join("layer/upper");
        fs::create_dir(&upper)?;
        locker_runtime::tree::copy_attrs(&upper, &base.symlink_metadata()?)
    })
    .await
    .map_err(|e| ApiError::internal(format!("making the run's layer: {e}")))?
    .map_err(|e| ApiError::internal(format!("making the run's layer: {e}")))
}

/// Starts the machine, runs the command, destroys the machine, commits. `Ok((result,
/// None))` when the client of a stream went away (the command was killed; nothing is
/// committed).
#[allow(clippy::too_many_arguments)]
async fn in_machine(
    app: &AppState,
    plan: &Plan,
    run_dir: &FsPath,
    base: &FsPath,
    spec: ExecSpec,
    stdin: Option<Vec<u8>>,
    body: Option<&mpsc::Sender<Bytes>>,
    phases: &mut Phases,
    start_seq: u64,
) -> Result<(ExecResult, Option<Changes>), ApiError> {
    let mspec = MachineSpec {
        id: spec.call_id.clone(),
        // Beside the warm machines, not in `run_dir`: its teardown may outlive the run.
        dir: pool_dir(&app.cfg.data_dir).join(&spec.call_id),
        template_rootfs: plan.template.rootfs.clone(),
        cpus: plan.cpus,
        memory_mb: plan.memory_mb,
        disk_mb: RUN_DISK_MB,
        pids: crate::limits::PIDS,
    };
    let mount = OverlayMount {
        lower: base.to_owned(),
        upper: run_dir.join("layer/upper"),
        work: run_dir.join("layer/work"),
        target: PathBuf::from(&plan.mount_path),
    };
    let starting = app.pool.starting();
    let machine = if plan.runtime == Runtime::Microvm {
        vm_machine(app, plan, mspec, mount).await?
    } else {
        jail_machine(app, plan, mspec, mount).await?
    };
    phases.mark("machine");
    // The network is attached after the claim (warm machines have none); destroy takes it.
    if crate::limits::has_egress(&plan.network) {
        let net = match app
            .egress
            .apply(
                &app.node,
                &machine,
                &spec.call_id,
                &plan.rec.tenant,
                &plan.network,
            )
            .await
        {
            Ok(()) => {
                crate::secrets::arm(
                    app,
                    &machine,
                    &spec.call_id,
                    &plan.rec.tenant,
                    &plan.req.env,
                )
                .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = net {
            let _ = app.node.destroy(&machine).await;
            return Err(ApiError::unavailable(format!(
                "giving the run's machine its network failed: {e}"
            )));
        }
    }

    phases.mark("network");
    drop(starting);
    let queue_ms = ms_since(phases.arrived);
    let agent = machine.agent.clone();
    let outcome = match body {
        None => Some(agent.exec(spec.clone(), stdin, None).await),
        Some(body) => {
            let (out_tx, mut out_rx) = mpsc::channel::<(Chan, Vec<u8>)>(32);
            pump(
                agent.exec(spec.clone(), stdin, Some(out_tx)),
                &mut out_rx,
                body,
            )
            .await
        }
    };
    phases.mark("exec");
    // Nothing may write to the layer once it is read. The agent killed the command's whole
    // tree before it answered (`kill_jobs`); when the machine's cgroups show that nothing
    // but the agent is left, the layer is already still, and the machine goes after the
    // answer with the rest of its teardown (mounts, loop device, cgroup, directory).
    // Otherwise its processes are killed first.
    let still = matches!(outcome, Some(Ok(_))) && app.node.only_agent_left(&machine);
    let stopped = if still {
        Ok(())
    } else {
        app.node.stop(&machine).await
    };
    phases.mark("stop");
    let app2 = app.clone();
    tokio::spawn(async move {
        let _turn = app2.pool.destroy_turn().await;
        if let Err(e) = app2.node.destroy(&machine).await {
            tracing::warn!(machine = %machine.id, error = %e, "destroying a run's machine failed");
        }
    });
    let stopped = stopped.map_err(ApiError::during("stopping the run's machine"));
    let mut res = match outcome {
        None => {
            stopped?;
            return Err(ApiError::new(
                axum::http::StatusCode::from_u16(499)
                    .unwrap_or(axum::http::StatusCode::BAD_REQUEST),
                "the client went away: the command was killed and nothing was committed",
            ));
        }
        Some(r) => r?,
    };
    stopped?;
    res.timings.queue_ms = queue_ms;
    let changes = commit(plan, run_dir, base, &res, start_seq).await?;
    phases.mark("commit");
    Ok((res, Some(changes)))
}

/// The run's jail: a warm one with the layer mounted into it, or a fresh one.
async fn jail_machine(
    app: &AppState,
    plan: &Plan,
    mspec: MachineSpec,
    mount: OverlayMount,
) -> Result<locker_runtime::node::Machine, ApiError> {
    let Some(m) = app.pool.claim(&plan.template, plan.cpus, plan.memory_mb) else {
        return fresh(app, mspec, mount).await;
    };
    match app.node.attach(&m, mount.clone()).await {
        Ok(()) => Ok(m),
        Err(e) => {
            tracing::warn!(error = %e, "a warm machine could not take the run's layer; starting a fresh one");
            let _ = app.node.destroy(&m).await;
            fresh(app, mspec, mount).await
        }
    }
}

/// The run's microVM: one from the microVM pool (sandboxes' shapes; the run's disk is the
/// sandboxes' default) served the layer, or a fresh one restored with it. A run with
/// egress needs a network device, so it is always fresh.
async fn vm_machine(
    app: &AppState,
    plan: &Plan,
    mspec: MachineSpec,
    mount: OverlayMount,
) -> Result<locker_runtime::node::Machine, ApiError> {
    let net = crate::limits::has_egress(&plan.network);
    let shape = (!net).then(|| {
        crate::vm_pool::VmShape::new(
            &plan.template.digest,
            plan.cpus,
            plan.memory_mb,
            RUN_DISK_MB,
        )
    });
    let pooled = shape.as_ref().and_then(|s| app.vm_pool.take(s));
    if let Some(s) = shape {
        app.vm_pool
            .refill(s, plan.template.rootfs.clone(), plan.cpus);
    }
    if let Some(m) = pooled {
        match app.node.attach(&m, mount.clone()).await {
            Ok(()) => return Ok(m),
            Err(e) => {
                tracing::warn!(error = %e, "a pooled microVM could not take the run's layer; restoring a fresh one");
                let _ = app.node.destroy(&m).await;
            }
        }
    }
    app.node
        .create_attached(
            mspec,
            locker_runtime::node::Attach {
                runtime: locker_runtime::node::RuntimeKind::Microvm,
                net,
                overlays: vec![mount],
                ..Default::default()
            },
        )
        .await
        .map_err(ApiError::during("starting the run's microVM failed"))
}

/// A machine started for this run alone, with the volume's layer mounted at start.
async fn fresh(
    app: &AppState,
    mspec: MachineSpec,
    mount: OverlayMount,
) -> Result<locker_runtime::node::Machine, ApiError> {
    let attach = locker_runtime::node::Attach {
        overlays: vec![mount],
        scratch: locker_runtime::machine::Scratch::Memory,
        ..Default::default()
    };
    app.node
        .create_attached(mspec, attach)
        .await
        .map_err(ApiError::during("starting the run's machine failed"))
}

/// Lists the changes of the run's layer and applies them per the commit mode.
async fn commit(
    plan: &Plan,
    run_dir: &FsPath,
    base: &FsPath,
    res: &ExecResult,
    start_seq: u64,
) -> Result<Changes, ApiError> {
    let vol = &plan.vol;
    let (base, upper) = (base.to_owned(), run_dir.join("layer/upper"));
    let scan = tokio::task::spawn_blocking(move || scan(&base, &upper))
        .await
        .map_err(|e| ApiError::internal(format!("listing the run's changes: {e}")))?
        .map_err(|e| ApiError::internal(format!("listing the run's changes: {e}")))?;
    let mut changes = Changes {
        added: scan.added,
        modified: scan.modified,
        deleted: scan.deleted,
        committed: false,
        conflicts: vec![],
        commit_error: None,
    };
    let mut paths: Vec<String> = changes
        .added
        .iter()
        .chain(&changes.modified)
        .chain(&changes.deleted)
        .cloned()
        .collect();
    paths.sort();
    if scan.ops.is_empty() {
        // Nothing to apply, and no path to conflict: no need to wait for the gate.
        changes.committed = plan.commit.applies(res.exit_code, false);
        return Ok(changes);
    }
    let _all = vol.space.gate.write().await;
    if vol.space.is_closed() {
        changes.commit_error = Some(format!(
            "{} moved to another server of the fleet during the run: nothing was committed; \
             run again (it goes to the new home)",
            vol.space.what
        ));
        return Ok(changes);
    }
    changes.conflicts = vol
        .log
        .lock()
        .expect("commit log")
        .conflicts(start_seq, &paths);
    if !plan
        .commit
        .applies(res.exit_code, !changes.conflicts.is_empty())
    {
        return Ok(changes);
    }
    let (dir, ops) = (vol.root(), scan.ops);
    let limit = vol.space.limit_bytes as i64;
    let used = vol.space.used_bytes() as i64;
    let what = vol.space.what.clone();
    let applied = tokio::task::spawn_blocking(move || -> io::Result<Result<i64, String>> {
        let delta = size_delta(&dir.join("live"), &ops);
        if delta > 0 && used + delta > limit {
            return Ok(Err(format!(
                "{what} is full: the run's changes need {delta} more bytes ({used} of {limit} in use); nothing was committed"
            )));
        }
        if let Err(e) = write_journal(&dir, &ops) {
            if e.kind() != io::ErrorKind::StorageFull {
                return Err(e);
            }
            // The run filled the volume's filesystem itself (its layer is on it): before
            // the commit point, so nothing was applied.
            return Ok(Err(format!(
                "{what} is full: its filesystem had no room left for the commit ({e}); nothing was committed"
            )));
        }
        finish_journal(&dir, &ops)?;
        Ok(Ok(delta))
    })
    .await
    .map_err(|e| ApiError::internal(format!("committing the run: {e}")))?
    .map_err(|e| ApiError::internal(format!("committing the run to volume {}: {e}", vol.id)))?;
    match applied {
        Ok(delta) => {
            vol.space.add(delta);
            changes.committed = true;
            vol.log.lock().expect("commit log").append(paths);
        }
        Err(why) => changes.commit_error = Some(why),
    }
    Ok(changes)
}

/// The call record of a run: the result without output, the changed paths.
fn call_record(caller: &Caller, plan: &Plan, res: &ExecResult, ch: Option<&Changes>) -> CallRecord {
    let mut result = res.clone();
    result.stdout.clear();
    result.stderr.clear();
    result.changes = ch.cloned();
    let argv = match (&plan.req.cmd, &plan.req.shell) {
        (Some(c), _) => c.clone(),
        (None, Some(s)) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        (None, None) => vec![],
    };
    CallRecord {
        id: res.call_id.clone(),
        tenant: caller.tenant.clone(),
        key_id: caller.key_id.clone(),
        kind: CallKind::Run,
        sandbox_id: None,
        volume_id: Some(plan.rec.id.clone()),
        command: argv,
        cwd: plan.req.cwd.clone(),
        env_keys: plan.req.env.keys().cloned().collect(),
        template_digest: plan.template.digest.clone(),
        runtime: plan.runtime.as_str().into(),
        result,
        egress_denied: vec![],
        secrets_used: vec![],
        secret_misuse: vec![],
        changes: ch.map(|c| {
            json!({"added": c.added, "modified": c.modified, "deleted": c.deleted,
                   "conflicts": c.conflicts, "committed": c.committed})
        }),
        created_at: locker_types::rfc3339(now_s()),
    }
}

/// The data of a run's `run.committed` event: its volume, change counts, conflicts and
/// outcome (`committed`, or why not).
fn run_event(volume: &str, exit_code: Option<i32>, c: &locker_types::Changes) -> Value {
    json!({
        "volume": volume,
        "exit_code": exit_code,
        "added": c.added.len(),
        "modified": c.modified.len(),
        "deleted": c.deleted.len(),
        "conflicts": c.conflicts,
        "committed": c.committed,
        "commit_error": c.commit_error,
    })
}

/// Spreads the machines' directories made in `dir` over the filesystem
/// (`locker_runtime::tree::spread_subdirs`): every run makes and removes one, a dozen
/// inodes, and on an ext4 data dir without a journal, packed into one block group, each
/// new inode cost a burst of runs about a millisecond of CPU (docs/benchmarks.md).
fn spread_machines(dir: &FsPath) {
    if let Err(e) = fs::create_dir_all(dir).and_then(|()| locker_runtime::tree::spread_subdirs(dir))
    {
        tracing::debug!(dir = %dir.display(), error = %e, "machine directories are not spread over block groups");
    }
}

/// At start, after journals were replayed: destroys machines of runs a killed server left
/// and removes their directories.
pub async fn cleanup(app: &AppState) {
    // Warm machines of a stopped server are never claimed again.
    let gone = app
        .node
        .cleanup_orphans(&pool_dir(&app.cfg.data_dir), Vec::new())
        .await;
    spread_machines(&pool_dir(&app.cfg.data_dir));
    if !gone.is_empty() {
        tracing::info!(
            count = gone.len(),
            "removed warm machines a stopped server left"
        );
    }
    let dir = runs_dir(app);
    let Ok(rd) = fs::read_dir(&dir) else {
        return;
    };
    for e in rd.flatten() {
        let id = e.file_name().to_string_lossy().into_owned();
        let m = e.path().join("machine");
        if m.exists() {
            if let Err(err) = app.node.destroy_dir(&id, &m).await {
                tracing::warn!(run = %id, error = %err, "could not destroy a run's machine");
                continue;
            }
        }
        let p = e.path();
        let _ = tokio::task::spawn_blocking(move || locker_sys::fs::remove_tree(&p)).await;
        tracing::info!(run = %id, "removed a run a stopped server left");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_checked() {
        assert_eq!(check_mount_path(None).unwrap(), "/workspace");
        assert_eq!(check_mount_path(Some("/a//b/")).unwrap(), "/a/b");
        assert!(check_mount_path(Some("rel")).is_err());
        assert!(check_mount_path(Some("/")).is_err());
        assert!(check_mount_path(Some("/a/../b")).is_err());
        assert!(check_mount_path(Some("/proc/x")).is_err());
    }

    #[test]
    fn runs_that_wait_together_share_a_view_and_newcomers_form_the_next() {
        let views = Views::default();
        let (a, b) = (views.join(), views.join());
        assert!(Arc::ptr_eq(&a, &b), "waiting together: one batch");
        assert_eq!(views.close(&a), 2);
        let c = views.join();
        assert!(!Arc::ptr_eq(&a, &c), "after the view began: the next batch");
        assert_eq!(views.close(&a), 2, "closing again changes nothing");
        assert_eq!(views.close(&c), 1);
    }

    #[test]
    fn overlapping_paths_conflict() {
        use crate::volumes::{overlaps, CommitLog};
        assert!(overlaps("/a", "/a/b") && overlaps("/a/b", "/a") && overlaps("/a", "/a"));
        assert!(!overlaps("/a", "/ab"));
        let mut log = CommitLog::default();
        let s = log.begin();
        log.append(vec!["/x/y".into()]);
        let c = log.conflicts(s, &["/x".into(), "/z".into()]);
        assert_eq!(c, vec!["/x"]);
        log.end(s);
        assert!(log.conflicts(s, &["/x".into()]).is_empty());
    }
}
