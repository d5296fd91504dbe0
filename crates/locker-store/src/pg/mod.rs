//! The Postgres store: one database shared by every `locker serve` that points at it
//! (`--database postgres://…`), so that several hosts can share one control plane.
//!
//! Owns: its schema and migrations (`schema`), its connections, its SQL (one module per
//! concern, as the SQLite store has them), and its authentication cache. It follows the
//! [`Store`] contract and the SQLite store's behaviour exactly; the store tests run on both.
//!
//! Connections: the [`Store`] trait is synchronous and is called from inside the tokio
//! runtime (request handlers, on worker threads of a multi-threaded runtime, and in tests
//! on current-thread runtimes). A driver's blocking facade (the `postgres` crate) cannot run
//! there: it blocks on a runtime of its own and panics inside another one; and
//! `block_in_place` is only allowed on a multi-threaded runtime. So the store owns
//! [`POOL_SIZE`] threads, each with one connection (the `postgres` crate's blocking client,
//! which drives tokio-postgres on a small runtime of that thread's own, outside any other
//! runtime). A method sends its work to them over a channel and waits for the answer, the
//! way a SQLite call waits for the disk: the calling thread blocks and no runtime is
//! entered twice. A thread whose connection broke connects again before its next job.
//!
//! Ordering across writers: `calls.seq` and `events.seq` come from sequences, and readers
//! page and follow cursors by them. A sequence hands out numbers at insert, not at commit,
//! so two writers could commit out of order and a reader could step over the slower one's
//! row. Inserts into those two tables therefore take a transaction-level advisory lock
//! first (one per table), which makes commit order equal sequence order, as SQLite's single
//! writer does.
//!
//! The authentication cache holds a key for at most [`AUTH_CACHE_TTL`]: a revoke purges
//! this process's cache at once, and another server sharing the database stops accepting
//! the key within that time.

mod calls;
pub(crate) mod copy;
mod events;
mod fleet;
mod objects;
mod placements;
mod sandboxes;
mod schema;
mod tenants;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use postgres::error::SqlState;
use postgres::types::ToSql;
use postgres::{Client, NoTls, Row, Statement};

use crate::error::{Result, StoreError};
use crate::fleet::{FleetCaRecord, JoinTokenRecord, NodeRecord, PlacementRecord};
use crate::model::{
    CallRecord, EventRecord, KeyInfo, Principal, SandboxRecord, SandboxState, SandboxTimes,
    TenantUsage, VolumeRecord, VolumeSnapshotRecord, WebhookRecord,
};
use crate::{
    SandboxPage, SandboxQuery, SecretRecord, SnapshotRecord, Store, TicketRecord, Tombstone,
};

pub use schema::PG_SCHEMA_VERSION;

/// Connections (and threads) per store.
pub const POOL_SIZE: usize = 4;
/// How long a key stays answered from memory (see the module docs).
pub const AUTH_CACHE_TTL: Duration = Duration::from_secs(2);
/// The advisory lock of [`PgStore::claim_server`].
const SERVER_LOCK: i64 = 0x006c_6f63_6b73_7276; // "locksrv"
/// The advisory lock of [`Store::lead`]: held by the fleet's leader.
const LEADER_LOCK: i64 = 0x006c_6f63_6b6c_6472; // "lockldr"
/// How long connecting may take before a call fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection silent this long is probed (TCP keepalive), on both ends.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// Probes this far apart, this many unanswered before the connection is dropped.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_PROBES: u32 = 3;
/// Data left unacknowledged this long drops the connection (`TCP_USER_TIMEOUT`).
const UNACKED_LIMIT: Duration = Duration::from_secs(15);

/// Tunes a connection's liveness so that a vanished peer is noticed in seconds, not the
/// kernel's two hours, *on both ends*: the client's socket (keepalive, `TCP_USER_TIMEOUT`)
/// and, through the startup `options`, the server's for this session
/// (`tcp_keepalives_*`, `tcp_user_timeout`). The server's side is what frees the fleet's
/// leader lock (a session advisory lock) when a replica is cut off from the database: the
/// server then closes its session within ~16 s and another replica can lead. Settings the
/// URL already names are kept.
fn tune_liveness(config: &mut postgres::Config) {
    if config.get_keepalives() && config.get_keepalives_idle() == Duration::from_secs(7200) {
        config.keepalives_idle(KEEPALIVE_IDLE);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVE_PROBES);
    }
    config.tcp_user_timeout(UNACKED_LIMIT);
    let given = config.get_options().unwrap_or("").to_owned();
    let mut options = vec![given.clone()];
    for (name, value) in [
        ("tcp_keepalives_idle", KEEPALIVE_IDLE.as_secs()),
        ("tcp_keepalives_interval", KEEPALIVE_INTERVAL.as_secs()),
        ("tcp_keepalives_count", u64::from(KEEPALIVE_PROBES)),
        ("tcp_user_timeout", UNACKED_LIMIT.as_millis() as u64),
    ] {
        if !given.contains(name) {
            options.push(format!("-c {name}={value}"));
        }
    }
    config.options(options.join(" ").trim());
}

/// Work for a connection thread.
type Job = Box<dyn FnOnce(&mut Conn) + Send>;

/// One connection and its prepared statements, owned by one thread of the store.
pub(crate) struct Conn {
    config: postgres::Config,
    target: String,
    client: Option<Client>,
    statements: HashMap<String, Statement>,
}

/// The [`Store`] on a Postgres database. See the module docs for its connections.
pub struct PgStore {
    target: String,
    jobs: Mutex<Sender<Job>>,
    /// The leadership's own connection (see [`Store::lead`]): a session lock lives as long
    /// as its connection, so it is never one the pool's jobs might break or share.
    leader: Mutex<Sender<Job>>,
    /// SHA-256 of a clear key → who it is, and since when it is cached.
    auth_cache: RwLock<HashMap<[u8; 32], (Principal, Instant)>>,
    /// Bumped by every revoke (see `SqliteStore`'s field of the same name).
    auth_generation: AtomicU64,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

/// A Postgres URL without its password, for messages and logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (auth, host) = match rest.rsplit_once('@') {
        Some((a, h)) => (Some(a), h),
        None => (None, rest),
    };
    match auth {
        Some(a) => {
            let user = a.split_once(':').map_or(a, |(u, _)| u);
            format!("{scheme}://{user}@{host}")
        }
        None => url.to_owned(),
    }
}

/// Whether `s` names a Postgres database (`postgres://…` or `postgresql://…`).
pub fn is_postgres_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

impl Conn {
    fn client(&mut self) -> Result<&mut Client> {
        if self.client.as_ref().is_some_and(|c| c.is_closed()) {
            self.client = None;
            self.statements.clear();
        }
        if self.client.is_none() {
            let c = self
                .config
                .connect(NoTls)
                .map_err(|source| StoreError::PgConnect {
                    target: self.target.clone(),
                    source,
                })?;
            self.client = Some(c);
        }
        Ok(self.client.as_mut().expect("connected above"))
    }

    fn statement(&mut self, sql: &str) -> Result<Statement> {
        if let Some(st) = self.statements.get(sql) {
            return Ok(st.clone());
        }
        let st = self.client()?.prepare(sql)?;
        self.statements.insert(sql.to_owned(), st.clone());
        Ok(st)
    }

    /// Rows of `sql` (prepared once per connection).
    pub(crate) fn query(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>> {
        let st = self.statement(sql)?;
        Ok(self.client()?.query(&st, params)?)
    }

    /// The row of `sql`, if any.
    pub(crate) fn query_opt(
        &mut self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>> {
        let st = self.statement(sql)?;
        Ok(self.client()?.query_opt(&st, params)?)
    }

    /// The one row of `sql`.
    pub(crate) fn query_one(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Row> {
        let st = self.statement(sql)?;
        Ok(self.client()?.query_one(&st, params)?)
    }

    /// How many rows `sql` changed.
    pub(crate) fn execute(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        let st = self.statement(sql)?;
        Ok(self.client()?.execute(&st, params)?)
    }

    /// Statements without parameters (DDL, `BEGIN`), not prepared.
    pub(crate) fn batch(&mut self, sql: &str) -> Result<()> {
        Ok(self.client()?.batch_execute(sql)?)
    }

    /// Runs `f` in one transaction: committed if it returns `Ok`, rolled back otherwise.
    pub(crate) fn transaction<T>(&mut self, f: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        self.batch("BEGIN")?;
        match f(self) {
            Ok(v) => {
                self.batch("COMMIT")?;
                Ok(v)
            }
            Err(e) => {
                if self.batch("ROLLBACK").is_err() {
                    // A connection that cannot roll back is not reused.
                    self.client = None;
                }
                Err(e)
            }
        }
    }
}

/// The same error for a Postgres uniqueness violation as the SQLite store gives.
pub(crate) fn conflict_on_unique(e: StoreError, msg: impl FnOnce() -> String) -> StoreError {
    match &e {
        StoreError::Postgres(pe) if pe.code() == Some(&SqlState::UNIQUE_VIOLATION) => {
            StoreError::Conflict(msg())
        }
        _ => e,
    }
}

/// One connection thread: runs jobs until the store is dropped.
fn worker(jobs: Arc<Mutex<Receiver<Job>>>, mut conn: Conn) {
    loop {
        let job = {
            let rx = jobs.lock().unwrap_or_else(PoisonError::into_inner);
            rx.recv()
        };
        let Ok(job) = job else { return };
        if std::panic::catch_unwind(AssertUnwindSafe(|| job(&mut conn))).is_err() {
            // The connection may be inside a transaction the panic left open.
            conn.client = None;
            conn.statements.clear();
        }
    }
}

impl PgStore {
    /// Connects to the database at `url` (`postgres://user:password@host:port/db`; the
    /// other forms tokio-postgres reads work too) and brings its schema up to
    /// [`PG_SCHEMA_VERSION`]. The database must exist; its tables are created here.
    ///
    /// `PgConnect` if it cannot be reached, `PgSchemaTooNew` if a newer Locker wrote it.
    pub fn connect(url: &str) -> Result<PgStore> {
        let target = redact_url(url);
        let mut config: postgres::Config = url.parse().map_err(|e| {
            StoreError::Invalid(format!(
                "--database {target}: {e} (write it as postgres://USER:PASSWORD@HOST:PORT/DB)"
            ))
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("locker");
        }
        tune_liveness(&mut config);
        let pool = |name: &str, n: usize| -> Result<Sender<Job>> {
            let (tx, rx) = mpsc::channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            for i in 0..n {
                let conn = Conn {
                    config: config.clone(),
                    target: target.clone(),
                    client: None,
                    statements: HashMap::new(),
                };
                let rx = Arc::clone(&rx);
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || worker(rx, conn))
                    .map_err(|e| StoreError::Unavailable(format!("cannot start a thread: {e}")))?;
            }
            Ok(tx)
        };
        let tx = pool("locker-pg", POOL_SIZE)?;
        let leader = pool("locker-pg-leader", 1)?;
        let store = PgStore {
            target,
            jobs: Mutex::new(tx),
            leader: Mutex::new(leader),
            auth_cache: RwLock::new(HashMap::new()),
            auth_generation: AtomicU64::new(0),
        };
        // On a connection thread too: this may be called inside a runtime (the server's).
        store.run(schema::migrate)?;
        Ok(store)
    }

    /// Claims the database for this server, for as long as it runs: alone (`shared` false:
    /// a one-host server, whose router could not reach another's machines) or beside other
    /// control replicas of a fleet (`shared` true: each adopts only its own machines and
    /// routes to the others'). A session-level advisory lock, exclusive or shared, on one of
    /// the store's connections: Postgres drops it when this process (or that connection)
    /// goes. `Conflict`, saying who holds it, if the other kind is held.
    pub fn claim_server(&self, shared: bool) -> Result<()> {
        let target = self.target.clone();
        self.run(move |c| {
            let sql = if shared {
                "SELECT pg_try_advisory_lock_shared($1)"
            } else {
                "SELECT pg_try_advisory_lock($1)"
            };
            let got: bool = c.query_one(sql, &[&SERVER_LOCK])?.try_get(0)?;
            if got {
                return Ok(());
            }
            let holder: Option<String> = c
                .query_opt(
                    "SELECT a.pid::text || ' from ' || COALESCE(host(a.client_addr), 'a local socket')
                     FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                     WHERE l.locktype = 'advisory' AND l.granted
                       AND l.objid = ($1::bigint & 4294967295)::oid LIMIT 1",
                    &[&SERVER_LOCK],
                )?
                .map(|r| r.try_get(0))
                .transpose()?;
            let holder = holder.as_deref().unwrap_or("unknown");
            Err(StoreError::Conflict(if shared {
                format!(
                    "a one-host locker serve (without --fleet-listen) already uses the Postgres \
                     database {target} (its session: {holder}): control replicas share a \
                     database only when every one of them runs with --fleet-listen \
                     (docs/operations.md, \"Fleet mode\"); restart it with --fleet-listen"
                )
            } else {
                format!(
                    "another locker serve already uses the Postgres database {target} (its \
                     session: {holder}): servers share a database only as control replicas of \
                     a fleet, each with --fleet-listen (docs/operations.md, \"Fleet mode\"); \
                     stop it first, pass another --database, or add --fleet-listen"
                )
            }))
        })
    }

    /// The database's URL without its password.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The schema version of the database.
    pub fn schema_version(&self) -> Result<i64> {
        self.run(|c| {
            Ok(
                c.query_one("SELECT COALESCE(MAX(version), 0) FROM schema_version", &[])?
                    .try_get(0)?,
            )
        })
    }

    /// Runs `f` on one of the store's connections and waits for its answer.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Conn) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.send(&self.jobs, f)
    }

    /// Runs `f` on a connection of `pool` and waits for its answer.
    fn send<T: Send + 'static>(
        &self,
        pool: &Mutex<Sender<Job>>,
        f: impl FnOnce(&mut Conn) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let (reply, answer) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |conn| {
            let _ = reply.send(f(conn));
        });
        pool.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(job)
            .map_err(|_| StoreError::Unavailable("the store's connections are closed".into()))?;
        answer.recv().map_err(|_| {
            StoreError::Unavailable("a database call panicked; see the server's log".into())
        })?
    }
}

/// `Option<&str>` → owned, for a job.
fn own(s: Option<&str>) -> Option<String> {
    s.map(str::to_owned)
}

impl Store for PgStore {
    // ---- tenants and keys ----

    fn ensure_tenant(&self, name: &str) -> Result<()> {
        let name = name.to_owned();
        self.run(move |c| tenants::ensure_tenant(c, &name))
    }

    fn create_tenant(&self, name: &str) -> Result<()> {
        let name = name.to_owned();
        self.run(move |c| tenants::create_tenant(c, &name))
    }

    fn tenant_exists(&self, name: &str) -> Result<bool> {
        let name = name.to_owned();
        self.run(move |c| tenants::tenant_exists(c, &name))
    }

    fn list_tenants(&self) -> Result<Vec<String>> {
        self.run(tenants::list_tenants)
    }

    fn create_key(&self, tenant: &str) -> Result<(KeyInfo, String)> {
        let tenant = tenant.to_owned();
        self.run(move |c| tenants::create_key(c, &tenant))
    }

    fn add_key_with_secret(&self, tenant: &str, clear_key: &str) -> Result<KeyInfo> {
        let (tenant, key) = (tenant.to_owned(), clear_key.to_owned());
        self.run(move |c| tenants::add_key_with_secret(c, &tenant, &key))
    }

    fn authenticate(&self, clear_key: &str) -> Result<Option<Principal>> {
        tenants::authenticate(self, clear_key)
    }

    fn revoke_key(&self, key_id: &str) -> Result<bool> {
        tenants::revoke_key(self, key_id)
    }

    fn list_keys(&self, tenant: &str) -> Result<Vec<KeyInfo>> {
        let tenant = tenant.to_owned();
        self.run(move |c| tenants::list_keys(c, &tenant))
    }

    // ---- sandboxes ----

    fn forget_sandbox(&self, id: &str) -> Result<bool> {
        let id = id.to_owned();
        self.run(move |c| Ok(c.execute("DELETE FROM sandboxes WHERE id = $1", &[&id])? > 0))
    }

    fn insert_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        let s = s.clone();
        self.run(move |c| sandboxes::insert_sandbox(c, &s))
    }

    fn get_sandbox(&self, tenant: &str, id: &str) -> Result<Option<SandboxRecord>> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        self.run(move |c| sandboxes::get_sandbox(c, Some(&tenant), &id))
    }

    fn get_sandbox_any(&self, id: &str) -> Result<Option<SandboxRecord>> {
        let id = id.to_owned();
        self.run(move |c| sandboxes::get_sandbox(c, None, &id))
    }

    fn list_sandboxes(
        &self,
        tenant: &str,
        state: Option<SandboxState>,
        metadata: &[(String, String)],
    ) -> Result<Vec<SandboxRecord>> {
        let (tenant, metadata) = (tenant.to_owned(), metadata.to_vec());
        self.run(move |c| sandboxes::list_sandboxes(c, &tenant, state, &metadata))
    }

    fn list_sandboxes_page(&self, tenant: &str, q: &SandboxQuery) -> Result<SandboxPage> {
        let (tenant, q) = (tenant.to_owned(), q.clone());
        self.run(move |c| sandboxes::list_sandboxes_page(c, &tenant, &q, true))
    }

    fn update_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        let s = s.clone();
        self.run(move |c| sandboxes::update_sandbox(c, &s))
    }

    fn set_sandbox_state_at(&self, id: &str, state: SandboxState, now: i64) -> Result<()> {
        let id = id.to_owned();
        self.run(move |c| sandboxes::set_sandbox_state_at(c, &id, state, now))
    }

    fn touch_sandbox(&self, id: &str, at: i64) -> Result<()> {
        let id = id.to_owned();
        self.run(move |c| sandboxes::touch_sandbox(c, &id, at))
    }

    fn delete_sandbox_at(&self, id: &str, now: i64) -> Result<bool> {
        let id = id.to_owned();
        self.run(move |c| sandboxes::end_sandbox_at(c, &id, now, None))
    }

    fn end_sandbox_at(&self, id: &str, now: i64, cause: &str) -> Result<bool> {
        let (id, cause) = (id.to_owned(), cause.to_owned());
        self.run(move |c| sandboxes::end_sandbox_at(c, &id, now, Some(&cause)))
    }

    fn tombstone_at(&self, tenant: &str, id: &str, now: i64) -> Result<Option<Tombstone>> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        self.run(move |c| sandboxes::tombstone_at(c, &tenant, &id, now))
    }

    fn list_live_sandboxes(&self) -> Result<Vec<SandboxRecord>> {
        self.run(sandboxes::list_live_sandboxes)
    }

    fn host_sandboxes(&self, host: &str) -> Result<Vec<SandboxRecord>> {
        let host = host.to_owned();
        self.run(move |c| sandboxes::host_sandboxes(c, &host))
    }

    fn lead(&self) -> Result<bool> {
        self.send(&self.leader, |c| {
            // Held already by this session (the connection never broke), else taken if free.
            // CASE evaluates in order: a session that holds it does not take it twice.
            Ok(c.query_one(
                "SELECT CASE WHEN EXISTS (
                     SELECT 1 FROM pg_locks
                     WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid()
                       AND classid = (($1::bigint >> 32) & 4294967295)::oid
                       AND objid = ($1::bigint & 4294967295)::oid AND objsubid = 1)
                 THEN true ELSE pg_try_advisory_lock($1) END",
                &[&LEADER_LOCK],
            )?
            .try_get(0)?)
        })
    }

    fn count_running(&self, tenant: &str) -> Result<u64> {
        let tenant = tenant.to_owned();
        self.run(move |c| sandboxes::count_running(c, &tenant))
    }

    fn sum_memory_mb(&self, tenant: &str) -> Result<u64> {
        let tenant = tenant.to_owned();
        self.run(move |c| sandboxes::sum_memory_mb(c, &tenant))
    }

    fn sum_disk_mb(&self, tenant: &str) -> Result<u64> {
        let tenant = tenant.to_owned();
        self.run(move |c| sandboxes::sum_disk_mb(c, &tenant))
    }

    fn expired_sandboxes(&self, now: i64) -> Result<Vec<String>> {
        self.run(move |c| sandboxes::expired_sandboxes(c, now))
    }

    fn idle_sandboxes(&self, now: i64) -> Result<Vec<String>> {
        self.run(move |c| sandboxes::idle_sandboxes(c, now))
    }

    // ---- snapshots ----

    fn insert_snapshot(&self, snap: &SnapshotRecord) -> Result<()> {
        let snap = snap.clone();
        self.run(move |c| objects::insert_snapshot(c, &snap))
    }

    fn get_snapshot(&self, tenant: &str, id: &str) -> Result<Option<SnapshotRecord>> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        self.run(move |c| objects::get_record(c, "snapshots", &tenant, &id))
    }

    fn list_snapshots(&self, tenant: &str) -> Result<Vec<SnapshotRecord>> {
        let tenant = tenant.to_owned();
        self.run(move |c| objects::list_snapshots(c, &tenant))
    }

    fn delete_snapshot(&self, tenant: &str, id: &str) -> Result<bool> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        self.run(move |c| objects::delete_row(c, "snapshots", &tenant, &id))
    }

    // ---- volumes ----

    fn insert_volume(&self, v: &VolumeRecord) -> Result<()> {
        let v = v.clone();
        self.run(move |c| objects::insert_volume(c, &v))
    }

    fn get_volume(&self, tenant: &str, id_or_name: &str) -> Result<Option<VolumeRecord>> {
        let (tenant, id) = (tenant.to_owned(), id_or_name.to_owned());
        self.run(move |c| objects::get_volume(c, &tenant, &id))
    }

    fn list_volumes(&self, tenant: &str) -> Result<Vec<VolumeRecord>> {
        let tenant = tenant.to_owned();
        self.run(move |c| objects::list_volumes(c, Some(&tenant)))
    }

    fn list_all_volumes(&self) -> Result<Vec<VolumeRecord>> {
        self.run(move |c| objects::list_volumes(c, None))
    }

    fn host_volumes(&self, host: &str) -> Result<Vec<VolumeRecord>> {
        let host = host.to_owned();
        self.run(move |c| objects::host_volumes(c, &host))
    }

    fn delete_volume(&self, tenant: &str, id: &str) -> Result<bool> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        self.run(move |c| objects::delete_volume(c, &tenant, &id))
    }

    fn move_volume(
        &self,
        tenant: &str,
        id: &str,
        from: &str,
        to: &str,
        snapshots: &[VolumeSnapshotRecord],
    ) -> Result<bool> {
        let (tenant, id, from, to) = (
            tenant.to_owned(),
            id.to_owned(),
            from.to_owned(),
            to.to_owned(),
        );
        let snapshots = snapshots.to_vec();
        self.run(move |c| objects::move_volume(c, &tenant, &id, (&from, &to), &snapshots))
    }

    fn insert_volume_snapshot(&self, snap: &VolumeSnapshotRecord) -> Result<()> {
        let snap = snap.clone();
        self.run(move |c| objects::insert_volume_snapshot(c, &snap))
    }

    fn get_volume_snapshot(&self, tenant: &str, id: &str) -> Result<Option<VolumeSnapshotRecord>> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        self.run(move |c| objects::get_record(c, "volume_snapshots", &tenant, &id))
    }

    fn list_volume_snapshots(
        &self,
        tenant: &str,
        volume_id: &str,
    ) -> Result<Vec<VolumeSnapshotRecord>> {
        let (tenant, volume_id) = (tenant.to_owned(), volume_id.to_owned());
        self.run(move |c| objects::list_volume_snapshots(c, &tenant, &volume_id))
    }

    fn delete_volume_snapshot(&self, tenant: &str, id: &str) -> Result<bool> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        self.run(move |c| objects::delete_row(c, "volume_snapshots", &tenant, &id))
    }

    // ---- template builds ----

    fn put_template_build(&self, id: &str, tenant: &str, state: &str, record: &str) -> Result<()> {
        let (id, tenant, state, record) = (
            id.to_owned(),
            tenant.to_owned(),
            state.to_owned(),
            record.to_owned(),
        );
        self.run(move |c| objects::put_template_build(c, &id, &tenant, &state, &record))
    }

    fn get_template_build(&self, tenant: &str, id: &str) -> Result<Option<String>> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        self.run(move |c| objects::get_template_build(c, &tenant, &id))
    }

    fn unfinished_template_builds(&self) -> Result<Vec<(String, String)>> {
        self.run(objects::unfinished_template_builds)
    }

    fn list_template_builds(&self, tenant: &str, limit: u32) -> Result<Vec<String>> {
        let tenant = tenant.to_owned();
        self.run(move |c| objects::list_template_builds(c, &tenant, limit))
    }

    // ---- call records and usage ----

    fn insert_calls(&self, calls: &[CallRecord]) -> Result<()> {
        if calls.is_empty() {
            return Ok(());
        }
        let rows = calls::encode(calls)?;
        self.run(move |c| calls::insert_calls(c, &rows))
    }

    fn list_calls(
        &self,
        tenant: &str,
        sandbox_id: Option<&str>,
        volume_id: Option<&str>,
        limit: Option<u32>,
    ) -> Result<Vec<CallRecord>> {
        let q = crate::CallQuery {
            sandbox_id: own(sandbox_id),
            volume_id: own(volume_id),
            limit,
            ..Default::default()
        };
        Ok(self.list_calls_page(tenant, &q)?.calls)
    }

    fn list_calls_page(&self, tenant: &str, q: &crate::CallQuery) -> Result<crate::CallPage> {
        let (tenant, q) = (tenant.to_owned(), q.clone());
        self.run(move |c| calls::list_calls_page(c, &tenant, &q))
    }

    fn usage_at(&self, tenant: &str, since: Option<i64>, now: i64) -> Result<TenantUsage> {
        let tenant = tenant.to_owned();
        self.run(move |c| calls::usage_at(c, &tenant, since, now))
    }

    // ---- lifecycle events and webhooks ----

    fn insert_event(
        &self,
        tenant: &str,
        kind: &str,
        subject: &str,
        data: &str,
        at: i64,
    ) -> Result<u64> {
        let (tenant, kind, subject, data) = (
            tenant.to_owned(),
            kind.to_owned(),
            subject.to_owned(),
            data.to_owned(),
        );
        self.run(move |c| events::insert_event(c, &tenant, &kind, &subject, &data, at))
    }

    fn events_after(
        &self,
        tenant: Option<&str>,
        after: u64,
        limit: u32,
    ) -> Result<Vec<EventRecord>> {
        let tenant = own(tenant);
        self.run(move |c| events::events_after(c, tenant.as_deref(), after, limit))
    }

    fn latest_event_seq(&self) -> Result<u64> {
        self.run(events::latest_event_seq)
    }

    fn put_ticket(&self, ticket: &TicketRecord, now_ms: i64, max: u64) -> Result<bool> {
        let t = ticket.clone();
        self.run(move |c| tenants::put_ticket(c, &t, now_ms, max))
    }

    fn take_ticket(&self, hash: &str, now_ms: i64) -> Result<Option<TicketRecord>> {
        let hash = hash.to_owned();
        self.run(move |c| tenants::take_ticket(c, &hash, now_ms))
    }

    fn take_node_events(
        &self,
        node_id: &str,
        events: &[EventRecord],
    ) -> Result<(u64, Vec<EventRecord>)> {
        let (node, events) = (node_id.to_owned(), events.to_vec());
        self.run(move |c| events::take_node_events(c, &node, &events))
    }

    fn prune_events(&self, before: i64, keep: u64) -> Result<u64> {
        self.run(move |c| events::prune_events(c, before, keep))
    }

    fn insert_webhook(&self, webhook: &WebhookRecord) -> Result<WebhookRecord> {
        let w = webhook.clone();
        self.run(move |c| events::insert_webhook(c, &w))
    }

    fn list_webhooks(&self, tenant: Option<&str>) -> Result<Vec<WebhookRecord>> {
        let tenant = own(tenant);
        self.run(move |c| events::list_webhooks(c, tenant.as_deref()))
    }

    fn delete_webhook(&self, tenant: &str, id: &str) -> Result<bool> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        self.run(move |c| events::delete_webhook(c, &tenant, &id))
    }

    fn set_webhook_cursor(&self, id: &str, seq: u64) -> Result<()> {
        let id = id.to_owned();
        self.run(move |c| events::set_webhook_cursor(c, &id, seq))
    }

    fn put_sandbox_times(&self, id: &str, times: &SandboxTimes) -> Result<()> {
        let (id, t) = (id.to_owned(), times.clone());
        self.run(move |c| events::put_sandbox_times(c, &id, &t))
    }

    fn sandbox_times(&self, id: &str) -> Result<Option<SandboxTimes>> {
        let id = id.to_owned();
        self.run(move |c| events::sandbox_times(c, &id))
    }

    // ---- secrets ----

    fn insert_secret(&self, s: &SecretRecord) -> Result<()> {
        let s = s.clone();
        self.run(move |c| objects::insert_secret(c, &s))
    }

    fn get_secret(&self, tenant: &str, name: &str) -> Result<Option<SecretRecord>> {
        let (tenant, name) = (tenant.to_owned(), name.to_owned());
        self.run(move |c| Ok(objects::list_secrets(c, &tenant, Some(&name))?.pop()))
    }

    fn list_secrets(&self, tenant: &str) -> Result<Vec<SecretRecord>> {
        let tenant = tenant.to_owned();
        self.run(move |c| objects::list_secrets(c, &tenant, None))
    }

    fn update_secret(&self, s: &SecretRecord) -> Result<bool> {
        let s = s.clone();
        self.run(move |c| objects::update_secret(c, &s))
    }

    fn delete_secret(&self, tenant: &str, name: &str) -> Result<bool> {
        let (tenant, name) = (tenant.to_owned(), name.to_owned());
        self.run(move |c| objects::delete_secret(c, &tenant, &name))
    }

    // ---- the fleet ----

    fn fleet_ca(&self) -> Result<Option<FleetCaRecord>> {
        self.run(fleet::fleet_ca)
    }

    fn put_fleet_ca_once(&self, ca: &FleetCaRecord) -> Result<FleetCaRecord> {
        let ca = ca.clone();
        self.run(move |c| fleet::put_fleet_ca_once(c, &ca))
    }

    fn insert_join_token(&self, token: &JoinTokenRecord) -> Result<()> {
        let token = token.clone();
        self.run(move |c| fleet::insert_join_token(c, &token))
    }

    fn join_node(&self, token_hash: &[u8], node: &NodeRecord, lease_ms: i64) -> Result<NodeRecord> {
        let (hash, node) = (token_hash.to_vec(), node.clone());
        self.run(move |c| fleet::join_node(c, &hash, &node, lease_ms))
    }

    fn upsert_node(&self, node: &NodeRecord, lease_ms: i64) -> Result<NodeRecord> {
        let node = node.clone();
        self.run(move |c| fleet::upsert_node(c, &node, lease_ms))
    }

    fn node_heartbeat(
        &self,
        id: &str,
        cert_sha256: &str,
        epoch: i64,
        report: &str,
        lease_ms: i64,
    ) -> Result<Option<NodeRecord>> {
        let (id, cert, report) = (id.to_owned(), cert_sha256.to_owned(), report.to_owned());
        self.run(move |c| fleet::node_heartbeat(c, &id, &cert, epoch, &report, lease_ms))
    }

    fn revive_node(&self, id: &str, lease_ms: i64) -> Result<Option<NodeRecord>> {
        let id = id.to_owned();
        self.run(move |c| fleet::revive_node(c, &id, lease_ms))
    }

    fn expire_nodes(&self, max: u32) -> Result<Vec<NodeRecord>> {
        self.run(move |c| fleet::expire_nodes(c, max))
    }

    fn get_node(&self, id_or_name: &str) -> Result<Option<NodeRecord>> {
        let id = id_or_name.to_owned();
        self.run(move |c| fleet::get_node(c, &id))
    }

    fn list_nodes(&self) -> Result<Vec<NodeRecord>> {
        self.run(fleet::list_nodes)
    }

    fn delete_node(&self, id: &str) -> Result<bool> {
        let id = id.to_owned();
        self.run(move |c| fleet::delete_node(c, &id))
    }

    fn delete_node_with_volumes(&self, id: &str) -> Result<Option<Vec<VolumeRecord>>> {
        let id = id.to_owned();
        self.run(move |c| objects::delete_node_with_volumes(c, &id))
    }

    fn cordon_node(&self, id: &str, cordoned: bool) -> Result<bool> {
        let id = id.to_owned();
        self.run(move |c| fleet::cordon_node(c, &id, cordoned))
    }

    fn clock_ms(&self) -> Result<i64> {
        self.run(fleet::clock_ms)
    }

    fn place(
        &self,
        p: &PlacementRecord,
        cap_slots: i64,
        cap_memory_mb: i64,
    ) -> Result<Option<PlacementRecord>> {
        let p = p.clone();
        self.run(move |c| placements::place(c, &p, cap_slots, cap_memory_mb))
    }

    fn set_placed(&self, id: &str, sandbox_id: &str, view: &str) -> Result<bool> {
        let (id, sb, view) = (id.to_owned(), sandbox_id.to_owned(), view.to_owned());
        self.run(move |c| placements::set_placed(c, &id, &sb, &view))
    }

    fn set_placement_view(&self, sandbox_id: &str, view: &str) -> Result<()> {
        let (sb, view) = (sandbox_id.to_owned(), view.to_owned());
        self.run(move |c| placements::set_placement_view(c, &sb, &view))
    }

    fn unplace(&self, id: &str) -> Result<Option<PlacementRecord>> {
        let id = id.to_owned();
        self.run(move |c| placements::unplace(c, &id))
    }

    fn unplace_lost(&self, id: &str) -> Result<Option<PlacementRecord>> {
        let id = id.to_owned();
        self.run(move |c| placements::unplace_lost(c, &id))
    }

    fn move_placement(
        &self,
        id: &str,
        (from_node, from_epoch, from_state): (&str, i64, crate::PlacementState),
        into: &str,
        view: &str,
    ) -> Result<Option<PlacementRecord>> {
        let (id, from, into, view) = (
            id.to_owned(),
            from_node.to_owned(),
            into.to_owned(),
            view.to_owned(),
        );
        self.run(move |c| {
            placements::move_placement(c, &id, (&from, from_epoch, from_state), &into, &view)
        })
    }

    fn get_placement(&self, sandbox_id: &str) -> Result<Option<PlacementRecord>> {
        let sb = sandbox_id.to_owned();
        self.run(move |c| placements::get_placement(c, &sb))
    }

    fn list_placements(
        &self,
        tenant: Option<&str>,
        node_id: Option<&str>,
    ) -> Result<Vec<PlacementRecord>> {
        let (t, n) = (tenant.map(str::to_owned), node_id.map(str::to_owned));
        self.run(move |c| placements::list_placements(c, t.as_deref(), n.as_deref()))
    }

    fn lose_placements(&self) -> Result<Vec<PlacementRecord>> {
        self.run(placements::lose_placements)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_password_in_messages() {
        assert_eq!(
            redact_url("postgres://locker:s3cret@db:5432/locker"),
            "postgres://locker@db:5432/locker"
        );
        assert_eq!(redact_url("postgres://db/locker"), "postgres://db/locker");
        assert_eq!(
            redact_url("postgresql://u:p@ss@h/d"),
            "postgresql://u@h/d",
            "a password holding '@'"
        );
        assert!(is_postgres_url("postgresql://h/d") && !is_postgres_url("/var/lib/x.sqlite"));
    }

    #[test]
    fn connections_notice_a_vanished_peer_on_both_ends_unless_the_url_says_otherwise() {
        let mut c: postgres::Config = "postgres://u@h/d".parse().unwrap();
        tune_liveness(&mut c);
        assert_eq!(c.get_keepalives_idle(), KEEPALIVE_IDLE);
        assert_eq!(c.get_keepalives_interval(), Some(KEEPALIVE_INTERVAL));
        assert_eq!(c.get_keepalives_retries(), Some(KEEPALIVE_PROBES));
        assert_eq!(
            c.get_options(),
            Some(
                "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=2 \
                 -c tcp_keepalives_count=3 -c tcp_user_timeout=15000"
            )
        );
        let mut c: postgres::Config =
            "postgres://u@h/d?keepalives_idle=60&options=-c%20tcp_keepalives_idle%3D60"
                .parse()
                .unwrap();
        tune_liveness(&mut c);
        assert_eq!(c.get_keepalives_idle(), Duration::from_secs(60));
        assert_eq!(
            c.get_options(),
            Some(
                "-c tcp_keepalives_idle=60 -c tcp_keepalives_interval=2 \
                 -c tcp_keepalives_count=3 -c tcp_user_timeout=15000"
            )
        );
    }
}
