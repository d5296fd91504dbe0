//! End-to-end tests of `locker serve`: the real binary, real machines, plain HTTP.
//!
//! Each test starts its own server (fresh data dir, known keys, a free port) and checks one
//! part of the contract in `docs/api.md` from the outside, the way a client sees it: status
//! codes, the error shape, the typed ExecResult, streams that arrive as output is produced,
//! files that never leave the sandbox's root, tenants that never see each other, a killed
//! server that finds its machines again. The [`Server`] guard deletes everything a test
//! created, even when it fails, so no machine, mount, cgroup or process outlives a test.
//!
//! Run as root after `scripts/setup build` (release binaries and the default template):
//! `cargo test --release -p locker-tests --test server`.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use locker_tests::server::{enc, rss_kib, Api, Resp, Server};
use locker_tests::{become_subreaper, traces_of, TempDir};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------

fn now_s() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs() as i64
}

/// Parses the API's RFC 3339 UTC times (`2026-11-30T12:00:00Z`) to Unix seconds.
fn parse_time(s: &str) -> i64 {
    let b = s.as_bytes();
    assert!(s.len() >= 20 && b[4] == b'-' && b[7] == b'-' && b[10] == b'T' && b[13] == b':' && s.ends_with('Z'), "not an RFC 3339 UTC time: {s:?}");
    let n = |r: std::ops::Range<usize>| -> i64 { s[r].parse().unwrap_or_else(|_| panic!("not an RFC 3339 UTC time: {s:?}")) };
    let (y, m, d) = (n(0..4), n(5..7), n(8..10));
    let (hh, mm, ss) = (n(11..13), n(14..16), n(17..19));
    // Howard Hinnant's days_from_civil.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    days * 86_400 + hh * 3600 + mm * 60 + ss
}

fn sandbox_id(v: &Value) -> String {
    let id = v["id"].as_str().unwrap_or_else(|| panic!("no id in {v}")).to_owned();
    assert!(id.starts_with("sb_"), "sandbox ids start with sb_: {id}");
    id
}

fn ids(list: &Value, key: &str) -> Vec<String> {
    list[key].as_array().unwrap_or_else(|| panic!("no `{key}` array in {list}")).iter().map(|s| s["id"].as_str().expect("id").to_owned()).collect()
}

/// Polls `f` every 50 ms until it returns `Some`, or panics with `what` after `limit`.
#[track_caller]
fn wait_for<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The machine's freezer state on the host: `Some(true)` when frozen.
fn frozen(id: &str) -> Option<bool> {
    let v1 = Path::new("/sys/fs/cgroup/freezer/locker").join(id).join("freezer.state");
    if let Ok(s) = std::fs::read_to_string(&v1) {
        return Some(s.trim() == "FROZEN");
    }
    let v2 = Path::new("/sys/fs/cgroup/locker").join(id).join("cgroup.freeze");
    std::fs::read_to_string(v2).ok().map(|s| s.trim() == "1")
}

/// Whether any process of the sandbox has `needle` in its command line.
fn running_in(api: &Api, sb: &str, needle: &str) -> bool {
    api.sh(sb, "ps -eo args").lines().any(|l| l.contains(needle))
}

/// Reads NDJSON lines, each with the time it arrived since `t0`.
fn read_ndjson(r: impl Read, t0: Instant) -> Vec<(Duration, Value)> {
    let mut out = Vec::new();
    for line in BufReader::new(r).lines() {
        let line = line.expect("read an NDJSON line");
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}"));
        out.push((t0.elapsed(), v));
    }
    out
}

/// The concatenated `data` of the `kind` lines (stdout or stderr) of an NDJSON stream.
fn stream_text(lines: &[(Duration, Value)], kind: &str) -> String {
    lines.iter().filter(|(_, v)| v["type"] == kind).map(|(_, v)| v["data"].as_str().expect("data is a string")).collect()
}

/// Asserts the body of every case is refused with `status`/`code` and a message naming
/// `needle` (the field at fault).
#[track_caller]
fn refused(r: &Resp, status: u16, code: &str, needle: &str, what: &str) {
    let msg = r.expect_error(status, code, what);
    assert!(msg.contains(needle), "{what}: the message should name `{needle}`: {msg:?}");
}

// ---------------------------------------------------------------------------------------
// Conventions: health, metrics, OpenAPI, templates, authentication, the error shape
// ---------------------------------------------------------------------------------------

/// Every route of the contract's sandbox, exec, process, file, record and admin sections.
const CONTRACT_ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/sandboxes"),
    ("get", "/v1/sandboxes"),
    ("get", "/v1/sandboxes/{id}"),
    ("patch", "/v1/sandboxes/{id}"),
    ("delete", "/v1/sandboxes/{id}"),
    ("post", "/v1/sandboxes/{id}/ttl"),
    ("post", "/v1/sandboxes/{id}/pause"),
    ("post", "/v1/sandboxes/{id}/resume"),
    ("post", "/v1/sandboxes/{id}/exec"),
    ("post", "/v1/sandboxes/{id}/processes"),
    ("get", "/v1/sandboxes/{id}/processes"),
    ("get", "/v1/sandboxes/{id}/processes/{proc}"),
    ("get", "/v1/sandboxes/{id}/processes/{proc}/output"),
    ("post", "/v1/sandboxes/{id}/processes/{proc}/stdin"),
    ("post", "/v1/sandboxes/{id}/processes/{proc}/signal"),
    ("get", "/v1/sandboxes/{id}/pty"),
    ("get", "/v1/sandboxes/{id}/files"),
    ("put", "/v1/sandboxes/{id}/files"),
    ("delete", "/v1/sandboxes/{id}/files"),
    ("get", "/v1/sandboxes/{id}/files/list"),
    ("get", "/v1/sandboxes/{id}/files/stat"),
    ("post", "/v1/sandboxes/{id}/files/mkdir"),
    ("post", "/v1/sandboxes/{id}/files/move"),
    ("get", "/v1/templates"),
    ("get", "/v1/calls"),
    ("get", "/v1/usage"),
    ("post", "/v1/tenants"),
    ("post", "/v1/tenants/{name}/keys"),
    ("delete", "/v1/keys/{key_id}"),
    ("get", "/healthz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
];

#[test]
fn health_openapi_metrics_and_templates() {
    become_subreaper();
    let srv = Server::start();
    let anon = srv.anon();

    // Health: no key needed; the jail runtime works here, the microVM says why not.
    let h = anon.get("/healthz").expect(200, "GET /healthz");
    assert_eq!(h["status"], "ok", "{h}");
    assert_eq!(h["runtimes"]["jail"], "ok", "{h}");
    let micro = h["runtimes"]["microvm"].as_str().unwrap_or_else(|| panic!("runtimes.microvm is reported: {h}"));
    assert!(micro.starts_with("unavailable: ") && micro.len() > "unavailable: ".len(), "microvm says why it is unavailable: {micro:?}");

    // OpenAPI: no key needed; documents every route of the contract, keyed routes as such.
    let o = anon.get("/openapi.json").expect(200, "GET /openapi.json");
    assert!(o["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "an OpenAPI 3 document: {}", o["openapi"]);
    for (method, path) in CONTRACT_ROUTES {
        let op = &o["paths"][path][method];
        assert!(op.is_object(), "/openapi.json documents {method} {path}");
        let keyed = path.starts_with("/v1/");
        assert_eq!(op.get("security").is_some(), keyed, "{method} {path}: security is declared exactly on /v1 routes");
    }
    let schema = &o["components"]["schemas"]["Error"];
    assert!(schema.is_object(), "the error shape is in the document");

    // Templates: the default template exists, with its digest.
    let api = srv.api();
    let t = api.get("/v1/templates").expect(200, "GET /v1/templates");
    let def = t["templates"].as_array().expect("templates").iter().find(|t| t["name"] == "default").cloned().unwrap_or_else(|| panic!("the default template is listed: {t}"));
    assert!(def["digest"].as_str().is_some_and(|d| !d.is_empty()), "{def}");
    assert!(def["size_bytes"].as_u64().is_some_and(|n| n > 0), "{def}");

    // Metrics: no key needed; Prometheus text counting the requests above by route.
    let m = anon.get("/metrics");
    assert_eq!(m.status, 200, "GET /metrics: {}", m.text());
    let ctype = m.headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    assert!(ctype.starts_with("text/plain"), "metrics are Prometheus text: {ctype}");
    let text = m.text();
    assert!(text.contains("locker_http_requests_total{method=\"GET\",route=\"/healthz\",status=\"200\"} 1"), "requests are counted by route and status:\n{text}");
    assert!(text.contains("# TYPE locker_exec_duration_seconds histogram"), "{text}");
    assert!(text.contains("# TYPE locker_sandbox_create_seconds histogram"), "{text}");

    // An unknown route and a wrong method answer with the error shape too.
    refused(&anon.get("/v2/nothing"), 404, "not_found", "route", "an unknown route");
    let r = api.request("PUT", "/v1/sandboxes", &[], ());
    assert_eq!(r.status, 405, "PUT /v1/sandboxes is a wrong method: {}", r.text());
    r.expect_error(405, "not_found", "a wrong method");
}

#[test]
fn every_v1_route_needs_a_valid_key() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    api.write_file(&sb, "/tmp/keep.txt", b"kept").expect(200, "write a file");
    let proc_id = api.post(&format!("/v1/sandboxes/{sb}/processes"), &json!({"cmd": ["sleep", "60"]})).expect(200, "start a process")["id"].as_str().expect("id").to_owned();

    let s = format!("/v1/sandboxes/{sb}");
    let routes: Vec<(&str, String, Option<Value>)> = vec![
        ("GET", "/v1/sandboxes".into(), None),
        ("POST", "/v1/sandboxes".into(), Some(json!({}))),
        ("GET", s.clone(), None),
        ("PATCH", s.clone(), Some(json!({"metadata": {"x": "y"}}))),
        ("DELETE", s.clone(), None),
        ("POST", format!("{s}/ttl"), Some(json!({"ttl_s": 5}))),
        ("POST", format!("{s}/pause"), None),
        ("POST", format!("{s}/resume"), None),
        ("POST", format!("{s}/exec"), Some(json!({"shell": "touch /tmp/pwned"}))),
        ("POST", format!("{s}/processes"), Some(json!({"shell": "touch /tmp/pwned"}))),
        ("GET", format!("{s}/processes"), None),
        ("GET", format!("{s}/processes/{proc_id}"), None),
        ("GET", format!("{s}/processes/{proc_id}/output"), None),
        ("POST", format!("{s}/processes/{proc_id}/signal"), Some(json!({"signal": "KILL"}))),
        ("GET", format!("{s}/files?path=/tmp/keep.txt"), None),
        ("PUT", format!("{s}/files?path=/tmp/pwned"), None),
        ("DELETE", format!("{s}/files?path=/tmp/keep.txt"), None),
        ("GET", format!("{s}/files/list?path=/tmp"), None),
        ("GET", format!("{s}/files/stat?path=/tmp/keep.txt"), None),
        ("POST", format!("{s}/files/mkdir"), Some(json!({"path": "/tmp/pwned"}))),
        ("POST", format!("{s}/files/move"), Some(json!({"from": "/tmp/keep.txt", "to": "/tmp/pwned"}))),
        ("GET", "/v1/templates".into(), None),
        ("GET", "/v1/calls".into(), None),
        ("GET", "/v1/usage".into(), None),
    ];
    let admin_key = srv.admin_key.clone().expect("admin key");
    let wrong_key = format!("{}x", srv.api_key);
    let bad_headers: Vec<(&str, Option<String>)> = vec![
        ("no Authorization header", None),
        ("a wrong key", Some(format!("Bearer {wrong_key}"))),
        ("the admin key", Some(format!("Bearer {admin_key}"))),
        ("an empty Bearer", Some("Bearer ".into())),
        ("Basic auth", Some(format!("Basic {}", srv.api_key))),
        ("the key without Bearer", Some(srv.api_key.clone())),
    ];
    let anon = srv.anon();
    for (method, path, body) in &routes {
        for (what, header) in &bad_headers {
            let mut headers = vec![("Content-Type", "application/json")];
            if let Some(h) = header {
                headers.push(("Authorization", h.as_str()));
            }
            let body = body.as_ref().map(|b| serde_json::to_vec(b).expect("json")).unwrap_or_default();
            let r = anon.request(method, path, &headers, body);
            r.expect_error(401, "unauthorized", &format!("{method} {path} with {what}"));
        }
    }
    // The PTY and stdin routes too.
    let (status, body) = ws_connect(&srv.url, None, &format!("{s}/pty")).err().expect("the PTY without a key is refused");
    assert_eq!(status, 401, "the PTY without a key: {body}");
    let r = anon.request("POST", &format!("{s}/processes/{proc_id}/stdin"), &[], b"x".to_vec());
    r.expect_error(401, "unauthorized", "stdin without a key");

    // Nothing of the above happened.
    let v = api.get(&s).expect(200, "the sandbox survived the refused requests");
    assert_eq!(v["state"], "running");
    assert_eq!(v["metadata"], json!({}));
    assert_eq!(api.get("/v1/sandboxes").expect(200, "list")["sandboxes"].as_array().map(Vec::len), Some(1), "no sandbox was created");
    assert_eq!(api.read_file(&sb, "/tmp/keep.txt").body, b"kept");
    api.read_file(&sb, "/tmp/pwned").expect_error(404, "not_found", "no command ran, no file was written");
    let p = api.get(&format!("{s}/processes/{proc_id}")).expect(200, "the process");
    assert_eq!(p["state"], "running", "the process was not signalled: {p}");
}

// ---------------------------------------------------------------------------------------
// Tenants and keys
// ---------------------------------------------------------------------------------------

#[test]
fn tenants_never_see_each_other_and_revoked_keys_stop_at_once() {
    become_subreaper();
    let srv = Server::start();
    let a = srv.api();

    // Admin routes want the admin key, and nothing else.
    a.post("/v1/tenants", &json!({"name": "team-x"})).expect_error(401, "unauthorized", "a tenant key on an admin route");
    srv.anon().post("/v1/tenants", &json!({"name": "team-x"})).expect_error(401, "unauthorized", "no key on an admin route");
    let admin = srv.admin();
    refused(&admin.post("/v1/tenants", &json!({"name": "team-x", "bogus": 1})), 400, "bad_request", "bogus", "an unknown field");
    refused(&admin.post("/v1/tenants", &json!({"name": 7})), 400, "bad_request", "name", "a wrong type");
    admin.post("/v1/tenants", &json!({"name": "Not A Name!"})).expect_error(400, "bad_request", "an invalid tenant name");

    let created = admin.post("/v1/tenants", &json!({"name": "team-b"})).expect(201, "create tenant team-b");
    assert_eq!(created["tenant"], "team-b");
    let b_key = created["api_key"].as_str().expect("api_key").to_owned();
    let b_key_id = created["key_id"].as_str().expect("key_id").to_owned();
    assert!(b_key.starts_with("lk_"), "API keys start with lk_: {b_key}");
    assert!(b_key_id.starts_with("key_"), "key ids start with key_: {b_key_id}");
    let b = srv.api_with(&b_key);
    admin.post("/v1/tenants", &json!({"name": "team-b"})).expect_error(409, "conflict", "a tenant that exists");

    let sa = sandbox_id(&a.create_sandbox(&json!({"metadata": {"owner": "a"}})));
    a.write_file(&sa, "/tmp/a.txt", b"a's data").expect(200, "write");
    let a_call = a.exec(&sa, &json!({"shell": "echo a"}))["call_id"].as_str().expect("call_id").to_owned();
    let sb = sandbox_id(&b.create_sandbox(&json!({"metadata": {"owner": "b"}})));
    let a_proc = a.post(&format!("/v1/sandboxes/{sa}/processes"), &json!({"cmd": ["sleep", "60"]})).expect(200, "start")["id"].as_str().expect("id").to_owned();

    // Each tenant lists only its own.
    assert_eq!(ids(&a.get("/v1/sandboxes").expect(200, "list a"), "sandboxes"), vec![sa.clone()]);
    assert_eq!(ids(&b.get("/v1/sandboxes").expect(200, "list b"), "sandboxes"), vec![sb.clone()]);

    // Every route on a's sandbox answers b exactly like a sandbox that does not exist.
    let missing = "sb_00000000deadbeef";
    type Case = (&'static str, String, Option<Value>);
    let cases = |id: &str| -> Vec<Case> {
        let s = format!("/v1/sandboxes/{id}");
        vec![
            ("GET", s.clone(), None),
            ("PATCH", s.clone(), Some(json!({"metadata": {"owner": "b"}}))),
            ("DELETE", s.clone(), None),
            ("POST", format!("{s}/ttl"), Some(json!({"ttl_s": 1}))),
            ("POST", format!("{s}/pause"), None),
            ("POST", format!("{s}/resume"), None),
            ("POST", format!("{s}/exec"), Some(json!({"shell": "touch /tmp/pwned"}))),
            ("POST", format!("{s}/processes"), Some(json!({"shell": "touch /tmp/pwned"}))),
            ("GET", format!("{s}/processes"), None),
            ("GET", format!("{s}/processes/{a_proc}"), None),
            ("GET", format!("{s}/processes/{a_proc}/output"), None),
            ("POST", format!("{s}/processes/{a_proc}/signal"), Some(json!({"signal": "KILL"}))),
            ("GET", format!("{s}/files?path=/tmp/a.txt"), None),
            ("PUT", format!("{s}/files?path=/tmp/pwned"), None),
            ("DELETE", format!("{s}/files?path=/tmp/a.txt"), None),
            ("GET", format!("{s}/files/list?path=/tmp"), None),
            ("GET", format!("{s}/files/stat?path=/tmp/a.txt"), None),
            ("POST", format!("{s}/files/mkdir"), Some(json!({"path": "/tmp/pwned"}))),
            ("POST", format!("{s}/files/move"), Some(json!({"from": "/tmp/a.txt", "to": "/tmp/pwned"}))),
        ]
    };
    for ((method, path, body), (_, missing_path, _)) in cases(&sa).into_iter().zip(cases(missing)) {
        let send = |p: &str| {
            let headers = [("Content-Type", "application/json")];
            b.request(method, p, &headers, body.as_ref().map(|b| serde_json::to_vec(b).expect("json")).unwrap_or_default())
        };
        let theirs = send(&path).expect_error(404, "not_found", &format!("team-b: {method} {path} on team a's sandbox"));
        let nobody = send(&missing_path).expect_error(404, "not_found", &format!("team-b: {method} {missing_path}"));
        assert_eq!(theirs.replace(&sa, "ID"), nobody.replace(missing, "ID"), "{method} {path}: another tenant's sandbox must be indistinguishable from a missing one");
    }
    let (status, body) = ws_connect(&srv.url, Some(&b_key), &format!("/v1/sandboxes/{sa}/pty")).err().expect("b cannot open a's terminal");
    assert_eq!(status, 404, "b opening a's terminal: {body}");
    let r = b.request("POST", &format!("/v1/sandboxes/{sa}/processes/{a_proc}/stdin"), &[], b"x".to_vec());
    r.expect_error(404, "not_found", "b writing to a's process");

    // a's sandbox is untouched, and b's records show nothing of a.
    let v = a.get(&format!("/v1/sandboxes/{sa}")).expect(200, "a's sandbox is still there");
    assert_eq!(v["state"], "running");
    assert_eq!(v["metadata"], json!({"owner": "a"}));
    assert_eq!(a.read_file(&sa, "/tmp/a.txt").body, b"a's data");
    a.read_file(&sa, "/tmp/pwned").expect_error(404, "not_found", "nothing of b's ran in a's sandbox");
    assert_eq!(a.get(&format!("/v1/sandboxes/{sa}/processes/{a_proc}")).expect(200, "a's process")["state"], "running");
    let b_calls = b.get("/v1/calls").expect(200, "b's calls");
    assert_eq!(b_calls["calls"], json!([]), "b sees none of a's calls");
    let b_calls = b.get(&format!("/v1/calls?sandbox_id={sa}")).expect(200, "b's calls of a's sandbox");
    assert_eq!(b_calls["calls"], json!([]), "b sees none of a's calls, even by sandbox id");
    assert!(a.get("/v1/calls").text().contains(&a_call), "a sees its own call");

    // A second key of team-b; then revoking the first one takes effect at once.
    let k2 = admin.post_empty("/v1/tenants/team-b/keys").expect(201, "a second key of team-b");
    assert_eq!(k2["tenant"], "team-b");
    let b2 = srv.api_with(k2["api_key"].as_str().expect("api_key"));
    assert_eq!(ids(&b2.get("/v1/sandboxes").expect(200, "the second key lists team-b's"), "sandboxes"), vec![sb.clone()]);
    admin.post_empty("/v1/tenants/no-such-team/keys").expect_error(404, "not_found", "a key of an unknown tenant");
    a.delete(&format!("/v1/keys/{b_key_id}")).expect_error(401, "unauthorized", "revoking with a tenant key");
    assert_eq!(admin.delete(&format!("/v1/keys/{b_key_id}")).status, 204, "revoke team-b's first key");
    b.get("/v1/sandboxes").expect_error(401, "unauthorized", "a revoked key, right after revoking");
    b.post(&format!("/v1/sandboxes/{sb}/exec"), &json!({"shell": "true"})).expect_error(401, "unauthorized", "exec with a revoked key");
    assert_eq!(ids(&b2.get("/v1/sandboxes").expect(200, "the other key still works"), "sandboxes"), vec![sb.clone()]);
    admin.delete(&format!("/v1/keys/{b_key_id}")).expect_error(404, "not_found", "revoking a revoked key");

    // Keys are stored hashed: no key appears in clear anywhere in the data dir's files.
    for e in std::fs::read_dir(&srv.data_dir).expect("data dir").flatten() {
        if !e.path().is_file() {
            continue;
        }
        let bytes = std::fs::read(e.path()).unwrap_or_default();
        for key in [&srv.api_key, &b_key] {
            let found = bytes.windows(key.len()).any(|w| w == key.as_bytes());
            assert!(!found, "{} holds an API key in clear", e.path().display());
        }
    }
}
