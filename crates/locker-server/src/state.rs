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
    /// Template builds running at once (more wait, queued).
    pub template_builds: u64,
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
            template_builds: 2,
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
    /// CA files the egress proxy trusts beside the host's when it connects to a secret's
    /// host (`--egress-ca`: private hosts, tests).
    pub egress_ca: Vec<PathBuf>,
    /// Build the template `default` in the background at start when it is missing.
    pub template_build: bool,
    /// Where preview URLs live (`--preview-domain`); `None`: no preview hosts.
    pub preview: Option<crate::ports::PreviewDomain>,
    /// Put cgroup moves on the kernel's fast path at start (`favordynmods`; off with
    /// `--no-favordynmods`): see `locker_runtime::cgroup::MoveMode`.
    pub favordynmods: bool,
    /// The Postgres database several servers share (`--database postgres://…`); `None`:
    /// SQLite in the data dir (`db.sqlite`), one host.
    pub database: Option<String>,
    /// Whether sandboxes' disks and snapshots may move to an XFS image of Locker's own
    /// when the data dir cannot reflink (`--cow-disks`; see `locker_runtime::cow_disks`).
    pub cow_disks: locker_runtime::cow_disks::Mode,
    /// Whether and where nodes of other hosts join this control plane (`--fleet-listen`).
    pub fleet: Option<crate::fleet::control::ControlConfig>,
    /// Whether this server is also a node of the fleet (`--node local`).
    pub local_node: Option<crate::fleet::local::LocalNodeConfig>,
    /// This engine is a fleet node's (`locker node`): it serves the control plane only,
    /// through the node listener (`fleet::node`), and holds no API keys.
    pub fleet_member: bool,
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
    /// How its up time splits (active, idle, paused) and the gaps between its calls:
    /// moved only when `inflight` goes 0↔>0 or the pause state changes.
    pub clock: std::sync::Mutex<Clock>,
}

/// Upper bounds (seconds) of the buckets of gaps between a sandbox's calls; one more bucket
/// holds the longer ones (`+Inf`).
pub const GAP_BOUNDS: [f64; 12] = [
    0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// A sandbox's time split, kept by transitions: a call in flight (active), up with none
/// (idle), frozen (paused); and a histogram of the gaps between one call's end and the
/// next one's start (paused time included: it is time the sandbox was not needed).
#[derive(Debug)]
pub struct Clock {
    calls: bool,
    paused: bool,
    since: Instant,
    last_call_end: Option<Instant>,
    times: locker_store::SandboxTimes,
}

impl Clock {
    /// A clock that goes on from `times` (persisted before), idle or paused from now.
    pub fn new(times: locker_store::SandboxTimes, paused: bool) -> Self {
        let mut times = times;
        times.call_gaps.resize(GAP_BOUNDS.len() + 1, 0);
        Self {
            calls: false,
            paused,
            since: Instant::now(),
            last_call_end: None,
            times,
        }
    }

    fn settle(&mut self, now: Instant) {
        let ms = now.duration_since(self.since).as_millis() as u64;
        self.since = now;
        let slot = if self.paused {
            &mut self.times.paused_ms
        } else if self.calls {
            &mut self.times.active_ms
        } else {
            &mut self.times.idle_ms
        };
        *slot += ms;
    }

    /// A first call came in (`true`) or the last one left (`false`).
    pub fn calls(&mut self, on: bool) {
        let now = Instant::now();
        self.settle(now);
        if on {
            if let Some(end) = self.last_call_end.take() {
                let gap = now.duration_since(end).as_secs_f64();
                let i = GAP_BOUNDS
                    .iter()
                    .position(|b| gap <= *b)
                    .unwrap_or(GAP_BOUNDS.len());
                self.times.call_gaps[i] += 1;
                self.times.call_gap_sum_ms += now.duration_since(end).as_millis() as u64;
            }
        } else {
            self.last_call_end = Some(now);
        }
        self.calls = on;
    }

    /// The sandbox was frozen (`true`) or thawed (`false`).
    pub fn paused(&mut self, on: bool) {
        self.settle(Instant::now());
        self.paused = on;
    }

    /// The figures up to now.
    pub fn times(&mut self) -> locker_store::SandboxTimes {
        self.settle(Instant::now());
        self.times.clone()
    }
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
    /// Being carried to another node (`carry`): frozen, and no call is admitted; whether it
    /// was paused before (so that a move that fails leaves it as it was).
    pub moving: Option<bool>,
    /// Its move passed the point of no return here (`carry`'s release): it is not thawed
    /// for a move abandoned.
    pub leaving: bool,
    /// Moves begun here so far: a give-up acts only on the move it watched.
    pub moves: u64,
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
            clock: std::sync::Mutex::new(Clock::new(Default::default(), paused)),
        }
    }

    /// Its time split up to now.
    pub fn times(&self) -> locker_store::SandboxTimes {
        self.clock.lock().expect("clock lock").times()
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
    pub fn enter(live: Arc<Live>) -> Result<(Self, Option<i64>), crate::error::ApiError> {
        let mut st = live.pause.lock().expect("pause lock");
        if st.moving.is_some() {
            return Err(crate::error::ApiError::unavailable(format!(
                "sandbox {} is moving to another node (its node is being drained): call again \
                 in a few seconds",
                live.id
            )));
        }
        {
            let mut clock = live.clock.lock().expect("clock lock");
            if live.inflight.fetch_add(1, Ordering::SeqCst) == 0 {
                clock.calls(true);
            }
        }
        live.last_active.store(now_s(), Ordering::Relaxed);
        let busy = Busy(live.clone());
        let mut idle_for = None;
        if let Some(since) = st.since {
            live.machine.resume().map_err(|e| {
                crate::error::ApiError::internal(format!("resuming the sandbox: {e}"))
            })?;
            idle_for = Some(if st.by_idle { now_s() - since } else { 0 });
            st.since = None;
            st.by_idle = false;
            st.cpu_active_at = now_s();
            live.clock.lock().expect("clock lock").paused(false);
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
        {
            let mut clock = self.0.clock.lock().unwrap_or_else(|e| e.into_inner());
            if self.0.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
                clock.calls(false);
            }
        }
        self.0.last_active.store(now_s(), Ordering::Relaxed);
    }
}

/// The server's shared state.
pub struct App {
    pub cfg: Config,
    /// This server's host id (`fleet::host_id`): its sandboxes' rows carry it.
    pub host_id: String,
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
    /// Tenants' secrets: sealing, opening, placeholders.
    pub secrets: Arc<crate::secrets::Secrets>,
    /// Whether the template `default` is being built (see `default_template`).
    pub default_template: crate::default_template::DefaultTemplate,
    /// Lifecycle events (`events`): rooms emit, the event room delivers.
    pub events: crate::events::Events,
    pub builds: crate::templates::Builds,
    /// Each tenant's usage minute by minute, for the dashboard's charts (`usage_series`).
    pub usage_series: crate::usage_series::Series,
    /// This server's hold on its data dir, for as long as the process lives.
    /// Where sandboxes' machines and snapshots live (`locker_runtime::cow_disks`).
    pub disks: locker_runtime::cow_disks::Placement,
    /// The control listener nodes join and beat to, when `--fleet-listen` is set.
    pub fleet: Option<Arc<crate::fleet::control::Control>>,
    /// The creates the control plane asked of this engine as a fleet node (its reports).
    pub fleet_creates: crate::fleet::node::Creates,
    /// Whether this server may act on its live sandboxes (a stall of a `--node local`
    /// server closes it until its node's next beat: `fleet::local::Awake`).
    pub awake: crate::fleet::local::Awake,
    pub(crate) _lock: DataDirLock,
}

pub type AppState = Arc<App>;

impl App {
    /// The machines directory of sandboxes.
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.disks.sandboxes.clone()
    }

    /// Where snapshots (and forks' points) are kept: on the sandboxes' filesystem.
    pub fn snapshots_dir(&self) -> PathBuf {
        self.disks.snapshots.clone()
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

/// An exclusive lock on `<data-dir>/serve.lock`, which holds the holder's pid.
///
/// A POSIX record lock, owned by the server *process* (`locker_sys::fs::lock_for_process`),
/// not an `flock` on the open file: the server spawns all the time (machines' shims,
/// tools), and a child caught between fork and exec when the server is killed shares the
/// open file for a moment; with `flock` that child kept the lock and a service manager's
/// immediate restart was refused. The file is opened close-on-exec and nothing else in the
/// process opens it (closing any descriptor of it would drop the lock).
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
        if !locker_sys::fs::lock_for_process(&f).map_err(err)? {
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
