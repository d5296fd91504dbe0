//! Issue 25's volume move (`FLEET.md` §5.3, "drain: … cold move per GiB, reported"):
//! `locker volume move` of a volume holding 256 MiB between the two servers of a fleet on
//! this host (both `--node local`, one Postgres), each move the other way, beside its peer
//! in the same run: the same amount of data through a bare `btrfs send | btrfs receive`
//! between two loop-mounted btrfs images, no Locker in between. The move's row includes
//! the API call, the copy, the catch-up under the volume's gate, the switch in the store and
//! the removal of the old copy. The same moves between two joined nodes (the split
//! layout: control relays both streams) are a row of their own.
//!
//! Owns the two servers, the database and the peer's images it makes (removed at the end,
//! also on failure).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use locker_tests::server::Server;
use serde_json::json;

use crate::stats::Row;
use crate::{check_stop, Args};

const MOVE: &str = "fleet volume move: 256 MiB volume to the other server (API call → moved)";
const RAW: &str = "btrfs send | btrfs receive: the same 256 MiB between two images, no Locker";
const PER_GIB: &str = "fleet volume move, per GiB of data (from the row above)";
const JOINED: &str =
    "fleet volume move between joined nodes: 256 MiB, relayed by control (API call → moved)";
const DATA_MB: u64 = 256;
/// The fleet CA's key is sealed with it: both servers share it.
const SECRETS_KEY: &str = "4a1c3e9a7b2d4f6081a3c5e7092b4d6f8a1c3e5079b2d4f6a8c0e2f4061b3d5e";

pub fn rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let moves = args.iterations.unwrap_or(6).clamp(2, 20);
    let (_db, url) = locker_tests::postgres::cluster().new_database();
    let replica = |name: &str| {
        Server::start_with_env(
            &[
                "--database",
                url.as_str(),
                "--fleet-listen",
                "127.0.0.1:0",
                "--node",
                "local",
                "--node-name",
                name,
                "--warm-pool",
                "0",
            ],
            &[("LOCKER_SECRETS_KEY", SECRETS_KEY)],
        )
    };
    let a = replica("bench-a");
    let _b = replica("bench-b");
    let (admin, api) = (a.admin(), a.api());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let l = admin.get("/v1/fleet/nodes").json();
        let alive = l["nodes"]
            .as_array()
            .map_or(0, |n| n.iter().filter(|n| n["alive"] == true).count());
        if alive == 2 {
            break;
        }
        if Instant::now() > deadline {
            bail!("both servers were not alive in the fleet within 30 s: {l}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    api.post(
        "/v1/volumes",
        &json!({"name": "bench-move", "size_mb": 1024}),
    )
    .expect(201, "the volume");
    fill(&api, "bench-move")?;
    let mut took = Vec::new();
    for i in 0..moves {
        check_stop()?;
        let to = if i % 2 == 0 { "bench-b" } else { "bench-a" };
        let t = Instant::now();
        api.post("/v1/volumes/bench-move/move", &json!({ "node": to }))
            .expect(200, "a move");
        took.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    api.delete("/v1/volumes/bench-move")
        .expect(204, "delete the volume");
    let joined = joined_moves(moves)?;
    let raw = bare_send_receive(moves)?;
    let per_gib: Vec<f64> = took
        .iter()
        .map(|ms| ms / 1000.0 * 1024.0 / DATA_MB as f64)
        .collect();
    rows.push(
        Row::new(MOVE, "ms", took, 0)
            .vs(RAW)
            .note(format!("{DATA_MB} MiB of random data in a 1024 MiB volume, no snapshots, idle while moved; {moves} moves, alternating direction")),
    );
    rows.push(Row::new(RAW, "ms", raw, 0).note(
        "two 1024 MiB btrfs images on loop devices; a read-only snapshot of the source, then `btrfs send | btrfs receive` (the receiving subvolume removed after each)",
    ));
    rows.push(Row::new(PER_GIB, "s", per_gib, 0));
    rows.push(
        Row::new(JOINED, "ms", joined, 0)
            .vs(RAW)
            .note(format!("the same volume between two `locker node`s in network namespaces of this host, joined to a control plane that is no node (the split layout): both btrfs streams go home → control → target over the nodes' mutual-TLS HTTP/2; {moves} moves, alternating direction")),
    );
    Ok(())
}

/// Volume `name` filled with [`DATA_MB`] of random data by a run.
fn fill(api: &locker_tests::server::Api, name: &str) -> anyhow::Result<()> {
    let filled = api
        .post(
            &format!("/v1/volumes/{name}/run"),
            &json!({"shell": format!("head -c {DATA_MB}M /dev/urandom > /workspace/blob"), "timeout_ms": 120000}),
        )
        .expect(200, "fill the volume");
    if filled["exit_code"] != 0 {
        bail!("filling the volume failed: {filled}");
    }
    Ok(())
}

/// `n` moves of a volume holding [`DATA_MB`] between two joined nodes, alternating.
fn joined_moves(n: usize) -> anyhow::Result<Vec<f64>> {
    let fab = locker_tests::fabric::Fabric::new(2);
    let srv = crate::fleet::control_server(&fab)?;
    let (admin, api) = (srv.admin(), srv.api());
    let mut nodes = locker_tests::fabric::join_nodes(&fab, &admin, &["vol-a", "vol-b"], 2);
    let made = api.post(
        "/v1/volumes",
        &json!({"name": "bench-joined", "size_mb": 1024}),
    );
    if made.status != 201 {
        bail!("a volume on a joined node: {}", made.text());
    }
    fill(&api, "bench-joined")?;
    let home = made
        .headers
        .get("x-locker-node")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("vol-a")
        .to_owned();
    let mut took = Vec::new();
    for i in 0..n {
        check_stop()?;
        let to = match (i % 2 == 0, home == "vol-a") {
            (true, true) | (false, false) => "vol-b",
            _ => "vol-a",
        };
        let t = Instant::now();
        api.post("/v1/volumes/bench-joined/move", &json!({ "node": to }))
            .expect(200, "a move between joined nodes");
        took.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    api.delete("/v1/volumes/bench-joined")
        .expect(204, "delete the volume");
    for node in &mut nodes {
        node.stop();
    }
    Ok(took)
}

/// Loop-mounted btrfs images for the peer, unmounted and removed on drop.
struct Images {
    dir: PathBuf,
    mounts: Vec<PathBuf>,
}

impl Drop for Images {
    fn drop(&mut self) {
        for m in &self.mounts {
            let _ = Command::new("umount").arg(m).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn sh(cmd: &str) -> anyhow::Result<()> {
    let out = Command::new("sh").args(["-c", cmd]).output()?;
    if !out.status.success() {
        bail!(
            "`{cmd}` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The peer: `n` times a snapshot of the source image sent and received into the other.
fn bare_send_receive(n: usize) -> anyhow::Result<Vec<f64>> {
    let dir = std::env::temp_dir().join(format!("locker-bench-btrfs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let mut images = Images {
        dir: dir.clone(),
        mounts: Vec::new(),
    };
    let mount = |name: &str, images: &mut Images| -> anyhow::Result<PathBuf> {
        let (img, at) = (dir.join(format!("{name}.img")), dir.join(name));
        std::fs::File::create(&img)?.set_len(1024 << 20)?;
        std::fs::create_dir_all(&at)?;
        sh(&format!("mkfs.btrfs -q -f {}", img.display())).context("mkfs.btrfs")?;
        sh(&format!("mount -o loop {} {}", img.display(), at.display()))?;
        images.mounts.push(at.clone());
        Ok(at)
    };
    let (from, to) = (mount("from", &mut images)?, mount("to", &mut images)?);
    std::fs::create_dir_all(from.join("live"))?;
    std::fs::create_dir_all(from.join("snapshots"))?;
    sh(&format!(
        "head -c {DATA_MB}M /dev/urandom > {}",
        from.join("live/blob").display()
    ))?;
    let mut took = Vec::new();
    for i in 0..n {
        check_stop()?;
        let snap: PathBuf = from.join("snapshots").join(format!("p{i}"));
        sh(&format!(
            "btrfs -q subvolume snapshot -r {} {}",
            from.display(),
            snap.display()
        ))?;
        let t = Instant::now();
        sh(&format!(
            "btrfs -q send {} | btrfs -q receive {}",
            snap.display(),
            to.display()
        ))?;
        took.push(t.elapsed().as_secs_f64() * 1000.0);
        remove_subvolume(&to.join(format!("p{i}")))?;
        remove_subvolume(&snap)?;
    }
    drop(images);
    Ok(took)
}

fn remove_subvolume(p: &Path) -> anyhow::Result<()> {
    sh(&format!("btrfs -q subvolume delete {}", p.display()))
}
