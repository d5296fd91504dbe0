//! The secrets tests' HTTPS hosts: a test CA with a server certificate (`Pki`), and the
//! echo server (`data/secrets_echo.js`, Node) that answers each request with what it got,
//! the secrets' real values masked, in a network namespace of its own or on an address of
//! the host; both removed on drop.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::egress::{ns_listens, wire_namespace};
use crate::{register_child, TempDir};

/// A secret's value for a test, random per run (`sk-test-<tag>-<24 hex digits>`): the echo
/// host masks it, so finding it anywhere else is a leak.
pub fn secret_value(tag: &str) -> String {
    let mut b = [0u8; 12];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("sk-test-{tag}-{hex}")
}

/// A test CA and one server certificate for `names`, made with the openssl CLI.
pub struct Pki {
    dir: TempDir,
}

impl Pki {
    pub fn new(names: &[&str]) -> Pki {
        let dir = TempDir::new("ltsecpki");
        let d = dir.path();
        let san: Vec<String> = names.iter().map(|n| format!("DNS:{n}")).collect();
        std::fs::write(
            d.join("ext.cnf"),
            format!("subjectAltName={}\n", san.join(",")),
        )
        .unwrap();
        let key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
        for cmd in [
            format!("req -x509 {key} -keyout ca.key -out ca.pem -days 2 -subj /CN=locker-secrets-test-ca"),
            format!("req {key} -keyout srv.key -out srv.csr -subj /CN={}", names[0]),
            "x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out srv.pem -days 2 -extfile ext.cnf".to_owned(),
        ] {
            let out = Command::new("openssl")
                .args(cmd.split(' '))
                .current_dir(d)
                .output()
                .expect("run openssl");
            assert!(out.status.success(), "openssl {cmd}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Pki { dir }
    }
    pub fn path(&self, f: &str) -> PathBuf {
        self.dir.path().join(f)
    }
}

/// An echo host (`data/secrets_echo.js`) in a network namespace of its own.
pub struct EchoHost {
    ns: String,
    link: String,
    pub addr: Ipv4Addr,
    child: Option<std::process::Child>,
    log: PathBuf,
    _dir: TempDir,
}

impl EchoHost {
    /// An echo host in a network namespace of its own, wired to the host (`addr`: its
    /// address there).
    pub fn start(name: &str, pki: &Pki, values: &[&str; 2]) -> EchoHost {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let ns = format!("ltsec-{pid}-{n}");
        let link = format!("ls{}x{n}", pid % 100_000);
        let third = (((pid % 32) * 8 + n) % 256) as u8;
        let (srv, host) = (
            Ipv4Addr::new(198, 19, third, 1),
            Ipv4Addr::new(198, 19, third, 2),
        );
        wire_namespace(&ns, &link, host, srv);
        EchoHost::spawn(name, pki, values, srv, Some((ns, link)))
    }

    /// An echo host on `addr`, an address the host already has (a test fabric's bridge).
    pub fn start_on(name: &str, pki: &Pki, values: &[&str; 2], addr: Ipv4Addr) -> EchoHost {
        EchoHost::spawn(name, pki, values, addr, None)
    }

    fn spawn(
        name: &str,
        pki: &Pki,
        values: &[&str; 2],
        srv: Ipv4Addr,
        ns: Option<(String, String)>,
    ) -> EchoHost {
        let dir = TempDir::new("ltsecho");
        let (ns, link) = ns.unwrap_or_default();
        let mut h = EchoHost {
            ns: ns.clone(),
            link,
            addr: srv,
            child: None,
            log: dir.path().join("requests.log"),
            _dir: dir,
        };
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/secrets_echo.js");
        std::fs::write(&h.log, "").unwrap();
        let mut cmd = if ns.is_empty() {
            Command::new("node")
        } else {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &ns, "node"]);
            c
        };
        let child = cmd
            .arg(&script)
            .arg(srv.to_string())
            .arg(name)
            .arg(pki.path("srv.pem"))
            .arg(pki.path("srv.key"))
            .arg(&h.log)
            .env("SECRET_VALUE_1", values[0])
            .env("SECRET_VALUE_2", values[1])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start node (the test host)");
        register_child(child.id());
        h.child = Some(child);
        let listens = |port: u16| {
            if ns.is_empty() {
                std::net::TcpStream::connect((srv, port)).is_ok()
            } else {
                ns_listens(&ns, port)
            }
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        while !(listens(443) && listens(8443) && listens(80)) {
            assert!(Instant::now() < deadline, "the echo host listens");
            std::thread::sleep(Duration::from_millis(50));
        }
        h
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for EchoHost {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if !self.ns.is_empty() {
            let _ = Command::new("ip")
                .args(["link", "del", &self.link])
                .output();
            let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
        }
    }
}
