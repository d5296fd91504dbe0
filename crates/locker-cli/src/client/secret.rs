//! `locker secret create|list|rotate|rm`: a tenant's secrets over `/v1/secrets…`. A value
//! is read from stdin (never from the command line, where `ps` and shell history would
//! keep it) and never printed: the server never returns one.

use serde_json::{json, Value};

use super::render::{cell, now_secs, relative, table};
use super::{delete_each, items, print_json, print_text, seg, Client, ClientError, Conn};

/// `locker secret …`.
#[derive(clap::Args, Debug)]
pub struct SecretArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub cmd: SecretCmd,
}

/// The secret subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum SecretCmd {
    /// Create a secret; its value is read from stdin (`locker secret create openai --host
    /// api.openai.com --env OPENAI_API_KEY < key.txt`).
    Create {
        /// Its name (a-z, 0-9, `_`, `-`), as sandboxes' `secrets` name it.
        name: String,
        /// A host the value may be sent to (repeatable).
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// The environment variable that holds the placeholder inside a machine.
        #[arg(long)]
        env: String,
    },
    /// List this tenant's secrets (names, hosts, env variables; never values).
    #[command(visible_alias = "ls")]
    List,
    /// Give a secret a new value (from stdin, with --value-stdin), new hosts or a new env
    /// variable.
    Rotate {
        name: String,
        /// Read a new value from stdin.
        #[arg(long)]
        value_stdin: bool,
        /// The new hosts (repeatable; replaces the list).
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// The new environment variable.
        #[arg(long)]
        env: Option<String>,
    },
    /// Delete secrets.
    #[command(visible_alias = "delete")]
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
    },
}

/// The value on stdin, without its final line break.
fn read_value() -> Result<String, ClientError> {
    let mut s = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
        .map_err(|e| ClientError::io("cannot read the secret's value from stdin", e))?;
    let v = s.strip_suffix('\n').unwrap_or(&s);
    let v = v.strip_suffix('\r').unwrap_or(v);
    Ok(v.to_owned())
}

fn secret_table(list: &[Value]) -> String {
    let now = now_secs();
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|s| {
            let hosts: Vec<&str> = s
                .get("hosts")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            vec![
                cell(s.get("name")),
                cell(s.get("env")),
                hosts.join(","),
                relative(
                    now,
                    s.get("updated_at").and_then(Value::as_str).unwrap_or(""),
                ),
            ]
        })
        .collect();
    table(&["NAME", "ENV", "HOSTS", "UPDATED"], &rows)
}

/// Runs `locker secret …`.
pub fn run(a: SecretArgs) -> Result<i32, ClientError> {
    let c: Client = a.conn.client()?;
    let json_out = a.conn.json;
    let show = |v: &Value, text: String| {
        if json_out {
            print_json(v)
        } else {
            print_text(&text)
        }
    };
    match a.cmd {
        SecretCmd::Create { name, hosts, env } => {
            let value = read_value()?;
            let v = c.post_json(
                "/v1/secrets",
                &json!({"name": name, "value": value, "hosts": hosts, "env": env}),
            )?;
            show(&v, secret_table(std::slice::from_ref(&v)))?;
        }
        SecretCmd::List => {
            let v = c.get_json("/v1/secrets", &[])?;
            show(&v, secret_table(items(&v, "secrets")?))?;
        }
        SecretCmd::Rotate {
            name,
            value_stdin,
            hosts,
            env,
        } => {
            let mut body = json!({});
            if value_stdin {
                body["value"] = json!(read_value()?);
            }
            if !hosts.is_empty() {
                body["hosts"] = json!(hosts);
            }
            if let Some(e) = env {
                body["env"] = json!(e);
            }
            let v = c.put_json(&format!("/v1/secrets/{}", seg(&name)), &body)?;
            show(&v, secret_table(std::slice::from_ref(&v)))?;
        }
        SecretCmd::Rm { names } => {
            return delete_each(&names, json_out, |n| {
                c.delete(&format!("/v1/secrets/{}", seg(n)), &[])
            });
        }
    }
    Ok(0)
}
