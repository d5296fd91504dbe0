//! A node's side of the fleet (`locker node`): join with a one-time token, keep the identity
//! it was given, and beat every [`HEARTBEAT`] with what it has.
//!
//! Identity, in `<data-dir>/fleet/`: `node.key` (its private key, made here, mode 0600,
//! never sent anywhere), `node.crt` (the client certificate the control plane signed),
//! `ca.crt` (the fleet CA: the only issuer the control plane's certificate is accepted
//! from), `identity.json` (control URL, node id, name, epoch). A node that has one starts
//! beating at once; the token is for the first start only (and is refused if replayed).
//!
//! Failure rules (`FLEET.md` §4.5): when the control plane cannot be reached the node keeps
//! beating into the void and keeps everything it runs: "a failed call is not an empty
//! list". When the control plane answers that the node was declared dead (409, its epoch
//! moved on), the node fences (from then on nothing it ran before is its own to serve) and
//! returns at the new epoch. Only an explicit removal (404, 403) stops it. A node that
//! stalled past its lease acts on nothing it runs (its reaper, idle policy, calls) until a
//! beat after the stall has come back and any fence is done (`local::Awake`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper::StatusCode;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::KeyPair;
use serde::{Deserialize, Serialize};

use super::node::Epoch;
use super::pki;
use super::wire::{
    self, Beat, BeatAnswer, EventsTaken, Fenced, Join, Joined, NodeEvent, NodeEvents, Report,
    Return,
};
use super::HEARTBEAT;
use crate::ids::hex;
use crate::state::AppState;

/// How `locker node` was started.
#[derive(Debug, Clone)]
pub struct MemberConfig {
    /// The control plane (`https://host:port`); only needed to join.
    pub control: Option<String>,
    pub token: Option<String>,
    pub data_dir: PathBuf,
    pub name: String,
    /// `host:port` where this node's listener answers, as the control plane should dial it.
    pub advertise: String,
    /// Where the listener binds (`--listen`; the advertised port on every address by
    /// default).
    pub listen: std::net::SocketAddr,
    pub slots: u32,
    /// The engine this node runs (its data dir is `data_dir`; `fleet_member` set).
    pub engine: crate::state::Config,
}

/// What a node keeps of its membership.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Identity {
    pub control: String,
    pub node_id: String,
    pub name: String,
    pub epoch: i64,
}

/// An identity and the credentials that go with it.
struct Member {
    ident: Identity,
    dir: PathBuf,
    /// Towards the control plane, and the node listener's.
    tls: Arc<rustls::ClientConfig>,
    server_tls: Arc<rustls::ServerConfig>,
}

/// Why a node stopped.
#[derive(Debug, thiserror::Error)]
pub enum MemberError {
    #[error("{0}")]
    Join(String),
    #[error("{0}")]
    Identity(String),
    #[error("{0}")]
    Removed(String),
    #[error("{0}")]
    Engine(String),
}

/// The fleet directory of a data dir.
pub fn fleet_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("fleet")
}

/// Starts the engine (adopting what a previous start left running), joins when the data
/// dir has no identity yet, serves the control plane on the node listener and beats, until
/// `stop` resolves. What the node runs keeps running after a stop, for the next start.
pub async fn run(
    cfg: MemberConfig,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), MemberError> {
    // The engine first: it takes the data dir's lock, so two nodes never share one.
    let app = crate::app::build(cfg.engine.clone())
        .await
        .map_err(|e| MemberError::Engine(e.to_string()))?;
    let (quit, quitting) = tokio::sync::watch::channel(false);
    let result = serve_and_beat(&cfg, &app, quitting, stop).await;
    let _ = quit.send(true);
    crate::app::shutdown(&app).await;
    result
}

async fn serve_and_beat(
    cfg: &MemberConfig,
    app: &AppState,
    quitting: tokio::sync::watch::Receiver<bool>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), MemberError> {
    // Bound before the join: the fleet lists the node alive from its registration on, and a
    // call control sends then waits in the backlog for the listener rather than being
    // refused.
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| MemberError::Engine(format!("cannot listen on {}: {e}", cfg.listen)))?;
    let dir = fleet_dir(&cfg.data_dir);
    let member = match load(&dir)? {
        Some(m) => {
            if cfg.token.is_some() {
                tracing::warn!(node = %m.ident.node_id, "this data dir already joined the fleet: the token is not used");
            }
            m
        }
        None => join(cfg, app, &dir).await?,
    };
    secrets_from_control(app, &member, quitting.clone());
    super::local::Awake::spawn_ticker(app.clone(), quitting.clone());
    let epoch: Epoch = Arc::new(AtomicI64::new(member.ident.epoch));
    super::node::serve(
        listener,
        member.server_tls.clone(),
        app.clone(),
        epoch.clone(),
        quitting,
    );
    crate::app::start_services(app);
    tracing::info!(node = %member.ident.node_id, name = %member.ident.name, control = %member.ident.control, epoch = member.ident.epoch, listen = %cfg.listen, "locker node ready: beating every {}s", HEARTBEAT.as_secs());
    tokio::select! {
        r = beat(member, cfg, app, epoch) => r,
        () = stop => {
            tracing::info!("stopped: what this node runs keeps running");
            Ok(())
        }
    }
}

/// The engine's secrets come from control (`secrets::remote`): fetched over a connection of
/// their own (a create waiting for a secret never waits behind a heartbeat), and fetched
/// again every beat while in use, until `quitting`.
fn secrets_from_control(
    app: &AppState,
    m: &Member,
    mut quitting: tokio::sync::watch::Receiver<bool>,
) {
    let link: Arc<tokio::sync::Mutex<Option<Link>>> = Arc::default();
    let (control, tls, node_id) = (
        m.ident.control.clone(),
        m.tls.clone(),
        m.ident.node_id.clone(),
    );
    app.secrets.set_remote(Arc::new(move |wanted| {
        let (link, control, tls) = (link.clone(), control.clone(), tls.clone());
        let asked = wire::SecretsAsked {
            node_id: node_id.clone(),
            wanted,
        };
        Box::pin(async move {
            let mut l = {
                let mut held = link.lock().await;
                match held.as_ref() {
                    Some(l) if !l.sender.is_closed() => l.clone(),
                    _ => {
                        let l = Link::open(&control, tls).await?;
                        *held = Some(l.clone());
                        l
                    }
                }
            };
            match l.call(wire::SECRETS, &asked).await {
                Ok((StatusCode::OK, b)) => serde_json::from_slice::<wire::SecretCopies>(&b)
                    .map(|c| c.secrets)
                    .map_err(|e| format!("control's answer: {e}")),
                Ok((s, b)) => Err(format!("control answered {s}: {}", message(&b))),
                Err(e) => {
                    *link.lock().await = None;
                    Err(e)
                }
            }
        })
    }));
    let app = app.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => crate::secrets::Secrets::refresh(&app).await,
                _ = quitting.changed() => return,
            }
        }
    });
}

/// `https://host:port` → (host, port).
fn parse_url(url: &str) -> Result<(String, u16), String> {
    let rest = url
        .strip_prefix("https://")
        .ok_or_else(|| format!("{url:?}: the control plane's URL starts with https://"))?;
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
            h,
            p.parse::<u16>()
                .map_err(|_| format!("{url:?}: the port is not a number"))?,
        ),
        _ => (authority, 443),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(format!("{url:?}: no host"));
    }
    Ok((host.to_owned(), port))
}

/// One HTTP/2 connection to the control plane.
#[derive(Clone)]
struct Link {
    sender: SendRequest<Full<Bytes>>,
    authority: String,
}

const CALL_TIMEOUT: Duration = Duration::from_secs(5);

impl Link {
    async fn open(url: &str, tls: Arc<rustls::ClientConfig>) -> Result<Link, String> {
        let (host, port) = parse_url(url)?;
        let tcp = tokio::time::timeout(
            CALL_TIMEOUT,
            tokio::net::TcpStream::connect((host.as_str(), port)),
        )
        .await
        .map_err(|_| format!("connecting to {url}: timed out"))?
        .map_err(|e| format!("connecting to {url}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| format!("{url}: {e}"))?;
        let tls = tokio::time::timeout(
            CALL_TIMEOUT,
            tokio_rustls::TlsConnector::from(tls).connect(name, tcp),
        )
        .await
        .map_err(|_| format!("TLS with {url}: timed out"))?
        .map_err(|e| format!("TLS with {url}: {e}"))?;
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .map_err(|e| format!("HTTP/2 with {url}: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Ok(Link { sender, authority })
    }

    async fn call<T: Serialize>(
        &mut self,
        path: &str,
        body: &T,
    ) -> Result<(StatusCode, Bytes), String> {
        let body = serde_json::to_vec(body).map_err(|e| e.to_string())?;
        let req = hyper::Request::post(format!("https://{}{path}", self.authority))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let exchange = async {
            let resp = self
                .sender
                .send_request(req)
                .await
                .map_err(|e| e.to_string())?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>((status, bytes))
        };
        tokio::time::timeout(CALL_TIMEOUT, exchange)
            .await
            .map_err(|_| format!("{path}: no answer within {}s", CALL_TIMEOUT.as_secs()))?
    }
}

/// The message of an error body (`{"error": {"message": …}}`), else the body.
fn message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

/// Writes `data` at `path` whole (a temporary file renamed over it), with `mode`.
fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<(), MemberError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let err = |e: std::io::Error| MemberError::Identity(format!("writing {}: {e}", path.display()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(data).and_then(|()| f.sync_all()).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

fn save_identity(dir: &Path, ident: &Identity) -> Result<(), MemberError> {
    let json =
        serde_json::to_vec_pretty(ident).map_err(|e| MemberError::Identity(e.to_string()))?;
    write_file(&dir.join("identity.json"), &json, 0o600)
}

/// The identity in `dir`, if this data dir joined before.
fn load(dir: &Path) -> Result<Option<Member>, MemberError> {
    let path = dir.join("identity.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(MemberError::Identity(format!("{}: {e}", path.display()))),
    };
    let bad = |what: &str, e: &dyn std::fmt::Display| {
        MemberError::Identity(format!(
            "{}: {what}: {e} (to join again, remove {} and start with a new token)",
            dir.display(),
            dir.display()
        ))
    };
    let ident: Identity = serde_json::from_str(&text).map_err(|e| bad("identity.json", &e))?;
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).map_err(|e| bad(f, &e));
    let key = KeyPair::from_pem(&read("node.key")?).map_err(|e| bad("node.key", &e))?;
    let (cert, ca) = (read("node.crt")?, read("ca.crt")?);
    let verifier = pki::trust_ca(&ca).map_err(|e| bad("ca.crt", &e))?;
    let tls = pki::client_config(verifier, Some((&cert, &key))).map_err(|e| bad("node.crt", &e))?;
    let server_tls = pki::node_server_config(&ca, &cert, &key).map_err(|e| bad("node.crt", &e))?;
    Ok(Some(Member {
        ident,
        dir: dir.to_owned(),
        tls,
        server_tls,
    }))
}

/// A report of this host: its capacity (CPUs, memory, the data dir's free disk), `slots`,
/// and what it runs and has (`sandboxes`, `warm`, the template digests in `templates`).
pub fn host_report(
    data_dir: &Path,
    slots: u32,
    sandboxes: u32,
    warm: u32,
    templates: Option<&locker_runtime::template::TemplateStore>,
) -> Report {
    // What a host has does not change while it runs: read once, not every heartbeat.
    static HOST: std::sync::OnceLock<(u32, u64)> = std::sync::OnceLock::new();
    let &(cpus, memory_mb) = HOST.get_or_init(|| {
        (
            std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(1)),
            crate::capacity::host_memory_mb().unwrap_or(0),
        )
    });
    let space = crate::capacity::Space::of(data_dir).ok();
    Report {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        cpus,
        memory_mb,
        disk_free_mb: space.map_or(0, |s| s.free_mb),
        disk_grantable_mb: space.map(|s| s.grantable_mb()),
        slots,
        sandboxes,
        templates: templates.and_then(|t| t.digests().ok()).unwrap_or_default(),
        warm,
        ..Report::default()
    }
}

/// What a node has now: the host's capacity (`data_dir`'s disk, `slots`), and what the
/// engine behind `app` runs and keeps warm. Read off the async threads (/proc, the data
/// dir's filesystem, the template cache).
pub async fn live_report(app: &AppState, data_dir: &Path, slots: u32) -> Report {
    let mut ids: Vec<String> = app.live.read().await.keys().cloned().collect();
    let running = ids.len();
    let warm = u32::try_from(app.pool.len()).unwrap_or(u32::MAX);
    let (creating, made) = app.fleet_creates.report();
    let (data_dir, app) = (data_dir.to_owned(), app.clone());
    tokio::task::spawn_blocking(move || {
        let mut r = host_report(
            &data_dir,
            slots,
            u32::try_from(running).unwrap_or(u32::MAX),
            warm,
            Some(&app.templates),
        );
        // Released for a move still under way: still this node's until it ends.
        for id in crate::carry::released(&app) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        r.sandbox_ids = ids;
        r.creating = creating;
        r.made = made;
        r
    })
    .await
    .unwrap_or_default()
}

/// [`live_report`] of this node.
async fn report(cfg: &MemberConfig, app: &AppState) -> Report {
    live_report(app, &cfg.data_dir, cfg.slots).await
}

async fn join(cfg: &MemberConfig, app: &AppState, dir: &Path) -> Result<Member, MemberError> {
    let fail = |m: String| MemberError::Join(m);
    let (Some(url), Some(token)) = (cfg.control.as_deref(), cfg.token.as_deref()) else {
        return Err(fail(format!(
            "{} holds no fleet identity: join with --join https://CONTROL:PORT --token TOKEN \
             (a token from `locker fleet token`)",
            dir.display()
        )));
    };
    let pin = super::token_pin(token).ok_or_else(|| {
        fail("--token is not a join token (lkj_…): mint one with `locker fleet token`".into())
    })?;
    // The key is written before the join is asked for: a join whose answer is lost, or a
    // node that dies before writing its identity, tries again with the same token and key
    // and gets the node it made.
    std::fs::create_dir_all(dir)
        .map_err(|e| MemberError::Identity(format!("{}: {e}", dir.display())))?;
    let key_path = dir.join("node.key");
    let key = match std::fs::read_to_string(&key_path) {
        Ok(pem) => KeyPair::from_pem(&pem)
            .map_err(|e| MemberError::Identity(format!("{}: {e}", key_path.display())))?,
        Err(_) => {
            let key =
                KeyPair::generate().map_err(|e| fail(format!("making the node's key: {e}")))?;
            write_file(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
            key
        }
    };
    let tls = pki::client_config(pki::PinnedCa::new(pin), None).map_err(fail)?;
    let mut link = Link::open(url, tls).await.map_err(fail)?;
    let body = Join {
        token: token.to_owned(),
        name: cfg.name.clone(),
        address: cfg.advertise.clone(),
        public_key: hex(key.public_key_raw()),
        report: report(cfg, app).await,
    };
    let (status, bytes) = link.call(wire::REGISTER, &body).await.map_err(fail)?;
    if status != StatusCode::CREATED {
        return Err(fail(format!(
            "the control plane refused the join ({status}): {}",
            message(&bytes)
        )));
    }
    let joined: Joined = serde_json::from_slice(&bytes)
        .map_err(|e| fail(format!("the control plane's answer: {e}")))?;
    // The CA handed over must be the one the token pins (the one TLS was checked against).
    let ca_der = pki::pem_to_der(&joined.ca_pem).map_err(fail)?;
    if !pki::fingerprint(&ca_der).starts_with(&pin.to_ascii_lowercase()) {
        return Err(fail(
            "the control plane handed over a CA other than the one the join token names".into(),
        ));
    }
    let ident = Identity {
        control: url.to_owned(),
        node_id: joined.node_id.clone(),
        name: cfg.name.clone(),
        epoch: joined.epoch,
    };
    write_file(&dir.join("node.crt"), joined.cert_pem.as_bytes(), 0o644)?;
    write_file(&dir.join("ca.crt"), joined.ca_pem.as_bytes(), 0o644)?;
    save_identity(dir, &ident)?;
    tracing::info!(node = %ident.node_id, name = %ident.name, "joined the fleet");
    load(dir)?.ok_or_else(|| MemberError::Identity("the identity just written is gone".into()))
}

/// Destroys every sandbox this node runs but `keep` (a returning node's: the fleet marked
/// the others lost when it declared the node dead); how many.
async fn drop_all_but(app: &AppState, keep: &[String]) -> usize {
    let ids: Vec<String> = app.live.read().await.keys().cloned().collect();
    let taken: Vec<String> = ids.into_iter().filter(|id| !keep.contains(id)).collect();
    super::destroy_taken(app, taken).await
}

/// Sends the node's own events after `cursor` to the fleet (a few batches a beat), moving
/// `cursor` to what the fleet answers it has. `Err` only when the connection failed; a
/// refusal (an older control plane without the route) is logged and left for later.
async fn send_events(
    l: &mut Link,
    node_id: &str,
    app: &AppState,
    cursor: &mut u64,
) -> Result<(), String> {
    const BATCHES: usize = 4;
    for _ in 0..BATCHES {
        let (store, after) = (app.store.clone(), *cursor);
        let batch = tokio::task::spawn_blocking(move || {
            store.events_after(None, after, wire::EVENTS_MAX as u32)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
        let Some(last) = batch.last().map(|e| e.seq) else {
            return Ok(());
        };
        let body = NodeEvents {
            node_id: node_id.to_owned(),
            events: batch
                .into_iter()
                .map(|r| NodeEvent {
                    seq: r.seq,
                    tenant: r.tenant,
                    kind: r.kind,
                    subject: r.subject,
                    data: serde_json::from_str(&r.data).unwrap_or(serde_json::Value::Null),
                    at_unix: r.at_unix,
                })
                .collect(),
        };
        let (status, bytes) = l.call(wire::EVENTS, &body).await?;
        if status != StatusCode::OK {
            tracing::debug!(status = %status, message = %message(&bytes), "the fleet did not take this node's events");
            return Ok(());
        }
        let taken: EventsTaken = serde_json::from_slice(&bytes)
            .map_err(|e| format!("the fleet's answer to events: {e}"))?;
        let behind = taken.cursor < last;
        *cursor = taken.cursor;
        // Caught up with what was read (or the fleet was ahead: it had them already).
        if !behind && body.events.len() < wire::EVENTS_MAX {
            return Ok(());
        }
    }
    Ok(())
}

/// Refusals in a row (one a beat) after which a node takes itself for removed.
const REFUSALS_TO_STOP: u32 = 10;

/// Beats until removed. Unreachable: keep going, keep everything. Declared dead: fence,
/// return.
async fn beat(
    mut m: Member,
    cfg: &MemberConfig,
    app: &AppState,
    epoch: Epoch,
) -> Result<(), MemberError> {
    const QUIET: Duration = Duration::from_secs(10);
    let mut link: Option<Link> = None;
    let mut tick = tokio::time::interval(HEARTBEAT);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Since when control is unreachable, and when that was last said.
    let mut unreachable: Option<(Instant, Instant)> = None;
    // Answers that the fleet does not know this node, in a row: one could be a store that
    // lost its latest writes (a failover); many are a removal.
    let mut refused = 0u32;
    // How far the fleet has this node's events (its answer says; 0 until the first).
    let mut events_cursor = 0u64;
    loop {
        tick.tick().await;
        // Volume moves whose control replica went away: the fleet says whose each is.
        let mut doubts = crate::volumes::handoff::in_doubt(app).await;
        doubts.truncate(wire::DOUBTS_MAX);
        let since = app.awake.beat_begins();
        let result = async {
            if link.is_none() {
                link = Some(Link::open(&m.ident.control, m.tls.clone()).await?);
            }
            let l = link.as_mut().expect("just opened");
            let mut report = report(cfg, app).await;
            report.volumes_in_doubt = doubts.clone();
            let beat = Beat {
                node_id: m.ident.node_id.clone(),
                epoch: m.ident.epoch,
                report,
            };
            l.call(wire::HEARTBEAT, &beat).await
        }
        .await;
        let (status, bytes) = match result {
            Ok(r) => r,
            Err(e) => {
                link = None;
                let now = Instant::now();
                match &mut unreachable {
                    None => {
                        tracing::warn!(error = %e, "cannot reach the control plane: keeping everything this node runs, retrying every {}s", HEARTBEAT.as_secs());
                        unreachable = Some((now, now));
                    }
                    Some((since, said)) if said.elapsed() >= QUIET => {
                        tracing::warn!(error = %e, for_s = since.elapsed().as_secs(), "still cannot reach the control plane");
                        *said = now;
                    }
                    Some(_) => {}
                }
                continue;
            }
        };
        if status != StatusCode::NOT_FOUND
            && status != StatusCode::FORBIDDEN
            && status != StatusCode::UNAUTHORIZED
        {
            refused = 0;
        }
        if let Some((since, _)) = unreachable.take() {
            tracing::info!(
                after_s = since.elapsed().as_secs(),
                "reached the control plane again"
            );
        }
        match status {
            StatusCode::OK => {
                let here = serde_json::from_slice::<BeatAnswer>(&bytes)
                    .ok()
                    .and_then(|a| a.volumes_here);
                if let Some(here) = here.filter(|_| !doubts.is_empty()) {
                    crate::volumes::handoff::settle(app, &doubts, &here).await;
                }
                app.awake.beaten(since);
                let l = link.as_mut().expect("a link answered");
                if let Err(e) = send_events(l, &m.ident.node_id, app, &mut events_cursor).await {
                    link = None;
                    tracing::warn!(error = %e, "cannot send this node's events: retrying at the next beat");
                }
            }
            StatusCode::CONFLICT => {
                let f: Fenced = serde_json::from_slice(&bytes).unwrap_or(Fenced {
                    message: message(&bytes),
                    state: "unknown".into(),
                    epoch: m.ident.epoch,
                });
                tracing::warn!(old_epoch = m.ident.epoch, epoch = f.epoch, state = %f.state, "fenced: the fleet declared this node dead; what it ran before is no longer its own to serve");
                let l = link.as_mut().expect("a link answered");
                let ret = Return {
                    node_id: m.ident.node_id.clone(),
                };
                match l.call(wire::RETURN, &ret).await {
                    Ok((StatusCode::OK, b)) => {
                        if let Ok(a) = serde_json::from_slice::<BeatAnswer>(&b) {
                            m.ident.epoch = a.epoch;
                            if let Err(e) = save_identity(&m.dir, &m.ident) {
                                // Kept in memory; a restart asks to return again.
                                tracing::warn!(error = %e, "cannot write the new epoch");
                            }
                            // Calls at the old epoch are refused from now on; what the
                            // fleet did not give back is destroyed.
                            epoch.store(a.epoch, Ordering::Release);
                            let dropped = drop_all_but(app, a.keep.as_deref().unwrap_or(&[])).await;
                            app.awake.beaten(since);
                            tracing::info!(
                                epoch = a.epoch,
                                destroyed = dropped,
                                "returned to the fleet"
                            );
                        }
                    }
                    Ok((s, b)) => {
                        tracing::warn!(status = %s, message = %message(&b), "the fleet did not take this node back yet")
                    }
                    Err(e) => {
                        link = None;
                        tracing::warn!(error = %e, "returning to the fleet failed: retrying");
                    }
                }
            }
            StatusCode::NOT_FOUND | StatusCode::FORBIDDEN | StatusCode::UNAUTHORIZED
                if {
                    refused += 1;
                    refused < REFUSALS_TO_STOP
                } =>
            {
                tracing::warn!(status = %status, message = %message(&bytes), "the fleet does not know this node: stopping if that lasts");
                continue;
            }
            StatusCode::NOT_FOUND | StatusCode::FORBIDDEN | StatusCode::UNAUTHORIZED => {
                return Err(MemberError::Removed(format!(
                    "the fleet no longer knows this node ({status}: {}); to join again, remove \
                     {} and start with a new token",
                    message(&bytes),
                    m.dir.display()
                )));
            }
            s => {
                tracing::warn!(status = %s, message = %message(&bytes), "the control plane did not take the heartbeat");
            }
        }
    }
}
