//! What a command is before and after it runs: an exec body checked and turned into the
//! agent's [`ExecSpec`] ([`build_spec`], the same for exec, background processes and runs),
//! and the call record of a sandbox's command ([`call_record`]).
//!
//! Pure functions over values: no state, no I/O, no HTTP responses (those are the
//! handlers' and `stream`'s).

use std::collections::BTreeMap;

use locker_proto::ExecSpec;
use locker_store::CallRecord;
use locker_types::{ExecRequest, ExecResult, DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_TIMEOUT_MS};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::{now_s, Live};

/// The largest `max_output_bytes` a call may ask for (per stream, kept in memory).
pub const MAX_OUTPUT_CAP: u64 = 16 << 20;
/// The largest stdin a JSON body may carry.
const MAX_STDIN: usize = 768 << 10;

pub use locker_types::base64::decode as base64_decode;

/// How a command is waited for, which sets its default and largest timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// The call returns when the command ends (exec, run): 60 s by default, at most 1 h;
    /// `stream` answers NDJSON.
    Call { stream: bool },
    /// A background process: no timeout unless asked for; it ends with its sandbox.
    Background,
}

/// Checks an exec body and turns it into what the agent runs.
pub fn build_spec(
    live_env: &BTreeMap<String, String>,
    req: &ExecRequest,
    call_id: &str,
    wait: Wait,
) -> Result<(ExecSpec, Option<Vec<u8>>), ApiError> {
    let (stream, timeout_ms) = match wait {
        Wait::Call { stream } => {
            req.validate().map_err(ApiError::bad_request)?;
            (stream, Some(req.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS)))
        }
        Wait::Background => {
            req.validate_background().map_err(ApiError::bad_request)?;
            (false, req.timeout_ms)
        }
    };
    if let Some(m) = req.max_output_bytes {
        if m > MAX_OUTPUT_CAP {
            return Err(ApiError::bad_request(format!("`max_output_bytes` must be at most {MAX_OUTPUT_CAP}; the full output is always kept in a file in the machine")));
        }
    }
    let stdin = match (&req.stdin, &req.stdin_b64) {
        (Some(s), _) => Some(s.as_bytes().to_vec()),
        (None, Some(b)) => {
            Some(base64_decode(b).map_err(|e| ApiError::bad_request(format!("`stdin_b64`: {e}")))?)
        }
        (None, None) => None,
    };
    if stdin.as_ref().is_some_and(|s| s.len() > MAX_STDIN) {
        return Err(ApiError::too_large(
            "stdin over 768 KiB: write it to a file with the files API and redirect from it",
        ));
    }
    let argv = match (&req.cmd, &req.shell) {
        (Some(c), _) => c.clone(),
        (None, Some(s)) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        (None, None) => unreachable!("validated"),
    };
    let mut env = live_env.clone();
    env.extend(req.env.clone());
    let spec = ExecSpec {
        call_id: call_id.to_owned(),
        argv,
        cwd: req.cwd.clone(),
        env: env.into_iter().collect(),
        stdin: stdin.is_some(),
        timeout_ms,
        max_output_bytes: req.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT_BYTES),
        user: req.user.clone(),
        stream_output: stream,
        pty: None,
        kill_jobs: false,
    };
    Ok((spec, stdin))
}

/// The call record of an exec (env keys only, no output bodies).
pub fn call_record(
    caller: &Caller,
    live: &Live,
    kind: locker_store::CallKind,
    req: &ExecRequest,
    spec: &ExecSpec,
    res: &ExecResult,
) -> CallRecord {
    let mut result = res.clone();
    result.stdout.clear();
    result.stderr.clear();
    CallRecord {
        id: res.call_id.clone(),
        tenant: caller.tenant.clone(),
        key_id: caller.key_id.clone(),
        kind,
        sandbox_id: Some(live.id.clone()),
        volume_id: None,
        command: spec.argv.clone(),
        cwd: req.cwd.clone(),
        env_keys: req.env.keys().cloned().collect(),
        template_digest: live.template_digest.clone(),
        runtime: live.machine.kind().as_str().into(),
        result,
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
    fn base64_round_trips_known_values() {
        assert_eq!(base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode("aGVsbG8").unwrap(), b"hello");
        assert_eq!(base64_decode("AP8=").unwrap(), vec![0, 255]);
        assert!(base64_decode("a*b").is_err());
    }

    #[test]
    fn shell_becomes_sh_c_and_env_merges() {
        let mut base = BTreeMap::new();
        base.insert("A".to_string(), "1".to_string());
        base.insert("B".to_string(), "1".to_string());
        let req: ExecRequest =
            serde_json::from_str(r#"{"shell":"echo hi","env":{"B":"2"}}"#).unwrap();
        let (spec, stdin) =
            build_spec(&base, &req, "call_x", Wait::Call { stream: false }).unwrap();
        assert_eq!(spec.argv, vec!["/bin/sh", "-c", "echo hi"]);
        assert_eq!(
            spec.env,
            vec![("A".into(), "1".into()), ("B".into(), "2".into())]
        );
        assert!(stdin.is_none());
        let bad: ExecRequest =
            serde_json::from_str(r#"{"cmd":["x"],"max_output_bytes":999999999}"#).unwrap();
        assert!(build_spec(&base, &bad, "c", Wait::Call { stream: false }).is_err());
        assert_eq!(spec.timeout_ms, Some(60_000), "exec's default");
        let (bg, _) = build_spec(&base, &req, "c", Wait::Background).unwrap();
        assert_eq!(bg.timeout_ms, None, "a background process has none");
        let long: ExecRequest =
            serde_json::from_str(r#"{"cmd":["x"],"timeout_ms":7200000}"#).unwrap();
        assert!(build_spec(&base, &long, "c", Wait::Call { stream: false }).is_err());
        assert!(build_spec(&base, &long, "c", Wait::Background).is_ok());
    }
}
