//! Tenants and their API keys on Postgres (see `sqlite/tenants.rs` for the rules): the
//! same key format, hashing and messages, and a cache that ages (see the module docs of
//! `pg`).
//!
//! Owns: the `tenants`, `api_keys` and `pty_tickets` tables and the store's authentication
//! cache.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::Instant;

use locker_types::rfc3339;

use super::{conflict_on_unique, Conn, PgStore, AUTH_CACHE_TTL};
use crate::error::{Result, StoreError};
use crate::model::{now_unix, validate_tenant_name, KeyInfo, Principal};
use crate::random::new_api_key;
use crate::sqlite::tenants::{hash_key, new_key_id, validate_clear_key, MAX_KEY_LEN};

pub(super) fn require_tenant(c: &mut Conn, name: &str) -> Result<()> {
    if tenant_exists(c, name)? {
        Ok(())
    } else {
        Err(StoreError::NotFound(format!(
            "tenant {name} does not exist (create it with POST /v1/tenants or \
             `locker tenant create {name}`)"
        )))
    }
}

pub(super) fn ensure_tenant(c: &mut Conn, name: &str) -> Result<()> {
    validate_tenant_name(name)?;
    let now = now_unix();
    c.execute(
        "INSERT INTO tenants (name, created_at, created_unix) VALUES ($1, $2, $3)
         ON CONFLICT (name) DO NOTHING",
        &[&name, &rfc3339(now), &now],
    )?;
    Ok(())
}

pub(super) fn create_tenant(c: &mut Conn, name: &str) -> Result<()> {
    validate_tenant_name(name)?;
    let now = now_unix();
    c.execute(
        "INSERT INTO tenants (name, created_at, created_unix) VALUES ($1, $2, $3)",
        &[&name, &rfc3339(now), &now],
    )
    .map_err(|e| conflict_on_unique(e, || format!("tenant {name} already exists")))?;
    Ok(())
}

pub(super) fn tenant_exists(c: &mut Conn, name: &str) -> Result<bool> {
    Ok(
        c.query_opt("SELECT 1 FROM tenants WHERE name = $1", &[&name])?
            .is_some(),
    )
}

pub(super) fn list_tenants(c: &mut Conn) -> Result<Vec<String>> {
    c.query("SELECT name FROM tenants ORDER BY name", &[])?
        .iter()
        .map(|r| Ok(r.try_get(0)?))
        .collect()
}

pub(super) fn create_key(c: &mut Conn, tenant: &str) -> Result<(KeyInfo, String)> {
    let clear = new_api_key()?;
    let info = KeyInfo {
        key_id: new_key_id()?,
        tenant: tenant.to_string(),
        created_at: rfc3339(now_unix()),
    };
    require_tenant(c, tenant)?;
    c.execute(
        "INSERT INTO api_keys (key_id, tenant, key_hash, created_at) VALUES ($1, $2, $3, $4)",
        &[
            &info.key_id,
            &info.tenant,
            &&hash_key(&clear)[..],
            &info.created_at,
        ],
    )?;
    Ok((info, clear))
}

/// Inserts the key unless its hash is known, then reads whichever row holds the hash: a
/// server racing with another on the same key ends with the one row both agree on.
pub(super) fn add_key_with_secret(c: &mut Conn, tenant: &str, clear_key: &str) -> Result<KeyInfo> {
    validate_clear_key(clear_key)?;
    let hash = hash_key(clear_key);
    c.transaction(|c| {
        require_tenant(c, tenant)?;
        let fresh = KeyInfo {
            key_id: new_key_id()?,
            tenant: tenant.to_string(),
            created_at: rfc3339(now_unix()),
        };
        c.execute(
            "INSERT INTO api_keys (key_id, tenant, key_hash, created_at) VALUES ($1, $2, $3, $4)
             ON CONFLICT (key_hash) DO NOTHING",
            &[&fresh.key_id, &fresh.tenant, &&hash[..], &fresh.created_at],
        )?;
        let row = c.query_one(
            "SELECT key_id, tenant, created_at, revoked_unix FROM api_keys WHERE key_hash = $1",
            &[&&hash[..]],
        )?;
        let info = KeyInfo {
            key_id: row.try_get(0)?,
            tenant: row.try_get(1)?,
            created_at: row.try_get(2)?,
        };
        let revoked: Option<i64> = row.try_get(3)?;
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
        Ok(info)
    })
}

pub(super) fn authenticate(db: &PgStore, clear_key: &str) -> Result<Option<Principal>> {
    if clear_key.is_empty() || clear_key.len() > MAX_KEY_LEN {
        return Ok(None);
    }
    let hash = hash_key(clear_key);
    let cache = db.auth_cache.read().unwrap_or_else(PoisonError::into_inner);
    if let Some((p, at)) = cache.get(&hash) {
        if at.elapsed() < AUTH_CACHE_TTL {
            return Ok(Some(p.clone()));
        }
    }
    drop(cache);
    let generation = db.auth_generation.load(Ordering::SeqCst);
    let found = db.run(move |c| {
        let row = c.query_opt(
            "SELECT key_id, tenant FROM api_keys WHERE key_hash = $1 AND revoked_unix IS NULL",
            &[&&hash[..]],
        )?;
        row.map(|r| {
            Ok(Principal {
                key_id: r.try_get(0)?,
                tenant: r.try_get(1)?,
            })
        })
        .transpose()
    })?;
    let mut cache = db
        .auth_cache
        .write()
        .unwrap_or_else(PoisonError::into_inner);
    match &found {
        Some(p) if db.auth_generation.load(Ordering::SeqCst) == generation => {
            cache.insert(hash, (p.clone(), Instant::now()));
        }
        Some(_) => {}
        // Revoked elsewhere: forget it here too.
        None => {
            cache.remove(&hash);
        }
    }
    Ok(found)
}

pub(super) fn revoke_key(db: &PgStore, key_id: &str) -> Result<bool> {
    let id = key_id.to_owned();
    let changed = db.run(move |c| {
        c.execute(
            "UPDATE api_keys SET revoked_unix = $1 WHERE key_id = $2 AND revoked_unix IS NULL",
            &[&now_unix(), &id],
        )
    })?;
    let mut cache = db
        .auth_cache
        .write()
        .unwrap_or_else(PoisonError::into_inner);
    db.auth_generation.fetch_add(1, Ordering::SeqCst);
    cache.retain(|_, (p, _)| p.key_id != key_id);
    Ok(changed > 0)
}

pub(super) fn list_keys(c: &mut Conn, tenant: &str) -> Result<Vec<KeyInfo>> {
    c.query(
        "SELECT key_id, tenant, created_at FROM api_keys
         WHERE tenant = $1 AND revoked_unix IS NULL ORDER BY created_at, key_id",
        &[&tenant],
    )?
    .iter()
    .map(|r| {
        Ok(KeyInfo {
            key_id: r.try_get(0)?,
            tenant: r.try_get(1)?,
            created_at: r.try_get(2)?,
        })
    })
    .collect()
}

/// See `Store::put_ticket`. The count and the insert are serialized by a transaction-scoped
/// advisory lock, so racing mints never pass `max` together.
pub(super) fn put_ticket(
    c: &mut Conn,
    t: &crate::TicketRecord,
    now_ms: i64,
    max: u64,
) -> Result<bool> {
    c.transaction(|c| {
        c.execute("SELECT pg_advisory_xact_lock($1)", &[&TICKETS_LOCK])?;
        c.execute("DELETE FROM pty_tickets WHERE expires_ms <= $1", &[&now_ms])?;
        let live: i64 = c
            .query_one("SELECT COUNT(*) FROM pty_tickets", &[])?
            .try_get(0)?;
        if u64::try_from(live).unwrap_or(0) >= max {
            return Ok(false);
        }
        c.execute(
            "INSERT INTO pty_tickets (hash, tenant, key_id, sandbox_id, expires_ms) \
             VALUES ($1, $2, $3, $4, $5)",
            &[&t.hash, &t.tenant, &t.key_id, &t.sandbox_id, &t.expires_ms],
        )?;
        Ok(true)
    })
}

/// The advisory lock key of ticket mints (any fixed number no other lock uses).
const TICKETS_LOCK: i64 = 0x6c6f_636b_7463_6b74; // "locktckt"

/// See `Store::take_ticket`.
pub(super) fn take_ticket(
    c: &mut Conn,
    hash: &str,
    now_ms: i64,
) -> Result<Option<crate::TicketRecord>> {
    let row = c.query_opt(
        "DELETE FROM pty_tickets WHERE hash = $1 \
         RETURNING hash, tenant, key_id, sandbox_id, expires_ms",
        &[&hash],
    )?;
    let Some(r) = row else { return Ok(None) };
    let t = crate::TicketRecord {
        hash: r.try_get(0)?,
        tenant: r.try_get(1)?,
        key_id: r.try_get(2)?,
        sandbox_id: r.try_get(3)?,
        expires_ms: r.try_get(4)?,
    };
    Ok((t.expires_ms > now_ms).then_some(t))
}
