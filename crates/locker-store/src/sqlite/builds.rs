//! Template builds' rows: one per build, its state and its record (kept as JSON the
//! server writes and reads back), so that a restart finds the builds it was running.
//!
//! Owns: the `template_builds` table. What a record holds is the server's (its template
//! room); this concern checks only the state.

use rusqlite::{params, OptionalExtension};

use super::SqliteStore;
use crate::error::{Result, StoreError};

const STATES: &[&str] = &["queued", "running", "succeeded", "failed"];

pub(super) fn put_template_build(
    db: &SqliteStore,
    id: &str,
    tenant: &str,
    state: &str,
    record: &str,
) -> Result<()> {
    if !STATES.contains(&state) {
        return Err(StoreError::Invalid(format!(
            "template build state {state:?} is not one of {STATES:?}"
        )));
    }
    let now = crate::model::now_unix();
    db.writer()
        .prepare_cached(
            "INSERT INTO template_builds (id, tenant, state, record, created_unix)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (id) DO UPDATE SET state = excluded.state, record = excluded.record
             WHERE template_builds.tenant = excluded.tenant",
        )?
        .execute(params![id, tenant, state, record, now])?;
    Ok(())
}

pub(super) fn get_template_build(
    db: &SqliteStore,
    tenant: &str,
    id: &str,
) -> Result<Option<String>> {
    db.read(|c| {
        Ok(
            c.prepare_cached("SELECT record FROM template_builds WHERE tenant = ?1 AND id = ?2")?
                .query_row(params![tenant, id], |r| r.get(0))
                .optional()?,
        )
    })
}

pub(super) fn unfinished_template_builds(db: &SqliteStore) -> Result<Vec<(String, String)>> {
    db.read(|c| {
        let mut stmt = c.prepare_cached(
            "SELECT tenant, record FROM template_builds
             WHERE state IN ('queued', 'running') ORDER BY created_unix",
        )?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
    })
}

pub(super) fn list_template_builds(
    db: &SqliteStore,
    tenant: &str,
    limit: u32,
) -> Result<Vec<String>> {
    db.read(|c| {
        let mut stmt = c.prepare_cached(
            "SELECT record FROM template_builds WHERE tenant = ?1
             ORDER BY created_unix DESC, rowid DESC LIMIT ?2",
        )?;
        let rows = stmt.query_map(params![tenant, limit], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
    })
}
