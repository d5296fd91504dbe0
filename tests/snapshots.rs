//! Snapshots, forks, pause and resume, through the real server.

use std::path::PathBuf;
use std::time::Duration;

use locker_tests::server::Server;
use locker_tests::{become_subreaper, traces_of};
use serde_json::{json, Value};

fn id_of(v: &Value) -> String {
    v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id in {v}"))
        .to_owned()
}

/// The machine's file as the host sees it, through the shim's mount namespace: reading it
/// is not a call on the sandbox, so a paused sandbox stays paused.
fn host_view(srv: &Server, sb: &str, path: &str) -> String {
    let dir = srv.machine_dir(sb);
    let state: Value =
        serde_json::from_slice(&std::fs::read(dir.join("state.json")).unwrap()).unwrap();
    let shim = state["shim_pid"].as_i64().unwrap();
    let p = PathBuf::from(format!("/proc/{shim}/root"))
        .join(dir.strip_prefix("/").unwrap())
        .join("disk/upper")
        .join(path.trim_start_matches('/'));
    std::fs::read_to_string(p).unwrap_or_default()
}

#[test]
fn a_snapshot_restores_files_and_outlives_its_sandbox() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = id_of(&api.create_sandbox(&json!({"memory_mb": 256, "metadata": {"k": "v"}})));
    let hash = api.sh(&sb, "mkdir -p /work && head -c 1048576 /dev/urandom > /work/blob && echo kept > /root/note && sha256sum /work/blob | cut -d' ' -f1");
    // Taken while a command keeps writing: still one consistent point.
    api.post(
        &format!("/v1/sandboxes/{sb}/processes"),
        &json!({"shell": "while :; do date >> /root/log; done"}),
    )
    .expect(200, "writer");
    api.sh(&sb, "while [ ! -s /root/log ]; do sleep 0.01; done");
    let snap = api
        .post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
        .expect(201, "snapshot");
    let snap_id = id_of(&snap);
    assert!(snap_id.starts_with("snap_"));
    assert_eq!(snap["sandbox_id"], sb.as_str());
    assert_eq!(
        snap["has_memory"], false,
        "the jail has no memory snapshots"
    );
    assert!(snap["size_bytes"].as_u64().unwrap() >= 1_048_576, "{snap}");
    assert_eq!(
        api.sh(&sb, "echo ok"),
        "ok\n",
        "the sandbox runs on after its snapshot"
    );
    let listed = api.get("/v1/snapshots").expect(200, "list");
    assert!(listed["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["id"] == snap_id.as_str()));

    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the source");
    let child = api.create_sandbox(&json!({"from_snapshot": snap_id}));
    let child_id = id_of(&child);
    assert_eq!(child["memory_mb"], 256, "sizes come from the snapshot");
    assert_eq!(
        api.sh(
            &child_id,
            "cat /root/note; sha256sum /work/blob | cut -d' ' -f1; stat -c %u /work/blob"
        ),
        format!("kept\n{}\n0\n", hash.trim())
    );
    // The log a command was appending to when the snapshot was taken ends in a whole line:
    // the machine was frozen between two writes, never inside one.
    let last = api.sh(&child_id, "tail -c 300 /root/log | tail -n 1");
    assert!(
        last.ends_with('\n') && last.len() > 20,
        "a whole `date` line: {last:?}"
    );

    // Bad uses.
    api.post("/v1/sandboxes", &json!({"from_snapshot": "snap_nope"}))
        .expect_error(404, "not_found", "snap_nope");
    api.post(
        "/v1/sandboxes",
        &json!({"from_snapshot": snap_id, "disk_mb": 99}),
    )
    .expect_error(400, "bad_request", "disk");
    let (other, _) = srv.create_tenant("snapother");
    other
        .post("/v1/sandboxes", &json!({"from_snapshot": snap_id}))
        .expect_error(404, "not_found", "snapshot");
    other
        .delete(&format!("/v1/snapshots/{snap_id}"))
        .expect_error(404, "not_found", "snapshot");

    api.delete(&format!("/v1/snapshots/{snap_id}"))
        .expect(204, "delete the snapshot");
    api.delete(&format!("/v1/snapshots/{snap_id}"))
        .expect_error(404, "not_found", "snapshot");
    assert_eq!(
        api.sh(&child_id, "cat /root/note"),
        "kept\n",
        "a sandbox keeps its own copy"
    );
    let data_dir = srv
        .machine_dir(&child_id)
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_owned();
    let snap_dir = data_dir.join("snapshots").join(&snap_id);
    assert!(
        !snap_dir.exists(),
        "the snapshot's files are gone: {}",
        snap_dir.display()
    );
}

#[test]
fn forks_are_independent() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = id_of(&api.create_sandbox(&json!({"memory_mb": 128, "env": {"FROM": "parent"}})));
    api.sh(&sb, "echo base > /root/shared");
    let forked = api
        .post(&format!("/v1/sandboxes/{sb}/fork"), &json!({"count": 3}))
        .expect(201, "fork");
    let kids: Vec<String> = forked["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(id_of)
        .collect();
    assert_eq!(kids.len(), 3);
    api.sh(&sb, "echo parent-after > /root/shared");
    for (i, k) in kids.iter().enumerate() {
        api.sh(k, &format!("echo kid{i} >> /root/shared"));
    }
    assert_eq!(api.sh(&sb, "cat /root/shared"), "parent-after\n");
    for (i, k) in kids.iter().enumerate() {
        assert_eq!(
            api.sh(k, "cat /root/shared; echo $FROM"),
            format!("base\nkid{i}\nparent\n"),
            "child {k}"
        );
    }
    assert!(
        api.get("/v1/snapshots").expect(200, "list")["snapshots"]
            .as_array()
            .unwrap()
            .is_empty(),
        "a fork keeps no snapshot"
    );
    for bad in [
        json!({"count": 0}),
        json!({"count": 101}),
        json!({"count": "3"}),
        json!({"cnt": 2}),
    ] {
        api.post(&format!("/v1/sandboxes/{sb}/fork"), &bad)
            .expect_error(400, "bad_request", "count");
    }
    for k in &kids {
        api.delete(&format!("/v1/sandboxes/{k}"))
            .expect(204, "delete a child");
        assert!(traces_of(k, &srv.machine_dir(k)).is_empty());
    }
}

#[test]
fn fifty_pause_resume_cycles_keep_files_and_processes() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = id_of(&api.create_sandbox(&json!({"memory_mb": 128})));
    let hash = api.sh(
        &sb,
        "head -c 1048576 /dev/urandom > /root/blob; sha256sum /root/blob",
    );
    let counter = api.post(&format!("/v1/sandboxes/{sb}/processes"), &json!({"shell": "i=0; while :; do i=$((i+1)); echo $i > /root/counter.tmp; mv /root/counter.tmp /root/counter; sleep 0.05; done"})).expect(200, "counter");
    let pid = counter["pid"].as_i64().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    for cycle in 0..50 {
        let p = api
            .post_empty(&format!("/v1/sandboxes/{sb}/pause"))
            .expect(200, "pause");
        assert_eq!(p["state"], "paused", "cycle {cycle}");
        if cycle % 10 == 0 {
            // Frozen means frozen: the counter does not move while paused.
            let before = host_view(&srv, &sb, "/root/counter");
            std::thread::sleep(Duration::from_millis(400));
            assert_eq!(
                host_view(&srv, &sb, "/root/counter"),
                before,
                "the counter advanced while paused (cycle {cycle})"
            );
            assert_eq!(
                api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["state"],
                "paused",
                "reading the record does not resume"
            );
        }
        let r = api
            .post_empty(&format!("/v1/sandboxes/{sb}/resume"))
            .expect(200, "resume");
        assert_eq!(r["state"], "running", "cycle {cycle}");
    }
    assert_eq!(
        api.sh(&sb, "sha256sum /root/blob"),
        hash,
        "the file survived 50 cycles"
    );
    let a = api.sh(&sb, "cat /root/counter");
    std::thread::sleep(Duration::from_millis(300));
    let b = api.sh(
        &sb,
        &format!("cat /root/counter; kill -0 {pid} && echo same-process"),
    );
    assert!(b.contains("same-process"), "{b}");
    assert!(
        b.lines().next().unwrap().parse::<u64>().unwrap() > a.trim().parse::<u64>().unwrap(),
        "the counter runs again: {a} then {b}"
    );
    // An exec on a paused sandbox resumes it transparently.
    api.post_empty(&format!("/v1/sandboxes/{sb}/pause"))
        .expect(200, "pause");
    assert_eq!(api.sh(&sb, "echo awake"), "awake\n");
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["state"],
        "running"
    );
}

/// The loop devices (`losetup -a` lines) whose backing file lies under the data dir's
/// sandboxes or snapshots (the server's warm pool keeps machines of its own).
fn loops_under(data_dir: &std::path::Path) -> Vec<String> {
    let mut v = loops_of(&data_dir.join("sandboxes"));
    v.extend(loops_of(&data_dir.join("snapshots")));
    v
}

fn loops_of(dir: &std::path::Path) -> Vec<String> {
    let out = std::process::Command::new("losetup")
        .arg("-a")
        .output()
        .expect("losetup");
    let d = dir.display().to_string();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&d))
        .map(str::to_owned)
        .collect()
}

fn inode(p: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .ino()
}

fn allocated(p: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).map(|m| m.blocks() * 512).unwrap_or(0)
}

/// A child of a snapshot stands on the snapshot's image, shared and read-only: it sees the
/// snapshot's files, deletions (whiteouts) and replaced directories (opaque), its own disk
/// starts blank (nothing copied, the quota is for its own writes), and it writes only there.
#[test]
fn a_child_stands_on_the_snapshot_layer_and_writes_only_its_own_disk() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = id_of(&api.create_sandbox(&json!({"memory_mb": 128, "disk_mb": 64})));
    let hash = api.sh(
        &sb,
        "test -e /etc/issue && test -d /usr/share/doc-base \
         && head -c 8388608 /dev/urandom > /root/blob && echo one > /root/note \
         && rm /etc/issue && rm -rf /usr/share/doc-base && mkdir /usr/share/doc-base \
         && echo fresh > /usr/share/doc-base/only && sha256sum /root/blob | cut -d' ' -f1",
    );
    let snap = id_of(
        &api.post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
            .expect(201, "snapshot"),
    );
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the source");
    let a = id_of(&api.create_sandbox(&json!({"from_snapshot": snap})));
    let b = id_of(&api.create_sandbox(&json!({"from_snapshot": snap})));
    let seen = "sha256sum /root/blob | cut -d' ' -f1; cat /root/note; \
                test -e /etc/issue && echo issue-back; ls /usr/share/doc-base; stat -c %u /root/blob";
    for k in [&a, &b] {
        assert_eq!(
            api.sh(k, seen),
            format!("{}\none\nonly\n0\n", hash.trim()),
            "child {k} sees the files, the deletion and the replaced directory"
        );
    }
    // Stored once: each child links the snapshot's image and copies none of it.
    let data_dir = srv
        .machine_dir(&a)
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_owned();
    let snap_img = data_dir.join("snapshots").join(&snap).join("disk.img");
    for k in [&a, &b] {
        let dir = srv.machine_dir(k);
        assert_eq!(
            inode(&dir.join("layers/0.img")),
            inode(&snap_img),
            "child {k} links the image"
        );
        assert!(
            allocated(&dir.join("disk.img")) < 4 << 20,
            "child {k}'s own disk holds none of the snapshot's 8 MB: {} bytes",
            allocated(&dir.join("disk.img"))
        );
    }
    let before = std::fs::read(&snap_img).unwrap();
    // Writes go to the writer's own disk: the snapshot and the sibling never see them.
    api.sh(
        &a,
        "echo two > /root/note && rm /root/blob && echo a > /etc/issue && sync",
    );
    assert_eq!(
        api.sh(
            &a,
            "cat /root/note /etc/issue; test -e /root/blob || echo gone"
        ),
        "two\na\ngone\n"
    );
    assert_eq!(
        api.sh(&b, seen),
        format!("{}\none\nonly\n0\n", hash.trim()),
        "the sibling"
    );
    let c = id_of(&api.create_sandbox(&json!({"from_snapshot": snap})));
    assert_eq!(
        api.sh(&c, seen),
        format!("{}\none\nonly\n0\n", hash.trim()),
        "a later child"
    );
    assert!(
        std::fs::read(&snap_img).unwrap() == before,
        "the snapshot's image is never written"
    );
    // The quota is the child's own disk (64 MB), whatever the layers beneath it hold.
    let r = api.exec(
        &c,
        &json!({"shell": "head -c 100000000 /dev/zero > /root/big"}),
    );
    assert_ne!(r["exit_code"], 0, "100 MB on a 64 MB disk: {r}");
    assert!(
        r["stderr"].as_str().unwrap().contains("No space left"),
        "{r}"
    );
    api.sh(
        &c,
        "rm /root/big && head -c 40000000 /dev/zero > /root/fits",
    );
    for k in [&a, &b, &c] {
        api.delete(&format!("/v1/sandboxes/{k}"))
            .expect(204, "delete a child");
        assert!(
            traces_of(k, &srv.machine_dir(k)).is_empty(),
            "{:?}",
            traces_of(k, &srv.machine_dir(k))
        );
    }
    api.delete(&format!("/v1/snapshots/{snap}"))
        .expect(204, "delete the snapshot");
    assert!(
        loops_under(&data_dir).is_empty(),
        "{:?}",
        loops_under(&data_dir)
    );
}

/// A snapshot of a sandbox that came from a snapshot stacks both layers; either snapshot
/// may be deleted while sandboxes and later snapshots stand on it (they keep its image).
#[test]
fn a_chain_of_two_snapshots_stacks_their_layers_and_outlives_deletes() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = id_of(&api.create_sandbox(&json!({"memory_mb": 128, "disk_mb": 64})));
    api.sh(&sb, "echo first > /root/one && echo doomed > /root/gone && mkdir /root/d && echo old > /root/d/old");
    let s1 = id_of(
        &api.post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
            .expect(201, "s1"),
    );
    let mid = id_of(&api.create_sandbox(&json!({"from_snapshot": s1})));
    // Over the lower layer: a deletion, a replaced directory, a change and an addition.
    api.sh(&mid, "rm /root/gone && rm -rf /root/d && mkdir /root/d && echo new > /root/d/new && echo changed > /root/one && echo second > /root/two");
    let s2 = id_of(
        &api.post_empty(&format!("/v1/sandboxes/{mid}/snapshots"))
            .expect(201, "s2"),
    );
    let data_dir = srv
        .machine_dir(&mid)
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_owned();
    let snaps = data_dir.join("snapshots");
    assert_eq!(
        inode(&snaps.join(&s2).join("lower/1.img")),
        inode(&snaps.join(&s1).join("disk.img")),
        "s2 records s1 beneath it, linked"
    );
    let want = "changed\nsecond\nnew\n";
    let probe =
        "cat /root/one /root/two; ls /root/d; test -e /root/gone && echo gone-is-back; true";
    let g = id_of(&api.create_sandbox(&json!({"from_snapshot": s2})));
    assert_eq!(api.sh(&g, probe), want);
    assert_eq!(
        std::fs::read_dir(srv.machine_dir(&g).join("layers"))
            .unwrap()
            .count(),
        2,
        "the grandchild stands on two layers"
    );
    // Deleting both snapshots while they are stood on: allowed, nothing standing moves.
    api.delete(&format!("/v1/snapshots/{s1}"))
        .expect(204, "delete s1 in use");
    assert!(!snaps.join(&s1).exists());
    let g2 = id_of(&api.create_sandbox(&json!({"from_snapshot": s2})));
    assert_eq!(
        api.sh(&g2, probe),
        want,
        "s2 keeps s1's layer after s1 is deleted"
    );
    api.delete(&format!("/v1/snapshots/{s2}"))
        .expect(204, "delete s2 in use");
    assert_eq!(
        api.sh(&g, probe),
        want,
        "a child keeps its layers after their snapshots went"
    );
    assert_eq!(
        api.sh(&mid, "cat /root/one; test -e /root/gone || echo no-gone"),
        "changed\nno-gone\n"
    );
    for k in [&sb, &mid, &g, &g2] {
        api.delete(&format!("/v1/sandboxes/{k}"))
            .expect(204, "delete");
        assert!(
            traces_of(k, &srv.machine_dir(k)).is_empty(),
            "{:?}",
            traces_of(k, &srv.machine_dir(k))
        );
    }
    assert!(
        loops_under(&data_dir).is_empty(),
        "{:?}",
        loops_under(&data_dir)
    );
    assert_eq!(
        std::fs::read_dir(&snaps).unwrap().count(),
        0,
        "no snapshot files left"
    );
}

/// Snapshots of sandboxes made from snapshots, 32 deep (each level deleting the one
/// before, which its layers outlive): the last child sees every level's file, and a
/// snapshot that would stack a 33rd layer is refused with a 409 saying why.
#[test]
fn a_chain_stops_at_its_layer_limit_with_a_clear_conflict() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let mut sb = id_of(&api.create_sandbox(&json!({"memory_mb": 64, "disk_mb": 32})));
    let mut prev_snap: Option<String> = None;
    for level in 0..32 {
        api.sh(&sb, &format!("echo {level} > /root/l{level}"));
        let snap = id_of(
            &api.post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
                .expect(201, &format!("snapshot at level {level}")),
        );
        api.delete(&format!("/v1/sandboxes/{sb}"))
            .expect(204, "delete");
        if let Some(p) = prev_snap.take() {
            api.delete(&format!("/v1/snapshots/{p}"))
                .expect(204, "delete the snapshot below");
        }
        sb = id_of(&api.create_sandbox(&json!({"from_snapshot": snap})));
        prev_snap = Some(snap);
    }
    assert_eq!(
        std::fs::read_dir(srv.machine_dir(&sb).join("layers"))
            .unwrap()
            .count(),
        32
    );
    let want: String = (0..32).map(|i| format!("{i}\n")).collect();
    let got = api.sh(&sb, "for i in $(seq 0 31); do cat /root/l$i; done");
    assert_eq!(got, want, "every level's file through 32 layers");
    for msg in [
        api.post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
            .expect_error(409, "conflict", "a 33rd layer by snapshot"),
        api.post(&format!("/v1/sandboxes/{sb}/fork"), &json!({"count": 1}))
            .expect_error(409, "conflict", "a 33rd layer by fork"),
    ] {
        assert!(msg.contains("stands on 32 snapshot layers"), "{msg}");
    }
    assert_eq!(
        api.sh(&sb, "cat /root/l0"),
        "0\n",
        "the refused sandbox runs on"
    );
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete");
    api.delete(&format!("/v1/snapshots/{}", prev_snap.unwrap()))
        .expect(204, "delete");
    let data_dir = srv
        .machine_dir(&sb)
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_owned();
    assert!(
        loops_under(&data_dir).is_empty(),
        "{:?}",
        loops_under(&data_dir)
    );
    assert_eq!(
        std::fs::read_dir(data_dir.join("snapshots"))
            .unwrap()
            .count(),
        0,
        "no snapshot files left (a refused fork leaves no point)"
    );
}
