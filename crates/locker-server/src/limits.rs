//! The rules of what a sandbox or a run may ask for: CPUs, memory, disk and processes, its
//! environment and metadata, its network policy (and whether this host can enforce it),
//! its runtime (and whether this host runs it).
//!
//! Checks only: each answers a 4xx (or a 503 for what this host cannot do) that says what
//! to fix, and changes nothing. It must not start machines or write records: `lifecycle`
//! does, after these rules passed. It reads no shared state (the node at most), so the
//! pools can use its limits without a way back to `state`.

use std::collections::BTreeMap;

use locker_runtime::node::{Node, RuntimeKind};
use locker_types::{NetworkPolicy, Runtime, RuntimeChoice};
use serde_json::{json, Value};

use crate::error::ApiError;

/// Limits a client may ask for.
pub const MAX_CPUS: f64 = 64.0;
pub const MEMORY_MB: (u64, u64) = (32, 262_144);
pub const DISK_MB: (u64, u64) = (16, 1_048_576);
/// Processes per sandbox: enough for builds, small enough to stop a fork bomb.
pub const PIDS: u64 = 1024;

/// Checks a request's network policy (its shape was checked with the body, see
/// [`NetworkPolicy`]) and returns its normalized form as records keep it: `none` (the
/// default), `all`, or `allow` with its list checked (lowercase names, masked CIDRs, see
/// [`crate::egress::Allowlist`]).
pub fn check_network(p: Option<&NetworkPolicy>) -> Result<Value, ApiError> {
    match p {
        None => Ok(NetworkPolicy::None.to_value()),
        Some(NetworkPolicy::Allow(list)) => {
            let (_, norm) = crate::egress::Allowlist::parse(list).map_err(ApiError::bad_request)?;
            Ok(json!({"egress": "allow", "allow": norm}))
        }
        Some(p) => Ok(p.to_value()),
    }
}

/// Whether a checked policy gives the machine a network (anything but `none`).
pub fn has_egress(network: &Value) -> bool {
    network
        .get("egress")
        .and_then(Value::as_str)
        .is_some_and(|e| e != "none")
}

/// 503 unless this host enforces egress policies (the probe of `locker_runtime::net`).
pub async fn require_egress(network: &Value) -> Result<(), ApiError> {
    if !has_egress(network) {
        return Ok(());
    }
    match tokio::task::spawn_blocking(locker_runtime::net::status).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(ApiError::unavailable(format!(
            "egress policies other than `none` cannot be enforced on this host, so Locker refuses them: {e}"
        ))),
        Err(e) => Err(ApiError::internal(format!("egress probe failed: {e}"))),
    }
}

pub fn check_env(env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ApiError::bad_request(format!(
                "env key {k:?}: keys must be non-empty without '=' or NUL, values without NUL"
            )));
        }
    }
    Ok(())
}

pub fn check_metadata(m: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if m.len() > 64 {
        return Err(ApiError::bad_request("`metadata` holds at most 64 keys"));
    }
    for (k, v) in m {
        if k.is_empty() || k.len() > 128 || v.len() > 1024 {
            return Err(ApiError::bad_request(format!(
                "metadata {k:?}: keys 1-128 bytes, values up to 1024 bytes"
            )));
        }
    }
    Ok(())
}

/// 503 unless this host can run microVMs.
pub async fn require_microvm(node: &Node) -> Result<(), ApiError> {
    match node.vm_assets().await {
        Ok(_) => Ok(()),
        Err(e) => Err(ApiError::unavailable(format!(
            "runtime `microvm` is not usable on this host: {e} (see `locker doctor`)"
        ))),
    }
}

/// The runtime a request names, resolved on this host (`auto` is the jail here; a
/// sandbox's create may pick a microVM for `auto` itself, see `sandboxes::create`).
pub fn resolve_runtime(r: RuntimeChoice) -> Result<Runtime, ApiError> {
    match r {
        RuntimeChoice::Auto | RuntimeChoice::Jail => Ok(Runtime::Jail),
        RuntimeChoice::Microvm => Ok(Runtime::Microvm),
        RuntimeChoice::Gvisor => Err(ApiError::unavailable(
            "runtime `gvisor` is not available in this version; use `jail` or `auto`",
        )),
    }
}

/// The runtime's name for a runtime.
pub fn kind_of(r: Runtime) -> RuntimeKind {
    match r {
        Runtime::Jail => RuntimeKind::Jail,
        Runtime::Microvm => RuntimeKind::Microvm,
    }
}
