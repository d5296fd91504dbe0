//! The way to a port in a machine that the server's proxy takes ([`dial`]): for a jail, a
//! TCP connection the host makes inside the jail's network namespace; for a microVM, whose
//! network is its guest kernel's, the agent's tunnel ([`crate::ports::connect`]).
//!
//! The jail's way: a short-lived thread enters the namespace (`setns` on the handle the
//! machine took when it started, never a path that a reused pid could redirect), connects
//! to the loopback there and ends; the socket stays in that namespace and is driven from
//! here like any other. Bytes then go kernel to kernel: no agent frames, copies or credits
//! (the tunnel cost five copies and a credit frame per 64 KiB). Nothing is added to the
//! machine: no route, no address, no listener; the socket belongs to the host process and
//! is inbound only, so the machine's egress policy is unchanged. The machine's own nftables
//! rules apply to it as to any socket there: loopback is never filtered by them.
//!
//! Connections per machine are capped ([`MAX_CONNECTIONS`]): a flood of requests to a port
//! costs the host a bounded number of sockets.

use std::io;
use std::net::{SocketAddr, TcpStream as StdTcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::node::Machine;
use crate::ports::{self, PortError, Tunnel};

/// Direct connections open at once into one jail.
pub const MAX_CONNECTIONS: usize = 256;

/// How long a connect to the machine's loopback may take (it is local: a full backlog).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A jail's network namespace, held from the machine's start, and its open connections.
#[derive(Debug)]
pub struct Netns {
    fd: OwnedFd,
    open: Arc<AtomicUsize>,
}

impl Netns {
    /// The network namespace of process `pid` (the jail's PID 1, just started or adopted
    /// alive).
    pub fn of_pid(pid: i32) -> io::Result<Self> {
        let file = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
        Ok(Self {
            fd: file.into(),
            open: Arc::new(AtomicUsize::new(0)),
        })
    }
}

/// A byte stream to a port in a machine.
pub enum PortConn {
    /// A socket in the jail's namespace; the count of open ones drops with it.
    Tcp(TcpStream, Slot),
    /// The agent's tunnel (microVMs, and jails whose namespace handle is missing).
    Tunnel(Tunnel),
}

/// One of a jail's [`MAX_CONNECTIONS`], given back when dropped.
pub struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Connects to `127.0.0.1:port` (else `[::1]:port`) in `machine`.
pub async fn dial(machine: &Machine, port: u16) -> Result<PortConn, PortError> {
    let Some(ns) = machine.netns() else {
        return ports::connect(&machine.agent, port)
            .await
            .map(PortConn::Tunnel);
    };
    if ns.open.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
        ns.open.fetch_sub(1, Ordering::AcqRel);
        return Err(PortError::Busy(MAX_CONNECTIONS));
    }
    let slot = Slot(ns.open.clone());
    let fd = ns.fd.try_clone().map_err(PortError::Dial)?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    // A thread of its own: it ends with the connect, so no thread of the runtime's pools is
    // ever left in the machine's namespace.
    std::thread::Builder::new()
        .name("port-dial".into())
        .spawn(move || {
            let _ = tx.send(connect_in(&fd, port));
        })
        .map_err(PortError::Dial)?;
    let stream = rx
        .await
        .map_err(|_| PortError::Dial(io::Error::other("the dialing thread died")))??;
    stream.set_nodelay(true).map_err(PortError::Dial)?;
    stream.set_nonblocking(true).map_err(PortError::Dial)?;
    let stream = TcpStream::from_std(stream).map_err(PortError::Dial)?;
    Ok(PortConn::Tcp(stream, slot))
}

/// On a thread that will end after it: enter the namespace `ns` and connect there.
fn connect_in(ns: &OwnedFd, port: u16) -> Result<StdTcpStream, PortError> {
    locker_sys::proc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET).map_err(PortError::Dial)?;
    let mut refused = Vec::new();
    for addr in [
        SocketAddr::from(([127, 0, 0, 1], port)),
        SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)),
    ] {
        match StdTcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => refused.push(format!("{addr}: {e}")),
        }
    }
    Err(PortError::NotListening(refused.join("; ")))
}

impl AsyncRead for PortConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PortConn::Tcp(s, _) => Pin::new(s).poll_read(cx, buf),
            PortConn::Tunnel(t) => Pin::new(t).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for PortConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PortConn::Tcp(s, _) => Pin::new(s).poll_write(cx, buf),
            PortConn::Tunnel(t) => Pin::new(t).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PortConn::Tcp(s, _) => Pin::new(s).poll_flush(cx),
            PortConn::Tunnel(t) => Pin::new(t).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PortConn::Tcp(s, _) => Pin::new(s).poll_shutdown(cx),
            PortConn::Tunnel(t) => Pin::new(t).poll_shutdown(cx),
        }
    }
}
