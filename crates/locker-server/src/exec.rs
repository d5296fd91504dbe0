//! `POST /v1/sandboxes/{id}/exec`: one command, as a typed result or as an NDJSON stream.
//!
//! The hot path: authenticate (cached hash), find the live sandbox (a map read), one frame
//! to its agent over the open channel, wait, answer. The call record is queued for the
//! batch writer; nothing here waits on the database.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use locker_proto::{Chan, ExecSpec};
use locker_store::CallRecord;
use locker_types::{
    ExecRequest, ExecResult, Reason, Timings, DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_TIMEOUT_MS,
};
use serde_json::json;
use tokio::sync::mpsc;

use crate::app::{ms_since, new_id, now_s, AppState, Live};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::Json;
use crate::sandboxes::live_of;

/// The largest `max_output_bytes` a call may ask for (per stream, kept in memory).
pub const MAX_OUTPUT_CAP: u64 = 16 << 20;
/// The largest stdin a JSON body may carry.
const MAX_STDIN: usize = 768 << 10;

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/sandboxes/{id}/exec", post(exec))
}

pub use locker_types::base64::decode as base64_decode;

/// How a command is waited for, which sets its default and largest timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// The call returns when the command ends (exec, run): 60 s by default, at most 1 h;
    /// `stream` answers NDJSON.
    Call { stream: bool },
    /// A background process: no timeout unless asked for; it ends with its sandbox.
    Background,
}

/// Checks an exec body and turns it into what the agent runs.
pub fn build_spec(
    live_env: &BTreeMap<String, String>,
    req: &ExecRequest,
    call_id: &str,
    wait: Wait,
) -> Result<(ExecSpec, Option<Vec<u8>>), ApiError> {
    let (stream, timeout_ms) = match wait {
        Wait::Call { stream } => {
            req.validate().map_err(ApiError::bad_request)?;
            (stream, Some(req.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS)))
        }
        Wait::Background => {
            req.validate_background().map_err(ApiError::bad_request)?;
            (false, req.timeout_ms)
        }
    };
    if let Some(m) = req.max_output_bytes {
        if m > MAX_OUTPUT_CAP {
            return Err(ApiError::bad_request(format!("`max_output_bytes` must be at most {MAX_OUTPUT_CAP}; the full output is always kept in a file in the machine")));
        }
    }
    let stdin = match (&req.stdin, &req.stdin_b64) {
        (Some(s), _) => Some(s.as_bytes().to_vec()),
        (None, Some(b)) => {
            Some(base64_decode(b).map_err(|e| ApiError::bad_request(format!("`stdin_b64`: {e}")))?)
        }
        (None, None) => None,
    };
    if stdin.as_ref().is_some_and(|s| s.len() > MAX_STDIN) {
        return Err(ApiError::too_large(
            "stdin over 768 KiB: write it to a file with the files API and redirect from it",
        ));
    }
    let argv = match (&req.cmd, &req.shell) {
        (Some(c), _) => c.clone(),
        (None, Some(s)) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        (None, None) => unreachable!("validated"),
    };
    let mut env = live_env.clone();
    env.extend(req.env.clone());
    let spec = ExecSpec {
        call_id: call_id.to_owned(),
        argv,
        cwd: req.cwd.clone(),
        env: env.into_iter().collect(),
        stdin: stdin.is_some(),
        timeout_ms,
        max_output_bytes: req.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT_BYTES),
        user: req.user.clone(),
        stream_output: stream,
        pty: None,
        kill_jobs: false,
    };
    Ok((spec, stdin))
}

/// The call record of an exec (env keys only, no output bodies).
pub fn call_record(
    caller: &Caller,
    live: &Live,
    kind: locker_store::CallKind,
    req: &ExecRequest,
    spec: &ExecSpec,
    res: &ExecResult,
) -> CallRecord {
    let mut result = res.clone();
    result.stdout.clear();
    result.stderr.clear();
    CallRecord {
        id: res.call_id.clone(),
        tenant: caller.tenant.clone(),
        key_id: caller.key_id.clone(),
        kind,
        sandbox_id: Some(live.id.clone()),
        volume_id: None,
        command: spec.argv.clone(),
        cwd: req.cwd.clone(),
        env_keys: req.env.keys().cloned().collect(),
        template_digest: live.template_digest.clone(),
        runtime: live.machine.kind().as_str().into(),
        result,
        egress_denied: vec![],
        changes: None,
        created_at: locker_types::rfc3339(now_s()),
    }
}

pub fn wants_ndjson(h: &HeaderMap) -> bool {
    h.get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/x-ndjson"))
}

async fn exec(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<ExecRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let call_id = new_id("call_");
    let stream = wants_ndjson(&headers);
    let live = live_of(&app, &caller, &id).await?;
    let (spec, stdin) = build_spec(&live.env, &req, &call_id, Wait::Call { stream })?;
    if !stream {
        let queue_ms = ms_since(arrived);
        let started = Instant::now();
        let mut res = match live.machine.agent.exec(spec.clone(), stdin, None).await {
            Ok(r) => r,
            Err(_) if machine_gone(&app, &live).await => killed_with_machine(&call_id, started),
            Err(e) => return Err(crate::failed::check(&app, &live, e).await),
        };
        finish(
            &app, &caller, &live, &req, &spec, &mut res, queue_ms, arrived,
        );
        return Ok(axum::Json(res).into_response());
    }
    let (body_tx, response) = ndjson_response();
    tokio::spawn(async move {
        let (out_tx, mut out_rx) = mpsc::channel::<(Chan, Vec<u8>)>(32);
        let queue_ms = ms_since(arrived);
        let started = Instant::now();
        let agent = live.machine.agent.clone();
        // `None`: the client went away; dropping the run cancels the command (its tree dies).
        let Some(r) = pump(
            agent.exec(spec.clone(), stdin, Some(out_tx)),
            &mut out_rx,
            &body_tx,
        )
        .await
        else {
            return;
        };
        let r = match r {
            Err(_) if machine_gone(&app, &live).await => {
                Ok(killed_with_machine(&spec.call_id, started))
            }
            other => other,
        };
        let last = match r {
            Ok(mut res) => {
                finish(
                    &app, &caller, &live, &req, &spec, &mut res, queue_ms, arrived,
                );
                typed("result", &res)
            }
            Err(e) => error_line(crate::failed::check(&app, &live, e).await),
        };
        send_line(&body_tx, &last).await;
    });
    Ok(response)
}

/// A channel whose lines become a streamed `application/x-ndjson` response.
pub fn ndjson_response() -> (mpsc::Sender<Bytes>, Response) {
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    }));
    (
        tx,
        (
            [
                (header::CONTENT_TYPE, "application/x-ndjson"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response(),
    )
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

/// Whether the sandbox of a call was destroyed (deleted or expired) while the call ran:
/// its agent connection then breaks, which is the command's end, not a platform failure.
/// A sandbox that failed under the call is not "gone" that way: the call answers why.
async fn machine_gone(app: &AppState, live: &Live) -> bool {
    !app.live.read().await.contains_key(&live.id) && crate::failed::reason(&live.id).is_none()
}

/// The result of a command killed with its machine (the sandbox was deleted or expired
/// under it): a 200 that says so, as the contract wants for every killed command. Its
/// output went away with the machine.
fn killed_with_machine(call_id: &str, started: Instant) -> ExecResult {
    ExecResult {
        call_id: call_id.to_owned(),
        exit_code: None,
        signal: Some("SIGKILL".into()),
        reason: Reason::Killed,
        stdout: String::new(),
        stderr: String::new(),
        stdout_b64: None,
        stderr_b64: None,
        stdout_truncated: false,
        stderr_truncated: false,
        stdout_bytes: 0,
        stderr_bytes: 0,
        output_path: None,
        timings: Timings {
            run_ms: ms_since(started),
            ..Default::default()
        },
        usage: Default::default(),
        changes: None,
    }
}

/// Fills the host's timings, records the call and the metrics.
#[allow(clippy::too_many_arguments)]
fn finish(
    app: &AppState,
    caller: &Caller,
    live: &Arc<Live>,
    req: &ExecRequest,
    spec: &ExecSpec,
    res: &mut ExecResult,
    queue_ms: f64,
    arrived: Instant,
) {
    res.timings.queue_ms = queue_ms;
    res.timings.total_ms = ms_since(arrived);
    app.metrics.exec_seconds.observe(res.timings.total_ms / 1e3);
    app.metrics
        .exec_wait_seconds
        .observe((res.timings.queue_ms + res.timings.start_ms) / 1e3);
    app.metrics.add_cpu(&caller.tenant, res.usage.cpu_ms);
    let mut record = call_record(caller, live, locker_store::CallKind::Exec, req, spec, res);
    record.egress_denied = app.egress.denied_since(&live.id, arrived);
    app.recorder.record(record);
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
    fn base64_round_trips_known_values() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64_decode("AP8=").unwrap(), vec![0, 255]);
        assert!(base64_decode("a*b").is_err());
    }

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
        assert_eq!(base64_decode(b64).unwrap(), raw);
        let text = e.chunk(Chan::Stderr, b"plain").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(v["data"], "plain");
        assert!(v.get("data_b64").is_none());
    }

    #[test]
    fn shell_becomes_sh_c_and_env_merges() {
        let mut base = BTreeMap::new();
        base.insert("A".to_string(), "1".to_string());
        base.insert("B".to_string(), "1".to_string());
        let req: ExecRequest =
            serde_json::from_str(r#"{"shell":"echo hi","env":{"B":"2"}}"#).unwrap();
        let (spec, stdin) =
            build_spec(&base, &req, "call_x", Wait::Call { stream: false }).unwrap();
        assert_eq!(spec.argv, vec!["/bin/sh", "-c", "echo hi"]);
        assert_eq!(
            spec.env,
            vec![("A".into(), "1".into()), ("B".into(), "2".into())]
        );
        assert!(stdin.is_none());
        let bad: ExecRequest =
            serde_json::from_str(r#"{"cmd":["x"],"max_output_bytes":999999999}"#).unwrap();
        assert!(build_spec(&base, &bad, "c", Wait::Call { stream: false }).is_err());
        assert_eq!(spec.timeout_ms, Some(60_000), "exec's default");
        let (bg, _) = build_spec(&base, &req, "c", Wait::Background).unwrap();
        assert_eq!(bg.timeout_ms, None, "a background process has none");
        let long: ExecRequest =
            serde_json::from_str(r#"{"cmd":["x"],"timeout_ms":7200000}"#).unwrap();
        assert!(build_spec(&base, &long, "c", Wait::Call { stream: false }).is_err());
        assert!(build_spec(&base, &long, "c", Wait::Background).is_ok());
    }
}
