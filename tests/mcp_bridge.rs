//! MCP servers inside a sandbox (`/v1/sandboxes/{id}/mcp`), end to end against a real
//! `locker serve` and real jails, driven by the official Python MCP client (PyPI `mcp`, the
//! venv of tests/mcp.rs) through `tests/mcp/check_bridge.py`:
//! - real registry servers: `@modelcontextprotocol/server-filesystem` (npm) and
//!   `mcp-server-time` (PyPI), installed on the host (cached under the target dir) and
//!   handed to the sandbox through a volume, since machines reach no registry here; run with
//!   the template's `node` and `python3`, in both protocol revisions;
//! - a hostile stdio server (`tests/mcp/hostile_server.py`): garbage lines, a 100 MB line, a
//!   request never answered, stdout closed, an exit, sessions sharing one process;
//!   and one that stops reading its stdin;
//! - bad input: names, cmd, duplicates, another tenant, a paused sandbox, stop vs end session;
//! - the same bridge to a server in a microVM (raw Streamable HTTP).
//!
//! A registry that cannot be reached skips its test with a message saying so.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use locker_tests::become_subreaper;
use locker_tests::server::{rss_kib, Api, Server};
use locker_tests::tools::{npm_package, pypi_unreachable, python_mcp, run_logged, target_dir};
use serde_json::{json, Value};

const FS_ENTRY: &str = "node_modules/@modelcontextprotocol/server-filesystem/dist/index.js";

/// `mcp-server-time` and its dependencies in a `pip install --target` tree (the host's
/// python3 is the template's 3.11), or None when PyPI is unreachable.
fn time_server_tree() -> Option<PathBuf> {
    let dir = target_dir().join("mcp-bridge/pypi");
    if dir.join("mcp_server_time").is_dir() {
        return Some(dir);
    }
    let (ok, log) = run_logged(Command::new("python3").args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--target",
        dir.to_str().expect("utf-8 path"),
        "mcp-server-time",
    ]));
    if !ok {
        if pypi_unreachable(&log) {
            eprintln!("SKIP: mcp-server-time cannot be installed, PyPI is unreachable:\n{log}");
            return None;
        }
        panic!("pip install mcp-server-time failed:\n{log}");
    }
    Some(dir)
}

/// Uploads the host directory `src` into `path` of volume `vol` as one tar archive.
fn upload_tree(api: &Api, vol: &str, src: &Path, path: &str) {
    let tar = Command::new("tar")
        .arg("-C")
        .arg(src)
        .args(["-cf", "-", "."])
        .output()
        .expect("run tar");
    assert!(tar.status.success(), "tar {}", src.display());
    api.put(
        &format!("/v1/volumes/{vol}/files?path={path}&format=tar"),
        tar.stdout,
    )
    .expect(200, "upload a tree into the volume");
}

/// Runs `check_bridge.py ARGS` and returns its JSON summary.
fn check_bridge(py: &Path, args: &[&str]) -> Value {
    check_bridge_or(py, args, String::new)
}

/// [`check_bridge`], adding `more()` (the server's side of the story) to a failure.
fn check_bridge_or(py: &Path, args: &[&str], more: impl FnOnce() -> String) -> Value {
    let script = locker_tests::root().join("tests/mcp/check_bridge.py");
    let started = Instant::now();
    let (ok, log) = run_logged(Command::new(py).arg(&script).args(args));
    assert!(
        ok,
        "check_bridge.py {:?} failed:\n{log}\n{}",
        &args[..1],
        more()
    );
    let last = log.lines().rev().find(|l| l.starts_with('{')).unwrap_or("");
    let v: Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("no JSON summary from check_bridge.py ({e}):\n{log}"));
    eprintln!("{:?} -> {v} in {:?}", &args[..1], started.elapsed());
    v
}

fn start_server(api: &Api, sb: &str, body: &Value) -> Value {
    api.post(&format!("/v1/sandboxes/{sb}/mcp"), body)
        .expect(201, "start an MCP server")
}

#[test]
fn registry_servers_from_npm_and_pypi_serve_the_python_client_from_inside_a_sandbox() {
    become_subreaper();
    let Some(py) = python_mcp() else { return };
    let Some(npm) = npm_package(
        "mcp-bridge/npm",
        "@modelcontextprotocol/server-filesystem",
        FS_ENTRY,
    ) else {
        return;
    };
    let Some(pypi) = time_server_tree() else {
        return;
    };
    let srv = Server::start();
    let api = srv.api();
    let vol = api
        .post("/v1/volumes", &json!({"name": "mcp-pkgs", "size_mb": 1024}))
        .expect(201, "create a volume")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    upload_tree(&api, &vol, &npm, "/npm");
    upload_tree(&api, &vol, &pypi, "/pypi");
    let sb = api.create_sandbox(&json!({
        "ttl_s": 900,
        "volumes": [{"volume": vol, "path": "/opt/mcp", "read_only": true}],
    }))["id"]
        .as_str()
        .expect("id")
        .to_owned();
    api.sh(
        &sb,
        "mkdir -p /root/data && echo 'hello from exec' > /root/data/hello.txt",
    );

    let fs = start_server(
        &api,
        &sb,
        &json!({"name": "fs", "cmd": ["node", format!("/opt/mcp/npm/{FS_ENTRY}"), "/root/data"]}),
    );
    assert_eq!(fs["state"], "running", "{fs}");
    let fs_url = fs["url"].as_str().expect("url").to_owned();
    assert_eq!(fs_url, format!("{}/v1/sandboxes/{sb}/mcp/fs", srv.url));
    let time = start_server(
        &api,
        &sb,
        &json!({"name": "time", "cmd": ["python3", "-m", "mcp_server_time", "--local-timezone", "UTC"],
                "env": {"PYTHONPATH": "/opt/mcp/pypi"}, "cwd": "/tmp"}),
    );
    let time_url = time["url"].as_str().expect("url").to_owned();

    for mode in ["legacy", "auto"] {
        let v = check_bridge(&py, &["fs", &fs_url, &srv.api_key, mode]);
        assert!(
            v["read"]
                .as_str()
                .is_some_and(|t| t.contains("hello from exec")),
            "the filesystem server read the file exec wrote: {v}"
        );
        let written = api.sh(&sb, "cat /root/data/from-mcp.txt");
        assert_eq!(written, format!("written over MCP ({mode})"));
        let v = check_bridge(&py, &["time", &time_url, &srv.api_key, mode]);
        assert_eq!(v["timezone"], "UTC", "{v}");
        assert!(v["datetime"].as_str().is_some_and(|d| d.len() > 18), "{v}");
    }
    // Both revisions were negotiated with the servers' clients.
    let v = check_bridge(&py, &["time", &time_url, &srv.api_key, "auto"]);
    assert_eq!(v["protocol_version"], "2026-07-28", "{v}");

    // Listed, and each is an ordinary background process of the sandbox.
    let list = api
        .get(&format!("/v1/sandboxes/{sb}/mcp"))
        .expect(200, "list");
    let names: Vec<&str> = list["servers"]
        .as_array()
        .expect("servers")
        .iter()
        .map(|s| s["name"].as_str().expect("name"))
        .collect();
    assert_eq!(names, ["fs", "time"], "{list}");
    assert_eq!(
        list["servers"][0]["server_info"]["name"],
        "secure-filesystem-server"
    );
    let fs_proc = fs["process_id"].as_str().expect("process_id").to_owned();
    let procs = api
        .get(&format!("/v1/sandboxes/{sb}/processes"))
        .expect(200, "processes");
    assert!(
        procs["processes"]
            .as_array()
            .expect("processes")
            .iter()
            .any(|p| p["id"] == fs_proc && p["state"] == "running"),
        "{procs}"
    );

    // DELETE without a session stops the server: its process ends, its URL is gone.
    api.delete(&format!("/v1/sandboxes/{sb}/mcp/fs"))
        .expect(204, "stop fs");
    let p = api
        .get(&format!("/v1/sandboxes/{sb}/processes/{fs_proc}"))
        .expect(200, "the fs process");
    assert_eq!(p["state"], "exited", "{p}");
    api.post(&format!("/v1/sandboxes/{sb}/mcp/fs"), &json!({}))
        .expect_error(404, "not_found", "a stopped server");
    // The name is free again.
    start_server(
        &api,
        &sb,
        &json!({"name": "fs", "cmd": ["node", format!("/opt/mcp/npm/{FS_ENTRY}"), "/root/data"]}),
    );
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the sandbox");
    api.get(&format!("/v1/sandboxes/{sb}/mcp")).expect_error(
        404,
        "not_found",
        "a deleted sandbox's servers",
    );
}

/// Writes the hostile server into a fresh sandbox; returns the sandbox id.
fn hostile_sandbox(api: &Api) -> String {
    let sb = api.create_sandbox(&json!({"ttl_s": 600}))["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let script = std::fs::read(locker_tests::root().join("tests/mcp/hostile_server.py"))
        .expect("read hostile_server.py");
    api.write_file(&sb, "/root/hostile.py", &script)
        .expect(200, "write the hostile server");
    sb
}

#[test]
fn a_hostile_stdio_server_gets_clear_errors_and_never_hurts_the_server() {
    become_subreaper();
    let Some(py) = python_mcp() else { return };
    let srv = Server::start();
    let api = srv.api();
    let sb = hostile_sandbox(&api);
    let h = start_server(
        &api,
        &sb,
        &json!({"name": "hostile", "cmd": ["python3", "/root/hostile.py"], "request_timeout_s": 3}),
    );
    let url = h["url"].as_str().expect("url").to_owned();
    let rss_before = rss_kib(srv.pid());
    let proc = h["process_id"].as_str().expect("process_id").to_owned();
    let v = check_bridge_or(&py, &["hostile", &url, &srv.api_key], || {
        let out = api
            .get(&format!("/v1/sandboxes/{sb}/processes/{proc}/output"))
            .text();
        let list = api.get(&format!("/v1/sandboxes/{sb}/mcp")).text();
        let tail = &out[out.len().saturating_sub(3000)..];
        format!("the server's list: {list}\nits process's output ends with: {tail}")
    });
    let rss_after = rss_kib(srv.pid());
    eprintln!("server RSS {rss_before} KiB -> {rss_after} KiB");
    assert!(
        v["notified"].as_array().is_some_and(|n| n
            .iter()
            .any(|s| s.as_str().is_some_and(|s| s.contains("ToolListChanged")))),
        "the server's notification reached the other session: {v}"
    );
    let huge = v["huge"].as_str().expect("huge");
    assert!(huge.contains("over 16 MiB"), "{huge}");
    let never = v["never"].as_str().expect("never");
    assert!(
        never.contains("did not answer tools/call within 3 s"),
        "{never}"
    );
    assert_eq!(v["after_never"], v["pid"], "the same process still serves");
    let closed = v["closed_stdout"].as_str().expect("closed_stdout");
    assert!(closed.contains("did not answer"), "{closed}");
    let exit = v["exit"].as_str().expect("exit");
    assert!(exit.contains("exited with exit code 7"), "{exit}");
    // A 100 MB line never sat in the server's memory whole.
    assert!(
        rss_after < rss_before + 80 * 1024,
        "the server's memory grew by {} MiB",
        (rss_after.saturating_sub(rss_before)) / 1024
    );

    // A server that stops reading its stdin: requests still end at their deadline, even the
    // one whose write cannot get through the full pipe.
    let deaf = start_server(
        &api,
        &sb,
        &json!({"name": "deaf", "cmd": ["python3", "/root/hostile.py"], "request_timeout_s": 3}),
    );
    let d = check_bridge(
        &py,
        &["deaf", deaf["url"].as_str().expect("url"), &srv.api_key],
    );
    let blocked = d["blocked"].as_str().expect("blocked");
    assert!(
        blocked.contains("did not answer tools/call within 3 s"),
        "{d}"
    );
    assert!(d["blocked_s"].as_f64() < Some(10.0), "{d}");
    api.delete(&format!("/v1/sandboxes/{sb}/mcp/deaf"))
        .expect(204, "stop the deaf server");

    // The server is gone: a clear 502, its state and why in the list.
    let r = api.post(&format!("/v1/sandboxes/{sb}/mcp/hostile"), &json!({}));
    let msg = r.expect_error(502, "bad_gateway", "a request to an exited server");
    assert!(
        msg.contains("exit code 7") && msg.contains("exiting on purpose"),
        "{msg}"
    );
    let list = api
        .get(&format!("/v1/sandboxes/{sb}/mcp"))
        .expect(200, "list");
    assert_eq!(list["servers"][0]["state"], "exited", "{list}");
    assert!(
        list["servers"][0]["dropped_lines"].as_u64() >= Some(4),
        "{list}"
    );
    // An exited server's name can be started again without a DELETE.
    start_server(
        &api,
        &sb,
        &json!({"name": "hostile", "cmd": ["python3", "/root/hostile.py"]}),
    );

    // A process that exits at once, and one that never answers initialize: 502 at start.
    let msg = api
        .post(
            &format!("/v1/sandboxes/{sb}/mcp"),
            &json!({"name": "quits", "cmd": ["sh", "-c", "echo bye >&2; exit 3"]}),
        )
        .expect_error(502, "bad_gateway", "a server that exits at once");
    assert!(msg.contains("exit code 3") && msg.contains("bye"), "{msg}");
    let started = Instant::now();
    let msg = api
        .post(
            &format!("/v1/sandboxes/{sb}/mcp"),
            &json!({"name": "silent", "cmd": ["sh", "-c", "echo not json; exec sleep 600"],
                    "request_timeout_s": 1}),
        )
        .expect_error(502, "bad_gateway", "a server that never answers");
    assert!(msg.contains("did not answer initialize"), "{msg}");
    assert!(started.elapsed() < Duration::from_secs(30));
    let list = api
        .get(&format!("/v1/sandboxes/{sb}/mcp"))
        .expect(200, "list");
    assert_eq!(list["servers"].as_array().map(Vec::len), Some(1), "{list}");
    // The failed starts left no process running.
    let procs = api
        .get(&format!("/v1/sandboxes/{sb}/processes"))
        .expect(200, "processes");
    let running: Vec<&Value> = procs["processes"]
        .as_array()
        .expect("processes")
        .iter()
        .filter(|p| p["state"] == "running")
        .collect();
    assert_eq!(
        running.len(),
        1,
        "only the restarted hostile server runs: {procs}"
    );
}

#[test]
fn bad_input_is_refused_with_errors_that_say_what_to_fix() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = hostile_sandbox(&api);
    let path = format!("/v1/sandboxes/{sb}/mcp");
    let hostile = json!(["python3", "/root/hostile.py"]);
    for (body, needle) in [
        (json!({"name": "Fs", "cmd": hostile}), "a-z, 0-9"),
        (json!({"name": "", "cmd": hostile}), "a-z, 0-9"),
        (json!({"name": "a/b", "cmd": hostile}), "a-z, 0-9"),
        (json!({"name": "x".repeat(65), "cmd": hostile}), "1-64"),
        (
            json!({"name": "fs", "cmd": []}),
            "`cmd` must name a program",
        ),
        (json!({"name": "fs"}), "cmd"),
        (
            json!({"name": "fs", "cmd": hostile, "request_timeout_s": 0}),
            "request_timeout_s",
        ),
        (json!({"name": "fs", "cmd": hostile, "bogus": 1}), "bogus"),
    ] {
        let msg = api
            .post(&path, &body)
            .expect_error(400, "bad_request", &format!("{body}"));
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    let msg = api
        .post(&path, &json!({"name": "fs", "cmd": ["/no/such/program"]}))
        .expect_error(400, "bad_request", "a program that does not exist");
    assert!(msg.contains("/no/such/program"), "{msg}");

    start_server(&api, &sb, &json!({"name": "h1", "cmd": hostile}));
    let msg = api
        .post(&path, &json!({"name": "h1", "cmd": hostile}))
        .expect_error(409, "conflict", "a duplicate name");
    assert!(msg.contains("already runs"), "{msg}");

    // Another tenant sees nothing of it.
    let (other, _) = srv.create_tenant("other");
    other
        .get(&path)
        .expect_error(404, "not_found", "another tenant's list");
    other.post(&format!("{path}/h1"), &json!({})).expect_error(
        404,
        "not_found",
        "another tenant's server",
    );
    other
        .delete(&format!("{path}/h1"))
        .expect_error(404, "not_found", "another tenant's stop");
    other
        .post(&path, &json!({"name": "h2", "cmd": hostile}))
        .expect_error(404, "not_found", "another tenant's start");
    // Without a key: 401 like every /v1 route.
    srv.anon()
        .post(&format!("{path}/h1"), &json!({}))
        .expect_error(401, "unauthorized", "no key");
    api.post(&format!("{path}/nope"), &json!({})).expect_error(
        404,
        "not_found",
        "an unknown server",
    );
    api.request("PUT", &format!("{path}/h1"), &[], "x")
        .expect_error(405, "method_not_allowed", "PUT");

    // A paused sandbox: a request to its server resumes it and is served.
    api.post_empty(&format!("/v1/sandboxes/{sb}/pause"))
        .expect(200, "pause");
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"}}});
    let headers = [
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
    ];
    let r = api.request(
        "POST",
        &format!("{path}/h1"),
        &headers,
        init.to_string().into_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("\"hostile\""), "{}", r.text());
    let session = r
        .headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .expect("a session id")
        .to_owned();
    let state = api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["state"].clone();
    assert_eq!(state, "running");
    // Paused again: a request forwarded to the process resumes it and gets its answer.
    api.post_empty(&format!("/v1/sandboxes/{sb}/pause"))
        .expect(200, "pause again");
    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                      "params": {"name": "stats", "arguments": {}}});
    let r = api.request(
        "POST",
        &format!("{path}/h1"),
        &[
            headers[0],
            headers[1],
            ("Mcp-Session-Id", session.as_str()),
            ("MCP-Protocol-Version", "2025-11-25"),
        ],
        call.to_string().into_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.text().contains("inits"),
        "the process answered: {}",
        r.text()
    );

    // DELETE with the session header ends that session only; the server keeps running.
    let r = api.request(
        "DELETE",
        &format!("{path}/h1"),
        &[("Mcp-Session-Id", session.as_str())],
        (),
    );
    assert_eq!(r.status, 204, "{}", r.text());
    let list = api.get(&path).expect(200, "list");
    assert_eq!(list["servers"][0]["state"], "running", "{list}");
    // Without it, the server stops.
    api.delete(&format!("{path}/h1")).expect(204, "stop");
    assert_eq!(api.get(&path).expect(200, "list")["servers"], json!([]));
}

/// The last JSON-RPC message of an answer, JSON or SSE (`data:` lines).
fn rpc_answer(text: &str) -> Value {
    let data = text
        .lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or(text);
    serde_json::from_str(data).unwrap_or_else(|e| panic!("not JSON-RPC ({e}): {text}"))
}

#[test]
fn a_server_in_a_microvm_is_bridged_like_one_in_a_jail() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let sb = api.create_sandbox(&json!({"runtime": "microvm", "memory_mb": 256, "ttl_s": 600}));
    assert_eq!(sb["runtime"], "microvm", "{sb}");
    let sb = sb["id"].as_str().expect("id").to_owned();
    let script = std::fs::read(locker_tests::root().join("tests/mcp/hostile_server.py"))
        .expect("read hostile_server.py");
    api.write_file(&sb, "/root/hostile.py", &script)
        .expect(200, "write the server");
    start_server(
        &api,
        &sb,
        &json!({"name": "h", "cmd": ["python3", "/root/hostile.py"], "request_timeout_s": 60}),
    );
    let path = format!("/v1/sandboxes/{sb}/mcp/h");
    let headers = [
        ("Content-Type", "application/json"),
        ("Accept", "application/json, text/event-stream"),
    ];
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"}}});
    let r = api.request("POST", &path, &headers, init.to_string().into_bytes());
    assert_eq!(r.status, 200, "{}", r.text());
    let session = r
        .headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .expect("a session id")
        .to_owned();
    let with_session = [
        headers[0],
        headers[1],
        ("Mcp-Session-Id", session.as_str()),
        ("MCP-Protocol-Version", "2025-11-25"),
    ];
    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                      "params": {"name": "stats", "arguments": {}}});
    let r = api.request("POST", &path, &with_session, call.to_string().into_bytes());
    assert_eq!(r.status, 200, "{}", r.text());
    let v = rpc_answer(&r.text());
    let stats: Value = serde_json::from_str(
        v["result"]["content"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("a tool result: {v}")),
    )
    .expect("stats JSON");
    assert_eq!(stats["inits"], 1, "{stats}");
    api.delete(&path).expect(204, "stop the server");
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the sandbox");
}
