//! Call records and usage totals on Postgres (the rules of `sqlite/calls.rs`).
//!
//! Owns: the `calls` table. Inserts take [`CALLS_LOCK`] so that `seq` order is commit
//! order (see the module docs of `pg`).

use postgres::types::ToSql;

use super::{conflict_on_unique, Conn};
use crate::codec::{from_i64, from_json, to_i64, to_json, unix_of};
use crate::error::Result;
use crate::model::{CallOutcome, CallPage, CallQuery, CallRecord, TenantUsage};
use crate::{DEFAULT_CALLS_LIMIT, MAX_CALLS_LIMIT};

/// The advisory lock every insert into `calls` holds until it commits.
pub(crate) const CALLS_LOCK: i64 = 0x6c6f_636b_6361_6c6c; // "lockcall"

/// A call record's columns, encoded (and its output stripped) before any connection is
/// taken, so a bad record fails the batch without waiting for the database.
pub(super) struct CallRow {
    id: String,
    tenant: String,
    key_id: String,
    kind: &'static str,
    sandbox_id: Option<String>,
    volume_id: Option<String>,
    created: i64,
    cpu_ms: i64,
    json: String,
}

pub(super) fn encode(calls: &[CallRecord]) -> Result<Vec<CallRow>> {
    calls
        .iter()
        .map(|call| {
            let created = unix_of(&format!("call {} created_at", call.id), &call.created_at)?;
            let json = if call.result.stdout.is_empty() && call.result.stderr.is_empty() {
                to_json("call record", call)?
            } else {
                let mut stripped = call.clone();
                stripped.strip_output();
                to_json("call record", &stripped)?
            };
            Ok(CallRow {
                id: call.id.clone(),
                tenant: call.tenant.clone(),
                key_id: call.key_id.clone(),
                kind: call.kind.as_str(),
                sandbox_id: call.sandbox_id.clone(),
                volume_id: call.volume_id.clone(),
                created,
                cpu_ms: to_i64("cpu_ms", call.result.usage.cpu_ms)?,
                json,
            })
        })
        .collect()
}

pub(super) fn insert_calls(c: &mut Conn, rows: &[CallRow]) -> Result<()> {
    c.transaction(|c| {
        c.execute("SELECT pg_advisory_xact_lock($1)", &[&CALLS_LOCK])?;
        for r in rows {
            c.execute(
                "INSERT INTO calls (id, tenant, key_id, kind, sandbox_id, volume_id,
                     created_unix, cpu_ms, record)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                &[
                    &r.id,
                    &r.tenant,
                    &r.key_id,
                    &r.kind,
                    &r.sandbox_id,
                    &r.volume_id,
                    &r.created,
                    &r.cpu_ms,
                    &r.json,
                ],
            )
            .map_err(|e| {
                conflict_on_unique(e, || format!("call record {} already exists", r.id))
            })?;
        }
        Ok(())
    })
}

/// One page of [`CallQuery`] (see the SQLite store's): the outcome is read from the
/// record's JSON, `before` bounds `seq`, one row more than the page tells whether another
/// page follows.
pub(super) fn list_calls_page(c: &mut Conn, tenant: &str, q: &CallQuery) -> Result<CallPage> {
    let limit = q
        .limit
        .unwrap_or(DEFAULT_CALLS_LIMIT)
        .clamp(1, MAX_CALLS_LIMIT) as usize;
    let kind = q.kind.map(|k| k.as_str());
    let reason = match q.outcome {
        Some(CallOutcome::Reason(r)) => Some(r),
        _ => None,
    };
    let fetch = (limit + 1) as i64;
    let mut sql = String::from(
        "SELECT seq, record FROM calls WHERE tenant = $1
           AND ($2::text IS NULL OR sandbox_id = $2)
           AND ($3::text IS NULL OR volume_id = $3)
           AND ($4::text IS NULL OR key_id = $4)
           AND ($5::text IS NULL OR kind = $5)
           AND ($6::bigint IS NULL OR seq < $6)
           AND ($7::text IS NULL OR record::jsonb #>> '{result,reason}' = $7)",
    );
    match q.outcome {
        Some(CallOutcome::Ok) => sql.push_str(
            " AND record::jsonb #>> '{result,reason}' = 'exited' \
             AND record::jsonb #>> '{result,exit_code}' = '0'",
        ),
        Some(CallOutcome::Failed) => sql.push_str(
            " AND NOT (record::jsonb #>> '{result,reason}' = 'exited' \
             AND COALESCE(record::jsonb #>> '{result,exit_code}', '-1') = '0')",
        ),
        _ => {}
    }
    sql.push_str(" ORDER BY seq DESC LIMIT $8");
    let params: [&(dyn ToSql + Sync); 8] = [
        &tenant,
        &q.sandbox_id,
        &q.volume_id,
        &q.key_id,
        &kind,
        &q.before,
        &reason,
        &fetch,
    ];
    let rows = c.query(&sql, &params)?;
    let more = rows.len() > limit;
    let mut calls = Vec::with_capacity(limit.min(rows.len()));
    let mut last = None;
    for r in rows.iter().take(limit) {
        let seq: i64 = r.try_get(0)?;
        let json: String = r.try_get(1)?;
        calls.push(from_json("call record", &json)?);
        last = Some(seq);
    }
    Ok(CallPage {
        calls,
        next_cursor: if more { last } else { None },
    })
}

pub(super) fn usage_at(
    c: &mut Conn,
    tenant: &str,
    since: Option<i64>,
    now: i64,
) -> Result<TenantUsage> {
    let since = since.unwrap_or(i64::MIN);
    let r = c.query_one(
        "SELECT COALESCE(SUM(cpu_ms), 0)::bigint,
                COUNT(*) FILTER (WHERE kind = 'run'),
                COUNT(*) FILTER (WHERE kind IN ('exec','process'))
         FROM calls WHERE tenant = $1 AND created_unix >= $2",
        &[&tenant, &since],
    )?;
    let (cpu_ms, runs, execs): (i64, i64, i64) = (r.try_get(0)?, r.try_get(1)?, r.try_get(2)?);
    let seconds: i64 = c
        .query_one(
            "SELECT COALESCE(SUM(GREATEST(0,
                        LEAST($3, COALESCE(ended_unix, $3)) - GREATEST(created_unix, $2))), 0)::bigint
             FROM sandboxes
             WHERE tenant = $1 AND (ended_unix IS NULL OR ended_unix > $2)",
            &[&tenant, &since, &now],
        )?
        .try_get(0)?;
    let r = c.query_one(
        "SELECT COALESCE(SUM(active_ms), 0)::bigint, COALESCE(SUM(idle_ms), 0)::bigint,
                COALESCE(SUM(paused_ms), 0)::bigint, COALESCE(SUM(cpu_ms), 0)::bigint
         FROM sandboxes
         WHERE tenant = $1 AND ended_unix IS NOT NULL AND ended_unix > $2",
        &[&tenant, &since],
    )?;
    let (active, idle, paused, sb_cpu): (i64, i64, i64, i64) =
        (r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?);
    Ok(TenantUsage {
        ended_active_ms: from_i64("active_ms", active)?,
        ended_idle_ms: from_i64("idle_ms", idle)?,
        ended_paused_ms: from_i64("paused_ms", paused)?,
        ended_cpu_ms: from_i64("cpu_ms", sb_cpu)?,
        cpu_ms: from_i64("cpu_ms", cpu_ms)?,
        sandbox_seconds: from_i64("sandbox_seconds", seconds)?,
        runs: from_i64("runs", runs)?,
        execs: from_i64("execs", execs)?,
    })
}
