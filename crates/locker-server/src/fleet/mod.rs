//! Fleet mode (issue 25, `FLEET.md`): nodes on other hosts join this control plane, are
//! watched (leases, epochs), run sandboxes placed on them, and get the calls about those
//! sandboxes routed to them.
//!
//! - `pki`: the fleet CA (kept in the store, its key sealed), node certificates, the control
//!   plane's client certificate, the TLS of every end;
//! - `wire`: the bodies node and control exchange;
//! - `control`: this server's side: the control listener (`--fleet-listen`, HTTP/2 with
//!   TLS; client certificates from the fleet CA), join, heartbeats, returns; the admin
//!   routes (`/v1/fleet/…`: mint a join token, list and remove nodes); the lease sweeper;
//! - `member`: a node's side (`locker node`): the engine, join with a token, keep its
//!   identity, beat every [`HEARTBEAT`], fence itself and return when the fleet declared it
//!   dead (destroying what the fleet no longer gives it);
//! - `node`: a node's listener: the engine served to the control plane only, every call at
//!   the node's epoch;
//! - `placement`: where a create goes (filter, score, best of 2, the optimistic
//!   reservation), lost placements, reconciliation with what nodes report;
//! - `route`: the router in front of the API on a control plane;
//! - `drain`: a node's sandboxes carried to other nodes (the nodes' side is `carry`);
//! - `restart`: a dead node's sandboxes started elsewhere from their last snapshot, kept
//!   in the snapshot store (`--snapshot-store`);
//! - `data_plane`: the router in front of preview hosts and E2B's surfaces, which name a
//!   sandbox by host, header or E2B's paths;
//! - `local`: `locker serve --node local`, this server's own node in the fleet's table.
//!
//! It owns the fleet's certificates, sockets and placements. Machines stay the engine's:
//! a node never kills anything because it cannot reach the control plane, only what the
//! fleet told it (at its return) is no longer its own.

pub mod control;
pub mod data_plane;
pub mod drain;
pub mod local;
pub mod member;
pub mod node;
pub mod pki;
pub mod placement;
pub mod restart;
pub mod route;
pub mod snapshot_store;
pub mod wire;

use std::time::Duration;

/// How often a node beats.
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// How long one beat keeps a node alive (three missed beats).
pub const LEASE: Duration = Duration::from_secs(3);
/// How often the sweeper looks for expired leases.
pub const SWEEP: Duration = Duration::from_millis(250);
/// A join token's life when the admin gives none, and the longest one allowed.
pub const TOKEN_TTL: Duration = Duration::from_secs(3600);
pub const TOKEN_TTL_MAX: Duration = Duration::from_secs(7 * 24 * 3600);
/// The prefix of a join token (`lkj_<CA pin>_<secret>`).
pub const TOKEN_PREFIX: &str = "lkj_";

/// A join token's parts: the pin of the CA the node must find at the URL, and the whole
/// token (what the control plane hashes). `None` if it is not shaped like one.
pub fn token_pin(token: &str) -> Option<&str> {
    let rest = token.strip_prefix(TOKEN_PREFIX)?;
    let (pin, secret) = rest.split_once('_')?;
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    (pin.len() == pki::PIN_HEX && hex(pin) && secret.len() >= 32 && hex(secret)).then_some(pin)
}

/// Destroys the sandboxes `ids` this server runs, which the fleet took back from its node
/// (a returning node fences): how many went. One that cannot be read or destroyed is
/// logged and left.
pub(crate) async fn destroy_taken(app: &crate::state::AppState, ids: Vec<String>) -> usize {
    let mut n = 0;
    for id in ids {
        let (store, sid) = (app.store.clone(), id.clone());
        match tokio::task::spawn_blocking(move || store.get_sandbox_any(&sid)).await {
            Ok(Ok(Some(r))) => match crate::lifecycle::destroy(app, &r, "deleted").await {
                Ok(()) => n += 1,
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e.message, "cannot destroy a sandbox the fleet took back")
                }
            },
            other => {
                tracing::warn!(sandbox = %id, result = ?other.map(|r| r.map(|o| o.is_some())), "cannot read a sandbox the fleet took back")
            }
        }
    }
    n
}

/// Accepts on `listener` until `quitting`, at most `max` connections at once (more are
/// closed at once: a peer retries), each handed to `serve` on a task of its own.
pub(crate) fn accept_loop<F, Fut>(
    listener: tokio::net::TcpListener,
    what: &'static str,
    max: usize,
    mut quitting: tokio::sync::watch::Receiver<bool>,
    serve: F,
) where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(max));
    tokio::spawn(async move {
        let quit = async move {
            let _ = quitting.wait_for(|q| *q).await;
        };
        tokio::pin!(quit);
        loop {
            let (tcp, _) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "{what}: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                () = &mut quit => return,
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let conn = serve(tcp);
            tokio::spawn(async move {
                conn.await;
                drop(permit);
            });
        }
    });
}

/// This server's host id (`node_…`): kept in `<data-dir>/fleet/local-node`, made at the
/// first start, so that two hosts that happen to share a name never share a row. It names
/// the machines this server's engine runs in a shared store (`SandboxRecord::host`) and, with
/// `--node local`, its node.
pub fn host_id(data_dir: &std::path::Path) -> Result<String, String> {
    let dir = member::fleet_dir(data_dir);
    let path = dir.join("local-node");
    if let Ok(id) = std::fs::read_to_string(&path) {
        let id = id.trim();
        if id.starts_with("node_") && id.len() < 64 {
            return Ok(id.to_owned());
        }
    }
    let id = crate::ids::new_id("node_");
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&path, format!("{id}\n")))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(id)
}
