//! Ports of a sandbox over HTTP: the list of what listens in the machine
//! (`GET /v1/sandboxes/{id}/ports`) and the path proxy (`ANY /v1/sandboxes/{id}/ports/{port}/…`)
//! that carries a request to `127.0.0.1:{port}` inside the machine and its answer back
//! (the forwarding itself is [`proxy`]'s).
//!
//! The way in is a tunnel of the agent channel (`locker_runtime::ports`): no route, address
//! or listener is added to the machine, so egress is unchanged and no sandbox can reach
//! another's ports by any address. A request resumes a sandbox its idle policy paused and
//! counts as activity (it goes through `live_of` like every call).
//!
//! This room owns the HTTP side only; tunnels and the port list are the runtime's.

mod proxy;

pub use proxy::ANSWER_DEADLINE;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use locker_runtime::ports::{self, PortError};
use serde_json::json;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::lifecycle::live_of;
use crate::state::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/ports", get(list))
        .route("/v1/sandboxes/{id}/ports/{port}", any(proxy_root))
        .route("/v1/sandboxes/{id}/ports/{port}/", any(proxy_root))
        .route("/v1/sandboxes/{id}/ports/{port}/{*rest}", any(proxy_rest))
}

fn port_of(raw: &str) -> Result<u16, ApiError> {
    match raw.parse::<u32>() {
        Ok(p @ 1..=65535) => Ok(p as u16),
        _ => Err(ApiError::bad_request(format!(
            "port must be a number from 1 to 65535, got {raw:?}"
        ))),
    }
}

fn port_error(id: &str, port: u16, e: PortError) -> ApiError {
    match e {
        PortError::NotListening(why) => ApiError::bad_gateway(format!(
            "nothing listens on port {port} in sandbox {id}: {why}; start a server there \
             (listening on 127.0.0.1 or 0.0.0.0) and retry"
        )),
        PortError::Unsupported => ApiError::conflict(PortError::Unsupported.to_string()),
        PortError::Agent(e) => ApiError::from(e),
    }
}

async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let live = live_of(&app, &caller, &id).await?;
    let found = ports::list(&live.machine.agent)
        .await
        .map_err(|e| port_error(&id, 0, e))?;
    let base = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(|h| format!("http://{h}"))
        .unwrap_or_default();
    let items: Vec<_> = found
        .iter()
        .map(|p| {
            json!({
                "port": p.port,
                "address": p.address,
                "process": p.process,
                "pid": p.pid,
                "public": false,
                "url": format!("{base}/v1/sandboxes/{id}/ports/{}/", p.port),
            })
        })
        .collect();
    Ok(axum::Json(json!({ "ports": items })).into_response())
}

async fn proxy_root(
    state: State<AppState>,
    caller: Caller,
    Path((id, port)): Path<(String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    proxy(state, caller, id, port, req).await
}

async fn proxy_rest(
    state: State<AppState>,
    caller: Caller,
    Path((id, port, _rest)): Path<(String, String, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    proxy(state, caller, id, port, req).await
}

async fn proxy(
    State(app): State<AppState>,
    caller: Caller,
    id: String,
    port_raw: String,
    req: Request,
) -> Result<Response, ApiError> {
    let port = port_of(&port_raw)?;
    let prefix = format!("/v1/sandboxes/{id}/ports/{port_raw}");
    let rest = req.uri().path().strip_prefix(&prefix).unwrap_or("");
    let target = proxy::target_of(rest, req.uri().query())?;
    let live = live_of(&app, &caller, &id).await?;
    proxy::forward(live, &id, port, target, req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_numbers_from_1_to_65535() {
        assert!(port_of("0").is_err());
        assert!(port_of("65536").is_err());
        assert!(port_of("x").is_err());
        assert!(port_of("-1").is_err());
        assert_eq!(port_of("65535").unwrap(), 65535);
    }
}
