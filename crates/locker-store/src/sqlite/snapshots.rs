//! Snapshots' rows, of sandboxes and of volumes: two kinds (a machine's disk and memory, a
//! copy of a directory tree) with one row shape, `record` holding the whole record as JSON.
//!
//! Owns: the `snapshots` and `volume_snapshots` tables. Deleting a volume deletes its
//! snapshots' rows too, in `volumes`' transaction.

use rusqlite::{params, OptionalExtension};

use super::codec::{to_json, unix_of};
use super::tenants::require_tenant;
use super::SqliteStore;
use crate::error::{Result, StoreError};
use crate::model::VolumeSnapshotRecord;
use crate::SnapshotRecord;

fn decode_volume_snapshot(json: &str) -> Result<VolumeSnapshotRecord> {
    serde_json::from_str(json)
        .map_err(|e| StoreError::Corrupt(format!("volume snapshot record: {e}")))
}

/// Deletes the tenant's row `id` of `table` (one of this file's own table names).
fn delete_row(db: &SqliteStore, table: &'static str, tenant: &str, id: &str) -> Result<bool> {
    let conn = db.writer();
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
    db: &SqliteStore,
    table: &str,
    owner_col: &str,
    id: &str,
    tenant: &str,
    owner: &str,
    created_unix: i64,
    record: &str,
) -> Result<()> {
    let conn = db.writer();
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

pub(super) fn insert_snapshot(db: &SqliteStore, snap: &SnapshotRecord) -> Result<()> {
    let record = to_json("snapshot", snap)?;
    let created_unix = unix_of("created_at", &snap.created_at)?;
    insert_snapshot_row(
        db,
        "snapshots",
        "sandbox_id",
        &snap.id,
        &snap.tenant,
        &snap.sandbox_id,
        created_unix,
        &record,
    )
}

pub(super) fn get_snapshot(
    db: &SqliteStore,
    tenant: &str,
    id: &str,
) -> Result<Option<SnapshotRecord>> {
    db.read(|c| {
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

pub(super) fn list_snapshots(db: &SqliteStore, tenant: &str) -> Result<Vec<SnapshotRecord>> {
    db.read(|c| {
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

pub(super) fn delete_snapshot(db: &SqliteStore, tenant: &str, id: &str) -> Result<bool> {
    delete_row(db, "snapshots", tenant, id)
}

pub(super) fn insert_volume_snapshot(db: &SqliteStore, snap: &VolumeSnapshotRecord) -> Result<()> {
    let record = to_json("volume snapshot", snap)?;
    let created_unix = unix_of("created_at", &snap.created_at)?;
    insert_snapshot_row(
        db,
        "volume_snapshots",
        "volume_id",
        &snap.id,
        &snap.tenant,
        &snap.volume_id,
        created_unix,
        &record,
    )
}

pub(super) fn get_volume_snapshot(
    db: &SqliteStore,
    tenant: &str,
    id: &str,
) -> Result<Option<VolumeSnapshotRecord>> {
    let json = db.read(|c| {
        Ok(
            c.prepare_cached("SELECT record FROM volume_snapshots WHERE tenant = ?1 AND id = ?2")?
                .query_row(params![tenant, id], |r| r.get::<_, String>(0))
                .optional()?,
        )
    })?;
    json.as_deref().map(decode_volume_snapshot).transpose()
}

pub(super) fn list_volume_snapshots(
    db: &SqliteStore,
    tenant: &str,
    volume_id: &str,
) -> Result<Vec<VolumeSnapshotRecord>> {
    let rows = db.read(|c| {
        Ok(c.prepare_cached(
            "SELECT record FROM volume_snapshots WHERE tenant = ?1 AND volume_id = ?2
             ORDER BY created_unix DESC, rowid DESC",
        )?
        .query_map(params![tenant, volume_id], |r| r.get::<_, String>(0))?
        .collect::<rusqlite::Result<Vec<_>>>()?)
    })?;
    rows.iter().map(|j| decode_volume_snapshot(j)).collect()
}

pub(super) fn delete_volume_snapshot(db: &SqliteStore, tenant: &str, id: &str) -> Result<bool> {
    delete_row(db, "volume_snapshots", tenant, id)
}
