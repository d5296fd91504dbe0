//! The links of a machine: its veth pair, a microVM's tap, bridge and named namespace.
//!
//! Owns creating and deleting them with `ip` and the tun device. It does not lease the
//! subnet ([`super::lease`]) or install any rule ([`super::nft`]); the callers in
//! [`super::attach`] order these steps so that no link exists before its rules.

use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;

use super::lease::NetLease;
use super::nft::{run, tool};
use super::NetError;

/// Wires the namespace `ns` (a path like `/proc/<pid>/ns/net`) to the host through the
/// veth of lease `l`.
pub(super) fn wire(l: &NetLease, ns: &Path) -> Result<(), NetError> {
    let (ip, nsenter) = (tool("ip")?, tool("nsenter")?);
    // `ip link add … netns` takes a pid or a name.
    host_veth(&ip, l, &ns_target(ns)?)?;
    run(
        "configuring the machine's eth0",
        Command::new(&nsenter)
            .arg(format!("--net={}", ns.display()))
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
    )
}

/// Creates the lease's veth: host end `lk<slot>` with the host address, up, IPv4 only and
/// strict reverse-path filtering (only the machine's own subnet enters by it; the forward
/// chain checks the source range as well); machine end `eth0` in namespace `ns_arg` (a pid
/// or a name, see [`ns_target`]).
pub(super) fn host_veth(ip: &Path, l: &NetLease, ns_arg: &str) -> Result<(), NetError> {
    let link = l.link();
    run(
        &format!("creating the veth {link}"),
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
pub(super) fn ns_target(ns: &Path) -> Result<String, NetError> {
    let s = ns.to_string_lossy();
    if let Some(rest) = s.strip_prefix("/proc/") {
        if let Some(pid) = rest.strip_suffix("/ns/net") {
            return Ok(pid.to_owned());
        }
    }
    if let Some(name) = s.strip_prefix("/run/netns/") {
        return Ok(name.to_owned());
    }
    Err(NetError::NamespacePath(ns.to_owned()))
}

/// Opens the tap `tap0` in the namespace `ns` (made there by this call, gone when the
/// last fd of it closes), with the virtio-net header QEMU's device expects.
pub(super) fn open_tap(ns: &Path) -> Result<fs::File, NetError> {
    let nsf = fs::File::open(ns).map_err(NetError::io(format!("open {}", ns.display())))?;
    std::thread::spawn(move || -> Result<fs::File, NetError> {
        // A network namespace is per thread: this thread alone enters the machine's.
        crate::sys::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET)
            .map_err(NetError::io("enter the microVM's namespace"))?;
        let tun = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .map_err(NetError::io("open /dev/net/tun (modprobe tun)"))?;
        const IFF_TAP: u16 = 0x0002;
        const IFF_NO_PI: u16 = 0x1000;
        const IFF_VNET_HDR: u16 = 0x4000;
        locker_sys::net::tun_attach(tun.as_raw_fd(), "tap0", IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
            .map_err(NetError::io("create the microVM's tap"))?;
        Ok(tun)
    })
    .join()
    .map_err(|_| NetError::Panicked("the tap thread"))?
}

/// Deletes a host link; whether it is gone.
pub(super) fn delete_link(link: &str) -> bool {
    if link_exists(link) {
        if let Some(ip) = crate::doctor::which("ip") {
            let _ = run(
                "deleting a machine's link",
                Command::new(ip).args(["link", "del", link]),
                None,
            );
        }
    }
    !link_exists(link)
}

/// Whether a network interface of this name exists in this process's network namespace.
/// Asked of the kernel (`if_nametoindex`), not of `/sys/class/net`: sysfs shows the
/// namespace of whoever mounted it, which is not this process's when it was started in
/// another network namespace without a sysfs of its own (`nsenter --net`, some containers).
pub fn link_exists(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: a NUL-terminated string that outlives the call.
    unsafe { libc::if_nametoindex(c.as_ptr()) != 0 }
}

/// Host links `lk<slot>` that exist now, in this process's network namespace
/// (`/proc/self/net/dev`, for the reason [`link_exists`] gives).
pub fn machine_links() -> Vec<String> {
    fs::read_to_string("/proc/self/net/dev")
        .unwrap_or_default()
        .lines()
        .skip(2)
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim().to_owned()))
        .filter(|n| {
            n.strip_prefix("lk")
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect()
}

/// Makes the named network namespace `/run/netns/<name>`.
pub(super) fn add_netns(name: &str) -> Result<(), NetError> {
    run(
        &format!("adding the network namespace {name}"),
        Command::new(tool("ip")?).args(["netns", "add", name]),
        None,
    )
}

/// Deletes a named network namespace (a microVM's bridge, the veth's machine end and its
/// ruleset go with it); whether it is gone.
pub(super) fn delete_netns(name: &str) -> bool {
    let path = Path::new("/run/netns").join(name);
    if path.exists() {
        if let Some(ip) = crate::doctor::which("ip") {
            let _ = run(
                "deleting a network namespace",
                Command::new(ip).args(["netns", "del", name]),
                None,
            );
        }
    }
    !path.exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_paths_name_a_pid_or_a_name() {
        assert_eq!(ns_target(Path::new("/proc/42/ns/net")).unwrap(), "42");
        assert_eq!(ns_target(Path::new("/run/netns/x")).unwrap(), "x");
        let e = ns_target(Path::new("/tmp/ns")).unwrap_err();
        assert_eq!(e.to_string(), "unsupported namespace path /tmp/ns");
    }
}
