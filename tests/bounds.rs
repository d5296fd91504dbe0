//! The server never trusts a machine's size or time: answers read from an agent are bounded
//! while they arrive, every agent call has a deadline, a machine whose agent died or stopped
//! is reported `failed` (never `running` with 500s), special files are refused cleanly, and
//! exhaustion inside a machine is not "payload too large".
//!
//! Each test starts its own server; the [`Server`] guard deletes what a test created even
//! when it fails. The agent is stopped or killed from the host side (the tests run as root),
//! through the pid in the machine directory's `state.json`.
//!
//! Run as root after `scripts/setup build`:
//! `cargo test --release -p locker-tests --test bounds`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use locker_tests::become_subreaper;
use locker_tests::server::{enc, rss_kib, Api, Server};
use serde_json::{json, Value};

/// The agent's pid of the machine in `dir` (its `state.json`).
fn agent_pid(dir: &Path) -> i32 {
    let v: Value = serde_json::from_slice(
        &std::fs::read(dir.join("state.json"))
            .unwrap_or_else(|e| panic!("reading {}/state.json: {e}", dir.display())),
    )
    .expect("state.json is JSON");
    v["agent_pid"].as_i64().expect("agent_pid") as i32
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: a plain kill(2) of a pid this test read from the machine's state.
    let r = unsafe { libc::kill(pid, sig) };
    assert_eq!(
        r,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

fn new_sandbox(api: &Api, body: Value) -> String {
    let sb = api.create_sandbox(&body);
    sb["id"].as_str().expect("id").to_owned()
}

/// Waits until `f` holds.
#[track_caller]
fn eventually(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Asserts the sandbox reads `failed` with a reason, later calls answer 409 at once, and
/// DELETE removes it and its machine.
#[track_caller]
fn assert_failed_then_deletable(srv: &Server, api: &Api, id: &str, dir: &Path) {
    let sb = api
        .get(&format!("/v1/sandboxes/{id}"))
        .expect(200, "GET the failed sandbox");
    assert_eq!(sb["state"], "failed", "the sandbox reads failed: {sb}");
    let reason = sb["failure"].as_str().unwrap_or_default();
    assert!(!reason.is_empty(), "the failure has a reason: {sb}");
    let t = Instant::now();
    let r = api.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"shell": "true", "timeout_ms": 2000}),
    );
    let msg = r.expect_error(409, "conflict", "an exec on a failed sandbox");
    assert!(msg.contains("failed"), "{msg}");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "a call on a failed sandbox answers at once, took {:?}",
        t.elapsed()
    );
    api.get(&format!("/v1/sandboxes/{id}/files/stat?path=/root"))
        .expect_error(409, "conflict", "a files call on a failed sandbox");
    assert_eq!(
        api.delete(&format!("/v1/sandboxes/{id}")).status,
        204,
        "DELETE a failed sandbox"
    );
    api.get(&format!("/v1/sandboxes/{id}"))
        .expect_error(404, "not_found", "the deleted sandbox");
    eventually("the machine directory goes", 10, || !dir.exists());
    let _ = srv;
}

// ---------------------------------------------------------------------------------------
// F2: answers are bounded while they arrive
// ---------------------------------------------------------------------------------------

#[test]
fn a_listing_of_a_huge_tree_is_refused_with_bounded_server_memory() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = new_sandbox(&api, json!({"disk_mb": 4096, "memory_mb": 1024}));
    // 40 000 files under 15 levels of 250-character directory names: about 166 MiB of
    // listing (4 KB paths), far past the bound.
    let made = api.exec(
        &id,
        &json!({"cmd": ["python3", "-c", r#"
import os
base = "/root/deep"
for i in range(15):
    base = os.path.join(base, ("d%02d" % i) * 83 + "x")
os.makedirs(base)
for i in range(40000):
    open(os.path.join(base, "f%06d" % i), "w").close()
print(len(base))
"#], "timeout_ms": 120000}),
    );
    assert_eq!(made["exit_code"], 0, "making the tree: {made}");
    let pid = srv.pid();
    let before = rss_kib(pid);
    let t = Instant::now();
    let r = api.get(&format!(
        "/v1/sandboxes/{id}/files/list?path={}&depth=16",
        enc("/root/deep")
    ));
    let took = t.elapsed();
    let after = rss_kib(pid);
    println!(
        "list of 40 000 files with 4 KB paths: HTTP {} in {took:?}, body {} bytes, server RSS {before} -> {after} KiB",
        r.status,
        r.body.len()
    );
    assert_eq!(
        r.status,
        413,
        "the listing past the bound: {}",
        String::from_utf8_lossy(&r.body[..r.body.len().min(300)])
    );
    let msg = r.expect_error(413, "payload_too_large", "the listing past the bound");
    assert!(
        msg.contains("subdirectory") && msg.contains("depth"),
        "the message says what to do: {msg}"
    );
    assert!(
        after < before + 40 * 1024,
        "the server's RSS grew by {} KiB for one refused listing",
        after.saturating_sub(before)
    );
    // A listing within the bound still works, and the server is healthy.
    let ok = api
        .get(&format!("/v1/sandboxes/{id}/files/list?path=/root&depth=2"))
        .expect(200, "a small listing");
    assert!(!ok["entries"].as_array().expect("entries").is_empty());
    api.get("/healthz").expect(200, "healthz");
    assert_eq!(api.sh(&id, "echo ok"), "ok\n");
}

#[test]
fn a_large_listing_within_the_bound_arrives_whole() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = new_sandbox(&api, json!({}));
    api.sh(
        &id,
        "python3 -c \"import os\nos.makedirs('/root/many')\nfor i in range(5000): open('/root/many/f%05d' % i, 'w').close()\"",
    );
    let r = api
        .get(
            "/v1/sandboxes/{id}/files/list?path=/root/many"
                .replace("{id}", &id)
                .as_str(),
        )
        .expect(200, "a listing of 5000 entries (streamed in chunks)");
    let entries = r["entries"].as_array().expect("entries");
    assert_eq!(entries.len(), 5000);
    assert_eq!(entries[0]["name"], "f00000");
    assert_eq!(entries[4999]["path"], "/root/many/f04999");
}

// ---------------------------------------------------------------------------------------
// F4: deadlines on agent calls; F9: a dead agent means a failed sandbox
// ---------------------------------------------------------------------------------------

#[test]
fn an_exec_answers_when_the_agent_is_stopped_and_the_sandbox_fails() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = new_sandbox(&api, json!({}));
    assert_eq!(api.sh(&id, "echo up"), "up\n");
    let dir = srv.machine_dir(&id);
    let pid = agent_pid(&dir);
    signal(pid, libc::SIGSTOP);
    let t = Instant::now();
    let r = api.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"shell": "echo never", "timeout_ms": 2000}),
    );
    let took = t.elapsed();
    println!(
        "exec on a stopped agent: HTTP {} after {took:?}: {}",
        r.status,
        r.text()
    );
    // 2 s timeout + 10 s grace + slack.
    assert!(
        took < Duration::from_secs(18),
        "the exec answered after {took:?}"
    );
    let msg = r.expect_error(409, "conflict", "an exec whose agent is stopped");
    assert!(msg.contains("stopped answering"), "{msg}");
    assert_failed_then_deletable(&srv, &api, &id, &dir);
}

#[test]
fn a_sandbox_whose_agent_is_killed_reads_failed() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = new_sandbox(&api, json!({}));
    assert_eq!(api.sh(&id, "echo up"), "up\n");
    let dir = srv.machine_dir(&id);
    signal(agent_pid(&dir), libc::SIGKILL);
    // Reported failed without any call (the connection's end is watched).
    eventually("the sandbox reads failed", 10, || {
        api.get(&format!("/v1/sandboxes/{id}")).json()["state"] == "failed"
    });
    let sb = api.get(&format!("/v1/sandboxes/{id}")).json();
    assert!(
        sb["failure"]
            .as_str()
            .is_some_and(|f| f.contains("connection to its agent was lost")),
        "{sb}"
    );
    assert_failed_then_deletable(&srv, &api, &id, &dir);
}

/// Loop devices whose backing file is under `d`.
fn loops_under(d: &Path) -> Vec<String> {
    let d = d.to_str().expect("utf-8 path");
    std::fs::read_dir("/sys/block")
        .expect("/sys/block")
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("loop/backing_file")).is_ok_and(|b| b.contains(d))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Pids whose command line is exactly `cmdline` (NUL-separated, NUL-terminated).
fn pids_running(cmdline: &[u8]) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == cmdline))
        .collect()
}

/// The parent pid of `pid` (0 if gone).
fn parent_of(pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// Machine directories (`state.json` holders) under `d`.
fn machines_under(d: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(d)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("state.json").exists())
        .collect()
}

#[test]
fn a_run_answers_when_its_agent_is_stopped_and_leaves_nothing() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let vol = api
        .post(
            "/v1/volumes",
            &json!({"name": "stopped-run", "size_mb": 64}),
        )
        .expect(201, "create a volume");
    let vid = vol["id"].as_str().expect("id").to_owned();
    let pool = srv.data_dir.join("pool");
    let stopper = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            // The run's machine is the one whose agent is an ancestor of its `sleep 30.5`.
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                let agents: Vec<i32> = machines_under(&pool).iter().map(|m| agent_pid(m)).collect();
                for sleeper in pids_running(b"sleep\x0030.5\x00") {
                    let mut p = sleeper;
                    for _ in 0..8 {
                        p = parent_of(p);
                        if agents.contains(&p) {
                            signal(p, libc::SIGSTOP);
                            return true;
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            false
        })
    };
    let t = Instant::now();
    let r = api.post(
        &format!("/v1/volumes/{vid}/run"),
        &json!({"cmd": ["sleep", "30.5"], "timeout_ms": 3000}),
    );
    let took = t.elapsed();
    assert!(
        stopper.join().expect("stopper"),
        "the run's agent was found and stopped"
    );
    println!(
        "run with a stopped agent: HTTP {} after {took:?}: {}",
        r.status,
        r.text()
    );
    assert!(
        // 3 s timeout + 10 s grace + killing a machine whose agent is stopped + slack.
        took < Duration::from_secs(35),
        "the run answered after {took:?}"
    );
    assert!(r.status >= 400, "the run reports the failure: {}", r.text());
    let msg = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(msg.contains("did not answer"), "{msg}");
    // The runs slot is free again: another run works at once.
    let ok = api
        .post(
            &format!("/v1/volumes/{vid}/run"),
            &json!({"shell": "echo again"}),
        )
        .expect(200, "a run after the stopped one");
    assert_eq!(ok["stdout"], "again\n");
    assert_eq!(
        api.delete(&format!("/v1/volumes/{vid}")).status,
        204,
        "the volume can be deleted"
    );
    let vdir = srv.data_dir.join("volumes").join(&vid);
    eventually("no loop device of the volume is left", 15, || {
        loops_under(&vdir).is_empty()
    });
    eventually("no machine of the run is left", 15, || {
        !std::fs::read_dir(&pool)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("call_"))
    });
    assert!(
        !std::fs::read_to_string("/proc/self/mountinfo")
            .expect("mountinfo")
            .contains(vdir.to_str().expect("utf-8")),
        "no mount of the volume is left"
    );
}

// ---------------------------------------------------------------------------------------
// F12: special files
// ---------------------------------------------------------------------------------------

#[test]
fn special_files_are_refused_or_capped_not_a_500_or_a_dropped_connection() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = new_sandbox(&api, json!({}));
    api.sh(
        &id,
        "python3 -c 'import socket;s=socket.socket(socket.AF_UNIX);s.bind(\"/root/sock\")' && mkfifo /root/fifo",
    );
    for p in ["/root/sock", "/root/fifo", "/dev/zero", "/dev/null"] {
        let r = api.read_file(&id, p);
        let msg = r.expect_error(400, "bad_request", &format!("GET {p}"));
        assert!(msg.contains("not a regular file"), "{p}: {msg}");
    }
    let r = api.read_file(&id, "/proc/self/mem");
    let msg = r.expect_error(400, "bad_request", "GET /proc/self/mem");
    println!("/proc/self/mem: {msg}");
    // An endless kernel file is capped (4 MiB), not streamed without end.
    let t = Instant::now();
    let r = api.read_file(&id, "/proc/self/pagemap");
    assert_eq!(r.status, 200, "pagemap: {}", r.status);
    assert!(
        r.body.len() <= 4 << 20,
        "pagemap capped: {} bytes",
        r.body.len()
    );
    assert!(t.elapsed() < Duration::from_secs(20));
    // An ordinary kernel file reads whole.
    let r = api.read_file(&id, "/proc/self/status");
    assert_eq!(r.status, 200);
    assert!(r.text().contains("Name:"), "{}", r.text());
    // The same through a volume's files API.
    let vol = api
        .post("/v1/volumes", &json!({"name": "special", "size_mb": 64}))
        .expect(201, "create a volume");
    let vid = vol["id"].as_str().expect("id").to_owned();
    // A sandbox mounting the volume plants a socket and a FIFO in it.
    let with_vol = new_sandbox(
        &api,
        json!({"volumes": [{"volume": vid, "path": "/workspace"}]}),
    );
    api.sh(
        &with_vol,
        "python3 -c 'import socket;s=socket.socket(socket.AF_UNIX);s.bind(\"/workspace/sock\")' && mkfifo /workspace/fifo",
    );
    for p in ["/sock", "/fifo"] {
        let r = api.get(&format!("/v1/volumes/{vid}/files?path={}", enc(p)));
        let msg = r.expect_error(400, "bad_request", &format!("volume GET {p}"));
        assert!(msg.contains("not a regular file"), "{p}: {msg}");
    }
    assert_eq!(api.delete(&format!("/v1/sandboxes/{with_vol}")).status, 204);
    assert_eq!(api.sh(&id, "echo fine"), "fine\n");
}

// ---------------------------------------------------------------------------------------
// F13: exhaustion inside a machine
// ---------------------------------------------------------------------------------------

#[test]
fn a_machine_out_of_processes_answers_429_not_413_and_recovers() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let id = new_sandbox(&api, json!({"memory_mb": 2048}));
    // Fill the machine's pids limit and keep it full for 40 s: the filler keeps taking any
    // pid that frees up (the agent's own threads come and go), and every sleeper ends at
    // the same moment. Stopping at the first failed fork would leave slack under load.
    let r = api.post(
        &format!("/v1/sandboxes/{id}/processes"),
        &json!({"cmd": ["python3", "-c", r#"
import os, time
end = time.time() + 40
while time.time() < end:
    try:
        pid = os.fork()
    except OSError:
        time.sleep(0.02)
        continue
    if pid == 0:
        time.sleep(max(0, end - time.time()))
        os._exit(0)
"#]}),
    );
    r.expect(200, "start the filler");
    let mut seen = Vec::new();
    let t0 = std::time::Instant::now();
    while t0.elapsed() < Duration::from_secs(30) {
        let r = api.post(
            &format!("/v1/sandboxes/{id}/exec"),
            &json!({"shell": "echo hi", "timeout_ms": 5000}),
        );
        assert_ne!(
            r.status,
            413,
            "exhaustion is not payload_too_large: {}",
            r.text()
        );
        let full = if r.status == 429 {
            let msg = r.expect_error(429, "quota_exceeded", "an exec in a full machine");
            seen.push(msg);
            true
        } else {
            let v = r.expect(200, "an exec in a full machine");
            let text = v.to_string();
            let full = text.contains("Resource temporarily unavailable");
            seen.push(text);
            full
        };
        if full {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    println!("execs in a machine out of processes: {seen:?}");
    assert!(
        seen.iter()
            .any(|m| m.contains("processes") || m.contains("Resource temporarily unavailable")),
        "the answers say the machine is out of processes: {seen:?}"
    );
    // Once the sleepers end, the sandbox works again.
    eventually("the sandbox recovers", 90, || {
        let r = api.post(
            &format!("/v1/sandboxes/{id}/exec"),
            &json!({"shell": "echo back", "timeout_ms": 5000}),
        );
        r.status == 200 && r.json()["stdout"] == "back\n"
    });
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}")).json()["state"],
        "running"
    );
}
