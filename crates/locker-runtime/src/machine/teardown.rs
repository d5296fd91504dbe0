//! Stopping and tearing down a machine, whatever its runtime: its processes (all in its
//! cgroup: a jail's shim and PID 1, or a microVM's QEMU and file server), its cgroup, its
//! network, its directory (disk image included) and its uid lease. Works on a
//! half-started machine too, and on one an earlier server process started.
//!
//! It starts nothing and does not talk to agents; it reads a machine only through its
//! directory ([`MachineState`]) and its cgroup.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::slots;
use super::state::MachineState;
use crate::cgroup::{CgroupError, Layout, MachineCgroup};
use crate::sys;

/// How long a jail's shim may take to exit after its PID 1.
const SHIM_EXIT: Duration = Duration::from_secs(10);

/// Why a machine could not be torn down.
#[derive(Debug, thiserror::Error)]
pub enum TeardownError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error("the machine did not stop within {0:?}")]
    StopTimeout(Duration),
    #[error("{step}: {source}")]
    Io { step: String, source: io::Error },
}

/// Stops a machine and removes every trace of it: its processes (a jail's whole pid
/// namespace dies with its PID 1), its cgroup, its egress, its directory, and its uid
/// lease. A jail's mounts and loop device go with its namespaces.
pub fn destroy(id: &str, dir: &Path, layout: &Layout) -> Result<(), TeardownError> {
    let cg = MachineCgroup::existing(layout.clone(), id, dir);
    let state = MachineState::load(dir);
    kill_processes(&cg, state.as_ref())?;
    if let Some(MachineState::Jail(s)) = &state {
        // The shim exits right after its PID 1; wait so its mount namespace is gone too.
        let deadline = Instant::now() + SHIM_EXIT;
        while crate::jail::is_shim(s.shim_pid, dir) {
            if Instant::now() > deadline {
                return Err(TeardownError::StopTimeout(SHIM_EXIT));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    cg.remove()?;
    // Egress (if the machine had any): its veth and subnet lease.
    crate::net::detach(dir, None);
    // A microVM's disk is a plain file QEMU opened: no loop device to wait for.
    if !matches!(state, Some(MachineState::Vm(_))) {
        wait_loops_gone(dir);
    }
    match fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(TeardownError::Io {
                step: format!("remove {}", dir.display()),
                source: e,
            })
        }
    }
    if let Some(s) = &state {
        slots::release_uid_range(s.uid_base(), dir);
    }
    Ok(())
}

/// Ends every process of a machine (its files stop changing) without tearing down the
/// rest: what a run needs before it reads the machine's layer. [`destroy`] does the rest.
pub fn stop(id: &str, dir: &Path, layout: &Layout) -> Result<(), TeardownError> {
    kill_processes(
        &MachineCgroup::existing(layout.clone(), id, dir),
        MachineState::load(dir).as_ref(),
    )
}

fn kill_processes(cg: &MachineCgroup, state: Option<&MachineState>) -> Result<(), TeardownError> {
    match state {
        Some(MachineState::Jail(s)) if crate::jail::owns_pid(s.agent_pid, cg.name()) => {
            // PID 1's death takes its whole pid namespace down, and the kernel reports it
            // only once every other process of the namespace is gone: wait for exactly that
            // (a run's answer waits on this), then let `kill_all` check and kill whatever
            // is left one by one. The descriptor is taken before the signal, so a pid
            // reused meanwhile is never waited on.
            let pidfd = sys::pidfd_open(s.agent_pid);
            let _ = sys::kill(s.agent_pid, libc::SIGKILL);
            // A frozen machine (paused, or held for a run's commit) acts on the signal only
            // once thawed; a thawed one is left as it is.
            let _ = cg.set_frozen(false);
            match pidfd {
                Ok(fd) => {
                    let _ = sys::pidfd_wait_exit(&fd, Duration::from_millis(200));
                }
                Err(_) => {
                    let deadline = Instant::now() + Duration::from_millis(200);
                    while !cg.pids().is_empty() && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_micros(500));
                    }
                }
            }
        }
        // QEMU's death takes nothing else with it (the file server runs on): the cgroup
        // kills the rest at once.
        Some(MachineState::Vm(v)) if crate::vm::is_alive(v) => {
            let _ = sys::kill(v.pid, libc::SIGKILL);
        }
        _ => {}
    }
    Ok(cg.kill_all()?)
}

/// Waits (at most 5 s) for the loop devices backed by the machine's images (its disk, the
/// snapshot layers linked in its directory) to go.
fn wait_loops_gone(dir: &Path) {
    // The kernel tears a dead mount namespace down asynchronously; the loop device detaches
    // once the disk is unmounted. Wait for it so "destroyed" means nothing is left.
    // The devices are found once (a scan of every loop device), then only they are
    // watched: with many machines going at once, a scan per poll would cost each of them
    // a read per loop device on the host, every poll.
    // Every image is under the machine's directory: match that prefix, with its slash.
    let img = dir.join("");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut devs = loops_backing(&img);
    while !devs.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
        devs.retain(|d| backs(d, &img));
    }
}

/// The loop devices (`/sys/block/loopN`) backed by `img`: of those the machine's shim
/// noted in its directory ([`super::LOOPS`]), else (a machine started by an earlier
/// release) of every loop device on the host.
fn loops_backing(img: &Path) -> Vec<PathBuf> {
    if let Ok(noted) = fs::read_to_string(img.join(super::LOOPS)) {
        return noted
            .lines()
            .filter_map(|l| l.strip_prefix("/dev/"))
            .filter(|n| {
                n.strip_prefix("loop")
                    .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
            })
            .map(|n| Path::new("/sys/block").join(n))
            .filter(|d| backs(d, img))
            .collect();
    }
    let Ok(rd) = fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    rd.flatten()
        .map(|e| e.path())
        .filter(|d| backs(d, img))
        .collect()
}

/// Whether the block device `dev` (`/sys/block/loopN`) is a loop device backed by `img`.
fn backs(dev: &Path, img: &Path) -> bool {
    fs::read(dev.join("loop/backing_file"))
        .is_ok_and(|b| b.starts_with(img.as_os_str().as_encoded_bytes()))
}

/// Whether `pid` exists and is neither a zombie nor dead.
pub(crate) fn is_running(pid: i32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or("Z");
    state != "Z" && state != "X"
}

/// The NUL-separated command line of `pid` (empty if it is gone): to tell a machine's
/// process from a reused pid.
pub(crate) fn cmdline(pid: i32) -> Vec<u8> {
    fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default()
}

/// Removes what a crash left: every machine directory under `machines_dir` whose id is
/// not in `keep`, killing any process still in its cgroup and removing the cgroup. Only
/// machines of this `machines_dir` are touched: other data dirs on the host keep theirs.
/// Returns the ids removed.
pub fn cleanup_orphans(machines_dir: &Path, keep: &[String], layout: &Layout) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(rd) = fs::read_dir(machines_dir) else {
        return removed;
    };
    for e in rd.flatten() {
        let id = e.file_name().to_string_lossy().into_owned();
        if keep.contains(&id) || !e.path().is_dir() {
            continue;
        }
        match destroy(&id, &e.path(), layout) {
            Ok(()) => removed.push(id),
            Err(err) => {
                tracing::warn!(machine = %id, error = %err, "could not clean up an orphaned machine")
            }
        }
    }
    removed
}
