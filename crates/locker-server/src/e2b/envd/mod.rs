//! envd, E2B's in-sandbox daemon, served by the server onto Locker's rooms: the Connect
//! services `process.Process` ([`process`]) and `filesystem.Filesystem` ([`filesystem`]),
//! JSON codec ([`connect`]), and the plain-HTTP endpoints `/files` and `/files/compose`
//! ([`files`]), `/health`, `/envs`, `/metrics` and `/init` (whose defaults, and process
//! tags, are the only state of envd's own: [`state`]).
//!
//! Owns: the translation of envd's wire protocol onto Locker's background processes
//! (`processes`, the agent's process table: E2B's pids are looked up there, no second
//! table), its files (the agent's file operations) and the machine's inotify watches.
//! Must not touch: routing and the access token (`e2b/mod.rs`), the control plane
//! (`control.rs`), the code interpreter (`interp.rs`).
//!
//! Users: an RPC names its user with `Authorization: Basic base64("<user>:")`, a `/files`
//! call with `?username=`; without either it runs as E2B's default user `user`. Relative
//! paths resolve against that user's home (`/root` or `/home/<user>`), and what a call
//! creates (files, directories and their missing parents) is given to that user.

use axum::extract::Request;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};

use locker_runtime::agent::{AgentClient, AgentClientError};

use super::{E2bError, Target};
use crate::state::AppState;

mod connect;
mod files;
mod filesystem;
mod process;
mod state;

use connect::{Code, ConnectError};

/// E2B's default user when a call names none.
pub const DEFAULT_USER: &str = "user";

pub(crate) async fn serve(app: AppState, t: Target, req: Request) -> Response {
    let path = req.uri().path().to_owned();
    if path == "/health" {
        // A paused sandbox is not running for E2B (`is_running()` is `False` until a
        // connect or any other call resumes it); this probe alone does not resume it.
        if t.live.is_paused() {
            return E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "The sandbox {} was not found running: it is paused (connect resumes it)",
                    t.live.id
                ),
            )
            .into_response();
        }
        return StatusCode::NO_CONTENT.into_response();
    }
    // `/files` may be let through by a signature instead of the token.
    if path == "/files" {
        return files::serve(app, t, req).await;
    }
    let rpc = path.starts_with("/process.Process/") || path.starts_with("/filesystem.Filesystem/");
    if !t.authorized {
        let m = "missing or wrong X-Access-Token: use the sandbox's envdAccessToken";
        return if rpc {
            ConnectError::new(Code::Unauthenticated, m).into_response()
        } else {
            E2bError::unauthorized(m).into_response()
        };
    }
    if rpc {
        if req.method() != Method::POST {
            return ConnectError::new(
                Code::Unimplemented,
                format!("{} {path}: Connect calls are POST", req.method()),
            )
            .into_response();
        }
        return match path.strip_prefix("/process.Process/") {
            Some(m) => process::serve(app, t, m.to_owned(), req).await,
            None => {
                let m = path
                    .trim_start_matches("/filesystem.Filesystem/")
                    .to_owned();
                filesystem::serve(app, t, m, req).await
            }
        };
    }
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/envs") => {
            let mut env = t.live.env.clone();
            env.extend(state::defaults(&t.live.id).env);
            axum::Json(env).into_response()
        }
        (Method::GET, "/metrics") => metrics(&app, &t)
            .await
            .unwrap_or_else(|e| e.into_response()),
        (Method::POST, "/init") => init(&app, &t, req)
            .await
            .map_or_else(|e| e.into_response(), IntoResponse::into_response),
        (Method::POST, "/files/compose") => files::compose(app, t, req)
            .await
            .unwrap_or_else(|e| e.into_response()),
        (m, p @ ("/envs" | "/metrics" | "/init" | "/files/compose")) => {
            let want = if matches!(p, "/envs" | "/metrics") {
                "GET"
            } else {
                "POST"
            };
            E2bError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{m} {p}: {p} takes {want}"),
            )
            .into_response()
        }
        _ => E2bError::not_found(format!(
            "{} {path}: envd serves /process.Process/*, /filesystem.Filesystem/*, /files, \
             /files/compose, /health, /envs, /metrics and /init",
            req.method()
        ))
        .into_response(),
    }
}

/// `GET /metrics`: envd's `Metrics` of the sandbox now (the control plane's one sample, in
/// envd's field names).
async fn metrics(app: &AppState, t: &Target) -> Result<Response, E2bError> {
    let r = crate::lifecycle::record_of(app, &t.caller, &t.live.id)?;
    let live = crate::lifecycle::live_of(app, &t.caller, &t.live.id).await?;
    let m = super::control::metric(&r, &live, crate::state::now_s());
    let n = |k: &str| m[k].as_u64().unwrap_or(0);
    Ok(axum::Json(serde_json::json!({
        "ts": m["timestampUnix"],
        "cpu_count": m["cpuCount"],
        "cpu_used_pct": m["cpuUsedPct"],
        "mem_total": n("memTotal"),
        "mem_used": n("memUsed"),
        "mem_cache": n("memCache"),
        "mem_total_mib": n("memTotal") >> 20,
        "mem_used_mib": n("memUsed") >> 20,
        "disk_used": n("diskUsed"),
        "disk_total": n("diskTotal"),
    }))
    .into_response())
}

/// envd's `/init` body (what the orchestrator sends a started or resumed sandbox).
#[derive(serde::Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Init {
    env_vars: std::collections::BTreeMap<String, String>,
    access_token: Option<String>,
    timestamp: Option<String>,
    default_user: Option<String>,
    default_workdir: Option<String>,
    volume_mounts: Vec<serde_json::Value>,
    ca_bundle: Option<String>,
    #[serde(rename = "hyperloopIP")]
    hyperloop_ip: Option<String>,
    #[serde(rename = "lifecycleID")]
    lifecycle_id: Option<String>,
}

/// `POST /init`: the environment, default user and working directory of later envd calls
/// (kept by [`state`]); 204. Locker's server already does the rest of what the
/// orchestrator asks of `/init`: the clock of a restored machine (`timestamp`, ignored), the
/// access token (which `/init` cannot change here: rotate it with Locker's
/// `POST /v1/sandboxes/{id}/preview-token`), volumes (Locker's own create mounts them) and
/// CA certificates (Locker's secrets install theirs).
async fn init(app: &AppState, t: &Target, req: Request) -> Result<StatusCode, E2bError> {
    let bytes = axum::body::to_bytes(req.into_body(), 1 << 20)
        .await
        .map_err(|e| E2bError::bad_request(format!("/init body: {e} (at most 1 MiB)")))?;
    let b: Init = if bytes.iter().all(u8::is_ascii_whitespace) {
        Init::default()
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|e| E2bError::bad_request(format!("/init body is not envd's JSON: {e}")))?
    };
    let (_, _, _) = (b.timestamp, b.hyperloop_ip, b.lifecycle_id);
    if let Some(tok) = b.access_token.as_deref().filter(|s| !s.is_empty()) {
        let own = t.live.preview.read().expect("preview lock").token.clone();
        if !crate::auth::constant_time_eq(tok.as_bytes(), own.as_bytes()) {
            return Err(E2bError::bad_request(
                "`accessToken` differs from the sandbox's: Locker's server sets the token; \
                 rotate it with POST /v1/sandboxes/{id}/preview-token",
            ));
        }
    }
    if !b.volume_mounts.is_empty() {
        return Err(E2bError::bad_request(
            "`volumeMounts` are not served: mount Locker volumes with Locker's create (`volumes`)",
        ));
    }
    if b.ca_bundle.as_deref().is_some_and(|c| !c.trim().is_empty()) {
        return Err(E2bError::bad_request(
            "`caBundle` is not served: write the certificates with /files and run \
             update-ca-certificates, or use Locker's secrets (which install their CA)",
        ));
    }
    for k in b.env_vars.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(E2bError::bad_request(format!(
                "`envVars` name {k:?} is not a variable name"
            )));
        }
    }
    let user = b.default_user.filter(|u| !u.is_empty());
    if let Some(u) = &user {
        check_user(u).map_err(E2bError::bad_request)?;
    }
    let workdir = match b.default_workdir.as_deref() {
        None | Some("") => None,
        Some(w) if w.starts_with('/') => {
            Some(resolve_path(DEFAULT_USER, w).map_err(E2bError::bad_request)?)
        }
        Some(w) => {
            return Err(E2bError::bad_request(format!(
                "`defaultWorkdir` {w:?} must be an absolute path"
            )))
        }
    };
    state::init(app, &t.live.id, b.env_vars, user, workdir).await;
    Ok(StatusCode::NO_CONTENT)
}

/// The user of calls of sandbox `id` that name none: `/init`'s `defaultUser`, else E2B's.
fn default_user(id: &str) -> String {
    state::defaults(id)
        .user
        .unwrap_or_else(|| DEFAULT_USER.to_owned())
}

/// The sandbox a signed `/files` URL without routing headers is for (see
/// [`files::sandbox_of_signature`]).
pub(crate) async fn sandbox_of_signature(
    app: &AppState,
    method: &Method,
    raw_query: &str,
) -> Option<String> {
    files::sandbox_of_signature(app, method, raw_query).await
}

pub(crate) use files::signed_by;

/// envd's interval between keepalive messages when it does not name one.
const DEFAULT_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(90);

/// How long a server stream (`Start`, `Connect`, `WatchDir`) may go without a message
/// before it sends a keepalive one, as envd does (proxies and load balancers on the way
/// close idle connections): the request's `Keepalive-Ping-Interval` in seconds (the SDKs
/// send 50; bounded to 1 s – 1 h), else envd's 90 s. A value that is not a number of
/// seconds is ignored, as envd ignores it.
fn keepalive_interval(h: &HeaderMap) -> std::time::Duration {
    h.get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map_or(DEFAULT_KEEPALIVE, |s| {
            std::time::Duration::from_secs(s.min(3600))
        })
}

/// An RPC's checked headers, its deadline (`Connect-Timeout-Ms`) and its user, or the answer
/// that refuses it (a stream's in its end-of-stream envelope, as Connect streams answer).
// The error is the answer itself, made at most once per RPC: boxing it buys nothing.
#[allow(clippy::result_large_err)]
fn rpc_headers(
    h: &HeaderMap,
    shape: connect::Shape,
    t: &Target,
) -> Result<(Option<std::time::Duration>, String), Response> {
    let timeout = connect::check_request(h, shape).map_err(process::rejected)?;
    let user = rpc_user(h, &default_user(&t.live.id)).map_err(|e| {
        if shape == connect::Shape::Unary {
            e.into_response()
        } else {
            connect::stream_error(e)
        }
    })?;
    Ok((timeout, user))
}

/// The user an RPC runs as: `Authorization: Basic base64("<user>:")`, else `default`.
fn rpc_user(h: &HeaderMap, default: &str) -> Result<String, ConnectError> {
    let Some(v) = h.get(axum::http::header::AUTHORIZATION) else {
        return Ok(default.into());
    };
    let bad = |why: &str| {
        ConnectError::new(
            Code::Unauthenticated,
            format!("Authorization: {why}; envd takes `Basic base64(\"<user>:\")`"),
        )
    };
    let v = v.to_str().map_err(|_| bad("not ASCII"))?.trim();
    let Some(b64) = v
        .strip_prefix("Basic ")
        .or_else(|| v.strip_prefix("basic "))
    else {
        return Err(bad("not a Basic credential"));
    };
    let raw = crate::command::base64_decode(b64.trim()).map_err(|_| bad("not base64"))?;
    let text = String::from_utf8(raw).map_err(|_| bad("not UTF-8"))?;
    let user = text.split(':').next().unwrap_or("").trim().to_owned();
    check_user(&user).map_err(|m| bad(&m))?;
    Ok(if user.is_empty() {
        default.into()
    } else {
        user
    })
}

/// The directories among `path`'s parents (and `path` itself with `itself`) that do not
/// exist yet, outermost first: what a write or a mkdir is about to create.
async fn missing_dirs(agent: &AgentClient, path: &str, itself: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = if itself {
        path.to_owned()
    } else {
        parent_of(path)
    };
    // Bounded: a path has at most 4096 bytes, so at most 2048 components.
    while cur != "/" {
        match agent.stat(&cur).await {
            Err(locker_runtime::agent::AgentClientError::Agent(e))
                if e.code == locker_proto::ErrorCode::NotFound =>
            {
                out.push(cur.clone());
                cur = parent_of(&cur);
            }
            _ => break,
        }
    }
    out.reverse();
    out
}

fn parent_of(p: &str) -> String {
    match p.rfind('/') {
        Some(0) | None => "/".into(),
        Some(i) => p[..i].to_owned(),
    }
}

/// Gives what a call created to its user, as envd does (files belong to whoever made
/// them); root's are root's already.
async fn give_to(
    agent: &AgentClient,
    user: &str,
    paths: &[String],
) -> Result<(), AgentClientError> {
    if user == "root" || user == "0" {
        return Ok(());
    }
    for p in paths {
        agent.chown(p, user).await?;
    }
    Ok(())
}

/// A user name as `/etc/passwd` has them (or a uid).
fn check_user(u: &str) -> Result<(), String> {
    if u.len() > 64
        || !u
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err(format!("user {u:?} is not a user name"));
    }
    Ok(())
}

/// A user's home in the machine (E2B's layout: `/root`, else `/home/<user>`).
fn home_of(user: &str) -> String {
    if user == "root" || user == "0" {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// `p` made absolute: relative paths are relative to the user's home; `.` and `..`
/// segments are folded (the agent resolves the result inside the machine's root, so no
/// path reaches outside it whatever it says).
fn resolve_path(user: &str, p: &str) -> Result<String, String> {
    if p.contains('\0') {
        return Err("a path must not contain NUL bytes".into());
    }
    if p.len() > 4096 {
        return Err("a path must be at most 4096 bytes".into());
    }
    let joined = if p.starts_with('/') {
        p.to_owned()
    } else {
        format!("{}/{p}", home_of(user))
    };
    let mut parts: Vec<&str> = Vec::new();
    for seg in joined.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_against_home() {
        assert_eq!(resolve_path("user", "a.txt").unwrap(), "/home/user/a.txt");
        assert_eq!(resolve_path("root", "x/../y").unwrap(), "/root/y");
        assert_eq!(resolve_path("user", "/../../etc").unwrap(), "/etc");
        assert_eq!(resolve_path("user", "/").unwrap(), "/");
        assert!(resolve_path("user", "a\0b").is_err());
    }

    #[test]
    fn parents() {
        assert_eq!(parent_of("/a/b"), "/a");
        assert_eq!(parent_of("/a"), "/");
    }

    #[test]
    fn basic_auth_names_the_user() {
        let mut h = HeaderMap::new();
        assert_eq!(rpc_user(&h, "user").unwrap(), "user");
        assert_eq!(rpc_user(&h, "admin").unwrap(), "admin");
        // base64("root:")
        h.insert("authorization", "Basic cm9vdDo=".parse().unwrap());
        assert_eq!(rpc_user(&h, "user").unwrap(), "root");
        h.insert("authorization", "Bearer x".parse().unwrap());
        assert!(rpc_user(&h, "user").is_err());
        // base64("a b:")
        h.insert("authorization", "Basic YSBiOg==".parse().unwrap());
        assert!(rpc_user(&h, "user").is_err());
    }
}
