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
use std::time::{Duration, Instant};

use locker_tests::server::{enc, rss_kib, Api, Resp, Server};
use locker_tests::{become_subreaper, frozen, traces_of, wait_for, TempDir};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

/// Parses the API's RFC 3339 UTC times (`2026-11-30T12:00:00Z`) to Unix seconds.
fn parse_time(s: &str) -> i64 {
    locker_types::parse_rfc3339(s).unwrap_or_else(|| panic!("not an RFC 3339 time: {s:?}"))
}

fn sandbox_id(v: &Value) -> String {
    let id = v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id in {v}"))
        .to_owned();
    assert!(id.starts_with("sb_"), "sandbox ids start with sb_: {id}");
    id
}

fn ids(list: &Value, key: &str) -> Vec<String> {
    list[key]
        .as_array()
        .unwrap_or_else(|| panic!("no `{key}` array in {list}"))
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_owned())
        .collect()
}

/// Whether any process of the sandbox has `needle` in its command line.
fn running_in(api: &Api, sb: &str, needle: &str) -> bool {
    api.sh(sb, "ps -eo args")
        .lines()
        .any(|l| l.contains(needle))
}

/// Reads NDJSON lines, each with the time it arrived since `t0`.
fn read_ndjson(r: impl Read, t0: Instant) -> Vec<(Duration, Value)> {
    let mut out = Vec::new();
    for line in BufReader::new(r).lines() {
        let line = line.expect("read an NDJSON line");
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}"));
        out.push((t0.elapsed(), v));
    }
    out
}

/// The concatenated `data` of the `kind` lines (stdout or stderr) of an NDJSON stream.
fn stream_text(lines: &[(Duration, Value)], kind: &str) -> String {
    lines
        .iter()
        .filter(|(_, v)| v["type"] == kind)
        .map(|(_, v)| v["data"].as_str().expect("data is a string"))
        .collect()
}

/// Asserts the body of every case is refused with `status`/`code` and a message naming
/// `needle` (the field at fault).
#[track_caller]
fn refused(r: &Resp, status: u16, code: &str, needle: &str, what: &str) {
    let msg = r.expect_error(status, code, what);
    assert!(
        msg.contains(needle),
        "{what}: the message should name `{needle}`: {msg:?}"
    );
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

    // Health: no key needed; the jail runtime works here; the microVM works (setup installs
    // QEMU and the guest kernel) or says why not, and the accelerator is named.
    let h = anon.get("/healthz").expect(200, "GET /healthz");
    assert_eq!(h["status"], "ok", "{h}");
    assert_eq!(h["runtimes"]["jail"], "ok", "{h}");
    let micro = h["runtimes"]["microvm"]
        .as_str()
        .unwrap_or_else(|| panic!("runtimes.microvm is reported: {h}"));
    assert!(
        micro == "ok" || micro.len() > "unavailable: ".len() && micro.starts_with("unavailable: "),
        "microvm works or says why not: {micro:?}"
    );
    let accel = h["virtualization"]["accel"].as_str().unwrap_or_default();
    assert!(accel == "kvm" || accel == "tcg", "{h}");
    assert!(
        !h["virtualization"]["detail"]
            .as_str()
            .unwrap_or_default()
            .is_empty(),
        "{h}"
    );

    // OpenAPI: no key needed; documents every route of the contract, keyed routes as such.
    let o = anon.get("/openapi.json").expect(200, "GET /openapi.json");
    assert!(
        o["openapi"].as_str().is_some_and(|v| v.starts_with("3.")),
        "an OpenAPI 3 document: {}",
        o["openapi"]
    );
    for (method, path) in CONTRACT_ROUTES {
        let op = &o["paths"][path][method];
        assert!(op.is_object(), "/openapi.json documents {method} {path}");
        let keyed = path.starts_with("/v1/");
        assert_eq!(
            op.get("security").is_some(),
            keyed,
            "{method} {path}: security is declared exactly on /v1 routes"
        );
    }
    let schema = &o["components"]["schemas"]["Error"];
    assert!(schema.is_object(), "the error shape is in the document");

    // Templates: the default template exists, with its digest.
    let api = srv.api();
    let t = api.get("/v1/templates").expect(200, "GET /v1/templates");
    let def = t["templates"]
        .as_array()
        .expect("templates")
        .iter()
        .find(|t| t["name"] == "default")
        .cloned()
        .unwrap_or_else(|| panic!("the default template is listed: {t}"));
    assert!(
        def["digest"].as_str().is_some_and(|d| !d.is_empty()),
        "{def}"
    );
    assert!(def["size_bytes"].as_u64().is_some_and(|n| n > 0), "{def}");

    // Metrics: no key needed; Prometheus text counting the requests above by route.
    let m = anon.get("/metrics");
    assert_eq!(m.status, 200, "GET /metrics: {}", m.text());
    let ctype = m
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    assert!(
        ctype.starts_with("text/plain"),
        "metrics are Prometheus text: {ctype}"
    );
    let text = m.text();
    let counted = |line: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(line))
            .and_then(|n| n.trim().parse::<u64>().ok())
    };
    assert_eq!(
        counted(
            "locker_http_requests_total{method=\"GET\",route=\"/v1/templates\",status=\"200\"} "
        ),
        Some(1),
        "requests are counted by route and status:\n{text}"
    );
    assert!(
        counted("locker_http_requests_total{method=\"GET\",route=\"/healthz\",status=\"200\"} ")
            .is_some_and(|n| n >= 1),
        "{text}"
    );
    assert!(
        text.contains("# TYPE locker_exec_duration_seconds histogram"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE locker_sandbox_create_seconds histogram"),
        "{text}"
    );

    // An unknown route and a wrong method answer with the error shape too.
    refused(
        &anon.get("/v2/nothing"),
        404,
        "not_found",
        "route",
        "an unknown route",
    );
    let r = api.request("PUT", "/v1/sandboxes", &[], ());
    assert_eq!(
        r.status,
        405,
        "PUT /v1/sandboxes is a wrong method: {}",
        r.text()
    );
    r.expect_error(405, "method_not_allowed", "a wrong method");
}

#[test]
fn every_v1_route_needs_a_valid_key() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    api.write_file(&sb, "/tmp/keep.txt", b"kept")
        .expect(200, "write a file");
    let proc_id = api
        .post(
            &format!("/v1/sandboxes/{sb}/processes"),
            &json!({"cmd": ["sleep", "60"]}),
        )
        .expect(200, "start a process")["id"]
        .as_str()
        .expect("id")
        .to_owned();

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
        (
            "POST",
            format!("{s}/exec"),
            Some(json!({"shell": "touch /tmp/pwned"})),
        ),
        (
            "POST",
            format!("{s}/processes"),
            Some(json!({"shell": "touch /tmp/pwned"})),
        ),
        ("GET", format!("{s}/processes"), None),
        ("GET", format!("{s}/processes/{proc_id}"), None),
        ("GET", format!("{s}/processes/{proc_id}/output"), None),
        (
            "POST",
            format!("{s}/processes/{proc_id}/signal"),
            Some(json!({"signal": "KILL"})),
        ),
        ("GET", format!("{s}/files?path=/tmp/keep.txt"), None),
        ("PUT", format!("{s}/files?path=/tmp/pwned"), None),
        ("DELETE", format!("{s}/files?path=/tmp/keep.txt"), None),
        ("GET", format!("{s}/files/list?path=/tmp"), None),
        ("GET", format!("{s}/files/stat?path=/tmp/keep.txt"), None),
        (
            "POST",
            format!("{s}/files/mkdir"),
            Some(json!({"path": "/tmp/pwned"})),
        ),
        (
            "POST",
            format!("{s}/files/move"),
            Some(json!({"from": "/tmp/keep.txt", "to": "/tmp/pwned"})),
        ),
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
            let body = body
                .as_ref()
                .map(|b| serde_json::to_vec(b).expect("json"))
                .unwrap_or_default();
            let r = anon.request(method, path, &headers, body);
            r.expect_error(401, "unauthorized", &format!("{method} {path} with {what}"));
        }
    }
    // The PTY and stdin routes too.
    let Err((status, body)) = ws_connect(&srv.url, None, &format!("{s}/pty")) else {
        panic!("the PTY without a key is refused")
    };
    assert_eq!(status, 401, "the PTY without a key: {body}");
    let r = anon.request(
        "POST",
        &format!("{s}/processes/{proc_id}/stdin"),
        &[],
        b"x".to_vec(),
    );
    r.expect_error(401, "unauthorized", "stdin without a key");

    // Nothing of the above happened.
    let v = api
        .get(&s)
        .expect(200, "the sandbox survived the refused requests");
    assert_eq!(v["state"], "running");
    assert_eq!(v["metadata"], json!({}));
    assert_eq!(
        api.get("/v1/sandboxes").expect(200, "list")["sandboxes"]
            .as_array()
            .map(Vec::len),
        Some(1),
        "no sandbox was created"
    );
    assert_eq!(api.read_file(&sb, "/tmp/keep.txt").body, b"kept");
    api.read_file(&sb, "/tmp/pwned").expect_error(
        404,
        "not_found",
        "no command ran, no file was written",
    );
    let p = api
        .get(&format!("{s}/processes/{proc_id}"))
        .expect(200, "the process");
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
    a.post("/v1/tenants", &json!({"name": "team-x"}))
        .expect_error(401, "unauthorized", "a tenant key on an admin route");
    srv.anon()
        .post("/v1/tenants", &json!({"name": "team-x"}))
        .expect_error(401, "unauthorized", "no key on an admin route");
    let admin = srv.admin();
    refused(
        &admin.post("/v1/tenants", &json!({"name": "team-x", "bogus": 1})),
        400,
        "bad_request",
        "bogus",
        "an unknown field",
    );
    refused(
        &admin.post("/v1/tenants", &json!({"name": 7})),
        400,
        "bad_request",
        "name",
        "a wrong type",
    );
    admin
        .post("/v1/tenants", &json!({"name": "Not A Name!"}))
        .expect_error(400, "bad_request", "an invalid tenant name");

    let created = admin
        .post("/v1/tenants", &json!({"name": "team-b"}))
        .expect(201, "create tenant team-b");
    assert_eq!(created["tenant"], "team-b");
    let b_key = created["api_key"].as_str().expect("api_key").to_owned();
    let b_key_id = created["key_id"].as_str().expect("key_id").to_owned();
    assert!(b_key.starts_with("lk_"), "API keys start with lk_: {b_key}");
    assert!(
        b_key_id.starts_with("key_"),
        "key ids start with key_: {b_key_id}"
    );
    let b = srv.api_with(&b_key);
    admin
        .post("/v1/tenants", &json!({"name": "team-b"}))
        .expect_error(409, "conflict", "a tenant that exists");

    let sa = sandbox_id(&a.create_sandbox(&json!({"metadata": {"owner": "a"}})));
    a.write_file(&sa, "/tmp/a.txt", b"a's data")
        .expect(200, "write");
    let a_call = a.exec(&sa, &json!({"shell": "echo a"}))["call_id"]
        .as_str()
        .expect("call_id")
        .to_owned();
    let sb = sandbox_id(&b.create_sandbox(&json!({"metadata": {"owner": "b"}})));
    let a_proc = a
        .post(
            &format!("/v1/sandboxes/{sa}/processes"),
            &json!({"cmd": ["sleep", "60"]}),
        )
        .expect(200, "start")["id"]
        .as_str()
        .expect("id")
        .to_owned();

    // Each tenant lists only its own.
    assert_eq!(
        ids(&a.get("/v1/sandboxes").expect(200, "list a"), "sandboxes"),
        vec![sa.clone()]
    );
    assert_eq!(
        ids(&b.get("/v1/sandboxes").expect(200, "list b"), "sandboxes"),
        vec![sb.clone()]
    );

    // Every route on a's sandbox answers b exactly like a sandbox that does not exist.
    let missing = "sb_00000000deadbeef";
    type Case = (&'static str, String, Option<Value>);
    let cases = |id: &str| -> Vec<Case> {
        let s = format!("/v1/sandboxes/{id}");
        vec![
            ("GET", s.clone(), None),
            (
                "PATCH",
                s.clone(),
                Some(json!({"metadata": {"owner": "b"}})),
            ),
            ("DELETE", s.clone(), None),
            ("POST", format!("{s}/ttl"), Some(json!({"ttl_s": 1}))),
            ("POST", format!("{s}/pause"), None),
            ("POST", format!("{s}/resume"), None),
            (
                "POST",
                format!("{s}/exec"),
                Some(json!({"shell": "touch /tmp/pwned"})),
            ),
            (
                "POST",
                format!("{s}/processes"),
                Some(json!({"shell": "touch /tmp/pwned"})),
            ),
            ("GET", format!("{s}/processes"), None),
            ("GET", format!("{s}/processes/{a_proc}"), None),
            ("GET", format!("{s}/processes/{a_proc}/output"), None),
            (
                "POST",
                format!("{s}/processes/{a_proc}/signal"),
                Some(json!({"signal": "KILL"})),
            ),
            ("GET", format!("{s}/files?path=/tmp/a.txt"), None),
            ("PUT", format!("{s}/files?path=/tmp/pwned"), None),
            ("DELETE", format!("{s}/files?path=/tmp/a.txt"), None),
            ("GET", format!("{s}/files/list?path=/tmp"), None),
            ("GET", format!("{s}/files/stat?path=/tmp/a.txt"), None),
            (
                "POST",
                format!("{s}/files/mkdir"),
                Some(json!({"path": "/tmp/pwned"})),
            ),
            (
                "POST",
                format!("{s}/files/move"),
                Some(json!({"from": "/tmp/a.txt", "to": "/tmp/pwned"})),
            ),
        ]
    };
    for ((method, path, body), (_, missing_path, _)) in cases(&sa).into_iter().zip(cases(missing)) {
        let send = |p: &str| {
            let headers = [("Content-Type", "application/json")];
            b.request(
                method,
                p,
                &headers,
                body.as_ref()
                    .map(|b| serde_json::to_vec(b).expect("json"))
                    .unwrap_or_default(),
            )
        };
        let theirs = send(&path).expect_error(
            404,
            "not_found",
            &format!("team-b: {method} {path} on team a's sandbox"),
        );
        let nobody = send(&missing_path).expect_error(
            404,
            "not_found",
            &format!("team-b: {method} {missing_path}"),
        );
        assert_eq!(
            theirs.replace(&sa, "ID"),
            nobody.replace(missing, "ID"),
            "{method} {path}: another tenant's sandbox must be indistinguishable from a missing one"
        );
    }
    let Err((status, body)) =
        ws_connect(&srv.url, Some(&b_key), &format!("/v1/sandboxes/{sa}/pty"))
    else {
        panic!("b cannot open a's terminal")
    };
    assert_eq!(status, 404, "b opening a's terminal: {body}");
    let r = b.request(
        "POST",
        &format!("/v1/sandboxes/{sa}/processes/{a_proc}/stdin"),
        &[],
        b"x".to_vec(),
    );
    r.expect_error(404, "not_found", "b writing to a's process");

    // a's sandbox is untouched, and b's records show nothing of a.
    let v = a
        .get(&format!("/v1/sandboxes/{sa}"))
        .expect(200, "a's sandbox is still there");
    assert_eq!(v["state"], "running");
    assert_eq!(v["metadata"], json!({"owner": "a"}));
    assert_eq!(a.read_file(&sa, "/tmp/a.txt").body, b"a's data");
    a.read_file(&sa, "/tmp/pwned").expect_error(
        404,
        "not_found",
        "nothing of b's ran in a's sandbox",
    );
    assert_eq!(
        a.get(&format!("/v1/sandboxes/{sa}/processes/{a_proc}"))
            .expect(200, "a's process")["state"],
        "running"
    );
    let b_calls = b.get("/v1/calls").expect(200, "b's calls");
    assert_eq!(b_calls["calls"], json!([]), "b sees none of a's calls");
    let b_calls = b
        .get(&format!("/v1/calls?sandbox_id={sa}"))
        .expect(200, "b's calls of a's sandbox");
    assert_eq!(
        b_calls["calls"],
        json!([]),
        "b sees none of a's calls, even by sandbox id"
    );
    assert!(
        a.get("/v1/calls").text().contains(&a_call),
        "a sees its own call"
    );

    // A second key of team-b; then revoking the first one takes effect at once.
    let k2 = admin
        .post_empty("/v1/tenants/team-b/keys")
        .expect(201, "a second key of team-b");
    assert_eq!(k2["tenant"], "team-b");
    let b2 = srv.api_with(k2["api_key"].as_str().expect("api_key"));
    assert_eq!(
        ids(
            &b2.get("/v1/sandboxes")
                .expect(200, "the second key lists team-b's"),
            "sandboxes"
        ),
        vec![sb.clone()]
    );
    admin
        .post_empty("/v1/tenants/no-such-team/keys")
        .expect_error(404, "not_found", "a key of an unknown tenant");
    a.delete(&format!("/v1/keys/{b_key_id}")).expect_error(
        401,
        "unauthorized",
        "revoking with a tenant key",
    );
    assert_eq!(
        admin.delete(&format!("/v1/keys/{b_key_id}")).status,
        204,
        "revoke team-b's first key"
    );
    b.get("/v1/sandboxes")
        .expect_error(401, "unauthorized", "a revoked key, right after revoking");
    b.post(
        &format!("/v1/sandboxes/{sb}/exec"),
        &json!({"shell": "true"}),
    )
    .expect_error(401, "unauthorized", "exec with a revoked key");
    assert_eq!(
        ids(
            &b2.get("/v1/sandboxes")
                .expect(200, "the other key still works"),
            "sandboxes"
        ),
        vec![sb.clone()]
    );
    admin.delete(&format!("/v1/keys/{b_key_id}")).expect_error(
        404,
        "not_found",
        "revoking a revoked key",
    );

    // Keys are stored hashed: no key appears in clear anywhere in the data dir's files.
    for e in std::fs::read_dir(&srv.data_dir)
        .expect("data dir")
        .flatten()
    {
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

#[test]
fn without_an_api_key_the_first_start_generates_one_and_prints_it_once() {
    become_subreaper();
    let mut srv = Server::generating_key();
    let key = srv.api_key.clone();
    assert!(
        key.starts_with("lk_") && key.len() >= 20,
        "a generated key: {key:?}"
    );
    assert_eq!(
        srv.log_text().matches("(shown only now").count(),
        1,
        "the key is printed at the first start"
    );
    assert_eq!(
        srv.api()
            .get("/v1/sandboxes")
            .expect(200, "the generated key works")["sandboxes"],
        json!([])
    );
    srv.restart();
    assert_eq!(
        srv.log_text().matches("(shown only now").count(),
        1,
        "a restart prints no key (and makes no new one):\n{}",
        srv.log_text()
    );
    srv.api()
        .get("/v1/sandboxes")
        .expect(200, "the generated key works after a restart");
    for e in std::fs::read_dir(&srv.data_dir)
        .expect("data dir")
        .flatten()
    {
        let bytes = std::fs::read(e.path()).unwrap_or_default();
        assert!(
            !bytes.windows(key.len()).any(|w| w == key.as_bytes()),
            "{} holds the generated key in clear",
            e.path().display()
        );
    }
}

// ---------------------------------------------------------------------------------------
// Sandboxes
// ---------------------------------------------------------------------------------------

#[test]
fn sandboxes_create_get_list_patch_ttl_pause_resume_delete() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();

    let before = now_s();
    let red = api.create_sandbox(&json!({
        "template": "default", "runtime": "auto", "cpus": 1, "memory_mb": 256, "disk_mb": 512, "ttl_s": 600,
        "env": {"GREETING": "hello from the sandbox"}, "network": {"egress": "none"},
        "metadata": {"team": "red", "n": "1"}
    }));
    let id = sandbox_id(&red);
    assert_eq!(red["state"], "running", "{red}");
    assert_eq!(red["template"], "default");
    assert_eq!(red["runtime"], "jail", "auto resolves to the jail here");
    assert_eq!(red["cpus"].as_f64(), Some(1.0));
    assert_eq!(red["memory_mb"], 256);
    assert_eq!(red["disk_mb"], 512);
    assert_eq!(red["network"], json!({"egress": "none"}));
    assert_eq!(red["volumes"], json!([]));
    assert_eq!(red["metadata"], json!({"team": "red", "n": "1"}));
    let created = parse_time(red["created_at"].as_str().expect("created_at"));
    assert!(
        (before - 1..=now_s() + 1).contains(&created),
        "created_at is now: {red}"
    );
    assert_eq!(
        parse_time(red["expires_at"].as_str().expect("expires_at")),
        created + 600,
        "expires_at = created_at + ttl_s"
    );
    parse_time(red["last_active_at"].as_str().expect("last_active_at"));
    assert!(
        red["usage"]["cpu_ms"].is_u64() && red["usage"]["peak_memory_bytes"].is_u64(),
        "usage: {red}"
    );
    // The sandbox's env reaches every exec.
    assert_eq!(api.sh(&id, "echo $GREETING"), "hello from the sandbox\n");

    // Defaults.
    let blue = api.create_sandbox(&json!({"metadata": {"team": "blue"}}));
    let blue_id = sandbox_id(&blue);
    assert_eq!(
        (blue["cpus"].as_f64(), &blue["memory_mb"], &blue["disk_mb"]),
        (Some(1.0), &json!(512), &json!(2048)),
        "defaults: {blue}"
    );
    let ttl = parse_time(blue["expires_at"].as_str().expect("expires_at"))
        - parse_time(blue["created_at"].as_str().expect("created_at"));
    assert_eq!(ttl, 1800, "the default ttl_s is 1800");
    assert_eq!(
        blue["network"],
        json!({"egress": "none"}),
        "no network by default"
    );

    // Get.
    let got = api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get");
    for k in [
        "id",
        "state",
        "template",
        "runtime",
        "cpus",
        "memory_mb",
        "disk_mb",
        "network",
        "volumes",
        "metadata",
        "created_at",
        "expires_at",
    ] {
        assert_eq!(
            got[k], red[k],
            "GET shows the same `{k}` as the create answer"
        );
    }
    api.get("/v1/sandboxes/sb_00000000deadbeef").expect_error(
        404,
        "not_found",
        "a sandbox that does not exist",
    );

    // List and its filters.
    let list = |q: &str| {
        let mut v = ids(
            &api.get(&format!("/v1/sandboxes{q}"))
                .expect(200, &format!("list {q}")),
            "sandboxes",
        );
        v.sort();
        v
    };
    let mut both = vec![id.clone(), blue_id.clone()];
    both.sort();
    assert_eq!(list(""), both);
    assert_eq!(list("?state=running"), both);
    assert_eq!(list("?state=paused"), Vec::<String>::new());
    assert_eq!(list("?metadata.team=red"), vec![id.clone()]);
    assert_eq!(list("?metadata.team=red&metadata.n=1"), vec![id.clone()]);
    assert_eq!(
        list("?metadata.team=red&metadata.n=2"),
        Vec::<String>::new()
    );
    assert_eq!(
        list("?state=running&metadata.team=blue"),
        vec![blue_id.clone()]
    );
    assert_eq!(list("?metadata.team=green"), Vec::<String>::new());
    refused(
        &api.get("/v1/sandboxes?state=sleepy"),
        400,
        "bad_request",
        "state",
        "an unknown state filter",
    );
    refused(
        &api.get("/v1/sandboxes?colour=red"),
        400,
        "bad_request",
        "colour",
        "an unknown query parameter",
    );

    // Patch: metadata is replaced, the network policy checked (fails closed).
    let p = api
        .patch(
            &format!("/v1/sandboxes/{id}"),
            &json!({"metadata": {"team": "green"}}),
        )
        .expect(200, "patch metadata");
    assert_eq!(p["metadata"], json!({"team": "green"}));
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get")["metadata"],
        json!({"team": "green"})
    );
    assert_eq!(list("?metadata.team=green"), vec![id.clone()]);
    assert_eq!(list("?metadata.team=red"), Vec::<String>::new());
    let p = api
        .patch(
            &format!("/v1/sandboxes/{id}"),
            &json!({"network": {"egress": "none"}}),
        )
        .expect(200, "patch network");
    assert_eq!(p["network"], json!({"egress": "none"}));
    refused(
        &api.patch(
            &format!("/v1/sandboxes/{id}"),
            &json!({"network": {"egress": "allow", "allow": ["fd00:ec2::254"]}}),
        ),
        400,
        "bad_request",
        "IPv6",
        "an allowlist entry this version cannot enforce",
    );
    refused(
        &api.patch(&format!("/v1/sandboxes/{id}"), &json!({"bogus": 1})),
        400,
        "bad_request",
        "bogus",
        "patch: an unknown field",
    );
    refused(
        &api.patch(
            &format!("/v1/sandboxes/{id}"),
            &json!({"metadata": {"k": 1}}),
        ),
        400,
        "bad_request",
        "metadata",
        "patch: a wrong type",
    );
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get")["network"],
        json!({"egress": "none"}),
        "a refused patch changes nothing"
    );

    // TTL: expires_at = now + ttl_s.
    let t = api
        .post(&format!("/v1/sandboxes/{id}/ttl"), &json!({"ttl_s": 3600}))
        .expect(200, "set the ttl");
    let exp = parse_time(t["expires_at"].as_str().expect("expires_at"));
    assert!(
        (now_s() + 3598..=now_s() + 3601).contains(&exp),
        "expires_at = now + 3600: {t}"
    );
    refused(
        &api.post(&format!("/v1/sandboxes/{id}/ttl"), &json!({"ttl_s": 0})),
        400,
        "bad_request",
        "ttl_s",
        "ttl 0",
    );
    refused(
        &api.post(&format!("/v1/sandboxes/{id}/ttl"), &json!({"ttl_s": -5})),
        400,
        "bad_request",
        "ttl_s",
        "a negative ttl",
    );
    refused(
        &api.post(&format!("/v1/sandboxes/{id}/ttl"), &json!({})),
        400,
        "bad_request",
        "ttl_s",
        "a missing ttl",
    );

    // Pause freezes every process; resume, or any call, thaws them.
    let counter = api
        .post(
            &format!("/v1/sandboxes/{id}/processes"),
            &json!({"shell": "while true; do date +%s%N >> /tmp/ticks; sleep 0.02; done"}),
        )
        .expect(200, "a ticking process");
    assert!(counter["id"].as_str().is_some());
    let p = api
        .post_empty(&format!("/v1/sandboxes/{id}/pause"))
        .expect(200, "pause");
    assert_eq!(p["state"], "paused");
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get")["state"],
        "paused"
    );
    assert_eq!(
        frozen(&id),
        Some(true),
        "the machine's cgroup is frozen on the host"
    );
    assert_eq!(list("?state=paused"), vec![id.clone()]);
    assert_eq!(list("?state=running"), vec![blue_id.clone()]);
    let r = api
        .post_empty(&format!("/v1/sandboxes/{id}/resume"))
        .expect(200, "resume");
    assert_eq!(r["state"], "running");
    assert_eq!(frozen(&id), Some(false), "thawed on the host");
    let ticks = |api: &Api| {
        api.sh(&id, "wc -l < /tmp/ticks")
            .trim()
            .parse::<u64>()
            .expect("a count")
    };
    let n = ticks(&api);
    wait_for(
        Duration::from_secs(5),
        "the ticking process runs again after resume",
        || (ticks(&api) > n).then_some(()),
    );
    api.post_empty(&format!("/v1/sandboxes/{id}/pause"))
        .expect(200, "pause again");
    assert_eq!(frozen(&id), Some(true));
    assert_eq!(
        api.sh(&id, "echo thawed by a call"),
        "thawed by a call\n",
        "a call on a paused sandbox thaws it first"
    );
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get")["state"],
        "running"
    );
    assert_eq!(frozen(&id), Some(false));

    // Delete: 204, then gone everywhere, and nothing of it is left on the host.
    api.post_empty(&format!("/v1/sandboxes/{blue_id}/pause"))
        .expect(200, "pause blue");
    for sb in [&id, &blue_id] {
        assert_eq!(
            api.delete(&format!("/v1/sandboxes/{sb}")).status,
            204,
            "delete {sb} (blue is paused)"
        );
        api.get(&format!("/v1/sandboxes/{sb}"))
            .expect_error(404, "not_found", "a deleted sandbox");
        api.delete(&format!("/v1/sandboxes/{sb}"))
            .expect_error(404, "not_found", "deleting twice");
        api.post(
            &format!("/v1/sandboxes/{sb}/exec"),
            &json!({"shell": "true"}),
        )
        .expect_error(404, "not_found", "exec in a deleted sandbox");
        let traces = traces_of(sb, &srv.machine_dir(sb));
        assert!(
            traces.is_empty(),
            "{sb} left traces on the host: {traces:?}"
        );
    }
    assert_eq!(list(""), Vec::<String>::new());

    // A sandbox whose TTL passes is destroyed by the server, even a paused one.
    let short = sandbox_id(&api.create_sandbox(&json!({"ttl_s": 1})));
    api.post_empty(&format!("/v1/sandboxes/{short}/pause"))
        .expect(200, "pause the short-lived sandbox");
    wait_for(
        Duration::from_secs(6),
        "the server destroys a sandbox whose ttl passed",
        || (api.get(&format!("/v1/sandboxes/{short}")).status == 404).then_some(()),
    );
    let traces = wait_for(
        Duration::from_secs(3),
        "an expired sandbox leaves nothing on the host",
        || {
            let t = traces_of(&short, &srv.machine_dir(&short));
            t.is_empty().then_some(t)
        },
    );
    assert!(traces.is_empty());
}

#[test]
fn an_idle_sandbox_is_paused_after_idle_timeout_s() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({"idle_timeout_s": 1})));
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["idle_timeout_s"],
        1
    );
    // Reading the sandbox's record is not a call on it: it must not keep it awake.
    wait_for(
        Duration::from_secs(5),
        "a sandbox with idle_timeout_s=1 is paused after a second without calls",
        || {
            (api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["state"] == "paused")
                .then_some(())
        },
    );
    assert_eq!(
        frozen(&sb),
        Some(true),
        "an idle-paused sandbox is frozen on the host"
    );
    assert_eq!(api.sh(&sb, "echo awake"), "awake\n", "a call wakes it");
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["state"],
        "running"
    );
}

#[test]
fn idle_pause_never_fires_during_work() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({"idle_timeout_s": 1})));
    // A long call in flight keeps it awake, whatever its CPU use.
    let api2 = srv.api();
    let sb2 = sb.clone();
    let long = std::thread::spawn(move || api2.sh(&sb2, "sleep 3; echo done"));
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["state"],
        "running",
        "paused during a call"
    );
    assert_eq!(long.join().unwrap(), "done\n");
    // A background process busy on the CPU keeps it awake with no call in flight.
    let p = api
        .post(
            &format!("/v1/sandboxes/{sb}/processes"),
            &json!({"shell": "while :; do :; done"}),
        )
        .expect(200, "start a spinner");
    std::thread::sleep(Duration::from_millis(3000));
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["state"],
        "running",
        "paused while its processes work"
    );
    assert_eq!(frozen(&sb), Some(false));
    let pid = p["id"].as_str().unwrap();
    api.post(
        &format!("/v1/sandboxes/{sb}/processes/{pid}/signal"),
        &json!({"signal": "SIGKILL"}),
    )
    .expect(200, "kill the spinner");
    // Quiet now: it is paused soon after.
    wait_for(Duration::from_secs(6), "paused once quiet", || {
        (api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["state"] == "paused")
            .then_some(())
    });
}

#[test]
fn bad_sandbox_requests_are_refused_with_the_error_shape() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let cases: Vec<(Value, u16, &str, &str)> = vec![
        (json!({"bogus": 1}), 400, "bad_request", "bogus"),
        (
            json!({"memory_mb": "lots"}),
            400,
            "bad_request",
            "memory_mb",
        ),
        (json!({"memory_mb": 1}), 400, "bad_request", "memory_mb"),
        (json!({"disk_mb": -5}), 400, "bad_request", "disk_mb"),
        (json!({"disk_mb": 1.5}), 400, "bad_request", "disk_mb"),
        (json!({"cpus": -1}), 400, "bad_request", "cpus"),
        (json!({"cpus": "two"}), 400, "bad_request", "cpus"),
        (json!({"ttl_s": 0}), 400, "bad_request", "ttl_s"),
        (json!({"ttl_s": -3}), 400, "bad_request", "ttl_s"),
        (
            json!({"idle_timeout_s": 0}),
            400,
            "bad_request",
            "idle_timeout_s",
        ),
        (json!({"env": "A=B"}), 400, "bad_request", "env"),
        (json!({"env": {"A=B": "x"}}), 400, "bad_request", "env"),
        (
            json!({"metadata": {"k": 5}}),
            400,
            "bad_request",
            "metadata",
        ),
        (json!({"metadata": ["k"]}), 400, "bad_request", "metadata"),
        (
            json!({"template": "no-such-template"}),
            400,
            "bad_request",
            "no-such-template",
        ),
        (json!({"template": 5}), 400, "bad_request", "template"),
        (json!({"runtime": "qemu"}), 400, "bad_request", "qemu"),
        (json!({"runtime": "gvisor"}), 503, "unavailable", "gvisor"),
        (
            json!({"network": {"egress": "allow", "allow": ["*"]}}),
            400,
            "bad_request",
            "egress",
        ),
        (
            json!({"network": {"egress": "sideways"}}),
            400,
            "bad_request",
            "egress",
        ),
        (
            json!({"network": {"egress": "none", "proxy": "x"}}),
            400,
            "bad_request",
            "proxy",
        ),
        (json!({"network": "none"}), 400, "bad_request", "network"),
        (json!([]), 400, "bad_request", "body"),
    ];
    for (body, status, code, needle) in &cases {
        refused(
            &api.post("/v1/sandboxes", body),
            *status,
            code,
            needle,
            &format!("POST /v1/sandboxes {body}"),
        );
    }
    let raw = |ctype: Option<&str>, body: Vec<u8>| {
        let mut h = vec![];
        if let Some(c) = ctype {
            h.push(("Content-Type", c));
        }
        api.request("POST", "/v1/sandboxes", &h, body)
    };
    raw(Some("application/json"), b"{\"cpus\": ".to_vec()).expect_error(
        400,
        "bad_request",
        "malformed JSON",
    );
    raw(None, b"{}".to_vec()).expect_error(400, "bad_request", "no Content-Type");
    raw(Some("text/plain"), b"{}".to_vec()).expect_error(
        400,
        "bad_request",
        "a non-JSON Content-Type",
    );
    let big = serde_json::to_vec(&json!({"env": {"A": "x".repeat(2 << 20)}})).expect("json");
    let (status, body) = post_oversized(&srv, "/v1/sandboxes", &big);
    let r = Resp {
        status,
        headers: Default::default(),
        body: body.into_bytes(),
    };
    r.expect_error(413, "payload_too_large", "a 2 MiB JSON body");

    // None of these made a sandbox or left a machine directory.
    assert_eq!(
        api.get("/v1/sandboxes").expect(200, "list")["sandboxes"],
        json!([])
    );
    let dirs: Vec<_> = std::fs::read_dir(srv.data_dir.join("sandboxes"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        dirs.is_empty(),
        "refused creates left machine dirs: {dirs:?}"
    );
    // And the server still works.
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    assert_eq!(api.sh(&sb, "echo ok"), "ok\n");
}

/// POSTs a body the server refuses before reading it all, on a raw connection: the body
/// is written from another thread while this one reads the answer, so the server closing
/// the connection early cannot hide its answer behind a broken pipe.
fn post_oversized(srv: &Server, path: &str, body: &[u8]) -> (u16, String) {
    use std::io::Write;
    let mut s = TcpStream::connect(srv.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        srv.addr,
        srv.api_key,
        body.len()
    );
    s.write_all(head.as_bytes())
        .expect("write the request head");
    let mut w = s.try_clone().expect("clone the socket");
    let body = body.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&body);
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if got.windows(4).any(|w| w == b"\r\n\r\n")
                    && e.kind() == std::io::ErrorKind::ConnectionReset =>
            {
                break
            }
            Err(e) => panic!(
                "reading the answer to an oversized body: {e} (got {:?})",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
    let _ = writer.join();
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {head:?}"));
    // The error body is small: either sent with a length, or as one chunk.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body.split_once("\r\n")
            .map(|(_, rest)| rest.split("\r\n").next().unwrap_or(""))
            .unwrap_or("")
            .to_owned()
    } else {
        body.to_owned()
    };
    (status, body)
}

#[test]
fn quotas_answer_429_naming_the_quota() {
    become_subreaper();
    let srv = Server::without_admin(&[
        "--quota-sandboxes",
        "2",
        "--quota-memory-mb",
        "1024",
        "--metrics-token",
        "metrics-secret",
    ]);
    let api = srv.api();
    let a = sandbox_id(&api.create_sandbox(&json!({"memory_mb": 512})));
    refused(
        &api.post("/v1/sandboxes", &json!({"memory_mb": 600})),
        429,
        "quota_exceeded",
        "memory",
        "past the memory quota",
    );
    let b = sandbox_id(&api.create_sandbox(&json!({"memory_mb": 256})));
    let msg = api
        .post("/v1/sandboxes", &json!({"memory_mb": 64}))
        .expect_error(429, "quota_exceeded", "a third sandbox");
    assert!(
        msg.contains("sandboxes") && msg.contains('2'),
        "the message names the sandbox quota: {msg:?}"
    );
    // A paused sandbox still counts.
    api.post_empty(&format!("/v1/sandboxes/{a}/pause"))
        .expect(200, "pause");
    api.post("/v1/sandboxes", &json!({"memory_mb": 64}))
        .expect_error(429, "quota_exceeded", "a paused sandbox counts");
    // Deleting frees the slot.
    assert_eq!(api.delete(&format!("/v1/sandboxes/{b}")).status, 204);
    let c = sandbox_id(&api.create_sandbox(&json!({"memory_mb": 64})));
    assert_eq!(api.sh(&c, "echo fits"), "fits\n");

    // --metrics-token: /metrics wants it.
    srv.anon()
        .get("/metrics")
        .expect_error(401, "unauthorized", "/metrics without the token");
    srv.anon()
        .with_key(Some("wrong"))
        .get("/metrics")
        .expect_error(401, "unauthorized", "/metrics with a wrong token");
    let m = srv.anon().with_key(Some("metrics-secret")).get("/metrics");
    assert_eq!(m.status, 200, "/metrics with the token: {}", m.text());
    assert!(
        m.text().contains("locker_sandboxes{state=\"paused\"} 1"),
        "{}",
        m.text()
    );
    // Without LOCKER_ADMIN_KEY the admin routes do not exist.
    srv.api()
        .post("/v1/tenants", &json!({"name": "x"}))
        .expect_error(404, "not_found", "admin routes without an admin key");
}

// ---------------------------------------------------------------------------------------
// Exec
// ---------------------------------------------------------------------------------------

#[test]
fn exec_returns_a_typed_result() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(
        &api.create_sandbox(&json!({"env": {"FROM_SANDBOX": "s1", "OVERRIDE": "sandbox"}})),
    );

    // A failing command is a 200 with its exit code, stdout and stderr apart.
    let r = api.exec(&sb, &json!({"shell": "echo out; echo err >&2; exit 3"}));
    assert!(
        r["call_id"]
            .as_str()
            .is_some_and(|c| c.starts_with("call_")),
        "{r}"
    );
    assert_eq!(r["exit_code"], 3, "{r}");
    assert_eq!(r["signal"], Value::Null);
    assert_eq!(r["reason"], "exited");
    assert_eq!(
        (r["stdout"].as_str(), r["stderr"].as_str()),
        (Some("out\n"), Some("err\n"))
    );
    assert_eq!(
        (&r["stdout_truncated"], &r["stderr_truncated"]),
        (&json!(false), &json!(false))
    );
    assert_eq!(
        (&r["stdout_bytes"], &r["stderr_bytes"]),
        (&json!(4), &json!(4))
    );
    assert_eq!(r["output_path"], Value::Null);
    assert_eq!(r["changes"], Value::Null);
    let t = &r["timings"];
    for k in ["queue_ms", "start_ms", "run_ms", "total_ms"] {
        assert!(t[k].as_f64().is_some_and(|v| v >= 0.0), "timings.{k}: {r}");
    }
    assert!(
        t["total_ms"].as_f64() >= t["run_ms"].as_f64(),
        "total covers run: {t}"
    );
    assert!(
        r["usage"]["cpu_ms"].is_u64() && r["usage"]["peak_memory_bytes"].is_u64(),
        "{r}"
    );

    // argv without a shell, cwd, env (the call's over the sandbox's), stdin, raw stdin, user.
    let out = |body: Value| {
        api.exec(&sb, &body)["stdout"]
            .as_str()
            .expect("stdout")
            .to_owned()
    };
    assert_eq!(
        out(json!({"cmd": ["printf", "%s|", "a b", "c'd", "$HOME"]})),
        "a b|c'd|$HOME|"
    );
    assert_eq!(out(json!({"cmd": ["pwd"], "cwd": "/tmp"})), "/tmp\n");
    assert_eq!(
        out(
            json!({"shell": "echo $FROM_SANDBOX $OVERRIDE $K", "env": {"OVERRIDE": "call", "K": "v"}})
        ),
        "s1 call v\n"
    );
    assert_eq!(
        out(json!({"cmd": ["cat"], "stdin": "hello\nworld"})),
        "hello\nworld"
    );
    assert_eq!(
        out(json!({"cmd": ["od", "-An", "-tx1"], "stdin_b64": "AP8Q"})).trim(),
        "00 ff 10"
    );
    assert_eq!(out(json!({"cmd": ["id", "-u"]})), "0\n", "root by default");
    assert_eq!(
        out(json!({"cmd": ["id", "-u"], "user": "nobody"})),
        "65534\n"
    );
    let r = api.exec(&sb, &json!({"cmd": ["/no/such/program"]}));
    assert_eq!(
        (r["exit_code"].as_i64(), r["reason"].as_str()),
        (Some(127), Some("exited")),
        "a missing program is the command's failure: {r}"
    );
    assert!(
        r["stderr"]
            .as_str()
            .is_some_and(|s| s.contains("/no/such/program")),
        "{r}"
    );

    // A signal ends it: no exit code, the signal's name.
    let r = api.exec(&sb, &json!({"shell": "kill -SEGV $$"}));
    assert_eq!(
        (&r["reason"], &r["signal"], &r["exit_code"]),
        (&json!("signaled"), &json!("SIGSEGV"), &Value::Null),
        "{r}"
    );

    // A timeout keeps the output so far and kills the whole tree, setsid and double forks too.
    let started = Instant::now();
    let r = api.exec(&sb, &json!({"shell": "echo before; (setsid sleep 31 >/dev/null 2>&1 &); (sleep 32 >/dev/null 2>&1 &); sleep 33", "timeout_ms": 700}));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the timeout was enforced: {:?}",
        started.elapsed()
    );
    assert_eq!(
        (&r["reason"], &r["exit_code"]),
        (&json!("timeout"), &Value::Null),
        "{r}"
    );
    assert_eq!(
        r["stdout"], "before\n",
        "the output until the kill is kept: {r}"
    );
    assert!(
        r["timings"]["run_ms"]
            .as_f64()
            .is_some_and(|ms| (650.0..5000.0).contains(&ms)),
        "run_ms ≈ timeout_ms: {r}"
    );
    wait_for(
        Duration::from_secs(3),
        "every process of a timed-out command is gone (sleep 31/32/33)",
        || {
            let ps = api.sh(&sb, "ps -eo args");
            (!ps.contains("sleep 31") && !ps.contains("sleep 32") && !ps.contains("sleep 33"))
                .then_some(())
        },
    );

    // The output cap keeps the head and the tail, and the whole stream in output_path.
    let r = api.exec(&sb, &json!({"shell": "printf HEAD; head -c 300000 /dev/zero | tr '\\0' x; printf TAIL; echo small >&2", "max_output_bytes": 1000}));
    assert_eq!(r["exit_code"], 0, "{r}");
    let so = r["stdout"].as_str().expect("stdout");
    assert_eq!(r["stdout_truncated"], true);
    assert_eq!(r["stdout_bytes"], 300_008);
    assert!(
        so.starts_with("HEADxxx") && so.ends_with("xxxTAIL"),
        "head and tail are kept: {}…{}",
        &so[..20],
        &so[so.len() - 20..]
    );
    assert!(
        so.contains("bytes omitted]"),
        "a marker line says what was cut: {so}"
    );
    assert!(
        so.len() < 1000 + 200,
        "at most max_output_bytes plus the marker: {} bytes",
        so.len()
    );
    assert_eq!(
        (&r["stderr"], &r["stderr_truncated"]),
        (&json!("small\n"), &json!(false)),
        "the cap is per stream"
    );
    let path = r["output_path"]
        .as_str()
        .unwrap_or_else(|| panic!("a truncated result names output_path: {r}"));
    let full = api.read_file(&sb, path);
    assert_eq!(
        full.status,
        200,
        "output_path is readable through the files API: {}",
        full.text()
    );
    assert_eq!(full.body.len(), 300_008);
    assert!(full.body.starts_with(b"HEADxxx") && full.body.ends_with(b"xxxTAIL"));
    // The default cap is 64 KiB per stream.
    let r = api.exec(
        &sb,
        &json!({"shell": "head -c 100000 /dev/zero | tr '\\0' y"}),
    );
    assert_eq!(
        (&r["stdout_truncated"], &r["stdout_bytes"]),
        (&json!(true), &json!(100_000))
    );
    assert!(
        r["stdout"].as_str().expect("stdout").len() <= 65_536 + 200,
        "the default cap is 65536"
    );

    // Malformed exec bodies are 400s naming the field; oversized stdin a 413.
    let e = format!("/v1/sandboxes/{sb}/exec");
    let bad: Vec<(Value, u16, &str, &str)> = vec![
        (json!({}), 400, "bad_request", "cmd"),
        (json!({"cmd": "ls"}), 400, "bad_request", "cmd"),
        (json!({"cmd": []}), 400, "bad_request", "cmd"),
        (
            json!({"cmd": ["ls"], "shell": "ls"}),
            400,
            "bad_request",
            "shell",
        ),
        (
            json!({"shell": "true", "bogus": true}),
            400,
            "bad_request",
            "bogus",
        ),
        (
            json!({"shell": "true", "timeout_ms": -1}),
            400,
            "bad_request",
            "timeout_ms",
        ),
        (
            json!({"shell": "true", "timeout_ms": 0}),
            400,
            "bad_request",
            "timeout_ms",
        ),
        (
            json!({"shell": "true", "timeout_ms": "soon"}),
            400,
            "bad_request",
            "timeout_ms",
        ),
        (
            json!({"shell": "true", "max_output_bytes": 0}),
            400,
            "bad_request",
            "max_output_bytes",
        ),
        (
            json!({"shell": "true", "max_output_bytes": -10}),
            400,
            "bad_request",
            "max_output_bytes",
        ),
        (
            json!({"shell": "true", "max_output_bytes": 1u64 << 40}),
            400,
            "bad_request",
            "max_output_bytes",
        ),
        (
            json!({"shell": "true", "cwd": "tmp"}),
            400,
            "bad_request",
            "cwd",
        ),
        (
            json!({"shell": "true", "cwd": "/no/such/dir"}),
            400,
            "bad_request",
            "/no/such/dir",
        ),
        (
            json!({"shell": "true", "env": {"A": 1}}),
            400,
            "bad_request",
            "env",
        ),
        (
            json!({"shell": "true", "stdin": "a", "stdin_b64": "YQ=="}),
            400,
            "bad_request",
            "stdin",
        ),
        (
            json!({"shell": "true", "stdin_b64": "***"}),
            400,
            "bad_request",
            "stdin_b64",
        ),
        (
            json!({"shell": "true", "user": "no-such-user"}),
            400,
            "bad_request",
            "no-such-user",
        ),
        (
            json!({"cmd": ["cat"], "stdin": "z".repeat(900 << 10)}),
            413,
            "payload_too_large",
            "stdin",
        ),
    ];
    for (body, status, code, needle) in &bad {
        let short: String = body.to_string().chars().take(80).collect();
        refused(
            &api.post(&e, body),
            *status,
            code,
            needle,
            &format!("exec {short}"),
        );
    }
    api.post(
        "/v1/sandboxes/sb_00000000deadbeef/exec",
        &json!({"shell": "true"}),
    )
    .expect_error(404, "not_found", "exec in a missing sandbox");
}

#[test]
fn exec_streams_ndjson_as_output_arrives_and_closing_the_stream_kills_the_command() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    let path = format!("/v1/sandboxes/{sb}/exec");
    let ndjson = [
        ("Content-Type", "application/json"),
        ("Accept", "application/x-ndjson"),
    ];

    // Lines arrive as the command writes them, not at its end.
    let t0 = Instant::now();
    let body =
        serde_json::to_vec(&json!({"shell": "echo first; echo warn >&2; sleep 2; echo second"}))
            .expect("json");
    let (status, headers, reader) = api
        .open("POST", &path, &ndjson, body)
        .expect("open the stream");
    assert_eq!(status, 200);
    let ctype = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    assert!(
        ctype.starts_with("application/x-ndjson"),
        "content type: {ctype}"
    );
    let lines = read_ndjson(reader, t0);
    let (last_t, last) = lines.last().expect("at least the result line").clone();
    assert_eq!(
        last["type"], "result",
        "the last line is the result: {last}"
    );
    assert_eq!(
        lines.iter().filter(|(_, v)| v["type"] == "result").count(),
        1,
        "one result line"
    );
    for (_, v) in &lines[..lines.len() - 1] {
        assert!(
            v["type"] == "stdout" || v["type"] == "stderr",
            "output lines are stdout or stderr: {v}"
        );
        assert!(v["data"].is_string(), "{v}");
    }
    let (first_t, _) = lines
        .iter()
        .find(|(_, v)| {
            v["type"] == "stdout" && v["data"].as_str().is_some_and(|d| d.contains("first"))
        })
        .expect("a stdout line with `first`");
    // `first` must arrive while the command sleeps, not with the result two seconds later.
    assert!(
        last_t >= *first_t + Duration::from_millis(1500),
        "`first` arrived at {first_t:?}, the result at {last_t:?}: the output was not streamed as it came"
    );
    assert_eq!(stream_text(&lines, "stdout"), "first\nsecond\n");
    assert_eq!(stream_text(&lines, "stderr"), "warn\n");
    assert_eq!(
        (&last["exit_code"], &last["stdout"], &last["stderr"]),
        (&json!(0), &json!("first\nsecond\n"), &json!("warn\n")),
        "{last}"
    );
    assert!(last["call_id"]
        .as_str()
        .is_some_and(|c| c.starts_with("call_")));
    // An error before the stream starts is a plain error answer.
    let bad = serde_json::to_vec(&json!({"shell": "true", "timeout_ms": 0})).expect("json");
    api.request("POST", &path, &ndjson, bad).expect_error(
        400,
        "bad_request",
        "a bad body with Accept: application/x-ndjson",
    );

    // Closing the stream kills the command: it never reaches its `touch`.
    let t0 = Instant::now();
    let body =
        serde_json::to_vec(&json!({"shell": "echo started; sleep 3.217; touch /tmp/close-marker"}))
            .expect("json");
    // A client of its own, so dropping it closes the connection (nothing pools it).
    let one_off = Api::new(&srv.url, Some(&srv.api_key));
    let (status, _, reader) = one_off
        .open("POST", &path, &ndjson, body)
        .expect("open the stream");
    assert_eq!(status, 200);
    let mut lines = BufReader::new(reader);
    let mut first = String::new();
    lines.read_line(&mut first).expect("the first line");
    assert!(first.contains("started"), "{first}");
    assert!(
        running_in(&api, &sb, "sleep 3.217"),
        "the command runs while the stream is open"
    );
    drop(lines);
    drop(one_off);
    wait_for(
        Duration::from_secs(3),
        "the command dies when its NDJSON stream is closed",
        || (!running_in(&api, &sb, "sleep 3.217")).then_some(()),
    );
    if let Some(rest) = Duration::from_millis(3700).checked_sub(t0.elapsed()) {
        std::thread::sleep(rest);
    }
    api.read_file(&sb, "/tmp/close-marker").expect_error(
        404,
        "not_found",
        "the killed command never ran its last step",
    );
}

#[test]
fn deleting_a_sandbox_ends_its_running_calls_as_killed() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    let path = format!("/v1/sandboxes/{sb}/exec");
    let plain = {
        let (api, path) = (api.clone(), path.clone());
        std::thread::spawn(move || api.post(&path, &json!({"shell": "sleep 31.5"})))
    };
    let ndjson = [
        ("Content-Type", "application/json"),
        ("Accept", "application/x-ndjson"),
    ];
    let body = serde_json::to_vec(&json!({"shell": "echo streaming; sleep 32.5"})).expect("json");
    let (status, _, stream) = api
        .open("POST", &path, &ndjson, body)
        .expect("open a stream");
    assert_eq!(status, 200);
    let mut stream = BufReader::new(stream);
    let mut first = String::new();
    stream.read_line(&mut first).expect("the first line");
    assert!(first.contains("streaming"), "{first}");
    let p = api
        .post(
            &format!("/v1/sandboxes/{sb}/processes"),
            &json!({"shell": "echo bg; sleep 33.5"}),
        )
        .expect(200, "start")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let (status, _, follow) = api
        .open(
            "GET",
            &format!("/v1/sandboxes/{sb}/processes/{p}/output?follow=true"),
            &[],
            (),
        )
        .expect("follow");
    assert_eq!(status, 200);
    wait_for(Duration::from_secs(5), "all three commands run", || {
        let ps = api.sh(&sb, "ps -eo args");
        ["sleep 31.5", "sleep 32.5", "sleep 33.5"]
            .iter()
            .all(|c| ps.contains(c))
            .then_some(())
    });

    let t0 = Instant::now();
    assert_eq!(
        api.delete(&format!("/v1/sandboxes/{sb}")).status,
        204,
        "delete with calls in flight"
    );
    // A killed command is a 200 that says so, not a platform error.
    let r = plain.join().expect("the exec thread");
    let v = r.expect(200, "an exec whose sandbox was deleted under it");
    assert_eq!(
        (&v["reason"], &v["exit_code"]),
        (&json!("killed"), &Value::Null),
        "{v}"
    );
    let rest = read_ndjson(stream, t0);
    let last = &rest
        .last()
        .unwrap_or_else(|| panic!("the stream ends with a result line: {rest:?}"))
        .1;
    assert_eq!(
        (&last["type"], &last["reason"]),
        (&json!("result"), &json!("killed")),
        "{last}"
    );
    let _ = read_ndjson(follow, t0);
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "every call ended promptly: {:?}",
        t0.elapsed()
    );
    let traces = traces_of(&sb, &srv.machine_dir(&sb));
    assert!(traces.is_empty(), "{traces:?}");
    // The killed calls are on record.
    let calls = api
        .get(&format!("/v1/calls?sandbox_id={sb}"))
        .expect(200, "calls");
    let reasons: Vec<&Value> = calls["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .filter(|c| {
            c["command"][2]
                .as_str()
                .is_some_and(|c| c.contains("sleep 3"))
        })
        .map(|c| &c["result"]["reason"])
        .collect();
    assert_eq!(reasons, [&json!("killed"), &json!("killed")], "{calls}");
}

// ---------------------------------------------------------------------------------------
// Background processes and the terminal
// ---------------------------------------------------------------------------------------

#[test]
fn background_processes_start_list_replay_follow_stdin_and_signal() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    let base = format!("/v1/sandboxes/{sb}/processes");

    // Start returns at once with an id and a pid.
    let t0 = Instant::now();
    let p = api.post(&base, &json!({"shell": "echo start; while read l; do echo got:$l; done; echo eof >&2; exit 4"})).expect(200, "start");
    assert!(t0.elapsed() < Duration::from_secs(5));
    let p1 = p["id"].as_str().expect("id").to_owned();
    assert!(p1.starts_with("proc_"), "{p}");
    assert!(p["pid"].as_u64().is_some_and(|n| n > 0), "{p}");
    let listed = api.get(&base).expect(200, "list");
    let mine = listed["processes"]
        .as_array()
        .expect("processes")
        .iter()
        .find(|x| x["id"] == p1.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("listed: {listed}"));
    assert_eq!(mine["state"], "running", "{mine}");
    let got = api.get(&format!("{base}/{p1}")).expect(200, "get");
    assert_eq!(
        (&got["state"], &got["result"]),
        (&json!("running"), &Value::Null),
        "{got}"
    );

    // stdin: raw bodies, then end of file.
    assert_eq!(
        api.request(
            "POST",
            &format!("{base}/{p1}/stdin"),
            &[],
            b"one\n".to_vec()
        )
        .status,
        200
    );
    assert_eq!(
        api.request(
            "POST",
            &format!("{base}/{p1}/stdin?close=true"),
            &[],
            b"two\n".to_vec()
        )
        .status,
        200
    );
    let done = wait_for(
        Duration::from_secs(5),
        "the process ends after its stdin closed",
        || {
            let v = api.get(&format!("{base}/{p1}")).expect(200, "get");
            (!v["result"].is_null()).then_some(v)
        },
    );
    assert_eq!(done["state"], "exited", "{done}");
    let res = &done["result"];
    assert_eq!(
        (&res["exit_code"], &res["reason"]),
        (&json!(4), &json!("exited")),
        "{res}"
    );
    assert_eq!(
        (&res["stdout"], &res["stderr"]),
        (&json!("start\ngot:one\ngot:two\n"), &json!("eof\n"))
    );

    // Output replays from the start, with the result last.
    let (status, _, r) = api
        .open("GET", &format!("{base}/{p1}/output"), &[], ())
        .expect("output");
    assert_eq!(status, 200);
    let lines = read_ndjson(r, Instant::now());
    assert_eq!(stream_text(&lines, "stdout"), "start\ngot:one\ngot:two\n");
    assert_eq!(stream_text(&lines, "stderr"), "eof\n");
    let last = &lines.last().expect("lines").1;
    assert_eq!(
        (&last["type"], &last["exit_code"]),
        (&json!("result"), &json!(4)),
        "{last}"
    );

    // follow=true: output as it comes, until the process ends; a signal ends it.
    let p2 = api.post(&base, &json!({"shell": "trap 'echo term; exit 7' TERM; echo ready; while true; do sleep 0.05; done"})).expect(200, "start")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let (status, _, r) = api
        .open("GET", &format!("{base}/{p2}/output?follow=true"), &[], ())
        .expect("follow");
    assert_eq!(status, 200);
    let mut r = BufReader::new(r);
    let mut line = String::new();
    r.read_line(&mut line).expect("a line");
    let v: Value = serde_json::from_str(&line).expect("json");
    assert_eq!(
        (&v["type"], &v["data"]),
        (&json!("stdout"), &json!("ready\n")),
        "the first line is live output: {v}"
    );
    assert_eq!(
        api.get(&format!("{base}/{p2}")).expect(200, "get")["state"],
        "running"
    );
    api.post(
        &format!("{base}/{p2}/signal"),
        &json!({"signal": "SIGTERM"}),
    )
    .expect(200, "SIGTERM");
    let rest = read_ndjson(r, Instant::now());
    assert!(
        stream_text(&rest, "stdout").contains("term\n"),
        "the trap ran: {rest:?}"
    );
    let last = &rest.last().expect("a result").1;
    assert_eq!(
        (&last["type"], &last["exit_code"]),
        (&json!("result"), &json!(7)),
        "{last}"
    );

    // A signal that kills: no exit code, the signal named; by number works too.
    let p3 = api
        .post(&base, &json!({"cmd": ["sleep", "100"]}))
        .expect(200, "start")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    api.post(&format!("{base}/{p3}/signal"), &json!({"signal": 9}))
        .expect(200, "signal 9");
    let v = wait_for(Duration::from_secs(5), "sleep dies of SIGKILL", || {
        let v = api.get(&format!("{base}/{p3}")).expect(200, "get");
        (!v["result"].is_null()).then_some(v)
    });
    let res = &v["result"];
    assert_eq!(
        (&res["exit_code"], &res["signal"]),
        (&Value::Null, &json!("SIGKILL")),
        "{v}"
    );
    assert!(
        res["reason"] == "killed" || res["reason"] == "signaled",
        "{v}"
    );

    // stdin given in the body is written, then closed.
    let p4 = api
        .post(&base, &json!({"cmd": ["cat"], "stdin": "from the body"}))
        .expect(200, "start")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let v = wait_for(Duration::from_secs(5), "cat ends", || {
        let v = api.get(&format!("{base}/{p4}")).expect(200, "get");
        (!v["result"].is_null()).then_some(v)
    });
    assert_eq!(v["result"]["stdout"], "from the body");
    let all = ids(&api.get(&base).expect(200, "list"), "processes");
    for p in [&p1, &p2, &p3, &p4] {
        assert!(all.contains(p), "{p} is listed: {all:?}");
    }

    // Errors.
    refused(
        &api.post(
            &format!("{base}/{p3}/signal"),
            &json!({"signal": "SIGNOPE"}),
        ),
        400,
        "bad_request",
        "signal",
        "an unknown signal",
    );
    refused(
        &api.post(&format!("{base}/{p3}/signal"), &json!({"signal": 0})),
        400,
        "bad_request",
        "signal",
        "signal 0",
    );
    refused(
        &api.post(&format!("{base}/{p3}/signal"), &json!({})),
        400,
        "bad_request",
        "signal",
        "no signal",
    );
    refused(
        &api.post(&base, &json!({"cmd": "sleep"})),
        400,
        "bad_request",
        "cmd",
        "a bad process body",
    );
    for missing in ["proc_00000000deadbeef", "not-a-proc", "proc_..%2F..%2Fetc"] {
        api.get(&format!("{base}/{missing}"))
            .expect_error(404, "not_found", "an unknown process");
        api.get(&format!("{base}/{missing}/output")).expect_error(
            404,
            "not_found",
            "the output of an unknown process",
        );
        api.request(
            "POST",
            &format!("{base}/{missing}/stdin"),
            &[],
            b"x".to_vec(),
        )
        .expect_error(404, "not_found", "stdin of an unknown process");
        api.post(
            &format!("{base}/{missing}/signal"),
            &json!({"signal": "KILL"}),
        )
        .expect_error(404, "not_found", "signal to an unknown process");
    }
}

/// Opens the terminal WebSocket at `path`; on a refused handshake, its status and body.
fn ws_connect(
    base: &str,
    key: Option<&str>,
    path: &str,
) -> Result<tungstenite::WebSocket<TcpStream>, (u16, String)> {
    use tungstenite::client::IntoClientRequest;
    let addr = base.strip_prefix("http://").expect("an http:// base");
    let mut req = format!("ws://{addr}{path}")
        .into_client_request()
        .expect("a ws request");
    if let Some(k) = key {
        req.headers_mut().insert(
            "Authorization",
            format!("Bearer {k}").parse().expect("header"),
        );
    }
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    match tungstenite::client(req, stream) {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => {
            let body = resp
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            Err((resp.status().as_u16(), body))
        }
        Err(e) => panic!("WebSocket handshake on {path}: {e}"),
    }
}

/// Reads terminal frames until the accumulated output contains `needle`.
fn read_until(ws: &mut tungstenite::WebSocket<TcpStream>, needle: &str, seen: &mut String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen.contains(needle) {
        assert!(
            Instant::now() < deadline,
            "no {needle:?} from the terminal within 10 s; it showed:\n{seen}"
        );
        match ws.read() {
            Ok(tungstenite::Message::Binary(b)) => seen.push_str(&String::from_utf8_lossy(&b)),
            Ok(tungstenite::Message::Text(t)) => seen.push_str(t.as_str()),
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => {
                panic!("the terminal failed while waiting for {needle:?}: {e}; it showed:\n{seen}")
            }
        }
    }
}

#[test]
fn pty_over_websocket_runs_a_shell_and_resizes() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    let path = format!("/v1/sandboxes/{sb}/pty?cols=120&rows=30");
    let mut ws = ws_connect(&srv.url, Some(&srv.api_key), &path)
        .unwrap_or_else(|(s, b)| panic!("open the terminal: {s} {b}"));
    let mut seen = String::new();

    // Typed input runs: `$((40+2))` shows 42 only if the shell evaluated it.
    ws.send(tungstenite::Message::binary(
        b"echo hi-$((40+2))\n".to_vec(),
    ))
    .expect("send");
    read_until(&mut ws, "hi-42", &mut seen);
    // The size from the query, then a resize control frame.
    ws.send(tungstenite::Message::binary(b"stty size\n".to_vec()))
        .expect("send");
    read_until(&mut ws, "30 120", &mut seen);
    ws.send(tungstenite::Message::text(r#"{"resize":[100,40]}"#))
        .expect("resize");
    ws.send(tungstenite::Message::binary(b"stty size\n".to_vec()))
        .expect("send");
    read_until(&mut ws, "40 100", &mut seen);
    // exit ends the shell: an exit frame with its code, then the close.
    ws.send(tungstenite::Message::binary(b"exit 5\n".to_vec()))
        .expect("send");
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        assert!(
            Instant::now() < deadline,
            "no exit frame; the terminal showed:\n{seen}"
        );
        match ws.read() {
            Ok(tungstenite::Message::Text(t)) => {
                let v: Value = serde_json::from_str(t.as_str())
                    .unwrap_or_else(|e| panic!("a control frame is JSON ({e}): {t}"));
                if v["type"] == "exit" {
                    break v;
                }
            }
            Ok(tungstenite::Message::Close(_)) => {
                panic!("closed without an exit frame; it showed:\n{seen}")
            }
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("the terminal failed before its exit frame: {e}"),
        }
    };
    assert_eq!(exit["exit_code"], 5, "{exit}");

    // A client that goes away ends its shell and whatever runs in it.
    let mut ws = ws_connect(
        &srv.url,
        Some(&srv.api_key),
        &format!("/v1/sandboxes/{sb}/pty"),
    )
    .unwrap_or_else(|(s, b)| panic!("open the terminal: {s} {b}"));
    let mut seen = String::new();
    ws.send(tungstenite::Message::binary(
        b"echo go; sleep 4.321\n".to_vec(),
    ))
    .expect("send");
    read_until(&mut ws, "go\r\n", &mut seen);
    wait_for(
        Duration::from_secs(3),
        "the terminal's command runs",
        || running_in(&api, &sb, "sleep 4.321").then_some(()),
    );
    drop(ws);
    wait_for(
        Duration::from_secs(3),
        "closing the WebSocket ends the terminal's processes",
        || (!running_in(&api, &sb, "sleep 4.321")).then_some(()),
    );
    // A missing sandbox is refused at the handshake, with the error shape.
    let Err((status, body)) = ws_connect(
        &srv.url,
        Some(&srv.api_key),
        "/v1/sandboxes/sb_00000000deadbeef/pty",
    ) else {
        panic!("refused")
    };
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("not_found"), "{body}");
}

// ---------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------

fn entry_names(v: &Value) -> Vec<String> {
    let mut n: Vec<String> = v["entries"]
        .as_array()
        .unwrap_or_else(|| panic!("entries: {v}"))
        .iter()
        .map(|e| e["path"].as_str().expect("path").to_owned())
        .collect();
    n.sort();
    n
}

#[test]
fn files_round_trip_list_stat_mkdir_move_delete() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    let f = |route: &str, path: &str| format!("/v1/sandboxes/{sb}/files{route}?path={}", enc(path));

    // Binary content under an odd name, with a mode.
    let odd = "/tmp/odd dir/ünï cödé ☃ #1 ?&=+%.bin";
    let data: Vec<u8> = (0..4096u32)
        .map(|i| (i % 256) as u8)
        .chain(b"\r\n\0end".iter().copied())
        .collect();
    let e = api
        .put(&format!("{}&mode=0640", f("", odd)), data.clone())
        .expect(200, "PUT an odd name");
    assert_eq!(e["path"], odd, "{e}");
    assert_eq!(e["name"], "ünï cödé ☃ #1 ?&=+%.bin");
    assert_eq!(
        (&e["type"], &e["size"], &e["mode"]),
        (&json!("file"), &json!(data.len()), &json!(0o640)),
        "{e}"
    );
    parse_time(e["mtime"].as_str().expect("mtime"));
    let got = api.get(&f("", odd));
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(
        got.headers
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/octet-stream")
    );
    assert!(
        got.body == data,
        "the bytes come back unchanged ({} vs {} bytes)",
        got.body.len(),
        data.len()
    );
    assert_eq!(
        api.get(&f("/stat", odd)).expect(200, "stat"),
        e,
        "stat shows the PUT's entry"
    );
    assert_eq!(
        api.get(&f("/stat", "/tmp/odd dir"))
            .expect(200, "stat a dir")["type"],
        "dir"
    );
    // Overwriting truncates; empty files are files.
    api.put(&f("", odd), b"short".to_vec())
        .expect(200, "overwrite");
    assert_eq!(api.get(&f("", odd)).body, b"short");
    assert_eq!(
        api.put(&f("", "/tmp/empty"), Vec::new())
            .expect(200, "empty")["size"],
        0
    );
    assert_eq!(api.get(&f("", "/tmp/empty")).body, b"");
    // The command line sees what the API wrote, and the other way round.
    assert_eq!(
        api.sh(&sb, "cat '/tmp/odd dir/ünï cödé ☃ #1 ?&=+%.bin'"),
        "short"
    );
    api.sh(&sb, "printf 'from exec' > /root/made-by-exec");
    assert_eq!(api.get(&f("", "/root/made-by-exec")).body, b"from exec");

    // mkdir (with parents), list at depths.
    let d = api
        .post(
            &format!("/v1/sandboxes/{sb}/files/mkdir"),
            &json!({"path": "/tmp/tree/a/b/c"}),
        )
        .expect(200, "mkdir");
    assert_eq!(
        (&d["path"], &d["type"]),
        (&json!("/tmp/tree/a/b/c"), &json!("dir")),
        "{d}"
    );
    for p in [
        "/tmp/tree/top.txt",
        "/tmp/tree/a/one.txt",
        "/tmp/tree/a/b/two.txt",
        "/tmp/tree/a/b/c/three.txt",
    ] {
        api.put(&f("", p), p.as_bytes().to_vec()).expect(200, p);
    }
    api.sh(&sb, "ln -s top.txt /tmp/tree/link");
    let l1 = api.get(&f("/list", "/tmp/tree")).expect(200, "list");
    assert_eq!(
        entry_names(&l1),
        ["/tmp/tree/a", "/tmp/tree/link", "/tmp/tree/top.txt"],
        "depth 1 is the default"
    );
    let kinds: Vec<(String, String)> = l1["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().expect("name").into(),
                e["type"].as_str().expect("type").into(),
            )
        })
        .collect();
    assert!(
        kinds.contains(&("a".into(), "dir".into()))
            && kinds.contains(&("link".into(), "symlink".into()))
            && kinds.contains(&("top.txt".into(), "file".into())),
        "{kinds:?}"
    );
    let l2 = api
        .get(&format!("{}&depth=2", f("/list", "/tmp/tree")))
        .expect(200, "list depth 2");
    assert_eq!(
        entry_names(&l2),
        [
            "/tmp/tree/a",
            "/tmp/tree/a/b",
            "/tmp/tree/a/one.txt",
            "/tmp/tree/link",
            "/tmp/tree/top.txt"
        ]
    );
    let l3 = api
        .get(&format!("{}&depth=3", f("/list", "/tmp/tree")))
        .expect(200, "list depth 3");
    assert_eq!(
        entry_names(&l3),
        [
            "/tmp/tree/a",
            "/tmp/tree/a/b",
            "/tmp/tree/a/b/c",
            "/tmp/tree/a/b/two.txt",
            "/tmp/tree/a/one.txt",
            "/tmp/tree/link",
            "/tmp/tree/top.txt"
        ]
    );
    for depth in ["0", "17", "-1", "deep"] {
        refused(
            &api.get(&format!("{}&depth={depth}", f("/list", "/tmp/tree"))),
            400,
            "bad_request",
            "depth",
            &format!("depth={depth}"),
        );
    }

    // Move.
    let m = api
        .post(
            &format!("/v1/sandboxes/{sb}/files/move"),
            &json!({"from": "/tmp/tree/top.txt", "to": "/tmp/tree/a/moved.txt"}),
        )
        .expect(200, "move");
    assert_eq!(
        (&m["path"], &m["type"]),
        (&json!("/tmp/tree/a/moved.txt"), &json!("file")),
        "{m}"
    );
    api.get(&f("", "/tmp/tree/top.txt")).expect_error(
        404,
        "not_found",
        "the old name after a move",
    );
    assert_eq!(
        api.get(&f("", "/tmp/tree/a/moved.txt")).body,
        b"/tmp/tree/top.txt"
    );
    api.post(
        &format!("/v1/sandboxes/{sb}/files/move"),
        &json!({"from": "/tmp/nothing", "to": "/tmp/x"}),
    )
    .expect_error(404, "not_found", "moving a missing file");

    // Delete: files, directories only with recursive=true.
    assert_eq!(api.delete(&f("", "/tmp/tree/a/moved.txt")).status, 204);
    api.get(&f("/stat", "/tmp/tree/a/moved.txt"))
        .expect_error(404, "not_found", "a deleted file");
    let r = api.delete(&f("", "/tmp/tree"));
    assert!(
        (400..500).contains(&r.status),
        "a non-empty directory without recursive=true is refused: {} {}",
        r.status,
        r.text()
    );
    r.expect_error(
        r.status,
        if r.status == 409 {
            "conflict"
        } else {
            "bad_request"
        },
        "delete a non-empty dir",
    );
    assert_eq!(
        api.get(&f("/stat", "/tmp/tree/a/b/c/three.txt")).status,
        200,
        "a refused delete removes nothing"
    );
    assert_eq!(
        api.delete(&format!("{}&recursive=true", f("", "/tmp/tree")))
            .status,
        204,
        "recursive delete"
    );
    api.get(&f("/stat", "/tmp/tree"))
        .expect_error(404, "not_found", "a recursively deleted dir");
    api.delete(&f("", "/tmp/tree"))
        .expect_error(404, "not_found", "deleting a missing path");
    refused(
        &api.delete(&f("", "/")),
        400,
        "bad_request",
        "/",
        "deleting /",
    );
    assert_eq!(
        api.sh(&sb, "ls / | wc -l")
            .trim()
            .parse::<u32>()
            .map(|n| n > 5),
        Ok(true),
        "/ is intact"
    );

    // Errors: missing, directory, relative, NUL, no path, unknown parameters, bad mode.
    api.get(&f("", "/tmp/missing"))
        .expect_error(404, "not_found", "GET a missing file");
    api.get(&f("/stat", "/tmp/missing"))
        .expect_error(404, "not_found", "stat a missing file");
    api.get(&f("/list", "/tmp/missing"))
        .expect_error(404, "not_found", "list a missing dir");
    api.get(&f("", "/tmp"))
        .expect_error(400, "bad_request", "GET a directory");
    for (what, q) in [
        ("relative", "tmp/x"),
        ("relative dots", "../etc/passwd"),
        ("empty", ""),
    ] {
        refused(
            &api.get(&format!("/v1/sandboxes/{sb}/files?path={}", enc(q))),
            400,
            "bad_request",
            "path",
            &format!("GET a {what} path"),
        );
        refused(
            &api.put(
                &format!("/v1/sandboxes/{sb}/files?path={}", enc(q)),
                b"x".to_vec(),
            ),
            400,
            "bad_request",
            "path",
            &format!("PUT a {what} path"),
        );
        refused(
            &api.get(&format!("/v1/sandboxes/{sb}/files/stat?path={}", enc(q))),
            400,
            "bad_request",
            "path",
            &format!("stat a {what} path"),
        );
        refused(
            &api.delete(&format!("/v1/sandboxes/{sb}/files?path={}", enc(q))),
            400,
            "bad_request",
            "path",
            &format!("delete a {what} path"),
        );
    }
    refused(
        &api.get(&format!("/v1/sandboxes/{sb}/files?path=/tmp/a%00b")),
        400,
        "bad_request",
        "NUL",
        "a NUL in a path",
    );
    refused(
        &api.put(
            &format!("/v1/sandboxes/{sb}/files?path=/tmp/a%00b"),
            b"x".to_vec(),
        ),
        400,
        "bad_request",
        "NUL",
        "a NUL in a PUT path",
    );
    refused(
        &api.get(&format!("/v1/sandboxes/{sb}/files")),
        400,
        "bad_request",
        "path",
        "no path",
    );
    refused(
        &api.get(&format!("{}&colour=red", f("", "/tmp/empty"))),
        400,
        "bad_request",
        "colour",
        "an unknown parameter",
    );
    refused(
        &api.put(&format!("{}&mode=rwx", f("", "/tmp/m")), b"x".to_vec()),
        400,
        "bad_request",
        "mode",
        "a non-octal mode",
    );
    refused(
        &api.post(
            &format!("/v1/sandboxes/{sb}/files/mkdir"),
            &json!({"path": "rel"}),
        ),
        400,
        "bad_request",
        "path",
        "mkdir a relative path",
    );
    refused(
        &api.post(
            &format!("/v1/sandboxes/{sb}/files/mkdir"),
            &json!({"path": "/tmp/x", "parents": true}),
        ),
        400,
        "bad_request",
        "parents",
        "mkdir: an unknown field",
    );
    refused(
        &api.post(
            &format!("/v1/sandboxes/{sb}/files/move"),
            &json!({"from": "/tmp/empty", "to": "rel"}),
        ),
        400,
        "bad_request",
        "to",
        "move to a relative path",
    );
    refused(
        &api.post(
            &format!("/v1/sandboxes/{sb}/files/move"),
            &json!({"from": "rel", "to": "/tmp/x"}),
        ),
        400,
        "bad_request",
        "from",
        "move from a relative path",
    );
    refused(
        &api.post(
            &format!("/v1/sandboxes/{sb}/files/move"),
            &json!({"from": "/tmp/empty"}),
        ),
        400,
        "bad_request",
        "to",
        "move without `to`",
    );
    let r = api.put(&f("", "/tmp/empty/child"), b"x".to_vec());
    assert!(
        (400..500).contains(&r.status),
        "a file as a parent directory is refused: {} {}",
        r.status,
        r.text()
    );
}

#[test]
fn file_paths_never_reach_the_hosts_files() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    // A secret on the host, at a path that does not exist inside the sandbox.
    let host = TempDir::new("locker-host-secret");
    let hdir = host.path().display().to_string();
    let secret_path = format!("{hdir}/secret.txt");
    let token = format!("host-secret-{}", now_s());
    std::fs::write(&secret_path, &token).expect("write the host secret");
    let hostile = |p: &str| format!("/v1/sandboxes/{sb}/files?path={}", enc(p));

    api.sh(
        &sb,
        &format!(
            "cd /root && ln -s {secret_path} abs && ln -s ../../../../../../../..{secret_path} rel && ln -s /root/abs chain && \
             ln -s / rootlink && ln -s {hdir} dirlink && ln -s /proc/1/root procroot && ln -s {hdir}/written.txt wlink && \
             ln -s ../../../../../../../..{hdir} reldir"
        ),
    );
    let reads = [
        secret_path.clone(),
        format!("/../../../../../..{secret_path}"),
        format!("/tmp/../../..{secret_path}"),
        "/root/abs".into(),
        "/root/rel".into(),
        "/root/chain".into(),
        format!("/root/rootlink{secret_path}"),
        "/root/dirlink/secret.txt".into(),
        "/root/reldir/secret.txt".into(),
        format!("/root/procroot{secret_path}"),
        format!("/proc/self/root{secret_path}"),
        format!("/proc/1/root{secret_path}"),
        format!("/proc/1/cwd/../../../..{secret_path}"),
    ];
    for p in &reads {
        for route in ["", "/stat", "/list"] {
            let r = api.get(&format!("/v1/sandboxes/{sb}/files{route}?path={}", enc(p)));
            assert!(
                !r.text().contains(&token) && !r.text().contains("secret.txt\""),
                "GET files{route} {p} showed the host's file: {}",
                r.text()
            );
            if route.is_empty() {
                assert!(
                    matches!(r.status, 400 | 404),
                    "GET {p}: 400 or 404, never the host's file: {} {}",
                    r.status,
                    r.text()
                );
            }
        }
    }
    // Writes, mkdir, move and delete through the same tricks stay inside the sandbox.
    let writes = [
        format!("{hdir}/written.txt"),
        format!("/../../../../..{hdir}/written.txt"),
        "/root/wlink".into(),
        format!("/root/rootlink{hdir}/written.txt"),
        "/root/dirlink/written.txt".into(),
        "/root/reldir/written.txt".into(),
    ];
    for p in &writes {
        let _ = api.put(&hostile(p), b"pwned".to_vec());
    }
    let _ = api.post(
        &format!("/v1/sandboxes/{sb}/files/mkdir"),
        &json!({"path": "/root/dirlink/made"}),
    );
    let _ = api.post(
        &format!("/v1/sandboxes/{sb}/files/mkdir"),
        &json!({"path": format!("/root/rootlink{hdir}/made2")}),
    );
    api.put(&hostile("/tmp/mover"), b"pwned".to_vec())
        .expect(200, "a file to move");
    let _ = api.post(
        &format!("/v1/sandboxes/{sb}/files/move"),
        &json!({"from": "/tmp/mover", "to": "/root/dirlink/moved"}),
    );
    let _ = api.post(
        &format!("/v1/sandboxes/{sb}/files/move"),
        &json!({"from": "/root/dirlink/secret.txt", "to": "/tmp/stolen"}),
    );
    let _ = api.delete(&hostile("/root/dirlink/secret.txt"));
    let _ = api.delete(&format!(
        "{}&recursive=true",
        hostile(&format!("/root/rootlink{hdir}"))
    ));
    let _ = api.delete(&format!("{}&recursive=true", hostile("/root/reldir")));

    let mut on_host: Vec<String> = std::fs::read_dir(host.path())
        .expect("the host dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    on_host.sort();
    assert_eq!(
        on_host,
        ["secret.txt"],
        "the sandbox's file API wrote into the host's directory"
    );
    assert_eq!(
        std::fs::read_to_string(&secret_path).expect("the host secret"),
        token,
        "the host secret is unchanged"
    );
    let stolen = api.get(&hostile("/tmp/stolen"));
    assert!(
        !stolen.text().contains(&token),
        "the host secret was moved into the sandbox"
    );
}

// ---------------------------------------------------------------------------------------
// Calls and usage
// ---------------------------------------------------------------------------------------

#[test]
fn calls_record_every_exec_without_env_values_and_usage_counts_them() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sbv = api.create_sandbox(&json!({}));
    let sb = sandbox_id(&sbv);
    let other = sandbox_id(&api.create_sandbox(&json!({})));

    let r1 = api.exec(
        &sb,
        &json!({"shell": "echo hi", "cwd": "/tmp", "env": {"SECRET_NAME": "s3cr3t-value-42"}}),
    );
    let r2 = api.exec(&sb, &json!({"cmd": ["false"]}));
    let (status, _, r) = api
        .open(
            "POST",
            &format!("/v1/sandboxes/{sb}/exec"),
            &[
                ("Content-Type", "application/json"),
                ("Accept", "application/x-ndjson"),
            ],
            serde_json::to_vec(&json!({"cmd": ["echo", "streamed"]})).expect("json"),
        )
        .expect("stream");
    assert_eq!(status, 200);
    let streamed = read_ndjson(r, Instant::now())
        .last()
        .expect("result")
        .1
        .clone();
    let r_other = api.exec(&other, &json!({"cmd": ["true"]}));
    let id = |v: &Value| v["call_id"].as_str().expect("call_id").to_owned();

    let resp = api.get(&format!("/v1/calls?sandbox_id={sb}"));
    let calls = resp.expect(200, "calls of a sandbox");
    assert!(
        !resp.text().contains("s3cr3t-value-42"),
        "env values never appear in call records"
    );
    let got: Vec<String> = calls["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .map(|c| c["id"].as_str().expect("id").to_owned())
        .collect();
    assert_eq!(
        got,
        [id(&streamed), id(&r2), id(&r1)],
        "this sandbox's calls, newest first"
    );
    let rec = calls["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .find(|c| c["id"] == id(&r1).as_str())
        .expect("r1")
        .clone();
    assert_eq!(rec["command"], json!(["/bin/sh", "-c", "echo hi"]), "{rec}");
    assert_eq!(rec["cwd"], "/tmp");
    assert_eq!(rec["env_keys"], json!(["SECRET_NAME"]));
    assert_eq!(rec["sandbox_id"], sb.as_str());
    assert_eq!(rec["template_digest"], sbv["template_digest"]);
    assert!(
        rec["template_digest"]
            .as_str()
            .is_some_and(|d| !d.is_empty()),
        "{rec}"
    );
    assert_eq!(rec["runtime"], "jail");
    assert!(
        rec["key_id"]
            .as_str()
            .is_some_and(|k| k.starts_with("key_")),
        "the caller's key id: {rec}"
    );
    assert_eq!(rec["egress_denied"], json!([]));
    assert_eq!(rec["result"]["call_id"], id(&r1).as_str());
    assert_eq!(
        (&rec["result"]["exit_code"], &rec["result"]["stdout_bytes"]),
        (&json!(0), &json!(3))
    );
    assert_eq!(
        (&rec["result"]["stdout"], &rec["result"]["stderr"]),
        (&json!(""), &json!("")),
        "records keep no output bodies"
    );
    parse_time(rec["created_at"].as_str().expect("created_at"));
    let rec2 = calls["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .find(|c| c["id"] == id(&r2).as_str())
        .expect("r2")
        .clone();
    assert_eq!(
        (&rec2["command"], &rec2["result"]["exit_code"]),
        (&json!(["false"]), &json!(1)),
        "{rec2}"
    );

    let all = api.get("/v1/calls").expect(200, "all calls");
    assert_eq!(
        all["calls"].as_array().map(Vec::len),
        Some(4),
        "every call of the tenant: {all}"
    );
    assert_eq!(all["calls"][0]["id"], id(&r_other).as_str(), "newest first");
    let one = api.get("/v1/calls?limit=1").expect(200, "limit=1");
    assert_eq!(one["calls"].as_array().map(Vec::len), Some(1));
    refused(
        &api.get("/v1/calls?limit=0"),
        400,
        "bad_request",
        "limit",
        "limit=0",
    );
    refused(
        &api.get("/v1/calls?limit=many"),
        400,
        "bad_request",
        "limit",
        "limit=many",
    );
    refused(
        &api.get("/v1/calls?sandbox=x"),
        400,
        "bad_request",
        "sandbox",
        "an unknown parameter",
    );
    assert_eq!(
        api.get("/v1/calls?sandbox_id=sb_00000000deadbeef")
            .expect(200, "calls of nothing")["calls"],
        json!([])
    );

    // A background process is recorded once it ends.
    let p = api
        .post(
            &format!("/v1/sandboxes/{sb}/processes"),
            &json!({"cmd": ["echo", "bg"]}),
        )
        .expect(200, "start");
    assert!(p["id"].as_str().is_some());
    wait_for(
        Duration::from_secs(5),
        "the background process's record",
        || {
            let c = api
                .get(&format!("/v1/calls?sandbox_id={sb}"))
                .expect(200, "calls");
            c["calls"]
                .as_array()
                .expect("calls")
                .iter()
                .any(|c| c["command"] == json!(["echo", "bg"]))
                .then_some(())
        },
    );

    // Usage.
    let u = api.get("/v1/usage").expect(200, "usage");
    assert_eq!(u["tenant"], "default");
    assert!(
        u["execs"].as_u64().is_some_and(|n| n >= 4),
        "execs counts every exec: {u}"
    );
    assert_eq!(u["runs"], 0, "{u}");
    assert!(u["cpu_ms"].is_u64() && u["sandbox_seconds"].is_u64(), "{u}");
    let later = api
        .get(&format!("/v1/usage?since={}", enc("2100-01-01T00:00:00Z")))
        .expect(200, "usage since the future");
    assert_eq!(later["execs"], 0, "{later}");
    let unix = api
        .get(&format!("/v1/usage?since={}", now_s() + 3600))
        .expect(200, "usage since unix seconds");
    assert_eq!(unix["execs"], 0, "{unix}");
    refused(
        &api.get("/v1/usage?since=yesterday"),
        400,
        "bad_request",
        "since",
        "a bad since",
    );

    // Metrics count the execs.
    let m = srv.anon().get("/metrics").text();
    let count = m
        .lines()
        .find_map(|l| l.strip_prefix("locker_exec_duration_seconds_count "))
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(
        count.is_some_and(|n| n >= 4),
        "locker_exec_duration_seconds_count counts the execs:\n{m}"
    );
    assert!(m.contains("locker_sandboxes{state=\"running\"} 2"), "{m}");
}

// ---------------------------------------------------------------------------------------
// Restart safety and streaming big files
// ---------------------------------------------------------------------------------------

#[test]
fn a_killed_server_adopts_its_sandboxes_on_restart() {
    become_subreaper();
    let mut srv = Server::start();
    let api = srv.api();
    let keep = sandbox_id(
        &api.create_sandbox(&json!({"metadata": {"role": "keep"}, "env": {"KEPT_ENV": "yes"}})),
    );
    let lost = sandbox_id(&api.create_sandbox(&json!({"metadata": {"role": "lost"}})));
    api.write_file(&keep, "/root/notes.txt", b"written before the crash")
        .expect(200, "write");
    let p = api
        .post(
            &format!("/v1/sandboxes/{keep}/processes"),
            &json!({"cmd": ["sleep", "987"]}),
        )
        .expect(200, "a process");
    assert!(p["id"].as_str().is_some());

    srv.kill9();
    // While the server is down the machines keep running; one of them dies meanwhile (its
    // PID 1, the agent, is killed, which takes every process of its PID namespace along).
    assert!(
        !traces_of(&keep, &srv.machine_dir(&keep)).is_empty(),
        "the machine outlives the server"
    );
    let state = locker_runtime::jail::JailState::load(&srv.machine_dir(&lost))
        .expect("the lost machine's state");
    assert!(
        locker_runtime::jail::is_alive(&state),
        "the lost machine runs before it is killed"
    );
    // SAFETY: kill with a pid read from the machine's own state file.
    unsafe { libc::kill(state.agent_pid, libc::SIGKILL) };
    wait_for(Duration::from_secs(5), "the killed machine is dead", || {
        (!locker_runtime::jail::is_alive(&state)).then_some(())
    });

    srv.restart();
    let api = srv.api();
    let v = api
        .get(&format!("/v1/sandboxes/{keep}"))
        .expect(200, "the sandbox after a restart");
    assert_eq!(
        (&v["state"], &v["metadata"]),
        (&json!("running"), &json!({"role": "keep"})),
        "{v}"
    );
    assert_eq!(
        api.read_file(&keep, "/root/notes.txt").body,
        b"written before the crash",
        "the file survived"
    );
    assert_eq!(
        api.sh(&keep, "echo $KEPT_ENV"),
        "yes\n",
        "the sandbox's env survived"
    );
    assert!(
        running_in(&api, &keep, "sleep 987"),
        "its processes kept running"
    );
    let procs = api
        .get(&format!("/v1/sandboxes/{keep}/processes"))
        .expect(200, "processes after the restart");
    assert!(
        ids(&procs, "processes").contains(&p["id"].as_str().expect("id").to_owned()),
        "the background process is still listed: {procs}"
    );
    api.write_file(&keep, "/root/after.txt", b"after")
        .expect(200, "write after the restart");
    api.get(&format!("/v1/sandboxes/{lost}")).expect_error(
        404,
        "not_found",
        "a sandbox whose machine died while the server was down",
    );
    assert_eq!(
        ids(&api.get("/v1/sandboxes").expect(200, "list"), "sandboxes"),
        vec![keep.clone()]
    );
    assert!(
        traces_of(&lost, &srv.machine_dir(&lost)).is_empty(),
        "nothing is left of the dead machine"
    );

    assert_eq!(
        api.delete(&format!("/v1/sandboxes/{keep}")).status,
        204,
        "delete the adopted sandbox"
    );
    let traces = traces_of(&keep, &srv.machine_dir(&keep));
    assert!(
        traces.is_empty(),
        "an adopted sandbox leaves nothing behind when deleted: {traces:?}"
    );
}

/// Deterministic pseudo-random bytes: byte `i` of the stream is a function of `i` alone.
struct Pattern {
    pos: u64,
    len: u64,
}

fn pattern_word(i: u64) -> u64 {
    // splitmix64
    let mut z = i
        .wrapping_add(0x9E37_79B9_7F4A_7C15)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 30)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn pattern_fill(offset: u64, buf: &mut [u8]) {
    let mut i = 0;
    while i < buf.len() {
        let p = offset + i as u64;
        let (w, k) = (pattern_word(p / 8).to_le_bytes(), (p % 8) as usize);
        let n = (8 - k).min(buf.len() - i);
        buf[i..i + n].copy_from_slice(&w[k..k + n]);
        i += n;
    }
}

impl Read for Pattern {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (self.len - self.pos).min(buf.len() as u64) as usize;
        pattern_fill(self.pos, &mut buf[..n]);
        self.pos += n as u64;
        Ok(n)
    }
}

#[test]
fn a_one_gib_file_streams_through_the_server_in_constant_memory() {
    become_subreaper();
    const SIZE: u64 = 1 << 30;
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({"disk_mb": 3000})));
    // Warm the server's paths up with a small round trip, then measure.
    api.write_file(&sb, "/root/small", &[7u8; 1 << 20])
        .expect(200, "a small file");
    assert_eq!(api.read_file(&sb, "/root/small").body.len(), 1 << 20);
    let pid = srv.pid();
    let base = rss_kib(pid);
    assert!(base > 0, "the server's VmRSS is readable");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_kib(pid));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        })
    };

    let t0 = Instant::now();
    let body = ureq::SendBody::from_owned_reader(Pattern { pos: 0, len: SIZE });
    let e = api
        .put(
            &format!("/v1/sandboxes/{sb}/files?path=/root/big.bin"),
            body,
        )
        .expect(200, "PUT 1 GiB");
    assert_eq!(e["size"], SIZE, "{e}");
    let put_s = t0.elapsed();

    let t1 = Instant::now();
    let (status, headers, mut r) = api
        .open(
            "GET",
            &format!("/v1/sandboxes/{sb}/files?path=/root/big.bin"),
            &[],
            (),
        )
        .expect("GET 1 GiB");
    assert_eq!(status, 200);
    assert_eq!(
        headers.get("x-locker-size").and_then(|v| v.to_str().ok()),
        Some(SIZE.to_string().as_str())
    );
    let (mut got, mut buf, mut want) = (0u64, vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = r.read(&mut buf).expect("read the body");
        if n == 0 {
            break;
        }
        pattern_fill(got, &mut want[..n]);
        assert!(
            buf[..n] == want[..n],
            "the bytes at offset {got}..{} differ from what was written",
            got + n as u64
        );
        got += n as u64;
    }
    assert_eq!(got, SIZE, "the whole file came back");
    let get_s = t1.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.join().expect("sampler").max(rss_kib(pid));
    let growth_mib = peak.saturating_sub(base) / 1024;
    eprintln!(
        "1 GiB: PUT {put_s:?}, GET {get_s:?}; server VmRSS {} MiB -> peak {} MiB",
        base / 1024,
        peak / 1024
    );
    assert!(
        growth_mib < 100,
        "the server's memory grew by {growth_mib} MiB while streaming 1 GiB (limit 100 MiB)"
    );
    assert_eq!(
        api.delete(&format!("/v1/sandboxes/{sb}/files?path=/root/big.bin"))
            .status,
        204
    );
}
