//! `locker db migrate --to postgres://…`: copies a one-host install's SQLite database into an
//! empty Postgres database, every table and every row, in one transaction.
//!
//! Owns: the list of tables and columns that are copied, and the checks around the copy.
//! It reads SQLite's rows as they are stored (not through the records), so nothing that a
//! record type does not show (a deleted sandbox's row, a revoked key, a tombstone's cause,
//! pruned events' place in the sequence) is lost.
//!
//! Rules: the source is brought to this build's schema first (as a start of `locker serve`
//! would); the target's schema is made by [`PgStore::connect`]; the target must hold no
//! Locker rows (a second run refuses, so a run is never applied twice); the copy, the
//! sequences' positions and the per-table count checks are one transaction, so a failure
//! leaves the target as empty as it was.

use std::path::Path;

use postgres::types::ToSql;
use rusqlite::types::Value;

use super::calls::CALLS_LOCK;
use super::events::EVENTS_LOCK;
use super::PgStore;
use crate::error::{Result, StoreError};
use crate::SqliteStore;

/// The kind of a copied column (SQLite's STRICT types).
#[derive(Clone, Copy)]
enum Kind {
    Text,
    Int,
    Real,
    Blob,
}

use Kind::{Blob, Int, Real, Text};

/// A table's copied columns and their kinds.
type Columns = &'static [(&'static str, Kind)];

/// Every table the store has, in an order that satisfies the foreign keys, with the
/// columns both databases share.
const TABLES: &[(&str, Columns)] = &[
    (
        "tenants",
        &[("name", Text), ("created_at", Text), ("created_unix", Int)],
    ),
    (
        "api_keys",
        &[
            ("key_id", Text),
            ("tenant", Text),
            ("key_hash", Blob),
            ("created_at", Text),
            ("revoked_unix", Int),
        ],
    ),
    (
        "sandboxes",
        &[
            ("id", Text),
            ("tenant", Text),
            ("state", Text),
            ("template", Text),
            ("template_digest", Text),
            ("runtime", Text),
            ("cpus", Real),
            ("memory_mb", Int),
            ("disk_mb", Int),
            ("network", Text),
            ("volumes", Text),
            ("metadata", Text),
            ("env", Text),
            ("ttl_s", Int),
            ("idle_timeout_s", Int),
            ("created_at", Text),
            ("expires_at", Text),
            ("last_active_at", Text),
            ("machine_dir", Text),
            ("cpu_ms", Int),
            ("peak_memory_bytes", Int),
            ("created_unix", Int),
            ("expires_unix", Int),
            ("last_active_unix", Int),
            ("ended_unix", Int),
            ("deleted_unix", Int),
            ("end_cause", Text),
            ("preview_token", Text),
            ("public_ports", Text),
            ("active_ms", Int),
            ("idle_ms", Int),
            ("paused_ms", Int),
            ("call_gaps", Text),
            ("call_gap_sum_ms", Int),
            ("host", Text),
        ],
    ),
    (
        "calls",
        &[
            ("seq", Int),
            ("id", Text),
            ("tenant", Text),
            ("key_id", Text),
            ("kind", Text),
            ("sandbox_id", Text),
            ("volume_id", Text),
            ("created_unix", Int),
            ("cpu_ms", Int),
            ("record", Text),
        ],
    ),
    (
        "snapshots",
        &[
            ("id", Text),
            ("tenant", Text),
            ("sandbox_id", Text),
            ("created_unix", Int),
            ("record", Text),
        ],
    ),
    (
        "volumes",
        &[
            ("id", Text),
            ("tenant", Text),
            ("name", Text),
            ("size_mb", Int),
            ("created_at", Text),
            ("created_unix", Int),
            ("host", Text),
        ],
    ),
    (
        "volume_snapshots",
        &[
            ("id", Text),
            ("tenant", Text),
            ("volume_id", Text),
            ("created_unix", Int),
            ("record", Text),
        ],
    ),
    (
        "secrets",
        &[
            ("tenant", Text),
            ("name", Text),
            ("hosts", Text),
            ("env", Text),
            ("sealed", Blob),
            ("created_at", Text),
            ("updated_at", Text),
        ],
    ),
    (
        "events",
        &[
            ("seq", Int),
            ("tenant", Text),
            ("kind", Text),
            ("subject", Text),
            ("data", Text),
            ("at_unix", Int),
        ],
    ),
    (
        "webhooks",
        &[
            ("id", Text),
            ("tenant", Text),
            ("url", Text),
            ("events", Text),
            ("secret", Text),
            ("created_unix", Int),
            ("cursor", Int),
        ],
    ),
    (
        "template_builds",
        &[
            ("id", Text),
            ("tenant", Text),
            ("state", Text),
            ("record", Text),
            ("created_unix", Int),
        ],
    ),
    (
        "fleet_ca",
        &[
            ("id", Int),
            ("cert_pem", Text),
            ("key_sealed", Blob),
            ("created_at", Text),
        ],
    ),
    (
        "join_tokens",
        &[
            ("id", Text),
            ("token_hash", Blob),
            ("created_at", Text),
            ("expires_unix", Int),
            ("used_unix", Int),
            ("node_id", Text),
        ],
    ),
    (
        "nodes",
        &[
            ("id", Text),
            ("name", Text),
            ("address", Text),
            ("cert_sha256", Text),
            ("cert_pem", Text),
            ("public_key", Text),
            ("epoch", Int),
            ("state", Text),
            ("joined_at", Text),
            ("heartbeat_ms", Int),
            ("lease_until_ms", Int),
            ("report", Text),
            ("reserved_memory_mb", Int),
            ("reserved_slots", Int),
            ("cordoned", Int),
            ("events_seq", Int),
        ],
    ),
    (
        "placements",
        &[
            ("id", Text),
            ("sandbox_id", Text),
            ("tenant", Text),
            ("node_id", Text),
            ("epoch", Int),
            ("memory_mb", Int),
            ("state", Text),
            ("created_ms", Int),
            ("view", Text),
        ],
    ),
    (
        "pty_tickets",
        &[
            ("hash", Text),
            ("tenant", Text),
            ("key_id", Text),
            ("sandbox_id", Text),
            ("expires_ms", Int),
        ],
    ),
];

/// One copied value, typed for Postgres (a NULL keeps its column's type).
enum Cell {
    Text(Option<String>),
    Int(Option<i64>),
    Real(Option<f64>),
    Blob(Option<Vec<u8>>),
}

impl Cell {
    fn of(table: &str, col: &str, kind: Kind, v: Value) -> Result<Cell> {
        let bad = |v: &Value| {
            StoreError::Corrupt(format!(
                "{table}.{col} holds {:?}, not the column's type",
                v.data_type()
            ))
        };
        Ok(match (kind, v) {
            (Text, Value::Null) => Cell::Text(None),
            (Int, Value::Null) => Cell::Int(None),
            (Real, Value::Null) => Cell::Real(None),
            (Blob, Value::Null) => Cell::Blob(None),
            (Text, Value::Text(s)) => Cell::Text(Some(s)),
            (Int, Value::Integer(i)) => Cell::Int(Some(i)),
            (Real, Value::Real(f)) => Cell::Real(Some(f)),
            (Real, Value::Integer(i)) => Cell::Real(Some(i as f64)),
            (Blob, Value::Blob(b)) => Cell::Blob(Some(b)),
            (_, v) => return Err(bad(&v)),
        })
    }

    fn param(&self) -> &(dyn ToSql + Sync) {
        match self {
            Cell::Text(v) => v,
            Cell::Int(v) => v,
            Cell::Real(v) => v,
            Cell::Blob(v) => v,
        }
    }
}

/// What a copy moved: rows per table, in [`TABLES`]' order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyReport {
    pub tables: Vec<(String, u64)>,
}

impl CopyReport {
    /// Rows copied in all.
    pub fn total(&self) -> u64 {
        self.tables.iter().map(|(_, n)| n).sum()
    }
}

/// Copies the SQLite database at `sqlite_path` into the Postgres database at `url` (see
/// the module docs for the rules). The caller makes sure no server writes the SQLite file
/// meanwhile.
pub fn copy_sqlite_to_postgres(sqlite_path: &Path, url: &str) -> Result<CopyReport> {
    if !sqlite_path.is_file() {
        return Err(StoreError::Invalid(format!(
            "{} does not exist: point --data-dir at the data dir of the server to migrate",
            sqlite_path.display()
        )));
    }
    // Brings the file to this build's schema, as `locker serve` would at start.
    drop(SqliteStore::open(sqlite_path)?);
    let src = rusqlite::Connection::open_with_flags(
        sqlite_path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .map_err(|source| StoreError::Open {
        path: sqlite_path.to_path_buf(),
        source,
    })?;
    // One read transaction: every table as of the same moment.
    src.execute_batch("BEGIN")?;
    let mut data: Vec<(&str, Columns, Vec<Vec<Cell>>)> = Vec::new();
    for (table, cols) in TABLES {
        let names: Vec<&str> = cols.iter().map(|(n, _)| *n).collect();
        let mut st = src.prepare(&format!(
            "SELECT {} FROM {table} ORDER BY rowid",
            names.join(", ")
        ))?;
        let mut rows = st.query([])?;
        let mut out = Vec::new();
        while let Some(r) = rows.next()? {
            let mut row = Vec::with_capacity(cols.len());
            for (i, (col, kind)) in cols.iter().enumerate() {
                row.push(Cell::of(table, col, *kind, r.get::<_, Value>(i)?)?);
            }
            out.push(row);
        }
        data.push((table, cols, out));
    }
    // Pruned events keep their numbers: the sequence goes on after the highest ever given.
    let events_seq: i64 = src.query_row(
        "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)",
        [],
        |r| r.get(0),
    )?;
    src.execute_batch("COMMIT")?;

    let target = PgStore::connect(url)?;
    let report = target.run(move |c| {
        let target = c.target.clone();
        c.transaction(|c| {
            // Nothing else writes these tables while we copy and check.
            c.execute("SELECT pg_advisory_xact_lock($1)", &[&CALLS_LOCK])?;
            c.execute("SELECT pg_advisory_xact_lock($1)", &[&EVENTS_LOCK])?;
            let mut held = Vec::new();
            for (table, _) in TABLES {
                let n: i64 = c
                    .query_one(&format!("SELECT COUNT(*) FROM {table}"), &[])?
                    .try_get(0)?;
                if n > 0 {
                    held.push(format!("{n} {table}"));
                }
            }
            if !held.is_empty() {
                return Err(StoreError::Conflict(format!(
                    "the Postgres database {target} already holds Locker data ({}): migrate \
                     into an empty database (for example `createdb locker_new`), or start \
                     `locker serve --database` on this one as it is",
                    held.join(", ")
                )));
            }
            let mut report = Vec::new();
            for (table, cols, rows) in &data {
                let names: Vec<&str> = cols.iter().map(|(n, _)| *n).collect();
                let marks: Vec<String> = (1..=cols.len()).map(|i| format!("${i}")).collect();
                let sql = format!(
                    "INSERT INTO {table} ({}) VALUES ({})",
                    names.join(", "),
                    marks.join(", ")
                );
                for row in rows {
                    let params: Vec<&(dyn ToSql + Sync)> = row.iter().map(Cell::param).collect();
                    c.execute(&sql, &params)?;
                }
                let copied: i64 = c
                    .query_one(&format!("SELECT COUNT(*) FROM {table}"), &[])?
                    .try_get(0)?;
                if copied != rows.len() as i64 {
                    return Err(StoreError::Corrupt(format!(
                        "{table}: {} rows read from SQLite but {copied} in Postgres; \
                         nothing was copied",
                        rows.len()
                    )));
                }
                report.push((table.to_string(), rows.len() as u64));
            }
            // The identity sequences go on after the copied numbers.
            let max_seq = |c: &mut super::Conn, table: &str| -> Result<i64> {
                Ok(
                    c.query_one(&format!("SELECT COALESCE(MAX(seq), 0) FROM {table}"), &[])?
                        .try_get(0)?,
                )
            };
            let calls_seq = max_seq(c, "calls")?;
            let events_seq = events_seq.max(max_seq(c, "events")?);
            for (table, seq) in [("calls", calls_seq), ("events", events_seq)] {
                if seq > 0 {
                    c.execute(
                        "SELECT setval(pg_get_serial_sequence($1, 'seq'), $2)",
                        &[&table, &seq],
                    )?;
                }
            }
            Ok(CopyReport { tables: report })
        })
    })?;
    Ok(report)
}
