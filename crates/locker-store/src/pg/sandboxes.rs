//! Sandboxes' rows on Postgres: the same records, states, soft deletes and tombstones as
//! `sqlite/sandboxes.rs`, whose checked encoding and decoding they share.
//!
//! Owns: the `sandboxes` table.

use locker_types::rfc3339;
use postgres::types::ToSql;
use postgres::Row;

use super::tenants::require_tenant;
use super::{conflict_on_unique, Conn};
use crate::codec::from_i64;
use crate::error::{Result, StoreError};
use crate::model::{now_unix, SandboxPage, SandboxQuery, SandboxRecord, SandboxState};
use crate::sqlite::sandboxes::{
    decode_sandbox, encode_sandbox, RawSandbox, SandboxColumns, LIVE_STATES, SANDBOX_COLUMNS,
};
use crate::Tombstone;

/// Every column a record writes, in order (`$1` is `id`, `$2` `tenant`, `$3` `state`).
const WRITTEN: [&str; 27] = [
    "id",
    "tenant",
    "state",
    "template",
    "template_digest",
    "runtime",
    "cpus",
    "memory_mb",
    "disk_mb",
    "network",
    "volumes",
    "metadata",
    "env",
    "ttl_s",
    "idle_timeout_s",
    "created_at",
    "expires_at",
    "last_active_at",
    "machine_dir",
    "cpu_ms",
    "peak_memory_bytes",
    "preview_token",
    "public_ports",
    "host",
    "created_unix",
    "expires_unix",
    "last_active_unix",
];

/// The values of [`WRITTEN`], in its order.
fn values<'a>(c: &'a SandboxColumns<'a>) -> [&'a (dyn ToSql + Sync); 27] {
    let s = c.s;
    [
        &s.id,
        &s.tenant,
        &c.state,
        &s.template,
        &s.template_digest,
        &s.runtime,
        &s.cpus,
        &c.memory_mb,
        &c.disk_mb,
        &c.network,
        &c.volumes,
        &c.metadata,
        &c.env,
        &c.ttl_s,
        &c.idle_timeout_s,
        &s.created_at,
        &s.expires_at,
        &s.last_active_at,
        &s.machine_dir,
        &c.cpu_ms,
        &c.peak_memory_bytes,
        &s.preview_token,
        &c.public_ports,
        &s.host,
        &c.created_unix,
        &c.expires_unix,
        &c.last_active_unix,
    ]
}

fn raw_sandbox(r: &Row) -> Result<RawSandbox> {
    Ok(RawSandbox {
        id: r.try_get(0)?,
        tenant: r.try_get(1)?,
        state: r.try_get(2)?,
        template: r.try_get(3)?,
        template_digest: r.try_get(4)?,
        runtime: r.try_get(5)?,
        cpus: r.try_get(6)?,
        memory_mb: r.try_get(7)?,
        disk_mb: r.try_get(8)?,
        network: r.try_get(9)?,
        volumes: r.try_get(10)?,
        metadata: r.try_get(11)?,
        env: r.try_get(12)?,
        ttl_s: r.try_get(13)?,
        idle_timeout_s: r.try_get(14)?,
        created_at: r.try_get(15)?,
        expires_at: r.try_get(16)?,
        last_active_at: r.try_get(17)?,
        machine_dir: r.try_get(18)?,
        cpu_ms: r.try_get(19)?,
        peak_memory_bytes: r.try_get(20)?,
        preview_token: r.try_get(21)?,
        public_ports: r.try_get(22)?,
        host: r.try_get(23)?,
    })
}

fn decode_rows(rows: Vec<Row>) -> Result<Vec<SandboxRecord>> {
    rows.iter()
        .map(|r| decode_sandbox(raw_sandbox(r)?))
        .collect()
}

fn sandbox_not_found(id: &str) -> StoreError {
    StoreError::NotFound(format!("sandbox {id} does not exist"))
}

pub(super) fn insert_sandbox(c: &mut Conn, s: &SandboxRecord) -> Result<()> {
    let cols = encode_sandbox(s)?;
    let ended = (!s.state.is_live()).then_some(now_unix());
    let mut params: Vec<&(dyn ToSql + Sync)> = values(&cols).to_vec();
    params.push(&ended);
    let placeholders: Vec<String> = (1..=params.len()).map(|i| format!("${i}")).collect();
    let sql = format!(
        "INSERT INTO sandboxes ({}, ended_unix) VALUES ({})",
        WRITTEN.join(", "),
        placeholders.join(", ")
    );
    require_tenant(c, &s.tenant)?;
    c.execute(&sql, &params)
        .map_err(|e| conflict_on_unique(e, || format!("sandbox {} already exists", s.id)))?;
    Ok(())
}

/// The live sandbox `id`, of `tenant` when given.
pub(super) fn get_sandbox(
    c: &mut Conn,
    tenant: Option<&str>,
    id: &str,
) -> Result<Option<SandboxRecord>> {
    let row = c.query_opt(
        &format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes
             WHERE id = $1 AND ($2::text IS NULL OR tenant = $2) AND deleted_unix IS NULL"
        ),
        &[&id, &tenant],
    )?;
    row.map(|r| decode_sandbox(raw_sandbox(&r)?)).transpose()
}

pub(super) fn list_sandboxes(
    c: &mut Conn,
    tenant: &str,
    state: Option<SandboxState>,
    metadata: &[(String, String)],
) -> Result<Vec<SandboxRecord>> {
    let q = SandboxQuery {
        state,
        metadata: metadata.to_vec(),
        ..Default::default()
    };
    Ok(list_sandboxes_page(c, tenant, &q, false)?.sandboxes)
}

/// A page of the tenant's live sandboxes (oldest or newest first, ties by insertion) and,
/// when `count`, how many match in all.
pub(super) fn list_sandboxes_page(
    c: &mut Conn,
    tenant: &str,
    q: &SandboxQuery,
    count: bool,
) -> Result<SandboxPage> {
    let state = q.state.map(SandboxState::as_str);
    let mut filter =
        "tenant = $1 AND deleted_unix IS NULL AND ($2::text IS NULL OR state = $2)".to_owned();
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![&tenant, &state];
    for (k, v) in &q.metadata {
        // Exact key and a string value equal to `v`, whatever characters either holds.
        params.push(k);
        params.push(v);
        filter.push_str(&format!(
            " AND metadata::jsonb -> ${}::text = to_jsonb(${}::text)",
            params.len() - 1,
            params.len()
        ));
    }
    let order = if q.newest_first {
        "created_unix DESC, ord DESC"
    } else {
        "created_unix, ord"
    };
    let limit: Option<i64> = q
        .limit
        .map(|l| {
            i64::try_from(l).map_err(|_| StoreError::Invalid(format!("limit {l} is too large")))
        })
        .transpose()?;
    let offset = i64::try_from(q.offset)
        .map_err(|_| StoreError::Invalid(format!("offset {} is too large", q.offset)))?;
    let n = params.len();
    let sql = format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE {filter} ORDER BY {order} LIMIT ${} OFFSET ${}",
        n + 1,
        n + 2
    );
    let total = if count {
        let row = c.query_one(
            &format!("SELECT COUNT(*) FROM sandboxes WHERE {filter}"),
            &params,
        )?;
        from_i64("count", row.get::<_, i64>(0))?
    } else {
        0
    };
    params.push(&limit);
    params.push(&offset);
    let sandboxes = decode_rows(c.query(&sql, &params)?)?;
    let total = if count { total } else { sandboxes.len() as u64 };
    Ok(SandboxPage { sandboxes, total })
}

pub(super) fn update_sandbox(c: &mut Conn, s: &SandboxRecord) -> Result<()> {
    let cols = encode_sandbox(s)?;
    let now = now_unix();
    let mut params: Vec<&(dyn ToSql + Sync)> = values(&cols).to_vec();
    params.push(&now);
    let set: Vec<String> = WRITTEN
        .iter()
        .enumerate()
        .skip(2)
        .map(|(i, col)| format!("{col} = ${}", i + 1))
        .collect();
    let sql = format!(
        "UPDATE sandboxes SET {},
             ended_unix = CASE WHEN $3 IN ('stopped','failed')
                               THEN COALESCE(ended_unix, ${}) END
         WHERE id = $1 AND tenant = $2 AND deleted_unix IS NULL",
        set.join(", "),
        params.len()
    );
    if c.execute(&sql, &params)? == 0 {
        return Err(sandbox_not_found(&s.id));
    }
    Ok(())
}

pub(super) fn set_sandbox_state_at(
    c: &mut Conn,
    id: &str,
    state: SandboxState,
    now: i64,
) -> Result<()> {
    let n = c.execute(
        "UPDATE sandboxes SET state = $2,
             ended_unix = CASE WHEN $2 IN ('stopped','failed')
                               THEN COALESCE(ended_unix, $3) END
         WHERE id = $1 AND deleted_unix IS NULL",
        &[&id, &state.as_str(), &now],
    )?;
    if n == 0 {
        return Err(sandbox_not_found(id));
    }
    Ok(())
}

pub(super) fn touch_sandbox(c: &mut Conn, id: &str, at: i64) -> Result<()> {
    let n = c.execute(
        "UPDATE sandboxes SET last_active_unix = $2, last_active_at = $3
         WHERE id = $1 AND deleted_unix IS NULL AND last_active_unix < $2",
        &[&id, &at, &rfc3339(at)],
    )?;
    if n == 0 {
        // Either missing, or already at least as recent: tell them apart.
        let exists = c
            .query_opt(
                "SELECT 1 FROM sandboxes WHERE id = $1 AND deleted_unix IS NULL",
                &[&id],
            )?
            .is_some();
        if !exists {
            return Err(sandbox_not_found(id));
        }
    }
    Ok(())
}

/// Soft-deletes the sandbox; `cause` recorded for its tombstone when given.
pub(super) fn end_sandbox_at(
    c: &mut Conn,
    id: &str,
    now: i64,
    cause: Option<&str>,
) -> Result<bool> {
    let n = c.execute(
        "UPDATE sandboxes SET state = 'stopped', env = '{}', deleted_unix = $2,
             ended_unix = COALESCE(ended_unix, $2), end_cause = COALESCE($3, end_cause)
         WHERE id = $1 AND deleted_unix IS NULL",
        &[&id, &now, &cause],
    )?;
    Ok(n > 0)
}

pub(super) fn tombstone_at(
    c: &mut Conn,
    tenant: &str,
    id: &str,
    now: i64,
) -> Result<Option<Tombstone>> {
    let row = c.query_opt(
        "SELECT deleted_unix, expires_unix, end_cause FROM sandboxes
         WHERE id = $1 AND tenant = $2 AND deleted_unix IS NOT NULL AND deleted_unix >= $3",
        &[&id, &tenant, &(now - crate::TOMBSTONE_S)],
    )?;
    let Some(row) = row else { return Ok(None) };
    let (ended, expires): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
    let cause: Option<String> = row.try_get(2)?;
    // Rows ended before causes were recorded: a delete at or past the expiry was the
    // TTL reaper's (as in the SQLite store).
    let cause = cause.unwrap_or_else(|| {
        if ended >= expires {
            "expired"
        } else {
            "deleted"
        }
        .to_owned()
    });
    Ok(Some(Tombstone {
        ended_at: rfc3339(ended),
        cause,
    }))
}

pub(super) fn list_live_sandboxes(c: &mut Conn) -> Result<Vec<SandboxRecord>> {
    decode_rows(c.query(
        &format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes
             WHERE deleted_unix IS NULL AND state IN {LIVE_STATES}
             ORDER BY created_unix, ord"
        ),
        &[],
    )?)
}

pub(super) fn host_sandboxes(c: &mut Conn, host: &str) -> Result<Vec<SandboxRecord>> {
    c.transaction(|c| {
        c.execute(
            &format!(
                "UPDATE sandboxes SET host = $1
                 WHERE host = '' AND deleted_unix IS NULL AND state IN {LIVE_STATES}"
            ),
            &[&host],
        )?;
        decode_rows(c.query(
            &format!(
                "SELECT {SANDBOX_COLUMNS} FROM sandboxes
                 WHERE host = $1 AND deleted_unix IS NULL AND state IN {LIVE_STATES}
                 ORDER BY created_unix, ord"
            ),
            &[&host],
        )?)
    })
}

fn count(c: &mut Conn, sql: &str, tenant: &str) -> Result<u64> {
    let n: i64 = c.query_one(sql, &[&tenant])?.try_get(0)?;
    from_i64("count", n)
}

pub(super) fn count_running(c: &mut Conn, tenant: &str) -> Result<u64> {
    count(
        c,
        &format!(
            "SELECT COUNT(*) FROM sandboxes
             WHERE tenant = $1 AND deleted_unix IS NULL AND state IN {LIVE_STATES}"
        ),
        tenant,
    )
}

pub(super) fn sum_memory_mb(c: &mut Conn, tenant: &str) -> Result<u64> {
    count(
        c,
        &format!(
            "SELECT COALESCE(SUM(memory_mb), 0)::bigint FROM sandboxes
             WHERE tenant = $1 AND deleted_unix IS NULL AND state IN {LIVE_STATES}"
        ),
        tenant,
    )
}

pub(super) fn sum_disk_mb(c: &mut Conn, tenant: &str) -> Result<u64> {
    count(
        c,
        &format!(
            "SELECT ((SELECT COALESCE(SUM(disk_mb), 0) FROM sandboxes
                      WHERE tenant = $1 AND deleted_unix IS NULL AND state IN {LIVE_STATES})
                   + (SELECT COALESCE(SUM(size_mb), 0) FROM volumes WHERE tenant = $1))::bigint"
        ),
        tenant,
    )
}

fn ids(c: &mut Conn, sql: &str, now: i64) -> Result<Vec<String>> {
    c.query(sql, &[&now])?
        .iter()
        .map(|r| Ok(r.try_get(0)?))
        .collect()
}

pub(super) fn expired_sandboxes(c: &mut Conn, now: i64) -> Result<Vec<String>> {
    ids(
        c,
        "SELECT id FROM sandboxes WHERE deleted_unix IS NULL AND expires_unix <= $1
         ORDER BY expires_unix, id",
        now,
    )
}

pub(super) fn idle_sandboxes(c: &mut Conn, now: i64) -> Result<Vec<String>> {
    ids(
        c,
        "SELECT id FROM sandboxes
         WHERE deleted_unix IS NULL AND state = 'running' AND idle_timeout_s IS NOT NULL
           AND last_active_unix + idle_timeout_s <= $1
         ORDER BY last_active_unix, id",
        now,
    )
}
