//! The dashboard (`/ui`, issue 23) through the real server: its assets and headers (a strict
//! CSP, caching, gzip), the terminal tickets that let a browser open the PTY without its key
//! in a URL (single use, bound to one sandbox and tenant, refused from another origin), the
//! refusal of cross-site state-changing requests, the cursor pagination and filters of
//! `GET /v1/calls`, and the page itself in headless Chromium (Debian's `chromium`, driven by
//! `playwright-core` from npm: `tests/ui/ui.test.mjs`): sign-in, a sandbox created from the
//! page, live updates from the event stream (a sandbox created and deleted via the API shows
//! with no reload and no polling), `echo hello` typed in its terminal, a file uploaded and
//! listed, a run's change list, idle fraction, a template build's log followed while it
//! runs, usage charts from `/v1/usage/series`, secrets used and misused in the calls page,
//! hostile strings shown as text with nothing run, phone-width pages, screenshots into
//! `docs/ui/`, and the first load and the calls page over 100 000 records measured into
//! `bench/results/ui.json`.
//!
//! The 100 000 records are written straight into the server's store (`insert_calls` of
//! `locker-store`, the call recorder's own path, from this process) rather than made by
//! 100 000 real calls, which would take hours here; they are real rows the server reads.
//!
//! `tests/ui/node_modules` is installed with `npm ci` on first use; when the npm registry is
//! unreachable the browser test is skipped with a message saying so.

use std::io::Read;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use locker_store::{CallRecord, SqliteStore, Store};
use locker_tests::become_subreaper;
use locker_tests::server::{enc, Api, Server};
use locker_tests::tools::{npm_unreachable, run_logged};
use serde_json::{json, Value};

fn header(r: &locker_tests::server::Resp, name: &str) -> String {
    r.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// A call record of `tenant` as the recorder writes one; `i` varies its kind and outcome.
fn record(tenant: &str, i: usize) -> CallRecord {
    let (reason, code) = match i % 10 {
        0 => ("timeout", Value::Null),
        1 | 2 => ("exited", json!(1)),
        _ => ("exited", json!(0)),
    };
    let kind = if i.is_multiple_of(4) { "run" } else { "exec" };
    serde_json::from_value(json!({
        "id": format!("call_bulk{i:012}"),
        "tenant": tenant,
        "key_id": if i.is_multiple_of(2) { "key_even" } else { "key_odd" },
        "kind": kind,
        "sandbox_id": if kind == "exec" { json!(format!("sb_bulk{:04}", i % 1000)) } else { Value::Null },
        "volume_id": if kind == "run" { json!("vol_bulk") } else { Value::Null },
        "command": ["/bin/sh", "-c", format!("step {i}")],
        "cwd": "/root",
        "env_keys": [],
        "template_digest": "sha256:bulk",
        "runtime": "jail",
        "result": {
            "call_id": format!("call_bulk{i:012}"), "exit_code": code, "signal": null,
            "reason": reason, "stdout": "", "stderr": "", "stdout_truncated": false,
            "stderr_truncated": false, "stdout_bytes": 0, "stderr_bytes": 0, "output_path": null,
            "timings": {"queue_ms": 1.5, "start_ms": 3.0, "run_ms": (i % 900) as f64, "total_ms": 5.0 + (i % 900) as f64},
            "usage": {"cpu_ms": i % 300, "peak_memory_bytes": 1 << 20},
            "changes": null
        },
        "egress_denied": if i.is_multiple_of(50) || i % 20 == 19 { json!(["pypi.org"]) } else { json!([]) },
        // Secrets: used on every tenth, misused (to a hostile-looking destination, shown as
        // text by the page) on every twentieth; the newest record (99 999) has both.
        "secrets_used": if i % 10 == 9 { json!([{"name": "openai", "host": "api.openai.com"}]) } else { json!([]) },
        "secret_misuse": if i % 20 == 19 {
            json!([{"name": "openai", "destination": "http://\"><img src=x onerror=window.__pwned=2>:80"}])
        } else {
            json!([])
        },
        "changes": null,
        "created_at": locker_types::rfc3339(locker_store::now_unix() - 100_000 + i as i64),
    }))
    .expect("a call record")
}

/// Writes `n` records of `tenant` into the server's store, in batches as the recorder does.
fn insert_records(srv: &Server, tenant: &str, n: usize) -> Duration {
    let started = Instant::now();
    let store = SqliteStore::open(srv.data_dir.join("db.sqlite")).expect("open the server's store");
    let mut batch = Vec::with_capacity(5000);
    for i in 0..n {
        batch.push(record(tenant, i));
        if batch.len() == 5000 || i + 1 == n {
            store.insert_calls(&batch).expect("insert call records");
            batch.clear();
        }
    }
    started.elapsed()
}

fn new_tenant(srv: &Server, name: &str) -> String {
    let t = srv
        .admin()
        .post("/v1/tenants", &json!({ "name": name }))
        .expect(201, "create a tenant");
    let key = t["api_key"].as_str().expect("api_key").to_owned();
    srv.remember_key(&key);
    key
}

#[test]
fn assets_are_served_with_a_strict_csp_caching_and_gzip() {
    become_subreaper();
    let srv = Server::start();
    let plain = Api::new(&srv.url, None);
    let page = plain.get("/ui");
    assert_eq!(page.status, 200, "{}", page.text());
    let csp = header(&page, "content-security-policy");
    for needle in [
        "default-src 'self'",
        "script-src 'self';",
        "frame-ancestors 'none'",
        "object-src 'none'",
    ] {
        assert!(csp.contains(needle), "CSP {csp:?} lacks {needle}");
    }
    assert!(!csp.contains("unsafe-eval"), "{csp}");
    assert_eq!(header(&page, "x-content-type-options"), "nosniff");
    assert_eq!(header(&page, "referrer-policy"), "no-referrer");
    assert_eq!(header(&page, "cache-control"), "no-cache");
    let html = page.text();
    assert!(!html.contains("<script>"), "no inline script: {html}");
    // Pages of the dashboard's router are the same page.
    assert_eq!(plain.get("/ui/sandboxes").text(), html);

    // The page names its assets under a version; they are immutable, gzipped on request,
    // with an ETag that answers 304.
    let app_js = html
        .split('"')
        .find(|s| s.starts_with("/ui/v/") && s.ends_with("/app.js"))
        .expect("index.html links app.js")
        .to_owned();
    let js = plain.get(&app_js);
    assert_eq!(js.status, 200);
    assert_eq!(
        header(&js, "content-type"),
        "text/javascript; charset=utf-8"
    );
    assert_eq!(
        header(&js, "cache-control"),
        "public, max-age=31536000, immutable"
    );
    assert!(header(&js, "content-security-policy").contains("default-src 'self'"));
    let etag = header(&js, "etag");
    assert!(etag.starts_with('"'), "{etag}");
    let again = plain.request("GET", &app_js, &[("If-None-Match", &etag)], ());
    assert_eq!(again.status, 304);
    let gz = plain.request("GET", &app_js, &[("Accept-Encoding", "gzip, br")], ());
    assert_eq!(header(&gz, "content-encoding"), "gzip");
    let gz_etag = header(&gz, "etag");
    assert_ne!(gz_etag, etag, "each encoding has its own tag");
    let again = plain.request(
        "GET",
        &app_js,
        &[("If-None-Match", &gz_etag), ("Accept-Encoding", "gzip")],
        (),
    );
    assert_eq!(again.status, 304);
    assert!(gz.body.len() < js.body.len(), "gzip is smaller");
    let mut unzipped = Vec::new();
    flate2_decode(&gz.body, &mut unzipped);
    assert_eq!(unzipped, js.body, "gzip holds the same bytes");
    let css = plain.get(&app_js.replace("/app.js", "/style.css"));
    assert_eq!(header(&css, "content-type"), "text/css; charset=utf-8");
    // Another build's version still answers (an old tab), but is not cached for good.
    let stale = plain.get("/ui/v/0000000000000000/app.js");
    assert_eq!(stale.status, 200);
    assert_eq!(header(&stale, "cache-control"), "no-cache");
    let missing = plain.get(&app_js.replace("/app.js", "/nope.js"));
    assert_eq!(missing.status, 404);
    // The terminal's code is built in (tests run after scripts/setup's `npm ci` in ui/).
    let xterm = plain.get(&app_js.replace("/app.js", "/xterm.js"));
    assert_eq!(xterm.status, 200, "xterm.js is embedded: {}", xterm.text());
    assert!(
        html.contains("content=\"yes\""),
        "the page knows the terminal is there"
    );
}

/// gzip decoding with the system's `gzip` (the tests crate has no deflate crate).
fn flate2_decode(gz: &[u8], out: &mut Vec<u8>) {
    use std::io::Write;
    let mut child = Command::new("gzip")
        .args(["-dc"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("gzip runs");
    child.stdin.take().unwrap().write_all(gz).unwrap();
    child.stdout.take().unwrap().read_to_end(out).unwrap();
    assert!(child.wait().unwrap().success(), "gzip -d");
}

/// A WebSocket handshake to the PTY with `headers`: the status, and the socket on 101.
fn pty_handshake(
    srv: &Server,
    sb: &str,
    headers: &[(&str, &str)],
) -> (
    u16,
    Option<tungstenite::WebSocket<std::net::TcpStream>>,
    String,
) {
    use tungstenite::client::IntoClientRequest;
    let addr = srv.url.strip_prefix("http://").unwrap().to_owned();
    let mut req = format!("ws://{addr}/v1/sandboxes/{sb}/pty")
        .into_client_request()
        .unwrap();
    for (k, v) in headers {
        let name = tungstenite::http::HeaderName::from_bytes(k.as_bytes()).expect("a header name");
        req.headers_mut()
            .insert(name, v.parse().expect("a header value"));
    }
    let stream = std::net::TcpStream::connect(&addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    match tungstenite::client(req, stream) {
        Ok((ws, resp)) => {
            let proto = resp
                .headers()
                .get("sec-websocket-protocol")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            (resp.status().as_u16(), Some(ws), proto)
        }
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => {
            let body =
                String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()).into_owned();
            (resp.status().as_u16(), None, body)
        }
        Err(e) => panic!("handshake: {e}"),
    }
}

fn mint(api: &Api, sb: &str) -> (String, String) {
    let t = api
        .post_empty(&format!("/v1/sandboxes/{sb}/pty/ticket"))
        .expect(201, "mint a terminal ticket");
    let protocols: Vec<&str> = t["protocols"]
        .as_array()
        .expect("protocols")
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert_eq!(protocols[0], "locker-pty");
    assert_eq!(
        protocols[1],
        format!("locker-ticket.{}", t["ticket"].as_str().unwrap())
    );
    assert_eq!(t["expires_in_s"], 30);
    (
        t["ticket"].as_str().unwrap().to_owned(),
        protocols.join(", "),
    )
}

#[test]
fn terminal_tickets_work_once_for_their_sandbox_and_origin() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let a = api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let b = api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // A browser's handshake: the ticket as a subprotocol, its own origin.
    let (_, protos) = mint(&api, &a);
    let origin = srv.url.clone();
    let (status, ws, chosen) = pty_handshake(
        &srv,
        &a,
        &[("Sec-WebSocket-Protocol", &protos), ("Origin", &origin)],
    );
    assert_eq!(status, 101, "{chosen}");
    assert_eq!(
        chosen, "locker-pty",
        "the server picks the terminal's subprotocol"
    );
    let mut ws = ws.unwrap();
    ws.send(tungstenite::Message::Binary(
        b"echo tick$((6*7))et\n".to_vec().into(),
    ))
    .unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !String::from_utf8_lossy(&seen).contains("tick42et") {
        assert!(
            Instant::now() < deadline,
            "no echo: {}",
            String::from_utf8_lossy(&seen)
        );
        if let tungstenite::Message::Binary(b) = ws.read().expect("terminal output") {
            seen.extend_from_slice(&b);
        }
    }
    let _ = ws.close(None);

    // Used once: the same ticket again is refused, and so is no ticket at all.
    let (status, _, body) = pty_handshake(&srv, &a, &[("Sec-WebSocket-Protocol", &protos)]);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("ticket"), "{body}");
    let (status, _, _) = pty_handshake(&srv, &a, &[]);
    assert_eq!(status, 401);
    // Bound to its sandbox: a ticket for `a` does not open `b` (and is then used up).
    let (_, protos) = mint(&api, &a);
    let (status, _, _) = pty_handshake(&srv, &b, &[("Sec-WebSocket-Protocol", &protos)]);
    assert_eq!(status, 401);
    let (status, _, _) = pty_handshake(&srv, &a, &[("Sec-WebSocket-Protocol", &protos)]);
    assert_eq!(status, 401, "a refused ticket is spent");
    // Another site's page cannot use one, even a live one.
    let (_, protos) = mint(&api, &a);
    let (status, _, body) = pty_handshake(
        &srv,
        &a,
        &[
            ("Sec-WebSocket-Protocol", &protos),
            ("Origin", "http://evil.example"),
        ],
    );
    assert_eq!(status, 403, "{body}");
    // A made-up ticket.
    let (status, _, _) = pty_handshake(
        &srv,
        &a,
        &[("Sec-WebSocket-Protocol", "locker-pty, locker-ticket.pt_00")],
    );
    assert_eq!(status, 401);
    // The key in the header still works (the CLI and SDKs).
    let key = format!("Bearer {}", srv.api_key);
    let (status, ws, _) = pty_handshake(&srv, &a, &[("Authorization", &key)]);
    assert_eq!(status, 101);
    drop(ws);

    // Minting needs the key, and a sandbox of the key's tenant.
    let other = srv.api_with(&new_tenant(&srv, "ui-other"));
    assert_eq!(
        other
            .post_empty(&format!("/v1/sandboxes/{a}/pty/ticket"))
            .status,
        404
    );
    assert_eq!(
        Api::new(&srv.url, None)
            .post_empty(&format!("/v1/sandboxes/{a}/pty/ticket"))
            .status,
        401
    );
    assert_eq!(
        api.post_empty("/v1/sandboxes/sb_0000000000000000/pty/ticket")
            .status,
        404
    );
}

#[test]
fn cross_site_state_changing_requests_are_refused() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let form = [("Content-Type", "application/x-www-form-urlencoded")];
    for (extra, what) in [
        (("Sec-Fetch-Site", "cross-site"), "another site"),
        (
            ("Sec-Fetch-Site", "same-site"),
            "a sibling host (a preview URL)",
        ),
        (
            ("Origin", "http://evil.example"),
            "an Origin of another site",
        ),
    ] {
        let r = api.request("POST", "/v1/sandboxes", &[form[0], extra], "a=b");
        assert_eq!(r.status, 403, "{what}: {}", r.text());
        assert!(r.text().contains("another site"), "{}", r.text());
        // Also without the key: the refusal comes before anything else.
        let r = Api::new(&srv.url, None).request("DELETE", "/v1/volumes/x", &[extra], ());
        assert_eq!(r.status, 403, "{what}");
    }
    // Reads are not refused, nor the dashboard's own requests, nor clients without the headers.
    let r = api.request(
        "GET",
        "/v1/sandboxes",
        &[("Sec-Fetch-Site", "cross-site")],
        (),
    );
    assert_eq!(r.status, 200);
    let own = srv.url.clone();
    let v = api.request(
        "POST",
        "/v1/volumes",
        &[
            ("Content-Type", "application/json"),
            ("Sec-Fetch-Site", "same-origin"),
            ("Origin", &own),
        ],
        r#"{"name":"ui-same-origin"}"#,
    );
    assert_eq!(v.status, 201, "{}", v.text());
    let v = api.post("/v1/volumes", &json!({"name": "ui-no-browser"}));
    assert_eq!(v.status, 201, "{}", v.text());
}

#[test]
fn calls_are_paginated_with_a_cursor_and_filtered() {
    become_subreaper();
    let srv = Server::start();
    let key = new_tenant(&srv, "ui-calls");
    let api = srv.api_with(&key);
    insert_records(&srv, "ui-calls", 250);
    // Another tenant's records never show.
    insert_records_other(&srv);

    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let q = match &cursor {
            Some(c) => format!("/v1/calls?limit=100&cursor={}", enc(c)),
            None => "/v1/calls?limit=100".to_owned(),
        };
        let page = api.get(&q).expect(200, "a page of calls");
        pages += 1;
        for c in page["calls"].as_array().unwrap() {
            seen.push(c["id"].as_str().unwrap().to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen.len(), 250);
    let mut expected: Vec<String> = (0..250)
        .rev()
        .map(|i| format!("call_bulk{i:012}"))
        .collect();
    assert_eq!(seen, expected, "newest first, none repeated or skipped");
    // A page that ends exactly at the last record says there is no next one.
    let last = api.get("/v1/calls?limit=250").expect(200, "all");
    assert!(last["next_cursor"].is_null(), "{}", last["next_cursor"]);

    let count = |q: &str| -> usize {
        api.get(&format!("/v1/calls?limit=1000&{q}")).expect(200, q)["calls"]
            .as_array()
            .unwrap()
            .len()
    };
    // i % 10: 0 timeout, 1-2 exit 1, else exit 0.
    assert_eq!(count("outcome=ok"), 175);
    assert_eq!(count("outcome=failed"), 75);
    assert_eq!(count("outcome=timeout"), 25);
    assert_eq!(count("key_id=key_even"), 125);
    assert_eq!(count("kind=run"), 63);
    assert_eq!(count("kind=run&outcome=timeout&key_id=key_even"), 13);
    assert_eq!(count("sandbox_id=sb_bulk0001"), 1);
    expected.clear();

    for (q, needle) in [
        ("cursor=abc", "cursor"),
        ("cursor=-5", "cursor"),
        ("outcome=maybe", "outcome"),
        ("kind=shell", "kind"),
    ] {
        let r = api.get(&format!("/v1/calls?{q}"));
        assert_eq!(r.status, 400, "{q}: {}", r.text());
        assert!(r.text().contains(needle), "{q}: {}", r.text());
    }
}

#[test]
fn sandboxes_are_paged_with_a_total_and_filtered() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let mut made = Vec::new();
    for i in 0..5u32 {
        let meta = if i.is_multiple_of(2) {
            json!({"even": "yes"})
        } else {
            json!({})
        };
        let sb = api.create_sandbox(&json!({ "metadata": meta }));
        made.push(sb["id"].as_str().unwrap().to_owned());
    }
    // Another tenant's sandbox is neither listed nor counted.
    srv.api_with(&new_tenant(&srv, "ui-paging-other"))
        .create_sandbox(&json!({}));
    let ids = |v: &Value| -> Vec<String> {
        v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect()
    };
    // Unpaged: every one, oldest first, with the total and no next page.
    let all = api.get("/v1/sandboxes").expect(200, "the whole list");
    assert_eq!(ids(&all), made);
    assert_eq!(all["total"], 5);
    assert!(all["next_offset"].is_null());
    // Newest first, two a page, to the end.
    let mut newest = made.clone();
    newest.reverse();
    let mut seen = Vec::new();
    let mut offset = Some(0u64);
    while let Some(o) = offset {
        let page = api
            .get(&format!("/v1/sandboxes?limit=2&order=newest&offset={o}"))
            .expect(200, "a page");
        assert_eq!(page["total"], 5);
        seen.extend(ids(&page));
        offset = page["next_offset"].as_u64();
    }
    assert_eq!(seen, newest, "every one once, newest first");
    // Past the end: an empty page that still says how many there are.
    let past = api
        .get("/v1/sandboxes?limit=2&offset=10")
        .expect(200, "past the end");
    assert!(ids(&past).is_empty());
    assert_eq!(past["total"], 5);
    // Filters and paging together: the total is of the matches.
    let even = api
        .get("/v1/sandboxes?metadata.even=yes&limit=1&order=newest")
        .expect(200, "filtered");
    assert_eq!(ids(&even), [made[4].clone()]);
    assert_eq!(even["total"], 3);
    assert_eq!(even["next_offset"], 1);
    for (q, needle) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("offset=-1", "offset"),
        ("order=sideways", "order"),
        ("page=2", "offset="),
    ] {
        let r = api.get(&format!("/v1/sandboxes?{q}"));
        assert_eq!(r.status, 400, "{q}: {}", r.text());
        assert!(r.text().contains(needle), "{q}: {}", r.text());
    }
}

fn insert_records_other(srv: &Server) {
    let store = SqliteStore::open(srv.data_dir.join("db.sqlite")).unwrap();
    let mut r = record("default", 0);
    r.id = "call_bulk_other_tenant".into();
    r.result.call_id = r.id.clone();
    store.insert_calls(&[r]).unwrap();
}

/// Real sandboxes of the tenant the browser test pages through: enough for three pages of
/// 50 (the page's own figures with 1,000 are the bench's `ui` group: 1,000 real sandboxes
/// take minutes to make on a small host).
const MANY: usize = 120;

/// Creates `n` sandboxes with `api`, four at a time: every tenth labelled `group=tenth`, every
/// 40th then paused. They go with the server (its drop deletes every sandbox of every key).
fn fill_sandboxes(api: &Api, n: usize) -> Duration {
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || {
                for i in (t..n).step_by(4) {
                    let meta = if i % 10 == 0 {
                        json!({"n": i.to_string(), "group": "tenth"})
                    } else {
                        json!({"n": i.to_string()})
                    };
                    let sb = api.create_sandbox(&json!({"memory_mb": 128, "metadata": meta}));
                    if i % 40 == 0 {
                        let id = sb["id"].as_str().expect("id");
                        api.post_empty(&format!("/v1/sandboxes/{id}/pause"))
                            .expect(200, "pause");
                    }
                }
            });
        }
    });
    started.elapsed()
}

/// `tests/ui/node_modules` with the locked playwright-core, or None when npm cannot reach
/// its registry.
fn playwright(dir: &Path) -> Option<()> {
    let installed_lock = dir.join("node_modules/.package-lock.json");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if dir
        .join("node_modules/playwright-core/package.json")
        .exists()
        && modified(&installed_lock) >= modified(&dir.join("package-lock.json"))
    {
        return Some(());
    }
    let (ok, log) =
        run_logged(
            Command::new("npm")
                .current_dir(dir)
                .args(["ci", "--no-audit", "--no-fund"]),
        );
    if !ok {
        if npm_unreachable(&log) {
            eprintln!("SKIP: playwright-core cannot be installed, the npm registry is unreachable:\n{log}");
            return None;
        }
        panic!("npm ci in tests/ui failed:\n{log}");
    }
    Some(())
}

#[test]
fn dashboard_in_chromium() {
    become_subreaper();
    assert!(
        Path::new("/usr/bin/chromium").exists(),
        "Debian's chromium is not installed: `scripts/setup test` installs it (apt-get install chromium)"
    );
    let root = locker_tests::root();
    let dir = root.join("tests/ui");
    let Some(()) = playwright(&dir) else { return };
    // Room for the many sandboxes' tenant (each tenant's quota is checked on its own).
    let quota = (MANY + 20).to_string();
    let srv = Server::start_with(&[
        "--quota-sandboxes",
        &quota,
        "--quota-memory-mb",
        "1000000",
        "--quota-disk-mb",
        "100000000",
    ]);
    let api = srv.api();
    let many = new_tenant(&srv, "many");
    let took = fill_sandboxes(&srv.api_with(&many), MANY);
    eprintln!("{MANY} sandboxes created in {took:?}");
    let bulk = new_tenant(&srv, "bulk");
    let took = insert_records(&srv, "bulk", 100_000);
    eprintln!("100 000 call records written into the store in {took:?}");
    api.post("/v1/volumes", &json!({"name": "ui-vol"}))
        .expect(201, "create a volume");
    api.put("/v1/volumes/ui-vol/files?path=/old.txt", &b"old\n"[..])
        .expect(200, "a file on the volume");

    let started = Instant::now();
    let (ok, log) = run_logged(
        Command::new("node")
            .current_dir(&dir)
            .args(["--test", "--test-reporter=tap", "ui.test.mjs"])
            .env("LOCKER_URL", &srv.url)
            .env("LOCKER_API_KEY", &srv.api_key)
            .env("LOCKER_BULK_KEY", &bulk)
            .env("LOCKER_VOLUME", "ui-vol")
            .env("LOCKER_MANY_KEY", &many)
            .env("LOCKER_MANY", MANY.to_string())
            .env("UI_SHOTS", root.join("docs/ui"))
            .env("UI_BENCH", root.join("bench/results/ui.json"))
            .env_remove("NODE_OPTIONS"),
    );
    eprintln!("the browser test took {:?}:\n{log}", started.elapsed());
    assert!(ok, "the dashboard's browser test failed:\n{log}");
    let count = |what: &str| -> u32 {
        log.lines()
            .find_map(|l| l.strip_prefix(&format!("# {what} ")))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no `# {what}` line in node's TAP output:\n{log}"))
    };
    assert_eq!(count("fail"), 0, "{log}");
    assert!(count("pass") >= 17, "{log}");
}
