//! Locker's own HTTP/1.1 for the port routes, in front of hyper. Every accepted connection
//! is read here first. A request that names a port of a sandbox (the path proxy
//! `/v1/sandboxes/{id}/ports/{port}/…`, or a preview host) is parsed here and goes through
//! the same router as any other request (auth, wake on request, limits and error answers stay
//! the router's), but its connection stays here: when the proxy reaches the port by a socket
//! in the jail's namespace, the bodies then move between the two sockets in large reads
//! and writes ([`super::wire`]), which hyper's server cannot do (it never hands out the
//! client's socket for an answer that is not an upgrade). Other answers (errors, redirects, a
//! microVM's port through the agent's tunnel) are written here from their body, like hyper
//! would.
//!
//! Everything else goes to hyper (axum's server, through [`Handoff`]) with the bytes read so
//! far, and stays there for the rest of the connection: HTTP/2, upgrades (WebSockets, also
//! to a port), HTTP/1.0, the API's other routes, a head this parser does not take (hyper
//! gives its own 400).
//!
//! Owns the connections it accepts until it hands them over; never decides who may reach a
//! port (the router does) nor how a port is reached (`proxy`).

use std::future::poll_fn;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, Version};
use axum::response::Response;
use axum::Router;
use bytes::{Buf, Bytes, BytesMut};
use futures_util::FutureExt;
use http_body_util::BodyExt;
use hyper::body::{Body as _, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};

use super::wire::{self, Chunked, Framing, Step};
use crate::state::AppState;

/// The largest request head read here; a larger one goes to hyper, which refuses it.
const MAX_REQUEST_HEAD: usize = 64 * 1024;

/// How long a started request head may pause between reads.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a kept-alive connection may wait for its next request.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// The most of an unread request body read and dropped to keep its connection.
const DRAIN_MAX: u64 = 256 * 1024;

/// How long an upload may take to finish once its answer has been sent.
const UPLOAD_GRACE: Duration = Duration::from_secs(1);

/// How long a closing connection reads what its client still sends, so that the client
/// reads the answer before a reset.
const LINGER: Duration = Duration::from_secs(2);

/// Accepts on `listener`: port requests are served here, the rest is handed to axum's
/// server through the [`Handoff`] returned (pass it to `axum::serve` with the same
/// `router`). Stops accepting, and closes idle connections, when `quit` turns true; the
/// returned [`Open`] tells when the connections served here have all ended.
pub fn listen(
    listener: TcpListener,
    router: Router,
    app: AppState,
    quit: watch::Receiver<bool>,
) -> io::Result<(Handoff, Open)> {
    let local = listener.local_addr()?;
    let (to_hyper, rx) = mpsc::unbounded_channel();
    let open = Open::default();
    let front = Arc::new(Front {
        router,
        app,
        to_hyper,
        quit: quit.clone(),
    });
    let counter = open.clone();
    let mut quit = quit;
    tokio::spawn(async move {
        loop {
            let (io, addr) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        accept_error(e).await;
                        continue;
                    }
                },
                () = quitting(&mut quit) => break,
            };
            // Streamed answers are many small writes: without TCP_NODELAY the second waits
            // for the client's delayed ACK (~40 ms).
            if let Err(e) = io.set_nodelay(true) {
                tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection");
            }
            let guard = counter.enter();
            tokio::spawn(connection(front.clone(), io, addr, guard));
        }
    });
    Ok((Handoff { rx, local }, open))
}

/// Resolves once `quit` is true (or its sender is gone).
async fn quitting(quit: &mut watch::Receiver<bool>) {
    let _ = quit.wait_for(|q| *q).await;
}

/// As axum's own accept loop: a connection that failed before it was accepted is nothing;
/// anything else (out of descriptors) waits a second.
async fn accept_error(e: io::Error) {
    if matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "accepting a connection");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

struct Front {
    router: Router,
    app: AppState,
    to_hyper: mpsc::UnboundedSender<(Rewind, SocketAddr)>,
    quit: watch::Receiver<bool>,
}

/// The connections this front hands to axum's server: its listener.
pub struct Handoff {
    rx: mpsc::UnboundedReceiver<(Rewind, SocketAddr)>,
    local: SocketAddr,
}

impl axum::serve::Listener for Handoff {
    type Io = Rewind;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Rewind, SocketAddr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The front stopped accepting: so does this.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// A connection handed over, with the bytes the front read from it first.
pub struct Rewind {
    prefix: Bytes,
    io: TcpStream,
}

impl AsyncRead for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let first = self.prefix.split_to(n);
            buf.put_slice(&first);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The connections served here that have not ended yet.
#[derive(Clone, Default)]
pub struct Open(Arc<(AtomicUsize, Notify)>);

struct OpenGuard(Open);

impl Open {
    fn enter(&self) -> OpenGuard {
        self.0 .0.fetch_add(1, Ordering::SeqCst);
        OpenGuard(self.clone())
    }

    /// Resolves once no connection is served here.
    pub async fn closed(&self) {
        loop {
            let woken = self.0 .1.notified();
            if self.0 .0.load(Ordering::SeqCst) == 0 {
                return;
            }
            woken.await;
        }
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        if self.0 .0 .0.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0 .0 .1.notify_waiters();
        }
    }
}

/// The client's side of a request served here, while its body has not been read: the
/// connection, the bytes read past the head, the body's framing.
pub(crate) struct Pending {
    pub(crate) io: Arc<TcpStream>,
    pub(crate) buf: BytesMut,
    pub(crate) framing: Framing,
}

enum State {
    /// Nobody has read the body.
    Idle(Pending),
    /// The request's body is being read (by hyper's client, an extractor…).
    Reading,
    /// The body was read to its end; the bytes read past it.
    Done(BytesMut),
    /// The proxy took the connection to relay the body.
    Taken,
    /// The body was left half read.
    Broken,
}

struct Shared {
    state: Mutex<State>,
    /// Told when the body reader ends (read whole or dropped).
    settled: Notify,
}

impl Shared {
    fn set(&self, s: State) {
        *self.state.lock().expect("front state lock") = s;
        self.settled.notify_one();
    }
}

/// A request extension: the request came through the front, whose client connection the
/// proxy may take ([`RelayIn::take`]) to relay the body itself.
#[derive(Clone)]
pub(crate) struct RelayIn(Arc<Shared>);

impl RelayIn {
    /// The client's connection and unread body, unless someone started reading it.
    pub(crate) fn take(&self) -> Option<Pending> {
        let mut st = self.0.state.lock().expect("front state lock");
        match std::mem::replace(&mut *st, State::Taken) {
            State::Idle(p) => Some(p),
            other => {
                *st = other;
                None
            }
        }
    }

    /// Gives back what [`RelayIn::take`] gave, untouched (the proxy answered without using it).
    pub(crate) fn restore(&self, p: Pending) {
        self.0.set(State::Idle(p));
    }
}

/// The request's upload into the machine, in a relayed exchange.
pub(crate) enum Upload {
    /// There was none; the bytes read past the request's head.
    Done(BytesMut),
    /// Moving; gives the bytes read past the body's end.
    Running(tokio::task::JoinHandle<Result<BytesMut, wire::RelayError>>),
}

impl Upload {
    fn abort(self) {
        if let Upload::Running(t) = self {
            t.abort();
        }
    }
}

/// An answer whose body the front relays from the machine's socket.
pub(crate) struct RelayedBody {
    pub(crate) machine: Arc<TcpStream>,
    /// What was read past the answer's head.
    pub(crate) buf: BytesMut,
    pub(crate) framing: Framing,
    pub(crate) upload: Upload,
    /// Held until the body has gone (the sandbox's busy guard, the connection's slot).
    pub(crate) guards: Box<dyn Send>,
}

/// A response extension: the answer's body is to be relayed ([`RelayedBody`]); the
/// response's own body is empty.
#[derive(Clone)]
pub(crate) struct Relayed(Arc<Mutex<Option<RelayedBody>>>);

impl Relayed {
    pub(crate) fn new(b: RelayedBody) -> Self {
        Relayed(Arc::new(Mutex::new(Some(b))))
    }

    fn take(&self) -> Option<RelayedBody> {
        self.0.lock().expect("relayed lock").take()
    }
}

/// One accepted connection: its requests, in order, while they are port requests.
async fn connection(front: Arc<Front>, io: TcpStream, addr: SocketAddr, _open: OpenGuard) {
    let io = Arc::new(io);
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let mut router = front.router.clone();
    let mut quit = front.quit.clone();
    loop {
        let parsed = match next_request(&front, &io, &mut buf, &mut quit).await {
            Next::Ours(p) => p,
            Next::Hyper => {
                // A task still holding the socket (none should) means it cannot be handed
                // over whole: it closes.
                if let Ok(io) = Arc::try_unwrap(io) {
                    let prefix = buf.freeze();
                    let _ = front.to_hyper.send((Rewind { prefix, io }, addr));
                }
                return;
            }
            Next::Close => return,
        };
        if !exchange(&mut router, &io, &mut buf, parsed).await {
            linger_close(&io).await;
            return;
        }
    }
}

/// A request head parsed here.
struct Parsed {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    len: usize,
    framing: Framing,
    close: bool,
    expect_continue: bool,
}

enum Next {
    Ours(Parsed),
    Hyper,
    Close,
}

/// Reads until `buf` holds a whole request head, and says whose it is.
async fn next_request(
    front: &Front,
    io: &TcpStream,
    buf: &mut BytesMut,
    quit: &mut watch::Receiver<bool>,
) -> Next {
    loop {
        if !buf.is_empty() {
            match parse_request(front, buf) {
                Some(Some(p)) => return Next::Ours(p),
                Some(None) => return Next::Hyper,
                None if buf.len() > MAX_REQUEST_HEAD => return Next::Hyper,
                None => {}
            }
        } else if *quit.borrow() {
            return Next::Close;
        }
        let wait = if buf.is_empty() {
            IDLE_TIMEOUT
        } else {
            HEAD_TIMEOUT
        };
        let idle = buf.is_empty();
        let read = tokio::select! {
            r = tokio::time::timeout(wait, wire::read_more(io, buf)) => r,
            () = quitting(quit), if idle => return Next::Close,
        };
        match read {
            Ok(Ok(n)) if n > 0 => {}
            _ => return Next::Close,
        }
    }
}

/// `None`: the head is not whole yet; `Some(None)`: hyper's; else ours.
fn parse_request(front: &Front, buf: &[u8]) -> Option<Option<Parsed>> {
    let mut slots = [httparse::EMPTY_HEADER; wire::MAX_HEADERS];
    let mut r = httparse::Request::new(&mut slots);
    let len = match r.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return None,
        Err(_) => return Some(None),
    };
    Some(ours(front, &r, len))
}

fn ours(front: &Front, r: &httparse::Request<'_, '_>, len: usize) -> Option<Parsed> {
    if r.version != Some(1) {
        return None;
    }
    let path = r.path?;
    if !path.starts_with('/') {
        return None;
    }
    let headers = wire::header_map(r.headers).ok()?;
    if headers.contains_key(header::UPGRADE)
        || has_token(&headers, header::CONNECTION, "upgrade")
        || headers.contains_key("e2b-sandbox-id")
    {
        return None;
    }
    let preview = front.app.cfg.preview.as_ref().and_then(|d| {
        let host = headers.get(header::HOST)?.to_str().ok()?;
        d.target(host)
    });
    match preview {
        Some(Ok((_, port))) if !crate::e2b::is_e2b_port(port) => {}
        Some(_) => return None,
        None if is_port_path(path) => {}
        None => return None,
    }
    let method = Method::from_bytes(r.method?.as_bytes()).ok()?;
    if method == Method::CONNECT {
        return None;
    }
    let uri = path.parse::<Uri>().ok()?;
    let framing = wire::request_framing(&headers).ok()?;
    Some(Parsed {
        method,
        uri,
        close: has_token(&headers, header::CONNECTION, "close"),
        expect_continue: headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue")),
        headers,
        len,
        framing,
    })
}

/// `/v1/sandboxes/{id}/ports/{port}` and below: the path proxy's routes.
fn is_port_path(path: &str) -> bool {
    let path = path.split('?').next().unwrap_or("");
    let mut seg = path.split('/');
    seg.next() == Some("")
        && seg.next() == Some("v1")
        && seg.next() == Some("sandboxes")
        && seg.next().is_some_and(|s| !s.is_empty())
        && seg.next() == Some("ports")
        && seg.next().is_some_and(|s| !s.is_empty())
}

fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Serves one request; whether the connection can take the next one.
async fn exchange(router: &mut Router, io: &Arc<TcpStream>, buf: &mut BytesMut, p: Parsed) -> bool {
    buf.advance(p.len);
    // Answered at once: the body will be read (or the connection closed after the answer).
    if p.expect_continue
        && p.framing != Framing::Empty
        && wire::write_all(io, b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .is_err()
    {
        return false;
    }
    let shared = Arc::new(Shared {
        state: Mutex::new(State::Idle(Pending {
            io: io.clone(),
            buf: std::mem::take(buf),
            framing: p.framing,
        })),
        settled: Notify::new(),
    });
    let body = match p.framing {
        Framing::Empty => Body::empty(),
        f => Body::new(SlotBody::new(shared.clone(), f)),
    };
    let mut req = Request::new(body);
    *req.method_mut() = p.method.clone();
    *req.uri_mut() = p.uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = p.headers;
    req.extensions_mut().insert(RelayIn(shared.clone()));
    let to_head = p.method == Method::HEAD;
    let ready = poll_fn(|cx| tower_service::Service::<Request>::poll_ready(&mut *router, cx)).await;
    let Ok(()) = ready;
    let Ok(mut resp) = tower_service::Service::call(router, req).await;
    let relayed = resp
        .extensions_mut()
        .remove::<Relayed>()
        .and_then(|s| s.take());
    let kept = match relayed {
        Some(sp) => send_relayed(io, resp, sp, p.close, buf).await,
        None => send(io, resp, to_head, p.close).await && settle(&shared, buf).await,
    };
    kept && !p.close
}

/// `Date` (as hyper adds it) and `Connection: close` where the connection ends after.
fn finish_headers(headers: &mut HeaderMap, close: bool) {
    if !headers.contains_key(header::DATE) {
        if let Ok(d) = HeaderValue::from_str(&httpdate::fmt_http_date(SystemTime::now())) {
            headers.insert(header::DATE, d);
        }
    }
    if close {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// Sends a relayed answer: its head, then its body from the machine's socket; then waits
/// for the upload. Whether the connection can go on.
async fn send_relayed(
    io: &TcpStream,
    resp: Response,
    sp: RelayedBody,
    close: bool,
    buf: &mut BytesMut,
) -> bool {
    let RelayedBody {
        machine,
        buf: mut from_machine,
        framing,
        upload,
        guards,
    } = sp;
    let (parts, _) = resp.into_parts();
    let mut headers = parts.headers;
    wire::set_framing(&mut headers, framing);
    finish_headers(&mut headers, close || framing == Framing::Eof);
    let mut out = wire::response_head(parts.status, &headers);
    // What came with the machine's head rides with ours: a small answer is one write.
    let mut rest = framing;
    if let Framing::Length(n) = framing {
        let k = (from_machine.len() as u64).min(n) as usize;
        out.extend_from_slice(&from_machine[..k]);
        from_machine.advance(k);
        rest = Framing::Length(n - k as u64);
    }
    if wire::write_all(io, &out).await.is_err() {
        upload.abort();
        return false;
    }
    let moved = wire::relay(&machine, io, &mut from_machine, rest, &|| {}).await;
    drop(guards);
    drop(machine);
    if let Err(e) = moved {
        tracing::debug!(error = %e, "a relayed answer was cut");
        upload.abort();
        return false;
    }
    if framing == Framing::Eof {
        upload.abort();
        return false;
    }
    match upload {
        Upload::Done(left) => {
            *buf = left;
            true
        }
        Upload::Running(mut task) => match tokio::time::timeout(UPLOAD_GRACE, &mut task).await {
            Ok(Ok(Ok(left))) => {
                *buf = left;
                true
            }
            Ok(_) => false,
            Err(_) => {
                task.abort();
                false
            }
        },
    }
}

/// Sends an answer from its body (errors, redirects, a tunnel's answers): `Content-Length`
/// when known, else chunked; each piece written as it comes (server-sent events). Whether
/// it went whole.
async fn send(io: &TcpStream, resp: Response, to_head: bool, close: bool) -> bool {
    let (parts, mut body) = resp.into_parts();
    let status = parts.status;
    let mut headers = parts.headers;
    let framing = if to_head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        Framing::Empty
    } else {
        match wire::content_length(&headers) {
            Ok(Some(n)) => Framing::Length(n),
            _ => match body.size_hint().exact() {
                Some(n) => Framing::Length(n),
                None => Framing::Chunked,
            },
        }
    };
    if framing == Framing::Empty && to_head && !headers.contains_key(header::CONTENT_LENGTH) {
        if let Some(n) = body.size_hint().exact() {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
    }
    wire::set_framing(&mut headers, framing);
    finish_headers(&mut headers, close);
    let mut head = wire::response_head(status, &headers);
    if framing == Framing::Empty {
        return wire::write_all(io, &head).await.is_ok();
    }
    let mut written = 0u64;
    let mut first = true;
    loop {
        // The first piece rides with the head when it is already there.
        let frame = if first {
            first = false;
            match body.frame().now_or_never() {
                Some(f) => f,
                None => {
                    if wire::write_all(io, &head).await.is_err() {
                        return false;
                    }
                    head.clear();
                    body.frame().await
                }
            }
        } else {
            body.frame().await
        };
        let data = match frame {
            None => break,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "an answer's body failed");
                let _ = wire::write_all(io, &head).await;
                return false;
            }
            Some(Ok(f)) => match f.into_data() {
                Ok(d) if !d.is_empty() => d,
                _ => continue,
            },
        };
        let sent = match framing {
            Framing::Length(n) => {
                if written + data.len() as u64 > n {
                    let fits = (n - written) as usize;
                    let _ = write_parts(io, &[&head, &data[..fits]]).await;
                    return false;
                }
                write_parts(io, &[&head, &data]).await
            }
            _ => {
                let size = format!("{:x}\r\n", data.len());
                write_parts(io, &[&head, size.as_bytes(), &data, b"\r\n"]).await
            }
        };
        if sent.is_err() {
            return false;
        }
        head.clear();
        written += data.len() as u64;
    }
    if framing == Framing::Chunked {
        head.extend_from_slice(b"0\r\n\r\n");
    }
    if !head.is_empty() && wire::write_all(io, &head).await.is_err() {
        return false;
    }
    match framing {
        Framing::Length(n) => written == n,
        _ => true,
    }
}

/// Writes `parts` in order, in as few calls as the socket takes.
async fn write_parts(s: &TcpStream, parts: &[&[u8]]) -> io::Result<()> {
    let (mut i, mut off) = (0, 0);
    loop {
        while i < parts.len() && off == parts[i].len() {
            i += 1;
            off = 0;
        }
        if i == parts.len() {
            return Ok(());
        }
        let mut slices = [io::IoSlice::new(&[]); 4];
        let mut n = 0;
        for (k, p) in parts[i..].iter().enumerate().take(4) {
            slices[n] = io::IoSlice::new(if k == 0 { &p[off..] } else { p });
            n += 1;
        }
        match s.try_write_vectored(&slices[..n]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(mut w) => {
                while w > 0 {
                    let left = parts[i].len() - off;
                    if w >= left {
                        w -= left;
                        i += 1;
                        off = 0;
                    } else {
                        off += w;
                        w = 0;
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => s.writable().await?,
            Err(e) => return Err(e),
        }
    }
}

/// After an answer from its body: the request's body read whole, or little enough left to
/// read and drop, keeps the connection; the bytes past it are the next request's.
async fn settle(shared: &Shared, buf: &mut BytesMut) -> bool {
    for _ in 0..2 {
        let state = {
            let mut st = shared.state.lock().expect("front state lock");
            match *st {
                State::Reading => None,
                _ => Some(std::mem::replace(&mut *st, State::Broken)),
            }
        };
        match state {
            Some(State::Done(left)) => {
                *buf = left;
                return true;
            }
            Some(State::Idle(p)) => return drain(p, buf).await,
            Some(_) => return false,
            None => {
                let _ = tokio::time::timeout(UPLOAD_GRACE, shared.settled.notified()).await;
            }
        }
    }
    false
}

/// Reads and drops an unread request body of up to [`DRAIN_MAX`] bytes.
async fn drain(mut p: Pending, buf: &mut BytesMut) -> bool {
    let n = match p.framing {
        Framing::Empty => 0,
        Framing::Length(n) => n,
        Framing::Chunked | Framing::Eof => return false,
    };
    if p.buf.len() as u64 >= n {
        p.buf.advance(n as usize);
        *buf = p.buf;
        return true;
    }
    let mut left = n - p.buf.len() as u64;
    if left > DRAIN_MAX {
        return false;
    }
    p.buf.clear();
    let drained = tokio::time::timeout(Duration::from_secs(5), async {
        while left > 0 {
            if wire::read_more(&p.io, &mut p.buf).await? == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            let k = (p.buf.len() as u64).min(left) as usize;
            p.buf.advance(k);
            left -= k as u64;
        }
        Ok(())
    })
    .await;
    if matches!(drained, Ok(Ok(()))) {
        *buf = p.buf;
        true
    } else {
        false
    }
}

/// Closes the sending side, then reads and drops what the client still sends for a while:
/// closing with unread bytes would reset the connection, and a reset can take the answer
/// with it before the client reads it.
async fn linger_close(io: &TcpStream) {
    let _ = locker_sys::fd::shutdown_write(io.as_raw_fd());
    let mut sink = BytesMut::new();
    let _ = tokio::time::timeout(LINGER, async {
        loop {
            sink.clear();
            match wire::read_more(io, &mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
}

/// A request's body read from the client's connection as the router's handlers poll it
/// (when the proxy did not take the connection to relay it).
struct SlotBody {
    shared: Arc<Shared>,
    pending: Option<Pending>,
    framing: Framing,
    /// Bytes of a `Content-Length` body still to come.
    left: u64,
    chunked: Chunked,
    finished: bool,
}

impl SlotBody {
    fn new(shared: Arc<Shared>, framing: Framing) -> Self {
        SlotBody {
            shared,
            pending: None,
            framing,
            left: match framing {
                Framing::Length(n) => n,
                _ => 0,
            },
            chunked: Chunked::default(),
            finished: false,
        }
    }

    fn finish(&mut self) {
        self.finished = true;
        if let Some(p) = self.pending.take() {
            self.shared.set(State::Done(p.buf));
        }
    }
}

impl hyper::body::Body for SlotBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(None);
        }
        if this.pending.is_none() {
            let mut st = this.shared.state.lock().expect("front state lock");
            match std::mem::replace(&mut *st, State::Reading) {
                State::Idle(p) => this.pending = Some(p),
                other => {
                    *st = other;
                    this.finished = true;
                    return Poll::Ready(Some(Err(io::Error::other(
                        "the request's body was taken by another reader",
                    ))));
                }
            }
        }
        loop {
            let Some(p) = this.pending.as_mut() else {
                return Poll::Ready(None);
            };
            match this.framing {
                Framing::Length(_) => {
                    if this.left == 0 {
                        this.finish();
                        return Poll::Ready(None);
                    }
                    if !p.buf.is_empty() {
                        let k = (p.buf.len() as u64).min(this.left) as usize;
                        let data = p.buf.split_to(k).freeze();
                        this.left -= k as u64;
                        if this.left == 0 {
                            this.finish();
                        }
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
                Framing::Chunked => {
                    while !p.buf.is_empty() {
                        match this.chunked.step(&p.buf) {
                            Err(e) => {
                                this.finished = true;
                                return Poll::Ready(Some(Err(io::Error::new(
                                    io::ErrorKind::InvalidData,
                                    format!("malformed chunked request body: {e}"),
                                ))));
                            }
                            Ok(Step::Meta(k)) => p.buf.advance(k),
                            Ok(Step::Data(k)) => {
                                let data = p.buf.split_to(k).freeze();
                                return Poll::Ready(Some(Ok(Frame::data(data))));
                            }
                            Ok(Step::Done(k)) => {
                                p.buf.advance(k);
                                this.finish();
                                return Poll::Ready(None);
                            }
                        }
                    }
                }
                Framing::Empty | Framing::Eof => {
                    this.finish();
                    return Poll::Ready(None);
                }
            }
            p.buf.reserve(64 * 1024);
            match p.io.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Ok(())) => {}
            }
            match p.io.try_read_buf(&mut p.buf) {
                Ok(0) => {
                    this.finished = true;
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the client closed the connection before the end of its request body",
                    ))));
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(_) => SizeHint::with_exact(self.left),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for SlotBody {
    fn drop(&mut self) {
        if self.pending.take().is_some() {
            self.shared.set(State::Broken);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_proxy_routes_are_recognised_and_nothing_else() {
        for yes in [
            "/v1/sandboxes/sb_1/ports/8000",
            "/v1/sandboxes/sb_1/ports/8000/",
            "/v1/sandboxes/sb_1/ports/8000/a/b?x=1",
            "/v1/sandboxes/sb_1/ports/x",
        ] {
            assert!(is_port_path(yes), "{yes}");
        }
        for no in [
            "/v1/sandboxes/sb_1/ports",
            "/v1/sandboxes/sb_1/ports/",
            "/v1/sandboxes//ports/80",
            "/v1/sandboxes/sb_1/exec",
            "/v2/sandboxes/sb_1/ports/80",
            "/",
        ] {
            assert!(!is_port_path(no), "{no}");
        }
    }
}
