//! Network egress of machines, enforced outside them.
//!
//! Owns the host side of a machine's network: its veth pair, its subnet lease, the
//! host-wide nftables table `inet locker`, and the ruleset inside the machine's network
//! namespace. It does not own the policy's API shape (the server does).
//!
//! A machine with egress `none` (the default) is untouched: loopback only, no veth, no
//! cost. A machine with egress `all` gets:
//! - a /30 of `100.96.0.0/12` leased host-wide (`/run/locker/net-slots/<slot>`, the file
//!   names the machine's directory, which holds `net.json`); host end `.1`, machine `.2`;
//! - a veth pair: host end `lk<slot>`, machine end `eth0` in the machine's network
//!   namespace (owned by the host's user namespace: the machine's root cannot change it),
//!   with its address, a default route via the host end and an nftables ruleset inside
//!   (defence in depth: no metadata, no host end, no other machine, no IPv6, nothing in);
//! - the host table `inet locker` (shared, static, replaced atomically and idempotently):
//!   *input* drops everything arriving from `lk*` (every address of the host, Locker's
//!   ports, the host's 127.0.0.0/8); *forward* drops from `lk*` to 169.254.0.0/16,
//!   100.96.0.0/12 (other machines), 127/8, multicast and broadcast, every IPv6 packet and
//!   any spoofed source, and lets nothing into `lk*` but replies; *postrouting*
//!   masquerades machine traffic leaving by any other interface.
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
/// hold without it).
fn machine_ruleset(l: &NetLease) -> String {
    format!(
        "table inet {TABLE} {{
  chain output {{
    type filter hook output priority 0; policy accept;
    oifname \"lo\" accept
    meta nfproto ipv6 drop
    ip daddr {{ {NEVER_V4}, {host} }} drop
  }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname \"lo\" accept
    ct state established,related accept
    drop
  }}
}}
",
        host = l.host_ip()
    )
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

fn release_slot(slot: u32) {
    let _ = fs::remove_file(Path::new(SLOTS_DIR).join(slot.to_string()));
}

/// Wires the namespace `ns` (a path like `/proc/<pid>/ns/net`) to the host through the
/// veth of lease `l`.
fn wire(l: &NetLease, ns: &Path, machine_rules: bool) -> Result<(), String> {
    let (ip, nsenter) = (tool("ip")?, tool("nsenter")?);
    let link = l.link();
    // `ip link add … netns` takes a pid or a name.
    let ns_arg = ns_target(ns)?;
    run(
        Command::new(&ip).arg("-batch").arg("-"),
        Some(&format!(
            "link add {link} type veth peer name eth0 netns {ns_arg}\n\
             addr add {}/30 dev {link}\n\
             link set {link} up\n",
            l.host_ip()
        )),
    )?;
    // Strict reverse-path filtering on the host end: only the machine's own subnet
    // enters by it (the forward chain checks the source range as well).
    let _ = fs::write(format!("/proc/sys/net/ipv4/conf/{link}/rp_filter"), "1");
    let _ = fs::write(format!("/proc/sys/net/ipv6/conf/{link}/disable_ipv6"), "1");
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
    if machine_rules {
        run(
            Command::new(&nsenter)
                .arg(&net_arg)
                .arg(tool("nft")?)
                .arg("-f")
                .arg("-"),
            Some(&machine_ruleset(l)),
        )?;
    }
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

/// Gives the running machine in `dir` (its PID 1 is `pid`) egress `all`: leases a subnet,
/// wires the veth and the machine's rules. Idempotent; undone by [`detach`]. The host
/// table must be in place ([`status`] checks and installs it).
pub fn attach(dir: &Path, pid: i32) -> Result<NetLease, String> {
    if let Some(l) = NetLease::load(dir) {
        if link_exists(&l.link()) {
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
        wire(&l, Path::new(&format!("/proc/{pid}/ns/net")), true)
    })();
    match result {
        Ok(()) => Ok(l),
        Err(e) => {
            detach(dir, Some(pid));
            Err(e)
        }
    }
}

/// Takes egress away from the machine in `dir`: removes its veth (both ends), the
/// ruleset inside (when `pid`, its PID 1, still runs), `net.json` and the subnet lease.
/// Safe to call when nothing is there.
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
    let _ = fs::remove_file(dir.join("net.json"));
    release_slot(l.slot);
}

fn delete_link(link: &str) {
    if link_exists(link) {
        if let Some(ip) = crate::doctor::which("ip") {
            let _ = run(Command::new(ip).args(["link", "del", link]), None);
        }
    }
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
        if old && !held {
            delete_link(&format!("lk{slot}"));
            release_slot(slot);
            removed.push(slot);
        }
    }
    for link in machine_links() {
        let slot: u32 = link[2..].parse().unwrap_or(u32::MAX);
        if !Path::new(SLOTS_DIR).join(slot.to_string()).exists() {
            delete_link(&link);
            removed.push(slot);
        }
    }
    removed
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
        wire(&l, &ns, false)?;
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
}
