//! E2B's control plane (`/sandboxes`, `/v2/sandboxes`, `/snapshots`, `/templates/{id}`) onto
//! Locker's sandboxes and snapshots.
//!
//! Owns: E2B's request and response shapes, `X-API-KEY`, and the mapping of E2B's fields to
//! Locker's: `templateID` aliases (and a `snap_…` id: a sandbox from that snapshot),
//! `timeout` to the TTL, `autoPause` to the idle policy, `envVars` to the sandbox's env,
//! `allow_internet_access` and `network` to the egress policy, `metadata` as it is (its
//! `locker.secrets` key, comma-separated names, also becomes the create's `secrets`).
//!
//! Must not: decide anything a sandbox's life decides. Every handler checks E2B's input and
//! calls the door Locker's own handler calls (`sandboxes::create_sandbox`,
//! `sandboxes::set_ttl_of`, `sandboxes::pause_sandbox`, `sandboxes::change_network`,
//! `lifecycle::{live_of, destroy}`, `snapshots::{snapshot_sandbox, fork_sandbox,
//! remove_snapshot}`), so limits, quotas, records and egress are Locker's.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, RawQuery, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put, MethodRouter};
use axum::Router;
use locker_store::{SandboxRecord, SandboxState, SnapshotRecord};
use locker_types::{CreateSandbox, NetworkPolicy, MAX_TTL_S};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{E2bError, ENVD_VERSION};
use crate::auth::Caller;
use crate::state::{now_s, AppState, Live};

/// E2B's default `timeout` of `POST /sandboxes` (v1), in seconds.
pub const V1_TIMEOUT_S: u64 = 15;
/// E2B's default `timeout` of `POST /v2/sandboxes`, in seconds.
pub const V2_TIMEOUT_S: u64 = 300;
/// The most items one list page holds (E2B's own bound), and its default.
const PAGE_MAX: usize = 100;

/// A list's `limit`: 1 to [`PAGE_MAX`].
fn page_limit(v: &str) -> Result<usize, E2bError> {
    match v.parse::<usize>() {
        Ok(n) if (1..=PAGE_MAX).contains(&n) => Ok(n),
        _ => Err(E2bError::bad_request(format!(
            "`limit` {v:?} must be a number from 1 to {PAGE_MAX}"
        ))),
    }
}
/// The address every IPv4 destination falls in: E2B's way to say "all traffic".
const ALL_TRAFFIC: [&str; 2] = ["0.0.0.0/0", "::/0"];

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/sandboxes", e2b(post(create_v1).get(list_v1)))
        .route("/v2/sandboxes", e2b(post(create_v2).get(list_v2)))
        .route("/sandboxes/{id}", e2b(delete(kill).get(info)))
        .route("/sandboxes/{id}/connect", e2b(post(connect)))
        .route("/v2/sandboxes/{id}/connect", e2b(post(connect)))
        .route("/sandboxes/{id}/timeout", e2b(post(timeout)))
        .route("/sandboxes/{id}/pause", e2b(post(pause)))
        .route("/sandboxes/{id}/resume", e2b(post(resume)))
        .route("/sandboxes/{id}/metrics", e2b(get(metrics)))
        .route("/sandboxes/{id}/snapshots", e2b(post(snapshot)))
        .route("/sandboxes/{id}/fork", e2b(post(fork)))
        .route("/sandboxes/{id}/network", e2b(put(network)))
        .route("/snapshots", e2b(get(list_snapshots)))
        .route("/templates/{id}", e2b(delete(delete_snapshot)))
}

/// An E2B route answers a method it does not take in E2B's error shape.
fn e2b(m: MethodRouter<AppState>) -> MethodRouter<AppState> {
    m.fallback(|req: Request| async move {
        E2bError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!(
                "{} {}: this E2B route does not take that method",
                req.method(),
                req.uri().path()
            ),
        )
    })
}

/// Whether `path` lies under E2B's control-plane prefixes (an unknown route there answers
/// in E2B's error shape: the SDKs parse every error body).
pub fn is_e2b_path(path: &str) -> bool {
    ["/sandboxes", "/v2/sandboxes", "/snapshots", "/templates"]
        .iter()
        .any(|p| path == *p || path.strip_prefix(p).is_some_and(|r| r.starts_with('/')))
}

/// The caller of an E2B route: the tenant of the Locker key in `X-API-KEY`.
pub(crate) struct E2bCaller(pub Caller);

impl FromRequestParts<AppState> for E2bCaller {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, app: &AppState) -> Result<Self, E2bError> {
        // On a fleet node, the control plane authenticated the caller (`auth`'s rule).
        if let Some(f) = parts.extensions.get::<crate::fleet::node::Forwarded>() {
            return Ok(Self(Caller {
                tenant: f.tenant.clone(),
                key_id: "fleet".into(),
            }));
        }
        api_key_caller(app, &parts.headers).map(Self)
    }
}

/// The caller whose Locker key `X-API-KEY` carries.
pub(crate) fn api_key_caller(
    app: &AppState,
    headers: &axum::http::HeaderMap,
) -> Result<Caller, E2bError> {
    let key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| {
            E2bError::unauthorized("missing X-API-KEY header: set E2B_API_KEY to a Locker API key")
        })?;
    match app.store.authenticate(key) {
        Ok(Some(p)) => Ok(Caller {
            tenant: p.tenant,
            key_id: p.key_id,
        }),
        Ok(None) => Err(E2bError::unauthorized(
            "unknown or revoked API key (X-API-KEY)",
        )),
        Err(e) => Err(E2bError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("checking the API key: {e}"),
        )),
    }
}

/// A JSON body in E2B's error shape when it is not one; an empty body is `{}` (the SDKs
/// send none for some calls).
pub(crate) struct Body<T>(pub T);

impl<T: DeserializeOwned + Send> FromRequest<AppState> for Body<T> {
    type Rejection = E2bError;

    async fn from_request(req: Request, app: &AppState) -> Result<Self, E2bError> {
        let bytes = Bytes::from_request(req, app).await.map_err(|e| {
            E2bError::new(
                e.status(),
                format!("reading the request body: {}", e.body_text()),
            )
        })?;
        let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            &bytes
        };
        serde_json::from_slice(text)
            .map(Body)
            .map_err(|e| E2bError::bad_request(format!("the request body: {e}")))
    }
}

/// `NewSandbox` (v1) and `NewSandboxV2`: the fields Locker maps or refuses; others the
/// SDKs may add are accepted and ignored.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    auto_pause: Option<bool>,
    auto_resume: Option<AutoResume>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<NetworkConfig>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    /// v1: whether envd needs the access token. Locker's always does.
    #[allow(dead_code)]
    secure: Option<bool>,
    mcp: Option<Value>,
    iam: Option<Value>,
    volume_mounts: Option<Vec<Value>>,
}

#[derive(Debug, Deserialize)]
struct AutoResume {
    enabled: bool,
}

/// `SandboxNetworkConfig` and `SandboxNetworkUpdateConfig`: the fields egress is made of.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkConfig {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    /// The update's own spelling of `allow_internet_access`.
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    rules: Option<Value>,
    egress_proxy: Option<Value>,
}

/// What placing an E2B create needs of its body, in Locker's create's words (`template`
/// or `from_snapshot`, `secrets`): the fleet's router places it by them. `None` for a body
/// the create refuses (it says why).
pub(crate) fn placement_spec(body: &Value) -> Option<Value> {
    let t = body["templateID"]
        .as_str()
        .map(str::trim)
        .filter(|t| !t.is_empty())?;
    let mut spec = if t.starts_with("snap_") {
        json!({"from_snapshot": t})
    } else {
        json!({"template": template_of(t)})
    };
    if let Some(names) = body["metadata"][SECRETS_KEY].as_str() {
        let names: Vec<&str> = names
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        spec["secrets"] = json!(names);
    }
    Some(spec)
}

/// Locker's template for an E2B template name.
fn template_of(e2b: &str) -> String {
    match e2b {
        "base" => "default".into(),
        "code-interpreter-v1" => "code-interpreter".into(),
        other => other.into(),
    }
}

/// The metadata key of an E2B create that names Locker secrets (comma-separated).
pub const SECRETS_KEY: &str = "locker.secrets";

/// Locker's egress policy for E2B's network settings. E2B allows all traffic unless told
/// otherwise; Locker allows none unless told (see docs/e2b.md), so nothing said is `none`.
/// `allowOut` names what may be reached (its entries win over `denyOut`, as in E2B);
/// `denyOut` can only deny all traffic: Locker enforces allowlists, not denylists.
fn egress_of(
    allow_internet: Option<bool>,
    net: Option<&NetworkConfig>,
) -> Result<NetworkPolicy, E2bError> {
    let none = NetworkConfig::default();
    let net = net.unwrap_or(&none);
    if net
        .rules
        .as_ref()
        .is_some_and(|r| !r.is_null() && r != &json!({}))
    {
        return Err(E2bError::bad_request(
            "`network.rules` (request transforms) are not served by Locker: leave them out",
        ));
    }
    if net.egress_proxy.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(E2bError::bad_request(
            "`network.egressProxy` is not served by Locker (its egress goes through Locker's own proxy): leave it out",
        ));
    }
    let allow_internet = allow_internet.or(net.allow_internet_access);
    let deny = net.deny_out.as_deref().unwrap_or_default();
    if let Some(d) = deny.iter().find(|d| !ALL_TRAFFIC.contains(&d.trim())) {
        return Err(E2bError::bad_request(format!(
            "`network.denyOut` {d:?}: Locker enforces allowlists, not denylists: deny all traffic \
             (\"0.0.0.0/0\") and list what may be reached in `allowOut`"
        )));
    }
    let deny_all = !deny.is_empty() || allow_internet == Some(false);
    let allow = net.allow_out.as_deref().unwrap_or_default();
    Ok(if !allow.is_empty() {
        if allow.iter().any(|a| ALL_TRAFFIC.contains(&a.trim()))
            || (allow_internet == Some(true) && !deny_all)
        {
            NetworkPolicy::All
        } else {
            NetworkPolicy::Allow(allow.iter().map(|a| Value::String(a.clone())).collect())
        }
    } else if allow_internet == Some(true) && !deny_all {
        NetworkPolicy::All
    } else {
        NetworkPolicy::None
    })
}

/// `timeout` (seconds) checked as a TTL.
fn ttl_of(timeout: u64) -> Result<u64, E2bError> {
    if timeout == 0 || timeout > MAX_TTL_S {
        return Err(E2bError::bad_request(format!(
            "`timeout` must be between 1 and {MAX_TTL_S} seconds"
        )));
    }
    Ok(timeout)
}

async fn create_v1(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Body(body): Body<Value>,
) -> Result<Response, E2bError> {
    create(app, caller, body, V1_TIMEOUT_S).await
}

async fn create_v2(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Body(body): Body<Value>,
) -> Result<Response, E2bError> {
    create(app, caller, body, V2_TIMEOUT_S).await
}

async fn create(
    app: AppState,
    caller: Caller,
    body: Value,
    default_timeout: u64,
) -> Result<Response, E2bError> {
    let new: NewSandbox = serde_json::from_value(body)
        .map_err(|e| E2bError::bad_request(format!("the sandbox to create: {e}")))?;
    if new.template_id.trim().is_empty() {
        return Err(E2bError::bad_request("`templateID` is empty: name a template (\"base\", \"code-interpreter-v1\") or a snapshot"));
    }
    if new.mcp.as_ref().is_some_and(|m| !m.is_null()) {
        return Err(E2bError::bad_request(
            "`mcp` (E2B's MCP gateway in the sandbox) is not served by Locker: leave it out; Locker serves MCP itself at /mcp",
        ));
    }
    if new
        .iam
        .as_ref()
        .is_some_and(|m| !m.is_null() && m != &json!({}) && m.get("tokens") != Some(&json!({})))
    {
        return Err(E2bError::bad_request(
            "`iam` (workload identity tokens) is not served by Locker: leave it out",
        ));
    }
    if new.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(E2bError::bad_request(
            "`volumeMounts` are not served through E2B's API: create the sandbox with Locker's own API (`volumes`) to mount Locker volumes",
        ));
    }
    if new.auto_resume.as_ref().is_some_and(|a| !a.enabled) {
        return Err(E2bError::bad_request(
            "`autoResume.enabled: false` cannot be honoured: any call to a paused Locker sandbox resumes it; leave `autoResume` out",
        ));
    }
    let timeout = ttl_of(new.timeout.unwrap_or(default_timeout))?;
    let network = egress_of(new.allow_internet_access, new.network.as_ref())?;
    // E2B's auto-pause pauses at the timeout instead of killing; Locker's idle policy pauses
    // after that long without calls, and the sandbox lives on (paused) until its TTL.
    let (ttl_s, idle_timeout_s) = if new.auto_pause == Some(true) {
        (MAX_TTL_S, Some(timeout))
    } else {
        (timeout, None)
    };
    let (template, from_snapshot) = if new.template_id.starts_with("snap_") {
        (None, Some(new.template_id.clone()))
    } else {
        (Some(template_of(&new.template_id)), None)
    };
    let metadata = new.metadata.unwrap_or_default();
    // E2B's create has no secrets: Locker's secrets are named in metadata (see docs/e2b.md).
    let secrets: Vec<String> = metadata
        .get(SECRETS_KEY)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    let create = CreateSandbox {
        template,
        from_snapshot,
        ttl_s: Some(ttl_s),
        idle_timeout_s,
        env: new.env_vars.unwrap_or_default(),
        metadata,
        secrets,
        network: Some(network),
        ..Default::default()
    };
    let (rec, _live) = crate::sandboxes::create_sandbox(&app, &caller, create).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(sandbox(&app, &rec, &new.template_id)),
    )
        .into_response())
}

/// What create returns as `domain`: the preview domain's host (and port), so that the
/// SDK's `get_host(port)` (`{port}-{id}.{domain}`) names a preview host this server serves.
/// Null without `--preview-domain` (and then `get_host` cannot work; docs/e2b.md).
fn domain(app: &AppState) -> Value {
    app.cfg
        .preview
        .as_ref()
        .map_or(Value::Null, |d| Value::String(d.authority()))
}

/// E2B's `Sandbox` for a record.
fn sandbox(app: &AppState, r: &SandboxRecord, template_id: &str) -> Value {
    json!({
        "templateID": template_id,
        "sandboxID": r.id,
        "clientID": "locker",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": r.preview_token,
        // A preview host's credential (header `E2b-Traffic-Access-Token`): ports are
        // private in Locker unless made public.
        "trafficAccessToken": r.preview_token,
        "domain": domain(app),
    })
}

/// E2B's state of a record: `running` or `paused` (`None` for those E2B has no word for).
fn state_of(r: &SandboxRecord) -> Option<&'static str> {
    match r.state {
        SandboxState::Running => Some("running"),
        SandboxState::Paused => Some("paused"),
        _ => None,
    }
}

/// E2B's `ListedSandbox` for a record.
fn listed(r: &SandboxRecord) -> Value {
    json!({
        "templateID": r.template,
        "sandboxID": r.id,
        "clientID": "locker",
        "startedAt": r.created_at,
        "endAt": r.expires_at,
        "cpuCount": (r.cpus.ceil() as u64).max(1),
        "memoryMB": r.memory_mb,
        "diskSizeMB": r.disk_mb,
        "state": state_of(r).unwrap_or("running"),
        "envdVersion": ENVD_VERSION,
        "metadata": r.metadata,
    })
}

/// E2B's view of a record's egress policy (`allowOut`, `denyOut`).
fn network_view(r: &SandboxRecord) -> (bool, Value) {
    match r.network.get("egress").and_then(Value::as_str) {
        Some("all") => (true, json!({})),
        Some("allow") => (
            false,
            json!({"allowOut": r.network.get("allow").cloned().unwrap_or(json!([])), "denyOut": ["0.0.0.0/0"]}),
        ),
        _ => (false, json!({"denyOut": ["0.0.0.0/0"]})),
    }
}

async fn kill(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let r = crate::lifecycle::record_of(&app, &caller, &id)?;
    crate::lifecycle::destroy(&app, &r, "deleted").await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn info(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, E2bError> {
    let r = crate::lifecycle::record_of(&app, &caller, &id)?;
    let Some(state) = state_of(&r) else {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is {} (not running or paused)", r.state),
        ));
    };
    let mut v = listed(&r);
    let (internet, network) = network_view(&r);
    v["state"] = json!(state);
    v["envdAccessToken"] = json!(r.preview_token);
    v["domain"] = domain(&app);
    v["allowInternetAccess"] = json!(internet);
    v["network"] = network;
    v["lifecycle"] = json!({
        "autoResume": true,
        "onTimeout": if r.idle_timeout_s.is_some() { "pause" } else { "kill" },
    });
    Ok(axum::Json(v))
}

/// `ConnectSandbox` (v1, v2) and `ResumedSandbox`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Connect {
    timeout: Option<u64>,
}

/// Thaws the caller's sandbox `id` if it is paused (a call through `live_of`, which counts
/// and thaws; it ends at once) and moves its end to `timeout` from now when that is later.
/// The record, and whether it was paused.
async fn wake(
    app: &AppState,
    caller: &Caller,
    id: &str,
    timeout: Option<u64>,
) -> Result<(SandboxRecord, bool), E2bError> {
    let r = crate::lifecycle::record_of(app, caller, id)?;
    let was_paused = r.state == SandboxState::Paused;
    drop(crate::lifecycle::live_of(app, caller, id).await?);
    let mut r = crate::lifecycle::record_of(app, caller, id)?;
    if let Some(t) = timeout {
        let t = ttl_of(t)?;
        let ends = locker_types::parse_rfc3339(&r.expires_at).unwrap_or(0);
        if now_s() + t as i64 > ends {
            r = crate::sandboxes::set_ttl_of(app, caller, id, t)?;
        }
    }
    Ok((r, was_paused))
}

/// `POST /sandboxes/{id}/connect` and `/v2/…/connect`: 200 when it was running, 201 when it
/// was paused and is resumed.
async fn connect(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
    Body(body): Body<Connect>,
) -> Result<Response, E2bError> {
    let (r, was_paused) = wake(&app, &caller, &id, body.timeout).await?;
    let status = if was_paused {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, axum::Json(sandbox(&app, &r, &r.template))).into_response())
}

/// `POST /sandboxes/{id}/resume` (older SDKs): 201, or 409 when it is not paused.
async fn resume(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
    Body(body): Body<Connect>,
) -> Result<Response, E2bError> {
    let r = crate::lifecycle::record_of(&app, &caller, &id)?;
    if r.state != SandboxState::Paused {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!(
                "sandbox {id} is not paused (it is {}): connect to it instead",
                r.state
            ),
        ));
    }
    let (r, _) = wake(&app, &caller, &id, body.timeout).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(sandbox(&app, &r, &r.template)),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
struct Timeout {
    timeout: Option<u64>,
}

/// `POST /sandboxes/{id}/timeout`: the sandbox ends `timeout` seconds from now. `0` is
/// its timeout now, as on E2B: an auto-pause sandbox is paused (a paused one stays so),
/// any other is killed (its id then answers as one that reached its timeout).
async fn timeout(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
    Body(body): Body<Timeout>,
) -> Result<StatusCode, E2bError> {
    let t = body
        .timeout
        .ok_or_else(|| E2bError::bad_request("missing `timeout` (seconds from now)"))?;
    if t == 0 {
        let r = crate::lifecycle::record_of(&app, &caller, &id)?;
        if r.idle_timeout_s.is_none() {
            crate::lifecycle::destroy(&app, &r, "expired").await?;
        } else if r.state != SandboxState::Paused {
            crate::sandboxes::pause_sandbox(&app, &caller, &id).await?;
        }
        return Ok(StatusCode::NO_CONTENT);
    }
    crate::sandboxes::set_ttl_of(&app, &caller, &id, ttl_of(t)?)?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/pause`: 204, 409 when already paused. The machine is frozen with
/// its memory (`memory: false` cannot be asked: a jail has no other pause).
async fn pause(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
    Body(_): Body<Value>,
) -> Result<StatusCode, E2bError> {
    let r = crate::lifecycle::record_of(&app, &caller, &id)?;
    if r.state == SandboxState::Paused {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    crate::sandboxes::pause_sandbox(&app, &caller, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /sandboxes/{id}/metrics?start=&end=`: one `SandboxMetric`, taken now (Locker keeps
/// totals, not a series), when now is inside the window asked for.
async fn metrics(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Result<axum::Json<Value>, E2bError> {
    let r = crate::lifecycle::record_of(&app, &caller, &id)?;
    let mut window = (i64::MIN, i64::MAX);
    for (k, v) in pairs(q.as_deref()) {
        let at = || {
            v.parse::<i64>().map_err(|_| {
                E2bError::bad_request(format!("`{k}` must be a Unix time in seconds, got {v:?}"))
            })
        };
        match k.as_str() {
            "start" => window.0 = at()?,
            "end" => window.1 = at()?,
            _ => {}
        }
    }
    let now = now_s();
    if now < window.0 || now > window.1 {
        return Ok(axum::Json(json!([])));
    }
    let live = crate::lifecycle::live_entry(&app, &caller, &id).await?;
    Ok(axum::Json(json!([metric(&r, &live, now)])))
}

/// A `SandboxMetric` of a live sandbox at `now`: CPU as the average use since it started
/// (of its CPUs), memory in use now, disk as the blocks its writable layer holds.
pub(super) fn metric(r: &SandboxRecord, live: &Live, now: i64) -> Value {
    let usage = live.machine.usage();
    let up_ms =
        ((now - locker_types::parse_rfc3339(&r.created_at).unwrap_or(now)).max(1) * 1000) as f64;
    let pct = (usage.cpu_ms as f64 / (up_ms * r.cpus.max(0.01)) * 100.0).clamp(0.0, 100.0);
    let dir = std::path::Path::new(&r.machine_dir);
    // The machine's own image (the layers beneath it are its snapshots'): a jail's
    // `disk.img`, a microVM's by its chain.
    let own = if locker_runtime::vm::is_vm_dir(dir) {
        locker_runtime::vm::own_disk_of(dir).ok()
    } else {
        Some(dir.join("disk.img"))
    };
    let disk_used = own.map_or(0, |d| locker_runtime::disk::allocated_bytes(&d));
    json!({
        "timestamp": locker_types::rfc3339(now),
        "timestampUnix": now,
        "cpuCount": (r.cpus.ceil() as u64).max(1),
        "cpuUsedPct": (pct * 100.0).round() / 100.0,
        "memUsed": live.machine.memory_bytes(),
        "memTotal": r.memory_mb * 1024 * 1024,
        "memCache": 0,
        "diskUsed": disk_used,
        "diskTotal": r.disk_mb * 1024 * 1024,
    })
}

/// A query string's pairs, decoded (`+` is a space).
fn pairs(q: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(q.unwrap_or("").as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// One page of a list, and the token of the next (`X-Next-Token`) when there is one.
struct Page<T> {
    items: Vec<T>,
    next: Option<String>,
}

/// Pages `all` (sorted by `key`, ascending) after `token`: tokens are `<unix>_<id>` of the
/// last item given, so a page is stable when items come and go meanwhile.
fn page<T>(
    mut all: Vec<T>,
    key: impl Fn(&T) -> (i64, String),
    desc: bool,
    token: Option<&str>,
    limit: usize,
) -> Result<Page<T>, E2bError> {
    all.sort_by_key(&key);
    if desc {
        all.reverse();
    }
    if let Some(t) = token {
        let after = t
            .split_once('_')
            .and_then(|(at, id)| Some((at.parse::<i64>().ok()?, id.to_owned())))
            .ok_or_else(|| {
                E2bError::bad_request(format!("`nextToken` {t:?} is not one this server gave"))
            })?;
        all.retain(|i| if desc { key(i) < after } else { key(i) > after });
    }
    let more = all.len() > limit;
    all.truncate(limit);
    let next = if more {
        all.last().map(|i| {
            let (at, id) = key(i);
            format!("{at}_{id}")
        })
    } else {
        None
    };
    Ok(Page { items: all, next })
}

/// A list answer: the items, with `X-Next-Token` when more follow.
fn list_answer(items: Vec<Value>, next: Option<String>) -> Response {
    let mut resp = axum::Json(Value::Array(items)).into_response();
    if let Some(n) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", n);
    }
    resp
}

fn started(r: &SandboxRecord) -> (i64, String) {
    (
        locker_types::parse_rfc3339(&r.created_at).unwrap_or(0),
        r.id.clone(),
    )
}

/// The order of a sandbox list: the start in milliseconds (the record keeps seconds; the
/// birth time of the machine's directory, made by the create, gives the rest, so two
/// sandboxes started within one second list in the order they started), then the id.
fn started_ms(r: &SandboxRecord) -> (i64, String) {
    let (secs, id) = started(r);
    let born = std::fs::metadata(&r.machine_dir)
        .and_then(|m| m.created())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as i64)
        // Made during the create, after its record's time; one made otherwise (a machine
        // adopted across a move) orders by the record's second.
        .filter(|ms| (secs * 1000..secs * 1000 + 60_000).contains(ms));
    (born.unwrap_or(secs * 1000), id)
}

/// The metadata filter of a list: `metadata=<urlencoded k=v&…>`.
fn metadata_filter(v: &str) -> Result<Vec<(String, String)>, E2bError> {
    let out: Vec<(String, String)> = pairs(Some(v));
    if out.iter().any(|(k, _)| k.is_empty()) {
        return Err(E2bError::bad_request(format!(
            "`metadata` {v:?} must be key=value pairs joined by & (URL-encoded)"
        )));
    }
    Ok(out)
}

/// `GET /v2/sandboxes?metadata=&state=running,paused&order=&limit=&nextToken=&template=`.
async fn list_v2(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    RawQuery(q): RawQuery,
) -> Result<Response, E2bError> {
    // Newest first unless `order=asc`, as E2B's API (its SDK's paging test expects it).
    let (mut meta, mut states, mut desc, mut limit, mut token, mut template, mut after) = (
        Vec::new(),
        vec!["running", "paused"],
        true,
        PAGE_MAX,
        None,
        None,
        None,
    );
    for (k, v) in pairs(q.as_deref()) {
        match k.as_str() {
            "metadata" => meta = metadata_filter(&v)?,
            "state" => {
                states = Vec::new();
                for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    states.push(match s {
                        "running" => "running",
                        "paused" => "paused",
                        _ => {
                            return Err(E2bError::bad_request(format!(
                                "`state` {s:?}: use running, paused or both (running,paused)"
                            )))
                        }
                    });
                }
            }
            "order" => {
                desc = match v.as_str() {
                    "asc" => false,
                    "desc" => true,
                    _ => {
                        return Err(E2bError::bad_request(format!(
                            "`order` {v:?}: use asc or desc"
                        )))
                    }
                }
            }
            "limit" => limit = page_limit(&v)?,
            "nextToken" => token = Some(v),
            "template" => template = Some(template_of(&v)),
            "startedAfter" => {
                after = Some(locker_types::parse_rfc3339(&v).ok_or_else(|| {
                    E2bError::bad_request(format!("`startedAfter` {v:?} is not an RFC 3339 time"))
                })?)
            }
            _ => {}
        }
    }
    let mut recs = app
        .store
        .list_sandboxes(&caller.tenant, None, &meta)
        .map_err(crate::error::ApiError::from)?;
    recs.extend(remote_records(&app, &caller.tenant, &meta)?);
    let recs: Vec<SandboxRecord> = recs
        .into_iter()
        .filter(|r| state_of(r).is_some_and(|s| states.contains(&s)))
        .filter(|r| template.as_ref().is_none_or(|t| *t == r.template))
        .filter(|r| after.is_none_or(|a| started(r).0 >= a))
        .collect();
    let p = page(recs, started_ms, desc, token.as_deref(), limit)?;
    Ok(list_answer(p.items.iter().map(listed).collect(), p.next))
}

/// `GET /sandboxes?metadata=` (E2B's deprecated v1 list): the running sandboxes, unpaged.
async fn list_v1(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    RawQuery(q): RawQuery,
) -> Result<Response, E2bError> {
    let mut meta = Vec::new();
    for (k, v) in pairs(q.as_deref()) {
        if k == "metadata" {
            meta = metadata_filter(&v)?;
        }
    }
    let mut recs = app
        .store
        .list_sandboxes(&caller.tenant, Some(SandboxState::Running), &meta)
        .map_err(crate::error::ApiError::from)?;
    recs.extend(
        remote_records(&app, &caller.tenant, &meta)?
            .into_iter()
            .filter(|r| r.state == SandboxState::Running),
    );
    Ok(axum::Json(Value::Array(recs.iter().map(listed).collect())).into_response())
}

/// The tenant's sandboxes on the fleet's joined nodes (none on one host), as records made
/// from the views their nodes last answered, those whose `metadata` has every pair of
/// `meta`; lost ones are left out (E2B has no word for them).
fn remote_records(
    app: &AppState,
    tenant: &str,
    meta: &[(String, String)],
) -> Result<Vec<SandboxRecord>, E2bError> {
    let views = crate::fleet::route::remote_views(app, tenant)?;
    Ok(views
        .into_iter()
        .filter_map(|mut v| {
            let o = v.as_object_mut()?;
            o.insert("tenant".into(), json!(tenant));
            for (k, empty) in [
                ("env", json!({})),
                ("machine_dir", json!("")),
                ("cpu_ms", json!(0)),
                ("peak_memory_bytes", json!(0)),
            ] {
                o.entry(k).or_insert(empty);
            }
            serde_json::from_value::<SandboxRecord>(v).ok()
        })
        .filter(|r| meta.iter().all(|(k, want)| r.metadata.get(k) == Some(want)))
        .collect())
}

#[derive(Debug, Deserialize)]
struct SnapshotBody {
    /// E2B's snapshot name: Locker's snapshots have ids only.
    name: Option<String>,
}

/// E2B's `SnapshotInfo` for a snapshot (Locker's snapshots have no names).
fn snapshot_info(s: &SnapshotRecord) -> Value {
    json!({"snapshotID": s.id, "names": []})
}

/// `POST /sandboxes/{id}/snapshots`: 201 `SnapshotInfo`; a sandbox starts from it with
/// `Sandbox.create(snapshot_id)`.
async fn snapshot(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
    Body(body): Body<SnapshotBody>,
) -> Result<Response, E2bError> {
    if body.name.as_deref().is_some_and(|n| !n.is_empty()) {
        return Err(E2bError::bad_request(
            "Locker's snapshots have ids, not names: leave `name` out and keep the snapshotID the answer gives",
        ));
    }
    let snap = crate::snapshots::snapshot_sandbox(&app, &caller, &id).await?;
    Ok((StatusCode::CREATED, axum::Json(snapshot_info(&snap))).into_response())
}

/// `GET /snapshots?sandboxID=&limit=&nextToken=`: the caller's snapshots, oldest first.
async fn list_snapshots(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    RawQuery(q): RawQuery,
) -> Result<Response, E2bError> {
    let (mut sandbox, mut limit, mut token) = (None, PAGE_MAX, None);
    for (k, v) in pairs(q.as_deref()) {
        match k.as_str() {
            "sandboxID" => sandbox = Some(v),
            "limit" => limit = page_limit(&v)?,
            "nextToken" => token = Some(v),
            "name" => {
                return Err(E2bError::bad_request(
                    "Locker's snapshots have no names: filter by `sandboxID` instead",
                ))
            }
            _ => {}
        }
    }
    let snaps: Vec<SnapshotRecord> = app
        .store
        .list_snapshots(&caller.tenant)
        .map_err(crate::error::ApiError::from)?
        .into_iter()
        .filter(|s| sandbox.as_ref().is_none_or(|id| *id == s.sandbox_id))
        .collect();
    let key = |s: &SnapshotRecord| {
        (
            locker_types::parse_rfc3339(&s.created_at).unwrap_or(0),
            s.id.clone(),
        )
    };
    let p = page(snaps, key, false, token.as_deref(), limit)?;
    Ok(list_answer(
        p.items.iter().map(snapshot_info).collect(),
        p.next,
    ))
}

/// `DELETE /templates/{id}`: deletes a snapshot (E2B's snapshots are templates). Locker's
/// own templates are not deleted through E2B's API.
async fn delete_snapshot(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    if !id.starts_with("snap_") {
        return Err(E2bError::not_found(format!(
            "snapshot {id} does not exist (Locker's templates are managed with `locker template`, not through E2B's API)"
        )));
    }
    crate::snapshots::remove_snapshot(&app, &caller, &id)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u64>,
}

/// `POST /sandboxes/{id}/fork`: 201 `[{"sandbox": Sandbox}]`, all or none; each child ends
/// `timeout` seconds from now (the parent's TTL when absent).
async fn fork(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
    Body(body): Body<ForkBody>,
) -> Result<Response, E2bError> {
    let timeout = body.timeout.map(ttl_of).transpose()?;
    let children =
        crate::snapshots::fork_sandbox(&app, &caller, &id, body.count.unwrap_or(1)).await?;
    let mut out = Vec::with_capacity(children.len());
    for (mut r, _live) in children {
        if let Some(t) = timeout {
            r = crate::sandboxes::set_ttl_of(&app, &caller, &r.id, t)?;
        }
        out.push(json!({"sandbox": sandbox(&app, &r, &r.template)}));
    }
    Ok((StatusCode::CREATED, axum::Json(Value::Array(out))).into_response())
}

/// `PUT /sandboxes/{id}/network`: the whole egress policy replaced (`allowOut`, `denyOut`,
/// `allow_internet_access`), 204.
async fn network(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
    Body(body): Body<NetworkConfig>,
) -> Result<StatusCode, E2bError> {
    let policy = egress_of(None, Some(&body))?;
    let r = crate::sandboxes::change_network(&app, &caller, &id, &policy).await?;
    app.store
        .update_sandbox(&r)
        .map_err(crate::error::ApiError::from)?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(v: Value) -> NetworkConfig {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn egress_maps_e2b_network_settings() {
        assert_eq!(egress_of(None, None).unwrap(), NetworkPolicy::None);
        assert_eq!(egress_of(Some(true), None).unwrap(), NetworkPolicy::All);
        assert_eq!(egress_of(Some(false), None).unwrap(), NetworkPolicy::None);
        let allow = net(json!({"allowOut": ["pypi.org", "10.0.0.0/8"], "denyOut": ["0.0.0.0/0"]}));
        assert_eq!(
            egress_of(None, Some(&allow)).unwrap(),
            NetworkPolicy::Allow(vec![json!("pypi.org"), json!("10.0.0.0/8")])
        );
        assert_eq!(
            egress_of(Some(true), Some(&allow)).unwrap(),
            NetworkPolicy::Allow(vec![json!("pypi.org"), json!("10.0.0.0/8")]),
            "denying all traffic makes allowOut an allowlist even with internet access"
        );
        let deny_all = net(json!({"denyOut": ["0.0.0.0/0"]}));
        assert_eq!(
            egress_of(Some(true), Some(&deny_all)).unwrap(),
            NetworkPolicy::None
        );
        let update = net(json!({"allow_internet_access": true}));
        assert_eq!(egress_of(None, Some(&update)).unwrap(), NetworkPolicy::All);
        let e = egress_of(None, Some(&net(json!({"denyOut": ["1.2.3.4"]})))).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("allowlists"), "{}", e.message);
        assert!(egress_of(None, Some(&net(json!({"rules": {"a": 1}})))).is_err());
    }

    #[test]
    fn template_aliases() {
        assert_eq!(template_of("base"), "default");
        assert_eq!(template_of("code-interpreter-v1"), "code-interpreter");
        assert_eq!(template_of("mine"), "mine");
    }

    #[test]
    fn pages_follow_tokens_in_both_orders() {
        let items: Vec<(i64, String)> = (0..5).map(|i| (100 + i / 2, format!("sb_{i}"))).collect();
        let key = |i: &(i64, String)| i.clone();
        let p1 = page(items.clone(), key, false, None, 2).unwrap();
        assert_eq!(p1.items.len(), 2);
        let p2 = page(items.clone(), key, false, p1.next.as_deref(), 2).unwrap();
        let p3 = page(items.clone(), key, false, p2.next.as_deref(), 2).unwrap();
        assert!(p3.next.is_none());
        let all: Vec<String> = [p1.items, p2.items, p3.items]
            .concat()
            .into_iter()
            .map(|i| i.1)
            .collect();
        assert_eq!(all, ["sb_0", "sb_1", "sb_2", "sb_3", "sb_4"]);
        let d1 = page(items.clone(), key, true, None, 3).unwrap();
        let d2 = page(items.clone(), key, true, d1.next.as_deref(), 3).unwrap();
        let all: Vec<String> = [d1.items, d2.items]
            .concat()
            .into_iter()
            .map(|i| i.1)
            .collect();
        assert_eq!(all, ["sb_4", "sb_3", "sb_2", "sb_1", "sb_0"]);
        assert!(page(items, key, false, Some("garbage"), 2).is_err());
    }

    #[test]
    fn e2b_paths() {
        assert!(is_e2b_path("/sandboxes"));
        assert!(is_e2b_path("/sandboxes/x/nope"));
        assert!(is_e2b_path("/v2/sandboxes/x"));
        assert!(is_e2b_path("/templates/x"));
        assert!(!is_e2b_path("/sandboxesx"));
        assert!(!is_e2b_path("/v1/sandboxes"));
    }
}
