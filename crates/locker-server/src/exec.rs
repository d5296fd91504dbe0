//! `POST /v1/sandboxes/{id}/exec`: one command, as a typed result or as an NDJSON stream.
//!
//! The hot path: authenticate (cached hash), find the live sandbox (a map read), one frame
//! to its agent over the open channel, wait, answer. The call record is queued for the
//! batch writer; nothing here waits on the database.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use locker_proto::{Chan, ExecSpec};
use locker_types::{ExecRequest, ExecResult, Reason, Timings};
use tokio::sync::mpsc;

use crate::auth::Caller;
use crate::command::{build_spec, call_record, Wait};
use crate::error::ApiError;
use crate::extract::Json;
use crate::lifecycle::live_of;
use crate::state::{ms_since, new_id, AppState, Live};
use crate::stream::{error_line, ndjson_response, pump, send_line, typed, wants_ndjson};

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/sandboxes/{id}/exec", post(exec))
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
    let (mut spec, stdin) = build_spec(&live.env, &req, &call_id, Wait::Call { stream })?;
    crate::templates::apply_defaults(&app, &live.template_digest, &mut spec);
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
    (record.secrets_used, record.secret_misuse) = app.egress.secrets_since(&live.id, arrived);
    app.recorder.record(record);
}
