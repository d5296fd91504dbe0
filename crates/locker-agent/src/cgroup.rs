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
//! The child joins its cgroups itself, between fork and exec, by writing "0" to `cgroup.procs`
//! files the parent opened beforehand (see `sys::child_setup`). This room owns no policy about
//! *when* to kill; `exec` decides that.

use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// The agent's cgroup layout plus a counter for naming command cgroups.
#[derive(Debug)]
pub struct Cgroups {
    pub layout: Layout,
    next: AtomicU64,
    warned: AtomicBool,
}

impl Cgroups {
    /// Detects the layout from `$LOCKER_CGROUP_ROOT` and `$LOCKER_CGROUP_PARENT`.
    pub fn detect(root: &Path, parent: &str) -> Cgroups {
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
        Cgroups {
            layout,
            next: AtomicU64::new(1),
            warned: AtomicBool::new(false),
        }
    }

    /// Creates the cgroup(s) of one command. `None` when cgroups are not usable.
    pub fn create(&self) -> Option<CmdCgroup> {
        let parents: Vec<(&'static str, PathBuf)> = match &self.layout {
            Layout::None => return None,
            Layout::V2 { parent } => vec![("", parent.clone())],
            Layout::V1 { parents } => parents.clone(),
        };
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
            let mut procs = Vec::new();
            for (_, d) in &dirs {
                match fs::OpenOptions::new()
                    .write(true)
                    .open(d.join("cgroup.procs"))
                {
                    Ok(f) => procs.push(OwnedFd::from(f)),
                    Err(e) => eprintln!(
                        "locker-agent: cannot open {}/cgroup.procs: {e}",
                        d.display()
                    ),
                }
            }
            let v2 = matches!(self.layout, Layout::V2 { .. });
            let cg = CmdCgroup { dirs, procs, v2 };
            return Some(cg);
        }
        None
    }

    /// The CPU and peak memory of the parent cgroup (the machine), where readable.
    pub fn parent_usage(&self) -> Measured {
        match &self.layout {
            Layout::None => Measured::default(),
            Layout::V2 { parent } => usage_v2(parent),
            Layout::V1 { parents } => usage_v1(parents),
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

/// The cgroup(s) of one running command.
#[derive(Debug)]
pub struct CmdCgroup {
    dirs: Vec<(&'static str, PathBuf)>,
    /// Open `cgroup.procs` for the child to join; closed once it has.
    procs: Vec<OwnedFd>,
    v2: bool,
}

impl CmdCgroup {
    /// The descriptors the child writes "0" to.
    pub fn procs_fds(&self) -> Vec<RawFd> {
        self.procs.iter().map(|f| f.as_raw_fd()).collect()
    }

    /// Closes the join descriptors (after the spawn).
    pub fn joined(&mut self) {
        self.procs.clear();
    }

    fn dir(&self, controller: &str) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(c, _)| *c == controller)
            .map(|(_, d)| d.as_path())
    }

    /// The best directory to list members from: the freezer's (v1), else any.
    fn members_dir(&self) -> &Path {
        self.dir("freezer").unwrap_or(&self.dirs[0].1)
    }

    /// The pids in the cgroup now.
    pub fn pids(&self) -> Vec<i32> {
        read_pids(self.members_dir())
    }

    /// Sends `sig` to every member.
    pub fn signal_all(&self, sig: i32) {
        for pid in self.pids() {
            let _ = crate::sys::kill(pid, sig);
        }
    }

    /// Kills every process in the cgroup and waits (up to a few seconds) until it is empty.
    /// Returns whether it is empty.
    pub fn kill_all(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        if self.v2 {
            let dir = &self.dirs[0].1;
            if fs::write(dir.join("cgroup.kill"), "1").is_ok() && wait_empty(dir, deadline) {
                return true;
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

    /// What the command used, where the accounting files are readable.
    pub fn usage(&self) -> Measured {
        if self.v2 {
            usage_v2(&self.dirs[0].1)
        } else {
            usage_v1(&self.dirs)
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

    /// Removes the (empty) cgroups.
    pub fn remove(&self) {
        for (_, d) in &self.dirs {
            let mut tries = 0;
            loop {
                match fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    // The last members may still be on their way out.
                    Err(_) if tries < 100 => {
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => {
                        eprintln!("locker-agent: cannot remove cgroup {}: {e}", d.display());
                        break;
                    }
                }
            }
        }
    }
}

fn read_pids(dir: &Path) -> Vec<i32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn wait_empty(dir: &Path, deadline: Instant) -> bool {
    loop {
        if read_pids(dir).is_empty() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
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

fn usage_v2(dir: &Path) -> Measured {
    Measured {
        cpu_ms: keyed(&dir.join("cpu.stat"), "usage_usec").map(|us| us / 1000),
        // memory.peak is new (Linux 5.19) and absent where the memory controller is off.
        peak_memory_bytes: read_u64(&dir.join("memory.peak")),
    }
}

fn usage_v1(dirs: &[(&'static str, PathBuf)]) -> Measured {
    let find = |c: &str| dirs.iter().find(|(n, _)| *n == c).map(|(_, d)| d);
    Measured {
        cpu_ms: find("cpuacct")
            .and_then(|d| read_u64(&d.join("cpuacct.usage")))
            .map(|ns| ns / 1_000_000),
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
