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
//!   hands over by fd, the disk copied while the VM is stopped, then `cont`.
//!
//! Each QEMU runs as the unprivileged uid of its machine's slot, in the machine's cgroup (cpu,
//! memory, pids), under QEMU's seccomp sandbox (`-sandbox on`, no spawning, no privilege
//! changes). Its files are its own directory; the kernel, initramfs and template image are
//! read-only to it. A machine with egress `none` has no network device at all, and its QEMU
//! a network namespace of its own with nothing in it. A machine with a network policy is of
//! another shape ([`Shape::net`]: a restored VM has exactly its base's devices): one
//! `virtio-net` device whose backend is a tap the host opened in the machine's own network
//! namespace ([`NetDev`], made by [`crate::net::prepare_vm`]), handed to QEMU by fd; QEMU
//! joins that namespace and opens nothing itself. The host then bridges the tap to the
//! machine's veth, so every packet of the guest meets the same host rules as a jail's.
//!
//! It does not know tenants, HTTP or the database; [`crate::node`] hands its machines out.

use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

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

/// Errors of the microVM runtime.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// Something this host lacks (QEMU, a kernel): the message says what to install.
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Setup(String),
    #[error("the VM's agent did not answer: {0}")]
    Agent(#[from] crate::agent::AgentClientError),
}

fn setup(what: impl std::fmt::Display) -> impl FnOnce(io::Error) -> VmError {
    move |e| VmError::Setup(format!("{what}: {e}"))
}

/// How guest code is run: hardware virtualization or QEMU's emulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The cache directory (`LOCKER_CACHE_DIR`, default `/var/cache/locker`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os(crate::template::CACHE_DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(crate::template::DEFAULT_CACHE_DIR))
}

/// Where `scripts/setup` unpacks the guest kernel: `vmlinuz` and `modules/` (the package's
/// `lib/modules/<version>`). `LOCKER_VM_KERNEL_DIR` overrides it.
pub fn kernel_dir() -> PathBuf {
    std::env::var_os("LOCKER_VM_KERNEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("vm-kernel"))
}

/// Which accelerator microVMs get here and why: `LOCKER_VM_ACCEL` if set, else KVM when
/// `/dev/kvm` opens and is not PVM-based (standard guest kernels hang under PVM), else TCG.
pub fn accel() -> (Accel, String) {
    match std::env::var("LOCKER_VM_ACCEL").as_deref() {
        Ok("kvm") => return (Accel::Kvm, "LOCKER_VM_ACCEL=kvm".into()),
        Ok("tcg") => return (Accel::Tcg, "LOCKER_VM_ACCEL=tcg".into()),
        _ => {}
    }
    if !Path::new("/dev/kvm").exists() {
        return (Accel::Tcg, "/dev/kvm is missing (no VT-x/AMD-V or nested virtualization): microVMs are emulated by TCG, which is slow and NOT a security boundary".into());
    }
    if Path::new("/sys/module/kvm_pvm").exists() {
        return (Accel::Tcg, "/dev/kvm is PVM-based (kvm_pvm): standard guest kernels hang under it, so microVMs are emulated by TCG, which is for correctness only and NOT a security boundary".into());
    }
    if fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return (Accel::Tcg, "/dev/kvm cannot be opened (permissions?): microVMs are emulated by TCG, which is NOT a security boundary".into());
    }
    match kvm_boots() {
        Ok(ms) => (Accel::Kvm, format!("/dev/kvm is usable and a standard guest kernel booted under it in {ms} ms: microVMs run under KVM")),
        Err(why) => (Accel::Tcg, format!("/dev/kvm opens but a standard guest kernel did not boot under it ({why}): microVMs are emulated by TCG, which is NOT a security boundary")),
    }
}

/// Proves a standard guest kernel boots under KVM on this host: QEMU boots the guest kernel
/// (no root filesystem) until it panics looking for one and exits. The verdict is cached
/// per kernel and QEMU in `$LOCKER_CACHE_DIR/vm/kvm-probe-*`.
fn kvm_boots() -> Result<u64, String> {
    let kernel = kernel_dir().join("vmlinuz");
    let qemu = crate::doctor::which("qemu-system-x86_64").ok_or("QEMU is not installed")?;
    let klen = fs::metadata(&kernel)
        .map_err(|_| "no guest kernel to try".to_owned())?
        .len();
    let qlen = fs::metadata(&qemu).map(|m| m.len()).unwrap_or(0);
    let dir = cache_dir().join("vm");
    let verdict = dir.join(format!("kvm-probe-{klen:x}-{qlen:x}"));
    if let Ok(v) = fs::read_to_string(&verdict) {
        return match v.strip_prefix("ok ") {
            Some(ms) => Ok(ms.trim().parse().unwrap_or(0)),
            None => Err(v.trim().to_owned()),
        };
    }
    let _ = fs::create_dir_all(&dir);
    let log = dir.join(format!(".kvm-probe-{}.log", std::process::id()));
    let t0 = Instant::now();
    let r = (|| {
        let out = fs::File::create(&log).map_err(|e| e.to_string())?;
        let mut child = std::process::Command::new(&qemu)
            .args([
                "-M",
                "microvm,rtc=on",
                "-accel",
                "kvm",
                "-cpu",
                "host",
                "-m",
                "128",
            ])
            .args([
                "-nodefaults",
                "-no-user-config",
                "-display",
                "none",
                "-no-reboot",
                "-serial",
                "stdio",
            ])
            .arg("-kernel")
            .arg(&kernel)
            .args(["-append", "console=ttyS0 panic=-1 reboot=t"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start QEMU: {e}"))?;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if t0.elapsed() > Duration::from_secs(20) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err("the guest hung for 20 s".to_owned());
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(e.to_string()),
            }
        }
        let text = fs::read_to_string(&log).unwrap_or_default();
        if text.contains("Kernel panic") || text.contains("VFS") {
            Ok(t0.elapsed().as_millis() as u64)
        } else {
            Err("QEMU exited before the guest kernel finished booting".to_owned())
        }
    })();
    let _ = fs::remove_file(&log);
    let _ = fs::write(
        &verdict,
        match &r {
            Ok(ms) => format!("ok {ms}"),
            Err(e) => e.clone(),
        },
    );
    r
}

/// What every microVM of this host is started from.
#[derive(Debug, Clone)]
pub struct Assets {
    pub qemu: PathBuf,
    pub qemu_version: (u32, u32),
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub accel: Accel,
    /// The host TSC frequency handed to the guest (`tsc_early_khz`).
    pub tsc_khz: u64,
    /// Identifies kernel, initramfs, QEMU and accelerator: bases are keyed by it.
    pub digest: String,
}

impl Assets {
    /// Finds QEMU and the kernel, and builds (once, cached by content) the initramfs.
    pub fn prepare(agent: &Path) -> Result<Self, VmError> {
        let qemu = crate::doctor::which("qemu-system-x86_64").ok_or_else(|| {
            VmError::Unavailable(
                "qemu-system-x86_64 is not installed (scripts/setup installs qemu-system-x86)"
                    .into(),
            )
        })?;
        let kdir = kernel_dir();
        let kernel = kdir.join("vmlinuz");
        if !kernel.is_file() || !kdir.join("modules").is_dir() {
            return Err(VmError::Unavailable(format!(
                "no guest kernel in {} (scripts/setup unpacks linux-image-cloud-amd64 there: vmlinuz and modules/)",
                kdir.display()
            )));
        }
        let qemu_version = qemu_version(&qemu)?;
        let (accel, _) = accel();
        let agent_bytes = fs::read(agent).map_err(setup(format!("read {}", agent.display())))?;
        let modules = resolve_modules(&kdir.join("modules"), MODULES)?;
        let mut h = Sha256::new();
        h.update(&agent_bytes);
        for m in &modules {
            h.update(m.as_os_str().as_encoded_bytes());
            h.update(fs::metadata(m).map(|m| m.len()).unwrap_or(0).to_le_bytes());
        }
        let initrd_digest = hex(&h.finalize()[..8]);
        let dir = cache_dir().join("vm");
        fs::create_dir_all(&dir).map_err(setup(format!("create {}", dir.display())))?;
        let initrd = dir.join(format!("initrd-{initrd_digest}.cpio"));
        if !initrd.exists() {
            build_initrd(&agent_bytes, &modules, &initrd)?;
            // Older ones (earlier agent builds) are never used again: QEMU reads the
            // initramfs at start only, and bases are keyed by it.
            for e in fs::read_dir(&dir).into_iter().flatten().flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with("initrd-") && n.ends_with(".cpio") && e.path() != initrd {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        let kernel_len = fs::metadata(&kernel).map(|m| m.len()).unwrap_or(0);
        let mut h = Sha256::new();
        h.update(initrd_digest.as_bytes());
        h.update(kernel_len.to_le_bytes());
        h.update(format!("{qemu_version:?}{}{DEVICES}", accel.as_str()).as_bytes());
        Ok(Self {
            qemu,
            qemu_version,
            kernel,
            initrd,
            accel,
            tsc_khz: host_khz(),
            digest: hex(&h.finalize()[..8]),
        })
    }

    /// QEMU 8.2 and later can map a read-only RAM file privately (`readonly=on,rom=off`);
    /// older ones open it for writing even when they never write it.
    fn ram_readonly(&self) -> bool {
        self.qemu_version >= (8, 2)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn qemu_version(qemu: &Path) -> Result<(u32, u32), VmError> {
    let out = std::process::Command::new(qemu)
        .arg("--version")
        .output()
        .map_err(setup(format!("run {} --version", qemu.display())))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text
        .split_whitespace()
        .skip_while(|w| *w != "version")
        .nth(1)
        .unwrap_or("0.0");
    let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    Ok((parts.next().unwrap_or(0), parts.next().unwrap_or(0)))
}

/// The host CPU's frequency in kHz (for `tsc_early_khz`: without it, calibrating the TSC
/// under TCG can stall a guest's boot).
pub fn host_khz() -> u64 {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("cpu MHz")
                    .and_then(|v| v.split(':').nth(1))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
        })
        .map_or(2_000_000, |mhz| (mhz * 1000.0) as u64)
}

// ---------------------------------------------------------------------------------------
// The initramfs: the agent as /init, and the modules it loads.
// ---------------------------------------------------------------------------------------

/// The module files for `wanted` and their dependencies, dependencies first. Dependencies
/// are read from each module's `.modinfo` (`depends=`), so no `depmod` is needed.
fn resolve_modules(dir: &Path, wanted: &[&str]) -> Result<Vec<PathBuf>, VmError> {
    let mut index = std::collections::HashMap::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Some(stem) = p
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".ko"))
            {
                index.insert(stem.replace('-', "_"), p);
            }
        }
    }
    let builtin = fs::read_to_string(dir.join("modules.builtin")).unwrap_or_default();
    let is_builtin = |name: &str| {
        builtin.lines().any(|l| {
            l.rsplit('/')
                .next()
                .and_then(|f| f.strip_suffix(".ko"))
                .map(|f| f.replace('-', "_"))
                .as_deref()
                == Some(name)
        })
    };
    let mut order: Vec<PathBuf> = Vec::new();
    fn visit(
        name: &str,
        index: &std::collections::HashMap<String, PathBuf>,
        is_builtin: &dyn Fn(&str) -> bool,
        order: &mut Vec<PathBuf>,
        depth: u32,
    ) -> Result<(), VmError> {
        if depth > 32 {
            return Err(VmError::Setup(format!(
                "module dependencies loop at {name}"
            )));
        }
        let Some(path) = index.get(name) else {
            if is_builtin(name) {
                return Ok(());
            }
            return Err(VmError::Unavailable(format!(
                "the guest kernel has no module {name}"
            )));
        };
        if order.contains(path) {
            return Ok(());
        }
        let bytes = fs::read(path).map_err(setup(format!("read {}", path.display())))?;
        for dep in modinfo(&bytes, "depends") {
            visit(&dep, index, is_builtin, order, depth + 1)?;
        }
        if !order.contains(path) {
            order.push(path.clone());
        }
        Ok(())
    }
    for w in wanted {
        visit(w, &index, &is_builtin, &mut order, 0)?;
    }
    Ok(order)
}

/// Values of `key` in a module's `.modinfo` strings (comma-separated lists are split).
fn modinfo(ko: &[u8], key: &str) -> Vec<String> {
    let needle = format!("\0{key}=");
    let n = needle.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i + n.len() <= ko.len() {
        if &ko[i..i + n.len()] == n {
            let start = i + n.len();
            let end = ko[start..]
                .iter()
                .position(|b| *b == 0)
                .map_or(ko.len(), |e| start + e);
            for v in String::from_utf8_lossy(&ko[start..end]).split(',') {
                if !v.is_empty() {
                    out.push(v.replace('-', "_"));
                }
            }
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// A `newc` cpio archive being written in memory.
struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len() as u32,
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0,
        ];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
}

fn build_initrd(agent: &[u8], modules: &[PathBuf], out: &Path) -> Result<(), VmError> {
    let mut c = Cpio {
        buf: Vec::with_capacity(agent.len() + (4 << 20)),
        ino: 0,
    };
    for d in ["dev", "proc", "sys", "lower", "layer", "newroot", "modules"] {
        c.entry(d, 0o040755, (0, 0), &[]);
    }
    c.entry("dev/console", 0o020600, (5, 1), &[]);
    c.entry("init", 0o100755, (0, 0), agent);
    let mut order = String::new();
    for m in modules {
        let name = m
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("module.ko")
            .to_owned();
        let bytes = fs::read(m).map_err(setup(format!("read {}", m.display())))?;
        c.entry(&format!("modules/{name}"), 0o100644, (0, 0), &bytes);
        order.push_str(&name);
        order.push('\n');
    }
    c.entry("modules/order", 0o100644, (0, 0), order.as_bytes());
    c.entry("TRAILER!!!", 0, (0, 0), &[]);
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, &c.buf).map_err(setup(format!("write {}", tmp.display())))?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))
        .map_err(setup("chmod the initramfs"))?;
    fs::rename(&tmp, out).map_err(setup(format!("install {}", out.display())))
}

// ---------------------------------------------------------------------------------------
// Template images.
// ---------------------------------------------------------------------------------------

/// Takes an exclusive `flock` on `path` (created), waiting for it.
fn lock_file(path: &Path) -> Result<fs::File, VmError> {
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(setup(format!("open {}", path.display())))?;
    loop {
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(f);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(VmError::Setup(format!("lock {}: {e}", path.display())));
        }
    }
}

/// The read-only ext4 image of a template's root filesystem (built once, cached by the
/// template's digest; `mkfs.ext4 -d`, no mount needed).
pub fn template_image(rootfs: &Path) -> Result<PathBuf, VmError> {
    let digest = rootfs
        .parent()
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str())
        .ok_or_else(|| {
            VmError::Setup(format!(
                "template root {} is not in a template directory",
                rootfs.display()
            ))
        })?;
    let dir = cache_dir().join("vm").join("images");
    fs::create_dir_all(&dir).map_err(setup(format!("create {}", dir.display())))?;
    let img = dir.join(format!("{digest}.ext4"));
    if img.exists() {
        return Ok(img);
    }
    let _lock = lock_file(&dir.join(format!("{digest}.lock")))?;
    if img.exists() {
        return Ok(img);
    }
    let bytes = crate::tree::allocated_bytes(rootfs)
        .map_err(setup(format!("measure {}", rootfs.display())))?;
    let size_mb = bytes / (1 << 20) * 13 / 10 + 128;
    let tmp = dir.join(format!(".{digest}.tmp"));
    let _ = fs::remove_file(&tmp);
    let out = std::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-O",
            "^has_journal",
            "-i",
            "8192",
            "-L",
            "locker-template",
            "-E",
            "root_owner=0:0",
            "-d",
        ])
        .arg(rootfs)
        .arg(&tmp)
        .arg(format!("{size_mb}M"))
        .output()
        .map_err(setup("run mkfs.ext4 (apt-get install e2fsprogs)"))?;
    if !out.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(VmError::Setup(format!(
            "building the template's disk image: mkfs.ext4: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o444))
        .map_err(setup("chmod the template image"))?;
    fs::rename(&tmp, &img).map_err(setup(format!("install {}", img.display())))?;
    Ok(img)
}

// ---------------------------------------------------------------------------------------
// QEMU processes.
// ---------------------------------------------------------------------------------------

/// A microVM's size and devices. VMs restored from one base share it exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub memory_mb: u64,
    pub vcpus: u32,
    pub disk_mb: u64,
    /// Whether it has a network device (machines with a network policy other than `none`).
    #[serde(default)]
    pub net: bool,
}

impl Shape {
    /// The shape of a machine with `cpus` cores (rounded up to whole vCPUs).
    pub fn new(memory_mb: u64, cpus: f64, disk_mb: u64) -> Self {
        Self {
            memory_mb,
            vcpus: (cpus.ceil() as u32).clamp(1, 64),
            disk_mb,
            net: false,
        }
    }

    /// The same shape with or without a network device.
    pub fn with_net(self, net: bool) -> Self {
        Self { net, ..self }
    }
}

/// How one QEMU process is to be started.
struct Launch<'a> {
    /// Holds `disk.img`; QEMU puts `agent.sock`, `qmp.sock`, `console.log` there.
    dir: &'a Path,
    template_image: &'a Path,
    /// The guest RAM file.
    ram: &'a Path,
    /// Shared (a base being booted) or a private copy-on-write map (every other VM).
    share: bool,
    /// Device state to restore from (becomes fd 3).
    incoming: Option<fs::File>,
    /// Run as this uid and gid (none: as the caller, for a base).
    uid: Option<u32>,
    cgroup_procs: Vec<PathBuf>,
    /// The network device's backend (a machine of a shape with one). A base of such a
    /// shape has none: QEMU, as root in its own empty namespace, makes its tap itself.
    net: Option<NetDev>,
}

/// The fd a machine's QEMU finds its tap on (fd 3 is the incoming state).
const TAP_FD: RawFd = 4;

fn qemu_args(a: &Assets, shape: Shape, l: &Launch) -> Vec<String> {
    let d = |n: &str| l.dir.join(n).display().to_string();
    let mem = shape.memory_mb;
    let ram = if l.share {
        format!(
            "memory-backend-file,id=mem,size={mem}M,mem-path={},share=on",
            l.ram.display()
        )
    } else if a.ram_readonly() {
        format!(
            "memory-backend-file,id=mem,size={mem}M,mem-path={},share=off,readonly=on,rom=off",
            l.ram.display()
        )
    } else {
        format!(
            "memory-backend-file,id=mem,size={mem}M,mem-path={},share=off",
            l.ram.display()
        )
    };
    let accel = match a.accel {
        Accel::Kvm => "kvm".to_owned(),
        Accel::Tcg => format!("tcg,tb-size={TCG_TB_MB}"),
    };
    let mut v: Vec<String> = vec![
        "-M".into(),
        "microvm,rtc=on,memory-backend=mem".into(),
        "-accel".into(),
        accel,
        "-cpu".into(),
        if a.accel == Accel::Kvm { "host".into() } else { "max".into() },
        "-m".into(),
        format!("{mem}M"),
        "-smp".into(),
        shape.vcpus.to_string(),
        "-object".into(),
        ram,
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        "-serial".into(),
        format!("file:{}", d("console.log")),
        "-kernel".into(),
        a.kernel.display().to_string(),
        "-initrd".into(),
        a.initrd.display().to_string(),
        "-append".into(),
        format!(
            "console=ttyS0 quiet panic=-1 reboot=t rdinit=/init tsc_early_khz={} tsc=reliable LOCKER_VM=1",
            a.tsc_khz
        ),
        "-drive".into(),
        format!("id=template,file={},format=raw,if=none,readonly=on", l.template_image.display()),
        "-device".into(),
        "virtio-blk-device,drive=template".into(),
        "-drive".into(),
        format!("id=disk,file={},format=raw,if=none,discard=unmap", d("disk.img")),
        "-device".into(),
        "virtio-blk-device,drive=disk".into(),
        "-device".into(),
        "virtio-serial-device".into(),
        "-chardev".into(),
        format!("socket,id=agent,path={},server=on,wait=off", d("agent.sock")),
        "-device".into(),
        format!("virtserialport,chardev=agent,name={PORT_NAME}"),
        // Volumes: FUSE requests to the host's file server (see [`crate::vm_fs`]).
        "-chardev".into(),
        format!("socket,id=fs,path={},server=on,wait=off", d(FS_SOCKET)),
        "-device".into(),
        format!(
            "virtserialport,chardev=fs,name={}",
            locker_proto::fs_frame::PORT_NAME
        ),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", d("qmp.sock")),
        "-sandbox".into(),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
    ];
    if shape.net {
        let backend = if l.net.is_some() {
            format!("fd={TAP_FD}")
        } else {
            "ifname=tap0,script=no,downscript=no".to_owned()
        };
        v.push("-netdev".into());
        v.push(format!("tap,id=net0,{backend},vhost=off"));
        v.push("-device".into());
        v.push("virtio-net-device,netdev=net0".into());
    }
    if l.incoming.is_some() {
        // Deferred: `x-ignore-shared` must be set before the state is read (see
        // [`Qmp::ignore_shared`]); the state itself comes on fd 3.
        v.push("-incoming".into());
        v.push("defer".into());
    }
    v
}

/// Starts QEMU: in the machine's cgroup, in the machine's network namespace (or a new,
/// empty one), as `uid`.
fn spawn_qemu(a: &Assets, shape: Shape, l: Launch) -> Result<tokio::process::Child, VmError> {
    let log = fs::File::create(l.dir.join("qemu.log")).map_err(setup("create qemu.log"))?;
    let log2 = log.try_clone().map_err(setup("dup qemu.log"))?;
    let mut cmd = std::process::Command::new(&a.qemu);
    cmd.args(qemu_args(a, shape, &l))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
    let procs = c_paths(&l.cgroup_procs);
    let incoming: Option<RawFd> = l.incoming.as_ref().map(|f| f.as_raw_fd());
    // The tap above fd 4, so that putting the incoming state on 3 cannot clobber it.
    let tap: Option<fs::File> = match &l.net {
        Some(n) => Some(dup_above(&n.tap, TAP_FD + 1).map_err(setup("dup the tap's fd"))?),
        None => None,
    };
    let (netns, tap_fd) = (
        l.net.as_ref().map(|n| n.netns.as_raw_fd()),
        tap.as_ref().map(|t| t.as_raw_fd()),
    );
    let uid = l.uid;
    // SAFETY: only async-signal-safe calls (open, write, close, unshare, setns, dup2,
    // set*id, prctl) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            for p in &procs {
                enter_cgroup(p)?;
            }
            let entered = match netns {
                Some(fd) => libc::setns(fd, libc::CLONE_NEWNET),
                None => libc::unshare(libc::CLONE_NEWNET),
            };
            if entered != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some(fd) = incoming {
                // dup2 onto itself would keep close-on-exec set: clear it instead.
                let r = if fd == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0)
                } else {
                    libc::dup2(fd, 3)
                };
                if r < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(fd) = tap_fd {
                if libc::dup2(fd, TAP_FD) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(uid) = uid {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setresgid(uid, uid, uid) != 0
                    || libc::setresuid(uid, uid, uid) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn()
        .map_err(setup(format!("start {}", a.qemu.display())))?;
    drop(l.incoming);
    drop(tap);
    Ok(child)
}

/// Paths as C strings, prepared before a fork for [`enter_cgroup`] after it.
pub(crate) fn c_paths(paths: &[PathBuf]) -> Vec<std::ffi::CString> {
    paths
        .iter()
        .map(|p| {
            std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
                .expect("no NUL in a cgroup path")
        })
        .collect()
}

/// Moves the calling process into the cgroup whose `cgroup.procs` is `procs`. Only
/// async-signal-safe calls: usable between fork and exec.
pub(crate) fn enter_cgroup(procs: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: open, write and close on a valid path and a static buffer.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let r = libc::write(fd, b"0".as_ptr().cast(), 1);
        libc::close(fd);
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A close-on-exec duplicate of `f` numbered `min` or above.
fn dup_above(f: &fs::File, min: RawFd) -> io::Result<fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: fcntl on an fd we own; a new fd it returns is ours alone.
    let fd = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    Ok(unsafe { fs::File::from_raw_fd(fd) })
}

/// The tail of a QEMU's log and console, for error messages.
fn logs_of(dir: &Path) -> String {
    let tail = |n: &str| {
        let t = fs::read(dir.join(n)).unwrap_or_default();
        let s = String::from_utf8_lossy(&t[t.len().saturating_sub(600)..]).into_owned();
        s.trim().to_owned()
    };
    format!(
        "qemu: {:?}; console: {:?}",
        tail("qemu.log"),
        tail("console.log")
    )
}

// ---------------------------------------------------------------------------------------
// QMP: QEMU's control socket.
// ---------------------------------------------------------------------------------------

/// A connection to one QEMU's QMP socket (blocking; use from blocking tasks).
struct Qmp {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Qmp {
    fn connect(sock: &Path, timeout: Duration) -> Result<Self, VmError> {
        let t0 = Instant::now();
        let s = loop {
            match UnixStream::connect(sock) {
                Ok(s) => break s,
                Err(_) if t0.elapsed() < timeout => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => {
                    return Err(VmError::Setup(format!(
                        "connect to QMP {}: {e}",
                        sock.display()
                    )))
                }
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(120)))
            .map_err(setup("QMP timeout"))?;
        let w = s.try_clone().map_err(setup("QMP socket"))?;
        let mut q = Self {
            r: BufReader::new(s),
            w,
        };
        q.read()?; // the greeting
        q.cmd("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn read(&mut self) -> Result<Value, VmError> {
        let mut line = String::new();
        if self
            .r
            .read_line(&mut line)
            .map_err(setup("read from QMP"))?
            == 0
        {
            return Err(VmError::Setup("QEMU closed its QMP socket".into()));
        }
        serde_json::from_str(&line).map_err(|e| VmError::Setup(format!("QMP sent bad JSON: {e}")))
    }

    /// Runs a command, optionally passing `fd` along (`SCM_RIGHTS`), and returns its result.
    fn cmd_fd(&mut self, name: &str, args: Value, fd: Option<RawFd>) -> Result<Value, VmError> {
        let msg = format!("{}\n", json!({"execute": name, "arguments": args}));
        match fd {
            None => self
                .w
                .write_all(msg.as_bytes())
                .map_err(setup("write to QMP"))?,
            Some(fd) => {
                send_with_fd(&self.w, msg.as_bytes(), fd).map_err(setup("pass an fd to QMP"))?
            }
        }
        loop {
            let v = self.read()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(VmError::Setup(format!(
                    "QMP {name}: {}",
                    e.get("desc").and_then(Value::as_str).unwrap_or("failed")
                )));
            }
            // An event: skip it.
        }
    }

    fn cmd(&mut self, name: &str, args: Value) -> Result<Value, VmError> {
        self.cmd_fd(name, args, None)
    }

    /// Keeps RAM mapped from a shared file out of migrations (both directions must agree):
    /// a base's state is then only device state, and its RAM file is mapped, not copied.
    fn ignore_shared(&mut self) -> Result<(), VmError> {
        self.cmd(
            "migrate-set-capabilities",
            json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
        )
        .map(drop)
    }

    /// Waits for an incoming migration to finish and lets the VM run: a VM saved while
    /// stopped (every base and snapshot is) stays paused after loading until `cont`.
    fn run_after_incoming(&mut self) -> Result<(), VmError> {
        let t0 = Instant::now();
        loop {
            let st = self.cmd("query-status", json!({}))?;
            match st.get("status").and_then(Value::as_str).unwrap_or("") {
                "running" => return Ok(()),
                "inmigrate" if t0.elapsed() < Duration::from_secs(120) => {
                    std::thread::sleep(Duration::from_micros(500))
                }
                "paused" | "postmigrate" | "prelaunch" | "restore-vm" => {
                    self.cmd("cont", json!({}))?;
                    return Ok(());
                }
                other => {
                    return Err(VmError::Setup(format!(
                        "restoring the VM: it is {other:?} instead of running"
                    )))
                }
            }
        }
    }

    /// Migrates the VM's state into `out` and waits until it is written.
    fn migrate_to(&mut self, out: &fs::File) -> Result<(), VmError> {
        self.ignore_shared()?;
        self.cmd_fd("getfd", json!({"fdname": "snap"}), Some(out.as_raw_fd()))?;
        self.cmd("migrate", json!({"uri": "fd:snap"}))?;
        let t0 = Instant::now();
        loop {
            let st = self.cmd("query-migrate", json!({}))?;
            match st.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(()),
                Some("failed") | Some("cancelled") => {
                    return Err(VmError::Setup(format!(
                        "saving the VM's state failed: {}",
                        st.get("error-desc")
                            .and_then(Value::as_str)
                            .unwrap_or("no reason given")
                    )))
                }
                _ if t0.elapsed() > Duration::from_secs(300) => {
                    return Err(VmError::Setup(
                        "saving the VM's state took over 300 s".into(),
                    ))
                }
                _ => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }
}

fn send_with_fd(sock: &UnixStream, data: &[u8], fd: RawFd) -> io::Result<()> {
    // SAFETY: a msghdr over our own buffers; CMSG macros compute offsets inside `cbuf`.
    unsafe {
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut _,
            iov_len: data.len(),
        };
        let space = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as usize;
        let mut cbuf = vec![0u8; space];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        let n = libc::sendmsg(sock.as_raw_fd(), &msg, 0);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if (n as usize) < data.len() {
            (&*sock).write_all(&data[n as usize..])?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Bases: booted once per (assets, template, shape), restored by every VM.
// ---------------------------------------------------------------------------------------

/// A saved, booted VM every machine of its shape restores.
#[derive(Debug, Clone)]
pub struct Base {
    pub dir: PathBuf,
    pub shape: Shape,
    pub template_image: PathBuf,
}

impl Base {
    fn ram(&self) -> PathBuf {
        self.dir.join("ram")
    }
    fn state(&self) -> PathBuf {
        self.dir.join("state")
    }
    fn disk(&self) -> PathBuf {
        self.dir.join("disk.img")
    }
}

/// The base for `template_rootfs` and `shape`: made now (a cold boot, seconds under TCG)
/// unless it exists. Concurrent callers (also in other processes) wait for one boot.
pub async fn ensure_base(
    a: &Assets,
    template_rootfs: &Path,
    shape: Shape,
) -> Result<Base, VmError> {
    let (a2, rootfs) = (a.clone(), template_rootfs.to_owned());
    let (image, key) =
        tokio::task::spawn_blocking(move || -> Result<(PathBuf, String), VmError> {
            let image = template_image(&rootfs)?;
            let mut h = Sha256::new();
            h.update(a2.digest.as_bytes());
            h.update(image.as_os_str().as_encoded_bytes());
            h.update(
                format!(
                    "{}-{}-{}{}",
                    shape.memory_mb,
                    shape.vcpus,
                    shape.disk_mb,
                    if shape.net { "-net" } else { "" }
                )
                .as_bytes(),
            );
            Ok((image, hex(&h.finalize()[..8])))
        })
        .await
        .map_err(|e| VmError::Setup(format!("task failed: {e}")))??;
    let root = Path::new(BASE_DIR);
    fs::create_dir_all(root).map_err(setup(format!("create {BASE_DIR}")))?;
    let base = Base {
        dir: root.join(&key),
        shape,
        template_image: image,
    };
    if base.dir.join("ready").exists() {
        return Ok(base);
    }
    let lock_path = root.join(format!("{key}.lock"));
    let lock = tokio::task::spawn_blocking(move || lock_file(&lock_path))
        .await
        .map_err(|e| VmError::Setup(format!("task failed: {e}")))??;
    if base.dir.join("ready").exists() {
        return Ok(base);
    }
    let t0 = Instant::now();
    let tmp = root.join(format!("{key}.boot"));
    // A server killed in the middle of this boot left its QEMU behind (we hold the lock,
    // so nobody else boots this base now).
    kill_qemus_under(&tmp);
    let _ = fs::remove_dir_all(&tmp);
    let r = boot_base(a, &base, &tmp).await;
    if let Err(e) = r {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let _ = fs::remove_dir_all(&base.dir);
    fs::rename(&tmp, &base.dir).map_err(setup("install the base"))?;
    fs::write(base.dir.join("ready"), a.digest.as_bytes()).map_err(setup("mark the base ready"))?;
    evict_stale_bases(&a.digest);
    drop(lock);
    tracing::info!(base = %key, ms = t0.elapsed().as_millis() as u64, accel = a.accel.as_str(), "microVM base booted and saved");
    Ok(base)
}

/// Kills every process whose command line names `dir` (QEMUs of an interrupted base boot).
fn kill_qemus_under(dir: &Path) {
    let needle = dir.as_os_str().as_encoded_bytes();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmdline.windows(needle.len()).any(|w| w == needle) {
            tracing::warn!(pid, dir = %dir.display(), "killing the QEMU of an interrupted base boot");
            // SAFETY: kill takes no pointers.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Removes bases made from other assets (an earlier agent, kernel or QEMU) over an hour
/// ago: this server never restores them, and their RAM files hold tmpfs memory. Machines still running from
/// one keep their private map of its RAM file; removing the file does not disturb them.
fn evict_stale_bases(current: &str) {
    for e in fs::read_dir(BASE_DIR).into_iter().flatten().flatten() {
        let ready = e.path().join("ready");
        let Ok(made_by) = fs::read_to_string(&ready) else {
            continue;
        };
        // An hour's grace: another server on this host (another version) may still be
        // restoring from it.
        let old = fs::metadata(&ready)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() > Duration::from_secs(3600));
        if !made_by.is_empty() && made_by != current && old {
            tracing::info!(base = %e.path().display(), "removing a microVM base of older assets");
            let _ = fs::remove_dir_all(e.path());
            let _ = fs::remove_file(e.path().with_extension("lock"));
        }
    }
}

async fn boot_base(a: &Assets, base: &Base, dir: &Path) -> Result<(), VmError> {
    fs::create_dir_all(dir).map_err(setup(format!("create {}", dir.display())))?;
    let ram = dir.join("ram");
    let f = fs::File::create(&ram).map_err(setup("create the RAM file"))?;
    f.set_len(base.shape.memory_mb << 20)
        .map_err(setup("size the RAM file"))?;
    drop(f);
    crate::disk::make_from_blank(
        &dir.join("disk.img"),
        base.shape.disk_mb,
        &crate::jail::blank_disks_dir(),
    )
    .map_err(setup("make the base's disk"))?;
    let mut child = spawn_qemu(
        a,
        base.shape,
        Launch {
            dir,
            template_image: &base.template_image,
            ram: &ram,
            share: true,
            incoming: None,
            uid: None,
            cgroup_procs: Vec::new(),
            net: None,
        },
    )?;
    let r = async {
        let agent = AgentClient::connect(&dir.join("agent.sock"), BOOT_TIMEOUT)
            .await
            .map_err(|e| {
                VmError::Setup(format!(
                    "the base VM did not start its agent: {e}; {}",
                    logs_of(dir)
                ))
            })?;
        // Warm the guest's page cache with what every first command touches (the shell,
        // the C library, the agent's exec path): each restored VM starts with it cached.
        let warm = locker_proto::ExecSpec {
            call_id: "warm-up".into(),
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                "/usr/bin/true; ls / >/dev/null; cat /etc/os-release >/dev/null".into(),
            ],
            max_output_bytes: 4096,
            timeout_ms: Some(60_000),
            ..Default::default()
        };
        let _ = agent.exec(warm, None, None).await;
        agent.flush().await?;
        drop(agent);
        // Let the guest see the host leave, so every restored VM starts out waiting for
        // its host rather than mid-connection.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (d, state) = (dir.to_owned(), dir.join("state"));
        tokio::task::spawn_blocking(move || -> Result<(), VmError> {
            let mut q = Qmp::connect(&d.join("qmp.sock"), Duration::from_secs(5))?;
            q.cmd("stop", json!({}))?;
            let out = fs::File::create(&state).map_err(setup("create the state file"))?;
            q.migrate_to(&out)?;
            out.sync_all().map_err(setup("sync the state file"))?;
            let _ = q.cmd("quit", json!({}));
            Ok(())
        })
        .await
        .map_err(|e| VmError::Setup(format!("task failed: {e}")))?
    }
    .await;
    let _ = child.kill().await;
    r?;
    // Every VM maps the RAM file; none may change it (QEMU before 8.2 opens it read-write
    // even for a private map, so there it stays writable: see docs/security.md).
    let mode = if a.ram_readonly() { 0o444 } else { 0o666 };
    fs::set_permissions(&ram, fs::Permissions::from_mode(mode))
        .map_err(setup("chmod the RAM file"))?;
    for f in ["state", "disk.img"] {
        fs::set_permissions(dir.join(f), fs::Permissions::from_mode(0o444))
            .map_err(setup("chmod the base"))?;
    }
    for f in ["agent.sock", "qmp.sock"] {
        let _ = fs::remove_file(dir.join(f));
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(setup("chmod the base"))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Machines.
// ---------------------------------------------------------------------------------------

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
}

impl VmState {
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
        return Err(VmError::Setup(format!(
            "a VM of shape {:?} needs {} network device backend",
            s.base.shape,
            if s.base.shape.net { "a" } else { "no" }
        )));
    }
    fs::create_dir_all(dir).map_err(setup(format!("create {}", dir.display())))?;
    std::os::unix::fs::chown(dir, Some(s.uid), Some(s.uid))
        .map_err(setup("give the machine its directory"))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(setup("chmod the machine directory"))?;
    let disk = dir.join("disk.img");
    let src = s.disk_from.map_or_else(|| s.base.disk(), Path::to_owned);
    crate::disk::copy_ephemeral(&src, &disk).map_err(setup("copy the machine's disk"))?;
    let t_disk = t0.elapsed();
    std::os::unix::fs::chown(&disk, Some(s.uid), Some(s.uid)).map_err(setup("chown the disk"))?;
    fs::set_permissions(&disk, fs::Permissions::from_mode(0o600))
        .map_err(setup("chmod the disk"))?;
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
    s.cgroup
        .create(limits, 0)
        .map_err(|e| VmError::Setup(format!("create the machine's cgroup: {e}")))?;
    let ram = s.base.ram();
    let t_cg = t0.elapsed();
    let child = spawn_qemu(
        a,
        s.base.shape,
        Launch {
            dir,
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
    tokio::task::spawn_blocking(move || -> Result<(), VmError> {
        let mut q = Qmp::connect(&d.join("qmp.sock"), Duration::from_secs(10))?;
        q.ignore_shared()?;
        q.cmd("migrate-incoming", json!({"uri": "fd:3"}))?;
        q.run_after_incoming()
    })
    .await
    .map_err(|e| VmError::Setup(format!("task failed: {e}")))?
    .map_err(|e| VmError::Setup(format!("{e}; {}", logs_of(dir))))?;
    let state = VmState {
        id: s.id.to_owned(),
        dir: dir.to_owned(),
        pid: child.id().unwrap_or(0) as i32,
        uid: s.uid,
        base: s.base.dir.clone(),
        shape: s.base.shape,
        accel: a.accel,
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
        a = AgentClient::connect(&sock, Duration::from_secs(60)) => a.map_err(|e| {
            VmError::Setup(format!("the restored VM's agent did not answer: {e}; {}", logs_of(dir)))
        })?,
        st = child.wait() => {
            return Err(VmError::Setup(format!(
                "QEMU exited ({}) while restoring the VM; {}",
                st.map(|s| s.to_string()).unwrap_or_default(),
                logs_of(dir)
            )))
        }
    };
    let mut entropy = [0u8; 64];
    // SAFETY: getrandom fills the buffer we own.
    unsafe { libc::getrandom(entropy.as_mut_ptr().cast(), entropy.len(), 0) };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    agent
        .refresh(now, entropy.to_vec(), s.id.to_owned())
        .await?;
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
    crate::jail::is_running(s.pid) && crate::jail::cmdline(s.pid).windows(n.len()).any(|w| w == n)
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

/// Saves a running machine's memory and device state into `state_out` and copies its disk
/// to `disk_out`, both at one instant (the VM is stopped meanwhile), then lets it run on.
pub fn save(
    s: &VmState,
    state_out: &Path,
    disk_out: &Path,
) -> Result<crate::disk::CopyKind, VmError> {
    let mut q = Qmp::connect(&s.dir.join("qmp.sock"), Duration::from_secs(5))?;
    q.cmd("stop", json!({}))?;
    let r = (|| {
        let out = fs::File::create(state_out).map_err(setup("create the state file"))?;
        q.migrate_to(&out)?;
        out.sync_all().map_err(setup("sync the state file"))?;
        crate::disk::copy(&s.dir.join("disk.img"), disk_out).map_err(setup("copy the disk"))
    })();
    let cont = q.cmd("cont", json!({}));
    let kind = r?;
    cont?;
    Ok(kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modinfo_reads_dependency_lists() {
        let ko = b"\x7fELF junk\0license=GPL\0depends=virtio,virtio_ring\0vermagic=6.1\0";
        assert_eq!(modinfo(ko, "depends"), vec!["virtio", "virtio_ring"]);
        assert!(modinfo(b"\0depends=\0", "depends").is_empty());
    }

    #[test]
    fn cpio_entries_are_aligned() {
        let mut c = Cpio {
            buf: Vec::new(),
            ino: 0,
        };
        c.entry("init", 0o100755, (0, 0), b"abcde");
        c.entry("TRAILER!!!", 0, (0, 0), &[]);
        assert_eq!(c.buf.len() % 4, 0);
        assert!(c.buf.starts_with(b"070701"));
    }
}
