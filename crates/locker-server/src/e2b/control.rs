//! E2B's control plane (`/sandboxes`, `/v2/sandboxes`, …) onto Locker's sandboxes.
//!
//! Owns: E2B's request and response shapes, `X-API-KEY`, and the mapping of E2B's fields to
//! Locker's (`templateID` aliases, `timeout` to the TTL, `envVars` to the sandbox's env,
//! `metadata`). The sandboxes themselves are `sandboxes`' and `lifecycle`'s.

use std::collections::BTreeMap;

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{delete, post};
use axum::Router;
use locker_store::SandboxRecord;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{E2bError, ENVD_VERSION};
use crate::auth::Caller;
use crate::state::AppState;
use locker_types::CreateSandbox;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/sandboxes", post(create_v1))
        .route("/v2/sandboxes", post(create_v2))
        .route("/sandboxes/{id}", delete(kill).get(info))
}

/// The caller of an E2B route: the tenant of the Locker key in `X-API-KEY`.
pub(crate) struct E2bCaller(pub Caller);

impl FromRequestParts<AppState> for E2bCaller {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, app: &AppState) -> Result<Self, E2bError> {
        let key = parts
            .headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| {
                E2bError::unauthorized("missing X-API-KEY header: set E2B_API_KEY to a Locker API key")
            })?;
        match app.store.authenticate(key) {
            Ok(Some(p)) => Ok(Self(Caller {
                tenant: p.tenant,
                key_id: p.key_id,
            })),
            Ok(None) => Err(E2bError::unauthorized("unknown or revoked API key")),
            Err(e) => Err(E2bError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("checking the API key: {e}"),
            )),
        }
    }
}

/// `NewSandbox` (v1) and `NewSandboxV2`: the fields Locker maps; the others are accepted.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

/// Locker's template for an E2B template name.
fn template_of(e2b: &str) -> String {
    match e2b {
        "base" => "default".into(),
        "code-interpreter-v1" => "code-interpreter".into(),
        other => other.into(),
    }
}

async fn create_v1(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    crate::extract::Json(body): crate::extract::Json<Value>,
) -> Result<impl IntoResponse, E2bError> {
    create(app, caller, body, 15).await
}

async fn create_v2(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    crate::extract::Json(body): crate::extract::Json<Value>,
) -> Result<impl IntoResponse, E2bError> {
    create(app, caller, body, 300).await
}

async fn create(
    app: AppState,
    caller: Caller,
    body: Value,
    default_timeout: u64,
) -> Result<impl IntoResponse, E2bError> {
    let new: NewSandbox = serde_json::from_value(body)
        .map_err(|e| E2bError::bad_request(format!("the sandbox to create: {e}")))?;
    let create = CreateSandbox {
        template: Some(template_of(&new.template_id)),
        ttl_s: Some(new.timeout.unwrap_or(default_timeout).max(1)),
        env: new.env_vars.unwrap_or_default(),
        metadata: new.metadata.unwrap_or_default(),
        ..Default::default()
    };
    let (rec, _live) = crate::sandboxes::create_sandbox(&app, &caller, create).await?;
    Ok((StatusCode::CREATED, axum::Json(sandbox(&rec, &new.template_id))))
}

/// E2B's `Sandbox` for a record.
fn sandbox(r: &SandboxRecord, template_id: &str) -> Value {
    json!({
        "templateID": template_id,
        "sandboxID": r.id,
        "clientID": "locker",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": r.preview_token,
        "domain": Value::Null,
    })
}

async fn kill(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, E2bError> {
    let r = crate::lifecycle::record_of(&app, &caller, &id)?;
    crate::lifecycle::destroy(&app, &r, "deleted").await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn info(
    State(app): State<AppState>,
    E2bCaller(caller): E2bCaller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, E2bError> {
    let r = crate::lifecycle::record_of(&app, &caller, &id)?;
    let mut v = sandbox(&r, &r.template);
    v["startedAt"] = json!(r.created_at);
    v["endAt"] = json!(r.expires_at);
    v["cpuCount"] = json!(r.cpus.ceil() as u64);
    v["memoryMB"] = json!(r.memory_mb);
    v["diskSizeMB"] = json!(r.disk_mb);
    v["state"] = json!(if r.state == locker_store::SandboxState::Paused { "paused" } else { "running" });
    v["metadata"] = json!(r.metadata);
    Ok(axum::Json(v))
}
