//! `locker serve --node local`: this server's in-process node as a node of the fleet
//! (`FLEET.md` §4.3, "small fleet, every host identical"). It joins without a token (the
//! server holds the store already) and has no certificate (it calls no fleet route): it
//! beats on the store directly every [`HEARTBEAT`] with what this server runs, and any
//! replica's sweeper declares it dead like any node when those beats stop.
//!
//! Declared dead while this server runs (a stall, a store outage longer than the lease),
//! it returns at once: no sandbox is placed elsewhere yet, so what it runs is still its
//! own. It owns no machine and stops none.

use locker_store::{NodeRecord, NodeState, StoreError};

use super::member::host_report;
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
    let sandboxes = u32::try_from(app.live.read().await.len()).unwrap_or(u32::MAX);
    let warm = u32::try_from(app.pool.len()).unwrap_or(u32::MAX);
    let r = host_report(
        &app.cfg.data_dir,
        slots,
        sandboxes,
        warm,
        Some(&app.templates),
    );
    serde_json::to_string(&r).unwrap_or_else(|_| "{}".into())
}

/// Registers this server's node (at start: a name held by a node that joined with a
/// certificate stops the start, saying so).
pub async fn register(app: &AppState, cfg: &LocalNodeConfig) -> Result<NodeRecord, String> {
    let rec = NodeRecord {
        id: new_id("node_"),
        name: cfg.name.clone(),
        address: cfg.address.clone(),
        cert_sha256: LOCAL_CERT.into(),
        epoch: 1,
        state: NodeState::Ready,
        joined_at: locker_types::rfc3339(now_s()),
        heartbeat_ms: 0,
        lease_until_ms: 0,
        report: report(app, cfg.slots).await,
    };
    let store = app.store.clone();
    let node = tokio::task::spawn_blocking(move || store.upsert_node(&rec, lease_ms()))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| match e {
            StoreError::Conflict(_) => format!(
                "a node named {:?} joined the fleet with a certificate: give this server \
                 another --node-name",
                cfg.name
            ),
            e => format!("registering this server's node: {e}"),
        })?;
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
                if let Some(n) = store.node_heartbeat(&id, epoch, &report, lease_ms())? {
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
