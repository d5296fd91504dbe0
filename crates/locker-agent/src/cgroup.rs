//! Per-command cgroups: the way the agent kills a command's *whole* tree (also children that
//! called `setsid` or double-forked) and measures what it used.
//!
//! Layout, detected once at start:
//! - root: `$LOCKER_CGROUP_ROOT` (default `/sys/fs/cgroup`), parent: `$LOCKER_CGROUP_PARENT`
//!   (relative, default empty: the root of the machine's cgroup tree).
//! - v2 when `<root>/cgroup.controllers` exists: a command gets `<root>/<parent>/cmd-<n>`; it is
//!   killed through `cgroup.kill` (or freeze, kill every member, thaw, as a fallback).
//! - v1 otherwise: `<root>/{memory,pids,cpu,cpuacct,freezer}/<parent>/cmd-<n>` for each such
//!   parent directory that exists; killed by freezing, SIGKILLing every member and thawing, until
//!   the group is empty.
//! - none usable: commands are killed by process group only (a `setsid` escapes that; the agent
//!   says so once on stderr).
//!
//! On v2 the child starts in its cgroup: it is cloned there (`clone3` with
//! `CLONE_INTO_CGROUP`, so nothing moves it and no move waits on the kernel's cgroup lock).
//! Where clone3 is refused (in a jail, whose seccomp policy answers it ENOSYS; kernels
//! before 5.7) and on v1, the child joins its cgroups itself, between fork and exec, by
//! writing "0" to `cgroup.procs` files the parent opened beforehand (see `sys::spawn`).
//! This room owns no policy about *when* to kill; `exec` decides that.
//!
//! A command runs as the agent's user, so whatever the agent may do to cgroups it may do
//! too. In a jail the host keeps the files that lead out of the commands' cgroups (the
//! agent's own cgroup's `cgroup.procs`: see the runtime's `cgroup` room), but a command can
//! still create a cgroup of its own beside the commands' (or below its own) and move there.
//! So a command's cgroup is killed with everything below it, and when any command ends,
//! every cgroup under the parent that is not a live command's nor the agent's own (a
//! *stray*) is killed and removed too ([`Cgroups::kill_strays`]). In a microVM the guest's
//! root owns the whole kernel and may run its own cgroup managers: no sweep there.
//!
//! **Reuse.** A command cgroup that ends empty, with no cgroup below it, is kept (up to
//! [`IDLE_MAX`]) for a later command instead of removed. Removing a memory cgroup is what
//! costs: the kernel then reparents the cgroup's entries in every list_lru of the host (two
//! per mounted filesystem, and every machine mounts several), under the global cgroup
//! mutex, so a command's end used to cost in proportion to the machines on the host. A
//! kept cgroup is handed out again only while it is still empty and every file a command
//! could have written to change how a later one runs (its limits, weights, freezing) reads
//! as it did when the cgroup was made ([`Knobs`]); otherwise it is killed and removed like
//! a stray, and a new one is made. Its counters are re-based when it is reused: CPU time
//! and the peak are measured from the reuse (v1: `memory.max_usage_in_bytes` reset; v2:
//! `memory.peak` reset through a descriptor kept for the command, Linux 6.12 and later:
//! without that, v2 cgroups are not reused), and the peak is what the command added to
//! what the cgroup held when it started (page cache an earlier command left charged to
//! it), as a new cgroup measures nothing charged elsewhere before it. A cgroup killed
//! through `cgroup.kill` (a timeout, a closed stream) is removed, not kept: on recent
//! kernels a child cloned into it afterwards is killed at birth (see
//! `CmdCgroup::kill_written`). Idle cgroups are still the agent's: a process a command
//! moves into one is killed at the next sweep.

use std::collections::HashSet;
use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Resource use read from cgroup files; `None` where a file is missing.
#[derive(Debug, Default, Clone, Copy)]
pub struct Measured {
    pub cpu_ms: Option<u64>,
    pub peak_memory_bytes: Option<u64>,
}

const V1_CONTROLLERS: [&str; 5] = ["memory", "pids", "cpu", "cpuacct", "freezer"];

/// Where commands' cgroups go.
#[derive(Debug)]
pub enum Layout {
    V2 {
        parent: PathBuf,
    },
    /// (controller, `<root>/<controller>/<parent>`) for each usable controller.
    V1 {
        parents: Vec<(&'static str, PathBuf)>,
    },
    None,
}

/// How many ended command cgroups are kept for later commands.
pub const IDLE_MAX: usize = 4;

/// What the agent's cgroups and the commands' share.
#[derive(Debug, Default)]
struct Shared {
    /// The names of the command cgroups that exist on purpose (under every parent): the
    /// running commands' and the idle ones.
    live: Mutex<HashSet<String>>,
    /// Ended empty and kept for a later command; the most recent last.
    idle: Mutex<Vec<Idle>>,
    /// Set once a kept cgroup's peak could not be reset (cgroup v2 before Linux 6.12):
    /// from then on, cgroups are removed when their command ends.
    no_reuse: AtomicBool,
}

/// A command cgroup between two commands.
#[derive(Debug)]
struct Idle {
    name: String,
    dirs: Vec<(&'static str, PathBuf)>,
    knobs: Knobs,
}

/// The files of a command cgroup a command could write to change how a later command in it
/// runs (limits, weights, freezing), each with its first line as read when the cgroup was
/// made. The accounting files are not among them: they are re-based on reuse.
type Knobs = Vec<(PathBuf, String)>;

const V1_KNOBS: [&str; 12] = [
    "memory.limit_in_bytes",
    "memory.soft_limit_in_bytes",
    "memory.memsw.limit_in_bytes",
    "memory.swappiness",
    "memory.oom_control",
    "memory.move_charge_at_immigrate",
    "pids.max",
    "cpu.shares",
    "cpu.cfs_quota_us",
    "cpu.cfs_period_us",
    "freezer.state",
    "notify_on_release",
];

const V2_KNOBS: [&str; 16] = [
    "memory.max",
    "memory.high",
    "memory.low",
    "memory.min",
    "memory.swap.max",
    "memory.swap.high",
    "memory.zswap.max",
    "memory.oom.group",
    "pids.max",
    "cpu.max",
    "cpu.weight",
    "cpu.idle",
    "cgroup.freeze",
    "cgroup.subtree_control",
    "cgroup.max.depth",
    "cgroup.max.descendants",
];

fn first_line(path: &Path) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    Some(text.lines().next().unwrap_or("").to_owned())
}

/// The knobs of a new cgroup, as they read now: on v1 each in its own controller's
/// directory only (`notify_on_release` in the members'), so a create opens no file that
/// cannot be there.
fn read_knobs(dirs: &[(&'static str, PathBuf)], v2: bool) -> Knobs {
    let names: &[&str] = if v2 { &V2_KNOBS } else { &V1_KNOBS };
    let members = members_of(dirs);
    let mut out = Vec::new();
    for (c, d) in dirs {
        for n in names {
            let here = match n.split_once('.') {
                _ if v2 => true,
                // Co-mounted cpu,cpuacct goes by the name "cpuacct".
                Some((ctl, _)) => ctl == *c || (ctl == "cpu" && *c == "cpuacct"),
                None => d == members,
            };
            if !here {
                continue;
            }
            let path = d.join(n);
            if let Some(v) = first_line(&path) {
                out.push((path, v));
            }
        }
    }
    out
}

/// The directory whose tree holds a command's members: the freezer's (v1), else the first
/// (v2: the only one). See [`CmdCgroup::pids`].
fn members_of<'a>(dirs: &'a [(&'static str, PathBuf)]) -> &'a Path {
    dirs.iter()
        .find(|(c, _)| *c == "freezer")
        .unwrap_or(&dirs[0])
        .1
        .as_path()
}

/// Whether no process is in the cgroup `dir` or below it.
fn tree_empty(dir: &Path) -> bool {
    let mut pids = Vec::new();
    tree_pids(dir, &mut pids);
    pids.is_empty()
}

/// Whether every knob still reads as it did when the cgroup was made.
fn knobs_unchanged(knobs: &Knobs) -> bool {
    knobs
        .iter()
        .all(|(path, was)| first_line(path).as_deref() == Some(was.as_str()))
}

/// The agent's cgroup layout plus a counter for naming command cgroups.
#[derive(Debug)]
pub struct Cgroups {
    pub layout: Layout,
    next: AtomicU64,
    warned: AtomicBool,
    shared: Arc<Shared>,
    /// The agent's own cgroup when it is a child of the parent (v2: `init`): never a stray.
    own: Option<String>,
    /// Whether strays are killed (in a jail; not in a microVM).
    sweep: bool,
}

impl Cgroups {
    /// Detects the layout from `$LOCKER_CGROUP_ROOT` and `$LOCKER_CGROUP_PARENT`; `sweep`
    /// says whether cgroups nobody made on purpose are killed when a command ends.
    pub fn detect(root: &Path, parent: &str, sweep: bool) -> Cgroups {
        let parent = parent.trim_matches('/');
        let layout = if root.join("cgroup.controllers").exists() {
            let dir = root.join(parent);
            if dir.is_dir() {
                // Let children account memory, cpu and pids; this fails harmlessly where the
                // parent holds processes itself or the controllers are already on.
                if let Ok(mut f) = fs::OpenOptions::new()
                    .write(true)
                    .open(dir.join("cgroup.subtree_control"))
                {
                    for c in ["+memory", "+cpu", "+pids"] {
                        let _ = f.write_all(c.as_bytes());
                    }
                }
                Layout::V2 { parent: dir }
            } else {
                Layout::None
            }
        } else {
            let mut parents: Vec<(&'static str, PathBuf)> = Vec::new();
            let mut seen: Vec<PathBuf> = Vec::new();
            for c in V1_CONTROLLERS {
                let dir = root.join(c).join(parent);
                // Co-mounted controllers (cpu,cpuacct) reach one directory by two names.
                let Ok(real) = fs::canonicalize(&dir) else {
                    continue;
                };
                if !real.is_dir() || !real.join("cgroup.procs").exists() {
                    continue;
                }
                if !seen.contains(&real) {
                    seen.push(real.clone());
                    parents.push((c, real));
                } else if let Some(p) = parents.iter_mut().find(|(_, d)| *d == real) {
                    // Prefer the name the accounting files are looked up by.
                    if c == "cpuacct" {
                        p.0 = "cpuacct";
                    }
                }
            }
            if parents.is_empty() {
                Layout::None
            } else {
                Layout::V1 { parents }
            }
        };
        if matches!(layout, Layout::None) {
            eprintln!(
                "locker-agent: no usable cgroups under {} (parent {parent:?}): commands are killed by \
                 process group only, and a child that calls setsid can outlive a timeout",
                root.display()
            );
        }
        let own = match layout {
            Layout::V2 { .. } => own_cgroup_name(parent),
            // v1: the agent lives in the parent itself.
            _ => None,
        };
        Cgroups {
            layout,
            next: AtomicU64::new(1),
            warned: AtomicBool::new(false),
            shared: Arc::default(),
            own,
            sweep,
        }
    }

    fn parents(&self) -> Vec<(&'static str, PathBuf)> {
        match &self.layout {
            Layout::None => Vec::new(),
            Layout::V2 { parent } => vec![("", parent.clone())],
            Layout::V1 { parents } => parents.clone(),
        }
    }

    /// Kills and removes every stray cgroup under the parent: one that is neither a live
    /// command's nor the agent's own (a command made it to leave its own). Strays are found
    /// in the members' hierarchy alone (v1: the freezer's; see [`CmdCgroup::pids`] for why
    /// one is enough), then removed from every hierarchy that has one of that name: one
    /// `getdents` when there is none. Empty cgroups a command made in the other hierarchies
    /// only hold nothing and go with the machine. An idle command cgroup that holds
    /// processes (a command moved them there) is a stray too.
    pub fn kill_strays(&self) {
        if !self.sweep {
            return;
        }
        let occupied: Vec<Idle> = {
            let mut idle = lock(&self.shared.idle);
            let (bad, good) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|i| !tree_empty(members_of(&i.dirs)));
            *idle = good;
            bad
        };
        for i in occupied {
            let cg = self.handle(i.name, i.dirs, i.knobs);
            cg.kill_all();
            cg.remove();
        }
        let parents = self.parents();
        if parents.is_empty() {
            return;
        }
        let members = members_of(&parents);
        let mut strays: Vec<(String, Vec<(&'static str, PathBuf)>)> = Vec::new();
        {
            let live = lock(&self.shared.live);
            let Ok(rd) = fs::read_dir(members) else {
                return;
            };
            for e in rd.flatten() {
                if !e.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                let name = e.file_name().to_string_lossy().into_owned();
                if live.contains(&name) || self.own.as_deref() == Some(name.as_str()) {
                    continue;
                }
                let dirs = parents
                    .iter()
                    .map(|(c, p)| (*c, p.join(&name)))
                    .filter(|(_, d)| d.is_dir())
                    .collect();
                strays.push((name, dirs));
            }
        }
        for (name, dirs) in strays {
            let cg = self.handle(name, dirs, Knobs::new());
            cg.kill_all();
            cg.remove();
        }
    }

    /// A handle on existing command cgroup directories, not yet re-based or joinable.
    fn handle(&self, name: String, dirs: Vec<(&'static str, PathBuf)>, knobs: Knobs) -> CmdCgroup {
        CmdCgroup {
            dirs,
            procs: Vec::new(),
            dir_fd: None,
            kill_written: AtomicBool::new(false),
            v2: matches!(self.layout, Layout::V2 { .. }),
            name,
            shared: self.shared.clone(),
            knobs,
            base: Base::default(),
            peak: None,
            gone: Mutex::new(false),
        }
    }

    /// The cgroup(s) of one command: an idle one reused where there is one fit for it,
    /// else new ones. `None` when cgroups are not usable.
    pub fn create(&self) -> Option<CmdCgroup> {
        if let Some(cg) = self.reuse() {
            return Some(cg);
        }
        let parents = self.parents();
        if parents.is_empty() {
            return None;
        }
        // Held while the directories appear, so a sweep never takes them for strays.
        let mut live = lock(&self.shared.live);
        for _ in 0..1000 {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            let name = format!("cmd-{n}");
            let mut dirs: Vec<(&'static str, PathBuf)> = Vec::new();
            let mut clash = false;
            for (c, p) in &parents {
                let d = p.join(&name);
                match fs::create_dir(&d) {
                    Ok(()) => dirs.push((c, d)),
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                        // Left over from an earlier agent: pick the next number.
                        clash = true;
                        break;
                    }
                    Err(e) => {
                        if !self.warned.swap(true, Ordering::Relaxed) {
                            eprintln!(
                                "locker-agent: cannot create cgroup {}: {e} (said once)",
                                d.display()
                            );
                        }
                    }
                }
            }
            if clash {
                for (_, d) in &dirs {
                    let _ = fs::remove_dir(d);
                }
                continue;
            }
            if dirs.is_empty() {
                return None;
            }
            live.insert(name.clone());
            let knobs = read_knobs(&dirs, matches!(self.layout, Layout::V2 { .. }));
            let mut cg = self.handle(name, dirs, knobs);
            cg.open_procs();
            return Some(cg);
        }
        None
    }

    /// Makes one command cgroup ahead and keeps it idle, for the first command.
    pub fn prepare(&self) {
        if let Some(cg) = self.create() {
            cg.release();
        }
    }

    /// An idle command cgroup made ready for a new command: still empty, its knobs as they
    /// were, its counters re-based. One that is not fit is killed and removed.
    fn reuse(&self) -> Option<CmdCgroup> {
        if self.shared.no_reuse.load(Ordering::Relaxed) {
            return None;
        }
        loop {
            let i = lock(&self.shared.idle).pop()?;
            let fit = tree_empty(members_of(&i.dirs)) && knobs_unchanged(&i.knobs);
            let mut cg = self.handle(i.name, i.dirs, i.knobs);
            if !fit {
                cg.kill_all();
                cg.remove();
                continue;
            }
            if let Err(e) = cg.rebase() {
                if !self.shared.no_reuse.swap(true, Ordering::Relaxed) {
                    eprintln!(
                        "locker-agent: cannot re-base a kept command cgroup ({e}): every command \
                         gets a new cgroup from now on"
                    );
                }
                cg.remove();
                return None;
            }
            cg.open_procs();
            return Some(cg);
        }
    }

    /// The CPU and peak memory of the parent cgroup (the machine), where readable.
    pub fn parent_usage(&self) -> Measured {
        match &self.layout {
            Layout::None => Measured::default(),
            Layout::V2 { parent } => usage_v2(parent).into(),
            Layout::V1 { parents } => usage_v1(parents).into(),
        }
    }

    /// The parent memory cgroup (the machine's) as `/proc/meminfo` needs it, where readable.
    pub fn memory(&self) -> Option<MemSample> {
        match &self.layout {
            Layout::None => None,
            Layout::V2 { parent } => {
                let max = fs::read_to_string(parent.join("memory.max")).ok()?;
                Some(MemSample {
                    v2: true,
                    limit: max.trim().parse().ok(),
                    usage: read_u64(&parent.join("memory.current"))?,
                    stat: read_stat(&parent.join("memory.stat")),
                })
            }
            Layout::V1 { parents } => {
                let dir = &parents.iter().find(|(c, _)| *c == "memory")?.1;
                let stat = read_stat(&dir.join("memory.stat"));
                // The limit in force is the smallest up the tree; "unlimited" reads as a
                // huge number, left to the caller to cap at the host's memory.
                let limit = stat
                    .iter()
                    .find(|(k, _)| k == "hierarchical_memory_limit")
                    .map(|(_, v)| *v)
                    .or_else(|| read_u64(&dir.join("memory.limit_in_bytes")));
                Some(MemSample {
                    v2: false,
                    limit,
                    usage: read_u64(&dir.join("memory.usage_in_bytes"))?,
                    stat,
                })
            }
        }
    }

    /// The parent memory cgroup's OOM-kill counter.
    pub fn parent_oom_kills(&self) -> u64 {
        match &self.layout {
            Layout::None => 0,
            Layout::V2 { parent } => oom_kills_v2(parent),
            Layout::V1 { parents } => oom_kills_v1(parents),
        }
    }
}

/// A memory cgroup's limit, usage (bytes) and `memory.stat`, as read.
#[derive(Debug, Clone)]
pub struct MemSample {
    pub v2: bool,
    /// `None`: no limit.
    pub limit: Option<u64>,
    pub usage: u64,
    pub stat: Vec<(String, u64)>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemSample {
    /// A `memory.stat` value (bytes), 0 where absent.
    pub fn get(&self, key: &str) -> u64 {
        self.stat
            .iter()
            .find(|(k, _)| k == key)
            .map_or(0, |(_, v)| *v)
    }
}

fn read_stat(path: &Path) -> Vec<(String, u64)> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_owned(), v.trim().parse().ok()?))
        })
        .collect()
}

/// The counters of a reused cgroup when its command started (zero for a new one).
#[derive(Debug, Default, Clone, Copy)]
struct Base {
    cpu_us: u64,
    memory: u64,
}

/// The cgroup(s) of one running command.
#[derive(Debug)]
pub struct CmdCgroup {
    dirs: Vec<(&'static str, PathBuf)>,
    /// Open `cgroup.procs` for the child to join; closed once it has.
    procs: Vec<OwnedFd>,
    /// v2: the cgroup's directory, for a child cloned straight into it; closed with `procs`.
    dir_fd: Option<OwnedFd>,
    /// v2: `cgroup.kill` was written. Such a cgroup is never reused: on Linux 6.18 (seen
    /// here; its `kill_seq` check compares the target's count of kills with the forking
    /// parent's cgroup's) every child later cloned into it with `CLONE_INTO_CGROUP` is
    /// killed at birth.
    kill_written: AtomicBool,
    v2: bool,
    name: String,
    shared: Arc<Shared>,
    knobs: Knobs,
    base: Base,
    /// v2, reused: `memory.peak` opened and reset for this command.
    peak: Option<fs::File>,
    /// Set (under the lock) once the cgroup is removed or handed back for reuse: a late
    /// signal through an old handle must never reach a later command's processes.
    gone: Mutex<bool>,
}

impl CmdCgroup {
    fn open_procs(&mut self) {
        if self.v2 {
            self.dir_fd = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECTORY)
                .open(&self.dirs[0].1)
                .ok()
                .map(OwnedFd::from);
        }
        for (_, d) in &self.dirs {
            match fs::OpenOptions::new()
                .write(true)
                .open(d.join("cgroup.procs"))
            {
                Ok(f) => self.procs.push(OwnedFd::from(f)),
                Err(e) => eprintln!(
                    "locker-agent: cannot open {}/cgroup.procs: {e}",
                    d.display()
                ),
            }
        }
    }

    /// Starts the counters over for a new command in a reused cgroup.
    fn rebase(&mut self) -> io::Result<()> {
        if self.v2 {
            let dir = &self.dirs[0].1;
            let peak = dir.join("memory.peak");
            if peak.exists() {
                let f = fs::OpenOptions::new().read(true).write(true).open(&peak)?;
                // Linux 6.12+: a write resets the peak seen through this descriptor.
                (&f).write_all(b"reset\n")?;
                self.peak = Some(f);
                self.base.memory = read_u64(&dir.join("memory.current")).unwrap_or(0);
            }
            self.base.cpu_us = keyed(&dir.join("cpu.stat"), "usage_usec").unwrap_or(0);
        } else {
            if let Some(d) = self.dir("memory") {
                // Resets the peak to the usage now.
                fs::write(d.join("memory.max_usage_in_bytes"), "0")?;
                self.base.memory = read_u64(&d.join("memory.usage_in_bytes")).unwrap_or(0);
            }
            if let Some(d) = self.dir("cpuacct") {
                self.base.cpu_us = read_u64(&d.join("cpuacct.usage")).unwrap_or(0) / 1000;
            }
        }
        Ok(())
    }

    /// The descriptors the child writes "0" to.
    pub fn procs_fds(&self) -> Vec<RawFd> {
        self.procs.iter().map(|f| f.as_raw_fd()).collect()
    }

    /// v2: the directory a child can be cloned into (`clone3(CLONE_INTO_CGROUP)`).
    pub fn clone_target(&self) -> Option<RawFd> {
        self.dir_fd.as_ref().map(|f| f.as_raw_fd())
    }

    /// Closes the join descriptors (after the spawn).
    pub fn joined(&mut self) {
        self.procs.clear();
        self.dir_fd = None;
    }

    fn dir(&self, controller: &str) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(c, _)| *c == controller)
            .map(|(_, d)| d.as_path())
    }

    /// The directory whose tree holds the members: the freezer's (v1), else the only one.
    fn members_dir(&self) -> &Path {
        members_of(&self.dirs)
    }

    /// The pids in the cgroup and below it now, in the members' hierarchy (v1: the
    /// freezer's). One hierarchy is enough: every process is in exactly one cgroup of it,
    /// so a member that moved itself elsewhere in another hierarchy is still found here,
    /// and one that moved out of this one is in a stray cgroup of it
    /// ([`Cgroups::kill_strays`] looks there). Reading one hierarchy instead of each keeps
    /// the end of every command cheap.
    pub fn pids(&self) -> Vec<i32> {
        let mut out = Vec::new();
        tree_pids(self.members_dir(), &mut out);
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Sends `sig` to every member.
    pub fn signal_all(&self, sig: i32) {
        let gone = lock(&self.gone);
        if *gone {
            return;
        }
        for pid in self.pids() {
            let _ = crate::sys::kill(pid, sig);
        }
    }

    /// Kills every process in the cgroup and waits (up to a few seconds) until it is empty.
    /// Returns whether it is empty.
    pub fn kill_all(&self) -> bool {
        let gone = lock(&self.gone);
        if *gone {
            return true;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        if self.v2 {
            let dir = &self.dirs[0].1;
            if fs::write(dir.join("cgroup.kill"), "1").is_ok() {
                self.kill_written.store(true, Ordering::Relaxed);
                if self.wait_empty(deadline) {
                    return true;
                }
            }
        }
        let freezer = if self.v2 {
            Some(self.dirs[0].1.as_path())
        } else {
            self.dir("freezer")
        };
        loop {
            let members = self.pids();
            if members.is_empty() {
                return true;
            }
            if Instant::now() > deadline {
                eprintln!(
                    "locker-agent: cgroup {} still has {} processes",
                    self.members_dir().display(),
                    members.len()
                );
                return false;
            }
            let frozen = freezer.map(|f| self.freeze(f, true)).unwrap_or(false);
            for pid in self.pids() {
                let _ = crate::sys::kill(pid, libc::SIGKILL);
            }
            if let Some(f) = freezer {
                self.freeze(f, false);
            }
            if !frozen || !self.pids().is_empty() {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// Freezes (or thaws) the group; true once the state is reached.
    fn freeze(&self, dir: &Path, on: bool) -> bool {
        let (file, value, want) = if self.v2 {
            ("cgroup.freeze", if on { "1" } else { "0" }, None)
        } else {
            (
                "freezer.state",
                if on { "FROZEN" } else { "THAWED" },
                Some(if on { "FROZEN" } else { "THAWED" }),
            )
        };
        if fs::write(dir.join(file), value).is_err() {
            return false;
        }
        let Some(want) = want else { return true };
        // v1 passes through FREEZING; wait (briefly) for the final state.
        for _ in 0..200 {
            match fs::read_to_string(dir.join(file)) {
                Ok(s) if s.trim() == want => return true,
                Ok(_) => std::thread::sleep(Duration::from_millis(1)),
                Err(_) => return false,
            }
        }
        false
    }

    /// What the command used, where the accounting files are readable: since the cgroup was
    /// made or (reused) since the command started.
    pub fn usage(&self) -> Measured {
        let mut m = if self.v2 {
            usage_v2(&self.dirs[0].1)
        } else {
            usage_v1(&self.dirs)
        };
        if let Some(f) = &self.peak {
            let mut buf = [0u8; 32];
            m.peak_memory_bytes = f
                .read_at(&mut buf, 0)
                .ok()
                .and_then(|n| std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok());
        }
        Measured {
            cpu_ms: m
                .cpu_us
                .map(|us| us.saturating_sub(self.base.cpu_us) / 1000),
            peak_memory_bytes: m
                .peak_memory_bytes
                .map(|b| b.saturating_sub(self.base.memory)),
        }
    }

    /// The command's own memory cgroup OOM-kill counter.
    pub fn oom_kills(&self) -> u64 {
        if self.v2 {
            oom_kills_v2(&self.dirs[0].1)
        } else {
            oom_kills_v1(&self.dirs)
        }
    }

    fn wait_empty(&self, deadline: Instant) -> bool {
        loop {
            if self.pids().is_empty() {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Hands the cgroup back once its command (and every job of it) has ended: kept for a
    /// later command when it is empty with no cgroup below it and there is room among the
    /// idle ones, else removed.
    pub fn release(&self) {
        let mut gone = lock(&self.gone);
        if *gone {
            return;
        }
        let keep = !self.shared.no_reuse.load(Ordering::Relaxed)
            && !self.kill_written.load(Ordering::Relaxed)
            && lock(&self.shared.idle).len() < IDLE_MAX
            && read_pids(self.members_dir()).is_empty()
            && self.dirs.iter().all(|(_, d)| no_subdirs(d));
        if !keep {
            drop(gone);
            return self.remove();
        }
        *gone = true;
        let mut idle = lock(&self.shared.idle);
        if idle.len() < IDLE_MAX {
            idle.push(Idle {
                name: self.name.clone(),
                dirs: self.dirs.clone(),
                knobs: self.knobs.clone(),
            });
            return;
        }
        drop(idle);
        self.remove_dirs();
    }

    /// Removes the (empty) cgroups, and any a command made below them. The name is free
    /// again afterwards: what could not be removed is a stray for the next sweep.
    pub fn remove(&self) {
        *lock(&self.gone) = true;
        self.remove_dirs();
    }

    fn remove_dirs(&self) {
        for (_, d) in &self.dirs {
            remove_tree(d);
        }
        lock(&self.shared.live).remove(&self.name);
    }
}

/// Whether a cgroup directory has no cgroup below it.
fn no_subdirs(dir: &Path) -> bool {
    fs::read_dir(dir).is_ok_and(|rd| {
        !rd.flatten()
            .any(|e| e.file_type().is_ok_and(|t| t.is_dir()))
    })
}

/// rmdir a cgroup and the cgroups below it, bottom-up.
fn remove_tree(dir: &Path) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    let mut tries = 0;
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => break,
            Err(e) if e.kind() == io::ErrorKind::NotFound => break,
            // The last members may still be on their way out.
            Err(_) if tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                eprintln!("locker-agent: cannot remove cgroup {}: {e}", dir.display());
                break;
            }
        }
    }
}

/// The pids in `dir` and every cgroup below it.
fn tree_pids(dir: &Path, out: &mut Vec<i32>) {
    out.extend(read_pids(dir));
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                tree_pids(&e.path(), out);
            }
        }
    }
}

/// The name of the agent's own v2 cgroup if it is a child of the parent (a jail's `init`),
/// read from `/proc/self/cgroup`, whose paths are relative to the machine's cgroup
/// namespace (rooted where the cgroup root is).
fn own_cgroup_name(parent: &str) -> Option<String> {
    let text = fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let path = path.trim().trim_start_matches('/');
    let rest = if parent.is_empty() {
        path
    } else {
        path.strip_prefix(parent)?.strip_prefix('/')?
    };
    (!rest.is_empty() && !rest.contains('/')).then(|| rest.to_owned())
}

fn read_pids(dir: &Path) -> Vec<i32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn read_u64(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn keyed(path: &Path, key: &str) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key))
            .then(|| it.next()?.parse().ok())
            .flatten()
    })
}

/// A cgroup's counters as read: CPU in microseconds, the memory peak in bytes.
struct Counters {
    cpu_us: Option<u64>,
    peak_memory_bytes: Option<u64>,
}

impl From<Counters> for Measured {
    fn from(c: Counters) -> Measured {
        Measured {
            cpu_ms: c.cpu_us.map(|us| us / 1000),
            peak_memory_bytes: c.peak_memory_bytes,
        }
    }
}

fn usage_v2(dir: &Path) -> Counters {
    Counters {
        cpu_us: keyed(&dir.join("cpu.stat"), "usage_usec"),
        // memory.peak is new (Linux 5.19) and absent where the memory controller is off.
        peak_memory_bytes: read_u64(&dir.join("memory.peak")),
    }
}

fn usage_v1(dirs: &[(&'static str, PathBuf)]) -> Counters {
    let find = |c: &str| dirs.iter().find(|(n, _)| *n == c).map(|(_, d)| d);
    Counters {
        cpu_us: find("cpuacct")
            .and_then(|d| read_u64(&d.join("cpuacct.usage")))
            .map(|ns| ns / 1000),
        peak_memory_bytes: find("memory")
            .and_then(|d| read_u64(&d.join("memory.max_usage_in_bytes"))),
    }
}

fn oom_kills_v2(dir: &Path) -> u64 {
    keyed(&dir.join("memory.events"), "oom_kill").unwrap_or(0)
}

fn oom_kills_v1(dirs: &[(&'static str, PathBuf)]) -> u64 {
    dirs.iter()
        .find(|(c, _)| *c == "memory")
        .and_then(|(_, d)| keyed(&d.join("memory.oom_control"), "oom_kill"))
        .unwrap_or(0)
}
