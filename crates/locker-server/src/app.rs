//! Configuration, shared state, start-up and shutdown of the server.
//!
//! One server per data dir: [`build`] takes an exclusive `flock` on `<data-dir>/serve.lock`
//! (holding the server's pid) before it touches anything, and a second server on the same
//! data dir refuses to start, naming the first. The kernel drops the lock when its holder
//! dies, so a killed server's lock is free at once.
//!
//! A stop (SIGINT, SIGTERM) keeps sandboxes running for the next start to adopt, and takes
//! down everything else this server made: warm machines (waiting for refills in flight),
//! volume agents and volume mounts.

use std::collections::{BTreeMap, HashMap};
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use locker_runtime::node::{Machine, Node, NodeConfig};
use locker_runtime::template::TemplateStore;
use locker_store::{CallRecorder, SqliteStore, Store};
use tokio::sync::RwLock;

use crate::metrics::Metrics;

/// Per-tenant limits.
#[derive(Debug, Clone)]
pub struct Quotas {
    /// Sandboxes that exist at once (starting, running or paused).
    pub sandboxes: u64,
    /// Sum of `memory_mb` over those sandboxes.
    pub memory_mb: u64,
    /// Serverless runs in flight at once.
    pub runs: u64,
    /// Sum of those sandboxes' `disk_mb` and of the tenant's volumes' `size_mb`.
    pub disk_mb: u64,
}

impl Quotas {
    /// The defaults on this host for a data dir at `data_dir`: 100 sandboxes, 32 runs, the
    /// host's RAM (`MemTotal`) of memory, the size of the data dir's filesystem of disk.
    pub fn for_host(data_dir: &std::path::Path) -> Self {
        let memory_mb = crate::capacity::host_memory_mb().unwrap_or(65_536);
        let disk_mb = crate::capacity::Space::of(data_dir)
            .map(|s| s.size_mb)
            .unwrap_or(1 << 20);
        Self {
            sandboxes: 100,
            memory_mb,
            runs: 32,
            disk_mb,
        }
    }
}

/// How `locker serve` was started.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// A key of tenant `default` (`LOCKER_API_KEY`); generated and printed once if absent.
    pub api_key: Option<String>,
    /// Enables the admin routes (`LOCKER_ADMIN_KEY`).
    pub admin_key: Option<String>,
    /// Bearer token `/metrics` requires, if any.
    pub metrics_token: Option<String>,
    pub quotas: Quotas,
    /// Where templates live (`LOCKER_CACHE_DIR`).
    pub cache_dir: PathBuf,
    /// Warm machines kept ready for runs (0: start each on demand).
    pub warm_pool: usize,
    /// Ready microVMs kept per sandbox shape asked for (0: each create restores).
    pub vm_pool: usize,
    /// Names pinned to addresses for machines' egress (`--egress-resolve name=ip`): the
    /// egress proxy and DNS responder use these instead of resolving.
    pub egress_resolve: Vec<(String, Vec<std::net::IpAddr>)>,
    /// Build the template `default` in the background at start when it is missing.
    pub template_build: bool,
}

/// A sandbox whose machine runs on this node.
#[derive(Debug)]
pub struct Live {
    pub id: String,
    pub tenant: String,
    pub machine: Machine,
    /// The sandbox's default environment for every exec.
    pub env: BTreeMap<String, String>,
    pub template_digest: String,
    /// Pause after this long without calls or CPU use (the idle policy).
    pub idle_timeout_s: Option<u64>,
    /// Calls in flight (exec, files, processes, PTY, streams): never idle while > 0.
    pub inflight: AtomicU64,
    /// Unix seconds of the last call; written to the store by the reaper, not per call.
    pub last_active: AtomicI64,
    /// Pause state; every transition holds this lock, so a call that is being admitted and
    /// the idle policy can never cross (a call is counted and the machine thawed atomically).
    pub pause: std::sync::Mutex<PauseState>,
    /// Queue times of this sandbox's latest background processes, by process id (the agent
    /// cannot know them; `processes::fill_timings` adds them to the results).
    pub proc_queue_ms: std::sync::Mutex<std::collections::VecDeque<(String, f64)>>,
}

/// Whether and why a sandbox is frozen.
#[derive(Debug, Default, Clone, Copy)]
pub struct PauseState {
    /// Unix seconds when it was frozen; `None` while running.
    pub since: Option<i64>,
    /// Frozen by the idle policy (not by the caller): the time does not count against the TTL.
    pub by_idle: bool,
    /// CPU time seen at the last idle check, and when it last grew noticeably.
    pub cpu_ms: u64,
    pub cpu_active_at: i64,
}

impl Live {
    pub fn new(
        id: String,
        tenant: String,
        machine: Machine,
        env: BTreeMap<String, String>,
        template_digest: String,
        idle_timeout_s: Option<u64>,
        paused: bool,
    ) -> Self {
        let now = now_s();
        Self {
            id,
            tenant,
            machine,
            env,
            template_digest,
            idle_timeout_s,
            inflight: Default::default(),
            last_active: AtomicI64::new(now),
            pause: std::sync::Mutex::new(PauseState {
                since: paused.then_some(now),
                cpu_active_at: now,
                ..Default::default()
            }),
            proc_queue_ms: Default::default(),
        }
    }

    pub fn is_paused(&self) -> bool {
        self.pause.lock().expect("pause lock").since.is_some()
    }
}

/// A call in flight on a sandbox, for as long as it lives; derefs to the sandbox.
pub struct Busy(Arc<Live>);

impl Busy {
    /// Counts a call and thaws the sandbox if it was frozen, atomically with respect to the
    /// idle policy. If it was paused, returns for how many seconds the idle policy (not the
    /// caller) had it paused: the TTL is extended by that much.
    pub fn enter(live: Arc<Live>) -> Result<(Self, Option<i64>), String> {
        let mut st = live.pause.lock().expect("pause lock");
        live.inflight.fetch_add(1, Ordering::SeqCst);
        live.last_active.store(now_s(), Ordering::Relaxed);
        let busy = Busy(live.clone());
        let mut idle_for = None;
        if let Some(since) = st.since {
            live.machine
                .resume()
                .map_err(|e| format!("resuming the sandbox: {e}"))?;
            idle_for = Some(if st.by_idle { now_s() - since } else { 0 });
            st.since = None;
            st.by_idle = false;
            st.cpu_active_at = now_s();
        }
        drop(st);
        Ok((busy, idle_for))
    }
}

impl std::ops::Deref for Busy {
    type Target = Arc<Live>;
    fn deref(&self) -> &Arc<Live> {
        &self.0
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
        self.0.last_active.store(now_s(), Ordering::Relaxed);
    }
}

/// The server's shared state.
pub struct App {
    pub cfg: Config,
    pub store: Arc<dyn Store>,
    pub recorder: CallRecorder,
    pub node: Arc<Node>,
    pub templates: TemplateStore,
    pub live: RwLock<HashMap<String, Arc<Live>>>,
    pub metrics: Metrics,
    /// Volumes and their host-side files agents.
    pub volumes: crate::volumes::Volumes,
    /// Serializes quota checks with the inserts they guard.
    pub create_lock: tokio::sync::Mutex<()>,
    pub started: Instant,
    /// Warm machines for runs.
    pub pool: crate::runs::Pool,
    /// Ready microVMs for sandboxes.
    pub vm_pool: crate::vm_pool::VmPool,
    /// Machines' egress policies: the name-checking proxy and DNS responder.
    pub egress: Arc<crate::egress::Egress>,
    /// Whether the template `default` is being built (see `default_template`).
    pub default_template: crate::default_template::DefaultTemplate,
    /// This server's hold on its data dir, for as long as the process lives.
    _lock: DataDirLock,
}

pub type AppState = Arc<App>;

impl App {
    /// The machines directory of sandboxes.
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("sandboxes")
    }
}

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
    #[error("another locker serve ({holder}) uses this data dir {}: stop it first or pass another --data-dir", .dir.display())]
    Busy { dir: PathBuf, holder: String },
    #[error("cannot lock the data dir ({}): {source}", .path.display())]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How long requests in flight may take to finish once a stop is asked for.
const GRACE: Duration = Duration::from_secs(10);

/// An exclusive `flock` on `<data-dir>/serve.lock`, which holds the holder's pid. The file
/// is opened close-on-exec, so machines' processes never inherit the lock.
#[derive(Debug)]
struct DataDirLock {
    _file: std::fs::File,
}

impl DataDirLock {
    fn take(dir: &std::path::Path) -> Result<Self, ServeError> {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsRawFd;
        let path = dir.join("serve.lock");
        let err = |source| ServeError::Lock {
            path: path.clone(),
            source,
        };
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(err)?;
        // SAFETY: flock on a descriptor we own; the lock lives as long as the file.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(err(e));
            }
            let mut pid = String::new();
            let _ = f.read_to_string(&mut pid);
            let holder = match pid.trim().parse::<u32>() {
                Ok(p) => format!("pid {p}"),
                Err(_) => "pid unknown".into(),
            };
            return Err(ServeError::Busy {
                dir: dir.to_owned(),
                holder,
            });
        }
        f.set_len(0).map_err(err)?;
        f.rewind().map_err(err)?;
        write!(f, "{}", std::process::id()).map_err(err)?;
        Ok(Self { _file: f })
    }
}

/// Builds the state, adopts or cleans up machines a previous server left, and serves until
/// SIGINT or SIGTERM; then stops accepting, lets requests in flight finish (up to
/// [`GRACE`]), flushes call records and takes down what only this server uses (see the
/// module doc). Sandboxes keep running: the next start adopts them.
pub async fn serve(cfg: Config) -> Result<(), ServeError> {
    // Listen for a stop before anything else: one that comes while the server starts is
    // honoured once it is up (the default action would kill it half-way).
    let stop = stop_signal();
    let app = build(cfg).await?;
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
    crate::sandboxes::spawn_reaper(app.clone());
    crate::default_template::ensure(&app, app.cfg.template_build);
    // Prove egress enforcement once at start (reported by /healthz; re-proved on demand
    // before a machine gets egress).
    tokio::task::spawn_blocking(|| match locker_runtime::net::status() {
        Ok(d) => tracing::info!(detail = %d, "egress enforcement works"),
        Err(e) => {
            tracing::warn!(error = %e, "egress enforcement unavailable: sandboxes get egress none only")
        }
    });
    let router = router(app.clone());
    let quit = Arc::new(tokio::sync::Notify::new());
    let quit2 = quit.clone();
    let mut serving = tokio::spawn(
        axum::serve(listener, router)
            .with_graceful_shutdown(async move { quit2.notified().await })
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
            quit.notify_one();
            if tokio::time::timeout(GRACE, &mut serving).await.is_err() {
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
/// refills in flight), volume agents stopped, volumes unmounted.
async fn shutdown(app: &AppState) {
    let _ = tokio::time::timeout(Duration::from_secs(5), app.recorder.flush()).await;
    app.pool.drain(app).await;
    app.vm_pool.drain(app).await;
    app.volumes.stop_agents().await;
    app.volumes.unmount_all().await;
    tracing::info!("stopped: sandboxes keep running for the next start");
}

/// The state, with machines adopted. Public for tests that serve on their own listener.
/// Fails without touching anything when another server holds the data dir.
pub async fn build(cfg: Config) -> Result<AppState, ServeError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(ServeError::NotRoot(euid));
    }
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|e| ServeError::DataDir(cfg.data_dir.clone(), e))?;
    let lock = DataDirLock::take(&cfg.data_dir)?;
    std::fs::create_dir_all(cfg.data_dir.join("sandboxes"))
        .map_err(|e| ServeError::DataDir(cfg.data_dir.clone(), e))?;
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(cfg.data_dir.join("db.sqlite"))?);
    store.ensure_tenant("default")?;
    match &cfg.api_key {
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
    let volumes = crate::volumes::Volumes::open(
        &cfg.data_dir,
        node_cfg.agent_exe.clone(),
        store.list_all_volumes()?,
    )
    .await
    .map_err(ServeError::Volumes)?;
    let node = Arc::new(Node::new(node_cfg)?);
    let templates =
        TemplateStore::open(&cfg.cache_dir).map_err(|e| ServeError::Templates(e.to_string()))?;
    let recorder = CallRecorder::spawn(store.clone());
    let warm_pool = cfg.warm_pool;
    let vm_pool = cfg.vm_pool;
    tracing::info!(quotas = ?cfg.quotas, "per-tenant quotas");
    let egress =
        crate::egress::Egress::new(&cfg.egress_resolve, crate::egress::limits::raise_nofile());
    let app = Arc::new(App {
        cfg,
        store,
        recorder,
        node,
        templates,
        live: RwLock::new(HashMap::new()),
        metrics: Metrics::default(),
        volumes,
        create_lock: tokio::sync::Mutex::new(()),
        started: Instant::now(),
        pool: crate::runs::Pool::new(warm_pool),
        vm_pool: crate::vm_pool::VmPool::new(vm_pool),
        egress,
        default_template: Default::default(),
        _lock: lock,
    });
    crate::sandboxes::adopt_all(&app).await;
    crate::snapshots::cleanup(&app).await;
    crate::runs::cleanup(&app).await;
    crate::runs::Pool::spawn_refill(app.clone());
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
        .merge(crate::volumes::routes())
        .merge(crate::runs::routes())
        .merge(crate::admin::routes())
        .merge(crate::ops::routes())
        .merge(crate::templates::routes())
        .fallback(|| async {
            crate::error::ApiError::not_found("no such route: see /openapi.json")
        })
        .method_not_allowed_fallback(|| async {
            crate::error::ApiError::new(
                axum::http::StatusCode::METHOD_NOT_ALLOWED,
                "this route does not take that method: see /openapi.json",
            )
        })
        .layer(axum::middleware::from_fn_with_state(app.clone(), observe))
        .layer(axum::extract::DefaultBodyLimit::max(1 << 20))
        .with_state(app.clone());
    crate::mcp::mount(app, api)
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

/// Milliseconds since `t`, as the API reports them.
pub fn ms_since(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e3 * 1000.0).round() / 1000.0
}

/// Seconds since the Unix epoch.
pub fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// A random id with a prefix (`sb_…`, `call_…`): 16 hex digits from the kernel's CSPRNG.
pub fn new_id(prefix: &str) -> String {
    let mut b = [0u8; 8];
    // SAFETY: getrandom fills the buffer we own.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    assert_eq!(n, 8, "getrandom");
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{prefix}{hex}")
}
