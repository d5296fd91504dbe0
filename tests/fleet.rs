//! Fleet mode's foundation (issue 25, point 1): the state on PostgreSQL. A real
//! `locker serve --database postgres://…` over HTTP, and `locker db migrate --to` from a
//! one-host install with data in every table, each against a real Postgres cluster this
//! test process starts and that goes with it (`common/postgres.rs`).

use std::process::Command;

use locker_tests::postgres::cluster;
use locker_tests::server::Server;
use locker_tests::{locker_bin, wait_for};
use serde_json::{json, Value};

fn ids(list: &Value, key: &str) -> Vec<String> {
    list[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} in {list}"))
        .iter()
        .map(|x| x["id"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn serve_on_postgres_keeps_sandboxes_across_a_restart() {
    let (db, url) = cluster().new_database();
    let mut srv = Server::start_with(&["--database", url.as_str()]);
    assert!(
        srv.log_text().contains("state store on Postgres"),
        "{}",
        srv.log_text()
    );
    assert!(
        !srv.data_dir.join("db.sqlite").exists(),
        "no SQLite file beside a Postgres store"
    );
    let api = srv.api();
    let id = api.create_sandbox(&json!({"metadata": {"owner": "fleet"}}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        api.sh(&id, "echo hello from postgres").trim(),
        "hello from postgres"
    );
    api.write_file(&id, "/root/kept.txt", b"kept across restarts")
        .expect(200, "write a file");
    // The rows are in Postgres, not somewhere else.
    assert_eq!(
        cluster()
            .psql(
                &db,
                &format!("SELECT state FROM sandboxes WHERE id = '{id}'")
            )
            .trim(),
        "running"
    );
    // Call records are written behind the answer (a queue): wait for the exec's.
    wait_for(std::time::Duration::from_secs(10), "the exec's call record", || {
        (cluster()
            .psql(&db, "SELECT COUNT(*) FROM calls")
            .trim()
            .parse::<u32>()
            .unwrap()
            >= 1)
            .then_some(())
    });

    // Until nodes exist, a database serves one server: a second one refuses, saying why.
    let other = locker_tests::TempDir::new("locker-second");
    let out = Command::new(locker_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database",
            url.as_str(),
            "--data-dir",
        ])
        .arg(other.path())
        .env("LOCKER_API_KEY", "lk_second_server_key")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("another locker serve already uses"),
        "{err}"
    );

    srv.restart();
    let api = srv.api();
    let listed = api
        .get("/v1/sandboxes?metadata.owner=fleet")
        .expect(200, "list");
    assert_eq!(ids(&listed, "sandboxes"), std::slice::from_ref(&id), "{listed}");
    assert_eq!(listed["sandboxes"][0]["state"], "running");
    assert_eq!(
        api.read_file(&id, "/root/kept.txt").text(),
        "kept across restarts"
    );
    assert_eq!(api.sh(&id, "echo still here").trim(), "still here");
    let calls = api
        .get(&format!("/v1/calls?sandbox_id={id}"))
        .expect(200, "calls");
    assert!(calls["calls"].as_array().unwrap().len() >= 2, "{calls}");
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete");
    assert_eq!(
        cluster()
            .psql(
                &db,
                &format!("SELECT state, deleted_unix IS NOT NULL FROM sandboxes WHERE id = '{id}'")
            )
            .trim(),
        "stopped|t"
    );
}

#[test]
fn serve_refuses_a_database_it_cannot_use_clearly() {
    let out = Command::new(locker_bin())
        .args(["serve", "--database", "mysql://x/y"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("postgres://"),
        "{err}"
    );
}

/// What a client sees of a server's state, for comparing two servers.
fn state_of(srv: &Server, tenant_key: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for api in [srv.api(), srv.api_with(tenant_key)] {
        for path in [
            "/v1/sandboxes",
            "/v1/snapshots",
            "/v1/volumes",
            "/v1/secrets",
            "/v1/calls?limit=1000",
            "/v1/webhooks",
        ] {
            let mut v = api.get(path).expect(200, path);
            // Live figures that move between two reads, and URLs with the server's port.
            for list in ["sandboxes", "volumes", "webhooks"] {
                if let Some(items) = v[list].as_array_mut() {
                    for it in items {
                        for k in [
                            "usage",
                            "last_active_at",
                            "used_bytes",
                            "preview_url",
                            "status",
                            "delivered_through",
                        ] {
                            it.as_object_mut().map(|o| o.remove(k));
                        }
                    }
                }
            }
            out.push(json!({ "path": path, "answer": v }));
        }
    }
    out
}

#[test]
fn db_migrate_moves_a_one_host_install_to_postgres() {
    let mut srv = Server::start();
    let (team, _key_id) = srv.create_tenant("team-fleet");
    let team_key = team.key().unwrap().to_owned();
    // Data in every table: sandboxes (one deleted), calls, a snapshot, a volume with a
    // snapshot, a secret, a webhook, events (every create and delete writes one).
    let id = team.create_sandbox(&json!({"metadata": {"k": "v"}}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    team.sh(&id, "echo data > /root/f.txt");
    let gone = team.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    team.delete(&format!("/v1/sandboxes/{gone}"))
        .expect(204, "delete");
    team.post_empty(&format!("/v1/sandboxes/{id}/snapshots"))
        .expect(201, "snapshot");
    let vol = team
        .post("/v1/volumes", &json!({"name": "repo", "size_mb": 64}))
        .expect(201, "volume")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    team.post_empty(&format!("/v1/volumes/{vol}/snapshots"))
        .expect(201, "volume snapshot");
    team.post(
        "/v1/secrets",
        &json!({"name": "gh", "value": "ghp_x", "hosts": ["api.github.com"], "env": "GH"}),
    )
    .expect(201, "secret");
    team.post(
        "/v1/webhooks",
        &json!({"url": "http://127.0.0.1:9/hook", "events": ["sandbox.*"], "secret": "whsec_fleet_test_1"}),
    )
    .expect(201, "webhook");
    let mine = srv.api().create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    srv.api().sh(&mine, "true");
    // The recorder writes call records in the background (and a SIGKILL loses its queue).
    for api in [&team, &srv.api()] {
        wait_for(
            std::time::Duration::from_secs(10),
            "the call records",
            || {
                let c = api.get("/v1/calls").json();
                (c["calls"].as_array().map_or(0, |a| a.len()) >= 1).then_some(())
            },
        );
    }
    let before = state_of(&srv, &team_key);

    let (db, url) = cluster().new_database();
    let migrate = |srv: &Server| {
        Command::new(locker_bin())
            .args(["db", "migrate", "--json", "--to", &url, "--data-dir"])
            .arg(&srv.data_dir)
            .output()
            .unwrap()
    };
    // A running server holds its data dir: the copy waits for it to stop.
    let out = migrate(&srv);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("stop `locker serve`"),
        "{err}"
    );
    assert_eq!(
        cluster()
            .psql(
                &db,
                "SELECT COUNT(*) FROM pg_tables WHERE tablename = 'tenants'"
            )
            .trim(),
        "0"
    );

    srv.kill9();
    let out = migrate(&srv);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    for table in [
        "tenants",
        "api_keys",
        "sandboxes",
        "calls",
        "snapshots",
        "volumes",
        "volume_snapshots",
        "secrets",
        "events",
        "webhooks",
    ] {
        assert!(
            report["tables"][table].as_u64().unwrap() >= 1,
            "{table}: {report}"
        );
        assert_eq!(
            cluster()
                .psql(&db, &format!("SELECT COUNT(*) FROM {table}"))
                .trim(),
            report["tables"][table].to_string(),
            "{table}"
        );
    }
    // Twice is refused, with what the target holds.
    let again = migrate(&srv);
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && err.contains("already holds"),
        "{err}"
    );

    // The same data dir (its machines, volumes and secrets' key) on the Postgres store.
    std::fs::rename(
        srv.data_dir.join("db.sqlite"),
        srv.data_dir.join("db.sqlite.migrated"),
    )
    .unwrap();
    srv.add_args(&["--database", url.as_str()]);
    srv.restart();
    let after = state_of(&srv, &team_key);
    assert_eq!(before.len(), after.len());
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(b, a, "the same answer from Postgres");
    }
    assert!(
        !srv.data_dir.join("db.sqlite").exists(),
        "nothing written to SQLite"
    );
    // Still usable, with the same keys: the sandbox and its files, new work on the volume
    // (a restarted server listens on a new port: a new client).
    let team = srv.api_with(&team_key);
    assert_eq!(team.read_file(&id, "/root/f.txt").text(), "data\n");
    assert_eq!(team.sh(&id, "echo after").trim(), "after");
    let run = team
        .post(
            &format!("/v1/volumes/{vol}/run"),
            &json!({"shell": "echo x > /workspace/y; cat /workspace/y"}),
        )
        .expect(200, "a run on the moved volume");
    assert_eq!(run["stdout"], "x\n", "{run}");
    let tomb = team.get(&format!("/v1/sandboxes/{gone}")).json();
    assert!(
        tomb.to_string().contains("deleted"),
        "the tombstone moved too: {tomb}"
    );
}
