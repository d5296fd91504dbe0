//! The guest's assets: QEMU and the kernel, the initramfs built here from the static agent
//! and the virtio modules it needs, and per template a read-only ext4 image of its root.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use super::accel::*;
use super::*;

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
    /// What the initramfs is built from, to build it again if another server on this host
    /// removed it (see [`Assets::ensure_initrd`]).
    agent: PathBuf,
    modules: Vec<PathBuf>,
}

impl Assets {
    /// Finds QEMU and the kernel, and builds (once, cached by content) the initramfs.
    pub fn prepare(agent: &Path) -> Result<Self, VmError> {
        let qemu = crate::doctor::which("qemu-system-x86_64").ok_or(VmError::QemuMissing)?;
        let kdir = kernel_dir();
        let kernel = kdir.join("vmlinuz");
        if !kernel.is_file() || !kdir.join("modules").is_dir() {
            return Err(VmError::KernelMissing(kdir));
        }
        let qemu_version = qemu_version(&qemu)?;
        let (accel, _) = accel();
        let agent_bytes = fs::read(agent).map_err(setup(format!("read {}", agent.display())))?;
        let modules = resolve_modules(&kdir.join("modules"), MODULES)?;
        let initrd_digest = initrd_digest(&agent_bytes, &modules);
        let dir = cache_dir().join("vm");
        fs::create_dir_all(&dir).map_err(setup(format!("create {}", dir.display())))?;
        let initrd = dir.join(format!("initrd-{initrd_digest}.cpio"));
        if initrd.exists() {
            // In use again: eviction by another server on this host goes by this time.
            let _ = fs::File::open(&initrd).and_then(|f| f.set_modified(SystemTime::now()));
        } else {
            build_initrd(&agent_bytes, &modules, &initrd)?;
        }
        evict_stale_initrds(&dir, &initrd);
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
            agent: agent.to_path_buf(),
            modules,
        })
    }

    /// Builds the initramfs again if it is gone (a server of another build on this host
    /// evicted it as stale while this one kept running): QEMU reads it at every start, a
    /// restore included. Refuses when the agent binary changed since [`Assets::prepare`]:
    /// the bases of this server hold the agent it started with.
    pub fn ensure_initrd(&self) -> Result<(), VmError> {
        if self.initrd.exists() {
            return Ok(());
        }
        let agent_bytes =
            fs::read(&self.agent).map_err(setup(format!("read {}", self.agent.display())))?;
        let name = format!("initrd-{}.cpio", initrd_digest(&agent_bytes, &self.modules));
        if self.initrd.file_name() != Some(std::ffi::OsStr::new(&name)) {
            return Err(VmError::Initrd(format!(
                "{} changed since this server started: restart locker serve",
                self.agent.display()
            )));
        }
        tracing::warn!(initrd = %self.initrd.display(), "the microVM initramfs was removed; building it again");
        build_initrd(&agent_bytes, &self.modules, &self.initrd)
    }

    /// QEMU 8.2 and later can map a read-only RAM file privately (`readonly=on,rom=off`);
    /// older ones open it for writing even when they never write it.
    pub(super) fn ram_readonly(&self) -> bool {
        self.qemu_version >= (8, 2)
    }
}

pub(super) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The oldest QEMU whose live migration kept every guest whole under TCG here: Debian 12's
/// 7.2 restored about one live move in ten with memory that did not match (kernel oopses
/// jumping into a stack page, a hang), 10.0 none in 65 (docs/operations.md, "Fleet mode").
pub const LIVE_MIN_QEMU: (u32, u32) = (10, 0);

/// Whether a node whose QEMU is `version` moves running microVMs live, and why:
/// `LOCKER_CARRY_LIVE=1` or `=0` says so; unset, live from [`LIVE_MIN_QEMU`] on.
pub fn live_moves(version: (u32, u32)) -> (bool, String) {
    live_moves_given(std::env::var("LOCKER_CARRY_LIVE").ok().as_deref(), version)
}

/// [`live_moves`] with `LOCKER_CARRY_LIVE` given.
fn live_moves_given(env: Option<&str>, version: (u32, u32)) -> (bool, String) {
    let v = format!("QEMU {}.{}", version.0, version.1);
    match env {
        Some("1") => (true, format!("LOCKER_CARRY_LIVE=1 ({v})")),
        Some("0") => (false, format!("LOCKER_CARRY_LIVE=0 ({v})")),
        _ if version >= LIVE_MIN_QEMU => (true, format!("{v}; LOCKER_CARRY_LIVE=0 moves them frozen")),
        _ => (false, format!("{v} is older than {}.{}, whose live migration under TCG kept every guest whole (7.2's did not, about one move in ten); scripts/setup installs QEMU 10 from bookworm-backports on Debian 12; LOCKER_CARRY_LIVE=1 moves them live anyway", LIVE_MIN_QEMU.0, LIVE_MIN_QEMU.1)),
    }
}

/// The version QEMU at `qemu` says it is (major, minor).
pub fn qemu_version(qemu: &Path) -> Result<(u32, u32), VmError> {
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
    Ok(major_minor(v).unwrap_or((0, 0)))
}

/// The major and minor numbers of a version `10.0.2` (or `10.0`).
pub(super) fn major_minor(v: &str) -> Option<(u32, u32)> {
    let mut parts = v.trim().split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next().flatten()?, parts.next().flatten()?))
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

/// The module files for `wanted` and their dependencies, dependencies first. Dependencies
/// are read from each module's `.modinfo` (`depends=`), so no `depmod` is needed.
pub(super) fn resolve_modules(dir: &Path, wanted: &[&str]) -> Result<Vec<PathBuf>, VmError> {
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
    pub(super) fn visit(
        name: &str,
        index: &std::collections::HashMap<String, PathBuf>,
        is_builtin: &dyn Fn(&str) -> bool,
        order: &mut Vec<PathBuf>,
        depth: u32,
    ) -> Result<(), VmError> {
        if depth > 32 {
            return Err(VmError::Initrd(format!(
                "module dependencies loop at {name}"
            )));
        }
        let Some(path) = index.get(name) else {
            if is_builtin(name) {
                return Ok(());
            }
            return Err(VmError::ModuleMissing(name.to_owned()));
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
pub(super) fn modinfo(ko: &[u8], key: &str) -> Vec<String> {
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
pub(super) struct Cpio {
    pub(super) buf: Vec<u8>,
    pub(super) ino: u32,
}

impl Cpio {
    pub(super) fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
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

    pub(super) fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
}

/// Names the initramfs by what goes in it: the agent's bytes and the modules.
fn initrd_digest(agent: &[u8], modules: &[PathBuf]) -> String {
    let mut h = Sha256::new();
    h.update(agent);
    for m in modules {
        h.update(m.as_os_str().as_encoded_bytes());
        h.update(fs::metadata(m).map(|m| m.len()).unwrap_or(0).to_le_bytes());
    }
    hex(&h.finalize()[..8])
}

/// How long an initramfs no server prepared stays in the cache: other servers on this host
/// (other builds, other checkouts) may run from theirs.
const INITRD_GRACE: Duration = Duration::from_secs(24 * 3600);

/// Removes the initramfs files of other agent builds that no server prepared for a day.
fn evict_stale_initrds(dir: &Path, current: &Path) {
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if !(n.starts_with("initrd-") && n.ends_with(".cpio")) || e.path() == current {
            continue;
        }
        let stale = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() > INITRD_GRACE);
        if stale {
            let _ = fs::remove_file(e.path());
        }
    }
}

pub(super) fn build_initrd(agent: &[u8], modules: &[PathBuf], out: &Path) -> Result<(), VmError> {
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

/// Takes an exclusive `flock` on `path` (created), waiting for it.
pub(super) fn lock_file(path: &Path) -> Result<fs::File, VmError> {
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(setup(format!("open {}", path.display())))?;
    locker_sys::fs::lock_exclusive(&f).map_err(|source| VmError::Io {
        step: format!("lock {}", path.display()),
        source,
    })?;
    Ok(f)
}

/// The read-only ext4 image of a template's root filesystem (built once, cached by the
/// template's digest; `mkfs.ext4 -d`, no mount needed).
pub fn template_image(rootfs: &Path) -> Result<PathBuf, VmError> {
    let digest = rootfs
        .parent()
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str())
        .ok_or_else(|| {
            VmError::TemplateImage(format!(
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
        return Err(VmError::TemplateImage(format!(
            "building the template's disk image: mkfs.ext4: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o444))
        .map_err(setup("chmod the template image"))?;
    fs::rename(&tmp, &img).map_err(setup(format!("install {}", img.display())))?;
    Ok(img)
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

    #[test]
    fn live_moves_need_qemu_10_unless_the_node_says() {
        assert!(!live_moves_given(None, (7, 2)).0);
        assert!(live_moves_given(None, (10, 0)).0);
        assert!(live_moves_given(None, (11, 1)).0);
        assert!(live_moves_given(Some("1"), (7, 2)).0);
        assert!(!live_moves_given(Some("0"), (10, 0)).0);
        // Anything else is as if unset.
        assert!(live_moves_given(Some("yes"), (10, 0)).0);
        let (_, why) = live_moves_given(None, (7, 2));
        assert!(
            why.contains("QEMU 7.2") && why.contains("LOCKER_CARRY_LIVE=1"),
            "{why}"
        );
    }
}
