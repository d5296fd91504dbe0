//! Secrets' rows: a name per tenant, its hosts and env variable, and its value sealed by
//! the server. The store never sees a clear value and never opens one.
//!
//! Owns: the `secrets` table.

use rusqlite::{params, OptionalExtension, Row};

use super::codec::{conflict_on_unique, from_json, to_json};
use super::tenants::require_tenant;
use super::SqliteStore;
use crate::error::Result;
use crate::model::{validate_secret_name, SecretRecord};

const COLUMNS: &str = "tenant, name, hosts, env, sealed, created_at, updated_at";

type Raw = (String, String, String, String, Vec<u8>, String, String);

fn secret_of(r: &Row<'_>) -> rusqlite::Result<Raw> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
    ))
}

fn decode(r: Raw) -> Result<SecretRecord> {
    Ok(SecretRecord {
        tenant: r.0,
        name: r.1,
        hosts: from_json("secret hosts", &r.2)?,
        env: r.3,
        sealed: r.4,
        created_at: r.5,
        updated_at: r.6,
    })
}

pub(super) fn insert_secret(db: &SqliteStore, s: &SecretRecord) -> Result<()> {
    validate_secret_name(&s.name)?;
    let hosts = to_json("secret hosts", &s.hosts)?;
    let conn = db.writer();
    require_tenant(&conn, &s.tenant)?;
    conn.prepare_cached(&format!(
        "INSERT INTO secrets ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
    ))?
    .execute(params![
        s.tenant,
        s.name,
        hosts,
        s.env,
        s.sealed,
        s.created_at,
        s.updated_at
    ])
    .map_err(|e| {
        conflict_on_unique(e, || {
            format!(
                "a secret named {:?} already exists: rotate it with PUT /v1/secrets/{}",
                s.name, s.name
            )
        })
    })?;
    Ok(())
}

pub(super) fn get_secret(
    db: &SqliteStore,
    tenant: &str,
    name: &str,
) -> Result<Option<SecretRecord>> {
    let raw = db.read(|c| {
        Ok(c.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM secrets WHERE tenant = ?1 AND name = ?2"
        ))?
        .query_row(params![tenant, name], secret_of)
        .optional()?)
    })?;
    raw.map(decode).transpose()
}

pub(super) fn list_secrets(db: &SqliteStore, tenant: &str) -> Result<Vec<SecretRecord>> {
    let raw = db.read(|c| {
        Ok(c.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM secrets WHERE tenant = ?1 ORDER BY name"
        ))?
        .query_map([tenant], secret_of)?
        .collect::<rusqlite::Result<Vec<_>>>()?)
    })?;
    raw.into_iter().map(decode).collect()
}

pub(super) fn update_secret(db: &SqliteStore, s: &SecretRecord) -> Result<bool> {
    let hosts = to_json("secret hosts", &s.hosts)?;
    let n = db
        .writer()
        .prepare_cached(
            "UPDATE secrets SET hosts = ?3, env = ?4, sealed = ?5, updated_at = ?6
             WHERE tenant = ?1 AND name = ?2",
        )?
        .execute(params![
            s.tenant,
            s.name,
            hosts,
            s.env,
            s.sealed,
            s.updated_at
        ])?;
    Ok(n > 0)
}

pub(super) fn delete_secret(db: &SqliteStore, tenant: &str, name: &str) -> Result<bool> {
    let n = db
        .writer()
        .prepare_cached("DELETE FROM secrets WHERE tenant = ?1 AND name = ?2")?
        .execute(params![tenant, name])?;
    Ok(n > 0)
}
