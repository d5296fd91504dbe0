//! A data dir of the previous release adopts: the previous release's `locker serve` (with
//! its own agent) fills a data dir, goes away (killed, as in a crash, or stopped with
//! SIGTERM), and this build's `locker serve` starts on the same dir.
//!
//! What the upgrade must keep: the running machines of both runtimes, served by the old
//! agent that still runs inside them (a new server speaks to an old agent), their files and
//! background processes; the paused machine, paused until resumed; the volume's files; the
//! snapshot, restorable; the API keys (a revoked one stays revoked); the call records. The
//! store's schema is migrated from the previous release's version to this build's.
//!
//! The previous release is `$LOCKER_PREV_BIN` and `$LOCKER_PREV_AGENT_BIN`, which
//! `scripts/setup test` builds from the commit it names (cached in
//! `/var/cache/locker/prev/<commit>/`). Without them the tests fail, saying so.
//!
//! Run as root after `scripts/setup build`:
//! `cargo test --release -p locker-tests --test upgrade`.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use locker_tests::server::{enc, Api, Server};
use locker_tests::{agent_bin, become_subreaper, frozen, traces_of, wait_for};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The schema version the previous release writes (its three migrations).
const PREVIOUS_SCHEMA: i64 = 3;

/// One upgrade at a time: each boots a microVM, and TCG on two cores has no room for more.
static SERIAL: Mutex<()> = Mutex::new(());

/// The previous release's `locker` and static `locker-agent`.
fn previous_release() -> (PathBuf, PathBuf) {
    let var = |name: &str| {
        let p = std::env::var_os(name)
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                panic!(
                    "${name} is not set: the upgrade tests need the previous release's `locker` \
                 (LOCKER_PREV_BIN) and static `locker-agent` (LOCKER_PREV_AGENT_BIN); \
                 `scripts/setup test` builds them and sets both"
                )
            });
        assert!(
            p.is_file(),
            "${name}={} is not a file: build the previous release with `scripts/setup test`",
            p.display()
        );
        p
    };
    let (locker, agent) = (var("LOCKER_PREV_BIN"), var("LOCKER_PREV_AGENT_BIN"));
    assert_ne!(
        sha256_of(&agent),
        sha256_of(&agent_bin()),
        "LOCKER_PREV_AGENT_BIN is this build's agent: the test would prove nothing"
    );
    (locker, agent)
}

fn sha256_of(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The store's schema version and whether `sandboxes` has the `end_cause` column (added
/// after the previous release), read from the file without migrating it.
fn schema_of(data_dir: &Path) -> (i64, bool) {
    let db = data_dir.join("db.sqlite");
    let c = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .unwrap_or_else(|e| panic!("open {}: {e}", db.display()));
    c.busy_timeout(Duration::from_secs(5))
        .expect("busy timeout");
    let version: i64 = c
        .query_row("SELECT MAX(version) FROM schema_version", [], |r| r.get(0))
        .expect("the schema version");
    let end_cause = c
        .prepare("SELECT 1 FROM pragma_table_info('sandboxes') WHERE name = 'end_cause'")
        .and_then(|mut st| st.exists([]))
        .expect("the sandboxes table's columns");
    (version, end_cause)
}

fn id_of(v: &Value) -> String {
    str_of(v, "id")
}

fn str_of(v: &Value, field: &str) -> String {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("no {field} in {v}"))
        .to_owned()
}

fn ids(v: &Value, list: &str) -> Vec<String> {
    v[list]
        .as_array()
        .unwrap_or_else(|| panic!("no {list} in {v}"))
        .iter()
        .map(id_of)
        .collect()
}

/// The highest `tick N` a background process has printed so far.
fn last_tick(api: &Api, sb: &str, proc_id: &str) -> u64 {
    let r = api.get(&format!("/v1/sandboxes/{sb}/processes/{proc_id}/output"));
    assert_eq!(r.status, 200, "the process's output: {}", r.text());
    r.text()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["type"] == "stdout")
        .filter_map(|l| l["data"].as_str().map(str::to_owned))
        .collect::<String>()
        .lines()
        .filter_map(|l| l.strip_prefix("tick ")?.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

/// The agent binary a jail runs, hashed on the host: its process's executable, found by
/// the pid the machine's `state.json` records (a jail's PID 1 may not read its own).
fn agent_of_jail(srv: &Server, sb: &str) -> String {
    let state = srv.machine_dir(sb).join("state.json");
    let v: Value = serde_json::from_slice(
        &std::fs::read(&state).unwrap_or_else(|e| panic!("read {}: {e}", state.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", state.display()));
    let pid = v["agent_pid"]
        .as_i64()
        .unwrap_or_else(|| panic!("no agent_pid in {v}"));
    sha256_of(Path::new(&format!("/proc/{pid}/exe")))
}

/// The agent binary a microVM runs (its PID 1, the guest's init), hashed in the guest.
fn agent_of_vm(api: &Api, sb: &str) -> String {
    api.sh(sb, "sha256sum /proc/1/exe | cut -d' ' -f1")
        .trim()
        .to_owned()
}

/// What the previous release made, to find again after the upgrade.
struct Made {
    key_id: String,
    spare_key: String,
    revoked_key: String,
    vol: String,
    run_call: String,
    jail: String,
    exec_call: String,
    proc_id: String,
    snap: String,
    paused: String,
    vm: String,
    calls: Vec<String>,
}

/// Fills the previous release's data dir: a tenant with keys (one revoked), a volume with
/// files and a run on it, a jail mounting the volume with a file and a background process, a
/// snapshot of it, a paused jail, a microVM with a file.
fn fill(srv: &Server) -> Made {
    let health = srv.anon().get("/healthz").expect(200, "health");
    assert_eq!(
        health["runtimes"]["microvm"], "ok",
        "the previous release cannot run microVMs on this host: {health}"
    );
    let (api, key_id) = srv.create_tenant("acme");
    let mut keys = Vec::new();
    for _ in 0..2 {
        let v = srv
            .admin()
            .post_empty("/v1/tenants/acme/keys")
            .expect(201, "another key of acme");
        keys.push((str_of(&v, "api_key"), str_of(&v, "key_id")));
    }
    let (spare_key, _) = keys.remove(0);
    let (revoked_key, revoked_id) = keys.remove(0);
    let r = srv.admin().delete(&format!("/v1/keys/{revoked_id}"));
    assert_eq!(r.status, 204, "revoke a key: {}", r.text());

    let vol = id_of(
        &api.post("/v1/volumes", &json!({"name": "kept", "size_mb": 64}))
            .expect(201, "a volume"),
    );
    api.put(
        &format!("/v1/volumes/{vol}/files?path={}", enc("/notes/hello.txt")),
        b"written by the previous release".to_vec(),
    )
    .expect(200, "a file in the volume");
    let run = api
        .post(
            &format!("/v1/volumes/{vol}/run"),
            &json!({"shell": "echo from the old run > run.txt"}),
        )
        .expect(200, "a run on the volume");
    assert_eq!(run["exit_code"], 0, "the run: {run}");

    let jail = id_of(&api.create_sandbox(&json!({
        "runtime": "jail",
        "metadata": {"role": "running"},
        "volumes": [{"volume": vol, "path": "/data"}],
    })));
    let exec = api.exec(&jail, &json!({"shell": "echo kept > /root/a.txt"}));
    assert_eq!(exec["exit_code"], 0, "{exec}");
    let proc_id = id_of(
        &api.post(
            &format!("/v1/sandboxes/{jail}/processes"),
            // The previous release gave background processes a 60 s timeout by default.
            &json!({
                "shell": "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done",
                "timeout_ms": 600_000,
            }),
        )
        .expect(200, "a background process"),
    );
    let snap = id_of(
        &api.post_empty(&format!("/v1/sandboxes/{jail}/snapshots"))
            .expect(201, "a snapshot"),
    );

    let paused = id_of(&api.create_sandbox(&json!({"runtime": "jail"})));
    api.write_file(&paused, "/root/p.txt", b"paused before the upgrade")
        .expect(200, "a file in the paused one");
    api.post_empty(&format!("/v1/sandboxes/{paused}/pause"))
        .expect(200, "pause");

    let vm = id_of(&api.create_sandbox(&json!({"runtime": "microvm"})));
    let vm_exec = api.exec(&vm, &json!({"shell": "echo in the vm > /root/v.txt"}));
    assert_eq!(vm_exec["exit_code"], 0, "{vm_exec}");

    wait_for(Duration::from_secs(10), "the process prints", || {
        (last_tick(&api, &jail, &proc_id) > 0).then_some(())
    });
    // Records are written in batches: wait until these are (a running process's record is
    // written when it ends).
    let made_calls = [&run, &exec, &vm_exec].map(|r| str_of(r, "call_id"));
    let calls = wait_for(Duration::from_secs(10), "the calls are recorded", || {
        let calls = ids(
            &api.get("/v1/calls?limit=100").expect(200, "calls"),
            "calls",
        );
        made_calls
            .iter()
            .all(|c| calls.contains(c))
            .then_some(calls)
    });
    Made {
        key_id,
        spare_key,
        revoked_key,
        vol,
        run_call: str_of(&run, "call_id"),
        jail,
        exec_call: str_of(&exec, "call_id"),
        proc_id,
        snap,
        paused,
        vm,
        calls,
    }
}

/// Everything the previous release made is there and works under this build.
fn check(srv: &Server, made: &Made, prev_agent: &str) {
    let (version, end_cause) = schema_of(&srv.data_dir);
    assert_eq!(
        (version, end_cause),
        (locker_store::SCHEMA_VERSION, true),
        "this build migrated the store"
    );
    let api = srv.api_with(&made.spare_key);

    // Keys: the spare key of the old release works (every call below), the revoked one not.
    srv.anon()
        .with_key(Some(&made.revoked_key))
        .get("/v1/sandboxes")
        .expect_error(401, "unauthorized", "the key revoked before the upgrade");

    // The running jail: adopted, served by the old agent still inside it.
    let v = api
        .get(&format!("/v1/sandboxes/{}", made.jail))
        .expect(200, "the jail");
    assert_eq!(
        (&v["state"], &v["metadata"]),
        (&json!("running"), &json!({"role": "running"})),
        "{v}"
    );
    // Made before preview URLs: the migration gave it a preview token of its own.
    let token = v["preview_token"].as_str().unwrap_or_default();
    assert!(token.starts_with("lpt_") && token.len() > 30, "{v}");
    let vm_token = api.get(&format!("/v1/sandboxes/{}", made.vm)).json()["preview_token"].clone();
    assert_ne!(
        vm_token,
        json!(token),
        "two sandboxes share a migrated token"
    );
    assert_eq!(
        agent_of_jail(srv, &made.jail),
        prev_agent,
        "the jail still runs the previous release's agent"
    );
    assert_eq!(api.sh(&made.jail, "cat /root/a.txt"), "kept\n");
    assert_eq!(
        api.read_file(&made.jail, "/data/notes/hello.txt").body,
        b"written by the previous release",
        "the volume is still mounted in the jail"
    );
    api.write_file(&made.jail, "/root/after.txt", b"after")
        .expect(200, "write after the upgrade");
    assert_eq!(api.sh(&made.jail, "cat /root/after.txt"), "after");

    // Its background process ran on while no server was there, and still answers.
    let before = last_tick(&api, &made.jail, &made.proc_id);
    wait_for(Duration::from_secs(10), "the process prints on", || {
        (last_tick(&api, &made.jail, &made.proc_id) > before).then_some(())
    });
    let listed = api
        .get(&format!("/v1/sandboxes/{}/processes", made.jail))
        .expect(200, "processes");
    assert!(
        ids(&listed, "processes").contains(&made.proc_id),
        "the background process is listed: {listed}"
    );
    api.post(
        &format!(
            "/v1/sandboxes/{}/processes/{}/signal",
            made.jail, made.proc_id
        ),
        &json!({"signal": "SIGKILL"}),
    )
    .expect(200, "signal the process");
    let p = wait_for(Duration::from_secs(10), "the process ends", || {
        let p = api
            .get(&format!(
                "/v1/sandboxes/{}/processes/{}",
                made.jail, made.proc_id
            ))
            .expect(200, "the process");
        (p["state"] != "running").then_some(p)
    });
    assert_eq!(p["result"]["signal"], "SIGKILL", "{p}");

    // The paused jail is still paused (frozen on the host), and resumes with its file.
    let v = api
        .get(&format!("/v1/sandboxes/{}", made.paused))
        .expect(200, "paused");
    assert_eq!(v["state"], "paused", "{v}");
    assert_eq!(frozen(&made.paused), Some(true), "still frozen on the host");
    api.post_empty(&format!("/v1/sandboxes/{}/resume", made.paused))
        .expect(200, "resume");
    assert_eq!(
        api.sh(&made.paused, "cat /root/p.txt"),
        "paused before the upgrade"
    );

    // The microVM: adopted, its old agent answers.
    let v = api
        .get(&format!("/v1/sandboxes/{}", made.vm))
        .expect(200, "the vm");
    assert_eq!(
        (&v["state"], &v["runtime"]),
        (&json!("running"), &json!("microvm")),
        "{v}"
    );
    assert_eq!(api.sh(&made.vm, "cat /root/v.txt"), "in the vm\n");
    assert_eq!(
        agent_of_vm(&api, &made.vm),
        prev_agent,
        "the microVM still runs the previous release's agent"
    );

    // The volume: its files, and a run of this build on it.
    let file = |path: &str| {
        api.get(&format!("/v1/volumes/kept/files?path={}", enc(path)))
            .body
    };
    assert_eq!(file("/notes/hello.txt"), b"written by the previous release");
    assert_eq!(file("/run.txt"), b"from the old run\n");
    let run = api
        .post(
            &format!("/v1/volumes/{}/run", made.vol),
            &json!({"shell": "cat notes/hello.txt run.txt"}),
        )
        .expect(200, "a run after the upgrade");
    assert_eq!(
        run["stdout"], "written by the previous releasefrom the old run\n",
        "{run}"
    );

    // The snapshot restores.
    let snaps = ids(
        &api.get("/v1/snapshots").expect(200, "snapshots"),
        "snapshots",
    );
    assert!(
        snaps.contains(&made.snap),
        "the snapshot is listed: {snaps:?}"
    );
    let restored = id_of(&api.create_sandbox(&json!({"from_snapshot": made.snap})));
    assert_eq!(api.sh(&restored, "cat /root/a.txt"), "kept\n");

    // The call records of the previous release are listed, by tenant, sandbox and volume.
    let calls = ids(
        &api.get("/v1/calls?limit=1000").expect(200, "calls"),
        "calls",
    );
    for c in &made.calls {
        assert!(
            calls.contains(c),
            "call {c} of the previous release: {calls:?}"
        );
    }
    assert!(
        calls.len() > made.calls.len(),
        "this build's calls are recorded too"
    );
    let of_jail = ids(
        &api.get(&format!("/v1/calls?sandbox_id={}", made.jail))
            .expect(200, "the jail's calls"),
        "calls",
    );
    assert!(of_jail.contains(&made.exec_call), "{of_jail:?}");
    let of_vol = ids(
        &api.get("/v1/calls?volume_id=kept")
            .expect(200, "the volume's calls"),
        "calls",
    );
    assert!(of_vol.contains(&made.run_call), "{of_vol:?}");
    let old = api
        .get(&format!("/v1/calls?sandbox_id={}&limit=1000", made.jail))
        .expect(200, "the jail's calls");
    let record = old["calls"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["id"] == made.exec_call.as_str()))
        .unwrap_or_else(|| panic!("the old exec's record in {old}"));
    assert_eq!(record["key_id"], made.key_id.as_str(), "{record}");
    let usage = api.get("/v1/usage").expect(200, "usage");
    assert!(
        usage["runs"].as_u64() >= Some(2) && usage["execs"].as_u64() >= Some(3),
        "usage counts the previous release's calls: {usage}"
    );

    // Deleting adopted machines leaves nothing; their tombstones use the migrated column.
    for sb in [&made.paused, &made.vm, &restored, &made.jail] {
        assert_eq!(
            api.delete(&format!("/v1/sandboxes/{sb}")).status,
            204,
            "delete {sb}"
        );
        let traces = traces_of(sb, &srv.machine_dir(sb));
        assert!(traces.is_empty(), "{sb} left {traces:?}");
    }
    let gone = api
        .get(&format!("/v1/sandboxes/{}", made.paused))
        .expect_error(404, "not_found", "a deleted sandbox");
    assert!(gone.contains("was deleted at"), "its tombstone: {gone}");
}

/// How the previous release's server goes away.
enum Stop {
    Kill,
    Term,
}

fn a_data_dir_of_the_previous_release_adopts(stop: Stop) {
    let _one = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    become_subreaper();
    let (prev, prev_agent) = previous_release();
    let prev_agent_sum = sha256_of(&prev_agent);
    let mut srv = Server::start_release(&prev, &prev_agent, &["--vm-pool", "0"]);
    let made = fill(&srv);
    assert_eq!(
        (
            agent_of_jail(&srv, &made.jail),
            agent_of_vm(&srv.api_with(&made.spare_key), &made.vm)
        ),
        (prev_agent_sum.clone(), prev_agent_sum.clone()),
        "the previous release runs its own agent"
    );

    // The previous release's warm machines for runs (its default pool).
    let old_pool: Vec<(String, PathBuf)> = wait_for(
        Duration::from_secs(30),
        "the previous release keeps warm machines",
        || {
            let pool: Vec<_> = std::fs::read_dir(srv.data_dir.join("pool"))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
                .collect();
            (!pool.is_empty()).then_some(pool)
        },
    );

    match stop {
        Stop::Kill => srv.kill9(),
        Stop::Term => {
            let pid = srv.pid();
            // SAFETY: kill with the pid of the server process this test started.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            wait_for(
                Duration::from_secs(60),
                "the old server exits on SIGTERM",
                || locker_tests::exited(pid).then_some(()),
            );
        }
    }
    assert_eq!(
        schema_of(&srv.data_dir),
        (PREVIOUS_SCHEMA, false),
        "the previous release's schema (the test must migrate something)"
    );

    let t0 = Instant::now();
    srv.upgrade();
    eprintln!(
        "this build started on the old data dir in {:?}",
        t0.elapsed()
    );
    check(&srv, &made, &prev_agent_sum);
    // Its warm machines were not adopted: they are gone (destroyed by the old server when
    // stopped, by this one when the old one was killed).
    for (id, dir) in &old_pool {
        wait_for(
            Duration::from_secs(20),
            "the old warm machine is gone",
            || traces_of(id, dir).is_empty().then_some(()),
        );
    }
}

#[test]
fn a_data_dir_of_a_killed_previous_release_adopts_everything() {
    a_data_dir_of_the_previous_release_adopts(Stop::Kill);
}

#[test]
fn a_data_dir_of_a_stopped_previous_release_adopts_everything() {
    a_data_dir_of_the_previous_release_adopts(Stop::Term);
}
