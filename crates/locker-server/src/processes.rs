//! Background processes and the terminal (PTY over WebSocket) of a sandbox.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::TryStreamExt;
use locker_proto::{Chan, PtySize, Request};
use locker_runtime::agent::{AgentClientError, Following, StreamEvent};
use locker_types::ExecRequest;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use crate::auth::Caller;
use crate::command::{build_spec, call_record, Wait};
use crate::error::ApiError;
use crate::extract::{Json, Query};
use crate::failed::result;
use crate::lifecycle::live_of;
use crate::state::{ms_since, new_id, AppState, Live};
use crate::stream::{error_line, ndjson_response, pump, send_line, typed};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/processes", post(start).get(list))
        .route("/v1/sandboxes/{id}/processes/{proc}", get(get_one))
        .route("/v1/sandboxes/{id}/processes/{proc}/output", get(output))
        .route(
            "/v1/sandboxes/{id}/processes/{proc}/stdin",
            post(stdin).layer(axum::extract::DefaultBodyLimit::max(64 << 20)),
        )
        .route("/v1/sandboxes/{id}/processes/{proc}/signal", post(signal))
        // GET: a WebSocket over HTTP/1.1; CONNECT: over HTTP/2 (RFC 8441), as the fleet's
        // control plane opens one to a node.
        .route(
            "/v1/sandboxes/{id}/pty",
            axum::routing::on(
                axum::routing::MethodFilter::GET.or(axum::routing::MethodFilter::CONNECT),
                pty,
            ),
        )
}

fn check_proc_id(p: &str) -> Result<(), ApiError> {
    if p.starts_with("proc_") && p.len() <= 64 && p[5..].bytes().all(|b| b.is_ascii_alphanumeric())
    {
        Ok(())
    } else {
        Err(ApiError::not_found(format!("process {p} does not exist")))
    }
}

async fn start(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(req): Json<ExecRequest>,
) -> Result<impl IntoResponse, ApiError> {
    let arrived = Instant::now();
    let live = live_of(&app, &caller, &id).await?;
    // Background processes keep a stdin pipe for later writes unless the body gave stdin.
    let (proc_id, pid) = spawn_background(&app, &caller, &live, req, arrived, |spec| {
        spec.stdin = true;
    })
    .await?;
    Ok(axum::Json(json!({"id": proc_id, "pid": pid})))
}

/// Starts a background process from an exec body (its id and pid) and records its call
/// when it ends: the one way in for Locker's own route and other protocols' (E2B's
/// `process.Process/Start`). `adjust` sets what the body cannot say (stdin, a terminal).
pub(crate) async fn spawn_background(
    app: &AppState,
    caller: &Caller,
    live: &std::sync::Arc<Live>,
    req: ExecRequest,
    arrived: Instant,
    adjust: impl FnOnce(&mut locker_proto::ExecSpec),
) -> Result<(String, i32), ApiError> {
    let (id, pid, _) = start_background(app, caller, live, req, arrived, adjust, false).await?;
    Ok((id, pid))
}

/// [`spawn_background`], with its output followed from its start (E2B's `Start`, which
/// streams what it starts): in one agent round trip where the agent serves it.
pub(crate) async fn spawn_background_following(
    app: &AppState,
    caller: &Caller,
    live: &std::sync::Arc<Live>,
    req: ExecRequest,
    arrived: Instant,
    adjust: impl FnOnce(&mut locker_proto::ExecSpec),
) -> Result<(String, i32, Following), ApiError> {
    let (id, pid, following) =
        start_background(app, caller, live, req, arrived, adjust, true).await?;
    Ok((id, pid, following.expect("asked to follow")))
}

async fn start_background(
    app: &AppState,
    caller: &Caller,
    live: &std::sync::Arc<Live>,
    req: ExecRequest,
    arrived: Instant,
    adjust: impl FnOnce(&mut locker_proto::ExecSpec),
    follow: bool,
) -> Result<(String, i32, Option<Following>), ApiError> {
    let call_id = new_id("call_");
    // No timeout unless the body asks for one: the process lives until it exits or its
    // sandbox ends.
    let (mut spec, stdin) = build_spec(&live.env, &req, &call_id, Wait::Background)?;
    crate::templates::apply_defaults(app, &live.template_digest, &mut spec);
    adjust(&mut spec);
    let agent = live.machine.agent.clone();
    let queue_ms = ms_since(arrived);
    let (proc_id, pid, following) = if follow {
        let (id, pid, f) = result(app, live, agent.spawn_follow(spec.clone()).await).await?;
        (id, pid, Some(f))
    } else {
        let (id, pid) = result(app, live, agent.spawn(spec.clone()).await).await?;
        (id, pid, None)
    };
    remember_queue(live, &proc_id, queue_ms);
    if let Some(data) = stdin {
        let r = agent.process_stdin(&proc_id, &data[..], true).await;
        result(app, live, r).await?;
    }
    // Record the call when the process ends; polling is cheap and moves no output.
    let (app2, live2, caller2, pid_s) =
        (app.clone(), live.clone(), caller.clone(), proc_id.clone());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            match live2.machine.agent.get_process(&pid_s).await {
                Ok(mut p) if p.result.is_some() => {
                    fill_timings(&live2, &mut p);
                    let mut res = p.result.expect("checked");
                    res.call_id = call_id.clone();
                    app2.metrics.add_cpu(&caller2.tenant, res.usage.cpu_ms);
                    let mut record = call_record(
                        &caller2,
                        &live2,
                        locker_store::CallKind::Process,
                        &req,
                        &spec,
                        &res,
                    );
                    record.egress_denied = app2.egress.denied_since(&live2.id, arrived);
                    (record.secrets_used, record.secret_misuse) =
                        app2.egress.secrets_since(&live2.id, arrived);
                    app2.recorder.record(record);
                    return;
                }
                Ok(_) => {}
                // Frozen (paused) under the poll: ask again once it runs.
                Err(AgentClientError::Unresponsive(_)) if live2.is_paused() => {}
                Err(_) => return,
            }
        }
    });
    Ok((proc_id, pid, following))
}

/// How many background processes' queue times a sandbox remembers: more than the agent
/// keeps (256 ended ones plus the running ones, in practice).
const QUEUE_TIMES: usize = 1024;

fn remember_queue(live: &Live, proc_id: &str, queue_ms: f64) {
    let mut q = live.proc_queue_ms.lock().expect("queue times lock");
    if q.len() >= QUEUE_TIMES {
        q.pop_front();
    }
    q.push_back((proc_id.to_owned(), queue_ms));
}

/// Completes an ended process's timings, which the agent leaves at 0: `queue_ms` as this
/// server saw it (0 for a process started before a restart) and `total_ms` from the
/// request's arrival to the process's end (queue + start + run).
fn fill_timings(live: &Live, info: &mut locker_proto::ProcessInfo) {
    let Some(res) = info.result.as_mut() else {
        return;
    };
    let queue_ms = live
        .proc_queue_ms
        .lock()
        .expect("queue times lock")
        .iter()
        .rev()
        .find(|(id, _)| *id == info.id)
        .map_or(0.0, |(_, q)| *q);
    let t = &mut res.timings;
    t.queue_ms = queue_ms;
    t.total_ms = ((queue_ms + t.start_ms + t.run_ms) * 1000.0).round() / 1000.0;
}

async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let live = live_of(&app, &caller, &id).await?;
    let mut procs = result(&app, &live, live.machine.agent.list_processes().await).await?;
    for p in &mut procs {
        fill_timings(&live, p);
        // Environment values stay out of Locker's answers, as out of its call records.
        p.env.clear();
    }
    Ok(axum::Json(json!({ "processes": procs })))
}

async fn get_one(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, proc_id)): Path<(String, String)>,
) -> Result<impl IntoResponse, ApiError> {
    check_proc_id(&proc_id)?;
    let live = live_of(&app, &caller, &id).await?;
    let mut p = result(&app, &live, live.machine.agent.get_process(&proc_id).await).await?;
    fill_timings(&live, &mut p);
    p.env.clear();
    Ok(axum::Json(p))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputQuery {
    #[serde(default)]
    follow: bool,
}

async fn output(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, proc_id)): Path<(String, String)>,
    Query(q): Query<OutputQuery>,
) -> Result<Response, ApiError> {
    check_proc_id(&proc_id)?;
    let live = live_of(&app, &caller, &id).await?;
    // Fail before streaming if the process is unknown.
    result(&app, &live, live.machine.agent.get_process(&proc_id).await).await?;
    let (body_tx, response) = ndjson_response();
    tokio::spawn(async move {
        let (out_tx, mut out_rx) = mpsc::channel::<(Chan, Vec<u8>)>(32);
        let agent = live.machine.agent.clone();
        let Some(end) = pump(
            agent.process_output(&proc_id, q.follow, out_tx),
            &mut out_rx,
            &body_tx,
        )
        .await
        else {
            return;
        };
        let last = match end {
            Ok(mut info) => {
                fill_timings(&live, &mut info);
                match info.result {
                    Some(res) => typed("result", &res),
                    None => json!({"type": "state", "state": info.state}),
                }
            }
            Err(e) => error_line(e.into()),
        };
        send_line(&body_tx, &last).await;
    });
    Ok(response)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinQuery {
    /// Close the process's stdin after this write (it sees end of file).
    #[serde(default)]
    close: bool,
}

async fn stdin(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, proc_id)): Path<(String, String)>,
    Query(q): Query<StdinQuery>,
    body: Body,
) -> Result<impl IntoResponse, ApiError> {
    check_proc_id(&proc_id)?;
    let live = live_of(&app, &caller, &id).await?;
    let reader =
        tokio_util::io::StreamReader::new(body.into_data_stream().map_err(std::io::Error::other));
    let r = live
        .machine
        .agent
        .process_stdin(&proc_id, reader, q.close)
        .await;
    result(&app, &live, r).await?;
    Ok(axum::Json(json!({"ok": true})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalBody {
    signal: serde_json::Value,
}

/// Parses `"SIGTERM"`, `"TERM"` or `15`.
pub fn parse_signal(v: &serde_json::Value) -> Result<i32, ApiError> {
    const NAMES: &[(&str, i32)] = &[
        ("HUP", libc::SIGHUP),
        ("INT", libc::SIGINT),
        ("QUIT", libc::SIGQUIT),
        ("KILL", libc::SIGKILL),
        ("USR1", libc::SIGUSR1),
        ("USR2", libc::SIGUSR2),
        ("TERM", libc::SIGTERM),
        ("CONT", libc::SIGCONT),
        ("STOP", libc::SIGSTOP),
        ("TSTP", libc::SIGTSTP),
        ("WINCH", libc::SIGWINCH),
        ("ALRM", libc::SIGALRM),
        ("PIPE", libc::SIGPIPE),
    ];
    let bad = || {
        ApiError::bad_request(format!(
            "`signal` must be a name like \"SIGTERM\" or a number 1-64, got {v}"
        ))
    };
    match v {
        serde_json::Value::Number(n) => n
            .as_i64()
            .filter(|n| (1..=64).contains(n))
            .map(|n| n as i32)
            .ok_or_else(bad),
        serde_json::Value::String(s) => {
            let name = s.strip_prefix("SIG").unwrap_or(s);
            NAMES
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| *v)
                .ok_or_else(bad)
        }
        _ => Err(bad()),
    }
}

async fn signal(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, proc_id)): Path<(String, String)>,
    Json(b): Json<SignalBody>,
) -> Result<impl IntoResponse, ApiError> {
    check_proc_id(&proc_id)?;
    let sig = parse_signal(&b.signal)?;
    let live = live_of(&app, &caller, &id).await?;
    let r = live.machine.agent.signal_process(&proc_id, sig).await;
    result(&app, &live, r).await?;
    Ok(axum::Json(json!({"ok": true})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PtyQuery {
    cols: Option<u16>,
    rows: Option<u16>,
    /// The program to run (default: a login shell, bash if the template has it).
    cmd: Option<String>,
}

async fn pty(
    State(app): State<AppState>,
    headers: axum::http::HeaderMap,
    forwarded: Option<axum::Extension<crate::fleet::node::Forwarded>>,
    Path(id): Path<String>,
    Query(q): Query<PtyQuery>,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    // The key, or a browser's single-use ticket (the dashboard's terminal): see `ui`; on a
    // fleet node, the control plane's word (it checked the key).
    let caller = match forwarded {
        Some(axum::Extension(f)) => crate::auth::Caller {
            tenant: f.tenant,
            key_id: "fleet".into(),
        },
        None => crate::ui::pty_caller(&app, &headers, &id).await?,
    };
    let live = live_of(&app, &caller, &id).await?;
    let size = PtySize {
        cols: q.cols.unwrap_or(80).clamp(1, 1000),
        rows: q.rows.unwrap_or(24).clamp(1, 1000),
    };
    let shell = q.cmd.unwrap_or_else(|| {
        "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi".into()
    });
    if shell.contains('\0') {
        return Err(ApiError::bad_request("`cmd` must not contain NUL"));
    }
    let spec = locker_proto::ExecSpec {
        call_id: new_id("call_"),
        argv: vec!["/bin/sh".into(), "-c".into(), shell],
        env: live.env.clone().into_iter().collect(),
        max_output_bytes: locker_types::DEFAULT_MAX_OUTPUT_BYTES,
        pty: Some(size),
        stream_output: true,
        stdin: true,
        ..Default::default()
    };
    let ws = ws.protocols([crate::ui::PTY_PROTOCOL]);
    Ok(ws.on_upgrade(move |socket| async move {
        if let Err(e) = bridge(socket, &live.machine.agent, spec).await {
            tracing::debug!(sandbox = %live.id, error = %e, "pty ended");
        }
    }))
}

/// How long a terminal's end waits for the client's side of the closing handshake.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Copies terminal bytes between the WebSocket and the agent until either side ends.
async fn bridge(
    mut ws: WebSocket,
    agent: &locker_runtime::agent::AgentClient,
    spec: locker_proto::ExecSpec,
) -> Result<(), String> {
    let mut stream = agent.open(Request::Exec(spec)).map_err(|e| e.to_string())?;
    let sender = stream.sender();
    loop {
        tokio::select! {
            ev = stream.recv() => match ev.map_err(|e| e.to_string())? {
                Some(StreamEvent::Data(_, bytes)) => {
                    if ws.send(Message::Binary(bytes.into())).await.is_err() {
                        return Ok(());
                    }
                }
                Some(StreamEvent::End(body)) => {
                    let v = match body {
                        locker_proto::EndBody::Exec(r) => {
                            let mut v = serde_json::to_value(&*r).expect("json");
                            v["type"] = json!("exit");
                            v
                        }
                        locker_proto::EndBody::Error(e) => json!({"type": "error", "message": e.message}),
                        _ => json!({"type": "exit"}),
                    };
                    let _ = ws.send(Message::Text(v.to_string().into())).await;
                    let _ = ws.send(Message::Close(None)).await;
                    // The closing handshake, bounded: what the client still sends (input
                    // typed as the command ended, its own close) is read before the socket
                    // goes. A socket closed with unread input is reset, and the reset can
                    // reach the client before it has read the exit above.
                    let _ = tokio::time::timeout(CLOSE_WAIT, async {
                        while let Some(Ok(m)) = ws.recv().await {
                            if matches!(m, Message::Close(_)) {
                                break;
                            }
                        }
                    })
                    .await;
                    return Ok(());
                }
                Some(_) => {}
                None => return Ok(()),
            },
            // Input for a command that has just ended is dropped, not an error: its end (and
            // exit code) is still on its way from the agent, and must reach the client.
            msg = ws.recv() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    let _ = sender.send_data(Chan::Bytes, &b).await;
                }
                Some(Ok(Message::Text(t))) => {
                    #[derive(Deserialize)]
                    struct Resize { resize: [u16; 2] }
                    match serde_json::from_str::<Resize>(&t) {
                        Ok(r) => {
                            let _ = sender.resize(PtySize { cols: r.resize[0].max(1), rows: r.resize[1].max(1) });
                        }
                        // Text that is not a control message is typed input.
                        Err(_) => {
                            let _ = sender.send_data(Chan::Bytes, t.as_bytes()).await;
                        }
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => {
                    // The client left: dropping the stream cancels it, which ends the shell.
                    return Ok(());
                }
                Some(Ok(_)) => {}
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn signals_parse() {
        use serde_json::json;
        assert_eq!(
            super::parse_signal(&json!("SIGTERM")).unwrap(),
            libc::SIGTERM
        );
        assert_eq!(super::parse_signal(&json!("KILL")).unwrap(), libc::SIGKILL);
        assert_eq!(super::parse_signal(&json!(2)).unwrap(), 2);
        assert!(super::parse_signal(&json!("SIGNOPE")).is_err());
        assert!(super::parse_signal(&json!(0)).is_err());
    }
}
