//! Start-up, the router and shutdown of the server (its shared state is in `state`).
//!
//! One server per data dir: [`build`] takes an exclusive lock on `<data-dir>/serve.lock`
//! (holding the server's pid; `state::DataDirLock`) before it touches anything, and a second
//! server on the same data dir refuses to start, naming the first. The lock belongs to the
//! server process, so the kernel drops it when the process dies: a killed server's data dir
//! is free at once, even while a child it was spawning still shares the lock's file.
//!
//! Connections are accepted by the port routes' own HTTP/1.1 (`ports::front`), which keeps
//! the requests to sandboxes' ports and hands every other connection to axum's server.
//!
//! A stop (SIGINT, SIGTERM) keeps sandboxes running for the next start to adopt, and takes
//! down everything else this server made: warm machines (waiting for refills in flight),
//! volume agents and volume mounts.

use std::collections::HashMap;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use locker_runtime::node::{Node, NodeConfig};
use locker_runtime::template::TemplateStore;
use locker_store::{CallRecorder, PgStore, SqliteStore, Store};
use tokio::sync::RwLock;

use crate::metrics::Metrics;
use crate::state::{App, AppState, Config, DataDirLock};

/// Errors that stop the server from starting.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("locker serve runs machines, which needs root (namespaces, cgroups, mounts, network devices); this process runs as uid {0}: start it with sudo or as a system service (`locker doctor` checks the host)")]
    NotRoot(u32),
    #[error("data dir {0}: {1}")]
    DataDir(PathBuf, std::io::Error),
    #[error("state store: {0}")]
    Store(#[from] locker_store::StoreError),
    #[error("{0}")]
    Node(#[from] locker_runtime::node::NodeError),
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    #[error("template store: {0}")]
    Templates(String),
    #[error("volumes: {0}")]
    Volumes(std::io::Error),
    #[error(transparent)]
    Lock(#[from] crate::state::LockError),
    #[error("secrets: {0}")]
    Secrets(String),
    #[error("fleet: {0}")]
    Fleet(String),
}

/// How long requests in flight may take to finish once a stop is asked for.
const GRACE: Duration = Duration::from_secs(10);

/// Builds the state, adopts or cleans up machines a previous server left, and serves until
/// SIGINT or SIGTERM; then stops accepting, lets requests in flight finish (up to
/// [`GRACE`]), flushes call records and takes down what only this server uses (see the
/// module doc). Sandboxes keep running: the next start adopts them.
pub async fn serve(cfg: Config) -> Result<(), ServeError> {
    // Listen for a stop before anything else: one that comes while the server starts is
    // honoured once it is up (the default action would kill it half-way).
    let stop = stop_signal();
    if cfg.favordynmods {
        // Before any machine starts: each start and each command moves a process into a
        // cgroup, and without this the first move after a quiet spell waits ~10 ms.
        match locker_runtime::cgroup::favor_dynamic_moves() {
            Ok(m) => tracing::info!(mode = ?m, "cgroup moves on the fast path"),
            Err(e) => {
                tracing::warn!(error = %e, "cgroup moves stay on the kernel's default path (each create and each exec after a pause waits an RCU grace period)")
            }
        }
    }
    let app = build(cfg).await?;
    let local_node = match &app.cfg.local_node {
        Some(c) => match crate::fleet::local::start(&app, c).await {
            Ok(n) => Some(n),
            Err(e) => {
                shutdown(&app).await;
                return Err(ServeError::Fleet(e));
            }
        },
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(app.cfg.listen)
        .await
        .map_err(|e| ServeError::Listen(app.cfg.listen, e));
    let listener = match listener {
        Ok(l) => l,
        Err(e) => {
            shutdown(&app).await;
            return Err(e);
        }
    };
    tracing::info!(listen = %app.cfg.listen, data_dir = %app.cfg.data_dir.display(), "locker serve ready");
    start_services(&app);
    let router = router(app.clone());
    let (quit, quitting) = tokio::sync::watch::channel(false);
    // Port requests are served by the front (bodies relayed by Locker); the rest reaches axum's
    // server through it.
    let (listener, front) = match crate::ports::front::listen(
        listener,
        router.clone(),
        app.clone(),
        quitting.clone(),
    ) {
        Ok(l) => l,
        Err(e) => {
            shutdown(&app).await;
            return Err(ServeError::Listen(app.cfg.listen, e));
        }
    };
    if let Some(fleet) = &app.fleet {
        fleet.serve(app.clone(), quitting.clone());
    }
    if let Some(n) = local_node {
        crate::fleet::local::spawn(app.clone(), n, quitting.clone());
    }
    let mut stopping = quitting;
    let mut serving = tokio::spawn(
        axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                let _ = stopping.wait_for(|q| *q).await;
            })
            .into_future(),
    );
    let served = tokio::select! {
        r = &mut serving => Some(r),
        () = stop => None,
    };
    let result = match served {
        Some(r) => r
            .map_err(|e| ServeError::Listen(app.cfg.listen, std::io::Error::other(e)))
            .and_then(|r| r.map_err(|e| ServeError::Listen(app.cfg.listen, e))),
        None => {
            tracing::info!("shutting down: finishing requests in flight");
            app.events.close();
            let _ = quit.send(true);
            let finished = tokio::time::timeout(GRACE, async {
                let _ = (&mut serving).await;
                front.closed().await;
            })
            .await;
            if finished.is_err() {
                tracing::warn!(
                    grace_s = GRACE.as_secs(),
                    "requests still in flight after the grace period: cut"
                );
                serving.abort();
            }
            Ok(())
        }
    };
    shutdown(&app).await;
    result
}

/// What runs beside the listeners, on a server and on a fleet node alike: the reaper (TTL
/// and idle policy), events, usage series, the UI's assets, the default template's build
/// when it is missing, and the proof of egress enforcement.
pub(crate) fn start_services(app: &AppState) {
    crate::lifecycle::spawn_reaper(app.clone());
    crate::events::spawn(app.clone());
    crate::usage_series::spawn(app.clone());
    crate::ui::warm();
    crate::default_template::ensure(app, app.cfg.template_build);
    // Prove egress enforcement once at start (reported by /healthz; re-proved on demand
    // before a machine gets egress).
    tokio::task::spawn_blocking(|| match locker_runtime::net::status() {
        Ok(d) => tracing::info!(detail = %d, "egress enforcement works"),
        Err(e) => {
            tracing::warn!(error = %e, "egress enforcement unavailable: sandboxes get egress none only")
        }
    });
}

/// Resolves on the first SIGINT or SIGTERM after this call.
fn stop_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        match (term, int) {
            (Ok(mut t), Ok(mut i)) => {
                tokio::select! {
                    _ = t.recv() => {}
                    _ = i.recv() => {}
                }
            }
            _ => {
                tracing::warn!("cannot listen for SIGTERM: stop the server with SIGINT");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

/// What a stop takes down: call records flushed, warm machines destroyed (after the
/// refills in flight), volume agents stopped, volumes unmounted, and Locker's XFS image of
/// disks unmounted when no sandbox is left on it (else it stays for the next start).
pub(crate) async fn shutdown(app: &AppState) {
    let _ = tokio::time::timeout(Duration::from_secs(5), app.recorder.flush()).await;
    app.pool.drain().await;
    app.vm_pool.drain().await;
    app.volumes.stop_agents().await;
    app.volumes.unmount_all().await;
    if app.disks.sharing == locker_runtime::cow_disks::Sharing::Image {
        let data_dir = app.cfg.data_dir.clone();
        match tokio::task::spawn_blocking(move || locker_runtime::cow_disks::release(&data_dir))
            .await
        {
            Ok(Ok(true)) => tracing::info!("unmounted the disks image: no sandbox is left on it"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!("cannot unmount the disks image: {e}"),
            Err(e) => tracing::warn!("cannot unmount the disks image: {e}"),
        }
    }
    tracing::info!("stopped: sandboxes keep running for the next start");
}

/// The state, with machines adopted. Public for tests that serve on their own listener.
/// Fails without touching anything when another server holds the data dir.
pub async fn build(cfg: Config) -> Result<AppState, ServeError> {
    let euid = locker_sys::host::geteuid();
    if euid != 0 {
        return Err(ServeError::NotRoot(euid));
    }
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|e| ServeError::DataDir(cfg.data_dir.clone(), e))?;
    let lock = DataDirLock::take(&cfg.data_dir)?;
    let host_id = crate::fleet::host_id(&cfg.data_dir)
        .map_err(|e| ServeError::DataDir(cfg.data_dir.clone(), std::io::Error::other(e)))?;
    let store: Arc<dyn Store> = match &cfg.database {
        None => Arc::new(SqliteStore::open(cfg.data_dir.join("db.sqlite"))?),
        Some(url) => {
            let pg = PgStore::connect(url)?;
            // Control replicas of a fleet share the database; a one-host server has it alone.
            pg.claim_server(cfg.fleet.is_some())?;
            tracing::info!(database = %pg.target(), "state store on Postgres");
            Arc::new(pg)
        }
    };
    // After the store: a server that cannot have it (Postgres held by another) leaves the
    // data dir as it found it.
    let disks = locker_runtime::cow_disks::place(&cfg.data_dir, cfg.cow_disks)
        .map_err(|e| ServeError::DataDir(cfg.data_dir.clone(), e))?;
    tracing::info!(sandboxes = %disks.sandboxes.display(), "{}", disks.describe());
    store.ensure_tenant("default")?;
    match &cfg.api_key {
        // A fleet node has no keys: the control plane authenticates its callers.
        _ if cfg.fleet_member => {}
        Some(k) => {
            store.add_key_with_secret("default", k)?;
        }
        None => {
            if store.list_keys("default")?.is_empty() {
                let (info, clear) = store.create_key("default")?;
                print_new_key(&cfg.listen, &clear, &info.key_id);
            }
        }
    }
    let node_cfg = NodeConfig::from_current_exe()?;
    let (volumes, left) = crate::volumes::Volumes::open(
        &cfg.data_dir,
        node_cfg.agent_exe.clone(),
        store.host_volumes(&host_id)?,
        cfg.fleet_member,
    )
    .await
    .map_err(ServeError::Volumes)?;
    if !cfg.fleet_member {
        let n = crate::volumes::handoff::forget_left_copies(store.as_ref(), &volumes.root, &left)?;
        if n > 0 {
            tracing::warn!(
                snapshots = n,
                "forgot the snapshot records a move that never finished wrote here"
            );
        }
    }
    let node = Arc::new(Node::new(node_cfg)?);
    let templates =
        TemplateStore::open(&cfg.cache_dir).map_err(|e| ServeError::Templates(e.to_string()))?;
    let recorder = CallRecorder::spawn(store.clone());
    let warm_pool = cfg.warm_pool;
    let vm_pool = cfg.vm_pool;
    tracing::info!(quotas = ?cfg.quotas, "per-tenant quotas");
    let egress =
        crate::egress::Egress::new(&cfg.egress_resolve, crate::egress::limits::raise_nofile());
    let sealer = crate::secrets::Sealer::load(&cfg.data_dir)
        .map_err(|e| ServeError::Secrets(e.to_string()))?;
    let fleet = match &cfg.fleet {
        Some(f) => Some(
            crate::fleet::control::Control::open(f, store.clone(), &sealer)
                .map_err(ServeError::Fleet)?,
        ),
        None => None,
    };
    let secrets = crate::secrets::Secrets::new(sealer, store.clone());
    egress
        .configure_secrets(secrets.clone(), &cfg.egress_ca)
        .map_err(ServeError::Secrets)?;
    let pool = Arc::new(crate::pool::Pool::new(
        warm_pool,
        node.clone(),
        crate::pool::pool_dir(&cfg.data_dir),
        crate::runs::RUN_DISK_MB,
    ));
    let vm_pool = Arc::new(crate::vm_pool::VmPool::new(
        vm_pool,
        node.clone(),
        disks.sandboxes.clone(),
    ));
    let events = crate::events::Events::new(store.clone());
    let awake = crate::fleet::local::Awake::new(cfg.local_node.is_some() || cfg.fleet_member);
    let app = Arc::new(App {
        cfg,
        host_id,
        store,
        recorder,
        node,
        templates,
        live: RwLock::new(HashMap::new()),
        metrics: Metrics::default(),
        volumes,
        create_lock: tokio::sync::Mutex::new(()),
        started: Instant::now(),
        pool,
        vm_pool,
        egress,
        secrets,
        default_template: Default::default(),
        events,
        builds: Default::default(),
        usage_series: Default::default(),
        disks,
        fleet,
        fleet_creates: Default::default(),
        awake,
        _lock: lock,
    });
    crate::lifecycle::adopt_all(&app).await;
    crate::snapshots::cleanup(&app).await;
    crate::runs::cleanup(&app).await;
    crate::templates::fail_interrupted(&app);
    let default = app.templates.resolve("default").ok().flatten();
    app.pool.spawn_refill(default);
    Ok(app)
}

/// Prints a generated key once, on stdout (the log is stderr), as the line to paste into
/// the shell that runs clients.
fn print_new_key(listen: &SocketAddr, key: &str, key_id: &str) {
    use std::io::Write;
    // A wildcard address is not one a client can dial; the loopback one reaches it.
    let host = match listen.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => "127.0.0.1".to_owned(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => "[::1]".to_owned(),
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        ip => ip.to_string(),
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "locker: created an API key for tenant `default` (shown only now; key id {key_id}).\n\
         Clients (locker CLI, SDK, MCP) find the server with:\n\
         \n  export LOCKER_URL=http://{host}:{port} LOCKER_API_KEY={key}\n",
        port = listen.port()
    );
    let _ = out.flush();
}

/// Every route.
pub fn router(app: AppState) -> Router {
    let api = Router::new()
        .merge(crate::sandboxes::routes())
        .merge(crate::snapshots::routes())
        .merge(crate::exec::routes())
        .merge(crate::files::routes())
        .merge(crate::processes::routes())
        .merge(crate::ports::routes())
        .merge(crate::mcp_bridge::routes())
        .merge(crate::code::routes())
        .merge(crate::volumes::routes())
        .merge(crate::secrets::routes())
        .merge(crate::runs::routes())
        .merge(crate::admin::routes())
        .merge(crate::fleet::control::routes())
        .merge(crate::ops::routes())
        .merge(crate::templates::routes())
        .merge(crate::template_image::routes())
        .merge(crate::events::routes())
        .merge(crate::e2b::routes())
        .merge(crate::ui::routes())
        .merge(crate::usage_series::routes())
        .fallback(|uri: axum::http::Uri| async move {
            crate::e2b::unknown_route(uri.path()).unwrap_or_else(|| {
                axum::response::IntoResponse::into_response(crate::error::ApiError::not_found(
                    "no such route: see /openapi.json",
                ))
            })
        })
        .method_not_allowed_fallback(|| async {
            crate::error::ApiError::new(
                axum::http::StatusCode::METHOD_NOT_ALLOWED,
                "this route does not take that method: see /openapi.json",
            )
        })
        // A sandbox on another fleet node is that node's to answer.
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            crate::fleet::route::dispatch,
        ))
        .layer(axum::middleware::from_fn(crate::ui::refuse_cross_site))
        .layer(axum::middleware::from_fn_with_state(app.clone(), observe))
        .layer(axum::extract::DefaultBodyLimit::max(1 << 20))
        .with_state(app.clone());
    // Preview hosts first: their every path belongs to the machine, none to the API.
    // E2B's data plane next: a request naming a sandbox with `E2b-Sandbox-Id` is the
    // sandbox's, whatever its path.
    crate::mcp::mount(app.clone(), api)
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            crate::e2b::dispatch,
        ))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            crate::ports::preview_dispatch,
        ))
        // On a fleet's control plane, before both: a preview host or E2B call about a
        // sandbox on another node goes there.
        .layer(axum::middleware::from_fn_with_state(
            app,
            crate::fleet::data_plane::dispatch,
        ))
}

/// Records latency and status of every request.
async fn observe(State(app): State<AppState>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().as_str().to_owned();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".into());
    let resp = next.run(req).await;
    app.metrics.request(
        &method,
        &route,
        resp.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    resp
}
