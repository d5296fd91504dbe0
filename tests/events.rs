//! Lifecycle events and usage figures through the real server: webhooks (signatures,
//! order, content, retries, a hanging receiver), the SSE stream (resumed across a restart,
//! per tenant), and the idle / active / paused split of a sandbox's time.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use locker_tests::server::{Api, Server};
use locker_tests::{become_subreaper, wait_for};
use serde_json::{json, Value};

// ---- a webhook receiver on loopback ----

/// How the receiver answers.
#[derive(Clone, Copy)]
enum Mode {
    Ok,
    /// 500 to the first `n` requests, then 200.
    FailFirst(usize),
    /// Reads the request and never answers.
    Hang,
}

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Delivery {
    signature: String,
    event_id: String,
    body: Vec<u8>,
    at: Instant,
}

struct Receiver {
    url: String,
    got: Arc<Mutex<Vec<Delivery>>>,
}

impl Receiver {
    fn start(mode: Mode) -> Receiver {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/hook?x=1", l.local_addr().unwrap());
        let got: Arc<Mutex<Vec<Delivery>>> = Default::default();
        let got2 = got.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(c) = c else { continue };
                let got = got2.clone();
                std::thread::spawn(move || serve(c, mode, &got));
            }
        });
        Receiver { url, got }
    }

    fn deliveries(&self) -> Vec<Delivery> {
        self.got.lock().unwrap().clone()
    }

    /// The events answered 200 (with mode `FailFirst`, the ones after the failures), parsed.
    fn events(&self) -> Vec<Value> {
        self.deliveries()
            .iter()
            .map(|d| serde_json::from_slice(&d.body).unwrap())
            .collect()
    }
}

fn serve(c: TcpStream, mode: Mode, got: &Mutex<Vec<Delivery>>) {
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut w = c;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        assert!(line.starts_with("POST /hook?x=1 "), "request line {line:?}");
        let (mut len, mut sig, mut id, mut ctype) =
            (0usize, String::new(), String::new(), String::new());
        loop {
            let mut h = String::new();
            r.read_line(&mut h).unwrap();
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (k, v) = h.split_once(':').unwrap();
            let v = v.trim().to_owned();
            match k.to_ascii_lowercase().as_str() {
                "content-length" => len = v.parse().unwrap(),
                "locker-signature" => sig = v,
                "locker-event-id" => id = v,
                "content-type" => ctype = v,
                _ => {}
            }
        }
        assert_eq!(ctype, "application/json");
        let mut body = vec![0; len];
        r.read_exact(&mut body).unwrap();
        let n = {
            let mut g = got.lock().unwrap();
            g.push(Delivery {
                signature: sig,
                event_id: id,
                body,
                at: Instant::now(),
            });
            g.len()
        };
        let status = match mode {
            Mode::Ok => 200,
            Mode::FailFirst(k) if n <= k => 500,
            Mode::FailFirst(_) => 200,
            Mode::Hang => {
                std::thread::sleep(Duration::from_secs(3600));
                return;
            }
        };
        let _ = write!(w, "HTTP/1.1 {status} X\r\ncontent-length: 0\r\n\r\n");
    }
}

// ---- HMAC-SHA256 (RFC 2104), written here so the test checks the server independently ----

fn hmac_sha256(key: &[u8], msg: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let ipad: Vec<u8> = k.iter().map(|b| b ^ 0x36).collect();
    let opad: Vec<u8> = k.iter().map(|b| b ^ 0x5c).collect();
    let inner = Sha256::new()
        .chain_update(&ipad)
        .chain_update(msg)
        .finalize();
    let outer = Sha256::new()
        .chain_update(&opad)
        .chain_update(inner)
        .finalize();
    outer.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks `Locker-Signature: t=<unix>,v1=<hex>` over `t.body` with `secret`, and that `t`
/// is now-ish.
fn check_signature(d: &Delivery, secret: &str) {
    let (t, v1) = d
        .signature
        .strip_prefix("t=")
        .and_then(|s| s.split_once(",v1="))
        .unwrap_or_else(|| panic!("signature header {:?}", d.signature));
    let mut msg = format!("{t}.").into_bytes();
    msg.extend_from_slice(&d.body);
    assert_eq!(
        v1,
        hmac_sha256(secret.as_bytes(), &msg),
        "signature of {}",
        d.event_id
    );
    let t: i64 = t.parse().unwrap();
    assert!(
        (locker_tests::answers::now_s() - t).abs() < 120,
        "signature time {t}"
    );
    let e: Value = serde_json::from_slice(&d.body).unwrap();
    assert_eq!(e["id"], d.event_id.as_str());
}

fn types_of(events: &[Value], subject: &str) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["subject"] == subject)
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect()
}

fn id_of(v: &Value) -> String {
    v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id in {v}"))
        .to_owned()
}

fn hook(api: &Api, url: &str, events: Value, secret: &str) -> String {
    id_of(
        &api.post(
            "/v1/webhooks",
            &json!({"url": url, "events": events, "secret": secret}),
        )
        .expect(201, "register a webhook"),
    )
}

#[test]
fn webhooks_see_a_sandbox_life_and_a_run_signed_in_order_and_retried() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    // Bad registrations say what to fix.
    for (body, needle) in [
        (
            json!({"url": "ftp://x/", "events": ["*"], "secret": "12345678"}),
            "http",
        ),
        (
            json!({"url": "http://127.0.0.1:1/", "events": ["sandbox.exploded"], "secret": "12345678"}),
            "unknown event type",
        ),
        (
            json!({"url": "http://127.0.0.1:1/", "events": [], "secret": "12345678"}),
            "at least one",
        ),
        (
            json!({"url": "http://127.0.0.1:1/", "events": ["*"], "secret": "short"}),
            "secret",
        ),
        (
            json!({"url": "http://u:p@127.0.0.1:1/", "events": ["*"], "secret": "12345678"}),
            "credentials",
        ),
    ] {
        let m = api
            .post("/v1/webhooks", &body)
            .expect_error(400, "bad_request", "a bad webhook");
        assert!(m.contains(needle), "{m}");
    }

    let ok = Receiver::start(Mode::Ok);
    let flaky = Receiver::start(Mode::FailFirst(2));
    let secret = "whsec-test-0123456789";
    let hook_id = hook(&api, &ok.url, json!(["sandbox.*", "run.committed"]), secret);
    hook(
        &api,
        &flaky.url,
        json!(["sandbox.created"]),
        "another-secret",
    );
    let listed = api.get("/v1/webhooks").expect(200, "list webhooks");
    assert_eq!(listed["webhooks"].as_array().unwrap().len(), 2);
    assert!(
        !listed.to_string().contains(secret),
        "the secret is never shown: {listed}"
    );

    // A sandbox's whole life.
    let sb = id_of(&api.create_sandbox(&json!({"ttl_s": 600})));
    assert_eq!(api.sh(&sb, "echo hi"), "hi\n");
    api.post_empty(&format!("/v1/sandboxes/{sb}/pause"))
        .expect(200, "pause");
    api.post_empty(&format!("/v1/sandboxes/{sb}/resume"))
        .expect(200, "resume");
    let snap = id_of(
        &api.post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
            .expect(201, "snapshot"),
    );
    let fork = api
        .post(&format!("/v1/sandboxes/{sb}/fork"), &json!({"count": 1}))
        .expect(201, "fork");
    let child = id_of(&fork["sandboxes"][0]);
    api.delete(&format!("/v1/sandboxes/{child}"))
        .expect(204, "delete the child");
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete");
    // One paused by its idle policy, then expired by its TTL.
    let short = id_of(&api.create_sandbox(&json!({"ttl_s": 6, "idle_timeout_s": 1})));
    // A run's commit.
    let vol = id_of(
        &api.post("/v1/volumes", &json!({"name": "evt"}))
            .expect(201, "volume"),
    );
    let run = api
        .post(
            &format!("/v1/volumes/{vol}/run"),
            &json!({"shell": "echo a > a.txt; echo b > b.txt"}),
        )
        .expect(200, "run");
    let call = run["call_id"].as_str().unwrap().to_owned();

    wait_for(Duration::from_secs(60), "every event delivered", || {
        let t = types_of(&ok.events(), &short);
        (t.last().map(String::as_str) == Some("sandbox.expired")).then_some(())
    });
    let events = ok.events();
    for d in ok.deliveries() {
        check_signature(&d, secret);
    }
    let seqs: Vec<&str> = events.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "in order, once each: {seqs:?}"
    );
    assert!(events
        .iter()
        .all(|e| e["tenant"] == "default" && e["at"].as_str().unwrap().ends_with('Z')));
    assert_eq!(
        types_of(&events, &sb),
        [
            "sandbox.created",
            "sandbox.paused",
            "sandbox.resumed",
            "sandbox.snapshotted",
            "sandbox.deleted"
        ],
        "{events:#?}"
    );
    assert_eq!(
        types_of(&events, &child),
        ["sandbox.forked", "sandbox.deleted"]
    );
    assert_eq!(
        types_of(&events, &short),
        ["sandbox.created", "sandbox.paused", "sandbox.expired"]
    );
    let find = |subject: &str, ty: &str| -> Value {
        events
            .iter()
            .find(|e| e["subject"] == subject && e["type"] == ty)
            .cloned()
            .unwrap_or_else(|| panic!("no {ty} of {subject}"))
    };
    assert_eq!(find(&sb, "sandbox.paused")["data"]["reason"], "explicit");
    assert_eq!(find(&short, "sandbox.paused")["data"]["reason"], "idle");
    assert_eq!(
        find(&sb, "sandbox.snapshotted")["data"]["snapshot"],
        snap.as_str()
    );
    assert_eq!(find(&child, "sandbox.forked")["data"]["from"], sb.as_str());
    assert!(
        find(&sb, "sandbox.deleted")["data"]["usage"]["active_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    let committed = find(&call, "run.committed");
    assert_eq!(committed["data"]["volume"], vol.as_str());
    assert_eq!(committed["data"]["added"], 2);
    assert_eq!(committed["data"]["committed"], true);
    assert_eq!(committed["data"]["conflicts"], json!([]));

    // The receiver that failed twice got every create in the end, the first one three times.
    wait_for(
        Duration::from_secs(30),
        "the flaky receiver catches up",
        || {
            let got = flaky.deliveries();
            let ids: std::collections::BTreeSet<&str> =
                got.iter().map(|d| d.event_id.as_str()).collect();
            (ids.len() == 2).then_some(())
        },
    );
    let got = flaky.deliveries();
    assert_eq!(got[0].event_id, got[1].event_id);
    assert_eq!(
        got[1].event_id, got[2].event_id,
        "retried until it answered 200"
    );
    assert!(
        got[2].at - got[0].at >= Duration::from_millis(1400),
        "with backoff"
    );
    let created: Vec<String> = got[2..].iter().map(|d| d.event_id.clone()).collect();
    assert!(
        created.windows(2).all(|w| w[0] < w[1]),
        "per-webhook order: {created:?}"
    );

    api.delete(&format!("/v1/webhooks/{hook_id}"))
        .expect(204, "remove a webhook");
    api.delete(&format!("/v1/webhooks/{hook_id}"))
        .expect_error(404, "not_found", "again");
    let before = ok.deliveries().len();
    let sb2 = id_of(&api.create_sandbox(&json!({})));
    api.delete(&format!("/v1/sandboxes/{sb2}"))
        .expect(204, "delete");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        ok.deliveries().len(),
        before,
        "a removed webhook gets nothing more"
    );
}

#[test]
fn a_hanging_receiver_does_not_slow_the_api() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let time_create = || {
        let t = Instant::now();
        let id = id_of(&api.create_sandbox(&json!({})));
        let took = t.elapsed();
        api.delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete");
        took
    };
    let base = (0..3).map(|_| time_create()).min().unwrap();
    let hang = Receiver::start(Mode::Hang);
    let ok = Receiver::start(Mode::Ok);
    hook(&api, &hang.url, json!(["*"]), "hang-secret-123");
    hook(&api, &ok.url, json!(["*"]), "ok-secret-1234");
    time_create();
    wait_for(
        Duration::from_secs(10),
        "the hanging receiver holds a delivery",
        || (!hang.deliveries().is_empty()).then_some(()),
    );
    let slow = (0..3).map(|_| time_create()).max().unwrap();
    assert!(
        slow < base * 3 + Duration::from_millis(500),
        "a create took {slow:?} while a receiver hung (without: {base:?})"
    );
    // The other webhook is not held up either: it has all 8 events (4 creates, 4 deletes).
    wait_for(
        Duration::from_secs(10),
        "the healthy receiver gets every event",
        || (ok.events().len() == 8).then_some(()),
    );
    let held = hang.deliveries();
    assert!(
        held.iter().all(|d| d.event_id == held[0].event_id),
        "the hanging webhook retries its first event and sends nothing after it"
    );
}

// ---- the SSE stream ----

/// Reads SSE events from `/v1/events` on a thread: (id, event JSON).
fn follow(api: &Api, last_event_id: Option<&str>) -> Arc<Mutex<Vec<(String, Value)>>> {
    let mut headers = vec![("Accept", "text/event-stream")];
    if let Some(id) = last_event_id {
        headers.push(("Last-Event-ID", id));
    }
    let (status, h, body) = api
        .with_timeout(Duration::from_secs(600))
        .open("GET", "/v1/events", &headers, ())
        .expect("open the stream");
    assert_eq!(status, 200);
    assert_eq!(h["content-type"], "text/event-stream");
    let out: Arc<Mutex<Vec<(String, Value)>>> = Default::default();
    let out2 = out.clone();
    std::thread::spawn(move || {
        let mut r = BufReader::new(body);
        let (mut id, mut data) = (String::new(), String::new());
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end_matches('\n');
            if let Some(v) = line.strip_prefix("id: ") {
                id = v.to_owned();
            } else if let Some(v) = line.strip_prefix("data: ") {
                data = v.to_owned();
            } else if line.is_empty() && !data.is_empty() {
                let e: Value = serde_json::from_str(&data).unwrap();
                assert_eq!(e["id"], id.as_str());
                out2.lock().unwrap().push((id.clone(), e));
                data.clear();
            }
        }
    });
    out
}

#[test]
fn the_stream_resumes_across_a_restart_and_tenants_see_only_their_own() {
    become_subreaper();
    let mut srv = Server::start();
    let api = srv.api();
    let (other, _) = srv.create_tenant("evt-other");
    srv.remember_key(other.key().unwrap());
    let mine = follow(&api, None);
    let theirs = follow(&other, None);
    let a = id_of(&api.create_sandbox(&json!({})));
    let b = id_of(&other.create_sandbox(&json!({})));
    api.post_empty(&format!("/v1/sandboxes/{a}/pause"))
        .expect(200, "pause");
    wait_for(Duration::from_secs(10), "both streams", || {
        (mine.lock().unwrap().len() == 2 && !theirs.lock().unwrap().is_empty()).then_some(())
    });
    let seen: Vec<(String, Value)> = mine.lock().unwrap().clone();
    assert!(
        seen.iter().all(|(_, e)| e["subject"] == a.as_str()),
        "{seen:?}"
    );
    assert!(theirs
        .lock()
        .unwrap()
        .iter()
        .all(|(_, e)| e["subject"] == b.as_str() && e["tenant"] == "evt-other"));
    let last = seen.last().unwrap().0.clone();

    // While nobody listens, more happens, across a restart of the server.
    api.post_empty(&format!("/v1/sandboxes/{a}/resume"))
        .expect(200, "resume");
    srv.restart();
    let api = srv.api();
    api.post_empty(&format!("/v1/sandboxes/{a}/snapshots"))
        .expect(201, "snapshot");
    let resumed = follow(&api, Some(&last));
    api.delete(&format!("/v1/sandboxes/{a}"))
        .expect(204, "delete");
    wait_for(Duration::from_secs(10), "the rest of the events", || {
        (resumed.lock().unwrap().len() == 3).then_some(())
    });
    std::thread::sleep(Duration::from_millis(500));
    let rest: Vec<(String, Value)> = resumed.lock().unwrap().clone();
    let types: Vec<&str> = rest
        .iter()
        .map(|(_, e)| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        ["sandbox.resumed", "sandbox.snapshotted", "sandbox.deleted"],
        "no gap, no duplicate"
    );
    let mut ids: Vec<&str> = seen.iter().chain(&rest).map(|(i, _)| i.as_str()).collect();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n);
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    // The other tenant's stream, from the start, has only its own.
    let all_theirs = follow(&srv.api_with(other.key().unwrap()), Some("0"));
    wait_for(
        Duration::from_secs(10),
        "the other tenant's backlog",
        || (!all_theirs.lock().unwrap().is_empty()).then_some(()),
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(all_theirs
        .lock()
        .unwrap()
        .iter()
        .all(|(_, e)| e["tenant"] == "evt-other"));
    // Filters and bad resumes.
    api.get("/v1/events?types=nope")
        .expect_error(400, "bad_request", "bad types");
    api.request("GET", "/v1/events", &[("Last-Event-ID", "garbage")], ())
        .expect_error(400, "bad_request", "bad Last-Event-ID");
}

#[test]
fn a_fork_that_fails_half_way_announces_none_of_its_children() {
    become_subreaper();
    // Memory for the parent and one child of 256 MB, not two: of a fork of two, one child
    // starts and the other is refused, so the fork undoes the one that started.
    let srv = Server::start_with(&["--quota-memory-mb", "600"]);
    let api = srv.api();
    let seen = follow(&api, None);
    let parent = id_of(&api.create_sandbox(&json!({"memory_mb": 256})));
    let r = api.post(
        &format!("/v1/sandboxes/{parent}/fork"),
        &json!({"count": 2}),
    );
    assert_eq!(
        r.status,
        429,
        "the second child is past the quota: {}",
        r.text()
    );
    assert_eq!(
        api.get("/v1/sandboxes").json()["sandboxes"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "all or none: the child that started is gone"
    );
    // A fork that fits, whose event ends what this test waits for.
    let child = id_of(
        &api.post(
            &format!("/v1/sandboxes/{parent}/fork"),
            &json!({"count": 1}),
        )
        .expect(201, "a fork within the quota")["sandboxes"][0],
    );
    wait_for(Duration::from_secs(10), "the fork's event", || {
        seen.lock()
            .unwrap()
            .iter()
            .any(|(_, e)| e["subject"] == child.as_str())
            .then_some(())
    });
    std::thread::sleep(Duration::from_millis(300));
    let got: Vec<(String, String)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(_, e)| {
            (
                e["type"].as_str().unwrap().to_owned(),
                e["subject"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("sandbox.created".to_owned(), parent.clone()),
            ("sandbox.forked".to_owned(), child.clone()),
        ],
        "no sandbox.deleted for a child that never had sandbox.forked"
    );
}

// ---- usage figures ----

fn usage_of(api: &Api, sb: &str) -> Value {
    api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get")["usage"].clone()
}

fn near(v: &Value, want: f64, tol: f64, what: &str) {
    let got = v.as_f64().unwrap_or_else(|| panic!("{what}: {v}"));
    assert!(
        (got - want).abs() <= tol,
        "{what}: {got} (want {want} ± {tol})"
    );
}

#[test]
fn usage_splits_active_idle_and_paused_time() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let before = api.get("/v1/usage").expect(200, "usage");
    let sb = id_of(&api.create_sandbox(&json!({})));
    // 2 s of calls, 2 s idle, a short call, 2 s paused, then 1 s idle.
    api.sh(&sb, "sleep 2");
    std::thread::sleep(Duration::from_secs(2));
    let u = usage_of(&api, &sb);
    near(&u["active_s"], 2.0, 0.6, "active after a 2 s call");
    near(&u["idle_s"], 2.0, 0.6, "idle after 2 s without calls");
    let f1 = u["idle_fraction"].as_f64().unwrap();
    api.sh(&sb, "true");
    api.post_empty(&format!("/v1/sandboxes/{sb}/pause"))
        .expect(200, "pause");
    std::thread::sleep(Duration::from_secs(2));
    api.post_empty(&format!("/v1/sandboxes/{sb}/resume"))
        .expect(200, "resume");
    std::thread::sleep(Duration::from_secs(1));
    let u = usage_of(&api, &sb);
    near(&u["paused_s"], 2.0, 0.6, "paused");
    near(&u["idle_s"], 3.0, 0.8, "idle, paused time not counted");
    near(&u["active_s"], 2.0, 0.8, "active");
    assert!(
        u["idle_fraction"].as_f64().unwrap() > f1,
        "idle fraction moves: {u}"
    );
    assert!(u["cpu_ms"].as_u64().is_some());
    // Gaps between calls: ~2 s (sleep), then ~3 s (pause and resume; resume is a call).
    let gaps = u["call_gaps"].as_array().unwrap();
    let total: u64 = gaps.iter().map(|g| g["count"].as_u64().unwrap()).sum();
    assert!(total >= 2, "{u}");
    let in_2_to_5: u64 = gaps
        .iter()
        .filter(|g| g["le"] == 5.0)
        .map(|g| g["count"].as_u64().unwrap())
        .sum();
    assert!(
        in_2_to_5 >= 1,
        "a gap of about 2-3 s lands in the (2, 5] bucket: {u}"
    );
    assert!(gaps.last().unwrap()["le"].is_null());

    let metrics = srv.anon().get("/metrics");
    assert_eq!(metrics.status, 200);
    let text = metrics.text();
    for series in [
        "locker_sandbox_seconds_total{tenant=\"default\",phase=\"active\"}",
        "locker_sandbox_seconds_total{tenant=\"default\",phase=\"paused\"}",
        "locker_sandbox_idle_fraction{tenant=\"default\"}",
        "locker_sandbox_cpu_seconds_total{tenant=\"default\"}",
        "locker_sandbox_call_gap_seconds_bucket{tenant=\"default\",le=\"5\"}",
        "locker_sandbox_call_gap_seconds_count{tenant=\"default\"}",
    ] {
        assert!(text.contains(series), "{series} in /metrics:\n{text}");
    }

    // The tenant's totals keep a deleted sandbox's figures.
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete");
    let after = api.get("/v1/usage").expect(200, "usage");
    let grew = |k: &str| after[k].as_f64().unwrap() - before[k].as_f64().unwrap();
    near(&json!(grew("active_s")), 2.0, 0.8, "tenant active_s");
    near(&json!(grew("paused_s")), 2.0, 0.6, "tenant paused_s");
    assert!(grew("idle_s") >= 2.5, "{after}");
    assert!(after["idle_fraction"].as_f64().unwrap() > 0.3, "{after}");
}
