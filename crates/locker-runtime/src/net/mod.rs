//! Network egress of machines, enforced outside them.
//!
//! Owns the host side of a machine's network: its veth pair, its subnet lease, the
//! host-wide nftables table `inet locker`, the machine's own table `ip locker_lk<slot>` on
//! the host, and the ruleset inside the machine's network namespace. It does not own the
//! policy's API shape, the name-checking proxy or the DNS responder (the server does: this
//! module only steers a machine's packets to their ports).
//!
//! A machine with egress `none` (the default) is untouched: loopback only, no veth, no
//! cost. A machine with any other [`Policy`] gets:
//! - a /30 of `100.96.0.0/12` leased host-wide (`/run/locker/net-slots/<slot>`, the file
//!   names the machine's directory, which holds `net.json`); host end `.1`, machine `.2`;
//! - a veth pair: host end `lk<slot>`, machine end `eth0` in the machine's network
//!   namespace (owned by the host's user namespace: the machine's root cannot change it),
//!   with its address, a default route via the host end and an nftables ruleset inside
//!   (defence in depth: no metadata, no host end but its DNS port, no other machine, no
//!   IPv6, nothing in; under `allow` only TCP, DNS and the allowed CIDRs leave);
//! - the host table `inet locker` (shared, static, replaced atomically and idempotently):
//!   *input* drops everything arriving from `lk*` (every address of the host, Locker's
//!   ports, the host's 127.0.0.0/8) except connections Locker's own per-machine rules
//!   redirected to the server (conntrack mark [`REDIRECT_MARK`] and DNAT status, which
//!   nothing in a machine can set); *forward* drops from `lk*` to 169.254.0.0/16,
//!   100.96.0.0/12 (other machines), 127/8, multicast and broadcast, every IPv6 packet
//!   and any spoofed source, and lets nothing into `lk*` but replies; *postrouting*
//!   masquerades machine traffic leaving by any other interface;
//! - its own host table `ip locker_lk<slot>` (installed before the link exists, so no
//!   packet ever leaves unsteered): DNS queries to the server's DNS responder; under
//!   `allow`, every TCP connection not to an allowed CIDR to the server's proxy, which
//!   dials the requested *name* itself, and every other forwarded packet not to an
//!   allowed CIDR dropped.
//!
//! A microVM ([`prepare_vm`], [`attach_vm`]) has the same lease, veth, host tables and
//! host rules; only the machine's side differs, because the machine's own address belongs
//! to its guest kernel, not to a namespace the host configures:
//! - its network namespace is a named one, `/run/netns/locker-lk<slot>`, made before QEMU
//!   starts (QEMU joins it) and living as long as the machine (removed by [`detach`], and by
//!   [`cleanup_stale`] after a crash);
//! - in it the host opens the tap `tap0` that QEMU's network device uses (by fd: the
//!   tap goes when QEMU does) and bridges it with the veth's machine end `eth0` on `br0`; the
//!   namespace itself has no address. The guest owns `.2`, routes via `.1` and asks `.1` for
//!   names (set through its agent);
//! - the ruleset inside is a `bridge` table (an `inet` one would never see bridged
//!   frames): frames from the tap must be IPv4 (or ARP) from `.2`, and then pass the same
//!   checks as a jail's `output` chain. The guest's root can change anything in the guest,
//!   not this table, nor the host's;
//! - the link lives as long as the machine: under `none` (a machine created with a network
//!   policy, then changed to `none`) its host table drops everything from it and the bridge
//!   table everything from the tap.
//!
//! Whether the host rules work is proved by [`probe`]: a throwaway namespace wired like a
//! machine tries to connect to a listener on the host (which would answer without the
//! rules) and to the metadata address; both must fail.
//!
//! Rooms: [`policy`] (the policy and its networks, pure), [`rules`] (the nftables
//! rulesets, pure text), [`lease`] (subnet slots and `net.json`), [`nft`] (running
//! `nft`/`ip`/`nsenter`, installing a ruleset on the host or in a namespace), [`link`]
//! (veth, tap, bridge, named namespaces), [`attach`] (the ordered steps for a jail and a
//! microVM, and their undoing), [`cleanup`] (what a crash left) and [`probe`] (the proof
//! and its cached verdict). Every failure is a [`NetError`] naming the step that failed.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

mod attach;
mod cleanup;
mod lease;
mod link;
mod nft;
mod policy;
mod probe;
mod rules;

pub use attach::{attach, attach_vm, detach, ensure_host, prepare_vm};
pub use cleanup::cleanup_stale;
pub use lease::NetLease;
pub use link::{link_exists, machine_links};
pub use policy::{merge_cidrs, Cidr, Policy};
pub use probe::{cached_status, probe, status};

/// The machines' address range: 100.96.0.0/12 (carrier-grade NAT space, never routed on
/// the internet), one /30 per machine.
pub const RANGE: &str = "100.96.0.0/12";
/// Host-wide subnet leases, like the uid slots.
pub const SLOTS_DIR: &str = "/run/locker/net-slots";
/// The host-wide nftables table (family inet).
pub const TABLE: &str = "locker";
/// Metadata and link-local addresses, never reachable.
const NEVER_V4: &str =
    "169.254.0.0/16, 100.96.0.0/12, 127.0.0.0/8, 0.0.0.0/8, 224.0.0.0/4, 255.255.255.255";
/// The conntrack mark Locker's per-machine rules put on the connections they redirect to
/// the server (its proxy and DNS responder); the host's input chain accepts from `lk*`
/// only those. Conntrack state is per network namespace: a machine cannot set it.
pub const REDIRECT_MARK: u32 = 0x4c4b_0045;
/// MicroVMs' network namespaces are `/run/netns/locker-lk<slot>`.
pub const VM_NETNS_PREFIX: &str = "locker-lk";
/// The most CIDRs one `allow` policy carries.
pub const MAX_CIDRS: usize = 256;

/// Why a machine's egress (or the proof of the host's rules) could not be set up. Every
/// variant names the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A program egress needs is not installed on the host.
    #[error(
        "`{tool}` not found: install {package} (apt-get install {package}; scripts/setup does)"
    )]
    ToolMissing {
        tool: &'static str,
        package: &'static str,
    },
    /// A program of the step could not be started.
    #[error("{step}: cannot run {command}: {source}")]
    Spawn {
        step: String,
        command: String,
        source: io::Error,
    },
    /// A program of the step ran and failed; `stderr` is what it said.
    #[error("{step}: {command} failed: {stderr}")]
    Command {
        step: String,
        command: String,
        stderr: String,
    },
    /// A file, socket or system call of the step failed.
    #[error("{step}: {source}")]
    Io { step: String, source: io::Error },
    #[error("cannot enable IPv4 forwarding ({0}): run `sysctl -w net.ipv4.ip_forward=1`")]
    Forwarding(#[source] io::Error),
    #[error("no free machine subnet on this host")]
    NoSubnet,
    #[error("egress `none` has no link to attach")]
    NoneHasNoLink,
    #[error("the microVM has no network lease (net.json)")]
    NoLease,
    #[error("the microVM's network ({} and {link}) is gone", .netns.display())]
    Gone { netns: PathBuf, link: String },
    #[error("unsupported namespace path {}", .0.display())]
    NamespacePath(PathBuf),
    #[error("{0} panicked")]
    Panicked(&'static str),
    /// The probe got past the host's rules.
    #[error("enforcement does not hold: a probe namespace reached {0:?} (another firewall accepting first?)")]
    NotEnforced(Vec<SocketAddr>),
    /// The cached verdict of the last probe ([`status`]).
    #[error(transparent)]
    Probe(Arc<NetError>),
}

impl NetError {
    /// The house idiom: `.map_err(NetError::io("what was being done"))`.
    fn io(step: impl Into<String>) -> impl FnOnce(io::Error) -> NetError {
        let step = step.into();
        move |source| NetError::Io { step, source }
    }
}
