//! The code interpreter's contexts for a sandbox the caller already found and admitted
//! (`lifecycle::enter`): the checks and driver requests behind this room's own context
//! routes and behind other protocols' (E2B's port 49999, `e2b::interp`), so that another
//! wire format is a thin translation and never a second code interpreter.
//!
//! It owns no route and no shape of its own: contexts come back as [`Context`], a cell as
//! the driver's parsed [`Line`]s (streamed), exactly what this room's routes relay.

use std::time::{Duration, Instant};

use axum::http::Method;
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::json;

use super::driver::{self, Start, EXECUTE_SLACK};
use super::wire::{Context, ContextList, LineReader, NewContext, RunCode};
use super::{ask, cell_body, check_context_id, language_of, no_context, read_json, stuck};
use crate::error::ApiError;
use crate::extract::check_path;
use crate::limits::check_env;
use crate::state::{new_id, Live};

/// The sandbox's contexts (none when its driver has not started).
pub(crate) async fn list(live: &Live) -> Result<Vec<Context>, ApiError> {
    Ok(
        match ask(live, Start::Never, Method::GET, "/contexts", None).await? {
            Some(resp) => read_json::<ContextList>(resp).await?.contexts,
            None => Vec::new(),
        },
    )
}

/// A new context's request checked, as the driver takes it (with its new id).
pub(crate) fn context_body(req: &NewContext) -> Result<serde_json::Value, ApiError> {
    let language = language_of(req.language.as_deref())?;
    if let Some(cwd) = &req.cwd {
        check_path("cwd", cwd)?;
    }
    check_env(&req.env)?;
    Ok(json!({
        "id": new_id("ctx_"),
        "language": language,
        "cwd": req.cwd,
        "home": req.home,
        "env": req.env,
    }))
}

/// A new context (a kernel started) in the sandbox.
pub(crate) async fn create(live: &Live, req: &NewContext) -> Result<Context, ApiError> {
    start_context(live, &context_body(req)?).await
}

/// Starts the context [`context_body`] describes.
pub(crate) async fn start_context(
    live: &Live,
    body: &serde_json::Value,
) -> Result<Context, ApiError> {
    let resp = ask(
        live,
        Start::IfMissing,
        Method::POST,
        "/contexts",
        Some(body),
    )
    .await?
    .ok_or_else(|| stuck(&live.id))?;
    read_json(resp).await
}

/// Starts the context `body` describes unless one with its id was ever made in this machine
/// (deleted since or not): E2B's default contexts, which the first list makes.
pub(crate) async fn start_once(live: &Live, body: &serde_json::Value) -> Result<(), ApiError> {
    let mut body = body.clone();
    body["once"] = serde_json::Value::Bool(true);
    ask(live, Start::IfMissing, Method::POST, "/contexts", Some(&body))
        .await?
        .ok_or_else(|| stuck(&live.id))?;
    Ok(())
}

/// Deletes context `ctx` (its kernel ends).
pub(crate) async fn remove(live: &Live, ctx: &str) -> Result<(), ApiError> {
    check_context_id(&live.id, ctx)?;
    let path = format!("/contexts/{ctx}");
    match ask(live, Start::Never, Method::DELETE, &path, None).await? {
        Some(_) => Ok(()),
        None => Err(no_context(&live.id, ctx)),
    }
}

/// Restarts context `ctx` with a fresh kernel (its state is gone).
pub(crate) async fn restart(live: &Live, ctx: &str) -> Result<Context, ApiError> {
    check_context_id(&live.id, ctx)?;
    let path = format!("/contexts/{ctx}/restart");
    match ask(live, Start::Never, Method::POST, &path, None).await? {
        Some(resp) => read_json(resp).await,
        None => Err(no_context(&live.id, ctx)),
    }
}

/// Interrupts what context `ctx` runs; whether a cell was running.
pub(crate) async fn interrupt(live: &Live, ctx: &str) -> Result<bool, ApiError> {
    #[derive(Deserialize)]
    struct Interrupted {
        interrupted: bool,
    }
    check_context_id(&live.id, ctx)?;
    let path = format!("/contexts/{ctx}/interrupt");
    match ask(live, Start::Never, Method::POST, &path, None).await? {
        Some(resp) => Ok(read_json::<Interrupted>(resp).await?.interrupted),
        None => Err(no_context(&live.id, ctx)),
    }
}

/// A cell on its way: the driver's lines as they come.
pub(crate) struct Cell {
    pub lines: LineReader<Incoming>,
    /// The context it runs in (the language's default context when the request named none).
    pub context: String,
    /// When the driver is deemed stuck: the cell's timeout and the driver's slack.
    pub until: tokio::time::Instant,
}

/// Sends a cell to the driver, streamed; its lines are read from [`Cell::lines`].
pub(crate) async fn cell(live: &Live, req: &RunCode) -> Result<Cell, ApiError> {
    let arrived = Instant::now();
    let (body, timeout_ms) = cell_body(req, true)?;
    let context = match &req.context {
        Some(ctx) => {
            check_context_id(&live.id, ctx)?;
            ctx.clone()
        }
        // The driver's name for a language's default context (`driver.py`, `execute`).
        None => format!("ctx_default_{}", language_of(req.language.as_deref())?),
    };
    let until =
        tokio::time::Instant::from_std(arrived) + Duration::from_millis(timeout_ms) + EXECUTE_SLACK;
    let resp = tokio::time::timeout_at(
        until,
        driver::send(
            live,
            Start::IfMissing,
            Method::POST,
            "/execute",
            Some(&body),
        ),
    )
    .await
    .map_err(|_| stuck(&live.id))??
    .ok_or_else(|| stuck(&live.id))?;
    Ok(Cell {
        lines: LineReader::new(resp.into_body()),
        context,
        until,
    })
}
