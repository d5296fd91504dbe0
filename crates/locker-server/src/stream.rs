//! The NDJSON toolkit of streamed answers (`Accept: application/x-ndjson`): the response
//! and its channel, the pump that turns a command's output into `stdout`/`stderr` lines
//! without splitting a character, and the typed last line (`result` or `error`).
//!
//! Used by exec, background processes and runs alike; it knows no sandbox, volume or
//! store, only lines.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use locker_proto::Chan;
use serde_json::json;
use tokio::sync::mpsc;

use crate::error::ApiError;

/// Whether the client asked for NDJSON.
pub fn wants_ndjson(h: &HeaderMap) -> bool {
    h.get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/x-ndjson"))
}

/// A channel whose lines become a streamed `application/x-ndjson` response.
pub fn ndjson_response() -> (mpsc::Sender<Bytes>, Response) {
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    }));
    (tx, ndjson(body))
}

/// The sender of a [`cuttable_body`]: `Ok` parts, or the [`cut`] that ends it short.
pub type CutSender = mpsc::Sender<Result<Bytes, std::io::Error>>;

/// [`ndjson_response`] over a [`cuttable_body`]: an `Err` line cuts the answer short.
pub fn cuttable_ndjson_response() -> (CutSender, Response) {
    let (tx, body) = cuttable_body(32);
    (tx, ndjson(body))
}

fn ndjson(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// A streamed body that can also be cut short: each `Ok` is sent as it comes, an `Err`
/// aborts the response (HTTP/1.1 closes the connection before the last chunk, HTTP/2 resets
/// the stream). That is how a client learns that the machine behind a stream went (killed,
/// past its timeout) the way it would behind a proxy: E2B's SDKs then probe the sandbox's
/// health and say it was killed, where a cleanly ended stream would read as a normal end.
pub fn cuttable_body(capacity: usize) -> (CutSender, Body) {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(capacity);
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (b, rx))
    }));
    (tx, body)
}

/// The error that cuts a [`cuttable_body`] short, saying why in the server's log.
pub fn cut(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, why.to_owned())
}

/// Drives `run` while turning the output it produces on `out` into NDJSON lines on `body`,
/// then sends what is left. `None` if the client went away first (`run` is dropped, which
/// cancels it).
pub async fn pump<F: std::future::Future>(
    run: F,
    out: &mut mpsc::Receiver<(Chan, Vec<u8>)>,
    body: &mpsc::Sender<Bytes>,
) -> Option<F::Output> {
    tokio::pin!(run);
    let mut lines = LineEncoder::default();
    let result = loop {
        tokio::select! {
            r = &mut run => break r,
            Some((chan, bytes)) = out.recv() => {
                if let Some(line) = lines.chunk(chan, &bytes) {
                    if body.send(line).await.is_err() {
                        return None;
                    }
                }
            }
            _ = body.closed() => return None,
        }
    };
    while let Ok((chan, bytes)) = out.try_recv() {
        if let Some(line) = lines.chunk(chan, &bytes) {
            let _ = body.send(line).await;
        }
    }
    for line in lines.flush() {
        let _ = body.send(line).await;
    }
    Some(result)
}

/// `value` as JSON with `"type": kind` added.
pub fn typed<T: serde::Serialize>(kind: &str, value: &T) -> serde_json::Value {
    let mut v = serde_json::to_value(value).expect("result serializes");
    v["type"] = json!(kind);
    v
}

/// The last line of a stream that failed.
pub fn error_line(e: ApiError) -> serde_json::Value {
    json!({"type": "error", "error": {"code": e.code(), "message": e.message}})
}

/// Sends one NDJSON line.
pub async fn send_line(body: &mpsc::Sender<Bytes>, v: &serde_json::Value) {
    let mut line = serde_json::to_vec(v).expect("json");
    line.push(b'\n');
    let _ = body.send(Bytes::from(line)).await;
}

/// Turns output chunks into NDJSON lines, never splitting a UTF-8 character across lines.
#[derive(Default)]
pub struct LineEncoder {
    carry: [Vec<u8>; 2],
}

impl LineEncoder {
    fn slot(chan: Chan) -> Option<(usize, &'static str)> {
        match chan {
            Chan::Stdout | Chan::Bytes => Some((0, "stdout")),
            Chan::Stderr => Some((1, "stderr")),
            _ => None,
        }
    }

    /// The line for a chunk (None if it held only part of a character).
    pub fn chunk(&mut self, chan: Chan, bytes: &[u8]) -> Option<Bytes> {
        let (i, name) = Self::slot(chan)?;
        let buf = &mut self.carry[i];
        buf.extend_from_slice(bytes);
        let cut = utf8_cut(buf);
        if cut == 0 {
            return None;
        }
        let l = line(name, &buf[..cut]);
        buf.drain(..cut);
        Some(l)
    }

    /// Whatever is left (an incomplete character at the very end).
    pub fn flush(&mut self) -> Vec<Bytes> {
        let mut out = Vec::new();
        for (i, name) in [(0, "stdout"), (1, "stderr")] {
            if !self.carry[i].is_empty() {
                out.push(line(name, &self.carry[i]));
                self.carry[i].clear();
            }
        }
        out
    }
}

/// One output line: `data` is the text; bytes that are not valid UTF-8 also travel
/// unchanged in `data_b64` (and `data` is then their lossy text).
fn line(kind: &str, bytes: &[u8]) -> Bytes {
    let msg = match std::str::from_utf8(bytes) {
        Ok(text) => json!({"type": kind, "data": text}),
        Err(_) => json!({
            "type": kind,
            "data": String::from_utf8_lossy(bytes),
            "data_b64": locker_types::base64::encode(bytes),
        }),
    };
    let mut v = serde_json::to_vec(&msg).expect("json");
    v.push(b'\n');
    Bytes::from(v)
}

/// The length of the longest prefix that does not end inside a UTF-8 character.
fn utf8_cut(b: &[u8]) -> usize {
    let n = b.len();
    for back in 1..=3.min(n) {
        let c = b[n - back];
        if c & 0xC0 == 0x80 {
            continue; // continuation byte: keep looking for the lead byte
        }
        let need = if c >= 0xF0 {
            4
        } else if c >= 0xE0 {
            3
        } else if c >= 0xC0 {
            2
        } else {
            1
        };
        return if need > back { n - back } else { n };
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_is_never_split() {
        let mut e = LineEncoder::default();
        let snow = "☃".as_bytes(); // 3 bytes
        assert!(e.chunk(Chan::Stdout, &snow[..2]).is_none());
        let l = e.chunk(Chan::Stdout, &[snow[2], b'x']).unwrap();
        assert_eq!(&l[..], "{\"data\":\"☃x\",\"type\":\"stdout\"}\n".as_bytes());
        assert_eq!(utf8_cut(b"abc"), 3);
        assert_eq!(utf8_cut(&[b'a', 0xE2]), 1);
    }

    #[test]
    fn bytes_that_are_not_text_travel_unchanged() {
        let mut e = LineEncoder::default();
        let raw = [b'E', b'L', b'F', 0xff, 0x00, 0xfe, b'x'];
        let l = e.chunk(Chan::Stdout, &raw).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&l).unwrap();
        assert_eq!(v["type"], "stdout");
        let b64 = v["data_b64"].as_str().unwrap();
        assert_eq!(locker_types::base64::decode(b64).unwrap(), raw);
        let text = e.chunk(Chan::Stderr, b"plain").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(v["data"], "plain");
        assert!(v.get("data_b64").is_none());
    }
}
