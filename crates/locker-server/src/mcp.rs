//! `/mcp`: Locker's MCP server (crate `locker-mcp`) over Streamable HTTP, on the API's port.
//!
//! Owns the mount only: the tools live in `locker-mcp` and reach the sandboxes through the
//! public API, here in-process through the API router itself (the same requests, paths and
//! Bearer auth as over the network, minus the socket). A request must carry a valid API key
//! before it reaches the MCP service (401 otherwise, like every `/v1` route); each tool call
//! forwards that request's own key, so a session can never act as another tenant.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::AppState;

/// `api` plus `/mcp` in front of it.
pub fn mount(app: AppState, api: Router) -> Router {
    let service = locker_mcp::http_service(Arc::new(locker_mcp::TowerApi::new(api.clone())));
    let mcp = Router::new()
        .route_service("/mcp", service)
        .layer(axum::middleware::from_fn_with_state(app, require_key));
    api.merge(mcp)
}

/// Refuses a request without a valid key before the MCP service sees it. The 401 carries
/// `WWW-Authenticate: Bearer` (RFC 6750, as MCP's authorization rules ask), so a client
/// knows which credentials to send.
async fn require_key(caller: Result<Caller, ApiError>, req: Request, next: Next) -> Response {
    if let Err(e) = caller {
        let mut resp = e.into_response();
        if resp.status() == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"locker\""),
            );
        }
        return resp;
    }
    let delete = req.method() == axum::http::Method::DELETE;
    let mut resp = next.run(req).await;
    // rmcp answers a session's DELETE with 202; clients (the Python SDK) expect 200 or 204
    // for "terminated" and warn otherwise. Nothing is pending after a DELETE: say 204.
    if delete && resp.status() == StatusCode::ACCEPTED {
        *resp.status_mut() = StatusCode::NO_CONTENT;
    }
    resp
}
