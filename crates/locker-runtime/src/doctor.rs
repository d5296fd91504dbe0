//! What works on this host, and what to install or enable for the rest.
//!
//! Owns the checks behind `locker doctor` and `/healthz`: per runtime whether it can run
//! here (with the reason when not), and the host facts that decide it (cgroup version, user
//! namespaces, the data dir's filesystem and copy-on-write, KVM, who runs it), and whether
//! the template `default` is built and the tools builds need are there. Checks are cheap
//! reads and probes; the end-to-end proof (start a machine, ping its agent) is `probe_jail`.
//! Nothing here creates or changes anything (the template cache is only read).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::cgroup::Layout;

/// One runtime's verdict.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Verdict {
    pub ok: bool,
    pub detail: String,
}

impl Verdict {
    fn ok(detail: impl Into<String>) -> Self {
        Self {
            ok: true,
            detail: detail.into(),
        }
    }
    fn no(detail: impl Into<String>) -> Self {
        Self {
            ok: false,
            detail: detail.into(),
        }
    }
}

/// The whole report (`locker doctor --json`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub runtimes: BTreeMap<String, Verdict>,
    pub host: Host,
}

/// Facts about the host.
#[derive(Debug, Clone, Serialize)]
pub struct Host {
    pub kernel: String,
    /// `v1`, `v2`, or `none`.
    pub cgroup: String,
    /// `favored` (some cgroup hierarchy is mounted with `favordynmods`: moving a process
    /// into a cgroup is fast) or `default` (the first move after a quiet spell waits an RCU
    /// grace period, 8–20 ms on a small VM: every create, and every exec after a pause).
    pub cgroup_moves: String,
    pub cgroup_moves_detail: String,
    pub user_namespaces: bool,
    pub data_dir: String,
    /// Whether the data dir exists; if not, `data_dir_fs` is that of `data_dir_fs_of`, its
    /// nearest existing parent, where `locker serve` will create it.
    pub data_dir_exists: bool,
    pub data_dir_fs_of: String,
    pub data_dir_fs: String,
    /// `btrfs-subvolume`, `reflink`, or `copy` (no copy-on-write: snapshots copy files).
    pub copy_on_write: String,
    /// What `copy_on_write` means for snapshots and forks, in words.
    pub copy_on_write_detail: String,
    /// The effective user id: machines need root.
    pub uid: u32,
    /// What volumes get here: their own btrfs filesystem (size limit and copy-on-write
    /// for every writer), or why they cannot be created.
    pub volumes: String,
    /// `kvm`, `tcg` (emulation only), or `none`.
    pub virtualization: String,
    pub virtualization_detail: String,
    /// How a fleet node moves running microVMs to another node: `live` (QEMU's pre-copy
    /// migration, the guest runs on) or `cold` (frozen, from a snapshot with memory), or
    /// `none` (no QEMU), with why.
    pub microvm_moves: String,
    pub microvm_moves_detail: String,
    /// What starts a jail machine: `locker-jail` (the small shim of the same build) or
    /// `locker` itself, with where it is and why.
    pub jail_shim: String,
    /// Where a jail run's writable layer lives: `memory` (a tmpfs, Linux 6.3 and later) or
    /// `disk` (an ext4 image per run), with what that means.
    pub run_layer: String,
}

/// Runs every check. `data_dir` need not exist yet (its nearest existing parent is used).
pub fn check(data_dir: &Path) -> Report {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let layout = Layout::host();
    let cgroup = match &layout {
        Ok(l) => format!("{:?}", l.version).to_lowercase(),
        Err(_) => "none".into(),
    };
    let userns = user_namespaces();
    let existing = data_dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    let fs = fs_type(existing);
    let (cow, cow_detail) = copy_on_write(data_dir, &fs);
    let uid = locker_sys::host::geteuid();
    let volumes = match crate::volume_fs::support() {
        Ok(what) => what,
        Err(why) => format!("unavailable, volumes cannot be created: {why}"),
    };
    let (virt, virt_detail) = virtualization();
    let (vm_moves, vm_moves_detail) =
        match which("qemu-system-x86_64").map(|q| crate::vm::qemu_version(&q)) {
            Some(Ok(v)) => match crate::vm::live_moves(v) {
                (true, why) => ("live", why),
                (false, why) => ("cold", why),
            },
            Some(Err(e)) => ("none", e.to_string()),
            None => ("none", "QEMU is not installed".to_owned()),
        };
    let (moves, moves_detail) = match crate::cgroup::move_mode() {
        crate::cgroup::MoveMode::Favored(d) => ("favored", format!("{d}: moving a process into a cgroup is fast; forks and exits host-wide take a slightly slower path")),
        crate::cgroup::MoveMode::Default(d) => ("default", format!("{d} (8-20 ms on a small VM), paid by every create and by every exec after a pause; `locker serve` sets favordynmods at start unless --no-favordynmods")),
    };

    let mut missing = Vec::new();
    if uid != 0 {
        missing.push(not_root(uid));
    }
    if let Err(e) = &layout {
        missing.push(e.to_string());
    }
    if !userns.0 {
        missing.push(userns.1.clone());
    }
    if !filesystems().contains("overlay") {
        missing.push("overlayfs is not available (modprobe overlay)".into());
    }
    if which("mkfs.ext4").is_none() {
        missing.push("mkfs.ext4 not found (apt-get install e2fsprogs)".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        missing.push(
            "/dev/loop-control is missing (modprobe loop): machine disks need loop devices".into(),
        );
    }
    let agent = std::env::current_exe()
        .ok()
        .and_then(|e| crate::node::find_agent(&e));
    if agent.is_none() {
        missing.push(
            "no static locker-agent found: run scripts/setup build or set LOCKER_AGENT_BIN".into(),
        );
    }
    if !kernel_at_least(&kernel, 5, 19) {
        missing.push(format!(
            "kernel {kernel} is too old: id-mapped overlay layers need Linux 5.19 or newer"
        ));
    }
    let jail = if missing.is_empty() {
        Verdict::ok(format!(
            "namespaces, overlayfs over an id-mapped template, cgroup {cgroup}, seccomp; shares the host kernel (weaker than a VM)"
        ))
    } else {
        Verdict::no(missing.join("; "))
    };
    let microvm = microvm_verdict(agent.is_some(), uid);
    let jail_shim = match std::env::current_exe() {
        Ok(exe) => {
            let shim = crate::node::find_shim(&exe);
            if shim == exe {
                format!("{} __jail-init (no locker-jail of this build beside it: each machine start costs about 1 ms more CPU; build it with cargo build --release -p locker-jail)", exe.display())
            } else {
                format!("{} (the shim alone, same build)", shim.display())
            }
        }
        Err(e) => format!("unknown: {e}"),
    };
    let runtimes = [("jail".to_owned(), jail), ("microvm".to_owned(), microvm)]
        .into_iter()
        .collect();
    Report {
        runtimes,
        host: Host {
            kernel,
            cgroup,
            cgroup_moves: moves.into(),
            cgroup_moves_detail: moves_detail,
            user_namespaces: userns.0,
            data_dir: data_dir.display().to_string(),
            data_dir_exists: data_dir.exists(),
            data_dir_fs_of: existing.display().to_string(),
            data_dir_fs: fs,
            copy_on_write: cow,
            copy_on_write_detail: cow_detail,
            uid,
            volumes,
            virtualization: virt,
            virtualization_detail: virt_detail,
            microvm_moves: vm_moves.into(),
            microvm_moves_detail: vm_moves_detail,
            jail_shim,
            run_layer: if crate::jail::memory_scratch() {
                "memory: a run's jail writes outside its volume to a tmpfs half its memory in size (no disk image per run)".into()
            } else {
                "disk: this kernel cannot id-map a tmpfs (Linux 6.3 can), so each run's jail gets a 2048 MB disk image (about 3 ms more CPU per run)".into()
            },
        },
    }
}

/// The microVM runtime: QEMU and the guest kernel present, and which accelerator it gets
/// (KVM, or TCG emulation, which is for correctness only and not a security boundary).
fn microvm_verdict(have_agent: bool, uid: u32) -> Verdict {
    let mut missing = Vec::new();
    if uid != 0 {
        missing.push(not_root(uid));
    }
    if which("qemu-system-x86_64").is_none() {
        missing.push("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86; scripts/setup does)".to_owned());
    }
    if which("qemu-img").is_none() {
        missing.push("qemu-img is not installed (apt-get install qemu-utils; scripts/setup does): microVMs started from snapshots stand on qcow2 overlays".to_owned());
    }
    let kdir = crate::vm::kernel_dir();
    if !kdir.join("vmlinuz").is_file() || !kdir.join("modules").is_dir() {
        missing.push(format!(
            "no guest kernel in {} (scripts/setup unpacks linux-image-cloud-amd64 there)",
            kdir.display()
        ));
    }
    if !have_agent {
        missing.push("no static locker-agent (the guest's init)".to_owned());
    }
    if !missing.is_empty() {
        return Verdict::no(missing.join("; "));
    }
    let (accel, why) = crate::vm::accel();
    match accel {
        crate::vm::Accel::Kvm => Verdict::ok(format!("KVM usable: QEMU microvm with its own guest kernel, restored from a booted snapshot ({why})")),
        crate::vm::Accel::Tcg => Verdict::ok(format!("TCG only: {why}. MicroVMs work (own guest kernel, memory snapshots) but run emulated: use them for correctness, not as an isolation boundary, on this host")),
    }
}

fn not_root(uid: u32) -> String {
    format!("this runs as uid {uid}, not root: machines need root (namespaces, cgroups, mounts, network devices); run `sudo locker doctor` and the server as root")
}

pub(crate) fn kernel_at_least(release: &str, major: u32, minor: u32) -> bool {
    let mut it = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|s| s.parse::<u32>().ok());
    let (a, b) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    (a, b) >= (major, minor)
}

fn filesystems() -> String {
    std::fs::read_to_string("/proc/filesystems").unwrap_or_default()
}

/// Finds a program on PATH (plus the sbin directories root usually has).
pub fn which(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file());
    found
}

fn user_namespaces() -> (bool, String) {
    let max = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    match max {
        Some(0) => (false, "user namespaces are disabled (sysctl user.max_user_namespaces=0): set it to 10000 or more".into()),
        None => (false, "this kernel has no user namespaces (CONFIG_USER_NS)".into()),
        Some(_) => (true, String::new()),
    }
}

fn fs_type(p: &Path) -> String {
    let Ok(f_type) = locker_sys::fs::fs_type(p) else {
        return "unknown".into();
    };
    match f_type as u32 {
        0xEF53 => "ext4",
        0x9123_683E => "btrfs",
        0x5846_5342 => "xfs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlay",
        0x6573_5546 => "fuse",
        0x2FC1_2FC1 => "zfs",
        _ => "other",
    }
    .into()
}

/// How snapshots and forks get their data, and what that means, in words: btrfs subvolume
/// snapshots, reflinks (tested with a real `FICLONE`), Locker's XFS image (see
/// [`crate::cow_disks`], with `locker serve`'s default `--cow-disks auto`), or copies.
fn copy_on_write(data_dir: &Path, fs: &str) -> (String, String) {
    use crate::cow_disks::{decide, Mode, Sharing};
    if fs == "btrfs" && !data_dir.join(crate::cow_disks::IMAGE).exists() {
        return ("btrfs-subvolume".into(), "snapshots and forks are btrfs subvolume snapshots: instant, and they share unchanged data".into());
    }
    match decide(data_dir, Mode::Auto) {
        Sharing::Reflinks => ("reflink".into(), "snapshots and forks clone files with reflinks: instant, and they share unchanged blocks".into()),
        Sharing::Image => ("xfs-image".into(), format!(
            "the data dir's filesystem cannot reflink, so sandboxes' disks and snapshots live on Locker's own XFS image ({}, mounted at {}; made by `locker serve` on a data dir without sandboxes, unless --cow-disks off): snapshots and forks share blocks. The image believes it has the host filesystem's size: keep that from filling (docs/operations.md)",
            data_dir.join(crate::cow_disks::IMAGE).display(),
            data_dir.join(crate::cow_disks::MOUNT).display()
        )),
        Sharing::Copies(why) => ("copy".into(), format!("none: {why}; snapshots and forks copy every byte a sandbox wrote (slower, full size each); a btrfs or XFS data dir, or a fresh one here with xfsprogs, makes them instant")),
    }
}

fn virtualization() -> (String, String) {
    let (accel, why) = crate::vm::accel();
    (accel.as_str().into(), why)
}

/// The human table of `locker doctor`.
pub fn render(r: &Report) -> String {
    let mut out = String::from("RUNTIME   OK   DETAIL\n");
    for (name, v) in &r.runtimes {
        out.push_str(&format!(
            "{name:<9} {:<4} {}\n",
            if v.ok { "yes" } else { "no" },
            v.detail
        ));
    }
    let h = &r.host;
    let data_dir = if h.data_dir_exists {
        format!("{} ({})", h.data_dir, h.data_dir_fs)
    } else {
        format!(
            "{} (does not exist yet: `locker serve` creates it, on the {} filesystem of {})",
            h.data_dir, h.data_dir_fs, h.data_dir_fs_of
        )
    };
    out.push_str(&format!(
        "\nkernel            {}\ncgroup            {}\ncgroup moves      {}: {}\nuser namespaces   {}\ndata dir          {}\ncopy-on-write     {}: {}\nvolumes           {}\nvirtualization    {}: {}\nmicroVM moves     {}: {}\njail shim         {}\nrun layer         {}\n",
        h.kernel,
        h.cgroup,
        h.cgroup_moves,
        h.cgroup_moves_detail,
        if h.user_namespaces { "yes" } else { "no" },
        data_dir,
        h.copy_on_write,
        h.copy_on_write_detail,
        h.volumes,
        h.virtualization,
        h.virtualization_detail,
        h.microvm_moves,
        h.microvm_moves_detail,
        h.jail_shim,
        h.run_layer
    ));
    out
}

/// The template cache and the tools that builds and machines need.
#[derive(Debug, Clone, Serialize)]
pub struct Templates {
    pub cache_dir: String,
    /// Whether the template `default` (what a create without `template` uses) is built.
    pub default_built: bool,
    pub detail: String,
    /// Per tool: whether it is installed, and what it is for or what to install.
    pub tools: BTreeMap<String, Verdict>,
}

/// Checks the template cache at `cache_dir` (read only: a missing cache is reported, not
/// created) and the tools template builds, machine disks and volumes need.
pub fn check_templates(cache_dir: &Path) -> Templates {
    const BUILD: &str = "sudo locker template build default";
    let (default_built, detail) = if !cache_dir.join("templates").is_dir() {
        (
            false,
            format!(
                "no template cache yet: run `{BUILD}` (a few minutes; `scripts/setup` does it too)"
            ),
        )
    } else {
        match crate::template::TemplateStore::open(cache_dir)
            .and_then(|s| s.resolve(crate::template::DEFAULT_TEMPLATE))
        {
            Ok(Some(t)) => (
                true,
                format!(
                    "`default` built ({}, {} MiB)",
                    &t.digest[..t.digest.len().min(12)],
                    t.size_bytes >> 20
                ),
            ),
            Ok(None) => (
                false,
                format!("`default` is not built: run `{BUILD}` (or start `locker serve`, which builds it in the background)"),
            ),
            Err(e) => (false, format!("cannot read the cache: {e}")),
        }
    };
    let tool = |names: &[&str], ok: &str, fix: &str| {
        if names.iter().all(|n| which(n).is_some()) {
            Verdict::ok(ok)
        } else {
            Verdict::no(fix)
        }
    };
    let tools = [
        (
            "mkfs.ext4",
            tool(
                &["mkfs.ext4"],
                "machine disks",
                "missing: machine disks need it: apt-get install e2fsprogs",
            ),
        ),
        (
            "mmdebstrap",
            tool(
                &["mmdebstrap"],
                "template builds",
                "missing: template builds need it: apt-get install mmdebstrap",
            ),
        ),
        (
            "btrfs-progs",
            tool(
                &["mkfs.btrfs", "btrfs"],
                "volumes",
                "missing: volumes need mkfs.btrfs and btrfs: apt-get install btrfs-progs",
            ),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    Templates {
        cache_dir: cache_dir.display().to_string(),
        default_built,
        detail,
        tools,
    }
}

/// The templates part of `locker doctor`'s table.
pub fn render_templates(t: &Templates) -> String {
    let tools: Vec<String> = t
        .tools
        .iter()
        .map(|(name, v)| {
            if v.ok {
                format!("{name} yes ({})", v.detail)
            } else {
                format!("{name} NO ({})", v.detail)
            }
        })
        .collect();
    format!(
        "templates         {}: {}\ntools             {}\n",
        t.cache_dir,
        t.detail,
        tools.join(", ")
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_versions_compare() {
        assert!(super::kernel_at_least("6.18.44-fc-v657", 5, 19));
        assert!(super::kernel_at_least("5.19.0", 5, 19));
        assert!(!super::kernel_at_least("5.15.0-91-generic", 5, 19));
    }

    #[test]
    fn report_on_this_host_is_complete() {
        let r = super::check(std::path::Path::new("/var/lib/locker"));
        assert!(r.runtimes.contains_key("jail") && r.runtimes.contains_key("microvm"));
        assert!(!r.host.kernel.is_empty());
        // How microVMs move follows the QEMU installed (scripts/setup's is 10 on Debian 12).
        let expect = match super::which("qemu-system-x86_64") {
            None => "none",
            Some(q) => match crate::vm::qemu_version(&q) {
                Ok(v) if crate::vm::live_moves(v).0 => "live",
                Ok(_) => "cold",
                Err(_) => "none",
            },
        };
        assert_eq!(
            r.host.microvm_moves, expect,
            "{}",
            r.host.microvm_moves_detail
        );
        assert!(super::render(&r).contains("microVM moves"));
    }
}
