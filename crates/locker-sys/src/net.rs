//! Network interfaces by `ioctl` (what `ifconfig` and `route` do), for a namespace or a
//! guest with no `ip` tool: interface flags, an address and netmask, the default route.
//! Which addresses a machine gets is the caller's policy.

use std::ffi::CString;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::{check_int, owned};

/// `struct rtentry` of `<net/route.h>` (the libc crate has it for uClibc only).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

fn sockaddr_v4(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes; every bit pattern is valid.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn sockaddr_bytes(sa: &libc::sockaddr) -> [u8; 16] {
    // SAFETY: a sockaddr is 16 plain bytes.
    unsafe { std::mem::transmute_copy::<libc::sockaddr, [u8; 16]>(sa) }
}

/// An `ifreq` for `name` with `data` (an address or flags) in its union.
fn ifreq(name: &str, data: &[u8]) -> io::Result<[u8; 40]> {
    if name.is_empty() || name.len() > 15 || name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "bad interface name",
        ));
    }
    let mut r = [0u8; 40];
    r[..name.len()].copy_from_slice(name.as_bytes());
    r[16..16 + data.len()].copy_from_slice(data);
    Ok(r)
}

/// A datagram socket to aim interface `ioctl`s at, in the caller's network namespace.
fn socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; `owned` takes the new fd.
    owned(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) }.into())
}

/// `ioctl(sock, req, arg)` for the interface requests below.
fn ioctl(sock: &OwnedFd, req: libc::c_ulong, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: every caller passes a buffer of the size `req` reads and writes (an ifreq of
    // 40 bytes or an rtentry), alive for the call.
    check_int(unsafe { libc::ioctl(sock.as_raw_fd(), req, arg) })
}

fn up(sock: &OwnedFd, name: &str) -> io::Result<()> {
    let mut r = ifreq(name, &[])?;
    ioctl(sock, libc::SIOCGIFFLAGS, r.as_mut_ptr().cast())?;
    let flags = i16::from_ne_bytes([r[16], r[17]]) | (libc::IFF_UP | libc::IFF_RUNNING) as i16;
    r[16..18].copy_from_slice(&flags.to_ne_bytes());
    ioctl(sock, libc::SIOCSIFFLAGS, r.as_mut_ptr().cast())
}

/// Brings the interface `name` of the current network namespace up.
pub fn link_up(name: &str) -> io::Result<()> {
    up(&socket()?, name)
}

/// Brings the loopback interface of the current network namespace up.
pub fn loopback_up() -> io::Result<()> {
    link_up("lo")
}

/// Gives `iface` the address `addr/prefix`, brings it and `lo` up and makes `gw` the
/// default route (replacing any earlier one): a microVM guest's network.
pub fn configure(iface: &str, addr: Ipv4Addr, prefix: u8, gw: Ipv4Addr) -> io::Result<()> {
    let sock = socket()?;
    up(&sock, "lo")?;
    let mut r = ifreq(iface, &sockaddr_bytes(&sockaddr_v4(addr)))?;
    ioctl(&sock, libc::SIOCSIFADDR, r.as_mut_ptr().cast())?;
    let mask = Ipv4Addr::from(
        u32::MAX
            .checked_shl(32 - u32::from(prefix.min(32)))
            .unwrap_or(0),
    );
    let mut r = ifreq(iface, &sockaddr_bytes(&sockaddr_v4(mask)))?;
    ioctl(&sock, libc::SIOCSIFNETMASK, r.as_mut_ptr().cast())?;
    up(&sock, iface)?;
    let any = Ipv4Addr::UNSPECIFIED;
    let mut dev = CString::new(iface)
        .map_err(|_| io::ErrorKind::InvalidInput)?
        .into_bytes_with_nul();
    let mut rt = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_v4(any),
        rt_gateway: sockaddr_v4(gw),
        rt_genmask: sockaddr_v4(any),
        rt_flags: (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: dev.as_mut_ptr().cast(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    // An earlier default route (a snapshot's guest had another address) goes first.
    let mut old = RtEntry {
        rt_dev: std::ptr::null_mut(),
        rt_flags: libc::RTF_UP as libc::c_ushort,
        rt_gateway: sockaddr_v4(any),
        ..rt
    };
    while ioctl(&sock, libc::SIOCDELRT, (&mut old as *mut RtEntry).cast()).is_ok() {}
    ioctl(&sock, libc::SIOCADDRT, (&mut rt as *mut RtEntry).cast())
}

/// The destination a connection redirected by nftables (`redirect`, `dnat`) had before
/// (`SO_ORIGINAL_DST`); `None` for a connection that was not redirected or not IPv4.
pub fn original_dst(sock: std::os::fd::RawFd) -> Option<std::net::SocketAddrV4> {
    // SAFETY: sockaddr_in is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `addr`, which we own; the
    // descriptor is the caller's, open for the call.
    let r = unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if r != 0 || addr.sin_family != libc::AF_INET as libc::sa_family_t {
        return None;
    }
    Some(std::net::SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}

/// `TUNSETIFF`, not in the `libc` crate.
const TUNSETIFF: libc::c_ulong = 0x4004_54CA;

/// Makes the open `/dev/net/tun` fd `tun` the interface `name` with `flags` (`IFF_TAP`,
/// `IFF_NO_PI`, `IFF_VNET_HDR`: `TUNSETIFF`), in the caller's network namespace.
pub fn tun_attach(tun: std::os::fd::RawFd, name: &str, flags: u16) -> io::Result<()> {
    let mut r = ifreq(name, &flags.to_ne_bytes())?;
    // SAFETY: an ifreq-sized buffer we own, for a request that reads and writes one; the
    // fd is the caller's, open for the call.
    check_int(unsafe { libc::ioctl(tun, TUNSETIFF, r.as_mut_ptr()) })
}
