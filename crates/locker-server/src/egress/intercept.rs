//! Interception for secrets: a connection from a machine armed for secrets whose SNI is
//! one of its secrets' hosts arrives here from the proxy instead of being passed through.
//! TLS is terminated with a leaf certificate of the machine's own CA ([`super::ca`]),
//! HTTP/1.1 or HTTP/2 is served (ALPN), each request's headers and URL query have the
//! machine's placeholders replaced by the secrets' values (only secrets that name this
//! host; a placeholder of another secret stays as it is and is noted as misuse), and the
//! request goes on to the real host over a new TLS connection that is fully verified
//! against the host's trust store and the operator's `--egress-ca`. Bodies are never
//! read or changed: they stream through both ways. Upstream connections are kept alive
//! and reused by the same client connection; an HTTP/1.1 `Upgrade` (WebSocket) gets its
//! own upstream connection and, after `101`, raw bytes are relayed both ways.
//!
//! The upstream address is always the one the proxy resolved for the SNI name (or the
//! operator pinned), never where the machine aimed: a forged SNI reaches only the
//! secret's host, and the value is only ever sent inside TLS verified for that name.
//!
//! Owns: the TLS and HTTP of intercepted connections. It does not choose which
//! connections are intercepted (`proxy` does) and does not hold values (it asks
//! `secrets` for each request, so a rotation applies to the next request).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, HOST, UPGRADE};
use hyper::{Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::{Armed, Egress, Seen};

/// How long a machine's TLS handshake with the proxy may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting (TCP and TLS) to the real host may take.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle HTTP/1.1 upstream connections kept per client connection.
const MAX_IDLE: usize = 8;

type Body = BoxBody<Bytes, hyper::Error>;

/// The TLS configurations for real hosts: one offering h2 and http/1.1, one http/1.1
/// only (for upgrades).
#[derive(Debug, Clone)]
pub struct UpstreamTls {
    any: Arc<rustls::ClientConfig>,
    h1: Arc<rustls::ClientConfig>,
}

impl UpstreamTls {
    pub fn new(extra_cas: &[std::path::PathBuf]) -> Result<UpstreamTls, String> {
        Ok(UpstreamTls {
            any: super::ca::upstream_config(extra_cas, &[b"h2", b"http/1.1"])?,
            h1: super::ca::upstream_config(extra_cas, &[b"http/1.1"])?,
        })
    }
}

/// Where an intercepted connection goes: the SNI name, the port the machine wanted, and
/// the addresses the proxy resolved for the name.
#[derive(Debug, Clone)]
pub struct Target {
    pub host: String,
    pub port: u16,
    pub addrs: Vec<SocketAddr>,
}

/// A connection with the bytes already read from it put back in front.
pub struct Prefixed {
    pre: Vec<u8>,
    pos: usize,
    inner: TcpStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.pos < self.pre.len() {
            let n = buf.remaining().min(self.pre.len() - self.pos);
            let start = self.pos;
            buf.put_slice(&self.pre[start..start + n]);
            self.pos += n;
            if self.pos == self.pre.len() {
                self.pre = Vec::new();
                self.pos = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serves one intercepted connection until either side closes. `hello` holds the bytes
/// the proxy read (the ClientHello).
pub async fn serve(
    eg: Arc<Egress>,
    armed: Arc<Armed>,
    sock: TcpStream,
    hello: Vec<u8>,
    target: Target,
) {
    let Some(tls_up) = eg.upstream.get().cloned() else {
        return;
    };
    let cfg = match armed.ca.server_config(&target.host) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "egress interception: no certificate");
            return;
        }
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
    // Nagle off, as on the passed-through path: a response's head and body go out as
    // separate TLS records, and the second would wait for the client's delayed ACK.
    let _ = sock.set_nodelay(true);
    let stream = Prefixed {
        pre: hello,
        pos: 0,
        inner: sock,
    };
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(t)) => t,
        _ => return,
    };
    let down_h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let conn = Arc::new(Conn {
        eg,
        armed,
        target,
        tls: tls_up,
        h2: Mutex::new(None),
        idle: Mutex::new(Vec::new()),
    });
    let svc = hyper::service::service_fn(move |req| {
        let conn = conn.clone();
        async move { Ok::<_, Infallible>(conn.forward(req, down_h2).await) }
    });
    let io = TokioIo::new(tls);
    let _ = if down_h2 {
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(io, svc)
            .await
    } else {
        hyper::server::conn::http1::Builder::new()
            .serve_connection(io, svc)
            .with_upgrades()
            .await
    };
}

/// An upstream connection's request side.
enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Incoming>),
    H2(hyper::client::conn::http2::SendRequest<Incoming>),
}

/// One intercepted client connection and its upstream connections.
struct Conn {
    eg: Arc<Egress>,
    armed: Arc<Armed>,
    target: Target,
    tls: UpstreamTls,
    h2: Mutex<Option<hyper::client::conn::http2::SendRequest<Incoming>>>,
    idle: Mutex<Vec<hyper::client::conn::http1::SendRequest<Incoming>>>,
}

/// The headers that belong to one hop and that HTTP/2 forbids.
const HOP: [&str; 6] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
];

fn text(status: StatusCode, msg: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(format!("locker: {msg}\n")))
            .map_err(|n: Infallible| match n {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("text/plain"));
    r
}

impl Conn {
    async fn forward(&self, mut req: Request<Incoming>, down_h2: bool) -> Response<Body> {
        let upgrade = !down_h2 && req.headers().contains_key(UPGRADE);
        let down_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        if let Err(msg) = self.replace(&mut parts) {
            return text(StatusCode::BAD_GATEWAY, msg);
        }
        let sender = if upgrade {
            self.connect(true).await
        } else {
            self.sender().await
        };
        let mut sender = match sender {
            Ok(s) => s,
            Err(e) => return text(StatusCode::BAD_GATEWAY, e),
        };
        let authority = if self.target.port == 443 {
            self.target.host.clone()
        } else {
            format!("{}:{}", self.target.host, self.target.port)
        };
        let pq = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        let res = match &mut sender {
            Sender::H2(s) => {
                for h in HOP {
                    if h == "te"
                        && parts
                            .headers
                            .get(h)
                            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"))
                    {
                        continue;
                    }
                    parts.headers.remove(h);
                }
                parts.headers.remove(HOST);
                parts.version = Version::HTTP_2;
                parts.uri = match Uri::builder()
                    .scheme("https")
                    .authority(authority.as_str())
                    .path_and_query(pq.as_str())
                    .build()
                {
                    Ok(u) => u,
                    Err(e) => {
                        return text(StatusCode::BAD_REQUEST, format!("bad request target: {e}"))
                    }
                };
                s.send_request(Request::from_parts(parts, body)).await
            }
            Sender::H1(s) => {
                if !parts.headers.contains_key(HOST) {
                    if let Ok(v) = HeaderValue::from_str(&authority) {
                        parts.headers.insert(HOST, v);
                    }
                }
                if down_h2 {
                    for h in HOP {
                        parts.headers.remove(h);
                    }
                }
                parts.version = Version::HTTP_11;
                parts.uri = match pq.parse() {
                    Ok(u) => u,
                    Err(e) => {
                        return text(StatusCode::BAD_REQUEST, format!("bad request target: {e}"))
                    }
                };
                s.send_request(Request::from_parts(parts, body)).await
            }
        };
        let mut resp = match res {
            Ok(r) => r,
            Err(e) => {
                return text(
                    StatusCode::BAD_GATEWAY,
                    format!("{} did not answer: {e}", self.target.host),
                )
            }
        };
        match sender {
            Sender::H1(s) if !upgrade => {
                let mut idle = self.idle.lock().expect("idle upstream");
                if idle.len() < MAX_IDLE {
                    idle.push(s);
                }
            }
            _ => {}
        }
        if let Some(down) = down_upgrade {
            if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
                let up = hyper::upgrade::on(&mut resp);
                tokio::spawn(async move {
                    if let (Ok(d), Ok(u)) = (down.await, up.await) {
                        let mut d = TokioIo::new(d);
                        let mut u = TokioIo::new(u);
                        let _ = tokio::io::copy_bidirectional(&mut d, &mut u).await;
                    }
                });
            }
        }
        let (mut rp, rb) = resp.into_parts();
        if down_h2 {
            for h in HOP {
                rp.headers.remove(h);
            }
        }
        Response::from_parts(rp, rb.boxed())
    }

    /// Puts values in for the placeholders in headers and the URL query, for the secrets
    /// that name this host now; notes every placeholder seen.
    fn replace(&self, parts: &mut hyper::http::request::Parts) -> Result<(), String> {
        let host = &self.target.host;
        let Some(secrets) = self.eg.secrets() else {
            return Ok(());
        };
        // The values this request needs, looked up once each.
        let value_of = |name: &str, cache: &mut Vec<(String, Option<Vec<u8>>)>| {
            if let Some(v) = cache.iter().find(|v| v.0 == name) {
                return v.1.clone();
            }
            let v = secrets
                .value_for(&self.armed.tenant, name, host)
                .map(|o| o.value);
            cache.push((name.to_owned(), v.clone()));
            v
        };
        let mut cache: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        let names: Vec<HeaderName> = parts.headers.keys().cloned().collect();
        for k in names {
            let all: Vec<HeaderValue> = parts.headers.get_all(&k).iter().cloned().collect();
            if !all
                .iter()
                .any(|v| self.armed.found_in(v.as_bytes()).next().is_some())
            {
                continue;
            }
            parts.headers.remove(&k);
            for v in all {
                let mut bytes = v.as_bytes().to_vec();
                for (name, ph) in &self.armed.secrets {
                    if !contains(&bytes, ph.as_bytes()) {
                        continue;
                    }
                    match value_of(name, &mut cache) {
                        Some(val) => {
                            bytes = replace_all(&bytes, ph.as_bytes(), &val);
                            self.armed.note(Seen::Used {
                                name: name.clone(),
                                host: host.clone(),
                            });
                        }
                        None => self.armed.note(Seen::Misuse {
                            name: name.clone(),
                            destination: host.clone(),
                        }),
                    }
                }
                let hv = HeaderValue::from_bytes(&bytes)
                    .map_err(|_| format!("header {k} cannot carry a secret's value"))?;
                parts.headers.append(k.clone(), hv);
            }
        }
        if let Some(q) = parts.uri.query() {
            if self.armed.found_in(q.as_bytes()).next().is_some() {
                let mut q = q.as_bytes().to_vec();
                for (name, ph) in &self.armed.secrets {
                    if !contains(&q, ph.as_bytes()) {
                        continue;
                    }
                    match value_of(name, &mut cache) {
                        Some(val) => {
                            q = replace_all(&q, ph.as_bytes(), percent_encode(&val).as_bytes());
                            self.armed.note(Seen::Used {
                                name: name.clone(),
                                host: host.clone(),
                            });
                        }
                        None => self.armed.note(Seen::Misuse {
                            name: name.clone(),
                            destination: host.clone(),
                        }),
                    }
                }
                let pq = format!("{}?{}", parts.uri.path(), String::from_utf8_lossy(&q));
                let mut b = hyper::http::uri::Parts::default();
                b.scheme = parts.uri.scheme().cloned();
                b.authority = parts.uri.authority().cloned();
                b.path_and_query = Some(
                    pq.parse()
                        .map_err(|_| "the URL cannot carry a secret's value".to_owned())?,
                );
                parts.uri = Uri::from_parts(b)
                    .map_err(|_| "the URL cannot carry a secret's value".to_owned())?;
            }
        }
        Ok(())
    }

    /// A sender to the real host: a live HTTP/2 connection, an idle HTTP/1.1 one, or a
    /// new connection.
    async fn sender(&self) -> Result<Sender, String> {
        if let Some(s) = self.h2.lock().expect("h2 upstream").as_ref() {
            if !s.is_closed() {
                return Ok(Sender::H2(s.clone()));
            }
        }
        {
            let mut idle = self.idle.lock().expect("idle upstream");
            idle.retain(|s| !s.is_closed());
            if let Some(i) = idle.iter().position(|s| s.is_ready()) {
                return Ok(Sender::H1(idle.swap_remove(i)));
            }
        }
        let s = self.connect(false).await?;
        if let Sender::H2(h) = &s {
            *self.h2.lock().expect("h2 upstream") = Some(h.clone());
        }
        Ok(s)
    }

    /// A new connection to the real host, verified for its name; HTTP/1.1 only when
    /// `h1_only` (upgrades).
    async fn connect(&self, h1_only: bool) -> Result<Sender, String> {
        let host = &self.target.host;
        let mut tcp = None;
        let mut last = String::from("no address");
        for a in &self.target.addrs {
            match tokio::time::timeout(UPSTREAM_TIMEOUT, TcpStream::connect(a)).await {
                Ok(Ok(s)) => {
                    tcp = Some(s);
                    break;
                }
                Ok(Err(e)) => last = format!("{a}: {e}"),
                Err(_) => last = format!("{a}: no answer within {UPSTREAM_TIMEOUT:?}"),
            }
        }
        let tcp = tcp.ok_or_else(|| format!("cannot connect to {host}: {last}"))?;
        let _ = tcp.set_nodelay(true);
        let cfg = if h1_only {
            self.tls.h1.clone()
        } else {
            self.tls.any.clone()
        };
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| format!("{host}: {e}"))?;
        let tls = tokio::time::timeout(
            UPSTREAM_TIMEOUT,
            tokio_rustls::TlsConnector::from(cfg).connect(name, tcp),
        )
        .await
        .map_err(|_| format!("TLS with {host}: no answer within {UPSTREAM_TIMEOUT:?}"))?
        .map_err(|e| format!("TLS with {host}: {e}"))?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = TokioIo::new(tls);
        if h2 {
            let (s, c) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(|e| format!("HTTP/2 with {host}: {e}"))?;
            tokio::spawn(c);
            Ok(Sender::H2(s))
        } else {
            let (s, c) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| format!("HTTP/1.1 with {host}: {e}"))?;
            tokio::spawn(c.with_upgrades());
            Ok(Sender::H1(s))
        }
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

fn replace_all(hay: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len() + to.len());
    let mut i = 0;
    while i < hay.len() {
        if hay[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    out
}

/// `v` as it may stand in a URL query: unreserved characters kept, the rest `%XX`.
fn percent_encode(v: &[u8]) -> String {
    let mut s = String::with_capacity(v.len());
    for &b in v {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_replaced_everywhere_they_occur() {
        assert_eq!(
            replace_all(b"Bearer P and P", b"P", b"xy"),
            b"Bearer xy and xy"
        );
        assert_eq!(replace_all(b"none", b"P", b"xy"), b"none");
        assert_eq!(percent_encode(b"a b&c=d"), "a%20b%26c%3Dd");
        assert!(contains(b"abc", b"bc") && !contains(b"abc", b""));
    }
}
