//! Ports of a sandbox over HTTP: the list of what listens in the machine
//! (`GET /v1/sandboxes/{id}/ports`) and the path proxy (`ANY /v1/sandboxes/{id}/ports/{port}/…`)
//! that carries a request to `127.0.0.1:{port}` inside the machine and its answer back:
//! bodies streamed both ways (never held whole), WebSocket and other upgrades relayed as raw
//! bytes, server-sent events as they come.
//!
//! The way in is a tunnel of the agent channel (`locker_runtime::ports`): no route, address
//! or listener is added to the machine, so egress is unchanged and no sandbox can reach
//! another's ports by any address. What the machine answers is hostile input: a malformed
//! response is a 502, a port that accepts and never answers is cut after
//! [`ANSWER_DEADLINE`], and the caller's credentials (`Authorization`, Locker's token) are
//! never forwarded into the machine. A request resumes a sandbox its idle policy paused and
//! counts as activity (it goes through `live_of` like every call).
//!
//! This room owns the HTTP side only; tunnels and the port list are the runtime's.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use hyper_util::rt::TokioIo;
use locker_runtime::ports::{self, PortError};
use serde_json::json;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::lifecycle::live_of;
use crate::state::AppState;

/// How long a port may take to send its response's head.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(60);

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
        .filter(|p| !crate::code::is_driver_port(p.port))
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

/// The part of the request's path after `/ports/{port}`, still percent-encoded, with its
/// query: what the server in the machine is asked for. A `.` or `..` segment (also
/// encoded) is refused: it means nothing to the machine's server but a way around a
/// client's or a proxy's idea of the path.
fn target_of(uri: &Uri, id: &str, port: &str) -> Result<String, ApiError> {
    let prefix = format!("/v1/sandboxes/{id}/ports/{port}");
    let rest = uri.path().strip_prefix(&prefix).unwrap_or("");
    let rest = if rest.is_empty() { "/" } else { rest };
    for seg in rest.split('/') {
        let decoded = seg.replace("%2e", ".").replace("%2E", ".");
        if decoded == "." || decoded == ".." {
            return Err(ApiError::bad_request(
                "the path may not contain `.` or `..` segments",
            ));
        }
        if seg.contains("%2f") || seg.contains("%2F") || seg.contains("%5c") || seg.contains("%5C")
        {
            return Err(ApiError::bad_request(
                "the path may not contain encoded slashes",
            ));
        }
    }
    Ok(match uri.query() {
        Some(q) => format!("{rest}?{q}"),
        None => rest.to_owned(),
    })
}

/// Headers that belong to one hop (RFC 9110 7.6.1), and the caller's credentials.
fn strip(headers: &mut HeaderMap, keep_upgrade: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .filter(|n| !(keep_upgrade && n == header::UPGRADE))
        .collect();
    for n in named {
        headers.remove(n);
    }
    for n in [
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
        header::AUTHORIZATION,
    ] {
        headers.remove(n);
    }
    headers.remove("keep-alive");
    headers.remove("x-locker-token");
    if !keep_upgrade {
        headers.remove(header::CONNECTION);
        headers.remove(header::UPGRADE);
    }
}

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
}

async fn proxy(
    State(app): State<AppState>,
    caller: Caller,
    id: String,
    port_raw: String,
    mut req: Request,
) -> Result<Response, ApiError> {
    let port = port_of(&port_raw)?;
    if crate::code::is_driver_port(port) {
        return Err(ApiError::not_found(format!(
            "port {port} in a sandbox is the code interpreter's own: use the /code and /contexts routes"
        )));
    }
    let target = target_of(req.uri(), &id, &port_raw)?;
    let live = live_of(&app, &caller, &id).await?;
    let tunnel = ports::connect(&live.machine.agent, port)
        .await
        .map_err(|e| port_error(&id, port, e))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tunnel))
        .await
        .map_err(|e| ApiError::bad_gateway(format!("port {port} in sandbox {id}: {e}")))?;
    let sandbox = id.clone();
    tokio::spawn(async move {
        // The connection ends with the response (or the upgrade): its error, if any, is the
        // client's to see in the response.
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(sandbox = %sandbox, port, error = %e, "port connection ended");
        }
    });

    let upgrade = is_upgrade(req.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let client_host = parts.headers.get(header::HOST).cloned();
    strip(&mut parts.headers, upgrade);
    parts.uri = target
        .parse()
        .map_err(|_| ApiError::bad_request("the path is not a valid URI"))?;
    parts.version = axum::http::Version::HTTP_11;
    if let Ok(h) = HeaderValue::from_str(&format!("127.0.0.1:{port}")) {
        parts.headers.insert(header::HOST, h);
    }
    if let Some(h) = client_host {
        parts.headers.insert("x-forwarded-host", h);
    }
    let out = Request::from_parts(parts, body);

    let answered = tokio::time::timeout(ANSWER_DEADLINE, sender.send_request(out)).await;
    let mut resp = match answered {
        Err(_) => {
            return Err(ApiError::bad_gateway(format!(
                "port {port} in sandbox {id} accepted the request but sent no response within {} s",
                ANSWER_DEADLINE.as_secs()
            )))
        }
        Ok(Err(e)) => {
            return Err(ApiError::bad_gateway(format!(
                "port {port} in sandbox {id} did not answer with valid HTTP/1: {e}"
            )))
        }
        Ok(Ok(r)) => r,
    };

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return Err(ApiError::bad_gateway(format!(
                "port {port} in sandbox {id} switched protocols without being asked to"
            )));
        };
        let machine_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            // An open WebSocket is a call in flight: the idle policy leaves the sandbox
            // running until it closes.
            let _busy = live;
            let (Ok(client), Ok(machine)) = (client_upgrade.await, machine_upgrade.await) else {
                return;
            };
            let mut client = TokioIo::new(client);
            let mut machine = TokioIo::new(machine);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut machine).await;
        });
        let (mut parts, _) = resp.into_parts();
        strip(&mut parts.headers, true);
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = resp.into_parts();
    strip(&mut parts.headers, false);
    // The busy guard lives as long as the body streams (the closure owns it): a download
    // keeps the sandbox active.
    let body = Body::new(http_body_util::BodyExt::map_err(body, move |e| {
        let _ = &live;
        e
    }));
    Ok(Response::from_parts(parts, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_keep_the_encoded_path_and_query_and_refuse_dot_segments() {
        let t = |u: &str| target_of(&u.parse().unwrap(), "sb_1", "8000");
        assert_eq!(t("/v1/sandboxes/sb_1/ports/8000").unwrap(), "/");
        assert_eq!(t("/v1/sandboxes/sb_1/ports/8000/").unwrap(), "/");
        assert_eq!(
            t("/v1/sandboxes/sb_1/ports/8000/a/b%20c?x=1&y").unwrap(),
            "/a/b%20c?x=1&y"
        );
        for bad in [
            "/v1/sandboxes/sb_1/ports/8000/../x",
            "/v1/sandboxes/sb_1/ports/8000/a/%2e%2E/x",
            "/v1/sandboxes/sb_1/ports/8000/./x",
            "/v1/sandboxes/sb_1/ports/8000/a%2fb",
        ] {
            assert!(t(bad).is_err(), "{bad}");
        }
        assert!(port_of("0").is_err());
        assert!(port_of("65536").is_err());
        assert!(port_of("x").is_err());
        assert_eq!(port_of("65535").unwrap(), 65535);
    }

    #[test]
    fn credentials_and_hop_headers_are_not_forwarded() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer lk_secret".parse().unwrap());
        h.insert("x-locker-token", "tok".parse().unwrap());
        h.insert(header::CONNECTION, "keep-alive, x-drop".parse().unwrap());
        h.insert("x-drop", "1".parse().unwrap());
        h.insert("x-keep", "1".parse().unwrap());
        strip(&mut h, false);
        assert!(h.get(header::AUTHORIZATION).is_none());
        assert!(h.get("x-locker-token").is_none());
        assert!(h.get("x-drop").is_none());
        assert!(h.get(header::CONNECTION).is_none());
        assert_eq!(h.get("x-keep").unwrap(), "1");
    }
}
