//! The dashboard (`/ui`): a page for people, over the same `/v1` API as every client.
//!
//! This room owns: serving the dashboard's assets (compiled into the binary from `ui/` at
//! the repository root, xterm.js from `ui/node_modules` when `npm ci` ran there; see
//! `build.rs`), their caching and compression, the security headers of every `/ui`
//! answer, the terminal tickets (`POST /v1/sandboxes/{id}/pty/ticket`: how a browser,
//! which cannot set headers on a WebSocket, opens the PTY without its key in a URL), and
//! the refusal of cross-site state-changing requests on the API.
//!
//! It must not touch: what the API answers (the page holds no privilege the key lacks; it
//! calls the public routes with the key in `Authorization`), sandboxes or the store.
//!
//! Caching: every asset lives under `/ui/v/{version}/…`, where the version is a hash of all
//! of them, so those answers are `immutable` and a new build changes every URL at once; the
//! page itself (`/ui`, `/ui/…`) is `no-cache` with an ETag. Assets are gzipped once, at
//! start (in the background, see [`warm`]), and sent compressed to clients that accept gzip.

use std::collections::HashMap;
use std::io::Write;
use std::sync::OnceLock;
use std::time::Duration;

use crate::ids::hex;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/ui", get(page))
        .route("/ui/", get(page))
        .route("/ui/{*rest}", get(page_or_asset))
        .route("/v1/sandboxes/{id}/pty/ticket", post(mint_ticket))
}

/// The Content-Security-Policy of every `/ui` answer: scripts and everything else from this
/// origin only, no inline script, no eval, no framing, no plugins, no forms. Inline style is
/// allowed (xterm.js sizes its rows with a `<style>` element); style cannot run code.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
img-src 'self' data:; connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; \
form-action 'none'; frame-ancestors 'none'";

/// One file of the dashboard.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    bytes: &'static [u8],
}

macro_rules! asset {
    ($name:literal, $ty:literal) => {
        Asset {
            name: $name,
            content_type: $ty,
            bytes: include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../ui/", $name)),
        }
    };
}

const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

const ASSETS: &[Asset] = &[
    asset!("app.js", "text/javascript; charset=utf-8"),
    asset!("api.js", "text/javascript; charset=utf-8"),
    asset!("dom.js", "text/javascript; charset=utf-8"),
    asset!("pages.js", "text/javascript; charset=utf-8"),
    asset!("detail.js", "text/javascript; charset=utf-8"),
    asset!("charts.js", "text/javascript; charset=utf-8"),
    asset!("style.css", "text/css; charset=utf-8"),
    asset!("icon.svg", "image/svg+xml"),
    Asset {
        name: "xterm.js",
        content_type: JS,
        bytes: include_bytes!(concat!(env!("OUT_DIR"), "/xterm.js")),
    },
    Asset {
        name: "xterm.css",
        content_type: CSS,
        bytes: include_bytes!(concat!(env!("OUT_DIR"), "/xterm.css")),
    },
];

const INDEX: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../ui/index.html"));

/// An asset (or the page) ready to send: its bytes, gzipped bytes and ETag.
struct Ready {
    content_type: &'static str,
    plain: bytes::Bytes,
    /// Empty when gzip would not make it smaller.
    gzip: bytes::Bytes,
    etag: String,
}

impl Ready {
    fn new(content_type: &'static str, plain: Vec<u8>) -> Ready {
        let digest = Sha256::digest(&plain);
        let etag = format!("\"{}\"", hex(&digest[..12]));
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        let gzip = match enc.write_all(&plain).and_then(|()| enc.finish()) {
            Ok(g) if g.len() < plain.len() => g,
            _ => Vec::new(),
        };
        Ready {
            content_type,
            plain: plain.into(),
            gzip: gzip.into(),
            etag,
        }
    }
}

/// Everything served, built once.
struct Built {
    version: String,
    page: Ready,
    assets: HashMap<&'static str, Ready>,
}

fn built() -> &'static Built {
    static BUILT: OnceLock<Built> = OnceLock::new();
    BUILT.get_or_init(|| {
        let mut h = Sha256::new();
        for a in ASSETS {
            h.update(a.name.as_bytes());
            h.update((a.bytes.len() as u64).to_le_bytes());
            h.update(a.bytes);
        }
        let version = hex(&h.finalize()[..8]);
        let xterm = if ASSETS
            .iter()
            .any(|a| a.name == "xterm.js" && !a.bytes.is_empty())
        {
            "yes"
        } else {
            "no"
        };
        let page = INDEX.replace("{{V}}", &version).replace("{{XTERM}}", xterm);
        Built {
            page: Ready::new("text/html; charset=utf-8", page.into_bytes()),
            assets: ASSETS
                .iter()
                .filter(|a| !a.bytes.is_empty())
                .map(|a| (a.name, Ready::new(a.content_type, a.bytes.to_vec())))
                .collect(),
            version,
        }
    })
}

/// Builds (and gzips) every asset now, on a thread of its own, so that the first visitor
/// does not wait for it (gzip at its best level over xterm.js takes tens of milliseconds).
pub fn warm() {
    std::thread::spawn(|| {
        built();
    });
}

/// The headers every `/ui` answer carries.
fn secure(resp: &mut Response) {
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
}

/// Whether `Accept-Encoding` takes gzip (named, and not with `q=0`).
fn takes_gzip(req: &HeaderMap) -> bool {
    let Some(v) = req
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    v.split(',').any(|e| {
        let mut parts = e.split(';').map(str::trim);
        parts.next() == Some("gzip")
            && !parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            })
    })
}

fn send(r: &Ready, req: &HeaderMap, cache: &'static str) -> Response {
    let gzip = !r.gzip.is_empty() && takes_gzip(req);
    // Each encoding is its own representation, with its own tag.
    let etag = if gzip {
        format!("{}-gz\"", r.etag.trim_end_matches('"'))
    } else {
        r.etag.clone()
    };
    let not_modified = req
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let mut resp = if not_modified {
        StatusCode::NOT_MODIFIED.into_response()
    } else if gzip {
        let mut r2 = Response::new(Body::from(r.gzip.clone()));
        r2.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        r2
    } else {
        Response::new(Body::from(r.plain.clone()))
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(r.content_type),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    if let Ok(v) = HeaderValue::from_str(&etag) {
        h.insert(header::ETAG, v);
    }
    secure(&mut resp);
    resp
}

async fn page(headers: HeaderMap) -> Response {
    send(&built().page, &headers, "no-cache")
}

async fn page_or_asset(Path(rest): Path<String>, headers: HeaderMap) -> Response {
    let Some(versioned) = rest.strip_prefix("v/") else {
        // Any other path is a page of the dashboard (its router reads the fragment).
        return page(headers).await;
    };
    let b = built();
    let (version, name) = versioned.split_once('/').unwrap_or(("", versioned));
    let Some(asset) = b.assets.get(name) else {
        let msg = if name == "xterm.js" || name == "xterm.css" {
            "the terminal (xterm.js) is not built into this binary: run `npm ci` in ui/ (scripts/setup does), then rebuild locker".to_owned()
        } else {
            format!("no dashboard asset {name:?}")
        };
        let mut resp = ApiError::not_found(msg).into_response();
        secure(&mut resp);
        return resp;
    };
    // An old page asking for an asset of another build gets this build's, uncached.
    let cache = if version == b.version {
        "public, max-age=31536000, immutable"
    } else {
        "no-cache"
    };
    send(asset, &headers, cache)
}

/// How long a terminal ticket may wait for its WebSocket.
const TICKET_TTL: Duration = Duration::from_secs(30);
/// Tickets outstanding at once (each is tiny; the cap keeps a loop of mints bounded).
const MAX_TICKETS: u64 = 10_000;
/// The WebSocket subprotocol the dashboard's terminal speaks (the PTY route's frames), and
/// the prefix of the one that carries a ticket.
pub const PTY_PROTOCOL: &str = "locker-pty";
const TICKET_PROTOCOL_PREFIX: &str = "locker-ticket.";

/// Terminal tickets (single use, short-lived) live in the store, only their SHA-256: so
/// with control replicas on one database a ticket minted through one is redeemed through
/// any, and a restart does not void them.
fn ticket_hash(ticket: &str) -> String {
    use sha2::Digest;
    locker_sys::hex::encode(&sha2::Sha256::digest(ticket.as_bytes()))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Runs a store call off the async threads.
async fn in_store<T: Send + 'static>(
    app: &AppState,
    f: impl FnOnce(&dyn locker_store::Store) -> locker_store::Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    let store = app.store.clone();
    tokio::task::spawn_blocking(move || f(store.as_ref()))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(ApiError::from)
}

/// A new ticket of `caller` for one WebSocket to `sandbox`'s PTY within [`TICKET_TTL`].
async fn mint(app: &AppState, caller: Caller, sandbox: &str) -> Result<String, ApiError> {
    let id = locker_sys::random::new_id("pt_", 32);
    let now = now_ms();
    let ttl_ms = i64::try_from(TICKET_TTL.as_millis()).unwrap_or(i64::MAX);
    let rec = locker_store::TicketRecord {
        hash: ticket_hash(&id),
        tenant: caller.tenant,
        key_id: caller.key_id,
        sandbox_id: sandbox.to_owned(),
        expires_ms: now.saturating_add(ttl_ms),
    };
    if !in_store(app, move |s| s.put_ticket(&rec, now, MAX_TICKETS)).await? {
        return Err(ApiError::quota(format!(
            "{MAX_TICKETS} terminal tickets are outstanding: use one (open its WebSocket) or wait {}s for them to expire",
            TICKET_TTL.as_secs()
        )));
    }
    Ok(id)
}

/// Takes the ticket (it is gone whatever follows) and answers its caller if it was live
/// and for `sandbox`.
async fn redeem(app: &AppState, ticket: &str, sandbox: &str) -> Result<Option<Caller>, ApiError> {
    let hash = ticket_hash(ticket);
    let now = now_ms();
    let t = in_store(app, move |s| s.take_ticket(&hash, now)).await?;
    Ok(t.filter(|t| t.sandbox_id == sandbox).map(|t| Caller {
        tenant: t.tenant,
        key_id: t.key_id,
    }))
}

async fn mint_ticket(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    // Only for a sandbox of the caller's tenant that is live here (404/409 as the PTY would).
    crate::lifecycle::live_entry(&app, &caller, &id).await?;
    ticket_answer(&app, caller, &id).await
}

/// A new terminal ticket of `caller` for sandbox `id` (which the caller may open), as
/// `POST /v1/sandboxes/{id}/pty/ticket` answers it; also the fleet router's, for a sandbox
/// on another node (the browser's handshake then comes to this server, which redeems it).
pub async fn ticket_answer(app: &AppState, caller: Caller, id: &str) -> Result<Response, ApiError> {
    let ticket = mint(app, caller, id).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({
            "ticket": ticket,
            "expires_in_s": TICKET_TTL.as_secs(),
            "protocols": [PTY_PROTOCOL, format!("{TICKET_PROTOCOL_PREFIX}{ticket}")],
        })),
    )
        .into_response())
}

/// Whether `headers` open a terminal with a ticket (a browser's handshake) rather than a key.
pub fn has_ticket(headers: &HeaderMap) -> bool {
    !headers.contains_key(header::AUTHORIZATION)
        && headers
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|p| p.trim().starts_with(TICKET_PROTOCOL_PREFIX))
}

/// The caller of the PTY route `GET /v1/sandboxes/{sandbox}/pty`: the API key in
/// `Authorization`, or else a ticket in `Sec-WebSocket-Protocol`
/// (`locker-pty, locker-ticket.pt_…`), used up here. A ticket comes from a browser, so its
/// handshake must also come from this server's own origin (no other site's page can open
/// it, even with a stolen ticket).
pub async fn pty_caller(
    app: &AppState,
    headers: &HeaderMap,
    sandbox: &str,
) -> Result<Caller, ApiError> {
    if headers.contains_key(header::AUTHORIZATION) {
        return crate::auth::caller_of(app, headers);
    }
    let ticket = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|p| p.trim().strip_prefix(TICKET_PROTOCOL_PREFIX))
        .ok_or_else(|| {
            ApiError::unauthorized(
                "missing `Authorization: Bearer <api-key>` header (a browser passes a ticket from `POST /v1/sandboxes/{id}/pty/ticket` as the WebSocket subprotocol `locker-ticket.<ticket>` instead)",
            )
        })?;
    if !same_origin(headers) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "a terminal ticket works only from a page of this server's own origin",
        ));
    }
    redeem(app, ticket, sandbox).await?.ok_or_else(|| {
        ApiError::unauthorized(
            "unknown, used or expired terminal ticket: mint a new one with `POST /v1/sandboxes/{id}/pty/ticket` (each works once, within 30 s, for its sandbox)",
        )
    })
}

/// Whether a browser's request comes from this server's own origin: its `Origin` (when
/// sent) names the same host and port as its `Host`.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let authority = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    authority.is_some_and(|a| a.eq_ignore_ascii_case(host))
}

/// Refuses a state-changing request that a browser sends on behalf of another site (a form
/// post, a cross-site `fetch`): the API's keys travel in a header no other site can set, so
/// such a request could never be authenticated anyway; this refuses it before any handler
/// runs, with a message that says why. Browsers mark the request with
/// `Sec-Fetch-Site`; older ones are judged by `Origin`. Clients that are not browsers send
/// neither and pass.
pub async fn refuse_cross_site(req: Request, next: Next) -> Response {
    let safe = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if !safe {
        let h = req.headers();
        let site = h.get("sec-fetch-site").and_then(|v| v.to_str().ok());
        let foreign = match site {
            Some(s) => !(s.eq_ignore_ascii_case("same-origin") || s.eq_ignore_ascii_case("none")),
            None => !same_origin(h),
        };
        if foreign {
            return ApiError::new(
                StatusCode::FORBIDDEN,
                "a browser request from another site (a cross-site form or fetch) may not change anything here: call the API from the dashboard (/ui) or from a client that is not a browser",
            )
            .into_response();
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn every_asset_is_served_and_the_page_names_them() {
        let b = built();
        for name in [
            "app.js",
            "api.js",
            "dom.js",
            "pages.js",
            "detail.js",
            "charts.js",
            "style.css",
        ] {
            assert!(b.assets.contains_key(name), "{name} is embedded");
            let path = format!("/ui/v/{}/{name}", b.version);
            if name == "app.js" || name == "style.css" {
                let page = String::from_utf8_lossy(&b.page.plain);
                assert!(page.contains(&path), "index.html links {path}");
            }
        }
        let page = String::from_utf8_lossy(&b.page.plain);
        assert!(
            !page.contains("{{"),
            "every placeholder of index.html is filled"
        );
        assert!(!page.contains("<script>"), "no inline script");
    }

    #[test]
    fn gzip_is_sent_only_when_taken() {
        assert!(takes_gzip(&headers(&[(
            "accept-encoding",
            "gzip, deflate, br"
        )])));
        assert!(takes_gzip(&headers(&[(
            "accept-encoding",
            "br;q=1.0, gzip;q=0.8"
        )])));
        assert!(!takes_gzip(&headers(&[("accept-encoding", "gzip;q=0")])));
        assert!(!takes_gzip(&headers(&[("accept-encoding", "identity")])));
        assert!(!takes_gzip(&headers(&[])));
    }

    #[test]
    fn same_origin_compares_host_and_port() {
        assert!(same_origin(&headers(&[("host", "127.0.0.1:7070")])));
        assert!(same_origin(&headers(&[
            ("host", "127.0.0.1:7070"),
            ("origin", "http://127.0.0.1:7070")
        ])));
        assert!(!same_origin(&headers(&[
            ("host", "127.0.0.1:7070"),
            ("origin", "http://evil.example")
        ])));
        assert!(!same_origin(&headers(&[
            ("host", "127.0.0.1:7070"),
            ("origin", "http://127.0.0.1:7071")
        ])));
        assert!(!same_origin(&headers(&[
            ("host", "127.0.0.1:7070"),
            ("origin", "null")
        ])));
    }
}
