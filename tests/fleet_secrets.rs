//! Fleet mode, secrets on joined nodes (issue 25): the control plane keeps a tenant's
//! secrets (sealed in the fleet's store, under a key no node has); a sandbox or a run on a
//! joined node gets placeholders, and the node's egress proxy puts the values in from
//! copies it fetches from control and keeps in memory only. A rotation, a secret's new
//! hosts and a deletion reach a running sandbox within seconds; a node gets only the
//! secrets of tenants it runs something of; a drain carries a sandbox's secrets to its new
//! node; the nodes' disks and logs never hold a value.
//! The secret's host is the secrets tests' echo server (`data/secrets_echo.js`) on the
//! fabric's bridge address, pinned on the node with `--egress-resolve`.

use std::net::Ipv4Addr;
use std::time::Duration;

use locker_tests::echo::{secret_value, EchoHost, Pki};
use locker_tests::fabric::{fleet_nodes, fleet_token, Fabric, NodeProc};
use locker_tests::fleet::placed_on;
use locker_tests::postgres::cluster;
use locker_tests::server::Api;
use locker_tests::wait_for;
use serde_json::{json, Value};

/// What the echo host saw as `Authorization` for a request from sandbox `id` to `url`,
/// sent with the placeholder, values masked; the machine trusts its store (intercepted
/// hosts) and the test CA at /root/test-ca.pem (hosts passed through).
fn auth_seen(api: &Api, id: &str, url: &str) -> String {
    let r = api.exec(
        id,
        &json!({"shell": format!("cat /etc/ssl/certs/ca-certificates.crt /root/test-ca.pem > /tmp/both.pem && curl -sS -m 10 --cacert /tmp/both.pem -H \"Authorization: Bearer $EXAMPLE_KEY\" {url}")}),
    );
    let out = r["stdout"].as_str().unwrap_or_default();
    serde_json::from_str::<Value>(out.trim())
        .unwrap_or_else(|_| panic!("not the echo's answer: {r}"))["headers"]["authorization"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn a_joined_nodes_sandboxes_and_runs_get_secrets_from_control() {
    let fab = Fabric::new(2);
    let (_db, pg_url) = cluster().new_database();
    let srv = fab.control(&pg_url, &[]);
    let (admin, api) = (srv.admin(), srv.api());
    let (v1, v2) = (secret_value("one"), secret_value("two"));
    let pki = Pki::new(&["api.secret.test", "api2.secret.test"]);
    let bridge: Ipv4Addr = fab.control_ip().parse().unwrap();
    let echo = EchoHost::start_on("echo", &pki, &[&v1, &v2], bridge);
    // Node a first; b joins later, for a drain.
    let node = |i: usize, name: &str| {
        let mut n = NodeProc::new(i, name);
        for host in ["api.secret.test", "api2.secret.test"] {
            n.extra
                .extend(["--egress-resolve".into(), format!("{host}={bridge}")]);
        }
        n.extra.extend([
            "--egress-ca".into(),
            pki.path("ca.pem").display().to_string(),
        ]);
        n
    };
    let (mut a, mut b) = (node(0, "a"), node(1, "b"));
    let control_url = fleet_token(&admin, 600)["url"].as_str().unwrap().to_owned();
    let join = |n: &mut NodeProc| {
        let t = fleet_token(&admin, 600);
        n.start(&fab, Some((&control_url, t["token"].as_str().unwrap())), 4);
        wait_for(
            Duration::from_secs(60),
            "the node alive, its egress checked",
            || {
                let alive = fleet_nodes(&admin)
                    .iter()
                    .any(|x| x["name"] == n.name && x["alive"] == true);
                (alive && n.log_text().contains("egress enforcement works")).then_some(())
            },
        );
    };
    join(&mut a);

    api.post(
        "/v1/secrets",
        &json!({"name": "example", "value": v1, "hosts": ["api.secret.test"], "env": "EXAMPLE_KEY"}),
    )
    .expect(201, "a secret on the control plane");
    let made = api.post(
        "/v1/sandboxes",
        &json!({"runtime": "jail", "memory_mb": 256, "ttl_s": 900, "secrets": ["example"]}),
    );
    assert_eq!(made.status, 201, "{}", made.text());
    assert_eq!(placed_on(&made), "a");
    let id = made.json()["id"].as_str().unwrap().to_owned();
    api.write_file(
        &id,
        "/root/test-ca.pem",
        &std::fs::read(pki.path("ca.pem")).unwrap(),
    )
    .expect(200, "the test CA");
    let placeholder = api.sh(&id, "printf %s \"$EXAMPLE_KEY\"");
    assert!(
        placeholder.starts_with("locker-secret-example-"),
        "{placeholder}"
    );
    assert_eq!(
        auth_seen(&api, &id, "https://api.secret.test/first"),
        "Bearer [value-1]"
    );

    // A rotation reaches the running sandbox within seconds (the node fetches its copies
    // again every beat).
    let put = |body: Value| {
        api.request(
            "PUT",
            "/v1/secrets/example",
            &[("Content-Type", "application/json")],
            serde_json::to_vec(&body).unwrap(),
        )
        .expect(200, "change the secret")
    };
    put(json!({ "value": v2 }));
    wait_for(Duration::from_secs(10), "the new value put in", || {
        (auth_seen(&api, &id, "https://api.secret.test/rotated") == "Bearer [value-2]")
            .then_some(())
    });
    // A new host joins the sandbox's allowlist on its node, and gets the value.
    put(json!({"hosts": ["api.secret.test", "api2.secret.test"]}));
    wait_for(Duration::from_secs(10), "the new host allowed", || {
        let v = api.get(&format!("/v1/sandboxes/{id}")).json();
        v["network"]["allow"]
            .as_array()
            .is_some_and(|l| l.contains(&json!("api2.secret.test")))
            .then_some(())
    });
    assert_eq!(
        auth_seen(&api, &id, "https://api2.secret.test/new-host"),
        "Bearer [value-2]"
    );

    // A run on a volume homed on the node gets the secret too.
    api.post("/v1/volumes", &json!({"name": "work", "size_mb": 64}))
        .expect(201, "a volume on the node");
    let ran = api.post(
        "/v1/volumes/work/run",
        &json!({"shell": "curl -sS -m 10 --cacert /etc/ssl/certs/ca-certificates.crt -H \"Authorization: Bearer $EXAMPLE_KEY\" https://api.secret.test/run", "secrets": ["example"]}),
    );
    assert_eq!(ran.status, 200, "{}", ran.text());
    let out: Value = serde_json::from_str(ran.json()["stdout"].as_str().unwrap().trim())
        .unwrap_or_else(|_| panic!("{}", ran.text()));
    assert_eq!(out["headers"]["authorization"], "Bearer [value-2]");

    // The node gets only the secrets of tenants it runs something of: asked with its own
    // certificate for another tenant's, control leaves it out.
    let fleet = a.data_dir().join("fleet");
    let ident: Value =
        serde_json::from_slice(&std::fs::read(fleet.join("identity.json")).unwrap()).unwrap();
    let asked = json!({"node_id": ident["node_id"], "wanted": [
        {"tenant": "default", "name": "example"},
        {"tenant": "someone-else", "name": "example"},
    ]});
    let out = std::process::Command::new("curl")
        .args(["-sS", "-k", "--http2", "--max-time", "5", "--cert"])
        .arg(fleet.join("node.crt"))
        .arg("--key")
        .arg(fleet.join("node.key"))
        .args([
            "-H",
            "content-type: application/json",
            "-d",
            &asked.to_string(),
        ])
        .arg(format!("{control_url}/internal/nodes/secrets"))
        .output()
        .expect("run curl");
    let got: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stdout)));
    let tenants: Vec<&str> = got["secrets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(tenants, ["default"], "{got}");

    // Drained to node b: the sandbox's secret goes with it (b arms its machine and gets
    // the value from control).
    join(&mut b);
    let r = admin.post("/v1/fleet/nodes/a/drain", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["moved"].as_array().map(Vec::len),
        Some(1),
        "{}",
        r.text()
    );
    assert_eq!(
        auth_seen(&api, &id, "https://api.secret.test/moved"),
        "Bearer [value-2]"
    );
    assert_eq!(
        api.sh(&id, "printf %s \"$EXAMPLE_KEY\""),
        placeholder,
        "the same placeholder on the new node"
    );

    // Deleted on the control plane: the running sandbox's requests carry the placeholder
    // only, within seconds.
    api.delete("/v1/secrets/example")
        .expect(204, "delete the secret");
    wait_for(
        Duration::from_secs(10),
        "the value no longer put in",
        || {
            (auth_seen(&api, &id, "https://api.secret.test/deleted")
                == format!("Bearer {placeholder}"))
            .then_some(())
        },
    );

    // No value in the nodes' files (their stores, identities) or logs.
    for v in [&v1, &v2] {
        for n in [&a, &b] {
            assert!(
                !n.log_text().contains(v.as_str()),
                "a value in node {}'s log",
                n.name
            );
        }
        for dir in [
            a.data_dir(),
            fleet.clone(),
            b.data_dir(),
            b.data_dir().join("fleet"),
        ] {
            for e in std::fs::read_dir(&dir).unwrap().flatten() {
                let p = e.path();
                if p.is_file() {
                    let b = std::fs::read(&p).unwrap_or_default();
                    assert!(
                        !b.windows(v.len()).any(|w| w == v.as_bytes()),
                        "a value in {}",
                        p.display()
                    );
                }
            }
        }
    }
    assert!(echo.log().contains("/deleted"), "{}", echo.log());
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete the sandbox");
    api.delete("/v1/volumes/work")
        .expect(204, "delete the volume");
}
