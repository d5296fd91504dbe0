//! What machine the numbers came from (name, date, CPUs, memory, kernel) and how busy it
//! was with other work while they were taken.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A description of this host, printed with the results.
pub struct Info {
    pub hostname: String,
    /// `YYYY-MM-DD` (UTC).
    pub date: String,
    pub nproc: usize,
    pub mem_gib: f64,
    pub kernel: String,
    pub cpu: String,
    pub load: String,
    /// The workspace's commit, `+dirty` when tracked files differ from it.
    pub commit: String,
    /// How long since the host booted: a fresh boot is what a new user's host is.
    pub uptime: String,
    /// The cgroup version and how moves into cgroups fare (`favored`: some hierarchy is
    /// mounted with `favordynmods`; `default`: the first move after a quiet spell waits an
    /// RCU grace period, as on a freshly booted host).
    pub cgroup: String,
}

fn commit() -> String {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(c) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{c}+dirty")
            } else {
                c
            }
        }
        None => "unknown commit".into(),
    }
}

fn read(p: &str) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The civil date of a count of days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

impl Info {
    pub fn collect() -> Info {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0) as i64;
        let (y, m, d) = civil(secs.div_euclid(86_400));
        let mem_kib: f64 = read("/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        let cpu = read("/proc/cpuinfo")
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .and_then(|v| v.split_once(':'))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let hostname = read("/proc/sys/kernel/hostname");
        Info {
            hostname: if hostname.is_empty() {
                "unknown-host".into()
            } else {
                hostname.replace('/', "_")
            },
            date: format!("{y:04}-{m:02}-{d:02}"),
            nproc: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            mem_gib: mem_kib / 1024.0 / 1024.0,
            kernel: read("/proc/sys/kernel/osrelease"),
            cpu,
            commit: commit(),
            uptime: {
                let s: f64 = read("/proc/uptime")
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0.0);
                format!("up {:.0} min", s / 60.0)
            },
            cgroup: {
                let v = match locker_runtime::cgroup::Layout::host() {
                    Ok(l) => format!("{:?}", l.version).to_lowercase(),
                    Err(_) => "none".into(),
                };
                let moves = match locker_runtime::cgroup::move_mode() {
                    locker_runtime::cgroup::MoveMode::Favored(_) => "moves favored (favordynmods)",
                    locker_runtime::cgroup::MoveMode::Default(_) => {
                        "moves on the default path (as a fresh boot)"
                    }
                };
                format!("cgroup {v}, {moves}, {}", dying_memcgs())
            },
            load: read("/proc/loadavg")
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "host {} | {} | nproc {} | {:.1} GiB RAM | kernel {} | {} | load {} | {} | {} | {}",
            self.hostname,
            self.date,
            self.nproc,
            self.mem_gib,
            self.kernel,
            self.cpu,
            self.load,
            self.uptime,
            self.cgroup,
            self.commit
        )
    }
}

/// How many memory cgroups the kernel holds that no directory names any more ("dying":
/// removed, still pinned by page cache charged to them). Every machine a host ran can leave
/// one, and a walk of the memory controller's tree visits them all, so a host that has run
/// many machines measures differently from a fresh one (docs/benchmarks.md).
fn dying_memcgs() -> String {
    fn count_dirs(dir: &std::path::Path) -> u64 {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return 0;
        };
        1 + rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| count_dirs(&e.path()))
            .sum::<u64>()
    }
    let total: Option<u64> = read("/proc/cgroups").lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.first() == Some(&"memory")).then(|| f.get(2)?.parse().ok())?
    });
    let Some(total) = total else {
        return "memory cgroups unknown".into();
    };
    // v1: the memory hierarchy's own mount; v2: the unified tree.
    let root = ["/sys/fs/cgroup/memory", "/sys/fs/cgroup"]
        .into_iter()
        .map(std::path::Path::new)
        .find(|p| p.join("memory.stat").exists() || p.join("cgroup.controllers").exists());
    match root {
        Some(r) => {
            let live = count_dirs(r);
            format!(
                "{total} memory cgroups ({} dying)",
                total.saturating_sub(live)
            )
        }
        None => format!("{total} memory cgroups"),
    }
}

/// A field of `/proc/meminfo` in KiB (0 if unreadable).
pub fn meminfo_kib(field: &str) -> u64 {
    read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// CPU time of the whole host and of this process tree, to tell later how much of the
/// host's CPU went to other work during the run.
pub struct CpuMark {
    at: Instant,
    /// (busy, total) jiffies of all CPUs from `/proc/stat`.
    host: (u64, u64),
    /// User + system seconds of this process and its waited-for descendants.
    own: f64,
}

fn host_jiffies() -> (u64, u64) {
    let stat = read("/proc/stat");
    let v: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    // idle and iowait are not busy.
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

/// The host's busy CPU time so far, all CPUs together, in ms (from `/proc/stat`; its
/// resolution is a clock tick, 10 ms: take differences over many operations).
pub fn host_busy_ms() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    host_jiffies().0 as f64 * 1000.0 / hz
}

fn own_cpu_s() -> f64 {
    let mut t = 0.0;
    for who in [libc::RUSAGE_SELF, libc::RUSAGE_CHILDREN] {
        // SAFETY: getrusage fills the zeroed struct we own.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::getrusage(who, &mut ru) } == 0 {
            for tv in [ru.ru_utime, ru.ru_stime] {
                t += tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
            }
        }
    }
    t
}

impl CpuMark {
    pub fn now() -> CpuMark {
        CpuMark {
            at: Instant::now(),
            host: host_jiffies(),
            own: own_cpu_s(),
        }
    }

    /// (host CPU busy %, this run's share %) since the mark, both of all CPUs. The run's
    /// share counts machines and servers it started once they were reaped; work inside
    /// machines still running is counted on the host side only.
    pub fn since(&self, nproc: usize) -> (f64, f64) {
        let (busy, total) = host_jiffies();
        let d_total = total.saturating_sub(self.host.1).max(1) as f64;
        let host = 100.0 * busy.saturating_sub(self.host.0) as f64 / d_total;
        let wall = self.at.elapsed().as_secs_f64().max(1e-3);
        let own = 100.0 * (own_cpu_s() - self.own) / (wall * nproc.max(1) as f64);
        (host, own.min(host))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn civil_dates() {
        assert_eq!(super::civil(0), (1970, 1, 1));
        assert_eq!(super::civil(19_782), (2024, 2, 29));
        assert_eq!(super::civil(20_422), (2025, 11, 30));
    }
}
