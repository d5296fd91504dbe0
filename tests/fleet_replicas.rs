//! Fleet mode, control replicas (`FLEET.md` §4.1 and §4.5; §5.2 tests 3 and 6, in part): two
//! `locker serve` replicas on one Postgres database, behind haproxy, are stateless.
//!
//! 1. Both start on the same database (with the same `LOCKER_SECRETS_KEY`, so that both open
//!    the fleet CA kept there); two nodes join through haproxy's TCP frontend (TLS passes
//!    through, whichever replica it picks answers).
//! 2. Routing: 1,000 calls through replica A, replica B and haproxy all land on the
//!    sandbox's node, by path (exec, file read, the sandbox's own GET), by preview host
//!    (`{port}-{id}.localhost`, with the key or the preview token) and by E2B's headers
//!    (`E2b-Sandbox-Id`): each reads back a file that exists only there, with content unique
//!    to that sandbox. Then the doors' rules as on one host (a preview host's credentials,
//!    the app's own `Authorization`, E2B's info, snapshots and forks), and E2B's and
//!    MCP's creates placed on nodes, listed, reached and killed through other replicas.
//! 3. (Run after 4.) Exactly one replica leads (holds the leader's advisory lock: the lease
//!    sweeper and reconciliation). SIGKILL it, then SIGKILL node a: the other replica takes
//!    over, declares a dead, and a's sandboxes read `lost` through it and through haproxy
//!    within seconds, while node b's sandboxes keep answering.
//! 4. A replica SIGKILLed while 8 clients make 200 sandboxes through haproxy (each retried a
//!    few times, as an SDK does), and started again: every create ends 201 or with a
//!    retriable error (5xx, 429 or a broken connection), and once reconciled the books
//!    balance: no placement left `starting`, every `placed` one names a sandbox its node
//!    runs, every sandbox a node runs has a placement (0 orphans), each node's reservation
//!    is its count of placements; deleting everything through haproxy empties the nodes.
//! 5. A follower's cached routes do not outlive a node: when a node dies, its sandboxes read
//!    `lost` (and can be deleted) through the follower and haproxy too, not only through the
//!    leader that declared it dead.
//!
//! Each replica connects with its own `application_name`
//! (`?application_name=locker-replica-a` on the same database URL), so that `pg_locks`
//! says which one holds the leader's lock.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use locker_tests::fabric::{fleet_node, fleet_nodes};
use locker_tests::fleet::{
    books, delete_all, kinds, placed_on, placed_sandboxes, quantile, rows, sandbox_dirs,
    ReplicaRig, NAMES,
};
use locker_tests::postgres::cluster;
use locker_tests::server::{enc, Api};
use locker_tests::{unique, wait_for};
use serde_json::{json, Value};
use sha2::Digest as _;

/// The lease the server keeps (`fleet::LEASE`).
const LEASE: Duration = Duration::from_secs(3);
/// Sandboxes the routing check calls, and the calls.
const ROUTED: usize = 10;
const REQUESTS: usize = 1000;
/// The creates a replica is killed during, and their clients.
const CREATES: usize = 200;
const CREATORS: usize = 8;
/// Tries a client makes of one create (an SDK's retries).
const TRIES: u32 = 4;
/// The file each routed sandbox holds, its content its own.
const OWNER_FILE: &str = "/tmp/owner.txt";
/// A fleet's create: a jail of `memory_mb` (and `disk_mb`, when given).
fn create_body(memory_mb: u32, disk_mb: Option<u32>) -> Vec<u8> {
    let mut b = json!({"runtime": "jail", "ttl_s": 900, "memory_mb": memory_mb});
    if let Some(d) = disk_mb {
        b["disk_mb"] = json!(d);
    }
    serde_json::to_vec(&b).expect("json")
}

const JSON: [(&str, &str); 1] = [("Content-Type", "application/json")];

/// A create through `api` that must answer 201: the sandbox's id and node.
#[track_caller]
fn create(api: &Api, body: &[u8], what: &str) -> (String, String) {
    let r = api.request("POST", "/v1/sandboxes", &JSON, body.to_vec());
    assert_eq!(r.status, 201, "{what}: create: {}", r.text());
    let id = r.json()["id"].as_str().expect("an id").to_owned();
    (id, placed_on(&r))
}

/// How one client's create ended, after up to [`TRIES`] tries.
#[derive(Debug)]
enum Outcome {
    Created {
        id: String,
        node: String,
    },
    /// Every try failed retriably (5xx, 429 or the connection); the last error.
    GaveUp(String),
    /// A try was refused in a way no client should retry (a 4xx other than 429).
    Refused(String),
}

/// A create as an SDK makes it: tried again on a 5xx, a 429 or a broken connection. The
/// outcome, and the retriable errors met on the way. Small (128 MB, 512 MB of disk): the
/// two nodes hold all 200 within the memory and disk their engines allow a tenant.
fn create_retrying(api: &Api) -> (Outcome, Vec<String>) {
    let mut errors = Vec::new();
    for attempt in 1..=TRIES {
        match api.try_request("POST", "/v1/sandboxes", &JSON, create_body(128, Some(512))) {
            Ok(r) if r.status == 201 => {
                let id = serde_json::from_slice::<Value>(&r.body)
                    .ok()
                    .and_then(|v| v["id"].as_str().map(str::to_owned));
                return match id {
                    Some(id) => (
                        Outcome::Created {
                            id,
                            node: placed_on(&r),
                        },
                        errors,
                    ),
                    None => (
                        Outcome::Refused(format!("201 without an id: {}", r.text())),
                        errors,
                    ),
                };
            }
            Ok(r) if r.status == 429 || r.status >= 500 => {
                errors.push(format!("HTTP {}: {}", r.status, r.text()));
            }
            Ok(r) => {
                return (
                    Outcome::Refused(format!("HTTP {}: {}", r.status, r.text())),
                    errors,
                );
            }
            Err(e) => errors.push(format!("connection: {e}")),
        }
        std::thread::sleep(Duration::from_millis(150 * u64::from(attempt)));
    }
    let last = errors.last().cloned().unwrap_or_default();
    (Outcome::GaveUp(last), errors)
}

/// The replicas (indexes into [`NAMES`]) that hold an exclusive session-level advisory lock
/// on `db`: held in three samples 300 ms apart (a transaction's own advisory locks come and
/// go), by a connection of that replica's `application_name`.
fn lock_holders(db: &str) -> Vec<usize> {
    let sample = || -> BTreeSet<String> {
        cluster()
            .psql(
                db,
                "SELECT DISTINCT a.application_name || '/' || l.classid || ':' || l.objid \
                 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' \
                   AND a.datname = current_database() \
                   AND a.application_name LIKE 'locker-replica-%'",
            )
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let mut held = sample();
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(300));
        let now = sample();
        held = held.intersection(&now).cloned().collect();
    }
    let holders: BTreeSet<usize> = held
        .iter()
        .filter_map(|h| {
            let app = h.split('/').next()?;
            NAMES
                .iter()
                .position(|n| app == format!("locker-replica-{}", n.to_lowercase()))
        })
        .collect();
    holders.into_iter().collect()
}

/// Polls [`lock_holders`] until exactly one replica holds the lock (`limit` at most): the
/// holders last seen.
fn leader(db: &str, limit: Duration) -> Vec<usize> {
    let deadline = Instant::now() + limit;
    loop {
        let h = lock_holders(db);
        if h.len() == 1 || Instant::now() > deadline {
            return h;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

type Rig = ReplicaRig;

/// Check 1: the fabric, two replicas on one database, haproxy before them, two nodes joined
/// through it.
fn start_rig() -> Rig {
    let rig = ReplicaRig::start("fleet-replicas", &[("a", 150), ("b", 150)]);
    println!(
        "check 1: replicas A ({}) and B ({}) on one database, haproxy before them, 2 nodes \
         joined through it",
        rig.reps[0].url, rig.reps[1].url
    );
    rig
}

/// The port each routed sandbox serves its `/tmp` on (`python3 -m http.server`), reached
/// through its preview host.
const WEB_PORT: u16 = 8000;
/// The kinds of routed calls: by path (the API's exec, files, view), by preview host (with
/// the API key, or with the sandbox's preview token and no key), by E2B's headers (envd's
/// `/files` with the access token).
const KINDS: [&str; 6] = [
    "exec",
    "file read",
    "GET",
    "preview (key)",
    "preview (token)",
    "e2b",
];

/// A sandbox of the routing check: where it runs, what its own file says, its token.
struct Routed {
    id: String,
    node: String,
    content: String,
    token: String,
}

/// One routed call, checked: did it reach sandbox `sb`'s node (its own content)?
fn routed_call(api: &Api, kind: &str, sb: &Routed) -> Result<(), String> {
    let (id, content) = (sb.id.as_str(), sb.content.as_str());
    let host = format!("{WEB_PORT}-{id}.localhost");
    let file = OWNER_FILE.strip_prefix("/tmp").unwrap();
    let r = match kind {
        "preview (key)" => api.try_request("GET", file, &[("Host", &host)], ()),
        "preview (token)" => Api::new(&api.base, None).try_request(
            "GET",
            file,
            &[("Host", &host), ("X-Locker-Token", &sb.token)],
            (),
        ),
        "e2b" => Api::new(&api.base, None).try_request(
            "GET",
            &format!("/files?path={}", enc(OWNER_FILE)),
            &[("E2b-Sandbox-Id", id), ("X-Access-Token", &sb.token)],
            (),
        ),
        "exec" => api.try_request(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            &JSON,
            serde_json::to_vec(&json!({"cmd": ["cat", OWNER_FILE]})).unwrap(),
        ),
        "file read" => api.try_request(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path={}", enc(OWNER_FILE)),
            &[],
            (),
        ),
        _ => api.try_request("GET", &format!("/v1/sandboxes/{id}"), &[], ()),
    }
    .map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    let good = r.status == 200
        && match kind {
            "exec" => v["exit_code"] == 0 && v["stdout"] == content,
            "file read" | "preview (key)" | "preview (token)" | "e2b" => {
                r.body == content.as_bytes()
            }
            _ => v["id"] == id && v["state"] == "running",
        };
    if good {
        Ok(())
    } else {
        Err(format!("HTTP {}: {}", r.status, r.text()))
    }
}

/// Check 2: 1,000 calls through A, B and haproxy all reach the sandbox's node.
fn check_routing(rig: &Rig) {
    let api_a = rig.api(0);
    let mut routed: Vec<Routed> = Vec::new();
    for i in 0..ROUTED {
        let (id, node) = create(
            &rig.hap,
            &create_body(256, None),
            "check 2: through haproxy",
        );
        let content = format!(
            "sandbox {id}, number {i}, on node {node}: {}",
            unique("own")
        );
        api_a
            .write_file(&id, OWNER_FILE, content.as_bytes())
            .expect(
                200,
                "check 2: write the sandbox's own file through replica A",
            );
        let r = api_a.exec(
            &id,
            &json!({"shell": format!("cd /tmp && python3 -m http.server {WEB_PORT} >/dev/null 2>&1 &")}),
        );
        assert_eq!(r["exit_code"], 0, "check 2: start the web server: {r}");
        let token = api_a
            .get(&format!("/v1/sandboxes/{id}"))
            .expect(200, "check 2: the sandbox's view")["preview_token"]
            .as_str()
            .expect("a preview token")
            .to_owned();
        routed.push(Routed {
            id,
            node,
            content,
            token,
        });
    }
    for sb in &routed {
        wait_for(Duration::from_secs(60), "the web servers listening", || {
            let ports = api_a
                .get(&format!("/v1/sandboxes/{}/ports", sb.id))
                .expect(200, "check 2: list ports");
            ports["ports"]
                .as_array()
                .is_some_and(|a| a.iter().any(|p| p["port"] == WEB_PORT))
                .then_some(())
        });
    }
    let mut spread: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &routed {
        *spread.entry(r.node.as_str()).or_default() += 1;
    }
    println!("check 2: {ROUTED} sandboxes, per node {spread:?}");
    let api_b = rig.api(1);
    let entries: [(&str, &Api); 3] = [
        ("replica A", &api_a),
        ("replica B", &api_b),
        ("haproxy", &rig.hap),
    ];
    let mut latency: [Vec<Duration>; 3] = Default::default();
    let mut failures: Vec<String> = Vec::new();
    let t0 = Instant::now();
    for i in 0..REQUESTS {
        // Every (entry point, sandbox) pair within 30 calls; the kind changes every 30.
        let (e, sb) = (i % 3, &routed[i % ROUTED]);
        let (name, api) = entries[e];
        let kind = KINDS[(i / 30) % KINDS.len()];
        let t = Instant::now();
        let outcome = routed_call(api, kind, sb);
        latency[e].push(t.elapsed());
        if let Err(m) = outcome {
            failures.push(format!(
                "call {i} through {name}, {kind} of {} (on node {}): {m}",
                sb.id, sb.node
            ));
        }
    }
    for (e, (name, _)) in entries.iter().enumerate() {
        let v = &mut latency[e];
        println!(
            "check 2: {} calls through {name}: p50 {:.2?}, p99 {:.2?}, max {:.2?}",
            v.len(),
            quantile(v, 0.50),
            quantile(v, 0.99),
            quantile(v, 1.0)
        );
    }
    println!(
        "check 2: {REQUESTS} calls in {:.1?}, {} failed",
        t0.elapsed(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "check 2: {} of {REQUESTS} calls did not reach the sandbox's node (its own content); \
         the first ones:\n{}",
        failures.len(),
        failures
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    // A browser's terminal: the ticket minted through replica A (it lives in the shared
    // store) opens the sandbox's shell through replica B, once.
    let id = &routed[0].id;
    let browser = locker_tests::streams::browser_terminal(&api_a, id);
    browser(&rig.reps[1].url).expect("check 2: a ticket minted through A opens through B");
    assert_eq!(
        browser(&rig.reps[0].url).err(),
        Some(401),
        "check 2: a ticket used through B opened the terminal again through A"
    );
    println!("check 2: a terminal ticket minted through A opened {id}'s shell through B, once");
    check_doors(rig, &routed[0]);
    check_e2b_and_mcp(rig, &routed[0]);
}

/// One MCP call (the stateless revision: any replica answers it) through `api`: the
/// answer's text.
fn mcp_call(api: &Api, method: &str, params: Value) -> String {
    let meta = json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "fleet-test", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {}});
    let mut params = params;
    params["_meta"] = meta;
    let name = params["name"].as_str().unwrap_or("").to_owned();
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let r = api.request(
        "POST",
        "/mcp",
        &[
            ("Accept", "application/json, text/event-stream"),
            ("Content-Type", "application/json"),
            ("MCP-Protocol-Version", "2026-07-28"),
            ("Mcp-Method", method),
            ("Mcp-Name", &name),
        ],
        body.to_string(),
    );
    assert_eq!(r.status, 200, "MCP {method}: {}", r.text());
    r.text()
}

/// Check 2, E2B's and MCP's creates: placed on a node like the API's (E2B's through replica
/// B, MCP's through haproxy), listed by E2B's lists through replica A, reached by E2B's
/// data plane and MCP's tools through either replica, and E2B's kill gives the placement
/// back at once.
fn check_e2b_and_mcp(rig: &Rig, routed: &Routed) {
    let (api_a, api_b) = (rig.api(0), rig.api(1));
    let anon_a = Api::new(&api_a.base, None);
    let anon_b = Api::new(&api_b.base, None);
    let key = [("X-API-KEY", rig.key.as_str())];
    let key_json = [key[0], ("Content-Type", "application/json")];
    // A body E2B's create refuses: E2B's shape, nothing placed.
    let before = placed_sandboxes(&rig.db).len();
    let r = anon_b.request("POST", "/sandboxes", &key_json, r#"{"templateID": ""}"#);
    assert_eq!(
        r.status,
        400,
        "check 2: E2B create, empty template: {}",
        r.text()
    );
    assert!(
        r.json()["message"]
            .as_str()
            .is_some_and(|m| m.contains("templateID")),
        "{}",
        r.text()
    );
    assert_eq!(placed_sandboxes(&rig.db).len(), before);

    let r = anon_b.request(
        "POST",
        "/sandboxes",
        &key_json,
        r#"{"templateID": "base", "timeout": 600, "metadata": {"via": "e2b"}}"#,
    );
    assert_eq!(r.status, 201, "check 2: E2B create through B: {}", r.text());
    let v = r.json();
    let id = v["sandboxID"].as_str().expect("sandboxID").to_owned();
    let token = v["envdAccessToken"]
        .as_str()
        .expect("envdAccessToken")
        .to_owned();
    let node = placed_on(&r);
    assert!(
        placed_sandboxes(&rig.db).contains(&id),
        "{id} has no placement"
    );
    // Its data plane through A: envd writes and reads a file on the node.
    let envd = |api: &Api, method: &str, body: &'static str| {
        api.request(
            method,
            &format!("/files?path={}", enc("/tmp/e2b.txt")),
            &[
                ("E2b-Sandbox-Id", id.as_str()),
                ("X-Access-Token", token.as_str()),
            ],
            body,
        )
    };
    let w = envd(&anon_a, "POST", "written through E2B's data plane");
    assert_eq!(w.status, 200, "check 2: envd write through A: {}", w.text());
    let g = envd(&anon_b, "GET", "");
    assert_eq!(
        (g.status, g.text()),
        (200, "written through E2B's data plane".to_owned()),
        "check 2: envd read through B"
    );
    // The calls older SDKs and signed URLs make, naming the sandbox by its token or a
    // signature only, through A (the sandbox runs on a node).
    let by_token = |api: &Api, token: &str| {
        api.request(
            "GET",
            &format!("/files?path={}", enc("/tmp/e2b.txt")),
            &[("X-Access-Token", token)],
            (),
        )
    };
    let g = by_token(&anon_a, &token);
    assert_eq!(
        (g.status, g.text()),
        (200, "written through E2B's data plane".to_owned()),
        "check 2: envd read by token only, through A"
    );
    let signed = |token: &str| {
        let raw = format!("/tmp/e2b.txt:read::{token}");
        let b64 = locker_types::base64::encode(&sha2::Sha256::digest(raw.as_bytes()));
        // A signature's `+` is a space in a query unless encoded.
        format!(
            "/files?path={}&signature={}",
            enc("/tmp/e2b.txt"),
            enc(&format!("v1_{}", b64.trim_end_matches('=')))
        )
    };
    let g = anon_a.request("GET", &signed(&token), &[], ());
    assert_eq!(
        (g.status, g.text()),
        (200, "written through E2B's data plane".to_owned()),
        "check 2: a signed download URL through A"
    );
    // A rotation through B: the new token finds the sandbox through A, the old one nothing.
    let rot = api_b
        .post(&format!("/v1/sandboxes/{id}/preview-token"), &json!({}))
        .expect(200, "check 2: rotate the token through B");
    let fresh = rot["preview_token"]
        .as_str()
        .expect("a new token")
        .to_owned();
    assert!(
        rot["preview_url"]
            .as_str()
            .is_some_and(|u| u.contains(&format!("-{id}.localhost:"))),
        "check 2: the rotation's preview URL is the replicas': {rot}"
    );
    assert_eq!(
        by_token(&anon_a, &fresh).status,
        200,
        "check 2: the new token"
    );
    assert_ne!(
        by_token(&anon_a, &token).status,
        200,
        "check 2: the old token"
    );
    assert_ne!(
        anon_a.request("GET", &signed(&token), &[], ()).status,
        200,
        "check 2: a URL signed with the old token"
    );
    // E2B's lists through A (v2 paged, v1 flat) and Locker's list show it, on its node.
    let l2 = anon_a.request("GET", "/v2/sandboxes?metadata=via%3De2b", &key, ());
    assert_eq!(l2.status, 200, "{}", l2.text());
    let ids: Vec<&str> = l2
        .json()
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["sandboxID"].as_str())
        .collect::<Vec<_>>()
        .into_iter()
        .map(|s| if s == id { "it" } else { "other" })
        .collect();
    assert_eq!(
        ids,
        ["it"],
        "check 2: E2B's v2 list through A: {}",
        l2.text()
    );
    let l1 = anon_a.request("GET", "/sandboxes", &key, ());
    assert!(
        l1.text().contains(&id),
        "check 2: E2B's v1 list through A: {}",
        l1.text()
    );
    let listed = api_a.get("/v1/sandboxes?limit=1000").expect(200, "list");
    let mine = listed["sandboxes"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["id"] == id.as_str()).cloned())
        .unwrap_or_else(|| panic!("check 2: {id} not in Locker's list: {listed}"));
    // Preview hosts are the replicas': their domain, not the node's (which has none).
    assert!(
        v["domain"]
            .as_str()
            .is_some_and(|d| d.starts_with("localhost:")),
        "check 2: E2B's domain: {v}"
    );
    assert!(
        mine["preview_url"]
            .as_str()
            .is_some_and(|u| u.starts_with(&format!("http://{{port}}-{id}.localhost:"))),
        "check 2: the preview URL: {mine}"
    );
    let node_id = fleet_node(&fleet_nodes(&rig.reps[0].admin()), &node)["id"].clone();
    assert_eq!(
        (&mine["node"], &mine["metadata"]["via"]),
        (&node_id, &json!("e2b")),
        "{mine}"
    );

    // MCP through haproxy: a tool reaches a sandbox on a node; a create is placed.
    let text = mcp_call(
        &rig.hap,
        "tools/call",
        json!({"name": "exec", "arguments": {"sandbox_id": routed.id, "cmd": ["cat", OWNER_FILE]}}),
    );
    let owner = serde_json::to_string(&routed.content).unwrap();
    assert!(
        text.contains(owner.trim_matches('"')),
        "check 2: MCP's exec on {} did not read its own file: {text}",
        routed.id
    );
    let text = mcp_call(
        &rig.hap,
        "tools/call",
        json!({"name": "sandbox_create", "arguments": {}}),
    );
    let made: Vec<String> = placed_sandboxes(&rig.db)
        .into_iter()
        .filter(|s| text.contains(s.as_str()))
        .collect();
    assert_eq!(
        made.len(),
        1,
        "check 2: MCP's sandbox_create was not placed: {text}"
    );
    let r = rig.hap.delete(&format!("/v1/sandboxes/{}", made[0]));
    assert_eq!(r.status, 204, "{}", r.text());

    // E2B's kill through haproxy: gone from its node, and its placement given back at once.
    let r = rig
        .hap
        .request("DELETE", &format!("/sandboxes/{id}"), &key, ());
    assert_eq!(r.status, 204, "check 2: E2B kill: {}", r.text());
    assert!(
        !placed_sandboxes(&rig.db).contains(&id),
        "{id} kept its placement"
    );
    assert_eq!(api_b.get(&format!("/v1/sandboxes/{id}")).status, 404);
    println!(
        "check 2: E2B's create through B placed {id} on node {node}; its envd, lists and kill \
         and MCP's exec and create through the other doors reached the node"
    );
}

/// Check 2, the doors other than paths for a sandbox on a node, through replica B: a
/// preview host lets the key, the token or nothing in as one host does (the key never
/// reaches the app, the app's own `Authorization` does); E2B's calls about the sandbox
/// reach it with `X-API-KEY`, its snapshots are kept on the node and its forks' children
/// placed there, as the API's are.
fn check_doors(rig: &Rig, sb: &Routed) {
    let api_b = rig.api(1);
    let anon = Api::new(&api_b.base, None);
    let id = &sb.id;
    api_b
        .put(
            &format!("/v1/sandboxes/{id}/files?path={}", enc("/root/srv.py")),
            locker_tests::HTTP_SERVER_PY.as_bytes(),
        )
        .expect(200, "check 2: upload the echo server");
    let r = api_b.exec(id, &json!({"shell": "python3 /root/srv.py 8001 &"}));
    assert_eq!(r["exit_code"], 0, "{r}");
    let host = format!("8001-{id}.localhost");
    let seen = wait_for(Duration::from_secs(60), "the echo server", || {
        let r = api_b
            .try_request("GET", "/v1/sandboxes?x=1", &[("Host", &host)], ())
            .ok()?;
        (r.status == 200).then(|| r.json())
    });
    assert_eq!(seen["path"], "/v1/sandboxes?x=1", "{seen}");
    assert!(
        seen["headers"].get("authorization").is_none()
            && seen["headers"].get("x-locker-preview").is_none()
            && seen["headers"].get("x-locker-preview-key").is_none(),
        "check 2: the key or the fleet's headers reached the app: {seen}"
    );
    // As on one host: the app is asked for `127.0.0.1:{port}`, the preview host forwarded.
    assert_eq!(seen["headers"]["x-forwarded-host"], host, "{seen}");
    let r = anon.request("GET", "/", &[("Host", &host)], ());
    assert_eq!(r.status, 401, "check 2: no credentials: {}", r.text());
    assert!(r.text().contains("private"), "{}", r.text());
    let r = anon.request(
        "GET",
        "/",
        &[("Host", &host), ("X-Locker-Token", "lpt_wrong")],
        (),
    );
    assert_eq!(r.status, 401, "check 2: a wrong token: {}", r.text());
    let r = anon.request(
        "GET",
        "/app",
        &[
            ("Host", &host),
            ("X-Locker-Token", &sb.token),
            ("Authorization", "Basic YXBwOnNlY3JldA=="),
            ("Origin", "http://app.example"),
        ],
        (),
    );
    assert_eq!(r.status, 200, "check 2: token: {}", r.text());
    let seen = r.json();
    assert_eq!(
        (
            &seen["headers"]["authorization"],
            &seen["headers"]["origin"]
        ),
        (
            &json!("Basic YXBwOnNlY3JldA=="),
            &json!("http://app.example")
        ),
        "check 2: the app's own Authorization and Origin: {seen}"
    );
    assert!(seen["headers"].get("x-locker-token").is_none(), "{seen}");
    let r = anon.request(
        "GET",
        "/",
        &[("Host", &host), ("Authorization", "Bearer lk_not_a_key")],
        (),
    );
    assert_eq!(r.status, 401, "check 2: a bad key: {}", r.text());

    let e2b = [("X-API-KEY", rig.key.as_str())];
    let r = anon.request("GET", &format!("/sandboxes/{id}"), &e2b, ());
    assert_eq!(r.status, 200, "check 2: E2B's info: {}", r.text());
    assert_eq!(
        (&r.json()["sandboxID"], &r.json()["envdAccessToken"]),
        (&json!(id), &json!(sb.token)),
        "{}",
        r.text()
    );
    let r = anon.request(
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        &[e2b[0], ("Content-Type", "application/json")],
        "{}",
    );
    assert_eq!(r.status, 201, "check 2: E2B's snapshot: {}", r.text());
    let snap = r.json()["snapshotID"].as_str().unwrap().to_owned();
    let r = anon.request("GET", "/snapshots", &e2b, ());
    assert!(
        r.json()
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["snapshotID"] == snap.as_str()),
        "check 2: E2B's snapshot listed: {}",
        r.text()
    );
    let r = anon.request("DELETE", &format!("/templates/{snap}"), &e2b, ());
    assert_eq!(
        r.status,
        204,
        "check 2: E2B's snapshot deleted: {}",
        r.text()
    );
    let r = anon.request("DELETE", &format!("/templates/{snap}"), &e2b, ());
    assert_eq!(r.status, 404, "check 2: deleted twice: {}", r.text());
    assert_eq!(r.json()["code"], 404, "E2B's error shape: {}", r.text());
    let r = anon.request(
        "POST",
        &format!("/sandboxes/{id}/fork"),
        &[e2b[0], ("Content-Type", "application/json")],
        "{}",
    );
    assert_eq!(r.status, 201, "check 2: E2B's fork: {}", r.text());
    let child = r.json()[0]["sandbox"]["sandboxID"]
        .as_str()
        .unwrap()
        .to_owned();
    // Placed on the parent's node, reached through the other replica, listed with the
    // API's view of it.
    let api_a = rig.api(0);
    let v = api_a
        .get(&format!("/v1/sandboxes/{child}"))
        .expect(200, "check 2: E2B's child through replica A");
    assert_eq!(v["state"], "running", "{v}");
    let listed = api_a
        .get("/v1/sandboxes?limit=1000")
        .expect(200, "the list");
    let item = |sb: &str| {
        listed["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == sb)
            .unwrap_or_else(|| panic!("{sb} not listed: {listed}"))
            .clone()
    };
    let (c, p) = (item(&child), item(id));
    assert_eq!(c["node"], p["node"], "{c} {p}");
    assert!(c["template_digest"].is_string(), "{c}");
    let r = anon.request("DELETE", &format!("/sandboxes/{child}"), &e2b, ());
    assert_eq!(
        r.status,
        204,
        "check 2: E2B's kill of the child: {}",
        r.text()
    );
    let r = anon.request(
        "GET",
        &format!("/sandboxes/{id}"),
        &[("X-API-KEY", "lk_not_a_key")],
        (),
    );
    assert_eq!(
        r.status,
        401,
        "check 2: E2B without a good key: {}",
        r.text()
    );
    println!(
        "check 2: {id}'s preview host and E2B calls through replica B reach its node, with \
         one host's rules"
    );
}

/// Check 4: a replica killed (and started again) while 200 creates run through haproxy;
/// then the books balance, and deleting everything empties the nodes.
fn check_replica_kill_during_creates(rig: &mut Rig) {
    let holders = lock_holders(&rig.db);
    // The one that does not lead (B when that cannot be told): the leader is killed in 3.
    let victim = if holders.len() == 1 {
        1 - holders[0]
    } else {
        1
    };
    println!(
        "check 4: leader lock held by {:?}; killing replica {} during the creates",
        holders.iter().map(|&i| NAMES[i]).collect::<Vec<_>>(),
        NAMES[victim]
    );
    let t0 = Instant::now();
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let outcomes: Mutex<Vec<(Outcome, Vec<String>)>> = Mutex::new(Vec::new());
    let (mut killed_after, mut restarted_after) = (0, 0);
    let hap = rig.hap.clone();
    let reps = &mut rig.reps;
    std::thread::scope(|s| {
        for _ in 0..CREATORS {
            s.spawn(|| {
                while next.fetch_add(1, Ordering::Relaxed) < CREATES {
                    let o = create_retrying(&hap);
                    outcomes.lock().unwrap().push(o);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while done.load(Ordering::Relaxed) < 30 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        reps[victim].kill9();
        killed_after = done.load(Ordering::Relaxed);
        // A little later: 15 more creates answered by the survivor (3 s at most).
        let back = Instant::now() + Duration::from_secs(3);
        while done.load(Ordering::Relaxed) < (killed_after + 15).min(CREATES)
            && Instant::now() < back
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        reps[victim].restart_on_same_port();
        restarted_after = done.load(Ordering::Relaxed);
    });
    let outcomes = outcomes.into_inner().unwrap();
    let retried: Vec<&String> = outcomes.iter().flat_map(|(_, e)| e).collect();
    let mut created: Vec<(String, String)> = Vec::new();
    let (mut gave_up, mut refused) = (Vec::new(), Vec::new());
    for (o, _) in &outcomes {
        match o {
            Outcome::Created { id, node } => created.push((id.clone(), node.clone())),
            Outcome::GaveUp(e) => gave_up.push(e),
            Outcome::Refused(e) => refused.push(e),
        }
    }
    println!(
        "check 4: {CREATES} creates in {:.1?} (replica {} killed after {killed_after} answers, \
         started again after {restarted_after}): {} created, {} gave up after {TRIES} tries, \
         {} refused; {} retriable errors on the way",
        t0.elapsed(),
        NAMES[victim],
        created.len(),
        gave_up.len(),
        refused.len(),
        retried.len()
    );
    for e in retried.iter().take(8) {
        let line: String = e.split_whitespace().collect::<Vec<_>>().join(" ");
        println!(
            "check 4:   retried: {}",
            line.chars().take(160).collect::<String>()
        );
    }
    assert_eq!(
        outcomes.len(),
        CREATES,
        "check 4: every create has an outcome"
    );
    assert!(
        refused.is_empty(),
        "check 4: creates refused with a non-retriable answer (a 4xx other than 429) while a \
         replica died: {refused:#?}"
    );
    // The replica started again makes sandboxes too.
    created.push(create(
        &rig.api(victim),
        &create_body(128, Some(512)),
        "check 4: through the restarted replica",
    ));

    // Reconciliation (on the leader, every 5 s): orphans destroyed after two sightings 10 s
    // apart, creates that died with their replica resolved. Polled, 45 s at most.
    let t_books = Instant::now();
    let mut wrong = books(&rig.db, &rig.nodes, &created);
    println!(
        "check 4: the books right after the creates (to be reconciled): {:?}",
        kinds(&wrong)
    );
    for w in wrong.iter().take(6) {
        println!("check 4:   {w}");
    }
    while !wrong.is_empty() && t_books.elapsed() < Duration::from_secs(45) {
        std::thread::sleep(Duration::from_millis(500));
        wrong = books(&rig.db, &rig.nodes, &created);
    }
    assert!(
        wrong.is_empty(),
        "check 4: the fleet's books do not balance {:.0?} after the creates ended ({:?}):\n{}",
        t_books.elapsed(),
        kinds(&wrong),
        wrong.join("\n")
    );
    println!(
        "check 4: books balance {:.1?} after the creates: no placement starting, every \
         placed sandbox on its node, 0 orphans, reservations = placements",
        t_books.elapsed()
    );
    // Every sandbox answered 201 runs.
    let not_running: Vec<String> = created
        .iter()
        .filter_map(|(id, node)| {
            match rig
                .hap
                .try_request("GET", &format!("/v1/sandboxes/{id}"), &[], ())
            {
                Ok(r) if r.status == 200 && r.json()["state"] == "running" => None,
                other => Some(format!(
                    "{id} on {node}: {:?}",
                    other.map(|r| (r.status, r.text()))
                )),
            }
        })
        .collect();
    assert!(
        not_running.is_empty(),
        "check 4: sandboxes created (201) while a replica died do not run: {not_running:#?}"
    );

    // Everything deleted through haproxy: the nodes are empty, nothing reserved.
    let all: Vec<String> = placed_sandboxes(&rig.db);
    let t_delete = Instant::now();
    let failed = delete_all(&rig.hap, &all, CREATORS);
    assert!(
        failed.is_empty(),
        "check 4: deletes through haproxy failed: {failed:#?}"
    );
    println!(
        "check 4: {} sandboxes ({} answered 201, and those made for creates whose answer was \
         lost) deleted through haproxy in {:.1?}",
        all.len(),
        created.len(),
        t_delete.elapsed()
    );
    for n in &rig.nodes {
        let left = sandbox_dirs(n);
        assert!(
            left.is_empty(),
            "check 4: node {} still holds sandboxes after every delete: {left:?}",
            n.name
        );
    }
    let reserved = rows(
        &rig.db,
        "SELECT name, reserved_slots, reserved_memory_mb FROM nodes ORDER BY name",
    );
    assert!(
        reserved.iter().all(|r| r[1] == "0" && r[2] == "0"),
        "check 4: reservations left after every delete: {reserved:?}"
    );
    let left = rows(&rig.db, "SELECT id, state, sandbox_id FROM placements");
    assert!(
        left.is_empty(),
        "check 4: placements left after every delete: {left:?}"
    );
    let list = rig.hap.get("/v1/sandboxes").expect(200, "list");
    assert_eq!(list["total"], 0, "check 4: sandboxes listed: {list}");
}

/// Each of `ids`' `state` through `api` (or what answered instead).
fn states(api: &Api, ids: &[String]) -> Vec<String> {
    ids.iter()
        .map(
            |id| match api.try_request("GET", &format!("/v1/sandboxes/{id}"), &[], ()) {
                Ok(r) => serde_json::from_slice::<Value>(&r.body).unwrap_or(Value::Null)["state"]
                    .as_str()
                    .map_or_else(|| format!("HTTP {}: {}", r.status, r.text()), str::to_owned),
                Err(e) => e.to_string(),
            },
        )
        .collect()
}

/// Polls until every state of `ids` through every one of `apis` is `lost` (15 s at most):
/// the states last seen, through each.
fn until_lost(apis: &[&Api], ids: &[String]) -> Vec<Vec<String>> {
    let t0 = Instant::now();
    loop {
        let seen: Vec<Vec<String>> = apis.iter().map(|a| states(a, ids)).collect();
        if seen.iter().flatten().all(|s| s == "lost") || t0.elapsed() > Duration::from_secs(15) {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Check 3: the leader dies, then node a: the other replica takes over the sweeping. The
/// dead leader's index.
fn check_leader_failover(rig: &mut Rig) -> usize {
    let mut on: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let both = |on: &BTreeMap<String, Vec<String>>| {
        ["a", "b"]
            .iter()
            .all(|n| on.get(*n).is_some_and(|v| v.len() >= 2))
    };
    // Placement spreads them (each on the emptier of the two, or either while its table is
    // a moment old): 20 creates at most.
    for _ in 0..20 {
        if both(&on) {
            break;
        }
        let (id, node) = create(
            &rig.hap,
            &create_body(256, None),
            "check 3: through haproxy",
        );
        on.entry(node).or_default().push(id);
    }
    assert!(
        both(&on),
        "check 3: 20 creates did not put 2 sandboxes on each node: {on:?}"
    );
    let holders = leader(&rig.db, Duration::from_secs(10));
    assert_eq!(
        holders.len(),
        1,
        "check 3: exactly one replica holds the fleet's leader lock (an exclusive session \
         advisory lock, pg_try_advisory_lock); holders for 10 s: {:?}",
        holders.iter().map(|&i| NAMES[i]).collect::<Vec<_>>()
    );
    let (l, f) = (holders[0], 1 - holders[0]);
    let api_f = rig.api(f);
    // The survivor routes calls to a's sandboxes (it caches their node) before a dies.
    for id in &on["a"] {
        assert_eq!(
            api_f.sh(id, "echo before"),
            "before\n",
            "check 3: {id} on a"
        );
    }
    let b_epoch = fleet_node(&fleet_nodes(&rig.reps[f].admin()), "b")["epoch"].clone();
    println!(
        "check 3: replica {} leads; killing it, then node a",
        NAMES[l]
    );
    rig.reps[l].kill9();
    rig.nodes[0].signal(libc::SIGKILL);
    let killed = Instant::now();
    let seen = until_lost(&[&api_f, &rig.hap], &on["a"]);
    assert!(
        seen.iter().flatten().all(|s| s == "lost"),
        "check 3: 15 s after the leader (replica {l}) and node a were killed, a's sandboxes \
         read {:?} through replica {f} and {:?} through haproxy, not `lost` (did {f} take \
         over the sweeping?)",
        seen[0],
        seen[1],
        l = NAMES[l],
        f = NAMES[f],
    );
    println!(
        "check 3: a's sandboxes lost through replica {} and haproxy {:.1?} after the kills \
         (lease {LEASE:?})",
        NAMES[f],
        killed.elapsed()
    );
    assert_eq!(
        leader(&rig.db, Duration::from_secs(5)),
        vec![f],
        "check 3: replica {} does not hold the leader lock after {}'s death",
        NAMES[f],
        NAMES[l]
    );
    assert!(
        rig.reps[f].log_text().contains("node declared dead"),
        "check 3: replica {}'s log does not say it declared node a dead",
        NAMES[f]
    );
    for api in [&api_f, &rig.hap] {
        for id in &on["b"] {
            let r = api.post(
                &format!("/v1/sandboxes/{id}/exec"),
                &json!({"shell": "echo alive"}),
            );
            assert!(
                r.status == 200 && r.json()["stdout"] == "alive\n",
                "check 3: node b's sandbox {id} through {}: HTTP {}: {}",
                api.base,
                r.status,
                r.text()
            );
        }
        api.post(
            &format!("/v1/sandboxes/{}/exec", on["a"][0]),
            &json!({"shell": "true"}),
        )
        .expect_error(410, "gone", "check 3: exec in a lost sandbox");
    }
    let l_nodes = fleet_nodes(&rig.reps[f].admin());
    let b = fleet_node(&l_nodes, "b");
    assert!(
        b["alive"] == true && b["epoch"] == b_epoch,
        "check 3: node b was declared dead in the failover: {b}"
    );
    assert_eq!(fleet_node(&l_nodes, "a")["state"], "dead", "check 3: a");
    // Lost sandboxes go with a delete; b's are deleted on b.
    let rest: Vec<String> = on.values().flatten().cloned().collect();
    let failed = delete_all(&rig.hap, &rest, CREATORS);
    assert!(
        failed.is_empty(),
        "check 3: deletes through haproxy: {failed:#?}"
    );
    assert!(
        sandbox_dirs(&rig.nodes[1]).is_empty(),
        "check 3: b still holds sandboxes after their deletes"
    );
    l
}

/// Check 5: a follower's routes do not outlive a node. The killed leader `x` comes back (a
/// follower); the leadership moves back to it (the other, `y`, killed and started again:
/// a new leader's limit of one node declared dead a minute starts afresh); `y` routes calls
/// to two sandboxes of b (caching b as their node), then b dies: its sandboxes read `lost`
/// through the leader, the follower and haproxy, and their deletes work through each.
fn check_follower_routes(rig: &mut Rig, x: usize) {
    let y = 1 - x;
    rig.reps[x].restart_on_same_port();
    let on_b: Vec<String> = (0..2)
        .map(|_| {
            let (id, node) = create(
                &rig.hap,
                &create_body(256, None),
                "check 5: through haproxy",
            );
            assert_eq!(node, "b", "check 5: a is dead");
            id
        })
        .collect();
    rig.reps[y].kill9();
    assert_eq!(
        leader(&rig.db, Duration::from_secs(10)),
        vec![x],
        "check 5: replica {} does not take the leader lock after {}'s death",
        NAMES[x],
        NAMES[y]
    );
    rig.reps[y].restart_on_same_port();
    let (api_x, api_y) = (rig.api(x), rig.api(y));
    for id in &on_b {
        assert_eq!(
            api_y.sh(id, "echo cached"),
            "cached\n",
            "check 5: {id} through {}",
            NAMES[y]
        );
    }
    rig.nodes[1].signal(libc::SIGKILL);
    let killed = Instant::now();
    let seen = until_lost(&[&api_x, &api_y, &rig.hap], &on_b);
    println!(
        "check 5: {:.1?} after node b's death, its sandboxes read {:?} through the leader {}, \
         {:?} through the follower {}, {:?} through haproxy",
        killed.elapsed(),
        seen[0],
        NAMES[x],
        seen[1],
        NAMES[y],
        seen[2]
    );
    assert!(
        seen[0].iter().all(|s| s == "lost"),
        "check 5: 15 s after node b's death, its sandboxes read {:?} through the leader {}, \
         not `lost`",
        seen[0],
        NAMES[x]
    );
    assert!(
        seen[1].iter().chain(&seen[2]).all(|s| s == "lost"),
        "check 5: node b's sandboxes read `lost` through the leader {x}, but {:?} through the \
         follower {y} and {:?} through haproxy: the follower's cached routes outlive the \
         node it no longer reaches",
        seen[1],
        seen[2],
        x = NAMES[x],
        y = NAMES[y],
    );
    let failed = delete_all(&rig.hap, &on_b, CREATORS);
    assert!(
        failed.is_empty(),
        "check 5: deletes of lost sandboxes through haproxy: {failed:#?}"
    );
}

#[test]
fn control_replicas_share_one_database_behind_haproxy() {
    let t0 = Instant::now();
    let mut rig = start_rig();
    println!("check 1 passed ({:.1?})", t0.elapsed());
    let t = Instant::now();
    check_routing(&rig);
    println!("check 2 passed ({:.1?})", t.elapsed());
    let t = Instant::now();
    check_replica_kill_during_creates(&mut rig);
    println!("check 4 passed ({:.1?})", t.elapsed());
    let t = Instant::now();
    let dead = check_leader_failover(&mut rig);
    println!("check 3 passed ({:.1?})", t.elapsed());
    let t = Instant::now();
    check_follower_routes(&mut rig, dead);
    println!("check 5 passed ({:.1?})", t.elapsed());
    println!("all checks passed in {:.1?}", t0.elapsed());
}
