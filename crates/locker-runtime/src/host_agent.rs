//! An agent that runs on the host, outside any machine, to serve the files API of a
//! directory tree (a volume's) with no machine started.
//!
//! It is the same static `locker-agent` as in machines, started with `--listen SOCKET` and
//! `LOCKER_AGENT_ROOT=<tree>`: every path is resolved with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` under the tree, so `..` and symlinks
//! never leave it even though the agent runs as host root (which is what keeps files owned
//! by canonical ids, root = 0). It must not touch the host's cgroups: its cgroup root is an
//! empty private directory, so it finds no usable cgroup and creates none (it serves no
//! commands anyway). It keeps its pid in a file beside its socket, so a server killed
//! with SIGKILL leaves nothing the next one cannot find and stop.
//!
//! This room owns the process and its connection; the server decides when to start and
//! stop one.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::agent::AgentClient;

/// What can go wrong starting a host agent.
#[derive(Debug, thiserror::Error)]
pub enum HostAgentError {
    #[error("preparing {0}: {1}")]
    Prepare(PathBuf, std::io::Error),
    #[error("starting the agent {0}: {1}")]
    Spawn(PathBuf, std::io::Error),
    #[error("connecting to the agent at {0}: {1}")]
    Connect(PathBuf, crate::agent::AgentClientError),
}

/// Where a host agent keeps its socket, pid, log and private files.
#[derive(Debug, Clone)]
pub struct HostAgentPaths {
    /// The tree it serves (its `LOCKER_AGENT_ROOT`).
    pub root: PathBuf,
    /// Its socket; `<socket>.pid` holds its pid while it runs.
    pub socket: PathBuf,
    /// A directory only the host sees: output spill files, the empty cgroup root, its log.
    pub private: PathBuf,
}

impl HostAgentPaths {
    fn pidfile(&self) -> PathBuf {
        let mut p = self.socket.clone().into_os_string();
        p.push(".pid");
        PathBuf::from(p)
    }
}

/// A running host agent and its connection. Killed when dropped.
#[derive(Debug)]
pub struct HostAgent {
    child: tokio::process::Child,
    pub client: AgentClient,
    paths: HostAgentPaths,
}

impl HostAgent {
    /// Starts `agent_exe` on `paths` (stopping any agent a previous server left there) and
    /// connects to it.
    pub async fn start(
        agent_exe: &Path,
        paths: &HostAgentPaths,
    ) -> Result<HostAgent, HostAgentError> {
        stop_stale(paths);
        let cgroup_root = paths.private.join("no-cgroups");
        let output = paths.private.join("output");
        for d in [&cgroup_root, &output] {
            std::fs::create_dir_all(d).map_err(|e| HostAgentError::Prepare(d.clone(), e))?;
        }
        let log_path = paths.private.join("agent.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| HostAgentError::Prepare(log_path.clone(), e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| HostAgentError::Prepare(log_path, e))?;
        let child = tokio::process::Command::new(agent_exe)
            .arg("--listen")
            .arg(&paths.socket)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("LOCKER_AGENT_ROOT", &paths.root)
            .env("LOCKER_OUTPUT_DIR", &output)
            .env("LOCKER_CGROUP_ROOT", &cgroup_root)
            .current_dir(&paths.private)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| HostAgentError::Spawn(agent_exe.to_owned(), e))?;
        let pidfile = paths.pidfile();
        if let Some(pid) = child.id() {
            std::fs::write(&pidfile, pid.to_string())
                .map_err(|e| HostAgentError::Prepare(pidfile, e))?;
        }
        match AgentClient::connect(&paths.socket, Duration::from_secs(10)).await {
            Ok(client) => Ok(HostAgent {
                child,
                client,
                paths: paths.clone(),
            }),
            Err(e) => {
                HostAgent::stop_child(child, paths).await;
                Err(HostAgentError::Connect(paths.socket.clone(), e))
            }
        }
    }

    async fn stop_child(mut child: tokio::process::Child, paths: &HostAgentPaths) {
        let _ = child.kill().await;
        cleanup(paths);
    }

    /// Whether it still answers (its connection is open).
    pub fn is_alive(&self) -> bool {
        !self.client.is_closed()
    }

    /// Kills it, waits for it, and removes its socket and pid file.
    pub async fn stop(self) {
        HostAgent::stop_child(self.child, &self.paths).await;
    }
}

fn cleanup(paths: &HostAgentPaths) {
    let _ = std::fs::remove_file(&paths.socket);
    let _ = std::fs::remove_file(paths.pidfile());
}

/// Stops an agent a previous server left on `paths` (found by its pid file and checked
/// by its command line, so a reused pid is never killed) and removes its socket.
pub fn stop_stale(paths: &HostAgentPaths) {
    let pid = std::fs::read_to_string(paths.pidfile())
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok());
    if let Some(pid) = pid.filter(|p| *p > 1) {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let sock = paths.socket.as_os_str().as_encoded_bytes();
        if cmdline.split(|b| *b == 0).any(|arg| arg == sock) {
            let _ = crate::sys::kill(pid, libc::SIGKILL);
        }
    }
    cleanup(paths);
}
