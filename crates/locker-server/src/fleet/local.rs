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
//!
//! A server that *stalled* (stopped, its VM paused, its host frozen) may have been declared
//! dead meanwhile without knowing it, and wakes with its old machines of sandboxes that now
//! run elsewhere: until its next beat has told it and it has fenced, it acts on none of
//! them ([`Awake`]: the reaper's expiries, the idle policy's pauses and calls to its live
//! sandboxes wait), so nothing it does on waking lands on a row another host owns.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Whether this server has run without a gap since its node's last beat (see the module
/// doc; a joined node, `member`, has one too). A gap is a stretch longer than the lease in which its clock moved on and it ran
/// nothing (a [`TICK`] task notices it, and so does any check made before that task ran
/// again); from then on [`Awake::is_open`] is false until a beat *begun after the gap*
/// has come back (and the fence it called for is done). A server that is no node of a
/// fleet is always open. A store that only answers slowly makes no gap: the server runs.
pub struct Awake {
    node: bool,
    /// The longest stretch that is not a gap: the lease.
    gap_ms: u64,
    base: Instant,
    state: std::sync::Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    /// Milliseconds since `base` of the last tick (or check); none before the first (a
    /// server's start, however long, is no gap).
    last_ms: Option<u64>,
    closed: bool,
    /// Counts the gaps seen, so that a beat that began before one cannot open it.
    gaps: u64,
}

/// How often the gap detector runs.
const TICK: Duration = Duration::from_millis(250);
/// How long calls to a live sandbox wait for the beat after a gap before they are refused.
const WAKE_WAIT: Duration = Duration::from_secs(4);

impl Awake {
    /// For a server that is a node (`--node local`, or a joined node: closed until its
    /// first beat is done) or none (always open).
    pub fn new(node: bool) -> Self {
        Self::with_gap(node, LEASE)
    }

    fn with_gap(node: bool, gap: Duration) -> Self {
        Self {
            node,
            gap_ms: u64::try_from(gap.as_millis()).unwrap_or(u64::MAX),
            base: Instant::now(),
            state: std::sync::Mutex::new(Seen {
                closed: node,
                ..Seen::default()
            }),
        }
    }

    /// Notes that the server runs now (a gap since the last note closes it): the state.
    fn note(&self) -> std::sync::MutexGuard<'_, Seen> {
        let now = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let ran_nothing_for = s.last_ms.map_or(0, |last| now.saturating_sub(last));
        s.last_ms = Some(now);
        if ran_nothing_for > self.gap_ms {
            s.gaps += 1;
            if !s.closed {
                s.closed = true;
                tracing::warn!(ran_nothing_for_ms = ran_nothing_for, "this server stalled for longer than its node's lease: it acts on no sandbox until its node's next beat says whether the fleet moved any");
            }
        }
        s
    }

    /// Whether this server may act on its live sandboxes now.
    pub fn is_open(&self) -> bool {
        !self.node || !self.note().closed
    }

    /// [`Awake::is_open`], waiting up to [`WAKE_WAIT`] for the beat after a gap: a 503
    /// saying so when it does not come.
    pub async fn wait_open(&self) -> Result<(), crate::error::ApiError> {
        let t0 = Instant::now();
        while !self.is_open() {
            if t0.elapsed() > WAKE_WAIT {
                return Err(crate::error::ApiError::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    "this host has not yet heard from the fleet since it stalled (its node's \
                     beat has not come back): retry in a few seconds",
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// Where a beat begins: what [`Awake::beaten`] compares.
    pub(super) fn beat_begins(&self) -> u64 {
        self.note().gaps
    }

    /// A beat begun at `since` came back and its fence (if any) is done: open, unless a
    /// gap came after it began.
    pub(super) fn beaten(&self, since: u64) {
        let mut s = self.note();
        if s.gaps == since {
            s.closed = false;
        }
    }

    /// Runs the gap detector until `quitting`.
    pub(super) fn spawn_ticker(app: AppState, mut quitting: tokio::sync::watch::Receiver<bool>) {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            loop {
                tokio::select! {
                    _ = tick.tick() => { drop(app.awake.note()); }
                    _ = quitting.wait_for(|q| *q) => return,
                }
            }
        });
    }
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
    let since = app.awake.beat_begins();
    let node = register(app, cfg, &address).await?;
    // Declared dead while this server was down: what the fleet gave up goes before this
    // server answers anything (its machines were adopted already).
    drop_lost(app, &node.id).await;
    app.awake.beaten(since);
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
    Awake::spawn_ticker(app.clone(), quitting.clone());
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
            let since = app.awake.beat_begins();
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
                    app.awake.beaten(since);
                }
                Ok(Ok(None)) => match register(&app, &cfg, &address).await {
                    Ok(n) => {
                        node = n;
                        serving.store(node.epoch, Ordering::Release);
                        drop_lost(&app, &node.id).await;
                        app.awake.beaten(since);
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

#[cfg(test)]
mod tests {
    use super::Awake;
    use std::time::Duration;

    #[test]
    fn a_server_that_is_no_node_is_always_awake() {
        let a = Awake::with_gap(false, Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(40));
        assert!(a.is_open());
    }

    #[test]
    fn a_gap_closes_until_a_beat_begun_after_it_comes_back() {
        let a = Awake::with_gap(true, Duration::from_millis(200));
        assert!(!a.is_open(), "closed until the node's first beat");
        let first = a.beat_begins();
        a.beaten(first);
        assert!(a.is_open());
        // Running on with checks closer than the gap: open.
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(50));
            assert!(a.is_open());
        }
        // A beat begins, then the server stalls past the gap before it comes back.
        let before = a.beat_begins();
        std::thread::sleep(Duration::from_millis(300));
        a.beaten(before);
        assert!(!a.is_open(), "a beat begun before the gap does not open");
        let after = a.beat_begins();
        assert!(!a.is_open());
        a.beaten(after);
        assert!(a.is_open());
    }
}
