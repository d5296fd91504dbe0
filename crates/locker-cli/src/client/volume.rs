//! `locker volume create|list|get|rm|snapshot|snapshots|snapshot-rm|restore|fork|files`: volumes, a tenant's persistent
//! directory trees, over `/v1/volumes…`. A volume is named by its name or its id wherever
//! one is asked for. `volume files …` are the sandbox files commands, aimed at a volume.

use serde_json::{json, Value};

use super::files::FilesCmd;
use super::render::{cell, human_bytes, kv_lines, now_secs, relative, table};
use super::{delete_each, items, print_json, print_text, seg, Client, ClientError, Conn};

/// `locker volume …`.
#[derive(clap::Args, Debug)]
pub struct VolumeArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub cmd: VolumeCmd,
}

/// The volume subcommands. VOLUME is a volume's name or id.
#[derive(clap::Subcommand, Debug)]
pub enum VolumeCmd {
    /// Create a volume; prints its id (the whole volume with --json).
    Create {
        /// Its name, unique in this tenant (every volume command takes it instead of the id).
        name: String,
        /// Its size limit in MiB (default 10240, i.e. 10 GiB).
        #[arg(long)]
        size_mb: Option<u64>,
    },
    /// List this tenant's volumes.
    #[command(visible_alias = "ls")]
    List,
    /// Show one volume: its id, name, size limit, space used, creation time.
    Get {
        /// The volume's name or id.
        volume: String,
    },
    /// Delete volumes, their files and their snapshots (refused while a sandbox mounts one).
    #[command(visible_alias = "delete")]
    Rm {
        /// The volumes' names or ids.
        #[arg(required = true)]
        volumes: Vec<String>,
    },
    /// Take a point-in-time copy of a volume; prints the snapshot's id.
    Snapshot {
        /// The volume's name or id.
        volume: String,
    },
    /// List a volume's snapshots.
    Snapshots {
        /// The volume's name or id.
        volume: String,
    },
    /// Delete snapshots of a volume.
    SnapshotRm {
        /// The volume's name or id.
        volume: String,
        /// The snapshots (snap_…).
        #[arg(required = true)]
        snapshots: Vec<String>,
    },
    /// Make a volume's tree what a snapshot of it holds (refused while a sandbox mounts it).
    Restore {
        /// The volume's name or id.
        volume: String,
        /// The snapshot (snap_…) to go back to.
        snapshot: String,
    },
    /// Make a new volume NEW_NAME with a copy of VOLUME's files (now, or of a snapshot);
    /// prints its id.
    Fork {
        /// The volume to copy (name or id).
        volume: String,
        /// The new volume's name.
        new_name: String,
        /// Copy this snapshot of VOLUME (snap_…) instead of its files now.
        #[arg(long)]
        snapshot: Option<String>,
    },
    /// Move a volume, with its snapshots, to another server of the fleet (one that runs
    /// `--node local`); its runs and mounts go there after. Refused while a sandbox mounts it.
    Move {
        /// The volume's name or id.
        volume: String,
        /// The server to move it to: its node's name or id (`locker fleet nodes`).
        #[arg(long)]
        to: String,
    },
    /// Read, write, list and move a volume's files (the first argument is the volume).
    #[command(subcommand, mut_subcommands(super::files::for_volume))]
    Files(FilesCmd),
}

/// Where the files routes of a volume live: `/v1/volumes/{id}`.
pub fn volume_base(volume: &str) -> String {
    format!("/v1/volumes/{}", seg(volume))
}

fn volume_table(vols: &[Value]) -> String {
    let now = now_secs();
    let rows: Vec<Vec<String>> = vols
        .iter()
        .map(|v| {
            let used = v.get("used_bytes").and_then(Value::as_u64).unwrap_or(0);
            let size = v.get("size_mb").and_then(Value::as_u64).unwrap_or(0);
            vec![
                cell(v.get("name")),
                cell(v.get("id")),
                format!("{} / {}", human_bytes(used), human_bytes(size << 20)),
                relative(
                    now,
                    v.get("created_at").and_then(Value::as_str).unwrap_or(""),
                ),
            ]
        })
        .collect();
    table(&["NAME", "ID", "USED", "CREATED"], &rows)
}

/// The fields `volume get` shows first, in this order.
const GET_ORDER: &[&str] = &["id", "name", "size", "used", "created_at"];

/// A Volume as `volume get` shows it: its size limit and use in the size style.
pub fn for_people(vol: &Value) -> Value {
    let mut v = vol.clone();
    if let Some(m) = v.as_object_mut() {
        if let Some(mb) = m.remove("size_mb").and_then(|s| s.as_u64()) {
            m.insert("size".into(), json!(human_bytes(mb << 20)));
        }
        if let Some(b) = m.remove("used_bytes").and_then(|s| s.as_u64()) {
            m.insert("used".into(), json!(human_bytes(b)));
        }
    }
    v
}

/// Runs `locker volume …`.
pub fn run(a: VolumeArgs) -> Result<i32, ClientError> {
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
        VolumeCmd::Create { name, size_mb } => {
            let mut body = json!({ "name": name });
            if let Some(s) = size_mb {
                body["size_mb"] = json!(s);
            }
            let v = c.post_json("/v1/volumes", &body)?;
            show(&v, format!("{}\n", cell(v.get("id"))))?;
        }
        VolumeCmd::List => {
            let v = c.get_json("/v1/volumes", &[])?;
            show(&v, volume_table(items(&v, "volumes")?))?;
        }
        VolumeCmd::Get { volume } => {
            let v = c.get_json(&volume_base(&volume), &[])?;
            show(&v, kv_lines(&for_people(&v), GET_ORDER, now_secs()))?;
        }
        VolumeCmd::Rm { volumes } => {
            return delete_each(&volumes, json_out, |vol| c.delete(&volume_base(vol), &[]));
        }
        VolumeCmd::Snapshot { volume } => {
            let v = c.post_json(&format!("{}/snapshots", volume_base(&volume)), &json!({}))?;
            show(&v, format!("{}\n", cell(v.get("id"))))?;
        }
        VolumeCmd::Snapshots { volume } => {
            let v = c.get_json(&format!("{}/snapshots", volume_base(&volume)), &[])?;
            let now = now_secs();
            let rows: Vec<Vec<String>> = items(&v, "snapshots")?
                .iter()
                .map(|s| {
                    vec![
                        cell(s.get("id")),
                        human_bytes(s.get("size_bytes").and_then(Value::as_u64).unwrap_or(0)),
                        relative(
                            now,
                            s.get("created_at").and_then(Value::as_str).unwrap_or(""),
                        ),
                    ]
                })
                .collect();
            show(&v, table(&["ID", "SIZE", "CREATED"], &rows))?;
        }
        VolumeCmd::SnapshotRm { volume, snapshots } => {
            return delete_each(&snapshots, json_out, |snap| {
                c.delete(
                    &format!("{}/snapshots/{}", volume_base(&volume), seg(snap)),
                    &[],
                )
            });
        }
        VolumeCmd::Restore { volume, snapshot } => {
            let v = c.post_json(
                &format!("{}/restore", volume_base(&volume)),
                &json!({ "snapshot": snapshot }),
            )?;
            show(&v, volume_table(std::slice::from_ref(&v)))?;
        }
        VolumeCmd::Fork {
            volume,
            new_name,
            snapshot,
        } => {
            let mut body = json!({ "name": new_name });
            if let Some(s) = snapshot {
                body["snapshot"] = json!(s);
            }
            let v = c.post_json(&format!("{}/fork", volume_base(&volume)), &body)?;
            show(&v, format!("{}\n", cell(v.get("id"))))?;
        }
        VolumeCmd::Move { volume, to } => {
            let v = c.post_json(
                &format!("{}/move", volume_base(&volume)),
                &json!({ "node": to }),
            )?;
            show(&v, volume_table(std::slice::from_ref(&v)))?;
        }
        VolumeCmd::Files(cmd) => return super::files::run_on(&c, json_out, cmd, volume_base),
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_volume_reads_with_sizes_for_people() {
        let v = json!({"id": "vol_1", "name": "repo", "size_mb": 10240, "used_bytes": 4096,
                       "created_at": "2026-11-30T11:00:00Z"});
        assert_eq!(
            kv_lines(&for_people(&v), GET_ORDER, 1_796_040_000),
            "id:         vol_1\n\
             name:       repo\n\
             size:       10G\n\
             used:       4.0K\n\
             created_at: 2026-11-30T11:00:00Z (60m ago)\n"
        );
    }
}
