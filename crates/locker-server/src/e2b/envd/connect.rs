//! The Connect protocol (connectrpc.com/docs/protocol), JSON codec only, as E2B's SDKs
//! speak it to envd: unary calls (`application/json`), server- and client-streaming calls
//! (`application/connect+json`, 5-byte envelopes, an end-of-stream envelope always last),
//! Connect's error codes and JSON, and `Connect-Timeout-Ms`.
//!
//! Hand-written rather than a crate: the part E2B uses is small (no binary codec, no
//! compression, no gRPC), and the Rust Connect crates bring a protobuf toolchain and code
//! generation that would cost every build on two cores more than this file.
//!
//! Hostile input: every envelope is checked before its payload is read (length bound,
//! flags), a body that ends inside an envelope or a header that takes too long is a Connect
//! error, never a panic, a 500 or a hang.

use std::time::Duration;

use axum::body::{Body, BodyDataStream};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, Bytes, BytesMut};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;

use crate::error::ApiError;

/// The largest message (unary body or envelope payload) a client may send: far above what
/// the SDKs send (an input chunk of a few KiB), small enough to bound what one call holds.
pub const MAX_MESSAGE: usize = 4 << 20;
/// How long the single request message of a unary or server-streaming call may take to
/// arrive (a client that opens a call and sends nothing is let go).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// Connect's error codes (the protocol's whole set; not every one is sent here).
#[allow(dead_code)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub fn name(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the protocol's table).
    pub fn status(self) -> StatusCode {
        let s = match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal | Code::DataLoss => 500,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists | Code::Aborted => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        };
        StatusCode::from_u16(s).expect("valid status")
    }
}

/// A Connect error: a code and a message that says what to fix.
#[derive(Debug, Clone)]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(Code::NotFound, m)
    }
    pub fn json(&self) -> serde_json::Value {
        json!({"code": self.code.name(), "message": self.message})
    }
}

/// Locker's own failures keep their meaning: the HTTP status picks the code.
impl From<ApiError> for ConnectError {
    fn from(e: ApiError) -> Self {
        let code = match e.status.as_u16() {
            400 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            409 => Code::FailedPrecondition,
            408 | 504 => Code::DeadlineExceeded,
            413 | 429 | 507 => Code::ResourceExhausted,
            501 => Code::Unimplemented,
            502 | 503 => Code::Unavailable,
            _ => Code::Internal,
        };
        if code == Code::Internal {
            tracing::error!(status = e.status.as_u16(), message = %e.message, "envd call failed");
        }
        Self::new(code, e.message)
    }
}

/// A unary call's error answer.
impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        (self.code.status(), axum::Json(self.json())).into_response()
    }
}

/// A unary call's success answer: the message as JSON.
pub fn unary_ok<T: Serialize>(msg: &T) -> Response {
    (StatusCode::OK, axum::Json(msg)).into_response()
}

/// The three call shapes E2B uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Unary,
    ServerStream,
    ClientStream,
}

fn media_type(h: &HeaderMap) -> String {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

/// Checks the request's protocol headers for a call of `shape`: its content type (JSON
/// only), its compression (identity only) and its timeout, which it returns.
pub fn check_request(h: &HeaderMap, shape: Shape) -> Result<Option<Duration>, ConnectError> {
    let mt = media_type(h);
    let want = match shape {
        Shape::Unary => "application/json",
        _ => "application/connect+json",
    };
    if mt != want {
        let hint = if mt.ends_with("proto") {
            " (only the JSON codec is served: the SDKs never send binary protobuf)"
        } else {
            ""
        };
        return Err(ConnectError::invalid(format!(
            "Content-Type {mt:?}: this method takes {want:?}{hint}"
        )));
    }
    let enc_header = match shape {
        Shape::Unary => header::CONTENT_ENCODING.as_str(),
        _ => "connect-content-encoding",
    };
    if let Some(enc) = h.get(enc_header).and_then(|v| v.to_str().ok()) {
        if !enc.trim().eq_ignore_ascii_case("identity") {
            return Err(ConnectError::new(
                Code::Unimplemented,
                format!("{enc_header} {enc:?}: only identity (no compression) is served"),
            ));
        }
    }
    timeout(h)
}

/// `Connect-Timeout-Ms`: at most 10 ASCII digits, per the protocol.
pub fn timeout(h: &HeaderMap) -> Result<Option<Duration>, ConnectError> {
    let Some(v) = h.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let s = v.to_str().unwrap_or("").trim();
    if s.is_empty() || s.len() > 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ConnectError::invalid(format!(
            "Connect-Timeout-Ms {v:?} must be 1 to 10 digits (milliseconds)"
        )));
    }
    let ms: u64 = s.parse().expect("digits");
    Ok(Some(Duration::from_millis(ms)))
}

/// Parses a ProtoJSON message; unknown fields are ignored (as connect-go's codec does),
/// wrong types are `invalid_argument`.
pub fn parse<T: DeserializeOwned>(what: &str, data: &[u8]) -> Result<T, ConnectError> {
    let data = if data.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        data
    };
    serde_json::from_slice(data)
        .map_err(|e| ConnectError::invalid(format!("invalid ProtoJSON for {what}: {e}")))
}

/// Reads a unary call's body (bounded, within [`REQUEST_DEADLINE`]) and parses it.
pub async fn read_unary<T: DeserializeOwned>(what: &str, body: Body) -> Result<T, ConnectError> {
    let bytes =
        match tokio::time::timeout(REQUEST_DEADLINE, axum::body::to_bytes(body, MAX_MESSAGE)).await
        {
            Err(_) => {
                return Err(ConnectError::new(
                    Code::DeadlineExceeded,
                    "the request body did not arrive in time",
                ))
            }
            Ok(Err(e)) => {
                return Err(ConnectError::new(
                    Code::ResourceExhausted,
                    format!(
                        "request body unreadable or over {} MiB: {e}",
                        MAX_MESSAGE >> 20
                    ),
                ))
            }
            Ok(Ok(b)) => b,
        };
    parse(what, &bytes)
}

/// The envelopes of a streaming request body, read one at a time.
pub struct Envelopes {
    body: BodyDataStream,
    buf: BytesMut,
    ended: bool,
}

impl Envelopes {
    pub fn new(body: Body) -> Self {
        Self {
            body: body.into_data_stream(),
            buf: BytesMut::new(),
            ended: false,
        }
    }

    /// Fills the buffer to `n` bytes; false when the body ended first.
    async fn fill(&mut self, n: usize) -> Result<bool, ConnectError> {
        while self.buf.len() < n {
            if self.ended {
                return Ok(false);
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => {
                    return Err(ConnectError::new(
                        Code::Canceled,
                        format!("reading the request body: {e}"),
                    ))
                }
                None => self.ended = true,
            }
        }
        Ok(true)
    }

    /// The next message's raw JSON, `None` at a clean end of the body.
    pub async fn next_raw(&mut self) -> Result<Option<Bytes>, ConnectError> {
        if !self.fill(1).await? {
            return Ok(None);
        }
        if !self.fill(5).await? {
            return Err(ConnectError::invalid(format!(
                "truncated envelope: the body ended {} bytes into a 5-byte envelope header",
                self.buf.len()
            )));
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if flags & 0x01 != 0 {
            return Err(ConnectError::invalid(
                "envelope has the compressed flag set, but no Connect-Content-Encoding was \
                 negotiated: send messages uncompressed",
            ));
        }
        if flags != 0 {
            return Err(ConnectError::invalid(format!(
                "envelope flags {flags:#04x}: a request message must have flags 0 (the \
                 end-of-stream flag is the server's)"
            )));
        }
        if len > MAX_MESSAGE {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!(
                    "envelope of {len} bytes is over the {} MiB message limit",
                    MAX_MESSAGE >> 20
                ),
            ));
        }
        if !self.fill(5 + len).await? {
            return Err(ConnectError::invalid(format!(
                "truncated envelope: it announces {len} bytes but the body ended after {}",
                self.buf.len() - 5
            )));
        }
        self.buf.advance(5);
        Ok(Some(self.buf.split_to(len).freeze()))
    }

    /// The next message, parsed.
    pub async fn next<T: DeserializeOwned>(
        &mut self,
        what: &str,
    ) -> Result<Option<T>, ConnectError> {
        match self.next_raw().await? {
            None => Ok(None),
            Some(raw) => parse(what, &raw).map(Some),
        }
    }

    /// The single request message of a server-streaming call: exactly one envelope,
    /// within [`REQUEST_DEADLINE`].
    pub async fn single<T: DeserializeOwned>(mut self, what: &str) -> Result<T, ConnectError> {
        let read = async {
            let Some(msg) = self.next::<T>(what).await? else {
                return Err(ConnectError::invalid(format!(
                    "{what}: the request body holds no message (one enveloped message expected)"
                )));
            };
            if self.next_raw().await?.is_some() {
                return Err(ConnectError::invalid(format!(
                    "{what}: more than one request message in a server-streaming call"
                )));
            }
            Ok(msg)
        };
        match tokio::time::timeout(REQUEST_DEADLINE, read).await {
            Ok(r) => r,
            Err(_) => Err(ConnectError::new(
                Code::DeadlineExceeded,
                format!("{what}: the request message did not arrive in time"),
            )),
        }
    }
}

/// One envelope: flags, big-endian length, payload.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.into()
}

/// The sending side of a streaming answer.
pub struct StreamOut {
    tx: crate::stream::CutSender,
}

impl StreamOut {
    /// Sends one message; false once the client has gone.
    pub async fn send<T: Serialize>(&self, msg: &T) -> bool {
        let payload = serde_json::to_vec(msg).expect("messages serialize");
        self.tx.send(Ok(envelope(0, &payload))).await.is_ok()
    }

    /// Waits until the client has gone.
    pub async fn closed(&self) {
        self.tx.closed().await
    }

    /// Ends the stream: the end-of-stream envelope, with the error if there is one.
    pub async fn end(self, err: Option<ConnectError>) {
        let body = match err {
            None => json!({}),
            Some(e) => json!({"error": e.json()}),
        };
        let payload = serde_json::to_vec(&body).expect("json");
        let _ = self.tx.send(Ok(envelope(0x02, &payload))).await;
    }

    /// Cuts the stream short, with no end-of-stream envelope: what a client sees when the
    /// sandbox behind it went (E2B's proxy drops the stream of a killed sandbox; the SDKs
    /// then probe `/health` and say the sandbox was killed or reached its end of life).
    pub async fn cut(self, why: &str) {
        let _ = self.tx.send(Err(crate::stream::cut(why))).await;
    }
}

/// A streaming answer: HTTP 200, `Content-Type: application/connect+json` exactly (the
/// Python client refuses parameters), the envelopes sent on the returned [`StreamOut`].
pub fn stream_response() -> (StreamOut, Response) {
    let (tx, body) = crate::stream::cuttable_body(16);
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    (StreamOut { tx }, resp)
}

/// A streaming answer of one message (a client-streaming call's).
pub fn stream_once<T: Serialize>(msg: &T) -> Response {
    let payload = serde_json::to_vec(msg).expect("messages serialize");
    let mut body = envelope(0, &payload).to_vec();
    body.extend_from_slice(&envelope(0x02, b"{}"));
    let mut resp = Response::new(Body::from(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    resp
}

/// A streaming call that failed before its first message: 200 and the end-of-stream
/// envelope with the error (how Connect reports errors of streaming calls).
pub fn stream_error(e: ConnectError) -> Response {
    let payload = serde_json::to_vec(&json!({"error": e.json()})).expect("json");
    let mut resp = Response::new(Body::from(envelope(0x02, &payload)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    resp
}

/// ProtoJSON scalars as clients write them: 64-bit (and, tolerated, 32-bit) integers as
/// numbers or decimal strings, enums as names or numbers.
pub mod pj {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NumOrStr {
        N(i64),
        S(String),
    }

    fn int<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
        match Option::<NumOrStr>::deserialize(d)? {
            None => Ok(None),
            Some(NumOrStr::N(n)) => Ok(Some(n)),
            Some(NumOrStr::S(s)) => s
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| serde::de::Error::custom(format!("{s:?} is not an integer"))),
        }
    }

    /// An optional unsigned 32-bit integer.
    pub fn opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        match int(d)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| serde::de::Error::custom(format!("{n} is not a uint32"))),
        }
    }

    /// An enum value: its name, or its number as text.
    pub fn opt_enum<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        match Option::<NumOrStr>::deserialize(d)? {
            None => Ok(None),
            Some(NumOrStr::N(n)) => Ok(Some(n.to_string())),
            Some(NumOrStr::S(s)) => Ok(Some(s)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn read_all(bytes: Vec<u8>) -> Result<Vec<serde_json::Value>, ConnectError> {
        let mut e = Envelopes::new(Body::from(bytes));
        let mut out = Vec::new();
        while let Some(v) = e.next::<serde_json::Value>("test").await? {
            out.push(v);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn envelopes_parse_and_reject() {
        let mut ok = envelope(0, b"{\"a\":1}").to_vec();
        ok.extend_from_slice(&envelope(0, b"{}"));
        assert_eq!(read_all(ok).await.unwrap().len(), 2);
        // Compressed flag, end-of-stream flag from a client, oversize, truncation.
        let bad = [
            envelope(1, b"{}").to_vec(),
            envelope(2, b"{}").to_vec(),
            vec![0, 0xff, 0xff, 0xff, 0xff],
            vec![0, 0, 0],
            vec![0, 0, 0, 0, 9, b'{'],
            envelope(0, b"{nope").to_vec(),
        ];
        for b in bad {
            let e = read_all(b.clone()).await.unwrap_err();
            assert!(
                matches!(e.code, Code::InvalidArgument | Code::ResourceExhausted),
                "{b:?}: {e:?}"
            );
        }
    }

    #[test]
    fn timeouts_parse() {
        let mut h = HeaderMap::new();
        assert!(timeout(&h).unwrap().is_none());
        h.insert("connect-timeout-ms", HeaderValue::from_static("1500"));
        assert_eq!(timeout(&h).unwrap(), Some(Duration::from_millis(1500)));
        h.insert(
            "connect-timeout-ms",
            HeaderValue::from_static("12345678901"),
        );
        assert!(timeout(&h).is_err());
        h.insert("connect-timeout-ms", HeaderValue::from_static("-1"));
        assert!(timeout(&h).is_err());
    }
}
