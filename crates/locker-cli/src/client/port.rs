//! `locker port ls|url`: the TCP ports listening in a sandbox and the URLs that reach them
//! through the server's path proxy (`/v1/sandboxes/{id}/ports…`). Nothing here forwards
//! traffic; the server does, with the caller's key.

use super::render::{cell, table};
use super::{items, print_json, print_text, seg, ClientError, Conn};

/// `locker port …`.
#[derive(clap::Args, Debug)]
pub struct PortArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub cmd: PortCmd,
}

/// The port subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum PortCmd {
    /// List the TCP ports listening in a sandbox now (a server started with `cmd &` or as
    /// a background process), with the process and the URL that reaches each.
    #[command(visible_alias = "list")]
    Ls {
        /// The sandbox (sb_…).
        sandbox: String,
    },
    /// Print the URL that reaches PORT in the sandbox through the server (send the API key
    /// as `Authorization: Bearer …`, e.g. `curl -H "Authorization: Bearer $LOCKER_API_KEY"
    /// "$(locker port url SB 8000)"`).
    Url {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The port in the sandbox (1-65535).
        port: u16,
        /// A path on that port (default `/`).
        #[arg(default_value = "/")]
        path: String,
    },
}

/// Runs `locker port …`.
pub fn run(a: PortArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    match a.cmd {
        PortCmd::Ls { sandbox } => {
            let v = c.get_json(&format!("/v1/sandboxes/{}/ports", seg(&sandbox)), &[])?;
            if a.conn.json {
                print_json(&v)?;
                return Ok(0);
            }
            let rows: Vec<Vec<String>> = items(&v, "ports")?
                .iter()
                .map(|p| {
                    vec![
                        cell(p.get("port")),
                        cell(p.get("address")),
                        cell(p.get("process")),
                        cell(p.get("url")),
                    ]
                })
                .collect();
            if rows.is_empty() {
                print_text("no TCP port listens in this sandbox\n")?;
            } else {
                print_text(&table(&["PORT", "ADDRESS", "PROCESS", "URL"], &rows))?;
            }
            Ok(0)
        }
        PortCmd::Url {
            sandbox,
            port,
            path,
        } => {
            if port == 0 {
                return Err(ClientError::Usage("the port must be 1-65535".into()));
            }
            let url = c.url(&format!(
                "/v1/sandboxes/{}/ports/{port}/{}",
                seg(&sandbox),
                path.trim_start_matches('/')
            ));
            if a.conn.json {
                print_json(&serde_json::json!({ "url": url }))?;
            } else {
                print_text(&format!("{url}\n"))?;
            }
            Ok(0)
        }
    }
}
