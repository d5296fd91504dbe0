//! Admin routes: tenants and their keys (enabled by `LOCKER_ADMIN_KEY`).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{delete, post};
use axum::Router;
use serde::Deserialize;
use serde_json::json;

use crate::auth::Admin;
use crate::error::ApiError;
use crate::extract::Json;
use crate::state::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/tenants", post(create_tenant))
        .route("/v1/tenants/{name}/keys", post(create_key))
        .route("/v1/keys/{key_id}", delete(revoke_key))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTenant {
    name: String,
}

async fn create_tenant(
    State(app): State<AppState>,
    _: Admin,
    Json(body): Json<NewTenant>,
) -> Result<impl IntoResponse, ApiError> {
    locker_store::validate_tenant_name(&body.name)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    app.store.create_tenant(&body.name)?;
    let (info, key) = app.store.create_key(&body.name)?;
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({"tenant": body.name, "api_key": key, "key_id": info.key_id})),
    ))
}

/// The body of a new key: its `format`, Locker's own (`lk_…`, the default) or E2B's
/// (`e2b_` and 40 hex digits, the shape some E2B SDK versions insist on).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NewKey {
    #[serde(default)]
    format: KeyFormat,
}

#[derive(Deserialize, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum KeyFormat {
    #[default]
    Locker,
    E2b,
}

/// A new key in E2B's shape: `e2b_` and 160 random bits as 40 hex digits.
fn new_e2b_key() -> Result<String, ApiError> {
    let mut buf = [0u8; 20];
    locker_store::fill_random(&mut buf)?;
    Ok(format!("e2b_{}", locker_sys::hex::encode(&buf)))
}

async fn create_key(
    State(app): State<AppState>,
    _: Admin,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let body: NewKey = if body.iter().all(u8::is_ascii_whitespace) {
        NewKey::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::bad_request(format!(
                "the new key: {e} (send {{}} or {{\"format\": \"e2b\"}})"
            ))
        })?
    };
    if !app.store.tenant_exists(&name)? {
        return Err(ApiError::not_found(format!("tenant {name} does not exist")));
    }
    let (info, key) = match body.format {
        KeyFormat::Locker => app.store.create_key(&name)?,
        KeyFormat::E2b => {
            let key = new_e2b_key()?;
            (app.store.add_key_with_secret(&name, &key)?, key)
        }
    };
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({"tenant": name, "api_key": key, "key_id": info.key_id})),
    ))
}

async fn revoke_key(
    State(app): State<AppState>,
    _: Admin,
    Path(key_id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    if app.store.revoke_key(&key_id)? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("key {key_id} does not exist")))
    }
}
