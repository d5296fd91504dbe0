//! The client side of the `locker` CLI: the commands that talk to `locker serve` over HTTP.
//!
//! This room owns `locker sandbox|snapshot|exec|run|shell|process|ps|files|volume|secret|tenant|key|calls|usage|events`. It codes
//! against the HTTP contract (`docs/api.md`) and nothing else: it must not link to the
//! server, the runtime or the store, so that what it does is exactly what any other client
//! of the API could do. The HTTP plumbing (base URL, Bearer key, the `{"error": …}` shape)
//! lives in [`http`]; what people see (tables, one-line errors, relative times) in
//! [`render`]; raw terminal handling in [`tty`] (its system calls are `locker-sys`'s: the
//! CLI has no `unsafe`).
//!
//! Every command reads `--url` or `LOCKER_URL` (default `http://127.0.0.1:7070`) and
//! `--api-key` or `LOCKER_API_KEY` (`--admin-key` or `LOCKER_ADMIN_KEY` for the admin
//! routes); `--json` prints the server's JSON for scripts. A failure is one line on stderr and exit code 1 (2 for usage mistakes); `exec`
//! exits with the command's own code.

pub mod admin;
pub mod code;
pub mod exec;
pub mod files;
pub mod fleet;
pub mod http;
pub mod port;
pub mod process;
pub mod records;
pub mod render;
pub mod run;
pub mod sandbox;
pub mod secret;
pub mod shell;
pub mod tty;
pub mod volume;

use std::io::Write;

use serde_json::Value;

pub use http::{Client, ClientError, KeyKind};

/// Where `locker serve` listens unless `LOCKER_URL` or `--url` says otherwise.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";

/// The server and the key a client command talks with. Global, so that
/// `locker sandbox list --url U` and `locker sandbox --url U list` both work (and `main`
/// moves them from before the subcommand: `locker --url U sandbox list`). The environment
/// is read here rather than by clap, so that a usage error never lists `--url` as if it
/// had to be typed.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Endpoint {
    /// The Locker server to talk to [env: LOCKER_URL; default: http://127.0.0.1:7070].
    #[arg(long, global = true, value_name = "URL")]
    pub url: Option<String>,
    /// The API key to send [env: LOCKER_API_KEY; `locker serve` prints one at its first
    /// start].
    #[arg(long, global = true, value_name = "KEY")]
    pub api_key: Option<String>,
}

impl Endpoint {
    /// `--url`, else `LOCKER_URL`, else [`DEFAULT_URL`].
    pub fn base_url(&self) -> String {
        self.url
            .clone()
            .or_else(|| {
                std::env::var("LOCKER_URL")
                    .ok()
                    .filter(|u| !u.trim().is_empty())
            })
            .unwrap_or_else(|| DEFAULT_URL.to_string())
    }

    /// A client for the tenant routes, keyed by `--api-key` or `LOCKER_API_KEY`.
    pub fn client(&self) -> Result<Client, ClientError> {
        let key = match &self.api_key {
            Some(k) if k.trim().is_empty() => {
                return Err(ClientError::Usage("--api-key is empty".into()))
            }
            Some(k) => Some(k.clone()),
            None => KeyKind::Tenant.key_in_env(),
        };
        Client::new(&self.base_url(), key, KeyKind::Tenant)
    }
}

/// The options every client command shares: where the server is, its key, and `--json`.
/// Flattened into each command group; global so that `locker sandbox list --json` and
/// `locker sandbox --json list` both work.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Conn {
    #[command(flatten)]
    pub endpoint: Endpoint,
    /// Print the server's JSON instead of text for people (for scripts).
    #[arg(long, global = true)]
    pub json: bool,
}

impl Conn {
    /// A client for the tenant routes, keyed by `--api-key` or `LOCKER_API_KEY`.
    pub fn client(&self) -> Result<Client, ClientError> {
        self.endpoint.client()
    }
}

/// The options of the admin commands (`tenant`, `key`): the server, the admin key, `--json`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct AdminConn {
    /// The Locker server to talk to [env: LOCKER_URL; default: http://127.0.0.1:7070].
    #[arg(long, global = true, value_name = "URL")]
    pub url: Option<String>,
    /// The admin key `locker serve` was started with [env: LOCKER_ADMIN_KEY].
    #[arg(long, global = true, value_name = "KEY")]
    pub admin_key: Option<String>,
    /// Print the server's JSON instead of text for people (for scripts).
    #[arg(long, global = true)]
    pub json: bool,
}

impl AdminConn {
    /// A client for the admin routes. The admin key is required up front: without it
    /// every admin route is a 401 anyway.
    pub fn client(&self) -> Result<Client, ClientError> {
        let key = self
            .admin_key
            .clone()
            .filter(|k| !k.trim().is_empty())
            .or_else(|| KeyKind::Admin.key_in_env());
        if key.is_none() {
            return Err(ClientError::Config(
                "LOCKER_ADMIN_KEY is not set: admin commands need the admin key `locker serve` was started with (or pass --admin-key)".into(),
            ));
        }
        let ep = Endpoint {
            url: self.url.clone(),
            api_key: None,
        };
        Client::new(&ep.base_url(), key, KeyKind::Admin)
    }
}

/// The client commands, flattened into the binary's top-level command list (boxed, so
/// the top-level enum stays small whatever flags a command grows).
#[derive(clap::Subcommand, Debug)]
pub enum ClientCmd {
    /// Create, list, inspect and delete sandboxes (session machines).
    Sandbox(Box<sandbox::SandboxArgs>),
    /// List and delete snapshots of sandboxes.
    Snapshot(Box<sandbox::SnapshotArgs>),
    /// Run a command in a sandbox, streaming its output; exits with the command's code.
    Exec(Box<exec::ExecArgs>),
    /// A serverless call: a fresh machine on a volume runs one command; its changes are
    /// committed to the volume and listed. Exits with the command's code.
    Run(Box<run::RunArgs>),
    /// Open an interactive terminal in a sandbox.
    Shell(Box<shell::ShellArgs>),
    /// Background processes of a sandbox (`locker exec --background` starts one): list,
    /// follow their output, wait for them, signal them, feed their stdin.
    Process(Box<process::ProcessArgs>),
    /// List a sandbox's background processes (as `locker process list`).
    Ps(Box<process::PsArgs>),
    /// The TCP ports listening in a sandbox and the URLs that reach them.
    Port(Box<port::PortArgs>),
    /// Run code in a sandbox's code context (a Jupyter kernel: variables persist between
    /// calls); output streams as it comes, images are saved with --save-images.
    Code(Box<code::CodeArgs>),
    /// Read, write, list and move files in a sandbox.
    Files(Box<files::FilesArgs>),
    /// Create, list, delete, snapshot and fork volumes, and move their files.
    Volume(Box<volume::VolumeArgs>),
    /// Create, list, rotate and delete secrets (values machines use but never see).
    Secret(Box<secret::SecretArgs>),
    /// Create tenants (admin: needs --admin-key or LOCKER_ADMIN_KEY).
    Tenant(Box<admin::TenantArgs>),
    /// Create and revoke API keys (admin: needs --admin-key or LOCKER_ADMIN_KEY).
    Key(Box<admin::KeyArgs>),
    /// Join tokens and the fleet's nodes (admin: needs --admin-key or LOCKER_ADMIN_KEY).
    Fleet(Box<fleet::FleetArgs>),
    /// The record of every exec and run: what ran, where, how it ended.
    Calls(Box<records::CallsArgs>),
    /// This tenant's usage totals.
    Usage(Box<records::UsageArgs>),
    /// Follow this tenant's lifecycle events (sandboxes created, paused, deleted, runs
    /// committed, …) as they happen, one line each.
    Events(Box<records::EventsArgs>),
}

/// Runs one client command and exits the process: 0 on success, the command's code for
/// `exec`, 1 with one line on stderr on failure (2 for usage mistakes).
pub fn main(cmd: ClientCmd) -> ! {
    let result = match cmd {
        ClientCmd::Sandbox(a) => sandbox::run(*a),
        ClientCmd::Snapshot(a) => sandbox::run_snapshot(*a),
        ClientCmd::Exec(a) => exec::run(*a),
        ClientCmd::Run(a) => run::run(*a),
        ClientCmd::Shell(a) => shell::run(*a),
        ClientCmd::Process(a) => process::run(*a),
        ClientCmd::Ps(a) => process::run_ps(*a),
        ClientCmd::Port(a) => port::run(*a),
        ClientCmd::Code(a) => code::run(*a),
        ClientCmd::Files(a) => files::run(*a),
        ClientCmd::Volume(a) => volume::run(*a),
        ClientCmd::Secret(a) => secret::run(*a),
        ClientCmd::Tenant(a) => admin::run_tenant(*a),
        ClientCmd::Key(a) => admin::run_key(*a),
        ClientCmd::Fleet(a) => fleet::run(*a),
        ClientCmd::Calls(a) => records::run_calls(*a),
        ClientCmd::Usage(a) => records::run_usage(*a),
        ClientCmd::Events(a) => records::run_events(*a),
    };
    let code = match result {
        Ok(code) => code,
        Err(e) => report(&e),
    };
    let _ = std::io::stdout().flush();
    std::process::exit(code)
}

/// Prints `e` as the one line a person sees and returns the exit code it calls for.
pub fn report(e: &ClientError) -> i32 {
    if let Some(line) = render::error_line(e) {
        eprintln!("{line}");
    }
    e.exit_code()
}

/// Parses `K=V` (for `--env` and `--metadata`); the value may be empty and may hold `=`.
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// A span typed by a person, in seconds: `90`, `90s`, `30m`, `24h`, `7d`, `2w`.
pub fn parse_span_s(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// A moment typed by a person, as Unix seconds (`now` is the present): RFC 3339
/// (`2026-12-01T08:00:00Z`), a UTC date (`2026-12-01`), `today` or `yesterday` (UTC
/// midnight), a span back from now (`30m`, `24h`, `7d`: see [`parse_span_s`]), or Unix
/// seconds.
pub fn parse_moment(s: &str, now: i64) -> Result<i64, String> {
    let s = s.trim();
    let midnight = now - now.rem_euclid(86_400);
    let at = if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        s.parse().ok()
    } else if let Some(t) = render::parse_rfc3339(s) {
        Some(t)
    } else if s.len() == 10 && s.as_bytes()[4] == b'-' {
        render::parse_rfc3339(&format!("{s}T00:00:00Z"))
    } else if s == "today" {
        Some(midnight)
    } else if s == "yesterday" {
        Some(midnight - 86_400)
    } else {
        parse_span_s(s)
            .filter(|_| s.ends_with(|c: char| c.is_ascii_alphabetic()))
            .and_then(|d| i64::try_from(d).ok())
            .map(|d| now.saturating_sub(d))
    };
    at.ok_or_else(|| {
        format!(
            "expected a date (2026-12-01), a time (2026-12-01T08:00:00Z), a span back from now (30m, 24h, 7d), today, yesterday or Unix seconds; got {s:?}"
        )
    })
}

/// The list inside a list answer: `{"<key>": [...]}`, or a bare array.
pub fn items<'a>(v: &'a Value, key: &str) -> Result<&'a [Value], ClientError> {
    let list = match v {
        Value::Array(a) => Some(a),
        v => v.get(key).and_then(Value::as_array),
    };
    list.map(Vec::as_slice)
        .ok_or_else(|| ClientError::Protocol(format!("expected a list under `{key}`")))
}

/// Deletes each of `ids` with `delete`, printing each one deleted (with `--json`, one
/// `{"deleted": [...]}` at the end) and a line for each failure; exit code 1 if any failed.
pub fn delete_each(
    ids: &[String],
    json_out: bool,
    delete: impl Fn(&str) -> Result<(), ClientError>,
) -> Result<i32, ClientError> {
    let mut failed = 0;
    let mut gone = Vec::new();
    for id in ids {
        match delete(id) {
            Ok(()) => {
                if !json_out {
                    print_text(&format!("{id}\n"))?;
                }
                gone.push(id.as_str());
            }
            Err(e) => {
                failed += 1;
                report(&e);
            }
        }
    }
    if json_out {
        print_json(&serde_json::json!({ "deleted": gone }))?;
    }
    Ok(if failed == 0 { 0 } else { 1 })
}

/// Writes `v` as pretty JSON plus a newline: what `--json` prints.
pub fn print_json(v: &Value) -> Result<(), ClientError> {
    let mut out = std::io::stdout().lock();
    let text = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    writeln!(out, "{text}").map_err(|e| ClientError::io("cannot write to stdout", e))
}

/// Writes text for people to stdout.
pub fn print_text(s: &str) -> Result<(), ClientError> {
    let mut out = std::io::stdout().lock();
    out.write_all(s.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| ClientError::io("cannot write to stdout", e))
}

/// Percent-encodes one path segment (an id or a name) so it cannot change the route
/// (`/`, `?`, and `.` too, so that `..` stays a name and not a step up).
pub fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Standard base64 with padding, for `stdin_b64`.
pub fn base64(data: &[u8]) -> String {
    locker_types::base64::encode(data)
}

/// Decodes base64 (`data_b64`, `stdout_b64`); `None` if malformed.
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    locker_types::base64::decode(s).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_parsing_keeps_equals_in_values() {
        assert_eq!(parse_kv("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert_eq!(parse_kv("A=").unwrap(), ("A".into(), String::new()));
        assert!(parse_kv("=x").is_err());
        assert!(parse_kv("novalue").is_err());
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: ClientCmd,
    }

    fn parse(args: &[&str]) -> Result<ClientCmd, clap::Error> {
        use clap::Parser;
        Cli::try_parse_from(std::iter::once("locker").chain(args.iter().copied())).map(|c| c.cmd)
    }

    #[test]
    fn exec_flags_stop_where_the_command_starts() {
        let Ok(ClientCmd::Exec(a)) = parse(&["exec", "sb_1", "--cwd", "/w", "ls", "-la", "--json"])
        else {
            panic!("exec did not parse");
        };
        assert_eq!(a.cwd.as_deref(), Some("/w"));
        assert_eq!(a.cmd, ["ls", "-la", "--json"]);
        assert!(!a.conn.json);
        let Ok(ClientCmd::Exec(a)) = parse(&["exec", "--json", "sb_1", "--", "-x", "--cwd"]) else {
            panic!("exec did not parse");
        };
        assert!(a.conn.json);
        assert_eq!(a.cmd, ["-x", "--cwd"]);
        assert!(parse(&["exec", "sb_1"]).is_err());
        assert!(parse(&["exec", "sb_1", "--shell", "x", "ls"]).is_err());
        assert!(parse(&["exec", "sb_1", "--shell", "echo hi"]).is_ok());
    }

    #[test]
    fn json_and_url_work_before_and_after_the_subcommand() {
        for args in [
            &["sandbox", "--json", "list"][..],
            &["sandbox", "list", "--json"],
            &["files", "ls", "sb_1", "/", "--json"],
            &["volume", "files", "ls", "repo", "/", "--json"],
            &["volume", "--json", "list"],
        ] {
            let cmd = parse(args).unwrap();
            let json = match cmd {
                ClientCmd::Sandbox(a) => a.conn.json,
                ClientCmd::Files(a) => a.conn.json,
                ClientCmd::Volume(a) => a.conn.json,
                _ => false,
            };
            assert!(json, "{args:?}");
        }
        let Ok(ClientCmd::Usage(a)) = parse(&["usage", "--url", "http://h:1"]) else {
            panic!("usage did not parse");
        };
        assert_eq!(a.conn.endpoint.url.as_deref(), Some("http://h:1"));
        let Ok(ClientCmd::Exec(a)) = parse(&["exec", "--api-key", "k", "sb_1", "true"]) else {
            panic!("exec did not parse");
        };
        assert_eq!(a.conn.endpoint.api_key.as_deref(), Some("k"));
        assert!(parse(&["shell", "sb_1", "--json"]).is_ok_and(|c| match c {
            ClientCmd::Shell(a) => a.cmd == ["--json"],
            _ => false,
        }));
        assert!(parse(&["shell", "--json", "sb_1"]).is_err());
    }

    #[test]
    fn spans_and_moments_read_as_people_type_them() {
        assert_eq!(parse_span_s("90"), Some(90));
        assert_eq!(parse_span_s("30m"), Some(1800));
        assert_eq!(parse_span_s("2h"), Some(7200));
        assert_eq!(parse_span_s("7d"), Some(604_800));
        assert_eq!(parse_span_s("1w"), Some(604_800));
        assert_eq!(parse_span_s("h"), None);
        assert_eq!(parse_span_s("1y"), None);
        assert_eq!(parse_span_s("-5"), None);
        let now = 1_796_040_000; // 2026-11-30T12:00:00Z
        assert_eq!(parse_moment("24h", now), Ok(now - 86_400));
        assert_eq!(parse_moment("30m", now), Ok(now - 1800));
        assert_eq!(parse_moment("2026-12-01", now), Ok(1_796_083_200));
        assert_eq!(parse_moment("2026-12-01T00:00:00Z", now), Ok(1_796_083_200));
        assert_eq!(parse_moment("1796083200", now), Ok(1_796_083_200));
        assert_eq!(parse_moment("today", now), Ok(1_795_996_800));
        assert_eq!(parse_moment("yesterday", now), Ok(1_795_910_400));
        for bad in ["soon", "", "2026-13-01", "24x", "12:00"] {
            let e = parse_moment(bad, now).unwrap_err();
            assert!(e.contains("24h") && e.contains("2026-12-01"), "{bad}: {e}");
        }
    }

    #[test]
    fn path_segments_cannot_escape_the_route() {
        assert_eq!(seg("sb_12"), "sb_12");
        assert_eq!(seg("../keys"), "%2E%2E%2Fkeys");
        assert_eq!(seg("a b?c"), "a%20b%3Fc");
    }
}
