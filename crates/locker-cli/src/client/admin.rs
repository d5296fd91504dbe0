//! `locker tenant create` and `locker key create|revoke`: the admin routes, authenticated
//! with `--admin-key` or `LOCKER_ADMIN_KEY` (the key `locker serve --admin-key` was given).

use serde_json::{json, Value};

use super::render::cell;
use super::{print_json, print_text, seg, AdminConn, ClientError};

/// `locker tenant …`.
#[derive(clap::Args, Debug)]
pub struct TenantArgs {
    #[command(flatten)]
    pub conn: AdminConn,
    #[command(subcommand)]
    pub cmd: TenantCmd,
}

/// The tenant subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum TenantCmd {
    /// Create a tenant and its first API key (the key is shown only once).
    Create {
        /// The tenant's name.
        name: String,
    },
}

/// `locker key …`.
#[derive(clap::Args, Debug)]
pub struct KeyArgs {
    #[command(flatten)]
    pub conn: AdminConn,
    #[command(subcommand)]
    pub cmd: KeyCmd,
}

/// The key subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum KeyCmd {
    /// Create a new API key of a tenant (shown only once).
    Create {
        /// The tenant the key belongs to.
        #[arg(long)]
        tenant: String,
        /// A key in E2B's shape (`e2b_` and 40 hex digits), for E2B's SDKs (`E2B_API_KEY`);
        /// it works as any Locker key.
        #[arg(long)]
        e2b: bool,
    },
    /// Revoke a key at once; prints its id.
    Revoke {
        /// The key's id (key_…), as `key create` printed it.
        key_id: String,
    },
}

/// A new key for people: tenant, key id and the key itself, one a line.
pub fn key_text(v: &Value) -> String {
    format!(
        "tenant:  {}\nkey_id:  {}\napi_key: {}\n",
        cell(v.get("tenant")),
        cell(v.get("key_id")),
        cell(v.get("api_key"))
    )
}

fn show_new_key(v: &Value, json_out: bool) -> Result<i32, ClientError> {
    if json_out {
        print_json(v)?;
    } else {
        print_text(&key_text(v))?;
        eprintln!("locker: the API key is shown only this once: store it now");
    }
    Ok(0)
}

/// Runs `locker tenant …`.
pub fn run_tenant(a: TenantArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    match a.cmd {
        TenantCmd::Create { name } => {
            let v = c.post_json("/v1/tenants", &json!({ "name": name }))?;
            show_new_key(&v, a.conn.json)
        }
    }
}

/// Runs `locker key …`.
pub fn run_key(a: KeyArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    match a.cmd {
        KeyCmd::Create { tenant, e2b } => {
            let body = if e2b {
                json!({"format": "e2b"})
            } else {
                json!({})
            };
            let v = c.post_json(&format!("/v1/tenants/{}/keys", seg(&tenant)), &body)?;
            show_new_key(&v, a.conn.json)
        }
        KeyCmd::Revoke { key_id } => {
            c.delete(&format!("/v1/keys/{}", seg(&key_id)), &[])?;
            if a.conn.json {
                print_json(&json!({ "revoked": key_id }))?;
            } else {
                print_text(&format!("{key_id}\n"))?;
            }
            Ok(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_key_reads_as_three_lines() {
        let v = json!({"tenant": "team-b", "api_key": "lk_abc", "key_id": "key_1"});
        assert_eq!(
            key_text(&v),
            "tenant:  team-b\nkey_id:  key_1\napi_key: lk_abc\n"
        );
    }
}
