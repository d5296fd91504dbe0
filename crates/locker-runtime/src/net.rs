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

use std::fs;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The machines' address range: 100.96.0.0/12 (carrier-grade NAT space, never routed on
/// the internet), one /30 per machine.
pub const RANGE: &str = "100.96.0.0/12";
const RANGE_BASE: u32 = 0x6460_0000; // 100.96.0.0
const SLOTS: u32 = 1 << 18; // /12 in /30s
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

/// What a machine's link lets through beyond the host's static rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// No link at all: loopback only.
    None,
    /// Everything but the never-reachable set; DNS queries to the host end go to the
    /// server's responder on `dns_port`.
    All { dns_port: u16 },
    /// Only the `cidrs` directly; every other TCP connection goes to the server's proxy on
    /// `proxy_port`, every DNS query to its responder on `dns_port`, nothing else leaves.
    Allow {
        cidrs: Vec<Cidr>,
        proxy_port: u16,
        dns_port: u16,
    },
}

/// An IPv4 network, `addr/prefix` (the address masked to the prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n` or a single address (`/32`); the address is masked to `n` bits.
    pub fn parse(s: &str) -> Option<Cidr> {
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, p.parse::<u8>().ok().filter(|p| *p <= 32)?),
            None => (s, 32),
        };
        let addr: Ipv4Addr = a.parse().ok()?;
        Some(Cidr {
            addr: Ipv4Addr::from(u32::from(addr) & Self::mask(p)),
            prefix: p,
        })
    }

    fn mask(prefix: u8) -> u32 {
        if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix)
        }
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask(self.prefix) == u32::from(self.addr)
    }

    /// Whether `other` lies wholly inside this network.
    pub fn covers(&self, other: &Cidr) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// `cidrs` without duplicates or networks inside another (nftables refuses overlapping
/// intervals in one set).
pub fn merge_cidrs(cidrs: &[Cidr]) -> Vec<Cidr> {
    let mut v: Vec<Cidr> = cidrs.to_vec();
    v.sort_by_key(|c| (c.prefix, c.addr));
    let mut out: Vec<Cidr> = Vec::new();
    for c in v {
        if !out.iter().any(|o| o.covers(&c)) {
            out.push(c);
        }
    }
    out.sort();
    out
}

/// A machine's network as written to `<dir>/net.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetLease {
    pub slot: u32,
}

impl NetLease {
    /// The host end's interface name.
    pub fn link(&self) -> String {
        format!("lk{}", self.slot)
    }
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::from(RANGE_BASE + self.slot * 4 + 1)
    }
    pub fn machine_ip(&self) -> Ipv4Addr {
        Ipv4Addr::from(RANGE_BASE + self.slot * 4 + 2)
    }
    /// The name of a microVM's network namespace (under `/run/netns`).
    pub fn netns_name(&self) -> String {
        format!("{VM_NETNS_PREFIX}{}", self.slot)
    }
    /// The path of a microVM's network namespace.
    pub fn netns(&self) -> PathBuf {
        Path::new("/run/netns").join(self.netns_name())
    }
    /// Reads a machine's lease from its directory.
    pub fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&fs::read(dir.join("net.json")).ok()?).ok()
    }
}

fn run(cmd: &mut Command, input: Option<&str>) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("run {shown}: {e}"))?;
    if let Some(s) = input {
        let mut stdin = child.stdin.take().expect("piped stdin");
        stdin
            .write_all(s.as_bytes())
            .map_err(|e| format!("write to {shown}: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("wait for {shown}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{shown} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn tool(name: &str) -> Result<PathBuf, String> {
    crate::doctor::which(name).ok_or_else(|| {
        let pkg = match name {
            "nft" => "nftables",
            "ip" => "iproute2",
            _ => "util-linux",
        };
        format!("`{name}` not found: install {pkg} (apt-get install {pkg}; scripts/setup does)")
    })
}

/// The host-wide ruleset (static: no per-machine state, so concurrent servers replacing
/// it write the same thing).
fn host_ruleset() -> String {
    format!(
        "table inet {TABLE} {{}}
delete table inet {TABLE}
table inet {TABLE} {{
  chain input {{
    type filter hook input priority -10; policy accept;
    iifname \"lk*\" ct mark {REDIRECT_MARK:#x} ct status dnat accept
    iifname \"lk*\" drop
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname \"lk*\" meta nfproto ipv6 drop
    iifname \"lk*\" ip daddr {{ {NEVER_V4} }} drop
    iifname \"lk*\" ip saddr != {RANGE} drop
    oifname \"lk*\" ct state established,related accept
    oifname \"lk*\" drop
    iifname \"lk*\" accept
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr {RANGE} oifname != \"lk*\" masquerade
  }}
}}
"
    )
}

/// The ruleset inside a machine's network namespace (defence in depth; the host's rules
/// hold without it), replacing any earlier one atomically.
fn machine_ruleset(l: &NetLease, policy: &Policy) -> String {
    let host = l.host_ip();
    let dns = match policy {
        Policy::None => String::new(),
        _ => format!("ip daddr {host} udp dport 53 accept\n    "),
    };
    let allow = match policy {
        Policy::Allow { cidrs, .. } => {
            let mut r = String::new();
            if !cidrs.is_empty() {
                r += &format!("ip daddr {{ {} }} accept\n    ", join(cidrs));
            }
            r + "meta l4proto tcp accept\n    udp dport 53 accept\n    drop\n"
        }
        _ => String::new(),
    };
    format!(
        "table inet {TABLE} {{}}
delete table inet {TABLE}
table inet {TABLE} {{
  chain output {{
    type filter hook output priority 0; policy accept;
    oifname \"lo\" accept
    meta nfproto ipv6 drop
    {dns}ip daddr {{ {NEVER_V4}, {host} }} drop
    {allow}
  }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname \"lo\" accept
    ct state established,related accept
    drop
  }}
}}
"
    )
}

/// The ruleset inside a microVM's network namespace: a `bridge` table over the frames its
/// guest sends through the tap (the namespace's own stack carries none of them). The
/// same checks as [`machine_ruleset`]'s output chain, plus the guest's source address
/// (its root can change it, unlike a jail's). Replaces any earlier one atomically.
fn vm_bridge_ruleset(l: &NetLease, policy: &Policy) -> String {
    let (host, m) = (l.host_ip(), l.machine_ip());
    let body = match policy {
        Policy::None => "drop\n".to_owned(),
        _ => {
            let mut r = format!(
                "ether type arp accept
    ether type != ip drop
    ip saddr != {m} drop
    ip daddr {host} udp dport 53 accept
    ip daddr {{ {NEVER_V4}, {host} }} drop
"
            );
            if let Policy::Allow { cidrs, .. } = policy {
                if !cidrs.is_empty() {
                    r += &format!("    ip daddr {{ {} }} accept\n", join(cidrs));
                }
                r += "    ip protocol tcp accept\n    udp dport 53 accept\n    drop\n";
            }
            r
        }
    };
    format!(
        "table bridge {TABLE} {{}}
delete table bridge {TABLE}
table bridge {TABLE} {{
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname != \"tap0\" accept
    {body}  }}
}}
"
    )
}

/// A microVM's own host table under `none`: its link stays, nothing crosses it.
fn host_closed_ruleset(l: &NetLease) -> String {
    let (link, t) = (l.link(), machine_table(l));
    format!(
        "table ip {t} {{}}
delete table ip {t}
table ip {t} {{
  chain forward {{
    type filter hook forward priority -5; policy accept;
    iifname \"{link}\" drop
  }}
}}
"
    )
}

fn join(cidrs: &[Cidr]) -> String {
    cidrs
        .iter()
        .map(Cidr::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The name of a machine's own table on the host (family `ip`).
fn machine_table(l: &NetLease) -> String {
    format!("{TABLE}_{}", l.link())
}

/// The machine's own table on the host: where its DNS queries and (under `allow`) its TCP
/// connections go, and (under `allow`) the drop of everything else not to an allowed
/// CIDR. Replaces any earlier one atomically; `None` for [`Policy::None`].
fn host_machine_ruleset(l: &NetLease, policy: &Policy) -> Option<String> {
    let (link, m, h, t) = (l.link(), l.machine_ip(), l.host_ip(), machine_table(l));
    let mark = format!("ct mark set {REDIRECT_MARK:#x}");
    let (nat, forward) = match policy {
        Policy::None => return None,
        Policy::All { dns_port } => (
            format!("iifname \"{link}\" ip saddr {m} ip daddr {h} udp dport 53 {mark} redirect to :{dns_port}\n"),
            String::new(),
        ),
        Policy::Allow {
            cidrs,
            proxy_port,
            dns_port,
        } => {
            let mut nat =
                format!("iifname \"{link}\" ip saddr {m} udp dport 53 {mark} redirect to :{dns_port}\n");
            let forward = if cidrs.is_empty() {
                format!("iifname \"{link}\" drop")
            } else {
                let set = join(cidrs);
                nat += &format!("    iifname \"{link}\" ip daddr {{ {set} }} return\n");
                format!("iifname \"{link}\" ip daddr != {{ {set} }} drop")
            };
            nat += &format!(
                "    iifname \"{link}\" ip saddr {m} meta l4proto tcp {mark} redirect to :{proxy_port}\n"
            );
            (
                nat,
                format!(
                    "  chain forward {{
    type filter hook forward priority -5; policy accept;
    {forward}
  }}
"
                ),
            )
        }
    };
    Some(format!(
        "table ip {t} {{}}
delete table ip {t}
table ip {t} {{
  chain prerouting {{
    type nat hook prerouting priority -100; policy accept;
    {nat}  }}
{forward}}}
"
    ))
}

/// Removes the machine's own host table, if there is one.
/// Deletes a machine's host table; whether it is gone.
fn delete_machine_table(table: &str) -> bool {
    match crate::doctor::which("nft") {
        Some(nft) => run(
            Command::new(nft).args(["delete", "table", "ip", table]),
            None,
        )
        .is_ok(),
        None => false,
    }
}

/// Installs the host table and turns IPv4 forwarding on. Idempotent.
pub fn ensure_host() -> Result<(), String> {
    let nft = tool("nft")?;
    tool("ip")?;
    tool("nsenter")?;
    let fwd = "/proc/sys/net/ipv4/ip_forward";
    if fs::read_to_string(fwd)
        .map(|s| s.trim() != "1")
        .unwrap_or(true)
    {
        fs::write(fwd, "1").map_err(|e| {
            format!("cannot enable IPv4 forwarding ({e}): run `sysctl -w net.ipv4.ip_forward=1`")
        })?;
    }
    run(Command::new(nft).arg("-f").arg("-"), Some(&host_ruleset()))
        .map_err(|e| format!("installing the nftables table inet {TABLE}: {e}"))
}

/// Leases a free subnet slot for the machine in `dir`.
fn lease_slot(owner: &Path) -> Result<u32, String> {
    fs::create_dir_all(SLOTS_DIR).map_err(|e| format!("create {SLOTS_DIR}: {e}"))?;
    let mut r = [0u8; 4];
    // SAFETY: getrandom fills the buffer we own.
    unsafe { libc::getrandom(r.as_mut_ptr().cast(), 4, 0) };
    let start = u32::from_le_bytes(r) % SLOTS;
    for i in 0..SLOTS {
        let slot = (start + i) % SLOTS;
        let f = Path::new(SLOTS_DIR).join(slot.to_string());
        match fs::OpenOptions::new().write(true).create_new(true).open(&f) {
            Ok(mut file) => {
                let _ = file.write_all(owner.as_os_str().as_encoded_bytes());
                return Ok(slot);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("lease a subnet in {SLOTS_DIR}: {e}")),
        }
    }
    Err("no free machine subnet on this host".into())
}

/// Frees a subnet lease; whether its file is gone.
fn release_slot(slot: u32) -> bool {
    match fs::remove_file(Path::new(SLOTS_DIR).join(slot.to_string())) {
        Ok(()) => true,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

/// Installs the rules of `policy` for lease `l`: the machine's own host table and the
/// ruleset inside its namespace `ns`. Safe before the link exists (the rules name it).
fn apply_rules(l: &NetLease, ns: &Path, policy: &Policy) -> Result<(), String> {
    let nft = tool("nft")?;
    match host_machine_ruleset(l, policy) {
        Some(rules) => run(Command::new(&nft).arg("-f").arg("-"), Some(&rules))
            .map_err(|e| format!("installing the host rules of {}: {e}", l.link()))?,
        None => {
            delete_machine_table(&machine_table(l));
        }
    }
    run(
        Command::new(tool("nsenter")?)
            .arg(format!("--net={}", ns.display()))
            .arg(&nft)
            .arg("-f")
            .arg("-"),
        Some(&machine_ruleset(l, policy)),
    )
    .map_err(|e| format!("installing the rules inside the machine: {e}"))
}

/// Wires the namespace `ns` (a path like `/proc/<pid>/ns/net`) to the host through the
/// veth of lease `l`.
fn wire(l: &NetLease, ns: &Path) -> Result<(), String> {
    let (ip, nsenter) = (tool("ip")?, tool("nsenter")?);
    // `ip link add … netns` takes a pid or a name.
    host_veth(&ip, l, &ns_target(ns)?)?;
    let net_arg = format!("--net={}", ns.display());
    run(
        Command::new(&nsenter)
            .arg(&net_arg)
            .arg(&ip)
            .arg("-batch")
            .arg("-"),
        Some(&format!(
            "link set lo up\n\
             addr add {}/30 dev eth0\n\
             link set eth0 up\n\
             route add default via {}\n",
            l.machine_ip(),
            l.host_ip()
        )),
    )?;
    Ok(())
}

/// Creates the lease's veth: host end `lk<slot>` with the host address, up, IPv4 only and
/// strict reverse-path filtering (only the machine's own subnet enters by it; the forward
/// chain checks the source range as well); machine end `eth0` in namespace `ns_arg` (a pid
/// or a name, see [`ns_target`]).
fn host_veth(ip: &Path, l: &NetLease, ns_arg: &str) -> Result<(), String> {
    let link = l.link();
    run(
        Command::new(ip).arg("-batch").arg("-"),
        Some(&format!(
            "link add {link} type veth peer name eth0 netns {ns_arg}\n\
             addr add {}/30 dev {link}\n\
             link set {link} up\n",
            l.host_ip()
        )),
    )?;
    let _ = fs::write(format!("/proc/sys/net/ipv4/conf/{link}/rp_filter"), "1");
    let _ = fs::write(format!("/proc/sys/net/ipv6/conf/{link}/disable_ipv6"), "1");
    Ok(())
}

/// What `ip link … netns X` takes for a namespace path: a pid for `/proc/<pid>/ns/net`,
/// a name for `/run/netns/<name>`.
fn ns_target(ns: &Path) -> Result<String, String> {
    let s = ns.to_string_lossy();
    if let Some(rest) = s.strip_prefix("/proc/") {
        if let Some(pid) = rest.strip_suffix("/ns/net") {
            return Ok(pid.to_owned());
        }
    }
    if let Some(name) = s.strip_prefix("/run/netns/") {
        return Ok(name.to_owned());
    }
    Err(format!("unsupported namespace path {s}"))
}

/// Gives the running machine in `dir` (its PID 1 is `pid`) the egress `policy` (not
/// [`Policy::None`]: that is [`detach`]): leases a subnet, installs the rules, then wires
/// the veth; on a machine that has its link already, replaces the rules only (a policy
/// change). Idempotent; undone by [`detach`]. The host table must be in place ([`status`]
/// checks and installs it).
pub fn attach(dir: &Path, pid: i32, policy: &Policy) -> Result<NetLease, String> {
    if *policy == Policy::None {
        return Err("egress `none` has no link to attach".into());
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
        fs::write(
            dir.join("net.json"),
            serde_json::to_vec(&l).expect("lease serializes"),
        )
        .map_err(|e| format!("write net.json: {e}"))?;
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
    if let (Some(pid), Some(nsenter), Some(nft)) = (
        pid,
        crate::doctor::which("nsenter"),
        crate::doctor::which("nft"),
    ) {
        let _ = run(
            Command::new(nsenter)
                .arg(format!("--net=/proc/{pid}/ns/net"))
                .arg(nft)
                .args(["delete", "table", "inet", TABLE]),
            None,
        );
    }
    delete_link(&l.link());
    delete_machine_table(&machine_table(&l));
    delete_netns(&l.netns_name());
    let _ = fs::remove_file(dir.join("net.json"));
    release_slot(l.slot);
}

/// Removes a microVM's network namespace (its bridge, the veth's machine end and its
/// ruleset go with it), if there is one.
/// Deletes a named network namespace; whether it is gone.
fn delete_netns(name: &str) -> bool {
    let path = Path::new("/run/netns").join(name);
    if path.exists() {
        if let Some(ip) = crate::doctor::which("ip") {
            let _ = run(Command::new(ip).args(["netns", "del", name]), None);
        }
    }
    !path.exists()
}

/// Gives the microVM in `dir` (not started yet) its network: leases a subnet, makes its
/// network namespace with everything closed (host table and bridge table as under
/// `none`), the bridge `br0`, the tap `tap0` (opened here: the returned file is its only
/// fd, for QEMU) and the veth. Returns the lease, the namespace (for QEMU to join) and the
/// tap. [`attach_vm`] opens it to a policy once the guest runs; [`detach`] undoes it.
pub fn prepare_vm(dir: &Path) -> Result<(NetLease, fs::File, fs::File), String> {
    ensure_host()?;
    let ip = tool("ip")?;
    let slot = lease_slot(dir)?;
    let l = NetLease { slot };
    let result = (|| {
        fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        fs::write(
            dir.join("net.json"),
            serde_json::to_vec(&l).expect("lease serializes"),
        )
        .map_err(|e| format!("write net.json: {e}"))?;
        let (name, ns) = (l.netns_name(), l.netns());
        delete_netns(&name);
        run(Command::new(&ip).args(["netns", "add", &name]), None)?;
        // Rules first: no packet crosses the link before they hold.
        apply_vm_rules(&l, &ns, &Policy::None)?;
        run(
            Command::new(&ip).args(["-n", &name, "-batch", "-"]),
            Some(
                "link set lo up\n\
                 link add br0 type bridge\n\
                 link set br0 up\n",
            ),
        )?;
        let tap = open_tap(&ns)?;
        run(
            Command::new(&ip).args(["-n", &name, "link", "set", "tap0", "master", "br0", "up"]),
            None,
        )?;
        host_veth(&ip, &l, &name)?;
        run(
            Command::new(&ip).args(["-n", &name, "link", "set", "eth0", "master", "br0", "up"]),
            None,
        )?;
        let netns = fs::File::open(&ns).map_err(|e| format!("open {}: {e}", ns.display()))?;
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
pub fn attach_vm(dir: &Path, policy: &Policy) -> Result<NetLease, String> {
    let l = NetLease::load(dir).ok_or("the microVM has no network lease (net.json)")?;
    let ns = l.netns();
    if !ns.exists() || !link_exists(&l.link()) {
        return Err(format!(
            "the microVM's network ({} and {}) is gone",
            ns.display(),
            l.link()
        ));
    }
    apply_vm_rules(&l, &ns, policy)?;
    Ok(l)
}

/// [`apply_rules`] for a microVM: its host table (closed under `None`) and the bridge
/// table inside its namespace `ns`.
fn apply_vm_rules(l: &NetLease, ns: &Path, policy: &Policy) -> Result<(), String> {
    let nft = tool("nft")?;
    let host = host_machine_ruleset(l, policy).unwrap_or_else(|| host_closed_ruleset(l));
    run(Command::new(&nft).arg("-f").arg("-"), Some(&host))
        .map_err(|e| format!("installing the host rules of {}: {e}", l.link()))?;
    run(
        Command::new(tool("nsenter")?)
            .arg(format!("--net={}", ns.display()))
            .arg(&nft)
            .arg("-f")
            .arg("-"),
        Some(&vm_bridge_ruleset(l, policy)),
    )
    .map_err(|e| format!("installing the rules in the microVM's namespace: {e}"))
}

/// Opens the tap `tap0` in the namespace `ns` (made there by this call, gone when the
/// last fd of it closes), with the virtio-net header QEMU's device expects.
fn open_tap(ns: &Path) -> Result<fs::File, String> {
    let nsf = fs::File::open(ns).map_err(|e| format!("open {}: {e}", ns.display()))?;
    std::thread::spawn(move || -> Result<fs::File, String> {
        // A network namespace is per thread: this thread alone enters the machine's.
        crate::sys::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET)
            .map_err(|e| format!("enter the microVM's namespace: {e}"))?;
        let tun = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .map_err(|e| format!("open /dev/net/tun (modprobe tun): {e}"))?;
        const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
        const IFF_TAP: i16 = 0x0002;
        const IFF_NO_PI: i16 = 0x1000;
        const IFF_VNET_HDR: i16 = 0x4000;
        // struct ifreq: the name (16 bytes), then the flags (a short) in a 24-byte union.
        let mut ifr = [0u8; 40];
        ifr[..4].copy_from_slice(b"tap0");
        ifr[16..18].copy_from_slice(&(IFF_TAP | IFF_NO_PI | IFF_VNET_HDR).to_ne_bytes());
        // SAFETY: an open tun fd and an ifreq-sized buffer we own.
        if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) } < 0 {
            return Err(format!(
                "create the microVM's tap: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(tun)
    })
    .join()
    .map_err(|_| "the tap thread panicked".to_string())?
}

/// Deletes a host link; whether it is gone.
fn delete_link(link: &str) -> bool {
    if link_exists(link) {
        if let Some(ip) = crate::doctor::which("ip") {
            let _ = run(Command::new(ip).args(["link", "del", link]), None);
        }
    }
    !link_exists(link)
}

/// Whether a network interface of this name exists in the host's namespace.
pub fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Host links `lk<slot>` that exist now.
pub fn machine_links() -> Vec<String> {
    fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n.strip_prefix("lk")
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect()
}

/// Removes what a crash left, host-wide: leases whose machine directory no longer holds
/// that lease (older than a minute, so a machine being set up is never touched) and links
/// `lk<slot>` with no lease. Returns the slots removed.
pub fn cleanup_stale() -> Vec<u32> {
    let mut removed = Vec::new();
    for e in fs::read_dir(SLOTS_DIR).into_iter().flatten().flatten() {
        let Ok(slot) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let owner = PathBuf::from(std::ffi::OsString::from(
            String::from_utf8_lossy(&fs::read(e.path()).unwrap_or_default()).into_owned(),
        ));
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .map(|t| t.elapsed().unwrap_or_default() > Duration::from_secs(60))
            .unwrap_or(false);
        let held = NetLease::load(&owner).is_some_and(|l| l.slot == slot);
        // Counted only when every part is gone: without the rights to delete (not root)
        // nothing was removed, whatever was tried.
        if old && !held {
            let link = delete_link(&format!("lk{slot}"));
            let ns = delete_netns(&format!("{VM_NETNS_PREFIX}{slot}"));
            if link && ns && release_slot(slot) {
                removed.push(slot);
            }
        }
    }
    for link in machine_links() {
        let slot: u32 = link[2..].parse().unwrap_or(u32::MAX);
        if !Path::new(SLOTS_DIR).join(slot.to_string()).exists() && delete_link(&link) {
            removed.push(slot);
        }
    }
    for e in fs::read_dir("/run/netns").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(slot) = name
            .strip_prefix(VM_NETNS_PREFIX)
            .and_then(|d| d.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(SLOTS_DIR).join(slot.to_string()).exists()
            && delete_netns(&name)
            && !removed.contains(&slot)
        {
            removed.push(slot);
        }
    }
    for table in machine_tables() {
        let slot: u32 = table[TABLE.len() + 3..].parse().unwrap_or(u32::MAX);
        if !Path::new(SLOTS_DIR).join(slot.to_string()).exists()
            && delete_machine_table(&table)
            && !removed.contains(&slot)
        {
            removed.push(slot);
        }
    }
    removed
}

/// The machines' own host tables (`ip locker_lk<slot>`) that exist now.
fn machine_tables() -> Vec<String> {
    let Some(nft) = crate::doctor::which("nft") else {
        return Vec::new();
    };
    let Ok(out) = Command::new(nft)
        .args(["list", "tables", "ip"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    let prefix = format!("{TABLE}_lk");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table ip "))
        .filter(|t| {
            t.strip_prefix(&prefix)
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_owned)
        .collect()
}

/// The cached verdict of [`probe`]: whether egress other than `none` can be enforced.
static STATUS: Mutex<Option<(Instant, Result<String, String>)>> = Mutex::new(None);

/// Whether egress enforcement works on this host (the last [`probe`]'s verdict, probed
/// again after a minute, or ten seconds after a failure). Blocking.
pub fn status() -> Result<String, String> {
    let mut st = STATUS.lock().expect("egress status lock");
    if let Some((at, r)) = &*st {
        let ttl = if r.is_ok() { 60 } else { 10 };
        if at.elapsed() < Duration::from_secs(ttl) {
            return r.clone();
        }
    }
    let r = probe();
    *st = Some((Instant::now(), r.clone()));
    r
}

/// The cached verdict only, without probing (for `/healthz`); `None` before any probe.
pub fn cached_status() -> Option<Result<String, String>> {
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
pub fn probe() -> Result<String, String> {
    ensure_host()?;
    let ip = tool("ip")?;
    let name = format!("locker-probe-{}", std::process::id());
    let ns = PathBuf::from(format!("/run/netns/{name}"));
    let owner = PathBuf::from(format!("/run/locker/{name}"));
    let _ = run(Command::new(&ip).args(["netns", "del", &name]), None);
    run(Command::new(&ip).args(["netns", "add", &name]), None)?;
    let _ = fs::create_dir_all(&owner);
    let result = (|| {
        let slot = lease_slot(&owner)?;
        let l = NetLease { slot };
        fs::write(
            owner.join("net.json"),
            serde_json::to_vec(&l).expect("lease serializes"),
        )
        .map_err(|e| format!("write the probe's lease: {e}"))?;
        wire(&l, &ns)?;
        let listener =
            TcpListener::bind("0.0.0.0:0").map_err(|e| format!("probe listener: {e}"))?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let targets = [
            SocketAddr::from((l.host_ip(), port)),
            SocketAddr::from(([169, 254, 169, 254], 80)),
        ];
        let nsf = fs::File::open(&ns).map_err(|e| format!("open {}: {e}", ns.display()))?;
        let reached = std::thread::spawn(move || -> Result<Vec<SocketAddr>, String> {
            // A network namespace is per thread: this thread alone enters the probe's.
            crate::sys::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET)
                .map_err(|e| format!("enter the probe namespace: {e}"))?;
            Ok(targets
                .iter()
                .filter(|a| TcpStream::connect_timeout(a, Duration::from_millis(300)).is_ok())
                .copied()
                .collect())
        })
        .join()
        .map_err(|_| "the probe thread panicked".to_string())??;
        drop(listener);
        if reached.is_empty() {
            Ok(format!(
                "nftables table inet {TABLE} installed; a probe namespace could not reach the host or the metadata address"
            ))
        } else {
            Err(format!(
                "enforcement does not hold: a probe namespace reached {reached:?} (another firewall accepting first?)"
            ))
        }
    })();
    detach(&owner, None);
    let _ = fs::remove_dir_all(&owner);
    let _ = run(Command::new(&ip).args(["netns", "del", &name]), None);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_a_slot() {
        let l = NetLease { slot: 0 };
        assert_eq!(l.host_ip(), Ipv4Addr::new(100, 96, 0, 1));
        assert_eq!(l.machine_ip(), Ipv4Addr::new(100, 96, 0, 2));
        let l = NetLease { slot: SLOTS - 1 };
        assert_eq!(l.machine_ip(), Ipv4Addr::new(100, 111, 255, 254));
        assert!(l.link().len() <= 15);
        assert_eq!(ns_target(Path::new("/proc/42/ns/net")).unwrap(), "42");
        assert_eq!(ns_target(Path::new("/run/netns/x")).unwrap(), "x");
    }

    #[test]
    fn cidrs_parse_mask_and_merge() {
        let c = Cidr::parse("10.1.2.3/8").unwrap();
        assert_eq!(c.to_string(), "10.0.0.0/8");
        assert!(c.contains(Ipv4Addr::new(10, 200, 0, 1)));
        assert!(!c.contains(Ipv4Addr::new(11, 0, 0, 1)));
        assert_eq!(Cidr::parse("1.2.3.4").unwrap().to_string(), "1.2.3.4/32");
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains(Ipv4Addr::new(8, 8, 8, 8)));
        for bad in [
            "1.2.3.4/33",
            "1.2.3/8",
            "example.com",
            "::1/128",
            "1.2.3.4/",
        ] {
            assert!(Cidr::parse(bad).is_none(), "{bad}");
        }
        let merged = merge_cidrs(&[
            Cidr::parse("10.1.0.0/16").unwrap(),
            Cidr::parse("10.0.0.0/8").unwrap(),
            Cidr::parse("192.168.1.1").unwrap(),
            Cidr::parse("10.0.0.0/8").unwrap(),
        ]);
        assert_eq!(join(&merged), "10.0.0.0/8, 192.168.1.1/32");
    }

    #[test]
    fn rules_steer_allow_to_the_server_and_drop_the_rest() {
        let l = NetLease { slot: 5 };
        assert!(host_machine_ruleset(&l, &Policy::None).is_none());
        let all = host_machine_ruleset(&l, &Policy::All { dns_port: 5353 }).unwrap();
        assert!(all.contains(
            "ip daddr 100.96.0.21 udp dport 53 ct mark set 0x4c4b0045 redirect to :5353"
        ));
        assert!(
            !all.contains("forward"),
            "all forwards by the static table: {all}"
        );
        let allow = Policy::Allow {
            cidrs: vec![Cidr::parse("198.18.0.0/24").unwrap()],
            proxy_port: 4000,
            dns_port: 5353,
        };
        let r = host_machine_ruleset(&l, &allow).unwrap();
        assert!(r.contains("table ip locker_lk5"), "{r}");
        assert!(
            r.contains("meta l4proto tcp ct mark set 0x4c4b0045 redirect to :4000"),
            "{r}"
        );
        assert!(r.contains("ip daddr { 198.18.0.0/24 } return"), "{r}");
        assert!(
            r.contains("iifname \"lk5\" ip daddr != { 198.18.0.0/24 } drop"),
            "{r}"
        );
        let none_allowed = Policy::Allow {
            cidrs: vec![],
            proxy_port: 4000,
            dns_port: 5353,
        };
        let r = host_machine_ruleset(&l, &none_allowed).unwrap();
        assert!(r.contains("iifname \"lk5\" drop"), "{r}");
        let inner = machine_ruleset(&l, &allow);
        assert!(
            inner.contains("ip daddr 100.96.0.21 udp dport 53 accept"),
            "{inner}"
        );
        assert!(inner.contains("meta l4proto tcp accept"), "{inner}");
        assert!(inner.trim_end().ends_with("}"), "{inner}");
        assert!(!machine_ruleset(&l, &Policy::All { dns_port: 1 }).contains("l4proto"));
        assert!(host_ruleset().contains("ct mark 0x4c4b0045 ct status dnat accept"));
    }

    #[test]
    fn a_microvm_bridge_checks_the_guest_frames_and_closes_under_none() {
        let l = NetLease { slot: 5 };
        assert_eq!(l.netns(), Path::new("/run/netns/locker-lk5"));
        let closed = vm_bridge_ruleset(&l, &Policy::None);
        assert!(
            closed.contains("iifname != \"tap0\" accept\n    drop\n"),
            "{closed}"
        );
        assert!(host_closed_ruleset(&l).contains("iifname \"lk5\" drop"));
        let allow = Policy::Allow {
            cidrs: vec![Cidr::parse("198.18.0.0/24").unwrap()],
            proxy_port: 4000,
            dns_port: 5353,
        };
        let r = vm_bridge_ruleset(&l, &allow);
        for want in [
            "table bridge locker",
            "ether type != ip drop",
            "ip saddr != 100.96.0.22 drop",
            "ip daddr 100.96.0.21 udp dport 53 accept",
            "ip daddr { 198.18.0.0/24 } accept",
            "ip protocol tcp accept",
        ] {
            assert!(r.contains(want), "{want}: {r}");
        }
        assert!(
            r.trim_end().ends_with("drop\n  }\n}") || r.contains("    drop\n  }"),
            "{r}"
        );
        let all = vm_bridge_ruleset(&l, &Policy::All { dns_port: 1 });
        assert!(!all.contains("ip protocol tcp"), "{all}");
    }
}
