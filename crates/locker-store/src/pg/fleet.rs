//! The fleet's rows on Postgres (the rules are in `crate::fleet`). Liveness uses the
//! database's clock (`clock_timestamp()`), never a replica's, so replicas agree on who is
//! alive whatever their own clocks say.
//!
//! Owns: the `fleet_ca`, `join_tokens` and `nodes` tables.

use postgres::Row;

use super::{conflict_on_unique, Conn};
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

/// The database's clock in milliseconds, as SQL.
const NOW_MS: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";

fn node_of(r: &Row) -> Result<NodeRecord> {
    Ok(NodeRecord {
        id: r.try_get(0)?,
        name: r.try_get(1)?,
        address: r.try_get(2)?,
        cert_sha256: r.try_get(3)?,
        cert_pem: r.try_get(4)?,
        public_key: r.try_get(5)?,
        epoch: r.try_get(6)?,
        state: NodeState::parse(r.try_get(7)?)?,
        joined_at: r.try_get(8)?,
        heartbeat_ms: r.try_get(9)?,
        lease_until_ms: r.try_get(10)?,
        report: r.try_get(11)?,
        reserved_memory_mb: r.try_get(12)?,
        reserved_slots: r.try_get(13)?,
        cordoned: r.try_get::<_, i64>(14)? != 0,
    })
}

pub(super) fn clock_ms(c: &mut Conn) -> Result<i64> {
    Ok(c.query_one(&format!("SELECT {NOW_MS}"), &[])?.try_get(0)?)
}

pub(super) fn fleet_ca(c: &mut Conn) -> Result<Option<FleetCaRecord>> {
    c.query_opt("SELECT cert_pem, key_sealed, created_at FROM fleet_ca", &[])?
        .map(|r| {
            Ok(FleetCaRecord {
                cert_pem: r.try_get(0)?,
                key_sealed: r.try_get(1)?,
                created_at: r.try_get(2)?,
            })
        })
        .transpose()
}

pub(super) fn put_fleet_ca_once(c: &mut Conn, ca: &FleetCaRecord) -> Result<FleetCaRecord> {
    c.execute(
        "INSERT INTO fleet_ca (id, cert_pem, key_sealed, created_at) VALUES (1, $1, $2, $3)
         ON CONFLICT (id) DO NOTHING",
        &[&ca.cert_pem, &ca.key_sealed, &ca.created_at],
    )?;
    Ok(fleet_ca(c)?.unwrap_or_else(|| ca.clone()))
}

pub(super) fn insert_join_token(c: &mut Conn, t: &JoinTokenRecord) -> Result<()> {
    c.execute(
        "INSERT INTO join_tokens (id, token_hash, created_at, expires_unix, used_unix, node_id)
         VALUES ($1, $2, $3, $4, $5, $6)",
        &[
            &t.id,
            &t.token_hash,
            &t.created_at,
            &t.expires_unix,
            &t.used_unix,
            &t.node_id,
        ],
    )?;
    Ok(())
}

pub(super) fn join_node(
    c: &mut Conn,
    token_hash: &[u8],
    node: &NodeRecord,
    lease_ms: i64,
) -> Result<NodeRecord> {
    validate_node_name(&node.name)?;
    c.transaction(|c| {
        // FOR UPDATE: two joins with one token at once redeem it once.
        let token = c.query_opt(
            "SELECT id, expires_unix, used_unix, node_id FROM join_tokens
             WHERE token_hash = $1 FOR UPDATE",
            &[&token_hash],
        )?;
        let now = now_unix();
        let Some(token) = token else {
            return Err(refused_token("no such token"));
        };
        let used: Option<i64> = token.try_get(2)?;
        let expires: i64 = token.try_get(1)?;
        if used.is_some() {
            // The same node trying again (its answer lost): the node it made, as it is.
            let used_by: Option<String> = token.try_get(3)?;
            let made = match used_by {
                Some(id) if expires > now => c
                    .query_opt(
                        &format!("SELECT {NODE_READ} FROM nodes WHERE id = $1"),
                        &[&id],
                    )?
                    .as_ref()
                    .map(node_of)
                    .transpose()?,
                _ => None,
            };
            return match made {
                Some(n) if n.public_key == node.public_key && n.name == node.name => Ok(n),
                _ => Err(refused_token("it was already used (one join each)")),
            };
        }
        if expires <= now {
            return Err(refused_token("it expired"));
        }
        let token_id: String = token.try_get(0)?;
        let row = insert_node(c, node, lease_ms, "")?
            .ok_or_else(|| crate::StoreError::Corrupt("an insert returned no row".into()))?;
        // `used_unix IS NULL` again: should the lock not hold (a connection made again
        // mid-transaction), the token still redeems once.
        let redeemed = c.execute(
            "UPDATE join_tokens SET used_unix = $1, node_id = $2 WHERE id = $3 AND used_unix IS NULL",
            &[&now, &node.id, &token_id],
        )?;
        if redeemed != 1 {
            return Err(refused_token("it was already used (one join each)"));
        }
        node_of(&row)
    })
}

/// `INSERT` of `node` (its heartbeat now, its lease `lease_ms` from now), with `conflict`
/// (an `ON CONFLICT` clause, or nothing); the row as stored, `None` when the conflict
/// clause updated nothing. A taken name is `Conflict`.
fn insert_node(
    c: &mut Conn,
    node: &NodeRecord,
    lease_ms: i64,
    conflict: &str,
) -> Result<Option<Row>> {
    c.query_opt(
        &format!(
            "INSERT INTO nodes ({NODE_COLUMNS})
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, {NOW_MS}, {NOW_MS} + $10, $11)
             {conflict}
             RETURNING {NODE_READ}"
        ),
        &[
            &node.id,
            &node.name,
            &node.address,
            &node.cert_sha256,
            &node.cert_pem,
            &node.public_key,
            &node.epoch,
            &node.state.as_str(),
            &node.joined_at,
            &lease_ms,
            &node.report,
        ],
    )
    .map_err(|e| conflict_on_unique(e, || name_taken(&node.name)))
}

pub(super) fn upsert_node(c: &mut Conn, node: &NodeRecord, lease_ms: i64) -> Result<NodeRecord> {
    validate_node_name(&node.name)?;
    let row = insert_node(
        c,
        node,
        lease_ms,
        "ON CONFLICT (id) DO UPDATE SET address = excluded.address, name = excluded.name
         WHERE nodes.cert_sha256 = excluded.cert_sha256",
    )?;
    match row {
        Some(r) => node_of(&r),
        None => Err(crate::StoreError::Conflict(format!(
            "node {} joined the fleet with a certificate: it is not this server's",
            node.id
        ))),
    }
}

pub(super) fn node_heartbeat(
    c: &mut Conn,
    id: &str,
    cert_sha256: &str,
    epoch: i64,
    report: &str,
    lease_ms: i64,
) -> Result<Option<NodeRecord>> {
    c.query_opt(
        &format!(
            "UPDATE nodes SET heartbeat_ms = {NOW_MS}, lease_until_ms = {NOW_MS} + $1, report = $2
             WHERE id = $3 AND epoch = $4 AND state = 'ready' AND cert_sha256 = $5
             RETURNING {NODE_READ}"
        ),
        &[&lease_ms, &report, &id, &epoch, &cert_sha256],
    )?
    .as_ref()
    .map(node_of)
    .transpose()
}

pub(super) fn revive_node(c: &mut Conn, id: &str, lease_ms: i64) -> Result<Option<NodeRecord>> {
    c.query_opt(
        &format!(
            "UPDATE nodes SET state = 'ready', heartbeat_ms = {NOW_MS},
                              lease_until_ms = {NOW_MS} + $1
             WHERE id = $2 AND state = 'dead'
             RETURNING {NODE_READ}"
        ),
        &[&lease_ms, &id],
    )?
    .as_ref()
    .map(node_of)
    .transpose()
}

pub(super) fn expire_nodes(c: &mut Conn, max: u32) -> Result<Vec<NodeRecord>> {
    // SKIP LOCKED: a node whose heartbeat is being written right now is not expired.
    c.query(
        &format!(
            "UPDATE nodes SET state = 'dead', epoch = epoch + 1, reserved_memory_mb = 0,
                             reserved_slots = 0
             WHERE id IN (SELECT id FROM nodes WHERE state = 'ready' AND lease_until_ms < {NOW_MS}
                          ORDER BY lease_until_ms LIMIT $1 FOR UPDATE SKIP LOCKED)
             RETURNING {NODE_READ}"
        ),
        &[&i64::from(max)],
    )?
    .iter()
    .map(node_of)
    .collect()
}

pub(super) fn get_node(c: &mut Conn, id_or_name: &str) -> Result<Option<NodeRecord>> {
    c.query_opt(
        &format!("SELECT {NODE_READ} FROM nodes WHERE id = $1 OR name = $1"),
        &[&id_or_name],
    )?
    .as_ref()
    .map(node_of)
    .transpose()
}

pub(super) fn list_nodes(c: &mut Conn) -> Result<Vec<NodeRecord>> {
    c.query(&format!("SELECT {NODE_READ} FROM nodes ORDER BY name"), &[])?
        .iter()
        .map(node_of)
        .collect()
}

pub(super) fn delete_node(c: &mut Conn, id: &str) -> Result<bool> {
    Ok(c.execute("DELETE FROM nodes WHERE id = $1", &[&id])? > 0)
}

pub(super) fn cordon_node(c: &mut Conn, id: &str, cordoned: bool) -> Result<bool> {
    let flag = i64::from(cordoned);
    Ok(c.execute(
        "UPDATE nodes SET cordoned = $2 WHERE id = $1",
        &[&id, &flag],
    )? > 0)
}
