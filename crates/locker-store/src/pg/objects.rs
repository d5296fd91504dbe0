//! The tenant-owned objects other than sandboxes, on Postgres: snapshots of sandboxes and of
//! volumes, volumes, secrets (sealed values only) and template builds, with the rules of
//! the SQLite store's `snapshots`, `volumes`, `secrets` and `builds`.
//!
//! Owns: the `snapshots`, `volume_snapshots`, `volumes`, `secrets` and `template_builds`
//! tables.

use serde::de::DeserializeOwned;

use super::tenants::require_tenant;
use super::{conflict_on_unique, Conn};
use crate::codec::{from_i64, from_json, to_i64, to_json, unix_of};
use crate::error::{Result, StoreError};
use crate::model::{
    validate_secret_name, validate_volume_name, VolumeRecord, VolumeSnapshotRecord,
};
use crate::{SecretRecord, SnapshotRecord};

/// The two snapshot tables, the only names [`get_record`] and [`delete_row`] take.
fn check_table(table: &str) -> Result<()> {
    if matches!(table, "snapshots" | "volume_snapshots") {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!("no snapshot table {table}")))
    }
}

/// Inserts a snapshot's row into `table`, its owner in `owner_col`; `Conflict` if the id
/// exists.
#[allow(clippy::too_many_arguments)]
fn insert_snapshot_row(
    c: &mut Conn,
    table: &str,
    owner_col: &str,
    id: &str,
    tenant: &str,
    owner: &str,
    created_unix: i64,
    record: &str,
) -> Result<()> {
    require_tenant(c, tenant)?;
    let n = c.execute(
        &format!(
            "INSERT INTO {table} (id, tenant, {owner_col}, created_unix, record)
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (id) DO NOTHING"
        ),
        &[&id, &tenant, &owner, &created_unix, &record],
    )?;
    if n == 0 {
        return Err(StoreError::Conflict(format!(
            "snapshot {id} already exists"
        )));
    }
    Ok(())
}

pub(super) fn insert_snapshot(c: &mut Conn, snap: &SnapshotRecord) -> Result<()> {
    let record = to_json("snapshot", snap)?;
    let created = unix_of("created_at", &snap.created_at)?;
    insert_snapshot_row(
        c,
        "snapshots",
        "sandbox_id",
        &snap.id,
        &snap.tenant,
        &snap.sandbox_id,
        created,
        &record,
    )
}

pub(super) fn insert_volume_snapshot(c: &mut Conn, snap: &VolumeSnapshotRecord) -> Result<()> {
    let record = to_json("volume snapshot", snap)?;
    let created = unix_of("created_at", &snap.created_at)?;
    insert_snapshot_row(
        c,
        "volume_snapshots",
        "volume_id",
        &snap.id,
        &snap.tenant,
        &snap.volume_id,
        created,
        &record,
    )
}

/// The tenant's record `id` of a snapshot table.
pub(super) fn get_record<T: DeserializeOwned>(
    c: &mut Conn,
    table: &str,
    tenant: &str,
    id: &str,
) -> Result<Option<T>> {
    check_table(table)?;
    let row = c.query_opt(
        &format!("SELECT record FROM {table} WHERE tenant = $1 AND id = $2"),
        &[&tenant, &id],
    )?;
    row.map(|r| {
        let json: String = r.try_get(0)?;
        from_json(&format!("{table} {id}"), &json)
    })
    .transpose()
}

fn records<T: DeserializeOwned>(rows: Vec<postgres::Row>, what: &str) -> Result<Vec<T>> {
    rows.iter()
        .map(|r| {
            let json: String = r.try_get(0)?;
            from_json(what, &json)
        })
        .collect()
}

pub(super) fn list_snapshots(c: &mut Conn, tenant: &str) -> Result<Vec<SnapshotRecord>> {
    let rows = c.query(
        "SELECT record FROM snapshots WHERE tenant = $1 ORDER BY created_unix DESC, ord DESC",
        &[&tenant],
    )?;
    records(rows, "snapshot record")
}

pub(super) fn list_volume_snapshots(
    c: &mut Conn,
    tenant: &str,
    volume_id: &str,
) -> Result<Vec<VolumeSnapshotRecord>> {
    let rows = c.query(
        "SELECT record FROM volume_snapshots WHERE tenant = $1 AND volume_id = $2
         ORDER BY created_unix DESC, ord DESC",
        &[&tenant, &volume_id],
    )?;
    records(rows, "volume snapshot record")
}

/// Deletes the tenant's row `id` of a snapshot table.
pub(super) fn delete_row(c: &mut Conn, table: &str, tenant: &str, id: &str) -> Result<bool> {
    check_table(table)?;
    Ok(c.execute(
        &format!("DELETE FROM {table} WHERE tenant = $1 AND id = $2"),
        &[&tenant, &id],
    )? > 0)
}

// ---- volumes ----

const VOLUME_COLUMNS: &str = "id, tenant, name, size_mb, created_at, host";

fn volumes_of(rows: Vec<postgres::Row>) -> Result<Vec<VolumeRecord>> {
    rows.iter()
        .map(|r| {
            Ok(VolumeRecord {
                id: r.try_get(0)?,
                tenant: r.try_get(1)?,
                name: r.try_get(2)?,
                size_mb: from_i64("size_mb", r.try_get(3)?)?,
                created_at: r.try_get(4)?,
                host: r.try_get(5)?,
            })
        })
        .collect()
}

pub(super) fn insert_volume(c: &mut Conn, v: &VolumeRecord) -> Result<()> {
    validate_volume_name(&v.name)?;
    let created = unix_of("created_at", &v.created_at)?;
    let size_mb = to_i64("size_mb", v.size_mb)?;
    require_tenant(c, &v.tenant)?;
    c.execute(
        "INSERT INTO volumes (id, tenant, name, size_mb, created_at, created_unix, host)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &[
            &v.id,
            &v.tenant,
            &v.name,
            &size_mb,
            &v.created_at,
            &created,
            &v.host,
        ],
    )
    .map_err(|e| {
        conflict_on_unique(e, || {
            format!(
                "a volume named {:?} (or with id {}) already exists",
                v.name, v.id
            )
        })
    })?;
    Ok(())
}

pub(super) fn get_volume(
    c: &mut Conn,
    tenant: &str,
    id_or_name: &str,
) -> Result<Option<VolumeRecord>> {
    // An id wins over a name: ids start with `vol_`, which a name may too.
    let rows = c.query(
        &format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE tenant = $1 AND (id = $2 OR name = $2)
             ORDER BY (id = $2) DESC LIMIT 1"
        ),
        &[&tenant, &id_or_name],
    )?;
    Ok(volumes_of(rows)?.pop())
}

/// The tenant's volumes (or every tenant's), oldest first.
pub(super) fn list_volumes(c: &mut Conn, tenant: Option<&str>) -> Result<Vec<VolumeRecord>> {
    let rows = c.query(
        &format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE ($1::text IS NULL OR tenant = $1)
             ORDER BY created_unix, ord"
        ),
        &[&tenant],
    )?;
    volumes_of(rows)
}

pub(super) fn host_volumes(c: &mut Conn, host: &str) -> Result<Vec<VolumeRecord>> {
    c.transaction(|c| {
        c.execute("UPDATE volumes SET host = $1 WHERE host = ''", &[&host])?;
        let rows = c.query(
            &format!(
                "SELECT {VOLUME_COLUMNS} FROM volumes WHERE host = $1 ORDER BY created_unix, ord"
            ),
            &[&host],
        )?;
        volumes_of(rows)
    })
}

/// `Store::delete_node_with_volumes`: the node's row, its volumes' and their snapshots', in
/// one transaction.
pub(super) fn delete_node_with_volumes(
    c: &mut Conn,
    id: &str,
) -> Result<Option<Vec<VolumeRecord>>> {
    c.transaction(|c| {
        if c.execute("DELETE FROM nodes WHERE id = $1", &[&id])? == 0 {
            return Ok(None);
        }
        let rows = c.query(
            &format!("DELETE FROM volumes WHERE host = $1 RETURNING {VOLUME_COLUMNS}"),
            &[&id],
        )?;
        let gone = volumes_of(rows)?;
        for v in &gone {
            c.execute(
                "DELETE FROM volume_snapshots WHERE tenant = $1 AND volume_id = $2",
                &[&v.tenant, &v.id],
            )?;
        }
        Ok(Some(gone))
    })
}

pub(super) fn delete_volume(c: &mut Conn, tenant: &str, id: &str) -> Result<bool> {
    c.transaction(|c| {
        let n = c.execute(
            "DELETE FROM volumes WHERE tenant = $1 AND id = $2",
            &[&tenant, &id],
        )?;
        if n > 0 {
            c.execute(
                "DELETE FROM volume_snapshots WHERE tenant = $1 AND volume_id = $2",
                &[&tenant, &id],
            )?;
        }
        Ok(n > 0)
    })
}

pub(super) fn move_volume(
    c: &mut Conn,
    tenant: &str,
    id: &str,
    (from, to): (&str, &str),
    snapshots: &[VolumeSnapshotRecord],
) -> Result<bool> {
    c.transaction(|c| {
        let n = c.execute(
            "UPDATE volumes SET host = $4 WHERE tenant = $1 AND id = $2 AND host = $3",
            &[&tenant, &id, &from, &to],
        )?;
        if n == 0 {
            return Ok(false);
        }
        for s in snapshots {
            let record = to_json("volume snapshot", s)?;
            c.execute(
                "UPDATE volume_snapshots SET record = $4 WHERE tenant = $1 AND volume_id = $2 AND id = $3",
                &[&tenant, &id, &s.id, &record],
            )?;
        }
        Ok(true)
    })
}

// ---- secrets ----

pub(super) fn insert_secret(c: &mut Conn, s: &SecretRecord) -> Result<()> {
    validate_secret_name(&s.name)?;
    let hosts = to_json("secret hosts", &s.hosts)?;
    require_tenant(c, &s.tenant)?;
    c.execute(
        "INSERT INTO secrets (tenant, name, hosts, env, sealed, created_at, updated_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &[
            &s.tenant,
            &s.name,
            &hosts,
            &s.env,
            &s.sealed,
            &s.created_at,
            &s.updated_at,
        ],
    )
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

/// The tenant's secrets by name, or only the one named `name`.
pub(super) fn list_secrets(
    c: &mut Conn,
    tenant: &str,
    name: Option<&str>,
) -> Result<Vec<SecretRecord>> {
    c.query(
        "SELECT tenant, name, hosts, env, sealed, created_at, updated_at FROM secrets
         WHERE tenant = $1 AND ($2::text IS NULL OR name = $2) ORDER BY name",
        &[&tenant, &name],
    )?
    .iter()
    .map(|r| {
        let hosts: String = r.try_get(2)?;
        Ok(SecretRecord {
            tenant: r.try_get(0)?,
            name: r.try_get(1)?,
            hosts: from_json("secret hosts", &hosts)?,
            env: r.try_get(3)?,
            sealed: r.try_get(4)?,
            created_at: r.try_get(5)?,
            updated_at: r.try_get(6)?,
        })
    })
    .collect()
}

pub(super) fn update_secret(c: &mut Conn, s: &SecretRecord) -> Result<bool> {
    let hosts = to_json("secret hosts", &s.hosts)?;
    Ok(c.execute(
        "UPDATE secrets SET hosts = $3, env = $4, sealed = $5, updated_at = $6
         WHERE tenant = $1 AND name = $2",
        &[&s.tenant, &s.name, &hosts, &s.env, &s.sealed, &s.updated_at],
    )? > 0)
}

pub(super) fn delete_secret(c: &mut Conn, tenant: &str, name: &str) -> Result<bool> {
    Ok(c.execute(
        "DELETE FROM secrets WHERE tenant = $1 AND name = $2",
        &[&tenant, &name],
    )? > 0)
}

// ---- template builds ----

const BUILD_STATES: &[&str] = &["queued", "running", "succeeded", "failed"];

pub(super) fn put_template_build(
    c: &mut Conn,
    id: &str,
    tenant: &str,
    state: &str,
    record: &str,
) -> Result<()> {
    if !BUILD_STATES.contains(&state) {
        return Err(StoreError::Invalid(format!(
            "template build state {state:?} is not one of {BUILD_STATES:?}"
        )));
    }
    let now = crate::model::now_unix();
    c.execute(
        "INSERT INTO template_builds (id, tenant, state, record, created_unix)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (id) DO UPDATE SET state = excluded.state, record = excluded.record
         WHERE template_builds.tenant = excluded.tenant",
        &[&id, &tenant, &state, &record, &now],
    )?;
    Ok(())
}

pub(super) fn get_template_build(c: &mut Conn, tenant: &str, id: &str) -> Result<Option<String>> {
    c.query_opt(
        "SELECT record FROM template_builds WHERE tenant = $1 AND id = $2",
        &[&tenant, &id],
    )?
    .map(|r| Ok(r.try_get(0)?))
    .transpose()
}

pub(super) fn unfinished_template_builds(c: &mut Conn) -> Result<Vec<(String, String)>> {
    c.query(
        "SELECT tenant, record FROM template_builds
         WHERE state IN ('queued', 'running') ORDER BY created_unix, ord",
        &[],
    )?
    .iter()
    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
    .collect()
}

pub(super) fn list_template_builds(c: &mut Conn, tenant: &str, limit: u32) -> Result<Vec<String>> {
    c.query(
        "SELECT record FROM template_builds WHERE tenant = $1
         ORDER BY created_unix DESC, ord DESC LIMIT $2",
        &[&tenant, &i64::from(limit)],
    )?
    .iter()
    .map(|r| Ok(r.try_get(0)?))
    .collect()
}
