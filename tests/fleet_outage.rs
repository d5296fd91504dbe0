//! Fleet mode, a database outage (issue 25, `FLEET.md` §4.5 "mass false death" and §5.2
//! test 7 without Patroni): Postgres stalls for 10 s (every process frozen: connections
//! hang rather than fail, as a stalled database host or a network dropping packets gives),
//! then goes on. No node may be declared dead for it: every lease looks expired when the
//! store comes back, so the sweeper must take a stall like an outage and wait a lease of
//! fresh heartbeats. Nodes keep what they run meanwhile; creates resume within a lease
//! and 2 s of the store's return.
//!
//! A test binary of its own: it freezes the test process's Postgres cluster.

use std::time::{Duration, Instant};

use locker_tests::fabric::{fleet_nodes, join_nodes, Fabric};
use locker_tests::postgres::cluster;
use locker_tests::server::{Api, Resp};
use locker_tests::wait_for;
use serde_json::json;

/// The lease the server keeps (`fleet::LEASE`).
const LEASE: Duration = Duration::from_secs(3);
const OUTAGE: Duration = Duration::from_secs(10);

fn create(api: &Api) -> Resp {
    api.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256}),
    )
}

#[test]
fn a_stalled_database_declares_no_node_dead() {
    let fab = Fabric::new(2);
    let (_db, pg_url) = cluster().new_database();
    let srv = fab.control(&pg_url, &[]);
    let (admin, api) = (srv.admin(), srv.api());
    let mut nodes = join_nodes(&fab, &admin, &["a", "b"], 4);
    let ids: Vec<String> = (0..2)
        .map(|_| {
            let r = create(&api);
            assert_eq!(r.status, 201, "{}", r.text());
            r.json()["id"].as_str().unwrap().to_owned()
        })
        .collect();
    for id in &ids {
        assert_eq!(api.sh(id, "echo before"), "before\n");
    }

    cluster().freeze_for(OUTAGE);
    let back = Instant::now();

    // Creates resume within a lease and 2 s of the store's return.
    let made = wait_for(
        LEASE + Duration::from_secs(2),
        "a create after the outage",
        || {
            let r = create(&api);
            (r.status == 201).then_some(r)
        },
    );
    let resumed = back.elapsed();
    // Past two leases of fresh heartbeats: nobody was declared dead, epochs unchanged.
    std::thread::sleep((LEASE * 2).saturating_sub(back.elapsed()));
    let l = fleet_nodes(&admin);
    for n in &l {
        assert_eq!(
            (&n["state"], &n["epoch"], &n["alive"]),
            (&json!("ready"), &json!(1), &json!(true)),
            "a node declared dead for a database outage: {n}\n{}",
            srv.log_text()
        );
    }
    let log = srv.log_text();
    assert!(!log.contains("node declared dead"), "{log}");
    assert!(
        log.contains("the store stalled: declaring no node dead for a lease"),
        "the sweeper did not see the stall:\n{log}"
    );
    // What the nodes ran before answers as before.
    for id in &ids {
        assert_eq!(api.sh(id, "echo after"), "after\n");
    }
    eprintln!("creates resumed {resumed:?} after the store's return");
    for id in ids.iter().chain(std::iter::once(
        &made.json()["id"].as_str().unwrap().to_owned(),
    )) {
        assert_eq!(api.delete(&format!("/v1/sandboxes/{id}")).status, 204);
    }
    for n in &mut nodes {
        n.stop();
    }
}
