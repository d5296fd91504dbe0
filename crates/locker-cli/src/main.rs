//! The `locker` binary: a thin shell over the libraries.

mod template_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "locker", version, about = "Disposable, isolated machines for AI agents' tool calls")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build, import and list templates (root filesystems machines start from).
    #[command(subcommand)]
    Template(template_cmd::TemplateCmd),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Template(c) => template_cmd::run(c),
    }
}
