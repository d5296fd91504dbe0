//! Egress test helpers shared by the egress and microVM tests: test servers in network
//! namespaces of their own, a test CA, and probes of what a sandbox can reach.

use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::server::{Api, Server};
use crate::{register_child, TempDir};

pub const GREETING: &str = "hello-from-the-test-server";

/// Makes network namespace `ns` wired to the host by veth `link`: the host side at `host`,
/// the namespace's `eth0` at `srv` (a /30), with its default route via the host.
pub fn wire_namespace(ns: &str, link: &str, host: Ipv4Addr, srv: Ipv4Addr) {
    ip(&["netns", "add", ns]);
    ip(&[
        "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ]);
    ip(&["addr", "add", &format!("{host}/30"), "dev", link]);
    ip(&["link", "set", link, "up"]);
    for c in [
        vec!["link", "set", "lo", "up"],
        vec!["addr", "add", &format!("{srv}/30"), "dev", "eth0"],
        vec!["link", "set", "eth0", "up"],
        vec!["route", "add", "default", "via", &host.to_string()],
    ] {
        let mut a = vec!["-n", ns];
        a.extend(c.iter().copied());
        ip(&a);
    }
}

pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Test servers in a network namespace of their own, wired to the host by a veth (not a
/// machine's: its name does not start with `lk`): [`GREETING`] on port 8080, an HTTP
/// server answering its `name` on port 80, and on port 443 either a TLS server (openssl
/// `s_server` with the test CA's certificate, serving the file `who`: `tls-<name>`) or a
/// listener that only counts. `hits` counts every connection to the Rust listeners.
/// Removed on drop, also when the test fails.
pub struct TestNet {
    pub ns: String,
    pub link: String,
    pub addr: Ipv4Addr,
    pub port: u16,
    pub name: String,
    pub hits: Arc<AtomicU32>,
    pub stop: Arc<AtomicBool>,
    pub tls: Option<std::process::Child>,
    pub _www: Option<TempDir>,
}

impl TestNet {
    pub fn start() -> TestNet {
        TestNet::start_with(None)
    }

    pub fn start_with(pki: Option<&Pki>) -> TestNet {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let ns = format!("ltsrv-{pid}-{n}");
        let link = format!("lt{}x{n}", pid % 100_000);
        let third = (((pid % 20) * 12 + n) % 256) as u8;
        let (srv, host) = (
            Ipv4Addr::new(198, 18, third, 1),
            Ipv4Addr::new(198, 18, third, 2),
        );
        let name = format!("server-{n}");
        let mut t = TestNet {
            ns: ns.clone(),
            link: link.clone(),
            addr: srv,
            port: 8080,
            name: name.clone(),
            hits: Arc::new(AtomicU32::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            tls: None,
            _www: None,
        };
        wire_namespace(&ns, &link, host, srv);
        let nsf = std::fs::File::open(format!("/run/netns/{ns}")).expect("open the namespace");
        let (stop, hits) = (t.stop.clone(), t.hits.clone());
        let count_443 = pki.is_none();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // SAFETY: setns of this thread only (network namespaces are per thread).
            let r = unsafe { libc::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "enter the test server's namespace");
            let mut ports = vec![8080, 80];
            if count_443 {
                ports.push(443);
            }
            let ls: Vec<(u16, TcpListener)> = ports
                .into_iter()
                .map(|p| {
                    let l = TcpListener::bind((srv, p)).expect("bind a test server");
                    l.set_nonblocking(true).expect("nonblocking");
                    (p, l)
                })
                .collect();
            tx.send(()).expect("ready");
            let mut fds: Vec<libc::pollfd> = ls
                .iter()
                .map(|(_, l)| libc::pollfd {
                    fd: l.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            while !stop.load(Ordering::SeqCst) {
                // SAFETY: poll reads and writes the array we own, of the length we pass.
                unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
                for (i, (p, l)) in ls.iter().enumerate() {
                    fds[i].revents = 0;
                    if let Ok((c, _)) = l.accept() {
                        hits.fetch_add(1, Ordering::SeqCst);
                        let (p, name) = (*p, name.clone());
                        std::thread::spawn(move || serve_one(c, p, &name));
                    }
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the test server started");
        if let Some(pki) = pki {
            let www = TempDir::new("ltwww");
            std::fs::write(www.path().join("who"), format!("tls-{}\n", t.name)).unwrap();
            let child = Command::new("ip")
                .args(["netns", "exec", &ns, "openssl", "s_server", "-quiet", "-4"])
                .args(["-accept", &format!("{srv}:443"), "-WWW"])
                .arg("-cert")
                .arg(pki.dir.path().join("srv.pem"))
                .arg("-key")
                .arg(pki.dir.path().join("srv.key"))
                .current_dir(www.path())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start openssl s_server");
            register_child(child.id());
            t.tls = Some(child);
            t._www = Some(www);
            let deadline = Instant::now() + Duration::from_secs(10);
            while !ns_listens(&ns, 443) {
                assert!(Instant::now() < deadline, "openssl s_server listens");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        t.port = 8080;
        t
    }

    pub fn hits(&self) -> u32 {
        self.hits.load(Ordering::SeqCst)
    }
}

/// Answers one connection of a test server: the greeting on 8080, an HTTP answer naming
/// the server on 80, nothing on 443 (it only counts).
pub fn serve_one(mut c: std::net::TcpStream, port: u16, name: &str) {
    let _ = c.set_nonblocking(false);
    match port {
        8080 => {
            let _ = c.write_all(format!("{GREETING}\n").as_bytes());
        }
        80 => {
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            let mut head = Vec::new();
            let mut b = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match std::io::Read::read(&mut c, &mut b) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&b[..n]),
                }
            }
            if head.starts_with(b"GET /big ") {
                // 64 MiB, for throughput.
                let chunk = vec![b'x'; 1 << 20];
                let _ = c.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        64 << 20
                    )
                    .as_bytes(),
                );
                for _ in 0..64 {
                    if c.write_all(&chunk).is_err() {
                        return;
                    }
                }
                return;
            }
            let body = format!("{name}\n");
            let _ = c.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
        }
        _ => std::thread::sleep(Duration::from_millis(500)),
    }
}

/// Whether something listens on TCP `port` in namespace `ns`.
pub fn ns_listens(ns: &str, port: u16) -> bool {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "cat", "/proc/net/tcp"])
        .output()
        .expect("read the namespace's sockets");
    let hex = format!(":{port:04X} ");
    String::from_utf8_lossy(&out.stdout).lines().any(|l| {
        l.split_whitespace()
            .nth(1)
            .is_some_and(|a| format!("{a} ").contains(&hex))
            && l.split_whitespace().nth(3) == Some("0A")
    })
}

impl Drop for TestNet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(mut c) = self.tls.take() {
            // `ip netns exec` execs openssl: this is openssl's pid.
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// A test CA and a server certificate for `allowed.test` and `*.wild.test`, made with the
/// openssl CLI.
pub struct Pki {
    pub dir: TempDir,
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

impl Pki {
    pub fn new() -> Pki {
        let dir = TempDir::new("ltpki");
        let d = dir.path();
        std::fs::write(
            d.join("ext.cnf"),
            "subjectAltName=DNS:allowed.test,DNS:*.wild.test\n",
        )
        .unwrap();
        let key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
        for cmd in [
            format!("req -x509 {key} -keyout ca.key -out ca.pem -days 2 -subj /CN=locker-test-ca"),
            format!("req {key} -keyout srv.key -out srv.csr -subj /CN=allowed.test"),
            "x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out srv.pem -days 2 -extfile ext.cnf".to_owned(),
        ] {
            let out = Command::new("openssl")
                .args(cmd.split(' '))
                .current_dir(d)
                .output()
                .expect("run openssl (apt-get install openssl)");
            assert!(
                out.status.success(),
                "openssl {cmd}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Pki { dir }
    }

    pub fn ca(&self) -> Vec<u8> {
        std::fs::read(self.dir.path().join("ca.pem")).unwrap()
    }
}

/// What a TCP connection from the sandbox to `addr:port` gives: the first line the peer
/// sends, `CONNECTED` if it sent nothing, or `FAILED`.
pub fn reach(api: &Api, id: &str, addr: &str, port: u16) -> String {
    let r = api.exec(
        id,
        &json!({"shell": format!(
            "timeout 2 bash -c 'exec 3<>/dev/tcp/{addr}/{port} && echo CONNECTED && timeout 1 head -n1 <&3' 2>/dev/null || echo FAILED"
        )}),
    );
    let out = r["stdout"].as_str().unwrap_or_default();
    if out.contains(GREETING) {
        GREETING.into()
    } else if out.contains("CONNECTED") {
        "CONNECTED".into()
    } else {
        "FAILED".into()
    }
}

/// The host's first global IPv4 address (its uplink).
pub fn host_address() -> String {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .expect("ip addr");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.contains(" lk") && !l.contains(" lt"))
        .find_map(|l| l.split_whitespace().nth(3))
        .and_then(|a| a.split('/').next())
        .expect("the host has a global IPv4 address")
        .to_owned()
}

/// The machine's lease (`net.json`) and link, if it has egress.
pub fn lease(srv: &Server, id: &str) -> Option<(u32, String, String)> {
    let v: Value =
        serde_json::from_slice(&std::fs::read(srv.machine_dir(id).join("net.json")).ok()?).ok()?;
    let slot = v["slot"].as_u64()? as u32;
    let base = u32::from(Ipv4Addr::new(100, 96, 0, 0)) + slot * 4;
    Some((
        slot,
        format!("lk{slot}"),
        Ipv4Addr::from(base + 2).to_string(),
    ))
}

pub fn gateway(machine_ip: &str) -> String {
    let ip: Ipv4Addr = machine_ip.parse().unwrap();
    Ipv4Addr::from(u32::from(ip) - 1).to_string()
}

pub fn wait_egress_ok(srv: &Server) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let h = srv.anon().get("/healthz").json();
        match h["egress"].as_str() {
            Some("ok") => return,
            Some("probing") if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            other => panic!("egress enforcement works on this host: {other:?} ({h})"),
        }
    }
}

pub fn nft_ruleset() -> String {
    String::from_utf8_lossy(
        &Command::new("nft")
            .args(["list", "ruleset"])
            .output()
            .expect("nft")
            .stdout,
    )
    .into_owned()
}

/// Runs `script` in the sandbox: its exit code, stdout and stderr, and its call id.
pub fn run_sh(api: &Api, id: &str, script: &str) -> (i64, String, String, String) {
    let r = api.exec(id, &json!({ "shell": script, "timeout_ms": 30000 }));
    (
        r["exit_code"].as_i64().unwrap_or(-1),
        r["stdout"].as_str().unwrap_or_default().to_owned(),
        r["stderr"].as_str().unwrap_or_default().to_owned(),
        r["call_id"].as_str().unwrap_or_default().to_owned(),
    )
}

/// The `egress_denied` of call `call_id` (records are written in batches: waits for it).
pub fn denied_of(api: &Api, query: &str, call_id: &str) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let calls = api.get(&format!("/v1/calls?{query}&limit=200")).json();
        let found = calls["calls"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["id"] == call_id)
            .cloned();
        if let Some(c) = found {
            return c["egress_denied"]
                .as_array()
                .unwrap_or_else(|| panic!("egress_denied is a list: {c}"))
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect();
        }
        assert!(Instant::now() < deadline, "no record of call {call_id}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub const REFUSED: &str = "is not allowed by this machine's network policy";
