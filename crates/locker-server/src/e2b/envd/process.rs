//! envd's `process.Process` service onto Locker's background processes: `Start` spawns
//! one (pipes or a terminal) and follows its output, so every E2B command is a Locker
//! background process (in `GET /v1/sandboxes/{id}/processes`, with its call record).
//! E2B names processes by pid; the agent's process table answers by pid (the newest
//! process with that pid, a running one first), so no second table is kept here. A
//! `Start`'s `tag` is kept beside it ([`super::state`]: envd's own), so `Connect` and the
//! other calls find a process by tag too, and `List` shows it.
//!
//! `Connect-Timeout-Ms` on `Start` is the process's lifetime (as in E2B's envd): the agent
//! kills its tree at the deadline and the stream ends with `deadline_exceeded`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use locker_proto::{Chan, ProcessInfo, PtySize};
use locker_runtime::agent::Following;
use locker_types::{ExecRequest, Reason};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::connect::{
    self, pj, stream_error, stream_response, unary_ok, Code, ConnectError, Envelopes, Shape,
    StreamOut,
};
use super::resolve_path;
use crate::e2b::Target;
use crate::failed::result;
use crate::lifecycle::live_of;
use crate::state::{AppState, Busy};

#[derive(Deserialize, Default)]
#[serde(default)]
struct ProcessConfig {
    cmd: String,
    args: Vec<String>,
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Size {
    #[serde(deserialize_with = "pj::opt_u32")]
    cols: Option<u32>,
    #[serde(deserialize_with = "pj::opt_u32")]
    rows: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Pty {
    size: Option<Size>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StartRequest {
    process: Option<ProcessConfig>,
    pty: Option<Pty>,
    tag: Option<String>,
    /// Absent means a stdin pipe (envd's default); the SDKs send `false` for `run`.
    stdin: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Selector {
    #[serde(deserialize_with = "pj::opt_u32")]
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct SelectRequest {
    process: Option<Selector>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Input {
    stdin: Option<String>,
    pty: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct SendInputRequest {
    process: Option<Selector>,
    input: Option<Input>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct SendSignalRequest {
    process: Option<Selector>,
    #[serde(deserialize_with = "pj::opt_enum")]
    signal: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct UpdateRequest {
    process: Option<Selector>,
    pty: Option<Pty>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StreamStart {
    process: Option<Selector>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StreamData {
    input: Option<Input>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StreamInputRequest {
    start: Option<StreamStart>,
    data: Option<StreamData>,
    keepalive: Option<serde_json::Value>,
}

pub(super) async fn serve(app: AppState, t: Target, method: String, req: Request) -> Response {
    let shape = match method.as_str() {
        "Start" | "Connect" => Shape::ServerStream,
        "StreamInput" => Shape::ClientStream,
        "List" | "SendInput" | "SendSignal" | "CloseStdin" | "Update" => Shape::Unary,
        _ => {
            return ConnectError::new(
                Code::Unimplemented,
                format!(
                    "process.Process/{method} does not exist: the service has Start, Connect, \
                     List, SendInput, StreamInput, CloseStdin, SendSignal and Update"
                ),
            )
            .into_response()
        }
    };
    let (timeout, user) = match super::rpc_headers(req.headers(), shape, &t) {
        Ok(h) => h,
        Err(refused) => return refused,
    };
    let keepalive = super::keepalive_interval(req.headers());
    let body = req.into_body();
    match shape {
        Shape::ServerStream => {
            let r = if method == "Start" {
                start(app, t, user, timeout, keepalive, body).await
            } else {
                connect_to(app, t, keepalive, body).await
            };
            r.unwrap_or_else(stream_error)
        }
        // A client-streaming answer is a stream of one message and the end.
        Shape::ClientStream => match stream_input(app, t, body).await {
            Ok(()) => connect::stream_once(&json!({})),
            Err(e) => stream_error(e),
        },
        Shape::Unary => {
            let call = unary(app, t, &method, body);
            let r = match timeout {
                Some(d) => tokio::time::timeout(d, call).await.unwrap_or_else(|_| {
                    Err(ConnectError::new(
                        Code::DeadlineExceeded,
                        format!(
                            "process.Process/{method} did not finish within Connect-Timeout-Ms"
                        ),
                    ))
                }),
                None => call.await,
            };
            r.unwrap_or_else(|e| e.into_response())
        }
    }
}

/// A request the protocol layer refused: a wrong content type is 415, as Connect says.
pub(super) fn rejected(e: ConnectError) -> Response {
    let status = if e.message.starts_with("Content-Type") {
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    } else {
        e.code.status()
    };
    (status, axum::Json(e.json())).into_response()
}

async fn busy(app: &AppState, t: &Target) -> Result<Busy, ConnectError> {
    Ok(live_of(app, &t.caller, &t.live.id).await?)
}

/// The process a selector names, by pid or by tag: the newest with that pid (or tag), a
/// running one first.
async fn find(
    app: &AppState,
    live: &Busy,
    sel: Option<Selector>,
) -> Result<ProcessInfo, ConnectError> {
    let sel = sel.ok_or_else(|| {
        ConnectError::invalid("`process` (a selector with `pid` or `tag`) is required")
    })?;
    let procs = result(app, live, live.machine.agent.list_processes().await).await?;
    let newest = |a: &ProcessInfo, b: &ProcessInfo| {
        (a.result.is_none(), &a.started_at).cmp(&(b.result.is_none(), &b.started_at))
    };
    match (sel.pid, sel.tag) {
        (Some(pid), _) => procs
            .into_iter()
            .filter(|p| i64::from(p.pid) == i64::from(pid))
            .max_by(newest)
            .ok_or_else(|| ConnectError::not_found(format!("process with pid {pid} not found"))),
        (None, Some(tag)) => {
            let tags = super::state::tags(&live.id, None);
            procs
                .into_iter()
                .filter(|p| tags.get(&p.id) == Some(&tag))
                .max_by(newest)
                .ok_or_else(|| {
                    ConnectError::not_found(format!("process with tag {tag:?} not found"))
                })
        }
        (None, None) => Err(ConnectError::invalid(
            "`process` must give a `pid` or a `tag`",
        )),
    }
}

/// A running process, else `not_found` (E2B forgets a process once it ends).
async fn find_running(
    app: &AppState,
    live: &Busy,
    sel: Option<Selector>,
) -> Result<ProcessInfo, ConnectError> {
    let p = find(app, live, sel).await?;
    if p.result.is_some() {
        return Err(ConnectError::not_found(format!(
            "process with pid {} has ended",
            p.pid
        )));
    }
    Ok(p)
}

fn pty_size(p: Option<Pty>) -> Result<Option<PtySize>, ConnectError> {
    let Some(p) = p else { return Ok(None) };
    let s = p.size.unwrap_or_default();
    let dim = |v: Option<u32>, name: &str, def: u16| -> Result<u16, ConnectError> {
        match v {
            None | Some(0) => Ok(def),
            Some(n) if n <= 1000 => Ok(n as u16),
            Some(n) => Err(ConnectError::invalid(format!(
                "pty size {name} {n} is over 1000"
            ))),
        }
    };
    Ok(Some(PtySize {
        cols: dim(s.cols, "cols", 80)?,
        rows: dim(s.rows, "rows", 24)?,
    }))
}

async fn start(
    app: AppState,
    t: Target,
    user: String,
    timeout: Option<Duration>,
    keepalive: Duration,
    body: axum::body::Body,
) -> Result<Response, ConnectError> {
    let arrived = Instant::now();
    let msg: StartRequest = Envelopes::new(body).single("process.StartRequest").await?;
    let p = msg
        .process
        .ok_or_else(|| ConnectError::invalid("`process` (cmd, args, envs, cwd) is required"))?;
    if p.cmd.is_empty() {
        return Err(ConnectError::invalid(
            "`process.cmd` (the program to run) is required",
        ));
    }
    // `/init`'s defaults first, the call's own over them.
    let defaults = super::state::defaults(&t.live.id);
    let cwd = match p.cwd.as_deref() {
        None | Some("") => defaults.workdir,
        Some(c) => Some(resolve_path(&user, c).map_err(ConnectError::invalid)?),
    };
    let mut env = defaults.env;
    env.extend(p.envs);
    let pty = pty_size(msg.pty)?;
    let stdin = pty.is_some() || msg.stdin.unwrap_or(true);
    let tag = msg.tag.filter(|t| !t.is_empty());
    if tag.as_ref().is_some_and(|t| t.len() > 256) {
        return Err(ConnectError::invalid("`tag` is at most 256 bytes"));
    }
    let mut cmd = vec![p.cmd];
    cmd.extend(p.args);
    let req = ExecRequest {
        cmd: Some(cmd),
        cwd,
        env,
        timeout_ms: timeout
            .map(|d| (d.as_millis() as u64).clamp(1, locker_types::MAX_BACKGROUND_TIMEOUT_MS)),
        user: Some(user),
        ..Default::default()
    };
    let live = busy(&app, &t).await?;
    let (proc_id, pid, following) =
        crate::processes::spawn_background_following(&app, &t.caller, &live, req, arrived, |s| {
            s.stdin = stdin;
            s.pty = pty;
        })
        .await?;
    if let Some(tag) = &tag {
        super::state::tag(&app, &live.id, &proc_id, tag).await;
    }
    let (out, resp) = stream_response();
    tokio::spawn(async move {
        if !out.send(&json!({"event": {"start": {"pid": pid}}})).await {
            return;
        }
        follow(&app, &live, following, pty.is_some(), out, keepalive).await;
    });
    Ok(resp)
}

async fn connect_to(
    app: AppState,
    t: Target,
    keepalive: Duration,
    body: axum::body::Body,
) -> Result<Response, ConnectError> {
    let msg: SelectRequest = Envelopes::new(body)
        .single("process.ConnectRequest")
        .await?;
    let live = busy(&app, &t).await?;
    let p = find_running(&app, &live, msg.process).await?;
    let following = result(&app, &live, live.machine.agent.follow_process(&p.id)).await?;
    let (out, resp) = stream_response();
    tokio::spawn(async move {
        if !out.send(&json!({"event": {"start": {"pid": p.pid}}})).await {
            return;
        }
        follow(&app, &live, following, p.pty, out, keepalive).await;
    });
    Ok(resp)
}

/// Streams a process's output as `data` events until it ends (`end`, then the end of the
/// stream) or the client goes (the process keeps running, as in envd); a `keepalive`
/// event after each `keepalive` without one.
async fn follow(
    app: &AppState,
    live: &Busy,
    following: Following,
    pty: bool,
    out: StreamOut,
    keepalive: Duration,
) {
    let (tx, mut rx) = mpsc::channel::<(Chan, Vec<u8>)>(32);
    let run = following.output(tx);
    tokio::pin!(run);
    let idle = tokio::time::sleep(keepalive);
    tokio::pin!(idle);
    let ended = loop {
        tokio::select! {
            r = &mut run => break r,
            Some((chan, bytes)) = rx.recv() => {
                if !send_data(&out, chan, &bytes, pty).await {
                    return;
                }
                idle.as_mut().reset(tokio::time::Instant::now() + keepalive);
            }
            () = &mut idle => {
                if !out.send(&json!({"event": {"keepalive": {}}})).await {
                    return;
                }
                idle.as_mut().reset(tokio::time::Instant::now() + keepalive);
            }
            _ = out.closed() => return,
        }
    };
    while let Ok((chan, bytes)) = rx.try_recv() {
        if !send_data(&out, chan, &bytes, pty).await {
            return;
        }
    }
    let info = match ended {
        Ok(info) => info,
        Err(e) => {
            let e: ConnectError = crate::failed::check(app, live, e).await.into();
            if crate::e2b::went(app, live).await {
                return out.cut("the sandbox went under the stream").await;
            }
            return out.end(Some(e)).await;
        }
    };
    let Some(res) = info.result else {
        return out
            .end(Some(ConnectError::new(
                Code::Unavailable,
                "the process's output stream ended early",
            )))
            .await;
    };
    let mut end = serde_json::Map::new();
    let code = res.exit_code.unwrap_or(-1);
    if code != 0 {
        end.insert("exitCode".into(), json!(code));
    }
    let exited = res.exit_code.is_some();
    end.insert("exited".into(), json!(exited));
    let status = match (&res.exit_code, &res.signal) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("signal: {}", s.trim_start_matches("SIG").to_lowercase()),
        (None, None) => format!("{:?}", res.reason).to_lowercase(),
    };
    end.insert("status".into(), json!(status));
    let timed_out = res.reason == Reason::Timeout;
    if timed_out {
        end.insert(
            "error".into(),
            json!("the process ran past Connect-Timeout-Ms and was killed"),
        );
    } else if res.reason == Reason::OutputLimit {
        end.insert(
            "error".into(),
            json!("the process wrote more output than the machine keeps and was killed"),
        );
    }
    if !out.send(&json!({"event": {"end": end}})).await {
        return;
    }
    let err = timed_out.then(|| {
        ConnectError::new(
            Code::DeadlineExceeded,
            "the process ran past Connect-Timeout-Ms and was killed",
        )
    });
    out.end(err).await;
}

async fn send_data(out: &StreamOut, chan: Chan, bytes: &[u8], pty: bool) -> bool {
    let key = match (pty, chan) {
        (true, _) => "pty",
        (false, Chan::Stderr) => "stderr",
        _ => "stdout",
    };
    let b64 = locker_types::base64::encode(bytes);
    out.send(&json!({"event": {"data": {key: b64}}})).await
}

async fn unary(
    app: AppState,
    t: Target,
    method: &str,
    body: axum::body::Body,
) -> Result<Response, ConnectError> {
    let empty = json!({});
    match method {
        "List" => {
            let _: serde_json::Value = connect::read_unary("process.ListRequest", body).await?;
            let live = busy(&app, &t).await?;
            let procs = result(&app, &live, live.machine.agent.list_processes().await).await?;
            let known: std::collections::HashSet<&str> =
                procs.iter().map(|p| p.id.as_str()).collect();
            let keep = |id: &str| known.contains(id);
            let tags = super::state::tags(&live.id, Some(&keep));
            let list: Vec<_> = procs
                .iter()
                .filter(|p| p.result.is_none())
                .map(|p| list_entry(&live.env, p.clone(), tags.get(&p.id)))
                .collect();
            Ok(unary_ok(&json!({"processes": list})))
        }
        "SendInput" => {
            let m: SendInputRequest = connect::read_unary("process.SendInputRequest", body).await?;
            let input = m.input.unwrap_or_default();
            let data = match (input.stdin, input.pty) {
                (Some(s), _) | (None, Some(s)) => locker_types::base64::decode(&s)
                    .map_err(|e| ConnectError::invalid(format!("`input`: not base64: {e}")))?,
                (None, None) => {
                    return Err(ConnectError::invalid(
                        "`input` needs `stdin` or `pty` (base64)",
                    ))
                }
            };
            let live = busy(&app, &t).await?;
            let p = find_running(&app, &live, m.process).await?;
            write_stdin(&app, &live, &p, &data[..], false).await?;
            Ok(unary_ok(&empty))
        }
        "CloseStdin" => {
            let m: SelectRequest = connect::read_unary("process.CloseStdinRequest", body).await?;
            let live = busy(&app, &t).await?;
            let p = find_running(&app, &live, m.process).await?;
            if p.pty {
                return Err(ConnectError::new(
                    Code::FailedPrecondition,
                    "a pty process has no stdin to close: send byte 0x04 (Ctrl-D) as input",
                ));
            }
            write_stdin(&app, &live, &p, &b""[..], true).await?;
            Ok(unary_ok(&empty))
        }
        "SendSignal" => {
            let m: SendSignalRequest =
                connect::read_unary("process.SendSignalRequest", body).await?;
            let sig = match m.signal.as_deref() {
                Some("SIGNAL_SIGKILL") | Some("9") => libc::SIGKILL,
                Some("SIGNAL_SIGTERM") | Some("15") => libc::SIGTERM,
                other => {
                    return Err(ConnectError::invalid(format!(
                        "`signal` {other:?}: envd takes SIGNAL_SIGTERM (15) or SIGNAL_SIGKILL (9)"
                    )))
                }
            };
            let live = busy(&app, &t).await?;
            let p = find_running(&app, &live, m.process).await?;
            match live.machine.agent.signal_process(&p.id, sig).await {
                Ok(()) => Ok(unary_ok(&empty)),
                // It ended between the lookup and the signal.
                Err(locker_runtime::agent::AgentClientError::Agent(e))
                    if e.code == locker_proto::ErrorCode::Conflict =>
                {
                    Err(ConnectError::not_found(format!(
                        "process with pid {} has ended",
                        p.pid
                    )))
                }
                Err(e) => Err(crate::failed::check(&app, &live, e).await.into()),
            }
        }
        "Update" => {
            let m: UpdateRequest = connect::read_unary("process.UpdateRequest", body).await?;
            let size = pty_size(m.pty)?;
            let live = busy(&app, &t).await?;
            let p = find_running(&app, &live, m.process).await?;
            if let Some(size) = size {
                if !p.pty {
                    return Err(ConnectError::new(
                        Code::FailedPrecondition,
                        format!("process with pid {} has no terminal to resize", p.pid),
                    ));
                }
                let r = live.machine.agent.resize_process(&p.id, size).await;
                result(&app, &live, r).await?;
            }
            Ok(unary_ok(&empty))
        }
        _ => unreachable!("dispatched above"),
    }
}

/// A running process as `List` shows it: its `cmd` and `args`, the `envs` its `Start` gave
/// (the environment the agent keeps, less the sandbox's own, which every process has) and
/// the `cwd` it named. An agent of an earlier release keeps neither: then both are empty.
fn list_entry(
    sandbox_env: &BTreeMap<String, String>,
    p: ProcessInfo,
    tag: Option<&String>,
) -> serde_json::Value {
    let mut argv = p.argv.into_iter();
    let cmd = argv.next().unwrap_or_default();
    let envs: BTreeMap<String, String> = p
        .env
        .into_iter()
        .filter(|(k, v)| sandbox_env.get(k) != Some(v))
        .collect();
    let mut config = json!({"cmd": cmd, "args": argv.collect::<Vec<_>>(), "envs": envs});
    if let Some(cwd) = p.cwd {
        config["cwd"] = json!(cwd);
    }
    let mut v = json!({"pid": p.pid, "config": config});
    if let Some(tag) = tag {
        v["tag"] = json!(tag);
    }
    v
}

async fn write_stdin(
    app: &AppState,
    live: &Busy,
    p: &ProcessInfo,
    data: impl tokio::io::AsyncRead + Unpin,
    close: bool,
) -> Result<(), ConnectError> {
    match live.machine.agent.process_stdin(&p.id, data, close).await {
        Ok(()) => Ok(()),
        Err(locker_runtime::agent::AgentClientError::Agent(e))
            if e.code == locker_proto::ErrorCode::Conflict =>
        {
            Err(ConnectError::new(Code::FailedPrecondition, e.message))
        }
        Err(e) => Err(crate::failed::check(app, live, e).await.into()),
    }
}

/// `StreamInput`: a `start` message naming the process, then `data` messages whose bytes
/// go to its stdin (or terminal) as they come, in one agent write.
async fn stream_input(
    app: AppState,
    t: Target,
    body: axum::body::Body,
) -> Result<(), ConnectError> {
    let mut env = Envelopes::new(body);
    let first: Option<StreamInputRequest> = tokio::time::timeout(
        connect::REQUEST_DEADLINE,
        env.next("process.StreamInputRequest"),
    )
    .await
    .map_err(|_| {
        ConnectError::new(Code::DeadlineExceeded, "no `start` message arrived in time")
    })??;
    let Some(StreamInputRequest {
        start: Some(start), ..
    }) = first
    else {
        return Err(ConnectError::invalid(
            "the first StreamInput message must be `start` (naming the process)",
        ));
    };
    let live = busy(&app, &t).await?;
    let p = find_running(&app, &live, start.process).await?;
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    let reader = super::files::channel_reader(rx);
    let feed = async move {
        loop {
            match env
                .next::<StreamInputRequest>("process.StreamInputRequest")
                .await
            {
                Ok(None) => return Ok(()),
                Ok(Some(m)) => {
                    if let Some(d) = m.data {
                        let input = d.input.unwrap_or_default();
                        let Some(s) = input.stdin.or(input.pty) else {
                            continue;
                        };
                        let bytes = locker_types::base64::decode(&s).map_err(|e| {
                            ConnectError::invalid(format!("`data.input`: not base64: {e}"))
                        })?;
                        if tx.send(Ok(Bytes::from(bytes))).await.is_err() {
                            return Ok(());
                        }
                    } else if m.start.is_some() {
                        return Err(ConnectError::invalid(
                            "`start` may only be the first message",
                        ));
                    }
                    let _ = m.keepalive;
                }
                Err(e) => {
                    let _ = tx.send(Err(std::io::Error::other(e.message.clone()))).await;
                    return Err(e);
                }
            }
        }
    };
    let (fed, written) = tokio::join!(feed, write_stdin(&app, &live, &p, reader, false));
    fed?;
    written
}
