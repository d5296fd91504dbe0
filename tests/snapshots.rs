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
