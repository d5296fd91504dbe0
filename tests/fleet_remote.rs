//! Fleet mode, sandboxes on nodes (issue 25, points 2 and 3; `FLEET.md` §5.2 tests 2, 3 in
//! part and 5): `locker node` processes in network namespaces of their own run the engine
//! behind their listener; a control plane on Postgres places sandboxes on them within their
//! capacity and routes every call about a sandbox to its node; a node's death loses its
//! sandboxes (never served twice), and a node that comes back fences itself and destroys
//! what is no longer its own.

use std::time::{Duration, Instant};

use locker_tests::fabric::{
    admin_cli, fleet_node, fleet_nodes, fleet_token, join_nodes, Fabric, NodeProc,
};
use locker_tests::fleet::placed_on;
use locker_tests::postgres::cluster;
use locker_tests::server::{Api, Resp};
use locker_tests::streams::{browser_terminal, read_exit_frame, read_until, ws_connect};
use locker_tests::wait_for;
use serde_json::{json, Value};

/// The lease the server keeps (`fleet::LEASE`).
const LEASE: Duration = Duration::from_secs(3);

fn create(api: &Api) -> Resp {
    api.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256}),
    )
}

/// The headers of an E2B call with `api`'s key.
fn e2b_headers(api: &Api) -> [(&'static str, &str); 2] {
    [
        ("X-API-KEY", api.key().unwrap()),
        ("Content-Type", "application/json"),
    ]
}

/// A TLS client of a node's listener with `cert`/`key` (or none), ignoring the server's
/// name: did it get an HTTP answer?
fn node_answers(addr: &str, cert: Option<(&std::path::Path, &std::path::Path)>) -> bool {
    let mut cmd = std::process::Command::new("curl");
    cmd.args([
        "-sk",
        "--http2",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "5",
    ]);
    if let Some((c, k)) = cert {
        cmd.arg("--cert").arg(c).arg("--key").arg(k);
    }
    let out = cmd
        .arg(format!("https://{addr}/v1/sandboxes"))
        .output()
        .expect("run curl");
    let code = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    code != "000" && !code.is_empty()
}

#[test]
fn sandboxes_are_placed_within_capacity_and_every_call_reaches_their_node() {
    let fab = Fabric::new(2);
    let (db, pg_url) = cluster().new_database();
    let srv = fab.control(
        &pg_url,
        &[
            // A tenant may use 1 GiB of sandbox memory across the fleet.
            "--quota-memory-mb",
            "1024",
        ],
    );
    let (admin, api) = (srv.admin(), srv.api());
    let token = |admin: &Api| {
        let t = fleet_token(admin, 600);
        (
            t["url"].as_str().unwrap().to_owned(),
            t["token"].as_str().unwrap().to_owned(),
        )
    };
    // Node a takes 2 sandboxes, node b 1.
    let mut a = NodeProc::new(0, "a");
    let mut b = NodeProc::new(1, "b");
    let (url, t) = token(&admin);
    a.start(&fab, Some((&url, &t)), 2);
    let (url, t) = token(&admin);
    b.start(&fab, Some((&url, &t)), 1);
    wait_for(Duration::from_secs(60), "both nodes alive", || {
        let l = fleet_nodes(&admin);
        (l.len() == 2 && l.iter().all(|n| n["alive"] == true)).then_some(())
    });

    // Only the control plane's certificate opens a node: none, or another node's, do not.
    let a_addr = format!("{}:{}", fab.node_ip(0), a.port);
    let b_fleet = b.data_dir().join("fleet");
    assert!(
        !node_answers(&a_addr, None),
        "a node answered without a certificate"
    );
    assert!(
        !node_answers(
            &a_addr,
            Some((&b_fleet.join("node.crt"), &b_fleet.join("node.key")))
        ),
        "a node answered another node's certificate"
    );

    // Eight creators at once for three slots: three sandboxes, two on a and one on b, and
    // five clear refusals; never over capacity.
    let answers: Vec<Resp> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8).map(|_| s.spawn(|| create(&api))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let made: Vec<&Resp> = answers.iter().filter(|r| r.status == 201).collect();
    let refused: Vec<&Resp> = answers.iter().filter(|r| r.status == 429).collect();
    assert_eq!(
        (made.len(), refused.len()),
        (3, 5),
        "{:?}",
        answers
            .iter()
            .map(|r| (r.status, r.text()))
            .collect::<Vec<_>>()
    );
    for r in &refused {
        assert!(r.text().contains("no capacity"), "{}", r.text());
    }
    let mut on: Vec<(String, String)> = made
        .iter()
        .map(|r| (placed_on(r), r.json()["id"].as_str().unwrap().to_owned()))
        .collect();
    on.sort();
    let names: Vec<&str> = on.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["a", "a", "b"], "{on:?}");
    // The tenant's quotas count its sandboxes on every node; bad input is the handler's 400.
    let m = api
        .post(
            "/v1/sandboxes",
            &json!({"runtime": "jail", "memory_mb": 512}),
        )
        .expect_error(
            429,
            "quota_exceeded",
            "past the memory quota across the fleet",
        );
    assert!(m.contains("768 MB in use"), "{m}");
    api.post("/v1/sandboxes", &json!({"memory_mb": 1}))
        .expect_error(400, "bad_request", "a memory_mb out of range");
    let l = fleet_nodes(&admin);
    assert_eq!(fleet_node(&l, "a")["reserved"]["slots"], 2);
    assert_eq!(fleet_node(&l, "b")["reserved"]["slots"], 1);
    assert_eq!(fleet_node(&l, "b")["reserved"]["memory_mb"], 256);

    // Every call reaches the sandbox's node: exec, files, the sandbox itself; the machine
    // lives in the node's data dir, not the control plane's.
    for (n, id) in &on {
        let out = api.sh(
            id,
            "echo hello from $(cat /etc/hostname 2>/dev/null || echo box)",
        );
        assert!(out.starts_with("hello from"), "{out}");
        let body = format!("written through control to node {n}");
        api.put(
            &format!("/v1/sandboxes/{id}/files?path=/tmp/f.txt"),
            body.as_bytes(),
        )
        .expect(200, "write a file");
        assert_eq!(api.read_file(id, "/tmp/f.txt").text(), body);
        let v = api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get");
        assert_eq!(v["state"], "running", "{v}");
        let dir = if n == "a" { a.data_dir() } else { b.data_dir() };
        assert!(dir.join("sandboxes").join(id).exists(), "{id} not on {n}");
        assert!(!srv.sandboxes_dir().join(id).exists());
    }
    // The list has them all, each with its node.
    let list = api.get("/v1/sandboxes").expect(200, "list");
    assert_eq!(list["total"], 3, "{list}");
    for (_, id) in &on {
        let s = list["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == id.as_str())
            .unwrap_or_else(|| panic!("{id} not listed: {list}"));
        assert!(s["node"].as_str().unwrap().starts_with("node_"), "{s}");
    }
    // Pages hold what they say across nodes: one at a time, newest first, each once.
    let mut paged = Vec::new();
    let mut offset = Some(0u64);
    while let Some(o) = offset {
        let page = api
            .get(&format!("/v1/sandboxes?limit=1&order=newest&offset={o}"))
            .expect(200, "a page");
        assert_eq!(page["total"], 3, "{page}");
        let items = page["sandboxes"].as_array().unwrap();
        assert_eq!(items.len(), 1, "{page}");
        paged.push((
            items[0]["created_at"].as_str().unwrap().to_owned(),
            items[0]["id"].as_str().unwrap().to_owned(),
        ));
        offset = page["next_offset"].as_u64();
        assert!(paged.len() <= 3, "{page}");
    }
    assert!(
        paged.windows(2).all(|w| w[0].0 >= w[1].0),
        "newest first: {paged:?}"
    );
    let mut ids: Vec<&str> = paged.iter().map(|(_, i)| i.as_str()).collect();
    ids.sort_unstable();
    let mut want: Vec<&str> = on.iter().map(|(_, i)| i.as_str()).collect();
    want.sort_unstable();
    assert_eq!(ids, want);
    // Another tenant reaches none of them.
    let (other, _) = srv.create_tenant("fleet-other");
    for (_, id) in &on {
        other.get(&format!("/v1/sandboxes/{id}")).expect_error(
            404,
            "not_found",
            "another tenant's sandbox",
        );
        other
            .post(&format!("/v1/sandboxes/{id}/exec"), &json!({"shell": "id"}))
            .expect_error(404, "not_found", "exec in another tenant's sandbox");
    }

    let (_, any) = &on[0];
    // The terminal (a WebSocket) reaches the node's shell through control.
    let mut ws = ws_connect(&srv.url, api.key(), &format!("/v1/sandboxes/{any}/pty"))
        .unwrap_or_else(|(s, e)| panic!("terminal through control: {s} {e}"));
    let mut seen = String::new();
    ws.send(tungstenite::Message::binary(
        b"echo pty-$((6*7)); cat /tmp/f.txt; echo\n".to_vec(),
    ))
    .unwrap();
    read_until(&mut ws, "pty-42", &mut seen);
    read_until(&mut ws, "written through control to node", &mut seen);
    ws.send(tungstenite::Message::binary(b"exit\n".to_vec()))
        .unwrap();
    assert_eq!(read_exit_frame(&mut ws, &mut seen)["exit_code"], 0);
    // A browser's terminal (the dashboard): a ticket minted through control opens the
    // node's shell once, from control's own origin, without the key.
    let browser = browser_terminal(&api, any);
    browser(&srv.url).expect("the browser's terminal opens");
    assert_eq!(
        browser(&srv.url).err(),
        Some(401),
        "a used ticket opened the terminal again"
    );

    // The nodes' own events join the fleet's stream (what `GET /v1/events` and webhooks
    // read), once each, naming their node.
    for (n, id) in &on {
        let row = wait_for(
            Duration::from_secs(10),
            "the node's event in the fleet",
            || {
                let r = cluster().psql(
                    &db,
                    &format!(
                        "SELECT count(*) || '|' || COALESCE(min(data::json->>'node_name'), '') FROM events \
                     WHERE kind = 'sandbox.created' AND subject = '{id}'"
                    ),
                );
                (!r.trim().starts_with("0|")).then(|| r.trim().to_owned())
            },
        );
        assert_eq!(row, format!("1|{n}"), "{id}");
    }

    // Deleting gives the slot back: the next create goes where there is room (b).
    let on_b = on.iter().find(|(n, _)| n == "b").unwrap().1.clone();
    assert_eq!(api.delete(&format!("/v1/sandboxes/{on_b}")).status, 204);
    assert!(!b.data_dir().join("sandboxes").join(&on_b).exists());
    assert_eq!(
        fleet_node(&fleet_nodes(&admin), "b")["reserved"]["slots"],
        0
    );
    // A disk no node can grant (b has the room, not the disk): the fleet says so, as one
    // host does, before anything is reserved.
    let m = api
        .post(
            "/v1/sandboxes",
            &json!({"runtime": "jail", "memory_mb": 256, "disk_mb": 1_000_000}),
        )
        .expect_error(422, "unprocessable", "a disk larger than any node's");
    assert!(
        m.contains("more than any node of the fleet can hold now"),
        "{m}"
    );
    assert_eq!(
        fleet_node(&fleet_nodes(&admin), "b")["reserved"]["slots"],
        0
    );
    let again = create(&api);
    assert_eq!(again.status, 201, "{}", again.text());
    assert_eq!(placed_on(&again), "b");
    let on_b = again.json()["id"].as_str().unwrap().to_owned();

    // b's agent restarts (an upgrade, a crash) within its lease: its engine adopts the
    // machine, the sandbox keeps its files and answers; b is never declared dead.
    api.put(
        &format!("/v1/sandboxes/{on_b}/files?path=/tmp/kept.txt"),
        &b"before the restart"[..],
    )
    .expect(200, "write a file");
    b.stop();
    b.start(&fab, None, 1);
    wait_for(Duration::from_secs(20), "b answering again", || {
        (api.post(
            &format!("/v1/sandboxes/{on_b}/exec"),
            &json!({"cmd": ["true"]}),
        )
        .status
            == 200)
            .then_some(())
    });
    assert_eq!(
        api.read_file(&on_b, "/tmp/kept.txt").text(),
        "before the restart"
    );
    assert_eq!(
        fleet_node(&fleet_nodes(&admin), "b")["epoch"],
        1,
        "b was declared dead"
    );

    let lost: Vec<String> = on
        .iter()
        .filter(|(n, _)| n == "a")
        .map(|(_, id)| id.clone())
        .collect();
    // A TTL or state changed through control is what the list shows (the view kept of a
    // node's sandbox): the API's ttl and pause answer the sandbox, E2B's timeout does not.
    let listed = |id: &str| -> Value {
        let list = api.get("/v1/sandboxes").expect(200, "list");
        list["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == id)
            .unwrap_or_else(|| panic!("{id} not listed: {list}"))
            .clone()
    };
    let was = listed(&on_b)["expires_at"].clone();
    let anon = api.with_key(None);
    let e2b = e2b_headers(&api);
    let r = anon.request(
        "POST",
        &format!("/sandboxes/{on_b}/timeout"),
        &e2b,
        r#"{"timeout": 60}"#,
    );
    assert_eq!(r.status, 204, "E2B's timeout on a node: {}", r.text());
    let now = listed(&on_b);
    assert_ne!(now["expires_at"], was, "{now}");
    assert_eq!(
        now["expires_at"],
        api.get(&format!("/v1/sandboxes/{on_b}")).json()["expires_at"]
    );
    api.post(&format!("/v1/sandboxes/{on_b}/pause"), &json!({}))
        .expect(200, "pause through control");
    assert_eq!(listed(&on_b)["state"], "paused");
    api.post(&format!("/v1/sandboxes/{on_b}/resume"), &json!({}))
        .expect(200, "resume through control");
    assert_eq!(listed(&on_b)["state"], "running");
    let short = api
        .post(
            &format!("/v1/sandboxes/{}/ttl", lost[1]),
            &json!({"ttl_s": 10}),
        )
        .expect(200, "a short TTL through control");
    assert_eq!(listed(&lost[1])["expires_at"], short["expires_at"]);

    // Node a dies: within the lease (and the sweep), its sandboxes are lost, never
    // answered by anyone; b's keep answering.
    a.signal(libc::SIGKILL);
    let killed = Instant::now();
    wait_for(Duration::from_secs(10), "a's sandboxes lost", || {
        lost.iter()
            .all(|id| api.get(&format!("/v1/sandboxes/{id}")).json()["state"] == "lost")
            .then_some(())
    });
    assert!(
        killed.elapsed() < LEASE + Duration::from_secs(3),
        "lost after {:?}",
        killed.elapsed()
    );
    api.post(
        &format!("/v1/sandboxes/{}/exec", lost[0]),
        &json!({"shell": "true"}),
    )
    .expect_error(410, "gone", "exec in a lost sandbox");
    assert_eq!(api.sh(&on_b, "echo still"), "still\n");
    assert_eq!(
        fleet_node(&fleet_nodes(&admin), "a")["reserved"]["slots"],
        0
    );
    // The lost sandbox whose TTL passes is ended by the fleet (its node is away): gone
    // from the list and the API, with its `sandbox.expired` event; the other stays lost.
    wait_for(
        Duration::from_secs(20),
        "the expired lost sandbox ended",
        || (api.get(&format!("/v1/sandboxes/{}", lost[1])).status == 404).then_some(()),
    );
    assert!(
        killed.elapsed() >= Duration::from_secs(9),
        "ended {:?} after the kill, before its TTL",
        killed.elapsed()
    );
    let list = api.get("/v1/sandboxes").expect(200, "list");
    assert!(!list.to_string().contains(lost[1].as_str()), "{list}");
    let events = cluster().psql(
        &db,
        &format!(
            "SELECT count(*) FROM events WHERE kind = 'sandbox.expired' AND subject = '{}'",
            lost[1]
        ),
    );
    assert_eq!(events.trim(), "1", "the expired event");
    assert_eq!(listed(&lost[0])["state"], "lost");
    let (lost, expired) = (vec![lost[0].clone()], lost[1].clone());

    // a comes back (the same data dir, no token): its engine adopts its machines, its
    // first beat is refused (its epoch moved on), it returns and destroys what the fleet
    // no longer gives it; then it takes new sandboxes at its new epoch.
    a.start(&fab, None, 2);
    wait_for(Duration::from_secs(60), "a back and empty", || {
        let l = fleet_nodes(&admin);
        let n = fleet_node(&l, "a");
        let empty = lost
            .iter()
            .chain([&expired])
            .all(|id| !a.data_dir().join("sandboxes").join(id).exists());
        (n["alive"] == true && n["epoch"] == 2 && empty && n["report"]["sandboxes"] == 0)
            .then_some(())
    });
    assert!(a.log_text().contains("fenced"), "{}", a.log_text());
    for id in &lost {
        // Still lost to its caller (never served again), until deleted.
        assert_eq!(
            api.get(&format!("/v1/sandboxes/{id}")).json()["state"],
            "lost"
        );
        assert_eq!(api.delete(&format!("/v1/sandboxes/{id}")).status, 204);
        api.get(&format!("/v1/sandboxes/{id}")).expect_error(
            404,
            "not_found",
            "a deleted lost sandbox",
        );
    }
    let fresh = create(&api);
    assert_eq!(fresh.status, 201, "{}", fresh.text());
    assert_eq!(placed_on(&fresh), "a");
    let fresh = fresh.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(api.sh(&fresh, "echo epoch two"), "epoch two\n");

    // What a node changes by itself shows in the list too: its idle pause, and the resume
    // a call makes there (its events reach control, which reads the view again).
    let idle = api.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256, "idle_timeout_s": 2}),
    );
    assert_eq!(
        (idle.status, placed_on(&idle)),
        (201, "a".to_owned()),
        "{}",
        idle.text()
    );
    let idle = idle.json()["id"].as_str().unwrap().to_owned();
    let t0 = Instant::now();
    wait_for(Duration::from_secs(30), "the idle pause listed", || {
        (listed(&idle)["state"] == "paused").then_some(())
    });
    eprintln!("the idle pause listed {:?} after the create", t0.elapsed());
    assert_eq!(api.sh(&idle, "echo awake"), "awake\n");
    wait_for(Duration::from_secs(15), "the resume listed", || {
        (listed(&idle)["state"] == "running").then_some(())
    });
    assert_eq!(api.delete(&format!("/v1/sandboxes/{idle}")).status, 204);

    // A sandbox a node runs that no placement names (its control plane died between the
    // node's create and the record of it; here the record is removed by hand) is destroyed
    // on its node after two sightings 10 s apart.
    cluster().psql(
        &db,
        &format!(
            "DELETE FROM placements WHERE sandbox_id = '{on_b}'; UPDATE nodes SET \
             reserved_slots = reserved_slots - 1, reserved_memory_mb = reserved_memory_mb - 256 \
             WHERE name = 'b'"
        ),
    );
    let t0 = Instant::now();
    wait_for(Duration::from_secs(40), "the orphan destroyed on b", || {
        (!b.data_dir().join("sandboxes").join(&on_b).exists()).then_some(())
    });
    assert!(
        t0.elapsed() >= Duration::from_secs(9),
        "destroyed after {:?}: sooner than two sightings",
        t0.elapsed()
    );
    assert!(
        b.log_text().contains("no placement for"),
        "{}",
        b.log_text()
    );
    assert_eq!(api.delete(&format!("/v1/sandboxes/{fresh}")).status, 204);
    let l = fleet_nodes(&admin);
    assert_eq!(fleet_node(&l, "a")["reserved"]["slots"], 0);
    assert_eq!(fleet_node(&l, "b")["reserved"]["slots"], 0);
}

/// Snapshots stay on the node that took them and the fleet knows where: listed by control,
/// started from on that node only (503 while it is dead), deleted there; a fork's children
/// are placed on their parent's node before they are made, all or none.
#[test]
fn snapshots_and_forks_of_a_node_sandbox_stay_on_its_node() {
    let fab = Fabric::new(2);
    let (_db, pg_url) = cluster().new_database();
    let srv = fab.control(&pg_url, &[]);
    let (admin, api) = (srv.admin(), srv.api());
    let join = |n: &mut NodeProc, name: &str, i: usize| {
        let t = fleet_token(&admin, 600);
        let (url, token) = (t["url"].as_str().unwrap(), t["token"].as_str().unwrap());
        n.start(&fab, Some((url, token)), 3);
        wait_for(Duration::from_secs(60), "the node alive", || {
            let l = fleet_nodes(&admin);
            (l.len() == i + 1 && fleet_node(&l, name)["alive"] == true).then_some(())
        });
    };
    // The parent on a (alone in the fleet when it is made); then b joins, with room.
    let mut a = NodeProc::new(0, "a");
    join(&mut a, "a", 0);
    let parent = create(&api);
    assert_eq!(
        (parent.status, placed_on(&parent)),
        (201, "a".to_owned()),
        "{}",
        parent.text()
    );
    let parent = parent.json()["id"].as_str().unwrap().to_owned();
    let mut b = NodeProc::new(1, "b");
    join(&mut b, "b", 1);
    api.sh(&parent, "echo the point > /root/mark");

    // A snapshot: taken on a, its files there, listed by control like one host's.
    let snap = api
        .post(&format!("/v1/sandboxes/{parent}/snapshots"), &json!({}))
        .expect(201, "a snapshot of a node's sandbox");
    let snap_id = snap["id"].as_str().unwrap().to_owned();
    assert_eq!(snap["sandbox_id"], parent.as_str(), "{snap}");
    assert!(a.data_dir().join("snapshots").join(&snap_id).is_dir());
    assert!(!b.data_dir().join("snapshots").join(&snap_id).exists());
    let list = api.get("/v1/snapshots").expect(200, "the snapshots");
    let listed = &list["snapshots"].as_array().unwrap();
    assert_eq!(listed.len(), 1, "{list}");
    for k in [
        "id",
        "sandbox_id",
        "template_digest",
        "runtime",
        "size_bytes",
        "created_at",
    ] {
        assert_eq!(listed[0][k], snap[k], "{k}: {list}");
    }
    let (other, _) = srv.create_tenant("fleet-other");
    other
        .delete(&format!("/v1/snapshots/{snap_id}"))
        .expect_error(404, "not_found", "another tenant's snapshot");
    assert_eq!(other.get("/v1/snapshots").json()["snapshots"], json!([]));

    // E2B's snapshot of it too: kept on a, recorded as the node shows it, deleted there.
    let anon = api.with_key(None);
    let e2b = e2b_headers(&api);
    let r = anon.request(
        "POST",
        &format!("/sandboxes/{parent}/snapshots"),
        &e2b,
        "{}",
    );
    assert_eq!(r.status, 201, "E2B's snapshot on a node: {}", r.text());
    let e2b_snap = r.json()["snapshotID"].as_str().unwrap().to_owned();
    assert!(a.data_dir().join("snapshots").join(&e2b_snap).is_dir());
    let list = api.get("/v1/snapshots").expect(200, "the snapshots");
    let rec = list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == e2b_snap.as_str())
        .unwrap_or_else(|| panic!("E2B's snapshot not listed: {list}"))
        .clone();
    assert_eq!(
        (&rec["sandbox_id"], &rec["template_digest"]),
        (&json!(parent), &snap["template_digest"]),
        "{rec}"
    );
    let r = anon.request("DELETE", &format!("/templates/{e2b_snap}"), &e2b[..1], ());
    assert_eq!(r.status, 204, "E2B's delete: {}", r.text());
    assert!(!a.data_dir().join("snapshots").join(&e2b_snap).exists());
    assert_eq!(
        api.get("/v1/snapshots").json()["snapshots"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // A fork of 2: both children on a (never b, which has more room), each routed and
    // standing on the point; a is then full.
    let forked = api
        .post(
            &format!("/v1/sandboxes/{parent}/fork"),
            &json!({"count": 2}),
        )
        .expect(201, "a fork on a node");
    let children: Vec<String> = forked["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(children.len(), 2, "{forked}");
    for c in &children {
        assert!(
            a.data_dir().join("sandboxes").join(c).exists(),
            "{c} not on a"
        );
        assert_eq!(api.sh(c, "cat /root/mark"), "the point\n");
        let v = api
            .get(&format!("/v1/sandboxes/{c}"))
            .expect(200, "a child");
        assert_eq!(v["state"], "running", "{v}");
    }
    let l = fleet_nodes(&admin);
    assert_eq!(fleet_node(&l, "a")["reserved"]["slots"], 3);
    assert_eq!(fleet_node(&l, "b")["reserved"]["slots"], 0);
    assert_eq!(api.get("/v1/sandboxes").json()["total"], 3);
    // No room on a for one more: refused, saying where, with nothing made or reserved.
    let m = api
        .post(
            &format!("/v1/sandboxes/{parent}/fork"),
            &json!({"count": 1}),
        )
        .expect_error(429, "quota_exceeded", "a fork past its node's room");
    assert!(m.contains("parent's node"), "{m}");
    let l = fleet_nodes(&admin);
    assert_eq!(fleet_node(&l, "a")["reserved"]["slots"], 3);
    assert_eq!(fleet_node(&l, "b")["reserved"]["slots"], 0);
    assert_eq!(api.get("/v1/sandboxes").json()["total"], 3);
    // Bad input is the handler's.
    api.post(
        &format!("/v1/sandboxes/{parent}/fork"),
        &json!({"count": 0}),
    )
    .expect_error(400, "bad_request", "a fork of none");

    // A sandbox from the snapshot goes to a, where its files are, even with b emptier.
    assert_eq!(
        api.delete(&format!("/v1/sandboxes/{}", children[0])).status,
        204
    );
    let from = api.post(
        "/v1/sandboxes",
        &json!({"from_snapshot": snap_id, "ttl_s": 900}),
    );
    assert_eq!(
        (from.status, placed_on(&from)),
        (201, "a".to_owned()),
        "{}",
        from.text()
    );
    let from = from.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(api.sh(&from, "cat /root/mark"), "the point\n");
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{from}")).json()["memory_mb"],
        256,
        "the snapshot's sizes"
    );

    // Deleted through control: gone on a and from the list; a create from it is 404.
    assert_eq!(api.delete(&format!("/v1/snapshots/{snap_id}")).status, 204);
    assert!(!a.data_dir().join("snapshots").join(&snap_id).exists());
    assert_eq!(api.get("/v1/snapshots").json()["snapshots"], json!([]));
    api.post("/v1/sandboxes", &json!({"from_snapshot": snap_id}))
        .expect_error(404, "not_found", "a deleted snapshot");
    api.delete(&format!("/v1/snapshots/{snap_id}"))
        .expect_error(404, "not_found", "a snapshot deleted twice");

    // A snapshot whose node is dead: kept, not started elsewhere (its files are on a), and
    // a clear 503 while a is away.
    let snap2 = api
        .post(&format!("/v1/sandboxes/{from}/snapshots"), &json!({}))
        .expect(201, "another snapshot");
    let snap2 = snap2["id"].as_str().unwrap().to_owned();
    a.signal(libc::SIGKILL);
    wait_for(Duration::from_secs(10), "a declared dead", || {
        (fleet_node(&fleet_nodes(&admin), "a")["alive"] == false).then_some(())
    });
    let m = api
        .post("/v1/sandboxes", &json!({"from_snapshot": snap2}))
        .expect_error(503, "unavailable", "a snapshot on a dead node");
    assert!(m.contains("not alive"), "{m}");
    api.delete(&format!("/v1/snapshots/{snap2}")).expect_error(
        503,
        "unavailable",
        "deleting a snapshot on a dead node",
    );
    assert_eq!(
        api.get("/v1/snapshots").json()["snapshots"][0]["id"],
        snap2.as_str()
    );
    assert_eq!(
        fleet_node(&fleet_nodes(&admin), "b")["reserved"]["slots"],
        0
    );
}

/// A cordoned node (`locker fleet cordon`) takes no new sandbox, its own keep running and
/// answering, the fleet's 429 says a node is cordoned when the rest is full, and the node
/// takes sandboxes again once the cordon is lifted.
#[test]
fn a_cordoned_node_takes_no_new_sandboxes_and_keeps_its_own() {
    let fab = Fabric::new(2);
    let (_db, pg_url) = cluster().new_database();
    let srv = fab.control(&pg_url, &[]);
    let (admin, api) = (srv.admin(), srv.api());
    let mut nodes = join_nodes(&fab, &admin, &["a", "b"], 2);
    // One sandbox on a first (b cordoned for it), then a is cordoned through the CLI.
    admin
        .post("/v1/fleet/nodes/b/cordon", &json!({}))
        .expect(200, "cordon b");
    let on_a = create(&api);
    assert_eq!(
        (on_a.status, placed_on(&on_a)),
        (201, "a".to_owned()),
        "{}",
        on_a.text()
    );
    let on_a = on_a.json()["id"].as_str().unwrap().to_owned();
    admin
        .post("/v1/fleet/nodes/b/uncordon", &json!({}))
        .expect(200, "uncordon b");
    let cli = |args: &[&str]| {
        let (code, text) = admin_cli(&srv, args);
        assert_eq!(code, Some(0), "{args:?}: {text}");
        text
    };
    assert!(cli(&["fleet", "cordon", "a"]).contains("cordoned"));
    assert_eq!(fleet_node(&fleet_nodes(&admin), "a")["cordoned"], true);
    assert!(cli(&["fleet", "nodes"]).contains("ready,cordoned"));
    // Every new sandbox goes to b, until b is full: then 429, naming the cordon.
    for _ in 0..2 {
        let r = create(&api);
        assert_eq!(
            (r.status, placed_on(&r)),
            (201, "b".to_owned()),
            "{}",
            r.text()
        );
    }
    let full = create(&api);
    assert_eq!(full.status, 429, "{}", full.text());
    assert!(
        full.text().contains("1 of them cordoned"),
        "{}",
        full.text()
    );
    // a's own sandbox runs on, and answers.
    assert_eq!(api.sh(&on_a, "echo still here"), "still here\n");
    let unknown = admin.post("/v1/fleet/nodes/nowhere/cordon", &json!({}));
    assert_eq!(unknown.status, 404, "{}", unknown.text());
    // Lifted: a takes sandboxes again.
    cli(&["fleet", "uncordon", "a"]);
    assert_eq!(fleet_node(&fleet_nodes(&admin), "a")["cordoned"], false);
    let r = create(&api);
    assert_eq!(
        (r.status, placed_on(&r)),
        (201, "a".to_owned()),
        "{}",
        r.text()
    );
    for n in &mut nodes {
        n.stop();
    }
}
