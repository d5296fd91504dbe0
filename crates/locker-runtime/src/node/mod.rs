//! The node: one host's machines, whatever their runtime.
//!
//! Owns creating, adopting, pausing and destroying machines and allocating what they need
//! from the host (uid ranges, directories). It hands out [`Machine`]s whose agent channel is
//! open, each with its runtime's own state ([`MachineState`]). It does not know tenants,
//! sandboxes or HTTP: the server maps those onto machines. It starts machines through
//! [`crate::jail`] and [`crate::vm`] and tears them down through [`crate::machine`].

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::agent::AgentClient;
use crate::cgroup::{Layout, MachineCgroup};
use crate::jail::{self, JailSpec};
use crate::machine::slots::{self, SlotError};
use crate::machine::{self, BindMount, MachineState, OverlayMount, Scratch};

pub use crate::machine::state::RuntimeKind;
pub use config::{find_agent, find_shim, is_static_elf, NodeConfig};
use unwind::Unwind;

mod config;
mod shares;
mod unwind;

/// How long a new machine's agent may take to answer.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Jail(#[from] jail::JailError),
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::CgroupError),
    #[error("the machine's agent did not answer: {0}")]
    Agent(#[from] crate::agent::AgentClientError),
    #[error("runtime {0} is not usable on this host: {1}")]
    Unavailable(&'static str, String),
    #[error(
        "no free uid range: {} machines already exist on this host",
        slots::UID_SLOTS
    )]
    NoSlot,
    /// The uid-range leases cannot be read or written.
    #[error(transparent)]
    Slot(SlotError),
    #[error(transparent)]
    Vm(#[from] crate::vm::VmError),
    #[error(transparent)]
    Teardown(#[from] machine::TeardownError),
    /// A host-side step of the node failed (a file it writes, a program it runs).
    #[error("{step}: {source}")]
    Io { step: String, source: io::Error },
    /// A blocking task of the node panicked or was cancelled.
    #[error("{what} task failed: {source}")]
    Task {
        what: &'static str,
        source: tokio::task::JoinError,
    },
    #[error("cannot find the locker binary: {0}")]
    NoInitExe(io::Error),
    #[error("locker-agent not found: set LOCKER_AGENT_BIN or install it beside the locker binary (scripts/setup does)")]
    NoAgent,
    /// The host could not wire a new microVM's network device (see [`crate::net`]).
    #[error("giving machine {machine} its network: {source}")]
    Network {
        machine: String,
        source: crate::net::NetError,
    },
    /// The host could not set a machine's egress (see [`crate::net`]).
    #[error("setting the egress of machine {machine}: {source}")]
    Egress {
        machine: String,
        source: crate::net::NetError,
    },
    /// A microVM's volumes could not be served or mounted.
    #[error("serving volumes to machine {machine}: {reason}")]
    Shares { machine: String, reason: String },
    /// A snapshot would stack more layers than a machine may stand on.
    #[error("this sandbox already stands on {0} snapshot layers (a snapshot of a sandbox made from a snapshot adds one), the most a snapshot may hold is {max}: snapshot a sandbox made from the template (copy the files over) instead", max = crate::disk::MAX_LAYERS)]
    LayersTooDeep(usize),
    #[error("only a microVM takes shares")]
    NotVm,
    #[error("machine {0} has its shares already")]
    SharedAlready(String),
    /// A memory snapshot another QEMU version wrote (`crate::vm::MEMORY_QEMU`).
    #[error("{0}")]
    OtherQemu(String),
    /// Mounting a run's layer into a running machine (`jail::attach`) failed.
    #[error("attaching a mount to machine {machine}: {reason}")]
    Attach { machine: String, reason: String },
}

impl From<SlotError> for NodeError {
    fn from(e: SlotError) -> Self {
        match e {
            SlotError::Full { .. } => NodeError::NoSlot,
            e => NodeError::Slot(e),
        }
    }
}

/// A task's failure, for [`NodeError::Task`].
fn task(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> NodeError {
    move |source| NodeError::Task { what, source }
}

/// Why a machine could not be adopted.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("the machine is gone (its processes ended while no server ran)")]
    Gone,
    #[error("the machine runs but cannot be reached: {0}")]
    Unreachable(NodeError),
}

/// What a new machine is made of.
#[derive(Debug, Clone)]
pub struct MachineSpec {
    pub id: String,
    /// The machine's directory (created, and removed on destroy).
    pub dir: PathBuf,
    pub template_rootfs: PathBuf,
    pub cpus: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub pids: u64,
}

/// What a machine gets attached at start besides its template.
#[derive(Debug, Clone, Default)]
pub struct Attach {
    /// The isolation backend.
    pub runtime: RuntimeKind,
    /// A microVM restores this memory snapshot (with `disk_from` as its disk).
    pub memory_from: Option<PathBuf>,
    /// Start from this snapshot image (`<snapshot>/disk.img`). A jail stands on the
    /// snapshot's layer stack ([`crate::disk::stack_of`]), each image mounted read-only
    /// beneath the machine's own blank disk of `disk_mb`: nothing is copied. A microVM
    /// (with `memory_from`) stands on its stack too ([`crate::disk::vm_stack_of`]: the
    /// snapshot's own image is `disk.img` or `disk.qcow2` beside it), read-only layers of
    /// QEMU's beneath a blank qcow2 overlay of its own: the disk its memory knows, nothing
    /// copied.
    pub disk_from: Option<PathBuf>,
    /// Overlays (a run's volume under its private layer).
    pub overlays: Vec<OverlayMount>,
    /// Bound host directories (volumes of a sandbox).
    pub binds: Vec<BindMount>,
    /// A microVM gets a network device (it will have a network policy other than `none`;
    /// one restored from a memory snapshot has one exactly when the snapshot's VM had).
    pub net: bool,
    /// Where a jail's writable layer lives (a microVM's is always its disk). Memory is
    /// given only where the kernel can id-map a tmpfs ([`crate::jail::memory_scratch`]);
    /// elsewhere the machine gets its disk, as if asked for one.
    pub scratch: Scratch,
}

/// Beside a memory snapshot's `memory`: present when its VM had a network device.
const MEMORY_NIC_MARK: &str = "memory.nic";

/// Beside a memory snapshot's `memory`: the mounts and the file server's table of a VM whose
/// volumes were mounted (`vm_fs::Carried`), taken while its relay held every request
/// ([`Node::hold_shares`]).
pub const FILES_TABLE: &str = "files.json";

/// A running machine with an open agent channel.
#[derive(Debug)]
pub struct Machine {
    pub id: String,
    pub dir: PathBuf,
    /// Its runtime and that runtime's processes.
    pub state: MachineState,
    pub agent: AgentClient,
    cgroup: MachineCgroup,
    /// The jail's shim, or the microVM's QEMU, when this process started it.
    shim: Mutex<Option<tokio::process::Child>>,
    /// A jail's network namespace, taken while its PID 1 was known alive (the proxy dials
    /// ports there, see [`crate::dial`]); `None` for a microVM.
    netns: Option<crate::dial::Netns>,
}

/// The handle on a jail's network namespace, if it can be had (else the proxy takes the
/// agent's tunnel).
fn jail_netns(state: &MachineState) -> Option<crate::dial::Netns> {
    let jail = state.as_jail()?;
    crate::dial::Netns::of_pid(jail.agent_pid)
        .map_err(|e| tracing::debug!(machine = %jail.id, error = %e, "no handle on the jail's network namespace"))
        .ok()
}

impl Machine {
    /// The jail's network namespace handle, if any.
    pub fn netns(&self) -> Option<&crate::dial::Netns> {
        self.netns.as_ref()
    }

    pub fn kind(&self) -> RuntimeKind {
        self.state.kind()
    }

    /// The jail's state, if this machine is a jail.
    pub fn jail(&self) -> Option<&jail::JailState> {
        self.state.as_jail()
    }

    /// The microVM's state, if this machine is a microVM.
    pub fn vm(&self) -> Option<&crate::vm::VmState> {
        self.state.as_vm()
    }

    /// The first host uid of its range.
    pub fn uid_base(&self) -> u32 {
        self.state.uid_base()
    }

    /// Whether its processes are frozen now (paused, or held still for a snapshot).
    pub fn is_frozen(&self) -> bool {
        self.cgroup.is_frozen()
    }

    /// Freezes every process of the machine (no CPU used until [`Machine::resume`]).
    pub fn pause(&self) -> Result<(), NodeError> {
        Ok(self.cgroup.set_frozen(true)?)
    }

    pub fn resume(&self) -> Result<(), NodeError> {
        Ok(self.cgroup.set_frozen(false)?)
    }

    /// CPU time and peak memory of the whole machine so far.
    pub fn usage(&self) -> locker_types::Usage {
        self.cgroup.usage()
    }

    /// Current memory use in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.cgroup.memory_current()
    }

    /// Host pids of every process in the machine.
    pub fn pids(&self) -> Vec<i32> {
        self.cgroup.pids()
    }

    /// Whether the machine's processes still run.
    pub fn is_alive(&self) -> bool {
        self.state.is_alive()
    }

    /// Whether this is a microVM without a network device (created with egress `none`):
    /// no other policy can be given to it.
    pub fn lacks_network_device(&self) -> bool {
        self.vm().is_some_and(|v| !v.shape.net)
    }

    /// Whether host trees are served to this microVM (its volumes; see [`crate::vm_fs`]).
    pub fn has_shares(&self) -> bool {
        self.vm().is_some() && crate::vm_fs::has_shares(&self.dir)
    }

    /// The host path of a jail's writable layer (valid while it runs). A microVM's layer
    /// is inside its guest.
    pub fn upper_dir(&self) -> Option<PathBuf> {
        self.jail().map(jail::JailState::upper_dir)
    }
}

/// One host's machines.
#[derive(Debug)]
pub struct Node {
    config: NodeConfig,
    layout: Layout,
    /// The microVM runtime's assets, prepared on first use.
    vm_assets: Mutex<Option<std::sync::Arc<crate::vm::Assets>>>,
}

impl Node {
    /// A node on this host. Fails if no usable cgroup hierarchy exists.
    pub fn new(config: NodeConfig) -> Result<Self, NodeError> {
        let layout = Layout::host().map_err(|e| NodeError::Unavailable("jail", e.to_string()))?;
        Ok(Self {
            config,
            layout,
            vm_assets: Mutex::new(None),
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// Starts a jailed machine with an empty disk and connects to its agent.
    pub async fn create(&self, spec: MachineSpec) -> Result<Machine, NodeError> {
        self.create_from(spec, None).await
    }

    /// Starts a jailed machine from the snapshot whose image is `disk_from` (its layer
    /// stack mounted read-only beneath a blank disk; see [`Attach::disk_from`]) or from
    /// the template alone, and connects to its agent.
    pub async fn create_from(
        &self,
        spec: MachineSpec,
        disk_from: Option<PathBuf>,
    ) -> Result<Machine, NodeError> {
        self.create_with(spec, disk_from, Vec::new()).await
    }

    /// [`Node::create_from`] with extra overlay mounts (a run's volume; see
    /// [`OverlayMount`]).
    pub async fn create_with(
        &self,
        spec: MachineSpec,
        disk_from: Option<PathBuf>,
        mounts: Vec<OverlayMount>,
    ) -> Result<Machine, NodeError> {
        self.create_attached(
            spec,
            Attach {
                disk_from,
                overlays: mounts,
                ..Default::default()
            },
        )
        .await
    }

    /// Starts a machine with everything attached at start: a disk image to copy, overlay
    /// mounts, bound directories.
    pub async fn create_attached(
        &self,
        spec: MachineSpec,
        attach: Attach,
    ) -> Result<Machine, NodeError> {
        if attach.runtime == RuntimeKind::Microvm {
            return self.create_vm(spec, attach).await;
        }
        let Attach {
            disk_from,
            overlays: mounts,
            binds,
            scratch,
            ..
        } = attach;
        let slot = slots::uid_ranges().lease(&spec.dir)?;
        let unwind = Unwind::new(&spec, slots::uid_base(slot), &self.layout);
        let js = JailSpec {
            id: spec.id.clone(),
            template_rootfs: spec.template_rootfs.clone(),
            dir: spec.dir.clone(),
            uid_base: slots::uid_base(slot),
            cpus: spec.cpus,
            memory_mb: spec.memory_mb,
            pids: spec.pids,
            disk_mb: spec.disk_mb,
            scratch: match scratch {
                Scratch::Memory if crate::jail::memory_scratch() => Scratch::Memory,
                _ => Scratch::Disk,
            },
            layers: disk_from
                .as_deref()
                .map(crate::disk::stack_of)
                .unwrap_or_default(),
            agent_path: self.config.agent_exe.clone(),
            hostname: spec.id.clone(),
            mounts,
            binds,
        };
        let started = async {
            let (state, child) = jail::start(&js, &self.config.shim_exe).await?;
            let agent = AgentClient::connect(&state.socket(), AGENT_CONNECT_TIMEOUT).await?;
            Ok::<_, NodeError>((state, child, agent))
        }
        .await;
        let (state, child, agent) = unwind.check(started).await?;
        let state = MachineState::Jail(state);
        Ok(Machine {
            cgroup: MachineCgroup::new(self.layout.clone(), &spec.id, &spec.dir),
            id: spec.id.clone(),
            dir: spec.dir,
            netns: jail_netns(&state),
            state,
            agent,
            shim: Mutex::new(Some(child)),
        })
    }

    /// The microVM runtime's assets (QEMU, kernel, initramfs), prepared once; an error says
    /// what this host lacks.
    pub async fn vm_assets(&self) -> Result<std::sync::Arc<crate::vm::Assets>, NodeError> {
        if let Some(a) = self.vm_assets.lock().expect("assets lock").clone() {
            return Ok(a);
        }
        let agent = self.config.agent_exe.clone();
        let a = tokio::task::spawn_blocking(move || crate::vm::Assets::prepare(&agent))
            .await
            .map_err(task("microVM assets"))??;
        let a = std::sync::Arc::new(a);
        *self.vm_assets.lock().expect("assets lock") = Some(a.clone());
        Ok(a)
    }

    /// Starts a microVM machine: restores its shape's base (booting it first if this host
    /// has none yet) or a memory snapshot, and connects to its agent.
    async fn create_vm(&self, spec: MachineSpec, attach: Attach) -> Result<Machine, NodeError> {
        if attach.disk_from.is_some() && attach.memory_from.is_none() {
            // A restored base's guest has the base's disk cached in its memory: another
            // disk under it would be corrupted. MicroVMs restore memory snapshots only.
            return Err(NodeError::Unavailable(
                "microvm",
                "a microVM starts from a snapshot with memory only (a disk alone cannot be put under a restored guest)".into(),
            ));
        }
        // A restored VM has exactly the devices its snapshot's VM had.
        let net = match &attach.memory_from {
            Some(mem) => {
                let nic = mem.with_file_name(MEMORY_NIC_MARK).exists();
                if attach.net && !nic {
                    return Err(NodeError::Unavailable(
                        "microvm",
                        "the snapshot is of a microVM without a network device (egress `none`): a sandbox from it has egress `none`".into(),
                    ));
                }
                nic
            }
            None => attach.net,
        };
        // A memory snapshot of a VM whose volumes were mounted (a move): its guest has
        // them mounted already, and its file server starts from the table taken with it.
        let carried = attach
            .memory_from
            .as_deref()
            .map(|mem| mem.with_file_name(FILES_TABLE))
            .filter(|t| t.exists());
        if carried.is_some() && (attach.binds.is_empty() || !attach.overlays.is_empty()) {
            return Err(NodeError::Unavailable(
                "microvm",
                "the snapshot is of a microVM whose volumes were mounted: it starts with the same volumes only".into(),
            ));
        }
        let files = carried.map(|table| {
            (
                self.config.init_exe.as_path(),
                crate::vm_fs::Spec {
                    socket: spec.dir.join(crate::vm::FS_SOCKET),
                    stage: spec.dir.join("fs-root"),
                    binds: attach.binds.clone(),
                    overlays: Vec::new(),
                    carried: Some(table),
                },
            )
        });
        if let Some((_, fs_spec)) = &files {
            let had = fs_spec
                .carried
                .as_deref()
                .map(crate::vm_fs::Carried::mounts_in)
                .transpose()
                .map_err(|source| NodeError::Io {
                    step: "reading the snapshot's volume mounts".into(),
                    source,
                })?
                .flatten();
            if had.as_ref() != Some(&fs_spec.guest_mounts()) {
                return Err(NodeError::Unavailable(
                    "microvm",
                    "the snapshot's guest has other volume mounts than this machine would serve: start it with the same volumes at the same paths".into(),
                ));
            }
        }
        let assets = self.vm_assets().await?;
        if let Some(why) = attach
            .memory_from
            .as_deref()
            .and_then(|mem| crate::vm::VmState::memory_mismatch(mem.parent()?, assets.qemu_version))
        {
            return Err(NodeError::OtherQemu(why));
        }
        let shape = crate::vm::Shape::new(spec.memory_mb, spec.cpus, spec.disk_mb).with_net(net);
        let base = crate::vm::ensure_base(&assets, &spec.template_rootfs, shape).await?;
        let slot = slots::uid_ranges().lease(&spec.dir)?;
        let uid = slots::uid_base(slot);
        let unwind = Unwind::new(&spec, uid, &self.layout);
        if let Some(parent) = spec.dir.parent() {
            traversable(parent);
        }
        let cgroup = MachineCgroup::new(self.layout.clone(), &spec.id, &spec.dir);
        let started = async {
            let netdev = if net {
                let d = spec.dir.clone();
                let (_, netns, tap) = tokio::task::spawn_blocking(move || {
                    crate::net::status()?;
                    crate::net::prepare_vm(&d)
                })
                .await
                .map_err(task("egress"))?
                .map_err(|source| NodeError::Network {
                    machine: spec.id.clone(),
                    source,
                })?;
                Some(crate::vm::NetDev { netns, tap })
            } else {
                None
            };
            let started = crate::vm::start(
                &assets,
                crate::vm::StartSpec {
                    id: &spec.id,
                    dir: &spec.dir,
                    uid,
                    base: &base,
                    disk_from: attach.disk_from.as_deref(),
                    memory_from: attach.memory_from.as_deref(),
                    cgroup: &cgroup,
                    cpus: spec.cpus,
                    pids: spec.pids,
                    net: netdev,
                    files: files.clone(),
                },
            )
            .await?;
            Ok::<_, NodeError>(started)
        }
        .await;
        let (vm, child, agent) = unwind.check(started).await?;
        let m = Machine {
            id: spec.id,
            dir: spec.dir,
            state: MachineState::Vm(vm),
            agent,
            cgroup,
            shim: Mutex::new(Some(child)),
            netns: None,
        };
        if files.is_some() {
            // The guest's relay held its requests when the table was taken: they go to
            // this file server now.
            if let Err(e) = m.agent.hold_shares(false).await {
                let _ = self.destroy(&m).await;
                return Err(e.into());
            }
        } else if !attach.binds.is_empty() || !attach.overlays.is_empty() {
            if let Err(e) = self.share(&m, attach.binds, attach.overlays).await {
                let _ = self.destroy(&m).await;
                return Err(e);
            }
        }
        Ok(m)
    }

    /// Serves host trees to a running microVM, mounted in its guest: live trees (a
    /// sandbox's volumes) and overlays (a run's view and layer). Once per machine: the
    /// file server is started here with all of them (see [`crate::vm_fs`]).
    pub async fn share(
        &self,
        m: &Machine,
        binds: Vec<BindMount>,
        overlays: Vec<OverlayMount>,
    ) -> Result<(), NodeError> {
        if m.vm().is_none() {
            return Err(NodeError::NotVm);
        }
        if crate::vm_fs::has_shares(&m.dir) {
            return Err(NodeError::SharedAlready(m.id.clone()));
        }
        let spec = crate::vm_fs::Spec {
            socket: m.dir.join(crate::vm::FS_SOCKET),
            stage: m.dir.join("fs-root"),
            binds,
            overlays,
            carried: None,
        };
        crate::vm_fs::start(
            &self.config.init_exe,
            &m.dir,
            &spec,
            &m.cgroup.procs_files(),
        )
        .await
        .map_err(|e| NodeError::Shares {
            machine: m.id.clone(),
            reason: e.to_string(),
        })?;
        for g in spec.guest_mounts() {
            m.agent
                .mount_share(g.channel, &g.target, g.read_only)
                .await?;
        }
        Ok(())
    }

    /// Re-attaches to a machine an earlier server process started, if it still runs. The
    /// machine comes back running whatever that server left it as: frozen (paused, or in
    /// the middle of a snapshot) it is thawed, and a microVM QEMU had stopped (a memory
    /// snapshot cut short) is let run again; a frozen or stopped agent could not answer.
    /// The caller freezes it again if it is to stay paused.
    pub async fn adopt(&self, id: &str, dir: &Path) -> Result<Machine, AdoptError> {
        let state = MachineState::load(dir).ok_or(AdoptError::Gone)?;
        if state.id() != id || !state.is_alive() {
            return Err(AdoptError::Gone);
        }
        let cgroup = MachineCgroup::existing(self.layout.clone(), id, dir);
        let kept = cgroup.clone();
        let (vm, id2) = (state.as_vm().cloned(), id.to_owned());
        // Failures here are only logged: the agent's answer below decides.
        let _ = tokio::task::spawn_blocking(move || {
            // Unconditionally: a freeze cut short is neither frozen nor thawed.
            if let Err(e) = cgroup.set_frozen(false) {
                tracing::warn!(machine = %id2, error = %e, "cannot thaw a machine to adopt");
            }
            if let Some(v) = vm {
                if let Err(e) = crate::vm::ensure_running(&v) {
                    tracing::warn!(machine = %id2, error = %e, "cannot let a stopped microVM run on");
                }
            }
        })
        .await;
        let agent = AgentClient::connect(&state.socket(), AGENT_CONNECT_TIMEOUT)
            .await
            .map_err(|e| AdoptError::Unreachable(e.into()))?;
        Ok(Machine {
            id: id.to_owned(),
            dir: dir.to_owned(),
            netns: jail_netns(&state),
            state,
            agent,
            cgroup: kept,
            shim: Mutex::new(None),
        })
    }

    /// Mounts an overlay into a running machine (see [`jail::attach`]).
    pub async fn attach(&self, m: &Machine, mount: OverlayMount) -> Result<(), NodeError> {
        let j = match &m.state {
            MachineState::Vm(_) => return self.share(m, Vec::new(), vec![mount]).await,
            MachineState::Jail(j) => j,
        };
        let spec = jail::AttachSpec {
            agent_pid: j.agent_pid,
            uid_base: j.uid_base,
            mount,
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let done = match jail::attach(spec, move |r| drop(tx.send(r))) {
            Ok(()) => rx
                .await
                .unwrap_or_else(|_| Err(jail::JailError::Init("the attach thread went".into()))),
            Err(e) => Err(e),
        };
        done.map_err(|e| NodeError::Attach {
            machine: m.id.clone(),
            reason: e.to_string(),
        })
    }

    /// Sets a running machine's egress (see [`crate::net`]): any policy but `None` wires
    /// its veth and subnet if it has none and installs the policy's rules; `None` removes
    /// them (loopback only). Returns the machine's lease, if it has a link now. Fails (and
    /// leaves no egress) when enforcement cannot be set up.
    pub async fn set_egress(
        &self,
        m: &Machine,
        policy: crate::net::Policy,
    ) -> Result<Option<crate::net::NetLease>, NodeError> {
        let all = policy != crate::net::Policy::None;
        let pid = match &m.state {
            MachineState::Vm(_) => return self.set_vm_egress(m, policy).await,
            MachineState::Jail(j) => j.agent_pid,
        };
        let dir = m.dir.clone();
        tokio::task::spawn_blocking(move || {
            if all {
                crate::net::status()?;
                crate::net::attach(&dir, pid, &policy).map(Some)
            } else {
                crate::net::detach(&dir, Some(pid));
                Ok(None)
            }
        })
        .await
        .map_err(task("egress"))?
        .map_err(|source| NodeError::Egress {
            machine: m.id.clone(),
            source,
        })
    }

    /// [`Node::set_egress`] for a microVM: its link exists from its start (when it has a
    /// network device at all) and stays; the policy replaces the rules only (`None` closes
    /// the link). The first policy that opens it also configures the guest's `eth0`, route
    /// and `/etc/resolv.conf` through the agent (`net-guest` in the machine's directory
    /// remembers that).
    async fn set_vm_egress(
        &self,
        m: &Machine,
        policy: crate::net::Policy,
    ) -> Result<Option<crate::net::NetLease>, NodeError> {
        let open = policy != crate::net::Policy::None;
        if m.lacks_network_device() {
            if !open {
                return Ok(None);
            }
            return Err(NodeError::Unavailable(
                "microvm",
                "this microVM has no network device (it was created with egress `none`): create a sandbox with the network policy instead".into(),
            ));
        }
        let dir = m.dir.clone();
        let lease = tokio::task::spawn_blocking(move || {
            if open {
                crate::net::status()?;
            }
            crate::net::attach_vm(&dir, &policy)
        })
        .await
        .map_err(task("egress"))?
        .map_err(|source| NodeError::Egress {
            machine: m.id.clone(),
            source,
        })?;
        if !open {
            return Ok(None);
        }
        let mark = m.dir.join("net-guest");
        if !mark.exists() {
            m.agent
                .configure_net("eth0", lease.machine_ip(), 30, lease.host_ip())
                .await?;
            let conf = format!(
                "# Written by Locker: the host answers for the names this machine may reach.\nnameserver {}\noptions timeout:2 attempts:2\n",
                lease.host_ip()
            );
            m.agent
                .write_file("/etc/resolv.conf", Some(0o644), conf.as_bytes())
                .await?;
            fs::write(&mark, b"").map_err(|source| NodeError::Io {
                step: format!("write {}", mark.display()),
                source,
            })?;
        }
        Ok(Some(lease))
    }

    /// The machine's address on its veth, when it has egress.
    pub fn egress_address(&self, m: &Machine) -> Option<std::net::Ipv4Addr> {
        crate::net::NetLease::load(&m.dir).map(|l| l.machine_ip())
    }

    /// Copies a running machine's disk to `dest` at one consistent point: its processes
    /// are frozen, its filesystem flushed, the image copied (a reflink where the data dir's
    /// filesystem can), and the processes thawed, also on failure.
    pub async fn snapshot_disk(
        &self,
        m: &Machine,
        dest: &Path,
    ) -> Result<(crate::disk::CopyKind, u64), NodeError> {
        let was_frozen = self.is_frozen(m);
        if !was_frozen {
            m.pause()?;
        }
        // A jail's disk as its shim mounted it; a microVM's guest flushed nothing here (its
        // memory snapshot is [`Node::snapshot`]'s).
        let mount = m
            .upper_dir()
            .and_then(|u| u.parent().map(Path::to_owned))
            .unwrap_or_default();
        let (img, dest) = (m.dir.join("disk.img"), dest.to_owned());
        let r = tokio::task::spawn_blocking(
            move || -> std::io::Result<(crate::disk::CopyKind, u64)> {
                crate::disk::flush(&mount)?;
                let kind = crate::disk::copy(&img, &dest)?;
                Ok((kind, crate::disk::allocated_bytes(&dest)))
            },
        )
        .await
        .map_err(task("snapshot"));
        if !was_frozen {
            m.resume()?;
        }
        r?.map_err(|source| NodeError::Io {
            step: "copying the machine's disk".into(),
            source,
        })
    }

    /// Snapshots a running machine into `dir` (which exists, and is closed to every user
    /// but root here: a microVM's QEMU reads its layers as its machine's uid). A jail's
    /// snapshot is its disk as `disk.img` over the layers the machine stands on, linked
    /// (stored once) as `lower/1.img`, … (see [`crate::disk::stack_of`]). A microVM's is
    /// its memory and device state as `memory` and its own disk (`disk.img`, or its qcow2
    /// overlay `disk.qcow2`) over its layers the same way (see [`crate::vm::save`]).
    /// Returns the bytes taken (the machine's own layer, and memory; shared lower layers
    /// are counted by the snapshot that made them) and whether memory was saved.
    pub async fn snapshot(&self, m: &Machine, dir: &Path) -> Result<(u64, bool), NodeError> {
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|source| {
                NodeError::Io {
                    step: format!("chmod {}", dir.display()),
                    source,
                }
            })?;
        }
        let Some(vm) = m.vm().cloned() else {
            let below = crate::disk::machine_layers(&m.dir).len();
            if below + 1 > crate::disk::MAX_LAYERS {
                return Err(NodeError::LayersTooDeep(below));
            }
            let (_, size) = self.snapshot_disk(m, &dir.join("disk.img")).await?;
            let (layers, lowers) = (
                crate::disk::machine_layers(&m.dir),
                dir.join(crate::disk::SNAPSHOT_LOWERS),
            );
            tokio::task::spawn_blocking(move || crate::disk::link_stack(&layers, &lowers, 1))
                .await
                .map_err(task("snapshot"))?
                .map_err(|source| NodeError::Io {
                    step: "recording the machine's layers".into(),
                    source,
                })?;
            return Ok((size, false));
        };
        if crate::vm_fs::has_shares(&m.dir) && !dir.join(FILES_TABLE).exists() {
            // The guest's FUSE mounts hold the file server's node ids: a restored copy
            // would meet a fresh server that knows none of them. Only a move, which holds
            // the mounts and takes the server's table first, carries them.
            return Err(NodeError::Unavailable(
                "microvm",
                "a microVM with volumes cannot be snapshotted with its memory".into(),
            ));
        }
        // A machine on as many layers as a snapshot may hold is written out whole by the
        // save (`crate::vm::save`): no limit here.
        // QMP answers only a running QEMU: thaw a paused machine for the save (the guest
        // itself is stopped by QMP meanwhile) and freeze it again after.
        let was_frozen = self.is_frozen(m);
        if was_frozen {
            m.resume()?;
        }
        let d = dir.to_owned();
        let r = tokio::task::spawn_blocking(move || {
            let disk = crate::vm::save(&vm, &d)?;
            if vm.shape.net {
                fs::write(d.join(MEMORY_NIC_MARK), b"").map_err(|source| {
                    crate::vm::VmError::Io {
                        step: "mark the snapshot".into(),
                        source,
                    }
                })?;
            }
            Ok::<u64, crate::vm::VmError>(
                crate::disk::allocated_bytes(&disk)
                    + crate::disk::allocated_bytes(&d.join("memory")),
            )
        })
        .await
        .map_err(task("snapshot"));
        if was_frozen {
            m.pause()?;
        }
        Ok((r??, true))
    }

    /// The first step of carrying running microVM `m` out live (see [`crate::vm::live`]):
    /// its point, and the layers linked into snapshot directory `dir` (closed to all but
    /// root), with the mark a memory snapshot of its shape has. `None`: not a running
    /// microVM, or its chain has no room for another layer: it moves cold
    /// ([`Node::snapshot`]); so does one whose volumes are mounted unless
    /// [`Node::hold_shares`] took its file server's table into `dir` first. Step 2 is
    /// [`crate::vm::live::migrate_out`], in a blocking task.
    pub async fn live_out(
        &self,
        m: &Machine,
        dir: &Path,
    ) -> Result<Option<crate::vm::live::Outgoing>, NodeError> {
        let Some(vm) = m.vm().cloned() else {
            return Ok(None);
        };
        if self.is_frozen(m)
            || (crate::vm_fs::has_shares(&m.dir) && !dir.join(FILES_TABLE).exists())
        {
            return Ok(None);
        }
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|source| {
                NodeError::Io {
                    step: format!("chmod {}", dir.display()),
                    source,
                }
            })?;
        }
        let d = dir.to_owned();
        let mark = vm.shape.net.then_some(MEMORY_NIC_MARK);
        Ok(
            tokio::task::spawn_blocking(move || crate::vm::live::prepare_out(&vm, &d, mark))
                .await
                .map_err(task("live move"))??,
        )
    }

    fn is_frozen(&self, m: &Machine) -> bool {
        m.cgroup.is_frozen()
    }

    /// Whether nothing but a jail's own agent (and its shim) runs in it now, read from the
    /// machine's cgroups: then its files cannot change until the host asks the agent for
    /// something (commands are the only other writers, and every one of them is in the
    /// machine's cgroups), so a run may read its layer without stopping it first. Always
    /// false for a microVM, whose guest the host cannot see into.
    pub fn only_agent_left(&self, m: &Machine) -> bool {
        let Some(j) = m.state.as_jail() else {
            return false;
        };
        m.cgroup
            .pids()
            .iter()
            .all(|&p| p == j.agent_pid || p == j.shim_pid)
    }

    /// Kills every process of a machine and waits until none is left; its files stop
    /// changing. [`Node::destroy`] must still follow.
    pub async fn stop(&self, m: &Machine) -> Result<(), NodeError> {
        let (id, dir, layout) = (m.id.clone(), m.dir.clone(), self.layout.clone());
        tokio::task::spawn_blocking(move || machine::stop(&id, &dir, &layout))
            .await
            .map_err(task("stop"))??;
        Ok(())
    }

    /// Destroys a machine: nothing of it remains (processes, mounts, cgroup, directory).
    pub async fn destroy(&self, m: &Machine) -> Result<(), NodeError> {
        let shim = m.shim.lock().expect("shim lock").take();
        let (id, dir, layout) = (m.id.clone(), m.dir.clone(), self.layout.clone());
        let started = Instant::now();
        tokio::task::spawn_blocking(move || machine::destroy(&id, &dir, &layout))
            .await
            .map_err(task("destroy"))??;
        if let Some(mut child) = shim {
            // The shim has exited (destroy waited for it); reap it now.
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
        }
        tracing::debug!(machine = %m.id, ms = started.elapsed().as_secs_f64() * 1e3, "machine destroyed");
        Ok(())
    }

    /// Destroys the machine `id` in `dir` that no [`Machine`] handle holds (one a killed
    /// server left), its uid range included. Nothing happens if `dir` holds no machine.
    pub async fn destroy_dir(&self, id: &str, dir: &Path) -> Result<(), NodeError> {
        let (id, d, layout) = (id.to_owned(), dir.to_owned(), self.layout.clone());
        tokio::task::spawn_blocking(move || machine::destroy(&id, &d, &layout))
            .await
            .map_err(task("destroy"))??;
        Ok(())
    }

    /// Destroys machines under `machines_dir` (and machine cgroups) not named in `keep`.
    pub async fn cleanup_orphans(&self, machines_dir: &Path, keep: Vec<String>) -> Vec<String> {
        let (dir, layout) = (machines_dir.to_owned(), self.layout.clone());
        tokio::task::spawn_blocking(move || {
            // Each machine destroyed gives its uid range back (see [`machine::destroy`]).
            let removed = machine::cleanup_orphans(&dir, &keep, &layout);
            // Veths and subnet leases of machines that no longer exist (host-wide).
            let stale = crate::net::cleanup_stale();
            if !stale.is_empty() {
                tracing::info!(count = stale.len(), "removed stale machine networks");
            }
            removed
        })
        .await
        .unwrap_or_default()
    }
}

/// Lets every user traverse (not list) `dir` and its parents, so a microVM's QEMU, which
/// runs as the machine's own uid, can reach its directory.
fn traversable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for d in dir.ancestors() {
        if let Ok(m) = fs::metadata(d) {
            let mode = m.permissions().mode();
            if mode & 0o001 == 0 {
                let _ = fs::set_permissions(d, fs::Permissions::from_mode((mode | 0o001) & 0o7777));
            }
        }
    }
}
