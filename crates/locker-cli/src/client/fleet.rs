//! `locker fleet token|nodes|cordon|uncordon|drain|remove`: the fleet's admin routes (`/v1/fleet/…`), with the
//! admin key. A token printed here is what `locker node --join URL --token T` takes on the
//! host that joins.

use serde_json::{json, Value};

use super::render::{cell, table};
use super::{print_json, print_text, seg, AdminConn, ClientError};

/// `locker fleet …`.
#[derive(clap::Args, Debug)]
pub struct FleetArgs {
    #[command(flatten)]
    pub conn: AdminConn,
    #[command(subcommand)]
    pub cmd: FleetCmd,
}

/// The fleet subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum FleetCmd {
    /// Mint a one-time join token, and print the command that joins a host with it.
    Token {
        /// How long the token stays valid: seconds, or with a unit (`90s`, `30m`, `12h`,
        /// `7d` at most).
        #[arg(long, default_value = "1h", value_parser = parse_ttl)]
        ttl: u64,
    },
    /// The nodes that joined: alive or not, their capacity and templates.
    Nodes,
    /// Cordon a node: no new sandbox is placed on it (what runs there keeps running).
    Cordon {
        /// The node's name or id.
        node: String,
    },
    /// Lift a node's cordon: placement may use it again.
    Uncordon {
        /// The node's name or id.
        node: String,
    },
    /// Drain a node: cordon it, then move each of its sandboxes to another node under its
    /// own id (a jail with its disk, cold; a microVM with its memory). Prints what moved,
    /// what did not and why; exits 1 if any sandbox stayed.
    Drain {
        /// The node's name or id.
        node: String,
    },
    /// Remove a node from the fleet (its certificate opens nothing from then on).
    Remove {
        /// The node's name or id.
        node: String,
    },
}

/// `90`, `90s`, `30m`, `12h`, `7d` → seconds.
pub fn parse_ttl(s: &str) -> Result<u64, String> {
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected seconds or a number with s, m, h or d"))?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{s:?}: the unit is one of s, m, h, d")),
    };
    Ok(n.saturating_mul(mult))
}

/// Runs `locker fleet …`.
pub fn run(a: FleetArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    match a.cmd {
        FleetCmd::Token { ttl } => {
            let v = c.post_json("/v1/fleet/tokens", &json!({ "ttl_s": ttl }))?;
            if a.conn.json {
                print_json(&v)?;
            } else {
                print_text(&format!(
                    "{}\n\nOn the host that joins (one use, expires {}):\n\n  {}\n",
                    cell(v.get("token")),
                    cell(v.get("expires_at")),
                    cell(v.get("command"))
                ))?;
            }
        }
        FleetCmd::Nodes => {
            let v = c.get_json("/v1/fleet/nodes", &[])?;
            if a.conn.json {
                print_json(&v)?;
            } else {
                print_text(&nodes_text(&v))?;
            }
        }
        FleetCmd::Cordon { ref node } | FleetCmd::Uncordon { ref node } => {
            let verb = if matches!(a.cmd, FleetCmd::Cordon { .. }) {
                "cordon"
            } else {
                "uncordon"
            };
            let node = node.clone();
            let v = c.post_json(
                &format!("/v1/fleet/nodes/{}/{verb}", seg(&node)),
                &json!({}),
            )?;
            if a.conn.json {
                print_json(&v)?;
            } else {
                print_text(&nodes_text(&json!({ "nodes": [v] })))?;
            }
        }
        FleetCmd::Drain { node } => {
            let v = c.post_json(&format!("/v1/fleet/nodes/{}/drain", seg(&node)), &json!({}))?;
            if a.conn.json {
                print_json(&v)?;
            } else {
                print_text(&drain_text(&v))?;
            }
            let stayed = v["failed"].as_array().is_some_and(|f| !f.is_empty())
                || v["volumes"]["failed"]
                    .as_array()
                    .is_some_and(|f| !f.is_empty());
            return Ok(i32::from(stayed));
        }
        FleetCmd::Remove { node } => {
            c.delete(&format!("/v1/fleet/nodes/{}", seg(&node)), &[])?;
            if a.conn.json {
                print_json(&json!({ "removed": node }))?;
            } else {
                print_text(&format!("{node}\n"))?;
            }
        }
    }
    Ok(0)
}

/// A drain's report for people: a line per sandbox, then the sums.
pub fn drain_text(v: &Value) -> String {
    let mut out = String::new();
    for m in v["moved"].as_array().map(Vec::as_slice).unwrap_or_default() {
        out.push_str(&format!(
            "moved  {}  to {}  ({} ms)\n",
            cell(m.get("sandbox")),
            cell(m.get("to_name")),
            cell(m.get("ms"))
        ));
    }
    for f in v["failed"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        out.push_str(&format!(
            "stayed {}  {}\n",
            cell(f.get("sandbox")),
            cell(f.get("error"))
        ));
    }
    let volumes = |k: &str| {
        v["volumes"][k]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
    };
    for m in volumes("moved") {
        out.push_str(&format!(
            "moved  volume {}  to {}  ({} ms)\n",
            cell(m.get("name")),
            cell(m.get("to_name")),
            cell(m.get("ms"))
        ));
    }
    for f in volumes("failed") {
        out.push_str(&format!(
            "stayed volume {}  {}\n",
            cell(f.get("name")),
            cell(f.get("error"))
        ));
    }
    out.push_str(&format!(
        "{}: {} moved, {} stayed, {} left on it, {} ms\n",
        cell(v.get("name")),
        v["moved"].as_array().map_or(0, Vec::len),
        v["failed"].as_array().map_or(0, Vec::len),
        cell(v.get("left")),
        cell(v.get("ms"))
    ));
    out
}

/// The nodes as a table for people.
pub fn nodes_text(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["nodes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|n| {
            let r = &n["report"];
            let mut state = match (n["state"].as_str(), n["alive"].as_bool()) {
                (Some("ready"), Some(false)) => "late".to_owned(),
                (s, _) => s.unwrap_or("?").to_owned(),
            };
            if n["cordoned"] == true {
                state.push_str(",cordoned");
            }
            vec![
                cell(n.get("name")),
                cell(n.get("id")),
                state,
                cell(n.get("epoch")),
                cell(n.get("address")),
                format!("{}/{}", cell(r.get("sandboxes")), cell(r.get("slots"))),
                cell(r.get("cpus")),
                format!("{} MB", cell(r.get("memory_mb"))),
                r["templates"].as_array().map_or(0, Vec::len).to_string(),
                format!("{} ms", cell(n.get("last_heartbeat_ms_ago"))),
            ]
        })
        .collect();
    if rows.is_empty() {
        return "no nodes: mint a token with `locker fleet token` and join a host with it\n".into();
    }
    table(
        &[
            "NAME",
            "ID",
            "STATE",
            "EPOCH",
            "ADDRESS",
            "SANDBOXES",
            "CPUS",
            "MEMORY",
            "TEMPLATES",
            "HEARTBEAT",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_read_with_units_and_refuse_others() {
        assert_eq!(parse_ttl("90").unwrap(), 90);
        assert_eq!(parse_ttl("30m").unwrap(), 1800);
        assert_eq!(parse_ttl("7d").unwrap(), 604_800);
        assert!(parse_ttl("1w").is_err());
        assert!(parse_ttl("h").is_err());
    }

    #[test]
    fn a_node_past_its_lease_reads_late() {
        let v = json!({"nodes": [{"name": "n1", "id": "node_1", "state": "ready", "alive": false,
            "epoch": 1, "address": "10.0.0.2:7443", "last_heartbeat_ms_ago": 4000,
            "report": {"sandboxes": 0, "slots": 30, "cpus": 2, "memory_mb": 1024, "templates": ["d"]}}]});
        let t = nodes_text(&v);
        assert!(
            t.contains("late") && t.contains("0/30") && t.contains("4000 ms"),
            "{t}"
        );
    }
}
