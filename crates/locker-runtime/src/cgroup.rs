//! Control groups of machines: limits, accounting, freezing, killing, removal.
//!
//! Owns the host side of every machine's cgroup under `<controller>/locker/<name>` (v1) or
//! `locker/<name>` (v2), where the name is the machine's id and a tag of its directory
//! ([`machine_name`]). Works on pure v2 hosts (most users) and on v1 or hybrid hosts
//! (these build machines: cpu, memory, pids and freezer on v1). Inside a machine the agent
//! creates a cgroup per command below the machine's own; this room never touches those
//! except to kill and remove everything when the machine goes. It also enters a process
//! into a machine's cgroup between fork and exec ([`enter_cgroup`]: QEMU, the file server).
//!
//! # What is delegated to the machine's root
//! Only what the agent needs to put commands into cgroups of their own: the machine's
//! directory (to create them) and, on v2, the machine cgroup's `cgroup.procs` (v2 checks
//! the common ancestor of the source and the destination, and the agent's leaf `init` and
//! the commands' cgroups meet there; the machine cgroup itself never holds a process, as it
//! delegates controllers). The files that would let a command leave its cgroup stay the
//! host's: on v1 the machine cgroup's `cgroup.procs` and `tasks` (where the agent lives),
//! on v2 `init`'s, and everywhere the limits and `cgroup.subtree_control`. Capabilities in
//! the machine's user namespace do not apply to files owned by ids it does not map, so its
//! root cannot write them. What a command can still do is make a cgroup of its own beside
//! the commands' and move there; the agent kills every such cgroup when a command ends.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The directory under each hierarchy that holds every machine's cgroup.
pub const PARENT: &str = "locker";

/// v1 controllers a machine uses; `cpuacct` may be co-mounted with `cpu`.
const V1_CONTROLLERS: [&str; 5] = ["memory", "pids", "cpu", "cpuacct", "freezer"];

/// Errors of cgroup setup and control.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no usable cgroup hierarchy at {root}: need cgroup v2 with memory, pids and cpu enabled, or v1 with the memory, pids, cpu, cpuacct and freezer controllers mounted")]
    NotFound { root: PathBuf },
    #[error("cgroup {path}: {step}: {source}")]
    Io {
        path: PathBuf,
        step: &'static str,
        source: io::Error,
    },
    #[error("cgroup {0} still has processes after killing them for 5 s")]
    Busy(PathBuf),
}

fn io_err<'a>(path: &'a Path, step: &'static str) -> impl FnOnce(io::Error) -> CgroupError + 'a {
    move |source| CgroupError::Io {
        path: path.to_owned(),
        step,
        source,
    }
}

/// Which cgroup version a host gives machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    V1,
    V2,
}

/// Where the hierarchies are.
#[derive(Debug, Clone)]
pub struct Layout {
    pub version: Version,
    /// `/sys/fs/cgroup`.
    pub root: PathBuf,
}

impl Layout {
    /// Detects the layout: v2 if the unified hierarchy at `root` has the memory, pids and
    /// cpu controllers; else v1 if those controllers are mounted as v1 hierarchies.
    pub fn detect(root: &Path) -> Result<Self, CgroupError> {
        if let Ok(c) = fs::read_to_string(root.join("cgroup.controllers")) {
            let has = |n: &str| c.split_whitespace().any(|x| x == n);
            if has("memory") && has("pids") && has("cpu") {
                return Ok(Self {
                    version: Version::V2,
                    root: root.to_owned(),
                });
            }
        }
        if V1_CONTROLLERS
            .iter()
            .all(|c| root.join(c).join("tasks").exists())
        {
            return Ok(Self {
                version: Version::V1,
                root: root.to_owned(),
            });
        }
        Err(CgroupError::NotFound {
            root: root.to_owned(),
        })
    }

    /// The host's layout at `/sys/fs/cgroup`.
    pub fn host() -> Result<Self, CgroupError> {
        Self::detect(Path::new("/sys/fs/cgroup"))
    }

    /// The controller directories that hold machine cgroups (v1: one per distinct
    /// hierarchy, so co-mounted `cpu,cpuacct` appears once; v2: the unified root).
    fn hierarchies(&self) -> Vec<(&'static str, PathBuf)> {
        match self.version {
            Version::V2 => vec![("", self.root.clone())],
            Version::V1 => {
                let mut seen: Vec<PathBuf> = Vec::new();
                let mut out = Vec::new();
                for c in V1_CONTROLLERS {
                    let p = self.root.join(c);
                    let canon = fs::canonicalize(&p).unwrap_or(p.clone());
                    if !seen.contains(&canon) {
                        seen.push(canon);
                        out.push((c, p));
                    }
                }
                out
            }
        }
    }

    /// The names of every machine cgroup that exists ([`machine_name`]).
    pub fn machine_names(&self) -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for (_, h) in self.hierarchies() {
            if let Ok(rd) = fs::read_dir(h.join(PARENT)) {
                for e in rd.flatten() {
                    if e.path().is_dir() {
                        let n = e.file_name().to_string_lossy().into_owned();
                        if !ids.contains(&n) {
                            ids.push(n);
                        }
                    }
                }
            }
        }
        ids
    }
}

/// Limits of one machine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// CPU time as a number of cores (CFS quota).
    pub cpus: f64,
    pub memory_bytes: u64,
    pub pids: u64,
}

/// One machine's cgroup.
#[derive(Debug, Clone)]
pub struct MachineCgroup {
    layout: Layout,
    name: String,
}

/// The name of the cgroup of machine `id` whose directory is `dir`: `<id>.<tag>`, the tag
/// eight hex digits of a hash of the directory. Several servers on one host (a fleet's
/// nodes in tests, a second data dir) each have their own machines' directories, and so
/// never share a cgroup even for one sandbox id: a machine of a sandbox that moved is
/// torn down without touching the new one's. The uid ranges are host-wide for the same
/// reason ([`crate::machine::slots`]). The hash is FNV-1a, fixed here, so a later build
/// finds the same name.
pub fn machine_name(id: &str, dir: &Path) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in dir.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{id}.{:08x}", (h ^ (h >> 32)) as u32)
}

fn write(path: &Path, value: &str, step: &'static str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(io_err(path, step))
}

fn chown(path: &Path, uid: u32) -> Result<(), CgroupError> {
    std::os::unix::fs::chown(path, Some(uid), Some(uid))
        .map_err(io_err(path, "delegate to the machine's root"))
}

impl MachineCgroup {
    /// The cgroup a machine being started (`id`, in `dir`) gets: see [`machine_name`].
    pub fn new(layout: Layout, id: &str, dir: &Path) -> Self {
        Self {
            name: machine_name(id, dir),
            layout,
        }
    }

    /// The cgroup of a machine that may have been started by an earlier server: the one
    /// [`MachineCgroup::new`] names, unless only a cgroup named by the bare id exists
    /// (what releases before the tag made). Whether or not it still exists.
    pub fn existing(layout: Layout, id: &str, dir: &Path) -> Self {
        let cg = Self::new(layout, id, dir);
        let Some((_, first)) = cg.layout.hierarchies().into_iter().next() else {
            return cg;
        };
        let parent = first.join(PARENT);
        if !parent.join(&cg.name).exists() && parent.join(id).exists() {
            return Self {
                name: id.to_owned(),
                layout: cg.layout,
            };
        }
        cg
    }

    /// The cgroup's name under [`PARENT`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cgroup's directory in the v1 hierarchy of `controller` (`""`: the v2 root).
    fn under(&self, controller: &str) -> PathBuf {
        self.layout
            .root
            .join(controller)
            .join(PARENT)
            .join(&self.name)
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Per hierarchy: (controller name, the machine's directory).
    pub fn dirs(&self) -> Vec<(&'static str, PathBuf)> {
        self.layout
            .hierarchies()
            .into_iter()
            .map(|(c, h)| (c, h.join(PARENT).join(&self.name)))
            .collect()
    }

    /// Creates the cgroup with its limits and delegates it to `owner_uid` (the machine's
    /// root): it may create child cgroups and move processes, never raise its own limits.
    pub fn create(&self, limits: Limits, owner_uid: u32) -> Result<(), CgroupError> {
        let period: u64 = 100_000;
        let quota = ((limits.cpus * period as f64).round() as u64).max(1000);
        match self.layout.version {
            Version::V2 => {
                let parent = self.layout.root.join(PARENT);
                fs::create_dir_all(&parent).map_err(io_err(&parent, "create"))?;
                for p in [&self.layout.root, &parent] {
                    let sc = p.join("cgroup.subtree_control");
                    write(&sc, "+memory +pids +cpu", "enable controllers")?;
                }
                let dir = parent.join(&self.name);
                fs::create_dir(&dir).map_err(io_err(&dir, "create"))?;
                write(
                    &dir.join("memory.max"),
                    &limits.memory_bytes.to_string(),
                    "set memory.max",
                )?;
                let _ = fs::write(dir.join("memory.swap.max"), "0");
                write(
                    &dir.join("pids.max"),
                    &limits.pids.to_string(),
                    "set pids.max",
                )?;
                write(
                    &dir.join("cpu.max"),
                    &format!("{quota} {period}"),
                    "set cpu.max",
                )?;
                // The agent lives in a leaf so the machine's cgroup may have children with
                // controllers (v2 allows no process in a cgroup that delegates controllers).
                let init = dir.join("init");
                // The machine's PID 1 enables the controllers for its children once it
                // has moved into `init` (see the jail's set-up): a cgroup that delegates
                // controllers may hold no process, and it enters this one first.
                fs::create_dir(&init).map_err(io_err(&init, "create"))?;
                for f in ["", "cgroup.procs"] {
                    chown(&dir.join(f), owner_uid)?;
                }
            }
            Version::V1 => {
                for (c, dir) in self.dirs() {
                    fs::create_dir_all(&dir).map_err(io_err(&dir, "create"))?;
                    match c {
                        "memory" => {
                            let _ = fs::write(dir.join("memory.use_hierarchy"), "1");
                            write(
                                &dir.join("memory.limit_in_bytes"),
                                &limits.memory_bytes.to_string(),
                                "set memory.limit_in_bytes",
                            )?;
                            // Without swap accounting the host may have no memsw files.
                            let _ = fs::write(
                                dir.join("memory.memsw.limit_in_bytes"),
                                limits.memory_bytes.to_string(),
                            );
                        }
                        "pids" => write(
                            &dir.join("pids.max"),
                            &limits.pids.to_string(),
                            "set pids.max",
                        )?,
                        "cpu" => {
                            write(
                                &dir.join("cpu.cfs_period_us"),
                                &period.to_string(),
                                "set cpu.cfs_period_us",
                            )?;
                            write(
                                &dir.join("cpu.cfs_quota_us"),
                                &quota.to_string(),
                                "set cpu.cfs_quota_us",
                            )?;
                        }
                        _ => {}
                    }
                    // v1 checks the destination's `cgroup.procs` only: the agent's own (this
                    // directory's) stays the host's, so no command can move back here.
                    chown(&dir, owner_uid)?;
                }
            }
        }
        Ok(())
    }

    /// Moves process `pid` into the machine's cgroup (v2: its `init` leaf).
    pub fn enter(&self, pid: u32) -> Result<(), CgroupError> {
        for procs in self.procs_files() {
            write(&procs, &pid.to_string(), "move a process in")?;
        }
        Ok(())
    }

    /// The `cgroup.procs` files a process is written to to enter the machine (v2: its
    /// `init` leaf): for a child that moves itself in between fork and exec.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs()
            .into_iter()
            .map(|(_, dir)| match self.layout.version {
                Version::V2 => dir.join("init").join("cgroup.procs"),
                Version::V1 => dir.join("cgroup.procs"),
            })
            .collect()
    }

    /// What the machine sees at `/sys/fs/cgroup`: (host directory, path inside).
    pub fn binds(&self) -> Vec<(PathBuf, PathBuf)> {
        match self.layout.version {
            Version::V2 => self
                .dirs()
                .into_iter()
                .map(|(_, d)| (d, PathBuf::from("sys/fs/cgroup")))
                .collect(),
            Version::V1 => V1_CONTROLLERS
                .iter()
                .map(|c| (self.under(c), PathBuf::from("sys/fs/cgroup").join(c)))
                .collect(),
        }
    }

    fn freezer_dir(&self) -> PathBuf {
        match self.layout.version {
            Version::V2 => self.under(""),
            Version::V1 => self.under("freezer"),
        }
    }

    /// Freezes (`true`) or thaws every process of the machine and waits until done.
    pub fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        let dir = self.freezer_dir();
        let deadline = Instant::now() + Duration::from_secs(5);
        match self.layout.version {
            Version::V2 => {
                write(
                    &dir.join("cgroup.freeze"),
                    if frozen { "1" } else { "0" },
                    "freeze",
                )?;
                let want = if frozen { "frozen 1" } else { "frozen 0" };
                while Instant::now() < deadline {
                    let ev = fs::read_to_string(dir.join("cgroup.events")).unwrap_or_default();
                    if ev.lines().any(|l| l == want) {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            Version::V1 => {
                let state = if frozen { "FROZEN" } else { "THAWED" };
                while Instant::now() < deadline {
                    write(&dir.join("freezer.state"), state, "freeze")?;
                    if fs::read_to_string(dir.join("freezer.state"))
                        .unwrap_or_default()
                        .trim()
                        == state
                    {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
        Err(CgroupError::Io {
            path: dir,
            step: "wait for the freezer",
            source: io::ErrorKind::TimedOut.into(),
        })
    }

    /// Whether the machine is frozen now.
    pub fn is_frozen(&self) -> bool {
        let dir = self.freezer_dir();
        match self.layout.version {
            Version::V2 => fs::read_to_string(dir.join("cgroup.events"))
                .unwrap_or_default()
                .lines()
                .any(|l| l == "frozen 1"),
            Version::V1 => {
                fs::read_to_string(dir.join("freezer.state"))
                    .unwrap_or_default()
                    .trim()
                    == "FROZEN"
            }
        }
    }

    /// Every pid in the machine's cgroup tree (host pids).
    pub fn pids(&self) -> Vec<i32> {
        let mut out = Vec::new();
        for (_, dir) in self.dirs() {
            collect_pids(&dir, &mut out);
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Kills every process of the machine (freeze, SIGKILL all, thaw) until none is left.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(CgroupError::Busy(self.freezer_dir()));
            }
            if self.layout.version == Version::V2 && self.freezer_dir().join("cgroup.kill").exists()
            {
                let _ = fs::write(self.freezer_dir().join("cgroup.kill"), "1");
            } else {
                let _ = self.set_frozen(true);
                for p in &pids {
                    let _ = crate::sys::kill(*p, libc::SIGKILL);
                }
                let _ = self.set_frozen(false);
                // A v1 cgroup frozen by itself stays frozen when its parent thaws, and a
                // frozen task never acts on its SIGKILL: the agent freezes a command's
                // cgroup to kill its tree, and if it dies in between (the machine is being
                // destroyed), that command would hang the pid namespace's teardown.
                if self.layout.version == Version::V1 {
                    thaw_descendants(&self.freezer_dir());
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Removes the cgroup and everything below it; the processes must be gone.
    pub fn remove(&self) -> Result<(), CgroupError> {
        let mut last = None;
        for (_, dir) in self.dirs() {
            if dir.exists() {
                if let Err(e) = remove_tree(&dir) {
                    last = Some(e);
                }
            }
        }
        last.map_or(Ok(()), Err)
    }

    /// CPU time and peak memory of the whole machine.
    pub fn usage(&self) -> locker_types::Usage {
        let read = |p: PathBuf| fs::read_to_string(p).unwrap_or_default();
        let dirs = self.dirs();
        let dir_of = |c: &str| {
            dirs.iter()
                .find(|(n, _)| *n == c || self.layout.version == Version::V2)
                .map(|(_, d)| d.clone())
        };
        match self.layout.version {
            Version::V2 => {
                let d = dir_of("").expect("v2 has one hierarchy");
                let cpu_us = read(d.join("cpu.stat"))
                    .lines()
                    .find_map(|l| {
                        l.strip_prefix("usage_usec ")
                            .and_then(|v| v.trim().parse::<u64>().ok())
                    })
                    .unwrap_or(0);
                let peak = read(d.join("memory.peak")).trim().parse().unwrap_or(0);
                locker_types::Usage {
                    cpu_ms: cpu_us / 1000,
                    peak_memory_bytes: peak,
                }
            }
            Version::V1 => {
                let acct = self.under("cpuacct");
                let ns: u64 = read(acct.join("cpuacct.usage")).trim().parse().unwrap_or(0);
                let mem = self.under("memory");
                let peak = read(mem.join("memory.max_usage_in_bytes"))
                    .trim()
                    .parse()
                    .unwrap_or(0);
                locker_types::Usage {
                    cpu_ms: ns / 1_000_000,
                    peak_memory_bytes: peak,
                }
            }
        }
    }

    /// Current memory use in bytes.
    pub fn memory_current(&self) -> u64 {
        let f = match self.layout.version {
            Version::V2 => self.under("").join("memory.current"),
            Version::V1 => self.under("memory").join("memory.usage_in_bytes"),
        };
        fs::read_to_string(f)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// Writes `THAWED` to every v1 freezer cgroup below `dir`.
fn thaw_descendants(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            let child = e.path();
            let _ = fs::write(child.join("freezer.state"), "THAWED");
            thaw_descendants(&child);
        }
    }
}

fn collect_pids(dir: &Path, out: &mut Vec<i32>) {
    if let Ok(s) = fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(s.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                collect_pids(&e.path(), out);
            }
        }
    }
}

/// rmdir a cgroup tree bottom-up (cgroupfs directories are removed with rmdir only).
fn remove_tree(dir: &Path) -> Result<(), CgroupError> {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_tree(&e.path())?;
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            // EBUSY while the last exiting task leaves the cgroup.
            Err(e) if Instant::now() < deadline && e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => {
                return Err(CgroupError::Io {
                    path: dir.to_owned(),
                    step: "remove",
                    source: e,
                })
            }
        }
    }
}

/// Paths as C strings, prepared before a fork for [`enter_cgroup`] after it.
pub(crate) fn c_paths(paths: &[std::path::PathBuf]) -> Vec<std::ffi::CString> {
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
pub(crate) fn enter_cgroup(procs: &std::ffi::CStr) -> std::io::Result<()> {
    // SAFETY: open, write and close on a valid path and a static buffer.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let r = libc::write(fd, b"0".as_ptr().cast(), 1);
        libc::close(fd);
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Where [`favor_dynamic_moves`] mounts its named v1 hierarchy.
pub const FAVOR_MOUNT: &str = "/run/locker/cgroup-favordynmods";

/// How cgroup migrations fare on this host: every machine start moves its PID 1 into the
/// machine's cgroup, and every command moves into a cgroup of its own (the way a timeout
/// kills its whole tree). A move takes the kernel's `cgroup_threadgroup_rwsem` for writing;
/// unless the kernel *favours dynamic modifications*, the first writer after a quiet spell
/// waits for an RCU grace period: 8–20 ms on a 2-core VM, measured. So on a freshly booted
/// host a create, and an exec that follows a pause (an agent's model turn), each wait that
/// long, where back-to-back calls do not. The cost of favouring: forks and exits on the
/// whole host take the reader side's slow path (a shared atomic instead of a per-CPU count),
/// which matters on hosts with many cores forking hard and little on a sandbox host.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "detail")]
pub enum MoveMode {
    /// Some cgroup hierarchy is mounted with `favordynmods`: moves are fast.
    Favored(String),
    /// Moves wait a grace period after a quiet spell (the kernel's default).
    Default(String),
}

/// Whether any cgroup hierarchy on the host is mounted with `favordynmods` (the kernel
/// state is global: one such mount puts every migration on the fast path).
pub fn move_mode() -> MoveMode {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    match favoring_mount(&info) {
        Some(at) => MoveMode::Favored(format!("favordynmods is set on the cgroup mount at {at}")),
        None => MoveMode::Default(
            "no cgroup hierarchy is mounted with favordynmods: the first cgroup move after a quiet spell waits an RCU grace period".into(),
        ),
    }
}

/// The mount point of a cgroup (v1 or v2) mount whose superblock options hold
/// `favordynmods`, from `/proc/self/mountinfo`'s text.
fn favoring_mount(mountinfo: &str) -> Option<String> {
    mountinfo.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        let mut post = post.split_whitespace();
        let fstype = post.next()?;
        let super_opts = post.nth(1)?;
        ((fstype == "cgroup" || fstype == "cgroup2")
            && super_opts.split(',').any(|o| o == "favordynmods"))
        .then(|| pre.split_whitespace().nth(4).unwrap_or("?").to_owned())
    })
}

/// Puts cgroup migrations on the kernel's fast path for as long as the host runs (see
/// [`MoveMode`] for why and at what cost), unless something already did. Mounts a named
/// cgroup v1 hierarchy without controllers (`name=locker`) with `favordynmods` at
/// [`FAVOR_MOUNT`] and leaves it there: the kernel favours dynamic modifications while
/// any hierarchy so mounted exists, and nothing uses this one. Where the kernel has no
/// cgroup v1 (or refuses the option), a pure v2 host's `/sys/fs/cgroup` is remounted with
/// its own options plus `favordynmods`. Changes nothing when it fails; says why.
pub fn favor_dynamic_moves() -> Result<MoveMode, String> {
    if let m @ MoveMode::Favored(_) = move_mode() {
        return Ok(m);
    }
    let at = Path::new(FAVOR_MOUNT);
    fs::create_dir_all(at).map_err(|e| format!("create {FAVOR_MOUNT}: {e}"))?;
    let v1 = crate::sys::mount(
        Some("locker"),
        at,
        Some("cgroup"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some("none,name=locker,favordynmods"),
    );
    let v1_err = match v1 {
        Ok(()) => {
            return Ok(MoveMode::Favored(format!(
                "favordynmods set by mounting a named cgroup v1 hierarchy at {FAVOR_MOUNT}"
            )))
        }
        Err(e) => {
            let _ = fs::remove_dir(at);
            e
        }
    };
    // A pure v2 host whose kernel has no v1: remount the unified hierarchy, keeping its
    // options (a remount without them would drop nsdelegate and the others).
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let root_opts = info.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        let mut post = post.split_whitespace();
        (pre.split_whitespace().nth(4)? == "/sys/fs/cgroup" && post.next()? == "cgroup2")
            .then(|| post.nth(1).unwrap_or("").to_owned())
    });
    let Some(opts) = root_opts else {
        return Err(format!(
            "mount a named cgroup v1 hierarchy with favordynmods: {v1_err} (and /sys/fs/cgroup is not cgroup2)"
        ));
    };
    let mut kept: Vec<&str> = opts
        .split(',')
        .filter(|o| !o.is_empty() && *o != "rw" && *o != "ro")
        .collect();
    kept.push("favordynmods");
    crate::sys::mount(
        None,
        Path::new("/sys/fs/cgroup"),
        None,
        libc::MS_REMOUNT,
        Some(&kept.join(",")),
    )
    .map_err(|e| {
        format!("mount a named cgroup v1 hierarchy with favordynmods: {v1_err}; remount /sys/fs/cgroup with it: {e}")
    })?;
    Ok(MoveMode::Favored(
        "favordynmods added to the options of /sys/fs/cgroup (cgroup2)".into(),
    ))
}

#[cfg(test)]
mod favor_tests {
    use super::favoring_mount;

    #[test]
    fn a_cgroup_mount_with_favordynmods_is_found_by_its_superblock_options() {
        let info = "\
35 25 0:30 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:12 - cgroup cgroup rw,pids
36 25 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
";
        assert_eq!(favoring_mount(info), None);
        let with = format!(
            "{info}90 24 0:55 / /run/locker/cgroup-favordynmods rw,nosuid,nodev,noexec,relatime - cgroup locker rw,name=locker,favordynmods\n"
        );
        assert_eq!(
            favoring_mount(&with).as_deref(),
            Some("/run/locker/cgroup-favordynmods")
        );
        // The word in a mount point or another filesystem's options does not count.
        let other = "91 24 0:56 / /mnt/favordynmods rw - tmpfs tmpfs rw,favordynmods\n";
        assert_eq!(favoring_mount(other), None);
    }
}

#[cfg(test)]
mod name_tests {
    use super::{machine_name, Layout, MachineCgroup, Version, PARENT};
    use std::path::Path;

    #[test]
    fn a_machines_cgroup_is_named_by_its_id_and_its_directory() {
        let a = machine_name("sb_1", Path::new("/var/lib/locker/sandboxes/sb_1"));
        // Fixed: a later build must find the cgroups an earlier one made.
        assert_eq!(a, "sb_1.07a9213a"); // FNV-1a 64 of the path, folded to 32 bits
        let b = machine_name("sb_1", Path::new("/srv/other/sandboxes/sb_1"));
        assert!(b.starts_with("sb_1.") && b != a, "{a} {b}");
    }

    #[test]
    fn an_earlier_releases_cgroup_named_by_the_bare_id_is_still_found() {
        let root = std::env::temp_dir().join(format!("cg-names-{}", std::process::id()));
        let layout = Layout {
            version: Version::V2,
            root: root.clone(),
        };
        let dir = Path::new("/data/sandboxes/sb_2");
        let tagged = MachineCgroup::new(layout.clone(), "sb_2", dir);
        // Neither exists: the name this build gives.
        assert_eq!(
            MachineCgroup::existing(layout.clone(), "sb_2", dir).name(),
            tagged.name()
        );
        std::fs::create_dir_all(root.join(PARENT).join("sb_2")).unwrap();
        assert_eq!(
            MachineCgroup::existing(layout.clone(), "sb_2", dir).name(),
            "sb_2"
        );
        // Both: the tagged one is this build's machine.
        std::fs::create_dir_all(root.join(PARENT).join(tagged.name())).unwrap();
        assert_eq!(
            MachineCgroup::existing(layout, "sb_2", dir).name(),
            tagged.name()
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
