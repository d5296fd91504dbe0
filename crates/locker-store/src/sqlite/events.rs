//! Lifecycle events, webhooks and sandboxes' time splits.
//!
//! Owns: the `events` and `webhooks` tables and the time-split columns of `sandboxes`
//! (`active_ms`, `idle_ms`, `paused_ms`, `call_gaps`). An event's `seq` comes from SQLite's
//! `AUTOINCREMENT`, so it only ever grows, also across pruning and restarts.

use rusqlite::{params, OptionalExtension};

use super::codec::{from_i64, from_json, to_i64, to_json};
use super::SqliteStore;
use crate::error::Result;
use crate::model::{EventRecord, SandboxTimes, WebhookRecord};

pub(super) fn insert_event(
    db: &SqliteStore,
    tenant: &str,
    kind: &str,
    subject: &str,
    data: &str,
    at: i64,
) -> Result<u64> {
    let conn = db.writer();
    conn.prepare_cached(
        "INSERT INTO events (tenant, kind, subject, data, at_unix) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![tenant, kind, subject, data, at])?;
    from_i64("event seq", conn.last_insert_rowid())
}

/// See `Store::take_node_events`. Owns the `events_seq` column of `nodes` (the node's
/// cursor moves with the events it covers).
pub(super) fn take_node_events(
    db: &SqliteStore,
    node_id: &str,
    events: &[EventRecord],
) -> Result<(u64, Vec<EventRecord>)> {
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let cursor: i64 = tx
        .query_row(
            "SELECT events_seq FROM nodes WHERE id = ?1",
            [node_id],
            |r| r.get(0),
        )
        .optional()?
        .ok_or_else(|| crate::StoreError::NotFound(format!("node {node_id} does not exist")))?;
    let mut fresh: Vec<&EventRecord> = events
        .iter()
        .filter(|e| to_i64("event seq", e.seq).is_ok_and(|s| s > cursor))
        .collect();
    fresh.sort_by_key(|e| e.seq);
    let mut stored = Vec::with_capacity(fresh.len());
    let mut last = cursor;
    for e in fresh {
        tx.prepare_cached(
            "INSERT INTO events (tenant, kind, subject, data, at_unix) VALUES (?1, ?2, ?3, ?4, ?5)",
        )?
        .execute(params![e.tenant, e.kind, e.subject, e.data, e.at_unix])?;
        stored.push(EventRecord {
            seq: from_i64("event seq", tx.last_insert_rowid())?,
            ..e.clone()
        });
        last = to_i64("event seq", e.seq)?;
    }
    tx.prepare_cached("UPDATE nodes SET events_seq = ?1 WHERE id = ?2")?
        .execute(params![last, node_id])?;
    tx.commit()?;
    Ok((from_i64("event seq", last)?, stored))
}

pub(super) fn events_after(
    db: &SqliteStore,
    tenant: Option<&str>,
    after: u64,
    limit: u32,
) -> Result<Vec<EventRecord>> {
    let after = to_i64("event seq", after)?;
    db.read(|c| {
        let mut stmt = c.prepare_cached(
            "SELECT seq, tenant, kind, subject, data, at_unix FROM events
             WHERE seq > ?1 AND (?2 IS NULL OR tenant = ?2) ORDER BY seq LIMIT ?3",
        )?;
        let rows = stmt.query_map(params![after, tenant, limit], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, i64>(5)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (seq, tenant, kind, subject, data, at_unix) = row?;
            out.push(EventRecord {
                seq: from_i64("event seq", seq)?,
                tenant,
                kind,
                subject,
                data,
                at_unix,
            });
        }
        Ok(out)
    })
}

pub(super) fn latest_event_seq(db: &SqliteStore) -> Result<u64> {
    let seq: i64 = db.read(|c| {
        Ok(c.query_row(
            "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)",
            [],
            |r| r.get(0),
        )?)
    })?;
    from_i64("event seq", seq)
}

pub(super) fn prune_events(db: &SqliteStore, before: i64, keep: u64) -> Result<u64> {
    let keep = to_i64("events kept", keep)?;
    let conn = db.writer();
    let old = conn
        .prepare_cached("DELETE FROM events WHERE at_unix < ?1")?
        .execute([before])?;
    let over = conn
        .prepare_cached(
            "DELETE FROM events WHERE seq <= (SELECT seq FROM events ORDER BY seq DESC
                 LIMIT 1 OFFSET ?1)",
        )?
        .execute([keep])?;
    Ok((old + over) as u64)
}

pub(super) fn insert_webhook(db: &SqliteStore, w: &WebhookRecord) -> Result<WebhookRecord> {
    let events = to_json("webhook events", &w.events)?;
    let conn = db.writer();
    // The cursor is read under the writer, which every event insert also holds.
    let cursor: i64 = conn.query_row(
        "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)",
        [],
        |r| r.get(0),
    )?;
    conn.prepare_cached(
        "INSERT INTO webhooks (id, tenant, url, events, secret, created_unix, cursor)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        w.id,
        w.tenant,
        w.url,
        events,
        w.secret,
        w.created_unix,
        cursor
    ])?;
    let mut out = w.clone();
    out.cursor = from_i64("webhook cursor", cursor)?;
    Ok(out)
}

pub(super) fn list_webhooks(db: &SqliteStore, tenant: Option<&str>) -> Result<Vec<WebhookRecord>> {
    db.read(|c| {
        let mut stmt = c.prepare_cached(
            "SELECT id, tenant, url, events, secret, created_unix, cursor FROM webhooks
             WHERE (?1 IS NULL OR tenant = ?1) ORDER BY created_unix, id",
        )?;
        let rows = stmt.query_map(params![tenant], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, i64>(5)?,
                r.get::<_, i64>(6)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, tenant, url, events, secret, created_unix, cursor) = row?;
            out.push(WebhookRecord {
                events: from_json("webhook events", &events)?,
                cursor: from_i64("webhook cursor", cursor)?,
                id,
                tenant,
                url,
                secret,
                created_unix,
            });
        }
        Ok(out)
    })
}

pub(super) fn delete_webhook(db: &SqliteStore, tenant: &str, id: &str) -> Result<bool> {
    let n = db
        .writer()
        .prepare_cached("DELETE FROM webhooks WHERE id = ?1 AND tenant = ?2")?
        .execute(params![id, tenant])?;
    Ok(n > 0)
}

pub(super) fn set_webhook_cursor(db: &SqliteStore, id: &str, seq: u64) -> Result<()> {
    let seq = to_i64("webhook cursor", seq)?;
    db.writer()
        .prepare_cached("UPDATE webhooks SET cursor = ?2 WHERE id = ?1 AND cursor < ?2")?
        .execute(params![id, seq])?;
    Ok(())
}

pub(super) fn put_sandbox_times(db: &SqliteStore, id: &str, t: &SandboxTimes) -> Result<()> {
    let gaps = to_json("call gaps", &t.call_gaps)?;
    db.writer()
        .prepare_cached(
            "UPDATE sandboxes SET active_ms = ?2, idle_ms = ?3, paused_ms = ?4, call_gaps = ?5,
                 call_gap_sum_ms = ?6
             WHERE id = ?1",
        )?
        .execute(params![
            id,
            to_i64("active_ms", t.active_ms)?,
            to_i64("idle_ms", t.idle_ms)?,
            to_i64("paused_ms", t.paused_ms)?,
            gaps,
            to_i64("call_gap_sum_ms", t.call_gap_sum_ms)?
        ])?;
    Ok(())
}

pub(super) fn sandbox_times(db: &SqliteStore, id: &str) -> Result<Option<SandboxTimes>> {
    db.read(|c| {
        let row = c
            .prepare_cached(
                "SELECT active_ms, idle_ms, paused_ms, call_gaps, call_gap_sum_ms FROM sandboxes
                 WHERE id = ?1",
            )?
            .query_row([id], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, i64>(4)?,
                ))
            })
            .optional()?;
        match row {
            None => Ok(None),
            Some((a, i, p, g, sum)) => Ok(Some(SandboxTimes {
                call_gap_sum_ms: from_i64("call_gap_sum_ms", sum)?,
                active_ms: from_i64("active_ms", a)?,
                idle_ms: from_i64("idle_ms", i)?,
                paused_ms: from_i64("paused_ms", p)?,
                call_gaps: from_json("call gaps", &g)?,
            })),
        }
    })
}
