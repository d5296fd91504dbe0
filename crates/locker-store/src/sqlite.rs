//! The SQLite store: one database file in the data dir (`db.sqlite`).
//!
//! Owns: the schema and its migrations, the connections, the SQL, and the in-memory
//! authentication cache. Nothing else in Locker writes SQL.
//!
//! Connections: one writer behind a mutex (SQLite allows one writer at a time anyway, and
//! serialising in-process avoids `SQLITE_BUSY` between our own threads) and a small pool of
//! read-only connections, which WAL mode lets read while the writer writes. Another
//! process opening the same file waits up to `busy_timeout` for the write lock.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use locker_types::rfc3339;
use rusqlite::{
    named_params, params, params_from_iter, Connection, ErrorCode, OpenFlags, OptionalExtension,
    Row, TransactionBehavior,
};
use sha2::{Digest, Sha256};

use crate::error::{Result, StoreError};
use crate::model::{
    now_unix, parse_rfc3339, validate_tenant_name, CallRecord, KeyInfo, Principal, SandboxRecord,
    SandboxState, TenantUsage,
};
use crate::model::{validate_volume_name, VolumeRecord, VolumeSnapshotRecord};
use crate::random::{fill_random, hex, new_api_key};
use crate::Tombstone;
use crate::{SnapshotRecord, Store, DEFAULT_CALLS_LIMIT, MAX_CALLS_LIMIT};

const VOLUME_COLUMNS: &str = "id, tenant, name, size_mb, created_at";

fn volume_of(r: &Row<'_>) -> rusqlite::Result<(String, String, String, i64, String)> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
}

fn decode_volume(r: (String, String, String, i64, String)) -> Result<VolumeRecord> {
    Ok(VolumeRecord {
        id: r.0,
        tenant: r.1,
        name: r.2,
        size_mb: from_i64("size_mb", r.3)?,
        created_at: r.4,
    })
}

fn decode_volume_snapshot(json: &str) -> Result<VolumeSnapshotRecord> {
    serde_json::from_str(json)
        .map_err(|e| StoreError::Corrupt(format!("volume snapshot record: {e}")))
}

/// The schema, one migration per entry, applied in order, each once. Never edit a
/// released entry: append a new one. `schema_version` holds one row per applied entry.
const MIGRATIONS: &[&str] = &[
    // 1: tenants, keys, sandboxes, call records.
    r#"
    CREATE TABLE tenants (
        name         TEXT PRIMARY KEY,
        created_at   TEXT NOT NULL,
        created_unix INTEGER NOT NULL
    ) STRICT;

    -- Only the SHA-256 of a key is stored, never the key.
    CREATE TABLE api_keys (
        key_id       TEXT PRIMARY KEY,
        tenant       TEXT NOT NULL REFERENCES tenants(name),
        key_hash     BLOB NOT NULL UNIQUE,
        created_at   TEXT NOT NULL,
        revoked_unix INTEGER
    ) STRICT;
    CREATE INDEX api_keys_tenant ON api_keys(tenant);

    -- A deleted sandbox keeps its row (deleted_unix set) so usage still counts it.
    CREATE TABLE sandboxes (
        id                TEXT PRIMARY KEY,
        tenant            TEXT NOT NULL REFERENCES tenants(name),
        state             TEXT NOT NULL
                          CHECK (state IN ('starting','running','paused','stopped','failed')),
        template          TEXT NOT NULL,
        template_digest   TEXT NOT NULL,
        runtime           TEXT NOT NULL,
        cpus              REAL NOT NULL,
        memory_mb         INTEGER NOT NULL,
        disk_mb           INTEGER NOT NULL,
        network           TEXT NOT NULL,  -- JSON
        volumes           TEXT NOT NULL,  -- JSON
        metadata          TEXT NOT NULL,  -- JSON object of strings
        env               TEXT NOT NULL,  -- JSON object of strings
        ttl_s             INTEGER NOT NULL,
        idle_timeout_s    INTEGER,
        created_at        TEXT NOT NULL,
        expires_at        TEXT NOT NULL,
        last_active_at    TEXT NOT NULL,
        machine_dir       TEXT NOT NULL,
        cpu_ms            INTEGER NOT NULL,
        peak_memory_bytes INTEGER NOT NULL,
        created_unix      INTEGER NOT NULL,
        expires_unix      INTEGER NOT NULL,
        last_active_unix  INTEGER NOT NULL,
        ended_unix        INTEGER,
        deleted_unix      INTEGER
    ) STRICT;
    CREATE INDEX sandboxes_tenant_live ON sandboxes(tenant, created_unix)
        WHERE deleted_unix IS NULL;
    CREATE INDEX sandboxes_expires_live ON sandboxes(expires_unix)
        WHERE deleted_unix IS NULL;
    CREATE INDEX sandboxes_state_live ON sandboxes(state)
        WHERE deleted_unix IS NULL;
    CREATE INDEX sandboxes_tenant_state_live ON sandboxes(tenant, state)
        WHERE deleted_unix IS NULL;
    CREATE INDEX sandboxes_tenant_all ON sandboxes(tenant, ended_unix);

    -- Append-only. `seq` orders records as they were written (newest = highest);
    -- `record` is the whole CallRecord as JSON, the other columns are for queries.
    CREATE TABLE calls (
        seq          INTEGER PRIMARY KEY,
        id           TEXT NOT NULL UNIQUE,
        tenant       TEXT NOT NULL,
        key_id       TEXT NOT NULL,
        kind         TEXT NOT NULL CHECK (kind IN ('exec','run','process')),
        sandbox_id   TEXT,
        volume_id    TEXT,
        created_unix INTEGER NOT NULL,
        cpu_ms       INTEGER NOT NULL,
        record       TEXT NOT NULL
    ) STRICT;
    CREATE INDEX calls_tenant ON calls(tenant, seq);
    CREATE INDEX calls_tenant_time ON calls(tenant, created_unix);
    CREATE INDEX calls_sandbox ON calls(sandbox_id, seq) WHERE sandbox_id IS NOT NULL;
    CREATE INDEX calls_volume ON calls(volume_id, seq) WHERE volume_id IS NOT NULL;
    "#,
    // 2: snapshots of sandboxes. `record` is the whole SnapshotRecord as JSON.
    r#"
    CREATE TABLE snapshots (
        id           TEXT PRIMARY KEY,
        tenant       TEXT NOT NULL REFERENCES tenants(name),
        sandbox_id   TEXT NOT NULL,
        created_unix INTEGER NOT NULL,
        record       TEXT NOT NULL
    ) STRICT;
    CREATE INDEX snapshots_tenant ON snapshots(tenant, created_unix);
    "#,
    // 3: volumes (names unique per tenant) and their snapshots (their own kind: a copy of
    // a directory tree, not a disk image). `record` is the whole VolumeSnapshotRecord.
    r#"
    CREATE TABLE volumes (
        id           TEXT PRIMARY KEY,
        tenant       TEXT NOT NULL REFERENCES tenants(name),
        name         TEXT NOT NULL,
        size_mb      INTEGER NOT NULL,
        created_at   TEXT NOT NULL,
        created_unix INTEGER NOT NULL,
        UNIQUE (tenant, name)
    ) STRICT;
    CREATE TABLE volume_snapshots (
        id           TEXT PRIMARY KEY,
        tenant       TEXT NOT NULL REFERENCES tenants(name),
        volume_id    TEXT NOT NULL,
        created_unix INTEGER NOT NULL,
        record       TEXT NOT NULL
    ) STRICT;
    CREATE INDEX volume_snapshots_volume ON volume_snapshots(tenant, volume_id, created_unix);
    "#,
    // 3: why a sandbox ended ("deleted", "expired", "failed: …"), for its tombstone.
    r#"
    ALTER TABLE sandboxes ADD COLUMN end_cause TEXT;
    "#,
];

/// The schema version this build writes (the number of migrations it knows).
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// How long a statement waits for another process's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Read connections kept open between reads; more are opened under load and closed after.
const MAX_IDLE_READERS: usize = 8;
/// The longest clear key `authenticate` hashes; longer ones cannot exist (see
/// `add_key_with_secret`), so they are refused without work.
const MAX_KEY_LEN: usize = 1024;

const SANDBOX_COLUMNS: &str = "id, tenant, state, template, template_digest, runtime, cpus, \
    memory_mb, disk_mb, network, volumes, metadata, env, ttl_s, idle_timeout_s, created_at, \
    expires_at, last_active_at, machine_dir, cpu_ms, peak_memory_bytes";
const LIVE_STATES: &str = "('starting','running','paused')";

/// The [`Store`] on a SQLite file. See the module docs for its connections.
pub struct SqliteStore {
    path: PathBuf,
    writer: Mutex<Connection>,
    readers: Mutex<Vec<Connection>>,
    /// SHA-256 of a clear key → who it is. Filled on first use, purged on revoke.
    auth_cache: RwLock<HashMap<[u8; 32], Principal>>,
    /// Bumped by every revoke, so a lookup that raced with a revoke does not put the
    /// revoked key back into the cache.
    auth_generation: AtomicU64,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` and brings its schema up to
    /// [`SCHEMA_VERSION`]. WAL journal, `synchronous=NORMAL` (a power cut may lose the
    /// last transactions, never corrupt the file), foreign keys on, 5 s busy timeout.
    ///
    /// `SchemaTooNew` if a newer Locker wrote the file. `path` must be a file: `:memory:`
    /// is refused, as each connection would see its own empty database.
    pub fn open(path: impl AsRef<Path>) -> Result<SqliteStore> {
        let path = path.as_ref().to_path_buf();
        if path.as_os_str() == ":memory:" || path.as_os_str().is_empty() {
            return Err(StoreError::Invalid(
                "the SQLite store needs a file path (for example <data-dir>/db.sqlite), \
                 not an in-memory database"
                    .into(),
            ));
        }
        let open_err = |source| StoreError::Open {
            path: path.clone(),
            source,
        };
        let mut writer = Connection::open(&path).map_err(open_err)?;
        writer.busy_timeout(BUSY_TIMEOUT).map_err(open_err)?;
        let mode: String = writer
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(open_err)?;
        if !mode.eq_ignore_ascii_case("wal") {
            tracing::warn!(
                path = %path.display(),
                mode,
                "SQLite refused WAL mode on this filesystem; readers will wait for writers"
            );
        }
        writer
            .execute_batch("PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;")
            .map_err(open_err)?;
        migrate(&mut writer, &path)?;
        Ok(SqliteStore {
            path,
            writer: Mutex::new(writer),
            readers: Mutex::new(Vec::new()),
            auth_cache: RwLock::new(HashMap::new()),
            auth_generation: AtomicU64::new(0),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The schema version of the open database.
    pub fn schema_version(&self) -> Result<i64> {
        self.read(|c| {
            Ok(
                c.query_row("SELECT MAX(version) FROM schema_version", [], |r| {
                    r.get::<_, i64>(0)
                })?,
            )
        })
    }

    /// Deletes the tenant's row `id` of `table` (one of this file's own table names).
    fn delete_row(&self, table: &'static str, tenant: &str, id: &str) -> Result<bool> {
        let conn = self.writer();
        let n = conn
            .prepare_cached(&format!(
                "DELETE FROM {table} WHERE tenant = ?1 AND id = ?2"
            ))?
            .execute(rusqlite::params![tenant, id])?;
        Ok(n > 0)
    }

    /// Inserts a snapshot's row (sandbox or volume snapshot: `table`, with its owner in
    /// column `owner_col`); Conflict if the id exists.
    #[allow(clippy::too_many_arguments)]
    fn insert_snapshot_row(
        &self,
        table: &str,
        owner_col: &str,
        id: &str,
        tenant: &str,
        owner: &str,
        created_unix: i64,
        record: &str,
    ) -> Result<()> {
        let conn = self.writer();
        require_tenant(&conn, tenant)?;
        let n = conn
            .prepare_cached(&format!(
                "INSERT INTO {table} (id, tenant, {owner_col}, created_unix, record)
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT(id) DO NOTHING"
            ))?
            .execute(params![id, tenant, owner, created_unix, record])?;
        if n == 0 {
            return Err(StoreError::Conflict(format!(
                "snapshot {id} already exists"
            )));
        }
        Ok(())
    }

    fn writer(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the writer rolled its transaction back (rusqlite's
        // Transaction rolls back on drop), so the connection is still sound.
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn read<T>(&self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        let pooled = self
            .readers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let conn = match pooled {
            Some(c) => c,
            None => open_reader(&self.path)?,
        };
        let out = f(&conn);
        let mut pool = self.readers.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.len() < MAX_IDLE_READERS {
            pool.push(conn);
        }
        out
    }

    fn read_sandbox(&self, sql_where: &str, args: &[&str]) -> Result<Option<SandboxRecord>> {
        self.read(|c| {
            let sql = format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE {sql_where}");
            let mut st = c.prepare_cached(&sql)?;
            let raw = st
                .query_row(params_from_iter(args), raw_sandbox)
                .optional()?;
            raw.map(decode_sandbox).transpose()
        })
    }

    fn read_sandboxes(&self, sql: &str, args: &[&str]) -> Result<Vec<SandboxRecord>> {
        self.read(|c| {
            let mut st = c.prepare_cached(sql)?;
            let raws = st
                .query_map(params_from_iter(args), raw_sandbox)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            raws.into_iter().map(decode_sandbox).collect()
        })
    }

    fn read_ids(&self, sql: &str, now: i64) -> Result<Vec<String>> {
        self.read(|c| {
            let mut st = c.prepare_cached(sql)?;
            let ids = st
                .query_map([now], |r| r.get(0))?
                .collect::<rusqlite::Result<Vec<String>>>()?;
            Ok(ids)
        })
    }

    fn read_count(&self, sql: &str, tenant: &str) -> Result<u64> {
        self.read(|c| {
            let n: i64 = c.prepare_cached(sql)?.query_row([tenant], |r| r.get(0))?;
            from_i64("count", n)
        })
    }
}

/// Applies the missing migrations in one `IMMEDIATE` transaction, so two processes
/// opening a new file at once cannot both migrate it.
fn migrate(conn: &mut Connection, path: &Path) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_version (
            version    INTEGER PRIMARY KEY,
            applied_at TEXT NOT NULL
        )",
    )?;
    let found: i64 = tx.query_row(
        "SELECT COALESCE(MAX(version), 0) FROM schema_version",
        [],
        |r| r.get(0),
    )?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            path: path.to_path_buf(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    let now = rfc3339(now_unix());
    for (version, sql) in (1i64..)
        .zip(MIGRATIONS)
        .skip(usize::try_from(found).unwrap_or(0))
    {
        tx.execute_batch(sql)?;
        tx.execute(
            "INSERT INTO schema_version (version, applied_at) VALUES (?1, ?2)",
            params![version, now],
        )?;
        tracing::info!(path = %path.display(), version, "applied database migration");
    }
    tx.commit()?;
    Ok(())
}

fn open_reader(path: &Path) -> Result<Connection> {
    let open_err = |source| StoreError::Open {
        path: path.to_path_buf(),
        source,
    };
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
    .map_err(open_err)?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(open_err)?;
    Ok(conn)
}

fn hash_key(clear_key: &str) -> [u8; 32] {
    Sha256::digest(clear_key.as_bytes()).into()
}

fn new_key_id() -> Result<String> {
    let mut buf = [0u8; 12];
    fill_random(&mut buf)?;
    Ok(format!("key_{}", hex(&buf)))
}

fn validate_clear_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY_LEN || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(StoreError::Invalid(format!(
            "an API key must be 1 to {MAX_KEY_LEN} printable ASCII characters without spaces \
             (it travels in an `Authorization: Bearer` header)"
        )));
    }
    Ok(())
}

fn tenant_exists_in(conn: &Connection, name: &str) -> Result<bool> {
    Ok(conn
        .prepare_cached("SELECT 1 FROM tenants WHERE name = ?1")?
        .exists([name])?)
}

fn require_tenant(conn: &Connection, name: &str) -> Result<()> {
    if tenant_exists_in(conn, name)? {
        Ok(())
    } else {
        Err(StoreError::NotFound(format!(
            "tenant {name} does not exist (create it with POST /v1/tenants or \
             `locker tenant create {name}`)"
        )))
    }
}

fn to_i64(what: &str, v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| StoreError::Invalid(format!("{what} = {v} is too large")))
}

fn from_i64(what: &str, v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt(format!("{what} is negative ({v})")))
}

fn unix_of(what: &str, s: &str) -> Result<i64> {
    parse_rfc3339(s).ok_or_else(|| {
        StoreError::Invalid(format!(
            "{what} {s:?} is not an RFC 3339 time such as 2026-11-30T12:00:00Z"
        ))
    })
}

fn to_json<T: serde::Serialize>(what: &str, v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| StoreError::Invalid(format!("{what}: {e}")))
}

fn from_json<T: serde::de::DeserializeOwned>(what: &str, s: &str) -> Result<T> {
    serde_json::from_str(s).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

/// Maps a uniqueness violation to `Conflict` with `msg`, anything else unchanged.
fn conflict_on_unique(e: rusqlite::Error, msg: impl FnOnce() -> String) -> StoreError {
    match e {
        rusqlite::Error::SqliteFailure(ref f, _) if f.code == ErrorCode::ConstraintViolation => {
            StoreError::Conflict(msg())
        }
        e => StoreError::Sqlite(e),
    }
}

/// A sandbox row as SQLite gives it, before the fallible conversions.
struct RawSandbox {
    id: String,
    tenant: String,
    state: String,
    template: String,
    template_digest: String,
    runtime: String,
    cpus: f64,
    memory_mb: i64,
    disk_mb: i64,
    network: String,
    volumes: String,
    metadata: String,
    env: String,
    ttl_s: i64,
    idle_timeout_s: Option<i64>,
    created_at: String,
    expires_at: String,
    last_active_at: String,
    machine_dir: String,
    cpu_ms: i64,
    peak_memory_bytes: i64,
}

/// Reads a row selected with [`SANDBOX_COLUMNS`], in that order.
fn raw_sandbox(r: &Row<'_>) -> rusqlite::Result<RawSandbox> {
    Ok(RawSandbox {
        id: r.get(0)?,
        tenant: r.get(1)?,
        state: r.get(2)?,
        template: r.get(3)?,
        template_digest: r.get(4)?,
        runtime: r.get(5)?,
        cpus: r.get(6)?,
        memory_mb: r.get(7)?,
        disk_mb: r.get(8)?,
        network: r.get(9)?,
        volumes: r.get(10)?,
        metadata: r.get(11)?,
        env: r.get(12)?,
        ttl_s: r.get(13)?,
        idle_timeout_s: r.get(14)?,
        created_at: r.get(15)?,
        expires_at: r.get(16)?,
        last_active_at: r.get(17)?,
        machine_dir: r.get(18)?,
        cpu_ms: r.get(19)?,
        peak_memory_bytes: r.get(20)?,
    })
}

fn decode_sandbox(r: RawSandbox) -> Result<SandboxRecord> {
    let ctx = |field: &str| format!("sandbox {} {field}", r.id);
    Ok(SandboxRecord {
        state: r
            .state
            .parse()
            .map_err(|_| StoreError::Corrupt(format!("{}: {:?}", ctx("state"), r.state)))?,
        cpus: r.cpus,
        memory_mb: from_i64(&ctx("memory_mb"), r.memory_mb)?,
        disk_mb: from_i64(&ctx("disk_mb"), r.disk_mb)?,
        network: from_json(&ctx("network"), &r.network)?,
        volumes: from_json(&ctx("volumes"), &r.volumes)?,
        metadata: from_json(&ctx("metadata"), &r.metadata)?,
        env: from_json(&ctx("env"), &r.env)?,
        ttl_s: from_i64(&ctx("ttl_s"), r.ttl_s)?,
        idle_timeout_s: r
            .idle_timeout_s
            .map(|v| from_i64(&ctx("idle_timeout_s"), v))
            .transpose()?,
        cpu_ms: from_i64(&ctx("cpu_ms"), r.cpu_ms)?,
        peak_memory_bytes: from_i64(&ctx("peak_memory_bytes"), r.peak_memory_bytes)?,
        id: r.id,
        tenant: r.tenant,
        template: r.template,
        template_digest: r.template_digest,
        runtime: r.runtime,
        created_at: r.created_at,
        expires_at: r.expires_at,
        last_active_at: r.last_active_at,
        machine_dir: r.machine_dir,
    })
}

/// A sandbox record turned into column values, checked.
struct SandboxColumns {
    network: String,
    volumes: String,
    metadata: String,
    env: String,
    memory_mb: i64,
    disk_mb: i64,
    ttl_s: i64,
    idle_timeout_s: Option<i64>,
    cpu_ms: i64,
    peak_memory_bytes: i64,
    created_unix: i64,
    expires_unix: i64,
    last_active_unix: i64,
}

fn encode_sandbox(s: &SandboxRecord) -> Result<SandboxColumns> {
    if s.id.is_empty() {
        return Err(StoreError::Invalid("a sandbox needs an id".into()));
    }
    if !s.cpus.is_finite() || s.cpus <= 0.0 {
        return Err(StoreError::Invalid(format!(
            "sandbox {}: cpus must be a positive number, got {}",
            s.id, s.cpus
        )));
    }
    Ok(SandboxColumns {
        network: to_json("network", &s.network)?,
        volumes: to_json("volumes", &s.volumes)?,
        metadata: to_json("metadata", &s.metadata)?,
        env: to_json("env", &s.env)?,
        memory_mb: to_i64("memory_mb", s.memory_mb)?,
        disk_mb: to_i64("disk_mb", s.disk_mb)?,
        ttl_s: to_i64("ttl_s", s.ttl_s)?,
        idle_timeout_s: s
            .idle_timeout_s
            .map(|v| to_i64("idle_timeout_s", v))
            .transpose()?,
        cpu_ms: to_i64("cpu_ms", s.cpu_ms)?,
        peak_memory_bytes: to_i64("peak_memory_bytes", s.peak_memory_bytes)?,
        created_unix: unix_of("created_at", &s.created_at)?,
        expires_unix: unix_of("expires_at", &s.expires_at)?,
        last_active_unix: unix_of("last_active_at", &s.last_active_at)?,
    })
}

fn sandbox_not_found(id: &str) -> StoreError {
    StoreError::NotFound(format!("sandbox {id} does not exist"))
}

impl Store for SqliteStore {
    fn insert_volume(&self, v: &VolumeRecord) -> Result<()> {
        validate_volume_name(&v.name)?;
        let created_unix = unix_of("created_at", &v.created_at)?;
        let size_mb = to_i64("size_mb", v.size_mb)?;
        let conn = self.writer();
        require_tenant(&conn, &v.tenant)?;
        conn.prepare_cached(
            "INSERT INTO volumes (id, tenant, name, size_mb, created_at, created_unix)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?
        .execute(params![
            v.id,
            v.tenant,
            v.name,
            size_mb,
            v.created_at,
            created_unix
        ])
        .map_err(|e| {
            conflict_on_unique(e, || {
                format!(
                    "a volume named {:?} (or with id {}) already exists",
                    v.name, v.id
                )
            })
        })?;
        Ok(())
    }

    fn get_volume(&self, tenant: &str, id_or_name: &str) -> Result<Option<VolumeRecord>> {
        let raw = self.read(|c| {
            // An id wins over a name: ids start with `vol_`, which a name may too.
            let sql = format!(
                "SELECT {VOLUME_COLUMNS} FROM volumes WHERE tenant = ?1 AND (id = ?2 OR name = ?2)
                 ORDER BY id = ?2 DESC LIMIT 1"
            );
            Ok(c.prepare_cached(&sql)?
                .query_row(params![tenant, id_or_name], volume_of)
                .optional()?)
        })?;
        raw.map(decode_volume).transpose()
    }

    fn list_volumes(&self, tenant: &str) -> Result<Vec<VolumeRecord>> {
        let raw = self.read(|c| {
            let sql = format!(
                "SELECT {VOLUME_COLUMNS} FROM volumes WHERE tenant = ?1 ORDER BY created_unix, rowid"
            );
            Ok(c.prepare_cached(&sql)?
                .query_map([tenant], volume_of)?
                .collect::<rusqlite::Result<Vec<_>>>()?)
        })?;
        raw.into_iter().map(decode_volume).collect()
    }

    fn list_all_volumes(&self) -> Result<Vec<VolumeRecord>> {
        let raw = self.read(|c| {
            let sql = format!("SELECT {VOLUME_COLUMNS} FROM volumes ORDER BY created_unix, rowid");
            Ok(c.prepare_cached(&sql)?
                .query_map([], volume_of)?
                .collect::<rusqlite::Result<Vec<_>>>()?)
        })?;
        raw.into_iter().map(decode_volume).collect()
    }

    fn delete_volume(&self, tenant: &str, id: &str) -> Result<bool> {
        let mut conn = self.writer();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let n = tx.execute(
            "DELETE FROM volumes WHERE tenant = ?1 AND id = ?2",
            params![tenant, id],
        )?;
        if n > 0 {
            tx.execute(
                "DELETE FROM volume_snapshots WHERE tenant = ?1 AND volume_id = ?2",
                params![tenant, id],
            )?;
        }
        tx.commit()?;
        Ok(n > 0)
    }

    fn insert_volume_snapshot(&self, snap: &VolumeSnapshotRecord) -> Result<()> {
        let record = to_json("volume snapshot", snap)?;
        let created_unix = unix_of("created_at", &snap.created_at)?;
        self.insert_snapshot_row(
            "volume_snapshots",
            "volume_id",
            &snap.id,
            &snap.tenant,
            &snap.volume_id,
            created_unix,
            &record,
        )
    }

    fn get_volume_snapshot(&self, tenant: &str, id: &str) -> Result<Option<VolumeSnapshotRecord>> {
        let json = self.read(|c| {
            Ok(c.prepare_cached(
                "SELECT record FROM volume_snapshots WHERE tenant = ?1 AND id = ?2",
            )?
            .query_row(params![tenant, id], |r| r.get::<_, String>(0))
            .optional()?)
        })?;
        json.as_deref().map(decode_volume_snapshot).transpose()
    }

    fn list_volume_snapshots(
        &self,
        tenant: &str,
        volume_id: &str,
    ) -> Result<Vec<VolumeSnapshotRecord>> {
        let rows = self.read(|c| {
            Ok(c.prepare_cached(
                "SELECT record FROM volume_snapshots WHERE tenant = ?1 AND volume_id = ?2
                 ORDER BY created_unix DESC, rowid DESC",
            )?
            .query_map(params![tenant, volume_id], |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?)
        })?;
        rows.iter().map(|j| decode_volume_snapshot(j)).collect()
    }

    fn insert_snapshot(&self, snap: &SnapshotRecord) -> Result<()> {
        let record = to_json("snapshot", snap)?;
        let created_unix = unix_of("created_at", &snap.created_at)?;
        self.insert_snapshot_row(
            "snapshots",
            "sandbox_id",
            &snap.id,
            &snap.tenant,
            &snap.sandbox_id,
            created_unix,
            &record,
        )
    }

    fn get_snapshot(&self, tenant: &str, id: &str) -> Result<Option<SnapshotRecord>> {
        self.read(|c| {
            let mut st =
                c.prepare_cached("SELECT record FROM snapshots WHERE tenant = ?1 AND id = ?2")?;
            let mut rows = st.query(rusqlite::params![tenant, id])?;
            match rows.next()? {
                Some(r) => {
                    let json: String = r.get(0)?;
                    Ok(Some(serde_json::from_str(&json).map_err(|e| {
                        StoreError::Corrupt(format!("snapshot {id}: {e}"))
                    })?))
                }
                None => Ok(None),
            }
        })
    }

    fn list_snapshots(&self, tenant: &str) -> Result<Vec<SnapshotRecord>> {
        self.read(|c| {
            let mut st = c.prepare_cached(
                "SELECT record FROM snapshots WHERE tenant = ?1 ORDER BY created_unix DESC, rowid DESC",
            )?;
            let rows = st
                .query_map([tenant], |r| r.get::<_, String>(0))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            rows.iter()
                .map(|j| {
                    serde_json::from_str(j)
                        .map_err(|e| StoreError::Corrupt(format!("snapshot record: {e}")))
                })
                .collect()
        })
    }

    fn delete_snapshot(&self, tenant: &str, id: &str) -> Result<bool> {
        self.delete_row("snapshots", tenant, id)
    }

    fn delete_volume_snapshot(&self, tenant: &str, id: &str) -> Result<bool> {
        self.delete_row("volume_snapshots", tenant, id)
    }

    fn ensure_tenant(&self, name: &str) -> Result<()> {
        validate_tenant_name(name)?;
        let now = now_unix();
        self.writer().execute(
            "INSERT INTO tenants (name, created_at, created_unix) VALUES (?1, ?2, ?3)
             ON CONFLICT (name) DO NOTHING",
            params![name, rfc3339(now), now],
        )?;
        Ok(())
    }

    fn create_tenant(&self, name: &str) -> Result<()> {
        validate_tenant_name(name)?;
        let now = now_unix();
        self.writer()
            .execute(
                "INSERT INTO tenants (name, created_at, created_unix) VALUES (?1, ?2, ?3)",
                params![name, rfc3339(now), now],
            )
            .map_err(|e| conflict_on_unique(e, || format!("tenant {name} already exists")))?;
        Ok(())
    }

    fn tenant_exists(&self, name: &str) -> Result<bool> {
        self.read(|c| tenant_exists_in(c, name))
    }

    fn list_tenants(&self) -> Result<Vec<String>> {
        self.read(|c| {
            let mut st = c.prepare_cached("SELECT name FROM tenants ORDER BY name")?;
            let names = st
                .query_map([], |r| r.get(0))?
                .collect::<rusqlite::Result<Vec<String>>>()?;
            Ok(names)
        })
    }

    fn create_key(&self, tenant: &str) -> Result<(KeyInfo, String)> {
        let clear = new_api_key()?;
        let info = KeyInfo {
            key_id: new_key_id()?,
            tenant: tenant.to_string(),
            created_at: rfc3339(now_unix()),
        };
        let conn = self.writer();
        require_tenant(&conn, tenant)?;
        conn.execute(
            "INSERT INTO api_keys (key_id, tenant, key_hash, created_at) VALUES (?1, ?2, ?3, ?4)",
            params![
                info.key_id,
                info.tenant,
                &hash_key(&clear)[..],
                info.created_at
            ],
        )?;
        Ok((info, clear))
    }

    fn add_key_with_secret(&self, tenant: &str, clear_key: &str) -> Result<KeyInfo> {
        validate_clear_key(clear_key)?;
        let hash = hash_key(clear_key);
        let mut conn = self.writer();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        require_tenant(&tx, tenant)?;
        let existing = tx
            .query_row(
                "SELECT key_id, tenant, created_at, revoked_unix FROM api_keys
                 WHERE key_hash = ?1",
                [&hash[..]],
                |r| {
                    Ok((
                        KeyInfo {
                            key_id: r.get(0)?,
                            tenant: r.get(1)?,
                            created_at: r.get(2)?,
                        },
                        r.get::<_, Option<i64>>(3)?,
                    ))
                },
            )
            .optional()?;
        if let Some((info, revoked)) = existing {
            if info.tenant != tenant {
                return Err(StoreError::Conflict(format!(
                    "this API key already belongs to another tenant ({}); choose a different key",
                    info.tenant
                )));
            }
            if revoked.is_some() {
                return Err(StoreError::Conflict(format!(
                    "this API key was revoked ({}); revoked keys stay revoked: choose a new key",
                    info.key_id
                )));
            }
            return Ok(info);
        }
        let info = KeyInfo {
            key_id: new_key_id()?,
            tenant: tenant.to_string(),
            created_at: rfc3339(now_unix()),
        };
        tx.execute(
            "INSERT INTO api_keys (key_id, tenant, key_hash, created_at) VALUES (?1, ?2, ?3, ?4)",
            params![info.key_id, info.tenant, &hash[..], info.created_at],
        )?;
        tx.commit()?;
        Ok(info)
    }

    fn authenticate(&self, clear_key: &str) -> Result<Option<Principal>> {
        if clear_key.is_empty() || clear_key.len() > MAX_KEY_LEN {
            return Ok(None);
        }
        let hash = hash_key(clear_key);
        let cache = self
            .auth_cache
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = cache.get(&hash) {
            return Ok(Some(p.clone()));
        }
        drop(cache);
        // Read the generation before the lookup: if a revoke commits after our read, it
        // bumps the generation and we must not cache what we read.
        let generation = self.auth_generation.load(Ordering::SeqCst);
        let found = self.read(|c| {
            Ok(c.prepare_cached(
                "SELECT key_id, tenant FROM api_keys
                 WHERE key_hash = ?1 AND revoked_unix IS NULL",
            )?
            .query_row([&hash[..]], |r| {
                Ok(Principal {
                    key_id: r.get(0)?,
                    tenant: r.get(1)?,
                })
            })
            .optional()?)
        })?;
        if let Some(p) = &found {
            let mut cache = self
                .auth_cache
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            if self.auth_generation.load(Ordering::SeqCst) == generation {
                cache.insert(hash, p.clone());
            }
        }
        Ok(found)
    }

    fn revoke_key(&self, key_id: &str) -> Result<bool> {
        let changed = self.writer().execute(
            "UPDATE api_keys SET revoked_unix = ?1 WHERE key_id = ?2 AND revoked_unix IS NULL",
            params![now_unix(), key_id],
        )?;
        let mut cache = self
            .auth_cache
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        self.auth_generation.fetch_add(1, Ordering::SeqCst);
        cache.retain(|_, p| p.key_id != key_id);
        Ok(changed > 0)
    }

    fn list_keys(&self, tenant: &str) -> Result<Vec<KeyInfo>> {
        self.read(|c| {
            let mut st = c.prepare_cached(
                "SELECT key_id, tenant, created_at FROM api_keys
                 WHERE tenant = ?1 AND revoked_unix IS NULL ORDER BY created_at, key_id",
            )?;
            let keys = st
                .query_map([tenant], |r| {
                    Ok(KeyInfo {
                        key_id: r.get(0)?,
                        tenant: r.get(1)?,
                        created_at: r.get(2)?,
                    })
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(keys)
        })
    }

    fn insert_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        let c = encode_sandbox(s)?;
        let now = now_unix();
        let ended = (!s.state.is_live()).then_some(now);
        let conn = self.writer();
        require_tenant(&conn, &s.tenant)?;
        conn.prepare_cached(&format!(
            "INSERT INTO sandboxes ({SANDBOX_COLUMNS}, created_unix, expires_unix,
                 last_active_unix, ended_unix)
             VALUES (:id, :tenant, :state, :template, :template_digest, :runtime, :cpus,
                 :memory_mb, :disk_mb, :network, :volumes, :metadata, :env, :ttl_s,
                 :idle_timeout_s, :created_at, :expires_at, :last_active_at, :machine_dir,
                 :cpu_ms, :peak_memory_bytes, :created_unix, :expires_unix,
                 :last_active_unix, :ended_unix)"
        ))?
        .execute(named_params! {
            ":id": s.id, ":tenant": s.tenant, ":state": s.state.as_str(),
            ":template": s.template, ":template_digest": s.template_digest,
            ":runtime": s.runtime, ":cpus": s.cpus, ":memory_mb": c.memory_mb,
            ":disk_mb": c.disk_mb, ":network": c.network, ":volumes": c.volumes,
            ":metadata": c.metadata, ":env": c.env, ":ttl_s": c.ttl_s,
            ":idle_timeout_s": c.idle_timeout_s, ":created_at": s.created_at,
            ":expires_at": s.expires_at, ":last_active_at": s.last_active_at,
            ":machine_dir": s.machine_dir, ":cpu_ms": c.cpu_ms,
            ":peak_memory_bytes": c.peak_memory_bytes, ":created_unix": c.created_unix,
            ":expires_unix": c.expires_unix, ":last_active_unix": c.last_active_unix,
            ":ended_unix": ended,
        })
        .map_err(|e| conflict_on_unique(e, || format!("sandbox {} already exists", s.id)))?;
        Ok(())
    }

    fn get_sandbox(&self, tenant: &str, id: &str) -> Result<Option<SandboxRecord>> {
        self.read_sandbox(
            "id = ?1 AND tenant = ?2 AND deleted_unix IS NULL",
            &[id, tenant],
        )
    }

    fn get_sandbox_any(&self, id: &str) -> Result<Option<SandboxRecord>> {
        self.read_sandbox("id = ?1 AND deleted_unix IS NULL", &[id])
    }

    fn list_sandboxes(
        &self,
        tenant: &str,
        state: Option<SandboxState>,
        metadata: &[(String, String)],
    ) -> Result<Vec<SandboxRecord>> {
        let mut sql = format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE tenant = ?1 AND deleted_unix IS NULL"
        );
        let mut args: Vec<&str> = vec![tenant];
        if let Some(st) = state {
            args.push(st.as_str());
            sql.push_str(&format!(" AND state = ?{}", args.len()));
        }
        for (k, v) in metadata {
            // json_each compares keys and values exactly, whatever characters they hold
            // (a JSON path would need quoting rules for keys with dots or quotes).
            args.push(k);
            args.push(v);
            sql.push_str(&format!(
                " AND EXISTS (SELECT 1 FROM json_each(sandboxes.metadata) AS m
                     WHERE m.key = ?{} AND m.type = 'text' AND m.value = ?{})",
                args.len() - 1,
                args.len()
            ));
        }
        sql.push_str(" ORDER BY created_unix, rowid");
        self.read_sandboxes(&sql, &args)
    }

    fn update_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        let c = encode_sandbox(s)?;
        let n = self
            .writer()
            .prepare_cached(
                "UPDATE sandboxes SET state = :state, template = :template,
                     template_digest = :template_digest, runtime = :runtime, cpus = :cpus,
                     memory_mb = :memory_mb, disk_mb = :disk_mb, network = :network,
                     volumes = :volumes, metadata = :metadata, env = :env, ttl_s = :ttl_s,
                     idle_timeout_s = :idle_timeout_s, created_at = :created_at,
                     expires_at = :expires_at, last_active_at = :last_active_at,
                     machine_dir = :machine_dir, cpu_ms = :cpu_ms,
                     peak_memory_bytes = :peak_memory_bytes, created_unix = :created_unix,
                     expires_unix = :expires_unix, last_active_unix = :last_active_unix,
                     ended_unix = CASE WHEN :state IN ('stopped','failed')
                                       THEN COALESCE(ended_unix, :now) END
                 WHERE id = :id AND tenant = :tenant AND deleted_unix IS NULL",
            )?
            .execute(named_params! {
                ":id": s.id, ":tenant": s.tenant, ":state": s.state.as_str(),
                ":template": s.template, ":template_digest": s.template_digest,
                ":runtime": s.runtime, ":cpus": s.cpus, ":memory_mb": c.memory_mb,
                ":disk_mb": c.disk_mb, ":network": c.network, ":volumes": c.volumes,
                ":metadata": c.metadata, ":env": c.env, ":ttl_s": c.ttl_s,
                ":idle_timeout_s": c.idle_timeout_s, ":created_at": s.created_at,
                ":expires_at": s.expires_at, ":last_active_at": s.last_active_at,
                ":machine_dir": s.machine_dir, ":cpu_ms": c.cpu_ms,
                ":peak_memory_bytes": c.peak_memory_bytes, ":created_unix": c.created_unix,
                ":expires_unix": c.expires_unix, ":last_active_unix": c.last_active_unix,
                ":now": now_unix(),
            })?;
        if n == 0 {
            return Err(sandbox_not_found(&s.id));
        }
        Ok(())
    }

    fn set_sandbox_state_at(&self, id: &str, state: SandboxState, now: i64) -> Result<()> {
        let n = self
            .writer()
            .prepare_cached(
                "UPDATE sandboxes SET state = ?2,
                     ended_unix = CASE WHEN ?2 IN ('stopped','failed')
                                       THEN COALESCE(ended_unix, ?3) END
                 WHERE id = ?1 AND deleted_unix IS NULL",
            )?
            .execute(params![id, state.as_str(), now])?;
        if n == 0 {
            return Err(sandbox_not_found(id));
        }
        Ok(())
    }

    fn touch_sandbox(&self, id: &str, at: i64) -> Result<()> {
        let conn = self.writer();
        let n = conn
            .prepare_cached(
                "UPDATE sandboxes SET last_active_unix = ?2, last_active_at = ?3
                 WHERE id = ?1 AND deleted_unix IS NULL AND last_active_unix < ?2",
            )?
            .execute(params![id, at, rfc3339(at)])?;
        if n == 0 {
            // Either missing, or already at least as recent: tell them apart.
            let exists = conn
                .prepare_cached("SELECT 1 FROM sandboxes WHERE id = ?1 AND deleted_unix IS NULL")?
                .exists([id])?;
            if !exists {
                return Err(sandbox_not_found(id));
            }
        }
        Ok(())
    }

    fn delete_sandbox_at(&self, id: &str, now: i64) -> Result<bool> {
        let n = self
            .writer()
            .prepare_cached(
                "UPDATE sandboxes SET state = 'stopped', env = '{}', deleted_unix = ?2,
                     ended_unix = COALESCE(ended_unix, ?2)
                 WHERE id = ?1 AND deleted_unix IS NULL",
            )?
            .execute(params![id, now])?;
        Ok(n > 0)
    }

    fn end_sandbox_at(&self, id: &str, now: i64, cause: &str) -> Result<bool> {
        let n = self
            .writer()
            .prepare_cached(
                "UPDATE sandboxes SET state = 'stopped', env = '{}', deleted_unix = ?2,
                     ended_unix = COALESCE(ended_unix, ?2), end_cause = ?3
                 WHERE id = ?1 AND deleted_unix IS NULL",
            )?
            .execute(params![id, now, cause])?;
        Ok(n > 0)
    }

    fn tombstone_at(&self, tenant: &str, id: &str, now: i64) -> Result<Option<Tombstone>> {
        self.read(|c| {
            let row = c
                .prepare_cached(
                    "SELECT deleted_unix, expires_unix, end_cause FROM sandboxes
                     WHERE id = ?1 AND tenant = ?2 AND deleted_unix IS NOT NULL
                       AND deleted_unix >= ?3",
                )?
                .query_row(params![id, tenant, now - crate::TOMBSTONE_S], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, Option<String>>(2)?,
                    ))
                })
                .optional()?;
            Ok(row.map(|(ended, expires, cause)| {
                // Rows ended before causes were recorded: a delete at or past the expiry
                // was the TTL reaper's.
                let cause = cause.unwrap_or_else(|| {
                    if ended >= expires {
                        "expired"
                    } else {
                        "deleted"
                    }
                    .to_owned()
                });
                Tombstone {
                    ended_at: rfc3339(ended),
                    cause,
                }
            }))
        })
    }

    fn list_live_sandboxes(&self) -> Result<Vec<SandboxRecord>> {
        self.read_sandboxes(
            &format!(
                "SELECT {SANDBOX_COLUMNS} FROM sandboxes
                 WHERE deleted_unix IS NULL AND state IN {LIVE_STATES}
                 ORDER BY created_unix, rowid"
            ),
            &[],
        )
    }

    fn count_running(&self, tenant: &str) -> Result<u64> {
        self.read_count(
            &format!(
                "SELECT COUNT(*) FROM sandboxes
                 WHERE tenant = ?1 AND deleted_unix IS NULL AND state IN {LIVE_STATES}"
            ),
            tenant,
        )
    }

    fn sum_memory_mb(&self, tenant: &str) -> Result<u64> {
        self.read_count(
            &format!(
                "SELECT COALESCE(SUM(memory_mb), 0) FROM sandboxes
                 WHERE tenant = ?1 AND deleted_unix IS NULL AND state IN {LIVE_STATES}"
            ),
            tenant,
        )
    }

    fn sum_disk_mb(&self, tenant: &str) -> Result<u64> {
        self.read_count(
            &format!(
                "SELECT (SELECT COALESCE(SUM(disk_mb), 0) FROM sandboxes
                         WHERE tenant = ?1 AND deleted_unix IS NULL AND state IN {LIVE_STATES})
                      + (SELECT COALESCE(SUM(size_mb), 0) FROM volumes WHERE tenant = ?1)"
            ),
            tenant,
        )
    }

    fn expired_sandboxes(&self, now: i64) -> Result<Vec<String>> {
        self.read_ids(
            "SELECT id FROM sandboxes WHERE deleted_unix IS NULL AND expires_unix <= ?1
             ORDER BY expires_unix, id",
            now,
        )
    }

    fn idle_sandboxes(&self, now: i64) -> Result<Vec<String>> {
        self.read_ids(
            "SELECT id FROM sandboxes
             WHERE deleted_unix IS NULL AND state = 'running' AND idle_timeout_s IS NOT NULL
               AND last_active_unix + idle_timeout_s <= ?1
             ORDER BY last_active_unix, id",
            now,
        )
    }

    fn insert_calls(&self, calls: &[CallRecord]) -> Result<()> {
        if calls.is_empty() {
            return Ok(());
        }
        // Encode everything before taking the writer, so a bad record fails the batch
        // without holding the lock.
        let mut rows = Vec::with_capacity(calls.len());
        for call in calls {
            let created = unix_of(&format!("call {} created_at", call.id), &call.created_at)?;
            let json = if call.result.stdout.is_empty() && call.result.stderr.is_empty() {
                to_json("call record", call)?
            } else {
                let mut stripped = call.clone();
                stripped.strip_output();
                to_json("call record", &stripped)?
            };
            let cpu_ms = to_i64("cpu_ms", call.result.usage.cpu_ms)?;
            rows.push((call, created, cpu_ms, json));
        }
        let mut conn = self.writer();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        {
            let mut st = tx.prepare_cached(
                "INSERT INTO calls (id, tenant, key_id, kind, sandbox_id, volume_id,
                     created_unix, cpu_ms, record)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            )?;
            for (call, created, cpu_ms, json) in &rows {
                st.execute(params![
                    call.id,
                    call.tenant,
                    call.key_id,
                    call.kind.as_str(),
                    call.sandbox_id,
                    call.volume_id,
                    created,
                    cpu_ms,
                    json
                ])
                .map_err(|e| {
                    conflict_on_unique(e, || format!("call record {} already exists", call.id))
                })?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn list_calls(
        &self,
        tenant: &str,
        sandbox_id: Option<&str>,
        volume_id: Option<&str>,
        limit: Option<u32>,
    ) -> Result<Vec<CallRecord>> {
        let limit = limit
            .unwrap_or(DEFAULT_CALLS_LIMIT)
            .clamp(1, MAX_CALLS_LIMIT)
            .to_string();
        let mut sql = String::from("SELECT record FROM calls WHERE tenant = ?1");
        let mut args: Vec<&str> = vec![tenant];
        if let Some(sb) = sandbox_id {
            args.push(sb);
            sql.push_str(&format!(" AND sandbox_id = ?{}", args.len()));
        }
        if let Some(vol) = volume_id {
            args.push(vol);
            sql.push_str(&format!(" AND volume_id = ?{}", args.len()));
        }
        args.push(&limit);
        sql.push_str(&format!(
            " ORDER BY seq DESC LIMIT CAST(?{} AS INTEGER)",
            args.len()
        ));
        self.read(|c| {
            let mut st = c.prepare_cached(&sql)?;
            let jsons = st
                .query_map(params_from_iter(&args), |r| r.get::<_, String>(0))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            jsons.iter().map(|j| from_json("call record", j)).collect()
        })
    }

    fn usage_at(&self, tenant: &str, since: Option<i64>, now: i64) -> Result<TenantUsage> {
        let since = since.unwrap_or(i64::MIN);
        self.read(|c| {
            let (cpu_ms, runs, execs): (i64, i64, i64) = c
                .prepare_cached(
                    "SELECT COALESCE(SUM(cpu_ms), 0),
                            COALESCE(SUM(kind = 'run'), 0),
                            COALESCE(SUM(kind IN ('exec','process')), 0)
                     FROM calls WHERE tenant = ?1 AND created_unix >= ?2",
                )?
                .query_row(params![tenant, since], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })?;
            let seconds: i64 = c
                .prepare_cached(
                    "SELECT COALESCE(SUM(MAX(0,
                                MIN(?3, COALESCE(ended_unix, ?3)) - MAX(created_unix, ?2))), 0)
                     FROM sandboxes
                     WHERE tenant = ?1 AND (ended_unix IS NULL OR ended_unix > ?2)",
                )?
                .query_row(params![tenant, since, now], |r| r.get(0))?;
            Ok(TenantUsage {
                cpu_ms: from_i64("cpu_ms", cpu_ms)?,
                sandbox_seconds: from_i64("sandbox_seconds", seconds)?,
                runs: from_i64("runs", runs)?,
                execs: from_i64("execs", execs)?,
            })
        })
    }
}
