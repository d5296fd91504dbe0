//! Serverless runs (`POST /v1/volumes/{id}/run`) through the real server: a fresh machine
//! per call on a volume, its changes listed and committed (or not) atomically, parallel runs
//! and conflicts, NDJSON, a server killed mid-commit, big trees, bad bodies, call records,
//! a run's view that in-place writes of a mounting sandbox do not reach.
//! After every test no machine, cgroup, run directory or process of its runs is left.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::time::{Duration, Instant};

use locker_tests::server::{enc, Api, Resp, Server};
use serde_json::{json, Value};

fn new_volume(api: &Api, name: &str) -> String {
    let v = api
        .post("/v1/volumes", &json!({ "name": name }))
        .expect(201, "create a volume");
    v["id"].as_str().unwrap().to_owned()
}

fn put(api: &Api, vol: &str, path: &str, data: &[u8]) {
    api.put(&format!("/v1/volumes/{vol}/files?path={}", enc(path)), data)
        .expect(200, "upload");
}

fn get(api: &Api, vol: &str, path: &str) -> Resp {
    api.get(&format!("/v1/volumes/{vol}/files?path={}", enc(path)))
}

fn run(api: &Api, vol: &str, body: &Value) -> Value {
    api.post(&format!("/v1/volumes/{vol}/run"), body)
        .expect(200, "run")
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

/// Every file under the volume (path → content), read through the files API.
fn tree(api: &Api, vol: &str) -> Vec<(String, Vec<u8>)> {
    let v = api
        .get(&format!("/v1/volumes/{vol}/files/list?path=/&depth=16"))
        .expect(200, "list");
    let mut out: Vec<(String, Vec<u8>)> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "file")
        .map(|e| {
            let p = e["path"].as_str().unwrap().to_owned();
            let body = get(api, vol, &p).body;
            (p, body)
        })
        .collect();
    out.sort();
    out
}

/// The directories that hold runs' layers and views: the data dir's `runs/` (older
/// servers) and every volume's `fs/runs/`.
fn run_dirs(s: &Server) -> Vec<std::path::PathBuf> {
    let mut out = vec![s.data_dir.join("runs")];
    for e in std::fs::read_dir(s.data_dir.join("volumes"))
        .into_iter()
        .flatten()
        .flatten()
    {
        out.push(e.path().join("fs/runs"));
    }
    out
}

/// Asserts nothing of the runs `calls` is left: their directories, cgroups, processes.
fn assert_clean(s: &Server, calls: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let runs = s.data_dir.join("runs");
        let dirs: Vec<String> = calls
            .iter()
            .filter(|c| run_dirs(s).iter().any(|d| d.join(c).exists()))
            .cloned()
            .collect();
        let cgroups: Vec<String> = calls
            .iter()
            .filter(|c| {
                [
                    "/sys/fs/cgroup",
                    "/sys/fs/cgroup/pids",
                    "/sys/fs/cgroup/memory",
                ]
                .iter()
                .any(|d| locker_tests::machine_cgroup(Path::new(d), c).is_some())
            })
            .cloned()
            .collect();
        let procs = pids_mentioning(&runs);
        let mounts: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(runs.to_str().unwrap()))
            .map(str::to_owned)
            .collect();
        if dirs.is_empty() && cgroups.is_empty() && procs.is_empty() && mounts.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            panic!("left behind: run dirs {dirs:?}, cgroups {cgroups:?}, processes {procs:?}, mounts {mounts:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn pids_mentioning(needle: &Path) -> Vec<i32> {
    let needle = needle.as_os_str().as_encoded_bytes();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmd.windows(needle.len()).any(|w| w == needle) {
            out.push(pid);
        }
    }
    out
}

fn call_id(r: &Value) -> String {
    r["call_id"].as_str().unwrap().to_owned()
}

#[test]
fn a_run_sees_the_volume_and_commits_its_changes() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "repo");
    put(&api, &vol, "/a.txt", b"hello");
    put(&api, &vol, "/keep", b"kept");
    put(&api, &vol, "/old/y", b"y");
    put(&api, &vol, "/old/sub/z", b"z");
    put(&api, &vol, "/rm/w", b"w");
    put(&api, &vol, "/src/m", b"m");
    let r = run(
        &api,
        &vol,
        &json!({"shell": "pwd; cat a.txt; echo mod > a.txt; echo new > b.txt; mv old renamed; rm -rf rm; echo more >> src/m; mkdir -p d/e && echo q > d/e/q"}),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["stdout"], "/workspace\nhello", "{r}");
    let ch = &r["changes"];
    assert_eq!(ch["committed"], true, "{r}");
    assert_eq!(
        strs(&ch["added"]),
        vec![
            "/b.txt",
            "/d",
            "/d/e",
            "/d/e/q",
            "/renamed",
            "/renamed/sub",
            "/renamed/sub/z",
            "/renamed/y"
        ],
        "{r}"
    );
    assert_eq!(strs(&ch["modified"]), vec!["/a.txt", "/src/m"], "{r}");
    assert_eq!(strs(&ch["deleted"]), vec!["/old", "/rm"], "{r}");
    assert!(strs(&ch["conflicts"]).is_empty());
    let files = tree(&api, &vol);
    let want: Vec<(String, Vec<u8>)> = [
        ("/a.txt", "mod\n"),
        ("/b.txt", "new\n"),
        ("/d/e/q", "q\n"),
        ("/keep", "kept"),
        ("/renamed/sub/z", "z"),
        ("/renamed/y", "y"),
        ("/src/m", "mmore\n"),
    ]
    .iter()
    .map(|(p, c)| (p.to_string(), c.as_bytes().to_vec()))
    .collect();
    assert_eq!(files, want);
    // Files written by the run are root's on the volume (canonical ids), readable by the
    // next run as root's.
    let r2 = run(
        &api,
        &vol,
        &json!({"shell": "stat -c '%u %g' b.txt renamed/y; ls -ld /workspace | cut -c1-10"}),
    );
    assert_eq!(r2["stdout"], "0 0\n0 0\ndrwxr-xr-x\n", "{r2}");
    assert_eq!(r2["changes"]["committed"], true);
    assert!(strs(&r2["changes"]["added"]).is_empty());
    // The run's overlay passes no sync to the volume's filesystem (`volatile`: its upper
    // layer is the run's own, and the commit flushes the volume itself); a command's
    // `sync` still succeeds, and what it wrote is committed.
    let r3 = run(
        &api,
        &vol,
        &json!({"shell": "grep ' /workspace ' /proc/self/mounts | grep -c volatile; echo s > synced && sync synced && echo ok"}),
    );
    assert_eq!(r3["stdout"], "1\nok\n", "{r3}");
    assert_eq!(strs(&r3["changes"]["added"]), vec!["/synced"], "{r3}");
    assert_eq!(get(&api, &vol, "/synced").body, b"s\n");

    // The call record lists the changes.
    let calls = api
        .get(&format!("/v1/calls?volume_id={vol}"))
        .expect(200, "calls");
    let rec = calls["calls"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == r["call_id"])
        .unwrap_or_else(|| panic!("no record of {} in {calls}", r["call_id"]))
        .clone();
    assert_eq!(rec["kind"], "run");
    assert_eq!(rec["volume_id"], vol.as_str());
    assert_eq!(rec["changes"]["deleted"], json!(["/old", "/rm"]), "{rec}");
    assert_eq!(rec["changes"]["modified"], json!(["/a.txt", "/src/m"]));
    let used = api.get(&format!("/v1/volumes/{vol}")).expect(200, "get")["used_bytes"]
        .as_u64()
        .unwrap();
    assert!(used > 0);
    assert_clean(&s, &[call_id(&r), call_id(&r2), call_id(&r3)]);
}

/// A run's command that leaves writers behind (a job, a `setsid` double fork, one that moved
/// to a cgroup of its own) gets them all killed before its changes are read: what the run
/// committed is what the volume keeps, and nothing writes to it afterwards.
/// A run's machine keeps what it writes outside its volume in memory (on kernels that can
/// id-map a tmpfs, 6.3 and later; a disk image elsewhere): its root's writable layer is as
/// big as `/tmp` (half the run's memory), a write past it fails with ENOSPC inside the
/// machine, ids inside are the machine's own, nothing of it reaches the volume, and the
/// machine's directory never holds a disk image. From the warm pool and from a fresh
/// machine (`--warm-pool 0`) alike; `locker doctor` says which layer runs get.
#[test]
fn a_runs_own_writes_stay_in_memory_as_big_as_tmp_and_never_reach_the_volume() {
    let in_memory = locker_runtime::jail::memory_scratch();
    for flags in [&[][..], &["--warm-pool", "0"][..]] {
        let s = Server::start_with(flags);
        let api = s.api();
        let vol = new_volume(&api, "scratch");
        let script = "df -m / /tmp | awk 'NR>1 {print $2}'; \
            echo x > /root/own && stat -c '%u:%g' /root/own; \
            if head -c 300M /dev/zero > /root/big 2>/tmp/err; then echo wrote; else cat /tmp/err; fi; \
            rm -f /root/big; echo kept > /workspace/kept";
        let r = run(
            &api,
            &vol,
            &json!({ "cmd": ["sh", "-c", script], "memory_mb": 512 }),
        );
        assert_eq!(r["exit_code"], 0, "{flags:?}: {r}");
        let out = r["stdout"].as_str().unwrap().to_owned();
        let lines: Vec<&str> = out.lines().collect();
        let (root_mb, tmp_mb): (u64, u64) = (lines[0].parse().unwrap(), lines[1].parse().unwrap());
        assert_eq!(
            lines[2], "0:0",
            "{flags:?}: the machine's root owns its files: {out}"
        );
        if in_memory {
            assert_eq!(
                root_mb, tmp_mb,
                "{flags:?}: the layer is sized like /tmp: {out}"
            );
            assert_eq!(root_mb, 256, "{flags:?}: half of 512 MB: {out}");
            assert!(
                lines[3].contains("No space left on device"),
                "{flags:?}: 300 MB past a 256 MB layer: {out}"
            );
        } else {
            assert!(
                root_mb > 1500,
                "{flags:?}: a 2048 MB disk without id-mapped tmpfs: {out}"
            );
            assert_eq!(lines[3], "wrote", "{flags:?}: {out}");
        }
        assert_eq!(
            strs(&r["changes"]["added"]),
            ["/kept"],
            "{flags:?}: only the volume's file is committed: {r}"
        );
        // No run's machine (nor a warm one) ever held a disk image.
        if in_memory {
            let images: Vec<_> = std::fs::read_dir(s.data_dir.join("pool"))
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.path().join("disk.img").exists())
                .map(|e| e.path())
                .collect();
            assert!(
                images.is_empty(),
                "{flags:?}: disk images in the pool: {images:?}"
            );
        }
        assert_clean(&s, &[call_id(&r)]);
    }
    // `locker doctor` says which this host gives.
    let out = std::process::Command::new(locker_tests::locker_bin())
        .args(["doctor", "--json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let said = v["host"]["run_layer"].as_str().unwrap();
    let want = if in_memory { "memory:" } else { "disk:" };
    assert!(said.starts_with(want), "doctor says {said:?}");
}

#[test]
fn nothing_a_run_leaves_running_writes_to_its_volume_after_the_commit() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "writers");
    let script = "(while :; do echo x >> job.log; sleep 0.01; done) & \
        setsid sh -c '(while :; do echo x >> session.log; sleep 0.01; done) &'; \
        (setsid sh -c 'for d in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do mkdir -p $d/esc && echo $$ > $d/esc/cgroup.procs; done 2>/dev/null; \
         while :; do echo x >> stray.log; sleep 0.01; done' &); \
        sleep 0.5; echo started";
    let mut calls = Vec::new();
    for _ in 0..3 {
        let r = run(&api, &vol, &json!({ "shell": script }));
        assert_eq!(
            (r["exit_code"].as_i64(), r["stdout"].as_str()),
            (Some(0), Some("started\n")),
            "{r}"
        );
        assert_eq!(r["changes"]["committed"], true, "{r}");
        calls.push(call_id(&r));
        let first = tree(&api, &vol);
        let names: Vec<&str> = first.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(names, ["/job.log", "/session.log", "/stray.log"], "{r}");
        assert!(first.iter().all(|(_, b)| !b.is_empty()), "{r}");
        std::thread::sleep(Duration::from_millis(600));
        assert!(
            tree(&api, &vol) == first,
            "the volume changed after the run's answer"
        );
    }
    assert_clean(&s, &calls);
}

#[test]
fn commit_modes_on_success_and_never() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "modes");
    let r = run(
        &api,
        &vol,
        &json!({"shell": "echo 1 > f; exit 1", "commit": "on_success"}),
    );
    assert_eq!(r["exit_code"], 1);
    assert_eq!(r["changes"]["committed"], false, "{r}");
    assert_eq!(strs(&r["changes"]["added"]), vec!["/f"]);
    assert_eq!(get(&api, &vol, "/f").status, 404);
    let r2 = run(
        &api,
        &vol,
        &json!({"shell": "echo 2 > f", "commit": "never"}),
    );
    assert_eq!(r2["changes"]["committed"], false);
    assert_eq!(get(&api, &vol, "/f").status, 404);
    let r3 = run(
        &api,
        &vol,
        &json!({"cmd": ["sh", "-c", "echo 3 > f"], "commit": "on_success"}),
    );
    assert_eq!(r3["changes"]["committed"], true);
    assert_eq!(get(&api, &vol, "/f").body, b"3\n");
    let r4 = run(&api, &vol, &json!({"shell": "echo 4 > f; exit 3"}));
    assert_eq!(r4["exit_code"], 3);
    assert_eq!(
        r4["changes"]["committed"], true,
        "always commits whatever the exit"
    );
    assert_eq!(get(&api, &vol, "/f").body, b"4\n");
    assert_clean(&s, &[call_id(&r), call_id(&r2), call_id(&r3), call_id(&r4)]);
}

#[test]
fn parallel_runs_each_commit_their_own_files() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "par");
    put(&api, &vol, "/shared", b"s");
    let t0 = Instant::now();
    let results: Vec<Value> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..5)
            .map(|i| {
                let (api, vol) = (api.with_key(Some(&s.api_key)), vol.clone());
                sc.spawn(move || {
                    run(
                        &api,
                        &vol,
                        &json!({"shell": format!("cat shared; sleep 1; echo {i} > out{i}")}),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wall = t0.elapsed();
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r["stdout"], "s", "{r}");
        assert_eq!(r["changes"]["committed"], true, "{r}");
        assert_eq!(strs(&r["changes"]["added"]), vec![format!("/out{i}")]);
        assert!(strs(&r["changes"]["conflicts"]).is_empty(), "{r}");
    }
    for i in 0..5 {
        assert_eq!(
            get(&api, &vol, &format!("/out{i}")).body,
            format!("{i}\n").as_bytes()
        );
    }
    assert!(
        wall < Duration::from_secs(5),
        "5 runs of 1 s overlapped: {wall:?}"
    );
    eprintln!("5 parallel 1 s runs took {wall:?}");
    let ids: Vec<String> = results.iter().map(call_id).collect();
    assert_clean(&s, &ids);
}

#[test]
fn conflicting_runs_report_one_conflict_and_never_mix() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "conf");
    put(&api, &vol, "/same", b"orig");
    let results: Vec<Value> = std::thread::scope(|sc| {
        let hs: Vec<_> = ["a", "b"]
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (api, vol) = (api.with_key(Some(&s.api_key)), vol.clone());
                let c = c.to_string();
                sc.spawn(move || {
                    // Both start before either commits; the second ends later.
                    let script = format!(
                        "sleep {}; head -c 3000000 /dev/zero | tr '\\0' '{c}' > same",
                        1 + i
                    );
                    run(&api, &vol, &json!({ "shell": script }))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let conflicts: Vec<Vec<String>> = results
        .iter()
        .map(|r| strs(&r["changes"]["conflicts"]))
        .collect();
    assert_eq!(
        conflicts.iter().filter(|c| !c.is_empty()).count(),
        1,
        "{results:?}"
    );
    assert_eq!(conflicts.concat(), vec!["/same"]);
    let body = get(&api, &vol, "/same").body;
    assert_eq!(body.len(), 3_000_000);
    assert!(
        body.iter().all(|b| *b == body[0]),
        "one run's whole content"
    );
    assert_eq!(body[0], b'b', "last writer wins");
    // on_success refuses a conflicting commit.
    let ids: Vec<String> = results.iter().map(call_id).collect();
    assert_clean(&s, &ids);
}

#[test]
fn a_run_streams_ndjson() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "stream");
    let t0 = Instant::now();
    let (status, _, r) = api
        .open(
            "POST",
            &format!("/v1/volumes/{vol}/run"),
            &[
                ("Content-Type", "application/json"),
                ("Accept", "application/x-ndjson"),
            ],
            serde_json::to_vec(&json!({"shell": "echo one; sleep 1; echo two; echo x > f"}))
                .unwrap(),
        )
        .unwrap();
    assert_eq!(status, 200);
    let mut lines = Vec::new();
    for l in BufReader::new(r).lines() {
        let l = l.unwrap();
        if !l.trim().is_empty() {
            lines.push((t0.elapsed(), serde_json::from_str::<Value>(&l).unwrap()));
        }
    }
    let first = lines.iter().find(|(_, v)| v["type"] == "stdout").unwrap();
    let last = &lines.last().unwrap().1;
    assert_eq!(last["type"], "result", "{lines:?}");
    assert!(
        first.0 + Duration::from_millis(700) < lines.last().unwrap().0,
        "output streamed before the end: {lines:?}"
    );
    assert_eq!(last["changes"]["added"], json!(["/f"]));
    assert_eq!(last["changes"]["committed"], true);
    assert_eq!(get(&api, &vol, "/f").body, b"x\n");
    assert_clean(&s, &[call_id(last)]);
}

#[test]
fn a_server_killed_mid_commit_leaves_the_volume_before_or_after() {
    let mut s = Server::start_with_env(&[], &[("LOCKER_TEST_COMMIT_DELAY_MS", "200")]);
    let api = s.api();
    let vol = new_volume(&api, "crash");
    for i in 0..10 {
        put(&api, &vol, &format!("/f{i}"), b"before");
    }
    let before = tree(&api, &vol);
    let url = s.url.clone();
    let key = s.api_key.clone();
    let v2 = vol.clone();
    let h = std::thread::spawn(move || {
        Api::new(&url, Some(&key)).try_request(
            "POST",
            &format!("/v1/volumes/{v2}/run"),
            &[("Content-Type", "application/json")],
            serde_json::to_vec(&json!({"shell": "for i in 0 1 2 3 4 5 6 7 8 9; do echo after > f$i; echo new > g$i; done"})).unwrap(),
        )
    });
    let journal = s
        .data_dir
        .join("volumes")
        .join(&vol)
        .join("fs/commit.journal");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !journal.exists() {
        assert!(Instant::now() < deadline, "no commit started");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(500));
    s.kill9();
    let _ = h.join();
    // Mid-apply: some ops done, some not.
    s.set_env(&[]);
    s.restart();
    let api = s.api();
    let after = tree(&api, &vol);
    let mut want_after: Vec<(String, Vec<u8>)> = (0..10)
        .flat_map(|i| {
            [
                (format!("/f{i}"), b"after\n".to_vec()),
                (format!("/g{i}"), b"new\n".to_vec()),
            ]
        })
        .collect();
    want_after.sort();
    assert!(after == want_after || after == before, "a mix: {after:?}");
    assert_eq!(
        after, want_after,
        "the journal was written: the commit is finished"
    );
    assert!(!journal.exists());
    let runs: Vec<_> = run_dirs(&s)
        .iter()
        .flat_map(|d| {
            std::fs::read_dir(d)
                .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
                .unwrap_or_default()
        })
        .collect();
    assert!(runs.is_empty(), "left: {runs:?}");
    assert!(pids_mentioning(&s.data_dir.join("runs")).is_empty());
}

#[test]
fn other_tenants_volume_is_404_and_bad_bodies_name_the_field() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "mine");
    let (other, _) = s.create_tenant(&locker_tests::unique("t"));
    other
        .post(&format!("/v1/volumes/{vol}/run"), &json!({"shell": "true"}))
        .expect_error(404, "not_found", "another tenant's volume");
    for (body, field) in [
        (json!({"shell": "true", "timeout_ms": 300001}), "timeout_ms"),
        (json!({"shell": "true", "mount_path": "work"}), "mount_path"),
        (json!({"shell": "true", "mount_path": "/"}), "mount_path"),
        (json!({"shell": "true", "commit": "sometimes"}), "commit"),
        (json!({"shell": "true", "bogus": 1}), "bogus"),
        (json!({"commit": "never"}), "cmd"),
    ] {
        let m = api
            .post(&format!("/v1/volumes/{vol}/run"), &body)
            .expect_error(400, "bad_request", "a bad body");
        assert!(m.contains(field), "{body}: {m}");
    }
    let r = run(
        &api,
        &vol,
        &json!({"shell": "pwd", "mount_path": "/data/v", "timeout_ms": 300000}),
    );
    assert_eq!(r["stdout"], "/data/v\n");
    assert_clean(&s, &[call_id(&r)]);
}

#[test]
fn the_runs_quota_answers_429() {
    let s = Server::start_with(&["--quota-runs", "1"]);
    let api = s.api();
    let vol = new_volume(&api, "q");
    let r = std::thread::scope(|sc| {
        let (a, v) = (api.with_key(Some(&s.api_key)), vol.clone());
        let h = sc.spawn(move || run(&a, &v, &json!({"shell": "sleep 2"})));
        std::thread::sleep(Duration::from_millis(800));
        let m = api
            .post(&format!("/v1/volumes/{vol}/run"), &json!({"shell": "true"}))
            .expect_error(429, "quota_exceeded", "a second run");
        assert!(m.contains("runs"), "{m}");
        h.join().unwrap()
    });
    assert_eq!(r["exit_code"], 0);
    assert_clean(&s, &[call_id(&r)]);
}

#[test]
fn a_100_mb_file_and_10000_small_files_commit() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "big");
    let t0 = Instant::now();
    let r = run(
        &api,
        &vol,
        &json!({"shell": "head -c 104857600 /dev/urandom > big && sha256sum big | cut -d' ' -f1 && mkdir many && cd many && i=0; while [ $i -lt 10000 ]; do echo $i > f$i; i=$((i+1)); done", "timeout_ms": 300000}),
    );
    eprintln!(
        "100 MB + 10 000 files run took {:?} ({})",
        t0.elapsed(),
        r["timings"]
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["changes"]["committed"], true);
    assert_eq!(r["changes"]["added"].as_array().unwrap().len(), 10_002);
    let stat = api
        .get(&format!("/v1/volumes/{vol}/files/stat?path=/big"))
        .expect(200, "stat");
    assert_eq!(stat["size"], 104_857_600);
    let sum = r["stdout"].as_str().unwrap().trim().to_owned();
    let r2 = run(
        &api,
        &vol,
        &json!({"shell": "sha256sum big | cut -d' ' -f1; ls many | wc -l; cat many/f9999"}),
    );
    assert_eq!(r2["stdout"], format!("{sum}\n10000\n9999\n"), "{r2}");
    let used = api.get(&format!("/v1/volumes/{vol}")).expect(200, "get")["used_bytes"]
        .as_u64()
        .unwrap();
    assert!(used >= 104_857_600, "used_bytes counts the commit: {used}");
    assert_clean(&s, &[call_id(&r), call_id(&r2)]);
}

#[test]
fn a_commit_past_the_size_limit_is_not_applied() {
    let s = Server::start();
    let api = s.api();
    let v = api
        .post("/v1/volumes", &json!({"name": "small", "size_mb": 1}))
        .expect(201, "create");
    let vol = v["id"].as_str().unwrap().to_owned();
    let r = run(
        &api,
        &vol,
        &json!({"shell": "head -c 3000000 /dev/zero > big"}),
    );
    assert_eq!(r["changes"]["committed"], false, "{r}");
    assert!(
        r["changes"]["commit_error"]
            .as_str()
            .unwrap()
            .contains("full"),
        "{r}"
    );
    assert_eq!(get(&api, &vol, "/big").status, 404);
    assert_clean(&s, &[call_id(&r)]);
}

#[test]
fn the_cli_runs_on_a_volume_and_lists_the_changes() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "cli");
    put(&api, &vol, "/old", b"o");
    let out = std::process::Command::new(locker_tests::locker_bin())
        .args([
            "run", "--volume", "cli", "--commit", "always", "--", "sh", "-c",
        ])
        .arg("echo hi; echo n > new; rm old; exit 3")
        .env("LOCKER_URL", &s.url)
        .env("LOCKER_API_KEY", &s.api_key)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
    assert!(err.contains("+ /new") && err.contains("- /old"), "{err}");
    assert_eq!(get(&api, &vol, "/new").body, b"n\n");
}

#[test]
fn sandboxes_mounting_a_volume_share_one_live_tree_and_see_run_commits() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "shared");
    put(&api, &vol, "/seed.txt", b"seed\n");
    let a = api.create_sandbox(&json!({"volumes": [{"volume": "shared", "path": "/workspace"}]}));
    let a = a["id"].as_str().unwrap().to_owned();
    let b = api
        .create_sandbox(&json!({"volumes": [{"volume": vol, "path": "/data", "read_only": true}]}));
    let b_id = b["id"].as_str().unwrap().to_owned();
    assert_eq!(b["volumes"][0]["volume"], vol.as_str());
    assert_eq!(b["volumes"][0]["read_only"], true);
    // One live tree: a write in one sandbox is seen at once by the other and by the files API.
    assert_eq!(
        api.sh(
            &a,
            "cat /workspace/seed.txt; echo from-a > /workspace/a.txt; stat -c %u /workspace/a.txt"
        ),
        "seed\n0\n"
    );
    assert_eq!(api.sh(&b_id, "cat /data/a.txt"), "from-a\n");
    assert_eq!(get(&api, &vol, "/a.txt").text(), "from-a\n");
    // Read-only means read-only.
    let r = api.exec(&b_id, &json!({"shell": "echo x > /data/b.txt"}));
    assert_ne!(r["exit_code"], 0, "{r}");
    // A run's commit appears in the mounting sandboxes.
    let r = run(&api, &vol, &json!({"shell": "echo committed > run.txt"}));
    assert_eq!(r["changes"]["committed"], true, "{r}");
    assert_eq!(api.sh(&a, "cat /workspace/run.txt"), "committed\n");
    assert_eq!(api.sh(&b_id, "cat /data/run.txt"), "committed\n");
    // A mounted volume cannot be deleted; once no sandbox mounts it, it can.
    api.delete(&format!("/v1/volumes/{vol}"))
        .expect_error(409, "conflict", "sb_");
    api.delete(&format!("/v1/sandboxes/{a}"))
        .expect(204, "delete a");
    api.delete(&format!("/v1/volumes/{vol}"))
        .expect_error(409, "conflict", "sb_");
    api.delete(&format!("/v1/sandboxes/{b_id}"))
        .expect(204, "delete b");
    api.delete(&format!("/v1/volumes/{vol}"))
        .expect(204, "delete the volume");
    // Bad mounts name the field.
    let v2 = new_volume(&api, "other");
    for (body, needle) in [
        (
            json!({"volumes": [{"volume": v2, "path": "relative"}]}),
            "volumes[0].path",
        ),
        (
            json!({"volumes": [{"volume": v2, "path": "/proc/x"}]}),
            "volumes[0].path",
        ),
        (
            json!({"volumes": [{"volume": v2, "path": "/w"}, {"volume": v2, "path": "/w/x"}]}),
            "overlaps",
        ),
        (
            json!({"volumes": [{"volume": "nope", "path": "/w"}]}),
            "nope",
        ),
        (json!({"volumes": [{"volume": v2, "mode": "rw"}]}), "mode"),
    ] {
        let r = api.post("/v1/sandboxes", &body);
        assert!(r.status == 400 || r.status == 404, "{body}: {}", r.text());
        assert!(r.text().contains(needle), "{body}: {}", r.text());
    }
}

#[test]
fn warm_machines_follow_the_shapes_runs_ask_for() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "warm");
    // The default shape is warm from the start: its runs get a pooled machine.
    std::thread::sleep(Duration::from_millis(1500));
    let r = run(&api, &vol, &json!({"cmd": ["hostname"]}));
    assert!(r["stdout"].as_str().unwrap().starts_with("pool_"), "{r}");
    // A new shape starts a machine of its own once, then is kept warm too.
    let r = run(&api, &vol, &json!({"cmd": ["hostname"], "memory_mb": 256}));
    assert!(r["stdout"].as_str().unwrap().starts_with("call_"), "{r}");
    std::thread::sleep(Duration::from_millis(1500));
    let r = run(
        &api,
        &vol,
        &json!({"cmd": ["sh", "-c", "hostname; echo warm > w.txt"], "memory_mb": 256}),
    );
    assert!(r["stdout"].as_str().unwrap().starts_with("pool_"), "{r}");
    assert_eq!(
        r["changes"]["added"],
        json!(["/w.txt"]),
        "a pooled machine commits like any other"
    );
}

/// Starts a streamed run of `shell` on `vol` that prints `started` first; returns once that
/// line came (the run's view of the volume is taken), with the thread that reads the rest
/// and returns the final result line.
fn start_run(api: &Api, vol: &str, shell: &str) -> std::thread::JoinHandle<Value> {
    let (status, _, r) = api
        .open(
            "POST",
            &format!("/v1/volumes/{vol}/run"),
            &[
                ("Content-Type", "application/json"),
                ("Accept", "application/x-ndjson"),
            ],
            serde_json::to_vec(&json!({ "shell": format!("echo started; {shell}") })).unwrap(),
        )
        .unwrap();
    assert_eq!(status, 200);
    let mut lines = BufReader::new(r).lines();
    loop {
        let l = lines.next().expect("the run ended early").unwrap();
        if l.contains("started") {
            break;
        }
    }
    std::thread::spawn(move || {
        let mut last = Value::Null;
        for l in lines {
            let l = l.unwrap();
            if !l.trim().is_empty() {
                last = serde_json::from_str(&l).unwrap();
            }
        }
        last
    })
}

#[test]
fn a_run_does_not_see_in_place_writes_of_a_mounting_sandbox() {
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "inplace");
    put(&api, &vol, "/data.txt", b"original\n");
    let sb = api.create_sandbox(&json!({"volumes": [{"volume": vol, "path": "/workspace"}]}));
    let sb = sb["id"].as_str().unwrap().to_owned();
    // Twice: a small tree (the run's view is a reflink copy), then one of more files than
    // a reflink view takes (a read-only snapshot of the volume's filesystem).
    let mut calls = Vec::new();
    for (round, text) in [(0, "CHANGED1"), (1, "CHANGED2")] {
        if round == 1 {
            api.sh(
                &sb,
                "mkdir -p /workspace/many && for i in $(seq 400); do echo $i > /workspace/many/f$i; done",
            );
        }
        let h = start_run(
            &api,
            &vol,
            "sleep 2; cat data.txt; cat many/f7 2>/dev/null; true",
        );
        // In place: the same inode, overwritten (no rename), as editors and databases do.
        let ino = api.sh(&sb, "stat -c %i /workspace/data.txt");
        api.sh(
            &sb,
            &format!("printf {text} | dd of=/workspace/data.txt conv=notrunc status=none; echo x > /workspace/many/f7 2>/dev/null; true"),
        );
        assert_eq!(
            api.sh(&sb, "stat -c %i /workspace/data.txt"),
            ino,
            "written in place"
        );
        let r = h.join().unwrap();
        assert_eq!(r["type"], "result", "{r}");
        assert_eq!(r["exit_code"], 0, "{r}");
        let want = if round == 0 {
            "started\noriginal\n".to_owned()
        } else {
            "started\nCHANGED1\n7\n".to_owned()
        };
        assert_eq!(
            r["stdout"].as_str().unwrap(),
            want,
            "round {round}: the run sees the volume as of its start"
        );
        assert_eq!(r["changes"]["committed"], true, "{r}");
        calls.push(call_id(&r));
        let now = get(&api, &vol, "/data.txt").text();
        assert!(now.starts_with(text), "the sandbox's write stays: {now}");
    }
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the sandbox");
    assert_clean(&s, &calls);
}

/// A sandbox mounting the volume swaps a directory for a symlink to a host path while a
/// run's commit is applied: the commit never follows it (steps under it are skipped), so
/// nothing lands outside the volume.
#[test]
fn a_commit_never_follows_a_symlink_a_sandbox_swaps_in() {
    use std::os::unix::fs::PermissionsExt;
    let s = Server::start_with_env(&[], &[("LOCKER_TEST_COMMIT_DELAY_MS", "150")]);
    let api = s.api();
    let vol = new_volume(&api, "swap");
    put(&api, &vol, "/a/keep", b"k");
    let victim = locker_tests::TempDir::new("locker-victim");
    std::fs::set_permissions(victim.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let sb = api.create_sandbox(&json!({"volumes": [{"volume": vol, "path": "/workspace"}]}));
    let sb = sb["id"].as_str().unwrap().to_owned();
    let (url, key, v2) = (s.url.clone(), s.api_key.clone(), vol.clone());
    let h = std::thread::spawn(move || {
        Api::new(&url, Some(&key))
            .post(
                &format!("/v1/volumes/{v2}/run"),
                &json!({"shell": "for i in $(seq 0 19); do echo x > a/f$i; done; mkdir a/d; echo y > a/d/g"}),
            )
            .expect(200, "the run")
    });
    let journal = s
        .data_dir
        .join("volumes")
        .join(&vol)
        .join("fs/commit.journal");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !journal.exists() {
        assert!(Instant::now() < deadline, "no commit started");
        std::thread::sleep(Duration::from_millis(2));
    }
    api.sh(
        &sb,
        &format!(
            "rm -rf /workspace/a && ln -s {} /workspace/a",
            victim.path().display()
        ),
    );
    let r = h.join().unwrap();
    assert_eq!(r["exit_code"], 0, "{r}");
    let landed: Vec<_> = std::fs::read_dir(victim.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        landed.is_empty(),
        "the commit wrote outside the volume: {landed:?}"
    );
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete");
}

/// A sandbox mounting the volume keeps swapping its files and a directory for symlinks to
/// host paths while runs take their views of the volume: a view never copies what a
/// symlink points at (the host's files never reach a run).
#[test]
fn a_view_never_copies_what_a_swapped_in_symlink_points_at() {
    use std::os::unix::fs::PermissionsExt;
    let s = Server::start();
    let api = s.api();
    let vol = new_volume(&api, "swapview");
    let secret = locker_tests::TempDir::new("locker-secret");
    std::fs::set_permissions(secret.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(secret.path().join("f0"), "HOST SECRET\n").unwrap();
    let sb = api.create_sandbox(&json!({"volumes": [{"volume": vol, "path": "/workspace"}]}));
    let sb = sb["id"].as_str().unwrap().to_owned();
    // 100 files and a directory, each swapped for a symlink to the host's secret and back,
    // as fast as one process can.
    let swap = format!(
        r#"import os
os.chdir("/workspace")
os.mkdir("d")
open("d/f0", "w").write("own\n")
for i in range(100):
    open(f"f{{i}}", "w").write("own\n")
open("ready", "w").write("1")
while True:
    for i in range(100):
        n = f"f{{i}}"
        os.rename(n, n + ".bak"); os.symlink("{s}/f0", n); os.unlink(n); os.rename(n + ".bak", n)
    os.rename("d", "d.bak"); os.symlink("{s}", "d"); os.unlink("d"); os.rename("d.bak", "d")
"#,
        s = secret.path().display()
    );
    api.post(
        &format!("/v1/sandboxes/{sb}/processes"),
        &json!({"cmd": ["python3", "-c", swap]}),
    )
    .expect(200, "the swapping loop");
    api.sh(&sb, "while [ ! -e /workspace/ready ]; do sleep 0.05; done");
    for _ in 0..12 {
        let r = api
            .post(
                &format!("/v1/volumes/{vol}/run"),
                &json!({"shell": "cat f* d/* *.bak d.bak/* 2>/dev/null; true", "commit": "never"}),
            )
            .expect(200, "a run");
        let out = r["stdout"].as_str().unwrap();
        assert!(
            !out.contains("HOST SECRET"),
            "a host file reached a run: {r}"
        );
    }
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete");
}
