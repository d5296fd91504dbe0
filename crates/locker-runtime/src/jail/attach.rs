//! Mounts an overlay into a running jail (a pooled machine a run claims), from a thread of
//! the caller's process made for it. It touches only the machine named in its spec, and
//! only its mount namespace; the thread's own filesystem context (root, cwd, mount
//! namespace) is unshared from the process's first and ends with the thread.

use std::fs;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::setup::mount_overlay_at;
use super::spec::AttachSpec;
use super::{step, JailError};
use crate::sys;

/// Mounts an overlay into a running machine (a pooled machine a run claims). `setns` into a
/// mount namespace needs a caller whose filesystem context is its own, so this runs on a
/// new thread (never a pooled one: it does not come back from the machine's namespace)
/// that first unshares `CLONE_FS` from the process. The layers are id-mapped on the host
/// side first, then the thread enters the machine's mount namespace, attaches them under a
/// private staging directory of its `/dev` (a tmpfs), mounts the overlay at the target,
/// and detaches the staging mounts (the overlay keeps its own references); `done` then gets
/// the outcome, on that thread. (This replaced exec'ing the CLI binary for it, about 5 ms
/// of a serverless run's 20.)
pub fn attach(
    spec: AttachSpec,
    done: impl FnOnce(Result<(), JailError>) + Send + 'static,
) -> Result<(), JailError> {
    std::thread::Builder::new()
        .name("jail-attach".into())
        .spawn(move || {
            done(
                sys::unshare(libc::CLONE_FS)
                    .map_err(step("unshare the attach thread's filesystem context"))
                    .and_then(|()| run_attach(&spec)),
            )
        })
        .map(drop)
        .map_err(step("start the attach thread"))
}

/// Names the staging directories of attaches running at once in one process apart.
static ATTACHES: AtomicU64 = AtomicU64::new(0);

fn run_attach(a: &AttachSpec) -> Result<(), JailError> {
    let m = &a.mount;
    let parts = m.parts()?;
    let (rel, rw, up, wk) = (parts.rel, parts.rw, parts.upper, parts.work);
    let userns = fs::File::open(format!("/proc/{}/ns/user", a.agent_pid))
        .map_err(step("open the machine's user namespace"))?;
    let mntns = fs::File::open(format!("/proc/{}/ns/mnt", a.agent_pid))
        .map_err(step("open the machine's mount namespace"))?;
    let lower = sys::idmapped_tree(&m.lower, userns.as_raw_fd(), true)
        .map_err(step(format!("id-map {}", m.lower.display())))?;
    let rw_tree = sys::idmapped_tree(rw, userns.as_raw_fd(), false)
        .map_err(step(format!("id-map {}", rw.display())))?;
    sys::setns(mntns.as_raw_fd(), libc::CLONE_NEWNS)
        .map_err(step("enter the machine's mount namespace"))?;
    std::env::set_current_dir("/").map_err(step("enter the machine's root"))?;
    let stage = PathBuf::from(format!(
        "/dev/.locker-attach-{}-{}",
        std::process::id(),
        ATTACHES.fetch_add(1, Ordering::Relaxed)
    ));
    let (l, r) = (stage.join("l"), stage.join("rw"));
    for d in [&l, &r] {
        fs::create_dir_all(d).map_err(step(format!("create {}", d.display())))?;
    }
    let result = (|| {
        sys::attach_tree(&lower, &l).map_err(step("attach the lower layer"))?;
        sys::attach_tree(&rw_tree, &r).map_err(step("attach the upper layer"))?;
        mount_overlay_at(
            &l,
            &r.join(up),
            &r.join(wk),
            &Path::new("/").join(rel),
            &m.target,
            a.uid_base,
        )
    })();
    let _ = sys::umount(&l, libc::MNT_DETACH);
    let _ = sys::umount(&r, libc::MNT_DETACH);
    let _ = fs::remove_dir_all(&stage);
    result
}
