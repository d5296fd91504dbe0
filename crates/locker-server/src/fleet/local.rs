//! `locker serve --node local`: this server's in-process node as a node of the fleet
//! (`FLEET.md` §4.3, "small fleet, every host identical"). It joins without a token (the
//! server holds the store already), under this server's host id (`fleet::host_id`), and
//! beats on the store directly every [`HEARTBEAT`] with what this server runs; any
//! replica's sweeper declares it dead like any node when those beats stop.
//!
//! On a control plane (`--fleet-listen`) it also serves a node listener (`--node-listen`),
//! as a joined node does (`fleet::node`): its certificate is signed here, by the CA this
//! replica holds, and other control replicas route the calls about its sandboxes to it.
//! Its `cert_sha256` stays [`LOCAL_CERT`]: it marks a node whose sandboxes' rows are in the
//! fleet's own store (listed and counted from there, not from placements' views).
//!
//! Declared dead while this server runs (a stall, a store outage longer than the lease), or
//! while it was down, it returns at once, and fences as a joined node does (`member`): the
//! sandboxes the fleet marked lost meanwhile are destroyed here (their lost placements stay
//! for callers to read and delete), and so are the machines of those the fleet started
//! again on another node from a snapshot (`fleet::restart`; their rows and placements are
//! that node's), so no replica serves a sandbox the fleet gave up or moved. Its other
//! machines are the server's own, as on one host.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use locker_store::{NodeRecord, NodeState, PlacementState, StoreError};

use super::{HEARTBEAT, LEASE};
use crate::ids::now_s;
use crate::state::AppState;

/// What `cert_sha256` holds for a control replica's own node (see the module doc).
pub const LOCAL_CERT: &str = "local";

/// Whether `n` is a control replica's own node (`--node local`), whose sandboxes' and
/// volumes' records are the fleet's own rows, rather than a joined node, which keeps its own.
pub fn is_own_node(n: &NodeRecord) -> bool {
    n.cert_sha256 == LOCAL_CERT
}

/// How `--node local` was asked for.
#[derive(Debug, Clone)]
pub struct LocalNodeConfig {
    pub name: String,
    /// Where the node listener binds (`--node-listen`; port 0: any free one). Used only on
    /// a control plane (`--fleet-listen`): without one no other replica routes here.
    pub listen: SocketAddr,
    pub slots: u32,
}

/// This server's node, registered, with its listener when it has one.
pub struct LocalNode {
    cfg: LocalNodeConfig,
    node: NodeRecord,
    listener: Option<(std::net::TcpListener, Arc<rustls::ServerConfig>)>,
}

/// Binds the node listener (on a control plane) and registers this server's node under the
/// address other replicas dial (at start: a name held by another node stops the start,
/// saying so).
pub async fn start(app: &AppState, cfg: &LocalNodeConfig) -> Result<LocalNode, String> {
    let (listener, address) = match app.fleet.as_ref() {
        Some(c) => {
            let socket = std::net::TcpListener::bind(cfg.listen).map_err(|e| {
                format!(
                    "cannot listen for control replicas on {}: {e} (--node-listen)",
                    cfg.listen
                )
            })?;
            socket.set_nonblocking(true).map_err(|e| e.to_string())?;
            let bound = socket.local_addr().map_err(|e| e.to_string())?;
            let address = if bound.ip().is_unspecified() {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_ascii_lowercase())
                    .unwrap_or_else(|_| "localhost".into());
                format!("{host}:{}", bound.port())
            } else {
                bound.to_string()
            };
            let tls = c.local_node_tls(&app.host_id)?;
            (Some((socket, tls)), address)
        }
        None => (None, app.cfg.listen.to_string()),
    };
    let node = register(app, cfg, &address).await?;
    // Declared dead while this server was down: what the fleet gave up goes before this
    // server answers anything (its machines were adopted already).
    drop_lost(app, &node.id).await;
    if listener.is_some() {
        tracing::info!(address = %address, "this server's node listener: control replicas route its sandboxes' calls here");
    }
    Ok(LocalNode {
        cfg: cfg.clone(),
        node,
        listener,
    })
}

fn lease_ms() -> i64 {
    i64::try_from(LEASE.as_millis()).unwrap_or(3000)
}

async fn report(app: &AppState, slots: u32) -> String {
    let r = super::member::live_report(app, &app.cfg.data_dir, slots).await;
    serde_json::to_string(&r).unwrap_or_else(|_| "{}".into())
}

/// Registers this server's node at `address`.
async fn register(
    app: &AppState,
    cfg: &LocalNodeConfig,
    address: &str,
) -> Result<NodeRecord, String> {
    let rec = NodeRecord {
        id: app.host_id.clone(),
        name: cfg.name.clone(),
        address: address.to_owned(),
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
        cordoned: false,
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

/// Destroys the sandboxes this server runs whose placements on node `node_id` the fleet
/// marked lost (see the module doc), and the machines of those it started again on another
/// node meanwhile (`fleet::restart`: their placements and rows are that node's now, and
/// stay as they are); how many.
async fn drop_lost(app: &AppState, node_id: &str) -> usize {
    let store = app.store.clone();
    let all = tokio::task::spawn_blocking(move || store.list_placements(None, None)).await;
    let all = match all {
        Ok(Ok(ps)) => ps,
        other => {
            tracing::warn!(result = ?other.map(|r| r.map(|v| v.len())), "cannot read which of this server's sandboxes the fleet marked lost: retrying at the next beat");
            return 0;
        }
    };
    let (mut lost, mut elsewhere) = (Vec::new(), Vec::new());
    {
        let live = app.live.read().await;
        for p in all {
            let Some(sb) = p.sandbox_id.filter(|sb| live.contains_key(sb)) else {
                continue;
            };
            if p.node_id != node_id {
                elsewhere.push(sb);
            } else if p.state == PlacementState::Lost {
                lost.push(sb);
            }
        }
    }
    let mut n = super::destroy_taken(app, lost).await;
    for sb in elsewhere {
        match crate::lifecycle::drop_machine(app, &sb).await {
            Ok(dropped) => n += usize::from(dropped),
            Err(e) => {
                tracing::warn!(sandbox = %sb, error = %e.message, "cannot destroy this server's old machine of a sandbox that runs on another node now")
            }
        }
    }
    if n > 0 {
        tracing::warn!(node = %node_id, destroyed = n, "fenced: destroyed this server's sandboxes that the fleet marked lost, or started elsewhere, while its node was declared dead");
    }
    n
}

/// A volume move control drove to or from this node (with a joined node at the other end,
/// `volumes::handoff`) whose control replica went away half way: past its wait it is
/// settled by the fleet's record, which this server reads itself (a joined node asks in its
/// heartbeat).
async fn settle_moves(app: &AppState) {
    let doubts = crate::volumes::handoff::in_doubt(app).await;
    if doubts.is_empty() {
        return;
    }
    let (store, asked, me) = (app.store.clone(), doubts.clone(), app.host_id.clone());
    let here = tokio::task::spawn_blocking(move || {
        let mut here = Vec::new();
        for k in &asked {
            if store
                .get_volume(&k.tenant, &k.id)?
                .is_some_and(|v| v.host == me)
            {
                here.push(k.id.clone());
            }
        }
        Ok::<_, StoreError>(here)
    })
    .await;
    match here {
        Ok(Ok(here)) => crate::volumes::handoff::settle(app, &doubts, &here).await,
        other => {
            tracing::warn!(result = ?other.map(|r| r.map(|v| v.len())), "cannot read the fleet's records of volumes in doubt: asking again at the next beat")
        }
    }
}

/// Serves the node listener and beats until `quitting`.
pub fn spawn(app: AppState, local: LocalNode, mut quitting: tokio::sync::watch::Receiver<bool>) {
    let LocalNode {
        cfg,
        mut node,
        listener,
    } = local;
    let serving: super::node::Epoch = Arc::new(node.epoch.into());
    if let Some((socket, tls)) = listener {
        match tokio::net::TcpListener::from_std(socket) {
            Ok(l) => super::node::serve(l, tls, app.clone(), serving.clone(), quitting.clone()),
            Err(e) => tracing::error!(error = %e, "this server's node listener cannot start"),
        }
    }
    let address = node.address.clone();
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
            settle_moves(&app).await;
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
                    let returned = n.epoch != node.epoch;
                    if returned {
                        tracing::warn!(old_epoch = node.epoch, epoch = n.epoch, "this server's node was declared dead (its beats stopped for longer than the lease) and returned");
                    }
                    node = n;
                    serving.store(node.epoch, Ordering::Release);
                    if returned {
                        drop_lost(&app, &node.id).await;
                    }
                }
                Ok(Ok(None)) => match register(&app, &cfg, &address).await {
                    Ok(n) => {
                        node = n;
                        serving.store(node.epoch, Ordering::Release);
                        drop_lost(&app, &node.id).await;
                    }
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
