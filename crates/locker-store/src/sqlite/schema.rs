//! The database's tables, and the migrations that bring a file of any earlier Locker up to
//! this build's [`SCHEMA_VERSION`].
//!
//! Owns: the DDL and the `schema_version` table. The queries on the rows live in the
//! concern modules beside it. A migration that must rewrite rows does it in SQL, in its own
//! entry, which runs in the one transaction of [`migrate`]: a file is never half migrated.

use std::path::Path;

use locker_types::rfc3339;
use rusqlite::{params, Connection, TransactionBehavior};

use crate::error::{Result, StoreError};
use crate::model::now_unix;

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
    // 4: why a sandbox ended ("deleted", "expired", "failed: …"), for its tombstone.
    r#"
    ALTER TABLE sandboxes ADD COLUMN end_cause TEXT;
    "#,
    // 5: preview URLs: each sandbox's token (sandboxes of earlier releases get one here, from
    // SQLite's CSPRNG) and its public ports (a JSON array of numbers).
    r#"
    ALTER TABLE sandboxes ADD COLUMN preview_token TEXT NOT NULL DEFAULT '';
    ALTER TABLE sandboxes ADD COLUMN public_ports TEXT NOT NULL DEFAULT '[]';
    UPDATE sandboxes SET preview_token = 'lpt_' || lower(hex(randomblob(24)))
        WHERE preview_token = '';
    "#,
    // 6: cells of the code interpreter are recorded too (kind `code`). SQLite cannot change
    // a CHECK in place: the table is copied into a new one, its order (`seq`) kept.
    r#"
    CREATE TABLE calls_v6 (
        seq          INTEGER PRIMARY KEY,
        id           TEXT NOT NULL UNIQUE,
        tenant       TEXT NOT NULL,
        key_id       TEXT NOT NULL,
        kind         TEXT NOT NULL CHECK (kind IN ('exec','run','process','code')),
        sandbox_id   TEXT,
        volume_id    TEXT,
        created_unix INTEGER NOT NULL,
        cpu_ms       INTEGER NOT NULL,
        record       TEXT NOT NULL
    ) STRICT;
    INSERT INTO calls_v6 (seq, id, tenant, key_id, kind, sandbox_id, volume_id, created_unix,
            cpu_ms, record)
        SELECT seq, id, tenant, key_id, kind, sandbox_id, volume_id, created_unix, cpu_ms,
            record FROM calls;
    DROP TABLE calls;
    ALTER TABLE calls_v6 RENAME TO calls;
    CREATE INDEX calls_tenant ON calls(tenant, seq);
    CREATE INDEX calls_tenant_time ON calls(tenant, created_unix);
    CREATE INDEX calls_sandbox ON calls(sandbox_id, seq) WHERE sandbox_id IS NOT NULL;
    CREATE INDEX calls_volume ON calls(volume_id, seq) WHERE volume_id IS NOT NULL;
    "#,
    // Secrets: values sealed by the server (ChaCha20-Poly1305, the tenant and name as
    // associated data); the store never sees a clear value.
    r#"
    CREATE TABLE secrets (
        tenant       TEXT NOT NULL REFERENCES tenants(name),
        name         TEXT NOT NULL,
        hosts        TEXT NOT NULL,  -- JSON array of names
        env          TEXT NOT NULL,
        sealed       BLOB NOT NULL,
        created_at   TEXT NOT NULL,
        updated_at   TEXT NOT NULL,
        PRIMARY KEY (tenant, name)
    ) STRICT;
    "#,
    // Lifecycle events (an ever-increasing `seq`, never reused even after pruning),
    // webhooks with the last event each has had delivered (`cursor`), and each sandbox's
    // time split (active, idle, paused) with its histogram of gaps between calls.
    r#"
    CREATE TABLE events (
        seq      INTEGER PRIMARY KEY AUTOINCREMENT,
        tenant   TEXT NOT NULL,
        kind     TEXT NOT NULL,
        subject  TEXT NOT NULL,
        data     TEXT NOT NULL,
        at_unix  INTEGER NOT NULL
    ) STRICT;
    CREATE INDEX events_tenant ON events(tenant, seq);
    CREATE INDEX events_time ON events(at_unix);
    CREATE TABLE webhooks (
        id           TEXT PRIMARY KEY,
        tenant       TEXT NOT NULL REFERENCES tenants(name),
        url          TEXT NOT NULL,
        events       TEXT NOT NULL,
        secret       TEXT NOT NULL,
        created_unix INTEGER NOT NULL,
        cursor       INTEGER NOT NULL
    ) STRICT;
    CREATE INDEX webhooks_tenant ON webhooks(tenant);
    ALTER TABLE sandboxes ADD COLUMN active_ms INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN idle_ms INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN paused_ms INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN call_gaps TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE sandboxes ADD COLUMN call_gap_sum_ms INTEGER NOT NULL DEFAULT 0;
    "#,
    // Template builds: their state and record (JSON the server's template room owns), so
    // a restart can tell the builds it was running that they failed.
    r#"
    CREATE TABLE template_builds (
        id           TEXT PRIMARY KEY,
        tenant       TEXT NOT NULL,
        state        TEXT NOT NULL CHECK (state IN ('queued','running','succeeded','failed')),
        record       TEXT NOT NULL,
        created_unix INTEGER NOT NULL
    ) STRICT;
    CREATE INDEX template_builds_unfinished ON template_builds(state)
        WHERE state IN ('queued', 'running');
    "#,
    // The fleet (issue 25): its CA (key sealed), one-time join tokens (hashes), nodes.
    r#"
    CREATE TABLE fleet_ca (
        id          INTEGER PRIMARY KEY CHECK (id = 1),
        cert_pem    TEXT NOT NULL,
        key_sealed  BLOB NOT NULL,
        created_at  TEXT NOT NULL
    ) STRICT;
    CREATE TABLE join_tokens (
        id           TEXT PRIMARY KEY,
        token_hash   BLOB NOT NULL UNIQUE,
        created_at   TEXT NOT NULL,
        expires_unix INTEGER NOT NULL,
        used_unix    INTEGER,
        node_id      TEXT
    ) STRICT;
    CREATE TABLE nodes (
        id             TEXT PRIMARY KEY,
        name           TEXT NOT NULL UNIQUE,
        address        TEXT NOT NULL,
        cert_sha256    TEXT NOT NULL,
        cert_pem       TEXT NOT NULL,
        public_key     TEXT NOT NULL,
        epoch          INTEGER NOT NULL,
        state          TEXT NOT NULL CHECK (state IN ('ready','dead')),
        joined_at      TEXT NOT NULL,
        heartbeat_ms   INTEGER NOT NULL,
        lease_until_ms INTEGER NOT NULL,
        report         TEXT NOT NULL
    ) STRICT;
    "#,
    // Sandboxes on fleet nodes (issue 25): what each node has reserved, and where each
    // sandbox placed on a node lives.
    r#"
    ALTER TABLE nodes ADD COLUMN reserved_memory_mb INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE nodes ADD COLUMN reserved_slots INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE placements (
        id          TEXT PRIMARY KEY,
        sandbox_id  TEXT UNIQUE,
        tenant      TEXT NOT NULL,
        node_id     TEXT NOT NULL,
        epoch       INTEGER NOT NULL,
        memory_mb   INTEGER NOT NULL,
        state       TEXT NOT NULL CHECK (state IN ('starting','placed','lost')),
        created_ms  INTEGER NOT NULL,
        view        TEXT NOT NULL
    ) STRICT;
    CREATE INDEX placements_node ON placements(node_id);
    CREATE INDEX placements_tenant ON placements(tenant);
    "#,
    // Control replicas sharing a database (issue 25): each server's engine adopts only
    // the machines it runs; nodes' events taken into the fleet's stream up to a cursor.
    r#"
    ALTER TABLE sandboxes ADD COLUMN host TEXT NOT NULL DEFAULT '';
    ALTER TABLE volumes ADD COLUMN host TEXT NOT NULL DEFAULT '';
    ALTER TABLE nodes ADD COLUMN events_seq INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX sandboxes_host_live ON sandboxes(host) WHERE deleted_unix IS NULL;
    "#,
    // Terminal tickets in the store, so any replica redeems what another minted.
    r#"
    CREATE TABLE pty_tickets (
        hash        TEXT PRIMARY KEY,
        tenant      TEXT NOT NULL,
        key_id      TEXT NOT NULL,
        sandbox_id  TEXT NOT NULL,
        expires_ms  INTEGER NOT NULL
    ) STRICT;
    CREATE INDEX pty_tickets_expiry ON pty_tickets(expires_ms);
    "#,
    // Cordoned fleet nodes: placement puts nothing new on them.
    r#"
    ALTER TABLE nodes ADD COLUMN cordoned INTEGER NOT NULL DEFAULT 0;
    "#,
];

/// The schema version this build writes (the number of migrations it knows).
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Applies the missing migrations in one `IMMEDIATE` transaction, so two processes
/// opening a new file at once cannot both migrate it.
pub(super) fn migrate(conn: &mut Connection, path: &Path) -> Result<()> {
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
