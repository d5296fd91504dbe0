//! The SQLite store: one database file in the data dir (`db.sqlite`).
//!
//! Owns: the schema and its migrations, the connections, the SQL, and the in-memory
//! authentication cache. Nothing else in Locker writes SQL.
//!
//! Connections: one writer behind a mutex (SQLite allows one writer at a time anyway, and
//! serialising in-process avoids `SQLITE_BUSY` between our own threads) and a small pool of
//! read-only connections, which WAL mode lets read while the writer writes. Another
//! process opening the same file waits up to `busy_timeout` for the write lock.
//!
//! This file holds the connections and the [`Store`] contract's table of contents; the SQL
//! lives in one module per concern: `schema` (tables and migrations), `tenants` (tenants,
//! keys, authentication), `sandboxes`, `calls` (records and usage), `volumes`, `snapshots`
//! (of sandboxes and of volumes), and `codec` (the checked conversions between records and
//! columns that they share). Those modules take the store as `db` and borrow its
//! connections; none opens its own.

mod builds;
mod calls;
pub(crate) mod codec;
mod events;
mod fleet;
mod placements;
pub(crate) mod sandboxes;
mod schema;
mod secrets;
mod snapshots;
pub(crate) mod tenants;
mod volumes;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use crate::error::{Result, StoreError};
use crate::fleet::{FleetCaRecord, JoinTokenRecord, NodeRecord, PlacementRecord};
use crate::model::{
    CallRecord, EventRecord, KeyInfo, Principal, SandboxRecord, SandboxState, SandboxTimes,
    TenantUsage, VolumeRecord, VolumeSnapshotRecord, WebhookRecord,
};
use crate::{SecretRecord, SnapshotRecord, Store, TicketRecord, Tombstone};

pub use schema::SCHEMA_VERSION;

/// How long a statement waits for another process's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Read connections kept open between reads; more are opened under load and closed after.
const MAX_IDLE_READERS: usize = 8;

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
        schema::migrate(&mut writer, &path)?;
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

impl Store for SqliteStore {
    // ---- tenants and keys ----

    fn ensure_tenant(&self, name: &str) -> Result<()> {
        tenants::ensure_tenant(self, name)
    }

    fn create_tenant(&self, name: &str) -> Result<()> {
        tenants::create_tenant(self, name)
    }

    fn tenant_exists(&self, name: &str) -> Result<bool> {
        tenants::tenant_exists(self, name)
    }

    fn list_tenants(&self) -> Result<Vec<String>> {
        tenants::list_tenants(self)
    }

    fn create_key(&self, tenant: &str) -> Result<(KeyInfo, String)> {
        tenants::create_key(self, tenant)
    }

    fn add_key_with_secret(&self, tenant: &str, clear_key: &str) -> Result<KeyInfo> {
        tenants::add_key_with_secret(self, tenant, clear_key)
    }

    fn authenticate(&self, clear_key: &str) -> Result<Option<Principal>> {
        tenants::authenticate(self, clear_key)
    }

    fn revoke_key(&self, key_id: &str) -> Result<bool> {
        tenants::revoke_key(self, key_id)
    }

    fn list_keys(&self, tenant: &str) -> Result<Vec<KeyInfo>> {
        tenants::list_keys(self, tenant)
    }

    // ---- sandboxes ----

    fn forget_sandbox(&self, id: &str) -> Result<bool> {
        Ok(self
            .writer()
            .prepare_cached("DELETE FROM sandboxes WHERE id = ?1")?
            .execute([id])?
            > 0)
    }

    fn insert_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        sandboxes::insert_sandbox(self, s)
    }

    fn get_sandbox(&self, tenant: &str, id: &str) -> Result<Option<SandboxRecord>> {
        sandboxes::get_sandbox(self, tenant, id)
    }

    fn get_sandbox_any(&self, id: &str) -> Result<Option<SandboxRecord>> {
        sandboxes::get_sandbox_any(self, id)
    }

    fn list_sandboxes(
        &self,
        tenant: &str,
        state: Option<SandboxState>,
        metadata: &[(String, String)],
    ) -> Result<Vec<SandboxRecord>> {
        sandboxes::list_sandboxes(self, tenant, state, metadata)
    }

    fn list_sandboxes_page(
        &self,
        tenant: &str,
        q: &crate::SandboxQuery,
    ) -> Result<crate::SandboxPage> {
        sandboxes::list_sandboxes_page(self, tenant, q)
    }

    fn update_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        sandboxes::update_sandbox(self, s)
    }

    fn set_sandbox_state_at(&self, id: &str, state: SandboxState, now: i64) -> Result<()> {
        sandboxes::set_sandbox_state_at(self, id, state, now)
    }

    fn touch_sandbox(&self, id: &str, at: i64) -> Result<()> {
        sandboxes::touch_sandbox(self, id, at)
    }

    fn delete_sandbox_at(&self, id: &str, now: i64) -> Result<bool> {
        sandboxes::delete_sandbox_at(self, id, now)
    }

    fn end_sandbox_at(&self, id: &str, now: i64, cause: &str) -> Result<bool> {
        sandboxes::end_sandbox_at(self, id, now, cause)
    }

    fn tombstone_at(&self, tenant: &str, id: &str, now: i64) -> Result<Option<Tombstone>> {
        sandboxes::tombstone_at(self, tenant, id, now)
    }

    fn list_live_sandboxes(&self) -> Result<Vec<SandboxRecord>> {
        sandboxes::list_live_sandboxes(self)
    }

    fn host_sandboxes(&self, host: &str) -> Result<Vec<SandboxRecord>> {
        sandboxes::host_sandboxes(self, host)
    }

    fn lead(&self) -> Result<bool> {
        Ok(true)
    }

    fn count_running(&self, tenant: &str) -> Result<u64> {
        sandboxes::count_running(self, tenant)
    }

    fn sum_memory_mb(&self, tenant: &str) -> Result<u64> {
        sandboxes::sum_memory_mb(self, tenant)
    }

    fn sum_disk_mb(&self, tenant: &str) -> Result<u64> {
        sandboxes::sum_disk_mb(self, tenant)
    }

    fn expired_sandboxes(&self, now: i64) -> Result<Vec<String>> {
        sandboxes::expired_sandboxes(self, now)
    }

    fn idle_sandboxes(&self, now: i64) -> Result<Vec<String>> {
        sandboxes::idle_sandboxes(self, now)
    }

    // ---- template builds ----

    fn put_template_build(&self, id: &str, tenant: &str, state: &str, record: &str) -> Result<()> {
        builds::put_template_build(self, id, tenant, state, record)
    }

    fn get_template_build(&self, tenant: &str, id: &str) -> Result<Option<String>> {
        builds::get_template_build(self, tenant, id)
    }

    fn unfinished_template_builds(&self) -> Result<Vec<(String, String)>> {
        builds::unfinished_template_builds(self)
    }

    fn list_template_builds(&self, tenant: &str, limit: u32) -> Result<Vec<String>> {
        builds::list_template_builds(self, tenant, limit)
    }

    // ---- call records and usage ----

    fn insert_calls(&self, calls: &[CallRecord]) -> Result<()> {
        calls::insert_calls(self, calls)
    }

    fn list_calls(
        &self,
        tenant: &str,
        sandbox_id: Option<&str>,
        volume_id: Option<&str>,
        limit: Option<u32>,
    ) -> Result<Vec<CallRecord>> {
        calls::list_calls(self, tenant, sandbox_id, volume_id, limit)
    }

    fn list_calls_page(&self, tenant: &str, q: &crate::CallQuery) -> Result<crate::CallPage> {
        calls::list_calls_page(self, tenant, q)
    }

    fn usage_at(&self, tenant: &str, since: Option<i64>, now: i64) -> Result<TenantUsage> {
        calls::usage_at(self, tenant, since, now)
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
        events::insert_event(self, tenant, kind, subject, data, at)
    }

    fn events_after(
        &self,
        tenant: Option<&str>,
        after: u64,
        limit: u32,
    ) -> Result<Vec<EventRecord>> {
        events::events_after(self, tenant, after, limit)
    }

    fn latest_event_seq(&self) -> Result<u64> {
        events::latest_event_seq(self)
    }

    fn put_ticket(&self, ticket: &TicketRecord, now_ms: i64, max: u64) -> Result<bool> {
        tenants::put_ticket(self, ticket, now_ms, max)
    }

    fn take_ticket(&self, hash: &str, now_ms: i64) -> Result<Option<TicketRecord>> {
        tenants::take_ticket(self, hash, now_ms)
    }

    fn take_node_events(
        &self,
        node_id: &str,
        events: &[EventRecord],
    ) -> Result<(u64, Vec<EventRecord>)> {
        events::take_node_events(self, node_id, events)
    }

    fn prune_events(&self, before: i64, keep: u64) -> Result<u64> {
        events::prune_events(self, before, keep)
    }

    fn insert_webhook(&self, webhook: &WebhookRecord) -> Result<WebhookRecord> {
        events::insert_webhook(self, webhook)
    }

    fn list_webhooks(&self, tenant: Option<&str>) -> Result<Vec<WebhookRecord>> {
        events::list_webhooks(self, tenant)
    }

    fn delete_webhook(&self, tenant: &str, id: &str) -> Result<bool> {
        events::delete_webhook(self, tenant, id)
    }

    fn set_webhook_cursor(&self, id: &str, seq: u64) -> Result<()> {
        events::set_webhook_cursor(self, id, seq)
    }

    fn put_sandbox_times(&self, id: &str, times: &SandboxTimes) -> Result<()> {
        events::put_sandbox_times(self, id, times)
    }

    fn sandbox_times(&self, id: &str) -> Result<Option<SandboxTimes>> {
        events::sandbox_times(self, id)
    }

    // ---- snapshots ----

    fn insert_volume_snapshot(&self, snap: &VolumeSnapshotRecord) -> Result<()> {
        snapshots::insert_volume_snapshot(self, snap)
    }

    fn get_volume_snapshot(&self, tenant: &str, id: &str) -> Result<Option<VolumeSnapshotRecord>> {
        snapshots::get_volume_snapshot(self, tenant, id)
    }

    fn list_volume_snapshots(
        &self,
        tenant: &str,
        volume_id: &str,
    ) -> Result<Vec<VolumeSnapshotRecord>> {
        snapshots::list_volume_snapshots(self, tenant, volume_id)
    }

    fn insert_snapshot(&self, snap: &SnapshotRecord) -> Result<()> {
        snapshots::insert_snapshot(self, snap)
    }

    fn get_snapshot(&self, tenant: &str, id: &str) -> Result<Option<SnapshotRecord>> {
        snapshots::get_snapshot(self, tenant, id)
    }

    fn list_snapshots(&self, tenant: &str) -> Result<Vec<SnapshotRecord>> {
        snapshots::list_snapshots(self, tenant)
    }

    fn delete_snapshot(&self, tenant: &str, id: &str) -> Result<bool> {
        snapshots::delete_snapshot(self, tenant, id)
    }

    fn delete_volume_snapshot(&self, tenant: &str, id: &str) -> Result<bool> {
        snapshots::delete_volume_snapshot(self, tenant, id)
    }

    // ---- volumes ----

    fn insert_volume(&self, v: &VolumeRecord) -> Result<()> {
        volumes::insert_volume(self, v)
    }

    fn get_volume(&self, tenant: &str, id_or_name: &str) -> Result<Option<VolumeRecord>> {
        volumes::get_volume(self, tenant, id_or_name)
    }

    fn list_volumes(&self, tenant: &str) -> Result<Vec<VolumeRecord>> {
        volumes::list_volumes(self, tenant)
    }

    fn list_all_volumes(&self) -> Result<Vec<VolumeRecord>> {
        volumes::list_all_volumes(self)
    }

    fn host_volumes(&self, host: &str) -> Result<Vec<VolumeRecord>> {
        volumes::host_volumes(self, host)
    }

    fn delete_volume(&self, tenant: &str, id: &str) -> Result<bool> {
        volumes::delete_volume(self, tenant, id)
    }

    fn move_volume(
        &self,
        tenant: &str,
        id: &str,
        from: &str,
        to: &str,
        snapshots: &[VolumeSnapshotRecord],
    ) -> Result<bool> {
        volumes::move_volume(self, tenant, id, (from, to), snapshots)
    }

    // ---- secrets ----

    fn insert_secret(&self, s: &SecretRecord) -> Result<()> {
        secrets::insert_secret(self, s)
    }

    fn get_secret(&self, tenant: &str, name: &str) -> Result<Option<SecretRecord>> {
        secrets::get_secret(self, tenant, name)
    }

    fn list_secrets(&self, tenant: &str) -> Result<Vec<SecretRecord>> {
        secrets::list_secrets(self, tenant)
    }

    fn update_secret(&self, s: &SecretRecord) -> Result<bool> {
        secrets::update_secret(self, s)
    }

    fn delete_secret(&self, tenant: &str, name: &str) -> Result<bool> {
        secrets::delete_secret(self, tenant, name)
    }

    // ---- the fleet ----

    fn fleet_ca(&self) -> Result<Option<FleetCaRecord>> {
        fleet::fleet_ca(self)
    }

    fn put_fleet_ca_once(&self, ca: &FleetCaRecord) -> Result<FleetCaRecord> {
        fleet::put_fleet_ca_once(self, ca)
    }

    fn insert_join_token(&self, token: &JoinTokenRecord) -> Result<()> {
        fleet::insert_join_token(self, token)
    }

    fn join_node(&self, token_hash: &[u8], node: &NodeRecord, lease_ms: i64) -> Result<NodeRecord> {
        fleet::join_node(self, token_hash, node, lease_ms)
    }

    fn upsert_node(&self, node: &NodeRecord, lease_ms: i64) -> Result<NodeRecord> {
        fleet::upsert_node(self, node, lease_ms)
    }

    fn node_heartbeat(
        &self,
        id: &str,
        cert_sha256: &str,
        epoch: i64,
        report: &str,
        lease_ms: i64,
    ) -> Result<Option<NodeRecord>> {
        fleet::node_heartbeat(self, id, cert_sha256, epoch, report, lease_ms)
    }

    fn revive_node(&self, id: &str, lease_ms: i64) -> Result<Option<NodeRecord>> {
        fleet::revive_node(self, id, lease_ms)
    }

    fn expire_nodes(&self, max: u32) -> Result<Vec<NodeRecord>> {
        fleet::expire_nodes(self, max)
    }

    fn get_node(&self, id_or_name: &str) -> Result<Option<NodeRecord>> {
        fleet::get_node(self, id_or_name)
    }

    fn list_nodes(&self) -> Result<Vec<NodeRecord>> {
        fleet::list_nodes(self)
    }

    fn delete_node(&self, id: &str) -> Result<bool> {
        fleet::delete_node(self, id)
    }

    fn delete_node_with_volumes(&self, id: &str) -> Result<Option<Vec<VolumeRecord>>> {
        volumes::delete_node_with_volumes(self, id)
    }

    fn cordon_node(&self, id: &str, cordoned: bool) -> Result<bool> {
        fleet::cordon_node(self, id, cordoned)
    }

    fn clock_ms(&self) -> Result<i64> {
        Ok(fleet::clock_ms())
    }

    fn place(
        &self,
        p: &PlacementRecord,
        cap_slots: i64,
        cap_memory_mb: i64,
    ) -> Result<Option<PlacementRecord>> {
        placements::place(self, p, cap_slots, cap_memory_mb)
    }

    fn set_placed(&self, id: &str, sandbox_id: &str, view: &str) -> Result<bool> {
        placements::set_placed(self, id, sandbox_id, view)
    }

    fn set_placement_view(&self, sandbox_id: &str, view: &str) -> Result<()> {
        placements::set_placement_view(self, sandbox_id, view)
    }

    fn unplace(&self, id: &str) -> Result<Option<PlacementRecord>> {
        placements::unplace(self, id)
    }

    fn unplace_lost(&self, id: &str) -> Result<Option<PlacementRecord>> {
        placements::unplace_lost(self, id)
    }

    fn move_placement(
        &self,
        id: &str,
        from: (&str, i64, crate::PlacementState),
        into: &str,
        view: &str,
    ) -> Result<Option<PlacementRecord>> {
        placements::move_placement(self, id, from, into, view)
    }

    fn get_placement(&self, sandbox_id: &str) -> Result<Option<PlacementRecord>> {
        placements::get_placement(self, sandbox_id)
    }

    fn list_placements(
        &self,
        tenant: Option<&str>,
        node_id: Option<&str>,
    ) -> Result<Vec<PlacementRecord>> {
        placements::list_placements(self, tenant, node_id)
    }

    fn lose_placements(&self) -> Result<Vec<PlacementRecord>> {
        placements::lose_placements(self)
    }
}
