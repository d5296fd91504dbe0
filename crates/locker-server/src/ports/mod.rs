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
//! Preview URLs (`{port}-{id}.{domain}`, [`preview`]) reach the same ports by host name;
//! this module also owns their settings: a port made public (`PUT …/ports/{port}`) and the
//! rotation of a sandbox's preview token (`POST …/preview-token`).
//!
//! Requests to ports are read off their connections by Locker's own HTTP/1.1 ([`front`]),
//! which relays their bodies between the client's socket and the machine's ([`wire`])
//! where both are plain sockets; HTTP/2, upgrades and microVMs' tunnels stay on hyper.
//!
//! This room owns the HTTP side only; tunnels and the port list are the runtime's.

pub(crate) mod front;
mod preview;
mod proxy;
mod wire;

pub use preview::{dispatch as preview_dispatch, PreviewDomain};
pub use proxy::ANSWER_DEADLINE;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::Router;
use locker_runtime::ports::{self, PortError};
use serde_json::json;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::Json;
use crate::lifecycle::live_of;
use crate::state::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/ports", get(list))
        .route(
            "/v1/sandboxes/{id}/ports/{port}",
            put(set_port).fallback(proxy_root),
        )
        .route("/v1/sandboxes/{id}/preview-token", post(rotate_token))
        .route("/v1/sandboxes/{id}/ports/{port}/", any(proxy_root))
        .route("/v1/sandboxes/{id}/ports/{port}/{*rest}", any(proxy_rest))
}

/// A port the API may reach: 1–65535 and not the code interpreter's own (its driver is
/// reached only through the `/code` and `/contexts` routes, whichever way a port is named).
fn port_of(raw: &str) -> Result<u16, ApiError> {
    match raw.parse::<u32>() {
        Ok(p) if crate::code::is_driver_port(p as u16) && p <= 65535 => {
            Err(ApiError::not_found(format!(
                "port {p} in a sandbox is the code interpreter's own: use the /code and \
                 /contexts routes"
            )))
        }
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
        e @ PortError::Busy(_) => ApiError::quota(format!("port {port} in sandbox {id}: {e}")),
        e @ PortError::Dial(_) => {
            ApiError::bad_gateway(format!("port {port} in sandbox {id}: {e}"))
        }
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
    let public = live
        .preview
        .read()
        .expect("preview lock")
        .public_ports
        .clone();
    let base = api_base(&headers);
    let items: Vec<_> = found
        .iter()
        .filter(|p| !crate::code::is_driver_port(p.port))
        .map(|p| {
            json!({
                "port": p.port,
                "address": p.address,
                "process": p.process,
                "pid": p.pid,
                "public": public.contains(&p.port),
                "url": port_url(&app, &base, &id, p.port),
                "proxy_url": format!("{base}/v1/sandboxes/{id}/ports/{}/", p.port),
            })
        })
        .collect();
    Ok(axum::Json(json!({ "ports": items })).into_response())
}

/// `http://{host}` of the API as the caller reached it.
fn api_base(headers: &HeaderMap) -> String {
    headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(|h| format!("http://{h}"))
        .unwrap_or_default()
}

/// The URL a person opens for `port`: the preview URL where the server has a preview
/// domain, else the path proxy's.
fn port_url(app: &AppState, base: &str, id: &str, port: u16) -> String {
    match &app.cfg.preview {
        Some(d) => d.url(id, port),
        None => format!("{base}/v1/sandboxes/{id}/ports/{port}/"),
    }
}

/// `PUT /v1/sandboxes/{id}/ports/{port}` `{"public": bool}`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PortSettings {
    public: bool,
}

async fn set_port(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, port_raw)): Path<(String, String)>,
    headers: HeaderMap,
    Json(body): Json<PortSettings>,
) -> Result<Response, ApiError> {
    let port = port_of(&port_raw)?;
    let live = crate::lifecycle::live_entry(&app, &caller, &id).await?;
    let public = {
        let mut p = live.preview.write().expect("preview lock");
        let mut ports = p.public_ports.clone();
        ports.retain(|&q| q != port);
        if body.public {
            ports.push(port);
            ports.sort_unstable();
        }
        let mut rec = app
            .store
            .get_sandbox(&caller.tenant, &id)?
            .ok_or_else(|| ApiError::not_found(format!("no sandbox {id}")))?;
        rec.public_ports = ports.clone();
        app.store.update_sandbox(&rec)?;
        p.public_ports = ports;
        body.public
    };
    let base = api_base(&headers);
    Ok(axum::Json(json!({
        "port": port,
        "public": public,
        "url": port_url(&app, &base, &id, port),
    }))
    .into_response())
}

/// `POST /v1/sandboxes/{id}/preview-token`: a new token; the old one and every cookie made
/// from it stop working at once.
async fn rotate_token(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let live = crate::lifecycle::live_entry(&app, &caller, &id).await?;
    let token = locker_store::new_preview_token();
    {
        let mut p = live.preview.write().expect("preview lock");
        let mut rec = app
            .store
            .get_sandbox(&caller.tenant, &id)?
            .ok_or_else(|| ApiError::not_found(format!("no sandbox {id}")))?;
        rec.preview_token = token.clone();
        app.store.update_sandbox(&rec)?;
        p.token = token.clone();
    }
    Ok(axum::Json(json!({
        "preview_token": token,
        "preview_url": app.cfg.preview.as_ref().map(|d| d.template(&id)),
    }))
    .into_response())
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
    // HTTP/2 names the host in the URI only; the machine's server gets it as HTTP/1's Host.
    let mut req = req;
    if !req.headers().contains_key(header::HOST) {
        if let Some(h) = req
            .uri()
            .authority()
            .and_then(|a| axum::http::HeaderValue::from_str(a.as_str()).ok())
        {
            req.headers_mut().insert(header::HOST, h);
        }
    }
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
