//! The data types of Locker's public contract (`docs/api.md`), shared by every crate.
//!
//! This room owns the shapes that cross a boundary: what a client sends to exec a command,
//! what comes back (`ExecResult`), what a file looks like (`Entry`), the bodies that create
//! sandboxes and runs (`requests`). It owns no behaviour: no I/O, no validation beyond the
//! body's own shape (what serde and the `requests` conversions check), so the agent (a static binary inside every
//! machine) can depend on it without pulling anything else in.

#![forbid(unsafe_code)]

pub mod base64;
pub mod requests;

pub use requests::{
    CommitMode, CreateSandbox, NetworkPolicy, PatchSandbox, RunMachine, RunRequest, Runtime,
    RuntimeChoice, VolumeMount, VolumeMounts,
};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Default per-stream output cap in bytes (`max_output_bytes`).
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 65_536;
/// Default wall-clock limit of one command (exec, run). Background processes have none.
pub const DEFAULT_TIMEOUT_MS: u64 = 60_000;
/// The largest `timeout_ms` a single exec may ask for (one hour).
pub const MAX_TIMEOUT_MS: u64 = 3_600_000;
/// The longest a sandbox may live (`ttl_s`), in seconds: 30 days.
pub const MAX_TTL_S: u64 = 30 * 24 * 3600;
/// The largest `timeout_ms` a background process may ask for: the longest a sandbox may
/// live, since a background process never outlives its sandbox anyway.
pub const MAX_BACKGROUND_TIMEOUT_MS: u64 = MAX_TTL_S * 1000;

/// What to run: the body of `POST /v1/sandboxes/{id}/exec` and of background processes.
///
/// Exactly one of `cmd` (an argv, run without a shell) and `shell` (run by `/bin/sh -c`)
/// must be given.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Text fed to the command's standard input, then closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Raw bytes (base64) fed to standard input; exclusive with `stdin`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_b64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
    /// A user name or numeric uid inside the machine; default `root`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

impl ExecRequest {
    /// Checks the request's own consistency for a call that returns when the command ends
    /// (exec, run); the message says what to fix.
    pub fn validate(&self) -> Result<(), String> {
        self.validate_within(MAX_TIMEOUT_MS)
    }

    /// The same checks for a background process, whose `timeout_ms` may reach
    /// [`MAX_BACKGROUND_TIMEOUT_MS`].
    pub fn validate_background(&self) -> Result<(), String> {
        self.validate_within(MAX_BACKGROUND_TIMEOUT_MS)
    }

    fn validate_within(&self, max_timeout_ms: u64) -> Result<(), String> {
        match (&self.cmd, &self.shell) {
            (Some(_), Some(_)) => return Err("give either `cmd` or `shell`, not both".into()),
            (None, None) => return Err("give `cmd` (an argv array) or `shell` (a string)".into()),
            (Some(c), None) if c.is_empty() => {
                return Err("`cmd` must hold at least the program to run".into())
            }
            (Some(c), None) if c[0].is_empty() => {
                return Err("`cmd[0]` (the program) must not be empty".into())
            }
            _ => {}
        }
        let strings = self
            .cmd
            .iter()
            .flatten()
            .chain(self.shell.iter())
            .chain(self.cwd.iter());
        for s in strings.chain(self.env.keys()).chain(self.env.values()) {
            if s.contains('\0') {
                return Err("command, cwd and env must not contain NUL bytes".into());
            }
        }
        for k in self.env.keys() {
            if k.is_empty() || k.contains('=') {
                return Err(format!(
                    "env key {k:?} must be non-empty and contain no '='"
                ));
            }
        }
        if let Some(cwd) = &self.cwd {
            if !cwd.starts_with('/') {
                return Err(format!("`cwd` must be an absolute path, got {cwd:?}"));
            }
        }
        if self.stdin.is_some() && self.stdin_b64.is_some() {
            return Err("give either `stdin` or `stdin_b64`, not both".into());
        }
        if let Some(t) = self.timeout_ms {
            if t == 0 || t > max_timeout_ms {
                let hint = if max_timeout_ms == MAX_TIMEOUT_MS {
                    "; start a background process for longer commands"
                } else {
                    ""
                };
                return Err(format!(
                    "`timeout_ms` must be between 1 and {max_timeout_ms}{hint}"
                ));
            }
        }
        if self.max_output_bytes == Some(0) {
            return Err("`max_output_bytes` must be at least 1".into());
        }
        Ok(())
    }
}

/// Why a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// It exited on its own; `exit_code` says how.
    Exited,
    /// A signal ended it (not one Locker sent); `signal` says which.
    Signaled,
    /// It ran past `timeout_ms`; its whole process tree was killed.
    Timeout,
    /// The kernel's OOM killer ended it at the machine's or the command's memory limit.
    Oom,
    /// It wrote more than the machine may keep; its tree was killed.
    OutputLimit,
    /// A caller killed it (closed stream, signal route, sandbox deleted).
    Killed,
}

/// Where the time of one call went, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// From the request's arrival to the moment it was handed to the machine.
    pub queue_ms: f64,
    /// From hand-over to the command's process having started.
    pub start_ms: f64,
    /// From the process's start to its end.
    pub run_ms: f64,
    /// The whole call.
    pub total_ms: f64,
}

/// Resources a command (or a sandbox) used.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub cpu_ms: u64,
    pub peak_memory_bytes: u64,
}

/// The change list of a run on a volume.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Changes {
    pub added: Vec<String>,
    pub modified: Vec<String>,
    pub deleted: Vec<String>,
    pub committed: bool,
    pub conflicts: Vec<String>,
    /// Why changes that were to be applied were not (e.g. the volume's size limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_error: Option<String>,
}

/// The typed result of every exec and run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecResult {
    pub call_id: String,
    pub exit_code: Option<i32>,
    pub signal: Option<String>,
    pub reason: Reason,
    /// UTF-8 (lossy) text of what was kept of stdout.
    pub stdout: String,
    pub stderr: String,
    /// The same bytes as `stdout`, base64, present only when they are not valid UTF-8
    /// (binary output reaches a client unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_b64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_b64: Option<String>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub output_path: Option<String>,
    pub timings: Timings,
    pub usage: Usage,
    pub changes: Option<Changes>,
}

/// The kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryType {
    File,
    Dir,
    Symlink,
    Other,
}

/// One file, directory or link, as the files API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Absolute path inside the machine (or volume).
    pub path: String,
    pub name: String,
    #[serde(rename = "type")]
    pub kind: EntryType,
    pub size: u64,
    /// Permission bits, e.g. 420 for 0644.
    pub mode: u32,
    /// Modification time, RFC 3339 UTC.
    pub mtime: String,
    /// The owner's uid inside the machine. Absent from an agent of an earlier release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The group's gid inside the machine. Absent from an agent of an earlier release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// A symlink's target, as the link holds it (relative or absolute). Absent for other
    /// entries, and from an agent of an earlier release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// A regular file's user metadata: its extended attributes in the `user.e2b.`
    /// namespace, the prefix left out (E2B's file metadata). Absent when it has none, and
    /// from an agent of an earlier release.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// Formats seconds since the Unix epoch as RFC 3339 UTC (`2026-11-30T12:00:00Z`).
pub fn rfc3339(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (h, m, s) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{m:02}:{s:02}Z")
}

/// Parses an RFC 3339 time (`2026-11-30T12:00:00Z`, optional fraction, `Z` or `±HH:MM`)
/// to whole seconds since the Unix epoch; the inverse of [`rfc3339`].
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    if !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = &b[r];
        if !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(part).ok()?.parse().ok()
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || d < 1 || d > days_in_month(y, mo) || h > 23 || mi > 59 {
        return None;
    }
    if sec > 60 {
        return None;
    }
    let mut i = 19;
    if b[i] == b'.' {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start {
            return None;
        }
    }
    let rest = &b[i..];
    let offset = if rest == b"Z" || rest == b"z" {
        0
    } else if rest.len() == 6 && matches!(rest[0], b'+' | b'-') && rest[3] == b':' {
        let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
        if oh > 23 || om > 59 {
            return None;
        }
        let o = oh * 3600 + om * 60;
        if rest[0] == b'+' {
            o
        } else {
            -o
        }
    } else {
        return None;
    };
    Some(days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + sec - offset)
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Howard Hinnant's days-from-civil: days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_points() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_040_000), "2026-11-30T12:00:00Z");
    }

    #[test]
    fn exec_request_rejects_ambiguity_and_nul() {
        let mut r = ExecRequest {
            shell: Some("true".into()),
            ..Default::default()
        };
        assert!(r.validate().is_ok());
        r.cmd = Some(vec!["true".into()]);
        assert!(r.validate().unwrap_err().contains("not both"));
        r.shell = None;
        r.cwd = Some("rel".into());
        assert!(r.validate().unwrap_err().contains("absolute"));
        r.cwd = Some("/a\0b".into());
        assert!(r.validate().unwrap_err().contains("NUL"));
        assert!(serde_json::from_str::<ExecRequest>(r#"{"shell":"x","bogus":1}"#).is_err());
    }
}
