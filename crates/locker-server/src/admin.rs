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

async fn create_key(
    State(app): State<AppState>,
    _: Admin,
    Path(name): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    if !app.store.tenant_exists(&name)? {
        return Err(ApiError::not_found(format!("tenant {name} does not exist")));
    }
    let (info, key) = app.store.create_key(&name)?;
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
