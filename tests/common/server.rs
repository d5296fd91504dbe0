//! A real `locker serve` for the end-to-end tests, and a small blocking HTTP client of it.
//!
//! [`Server`] starts the built binary on a free port with a fresh data dir and known keys,
//! waits until `/healthz` answers, and on drop leaves nothing behind even when the test
//! failed: it deletes every sandbox through the API (so the server tears machines down
//! the normal way), stops the server (SIGTERM), then destroys whatever machine is still on
//! disk with the runtime's own orphan cleanup. When the test is failing, the server's log
//! is printed.

use std::io::Read;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use ureq::http::{HeaderMap, Request};
use ureq::{AsSendBody, BodyReader};

use crate::{agent_bin, locker_bin, register_child, unique, TempDir};

/// A `locker serve` process owned by a test.
pub struct Server {
    /// The `locker serve` process; behind a lock so a server shared by a test binary's
    /// tests (see [`crate::shared`]) can be shut down through `&self` at exit.
    child: Mutex<Option<Child>>,
    /// `http://127.0.0.1:PORT` (changes when [`Server::restart`] picks a new port).
    pub url: String,
    pub addr: SocketAddr,
    /// The server's `--data-dir` (kept across [`Server::restart`]).
    pub data_dir: PathBuf,
    /// The key of tenant `default` (`LOCKER_API_KEY`, or the one the server generated).
    pub api_key: String,
    /// Whether the server generates the key itself (started without `LOCKER_API_KEY`).
    generated_key: bool,
    /// `LOCKER_ADMIN_KEY`, unless started with [`Server::without_admin`].
    pub admin_key: Option<String>,
    extra_args: Vec<String>,
    /// Extra environment of the server process (test hooks).
    extra_env: Vec<(String, String)>,
    /// The open files limit (soft and hard) the server is started with, if not inherited.
    nofile: Option<u64>,
    /// Another build's `locker` and `locker-agent` to run instead of this checkout's (the
    /// previous release, for the upgrade tests), until [`Server::upgrade`].
    release: Option<(PathBuf, PathBuf)>,
    log: PathBuf,
    /// Every tenant key seen, so drop can delete each tenant's sandboxes.
    keys: Mutex<Vec<String>>,
    _dir: TempDir,
}

/// A fresh secret (good enough for a test: unique and unguessable across runs).
fn secret(prefix: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("{prefix}_{}_{t:x}", unique("k").replace('-', "_"))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("local addr")
        .port()
}

impl Server {
    /// A server with default flags, an API key and an admin key.
    pub fn start() -> Server {
        Server::start_with(&[])
    }

    /// A server with extra `locker serve` flags (`--quota-sandboxes 2`, …).
    pub fn start_with(args: &[&str]) -> Server {
        Server::build(args, true, false)
    }

    /// A server with extra flags and extra environment variables (test hooks such as
    /// `LOCKER_TEST_COMMIT_DELAY_MS`), kept across [`Server::restart`] unless cleared with
    /// [`Server::set_env`].
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut s = Server::build_stopped(args, true, false);
        s.extra_env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        s.spawn();
        s
    }

    /// Replaces the extra environment used by the next [`Server::restart`].
    pub fn set_env(&mut self, env: &[(&str, &str)]) {
        self.extra_env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    }

    /// A server with extra flags started with an open files limit of `nofile` (soft and
    /// hard), as a service manager would start it.
    pub fn start_with_nofile(args: &[&str], nofile: u64) -> Server {
        let mut s = Server::build_stopped(args, true, false);
        s.nofile = Some(nofile);
        s.spawn();
        s
    }

    /// A server of another build (`locker` and its static `locker-agent`), with extra
    /// flags, an API key and an admin key; [`Server::upgrade`] replaces it with this
    /// checkout's build on the same data dir.
    pub fn start_release(locker: &Path, agent: &Path, args: &[&str]) -> Server {
        let mut s = Server::build_stopped(args, true, false);
        s.release = Some((locker.to_owned(), agent.to_owned()));
        s.spawn();
        s
    }

    /// Starts this checkout's build on the data dir of a stopped (or killed) server that
    /// [`Server::start_release`] started, with the same keys and flags.
    pub fn upgrade(&mut self) {
        self.kill9();
        self.release = None;
        self.spawn();
    }

    /// A server without an admin key (admin routes disabled).
    pub fn without_admin(args: &[&str]) -> Server {
        Server::build(args, false, false)
    }

    /// A server started without `LOCKER_API_KEY`: it generates a key of tenant `default`
    /// and prints it; [`Server::api_key`] is the key read from its log.
    pub fn generating_key() -> Server {
        Server::build(&[], true, true)
    }

    fn build(args: &[&str], admin: bool, generated_key: bool) -> Server {
        let mut s = Server::build_stopped(args, admin, generated_key);
        s.spawn();
        s
    }

    fn build_stopped(args: &[&str], admin: bool, generated_key: bool) -> Server {
        crate::become_subreaper();
        let dir = TempDir::new("locker-srv");
        let data_dir = dir.path().join("data");
        let api_key = if generated_key {
            String::new()
        } else {
            secret("lk_test")
        };
        let s = Server {
            child: Mutex::new(None),
            url: String::new(),
            addr: "127.0.0.1:0".parse().expect("addr"),
            log: dir.path().join("server.log"),
            data_dir,
            admin_key: admin.then(|| secret("lk_admin")),
            keys: Mutex::new(vec![api_key.clone()]),
            api_key,
            generated_key,
            extra_args: args.iter().map(|a| a.to_string()).collect(),
            extra_env: Vec::new(),
            nofile: None,
            release: None,
            _dir: dir,
        };
        s
    }

    /// Sends signal `sig` to the server's process (`SIGSTOP`: a stalled host).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill with the pid of this test's own child and a signal number.
        unsafe { libc::kill(self.pid() as i32, sig) };
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child
            .lock()
            .expect("the server's process")
            .as_ref()
            .expect("the server is running")
            .id()
    }

    /// Starts the process on a free port and waits for `/healthz` (retrying on a port that
    /// another test grabbed in between).
    fn spawn(&mut self) {
        self.spawn_on(None);
    }

    /// [`Server::spawn`] on `port` when given (tried again a little later while it is still
    /// taken), else on a free one.
    fn spawn_on(&mut self, fixed: Option<u16>) {
        for _attempt in 0..5 {
            let port = fixed.unwrap_or_else(free_port);
            self.addr = SocketAddr::from(([127, 0, 0, 1], port));
            self.url = format!("http://{}", self.addr);
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .expect("open the server log");
            // This start's lines begin here (a restart appends to the same log).
            let from = log.metadata().map_or(0, |m| m.len());
            // prlimit execs the server: the child's pid is the server's.
            let (locker, agent) = match &self.release {
                Some((l, a)) => (l.clone(), a.clone()),
                None => (locker_bin(), agent_bin()),
            };
            let mut cmd = match self.nofile {
                Some(n) => {
                    let mut c = Command::new("prlimit");
                    c.arg(format!("--nofile={n}:{n}")).arg(&locker);
                    c
                }
                None => Command::new(&locker),
            };
            cmd.arg("serve")
                .arg("--listen")
                .arg(self.addr.to_string())
                .arg("--data-dir")
                .arg(&self.data_dir)
                .args(&self.extra_args)
                // Disks on the data dir itself, where the tests look for machines
                // (`data_dir/sandboxes`); tests of the XFS image ask for it.
                .env("LOCKER_COW_DISKS", "off")
                .envs(self.extra_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .env("LOCKER_AGENT_BIN", &agent)
                // Whatever else is asked, the line that says it listens (`wait_ready`).
                .env(
                    "LOCKER_LOG",
                    format!(
                        "{},locker_server::app=info",
                        std::env::var("LOCKER_LOG").unwrap_or_else(|_| "info".into())
                    ),
                )
                .env("NO_COLOR", "1")
                .env_remove("LOCKER_ADMIN_KEY")
                .env_remove("LOCKER_METRICS_TOKEN")
                .env_remove("LOCKER_LISTEN")
                .env_remove("LOCKER_DATA_DIR")
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log fd"))
                .stderr(log);
            if let Some(a) = &self.admin_key {
                cmd.env("LOCKER_ADMIN_KEY", a);
            }
            if self.generated_key {
                cmd.env_remove("LOCKER_API_KEY");
            } else {
                cmd.env("LOCKER_API_KEY", &self.api_key);
            }
            let child = cmd
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", locker.display()));
            register_child(child.id());
            *self.child.get_mut().expect("the server's process") = Some(child);
            match self.wait_ready(from) {
                Ok(()) => {
                    if self.generated_key && self.api_key.is_empty() {
                        let log = self.log_text();
                        let key = log
                            .lines()
                            .find_map(|l| l.split_once(" LOCKER_API_KEY="))
                            .and_then(|(_, rest)| rest.split_whitespace().next())
                            .unwrap_or_else(|| panic!("no generated API key in the log:\n{log}"))
                            .to_owned();
                        self.remember_key(&key);
                        self.api_key = key;
                    }
                    return;
                }
                Err(log) if log.contains("Address already in use") => {
                    if fixed.is_some() {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    continue;
                }
                Err(log) => panic!("locker serve did not start:\n{log}"),
            }
        }
        panic!("locker serve: no free port after 5 tries");
    }

    /// Waits until this start (its log from byte `from`) says it listens and `/healthz`
    /// answers. The log comes first: the port was free when picked, but another test's
    /// server may take it before this one binds, and answer `/healthz` in its place (this
    /// one then exits with "Address already in use", and the caller picks another port).
    fn wait_ready(&mut self, from: u64) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let api = self.anon();
        let mut listening = false;
        loop {
            let child = self.child.get_mut().expect("the server's process");
            if let Some(st) = child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                *child = None;
                return Err(format!("exited with {st}:\n{}", self.log_text()));
            }
            if !listening {
                let log = std::fs::read(&self.log).unwrap_or_default();
                let new = String::from_utf8_lossy(
                    log.get(usize::try_from(from).unwrap_or(0)..)
                        .unwrap_or_default(),
                );
                listening = new.contains("locker serve ready");
            }
            if listening {
                if let Ok(r) = api.try_request("GET", "/healthz", &[], ()) {
                    if r.status == 200 || r.status == 503 {
                        return Ok(());
                    }
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "no answer on /healthz after 30 s:\n{}",
                    self.log_text()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills the server with SIGKILL (no graceful shutdown; machines keep running).
    pub fn kill9(&mut self) {
        self.stop();
    }

    fn stop(&self) {
        let child = self.child.lock().map(|mut c| c.take());
        if let Ok(Some(mut c)) = child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the server the way a service manager does, with SIGTERM: it drains its warm
    /// pool, where a SIGKILL can orphan a machine it was still starting (its state not yet
    /// on disk for the orphan cleanup to find). Killed if it has not exited within 20 s.
    fn stop_gracefully(&self) {
        let child = self.child.lock().map(|mut c| c.take());
        let Ok(Some(mut c)) = child else {
            return;
        };
        // SAFETY: kill with the pid of the server process this guard started and has not
        // reaped yet (so the pid is still its).
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("cleanup: the server did not exit within 20 s of SIGTERM: killed");
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Stops the server as a service manager does (SIGTERM, killed after 20 s), keeping its
    /// data dir and whatever machines it leaves running; [`Server::restart`] starts it again.
    pub fn terminate(&self) {
        self.stop_gracefully();
    }

    fn running(&self) -> bool {
        self.child.lock().map(|c| c.is_some()).unwrap_or(false)
    }

    /// Adds `locker serve` flags for the next [`Server::restart`] (`--database URL` after
    /// `locker db migrate`).
    pub fn add_args(&mut self, args: &[&str]) {
        self.extra_args.extend(args.iter().map(|a| a.to_string()));
    }

    /// Starts the server again on the same data dir (after [`Server::kill9`]).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// Starts the server again on the same data dir and the same port, with the same flags
    /// and environment (after [`Server::kill9`]): what a load balancer in front of it still
    /// points at.
    pub fn restart_on_same_port(&mut self) {
        self.kill9();
        let port = self.addr.port();
        self.spawn_on(Some(port));
    }

    /// Where sandbox `id`'s machine lives on the host.
    pub fn machine_dir(&self, id: &str) -> PathBuf {
        self.sandboxes_dir().join(id)
    }

    /// Where the server keeps sandboxes' machines: in the data dir, or on Locker's XFS
    /// image when it made one (`locker_runtime::cow_disks`).
    pub fn sandboxes_dir(&self) -> PathBuf {
        let image = self
            .data_dir
            .join(locker_runtime::cow_disks::MOUNT)
            .join("sandboxes");
        if image.is_dir() {
            image
        } else {
            self.data_dir.join("sandboxes")
        }
    }

    /// A client with the `default` tenant's key.
    pub fn api(&self) -> Api {
        Api::new(&self.url, Some(&self.api_key))
    }

    /// A client with the admin key.
    pub fn admin(&self) -> Api {
        Api::new(
            &self.url,
            Some(
                self.admin_key
                    .as_deref()
                    .expect("this server has no admin key"),
            ),
        )
    }

    /// A client without a key.
    pub fn anon(&self) -> Api {
        Api::new(&self.url, None)
    }

    /// A client with `key` (remembered, so drop cleans up that tenant's sandboxes too).
    pub fn api_with(&self, key: &str) -> Api {
        self.remember_key(key);
        Api::new(&self.url, Some(key))
    }

    /// Remembers a tenant key for the cleanup on drop.
    pub fn remember_key(&self, key: &str) {
        let mut k = self.keys.lock().expect("keys");
        if !k.iter().any(|x| x == key) {
            k.push(key.to_owned());
        }
    }

    /// Creates tenant `name` through the admin route: its client and its key id.
    pub fn create_tenant(&self, name: &str) -> (Api, String) {
        let v = self
            .admin()
            .post("/v1/tenants", &json!({ "name": name }))
            .expect(201, "create a tenant");
        let key = v["api_key"].as_str().expect("api_key").to_owned();
        (
            self.api_with(&key),
            v["key_id"].as_str().expect("key_id").to_owned(),
        )
    }

    /// Deletes every sandbox and volume of every tenant this test used; returns what could
    /// not be.
    fn delete_all_sandboxes(&self) -> Vec<String> {
        let keys = self.keys.lock().map(|k| k.clone()).unwrap_or_default();
        keys.iter()
            .filter(|k| !k.is_empty())
            .flat_map(|key| delete_all_of(&Api::new(&self.url, Some(key))))
            .collect()
    }

    /// Leaves nothing behind, even when the test failed: deletes every sandbox through the
    /// API (so the server tears machines down the normal way), stops the server (SIGTERM,
    /// then SIGKILL after 20 s), then destroys whatever machine is still on disk with the
    /// runtime's own orphan cleanup.
    /// Drop calls it; so does the exit of a test binary whose tests shared this server.
    pub fn shut_down(&self) {
        let failed = if self.running() {
            self.delete_all_sandboxes()
        } else {
            Vec::new()
        };
        self.stop_gracefully();
        // Whatever the API could not delete (a dead server, a failed delete): the
        // runtime's own crash cleanup destroys the machines of this data dir.
        let mut left = destroy_machines(&self.sandboxes_dir());
        left.extend(destroy_machines(&self.data_dir.join("pool")));
        stop_volume_agents(&self.data_dir.join("volumes"));
        // Locker's XFS image, when the server made one, goes with the data dir.
        if let Err(e) = locker_runtime::cow_disks::unmount(&self.data_dir) {
            eprintln!("cleanup: cannot unmount the data dir's XFS image: {e}");
        }
        if std::thread::panicking() {
            self.print_log_tail();
        }
        if !failed.is_empty() || !left.is_empty() {
            eprintln!("cleanup: delete failed for {failed:?}; destroyed leftovers {left:?}");
        }
        // A shared server is never dropped: its data dir and log go here.
        let _ = std::fs::remove_dir_all(self._dir.path());
    }

    /// Prints the last lines of the server's log (for a failing test).
    pub fn print_log_tail(&self) {
        let log = self.log_text();
        let tail: Vec<&str> = log.lines().rev().take(60).collect();
        eprintln!("---- locker serve log ({}), last lines ----", self.url);
        for l in tail.iter().rev() {
            eprintln!("{l}");
        }
    }
}

/// Deletes every volume and sandbox of the tenant whose key `api` has; returns what could
/// not be.
pub fn delete_all_of(api: &Api) -> Vec<String> {
    let mut failed = Vec::new();
    // Volumes first: a sandbox's delete does not wait for them.
    for kind in ["volumes", "sandboxes"] {
        let Ok(r) = api.try_request("GET", &format!("/v1/{kind}"), &[], ()) else {
            continue;
        };
        let list = serde_json::from_slice::<Value>(&r.body).unwrap_or(Value::Null);
        for v in list[kind].as_array().into_iter().flatten() {
            let id = v["id"].as_str().unwrap_or_default();
            match api.try_request("DELETE", &format!("/v1/{kind}/{id}"), &[], ()) {
                Ok(r) if r.status == 204 || r.status == 404 => {}
                other => failed.push(format!("{id}: {:?}", other.map(|r| (r.status, r.text())))),
            }
        }
    }
    failed
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Destroys every machine under `machines_dir` (the server must be dead).
pub fn destroy_machines(machines_dir: &Path) -> Vec<String> {
    let any = std::fs::read_dir(machines_dir)
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    if !any {
        return Vec::new();
    }
    let cfg = locker_runtime::node::NodeConfig {
        init_exe: locker_bin(),
        shim_exe: locker_runtime::node::find_shim(&locker_bin()),
        agent_exe: agent_bin(),
    };
    let Ok(node) = locker_runtime::node::Node::new(cfg) else {
        return Vec::new();
    };
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return Vec::new();
    };
    rt.block_on(node.cleanup_orphans(machines_dir, Vec::new()))
}

/// Stops the host-side agents of the volumes under `volumes_dir` and unmounts their
/// filesystems (the server must be dead), so nothing of them outlives the test.
pub fn stop_volume_agents(volumes_dir: &Path) {
    for e in std::fs::read_dir(volumes_dir)
        .into_iter()
        .flatten()
        .flatten()
    {
        let dir = e.path();
        locker_runtime::host_agent::stop_stale(&locker_runtime::host_agent::HostAgentPaths {
            root: locker_runtime::volume_fs::live(&dir),
            socket: dir.join("agent.sock"),
            private: dir.join("private"),
        });
        if let Err(err) = locker_runtime::volume_fs::unmount(&dir) {
            eprintln!("cleanup: unmounting volume {}: {err}", dir.display());
        }
    }
}

/// The resident memory of a process in KiB (`VmRSS`), 0 if it is gone.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Percent-encodes a query value or path segment (everything but unreserved characters).
pub fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An answer: status, headers, whole body.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Resp {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON (`null` when empty); panics with the body when it is not JSON.
    pub fn json(&self) -> Value {
        if self.body.is_empty() {
            return Value::Null;
        }
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}), HTTP {}: {}", self.status, self.text()))
    }

    /// Asserts the status and returns the JSON body.
    #[track_caller]
    pub fn expect(&self, status: u16, what: &str) -> Value {
        assert_eq!(
            self.status,
            status,
            "{what}: expected HTTP {status}, got {}: {}",
            self.status,
            self.text()
        );
        self.json()
    }

    /// Asserts an error answer of the contract's shape, `{"error": {"code", "message"}}`,
    /// with this status and code; returns the message.
    #[track_caller]
    pub fn expect_error(&self, status: u16, code: &str, what: &str) -> String {
        assert_eq!(
            self.status,
            status,
            "{what}: expected HTTP {status} {code}, got {}: {}",
            self.status,
            self.text()
        );
        let v: Value = serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{what}: the error body is not JSON ({e}): {:?}",
                self.text()
            )
        });
        let obj = v
            .as_object()
            .unwrap_or_else(|| panic!("{what}: the error body is not an object: {v}"));
        assert_eq!(
            obj.len(),
            1,
            "{what}: the error body has exactly one key, `error`: {v}"
        );
        let e = &v["error"];
        assert_eq!(e["code"], code, "{what}: error code: {v}");
        let msg = e["message"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: error.message is a string: {v}"));
        assert!(!msg.is_empty(), "{what}: error.message is empty: {v}");
        msg.to_owned()
    }
}

/// A blocking HTTP client of one server, with one key (or none).
#[derive(Clone)]
pub struct Api {
    pub base: String,
    key: Option<String>,
    agent: ureq::Agent,
}

/// An HTTP agent for tests: statuses are answers, not errors; no proxy; a global timeout
/// so a hung server fails the test instead of hanging it; and no connection reuse: a
/// server may close a connection after answering a request before reading its body (a
/// 401 or 404 to a POST), and a pooled connection would then fail the next request.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .max_redirects(0)
        .max_idle_connections(0)
        .max_idle_connections_per_host(0)
        .timeout_global(Some(timeout))
        .build()
        .into()
}

impl Api {
    pub fn new(base: &str, key: Option<&str>) -> Api {
        Api {
            base: base.to_owned(),
            key: key.map(str::to_owned),
            agent: agent(Duration::from_secs(120)),
        }
    }

    /// The same client with another overall timeout per request.
    pub fn with_timeout(&self, timeout: Duration) -> Api {
        Api {
            base: self.base.clone(),
            key: self.key.clone(),
            agent: agent(timeout),
        }
    }

    /// The same server with another key.
    /// The key this client sends, if any.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    pub fn with_key(&self, key: Option<&str>) -> Api {
        Api {
            base: self.base.clone(),
            key: key.map(str::to_owned),
            agent: self.agent.clone(),
        }
    }

    /// Sends a request and returns the response with its body still unread.
    pub fn open(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl AsSendBody,
    ) -> Result<(u16, HeaderMap, BodyReader<'static>), ureq::Error> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(k) = &self.key {
            b = b.header("Authorization", format!("Bearer {k}"));
        }
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let req = b
            .body(body)
            .map_err(|e| ureq::Error::BadUri(e.to_string()))?;
        let resp = self.agent.run(req)?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        Ok((status, headers, resp.into_body().into_reader()))
    }

    /// Sends a request and reads the whole answer.
    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl AsSendBody,
    ) -> Result<Resp, ureq::Error> {
        let (status, headers, mut r) = self.open(method, path, headers, body)?;
        let mut body = Vec::new();
        r.read_to_end(&mut body).map_err(ureq::Error::Io)?;
        Ok(Resp {
            status,
            headers,
            body,
        })
    }

    /// [`Api::try_request`] that panics on a transport failure.
    #[track_caller]
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl AsSendBody,
    ) -> Resp {
        self.try_request(method, path, headers, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    #[track_caller]
    pub fn get(&self, path: &str) -> Resp {
        self.request("GET", path, &[], ())
    }

    #[track_caller]
    pub fn delete(&self, path: &str) -> Resp {
        self.request("DELETE", path, &[], ())
    }

    /// A JSON body.
    #[track_caller]
    pub fn post(&self, path: &str, body: &Value) -> Resp {
        self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            serde_json::to_vec(body).expect("json"),
        )
    }

    /// A POST without a body.
    #[track_caller]
    pub fn post_empty(&self, path: &str) -> Resp {
        self.request("POST", path, &[], ())
    }

    #[track_caller]
    pub fn patch(&self, path: &str, body: &Value) -> Resp {
        self.request(
            "PATCH",
            path,
            &[("Content-Type", "application/json")],
            serde_json::to_vec(body).expect("json"),
        )
    }

    /// A raw body (`Content-Type: application/octet-stream`).
    #[track_caller]
    pub fn put(&self, path: &str, body: impl AsSendBody) -> Resp {
        self.request(
            "PUT",
            path,
            &[("Content-Type", "application/octet-stream")],
            body,
        )
    }

    /// Creates a sandbox (201) and returns it.
    #[track_caller]
    pub fn create_sandbox(&self, body: &Value) -> Value {
        self.post("/v1/sandboxes", body)
            .expect(201, "create a sandbox")
    }

    /// Runs a command (200) and returns its ExecResult.
    #[track_caller]
    pub fn exec(&self, id: &str, body: &Value) -> Value {
        self.post(&format!("/v1/sandboxes/{id}/exec"), body)
            .expect(200, &format!("exec {body}"))
    }

    /// Runs a shell command that must exit 0 and returns its stdout.
    #[track_caller]
    pub fn sh(&self, id: &str, script: &str) -> String {
        let r = self.exec(id, &json!({ "shell": script }));
        assert_eq!(r["exit_code"], 0, "`{script}` failed: {r}");
        r["stdout"].as_str().expect("stdout").to_owned()
    }

    /// `GET /v1/sandboxes/{id}/files?path=…` (the raw answer).
    #[track_caller]
    pub fn read_file(&self, id: &str, path: &str) -> Resp {
        self.get(&format!("/v1/sandboxes/{id}/files?path={}", enc(path)))
    }

    /// `PUT /v1/sandboxes/{id}/files?path=…` (the raw answer).
    #[track_caller]
    pub fn write_file(&self, id: &str, path: &str, data: &[u8]) -> Resp {
        self.put(
            &format!("/v1/sandboxes/{id}/files?path={}", enc(path)),
            data,
        )
    }
}
