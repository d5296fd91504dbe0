//! The server's streams seen from a client: NDJSON exec and process output, the terminal's
//! WebSocket, a raw HTTP request whose body the server refuses before reading it, and a
//! deterministic byte stream for large transfers.
//!
//! Plain helpers over sockets the caller owns: they start no server and keep nothing open
//! past the value they return.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;
use ureq::http::HeaderMap;
use ureq::BodyReader;

use crate::server::Api;

/// The headers of a POST asking for NDJSON.
pub const NDJSON: [(&str, &str); 2] = [
    ("Content-Type", "application/json"),
    ("Accept", "application/x-ndjson"),
];

/// Opens an NDJSON exec in sandbox `sb` with `body`: its status, headers and unread body.
#[track_caller]
pub fn exec_stream(api: &Api, sb: &str, body: &Value) -> (u16, HeaderMap, BodyReader<'static>) {
    api.open(
        "POST",
        &format!("/v1/sandboxes/{sb}/exec"),
        &NDJSON,
        serde_json::to_vec(body).expect("json"),
    )
    .unwrap_or_else(|e| panic!("open an NDJSON exec {body}: {e}"))
}

/// Reads NDJSON lines, each with the time it arrived since `t0`.
pub fn read_ndjson(r: impl Read, t0: Instant) -> Vec<(Duration, Value)> {
    let mut out = Vec::new();
    for line in BufReader::new(r).lines() {
        let line = line.expect("read an NDJSON line");
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}"));
        out.push((t0.elapsed(), v));
    }
    out
}

/// The concatenated `data` of the `kind` lines (stdout or stderr) of an NDJSON stream.
pub fn stream_text(lines: &[(Duration, Value)], kind: &str) -> String {
    lines
        .iter()
        .filter(|(_, v)| v["type"] == kind)
        .map(|(_, v)| v["data"].as_str().expect("data is a string"))
        .collect()
}

/// Reads the first line of a stream (which stays open for the rest).
pub fn first_line<R: Read>(r: R) -> (String, BufReader<R>) {
    let mut r = BufReader::new(r);
    let mut first = String::new();
    r.read_line(&mut first).expect("the first line");
    (first, r)
}

/// A terminal's WebSocket.
pub type Terminal = tungstenite::WebSocket<TcpStream>;

/// Opens the terminal WebSocket at `path`; on a refused handshake, its status and body.
pub fn ws_connect(base: &str, key: Option<&str>, path: &str) -> Result<Terminal, (u16, String)> {
    use tungstenite::client::IntoClientRequest;
    let addr = base.strip_prefix("http://").expect("an http:// base");
    let mut req = format!("ws://{addr}{path}")
        .into_client_request()
        .expect("a ws request");
    if let Some(k) = key {
        req.headers_mut().insert(
            "Authorization",
            format!("Bearer {k}").parse().expect("header"),
        );
    }
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    match tungstenite::client(req, stream) {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => {
            let body = resp
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            Err((resp.status().as_u16(), body))
        }
        Err(e) => panic!("WebSocket handshake on {path}: {e}"),
    }
}

/// The next frame of a terminal, `None` when the read timed out; output frames are added
/// to `seen`.
fn next_frame(ws: &mut Terminal, seen: &mut String, waiting_for: &str) -> Option<Message> {
    match ws.read() {
        Ok(tungstenite::Message::Binary(b)) => {
            seen.push_str(&String::from_utf8_lossy(&b));
            Some(Message::Output)
        }
        Ok(tungstenite::Message::Text(t)) => Some(Message::Text(t.as_str().to_owned())),
        Ok(tungstenite::Message::Close(_)) => Some(Message::Close),
        Ok(_) => Some(Message::Output),
        Err(tungstenite::Error::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            None
        }
        Err(e) => {
            panic!("the terminal failed while waiting for {waiting_for}: {e}; it showed:\n{seen}")
        }
    }
}

enum Message {
    Output,
    Text(String),
    Close,
}

/// Reads terminal frames until the accumulated output contains `needle`.
pub fn read_until(ws: &mut Terminal, needle: &str, seen: &mut String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen.contains(needle) {
        assert!(
            Instant::now() < deadline,
            "no {needle:?} from the terminal within 10 s; it showed:\n{seen}"
        );
        if let Some(Message::Text(t)) = next_frame(ws, seen, needle) {
            seen.push_str(&t);
        }
    }
}

/// Reads terminal frames until the exit control frame, and returns it.
pub fn read_exit_frame(ws: &mut Terminal, seen: &mut String) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < deadline,
            "no exit frame; the terminal showed:\n{seen}"
        );
        match next_frame(ws, seen, "the exit frame") {
            Some(Message::Text(t)) => {
                let v: Value = serde_json::from_str(&t)
                    .unwrap_or_else(|e| panic!("a control frame is JSON ({e}): {t}"));
                if v["type"] == "exit" {
                    return v;
                }
            }
            Some(Message::Close) => panic!("closed without an exit frame; it showed:\n{seen}"),
            Some(Message::Output) | None => {}
        }
    }
}

/// POSTs a body the server refuses before reading it all, on a raw connection: the body
/// is written from another thread while this one reads the answer, so the server closing
/// the connection early cannot hide its answer behind a broken pipe. Returns the status
/// and the (small) body.
pub fn post_oversized(addr: SocketAddr, key: &str, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())
        .expect("write the request head");
    let mut w = s.try_clone().expect("clone the socket");
    let body = body.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&body);
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if got.windows(4).any(|w| w == b"\r\n\r\n")
                    && e.kind() == std::io::ErrorKind::ConnectionReset =>
            {
                break
            }
            Err(e) => panic!(
                "reading the answer to an oversized body: {e} (got {:?})",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
    let _ = writer.join();
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {head:?}"));
    // The error body is small: either sent with a length, or as one chunk.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body.split_once("\r\n")
            .map(|(_, rest)| rest.split("\r\n").next().unwrap_or(""))
            .unwrap_or("")
            .to_owned()
    } else {
        body.to_owned()
    };
    (status, body)
}

/// Deterministic pseudo-random bytes: byte `i` of the stream is a function of `i` alone.
pub struct Pattern {
    pub pos: u64,
    pub len: u64,
}

fn pattern_word(i: u64) -> u64 {
    // splitmix64
    let mut z = i
        .wrapping_add(0x9E37_79B9_7F4A_7C15)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 30)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `buf` with the pattern's bytes from `offset`.
pub fn pattern_fill(offset: u64, buf: &mut [u8]) {
    let mut i = 0;
    while i < buf.len() {
        let p = offset + i as u64;
        let (w, k) = (pattern_word(p / 8).to_le_bytes(), (p % 8) as usize);
        let n = (8 - k).min(buf.len() - i);
        buf[i..i + n].copy_from_slice(&w[k..k + n]);
        i += n;
    }
}

impl Read for Pattern {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (self.len - self.pos).min(buf.len() as u64) as usize;
        pattern_fill(self.pos, &mut buf[..n]);
        self.pos += n as u64;
        Ok(n)
    }
}

/// A browser's terminal: mints a ticket for `sandbox` through `mint_at`, and answers a
/// function that opens `/v1/sandboxes/{sandbox}/pty` at `url` (no key; the ticket as the
/// WebSocket subprotocol, `Origin` that server's own), runs `echo` in it and closes it:
/// `Ok` once the shell answered, else the refusal's HTTP status.
pub fn browser_terminal(
    mint_at: &crate::server::Api,
    sandbox: &str,
) -> impl Fn(&str) -> Result<(), u16> {
    let t = mint_at
        .post_empty(&format!("/v1/sandboxes/{sandbox}/pty/ticket"))
        .expect(201, "a terminal ticket");
    let protos = t["protocols"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect::<Vec<_>>()
        .join(", ");
    let sandbox = sandbox.to_owned();
    move |url: &str| {
        use tungstenite::client::IntoClientRequest;
        let addr = url.trim_start_matches("http://");
        let mut req = format!("ws://{addr}/v1/sandboxes/{sandbox}/pty")
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("Sec-WebSocket-Protocol", protos.parse().unwrap());
        req.headers_mut().insert("Origin", url.parse().unwrap());
        let stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let (mut ws, resp) = match tungstenite::client(req, stream) {
            Ok(x) => x,
            Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(r))) => {
                return Err(r.status().as_u16())
            }
            Err(e) => panic!("the browser's handshake: {e}"),
        };
        assert_eq!(resp.headers()["sec-websocket-protocol"], "locker-pty");
        let mut seen = String::new();
        ws.send(tungstenite::Message::binary(
            b"echo tick$((6*7))et\n".to_vec(),
        ))
        .unwrap();
        read_until(&mut ws, "tick42et", &mut seen);
        Ok(())
    }
}
