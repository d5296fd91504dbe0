//! Sandboxes placed on fleet nodes, on Postgres (the rules are `crate::fleet`'s
//! [`PlacementRecord`]). Placing is optimistic: no row is locked while the control plane
//! chooses; the reservation is one conditional `UPDATE` of the node (`WHERE epoch = $e AND
//! reserved + r <= capacity`) in the transaction that inserts the placement, and a create
//! that loses the race chooses again.
//!
//! Owns: the `placements` table, and the `reserved_*` columns of `nodes`.

use postgres::Row;

use super::Conn;
use crate::error::Result;
use crate::fleet::{PlacementRecord, PlacementState};

const COLUMNS: &str = "id, sandbox_id, tenant, node_id, epoch, memory_mb, state, created_ms, view";

/// The database's clock in milliseconds, as SQL.
const NOW_MS: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";

fn of(r: &Row) -> Result<PlacementRecord> {
    Ok(PlacementRecord {
        id: r.try_get(0)?,
        sandbox_id: r.try_get(1)?,
        tenant: r.try_get(2)?,
        node_id: r.try_get(3)?,
        epoch: r.try_get(4)?,
        memory_mb: r.try_get(5)?,
        state: PlacementState::parse(r.try_get(6)?)?,
        created_ms: r.try_get(7)?,
        view: r.try_get(8)?,
    })
}

pub(super) fn place(
    c: &mut Conn,
    p: &PlacementRecord,
    cap_slots: i64,
    cap_memory_mb: i64,
) -> Result<Option<PlacementRecord>> {
    c.transaction(|c| {
        let reserved = c.execute(
            "UPDATE nodes SET reserved_memory_mb = reserved_memory_mb + $1,
                              reserved_slots = reserved_slots + 1
             WHERE id = $2 AND epoch = $3 AND state = 'ready'
               AND reserved_slots + 1 <= $4 AND reserved_memory_mb + $1 <= $5",
            &[
                &p.memory_mb,
                &p.node_id,
                &p.epoch,
                &cap_slots,
                &cap_memory_mb,
            ],
        )?;
        if reserved == 0 {
            return Ok(None);
        }
        let row = c.query_one(
            &format!(
                "INSERT INTO placements ({COLUMNS})
                 VALUES ($1, $2, $3, $4, $5, $6, $7, {NOW_MS}, $8) RETURNING {COLUMNS}"
            ),
            &[
                &p.id,
                &p.sandbox_id,
                &p.tenant,
                &p.node_id,
                &p.epoch,
                &p.memory_mb,
                &p.state.as_str(),
                &p.view,
            ],
        )?;
        of(&row).map(Some)
    })
}

pub(super) fn set_placed(c: &mut Conn, id: &str, sandbox_id: &str, view: &str) -> Result<bool> {
    Ok(c.execute(
        &format!(
            "UPDATE placements SET sandbox_id = $1, view = $2, state = 'placed',
                                   created_ms = {NOW_MS}
             WHERE id = $3 AND (state = 'starting' OR (state = 'placed' AND sandbox_id = $1))"
        ),
        &[&sandbox_id, &view, &id],
    )? > 0)
}

pub(super) fn set_placement_view(c: &mut Conn, sandbox_id: &str, view: &str) -> Result<()> {
    c.execute(
        "UPDATE placements SET view = $1 WHERE sandbox_id = $2",
        &[&view, &sandbox_id],
    )?;
    Ok(())
}

pub(super) fn unplace(c: &mut Conn, id: &str) -> Result<Option<PlacementRecord>> {
    c.transaction(|c| {
        let gone = c
            .query_opt(
                &format!("DELETE FROM placements WHERE id = $1 RETURNING {COLUMNS}"),
                &[&id],
            )?
            .as_ref()
            .map(of)
            .transpose()?;
        if let Some(p) = &gone {
            // A lost placement's reservation went with its node's old epoch.
            if p.state != PlacementState::Lost {
                c.execute(
                    "UPDATE nodes SET reserved_memory_mb = GREATEST(0, reserved_memory_mb - $1),
                                      reserved_slots = GREATEST(0, reserved_slots - 1)
                     WHERE id = $2 AND epoch = $3",
                    &[&p.memory_mb, &p.node_id, &p.epoch],
                )?;
            }
        }
        Ok(gone)
    })
}

pub(super) fn unplace_lost(c: &mut Conn, id: &str) -> Result<Option<PlacementRecord>> {
    // A lost placement holds no reservation: one statement.
    c.query_opt(
        &format!("DELETE FROM placements WHERE id = $1 AND state = 'lost' RETURNING {COLUMNS}"),
        &[&id],
    )?
    .as_ref()
    .map(of)
    .transpose()
}

pub(super) fn move_placement(
    c: &mut Conn,
    id: &str,
    (from_node, from_epoch, from_state): (&str, i64, PlacementState),
    into: &str,
    view: &str,
) -> Result<Option<PlacementRecord>> {
    c.transaction(|c| {
        let target = c
            .query_opt(
                &format!(
                    "SELECT {COLUMNS} FROM placements WHERE id = $1 AND state = 'starting' FOR UPDATE"
                ),
                &[&into],
            )?
            .as_ref()
            .map(of)
            .transpose()?;
        let old = c
            .query_opt(
                &format!(
                    "SELECT {COLUMNS} FROM placements
                     WHERE id = $1 AND node_id = $2 AND epoch = $3 AND state = $4 FOR UPDATE"
                ),
                &[&id, &from_node, &from_epoch, &from_state.as_str()],
            )?
            .as_ref()
            .map(of)
            .transpose()?;
        let (Some(target), Some(old)) = (target, old) else {
            return Ok(None);
        };
        c.execute("DELETE FROM placements WHERE id = $1", &[&into])?;
        let row = c.query_one(
            &format!(
                "UPDATE placements SET node_id = $1, epoch = $2, view = $3, created_ms = {NOW_MS},
                                       state = 'placed'
                 WHERE id = $4 RETURNING {COLUMNS}"
            ),
            &[&target.node_id, &target.epoch, &view, &id],
        )?;
        c.execute(
            "UPDATE nodes SET reserved_memory_mb = GREATEST(0, reserved_memory_mb - $1),
                              reserved_slots = GREATEST(0, reserved_slots - 1)
             WHERE id = $2 AND epoch = $3",
            &[&old.memory_mb, &old.node_id, &old.epoch],
        )?;
        of(&row).map(Some)
    })
}

pub(super) fn get_placement(c: &mut Conn, sandbox_id: &str) -> Result<Option<PlacementRecord>> {
    c.query_opt(
        &format!("SELECT {COLUMNS} FROM placements WHERE sandbox_id = $1"),
        &[&sandbox_id],
    )?
    .as_ref()
    .map(of)
    .transpose()
}

pub(super) fn list_placements(
    c: &mut Conn,
    tenant: Option<&str>,
    node_id: Option<&str>,
) -> Result<Vec<PlacementRecord>> {
    c.query(
        &format!(
            "SELECT {COLUMNS} FROM placements
             WHERE ($1::TEXT IS NULL OR tenant = $1) AND ($2::TEXT IS NULL OR node_id = $2)
             ORDER BY created_ms, id"
        ),
        &[&tenant, &node_id],
    )?
    .iter()
    .map(of)
    .collect()
}

pub(super) fn lose_placements(c: &mut Conn) -> Result<Vec<PlacementRecord>> {
    c.query(
        &format!(
            "UPDATE placements SET state = 'lost'
             WHERE state != 'lost'
               AND epoch < COALESCE((SELECT n.epoch FROM nodes n WHERE n.id = placements.node_id),
                                    placements.epoch + 1)
             RETURNING {COLUMNS}"
        ),
        &[],
    )?
    .iter()
    .map(of)
    .collect()
}
