//! E2B compatibility: E2B's own SDKs (Python `e2b`, `e2b-code-interpreter`; npm `e2b`,
//! `@e2b/code-interpreter`) run unmodified against Locker with `E2B_API_URL` and
//! `E2B_SANDBOX_URL` set to Locker's URL and `E2B_API_KEY` to a Locker key.
//!
//! Owns: E2B's wire protocol, translated onto Locker's own rooms. The control plane
//! ([`control`]: `/sandboxes`, `/v2/sandboxes`, `/snapshots`, …) becomes `sandboxes`,
//! `lifecycle` and `snapshots` calls; the data plane of a sandbox (envd on port 49983:
//! [`envd`]; the code interpreter on 49999: [`interp`]) becomes `exec`, `processes`,
//! `files` and `code` calls. Each E2B call so gets Locker's limits, quotas, call records
//! and egress policy.
//!
//! Must not: keep a second engine or state of its own that Locker's rooms already keep
//! (sandboxes, processes, files, contexts live where they always do), or run E2B's envd or
//! code-interpreter server inside machines.
//!
//! Routing ([`dispatch`], in front of the API): a request that names a sandbox with
//! `E2b-Sandbox-Id` (and `E2b-Sandbox-Port`, 49983 when absent) belongs to the data plane,
//! whatever its path; so does a `/files` request without it that carries a sandbox's access
//! token (older JavaScript SDKs) or a signature made with it (signed URLs on
//! `E2B_SANDBOX_URL`), and a request to the preview host of port 49983 or 49999
//! ([`serve_host`]). A data-plane request is let through by the sandbox's
//! `envdAccessToken` (`X-Access-Token`), which is the sandbox's preview token: one secret
//! per sandbox, rotated together (`POST /v1/sandboxes/{id}/preview-token`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;

use crate::auth::{constant_time_eq, Caller};
use crate::state::{AppState, Live};

mod control;
mod envd;
mod error;
mod interp;

pub(crate) use control::{api_key_caller, placement_spec};
pub(crate) use envd::{sandbox_of_signature, signed_by};
pub use error::E2bError;

/// The envd port of E2B's sandboxes.
pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port.
pub const INTERP_PORT: u16 = 49999;
/// The envd version create and connect advertise: the SDKs turn features on by it, so it
/// names the newest version whose features Locker really serves.
pub const ENVD_VERSION: &str = "0.6.4";

/// The control plane's routes (E2B's REST API, authenticated by `X-API-KEY`).
pub fn routes() -> Router<AppState> {
    control::routes()
}

/// Whether sandbox `live` went while one of its streams ran (deleted, past its TTL, or
/// failed: in each case it is no longer live here). Such a stream is cut, as E2B's proxy
/// drops the streams of a sandbox that went; the SDKs then probe `/health` (502) and say the
/// sandbox was killed (the JavaScript SDK probes only for a cut connection).
async fn went(app: &AppState, live: &Live) -> bool {
    !app.live.read().await.contains_key(&live.id)
}

/// A data-plane request's sandbox, found and let through.
#[derive(Clone)]
pub(crate) struct Target {
    pub live: Arc<Live>,
    /// The sandbox's tenant, as Locker's rooms take a caller.
    pub caller: Caller,
    /// 49983 (envd), 49999 (code interpreter) or a port of the machine.
    pub port: u16,
    /// Whether the request carried the sandbox's access token (`/health` and signed `/files`
    /// URLs need none; everything else does).
    pub authorized: bool,
}

/// Middleware in front of every route: a request for a sandbox's data plane goes there,
/// any other on to the API.
pub async fn dispatch(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let id = match header_str(req.headers(), "e2b-sandbox-id") {
        Some(id) => id.to_owned(),
        None => {
            // Only what the lookup needs: a request is not `Sync`, so no borrow of it may
            // be held across the lookup's await.
            let files = req.uri().path() == "/files";
            let token = files
                .then(|| header_str(req.headers(), "x-access-token").map(str::to_owned))
                .flatten();
            // A signed URL on `E2B_SANDBOX_URL` names neither the sandbox nor its token.
            let signed = (files && token.is_none())
                .then(|| req.uri().query().map(str::to_owned))
                .flatten()
                .filter(|q| q.contains("signature="));
            let method = req.method().clone();
            let found = match (token, signed) {
                (Some(t), _) => sandbox_of_token(&app, &t).await,
                (None, Some(q)) => envd::sandbox_of_signature(&app, &method, &q).await,
                (None, None) => None,
            };
            match found {
                Some(id) => id,
                None => return next.run(req).await,
            }
        }
    };
    let port = match header_str(req.headers(), "e2b-sandbox-port") {
        None => ENVD_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => {
                return E2bError::bad_request(format!(
                    "E2b-Sandbox-Port {p:?} is not a port number (1-65535)"
                ))
                .into_response()
            }
        },
    };
    match target(&app, &id, port, req.headers()).await {
        Ok(t) => serve(app, t, req).await,
        Err(e) => e.into_response(),
    }
}

/// The sandbox whose access token is `token`, for a `/files` request without routing
/// headers: some JavaScript SDK versions sent envd's `/files` requests without
/// `E2b-Sandbox-Id` (E2B issue #1158). A token names exactly one sandbox; a request with
/// none (or another) goes on to the API as before.
pub(crate) async fn sandbox_of_token(app: &AppState, token: &str) -> Option<String> {
    let live = app.live.read().await;
    live.values()
        .find(|l| {
            let own = l.preview.read().expect("preview lock").token.clone();
            !own.is_empty() && constant_time_eq(own.as_bytes(), token.as_bytes())
        })
        .map(|l| l.id.clone())
}

/// The data plane of one sandbox: envd, the code interpreter, or a port of the machine.
async fn serve(app: AppState, t: Target, req: Request) -> Response {
    match t.port {
        ENVD_PORT => envd::serve(app, t, req).await,
        INTERP_PORT => interp::serve(app, t, req).await,
        _ => E2bError::bad_request(format!(
            "E2b-Sandbox-Port {}: only envd (49983) and the code interpreter (49999) are \
             served through E2B_SANDBOX_URL; reach other ports with get_host()",
            t.port
        ))
        .into_response(),
    }
}

/// Whether `port` is one E2B's SDKs reach a sandbox's own services on (envd, the code
/// interpreter): a preview host for it is served here, not proxied to the machine.
pub fn is_e2b_port(port: u16) -> bool {
    port == ENVD_PORT || port == INTERP_PORT
}

/// A request to the preview host `{port}-{id}.{domain}` of envd's or the code interpreter's
/// port (E2B's SDKs without `E2B_SANDBOX_URL`, and every signed `/files` URL).
pub async fn serve_host(app: AppState, id: &str, port: u16, req: Request) -> Response {
    match target(&app, id, port, req.headers()).await {
        Ok(t) => serve(app, t, req).await,
        Err(e) => e.into_response(),
    }
}

/// The answer for a path no route serves, when it lies under E2B's control-plane prefixes:
/// a 404 in E2B's shape (the SDKs parse every error body). `None` for Locker's own paths.
pub fn unknown_route(path: &str) -> Option<Response> {
    control::is_e2b_path(path)
        .then(|| E2bError::not_found(format!("no such E2B route: {path}")).into_response())
}

/// Finds sandbox `id` on this server and checks the request's access token against it.
async fn target(
    app: &AppState,
    id: &str,
    port: u16,
    headers: &HeaderMap,
) -> Result<Target, E2bError> {
    let live = app.live.read().await.get(id).cloned();
    let live = live.ok_or_else(|| sandbox_not_found(id))?;
    let token = live.preview.read().expect("preview lock").token.clone();
    let authorized = header_str(headers, "x-access-token")
        .is_some_and(|t| !token.is_empty() && constant_time_eq(t.as_bytes(), token.as_bytes()));
    let caller = Caller {
        tenant: live.tenant.clone(),
        key_id: "e2b-access-token".into(),
    };
    Ok(Target {
        live,
        caller,
        port,
        authorized,
    })
}

/// What E2B's proxy answers a data-plane request for a sandbox it does not find running
/// (killed, past its timeout, never made): 502 with "… was not found". The SDKs read it
/// as "not running": `is_running()` is `False`, and a request that failed in flight
/// becomes their `SandboxNotRunningException`, where a 404 would be an error of envd's.
pub(crate) fn sandbox_not_found(id: &str) -> E2bError {
    E2bError::new(
        axum::http::StatusCode::BAD_GATEWAY,
        format!("The sandbox {id} was not found: it was killed or reached its timeout"),
    )
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}
