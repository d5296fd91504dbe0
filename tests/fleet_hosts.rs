//! Fleet mode, "several identical hosts" (issue 25, `FLEET.md` §4.3): every host runs
//! `locker serve --database <one Postgres> --fleet-listen … --node local`. Each replica is a
//! control plane and a node at once: creates through either are placed on either; every
//! call about a sandbox reaches the replica whose engine runs it (through that replica's
//! node listener); lists and quotas count each sandbox once; a restarted replica adopts
//! only its own machines; one replica leads (sweeps leases) at a time, and when the leader
//! dies the other takes over and declares it dead; when the dead one comes back it fences
//! (destroys what the fleet marked lost) before it answers.

use std::collections::HashMap;
use std::time::Duration;

use locker_tests::fleet::{drained, listed_ids, placed_node, rows};
use locker_tests::postgres::cluster;
use locker_tests::server::{Api, Resp, Server};
use locker_tests::streams::{read_exit_frame, read_until, ws_connect};
use locker_tests::wait_for;
use serde_json::json;

/// The secrets key both replicas share (the fleet CA's key is sealed with it).
const SECRETS_KEY: &str = "5f1c3e9a7b2d4f6081a3c5e7092b4d6f8a1c3e5079b2d4f6a8c0e2f4061b3d5e";

fn replica(url: &str, name: &str) -> Server {
    replica_with(url, name, &[])
}

/// [`replica`] with more arguments.
fn replica_with(url: &str, name: &str, extra: &[&str]) -> Server {
    let mut args = vec![
        "--database",
        url,
        "--fleet-listen",
        "127.0.0.1:0",
        "--node",
        "local",
        "--node-name",
        name,
        "--node-slots",
        "3",
    ];
    args.extend_from_slice(extra);
    Server::start_with_env(&args, &[("LOCKER_SECRETS_KEY", SECRETS_KEY)])
}

fn nodes(admin: &Api) -> Vec<serde_json::Value> {
    let l = admin.get("/v1/fleet/nodes").expect(200, "fleet nodes");
    l["nodes"].as_array().unwrap().clone()
}

fn alive(admin: &Api, name: &str) -> Option<serde_json::Value> {
    nodes(admin)
        .into_iter()
        .find(|n| n["name"] == name && n["alive"] == true)
}

fn create(api: &Api) -> Resp {
    api.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256}),
    )
}

#[test]
fn identical_hosts_place_route_and_take_over_from_each_other() {
    let (_db, url) = cluster().new_database();
    let mut a = replica(&url, "host-a");
    let b = replica(&url, "host-b");
    let (api_a, api_b) = (a.api(), b.api());
    // One tenant, one key: keys live in the shared store.
    let api_b = api_b.with_key(api_a.key());
    wait_for(Duration::from_secs(15), "both hosts alive", || {
        (alive(&a.admin(), "host-a").is_some() && alive(&a.admin(), "host-b").is_some())
            .then_some(())
    });

    // Six creates, alternating replicas, fill both hosts (3 slots each); a seventh is
    // refused. Every sandbox is placed, on either host.
    let mut on: HashMap<String, String> = HashMap::new();
    for i in 0..6 {
        let api = if i % 2 == 0 { &api_a } else { &api_b };
        let r = create(api);
        assert_eq!(r.status, 201, "create {i}: {}", r.text());
        let node = r.headers["x-locker-node"].to_str().unwrap().to_owned();
        on.insert(r.json()["id"].as_str().unwrap().to_owned(), node);
    }
    let mut per: HashMap<&str, usize> = HashMap::new();
    for n in on.values() {
        *per.entry(n.as_str()).or_default() += 1;
    }
    assert_eq!(
        (per.get("host-a"), per.get("host-b")),
        (Some(&3), Some(&3)),
        "{on:?}"
    );
    let full = create(&api_b);
    assert_eq!(full.status, 429, "{}", full.text());

    // Every call reaches the owner whichever replica it enters: a file written through one
    // replica reads back through the other, exec answers through both, and each machine
    // lives in its own host's data dir only.
    for (id, node) in &on {
        let (owner, other) = if node == "host-a" { (&a, &b) } else { (&b, &a) };
        assert!(
            owner.sandboxes_dir().join(id).exists(),
            "{id} not on {node}"
        );
        assert!(!other.sandboxes_dir().join(id).exists(), "{id} on both");
        let body = format!("{id} lives on {node}");
        api_a
            .put(
                &format!("/v1/sandboxes/{id}/files?path=/tmp/owner.txt"),
                body.as_bytes(),
            )
            .expect(200, "write through a");
        assert_eq!(api_b.read_file(id, "/tmp/owner.txt").text(), body);
        for api in [&api_a, &api_b] {
            assert_eq!(api.sh(id, "cat /tmp/owner.txt"), body);
            let v = api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get");
            assert_eq!(v["state"], "running", "{v}");
        }
    }
    // The terminal (a WebSocket) too: opened through either replica, it is the owner's shell,
    // typed input and all, and ends with the shell's exit.
    for (id, node) in on.iter().take(2) {
        for srv in [&a, &b] {
            let mut ws = ws_connect(&srv.url, api_a.key(), &format!("/v1/sandboxes/{id}/pty"))
                .unwrap_or_else(|(s, e)| panic!("terminal of {id} through {}: {s} {e}", srv.url));
            let mut seen = String::new();
            ws.send(tungstenite::Message::binary(
                b"echo hi-$((40+2)); cat /tmp/owner.txt; echo\n".to_vec(),
            ))
            .unwrap();
            read_until(&mut ws, "hi-42", &mut seen);
            read_until(&mut ws, &format!("lives on {node}"), &mut seen);
            ws.send(tungstenite::Message::binary(b"exit 3\n".to_vec()))
                .unwrap();
            let exit = read_exit_frame(&mut ws, &mut seen);
            assert_eq!(exit["exit_code"], 3, "{exit}");
        }
    }

    // Each replica lists the six exactly once.
    for api in [&api_a, &api_b] {
        let list = api.get("/v1/sandboxes").expect(200, "list");
        let mut ids: Vec<&str> = list["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        ids.sort_unstable();
        let mut want: Vec<&str> = on.keys().map(String::as_str).collect();
        want.sort_unstable();
        assert_eq!(ids, want, "{list}");
        assert_eq!(list["total"], 6, "{list}");
    }

    // A delete through the other replica frees the owner's slot: the next create fits.
    let gone = delete_one_on(&api_b, &mut on, "host-a", "delete through b");
    let gone_node = "host-a".to_owned();
    assert!(!a.sandboxes_dir().join(&gone).exists());
    let again = wait_for(Duration::from_secs(10), "a slot free again", || {
        let r = create(&api_b);
        (r.status == 201).then_some(r)
    });
    let node = again.headers["x-locker-node"].to_str().unwrap().to_owned();
    assert_eq!(node, gone_node);
    on.insert(again.json()["id"].as_str().unwrap().to_owned(), node);

    // A volume lives where it was made (host-a): every call about it through b reaches a
    // (files, a serverless run), b lists it with its node, and a sandbox that mounts it is
    // placed on host-a whichever replica asked.
    delete_one_on(&api_b, &mut on, "host-a", "make room on host-a");
    api_a
        .post("/v1/volumes", &json!({"name": "shared", "size_mb": 64}))
        .expect(201, "a volume on host-a");
    api_b
        .put(
            "/v1/volumes/shared/files?path=%2Fdata.txt",
            &b"made through b\n"[..],
        )
        .expect(200, "write a's volume through b");
    assert_eq!(
        api_a
            .get("/v1/volumes/shared/files?path=%2Fdata.txt")
            .text(),
        "made through b\n"
    );
    let ran = api_b
        .post(
            "/v1/volumes/shared/run",
            &json!({"shell": "cat /workspace/data.txt; echo ran >> /workspace/data.txt"}),
        )
        .expect(200, "a run on a's volume through b");
    assert_eq!(ran["stdout"], "made through b\n", "{ran}");
    assert_eq!(
        api_a
            .get("/v1/volumes/shared/files?path=%2Fdata.txt")
            .text(),
        "made through b\nran\n"
    );
    let listed = api_b.get("/v1/volumes").expect(200, "volumes through b");
    let v = listed["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "shared")
        .unwrap_or_else(|| panic!("b does not list a's volume: {listed}"));
    assert!(v["node"].as_str().unwrap().starts_with("node_"), "{v}");
    // Its home names itself the same: every view of a volume says where it lives.
    let home = api_a
        .get("/v1/volumes/shared")
        .expect(200, "the volume on its home");
    assert_eq!(home["node"], v["node"], "{home}");
    let with = jail_mounting(&api_b, "shared", "/mnt/v", "host-a");
    assert!(a.sandboxes_dir().join(&with).exists());
    assert_eq!(
        api_b.sh(&with, "cat /mnt/v/data.txt"),
        "made through b\nran\n"
    );
    let busy = api_a.post("/v1/volumes/shared/move", &json!({"node": "host-b"}));
    assert_eq!(busy.status, 409, "moved while mounted: {}", busy.text());
    assert!(busy.text().contains(&with), "{}", busy.text());
    api_b
        .delete(&format!("/v1/sandboxes/{with}"))
        .expect(204, "delete the sandbox with the volume");

    // `locker volume move`: the volume, its snapshots with it, goes to host-b; its files
    // read back byte for byte through both replicas; runs, mounts and the files API go
    // there after, and nothing of it stays on host-a. Then back to host-a.
    let vol_id = api_a.get("/v1/volumes/shared").expect(200, "the volume")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let snap = api_b
        .post("/v1/volumes/shared/snapshots", &json!({}))
        .expect(201, "a snapshot of a's volume through b")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let blob: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    api_a
        .put("/v1/volumes/shared/files?path=%2Fblob.bin", &blob[..])
        .expect(200, "a blob on a's volume");
    for (bad, status) in [
        (json!({"node": "nowhere"}), 404),
        (json!({"node": "host-b", "when": "now"}), 400),
        (json!({}), 400),
    ] {
        let r = api_b.post("/v1/volumes/shared/move", &bad);
        assert_eq!(r.status, status, "{bad}: {}", r.text());
    }
    let volumes_of = |s: &Server| s.data_dir.join("volumes").join(&vol_id);
    let moved = api_a
        .post("/v1/volumes/shared/move", &json!({"node": "host-b"}))
        .expect(200, "move a's volume to host-b");
    let b_node = alive(&a.admin(), "host-b").unwrap()["id"].clone();
    assert_eq!(moved["node"], b_node, "{moved}");
    assert!(volumes_of(&b).join("disk.img").exists());
    assert!(
        !volumes_of(&a).exists(),
        "host-a keeps the moved volume's files"
    );
    for api in [&api_a, &api_b] {
        let got = api.get("/v1/volumes/shared/files?path=%2Fblob.bin");
        assert_eq!(got.status, 200);
        assert!(got.body == blob, "the blob differs after the move");
        assert_eq!(
            api.get("/v1/volumes/shared/files?path=%2Fdata.txt").text(),
            "made through b\nran\n"
        );
    }
    delete_one_on(&api_a, &mut on, "host-b", "make room on host-b");
    let ran = api_a
        .post(
            "/v1/volumes/shared/run",
            &json!({"shell": "echo moved >> /workspace/data.txt; cat /workspace/data.txt"}),
        )
        .expect(200, "a run on the moved volume through a");
    assert_eq!(ran["stdout"], "made through b\nran\nmoved\n", "{ran}");
    let r = api_a.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256,
                "volumes": [{"volume": "shared", "path": "/mnt/v"}]}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.headers["x-locker-node"], "host-b");
    let with = r.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(api_a.sh(&with, "tail -n1 /mnt/v/data.txt"), "moved\n");
    api_a
        .delete(&format!("/v1/sandboxes/{with}"))
        .expect(204, "delete the sandbox on the moved volume");
    settle(&api_b, create(&api_b), &mut on);
    // The snapshot came along: listed, and restorable on host-b.
    let snaps = api_b
        .get("/v1/volumes/shared/snapshots")
        .expect(200, "snapshots");
    assert_eq!(snaps["snapshots"][0]["id"], snap.as_str(), "{snaps}");
    api_a
        .post("/v1/volumes/shared/restore", &json!({"snapshot": snap}))
        .expect(200, "restore the moved snapshot");
    assert_eq!(
        api_b
            .get("/v1/volumes/shared/files?path=%2Fblob.bin")
            .status,
        404,
        "the snapshot was taken before the blob"
    );
    // And home again, through b: the same content on host-a, nothing left on host-b.
    api_b
        .post("/v1/volumes/shared/move", &json!({"node": "host-a"}))
        .expect(200, "move the volume back to host-a");
    assert!(volumes_of(&a).join("disk.img").exists());
    assert!(
        !volumes_of(&b).exists(),
        "host-b keeps the moved volume's files"
    );
    assert_eq!(
        api_b
            .get("/v1/volumes/shared/files?path=%2Fdata.txt")
            .text(),
        "made through b\nran\n"
    );
    api_b
        .delete("/v1/volumes/shared")
        .expect(204, "delete a's volume through b");
    assert_eq!(api_a.get("/v1/volumes/shared").status, 404);
    settle(&api_a, create(&api_a), &mut on);

    // A snapshot of a sandbox on host-a, taken through b, stays on a; a fork through b is
    // placed on a (its parent's host) and answers through both; a sandbox from the
    // snapshot, made through b, goes to a; the snapshot is deleted through b, on a.
    delete_one_on(&api_b, &mut on, "host-a", "make room on host-a again");
    let src = on
        .iter()
        .find(|(_, n)| *n == "host-a")
        .map(|(i, _)| i.clone())
        .unwrap();
    api_a.sh(&src, "echo the point of $HOSTNAME > /root/point");
    let point = api_a.sh(&src, "cat /root/point");
    let snap = api_b
        .post(&format!("/v1/sandboxes/{src}/snapshots"), &json!({}))
        .expect(201, "a snapshot through b of a sandbox on a");
    let snap = snap["id"].as_str().unwrap().to_owned();
    let a_snaps = a.sandboxes_dir().parent().unwrap().join("snapshots");
    let b_snaps = b.sandboxes_dir().parent().unwrap().join("snapshots");
    assert!(a_snaps.join(&snap).is_dir() && !b_snaps.join(&snap).exists());
    for api in [&api_a, &api_b] {
        let l = api.get("/v1/snapshots").expect(200, "snapshots");
        assert_eq!(l["snapshots"].as_array().unwrap().len(), 1, "{l}");
    }
    let forked = api_b
        .post(&format!("/v1/sandboxes/{src}/fork"), &json!({"count": 1}))
        .expect(201, "a fork through b of a sandbox on a");
    let child = forked["sandboxes"][0]["id"].as_str().unwrap().to_owned();
    assert!(a.sandboxes_dir().join(&child).exists(), "{forked}");
    for api in [&api_a, &api_b] {
        assert_eq!(api.sh(&child, "cat /root/point"), point);
    }
    assert_eq!(api_a.get("/v1/sandboxes").json()["total"], 6);
    api_a
        .delete(&format!("/v1/sandboxes/{child}"))
        .expect(204, "delete the child through a");
    // E2B's fork through a of its own sandbox: the child is placed, so b reaches it.
    let r = api_a.with_key(None).request(
        "POST",
        &format!("/sandboxes/{src}/fork"),
        &[
            ("X-API-KEY", api_a.key().unwrap()),
            ("Content-Type", "application/json"),
        ],
        "{}",
    );
    assert_eq!(r.status, 201, "E2B's fork: {}", r.text());
    let child = r.json()[0]["sandbox"]["sandboxID"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(api_b.sh(&child, "cat /root/point"), point);
    api_b
        .delete(&format!("/v1/sandboxes/{child}"))
        .expect(204, "delete E2B's child through b");
    let r = api_b.post(
        "/v1/sandboxes",
        &json!({"from_snapshot": snap, "ttl_s": 900}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.headers["x-locker-node"], "host-a");
    let from = r.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(api_b.sh(&from, "cat /root/point"), point);
    on.insert(from, "host-a".to_owned());
    api_b
        .delete(&format!("/v1/snapshots/{snap}"))
        .expect(204, "delete a's snapshot through b");
    assert!(!a_snaps.join(&snap).exists());
    assert_eq!(api_a.get("/v1/snapshots").json()["snapshots"], json!([]));

    // A restarts (an upgrade): it adopts its own three machines, never b's, and every
    // sandbox answers through both replicas afterwards.
    a.restart();
    let api_a = a.api().with_key(api_b.key());
    for (id, node) in &on {
        for api in [&api_a, &api_b] {
            let out = wait_for(Duration::from_secs(15), "answers after a's restart", || {
                let r = api.post(
                    &format!("/v1/sandboxes/{id}/exec"),
                    &json!({"shell": "cat /tmp/owner.txt 2>/dev/null || echo new"}),
                );
                (r.status == 200).then(|| r.json()["stdout"].as_str().unwrap_or("").to_owned())
            });
            assert!(
                out.contains(node.as_str()) || out.trim() == "new",
                "{id}: {out}"
            );
        }
    }
    let log = a.log_text();
    let adopted = log.matches("adopted a sandbox").count();
    assert_eq!(adopted, 3, "a adopted {adopted} sandboxes:\n{log}");

    // A's server dies (SIGKILL; its machines stay, unreachable). B leads now: within the
    // lease and its grace it declares host-a dead; a's sandboxes read lost through b, and
    // b's own keep answering.
    a.kill9();
    let lost: Vec<&String> = on
        .iter()
        .filter(|(_, n)| *n == "host-a")
        .map(|(i, _)| i)
        .collect();
    wait_for(Duration::from_secs(20), "host-a declared dead by b", || {
        nodes(&b.admin())
            .iter()
            .any(|n| n["name"] == "host-a" && n["state"] == "dead")
            .then_some(())
    });
    for id in &lost {
        let v = api_b
            .get(&format!("/v1/sandboxes/{id}"))
            .expect(200, "get lost");
        assert_eq!(v["state"], "lost", "{v}");
    }
    for (id, n) in &on {
        if n == "host-b" {
            assert_eq!(
                api_b.sh(id, "cat /tmp/owner.txt"),
                format!("{id} lives on host-b")
            );
        }
    }

    // A comes back (its machines still run): it fences as a joined node does. The sandboxes
    // the fleet marked lost are destroyed before it answers, never served again through a,
    // and read `lost` through both replicas; b's answer through a.
    for id in &lost {
        assert!(
            a.machine_dir(id).exists(),
            "{id}'s machine went with a's server"
        );
    }
    a.restart();
    let api_a = a.api().with_key(api_b.key());
    for id in &lost {
        assert!(
            !a.machine_dir(id).exists(),
            "{id}, lost, still has its machine on a after a's return:\n{}",
            a.log_text()
        );
        for api in [&api_a, &api_b] {
            let v = api
                .get(&format!("/v1/sandboxes/{id}"))
                .expect(200, "get lost after a's return");
            assert_eq!(v["state"], "lost", "{v}");
            let r = api.post(
                &format!("/v1/sandboxes/{id}/exec"),
                &json!({"shell": "true"}),
            );
            assert_eq!(r.status, 410, "{id} served after it was lost: {}", r.text());
        }
    }
    assert!(
        a.log_text()
            .contains("fenced: destroyed this server's sandboxes"),
        "{}",
        a.log_text()
    );
    for (id, n) in &on {
        if n == "host-b" {
            assert_eq!(
                api_a.sh(id, "cat /tmp/owner.txt"),
                format!("{id} lives on host-b")
            );
        }
    }
    for id in on.keys() {
        let _ = api_b.delete(&format!("/v1/sandboxes/{id}"));
    }
}

/// Deletes, through `api`, one of the sandboxes `on` (id → node) says runs on `node`, and
/// forgets it there; its id.
/// A sandbox just made (`made`, 201) joins `on`, with the owner file every sandbox there
/// has.
fn settle(api: &Api, made: Resp, on: &mut HashMap<String, String>) {
    assert_eq!(made.status, 201, "{}", made.text());
    let (id, node) = (
        made.json()["id"].as_str().unwrap().to_owned(),
        made.headers["x-locker-node"].to_str().unwrap().to_owned(),
    );
    api.put(
        &format!("/v1/sandboxes/{id}/files?path=/tmp/owner.txt"),
        format!("{id} lives on {node}").as_bytes(),
    )
    .expect(200, "the owner file");
    on.insert(id, node);
}

fn delete_one_on(api: &Api, on: &mut HashMap<String, String>, node: &str, what: &str) -> String {
    let gone = on
        .iter()
        .find(|(_, n)| *n == node)
        .map(|(i, _)| i.clone())
        .unwrap();
    api.delete(&format!("/v1/sandboxes/{gone}"))
        .expect(204, what);
    on.remove(&gone);
    gone
}

/// `locker volume move` while the volume is written through the other replica all along:
/// each move goes through (the bulk copied while writes go on, the rest under the
/// volume's gate), every write that was answered 200 reads back afterwards wherever the
/// volume went, a write refused meanwhile says to call again, and only the volume's home
/// holds its files.
#[test]
fn a_volume_moved_while_written_keeps_every_acknowledged_write() {
    let (_db, url) = cluster().new_database();
    let a = replica(&url, "host-a");
    let b = replica(&url, "host-b");
    let api_a = a.api();
    let api_b = b.api().with_key(api_a.key());
    wait_for(Duration::from_secs(15), "both hosts alive", || {
        (alive(&a.admin(), "host-a").is_some() && alive(&a.admin(), "host-b").is_some())
            .then_some(())
    });
    let vol = api_a
        .post("/v1/volumes", &json!({"name": "busy", "size_mb": 64}))
        .expect(201, "a volume on host-a")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (api, stop) = (api_b.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut acked, mut refused) = (Vec::new(), Vec::new());
            let mut i = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let body = format!("write {i}\n").repeat(1 + (i as usize % 50));
                let r = api.put(
                    &format!("/v1/volumes/busy/files?path=%2Fw%2F{i}.txt"),
                    body.as_bytes(),
                );
                if r.status == 200 {
                    acked.push((i, body));
                } else {
                    refused.push((i, r.status, r.text()));
                }
                i += 1;
            }
            (acked, refused)
        })
    };
    // And snapshots of it taken all along: each one answered 201 is kept, wherever the
    // volume goes (a move during which one is made is refused, to be tried again).
    let snapshotter = {
        let (api, stop) = (api_a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut made = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && made.len() < 12 {
                let r = api.post("/v1/volumes/busy/snapshots", &json!({}));
                if r.status == 201 {
                    made.push(r.json()["id"].as_str().unwrap().to_owned());
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            made
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let mut homes = vec!["host-a"];
    for to in ["host-b", "host-a", "host-b"] {
        let t = std::time::Instant::now();
        let mut tries = 0;
        loop {
            tries += 1;
            let r = api_a.post("/v1/volumes/busy/move", &json!({"node": to}));
            if r.status == 200 {
                break;
            }
            assert!(
                r.status == 409 && r.text().contains("snapshots changed") && tries < 30,
                "a move while written: {} {}",
                r.status,
                r.text()
            );
        }
        eprintln!("moved to {to} in {:?} ({tries} tries)", t.elapsed());
        homes.push(to);
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (acked, refused) = writer.join().unwrap();
    let snapshots = snapshotter.join().unwrap();
    let listed = api_b
        .get("/v1/volumes/busy/snapshots")
        .expect(200, "the volume's snapshots");
    let mut listed: Vec<String> = listed["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    listed.sort();
    let mut made = snapshots.clone();
    made.sort();
    assert!(made.len() > 3, "snapshots made: {made:?}");
    assert_eq!(listed, made, "every snapshot answered 201 is kept");
    eprintln!(
        "moves that switched: {:?}; writes acknowledged {}, refused {}: {:?}",
        &homes[1..],
        acked.len(),
        refused.len(),
        refused.iter().take(5).collect::<Vec<_>>()
    );
    assert!(acked.len() > 20, "the writer hardly wrote: {}", acked.len());
    for (_, status, text) in &refused {
        assert!(
            (*status == 503 && text.contains("call again")) || *status == 404,
            "a write during a move answered {status}: {text}"
        );
    }
    for api in [&api_a, &api_b] {
        for (i, body) in &acked {
            let got = api.get(&format!("/v1/volumes/busy/files?path=%2Fw%2F{i}.txt"));
            assert_eq!(
                got.status,
                200,
                "acknowledged write {i} lost: {}",
                got.text()
            );
            assert_eq!(&got.text(), body, "acknowledged write {i} differs");
        }
    }
    let home = *homes.last().unwrap();
    let (here, other) = if home == "host-a" { (&a, &b) } else { (&b, &a) };
    assert!(here
        .data_dir
        .join("volumes")
        .join(&vol)
        .join("disk.img")
        .exists());
    assert!(
        !other.data_dir.join("volumes").join(&vol).exists(),
        "{home} is the home, yet the other host keeps a copy"
    );
    // Each snapshot's files came along: the first one restored is the volume as it was.
    let first = api_b
        .post(
            "/v1/volumes/busy/restore",
            &json!({"snapshot": snapshots[0]}),
        )
        .expect(200, "restore the first snapshot after the moves");
    assert!(first["used_bytes"].as_u64().is_some(), "{first}");
    let last = snapshots.last().unwrap();
    api_a
        .post("/v1/volumes/busy/restore", &json!({"snapshot": last}))
        .expect(200, "restore the last snapshot after the moves");
    api_b
        .delete("/v1/volumes/busy")
        .expect(204, "delete the volume");
}

/// The name of the node a placement in `db` names for sandbox `id`, and how many rows of
/// the fleet's store the sandbox has (a drained host's row goes, the new host's comes).
fn placed_in(db: &str, id: &str) -> (String, usize) {
    let sandbox_rows = rows(db, &format!("SELECT id FROM sandboxes WHERE id = '{id}'"));
    (placed_node(db, id), sandbox_rows.len())
}

/// A sandbox made through `api` from `body`, on host `node` (the other host, `other`,
/// cordoned meanwhile through `admin`): its id.
fn made_on(api: &Api, admin: &Api, node: &str, other: &str, body: &serde_json::Value) -> String {
    admin
        .post(&format!("/v1/fleet/nodes/{other}/cordon"), &json!({}))
        .expect(200, "cordon");
    let made = api.post("/v1/sandboxes", body);
    admin
        .post(&format!("/v1/fleet/nodes/{other}/uncordon"), &json!({}))
        .expect(200, "uncordon");
    assert_eq!(made.status, 201, "{}", made.text());
    assert_eq!(made.headers["x-locker-node"], node, "{}", made.text());
    made.json()["id"].as_str().unwrap().to_owned()
}

/// A jail made through `api` that mounts `volume` at `path`, placed on `node` (the
/// volume's home): its id.
fn jail_mounting(api: &Api, volume: &str, path: &str, node: &str) -> String {
    let r = api.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256,
                "volumes": [{"volume": volume, "path": path}]}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.headers["x-locker-node"], node);
    r.json()["id"].as_str().unwrap().to_owned()
}

/// A host drained (`locker fleet drain host-a`, `FLEET.md` §4.7) in the identical-hosts
/// layout: every sandbox it runs moves to the other host under its own id with the files on
/// its disk; a jail that mounts a volume takes the volume along; the host's other volume
/// moves too; calls through either replica reach them on the new host; each is listed
/// once; the old host keeps nothing; and they come back when the other host is drained.
#[test]
fn a_drained_host_hands_its_sandboxes_and_volumes_to_the_other() {
    let (db, url) = cluster().new_database();
    let a = replica(&url, "host-a");
    let b = replica(&url, "host-b");
    let admin = a.admin();
    let api_a = a.api();
    let api_b = b.api().with_key(api_a.key());
    wait_for(Duration::from_secs(15), "both hosts alive", || {
        (alive(&admin, "host-a").is_some() && alive(&admin, "host-b").is_some()).then_some(())
    });
    // Everything on host-a (host-b cordoned meanwhile): two volumes, a jail with files on
    // its disk, a jail that mounts one of the volumes.
    admin
        .post("/v1/fleet/nodes/host-b/cordon", &json!({}))
        .expect(200, "cordon host-b");
    for name in ["mounted", "spare"] {
        let v = api_a.post("/v1/volumes", &json!({"name": name, "size_mb": 64}));
        assert_eq!(v.status, 201, "{}", v.text());
        api_a
            .put(
                &format!("/v1/volumes/{name}/files?path=%2Fv.txt"),
                format!("{name} volume").as_bytes(),
            )
            .expect(200, "write a volume");
    }
    let plain = create(&api_b);
    assert_eq!(plain.status, 201, "{}", plain.text());
    assert_eq!(plain.headers["x-locker-node"], "host-a");
    let plain = plain.json()["id"].as_str().unwrap().to_owned();
    let mounting = jail_mounting(&api_a, "mounted", "/data", "host-a");
    api_a.sh(&plain, "echo kept > /home/user/note && sync");
    api_b.sh(&mounting, "echo from-the-jail > /data/j.txt && sync");
    let before = api_a.get(&format!("/v1/sandboxes/{plain}")).json();
    admin
        .post("/v1/fleet/nodes/host-b/uncordon", &json!({}))
        .expect(200, "uncordon host-b");

    // Drained through the other replica: both sandboxes and both volumes go to host-b.
    let report = drained(&b.admin(), "host-a", 2);
    eprintln!("{report:#}");
    assert_eq!(report["failed"], json!([]), "{report}");
    assert_eq!(report["left"], 0, "{report}");
    assert!(
        report["moved"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["to_name"] == "host-b"),
        "{report}"
    );
    // The mounted volume went with its jail; the spare one after the sandboxes.
    let vols = &report["volumes"];
    assert_eq!(vols["failed"], json!([]), "{report}");
    assert_eq!(vols["moved"].as_array().map(Vec::len), Some(1), "{report}");
    assert_eq!(vols["moved"][0]["name"], "spare", "{report}");
    for id in [&plain, &mounting] {
        assert_eq!(placed_in(&db, id), ("host-b".to_owned(), 1), "{id}");
        assert!(b.sandboxes_dir().join(id).exists(), "{id} not on host-b");
        assert!(!a.sandboxes_dir().join(id).exists(), "{id} left on host-a");
    }
    let after = api_a.get(&format!("/v1/sandboxes/{plain}")).json();
    for k in [
        "id",
        "created_at",
        "expires_at",
        "preview_token",
        "template_digest",
    ] {
        assert_eq!(after[k], before[k], "{k} after the move: {after}");
    }
    for api in [&api_a, &api_b] {
        assert_eq!(api.sh(&plain, "cat /home/user/note"), "kept\n");
        assert_eq!(
            api.sh(&mounting, "cat /data/j.txt /data/v.txt"),
            "from-the-jail\nmounted volume"
        );
        assert_eq!(
            api.get("/v1/volumes/spare/files?path=%2Fv.txt").text(),
            "spare volume"
        );
        let mut want = vec![plain.clone(), mounting.clone()];
        want.sort();
        assert_eq!(listed_ids(api), want, "each listed once");
    }
    for name in ["mounted", "spare"] {
        let v = api_a
            .get(&format!("/v1/volumes/{name}"))
            .expect(200, "volume");
        let id = v["id"].as_str().unwrap();
        assert!(
            b.data_dir.join("volumes").join(id).exists(),
            "{name} not on host-b"
        );
        assert!(
            !a.data_dir.join("volumes").join(id).exists(),
            "{name} left on host-a"
        );
    }

    // Back: host-a open again, host-b drained.
    admin
        .post("/v1/fleet/nodes/host-a/uncordon", &json!({}))
        .expect(200, "uncordon host-a");
    drained(&admin, "host-b", 2);
    for id in [&plain, &mounting] {
        assert_eq!(placed_in(&db, id), ("host-a".to_owned(), 1), "{id}");
    }
    assert_eq!(api_b.sh(&plain, "cat /home/user/note"), "kept\n");
    api_a.sh(&mounting, "echo back >> /data/j.txt");
    assert_eq!(
        api_b.sh(&mounting, "cat /data/j.txt"),
        "from-the-jail\nback\n"
    );
    for id in [&plain, &mounting] {
        api_b
            .delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete after the moves");
    }
    for name in ["mounted", "spare"] {
        api_a
            .delete(&format!("/v1/volumes/{name}"))
            .expect(204, "delete a volume");
    }
}

/// A host that dies (its server and machines) has its sandbox started again on the other
/// host from its last snapshot in the snapshot store both share (`--snapshot-store`): under
/// its id, with the snapshot's files and not what was written after; its row in the
/// fleet's store becomes the new host's. When the dead host comes back it adopts nothing of
/// it and writes nothing of it, and the sandbox answers from its new host through both
/// replicas. A sandbox of the dead host whose TTL passes meanwhile is ended by the other
/// (its record and placement; its machine died with the host).
#[test]
fn a_dead_hosts_sandbox_restarts_on_the_other_from_its_last_snapshot() {
    let (db, url) = cluster().new_database();
    let kept = locker_tests::TempDir::new("locker-snapshot-store");
    let store = kept.path().display().to_string();
    let extra = ["--snapshot-store", store.as_str()];
    let mut a = replica_with(&url, "host-a", &extra);
    let mut b = replica_with(&url, "host-b", &extra);
    wait_for(Duration::from_secs(15), "both hosts alive", || {
        (alive(&a.admin(), "host-a").is_some() && alive(&a.admin(), "host-b").is_some())
            .then_some(())
    });
    // The leader sweeps leases; the other host is the one that dies.
    let a_leads = a.log_text().contains("this replica leads the fleet");
    let leader = if a_leads { &a } else { &b };
    let (lname, vname) = if a_leads {
        ("host-a", "host-b")
    } else {
        ("host-b", "host-a")
    };
    let api = leader.api();
    let admin = leader.admin();
    let jail = |ttl_s: u64| json!({"runtime": "jail", "ttl_s": ttl_s, "memory_mb": 256});
    let id = made_on(&api, &admin, vname, lname, &jail(900));
    api.sh(&id, "echo before > /home/user/f && sync");
    let snap = api.post(&format!("/v1/sandboxes/{id}/snapshots"), &json!({}));
    assert_eq!(snap.status, 201, "{}", snap.text());
    let snap = snap.json()["id"].as_str().unwrap().to_owned();
    let copy = kept.path().join(format!("{snap}.chunks"));
    wait_for(Duration::from_secs(30), "the copy in the store", || {
        copy.is_file().then_some(())
    });
    api.sh(&id, "echo after > /home/user/g && sync");
    let before = api.get(&format!("/v1/sandboxes/{id}")).json();
    // A jail that mounts the dying host's volume: its snapshot is not kept (the volume
    // dies with the host), so it stays lost rather than being tried elsewhere.
    let vapi = if a_leads { b.api() } else { a.api() }.with_key(api.key());
    vapi.post("/v1/volumes", &json!({"name": "dies", "size_mb": 64}))
        .expect(201, "a volume on the dying host");
    let mounting = jail_mounting(&vapi, "dies", "/mnt/d", vname);
    let not_kept = api.post(&format!("/v1/sandboxes/{mounting}/snapshots"), &json!({}));
    assert_eq!(not_kept.status, 201, "{}", not_kept.text());
    let not_kept = not_kept.json()["id"].as_str().unwrap().to_owned();
    // A short-lived jail on the dying host, never snapshotted: lost with it, and its TTL
    // ends while the host is dead.
    let short = made_on(&api, &admin, vname, lname, &jail(10));
    // The host dies: its server killed, its machines with it.
    let victim = if a_leads { &mut b } else { &mut a };
    victim.kill9();
    let died = std::time::Instant::now();
    locker_tests::server::destroy_machines(&victim.sandboxes_dir());
    wait_for(
        Duration::from_secs(30),
        "placed on the leader's host again",
        || (placed_in(&db, &id).0 == lname).then_some(()),
    );
    eprintln!(
        "restarted on {lname} {:?} after {vname} died (lease 3 s)",
        died.elapsed()
    );
    let leader = if a_leads { &a } else { &b };
    let api = leader.api().with_key(api.key());
    let now = api.get(&format!("/v1/sandboxes/{id}")).json();
    assert_eq!(now["state"], "running", "{now}");
    for k in ["id", "created_at", "expires_at", "preview_token"] {
        assert_eq!(now[k], before[k], "{k} after the restart: {now}");
    }
    assert_eq!(
        api.sh(
            &id,
            "cat /home/user/f; test -e /home/user/g && echo g || echo no-g"
        ),
        "before\nno-g\n"
    );
    let lost = api.get(&format!("/v1/sandboxes/{mounting}")).json();
    assert_eq!(lost["state"], "lost", "{lost}");
    assert!(!kept.path().join(format!("{not_kept}.chunks")).exists());
    let row_host = || {
        rows(
            &db,
            &format!("SELECT host FROM sandboxes WHERE id = '{id}'"),
        )
    };
    let leader_id = alive(&admin, lname).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        row_host(),
        vec![vec![leader_id.clone()]],
        "the row is the new host's"
    );
    // The short jail's TTL passes while its host is dead: the leader ends its record (and
    // nothing else: its machine was on the dead host).
    wait_for(
        Duration::from_secs(30),
        "the dead host's short jail expired",
        || {
            let r = api.get(&format!("/v1/sandboxes/{short}"));
            (r.status == 404 && r.text().contains("its TTL ran out")).then_some(())
        },
    );
    assert!(
        leader
            .log_text()
            .lines()
            .any(|l| l.contains(&short) && l.contains("on a host that is not alive")),
        "{}",
        leader.log_text()
    );

    // The dead host comes back: it adopts nothing of the sandbox (its row is the other
    // host's), routes calls to it there, and writes nothing of it.
    let victim = if a_leads { &mut b } else { &mut a };
    victim.restart();
    let vapi = victim.api().with_key(api.key());
    wait_for(Duration::from_secs(20), "the dead host back", || {
        alive(&admin, vname).map(|_| ())
    });
    assert!(!victim.machine_dir(&id).exists());
    for api in [&api, &vapi] {
        assert_eq!(api.sh(&id, "cat /home/user/f"), "before\n");
        let v = api.get(&format!("/v1/sandboxes/{id}")).json();
        assert_eq!(v["state"], "running", "{v}");
    }
    assert_eq!(row_host(), vec![vec![leader_id]]);
    let lost = vapi.get(&format!("/v1/sandboxes/{mounting}")).json();
    assert_eq!(lost["state"], "lost", "{lost}");
    vapi.delete(&format!("/v1/sandboxes/{mounting}"))
        .expect(204, "delete the lost sandbox");
    vapi.delete("/v1/volumes/dies")
        .expect(204, "delete its volume");
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete the restarted sandbox");
}

/// A host that stalls (its server stopped, its machines running on) past its lease: the
/// fleet starts its snapshotted jail on the other host while the old machine still runs
/// there. When the stalled server wakes it fences before it acts: it destroys its old
/// machine and nothing else (the new host's machine, on the same kernel here, keeps
/// running: machines' cgroups are named per host), writes nothing of the sandbox (no
/// `failed`, no expiry, no pause: the row stays the new host's and `running`), and routes
/// calls to the new host. Meanwhile the reaper of each host ends only its own rows: a jail
/// with a short TTL on the leader's host is expired there, never by the other.
#[test]
fn a_stalled_host_wakes_fenced_and_leaves_the_moved_sandbox_alone() {
    let (db, url) = cluster().new_database();
    let kept = locker_tests::TempDir::new("locker-snapshot-store");
    let store = kept.path().display().to_string();
    let extra = ["--snapshot-store", store.as_str()];
    let a = replica_with(&url, "host-a", &extra);
    let b = replica_with(&url, "host-b", &extra);
    wait_for(Duration::from_secs(15), "both hosts alive", || {
        (alive(&a.admin(), "host-a").is_some() && alive(&a.admin(), "host-b").is_some())
            .then_some(())
    });
    let a_leads = a.log_text().contains("this replica leads the fleet");
    let (leader, victim) = if a_leads { (&a, &b) } else { (&b, &a) };
    let (lname, vname) = if a_leads {
        ("host-a", "host-b")
    } else {
        ("host-b", "host-a")
    };
    let (api, admin) = (leader.api(), leader.admin());
    let vapi = victim.api().with_key(api.key());
    let on = |node: &str, body: serde_json::Value| -> String {
        let other = if node == lname { vname } else { lname };
        made_on(&api, &admin, node, other, &body)
    };
    // The sandbox that moves: on the victim, with a kept snapshot and an idle timeout the
    // stall outlasts (the victim's idle policy must not pause it when it wakes).
    let id = on(
        vname,
        json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256, "idle_timeout_s": 8}),
    );
    api.sh(&id, "echo before > /home/user/f && sync");
    let snap = api.post(&format!("/v1/sandboxes/{id}/snapshots"), &json!({}));
    assert_eq!(snap.status, 201, "{}", snap.text());
    let copy = kept
        .path()
        .join(format!("{}.chunks", snap.json()["id"].as_str().unwrap()));
    wait_for(Duration::from_secs(30), "the copy in the store", || {
        copy.is_file().then_some(())
    });
    api.sh(&id, "echo after > /home/user/g && sync");
    let old_dir = victim.machine_dir(&id);
    let old_cgroup = locker_tests::machine_cgroup(std::path::Path::new("/sys/fs/cgroup/pids"), &id)
        .or_else(|| locker_tests::machine_cgroup(std::path::Path::new("/sys/fs/cgroup"), &id))
        .expect("the victim's machine's cgroup");

    // The victim's server stalls; its machine runs on.
    victim.signal(libc::SIGSTOP);
    let stalled = std::time::Instant::now();
    wait_for(
        Duration::from_secs(30),
        "started on the leader's host",
        || (placed_in(&db, &id).0 == lname).then_some(()),
    );
    eprintln!(
        "started on {lname} {:?} after {vname} stalled",
        stalled.elapsed()
    );
    assert_eq!(
        api.sh(
            &id,
            "cat /home/user/f; test -e /home/user/g && echo g || echo no-g"
        ),
        "before\nno-g\n"
    );
    assert!(
        old_dir.is_dir() && old_cgroup.is_dir(),
        "the old machine runs on"
    );
    let new_dir = leader.machine_dir(&id);
    assert!(new_dir.is_dir(), "the new machine");
    // Past the idle timeout, the victim wakes, with a call to the sandbox waiting in its
    // listener: the call is answered by the new machine (no `g`), never by the old one.
    std::thread::sleep(Duration::from_secs(6));
    let waiting = {
        let (vapi, id) = (vapi.clone(), id.clone());
        std::thread::spawn(move || {
            vapi.sh(
                &id,
                "cat /home/user/f; test -e /home/user/g && echo g || echo no-g",
            )
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    victim.signal(libc::SIGCONT);
    assert_eq!(waiting.join().unwrap(), "before\nno-g\n");
    wait_for(Duration::from_secs(20), "the old machine destroyed", || {
        (!old_dir.exists() && !old_cgroup.exists()).then_some(())
    });
    let log = victim.log_text();
    assert!(
        log.contains("stalled for longer than its node's lease") && log.contains("fenced"),
        "{log}"
    );
    // The new machine is untouched, the sandbox running there, its row the leader's.
    let leader_id = alive(&admin, lname).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    std::thread::sleep(Duration::from_secs(2));
    for api in [&api, &vapi] {
        assert_eq!(api.sh(&id, "cat /home/user/f"), "before\n");
        let v = api.get(&format!("/v1/sandboxes/{id}")).json();
        assert_eq!(v["state"], "running", "{v}");
    }
    assert!(new_dir.is_dir());
    assert_eq!(
        rows(
            &db,
            &format!("SELECT host, state FROM sandboxes WHERE id = '{id}'"),
        ),
        vec![vec![leader_id, "running".to_owned()]]
    );
    assert!(
        !victim
            .log_text()
            .lines()
            .any(|l| l.contains(&id) && l.contains("paused by the idle policy")),
        "{}",
        victim.log_text()
    );
    // A short-lived jail on the leader's host is expired by its own host's reaper, and by
    // no other (both reapers see the row: the store is the fleet's).
    let short = on(
        lname,
        json!({"runtime": "jail", "ttl_s": 3, "memory_mb": 256}),
    );
    wait_for(Duration::from_secs(10), "the short jail expired", || {
        (api.get(&format!("/v1/sandboxes/{short}")).status == 404).then_some(())
    });
    let ended = |s: &Server| {
        s.log_text()
            .lines()
            .any(|l| l.contains(&short) && l.contains("expired (TTL) and destroyed"))
    };
    assert!(ended(leader), "{}", leader.log_text());
    assert!(!ended(victim), "{}", victim.log_text());
    assert!(!leader.machine_dir(&short).exists());
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete the moved sandbox");
}
