//! The records the store keeps: tenants' keys, sandboxes, call records, usage totals.
//!
//! Owns: the shapes and their small rules (tenant names, state names, stripping output
//! bodies, RFC 3339 parsing). It does not touch the database; `sqlite.rs` does.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use locker_types::ExecResult;
use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};

/// The tenant that `LOCKER_API_KEY` (or the key generated on first start) belongs to.
pub const DEFAULT_TENANT: &str = "default";

/// Checks a tenant name: `[a-z0-9][a-z0-9-]{0,62}` (so it fits in DNS labels, paths, and
/// metric labels without escaping).
pub fn validate_tenant_name(name: &str) -> Result<()> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-');
    if ok {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "tenant name {name:?} is not valid: use 1 to 63 of a-z, 0-9 and '-', \
             starting with a letter or digit"
        )))
    }
}

/// An API key as the admin routes show it; the clear key is never part of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyInfo {
    /// `key_<hex>`: how a key is named in call records, logs and `DELETE /v1/keys/{key_id}`.
    pub key_id: String,
    pub tenant: String,
    /// RFC 3339 UTC.
    pub created_at: String,
}

/// Who made a request: the result of authenticating a Bearer key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Principal {
    pub key_id: String,
    pub tenant: String,
}

/// The life of a sandbox. `stopped` and `failed` are final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Starting,
    Running,
    Paused,
    Stopped,
    Failed,
}

impl SandboxState {
    /// Every state, in life order.
    pub const ALL: [SandboxState; 5] = [
        SandboxState::Starting,
        SandboxState::Running,
        SandboxState::Paused,
        SandboxState::Stopped,
        SandboxState::Failed,
    ];

    /// The name used in the API and in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Stopped => "stopped",
            SandboxState::Failed => "failed",
        }
    }

    /// Whether a machine may exist for it (`starting`, `running`, `paused`): these hold
    /// resources, count against quotas, and are adopted after a restart.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            SandboxState::Starting | SandboxState::Running | SandboxState::Paused
        )
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SandboxState {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self> {
        SandboxState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                StoreError::Invalid(format!(
                    "unknown sandbox state {s:?}: use starting, running, paused, stopped or failed"
                ))
            })
    }
}

/// A sandbox as the store keeps it: the API's Sandbox plus what the server needs to find
/// and adopt its machine again after a restart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// `sb_…`, unique across tenants.
    pub id: String,
    pub tenant: String,
    pub state: SandboxState,
    /// The template's name, as asked for (`default`).
    pub template: String,
    /// The content digest of the template the machine was built from.
    pub template_digest: String,
    /// The runtime that was picked (`jail`, `microvm`, …; never `auto`).
    pub runtime: String,
    pub cpus: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    /// The network policy as the API takes it (`{"egress": "none"}`, …).
    pub network: serde_json::Value,
    /// The volume mounts as the API takes them (`[{"volume", "path", "read_only"}]`).
    pub volumes: serde_json::Value,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The environment the caller gave the machine. Kept so a restarted server can
    /// recreate the machine's view; never shown by the API or written to call records.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub ttl_s: u64,
    pub idle_timeout_s: Option<u64>,
    /// RFC 3339 UTC (`locker_types::rfc3339`).
    pub created_at: String,
    /// RFC 3339 UTC: the reaper destroys the sandbox at this time.
    pub expires_at: String,
    /// RFC 3339 UTC: the last call's time, for the idle policy.
    pub last_active_at: String,
    /// Where the sandbox's machine lives on the host (`<data-dir>/sandboxes/<id>`).
    pub machine_dir: String,
    pub cpu_ms: u64,
    pub peak_memory_bytes: u64,
    /// Opens the sandbox's private ports through preview URLs (`X-Locker-Token`, or the
    /// cookie `?locker_token=` sets); rotated on demand. Empty only in a record made by a
    /// release before preview URLs, which the migration then fills.
    #[serde(default)]
    pub preview_token: String,
    /// The server whose engine runs the machine (its host id, `fleet/local-node` in its data
    /// dir): servers sharing a database each adopt only their own at start. Empty in a row
    /// from before host ids, which the first server to start takes.
    #[serde(default)]
    pub host: String,
    /// Ports anyone with the preview URL may reach, without a token; sorted, unique.
    #[serde(default)]
    pub public_ports: Vec<u16>,
}

/// What kind of call a [`CallRecord`] is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallKind {
    /// `POST /v1/sandboxes/{id}/exec`.
    Exec,
    /// `POST /v1/volumes/{id}/run`: a serverless call.
    Run,
    /// A background process (`POST /v1/sandboxes/{id}/processes`).
    Process,
    /// A cell of the code interpreter (`POST /v1/sandboxes/{id}/code`): `command` is the
    /// context and the code.
    Code,
}

impl CallKind {
    /// The name used in the API and in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            CallKind::Exec => "exec",
            CallKind::Run => "run",
            CallKind::Process => "process",
            CallKind::Code => "code",
        }
    }
}

/// The provenance of one exec, run or background process: who, where, what, with what
/// result. Holds no secrets and no output: env keys without values, the result without
/// its stdout/stderr bodies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    /// `call_…`, the same as `result.call_id`.
    pub id: String,
    pub tenant: String,
    /// The key that made the call.
    pub key_id: String,
    pub kind: CallKind,
    pub sandbox_id: Option<String>,
    pub volume_id: Option<String>,
    /// The argv; a `shell` call is recorded as `["/bin/sh", "-c", script]`.
    pub command: Vec<String>,
    pub cwd: Option<String>,
    /// The names of the env variables the caller passed; never their values.
    pub env_keys: Vec<String>,
    pub template_digest: String,
    pub runtime: String,
    /// The result without output bodies (see [`strip_output`]).
    pub result: ExecResult,
    /// Names or addresses the network policy refused during the call.
    #[serde(default)]
    pub egress_denied: Vec<String>,
    /// Which secret's value the egress proxy put into a request to which host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets_used: Vec<SecretUse>,
    /// A secret's placeholder seen going where its value may not (another host, plain
    /// HTTP): it went out as the placeholder, never the value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_misuse: Vec<SecretMisuse>,
    /// For runs on volumes: the changed paths (no contents).
    pub changes: Option<serde_json::Value>,
    /// RFC 3339 UTC.
    pub created_at: String,
}

/// The result as a call record keeps it: `stdout` and `stderr` emptied; sizes, truncation
/// flags, timings, usage and changes kept.
pub fn strip_output(result: &ExecResult) -> ExecResult {
    ExecResult {
        stdout: String::new(),
        stderr: String::new(),
        stdout_b64: None,
        stderr_b64: None,
        ..result.clone()
    }
}

impl CallRecord {
    /// Empties the output bodies in place (what [`strip_output`] does, without a copy).
    pub fn strip_output(&mut self) {
        self.result.stdout = String::new();
        self.result.stderr = String::new();
        self.result.stdout_b64 = None;
        self.result.stderr_b64 = None;
    }
}

/// A tenant's totals for `GET /v1/usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantUsage {
    /// CPU time of every call (exec, run, process) recorded in the window.
    pub cpu_ms: u64,
    /// Wall-clock seconds the tenant's sandboxes existed in the window, summed over
    /// sandboxes (deleted ones included).
    pub sandbox_seconds: u64,
    /// Serverless runs recorded in the window.
    pub runs: u64,
    /// Execs and background processes recorded in the window.
    pub execs: u64,
    /// Time splits and machine CPU of the tenant's sandboxes that have ended (and ended
    /// after `since`), as persisted at their end; the server adds its live ones.
    pub ended_active_ms: u64,
    pub ended_idle_ms: u64,
    pub ended_paused_ms: u64,
    pub ended_cpu_ms: u64,
}

/// Seconds since the Unix epoch, now.
pub fn now_unix() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

pub use locker_types::parse_rfc3339;

#[cfg(test)]
mod tests {
    use super::*;
    use locker_types::rfc3339;

    #[test]
    fn tenant_names() {
        for ok in ["default", "team-b", "0", "a-", &"a".repeat(63)] {
            assert!(validate_tenant_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "Team", "a_b", "a.b", "é", &"a".repeat(64), "a b"] {
            let e = validate_tenant_name(bad).unwrap_err().to_string();
            assert!(e.contains("a-z, 0-9"), "{bad}: {e}");
        }
    }

    #[test]
    fn rfc3339_round_trips_and_rejects_garbage() {
        for t in [0, 951_782_400, 1_796_040_000, -86_400, 4_102_444_799] {
            assert_eq!(parse_rfc3339(&rfc3339(t)), Some(t), "{t}");
        }
        assert_eq!(parse_rfc3339("1970-01-01T01:00:00+01:00"), Some(0));
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00.123456Z"), Some(0));
        assert_eq!(parse_rfc3339("1969-12-31T23:00:00-01:00"), Some(0));
        for bad in [
            "",
            "1970-01-01",
            "1970-01-01T00:00:00",
            "1970-13-01T00:00:00Z",
            "1970-02-30T00:00:00Z",
            "1970-01-01T24:00:00Z",
            "1970-01-01T00:00:00.Z",
            "1970-01-01T00:00:00+0100",
            "197a-01-01T00:00:00Z",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn strip_output_keeps_everything_but_bodies() {
        let r = ExecResult {
            call_id: "call_1".into(),
            exit_code: Some(0),
            signal: None,
            reason: locker_types::Reason::Exited,
            stdout: "secret output".into(),
            stderr: "err".into(),
            stdout_b64: Some("c2VjcmV0".into()),
            stderr_b64: None,
            stdout_truncated: true,
            stderr_truncated: false,
            stdout_bytes: 13,
            stderr_bytes: 3,
            output_path: Some("/tmp/out".into()),
            timings: Default::default(),
            usage: locker_types::Usage {
                cpu_ms: 5,
                peak_memory_bytes: 9,
            },
            changes: None,
        };
        let s = strip_output(&r);
        assert_eq!((s.stdout.as_str(), s.stderr.as_str()), ("", ""));
        assert_eq!(
            ExecResult {
                stdout: r.stdout.clone(),
                stderr: r.stderr.clone(),
                stdout_b64: r.stdout_b64.clone(),
                ..s
            },
            r
        );
    }
}

/// A saved sandbox state: its disk image (and, on runtimes that can, its memory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// `snap_…`.
    pub id: String,
    pub tenant: String,
    /// The sandbox it was taken from (which may be gone since).
    pub sandbox_id: String,
    pub template: String,
    pub template_digest: String,
    pub runtime: String,
    /// Bytes the snapshot occupies on the host.
    pub size_bytes: u64,
    pub has_memory: bool,
    /// The sandbox's sizes, which a sandbox started from the snapshot inherits.
    pub cpus: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// Where its files are on the host.
    pub path: String,
    /// The fleet node whose disk holds its files: the host id of the server that took it
    /// (as `SandboxRecord::host`; a control replica's own node has that id), or, in a
    /// control plane's copy of a joined node's snapshot, that node's id (its `path` is the
    /// node's). Empty in a record from before fleets: the server's own.
    #[serde(default)]
    pub host: String,
}

impl SnapshotRecord {
    /// Whether its files are on the server of host id `host_id`.
    pub fn is_on(&self, host_id: &str) -> bool {
        self.host.is_empty() || self.host == host_id
    }
}

/// Checks a volume name: `[a-z0-9][a-z0-9._-]{0,62}` (a path segment and a CLI argument
/// without quoting; never `.` or `..` since it starts with a letter or digit).
pub fn validate_volume_name(name: &str) -> Result<()> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(*c, b'.' | b'_' | b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "`name` must match [a-z0-9][a-z0-9._-]{{0,62}}, got {name:?}"
        )))
    }
}

/// A volume: a persistent directory tree of a tenant, named uniquely within the tenant.
/// Its bytes in use are not stored: the server measures them from the tree itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// `vol_…`.
    pub id: String,
    pub tenant: String,
    /// Unique per tenant; see [`validate_volume_name`].
    pub name: String,
    /// The size limit in MiB.
    pub size_mb: u64,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// The server whose data dir holds its files (its host id, as `SandboxRecord::host`):
    /// servers sharing a store open only their own. Empty in a row from before host ids,
    /// which the first server to start takes.
    #[serde(default)]
    pub host: String,
}

/// A point-in-time copy of a volume's tree. Its ids are `snap_…` like sandbox snapshots',
/// but it is its own kind (its own table): a sandbox snapshot is a disk image, this is a
/// directory tree. It is removed with its volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeSnapshotRecord {
    /// `snap_…`.
    pub id: String,
    pub tenant: String,
    pub volume_id: String,
    /// Bytes allocated by the copied tree (shared blocks of a reflink counted in full).
    pub size_bytes: u64,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// Where its tree is on the host.
    pub path: String,
}

/// A secret's value put into a request by the egress proxy (a call record's `secrets_used`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretUse {
    pub name: String,
    pub host: String,
}

/// A secret's placeholder seen going elsewhere (a call record's `secret_misuse`):
/// `destination` is the name or `address:port` it went to, with `http://` when in clear.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretMisuse {
    pub name: String,
    pub destination: String,
}

/// A tenant's secret as the store keeps it: the value only sealed (see the server's
/// `secrets` room); names, hosts and the env variable in clear.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRecord {
    pub tenant: String,
    /// Unique per tenant; see [`validate_secret_name`].
    pub name: String,
    /// The hosts the value may be sent to (exact names, lowercase).
    pub hosts: Vec<String>,
    /// The environment variable that holds the placeholder inside a machine.
    pub env: String,
    /// Nonce and ciphertext; opaque to the store.
    pub sealed: Vec<u8>,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// RFC 3339 UTC: the last rotation.
    pub updated_at: String,
}

/// Checks a secret's name: 1 to 64 of `a-z`, `0-9`, `_`, `-`, starting with a letter or digit.
pub fn validate_secret_name(name: &str) -> crate::error::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && name.as_bytes()[0].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(crate::error::StoreError::Invalid(format!(
            "secret name {name:?}: use 1 to 64 of a-z, 0-9, `_` and `-`, starting with a letter or digit"
        )))
    }
}

/// One stored lifecycle event (the server's `events` room gives it its wire form).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRecord {
    /// Increasing in the order events were stored; never reused.
    pub seq: u64,
    pub tenant: String,
    /// `sandbox.created`, `run.committed`, …
    pub kind: String,
    pub subject: String,
    /// JSON text.
    pub data: String,
    pub at_unix: i64,
}

/// A tenant's webhook: where its events go and which of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookRecord {
    /// `wh_…`.
    pub id: String,
    pub tenant: String,
    pub url: String,
    /// Type patterns: `sandbox.created`, `sandbox.*`, `*`.
    pub events: Vec<String>,
    /// The HMAC key of its signatures (kept as given: it must sign).
    pub secret: String,
    pub created_unix: i64,
    /// The last event's `seq` it has been given (delivered, or given up on).
    pub cursor: u64,
}

/// How a sandbox's up time split: a call in flight (`active_ms`), up with none
/// (`idle_ms`), frozen (`paused_ms`), and how long the gaps between its calls were
/// (`call_gaps[i]`: gaps in the i-th bucket of the server's fixed bounds).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxTimes {
    pub active_ms: u64,
    pub idle_ms: u64,
    pub paused_ms: u64,
    pub call_gaps: Vec<u64>,
    /// The gaps' sum.
    #[serde(default)]
    pub call_gap_sum_ms: u64,
}

/// How a call ended, as a filter of [`CallQuery`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// Exited with code 0.
    Ok,
    /// Anything else: a non-zero exit, a signal, a timeout, OOM, the output limit, a kill.
    Failed,
    /// The result's `reason` is exactly this (`exited`, `signaled`, `timeout`, `oom`,
    /// `output_limit`, `killed`).
    Reason(&'static str),
}

impl FromStr for CallOutcome {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "ok" => CallOutcome::Ok,
            "failed" => CallOutcome::Failed,
            "exited" => CallOutcome::Reason("exited"),
            "signaled" => CallOutcome::Reason("signaled"),
            "timeout" => CallOutcome::Reason("timeout"),
            "oom" => CallOutcome::Reason("oom"),
            "output_limit" => CallOutcome::Reason("output_limit"),
            "killed" => CallOutcome::Reason("killed"),
            other => {
                return Err(format!(
                    "`outcome` must be ok, failed, exited, signaled, timeout, oom, output_limit or killed, got {other:?}"
                ))
            }
        })
    }
}

/// Which sandboxes one page of [`crate::Store::list_sandboxes_page`] holds: those of
/// [`crate::Store::list_sandboxes`]'s filters, in creation order (newest first when
/// `newest_first`), `limit` of them after skipping `offset`.
#[derive(Debug, Clone, Default)]
pub struct SandboxQuery {
    pub state: Option<SandboxState>,
    pub metadata: Vec<(String, String)>,
    pub newest_first: bool,
    pub offset: u64,
    /// None: every one after `offset`.
    pub limit: Option<u64>,
}

/// One page of sandboxes and how many match the query's filters in all.
#[derive(Debug, Clone)]
pub struct SandboxPage {
    pub sandboxes: Vec<SandboxRecord>,
    pub total: u64,
}

/// Which call records one page of [`crate::Store::list_calls_page`] holds.
#[derive(Debug, Clone, Default)]
pub struct CallQuery {
    pub sandbox_id: Option<String>,
    pub volume_id: Option<String>,
    /// The key that made the call (`key_…`).
    pub key_id: Option<String>,
    pub kind: Option<CallKind>,
    pub outcome: Option<CallOutcome>,
    /// Only records older than this cursor (a previous page's `next_cursor`).
    pub before: Option<i64>,
    /// Default [`crate::DEFAULT_CALLS_LIMIT`], clamped to 1..=[`crate::MAX_CALLS_LIMIT`].
    pub limit: Option<u32>,
}

/// One page of call records, newest first.
#[derive(Debug, Clone)]
pub struct CallPage {
    pub calls: Vec<CallRecord>,
    /// The cursor of the next (older) page; None when this page is the last.
    pub next_cursor: Option<i64>,
}

/// A terminal ticket (`POST /v1/sandboxes/{id}/pty/ticket`): one WebSocket to one
/// sandbox's PTY, for the tenant and key that minted it, until `expires_ms` (ms since the
/// epoch, the minting server's clock). Only the ticket's SHA-256 (hex) is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketRecord {
    pub hash: String,
    pub tenant: String,
    pub key_id: String,
    pub sandbox_id: String,
    pub expires_ms: i64,
}
