//! `locker port ls|url|open|close`: the TCP ports listening in a sandbox, the URLs that
//! reach them (preview URLs `{port}-{id}.{domain}`, or the server's path proxy
//! `/v1/sandboxes/{id}/ports…` where it has no preview domain), and whether a port is
//! public. Nothing here forwards traffic; the server does.

use serde_json::{json, Value};

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
    /// Print the URL that reaches PORT in the sandbox: its preview URL, with
    /// `?locker_token=` for a private port so that a browser opens it at once (the server
    /// swaps it for a cookie); on a server without a preview domain, the path proxy's URL
    /// (send the API key: `curl -H "Authorization: Bearer $LOCKER_API_KEY" "$(locker port
    /// url SB 8000)"`).
    Url {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The port in the sandbox (1-65535).
        port: u16,
        /// A path on that port (default `/`).
        #[arg(default_value = "/")]
        path: String,
        /// Without the token, even for a private port.
        #[arg(long)]
        bare: bool,
    },
    /// Make PORT public: anyone with its preview URL reaches it, without a key or token.
    Open {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The port in the sandbox (1-65535); it need not listen yet.
        port: u16,
    },
    /// Make PORT private again (the default): the API key, the preview token or its cookie.
    Close {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The port in the sandbox (1-65535).
        port: u16,
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
            bare,
        } => {
            check_port(port)?;
            let sb = c.get_json(&format!("/v1/sandboxes/{}", seg(&sandbox)), &[])?;
            let url = match sb.get("preview_url").and_then(Value::as_str) {
                Some(template) => {
                    let public = is_public(&c, &sandbox, port);
                    let token = sb.get("preview_token").and_then(Value::as_str);
                    preview_url(template, port, &path, token.filter(|_| !bare && !public))
                }
                None => c.url(&format!(
                    "/v1/sandboxes/{}/ports/{port}/{}",
                    seg(&sandbox),
                    path.trim_start_matches('/')
                )),
            };
            if a.conn.json {
                print_json(&json!({ "url": url }))?;
            } else {
                print_text(&format!("{url}\n"))?;
            }
            Ok(0)
        }
        cmd @ (PortCmd::Open { .. } | PortCmd::Close { .. }) => {
            let (public, sandbox, port) = match cmd {
                PortCmd::Open { sandbox, port } => (true, sandbox, port),
                PortCmd::Close { sandbox, port } => (false, sandbox, port),
                _ => unreachable!("matched above"),
            };
            check_port(port)?;
            let v = c.put_json(
                &format!("/v1/sandboxes/{}/ports/{port}", seg(&sandbox)),
                &json!({ "public": public }),
            )?;
            if a.conn.json {
                print_json(&v)?;
            } else if public {
                print_text(&format!("port {port} is public: {}\n", cell(v.get("url"))))?;
            } else {
                print_text(&format!("port {port} is private\n"))?;
            }
            Ok(0)
        }
    }
}

fn check_port(port: u16) -> Result<(), ClientError> {
    if port == 0 {
        return Err(ClientError::Usage("the port must be 1-65535".into()));
    }
    Ok(())
}

/// Whether `port` of the sandbox is public now (listening or not); false when unknown.
fn is_public(c: &super::Client, sandbox: &str, port: u16) -> bool {
    c.get_json(&format!("/v1/sandboxes/{}/ports", seg(sandbox)), &[])
        .ok()
        .and_then(|v| {
            v.get("ports")?
                .as_array()?
                .iter()
                .find(|p| p.get("port").and_then(Value::as_u64) == Some(u64::from(port)))
                .and_then(|p| p.get("public")?.as_bool())
        })
        .unwrap_or(false)
}

/// The preview URL of `port` from the sandbox's template, with `path`, and the token as
/// `?locker_token=` when given.
fn preview_url(template: &str, port: u16, path: &str, token: Option<&str>) -> String {
    let base = template.replace("{port}", &port.to_string());
    let mut url = format!(
        "{}/{}",
        base.trim_end_matches('/'),
        path.trim_start_matches('/')
    );
    if let Some(t) = token {
        url.push(if url.contains('?') { '&' } else { '?' });
        url.push_str("locker_token=");
        url.push_str(t);
    }
    url
}

#[cfg(test)]
mod tests {
    use super::preview_url;

    #[test]
    fn preview_urls_take_the_port_the_path_and_the_token() {
        let t = "http://{port}-sb_1.localhost:7070/";
        assert_eq!(
            preview_url(t, 8000, "/", None),
            "http://8000-sb_1.localhost:7070/"
        );
        assert_eq!(
            preview_url(t, 3000, "/a?b=1", Some("lpt_x")),
            "http://3000-sb_1.localhost:7070/a?b=1&locker_token=lpt_x"
        );
        assert_eq!(
            preview_url(t, 3000, "app", Some("lpt_x")),
            "http://3000-sb_1.localhost:7070/app?locker_token=lpt_x"
        );
    }
}
