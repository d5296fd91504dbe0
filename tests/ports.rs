//! Ports of a sandbox through the real server (issue 17, API.md "Ports, preview URLs, MCP
//! servers in a sandbox"): a server started with `&` inside a machine is listed and reached
//! through the path proxy, bodies stream both ways, server-sent events arrive as they are
//! sent, a WebSocket echoes, a paused sandbox wakes for a request; credentials never reach
//! the machine, another tenant gets 404, and bad ports, climbing paths, ports nothing listens
//! on and malformed answers get clear errors. Jail and microVM. Each server cleans up.

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use locker_tests::server::{Api, Server};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const PORT: u16 = 8000;

/// A sandbox running the test server on `PORT`.
fn serving(api: &Api, body: &Value) -> String {
    locker_tests::serving_http(api, body, PORT)
}

fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandboxes/{id}/ports/{PORT}{rest}")
}

fn reached_through_the_proxy(body: Value) {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api, &body);

    let ports = api
        .get(&format!("/v1/sandboxes/{id}/ports"))
        .expect(200, "list ports");
    let p = ports["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == PORT)
        .cloned()
        .unwrap();
    assert_eq!(p["address"], "0.0.0.0", "{ports}");
    assert!(
        p["process"].as_str().unwrap().starts_with("python"),
        "{ports}"
    );
    assert_eq!(p["public"], false, "{ports}");
    assert!(
        p["proxy_url"]
            .as_str()
            .unwrap()
            .ends_with(&format!("/v1/sandboxes/{id}/ports/{PORT}/")),
        "{ports}"
    );
    // The tests' server listens on loopback: preview URLs are on `localhost`.
    assert!(
        p["url"]
            .as_str()
            .unwrap()
            .starts_with(&format!("http://{PORT}-{id}.localhost:")),
        "{ports}"
    );

    // The path (still encoded) and the query reach the server; the caller's key does not.
    let r = api
        .get(&path(&id, "/a/b%20c?x=1&y=%2F"))
        .expect(200, "GET through the proxy");
    assert_eq!(r["method"], "GET", "{r}");
    assert_eq!(r["path"], "/a/b%20c?x=1&y=%2F", "{r}");
    assert!(r["headers"].get("authorization").is_none(), "{r}");
    assert_eq!(r["headers"]["host"], format!("127.0.0.1:{PORT}"), "{r}");
    let root = api.get(&path(&id, "")).expect(200, "the port's root");
    assert_eq!(root["path"], "/", "{root}");

    // Bodies both ways, whole and exact.
    let up: Vec<u8> = (0..20_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let r = api
        .request("POST", &path(&id, "/upload"), &[], up.as_slice())
        .expect(200, "a 20 MB upload");
    assert_eq!(r["length"], up.len(), "{r}");
    assert_eq!(r["sha256"], hex(&Sha256::digest(&up)), "{r}");
    let n = 100 * 1024 * 1024;
    let (status, _, mut body) = api
        .open("GET", &path(&id, &format!("/big?n={n}")), &[], ())
        .unwrap();
    assert_eq!(status, 200);
    let got = std::io::copy(&mut body, &mut std::io::sink()).unwrap();
    assert_eq!(got, n as u64, "a 100 MiB download");
}

#[test]
fn a_server_in_a_jail_is_listed_and_reached_through_the_path_proxy() {
    reached_through_the_proxy(json!({}));
}

#[test]
fn a_server_in_a_jail_with_egress_is_reached_through_the_path_proxy() {
    // The proxy dials into the jail's own namespace: its egress rules must not stand in
    // the way (loopback) and the way in must not change them.
    reached_through_the_proxy(json!({"network": {"egress": "all"}}));
}

#[test]
fn a_server_in_a_microvm_is_listed_and_reached_through_the_path_proxy() {
    reached_through_the_proxy(json!({"runtime": "microvm", "memory_mb": 256}));
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn events_stream_as_they_come_and_a_websocket_echoes() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api, &json!({}));

    let t0 = Instant::now();
    let (status, headers, mut body) = api.open("GET", &path(&id, "/sse"), &[], ()).unwrap();
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    let mut first = [0u8; 9];
    body.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"data: 0\n\n");
    assert!(
        t0.elapsed() < Duration::from_millis(1200),
        "the first event waited for the rest: {:?}",
        t0.elapsed()
    );
    let mut rest = String::new();
    body.read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "data: 1\n\ndata: 2\n\n");

    locker_tests::websocket_echoes(websocket(&s, &id));
}

/// A WebSocket to the test server's `/ws` through the path proxy.
fn websocket(s: &Server, id: &str) -> tungstenite::WebSocket<TcpStream> {
    locker_tests::port_websocket(s, id, PORT, Duration::from_secs(20))
}

fn echoes(ws: &mut tungstenite::WebSocket<TcpStream>, msg: &str) {
    ws.send(tungstenite::Message::Text(msg.into())).unwrap();
    match ws.read().unwrap() {
        tungstenite::Message::Text(t) => assert_eq!(t.as_str(), msg),
        other => panic!("not an echo: {other:?}"),
    }
}

#[test]
fn an_open_websocket_keeps_an_idle_sandbox_running_until_it_closes() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api, &json!({"idle_timeout_s": 1}));
    let mut ws = websocket(&s, &id);
    echoes(&mut ws, "first");
    // Three idle timeouts with nothing but the open connection.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}")).json()["state"],
        "running",
        "paused under an open WebSocket"
    );
    echoes(&mut ws, "still there");
    let _ = ws.close(None);
    drop(ws);
    locker_tests::wait_for(
        Duration::from_secs(10),
        "the idle pause once it closed",
        || (api.get(&format!("/v1/sandboxes/{id}")).json()["state"] == "paused").then_some(()),
    );
}

#[test]
fn a_paused_sandbox_wakes_for_a_request_to_its_port() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api, &json!({}));
    api.post_empty(&format!("/v1/sandboxes/{id}/pause"))
        .expect(200, "pause");
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}")).json()["state"],
        "paused"
    );
    let r = api
        .get(&path(&id, "/after-pause"))
        .expect(200, "a request to a paused sandbox");
    assert_eq!(r["path"], "/after-pause", "{r}");
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}")).json()["state"],
        "running"
    );
}

#[test]
fn bad_ports_paths_and_answers_get_clear_errors_and_other_tenants_get_404() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api, &json!({}));

    for bad in ["0", "65536", "http", "-1"] {
        let m = api
            .get(&format!("/v1/sandboxes/{id}/ports/{bad}/"))
            .expect_error(400, "bad_request", "a bad port");
        assert!(m.contains("1 to 65535"), "{m}");
    }
    for climb in ["/../../../v1/sandboxes", "/a/%2e%2e/b", "/a%2Fb"] {
        api.get(&path(&id, climb))
            .expect_error(400, "bad_request", "a climbing path");
    }
    let m = api
        .get(&format!("/v1/sandboxes/{id}/ports/9/"))
        .expect_error(502, "bad_gateway", "a port nothing listens on");
    assert!(m.contains("nothing listens on port 9"), "{m}");
    let m = api
        .get(&path(&id, "/garbage"))
        .expect_error(502, "bad_gateway", "a malformed answer");
    assert!(m.contains("valid HTTP"), "{m}");
    // The server is still fine after all of that.
    api.get(&path(&id, "/still"))
        .expect(200, "the port after errors");

    // No key, another tenant's key, a deleted sandbox.
    let anon = s.anon();
    assert_eq!(anon.get(&path(&id, "/")).status, 401);
    let (other, _) = s.create_tenant("other");
    other
        .get(&path(&id, "/"))
        .expect_error(404, "not_found", "another tenant's sandbox");
    other
        .get(&format!("/v1/sandboxes/{id}/ports"))
        .expect_error(404, "not_found", "another tenant's ports");
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete");
    api.get(&path(&id, "/"))
        .expect_error(404, "not_found", "a deleted sandbox's port");
}
