//! `locker mcp`: Locker's MCP server on stdin/stdout, for MCP clients that start a local
//! command (Claude Code, Claude Desktop, IDEs). It talks to `locker serve` at `LOCKER_URL`
//! with `LOCKER_API_KEY`; stdout carries only the protocol, diagnostics go to stderr.

#[derive(clap::Args)]
pub struct McpArgs {
    /// The Locker server the tools act on.
    #[arg(long, env = "LOCKER_URL", default_value = crate::client::DEFAULT_URL)]
    url: String,
}

pub fn run(args: McpArgs) -> anyhow::Result<()> {
    let key = std::env::var("LOCKER_API_KEY")
        .ok()
        .filter(|k| !k.trim().is_empty());
    if key.is_none() {
        eprintln!(
            "locker mcp: LOCKER_API_KEY is not set; every tool call will answer unauthorized"
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(locker_mcp::serve_stdio(&args.url, key))?;
    Ok(())
}
