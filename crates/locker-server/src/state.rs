//! The server's shared state and what every room reads from it: [`Config`] and [`Quotas`]
//! (how `locker serve` was started), [`App`] (the one shared state, as [`AppState`]),
//! [`Live`] sandboxes with their pause state, [`Busy`] (a call in flight), the hold on the
//! data dir; the id and clock helpers of `ids` are re-exported here for the handlers.
//!
//! It owns no behaviour beyond these values' own invariants (a call admitted and a
//! sandbox thawed atomically): handlers and services live in their rooms, start-up and
//! shutdown in `app`. It names the services it holds (the pools, volumes, egress,
//! metrics, the default template's build) and calls none of the handlers: they import it.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use locker_runtime::node::{Machine, Node};
use locker_runtime::template::TemplateStore;
use locker_store::{CallRecorder, SandboxRecord, Store};
use tokio::sync::RwLock;

pub use crate::ids::{ms_since, new_id, now_s};
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
    /// Where preview URLs live (`--preview-domain`); `None`: no preview hosts.
    pub preview: Option<crate::ports::PreviewDomain>,
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
    /// Who may reach its ports by preview URL without an API key (kept beside the store's
    /// copy, so a preview request reads no database).
    pub preview: std::sync::RwLock<Preview>,
    /// The MCP servers bridged from this sandbox (`mcp_bridge`); they end with it.
    pub mcp: crate::mcp_bridge::Servers,
}

/// A sandbox's preview access: its token and its public ports.
#[derive(Debug, Clone, Default)]
pub struct Preview {
    pub token: String,
    pub public_ports: Vec<u16>,
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
    /// The live side of `record`'s sandbox, whose machine is `machine`.
    pub fn new(record: &SandboxRecord, machine: Machine, paused: bool) -> Self {
        let now = now_s();
        Self {
            id: record.id.clone(),
            tenant: record.tenant.clone(),
            machine,
            env: record.env.clone(),
            template_digest: record.template_digest.clone(),
            idle_timeout_s: record.idle_timeout_s,
            inflight: Default::default(),
            last_active: AtomicI64::new(now),
            pause: std::sync::Mutex::new(PauseState {
                since: paused.then_some(now),
                cpu_active_at: now,
                ..Default::default()
            }),
            proc_queue_ms: Default::default(),
            preview: std::sync::RwLock::new(Preview {
                token: record.preview_token.clone(),
                public_ports: record.public_ports.clone(),
            }),
            mcp: Default::default(),
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
    pub pool: Arc<crate::pool::Pool>,
    /// Ready microVMs for sandboxes.
    pub vm_pool: Arc<crate::vm_pool::VmPool>,
    /// Machines' egress policies: the name-checking proxy and DNS responder.
    pub egress: Arc<crate::egress::Egress>,
    /// Whether the template `default` is being built (see `default_template`).
    pub default_template: crate::default_template::DefaultTemplate,
    /// Lifecycle events (`events`): rooms emit, the event room delivers.
    pub events: crate::events::Events,
    /// The dashboard's single-use terminal tickets (`ui`).
    pub tickets: crate::ui::Tickets,
    /// This server's hold on its data dir, for as long as the process lives.
    pub(crate) _lock: DataDirLock,
}

pub type AppState = Arc<App>;

impl App {
    /// The machines directory of sandboxes.
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("sandboxes")
    }
}

/// Why the data dir could not be held.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another locker serve ({holder}) uses this data dir {}: stop it first or pass another --data-dir", .dir.display())]
    Busy { dir: PathBuf, holder: String },
    #[error("cannot lock the data dir ({}): {source}", .path.display())]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// An exclusive `flock` on `<data-dir>/serve.lock`, which holds the holder's pid. The file
/// is opened close-on-exec, so machines' processes never inherit the lock.
#[derive(Debug)]
pub struct DataDirLock {
    _file: std::fs::File,
}

impl DataDirLock {
    pub fn take(dir: &std::path::Path) -> Result<Self, LockError> {
        use std::io::{Read, Seek, Write};
        let path = dir.join("serve.lock");
        let err = |source| LockError::Lock {
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
        // The lock lives as long as the file.
        if !locker_sys::fs::flock(&f, false).map_err(err)? {
            let mut pid = String::new();
            let _ = f.read_to_string(&mut pid);
            let holder = match pid.trim().parse::<u32>() {
                Ok(p) => format!("pid {p}"),
                Err(_) => "pid unknown".into(),
            };
            return Err(LockError::Busy {
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
