//! Fleet mode, nodes (issue 25, point 2; `FLEET.md` §5.2 test 1 and the detection and
//! fencing parts of tests 5 and 7): `locker node` processes in network namespaces of their
//! own on a private bridge (`common/fabric.rs`) join a real `locker serve` with one-time
//! tokens, over TLS with the fleet CA, and beat; the lease sweeper declares a silent node
//! dead within the lease, a returning node fences itself and comes back at its new epoch,
//! a control-plane outage declares nobody dead.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use locker_tests::fabric::{fleet_node, fleet_nodes, fleet_token, Fabric, NodeProc};
use locker_tests::postgres::cluster;
use locker_tests::server::{Api, Server};
use locker_tests::{locker_bin, wait_for};
use serde_json::{json, Value};

/// The lease the server keeps (`fleet::LEASE`) and the sweeper's period.
const LEASE: Duration = Duration::from_secs(3);
const SWEEP: Duration = Duration::from_millis(250);

/// A heartbeat sent with curl, with node `who`'s certificate (or none): the status.
fn beat_as(control: &str, who: Option<&NodeProc>, node_id: &str, epoch: i64, ca: &Path) -> u16 {
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sS",
        "--http2",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "5",
    ])
    .arg("--cacert")
    .arg(ca);
    if let Some(n) = who {
        let d = n.data_dir().join("fleet");
        cmd.arg("--cert").arg(d.join("node.crt"));
        cmd.arg("--key").arg(d.join("node.key"));
    }
    let body = json!({"node_id": node_id, "epoch": epoch, "report": {
        "version": "x", "cpus": 1, "memory_mb": 1, "disk_free_mb": 1, "slots": 1,
        "sandboxes": 0, "templates": [], "warm": 0}});
    let out = cmd
        .args([
            "-H",
            "content-type: application/json",
            "-d",
            &body.to_string(),
        ])
        .arg(format!("{control}/internal/nodes/heartbeat"))
        .output()
        .expect("run curl");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("curl: {}", String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn nodes_join_once_per_token_over_the_fleet_ca_and_report_their_capacity() {
    let fab = Fabric::new(5);
    let (db, pg_url) = cluster().new_database();
    let srv = fab.control(&pg_url, &[]);
    let admin = srv.admin();

    // Bad admin input: a clear 400; a tenant's key opens no fleet route.
    admin
        .post("/v1/fleet/tokens", &json!({"ttl_s": 0}))
        .expect_error(400, "bad_request", "a zero ttl");
    admin
        .post("/v1/fleet/tokens", &json!({"ttl_s": 30 * 86_400}))
        .expect_error(400, "bad_request", "a ttl over 7 days");
    admin
        .post("/v1/fleet/tokens", &json!({"ttl": 60}))
        .expect_error(400, "bad_request", "an unknown field");
    let status = srv.api().post("/v1/fleet/tokens", &json!({})).status;
    assert!(
        status == 401 || status == 403,
        "a tenant key minted a token: {status}"
    );
    assert_eq!(srv.api().get("/v1/fleet/nodes").status / 100, 4);

    let first = fleet_token(&admin, 600);
    let control = first["url"].as_str().unwrap().to_owned();
    assert!(
        control.starts_with(&format!("https://{}:", fab.control_ip())),
        "{first}"
    );
    assert!(first["command"]
        .as_str()
        .unwrap()
        .starts_with(&format!("locker node --join {control} --token lkj_")));

    // Four nodes of different capacity, each with a token of its own.
    let slots = [60u32, 120, 120, 30];
    let mut procs: Vec<NodeProc> = Vec::new();
    for (i, s) in slots.iter().enumerate() {
        let token = if i == 0 {
            first["token"].as_str().unwrap().to_owned()
        } else {
            fleet_token(&admin, 600)["token"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        let mut p = NodeProc::new(i, &format!("n{}", i + 1));
        p.start(&fab, Some((&control, &token)), *s);
        procs.push(p);
    }
    let list = wait_for(Duration::from_secs(30), "four nodes alive", || {
        let l = fleet_nodes(&admin);
        (l.len() == 4 && l.iter().all(|n| n["alive"] == true)).then_some(l)
    });
    for (i, s) in slots.iter().enumerate() {
        let n = fleet_node(&list, &format!("n{}", i + 1));
        assert_eq!(n["state"], "ready", "{n}");
        assert_eq!(n["epoch"], 1, "{n}");
        assert_eq!(
            n["address"],
            format!("{}:{}", fab.node_ip(i), procs[i].port),
            "{n}"
        );
        assert_eq!(n["report"]["slots"], *s, "{n}");
        assert!(n["report"]["cpus"].as_u64().unwrap() >= 1, "{n}");
        assert!(n["report"]["memory_mb"].as_u64().unwrap() > 0, "{n}");
        assert!(n["report"]["templates"].is_array(), "{n}");
        assert!(n["id"].as_str().unwrap().starts_with("node_"), "{n}");
    }
    // They keep beating: a heartbeat at most ~1 s old, a second later too.
    std::thread::sleep(Duration::from_millis(1500));
    for n in fleet_nodes(&admin) {
        assert!(n["last_heartbeat_ms_ago"].as_i64().unwrap() < 2500, "{n}");
    }
    // The identity stays on the node: its key private, never sent.
    let fleet_dir = procs[0].data_dir().join("fleet");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(fleet_dir.join("node.key"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);

    // The CLI shows them.
    let out = Command::new(locker_bin())
        .args(["fleet", "nodes"])
        .env("LOCKER_URL", &srv.url)
        .env("LOCKER_ADMIN_KEY", srv.admin_key.as_deref().unwrap())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for name in ["n1", "n2", "n3", "n4"] {
        assert!(text.contains(name), "{text}");
    }
    assert!(text.contains("0/120") && text.contains("0/30"), "{text}");

    // Refused joins, each saying why, and nothing written on the node.
    let n5 = NodeProc::new(4, "n5");
    let pin = &first["token"].as_str().unwrap()[4..36];
    let expired = fleet_token(&admin, 1)["token"].as_str().unwrap().to_owned();
    std::thread::sleep(Duration::from_millis(2200));
    for (token, why) in [
        (first["token"].as_str().unwrap().to_owned(), "already used"),
        (format!("lkj_{pin}_{}", "0".repeat(40)), "no such token"),
        (expired, "expired"),
        (
            format!("lkj_{}_{}", "0".repeat(32), "1".repeat(40)),
            "not the one the join token names",
        ),
        ("hello".to_owned(), "not a join token"),
    ] {
        let (ok, log) = n5.run_to_end(&fab, &control, &token);
        assert!(!ok && log.contains(why), "{why}: {log}");
        assert!(!n5.data_dir().join("fleet/identity.json").exists(), "{why}");
    }
    // A taken name is refused and leaves the token good for another name.
    let token = fleet_token(&admin, 600)["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let n1_again = NodeProc::new(4, "n1");
    let (ok, log) = n1_again.run_to_end(&fab, &control, &token);
    assert!(!ok && log.contains("already in the fleet"), "{log}");
    let mut n5 = NodeProc::new(4, "n5");
    let n5_token = token.clone();
    n5.start(&fab, Some((&control, &token)), 10);
    wait_for(Duration::from_secs(20), "n5 alive", || {
        fleet_nodes(&admin)
            .iter()
            .any(|n| n["name"] == "n5" && n["alive"] == true)
            .then_some(())
    });

    // One token, two nodes at once: one joins, the other is told it was used.
    let token = fleet_token(&admin, 600)["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let (mut a, mut b) = (NodeProc::new(4, "n6"), NodeProc::new(4, "n7"));
    a.start(&fab, Some((&control, &token)), 4);
    b.start(&fab, Some((&control, &token)), 4);
    let (la, lb) = wait_for(Duration::from_secs(20), "both joins answered", || {
        let (la, lb) = (a.log_text(), b.log_text());
        let done = |l: &str| l.contains("already used") || l.contains("locker node ready");
        (done(&la) && done(&lb)).then_some((la, lb))
    });
    let joined = [&la, &lb]
        .iter()
        .filter(|l| l.contains("locker node ready"))
        .count();
    assert_eq!(joined, 1, "{la}\n{lb}");
    assert!(la.contains("already used") || lb.contains("already used"));
    let listed = fleet_nodes(&admin);
    let six_or_seven = |n: &&Value| n["name"] == "n6" || n["name"] == "n7";
    assert_eq!(listed.iter().filter(six_or_seven).count(), 1, "{listed:?}");
    a.stop();
    b.stop();

    // A join whose answer was lost (the node died before writing its identity) is tried
    // again with the same token and key: the same node comes back.
    let n5_id = fleet_node(&fleet_nodes(&admin), "n5")["id"].clone();
    n5.stop();
    for f in ["identity.json", "node.crt", "ca.crt"] {
        std::fs::remove_file(n5.data_dir().join("fleet").join(f)).unwrap();
    }
    n5.start(&fab, Some((&control, &n5_token)), 10);
    wait_for(
        Duration::from_secs(20),
        "n5 back by its retried join",
        || {
            n5.data_dir()
                .join("fleet/identity.json")
                .exists()
                .then_some(())
        },
    );
    let ident: Value =
        serde_json::from_slice(&std::fs::read(n5.data_dir().join("fleet/identity.json")).unwrap())
            .unwrap();
    assert_eq!(ident["node_id"], n5_id);

    // Calls need the node's own certificate.
    let list = fleet_nodes(&admin);
    let (id1, id2) = (
        fleet_node(&list, "n1")["id"].as_str().unwrap().to_owned(),
        fleet_node(&list, "n2")["id"].as_str().unwrap().to_owned(),
    );
    let ca = fleet_dir.join("ca.crt");
    assert_eq!(beat_as(&control, Some(&procs[0]), &id1, 1, &ca), 200);
    assert_eq!(
        beat_as(&control, Some(&procs[0]), &id2, 1, &ca),
        403,
        "another node's id"
    );
    assert_eq!(beat_as(&control, None, &id1, 1, &ca), 401, "no certificate");
    assert_eq!(beat_as(&control, Some(&procs[0]), "node_gone", 1, &ca), 404);
    assert_eq!(
        beat_as(&control, Some(&procs[0]), &id1, 7, &ca),
        409,
        "a stale epoch"
    );

    // Postgres holds the tokens' hashes only, and the CA's key sealed.
    let dump = cluster().dump(&db);
    assert!(
        !dump.contains(&token[36..]),
        "a clear join token in the database"
    );
    assert!(!dump.contains("PRIVATE KEY"), "a clear key in the database");
    for p in &mut procs {
        p.stop();
    }
    n5.stop();
}

#[test]
fn a_silent_node_is_declared_dead_within_its_lease_and_comes_back_fenced() {
    let fab = Fabric::new(3);
    // A fixed port: the restart below must listen where the nodes dial.
    let port = std::net::TcpListener::bind(format!("{}:0", fab.control_ip()))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut srv = Server::start_with(&["--fleet-listen", &format!("{}:{port}", fab.control_ip())]);
    let admin = srv.admin();
    let mut procs: Vec<NodeProc> = (0..3).map(|i| NodeProc::new(i, &format!("m{i}"))).collect();
    for p in &mut procs {
        let t = fleet_token(&admin, 600);
        p.start(
            &fab,
            Some((t["url"].as_str().unwrap(), t["token"].as_str().unwrap())),
            8,
        );
    }
    let alive = |admin: &Api, name: &str| -> Option<bool> {
        fleet_nodes(admin)
            .iter()
            .find(|n| n["name"] == name)
            .map(|n| n["alive"] == true)
    };
    wait_for(Duration::from_secs(30), "three nodes alive", || {
        (0..3)
            .all(|i| alive(&admin, &format!("m{i}")) == Some(true))
            .then_some(())
    });

    // A stopped agent (a hung host): dead within lease + a sweep of its last beat.
    procs[0].signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let dead = wait_for(Duration::from_secs(10), "m0 declared dead", || {
        let l = fleet_nodes(&admin);
        let n = fleet_node(&l, "m0").clone();
        (n["state"] == "dead").then_some(n)
    });
    let took = stopped.elapsed();
    assert!(
        took <= LEASE + SWEEP + Duration::from_millis(750)
            && took >= LEASE - Duration::from_millis(1100),
        "declared after {took:?}"
    );
    assert_eq!(dead["epoch"], 2, "{dead}");
    let l = fleet_nodes(&admin);
    assert!(
        fleet_node(&l, "m1")["alive"] == true && fleet_node(&l, "m2")["alive"] == true,
        "{l:?}"
    );
    // It wakes up: fenced (its epoch moved on), it returns at the new epoch.
    procs[0].signal(libc::SIGCONT);
    wait_for(Duration::from_secs(10), "m0 back at epoch 2", || {
        let l = fleet_nodes(&admin);
        let n = fleet_node(&l, "m0");
        (n["state"] == "ready" && n["epoch"] == 2 && n["alive"] == true).then_some(())
    });
    // The node logs its return once it has read the answer, which may be just after the
    // control plane shows it back.
    wait_for(Duration::from_secs(5), "m0 saying it returned", || {
        let log = procs[0].log_text();
        (log.contains("fenced")
            && log.contains("returned to the fleet")
            && log.contains("stalled for longer than its node's lease"))
        .then_some(())
    });

    // A node agent restart keeps its identity: no token, same id and epoch.
    let id2 = fleet_node(&fleet_nodes(&admin), "m2")["id"].clone();
    procs[2].signal(libc::SIGTERM);
    assert!(procs[2].wait_end(Duration::from_secs(10)).success());
    let _ = std::fs::remove_file(&procs[2].log);
    procs[2].start(&fab, None, 8);
    wait_for(Duration::from_secs(10), "m2 beating again", || {
        procs[2]
            .log_text()
            .contains("locker node ready")
            .then_some(())
    });
    std::thread::sleep(Duration::from_millis(1200));
    let l = fleet_nodes(&admin);
    let n = fleet_node(&l, "m2");
    assert_eq!(
        (n["id"].clone(), n["epoch"].clone(), n["alive"].clone()),
        (id2, json!(1), json!(true)),
        "{n}"
    );

    // The control plane away for longer than a lease: nobody declared dead when it is back
    // (a lease of grace for the heartbeats to land).
    let epochs = |admin: &Api| -> Vec<(String, Value)> {
        fleet_nodes(admin)
            .iter()
            .map(|n| (n["name"].as_str().unwrap().to_owned(), n["epoch"].clone()))
            .collect()
    };
    let before = epochs(&admin);
    srv.kill9();
    std::thread::sleep(LEASE + Duration::from_secs(2));
    srv.restart();
    let admin = srv.admin();
    let deadline = Instant::now() + LEASE * 2;
    while Instant::now() < deadline {
        for n in fleet_nodes(&admin) {
            assert_eq!(n["state"], "ready", "declared dead after an outage: {n}");
        }
        std::thread::sleep(SWEEP);
    }
    // Not even briefly: a node declared and back between two looks would have a new epoch.
    assert_eq!(epochs(&admin), before);

    // Removed: the node's certificate opens nothing, and it stops, saying how to rejoin.
    let out = Command::new(locker_bin())
        .args(["fleet", "remove", "m2"])
        .env("LOCKER_URL", &srv.url)
        .env("LOCKER_ADMIN_KEY", srv.admin_key.as_deref().unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!procs[2].wait_end(Duration::from_secs(30)).success());
    assert!(
        procs[2].log_text().contains("no longer knows this node"),
        "{}",
        procs[2].log_text()
    );
    admin
        .delete("/v1/fleet/nodes/m2")
        .expect_error(404, "not_found", "removing a removed node");
    for p in &mut procs {
        p.stop();
    }
}

#[test]
fn a_partition_declares_at_most_the_rate_limit_and_partitioned_nodes_keep_running() {
    let fab = Fabric::new(3);
    let srv = Server::start_with(&["--fleet-listen", &format!("{}:0", fab.control_ip())]);
    let admin = srv.admin();
    let mut procs: Vec<NodeProc> = (0..3).map(|i| NodeProc::new(i, &format!("p{i}"))).collect();
    for p in &mut procs {
        let t = fleet_token(&admin, 600);
        p.start(
            &fab,
            Some((t["url"].as_str().unwrap(), t["token"].as_str().unwrap())),
            8,
        );
    }
    wait_for(Duration::from_secs(30), "three nodes alive", || {
        let l = fleet_nodes(&admin);
        (l.len() == 3 && l.iter().all(|n| n["alive"] == true)).then_some(())
    });

    // Two of three cut off at once: more likely the network than two dead hosts. One is
    // declared (max(1, 10%) a minute), the other stays `ready` past its lease, and the
    // server says why.
    fab.link(0, false);
    fab.link(1, false);
    let dead = |l: &[Value]| -> Vec<String> {
        l.iter()
            .filter(|n| n["state"] == "dead")
            .map(|n| n["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let first = wait_for(Duration::from_secs(10), "one node declared dead", || {
        let d = dead(&fleet_nodes(&admin));
        (!d.is_empty()).then_some(d)
    });
    assert_eq!(first.len(), 1, "{first:?}");
    std::thread::sleep(LEASE);
    let l = fleet_nodes(&admin);
    assert_eq!(dead(&l), first, "the rate limit held: {l:?}");
    let other = if first[0] == "p0" { "p1" } else { "p0" };
    assert_eq!(fleet_node(&l, other)["alive"], false, "{l:?}");
    assert_eq!(fleet_node(&l, "p2")["alive"], true, "{l:?}");
    assert!(
        srv.log_text().contains("declaring at most 1 per minute"),
        "{}",
        srv.log_text()
    );
    // Cut off, the nodes keep running (never kill what they run for want of control).
    for p in &mut procs[..2] {
        wait_for(
            Duration::from_secs(10),
            "the node saying it keeps everything",
            || {
                p.log_text()
                    .contains("cannot reach the control plane: keeping everything")
                    .then_some(())
            },
        );
        assert!(
            p.child.as_mut().unwrap().try_wait().unwrap().is_none(),
            "{}",
            p.log_text()
        );
    }
    // Healed: the declared one returns fenced at epoch 2, the other resumes at epoch 1.
    fab.link(0, true);
    fab.link(1, true);
    wait_for(Duration::from_secs(15), "both back", || {
        let l = fleet_nodes(&admin);
        (fleet_node(&l, &first[0])["epoch"] == 2 && l.iter().all(|n| n["alive"] == true))
            .then_some(())
    });
    assert_eq!(fleet_node(&fleet_nodes(&admin), other)["epoch"], 1);
    for p in &mut procs {
        p.stop();
    }
}

#[test]
fn a_server_with_node_local_is_a_node_of_its_own_fleet_with_what_it_runs() {
    let fab = Fabric::new(1);
    let mut srv = Server::start_with(&[
        "--fleet-listen",
        &format!("{}:0", fab.control_ip()),
        "--node",
        "local",
        "--node-name",
        "ctl",
        "--node-slots",
        "7",
    ]);
    let admin = srv.admin();
    let ctl = |admin: &Api| fleet_node(&fleet_nodes(admin), "ctl").clone();
    let first = wait_for(Duration::from_secs(10), "ctl alive", || {
        let n = ctl(&admin);
        (n["alive"] == true).then_some(n)
    });
    assert_eq!(first["report"]["slots"], 7, "{first}");
    // Its address is its node listener's (for other control replicas), on the fleet
    // listener's address and a port of its own, not the API's.
    let address = first["address"].as_str().unwrap();
    assert!(
        address.starts_with(&format!("{}:", fab.control_ip()))
            && address != srv.url.trim_start_matches("http://"),
        "{first}"
    );

    // What it runs shows within a beat or two.
    let sb = srv.api().create_sandbox(&json!({}));
    let digest = sb["template_digest"].as_str().unwrap().to_owned();
    let id = sb["id"].as_str().unwrap().to_owned();
    wait_for(Duration::from_secs(5), "ctl reports the sandbox", || {
        let n = ctl(&admin);
        let has = n["report"]["templates"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d == &json!(digest));
        (n["report"]["sandboxes"] == 1 && has).then_some(())
    });
    srv.api()
        .delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete the sandbox");
    wait_for(Duration::from_secs(5), "ctl reports none", || {
        (ctl(&admin)["report"]["sandboxes"] == 0).then_some(())
    });

    // Its name is its own: a remote node cannot join by it.
    let t = fleet_token(&admin, 600);
    let (ok, log) = NodeProc::new(0, "ctl").run_to_end(
        &fab,
        t["url"].as_str().unwrap(),
        t["token"].as_str().unwrap(),
    );
    assert!(!ok && log.contains("already in the fleet"), "{log}");
    let mut n1 = NodeProc::new(0, "n1");
    n1.start(
        &fab,
        Some((t["url"].as_str().unwrap(), t["token"].as_str().unwrap())),
        4,
    );
    wait_for(Duration::from_secs(20), "n1 alive", || {
        fleet_nodes(&admin)
            .iter()
            .any(|n| n["name"] == "n1" && n["alive"] == true)
            .then_some(())
    });

    // A restart keeps its row (same id, epoch).
    srv.restart();
    let admin = srv.admin();
    let again = wait_for(Duration::from_secs(10), "ctl alive again", || {
        let n = ctl(&admin);
        (n["alive"] == true).then_some(n)
    });
    assert_eq!(
        (&again["id"], &again["epoch"]),
        (&first["id"], &first["epoch"])
    );

    // Named as a node that joined with a certificate, a server does not start.
    srv.kill9();
    let out = Command::new(locker_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--no-template-build",
            "--node",
            "local",
        ])
        .args(["--node-name", "n1", "--data-dir"])
        .arg(&srv.data_dir)
        .env("LOCKER_API_KEY", "lk_node_local_test_key")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("already in the fleet") && err.contains("--node-name"),
        "{err}"
    );
    n1.stop();
}

#[test]
fn a_server_without_a_fleet_listener_says_how_to_get_one() {
    let srv = Server::start();
    let msg = srv
        .admin()
        .post("/v1/fleet/tokens", &json!({}))
        .expect_error(409, "conflict", "a token without a fleet listener");
    assert!(msg.contains("--fleet-listen"), "{msg}");
    assert_eq!(
        srv.admin().get("/v1/fleet/nodes").expect(200, "no nodes")["nodes"],
        json!([])
    );
}
