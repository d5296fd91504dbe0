//! HTTP/1.1 on the wire for the port routes' direct path: body framing ([`Framing`], the
//! chunked scanner), heads read and written, and the relay of one body between two TCP
//! sockets ([`relay`]). Shared by the routes' own HTTP/1.1 handling ([`super::front`]) and
//! the proxy ([`super::proxy`]); it knows nothing of sandboxes, auth or routes.
//!
//! A body is copied through a buffer that grows while the sender keeps it full (see
//! [`BODY_CHUNK_MAX`]). `splice(2)` (socket → pipe → socket, no copy into this process) was
//! built first and measured slower on Linux 6.18: spliced segments cost the receiving
//! client twice what fresh ones do, and the pipe's 1 MiB bounded each call; large reads
//! and writes took less CPU in all (docs/benchmarks.md, "Ports").

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use bytes::{Buf, BufMut, BytesMut};
use tokio::net::TcpStream;

/// A body's reads start at this size...
const READ_CHUNK: usize = 64 * 1024;

/// ... and grow fourfold each time one fills its buffer, up to this: a large, fast body
/// then moves in a few big reads and writes (fewer calls, and segments the client's kernel
/// takes whole). Measured: a 1 GiB download went at 35% of a direct connection's rate in
/// 64 KiB pieces and 58% in 4 MiB ones, with half the server's CPU per GiB.
const BODY_CHUNK_MAX: usize = 4 << 20;

/// What the relays of the whole server may hold together beyond [`READ_CHUNK`] each: past
/// it a body keeps the size it has (many large downloads at once cost memory, not failure).
const GROWN_MAX: usize = 256 << 20;

/// Bytes of [`GROWN_MAX`] held now.
static GROWN: AtomicUsize = AtomicUsize::new(0);

/// The most headers a head may have (hyper's limit, which the proxy had before).
pub(crate) const MAX_HEADERS: usize = 100;

/// The largest response head a machine may send (about hyper's read buffer limit).
const MAX_RESPONSE_HEAD: usize = 400 * 1024;

/// How a message's body is delimited (RFC 9112 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body (a request without one; HEAD, 1xx, 204, 304 answers).
    Empty,
    /// `Content-Length`.
    Length(u64),
    /// `Transfer-Encoding: chunked`, passed on as it came.
    Chunked,
    /// Until the sender closes (a response with neither).
    Eof,
}

/// Why a body stopped before its end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RelayError {
    #[error("reading the body: {0}")]
    Read(io::Error),
    #[error("writing the body: {0}")]
    Write(io::Error),
    #[error("the sender closed the connection {0} bytes before the body's end")]
    Cut(u64),
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
}

/// Writes all of `b` to `s`.
pub(crate) async fn write_all(s: &TcpStream, mut b: &[u8]) -> io::Result<()> {
    while !b.is_empty() {
        match s.try_write(b) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => b = &b[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => s.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads what `s` has into `buf` (waiting for something); 0 at its end.
pub(crate) async fn read_more(s: &TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    read_up_to(s, buf, READ_CHUNK).await
}

/// Reads at most `want` bytes of what `s` has into `buf` (waiting for something); 0 at
/// its end.
async fn read_up_to(s: &TcpStream, buf: &mut BytesMut, want: usize) -> io::Result<usize> {
    buf.reserve(want);
    loop {
        match s.try_read_buf(&mut (&mut *buf).limit(want)) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => s.readable().await?,
            Err(e) => return Err(e),
        }
    }
}

/// One relay's share of [`GROWN_MAX`] (its reads are [`READ_CHUNK`] plus that), grown
/// while its reads come back full (see [`BODY_CHUNK_MAX`]) and given back when dropped.
struct Sizer {
    held: usize,
}

impl Sizer {
    fn new() -> Self {
        Sizer { held: 0 }
    }

    /// How much the next read asks for.
    fn chunk(&self) -> usize {
        READ_CHUNK + self.held
    }

    /// A read of `want` bytes brought `got`: a full one grows the next fourfold, if the
    /// server's budget allows.
    fn after_read(&mut self, want: usize, got: usize) {
        let chunk = self.chunk();
        if got < want || want < chunk || chunk >= BODY_CHUNK_MAX {
            return;
        }
        let add = (chunk * 4).min(BODY_CHUNK_MAX) - chunk;
        let taken = GROWN.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
            (held + add <= GROWN_MAX).then_some(held + add)
        });
        if taken.is_ok() {
            self.held += add;
        }
    }
}

impl Drop for Sizer {
    fn drop(&mut self) {
        GROWN.fetch_sub(self.held, Ordering::Relaxed);
    }
}

/// Moves `n` bytes (all until its end when `None`) from `src` to `dst` through `buf`
/// (empty on entry, empty again on return), each read written whole before the next.
/// Returns the bytes moved, fewer than `n` only when `src` ended.
async fn copy_n<F: Fn()>(
    src: &TcpStream,
    dst: &TcpStream,
    buf: &mut BytesMut,
    n: Option<u64>,
    sizer: &mut Sizer,
    progress: &F,
) -> Result<u64, RelayError> {
    let mut taken = 0u64;
    while n.is_none_or(|n| taken < n) {
        let chunk = sizer.chunk();
        let want = n.map_or(chunk, |n| (n - taken).min(chunk as u64) as usize);
        let got = read_up_to(src, buf, want).await.map_err(RelayError::Read)?;
        if got == 0 {
            break;
        }
        sizer.after_read(want, got);
        write_all(dst, buf).await.map_err(RelayError::Write)?;
        buf.clear();
        taken += got as u64;
        progress();
    }
    Ok(taken)
}

/// Writes the first `k` bytes of `buf` (already read) to `dst` and drops them from `buf`.
async fn send_front<F: Fn()>(
    dst: &TcpStream,
    buf: &mut BytesMut,
    k: usize,
    progress: &F,
) -> Result<(), RelayError> {
    if k > 0 {
        write_all(dst, &buf[..k]).await.map_err(RelayError::Write)?;
        buf.advance(k);
        progress();
    }
    Ok(())
}

/// Moves exactly `left` bytes from `src` to `dst` (`buf` is empty).
async fn move_exact<F: Fn()>(
    src: &TcpStream,
    dst: &TcpStream,
    buf: &mut BytesMut,
    left: u64,
    sizer: &mut Sizer,
    progress: &F,
) -> Result<(), RelayError> {
    let moved = copy_n(src, dst, buf, Some(left), sizer, progress).await?;
    if moved < left {
        Err(RelayError::Cut(left - moved))
    } else {
        Ok(())
    }
}

/// Moves one body framed by `framing` from `src` to `dst`, starting with what `buf` holds
/// (bytes already read past the head). A chunked body goes as it came, framing and all.
/// On success `buf` holds what was read past the body's end; a buffer grown for a large
/// body is given back whichever way it ends (the connection may stay open long after).
pub(crate) async fn relay<F: Fn()>(
    src: &TcpStream,
    dst: &TcpStream,
    buf: &mut BytesMut,
    framing: Framing,
    progress: &F,
) -> Result<(), RelayError> {
    let r = relay_body(src, dst, buf, framing, &mut Sizer::new(), progress).await;
    if buf.capacity() > 2 * READ_CHUNK {
        *buf = BytesMut::from(&buf[..]);
    }
    r
}

async fn relay_body<F: Fn()>(
    src: &TcpStream,
    dst: &TcpStream,
    buf: &mut BytesMut,
    framing: Framing,
    sizer: &mut Sizer,
    progress: &F,
) -> Result<(), RelayError> {
    match framing {
        Framing::Empty => Ok(()),
        Framing::Length(n) => {
            let now = (buf.len() as u64).min(n) as usize;
            send_front(dst, buf, now, progress).await?;
            move_exact(src, dst, buf, n - now as u64, sizer, progress).await
        }
        Framing::Eof => {
            send_front(dst, buf, buf.len(), progress).await?;
            copy_n(src, dst, buf, None, sizer, progress).await.map(drop)
        }
        Framing::Chunked => {
            let mut scan = Chunked::default();
            loop {
                let mut pass = 0;
                let mut done = false;
                while pass < buf.len() {
                    match scan.step(&buf[pass..]).map_err(RelayError::Chunked)? {
                        Step::Meta(k) | Step::Data(k) => pass += k,
                        Step::Done(k) => {
                            pass += k;
                            done = true;
                            break;
                        }
                    }
                }
                send_front(dst, buf, pass, progress).await?;
                if done {
                    return Ok(());
                }
                // Everything buffered went out (the scanner takes all it is given until
                // the end): a large chunk's data moves without being scanned.
                match scan.data_left() {
                    Some(left) if left >= READ_CHUNK as u64 => {
                        move_exact(src, dst, buf, left, sizer, progress).await?;
                        scan.data_moved(left);
                    }
                    _ => {
                        if read_more(src, buf).await.map_err(RelayError::Read)? == 0 {
                            return Err(RelayError::Cut(scan.data_left().unwrap_or(0)));
                        }
                    }
                }
            }
        }
    }
}

/// What the next bytes of a chunked body are.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// This many bytes of framing (sizes, extensions, line ends, trailers).
    Meta(usize),
    /// This many bytes of data.
    Data(usize),
    /// This many bytes of framing, ending the body.
    Done(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    Size { n: u64, digits: u8 },
    Ext { n: u64, len: usize },
    SizeLf { n: u64 },
    Data(u64),
    DataCr,
    DataLf,
    Trailer { len: usize, line_start: bool },
    TrailerLf { end: bool, len: usize },
    Done,
}

/// A scanner of `Transfer-Encoding: chunked` (RFC 9112 7.1), fed the body's bytes in order.
#[derive(Debug)]
pub(crate) struct Chunked(St);

impl Default for Chunked {
    fn default() -> Self {
        Chunked(St::Size { n: 0, digits: 0 })
    }
}

impl Chunked {
    /// Takes the next piece of `input` (not empty).
    pub(crate) fn step(&mut self, input: &[u8]) -> Result<Step, &'static str> {
        if let St::Data(left) = self.0 {
            let k = (input.len() as u64).min(left) as usize;
            self.0 = if k as u64 == left {
                St::DataCr
            } else {
                St::Data(left - k as u64)
            };
            return Ok(Step::Data(k));
        }
        let mut used = 0;
        for &b in input {
            used += 1;
            self.0 = match (self.0, b) {
                (St::Size { digits: 16, .. }, b) if b.is_ascii_hexdigit() => {
                    return Err("a chunk size past 16 hex digits")
                }
                (St::Size { n, digits }, b) if b.is_ascii_hexdigit() => St::Size {
                    n: n * 16 + u64::from((b as char).to_digit(16).unwrap_or(0)),
                    digits: digits + 1,
                },
                (St::Size { digits: 0, .. }, _) => return Err("a chunk without a size"),
                (St::Size { n, .. }, b';' | b' ' | b'\t') => St::Ext { n, len: 0 },
                (St::Size { n, .. } | St::Ext { n, .. }, b'\r') => St::SizeLf { n },
                (St::Size { .. }, _) => return Err("a chunk size that is not hexadecimal"),
                (St::Ext { len: 4096, .. }, _) => return Err("a chunk extension past 4 KiB"),
                (St::Ext { .. }, b'\n') => return Err("a bare line feed after a chunk size"),
                (St::Ext { n, len }, _) => St::Ext { n, len: len + 1 },
                (St::SizeLf { n: 0 }, b'\n') => St::Trailer {
                    len: 0,
                    line_start: true,
                },
                (St::SizeLf { n }, b'\n') => {
                    self.0 = St::Data(n);
                    return Ok(Step::Meta(used));
                }
                (St::DataCr, b'\r') => St::DataLf,
                (St::DataLf, b'\n') => St::Size { n: 0, digits: 0 },
                (St::Trailer { len, line_start }, b'\r') => St::TrailerLf {
                    end: line_start,
                    len,
                },
                (St::Trailer { len: 16384.., .. }, _) => return Err("trailers past 16 KiB"),
                (St::Trailer { len, .. }, _) => St::Trailer {
                    len: len + 1,
                    line_start: false,
                },
                (St::TrailerLf { end: true, .. }, b'\n') => {
                    self.0 = St::Done;
                    return Ok(Step::Done(used));
                }
                (St::TrailerLf { end: false, len }, b'\n') => St::Trailer {
                    len,
                    line_start: true,
                },
                (St::Done, _) => return Err("bytes after the last chunk"),
                _ => return Err("a chunk line that does not end in CRLF"),
            };
        }
        Ok(Step::Meta(used))
    }

    /// The data bytes left in the current chunk, when in one.
    pub(crate) fn data_left(&self) -> Option<u64> {
        match self.0 {
            St::Data(n) => Some(n),
            _ => None,
        }
    }

    /// `n` data bytes of the current chunk went by without being scanned.
    pub(crate) fn data_moved(&mut self, n: u64) {
        if let St::Data(left) = self.0 {
            self.0 = if n >= left {
                St::DataCr
            } else {
                St::Data(left - n)
            };
        }
    }
}

/// A response head off the wire.
pub(crate) struct ResponseHead {
    pub status: StatusCode,
    pub headers: HeaderMap,
}

/// Reads a response head from `s` into `buf` (informational answers but 101 skipped); what
/// came after it stays in `buf`. The error says what was wrong, for a 502.
pub(crate) async fn read_response_head(
    s: &TcpStream,
    buf: &mut BytesMut,
) -> Result<ResponseHead, String> {
    loop {
        if !buf.is_empty() {
            let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut r = httparse::Response::new(&mut slots);
            let parsed = r.parse(buf).map_err(|e| match e {
                httparse::Error::TooManyHeaders => {
                    format!("more than {MAX_HEADERS} headers in the response")
                }
                e => format!("{e} in the response head"),
            })?;
            if let httparse::Status::Complete(len) = parsed {
                let code = r.code.unwrap_or(0);
                let status = StatusCode::from_u16(code)
                    .map_err(|_| format!("status code {code} is not one"))?;
                let headers = header_map(r.headers)?;
                buf.advance(len);
                if status.is_informational() && status != StatusCode::SWITCHING_PROTOCOLS {
                    continue;
                }
                return Ok(ResponseHead { status, headers });
            }
        }
        if buf.len() > MAX_RESPONSE_HEAD {
            return Err(format!(
                "the response head is larger than {} KiB",
                MAX_RESPONSE_HEAD / 1024
            ));
        }
        let n = read_more(s, buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(if buf.is_empty() {
                "the connection closed before a response".to_owned()
            } else {
                "the connection closed in the middle of the response head".to_owned()
            });
        }
    }
}

/// Headers as parsed, or what is wrong with one.
pub(crate) fn header_map(parsed: &[httparse::Header<'_>]) -> Result<HeaderMap, String> {
    let mut map = HeaderMap::with_capacity(parsed.len());
    for h in parsed {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| format!("invalid header name {:?}", h.name))?;
        let value = HeaderValue::from_bytes(h.value)
            .map_err(|_| format!("invalid value of header {}", h.name))?;
        map.append(name, value);
    }
    Ok(map)
}

/// Whether the last of the message's transfer codings is chunked (`None`: no
/// `Transfer-Encoding` at all).
fn chunked_last(headers: &HeaderMap) -> Option<bool> {
    let codings: Vec<String> = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("?").split(','))
        .map(|c| c.trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty())
        .collect();
    if headers.contains_key(header::TRANSFER_ENCODING) {
        Some(codings.last().is_some_and(|c| c == "chunked"))
    } else {
        None
    }
}

/// The one `Content-Length` of a message (repeats must agree), `Ok(None)` without one.
pub(crate) fn content_length(headers: &HeaderMap) -> Result<Option<u64>, &'static str> {
    let mut found = None;
    for v in headers.get_all(header::CONTENT_LENGTH) {
        for part in v
            .to_str()
            .map_err(|_| "a Content-Length that is not a number")?
            .split(',')
        {
            let part = part.trim();
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) || part.len() > 19 {
                return Err("a Content-Length that is not a number");
            }
            let n: u64 = part
                .parse()
                .map_err(|_| "a Content-Length that is not a number")?;
            if found.is_some_and(|f| f != n) {
                return Err("Content-Length headers that disagree");
            }
            found = Some(n);
        }
    }
    Ok(found)
}

/// A request's body framing, or why it is one the port routes leave to hyper (which answers
/// it with its own 400).
pub(crate) fn request_framing(headers: &HeaderMap) -> Result<Framing, &'static str> {
    let length = content_length(headers)?;
    match chunked_last(headers) {
        Some(true) if length.is_none() => Ok(Framing::Chunked),
        Some(_) => Err("a Transfer-Encoding this server does not take with it"),
        None => Ok(match length {
            Some(0) | None => Framing::Empty,
            Some(n) => Framing::Length(n),
        }),
    }
}

/// A response's body framing (RFC 9112 6.3).
pub(crate) fn response_framing(
    to_head: bool,
    status: StatusCode,
    headers: &HeaderMap,
) -> Result<Framing, &'static str> {
    if to_head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Empty);
    }
    match chunked_last(headers) {
        Some(true) => Ok(Framing::Chunked),
        Some(false) => Ok(Framing::Eof),
        None => Ok(match content_length(headers)? {
            Some(n) => Framing::Length(n),
            None => Framing::Eof,
        }),
    }
}

/// Sets the framing headers of a message to send: one `Content-Length` or
/// `Transfer-Encoding: chunked`, or neither (an empty message keeps what it had: a HEAD's
/// answer names the length of what GET would send).
pub(crate) fn set_framing(headers: &mut HeaderMap, framing: Framing) {
    if framing == Framing::Empty {
        return;
    }
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::TRANSFER_ENCODING);
    match framing {
        Framing::Length(n) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        Framing::Chunked => {
            headers.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
        }
        Framing::Empty | Framing::Eof => {}
    }
}

fn put_headers(out: &mut Vec<u8>, headers: &HeaderMap) {
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// An HTTP/1.1 request head.
pub(crate) fn request_head(method: &Method, target: &str, headers: &HeaderMap) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + 64 * headers.len());
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    put_headers(&mut out, headers);
    out
}

/// An HTTP/1.1 response head.
pub(crate) fn response_head(status: StatusCode, headers: &HeaderMap) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + 64 * headers.len());
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    put_headers(&mut out, headers);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The only test here that moves bodies or grows buffers: [`GROWN`] is the process's.
    #[tokio::test]
    async fn a_body_buffer_grows_while_reads_fill_it_and_is_given_back() {
        // Full reads grow the next one fourfold to the cap; a short one does not.
        let mut z = Sizer::new();
        z.after_read(READ_CHUNK, READ_CHUNK / 2);
        assert_eq!(z.chunk(), READ_CHUNK);
        let mut sizes = vec![z.chunk()];
        for _ in 0..5 {
            z.after_read(z.chunk(), z.chunk());
            sizes.push(z.chunk());
        }
        assert_eq!(
            sizes,
            [64 << 10, 256 << 10, 1 << 20, 4 << 20, 4 << 20, 4 << 20]
        );
        assert_eq!(GROWN.load(Ordering::Relaxed), BODY_CHUNK_MAX - READ_CHUNK);
        drop(z);
        assert_eq!(GROWN.load(Ordering::Relaxed), 0);

        // With the server's budget spent, a body keeps the size it has.
        GROWN.store(GROWN_MAX - READ_CHUNK, Ordering::Relaxed);
        let mut z = Sizer::new();
        z.after_read(READ_CHUNK, READ_CHUNK);
        assert_eq!((z.chunk(), z.held), (READ_CHUNK, 0));
        drop(z);
        GROWN.store(0, Ordering::Relaxed);

        // 24 MiB through a relay between two loopback connections: whole and in order,
        // and the grown buffer is gone afterwards (the connection may idle for long).
        let pair = || async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
            let (b, _) = l.accept().await.unwrap();
            (a, b)
        };
        let ((mut sender, src), (dst, mut receiver)) = (pair().await, pair().await);
        let n: usize = 24 << 20;
        let body: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        let sent = body.clone();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            sender.write_all(&sent).await.unwrap();
            sender.write_all(b"NEXT").await.unwrap();
            sender
        });
        let reader = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut got = vec![0u8; n];
            receiver.read_exact(&mut got).await.unwrap();
            got
        });
        let mut buf = BytesMut::new();
        relay(&src, &dst, &mut buf, Framing::Length(n as u64), &|| {})
            .await
            .unwrap();
        let _sender = writer.await.unwrap();
        assert!(reader.await.unwrap() == body, "the body came out changed");
        assert!(buf.capacity() <= 2 * READ_CHUNK, "{} kept", buf.capacity());
        assert_eq!(GROWN.load(Ordering::Relaxed), 0);
        // Nothing past the body was read into it: the next message is still there.
        let mut next = BytesMut::new();
        while next.len() < 4 {
            read_more(&src, &mut next).await.unwrap();
        }
        assert_eq!(&next[..], b"NEXT");
    }

    /// Feeds `wire` to a scanner in pieces of `piece` bytes: the data, and where the body
    /// ended.
    fn decode(wire: &[u8], piece: usize) -> Result<(Vec<u8>, usize), &'static str> {
        let mut c = Chunked::default();
        let mut data = Vec::new();
        let mut pos = 0;
        for part in wire.chunks(piece) {
            let mut at = 0;
            while at < part.len() {
                let k = match c.step(&part[at..])? {
                    Step::Meta(k) => k,
                    Step::Data(k) => {
                        data.extend_from_slice(&part[at..at + k]);
                        k
                    }
                    Step::Done(k) => return Ok((data, pos + at + k)),
                };
                at += k;
            }
            pos += part.len();
        }
        Err("not ended")
    }

    #[test]
    fn chunked_bodies_are_scanned_to_their_end_in_any_pieces() {
        let wire = b"5;ext=1\r\nhello\r\n0006\r\n world\r\n0\r\nX-T: 1\r\n\r\nNEXT";
        for piece in [1, 2, 3, 7, 64] {
            let (data, end) = decode(wire, piece).unwrap();
            assert_eq!(data, b"hello world", "piece {piece}");
            assert_eq!(&wire[end..], b"NEXT", "piece {piece}");
        }
        let (data, end) = decode(b"0\r\n\r\n", 1).unwrap();
        assert!(data.is_empty());
        assert_eq!(end, 5);
        for bad in [
            &b"x\r\n"[..],
            b"\r\n",
            b"5\nhello",
            b"5\r\nhelloX\r\n",
            b"11111111111111111\r\n",
        ] {
            assert!(
                decode(bad, 64).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let mut c = Chunked::default();
        assert_eq!(c.step(b"100000\r\n").unwrap(), Step::Meta(8));
        assert_eq!(c.data_left(), Some(0x100000));
        c.data_moved(0x100000);
        assert_eq!(c.step(b"\r\n0\r\n\r\n").unwrap(), Step::Done(7));
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let h = |pairs: &[(&str, &str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in pairs {
                m.append(
                    HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            m
        };
        let ok = StatusCode::OK;
        assert_eq!(
            response_framing(false, ok, &h(&[("content-length", "10")])),
            Ok(Framing::Length(10))
        );
        assert_eq!(
            response_framing(
                false,
                ok,
                &h(&[
                    ("transfer-encoding", "gzip, chunked"),
                    ("content-length", "3")
                ])
            ),
            Ok(Framing::Chunked)
        );
        assert_eq!(response_framing(false, ok, &h(&[])), Ok(Framing::Eof));
        assert_eq!(
            response_framing(true, ok, &h(&[("content-length", "10")])),
            Ok(Framing::Empty)
        );
        assert_eq!(
            response_framing(false, StatusCode::NOT_MODIFIED, &h(&[])),
            Ok(Framing::Empty)
        );
        assert!(response_framing(
            false,
            ok,
            &h(&[("content-length", "1"), ("content-length", "2")])
        )
        .is_err());
        assert!(response_framing(false, ok, &h(&[("content-length", "-1")])).is_err());
        assert_eq!(request_framing(&h(&[])), Ok(Framing::Empty));
        assert_eq!(
            request_framing(&h(&[("content-length", "5, 5")])),
            Ok(Framing::Length(5))
        );
        assert_eq!(
            request_framing(&h(&[("transfer-encoding", "chunked")])),
            Ok(Framing::Chunked)
        );
        assert!(request_framing(&h(&[("transfer-encoding", "gzip")])).is_err());
        assert!(request_framing(&h(&[
            ("transfer-encoding", "chunked"),
            ("content-length", "5")
        ]))
        .is_err());
    }
}
