//! E2B's control plane on Locker (issue 19): the unmodified SDKs from the registries drive a
//! real `locker serve` with `E2B_API_URL` and `E2B_SANDBOX_URL` set to its URL and
//! `E2B_API_KEY` to a key from `locker key create --e2b`. The newest Python `e2b` creates,
//! lists (metadata and state filters, pages of one through `X-Next-Token`), reads info and
//! metrics, sets timeouts, pauses (twice: the second is `False`), connects (resumes), kills
//! (twice: the second is `False`), snapshots, starts a sandbox from a snapshot, forks, and
//! changes the network policy; another tenant's key sees nothing; `get_host(port)` names a
//! preview host that reaches a server in the sandbox with its `trafficAccessToken` (and not
//! without); the 2.50 SDK creates with `POST /sandboxes`; the npm `e2b` package creates,
//! lists and kills. Raw requests check
//! every bad input the SDKs would not send (no key, a wrong key, malformed bodies, unknown
//! routes and methods, bad list parameters) is answered in E2B's error shape
//! `{"code", "message"}`, and that a sandbox's preview host for port 49983 reaches envd
//! (E2B's `{port}-{id}.{domain}` routing, with `domain` from create), as does a `/files`
//! request that carries only the sandbox's access token (older JavaScript SDKs).
//!
//! The SDKs install into the target dir on first use; when a registry is unreachable the
//! test that needs it is skipped with a message.

use std::path::{Path, PathBuf};
use std::process::Command;

use locker_tests::server::{Api, Server};
use locker_tests::tools::{npm_package, python_e2b, python_e2b_old, run_logged};
use serde_json::{json, Value};

/// The directory of the driver scripts.
fn scripts() -> PathBuf {
    locker_tests::root().join("tests/e2b")
}

/// A server with a preview domain (so create's `domain` is one this server serves).
fn server() -> Server {
    Server::start_with(&["--preview-domain", "localhost"])
}

/// A key in E2B's shape for tenant `default`, through `locker key create --e2b` (the CLI
/// against the admin route), remembered for the cleanup.
fn e2b_key(srv: &Server) -> String {
    let out = Command::new(locker_tests::locker_bin())
        .args(["key", "create", "--tenant", "default", "--e2b", "--json"])
        .env("LOCKER_URL", &srv.url)
        .env(
            "LOCKER_ADMIN_KEY",
            srv.admin_key.as_deref().expect("admin key"),
        )
        .output()
        .expect("run locker key create");
    assert!(
        out.status.success(),
        "locker key create --e2b: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON from --json");
    let key = v["api_key"].as_str().expect("api_key").to_owned();
    assert!(
        key.len() == 44
            && key.starts_with("e2b_")
            && key[4..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "not e2b_<40 hex>: {key}"
    );
    srv.remember_key(&key);
    key
}

/// The SDK's environment: everything through this server, no proxy.
fn e2b_env<'a>(cmd: &'a mut Command, srv: &Server, key: &str) -> &'a mut Command {
    for p in [
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ] {
        cmd.env_remove(p);
    }
    cmd.env("E2B_API_URL", &srv.url)
        .env("E2B_SANDBOX_URL", &srv.url)
        .env("E2B_API_KEY", key)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
}

/// Runs `python control.py SCENARIO` and checks it passed.
fn scenario(py: &Path, srv: &Server, key: &str, name: &str, extra: &[(&str, &str)]) {
    let mut cmd = Command::new(py);
    cmd.arg(scripts().join("control.py")).arg(name);
    e2b_env(&mut cmd, srv, key);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let (ok, log) = run_logged(&mut cmd);
    if !ok || !log.contains(&format!("ok {name}")) {
        srv.print_log_tail();
        panic!("scenario {name} failed:\n{log}");
    }
}

#[test]
fn python_sdk_drives_the_control_plane() {
    let Some(py) = python_e2b() else { return };
    let srv = server();
    let key = e2b_key(&srv);
    let (other, _) = srv.create_tenant("e2b-other");
    let other_key = other.key().expect("key").to_owned();
    std::thread::scope(|s| {
        for name in ["lifecycle", "snapshots", "network", "tenants"] {
            let (py, srv, key, other_key) = (&py, &srv, &key, &other_key);
            s.spawn(move || scenario(py, srv, key, name, &[("OTHER_KEY", other_key)]));
        }
    });
}

#[test]
fn get_host_reaches_a_server_in_the_sandbox() {
    let Some(py) = python_e2b() else { return };
    let srv = server();
    let key = e2b_key(&srv);
    let id = locker_tests::serving_http(&srv.api(), &json!({}), 8000);
    scenario(
        &py,
        &srv,
        &key,
        "get_host",
        &[("SANDBOX_ID", id.as_str()), ("PORT", "8000")],
    );
}

#[test]
fn older_python_sdk_and_npm_create_and_kill() {
    let srv = server();
    let key = e2b_key(&srv);
    if let Some(py) = python_e2b_old() {
        scenario(&py, &srv, &key, "old_create", &[]);
    }
    if let Some(dir) = npm_package("e2b-npm", "e2b", "node_modules/e2b/package.json") {
        let script = dir.join("control.mjs");
        std::fs::copy(scripts().join("control.mjs"), &script).expect("copy control.mjs");
        let mut cmd = Command::new("node");
        cmd.arg(&script).current_dir(&dir);
        e2b_env(&mut cmd, &srv, &key);
        let (ok, log) = run_logged(&mut cmd);
        if !ok || !log.contains("ok npm") {
            srv.print_log_tail();
            panic!("npm e2b failed:\n{log}");
        }
    }
}

/// `examples/e2b/agent_tools.py`, unchanged, against this server: a session's sandbox, a
/// program written and run, paused between turns and found again by its metadata, a
/// snapshot, two forks running variants, and the cleanup. Its output is checked against
/// what the program computes.
#[test]
fn the_agent_tools_example_runs() {
    let Some(py) = python_e2b() else { return };
    let srv = server();
    let key = e2b_key(&srv);
    let mut cmd = Command::new(&py);
    cmd.arg(locker_tests::root().join("examples/e2b/agent_tools.py"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    e2b_env(&mut cmd, &srv, &key);
    let (ok, log) = run_logged(&mut cmd);
    if !ok {
        srv.print_log_tail();
    }
    assert!(ok, "agent_tools.py failed:\n{log}");
    for want in [
        "fib(30) = 832040",
        "resumed: ['demo', 'user']",
        ": fib(10) = 55",
        ": fib(20) = 6765",
    ] {
        assert!(log.contains(want), "{want:?} not in the output:\n{log}");
    }
    // The cleanup left nothing running.
    let (status, v) = e2b(&srv, Some(&key), "GET", "/v2/sandboxes", "");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v, json!([]), "agent_tools.py left sandboxes behind");
}

/// An E2B request with `X-API-KEY` (or none).
fn e2b(srv: &Server, key: Option<&str>, method: &str, path: &str, body: &str) -> (u16, Value) {
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(k) = key {
        headers.push(("X-API-KEY", k));
    }
    let r = Api::new(&srv.url, None).request(method, path, &headers, body.as_bytes().to_vec());
    let v: Value = if r.body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {}", r.text()))
    };
    (r.status, v)
}

/// An error in E2B's shape: `code` is the status, `message` says something.
#[track_caller]
fn e2b_error(got: (u16, Value), status: u16, needle: &str) {
    let (s, v) = got;
    assert_eq!(s, status, "{v}");
    assert_eq!(v["code"], json!(status), "{v}");
    let msg = v["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no message: {v}"));
    assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
}

#[test]
fn bad_input_answers_in_e2b_shape_and_hosts_route_to_envd() {
    let srv = server();
    let key = srv.api_key.clone();
    let k = Some(key.as_str());
    // Keys.
    e2b_error(
        e2b(&srv, None, "POST", "/v2/sandboxes", "{}"),
        401,
        "X-API-KEY",
    );
    e2b_error(
        e2b(
            &srv,
            Some("e2b_0000000000000000000000000000000000000000"),
            "GET",
            "/v2/sandboxes",
            "",
        ),
        401,
        "unknown",
    );
    // Bodies.
    e2b_error(
        e2b(&srv, k, "POST", "/v2/sandboxes", "{not json"),
        400,
        "request body",
    );
    e2b_error(
        e2b(&srv, k, "POST", "/v2/sandboxes", "{}"),
        400,
        "templateID",
    );
    e2b_error(
        e2b(&srv, k, "POST", "/sandboxes", r#"{"templateID": 7}"#),
        400,
        "expected a string",
    );
    e2b_error(
        e2b(
            &srv,
            k,
            "POST",
            "/v2/sandboxes",
            r#"{"templateID": "base", "timeout": 0}"#,
        ),
        400,
        "timeout",
    );
    e2b_error(
        e2b(
            &srv,
            k,
            "POST",
            "/v2/sandboxes",
            r#"{"templateID": "base", "network": {"denyOut": ["8.8.8.8"]}}"#,
        ),
        400,
        "allowlists",
    );
    e2b_error(
        e2b(
            &srv,
            k,
            "POST",
            "/v2/sandboxes",
            r#"{"templateID": "base", "envVars": {"A=B": "x"}}"#,
        ),
        400,
        "env",
    );
    e2b_error(
        e2b(
            &srv,
            k,
            "POST",
            "/v2/sandboxes",
            r#"{"templateID": "nope"}"#,
        ),
        400,
        "nope",
    );
    // Unknown sandboxes, routes, methods, list parameters.
    e2b_error(
        e2b(&srv, k, "GET", "/sandboxes/sb_000000000000000000000000", ""),
        404,
        "sb_0",
    );
    e2b_error(
        e2b(
            &srv,
            k,
            "DELETE",
            "/sandboxes/sb_000000000000000000000000",
            "",
        ),
        404,
        "sb_0",
    );
    e2b_error(
        e2b(&srv, k, "GET", "/sandboxes/x/nothing-here", ""),
        404,
        "no such E2B route",
    );
    e2b_error(e2b(&srv, k, "PATCH", "/v2/sandboxes", "{}"), 405, "method");
    e2b_error(
        e2b(&srv, k, "GET", "/v2/sandboxes?limit=0", ""),
        400,
        "limit",
    );
    e2b_error(
        e2b(&srv, k, "GET", "/v2/sandboxes?state=gone", ""),
        400,
        "state",
    );
    e2b_error(
        e2b(&srv, k, "GET", "/v2/sandboxes?nextToken=zzz", ""),
        400,
        "nextToken",
    );
    e2b_error(
        e2b(&srv, k, "DELETE", "/templates/default", ""),
        404,
        "locker template",
    );

    // A sandbox: its domain is this server's preview domain, its host for 49983 is envd.
    let (s, sb) = e2b(
        &srv,
        k,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID": "base", "timeout": 60}"#,
    );
    assert_eq!(s, 201, "{sb}");
    let id = sb["sandboxID"].as_str().expect("sandboxID").to_owned();
    let port = srv.url.rsplit_once(':').unwrap().1;
    assert_eq!(sb["domain"], json!(format!("localhost:{port}")), "{sb}");
    assert!(
        sb["envdAccessToken"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{sb}"
    );
    let envd_host = |path: &str, extra: &[&str]| -> (u16, String) {
        let addr = srv.url.strip_prefix("http://").unwrap();
        let out = Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "30",
                "-w",
                "\n%{http_code}",
                "--noproxy",
                "*",
            ])
            .args(["--connect-to", &format!("::{addr}")])
            .args(extra)
            .arg(format!("http://49983-{id}.localhost:{port}{path}"))
            .output()
            .expect("curl runs");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    };
    assert_eq!(envd_host("/health", &[]).0, 204, "envd's /health by host");
    let (code, body) = envd_host("/process.Process/List", &["-X", "POST", "-d", "{}"]);
    assert_eq!(code, 401, "no access token: {body}");
    assert!(body.contains("X-Access-Token"), "{body}");
    // `/files` without routing headers (older JavaScript SDKs) is the sandbox's whose access
    // token it carries; with another token it is no E2B request at all (the API's 404).
    let token = sb["envdAccessToken"].as_str().unwrap();
    let files = |t: &str| {
        Api::new(&srv.url, None).request(
            "GET",
            "/files?path=%2Fetc%2Fhostname",
            &[("X-Access-Token", t)],
            (),
        )
    };
    let r = files(token);
    assert_ne!(r.status, 404, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    assert!(
        v.get("error").is_none(),
        "not the API's answer: {}",
        r.text()
    );
    let r = files("lpt_not_this_sandboxes_token");
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no such route")),
        "{}",
        r.text()
    );
    // Another tenant: its key finds nothing, kills nothing.
    let (other, _) = srv.create_tenant("e2b-bad-other");
    let ok = other.key().map(str::to_owned);
    e2b_error(
        e2b(&srv, ok.as_deref(), "GET", &format!("/sandboxes/{id}"), ""),
        404,
        &id,
    );
    e2b_error(
        e2b(
            &srv,
            ok.as_deref(),
            "POST",
            &format!("/sandboxes/{id}/pause"),
            "",
        ),
        404,
        &id,
    );
    e2b_error(
        e2b(
            &srv,
            ok.as_deref(),
            "POST",
            &format!("/sandboxes/{id}/timeout"),
            r#"{"timeout": 5}"#,
        ),
        404,
        &id,
    );
    // Timeout bodies, a second pause, a resume of a running one.
    e2b_error(
        e2b(&srv, k, "POST", &format!("/sandboxes/{id}/timeout"), "{}"),
        400,
        "timeout",
    );
    e2b_error(
        e2b(&srv, k, "POST", &format!("/sandboxes/{id}/resume"), "{}"),
        409,
        "not paused",
    );
    assert_eq!(
        e2b(&srv, k, "POST", &format!("/sandboxes/{id}/pause"), "").0,
        204
    );
    e2b_error(
        e2b(&srv, k, "POST", &format!("/sandboxes/{id}/pause"), "{}"),
        409,
        "already paused",
    );
    let (s, v) = e2b(
        &srv,
        k,
        "POST",
        &format!("/sandboxes/{id}/resume"),
        r#"{"timeout": 60}"#,
    );
    assert_eq!(s, 201, "{v}");
    let (s, v) = e2b(
        &srv,
        k,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        "{}",
    );
    assert_eq!(s, 200, "a running sandbox connects with 200: {v}");
    assert_eq!(
        e2b(&srv, k, "DELETE", &format!("/sandboxes/{id}"), "").0,
        204
    );
    e2b_error(
        e2b(
            &srv,
            k,
            "POST",
            &format!("/v2/sandboxes/{id}/connect"),
            "{}",
        ),
        404,
        &id,
    );
}

/// `set_timeout(0)` is the timeout now, as on E2B: an auto-pause sandbox is paused (and
/// stays so when asked again), any other is killed. Lists order by the start to the
/// millisecond: two sandboxes made one after the other list newest first, in pages of one,
/// also when they started within the same second.
#[test]
fn zero_timeout_pauses_or_kills_and_lists_order_by_start() {
    let srv = server();
    let k = Some(srv.api_key.as_str());
    let create = |body: &str| {
        let (s, v) = e2b(&srv, k, "POST", "/v2/sandboxes", body);
        assert_eq!(s, 201, "{v}");
        v["sandboxID"].as_str().expect("sandboxID").to_owned()
    };
    let older = create(r#"{"templateID":"base","timeout":120,"metadata":{"t":"zero"}}"#);
    let newer =
        create(r#"{"templateID":"base","timeout":120,"autoPause":true,"metadata":{"t":"zero"}}"#);
    let page = |token: Option<&str>| {
        let mut path = "/v2/sandboxes?metadata=t%3Dzero&limit=1".to_owned();
        if let Some(t) = token {
            path += &format!("&nextToken={t}");
        }
        let r = Api::new(&srv.url, None).request("GET", &path, &[("X-API-KEY", srv.api_key.as_str())], "");
        let next = r
            .headers
            .get("x-next-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        (r.expect(200, "list"), next)
    };
    let (first, next) = page(None);
    assert_eq!(first[0]["sandboxID"], json!(newer), "newest first: {first}");
    let (second, last) = page(Some(&next.expect("a next page")));
    assert_eq!(second[0]["sandboxID"], json!(older), "{second}");
    assert_eq!(last, None);

    let zero = r#"{"timeout":0}"#;
    for id in [&newer, &newer] {
        let (s, v) = e2b(&srv, k, "POST", &format!("/sandboxes/{id}/timeout"), zero);
        assert_eq!(s, 204, "{v}");
        let (s, v) = e2b(&srv, k, "GET", &format!("/sandboxes/{id}"), "");
        assert_eq!((s, &v["state"]), (200, &json!("paused")), "{v}");
    }
    let (s, v) = e2b(&srv, k, "POST", &format!("/sandboxes/{older}/timeout"), zero);
    assert_eq!(s, 204, "{v}");
    e2b_error(
        e2b(&srv, k, "GET", &format!("/sandboxes/{older}"), ""),
        404,
        &older,
    );
    // The paused one connects again, running.
    let (s, v) = e2b(&srv, k, "POST", &format!("/v2/sandboxes/{newer}/connect"), "{}");
    assert_eq!(s, 201, "a paused sandbox resumes with 201: {v}");
    assert_eq!(e2b(&srv, k, "DELETE", &format!("/sandboxes/{newer}"), "").0, 204);
}

/// The bench rows of issue 19 (`bench/e2b_layer.py`), printed, not asserted: run with
/// `--ignored e2b_figures --nocapture`.
#[test]
#[ignore = "a measurement: run it by name"]
fn e2b_figures() {
    let Some(py) = python_e2b() else { return };
    let srv = server();
    let key = e2b_key(&srv);
    let mut cmd = Command::new(&py);
    cmd.arg(locker_tests::root().join("bench/e2b_layer.py"))
        .env("LOCKER_URL", &srv.url)
        .env("LOCKER_API_KEY", &key)
        .env("PYTHONDONTWRITEBYTECODE", "1");
    e2b_env(&mut cmd, &srv, &key);
    let status = cmd.status().expect("run bench/e2b_layer.py");
    assert!(status.success());
}
