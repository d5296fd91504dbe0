//! Sandboxes placed on fleet nodes, on SQLite (the rules are `crate::fleet`'s
//! [`PlacementRecord`]): a placement and its node's reservation change in one transaction.
//!
//! Owns: the `placements` table, and the `reserved_*` columns of `nodes`.

use rusqlite::{params, OptionalExtension, Row, TransactionBehavior};

use super::fleet::clock_ms;
use super::SqliteStore;
use crate::error::Result;
use crate::fleet::{PlacementRecord, PlacementState};

const COLUMNS: &str = "id, sandbox_id, tenant, node_id, epoch, memory_mb, state, created_ms, view";

/// A placement row as read (its state still text).
struct Raw(PlacementRecord, String);

fn raw(r: &Row<'_>) -> rusqlite::Result<Raw> {
    Ok(Raw(
        PlacementRecord {
            id: r.get(0)?,
            sandbox_id: r.get(1)?,
            tenant: r.get(2)?,
            node_id: r.get(3)?,
            epoch: r.get(4)?,
            memory_mb: r.get(5)?,
            state: PlacementState::Starting,
            created_ms: r.get(7)?,
            view: r.get(8)?,
        },
        r.get(6)?,
    ))
}

fn decode(r: Raw) -> Result<PlacementRecord> {
    let Raw(mut p, state) = r;
    p.state = PlacementState::parse(&state)?;
    Ok(p)
}

pub(super) fn place(
    db: &SqliteStore,
    p: &PlacementRecord,
    cap_slots: i64,
    cap_memory_mb: i64,
) -> Result<Option<PlacementRecord>> {
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let reserved = tx
        .prepare_cached(
            "UPDATE nodes SET reserved_memory_mb = reserved_memory_mb + ?1,
                              reserved_slots = reserved_slots + 1
             WHERE id = ?2 AND epoch = ?3 AND state = 'ready'
               AND reserved_slots + 1 <= ?4 AND reserved_memory_mb + ?1 <= ?5",
        )?
        .execute(params![
            p.memory_mb,
            p.node_id,
            p.epoch,
            cap_slots,
            cap_memory_mb
        ])?;
    if reserved == 0 {
        return Ok(None);
    }
    let ms = clock_ms();
    tx.prepare_cached(&format!(
        "INSERT INTO placements ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
    ))?
    .execute(params![
        p.id,
        p.sandbox_id,
        p.tenant,
        p.node_id,
        p.epoch,
        p.memory_mb,
        p.state.as_str(),
        ms,
        p.view
    ])?;
    tx.commit()?;
    Ok(Some(PlacementRecord {
        created_ms: ms,
        ..p.clone()
    }))
}

pub(super) fn set_placed(db: &SqliteStore, id: &str, sandbox_id: &str, view: &str) -> Result<bool> {
    Ok(db
        .writer()
        .prepare_cached(
            "UPDATE placements SET sandbox_id = ?1, view = ?2, state = 'placed', created_ms = ?4
             WHERE id = ?3 AND (state = 'starting' OR (state = 'placed' AND sandbox_id = ?1))",
        )?
        .execute(params![sandbox_id, view, id, clock_ms()])?
        > 0)
}

pub(super) fn set_placement_view(db: &SqliteStore, sandbox_id: &str, view: &str) -> Result<()> {
    db.writer()
        .prepare_cached("UPDATE placements SET view = ?1 WHERE sandbox_id = ?2")?
        .execute(params![view, sandbox_id])?;
    Ok(())
}

pub(super) fn unplace(db: &SqliteStore, id: &str) -> Result<Option<PlacementRecord>> {
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let gone = tx
        .prepare_cached(&format!(
            "DELETE FROM placements WHERE id = ?1 RETURNING {COLUMNS}"
        ))?
        .query_row(params![id], raw)
        .optional()?
        .map(decode)
        .transpose()?;
    if let Some(p) = &gone {
        // A lost placement's reservation went with its node's old epoch.
        if p.state != PlacementState::Lost {
            tx.prepare_cached(
                "UPDATE nodes SET reserved_memory_mb = MAX(0, reserved_memory_mb - ?1),
                                  reserved_slots = MAX(0, reserved_slots - 1)
                 WHERE id = ?2 AND epoch = ?3",
            )?
            .execute(params![p.memory_mb, p.node_id, p.epoch])?;
        }
    }
    tx.commit()?;
    Ok(gone)
}

pub(super) fn unplace_lost(db: &SqliteStore, id: &str) -> Result<Option<PlacementRecord>> {
    // A lost placement holds no reservation: one statement.
    db.writer()
        .prepare_cached(&format!(
            "DELETE FROM placements WHERE id = ?1 AND state = 'lost' RETURNING {COLUMNS}"
        ))?
        .query_row(params![id], raw)
        .optional()?
        .map(decode)
        .transpose()
}

pub(super) fn move_placement(
    db: &SqliteStore,
    id: &str,
    (from_node, from_epoch, from_state): (&str, i64, PlacementState),
    into: &str,
    view: &str,
) -> Result<Option<PlacementRecord>> {
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let read = |sql: &str, p: &[&dyn rusqlite::ToSql]| -> Result<Option<PlacementRecord>> {
        tx.prepare_cached(&format!("SELECT {COLUMNS} FROM placements WHERE {sql}"))?
            .query_row(p, raw)
            .optional()?
            .map(decode)
            .transpose()
    };
    let target = read("id = ?1 AND state = 'starting'", &[&into])?;
    let old = read(
        "id = ?1 AND node_id = ?2 AND epoch = ?3 AND state = ?4",
        &[&id, &from_node, &from_epoch, &from_state.as_str()],
    )?;
    let (Some(target), Some(old)) = (target, old) else {
        // Dropped without a commit: nothing written.
        return Ok(None);
    };
    let ms = clock_ms();
    tx.prepare_cached("DELETE FROM placements WHERE id = ?1")?
        .execute(params![into])?;
    tx.prepare_cached(
        "UPDATE placements SET node_id = ?1, epoch = ?2, view = ?3, created_ms = ?4,
                               state = 'placed'
         WHERE id = ?5",
    )?
    .execute(params![target.node_id, target.epoch, view, ms, id])?;
    tx.prepare_cached(
        "UPDATE nodes SET reserved_memory_mb = MAX(0, reserved_memory_mb - ?1),
                          reserved_slots = MAX(0, reserved_slots - 1)
         WHERE id = ?2 AND epoch = ?3",
    )?
    .execute(params![old.memory_mb, old.node_id, old.epoch])?;
    tx.commit()?;
    Ok(Some(PlacementRecord {
        node_id: target.node_id,
        epoch: target.epoch,
        view: view.to_owned(),
        created_ms: ms,
        state: PlacementState::Placed,
        ..old
    }))
}

pub(super) fn get_placement(db: &SqliteStore, sandbox_id: &str) -> Result<Option<PlacementRecord>> {
    db.read(|c| {
        c.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM placements WHERE sandbox_id = ?1"
        ))?
        .query_row(params![sandbox_id], raw)
        .optional()?
        .map(decode)
        .transpose()
    })
}

pub(super) fn list_placements(
    db: &SqliteStore,
    tenant: Option<&str>,
    node_id: Option<&str>,
) -> Result<Vec<PlacementRecord>> {
    db.read(|c| {
        let raws = c
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM placements
                 WHERE (?1 IS NULL OR tenant = ?1) AND (?2 IS NULL OR node_id = ?2)
                 ORDER BY created_ms, id"
            ))?
            .query_map(params![tenant, node_id], raw)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        raws.into_iter().map(decode).collect()
    })
}

pub(super) fn lose_placements(db: &SqliteStore) -> Result<Vec<PlacementRecord>> {
    let conn = db.writer();
    let mut st = conn.prepare_cached(&format!(
        "UPDATE placements SET state = 'lost'
         WHERE state != 'lost'
           AND epoch < COALESCE((SELECT n.epoch FROM nodes n WHERE n.id = placements.node_id),
                                placements.epoch + 1)
         RETURNING {COLUMNS}"
    ))?;
    let raws = st
        .query_map([], raw)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    raws.into_iter().map(decode).collect()
}
