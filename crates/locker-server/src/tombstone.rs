//! What an id of a sandbox that is gone answers: 404 with why and when it ended (expired,
//! deleted, failed: reason) for `locker_store::TOMBSTONE_S` after its end, and "does not
//! exist" for a typo or an end older than that. Every route that takes a sandbox id
//! answers through [`gone`], so the message has one shape.
//!
//! Owns the wording only; the ended rows and their causes are the store's (they were
//! already kept for usage: a tombstone adds one short column, nothing else).

use locker_store::{SandboxRecord, SandboxState};

use crate::error::ApiError;
use crate::state::{now_s, AppState};

/// The 404 for sandbox `id` of `tenant`, which is not live here.
pub fn gone(app: &AppState, tenant: &str, id: &str) -> ApiError {
    match app.store.tombstone_at(tenant, id, now_s()) {
        Ok(Some(t)) => {
            let what = match t.cause.as_str() {
                "expired" => format!("expired at {} (its TTL ran out)", t.ended_at),
                "deleted" => format!("was deleted at {}", t.ended_at),
                other => format!("ended at {}: {other}", t.ended_at),
            };
            ApiError::not_found(format!(
                "sandbox {id} {what}; its machine and files are gone: create another"
            ))
        }
        Ok(None) | Err(_) => ApiError::not_found(format!("sandbox {id} does not exist")),
    }
}

/// Why `r` ends now, given what ends it (`deleted` or `expired`): a failed sandbox keeps
/// its failure as the cause.
pub fn cause(r: &SandboxRecord, ending: &str) -> String {
    if r.state == SandboxState::Failed {
        let why = crate::failed::reason(&r.id).unwrap_or_else(|| "reason unknown".into());
        return format!("failed ({why}), then {ending}");
    }
    ending.to_owned()
}
