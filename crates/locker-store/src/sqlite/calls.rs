//! Call records (append-only, newest first) and the usage totals read from them and from
//! the sandboxes' lifetimes.
//!
//! Owns: the `calls` table. Records arrive without output bodies (see
//! [`crate::CallRecorder`]); a record that still has them is stripped here.

use rusqlite::{params, params_from_iter, TransactionBehavior};

use super::codec::{conflict_on_unique, from_i64, from_json, to_i64, to_json, unix_of};
use super::SqliteStore;
use crate::error::Result;
use crate::model::{CallOutcome, CallPage, CallQuery, CallRecord, TenantUsage};
use crate::{DEFAULT_CALLS_LIMIT, MAX_CALLS_LIMIT};

pub(super) fn insert_calls(db: &SqliteStore, calls: &[CallRecord]) -> Result<()> {
    if calls.is_empty() {
        return Ok(());
    }
    // Encode everything before taking the writer, so a bad record fails the batch
    // without holding the lock.
    let mut rows = Vec::with_capacity(calls.len());
    for call in calls {
        let created = unix_of(&format!("call {} created_at", call.id), &call.created_at)?;
        let json = if call.result.stdout.is_empty() && call.result.stderr.is_empty() {
            to_json("call record", call)?
        } else {
            let mut stripped = call.clone();
            stripped.strip_output();
            to_json("call record", &stripped)?
        };
        let cpu_ms = to_i64("cpu_ms", call.result.usage.cpu_ms)?;
        rows.push((call, created, cpu_ms, json));
    }
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let mut st = tx.prepare_cached(
            "INSERT INTO calls (id, tenant, key_id, kind, sandbox_id, volume_id,
                 created_unix, cpu_ms, record)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?;
        for (call, created, cpu_ms, json) in &rows {
            st.execute(params![
                call.id,
                call.tenant,
                call.key_id,
                call.kind.as_str(),
                call.sandbox_id,
                call.volume_id,
                created,
                cpu_ms,
                json
            ])
            .map_err(|e| {
                conflict_on_unique(e, || format!("call record {} already exists", call.id))
            })?;
        }
    }
    tx.commit()?;
    Ok(())
}

pub(super) fn list_calls(
    db: &SqliteStore,
    tenant: &str,
    sandbox_id: Option<&str>,
    volume_id: Option<&str>,
    limit: Option<u32>,
) -> Result<Vec<CallRecord>> {
    let limit = limit
        .unwrap_or(DEFAULT_CALLS_LIMIT)
        .clamp(1, MAX_CALLS_LIMIT)
        .to_string();
    let mut sql = String::from("SELECT record FROM calls WHERE tenant = ?1");
    let mut args: Vec<&str> = vec![tenant];
    if let Some(sb) = sandbox_id {
        args.push(sb);
        sql.push_str(&format!(" AND sandbox_id = ?{}", args.len()));
    }
    if let Some(vol) = volume_id {
        args.push(vol);
        sql.push_str(&format!(" AND volume_id = ?{}", args.len()));
    }
    args.push(&limit);
    sql.push_str(&format!(
        " ORDER BY seq DESC LIMIT CAST(?{} AS INTEGER)",
        args.len()
    ));
    db.read(|c| {
        let mut st = c.prepare_cached(&sql)?;
        let jsons = st
            .query_map(params_from_iter(&args), |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        jsons.iter().map(|j| from_json("call record", j)).collect()
    })
}

/// One page of [`CallQuery`]: the filters become `WHERE` terms on the indexed columns
/// (the outcome is read from the record's JSON), `before` a `seq <` bound, and one row
/// more than the page is read to know whether another page follows.
pub(super) fn list_calls_page(db: &SqliteStore, tenant: &str, q: &CallQuery) -> Result<CallPage> {
    let limit = q
        .limit
        .unwrap_or(DEFAULT_CALLS_LIMIT)
        .clamp(1, MAX_CALLS_LIMIT) as usize;
    let mut sql = String::from("SELECT seq, record FROM calls WHERE tenant = ?1");
    let mut args: Vec<rusqlite::types::Value> = vec![tenant.to_owned().into()];
    let mut bind = |sql: &mut String, term: &str, v: rusqlite::types::Value| {
        args.push(v);
        sql.push_str(&term.replace('?', &format!("?{}", args.len())));
    };
    if let Some(sb) = &q.sandbox_id {
        bind(&mut sql, " AND sandbox_id = ?", sb.clone().into());
    }
    if let Some(vol) = &q.volume_id {
        bind(&mut sql, " AND volume_id = ?", vol.clone().into());
    }
    if let Some(key) = &q.key_id {
        bind(&mut sql, " AND key_id = ?", key.clone().into());
    }
    if let Some(kind) = q.kind {
        bind(&mut sql, " AND kind = ?", kind.as_str().to_owned().into());
    }
    if let Some(before) = q.before {
        bind(&mut sql, " AND seq < ?", before.into());
    }
    match q.outcome {
        None => {}
        Some(CallOutcome::Ok) => sql.push_str(
            " AND json_extract(record, '$.result.reason') = 'exited' \
             AND json_extract(record, '$.result.exit_code') = 0",
        ),
        Some(CallOutcome::Failed) => sql.push_str(
            " AND NOT (json_extract(record, '$.result.reason') = 'exited' \
             AND IFNULL(json_extract(record, '$.result.exit_code'), -1) = 0)",
        ),
        Some(CallOutcome::Reason(r)) => bind(
            &mut sql,
            " AND json_extract(record, '$.result.reason') = ?",
            r.to_owned().into(),
        ),
    }
    bind(
        &mut sql,
        " ORDER BY seq DESC LIMIT ?",
        ((limit + 1) as i64).into(),
    );
    db.read(|c| {
        let mut st = c.prepare_cached(&sql)?;
        let rows = st
            .query_map(params_from_iter(&args), |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let more = rows.len() > limit;
        let mut calls = Vec::with_capacity(limit.min(rows.len()));
        let mut last = None;
        for (seq, json) in rows.iter().take(limit) {
            calls.push(from_json("call record", json)?);
            last = Some(*seq);
        }
        Ok(CallPage {
            calls,
            next_cursor: if more { last } else { None },
        })
    })
}

pub(super) fn usage_at(
    db: &SqliteStore,
    tenant: &str,
    since: Option<i64>,
    now: i64,
) -> Result<TenantUsage> {
    let since = since.unwrap_or(i64::MIN);
    db.read(|c| {
        let (cpu_ms, runs, execs): (i64, i64, i64) = c
            .prepare_cached(
                "SELECT COALESCE(SUM(cpu_ms), 0),
                        COALESCE(SUM(kind = 'run'), 0),
                        COALESCE(SUM(kind IN ('exec','process')), 0)
                 FROM calls WHERE tenant = ?1 AND created_unix >= ?2",
            )?
            .query_row(params![tenant, since], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })?;
        let seconds: i64 = c
            .prepare_cached(
                "SELECT COALESCE(SUM(MAX(0,
                            MIN(?3, COALESCE(ended_unix, ?3)) - MAX(created_unix, ?2))), 0)
                 FROM sandboxes
                 WHERE tenant = ?1 AND (ended_unix IS NULL OR ended_unix > ?2)",
            )?
            .query_row(params![tenant, since, now], |r| r.get(0))?;
        let (active, idle, paused, sb_cpu): (i64, i64, i64, i64) = c
            .prepare_cached(
                "SELECT COALESCE(SUM(active_ms), 0), COALESCE(SUM(idle_ms), 0),
                        COALESCE(SUM(paused_ms), 0), COALESCE(SUM(cpu_ms), 0)
                 FROM sandboxes
                 WHERE tenant = ?1 AND ended_unix IS NOT NULL AND ended_unix > ?2",
            )?
            .query_row(params![tenant, since], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
            })?;
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
    })
}
