//! What the fleet tests with control replicas share: the rig (two replicas on one Postgres
//! database, haproxy before them, nodes joined through it), and the fleet's books
//! (Postgres' `nodes` and `placements` against what the nodes' data dirs hold).

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sha2::Digest;

use crate::fabric::{fleet_nodes, fleet_token, Fabric, NodeProc};
use crate::postgres::cluster;
use crate::server::{Api, Server};
use crate::{register_child, unique, wait_for, TempDir};

const HAPROXY: &str = "/usr/sbin/haproxy";
/// The replicas' names (`application_name` `locker-replica-<lowercase>`, so that
/// `pg_locks` says which one holds a lock).
pub const NAMES: [&str; 2] = ["A", "B"];

/// Everything a replica test starts. Fields drop in this order: haproxy, the replicas (whose
/// clean-up deletes what is left through the nodes), the nodes (which destroy what their
/// engines still hold), the fabric.
pub struct ReplicaRig {
    _hap: Haproxy,
    pub reps: [Server; 2],
    pub nodes: Vec<NodeProc>,
    _fab: Fabric,
    pub db: String,
    /// Tenant `default`'s key (replica A's, in the shared store: good on every replica).
    pub key: String,
    /// The API through haproxy.
    pub hap: Api,
}

impl ReplicaRig {
    /// The fabric with a namespace per node of `nodes` (name, slots), a Postgres database,
    /// replicas A and B on it (one `LOCKER_SECRETS_KEY`: the fleet CA is sealed with it),
    /// haproxy before them (the API, and the fleet listeners with TLS passed through), and
    /// the nodes joined through haproxy with tokens minted by A.
    pub fn start(tag: &str, nodes: &[(&str, u32)]) -> ReplicaRig {
        let fab = Fabric::new(nodes.len());
        let ctl = fab.control_ip();
        let (db, pg_url) = cluster().new_database();
        let mut procs: Vec<NodeProc> = nodes
            .iter()
            .enumerate()
            .map(|(i, (name, _))| NodeProc::new(i, name))
            .collect();
        // Ports: haproxy's API and fleet frontends, each replica's fleet listener (fixed: a
        // replica started again takes the same flags).
        let ports = free_ports(&ctl, 4);
        let (hap_api_port, hap_fleet_port) = (ports[0], ports[1]);
        let fleet_listen = [format!("{ctl}:{}", ports[2]), format!("{ctl}:{}", ports[3])];
        let fleet_url = format!("https://{ctl}:{hap_fleet_port}");
        let secrets_key = format!(
            "{:x}",
            sha2::Sha256::digest(unique(&format!("{tag}-secrets")).as_bytes())
        );
        let env = [("LOCKER_SECRETS_KEY", secrets_key.as_str())];
        let start = |i: usize| {
            let sep = if pg_url.contains('?') { '&' } else { '?' };
            let database = format!(
                "{pg_url}{sep}application_name=locker-replica-{}",
                NAMES[i].to_lowercase()
            );
            Server::start_with_env(
                &[
                    "--database",
                    &database,
                    "--fleet-listen",
                    &fleet_listen[i],
                    "--fleet-name",
                    &ctl,
                    "--fleet-url",
                    &fleet_url,
                    "--quota-sandboxes",
                    "1000",
                    "--quota-memory-mb",
                    "1000000",
                    // Control only: no warm machines of their own on this 2-core host.
                    "--warm-pool",
                    "0",
                    "--vm-pool",
                    "0",
                    // Preview hosts `{port}-{id}.localhost` (any port of any replica).
                    "--preview-domain",
                    "localhost",
                ],
                &env,
            )
        };
        let (a, b) = (start(0), start(1));
        let hap = Haproxy::start(&replicas_config(
            &ctl,
            hap_api_port,
            hap_fleet_port,
            &[a.addr.to_string(), b.addr.to_string()],
            &fleet_listen,
        ));
        let key = a.api_key.clone();
        let hap_api = Api::new(&format!("http://{ctl}:{hap_api_port}"), Some(&key));
        wait_for(Duration::from_secs(10), "haproxy answering", || {
            hap_api
                .try_request("GET", "/healthz", &[], ())
                .ok()
                .filter(|r| r.status == 200 || r.status == 503)
        });
        for (n, (_, slots)) in procs.iter_mut().zip(nodes) {
            let t = fleet_token(&a.admin(), 600);
            assert_eq!(
                t["url"], fleet_url,
                "the join URL is haproxy's fleet frontend (--fleet-url): {t}"
            );
            let (url, token) = (t["url"].as_str().unwrap(), t["token"].as_str().unwrap());
            n.start(&fab, Some((url, token)), *slots);
        }
        // B sees what the nodes wrote through whichever replica haproxy chose.
        wait_for(
            Duration::from_secs(60),
            "every node alive, seen by B",
            || {
                let l = fleet_nodes(&b.admin());
                (l.len() == nodes.len() && l.iter().all(|n| n["alive"] == true)).then_some(())
            },
        );
        ReplicaRig {
            _hap: hap,
            reps: [a, b],
            nodes: procs,
            _fab: fab,
            db,
            key,
            hap: hap_api,
        }
    }

    /// A client of replica `i` (direct, not through haproxy).
    pub fn api(&self, i: usize) -> Api {
        Api::new(&self.reps[i].url, Some(&self.key))
    }
}

/// haproxy in the foreground, killed (and its log shown, when the test fails) on drop.
pub struct Haproxy {
    child: Option<Child>,
    log: PathBuf,
    _dir: TempDir,
}

impl Haproxy {
    pub fn start(config: &str) -> Haproxy {
        let dir = TempDir::new("locker-haproxy");
        let cfg = dir.path().join("haproxy.cfg");
        std::fs::write(&cfg, config).expect("write haproxy.cfg");
        let checked = Command::new(HAPROXY)
            .arg("-c")
            .arg("-f")
            .arg(&cfg)
            .output()
            .unwrap_or_else(|e| {
                panic!("run {HAPROXY} ({e}): `scripts/setup test` installs haproxy")
            });
        assert!(
            checked.status.success(),
            "haproxy refuses its configuration:\n{}{}\n{config}",
            String::from_utf8_lossy(&checked.stdout),
            String::from_utf8_lossy(&checked.stderr)
        );
        let log = dir.path().join("haproxy.log");
        let out = std::fs::File::create(&log).expect("haproxy's log");
        let mut cmd = Command::new(HAPROXY);
        // SAFETY: prctl with integer arguments, between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .arg("-f")
            .arg(&cfg)
            .arg("-db")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("start haproxy");
        register_child(child.id());
        Haproxy {
            child: Some(child),
            log,
            _dir: dir,
        }
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("---- haproxy log, last lines ----");
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
    }
}

/// `n` distinct free ports on `ip` (all held until all are known).
pub fn free_ports(ip: &str, n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind((ip, 0)).expect("bind a free port"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

/// haproxy's configuration for control replicas on `ip`: an HTTP frontend on `api_port`
/// before the replicas' API addresses `apis`, and a TCP frontend on `fleet_port` (TLS passes
/// through: nodes join and beat through it) before their fleet listeners `fleets`; servers
/// named A, B, … in that order, checked every 200 ms, balanced round robin.
pub fn replicas_config(
    ip: &str,
    api_port: u16,
    fleet_port: u16,
    apis: &[String],
    fleets: &[String],
) -> String {
    let servers = |addrs: &[String]| -> String {
        addrs
            .iter()
            .enumerate()
            .map(|(i, a)| {
                format!(
                    "    server {} {a} check inter 200 fall 1 rise 1\n",
                    char::from(b'A' + u8::try_from(i).unwrap_or(0))
                )
            })
            .collect()
    };
    format!(
        "global
    maxconn 4096

defaults
    timeout connect 2s
    timeout client 150s
    timeout server 150s
    timeout tunnel 1h
    retries 2
    option redispatch

frontend api
    mode http
    bind {ip}:{api_port}
    default_backend replicas_api

backend replicas_api
    mode http
    balance roundrobin
{}
frontend fleet
    mode tcp
    bind {ip}:{fleet_port}
    default_backend replicas_fleet

backend replicas_fleet
    mode tcp
    balance roundrobin
{}",
        servers(apis),
        servers(fleets)
    )
}

/// `sql`'s rows in `db`, their columns split.
pub fn rows(db: &str, sql: &str) -> Vec<Vec<String>> {
    cluster()
        .psql(db, sql)
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| l.split('|').map(str::to_owned).collect())
        .collect()
}

/// The name of the node the placement of sandbox `id` in `db` names (exactly one).
pub fn placed_node(db: &str, id: &str) -> String {
    let on = rows(
        db,
        &format!(
            "SELECT n.name FROM placements p JOIN nodes n ON n.id = p.node_id \
             WHERE p.sandbox_id = '{id}'"
        ),
    );
    assert_eq!(on.len(), 1, "placements of {id}: {on:?}");
    on[0][0].clone()
}

/// Drains `node` through `admin` (`POST /v1/fleet/nodes/{node}/drain`): answered 200 with
/// `moved` sandboxes moved; the report.
pub fn drained(admin: &crate::server::Api, node: &str, moved: usize) -> serde_json::Value {
    let r = admin.post(
        &format!("/v1/fleet/nodes/{node}/drain"),
        &serde_json::json!({}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let report = r.json();
    assert_eq!(
        report["moved"].as_array().map(Vec::len),
        Some(moved),
        "{report}"
    );
    report
}

/// The ids of the sandboxes `api`'s tenant lists, sorted.
pub fn listed_ids(api: &crate::server::Api) -> Vec<String> {
    let list = api.get("/v1/sandboxes").expect(200, "list");
    let mut ids: Vec<String> = list["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .map(|s| s["id"].as_str().expect("an id").to_owned())
        .collect();
    ids.sort();
    ids
}

/// The sandboxes a node's engine holds on disk.
pub fn sandbox_dirs(n: &NodeProc) -> BTreeSet<String> {
    std::fs::read_dir(n.data_dir().join("sandboxes"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .collect()
}

/// What is wrong with the fleet's books now (empty when they balance): placements left
/// `starting`, `placed` ones whose node lacks their sandbox, sandboxes a node runs that no
/// placement names, reservations other than the count of placements, and created sandboxes
/// (`created`, answered 201) without a `placed` placement.
pub fn books(db: &str, nodes: &[NodeProc], created: &[(String, String)]) -> Vec<String> {
    let mut wrong = Vec::new();
    for r in rows(
        db,
        "SELECT p.id, n.name, COALESCE(p.sandbox_id, '-'), p.created_ms \
         FROM placements p JOIN nodes n ON n.id = p.node_id WHERE p.state = 'starting'",
    ) {
        wrong.push(format!(
            "starting: placement {} on node {} (sandbox {}) is still `starting`",
            r[0], r[1], r[2]
        ));
    }
    let placed: BTreeMap<String, String> = rows(
        db,
        "SELECT p.sandbox_id, n.name FROM placements p JOIN nodes n ON n.id = p.node_id \
         WHERE p.state = 'placed'",
    )
    .into_iter()
    .map(|r| (r[0].clone(), r[1].clone()))
    .collect();
    let named: BTreeSet<String> = rows(
        db,
        "SELECT sandbox_id FROM placements WHERE sandbox_id IS NOT NULL",
    )
    .into_iter()
    .map(|r| r[0].clone())
    .collect();
    for n in nodes {
        let dirs = sandbox_dirs(n);
        for (sb, on) in &placed {
            if *on == n.name && !dirs.contains(sb) {
                wrong.push(format!(
                    "missing: placement names {sb} on node {on}, which does not run it"
                ));
            }
        }
        for sb in &dirs {
            if !named.contains(sb) {
                wrong.push(format!(
                    "orphan: node {} runs {sb}, which no placement names",
                    n.name
                ));
            } else if placed.get(sb).is_some_and(|on| *on != n.name) {
                wrong.push(format!(
                    "elsewhere: node {} runs {sb}, placed on node {}",
                    n.name, placed[sb]
                ));
            }
        }
    }
    for r in rows(
        db,
        "SELECT n.name, n.reserved_slots, \
           (SELECT count(*) FROM placements p \
             WHERE p.node_id = n.id AND p.epoch = n.epoch AND p.state <> 'lost') \
         FROM nodes n ORDER BY n.name",
    ) {
        if r[1] != r[2] {
            wrong.push(format!(
                "reservation: node {} has reserved_slots {} for {} placements",
                r[0], r[1], r[2]
            ));
        }
    }
    for (id, node) in created {
        if !placed.contains_key(id) {
            wrong.push(format!(
                "unrecorded: {id}, created (201) on node {node}, has no `placed` placement"
            ));
        }
    }
    wrong
}

/// The `p`-quantile of `v` (sorted here).
pub fn quantile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    if v.is_empty() {
        return Duration::ZERO;
    }
    let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// `wrong`'s problems counted by kind (the word before the first colon).
pub fn kinds(wrong: &[String]) -> BTreeMap<String, usize> {
    let mut k = BTreeMap::new();
    for w in wrong {
        *k.entry(w.split(':').next().unwrap_or("").to_owned())
            .or_default() += 1;
    }
    k
}

/// The node a create's answer says the sandbox went to (`X-Locker-Node`).
pub fn placed_on(r: &crate::server::Resp) -> String {
    r.headers
        .get("x-locker-node")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// Every sandbox a placement in `db` names, in id order.
pub fn placed_sandboxes(db: &str) -> Vec<String> {
    rows(
        db,
        "SELECT sandbox_id FROM placements WHERE sandbox_id IS NOT NULL ORDER BY sandbox_id",
    )
    .into_iter()
    .map(|r| r[0].clone())
    .collect()
}

/// Deletes `ids` through `api` with `threads` threads: the failures.
pub fn delete_all(api: &Api, ids: &[String], threads: usize) -> Vec<String> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(id) = ids.get(i) else { break };
                match api.try_request("DELETE", &format!("/v1/sandboxes/{id}"), &[], ()) {
                    Ok(r) if r.status == 204 => {}
                    other => failed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(format!("{id}: {:?}", other.map(|r| (r.status, r.text())))),
                }
            });
        }
    });
    failed.into_inner().unwrap_or_else(|e| e.into_inner())
}
