//! The code interpreter over HTTP: contexts (`/v1/sandboxes/{id}/contexts…`), each a Jupyter
//! kernel in the machine, and cells (`POST /v1/sandboxes/{id}/code`) answered as one
//! Execution or as an NDJSON stream.
//!
//! The kernels are driven inside the machine by `driver.py` on `jupyter_client` (the
//! Jupyter messaging protocol's own implementation), started on first use (`driver`). This
//! room checks requests, finds the sandbox through `live_of` (a call resumes a paused
//! sandbox and counts as activity for the whole cell), and relays what the driver answers
//! after parsing it into the contract's shapes (`wire`): nothing the machine sends is passed
//! through unread. Two cells on one context queue in arrival order inside the driver (one
//! worker per kernel); `timeout_ms` counts from the cell's arrival, its wait included.
//!
//! Every cell that reaches the driver is recorded like an exec (`GET /v1/calls`, kind
//! `code`, `command` = the context and the code, no output).
//!
//! It does not run commands, own ports or keep state: a context lives in the machine's
//! memory only.

pub(crate) mod door;
mod driver;
pub mod wire;

use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use locker_store::{CallKind, CallRecord};
use locker_types::{
    ExecResult, Reason as ExecReason, Timings as ExecTimings, DEFAULT_MAX_OUTPUT_BYTES,
};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::timeout_at;

pub use self::driver::{prestart, PORT};
use self::driver::{Start, CONTEXT_DEADLINE, EXECUTE_SLACK};
use self::wire::*;
use crate::auth::Caller;
use crate::command::MAX_OUTPUT_CAP;
use crate::error::ApiError;
use crate::extract::Json;
use crate::lifecycle::live_of;
use crate::limits::check_env;
use crate::state::{ms_since, new_id, now_s, AppState, Live};
use crate::stream::{error_line, ndjson_response, send_line, typed, wants_ndjson};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/contexts", post(create).get(list))
        .route("/v1/sandboxes/{id}/contexts/{ctx}", delete(remove))
        .route("/v1/sandboxes/{id}/contexts/{ctx}/restart", post(restart))
        .route(
            "/v1/sandboxes/{id}/contexts/{ctx}/interrupt",
            post(interrupt),
        )
        .route("/v1/sandboxes/{id}/code", post(run_code))
}

/// Whether a port in the machine is the code driver's (hidden from the port list and proxy).
pub fn is_driver_port(port: u16) -> bool {
    port == PORT
}

fn language_of(raw: Option<&str>) -> Result<&'static str, ApiError> {
    let raw = raw.unwrap_or("python");
    LANGUAGES
        .iter()
        .find(|l| **l == raw)
        .copied()
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "`language` must be one of {}; got {raw:?}",
                LANGUAGES.join(", ")
            ))
        })
}

/// A context id as clients see it; anything else cannot name a context.
fn check_context_id(sandbox: &str, ctx: &str) -> Result<(), ApiError> {
    let ok = ctx.len() <= 64
        && ctx.starts_with("ctx_")
        && ctx
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(no_context(sandbox, ctx))
    }
}

fn no_context(sandbox: &str, ctx: &str) -> ApiError {
    ApiError::not_found(format!(
        "no context {ctx:?} in sandbox {sandbox}: create one with POST /v1/sandboxes/{sandbox}/contexts"
    ))
}

/// The driver took longer than any cell or kernel start may.
fn stuck(sandbox: &str) -> ApiError {
    ApiError::bad_gateway(format!(
        "the code interpreter in sandbox {sandbox} stopped answering; restart the context \
         (POST …/contexts/{{ctx}}/restart)"
    ))
}

/// Sends a context request with the context deadline.
async fn ask(
    live: &crate::state::Live,
    start: Start,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<Option<Response<Incoming>>, ApiError> {
    tokio::time::timeout(
        CONTEXT_DEADLINE,
        driver::send(live, start, method, path, body),
    )
    .await
    .map_err(|_| stuck(&live.id))?
}

/// A small JSON answer of the driver, parsed.
async fn read_json<T: DeserializeOwned>(resp: Response<Incoming>) -> Result<T, ApiError> {
    let body = Limited::new(resp.into_body(), 1 << 20)
        .collect()
        .await
        .map_err(|e| garbled(&format!("unreadable answer ({e})")))?;
    serde_json::from_slice(&body.to_bytes()).map_err(|e| garbled(&format!("{e}")))
}

async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(req): Json<NewContext>,
) -> Result<Response, ApiError> {
    // Checked before the sandbox is found (and a paused one resumed).
    let body = door::context_body(&req)?;
    let live = live_of(&app, &caller, &id).await?;
    let ctx = door::start_context(&live, &body).await?;
    Ok((StatusCode::CREATED, axum::Json(ctx)).into_response())
}

async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let live = live_of(&app, &caller, &id).await?;
    let contexts = door::list(&live).await?;
    Ok(axum::Json(json!({ "contexts": contexts })).into_response())
}

async fn remove(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, ctx)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    check_context_id(&id, &ctx)?;
    let live = live_of(&app, &caller, &id).await?;
    door::remove(&live, &ctx).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn restart(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, ctx)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    check_context_id(&id, &ctx)?;
    let live = live_of(&app, &caller, &id).await?;
    Ok(axum::Json(door::restart(&live, &ctx).await?).into_response())
}

async fn interrupt(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, ctx)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    check_context_id(&id, &ctx)?;
    let live = live_of(&app, &caller, &id).await?;
    let interrupted = door::interrupt(&live, &ctx).await?;
    Ok(axum::Json(json!({ "id": ctx, "interrupted": interrupted })).into_response())
}

/// A cell's request checked, as the driver takes it.
fn cell_body(req: &RunCode, stream: bool) -> Result<(Value, u64), ApiError> {
    let language = language_of(req.language.as_deref())?;
    if req.code.len() > MAX_CODE {
        return Err(ApiError::too_large(format!(
            "`code` is over {} MiB: write it to a file with the files API and run that file",
            MAX_CODE >> 20
        )));
    }
    let timeout_ms = req.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);
    if timeout_ms == 0 || timeout_ms > MAX_TIMEOUT_MS {
        return Err(ApiError::bad_request(format!(
            "`timeout_ms` must be from 1 to {MAX_TIMEOUT_MS}, got {timeout_ms}"
        )));
    }
    let max_output = req.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT_BYTES);
    if max_output > MAX_OUTPUT_CAP {
        return Err(ApiError::bad_request(format!(
            "`max_output_bytes` must be at most {MAX_OUTPUT_CAP} (per stream; the head and the tail are kept)"
        )));
    }
    check_env(&req.env)?;
    let body = json!({
        "context": req.context,
        // Only what the caller said: a context keeps its own language.
        "language": req.language.as_ref().map(|_| language),
        "code": req.code,
        "timeout_ms": timeout_ms,
        "env": req.env,
        "max_output_bytes": max_output,
        "stream": stream,
        "home": req.home,
    });
    Ok((body, timeout_ms))
}

async fn run_code(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<RunCode>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let stream = wants_ndjson(&headers);
    let (body, timeout_ms) = cell_body(&req, stream)?;
    if let Some(ctx) = &req.context {
        check_context_id(&id, ctx)?;
    }
    let live = live_of(&app, &caller, &id).await?;
    let until =
        tokio::time::Instant::from_std(arrived) + Duration::from_millis(timeout_ms) + EXECUTE_SLACK;
    let resp = timeout_at(
        until,
        driver::send(
            &live,
            Start::IfMissing,
            Method::POST,
            "/execute",
            Some(&body),
        ),
    )
    .await
    .map_err(|_| stuck(&id))??
    .ok_or_else(|| stuck(&id))?;
    let queue_ms = ms_since(arrived);
    let mut lines = LineReader::new(resp.into_body());
    if !stream {
        let mut execution = timeout_at(until, last_execution(&mut lines))
            .await
            .map_err(|_| stuck(&id))??;
        execution.timings.queue_ms = queue_ms;
        execution.timings.total_ms = ms_since(arrived);
        app.recorder
            .record(call_record(&caller, &live, &req, &execution));
        return Ok(axum::Json(execution).into_response());
    }
    let (tx, response) = ndjson_response();
    tokio::spawn(async move {
        // The sandbox is busy until the stream's last line.
        let relayed = timeout_at(until, relay(&mut lines, &tx, arrived, queue_ms)).await;
        if let Ok(Ok(Some(execution))) = &relayed {
            app.recorder
                .record(call_record(&caller, &live, &req, execution));
        }
        let failed = match relayed {
            Ok(Ok(_)) => return,
            Ok(Err(e)) => e,
            Err(_) => stuck(&id),
        };
        send_line(&tx, &error_line(failed)).await;
    });
    Ok(response)
}

/// Reads the driver's lines up to the Execution.
async fn last_execution(lines: &mut LineReader<Incoming>) -> Result<Execution, ApiError> {
    while let Some(line) = lines.next().await? {
        match line {
            Line::Execution(e) => return Ok(e),
            Line::Failure { status, error } => return Err(driver::status_error(status, error)),
            _ => {}
        }
    }
    Err(garbled("its answer ended before the cell's end"))
}

/// Relays the driver's lines as the contract's NDJSON, the Execution last (and returned). A
/// client that goes away ends the relay: the connection closes and the driver interrupts the cell.
async fn relay(
    lines: &mut LineReader<Incoming>,
    tx: &mpsc::Sender<Bytes>,
    arrived: Instant,
    queue_ms: f64,
) -> Result<Option<Execution>, ApiError> {
    while let Some(line) = lines.next().await? {
        let out = match line {
            Line::Stdout { text } => json!({"type": "stdout", "text": text}),
            Line::Stderr { text } => json!({"type": "stderr", "text": text}),
            Line::Result(r) => typed("result", &r),
            Line::Error(e) => typed("error", &e),
            Line::Failure { status, error } => return Err(driver::status_error(status, error)),
            Line::Execution(mut e) => {
                e.timings.queue_ms = queue_ms;
                e.timings.total_ms = ms_since(arrived);
                send_line(tx, &typed("execution", &e)).await;
                return Ok(Some(e));
            }
        };
        if tx.is_closed() {
            return Ok(None);
        }
        send_line(tx, &out).await;
    }
    Err(garbled("its answer ended before the cell's end"))
}

/// The call record of a cell: its context and code, the names of its env variables, and
/// its end as an exec's result (no output, only its size).
fn call_record(caller: &Caller, live: &Live, req: &RunCode, e: &Execution) -> CallRecord {
    let (reason, exit_code) = match e.reason {
        Reason::Finished => (ExecReason::Exited, Some(0)),
        Reason::Error => (ExecReason::Exited, Some(1)),
        Reason::Timeout => (ExecReason::Timeout, None),
        Reason::Interrupted => (ExecReason::Killed, None),
        Reason::ContextDied => (ExecReason::Signaled, None),
    };
    let call_id = new_id("call_");
    CallRecord {
        id: call_id.clone(),
        tenant: caller.tenant.clone(),
        key_id: caller.key_id.clone(),
        kind: CallKind::Code,
        sandbox_id: Some(live.id.clone()),
        volume_id: None,
        command: vec![e.context.clone(), req.code.clone()],
        cwd: None,
        env_keys: req.env.keys().cloned().collect(),
        template_digest: live.template_digest.clone(),
        runtime: live.machine.kind().as_str().into(),
        result: ExecResult {
            call_id,
            exit_code,
            signal: None,
            reason,
            stdout: String::new(),
            stderr: String::new(),
            stdout_b64: None,
            stderr_b64: None,
            stdout_truncated: e.stdout_truncated,
            stderr_truncated: e.stderr_truncated,
            stdout_bytes: e.stdout.len() as u64,
            stderr_bytes: e.stderr.len() as u64,
            output_path: None,
            timings: ExecTimings {
                queue_ms: e.timings.queue_ms,
                start_ms: 0.0,
                run_ms: e.timings.run_ms,
                total_ms: e.timings.total_ms,
            },
            usage: Default::default(),
            changes: None,
        },
        egress_denied: vec![],
        secrets_used: vec![],
        secret_misuse: vec![],
        changes: None,
        created_at: locker_types::rfc3339(now_s()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_ids_and_languages_are_checked() {
        assert!(check_context_id("sb_1", "ctx_0123abcd").is_ok());
        assert!(check_context_id("sb_1", "ctx_default_python").is_ok());
        for bad in [
            "",
            "ctx",
            "../ctx_a",
            "ctx_A",
            "ctx_a/b",
            &format!("ctx_{}", "a".repeat(70)),
        ] {
            let e = check_context_id("sb_1", bad).unwrap_err();
            assert_eq!(e.status, StatusCode::NOT_FOUND, "{bad}");
        }
        assert_eq!(language_of(None).unwrap(), "python");
        assert_eq!(language_of(Some("bash")).unwrap(), "bash");
        assert_eq!(
            language_of(Some("ruby")).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert!(is_driver_port(PORT) && !is_driver_port(8000));
    }
}
