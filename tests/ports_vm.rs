//! Services in a microVM through the port proxy, and the first request to an idle-paused
//! sandbox (issue 17): Python's `http.server` started with `&` serves a file, a body goes up,
//! server-sent events arrive as sent, a WebSocket echoes, and a request wakes the machine
//! its idle policy paused; the throughput and the first byte's time are printed. The VM runs
//! under TCG on these hosts, so its bodies are smaller than the jail's (`ports_hostile`).

use std::io::Read;
use std::time::{Duration, Instant};

use locker_tests::server::{enc, Api, Server};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const SRV: &str = include_str!("data/ports_srv.py");
const MIB: u64 = 1 << 20;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn state(api: &Api, id: &str) -> String {
    api.get(&format!("/v1/sandboxes/{id}")).json()["state"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn wait_listed(api: &Api, id: &str, port: u16) {
    locker_tests::wait_for(Duration::from_secs(60), "the port to be listed", || {
        let ports = api
            .get(&format!("/v1/sandboxes/{id}/ports"))
            .expect(200, "list ports");
        ports["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["port"] == port)
            .then_some(())
    });
}

/// Waits for the idle policy to pause `id`, then times a request to `port` until its head
/// (the first byte) and its whole answer.
fn first_byte_after_idle_pause(api: &Api, id: &str, port: u16, rest: &str) -> Duration {
    locker_tests::wait_for(Duration::from_secs(60), "the idle pause", || {
        (state(api, id) == "paused").then_some(())
    });
    let t = Instant::now();
    let (status, _, mut body) = api
        .open(
            "GET",
            &format!("/v1/sandboxes/{id}/ports/{port}{rest}"),
            &[],
            (),
        )
        .unwrap();
    let first = t.elapsed();
    assert_eq!(status, 200, "a request to a paused sandbox");
    std::io::copy(&mut body, &mut std::io::sink()).unwrap();
    assert_eq!(state(api, id), "running", "the request woke it");
    first
}

#[test]
fn a_server_in_a_microvm_serves_files_events_a_websocket_and_wakes_from_an_idle_pause() {
    let s = Server::start();
    let api = s.api().with_timeout(Duration::from_secs(600));
    let t = Instant::now();
    let id = api
        .create_sandbox(&json!({"runtime": "microvm", "memory_mb": 512, "idle_timeout_s": 3}))
        ["id"]
        .as_str()
        .unwrap()
        .to_owned();
    eprintln!("microVM created in {:?}", t.elapsed());
    api.put(
        &format!("/v1/sandboxes/{id}/files?path={}", enc("/root/srv.py")),
        SRV.as_bytes(),
    )
    .expect(200, "upload the server");
    let r = api.exec(
        &id,
        &json!({"shell": "mkdir -p /root/www && head -c 32M /dev/urandom > /root/www/f.bin && \
             sha256sum /root/www/f.bin || exit 1\n\
             cd /root/www && python3 -m http.server 8001 --bind 0.0.0.0 >/dev/null 2>&1 &\n\
             python3 /root/srv.py 8000 >/root/srv.log 2>&1 &",
            "timeout_ms": 120000}),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    let want = r["stdout"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    wait_listed(&api, &id, 8001);
    wait_listed(&api, &id, 8000);

    // A file from `python3 -m http.server`, exact.
    let t = Instant::now();
    let (status, _, mut body) = api
        .open(
            "GET",
            &format!("/v1/sandboxes/{id}/ports/8001/f.bin"),
            &[],
            (),
        )
        .unwrap();
    assert_eq!(status, 200);
    let mut got = Vec::new();
    body.read_to_end(&mut got).unwrap();
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(got.len() as u64, 32 * MIB);
    assert_eq!(
        hex(&Sha256::digest(&got)),
        want,
        "the file through the proxy"
    );
    eprintln!(
        "microVM download: 32 MiB in {secs:.1} s = {:.1} MB/s",
        32.0 * 1.048576 / secs
    );

    // A body up, exact.
    let up: Vec<u8> = (0..16 * MIB).map(|i| (i % 251) as u8).collect();
    let t = Instant::now();
    let r = api
        .request(
            "POST",
            &format!("/v1/sandboxes/{id}/ports/8000/upload"),
            &[],
            up.as_slice(),
        )
        .expect(200, "a 16 MiB upload");
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(r["length"], 16 * MIB, "{r}");
    assert_eq!(r["sha256"], hex(&Sha256::digest(&up)), "{r}");
    eprintln!(
        "microVM upload: 16 MiB in {secs:.1} s = {:.1} MB/s",
        16.0 * 1.048576 / secs
    );

    // Events as they are sent (0.7 s apart), not at the end.
    let t = Instant::now();
    let (status, headers, mut body) = api
        .open(
            "GET",
            &format!("/v1/sandboxes/{id}/ports/8000/sse"),
            &[],
            (),
        )
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    let mut first = [0u8; 9];
    body.read_exact(&mut first).unwrap();
    let at = t.elapsed();
    assert_eq!(&first, b"data: 0\n\n");
    let mut rest = String::new();
    body.read_to_string(&mut rest).unwrap();
    let total = t.elapsed();
    assert_eq!(rest, "data: 1\n\ndata: 2\n\n");
    eprintln!("microVM SSE: first event after {at:?}, all three after {total:?}");
    assert!(
        total - at >= Duration::from_millis(1200),
        "the events came together: first at {at:?}, all at {total:?}"
    );

    // A WebSocket echo.
    locker_tests::websocket_echoes(locker_tests::port_websocket(
        &s,
        &id,
        8000,
        Duration::from_secs(60),
    ));

    // Idle-paused, woken by a request to the port.
    let first = first_byte_after_idle_pause(&api, &id, 8001, "/");
    eprintln!("microVM: first byte after an idle pause in {first:?}");
}

#[test]
fn an_idle_paused_jail_answers_its_first_request_quickly() {
    let s = Server::start();
    let api = s.api();
    let id = api.create_sandbox(&json!({"idle_timeout_s": 1}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    api.put(
        &format!("/v1/sandboxes/{id}/files?path={}", enc("/root/srv.py")),
        SRV.as_bytes(),
    )
    .expect(200, "upload the server");
    let r: Value = api.exec(
        &id,
        &json!({"shell": "python3 /root/srv.py 8000 >/root/srv.log 2>&1 &"}),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    wait_listed(&api, &id, 8000);
    let mut times: Vec<Duration> = (0..5)
        .map(|_| first_byte_after_idle_pause(&api, &id, 8000, "/echo"))
        .collect();
    times.sort();
    eprintln!(
        "jail: first byte after an idle pause: {times:?}, p50 {:?}",
        times[2]
    );
    assert!(
        times[2] < Duration::from_millis(500),
        "a paused jail took {:?} (p50) to answer",
        times[2]
    );
}
