//! Lifecycle events, webhooks and sandboxes' time splits on Postgres (the rules of
//! `sqlite/events.rs`).
//!
//! Owns: the `events` and `webhooks` tables and the time-split columns of `sandboxes`. An
//! event's `seq` comes from its identity sequence, which never hands a number out twice;
//! inserts (and a new webhook's cursor) hold [`EVENTS_LOCK`] so commit order is `seq` order.

use super::Conn;
use crate::codec::{from_i64, from_json, to_i64, to_json};
use crate::error::Result;
use crate::model::{EventRecord, SandboxTimes, WebhookRecord};

/// The advisory lock every insert into `events` holds until it commits.
pub(crate) const EVENTS_LOCK: i64 = 0x6c6f_636b_6576_6e74; // "lockevnt"

/// The newest `seq` the sequence has handed out (pruned and rolled-back ones included).
const LATEST_SEQ: &str = "SELECT COALESCE(
    pg_sequence_last_value(pg_get_serial_sequence('events', 'seq')::regclass), 0)";

pub(super) fn insert_event(
    c: &mut Conn,
    tenant: &str,
    kind: &str,
    subject: &str,
    data: &str,
    at: i64,
) -> Result<u64> {
    let seq: i64 = c.transaction(|c| {
        c.execute("SELECT pg_advisory_xact_lock($1)", &[&EVENTS_LOCK])?;
        Ok(c.query_one(
            "INSERT INTO events (tenant, kind, subject, data, at_unix)
                 VALUES ($1, $2, $3, $4, $5) RETURNING seq",
            &[&tenant, &kind, &subject, &data, &at],
        )?
        .try_get(0)?)
    })?;
    from_i64("event seq", seq)
}

/// See `Store::take_node_events`. Owns the `events_seq` column of `nodes` (the node's
/// cursor moves with the events it covers); the node's row is locked for the transaction,
/// so two replicas taking the same batch store it once.
pub(super) fn take_node_events(
    c: &mut Conn,
    node_id: &str,
    events: &[EventRecord],
) -> Result<(u64, Vec<EventRecord>)> {
    c.transaction(|c| {
        let cursor: i64 = c
            .query_opt(
                "SELECT events_seq FROM nodes WHERE id = $1 FOR UPDATE",
                &[&node_id],
            )?
            .ok_or_else(|| crate::StoreError::NotFound(format!("node {node_id} does not exist")))?
            .try_get(0)?;
        let mut fresh: Vec<&EventRecord> = events
            .iter()
            .filter(|e| to_i64("event seq", e.seq).is_ok_and(|s| s > cursor))
            .collect();
        fresh.sort_by_key(|e| e.seq);
        if !fresh.is_empty() {
            c.execute("SELECT pg_advisory_xact_lock($1)", &[&EVENTS_LOCK])?;
        }
        let mut stored = Vec::with_capacity(fresh.len());
        let mut last = cursor;
        for e in fresh {
            let seq: i64 = c
                .query_one(
                    "INSERT INTO events (tenant, kind, subject, data, at_unix)
                     VALUES ($1, $2, $3, $4, $5) RETURNING seq",
                    &[&e.tenant, &e.kind, &e.subject, &e.data, &e.at_unix],
                )?
                .try_get(0)?;
            stored.push(EventRecord {
                seq: from_i64("event seq", seq)?,
                ..e.clone()
            });
            last = to_i64("event seq", e.seq)?;
        }
        c.execute(
            "UPDATE nodes SET events_seq = $1 WHERE id = $2",
            &[&last, &node_id],
        )?;
        Ok((from_i64("event seq", last)?, stored))
    })
}

pub(super) fn events_after(
    c: &mut Conn,
    tenant: Option<&str>,
    after: u64,
    limit: u32,
) -> Result<Vec<EventRecord>> {
    let after = to_i64("event seq", after)?;
    let limit = i64::from(limit);
    c.query(
        "SELECT seq, tenant, kind, subject, data, at_unix FROM events
         WHERE seq > $1 AND ($2::text IS NULL OR tenant = $2) ORDER BY seq LIMIT $3",
        &[&after, &tenant, &limit],
    )?
    .iter()
    .map(|r| {
        Ok(EventRecord {
            seq: from_i64("event seq", r.try_get(0)?)?,
            tenant: r.try_get(1)?,
            kind: r.try_get(2)?,
            subject: r.try_get(3)?,
            data: r.try_get(4)?,
            at_unix: r.try_get(5)?,
        })
    })
    .collect()
}

pub(super) fn latest_event_seq(c: &mut Conn) -> Result<u64> {
    let seq: i64 = c.query_one(LATEST_SEQ, &[])?.try_get(0)?;
    from_i64("event seq", seq)
}

pub(super) fn prune_events(c: &mut Conn, before: i64, keep: u64) -> Result<u64> {
    let keep = to_i64("events kept", keep)?;
    let old = c.execute("DELETE FROM events WHERE at_unix < $1", &[&before])?;
    let over = c.execute(
        "DELETE FROM events WHERE seq <= (SELECT seq FROM events ORDER BY seq DESC
             LIMIT 1 OFFSET $1)",
        &[&keep],
    )?;
    Ok(old + over)
}

pub(super) fn insert_webhook(c: &mut Conn, w: &WebhookRecord) -> Result<WebhookRecord> {
    let events = to_json("webhook events", &w.events)?;
    let cursor: i64 = c.transaction(|c| {
        // Read under the lock every event insert holds: no event commits in between.
        c.execute("SELECT pg_advisory_xact_lock($1)", &[&EVENTS_LOCK])?;
        let cursor: i64 = c.query_one(LATEST_SEQ, &[])?.try_get(0)?;
        c.execute(
            "INSERT INTO webhooks (id, tenant, url, events, secret, created_unix, cursor)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[
                &w.id,
                &w.tenant,
                &w.url,
                &events,
                &w.secret,
                &w.created_unix,
                &cursor,
            ],
        )?;
        Ok(cursor)
    })?;
    let mut out = w.clone();
    out.cursor = from_i64("webhook cursor", cursor)?;
    Ok(out)
}

pub(super) fn list_webhooks(c: &mut Conn, tenant: Option<&str>) -> Result<Vec<WebhookRecord>> {
    c.query(
        "SELECT id, tenant, url, events, secret, created_unix, cursor FROM webhooks
         WHERE ($1::text IS NULL OR tenant = $1) ORDER BY created_unix, id",
        &[&tenant],
    )?
    .iter()
    .map(|r| {
        let events: String = r.try_get(3)?;
        Ok(WebhookRecord {
            id: r.try_get(0)?,
            tenant: r.try_get(1)?,
            url: r.try_get(2)?,
            events: from_json("webhook events", &events)?,
            secret: r.try_get(4)?,
            created_unix: r.try_get(5)?,
            cursor: from_i64("webhook cursor", r.try_get(6)?)?,
        })
    })
    .collect()
}

pub(super) fn delete_webhook(c: &mut Conn, tenant: &str, id: &str) -> Result<bool> {
    Ok(c.execute(
        "DELETE FROM webhooks WHERE id = $1 AND tenant = $2",
        &[&id, &tenant],
    )? > 0)
}

pub(super) fn set_webhook_cursor(c: &mut Conn, id: &str, seq: u64) -> Result<()> {
    let seq = to_i64("webhook cursor", seq)?;
    c.execute(
        "UPDATE webhooks SET cursor = $2 WHERE id = $1 AND cursor < $2",
        &[&id, &seq],
    )?;
    Ok(())
}

pub(super) fn put_sandbox_times(c: &mut Conn, id: &str, t: &SandboxTimes) -> Result<()> {
    let gaps = to_json("call gaps", &t.call_gaps)?;
    c.execute(
        "UPDATE sandboxes SET active_ms = $2, idle_ms = $3, paused_ms = $4, call_gaps = $5,
             call_gap_sum_ms = $6
         WHERE id = $1",
        &[
            &id,
            &to_i64("active_ms", t.active_ms)?,
            &to_i64("idle_ms", t.idle_ms)?,
            &to_i64("paused_ms", t.paused_ms)?,
            &gaps,
            &to_i64("call_gap_sum_ms", t.call_gap_sum_ms)?,
        ],
    )?;
    Ok(())
}

pub(super) fn sandbox_times(c: &mut Conn, id: &str) -> Result<Option<SandboxTimes>> {
    let Some(r) = c.query_opt(
        "SELECT active_ms, idle_ms, paused_ms, call_gaps, call_gap_sum_ms FROM sandboxes
         WHERE id = $1",
        &[&id],
    )?
    else {
        return Ok(None);
    };
    let gaps: String = r.try_get(3)?;
    Ok(Some(SandboxTimes {
        active_ms: from_i64("active_ms", r.try_get(0)?)?,
        idle_ms: from_i64("idle_ms", r.try_get(1)?)?,
        paused_ms: from_i64("paused_ms", r.try_get(2)?)?,
        call_gaps: from_json("call gaps", &gaps)?,
        call_gap_sum_ms: from_i64("call_gap_sum_ms", r.try_get(4)?)?,
    }))
}
