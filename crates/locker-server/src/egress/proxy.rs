//! The name-checking proxy: every TCP connection of a machine under `allow` that is not
//! to an allowed CIDR arrives here (nftables redirected it). The proxy reads the name the
//! client asks for from its first bytes (the TLS ClientHello's SNI, or the HTTP `Host`
//! header), checks it against the machine's allowlist, resolves it on the host and
//! connects to that name itself on the port the client wanted, then relays bytes both
//! ways. The original destination address is never dialled unless it is in an allowed
//! CIDR; a connection that names nothing (a protocol where the server speaks first, raw
//! bytes) is refused. Refusals answer `403` to HTTP, a TLS `access_denied` alert to TLS,
//! and are counted for the machine's call records.
//!
//! A machine armed for secrets has its TLS connections to its secrets' hosts handed to
//! [`super::intercept`] instead of relayed; a placeholder seen in a plain HTTP request
//! head is noted as misuse (and relayed unchanged).
//!
//! Every connection takes server file descriptors, so how many a machine, a tenant and
//! all machines may hold open is capped ([`super::limits`]); past a cap a connection is
//! closed at once, and near one the proxy waits less for a client's first bytes.

use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::limits::Permit;
use super::{forbidden, intercept, normalize_name, Egress, Rule, Seen};

/// How long a client may take to send the name it wants.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The same when a cap is near: idle connections then give their place up soon.
const HELLO_TIMEOUT_NEAR_CAP: Duration = Duration::from_secs(1);
/// How long dialing the name may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most bytes read before the name must be known (a ClientHello with large key
/// shares fits well inside).
const MAX_HELLO: usize = 64 << 10;
/// The relay's buffer per direction (bigger than tokio's 8 KiB default: fewer system
/// calls per byte on bulk downloads).
const RELAY_BUF: usize = 64 << 10;

/// Accepts redirected connections for the life of the server.
pub async fn serve(eg: Arc<Egress>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((sock, peer)) => {
                let eg = eg.clone();
                tokio::spawn(async move { handle(&eg, sock, peer).await });
            }
            Err(e) => {
                eg.accept_failed(&e);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn handle(eg: &Arc<Egress>, mut sock: TcpStream, peer: SocketAddr) {
    // Only machines under `allow` are served; anyone else is closed on at once.
    let IpAddr::V4(ip) = peer.ip() else { return };
    let Some(entry) = eg.entry(ip) else { return };
    let Rule::Allow(list) = &*entry.rule() else {
        return;
    };
    let Some(orig) = original_dst(&sock) else {
        return;
    };
    let slot = match Permit::take(
        &eg.proxy_caps,
        &entry.held.conns,
        &entry.tenant.conns,
        &eg.total.conns,
    ) {
        Ok(p) => p,
        Err(full) => {
            entry.deny(format!("{}:{}", orig.ip(), orig.port()), full.why());
            return;
        }
    };
    let wait = if slot.near_cap {
        HELLO_TIMEOUT_NEAR_CAP
    } else {
        HELLO_TIMEOUT
    };
    let mut buf = Vec::with_capacity(4096);
    let hello = match tokio::time::timeout(wait, read_hello(&mut sock, &mut buf)).await {
        Ok(Ok(h)) => h,
        Ok(Err(_)) => return,
        Err(_) => Hello::Other,
    };
    let port = orig.port();
    let armed = eg.armed(&entry.key);
    if let (Some(a), Hello::Http(h)) = (&armed, &hello) {
        // Plain HTTP is never given a value; a placeholder in it is noted (the head only:
        // bodies are not read).
        let dest = match h {
            Some(n) => format!("http://{n}"),
            None => format!("http://{}:{port}", orig.ip()),
        };
        let found: Vec<String> = a.found_in(&buf).map(|(n, _)| n.clone()).collect();
        for name in found {
            a.note(Seen::Misuse {
                name,
                destination: dest.clone(),
            });
        }
    }
    let named = match &hello {
        Hello::Tls(Some(n)) | Hello::Http(Some(n)) => Some(n.clone()),
        _ => None,
    };
    // What to dial: the requested name, or an address (a literal, or the original
    // destination when nothing was named) that must be in an allowed CIDR.
    let target: Result<Vec<SocketAddr>, (String, &str)> = match named {
        Some(n) => match n.parse::<IpAddr>() {
            Ok(IpAddr::V4(a)) if list.allows_ip(a) && !forbidden(IpAddr::V4(a)) => {
                Ok(vec![SocketAddr::from((a, port))])
            }
            Ok(a) => Err((format!("{a}:{port}"), "an address not in an allowed CIDR")),
            Err(_) if list.allows_name(&n) => match eg.resolve(&n).await {
                Ok(addrs) => {
                    let ok: Vec<SocketAddr> = addrs
                        .into_iter()
                        .filter(|a| !forbidden(*a))
                        .map(|a| SocketAddr::from((a, port)))
                        .collect();
                    if ok.is_empty() {
                        Err((n, "the name resolves to no address a machine may reach"))
                    } else {
                        Ok(ok)
                    }
                }
                Err(e) => {
                    if let Some(held_back) = entry.log_now() {
                        tracing::info!(machine = %entry.key, error = %e, more_refused_before = held_back, "egress proxy: cannot resolve an allowed name");
                    }
                    refuse(&mut sock, &hello, &format!("{n} cannot be resolved")).await;
                    return;
                }
            },
            Err(_) => Err((n, "not in the allowlist")),
        },
        None => {
            let a = *orig.ip();
            if list.allows_ip(a) && !forbidden(IpAddr::V4(a)) {
                Ok(vec![SocketAddr::from((a, port))])
            } else {
                Err((
                    format!("{a}:{port}"),
                    "no name (TLS SNI or HTTP Host) and an address not in an allowed CIDR",
                ))
            }
        }
    };
    let addrs = match target {
        Ok(a) => a,
        Err((what, why)) => {
            refuse(
                &mut sock,
                &hello,
                &format!("egress to {what} is not allowed by this machine's network policy"),
            )
            .await;
            entry.deny(what, why);
            return;
        }
    };
    if let (Some(a), Hello::Tls(Some(n)), Some(secrets)) = (&armed, &hello, eg.secrets()) {
        // A joined node's copies of the machine's secrets, fetched again if one was dropped
        // unused (a no-op where the store is at hand); without them nothing is put in.
        let names: Vec<String> = a.secrets.iter().map(|(name, _)| name.clone()).collect();
        if let Err(e) = secrets.ensure(&a.tenant, &names).await {
            tracing::warn!(error = %e.message, "a machine's secrets could not be fetched: its connection gets no values");
        }
        if a.secrets
            .iter()
            .any(|(name, _)| secrets.has_host(&a.tenant, name, n))
        {
            let target = intercept::Target {
                host: n.clone(),
                port,
                addrs,
            };
            intercept::serve(eg.clone(), a.clone(), sock, buf, target).await;
            drop(slot);
            return;
        }
    }
    let mut upstream = None;
    for a in &addrs {
        if let Ok(Ok(s)) = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(a)).await {
            upstream = Some(s);
            break;
        }
    }
    let Some(mut up) = upstream else {
        refuse(
            &mut sock,
            &hello,
            &format!("no answer from {addrs:?} on port {port}"),
        )
        .await;
        return;
    };
    let _ = up.set_nodelay(true);
    let _ = sock.set_nodelay(true);
    if up.write_all(&buf).await.is_err() {
        return;
    }
    drop(buf);
    let _ =
        tokio::io::copy_bidirectional_with_sizes(&mut sock, &mut up, RELAY_BUF, RELAY_BUF).await;
    drop(slot);
}

/// Tells the client no, in its own protocol where there is one, and closes.
async fn refuse(sock: &mut TcpStream, hello: &Hello, message: &str) {
    let bytes: Vec<u8> = match hello {
        // A fatal `access_denied` alert (TLS 1.2 record framing, which every version reads).
        Hello::Tls(_) => vec![0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 49],
        Hello::Http(_) => {
            let body = format!("locker: {message}\n");
            format!(
                "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        }
        Hello::Other => Vec::new(),
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = sock.write_all(&bytes).await;
        let _ = sock.shutdown().await;
    })
    .await;
}

/// The destination a redirected connection had before nftables sent it here.
fn original_dst(s: &TcpStream) -> Option<SocketAddrV4> {
    locker_sys::net::original_dst(s.as_raw_fd())
}

/// What the first bytes of a connection ask for.
#[derive(Debug, PartialEq, Eq)]
pub enum Hello {
    /// A TLS ClientHello, with its SNI if it has one.
    Tls(Option<String>),
    /// An HTTP request, with its `Host` (port removed) if it has one.
    Http(Option<String>),
    /// Anything else.
    Other,
}

/// Reads until the first bytes say what they ask for.
async fn read_hello(sock: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<Hello> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(h) = sniff(buf) {
            return Ok(h);
        }
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            return Ok(Hello::Other);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// What `b` asks for, or `None` if more bytes are needed to tell.
pub fn sniff(b: &[u8]) -> Option<Hello> {
    if b.is_empty() {
        return None;
    }
    if b[0] == 0x16 {
        return match client_hello_sni(b) {
            Ok(sni) => Some(Hello::Tls(sni)),
            Err(Need::More) if b.len() < MAX_HELLO => None,
            Err(_) => Some(Hello::Tls(None)),
        };
    }
    // An HTTP request starts with a method: uppercase letters, then a space.
    let method_len = b.iter().take_while(|c| c.is_ascii_uppercase()).count();
    if method_len == b.len() && method_len < 16 {
        return None;
    }
    if method_len == 0 || method_len >= 16 || b[method_len] != b' ' {
        return Some(Hello::Other);
    }
    match find(b, b"\r\n\r\n") {
        Some(end) => Some(Hello::Http(http_host(&b[..end]))),
        None if b.len() < MAX_HELLO => None,
        None => Some(Hello::Http(None)),
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The `Host` of an HTTP request head, without its port.
fn http_host(head: &[u8]) -> Option<String> {
    let head = std::str::from_utf8(head).ok()?;
    let host = head.split("\r\n").skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case("host").then(|| v.trim())
    })?;
    let host = if let Some(rest) = host.strip_prefix('[') {
        // An IPv6 literal: `[::1]:80`.
        rest.split(']').next()?
    } else {
        host.rsplit_once(':')
            .filter(|(_, p)| p.bytes().all(|c| c.is_ascii_digit()))
            .map(|(h, _)| h)
            .unwrap_or(host)
    };
    let host = normalize_name(host);
    (!host.is_empty()).then_some(host)
}

#[derive(Debug, PartialEq, Eq)]
enum Need {
    More,
    Malformed,
}

/// A byte reader over a ClientHello that fails with `Malformed` past its end.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Need> {
        if self.0.len() < n {
            return Err(Need::Malformed);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<usize, Need> {
        Ok(self.take(1)?[0] as usize)
    }
    fn u16(&mut self) -> Result<usize, Need> {
        let b = self.take(2)?;
        Ok(((b[0] as usize) << 8) | b[1] as usize)
    }
}

/// The SNI of the TLS ClientHello that starts `b` (its records may be fragmented).
fn client_hello_sni(b: &[u8]) -> Result<Option<String>, Need> {
    // Reassemble the handshake message from the records that carry it.
    let mut hs: Vec<u8> = Vec::new();
    let mut rest = b;
    loop {
        if rest.len() < 5 {
            return Err(Need::More);
        }
        if rest[0] != 0x16 {
            return Err(Need::Malformed);
        }
        let len = ((rest[3] as usize) << 8) | rest[4] as usize;
        if rest.len() < 5 + len {
            return Err(Need::More);
        }
        hs.extend_from_slice(&rest[5..5 + len]);
        rest = &rest[5 + len..];
        if hs.len() >= 4 {
            if hs[0] != 0x01 {
                return Err(Need::Malformed);
            }
            let body = ((hs[1] as usize) << 16) | ((hs[2] as usize) << 8) | hs[3] as usize;
            if body > MAX_HELLO {
                return Err(Need::Malformed);
            }
            if hs.len() >= 4 + body {
                return parse_client_hello(&hs[4..4 + body]);
            }
        }
    }
}

fn parse_client_hello(body: &[u8]) -> Result<Option<String>, Need> {
    let mut r = Reader(body);
    r.take(2 + 32)?; // version, random
    let n = r.u8()?;
    r.take(n)?; // session id
    let n = r.u16()?;
    r.take(n)?; // cipher suites
    let n = r.u8()?;
    r.take(n)?; // compression methods
    if r.0.is_empty() {
        return Ok(None);
    }
    let n = r.u16()?;
    let mut ext = Reader(r.take(n)?);
    while !ext.0.is_empty() {
        let typ = ext.u16()?;
        let n = ext.u16()?;
        let data = ext.take(n)?;
        if typ != 0 {
            continue;
        }
        let mut list = Reader(data);
        let n = list.u16()?;
        let mut names = Reader(list.take(n)?);
        while !names.0.is_empty() {
            let kind = names.u8()?;
            let n = names.u16()?;
            let name = names.take(n)?;
            if kind == 0 {
                let s = std::str::from_utf8(name).map_err(|_| Need::Malformed)?;
                return Ok(Some(normalize_name(s)));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello carrying `sni`, split into records of at most `frag` bytes.
    fn client_hello(sni: Option<&str>, frag: usize) -> Vec<u8> {
        let mut body = vec![0x03, 0x03];
        body.extend([7u8; 32]);
        body.push(0); // session id
        body.extend([0x00, 0x02, 0x13, 0x01]); // one cipher suite
        body.extend([0x01, 0x00]); // null compression
        let mut exts = Vec::new();
        // An unrelated extension first (supported_versions).
        exts.extend([0x00, 0x2b, 0x00, 0x03, 0x02, 0x03, 0x04]);
        if let Some(s) = sni {
            let n = s.len();
            let mut e = vec![0x00, 0x00];
            e.extend(((n + 5) as u16).to_be_bytes());
            e.extend(((n + 3) as u16).to_be_bytes());
            e.push(0);
            e.extend((n as u16).to_be_bytes());
            e.extend(s.as_bytes());
            exts.extend(e);
        }
        body.extend((exts.len() as u16).to_be_bytes());
        body.extend(exts);
        let mut hs = vec![0x01];
        hs.extend(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend(body);
        let mut out = Vec::new();
        for c in hs.chunks(frag) {
            out.extend([0x16, 0x03, 0x01]);
            out.extend((c.len() as u16).to_be_bytes());
            out.extend(c);
        }
        out
    }

    #[test]
    fn tls_sni_is_read_also_from_fragmented_records() {
        let h = client_hello(Some("Allowed.Test"), 1 << 14);
        assert_eq!(sniff(&h), Some(Hello::Tls(Some("allowed.test".into()))));
        let h = client_hello(Some("a.example.com"), 20);
        assert_eq!(sniff(&h), Some(Hello::Tls(Some("a.example.com".into()))));
        for cut in 1..h.len() {
            assert_eq!(sniff(&h[..cut]), None, "needs more at {cut}");
        }
        assert_eq!(sniff(&client_hello(None, 1 << 14)), Some(Hello::Tls(None)));
        // Garbage after the record header is malformed, not a reason to wait forever.
        assert_eq!(
            sniff(&[0x16, 3, 1, 0, 4, 0x02, 0, 0, 0]),
            Some(Hello::Tls(None))
        );
        let mut bad = client_hello(Some("x.test"), 1 << 14);
        let l = bad.len();
        bad[l - 8] = 0xff; // the name's length now runs past the end
        assert_eq!(sniff(&bad), Some(Hello::Tls(None)));
    }

    #[test]
    fn http_host_is_read_without_its_port() {
        let r = b"GET / HTTP/1.1\r\nUser-Agent: x\r\nhOsT: Allowed.Test:8080\r\n\r\n";
        assert_eq!(sniff(r), Some(Hello::Http(Some("allowed.test".into()))));
        assert_eq!(sniff(&r[..20]), None);
        assert_eq!(
            sniff(b"POST /x HTTP/1.1\r\nHost: 10.0.0.1\r\n\r\nbody"),
            Some(Hello::Http(Some("10.0.0.1".into())))
        );
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n"),
            Some(Hello::Http(Some("::1".into())))
        );
        assert_eq!(sniff(b"GET / HTTP/1.0\r\n\r\n"), Some(Hello::Http(None)));
        assert_eq!(sniff(b"GE"), None);
        assert_eq!(sniff(b"SSH-2.0-OpenSSH\r\n"), Some(Hello::Other));
        assert_eq!(sniff(b"\x00\x01"), Some(Hello::Other));
    }
}
