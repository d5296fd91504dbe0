//! Sandboxes: create, list, get, change, delete, TTL, pause and resume; adoption after a
//! restart and the TTL reaper.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use locker_runtime::node::MachineSpec;
use locker_store::{SandboxRecord, SandboxState};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::app::{new_id, now_s, AppState, Busy, Live};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::Json;
use locker_types::MAX_TTL_S;

/// Limits a client may ask for.
pub(crate) const MAX_CPUS: f64 = 64.0;
pub(crate) const MEMORY_MB: (u64, u64) = (32, 262_144);
const DISK_MB: (u64, u64) = (16, 1_048_576);
/// Processes per sandbox: enough for builds, small enough to stop a fork bomb.
pub(crate) const PIDS: u64 = 1024;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes", post(create).get(list))
        .route(
            "/v1/sandboxes/{id}",
            get(get_one).patch(patch).delete(delete),
        )
        .route("/v1/sandboxes/{id}/ttl", post(set_ttl))
        .route("/v1/sandboxes/{id}/pause", post(pause))
        .route("/v1/sandboxes/{id}/resume", post(resume))
}

/// The body of `POST /v1/sandboxes`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    pub template: Option<String>,
    pub runtime: Option<String>,
    pub cpus: Option<f64>,
    pub memory_mb: Option<u64>,
    pub disk_mb: Option<u64>,
    pub ttl_s: Option<u64>,
    pub idle_timeout_s: Option<u64>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub network: Option<Value>,
    pub volumes: Option<Vec<Value>>,
    pub from_snapshot: Option<String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// Validates the network policy and returns its normalized form: `none` (the default),
/// `all`, or `allow` with its list checked (lowercase names, masked CIDRs, see
/// [`crate::egress::Allowlist`]).
pub fn check_network(v: &Option<Value>) -> Result<Value, ApiError> {
    let Some(v) = v else {
        return Ok(json!({"egress": "none"}));
    };
    let obj = v.as_object().ok_or_else(|| {
        ApiError::bad_request("`network` must be an object like {\"egress\": \"none\"}")
    })?;
    for k in obj.keys() {
        if k != "egress" && k != "allow" {
            return Err(ApiError::bad_request(format!(
                "unknown field `{k}` in `network`: expected `egress` and `allow`"
            )));
        }
    }
    match obj.get("egress").and_then(Value::as_str) {
        Some(e @ ("none" | "all")) if obj.get("allow").is_none() => Ok(json!({"egress": e})),
        Some("none" | "all") => Err(ApiError::bad_request(
            "`allow` only goes with {\"egress\": \"allow\"}",
        )),
        Some("allow") => {
            let list = obj.get("allow").and_then(Value::as_array).ok_or_else(|| {
                ApiError::bad_request("`network.allow` is required with {\"egress\": \"allow\"}: a list of domains (`pypi.org`, `*.github.com`) and IPv4 CIDRs (`10.0.0.0/8`)")
            })?;
            let (_, norm) = crate::egress::Allowlist::parse(list).map_err(ApiError::bad_request)?;
            Ok(json!({"egress": "allow", "allow": norm}))
        }
        Some(other) => Err(ApiError::bad_request(format!(
            "`network.egress` must be none, all or allow, got {other:?}"
        ))),
        None => Err(ApiError::bad_request(
            "`network.egress` is required: none, all or allow",
        )),
    }
}

/// Whether a checked policy gives the machine a network (anything but `none`).
pub fn has_egress(network: &Value) -> bool {
    network
        .get("egress")
        .and_then(Value::as_str)
        .is_some_and(|e| e != "none")
}

/// 503 unless this host enforces egress policies (the probe of `locker_runtime::net`).
pub async fn require_egress(network: &Value) -> Result<(), ApiError> {
    if !has_egress(network) {
        return Ok(());
    }
    match tokio::task::spawn_blocking(locker_runtime::net::status).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(ApiError::unavailable(format!(
            "egress policies other than `none` cannot be enforced on this host, so Locker refuses them: {e}"
        ))),
        Err(e) => Err(ApiError::internal(format!("egress probe failed: {e}"))),
    }
}

fn check_env(env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ApiError::bad_request(format!(
                "env key {k:?}: keys must be non-empty without '=' or NUL, values without NUL"
            )));
        }
    }
    Ok(())
}

fn check_metadata(m: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if m.len() > 64 {
        return Err(ApiError::bad_request("`metadata` holds at most 64 keys"));
    }
    for (k, v) in m {
        if k.is_empty() || k.len() > 128 || v.len() > 1024 {
            return Err(ApiError::bad_request(format!(
                "metadata {k:?}: keys 1-128 bytes, values up to 1024 bytes"
            )));
        }
    }
    Ok(())
}

/// 503 unless this host can run microVMs.
pub async fn require_microvm(app: &AppState) -> Result<(), ApiError> {
    match app.node.vm_assets().await {
        Ok(_) => Ok(()),
        Err(e) => Err(ApiError::unavailable(format!(
            "runtime `microvm` is not usable on this host: {e} (see `locker doctor`)"
        ))),
    }
}

/// The runtime a request names, resolved on this host.
pub fn resolve_runtime(r: Option<&str>) -> Result<&'static str, ApiError> {
    match r.unwrap_or("auto") {
        "auto" | "jail" => Ok("jail"),
        "microvm" => Ok("microvm"),
        "gvisor" => Err(ApiError::unavailable(
            "runtime `gvisor` is not available in this version; use `jail` or `auto`",
        )),
        other => Err(ApiError::bad_request(format!(
            "unknown runtime {other:?}: use auto, jail, microvm or gvisor"
        ))),
    }
}

/// The API's view of a sandbox.
pub fn view(r: &SandboxRecord, live: Option<&Live>) -> Value {
    let last_active = match live {
        Some(l) => locker_types::rfc3339(l.last_active.load(std::sync::atomic::Ordering::Relaxed)),
        None => r.last_active_at.clone(),
    };
    let usage = match live {
        Some(l) => {
            let u = l.machine.usage();
            json!({"cpu_ms": u.cpu_ms, "peak_memory_bytes": u.peak_memory_bytes})
        }
        None => json!({"cpu_ms": r.cpu_ms, "peak_memory_bytes": r.peak_memory_bytes}),
    };
    json!({
        "id": r.id,
        "state": r.state,
        "template": r.template,
        "template_digest": r.template_digest,
        "runtime": r.runtime,
        "cpus": r.cpus,
        "memory_mb": r.memory_mb,
        "disk_mb": r.disk_mb,
        "network": r.network,
        "volumes": r.volumes,
        "metadata": r.metadata,
        "ttl_s": r.ttl_s,
        "idle_timeout_s": r.idle_timeout_s,
        "created_at": r.created_at,
        "expires_at": r.expires_at,
        "last_active_at": last_active,
        "usage": usage,
        "failure": (r.state == SandboxState::Failed)
            .then(|| crate::failed::reason(&r.id).unwrap_or_else(|| "unknown".into())),
    })
}

async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Json(body): Json<CreateSandbox>,
) -> Result<impl IntoResponse, ApiError> {
    let started = Instant::now();
    let runtime = resolve_runtime(body.runtime.as_deref())?;
    let volumes = resolve_volumes(&app, &caller, body.volumes.as_deref().unwrap_or(&[]))?;
    let snapshot = match &body.from_snapshot {
        None => None,
        Some(s) => Some(
            app.store
                .get_snapshot(&caller.tenant, s)?
                .ok_or_else(|| ApiError::not_found(format!("snapshot {s} does not exist")))?,
        ),
    };
    let cpus = body
        .cpus
        .or(snapshot.as_ref().map(|s| s.cpus))
        .unwrap_or(1.0);
    if !(cpus > 0.0 && cpus <= MAX_CPUS) {
        return Err(ApiError::bad_request(format!(
            "`cpus` must be more than 0 and at most {MAX_CPUS}"
        )));
    }
    let memory_mb = body
        .memory_mb
        .or(snapshot.as_ref().map(|s| s.memory_mb))
        .unwrap_or(512);
    if !(MEMORY_MB.0..=MEMORY_MB.1).contains(&memory_mb) {
        return Err(ApiError::bad_request(format!(
            "`memory_mb` must be between {} and {}",
            MEMORY_MB.0, MEMORY_MB.1
        )));
    }
    let disk_mb = body.disk_mb.unwrap_or(2048);
    if !(DISK_MB.0..=DISK_MB.1).contains(&disk_mb) {
        return Err(ApiError::bad_request(format!(
            "`disk_mb` must be between {} and {}",
            DISK_MB.0, DISK_MB.1
        )));
    }
    let ttl_s = body.ttl_s.unwrap_or(1800);
    if ttl_s == 0 || ttl_s > MAX_TTL_S {
        return Err(ApiError::bad_request(format!(
            "`ttl_s` must be between 1 and {MAX_TTL_S}"
        )));
    }
    if body.idle_timeout_s == Some(0) {
        return Err(ApiError::bad_request(
            "`idle_timeout_s` must be at least 1 (or null for none)",
        ));
    }
    check_env(&body.env)?;
    check_metadata(&body.metadata)?;
    let network = check_network(&body.network)?;
    require_egress(&network).await?;
    // A snapshot with memory restores only as a microVM (its memory is a VM's).
    let runtime = match &snapshot {
        Some(snap) if snap.has_memory => {
            if body
                .runtime
                .as_deref()
                .is_some_and(|r| r != "microvm" && r != "auto")
            {
                return Err(ApiError::bad_request(format!(
                    "snapshot {} holds a microVM's memory: leave `runtime` out or say \"microvm\"",
                    snap.id
                )));
            }
            "microvm"
        }
        Some(snap) if runtime == "microvm" => {
            return Err(ApiError::bad_request(format!(
                "snapshot {} holds a disk only (a jail's): microVM sandboxes restore snapshots with memory; leave `runtime` out or say \"jail\"",
                snap.id
            )));
        }
        Some(_) => "jail",
        // `auto`: the strongest runtime that works here and does what was asked. A microVM
        // under TCG emulation is not a security boundary, so auto picks it on KVM only; and
        // not with volumes: a microVM with volumes cannot be snapshotted or forked.
        None if body.runtime.as_deref().unwrap_or("auto") == "auto" => {
            let kvm = matches!(app.node.vm_assets().await, Ok(a) if a.accel == locker_runtime::vm::Accel::Kvm);
            if kvm && volumes.is_empty() {
                "microvm"
            } else {
                "jail"
            }
        }
        None => runtime,
    };
    if runtime == "microvm" {
        require_microvm(&app).await?;
    }
    let (template_name, template, snapshot_dir, disk_mb) = match &snapshot {
        Some(snap) => {
            if body.disk_mb.is_some_and(|d| d != snap.disk_mb) {
                return Err(ApiError::bad_request(format!(
                    "a sandbox from snapshot {} has its disk size ({} MB): leave `disk_mb` out",
                    snap.id, snap.disk_mb
                )));
            }
            if body.template.as_ref().is_some_and(|t| *t != snap.template) {
                return Err(ApiError::bad_request(format!(
                    "snapshot {} was taken from template {:?}: leave `template` out",
                    snap.id, snap.template
                )));
            }
            let t = app
                .templates
                .resolve(&snap.template_digest)
                .map_err(|e| ApiError::internal(format!("reading templates: {e}")))?
                .ok_or_else(|| {
                    ApiError::conflict(format!(
                        "the template of snapshot {} ({}) is no longer on this host",
                        snap.id, snap.template_digest
                    ))
                })?;
            (
                snap.template.clone(),
                t,
                Some(std::path::PathBuf::from(&snap.path)),
                snap.disk_mb,
            )
        }
        None => {
            let name = body.template.clone().unwrap_or_else(|| "default".into());
            let t = app
                .templates
                .resolve(&name)
                .map_err(|e| ApiError::internal(format!("reading templates: {e}")))?
                .ok_or_else(|| crate::default_template::unknown(&app, &name))?;
            (name, t, None, disk_mb)
        }
    };
    let new = NewSandbox {
        template_name,
        template,
        runtime,
        cpus,
        memory_mb,
        disk_mb,
        ttl_s,
        idle_timeout_s: body.idle_timeout_s,
        env: body.env,
        network,
        metadata: body.metadata,
        volumes,
    };
    let (rec, live) = launch(&app, &caller, &new, snapshot_dir).await?;
    app.metrics
        .sandbox_create_seconds
        .observe(started.elapsed().as_secs_f64());
    Ok((StatusCode::CREATED, axum::Json(view(&rec, Some(&live)))))
}

/// Everything a new sandbox is made of, checked.
#[derive(Clone)]
pub struct NewSandbox {
    pub template_name: String,
    pub template: locker_runtime::template::Template,
    pub runtime: &'static str,
    pub cpus: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub ttl_s: u64,
    pub idle_timeout_s: Option<u64>,
    pub env: BTreeMap<String, String>,
    pub network: Value,
    pub metadata: BTreeMap<String, String>,
    /// Volumes bound into the sandbox (their live trees).
    pub volumes: Vec<VolumeMount>,
}

/// A volume mounted in a sandbox.
#[derive(Clone, Debug)]
pub struct VolumeMount {
    pub volume_id: String,
    pub path: String,
    pub read_only: bool,
    /// The volume's live tree on the host.
    pub source: std::path::PathBuf,
}

/// The most volumes one sandbox mounts.
const MAX_VOLUME_MOUNTS: usize = 16;

/// Checks a sandbox's `volumes` (`[{"volume": id or name, "path": "/abs", "read_only": bool}]`)
/// and finds the caller's volumes.
pub fn resolve_volumes(
    app: &AppState,
    caller: &Caller,
    list: &[Value],
) -> Result<Vec<VolumeMount>, ApiError> {
    if list.len() > MAX_VOLUME_MOUNTS {
        return Err(ApiError::bad_request(format!(
            "`volumes` holds at most {MAX_VOLUME_MOUNTS} mounts"
        )));
    }
    let mut out: Vec<VolumeMount> = Vec::new();
    for (i, v) in list.iter().enumerate() {
        let o = v.as_object().ok_or_else(|| ApiError::bad_request(format!("`volumes[{i}]` must be an object like {{\"volume\": \"vol_…\", \"path\": \"/workspace\"}}")))?;
        if let Some(k) = o
            .keys()
            .find(|k| !["volume", "path", "read_only"].contains(&k.as_str()))
        {
            return Err(ApiError::bad_request(format!(
                "unknown field `{k}` in `volumes[{i}]`: expected volume, path, read_only"
            )));
        }
        let name = o.get("volume").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_request(format!(
                "`volumes[{i}].volume` is required: a volume id or name"
            ))
        })?;
        let path = match o.get("path") {
            None => "/workspace",
            Some(p) => p.as_str().ok_or_else(|| {
                ApiError::bad_request(format!("`volumes[{i}].path` must be a string"))
            })?,
        };
        let read_only = match o.get("read_only") {
            None => false,
            Some(b) => b.as_bool().ok_or_else(|| {
                ApiError::bad_request(format!("`volumes[{i}].read_only` must be true or false"))
            })?,
        };
        crate::extract::check_path(&format!("volumes[{i}].path"), path)?;
        let clean = path.trim_end_matches('/');
        if clean.is_empty()
            || clean.split('/').any(|c| c == ".." || c == ".")
            || ["/proc", "/sys", "/dev", "/tmp"]
                .iter()
                .any(|p| clean == *p || clean.starts_with(&format!("{p}/")))
        {
            return Err(ApiError::bad_request(format!(
                "`volumes[{i}].path` {path:?} cannot hold a volume: use a path like /workspace"
            )));
        }
        if let Some(other) = out.iter().find(|m| {
            m.path == clean
                || m.path.starts_with(&format!("{clean}/"))
                || clean.starts_with(&format!("{}/", m.path))
        }) {
            return Err(ApiError::bad_request(format!(
                "`volumes[{i}].path` {clean} overlaps {}",
                other.path
            )));
        }
        let (rec, vol) = crate::volumes::lookup(app, caller, name)?;
        out.push(VolumeMount {
            volume_id: rec.id,
            path: clean.to_owned(),
            read_only,
            source: vol.live(),
        });
    }
    Ok(out)
}

/// Checks the tenant's quotas, records the sandbox and starts its machine (from the
/// snapshot in directory `from` if given: its `disk.img`, and its `memory` when it has one).
/// On failure the record says `failed` and nothing else remains.
pub async fn launch(
    app: &AppState,
    caller: &Caller,
    new: &NewSandbox,
    from: Option<std::path::PathBuf>,
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
    // A plain microVM comes ready from the pool when one waits (see `vm_pool`).
    let pool_shape = (new.runtime == "microvm" && from.is_none() && !has_egress(&new.network))
        .then(|| {
            crate::vm_pool::Shape::new(&new.template.digest, new.cpus, new.memory_mb, new.disk_mb)
        });
    let pooled = pool_shape.as_ref().and_then(|s| app.vm_pool.take(s));
    let id = pooled
        .as_ref()
        .map_or_else(|| new_id("sb_"), |m| m.id.clone());
    let now = now_s();
    let mut record = SandboxRecord {
        id: id.clone(),
        tenant: caller.tenant.clone(),
        state: SandboxState::Starting,
        template: new.template_name.clone(),
        template_digest: new.template.digest.clone(),
        runtime: new.runtime.into(),
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
    };
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
        crate::vm_pool::VmPool::refill(app, s.clone(), new.template.rootfs.clone(), new.cpus);
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
                        runtime: if new.runtime == "microvm" {
                            locker_runtime::node::RuntimeKind::Microvm
                        } else {
                            locker_runtime::node::RuntimeKind::Jail
                        },
                        net: has_egress(&new.network),
                        memory_from,
                        disk_from,
                        overlays: Vec::new(),
                        binds,
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
            return Err(ApiError::internal(format!(
                "starting the sandbox failed: {e}"
            )));
        }
    };
    if has_egress(&new.network) {
        if let Err(e) = app
            .egress
            .apply(&app.node, &machine, &id, &caller.tenant, &new.network)
            .await
        {
            app.egress.forget(&id);
            let _ = app.node.destroy(&machine).await;
            crate::failed::note(&id, format!("giving its machine a network failed: {e}"));
            let _ = app.store.set_sandbox_state(&id, SandboxState::Failed);
            return Err(ApiError::unavailable(format!(
                "starting the sandbox failed: {e}"
            )));
        }
    }
    let live = Arc::new(Live::new(
        id.clone(),
        caller.tenant.clone(),
        machine,
        new.env.clone(),
        new.template.digest.clone(),
        new.idle_timeout_s,
        false,
    ));
    app.store.set_sandbox_state(&id, SandboxState::Running)?;
    app.live.write().await.insert(id.clone(), live.clone());
    crate::failed::watch(app, &live);
    record.state = SandboxState::Running;
    Ok((record, live))
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

/// A pooled microVM made this sandbox's: it waited a while since its restore, so its clock,
/// entropy and hostname are refreshed again; its volumes are served and mounted.
async fn ready_pooled(
    app: &AppState,
    m: &locker_runtime::node::Machine,
    binds: Vec<locker_runtime::machine::BindMount>,
) -> Result<(), locker_runtime::node::NodeError> {
    locker_runtime::vm::refresh_guest(&m.agent, &m.id).await?;
    if !binds.is_empty() {
        app.node.share(m, binds, Vec::new()).await?;
    }
    Ok(())
}

/// The caller's live sandbox `id` without counting a call or thawing it (pause, snapshot).
pub async fn live_quiet(app: &AppState, caller: &Caller, id: &str) -> Result<Arc<Live>, ApiError> {
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
    let live = app.live.read().await.get(id).cloned();
    match live {
        Some(l) if l.tenant == caller.tenant => {
            let (busy, idle_for) = Busy::enter(l).map_err(ApiError::internal)?;
            if let Some(secs) = idle_for {
                resumed(app, id, secs)?;
            }
            Ok(busy)
        }
        _ => {
            // Exists but not live here: say why rather than pretending it is missing.
            match app.store.get_sandbox(&caller.tenant, id)? {
                Some(r) if r.state == SandboxState::Failed => Err(crate::failed::conflict(id)),
                Some(r) if r.state == SandboxState::Starting => Err(ApiError::conflict(format!(
                    "sandbox {id} is still starting"
                ))),
                _ => Err(crate::tombstone::gone(app, &caller.tenant, id)),
            }
        }
    }
}

/// Records a thaw: state running and, after an idle pause, the TTL pushed back by the time
/// spent paused (the user did not ask for that pause).
fn resumed(app: &AppState, id: &str, idle_secs: i64) -> Result<(), ApiError> {
    PauseMarks::of(app).clear(id);
    if let Some(mut r) = app.store.get_sandbox_any(id)? {
        r.state = SandboxState::Running;
        if idle_secs > 0 {
            if let Some(exp) = locker_store::parse_rfc3339(&r.expires_at) {
                r.expires_at = locker_types::rfc3339(exp + idle_secs);
            }
        }
        app.store.update_sandbox(&r)?;
    }
    Ok(())
}

async fn list(
    State(app): State<AppState>,
    caller: Caller,
    RawQuery(q): RawQuery,
) -> Result<impl IntoResponse, ApiError> {
    let mut state = None;
    let mut meta = Vec::new();
    for (k, v) in form_pairs(q.as_deref().unwrap_or("")) {
        if k == "state" {
            state = Some(v);
        } else if let Some(mk) = k.strip_prefix("metadata.") {
            meta.push((mk.to_owned(), v));
        } else {
            return Err(ApiError::bad_request(format!(
                "unknown query parameter {k:?}: use state= and metadata.KEY=VALUE"
            )));
        }
    }
    let state: Option<SandboxState> = match &state {
        None => None,
        Some(s) => Some(s.parse().map_err(|_| {
            ApiError::bad_request(format!(
                "`state` must be starting, running, paused, stopped or failed, got {s:?}"
            ))
        })?),
    };
    let recs = app.store.list_sandboxes(&caller.tenant, state, &meta)?;
    let live = app.live.read().await;
    let items: Vec<Value> = recs
        .iter()
        .map(|r| view(r, live.get(&r.id).map(|l| l.as_ref())))
        .collect();
    Ok(axum::Json(json!({ "sandboxes": items })))
}

/// Decodes `a=b&c=d` (percent-decoding and `+` as space).
pub fn form_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (pct_decode(k), pct_decode(v))
        })
        .collect()
}

fn pct_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match h {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn get_one(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let r = record_of(&app, &caller, &id)?;
    let live = app.live.read().await.get(&id).cloned();
    Ok(axum::Json(view(&r, live.as_deref())))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchSandbox {
    network: Option<Value>,
    metadata: Option<BTreeMap<String, String>>,
}

async fn patch(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(body): Json<PatchSandbox>,
) -> Result<impl IntoResponse, ApiError> {
    let mut r = record_of(&app, &caller, &id)?;
    if let Some(n) = &body.network {
        let network = check_network(&Some(n.clone()))?;
        require_egress(&network).await?;
        // One policy change at a time (the create lock is short and rarely contended).
        let _guard = app.create_lock.lock().await;
        r = record_of(&app, &caller, &id)?;
        if network != r.network {
            // Like any call, a policy change thaws a paused sandbox (the machine's resolver
            // is written through its agent).
            let l = live_of(&app, &caller, &id).await.map_err(|e| {
                if e.status == StatusCode::NOT_FOUND {
                    ApiError::conflict(format!(
                        "sandbox {id} is not running here; its network policy cannot change"
                    ))
                } else {
                    e
                }
            })?;
            if has_egress(&network) && l.machine.lacks_network_device() {
                return Err(ApiError::conflict(format!(
                    "sandbox {id} is a microVM created with egress `none`: it has no network device, so its policy cannot change; create a new sandbox with the network policy"
                )));
            }
            if let Err(e) = app
                .egress
                .apply(&app.node, &l.machine, &id, &caller.tenant, &network)
                .await
            {
                // Back to the policy it had (rules are replaced whole, so this restores it).
                let _ = app
                    .egress
                    .apply(&app.node, &l.machine, &id, &caller.tenant, &r.network)
                    .await;
                return Err(ApiError::unavailable(format!(
                    "changing the network policy failed (unchanged): {e}"
                )));
            }
        }
        r.network = network;
    }
    if let Some(m) = body.metadata {
        check_metadata(&m)?;
        r.metadata = m;
    }
    app.store.update_sandbox(&r)?;
    let live = app.live.read().await.get(&id).cloned();
    Ok(axum::Json(view(&r, live.as_deref())))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Ttl {
    ttl_s: u64,
}

async fn set_ttl(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(body): Json<Ttl>,
) -> Result<impl IntoResponse, ApiError> {
    if body.ttl_s == 0 || body.ttl_s > MAX_TTL_S {
        return Err(ApiError::bad_request(format!(
            "`ttl_s` must be between 1 and {MAX_TTL_S}"
        )));
    }
    let mut r = record_of(&app, &caller, &id)?;
    r.ttl_s = body.ttl_s;
    r.expires_at = locker_types::rfc3339(now_s() + body.ttl_s as i64);
    app.store.update_sandbox(&r)?;
    let live = app.live.read().await.get(&id).cloned();
    Ok(axum::Json(view(&r, live.as_deref())))
}

async fn pause(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let live = live_quiet(&app, &caller, &id).await?;
    {
        let mut st = live.pause.lock().expect("pause lock");
        if st.since.is_none() {
            live.machine
                .pause()
                .map_err(|e| ApiError::internal(format!("pausing: {e}")))?;
            st.since = Some(now_s());
        }
        // An explicit pause is the caller's: its time counts against the TTL.
        st.by_idle = false;
    }
    PauseMarks::of(&app).clear(&id);
    app.store.set_sandbox_state(&id, SandboxState::Paused)?;
    let r = record_of(&app, &caller, &id)?;
    Ok(axum::Json(view(&r, Some(&live))))
}

async fn resume(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let live = live_of(&app, &caller, &id).await?;
    let r = record_of(&app, &caller, &id)?;
    Ok(axum::Json(view(&r, Some(&live))))
}

async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let r = record_of(&app, &caller, &id)?;
    destroy(&app, &r, "deleted").await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Destroys a sandbox's machine (if live) and marks it stopped, keeping its usage; `ending`
/// (`deleted`, `expired`) is what its id answers afterwards (see `tombstone`).
pub async fn destroy(app: &AppState, r: &SandboxRecord, ending: &str) -> Result<(), ApiError> {
    let live = app.live.write().await.remove(&r.id);
    app.egress.forget(&r.id);
    PauseMarks::of(app).clear(&r.id);
    let mut rec = r.clone();
    if let Some(l) = live {
        let u = l.machine.usage();
        rec.cpu_ms = u.cpu_ms;
        rec.peak_memory_bytes = u.peak_memory_bytes;
        // Thaw first: a frozen machine cannot die.
        let _ = l.machine.resume();
        app.node
            .destroy(&l.machine)
            .await
            .map_err(|e| ApiError::internal(format!("destroying sandbox {}: {e}", r.id)))?;
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
    Ok(())
}

/// The answer for a template this host has not built: how to build it.
pub fn unknown_template(name: &str) -> ApiError {
    let how = if name == "default" {
        "build it with `locker template build default` (Debian bookworm with python3, git and node; `scripts/setup` does it too)".to_string()
    } else {
        format!("build it with `locker template build {name} --file SPEC.json` or import a root filesystem with `locker template import {name} ROOTFS.tar`")
    };
    ApiError::bad_request(format!(
        "unknown template {name:?}: {how}; `locker template list` shows the templates of this host"
    ))
}

/// At start: re-attach to machines a previous server left running, mark the others
/// stopped, and remove machine directories nobody owns. A machine comes back running (see
/// `Node::adopt`: a frozen one is thawed to reach its agent); one whose record says paused
/// is frozen again, with its pause's time and cause as they were (see [`PauseMarks`]).
pub async fn adopt_all(app: &AppState) {
    let recs = match app.store.list_live_sandboxes() {
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
        let live = Arc::new(Live::new(
            r.id.clone(),
            r.tenant.clone(),
            machine,
            r.env.clone(),
            r.template_digest.clone(),
            r.idle_timeout_s,
            false,
        ));
        if let Some(at) = locker_store::parse_rfc3339(&r.last_active_at) {
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
        let paused = r.state == SandboxState::Paused;
        if paused {
            let mut st = live.pause.lock().expect("pause lock");
            match live.machine.pause() {
                Ok(()) => {
                    let (since, by_idle) = marks.get(&r.id).unwrap_or((now_s(), false));
                    st.since = Some(since);
                    st.by_idle = by_idle;
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
    if let Err(e) = app
        .egress
        .apply(&app.node, &live.machine, &r.id, &r.tenant, &r.network)
        .await
    {
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
async fn idle_pass(app: &AppState) {
    let now = now_s();
    let live: Vec<Arc<Live>> = app.live.read().await.values().cloned().collect();
    for l in live {
        let Some(idle) = l.idle_timeout_s else {
            continue;
        };
        let paused = {
            let mut st = l.pause.lock().expect("pause lock");
            if st.since.is_some() {
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
                true
            } else {
                false
            }
        };
        if paused {
            PauseMarks::of(app).set(&l.id, now);
            let _ = app.store.set_sandbox_state(&l.id, SandboxState::Paused);
            tracing::info!(sandbox = %l.id, idle_s = idle, "paused by the idle policy");
        }
    }
}

/// Destroys sandboxes whose TTL passed, once a second.
pub fn spawn_reaper(app: AppState) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut persisted: std::collections::HashMap<String, i64> = Default::default();
        loop {
            tick.tick().await;
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
                    match destroy(&app, &r, "expired").await {
                        Ok(()) => tracing::info!(sandbox = %id, "expired (TTL) and destroyed"),
                        Err(e) => tracing::warn!(sandbox = %id, error = %e, "TTL reaper failed"),
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn form_pairs_decode() {
        let p = super::form_pairs("state=running&metadata.team=a%20b&metadata.x=1+2");
        assert_eq!(p[0], ("state".into(), "running".into()));
        assert_eq!(p[1], ("metadata.team".into(), "a b".into()));
        assert_eq!(p[2], ("metadata.x".into(), "1 2".into()));
        assert_eq!(super::pct_decode("%zz%4"), "%zz%4");
    }
}
