//! The MCP server end to end, driven by real MCP clients against a real `locker serve`:
//! - the official Python client (PyPI `mcp`, installed into `target/mcp-py/venv` on first
//!   use) over Streamable HTTP at `/mcp`, once in the session-based revision (2025-11-25,
//!   `Mcp-Session-Id`) and once in the current stateless one (2026-07-28), and over stdio
//!   through `locker mcp`; `tests/mcp/check_client.py` holds the scenario (tool list,
//!   schemas and annotations; sandbox_create, exec, file_write, file_edit, file_read,
//!   background processes, truncation and output_path, run on a volume, sandbox_delete);
//! - plain HTTP for the auth rules of `/mcp`.
//!
//! The Python client that cannot be installed because PyPI is unreachable is skipped with a
//! message saying so; any other failure fails the test. (The MCP Inspector CLI is not here:
//! the versions that can send a Bearer header, 0.16 and later, need Node 22; hosts have 20.)

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use locker_tests::become_subreaper;
use locker_tests::server::Server;
use serde_json::{json, Value};

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| locker_tests::root().join("target"))
}

/// Whether a failed install's log says the registry could not be reached.
fn unreachable(log: &str) -> bool {
    [
        "Network is unreachable",
        "Temporary failure in name resolution",
        "Failed to establish a new connection",
        "Max retries exceeded",
        "Could not find a version that satisfies",
    ]
    .iter()
    .any(|m| log.contains(m))
}

fn run_logged(cmd: &mut Command) -> (bool, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), log)
}

/// The venv's python with `mcp` importable, or None (with a message) when PyPI is
/// unreachable.
fn python_mcp() -> Option<PathBuf> {
    let venv = target_dir().join("mcp-py/venv");
    let py = venv.join("bin/python");
    let ok = |py: &Path| {
        Command::new(py)
            .args([
                "-c",
                "import mcp, mcp.client.streamable_http; from mcp import Client",
            ])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ok(&py) {
        return Some(py);
    }
    let (made, log) = run_logged(Command::new("python3").args(["-m", "venv"]).arg(&venv));
    assert!(made, "python3 -m venv {}: {log}", venv.display());
    let started = Instant::now();
    let (installed, log) = run_logged(Command::new(venv.join("bin/pip")).args([
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "mcp>=2.3,<3",
    ]));
    if !installed {
        if unreachable(&log) {
            eprintln!(
                "SKIP: the Python `mcp` client cannot be installed, PyPI is unreachable:\n{log}"
            );
            return None;
        }
        panic!("pip install mcp failed:\n{log}");
    }
    eprintln!("installed the Python mcp client in {:?}", started.elapsed());
    assert!(ok(&py), "mcp is not importable after pip install");
    Some(py)
}

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
    assert_eq!(v["tools"], 15);
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
    assert_eq!(v["tools"], 15);

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

fn post_mcp(url: &str, key: Option<&str>, body: &Value) -> (u16, String) {
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
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (status, text)
}

#[test]
fn mcp_needs_a_valid_key_and_forwards_it() {
    become_subreaper();
    let srv = Server::start();
    let list = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {}}}});
    let (s, body) = post_mcp(&srv.url, None, &list);
    assert_eq!(s, 401, "{body}");
    assert!(body.contains("unauthorized"), "{body}");
    let (s, body) = post_mcp(&srv.url, Some("lk_wrong"), &list);
    assert_eq!(s, 401, "{body}");
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
