//! Fleet soak (`FLEET.md` §5.2 test 11): 4 nodes of different sizes, two control replicas
//! on one Postgres database behind haproxy, and a mixed workload of jail sandboxes for a
//! while, with the invariants of tests 2 (capacity), 3 (routing) and 5 (never served twice)
//! checked every second, and the books checked once the workload stops.
//!
//! What it proves, for the whole run:
//! - **capacity**: on every node, its placements and `reserved_slots` never exceed its slots,
//!   nor does what it reports running or holds on disk; a create is refused (429) only when
//!   the fleet is (nearly) full;
//! - **routing**: every exec, file read and GET about a sandbox, through replica A, replica
//!   B or haproxy, answers with that sandbox's own content (a file written at its create,
//!   unique to it); a deleted sandbox answers 404 through another entry point;
//! - **never served twice**: no sandbox is in two nodes' `sandboxes/` at once, nor on a node
//!   other than its placement's; no node is declared dead or fenced (nothing is killed);
//! - **no server error**: no 5xx and no broken connection (nothing is killed here);
//! - **books**: one reconcile period after the workload stops, no placement is `starting`,
//!   placements are exactly the sandboxes on the nodes (0 orphans), each node's reservation
//!   is its count of placements, and every create answered 201 and not deleted is `placed`
//!   on the node its answer named, runs, and reads back its own file; deleting everything
//!   then empties the nodes.
//!
//! Several clients create (the live count climbs until the fleet is full or [`HIGH`]), exec,
//! read, GET and delete (down to [`LOW`]), round and round; operations, errors and p50/p99
//! latencies per kind are printed at the end, with the checks run and any violation.
//!
//! The run lasts `LOCKER_SOAK_SECS` seconds, 45 by default (CI). The full soak of the design,
//! 10 minutes:
//!
//! ```sh
//! LOCKER_SOAK_SECS=600 LOCKER_BIN=$PWD/target/release/locker \
//!   LOCKER_AGENT_BIN=$PWD/target/x86_64-unknown-linux-gnu/release/locker-agent \
//!   cargo test --release -q -p locker-tests --test fleet_soak -- --nocapture
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use locker_tests::fabric::NodeProc;
use locker_tests::fleet::{
    books, delete_all, kinds, placed_on, placed_sandboxes, quantile, rows, sandbox_dirs, ReplicaRig,
};
use locker_tests::server::{enc, Api, Resp};
use locker_tests::unique;
use serde_json::{json, Value};

/// The nodes and their slots (200 in all: the fleet fills at the top of each cycle).
const NODES: [(&str, u32); 4] = [("n1", 40), ("n2", 70), ("n3", 70), ("n4", 20)];
/// Client threads of the workload.
const CLIENTS: usize = 6;
/// The live count the clients climb to (at most), and go back down to.
const HIGH: usize = 200;
const LOW: usize = 100;
/// Every create.
const BODY: &str = r#"{"runtime":"jail","ttl_s":900,"memory_mb":128,"disk_mb":256}"#;
/// The file each sandbox holds from its create on, its content its own.
const OWNER_FILE: &str = "/tmp/owner.txt";
/// The default duration (CI); `LOCKER_SOAK_SECS` sets another.
const DEFAULT_SECS: u64 = 45;
/// How long the books may take to balance once the workload stops (the leader reconciles
/// every 5 s; orphans go after two sightings 10 s apart).
const BOOKS_LIMIT: Duration = Duration::from_secs(40);
/// The leader's reconcile period, and a little more.
const RECONCILE: Duration = Duration::from_secs(6);
const JSON: [(&str, &str); 1] = [("Content-Type", "application/json")];
/// The operations, in the order the summary prints them.
const KINDS: [&str; 7] = ["create", "write", "exec", "read", "get", "delete", "gone"];

type Rig = ReplicaRig;

/// The three ways in: replica A, replica B, haproxy.
fn entries(rig: &Rig) -> [(&'static str, Api); 3] {
    [
        ("A", rig.api(0)),
        ("B", rig.api(1)),
        ("haproxy", rig.hap.clone()),
    ]
}

/// The fabric, Postgres, two replicas behind haproxy, four nodes joined through it.
fn start_rig() -> Rig {
    ReplicaRig::start("fleet-soak", &NODES)
}

/// What the invariants found wrong, by kind (`kind: detail`); never a panic in a thread.
#[derive(Default)]
struct Violations(Mutex<Vec<String>>);

impl Violations {
    fn add(&self, kind: &str, detail: impl AsRef<str>) {
        let d: String = detail
            .as_ref()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let d: String = d.chars().take(400).collect();
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(format!("{kind}: {d}"));
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A live sandbox: its node (from its create's answer) and its own file's content (`None`
/// when writing it failed, a violation already).
struct Sb {
    id: String,
    node: String,
    content: Option<String>,
}

/// The sandboxes no client is using now, and the fleet's live count.
struct Pool {
    free: Mutex<Vec<Sb>>,
    live: AtomicUsize,
    growing: AtomicBool,
    /// Deletes whose outcome is unknown (an error answer): left out of the final check.
    unsure: Mutex<Vec<String>>,
    /// Times the live count turned from climbing to falling.
    cycles: AtomicUsize,
    /// The live count's lowest and highest (after the first climb).
    low_high: Mutex<(usize, usize)>,
}

impl Pool {
    fn take(&self, rng: &mut Rng) -> Option<Sb> {
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_empty() {
            return None;
        }
        let i = rng.below(f.len());
        Some(f.swap_remove(i))
    }

    fn put(&self, sb: Sb) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(sb);
    }

    /// Climbing stops at [`HIGH`] or when the fleet is full; falling stops at [`LOW`].
    fn turn(&self, full: bool) {
        let live = self.live.load(Ordering::Relaxed);
        if self.growing.load(Ordering::Relaxed) && (full || live >= HIGH) {
            if self.growing.swap(false, Ordering::Relaxed) {
                self.cycles.fetch_add(1, Ordering::Relaxed);
            }
        } else if !self.growing.load(Ordering::Relaxed) && live <= LOW {
            self.growing.store(true, Ordering::Relaxed);
        }
        if self.cycles.load(Ordering::Relaxed) > 0 {
            let mut lh = self.low_high.lock().unwrap_or_else(|e| e.into_inner());
            lh.0 = lh.0.min(live);
            lh.1 = lh.1.max(live);
        }
    }
}

/// A small xorshift generator (no crate for it).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        Rng((t ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x % n.max(1) as u64) as usize
    }
}

/// One client's counts: operations, errors (`kind status`) and latencies per kind, and
/// operations per entry point.
#[derive(Default)]
struct Stats {
    ops: BTreeMap<&'static str, usize>,
    errors: BTreeMap<String, usize>,
    latency: BTreeMap<&'static str, Vec<Duration>>,
    entries: BTreeMap<&'static str, usize>,
}

impl Stats {
    fn merge(&mut self, o: Stats) {
        for (k, v) in o.ops {
            *self.ops.entry(k).or_default() += v;
        }
        for (k, v) in o.errors {
            *self.errors.entry(k).or_default() += v;
        }
        for (k, v) in o.latency {
            self.latency.entry(k).or_default().extend(v);
        }
        for (k, v) in o.entries {
            *self.entries.entry(k).or_default() += v;
        }
    }
}

/// What a client needs: the entry points, the pool, where violations go, the database.
struct Ctx<'a> {
    entries: &'a [(&'static str, Api); 3],
    pool: &'a Pool,
    bad: &'a Violations,
    db: &'a str,
    created: &'a Mutex<Vec<(String, String)>>,
}

/// `sql`'s rows, or why not (psql's panic caught: never a panic in a thread).
fn try_rows(db: &str, sql: &str) -> Result<Vec<Vec<String>>, String> {
    std::panic::catch_unwind(AssertUnwindSafe(|| rows(db, sql))).map_err(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// One client: operations until `end`.
fn client(cx: &Ctx, n: usize, end: Instant) -> Stats {
    let mut st = Stats::default();
    let mut rng = Rng::new(n as u64 + 1);
    let mut calls = 0usize;
    while Instant::now() < end {
        cx.pool.turn(false);
        let live = cx.pool.live.load(Ordering::Relaxed);
        let roll = rng.below(100);
        // Climbing: mostly creates; falling: mostly deletes; calls in both.
        let (c, d) = if cx.pool.growing.load(Ordering::Relaxed) {
            (45, 85)
        } else {
            (15, 55)
        };
        let want = if roll < c {
            "create"
        } else if roll >= d {
            "delete"
        } else {
            ["exec", "exec", "read", "get"][roll % 4]
        };
        calls += 1;
        let e = (n + calls) % cx.entries.len();
        if want == "create" && live < HIGH {
            create(cx, &mut st, e, &mut rng);
            continue;
        }
        let Some(sb) = cx.pool.take(&mut rng) else {
            if live < HIGH {
                create(cx, &mut st, e, &mut rng);
            } else {
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        };
        match want {
            "delete" => delete(cx, &mut st, e, sb),
            "create" => {
                // Full (HIGH live): a call instead.
                call(cx, &mut st, e, "exec", &sb, calls);
                cx.pool.put(sb);
            }
            kind => {
                call(cx, &mut st, e, kind, &sb, calls);
                cx.pool.put(sb);
            }
        }
    }
    st
}

/// Records an error answer to a `kind` call about `subject` through entry `e`: counted by
/// kind and status, and a violation (nothing is killed here, so no error is expected; a
/// create's 429 is counted by [`create`] instead).
fn error(
    cx: &Ctx,
    st: &mut Stats,
    kind: &str,
    subject: &str,
    e: usize,
    r: &Result<Resp, ureq::Error>,
) {
    let (status, what, text) = match r {
        Ok(r) if r.status >= 500 => (r.status.to_string(), "5xx", r.text()),
        Ok(r) => (r.status.to_string(), "4xx", r.text()),
        Err(err) => ("transport".to_owned(), "transport", err.to_string()),
    };
    *st.errors.entry(format!("{kind} {status}")).or_default() += 1;
    let entry = cx.entries[e].0;
    cx.bad.add(
        what,
        format!("{kind} {subject} through {entry}: {status}: {text}"),
    );
}

fn create(cx: &Ctx, st: &mut Stats, e: usize, rng: &mut Rng) {
    let (entry, api) = &cx.entries[e];
    *st.ops.entry("create").or_default() += 1;
    *st.entries.entry(entry).or_default() += 1;
    let t = Instant::now();
    let r = api.try_request("POST", "/v1/sandboxes", &JSON, BODY.as_bytes().to_vec());
    let took = t.elapsed();
    let resp = match r {
        Ok(resp) if resp.status == 201 => resp,
        Ok(resp) if resp.status == 429 => {
            *st.errors.entry("create 429".into()).or_default() += 1;
            cx.pool.turn(true);
            refused(cx, entry, &resp);
            return;
        }
        other => {
            error(cx, st, "create", "of a sandbox", e, &other);
            return;
        }
    };
    st.latency.entry("create").or_default().push(took);
    let id = serde_json::from_slice::<Value>(&resp.body)
        .ok()
        .and_then(|v| v["id"].as_str().map(str::to_owned));
    let Some(id) = id else {
        cx.bad
            .add("4xx", format!("create: 201 without an id: {}", resp.text()));
        return;
    };
    let node = placed_on(&resp);
    if !NODES.iter().any(|(n, _)| *n == node) {
        cx.bad.add(
            "routing",
            format!("create of {id}: node {node:?} is none of the fleet's"),
        );
    }
    cx.pool.live.fetch_add(1, Ordering::Relaxed);
    cx.created
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((id.clone(), node.clone()));
    // Its own file, written through another entry point.
    let content = format!("{id} on {node}: {}", unique("own"));
    let w = (e + 1 + rng.below(2)) % cx.entries.len();
    let (wentry, wapi) = &cx.entries[w];
    *st.ops.entry("write").or_default() += 1;
    *st.entries.entry(wentry).or_default() += 1;
    let t = Instant::now();
    let r = wapi.try_request(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path={}", enc(OWNER_FILE)),
        &[("Content-Type", "application/octet-stream")],
        content.as_bytes().to_vec(),
    );
    let took = t.elapsed();
    let content = match &r {
        Ok(resp) if resp.status == 200 => {
            st.latency.entry("write").or_default().push(took);
            Some(content)
        }
        _ => {
            error(cx, st, "write", &id, w, &r);
            None
        }
    };
    cx.pool.put(Sb { id, node, content });
}

/// A create refused for capacity: the fleet must be (nearly) full. Deletes finishing since
/// the server's last read of the nodes may have freed a few slots: each other client one,
/// twice over.
fn refused(cx: &Ctx, entry: &str, resp: &Resp) {
    let text = resp.text();
    if !text.contains("no capacity") {
        cx.bad.add(
            "capacity",
            format!("a create through {entry} refused (429) for another reason: {text}"),
        );
        return;
    }
    match try_rows(
        cx.db,
        "SELECT COALESCE(sum((report::json->>'slots')::bigint - reserved_slots), 0) FROM nodes \
         WHERE state = 'ready'",
    ) {
        Ok(r) => {
            let free: i64 = r
                .first()
                .and_then(|r| r.first())
                .and_then(|f| f.parse().ok())
                .unwrap_or(0);
            if free > 2 * CLIENTS as i64 {
                cx.bad.add(
                    "capacity",
                    format!(
                        "a create through {entry} refused (no capacity) while the fleet had \
                         {free} free slots just after: {text}"
                    ),
                );
            }
        }
        Err(e) => cx.bad.add("checker", format!("psql: {e}")),
    }
}

/// An exec, a file read or a GET of `sb` through entry `e`: its own answer?
fn call(cx: &Ctx, st: &mut Stats, e: usize, kind: &'static str, sb: &Sb, n: usize) {
    let (entry, api) = &cx.entries[e];
    let id = &sb.id;
    *st.ops.entry(kind).or_default() += 1;
    *st.entries.entry(entry).or_default() += 1;
    let nonce = format!("call-{}-{n}", unique("c"));
    let t = Instant::now();
    let r = match kind {
        "exec" => api.try_request(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            &JSON,
            serde_json::to_vec(&json!({ "shell": format!("echo {nonce}; cat {OWNER_FILE}") }))
                .unwrap_or_default(),
        ),
        "read" => api.try_request(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path={}", enc(OWNER_FILE)),
            &[],
            (),
        ),
        _ => api.try_request("GET", &format!("/v1/sandboxes/{id}"), &[], ()),
    };
    let took = t.elapsed();
    let resp = match r {
        Ok(resp) if resp.status == 200 => resp,
        other => {
            error(cx, st, kind, id, e, &other);
            return;
        }
    };
    st.latency.entry(kind).or_default().push(took);
    let v: Value = serde_json::from_slice(&resp.body).unwrap_or(Value::Null);
    let good = match kind {
        "exec" => {
            let want = format!("{nonce}\n{}", sb.content.as_deref().unwrap_or(""));
            v["exit_code"] == 0
                && match &sb.content {
                    Some(_) => v["stdout"] == want.as_str(),
                    None => v["stdout"]
                        .as_str()
                        .is_some_and(|s| s.starts_with(&format!("{nonce}\n"))),
                }
        }
        "read" => sb
            .content
            .as_ref()
            .is_none_or(|c| resp.body == c.as_bytes()),
        _ => v["id"] == id.as_str() && v["state"] == "running",
    };
    if !good {
        cx.bad.add(
            "routing",
            format!(
                "{kind} of {id} (on node {}) through {entry} answered 200 but not with its own \
                 content: {}",
                sb.node,
                resp.text()
            ),
        );
    }
}

/// A delete through entry `e`, then a GET through another: 404.
fn delete(cx: &Ctx, st: &mut Stats, e: usize, sb: Sb) {
    let (entry, api) = &cx.entries[e];
    let id = &sb.id;
    *st.ops.entry("delete").or_default() += 1;
    *st.entries.entry(entry).or_default() += 1;
    let t = Instant::now();
    let r = api.try_request("DELETE", &format!("/v1/sandboxes/{id}"), &[], ());
    let took = t.elapsed();
    match &r {
        Ok(resp) if resp.status == 204 => {
            st.latency.entry("delete").or_default().push(took);
            cx.pool.live.fetch_sub(1, Ordering::Relaxed);
        }
        _ => {
            error(cx, st, "delete", id, e, &r);
            cx.pool
                .unsure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(id.clone());
            cx.pool.live.fetch_sub(1, Ordering::Relaxed);
            return;
        }
    }
    let g = (e + 1) % cx.entries.len();
    let (gentry, gapi) = &cx.entries[g];
    *st.ops.entry("gone").or_default() += 1;
    *st.entries.entry(gentry).or_default() += 1;
    let t = Instant::now();
    let r = gapi.try_request("GET", &format!("/v1/sandboxes/{id}"), &[], ());
    let took = t.elapsed();
    match &r {
        Ok(resp) if resp.status == 404 => st.latency.entry("gone").or_default().push(took),
        Ok(resp) if resp.status == 200 => {
            *st.errors.entry("gone 200".into()).or_default() += 1;
            cx.bad.add(
                "routing",
                format!(
                    "{id} (on node {}), deleted through {entry} (204), still answers through \
                     {gentry}: {}",
                    sb.node,
                    resp.text()
                ),
            );
        }
        _ => error(cx, st, "gone", id, g, &r),
    }
}

/// Per node, the most seen at once: placements, `reserved_slots`, what it reported
/// running, what its data dir held.
type Peaks = BTreeMap<String, [i64; 4]>;

/// One check of the invariants: capacity on every node, no sandbox on two nodes or on
/// another node than its placement's, no node dead or moved to another epoch.
fn check(db: &str, nodes: &[NodeProc], bad: &Violations, peaks: &mut Peaks) {
    let table = match try_rows(
        db,
        "SELECT n.name, n.state, n.epoch, COALESCE(n.report::json->>'slots', '0'), \
           n.reserved_slots, \
           (SELECT count(*) FROM placements p \
             WHERE p.node_id = n.id AND p.epoch = n.epoch AND p.state <> 'lost'), \
           COALESCE(n.report::json->>'sandboxes', '0'), \
           n.reserved_memory_mb, \
           (SELECT COALESCE(sum(p.memory_mb), 0) FROM placements p \
             WHERE p.node_id = n.id AND p.epoch = n.epoch AND p.state <> 'lost'), \
           COALESCE(n.report::json->>'memory_mb', '0') \
         FROM nodes n ORDER BY n.name",
    ) {
        Ok(t) => t,
        Err(e) => return bad.add("checker", format!("psql: {e}")),
    };
    let placed: BTreeMap<String, String> = match try_rows(
        db,
        "SELECT p.sandbox_id, n.name FROM placements p JOIN nodes n ON n.id = p.node_id \
         WHERE p.sandbox_id IS NOT NULL",
    ) {
        Ok(r) => r
            .into_iter()
            .map(|r| (r[0].clone(), r[1].clone()))
            .collect(),
        Err(e) => return bad.add("checker", format!("psql: {e}")),
    };
    let dirs: BTreeMap<&str, BTreeSet<String>> = nodes
        .iter()
        .map(|n| (n.name.as_str(), sandbox_dirs(n)))
        .collect();
    if table.len() != NODES.len() {
        bad.add("checker", format!("nodes table: {table:?}"));
    }
    for r in &table {
        let num = |i: usize| r.get(i).and_then(|f| f.parse::<i64>().ok()).unwrap_or(-1);
        let (name, state, epoch, slots) = (&r[0], &r[1], num(2), num(3));
        let (reserved, placements, reported) = (num(4), num(5), num(6));
        let (reserved_mb, placed_mb, memory_mb) = (num(7), num(8), num(9));
        let held = dirs.get(name.as_str()).map_or(0, |d| d.len() as i64);
        let want = NODES
            .iter()
            .find(|(n, _)| n == name)
            .map_or(-1, |(_, s)| i64::from(*s));
        if state != "ready" || epoch != 1 {
            bad.add(
                "fencing",
                format!("node {name} is {state} at epoch {epoch}: declared dead, nothing killed"),
            );
        }
        if slots != want {
            bad.add(
                "capacity",
                format!("node {name} reports {slots} slots, started with {want}"),
            );
        }
        for (what, v) in [
            ("placements", placements),
            ("reserved_slots", reserved),
            ("sandboxes it reports running", reported),
            ("sandbox dirs in its data dir", held),
        ] {
            if v > want || v < 0 {
                bad.add(
                    "capacity",
                    format!("node {name}: {v} {what}, for {want} slots"),
                );
            }
        }
        // Both change in one transaction (a placement and its reservation): one statement
        // reads them in one snapshot.
        if reserved != placements || reserved_mb != placed_mb {
            bad.add(
                "books",
                format!(
                    "node {name}: reserved {reserved} slots and {reserved_mb} MB for {placements} \
                     placements of {placed_mb} MB"
                ),
            );
        }
        if reserved_mb > memory_mb {
            bad.add(
                "capacity",
                format!("node {name}: {reserved_mb} MB reserved of its {memory_mb} MB"),
            );
        }
        let p = peaks.entry(name.clone()).or_default();
        for (i, v) in [placements, reserved, reported, held]
            .into_iter()
            .enumerate()
        {
            p[i] = p[i].max(v);
        }
    }
    let mut on: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (node, ids) in &dirs {
        for id in ids {
            on.entry(id.as_str()).or_default().push(node);
            if let Some(p) = placed.get(id) {
                if p != node {
                    bad.add(
                        "double",
                        format!("node {node} holds {id}, placed on node {p}"),
                    );
                }
            }
        }
    }
    for (id, ns) in on {
        if ns.len() > 1 {
            bad.add("double", format!("{id} is on nodes {ns:?} at once"));
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

#[test]
fn fleet_soak_mixed_workload_keeps_the_invariants() {
    let secs: u64 = std::env::var("LOCKER_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SECS);
    let t0 = Instant::now();
    let rig = start_rig();
    println!(
        "soak: 4 nodes {:?}, replicas A ({}) and B ({}) behind haproxy ({}), ready in {:.1?}; \
         {CLIENTS} clients for {secs} s, live between {LOW} and the fleet's fill ({HIGH} at \
         most)",
        NODES,
        rig.reps[0].url,
        rig.reps[1].url,
        rig.hap.base,
        t0.elapsed()
    );
    let entries = entries(&rig);
    let pool = Pool {
        free: Mutex::new(Vec::new()),
        live: AtomicUsize::new(0),
        growing: AtomicBool::new(true),
        unsure: Mutex::new(Vec::new()),
        cycles: AtomicUsize::new(0),
        low_high: Mutex::new((usize::MAX, 0)),
    };
    let bad = Violations::default();
    let created = Mutex::new(Vec::new());
    let cx = Ctx {
        entries: &entries,
        pool: &pool,
        bad: &bad,
        db: &rig.db,
        created: &created,
    };
    let stop = AtomicBool::new(false);
    let checks = AtomicUsize::new(0);
    let mut peaks = Peaks::new();
    let mut stats = Stats::default();
    let t_run = Instant::now();
    let end = t_run + Duration::from_secs(secs);
    std::thread::scope(|s| {
        let (cx, stop, checks, peaks) = (&cx, &stop, &checks, &mut peaks);
        let nodes = &rig.nodes;
        let checker = s.spawn(move || {
            let mut next = Instant::now();
            let mut last_print = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                next += Duration::from_secs(1);
                let ok = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    check(cx.db, nodes, cx.bad, peaks)
                }));
                if ok.is_err() {
                    cx.bad.add("checker", "the check panicked");
                }
                checks.fetch_add(1, Ordering::Relaxed);
                if last_print.elapsed() >= Duration::from_secs(15) {
                    last_print = Instant::now();
                    println!(
                        "soak: {:.0?}: {} live, {} checks, {} violations",
                        t_run.elapsed(),
                        cx.pool.live.load(Ordering::Relaxed),
                        checks.load(Ordering::Relaxed),
                        cx.bad.all().len()
                    );
                }
                if let Some(d) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d);
                }
            }
        });
        let clients: Vec<_> = (0..CLIENTS)
            .map(|n| {
                s.spawn(move || {
                    std::panic::catch_unwind(AssertUnwindSafe(|| client(cx, n, end)))
                        .unwrap_or_else(|_| {
                            cx.bad.add("checker", format!("client {n} panicked"));
                            Stats::default()
                        })
                })
            })
            .collect();
        for c in clients {
            stats.merge(c.join().unwrap_or_default());
        }
        stop.store(true, Ordering::Relaxed);
        let _ = checker.join();
    });
    let ran = t_run.elapsed();
    let checks = checks.into_inner();
    let live: Vec<Sb> = pool.free.into_inner().unwrap_or_else(|e| e.into_inner());
    let unsure = pool.unsure.into_inner().unwrap_or_else(|e| e.into_inner());
    let (low, high) = pool
        .low_high
        .into_inner()
        .unwrap_or_else(|e| e.into_inner());
    println!(
        "soak: workload ran {ran:.1?}; {} live at the end, {} created in all, {} climbs to the \
         top, live between {} and {high} after the first",
        live.len(),
        created.lock().map(|c| c.len()).unwrap_or(0),
        pool.cycles.load(Ordering::Relaxed),
        if low == usize::MAX { 0 } else { low },
    );

    // The books, once reconciled: every live sandbox placed on its node, 0 orphans.
    let t_books = Instant::now();
    let pairs: Vec<(String, String)> = live
        .iter()
        .map(|s| (s.id.clone(), s.node.clone()))
        .collect();
    // Polled until they balance and one reconcile period has passed (what reconciliation
    // does to balanced books must keep them balanced).
    let (mut first, mut balanced_at, mut unbalanced_again) = (None, None, Vec::new());
    let wrong = loop {
        let wrong = books(&rig.db, &rig.nodes, &pairs);
        let at = t_books.elapsed();
        first.get_or_insert_with(|| kinds(&wrong));
        if wrong.is_empty() {
            balanced_at.get_or_insert(at);
        } else if let Some(b) = balanced_at {
            unbalanced_again.push(format!(
                "balanced {b:.1?} after the workload, not {at:.1?} after: {}",
                wrong.join("; ")
            ));
        }
        if (wrong.is_empty() && at >= RECONCILE) || at >= BOOKS_LIMIT {
            break wrong;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    println!(
        "soak: books right after the workload {:?}; {}, {:.1?} after it",
        first.unwrap_or_default(),
        match balanced_at {
            Some(b) if wrong.is_empty() => format!("balanced {b:.1?} after it and still"),
            _ => format!("still {:?}", kinds(&wrong)),
        },
        t_books.elapsed()
    );
    for w in unbalanced_again {
        bad.add("books", w);
    }
    for w in &wrong {
        bad.add("books", w);
    }
    let placed: BTreeMap<String, String> = rows(
        &rig.db,
        "SELECT p.sandbox_id, n.name FROM placements p JOIN nodes n ON n.id = p.node_id \
         WHERE p.state = 'placed'",
    )
    .into_iter()
    .map(|r| (r[0].clone(), r[1].clone()))
    .collect();
    // Every sandbox answered 201 and not deleted: on the node its answer named, running,
    // its own file.
    let hap = &entries[2].1;
    for sb in &live {
        if placed.get(&sb.id).is_some_and(|n| *n != sb.node) {
            bad.add(
                "books",
                format!(
                    "{} answered 201 on node {}, placed on {}",
                    sb.id, sb.node, placed[&sb.id]
                ),
            );
        }
        let r = hap.try_request("GET", &format!("/v1/sandboxes/{}", sb.id), &[], ());
        let running = r.as_ref().is_ok_and(|r| {
            r.status == 200
                && serde_json::from_slice::<Value>(&r.body).unwrap_or(Value::Null)["state"]
                    == "running"
        });
        if !running {
            bad.add(
                "books",
                format!(
                    "{} (created on {}, never deleted) does not run: {:?}",
                    sb.id,
                    sb.node,
                    r.map(|r| (r.status, r.text()))
                ),
            );
        }
        if let Some(c) = &sb.content {
            let r = hap.try_request(
                "GET",
                &format!("/v1/sandboxes/{}/files?path={}", sb.id, enc(OWNER_FILE)),
                &[],
                (),
            );
            if !r
                .as_ref()
                .is_ok_and(|r| r.status == 200 && r.body == c.as_bytes())
            {
                bad.add(
                    "routing",
                    format!(
                        "{}'s own file after the workload: {:?}",
                        sb.id,
                        r.map(|r| (r.status, r.text()))
                    ),
                );
            }
        }
    }
    // No node was declared dead or fenced itself (nothing was killed).
    for n in &rig.nodes {
        if n.log_text().contains("fenced") {
            bad.add(
                "fencing",
                format!("node {} logged that it was fenced", n.name),
            );
        }
    }

    // Everything deleted through haproxy: the nodes empty, nothing reserved or placed.
    let t_delete = Instant::now();
    let all: Vec<String> = placed_sandboxes(&rig.db);
    for f in delete_all(&rig.hap, &all, CLIENTS) {
        bad.add("cleanup", format!("delete through haproxy: {f}"));
    }
    let deleted_in = t_delete.elapsed();
    for n in &rig.nodes {
        let left = sandbox_dirs(n);
        if !left.is_empty() {
            bad.add(
                "cleanup",
                format!("node {} holds {left:?} after every delete", n.name),
            );
        }
    }
    let left = rows(
        &rig.db,
        "SELECT (SELECT count(*) FROM placements), \
           (SELECT COALESCE(sum(reserved_slots), 0) FROM nodes), \
           (SELECT COALESCE(sum(reserved_memory_mb), 0) FROM nodes)",
    );
    if left.first().is_none_or(|r| r.iter().any(|f| f != "0")) {
        bad.add(
            "cleanup",
            format!("placements, reserved slots and memory left after every delete: {left:?}"),
        );
    }
    println!(
        "soak: {} sandboxes deleted through haproxy in {deleted_in:.1?}; {} deletes of the \
         workload left unsure",
        all.len(),
        unsure.len()
    );

    // The summary.
    let total: usize = stats.ops.values().sum();
    println!(
        "soak: {total} operations in {ran:.1?} ({:.1}/s); per entry point {:?}",
        total as f64 / ran.as_secs_f64(),
        stats.entries
    );
    println!(
        "soak: {:<7} {:>7} {:>7} {:>10} {:>10} {:>10}",
        "kind", "ops", "errors", "p50", "p99", "max"
    );
    for k in KINDS {
        let errs: usize = stats
            .errors
            .iter()
            .filter(|(e, _)| e.split(' ').next() == Some(k))
            .map(|(_, n)| n)
            .sum();
        let v = stats.latency.entry(k).or_default();
        println!(
            "soak: {k:<7} {:>7} {errs:>7} {:>10} {:>10} {:>10}",
            stats.ops.get(k).copied().unwrap_or(0),
            ms(quantile(v, 0.50)),
            ms(quantile(v, 0.99)),
            ms(quantile(v, 1.0)),
        );
    }
    println!("soak: errors by kind and status: {:?}", stats.errors);
    println!(
        "soak: peaks per node [placements, reserved_slots, reported running, dirs] of slots: \
         {}",
        NODES
            .iter()
            .map(|(n, s)| format!("{n} {:?}/{s}", peaks.get(*n).copied().unwrap_or_default()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let bad = bad.all();
    println!(
        "soak: {checks} invariant checks (one a second), {} violations {:?}; total {:.1?}",
        bad.len(),
        kinds(&bad),
        t0.elapsed()
    );
    for b in bad.iter().take(30) {
        println!("soak:   {b}");
    }
    assert!(
        checks >= secs as usize / 2,
        "only {checks} invariant checks in {ran:.1?}"
    );
    assert!(
        bad.is_empty(),
        "{} violations of the fleet's invariants ({:?}); the first:\n{}",
        bad.len(),
        kinds(&bad),
        bad.iter().take(30).cloned().collect::<Vec<_>>().join("\n")
    );
}
