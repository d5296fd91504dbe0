//! Proof that the host's egress rules hold, and its cached verdict.
//!
//! [`probe`] wires a throwaway namespace like a machine and tries to get past the host's
//! rules; [`status`] caches its verdict for the server (re-probed after a minute, ten
//! seconds after a failure). Owns nothing a machine uses: everything the probe makes is
//! removed before it returns; what a probe killed half-way left (its namespace, veth and
//! subnet lease, named after its process) goes with the rest of a crash's networks
//! ([`super::cleanup_stale`], through [`remove`]).

use std::fs;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::attach::{detach, ensure_host};
use super::lease::{lease_slot, NetLease};
use super::link::{add_netns, delete_netns, wire};
use super::{NetError, TABLE};

/// The cached verdict of [`probe`]: whether egress other than `none` can be enforced.
/// The error is shared: every caller until the next probe gets the same one.
type Verdict = Result<String, Arc<NetError>>;
static STATUS: Mutex<Option<(Instant, Verdict)>> = Mutex::new(None);

/// Whether egress enforcement works on this host (the last [`probe`]'s verdict, probed
/// again after a minute, or ten seconds after a failure). Blocking.
pub fn status() -> Result<String, NetError> {
    let mut st = STATUS.lock().expect("egress status lock");
    if let Some((at, r)) = &*st {
        let ttl = if r.is_ok() { 60 } else { 10 };
        if at.elapsed() < Duration::from_secs(ttl) {
            return r.clone().map_err(NetError::Probe);
        }
    }
    let r = probe().map_err(Arc::new);
    *st = Some((Instant::now(), r.clone()));
    r.map_err(NetError::Probe)
}

/// The cached verdict only, without probing (for `/healthz`); `None` before any probe.
pub fn cached_status() -> Option<Verdict> {
    STATUS
        .lock()
        .expect("egress status lock")
        .as_ref()
        .map(|(_, r)| r.clone())
}

/// Proves the host's rules: installs them, wires a throwaway namespace like a machine
/// (without the machine's own ruleset, so only the host's rules stand in the way), and
/// tries to reach a listener on the host through the veth's host end and the metadata
/// address. Both must fail; everything is removed afterwards.
pub fn probe() -> Result<String, NetError> {
    ensure_host()?;
    let name = format!("{PREFIX}{}", std::process::id());
    let ns = PathBuf::from(format!("/run/netns/{name}"));
    let owner = owner_dir(&name);
    delete_netns(&name);
    add_netns(&name)?;
    let _ = fs::create_dir_all(&owner);
    let result = (|| {
        let slot = lease_slot(&owner)?;
        let l = NetLease { slot };
        l.store(&owner)?;
        wire(&l, &ns)?;
        let listener =
            TcpListener::bind("0.0.0.0:0").map_err(NetError::io("bind the probe's listener"))?;
        let port = listener
            .local_addr()
            .map_err(NetError::io("read the probe listener's port"))?
            .port();
        let targets = [
            SocketAddr::from((l.host_ip(), port)),
            SocketAddr::from(([169, 254, 169, 254], 80)),
        ];
        let nsf = fs::File::open(&ns).map_err(NetError::io(format!("open {}", ns.display())))?;
        let reached = std::thread::spawn(move || -> Result<Vec<SocketAddr>, NetError> {
            // A network namespace is per thread: this thread alone enters the probe's.
            crate::sys::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET)
                .map_err(NetError::io("enter the probe namespace"))?;
            Ok(targets
                .iter()
                .filter(|a| TcpStream::connect_timeout(a, Duration::from_millis(300)).is_ok())
                .copied()
                .collect())
        })
        .join()
        .map_err(|_| NetError::Panicked("the probe thread"))??;
        drop(listener);
        if reached.is_empty() {
            Ok(format!(
                "nftables table inet {TABLE} installed; a probe namespace could not reach the host or the metadata address"
            ))
        } else {
            Err(NetError::NotEnforced(reached))
        }
    })();
    remove(&name);
    result
}

/// A probe's namespace is `locker-probe-<pid of the probing process>`.
pub(super) const PREFIX: &str = "locker-probe-";

/// Where probe `name` keeps its subnet lease (as a machine's directory does).
fn owner_dir(name: &str) -> PathBuf {
    PathBuf::from(format!("/run/locker/{name}"))
}

/// Removes probe `name`: its veth and lease, their directory, its namespace. Whether the
/// namespace is gone.
pub(super) fn remove(name: &str) -> bool {
    let owner = owner_dir(name);
    detach(&owner, None);
    let _ = fs::remove_dir_all(&owner);
    delete_netns(name)
}
