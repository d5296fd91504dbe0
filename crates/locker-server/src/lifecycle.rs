//! A sandbox's life on this node: [`launch`] (quotas, record, machine, network), the
//! lookups every call makes ([`live_of`] counts a call and thaws a paused sandbox,
//! [`live_quiet`] and [`record_of`] do not), [`destroy`], [`adopt_all`] after a restart,
//! the idle policy ([`idle_pass`], [`PauseMarks`]) and the TTL reaper ([`spawn_reaper`]).
//!
//! The handlers in `sandboxes` and `snapshots` check requests and call these; this room
//! takes checked values ([`NewSandbox`]) and never parses a request body. It must not
//! touch namespaces or cgroups: the runtime's `Node` does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use locker_runtime::node::MachineSpec;
use locker_store::{SandboxRecord, SandboxState};
use locker_types::Runtime;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::limits::{has_egress, kind_of, PIDS};
use crate::state::{new_id, now_s, AppState, Busy, Live};

/// Everything a new sandbox is made of, checked.
#[derive(Clone)]
pub struct NewSandbox {
    pub template_name: String,
    pub template: locker_runtime::template::Template,
    pub runtime: Runtime,
    pub cpus: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub ttl_s: u64,
    pub idle_timeout_s: Option<u64>,
    pub env: BTreeMap<String, String>,
    pub network: Value,
    pub metadata: BTreeMap<String, String>,
    /// Volumes bound into the sandbox (their live trees).
    pub volumes: Vec<MountedVolume>,
}

/// A volume mounted in a sandbox.
#[derive(Clone, Debug)]
pub struct MountedVolume {
    pub volume_id: String,
    pub path: String,
    pub read_only: bool,
    /// The volume's live tree on the host.
    pub source: std::path::PathBuf,
    /// Held from the check that the volume is not moving until the sandbox is recorded
    /// (dropped with the create), so that no move starts in between.
    pub claim: Option<std::sync::Arc<crate::volumes::MountClaim>>,
}

/// Checks the tenant's quotas, records the sandbox and starts its machine (from the
/// snapshot in directory `from` if given: its `disk.img`, and its `memory` when it has one).
/// On failure the record says `failed` and nothing else remains. A fresh sandbox of a
/// template with a ready command comes back `starting` and not yet reachable by calls: the
/// caller runs the ready command, then [`make_running`] or [`discard`].
pub async fn launch(
    app: &AppState,
    caller: &Caller,
    new: &NewSandbox,
    from: Option<std::path::PathBuf>,
) -> Result<(SandboxRecord, Arc<Live>), ApiError> {
    launch_as(app, caller, new, from, None).await
}

/// [`launch`] of a sandbox carried here from another node (`carry`): it keeps its id, its
/// times, its preview token and public ports as `carried` has them, and starts from the
/// snapshot its old node took in `from`.
pub async fn launch_carried(
    app: &AppState,
    caller: &Caller,
    new: &NewSandbox,
    from: std::path::PathBuf,
    carried: &SandboxRecord,
) -> Result<(SandboxRecord, Arc<Live>), ApiError> {
    launch_as(app, caller, new, Some(from), Some(carried)).await
}

async fn launch_as(
    app: &AppState,
    caller: &Caller,
    new: &NewSandbox,
    from: Option<std::path::PathBuf>,
    carried: Option<&SandboxRecord>,
) -> Result<(SandboxRecord, Arc<Live>), ApiError> {
    let disk_from = from.as_ref().map(|d| d.join("disk.img"));
    let memory_from = from
        .as_ref()
        .map(|d| d.join("memory"))
        .filter(|m| m.exists());
    // A restored VM has exactly its snapshot's devices (see `Node::snapshot`).
    if memory_from
        .as_ref()
        .is_some_and(|m| has_egress(&new.network) && !m.with_file_name("memory.nic").exists())
    {
        return Err(ApiError::conflict(
            "the snapshot is of a microVM without a network device (egress `none`): a sandbox from it has egress `none`",
        ));
    }
    // A plain microVM, or a plain jail of a template with a Jupyter kernel, comes ready
    // from the pool when one waits (see `vm_pool`); a microVM of such a template with no
    // environment of its own comes with a kernel started, like the jail.
    // A jail's network is set up after it is made (below), so a pooled jail may have one;
    // a microVM's device is chosen at its restore.
    let kernel = || {
        new.env.is_empty()
            && app
                .vm_pool
                .pools_kernels(&new.template.digest, &new.template.rootfs)
    };
    let pool_shape = if from.is_none()
        && !has_egress(&new.network)
        && new.runtime == Runtime::Microvm
    {
        let shape = if kernel() {
            crate::vm_pool::VmShape::code_vm
        } else {
            crate::vm_pool::VmShape::new
        };
        Some(shape(
            &new.template.digest,
            new.cpus,
            new.memory_mb,
            new.disk_mb,
        ))
    } else if from.is_none() && new.runtime == Runtime::Jail && new.volumes.is_empty() && kernel() {
        Some(crate::vm_pool::VmShape::code_jail(
            &new.template.digest,
            new.cpus,
            new.memory_mb,
            new.disk_mb,
        ))
    } else {
        None
    };
    let pooled = pool_shape.as_ref().and_then(|s| app.vm_pool.take(s));
    let id = match (carried, &pooled) {
        (Some(c), _) => c.id.clone(),
        (None, Some(m)) => m.id.clone(),
        (None, None) => new_id("sb_"),
    };
    let now = now_s();
    let mut record = SandboxRecord {
        id: id.clone(),
        tenant: caller.tenant.clone(),
        state: SandboxState::Starting,
        template: new.template_name.clone(),
        template_digest: new.template.digest.clone(),
        runtime: new.runtime.as_str().into(),
        cpus: new.cpus,
        memory_mb: new.memory_mb,
        disk_mb: new.disk_mb,
        network: new.network.clone(),
        volumes: Value::Array(
            new.volumes
                .iter()
                .map(|m| json!({"volume": m.volume_id, "path": m.path, "read_only": m.read_only}))
                .collect(),
        ),
        metadata: new.metadata.clone(),
        env: new.env.clone(),
        ttl_s: new.ttl_s,
        idle_timeout_s: new.idle_timeout_s,
        created_at: locker_types::rfc3339(now),
        expires_at: locker_types::rfc3339(now + new.ttl_s as i64),
        last_active_at: locker_types::rfc3339(now),
        machine_dir: app.sandboxes_dir().join(&id).display().to_string(),
        cpu_ms: 0,
        peak_memory_bytes: 0,
        preview_token: locker_store::new_preview_token(),
        public_ports: Vec::new(),
        host: app.host_id.clone(),
    };
    if let Some(c) = carried {
        record.created_at = c.created_at.clone();
        record.expires_at = c.expires_at.clone();
        record.last_active_at = c.last_active_at.clone();
        record.preview_token = c.preview_token.clone();
        record.public_ports = c.public_ports.clone();
        record.cpu_ms = c.cpu_ms;
        record.peak_memory_bytes = c.peak_memory_bytes;
    }
    {
        let _guard = app.create_lock.lock().await;
        let q = &app.cfg.quotas;
        let admitted = (|| {
            crate::capacity::admit_disk(&app.cfg.data_dir, "`disk_mb`", new.disk_mb)?;
            let running = app.store.count_running(&caller.tenant)?;
            if running >= q.sandboxes {
                return Err(ApiError::quota(format!(
                    "quota exceeded: tenant {} may have {} sandboxes at once; delete some first",
                    caller.tenant, q.sandboxes
                )));
            }
            let mem = app.store.sum_memory_mb(&caller.tenant)?;
            if mem + new.memory_mb > q.memory_mb {
                return Err(ApiError::quota(format!(
                    "quota exceeded: tenant {} may use {} MB of sandbox memory in all ({} MB in use)",
                    caller.tenant, q.memory_mb, mem
                )));
            }
            check_disk_quota(app, &caller.tenant, new.disk_mb, "sandbox")?;
            app.store.insert_sandbox(&record)?;
            Ok(())
        })();
        if let Err(e) = admitted {
            if let (Some(s), Some(m)) = (pool_shape, pooled) {
                app.vm_pool.put_back(s, m);
            }
            return Err(e);
        }
    }
    if let Some(s) = &pool_shape {
        app.vm_pool
            .refill(s.clone(), new.template.rootfs.clone(), new.cpus);
    }
    let spec = MachineSpec {
        id: id.clone(),
        dir: app.sandboxes_dir().join(&id),
        template_rootfs: new.template.rootfs.clone(),
        cpus: new.cpus,
        memory_mb: new.memory_mb,
        disk_mb: new.disk_mb,
        pids: PIDS,
    };
    let binds: Vec<locker_runtime::machine::BindMount> = new
        .volumes
        .iter()
        .map(|m| locker_runtime::machine::BindMount {
            source: m.source.clone(),
            target: m.path.clone().into(),
            read_only: m.read_only,
        })
        .collect();
    let started = match pooled {
        Some(m) => match ready_pooled(app, &m, binds).await {
            Ok(()) => Ok(m),
            Err(e) => {
                let _ = app.node.destroy(&m).await;
                Err(e)
            }
        },
        None => {
            app.node
                .create_attached(
                    spec,
                    locker_runtime::node::Attach {
                        runtime: kind_of(new.runtime),
                        net: has_egress(&new.network),
                        memory_from,
                        disk_from,
                        overlays: Vec::new(),
                        binds,
                        scratch: locker_runtime::machine::Scratch::Disk,
                    },
                )
                .await
        }
    };
    let machine = match started {
        Ok(m) => m,
        Err(e) => {
            crate::failed::note(&id, format!("starting its machine failed: {e}"));
            let _ = app.store.set_sandbox_state(&id, SandboxState::Failed);
            app.events.emit(
                &caller.tenant,
                crate::events::Kind::SandboxFailed,
                &id,
                json!({"reason": format!("create failed: starting its machine failed: {e}")}),
            );
            return Err(ApiError::during("starting the sandbox failed")(e));
        }
    };
    if has_egress(&new.network) {
        let net = match app
            .egress
            .apply(&app.node, &machine, &id, &caller.tenant, &new.network)
            .await
        {
            Ok(()) => crate::secrets::arm(app, &machine, &id, &caller.tenant, &new.env).await,
            Err(e) => Err(e),
        };
        if let Err(e) = net {
            app.egress.forget(&id);
            let _ = app.node.destroy(&machine).await;
            crate::failed::note(&id, format!("giving its machine a network failed: {e}"));
            let _ = app.store.set_sandbox_state(&id, SandboxState::Failed);
            app.events.emit(&caller.tenant, crate::events::Kind::SandboxFailed, &id, json!({"reason": format!("create failed: giving its machine a network failed: {e}")}));
            return Err(ApiError::unavailable(format!(
                "starting the sandbox failed: {e}"
            )));
        }
    }
    let live = Arc::new(Live::new(&record, machine, false));
    let ready_first = from.is_none()
        && crate::templates::run_config(app, &new.template.digest)
            .ready_cmd
            .is_some();
    if !ready_first {
        make_running(app, &mut record, &live).await?;
    }
    Ok((record, live))
}

/// Makes a launched sandbox `running` and reachable by calls.
pub async fn make_running(
    app: &AppState,
    record: &mut SandboxRecord,
    live: &Arc<Live>,
) -> Result<(), ApiError> {
    app.store
        .set_sandbox_state(&record.id, SandboxState::Running)?;
    app.live
        .write()
        .await
        .insert(record.id.clone(), live.clone());
    crate::failed::watch(app, live);
    record.state = SandboxState::Running;
    Ok(())
}

/// Ends a launched sandbox whose create failed after its machine started (its template's
/// start or ready command): the machine and everything of it destroyed, the record
/// `failed` with `why` (a `sandbox.failed` event says why), then ended. Never announced
/// by `sandbox.created`, so no `sandbox.deleted` follows (see [`discard`]).
pub async fn discard_failed(app: &AppState, record: &SandboxRecord, live: Arc<Live>, why: &str) {
    crate::failed::note(&record.id, why);
    let _ = app
        .store
        .set_sandbox_state(&record.id, SandboxState::Failed);
    app.events.emit(
        &record.tenant,
        crate::events::Kind::SandboxFailed,
        &record.id,
        json!({"reason": format!("create failed: {why}")}),
    );
    let mut r = record.clone();
    r.state = SandboxState::Failed;
    app.live.write().await.remove(&r.id);
    if let Err(e) = destroy_with(app, &r, Some(live), "deleted", false).await {
        tracing::warn!(sandbox = %r.id, "cannot destroy a sandbox whose create failed: {}", e.message);
    }
}

/// A pooled microVM made this sandbox's: it waited a while since its restore, so its clock,
/// entropy and hostname are refreshed again; its volumes are served and mounted. A pooled
/// jail shares the host's clock and has no volumes: it is ready as it is.
async fn ready_pooled(
    app: &AppState,
    m: &locker_runtime::node::Machine,
    binds: Vec<locker_runtime::machine::BindMount>,
) -> Result<(), locker_runtime::node::NodeError> {
    if m.kind() != locker_runtime::node::RuntimeKind::Microvm {
        return Ok(());
    }
    locker_runtime::vm::refresh_guest(&m.agent, &m.id).await?;
    if !binds.is_empty() {
        app.node.share(m, binds, Vec::new()).await?;
    }
    Ok(())
}

/// The caller's live sandbox `id` without counting a call or thawing it (pause, snapshot).
pub async fn live_quiet(app: &AppState, caller: &Caller, id: &str) -> Result<Arc<Live>, ApiError> {
    app.awake.wait_open().await?;
    let live = app
        .live
        .read()
        .await
        .get(id)
        .cloned()
        .filter(|l| l.tenant == caller.tenant);
    match live {
        Some(l) => Ok(l),
        None => Err(live_of(app, caller, id)
            .await
            .err()
            .unwrap_or_else(|| crate::tombstone::gone(app, &caller.tenant, id))),
    }
}

/// The caller's record of sandbox `id` (404 for another tenant's or a deleted one).
pub fn record_of(app: &AppState, caller: &Caller, id: &str) -> Result<SandboxRecord, ApiError> {
    match app.store.get_sandbox(&caller.tenant, id)? {
        Some(r) if r.state != SandboxState::Stopped => Ok(r),
        _ => Err(crate::tombstone::gone(app, &caller.tenant, id)),
    }
}

/// The caller's running sandbox `id` with this call counted in flight; a paused sandbox is
/// thawed first (transparently: any call resumes it).
pub async fn live_of(app: &AppState, caller: &Caller, id: &str) -> Result<Busy, ApiError> {
    enter(app, live_entry(app, caller, id).await?)
}

/// The caller's sandbox `id`, live on this node, without counting a call (a settings change
/// neither needs the machine nor wakes it).
pub async fn live_entry(app: &AppState, caller: &Caller, id: &str) -> Result<Arc<Live>, ApiError> {
    app.awake.wait_open().await?;
    match app.live.read().await.get(id).cloned() {
        Some(l) if l.tenant == caller.tenant => Ok(l),
        _ => Err(not_live(app, caller, id)),
    }
}

/// Why the caller's sandbox `id` is not live here: it failed, is still starting, or is
/// gone (rather than pretending it is missing).
pub fn not_live(app: &AppState, caller: &Caller, id: &str) -> ApiError {
    match app.store.get_sandbox(&caller.tenant, id) {
        Err(e) => e.into(),
        Ok(Some(r)) if r.state == SandboxState::Failed => crate::failed::conflict(id),
        Ok(Some(r)) if r.state == SandboxState::Starting => {
            ApiError::conflict(format!("sandbox {id} is still starting"))
        }
        Ok(_) => crate::tombstone::gone(app, &caller.tenant, id),
    }
}

/// `l` with a call counted in flight; a paused sandbox is thawed first. For callers that
/// found and admitted the sandbox themselves (preview hosts); [`live_of`] does both.
pub fn enter(app: &AppState, l: Arc<Live>) -> Result<Busy, ApiError> {
    let id = l.id.clone();
    let (busy, idle_for) = Busy::enter(l)?;
    if let Some(secs) = idle_for {
        resumed(app, &id, secs)?;
    }
    Ok(busy)
}

/// Records a thaw: state running and, after an idle pause, the TTL pushed back by the time
/// spent paused (the user did not ask for that pause).
fn resumed(app: &AppState, id: &str, idle_secs: i64) -> Result<(), ApiError> {
    PauseMarks::of(app).clear(id);
    if let Some(mut r) = app.store.get_sandbox_any(id)? {
        app.events.emit(
            &r.tenant,
            crate::events::Kind::SandboxResumed,
            id,
            json!({"ttl_extended_s": idle_secs.max(0)}),
        );
        r.state = SandboxState::Running;
        if idle_secs > 0 {
            if let Some(exp) = locker_types::parse_rfc3339(&r.expires_at) {
                r.expires_at = locker_types::rfc3339(exp + idle_secs);
            }
        }
        app.store.update_sandbox(&r)?;
    }
    Ok(())
}

/// Destroys a sandbox's machine (if live) and marks it stopped, keeping its usage; `ending`
/// (`deleted`, `expired`) is what its id answers afterwards (see `tombstone`).
pub async fn destroy(app: &AppState, r: &SandboxRecord, ending: &str) -> Result<(), ApiError> {
    end(app, r, ending, true).await
}

/// Destroys a sandbox that was never announced (a create whose start command failed, the
/// children of a fork that failed half-way): as [`destroy`], without the `sandbox.deleted`
/// event, since no `sandbox.created` or `sandbox.forked` told anyone it existed.
pub async fn discard(app: &AppState, r: &SandboxRecord) -> Result<(), ApiError> {
    end(app, r, "deleted", false).await
}

async fn end(
    app: &AppState,
    r: &SandboxRecord,
    ending: &str,
    announce: bool,
) -> Result<(), ApiError> {
    let live = app.live.write().await.remove(&r.id);
    destroy_with(app, r, live, ending, announce).await
}

/// Destroys this server's machine of sandbox `id` and nothing else (no row written, no
/// event): the sandbox is no longer this server's (the fleet started it on another node
/// while this one was declared dead: `fleet::local`'s fencing). Whether it had one.
pub async fn drop_machine(app: &AppState, id: &str) -> Result<bool, ApiError> {
    let Some(l) = app.live.write().await.remove(id) else {
        return Ok(false);
    };
    app.egress.forget(id);
    PauseMarks::of(app).clear(id);
    crate::failed::forget(id);
    // Thaw first: a frozen machine cannot die.
    let _ = l.machine.resume();
    app.node.destroy(&l.machine).await.map_err(|e| {
        let mut a = ApiError::from(e);
        a.message = format!("destroying sandbox {id}: {}", a.message);
        a
    })?;
    Ok(true)
}

/// [`destroy`] of a sandbox whose [`Live`] (if any) is already out of the live map.
async fn destroy_with(
    app: &AppState,
    r: &SandboxRecord,
    live: Option<Arc<Live>>,
    ending: &str,
    announce: bool,
) -> Result<(), ApiError> {
    app.egress.forget(&r.id);
    PauseMarks::of(app).clear(&r.id);
    let mut rec = r.clone();
    let mut times = None;
    if let Some(l) = live {
        let u = l.machine.usage();
        rec.cpu_ms = u.cpu_ms;
        rec.peak_memory_bytes = u.peak_memory_bytes;
        let t = l.times();
        let _ = app.store.put_sandbox_times(&r.id, &t);
        app.metrics.retire(&r.tenant, &t, u.cpu_ms);
        times = Some(t);
        // Thaw first: a frozen machine cannot die.
        let _ = l.machine.resume();
        app.node.destroy(&l.machine).await.map_err(|e| {
            let mut a = ApiError::from(e);
            a.message = format!("destroying sandbox {}: {}", r.id, a.message);
            a
        })?;
    } else {
        let (id, dir, layout) = (
            r.id.clone(),
            std::path::PathBuf::from(&r.machine_dir),
            app.node.layout().clone(),
        );
        let _ = tokio::task::spawn_blocking(move || {
            locker_runtime::machine::destroy(&id, &dir, &layout)
        })
        .await;
    }
    app.store.update_sandbox(&rec)?;
    app.store
        .end_sandbox_at(&rec.id, now_s(), &crate::tombstone::cause(r, ending))?;
    crate::failed::forget(&rec.id);
    if announce {
        app.events.emit(&r.tenant, if ending == "expired" { crate::events::Kind::SandboxExpired } else { crate::events::Kind::SandboxDeleted }, &r.id, json!({"usage": times.map(|t| crate::sandboxes::usage_json(&t, rec.cpu_ms, rec.peak_memory_bytes))}));
    }
    Ok(())
}

/// At start: re-attach to machines a previous server left running (this host's rows only:
/// control replicas sharing a store run their own), mark the others stopped, and remove
/// machine directories nobody owns. A machine comes back running (see
/// `Node::adopt`: a frozen one is thawed to reach its agent); one whose record says paused
/// is frozen again, with its pause's time and cause as they were (see [`PauseMarks`]).
pub async fn adopt_all(app: &AppState) {
    let recs = match app.store.host_sandboxes(&app.host_id) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot list sandboxes to adopt");
            return;
        }
    };
    let marks = PauseMarks::of(app);
    let mut keep = Vec::new();
    for r in recs {
        let dir = std::path::PathBuf::from(&r.machine_dir);
        let machine = match app.node.adopt(&r.id, &dir).await {
            Ok(m) => m,
            Err(e) => {
                let _ = app.store.end_sandbox_at(
                    &r.id,
                    now_s(),
                    "lost: its machine did not survive a restart of the server",
                );
                tracing::warn!(sandbox = %r.id, error = %e, "sandbox did not survive the restart; marked stopped");
                continue;
            }
        };
        let live = Arc::new(Live::new(&r, machine, false));
        if let Ok(Some(t)) = app.store.sandbox_times(&r.id) {
            *live.clock.lock().expect("clock lock") = crate::state::Clock::new(t, false);
        }
        if let Some(at) = locker_types::parse_rfc3339(&r.last_active_at) {
            live.last_active
                .store(at, std::sync::atomic::Ordering::Relaxed);
        }
        if r.state == SandboxState::Starting {
            let _ = app.store.set_sandbox_state(&r.id, SandboxState::Running);
        }
        // While it runs: restoring its egress may need its agent.
        if has_egress(&r.network) {
            readopt_egress(app, &r, &live).await;
        }
        // A microVM's volume mounts held for a snapshot or a move that the last process
        // left half way are let go (the move is over for this node: its mark is gone, so
        // its release is refused).
        if let Err(e) = app.node.release_shares(&live.machine).await {
            tracing::warn!(sandbox = %r.id, error = %e, "cannot let the volume mounts of an adopted microVM go: its volume calls may wait");
        }
        let paused = r.state == SandboxState::Paused;
        if paused {
            let mut st = live.pause.lock().expect("pause lock");
            match live.machine.pause() {
                Ok(()) => {
                    let (since, by_idle) = marks.get(&r.id).unwrap_or((now_s(), false));
                    st.since = Some(since);
                    st.by_idle = by_idle;
                    live.clock.lock().expect("clock lock").paused(true);
                }
                Err(e) => {
                    // Running is better than lost; its record says so.
                    tracing::warn!(sandbox = %r.id, error = %e, "cannot freeze an adopted paused sandbox again: it runs");
                    let _ = app.store.set_sandbox_state(&r.id, SandboxState::Running);
                }
            }
        }
        crate::failed::watch(app, &live);
        app.live.write().await.insert(r.id.clone(), live);
        keep.push(r.id.clone());
        tracing::info!(sandbox = %r.id, paused, "adopted a sandbox");
    }
    marks.retain(&keep);
    let removed = app.node.cleanup_orphans(&app.sandboxes_dir(), keep).await;
    if !removed.is_empty() {
        tracing::info!(count = removed.len(), "removed orphaned machines");
    }
}

/// Idle pauses on disk, so a restarted server knows which paused sandboxes the idle policy
/// paused and since when (their paused time does not count against the TTL): one file per
/// sandbox in `<data-dir>/idle-paused/`, named by its id, holding the Unix second of the
/// pause. Written by the idle policy, removed when the sandbox runs again or is destroyed;
/// a paused sandbox without one was paused by its caller.
pub struct PauseMarks(std::path::PathBuf);

impl PauseMarks {
    pub fn of(app: &AppState) -> Self {
        Self(app.cfg.data_dir.join("idle-paused"))
    }

    /// Notes that the idle policy paused sandbox `id` at `since`.
    pub fn set(&self, id: &str, since: i64) {
        let r = std::fs::create_dir_all(&self.0)
            .and_then(|()| std::fs::write(self.0.join(id), since.to_string()));
        if let Err(e) = r {
            tracing::warn!(sandbox = %id, error = %e, "cannot note an idle pause: a restart would count it against the TTL");
        }
    }

    /// Forgets sandbox `id`'s idle pause (it runs again, was paused by its caller, or is gone).
    pub fn clear(&self, id: &str) {
        let _ = std::fs::remove_file(self.0.join(id));
    }

    /// When the idle policy paused sandbox `id`, if it did: `(since, true)`.
    fn get(&self, id: &str) -> Option<(i64, bool)> {
        let s = std::fs::read_to_string(self.0.join(id)).ok()?;
        Some((s.trim().parse().ok()?, true))
    }

    /// Removes the marks of every sandbox but `keep`.
    fn retain(&self, keep: &[String]) {
        for e in std::fs::read_dir(&self.0).into_iter().flatten().flatten() {
            if !keep.iter().any(|k| *k == *e.file_name().to_string_lossy()) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Steers an adopted sandbox's network to this server's proxy and DNS responder (a
/// previous server's ports are gone). If that fails it gets no network at all, and its
/// record says so: fail closed.
async fn readopt_egress(app: &AppState, r: &SandboxRecord, live: &Live) {
    let net = match app
        .egress
        .apply(&app.node, &live.machine, &r.id, &r.tenant, &r.network)
        .await
    {
        Ok(()) => crate::secrets::arm(app, &live.machine, &r.id, &r.tenant, &r.env).await,
        Err(e) => Err(e),
    };
    if let Err(e) = net {
        tracing::warn!(sandbox = %r.id, error = %e, "cannot restore the sandbox's egress: it now has none");
        let none = json!({"egress": "none"});
        let _ = app
            .egress
            .apply(&app.node, &live.machine, &r.id, &r.tenant, &none)
            .await;
        if let Ok(Some(mut rec)) = app.store.get_sandbox_any(&r.id) {
            rec.network = none;
            let _ = app.store.update_sandbox(&rec);
        }
    }
}

/// CPU a sandbox may use per reaper tick (about a second) and still count as idle.
const IDLE_CPU_MS_PER_TICK: u64 = 20;

/// The idle policy: a sandbox with `idle_timeout_s` is paused once no call has been in flight
/// and its processes used (almost) no CPU for that long. Never in the middle of work: the
/// check and the freeze hold the same lock that admits calls.
pub async fn idle_pass(app: &AppState) {
    let now = now_s();
    let live: Vec<Arc<Live>> = app.live.read().await.values().cloned().collect();
    for l in live {
        let Some(idle) = l.idle_timeout_s else {
            continue;
        };
        let paused = {
            let mut st = l.pause.lock().expect("pause lock");
            // Moving: frozen already, or a microVM moving live that must run on.
            if st.since.is_some() || st.moving.is_some() {
                continue;
            }
            let cpu = l.machine.usage().cpu_ms;
            if cpu > st.cpu_ms + IDLE_CPU_MS_PER_TICK {
                st.cpu_active_at = now;
            }
            st.cpu_ms = cpu;
            let quiet_since = l
                .last_active
                .load(std::sync::atomic::Ordering::Relaxed)
                .max(st.cpu_active_at);
            let idle_now = l.inflight.load(std::sync::atomic::Ordering::SeqCst) == 0
                && now - quiet_since >= idle as i64;
            if idle_now && l.machine.pause().is_ok() {
                st.since = Some(now);
                st.by_idle = true;
                l.clock.lock().expect("clock lock").paused(true);
                true
            } else {
                false
            }
        };
        if paused {
            PauseMarks::of(app).set(&l.id, now);
            let _ = app.store.set_sandbox_state(&l.id, SandboxState::Paused);
            app.events.emit(
                &l.tenant,
                crate::events::Kind::SandboxPaused,
                &l.id,
                json!({"reason": "idle", "idle_timeout_s": idle}),
            );
            tracing::info!(sandbox = %l.id, idle_s = idle, "paused by the idle policy");
        }
    }
}

/// Destroys sandboxes whose TTL passed, once a second.
pub fn spawn_reaper(app: AppState) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut persisted: std::collections::HashMap<String, i64> = Default::default();
        let mut ticks: u64 = 0;
        loop {
            tick.tick().await;
            // After a stall, nothing until this server's node has heard from the fleet
            // (`fleet::local::Awake`): these sandboxes may run elsewhere now.
            if !app.awake.is_open() {
                continue;
            }
            ticks += 1;
            // Time splits too, every 10 ticks (and at each sandbox's end, in `destroy`).
            if ticks.is_multiple_of(10) {
                for l in app.live.read().await.values() {
                    let _ = app.store.put_sandbox_times(&l.id, &l.times());
                }
            }
            // Last-activity times live in memory on the hot path; persist them here.
            let live: Vec<Arc<Live>> = app.live.read().await.values().cloned().collect();
            persisted.retain(|id, _| live.iter().any(|l| &l.id == id));
            for l in live {
                let at = l.last_active.load(std::sync::atomic::Ordering::Relaxed);
                if persisted.get(&l.id) != Some(&at) && app.store.touch_sandbox(&l.id, at).is_ok() {
                    persisted.insert(l.id.clone(), at);
                }
            }
            idle_pass(&app).await;
            let ids = match app.store.expired_sandboxes(now_s()) {
                Ok(ids) => ids,
                Err(e) => {
                    tracing::warn!(error = %e, "TTL reaper: cannot read expired sandboxes");
                    continue;
                }
            };
            for id in ids {
                if let Ok(Some(r)) = app.store.get_sandbox_any(&id) {
                    if r.host != app.host_id {
                        expire_elsewhere(&app, &r).await;
                        continue;
                    }
                    match destroy(&app, &r, "expired").await {
                        Ok(()) => tracing::info!(sandbox = %id, "expired (TTL) and destroyed"),
                        Err(e) => tracing::warn!(sandbox = %id, error = %e, "TTL reaper failed"),
                    }
                }
            }
        }
    });
}

/// The TTL of another host's sandbox passed (a fleet's store holds every replica's rows):
/// that host's own reaper ends it, machine and row. Only when that host's node is not
/// alive (dead, or removed from the fleet) is it ended here: its row, and its placement
/// (lost with the node) given back; its machine, if any, is on that host, which destroys
/// it when it returns and fences.
async fn expire_elsewhere(app: &AppState, r: &SandboxRecord) {
    let alive = app
        .store
        .get_node(&r.host)
        .and_then(|n| Ok((n, app.store.clock_ms()?)));
    match alive {
        Ok((Some(n), now_ms)) if crate::fleet::placement::alive(&n, now_ms) => {}
        Ok(_) => {
            match app
                .store
                .end_sandbox_at(&r.id, now_s(), &crate::tombstone::cause(r, "expired"))
            {
                Ok(true) => {
                    if let Ok(Some(p)) = app.store.get_placement(&r.id) {
                        crate::fleet::placement::unplace(app, &p.id).await;
                    }
                    app.events.emit(
                        &r.tenant,
                        crate::events::Kind::SandboxExpired,
                        &r.id,
                        json!({"usage": null}),
                    );
                    tracing::info!(sandbox = %r.id, host = %r.host, "expired (TTL) on a host that is not alive: its record ended");
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(sandbox = %r.id, error = %e, "TTL reaper failed"),
            }
        }
        Err(e) => {
            tracing::warn!(sandbox = %r.id, error = %e, "TTL reaper: cannot read the node of another host's sandbox")
        }
    }
}

/// Refuses `want_mb` more disk for `tenant` (a `what`: sandbox, volume) past its disk
/// quota, counting what its sandboxes and volumes hold and what creates in progress were
/// granted. Called under `create_lock`.
pub fn check_disk_quota(
    app: &AppState,
    tenant: &str,
    want_mb: u64,
    what: &str,
) -> Result<(), ApiError> {
    let q = app.cfg.quotas.disk_mb;
    let held = app.store.sum_disk_mb(tenant)? + app.volumes.pending_mb.of(tenant);
    if held + want_mb > q {
        return Err(ApiError::quota(format!(
            "quota exceeded: tenant {tenant} may hold {q} MB of disk in all (sandboxes' disk_mb and volumes' size_mb; {held} MB held now), \
             so a {what} of {want_mb} MB does not fit; delete sandboxes or volumes, or ask for less"
        )));
    }
    Ok(())
}
