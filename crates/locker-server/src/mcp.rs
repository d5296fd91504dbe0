//! `/mcp`: Locker's MCP server (crate `locker-mcp`) over Streamable HTTP, on the API's port.
//!
//! Owns the mount only: the tools live in `locker-mcp` and reach the sandboxes through the
//! public API, here in-process through the API router itself (the same requests, paths and
//! Bearer auth as over the network, minus the socket). A request must carry a valid API key
//! before it reaches the MCP service (401 otherwise, like every `/v1` route); each tool call
//! forwards that request's own key, so a session can never act as another tenant.

use std::sync::Arc;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;

use crate::app::AppState;
use crate::auth::Caller;

/// `api` plus `/mcp` in front of it.
pub fn mount(app: AppState, api: Router) -> Router {
    let service = locker_mcp::http_service(Arc::new(locker_mcp::TowerApi::new(api.clone())));
    let mcp = Router::new()
        .route_service("/mcp", service)
        .layer(axum::middleware::from_fn_with_state(app, require_key));
    api.merge(mcp)
}

/// Refuses a request without a valid key before the MCP service sees it.
async fn require_key(_caller: Caller, req: Request, next: Next) -> Response {
    let delete = req.method() == axum::http::Method::DELETE;
    let mut resp = next.run(req).await;
    // rmcp answers a session's DELETE with 202; clients (the Python SDK) expect 200 or 204
    // for "terminated" and warn otherwise. Nothing is pending after a DELETE: say 204.
    if delete && resp.status() == axum::http::StatusCode::ACCEPTED {
        *resp.status_mut() = axum::http::StatusCode::NO_CONTENT;
    }
    resp
}
