//! QMP, QEMU's control socket: the few commands the runtime sends, and passing an fd.

use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;

/// How a QMP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("QEMU closed its QMP socket")]
    Closed,
    #[error("QMP sent bad JSON: {0}")]
    BadJson(#[from] serde_json::Error),
    /// QEMU answered the command with an error.
    #[error("{0}")]
    Refused(String),
    /// The VM did not reach the state the command was for.
    #[error("{0}")]
    Stuck(String),
}

/// A QMP failure of `cmd`.
fn qmp(cmd: &str, source: impl Into<QmpError>) -> VmError {
    VmError::Qmp {
        cmd: cmd.to_owned(),
        source: source.into(),
    }
}

/// A connection to one QEMU's QMP socket (blocking; use from blocking tasks).
pub(super) struct Qmp {
    pub(super) r: BufReader<UnixStream>,
    pub(super) w: UnixStream,
}

impl Qmp {
    pub(super) fn connect(sock: &Path, timeout: Duration) -> Result<Self, VmError> {
        let t0 = Instant::now();
        let s = loop {
            match UnixStream::connect(sock) {
                Ok(s) => break s,
                Err(_) if t0.elapsed() < timeout => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => return Err(qmp(&format!("connect {}", sock.display()), e)),
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(120)))
            .map_err(|e| qmp("connect", e))?;
        let w = s.try_clone().map_err(|e| qmp("connect", e))?;
        let mut q = Self {
            r: BufReader::new(s),
            w,
        };
        q.read("greeting")?;
        q.cmd("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    /// Reads one message, on behalf of `cmd`.
    pub(super) fn read(&mut self, cmd: &str) -> Result<Value, VmError> {
        let mut line = String::new();
        if self.r.read_line(&mut line).map_err(|e| qmp(cmd, e))? == 0 {
            return Err(qmp(cmd, QmpError::Closed));
        }
        serde_json::from_str(&line).map_err(|e| qmp(cmd, e))
    }

    /// Runs a command, optionally passing `fd` along (`SCM_RIGHTS`), and returns its result.
    pub(super) fn cmd_fd(
        &mut self,
        name: &str,
        args: Value,
        fd: Option<RawFd>,
    ) -> Result<Value, VmError> {
        let msg = format!("{}\n", json!({"execute": name, "arguments": args}));
        match fd {
            None => self.w.write_all(msg.as_bytes()),
            Some(fd) => send_with_fd(&self.w, msg.as_bytes(), fd),
        }
        .map_err(|e| qmp(name, e))?;
        loop {
            let v = self.read(name)?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                let desc = e.get("desc").and_then(Value::as_str).unwrap_or("failed");
                return Err(qmp(name, QmpError::Refused(desc.to_owned())));
            }
            // An event: skip it.
        }
    }

    pub(super) fn cmd(&mut self, name: &str, args: Value) -> Result<Value, VmError> {
        self.cmd_fd(name, args, None)
    }

    /// Keeps RAM mapped from a shared file out of migrations (both directions must agree):
    /// a base's state is then only device state, and its RAM file is mapped, not copied.
    pub(super) fn ignore_shared(&mut self) -> Result<(), VmError> {
        self.cmd(
            "migrate-set-capabilities",
            json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
        )
        .map(drop)
    }

    /// Waits for an incoming migration to finish and lets the VM run: a VM saved while
    /// stopped (every base and snapshot is) stays paused after loading until `cont`.
    pub(super) fn run_after_incoming(&mut self) -> Result<(), VmError> {
        let t0 = Instant::now();
        loop {
            let st = self.cmd("query-status", json!({}))?;
            match st.get("status").and_then(Value::as_str).unwrap_or("") {
                "running" => return Ok(()),
                "inmigrate" if t0.elapsed() < Duration::from_secs(120) => {
                    std::thread::sleep(Duration::from_micros(500))
                }
                "paused" | "postmigrate" | "prelaunch" | "restore-vm" => {
                    self.cmd("cont", json!({}))?;
                    return Ok(());
                }
                other => {
                    return Err(qmp(
                        "query-status",
                        QmpError::Stuck(format!(
                            "restoring the VM: it is {other:?} instead of running"
                        )),
                    ))
                }
            }
        }
    }

    /// Migrates the VM's state into `out` and waits until it is written.
    pub(super) fn migrate_to(&mut self, out: &fs::File) -> Result<(), VmError> {
        self.ignore_shared()?;
        self.cmd_fd("getfd", json!({"fdname": "snap"}), Some(out.as_raw_fd()))?;
        self.cmd("migrate", json!({"uri": "fd:snap"}))?;
        let t0 = Instant::now();
        loop {
            let st = self.cmd("query-migrate", json!({}))?;
            match st.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(()),
                Some("failed") | Some("cancelled") => {
                    let why = st
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no reason given");
                    return Err(qmp(
                        "migrate",
                        QmpError::Stuck(format!("saving the VM's state failed: {why}")),
                    ));
                }
                _ if t0.elapsed() > Duration::from_secs(300) => {
                    return Err(qmp(
                        "migrate",
                        QmpError::Stuck("saving the VM's state took over 300 s".into()),
                    ))
                }
                _ => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }
}

pub(super) fn send_with_fd(sock: &UnixStream, data: &[u8], fd: RawFd) -> io::Result<()> {
    let n = locker_sys::fd::send_with_fd(sock.as_raw_fd(), data, fd)?;
    if n < data.len() {
        (&*sock).write_all(&data[n..])?;
    }
    Ok(())
}
