//! Giving a machine its egress and taking it away: the ordered steps over a lease, its
//! links and its rules, for a jail ([`attach`]) and a microVM ([`prepare_vm`],
//! [`attach_vm`]), undone by [`detach`].
//!
//! The order is the security argument: the rules of a lease are installed before the link
//! that they name exists, so no packet ever crosses an unsteered link; a step that fails
//! undoes everything before it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::lease::{lease_slot, release_slot, NetLease};
use super::link::{add_netns, delete_link, delete_netns, host_veth, link_exists, open_tap, wire};
use super::nft::{delete_machine_table, install_in_netns, install_on_host, run, tool};
use super::rules::{
    host_closed_ruleset, host_machine_ruleset, host_ruleset, machine_ruleset, machine_table,
    vm_bridge_ruleset,
};
use super::{NetError, Policy, TABLE};

/// Installs the host table and turns IPv4 forwarding on. Idempotent.
pub fn ensure_host() -> Result<(), NetError> {
    tool("nft")?;
    tool("ip")?;
    tool("nsenter")?;
    let fwd = "/proc/sys/net/ipv4/ip_forward";
    if fs::read_to_string(fwd)
        .map(|s| s.trim() != "1")
        .unwrap_or(true)
    {
        fs::write(fwd, "1").map_err(NetError::Forwarding)?;
    }
    install_on_host(
        &format!("installing the nftables table inet {TABLE}"),
        &host_ruleset(),
    )
}

/// Installs the rules of `policy` for lease `l`: the machine's own host table and the
/// ruleset inside its namespace `ns`. Safe before the link exists (the rules name it).
fn apply_rules(l: &NetLease, ns: &Path, policy: &Policy) -> Result<(), NetError> {
    match host_machine_ruleset(l, policy) {
        Some(rules) => install_on_host(
            &format!("installing the host rules of {}", l.link()),
            &rules,
        )?,
        None => {
            delete_machine_table(&machine_table(l));
        }
    }
    install_in_netns(ns, &machine_ruleset(l, policy))
}

/// Gives the running machine in `dir` (its PID 1 is `pid`) the egress `policy` (not
/// [`Policy::None`]: that is [`detach`]): leases a subnet, installs the rules, then wires
/// the veth; on a machine that has its link already, replaces the rules only (a policy
/// change). Idempotent; undone by [`detach`]. The host table must be in place
/// ([`super::status`] checks and installs it).
pub fn attach(dir: &Path, pid: i32, policy: &Policy) -> Result<NetLease, NetError> {
    if *policy == Policy::None {
        return Err(NetError::NoneHasNoLink);
    }
    let ns = PathBuf::from(format!("/proc/{pid}/ns/net"));
    if let Some(l) = NetLease::load(dir) {
        if link_exists(&l.link()) {
            apply_rules(&l, &ns, policy)?;
            return Ok(l);
        }
    }
    ensure_host()?;
    let slot = lease_slot(dir)?;
    let l = NetLease { slot };
    let result = (|| {
        l.store(dir)?;
        // Rules first: no packet crosses the link before they hold.
        apply_rules(&l, &ns, policy)?;
        wire(&l, &ns)
    })();
    match result {
        Ok(()) => Ok(l),
        Err(e) => {
            detach(dir, Some(pid));
            Err(e)
        }
    }
}

/// Takes egress away from the machine in `dir`: removes its veth (both ends), its host
/// table, the ruleset inside (when `pid`, its PID 1, still runs), `net.json` and the
/// subnet lease. Safe to call when nothing is there.
pub fn detach(dir: &Path, pid: Option<i32>) {
    let Some(l) = NetLease::load(dir) else {
        return;
    };
    if let Some(pid) = pid {
        // Best effort: the namespace goes with the machine anyway.
        let _ = install_in_netns(
            Path::new(&format!("/proc/{pid}/ns/net")),
            &format!("delete table inet {TABLE}\n"),
        );
    }
    delete_link(&l.link());
    delete_machine_table(&machine_table(&l));
    delete_netns(&l.netns_name());
    let _ = fs::remove_file(dir.join("net.json"));
    release_slot(l.slot);
}

/// Gives the microVM in `dir` (not started yet) its network: leases a subnet, makes its
/// network namespace with everything closed (host table and bridge table as under
/// `none`), the bridge `br0`, the tap `tap0` (opened here: the returned file is its only
/// fd, for QEMU) and the veth. Returns the lease, the namespace (for QEMU to join) and the
/// tap. [`attach_vm`] opens it to a policy once the guest runs; [`detach`] undoes it.
pub fn prepare_vm(dir: &Path) -> Result<(NetLease, fs::File, fs::File), NetError> {
    ensure_host()?;
    let ip = tool("ip")?;
    let slot = lease_slot(dir)?;
    let l = NetLease { slot };
    let result = (|| {
        fs::create_dir_all(dir).map_err(NetError::io(format!("create {}", dir.display())))?;
        l.store(dir)?;
        let (name, ns) = (l.netns_name(), l.netns());
        delete_netns(&name);
        add_netns(&name)?;
        // Rules first: no packet crosses the link before they hold.
        apply_vm_rules(&l, &ns, &Policy::None)?;
        run(
            "making the microVM's bridge br0",
            Command::new(&ip).args(["-n", &name, "-batch", "-"]),
            Some(
                "link set lo up\n\
                 link add br0 type bridge\n\
                 link set br0 up\n",
            ),
        )?;
        let tap = open_tap(&ns)?;
        run(
            "putting tap0 on the bridge",
            Command::new(&ip).args(["-n", &name, "link", "set", "tap0", "master", "br0", "up"]),
            None,
        )?;
        host_veth(&ip, &l, &name)?;
        run(
            "putting eth0 on the bridge",
            Command::new(&ip).args(["-n", &name, "link", "set", "eth0", "master", "br0", "up"]),
            None,
        )?;
        let netns = fs::File::open(&ns).map_err(NetError::io(format!("open {}", ns.display())))?;
        Ok((netns, tap))
    })();
    match result {
        Ok((netns, tap)) => Ok((l, netns, tap)),
        Err(e) => {
            detach(dir, None);
            release_slot(slot);
            Err(e)
        }
    }
}

/// Sets the egress `policy` of the microVM in `dir` (made by [`prepare_vm`]): replaces
/// its host table and the bridge table in its namespace. `None` closes the link.
pub fn attach_vm(dir: &Path, policy: &Policy) -> Result<NetLease, NetError> {
    let l = NetLease::load(dir).ok_or(NetError::NoLease)?;
    let ns = l.netns();
    if !ns.exists() || !link_exists(&l.link()) {
        return Err(NetError::Gone {
            netns: ns,
            link: l.link(),
        });
    }
    apply_vm_rules(&l, &ns, policy)?;
    Ok(l)
}

/// [`apply_rules`] for a microVM: its host table (closed under `None`) and the bridge
/// table inside its namespace `ns`.
fn apply_vm_rules(l: &NetLease, ns: &Path, policy: &Policy) -> Result<(), NetError> {
    let host = host_machine_ruleset(l, policy).unwrap_or_else(|| host_closed_ruleset(l));
    install_on_host(&format!("installing the host rules of {}", l.link()), &host)?;
    install_in_netns(ns, &vm_bridge_ruleset(l, policy))
}
