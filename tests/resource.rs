//! One tenant cannot starve the host: idle connections to the egress proxy leave the API
//! its file descriptors, other tenants their egress, and the log a bounded number of lines
//! (a server started with a file limit of 1024, as under most service managers); disk is
//! admitted against the host's free space and a per-tenant disk quota, and a refused
//! create leaves nothing behind. Run as root. All traffic stays on this machine: the
//! machines' connections go to the server's own proxy, and names are pinned to a test
//! server in a network namespace of the test's own.

use std::path::Path;
use std::time::{Duration, Instant};

use locker_tests::become_subreaper;
use locker_tests::egress::*;
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

/// Holds `n` TCP connections open from the machine for `secs` seconds, opening a new one
/// whenever the other end closes one. The address is any: under `allow` every connection
/// is redirected to the server's egress proxy, which waits for a name that never comes.
const HOLD: &str = r#"
import selectors, socket, sys, time
n, secs = int(sys.argv[1]), float(sys.argv[2])
sel = selectors.DefaultSelector()
def open_one():
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("198.51.100.7", 80))
    sel.register(s, selectors.EVENT_READ)
for _ in range(n):
    open_one()
open("/tmp/holding", "w").write(str(n))
end = time.time() + secs
while time.time() < end:
    for key, _ in sel.select(timeout=0.5):
        s = key.fileobj
        try:
            gone = s.recv(1) == b""
        except OSError:
            gone = True
        if gone:
            sel.unregister(s)
            s.close()
            open_one()
    time.sleep(0.02)
"#;

const ALLOW: &str = "allowed.test";

/// A sandbox of `api`'s tenant under `allow` that holds `n` proxy connections open
/// (reopening the ones the proxy closes) for `secs` seconds.
fn holding_sandbox(api: &Api, n: u32, secs: u32) -> String {
    let id = api.create_sandbox(&json!({"network": {"egress": "allow", "allow": [ALLOW]}}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    api.write_file(&id, "/root/hold.py", HOLD.as_bytes())
        .expect(200, "the holding script");
    api.post(
        &format!("/v1/sandboxes/{id}/processes"),
        &json!({"shell": format!("python3 /root/hold.py {n} {secs}")}),
    )
    .expect(200, "start holding connections");
    id
}

/// Waits until every sandbox's script opened its connections.
fn wait_holding(api: &Api, ids: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for id in ids {
        while api.read_file(id, "/tmp/holding").status != 200 {
            assert!(Instant::now() < deadline, "{id} opened its connections");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// A client that gives up after 15 s: a starved server must fail the test, not hang it.
fn impatient(srv: &Server) -> Api {
    srv.api().with_timeout(Duration::from_secs(15))
}

#[test]
fn idle_proxy_connections_of_one_tenant_starve_neither_the_api_nor_the_log() {
    become_subreaper();
    let srv = Server::start_with_nofile(&[], 1024);
    wait_egress_ok(&srv);
    let api = srv.api();
    let log_before = srv.log_text().lines().count();
    let since_first = Instant::now();
    let ids: Vec<String> = (0..3).map(|_| holding_sandbox(&api, 600, 60)).collect();
    wait_holding(&api, &ids);
    let quick = impatient(&srv);
    let started = Instant::now();
    let mut failures = Vec::new();
    let mut most_fds = 0;
    let mut calls = 0;
    while started.elapsed() < Duration::from_secs(15) {
        most_fds = most_fds.max(open_fds(srv.pid()));
        let mut call = |what: &str, r: Result<locker_tests::server::Resp, ureq::Error>, ok: u16| {
            calls += 1;
            match r {
                Ok(r) if r.status == ok => {}
                Ok(r) => failures.push(format!("{what}: HTTP {}: {}", r.status, r.text())),
                Err(e) => failures.push(format!("{what}: {e}")),
            }
        };
        call(
            "GET /v1/sandboxes",
            quick.try_request("GET", "/v1/sandboxes", &[], ()),
            200,
        );
        call(
            "exec",
            quick.try_request(
                "POST",
                &format!("/v1/sandboxes/{}/exec", ids[0]),
                &[("Content-Type", "application/json")],
                serde_json::to_vec(&json!({"shell": "echo ok"})).unwrap(),
            ),
            200,
        );
        let created = quick.try_request(
            "POST",
            "/v1/sandboxes",
            &[("Content-Type", "application/json")],
            serde_json::to_vec(&json!({})).unwrap(),
        );
        if let Ok(r) = &created {
            if r.status == 201 {
                let id = r.json()["id"].as_str().unwrap().to_owned();
                call(
                    "DELETE a sandbox",
                    quick.try_request("DELETE", &format!("/v1/sandboxes/{id}"), &[], ()),
                    204,
                );
            }
        }
        call("POST /v1/sandboxes", created, 201);
    }
    eprintln!(
        "{calls} API calls in {:?}; the server held at most {most_fds} fds",
        started.elapsed()
    );
    let log = srv.log_text();
    let lines: Vec<&str> = log
        .lines()
        .skip(log_before)
        .filter(|l| l.contains("egress refused") || l.contains("accept failed"))
        .collect();
    // One line per machine per 5 s at most, and one when it goes.
    let bound = 3 * (since_first.elapsed().as_secs() as usize / 5 + 2);
    eprintln!("{} refusal lines in the log (at most {bound})", lines.len());
    assert!(
        failures.is_empty(),
        "every API call succeeds while one tenant's machines hold 1800 idle proxy connections ({} of {calls} failed): {failures:#?}",
        failures.len()
    );
    assert!(
        most_fds < 1024 * 3 / 4,
        "the proxy kept its fds under half the limit: {most_fds}"
    );
    assert!(
        lines.len() <= bound,
        "refusals are logged at most once per machine every few seconds, with a count: {} lines, the first: {:#?}",
        lines.len(),
        &lines[..lines.len().min(5)]
    );
    assert!(
        lines.iter().any(|l| l.contains("more_refused_before")),
        "a refusal line counts the ones not logged: {lines:#?}"
    );
}

#[test]
fn a_tenant_at_its_connection_cap_leaves_other_tenants_their_egress() {
    become_subreaper();
    let net = TestNet::start();
    let pin = format!("{ALLOW}={}", net.addr);
    let srv = Server::start_with_nofile(&["--egress-resolve", &pin], 1024);
    wait_egress_ok(&srv);
    let a = srv.api();
    let (b, _) = srv.create_tenant("tenant-b");
    let b_id = b.create_sandbox(&json!({"network": {"egress": "allow", "allow": [ALLOW]}}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        b.sh(&b_id, &format!("curl -sS -m 5 http://{ALLOW}/"))
            .trim(),
        net.name,
        "tenant b reaches the allowed name"
    );
    let ids: Vec<String> = (0..3).map(|_| holding_sandbox(&a, 500, 60)).collect();
    wait_holding(&a, &ids);
    std::thread::sleep(Duration::from_secs(1));
    let mut failed = Vec::new();
    for i in 0..10 {
        let r = b.exec(
            &b_id,
            &json!({"shell": format!("curl -sS -m 2 http://{ALLOW}/"), "timeout_ms": 20000}),
        );
        if r["stdout"].as_str().unwrap_or_default().trim() != net.name {
            failed.push(format!("{i}: {r}"));
        }
    }
    assert!(
        failed.is_empty(),
        "tenant b's connections get through while tenant a holds all it may: {failed:#?}"
    );
    // Tenant a is at its cap: the proxy closes its new connections at once.
    let (_, out, _, _) = run_sh(
        &a,
        &ids[0],
        &format!("for i in 1 2 3 4 5; do curl -sS -m 5 http://{ALLOW}/ 2>&1; done"),
    );
    assert!(
        !out.contains(&net.name) || out.matches(&net.name).count() < 5,
        "tenant a is held at its cap: {out}"
    );
}

/// The free space of the data dir's filesystem, in MiB.
fn free_mb(p: &Path) -> u64 {
    let out = std::process::Command::new("df")
        .args(["-B1M", "--output=avail"])
        .arg(p)
        .output()
        .expect("df");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .expect("df's answer")
}

/// Everything of the data dir that names `id` (records are checked through the API).
fn leftovers(srv: &Server, id_prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for sub in ["sandboxes", "volumes", "snapshots"] {
        for e in std::fs::read_dir(srv.data_dir.join(sub))
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(id_prefix) {
                out.push(format!("{sub}/{n}"));
            }
        }
    }
    out
}

fn dir_names(p: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn disk_beyond_the_hosts_free_space_is_refused_and_leaves_nothing() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let free = free_mb(&srv.data_dir);
    let want = (free * 2).min(1_048_576);
    assert!(
        want > free,
        "this test needs a data dir with less than 1 TiB free ({free} MB here)"
    );
    let sandboxes_before = dir_names(&srv.data_dir.join("sandboxes"));
    let volumes_before = dir_names(&srv.data_dir.join("volumes"));
    let msg = api
        .post("/v1/sandboxes", &json!({"disk_mb": want}))
        .expect_error(422, "unprocessable", "disk_mb twice the free space");
    assert!(
        msg.contains("disk_mb") && msg.contains("free") && msg.contains("MB"),
        "the message names the free space and what to do: {msg}"
    );
    let msg = api
        .post("/v1/volumes", &json!({"name": "huge", "size_mb": want}))
        .expect_error(422, "unprocessable", "size_mb twice the free space");
    assert!(
        msg.contains("size_mb") && msg.contains("free"),
        "the message names the free space and what to do: {msg}"
    );
    // Nothing is left of either: no record, no directory, no image.
    assert_eq!(api.get("/v1/sandboxes").json()["sandboxes"], json!([]));
    assert_eq!(api.get("/v1/volumes").json()["volumes"], json!([]));
    assert_eq!(dir_names(&srv.data_dir.join("sandboxes")), sandboxes_before);
    assert_eq!(dir_names(&srv.data_dir.join("volumes")), volumes_before);
    // What fits is still granted.
    let id = api.create_sandbox(&json!({"disk_mb": 64}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(api.sh(&id, "echo ok").trim(), "ok");
    api.post("/v1/volumes", &json!({"name": "small", "size_mb": 64}))
        .expect(201, "a small volume");
}

#[test]
fn the_per_tenant_disk_quota_counts_sandboxes_and_volumes() {
    become_subreaper();
    let srv = Server::start_with(&["--quota-disk-mb", "300"]);
    let api = srv.api();
    let sb = api.create_sandbox(&json!({"disk_mb": 128}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let vol = api
        .post("/v1/volumes", &json!({"name": "v1", "size_mb": 128}))
        .expect(201, "a volume within the quota");
    // 256 of 300 MB held: a sandbox or a volume of 64 MB is past the quota.
    let msg = api
        .post("/v1/sandboxes", &json!({"disk_mb": 64}))
        .expect_error(429, "quota_exceeded", "a sandbox past the disk quota");
    assert!(
        msg.contains("disk") && msg.contains("300"),
        "names the disk quota: {msg}"
    );
    let msg = api
        .post("/v1/volumes", &json!({"name": "v2", "size_mb": 64}))
        .expect_error(429, "quota_exceeded", "a volume past the disk quota");
    assert!(
        msg.contains("disk") && msg.contains("300"),
        "names the disk quota: {msg}"
    );
    let msg = api
        .post(
            &format!("/v1/volumes/{}/fork", vol["id"].as_str().unwrap()),
            &json!({"name": "v3"}),
        )
        .expect_error(429, "quota_exceeded", "a volume fork past the disk quota");
    assert!(msg.contains("disk"), "{msg}");
    let msg = api
        .post(&format!("/v1/sandboxes/{sb}/fork"), &json!({"count": 1}))
        .expect_error(429, "quota_exceeded", "a sandbox fork past the disk quota");
    assert!(msg.contains("disk"), "{msg}");
    // Nothing is left of the refused ones.
    assert_eq!(
        api.get("/v1/sandboxes").json()["sandboxes"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let vols: Vec<Value> = api.get("/v1/volumes").json()["volumes"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(vols.len(), 1, "{vols:?}");
    assert_eq!(dir_names(&srv.data_dir.join("sandboxes")), vec![sb.clone()]);
    assert_eq!(dir_names(&srv.data_dir.join("volumes")).len(), 1);
    assert!(leftovers(&srv, ".fork").is_empty());
    // Another tenant has a quota of its own.
    let (b, _) = srv.create_tenant("tenant-b");
    b.create_sandbox(&json!({"disk_mb": 128}));
    // Deleting gives the quota back.
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete");
    api.create_sandbox(&json!({"disk_mb": 128}));
}
