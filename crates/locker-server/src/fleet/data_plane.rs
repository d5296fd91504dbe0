//! The router's other doors (`FLEET.md` §4.2 "Data plane"): requests that name a sandbox
//! by something other than their path, for a sandbox on another node.
//!
//! [`dispatch`] runs in front of the preview hosts and E2B's surfaces on a control plane
//! (`--fleet-listen`), for a sandbox this server does not run and whose placement names
//! another node (a joined node, or another replica's `--node local`):
//! - a **preview host** (`{port}-{id}.{domain}`): the request goes to the node as it came,
//!   its target (sandbox, port, scheme, host) in `node::PREVIEW_HEADER` (the node may have
//!   no preview domain of its own). The node admits it by the sandbox's preview token,
//!   cookie or public port, as one host does; a Locker API key is checked here (nodes hold
//!   no keys), taken off, and vouched for with `node::PREVIEW_KEY_HEADER`; an app's own
//!   `Authorization` crosses in `node::APP_AUTH_HEADER`;
//! - **E2B's data plane** (`E2b-Sandbox-Id`): the request goes as it came; the node checks
//!   the sandbox's access token;
//! - **E2B's calls about one sandbox** (`/sandboxes/{id}/…`, `/v2/sandboxes/{id}/connect`):
//!   `X-API-KEY` is checked here and the call goes with its tenant, as the API's own do;
//!   a snapshot stays on the node and is recorded, and a fork's children are placed, as
//!   the API's are (`route`'s `snapshots`; a fork of this server's own sandbox too).
//!
//! - **E2B's `/files` calls that name their sandbox only by its access token or a signed
//!   URL** (older JavaScript SDKs; `download_url`, `upload_url`): when no sandbox of this
//!   server's has that token, the sandbox is looked for among the placed ones by the token
//!   their views hold (the view is read again after a rotation through the API) and the
//!   call goes to its node, which checks token or signature itself.
//!
//! Everything else (a sandbox this server runs, one nobody placed, a caller whose key does
//! not name the sandbox's tenant) goes on to this server's own handlers, which answer as one
//! host does.

use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use locker_store::PlacementState;

use super::node::{Forwarded, APP_AUTH_HEADER, PREVIEW_HEADER, PREVIEW_KEY_HEADER};
use super::route::{self, Extra};
use crate::e2b::E2bError;
use crate::error::ApiError;
use crate::state::AppState;

/// What a request names a sandbox by.
enum Door {
    /// A preview host: its port, and the host as the client wrote it.
    Preview {
        port: u16,
        authority: String,
        https: bool,
    },
    /// `E2b-Sandbox-Id`.
    E2bData,
    /// E2B's REST calls about one sandbox.
    E2bControl,
}

impl Door {
    fn is_e2b(&self) -> bool {
        !matches!(self, Door::Preview { .. })
    }

    /// An error in the shape the door's clients parse.
    fn error(&self, status: StatusCode, message: String) -> Response {
        if self.is_e2b() {
            E2bError::new(status, message).into_response()
        } else {
            ApiError::new(status, message).into_response()
        }
    }
}

/// The sandbox and door of `req`, if it names a sandbox other than by `/v1/sandboxes/{id}`.
fn door_of(app: &AppState, req: &Request) -> Option<(String, Door)> {
    if let Some(domain) = app.cfg.preview.as_ref() {
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str())
            .or_else(|| req.headers().get(header::HOST)?.to_str().ok());
        // A host that is not a well-formed preview host is the preview door's to refuse.
        if let Some(Ok((id, port))) = authority.and_then(|a| domain.target(a)) {
            let door = Door::Preview {
                port,
                authority: authority.unwrap_or_default().to_owned(),
                https: domain.is_https(),
            };
            return Some((id, door));
        }
    }
    if let Some(id) = req
        .headers()
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        return Some((id.to_owned(), Door::E2bData));
    }
    let path = req.uri().path();
    let rest = path
        .strip_prefix("/sandboxes/")
        .or_else(|| path.strip_prefix("/v2/sandboxes/"))?;
    let (id, sub) = rest.split_once('/').unwrap_or((rest, ""));
    if id.is_empty() || (path.starts_with("/v2/") && sub != "connect") {
        return None;
    }
    Some((id.to_owned(), Door::E2bControl))
}

/// The middleware (see the module doc).
pub async fn dispatch(State(app): State<AppState>, req: Request, next: Next) -> Response {
    if app.fleet.is_none() || req.extensions().get::<Forwarded>().is_some() {
        return next.run(req).await;
    }
    let found = match door_of(&app, &req) {
        Some(d) => Some(d),
        None => match files_call(&req) {
            Some(call) => files_owner(&app, call).await.map(|id| (id, Door::E2bData)),
            None => None,
        },
    };
    let Some((id, door)) = found else {
        return next.run(req).await;
    };
    // E2B's fork places its children, this server's own sandbox's too.
    let fork = matches!(door, Door::E2bControl)
        && req.method() == axum::http::Method::POST
        && req.uri().path() == format!("/sandboxes/{id}/fork");
    // After a stall, this server's sandboxes are known after its node's next beat.
    if let Err(e) = app.awake.wait_open().await {
        return door.error(e.status, e.message);
    }
    if !fork && app.live.read().await.contains_key(&id) {
        return next.run(req).await;
    }
    let route = match route::route_of(&app, &id).await {
        Ok(Some(r)) if !r.local || fork => r,
        Ok(_) => return next.run(req).await,
        Err(e) => return door.error(e.status, e.message),
    };
    let mut req = req;
    let mut extra = Vec::new();
    match &door {
        Door::Preview {
            port,
            authority,
            https,
        } => {
            let scheme = if *https { "https" } else { "http" };
            extra.push(header_pair(
                PREVIEW_HEADER,
                &format!("{id} {port} {scheme} {authority}"),
            ));
            // The tenant's key is Locker's: checked here, never sent on. Anything else in
            // `Authorization` is the app's own.
            let key = crate::auth::caller_of(&app, req.headers());
            if let Some(auth) = req.headers_mut().remove(header::AUTHORIZATION) {
                match key {
                    Ok(c) if c.tenant == route.tenant() => {
                        extra.push(header_pair(PREVIEW_KEY_HEADER, "1"))
                    }
                    _ => extra.push((HeaderName::from_static(APP_AUTH_HEADER), auth)),
                }
            }
            // The page's own headers are the app's to read (control's API checks them
            // against its own origin, which the preview host is not).
            for name in [header::ORIGIN, header::REFERER] {
                if let Some(v) = req.headers().get(&name) {
                    extra.push((name, v.clone()));
                }
            }
            for name in [
                "sec-fetch-site",
                "sec-fetch-mode",
                "sec-fetch-dest",
                "x-api-key",
            ] {
                if let Some(v) = req.headers().get(name) {
                    extra.push((HeaderName::from_static(name), v.clone()));
                }
            }
        }
        Door::E2bData => {}
        Door::E2bControl => {
            // A caller of another tenant (or none) gets the handlers' answer: not found, or
            // not authorized.
            match crate::e2b::api_key_caller(&app, req.headers()) {
                Ok(c) if c.tenant == route.tenant() => {}
                _ => return next.run(req).await,
            }
        }
    }
    if route.state == PlacementState::Lost {
        return door.error(
            StatusCode::GONE,
            format!(
                "sandbox {id} was lost with its node ({}): the node was declared dead or \
                 removed; delete it, and create another",
                route.node_id()
            ),
        );
    }
    if fork && route.state == PlacementState::Placed {
        return route::e2b_shaped(route::fork(&app, &route, &id, req, next).await).await;
    }
    if route.local {
        return next.run(req).await;
    }
    // E2B's kill: its placement is given back at once, as the API's delete does.
    let kill = matches!(door, Door::E2bControl)
        && req.method() == axum::http::Method::DELETE
        && req.uri().path() == format!("/sandboxes/{id}");
    // E2B's calls that change the sandbox's TTL or state answer no sandbox: the listed
    // view is read again from the node after them.
    let changes_view =
        matches!(door, Door::E2bControl)
            && req.method() == axum::http::Method::POST
            && req.uri().path().rsplit_once('/').is_some_and(|(_, last)| {
                matches!(last, "timeout" | "pause" | "resume" | "connect")
            });
    let placement = route.placement().to_owned();
    req.extensions_mut().insert(Extra(extra));
    let e2b_control = matches!(door, Door::E2bControl);
    let snapshot = e2b_control
        && req.method() == axum::http::Method::POST
        && req.uri().path() == format!("/sandboxes/{id}/snapshots");
    let mut resp = if snapshot {
        route::e2b_shaped(route::snapshot(&app, &route, &id, req).await).await
    } else {
        route::forward(&app, route, &id, req).await
    };
    if e2b_control {
        // E2B's `domain` is this server's preview domain, not the node's.
        resp = route::localized_answer(&app, resp).await;
    }
    if kill && (resp.status().is_success() || resp.status() == StatusCode::NOT_FOUND) {
        super::placement::unplace(&app, &placement).await;
    } else if changes_view && resp.status().is_success() {
        route::refresh_view(&app, &id).await;
    }
    resp
}

/// The sandbox on another node that an E2B `/files` call without `E2b-Sandbox-Id` is for,
/// by its `X-Access-Token` or its URL's signature (see the module doc); `None` for any other
/// call, and for one this server's own sandboxes answer.
async fn files_owner(app: &AppState, call: FilesCall) -> Option<String> {
    let FilesCall {
        token,
        signed,
        method,
    } = call;
    // This server's own sandboxes are E2B's door's to find.
    let here = match (&token, &signed) {
        (Some(t), _) => crate::e2b::sandbox_of_token(app, t).await,
        (None, Some(q)) => crate::e2b::sandbox_of_signature(app, &method, q).await,
        (None, None) => return None,
    };
    if here.is_some() {
        return None;
    }
    let store = app.store.clone();
    let placed = tokio::task::spawn_blocking(move || store.list_placements(None, None))
        .await
        .ok()?
        .ok()?;
    let tokens = placed.into_iter().filter_map(|p| {
        let id = p.sandbox_id.filter(|_| p.state == PlacementState::Placed)?;
        let view: serde_json::Value = serde_json::from_str(&p.view).ok()?;
        Some((id, view["preview_token"].as_str()?.to_owned()))
    });
    match (token, signed) {
        (Some(t), _) => tokens
            .filter(|(_, own)| crate::auth::constant_time_eq(own.as_bytes(), t.as_bytes()))
            .map(|(id, _)| id)
            .next(),
        (None, Some(q)) => crate::e2b::signed_by(&method, &q, tokens),
        (None, None) => None,
    }
}

/// What [`files_owner`] reads of a request (taken before any wait: a request is not
/// `Sync`).
struct FilesCall {
    token: Option<String>,
    signed: Option<String>,
    method: axum::http::Method,
}

/// An E2B `/files` call without `E2b-Sandbox-Id` that carries a token or a signature.
fn files_call(req: &Request) -> Option<FilesCall> {
    if req.uri().path() != "/files" || req.headers().contains_key("e2b-sandbox-id") {
        return None;
    }
    let token = req
        .headers()
        .get("x-access-token")
        .and_then(|v| v.to_str().ok())
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty());
    let signed = req
        .uri()
        .query()
        .filter(|q| q.contains("signature="))
        .map(str::to_owned);
    (token.is_some() || signed.is_some()).then(|| FilesCall {
        token,
        signed,
        method: req.method().clone(),
    })
}

fn header_pair(name: &'static str, value: &str) -> (HeaderName, HeaderValue) {
    (
        HeaderName::from_static(name),
        HeaderValue::from_str(value).unwrap_or_else(|_| HeaderValue::from_static("")),
    )
}
