//! Sandboxes' routes: create, list, get, change, delete, TTL, pause and resume.
//!
//! Handlers only: extract, check (`limits`), call `lifecycle`, answer with [`view`]. A
//! sandbox's life itself (launch, destroy, adoption, idle policy, TTL reaper) is in
//! `lifecycle`.

use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use locker_store::{SandboxRecord, SandboxState};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::{Json, Query};
use crate::lifecycle::{
    destroy, launch, live_of, live_quiet, record_of, MountedVolume, NewSandbox, PauseMarks,
};
use crate::limits::{
    check_env, check_metadata, check_network, has_egress, require_egress, require_microvm,
    resolve_runtime, DISK_MB, MAX_CPUS, MEMORY_MB,
};
use crate::state::{now_s, App, AppState, Live};
use locker_types::{CreateSandbox, PatchSandbox, Runtime, RuntimeChoice, MAX_TTL_S};

/// A sandbox's disk when its create does not say (MiB).
pub const DEFAULT_DISK_MB: u64 = 2048;

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

/// The API's view of a sandbox.
pub fn view(app: &App, r: &SandboxRecord, live: Option<&Live>) -> Value {
    let last_active = match live {
        Some(l) => locker_types::rfc3339(l.last_active.load(std::sync::atomic::Ordering::Relaxed)),
        None => r.last_active_at.clone(),
    };
    let usage = match live {
        Some(l) => {
            let u = l.machine.usage();
            usage_json(&l.times(), u.cpu_ms, u.peak_memory_bytes)
        }
        None => {
            let t = app
                .store
                .sandbox_times(&r.id)
                .ok()
                .flatten()
                .unwrap_or_default();
            usage_json(&t, r.cpu_ms, r.peak_memory_bytes)
        }
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
        "preview_token": r.preview_token,
        "preview_url": app.cfg.preview.as_ref().map(|d| d.template(&r.id)),
        "failure": (r.state == SandboxState::Failed)
            .then(|| crate::failed::reason(&r.id).unwrap_or_else(|| "unknown".into())),
    })
}

/// A sandbox's `usage`: machine CPU and memory, its time split with the idle fraction
/// (idle over active and idle), and the histogram of gaps between its calls (`le`: a
/// bucket's upper bound in seconds, `null` for the last, unbounded one; counts not
/// cumulative).
pub fn usage_json(t: &locker_store::SandboxTimes, cpu_ms: u64, peak_memory_bytes: u64) -> Value {
    let up = t.active_ms + t.idle_ms;
    let gaps: Vec<Value> = (0..=crate::state::GAP_BOUNDS.len())
        .map(|i| {
            json!({"le": crate::state::GAP_BOUNDS.get(i), "count": t.call_gaps.get(i).copied().unwrap_or(0)})
        })
        .collect();
    json!({
        "cpu_ms": cpu_ms,
        "peak_memory_bytes": peak_memory_bytes,
        "active_s": t.active_ms as f64 / 1000.0,
        "idle_s": t.idle_ms as f64 / 1000.0,
        "paused_s": t.paused_ms as f64 / 1000.0,
        "idle_fraction": if up == 0 { 0.0 } else { t.idle_ms as f64 / up as f64 },
        "call_gaps": gaps,
    })
}

async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Json(body): Json<CreateSandbox>,
) -> Result<impl IntoResponse, ApiError> {
    let (rec, live) = create_sandbox(&app, &caller, body).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(view(&app, &rec, Some(&live))),
    ))
}

/// Creates a sandbox from a create's body (checked here): the door for other protocols'
/// creates (`e2b`), so that theirs meet the same limits and records.
pub(crate) async fn create_sandbox(
    app: &AppState,
    caller: &Caller,
    body: CreateSandbox,
) -> Result<(SandboxRecord, std::sync::Arc<Live>), ApiError> {
    let started = Instant::now();
    let (new, snapshot_dir) = checked(app, caller, body).await?;
    let from_snapshot = snapshot_dir
        .as_ref()
        .and_then(|d| d.file_name())
        .map(|n| n.to_string_lossy().into_owned());
    let fresh = snapshot_dir.is_none();
    let (mut rec, live) = launch(app, caller, &new, snapshot_dir).await?;
    // A template's start command, and its ready command before the sandbox is answered
    // (it reads `starting` until then).
    if fresh {
        if let Err(e) = crate::templates::start_sandbox(app, caller, &live).await {
            // Never announced (no `sandbox.created`): `sandbox.failed` says why, and no
            // `sandbox.deleted` follows.
            crate::lifecycle::discard_failed(app, &rec, live, &e.message).await;
            return Err(e);
        }
        if rec.state == SandboxState::Starting {
            if let Err(e) = crate::lifecycle::make_running(app, &mut rec, &live).await {
                crate::lifecycle::discard_failed(app, &rec, live, &e.message).await;
                return Err(e);
            }
        }
    }
    app.events.emit(
        &caller.tenant,
        crate::events::Kind::SandboxCreated,
        &rec.id,
        json!({"template": rec.template, "runtime": rec.runtime, "from_snapshot": from_snapshot}),
    );
    app.metrics
        .sandbox_create_seconds
        .observe(started.elapsed().as_secs_f64());
    Ok((rec, live))
}

/// A snapshot of a microVM whose volumes were mounted restores with the same mounts only:
/// its guest holds them (the same volumes need not be: a mount names a path and whether
/// it is read-only). 400 otherwise, saying which.
fn same_mounts(
    snap: &locker_store::SnapshotRecord,
    volumes: &[MountedVolume],
) -> Result<(), ApiError> {
    let file = std::path::Path::new(&snap.path).join(locker_runtime::node::FILES_TABLE);
    let Some(had) = locker_runtime::vm_fs::Carried::mounts_in(&file)
        .map_err(|e| ApiError::internal(format!("reading snapshot {}: {e}", snap.id)))?
    else {
        return Ok(());
    };
    let asked: Vec<(String, bool)> = volumes
        .iter()
        .map(|v| (v.path.clone(), v.read_only))
        .collect();
    let had: Vec<(String, bool)> = had.into_iter().map(|m| (m.target, m.read_only)).collect();
    if asked == had {
        return Ok(());
    }
    let say = |l: &[(String, bool)]| {
        if l.is_empty() {
            return "none".to_owned();
        }
        l.iter()
            .map(|(p, ro)| format!("{p}{}", if *ro { " (read-only)" } else { "" }))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Err(ApiError::bad_request(format!(
        "snapshot {} is of a microVM with volumes mounted at {}, which its memory holds: \
         give `volumes` mounted at those paths, in that order (asked: {})",
        snap.id,
        say(&had),
        say(&asked)
    )))
}

/// A create's body checked against the limits, its snapshot and this host: the sandbox to
/// launch, and the snapshot directory it starts from, if any.
async fn checked(
    app: &AppState,
    caller: &Caller,
    body: CreateSandbox,
) -> Result<(NewSandbox, Option<std::path::PathBuf>), ApiError> {
    let choice = body.runtime.unwrap_or_default();
    let runtime = resolve_runtime(choice)?;
    let volumes = resolve_volumes(app, caller, body.volumes.as_ref().map_or(&[][..], |v| &v.0))?;
    let snapshot = match &body.from_snapshot {
        None => None,
        Some(s) => Some(
            app.store
                .get_snapshot(&caller.tenant, s)?
                .ok_or_else(|| ApiError::not_found(format!("snapshot {s} does not exist")))?,
        ),
    };
    if let Some(s) = &snapshot {
        crate::snapshots::elsewhere(app, s)?;
    }
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
    let disk_mb = body.disk_mb.unwrap_or(DEFAULT_DISK_MB);
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
    let mut network = check_network(body.network.as_ref())?;
    let mut env = body.env;
    // A snapshot's secrets come back by name, with the placeholders its disk and memory hold.
    let kept = match &snapshot {
        Some(s) => crate::secrets::for_snapshot(std::path::Path::new(&s.path))?,
        None => Vec::new(),
    };
    let mut names = body.secrets;
    for (n, _) in &kept {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    app.secrets.ensure(&caller.tenant, &names).await?;
    crate::secrets::resolve_keeping(
        app,
        &caller.tenant,
        &names,
        &kept,
        &mut env,
        &mut network,
        body.network.is_some(),
    )?;
    require_egress(&network).await?;
    // A snapshot with memory restores only as a microVM (its memory is a VM's).
    let runtime = match &snapshot {
        Some(snap) if snap.has_memory => {
            if !matches!(choice, RuntimeChoice::Microvm | RuntimeChoice::Auto) {
                return Err(ApiError::bad_request(format!(
                    "snapshot {} holds a microVM's memory: leave `runtime` out or say \"microvm\"",
                    snap.id
                )));
            }
            Runtime::Microvm
        }
        Some(snap) if runtime == Runtime::Microvm => {
            return Err(ApiError::bad_request(format!(
                "snapshot {} holds a disk only (a jail's): microVM sandboxes restore snapshots with memory; leave `runtime` out or say \"jail\"",
                snap.id
            )));
        }
        Some(_) => Runtime::Jail,
        // `auto`: the strongest runtime that works here and does what was asked. A microVM
        // under TCG emulation is not a security boundary, so auto picks it on KVM only; and
        // not with volumes: every file operation of a microVM's volume is a round trip.
        None if choice == RuntimeChoice::Auto => {
            let kvm = matches!(app.node.vm_assets().await, Ok(a) if a.accel == locker_runtime::vm::Accel::Kvm);
            if kvm && volumes.is_empty() {
                Runtime::Microvm
            } else {
                Runtime::Jail
            }
        }
        None => runtime,
    };
    if runtime == Runtime::Microvm {
        require_microvm(&app.node).await?;
    }
    if let (Some(snap), Runtime::Microvm, Ok(a)) = (&snapshot, runtime, app.node.vm_assets().await)
    {
        // Another QEMU version's memory (the host's QEMU upgraded since): refused before
        // a record is made (the node checks it again at the start).
        let dir = std::path::Path::new(&snap.path);
        if let Some(why) = locker_runtime::vm::VmState::memory_mismatch(dir, a.qemu_version) {
            return Err(ApiError::conflict(format!("snapshot {}: {why}", snap.id)));
        }
    }
    let (template_name, template, snapshot_dir, disk_mb) = match &snapshot {
        Some(snap) => {
            same_mounts(snap, &volumes)?;
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
            let t = crate::templates::by_digest(
                app,
                &snap.template_digest,
                &format!("snapshot {}", snap.id),
            )?;
            (
                snap.template.clone(),
                t,
                Some(std::path::PathBuf::from(&snap.path)),
                snap.disk_mb,
            )
        }
        None => {
            let name = body.template.clone().unwrap_or_else(|| "default".into());
            let t = crate::templates::resolve_for(app, &caller.tenant, &name)?
                .ok_or_else(|| crate::default_template::unknown(app, &name))?;
            (name, t, None, disk_mb)
        }
    };
    // The template's environment under the request's (with its secrets' placeholders).
    let request_env = env;
    let mut env = template.config.env.clone();
    env.extend(request_env);
    let new = NewSandbox {
        template_name,
        template,
        runtime,
        cpus,
        memory_mb,
        disk_mb,
        ttl_s,
        idle_timeout_s: body.idle_timeout_s,
        env,
        network,
        metadata: body.metadata,
        volumes,
    };
    Ok((new, snapshot_dir))
}

/// Checks the paths of a sandbox's `volumes` (their shape was checked with the body, see
/// [`locker_types::VolumeMount`]) and finds the caller's volumes.
pub fn resolve_volumes(
    app: &AppState,
    caller: &Caller,
    list: &[locker_types::VolumeMount],
) -> Result<Vec<MountedVolume>, ApiError> {
    let mut out: Vec<MountedVolume> = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let (name, path, read_only) = (m.volume.as_str(), m.path.as_str(), m.read_only);
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
        let Some(claim) = crate::volumes::MountClaim::take(&vol) else {
            return Err(ApiError::conflict(format!(
                "volume {} is being moved to another node of the fleet: create the sandbox \
                 once the move is done (it is placed on the new home)",
                rec.name
            )));
        };
        out.push(MountedVolume {
            volume_id: rec.id,
            path: clean.to_owned(),
            read_only,
            source: vol.live(),
            claim: Some(std::sync::Arc::new(claim)),
        });
    }
    Ok(out)
}

/// The most sandboxes one page of `GET /v1/sandboxes?limit=` holds.
pub const MAX_LIST_LIMIT: u64 = 1000;

async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<impl IntoResponse, ApiError> {
    let mut q = locker_store::SandboxQuery::default();
    let number = |k: &str, v: &str| {
        v.parse::<u64>()
            .map_err(|_| ApiError::bad_request(format!("`{k}` must be a whole number, got {v:?}")))
    };
    for (k, v) in pairs {
        match k.as_str() {
            "state" => {
                q.state = Some(v.parse().map_err(|_| {
                    ApiError::bad_request(format!(
                        "`state` must be starting, running, paused, stopped or failed, got {v:?}"
                    ))
                })?)
            }
            "limit" => {
                let l = number("limit", &v)?;
                if l == 0 || l > MAX_LIST_LIMIT {
                    return Err(ApiError::bad_request(format!(
                        "`limit` must be between 1 and {MAX_LIST_LIMIT}, got {l}"
                    )));
                }
                q.limit = Some(l);
            }
            "offset" => q.offset = number("offset", &v)?,
            "order" => {
                q.newest_first = match v.as_str() {
                    "oldest" => false,
                    "newest" => true,
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "`order` must be oldest (the default) or newest, got {v:?}"
                        )))
                    }
                }
            }
            _ => match k.strip_prefix("metadata.") {
                Some(mk) => q.metadata.push((mk.to_owned(), v)),
                None => {
                    return Err(ApiError::bad_request(format!(
                        "unknown query parameter {k:?}: use state=, metadata.KEY=VALUE, limit=, offset= and order="
                    )))
                }
            },
        }
    }
    // Sandboxes on joined fleet nodes (not rows of this store): merged with the rows in one
    // order by creation, so pages stay pages. The window of rows read is then the first
    // `offset + limit` (the page can only hold those and remote ones).
    let remote: Vec<Value> = if app.fleet.is_some() {
        crate::fleet::route::remote_views(&app, &caller.tenant)?
            .into_iter()
            .filter(|v| q.state.is_none_or(|s| v["state"] == s.as_str()))
            .filter(|v| q.metadata.iter().all(|(k, want)| v["metadata"][k] == *want))
            .collect()
    } else {
        Vec::new()
    };
    let rows_q = if remote.is_empty() {
        q.clone()
    } else {
        locker_store::SandboxQuery {
            offset: 0,
            limit: q.limit.map(|l| q.offset.saturating_add(l)),
            ..q.clone()
        }
    };
    let page = app.store.list_sandboxes_page(&caller.tenant, &rows_q)?;
    let live = app.live.read().await;
    let mut items: Vec<Value> = page
        .sandboxes
        .iter()
        .map(|r| view(&app, r, live.get(&r.id).map(|l| l.as_ref())))
        .collect();
    drop(live);
    let total = page.total + remote.len() as u64;
    if !remote.is_empty() {
        items.extend(remote);
        // RFC 3339 in one format sorts as time; stable, so rows keep their own order.
        items.sort_by(|a, b| {
            let (a, b) = (a["created_at"].as_str(), b["created_at"].as_str());
            if q.newest_first {
                b.cmp(&a)
            } else {
                a.cmp(&b)
            }
        });
        let from = usize::try_from(q.offset)
            .unwrap_or(usize::MAX)
            .min(items.len());
        items.drain(..from);
        if let Some(l) = q.limit {
            items.truncate(usize::try_from(l).unwrap_or(usize::MAX));
        }
    }
    // The offset of the next page, when a limit was given and more match.
    let end = q.offset.saturating_add(items.len() as u64);
    let next_offset = (q.limit.is_some() && end < total).then_some(end);
    Ok(axum::Json(json!({
        "sandboxes": items,
        "total": total,
        "next_offset": next_offset,
    })))
}

async fn get_one(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let r = record_of(&app, &caller, &id)?;
    let live = app.live.read().await.get(&id).cloned();
    Ok(axum::Json(view(&app, &r, live.as_deref())))
}

async fn patch(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(body): Json<PatchSandbox>,
) -> Result<impl IntoResponse, ApiError> {
    let mut r = match &body.network {
        Some(n) => change_network(&app, &caller, &id, n).await?,
        None => record_of(&app, &caller, &id)?,
    };
    if let Some(m) = body.metadata {
        check_metadata(&m)?;
        r.metadata = m;
    }
    app.store.update_sandbox(&r)?;
    let live = app.live.read().await.get(&id).cloned();
    Ok(axum::Json(view(&app, &r, live.as_deref())))
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
    let r = set_ttl_of(&app, &caller, &id, body.ttl_s)?;
    let live = app.live.read().await.get(&id).cloned();
    Ok(axum::Json(view(&app, &r, live.as_deref())))
}

async fn pause(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let (r, live) = pause_sandbox(&app, &caller, &id).await?;
    Ok(axum::Json(view(&app, &r, Some(&live))))
}

/// Applies network policy `n` to the caller's sandbox `id` (egress rules replaced whole;
/// unchanged on failure): its record with the new policy, for the caller to store. The door
/// for other protocols' policy changes (`e2b`).
pub(crate) async fn change_network(
    app: &AppState,
    caller: &Caller,
    id: &str,
    n: &locker_types::NetworkPolicy,
) -> Result<SandboxRecord, ApiError> {
    let network = check_network(Some(n))?;
    require_egress(&network).await?;
    // One policy change at a time (the create lock is short and rarely contended).
    let _guard = app.create_lock.lock().await;
    let mut r = record_of(app, caller, id)?;
    if network != r.network {
        // Like any call, a policy change thaws a paused sandbox (the machine's resolver
        // is written through its agent).
        let l = live_of(app, caller, id).await.map_err(|e| {
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
            .apply(&app.node, &l.machine, id, &caller.tenant, &network)
            .await
        {
            // Back to the policy it had (rules are replaced whole, so this restores it).
            let _ = app
                .egress
                .apply(&app.node, &l.machine, id, &caller.tenant, &r.network)
                .await;
            return Err(ApiError::unavailable(format!(
                "changing the network policy failed (unchanged): {e}"
            )));
        }
    }
    r.network = network;
    Ok(r)
}

/// Sets the caller's sandbox `id` to expire `ttl_s` seconds from now (stored): its record.
pub(crate) fn set_ttl_of(
    app: &AppState,
    caller: &Caller,
    id: &str,
    ttl_s: u64,
) -> Result<SandboxRecord, ApiError> {
    if ttl_s == 0 || ttl_s > MAX_TTL_S {
        return Err(ApiError::bad_request(format!(
            "`ttl_s` must be between 1 and {MAX_TTL_S}"
        )));
    }
    let mut r = record_of(app, caller, id)?;
    r.ttl_s = ttl_s;
    r.expires_at = locker_types::rfc3339(now_s() + ttl_s as i64);
    app.store.update_sandbox(&r)?;
    Ok(r)
}

/// Freezes sandbox `live` (a frozen one stays so), paused by idleness or not, and records
/// it paused; no event (a sandbox carried from another node paused comes back so).
pub(crate) fn freeze(app: &AppState, live: &Live, by_idle: bool) -> Result<(), ApiError> {
    {
        let mut st = live.pause.lock().expect("pause lock");
        if st.moving.is_some() {
            // A microVM moving live runs on until its last copy: no freeze meanwhile.
            return Err(ApiError::unavailable(format!(
                "sandbox {} is moving to another node (its node is being drained): call \
                 again in a few seconds",
                live.id
            )));
        }
        if st.since.is_none() {
            live.machine.pause().map_err(ApiError::during("pausing"))?;
            st.since = Some(now_s());
            live.clock.lock().expect("clock lock").paused(true);
        }
        st.by_idle = by_idle;
        match (by_idle, st.since) {
            (true, Some(since)) => PauseMarks::of(app).set(&live.id, since),
            _ => PauseMarks::of(app).clear(&live.id),
        }
    }
    app.store
        .set_sandbox_state(&live.id, SandboxState::Paused)?;
    Ok(())
}

/// Pauses (freezes) the caller's sandbox `id`; a paused one stays paused, now by its
/// caller. Its record and live entry.
pub(crate) async fn pause_sandbox(
    app: &AppState,
    caller: &Caller,
    id: &str,
) -> Result<(SandboxRecord, std::sync::Arc<Live>), ApiError> {
    let live = live_quiet(app, caller, id).await?;
    // An explicit pause is the caller's: its time counts against the TTL.
    freeze(app, &live, false)?;
    app.events.emit(
        &caller.tenant,
        crate::events::Kind::SandboxPaused,
        id,
        json!({"reason": "explicit"}),
    );
    let r = record_of(app, caller, id)?;
    Ok((r, live))
}

async fn resume(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let live = live_of(&app, &caller, &id).await?;
    let r = record_of(&app, &caller, &id)?;
    Ok(axum::Json(view(&app, &r, Some(&live))))
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

/// The answer for a template this host has not built: how to build it.
pub fn unknown_template(name: &str) -> ApiError {
    let how = if name == "default" {
        "build it with `locker template build default` (Debian bookworm with python3, git and node; `scripts/setup` does it too)".to_string()
    } else if name == "code-interpreter" {
        "build it with `sudo locker template build code-interpreter` (default's packages with Jupyter's Python kernel, numpy, pandas, matplotlib and scipy; about 6 minutes, once per host)".to_string()
    } else {
        format!("build it with `locker template build {name} --file SPEC.json` or import a root filesystem with `locker template import {name} ROOTFS.tar`")
    };
    ApiError::bad_request(format!(
        "unknown template {name:?}: {how}; `locker template list` shows the templates of this host"
    ))
}

#[cfg(test)]
mod tests {
    /// The list's query, decoded as `list` decodes it: repeated keys kept in order,
    /// percent-decoding, `+` as a space, and a broken escape left as it is.
    fn pairs(q: &str) -> Vec<(String, String)> {
        let uri: axum::http::Uri = format!("/v1/sandboxes?{q}").parse().unwrap();
        axum::extract::Query::<Vec<(String, String)>>::try_from_uri(&uri)
            .unwrap()
            .0
    }

    #[test]
    fn form_pairs_decode() {
        let p = pairs("state=running&metadata.team=a%20b&metadata.x=1+2");
        assert_eq!(p[0], ("state".into(), "running".into()));
        assert_eq!(p[1], ("metadata.team".into(), "a b".into()));
        assert_eq!(p[2], ("metadata.x".into(), "1 2".into()));
        assert_eq!(pairs("k=%zz%4")[0].1, "%zz%4");
        let p = pairs("metadata.a=1&metadata.a=2&&flag");
        assert_eq!(p.len(), 3, "repeated keys stay, empty pairs go: {p:?}");
        assert_eq!(p[2], ("flag".into(), String::new()));
    }
}
