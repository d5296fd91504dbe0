//! `locker sandbox create|list|get|rm|pause|resume|ttl|network|snapshot|fork` and `locker
//! snapshot list|rm`: session machines over `/v1/sandboxes` and their snapshots.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::render::{cell, human_bytes, kv_lines, now_secs, relative, table};
use super::{delete_each, items, parse_kv, print_json, print_text, seg, Client, ClientError, Conn};

/// `locker sandbox …`.
#[derive(clap::Args, Debug)]
pub struct SandboxArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub cmd: SandboxCmd,
}

/// The sandbox subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum SandboxCmd {
    /// Create a sandbox and print its id.
    Create(Box<CreateArgs>),
    /// List this tenant's sandboxes.
    #[command(visible_alias = "ls")]
    List(ListArgs),
    /// Show one sandbox.
    Get {
        /// The sandbox (sb_…).
        id: String,
    },
    /// Destroy sandboxes now: their processes, mounts and files are gone.
    #[command(visible_alias = "delete")]
    Rm {
        /// The sandboxes (sb_…).
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Freeze every process of a sandbox (it uses no CPU; any call resumes it).
    Pause {
        /// The sandbox (sb_…).
        id: String,
    },
    /// Thaw a paused sandbox.
    Resume {
        /// The sandbox (sb_…).
        id: String,
    },
    /// Set how long a sandbox lives from now (it is destroyed then); prints its new expiry.
    Ttl {
        /// The sandbox (sb_…).
        id: String,
        /// Seconds from now, or with a unit: 90s, 30m, 2h, 7d (at most 30 days).
        #[arg(value_name = "TTL", value_parser = parse_ttl)]
        ttl_s: u64,
    },
    /// Change a running sandbox's egress policy; new connections follow it at once. Prints
    /// the policy as the server normalized it.
    Network {
        /// The sandbox (sb_…).
        id: String,
        /// `none`, `all`, `allow:pypi.org,*.github.com,10.0.0.0/8`, or the policy's JSON
        /// (as `sandbox create --network`).
        #[arg(value_name = "POLICY", value_parser = parse_network)]
        policy: Value,
    },
    /// Save a sandbox's files as a snapshot (snap_…) to start new sandboxes from.
    Snapshot {
        /// The sandbox (sb_…).
        id: String,
    },
    /// Make COUNT new sandboxes from one consistent point of this one; prints their ids.
    Fork {
        /// The sandbox (sb_…).
        id: String,
        /// How many (1-100).
        #[arg(long, short = 'n', default_value_t = 1)]
        count: u64,
    },
}

/// `locker snapshot …`.
#[derive(clap::Args, Debug)]
pub struct SnapshotArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub cmd: SnapshotCmd,
}

/// The snapshot subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum SnapshotCmd {
    /// List this tenant's snapshots.
    #[command(visible_alias = "ls")]
    List,
    /// Delete snapshots (sandboxes started from them keep their own copies).
    #[command(visible_alias = "delete")]
    Rm {
        /// The snapshots (snap_…).
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

/// Runs `locker snapshot …`.
pub fn run_snapshot(a: SnapshotArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    match a.cmd {
        SnapshotCmd::List => {
            let v = c.get_json("/v1/snapshots", &[])?;
            if a.conn.json {
                print_json(&v)?;
            } else {
                let now = now_secs();
                let rows: Vec<Vec<String>> = items(&v, "snapshots")?
                    .iter()
                    .map(|s| {
                        let created = s.get("created_at").and_then(Value::as_str).unwrap_or("");
                        vec![
                            cell(s.get("id")),
                            cell(s.get("sandbox_id")),
                            cell(s.get("template")),
                            human_bytes(s.get("size_bytes").and_then(Value::as_u64).unwrap_or(0)),
                            relative(now, created),
                        ]
                    })
                    .collect();
                print_text(&table(
                    &["ID", "SANDBOX", "TEMPLATE", "SIZE", "CREATED"],
                    &rows,
                ))?;
            }
            Ok(0)
        }
        SnapshotCmd::Rm { ids } => delete_each(&ids, a.conn.json, |id| {
            c.delete(&format!("/v1/snapshots/{}", seg(id)), &[])
        }),
    }
}

/// Flags of `locker sandbox create`; every one left out takes the server's default.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct CreateArgs {
    /// The template to start from (default: `default`; `locker template list` shows them).
    #[arg(long)]
    pub template: Option<String>,
    /// The isolation backend: auto (default: microvm where KVM works and no volume is
    /// mounted, else jail), jail (Linux namespaces) or microvm (its own kernel).
    #[arg(long, value_parser = ["auto", "jail", "microvm"])]
    pub runtime: Option<String>,
    /// CPUs (fractions allowed, e.g. 0.5; default 1).
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Memory limit in MiB (default 512).
    #[arg(long)]
    pub memory_mb: Option<u64>,
    /// Disk quota of its writable layer in MiB (default 2048).
    #[arg(long)]
    pub disk_mb: Option<u64>,
    /// Seconds until it is destroyed (default 1800; `sandbox ttl` changes it later).
    #[arg(long)]
    pub ttl_s: Option<u64>,
    /// Pause it after this many seconds with no call (default: never); any call resumes it.
    #[arg(long)]
    pub idle_timeout_s: Option<u64>,
    /// An environment variable of every command in it (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// A label to find it by (`sandbox list --metadata K=V`; repeatable).
    #[arg(long = "metadata", value_name = "K=V", value_parser = parse_kv)]
    pub metadata: Vec<(String, String)>,
    /// Egress: `none` (default), `all`, `allow:pypi.org,*.github.com,10.0.0.0/8`, or the
    /// policy's JSON (`sandbox network` changes it later).
    #[arg(long, value_name = "POLICY", value_parser = parse_network)]
    pub network: Option<Value>,
    /// A secret by name (repeatable): its env variable gets a placeholder, and the egress
    /// proxy puts the value in requests to its hosts only (`locker secret create`).
    #[arg(long = "secret", value_name = "NAME")]
    pub secrets: Vec<String>,
    /// Mount a volume (its name or vol_… id) at /workspace, or at PATH; `:ro` mounts it
    /// read-only (repeatable): `repo`, `repo:/src`, `repo:/src:ro`.
    #[arg(long = "volume", value_name = "VOL[:PATH][:ro]", value_parser = parse_volume)]
    pub volumes: Vec<Value>,
    /// Start from a snapshot (snap_…) instead of the template.
    #[arg(long)]
    pub from_snapshot: Option<String>,
}

/// Flags of `locker sandbox list`.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct ListArgs {
    /// Only sandboxes in this state (starting, running, paused, stopped, failed).
    #[arg(long)]
    pub state: Option<String>,
    /// Only sandboxes with this label (repeatable: all must match).
    #[arg(long = "metadata", value_name = "K=V", value_parser = parse_kv)]
    pub metadata: Vec<(String, String)>,
}

/// The `--network` flag as the API's `network` object.
pub fn parse_network(s: &str) -> Result<Value, String> {
    let s = s.trim();
    if s.starts_with('{') {
        let v: Value = serde_json::from_str(s).map_err(|e| format!("not valid JSON: {e}"))?;
        return if v.get("egress").is_some() {
            Ok(v)
        } else {
            Err("a JSON policy needs an \"egress\" field".into())
        };
    }
    match s {
        "none" => Ok(json!({"egress": "none"})),
        "all" => Ok(json!({"egress": "all"})),
        _ => {
            let list = s
                .strip_prefix("allow:")
                .or_else(|| s.strip_prefix("allow="))
                .ok_or_else(|| format!("expected none, all or allow:DOMAIN,…, got {s:?}"))?;
            let allow: Vec<&str> = list
                .split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .collect();
            if allow.is_empty() {
                return Err("allow: needs at least one domain or address".into());
            }
            Ok(json!({"egress": "allow", "allow": allow}))
        }
    }
}

/// Where a volume given without a path is mounted (the API's default).
pub const DEFAULT_MOUNT: &str = "/workspace";

/// The `--volume` flag (`VOL[:/path][:ro]`) as one entry of the API's `volumes`.
pub fn parse_volume(s: &str) -> Result<Value, String> {
    let (spec, read_only) = match s.strip_suffix(":ro") {
        Some(rest) => (rest, true),
        None => (s.strip_suffix(":rw").unwrap_or(s), false),
    };
    let (vol, path) = spec.split_once(':').unwrap_or((spec, DEFAULT_MOUNT));
    if vol.is_empty() || !path.starts_with('/') {
        return Err(format!("expected VOLUME[:/abs/path][:ro], got {s:?}"));
    }
    Ok(json!({"volume": vol, "path": path, "read_only": read_only}))
}

/// The TTL argument of `sandbox ttl`: seconds, or a span with a unit.
pub fn parse_ttl(s: &str) -> Result<u64, String> {
    super::parse_span_s(s)
        .ok_or_else(|| format!("expected seconds or a span (90s, 30m, 2h, 7d), got {s:?}"))
}

fn map_of(pairs: &[(String, String)]) -> BTreeMap<&str, &str> {
    pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// The body of `POST /v1/sandboxes` for these flags: only what was given.
pub fn create_body(a: &CreateArgs) -> Value {
    let mut m = Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    if let Some(t) = &a.template {
        put("template", json!(t));
    }
    if let Some(r) = &a.runtime {
        put("runtime", json!(r));
    }
    if let Some(n) = a.cpus {
        put("cpus", json!(n));
    }
    if let Some(n) = a.memory_mb {
        put("memory_mb", json!(n));
    }
    if let Some(n) = a.disk_mb {
        put("disk_mb", json!(n));
    }
    if let Some(n) = a.ttl_s {
        put("ttl_s", json!(n));
    }
    if let Some(n) = a.idle_timeout_s {
        put("idle_timeout_s", json!(n));
    }
    if !a.env.is_empty() {
        put("env", json!(map_of(&a.env)));
    }
    if !a.metadata.is_empty() {
        put("metadata", json!(map_of(&a.metadata)));
    }
    if let Some(n) = &a.network {
        put("network", n.clone());
    }
    if !a.secrets.is_empty() {
        put("secrets", json!(a.secrets));
    }
    if !a.volumes.is_empty() {
        put("volumes", Value::Array(a.volumes.clone()));
    }
    if let Some(s) = &a.from_snapshot {
        put("from_snapshot", json!(s));
    }
    Value::Object(m)
}

/// The query of `GET /v1/sandboxes` for these flags.
pub fn list_query(a: &ListArgs) -> Vec<(String, String)> {
    let mut q = Vec::new();
    if let Some(s) = &a.state {
        q.push(("state".to_string(), s.clone()));
    }
    for (k, v) in &a.metadata {
        q.push((format!("metadata.{k}"), v.clone()));
    }
    q
}

/// The sandbox list as a table for people.
pub fn list_table(sandboxes: &[Value], now: i64) -> String {
    let rows: Vec<Vec<String>> = sandboxes
        .iter()
        .map(|s| {
            let when = |k: &str| match s.get(k).and_then(Value::as_str) {
                Some(t) => relative(now, t),
                None => "-".to_string(),
            };
            vec![
                cell(s.get("id")),
                cell(s.get("state")),
                cell(s.get("template")),
                cell(s.get("runtime")),
                when("created_at"),
                when("expires_at"),
            ]
        })
        .collect();
    table(
        &["ID", "STATE", "TEMPLATE", "RUNTIME", "CREATED", "EXPIRES"],
        &rows,
    )
}

/// The fields `sandbox get` shows first, in this order.
const GET_ORDER: &[&str] = &[
    "id",
    "state",
    "template",
    "runtime",
    "cpus",
    "memory_mb",
    "disk_mb",
    "created_at",
    "expires_at",
    "last_active_at",
];

/// Runs `locker sandbox …`.
pub fn run(a: SandboxArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    let json_out = a.conn.json;
    match a.cmd {
        SandboxCmd::Create(args) => {
            let sb = c.post_json("/v1/sandboxes", &create_body(&args))?;
            if json_out {
                print_json(&sb)?;
            } else {
                let id = sb.get("id").and_then(Value::as_str).ok_or_else(|| {
                    ClientError::Protocol("the created sandbox has no `id`".into())
                })?;
                print_text(&format!("{id}\n"))?;
                // For people, on stderr: `SB=$(locker sandbox create)` still gets the id alone.
                if let Some(url) = sb.get("preview_url").and_then(Value::as_str) {
                    eprintln!(
                        "preview: {url} (private; `locker port url {id} PORT` prints one a \
                         browser opens, `locker port open {id} PORT` makes a port public)"
                    );
                }
            }
            Ok(0)
        }
        SandboxCmd::List(args) => {
            let q = list_query(&args);
            let q: Vec<(&str, String)> = q.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            let v = c.get_json("/v1/sandboxes", &q)?;
            if json_out {
                print_json(&v)?;
            } else {
                print_text(&list_table(items(&v, "sandboxes")?, now_secs()))?;
            }
            Ok(0)
        }
        SandboxCmd::Get { id } => {
            let v = get(&c, &id)?;
            if json_out {
                print_json(&v)?;
            } else {
                let names = volume_names(&c, &v);
                print_text(&kv_lines(&for_people(&v, &names), GET_ORDER, now_secs()))?;
            }
            Ok(0)
        }
        SandboxCmd::Ttl { id, ttl_s } => {
            let v = c.post_json(
                &format!("/v1/sandboxes/{}/ttl", seg(&id)),
                &json!({ "ttl_s": ttl_s }),
            )?;
            if json_out {
                print_json(&v)?;
            } else {
                let at = v.get("expires_at").and_then(Value::as_str).unwrap_or("");
                print_text(&format!(
                    "{id} expires at {} ({})\n",
                    cell(v.get("expires_at")),
                    relative(now_secs(), at)
                ))?;
            }
            Ok(0)
        }
        SandboxCmd::Network { id, policy } => {
            let v = c.patch_json(
                &format!("/v1/sandboxes/{}", seg(&id)),
                &json!({ "network": policy }),
            )?;
            if json_out {
                print_json(&v)?;
            } else {
                print_text(&format!("{id} network: {}\n", network_text(&v["network"])))?;
            }
            Ok(0)
        }
        SandboxCmd::Rm { ids } => delete_each(&ids, json_out, |id| {
            c.delete(&format!("/v1/sandboxes/{}", seg(id)), &[])
        }),
        cmd @ (SandboxCmd::Pause { .. } | SandboxCmd::Resume { .. }) => {
            let (verb, id) = match cmd {
                SandboxCmd::Pause { id } => ("pause", id),
                SandboxCmd::Resume { id } => ("resume", id),
                _ => unreachable!("matched above"),
            };
            let v = c.post_json(&format!("/v1/sandboxes/{}/{verb}", seg(&id)), &json!({}))?;
            if json_out {
                print_json(&v)?;
            } else {
                print_text(&format!(
                    "{id} {}\n",
                    v.get("state").and_then(Value::as_str).unwrap_or("")
                ))?;
            }
            Ok(0)
        }
        SandboxCmd::Snapshot { id } => {
            let v = c.post_json(&format!("/v1/sandboxes/{}/snapshots", seg(&id)), &json!({}))?;
            if json_out {
                print_json(&v)?;
            } else {
                print_text(&format!("{}\n", cell(v.get("id"))))?;
            }
            Ok(0)
        }
        SandboxCmd::Fork { id, count } => {
            let v = c.post_json(
                &format!("/v1/sandboxes/{}/fork", seg(&id)),
                &json!({ "count": count }),
            )?;
            if json_out {
                print_json(&v)?;
            } else {
                for sb in items(&v, "sandboxes")? {
                    print_text(&format!("{}\n", cell(sb.get("id"))))?;
                }
            }
            Ok(0)
        }
    }
}

/// A network policy in the words of `--network`: `none`, `all`, `allow:a,b`.
pub fn network_text(n: &Value) -> String {
    match n.get("egress").and_then(Value::as_str) {
        Some("allow") => {
            let list: Vec<String> = n
                .get("allow")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|a| cell(Some(a)))
                .collect();
            format!("allow:{}", list.join(","))
        }
        Some(e) => cell(Some(&json!(e))),
        None => cell(Some(n)),
    }
}

/// The names of the volumes a sandbox mounts by id (`vol_…` → name), when they can be
/// found; a sandbox without volumes costs no request.
fn volume_names(c: &Client, sb: &Value) -> BTreeMap<String, String> {
    let mounts = sb.get("volumes").and_then(Value::as_array);
    if mounts.is_none_or(|m| m.is_empty()) {
        return BTreeMap::new();
    }
    let Ok(list) = c.get_json("/v1/volumes", &[]) else {
        return BTreeMap::new();
    };
    items(&list, "volumes")
        .unwrap_or_default()
        .iter()
        .filter_map(|v| {
            Some((
                v.get("id")?.as_str()?.to_string(),
                v.get("name")?.as_str()?.to_string(),
            ))
        })
        .collect()
}

/// A Sandbox as `sandbox get` shows it: each volume mount as `name:/path` (`:ro` when
/// read-only), the network in `--network`'s words, byte counts in the size style.
pub fn for_people(sb: &Value, names: &BTreeMap<String, String>) -> Value {
    let mut v = sb.clone();
    if let Some(mounts) = sb.get("volumes").and_then(Value::as_array) {
        let shown: Vec<Value> = mounts
            .iter()
            .map(|m| {
                let vol = m.get("volume").and_then(Value::as_str).unwrap_or("?");
                let vol = match names.get(vol) {
                    Some(name) => format!("{name} ({vol})"),
                    None => vol.to_string(),
                };
                let path = m
                    .get("path")
                    .and_then(Value::as_str)
                    .unwrap_or(DEFAULT_MOUNT);
                let ro = if m.get("read_only").and_then(Value::as_bool) == Some(true) {
                    ":ro"
                } else {
                    ""
                };
                json!(format!("{vol}:{path}{ro}"))
            })
            .collect();
        v["volumes"] = Value::Array(shown);
    }
    if let Some(n) = sb.get("network").filter(|n| n.is_object()) {
        v["network"] = json!(network_text(n));
    }
    // A template reads as one to people: `http://PORT-sb_….localhost:7070/`.
    if let Some(u) = sb.get("preview_url").and_then(Value::as_str) {
        v["preview_url"] = json!(u.replace("{port}", "PORT"));
    }
    if let Some(b) = sb
        .pointer("/usage/peak_memory_bytes")
        .and_then(Value::as_u64)
    {
        v["usage"]["peak_memory_bytes"] = json!(human_bytes(b));
    }
    v
}

/// `GET /v1/sandboxes/{id}`.
pub fn get(c: &Client, id: &str) -> Result<Value, ClientError> {
    c.get_json(&format!("/v1/sandboxes/{}", seg(id)), &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_sends_only_what_was_given() {
        assert_eq!(create_body(&CreateArgs::default()), json!({}));
        let a = CreateArgs {
            template: Some("py".into()),
            cpus: Some(2.0),
            memory_mb: Some(1024),
            ttl_s: Some(60),
            env: vec![("A".into(), "1".into()), ("B".into(), "x=y".into())],
            metadata: vec![("agent".into(), "a1".into())],
            network: Some(parse_network("allow:pypi.org, *.github.com").unwrap()),
            volumes: vec![parse_volume("vol_1:/workspace:ro").unwrap()],
            ..Default::default()
        };
        assert_eq!(
            create_body(&a),
            json!({
                "template": "py", "cpus": 2.0, "memory_mb": 1024, "ttl_s": 60,
                "env": {"A": "1", "B": "x=y"}, "metadata": {"agent": "a1"},
                "network": {"egress": "allow", "allow": ["pypi.org", "*.github.com"]},
                "volumes": [{"volume": "vol_1", "path": "/workspace", "read_only": true}],
            })
        );
    }

    #[test]
    fn network_policies() {
        assert_eq!(parse_network("none").unwrap(), json!({"egress": "none"}));
        assert_eq!(parse_network("all").unwrap(), json!({"egress": "all"}));
        assert_eq!(
            parse_network(r#"{"egress":"allow","allow":["a.b"]}"#).unwrap(),
            json!({"egress": "allow", "allow": ["a.b"]})
        );
        assert!(parse_network("allow:").is_err());
        assert!(parse_network("some").is_err());
        assert!(parse_network("{}").is_err());
    }

    #[test]
    fn volumes_mount_at_workspace_or_an_absolute_path() {
        assert_eq!(
            parse_volume("vol_1:/w").unwrap(),
            json!({"volume": "vol_1", "path": "/w", "read_only": false})
        );
        assert_eq!(
            parse_volume("repo").unwrap(),
            json!({"volume": "repo", "path": "/workspace", "read_only": false})
        );
        assert_eq!(
            parse_volume("repo:ro").unwrap(),
            json!({"volume": "repo", "path": "/workspace", "read_only": true})
        );
        assert!(parse_volume("vol_1:rel").is_err());
        assert!(parse_volume(":/w").is_err());
        assert!(parse_volume("").is_err());
    }

    #[test]
    fn a_sandbox_reads_as_text() {
        let sb = json!({"id": "sb_1", "network": {"egress": "allow", "allow": ["a.b", "10.0.0.0/8"]},
            "volumes": [{"volume": "vol_1", "path": "/workspace", "read_only": false},
                        {"volume": "vol_2", "path": "/data", "read_only": true}],
            "usage": {"cpu_ms": 5, "peak_memory_bytes": 3_145_728}});
        let names = BTreeMap::from([("vol_1".to_string(), "repo".to_string())]);
        assert_eq!(
            kv_lines(&for_people(&sb, &names), GET_ORDER, 0),
            "id:                      sb_1\n\
             network:                 allow:a.b,10.0.0.0/8\n\
             usage.cpu_ms:            5\n\
             usage.peak_memory_bytes: 3.0M\n\
             volumes:                 repo (vol_1):/workspace, vol_2:/data:ro\n"
        );
        assert_eq!(network_text(&json!({"egress": "none"})), "none");
        assert_eq!(parse_ttl("2h"), Ok(7200));
        assert!(parse_ttl("soon").is_err());
    }

    #[test]
    fn list_filters_become_query_parameters() {
        let a = ListArgs {
            state: Some("running".into()),
            metadata: vec![("agent".into(), "a 1".into())],
        };
        assert_eq!(
            list_query(&a),
            vec![
                ("state".to_string(), "running".to_string()),
                ("metadata.agent".to_string(), "a 1".to_string())
            ]
        );
    }

    #[test]
    fn list_table_shows_relative_times() {
        let now = 1_796_040_000;
        let sbs = vec![json!({
            "id": "sb_1", "state": "running", "template": "default", "runtime": "jail",
            "created_at": "2026-11-30T11:57:00Z", "expires_at": "2026-11-30T12:27:00Z"
        })];
        assert_eq!(
            list_table(&sbs, now),
            "ID    STATE    TEMPLATE  RUNTIME  CREATED  EXPIRES\n\
             sb_1  running  default   jail     3m ago   in 27m\n"
        );
    }
}
