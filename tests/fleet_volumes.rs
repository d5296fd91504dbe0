//! Fleet mode, volumes on joined nodes (issue 25, point 3 "volume home nodes"; `FLEET.md`
//! §4.6 and §5.2 test 8): a control plane that is no node itself (the split layout) gives
//! each new volume a joined node as its home; its files, runs, snapshots, forks and the
//! sandboxes that mount it all go there whichever node is fuller; names are unique across
//! the fleet; a dead home answers 503, never an empty volume, and its volumes come back
//! whole with it; a node removed from the fleet takes its volumes' records with it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use locker_tests::fabric::{
    fleet_node, fleet_nodes, fleet_token, join_nodes, join_nodes_with, Fabric, NodeProc,
};
use locker_tests::fleet::{placed_on, rows};
use locker_tests::postgres::cluster;
use locker_tests::server::{Api, Server};
use locker_tests::wait_for;
use serde_json::json;

#[test]
fn a_volume_lives_on_a_joined_node_and_every_call_about_it_goes_there() {
    let fab = Fabric::new(2);
    let (_db, pg_url) = cluster().new_database();
    let srv = fab.control(&pg_url, &[]);
    let (admin, api) = (srv.admin(), srv.api());
    let mut nodes = [NodeProc::new(0, "a"), NodeProc::new(1, "b")];
    for n in nodes.iter_mut() {
        let t = fleet_token(&admin, 600);
        n.start(
            &fab,
            Some((t["url"].as_str().unwrap(), t["token"].as_str().unwrap())),
            3,
        );
    }
    wait_for(Duration::from_secs(60), "both nodes alive", || {
        let l = fleet_nodes(&admin);
        (l.len() == 2 && l.iter().all(|n| n["alive"] == true)).then_some(())
    });

    // A new volume gets a joined node as its home; the id is control's, whatever a caller
    // sends in the node's own header.
    let made = api.request(
        "POST",
        "/v1/volumes",
        &[
            ("Content-Type", "application/json"),
            ("x-locker-volume", "vol_0000000000000000"),
        ],
        serde_json::to_vec(&json!({"name": "repo", "size_mb": 64})).unwrap(),
    );
    assert_eq!(made.status, 201, "{}", made.text());
    let home = placed_on(&made);
    assert!(home == "a" || home == "b", "{:?}", made.headers);
    let vol = made.json()["id"].as_str().unwrap().to_owned();
    assert_ne!(vol, "vol_0000000000000000");
    let (h, other) = if home == "a" { (0, 1) } else { (1, 0) };
    let home_id = fleet_node(&fleet_nodes(&admin), &home)["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let dirs = [nodes[0].data_dir(), nodes[1].data_dir()];
    let disk = |i: usize, id: &str| dirs[i].join("volumes").join(id).join("disk.img");
    assert!(disk(h, &vol).exists(), "the home holds no filesystem");
    assert!(!disk(other, &vol).exists(), "the other node holds one");
    // Names are the fleet's: a second "repo" is refused whichever node would take it.
    api.post("/v1/volumes", &json!({"name": "repo", "size_mb": 64}))
        .expect_error(409, "conflict", "a second volume named repo");
    let m = api
        .post(
            "/v1/volumes",
            &json!({"name": "huge", "size_mb": 1_000_000}),
        )
        .expect_error(429, "quota_exceeded", "a volume no node can hold");
    assert!(m.contains("1000000 MB"), "{m}");
    api.post("/v1/volumes", &json!({"name": "vol_x"}))
        .expect_error(400, "bad_request", "a name shaped like an id");

    // Files, runs and snapshots go to the home, and the list knows where it lives.
    api.put(
        "/v1/volumes/repo/files?path=%2Fdata.txt",
        &b"written through control\n"[..],
    )
    .expect(200, "write the volume");
    let got = api.get("/v1/volumes/repo/files?path=%2Fdata.txt");
    assert_eq!(got.text(), "written through control\n");
    assert_eq!(placed_on(&got), home);
    // The home is the fullest node (a sandbox mounting the volume and another one on it),
    // yet every run goes there.
    let mounted = api.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256,
                "volumes": [{"volume": "repo", "path": "/mnt/v"}]}),
    );
    assert_eq!(mounted.status, 201, "{}", mounted.text());
    assert_eq!(placed_on(&mounted), home);
    let with = mounted.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        api.sh(&with, "cat /mnt/v/data.txt"),
        "written through control\n"
    );
    for i in 0..6 {
        let ran = api.post(
            "/v1/volumes/repo/run",
            &json!({"shell": format!("echo run {i} >> /workspace/data.txt; wc -l < /workspace/data.txt")}),
        );
        assert_eq!(ran.status, 200, "{}", ran.text());
        assert_eq!(placed_on(&ran), home, "run {i} went elsewhere");
        assert_eq!(ran.json()["stdout"], format!("{}\n", i + 2));
    }
    assert_eq!(
        api.sh(&with, "tail -n 1 /mnt/v/data.txt"),
        "run 5\n",
        "the mounted sandbox sees the runs' commits"
    );
    let listed = api.get("/v1/volumes").expect(200, "list volumes");
    let row = listed["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "repo")
        .unwrap_or_else(|| panic!("no repo in {listed}"))
        .clone();
    assert_eq!(row["node"], home_id, "{row}");
    let one = api.get("/v1/volumes/repo").expect(200, "read the volume");
    assert!(one["used_bytes"].as_u64().unwrap() > 0, "{one}");
    let snap = api
        .post("/v1/volumes/repo/snapshots", &json!({}))
        .expect(201, "a snapshot of the volume")["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // A fork is made beside its source, under a name of the fleet's.
    let fork = api.post(
        "/v1/volumes/repo/fork",
        &json!({"name": "repo-copy", "snapshot": snap}),
    );
    assert_eq!(fork.status, 201, "{}", fork.text());
    assert_eq!(placed_on(&fork), home);
    let fork_id = fork.json()["id"].as_str().unwrap().to_owned();
    assert!(disk(h, &fork_id).exists());
    assert_eq!(
        api.get("/v1/volumes/repo-copy/files?path=%2Fdata.txt")
            .text(),
        "written through control\nrun 0\nrun 1\nrun 2\nrun 3\nrun 4\nrun 5\n"
    );
    api.post("/v1/volumes/repo/fork", &json!({"name": "repo-copy"}))
        .expect_error(409, "conflict", "a fork under a name taken");
    // A volume a running sandbox mounts does not move (`tests::…moves_between_joined_nodes`
    // moves one); moving it to its own home is nothing to do.
    let m = api
        .post(
            "/v1/volumes/repo/move",
            &json!({"node": if home == "a" { "b" } else { "a" }}),
        )
        .expect_error(409, "conflict", "moving a mounted volume");
    assert!(m.contains("mounted by running sandbox"), "{m}");
    let stays = api
        .post("/v1/volumes/repo/move", &json!({"node": home}))
        .expect(200, "a move to the volume's own home");
    assert_eq!(stays["node"], home_id, "{stays}");
    api.delete("/v1/volumes/repo-copy")
        .expect(204, "delete the fork");
    assert!(!disk(h, &fork_id).exists(), "the fork's files stayed");
    api.get("/v1/volumes/repo-copy")
        .expect_error(404, "not_found", "a deleted fork");
    api.post("/v1/volumes", &json!({"name": "repo-copy", "size_mb": 64}))
        .expect(201, "the name is free again");
    api.delete("/v1/volumes/repo-copy")
        .expect(204, "delete it again");

    // The home dies (the whole node at once, as a host does) while runs write the volume:
    // its volume answers 503 (never an empty volume), a sandbox that mounts it cannot be
    // made, the other node's work goes on. Each run writes 40 files in its own directory
    // and sleeps a little longer than the one before, so that the kill finds some
    // committed, some running and maybe one committing.
    api.delete(&format!("/v1/sandboxes/{with}"))
        .expect(204, "delete the mounting sandbox");
    let runs: Vec<_> = (0..6)
        .map(|i| {
            let api = api.clone();
            std::thread::spawn(move || {
                let script = format!(
                    "sleep {}; mkdir /workspace/r{i}; for j in $(seq 40); do echo {i}.$j > /workspace/r{i}/f$j; done",
                    0.25 * i as f64
                );
                let r = api.post("/v1/volumes/repo/run", &json!({ "shell": script }));
                (i, r.status, r.text())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(900));
    nodes[h].signal(libc::SIGKILL);
    let answered: Vec<(usize, u16, String)> = runs.into_iter().map(|t| t.join().unwrap()).collect();
    eprintln!(
        "runs when the home died: {:?}",
        answered.iter().map(|(i, s, _)| (i, s)).collect::<Vec<_>>()
    );
    for (i, status, text) in &answered {
        assert!(
            *status == 200 || *status == 502 || *status == 503,
            "run {i} answered {status}: {text}"
        );
    }
    wait_for(Duration::from_secs(15), "the home declared dead", || {
        (fleet_node(&fleet_nodes(&admin), &home)["alive"] == false).then_some(())
    });
    let m = api
        .get("/v1/volumes/repo/files?path=%2Fdata.txt")
        .expect_error(503, "unavailable", "a file of a dead home's volume");
    assert!(m.contains("unavailable"), "{m}");
    api.post("/v1/volumes/repo/run", &json!({"shell": "ls /workspace"}))
        .expect_error(503, "unavailable", "a run on a dead home's volume");
    api.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "volumes": [{"volume": "repo", "path": "/mnt/v"}]}),
    )
    .expect_error(
        503,
        "unavailable",
        "a sandbox mounting a dead home's volume",
    );
    let elsewhere = api.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256}),
    );
    assert_eq!(elsewhere.status, 201, "{}", elsewhere.text());
    assert_eq!(placed_on(&elsewhere), if h == 0 { "b" } else { "a" });

    // It comes back (same data dir, no token): its volume is whole again.
    nodes[h].stop();
    nodes[h].start(&fab, None, 3);
    wait_for(Duration::from_secs(60), "the home back", || {
        (fleet_node(&fleet_nodes(&admin), &home)["alive"] == true).then_some(())
    });
    let back = wait_for(Duration::from_secs(15), "the volume answering", || {
        let r = api.get("/v1/volumes/repo/files?path=%2Fdata.txt");
        (r.status == 200).then_some(r.text())
    });
    assert!(back.ends_with("run 5\n"), "{back}");
    // Every run is whole or absent: acknowledged ones whole, none half-committed.
    let ran = api.post(
        "/v1/volumes/repo/run",
        &json!({"shell": "cd /workspace; for d in r*; do [ -d $d ] && echo $d $(ls $d | wc -l) $(cat $d/* | sort -u | wc -l); done; true"}),
    );
    assert_eq!(ran.status, 200, "{}", ran.text());
    let stdout = ran.json()["stdout"].as_str().unwrap().to_owned();
    eprintln!("runs' directories after the home came back:\n{stdout}");
    for line in stdout.lines() {
        assert!(line.ends_with(" 40 40"), "a run half-committed: {line}");
    }
    for (i, status, _) in &answered {
        if *status == 200 {
            assert!(
                stdout.contains(&format!("r{i} 40 40")),
                "acknowledged run {i} lost: {stdout}"
            );
        }
    }
    api.delete("/v1/volumes/repo")
        .expect(204, "delete the volume");
    assert!(!disk(h, &vol).exists(), "the volume's files stayed");
    assert!(
        api.get("/v1/volumes").json()["volumes"]
            .as_array()
            .unwrap()
            .is_empty(),
        "records left"
    );
    api.delete(&format!(
        "/v1/sandboxes/{}",
        elsewhere.json()["id"].as_str().unwrap()
    ))
    .expect(204, "delete the other sandbox");

    // A node removed from the fleet (`locker fleet remove`: its machine is gone) takes its
    // volumes' records with it: their names and disk quota are free again, and nothing
    // answers 503 forever. A new volume goes to a node that is still there.
    let lost = api.post("/v1/volumes", &json!({"name": "scratch", "size_mb": 64}));
    assert_eq!(lost.status, 201, "{}", lost.text());
    let gone = placed_on(&lost);
    nodes[if gone == "a" { 0 } else { 1 }].stop();
    admin
        .delete(&format!("/v1/fleet/nodes/{gone}"))
        .expect(204, "remove the volume's node");
    api.get("/v1/volumes/scratch")
        .expect_error(404, "not_found", "a removed node's volume");
    let again = api.post("/v1/volumes", &json!({"name": "scratch", "size_mb": 64}));
    assert_eq!(again.status, 201, "{}", again.text());
    assert_ne!(placed_on(&again), gone);
    api.delete("/v1/volumes/scratch")
        .expect(204, "delete the second scratch");
}

/// The files of volume `vol` on node `n`'s disk, if any.
fn on_disk(n: &NodeProc, vol: &str) -> bool {
    n.data_dir().join("volumes").join(vol).exists()
}

/// A volume moves between joined nodes (`locker volume move`) while it is written: its
/// files, snapshots and every acknowledged write go with it, calls go to the new home at
/// once, the old home keeps nothing; it moves back the same way. Bad moves say what to fix.
#[test]
fn a_volume_moves_between_joined_nodes_with_its_files_snapshots_and_writes() {
    let fab = Fabric::new(2);
    let (_db, pg_url) = cluster().new_database();
    let srv = fab.control(&pg_url, &[]);
    let (admin, api) = (srv.admin(), srv.api());
    let mut nodes = join_nodes(&fab, &admin, &["a", "b"], 3);
    let made = api.post("/v1/volumes", &json!({"name": "repo", "size_mb": 256}));
    assert_eq!(made.status, 201, "{}", made.text());
    let home = placed_on(&made);
    let vol = made.json()["id"].as_str().unwrap().to_owned();
    let (h, o) = if home == "a" { (0, 1) } else { (1, 0) };
    let other = ["a", "b"][o];
    let ids: Vec<String> = ["a", "b"]
        .iter()
        .map(|n| {
            fleet_node(&fleet_nodes(&admin), n)["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    let filled = api.post(
        "/v1/volumes/repo/run",
        &json!({"shell": "mkdir /workspace/src; for i in $(seq 300); do echo $i > /workspace/src/f$i; done; \
                 head -c 24M /dev/urandom > /workspace/blob; sha256sum /workspace/blob > /workspace/blob.sum"}),
    );
    assert_eq!(filled.status, 200, "{}", filled.text());
    let snap = api
        .post("/v1/volumes/repo/snapshots", &json!({}))
        .expect(201, "a snapshot")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    api.put(
        "/v1/volumes/repo/files?path=%2Fafter.txt",
        &b"after the snapshot"[..],
    )
    .expect(200, "a write after the snapshot");

    api.post("/v1/volumes/repo/move", &json!({"node": "nope"}))
        .expect_error(404, "not_found", "a move to no node");
    api.post("/v1/volumes/repo/move", &json!({})).expect_error(
        400,
        "bad_request",
        "a move naming no node",
    );
    api.post(
        "/v1/volumes/repo/move",
        &json!({"node": other, "now": true}),
    )
    .expect_error(400, "bad_request", "a move with an unknown field");

    // Writes go on through the move, one after another: each is answered 200 (kept) or
    // 503 (nothing written: call again).
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (api, stop) = (api.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut answered = Vec::new();
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let r = api.put(
                    &format!("/v1/volumes/repo/files?path=%2Fw%2F{i}"),
                    format!("write {i}").as_bytes(),
                );
                answered.push((i, r.status, r.text()));
                std::thread::sleep(Duration::from_millis(5));
            }
            answered
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let moved = api.post("/v1/volumes/repo/move", &json!({"node": other}));
    let took = t.elapsed();
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let answered = writer.join().unwrap();
    assert_eq!(moved.status, 200, "{}", moved.text());
    assert_eq!(moved.json()["node"], ids[o], "{}", moved.text());
    assert_eq!(placed_on(&moved), other);
    let kept: Vec<usize> = answered
        .iter()
        .filter(|(_, s, _)| *s == 200)
        .map(|(i, _, _)| *i)
        .collect();
    eprintln!(
        "moved in {took:?}; {} writes meanwhile, {} kept, refused: {:?}",
        answered.len(),
        kept.len(),
        answered
            .iter()
            .filter(|(_, s, _)| *s != 200)
            .map(|(i, s, _)| (i, s))
            .collect::<Vec<_>>()
    );
    for (i, status, text) in &answered {
        assert!(
            *status == 200 || *status == 503,
            "write {i} answered {status}: {text}"
        );
    }
    assert!(kept.len() > 10, "too few writes kept: {answered:?}");
    let listed = api.post(
        "/v1/volumes/repo/run",
        &json!({"shell": "cd /workspace; for f in w/*; do echo \"$f $(cat $f)\"; done; sha256sum -c --quiet blob.sum && echo blob-ok; ls src | wc -l"}),
    );
    assert_eq!(listed.status, 200, "{}", listed.text());
    assert_eq!(placed_on(&listed), other, "a run after the move");
    let out = listed.json()["stdout"].as_str().unwrap().to_owned();
    for i in &kept {
        assert!(
            out.contains(&format!("w/{i} write {i}\n")),
            "acknowledged write {i} lost in the move"
        );
    }
    assert!(out.ends_with("blob-ok\n300\n"), "{out}");
    assert!(on_disk(&nodes[o], &vol), "the new home holds no files");
    assert!(!on_disk(&nodes[h], &vol), "the old home kept its files");

    // Its snapshot came along: listed, and restored on the new home.
    let snaps = api
        .get("/v1/volumes/repo/snapshots")
        .expect(200, "snapshots");
    assert!(snaps.to_string().contains(&snap), "{snaps}");
    api.post("/v1/volumes/repo/restore", &json!({"snapshot": snap}))
        .expect(200, "restore the moved snapshot");
    api.get("/v1/volumes/repo/files?path=%2Fafter.txt")
        .expect_error(404, "not_found", "a file written after the snapshot");
    assert_eq!(
        api.get("/v1/volumes/repo/files?path=%2Fsrc%2Ff300").text(),
        "300\n"
    );

    // And back: a second move starts from nothing the first left.
    let back = api.post("/v1/volumes/repo/move", &json!({"node": home}));
    assert_eq!(back.status, 200, "{}", back.text());
    assert_eq!(back.json()["node"], ids[h]);
    assert!(on_disk(&nodes[h], &vol) && !on_disk(&nodes[o], &vol));
    let r = api.get("/v1/volumes/repo/files?path=%2Fsrc%2Ff7");
    assert_eq!(
        (r.text().as_str(), placed_on(&r).as_str()),
        ("7\n", home.as_str())
    );
    api.delete("/v1/volumes/repo")
        .expect(204, "delete the volume");
    assert!(!on_disk(&nodes[h], &vol) && !on_disk(&nodes[o], &vol));
    for n in &mut nodes {
        n.stop();
    }
}

/// A volume move whose control plane dies half way is settled by the nodes with the
/// fleet's record (`LOCKER_CARRY_WAIT_S` after their last step, asking a control replica
/// with their heartbeats): before the switch the volume stays where it was and the copy
/// goes; after it, the old home lets go; a home restarted in the middle holds the volume
/// again until the fleet answers. One copy is left, with every acknowledged write.
#[test]
fn a_volume_move_whose_control_plane_dies_is_settled_by_the_fleets_record() {
    let fab = Fabric::new(2);
    let (db, pg_url) = cluster().new_database();
    // A fixed port for the nodes (the join's URL): the control plane comes back on it.
    let ip = fab.control_ip();
    let port = locker_tests::fleet::free_ports(&ip, 1)[0];
    let listen = format!("{ip}:{port}");
    let mut srv = Server::start_with(&["--database", &pg_url, "--fleet-listen", &listen]);
    let (admin, api) = (srv.admin(), srv.api());
    let mut nodes = join_nodes_with(
        &fab,
        &admin,
        &["a", "b"],
        3,
        &[("LOCKER_CARRY_WAIT_S", "2")],
    );
    let made = api.post("/v1/volumes", &json!({"name": "repo", "size_mb": 256}));
    assert_eq!(made.status, 201, "{}", made.text());
    let home = placed_on(&made);
    let vol = made.json()["id"].as_str().unwrap().to_owned();
    let (h, o) = if home == "a" { (0, 1) } else { (1, 0) };
    let filled = api.post(
        "/v1/volumes/repo/run",
        &json!({"shell": "head -c 16M /dev/urandom > /workspace/blob; sha256sum /workspace/blob > /workspace/blob.sum; echo one > /workspace/one"}),
    );
    assert_eq!(filled.status, 200, "{}", filled.text());
    let host =
        |db: &str| rows(db, &format!("SELECT host FROM volumes WHERE id = '{vol}'"))[0][0].clone();
    let home_id = host(&db);
    let dirs = [nodes[0].data_dir(), nodes[1].data_dir()];
    let dir = |i: usize| dirs[i].join("volumes").join(&vol);

    // 1. Control stops the moment the home holds the volume (its mark), before the switch.
    let mover = move_in_background(&api, ["a", "b"][o]);
    watch_for(&dir(h).join("outgoing"), "the home holding the volume");
    srv.signal(libc::SIGSTOP);
    srv.kill9();
    let _ = mover.join();
    srv.restart_on_same_port();
    let api = srv.api();
    wait_for(
        Duration::from_secs(30),
        "the copy dropped, the home serving",
        || {
            let r = api.put("/v1/volumes/repo/files?path=%2Ftwo", &b"two"[..]);
            (r.status == 200 && !dir(o).exists() && !dir(h).join("outgoing").exists()).then_some(())
        },
    );
    assert_eq!(host(&db), home_id, "the record moved without a switch");
    for n in &nodes {
        let log = n.log_text();
        assert!(log.contains("settled by the fleet's record"), "{log}");
    }

    // 2. The old home stops once the new one has the volume whole (its points dropped,
    //    about to open), and control dies once the record switched: the old home, back,
    //    finds the volume is not its own any more and lets it go.
    let mover = move_in_background(&api, ["a", "b"][o]);
    let snaps = dir(o).join("fs");
    watch_for(&dir(o).join("incoming"), "the copy arriving");
    wait_until_points_gone(&snaps);
    nodes[h].signal(libc::SIGSTOP);
    wait_for(Duration::from_secs(30), "the record switched", || {
        (host(&db) != home_id).then_some(())
    });
    srv.kill9();
    let _ = mover.join();
    nodes[h].signal(libc::SIGCONT);
    srv.restart_on_same_port();
    let api = srv.api();
    wait_for(Duration::from_secs(30), "the old home letting go", || {
        (!dir(h).exists()).then_some(())
    });
    let r = api.post(
        "/v1/volumes/repo/run",
        &json!({"shell": "cd /workspace; sha256sum -c --quiet blob.sum && cat one two"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(placed_on(&r), ["a", "b"][o]);
    assert_eq!(r.json()["stdout"], "one\ntwo");
    wait_for(Duration::from_secs(30), "the new home's mark gone", || {
        (!dir(o).join("incoming").exists()).then_some(())
    });

    // 3. The home (now o) is killed with control the moment it holds the volume, and both
    //    start again: the home finds its mark, holds the volume again until the fleet says
    //    it is still its own, and serves it; the copy on h goes.
    let now_home = host(&db);
    let mover = move_in_background(&api, ["a", "b"][h]);
    watch_for(
        &dir(o).join("outgoing"),
        "the home holding the volume again",
    );
    srv.signal(libc::SIGSTOP);
    nodes[o].signal(libc::SIGKILL);
    srv.kill9();
    let _ = mover.join();
    nodes[o].stop();
    nodes[o].start(&fab, None, 3);
    srv.restart_on_same_port();
    let api = srv.api();
    wait_for(
        Duration::from_secs(60),
        "the restarted home serving",
        || {
            let r = api.put("/v1/volumes/repo/files?path=%2Fthree", &b"three"[..]);
            (r.status == 200 && !dir(h).exists() && !dir(o).join("outgoing").exists()).then_some(())
        },
    );
    assert_eq!(host(&db), now_home, "the record moved without a switch");
    let points: Vec<_> = std::fs::read_dir(dir(o).join("fs/snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(points.is_empty(), "the move's points stayed: {points:?}");
    let r = api.post(
        "/v1/volumes/repo/run",
        &json!({"shell": "cd /workspace; sha256sum -c --quiet blob.sum && cat one two three"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stdout"], "one\ntwothree");
    let log = nodes[o].log_text();
    assert!(
        log.contains("a move of this volume was under way when the node stopped"),
        "{log}"
    );
    api.delete("/v1/volumes/repo")
        .expect(204, "delete the volume");
    for n in &mut nodes {
        n.stop();
    }
}

/// `POST /v1/volumes/repo/move` to `node` in a thread of its own (its control plane may
/// die under it).
fn move_in_background(api: &Api, node: &'static str) -> std::thread::JoinHandle<()> {
    let api = api.clone();
    std::thread::spawn(move || {
        let body = serde_json::to_vec(&json!({ "node": node })).unwrap();
        let r = api.try_request(
            "POST",
            "/v1/volumes/repo/move",
            &[("Content-Type", "application/json")],
            body,
        );
        eprintln!(
            "the move whose control plane died: {:?}",
            r.map(|r| (r.status, r.text()))
        );
    })
}

/// Waits for `path` to exist, looking every millisecond (a step of a move is caught as it
/// happens).
fn watch_for(path: &std::path::Path, never: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(Instant::now() < deadline, "never seen: {never}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until the move's points (`.move-…`) were received into `fs/snapshots` and are
/// gone again: the copy is whole.
fn wait_until_points_gone(fs: &std::path::Path) {
    let snaps = fs.join("snapshots");
    let points = || {
        std::fs::read_dir(&snaps)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(".move-"))
                    .count()
            })
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while points() == 0 {
        assert!(Instant::now() < deadline, "no point received");
        std::thread::sleep(Duration::from_millis(1));
    }
    while points() > 0 {
        assert!(Instant::now() < deadline, "the points stayed");
        std::thread::sleep(Duration::from_millis(1));
    }
}
