//! The store's contract, exercised through `Arc<dyn Store>` on both stores: real SQLite
//! files, and real Postgres databases in a cluster this test process starts (and that goes
//! with it: `tests/common/postgres.rs`). Each behaviour test runs once per store
//! (`sqlite::NAME`, `postgres::NAME`); the tests of one store's own files and URLs follow.

#[path = "../../../tests/common/postgres.rs"]
mod pg;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use locker_store::{
    new_id, CallKind, CallRecord, CallRecorder, PgStore, SandboxQuery, SandboxRecord, SandboxState,
    SqliteStore, Store, StoreError, TenantUsage, SCHEMA_VERSION,
};
use locker_types::{rfc3339, ExecResult, Reason, Timings, Usage};
use serde_json::json;
use sha2::{Digest, Sha256};

/// A directory under the system's temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("locker-store-test-{}", new_id("t")));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn db(&self) -> PathBuf {
        self.0.join("db.sqlite")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn open(dir: &TempDir) -> Arc<dyn Store> {
    Arc::new(SqliteStore::open(dir.db()).unwrap())
}

/// Which store a behaviour test runs on.
#[derive(Clone, Copy)]
enum Backend {
    Sqlite,
    Postgres,
}

/// One empty database of a [`Backend`], removed with the test (SQLite) or with the test
/// process's cluster (Postgres).
enum Db {
    Sqlite(TempDir),
    Postgres { name: String, url: String },
}

impl Db {
    fn new(b: Backend) -> Db {
        match b {
            Backend::Sqlite => Db::Sqlite(TempDir::new()),
            Backend::Postgres => {
                let (name, url) = pg::cluster().new_database();
                Db::Postgres { name, url }
            }
        }
    }

    /// A new store on this database (a second one is what a second server would have).
    fn open(&self) -> Arc<dyn Store> {
        match self {
            Db::Sqlite(dir) => open(dir),
            Db::Postgres { url, .. } => Arc::new(PgStore::connect(url).unwrap()),
        }
    }

    /// Everything the database holds, as bytes: the SQLite file and its log, or a dump.
    fn raw(&self) -> Vec<u8> {
        match self {
            Db::Sqlite(dir) => db_bytes(&dir.db()),
            Db::Postgres { name, .. } => pg::cluster().dump(name).into_bytes(),
        }
    }

    /// The one row of `sql`, its columns joined by `|`.
    fn row(&self, sql: &str) -> String {
        match self {
            Db::Sqlite(dir) => {
                let c = rusqlite::Connection::open(dir.db()).unwrap();
                let mut st = c.prepare(sql).unwrap();
                let n = st.column_count();
                st.query_row([], |r| {
                    Ok((0..n)
                        .map(|i| r.get::<_, String>(i).unwrap())
                        .collect::<Vec<_>>()
                        .join("|"))
                })
                .unwrap()
            }
            Db::Postgres { name, .. } => pg::cluster().psql(name, sql).trim_end().to_owned(),
        }
    }
}

const T0: i64 = 1_796_040_000; // 2026-11-30T12:00:00Z

fn sandbox(id: &str, tenant: &str, created: i64) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        tenant: tenant.into(),
        state: SandboxState::Running,
        template: "default".into(),
        template_digest: "sha256:abc".into(),
        runtime: "jail".into(),
        cpus: 1.5,
        memory_mb: 512,
        disk_mb: 2048,
        network: json!({"egress": "none"}),
        volumes: json!([{"volume": "vol_1", "path": "/workspace", "read_only": false}]),
        metadata: BTreeMap::new(),
        env: BTreeMap::from([("TOKEN".to_string(), "s3cret-env-value".to_string())]),
        ttl_s: 1800,
        idle_timeout_s: None,
        created_at: rfc3339(created),
        expires_at: rfc3339(created + 1800),
        last_active_at: rfc3339(created),
        machine_dir: format!("/var/lib/locker/sandboxes/{id}"),
        cpu_ms: 0,
        peak_memory_bytes: 0,
        preview_token: format!("lpt_{id}"),
        public_ports: vec![],
        host: String::new(),
    }
}

fn call(id: &str, tenant: &str, kind: CallKind, sandbox_id: Option<&str>, at: i64) -> CallRecord {
    CallRecord {
        id: id.into(),
        tenant: tenant.into(),
        key_id: "key_1".into(),
        kind,
        sandbox_id: sandbox_id.map(Into::into),
        volume_id: None,
        command: vec!["python3".into(), "-c".into(), "print(1)".into()],
        cwd: Some("/root".into()),
        env_keys: vec!["K".into()],
        template_digest: "sha256:abc".into(),
        runtime: "jail".into(),
        result: ExecResult {
            call_id: id.into(),
            exit_code: Some(0),
            signal: None,
            reason: Reason::Exited,
            stdout: "OUTPUT-BODY-MUST-NOT-BE-STORED".into(),
            stderr: "ERR-BODY".into(),
            stdout_b64: Some("T1VUUFVU".into()),
            stderr_b64: None,
            stdout_truncated: false,
            stderr_truncated: false,
            stdout_bytes: 30,
            stderr_bytes: 8,
            output_path: None,
            timings: Timings {
                queue_ms: 0.5,
                start_ms: 1.0,
                run_ms: 2.0,
                total_ms: 3.5,
            },
            usage: Usage {
                cpu_ms: 10,
                peak_memory_bytes: 1 << 20,
            },
            changes: None,
        },
        egress_denied: vec![],
        secrets_used: vec![],
        secret_misuse: vec![],
        changes: None,
        created_at: rfc3339(at),
    }
}

/// The bytes of the database and of its write-ahead log, where recent writes live.
fn db_bytes(path: &Path) -> Vec<u8> {
    let mut bytes = std::fs::read(path).unwrap();
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    if let Ok(w) = std::fs::read(PathBuf::from(wal)) {
        bytes.extend(w);
    }
    bytes
}

/// Whether `hay` holds `needle`, as it is or in hex (how a dump shows a blob).
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    let hex: Vec<u8> = needle
        .iter()
        .flat_map(|b| format!("{b:02x}").into_bytes())
        .collect();
    hay.windows(needle.len()).any(|w| w == needle) || hay.windows(hex.len()).any(|w| w == hex)
}

#[test]
fn migrations_apply_once_and_reopen_keeps_data() {
    let dir = TempDir::new();
    {
        let s = SqliteStore::open(dir.db()).unwrap();
        assert_eq!(s.schema_version().unwrap(), SCHEMA_VERSION);
        s.create_tenant("team-a").unwrap();
    }
    let s = SqliteStore::open(dir.db()).unwrap();
    assert_eq!(s.schema_version().unwrap(), SCHEMA_VERSION);
    assert!(s.tenant_exists("team-a").unwrap());
    let again = SqliteStore::open(dir.db()).unwrap(); // a second handle on an open file
    assert_eq!(again.list_tenants().unwrap(), vec!["team-a".to_string()]);

    let c = rusqlite::Connection::open(dir.db()).unwrap();
    let rows: i64 = c
        .query_row("SELECT COUNT(*) FROM schema_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(rows, SCHEMA_VERSION, "each migration recorded exactly once");
    let mode: String = c
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
}

#[test]
fn a_database_from_a_newer_locker_is_refused_clearly() {
    let dir = TempDir::new();
    drop(SqliteStore::open(dir.db()).unwrap());
    let c = rusqlite::Connection::open(dir.db()).unwrap();
    c.execute(
        "INSERT INTO schema_version (version, applied_at) VALUES (?1, 'x')",
        [SCHEMA_VERSION + 5],
    )
    .unwrap();
    drop(c);
    let err = SqliteStore::open(dir.db()).unwrap_err();
    assert!(matches!(err, StoreError::SchemaTooNew { found, .. } if found == SCHEMA_VERSION + 5));
    let msg = err.to_string();
    assert!(
        msg.contains("newer Locker") && msg.contains("--data-dir"),
        "{msg}"
    );
}

#[test]
fn open_refuses_memory_and_unwritable_paths() {
    assert!(matches!(
        SqliteStore::open(":memory:").unwrap_err(),
        StoreError::Invalid(_)
    ));
    let err = SqliteStore::open("/nonexistent-locker-dir/db.sqlite").unwrap_err();
    assert!(err.to_string().contains("cannot open database"), "{err}");
}

fn tenants_are_validated_and_unique(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.create_tenant("team-b").unwrap();
    assert!(matches!(
        s.create_tenant("team-b").unwrap_err(),
        StoreError::Conflict(m) if m.contains("already exists")
    ));
    s.ensure_tenant("team-b").unwrap();
    s.ensure_tenant("default").unwrap();
    s.ensure_tenant("default").unwrap();
    assert!(matches!(
        s.create_tenant("Team_B").unwrap_err(),
        StoreError::Invalid(_)
    ));
    assert!(matches!(
        s.ensure_tenant("").unwrap_err(),
        StoreError::Invalid(_)
    ));
    assert_eq!(s.list_tenants().unwrap(), vec!["default", "team-b"]);
    assert!(!s.tenant_exists("nobody").unwrap());
}

fn keys_authenticate_revoke_and_are_stored_only_as_hashes(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.create_tenant("team-a").unwrap();
    s.create_tenant("team-b").unwrap();

    let (info, clear) = s.create_key("team-a").unwrap();
    assert!(info.key_id.starts_with("key_"));
    assert!(clear.starts_with("lk_") && clear.len() >= 3 + 52, "{clear}");
    assert_eq!(info.tenant, "team-a");

    let p = s.authenticate(&clear).unwrap().unwrap();
    assert_eq!(
        (p.key_id.as_str(), p.tenant.as_str()),
        (info.key_id.as_str(), "team-a")
    );
    // A second time: from the cache, same answer.
    assert_eq!(s.authenticate(&clear).unwrap().unwrap(), p);
    assert_eq!(s.authenticate("lk_wrong").unwrap(), None);
    assert_eq!(s.authenticate("").unwrap(), None);
    assert_eq!(s.authenticate(&"x".repeat(5000)).unwrap(), None);

    let (info2, clear2) = s.create_key("team-a").unwrap();
    assert_ne!(clear, clear2);
    assert_eq!(s.list_keys("team-a").unwrap().len(), 2);

    // Revocation takes effect at once, also for a key already in the cache.
    assert!(s.revoke_key(&info.key_id).unwrap());
    assert_eq!(s.authenticate(&clear).unwrap(), None);
    assert!(!s.revoke_key(&info.key_id).unwrap(), "already revoked");
    assert!(!s.revoke_key("key_unknown").unwrap());
    assert_eq!(s.list_keys("team-a").unwrap(), vec![info2.clone()]);
    assert!(s.authenticate(&clear2).unwrap().is_some());

    assert!(matches!(
        s.create_key("nobody").unwrap_err(),
        StoreError::NotFound(m) if m.contains("tenant nobody")
    ));

    // Only hashes reach the disk (the database and its write-ahead log).
    let bytes = dir.raw();
    let hash: [u8; 32] = Sha256::digest(clear2.as_bytes()).into();
    assert!(contains(&bytes, &hash), "the test must see the stored hash");
    for k in [&clear, &clear2] {
        assert!(!contains(&bytes, k.as_bytes()), "clear key on disk");
        assert!(!contains(&bytes, &k.as_bytes()[3..]), "key body on disk");
    }
}

fn chosen_keys_are_idempotent_and_guarded(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.ensure_tenant("default").unwrap();
    s.create_tenant("other").unwrap();
    let key = "my-operator-chosen-key-0123456789";
    let a = s.add_key_with_secret("default", key).unwrap();
    let b = s.add_key_with_secret("default", key).unwrap();
    assert_eq!(a, b, "the same key twice is the same key");
    assert_eq!(s.list_keys("default").unwrap().len(), 1);
    assert_eq!(s.authenticate(key).unwrap().unwrap().tenant, "default");

    assert!(matches!(
        s.add_key_with_secret("other", key).unwrap_err(),
        StoreError::Conflict(m) if m.contains("another tenant")
    ));
    for bad in ["", "has space", "tab\tkey", "ünïcode"] {
        assert!(
            matches!(
                s.add_key_with_secret("default", bad),
                Err(StoreError::Invalid(_))
            ),
            "{bad:?}"
        );
    }
    assert!(matches!(
        s.add_key_with_secret("nobody", "abcdefgh"),
        Err(StoreError::NotFound(_))
    ));

    assert!(s.revoke_key(&a.key_id).unwrap());
    assert!(matches!(
        s.add_key_with_secret("default", key).unwrap_err(),
        StoreError::Conflict(m) if m.contains("revoked")
    ));
    assert_eq!(s.authenticate(key).unwrap(), None);

    drop(s);
    let bytes = dir.raw();
    assert!(!contains(&bytes, key.as_bytes()));
}

fn sandboxes_are_isolated_between_tenants(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.create_tenant("a").unwrap();
    s.create_tenant("b").unwrap();
    let sb = sandbox("sb_1", "a", T0);
    s.insert_sandbox(&sb).unwrap();

    assert_eq!(s.get_sandbox("a", "sb_1").unwrap().unwrap(), sb);
    assert_eq!(s.get_sandbox("b", "sb_1").unwrap(), None);
    assert_eq!(s.get_sandbox_any("sb_1").unwrap().unwrap(), sb);
    assert_eq!(s.list_sandboxes("a", None, &[]).unwrap(), vec![sb.clone()]);
    assert!(s.list_sandboxes("b", None, &[]).unwrap().is_empty());

    // Another tenant cannot update it, nor take it over.
    let mut stolen = sb.clone();
    stolen.tenant = "b".into();
    stolen.state = SandboxState::Paused;
    assert!(matches!(
        s.update_sandbox(&stolen),
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(
        s.get_sandbox("a", "sb_1").unwrap().unwrap().state,
        SandboxState::Running
    );

    assert!(matches!(
        s.insert_sandbox(&sb).unwrap_err(),
        StoreError::Conflict(m) if m.contains("sb_1")
    ));
    assert!(matches!(
        s.insert_sandbox(&sandbox("sb_2", "nobody", T0))
            .unwrap_err(),
        StoreError::NotFound(_)
    ));
    let mut bad = sandbox("sb_3", "a", T0);
    bad.expires_at = "tomorrow".into();
    assert!(
        matches!(s.insert_sandbox(&bad), Err(StoreError::Invalid(m)) if m.contains("RFC 3339"))
    );
}

fn update_round_trips_every_field(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.create_tenant("a").unwrap();
    let mut sb = sandbox("sb_1", "a", T0);
    s.insert_sandbox(&sb).unwrap();
    sb.state = SandboxState::Paused;
    sb.network = json!({"egress": "allow", "allow": ["pypi.org"]});
    sb.metadata.insert("owner".into(), "ci".into());
    sb.idle_timeout_s = Some(60);
    sb.cpu_ms = 1234;
    sb.peak_memory_bytes = 5 << 20;
    sb.expires_at = rfc3339(T0 + 10);
    sb.cpus = 0.25;
    sb.preview_token = "lpt_rotated".into();
    sb.public_ports = vec![3000, 8000];
    s.update_sandbox(&sb).unwrap();
    assert_eq!(s.get_sandbox("a", "sb_1").unwrap().unwrap(), sb);
    assert!(matches!(
        s.update_sandbox(&sandbox("sb_missing", "a", T0)),
        Err(StoreError::NotFound(m)) if m.contains("sb_missing")
    ));
}

fn list_filters_by_state_and_metadata(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.create_tenant("a").unwrap();
    s.create_tenant("b").unwrap();
    let meta = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let mut s1 = sandbox("sb_1", "a", T0);
    s1.metadata = meta(&[("env", "prod"), ("team", "x"), ("odd.key\"q", "1")]);
    let mut s2 = sandbox("sb_2", "a", T0 + 1);
    s2.metadata = meta(&[("env", "dev"), ("team", "x")]);
    s2.state = SandboxState::Paused;
    let mut s3 = sandbox("sb_3", "a", T0 + 2);
    s3.metadata = meta(&[("env", "prod")]);
    let mut other = sandbox("sb_4", "b", T0);
    other.metadata = meta(&[("env", "prod"), ("team", "x")]);
    for sb in [&s1, &s2, &s3, &other] {
        s.insert_sandbox(sb).unwrap();
    }
    let ids = |state: Option<SandboxState>, filters: &[(&str, &str)]| -> Vec<String> {
        let f: Vec<(String, String)> = filters
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        s.list_sandboxes("a", state, &f)
            .unwrap()
            .into_iter()
            .map(|x| x.id)
            .collect()
    };
    assert_eq!(ids(None, &[]), ["sb_1", "sb_2", "sb_3"]);
    assert_eq!(ids(None, &[("env", "prod")]), ["sb_1", "sb_3"]);
    assert_eq!(ids(None, &[("team", "x")]), ["sb_1", "sb_2"]);
    assert_eq!(ids(None, &[("env", "prod"), ("team", "x")]), ["sb_1"]);
    assert_eq!(ids(None, &[("odd.key\"q", "1")]), ["sb_1"]);
    assert!(ids(None, &[("env", "staging")]).is_empty());
    assert!(ids(None, &[("missing", "")]).is_empty());
    assert_eq!(ids(Some(SandboxState::Paused), &[]), ["sb_2"]);
    assert_eq!(ids(Some(SandboxState::Running), &[("team", "x")]), ["sb_1"]);
    assert!(ids(Some(SandboxState::Failed), &[]).is_empty());
}

fn sandbox_pages_count_skip_and_order(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.create_tenant("a").unwrap();
    s.create_tenant("b").unwrap();
    // 25 of tenant a, two created in the same second (rowid breaks the tie); every third
    // paused and labelled; one of tenant b and one deleted never show.
    for i in 0..25 {
        let mut sb = sandbox(&format!("sb_{i:02}"), "a", T0 + i.min(20));
        if i % 3 == 0 {
            sb.state = SandboxState::Paused;
            sb.metadata.insert("third".into(), "yes".into());
        }
        s.insert_sandbox(&sb).unwrap();
    }
    s.insert_sandbox(&sandbox("sb_b", "b", T0)).unwrap();
    s.insert_sandbox(&sandbox("sb_gone", "a", T0)).unwrap();
    assert!(s.delete_sandbox("sb_gone").unwrap());
    let page = |q: SandboxQuery| -> (Vec<String>, u64) {
        let p = s.list_sandboxes_page("a", &q).unwrap();
        (p.sandboxes.into_iter().map(|x| x.id).collect(), p.total)
    };
    let all: Vec<String> = (0..25).map(|i| format!("sb_{i:02}")).collect();
    assert_eq!(page(SandboxQuery::default()), (all.clone(), 25));
    let (first, total) = page(SandboxQuery {
        limit: Some(10),
        ..Default::default()
    });
    assert_eq!((first.as_slice(), total), (&all[..10], 25));
    let (last, _) = page(SandboxQuery {
        limit: Some(10),
        offset: 20,
        ..Default::default()
    });
    assert_eq!(last, &all[20..]);
    let mut newest = all.clone();
    newest.reverse();
    let (head, _) = page(SandboxQuery {
        newest_first: true,
        limit: Some(3),
        ..Default::default()
    });
    assert_eq!(
        head,
        &newest[..3],
        "newest first, same-second ties by insertion"
    );
    let (paused, total) = page(SandboxQuery {
        state: Some(SandboxState::Paused),
        metadata: vec![("third".into(), "yes".into())],
        newest_first: true,
        offset: 1,
        limit: Some(2),
    });
    assert_eq!(paused, ["sb_21", "sb_18"]);
    assert_eq!(total, 9, "the total counts every match, not the page");
    let (past, total) = page(SandboxQuery {
        offset: 100,
        limit: Some(10),
        ..Default::default()
    });
    assert!(past.is_empty());
    assert_eq!(total, 25);
}

fn lifecycle_queries_and_soft_delete(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.create_tenant("a").unwrap();
    s.create_tenant("b").unwrap();
    let mut idle = sandbox("sb_idle", "a", T0);
    idle.idle_timeout_s = Some(60);
    idle.memory_mb = 1024;
    let mut short = sandbox("sb_short", "a", T0);
    short.expires_at = rfc3339(T0 + 100);
    let mut starting = sandbox("sb_starting", "b", T0);
    starting.state = SandboxState::Starting;
    for sb in [&idle, &short, &starting] {
        s.insert_sandbox(sb).unwrap();
    }

    assert_eq!(s.count_running("a").unwrap(), 2);
    assert_eq!(s.sum_memory_mb("a").unwrap(), 1024 + 512);
    assert_eq!(s.count_running("b").unwrap(), 1);
    assert_eq!(s.count_running("nobody").unwrap(), 0);
    assert_eq!(s.list_live_sandboxes().unwrap().len(), 3);

    assert!(s.expired_sandboxes(T0 + 99).unwrap().is_empty());
    assert_eq!(s.expired_sandboxes(T0 + 100).unwrap(), ["sb_short"]);
    assert_eq!(s.expired_sandboxes(T0 + 1800).unwrap().len(), 3);

    assert!(s.idle_sandboxes(T0 + 59).unwrap().is_empty());
    assert_eq!(s.idle_sandboxes(T0 + 60).unwrap(), ["sb_idle"]);
    s.touch_sandbox("sb_idle", T0 + 50).unwrap();
    s.touch_sandbox("sb_idle", T0 + 10).unwrap(); // older: ignored, not an error
    assert!(s.idle_sandboxes(T0 + 60).unwrap().is_empty());
    assert_eq!(s.idle_sandboxes(T0 + 110).unwrap(), ["sb_idle"]);
    assert_eq!(
        s.get_sandbox("a", "sb_idle")
            .unwrap()
            .unwrap()
            .last_active_at,
        rfc3339(T0 + 50)
    );
    assert!(matches!(
        s.touch_sandbox("sb_none", T0),
        Err(StoreError::NotFound(_))
    ));

    s.set_sandbox_state_at("sb_idle", SandboxState::Paused, T0 + 200)
        .unwrap();
    assert!(
        s.idle_sandboxes(T0 + 1000).unwrap().is_empty(),
        "paused is not idle-paused again"
    );
    assert_eq!(
        s.count_running("a").unwrap(),
        2,
        "paused still holds its machine"
    );
    s.set_sandbox_state_at("sb_short", SandboxState::Failed, T0 + 200)
        .unwrap();
    assert_eq!(s.count_running("a").unwrap(), 1);
    assert_eq!(s.sum_memory_mb("a").unwrap(), 1024);
    assert_eq!(s.list_live_sandboxes().unwrap().len(), 2);
    assert!(matches!(
        s.set_sandbox_state_at("sb_none", SandboxState::Running, T0),
        Err(StoreError::NotFound(_))
    ));

    // Soft delete: gone from every read, kept for usage, env wiped.
    assert!(s.delete_sandbox_at("sb_idle", T0 + 300).unwrap());
    assert!(!s.delete_sandbox_at("sb_idle", T0 + 301).unwrap());
    assert_eq!(s.get_sandbox("a", "sb_idle").unwrap(), None);
    assert_eq!(s.get_sandbox_any("sb_idle").unwrap(), None);
    assert_eq!(
        s.list_sandboxes("a", None, &[])
            .unwrap()
            .into_iter()
            .map(|x| x.id)
            .collect::<Vec<_>>(),
        ["sb_short"]
    );
    assert_eq!(s.count_running("a").unwrap(), 0);
    assert!(!s
        .expired_sandboxes(T0 + 10_000)
        .unwrap()
        .contains(&"sb_idle".to_string()));
    assert!(matches!(
        s.set_sandbox_state_at("sb_idle", SandboxState::Running, T0),
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        s.insert_sandbox(&sandbox("sb_idle", "a", T0)),
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        dir.row("SELECT state, env FROM sandboxes WHERE id = 'sb_idle'"),
        "stopped|{}"
    );
}

fn usage_counts_calls_and_sandbox_seconds_in_the_window(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.create_tenant("a").unwrap();
    s.create_tenant("b").unwrap();
    // sb_1: T0 .. T0+100 (deleted); sb_2: T0+50 .. still running; sb_3: failed at T0+20;
    // b's sandbox must not count.
    s.insert_sandbox(&sandbox("sb_1", "a", T0)).unwrap();
    s.insert_sandbox(&sandbox("sb_2", "a", T0 + 50)).unwrap();
    s.insert_sandbox(&sandbox("sb_3", "a", T0 + 10)).unwrap();
    s.insert_sandbox(&sandbox("sb_b", "b", T0)).unwrap();
    s.delete_sandbox_at("sb_1", T0 + 100).unwrap();
    s.set_sandbox_state_at("sb_3", SandboxState::Failed, T0 + 20)
        .unwrap();
    // Ending again does not move the end.
    s.delete_sandbox_at("sb_3", T0 + 500).unwrap();
    // Time splits count once their sandbox ended: sb_1's and sb_3's, not sb_2's yet.
    let times = |a, i, p| locker_store::SandboxTimes {
        active_ms: a,
        idle_ms: i,
        paused_ms: p,
        call_gaps: vec![1, 0, 2],
        call_gap_sum_ms: 4321,
    };
    s.put_sandbox_times("sb_1", &times(1000, 3000, 500))
        .unwrap();
    s.put_sandbox_times("sb_2", &times(7, 7, 7)).unwrap();
    s.put_sandbox_times("sb_3", &times(10, 20, 0)).unwrap();
    assert_eq!(
        s.sandbox_times("sb_1").unwrap(),
        Some(times(1000, 3000, 500))
    );
    assert_eq!(s.sandbox_times("sb_none").unwrap(), None);
    let cpu = sandbox("sb_x", "a", T0).cpu_ms;

    let mut calls = vec![
        call("call_1", "a", CallKind::Exec, Some("sb_1"), T0 + 1),
        call("call_2", "a", CallKind::Run, None, T0 + 60),
        call("call_3", "a", CallKind::Process, Some("sb_2"), T0 + 70),
        call("call_4", "b", CallKind::Exec, Some("sb_b"), T0 + 70),
    ];
    calls[1].result.usage.cpu_ms = 100;
    s.insert_calls(&calls).unwrap();

    let now = T0 + 200;
    assert_eq!(
        s.usage_at("a", None, now).unwrap(),
        TenantUsage {
            cpu_ms: 10 + 100 + 10,
            // sb_1: 100, sb_2: 150, sb_3: 10
            sandbox_seconds: 100 + 150 + 10,
            runs: 1,
            execs: 2,
            ended_active_ms: 1010,
            ended_idle_ms: 3020,
            ended_paused_ms: 500,
            ended_cpu_ms: 2 * cpu,
        }
    );
    assert_eq!(
        s.usage_at("a", Some(T0 + 60), now).unwrap(),
        TenantUsage {
            cpu_ms: 110,
            // sb_1: 40, sb_2: 140, sb_3 ended before the window
            sandbox_seconds: 40 + 140,
            runs: 1,
            execs: 1,
            ended_active_ms: 1000,
            ended_idle_ms: 3000,
            ended_paused_ms: 500,
            ended_cpu_ms: cpu,
        }
    );
    assert_eq!(
        s.usage_at("a", Some(T0 + 1000), now).unwrap(),
        TenantUsage::default()
    );
    assert_eq!(s.usage_at("b", None, now).unwrap().sandbox_seconds, 200);
    assert_eq!(
        s.usage_at("nobody", None, now).unwrap(),
        TenantUsage::default()
    );
}

fn call_records_strip_output_filter_and_isolate(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    let mut run = call("call_r", "a", CallKind::Run, None, T0);
    run.volume_id = Some("vol_1".into());
    run.changes = Some(json!({"added": ["/workspace/a.txt"], "modified": [], "deleted": []}));
    run.egress_denied = vec!["evil.example".into()];
    let batch = vec![
        call("call_1", "a", CallKind::Exec, Some("sb_1"), T0),
        call("call_2", "a", CallKind::Exec, Some("sb_2"), T0),
        run.clone(),
        call("call_b", "b", CallKind::Exec, Some("sb_1"), T0),
    ];
    s.insert_calls(&batch).unwrap();

    let all = s.list_calls("a", None, None, None).unwrap();
    assert_eq!(
        all.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(),
        ["call_r", "call_2", "call_1"]
    );
    for c in &all {
        assert_eq!(
            (c.result.stdout.as_str(), c.result.stderr.as_str()),
            ("", "")
        );
        assert_eq!(c.result.stdout_bytes, 30, "sizes are kept");
    }
    let mut expected = run;
    expected.strip_output();
    assert_eq!(all[0], expected);

    let by_sb: Vec<_> = s
        .list_calls("a", Some("sb_1"), None, None)
        .unwrap()
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(
        by_sb,
        ["call_1"],
        "b's call on an id of the same name stays b's"
    );
    let by_vol = s.list_calls("a", None, Some("vol_1"), None).unwrap();
    assert_eq!(by_vol.len(), 1);
    assert!(s
        .list_calls("a", Some("sb_1"), Some("vol_1"), None)
        .unwrap()
        .is_empty());
    assert_eq!(s.list_calls("b", None, None, None).unwrap().len(), 1);

    let bytes = dir.raw();
    assert!(!contains(&bytes, b"OUTPUT-BODY-MUST-NOT-BE-STORED"));
    assert!(!contains(&bytes, b"T1VUUFVU"));
    assert!(contains(&bytes, b"evil.example"));

    // One transaction: a duplicate id fails the whole batch, nothing of it is stored.
    let err = s
        .insert_calls(&[
            call("call_new", "a", CallKind::Exec, None, T0),
            call("call_1", "a", CallKind::Exec, None, T0),
        ])
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict(m) if m.contains("call_1")));
    assert_eq!(s.list_calls("a", None, None, None).unwrap().len(), 3);
    let mut bad = call("call_bad", "a", CallKind::Exec, None, T0);
    bad.created_at = "yesterday".into();
    assert!(matches!(
        s.insert_calls(&[bad]),
        Err(StoreError::Invalid(_))
    ));
}

async fn recorder_batches_a_thousand_records_without_waiting(b: Backend) {
    let dir = Db::new(b);
    let store = dir.open();
    let recorder = CallRecorder::spawn(Arc::clone(&store));

    let start = Instant::now();
    for i in 0..1000 {
        recorder.record(call(
            &format!("call_{i:04}"),
            "a",
            CallKind::Exec,
            Some("sb_1"),
            T0,
        ));
    }
    let queued = start.elapsed();
    recorder.flush().await;
    let stats = recorder.stats();
    assert_eq!((stats.written, stats.dropped, stats.failed), (1000, 0, 0));
    assert!(
        (4..=100).contains(&stats.batches),
        "1000 records should take a few transactions, took {}",
        stats.batches
    );
    // Recording is a queue push: far below a millisecond per record even in debug builds.
    assert!(queued.as_millis() < 500, "recording 1000 took {queued:?}");

    let page = store.list_calls("a", None, None, Some(1000)).unwrap();
    assert_eq!(page.len(), 1000);
    assert_eq!(page[0].id, "call_0999", "newest first");
    assert_eq!(page[999].id, "call_0000");
    assert!(page.iter().all(|c| c.result.stdout.is_empty()));
    let default_page = store.list_calls("a", None, None, None).unwrap();
    assert_eq!(default_page.len(), 100);
    assert_eq!(default_page[..], page[..100]);
    assert_eq!(
        store.list_calls("a", None, None, Some(5)).unwrap()[..],
        page[..5]
    );
    assert_eq!(store.list_calls("a", None, None, Some(0)).unwrap().len(), 1);
    recorder.record(call("call_more", "a", CallKind::Exec, None, T0));
    recorder.flush().await;
    assert_eq!(
        store
            .list_calls("a", None, None, Some(u32::MAX))
            .unwrap()
            .len(),
        1000,
        "capped at 1000"
    );
    assert_eq!(
        store.list_calls("a", None, None, Some(1)).unwrap()[0].id,
        "call_more"
    );
}

async fn recorder_drops_on_a_full_queue_and_survives_bad_records(b: Backend) {
    let dir = Db::new(b);
    let store = dir.open();
    store
        .insert_calls(&[call("call_dup", "a", CallKind::Exec, None, T0)])
        .unwrap();

    // On a current-thread runtime the writer cannot run until we yield, so a queue of
    // two holds exactly two records and refuses the rest.
    let recorder = CallRecorder::spawn_with_capacity(Arc::clone(&store), 2);
    for i in 0..10 {
        recorder.record(call(&format!("call_q{i}"), "a", CallKind::Exec, None, T0));
    }
    assert_eq!(recorder.stats().dropped, 8);
    recorder.flush().await;
    assert_eq!(recorder.stats().written, 2);

    // A batch holding one bad record: the others are still written, one by one.
    recorder.record(call("call_ok1", "a", CallKind::Exec, None, T0));
    recorder.record(call("call_dup", "a", CallKind::Exec, None, T0));
    recorder.flush().await;
    recorder.record(call("call_ok2", "a", CallKind::Exec, None, T0));
    recorder.flush().await;
    let stats = recorder.stats();
    assert_eq!((stats.written, stats.failed, stats.dropped), (4, 1, 8));
    let ids: Vec<String> = store
        .list_calls("a", None, None, None)
        .unwrap()
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(
        ids,
        ["call_ok2", "call_ok1", "call_q1", "call_q0", "call_dup"]
    );
}

async fn recorder_writes_what_is_queued_when_dropped(b: Backend) {
    let dir = Db::new(b);
    let store = dir.open();
    let recorder = CallRecorder::spawn(Arc::clone(&store));
    recorder.record(call("call_last", "a", CallKind::Exec, None, T0));
    let clone = recorder.clone();
    drop(recorder);
    clone.flush().await;
    assert_eq!(store.list_calls("a", None, None, None).unwrap().len(), 1);
}

fn concurrent_use_from_several_threads(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    // A second store on the same file, as a second process would have.
    let other: Arc<dyn Store> = dir.open();
    const THREADS: usize = 8;
    const PER_THREAD: usize = 50;
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let s = if t % 2 == 0 { &s } else { &other };
            scope.spawn(move || {
                let tenant = format!("t{t}");
                s.create_tenant(&tenant).unwrap();
                let (info, key) = s.create_key(&tenant).unwrap();
                for i in 0..PER_THREAD {
                    let p = s.authenticate(&key).unwrap().unwrap();
                    assert_eq!(p.tenant, tenant);
                    let id = format!("sb_{t}_{i}");
                    s.insert_sandbox(&sandbox(&id, &tenant, T0 + i as i64))
                        .unwrap();
                    s.touch_sandbox(&id, T0 + 1000).unwrap();
                    s.insert_calls(&[call(
                        &format!("call_{t}_{i}"),
                        &tenant,
                        CallKind::Exec,
                        Some(&id),
                        T0,
                    )])
                    .unwrap();
                    assert!(s.get_sandbox(&tenant, &id).unwrap().is_some());
                    if i % 10 == 0 {
                        s.delete_sandbox(&id).unwrap();
                    }
                }
                assert!(s.revoke_key(&info.key_id).unwrap());
                assert_eq!(s.authenticate(&key).unwrap(), None);
            });
        }
    });
    for t in 0..THREADS {
        let tenant = format!("t{t}");
        assert_eq!(
            s.list_sandboxes(&tenant, None, &[]).unwrap().len(),
            PER_THREAD - PER_THREAD / 10
        );
        assert_eq!(
            other
                .list_calls(&tenant, None, None, Some(1000))
                .unwrap()
                .len(),
            PER_THREAD
        );
        assert_eq!(
            s.usage_at(&tenant, None, T0).unwrap().execs,
            PER_THREAD as u64
        );
    }
    assert_eq!(s.list_tenants().unwrap().len(), THREADS);
}

fn snapshots_are_isolated_between_tenants_and_survive_reopen(b: Backend) {
    let dir = Db::new(b);
    let store = dir.open();
    store.ensure_tenant("a").unwrap();
    store.ensure_tenant("b").unwrap();
    let snap = |id: &str, tenant: &str| locker_store::SnapshotRecord {
        id: id.into(),
        tenant: tenant.into(),
        sandbox_id: "sb_1".into(),
        template: "default".into(),
        template_digest: "d".into(),
        runtime: "jail".into(),
        size_bytes: 42,
        has_memory: false,
        cpus: 1.0,
        memory_mb: 512,
        disk_mb: 2048,
        created_at: rfc3339(1),
        path: format!("/x/{id}"),
        host: "host-1".into(),
    };
    store.insert_snapshot(&snap("snap_1", "a")).unwrap();
    store.insert_snapshot(&snap("snap_2", "b")).unwrap();
    assert!(matches!(
        store.insert_snapshot(&snap("snap_1", "a")),
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        store
            .get_snapshot("a", "snap_1")
            .unwrap()
            .unwrap()
            .size_bytes,
        42
    );
    assert!(
        store.get_snapshot("b", "snap_1").unwrap().is_none(),
        "another tenant's snapshot is invisible"
    );
    assert_eq!(store.list_snapshots("a").unwrap().len(), 1);
    assert!(
        !store.delete_snapshot("b", "snap_1").unwrap(),
        "nor deletable"
    );
    drop(store);
    let store = dir.open();
    assert_eq!(store.list_snapshots("a").unwrap()[0].id, "snap_1");
    assert!(store.delete_snapshot("a", "snap_1").unwrap());
    assert!(store.list_snapshots("a").unwrap().is_empty());
}

fn volumes_have_unique_names_per_tenant_and_are_isolated(b: Backend) {
    use locker_store::{VolumeRecord, VolumeSnapshotRecord};
    let dir = Db::new(b);
    let store = dir.open();
    store.ensure_tenant("a").unwrap();
    store.ensure_tenant("b").unwrap();
    let vol = |id: &str, tenant: &str, name: &str| VolumeRecord {
        id: id.into(),
        tenant: tenant.into(),
        name: name.into(),
        size_mb: 100,
        created_at: rfc3339(10),
        host: String::new(),
    };
    store.insert_volume(&vol("vol_1", "a", "repo")).unwrap();
    assert!(
        matches!(store.insert_volume(&vol("vol_2", "a", "repo")), Err(StoreError::Conflict(m)) if m.contains("repo")),
        "a name is unique within its tenant"
    );
    store.insert_volume(&vol("vol_3", "b", "repo")).unwrap();
    // The disk quota counts volumes' sizes and live sandboxes' disks, per tenant.
    assert_eq!(store.sum_disk_mb("a").unwrap(), 100);
    let mut sb = sandbox("sb_disk", "a", 10);
    sb.disk_mb = 300;
    store.insert_sandbox(&sb).unwrap();
    let mut gone = sandbox("sb_gone", "a", 10);
    gone.state = SandboxState::Failed;
    store.insert_sandbox(&gone).unwrap();
    assert_eq!(
        store.sum_disk_mb("a").unwrap(),
        400,
        "a failed sandbox holds no disk"
    );
    assert_eq!(store.sum_disk_mb("b").unwrap(), 100);
    assert_eq!(store.sum_disk_mb("nobody").unwrap(), 0);
    assert!(
        matches!(store.insert_volume(&vol("vol_4", "a", "Bad")), Err(StoreError::Invalid(m)) if m.contains("name"))
    );
    assert!(matches!(
        store.insert_volume(&vol("vol_5", "nobody", "x")),
        Err(StoreError::NotFound(_))
    ));
    store.insert_volume(&vol("vol_6", "a", "vol_3")).unwrap();

    assert_eq!(
        store.get_volume("a", "vol_1").unwrap().unwrap().name,
        "repo"
    );
    assert_eq!(
        store.get_volume("a", "repo").unwrap().unwrap().id,
        "vol_1",
        "by name too"
    );
    assert_eq!(store.get_volume("b", "repo").unwrap().unwrap().id, "vol_3");
    assert!(
        store.get_volume("b", "vol_1").unwrap().is_none(),
        "another tenant's volume is invisible"
    );
    assert_eq!(
        store.get_volume("a", "vol_3").unwrap().unwrap().id,
        "vol_6",
        "a's name, not b's id"
    );
    assert_eq!(
        store
            .list_volumes("a")
            .unwrap()
            .iter()
            .map(|v| v.id.as_str())
            .collect::<Vec<_>>(),
        ["vol_1", "vol_6"]
    );
    assert_eq!(store.list_all_volumes().unwrap().len(), 3);

    let snap = |id: &str, tenant: &str, vol: &str| VolumeSnapshotRecord {
        id: id.into(),
        tenant: tenant.into(),
        volume_id: vol.into(),
        size_bytes: 7,
        created_at: rfc3339(20),
        path: format!("/x/{id}"),
    };
    store
        .insert_volume_snapshot(&snap("snap_1", "a", "vol_1"))
        .unwrap();
    assert!(matches!(
        store.insert_volume_snapshot(&snap("snap_1", "a", "vol_1")),
        Err(StoreError::Conflict(_))
    ));
    assert!(store.get_volume_snapshot("b", "snap_1").unwrap().is_none());
    assert!(
        store.get_snapshot("a", "snap_1").unwrap().is_none(),
        "not a sandbox snapshot"
    );
    assert_eq!(store.list_volume_snapshots("a", "vol_1").unwrap().len(), 1);

    assert!(
        !store.delete_volume("b", "vol_1").unwrap(),
        "nor deletable by another tenant"
    );
    drop(store);
    let store = dir.open();
    assert_eq!(
        store
            .get_volume_snapshot("a", "snap_1")
            .unwrap()
            .unwrap()
            .size_bytes,
        7
    );
    // A move switches the home only from the host it names, and the snapshots' paths with it.
    store.host_volumes("host-a").unwrap();
    let mut moved = store.get_volume_snapshot("a", "snap_1").unwrap().unwrap();
    moved.path = "/b/snap_1".into();
    assert!(
        !store
            .move_volume(
                "a",
                "vol_1",
                "host-b",
                "host-c",
                std::slice::from_ref(&moved)
            )
            .unwrap(),
        "not from a host it is not on"
    );
    assert!(!store
        .move_volume("b", "vol_1", "host-a", "host-b", &[])
        .unwrap());
    assert_eq!(
        store
            .get_volume_snapshot("a", "snap_1")
            .unwrap()
            .unwrap()
            .path,
        "/x/snap_1",
        "a refused move changes nothing"
    );
    assert!(store
        .move_volume(
            "a",
            "vol_1",
            "host-a",
            "host-b",
            std::slice::from_ref(&moved)
        )
        .unwrap());
    assert_eq!(
        store.get_volume("a", "vol_1").unwrap().unwrap().host,
        "host-b"
    );
    assert_eq!(
        store.get_volume_snapshot("a", "snap_1").unwrap().unwrap(),
        moved
    );
    assert!(store
        .host_volumes("host-a")
        .unwrap()
        .iter()
        .all(|v| v.id != "vol_1"));
    assert!(store.delete_volume("a", "vol_1").unwrap());
    assert!(store.get_volume("a", "repo").unwrap().is_none());
    assert!(
        store.get_volume_snapshot("a", "snap_1").unwrap().is_none(),
        "its snapshots go with it"
    );
    store.insert_volume(&vol("vol_7", "a", "repo")).unwrap();
}

fn code_cells_are_recorded_beside_execs_newest_first(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.insert_calls(&[
        call("call_1", "a", CallKind::Exec, Some("sb_1"), T0),
        call("call_2", "a", CallKind::Code, Some("sb_1"), T0),
    ])
    .unwrap();
    drop(s);
    // Reopened (every migration already applied: none runs again), then more records.
    let s = dir.open();
    s.insert_calls(&[call("call_3", "a", CallKind::Code, Some("sb_1"), T0)])
        .unwrap();
    let got = s.list_calls("a", Some("sb_1"), None, None).unwrap();
    assert_eq!(
        got.iter()
            .map(|c| (c.id.as_str(), c.kind))
            .collect::<Vec<_>>(),
        [
            ("call_3", CallKind::Code),
            ("call_2", CallKind::Code),
            ("call_1", CallKind::Exec)
        ]
    );
    assert_eq!(
        serde_json::to_value(CallKind::Code).unwrap(),
        json!("code"),
        "the API's name"
    );
}

fn events_grow_prune_and_feed_webhook_cursors(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    s.create_tenant("a").unwrap();
    s.create_tenant("b").unwrap();
    let e1 = s
        .insert_event("a", "sandbox.created", "sb_1", "{}", T0)
        .unwrap();
    let e2 = s
        .insert_event("b", "sandbox.created", "sb_2", "{}", T0 + 1)
        .unwrap();
    let hook = locker_store::WebhookRecord {
        id: "wh_1".into(),
        tenant: "a".into(),
        url: "http://127.0.0.1:1/".into(),
        events: vec!["sandbox.*".into()],
        secret: "s3cret".into(),
        created_unix: T0,
        cursor: 0,
    };
    // A new webhook starts after the newest event.
    assert_eq!(s.insert_webhook(&hook).unwrap().cursor, e2);
    let e3 = s
        .insert_event("a", "sandbox.deleted", "sb_1", "{\"x\":1}", T0 + 2)
        .unwrap();
    assert!(e1 < e2 && e2 < e3);
    let a: Vec<u64> = s
        .events_after(Some("a"), 0, 10)
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(a, vec![e1, e3]);
    assert_eq!(s.events_after(None, e1, 10).unwrap().len(), 2);
    assert_eq!(s.events_after(None, 0, 1).unwrap()[0].seq, e1);
    s.set_webhook_cursor("wh_1", e3).unwrap();
    s.set_webhook_cursor("wh_1", e1).unwrap();
    assert_eq!(s.list_webhooks(Some("a")).unwrap()[0].cursor, e3);
    assert!(s.list_webhooks(Some("b")).unwrap().is_empty());
    assert!(!s.delete_webhook("b", "wh_1").unwrap());
    // Pruning: by age, then by count; seq never goes back.
    assert_eq!(s.prune_events(T0 + 1, 100).unwrap(), 1);
    assert_eq!(s.prune_events(0, 1).unwrap(), 1);
    let left = s.events_after(None, 0, 10).unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].seq, e3);
    s.prune_events(T0 + 10, 0).unwrap();
    assert_eq!(s.latest_event_seq().unwrap(), e3);
    assert!(
        s.insert_event("a", "sandbox.created", "sb_3", "{}", T0 + 3)
            .unwrap()
            > e3
    );
    assert!(s.delete_webhook("a", "wh_1").unwrap());
}

fn call_pages_follow_a_cursor_and_filter_by_key_kind_and_outcome(b: Backend) {
    let dir = Db::new(b);
    let s = dir.open();
    let mut batch = Vec::new();
    for i in 0..25 {
        let kind = if i % 5 == 0 {
            CallKind::Run
        } else {
            CallKind::Exec
        };
        let mut c = call(&format!("call_{i:02}"), "a", kind, Some("sb_1"), T0 + i);
        c.key_id = if i % 2 == 0 { "key_even" } else { "key_odd" }.into();
        match i % 3 {
            0 => {}
            1 => c.result.exit_code = Some(2),
            _ => {
                c.result.reason = Reason::Timeout;
                c.result.exit_code = None;
            }
        }
        batch.push(c);
    }
    batch.push(call("call_b", "b", CallKind::Exec, Some("sb_1"), T0));
    s.insert_calls(&batch).unwrap();

    let mut q = locker_store::CallQuery {
        limit: Some(10),
        ..Default::default()
    };
    let mut ids = Vec::new();
    let mut pages = 0;
    loop {
        let page = s.list_calls_page("a", &q).unwrap();
        pages += 1;
        ids.extend(page.calls.into_iter().map(|c| c.id));
        match page.next_cursor {
            Some(c) => q.before = Some(c),
            None => break,
        }
        // A record written between pages is newer than the cursor: it never shifts a page.
        if pages == 1 {
            s.insert_calls(&[call("call_late", "a", CallKind::Exec, None, T0)])
                .unwrap();
        }
    }
    assert_eq!(pages, 3);
    let expected: Vec<String> = (0..25).rev().map(|i| format!("call_{i:02}")).collect();
    assert_eq!(ids, expected);

    let n = |q: locker_store::CallQuery| s.list_calls_page("a", &q).unwrap().calls.len();
    let all = || locker_store::CallQuery {
        limit: Some(1000),
        ..Default::default()
    };
    use locker_store::CallOutcome;
    assert_eq!(
        n(locker_store::CallQuery {
            outcome: Some(CallOutcome::Ok),
            ..all()
        }),
        9 + 1,
        "i%3==0, and call_late"
    );
    assert_eq!(
        n(locker_store::CallQuery {
            outcome: Some(CallOutcome::Failed),
            ..all()
        }),
        16
    );
    assert_eq!(
        n(locker_store::CallQuery {
            outcome: Some(CallOutcome::Reason("timeout")),
            ..all()
        }),
        8
    );
    assert_eq!(
        n(locker_store::CallQuery {
            key_id: Some("key_even".into()),
            ..all()
        }),
        13
    );
    assert_eq!(
        n(locker_store::CallQuery {
            kind: Some(CallKind::Run),
            ..all()
        }),
        5
    );
    assert_eq!(
        n(locker_store::CallQuery {
            kind: Some(CallKind::Run),
            key_id: Some("key_odd".into()),
            outcome: Some(CallOutcome::Reason("exited")),
            ..all()
        }),
        1,
        "run 15 (exit 0); run 5 timed out"
    );
    assert!("sometimes".parse::<CallOutcome>().is_err());
}

// ---- the Postgres store's own: its schema, its URLs, its cache, the copy from SQLite ----

#[test]
fn postgres_migrations_apply_once_and_reconnect_keeps_data() {
    let db = Db::new(Backend::Postgres);
    let Db::Postgres { name, url } = &db else {
        unreachable!()
    };
    {
        let s = PgStore::connect(url).unwrap();
        assert_eq!(s.schema_version().unwrap(), locker_store::PG_SCHEMA_VERSION);
        s.create_tenant("team-a").unwrap();
    }
    // Two servers starting at once on the same database: one migrates, neither fails.
    let (a, b) = std::thread::scope(|sc| {
        let a = sc.spawn(|| PgStore::connect(url).unwrap());
        let b = sc.spawn(|| PgStore::connect(url).unwrap());
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(a.tenant_exists("team-a").unwrap());
    assert_eq!(b.list_tenants().unwrap(), vec!["team-a".to_string()]);
    assert_eq!(
        pg::cluster()
            .psql(name, "SELECT COUNT(*) FROM schema_version")
            .trim(),
        locker_store::PG_SCHEMA_VERSION.to_string(),
        "each migration recorded exactly once"
    );
}

#[test]
/// Control replicas on one database: one leads at a time (the leadership is a session's, so
/// it moves when its holder goes), and they share the database while a one-host server has
/// it alone, each kind refusing the other.
fn postgres_leadership_moves_and_servers_claim_the_database() {
    let db = Db::new(Backend::Postgres);
    let Db::Postgres { url, .. } = &db else {
        unreachable!()
    };
    let (a, b) = (
        PgStore::connect(url).unwrap(),
        PgStore::connect(url).unwrap(),
    );
    assert!(a.lead().unwrap(), "the first to ask leads");
    assert!(!b.lead().unwrap(), "only one leads");
    assert!(
        a.lead().unwrap(),
        "the leader keeps leading when it asks again"
    );
    assert!(!b.lead().unwrap());
    drop(a);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !b.lead().unwrap() {
        assert!(
            std::time::Instant::now() < deadline,
            "the leadership never moved when its holder went"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    b.claim_server(true).unwrap();
    let c = PgStore::connect(url).unwrap();
    c.claim_server(true).unwrap();
    let single = PgStore::connect(url).unwrap();
    let err = single.claim_server(false).unwrap_err().to_string();
    assert!(err.contains("another locker serve already uses"), "{err}");
    drop((b, c));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while single.claim_server(false).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the replicas' claims stayed"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let replica = PgStore::connect(url).unwrap();
    let err = replica.claim_server(true).unwrap_err().to_string();
    assert!(err.contains("--fleet-listen"), "{err}");
}

#[test]
fn postgres_database_from_a_newer_locker_is_refused_clearly() {
    let db = Db::new(Backend::Postgres);
    let Db::Postgres { name, url } = &db else {
        unreachable!()
    };
    drop(PgStore::connect(url).unwrap());
    pg::cluster().psql(
        name,
        &format!(
            "INSERT INTO schema_version (version, applied_at) VALUES ({}, 'x')",
            locker_store::PG_SCHEMA_VERSION + 5
        ),
    );
    let err = PgStore::connect(url).unwrap_err();
    assert!(
        matches!(err, StoreError::PgSchemaTooNew { found, .. } if found == locker_store::PG_SCHEMA_VERSION + 5)
    );
    let msg = err.to_string();
    assert!(
        msg.contains("newer Locker") && msg.contains("--database"),
        "{msg}"
    );
}

#[test]
fn postgres_urls_that_cannot_work_are_refused_clearly() {
    let port = pg::cluster().port;
    let err = PgStore::connect(&format!(
        "postgres://postgres:hunter2@127.0.0.1:{port}/no_such_db"
    ))
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, StoreError::PgConnect { .. }) && msg.contains("no_such_db"),
        "{msg}"
    );
    assert!(!msg.contains("hunter2"), "the password never shows: {msg}");
    let err = PgStore::connect("postgres://h:notaport/db").unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
}

#[test]
fn postgres_revoke_reaches_another_server_within_the_cache_ttl() {
    let db = Db::new(Backend::Postgres);
    let (a, b) = (db.open(), db.open());
    a.create_tenant("t").unwrap();
    let (info, key) = a.create_key("t").unwrap();
    assert_eq!(b.authenticate(&key).unwrap().unwrap().key_id, info.key_id);
    assert!(a.revoke_key(&info.key_id).unwrap());
    assert_eq!(a.authenticate(&key).unwrap(), None, "at once where revoked");
    let start = Instant::now();
    while b.authenticate(&key).unwrap().is_some() {
        assert!(
            start.elapsed() < locker_store::AUTH_CACHE_TTL + std::time::Duration::from_secs(1),
            "the other server still accepts a revoked key after {:?}",
            start.elapsed()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A one-host install with a row in every table, some of them ones no read returns.
fn fill_every_table(s: &dyn Store) {
    s.ensure_tenant("default").unwrap();
    s.create_tenant("team-a").unwrap();
    s.add_key_with_secret("default", "lk_chosen_key_0123456789")
        .unwrap();
    let (revoked, _) = s.create_key("team-a").unwrap();
    s.create_key("team-a").unwrap();
    s.revoke_key(&revoked.key_id).unwrap();
    let mut sb = sandbox("sb_live", "team-a", T0);
    sb.metadata.insert("owner".into(), "ci".into());
    s.insert_sandbox(&sb).unwrap();
    s.insert_sandbox(&sandbox("sb_gone", "team-a", T0 + 1))
        .unwrap();
    s.end_sandbox_at("sb_gone", T0 + 50, "expired").unwrap();
    s.put_sandbox_times(
        "sb_gone",
        &locker_store::SandboxTimes {
            active_ms: 5,
            idle_ms: 6,
            paused_ms: 7,
            call_gaps: vec![1, 2],
            call_gap_sum_ms: 99,
        },
    )
    .unwrap();
    let calls: Vec<CallRecord> = (0..30)
        .map(|i| {
            call(
                &format!("call_{i:02}"),
                "team-a",
                CallKind::Exec,
                Some("sb_live"),
                T0 + i,
            )
        })
        .collect();
    s.insert_calls(&calls).unwrap();
    s.insert_snapshot(&locker_store::SnapshotRecord {
        id: "snap_1".into(),
        tenant: "team-a".into(),
        sandbox_id: "sb_live".into(),
        template: "default".into(),
        template_digest: "d".into(),
        runtime: "jail".into(),
        size_bytes: 42,
        has_memory: true,
        cpus: 1.0,
        memory_mb: 512,
        disk_mb: 2048,
        created_at: rfc3339(T0),
        path: "/x/snap_1".into(),
        host: String::new(),
    })
    .unwrap();
    s.insert_volume(&locker_store::VolumeRecord {
        id: "vol_1".into(),
        tenant: "team-a".into(),
        name: "repo".into(),
        size_mb: 100,
        created_at: rfc3339(T0),
        host: String::new(),
    })
    .unwrap();
    s.insert_volume_snapshot(&locker_store::VolumeSnapshotRecord {
        id: "vsnap_1".into(),
        tenant: "team-a".into(),
        volume_id: "vol_1".into(),
        size_bytes: 7,
        created_at: rfc3339(T0),
        path: "/x/vsnap_1".into(),
    })
    .unwrap();
    s.insert_secret(&locker_store::SecretRecord {
        tenant: "team-a".into(),
        name: "gh-token".into(),
        hosts: vec!["api.github.com".into()],
        env: "GITHUB_TOKEN".into(),
        sealed: vec![0, 1, 2, 255],
        created_at: rfc3339(T0),
        updated_at: rfc3339(T0),
    })
    .unwrap();
    for i in 0..5 {
        s.insert_event(
            "team-a",
            "sandbox.created",
            &format!("sb_{i}"),
            "{}",
            T0 + i,
        )
        .unwrap();
    }
    // Pruned events keep their numbers: the next one must not reuse them.
    s.prune_events(T0 + 3, 100).unwrap();
    s.insert_webhook(&locker_store::WebhookRecord {
        id: "wh_1".into(),
        tenant: "team-a".into(),
        url: "http://127.0.0.1:1/".into(),
        events: vec!["sandbox.*".into()],
        secret: "whsec".into(),
        created_unix: T0,
        cursor: 0,
    })
    .unwrap();
    s.put_template_build("bld_1", "team-a", "succeeded", "{\"id\":\"bld_1\"}")
        .unwrap();
    s.put_template_build("bld_2", "team-a", "running", "{\"id\":\"bld_2\"}")
        .unwrap();
    s.put_fleet_ca_once(&locker_store::FleetCaRecord {
        cert_pem: "-----BEGIN CERTIFICATE-----".into(),
        key_sealed: vec![9, 8, 7],
        created_at: rfc3339(T0),
    })
    .unwrap();
    for (id, clear) in [("jt_1", "token-one"), ("jt_2", "token-two")] {
        s.insert_join_token(&locker_store::JoinTokenRecord {
            id: id.into(),
            token_hash: Sha256::digest(clear.as_bytes()).to_vec(),
            created_at: rfc3339(T0),
            expires_unix: locker_store::now_unix() + 600,
            used_unix: None,
            node_id: None,
        })
        .unwrap();
    }
    s.join_node(
        &Sha256::digest(b"token-one"),
        &locker_store::NodeRecord {
            id: "nd_1".into(),
            name: "n1".into(),
            address: "10.0.0.2:7443".into(),
            cert_sha256: "cd".repeat(32),
            cert_pem: "-----BEGIN CERTIFICATE-----".into(),
            public_key: "04ab".into(),
            epoch: 1,
            state: locker_store::NodeState::Ready,
            joined_at: rfc3339(T0),
            heartbeat_ms: 0,
            lease_until_ms: 0,
            report: "{\"slots\":3}".into(),
            reserved_memory_mb: 0,
            reserved_slots: 0,
            cordoned: false,
        },
        3000,
    )
    .unwrap();
    s.place(
        &locker_store::PlacementRecord {
            id: "pl_1".into(),
            sandbox_id: Some("sb_remote".into()),
            tenant: "default".into(),
            node_id: "nd_1".into(),
            epoch: 1,
            memory_mb: 512,
            state: locker_store::PlacementState::Placed,
            created_ms: 0,
            view: "{\"id\":\"sb_remote\"}".into(),
        },
        3,
        4096,
    )
    .unwrap()
    .unwrap();
    s.put_ticket(
        &locker_store::TicketRecord {
            hash: "ab".repeat(32),
            tenant: "default".into(),
            key_id: "key_1".into(),
            sandbox_id: "sb_1".into(),
            expires_ms: i64::MAX / 2,
        },
        0,
        10,
    )
    .unwrap();
}

#[test]
fn sqlite_data_moves_to_postgres_whole_and_only_once() {
    let dir = TempDir::new();
    {
        let s = open(&dir);
        fill_every_table(s.as_ref());
    }
    let target = Db::new(Backend::Postgres);
    let Db::Postgres { url, .. } = &target else {
        unreachable!()
    };
    let report = locker_store::copy_sqlite_to_postgres(&dir.db(), url).unwrap();
    let counts: BTreeMap<String, u64> = report.tables.iter().cloned().collect();
    let c = rusqlite::Connection::open(dir.db()).unwrap();
    for (table, n) in &counts {
        let src: i64 = c
            .query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0))
            .unwrap();
        assert_eq!(*n as i64, src, "{table}");
        assert!(src > 0, "the test fills {table}");
        assert_eq!(
            target.row(&format!("SELECT COUNT(*) FROM {table}")),
            src.to_string(),
            "{table} in Postgres"
        );
    }
    assert_eq!(counts.len(), 16, "every table: {counts:?}");

    // What the API reads is the same on both stores.
    let (a, b) = (open(&dir), target.open());
    assert_eq!(a.list_tenants().unwrap(), b.list_tenants().unwrap());
    for t in ["default", "team-a"] {
        assert_eq!(a.list_keys(t).unwrap(), b.list_keys(t).unwrap());
        assert_eq!(
            a.list_sandboxes(t, None, &[]).unwrap(),
            b.list_sandboxes(t, None, &[]).unwrap()
        );
        assert_eq!(
            a.list_calls(t, None, None, Some(1000)).unwrap(),
            b.list_calls(t, None, None, Some(1000)).unwrap()
        );
        assert_eq!(a.list_snapshots(t).unwrap(), b.list_snapshots(t).unwrap());
        assert_eq!(a.list_volumes(t).unwrap(), b.list_volumes(t).unwrap());
        assert_eq!(a.list_secrets(t).unwrap(), b.list_secrets(t).unwrap());
        assert_eq!(
            a.usage_at(t, None, T0 + 100).unwrap(),
            b.usage_at(t, None, T0 + 100).unwrap()
        );
        assert_eq!(
            a.list_template_builds(t, 10).unwrap(),
            b.list_template_builds(t, 10).unwrap()
        );
    }
    assert_eq!(
        a.authenticate("lk_chosen_key_0123456789").unwrap(),
        b.authenticate("lk_chosen_key_0123456789").unwrap()
    );
    assert_eq!(a.list_nodes().unwrap(), b.list_nodes().unwrap());
    assert_eq!(a.fleet_ca().unwrap(), b.fleet_ca().unwrap());
    // A token used before the move stays used after it: the node that used it gets itself
    // back, anyone else is refused.
    let n1 = a.get_node("n1").unwrap().unwrap();
    let hash = Sha256::digest(b"token-one");
    assert_eq!(b.join_node(&hash, &n1, 1).unwrap(), n1);
    let mut other = n1.clone();
    other.public_key = "04cd".into();
    assert!(b.join_node(&hash, &other, 1).is_err());
    assert!(b
        .authenticate("lk_chosen_key_0123456789")
        .unwrap()
        .is_some());
    assert_eq!(
        a.tombstone_at("team-a", "sb_gone", T0 + 60).unwrap(),
        b.tombstone_at("team-a", "sb_gone", T0 + 60).unwrap()
    );
    assert_eq!(
        b.tombstone_at("team-a", "sb_gone", T0 + 60)
            .unwrap()
            .unwrap()
            .cause,
        "expired"
    );
    assert_eq!(
        a.sandbox_times("sb_gone").unwrap(),
        b.sandbox_times("sb_gone").unwrap()
    );
    assert_eq!(
        a.events_after(None, 0, 100).unwrap(),
        b.events_after(None, 0, 100).unwrap()
    );
    assert_eq!(
        a.list_webhooks(None).unwrap(),
        b.list_webhooks(None).unwrap()
    );
    assert_eq!(
        a.unfinished_template_builds().unwrap(),
        b.unfinished_template_builds().unwrap()
    );
    assert_eq!(a.latest_event_seq().unwrap(), b.latest_event_seq().unwrap());
    assert_eq!(
        a.list_volume_snapshots("team-a", "vol_1").unwrap(),
        b.list_volume_snapshots("team-a", "vol_1").unwrap()
    );
    // The sequences go on after the copied numbers.
    let next = b
        .insert_event("team-a", "sandbox.created", "sb_new", "{}", T0 + 9)
        .unwrap();
    assert_eq!(next, a.latest_event_seq().unwrap() + 1);
    b.insert_calls(&[call("call_new", "team-a", CallKind::Exec, None, T0)])
        .unwrap();
    assert_eq!(
        b.list_calls("team-a", None, None, Some(1)).unwrap()[0].id,
        "call_new"
    );

    // A second run refuses, naming what the target holds, and changes nothing.
    let err = locker_store::copy_sqlite_to_postgres(&dir.db(), url).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, StoreError::Conflict(_))
            && msg.contains("already holds")
            && msg.contains("tenants"),
        "{msg}"
    );
    assert_eq!(target.row("SELECT COUNT(*) FROM tenants"), "2");
}

#[test]
fn a_failed_copy_leaves_the_target_empty() {
    let dir = TempDir::new();
    {
        let s = open(&dir);
        fill_every_table(s.as_ref());
    }
    // A row Postgres refuses (its CHECK), late in the copy: nothing may stay behind.
    let c = rusqlite::Connection::open(dir.db()).unwrap();
    c.execute_batch("PRAGMA ignore_check_constraints = ON; UPDATE template_builds SET state = 'weird' WHERE id = 'bld_2';")
        .unwrap();
    drop(c);
    let target = Db::new(Backend::Postgres);
    let Db::Postgres { url, .. } = &target else {
        unreachable!()
    };
    let err = locker_store::copy_sqlite_to_postgres(&dir.db(), url).unwrap_err();
    assert!(err.to_string().contains("check"), "{err}");
    for table in ["tenants", "api_keys", "sandboxes", "calls", "events"] {
        assert_eq!(
            target.row(&format!("SELECT COUNT(*) FROM {table}")),
            "0",
            "{table}"
        );
    }
    // Fixed at the source, the copy then goes through.
    let c = rusqlite::Connection::open(dir.db()).unwrap();
    c.execute(
        "UPDATE template_builds SET state = 'failed' WHERE id = 'bld_2'",
        [],
    )
    .unwrap();
    drop(c);
    assert!(
        locker_store::copy_sqlite_to_postgres(&dir.db(), url)
            .unwrap()
            .total()
            > 40
    );
}

/// Every behaviour test on the Sqlite store.
/// The fleet's rows: a join token redeems once and never after it expires; a taken name
/// leaves the token unused; heartbeats count only at the node's epoch; an expired lease is
/// declared dead once (epoch + 1), and the node is brought back at its new epoch; the CA is
/// made once.
fn fleet_tokens_nodes_and_leases(b: Backend) {
    use locker_store::{FleetCaRecord, JoinTokenRecord, NodeRecord, NodeState};
    let db = Db::new(b);
    let store = db.open();
    let now = locker_store::now_unix();
    let hash = |s: &str| Sha256::digest(s.as_bytes()).to_vec();
    let token = |id: &str, clear: &str, expires: i64| JoinTokenRecord {
        id: id.into(),
        token_hash: hash(clear),
        created_at: rfc3339(now),
        expires_unix: expires,
        used_unix: None,
        node_id: None,
    };
    let node = |id: &str, name: &str| NodeRecord {
        id: id.into(),
        name: name.into(),
        address: "10.0.0.2:7443".into(),
        cert_sha256: "ab".repeat(32),
        cert_pem: format!("cert of {id}"),
        public_key: format!("key of {name}"),
        epoch: 1,
        state: NodeState::Ready,
        joined_at: rfc3339(now),
        heartbeat_ms: 0,
        lease_until_ms: 0,
        report: "{}".into(),
        reserved_memory_mb: 0,
        reserved_slots: 0,
        cordoned: false,
    };
    store
        .insert_join_token(&token("jt_1", "one", now + 600))
        .unwrap();
    store
        .insert_join_token(&token("jt_2", "two", now - 1))
        .unwrap();
    store
        .insert_join_token(&token("jt_3", "three", now + 600))
        .unwrap();

    let clock = store.clock_ms().unwrap();
    let n1 = store
        .join_node(&hash("one"), &node("nd_1", "n1"), 3000)
        .unwrap();
    assert!(
        n1.lease_until_ms >= clock + 3000 && n1.heartbeat_ms >= clock,
        "{n1:?}"
    );
    // The same node again (its answer lost): the node it made, unchanged; another key or
    // name: refused.
    let again = store
        .join_node(&hash("one"), &node("nd_y", "n1"), 3000)
        .unwrap();
    assert_eq!(
        (again.id.as_str(), again.cert_pem.as_str()),
        ("nd_1", "cert of nd_1")
    );
    let mut thief = node("nd_y", "n1");
    thief.public_key = "another key".into();
    assert!(matches!(
        store.join_node(&hash("one"), &thief, 3000),
        Err(StoreError::NotFound(_))
    ));
    // Replayed, expired, unknown: refused, saying why; nothing inserted.
    for (clear, why) in [
        ("one", "already used"),
        ("two", "expired"),
        ("nope", "no such token"),
    ] {
        match store.join_node(&hash(clear), &node("nd_x", "nx"), 3000) {
            Err(StoreError::NotFound(m)) => assert!(m.contains(why), "{m}"),
            other => panic!("{clear}: {other:?}"),
        }
    }
    // A taken name: Conflict, and the token stays good for another name.
    assert!(matches!(
        store.join_node(&hash("three"), &node("nd_2", "n1"), 3000),
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(
        store.join_node(&hash("three"), &node("nd_2", "Bad Name"), 3000),
        Err(StoreError::Invalid(_))
    ));
    store
        .join_node(&hash("three"), &node("nd_2", "n2"), 3000)
        .unwrap();
    assert_eq!(
        db.row("SELECT node_id FROM join_tokens WHERE id = 'jt_3'"),
        "nd_2"
    );
    let names: Vec<String> = store
        .list_nodes()
        .unwrap()
        .into_iter()
        .map(|n| n.name)
        .collect();
    assert_eq!(names, ["n1", "n2"]);
    assert_eq!(store.get_node("n2").unwrap().unwrap().id, "nd_2");
    assert_eq!(store.get_node("nd_1").unwrap().unwrap().name, "n1");

    // Heartbeats: with the node's certificate, at its epoch only.
    let ab = "ab".repeat(32);
    assert!(store
        .node_heartbeat("nd_1", "local", 1, "{}", 3000)
        .unwrap()
        .is_none());
    let hb = store
        .node_heartbeat("nd_1", &ab, 1, r#"{"slots":4}"#, 3000)
        .unwrap()
        .unwrap();
    assert_eq!(hb.report, r#"{"slots":4}"#);
    assert!(store
        .node_heartbeat("nd_1", &ab, 2, "{}", 3000)
        .unwrap()
        .is_none());
    assert!(store
        .node_heartbeat("nd_9", &ab, 1, "{}", 3000)
        .unwrap()
        .is_none());

    // n2's lease runs out (a 1 ms lease), n1's does not: only n2 is declared, once.
    store
        .node_heartbeat("nd_2", &ab, 1, "{}", 1)
        .unwrap()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let dead = store.expire_nodes(10).unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        (dead[0].id.as_str(), dead[0].state, dead[0].epoch),
        ("nd_2", NodeState::Dead, 2)
    );
    assert!(store.expire_nodes(10).unwrap().is_empty());
    // A dead node's heartbeat at its old epoch does not count; revived, its new one does.
    assert!(store
        .node_heartbeat("nd_2", &ab, 1, "{}", 3000)
        .unwrap()
        .is_none());
    assert!(
        store.revive_node("nd_1", 3000).unwrap().is_none(),
        "n1 is not dead"
    );
    let back = store.revive_node("nd_2", 3000).unwrap().unwrap();
    assert_eq!((back.state, back.epoch), (NodeState::Ready, 2));
    assert!(store
        .node_heartbeat("nd_2", &ab, 2, "{}", 3000)
        .unwrap()
        .is_some());

    // max bounds how many one sweep declares.
    store
        .node_heartbeat("nd_1", &ab, 1, "{}", 1)
        .unwrap()
        .unwrap();
    store
        .node_heartbeat("nd_2", &ab, 2, "{}", 1)
        .unwrap()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(store.expire_nodes(1).unwrap().len(), 1);
    assert_eq!(store.expire_nodes(1).unwrap().len(), 1);

    assert!(store.delete_node("nd_1").unwrap());
    assert!(!store.delete_node("nd_1").unwrap());

    // A server's own node: no token; registered again (same id), it keeps its row with
    // its new name and address; another id cannot take its name, nor can it take a node
    // that joined with a certificate.
    let mut local = node("nd_l", "ctl");
    local.cert_sha256 = "local".into();
    let l1 = store.upsert_node(&local, 3000).unwrap();
    assert_eq!((l1.id.as_str(), l1.epoch), ("nd_l", 1));
    store
        .node_heartbeat("nd_l", "local", 1, "{}", 1)
        .unwrap()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(store.expire_nodes(5).unwrap()[0].id, "nd_l");
    local.address = "10.0.0.9:7443".into();
    local.name = "ctl-2".into();
    let l2 = store.upsert_node(&local, 3000).unwrap();
    assert_eq!(
        (l2.id.as_str(), l2.epoch, l2.state),
        ("nd_l", 2, NodeState::Dead)
    );
    assert_eq!(
        (l2.address.as_str(), l2.name.as_str()),
        ("10.0.0.9:7443", "ctl-2")
    );
    let mut other = local.clone();
    other.id = "nd_other".into();
    assert!(matches!(
        store.upsert_node(&other, 3000),
        Err(StoreError::Conflict(_))
    ));
    let mut z = node("nd_2", "zz");
    z.cert_sha256 = "local".into();
    assert!(matches!(
        store.upsert_node(&z, 3000),
        Err(StoreError::Conflict(_))
    ));

    // The CA: the first one stored stays, whoever comes second.
    assert!(store.fleet_ca().unwrap().is_none());
    let ca = |pem: &str| FleetCaRecord {
        cert_pem: pem.into(),
        key_sealed: vec![1, 2, 3],
        created_at: rfc3339(now),
    };
    assert_eq!(
        store.put_fleet_ca_once(&ca("first")).unwrap().cert_pem,
        "first"
    );
    assert_eq!(
        db.open().put_fleet_ca_once(&ca("second")).unwrap().cert_pem,
        "first"
    );
    // Only the tokens' hashes are stored.
    assert!(
        !contains(&db.raw(), b"three"),
        "a clear join token in the database"
    );
}

/// Servers sharing a store adopt only their own machines' rows; rows of no host (from before
/// host ids) go to the first server that asks, once.
fn host_sandboxes_take_hostless_rows_once(b: Backend) {
    let db = Db::new(b);
    let store = db.open();
    store.ensure_tenant("default").unwrap();
    let mut mine = sandbox("sb_mine", "default", T0);
    mine.host = "node_a".into();
    let mut theirs = sandbox("sb_theirs", "default", T0 + 1);
    theirs.host = "node_b".into();
    let old = sandbox("sb_old", "default", T0 + 2);
    let mut ended = sandbox("sb_ended", "default", T0 + 3);
    ended.state = SandboxState::Stopped;
    for s in [&mine, &theirs, &old, &ended] {
        store.insert_sandbox(s).unwrap();
    }
    let ids = |v: Vec<SandboxRecord>| v.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(
        ids(store.host_sandboxes("node_a").unwrap()),
        ["sb_mine", "sb_old"]
    );
    assert_eq!(ids(store.host_sandboxes("node_b").unwrap()), ["sb_theirs"]);
    assert_eq!(
        ids(store.host_sandboxes("node_c").unwrap()),
        Vec::<String>::new()
    );
    let got = store.get_sandbox_any("sb_old").unwrap().unwrap();
    assert_eq!(
        got.host, "node_a",
        "the row now names the server that took it"
    );
    assert_eq!(store.list_live_sandboxes().unwrap().len(), 3);

    // Volumes likewise: a server opens only those whose files it holds.
    let vol = |id: &str, host: &str| locker_store::VolumeRecord {
        id: id.into(),
        tenant: "default".into(),
        name: id.replace('_', "-"),
        size_mb: 100,
        created_at: rfc3339(T0),
        host: host.into(),
    };
    store.insert_volume(&vol("vol_old", "")).unwrap();
    store.insert_volume(&vol("vol_b", "node_b")).unwrap();
    let vids = |v: Vec<locker_store::VolumeRecord>| v.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(vids(store.host_volumes("node_a").unwrap()), ["vol_old"]);
    assert_eq!(vids(store.host_volumes("node_b").unwrap()), ["vol_b"]);
    assert_eq!(
        store
            .get_volume("default", "vol-old")
            .unwrap()
            .unwrap()
            .host,
        "node_a"
    );
}

/// A fleet node's events join the store's stream once each, whatever the node resends:
/// after its cursor, in its order, with this store's `seq`s.
fn node_events_are_taken_once(b: Backend) {
    use locker_store::{EventRecord, NodeRecord, NodeState};
    let db = Db::new(b);
    let store = db.open();
    let node = NodeRecord {
        id: "nd_a".into(),
        name: "nd-a".into(),
        address: "10.0.0.2:7443".into(),
        cert_sha256: "fp".into(),
        cert_pem: String::new(),
        public_key: String::new(),
        epoch: 1,
        state: NodeState::Ready,
        joined_at: rfc3339(T0),
        heartbeat_ms: 0,
        lease_until_ms: 0,
        report: "{}".into(),
        reserved_memory_mb: 0,
        reserved_slots: 0,
        cordoned: false,
    };
    store.upsert_node(&node, 60_000).unwrap();
    let own = store
        .insert_event("default", "sandbox.lost", "sb_0", "{}", T0)
        .unwrap();
    let ev = |seq: u64| EventRecord {
        seq,
        tenant: "default".into(),
        kind: "sandbox.created".into(),
        subject: format!("sb_{seq}"),
        data: format!(r#"{{"n":{seq}}}"#),
        at_unix: T0 + seq as i64,
    };
    let (cursor, stored) = store.take_node_events("nd_a", &[ev(2), ev(1)]).unwrap();
    assert_eq!(cursor, 2);
    let subjects: Vec<&str> = stored.iter().map(|e| e.subject.as_str()).collect();
    assert_eq!(subjects, ["sb_1", "sb_2"], "in the node's order");
    assert!(stored[0].seq > own && stored[1].seq > stored[0].seq);
    // Sent again with a new one (its answer was lost): only the new one is taken.
    let (cursor, stored) = store
        .take_node_events("nd_a", &[ev(1), ev(2), ev(3)])
        .unwrap();
    assert_eq!((cursor, stored.len()), (3, 1));
    assert_eq!(stored[0].subject, "sb_3");
    assert_eq!(store.take_node_events("nd_a", &[]).unwrap(), (3, vec![]));
    let all = store.events_after(Some("default"), 0, 100).unwrap();
    assert_eq!(all.len(), 4, "{all:?}");
    assert_eq!(all[3].data, r#"{"n":3}"#);
    assert!(matches!(
        store.take_node_events("nd_nobody", &[ev(9)]),
        Err(locker_store::StoreError::NotFound(_))
    ));
}

/// A ready node `id` at `epoch`, with nothing reserved (the placement tests').
fn fleet_node(id: &str, epoch: i64) -> locker_store::NodeRecord {
    locker_store::NodeRecord {
        id: id.into(),
        name: id.replace('_', "-"),
        address: "10.0.0.2:7443".into(),
        cert_sha256: "local".into(),
        cert_pem: String::new(),
        public_key: String::new(),
        epoch,
        state: locker_store::NodeState::Ready,
        joined_at: rfc3339(locker_store::now_unix()),
        heartbeat_ms: 0,
        lease_until_ms: 0,
        report: "{}".into(),
        reserved_memory_mb: 0,
        reserved_slots: 0,
        cordoned: false,
    }
}

/// A `starting` placement `id` of `mb` MB on `node` at `epoch`.
fn fleet_placement(id: &str, node: &str, epoch: i64, mb: i64) -> locker_store::PlacementRecord {
    locker_store::PlacementRecord {
        id: id.into(),
        sandbox_id: None,
        tenant: "default".into(),
        node_id: node.into(),
        epoch,
        memory_mb: mb,
        state: locker_store::PlacementState::Starting,
        created_ms: 0,
        view: "{}".into(),
    }
}

/// Placements reserve on their node in the transaction that inserts them, never beyond its
/// capacity, even when eight creators race for the last slots; they give the reservation
/// back when removed; a node's death loses them and zeroes its reservations.
fn placements_reserve_within_capacity(b: Backend) {
    use locker_store::{PlacementRecord, PlacementState};
    let db = Db::new(b);
    let store = db.open();
    let node = |id: &str| fleet_node(id, 1);
    store.upsert_node(&node("nd_a"), 60_000).unwrap();
    store.upsert_node(&node("nd_b"), 60_000).unwrap();
    let placement = fleet_placement;
    // Eight creators for a node of 3 slots: exactly 3 placed.
    let won: usize = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let store = store.clone();
                s.spawn(move || {
                    store
                        .place(&placement(&format!("pl_{i}"), "nd_a", 1, 256), 3, 4096)
                        .unwrap()
                        .is_some()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap() as usize).sum()
    });
    assert_eq!(won, 3);
    let a = store.get_node("nd_a").unwrap().unwrap();
    assert_eq!((a.reserved_slots, a.reserved_memory_mb), (3, 768));
    // Memory bounds it too; a wrong epoch or an unknown node reserves nothing.
    assert!(store
        .place(&placement("pl_m", "nd_b", 1, 600), 10, 1000)
        .unwrap()
        .is_some());
    assert!(store
        .place(&placement("pl_n", "nd_b", 1, 600), 10, 1000)
        .unwrap()
        .is_none());
    assert!(store
        .place(&placement("pl_e", "nd_b", 2, 1), 10, 1000)
        .unwrap()
        .is_none());
    assert!(store
        .place(&placement("pl_u", "nd_zz", 1, 1), 10, 1000)
        .unwrap()
        .is_none());
    assert_eq!(
        store.list_placements(None, None).unwrap().len(),
        4,
        "3 on a, 1 on b"
    );

    // Placed: found by its sandbox; listed by tenant and node.
    let mine: Vec<PlacementRecord> = store.list_placements(None, Some("nd_a")).unwrap();
    assert_eq!(mine.len(), 3);
    let first = mine[0].id.clone();
    assert!(store
        .set_placed(&first, "sb_1", r#"{"id":"sb_1"}"#)
        .unwrap());
    // Recording the same sandbox again is harmless (the fleet's leader and the create's
    // replica may both record it); another sandbox for a placed placement is refused.
    assert!(store
        .set_placed(&first, "sb_1", r#"{"id":"sb_1"}"#)
        .unwrap());
    assert!(
        !store.set_placed(&first, "sb_9", "{}").unwrap(),
        "placed once"
    );
    store
        .set_placement_view("sb_1", r#"{"id":"sb_1","state":"paused"}"#)
        .unwrap();
    let p = store.get_placement("sb_1").unwrap().unwrap();
    assert_eq!(
        (p.state, p.view.as_str()),
        (PlacementState::Placed, r#"{"id":"sb_1","state":"paused"}"#)
    );
    assert_eq!(
        store.list_placements(Some("default"), None).unwrap().len(),
        4
    );
    assert!(store
        .list_placements(Some("other"), None)
        .unwrap()
        .is_empty());

    // Removed: its slot and memory come back, once.
    assert_eq!(store.unplace(&first).unwrap().unwrap().id, first);
    assert!(store.unplace(&first).unwrap().is_none());
    let a = store.get_node("nd_a").unwrap().unwrap();
    assert_eq!((a.reserved_slots, a.reserved_memory_mb), (2, 512));

    // nd_a dies: its placements are lost (once), its reservations 0; removing a lost
    // placement gives nothing back to the node's new epoch.
    store
        .node_heartbeat("nd_a", "local", 1, "{}", 1)
        .unwrap()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let dead = store.expire_nodes(10).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].reserved_slots, dead[0].reserved_memory_mb), (0, 0));
    let lost = store.lose_placements().unwrap();
    assert_eq!(lost.len(), 2, "{lost:?}");
    assert!(lost
        .iter()
        .all(|p| p.state == PlacementState::Lost && p.node_id == "nd_a"));
    assert!(store.lose_placements().unwrap().is_empty());
    store.revive_node("nd_a", 60_000).unwrap().unwrap();
    assert!(store
        .place(&placement("pl_new", "nd_a", 2, 100), 3, 4096)
        .unwrap()
        .is_some());
    // Only a lost placement goes by `unplace_lost` (an expired lost sandbox), and only once.
    assert!(store.unplace_lost("pl_new").unwrap().is_none());
    assert!(store
        .list_placements(None, Some("nd_a"))
        .unwrap()
        .iter()
        .any(|p| p.id == "pl_new"));
    assert_eq!(
        store.unplace_lost(&lost[0].id).unwrap().unwrap().id,
        lost[0].id
    );
    assert!(store.unplace_lost(&lost[0].id).unwrap().is_none());
    assert!(store.unplace(&lost[0].id).unwrap().is_none());
    store.unplace(&lost[1].id).unwrap().unwrap();
    let a = store.get_node("nd_a").unwrap().unwrap();
    assert_eq!((a.reserved_slots, a.reserved_memory_mb), (1, 100));
    // A removed node loses its placements too.
    assert!(store.delete_node("nd_b").unwrap());
    let lost = store.lose_placements().unwrap();
    assert_eq!(lost.len(), 1);
    assert_eq!(lost[0].id, "pl_m");
}

/// Terminal tickets: stored as given (the server hashes them), taken once by whichever
/// server asks first, never after they expire, and capped while live (expired ones do not
/// count); eight threads racing for the last two places get exactly two.
fn terminal_tickets_are_taken_once_and_capped(b: Backend) {
    use locker_store::TicketRecord;
    let db = Db::new(b);
    let store = db.open();
    let t = |hash: &str, expires_ms: i64| TicketRecord {
        hash: hash.into(),
        tenant: "default".into(),
        key_id: "key_1".into(),
        sandbox_id: "sb_1".into(),
        expires_ms,
    };
    let now = 1_000_000;
    assert!(store.put_ticket(&t("h1", now + 30_000), now, 4).unwrap());
    assert!(store
        .put_ticket(&t("h_old", now - 1), now - 100, 4)
        .unwrap());
    // Taken once: the second take finds nothing.
    assert_eq!(
        store.take_ticket("h1", now).unwrap(),
        Some(t("h1", now + 30_000))
    );
    assert_eq!(store.take_ticket("h1", now).unwrap(), None);
    // Expired: gone, and not answered.
    assert!(store.put_ticket(&t("h2", now + 10), now, 4).unwrap());
    assert_eq!(store.take_ticket("h2", now + 10).unwrap(), None);
    assert_eq!(
        store.take_ticket("h2", now).unwrap(),
        None,
        "taken by the expired take"
    );
    assert_eq!(store.take_ticket("nope", now).unwrap(), None);
    // The cap counts live tickets only (h_old expired: removed by the next put).
    assert!(store.put_ticket(&t("a", now + 30_000), now, 4).unwrap());
    assert!(store.put_ticket(&t("b", now + 30_000), now, 4).unwrap());
    let won: usize = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let store = store.clone();
                sc.spawn(move || {
                    store
                        .put_ticket(&t(&format!("r{i}"), now + 30_000), now, 4)
                        .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap() as usize).sum()
    });
    assert_eq!(won, 2, "the last two places of four");
    assert!(!store.put_ticket(&t("full", now + 30_000), now, 4).unwrap());
    // Once they expire the places are free again.
    assert!(store
        .put_ticket(&t("later", now + 90_000), now + 60_000, 4)
        .unwrap());
}

/// A timer as `ss` prints it, in seconds: `119min`, `1min5sec`, `9sec`, `9.484ms` (9.484
/// s), `484ms`.
fn ss_seconds(t: &str) -> Option<f64> {
    let (min, rest) = match t.split_once("min") {
        Some((m, r)) => (m.parse::<f64>().ok()?, r),
        None => (0.0, t),
    };
    let secs = if rest.is_empty() {
        0.0
    } else if let Some(s) = rest.strip_suffix("sec") {
        s.parse().ok()?
    } else {
        let ms = rest.strip_suffix("ms")?;
        match ms.split_once('.') {
            Some((s, frac)) => s.parse::<f64>().ok()? + frac.parse::<f64>().ok()? / 1000.0,
            None => ms.parse::<f64>().ok()? / 1000.0,
        }
    };
    Some(min * 60.0 + secs)
}

/// A store's connections ask the database server for fast keepalives on its side of each
/// session (what frees the leader's lock when a replica is cut off), and keep them on their
/// own side: both ends' sockets show a keepalive timer of at most 10 s (`ss`), where
/// Postgres's default would be the kernel's two hours.
#[test]
fn postgres_sessions_keep_alive_on_both_ends() {
    let db = Db::new(Backend::Postgres);
    let Db::Postgres { url, .. } = &db else {
        unreachable!()
    };
    let port = url
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .unwrap()
        .to_owned();
    let store = db.open();
    store.list_tenants().unwrap();
    // Idle, so the sockets' timers are their keepalives (not a retransmission's).
    std::thread::sleep(std::time::Duration::from_millis(500));
    // `timer:(keepalive,9.8sec,0)` on each socket of the connection; `ss` lists sockets
    // whose source port is the server's (the server's ends) and whose destination is.
    let timers = |side: &str| -> Vec<f64> {
        let out = std::process::Command::new("ss")
            .args([
                "-tnoH",
                "state",
                "established",
                &format!("( {side} = :{port} )"),
            ])
            .output()
            .expect("ss (iproute2)");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let t = l.split("timer:(keepalive,").nth(1)?.split(',').next()?;
                ss_seconds(t)
            })
            .collect()
    };
    assert_eq!(ss_seconds("119min"), Some(7140.0));
    assert_eq!(ss_seconds("1min5sec"), Some(65.0));
    assert_eq!(ss_seconds("9.484ms"), Some(9.484));
    assert_eq!(ss_seconds("484ms"), Some(0.484));
    for side in ["sport", "dport"] {
        let t = timers(side);
        assert!(
            t.iter().any(|&s| s <= 10.0),
            "sockets with {side} :{port} keep alive after {t:?} s, not within 10 s"
        );
    }
    drop(store);
}

/// A joined node removed from the fleet takes its volumes' records (and their snapshots')
/// with it in one transaction; other nodes' volumes stay; a second removal finds nothing.
fn a_removed_node_takes_its_volumes_records(b: Backend) {
    let db = Db::new(b);
    let store = db.open();
    store.upsert_node(&fleet_node("nd_a", 1), 60_000).unwrap();
    store.upsert_node(&fleet_node("nd_b", 1), 60_000).unwrap();
    store.ensure_tenant("default").unwrap();
    let vol = |id: &str, host: &str| locker_store::VolumeRecord {
        id: id.into(),
        tenant: "default".into(),
        name: id.replace('_', "-"),
        size_mb: 100,
        created_at: rfc3339(T0),
        host: host.into(),
    };
    for (id, host) in [("vol_a1", "nd_a"), ("vol_a2", "nd_a"), ("vol_b1", "nd_b")] {
        store.insert_volume(&vol(id, host)).unwrap();
        store
            .insert_volume_snapshot(&locker_store::VolumeSnapshotRecord {
                id: format!("snap_{}", id.trim_start_matches("vol_")),
                tenant: "default".into(),
                volume_id: id.into(),
                size_bytes: 1,
                created_at: rfc3339(T0),
                path: format!("/x/{id}"),
            })
            .unwrap();
    }
    let mut gone: Vec<String> = store
        .delete_node_with_volumes("nd_a")
        .unwrap()
        .expect("nd_a was there")
        .into_iter()
        .map(|v| v.id)
        .collect();
    gone.sort();
    assert_eq!(gone, ["vol_a1", "vol_a2"]);
    assert!(store.get_node("nd_a").unwrap().is_none());
    assert!(store.get_volume("default", "vol_a1").unwrap().is_none());
    assert!(store
        .list_volume_snapshots("default", "vol_a1")
        .unwrap()
        .is_empty());
    assert!(store
        .get_volume_snapshot("default", "snap_a2")
        .unwrap()
        .is_none());
    assert_eq!(
        store.get_volume("default", "vol-a1").unwrap(),
        None,
        "the name is free"
    );
    assert!(store.get_volume("default", "vol_b1").unwrap().is_some());
    assert!(store
        .get_volume_snapshot("default", "snap_b1")
        .unwrap()
        .is_some());
    assert!(store.delete_node_with_volumes("nd_a").unwrap().is_none());
    assert!(store.get_node("nd_b").unwrap().is_some());
}

/// A sandbox moved between nodes (a drain): its placement switches node and epoch, the
/// reservation made for the move becomes its own, the old node's comes back; a stale move
/// (deleted meanwhile, moved already, the reservation gone) writes nothing.
fn placements_move_between_nodes(b: Backend) {
    use locker_store::PlacementState;
    use PlacementState::Placed;
    let db = Db::new(b);
    let store = db.open();
    store.upsert_node(&fleet_node("nd_a", 1), 60_000).unwrap();
    store.upsert_node(&fleet_node("nd_b", 1), 60_000).unwrap();
    let placement = |id: &str, node: &str, mb: i64| fleet_placement(id, node, 1, mb);
    let reserved = |n: &str| {
        let n = store.get_node(n).unwrap().unwrap();
        (n.reserved_slots, n.reserved_memory_mb)
    };
    store
        .place(&placement("pl_1", "nd_a", 256), 10, 4096)
        .unwrap()
        .unwrap();
    assert!(store
        .set_placed("pl_1", "sb_1", r#"{"id":"sb_1"}"#)
        .unwrap());
    store
        .place(&placement("pl_mv", "nd_b", 256), 10, 4096)
        .unwrap()
        .unwrap();
    assert_eq!((reserved("nd_a"), reserved("nd_b")), ((1, 256), (1, 256)));

    // From the wrong node or epoch, or into a reservation that is not one: nothing.
    assert!(store
        .move_placement("pl_1", ("nd_b", 1, Placed), "pl_mv", "{}")
        .unwrap()
        .is_none());
    assert!(store
        .move_placement("pl_1", ("nd_a", 2, Placed), "pl_mv", "{}")
        .unwrap()
        .is_none());
    assert!(store
        .move_placement("pl_1", ("nd_a", 1, Placed), "pl_zz", "{}")
        .unwrap()
        .is_none());
    assert!(store
        .move_placement("pl_1", ("nd_a", 1, Placed), "pl_1", "{}")
        .unwrap()
        .is_none());
    assert_eq!(store.list_placements(None, None).unwrap().len(), 2);

    let moved = store
        .move_placement(
            "pl_1",
            ("nd_a", 1, Placed),
            "pl_mv",
            r#"{"id":"sb_1","moved":1}"#,
        )
        .unwrap()
        .expect("moved");
    assert_eq!((moved.node_id.as_str(), moved.epoch), ("nd_b", 1));
    let p = store.get_placement("sb_1").unwrap().unwrap();
    assert_eq!(
        (p.id.as_str(), p.node_id.as_str(), p.state, p.view.as_str()),
        (
            "pl_1",
            "nd_b",
            PlacementState::Placed,
            r#"{"id":"sb_1","moved":1}"#
        )
    );
    assert_eq!(
        store.list_placements(None, None).unwrap().len(),
        1,
        "the move's reservation is the sandbox's now"
    );
    assert_eq!((reserved("nd_a"), reserved("nd_b")), ((0, 0), (1, 256)));
    // Once: the same move again finds neither.
    assert!(store
        .move_placement("pl_1", ("nd_a", 1, Placed), "pl_mv", "{}")
        .unwrap()
        .is_none());
    // Deleted while it moved: the move's reservation stays to be given back by its caller.
    store
        .place(&placement("pl_back", "nd_a", 256), 10, 4096)
        .unwrap()
        .unwrap();
    store.unplace("pl_1").unwrap().unwrap();
    assert!(store
        .move_placement("pl_1", ("nd_b", 1, Placed), "pl_back", "{}")
        .unwrap()
        .is_none());
    assert_eq!((reserved("nd_a"), reserved("nd_b")), ((1, 256), (0, 0)));
    store.unplace("pl_back").unwrap().unwrap();
    assert_eq!(reserved("nd_a"), (0, 0));

    // A restart elsewhere: nd_b dies with sb_2, which is lost; a lost placement moves only
    // as lost, once, onto nd_a's reservation, placed again; nd_b's new epoch owes nothing.
    store
        .place(&placement("pl_2", "nd_b", 128), 10, 4096)
        .unwrap()
        .unwrap();
    assert!(store.set_placed("pl_2", "sb_2", "{}").unwrap());
    store
        .node_heartbeat("nd_b", "local", 1, "{}", 1)
        .unwrap()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(store.expire_nodes(10).unwrap().len(), 1);
    assert_eq!(store.lose_placements().unwrap().len(), 1);
    store
        .place(&placement("pl_re", "nd_a", 128), 10, 4096)
        .unwrap()
        .unwrap();
    assert!(store
        .move_placement("pl_2", ("nd_b", 1, Placed), "pl_re", "{}")
        .unwrap()
        .is_none());
    let back = store
        .move_placement(
            "pl_2",
            ("nd_b", 1, PlacementState::Lost),
            "pl_re",
            "{\"re\":1}",
        )
        .unwrap()
        .expect("restarted");
    assert_eq!(
        (back.node_id.as_str(), back.state),
        ("nd_a", PlacementState::Placed)
    );
    let p = store.get_placement("sb_2").unwrap().unwrap();
    assert_eq!(
        (p.node_id.as_str(), p.state),
        ("nd_a", PlacementState::Placed)
    );
    assert!(store
        .move_placement("pl_2", ("nd_b", 1, PlacementState::Lost), "pl_re", "{}")
        .unwrap()
        .is_none());
    assert_eq!(reserved("nd_a"), (1, 128));
    assert_eq!(store.list_placements(None, None).unwrap().len(), 1);
}

mod sqlite {
    #[test]
    fn fleet_tokens_nodes_and_leases() {
        super::fleet_tokens_nodes_and_leases(super::Backend::Sqlite)
    }

    #[test]
    fn placements_reserve_within_capacity() {
        super::placements_reserve_within_capacity(super::Backend::Sqlite)
    }

    #[test]
    fn placements_move_between_nodes() {
        super::placements_move_between_nodes(super::Backend::Sqlite)
    }

    #[test]
    fn a_removed_node_takes_its_volumes_records() {
        super::a_removed_node_takes_its_volumes_records(super::Backend::Sqlite)
    }

    #[test]
    fn host_sandboxes_take_hostless_rows_once() {
        super::host_sandboxes_take_hostless_rows_once(super::Backend::Sqlite)
    }

    #[test]
    fn node_events_are_taken_once() {
        super::node_events_are_taken_once(super::Backend::Sqlite)
    }

    #[test]
    fn terminal_tickets_are_taken_once_and_capped() {
        super::terminal_tickets_are_taken_once_and_capped(super::Backend::Sqlite)
    }

    #[test]
    fn tenants_are_validated_and_unique() {
        super::tenants_are_validated_and_unique(super::Backend::Sqlite)
    }

    #[test]
    fn keys_authenticate_revoke_and_are_stored_only_as_hashes() {
        super::keys_authenticate_revoke_and_are_stored_only_as_hashes(super::Backend::Sqlite)
    }

    #[test]
    fn chosen_keys_are_idempotent_and_guarded() {
        super::chosen_keys_are_idempotent_and_guarded(super::Backend::Sqlite)
    }

    #[test]
    fn sandboxes_are_isolated_between_tenants() {
        super::sandboxes_are_isolated_between_tenants(super::Backend::Sqlite)
    }

    #[test]
    fn update_round_trips_every_field() {
        super::update_round_trips_every_field(super::Backend::Sqlite)
    }

    #[test]
    fn list_filters_by_state_and_metadata() {
        super::list_filters_by_state_and_metadata(super::Backend::Sqlite)
    }

    #[test]
    fn lifecycle_queries_and_soft_delete() {
        super::lifecycle_queries_and_soft_delete(super::Backend::Sqlite)
    }

    #[test]
    fn sandbox_pages_count_skip_and_order() {
        super::sandbox_pages_count_skip_and_order(super::Backend::Sqlite)
    }

    #[test]
    fn usage_counts_calls_and_sandbox_seconds_in_the_window() {
        super::usage_counts_calls_and_sandbox_seconds_in_the_window(super::Backend::Sqlite)
    }

    #[test]
    fn call_records_strip_output_filter_and_isolate() {
        super::call_records_strip_output_filter_and_isolate(super::Backend::Sqlite)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recorder_batches_a_thousand_records_without_waiting() {
        super::recorder_batches_a_thousand_records_without_waiting(super::Backend::Sqlite).await
    }

    #[tokio::test(flavor = "current_thread")]
    async fn recorder_drops_on_a_full_queue_and_survives_bad_records() {
        super::recorder_drops_on_a_full_queue_and_survives_bad_records(super::Backend::Sqlite).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recorder_writes_what_is_queued_when_dropped() {
        super::recorder_writes_what_is_queued_when_dropped(super::Backend::Sqlite).await
    }

    #[test]
    fn concurrent_use_from_several_threads() {
        super::concurrent_use_from_several_threads(super::Backend::Sqlite)
    }

    #[test]
    fn snapshots_are_isolated_between_tenants_and_survive_reopen() {
        super::snapshots_are_isolated_between_tenants_and_survive_reopen(super::Backend::Sqlite)
    }

    #[test]
    fn volumes_have_unique_names_per_tenant_and_are_isolated() {
        super::volumes_have_unique_names_per_tenant_and_are_isolated(super::Backend::Sqlite)
    }

    #[test]
    fn code_cells_are_recorded_beside_execs_newest_first() {
        super::code_cells_are_recorded_beside_execs_newest_first(super::Backend::Sqlite)
    }

    #[test]
    fn events_grow_prune_and_feed_webhook_cursors() {
        super::events_grow_prune_and_feed_webhook_cursors(super::Backend::Sqlite)
    }

    #[test]
    fn call_pages_follow_a_cursor_and_filter_by_key_kind_and_outcome() {
        super::call_pages_follow_a_cursor_and_filter_by_key_kind_and_outcome(super::Backend::Sqlite)
    }
}

/// Every behaviour test on the Postgres store.
mod postgres {
    #[test]
    fn fleet_tokens_nodes_and_leases() {
        super::fleet_tokens_nodes_and_leases(super::Backend::Postgres)
    }

    #[test]
    fn placements_reserve_within_capacity() {
        super::placements_reserve_within_capacity(super::Backend::Postgres)
    }

    #[test]
    fn placements_move_between_nodes() {
        super::placements_move_between_nodes(super::Backend::Postgres)
    }

    #[test]
    fn a_removed_node_takes_its_volumes_records() {
        super::a_removed_node_takes_its_volumes_records(super::Backend::Postgres)
    }

    #[test]
    fn host_sandboxes_take_hostless_rows_once() {
        super::host_sandboxes_take_hostless_rows_once(super::Backend::Postgres)
    }

    #[test]
    fn node_events_are_taken_once() {
        super::node_events_are_taken_once(super::Backend::Postgres)
    }

    #[test]
    fn terminal_tickets_are_taken_once_and_capped() {
        super::terminal_tickets_are_taken_once_and_capped(super::Backend::Postgres)
    }

    #[test]
    fn tenants_are_validated_and_unique() {
        super::tenants_are_validated_and_unique(super::Backend::Postgres)
    }

    #[test]
    fn keys_authenticate_revoke_and_are_stored_only_as_hashes() {
        super::keys_authenticate_revoke_and_are_stored_only_as_hashes(super::Backend::Postgres)
    }

    #[test]
    fn chosen_keys_are_idempotent_and_guarded() {
        super::chosen_keys_are_idempotent_and_guarded(super::Backend::Postgres)
    }

    #[test]
    fn sandboxes_are_isolated_between_tenants() {
        super::sandboxes_are_isolated_between_tenants(super::Backend::Postgres)
    }

    #[test]
    fn update_round_trips_every_field() {
        super::update_round_trips_every_field(super::Backend::Postgres)
    }

    #[test]
    fn list_filters_by_state_and_metadata() {
        super::list_filters_by_state_and_metadata(super::Backend::Postgres)
    }

    #[test]
    fn lifecycle_queries_and_soft_delete() {
        super::lifecycle_queries_and_soft_delete(super::Backend::Postgres)
    }

    #[test]
    fn sandbox_pages_count_skip_and_order() {
        super::sandbox_pages_count_skip_and_order(super::Backend::Postgres)
    }

    #[test]
    fn usage_counts_calls_and_sandbox_seconds_in_the_window() {
        super::usage_counts_calls_and_sandbox_seconds_in_the_window(super::Backend::Postgres)
    }

    #[test]
    fn call_records_strip_output_filter_and_isolate() {
        super::call_records_strip_output_filter_and_isolate(super::Backend::Postgres)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recorder_batches_a_thousand_records_without_waiting() {
        super::recorder_batches_a_thousand_records_without_waiting(super::Backend::Postgres).await
    }

    #[tokio::test(flavor = "current_thread")]
    async fn recorder_drops_on_a_full_queue_and_survives_bad_records() {
        super::recorder_drops_on_a_full_queue_and_survives_bad_records(super::Backend::Postgres)
            .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recorder_writes_what_is_queued_when_dropped() {
        super::recorder_writes_what_is_queued_when_dropped(super::Backend::Postgres).await
    }

    #[test]
    fn concurrent_use_from_several_threads() {
        super::concurrent_use_from_several_threads(super::Backend::Postgres)
    }

    #[test]
    fn snapshots_are_isolated_between_tenants_and_survive_reopen() {
        super::snapshots_are_isolated_between_tenants_and_survive_reopen(super::Backend::Postgres)
    }

    #[test]
    fn volumes_have_unique_names_per_tenant_and_are_isolated() {
        super::volumes_have_unique_names_per_tenant_and_are_isolated(super::Backend::Postgres)
    }

    #[test]
    fn code_cells_are_recorded_beside_execs_newest_first() {
        super::code_cells_are_recorded_beside_execs_newest_first(super::Backend::Postgres)
    }

    #[test]
    fn events_grow_prune_and_feed_webhook_cursors() {
        super::events_grow_prune_and_feed_webhook_cursors(super::Backend::Postgres)
    }

    #[test]
    fn call_pages_follow_a_cursor_and_filter_by_key_kind_and_outcome() {
        super::call_pages_follow_a_cursor_and_filter_by_key_kind_and_outcome(
            super::Backend::Postgres,
        )
    }
}
