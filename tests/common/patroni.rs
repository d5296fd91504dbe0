//! A highly available PostgreSQL for the fleet's failover test (`FLEET.md` §5.1: "Patroni
//! with 2 Postgres instances and a 1-member etcd, all local"): Debian's `etcd` (its v2 API,
//! which Debian's Patroni speaks) and two `patroni` processes, each running its own Postgres
//! on a free loopback port; one leads (read-write), the other streams from it.
//!
//! Nothing outlives the test process: everything runs under a shell watchdog that polls the
//! test process's pid and, once it is gone, stops both Patronis (they stop their Postgres),
//! stops any Postgres still up, stops etcd and removes the directory. As root, Patroni and
//! Postgres run as the `postgres` user.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::postgres::pg_bin_dir;

/// What the cluster's leader key lives for (`bootstrap.dcs.ttl`; Patroni's minimum).
pub const TTL: Duration = Duration::from_secs(20);

/// Each member's Patroni configuration (`{…}` filled in per member).
const CONFIG: &str = r#"scope: locker-test
name: pg{i}
restapi:
  listen: 127.0.0.1:{rest}
  connect_address: 127.0.0.1:{rest}
etcd:
  host: 127.0.0.1:{client}
bootstrap:
  dcs:
    ttl: {ttl}
    loop_wait: 1
    retry_timeout: 5
    maximum_lag_on_failover: 1048576
    postgresql:
      use_pg_rewind: false
      parameters:
        max_connections: 300
        fsync: 'off'
        full_page_writes: 'off'
  initdb:
  - encoding: UTF8
  - auth: trust
  - no-sync
  pg_hba:
  - local all all trust
  - host replication replicator 127.0.0.1/32 trust
  - host all all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:{port}
  connect_address: 127.0.0.1:{port}
  data_dir: {dir}/pg{i}
  bin_dir: {bin}
  pgpass: {dir}/pgpass{i}
  basebackup:
  - no-sync
  authentication:
    replication:
      username: replicator
      password: rep
    superuser:
      username: postgres
      password: pg
  parameters:
    unix_socket_directories: '{dir}'
    logging_collector: 'on'
    log_directory: '{dir}/pglog{i}'
"#;

/// The two members: `pg0` and `pg1`.
pub struct Patroni {
    pub dir: PathBuf,
    /// Postgres's port of each member.
    pub ports: [u16; 2],
    _watchdog: std::process::Child,
}

/// Six loopback ports, all different.
fn distinct_ports() -> [u16; 6] {
    let held: Vec<std::net::TcpListener> = (0..6)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    let ports: Vec<u16> = held
        .iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect();
    ports.try_into().expect("six ports")
}

impl Patroni {
    /// Starts etcd and both members and waits until one leads and the other streams.
    pub fn start() -> Patroni {
        for tool in ["etcd", "patroni", "patronictl"] {
            assert!(
                Command::new("sh")
                    .args(["-c", &format!("command -v {tool}")])
                    .stdout(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success()),
                "{tool} is not installed: `scripts/setup test` installs Debian's patroni and etcd-server"
            );
        }
        let dir = std::env::temp_dir().join(format!("locker-patroni-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // Every port at once, while all are held: ports taken one by one may repeat (a
        // port just released can be handed out again), and two members on one port hang
        // Patroni's bootstrap.
        let [client, peer, p0, p1, r0, r1] = distinct_ports();
        let ports = [p0, p1];
        let rests = [r0, r1];
        let bin = pg_bin_dir().expect("PostgreSQL is installed (scripts/setup test)");
        for (i, port) in ports.iter().enumerate() {
            let rest = rests[i];
            let config = CONFIG
                .replace("{i}", &i.to_string())
                .replace("{rest}", &rest.to_string())
                .replace("{client}", &client.to_string())
                .replace("{ttl}", &TTL.as_secs().to_string())
                .replace("{port}", &port.to_string())
                .replace("{dir}", &dir.display().to_string())
                .replace("{bin}", &bin.display().to_string());
            std::fs::write(dir.join(format!("pg{i}.yml")), config).unwrap();
        }
        let ok = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "chown the Patroni dir to postgres");
        let script = r#"
            dir="$1"; parent="$2"; client="$3"; peer="$4"
            # A working directory the postgres user can enter (the test's may be a 0700
            # checkout: PostgreSQL's tools chdir back to where they started).
            cd "$dir"
            etcd --name e0 --data-dir "$dir/etcd" --enable-v2=true \
                --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
                --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
                --initial-cluster "e0=http://127.0.0.1:$peer" >"$dir/etcd.log" 2>&1 &
            e=$!
            for i in 0 1; do
                setpriv --reuid=postgres --regid=postgres --init-groups -- \
                    patroni "$dir/pg$i.yml" >"$dir/patroni$i.log" 2>&1 &
                echo $! >"$dir/patroni$i.pid"
            done
            while kill -0 "$parent" 2>/dev/null; do sleep 0.3; done
            for i in 0 1; do kill -TERM "$(cat "$dir/patroni$i.pid")" 2>/dev/null; done
            for n in $(seq 1 50); do
                alive=0
                for i in 0 1; do kill -0 "$(cat "$dir/patroni$i.pid")" 2>/dev/null && alive=1; done
                [ $alive = 0 ] && break
                sleep 0.2
            done
            for i in 0 1; do
                kill -KILL "$(cat "$dir/patroni$i.pid")" 2>/dev/null
                [ -f "$dir/pg$i/postmaster.pid" ] && kill -QUIT "$(head -n1 "$dir/pg$i/postmaster.pid")" 2>/dev/null
            done
            sleep 0.5
            kill "$e" 2>/dev/null; wait "$e"
            rm -rf "$dir"
        "#;
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg("locker-patroni-watchdog")
            .arg(&dir)
            .arg(std::process::id().to_string())
            .arg(client.to_string())
            .arg(peer.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the Patroni watchdog");
        let p = Patroni {
            dir,
            ports,
            _watchdog: watchdog,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let m = p.members();
            let leads = m.iter().any(|m| m.1 == "Leader" && m.2 == "running");
            let streams = m
                .iter()
                .any(|m| m.1 == "Replica" && (m.2 == "streaming" || m.2 == "running"));
            if leads && streams {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "Patroni did not make a leader and a replica in 120 s: {m:?}\n{}",
                p.logs()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
        p
    }

    /// `(name, role, state)` of each member, as `patronictl list` says.
    pub fn members(&self) -> Vec<(String, String, String)> {
        let out = Command::new("patronictl")
            .arg("-c")
            .arg(self.dir.join("pg0.yml"))
            .args(["list", "-f", "json"])
            .stderr(Stdio::null())
            .output();
        let Ok(out) = out else { return Vec::new() };
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v.as_array()
            .into_iter()
            .flatten()
            .map(|m| {
                let s = |k: &str| m[k].as_str().unwrap_or_default().to_owned();
                (s("Member"), s("Role"), s("State"))
            })
            .collect()
    }

    /// The member that leads now, if one does.
    pub fn leader(&self) -> Option<usize> {
        self.members()
            .iter()
            .find(|m| m.1 == "Leader" && m.2 == "running")
            .and_then(|m| m.0.strip_prefix("pg")?.parse().ok())
    }

    /// The URL a server uses: both members, the read-write one chosen at each connect.
    pub fn url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{db}?target_session_attrs=read-write",
            self.ports[0], self.ports[1]
        )
    }

    /// Runs `sql` on the leader's database `db`.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let l = self.leader().expect("a leader");
        crate::postgres::psql(self.ports[l], db, sql)
    }

    /// A planned switchover from the leader to the other member (`patronictl switchover`).
    pub fn switchover(&self) {
        let l = self.leader().expect("a leader");
        let out = Command::new("patronictl")
            .arg("-c")
            .arg(self.dir.join("pg0.yml"))
            .args(["switchover", "--force"])
            .arg("--leader")
            .arg(format!("pg{l}"))
            .arg("--candidate")
            .arg(format!("pg{}", 1 - l))
            .output()
            .expect("patronictl switchover");
        assert!(
            out.status.success(),
            "switchover: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Kills member `i` as a host dies: its Patroni and its Postgres, SIGKILL.
    pub fn kill(&self, i: usize) {
        let read = |f: PathBuf| {
            std::fs::read_to_string(f)
                .ok()
                .and_then(|s| s.lines().next().map(str::to_owned))
        };
        let pids: Vec<String> = [
            read(self.dir.join(format!("patroni{i}.pid"))),
            read(self.dir.join(format!("pg{i}/postmaster.pid"))),
        ]
        .into_iter()
        .flatten()
        .collect();
        assert_eq!(pids.len(), 2, "the pids of member pg{i}");
        let ok = Command::new("kill")
            .arg("-KILL")
            .args(&pids)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill member pg{i}");
    }

    /// The members' and etcd's logs (for a failure's message).
    pub fn logs(&self) -> String {
        let pg_logs = (0..2).flat_map(|i| {
            std::fs::read_dir(self.dir.join(format!("pglog{i}")))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
        });
        ["etcd.log", "patroni0.log", "patroni1.log"]
            .iter()
            .map(|f| self.dir.join(f))
            .chain(pg_logs)
            .map(|f| {
                // The head says what a member set out to do (a bootstrap, a base
                // backup), the tail where it stands; Patroni's once-a-second status lines
                // are left out, so that what a tool it ran printed shows.
                let t = std::fs::read_to_string(&f).unwrap_or_default();
                let lines: Vec<&str> = t
                    .lines()
                    .filter(|l| {
                        ![
                            "Lock owner: None",
                            "not healthy enough for leader race",
                            "bootstrap in progress",
                            "waiting for leader to bootstrap",
                        ]
                        .iter()
                        .any(|n| l.contains(n))
                    })
                    .collect();
                let head = lines.len().min(15);
                let tail = lines.len().saturating_sub(20).max(head);
                format!(
                    "---- {} ----\n{}\n[…]\n{}\n",
                    f.display(),
                    lines[..head].join("\n"),
                    lines[tail..].join("\n")
                )
            })
            .chain(std::iter::once(format!(
                "---- the postgres user's processes ----\n{}",
                Command::new("ps")
                    .args(["-u", "postgres", "-o", "pid,ppid,stat,etime,wchan:24,args"])
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default()
            )))
            .collect()
    }
}
