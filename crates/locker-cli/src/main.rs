//! The `locker` binary: a thin shell over the libraries.

mod client;
mod doctor_cmd;
mod mcp_cmd;
mod serve_cmd;
mod template_cmd;

use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "locker",
    version,
    about = "Disposable, isolated machines for AI agents' tool calls"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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

fn main() -> anyhow::Result<()> {
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
    if args.nth(1).is_some_and(|a| a == "__jail-attach") {
        locker_runtime::jail::attach_main(&args.next().unwrap_or_default().to_string_lossy());
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
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Template(c) => template_cmd::run(c),
        Cmd::Doctor(a) => doctor_cmd::run(a),
        Cmd::Serve(a) => serve_cmd::run(a),
        Cmd::Mcp(a) => mcp_cmd::run(a),
        Cmd::Completion { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "locker", &mut std::io::stdout());
            Ok(())
        }
        Cmd::Client(c) => client::main(c),
    }
}
