//! The fleet tests' network (`FLEET.md` §5.1): node hosts as network namespaces on a
//! private bridge, made by the test and removed when it drops, also when it fails.
//!
//! The bridge carries the control address (`.1`) in the test's own network namespace, so
//! that `locker serve` started by the harness can listen on it; each node namespace has one
//! veth on the bridge (`.10 + i`). The /24 (`10.251.X.0`, X from the test's pid and the
//! fabric's number) exists only while the fabric does. Names start with `fab` and the test
//! process's pid, never with `lk` (Locker's own links, which a server's start-up sweep
//! removes); what a killed test process left is removed by the next fabric's start.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::egress::ip;
use crate::{locker_bin, wait_for, TempDir};

/// A bridge and `n` node namespaces on it.
pub struct Fabric {
    tag: String,
    subnet: u8,
    nodes: usize,
}

impl Fabric {
    pub fn new(nodes: usize) -> Fabric {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        // "fab" + a pid (7 digits at most) + "x" + n + "v" + i: within a link name's 15.
        let f = Fabric {
            tag: format!("fab{pid}x{n}"),
            subnet: u8::try_from(20 + (pid + 37 * n) % 200).unwrap_or(20),
            nodes,
        };
        sweep_dead();
        f.remove();
        ip(&["link", "add", &f.bridge(), "type", "bridge"]);
        ip(&[
            "addr",
            "add",
            &format!("{}/24", f.control_ip()),
            "dev",
            &f.bridge(),
        ]);
        ip(&["link", "set", &f.bridge(), "up"]);
        for i in 0..nodes {
            let (ns, veth) = (f.ns(i), f.veth(i));
            ip(&["netns", "add", &ns]);
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]);
            ip(&["link", "set", &veth, "master", &f.bridge()]);
            ip(&["link", "set", &veth, "up"]);
            for c in [
                vec!["link", "set", "lo", "up"],
                vec![
                    "addr",
                    "add",
                    &format!("{}/24", f.node_ip(i)),
                    "dev",
                    "eth0",
                ],
                vec!["link", "set", "eth0", "up"],
            ] {
                let mut a = vec!["-n", ns.as_str()];
                a.extend(c.iter().copied());
                ip(&a);
            }
        }
        f
    }

    fn bridge(&self) -> String {
        format!("{}b", self.tag)
    }

    fn veth(&self, i: usize) -> String {
        format!("{}v{i}", self.tag)
    }

    /// Node `i`'s namespace.
    pub fn ns(&self, i: usize) -> String {
        format!("{}-n{i}", self.tag)
    }

    /// The address the control plane listens on.
    /// A control plane on Postgres `pg_url` whose fleet listener is on this fabric's
    /// bridge, with `extra` arguments.
    pub fn control(&self, pg_url: &str, extra: &[&str]) -> crate::server::Server {
        let listen = format!("{}:0", self.control_ip());
        let mut args = vec!["--database", pg_url, "--fleet-listen", &listen];
        args.extend_from_slice(extra);
        crate::server::Server::start_with(&args)
    }

    pub fn control_ip(&self) -> String {
        format!("10.251.{}.1", self.subnet)
    }

    pub fn node_ip(&self, i: usize) -> String {
        format!("10.251.{}.{}", self.subnet, 10 + i)
    }

    /// Cuts node `i` off the bridge (`false`) or wires it back (`true`): a partition.
    pub fn link(&self, i: usize, up: bool) {
        ip(&["link", "set", &self.veth(i), if up { "up" } else { "down" }]);
    }

    /// `program args…` started in node `i`'s namespace, its output appended to `log`; it
    /// is killed when the thread that started it ends (the test), whatever else happens.
    pub fn spawn(
        &self,
        i: usize,
        program: &std::path::Path,
        args: &[&str],
        log: &std::path::Path,
    ) -> Child {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open the node's log");
        // nsenter, not `ip netns exec`: that one also remounts /sys for the namespace,
        // which hides the cgroup hierarchies a node's engine runs machines in.
        let mut cmd = Command::new("nsenter");
        // SAFETY: prctl with integer arguments, between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .arg(format!("--net=/run/netns/{}", self.ns(i)))
            .arg("--")
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("start a process in a node's namespace");
        crate::register_child(child.id());
        child
    }

    fn remove(&self) {
        for i in 0..self.nodes {
            // The host side first: a namespace's own cleanup (which takes its veth peers
            // along) runs later, in the kernel's own time.
            let _ = Command::new("ip")
                .args(["link", "del", &self.veth(i)])
                .output();
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(i)])
                .output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge()])
            .output();
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Removes what fabrics of test processes that are gone left (killed before their drop).
fn sweep_dead() {
    let dead = |name: &str| -> bool {
        let Some(pid) = name
            .strip_prefix("fab")
            .and_then(|r| r.split('x').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            return false;
        };
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
    };
    let out = |args: &[&str]| {
        Command::new("ip")
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    for line in out(&["-o", "link", "show"]).lines() {
        // "12: fab123x0b: <…" or "13: fab123x0v1@if2: <…"
        let Some(name) = line
            .split(": ")
            .nth(1)
            .map(|n| n.split('@').next().unwrap_or(n))
        else {
            continue;
        };
        if dead(name) {
            let _ = Command::new("ip").args(["link", "del", name]).output();
        }
    }
    for line in out(&["netns", "list"]).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        if dead(name) {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
}

/// One `locker node` in its namespace: its data dir and log.
pub struct NodeProc {
    pub i: usize,
    /// The port its listener takes (each node process of a test its own: several may share
    /// a namespace).
    pub port: u16,
    pub name: String,
    pub dir: TempDir,
    pub log: PathBuf,
    pub child: Option<Child>,
    /// Environment the process starts with, beside the test's.
    pub env: Vec<(String, String)>,
    /// More arguments of `locker node`.
    pub extra: Vec<String>,
}

impl NodeProc {
    pub fn new(i: usize, name: &str) -> NodeProc {
        let dir = TempDir::new("locker-node");
        let log = dir.path().join("node.log");
        static NEXT_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(7443);
        NodeProc {
            i,
            port: NEXT_PORT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            name: name.into(),
            dir,
            log,
            child: None,
            env: Vec::new(),
            extra: Vec::new(),
        }
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn args(&self, fab: &Fabric, join: Option<(&str, &str)>, slots: u32) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "node".into(),
            "--name".into(),
            self.name.clone(),
            "--slots".into(),
            slots.to_string(),
            "--advertise".into(),
            format!("{}:{}", fab.node_ip(self.i), self.port),
            "--data-dir".into(),
            self.data_dir().display().to_string(),
            // A node's engine, light: no warm machines, no template build (the host's
            // cache has the default template), disks on the data dir where the clean-up
            // below finds them.
            "--warm-pool".into(),
            "0".into(),
            "--vm-pool".into(),
            "0".into(),
            "--no-template-build".into(),
            "--cow-disks".into(),
            "off".into(),
        ];
        if let Some((url, token)) = join {
            a.extend(["--join".into(), url.into(), "--token".into(), token.into()]);
        }
        a.extend(self.extra.iter().cloned());
        a
    }

    pub fn start(&mut self, fab: &Fabric, join: Option<(&str, &str)>, slots: u32) {
        let mut args = self.args(fab, join, slots);
        let mut program = locker_bin();
        if !self.env.is_empty() {
            // Through env(1): the namespace's spawn takes no environment of its own.
            let mut with: Vec<String> = self.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
            with.push(program.display().to_string());
            with.append(&mut args);
            args = with;
            program = PathBuf::from("/usr/bin/env");
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.child = Some(fab.spawn(self.i, &program, &args, &self.log));
    }

    /// Runs `locker node` to its end (a refused join ends at once): its status and log.
    pub fn run_to_end(&self, fab: &Fabric, url: &str, token: &str) -> (bool, String) {
        let args = self.args(fab, Some((url, token)), 10);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let _ = std::fs::remove_file(&self.log);
        let child = fab.spawn(self.i, &locker_bin(), &args, &self.log);
        // Killed on drop, also when the wait below gives up.
        let mut guard = NodeProc {
            i: self.i,
            port: self.port,
            name: self.name.clone(),
            dir: TempDir::new("locker-node-run"),
            log: self.log.clone(),
            child: Some(child),
            env: Vec::new(),
            extra: Vec::new(),
        };
        let status = wait_for(Duration::from_secs(20), "a refused join to end", || {
            guard.child.as_mut().unwrap().try_wait().expect("wait")
        });
        guard.child = None;
        (status.success(), self.log_text())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, sig: i32) {
        let pid = self.child.as_ref().expect("running").id();
        // SAFETY: kill with a pid of our own child and a signal number.
        unsafe { libc::kill(pid as i32, sig) };
    }

    /// Waits for the process to end by itself; its status.
    pub fn wait_end(&mut self, limit: Duration) -> std::process::ExitStatus {
        let child = self.child.as_mut().expect("running");
        let status = wait_for(limit, "the node to stop", || {
            child.try_wait().expect("wait")
        });
        self.child = None;
        status
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        // SIGCONT first: a stopped process does not die of SIGKILL until it runs.
        if let Some(c) = &self.child {
            // SAFETY: as in `signal`.
            unsafe { libc::kill(c.id() as i32, libc::SIGCONT) };
        }
        self.stop();
        // What the node ran outlives it (a node's machines survive its restarts): the
        // runtime's crash clean-up destroys them, so nothing outlives the test.
        let data = self.data_dir();
        let mut left = crate::server::destroy_machines(&data.join("sandboxes"));
        left.extend(crate::server::destroy_machines(&data.join("pool")));
        // And its volumes stay mounted on the host (a node shares its mount namespace).
        crate::server::stop_volume_agents(&data.join("volumes"));
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("---- locker node {} log, last lines ----", self.name);
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
        if !left.is_empty() {
            eprintln!("cleanup: node {} left machines {left:?}", self.name);
        }
    }
}

/// A join token minted with the admin key, valid `ttl_s` (`POST /v1/fleet/tokens`'s answer).
pub fn fleet_token(admin: &crate::server::Api, ttl_s: u64) -> serde_json::Value {
    admin
        .post("/v1/fleet/tokens", &serde_json::json!({ "ttl_s": ttl_s }))
        .expect(201, "mint a join token")
}

/// `GET /v1/fleet/nodes`'s nodes.
pub fn fleet_nodes(admin: &crate::server::Api) -> Vec<serde_json::Value> {
    admin.get("/v1/fleet/nodes").expect(200, "list the nodes")["nodes"]
        .as_array()
        .expect("nodes")
        .clone()
}

/// The node named `name` in a list of [`fleet_nodes`].
pub fn fleet_node<'a>(list: &'a [serde_json::Value], name: &str) -> &'a serde_json::Value {
    list.iter()
        .find(|n| n["name"] == name)
        .unwrap_or_else(|| panic!("no node {name} in {list:?}"))
}

/// Nodes `names` (slots 0, 1, … of the fabric), each joined with a token of its own and
/// `slots` sandbox slots, once every one of them is listed alive.
pub fn join_nodes(
    fab: &Fabric,
    admin: &crate::server::Api,
    names: &[&str],
    slots: u32,
) -> Vec<NodeProc> {
    join_nodes_with(fab, admin, names, slots, &[])
}

/// [`join_nodes`], each node started with `env` beside the test's environment.
pub fn join_nodes_with(
    fab: &Fabric,
    admin: &crate::server::Api,
    names: &[&str],
    slots: u32,
    env: &[(&str, &str)],
) -> Vec<NodeProc> {
    let mut nodes: Vec<NodeProc> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut n = NodeProc::new(i, name);
            n.env = env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            n
        })
        .collect();
    for n in &mut nodes {
        let t = fleet_token(admin, 600);
        n.start(
            fab,
            Some((t["url"].as_str().unwrap(), t["token"].as_str().unwrap())),
            slots,
        );
    }
    crate::wait_for(
        std::time::Duration::from_secs(60),
        "the nodes alive",
        || {
            let l = fleet_nodes(admin);
            // Listed alive once registered; its identity written a moment later (a node
            // restarted before that would not know it joined).
            let saved = nodes
                .iter()
                .all(|n| n.data_dir().join("fleet/identity.json").exists());
            // (A control replica's own node, `--node local`, may be listed beside them.)
            let up = names
                .iter()
                .all(|name| l.iter().any(|n| n["name"] == *name && n["alive"] == true));
            (saved && up).then_some(())
        },
    );
    nodes
}

/// `locker ARGS` against server `srv` with its admin key (`LOCKER_URL`,
/// `LOCKER_ADMIN_KEY`): its exit code, and its output (stdout, then stderr).
pub fn admin_cli(srv: &crate::server::Server, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(locker_bin())
        .args(args)
        .env("LOCKER_URL", &srv.url)
        .env(
            "LOCKER_ADMIN_KEY",
            srv.admin_key.as_deref().unwrap_or_default(),
        )
        .output()
        .expect("run locker");
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}
