//! Sandboxes' rows: their records, life-cycle states, soft deletes and tombstones, and the
//! sums and lists the quotas and the life-cycle tasks read.
//!
//! Owns: the `sandboxes` table. A deleted sandbox keeps its row (see the crate docs).

use locker_types::rfc3339;
use rusqlite::types::ToSql;
use rusqlite::{params, params_from_iter, OptionalExtension, Row};

use super::codec::{conflict_on_unique, from_i64, from_json, to_i64, to_json, unix_of};
use super::tenants::require_tenant;
use super::SqliteStore;
use crate::error::{Result, StoreError};
use crate::model::{now_unix, SandboxPage, SandboxQuery, SandboxRecord, SandboxState};
use crate::Tombstone;

pub(crate) const SANDBOX_COLUMNS: &str = "id, tenant, state, template, template_digest, runtime, cpus, \
    memory_mb, disk_mb, network, volumes, metadata, env, ttl_s, idle_timeout_s, created_at, \
    expires_at, last_active_at, machine_dir, cpu_ms, peak_memory_bytes, preview_token, public_ports, host";
pub(crate) const LIVE_STATES: &str = "('starting','running','paused')";

/// A sandbox row as SQLite gives it, before the fallible conversions.
pub(crate) struct RawSandbox {
    pub(crate) id: String,
    pub(crate) tenant: String,
    pub(crate) state: String,
    pub(crate) template: String,
    pub(crate) template_digest: String,
    pub(crate) runtime: String,
    pub(crate) cpus: f64,
    pub(crate) memory_mb: i64,
    pub(crate) disk_mb: i64,
    pub(crate) network: String,
    pub(crate) volumes: String,
    pub(crate) metadata: String,
    pub(crate) env: String,
    pub(crate) ttl_s: i64,
    pub(crate) idle_timeout_s: Option<i64>,
    pub(crate) created_at: String,
    pub(crate) expires_at: String,
    pub(crate) last_active_at: String,
    pub(crate) machine_dir: String,
    pub(crate) cpu_ms: i64,
    pub(crate) peak_memory_bytes: i64,
    pub(crate) preview_token: String,
    pub(crate) public_ports: String,
    pub(crate) host: String,
}

/// Reads a row selected with [`SANDBOX_COLUMNS`], in that order.
fn raw_sandbox(r: &Row<'_>) -> rusqlite::Result<RawSandbox> {
    Ok(RawSandbox {
        id: r.get(0)?,
        tenant: r.get(1)?,
        state: r.get(2)?,
        template: r.get(3)?,
        template_digest: r.get(4)?,
        runtime: r.get(5)?,
        cpus: r.get(6)?,
        memory_mb: r.get(7)?,
        disk_mb: r.get(8)?,
        network: r.get(9)?,
        volumes: r.get(10)?,
        metadata: r.get(11)?,
        env: r.get(12)?,
        ttl_s: r.get(13)?,
        idle_timeout_s: r.get(14)?,
        created_at: r.get(15)?,
        expires_at: r.get(16)?,
        last_active_at: r.get(17)?,
        machine_dir: r.get(18)?,
        cpu_ms: r.get(19)?,
        peak_memory_bytes: r.get(20)?,
        preview_token: r.get(21)?,
        public_ports: r.get(22)?,
        host: r.get(23)?,
    })
}

pub(crate) fn decode_sandbox(r: RawSandbox) -> Result<SandboxRecord> {
    let ctx = |field: &str| format!("sandbox {} {field}", r.id);
    Ok(SandboxRecord {
        state: r
            .state
            .parse()
            .map_err(|_| StoreError::Corrupt(format!("{}: {:?}", ctx("state"), r.state)))?,
        cpus: r.cpus,
        memory_mb: from_i64(&ctx("memory_mb"), r.memory_mb)?,
        disk_mb: from_i64(&ctx("disk_mb"), r.disk_mb)?,
        network: from_json(&ctx("network"), &r.network)?,
        volumes: from_json(&ctx("volumes"), &r.volumes)?,
        metadata: from_json(&ctx("metadata"), &r.metadata)?,
        env: from_json(&ctx("env"), &r.env)?,
        ttl_s: from_i64(&ctx("ttl_s"), r.ttl_s)?,
        idle_timeout_s: r
            .idle_timeout_s
            .map(|v| from_i64(&ctx("idle_timeout_s"), v))
            .transpose()?,
        cpu_ms: from_i64(&ctx("cpu_ms"), r.cpu_ms)?,
        peak_memory_bytes: from_i64(&ctx("peak_memory_bytes"), r.peak_memory_bytes)?,
        public_ports: from_json(&ctx("public_ports"), &r.public_ports)?,
        preview_token: r.preview_token,
        id: r.id,
        tenant: r.tenant,
        template: r.template,
        template_digest: r.template_digest,
        runtime: r.runtime,
        created_at: r.created_at,
        expires_at: r.expires_at,
        last_active_at: r.last_active_at,
        machine_dir: r.machine_dir,
        host: r.host,
    })
}

/// A sandbox record turned into column values, checked.
pub(crate) struct SandboxColumns<'a> {
    pub(crate) s: &'a SandboxRecord,
    pub(crate) state: &'static str,
    pub(crate) network: String,
    pub(crate) volumes: String,
    pub(crate) metadata: String,
    pub(crate) env: String,
    pub(crate) memory_mb: i64,
    pub(crate) disk_mb: i64,
    pub(crate) ttl_s: i64,
    pub(crate) idle_timeout_s: Option<i64>,
    pub(crate) cpu_ms: i64,
    pub(crate) peak_memory_bytes: i64,
    pub(crate) public_ports: String,
    pub(crate) created_unix: i64,
    pub(crate) expires_unix: i64,
    pub(crate) last_active_unix: i64,
}

pub(crate) fn encode_sandbox(s: &SandboxRecord) -> Result<SandboxColumns<'_>> {
    if s.id.is_empty() {
        return Err(StoreError::Invalid("a sandbox needs an id".into()));
    }
    if !s.cpus.is_finite() || s.cpus <= 0.0 {
        return Err(StoreError::Invalid(format!(
            "sandbox {}: cpus must be a positive number, got {}",
            s.id, s.cpus
        )));
    }
    Ok(SandboxColumns {
        s,
        state: s.state.as_str(),
        network: to_json("network", &s.network)?,
        volumes: to_json("volumes", &s.volumes)?,
        metadata: to_json("metadata", &s.metadata)?,
        env: to_json("env", &s.env)?,
        memory_mb: to_i64("memory_mb", s.memory_mb)?,
        disk_mb: to_i64("disk_mb", s.disk_mb)?,
        ttl_s: to_i64("ttl_s", s.ttl_s)?,
        idle_timeout_s: s
            .idle_timeout_s
            .map(|v| to_i64("idle_timeout_s", v))
            .transpose()?,
        cpu_ms: to_i64("cpu_ms", s.cpu_ms)?,
        peak_memory_bytes: to_i64("peak_memory_bytes", s.peak_memory_bytes)?,
        public_ports: to_json("public_ports", &s.public_ports)?,
        created_unix: unix_of("created_at", &s.created_at)?,
        expires_unix: unix_of("expires_at", &s.expires_at)?,
        last_active_unix: unix_of("last_active_at", &s.last_active_at)?,
    })
}

impl SandboxColumns<'_> {
    /// Every column a record writes, each bound to the parameter of its name (`:id` for
    /// `id`): the one list both the insert and the update are written from, so a new column
    /// is added in one place.
    fn bound(&self) -> Vec<(&'static str, &dyn ToSql)> {
        let s = self.s;
        vec![
            (":id", &s.id),
            (":tenant", &s.tenant),
            (":state", &self.state),
            (":template", &s.template),
            (":template_digest", &s.template_digest),
            (":runtime", &s.runtime),
            (":cpus", &s.cpus),
            (":memory_mb", &self.memory_mb),
            (":disk_mb", &self.disk_mb),
            (":network", &self.network),
            (":volumes", &self.volumes),
            (":metadata", &self.metadata),
            (":env", &self.env),
            (":ttl_s", &self.ttl_s),
            (":idle_timeout_s", &self.idle_timeout_s),
            (":created_at", &s.created_at),
            (":expires_at", &s.expires_at),
            (":last_active_at", &s.last_active_at),
            (":machine_dir", &s.machine_dir),
            (":cpu_ms", &self.cpu_ms),
            (":peak_memory_bytes", &self.peak_memory_bytes),
            (":preview_token", &s.preview_token),
            (":public_ports", &self.public_ports),
            (":host", &s.host),
            (":created_unix", &self.created_unix),
            (":expires_unix", &self.expires_unix),
            (":last_active_unix", &self.last_active_unix),
        ]
    }
}

/// The column a parameter of [`SandboxColumns::bound`] writes.
fn column(param: &str) -> &str {
    param.trim_start_matches(':')
}

/// `INSERT` of every bound column, and `ended_unix` bound as `:ended_unix`.
fn insert_sql(bound: &[(&str, &dyn ToSql)]) -> String {
    let columns: Vec<&str> = bound.iter().map(|(p, _)| column(p)).collect();
    let params: Vec<&str> = bound.iter().map(|(p, _)| *p).collect();
    format!(
        "INSERT INTO sandboxes ({}, ended_unix) VALUES ({}, :ended_unix)",
        columns.join(", "),
        params.join(", ")
    )
}

/// `UPDATE` of every bound column of the live sandbox `:id` of `:tenant` (which it keeps);
/// `ended_unix` is set once, at `:now`, when the state ends.
fn update_sql(bound: &[(&str, &dyn ToSql)]) -> String {
    let set: Vec<String> = bound
        .iter()
        .map(|(p, _)| column(p))
        .filter(|c| !matches!(*c, "id" | "tenant"))
        .map(|c| format!("{c} = :{c}"))
        .collect();
    format!(
        "UPDATE sandboxes SET {},
             ended_unix = CASE WHEN :state IN ('stopped','failed')
                               THEN COALESCE(ended_unix, :now) END
         WHERE id = :id AND tenant = :tenant AND deleted_unix IS NULL",
        set.join(", ")
    )
}

fn sandbox_not_found(id: &str) -> StoreError {
    StoreError::NotFound(format!("sandbox {id} does not exist"))
}

fn read_sandbox(db: &SqliteStore, sql_where: &str, args: &[&str]) -> Result<Option<SandboxRecord>> {
    db.read(|c| {
        let sql = format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE {sql_where}");
        let mut st = c.prepare_cached(&sql)?;
        let raw = st
            .query_row(params_from_iter(args), raw_sandbox)
            .optional()?;
        raw.map(decode_sandbox).transpose()
    })
}

fn read_sandboxes(db: &SqliteStore, sql: &str, args: &[&str]) -> Result<Vec<SandboxRecord>> {
    db.read(|c| {
        let mut st = c.prepare_cached(sql)?;
        let raws = st
            .query_map(params_from_iter(args), raw_sandbox)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        raws.into_iter().map(decode_sandbox).collect()
    })
}

fn read_ids(db: &SqliteStore, sql: &str, now: i64) -> Result<Vec<String>> {
    db.read(|c| {
        let mut st = c.prepare_cached(sql)?;
        let ids = st
            .query_map([now], |r| r.get(0))?
            .collect::<rusqlite::Result<Vec<String>>>()?;
        Ok(ids)
    })
}

fn read_count(db: &SqliteStore, sql: &str, tenant: &str) -> Result<u64> {
    db.read(|c| {
        let n: i64 = c.prepare_cached(sql)?.query_row([tenant], |r| r.get(0))?;
        from_i64("count", n)
    })
}

pub(super) fn insert_sandbox(db: &SqliteStore, s: &SandboxRecord) -> Result<()> {
    let c = encode_sandbox(s)?;
    let ended = (!s.state.is_live()).then_some(now_unix());
    let mut bound = c.bound();
    let sql = insert_sql(&bound);
    bound.push((":ended_unix", &ended));
    let conn = db.writer();
    require_tenant(&conn, &s.tenant)?;
    conn.prepare_cached(&sql)?
        .execute(bound.as_slice())
        .map_err(|e| conflict_on_unique(e, || format!("sandbox {} already exists", s.id)))?;
    Ok(())
}

pub(super) fn get_sandbox(
    db: &SqliteStore,
    tenant: &str,
    id: &str,
) -> Result<Option<SandboxRecord>> {
    read_sandbox(
        db,
        "id = ?1 AND tenant = ?2 AND deleted_unix IS NULL",
        &[id, tenant],
    )
}

pub(super) fn get_sandbox_any(db: &SqliteStore, id: &str) -> Result<Option<SandboxRecord>> {
    read_sandbox(db, "id = ?1 AND deleted_unix IS NULL", &[id])
}

/// The `WHERE` clause of a tenant's listed sandboxes (not deleted, optionally in `state`,
/// with every metadata pair) and its arguments, the tenant first.
fn list_filter<'a>(
    tenant: &'a str,
    state: Option<SandboxState>,
    metadata: &'a [(String, String)],
) -> (String, Vec<&'a str>) {
    let mut sql = String::from("tenant = ?1 AND deleted_unix IS NULL");
    let mut args: Vec<&str> = vec![tenant];
    if let Some(st) = state {
        args.push(st.as_str());
        sql.push_str(&format!(" AND state = ?{}", args.len()));
    }
    for (k, v) in metadata {
        // json_each compares keys and values exactly, whatever characters they hold
        // (a JSON path would need quoting rules for keys with dots or quotes).
        args.push(k);
        args.push(v);
        sql.push_str(&format!(
            " AND EXISTS (SELECT 1 FROM json_each(sandboxes.metadata) AS m
                 WHERE m.key = ?{} AND m.type = 'text' AND m.value = ?{})",
            args.len() - 1,
            args.len()
        ));
    }
    (sql, args)
}

pub(super) fn list_sandboxes(
    db: &SqliteStore,
    tenant: &str,
    state: Option<SandboxState>,
    metadata: &[(String, String)],
) -> Result<Vec<SandboxRecord>> {
    let (filter, args) = list_filter(tenant, state, metadata);
    let sql = format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE {filter} ORDER BY created_unix, rowid"
    );
    read_sandboxes(db, &sql, &args)
}

pub(super) fn list_sandboxes_page(
    db: &SqliteStore,
    tenant: &str,
    q: &SandboxQuery,
) -> Result<SandboxPage> {
    let (filter, args) = list_filter(tenant, q.state, &q.metadata);
    let order = if q.newest_first {
        "created_unix DESC, rowid DESC"
    } else {
        "created_unix, rowid"
    };
    // SQLite reads a negative LIMIT as none.
    let limit = match q.limit {
        Some(l) => to_i64("limit", l)?,
        None => -1,
    };
    let offset = to_i64("offset", q.offset)?;
    let n = args.len();
    let sql = format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE {filter} ORDER BY {order} LIMIT ?{} OFFSET ?{}",
        n + 1,
        n + 2
    );
    let count = format!("SELECT COUNT(*) FROM sandboxes WHERE {filter}");
    db.read(|c| {
        let mut bound: Vec<&dyn ToSql> = args.iter().map(|a| a as &dyn ToSql).collect();
        bound.push(&limit);
        bound.push(&offset);
        let raws = c
            .prepare_cached(&sql)?
            .query_map(bound.as_slice(), raw_sandbox)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let total: i64 = c
            .prepare_cached(&count)?
            .query_row(params_from_iter(&args), |r| r.get(0))?;
        Ok(SandboxPage {
            sandboxes: raws
                .into_iter()
                .map(decode_sandbox)
                .collect::<Result<_>>()?,
            total: from_i64("count", total)?,
        })
    })
}

pub(super) fn update_sandbox(db: &SqliteStore, s: &SandboxRecord) -> Result<()> {
    let c = encode_sandbox(s)?;
    let now = now_unix();
    let mut bound = c.bound();
    let sql = update_sql(&bound);
    bound.push((":now", &now));
    let n = db
        .writer()
        .prepare_cached(&sql)?
        .execute(bound.as_slice())?;
    if n == 0 {
        return Err(sandbox_not_found(&s.id));
    }
    Ok(())
}

pub(super) fn set_sandbox_state_at(
    db: &SqliteStore,
    id: &str,
    state: SandboxState,
    now: i64,
) -> Result<()> {
    let n = db
        .writer()
        .prepare_cached(
            "UPDATE sandboxes SET state = ?2,
                 ended_unix = CASE WHEN ?2 IN ('stopped','failed')
                                   THEN COALESCE(ended_unix, ?3) END
             WHERE id = ?1 AND deleted_unix IS NULL",
        )?
        .execute(params![id, state.as_str(), now])?;
    if n == 0 {
        return Err(sandbox_not_found(id));
    }
    Ok(())
}

pub(super) fn touch_sandbox(db: &SqliteStore, id: &str, at: i64) -> Result<()> {
    let conn = db.writer();
    let n = conn
        .prepare_cached(
            "UPDATE sandboxes SET last_active_unix = ?2, last_active_at = ?3
             WHERE id = ?1 AND deleted_unix IS NULL AND last_active_unix < ?2",
        )?
        .execute(params![id, at, rfc3339(at)])?;
    if n == 0 {
        // Either missing, or already at least as recent: tell them apart.
        let exists = conn
            .prepare_cached("SELECT 1 FROM sandboxes WHERE id = ?1 AND deleted_unix IS NULL")?
            .exists([id])?;
        if !exists {
            return Err(sandbox_not_found(id));
        }
    }
    Ok(())
}

pub(super) fn delete_sandbox_at(db: &SqliteStore, id: &str, now: i64) -> Result<bool> {
    let n = db
        .writer()
        .prepare_cached(
            "UPDATE sandboxes SET state = 'stopped', env = '{}', deleted_unix = ?2,
                 ended_unix = COALESCE(ended_unix, ?2)
             WHERE id = ?1 AND deleted_unix IS NULL",
        )?
        .execute(params![id, now])?;
    Ok(n > 0)
}

pub(super) fn end_sandbox_at(db: &SqliteStore, id: &str, now: i64, cause: &str) -> Result<bool> {
    let n = db
        .writer()
        .prepare_cached(
            "UPDATE sandboxes SET state = 'stopped', env = '{}', deleted_unix = ?2,
                 ended_unix = COALESCE(ended_unix, ?2), end_cause = ?3
             WHERE id = ?1 AND deleted_unix IS NULL",
        )?
        .execute(params![id, now, cause])?;
    Ok(n > 0)
}

pub(super) fn tombstone_at(
    db: &SqliteStore,
    tenant: &str,
    id: &str,
    now: i64,
) -> Result<Option<Tombstone>> {
    db.read(|c| {
        let row = c
            .prepare_cached(
                "SELECT deleted_unix, expires_unix, end_cause FROM sandboxes
                 WHERE id = ?1 AND tenant = ?2 AND deleted_unix IS NOT NULL
                   AND deleted_unix >= ?3",
            )?
            .query_row(params![id, tenant, now - crate::TOMBSTONE_S], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, Option<String>>(2)?,
                ))
            })
            .optional()?;
        Ok(row.map(|(ended, expires, cause)| {
            // Rows ended before causes were recorded: a delete at or past the expiry
            // was the TTL reaper's.
            let cause = cause.unwrap_or_else(|| {
                if ended >= expires {
                    "expired"
                } else {
                    "deleted"
                }
                .to_owned()
            });
            Tombstone {
                ended_at: rfc3339(ended),
                cause,
            }
        }))
    })
}

pub(super) fn list_live_sandboxes(db: &SqliteStore) -> Result<Vec<SandboxRecord>> {
    read_sandboxes(
        db,
        &format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes
             WHERE deleted_unix IS NULL AND state IN {LIVE_STATES}
             ORDER BY created_unix, rowid"
        ),
        &[],
    )
}

pub(super) fn host_sandboxes(db: &SqliteStore, host: &str) -> Result<Vec<SandboxRecord>> {
    {
        let conn = db.writer();
        conn.prepare_cached(&format!(
            "UPDATE sandboxes SET host = ?1
             WHERE host = '' AND deleted_unix IS NULL AND state IN {LIVE_STATES}"
        ))?
        .execute([host])?;
    }
    read_sandboxes(
        db,
        &format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes
             WHERE host = ?1 AND deleted_unix IS NULL AND state IN {LIVE_STATES}
             ORDER BY created_unix, rowid"
        ),
        &[host],
    )
}

pub(super) fn count_running(db: &SqliteStore, tenant: &str) -> Result<u64> {
    read_count(
        db,
        &format!(
            "SELECT COUNT(*) FROM sandboxes
             WHERE tenant = ?1 AND deleted_unix IS NULL AND state IN {LIVE_STATES}"
        ),
        tenant,
    )
}

pub(super) fn sum_memory_mb(db: &SqliteStore, tenant: &str) -> Result<u64> {
    read_count(
        db,
        &format!(
            "SELECT COALESCE(SUM(memory_mb), 0) FROM sandboxes
             WHERE tenant = ?1 AND deleted_unix IS NULL AND state IN {LIVE_STATES}"
        ),
        tenant,
    )
}

pub(super) fn sum_disk_mb(db: &SqliteStore, tenant: &str) -> Result<u64> {
    read_count(
        db,
        &format!(
            "SELECT (SELECT COALESCE(SUM(disk_mb), 0) FROM sandboxes
                     WHERE tenant = ?1 AND deleted_unix IS NULL AND state IN {LIVE_STATES})
                  + (SELECT COALESCE(SUM(size_mb), 0) FROM volumes WHERE tenant = ?1)"
        ),
        tenant,
    )
}

pub(super) fn expired_sandboxes(db: &SqliteStore, now: i64) -> Result<Vec<String>> {
    read_ids(
        db,
        "SELECT id FROM sandboxes WHERE deleted_unix IS NULL AND expires_unix <= ?1
         ORDER BY expires_unix, id",
        now,
    )
}

pub(super) fn idle_sandboxes(db: &SqliteStore, now: i64) -> Result<Vec<String>> {
    read_ids(
        db,
        "SELECT id FROM sandboxes
         WHERE deleted_unix IS NULL AND state = 'running' AND idle_timeout_s IS NOT NULL
           AND last_active_unix + idle_timeout_s <= ?1
         ORDER BY last_active_unix, id",
        now,
    )
}
