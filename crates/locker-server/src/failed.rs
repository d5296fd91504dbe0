//! Sandboxes whose machine can no longer answer: the agent died (killed, OOM-killed), its
//! connection broke, or it stopped answering within a call's deadline (a command stopped it).
//!
//! Such a sandbox is marked `failed` at once, with a reason: its machine is destroyed (it
//! holds memory, a disk and the tenant's quota, and nothing can be done in it without its
//! agent), its record stays `failed` until it is deleted, every later call answers 409 with
//! the reason, and `GET /v1/sandboxes/{id}` shows the reason as `failure`. The store keeps
//! only the state; the reason lives in this process (after a restart it reads "unknown").
//!
//! This room owns the decision "this sandbox failed" and the reasons; it does not own the
//! lifecycle of healthy sandboxes (`sandboxes`) or what an agent error means for a single
//! call's answer (`error`).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use locker_runtime::agent::AgentClientError;
use locker_store::SandboxState;

use crate::error::ApiError;
use crate::state::{AppState, Live};

/// Why each failed sandbox failed, by id (ids are unique across the process's servers).
static REASONS: LazyLock<Mutex<HashMap<String, String>>> = LazyLock::new(Default::default);

fn reasons() -> std::sync::MutexGuard<'static, HashMap<String, String>> {
    REASONS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Remembers why sandbox `id` failed (also for a sandbox that failed to start).
pub fn note(id: &str, reason: impl Into<String>) {
    reasons().insert(id.to_owned(), reason.into());
}

/// Why sandbox `id` failed, if it did while this server ran.
pub fn reason(id: &str) -> Option<String> {
    reasons().get(id).cloned()
}

/// Forgets a deleted sandbox's reason.
pub fn forget(id: &str) {
    reasons().remove(id);
}

/// The answer to a call on a failed sandbox.
pub fn conflict(id: &str) -> ApiError {
    let why = reason(id).unwrap_or_else(|| "unknown (the server restarted since)".into());
    ApiError::conflict(format!(
        "sandbox {id} failed: {why}. Its machine is gone; delete it and create another"
    ))
}

/// Whether an agent error means the machine can no longer answer (rather than one
/// request failing). A protocol error counts only when it cost the connection (a request
/// the host could not encode is the caller's problem, not the machine's).
pub fn is_fatal(e: &AgentClientError, live: &Live) -> bool {
    match e {
        AgentClientError::ConnectionLost(_) | AgentClientError::Unresponsive(_) => true,
        AgentClientError::Protocol(_) => live.machine.agent.is_closed(),
        _ => false,
    }
}

/// The answer for an agent error on sandbox `live`: a fatal one marks the sandbox failed
/// (unless it was deleted meanwhile: then it is a plain 404) and answers 409.
pub async fn check(app: &AppState, live: &Arc<Live>, e: AgentClientError) -> ApiError {
    if !is_fatal(&e, live) {
        return e.into();
    }
    if live.is_paused() || live.machine.is_frozen() {
        // Paused (or held still for a snapshot) under the call: its agent is frozen, not
        // broken.
        return ApiError::conflict(format!(
            "sandbox {} was paused or snapshotted while the call ran, which took too long; \
             retry once it runs",
            live.id
        ));
    }
    if mark(app, live, describe(&e)).await || reason(&live.id).is_some() {
        conflict(&live.id)
    } else {
        crate::tombstone::gone(app, &live.tenant, &live.id)
    }
}

fn describe(e: &AgentClientError) -> String {
    match e {
        AgentClientError::Unresponsive(d) => format!(
            "its agent stopped answering (nothing within {d:?}; a command may have stopped it)"
        ),
        AgentClientError::ConnectionLost(why) => format!(
            "the connection to its agent was lost ({why}; the agent may have been killed, \
             e.g. by the out-of-memory killer)"
        ),
        other => format!("its agent broke the protocol ({other})"),
    }
}

/// Marks sandbox `live` failed with `reason` and destroys its machine. Returns whether this
/// call did it (false: it was already deleted or failed).
pub async fn mark(app: &AppState, live: &Arc<Live>, reason: String) -> bool {
    {
        let mut map = app.live.write().await;
        match map.get(&live.id) {
            Some(l) if Arc::ptr_eq(l, live) => {
                map.remove(&live.id);
            }
            _ => return false,
        }
    }
    // Control replicas' own nodes share the fleet's store: a machine this server still had
    // of a sandbox the fleet started on another node meanwhile (while this one was declared
    // dead) is only destroyed; the sandbox, its row and its events are that node's.
    let row = app.store.get_sandbox_any(&live.id);
    if let Ok(Some(r)) = &row {
        if !r.host.is_empty() && r.host != app.host_id {
            tracing::warn!(sandbox = %live.id, reason = %reason, node = %r.host, "this server's old machine of a sandbox that runs on another node now ended; destroying it");
            app.egress.forget(&live.id);
            let _ = live.machine.resume();
            if let Err(e) = app.node.destroy(&live.machine).await {
                tracing::warn!(sandbox = %live.id, error = %e, "destroying an old machine");
            }
            return false;
        }
    }
    note(&live.id, reason.clone());
    tracing::warn!(sandbox = %live.id, reason = %reason, "sandbox failed; destroying its machine");
    app.egress.forget(&live.id);
    let usage = live.machine.usage();
    let times = live.times();
    let _ = app.store.put_sandbox_times(&live.id, &times);
    app.metrics.retire(&live.tenant, &times, usage.cpu_ms);
    app.events.emit(
        &live.tenant,
        crate::events::Kind::SandboxFailed,
        &live.id,
        serde_json::json!({"reason": reason}),
    );
    // A frozen machine cannot die: thaw first.
    let _ = live.machine.resume();
    if let Err(e) = app.node.destroy(&live.machine).await {
        tracing::warn!(sandbox = %live.id, error = %e, "destroying a failed sandbox's machine");
    }
    match row {
        Ok(Some(mut rec)) => {
            rec.state = SandboxState::Failed;
            rec.cpu_ms = usage.cpu_ms;
            rec.peak_memory_bytes = usage.peak_memory_bytes;
            if let Err(e) = app.store.update_sandbox(&rec) {
                tracing::warn!(sandbox = %live.id, error = %e, "recording a failed sandbox");
            }
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(sandbox = %live.id, error = %e, "recording a failed sandbox"),
    }
    true
}

/// Watches a live sandbox's agent connection: when it is lost while the sandbox is live,
/// the sandbox is marked failed at once (not at its next call).
pub fn watch(app: &AppState, live: &Arc<Live>) {
    let closed = live.machine.agent.closed();
    let (app, live) = (app.clone(), Arc::downgrade(live));
    tokio::spawn(async move {
        let why = closed.await;
        let Some(live) = live.upgrade() else {
            return;
        };
        mark(
            &app,
            &live,
            describe(&AgentClientError::ConnectionLost(why)),
        )
        .await;
    });
}

/// `r`, with an agent error answered by [`check`].
pub async fn result<R>(
    app: &AppState,
    live: &Arc<Live>,
    r: Result<R, AgentClientError>,
) -> Result<R, ApiError> {
    match r {
        Ok(v) => Ok(v),
        Err(e) => Err(check(app, live, e).await),
    }
}
