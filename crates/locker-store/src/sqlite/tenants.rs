//! Tenants and their API keys: creation, authentication (answered from the in-memory
//! cache after the first lookup), revocation.
//!
//! Owns: the `tenants`, `api_keys` and `pty_tickets` tables and the store's authentication
//! cache. Clear
//! keys never reach SQL: only their SHA-256 does.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use locker_types::rfc3339;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use sha2::{Digest, Sha256};

use super::codec::conflict_on_unique;
use super::SqliteStore;
use crate::error::{Result, StoreError};
use crate::model::{now_unix, validate_tenant_name, KeyInfo, Principal};
use crate::random::{fill_random, hex, new_api_key};

/// The longest clear key `authenticate` hashes; longer ones cannot exist (see
/// `add_key_with_secret`), so they are refused without work.
pub(crate) const MAX_KEY_LEN: usize = 1024;

pub(crate) fn hash_key(clear_key: &str) -> [u8; 32] {
    Sha256::digest(clear_key.as_bytes()).into()
}

pub(crate) fn new_key_id() -> Result<String> {
    let mut buf = [0u8; 12];
    fill_random(&mut buf)?;
    Ok(format!("key_{}", hex(&buf)))
}

pub(crate) fn validate_clear_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY_LEN || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(StoreError::Invalid(format!(
            "an API key must be 1 to {MAX_KEY_LEN} printable ASCII characters without spaces \
             (it travels in an `Authorization: Bearer` header)"
        )));
    }
    Ok(())
}

fn tenant_exists_in(conn: &Connection, name: &str) -> Result<bool> {
    Ok(conn
        .prepare_cached("SELECT 1 FROM tenants WHERE name = ?1")?
        .exists([name])?)
}

pub(super) fn require_tenant(conn: &Connection, name: &str) -> Result<()> {
    if tenant_exists_in(conn, name)? {
        Ok(())
    } else {
        Err(StoreError::NotFound(format!(
            "tenant {name} does not exist (create it with POST /v1/tenants or \
             `locker tenant create {name}`)"
        )))
    }
}

pub(super) fn ensure_tenant(db: &SqliteStore, name: &str) -> Result<()> {
    validate_tenant_name(name)?;
    let now = now_unix();
    db.writer().execute(
        "INSERT INTO tenants (name, created_at, created_unix) VALUES (?1, ?2, ?3)
         ON CONFLICT (name) DO NOTHING",
        params![name, rfc3339(now), now],
    )?;
    Ok(())
}

pub(super) fn create_tenant(db: &SqliteStore, name: &str) -> Result<()> {
    validate_tenant_name(name)?;
    let now = now_unix();
    db.writer()
        .execute(
            "INSERT INTO tenants (name, created_at, created_unix) VALUES (?1, ?2, ?3)",
            params![name, rfc3339(now), now],
        )
        .map_err(|e| conflict_on_unique(e, || format!("tenant {name} already exists")))?;
    Ok(())
}

pub(super) fn tenant_exists(db: &SqliteStore, name: &str) -> Result<bool> {
    db.read(|c| tenant_exists_in(c, name))
}

pub(super) fn list_tenants(db: &SqliteStore) -> Result<Vec<String>> {
    db.read(|c| {
        let mut st = c.prepare_cached("SELECT name FROM tenants ORDER BY name")?;
        let names = st
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<Vec<String>>>()?;
        Ok(names)
    })
}

pub(super) fn create_key(db: &SqliteStore, tenant: &str) -> Result<(KeyInfo, String)> {
    let clear = new_api_key()?;
    let info = KeyInfo {
        key_id: new_key_id()?,
        tenant: tenant.to_string(),
        created_at: rfc3339(now_unix()),
    };
    let conn = db.writer();
    require_tenant(&conn, tenant)?;
    conn.execute(
        "INSERT INTO api_keys (key_id, tenant, key_hash, created_at) VALUES (?1, ?2, ?3, ?4)",
        params![
            info.key_id,
            info.tenant,
            &hash_key(&clear)[..],
            info.created_at
        ],
    )?;
    Ok((info, clear))
}

pub(super) fn add_key_with_secret(
    db: &SqliteStore,
    tenant: &str,
    clear_key: &str,
) -> Result<KeyInfo> {
    validate_clear_key(clear_key)?;
    let hash = hash_key(clear_key);
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    require_tenant(&tx, tenant)?;
    let existing = tx
        .query_row(
            "SELECT key_id, tenant, created_at, revoked_unix FROM api_keys
             WHERE key_hash = ?1",
            [&hash[..]],
            |r| {
                Ok((
                    KeyInfo {
                        key_id: r.get(0)?,
                        tenant: r.get(1)?,
                        created_at: r.get(2)?,
                    },
                    r.get::<_, Option<i64>>(3)?,
                ))
            },
        )
        .optional()?;
    if let Some((info, revoked)) = existing {
        if info.tenant != tenant {
            return Err(StoreError::Conflict(format!(
                "this API key already belongs to another tenant ({}); choose a different key",
                info.tenant
            )));
        }
        if revoked.is_some() {
            return Err(StoreError::Conflict(format!(
                "this API key was revoked ({}); revoked keys stay revoked: choose a new key",
                info.key_id
            )));
        }
        return Ok(info);
    }
    let info = KeyInfo {
        key_id: new_key_id()?,
        tenant: tenant.to_string(),
        created_at: rfc3339(now_unix()),
    };
    tx.execute(
        "INSERT INTO api_keys (key_id, tenant, key_hash, created_at) VALUES (?1, ?2, ?3, ?4)",
        params![info.key_id, info.tenant, &hash[..], info.created_at],
    )?;
    tx.commit()?;
    Ok(info)
}

pub(super) fn authenticate(db: &SqliteStore, clear_key: &str) -> Result<Option<Principal>> {
    if clear_key.is_empty() || clear_key.len() > MAX_KEY_LEN {
        return Ok(None);
    }
    let hash = hash_key(clear_key);
    let cache = db.auth_cache.read().unwrap_or_else(PoisonError::into_inner);
    if let Some(p) = cache.get(&hash) {
        return Ok(Some(p.clone()));
    }
    drop(cache);
    // Read the generation before the lookup: if a revoke commits after our read, it
    // bumps the generation and we must not cache what we read.
    let generation = db.auth_generation.load(Ordering::SeqCst);
    let found = db.read(|c| {
        Ok(c.prepare_cached(
            "SELECT key_id, tenant FROM api_keys
             WHERE key_hash = ?1 AND revoked_unix IS NULL",
        )?
        .query_row([&hash[..]], |r| {
            Ok(Principal {
                key_id: r.get(0)?,
                tenant: r.get(1)?,
            })
        })
        .optional()?)
    })?;
    if let Some(p) = &found {
        let mut cache = db
            .auth_cache
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if db.auth_generation.load(Ordering::SeqCst) == generation {
            cache.insert(hash, p.clone());
        }
    }
    Ok(found)
}

pub(super) fn revoke_key(db: &SqliteStore, key_id: &str) -> Result<bool> {
    let changed = db.writer().execute(
        "UPDATE api_keys SET revoked_unix = ?1 WHERE key_id = ?2 AND revoked_unix IS NULL",
        params![now_unix(), key_id],
    )?;
    let mut cache = db
        .auth_cache
        .write()
        .unwrap_or_else(PoisonError::into_inner);
    db.auth_generation.fetch_add(1, Ordering::SeqCst);
    cache.retain(|_, p| p.key_id != key_id);
    Ok(changed > 0)
}

pub(super) fn list_keys(db: &SqliteStore, tenant: &str) -> Result<Vec<KeyInfo>> {
    db.read(|c| {
        let mut st = c.prepare_cached(
            "SELECT key_id, tenant, created_at FROM api_keys
             WHERE tenant = ?1 AND revoked_unix IS NULL ORDER BY created_at, key_id",
        )?;
        let keys = st
            .query_map([tenant], |r| {
                Ok(KeyInfo {
                    key_id: r.get(0)?,
                    tenant: r.get(1)?,
                    created_at: r.get(2)?,
                })
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(keys)
    })
}

/// See `Store::put_ticket`.
pub(super) fn put_ticket(
    db: &SqliteStore,
    t: &crate::TicketRecord,
    now_ms: i64,
    max: u64,
) -> Result<bool> {
    let mut conn = db.writer();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.execute("DELETE FROM pty_tickets WHERE expires_ms <= ?1", [now_ms])?;
    let live: i64 = tx.query_row("SELECT COUNT(*) FROM pty_tickets", [], |r| r.get(0))?;
    if u64::try_from(live).unwrap_or(0) >= max {
        return Ok(false);
    }
    tx.execute(
        "INSERT INTO pty_tickets (hash, tenant, key_id, sandbox_id, expires_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5)",
        params![t.hash, t.tenant, t.key_id, t.sandbox_id, t.expires_ms],
    )?;
    tx.commit()?;
    Ok(true)
}

/// See `Store::take_ticket`.
pub(super) fn take_ticket(
    db: &SqliteStore,
    hash: &str,
    now_ms: i64,
) -> Result<Option<crate::TicketRecord>> {
    let conn = db.writer();
    let t = conn
        .query_row(
            "DELETE FROM pty_tickets WHERE hash = ?1 \
             RETURNING hash, tenant, key_id, sandbox_id, expires_ms",
            [hash],
            |r| {
                Ok(crate::TicketRecord {
                    hash: r.get(0)?,
                    tenant: r.get(1)?,
                    key_id: r.get(2)?,
                    sandbox_id: r.get(3)?,
                    expires_ms: r.get(4)?,
                })
            },
        )
        .optional()?;
    Ok(t.filter(|t| t.expires_ms > now_ms))
}
