//! The state of a Locker server: tenants, API keys, sandboxes, call records, usage.
//!
//! This room owns what must survive a restart and what the server answers from its
//! database: who a Bearer key belongs to, which sandboxes exist and in which state, the
//! record of every call. It owns no machines and no files of them (`locker-runtime` does),
//! no HTTP (`locker-server` does).
//!
//! The [`Store`] trait is the whole contract. Two stores keep it: [`SqliteStore`] (one file
//! in the data dir: the default, one host) and [`PgStore`] (a Postgres database that several
//! `locker serve` processes on several hosts can share, `--database postgres://…`); the
//! same behaviour tests run on both, and [`copy_sqlite_to_postgres`] moves an install from
//! the first to the second. Its methods are
//! synchronous: reads are fast enough to call from a request handler (authentication is
//! answered from memory), writes belong in `tokio::task::spawn_blocking` when they sit on a
//! hot path. Call records never do: [`CallRecorder`] queues them without waiting and
//! writes them in batches in the background.
//!
//! Rules every implementation keeps:
//! - Clear API keys are never stored: only their SHA-256.
//! - Call records hold no output bodies and no env values.
//! - A tenant's reads never return another tenant's rows; the server answers those 404.
//! - Deleting a sandbox is a soft delete: its row stays (state `stopped`, env wiped) so
//!   usage can still count its seconds, but no sandbox read returns it again.

#![forbid(unsafe_code)]

mod codec;
mod error;
mod fleet;
mod model;
mod pg;
mod random;
mod recorder;
mod sqlite;

pub use error::{Result, StoreError};
pub use fleet::{
    validate_node_name, FleetCaRecord, JoinTokenRecord, NodeRecord, NodeState, PlacementRecord,
    PlacementState,
};
pub use model::{
    now_unix, parse_rfc3339, strip_output, validate_tenant_name, CallKind, CallRecord, KeyInfo,
    Principal, SandboxRecord, SandboxState, SnapshotRecord, TenantUsage, DEFAULT_TENANT,
};
pub use model::{validate_secret_name, SecretMisuse, SecretRecord, SecretUse};
pub use model::{validate_volume_name, VolumeRecord, VolumeSnapshotRecord};
pub use model::{CallOutcome, CallPage, CallQuery, SandboxPage, SandboxQuery};
pub use model::{EventRecord, SandboxTimes, TicketRecord, WebhookRecord};
pub use pg::copy::{copy_sqlite_to_postgres, CopyReport};
pub use pg::{is_postgres_url, redact_url, PgStore, AUTH_CACHE_TTL, PG_SCHEMA_VERSION, POOL_SIZE};
pub use random::{fill_random, new_id, new_preview_token, API_KEY_PREFIX, PREVIEW_TOKEN_PREFIX};
pub use recorder::{CallRecorder, RecorderStats, BATCH_MAX, BATCH_WINDOW, QUEUE_CAPACITY};
pub use sqlite::{SqliteStore, SCHEMA_VERSION};

/// The largest page of call records one [`Store::list_calls`] returns.
pub const MAX_CALLS_LIMIT: u32 = 1000;
/// How long an ended sandbox's id still answers with why it ended (its tombstone): 7 days.
pub const TOMBSTONE_S: i64 = 7 * 24 * 3600;

/// Why and when a sandbox ended, answered for [`TOMBSTONE_S`] after its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tombstone {
    /// RFC 3339 UTC.
    pub ended_at: String,
    /// `deleted`, `expired`, or `failed: <reason>`.
    pub cause: String,
}

/// The page size of [`Store::list_calls`] when the caller gives none.
pub const DEFAULT_CALLS_LIMIT: u32 = 100;

/// Everything the server keeps in its database. Object safe: the server holds an
/// `Arc<dyn Store>`.
///
/// Times passed in (`now`, `at`, `since`) are seconds since the Unix epoch; the methods
/// without `_at` use the clock.
pub trait Store: Send + Sync {
    // ---- tenants and keys ----

    /// Creates the tenant if it does not exist yet (used for `default` at start).
    fn ensure_tenant(&self, name: &str) -> Result<()>;

    /// Creates a tenant; `Conflict` if it exists, `Invalid` if the name is not
    /// `[a-z0-9][a-z0-9-]{0,62}`.
    fn create_tenant(&self, name: &str) -> Result<()>;

    /// Whether the tenant exists.
    fn tenant_exists(&self, name: &str) -> Result<bool>;

    /// Every tenant's name, sorted.
    fn list_tenants(&self) -> Result<Vec<String>>;

    /// Makes a new key for the tenant and returns it with its clear text (`lk_…`), which
    /// exists nowhere else afterwards: only its hash is stored. `NotFound` if the tenant
    /// does not exist.
    fn create_key(&self, tenant: &str) -> Result<(KeyInfo, String)>;

    /// Registers a key chosen outside (`LOCKER_API_KEY`). Idempotent: the same key for
    /// the same tenant returns the existing [`KeyInfo`]. `Conflict` if the key belongs
    /// to another tenant or was revoked (a revoked key stays revoked, also across
    /// restarts); `Invalid` if it is empty, longer than 1024 bytes, or holds anything but
    /// printable ASCII without spaces.
    fn add_key_with_secret(&self, tenant: &str, clear_key: &str) -> Result<KeyInfo>;

    /// Who a Bearer key belongs to; `None` for an unknown or revoked key. A known key is
    /// answered from memory, without SQL.
    fn authenticate(&self, clear_key: &str) -> Result<Option<Principal>>;

    /// Revokes a key at once (also in the authentication cache). `false` if no active
    /// key has that id.
    fn revoke_key(&self, key_id: &str) -> Result<bool>;

    /// The tenant's active (not revoked) keys, oldest first.
    fn list_keys(&self, tenant: &str) -> Result<Vec<KeyInfo>>;

    // ---- sandboxes ----

    /// Stores a new sandbox. `Conflict` if its id exists (deleted ones included),
    /// `NotFound` if its tenant does not exist, `Invalid` if a time is not RFC 3339.
    fn insert_sandbox(&self, sandbox: &SandboxRecord) -> Result<()>;

    /// The tenant's sandbox; `None` if it does not exist, was deleted, or belongs to
    /// another tenant.
    fn get_sandbox(&self, tenant: &str, id: &str) -> Result<Option<SandboxRecord>>;

    /// A sandbox of any tenant (for the lifecycle tasks); `None` if missing or deleted.
    fn get_sandbox_any(&self, id: &str) -> Result<Option<SandboxRecord>>;

    /// The tenant's sandboxes that were not deleted, oldest first, optionally only those
    /// in `state` and only those whose metadata holds every `(key, value)` pair given.
    fn list_sandboxes(
        &self,
        tenant: &str,
        state: Option<SandboxState>,
        metadata: &[(String, String)],
    ) -> Result<Vec<SandboxRecord>>;

    /// A page of the tenant's sandboxes (see [`SandboxQuery`]) and how many match in all:
    /// what a list of a thousand sandboxes shows fifty at a time.
    fn list_sandboxes_page(&self, tenant: &str, q: &SandboxQuery) -> Result<SandboxPage>;

    /// Replaces a sandbox's record (matched by id and tenant). Moving it to `stopped` or
    /// `failed` marks the time it ended, for usage. `NotFound` if missing or deleted.
    fn update_sandbox(&self, sandbox: &SandboxRecord) -> Result<()>;

    /// Sets a sandbox's state; `stopped`/`failed` mark the time it ended as `now`.
    fn set_sandbox_state_at(&self, id: &str, state: SandboxState, now: i64) -> Result<()>;

    /// [`Store::set_sandbox_state_at`] with the clock's time.
    fn set_sandbox_state(&self, id: &str, state: SandboxState) -> Result<()> {
        self.set_sandbox_state_at(id, state, now_unix())
    }

    /// Records a call at time `at` for the idle policy (never moves `last_active_at`
    /// back). `NotFound` if missing or deleted.
    fn touch_sandbox(&self, id: &str, at: i64) -> Result<()>;

    /// Soft-deletes a sandbox: state `stopped`, ended at `now` (unless it ended before),
    /// env wiped; invisible to every sandbox read afterwards, still counted by usage.
    /// `false` if it was missing or already deleted.
    fn delete_sandbox_at(&self, id: &str, now: i64) -> Result<bool>;

    /// [`Store::delete_sandbox_at`] that also records why the sandbox ended (`deleted`,
    /// `expired`, `failed: …`) for its tombstone.
    fn end_sandbox_at(&self, id: &str, now: i64, cause: &str) -> Result<bool>;

    /// Why the tenant's sandbox `id` ended, if it ended less than [`TOMBSTONE_S`] before
    /// `now`; older ends answer `None`, like an id that never existed.
    fn tombstone_at(&self, tenant: &str, id: &str, now: i64) -> Result<Option<Tombstone>>;

    /// Removes sandbox `id`'s row altogether: a sandbox that left this server for another
    /// node (a drain) did not end, and one that comes back is recorded anew. `false` if
    /// there was none.
    fn forget_sandbox(&self, id: &str) -> Result<bool>;

    /// [`Store::delete_sandbox_at`] with the clock's time.
    fn delete_sandbox(&self, id: &str) -> Result<bool> {
        self.delete_sandbox_at(id, now_unix())
    }

    /// Every tenant's sandboxes whose machine may exist (`starting`, `running`,
    /// `paused`), oldest first: what the server adopts or cleans up after a restart.
    fn list_live_sandboxes(&self) -> Result<Vec<SandboxRecord>>;

    /// The live sandboxes whose machines the server `host` runs, oldest first: what it
    /// adopts after a restart. Live rows of no host (written before host ids) become
    /// `host`'s first, in the same transaction, so exactly one server takes them.
    fn host_sandboxes(&self, host: &str) -> Result<Vec<SandboxRecord>>;

    /// Whether this process leads the fleet (`FLEET.md` §4.1: runs the singletons, the lease
    /// sweeper and the reconciler), taking the leadership when nobody holds it. Asked again
    /// before each round of that work: a leader whose session ended (its connection broke)
    /// hears `false` or an error, and another replica takes over. SQLite: always (one
    /// server per database).
    fn lead(&self) -> Result<bool>;

    /// The tenant's live sandboxes (`starting`, `running` or `paused`: each holds a
    /// machine), for the "running sandboxes" quota.
    fn count_running(&self, tenant: &str) -> Result<u64>;

    /// The memory (MiB) the tenant's live sandboxes were given, for the memory quota.
    fn sum_memory_mb(&self, tenant: &str) -> Result<u64>;

    /// The disk (MiB) the tenant holds, for the disk quota: its live sandboxes' `disk_mb`
    /// plus its volumes' `size_mb`.
    fn sum_disk_mb(&self, tenant: &str) -> Result<u64>;

    /// Ids of the sandboxes (any tenant, any state, not deleted) whose `expires_at` is at
    /// or before `now`: the reaper destroys them.
    fn expired_sandboxes(&self, now: i64) -> Result<Vec<String>>;

    /// Ids of running sandboxes with an idle timeout and no call for that long at `now`:
    /// the lifecycle task pauses them.
    fn idle_sandboxes(&self, now: i64) -> Result<Vec<String>>;

    // ---- snapshots ----

    /// Stores a snapshot's record (Conflict if the id exists).
    fn insert_snapshot(&self, snapshot: &SnapshotRecord) -> Result<()>;

    /// The tenant's snapshot `id` (None for another tenant's).
    fn get_snapshot(&self, tenant: &str, id: &str) -> Result<Option<SnapshotRecord>>;

    /// The tenant's snapshots, newest first.
    fn list_snapshots(&self, tenant: &str) -> Result<Vec<SnapshotRecord>>;

    /// Removes the record; false if the tenant has no such snapshot.
    fn delete_snapshot(&self, tenant: &str, id: &str) -> Result<bool>;

    // ---- volumes ----

    /// Stores a new volume. `Conflict` if the tenant already has a volume of that name (or
    /// the id exists), `Invalid` for a bad name, `NotFound` if the tenant does not exist.
    fn insert_volume(&self, volume: &VolumeRecord) -> Result<()>;

    /// The tenant's volume whose id, or else whose name, is `id_or_name`; `None` for
    /// another tenant's.
    fn get_volume(&self, tenant: &str, id_or_name: &str) -> Result<Option<VolumeRecord>>;

    /// The tenant's volumes, oldest first.
    fn list_volumes(&self, tenant: &str) -> Result<Vec<VolumeRecord>>;

    /// Every tenant's volumes, oldest first.
    fn list_all_volumes(&self) -> Result<Vec<VolumeRecord>>;

    /// The volumes whose files the server `host` holds (what it opens at start), oldest
    /// first; rows of no host (from before host ids) become `host`'s first.
    fn host_volumes(&self, host: &str) -> Result<Vec<VolumeRecord>>;

    /// Removes a volume's record and the records of its snapshots, in one transaction.
    /// `false` if the tenant has no such volume.
    fn delete_volume(&self, tenant: &str, id: &str) -> Result<bool>;

    /// Moves a volume's home from server `from` to server `to` (`locker volume move`), in
    /// one transaction: its `host` becomes `to` only while it is still `from`, and its
    /// snapshots' records become `snapshots` (their files' paths on `to`). `false`, with
    /// nothing changed, if the tenant has no such volume or its host is not `from`.
    fn move_volume(
        &self,
        tenant: &str,
        id: &str,
        from: &str,
        to: &str,
        snapshots: &[VolumeSnapshotRecord],
    ) -> Result<bool>;

    /// Stores a volume snapshot's record (`Conflict` if the id exists).
    fn insert_volume_snapshot(&self, snapshot: &VolumeSnapshotRecord) -> Result<()>;

    /// The tenant's volume snapshot `id` (`None` for another tenant's).
    fn get_volume_snapshot(&self, tenant: &str, id: &str) -> Result<Option<VolumeSnapshotRecord>>;

    /// The tenant's snapshots of one volume, newest first.
    fn list_volume_snapshots(
        &self,
        tenant: &str,
        volume_id: &str,
    ) -> Result<Vec<VolumeSnapshotRecord>>;

    /// Removes a volume snapshot's record; false if the tenant has no such snapshot.
    fn delete_volume_snapshot(&self, tenant: &str, id: &str) -> Result<bool>;

    // ---- template builds ----

    /// Stores (or replaces) template build `id` of `tenant`: its state (`queued`,
    /// `running`, `succeeded`, `failed`) and its record, JSON the server owns.
    fn put_template_build(&self, id: &str, tenant: &str, state: &str, record: &str) -> Result<()>;

    /// The record of the tenant's build `id` (`None` for another tenant's).
    fn get_template_build(&self, tenant: &str, id: &str) -> Result<Option<String>>;

    /// `(tenant, record)` of every build still queued or running, oldest first (at start,
    /// these are the builds a stopped server left unfinished).
    fn unfinished_template_builds(&self) -> Result<Vec<(String, String)>>;

    /// The records of the tenant's `limit` newest builds, newest first (the dashboard's
    /// list of builds).
    fn list_template_builds(&self, tenant: &str, limit: u32) -> Result<Vec<String>>;

    // ---- call records and usage ----

    /// Stores call records, all in one transaction (all or none). Output bodies are
    /// stripped again here, whatever the caller passed. `Conflict` on a duplicate id.
    fn insert_calls(&self, calls: &[CallRecord]) -> Result<()>;

    /// The tenant's call records, newest first, optionally of one sandbox and/or one
    /// volume. `limit`: default [`DEFAULT_CALLS_LIMIT`], clamped to
    /// 1..=[`MAX_CALLS_LIMIT`].
    fn list_calls(
        &self,
        tenant: &str,
        sandbox_id: Option<&str>,
        volume_id: Option<&str>,
        limit: Option<u32>,
    ) -> Result<Vec<CallRecord>>;

    /// One page of the tenant's call records, newest first, that match every filter of
    /// `q`; `next_cursor` (pass it as [`CallQuery::before`]) when older ones may follow.
    /// Keyed on the insertion order, so a page never repeats or skips a record whatever
    /// is written meanwhile.
    fn list_calls_page(&self, tenant: &str, q: &CallQuery) -> Result<CallPage>;

    /// The tenant's totals from `since` (or from the beginning) up to `now`:
    /// - `cpu_ms`, `runs`, `execs` (execs and background processes): from the call
    ///   records created at or after `since`;
    /// - `sandbox_seconds`: for every sandbox of the tenant, deleted ones included,
    ///   `min(now, ended) - max(created, since)` when positive, summed.
    fn usage_at(&self, tenant: &str, since: Option<i64>, now: i64) -> Result<TenantUsage>;

    // ---- lifecycle events and webhooks ----

    /// Appends an event; returns its `seq`, greater than every `seq` before it.
    fn insert_event(
        &self,
        tenant: &str,
        kind: &str,
        subject: &str,
        data: &str,
        at: i64,
    ) -> Result<u64>;

    /// Events after `after` (exclusive) in `seq` order, of `tenant` (or of all tenants),
    /// at most `limit`.
    fn events_after(
        &self,
        tenant: Option<&str>,
        after: u64,
        limit: u32,
    ) -> Result<Vec<EventRecord>>;

    /// Takes a fleet node's own events into this store's stream, exactly once: those after
    /// the node's cursor (its `seq`s, kept on its row), in their order, each stored with a
    /// `seq` of this store, and the cursor moved, in one transaction. Returns the cursor and
    /// the events as stored. `NotFound` for an unknown node.
    fn take_node_events(
        &self,
        node_id: &str,
        events: &[EventRecord],
    ) -> Result<(u64, Vec<EventRecord>)>;

    /// Stores a terminal ticket unless `max` live ones are outstanding (those expired at
    /// `now_ms` are removed first): `false` when full. One transaction.
    fn put_ticket(&self, ticket: &TicketRecord, now_ms: i64, max: u64) -> Result<bool>;

    /// Takes the ticket whose hash is `hash`: it is removed whatever follows, and returned
    /// only if it is still live at `now_ms`. Each ticket is taken once, by one server.
    fn take_ticket(&self, hash: &str, now_ms: i64) -> Result<Option<TicketRecord>>;

    /// The newest event's `seq` ever stored (pruned ones included); 0 if none.
    fn latest_event_seq(&self) -> Result<u64>;

    /// Removes events older than `before` and all but the newest `keep`; returns how many.
    fn prune_events(&self, before: i64, keep: u64) -> Result<u64>;

    /// Stores a webhook whose cursor is the newest event's `seq` (it gets events from now
    /// on), atomically with respect to [`Store::insert_event`]; returns it as stored.
    fn insert_webhook(&self, webhook: &WebhookRecord) -> Result<WebhookRecord>;

    /// The tenant's webhooks (or every tenant's), oldest first.
    fn list_webhooks(&self, tenant: Option<&str>) -> Result<Vec<WebhookRecord>>;

    /// Removes the tenant's webhook; `false` if it has none of that id.
    fn delete_webhook(&self, tenant: &str, id: &str) -> Result<bool>;

    /// Moves a webhook's cursor forward to `seq` (never back).
    fn set_webhook_cursor(&self, id: &str, seq: u64) -> Result<()>;

    /// Persists a sandbox's time split (deleted ones included: their figures count).
    fn put_sandbox_times(&self, id: &str, times: &SandboxTimes) -> Result<()>;

    /// A sandbox's persisted time split; `None` if there is no such sandbox.
    fn sandbox_times(&self, id: &str) -> Result<Option<SandboxTimes>>;

    /// [`Store::usage_at`] up to the clock's time.
    fn usage(&self, tenant: &str, since: Option<i64>) -> Result<TenantUsage> {
        self.usage_at(tenant, since, now_unix())
    }

    // ---- secrets (sealed values only) ----

    /// Adds a secret; `Conflict` when the tenant has one by that name.
    fn insert_secret(&self, secret: &SecretRecord) -> Result<()>;

    /// The tenant's secret `name`.
    fn get_secret(&self, tenant: &str, name: &str) -> Result<Option<SecretRecord>>;

    /// The tenant's secrets, by name.
    fn list_secrets(&self, tenant: &str) -> Result<Vec<SecretRecord>>;

    /// Replaces a secret's hosts, env, sealed value and `updated_at`; `false` if none.
    fn update_secret(&self, secret: &SecretRecord) -> Result<bool>;

    /// Deletes a secret; `false` if none.
    fn delete_secret(&self, tenant: &str, name: &str) -> Result<bool>;

    // ---- the fleet: its CA, join tokens, nodes (see `fleet`) ----

    /// The fleet's CA, if one was made.
    fn fleet_ca(&self) -> Result<Option<FleetCaRecord>>;

    /// Stores `ca` unless a CA exists, and returns the one stored: two replicas making the
    /// first CA at once both end up with the same one.
    fn put_fleet_ca_once(&self, ca: &FleetCaRecord) -> Result<FleetCaRecord>;

    /// Stores a new join token (its hash).
    fn insert_join_token(&self, token: &JoinTokenRecord) -> Result<()>;

    /// Redeems the token whose SHA-256 is `token_hash` for `node` and inserts the node, in
    /// one transaction; its `heartbeat_ms` and `lease_until_ms` are set from the store's
    /// clock (`lease_ms` from now). `NotFound` (saying why) if the token is unknown, used or
    /// expired; `Conflict` if the node's name is taken (the token stays unused). A token
    /// already redeemed by a node with the same `public_key`, before it expires, returns
    /// that node as it is (a retried join).
    fn join_node(&self, token_hash: &[u8], node: &NodeRecord, lease_ms: i64) -> Result<NodeRecord>;

    /// Registers a node that joins without a token: a server's own in-process node
    /// (`--node local`, `cert_sha256` `local`: it has no certificate and calls no fleet
    /// route). A new id is inserted (lease `lease_ms` from now); an id already there keeps
    /// its row (epoch, state) with `name` and `address` updated; `Conflict` if the name is
    /// another node's, or the id is a node that joined with a certificate.
    fn upsert_node(&self, node: &NodeRecord, lease_ms: i64) -> Result<NodeRecord>;

    /// Records a heartbeat of node `id`, holding the certificate `cert_sha256`, at `epoch`:
    /// its report, and its lease renewed to `lease_ms` from now. `None` (nothing written) if
    /// the node is unknown, holds another certificate, is dead, or is at another epoch: one
    /// statement either way, so a heartbeat costs one round trip.
    fn node_heartbeat(
        &self,
        id: &str,
        cert_sha256: &str,
        epoch: i64,
        report: &str,
        lease_ms: i64,
    ) -> Result<Option<NodeRecord>>;

    /// Brings a dead node back (state `ready`, its current epoch, lease `lease_ms` from
    /// now); `None` if it is unknown or not dead.
    fn revive_node(&self, id: &str, lease_ms: i64) -> Result<Option<NodeRecord>>;

    /// Declares dead at most `max` ready nodes whose lease ran out (oldest lease first):
    /// state `dead`, epoch + 1. Returns them as they are now.
    fn expire_nodes(&self, max: u32) -> Result<Vec<NodeRecord>>;

    /// The node with this id or name.
    fn get_node(&self, id_or_name: &str) -> Result<Option<NodeRecord>>;

    /// Every node, by name.
    fn list_nodes(&self) -> Result<Vec<NodeRecord>>;

    /// Removes a node from the fleet (its certificate is refused from then on); `false` if
    /// none has that id.
    fn delete_node(&self, id: &str) -> Result<bool>;

    /// [`Store::delete_node`] and, in the same transaction, the records of the volumes
    /// whose host it is (and their snapshots'): a joined node's volumes live on its disk,
    /// which nothing of the fleet reaches once it is removed. The volumes removed; `None`
    /// if no node has that id.
    fn delete_node_with_volumes(&self, id: &str) -> Result<Option<Vec<VolumeRecord>>>;

    /// Cordons node `id` (no new placements) or lifts its cordon; `false` if none has
    /// that id.
    fn cordon_node(&self, id: &str, cordoned: bool) -> Result<bool>;

    /// The store's clock, in milliseconds since the Unix epoch (Postgres: the database's).
    fn clock_ms(&self) -> Result<i64>;

    // ---- sandboxes placed on fleet nodes (see `fleet::PlacementRecord`) ----

    /// Reserves `p.memory_mb` and one slot on node `p.node_id` at epoch `p.epoch`, if it is
    /// ready there and the reservations stay within `cap_slots` and `cap_memory_mb`, and
    /// inserts `p`: one transaction. `None` (nothing written) when the node is full, dead
    /// or at another epoch: choose again. Its `created_ms` is the store's clock.
    fn place(
        &self,
        p: &PlacementRecord,
        cap_slots: i64,
        cap_memory_mb: i64,
    ) -> Result<Option<PlacementRecord>>;

    /// The node made the sandbox of placement `id`: its id and view, and `created_ms` the
    /// store's clock now; `false` if the placement is gone or no longer `starting`.
    fn set_placed(&self, id: &str, sandbox_id: &str, view: &str) -> Result<bool>;

    /// The sandbox's view, as its node last answered it.
    fn set_placement_view(&self, sandbox_id: &str, view: &str) -> Result<()>;

    /// Removes placement `id` and gives its reservation back to its node (unless it was
    /// lost: that went with the node's old epoch), in one transaction; the row removed.
    fn unplace(&self, id: &str) -> Result<Option<PlacementRecord>>;

    /// Removes placement `id` only while it is `lost` (a restart elsewhere that switched it
    /// first keeps it); the row removed, `None` when it was not lost or is gone.
    fn unplace_lost(&self, id: &str) -> Result<Option<PlacementRecord>>;

    /// Moves sandbox `id`, in state `from_state` on node `from_node` (at `from_epoch`), onto
    /// the node of placement `into` (a `starting` one reserved there for the move), placed,
    /// with `view` as the new node answered it: `into` goes (its reservation becomes
    /// `id`'s), `from_node` gets `id`'s reservation back (a lost one went with the node's
    /// old epoch), in one transaction. `placed` for a drain, `lost` for a restart elsewhere
    /// after a node's death. `None` (nothing written) when `id` is no longer so (deleted,
    /// lost, moved) or `into` is gone.
    fn move_placement(
        &self,
        id: &str,
        from: (&str, i64, PlacementState),
        into: &str,
        view: &str,
    ) -> Result<Option<PlacementRecord>>;

    /// The placement of sandbox `sandbox_id`.
    fn get_placement(&self, sandbox_id: &str) -> Result<Option<PlacementRecord>>;

    /// Placements, of one tenant and/or one node, oldest first.
    fn list_placements(
        &self,
        tenant: Option<&str>,
        node_id: Option<&str>,
    ) -> Result<Vec<PlacementRecord>>;

    /// Marks `lost` every placement whose node moved to a later epoch (declared dead) or was
    /// removed; returns them.
    fn lose_placements(&self) -> Result<Vec<PlacementRecord>>;
}
