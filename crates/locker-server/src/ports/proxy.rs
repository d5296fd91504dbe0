//! The forwarding core of the port proxy: one request into `127.0.0.1:{port}` of a machine
//! (a socket in a jail's namespace, or the agent's tunnel: `locker_runtime::dial`), and the
//! answer back. Bodies stream both ways (never held
//! whole), upgrades (WebSocket) are relayed as raw bytes, server-sent events pass as they
//! come. What the machine answers is hostile input: a malformed response (or a head past
//! hyper's limits) is a 502, a port that accepts and never answers is cut [`ANSWER_DEADLINE`]
//! after the request's last byte (`LOCKER_PORT_ANSWER_DEADLINE_MS` overrides it), and the
//! caller's credentials (`Authorization`, Locker's token and cookie) are never forwarded.
//!
//! Two ways through, one behaviour: a request the front parsed (`front::RelayIn`) to a
//! socket in a jail's namespace is written to the machine by Locker itself and its bodies
//! are relayed ([`relayed`]); any other (upgrades, a microVM's tunnel, a request that came
//! through hyper: HTTP/2, or a connection that spoke to the API first) goes through hyper's
//! client.
//!
//! Owns one request's way through; who may ask, and which sandbox and port a request names
//! (the API path or a preview host), are decided before it, in `ports` and `ports::preview`.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::Response;
use bytes::BytesMut;
use hyper_util::rt::TokioIo;
use locker_runtime::dial::PortConn;

use super::front::{Pending, RelayIn, Relayed, RelayedBody, Upload};
use super::port_error;
use super::wire::{self, Framing};
use crate::error::ApiError;
use crate::state::Busy;

/// A request extension: the request's `Authorization` is the app's own (a preview host let
/// it in by token, cookie or public port), so it goes to the machine.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AppAuthorization;

/// How long a port may take to send its response's head, counted from the request's last
/// byte (an upload that takes minutes is not the port's silence).
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(60);

/// [`ANSWER_DEADLINE`], or `LOCKER_PORT_ANSWER_DEADLINE_MS` when it is set to a positive
/// number (read once: tests and operators with slow services set it at start).
fn answer_deadline() -> Duration {
    static DEADLINE: OnceLock<Duration> = OnceLock::new();
    *DEADLINE.get_or_init(|| {
        std::env::var("LOCKER_PORT_ANSWER_DEADLINE_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis)
            .unwrap_or(ANSWER_DEADLINE)
    })
}

/// `60 s`, or `1500 ms` where seconds would round.
fn spoken(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// When the request last moved: its start, then each chunk of its body taken for the machine.
#[derive(Clone)]
struct Progress {
    start: Instant,
    /// Milliseconds after `start`.
    last: Arc<AtomicU64>,
}

impl Progress {
    fn new() -> Self {
        Progress {
            start: Instant::now(),
            last: Arc::new(AtomicU64::new(0)),
        }
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last.load(Ordering::Relaxed))
    }
}

/// Waits for `answer` until the request has been still for `deadline`; `None` past it.
async fn within<F: Future>(
    progress: &Progress,
    deadline: Duration,
    answer: F,
) -> Option<F::Output> {
    let mut answer = pin!(answer);
    loop {
        let until = progress.last() + deadline;
        if let Ok(out) = tokio::time::timeout_at(until.into(), answer.as_mut()).await {
            return Some(out);
        }
        if progress.last() + deadline <= Instant::now() {
            return None;
        }
    }
}

/// What the server in the machine is asked for: `rest` (the request's path after the part
/// that named the sandbox and port, still percent-encoded) with the query. A `.` or `..`
/// segment (also encoded) is refused: it means nothing to the machine's server but a way
/// around a client's or a proxy's idea of the path; so is an encoded slash or backslash.
pub(crate) fn target_of(rest: &str, query: Option<&str>) -> Result<String, ApiError> {
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
    Ok(match query {
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
    // E2B's name for the same credential (`trafficAccessToken`, see `e2b`).
    headers.remove("e2b-traffic-access-token");
    // A fleet's routing of a preview request (its node read them).
    headers.remove(crate::fleet::node::PREVIEW_HEADER);
    headers.remove(crate::fleet::node::PREVIEW_KEY_HEADER);
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

/// The task driving a connection into the machine, ended when dropped unless an answer took
/// it over: a request that got an error instead (no head in time, a malformed one) must not
/// keep streaming its upload into the machine or hold its tunnel's place.
struct Connection(Option<tokio::task::AbortHandle>);

impl Connection {
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// The request as the machine gets it: to `target`, `Host: 127.0.0.1:{port}` (the caller's
/// host in `X-Forwarded-Host`), without hop-by-hop headers or Locker's credentials (the
/// app's own `Authorization` stays where a preview host let it through).
fn outgoing(
    parts: &mut axum::http::request::Parts,
    port: u16,
    target: &str,
    upgrade: bool,
) -> Result<(), ApiError> {
    let client_host = parts.headers.get(header::HOST).cloned();
    let app_auth = parts
        .extensions
        .get::<AppAuthorization>()
        .and_then(|_| parts.headers.get(header::AUTHORIZATION).cloned());
    strip(&mut parts.headers, upgrade);
    if let Some(a) = app_auth {
        parts.headers.insert(header::AUTHORIZATION, a);
    }
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
    Ok(())
}

fn deadline_passed(id: &str, port: u16, deadline: Duration) -> ApiError {
    ApiError::bad_gateway(format!(
        "port {port} in sandbox {id} accepted the request but sent no response within \
         {} of its last byte; the server there is stuck or too slow",
        spoken(deadline)
    ))
}

fn not_http(id: &str, port: u16, e: impl std::fmt::Display) -> ApiError {
    ApiError::bad_gateway(format!(
        "port {port} in sandbox {id} did not answer with valid HTTP/1: {e}"
    ))
}

/// [`forward`] for a request the front parsed ([`RelayIn`]) to a socket in the jail's
/// namespace: Locker writes the request's head to the machine itself, relays the upload in
/// a task of its own while it reads the answer's head (with the same deadline, counted from
/// the upload's last move), and answers with the head; the front then relays the answer's
/// body ([`Relayed`]). Errors before the answer's head are the same as [`forward`]'s.
#[allow(clippy::too_many_arguments)]
async fn relayed(
    live: Busy,
    id: &str,
    port: u16,
    target: &str,
    req: Request,
    machine: tokio::net::TcpStream,
    slot: locker_runtime::dial::Slot,
    front: RelayIn,
) -> Result<Response, ApiError> {
    let Some(pending) = front.take() else {
        return Err(ApiError::internal(
            "the request's connection is no longer available to the proxy",
        ));
    };
    let (mut parts, _unread) = req.into_parts();
    if let Err(e) = outgoing(&mut parts, port, target, false) {
        front.restore(pending);
        return Err(e);
    }
    // The front answered `100 Continue` itself.
    parts.headers.remove(header::EXPECT);
    wire::set_framing(&mut parts.headers, pending.framing);
    if pending.framing == Framing::Empty
        && matches!(parts.method, Method::POST | Method::PUT | Method::PATCH)
    {
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(0u64));
    }
    let head = wire::request_head(&parts.method, target, &parts.headers);
    let machine = Arc::new(machine);
    if let Err(e) = wire::write_all(&machine, &head).await {
        front.restore(pending);
        return Err(ApiError::bad_gateway(format!(
            "port {port} in sandbox {id}: {e}"
        )));
    }
    let progress = Progress::new();
    // A request without a body keeps its connection for a keep-alive after an error.
    let mut idle = None;
    let mut running = Connection(None);
    let mut task = None;
    if pending.framing == Framing::Empty {
        idle = Some(pending);
    } else {
        let to = machine.clone();
        let moved = progress.clone();
        let Pending {
            io,
            mut buf,
            framing,
        } = pending;
        let t = tokio::spawn(async move {
            wire::relay(&io, &to, &mut buf, framing, &|| moved.touch())
                .await
                .map(|()| buf)
        });
        running = Connection(Some(t.abort_handle()));
        task = Some(t);
    }
    let give_back = |idle: Option<Pending>| {
        if let Some(p) = idle {
            front.restore(p);
        }
    };
    let mut from_machine = BytesMut::with_capacity(16 * 1024);
    let deadline = answer_deadline();
    let answer = within(
        &progress,
        deadline,
        wire::read_response_head(&machine, &mut from_machine),
    )
    .await;
    let answer = match answer {
        None => {
            give_back(idle);
            return Err(deadline_passed(id, port, deadline));
        }
        Some(Err(e)) => {
            give_back(idle);
            return Err(not_http(id, port, e));
        }
        Some(Ok(a)) => a,
    };
    if answer.status == StatusCode::SWITCHING_PROTOCOLS {
        give_back(idle);
        return Err(ApiError::bad_gateway(format!(
            "port {port} in sandbox {id} switched protocols without being asked to"
        )));
    }
    let framing = match wire::response_framing(
        parts.method == Method::HEAD,
        answer.status,
        &answer.headers,
    ) {
        Ok(f) => f,
        Err(e) => {
            give_back(idle);
            return Err(not_http(id, port, e));
        }
    };
    let mut headers = answer.headers;
    strip(&mut headers, false);
    let upload = match (task, idle) {
        (Some(t), _) => Upload::Running(t),
        (None, Some(p)) => Upload::Done(p.buf),
        (None, None) => Upload::Done(BytesMut::new()),
    };
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = answer.status;
    *resp.headers_mut() = headers;
    resp.extensions_mut().insert(Relayed::new(RelayedBody {
        machine,
        buf: from_machine,
        framing,
        upload,
        guards: Box::new((live, slot)),
    }));
    running.keep();
    Ok(resp)
}

/// Carries `req` to `target` (from [`target_of`]) on `port` of the sandbox `live` holds, and
/// its answer back. `live` is the sandbox's busy guard: it is held while the answer's body
/// streams or an upgraded connection stays open, so neither is idle time.
pub(crate) async fn forward(
    live: Busy,
    id: &str,
    port: u16,
    target: String,
    mut req: Request,
) -> Result<Response, ApiError> {
    let tunnel = locker_runtime::dial::dial(&live.machine, port)
        .await
        .map_err(|e| port_error(id, port, e))?;
    // A request the front parsed, to a socket in the jail: relayed. An upgrade, a microVM's
    // tunnel, or a request that came through hyper go the way below.
    let front = req.extensions_mut().remove::<RelayIn>();
    let tunnel = match (front, tunnel) {
        (Some(front), PortConn::Tcp(machine, slot)) if !is_upgrade(req.headers()) => {
            return relayed(live, id, port, &target, req, machine, slot, front).await;
        }
        (_, tunnel) => tunnel,
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tunnel))
        .await
        .map_err(|e| ApiError::bad_gateway(format!("port {port} in sandbox {id}: {e}")))?;
    let sandbox = id.to_owned();
    let connection = Connection(Some(
        tokio::spawn(async move {
            // The connection ends with the response (or the upgrade): its error, if any, is
            // the client's to see in the response.
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(sandbox = %sandbox, port, error = %e, "port connection ended");
            }
        })
        .abort_handle(),
    ));

    let upgrade = is_upgrade(req.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    outgoing(&mut parts, port, &target, upgrade)?;
    let progress = Progress::new();
    let moved = progress.clone();
    let body = Body::new(http_body_util::BodyExt::map_frame(body, move |f| {
        moved.touch();
        f
    }));
    let out = Request::from_parts(parts, body);

    let deadline = answer_deadline();
    let mut resp = match within(&progress, deadline, sender.send_request(out)).await {
        None => return Err(deadline_passed(id, port, deadline)),
        Some(Err(e)) => return Err(not_http(id, port, e)),
        Some(Ok(r)) => r,
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
        connection.keep();
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
    connection.keep();
    Ok(Response::from_parts(parts, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_keep_the_encoded_path_and_query_and_refuse_dot_segments() {
        assert_eq!(target_of("", None).unwrap(), "/");
        assert_eq!(target_of("/", None).unwrap(), "/");
        assert_eq!(
            target_of("/a/b%20c", Some("x=1&y")).unwrap(),
            "/a/b%20c?x=1&y"
        );
        for bad in ["/../x", "/a/%2e%2E/x", "/./x", "/a%2fb", "/a%5Cb"] {
            assert!(target_of(bad, None).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_answer_deadline_counts_from_the_requests_last_move() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let deadline = Duration::from_millis(150);
            let still = Progress::new();
            let t = Instant::now();
            assert!(within(&still, deadline, std::future::pending::<()>())
                .await
                .is_none());
            assert!(t.elapsed() >= deadline);
            // A body moving for three deadlines, then the answer: served.
            let moving = Progress::new();
            let mover = moving.clone();
            let answer = async move {
                for _ in 0..9 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    mover.touch();
                }
                7
            };
            assert_eq!(within(&moving, deadline, answer).await, Some(7));
        });
        assert_eq!(spoken(Duration::from_secs(60)), "60 s");
        assert_eq!(spoken(Duration::from_millis(1500)), "1500 ms");
    }

    #[test]
    fn credentials_and_hop_headers_are_not_forwarded() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer lk_secret".parse().unwrap());
        h.insert("x-locker-token", "tok".parse().unwrap());
        h.insert("e2b-traffic-access-token", "tok".parse().unwrap());
        h.insert(header::CONNECTION, "keep-alive, x-drop".parse().unwrap());
        h.insert("x-drop", "1".parse().unwrap());
        h.insert("x-keep", "1".parse().unwrap());
        strip(&mut h, false);
        assert!(h.get(header::AUTHORIZATION).is_none());
        assert!(h.get("x-locker-token").is_none());
        assert!(h.get("e2b-traffic-access-token").is_none());
        assert!(h.get("x-drop").is_none());
        assert!(h.get(header::CONNECTION).is_none());
        assert_eq!(h.get("x-keep").unwrap(), "1");
    }
}
