//! The MCP server end to end, driven by real MCP clients against a real `locker serve`:
//! - the official Python client (PyPI `mcp`, installed into `target/mcp-py/venv` on first
//!   use) over Streamable HTTP at `/mcp`, once in the session-based revision (2025-11-25,
//!   `Mcp-Session-Id`) and once in the current stateless one (2026-07-28), and over stdio
//!   through `locker mcp`; `tests/mcp/check_client.py` holds the scenario (tool list,
//!   schemas and annotations; sandbox_create, exec, file_write, file_edit, file_read,
//!   background processes, truncation and output_path, run on a volume, sandbox_delete);
//!   `tests/mcp/check_agents.py` an agent's session management (sandbox_list after a
//!   context reset, process_list, sandbox_set_ttl, snapshot_list and snapshot_delete,
//!   repeatable deletes) and the `network` argument, which the server enforces;
//! - plain HTTP for the auth rules of `/mcp`.
//!
//! - the MCP Inspector CLI (npm `@modelcontextprotocol/inspector-cli`, the standalone CLI
//!   package, 1.0.3: it runs on Node 20 and sends `--header "Authorization: Bearer …"`),
//!   installed into `target/mcp-inspector` on first use.
//!
//! - `@modelcontextprotocol/conformance` 0.1.5 (the newest that runs on Node 20), the server
//!   scenarios that need no fixture tools (`server-initialize`, `tools-list`), through
//!   `tests/mcp/bearer_proxy.py`, which adds the Bearer header the suite cannot send.
//!
//! A client that cannot be installed because its registry is unreachable is skipped with a
//! message saying so; any other failure fails the test.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use locker_tests::become_subreaper;
use locker_tests::server::Server;
use locker_tests::tools::{npm_package, python_mcp, run_logged};
use serde_json::{json, Value};

fn check_client(py: &Path, args: &[&str]) -> Value {
    let script = locker_tests::root().join("tests/mcp/check_client.py");
    let started = Instant::now();
    let (ok, log) = run_logged(Command::new(py).arg(&script).args(args));
    assert!(ok, "check_client.py {args:?} failed:\n{log}");
    assert!(
        !log.contains("Session termination failed"),
        "the session ended uncleanly:\n{log}"
    );
    let last = log.lines().rev().find(|l| l.starts_with('{')).unwrap_or("");
    let v: Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("no JSON summary from check_client.py ({e}):\n{log}"));
    eprintln!("{args:?} -> {v} in {:?}", started.elapsed());
    v
}

#[test]
fn python_client_over_streamable_http_both_revisions_and_stdio() {
    become_subreaper();
    let Some(py) = python_mcp() else { return };
    let srv = Server::start();
    let url = srv.url.clone();
    let key = srv.api_key.clone();

    // The session-based revision: initialize, then Mcp-Session-Id on every request.
    let v = check_client(&py, &["http", &url, &key, "legacy"]);
    assert_eq!(v["protocol_version"], "2025-11-25", "{v}");
    assert_eq!(v["tools"], 25);
    assert_eq!(v["run"], "ok", "the run tool works: {v}");

    // The current revision: server/discover, stateless requests.
    let v = check_client(&py, &["http", &url, &key, "auto"]);
    assert_eq!(v["protocol_version"], "2026-07-28", "{v}");

    // stdio: `locker mcp` as a subprocess, talking to the server at LOCKER_URL.
    let bin = locker_tests::locker_bin();
    let v = check_client(
        &py,
        &["stdio", bin.to_str().expect("utf-8 path"), &url, &key],
    );
    assert_eq!(v["tools"], 25);

    // Every tool call was an ordinary API call of the key's tenant, on the record.
    let calls = srv
        .api()
        .get("/v1/calls?limit=200")
        .expect(200, "GET /v1/calls");
    assert!(
        calls["calls"].as_array().is_some_and(|c| c.len() >= 10),
        "the tools' execs are recorded: {calls}"
    );
}

/// Runs `tests/mcp/check_agents.py URL KEY WHAT` and returns its JSON summary.
fn check_agents(py: &Path, srv: &Server, what: &str) -> Value {
    let script = locker_tests::root().join("tests/mcp/check_agents.py");
    let started = Instant::now();
    let (ok, log) = run_logged(
        Command::new(py)
            .arg(&script)
            .args([&srv.url, &srv.api_key, what]),
    );
    assert!(ok, "check_agents.py {what} failed:\n{log}");
    let last = log.lines().rev().find(|l| l.starts_with('{')).unwrap_or("");
    let v: Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("no JSON summary from check_agents.py ({e}):\n{log}"));
    eprintln!("{what} -> {v} in {:?}", started.elapsed());
    v
}

#[test]
fn an_agent_finds_its_sandboxes_processes_and_snapshots_again_after_a_context_reset() {
    become_subreaper();
    let Some(py) = python_mcp() else { return };
    let srv = Server::start();
    let v = check_agents(&py, &srv, "session");
    assert_eq!(v["tools"], 25, "{v}");
    let left = srv
        .api()
        .get("/v1/snapshots")
        .expect(200, "GET /v1/snapshots");
    assert_eq!(
        left["snapshots"],
        json!([]),
        "the agent cleaned up its snapshots"
    );
}

#[test]
fn an_agent_asks_for_a_network_and_the_server_enforces_it() {
    become_subreaper();
    let Some(py) = python_mcp() else { return };
    let srv = Server::start();
    locker_tests::egress::wait_egress_ok(&srv);
    let v = check_agents(&py, &srv, "network");
    assert_eq!(v["run"], "ok", "{v}");
}

#[test]
fn an_agent_starts_a_service_and_reaches_it_by_the_url_it_got() {
    become_subreaper();
    let Some(py) = python_mcp() else { return };
    let srv = Server::start();
    let v = check_agents(&py, &srv, "services");
    let text = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
    assert!(text("again").contains("already listens"), "{v}");
    assert!(text("exits").contains("exit_code 5"), "{v}");
    assert!(
        text("silent").contains("nothing listens on port 9001 after 2 s"),
        "{v}"
    );
}

fn post_mcp(url: &str, key: Option<&str>, body: &Value) -> (u16, String) {
    let (status, text, _) = post_mcp_full(url, key, body);
    (status, text)
}

/// Status, body and the `WWW-Authenticate` header of one POST to `/mcp`.
fn post_mcp_full(url: &str, key: Option<&str>, body: &Value) -> (u16, String, Option<String>) {
    let agent = locker_tests::server::agent(std::time::Duration::from_secs(30));
    let mut req = agent
        .post(format!("{url}/mcp"))
        .header("Accept", "application/json, text/event-stream")
        .header("Content-Type", "application/json")
        .header("MCP-Protocol-Version", "2026-07-28")
        .header("Mcp-Method", body["method"].as_str().unwrap_or(""));
    if let Some(name) = body["params"]["name"].as_str() {
        req = req.header("Mcp-Name", name);
    }
    if let Some(k) = key {
        req = req.header("Authorization", format!("Bearer {k}"));
    }
    let mut resp = req.send(body.to_string()).expect("POST /mcp");
    let status = resp.status().as_u16();
    let www = resp
        .headers()
        .get("www-authenticate")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (status, text, www)
}

#[test]
fn mcp_needs_a_valid_key_and_forwards_it() {
    become_subreaper();
    let srv = Server::start();
    let list = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {}}}});
    let (s, body, www) = post_mcp_full(&srv.url, None, &list);
    assert_eq!(s, 401, "{body}");
    assert!(body.contains("unauthorized"), "{body}");
    // A client learns from the 401 which credentials to send (RFC 6750, MCP authorization).
    assert_eq!(www.as_deref(), Some("Bearer realm=\"locker\""), "{body}");
    let (s, body, www) = post_mcp_full(&srv.url, Some("lk_wrong"), &list);
    assert_eq!(s, 401, "{body}");
    assert!(www.is_some_and(|w| w.starts_with("Bearer")), "{body}");
    let (s, body) = post_mcp(&srv.url, Some(&srv.api_key), &list);
    assert_eq!(s, 200, "{body}");
    assert!(body.contains("sandbox_create"), "{body}");

    // Another tenant's key sees only its own sandboxes through the tools.
    let t = srv
        .admin()
        .post("/v1/tenants", &json!({"name": "mcp-other"}))
        .expect(201, "create a tenant");
    let other_key = t["api_key"].as_str().expect("api_key").to_owned();
    srv.remember_key(&other_key);
    let sb = srv.api().create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_owned();
    let call = |key: &str| {
        let req = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "exec", "arguments": {"sandbox_id": id, "shell": "echo hi"},
            "_meta": list["params"]["_meta"]}});
        post_mcp(&srv.url, Some(key), &req)
    };
    let (s, body) = call(&srv.api_key);
    assert_eq!(s, 200, "{body}");
    assert!(
        body.contains(r#"\"stdout\":\"hi\\n\""#) || body.contains("hi\\n"),
        "{body}"
    );
    let (s, body) = call(&other_key);
    assert_eq!(s, 200, "{body}");
    assert!(
        body.contains("\"isError\":true") && body.contains("not_found"),
        "another tenant's sandbox is not found: {body}"
    );
}

/// The Inspector CLI's entry point, or None (with a message) when npm is unreachable.
fn inspector_cli() -> Option<PathBuf> {
    let probe = "node_modules/@modelcontextprotocol/inspector-cli/build/index.js";
    npm_package(
        "mcp-inspector",
        "@modelcontextprotocol/inspector-cli@1.0.3",
        probe,
    )
    .map(|d| d.join(probe))
}

/// Runs the Inspector CLI against `/mcp` and returns its JSON answer.
fn inspector(entry: &Path, srv: &Server, args: &[&str]) -> Value {
    // It reads its own package.json relative to the working directory: run it from there.
    let build = entry.parent().expect("build dir");
    let url = format!("{}/mcp", srv.url);
    let auth = format!("Authorization: Bearer {}", srv.api_key);
    let (ok, log) = run_logged(
        Command::new("node")
            .current_dir(build)
            .arg(entry)
            .arg(&url)
            .args(["--transport", "http", "--header", &auth])
            .args(args),
    );
    assert!(ok, "inspector {args:?} failed:\n{log}");
    serde_json::from_str(&log[log.find('{').unwrap_or(0)..])
        .unwrap_or_else(|e| panic!("inspector {args:?}: not JSON ({e}):\n{log}"))
}

#[test]
fn the_mcp_inspector_cli_lists_and_calls_tools() {
    become_subreaper();
    let Some(entry) = inspector_cli() else { return };
    let srv = Server::start();
    let tools = inspector(&entry, &srv, &["--method", "tools/list"]);
    let names: Vec<&str> = tools["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    for want in [
        "run",
        "sandbox_create",
        "exec",
        "file_edit",
        "sandbox_delete",
        "volume_list",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    for t in tools["tools"].as_array().unwrap() {
        assert_eq!(
            t["inputSchema"]["additionalProperties"], false,
            "{}",
            t["name"]
        );
        assert!(
            t["annotations"]["readOnlyHint"].is_boolean(),
            "{}",
            t["name"]
        );
    }
    let created = inspector(
        &entry,
        &srv,
        &["--method", "tools/call", "--tool-name", "sandbox_create"],
    );
    let sb = created["structuredContent"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no sandbox id in {created}"))
        .to_owned();
    let ran = inspector(
        &entry,
        &srv,
        &[
            "--method",
            "tools/call",
            "--tool-name",
            "exec",
            "--tool-arg",
            &format!("sandbox_id={sb}"),
            "--tool-arg",
            "shell=echo from-inspector; exit 3",
        ],
    );
    assert_eq!(
        ran["isError"], false,
        "a non-zero exit is a result, not an error: {ran}"
    );
    assert_eq!(ran["structuredContent"]["exit_code"], 3, "{ran}");
    assert!(
        ran["structuredContent"]["stdout"]
            .as_str()
            .unwrap_or("")
            .contains("from-inspector"),
        "{ran}"
    );
    let gone = inspector(
        &entry,
        &srv,
        &[
            "--method",
            "tools/call",
            "--tool-name",
            "sandbox_delete",
            "--tool-arg",
            &format!("sandbox_id={sb}"),
        ],
    );
    assert_eq!(gone["isError"], false, "{gone}");
}

#[test]
fn the_conformance_suite_passes_its_server_scenarios_without_fixtures() {
    become_subreaper();
    let Some(dir) = npm_package(
        "mcp-conformance",
        "@modelcontextprotocol/conformance@0.1.5",
        "node_modules/.bin/conformance",
    ) else {
        return;
    };
    let srv = Server::start();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut proxy = Command::new("python3")
        .arg(locker_tests::root().join("tests/mcp/bearer_proxy.py"))
        .arg(format!("{}/mcp", srv.url))
        .arg(&srv.api_key)
        .arg(port.to_string())
        .spawn()
        .expect("start the header proxy");
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _proxy = Kill(&mut proxy);
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the header proxy did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    for scenario in ["server-initialize", "tools-list"] {
        let (ok, log) = run_logged(Command::new("node").current_dir(&dir).args([
            "node_modules/.bin/conformance",
            "server",
            "--url",
            &format!("http://127.0.0.1:{port}/mcp"),
            "--scenario",
            scenario,
        ]));
        assert!(
            ok && log.contains("Passed: 1/1, 0 failed"),
            "conformance {scenario}:\n{log}"
        );
    }
}
