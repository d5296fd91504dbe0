//! The `locker` binary: a thin shell over the libraries. It owns how the command line is
//! read (the connection flags may come before the subcommand) and how a failure is shown:
//! one `locker: …` line on stderr for every command, local or client, never a backtrace.

// The terminal's system calls are `locker-sys`'s; nothing here needs `unsafe`.
#![forbid(unsafe_code)]

mod client;
mod db_cmd;
mod doctor_cmd;
mod mcp_cmd;
mod node_cmd;
mod serve_cmd;
mod template_cmd;

use std::ffi::OsString;

use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "locker",
    version,
    about = "Disposable, isolated machines for AI agents' tool calls",
    after_help = "The client commands talk to `locker serve` at --url or LOCKER_URL \
                  (default http://127.0.0.1:7070) with the key in --api-key or LOCKER_API_KEY \
                  (`locker serve` prints one at its first start)."
)]
struct Cli {
    #[command(flatten)]
    leading: Leading,
    #[command(subcommand)]
    cmd: Cmd,
}

/// Flags that may come before the subcommand (`locker --json sandbox list`). [`hoist`]
/// moves them behind the subcommand's name, where the subcommand reads them, so these
/// fields document them in `locker --help` and are set only when hoisting could not
/// apply. Their ids differ from the subcommands' own flags: clap copies a global flag's
/// value to a parent's flag of the same id.
#[derive(clap::Args)]
struct Leading {
    /// Print JSON instead of text for people (client commands, doctor, template list…).
    #[arg(long = "json", id = "leading_json")]
    json: bool,
    /// The Locker server the client commands talk to [env: LOCKER_URL; default:
    /// http://127.0.0.1:7070].
    #[arg(long = "url", id = "leading_url", value_name = "URL")]
    url: Option<String>,
    /// The API key the client commands send [env: LOCKER_API_KEY].
    #[arg(long = "api-key", id = "leading_api_key", value_name = "KEY")]
    api_key: Option<String>,
}

/// The flags [`Leading`] names, and whether each takes a value.
const LEADING: &[(&str, bool)] = &[("--json", false), ("--url", true), ("--api-key", true)];

/// `locker [LEADING…] SUBCOMMAND REST…` → `locker SUBCOMMAND [LEADING…] REST…`: the
/// connection flags typed before the subcommand go right after its name (with `depth`
/// 2, after the name of its subcommand: `template list`). Anything else before the
/// subcommand (`--help`, `-V`, a typo) leaves the line as it is for clap.
fn hoist(args: &[OsString], depth: usize) -> Vec<OsString> {
    let mut leading = Vec::new();
    let mut i = 1;
    while let Some(a) = args.get(i).and_then(|a| a.to_str()) {
        let flag = a.split_once('=').map_or(a, |(f, _)| f);
        let Some(&(_, takes_value)) = LEADING.iter().find(|(f, _)| *f == flag) else {
            break;
        };
        let n = if takes_value && !a.contains('=') {
            2
        } else {
            1
        };
        leading.extend(args[i..(i + n).min(args.len())].iter().cloned());
        i += n;
    }
    let names = args[i.min(args.len())..]
        .iter()
        .take(depth)
        .take_while(|a| a.to_str().is_some_and(|a| !a.starts_with('-')))
        .count();
    if leading.is_empty() || names < depth {
        return args.to_vec();
    }
    let mut out = vec![args[0].clone()];
    out.extend(args[i..i + names].iter().cloned());
    out.extend(leading);
    out.extend(args[i + names..].iter().cloned());
    out
}

#[derive(Subcommand)]
enum Cmd {
    /// Build, import and list templates (root filesystems machines start from).
    #[command(subcommand)]
    Template(template_cmd::TemplateCmd),
    /// Check which runtimes work on this host, and why not.
    Doctor(doctor_cmd::DoctorArgs),
    /// Serve the HTTP API (sandboxes, exec, files, records).
    Serve(serve_cmd::ServeArgs),
    /// Run this host as a node of a fleet: `--join URL --token T` the first time (a token
    /// from `locker fleet token`), then with the identity that left in the data dir.
    Node(node_cmd::NodeArgs),
    /// Manage the state database: `locker db migrate --to postgres://…` moves a one-host
    /// install's SQLite data into Postgres.
    #[command(subcommand)]
    Db(db_cmd::DbCmd),
    /// Serve Locker's tools to an MCP client on stdin/stdout (uses LOCKER_URL, LOCKER_API_KEY).
    Mcp(mcp_cmd::McpArgs),
    /// Print a shell completion script: `source <(locker completion bash)`, or for zsh
    /// `locker completion zsh > "${fpath[1]}/_locker"`, for fish
    /// `locker completion fish > ~/.config/fish/completions/locker.fish`.
    Completion {
        /// The shell to complete for.
        shell: clap_complete::Shell,
    },
    // Client commands (sandbox, exec, shell, files, tenant, key, calls, usage): they talk
    // to `locker serve` over HTTP; see `client/mod.rs`.
    #[command(flatten)]
    Client(client::ClientCmd),
}

/// The command line, with [`Leading`] flags moved where the subcommand reads them.
fn parse() -> Cli {
    let args: Vec<OsString> = std::env::args_os().collect();
    match Cli::try_parse_from(hoist(&args, 1)) {
        Ok(cli) => cli,
        Err(e) => Cli::try_parse_from(hoist(&args, 2)).unwrap_or_else(|_| e.exit()),
    }
}

fn main() {
    // The jail's shim must start single-threaded, before anything else runs.
    let mut args = std::env::args_os();
    if args.nth(1).is_some_and(|a| a == "__jail-init") {
        let spec = args
            .next()
            .map(std::path::PathBuf::from)
            .unwrap_or_default();
        locker_runtime::jail::init_main(&spec);
    }
    let mut args = std::env::args_os();
    if args.nth(1).is_some_and(|a| a == "__vm-fs") {
        // Its warnings (malformed requests from the guest) go to its log, `vm-fs.log`.
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("LOCKER_LOG")
                    .unwrap_or_else(|_| "warn".into()),
            )
            .init();
        locker_runtime::vm_fs::main(&args.next().unwrap_or_default().to_string_lossy());
    }
    let cli = parse();
    let l = &cli.leading;
    if l.json || l.url.is_some() || l.api_key.is_some() {
        // `hoist` moves them whenever a subcommand follows; this line had something else
        // in between.
        eprintln!(
            "locker: put --json, --url and --api-key right before or after the subcommand's name"
        );
        std::process::exit(2);
    }
    let result = match cli.cmd {
        Cmd::Template(c) => template_cmd::run(c),
        Cmd::Doctor(a) => doctor_cmd::run(a),
        Cmd::Serve(a) => serve_cmd::run(a),
        Cmd::Node(a) => node_cmd::run(a),
        Cmd::Mcp(a) => mcp_cmd::run(a),
        Cmd::Db(c) => db_cmd::run(c),
        Cmd::Completion { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "locker", &mut std::io::stdout());
            Ok(())
        }
        Cmd::Client(c) => client::main(c),
    };
    if let Err(e) = result {
        // The same one line as a client command's failure: the error and its causes,
        // never a backtrace (RUST_BACKTRACE is for panics).
        eprintln!("locker: {}", client::render::clean(&format!("{e:#}")));
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(args: &[&str]) -> Vec<OsString> {
        std::iter::once("locker")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect()
    }

    fn hoisted(args: &[&str], depth: usize) -> Vec<String> {
        hoist(&line(args), depth)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn leading_flags_move_behind_the_subcommand() {
        assert_eq!(
            hoisted(&["--json", "sandbox", "list"], 1),
            ["locker", "sandbox", "--json", "list"]
        );
        assert_eq!(
            hoisted(&["--json", "template", "list"], 2),
            ["locker", "template", "list", "--json"]
        );
        assert_eq!(
            hoisted(
                &[
                    "--url",
                    "http://h:1",
                    "--api-key=k",
                    "exec",
                    "sb_1",
                    "--",
                    "ls"
                ],
                1
            ),
            [
                "locker",
                "exec",
                "--url",
                "http://h:1",
                "--api-key=k",
                "sb_1",
                "--",
                "ls"
            ]
        );
        for same in [
            &["sandbox", "list", "--json"][..],
            &["--json"],
            &["--json", "--help"],
            &["--url"],
            &["-V"],
        ] {
            let mut want = vec!["locker"];
            want.extend(same);
            assert_eq!(hoisted(same, 1), want);
        }
    }

    #[test]
    fn every_command_parses_after_hoisting() {
        Cli::command().debug_assert();
        for args in [
            &["--json", "sandbox", "list"][..],
            &[
                "--url",
                "http://h:1",
                "--api-key",
                "k",
                "exec",
                "sb_1",
                "true",
            ],
            &["--json", "doctor"],
            &["--url=http://h:1", "mcp"],
            &["--json", "process", "list", "sb_1"],
            &["--json", "ps", "sb_1"],
        ] {
            assert!(
                Cli::try_parse_from(hoist(&line(args), 1)).is_ok(),
                "{args:?}"
            );
        }
        assert!(Cli::try_parse_from(hoist(&line(&["--json", "template", "list"]), 1)).is_err());
        assert!(Cli::try_parse_from(hoist(&line(&["--json", "template", "list"]), 2)).is_ok());
    }
}
