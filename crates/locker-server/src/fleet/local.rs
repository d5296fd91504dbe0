//! `locker serve --node local`: this server's in-process node as a node of the fleet
//! (`FLEET.md` §4.3, "small fleet, every host identical"). It joins without a token (the
//! server holds the store already), under an id kept in the data dir (`fleet/local-node`),
//! and has no certificate (it calls no fleet route): it
//! beats on the store directly every [`HEARTBEAT`] with what this server runs, and any
//! replica's sweeper declares it dead like any node when those beats stop.
//!
//! Declared dead while this server runs (a stall, a store outage longer than the lease),
//! it returns at once: no sandbox is placed elsewhere yet, so what it runs is still its
//! own. It owns no machine and stops none.

use locker_store::{NodeRecord, NodeState, StoreError};

use super::{HEARTBEAT, LEASE};
use crate::ids::{new_id, now_s};
use crate::state::AppState;

/// What `cert_sha256` holds for a node without a certificate.
pub const LOCAL_CERT: &str = "local";

/// How `--node local` was asked for.
#[derive(Debug, Clone)]
pub struct LocalNodeConfig {
    pub name: String,
    /// Where this server's API answers, as other replicas would dial it.
    pub address: String,
    pub slots: u32,
}

fn lease_ms() -> i64 {
    i64::try_from(LEASE.as_millis()).unwrap_or(3000)
}

async fn report(app: &AppState, slots: u32) -> String {
    let r = super::member::live_report(app, &app.cfg.data_dir, slots).await;
    serde_json::to_string(&r).unwrap_or_else(|_| "{}".into())
}

/// This server's node id: kept in `<data-dir>/fleet/local-node`, made at the first start,
/// so that two hosts that happen to share a name never share a row.
fn node_id(data_dir: &std::path::Path) -> Result<String, String> {
    let dir = super::member::fleet_dir(data_dir);
    let path = dir.join("local-node");
    if let Ok(id) = std::fs::read_to_string(&path) {
        let id = id.trim();
        if id.starts_with("node_") && id.len() < 64 {
            return Ok(id.to_owned());
        }
    }
    let id = new_id("node_");
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&path, format!("{id}\n")))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(id)
}

/// Registers this server's node (at start: a name held by another node stops the start,
/// saying so).
pub async fn register(app: &AppState, cfg: &LocalNodeConfig) -> Result<NodeRecord, String> {
    let rec = NodeRecord {
        id: node_id(&app.cfg.data_dir)?,
        name: cfg.name.clone(),
        address: cfg.address.clone(),
        cert_sha256: LOCAL_CERT.into(),
        cert_pem: String::new(),
        public_key: String::new(),
        epoch: 1,
        state: NodeState::Ready,
        joined_at: locker_types::rfc3339(now_s()),
        heartbeat_ms: 0,
        lease_until_ms: 0,
        report: report(app, cfg.slots).await,
        reserved_memory_mb: 0,
        reserved_slots: 0,
    };
    let store = app.store.clone();
    let node = tokio::task::spawn_blocking(move || store.upsert_node(&rec, lease_ms()))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| match e {
            StoreError::Conflict(m) => format!("{m} (--node-name names this server's node)"),
            e => format!("registering this server's node: {e}"),
        })?;
    if let Some(c) = app.fleet.as_ref() {
        c.set_local_node(&node.id);
    }
    tracing::info!(node = %node.id, name = %node.name, epoch = node.epoch, "this server is a node of the fleet (--node local)");
    Ok(node)
}

/// Beats for `node` until `quitting`.
pub fn spawn(
    app: AppState,
    cfg: LocalNodeConfig,
    mut node: NodeRecord,
    mut quitting: tokio::sync::watch::Receiver<bool>,
) {
    tokio::spawn(async move {
        let quit = async move {
            let _ = quitting.wait_for(|q| *q).await;
        };
        tokio::pin!(quit);
        let mut tick = tokio::time::interval(HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = &mut quit => return,
            }
            let report = report(&app, cfg.slots).await;
            let (store, id, epoch) = (app.store.clone(), node.id.clone(), node.epoch);
            let beat = tokio::task::spawn_blocking(move || {
                if let Some(n) =
                    store.node_heartbeat(&id, LOCAL_CERT, epoch, &report, lease_ms())?
                {
                    return Ok(Some(n));
                }
                // Declared dead (or removed): come back, or register again.
                match store.revive_node(&id, lease_ms())? {
                    Some(n) => Ok(Some(n)),
                    None => Ok::<_, StoreError>(
                        store.get_node(&id)?.filter(|n| n.state == NodeState::Ready),
                    ),
                }
            })
            .await;
            match beat {
                Ok(Ok(Some(n))) => {
                    if n.epoch != node.epoch {
                        tracing::warn!(old_epoch = node.epoch, epoch = n.epoch, "this server's node was declared dead (its beats stopped for longer than the lease) and returned");
                    }
                    node = n;
                }
                Ok(Ok(None)) => match register(&app, &cfg).await {
                    Ok(n) => node = n,
                    Err(e) => {
                        tracing::warn!(error = %e, "this server's node was removed and cannot register again")
                    }
                },
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "this server's node could not beat: retrying")
                }
                Err(e) => tracing::warn!(error = %e, "this server's node could not beat: retrying"),
            }
        }
    });
}
