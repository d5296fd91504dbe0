//! The way to a sandbox's code driver (`driver.py`, shipped inside this binary): started on
//! first use by one exec of `python3 - --start` with its source on stdin, then reached at
//! `127.0.0.1:`[`PORT`] in the machine the way the port proxy reaches a port
//! (`locker_runtime::dial`: a jail's loopback dialled directly from the host, a microVM's
//! through the agent's tunnel), one HTTP/1 request per connection.
//!
//! Why in the binary and not in the template: the driver and the server that speaks to it
//! change together, so a server upgrade never meets an older driver baked into a template,
//! and any template with Python's `jupyter_client` and `ipykernel` (a user's own) works.
//! Locker's own kernels (`kernels/`) travel the same way, ahead of the driver's source
//! (`KERNEL_FILES`). Nothing is written to the machine's disk but a language runtime's
//! source, in a private directory until the runtime has read it, so user code cannot
//! corrupt the driver's files.
//!
//! This room owns starting and reaching the driver and turning its refusals into API errors;
//! it does not parse executions (`wire`) or know routes (`mod`).

use std::time::Duration;

use axum::http::{header, Method, Request, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::collections::BTreeMap;

use locker_proto::ExecSpec;
use locker_runtime::dial::{self, PortConn};
use locker_runtime::node::Machine;
use locker_runtime::ports::PortError;
use serde::Deserialize;
use serde_json::Value;

use super::wire::garbled;
use crate::error::ApiError;
use crate::state::{new_id, Live};

/// The driver's port on the machine's loopback: E2B's code-interpreter port, so a
/// sandbox's own servers rarely want it; hidden from the port list and the proxy.
pub const PORT: u16 = 49999;
/// Locker's own kernels (`kernels/`), handed to the driver with its source.
const KERNEL_FILES: &[(&str, &str)] = &[
    ("runtime_kernel.py", include_str!("kernels/runtime_kernel.py")),
    ("bash_kernel.py", include_str!("kernels/bash_kernel.py")),
    ("js_runtime.js", include_str!("kernels/js_runtime.js")),
    ("JShellRuntime.java", include_str!("kernels/JShellRuntime.java")),
    ("python_display.py", include_str!("kernels/python_display.py")),
];

/// What is written to `python3`'s stdin at start: `KERNEL_FILES = {name: source, …}` (each
/// a JSON string, which Python reads as its own string literal), then the driver's source.
fn source() -> &'static [u8] {
    static SOURCE: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
        let files: serde_json::Map<String, Value> = KERNEL_FILES
            .iter()
            .map(|(name, text)| (name.to_string(), Value::from(*text)))
            .collect();
        format!("KERNEL_FILES = {}\n{}", Value::Object(files), include_str!("driver.py"))
            .into_bytes()
    });
    &SOURCE
}
/// How long the driver may take to start listening (`python3` and `jupyter_client` import).
const START_TIMEOUT_MS: u64 = 60_000;
/// How long a context request may take: a kernel's start or restart fits well within it.
pub const CONTEXT_DEADLINE: Duration = Duration::from_secs(120);
/// What a cell may take beyond its `timeout_ms` before the driver is deemed stuck: the
/// interrupt's grace, a kernel restart, and the default context's first kernel.
pub const EXECUTE_SLACK: Duration = Duration::from_secs(150);
/// The driver's exit status when the template has no Jupyter kernel.
const NO_KERNEL: i32 = 3;
/// `exec`'s status when there is no such program (no `python3`).
const NO_PROGRAM: i32 = 127;

/// Whether a request may start the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Start it if it is not running (creating contexts, running code).
    IfMissing,
    /// A driver that is not running has no contexts: answer without starting one.
    Never,
}

/// A machine whose driver is spoken to: a sandbox's, or a warm pool's not yet a sandbox's.
pub struct Target<'a> {
    pub id: &'a str,
    pub machine: &'a Machine,
    /// The environment the driver (and so every kernel) starts with.
    pub env: &'a BTreeMap<String, String>,
}

impl<'a> From<&'a Live> for Target<'a> {
    fn from(live: &'a Live) -> Self {
        Self {
            id: &live.id,
            machine: &live.machine,
            env: &live.env,
        }
    }
}

/// Sends one request to the driver of `live` and returns its answer when it is a success.
/// `None`: the driver is not running and `start` said not to start it.
pub async fn send(
    live: &Live,
    start: Start,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<Option<Response<Incoming>>, ApiError> {
    send_to(&Target::from(live), start, method, path, body).await
}

/// How long a warm machine may take to start its driver and spare kernel: long, since it is
/// made in the background and a microVM under TCG on a busy host took over 90 s (Python and
/// ipykernel's imports, translated).
const PRESTART_DEADLINE: Duration = Duration::from_secs(600);

/// Starts the driver of a machine not yet a sandbox's (the warm pool's) and a spare Python
/// kernel in it, returning once the kernel is ready: the machine's first context takes it.
pub async fn prestart(machine: &Machine) -> Result<(), String> {
    let env = BTreeMap::new();
    let target = Target {
        id: &machine.id,
        machine,
        env: &env,
    };
    let body = serde_json::json!({ "language": "python" });
    let asked = tokio::time::timeout(
        PRESTART_DEADLINE,
        send_to(
            &target,
            Start::IfMissing,
            Method::POST,
            "/spare",
            Some(&body),
        ),
    )
    .await
    .map_err(|_| "the code driver's spare kernel did not start in 600 s".to_string())?;
    let resp = asked
        .map_err(|e| e.message)?
        .ok_or_else(|| "the code driver did not start".to_string())?;
    // The answer is read whole: the kernel is ready when it ends.
    Limited::new(resp.into_body(), 1 << 16)
        .collect()
        .await
        .map(|_| ())
        .map_err(|e| format!("the code driver's answer broke off ({e})"))
}

async fn send_to(
    live: &Target<'_>,
    start: Start,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<Option<Response<Incoming>>, ApiError> {
    let Some(conn) = connection(live, start).await? else {
        return Ok(None);
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(conn))
        .await
        .map_err(|e| garbled(&format!("no HTTP/1 connection ({e})")))?;
    let sandbox = live.id.to_owned();
    tokio::spawn(async move {
        // The connection ends with the response; a broken one shows in the response.
        if let Err(e) = conn.await {
            tracing::debug!(sandbox = %sandbox, error = %e, "code driver connection ended");
        }
    });
    let raw = body
        .map(|b| serde_json::to_vec(b).expect("a JSON value serializes"))
        .unwrap_or_default();
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, format!("127.0.0.1:{PORT}"))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, raw.len())
        .body(Full::new(Bytes::from(raw)))
        .map_err(|e| ApiError::internal(format!("code driver request: {e}")))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| garbled(&format!("no answer ({e})")))?;
    if resp.status().is_success() {
        return Ok(Some(resp));
    }
    Err(refusal(resp).await)
}

/// A connection to the driver, starting it first when `start` allows.
async fn connection(live: &Target<'_>, start: Start) -> Result<Option<PortConn>, ApiError> {
    match dial::dial(live.machine, PORT).await {
        Ok(t) => return Ok(Some(t)),
        Err(PortError::NotListening(_)) => {}
        Err(e) => return Err(port_error(e)),
    }
    if start == Start::Never {
        return Ok(None);
    }
    let why = launch(live).await?;
    match dial::dial(live.machine, PORT).await {
        Ok(t) => Ok(Some(t)),
        Err(PortError::NotListening(_)) => Err(ApiError::internal(format!(
            "the code interpreter's driver did not start in sandbox {}: {}",
            live.id,
            if why.is_empty() {
                "it exited at once"
            } else {
                &why
            }
        ))),
        Err(e) => Err(port_error(e)),
    }
}

fn port_error(e: PortError) -> ApiError {
    match e {
        PortError::Unsupported => ApiError::conflict(format!(
            "{}; the code interpreter reaches its kernels through ports",
            PortError::Unsupported
        )),
        PortError::NotListening(m) => garbled(&m),
        PortError::Agent(e) => ApiError::from(e),
        e @ PortError::Busy(_) => ApiError::quota(format!("the code interpreter's driver: {e}")),
        e @ PortError::Dial(_) => {
            ApiError::bad_gateway(format!("the code interpreter's driver: {e}"))
        }
    }
}

/// Starts the driver: one exec that returns once it listens. `Ok` with what it said when
/// it did not start itself (another start won the port): the next connect decides.
async fn launch(live: &Target<'_>) -> Result<String, ApiError> {
    let mut env: Vec<(String, String)> = live
        .env
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.push(("PYTHONDONTWRITEBYTECODE".into(), "1".into()));
    let spec = ExecSpec {
        call_id: new_id("call_"),
        argv: vec!["python3".into(), "-".into(), "--start".into()],
        cwd: None,
        env,
        stdin: true,
        timeout_ms: Some(START_TIMEOUT_MS),
        max_output_bytes: 16 << 10,
        user: None,
        stream_output: false,
        pty: None,
        kill_jobs: false,
    };
    let res = live
        .machine
        .agent
        .exec(spec, Some(source().to_vec()), None)
        .await
        .map_err(ApiError::from)?;
    let said = res.stderr.trim().to_owned();
    match res.exit_code {
        Some(0) => Ok(String::new()),
        Some(NO_KERNEL) | Some(NO_PROGRAM) => Err(ApiError::conflict(format!(
            "sandbox {} has no Jupyter kernel for the code interpreter ({}): create the sandbox \
             with \"template\": \"code-interpreter\" (a host builds it once with \
             `sudo locker template build code-interpreter`), or add python3-ipykernel and \
             python3-jupyter-client to your template",
            live.id,
            if said.is_empty() { "no python3" } else { &said }
        ))),
        _ => Ok(said),
    }
}

/// A driver's refusal (`{"error": "…"}` with a status) as the API's error.
async fn refusal(resp: Response<Incoming>) -> ApiError {
    #[derive(Deserialize)]
    struct Refusal {
        error: String,
    }
    let status = resp.status().as_u16();
    let Ok(body) = Limited::new(resp.into_body(), 1 << 20).collect().await else {
        return garbled(&format!("it answered {status} with an unreadable body"));
    };
    match serde_json::from_slice::<Refusal>(&body.to_bytes()) {
        Ok(r) => status_error(status, r.error),
        Err(_) => garbled(&format!("it answered {status}")),
    }
}

/// The driver's status and message as the API's error.
pub fn status_error(status: u16, message: String) -> ApiError {
    match status {
        400 => ApiError::bad_request(message),
        404 => ApiError::not_found(message),
        409 => ApiError::conflict(message),
        _ => ApiError::internal(format!(
            "the code interpreter in the sandbox failed: {message}"
        )),
    }
}
