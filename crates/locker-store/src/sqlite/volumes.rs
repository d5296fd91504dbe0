//! Volumes' rows: names unique per tenant, sizes. Their files live on disk (the server's
//! volume room); their snapshots' rows are in `snapshots`.
//!
//! Owns: the `volumes` table.

use rusqlite::{params, OptionalExtension, Row, TransactionBehavior};

use super::codec::{conflict_on_unique, from_i64, to_i64, to_json, unix_of};
use super::tenants::require_tenant;
use super::SqliteStore;
use crate::error::Result;
use crate::model::{validate_volume_name, VolumeRecord, VolumeSnapshotRecord};

const VOLUME_COLUMNS: &str = "id, tenant, name, size_mb, created_at, host";

type RawVolume = (String, String, String, i64, String, String);

fn volume_of(r: &Row<'_>) -> rusqlite::Result<RawVolume> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
    ))
}

fn decode_volume(r: RawVolume) -> Result<VolumeRecord> {
    Ok(VolumeRecord {
        id: r.0,
        tenant: r.1,
        name: r.2,
        size_mb: from_i64("size_mb", r.3)?,
        created_at: r.4,
        host: r.5,
    })
}

pub(super) fn insert_volume(db: &SqliteStore, v: &VolumeRecord) -> Result<()> {
    validate_volume_name(&v.name)?;
    let created_unix = unix_of("created_at", &v.created_at)?;
    let size_mb = to_i64("size_mb", v.size_mb)?;
    let conn = db.writer();
    require_tenant(&conn, &v.tenant)?;
    conn.prepare_cached(
        "INSERT INTO volumes (id, tenant, name, size_mb, created_at, created_unix, host)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        v.id,
        v.tenant,
        v.name,
        size_mb,
        v.created_at,
        created_unix,
        v.host
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

pub(super) fn get_volume(
    db: &SqliteStore,
    tenant: &str,
    id_or_name: &str,
) -> Result<Option<VolumeRecord>> {
    let raw = db.read(|c| {
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

pub(super) fn list_volumes(db: &SqliteStore, tenant: &str) -> Result<Vec<VolumeRecord>> {
    let raw = db.read(|c| {
        let sql = format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE tenant = ?1 ORDER BY created_unix, rowid"
        );
        Ok(c.prepare_cached(&sql)?
            .query_map([tenant], volume_of)?
            .collect::<rusqlite::Result<Vec<_>>>()?)
    })?;
    raw.into_iter().map(decode_volume).collect()
}

pub(super) fn list_all_volumes(db: &SqliteStore) -> Result<Vec<VolumeRecord>> {
    let raw = db.read(|c| {
        let sql = format!("SELECT {VOLUME_COLUMNS} FROM volumes ORDER BY created_unix, rowid");
        Ok(c.prepare_cached(&sql)?
            .query_map([], volume_of)?
            .collect::<rusqlite::Result<Vec<_>>>()?)
    })?;
    raw.into_iter().map(decode_volume).collect()
}

pub(super) fn host_volumes(db: &SqliteStore, host: &str) -> Result<Vec<VolumeRecord>> {
    db.writer()
        .prepare_cached("UPDATE volumes SET host = ?1 WHERE host = ''")?
        .execute([host])?;
    let raw = db.read(|c| {
        let sql = format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE host = ?1 ORDER BY created_unix, rowid"
        );
        Ok(c.prepare_cached(&sql)?
            .query_map([host], volume_of)?
            .collect::<rusqlite::Result<Vec<_>>>()?)
    })?;
    raw.into_iter().map(decode_volume).collect()
}

/// `Store::delete_node_with_volumes`: the node's row, its volumes' and their snapshots', in
/// one transaction.
pub(super) fn delete_node_with_volumes(
    db: &SqliteStore,
    id: &str,
) -> Result<Option<Vec<VolumeRecord>>> {
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    if tx.execute("DELETE FROM nodes WHERE id = ?1", params![id])? == 0 {
        return Ok(None);
    }
    let raw: Vec<RawVolume> = tx
        .prepare(&format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE host = ?1"
        ))?
        .query_map(params![id], volume_of)?
        .collect::<rusqlite::Result<_>>()?;
    let gone = raw
        .into_iter()
        .map(decode_volume)
        .collect::<Result<Vec<_>>>()?;
    for v in &gone {
        tx.execute(
            "DELETE FROM volume_snapshots WHERE tenant = ?1 AND volume_id = ?2",
            params![v.tenant, v.id],
        )?;
        tx.execute(
            "DELETE FROM volumes WHERE tenant = ?1 AND id = ?2",
            params![v.tenant, v.id],
        )?;
    }
    tx.commit()?;
    Ok(Some(gone))
}

pub(super) fn delete_volume(db: &SqliteStore, tenant: &str, id: &str) -> Result<bool> {
    let mut conn = db.writer();
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

pub(super) fn move_volume(
    db: &SqliteStore,
    tenant: &str,
    id: &str,
    (from, to): (&str, &str),
    snapshots: &[VolumeSnapshotRecord],
) -> Result<bool> {
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let n = tx.execute(
        "UPDATE volumes SET host = ?4 WHERE tenant = ?1 AND id = ?2 AND host = ?3",
        params![tenant, id, from, to],
    )?;
    if n == 0 {
        return Ok(false);
    }
    for s in snapshots {
        let record = to_json("volume snapshot", s)?;
        tx.execute(
            "UPDATE volume_snapshots SET record = ?4 WHERE tenant = ?1 AND volume_id = ?2 AND id = ?3",
            params![tenant, id, s.id, record],
        )?;
    }
    tx.commit()?;
    Ok(true)
}
