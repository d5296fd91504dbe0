//! The code interpreter's protocol (E2B's port 49999, the server of `e2b-code-interpreter`
//! and `@e2b/code-interpreter`) onto Locker's code contexts (`crate::code::door`).
//!
//! Owns: E2B's routes and shapes on that port: `POST /execute` streamed as NDJSON
//! (`number_of_executions`, `stdout`/`stderr` with a timestamp, `result` with E2B's MIME
//! names, `error`, `keepalive` every [`KEEPALIVE`] while a cell is silent, and
//! `end_of_execution` last), `/contexts` (list, create, delete, restart) and `/health`;
//! errors as plain text with the status the SDKs turn into their exceptions (404
//! `NotFoundException`, 502 `TimeoutException`, anything else `SandboxException`).
//!
//! Must not: run kernels or keep contexts (the code room's driver does, one per sandbox), or
//! pass anything the machine sent through unread (the code room parses each line first).
//!
//! Access: the SDKs send the sandbox's access token (`X-Access-Token`) on `/execute` only,
//! and `E2B-Traffic-Access-Token` on every call when create returned a
//! `trafficAccessToken` (Locker's create and connect always return it: it is the same
//! secret as the access token). Every route but `/health` needs one of the two; a missing
//! or wrong token is a 401. Contexts live inside their sandbox's machine, so a
//! context id of another sandbox is unknown here (404) whoever asks.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::Target;
use crate::auth::constant_time_eq;
use crate::code::door::{self, Cell};
use crate::code::wire::{CodeError, CodeResult, Context, Execution, Line, NewContext, RunCode};
use crate::error::ApiError;
use crate::lifecycle::enter;
use crate::state::{AppState, Busy};
use crate::stream::{cuttable_ndjson_response, CutSender};

/// How long a cell may stay silent before a `keepalive` line: what E2B's server sends, and
/// what lets a client that went away be noticed (a write to its closed connection fails).
pub const KEEPALIVE: Duration = Duration::from_secs(5);
/// A cell's bound on the server side. E2B's has none: the SDK's `timeout` (300 s by
/// default) is the client's, which goes away and so interrupts the kernel; the sandbox's
/// TTL ends it at the latest. This is the code room's longest timeout (a day).
const CELL_TIMEOUT_MS: u64 = crate::code::wire::MAX_TIMEOUT_MS;
/// What a cell's stdout and stderr keep each (the head is streamed, the tail sent at the
/// end), larger than exec's default because E2B's own server keeps everything.
const CELL_MAX_OUTPUT: u64 = 1 << 20;
/// The largest request body: a cell's code (4 MiB in the code room) escaped as JSON.
const MAX_BODY: usize = 16 << 20;
/// Where a context starts when no `cwd` is given, as in E2B's code interpreter (its kernels
/// run as root in E2B's default user's home); `$HOME` where the template has no such
/// directory.
const E2B_HOME: &str = "/home/user";

pub(crate) async fn serve(app: AppState, t: Target, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_owned();
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let access = access(&parts.headers, &t);
    let m = &parts.method;
    let answer = match segs.as_slice() {
        ["health"] if m == Method::GET => Ok(axum::Json("OK").into_response()),
        ["execute"] if m == Method::POST => match access {
            Access::Granted => execute(&app, &t, body).await,
            Access::Refused => Err(refused()),
            Access::None => Err(Refusal::new(
                StatusCode::UNAUTHORIZED,
                "running code needs the sandbox's X-Access-Token header (the envdAccessToken \
                 that create and connect return; the E2B SDKs send it themselves)",
            )),
        },
        ["contexts"] | ["contexts", _] | ["contexts", _, "restart"]
            if access != Access::Granted =>
        {
            Err(if access == Access::Refused {
                refused()
            } else {
                Refusal::new(
                    StatusCode::UNAUTHORIZED,
                    "contexts need the sandbox's token as E2B-Traffic-Access-Token (the \
                     trafficAccessToken that create and connect return; the E2B SDKs send it \
                     themselves) or X-Access-Token",
                )
            })
        }
        ["contexts"] if m == Method::GET => list(&app, &t).await,
        ["contexts"] if m == Method::POST => create(&app, &t, body).await,
        ["contexts", id] if m == Method::DELETE => remove(&app, &t, id).await,
        ["contexts", id, "restart"] if m == Method::POST => restart(&app, &t, id).await,
        ["health"] | ["execute"] | ["contexts"] | ["contexts", _] | ["contexts", _, "restart"] => {
            Err(Refusal::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{m} {path} is not a route of the code interpreter (port 49999)"),
            ))
        }
        _ => Err(Refusal::new(
            StatusCode::NOT_FOUND,
            format!(
                "{m} {path}: the code interpreter (port 49999) serves POST /execute, \
                 GET and POST /contexts, DELETE /contexts/{{id}}, \
                 POST /contexts/{{id}}/restart and GET /health"
            ),
        )),
    };
    answer.unwrap_or_else(<Refusal as IntoResponse>::into_response)
}

/// What the request's tokens say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// The sandbox's token, as `X-Access-Token` or `E2B-Traffic-Access-Token`.
    Granted,
    /// A token that is not the sandbox's.
    Refused,
    /// No token at all.
    None,
}

fn access(headers: &HeaderMap, t: &Target) -> Access {
    if t.authorized {
        return Access::Granted;
    }
    let given = |name: &str| {
        headers
            .get(name)
            .map(|v| v.to_str().map(str::trim).unwrap_or_default())
            .filter(|v| !v.is_empty())
    };
    if let Some(traffic) = given("e2b-traffic-access-token") {
        let token = t.live.preview.read().expect("preview lock").token.clone();
        if !token.is_empty() && constant_time_eq(traffic.as_bytes(), token.as_bytes()) {
            return Access::Granted;
        }
        return Access::Refused;
    }
    if given("x-access-token").is_some() {
        return Access::Refused;
    }
    Access::None
}

fn refused() -> Refusal {
    Refusal::new(
        StatusCode::UNAUTHORIZED,
        "the access token is not this sandbox's: send the envdAccessToken that create and \
         connect returned for it",
    )
}

/// A failure as E2B's code interpreter answers one: its status and a plain-text reason
/// (the SDKs put the text into the exception they raise).
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl From<ApiError> for Refusal {
    fn from(e: ApiError) -> Self {
        Self::new(e.status, e.message)
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = self.status.as_u16(), message = %self.message, "E2B code interpreter call failed");
        }
        (
            self.status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            self.message,
        )
            .into_response()
    }
}

/// The request's JSON body (`{}` when empty), at most [`MAX_BODY`].
async fn json_body<T: serde::de::DeserializeOwned>(body: Body, what: &str) -> Result<T, Refusal> {
    let raw = Limited::new(body, MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Refusal::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "{what} is over {} MiB: write large code to a file and run that file",
                        MAX_BODY >> 20
                    ),
                )
            } else {
                Refusal::new(
                    StatusCode::BAD_REQUEST,
                    format!("{what} could not be read: {e}"),
                )
            }
        })?
        .to_bytes();
    let raw: &[u8] = if raw.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        &raw
    };
    serde_json::from_slice(raw).map_err(|e| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("{what} is not the JSON the code interpreter takes: {e}"),
        )
    })
}

/// E2B's language names as Locker's: case and spaces do not count, `js` is `javascript`
/// (E2B's own server does the same); the code room refuses what has no kernel.
fn language(raw: Option<&str>) -> Option<String> {
    let l = raw
        .map(|l| l.trim().to_ascii_lowercase())
        .filter(|l| !l.is_empty())?;
    Some(match l.as_str() {
        "js" => "javascript".into(),
        "ts" => "typescript".into(),
        _ => l,
    })
}

/// `POST /execute`'s body (unknown fields are ignored, as E2B's server does).
#[derive(Debug, Deserialize)]
struct ExecuteRequest {
    code: String,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

async fn execute(app: &AppState, t: &Target, body: Body) -> Result<Response, Refusal> {
    let req: ExecuteRequest = json_body(body, "the execution request").await?;
    let context = req.context_id.filter(|c| !c.is_empty());
    let language = language(req.language.as_deref());
    if context.is_some() && language.is_some() {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "give context_id or language, not both: a context has its own language",
        ));
    }
    let run = RunCode {
        code: req.code,
        context,
        language,
        timeout_ms: Some(CELL_TIMEOUT_MS),
        env: req.env_vars.unwrap_or_default(),
        max_output_bytes: Some(CELL_MAX_OUTPUT),
        home: Some(E2B_HOME.into()),
    };
    let busy = enter(app, t.live.clone())?;
    let (tx, response) = cuttable_ndjson_response();
    match door::cell(&busy, &run).await {
        Ok(cell) => {
            tokio::spawn(relay(app.clone(), busy, cell, tx));
        }
        // Killed before the cell's first line: cut as a stream under way is (see `relay`).
        Err(_) if super::went(app, &busy).await => {
            let _ = tx.try_send(Err(crate::stream::cut("the sandbox went before its cell began")));
        }
        Err(e) => return Err(context_error(e, &t.live.id)),
    }
    Ok(response)
}

/// A context the code room does not know, said in E2B's terms.
fn context_error(e: ApiError, sandbox: &str) -> Refusal {
    if e.status == StatusCode::NOT_FOUND {
        return Refusal::new(
            StatusCode::NOT_FOUND,
            format!(
                "{}; contexts belong to one sandbox ({sandbox} here): create one with \
                 create_code_context()",
                e.message
            ),
        );
    }
    e.into()
}

/// Relays a cell's lines as E2B's until its end; a client that goes away interrupts it. A
/// sandbox killed under the cell cuts the stream (as E2B's proxy does when a sandbox goes):
/// the SDKs then probe its health and say it was killed while the request was in progress.
async fn relay(app: AppState, live: Busy, mut cell: Cell, tx: CutSender) {
    let mut lines = Translator::default();
    loop {
        let next = tokio::select! {
            biased;
            _ = tx.closed() => {
                // The cell's output has nobody to go to: stop it, like E2B's server does.
                if let Err(e) = door::interrupt(&live, &cell.context).await {
                    tracing::debug!(sandbox = %live.id, error = %e.message, "interrupting an abandoned cell");
                }
                return;
            }
            _ = tokio::time::sleep_until(cell.until) => Err(ApiError::bad_gateway(format!(
                "the code interpreter in sandbox {} stopped answering; restart the context",
                live.id
            ))),
            next = tokio::time::timeout(KEEPALIVE, cell.lines.next()) => match next {
                Ok(next) => next,
                Err(_) => {
                    send(&tx, &json!({"type": "keepalive"})).await;
                    continue;
                }
            },
        };
        if !matches!(next, Ok(Some(_))) && super::went(&app, &live).await {
            let _ = tx
                .send(Err(crate::stream::cut("the sandbox went under a cell")))
                .await;
            return;
        }
        let (out, done) = match next {
            Ok(Some(line)) => lines.line(line, &timestamp()),
            Ok(None) => lines.broken("the code interpreter's answer ended before the cell did"),
            Err(e) => lines.broken(&e.message),
        };
        for v in &out {
            send(&tx, v).await;
        }
        if done {
            return;
        }
    }
}

async fn send(tx: &CutSender, v: &Value) {
    let mut line = serde_json::to_vec(v).expect("a JSON value serializes");
    line.push(b'\n');
    let _ = tx.send(Ok(Bytes::from(line))).await;
}

/// Now as E2B's server stamps output (the kernel message's date): RFC 3339, microseconds.
fn timestamp() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = locker_types::rfc3339(now.as_secs() as i64);
    format!("{}.{:06}Z", secs.trim_end_matches('Z'), now.subsec_micros())
}

/// Turns the code room's lines into E2B's, remembering what was streamed so that the end
/// adds only what is missing (the kept tail of a capped stream, an error no line carried).
#[derive(Debug, Default)]
struct Translator {
    stdout: String,
    stderr: String,
    error_sent: bool,
}

impl Translator {
    /// E2B's lines for one of the code room's, and whether the cell is over.
    fn line(&mut self, line: Line, now: &str) -> (Vec<Value>, bool) {
        match line {
            Line::Stdout { text } => {
                self.stdout.push_str(&text);
                (vec![output("stdout", &text, now)], false)
            }
            Line::Stderr { text } => {
                self.stderr.push_str(&text);
                (vec![output("stderr", &text, now)], false)
            }
            Line::Result(r) => (vec![result(r)], false),
            Line::Error(e) => {
                self.error_sent = true;
                (vec![error(&e)], false)
            }
            Line::Failure { status, error } => self.broken(&format!("{error} (status {status})")),
            Line::Execution(e) => (self.end(e, now), true),
        }
    }

    fn end(&mut self, e: Execution, now: &str) -> Vec<Value> {
        let mut out = Vec::new();
        if let Some(n) = e.execution_count {
            out.push(json!({"type": "number_of_executions", "execution_count": n}));
        }
        for (name, sent, all) in [
            ("stdout", &self.stdout, &e.stdout),
            ("stderr", &self.stderr, &e.stderr),
        ] {
            if let Some(rest) = all.strip_prefix(sent.as_str()).filter(|r| !r.is_empty()) {
                out.push(output(name, rest, now));
            }
        }
        if let (Some(err), false) = (&e.error, self.error_sent) {
            out.push(error(err));
        }
        out.push(json!({"type": "end_of_execution"}));
        out
    }

    /// The cell's end when the code interpreter failed under it.
    fn broken(&mut self, why: &str) -> (Vec<Value>, bool) {
        let err = CodeError {
            name: "CodeInterpreterError".into(),
            value: why.to_owned(),
            traceback: String::new(),
        };
        (vec![error(&err), json!({"type": "end_of_execution"})], true)
    }
}

fn output(kind: &str, text: &str, now: &str) -> Value {
    json!({"type": kind, "text": text, "timestamp": now})
}

fn error(e: &CodeError) -> Value {
    json!({"type": "error", "name": e.name, "value": e.value, "traceback": e.traceback})
}

/// A result under E2B's names. Like E2B's server, a text that is a quoted string loses its
/// quotes (`'kept'` is `kept`); what Locker left out is said in `extra`.
fn result(r: CodeResult) -> Value {
    let mut v = Map::new();
    v.insert("type".into(), json!("result"));
    if let Some(text) = r.text {
        v.insert("text".into(), json!(unquoted(&text)));
    }
    let fields = [
        ("html", r.html),
        ("markdown", r.markdown),
        ("svg", r.svg),
        ("png", r.png),
        ("jpeg", r.jpeg),
        ("pdf", r.pdf),
        ("latex", r.latex),
        ("javascript", r.javascript),
    ];
    for (name, value) in fields {
        if let Some(value) = value {
            v.insert(name.into(), json!(value));
        }
    }
    if let Some(j) = r.json {
        v.insert("json".into(), j);
    }
    if let Some(c) = r.chart {
        v.insert("chart".into(), c);
    }
    if let Some(d) = r.data {
        v.insert("data".into(), d);
    }
    let mut extra = Map::new();
    if r.truncated {
        extra.insert("truncated".into(), json!(true));
    }
    if !r.other_types.is_empty() {
        extra.insert("omitted_types".into(), json!(r.other_types));
    }
    if !extra.is_empty() {
        v.insert("extra".into(), Value::Object(extra));
    }
    v.insert("is_main_result".into(), json!(r.is_main_result));
    Value::Object(v)
}

fn unquoted(text: &str) -> &str {
    let quoted = text.len() >= 2
        && ((text.starts_with('\'') && text.ends_with('\''))
            || (text.starts_with('"') && text.ends_with('"')));
    if quoted {
        &text[1..text.len() - 1]
    } else {
        text
    }
}

/// A context as E2B shows it.
fn context(c: &Context) -> Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

/// `POST /contexts`'s body.
#[derive(Debug, Deserialize)]
struct CreateContext {
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
}

async fn create(app: &AppState, t: &Target, body: Body) -> Result<Response, Refusal> {
    let req: CreateContext = json_body(body, "the context to create").await?;
    let new = NewContext {
        language: language(req.language.as_deref()),
        cwd: req.cwd.filter(|c| !c.is_empty()),
        env: BTreeMap::new(),
        home: Some(E2B_HOME.into()),
    };
    let busy = enter(app, t.live.clone())?;
    let c = door::create(&busy, &new).await?;
    Ok(axum::Json(context(&c)).into_response())
}

/// The languages whose default contexts E2B's server starts with the sandbox.
const DEFAULT_LANGUAGES: &[&str] = &["python", "javascript"];

/// The contexts, with the default ones of [`DEFAULT_LANGUAGES`] made first unless they were
/// made before (E2B's server starts them at boot; Locker makes them on first use, and a list
/// is one; one deleted since stays deleted). A language the sandbox has no kernel for is
/// left out. The default contexts come first.
async fn list(app: &AppState, t: &Target) -> Result<Response, Refusal> {
    let busy = enter(app, t.live.clone())?;
    let mut all = door::list(&busy).await?;
    let mut made = false;
    for language in DEFAULT_LANGUAGES {
        let id = format!("ctx_default_{language}");
        if all.iter().any(|c| c.id == id) {
            continue;
        }
        let body = json!({"id": id, "language": language, "cwd": null, "home": E2B_HOME, "env": {}});
        match door::start_once(&busy, &body).await {
            Ok(()) => made = true,
            Err(e) if e.status == StatusCode::BAD_REQUEST => {}
            Err(e) => return Err(e.into()),
        }
    }
    if made {
        all = door::list(&busy).await?;
    }
    // First, as on E2B where they are the oldest: a context made before this list stays last.
    all.sort_by_key(|c| !c.id.starts_with("ctx_default_"));
    Ok(axum::Json(all.iter().map(context).collect::<Vec<_>>()).into_response())
}

async fn remove(app: &AppState, t: &Target, id: &str) -> Result<Response, Refusal> {
    let busy = enter(app, t.live.clone())?;
    door::remove(&busy, id)
        .await
        .map_err(|e| context_error(e, &t.live.id))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn restart(app: &AppState, t: &Target, id: &str) -> Result<Response, Refusal> {
    let busy = enter(app, t.live.clone())?;
    door::restart(&busy, id)
        .await
        .map_err(|e| context_error(e, &t.live.id))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::wire::{Reason, Timings};

    fn execution(stdout: &str, error: Option<CodeError>) -> Execution {
        Execution {
            execution_count: Some(7),
            stdout: stdout.into(),
            stderr: String::new(),
            stdout_truncated: false,
            stderr_truncated: false,
            results: vec![],
            error,
            reason: Reason::Finished,
            context: "ctx_a".into(),
            timings: Timings::default(),
        }
    }

    #[test]
    fn a_cells_lines_become_e2bs_with_the_end_adding_only_what_is_missing() {
        let mut t = Translator::default();
        let (out, done) = t.line(
            Line::Stdout {
                text: "head".into(),
            },
            "T",
        );
        assert_eq!(
            out,
            vec![json!({"type": "stdout", "text": "head", "timestamp": "T"})]
        );
        assert!(!done);
        // A capped stream: the tail only comes in the execution.
        let (out, done) = t.line(
            Line::Execution(execution("head\n…[locker: 9 bytes omitted]…\ntail", None)),
            "T",
        );
        assert!(done);
        assert_eq!(
            out,
            vec![
                json!({"type": "number_of_executions", "execution_count": 7}),
                json!({"type": "stdout", "text": "\n…[locker: 9 bytes omitted]…\ntail", "timestamp": "T"}),
                json!({"type": "end_of_execution"}),
            ]
        );

        // An error streamed is not sent twice; one only the end knows (a timeout) is sent.
        let boom = CodeError {
            name: "ValueError".into(),
            value: "boom".into(),
            traceback: "tb".into(),
        };
        let mut t = Translator::default();
        let (out, _) = t.line(Line::Error(boom.clone()), "T");
        assert_eq!(
            out,
            vec![
                json!({"type": "error", "name": "ValueError", "value": "boom", "traceback": "tb"})
            ]
        );
        let (out, _) = t.line(Line::Execution(execution("", Some(boom.clone()))), "T");
        assert_eq!(out.len(), 2, "{out:?}");
        let mut t = Translator::default();
        let (out, _) = t.line(Line::Execution(execution("", Some(boom))), "T");
        assert_eq!(out[1]["type"], "error");
        assert_eq!(out[2]["type"], "end_of_execution");

        let (out, done) = Translator::default().line(
            Line::Failure {
                status: 400,
                error: "no bash kernel".into(),
            },
            "T",
        );
        assert!(done);
        assert_eq!(out[0]["name"], "CodeInterpreterError");
        assert!(out[0]["value"].as_str().unwrap().contains("no bash kernel"));
        assert_eq!(out[1]["type"], "end_of_execution");
    }

    #[test]
    fn results_take_e2bs_names_and_quoted_text_loses_its_quotes() {
        let r = result(CodeResult {
            is_main_result: true,
            text: Some("'kept'".into()),
            png: Some("iVBO".into()),
            json: Some(json!({"a": 1})),
            truncated: true,
            other_types: vec!["application/vnd.custom".into()],
            ..Default::default()
        });
        assert_eq!(
            r,
            json!({
                "type": "result",
                "text": "kept",
                "png": "iVBO",
                "json": {"a": 1},
                "extra": {"truncated": true, "omitted_types": ["application/vnd.custom"]},
                "is_main_result": true,
            })
        );
        assert_eq!(unquoted("'"), "'");
        assert_eq!(unquoted("\"a\""), "a");
        assert_eq!(unquoted("42"), "42");
    }

    #[test]
    fn languages_are_normalized_like_e2bs_server() {
        assert_eq!(language(None), None);
        assert_eq!(language(Some("  ")), None);
        assert_eq!(language(Some("Python")).as_deref(), Some("python"));
        assert_eq!(language(Some("js")).as_deref(), Some("javascript"));
        assert_eq!(language(Some("ts")).as_deref(), Some("typescript"));
        assert_eq!(language(Some("bash")).as_deref(), Some("bash"));
    }

    #[test]
    fn timestamps_are_rfc3339_with_microseconds() {
        let t = timestamp();
        assert_eq!(t.len(), "2026-12-02T10:00:00.000000Z".len(), "{t}");
        assert!(t.ends_with('Z') && t.as_bytes()[19] == b'.', "{t}");
    }
}
