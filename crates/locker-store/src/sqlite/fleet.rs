//! The fleet's rows on SQLite (the rules are in `crate::fleet`): one control server with
//! remote nodes needs no Postgres. The clock is this host's.
//!
//! Owns: the `fleet_ca`, `join_tokens` and `nodes` tables.

use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, OptionalExtension, Row, TransactionBehavior};

use super::codec::conflict_on_unique;
use super::SqliteStore;
use crate::error::Result;
use crate::fleet::{name_taken, refused_token, validate_node_name};
use crate::fleet::{FleetCaRecord, JoinTokenRecord, NodeRecord, NodeState};
use crate::model::now_unix;

const NODE_COLUMNS: &str = "id, name, address, cert_sha256, cert_pem, public_key, epoch, \
                            state, joined_at, heartbeat_ms, lease_until_ms, report";
/// What a read gives: the columns above and the reservations placement keeps.
const NODE_READ: &str = "id, name, address, cert_sha256, cert_pem, public_key, epoch, state, \
                         joined_at, heartbeat_ms, lease_until_ms, report, \
                         reserved_memory_mb, reserved_slots, cordoned";
const NODE_VALUES: &str = "?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12";

/// A node row as read (its state still text).
struct RawNode(NodeRecord, String);

fn raw_node(r: &Row<'_>) -> rusqlite::Result<RawNode> {
    Ok(RawNode(
        NodeRecord {
            id: r.get(0)?,
            name: r.get(1)?,
            address: r.get(2)?,
            cert_sha256: r.get(3)?,
            cert_pem: r.get(4)?,
            public_key: r.get(5)?,
            epoch: r.get(6)?,
            state: NodeState::Ready,
            joined_at: r.get(8)?,
            heartbeat_ms: r.get(9)?,
            lease_until_ms: r.get(10)?,
            report: r.get(11)?,
            reserved_memory_mb: r.get(12)?,
            reserved_slots: r.get(13)?,
            cordoned: r.get::<_, i64>(14)? != 0,
        },
        r.get(7)?,
    ))
}

fn decode(r: RawNode) -> Result<NodeRecord> {
    let RawNode(mut n, state) = r;
    n.state = NodeState::parse(&state)?;
    Ok(n)
}

/// The parameters of a node row in [`NODE_COLUMNS`]' order, with its times.
fn node_params(n: &NodeRecord, heartbeat_ms: i64, lease_until_ms: i64) -> [Value; 12] {
    [
        Value::Text(n.id.clone()),
        Value::Text(n.name.clone()),
        Value::Text(n.address.clone()),
        Value::Text(n.cert_sha256.clone()),
        Value::Text(n.cert_pem.clone()),
        Value::Text(n.public_key.clone()),
        Value::Integer(n.epoch),
        Value::Text(n.state.as_str().to_owned()),
        Value::Text(n.joined_at.clone()),
        Value::Integer(heartbeat_ms),
        Value::Integer(lease_until_ms),
        Value::Text(n.report.clone()),
    ]
}

/// This host's clock in milliseconds.
pub(super) fn clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

pub(super) fn fleet_ca(db: &SqliteStore) -> Result<Option<FleetCaRecord>> {
    db.read(|c| {
        Ok(
            c.prepare_cached("SELECT cert_pem, key_sealed, created_at FROM fleet_ca")?
                .query_row([], |r| {
                    Ok(FleetCaRecord {
                        cert_pem: r.get(0)?,
                        key_sealed: r.get(1)?,
                        created_at: r.get(2)?,
                    })
                })
                .optional()?,
        )
    })
}

pub(super) fn put_fleet_ca_once(db: &SqliteStore, ca: &FleetCaRecord) -> Result<FleetCaRecord> {
    db.writer()
        .prepare_cached(
            "INSERT INTO fleet_ca (id, cert_pem, key_sealed, created_at) VALUES (1, ?1, ?2, ?3)
             ON CONFLICT (id) DO NOTHING",
        )?
        .execute(params![ca.cert_pem, ca.key_sealed, ca.created_at])?;
    Ok(fleet_ca(db)?.unwrap_or_else(|| ca.clone()))
}

pub(super) fn insert_join_token(db: &SqliteStore, t: &JoinTokenRecord) -> Result<()> {
    db.writer()
        .prepare_cached(
            "INSERT INTO join_tokens (id, token_hash, created_at, expires_unix, used_unix, node_id)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?
        .execute(params![
            t.id,
            t.token_hash,
            t.created_at,
            t.expires_unix,
            t.used_unix,
            t.node_id
        ])?;
    Ok(())
}

pub(super) fn join_node(
    db: &SqliteStore,
    token_hash: &[u8],
    node: &NodeRecord,
    lease_ms: i64,
) -> Result<NodeRecord> {
    validate_node_name(&node.name)?;
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let token: Option<(String, i64, Option<i64>, Option<String>)> = tx
        .prepare_cached(
            "SELECT id, expires_unix, used_unix, node_id FROM join_tokens WHERE token_hash = ?1",
        )?
        .query_row(params![token_hash], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })
        .optional()?;
    let now = now_unix();
    let token_id = match token {
        None => return Err(refused_token("no such token")),
        Some((_, expires, Some(_), used_by)) => {
            // The same node trying again (its answer lost): the node it made, as it is.
            let made = match used_by {
                Some(id) if expires > now => tx
                    .prepare_cached(&format!("SELECT {NODE_READ} FROM nodes WHERE id = ?1"))?
                    .query_row(params![id], raw_node)
                    .optional()?
                    .map(decode)
                    .transpose()?,
                _ => None,
            };
            return match made {
                Some(n) if n.public_key == node.public_key && n.name == node.name => Ok(n),
                _ => Err(refused_token("it was already used (one join each)")),
            };
        }
        Some((_, expires, None, _)) if expires <= now => {
            return Err(refused_token("it expired"));
        }
        Some((id, _, None, _)) => id,
    };
    let ms = clock_ms();
    let mut n = node.clone();
    n.heartbeat_ms = ms;
    n.lease_until_ms = ms + lease_ms;
    tx.prepare_cached(&format!(
        "INSERT INTO nodes ({NODE_COLUMNS}) VALUES ({NODE_VALUES})"
    ))?
    .execute(params_from_iter(node_params(
        &n,
        n.heartbeat_ms,
        n.lease_until_ms,
    )))
    .map_err(|e| conflict_on_unique(e, || name_taken(&n.name)))?;
    let redeemed = tx
        .prepare_cached(
            "UPDATE join_tokens SET used_unix = ?1, node_id = ?2 WHERE id = ?3 AND used_unix IS NULL",
        )?
        .execute(params![now, n.id, token_id])?;
    if redeemed != 1 {
        return Err(refused_token("it was already used (one join each)"));
    }
    tx.commit()?;
    Ok(n)
}

pub(super) fn upsert_node(
    db: &SqliteStore,
    node: &NodeRecord,
    lease_ms: i64,
) -> Result<NodeRecord> {
    validate_node_name(&node.name)?;
    let ms = clock_ms();
    let raw = db
        .writer()
        .prepare_cached(&format!(
            "INSERT INTO nodes ({NODE_COLUMNS}) VALUES ({NODE_VALUES})
             ON CONFLICT (id) DO UPDATE SET address = excluded.address, name = excluded.name
             WHERE nodes.cert_sha256 = excluded.cert_sha256
             RETURNING {NODE_READ}"
        ))?
        .query_row(
            params_from_iter(node_params(node, ms, ms + lease_ms)),
            raw_node,
        )
        .optional()
        .map_err(|e| conflict_on_unique(e, || name_taken(&node.name)))?;
    match raw {
        Some(r) => decode(r),
        None => Err(crate::StoreError::Conflict(format!(
            "node {} joined the fleet with a certificate: it is not this server's",
            node.id
        ))),
    }
}

/// One `UPDATE … RETURNING` of a node row, or `None` when no row matched.
fn update_node(
    db: &SqliteStore,
    sql: &str,
    p: &[&dyn rusqlite::ToSql],
) -> Result<Option<NodeRecord>> {
    let raw = db
        .writer()
        .prepare_cached(&format!("{sql} RETURNING {NODE_READ}"))?
        .query_row(p, raw_node)
        .optional()?;
    raw.map(decode).transpose()
}

pub(super) fn node_heartbeat(
    db: &SqliteStore,
    id: &str,
    cert_sha256: &str,
    epoch: i64,
    report: &str,
    lease_ms: i64,
) -> Result<Option<NodeRecord>> {
    let ms = clock_ms();
    update_node(
        db,
        "UPDATE nodes SET heartbeat_ms = ?1, lease_until_ms = ?2, report = ?3
         WHERE id = ?4 AND epoch = ?5 AND state = 'ready' AND cert_sha256 = ?6",
        &[&ms, &(ms + lease_ms), &report, &id, &epoch, &cert_sha256],
    )
}

pub(super) fn revive_node(db: &SqliteStore, id: &str, lease_ms: i64) -> Result<Option<NodeRecord>> {
    let ms = clock_ms();
    update_node(
        db,
        "UPDATE nodes SET state = 'ready', heartbeat_ms = ?1, lease_until_ms = ?2
         WHERE id = ?3 AND state = 'dead'",
        &[&ms, &(ms + lease_ms), &id],
    )
}

pub(super) fn expire_nodes(db: &SqliteStore, max: u32) -> Result<Vec<NodeRecord>> {
    let ms = clock_ms();
    let conn = db.writer();
    let mut st = conn.prepare_cached(&format!(
        "UPDATE nodes SET state = 'dead', epoch = epoch + 1, reserved_memory_mb = 0,
                             reserved_slots = 0
         WHERE id IN (SELECT id FROM nodes WHERE state = 'ready' AND lease_until_ms < ?1
                      ORDER BY lease_until_ms LIMIT ?2)
         RETURNING {NODE_READ}"
    ))?;
    let raws = st
        .query_map(params![ms, max], raw_node)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    raws.into_iter().map(decode).collect()
}

pub(super) fn get_node(db: &SqliteStore, id_or_name: &str) -> Result<Option<NodeRecord>> {
    let raw = db.read(|c| {
        Ok(c.prepare_cached(&format!(
            "SELECT {NODE_READ} FROM nodes WHERE id = ?1 OR name = ?1"
        ))?
        .query_row(params![id_or_name], raw_node)
        .optional()?)
    })?;
    raw.map(decode).transpose()
}

pub(super) fn list_nodes(db: &SqliteStore) -> Result<Vec<NodeRecord>> {
    let raws = db.read(|c| {
        Ok(
            c.prepare_cached(&format!("SELECT {NODE_READ} FROM nodes ORDER BY name"))?
                .query_map([], raw_node)?
                .collect::<rusqlite::Result<Vec<_>>>()?,
        )
    })?;
    raws.into_iter().map(decode).collect()
}

pub(super) fn cordon_node(db: &SqliteStore, id: &str, cordoned: bool) -> Result<bool> {
    Ok(db
        .writer()
        .prepare_cached("UPDATE nodes SET cordoned = ?2 WHERE id = ?1")?
        .execute(params![id, i64::from(cordoned)])?
        > 0)
}

pub(super) fn delete_node(db: &SqliteStore, id: &str) -> Result<bool> {
    Ok(db
        .writer()
        .prepare_cached("DELETE FROM nodes WHERE id = ?1")?
        .execute(params![id])?
        > 0)
}
