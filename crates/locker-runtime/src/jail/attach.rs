//! `locker __jail-attach`: mounts an overlay into a running jail (a pooled machine a run
//! claims). It touches only the machine named in its spec, and only its mount namespace.

use std::fs;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::setup::mount_overlay_at;
use super::spec::AttachSpec;
use super::{step, JailError};
use crate::sys;

/// Mounts an overlay into a running machine (a pooled machine a run claims). Runs as
/// `locker __jail-attach <json>`: `setns` into a mount namespace needs a single-threaded
/// process. The layers are id-mapped on the host side first, then the process enters the
/// machine's mount namespace, attaches them under a private staging directory of its
/// `/dev` (a tmpfs), mounts the overlay at the target, and detaches the staging mounts
/// (the overlay keeps its own references). Exits 0, or 1 with the reason on stderr.
pub fn attach_main(arg: &str) -> ! {
    let code = match serde_json::from_str::<AttachSpec>(arg)
        .map_err(|e| JailError::Init(format!("bad attach spec: {e}")))
        .and_then(|s| run_attach(&s))
    {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    };
    std::process::exit(code)
}

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
    let stage = PathBuf::from(format!("/dev/.locker-attach-{}", std::process::id()));
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
