//! Volumes through the real server: records, names and tenants, the files API with no
//! machine (confined to the volume's tree), the size limit, snapshots and forks, delete and
//! restart. Every test cleans up through the `Server` guard, and deletes what it made.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use locker_tests::become_subreaper;
use locker_tests::server::{enc, Api, Resp, Server};
use serde_json::{json, Value};

fn id_of(v: &Value) -> String {
    v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id in {v}"))
        .to_owned()
}

fn put(api: &Api, vol: &str, path: &str, data: &[u8]) -> Resp {
    api.put(&format!("/v1/volumes/{vol}/files?path={}", enc(path)), data)
}

fn get(api: &Api, vol: &str, path: &str) -> Resp {
    api.get(&format!("/v1/volumes/{vol}/files?path={}", enc(path)))
}

fn list(api: &Api, vol: &str, path: &str, depth: u32) -> Vec<Value> {
    let v = api
        .get(&format!(
            "/v1/volumes/{vol}/files/list?path={}&depth={depth}",
            enc(path)
        ))
        .expect(200, "list");
    v["entries"].as_array().unwrap().clone()
}

fn names(entries: &[Value]) -> Vec<String> {
    let mut n: Vec<String> = entries
        .iter()
        .map(|e| e["path"].as_str().unwrap().to_owned())
        .collect();
    n.sort();
    n
}

/// Host pids whose command line mentions `needle` (a volume's directory).
fn pids_mentioning(needle: &Path) -> Vec<i32> {
    let needle = needle.as_os_str().as_encoded_bytes();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmd.windows(needle.len()).any(|w| w == needle) {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if !stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
            {
                out.push(pid);
            }
        }
    }
    out
}

/// Asserts that nothing mounts the volume in `dir` and no loop device holds its image.
#[track_caller]
fn assert_no_filesystem_left(dir: &Path) {
    let d = dir.to_str().unwrap();
    assert!(
        !std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .contains(d),
        "a mount of {d} is left"
    );
    eventually("the volume's loop device detaches", || {
        !std::fs::read_dir("/sys/block").unwrap().flatten().any(|e| {
            std::fs::read_to_string(e.path().join("loop/backing_file")).is_ok_and(|b| b.contains(d))
        })
    });
}

fn vol_dir(srv: &Server, id: &str) -> PathBuf {
    srv.data_dir.join("volumes").join(id)
}

/// Waits until `f` holds (agents stop and temp files go asynchronously).
#[track_caller]
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn volumes_are_records_with_unique_names_per_tenant() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let v = api
        .post("/v1/volumes", &json!({"name": "repo", "size_mb": 64}))
        .expect(201, "create");
    let id = id_of(&v);
    assert!(id.starts_with("vol_"), "{v}");
    assert_eq!(
        (
            v["name"].as_str(),
            v["size_mb"].as_u64(),
            v["used_bytes"].as_u64()
        ),
        (Some("repo"), Some(64), Some(0)),
        "{v}"
    );
    assert!(v["created_at"].as_str().unwrap().ends_with('Z'));
    let d = api
        .post("/v1/volumes", &json!({"name": "data"}))
        .expect(201, "default size");
    assert_eq!(d["size_mb"], 10240);

    assert_eq!(
        api.get(&format!("/v1/volumes/{id}")).expect(200, "get")["name"],
        "repo"
    );
    assert_eq!(
        api.get("/v1/volumes/repo").expect(200, "get by name")["id"],
        id.as_str()
    );
    let all = api.get("/v1/volumes").expect(200, "list");
    assert_eq!(
        all["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["repo", "data"]
    );

    api.post("/v1/volumes", &json!({"name": "repo"}))
        .expect_error(409, "conflict", "a duplicate name");
    for (body, field) in [
        (json!({"name": "Repo"}), "name"),
        (json!({"name": ""}), "name"),
        (json!({"name": "a/b"}), "name"),
        (json!({"name": "vol_x"}), "name"),
        (json!({}), "name"),
        (json!({"name": "x", "size_mb": 0}), "size_mb"),
        (json!({"name": "x", "size_mb": 1_048_577}), "size_mb"),
        (json!({"name": "x", "size_mb": "big"}), "size_mb"),
        (json!({"name": "x", "colour": "red"}), "colour"),
    ] {
        let msg =
            api.post("/v1/volumes", &body)
                .expect_error(400, "bad_request", &body.to_string());
        assert!(
            msg.contains(field),
            "{body}: the message names `{field}`: {msg}"
        );
    }

    // Another tenant sees none of it, by id or by name, and may use the same name.
    let (other, _) = srv.create_tenant("volother");
    assert!(
        other.get("/v1/volumes").expect(200, "other's list")["volumes"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    for p in [
        format!("/v1/volumes/{id}"),
        "/v1/volumes/repo".to_owned(),
        format!("/v1/volumes/{id}/files/list?path=/"),
    ] {
        other.get(&p).expect_error(404, "not_found", &p);
    }
    other
        .delete(&format!("/v1/volumes/{id}"))
        .expect_error(404, "not_found", "other's delete");
    other
        .put(&format!("/v1/volumes/{id}/files?path=/x"), &b"x"[..])
        .expect_error(404, "not_found", "other's write");
    other
        .post_empty(&format!("/v1/volumes/{id}/snapshots"))
        .expect_error(404, "not_found", "other's snapshot");
    other
        .post(&format!("/v1/volumes/{id}/fork"), &json!({"name": "mine"}))
        .expect_error(404, "not_found", "other's fork");
    let theirs = other
        .post("/v1/volumes", &json!({"name": "repo"}))
        .expect(201, "the same name in another tenant");
    other
        .delete(&format!("/v1/volumes/{}", id_of(&theirs)))
        .expect(204, "delete theirs");

    api.delete("/v1/volumes/data").expect(204, "delete by name");
    api.delete(&format!("/v1/volumes/{id}"))
        .expect(204, "delete");
    api.get(&format!("/v1/volumes/{id}"))
        .expect_error(404, "not_found", "deleted");
    api.delete(&format!("/v1/volumes/{id}"))
        .expect_error(404, "not_found", "deleted twice");
    api.post("/v1/volumes", &json!({"name": "repo"}))
        .expect(201, "the name is free again");
}

#[test]
fn volume_files_round_trip_and_never_leave_the_volume() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let secret = srv.data_dir.parent().unwrap().join("host-secret.txt");
    std::fs::write(&secret, b"host secret").unwrap();
    let id = id_of(
        &api.post("/v1/volumes", &json!({"name": "files"}))
            .expect(201, "create"),
    );
    let live = vol_dir(&srv, &id).join("fs/live");

    // Binary data, odd names, a 20 MB file.
    let bin: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let e = put(&api, &id, "/a/b/bin.dat", &bin).expect(200, "put binary");
    assert_eq!(
        (e["size"].as_u64(), e["type"].as_str()),
        (Some(70_000), Some("file")),
        "{e}"
    );
    assert_eq!(get(&api, &id, "/a/b/bin.dat").body, bin);
    for name in [
        "/odd/sp ace & ?#%.txt",
        "/odd/ünï©ødé 🦀",
        "/odd/-dash",
        "/odd/.hidden",
    ] {
        put(&api, &id, name, name.as_bytes()).expect(200, name);
        assert_eq!(get(&api, &id, name).body, name.as_bytes(), "{name}");
    }
    assert_eq!(names(&list(&api, &id, "/odd", 1)).len(), 4);
    let big: Vec<u8> = (0..20_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    put(&api, &id, "/big", &big).expect(200, "put 20 MB");
    assert!(get(&api, &id, "/big").body == big, "20 MB come back intact");
    let st = api
        .get(&format!("/v1/volumes/{id}/files/stat?path=/big"))
        .expect(200, "stat");
    assert_eq!(st["size"], 20_000_000);
    let used = api.get(&format!("/v1/volumes/{id}")).expect(200, "get")["used_bytes"]
        .as_u64()
        .unwrap();
    assert!(
        (20_000_000..21_000_000).contains(&used),
        "used_bytes counts what was written: {used}"
    );

    // mkdir, move, remove; files are root's on disk (canonical ids).
    api.post(
        &format!("/v1/volumes/{id}/files/mkdir"),
        &json!({"path": "/m/n"}),
    )
    .expect(200, "mkdir");
    api.post(
        &format!("/v1/volumes/{id}/files/move"),
        &json!({"from": "/a/b/bin.dat", "to": "/m/n/moved"}),
    )
    .expect(200, "move");
    assert_eq!(get(&api, &id, "/m/n/moved").body, bin);
    get(&api, &id, "/a/b/bin.dat").expect_error(404, "not_found", "moved away");
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(live.join("m/n/moved")).unwrap();
        assert_eq!((m.uid(), m.gid()), (0, 0));
    }
    api.delete(&format!("/v1/volumes/{id}/files?path=/big"))
        .expect(204, "remove");
    api.delete(&format!("/v1/volumes/{id}/files?path=/odd&recursive=true"))
        .expect(204, "remove a tree");
    let used = api.get(&format!("/v1/volumes/{id}")).expect(200, "get")["used_bytes"]
        .as_u64()
        .unwrap();
    assert!(used < 1_000_000, "deletes give the space back: {used}");

    // Escapes: `..`, absolute and relative symlinks planted in the tree, writes through them.
    std::os::unix::fs::symlink(&secret, live.join("abs-link")).unwrap();
    std::os::unix::fs::symlink(
        "../../../../../../../../".to_owned() + secret.to_str().unwrap().trim_start_matches('/'),
        live.join("rel-link"),
    )
    .unwrap();
    std::os::unix::fs::symlink("/", live.join("root-link")).unwrap();
    let up = format!("/../../../../../../..{}", secret.display());
    let escapes = [
        up.clone(),
        "/abs-link".into(),
        "/rel-link".into(),
        format!("/root-link{}", secret.display()),
    ];
    for p in &escapes {
        let r = get(&api, &id, p);
        assert!(
            r.status == 404 || r.status == 400,
            "{p}: {} {}",
            r.status,
            r.text()
        );
        assert!(
            !r.text().contains("host secret"),
            "{p} leaked the host file"
        );
    }
    for p in &escapes {
        let w = put(&api, &id, p, b"pwned");
        assert!(
            w.status == 200 || w.status == 404 || w.status == 400,
            "{p}: {} {}",
            w.status,
            w.text()
        );
    }
    assert_eq!(
        std::fs::read_to_string(&secret).unwrap(),
        "host secret",
        "no write reached the host file"
    );
    let r = api.get(&format!("/v1/volumes/{id}/files/list?path=/root-link/"));
    assert!(
        !r.text().contains("\"/proc\"") && !r.text().contains("\"/etc\""),
        "a link to / shows the volume, not the host: {}",
        r.text()
    );

    // Deleting the volume removes its files and stops its agent.
    let dir = vol_dir(&srv, &id);
    assert!(
        !pids_mentioning(&dir).is_empty(),
        "the volume's agent runs while its files are used"
    );
    api.delete(&format!("/v1/volumes/{id}"))
        .expect(204, "delete");
    assert!(!dir.exists(), "the volume's directory is gone");
    assert_no_filesystem_left(&dir);
    eventually("the volume's agent stops", || {
        pids_mentioning(&dir).is_empty()
    });
    let _ = std::fs::remove_file(&secret);
}

#[test]
fn the_size_limit_refuses_writes_and_leaves_nothing_partial() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = id_of(
        &api.post("/v1/volumes", &json!({"name": "small", "size_mb": 1}))
            .expect(201, "create"),
    );
    put(&api, &id, "/half", &vec![1u8; 512 * 1024]).expect(200, "within the limit");
    let msg = put(&api, &id, "/too-big", &vec![2u8; 2 << 20]).expect_error(
        413,
        "payload_too_large",
        "past the limit (declared length)",
    );
    assert!(msg.contains("size_mb"), "{msg}");
    // A body of unknown length is refused while it streams.
    let data = vec![3u8; 3 << 20];
    let mut reader = &data[..];
    let r = api.request(
        "PUT",
        &format!("/v1/volumes/{id}/files?path=/streamed"),
        &[],
        ureq::SendBody::from_reader(&mut reader),
    );
    r.expect_error(413, "payload_too_large", "past the limit (streamed)");
    // An overwrite that stays within the limit is fine (the old file's space is reused).
    put(&api, &id, "/half", &vec![4u8; 600 * 1024]).expect(200, "overwrite");
    eventually("no temporary file is left", || {
        names(&list(&api, &id, "/", 1)) == ["/half"]
    });
    let live = vol_dir(&srv, &id).join("fs/live");
    let on_disk: Vec<_> = std::fs::read_dir(&live)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(on_disk, ["half"], "nothing partial on disk");
    let used = api.get(&format!("/v1/volumes/{id}")).expect(200, "get")["used_bytes"]
        .as_u64()
        .unwrap();
    assert!((600 * 1024..=1 << 20).contains(&used), "{used}");
    api.delete(&format!("/v1/volumes/{id}"))
        .expect(204, "delete");
}

#[test]
fn ten_thousand_small_files_are_written_and_listed() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = id_of(
        &api.post("/v1/volumes", &json!({"name": "many"}))
            .expect(201, "create"),
    );
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..8 {
            let (api, id) = (api.clone(), id.clone());
            s.spawn(move || {
                for i in (t..10_000).step_by(8) {
                    put(
                        &api,
                        &id,
                        &format!("/d{:02}/f{i:05}", i % 100),
                        format!("{i}").as_bytes(),
                    )
                    .expect(200, "put a small file");
                }
            });
        }
    });
    eprintln!("10 000 small files written in {:?}", started.elapsed());
    let entries = list(&api, &id, "/", 2);
    assert_eq!(
        entries.iter().filter(|e| e["type"] == "file").count(),
        10_000
    );
    assert_eq!(entries.iter().filter(|e| e["type"] == "dir").count(), 100);
    assert_eq!(
        list(&api, &id, "/", 1).len(),
        100,
        "depth 1 lists the directories only"
    );
    assert_eq!(get(&api, &id, "/d42/f04242").text(), "4242");
    let used = api.get(&format!("/v1/volumes/{id}")).expect(200, "get")["used_bytes"]
        .as_u64()
        .unwrap();
    assert!(used >= 10_000 * 4096, "{used}");
    api.delete(&format!("/v1/volumes/{id}"))
        .expect(204, "delete");
}

#[test]
fn snapshots_and_forks_are_independent_copies() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = id_of(
        &api.post("/v1/volumes", &json!({"name": "src", "size_mb": 32}))
            .expect(201, "create"),
    );
    put(&api, &id, "/code/main.py", b"print(1)\n").expect(200, "put");
    put(&api, &id, "/blob", &vec![9u8; 1 << 20]).expect(200, "put");

    let snap = api
        .post_empty(&format!("/v1/volumes/{id}/snapshots"))
        .expect(201, "snapshot");
    assert!(id_of(&snap).starts_with("snap_"), "{snap}");
    assert_eq!(snap["volume_id"], id.as_str());
    assert!(snap["size_bytes"].as_u64().unwrap() >= 1 << 20, "{snap}");
    let fork = api
        .post(&format!("/v1/volumes/{id}/fork"), &json!({"name": "copy"}))
        .expect(201, "fork");
    let fid = id_of(&fork);
    assert_eq!(
        (fork["name"].as_str(), fork["size_mb"].as_u64()),
        (Some("copy"), Some(32)),
        "{fork}"
    );
    assert!(fork["used_bytes"].as_u64().unwrap() >= 1 << 20, "{fork}");
    api.post(&format!("/v1/volumes/{id}/fork"), &json!({"name": "copy"}))
        .expect_error(409, "conflict", "a fork needs a new name");
    api.post(&format!("/v1/volumes/{id}/fork"), &json!({}))
        .expect_error(400, "bad_request", "a fork needs a name");

    assert_eq!(get(&api, &fid, "/code/main.py").text(), "print(1)\n");
    put(&api, &id, "/code/main.py", b"print(2)\n").expect(200, "change the source");
    put(&api, &fid, "/blob", b"small").expect(200, "change the fork");
    assert_eq!(
        get(&api, &fid, "/code/main.py").text(),
        "print(1)\n",
        "the fork does not see the source's change"
    );
    assert_eq!(
        get(&api, &id, "/blob").body.len(),
        1 << 20,
        "the source does not see the fork's change"
    );
    let snap_tree = vol_dir(&srv, &id)
        .join("fs/snapshots")
        .join(id_of(&snap))
        .join("live");
    assert_eq!(
        std::fs::read_to_string(snap_tree.join("code/main.py")).unwrap(),
        "print(1)\n",
        "the snapshot keeps its point"
    );

    api.delete("/v1/volumes/src")
        .expect(204, "delete the source");
    assert_eq!(
        get(&api, &fid, "/code/main.py").text(),
        "print(1)\n",
        "the fork outlives its source"
    );
    api.delete(&format!("/v1/volumes/{fid}"))
        .expect(204, "delete the fork");
}

#[test]
fn a_restarted_server_keeps_volumes_and_their_files() {
    become_subreaper();
    let mut srv = Server::start();
    let api = srv.api();
    let id = id_of(
        &api.post("/v1/volumes", &json!({"name": "keep", "size_mb": 8}))
            .expect(201, "create"),
    );
    put(&api, &id, "/k/v", &vec![5u8; 100_000]).expect(200, "put");
    let before = api.get(&format!("/v1/volumes/{id}")).expect(200, "get")["used_bytes"]
        .as_u64()
        .unwrap();
    let dir = vol_dir(&srv, &id);
    let old_agents = pids_mentioning(&dir);
    assert_eq!(old_agents.len(), 1, "one agent per volume: {old_agents:?}");

    srv.restart(); // SIGKILL: the old agent is left behind, the new server stops it
    let api = srv.api();
    eventually("the stale agent is stopped", || {
        !old_agents
            .iter()
            .any(|p| Path::new(&format!("/proc/{p}")).exists() && pids_mentioning(&dir).contains(p))
    });
    let v = api.get("/v1/volumes/keep").expect(200, "get after restart");
    assert_eq!(v["id"], id.as_str());
    let after = v["used_bytes"].as_u64().unwrap();
    // Measured again at start: the same within the blocks of the directories made as parents.
    assert!(
        after.abs_diff(before) <= 8192,
        "used_bytes {before} before the restart, {after} after"
    );
    assert_eq!(get(&api, &id, "/k/v").body, vec![5u8; 100_000]);
    api.delete(&format!("/v1/volumes/{id}"))
        .expect(204, "delete");
    eventually("no agent is left", || pids_mentioning(&dir).is_empty());
}

#[test]
fn a_sandbox_writing_past_the_size_limit_gets_enospc_and_the_volume_stays_whole() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = id_of(
        &api.post("/v1/volumes", &json!({"name": "tight", "size_mb": 64}))
            .expect(201, "create"),
    );
    put(&api, &id, "/keep.txt", b"kept\n").expect(200, "put");
    let sb = api.create_sandbox(&json!({"volumes": [{"volume": id, "path": "/workspace"}]}));
    let sb = sb["id"].as_str().unwrap().to_owned();
    // 100 MiB into a 64 MiB volume, through the sandbox's mount: the kernel refuses.
    let r = api.exec(
        &sb,
        &json!({"shell": "dd if=/dev/zero of=/workspace/fill bs=1M count=100 conv=fsync"}),
    );
    assert_ne!(r["exit_code"], 0, "{r}");
    assert!(
        r["stderr"]
            .as_str()
            .unwrap()
            .contains("No space left on device"),
        "{r}"
    );
    let fill: u64 = api
        .sh(&sb, "stat -c %s /workspace/fill")
        .trim()
        .parse()
        .unwrap();
    assert!(fill <= 64 << 20, "at most size_mb was written: {fill}");
    // The volume is whole: its files read back, and writes work again once space is freed.
    assert_eq!(get(&api, &id, "/keep.txt").text(), "kept\n");
    assert_eq!(api.sh(&sb, "cat /workspace/keep.txt"), "kept\n");
    api.sh(&sb, "rm /workspace/fill");
    eventually("the space comes back", || {
        api.exec(
            &sb,
            &json!({"shell": "dd if=/dev/zero of=/workspace/again bs=1M count=16 conv=fsync status=none"}),
        )["exit_code"]
            == 0
    });
    put(&api, &id, "/after.txt", b"after\n").expect(200, "the files API writes again");
    let r = api
        .post(
            &format!("/v1/volumes/{id}/run"),
            &json!({"shell": "cat keep.txt after.txt; echo r > run.txt"}),
        )
        .expect(200, "run");
    assert_eq!(r["stdout"], "kept\nafter\n", "{r}");
    assert_eq!(r["changes"]["committed"], true, "{r}");
    // A run is held to the same filesystem: it cannot write past size_mb either.
    let r = api
        .post(
            &format!("/v1/volumes/{id}/run"),
            &json!({"shell": "dd if=/dev/zero of=big bs=1M count=100 status=none"}),
        )
        .expect(200, "run");
    assert_ne!(r["exit_code"], 0, "{r}");
    assert!(
        r["stderr"]
            .as_str()
            .unwrap()
            .contains("No space left on device"),
        "{r}"
    );
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the sandbox");
    let dir = vol_dir(&srv, &id);
    api.delete(&format!("/v1/volumes/{id}"))
        .expect(204, "delete");
    assert!(!dir.exists());
    assert_no_filesystem_left(&dir);
}
