//! A real PostgreSQL server for the tests: one private cluster per test process, made with
//! Debian's `initdb` in a temp dir and started on a free loopback port, and an empty
//! database per test.
//!
//! Nothing outlives the test process: the server runs under a small shell watchdog that
//! polls the test process's pid and, once it is gone (passed, failed, panicked or killed),
//! stops the server (immediate shutdown) and removes its directory. As root, the server
//! runs as the `postgres` user (Postgres refuses root).
//!
//! Std only: the store's own tests include this file too (`#[path]`), so both test crates
//! share one fabric.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The running cluster of this test process.
pub struct PgCluster {
    pub port: u16,
    pub dir: PathBuf,
    bin: PathBuf,
    /// The watchdog shell: it outlives this process on purpose (it cleans up after it).
    _watchdog: std::process::Child,
}

/// The directory of Debian's PostgreSQL programs (the newest installed), or `None`.
pub fn pg_bin_dir() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, b)| b)
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("local addr")
        .port()
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `cmd` as the cluster's owner: `postgres` when we are root, else ourselves.
fn as_owner(bin: &Path, prog: &str) -> Command {
    if is_root() {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg(bin.join(prog));
        c
    } else {
        Command::new(bin.join(prog))
    }
}

/// The cluster of this test process, started on first use.
pub fn cluster() -> &'static PgCluster {
    static CLUSTER: OnceLock<PgCluster> = OnceLock::new();
    CLUSTER.get_or_init(start)
}

fn start() -> PgCluster {
    let bin = pg_bin_dir().expect(
        "PostgreSQL is not installed (/usr/lib/postgresql/*/bin/initdb): \
         `scripts/setup test` installs Debian's postgresql package",
    );
    let dir = std::env::temp_dir().join(format!(
        "locker-pg-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).expect("make the cluster's dir");
    if is_root() {
        run(
            Command::new("chown").arg("postgres:postgres").arg(&dir),
            "chown the cluster's dir to postgres",
        );
    }
    let data = dir.join("data");
    run(
        as_owner(&bin, "initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .args(["--no-instructions"]),
        "initdb",
    );
    let port = free_port();
    // The watchdog: starts the server, waits for the test process to go, stops the server
    // and removes everything. Its own stdio is detached so it never holds the test's pipes.
    let script = r#"
        dir="$1"; port="$2"; parent="$3"; shift 3
        "$@" -D "$dir/data" -p "$port" -k "$dir" -c listen_addresses=127.0.0.1 \
            -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
            -c max_connections=300 >"$dir/server.log" 2>&1 &
        pg=$!
        while kill -0 "$parent" 2>/dev/null && kill -0 "$pg" 2>/dev/null; do sleep 0.3; done
        kill -QUIT "$pg" 2>/dev/null; wait "$pg"
        rm -rf "$dir"
    "#;
    let server = as_owner(&bin, "postgres");
    let mut args: Vec<String> = vec![server.get_program().to_string_lossy().into_owned()];
    args.extend(server.get_args().map(|a| a.to_string_lossy().into_owned()));
    let watchdog = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("locker-pg-watchdog")
        .arg(&dir)
        .arg(port.to_string())
        .arg(std::process::id().to_string())
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the Postgres watchdog");
    let c = PgCluster {
        port,
        dir,
        bin,
        _watchdog: watchdog,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ok = Command::new(c.bin.join("pg_isready"))
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Postgres did not start in 60 s:\n{}",
            std::fs::read_to_string(c.dir.join("server.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    c
}

/// Runs `sql` in database `db` of the server on loopback `port` with psql (user
/// `postgres`); its rows, `|`-separated, one per line.
pub fn psql(port: u16, db: &str, sql: &str) -> String {
    let bin = pg_bin_dir().expect("PostgreSQL is installed");
    run(
        Command::new(bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args([
                "-U",
                "postgres",
                "-d",
                db,
                "-v",
                "ON_ERROR_STOP=1",
                "-At",
                "-c",
            ])
            .arg(sql),
        &format!("psql {sql:?}"),
    )
}

impl PgCluster {
    /// Runs `sql` in database `db` with psql; its rows, `|`-separated, one per line.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        psql(self.port, db, sql)
    }

    /// A new, empty database; its URL.
    pub fn new_database(&self) -> (String, String) {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "t{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        self.psql("postgres", &format!("CREATE DATABASE {name}"));
        let url = format!("postgres://postgres@127.0.0.1:{}/{name}", self.port);
        (name, url)
    }

    /// Freezes the whole server (the postmaster and every backend, SIGSTOP) for `d`, then
    /// lets it go on: an outage in which connections hang rather than fail, as a database
    /// host that stalls or a network that drops packets gives. The caller's own queries
    /// hang too meanwhile. Use it only in a test binary of its own: every test of the process
    /// shares the cluster.
    pub fn freeze_for(&self, d: Duration) {
        let pidfile = self.dir.join("data").join("postmaster.pid");
        let pid = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.lines().next().map(str::to_owned))
            .expect("the postmaster's pid");
        let all = || {
            let children = run(
                Command::new("pgrep").args(["-P", &pid]),
                "the postmaster's children",
            );
            let mut pids: Vec<String> = children.lines().map(str::to_owned).collect();
            pids.push(pid.clone());
            pids
        };
        let pids = all();
        run(
            Command::new("kill").arg("-STOP").args(&pids),
            "freeze Postgres",
        );
        std::thread::sleep(d);
        run(
            Command::new("kill").arg("-CONT").args(&pids),
            "thaw Postgres",
        );
        // A backend forked just before the freeze.
        let _ = Command::new("kill").arg("-CONT").args(all()).status();
    }

    /// The plain-text dump of database `db` (every row of every table).
    pub fn dump(&self, db: &str) -> String {
        run(
            Command::new(self.bin.join("pg_dump"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(["-U", "postgres", "--data-only", db]),
            "pg_dump",
        )
    }
}
