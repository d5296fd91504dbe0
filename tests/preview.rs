//! Preview URLs through the real server (issue 17, API.md "Ports, preview URLs, MCP servers
//! in a sandbox"): `{port}-{sandbox_id}.localhost` reaches a server started with `&` in the
//! machine, whatever the path; a private port lets through the API key of the sandbox's
//! tenant, the sandbox's preview token as `X-Locker-Token`, or the cookie a `?locker_token=`
//! sets once (with a redirect that drops it), and nothing else; `PUT …/ports/{port}` opens a
//! port to anyone and closes it again; a rotated token stops working at once; settings
//! survive a restart of the server; HTTP/2 (prior knowledge) works on the preview host and
//! the path proxy; a paused sandbox wakes. The client is `curl`, a real one that sends the
//! Host header a browser would.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

const PORT: u16 = 8000;

/// What curl got: status, headers (lowercase names; the last of each), body, HTTP version.
struct Got {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
    version: String,
}

impl Got {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.body))
    }
}

/// `curl` to `http://{host}{path}` where `host` names a preview host; the connection goes to
/// the test server whatever the name resolves to.
fn curl(s: &Server, host: &str, path: &str, args: &[&str]) -> Got {
    let addr = s.url.strip_prefix("http://").unwrap();
    let port = addr.rsplit_once(':').unwrap().1;
    let dir = tempdir();
    let head = dir.join("head");
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "60", "-o"])
        .arg(dir.join("body"))
        .arg("-D")
        .arg(&head)
        .args(["-w", "%{http_code} %{http_version}"])
        .args(["--connect-to", &format!("::{addr}")])
        .args(args)
        .arg(format!("http://{host}:{port}{path}"))
        .output()
        .expect("curl runs");
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let w = String::from_utf8_lossy(&out.stdout).into_owned();
    let (status, version) = w.split_once(' ').unwrap();
    let mut headers = BTreeMap::new();
    for line in std::fs::read_to_string(&head).unwrap().lines() {
        if let Some((k, v)) = line.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
        }
    }
    let body = std::fs::read_to_string(dir.join("body")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    Got {
        status: status.parse().unwrap(),
        headers,
        body,
        version: version.to_owned(),
    }
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(locker_tests::unique("locker-preview"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn host(id: &str, port: u16) -> String {
    format!("{port}-{id}.localhost")
}

/// `PUT /v1/sandboxes/{id}/ports/{port}` with a JSON body.
fn put_port(api: &Api, id: &str, port: u16, body: &Value) -> locker_tests::server::Resp {
    api.request(
        "PUT",
        &format!("/v1/sandboxes/{id}/ports/{port}"),
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

fn sandbox(api: &Api, id: &str) -> Value {
    api.get(&format!("/v1/sandboxes/{id}"))
        .expect(200, "the sandbox")
}

#[test]
fn a_private_port_opens_with_the_key_the_token_or_its_cookie_and_nothing_else() {
    let s = Server::start();
    let api = s.api();
    let id = locker_tests::serving_http(&api, &json!({}), PORT);
    let other_id = api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let sb = sandbox(&api, &id);
    let token = sb["preview_token"].as_str().unwrap().to_owned();
    assert!(token.starts_with("lpt_") && token.len() > 30, "{sb}");
    let other_token = sandbox(&api, &other_id)["preview_token"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(token, other_token);
    let url = sb["preview_url"].as_str().unwrap();
    assert!(
        url.starts_with(&format!("http://{{port}}-{id}.localhost:")),
        "{sb}"
    );
    let h = host(&id, PORT);

    // Nothing: 401 saying how to get in; the machine saw nothing.
    let g = curl(&s, &h, "/", &[]);
    assert_eq!(g.status, 401, "{}", g.body);
    assert!(
        g.body.contains("private") && g.body.contains("locker_token"),
        "{}",
        g.body
    );

    // The key: every path is the machine's, even the API's own; the key stays out.
    let bearer = format!("Authorization: Bearer {}", s.api_key);
    let g = curl(&s, &h, "/v1/sandboxes?x=1", &["-H", &bearer]);
    assert_eq!(g.status, 200, "{}", g.body);
    let seen = g.json();
    assert_eq!(seen["path"], "/v1/sandboxes?x=1", "{seen}");
    assert!(seen["headers"].get("authorization").is_none(), "{seen}");
    assert_eq!(
        seen["headers"]["x-forwarded-host"],
        format!("{h}:{}", port_of(&s)),
        "{seen}"
    );
    // `sb-…` for clients that refuse `_` in a host name.
    let dashed = h.replace("sb_", "sb-");
    assert_eq!(curl(&s, &dashed, "/", &["-H", &bearer]).status, 200);
    // Another tenant's key learns nothing.
    let (other, _) = s.create_tenant("other");
    let other_key = other.key().expect("the other tenant's key").to_owned();
    let g = curl(
        &s,
        &h,
        "/",
        &["-H", &format!("Authorization: Bearer {other_key}")],
    );
    assert_eq!(g.status, 404, "{}", g.body);
    let g = curl(&s, &h, "/", &["-H", "Authorization: Bearer lk_nonsense"]);
    assert_eq!(g.status, 401, "{}", g.body);

    // The token as a header; another sandbox's token is no token.
    let g = curl(&s, &h, "/t", &["-H", &format!("X-Locker-Token: {token}")]);
    assert_eq!(g.status, 200, "{}", g.body);
    assert!(
        g.json()["headers"].get("x-locker-token").is_none(),
        "{}",
        g.body
    );
    let g = curl(
        &s,
        &h,
        "/t",
        &["-H", &format!("X-Locker-Token: {other_token}")],
    );
    assert_eq!(g.status, 401, "{}", g.body);

    // `?locker_token=` once: a redirect without it and a cookie for this host only.
    let g = curl(&s, &h, &format!("/app?a=1&locker_token={token}&b=2"), &[]);
    assert_eq!(g.status, 302, "{}", g.body);
    assert_eq!(g.headers["location"], "/app?a=1&b=2");
    let cookie = &g.headers["set-cookie"];
    assert!(
        cookie.starts_with(&format!("locker_token={token};")),
        "{cookie}"
    );
    assert!(
        cookie.contains("HttpOnly") && !cookie.to_ascii_lowercase().contains("domain="),
        "{cookie}"
    );
    assert_eq!(curl(&s, &h, "/app?locker_token=lpt_wrong", &[]).status, 401);
    // The redirect never leaves the host, whatever the path looks like.
    let g = curl(
        &s,
        &h,
        &format!("//evil.example/x?locker_token={token}"),
        &["--path-as-is"],
    );
    assert_eq!(g.status, 302, "{}", g.body);
    assert_eq!(g.headers["location"], "/evil.example/x");
    // The cookie opens the port; the app's own cookies pass, ours does not.
    let jar = format!("Cookie: theme=dark; locker_token={token}");
    let g = curl(&s, &h, "/app", &["-H", &jar]);
    assert_eq!(g.status, 200, "{}", g.body);
    assert_eq!(g.json()["headers"]["cookie"], "theme=dark", "{}", g.body);
    // A whole browser-like round: follow the redirect with a cookie jar.
    let dir = tempdir();
    let jar_file = dir.join("jar").display().to_string();
    let g = curl(
        &s,
        &h,
        &format!("/deep?locker_token={token}"),
        &["-L", "-c", &jar_file, "-b", &jar_file],
    );
    assert_eq!(g.status, 200, "{}", g.body);
    assert_eq!(g.json()["path"], "/deep");
    let _ = std::fs::remove_dir_all(&dir);

    // Rotation: the old token and its cookie stop at once; the new one works.
    let rotated = api
        .post_empty(&format!("/v1/sandboxes/{id}/preview-token"))
        .expect(200, "rotate the token");
    let new_token = rotated["preview_token"].as_str().unwrap().to_owned();
    assert_ne!(new_token, token);
    assert_eq!(sandbox(&api, &id)["preview_token"], new_token.as_str());
    assert_eq!(
        curl(&s, &h, "/", &["-H", &format!("X-Locker-Token: {token}")]).status,
        401
    );
    let g = curl(&s, &h, "/", &["-H", &jar]);
    assert_eq!(g.status, 401);
    assert!(g.body.contains("rotated"), "{}", g.body);
    assert_eq!(
        curl(
            &s,
            &h,
            "/",
            &["-H", &format!("X-Locker-Token: {new_token}")]
        )
        .status,
        200
    );
    // Another tenant cannot rotate it.
    other
        .post_empty(&format!("/v1/sandboxes/{id}/preview-token"))
        .expect_error(404, "not_found", "another tenant's rotation");
}

fn port_of(s: &Server) -> String {
    s.url.rsplit_once(':').unwrap().1.to_owned()
}

#[test]
fn a_public_port_opens_to_anyone_until_it_is_closed_and_survives_a_restart() {
    let mut s = Server::start();
    let api = s.api();
    let id = locker_tests::serving_http(&api, &json!({}), PORT);
    let h = host(&id, PORT);
    assert_eq!(curl(&s, &h, "/", &[]).status, 401);

    let r = put_port(&api, &id, PORT, &json!({"public": true})).expect(200, "make the port public");
    assert_eq!(r["public"], true, "{r}");
    assert_eq!(r["url"], format!("http://{h}:{}/", port_of(&s)), "{r}");
    let g = curl(&s, &h, "/open", &["-u", "bob:pw"]);
    assert_eq!(g.status, 200, "{}", g.body);
    assert_eq!(g.json()["path"], "/open");
    // The app's own Basic auth on a public port is the app's.
    assert_eq!(
        g.json()["headers"]["authorization"],
        "Basic Ym9iOnB3",
        "{}",
        g.body
    );
    // Only that port: another stays private (401 before anything is dialled).
    assert_eq!(curl(&s, &host(&id, 9), "/", &[]).status, 401);
    let ports = api
        .get(&format!("/v1/sandboxes/{id}/ports"))
        .expect(200, "list");
    let listed = ports["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == PORT)
        .cloned()
        .unwrap();
    assert_eq!(listed["public"], true, "{ports}");

    // Bad settings get clear errors and change nothing.
    for (body, what) in [
        (json!({"public": "yes"}), "a string"),
        (json!({"open": true}), "an unknown field"),
        (json!({}), "nothing"),
    ] {
        put_port(&api, &id, PORT, &body).expect_error(400, "bad_request", what);
    }
    put_port(&api, &id, 0, &json!({"public": true})).expect_error(400, "bad_request", "port 0");
    let (other, _) = s.create_tenant("other");
    put_port(&other, &id, PORT, &json!({"public": false})).expect_error(
        404,
        "not_found",
        "another tenant's port",
    );
    assert_eq!(curl(&s, &h, "/", &[]).status, 200);

    // The settings and the token are the sandbox's: a restarted server keeps them.
    let token = sandbox(&api, &id)["preview_token"].clone();
    s.restart();
    let api = s.api();
    assert_eq!(sandbox(&api, &id)["preview_token"], token);
    assert_eq!(curl(&s, &h, "/after-restart", &[]).status, 200);

    put_port(&api, &id, PORT, &json!({"public": false})).expect(200, "make it private again");
    assert_eq!(curl(&s, &h, "/", &[]).status, 401);
}

#[test]
fn preview_hosts_that_name_nothing_get_clear_errors_and_the_api_host_stays_the_api() {
    let s = Server::start();
    let api = s.api();
    let bearer = format!("Authorization: Bearer {}", s.api_key);
    let g = curl(
        &s,
        "8000-sb_0000000000000000.localhost",
        "/",
        &["-H", &bearer],
    );
    assert_eq!(g.status, 404, "{}", g.body);
    for bad in [
        "sb_1.localhost",
        "0-sb_1.localhost",
        "70000-sb_1.localhost",
        "80-x.y.localhost",
    ] {
        let g = curl(&s, bad, "/", &["-H", &bearer]);
        assert_eq!(g.status, 400, "{bad}: {}", g.body);
    }
    // The API answers on its own names.
    let g = curl(&s, "localhost", "/v1/sandboxes", &["-H", &bearer]);
    assert_eq!(g.status, 200, "{}", g.body);
    let g = curl(&s, "127.0.0.1", "/v1/sandboxes", &["-H", &bearer]);
    assert_eq!(g.status, 200, "{}", g.body);
    drop(api);
}

#[test]
fn http2_reaches_the_preview_host_and_the_path_proxy_and_a_paused_sandbox_wakes() {
    let s = Server::start();
    let api = s.api();
    let id = locker_tests::serving_http(&api, &json!({}), PORT);
    let token = sandbox(&api, &id)["preview_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let h = host(&id, PORT);
    let g = curl(
        &s,
        &h,
        "/h2?q=1",
        &[
            "--http2-prior-knowledge",
            "-H",
            &format!("X-Locker-Token: {token}"),
        ],
    );
    assert_eq!((g.status, g.version.as_str()), (200, "2"), "{}", g.body);
    let seen = g.json();
    assert_eq!(seen["path"], "/h2?q=1", "{seen}");
    assert_eq!(
        seen["headers"]["x-forwarded-host"],
        format!("{h}:{}", port_of(&s)),
        "{seen}"
    );
    // A 1 MB upload over HTTP/2.
    let dir = tempdir();
    let file = dir.join("up");
    std::fs::write(&file, vec![7u8; 1 << 20]).unwrap();
    let g = curl(
        &s,
        &h,
        "/up",
        &[
            "--http2-prior-knowledge",
            "-H",
            &format!("X-Locker-Token: {token}"),
            "--data-binary",
            &format!("@{}", file.display()),
        ],
    );
    assert_eq!(g.status, 200, "{}", g.body);
    assert_eq!(g.json()["length"], 1 << 20);
    let _ = std::fs::remove_dir_all(&dir);
    let g = curl(
        &s,
        "127.0.0.1",
        &format!("/v1/sandboxes/{id}/ports/{PORT}/p"),
        &[
            "--http2-prior-knowledge",
            "-H",
            &format!("Authorization: Bearer {}", s.api_key),
        ],
    );
    assert_eq!((g.status, g.version.as_str()), (200, "2"), "{}", g.body);

    // Wake on request through the preview host.
    api.post_empty(&format!("/v1/sandboxes/{id}/pause"))
        .expect(200, "pause");
    assert_eq!(sandbox(&api, &id)["state"], "paused");
    let g = curl(
        &s,
        &h,
        "/woken",
        &["-H", &format!("X-Locker-Token: {token}")],
    );
    assert_eq!(g.status, 200, "{}", g.body);
    assert_eq!(sandbox(&api, &id)["state"], "running");
}

#[test]
fn a_websocket_and_a_microvm_are_reached_by_their_preview_hosts() {
    let s = Server::start();
    let api = s.api();
    let id =
        locker_tests::serving_http(&api, &json!({"runtime": "microvm", "memory_mb": 256}), PORT);
    let token = sandbox(&api, &id)["preview_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let h = host(&id, PORT);
    let g = curl(&s, &h, "/vm", &["-H", &format!("X-Locker-Token: {token}")]);
    assert_eq!(g.status, 200, "{}", g.body);
    assert_eq!(g.json()["path"], "/vm");

    use tungstenite::client::IntoClientRequest;
    let addr = s.url.strip_prefix("http://").unwrap().to_owned();
    let mut req = format!("ws://{h}:{}/ws", port_of(&s))
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("X-Locker-Token", token.parse().unwrap());
    let stream = std::net::TcpStream::connect(&addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let (mut ws, resp) = tungstenite::client(req, stream).expect("a WebSocket by preview host");
    assert_eq!(resp.status().as_u16(), 101);
    ws.send(tungstenite::Message::Text("over the preview host".into()))
        .unwrap();
    match ws.read().unwrap() {
        tungstenite::Message::Text(t) => assert_eq!(t.as_str(), "over the preview host"),
        other => panic!("not an echo: {other:?}"),
    }
    let _ = ws.close(None);
}
