//! Ports: which TCP ports listen in the machine, and byte tunnels to them for the host's
//! port proxy (`Request::ListPorts`, `Request::Connect`).
//!
//! The way in is this stream and nothing else: the agent connects to the loopback address
//! inside the machine, so no route, address or listener is added to the machine's network
//! and the egress policy is untouched. What answers on the port is hostile input: its bytes
//! are only relayed (flow-controlled by the stream's credit, so a port that answers with
//! gigabytes never outruns the host's reader), and at most [`MAX_TUNNELS`] tunnels are open
//! at once. This room knows nothing of HTTP; the host's proxy does.

use std::fs;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use locker_proto::{AgentError, Chan, EndBody, ErrorCode, PortInfo, Reply};

use crate::conn::{Inbound, Recv, Stream};
use crate::Agent;

/// Tunnels open at once at most; past it a `Connect` answers `Busy` (a 429 at the proxy).
/// Each costs the machine two threads (this stream's and its `port-out` pump), counted in
/// the sandbox's process limit (1024): at 256, a flood of connections takes half of it and
/// the machine's own commands can still start.
pub const MAX_TUNNELS: usize = 256;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// `st` of a listening socket in `/proc/net/tcp*`.
const TCP_LISTEN: &str = "0A";

/// Serves `Request::ListPorts`.
pub fn list(s: &Stream) {
    let mut ports = Vec::new();
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        if let Ok(text) = fs::read_to_string(file) {
            ports.extend(parse_listening(&text, v6));
        }
    }
    let owners = socket_owners();
    let mut out: Vec<PortInfo> = ports
        .into_iter()
        .map(|(address, port, inode)| {
            let owner = owners.iter().find(|(i, _, _)| *i == inode);
            PortInfo {
                port,
                address: address.to_string(),
                pid: owner.map(|o| o.1),
                process: owner.map(|o| o.2.clone()),
            }
        })
        .collect();
    out.sort_by(|a, b| (a.port, &a.address).cmp(&(b.port, &b.address)));
    out.dedup();
    s.end(EndBody::Ports(out));
}

/// (address, port, socket inode) of each listening socket in a `/proc/net/tcp{,6}` text.
fn parse_listening(text: &str, v6: bool) -> Vec<(IpAddr, u16, u64)> {
    let mut out = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 10 || f[3] != TCP_LISTEN {
            continue;
        }
        let Some((addr, port)) = f[1].split_once(':') else {
            continue;
        };
        let (Some(ip), Ok(port), Ok(inode)) = (
            parse_addr(addr, v6),
            u16::from_str_radix(port, 16),
            f[9].parse::<u64>(),
        ) else {
            continue;
        };
        out.push((ip, port, inode));
    }
    out
}

/// The kernel prints an address as 32-bit words in host (little-endian) order.
fn parse_addr(hex: &str, v6: bool) -> Option<IpAddr> {
    let words: Vec<u32> = (0..hex.len() / 8)
        .map(|i| u32::from_str_radix(&hex[i * 8..i * 8 + 8], 16))
        .collect::<Result<_, _>>()
        .ok()?;
    let mut bytes = Vec::with_capacity(16);
    for w in &words {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    match (v6, bytes.len()) {
        (false, 4) => Some(IpAddr::V4(Ipv4Addr::new(
            bytes[0], bytes[1], bytes[2], bytes[3],
        ))),
        (true, 16) => {
            let b: [u8; 16] = bytes.try_into().ok()?;
            let a = Ipv6Addr::from(b);
            // A dual-stack socket bound to an IPv4 address shows it mapped.
            Some(match a.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(a),
            })
        }
        _ => None,
    }
}

/// (socket inode, pid, process name) of every socket a process of the machine holds.
fn socket_owners() -> Vec<(u64, i32, String)> {
    let mut out = Vec::new();
    let Ok(procs) = fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(fds) = fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let mut name: Option<String> = None;
        for fd in fds.flatten() {
            let Ok(link) = fs::read_link(fd.path()) else {
                continue;
            };
            let Some(inode) = link
                .to_str()
                .and_then(|l| l.strip_prefix("socket:["))
                .and_then(|l| l.strip_suffix(']'))
                .and_then(|l| l.parse::<u64>().ok())
            else {
                continue;
            };
            let n = name.get_or_insert_with(|| {
                fs::read_to_string(p.path().join("comm"))
                    .map(|c| c.trim_end().to_owned())
                    .unwrap_or_default()
            });
            out.push((inode, pid, n.clone()));
        }
    }
    out
}

/// Releases a tunnel's place when its stream ends, however it ends.
struct Place<'a>(&'a Agent);

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.0.tunnels.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves `Request::Connect`.
pub fn connect(agent: &Agent, s: &Arc<Stream>, port: u16) {
    if port == 0 {
        return s.fail(AgentError::new(
            ErrorCode::BadRequest,
            "port must be 1-65535",
        ));
    }
    let open = agent.tunnels.fetch_add(1, Ordering::Relaxed);
    let _place = Place(agent);
    if open >= MAX_TUNNELS {
        return s.fail(AgentError::new(
            ErrorCode::Busy,
            format!(
                "{MAX_TUNNELS} connections to the machine's ports are open already (the limit \
                 per sandbox): close some (kept-alive connections, WebSockets) and retry"
            ),
        ));
    }
    let targets = [
        SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        SocketAddr::from((Ipv6Addr::LOCALHOST, port)),
    ];
    let mut last = None;
    let sock = targets.iter().find_map(|a| {
        TcpStream::connect_timeout(a, CONNECT_TIMEOUT)
            .map_err(|e| last = Some(e))
            .ok()
            .map(|t| (t, *a))
    });
    let Some((sock, addr)) = sock else {
        let why = last.map(|e| e.to_string()).unwrap_or_default();
        return s.fail(AgentError::new(
            ErrorCode::NotFound,
            format!("nothing listens on port {port} in the machine (127.0.0.1 and ::1: {why})"),
        ));
    };
    let _ = sock.set_nodelay(true);
    if s.msg(Reply::Connected {
        address: addr.to_string(),
    })
    .is_err()
    {
        return;
    }
    let reader = match sock.try_clone() {
        Ok(r) => r,
        Err(e) => {
            return s.fail(AgentError::new(
                ErrorCode::Busy,
                format!("cannot relay the connection: {e}"),
            ))
        }
    };
    let out = s.clone();
    let pump = std::thread::Builder::new()
        .name("port-out".into())
        .stack_size(128 * 1024)
        .spawn(move || relay_out(reader, &out));
    let pump = match pump {
        Ok(p) => p,
        Err(e) => {
            return s.fail(AgentError::new(
                ErrorCode::Busy,
                format!("cannot relay the connection: {e}"),
            ))
        }
    };
    relay_in(&sock, s);
    let _ = pump.join();
    s.end(EndBody::Ok);
}

/// The connection's answers to the host, until it closes its side or the stream is gone.
fn relay_out(mut sock: TcpStream, s: &Stream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match sock.read(&mut buf) {
            Ok(0) | Err(_) => {
                let _ = s.eof(Chan::Stdout);
                return;
            }
            Ok(n) => {
                if s.data(Chan::Stdout, &buf[..n]).is_err() {
                    // The host went away: unblock the other direction too.
                    let _ = sock.shutdown(Shutdown::Both);
                    return;
                }
            }
        }
    }
}

/// The host's bytes to the connection, until the host's `Eof` (then the write side is
/// closed and the answer may still come) or the stream is gone (then all of it is closed).
fn relay_in(mut sock: &TcpStream, s: &Stream) {
    loop {
        match s.recv(None) {
            Recv::Item(Inbound::Data(chan, bytes)) => {
                if chan == Chan::Stdin && sock.write_all(&bytes).is_err() {
                    let _ = sock.shutdown(Shutdown::Both);
                    return;
                }
                s.credit(chan, bytes.len());
            }
            Recv::Item(Inbound::Eof(Chan::Stdin)) => {
                let _ = sock.shutdown(Shutdown::Write);
                return;
            }
            Recv::Item(_) | Recv::Timeout => {}
            Recv::Gone => {
                let _ = sock.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_sockets_are_read_from_proc_net_tcp() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0 100 0 0 10 0\n\
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 17 1 0 100 0 0 10 0\n\
   2: 0100007F:9C40 0100007F:1F40 01 00000000:00000000 00:00000000 00000000     0        0 99 1 0 100 0 0 10 0\n";
        assert_eq!(
            parse_listening(v4, false),
            vec![
                ("127.0.0.1".parse().unwrap(), 8000, 4242),
                ("0.0.0.0".parse().unwrap(), 22, 17)
            ]
        );
        let v6 = "  sl  local_address                         remote_address                        st\n\
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 55 1\n\
   1: 00000000000000000000000001000000:0050 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 56 1\n\
   2: 0000000000000000FFFF00000100007F:0051 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 57 1\n";
        assert_eq!(
            parse_listening(v6, true),
            vec![
                ("::".parse().unwrap(), 8080, 55),
                ("::1".parse().unwrap(), 80, 56),
                ("127.0.0.1".parse().unwrap(), 81, 57)
            ]
        );
        // Garbage lines are skipped, not fatal.
        assert!(parse_listening("header\nnot a line\n 0: zz:zz 0 0A", false).is_empty());
    }
}
