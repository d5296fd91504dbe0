//! The client side of the `locker` CLI: the commands that talk to `locker serve` over HTTP.
//!
//! This room owns `locker sandbox|exec|run|shell|files|volume|tenant|key|calls|usage`. It codes
//! against the HTTP contract (`docs/api.md`) and nothing else: it must not link to the
//! server, the runtime or the store, so that what it does is exactly what any other client
//! of the API could do. The HTTP plumbing (base URL, Bearer key, the `{"error": …}` shape)
//! lives in [`http`]; what people see (tables, one-line errors, relative times) in
//! [`render`]; raw terminal handling, the only `unsafe` here, in [`tty`].
//!
//! Every command reads `LOCKER_URL` (default `http://127.0.0.1:7070`) and `LOCKER_API_KEY`
//! (`LOCKER_ADMIN_KEY` for the admin routes); `--json` prints the server's JSON for
//! scripts. A failure is one line on stderr and exit code 1 (2 for usage mistakes); `exec`
//! exits with the command's own code.

pub mod admin;
pub mod exec;
pub mod files;
pub mod http;
pub mod records;
pub mod render;
pub mod run;
pub mod sandbox;
pub mod shell;
pub mod tty;
pub mod volume;

use std::io::Write;

use serde_json::Value;

pub use http::{Client, ClientError, KeyKind};

/// Where `locker serve` listens unless `LOCKER_URL` or `--url` says otherwise.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";

/// The options every client command shares. Flattened into each command group; global so
/// that `locker sandbox list --json` and `locker sandbox --json list` both work.
#[derive(clap::Args, Debug, Clone)]
pub struct Conn {
    /// The Locker server to talk to.
    #[arg(long, global = true, env = "LOCKER_URL", default_value = DEFAULT_URL)]
    pub url: String,
    /// Print the server's JSON instead of text for people (for scripts).
    #[arg(long, global = true)]
    pub json: bool,
}

impl Conn {
    /// A client for the tenant routes, keyed by `LOCKER_API_KEY`.
    pub fn client(&self) -> Result<Client, ClientError> {
        Client::from_env(&self.url, KeyKind::Tenant)
    }

    /// A client for the admin routes, keyed by `LOCKER_ADMIN_KEY`.
    pub fn admin_client(&self) -> Result<Client, ClientError> {
        Client::from_env(&self.url, KeyKind::Admin)
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
    /// Read, write, list and move files in a sandbox.
    Files(Box<files::FilesArgs>),
    /// Create, list, delete, snapshot and fork volumes, and move their files.
    Volume(Box<volume::VolumeArgs>),
    /// Create tenants (admin: needs LOCKER_ADMIN_KEY).
    Tenant(Box<admin::TenantArgs>),
    /// Create and revoke API keys (admin: needs LOCKER_ADMIN_KEY).
    Key(Box<admin::KeyArgs>),
    /// The record of every exec and run: what ran, where, how it ended.
    Calls(Box<records::CallsArgs>),
    /// This tenant's usage totals.
    Usage(Box<records::UsageArgs>),
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
        ClientCmd::Files(a) => files::run(*a),
        ClientCmd::Volume(a) => volume::run(*a),
        ClientCmd::Tenant(a) => admin::run_tenant(*a),
        ClientCmd::Key(a) => admin::run_key(*a),
        ClientCmd::Calls(a) => records::run_calls(*a),
        ClientCmd::Usage(a) => records::run_usage(*a),
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

/// The list inside a list answer: `{"<key>": [...]}`, or a bare array.
pub fn items<'a>(v: &'a Value, key: &str) -> Result<&'a [Value], ClientError> {
    let list = match v {
        Value::Array(a) => Some(a),
        v => v.get(key).and_then(Value::as_array),
    };
    list.map(Vec::as_slice)
        .ok_or_else(|| ClientError::Protocol(format!("expected a list under `{key}`")))
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
        assert_eq!(a.conn.url, "http://h:1");
    }

    #[test]
    fn path_segments_cannot_escape_the_route() {
        assert_eq!(seg("sb_12"), "sb_12");
        assert_eq!(seg("../keys"), "%2E%2E%2Fkeys");
        assert_eq!(seg("a b?c"), "a%20b%3Fc");
    }
}
