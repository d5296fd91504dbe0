//! `locker calls` and `locker usage`: the record of what every tool call did, and the
//! tenant's totals (`GET /v1/calls`, `GET /v1/usage`).
//!
//! The contract names what a call record holds but not every field's spelling, so the
//! table looks for each column under the names a record may use (top level or inside its
//! `result`) and shows `-` for what is missing; `--json` always shows the record whole.

use serde_json::Value;

use super::render::{cell, kv_lines, now_secs, relative, table};
use super::{items, print_json, print_text, ClientError, Conn};

/// `locker calls`.
#[derive(clap::Args, Debug)]
pub struct CallsArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// Only the calls in this sandbox (sb_…).
    #[arg(long)]
    pub sandbox: Option<String>,
    /// Only the runs on this volume (its name or vol_… id).
    #[arg(long)]
    pub volume: Option<String>,
    /// At most this many calls, newest first (default 100, at most 1000).
    #[arg(long)]
    pub limit: Option<u32>,
}

/// `locker usage`.
#[derive(clap::Args, Debug)]
pub struct UsageArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// Count from this moment on (default: since the tenant began): a UTC date
    /// (2026-12-01), a time (2026-12-01T08:00:00Z), a span back from now (30m, 24h, 7d),
    /// today, yesterday, or Unix seconds.
    #[arg(long, value_name = "WHEN", value_parser = parse_since)]
    pub since: Option<i64>,
}

/// `locker events`.
#[derive(clap::Args, Debug)]
pub struct EventsArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// Only these types, comma-separated (`sandbox.*,run.committed`).
    #[arg(long)]
    pub types: Option<String>,
    /// Start after this event id (`evt_…`; `0`: every event the server keeps) instead of now.
    #[arg(long, value_name = "ID")]
    pub after: Option<String>,
}

/// Runs `locker events`: follows `GET /v1/events` until interrupted; one line per event
/// (`--json`: the event's JSON).
pub fn run_events(a: EventsArgs) -> Result<i32, ClientError> {
    use std::io::{BufRead, Write};
    let c = a.conn.client()?;
    let mut q: Vec<(&str, String)> = Vec::new();
    if let Some(t) = &a.types {
        q.push(("types", t.clone()));
    }
    if let Some(x) = &a.after {
        q.push(("after", x.clone()));
    }
    let body = c.get_stream_accept("/v1/events", &q, "text/event-stream")?;
    let mut out = std::io::stdout().lock();
    for line in std::io::BufReader::new(body).lines() {
        let line = line.map_err(|e| ClientError::io("reading the event stream", e))?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let text = if a.conn.json {
            data.to_owned()
        } else {
            let e: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            let s = |k: &str| e[k].as_str().unwrap_or("").to_owned();
            format!(
                "{} {} {} {} {}",
                s("at"),
                s("id"),
                s("type"),
                s("subject"),
                e["data"]
            )
        };
        writeln!(out, "{text}")
            .and_then(|()| out.flush())
            .map_err(|e| ClientError::io("writing to stdout", e))?;
    }
    Ok(0)
}

fn parse_since(s: &str) -> Result<i64, String> {
    super::parse_moment(s, now_secs())
}

/// The query of `GET /v1/calls` for these flags.
pub fn calls_query(a: &CallsArgs) -> Vec<(&'static str, String)> {
    let mut q = Vec::new();
    if let Some(s) = &a.sandbox {
        q.push(("sandbox_id", s.clone()));
    }
    if let Some(v) = &a.volume {
        q.push(("volume_id", v.clone()));
    }
    if let Some(n) = a.limit {
        q.push(("limit", n.to_string()));
    }
    q
}

/// The first of `names` present in the record, at its top level or in its `result`.
fn field<'a>(rec: &'a Value, names: &[&str]) -> Option<&'a Value> {
    let scopes = [Some(rec), rec.get("result")];
    names.iter().find_map(|n| {
        scopes
            .iter()
            .flatten()
            .find_map(|s| s.get(*n).filter(|v| !v.is_null()))
    })
}

/// The command of a record as one short line.
pub fn command_text(rec: &Value) -> String {
    let text = match field(rec, &["cmd", "command", "shell"]) {
        Some(Value::Array(argv)) => argv
            .iter()
            .map(|a| match a.as_str() {
                Some(s) if !s.is_empty() && !s.contains(char::is_whitespace) => s.to_string(),
                Some(s) => format!("{s:?}"),
                None => a.to_string(),
            })
            .collect::<Vec<_>>()
            .join(" "),
        other => cell(other),
    };
    let text = super::render::clean(&text);
    if text.chars().count() > 48 {
        format!("{}…", text.chars().take(47).collect::<String>())
    } else {
        text
    }
}

/// How a recorded call ended, in a word: its exit code, or why it has none.
pub fn outcome_text(rec: &Value) -> String {
    let reason = field(rec, &["reason"]).and_then(Value::as_str);
    let code = field(rec, &["exit_code"]).and_then(Value::as_i64);
    let signal = field(rec, &["signal"]).and_then(Value::as_str);
    match (reason, code, signal) {
        (Some("exited") | None, Some(c), _) => c.to_string(),
        (Some("signaled"), _, Some(s)) => s.to_string(),
        (Some(r), _, _) => r.to_string(),
        (None, None, Some(s)) => s.to_string(),
        (None, None, None) => "-".to_string(),
    }
}

/// Milliseconds for people: `850ms`, `1.2s`, `3m05s`.
pub fn duration_text(ms: f64) -> String {
    if ms < 1000.0 {
        format!("{}ms", ms.round() as u64)
    } else if ms < 60_000.0 {
        format!("{:.1}s", ms / 1000.0)
    } else {
        let s = (ms / 1000.0).round() as u64;
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// The calls as a table for people.
pub fn calls_table(calls: &[Value], now: i64) -> String {
    let rows: Vec<Vec<String>> = calls
        .iter()
        .map(|r| {
            let ms = |k: &str| {
                field(r, &["timings"])
                    .and_then(|t| t.get(k))
                    .and_then(Value::as_f64)
                    .map(duration_text)
                    .unwrap_or_else(|| "-".into())
            };
            let when = match field(r, &["created_at", "started_at", "at", "time"]) {
                Some(Value::String(t)) => relative(now, t),
                other => cell(other),
            };
            vec![
                cell(field(r, &["call_id", "id"])),
                cell(field(r, &["sandbox_id", "volume_id"])),
                outcome_text(r),
                ms("total_ms"),
                when,
                command_text(r),
            ]
        })
        .collect();
    table(&["CALL", "WHERE", "EXIT", "TOOK", "WHEN", "COMMAND"], &rows)
}

/// Runs `locker calls`.
pub fn run_calls(a: CallsArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    let v = c.get_json("/v1/calls", &calls_query(&a))?;
    if a.conn.json {
        print_json(&v)?;
    } else {
        print_text(&calls_table(items(&v, "calls")?, now_secs()))?;
    }
    Ok(0)
}

/// Runs `locker usage`.
pub fn run_usage(a: UsageArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    let since = a.since.map(locker_types::rfc3339);
    let q: Vec<(&str, String)> = since.iter().map(|s| ("since", s.clone())).collect();
    let mut v = c.get_json("/v1/usage", &q)?;
    if a.conn.json {
        print_json(&v)?;
    } else {
        // People see the moment the totals count from, as the CLI understood it.
        if let (Some(s), Some(m)) = (since, v.as_object_mut()) {
            let when = format!("{s} ({})", relative(now_secs(), &s));
            m.entry("since").or_insert(Value::String(when));
        }
        let order = [
            "tenant",
            "since",
            "execs",
            "runs",
            "cpu_ms",
            "sandbox_seconds",
            "active_s",
            "idle_s",
            "paused_s",
            "idle_fraction",
            "sandbox_cpu_ms",
        ];
        print_text(&kv_lines(&v, &order, now_secs()))?;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn calls_filters_become_query_parameters() {
        let a = CallsArgs {
            conn: super::super::Conn::default(),
            sandbox: Some("sb_1".into()),
            volume: None,
            limit: Some(20),
        };
        assert_eq!(
            calls_query(&a),
            vec![
                ("sandbox_id", "sb_1".to_string()),
                ("limit", "20".to_string())
            ]
        );
    }

    #[test]
    fn a_call_reads_as_one_row() {
        let now = 1_796_040_000;
        let calls = vec![
            json!({"call_id": "call_1", "sandbox_id": "sb_1",
                   "cmd": ["python3", "-c", "print(1)"], "exit_code": 0, "reason": "exited",
                   "timings": {"total_ms": 15.6}, "created_at": "2026-11-30T11:59:00Z"}),
            json!({"id": "call_2", "volume_id": "vol_1", "shell": "sleep 99",
                   "result": {"exit_code": null, "reason": "timeout",
                              "timings": {"total_ms": 61_000.0}}}),
        ];
        assert_eq!(
            calls_table(&calls, now),
            "CALL    WHERE  EXIT     TOOK   WHEN     COMMAND\n\
             call_1  sb_1   0        16ms   60s ago  python3 -c print(1)\n\
             call_2  vol_1  timeout  1m01s  -        sleep 99\n"
        );
    }

    #[test]
    fn outcomes_and_durations() {
        assert_eq!(
            outcome_text(&json!({"reason": "signaled", "signal": "SIGSEGV"})),
            "SIGSEGV"
        );
        assert_eq!(outcome_text(&json!({"exit_code": 3})), "3");
        assert_eq!(outcome_text(&json!({})), "-");
        assert_eq!(duration_text(0.4), "0ms");
        assert_eq!(duration_text(1234.0), "1.2s");
        assert_eq!(
            command_text(&json!({"cmd": ["echo", "a b"]})),
            "echo \"a b\""
        );
        let long = json!({ "cmd": vec!["xy"; 40] });
        assert_eq!(command_text(&long).chars().count(), 48);
    }
}
