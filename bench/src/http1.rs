//! A minimal HTTP/1.1 client on one kept-alive TCP connection, and the way into a machine's
//! network namespace. The ports rows drive both sides of every comparison (through Locker's
//! port proxy, and straight to the server inside the machine) with this same code, so the
//! only difference between two rows is the path the bytes take.
//!
//! Owns its socket and nothing else. It reads `Content-Length` bodies only: the bench's
//! server in the machine sends nothing else, and the proxy passes the length through; any
//! other framing is an error that says so, never a silent mismeasure.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// How long one read may wait before the request counts as failed.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// One connection, kept alive across requests.
pub struct Conn {
    stream: TcpStream,
    /// The `Host` header, and the `Authorization` header when the server needs one.
    host: String,
    auth: Option<String>,
    /// Bytes read past the end of the previous answer's head, not yet consumed.
    buf: Vec<u8>,
    /// A body is read through this, then dropped: only its length matters here.
    scratch: Vec<u8>,
    /// Whether the server said it closes the connection after this answer.
    closing: bool,
}

/// What one request got.
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    /// From writing the request to the first byte of the answer.
    pub first_byte: Duration,
    /// From writing the request to the last byte of the body.
    pub total: Duration,
    pub body_bytes: u64,
}

impl Conn {
    /// A client on `stream` (Nagle off: the requests are small and latency is the point).
    pub fn new(stream: TcpStream, host: &str, bearer: Option<&str>) -> io::Result<Conn> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        Ok(Conn {
            stream,
            host: host.to_owned(),
            auth: bearer.map(|k| format!("Authorization: Bearer {k}\r\n")),
            buf: Vec::with_capacity(16 << 10),
            scratch: vec![0; 1 << 20],
            closing: false,
        })
    }

    /// A client connected to `addr` (the Locker server on loopback).
    pub fn to(addr: SocketAddr, bearer: Option<&str>) -> anyhow::Result<Conn> {
        let s = TcpStream::connect(addr).with_context(|| format!("connect to {addr}"))?;
        Ok(Conn::new(s, &addr.to_string(), bearer)?)
    }

    /// `GET path`, reading the whole answer; fails on a status other than 200 (after reading
    /// its body, so the connection stays usable for the error's sake).
    pub fn get(&mut self, path: &str) -> anyhow::Result<Answer> {
        if self.closing {
            bail!("the server closed this connection after its last answer");
        }
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\n{}Accept: */*\r\n\r\n",
            self.host,
            self.auth.as_deref().unwrap_or("")
        );
        let t0 = Instant::now();
        self.stream
            .write_all(req.as_bytes())
            .with_context(|| format!("send GET {path}"))?;
        let mut first_byte = None;
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i + 4;
            }
            if self.buf.len() > 64 << 10 {
                bail!("GET {path}: an answer head over 64 KiB");
            }
            let n = self
                .fill()
                .with_context(|| format!("GET {path}: read the answer"))?;
            if n == 0 {
                bail!("GET {path}: the connection closed before an answer");
            }
            first_byte.get_or_insert_with(|| t0.elapsed());
        };
        let first_byte = first_byte.unwrap_or_else(|| t0.elapsed());
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("GET {path}: no status in {head:?}"))?;
        let mut length = None;
        for line in head.lines().skip(1) {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            match k.as_str() {
                "content-length" => length = v.parse::<u64>().ok(),
                "transfer-encoding" => {
                    bail!("GET {path}: a `Transfer-Encoding: {v}` body; this client reads Content-Length bodies only")
                }
                "connection" if v.eq_ignore_ascii_case("close") => self.closing = true,
                _ => {}
            }
        }
        let length =
            length.with_context(|| format!("GET {path}: no Content-Length in {head:?}"))?;
        self.buf.drain(..head_end);
        let mut left = length;
        let buffered = (self.buf.len() as u64).min(left);
        self.buf.drain(..buffered as usize);
        left -= buffered;
        while left > 0 {
            let want = (left as usize).min(self.scratch.len());
            let n = self
                .stream
                .read(&mut self.scratch[..want])
                .with_context(|| format!("GET {path}: read the body ({left} bytes left)"))?;
            if n == 0 {
                bail!(
                    "GET {path}: the connection closed with {left} of {length} body bytes unread"
                );
            }
            left -= n as u64;
        }
        let total = t0.elapsed();
        if status != 200 {
            bail!("GET {path}: HTTP {status}: {head}");
        }
        Ok(Answer {
            first_byte,
            total,
            body_bytes: length,
        })
    }

    fn fill(&mut self) -> io::Result<usize> {
        let mut chunk = [0u8; 16 << 10];
        let n = self.stream.read(&mut chunk)?;
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Makes TCP connections to `127.0.0.1` ports inside the network namespace of a process
/// (what `nsenter --net=/proc/<pid>/ns/net` would give a client), from this process: a
/// socket belongs to the namespace it was created in, so one thread of ours enters the
/// namespace once and makes every socket asked for; the sockets are then used from anywhere.
/// The thread ends when the dialer is dropped.
pub struct NetnsDialer {
    ask: mpsc::Sender<(u16, mpsc::Sender<io::Result<TcpStream>>)>,
}

impl NetnsDialer {
    pub fn enter(pid: u32) -> anyhow::Result<NetnsDialer> {
        let ns_path = format!("/proc/{pid}/ns/net");
        let ns = File::open(&ns_path).with_context(|| format!("open {ns_path}"))?;
        let own = std::fs::read_link("/proc/self/ns/net").context("read /proc/self/ns/net")?;
        let theirs = std::fs::read_link(&ns_path).with_context(|| format!("read {ns_path}"))?;
        if own == theirs {
            bail!("process {pid} is in this host's network namespace, not a machine's");
        }
        let (ask, asked) = mpsc::channel::<(u16, mpsc::Sender<io::Result<TcpStream>>)>();
        let (ready_tx, ready) = mpsc::channel();
        std::thread::spawn(move || {
            // SAFETY: setns on an open namespace file; it moves only this thread, which does
            // nothing but make sockets until the dialer is dropped.
            let entered = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            let _ = ready_tx.send(if entered == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            });
            if entered != 0 {
                return;
            }
            for (port, reply) in asked {
                let _ = reply.send(TcpStream::connect(("127.0.0.1", port)));
            }
        });
        ready
            .recv()
            .context("the namespace thread ended")?
            .with_context(|| format!("setns into {ns_path}"))?;
        Ok(NetnsDialer { ask })
    }

    /// A connection to `127.0.0.1:port` in the namespace.
    pub fn connect(&self, port: u16) -> anyhow::Result<TcpStream> {
        let (tx, rx) = mpsc::channel();
        self.ask
            .send((port, tx))
            .map_err(|_| anyhow::anyhow!("the namespace thread ended"))?;
        rx.recv()
            .context("the namespace thread ended")?
            .with_context(|| format!("connect to 127.0.0.1:{port} in the machine's namespace"))
    }
}

/// The host pid of a process of sandbox `id` whose command line contains `needle`, found
/// through the machine's cgroup (v1 `pids`/`freezer`, or v2), walked to the commands'
/// cgroups below it.
pub fn sandbox_pid(id: &str, needle: &str) -> Option<u32> {
    [
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/freezer",
        "/sys/fs/cgroup",
    ]
    .iter()
    .filter_map(|r| locker_tests::machine_cgroup(Path::new(r), id))
    .find_map(|p| find_pid(&p, needle, 0))
}

fn find_pid(dir: &Path, needle: &str, depth: usize) -> Option<u32> {
    if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmd).contains(needle) {
                return Some(pid);
            }
        }
    }
    if depth > 6 {
        return None;
    }
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .find_map(|e| find_pid(&e.path(), needle, depth + 1))
}
