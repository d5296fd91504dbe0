//! `DELETE /v1/templates/{name}`: removing a template from this host.
//!
//! Templates live in the host's shared cache, so only tenant `default` (the host owner's,
//! whose key `locker serve` prints) may remove one. The answer is 409 while anything of
//! this server stands on it: a sandbox (the template is the lower layer of its root) or a
//! snapshot (it restores onto it); `default` itself is refused, since creates, runs and the
//! warm pools use it. The name goes; the files go once no other name points at them.
//!
//! This room never builds templates and never touches a machine.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::delete;
use axum::Router;
use locker_runtime::template::DEFAULT_TEMPLATE;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::AppState;

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/templates/{name}", delete(remove))
}

async fn remove(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    if caller.tenant != locker_store::DEFAULT_TENANT {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "templates are shared by every tenant of this host: only tenant `default` (the host's owner) may remove one",
        ));
    }
    if name == DEFAULT_TEMPLATE {
        return Err(ApiError::conflict(
            "the template `default` is what creates and runs use when they name none, and the warm pools hold it: rebuild it with `locker template build default` rather than remove it",
        ));
    }
    let not_found = || {
        ApiError::not_found(format!(
            "template {name:?} does not exist: `locker template list` shows the templates of this host"
        ))
    };
    locker_runtime::template::validate_name(&name).map_err(|_| not_found())?;
    let t = app
        .templates
        .resolve(&name)
        .map_err(|e| ApiError::internal(format!("reading templates: {e}")))?
        .filter(|t| t.name == name)
        .ok_or_else(not_found)?;
    if let Some(user) = user_of(&app, &t.digest)? {
        return Err(ApiError::conflict(format!(
            "template {name:?} is in use by {user}: delete that first"
        )));
    }
    let (store, name2) = (app.templates.clone(), name.clone());
    tokio::task::spawn_blocking(move || store.remove(&name2, |_| false))
        .await
        .map_err(|e| ApiError::internal(format!("removing the template: {e}")))?
        .map_err(|e| ApiError::internal(format!("removing the template: {e}")))?
        .ok_or_else(not_found)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A sandbox or snapshot of any tenant of this server that stands on `digest`.
fn user_of(app: &AppState, digest: &str) -> Result<Option<String>, ApiError> {
    if let Some(s) = app
        .store
        .list_live_sandboxes()?
        .into_iter()
        .find(|s| s.template_digest == digest)
    {
        return Ok(Some(format!("sandbox {} (tenant {})", s.id, s.tenant)));
    }
    for tenant in app.store.list_tenants()? {
        if let Some(s) = app
            .store
            .list_snapshots(&tenant)?
            .into_iter()
            .find(|s| s.template_digest == digest)
        {
            return Ok(Some(format!("snapshot {} (tenant {tenant})", s.id)));
        }
    }
    Ok(None)
}
