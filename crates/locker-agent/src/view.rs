//! What a jail's commands see of its resources: its CPUs and its `/proc/meminfo`.
//!
//! CPUs: the shim names the machine's CPUs in `LOCKER_CPUS` (see the runtime's `view` room,
//! which also binds a matching `/sys/devices/system/cpu/online`); every command is pinned
//! to them between fork and exec (`sys::child_setup`), so `nproc` and
//! `os.sched_getaffinity` say the machine's size. The agent itself is not pinned: its own
//! threads run wherever the host has room, and a command that changes the agent's
//! affinity (same uid) changes nothing for later commands.
//!
//! Memory: `free`, `top`, JVMs and Python's `psutil` read MemTotal as the machine's limit
//! and used as what its cgroup is charged. The shim binds a file of its own, read-only,
//! over `/proc/meminfo` and hands the agent the only write descriptor (`LOCKER_VIEW_FD`).
//! This room rewrites it from the machine's memory cgroup: once before the agent serves
//! anything, when a command starts (unless it was rewritten in the last [`FRESH`]), and
//! every [`PERIOD`] while any command runs (an idle machine costs nothing). A microVM's
//! guest has a kernel of its own whose `/proc` is already right: no view there.
//!
//! The file keeps one length for a given limit (every value is padded to the width of
//! MemTotal and none exceeds it), so a rewrite is one `pwrite` at offset 0 and a reader
//! never sees a truncated file. This room owns the file's contents only; reading the
//! cgroup is `cgroup`'s.

use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::cgroup::MemSample;
use crate::{sys, Agent};

/// How stale the view may get while commands run.
pub const PERIOD: Duration = Duration::from_millis(200);
/// A view at most this old is fresh enough for a command that starts now: back-to-back
/// commands cost at most one rewrite per this long.
pub const FRESH: Duration = Duration::from_millis(10);

/// The CPUs the shim named in `LOCKER_CPUS`, if any.
pub fn cpus_from_env() -> Option<sys::CpuSet> {
    let list = std::env::var("LOCKER_CPUS").ok()?;
    let set = sys::CpuSet::parse(&list);
    if set.is_none() {
        eprintln!("locker-agent: LOCKER_CPUS={list:?} is not a CPU list: commands are not pinned");
    }
    set
}

/// The writer of the machine's `/proc/meminfo`.
pub struct View {
    file: File,
    /// The bytes last written (rewrites that change nothing are skipped).
    last: Mutex<Vec<u8>>,
    wake: Mutex<Wake>,
    cv: Condvar,
}

struct Wake {
    kicked: bool,
    /// Commands (and background processes) running now.
    active: usize,
    /// When the refresher last started a rewrite.
    refreshed: Instant,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl View {
    /// The view the jail handed over in `LOCKER_VIEW_FD`, if any.
    pub fn from_env() -> Option<Arc<View>> {
        let fd: i32 = std::env::var("LOCKER_VIEW_FD").ok()?.parse().ok()?;
        if let Err(e) = sys::set_cloexec(fd) {
            eprintln!("locker-agent: LOCKER_VIEW_FD={fd} is not usable: {e}");
            return None;
        }
        // SAFETY: the jail's init handed this descriptor over for exactly this purpose and
        // nothing else in the agent owns it.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        Some(Arc::new(View {
            file,
            last: Mutex::new(Vec::new()),
            wake: Mutex::new(Wake {
                kicked: false,
                active: 0,
                refreshed: Instant::now(),
            }),
            cv: Condvar::new(),
        }))
    }

    /// Rewrites the file from the machine's cgroup now.
    pub fn refresh(&self, agent: &Agent) {
        let text = match agent.cgroups.memory() {
            Some(s) => render(&s, sys::host_memory().map(|m| m.0)),
            None => render_host(),
        };
        let mut last = lock(&self.last);
        if *last == text.as_bytes() {
            return;
        }
        let shorter = text.len() < last.len();
        let written = self.file.write_at(text.as_bytes(), 0).and_then(|n| {
            if n == text.len() {
                Ok(())
            } else {
                Err(std::io::ErrorKind::WriteZero.into())
            }
        });
        let written = written.and_then(|()| {
            if shorter {
                self.file.set_len(text.len() as u64)
            } else {
                Ok(())
            }
        });
        match written {
            Ok(()) => *last = text.into_bytes(),
            Err(e) => {
                eprintln!("locker-agent: cannot update the machine's /proc/meminfo: {e}");
                last.clear();
            }
        }
    }
}

/// Held while a command runs: keeps the view refreshing, and refreshes it when the command
/// starts. When the last command ends the refresher rewrites it once more, a period later,
/// and sleeps.
pub struct Busy(Arc<View>);

impl Busy {
    pub fn new(view: &Arc<View>) -> Busy {
        let mut w = lock(&view.wake);
        w.active += 1;
        if w.active == 1 || w.refreshed.elapsed() >= FRESH {
            w.kicked = true;
            view.cv.notify_one();
        }
        drop(w);
        Busy(view.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut w = lock(&self.0.wake);
        w.active = w.active.saturating_sub(1);
    }
}

/// The refresher thread's body: waits for a kick, or for [`PERIOD`] while commands run.
pub fn serve(agent: Arc<Agent>) {
    let Some(view) = agent.view.clone() else {
        return;
    };
    let mut w = lock(&view.wake);
    loop {
        if !w.kicked {
            w = if w.active > 0 {
                view.cv
                    .wait_timeout(w, PERIOD)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            } else {
                view.cv.wait(w).unwrap_or_else(|e| e.into_inner())
            };
        }
        w.kicked = false;
        w.refreshed = Instant::now();
        drop(w);
        view.refresh(&agent);
        w = lock(&view.wake);
    }
}

/// `/proc/meminfo` for a machine whose memory cgroup reads `s`, on a host with
/// `host_total` bytes of memory: MemTotal is the limit (or the host's memory, if smaller),
/// used is what the cgroup is charged, and what the kernel could reclaim (file pages,
/// reclaimable slab) counts as available.
pub fn render(s: &MemSample, host_total: Option<u64>) -> String {
    let total = match (s.limit, host_total) {
        (Some(l), Some(h)) => l.min(h),
        (Some(l), None) => l,
        (None, Some(h)) => h,
        (None, None) => s.usage,
    };
    let total_kb = total / 1024;
    let kb = |b: u64| (b / 1024).min(total_kb);
    let g = |v1: &str, v2: &str| kb(s.get(if s.v2 { v2 } else { v1 }));
    let used = kb(s.usage);
    let free = total_kb - used;
    let active_file = g("total_active_file", "active_file");
    let inactive_file = g("total_inactive_file", "inactive_file");
    let active_anon = g("total_active_anon", "active_anon");
    let inactive_anon = g("total_inactive_anon", "inactive_anon");
    let sreclaimable = g("", "slab_reclaimable");
    let sunreclaim = g("", "slab_unreclaimable");
    let available = (free + active_file + inactive_file + sreclaimable).min(total_kb);
    let rows: [(&str, u64); 29] = [
        ("MemTotal", total_kb),
        ("MemFree", free),
        ("MemAvailable", available),
        ("Buffers", 0),
        ("Cached", g("total_cache", "file")),
        ("SwapCached", 0),
        ("Active", (active_anon + active_file).min(total_kb)),
        ("Inactive", (inactive_anon + inactive_file).min(total_kb)),
        ("Active(anon)", active_anon),
        ("Inactive(anon)", inactive_anon),
        ("Active(file)", active_file),
        ("Inactive(file)", inactive_file),
        ("Unevictable", g("total_unevictable", "unevictable")),
        ("Mlocked", 0),
        ("SwapTotal", 0),
        ("SwapFree", 0),
        ("Dirty", g("total_dirty", "file_dirty")),
        ("Writeback", g("total_writeback", "file_writeback")),
        ("AnonPages", g("total_rss", "anon")),
        ("Mapped", g("total_mapped_file", "file_mapped")),
        ("Shmem", g("total_shmem", "shmem")),
        ("KReclaimable", sreclaimable),
        ("Slab", (sreclaimable + sunreclaim).min(total_kb)),
        ("SReclaimable", sreclaimable),
        ("SUnreclaim", sunreclaim),
        ("KernelStack", g("", "kernel_stack")),
        ("PageTables", g("", "pagetables")),
        ("CommitLimit", total_kb),
        ("Committed_AS", used),
    ];
    format_rows(&rows, total_kb)
}

/// The kernel's layout: the name and colon in 16 columns, the value right-aligned in at
/// least 8 (here: the width of MemTotal, so the file keeps one length), then " kB".
fn format_rows(rows: &[(&str, u64)], total_kb: u64) -> String {
    let width = total_kb.to_string().len().max(8);
    let mut out = String::with_capacity(rows.len() * (20 + width) + 160);
    for (name, v) in rows {
        out.push_str(&format!("{:<16}{v:>width$} kB\n", format!("{name}:")));
    }
    for name in [
        "HugePages_Total",
        "HugePages_Free",
        "HugePages_Rsvd",
        "HugePages_Surp",
    ] {
        out.push_str(&format!("{:<16}{:>8}\n", format!("{name}:"), 0));
    }
    out.push_str(&format!("{:<16}{:>8} kB\n", "Hugepagesize:", 2048));
    out
}

/// What is written when the machine's memory cgroup cannot be read: the kernel's own
/// totals, so the file at least parses.
fn render_host() -> String {
    let (total, free) = sys::host_memory().unwrap_or((0, 0));
    let (total_kb, free_kb) = (total / 1024, (free / 1024).min(total / 1024));
    format_rows(
        &[
            ("MemTotal", total_kb),
            ("MemFree", free_kb),
            ("MemAvailable", free_kb),
        ],
        total_kb,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(v2: bool, usage: u64, stat: &[(&str, u64)]) -> MemSample {
        MemSample {
            v2,
            limit: Some(512 << 20),
            usage,
            stat: stat.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        }
    }

    fn field(text: &str, key: &str) -> u64 {
        text.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k == key).then(|| v.split_whitespace().next()?.parse().ok())?
            })
            .unwrap()
    }

    #[test]
    fn the_limit_is_the_total_and_reclaimable_pages_are_available() {
        for v2 in [false, true] {
            let (file, active_file) = if v2 {
                ("file", "active_file")
            } else {
                ("total_cache", "total_active_file")
            };
            let s = sample(v2, 300 << 20, &[(file, 100 << 20), (active_file, 80 << 20)]);
            let t = render(&s, Some(8 << 30));
            assert_eq!(field(&t, "MemTotal"), 512 * 1024);
            assert_eq!(field(&t, "MemFree"), 212 * 1024);
            assert_eq!(field(&t, "MemAvailable"), 292 * 1024);
            assert_eq!(field(&t, "Cached"), 100 * 1024);
            assert!(t.starts_with("MemTotal:         524288 kB\n"), "{t}");
        }
    }

    #[test]
    fn a_limit_above_the_hosts_memory_shows_the_hosts() {
        let mut s = sample(true, 1 << 20, &[]);
        s.limit = None;
        assert_eq!(
            field(&render(&s, Some(2 << 30)), "MemTotal"),
            2 * 1024 * 1024
        );
        s.limit = Some(64 << 30);
        assert_eq!(
            field(&render(&s, Some(2 << 30)), "MemTotal"),
            2 * 1024 * 1024
        );
    }

    #[test]
    fn cpu_lists_from_the_shim_parse_like_the_kernels() {
        assert_eq!(sys::CpuSet::parse("1").map(|s| s.count()), Some(1));
        assert_eq!(sys::CpuSet::parse("0-3,6\n").map(|s| s.count()), Some(5));
        for bad in ["", "3-1", "a", "0,", "-1", "100000"] {
            assert!(sys::CpuSet::parse(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn the_file_keeps_one_length_whatever_the_use() {
        let idle = render(&sample(false, 0, &[]), None);
        let full = render(
            &sample(
                false,
                600 << 20,
                &[("total_cache", 900 << 20), ("total_rss", 1 << 40)],
            ),
            None,
        );
        assert_eq!(idle.len(), full.len());
        assert_eq!(field(&full, "MemFree"), 0);
        assert_eq!(field(&full, "AnonPages"), 512 * 1024);
    }
}
