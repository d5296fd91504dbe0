//! E2B's envd data plane (issue 19, item 2) through the real server: E2B's own SDKs,
//! unmodified, with `E2B_API_URL`/`E2B_SANDBOX_URL` set to Locker and `E2B_API_KEY` to a
//! Locker key: commands (foreground, background + list + kill, streaming callbacks,
//! stdin, timeouts, envs, cwd, user, connect), the PTY, files (text and bytes, gzip both
//! ways, streams, several files at once, list with depth, exists, info, make_dir, rename,
//! remove, watch by polling and by stream) — the Python SDK's checks are in
//! `tests/e2b/envd_sdk.py`, the npm package's in `tests/e2b/envd_npm.mjs`. Then every bad
//! input the Connect layer and `/files` must turn away, asserted in the protocol's own
//! error shape: malformed envelopes (compressed flag, bad and oversized lengths,
//! truncation), unknown methods, invalid ProtoJSON, wrong content types and timeouts, a
//! missing token, a wrong signature, broken multipart and a gzip bomb.

use std::io::Read;
use std::process::Command;
use std::time::Duration;

use locker_tests::server::{Api, Resp, Server};
use serde_json::Value;

/// A sandbox made through E2B's control plane; killed when dropped.
struct E2bSandbox {
    api: Api,
    key: String,
    id: String,
    token: String,
}

impl E2bSandbox {
    fn create(srv: &Server) -> E2bSandbox {
        let api = srv.anon().with_timeout(Duration::from_secs(300));
        let r = api.request(
            "POST",
            "/sandboxes",
            &[
                ("X-API-KEY", &srv.api_key),
                ("Content-Type", "application/json"),
            ],
            r#"{"templateID":"base","timeout":600}"#,
        );
        let v = r.expect(201, "E2B create");
        E2bSandbox {
            api,
            key: srv.api_key.clone(),
            id: v["sandboxID"].as_str().expect("sandboxID").to_owned(),
            token: v["envdAccessToken"]
                .as_str()
                .expect("envdAccessToken")
                .to_owned(),
        }
    }

    /// A data-plane request with the sandbox's headers (and the token unless `anon`).
    fn envd(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
        anon: bool,
    ) -> Resp {
        let mut h: Vec<(&str, &str)> =
            vec![("E2b-Sandbox-Id", &self.id), ("E2b-Sandbox-Port", "49983")];
        if !anon {
            h.push(("X-Access-Token", &self.token));
        }
        h.extend_from_slice(headers);
        self.api.request(method, path, &h, body)
    }

    fn unary(&self, method: &str, body: &str) -> Resp {
        self.envd(
            "POST",
            method,
            &[
                ("Content-Type", "application/json"),
                ("Connect-Protocol-Version", "1"),
            ],
            body.as_bytes().to_vec(),
            false,
        )
    }

    fn stream(&self, method: &str, body: Vec<u8>, extra: &[(&str, &str)]) -> Resp {
        let mut h = vec![
            ("Content-Type", "application/connect+json"),
            ("Connect-Protocol-Version", "1"),
        ];
        h.extend_from_slice(extra);
        self.envd("POST", method, &h, body, false)
    }
}

impl Drop for E2bSandbox {
    fn drop(&mut self) {
        let _ = self.api.try_request(
            "DELETE",
            &format!("/sandboxes/{}", self.id),
            &[("X-API-KEY", &self.key)],
            "",
        );
    }
}

fn envelope(flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![flags];
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v
}

/// The envelopes of a streaming answer: (flags, JSON).
fn envelopes(r: &Resp) -> Vec<(u8, Value)> {
    let mut out = Vec::new();
    let mut b = &r.body[..];
    while !b.is_empty() {
        assert!(
            b.len() >= 5,
            "a truncated envelope in the answer: {:?}",
            r.text()
        );
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        let v: Value = serde_json::from_slice(&b[5..5 + len]).expect("envelope JSON");
        out.push((b[0], v));
        b = &b[5 + len..];
    }
    out
}

/// A unary Connect error: the status and `{"code": code, "message": …}`.
#[track_caller]
fn connect_error(r: &Resp, status: u16, code: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.text());
    let v = r.json();
    assert_eq!(v["code"], code, "{what}: {v}");
    assert!(
        v["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {v}"
    );
}

/// A streaming Connect error: 200, `application/connect+json`, and only the end-of-stream
/// envelope carrying the error.
#[track_caller]
fn stream_error(r: &Resp, code: &str, what: &str) {
    assert_eq!(r.status, 200, "{what}: {}", r.text());
    let ct = r.headers.get("content-type").and_then(|v| v.to_str().ok());
    assert_eq!(ct, Some("application/connect+json"), "{what}");
    let e = envelopes(r);
    assert_eq!(e.len(), 1, "{what}: {e:?}");
    assert_eq!(e[0].0, 2, "{what}: the end-of-stream flag: {e:?}");
    assert_eq!(e[0].1["error"]["code"], code, "{what}: {e:?}");
}

fn python_env(cmd: &mut Command, srv: &Server) {
    cmd.env("E2B_API_URL", &srv.url)
        .env("E2B_SANDBOX_URL", &srv.url)
        .env("E2B_API_KEY", &srv.api_key)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONUNBUFFERED", "1");
}

#[test]
fn python_sdk_drives_envd() {
    let Some(py) = locker_tests::tools::python_e2b() else {
        return;
    };
    let srv = Server::start();
    let script = locker_tests::root().join("tests/e2b/envd_sdk.py");
    let mut cmd = Command::new(&py);
    cmd.arg(&script);
    python_env(&mut cmd, &srv);
    let out = cmd.output().expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        srv.print_log_tail();
    }
    assert!(
        out.status.success(),
        "envd_sdk.py failed:\n{stdout}\n{stderr}"
    );
    for check in [
        "run",
        "exit_code",
        "envs",
        "cwd_user",
        "callbacks",
        "timeout",
        "background_list",
        "kill",
        "stdin",
        "connect",
        "pty",
        "read_write",
        "write_files",
        "list",
        "exists_remove_rename",
        "watch",
        "watch_stream",
        "health",
    ] {
        assert!(
            stdout.lines().any(|l| l == format!("ok {check}")),
            "check {check} missing:\n{stdout}\n{stderr}"
        );
    }
    assert!(stdout.contains("done"), "{stdout}");
}

#[test]
fn npm_sdk_runs_a_command_and_a_file() {
    let Some(dir) =
        locker_tests::tools::npm_package("e2b-npm", "e2b", "node_modules/e2b/package.json")
    else {
        return;
    };
    let srv = Server::start();
    let script = locker_tests::root().join("tests/e2b/envd_npm.mjs");
    let copy = dir.join("envd_npm.mjs");
    std::fs::copy(&script, &copy).expect("copy the script next to node_modules");
    let mut cmd = Command::new("node");
    cmd.arg(&copy).current_dir(&dir);
    python_env(&mut cmd, &srv);
    let out = cmd.output().expect("node runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "envd_npm.mjs failed:\n{stdout}\n{stderr}"
    );
    for check in ["run", "background", "files", "watch", "killed"] {
        assert!(
            stdout.lines().any(|l| l == format!("ok {check}")),
            "check {check} missing:\n{stdout}\n{stderr}"
        );
    }
}

#[test]
fn bad_input_gets_connect_errors() {
    let srv = Server::start();
    let s = E2bSandbox::create(&srv);

    // E2B's templates have the user `user` (the default user of envd calls); make it
    // where this one does not yet, as root.
    let r = s.stream(
        "/process.Process/Start",
        envelope(
            0,
            br#"{"process":{"cmd":"/bin/sh","args":["-c","id user >/dev/null 2>&1 || useradd -m -s /bin/bash user"]},"stdin":false}"#,
        ),
        &[("Authorization", "Basic cm9vdDo=")],
    );
    let e = envelopes(&r);
    assert_eq!(
        e.last().map(|e| (e.0, e.1.clone())),
        Some((2, serde_json::json!({}))),
        "{e:?}"
    );

    // A good call first, so the failures below are about their input.
    let r = s.unary("/process.Process/List", "{}");
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["processes"].is_array(), "{}", r.text());
    let r = s.stream(
        "/process.Process/Start",
        envelope(
            0,
            br#"{"process":{"cmd":"/bin/echo","args":["hi"]},"stdin":false}"#,
        ),
        &[],
    );
    let e = envelopes(&r);
    assert_eq!(
        e.first().map(|e| e.1["event"]["start"]["pid"].is_number()),
        Some(true),
        "{e:?}"
    );
    assert_eq!(
        e.last().map(|e| (e.0, e.1.clone())),
        Some((2, serde_json::json!({}))),
        "{e:?}"
    );
    assert!(
        e.iter()
            .any(|(_, v)| v["event"]["data"]["stdout"] == "aGkK"),
        "{e:?}"
    );

    // Unary: invalid ProtoJSON, wrong types, unknown methods and services, content types,
    // timeouts, user names, a missing token.
    connect_error(
        &s.unary("/process.Process/List", "{not json"),
        400,
        "invalid_argument",
        "bad JSON",
    );
    connect_error(
        &s.unary("/filesystem.Filesystem/Stat", r#"{"path": 7}"#),
        400,
        "invalid_argument",
        "wrong type",
    );
    connect_error(
        &s.unary(
            "/process.Process/SendSignal",
            r#"{"process":{"pid":"x"},"signal":"SIGNAL_SIGKILL"}"#,
        ),
        400,
        "invalid_argument",
        "pid not a number",
    );
    connect_error(
        &s.unary("/process.Process/Nope", "{}"),
        501,
        "unimplemented",
        "unknown method",
    );
    connect_error(
        &s.unary("/filesystem.Filesystem/Nope", "{}"),
        501,
        "unimplemented",
        "unknown method",
    );
    connect_error(
        &s.unary("/filesystem.Filesystem/Stat", r#"{"path":"/nope/x"}"#),
        404,
        "not_found",
        "stat missing",
    );
    connect_error(
        &s.unary("/filesystem.Filesystem/Stat", r#"{"path":""}"#),
        400,
        "invalid_argument",
        "empty path",
    );
    connect_error(
        &s.unary(
            "/process.Process/SendInput",
            r#"{"process":{"pid":999999},"input":{"stdin":"aGkK"}}"#,
        ),
        404,
        "not_found",
        "unknown pid",
    );
    let r = s.envd(
        "POST",
        "/process.Process/List",
        &[("Content-Type", "application/proto")],
        b"{}".to_vec(),
        false,
    );
    connect_error(&r, 415, "invalid_argument", "binary protobuf");
    let r = s.envd(
        "POST",
        "/process.Process/List",
        &[
            ("Content-Type", "application/json"),
            ("Connect-Timeout-Ms", "soon"),
        ],
        b"{}".to_vec(),
        false,
    );
    connect_error(&r, 400, "invalid_argument", "bad timeout");
    let r = s.envd(
        "POST",
        "/process.Process/List",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", "Basic bm8gc3VjaCB1c2VyOg=="),
        ],
        b"{}".to_vec(),
        false,
    );
    connect_error(&r, 401, "unauthenticated", "a user name with a space");
    let r = s.envd(
        "POST",
        "/process.Process/List",
        &[("Content-Type", "application/json")],
        b"{}".to_vec(),
        true,
    );
    connect_error(&r, 401, "unauthenticated", "no access token");

    // Streaming: malformed envelopes answer 200 with the error in the end-of-stream envelope.
    let start = br#"{"process":{"cmd":"/bin/true"}}"#;
    stream_error(
        &s.stream("/process.Process/Start", envelope(1, start), &[]),
        "invalid_argument",
        "compressed flag",
    );
    stream_error(
        &s.stream("/process.Process/Start", envelope(2, start), &[]),
        "invalid_argument",
        "end flag from the client",
    );
    let mut huge = vec![0u8];
    huge.extend_from_slice(&u32::MAX.to_be_bytes());
    huge.extend_from_slice(b"{}");
    stream_error(
        &s.stream("/process.Process/Start", huge, &[]),
        "resource_exhausted",
        "oversized length",
    );
    let mut cut = envelope(0, start);
    cut.truncate(cut.len() - 4);
    stream_error(
        &s.stream("/process.Process/Start", cut, &[]),
        "invalid_argument",
        "truncated payload",
    );
    stream_error(
        &s.stream("/process.Process/Start", vec![0, 0, 0], &[]),
        "invalid_argument",
        "truncated header",
    );
    stream_error(
        &s.stream("/process.Process/Start", Vec::new(), &[]),
        "invalid_argument",
        "no message",
    );
    stream_error(
        &s.stream("/process.Process/Start", envelope(0, b"[1,2]"), &[]),
        "invalid_argument",
        "not an object",
    );
    let mut two = envelope(0, start);
    two.extend_from_slice(&envelope(0, start));
    stream_error(
        &s.stream("/process.Process/Start", two, &[]),
        "invalid_argument",
        "two messages",
    );
    stream_error(
        &s.stream(
            "/process.Process/Start",
            envelope(0, br#"{"process":{"cmd":""}}"#),
            &[],
        ),
        "invalid_argument",
        "no command",
    );
    stream_error(
        &s.stream(
            "/process.Process/Connect",
            envelope(0, br#"{"process":{"pid":999999}}"#),
            &[],
        ),
        "not_found",
        "connect to an unknown pid",
    );
    stream_error(
        &s.stream(
            "/filesystem.Filesystem/WatchDir",
            envelope(0, br#"{"path":"/nope"}"#),
            &[],
        ),
        "not_found",
        "watch a missing directory",
    );
    // Start under a deadline: the process dies with it and the stream says so.
    let r = s.stream(
        "/process.Process/Start",
        envelope(
            0,
            br#"{"process":{"cmd":"/bin/sleep","args":["30"]},"stdin":false}"#,
        ),
        &[("Connect-Timeout-Ms", "1000")],
    );
    let e = envelopes(&r);
    assert_eq!(e.last().map(|e| e.0), Some(2), "{e:?}");
    assert_eq!(
        e.last().unwrap().1["error"]["code"],
        "deadline_exceeded",
        "{e:?}"
    );
    assert!(
        e.iter().any(|(_, v)| v["event"]["end"].is_object()),
        "{e:?}"
    );

    // /files: E2B's REST error shape.
    let files = |q: &str, headers: &[(&str, &str)], body: Vec<u8>, method: &str, anon: bool| {
        s.envd(method, &format!("/files?{q}"), headers, body, anon)
    };
    let e2b_error = |r: &Resp, status: u16, what: &str| {
        assert_eq!(r.status, status, "{what}: {}", r.text());
        assert_eq!(r.json()["code"], status, "{what}: {}", r.text());
    };
    e2b_error(
        &files("path=/nope", &[], vec![], "GET", false),
        404,
        "missing file",
    );
    e2b_error(
        &files("path=/etc/hostname", &[], vec![], "GET", true),
        401,
        "no token",
    );
    e2b_error(
        &files(
            "path=/etc/hostname&signature=v1_wrong",
            &[],
            vec![],
            "GET",
            true,
        ),
        401,
        "wrong signature",
    );
    e2b_error(
        &files(
            "path=/tmp/x",
            &[("Content-Type", "multipart/form-data")],
            b"x".to_vec(),
            "POST",
            false,
        ),
        400,
        "no boundary",
    );
    e2b_error(
        &files(
            "",
            &[("Content-Type", "multipart/form-data; boundary=XX")],
            b"--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/cut\"\r\n\r\nabc".to_vec(),
            "POST",
            false,
        ),
        400,
        "truncated multipart",
    );
    e2b_error(
        &files("path=/tmp/x&username=a%20b", &[], vec![], "GET", false),
        400,
        "bad user name",
    );
    e2b_error(
        &files(
            "path=/tmp/y",
            &[("Content-Type", "text/plain")],
            b"x".to_vec(),
            "POST",
            false,
        ),
        415,
        "text/plain upload",
    );
    e2b_error(
        &files(
            "path=/tmp/y",
            &[
                ("Content-Type", "application/octet-stream"),
                ("Content-Encoding", "gzip"),
            ],
            b"not gzip at all".to_vec(),
            "POST",
            false,
        ),
        400,
        "bad gzip",
    );
    // A gzip bomb: a few MiB that inflate past the server's cap (or the machine's disk).
    let bomb = gzip_bomb();
    let r = files(
        "path=/tmp/bomb",
        &[
            ("Content-Type", "application/octet-stream"),
            ("Content-Encoding", "gzip"),
        ],
        bomb,
        "POST",
        false,
    );
    assert!(
        matches!(r.status, 413 | 507),
        "gzip bomb: {} {}",
        r.status,
        r.text()
    );
    assert!(r.json()["code"].is_number(), "{}", r.text());

    // A range, and a signed URL without the token.
    let up = files(
        "path=/tmp/r.txt",
        &[("Content-Type", "application/octet-stream")],
        b"0123456789".to_vec(),
        "POST",
        false,
    );
    assert_eq!(up.status, 200, "{}", up.text());
    assert_eq!(up.json()[0]["path"], "/tmp/r.txt", "{}", up.text());
    let r = files(
        "path=/tmp/r.txt",
        &[("Range", "bytes=2-4")],
        vec![],
        "GET",
        false,
    );
    assert_eq!((r.status, r.text()), (206, "234".to_string()));
    let sig = signature("/tmp/r.txt", "read", "", &s.token);
    let r = files(
        &format!("path=/tmp/r.txt&signature={sig}"),
        &[],
        vec![],
        "GET",
        true,
    );
    assert_eq!((r.status, r.text()), (200, "0123456789".to_string()));
    let r = s.envd("GET", "/health", &[], vec![], true);
    assert_eq!(r.status, 204);
    let r = s.envd("GET", "/envs", &[], vec![], false);
    assert!(r.json().is_object(), "{}", r.text());
}

/// The SDK's `v1_` signature, computed by Python's hashlib (the tests have no sha2).
fn signature(path: &str, op: &str, user: &str, token: &str) -> String {
    let out = Command::new("python3")
        .args([
            "-c",
            "import base64,hashlib,sys; d=hashlib.sha256(':'.join(sys.argv[1:]).encode()).digest(); print('v1_'+base64.b64encode(d).rstrip(b'=').decode())",
            path,
            op,
            user,
            token,
        ])
        .output()
        .expect("python3");
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .replace('+', "%2B")
        .replace('/', "%2F")
}

/// 1.1 GiB of zeros, gzipped (about 1 MiB), made by Python's gzip.
fn gzip_bomb() -> Vec<u8> {
    let mut child = Command::new("python3")
        .args([
            "-c",
            "import gzip,sys\nz=gzip.GzipFile(fileobj=sys.stdout.buffer,mode='wb',compresslevel=9)\nb=bytes(1<<20)\nfor _ in range(1126): z.write(b)\nz.close()",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut v = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut v).unwrap();
    assert!(child.wait().unwrap().success());
    v
}

/// Long streams send envd's keepalive events at the request's `Keepalive-Ping-Interval`
/// while a command prints nothing (the SDKs send the header and skip the events; proxies
/// on the way would close a silent stream), and `List` shows a running process's `envs`
/// and `cwd` as its `Start` gave them (the sandbox's own `envVars` are not repeated).
#[test]
fn keepalives_on_silent_streams_and_list_shows_envs_and_cwd() {
    let srv = Server::start();
    let api = srv.anon().with_timeout(Duration::from_secs(300));
    let r = api.request(
        "POST",
        "/sandboxes",
        &[
            ("X-API-KEY", &srv.api_key),
            ("Content-Type", "application/json"),
        ],
        r#"{"templateID":"base","timeout":600,"envVars":{"FROM_SANDBOX":"s"}}"#,
    );
    let v = r.expect(201, "E2B create");
    let s = E2bSandbox {
        api,
        key: srv.api_key.clone(),
        id: v["sandboxID"].as_str().expect("sandboxID").to_owned(),
        token: v["envdAccessToken"]
            .as_str()
            .expect("envdAccessToken")
            .to_owned(),
    };
    let root = ("Authorization", "Basic cm9vdDo=");

    // Silent for 2.5 s with a 1 s interval: two keepalives between start and the output.
    let r = s.stream(
        "/process.Process/Start",
        envelope(
            0,
            br#"{"process":{"cmd":"/bin/sh","args":["-c","sleep 2.5; echo done"]},"stdin":false}"#,
        ),
        &[root, ("Keepalive-Ping-Interval", "1")],
    );
    let e = envelopes(&r);
    let kinds: Vec<String> = e
        .iter()
        .map(|(flags, v)| match v["event"].as_object() {
            Some(o) if *flags == 0 => o.keys().next().cloned().unwrap_or_default(),
            _ => format!("flags {flags}"),
        })
        .collect();
    let keepalives = kinds.iter().filter(|k| *k == "keepalive").count();
    assert!(
        kinds.first().map(String::as_str) == Some("start")
            && (2..=4).contains(&keepalives)
            && kinds.ends_with(&["data".into(), "end".into(), "flags 2".into()]),
        "start, 2 keepalives, data, end, end of stream: {kinds:?}"
    );
    assert!(
        e.iter()
            .all(|(_, v)| v["event"]["keepalive"].is_null() || v["event"]["keepalive"] == serde_json::json!({})),
        "{e:?}"
    );
    // Without the header (envd's default of 90 s) a short command gets none.
    let r = s.stream(
        "/process.Process/Start",
        envelope(
            0,
            br#"{"process":{"cmd":"/bin/sh","args":["-c","sleep 1.2; echo done"]},"stdin":false}"#,
        ),
        &[root],
    );
    assert!(
        envelopes(&r)
            .iter()
            .all(|(_, v)| v["event"]["keepalive"].is_null()),
        "no keepalive within envd's default interval: {:?}",
        envelopes(&r)
    );

    // A process started with envs and a cwd, listed while it runs.
    std::thread::scope(|scope| {
        let started = scope.spawn(|| {
            s.stream(
                "/process.Process/Start",
                envelope(
                    0,
                    br#"{"process":{"cmd":"/bin/sleep","args":["3"],"envs":{"MINE":"m1","FROM_SANDBOX":"s"},"cwd":"/tmp"},"stdin":false}"#,
                ),
                &[root],
            )
        });
        let mut listed = None;
        for _ in 0..40 {
            std::thread::sleep(Duration::from_millis(100));
            let r = s.unary("/process.Process/List", "{}");
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            if let Some(p) = v["processes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["config"]["cmd"] == "/bin/sleep")
            {
                listed = Some(p.clone());
                break;
            }
        }
        let p = listed.expect("the running sleep is listed");
        assert_eq!(p["config"]["args"], serde_json::json!(["3"]), "{p}");
        assert_eq!(p["config"]["cwd"], "/tmp", "{p}");
        // The sandbox's own variable is every process's: not repeated as this one's.
        assert_eq!(
            p["config"]["envs"],
            serde_json::json!({"MINE": "m1"}),
            "{p}"
        );
        let r = started.join().expect("the Start stream");
        assert_eq!(envelopes(&r).last().map(|e| e.0), Some(2));
    });
}

/// What envd 0.6.2–0.6.4 added (file metadata, watch events with their entry, watches
/// that allow network mounts), a symlink's `Stat` and `set_timeout(0)`, through the
/// Python SDK: the checks are in `tests/e2b/envd_newer.py`.
#[test]
fn python_sdk_metadata_symlinks_entries_and_zero_timeout() {
    let Some(py) = locker_tests::tools::python_e2b() else {
        return;
    };
    let srv = Server::start();
    let script = locker_tests::root().join("tests/e2b/envd_newer.py");
    let mut cmd = Command::new(&py);
    cmd.arg(&script);
    python_env(&mut cmd, &srv);
    let out = cmd.output().expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        srv.print_log_tail();
    }
    assert!(
        out.status.success(),
        "envd_newer.py failed:\n{stdout}\n{stderr}"
    );
    for check in [
        "metadata_write",
        "metadata_list_rename_overwrite",
        "metadata_xattr",
        "metadata_refused",
        "symlink_stat",
        "watch_include_entry",
        "watch_network_mounts",
        "set_timeout_zero_pauses",
        "set_timeout_zero_kills",
        "killed_under_command",
    ] {
        assert!(
            stdout.lines().any(|l| l == format!("ok {check}")),
            "check {check} missing:\n{stdout}\n{stderr}"
        );
    }
    assert!(stdout.contains("done"), "{stdout}");
}

/// envd's routes the SDKs do not call but envd serves (`/init`, `/metrics`,
/// `/files/compose`), process tags (`Start` with a tag, `List` showing it, `Connect` and
/// `SendSignal` by it), metadata headers the server refuses, and the whole data plane over
/// HTTP/2 without TLS (h2c with prior knowledge, as `curl --http2-prior-knowledge`).
#[test]
fn init_metrics_compose_tags_and_h2c() {
    let srv = Server::start();
    let s = E2bSandbox::create(&srv);
    let root = ("Authorization", "Basic cm9vdDo=");
    let json = ("Content-Type", "application/json");

    // /metrics: envd's field names, the sandbox's sizes.
    let r = s.envd("GET", "/metrics", &[], vec![], false);
    let m = r.expect(200, "/metrics");
    assert!(m["ts"].as_i64().unwrap_or(0) > 1_700_000_000, "{m}");
    assert!(m["cpu_count"].as_u64().unwrap_or(0) >= 1, "{m}");
    assert!(m["mem_total"].as_u64().unwrap_or(0) > 0, "{m}");
    assert_eq!(m["mem_total_mib"].as_u64(), m["mem_total"].as_u64().map(|b| b >> 20), "{m}");
    assert!(m["disk_total"].as_u64().unwrap_or(0) > 0, "{m}");
    assert!(m["cpu_used_pct"].is_number() && m["mem_used"].is_number(), "{m}");
    let r = s.envd("GET", "/metrics", &[], vec![], true);
    assert_eq!(r.status, 401, "/metrics without the token: {}", r.text());

    // /init: environment, default user and working directory of later calls.
    let r = s.envd(
        "POST",
        "/init",
        &[json],
        br#"{"envVars":{"FROM_INIT":"i1"},"defaultUser":"root","defaultWorkdir":"/tmp","timestamp":"2026-12-02T00:00:00Z","lifecycleID":"x"}"#.to_vec(),
        false,
    );
    assert_eq!(r.status, 204, "/init: {}", r.text());
    let r = s.stream(
        "/process.Process/Start",
        envelope(
            0,
            br#"{"process":{"cmd":"/bin/sh","args":["-c","echo $FROM_INIT $(whoami) $(pwd)"]},"stdin":false}"#,
        ),
        &[],
    );
    let out: String = envelopes(&r)
        .iter()
        .filter_map(|(_, v)| v["event"]["data"]["stdout"].as_str())
        .map(|b| String::from_utf8_lossy(&b64(b)).into_owned())
        .collect();
    assert_eq!(out, "i1 root /tmp\n", "{:?}", envelopes(&r));
    let envs = s.envd("GET", "/envs", &[], vec![], false).expect(200, "/envs");
    assert_eq!(envs["FROM_INIT"], "i1", "{envs}");
    for (body, what) in [
        (&br#"{"volumeMounts":[{"nfs_target":"x","path":"/mnt"}]}"#[..], "volumeMounts"),
        (br#"{"accessToken":"not-the-token"}"#, "accessToken"),
        (br#"{"caBundle":"-----BEGIN CERTIFICATE-----"}"#, "caBundle"),
        (br#"{"defaultUser":"a b"}"#, "defaultUser"),
        (br#"{"defaultWorkdir":"rel"}"#, "defaultWorkdir"),
        (br#"{"envVars":{"A=B":"c"}}"#, "envVars"),
        (br#"{"envVars":"#, "truncated JSON"),
    ] {
        let r = s.envd("POST", "/init", &[json], body.to_vec(), false);
        assert_eq!(r.status, 400, "/init {what}: {}", r.text());
        let v = r.json();
        assert_eq!(v["code"], 400, "{what}: {v}");
    }
    let r = s.envd("POST", "/init", &[json], b"{}".to_vec(), true);
    assert_eq!(r.status, 401, "/init without the token: {}", r.text());
    let r = s.envd("GET", "/init", &[], vec![], false);
    assert_eq!(r.status, 405, "GET /init: {}", r.text());
    // Back to E2B's default user for the rest.
    let r = s.envd("POST", "/init", &[json], br#"{"defaultUser":"user"}"#.to_vec(), false);
    assert_eq!(r.status, 204, "{}", r.text());

    // /files/compose: joined in order, the sources removed, the result the user's.
    for (name, body) in [("p1", "one\n"), ("p2", "two\n"), ("p3", "three\n")] {
        let r = s.envd(
            "POST",
            &format!("/files?path=/home/user/parts/{name}"),
            &[("Content-Type", "application/octet-stream")],
            body.as_bytes().to_vec(),
            false,
        );
        assert_eq!(r.status, 200, "upload {name}: {}", r.text());
    }
    let r = s.envd(
        "POST",
        "/files/compose",
        &[json],
        br#"{"source_paths":["parts/p1","parts/p2","/home/user/parts/p3"],"destination":"joined/all.txt"}"#.to_vec(),
        false,
    );
    let v = r.expect(200, "compose");
    assert_eq!(v["path"], "/home/user/joined/all.txt", "{v}");
    assert_eq!(v["type"], "file", "{v}");
    let r = s.envd("GET", "/files?path=joined/all.txt", &[], vec![], false);
    assert_eq!(r.text(), "one\ntwo\nthree\n");
    let r = s.envd("GET", "/files?path=parts/p1", &[], vec![], false);
    assert_eq!(r.status, 404, "a source is removed: {}", r.text());
    let st = s.unary(
        "/filesystem.Filesystem/Stat",
        r#"{"path":"/home/user/joined/all.txt"}"#,
    );
    assert_eq!(st.json()["entry"]["owner"], "user", "{}", st.text());
    for (body, status, what) in [
        (&br#"{"source_paths":["parts/none"],"destination":"x"}"#[..], 404, "a missing source"),
        (br#"{"source_paths":["/home"],"destination":"x"}"#, 400, "a directory"),
        (br#"{"source_paths":[],"destination":"x"}"#, 400, "no source"),
        (br#"{"source_paths":["a"]}"#, 400, "no destination"),
        (br#"{"source_paths":["a"],"destination":"x","username":"a b"}"#, 400, "a bad user"),
    ] {
        let r = s.envd("POST", "/files/compose", &[json], body.to_vec(), false);
        assert_eq!(r.status, status, "compose with {what}: {}", r.text());
        assert_eq!(r.json()["code"], status, "{what}");
    }
    let r = s.envd(
        "POST",
        "/files/compose",
        &[json],
        br#"{"source_paths":["joined/all.txt"],"destination":"y"}"#.to_vec(),
        true,
    );
    assert_eq!(r.status, 401, "compose without the token: {}", r.text());

    // Metadata headers the server refuses itself (the SDKs check them first).
    for (k, v, what) in [
        ("X-Metadata-Key", "a\tb".to_owned(), "a value that is not printable"),
        ("X-Metadata-Big", "v".repeat(5000), "more than 4096 bytes"),
    ] {
        let r = s.envd(
            "POST",
            "/files?path=meta.txt",
            &[("Content-Type", "application/octet-stream"), (k, &v)],
            b"x".to_vec(),
            false,
        );
        assert_eq!(r.status, 400, "metadata with {what}: {}", r.text());
    }

    // Tags: Start with one, List shows it, Connect and SendSignal find the process by it.
    std::thread::scope(|scope| {
        let started = scope.spawn(|| {
            s.stream(
                "/process.Process/Start",
                envelope(
                    0,
                    br#"{"process":{"cmd":"/bin/sh","args":["-c","echo tagged; sleep 30"]},"tag":"my-server","stdin":false}"#,
                ),
                &[root],
            )
        });
        let mut listed = None;
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(100));
            let v = s.unary("/process.Process/List", "{}").json();
            if let Some(p) = v["processes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["tag"] == "my-server")
            {
                listed = Some(p.clone());
                break;
            }
        }
        let p = listed.expect("List shows the tagged process with its tag");
        assert_eq!(p["config"]["cmd"], "/bin/sh", "{p}");
        // Connect by tag replays its output; the signal by tag ends it.
        let (conn, _) = std::thread::scope(|inner| {
            let c = inner.spawn(|| {
                s.stream(
                    "/process.Process/Connect",
                    envelope(0, br#"{"process":{"tag":"my-server"}}"#),
                    &[],
                )
            });
            std::thread::sleep(Duration::from_millis(500));
            let r = s.unary(
                "/process.Process/SendSignal",
                r#"{"process":{"tag":"my-server"},"signal":"SIGNAL_SIGKILL"}"#,
            );
            assert_eq!(r.status, 200, "SendSignal by tag: {}", r.text());
            (c.join().expect("connect"), ())
        });
        let e = envelopes(&conn);
        assert_eq!(e[0].1["event"]["start"]["pid"], p["pid"], "{e:?}");
        let said: String = e
            .iter()
            .filter_map(|(_, v)| v["event"]["data"]["stdout"].as_str())
            .map(|b| String::from_utf8_lossy(&b64(b)).into_owned())
            .collect();
        assert_eq!(said, "tagged\n", "{e:?}");
        assert!(
            e.iter().any(|(_, v)| v["event"]["end"]["status"] == "signal: kill"),
            "{e:?}"
        );
        started.join().expect("the Start stream");
    });
    let r = s.unary("/process.Process/SendSignal", r#"{"process":{"tag":"none"},"signal":"SIGNAL_SIGKILL"}"#);
    connect_error(&r, 404, "not_found", "an unknown tag");

    // HTTP/2 without TLS: a unary call, a server stream and a file read.
    // curl (with nghttp2) is in scripts/setup's packages.
    let dir = std::env::temp_dir().join(format!("locker-e2b-h2c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let h2 = |path: &str, ct: &str, body: &[u8]| -> (String, Vec<u8>) {
        let (bf, of) = (dir.join("body"), dir.join("out"));
        std::fs::write(&bf, body).expect("write body");
        let _ = std::fs::remove_file(&of);
        let mut c = Command::new("curl");
        c.args(["-sS", "--http2-prior-knowledge", "-o"])
            .arg(&of)
            .args(["-w", "%{http_version} %{http_code}"])
            .args(["-H", &format!("E2b-Sandbox-Id: {}", s.id)])
            .args(["-H", &format!("X-Access-Token: {}", s.token)])
            .args(["-H", "Connect-Protocol-Version: 1"]);
        if body.is_empty() {
            c.arg(format!("{}{path}", srv.url));
        } else {
            c.args(["-H", &format!("Content-Type: {ct}"), "--data-binary"])
                .arg(format!("@{}", bf.display()))
                .arg(format!("{}{path}", srv.url));
        }
        let out = c.output().expect("curl runs");
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            std::fs::read(&of).unwrap_or_default(),
        )
    };
    let (how, body) = h2(
        "/filesystem.Filesystem/Stat",
        "application/json",
        br#"{"path":"/home/user/joined/all.txt"}"#,
    );
    assert_eq!(how, "2 200", "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).expect("Stat JSON");
    assert_eq!(v["entry"]["size"], "14", "{v}");
    let (how, body) = h2(
        "/process.Process/Start",
        "application/connect+json",
        &envelope(0, br#"{"process":{"cmd":"echo","args":["over h2"]},"stdin":false}"#),
    );
    assert_eq!(how, "2 200");
    let e = envelopes(&Resp {
        status: 200,
        headers: Default::default(),
        body,
    });
    assert_eq!(e.last().map(|x| x.0), Some(2), "{e:?}");
    assert!(
        e.iter().any(|(_, v)| v["event"]["data"]["stdout"].as_str().map(b64)
            == Some(b"over h2\n".to_vec())),
        "{e:?}"
    );
    let (how, body) = h2("/files?path=joined/all.txt", "", b"");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(how, "2 200");
    assert_eq!(body, b"one\ntwo\nthree\n");
}

fn b64(s: &str) -> Vec<u8> {
    locker_types::base64::decode(s).expect("base64")
}
