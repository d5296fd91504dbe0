//! What a jailed machine sees of its own resources: the shim's side.
//!
//! A jail shares the host's kernel, so `/proc/meminfo`, `/sys/devices/system/cpu/online`
//! and a process's CPU affinity would tell the host's numbers, and `nproc`, `free`,
//! `os.cpu_count()`, JVMs and build tools would size themselves to the host. This room
//! gives each jail a view of its limits instead (see docs/architecture.md, "What a machine
//! sees of its resources"):
//! - CPUs: every command of the machine is pinned (by the agent, between fork and exec; the
//!   shim names the CPUs in `LOCKER_CPUS`) to `ceil(cpus)` of the CPUs the server may use,
//!   placed round-robin host-wide ([`pick_cpus`]), and the machine's
//!   `/sys/devices/system/cpu/online` lists exactly those CPUs. The cgroup's CFS quota stays
//!   the limit; the affinity is what makes the count right.
//! - Memory: `/proc/meminfo` is a file of a small tmpfs private to the machine, bound
//!   read-only over the real one ([`mount`]). The agent rewrites it from the machine's
//!   cgroup through the descriptor this room opens for it; nothing else can write it.
//!
//! It owns the view files and the CPU placement, not the file's contents over time (the
//! agent's `view` room) nor the cgroup limits (see [`crate::cgroup`]).

use std::fs;
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::sys;

/// The host-wide placement cursor: the CPU the next machine starts from.
const CURSOR: &str = "/run/locker/cpu-cursor";

/// Errors setting up a machine's view; each names the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error("the resource view: {step}: {source}")]
    Io {
        step: &'static str,
        source: io::Error,
    },
}

fn step(step: &'static str) -> impl FnOnce(io::Error) -> ViewError {
    move |source| ViewError::Io { step, source }
}

/// The CPUs a machine limited to `cpus` runs on: `ceil(cpus)` of those this process may
/// use, or `None` when that is all of them (no pinning, no view needed). Placement is
/// round-robin over a host-wide cursor, so machines started one after another do not pile
/// up on the same CPUs (a pinned machine cannot move to an idle CPU).
pub fn pick_cpus(cpus: f64) -> Option<Vec<usize>> {
    let allowed = sys::affinity().ok().filter(|a| !a.is_empty())?;
    let n = (cpus.ceil() as usize).max(1);
    if n >= allowed.len() {
        return None;
    }
    let start = next_start(n, allowed.len());
    let mut picked: Vec<usize> = (0..n)
        .map(|i| allowed[(start + i) % allowed.len()])
        .collect();
    picked.sort_unstable();
    Some(picked)
}

/// Advances the host-wide cursor by `n` and returns where it was (modulo `len`). One
/// small file under a lock: no scan of other machines. Without it (an unwritable
/// `/run`), a random start spreads machines as well on average.
fn next_start(n: usize, len: usize) -> usize {
    let stepped = || -> io::Result<usize> {
        fs::create_dir_all("/run/locker")?;
        let mut f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(CURSOR)?;
        sys::lock_exclusive(&f)?;
        let mut text = String::new();
        f.read_to_string(&mut text)?;
        let at = text.trim().parse::<usize>().unwrap_or(0) % len;
        let next = format!("{:<20}", (at + n) % len);
        f.write_all_at(next.as_bytes(), 0)?;
        Ok(at)
    };
    stepped().unwrap_or_else(|_| {
        let mut r = [0u8; 8];
        sys::random_bytes(&mut r);
        (u64::from_le_bytes(r) % len as u64) as usize
    })
}

/// A CPU list as the kernel writes one (`0-3,6`).
pub fn cpu_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// Mounts the machine's view files: a tmpfs at `dir/view` (in the machine's mount
/// namespace, gone with it), its `meminfo` bound read-only over `root/proc/meminfo`, and
/// when the machine is pinned to `cpus`, an `online` list bound over
/// `root/sys/devices/system/cpu/online`. Returns a write descriptor on `meminfo` for the
/// agent, the only writer: the files belong to the host's root, which the machine's user
/// namespace does not map (so no capability of the machine's root applies to them), and
/// the binds are read-only mounts its root cannot remount, unmount or cover (the
/// namespace is the host's, and the filter refuses mount calls anyway). The agent fills
/// `meminfo` before it serves its first call.
pub fn mount(dir: &Path, root: &Path, cpus: Option<&[usize]>) -> Result<OwnedFd, ViewError> {
    let at = dir.join("view");
    fs::create_dir_all(&at).map_err(step("create its directory"))?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    sys::mount(
        Some("locker-view"),
        &at,
        Some("tmpfs"),
        flags,
        Some("mode=755,size=64k,nr_inodes=16"),
    )
    .map_err(step("mount its tmpfs"))?;
    let meminfo = at.join("meminfo");
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .custom_flags(libc::O_CLOEXEC)
        .open(&meminfo)
        .map_err(step("create meminfo"))?;
    sys::bind(
        &meminfo,
        &root.join("proc/meminfo"),
        flags | libc::MS_RDONLY,
    )
    .map_err(step("bind /proc/meminfo"))?;
    if let Some(cpus) = cpus {
        let online = at.join("online");
        fs::write(&online, format!("{}\n", cpu_list(cpus))).map_err(step("write online"))?;
        fs::set_permissions(&online, fs::Permissions::from_mode(0o444))
            .map_err(step("write online"))?;
        let target = root.join("sys/devices/system/cpu/online");
        if target.exists() {
            sys::bind(&online, &target, flags | libc::MS_RDONLY)
                .map_err(step("bind /sys/devices/system/cpu/online"))?;
        }
    }
    Ok(OwnedFd::from(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_read_like_the_kernels() {
        assert_eq!(cpu_list(&[0]), "0");
        assert_eq!(cpu_list(&[3]), "3");
        assert_eq!(cpu_list(&[0, 1, 2, 3]), "0-3");
        assert_eq!(cpu_list(&[0, 2, 3, 4, 7]), "0,2-4,7");
    }

    #[test]
    fn a_machine_as_large_as_the_allowed_cpus_is_not_pinned() {
        let n = sys::affinity().unwrap().len();
        assert_eq!(pick_cpus(n as f64), None);
        assert_eq!(pick_cpus(n as f64 + 0.5), None);
        if n > 1 {
            let one = pick_cpus(0.25).unwrap();
            assert_eq!(one.len(), 1);
            assert!(sys::affinity().unwrap().contains(&one[0]));
        }
    }
}
