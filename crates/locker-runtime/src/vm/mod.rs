//! The microVM runtime: a machine with its own guest kernel, in a QEMU `microvm`, started by
//! restoring a booted snapshot instead of booting.
//!
//! This room owns the guest assets, the warm "base" snapshots and the QEMU processes:
//! - **Assets** ([`Assets`]): QEMU, the guest kernel (Debian's cloud kernel, unpacked by
//!   `scripts/setup` into `$LOCKER_CACHE_DIR/vm-kernel`), an initramfs built here from the
//!   static `locker-agent` (which is the guest's init, see the agent's `vm` module) and the
//!   virtio modules it needs, and per template a read-only ext4 image of its root filesystem.
//! - **Bases** ([`ensure_base`]): per (assets, template, shape) one VM is booted once, its
//!   agent waited for, its filesystems flushed, and its device state saved while its RAM sits
//!   in a shared file on tmpfs (`/run/locker/vm-base/<key>/`). Migration capability
//!   `x-ignore-shared` keeps that RAM out of the state file: the snapshot is tens of KiB.
//! - **Machines** ([`start`]): every microVM sandbox restores a base (or a memory snapshot
//!   of another sandbox): QEMU maps the base's RAM file privately (copy-on-write), reads the
//!   device state from an inherited fd (`-incoming fd:3`), and runs on. The host then connects
//!   to the agent's virtio-serial port (a unix socket on the host side, `agent.sock` in the
//!   machine's directory, the same name the jail runtime uses) and refreshes the guest's
//!   clock, entropy and hostname.
//! - **Snapshots with memory** ([`save`]): QMP `stop`, a migration into a file the host
//!   hands over by fd, the machine's own disk image taken while the VM is stopped, then
//!   `cont`; the layers it stands on are linked beneath, not copied. The image is taken
//!   by a zero-copy point where it holds enough to be worth one ([`stack`]: QEMU goes on
//!   on a new blank overlay and the image becomes a read-only layer the snapshot shares),
//!   else copied.
//! - **Disks**: the guest's writable disk (`/dev/vdb`) is a chain of images QEMU is given
//!   node by node (`-blockdev`, see `qemu::disk_args`), each with the format the host named
//!   it with ([`crate::disk::Format`]: `*.img` raw, `*.qcow2` qcow2), never probed and never
//!   backed by a file an image's header names. A machine restored from a base writes a raw
//!   copy of the base's disk (`disk.img`): that disk is small (a fresh ext4 and the boot's
//!   writes, a few MB allocated), so its sparse copy costs about a millisecond, QEMU adds no
//!   qcow2 lookups to its writes, and its snapshot is one raw image. A machine started from a
//!   memory snapshot stands on the snapshot's layer stack ([`crate::disk::vm_stack_of`]),
//!   hard-linked into `layers/` as a jail's is, read-only to QEMU, beneath a blank qcow2
//!   overlay of its own (`disk.qcow2`, a copy of a blank made once per size): nothing of the
//!   snapshot's data is copied, and a snapshot of it holds only what it wrote (its overlay)
//!   over the same layers (`lower/`). The files of a machine's directory say which it is,
//!   until a point moves it: then its record `disk.json` does ([`stack::Chain`]).
//!
//! Each QEMU runs as the unprivileged uid of its machine's slot, in the machine's cgroup (cpu,
//! memory, pids), under QEMU's seccomp sandbox (`-sandbox on`, no spawning, no privilege
//! changes). Its files are its own directory; the kernel, initramfs and template image are
//! read-only to it, and so are the layers its disk stands on (root's files, shared by every
//! machine and snapshot of that chain). A machine with egress `none` has no network device at all, and its QEMU
//! a network namespace of its own with nothing in it. A machine with a network policy is of
//! another shape ([`Shape::net`]: a restored VM has exactly its base's devices): one
//! `virtio-net` device whose backend is a tap the host opened in the machine's own network
//! namespace ([`NetDev`], made by [`crate::net::prepare_vm`]), handed to QEMU by fd; QEMU
//! joins that namespace and opens nothing itself. The host then bridges the tap to the
//! machine's veth, so every packet of the guest meets the same host rules as a jail's.
//!
//! It does not know tenants, HTTP or the database; [`crate::node`] hands its machines out.

mod accel;
mod assets;
mod base;
pub mod live;
mod qemu;
mod qmp;
pub mod stack;

pub use accel::{accel, Accel};
pub use assets::{
    cache_dir, host_khz, kernel_dir, live_moves, qemu_version, template_image, Assets,
    LIVE_MIN_QEMU,
};
pub use base::{ensure_base, Base};
pub use qemu::Shape;
use qemu::*;
pub use qmp::QmpError;
use qmp::*;
pub use stack::Chain;

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::agent::AgentClient;
use crate::cgroup::MachineCgroup;

/// The virtio-serial port name the agent looks for in the guest.
pub const PORT_NAME: &str = "org.locker.agent";
/// The host end of the file port, in the machine's directory.
pub const FS_SOCKET: &str = "fs.sock";
/// Where bases live: tmpfs, so their RAM files cost memory only for the pages touched.
pub const BASE_DIR: &str = "/run/locker/vm-base";
/// Modules the guest needs before it can mount its disks (dependencies are added).
const MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "overlay",
    "virtio_net",
    "fuse",
];
/// The devices every VM has, by version: bases made with other devices are not restored.
const DEVICES: &str = "devices-2: agent and fs ports";
/// The most a cold boot of a base may take (TCG on a loaded 2-core host is slow).
const BOOT_TIMEOUT: Duration = Duration::from_secs(180);
/// QEMU's own memory beside the guest's (device emulation, TCG's translation cache).
const QEMU_OVERHEAD_MB: u64 = 192;
/// The volume file server's, in the same cgroup: each node the guest's kernel remembers
/// pins an inode and a dentry on the host (about 1.3 KB; see [`crate::vm_fs`]).
const FS_SERVER_MB: u64 = 160;
/// TCG's translation block cache in MiB (QEMU's default is a gigabyte).
const TCG_TB_MB: u64 = 64;

/// Errors of the microVM runtime; each names the step that failed and carries its cause.
/// The first three are what this host lacks: their messages say what to install.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("qemu-system-x86_64 is not installed (scripts/setup installs qemu-system-x86)")]
    QemuMissing,
    #[error("no guest kernel in {} (scripts/setup unpacks linux-image-cloud-amd64 there: vmlinuz and modules/)", .0.display())]
    KernelMissing(PathBuf),
    #[error("the guest kernel has no module {0}")]
    ModuleMissing(String),
    /// A host-side step (a file, a directory, a disk copy, a lock) failed.
    #[error("{step}: {source}")]
    Io { step: String, source: io::Error },
    /// QEMU could not be run, exited, or its VM did not get where it should; `detail`
    /// ends with QEMU's and the guest's logs where there are any.
    #[error("{step}: {detail}")]
    Qemu { step: &'static str, detail: String },
    /// A QMP command (or the connection for it) failed.
    #[error("QMP {cmd}: {source}")]
    Qmp { cmd: String, source: QmpError },
    /// The initramfs cannot be built as this server needs it.
    #[error("{0}")]
    Initrd(String),
    /// A template's read-only disk image cannot be built.
    #[error("{0}")]
    TemplateImage(String),
    #[error("create the machine's cgroup: {0}")]
    Cgroup(#[source] crate::cgroup::CgroupError),
    #[error("a VM of shape {shape:?} needs {} network device backend", if shape.net { "a" } else { "no" })]
    NetDevice { shape: Shape },
    /// A blocking task of the runtime panicked or was cancelled.
    #[error("{what} task failed: {source}")]
    Task {
        what: &'static str,
        source: tokio::task::JoinError,
    },
    #[error("the VM's agent did not answer: {0}")]
    Agent(#[from] crate::agent::AgentClientError),
}

/// An I/O error's step, for [`VmError::Io`].
fn setup(what: impl std::fmt::Display) -> impl FnOnce(io::Error) -> VmError {
    move |source| VmError::Io {
        step: what.to_string(),
        source,
    }
}

/// A task's failure, for [`VmError::Task`].
fn task(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> VmError {
    move |source| VmError::Task { what, source }
}

/// What a microVM machine is, written to `<dir>/vm.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmState {
    pub id: String,
    pub dir: PathBuf,
    pub pid: i32,
    pub uid: u32,
    pub base: PathBuf,
    pub shape: Shape,
    pub accel: Accel,
    /// The version of the QEMU that runs it (major, minor); unknown for machines an
    /// earlier release started.
    #[serde(default)]
    pub qemu: Option<(u32, u32)>,
}

/// Beside a memory snapshot's `memory`: the version of the QEMU that wrote it (`10.0`).
/// QEMU does not version its `microvm` machine, so another version may not load the
/// state (7.2's into 10.0: "Size mismatch: pc.bios"): a restore checks it first.
pub const MEMORY_QEMU: &str = "memory.qemu";

impl VmState {
    /// Records, in snapshot directory `dir`, which QEMU wrote its memory ([`MEMORY_QEMU`]).
    pub(super) fn mark_memory(&self, dir: &Path) -> Result<(), VmError> {
        match self.qemu {
            Some((major, minor)) => fs::write(dir.join(MEMORY_QEMU), format!("{major}.{minor}\n"))
                .map_err(setup("record the snapshot's QEMU version")),
            None => Ok(()),
        }
    }

    /// Why a memory snapshot in `dir` cannot be restored by QEMU `here`, if it cannot: its
    /// [`MEMORY_QEMU`] names another version. A snapshot without it (an earlier release's)
    /// is tried.
    pub fn memory_mismatch(dir: &Path, here: (u32, u32)) -> Option<String> {
        let text = fs::read_to_string(dir.join(MEMORY_QEMU)).ok()?;
        let wrote = text.trim();
        (assets::major_minor(wrote)? != here).then(|| {
            format!(
                "the snapshot's memory was written by QEMU {wrote} and this host runs QEMU {}.{}, which cannot load another version's microVM state: start it on a host with QEMU {wrote}, or make a new sandbox and copy its files over",
                here.0, here.1
            )
        })
    }

    pub fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&fs::read(dir.join("vm.json")).ok()?).ok()
    }
}

/// Whether `dir` holds a microVM machine.
pub fn is_vm_dir(dir: &Path) -> bool {
    dir.join("vm.json").exists()
}

/// A new machine: restored from `base`, or from a memory snapshot of another machine
/// (`memory_from`, with its disk as `disk_from`).
pub struct StartSpec<'a> {
    pub id: &'a str,
    pub dir: &'a Path,
    pub uid: u32,
    pub base: &'a Base,
    pub disk_from: Option<&'a Path>,
    pub memory_from: Option<&'a Path>,
    pub cgroup: &'a MachineCgroup,
    pub cpus: f64,
    pub pids: u64,
    /// The network device's backend: required exactly when the base's shape has one.
    pub net: Option<NetDev>,
    /// The file server of a guest whose volumes are mounted already (a memory snapshot
    /// of a move, `crate::vm_fs::Spec::carried`): started with the `__vm-fs` executable
    /// once QEMU's port exists and before the guest runs, so that the guest never sees its
    /// host end missing (its relay would abort the mounts).
    pub files: Option<(&'a Path, crate::vm_fs::Spec)>,
}

/// What a machine's network device is plugged into: the machine's network namespace (QEMU
/// joins it) and a tap opened there by the host (QEMU gets the fd and opens nothing).
#[derive(Debug)]
pub struct NetDev {
    pub netns: fs::File,
    pub tap: fs::File,
}

/// Starts a machine and returns its state, its QEMU process and its connected agent.
pub async fn start(
    a: &Assets,
    s: StartSpec<'_>,
) -> Result<(VmState, tokio::process::Child, AgentClient), VmError> {
    let t0 = Instant::now();
    let dir = s.dir;
    if s.base.shape.net != s.net.is_some() {
        return Err(VmError::NetDevice {
            shape: s.base.shape,
        });
    }
    fs::create_dir_all(dir).map_err(setup(format!("create {}", dir.display())))?;
    std::os::unix::fs::chown(dir, Some(s.uid), Some(s.uid))
        .map_err(setup("give the machine its directory"))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(setup("chmod the machine directory"))?;
    let disk = prepare_disk(dir, s.uid, s.base, s.disk_from)?;
    let t_disk = t0.elapsed();
    let state_src = s.memory_from.map_or_else(|| s.base.state(), Path::to_owned);
    let incoming =
        fs::File::open(&state_src).map_err(setup(format!("open {}", state_src.display())))?;
    let limits = crate::cgroup::Limits {
        cpus: s.cpus,
        memory_bytes: (s.base.shape.memory_mb
            + QEMU_OVERHEAD_MB
            + FS_SERVER_MB
            + if a.accel == Accel::Tcg { TCG_TB_MB } else { 0 })
            << 20,
        pids: s.pids.max(64),
    };
    s.cgroup.create(limits, 0).map_err(VmError::Cgroup)?;
    let ram = s.base.ram();
    let t_cg = t0.elapsed();
    let child = spawn_qemu(
        a,
        s.base.shape,
        Launch {
            dir,
            disk: &disk,
            template_image: &s.base.template_image,
            ram: &ram,
            share: false,
            incoming: Some(incoming),
            uid: Some(s.uid),
            cgroup_procs: s.cgroup.procs_files(),
            net: s.net,
        },
    )?;
    let t_spawn = t0.elapsed();
    let d = dir.to_owned();
    let restoring = |e: VmError| VmError::Qemu {
        step: "restoring the VM",
        detail: format!("{e}; {}", logs_of(dir)),
    };
    // QMP answers once QEMU made every chardev: its ports' sockets exist from then on.
    let mut q = tokio::task::spawn_blocking(move || -> Result<Qmp, VmError> {
        let mut q = Qmp::connect(&d.join("qmp.sock"), Duration::from_secs(10))?;
        q.ignore_shared()?;
        Ok(q)
    })
    .await
    .map_err(task("restore"))?
    .map_err(restoring)?;
    if let Some((exe, spec)) = &s.files {
        crate::vm_fs::start(exe, dir, spec, &s.cgroup.procs_files())
            .await
            .map_err(setup("start the file server of the guest's volumes"))?;
    }
    tokio::task::spawn_blocking(move || -> Result<(), VmError> {
        q.cmd("migrate-incoming", json!({"uri": "fd:3"}))?;
        q.run_after_incoming()
    })
    .await
    .map_err(task("restore"))?
    .map_err(restoring)?;
    let state = VmState {
        id: s.id.to_owned(),
        dir: dir.to_owned(),
        pid: child.id().unwrap_or(0) as i32,
        uid: s.uid,
        base: s.base.dir.clone(),
        shape: s.base.shape,
        accel: a.accel,
        qemu: Some(a.qemu_version),
    };
    fs::write(
        dir.join("vm.json"),
        serde_json::to_vec(&state).expect("state serializes"),
    )
    .map_err(setup("write vm.json"))?;
    let t_incoming = t0.elapsed();
    let mut child = child;
    let sock = dir.join("agent.sock");
    let agent = tokio::select! {
        a = AgentClient::connect(&sock, Duration::from_secs(60)) => a.map_err(|e| VmError::Qemu {
            step: "the restored VM's agent did not answer",
            detail: format!("{e}; {}", logs_of(dir)),
        })?,
        st = child.wait() => {
            return Err(VmError::Qemu {
                step: "QEMU exited while restoring the VM",
                detail: format!(
                    "{}; {}",
                    st.map(|s| s.to_string()).unwrap_or_default(),
                    logs_of(dir)
                ),
            })
        }
    };
    refresh_guest(&agent, s.id).await?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    tracing::debug!(
        machine = %s.id,
        disk_ms = ms(t_disk),
        cgroup_ms = ms(t_cg),
        spawn_ms = ms(t_spawn),
        incoming_ms = ms(t_incoming),
        total_ms = ms(t0.elapsed()),
        "microVM restored"
    );
    Ok((state, child, agent))
}

/// Whether the machine's QEMU still runs (a live process whose command line names the
/// machine's agent socket, inside its `-chardev` argument).
pub fn is_alive(s: &VmState) -> bool {
    let needle = s.dir.join("agent.sock");
    let n = needle.as_os_str().as_encoded_bytes();
    crate::machine::is_running(s.pid)
        && crate::machine::cmdline(s.pid)
            .windows(n.len())
            .any(|w| w == n)
}

/// Lets a machine's guest run again if a server stopped it and died before letting it go
/// on (a memory snapshot cut short by a kill): a migration still going is cancelled, then
/// `cont`. A running guest is left alone. QMP answers only a thawed QEMU.
pub fn ensure_running(s: &VmState) -> Result<(), VmError> {
    let mut q = Qmp::connect(&s.dir.join("qmp.sock"), Duration::from_secs(5))?;
    let t0 = Instant::now();
    loop {
        let st = q.cmd("query-status", json!({}))?;
        match st.get("status").and_then(Value::as_str).unwrap_or("") {
            "running" => return Ok(()),
            "finish-migrate" if t0.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            _ => {
                let mig = q.cmd("query-migrate", json!({}))?;
                let active = matches!(
                    mig.get("status").and_then(Value::as_str),
                    Some("setup" | "active" | "pre-switchover" | "device" | "cancelling")
                );
                if active {
                    let _ = q.cmd("migrate_cancel", json!({}));
                    if t0.elapsed() < Duration::from_secs(30) {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                }
                q.cmd("cont", json!({}))?;
                return Ok(());
            }
        }
    }
}

/// A new machine's disk in `dir`, by the names the host gives it (see the module doc,
/// "Disks"): standing on layers (`layers/`) it writes its qcow2 overlay `disk.qcow2`,
/// else its raw `disk.img` (a zero-copy point moves it later: [`stack`]).
fn own_disk(dir: &Path, layers: &[PathBuf]) -> PathBuf {
    dir.join(if layers.is_empty() {
        "disk.img"
    } else {
        "disk.qcow2"
    })
}

/// Makes a new machine's writable disk in `dir` and returns its images, top first (see the
/// module doc, "Disks"). Restored from a base: a raw copy of the base's disk (`disk.img`).
/// From a snapshot (`disk_from`, its `disk.img` path as [`crate::disk::vm_stack_of`] takes
/// it): the snapshot's layer stack hard-linked into `layers/` (nothing of its data copied)
/// beneath a blank qcow2 overlay of the stack's virtual size (`disk.qcow2`).
fn prepare_disk(
    dir: &Path,
    uid: u32,
    base: &Base,
    disk_from: Option<&Path>,
) -> Result<Vec<PathBuf>, VmError> {
    let layers = match disk_from {
        None => Vec::new(),
        Some(img) => {
            let stack =
                crate::disk::vm_stack_of(img).map_err(setup("read the snapshot's layers"))?;
            // Every image of a stack has the virtual size of its raw bottom (its length).
            let size = fs::metadata(&stack[stack.len() - 1])
                .map_err(setup("read the snapshot's disk size"))?
                .len();
            let at = dir.join(crate::disk::MACHINE_LAYERS);
            crate::disk::link_vm_stack(&stack, &at, 0)
                .map_err(setup("link the snapshot's layers"))?;
            // QEMU reads them as the machine's uid: root's files, readable by all, reached
            // only through this directory or the snapshot's, which are closed to others.
            fs::set_permissions(&at, fs::Permissions::from_mode(0o755))
                .map_err(setup("chmod the layers"))?;
            let layers = crate::disk::vm_machine_layers(dir);
            for l in &layers {
                fs::set_permissions(l, fs::Permissions::from_mode(0o444))
                    .map_err(setup("chmod a layer"))?;
            }
            crate::disk::make_qcow2_from_blank(
                &own_disk(dir, &layers),
                size,
                &crate::machine::blank_disks_dir(),
            )
            .map_err(setup("make the machine's overlay"))?;
            layers
        }
    };
    let own = own_disk(dir, &layers);
    if layers.is_empty() {
        crate::disk::copy_ephemeral(&base.disk(), &own).map_err(setup("copy the base's disk"))?;
    }
    std::os::unix::fs::chown(&own, Some(uid), Some(uid)).map_err(setup("chown the disk"))?;
    fs::set_permissions(&own, fs::Permissions::from_mode(0o600))
        .map_err(setup("chmod the disk"))?;
    Ok([own].into_iter().chain(layers).collect())
}

/// Saves a running machine into the snapshot directory `dir`, at one instant: its memory
/// and device state as `memory`, and the image it writes (`disk.img`, `disk.qcow2`, …, see
/// [`stack`]) as the snapshot's own image `disk.<ext>`, then lets it run on. The image is
/// taken while QEMU is stopped (its writes flushed), before the migration: by a zero-copy
/// point where it is worth one ([`stack::point`]: QEMU goes on on a new blank overlay and
/// the image, read-only now, is hard-linked into the snapshot), else copied after the
/// migration (which let go of the images). The layers the machine stands on are linked
/// (not copied) beneath as `lower/1.<ext>`, … (see [`crate::disk::vm_stack_of`]): a
/// snapshot costs what the machine wrote itself. Returns the snapshot's own image.
pub fn save(s: &VmState, dir: &Path) -> Result<PathBuf, VmError> {
    let chain = Chain::load(&s.dir).map_err(setup("read the machine's disk chain"))?;
    let own = chain.top_path(&s.dir);
    let layers = chain.layer_paths(&s.dir);
    // A machine on as many layers as a snapshot may hold: its disk is written out whole,
    // as one image (see [`stack::flatten`]).
    let flat = layers.len() + 1 > crate::disk::MAX_LAYERS;
    let out_disk = if flat {
        dir.join("disk.img")
    } else {
        dir.join(stack::snapshot_name(&own))
    };
    // (A flattening checks the copies it reads instead: see [`stack::flatten`].)
    if !layers.is_empty() && !flat {
        crate::disk::check_vm_stack(&layers).map_err(setup("check the machine's layers"))?;
        crate::disk::link_vm_stack(&layers, &dir.join(crate::disk::SNAPSHOT_LOWERS), 1)
            .map_err(setup("record the machine's layers"))?;
    }
    let next = if stack::wants_point(&s.dir, &chain) {
        stack::prepare_point(&s.dir, s.uid, &chain)
            .inspect_err(|e| tracing::warn!(machine = %s.id, error = %e, "no zero-copy point: the snapshot copies the disk"))
            .ok()
    } else {
        None
    };
    let state_out = dir.join("memory");
    let mut q = Qmp::connect(&s.dir.join("qmp.sock"), Duration::from_secs(5))?;
    q.cmd("stop", json!({}))?;
    let r = (|| {
        let moved = match &next {
            Some((name, node)) => stack::point(&mut q, &s.dir, &chain, name, node)?.is_some(),
            None => false,
        };
        let out = fs::File::create(&state_out).map_err(setup("create the state file"))?;
        s.mark_memory(dir)?;
        q.migrate_to(&out)?;
        if flat {
            stack::flatten(&s.dir, &chain, &out_disk, &dir.join(".flatten"))?;
            tracing::info!(machine = %s.id, "the machine stands on as many layers as a snapshot may hold: its disk was written out whole into the snapshot");
        } else if !moved {
            crate::disk::copy_ephemeral(&own, &out_disk).map_err(setup("copy the disk"))?;
        }
        Ok::<_, VmError>((out, moved))
    })();
    let cont = q.cmd("cont", json!({}));
    let (out, moved) = r?;
    cont?;
    // Durable, now that the guest runs again.
    out.sync_all().map_err(setup("sync the state file"))?;
    if moved {
        crate::disk::link_or_copy(&own, &out_disk).map_err(setup("link the disk"))?;
    } else {
        let disk = fs::File::open(&out_disk).map_err(setup("open the disk's copy"))?;
        disk.sync_all().map_err(setup("sync the disk's copy"))?;
        fs::set_permissions(&out_disk, fs::Permissions::from_mode(0o444))
            .map_err(setup("chmod the disk's copy"))?;
    }
    // The stack as a child will read it (the overlay's header included: QEMU wrote it).
    crate::disk::vm_stack_of(&dir.join("disk.img")).map_err(setup("check the snapshot"))?;
    Ok(out_disk)
}

/// The layers the machine in `dir` stands on beneath the image it writes (see [`stack`]).
pub fn machine_layers(dir: &Path) -> io::Result<Vec<PathBuf>> {
    Chain::load(dir).map(|c| c.layer_paths(dir))
}

/// The image the machine in `dir` writes (see [`stack`]).
pub fn own_disk_of(dir: &Path) -> io::Result<PathBuf> {
    Chain::load(dir).map(|c| c.top_path(dir))
}

/// Gives a restored guest the host's clock, fresh entropy and its own hostname: a restore
/// (or a wait in the pool since) left it with its base's.
pub async fn refresh_guest(
    agent: &AgentClient,
    hostname: &str,
) -> Result<(), crate::agent::AgentClientError> {
    let mut entropy = [0u8; 64];
    crate::sys::random_bytes(&mut entropy);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    agent
        .refresh(now, entropy.to_vec(), hostname.to_owned())
        .await
}
