//! The control plane's side of the fleet: the control listener nodes call (join,
//! heartbeats, returns), the admin routes (`/v1/fleet/…`), and the lease sweeper.
//!
//! The listener is its own socket (`--fleet-listen`), apart from the API: TLS with the
//! fleet CA's leaf, HTTP/2, client certificates optional at the handshake and required by
//! every route but join. A node is who its certificate says only when the certificate's
//! fingerprint is the one stored for it at join: a removed node's certificate, still
//! signed by the CA, opens nothing.
//!
//! The sweeper declares dead the nodes whose lease ran out, with the two guards of
//! `FLEET.md` §4.5: nobody is declared in the first lease after this server started or
//! after the store came back from an outage (their heartbeats may simply not have been
//! written), and at most max(1, 10%) of the nodes per minute (beyond that it says so
//! instead: many nodes dying at once is more likely the network than the nodes).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Extension, Router};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use locker_store::{JoinTokenRecord, NodeRecord, NodeState, PlacementState, Store, StoreError};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::pki::{self, FleetCa};
use super::wire::{self, Beat, BeatAnswer, EventsTaken, Fenced, Join, Joined, NodeEvents, Return};
use super::{LEASE, SWEEP, TOKEN_PREFIX, TOKEN_TTL, TOKEN_TTL_MAX};
use crate::auth::Admin;
use crate::error::ApiError;
use crate::extract::Json;
use crate::ids::{hex, new_id, now_s};
use crate::state::AppState;

/// A sweeper's round of store calls slower than this is a stall of the store: treated as
/// an outage (a lease of grace).
const STALL: Duration = Duration::from_secs(1);
/// Connections the listener holds at once (a node holds one); more are refused.
const MAX_CONNECTIONS: usize = 4096;
/// HTTP/2 pings on an idle connection, and how long an answer may take: a node that died
/// or was cut off frees its connection within twice this.
const KEEPALIVE: Duration = Duration::from_secs(10);
/// How long a connection without a client certificate (a join) may stay.
const ANONYMOUS_LIFE: Duration = Duration::from_secs(30);

/// How `locker serve` accepts nodes (`--fleet-listen`, `--fleet-name`, `--fleet-url`).
#[derive(Debug, Clone)]
pub struct ControlConfig {
    pub listen: SocketAddr,
    /// Extra names (hosts or addresses) for the listener's certificate.
    pub names: Vec<String>,
    /// The URL nodes dial, when it is not the listen address (behind NAT, a load balancer).
    pub url: Option<String>,
    /// Where snapshots of joined nodes' sandboxes are copied, to restart them elsewhere
    /// should their node die (`restart`); shared by the fleet's control replicas.
    pub snapshot_store: Option<std::path::PathBuf>,
}

/// This server's control listener and what it answers from.
pub struct Control {
    store: Arc<dyn Store>,
    ca: FleetCa,
    tls: Arc<rustls::ServerConfig>,
    /// The bound address (the port is known when `--fleet-listen` said 0).
    pub listen: SocketAddr,
    /// What a join command names.
    pub url: String,
    socket: Mutex<Option<std::net::TcpListener>>,
    /// The nodes as placement last read them.
    pub table: Mutex<super::placement::Table>,
    /// The router's connections to nodes and its route cache.
    pub routes: super::route::Routes,
    /// This server's own node (`--node local`), once registered.
    local: Mutex<Option<String>>,
    /// Sandboxes nodes run without a placement: (node, sandbox) → when first seen.
    pub orphans: Mutex<std::collections::HashMap<(String, String), Instant>>,
    /// The snapshot store (`ControlConfig::snapshot_store`).
    pub snapshot_store: Option<std::path::PathBuf>,
    /// Lost sandboxes being restarted elsewhere, or tried last: sandbox → when (`restart`).
    pub restarts: Mutex<std::collections::HashMap<String, Instant>>,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Control({})", self.listen)
    }
}

/// The certificate fingerprint of a connection's client, if it sent one.
#[derive(Clone, Debug)]
struct Peer(Option<String>);

impl Control {
    /// Opens (or makes) the fleet CA and binds the listener; [`Control::serve`] accepts.
    pub fn open(
        cfg: &ControlConfig,
        store: Arc<dyn Store>,
        sealer: &crate::secrets::Sealer,
    ) -> Result<Arc<Control>, String> {
        let ca = FleetCa::load_or_make(store.as_ref(), sealer)?;
        let socket = std::net::TcpListener::bind(cfg.listen)
            .map_err(|e| format!("cannot listen for nodes on {}: {e}", cfg.listen))?;
        socket.set_nonblocking(true).map_err(|e| e.to_string())?;
        let listen = socket.local_addr().map_err(|e| e.to_string())?;
        let names = pki::listener_names(&cfg.names, listen);
        let tls = ca.server_config(&names)?;
        let url = cfg.url.clone().unwrap_or_else(|| {
            let host = if listen.ip().is_unspecified() {
                names
                    .iter()
                    .find(|n| *n != "localhost" && *n != "127.0.0.1")
                    .cloned()
                    .unwrap_or_else(|| "127.0.0.1".into())
            } else {
                listen.ip().to_string()
            };
            format!("https://{host}:{}", listen.port())
        });
        tracing::info!(listen = %listen, url = %url, ca = %pki::fingerprint(&ca.der), "accepting fleet nodes");
        let routes = super::route::Routes::new(ca.control_client_config()?);
        Ok(Arc::new(Control {
            store,
            ca,
            tls,
            listen,
            url,
            socket: Mutex::new(Some(socket)),
            table: Default::default(),
            routes,
            local: Mutex::new(None),
            orphans: Default::default(),
            snapshot_store: cfg.snapshot_store.clone(),
            restarts: Default::default(),
        }))
    }

    /// Accepts nodes' connections until `quitting`, and runs the sweeper.
    pub fn serve(self: &Arc<Self>, app: AppState, quitting: tokio::sync::watch::Receiver<bool>) {
        let Some(socket) = self.socket.lock().expect("socket").take() else {
            return;
        };
        let listener = match tokio::net::TcpListener::from_std(socket) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "the fleet listener cannot start");
                return;
            }
        };
        let routes = Router::new()
            .route(wire::REGISTER, post(register))
            .route(wire::HEARTBEAT, post(heartbeat))
            .route(wire::RETURN, post(give_back))
            .route(wire::EVENTS, post(take_events))
            .route(wire::SECRETS, post(give_secrets))
            .layer(Extension(app.clone()))
            .with_state(self.clone());
        let acceptor = tokio_rustls::TlsAcceptor::from(self.tls.clone());
        // Full: refuse at once rather than queue (nodes retry every beat).
        super::accept_loop(
            listener,
            "fleet listener",
            MAX_CONNECTIONS,
            quitting.clone(),
            move |tcp| connection(tcp, acceptor.clone(), routes.clone()),
        );
        tokio::spawn(sweep(app, quitting));
    }

    /// The TLS of this server's own node listener (`--node local`), as node `node_id`.
    pub fn local_node_tls(&self, node_id: &str) -> Result<Arc<rustls::ServerConfig>, String> {
        self.ca.local_node_server_config(node_id)
    }

    /// This server's own node's id (`--node local`), if it is one.
    pub fn local_node_id(&self) -> Option<String> {
        self.local.lock().expect("local").clone()
    }

    pub fn set_local_node(&self, id: &str) {
        *self.local.lock().expect("local") = Some(id.to_owned());
    }

    /// A new join token, valid `ttl`: its row (hash only) and its clear text.
    pub fn mint_token(&self, ttl: Duration) -> Result<(JoinTokenRecord, String), ApiError> {
        let mut secret = [0u8; 20];
        locker_store::fill_random(&mut secret).map_err(|e| ApiError::internal(e.to_string()))?;
        let clear = format!("{TOKEN_PREFIX}{}_{}", self.ca.pin(), hex(&secret));
        let now = now_s();
        let rec = JoinTokenRecord {
            id: new_id("jt_"),
            token_hash: Sha256::digest(clear.as_bytes()).to_vec(),
            created_at: locker_types::rfc3339(now),
            expires_unix: now + i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX / 2),
            used_unix: None,
            node_id: None,
        };
        self.store.insert_join_token(&rec)?;
        Ok((rec, clear))
    }
}

/// One node connection: TLS, then HTTP/2 with the client's fingerprint on every request.
async fn connection(
    tcp: tokio::net::TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    routes: Router,
) {
    let tls = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "fleet listener: a TLS handshake failed");
            return;
        }
        Err(_) => return,
    };
    let peer = Peer(
        tls.get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| pki::fingerprint(c)),
    );
    let anonymous = peer.0.is_none();
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(peer.clone());
        let mut routes = routes.clone();
        async move { tower_service::Service::call(&mut routes, req).await }
    });
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(KEEPALIVE))
        .keep_alive_timeout(KEEPALIVE)
        .max_concurrent_streams(16)
        .serve_connection(TokioIo::new(tls), svc);
    if anonymous {
        // Without a certificate only a join can be asked for: one call, then it goes.
        let _ = tokio::time::timeout(ANONYMOUS_LIFE, conn).await;
    } else {
        let _ = conn.await;
    }
}

/// A store call off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(ApiError::from)
}

fn lease_ms() -> i64 {
    i64::try_from(LEASE.as_millis()).unwrap_or(3000)
}

async fn register(
    State(c): State<Arc<Control>>,
    Json(join): Json<Join>,
) -> Result<Response, ApiError> {
    locker_store::validate_node_name(&join.name)?;
    if join.address.is_empty() || join.address.len() > 255 {
        return Err(ApiError::bad_request(
            "address must be the host:port where the node's listener answers (--advertise)",
        ));
    }
    let id = new_id("node_");
    let (cert_pem, cert_sha256) =
        c.ca.sign_node(&id, &join.public_key)
            .map_err(ApiError::bad_request)?;
    let report =
        serde_json::to_string(&join.report).map_err(|e| ApiError::internal(e.to_string()))?;
    let node = NodeRecord {
        id: id.clone(),
        name: join.name.clone(),
        address: join.address.clone(),
        cert_sha256,
        cert_pem,
        public_key: join.public_key.to_ascii_lowercase(),
        epoch: 1,
        state: NodeState::Ready,
        joined_at: locker_types::rfc3339(now_s()),
        heartbeat_ms: 0,
        lease_until_ms: 0,
        report,
        reserved_memory_mb: 0,
        reserved_slots: 0,
        cordoned: false,
    };
    let hash = Sha256::digest(join.token.as_bytes()).to_vec();
    let store = c.store.clone();
    let joined = tokio::task::spawn_blocking(move || store.join_node(&hash, &node, lease_ms()))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let node = match joined {
        Ok(n) => n,
        Err(StoreError::NotFound(m)) => {
            tracing::warn!(name = %join.name, why = %m, "refused a node's join");
            return Err(ApiError::new(StatusCode::FORBIDDEN, m));
        }
        Err(e) => return Err(e.into()),
    };
    tracing::info!(node = %node.id, name = %node.name, address = %node.address, "a node joined the fleet");
    let body = Joined {
        node_id: node.id,
        epoch: node.epoch,
        // The stored one: a retried join gets the certificate it was given the first time.
        cert_pem: node.cert_pem,
        ca_pem: c.ca.pem.clone(),
        heartbeat_ms: u64::try_from(super::HEARTBEAT.as_millis()).unwrap_or(1000),
        lease_ms: u64::try_from(LEASE.as_millis()).unwrap_or(3000),
    };
    Ok((StatusCode::CREATED, axum::Json(body)).into_response())
}

/// The node a call comes from: its certificate must be the one it joined with.
async fn caller(c: &Control, peer: &Peer, node_id: &str) -> Result<NodeRecord, ApiError> {
    let fp = fingerprint_of(peer)?;
    let (store, id) = (c.store.clone(), node_id.to_owned());
    let found = blocking(move || store.get_node(&id)).await?;
    holder(found, node_id, &fp)
}

/// The fingerprint of the caller's certificate; 401 without one.
fn fingerprint_of(peer: &Peer) -> Result<String, ApiError> {
    peer.0.clone().ok_or_else(|| {
        ApiError::unauthorized("this call needs the node's client certificate (made at join)")
    })
}

/// `found` (the row read for `node_id`) if the certificate `fp` is its own: 404 when there
/// is no such node, 403 when the certificate is another's.
fn holder(found: Option<NodeRecord>, node_id: &str, fp: &str) -> Result<NodeRecord, ApiError> {
    let node = found.filter(|n| n.id == node_id).ok_or_else(|| {
        ApiError::not_found(format!(
            "node {node_id} is not in the fleet (removed?): join again with a new token"
        ))
    })?;
    if node.cert_sha256 != fp {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("this certificate is not node {node_id}'s"),
        ));
    }
    Ok(node)
}

fn fenced(node: &NodeRecord) -> Response {
    let body = Fenced {
        message: format!(
            "node {} is {} at epoch {}: fence (serve none of the sandboxes you ran) and return",
            node.id,
            node.state.as_str(),
            node.epoch
        ),
        state: node.state.as_str().to_owned(),
        epoch: node.epoch,
    };
    (StatusCode::CONFLICT, axum::Json(body)).into_response()
}

async fn heartbeat(
    State(c): State<Arc<Control>>,
    Extension(peer): Extension<Peer>,
    Json(beat): Json<Beat>,
) -> Result<Response, ApiError> {
    // One statement when it counts (the certificate is part of its WHERE); the row is read
    // only to say why one did not.
    let fp = fingerprint_of(&peer)?;
    let mut doubts = beat.report.volumes_in_doubt.clone();
    doubts.truncate(wire::DOUBTS_MAX);
    let report =
        serde_json::to_string(&beat.report).map_err(|e| ApiError::internal(e.to_string()))?;
    let (store, id, cert) = (c.store.clone(), beat.node_id.clone(), fp.clone());
    let counted = blocking(move || {
        Ok(
            match store.node_heartbeat(&id, &cert, beat.epoch, &report, lease_ms())? {
                Some(n) => Ok(n),
                None => Err(store.get_node(&id)?),
            },
        )
    })
    .await?;
    match counted {
        Ok(n) => {
            let volumes_here = volumes_here(&c, &n.id, doubts).await;
            Ok(axum::Json(BeatAnswer {
                epoch: n.epoch,
                lease_until_ms: n.lease_until_ms,
                keep: None,
                volumes_here,
            })
            .into_response())
        }
        // Not counted: answer with the row as it is now (the sweeper may just have moved
        // it on), once the certificate is the node's.
        Err(now) => Ok(fenced(&holder(now, &beat.node_id, &fp)?)),
    }
}

/// Of the volumes a node is in doubt about (`Report::volumes_in_doubt`), those whose record
/// names it as their home; `None` when none was asked, or the store could not answer.
async fn volumes_here(
    c: &Control,
    node: &str,
    asked: Vec<crate::volumes::handoff::VolumeKey>,
) -> Option<Vec<String>> {
    if asked.is_empty() {
        return None;
    }
    let (store, node) = (c.store.clone(), node.to_owned());
    let read = blocking(move || {
        let mut here = Vec::new();
        for k in asked {
            let rec = store.get_volume(&k.tenant, &k.id)?;
            if rec.is_some_and(|r| r.id == k.id && r.host == node) {
                here.push(k.id);
            }
        }
        Ok(here)
    })
    .await;
    read.map_err(|e| tracing::warn!(error = %e.message, "cannot say whose the volumes a node asks about are"))
        .ok()
}

/// A node's own events (its sandboxes created, paused, expired, deleted…) into the fleet's
/// stream, so `GET /v1/events` and webhooks see them; each names its node in `data`.
async fn take_events(
    State(c): State<Arc<Control>>,
    Extension(peer): Extension<Peer>,
    Extension(app): Extension<AppState>,
    Json(batch): Json<NodeEvents>,
) -> Result<Response, ApiError> {
    if batch.events.len() > wire::EVENTS_MAX {
        return Err(ApiError::bad_request(format!(
            "at most {} events a call",
            wire::EVENTS_MAX
        )));
    }
    let node = caller(&c, &peer, &batch.node_id).await?;
    // What a node changes of a sandbox by itself (its idle pause, a resume a call made
    // there) is read again into the sandbox's listed view, as a call through control
    // does (`route::refresh_view`: from the node the placement names, whoever says so).
    let changed: std::collections::BTreeSet<String> = batch
        .events
        .iter()
        .filter(|e| VIEW_CHANGES.contains(&e.kind.as_str()))
        .map(|e| e.subject.clone())
        .collect();
    let events: Vec<locker_store::EventRecord> = batch
        .events
        .into_iter()
        .map(|e| {
            let mut data = e.data;
            if let Some(o) = data.as_object_mut() {
                o.insert("node".into(), Value::String(node.id.clone()));
                o.insert("node_name".into(), Value::String(node.name.clone()));
            }
            locker_store::EventRecord {
                seq: e.seq,
                tenant: e.tenant,
                kind: e.kind,
                subject: e.subject,
                data: data.to_string(),
                at_unix: e.at_unix,
            }
        })
        .collect();
    let id = node.id.clone();
    let taker = app.clone();
    let cursor = blocking(move || taker.events.take_from_node(&id, &events)).await?;
    if !changed.is_empty() {
        tokio::spawn(async move {
            for sb in changed {
                super::route::refresh_view(&app, &sb).await;
            }
        });
    }
    Ok(axum::Json(EventsTaken { cursor }).into_response())
}

/// The kinds of a node's events after which the sandbox's listed view is read again.
const VIEW_CHANGES: &[&str] = &["sandbox.paused", "sandbox.resumed"];

/// The current values of secrets a node's machines use (`wire::SECRETS`). A node gets only
/// the secrets of tenants it runs something of: a sandbox placed on it (starting or
/// placed) or a volume homed on it (a run's machine); nothing is written anywhere.
async fn give_secrets(
    State(c): State<Arc<Control>>,
    Extension(peer): Extension<Peer>,
    Extension(app): Extension<AppState>,
    Json(asked): Json<wire::SecretsAsked>,
) -> Result<Response, ApiError> {
    if asked.wanted.len() > wire::SECRETS_MAX {
        return Err(ApiError::bad_request(format!(
            "at most {} secrets a call",
            wire::SECRETS_MAX
        )));
    }
    let node = caller(&c, &peer, &asked.node_id).await?;
    if node.state != NodeState::Ready {
        return Err(ApiError::conflict(format!(
            "node {} is {}: it gets no secrets until it returns",
            node.name,
            node.state.as_str()
        )));
    }
    let (store, node_id) = (c.store.clone(), node.id.clone());
    let copies = blocking(move || {
        // The tenants the node serves: a placement there not lost (one read for all of
        // them: every node asks every beat), or else a volume homed there (a read for each
        // tenant asked of that has no sandbox there: runs on volumes).
        let mut hosted: std::collections::BTreeSet<String> = store
            .list_placements(None, Some(&node_id))?
            .into_iter()
            .filter(|p| p.state != locker_store::PlacementState::Lost)
            .map(|p| p.tenant)
            .collect();
        let others: std::collections::BTreeSet<String> = asked
            .wanted
            .iter()
            .filter(|k| !hosted.contains(&k.tenant))
            .map(|k| k.tenant.clone())
            .collect();
        for t in others {
            if store.list_volumes(&t)?.iter().any(|v| v.host == node_id) {
                hosted.insert(t);
            }
        }
        let mut out = Vec::new();
        for k in asked.wanted {
            if !hosted.contains(&k.tenant) {
                continue;
            }
            let Some(rec) = store.get_secret(&k.tenant, &k.name)? else {
                continue;
            };
            let Some(value) = app.secrets.open(&rec) else {
                continue;
            };
            out.push(wire::SecretCopy {
                tenant: rec.tenant,
                name: rec.name,
                env: rec.env,
                hosts: rec.hosts,
                value_b64: locker_types::base64::encode(&value),
            });
        }
        Ok(out)
    })
    .await?;
    Ok(axum::Json(wire::SecretCopies { secrets: copies }).into_response())
}

async fn give_back(
    State(c): State<Arc<Control>>,
    Extension(peer): Extension<Peer>,
    Json(ret): Json<Return>,
) -> Result<Response, ApiError> {
    let node = caller(&c, &peer, &ret.node_id).await?;
    let (store, id) = (c.store.clone(), node.id.clone());
    // Idempotent: a node already back (its first answer lost) learns its current epoch.
    let back = blocking(move || {
        let n = match store.revive_node(&id, lease_ms())? {
            Some(n) => Some((n, true)),
            None => store
                .get_node(&id)?
                .filter(|n| n.state == NodeState::Ready)
                .map(|n| (n, false)),
        };
        // What is still the node's: placed at its current epoch (everything placed
        // before its death was lost with it).
        let keep = match &n {
            Some((n, _)) => store
                .list_placements(None, Some(&n.id))?
                .into_iter()
                .filter(|p| p.epoch == n.epoch && p.state != PlacementState::Lost)
                .filter_map(|p| p.sandbox_id)
                .collect(),
            None => Vec::new(),
        };
        Ok(n.map(|n| (n, keep)))
    })
    .await?;
    match back {
        Some(((n, revived), keep)) => {
            if revived {
                tracing::info!(node = %n.id, name = %n.name, epoch = n.epoch, "a node declared dead returned");
            }
            Ok(axum::Json(BeatAnswer {
                epoch: n.epoch,
                lease_until_ms: n.lease_until_ms,
                keep: Some(keep),
                volumes_here: None,
            })
            .into_response())
        }
        None => Ok(fenced(&node)),
    }
}

/// The sweeper (see the module doc): every [`SWEEP`], on the fleet's leader only
/// (`Store::lead`, asked each round: control replicas sharing the store run one sweeper
/// between them, so the rate limit holds fleet-wide), after a lease of grace from when this
/// replica became the leader.
async fn sweep(app: AppState, mut quitting: tokio::sync::watch::Receiver<bool>) {
    const WINDOW: Duration = Duration::from_secs(60);
    super::restart::tidy(&app).await;
    let store = app.store.clone();
    let mut reconciled = Instant::now();
    let mut grace_until = Instant::now() + LEASE;
    let mut declared: Vec<Instant> = Vec::new();
    let mut alarmed = Instant::now() - WINDOW;
    let mut leading = false;
    let mut tick = tokio::time::interval(SWEEP);
    let quit = async move {
        let _ = quitting.wait_for(|q| *q).await;
    };
    tokio::pin!(quit);
    let mut round = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = &mut quit => return,
        }
        // The last round stalled somewhere (a store call, reconciliation): heartbeats could
        // not land meanwhile either, whatever this round reads next.
        if round.elapsed() > SWEEP + STALL {
            stalled(round.elapsed(), &mut grace_until);
        }
        round = Instant::now();
        let asked = round;
        let s = store.clone();
        let leads = matches!(
            tokio::task::spawn_blocking(move || s.lead()).await,
            Ok(Ok(true))
        );
        if leads != leading {
            leading = leads;
            if leads {
                // Heartbeats the previous leader saw are not this one's: a lease of grace.
                grace_until = Instant::now() + LEASE;
                tracing::info!("this replica leads the fleet: it sweeps leases and reconciles");
            } else {
                tracing::info!("this replica no longer leads the fleet");
            }
        }
        if !leads || Instant::now() < grace_until {
            continue;
        }
        declared.retain(|t| t.elapsed() < WINDOW);
        let s = store.clone();
        let (nodes, now_ms) = match tokio::task::spawn_blocking(move || {
            Ok::<_, StoreError>((s.list_nodes()?, s.clock_ms()?))
        })
        .await
        {
            // A store that took this long stalled (every lease may have run out meanwhile
            // with no heartbeat able to land): as after an outage, wait a lease of fresh ones.
            Ok(Ok(_)) if asked.elapsed() > STALL => {
                stalled(asked.elapsed(), &mut grace_until);
                continue;
            }
            Ok(Ok(n)) => n,
            _ => {
                // The store is away: when it is back, heartbeats need a lease to land.
                grace_until = Instant::now() + LEASE;
                continue;
            }
        };
        if reconciled.elapsed() >= super::placement::RECONCILE {
            reconciled = Instant::now();
            super::placement::reconcile(&app, &nodes).await;
            // Also here, not only after an expiry: one that failed to mark its placements
            // lost is caught up within this period.
            super::placement::lose(&app).await;
            super::placement::expire_lost(&app, &nodes).await;
            super::restart::lost(&app).await;
        }
        let budget = (nodes.len() / 10).max(1);
        let left = budget.saturating_sub(declared.len());
        let expired = nodes
            .iter()
            .filter(|n| n.state == NodeState::Ready && n.lease_until_ms < now_ms)
            .count();
        if expired == 0 {
            continue;
        }
        if left == 0 {
            if alarmed.elapsed() >= WINDOW {
                alarmed = Instant::now();
                tracing::error!(expired, budget, "many nodes missed their lease at once: declaring at most {budget} per minute (a network or control-plane problem is more likely than that many dead hosts)");
            }
            continue;
        }
        // This round's reads are as old as it is: a stall since (reconciliation's calls) and
        // the leases they showed are not the store's now.
        if round.elapsed() > STALL {
            stalled(round.elapsed(), &mut grace_until);
            continue;
        }
        let s = store.clone();
        let max = u32::try_from(left).unwrap_or(1);
        match tokio::task::spawn_blocking(move || s.expire_nodes(max)).await {
            Ok(Ok(dead)) => {
                for n in &dead {
                    declared.push(Instant::now());
                    tracing::warn!(node = %n.id, name = %n.name, epoch = n.epoch, "node declared dead: its lease ran out");
                }
                super::placement::lose(&app).await;
                super::restart::lost(&app).await;
            }
            _ => grace_until = Instant::now() + LEASE,
        }
    }
}

/// A stall of the store (or of the sweeper's round): no node is declared dead for a lease.
fn stalled(took: Duration, grace_until: &mut Instant) {
    tracing::warn!(
        took_ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
        "the store stalled: declaring no node dead for a lease"
    );
    *grace_until = Instant::now() + LEASE;
}

// ---- the admin routes ----

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/fleet/tokens", post(new_token))
        .route("/v1/fleet/nodes", get(list_nodes))
        .route("/v1/fleet/nodes/{node}", delete(remove_node))
        .route("/v1/fleet/nodes/{node}/cordon", post(cordon))
        .route("/v1/fleet/nodes/{node}/uncordon", post(uncordon))
        .route("/v1/fleet/nodes/{node}/drain", post(drain))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NewToken {
    #[serde(default)]
    ttl_s: Option<u64>,
}

async fn new_token(
    State(app): State<AppState>,
    _: Admin,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let Some(c) = app.fleet.as_ref() else {
        return Err(ApiError::conflict(
            "this server does not accept nodes: start it with --fleet-listen ADDR:PORT",
        ));
    };
    let req: NewToken = if body.iter().all(u8::is_ascii_whitespace) {
        NewToken::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e} (fields: ttl_s)")))?
    };
    let ttl = req.ttl_s.map_or(TOKEN_TTL, Duration::from_secs);
    if ttl.is_zero() || ttl > TOKEN_TTL_MAX {
        return Err(ApiError::bad_request(format!(
            "ttl_s must be 1 to {} (7 days)",
            TOKEN_TTL_MAX.as_secs()
        )));
    }
    let minter = c.clone();
    let (rec, clear) = tokio::task::spawn_blocking(move || minter.mint_token(ttl))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({
            "id": rec.id,
            "token": clear,
            "expires_at": locker_types::rfc3339(rec.expires_unix),
            "url": c.url,
            "command": format!("locker node --join {} --token {clear}", c.url),
        })),
    )
        .into_response())
}

/// A node as the admin routes show it.
fn node_json(n: &NodeRecord, now_ms: i64) -> Value {
    let report: Value = serde_json::from_str(&n.report).unwrap_or(Value::Null);
    let alive = super::placement::alive(n, now_ms);
    json!({
        "id": n.id,
        "name": n.name,
        "address": n.address,
        "state": n.state.as_str(),
        "alive": alive,
        "epoch": n.epoch,
        "joined_at": n.joined_at,
        "last_heartbeat_ms_ago": (now_ms - n.heartbeat_ms).max(0),
        "lease_left_ms": (n.lease_until_ms - now_ms).max(0),
        "cordoned": n.cordoned,
        "reserved": {"slots": n.reserved_slots, "memory_mb": n.reserved_memory_mb},
        "report": report,
    })
}

async fn list_nodes(State(app): State<AppState>, _: Admin) -> Result<Response, ApiError> {
    let store = app.store.clone();
    let (nodes, now_ms) = blocking(move || Ok((store.list_nodes()?, store.clock_ms()?))).await?;
    let nodes: Vec<Value> = nodes.iter().map(|n| node_json(n, now_ms)).collect();
    Ok(axum::Json(json!({ "nodes": nodes })).into_response())
}

/// `POST /v1/fleet/nodes/{node}/cordon`: placement puts no new sandbox on the node (its
/// sandboxes keep running, and their forks still go there: children live on their
/// parent's node). 200 with the node.
async fn cordon(
    State(app): State<AppState>,
    _: Admin,
    Path(node): Path<String>,
) -> Result<Response, ApiError> {
    set_cordon(&app, node, true).await
}

/// `POST /v1/fleet/nodes/{node}/uncordon`: placement may use the node again.
async fn uncordon(
    State(app): State<AppState>,
    _: Admin,
    Path(node): Path<String>,
) -> Result<Response, ApiError> {
    set_cordon(&app, node, false).await
}

/// `POST /v1/fleet/nodes/{node}/drain`: the node is cordoned and its sandboxes carried
/// to other nodes (`drain`); 200 with what moved, what did not and why.
async fn drain(
    State(app): State<AppState>,
    _: Admin,
    Path(node): Path<String>,
) -> Result<Response, ApiError> {
    if app.fleet.is_none() {
        return Err(ApiError::conflict(
            "this server has no fleet: start it with --fleet-listen ADDR:PORT",
        ));
    }
    set_cordon(&app, node.clone(), true).await?;
    let store = app.store.clone();
    let n = blocking(move || {
        store
            .get_node(&node)?
            .ok_or_else(|| StoreError::NotFound(format!("node {node:?} was removed meanwhile")))
    })
    .await?;
    let report = super::drain::drain(&app, &n).await?;
    Ok(axum::Json(report).into_response())
}

async fn set_cordon(app: &AppState, node: String, cordoned: bool) -> Result<Response, ApiError> {
    let store = app.store.clone();
    let (n, now_ms) = blocking(move || {
        let n = store.get_node(&node)?.ok_or_else(|| {
            StoreError::NotFound(format!(
                "no node {node:?} in the fleet (see GET /v1/fleet/nodes)"
            ))
        })?;
        store.cordon_node(&n.id, cordoned)?;
        let n = store
            .get_node(&n.id)?
            .ok_or_else(|| StoreError::NotFound(format!("node {node:?} was removed meanwhile")))?;
        Ok((n, store.clock_ms()?))
    })
    .await?;
    tracing::info!(node = %n.id, name = %n.name, cordoned, "node cordon changed");
    // This replica's placement sees it at once; the others within their table's age.
    super::placement::forget_nodes(app);
    Ok(axum::Json(node_json(&n, now_ms)).into_response())
}

async fn remove_node(
    State(app): State<AppState>,
    _: Admin,
    Path(node): Path<String>,
) -> Result<Response, ApiError> {
    let store = app.store.clone();
    let removed = blocking(move || match store.get_node(&node)? {
        Some(n) => {
            // A joined node's volumes are on its disk, which nothing of the fleet reaches
            // from now on (its certificate opens nothing): their records go with it, in
            // the same transaction, so that their names and disk quota are free again. A
            // replica's own node (`--node local`) keeps its volumes on its server's disk,
            // and registers again at that server's next start.
            let gone = if super::local::is_own_node(&n) {
                store.delete_node(&n.id)?.then(Vec::new)
            } else {
                store.delete_node_with_volumes(&n.id)?
            };
            Ok(gone.map(|gone| (n, gone)))
        }
        None => Err(StoreError::NotFound(format!(
            "no node {node:?} in the fleet (see GET /v1/fleet/nodes)"
        ))),
    })
    .await?;
    if let Some((n, volumes)) = removed {
        tracing::info!(node = %n.id, name = %n.name, volumes = volumes.len(), "node removed from the fleet");
        for v in volumes {
            tracing::warn!(volume = %v.id, tenant = %v.tenant, name = %v.name, node = %n.name, "volume forgotten with its removed node (its files stay on that node's disk)");
        }
        // This replica places nothing there from now on; the others within their table's
        // age (the node's certificate opens nothing meanwhile).
        super::placement::forget_nodes(&app);
        // Its sandboxes go with it.
        super::placement::lose(&app).await;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}
