//! The stdio side of a bridged MCP server: one background process of the sandbox, spoken to
//! in newline-delimited JSON-RPC over its stdin and stdout.
//!
//! Owns the process's link (a writer task feeding `ProcessStdin`, one long `ProcessOutput`
//! follow stream read by a framer), the table of requests in flight (ids rewritten to this
//! bridge's own counter, so answers go back to the session that asked), the `initialize`
//! handshake done once per process, and the fan-out of the server's notifications to the
//! open sessions. Must not know HTTP or sessions' transport (that is `session.rs` and rmcp).
//!
//! The process is hostile by default: a line that is not JSON-RPC is dropped (and counted),
//! a line over [`MAX_LINE`] is dropped without being held whole (the request it answered
//! gets an error), a request the process never answers gets an error at its deadline, and a
//! process that exits or closes stdout fails every request in flight. Memory is bounded by
//! [`MAX_LINE`], [`MAX_IN_FLIGHT`] and the stderr tail.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use locker_mcp::rmcp::model::{
    ErrorCode, ErrorData, InitializeResult, NumberOrString, ProgressNotificationParam,
    ProgressToken, ServerNotification,
};
use locker_mcp::rmcp::service::{Peer, RoleServer};
use locker_proto::Chan;
use locker_runtime::agent::AgentClient;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// The longest line (one JSON-RPC message) taken from the process; longer ones are dropped.
pub const MAX_LINE: usize = 16 << 20;
/// Requests in flight to one process, across all its sessions.
pub const MAX_IN_FLIGHT: usize = 256;
/// How much of the process's stderr is kept, for error messages.
const STDERR_TAIL: usize = 2048;
/// How long the process has to answer `initialize`.
pub const INIT_DEADLINE: Duration = Duration::from_secs(60);
/// Progress tokens are rewritten to this prefix plus a counter, so sessions never collide.
const TOKEN_PREFIX: &str = "locker-";

/// Why the process cannot take requests any more.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Gone {
    #[error("the MCP server exited{code}{stderr}")]
    Exited { code: String, stderr: String },
    #[error("the MCP server's standard input is closed: {0}")]
    Stdin(String),
    #[error("the link to the MCP server broke: {0}")]
    Link(String),
    #[error("the MCP server was stopped")]
    Stopped,
}

type Answer = Result<Value, ErrorData>;

/// A progress token of a request in flight: who asked, under which token.
struct Progress {
    peer: Option<Peer<RoleServer>>,
    token: ProgressToken,
}

#[derive(Default)]
struct Table {
    pending: HashMap<u64, oneshot::Sender<Answer>>,
    progress: HashMap<String, Progress>,
    peers: Vec<Peer<RoleServer>>,
    gone: Option<Gone>,
}

/// One bridged process.
pub struct Upstream {
    pub proc_id: String,
    pub pid: i32,
    agent: AgentClient,
    lines: mpsc::Sender<Vec<u8>>,
    table: Mutex<Table>,
    next_id: AtomicU64,
    stderr: Mutex<VecDeque<u8>>,
    /// Lines from the process that were not JSON-RPC, or too long.
    pub dropped: AtomicU64,
    pub timeout: Duration,
    init: std::sync::OnceLock<InitializeResult>,
    stop: CancellationToken,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A JSON-RPC error of the bridge itself (the process is gone, late, or misbehaved).
pub fn bridge_error(msg: impl Into<String>) -> ErrorData {
    ErrorData::new(ErrorCode::INTERNAL_ERROR, msg.into(), None)
}

impl Upstream {
    /// Takes over a started process: its output is followed from the first byte.
    pub fn attach(
        agent: AgentClient,
        proc_id: String,
        pid: i32,
        timeout: Duration,
    ) -> Arc<Upstream> {
        let (lines, lines_rx) = mpsc::channel(64);
        let up = Arc::new(Upstream {
            proc_id,
            pid,
            agent,
            lines,
            table: Mutex::default(),
            next_id: AtomicU64::new(1),
            stderr: Mutex::default(),
            dropped: AtomicU64::new(0),
            timeout,
            init: std::sync::OnceLock::new(),
            stop: CancellationToken::new(),
        });
        tokio::spawn(write_loop(up.clone(), lines_rx));
        tokio::spawn(read_loop(up.clone()));
        up
    }

    /// Why it cannot take requests, if it cannot.
    pub fn gone(&self) -> Option<Gone> {
        lock(&self.table).gone.clone()
    }

    /// The `initialize` answer every session gets.
    pub fn info(&self) -> Option<&InitializeResult> {
        self.init.get()
    }

    /// Sessions that get the process's notifications.
    pub fn add_peer(&self, peer: Peer<RoleServer>) {
        let mut t = lock(&self.table);
        t.peers.retain(|p| !p.is_transport_closed());
        t.peers.push(peer);
    }

    /// The handshake: `initialize` as this bridge's own client, then `initialized`.
    pub async fn initialize(&self) -> Result<(), ErrorData> {
        let params = json!({
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "locker-mcp-bridge", "version": env!("CARGO_PKG_VERSION")},
        });
        let v = self
            .request_within(
                "initialize",
                Some(params),
                None,
                &CancellationToken::new(),
                INIT_DEADLINE.min(self.timeout.max(Duration::from_secs(10))),
            )
            .await?;
        let info: InitializeResult = serde_json::from_value(v).map_err(|e| {
            bridge_error(format!(
                "the MCP server's answer to initialize is not an InitializeResult: {e}"
            ))
        })?;
        let _ = self.init.set(info);
        self.notify("notifications/initialized", None).await;
        Ok(())
    }

    /// Sends one request and waits for its answer, the deadline, or `cancel`.
    pub async fn request(
        &self,
        method: &str,
        params: Option<Value>,
        peer: Option<Peer<RoleServer>>,
        cancel: &CancellationToken,
    ) -> Answer {
        self.request_within(method, params, peer, cancel, self.timeout)
            .await
    }

    async fn request_within(
        &self,
        method: &str,
        mut params: Option<Value>,
        peer: Option<Peer<RoleServer>>,
        cancel: &CancellationToken,
        deadline: Duration,
    ) -> Answer {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut t = lock(&self.table);
            if let Some(g) = &t.gone {
                return Err(bridge_error(self.explain(g)));
            }
            if t.pending.len() >= MAX_IN_FLIGHT {
                return Err(bridge_error(format!(
                    "{MAX_IN_FLIGHT} requests are already in flight to this MCP server; retry when some have answered"
                )));
            }
            t.pending.insert(id, tx);
            // A progress token is made unique per process; the notifications are routed back.
            if let Some(tok) = params
                .as_mut()
                .and_then(|p| p.get_mut("_meta"))
                .and_then(|m| m.get_mut("progressToken"))
            {
                if let Ok(orig) = serde_json::from_value::<NumberOrString>(tok.clone()) {
                    let ours = format!("{TOKEN_PREFIX}{id}");
                    *tok = Value::String(ours.clone());
                    t.progress.insert(
                        ours,
                        Progress {
                            peer: peer.clone(),
                            token: ProgressToken(orig),
                        },
                    );
                }
            }
        }
        let mut msg = json!({"jsonrpc": "2.0", "id": id, "method": method});
        if let Some(p) = params {
            msg["params"] = p;
        }
        let forget = || {
            let mut t = lock(&self.table);
            t.pending.remove(&id);
            t.progress.remove(&format!("{TOKEN_PREFIX}{id}"));
        };
        // The deadline covers the write too: a server that stops reading its stdin fills the
        // pipe, then the queue, and must not hold its callers forever.
        let until = tokio::time::Instant::now() + deadline;
        let late = || {
            bridge_error(format!(
                "the MCP server did not answer {method} within {} s (the bridge's request_timeout_s); it may be stuck",
                deadline.as_secs()
            ))
        };
        let gone = || {
            bridge_error(
                self.gone()
                    .map_or_else(|| "the MCP server is gone".into(), |g| self.explain(&g)),
            )
        };
        match tokio::time::timeout_at(until, self.send(msg)).await {
            Ok(true) => {}
            Ok(false) => {
                forget();
                return Err(gone());
            }
            Err(_) => {
                forget();
                return Err(late());
            }
        }
        tokio::select! {
            a = rx => {
                lock(&self.table).progress.remove(&format!("{TOKEN_PREFIX}{id}"));
                a.unwrap_or_else(|_| Err(gone()))
            }
            _ = tokio::time::sleep_until(until) => {
                forget();
                // Best effort: a server that stopped reading gets no more of the caller's time.
                let _ = tokio::time::timeout(Duration::from_millis(100), self.cancelled(id, "deadline")).await;
                Err(late())
            }
            _ = cancel.cancelled() => {
                forget();
                let _ = tokio::time::timeout(
                    Duration::from_millis(100),
                    self.cancelled(id, "the client cancelled the request"),
                )
                .await;
                Err(bridge_error("cancelled"))
            }
        }
    }

    async fn cancelled(&self, id: u64, why: &str) {
        self.notify(
            "notifications/cancelled",
            Some(json!({"requestId": id, "reason": why})),
        )
        .await;
    }

    /// Sends a notification (no answer expected).
    pub async fn notify(&self, method: &str, params: Option<Value>) {
        let mut msg = json!({"jsonrpc": "2.0", "method": method});
        if let Some(p) = params {
            msg["params"] = p;
        }
        self.send(msg).await;
    }

    async fn send(&self, msg: Value) -> bool {
        let mut line = serde_json::to_vec(&msg).expect("json");
        line.push(b'\n');
        tokio::select! {
            r = self.lines.send(line) => r.is_ok(),
            _ = self.stop.cancelled() => false,
        }
    }

    /// The reason with the end of the process's stderr, which usually says what went wrong.
    pub fn explain(&self, g: &Gone) -> String {
        match g {
            Gone::Exited { .. } => g.to_string(),
            _ => {
                let tail = self.stderr_tail();
                if tail.is_empty() {
                    g.to_string()
                } else {
                    format!("{g}; its stderr ends with: {tail}")
                }
            }
        }
    }

    pub fn stderr_tail(&self) -> String {
        let s = lock(&self.stderr);
        let (a, b) = s.as_slices();
        let mut v = a.to_vec();
        v.extend_from_slice(b);
        String::from_utf8_lossy(&v).trim().to_owned()
    }

    /// Marks it gone (first reason wins) and fails every request in flight.
    fn fail(&self, g: Gone) {
        let pending = {
            let mut t = lock(&self.table);
            if t.gone.is_none() {
                t.gone = Some(g.clone());
            }
            t.progress.clear();
            t.peers.clear();
            std::mem::take(&mut t.pending)
        };
        let msg = self.explain(&g);
        for (_, tx) in pending {
            let _ = tx.send(Err(bridge_error(msg.clone())));
        }
        self.stop.cancel();
    }

    /// Stops the process: SIGTERM, then SIGKILL (the whole tree) if it is still there.
    pub async fn shutdown(&self) {
        self.fail(Gone::Stopped);
        if self
            .agent
            .signal_process(&self.proc_id, libc::SIGTERM)
            .await
            .is_err()
        {
            return;
        }
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            match self.agent.get_process(&self.proc_id).await {
                Ok(p) if p.result.is_none() => {}
                _ => return,
            }
        }
        let _ = self
            .agent
            .signal_process(&self.proc_id, libc::SIGKILL)
            .await;
    }

    /// One complete line from the process.
    fn on_line(&self, line: &[u8]) {
        let line = line.trim_ascii();
        if line.is_empty() {
            return;
        }
        let Ok(Value::Object(mut m)) = serde_json::from_slice::<Value>(line) else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(proc = %self.proc_id, "an MCP server wrote a line that is not JSON-RPC");
            return;
        };
        let method = m.get("method").and_then(Value::as_str).map(str::to_owned);
        match (method, m.get("id").cloned()) {
            (None, Some(id)) => {
                let Some(id) = id.as_u64() else {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                let answer = if let Some(e) = m.remove("error") {
                    Err(serde_json::from_value::<ErrorData>(e).unwrap_or_else(|e| {
                        bridge_error(format!("the MCP server sent a malformed error: {e}"))
                    }))
                } else {
                    Ok(m.remove("result").unwrap_or(Value::Null))
                };
                if let Some(tx) = lock(&self.table).pending.remove(&id) {
                    let _ = tx.send(answer);
                }
            }
            (Some(method), Some(id)) => {
                // A request to the client. The process is shared by every session, so none
                // of them can answer for it: ping is answered here, the rest are refused.
                let reply = if method == "ping" {
                    json!({"jsonrpc": "2.0", "id": id, "result": {}})
                } else {
                    json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601,
                        "message": format!("{method} is not available: Locker's bridge shares this server between its clients and forwards no server-to-client requests")}})
                };
                let lines = self.lines.clone();
                let mut l = serde_json::to_vec(&reply).expect("json");
                l.push(b'\n');
                tokio::spawn(async move {
                    let _ = lines.send(l).await;
                });
            }
            (Some(method), None) => self.on_notification(&method, Value::Object(m)),
            (None, None) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn on_notification(&self, method: &str, msg: Value) {
        if method == "notifications/progress" {
            let Ok(mut p) = serde_json::from_value::<ProgressNotificationParam>(
                msg.get("params").cloned().unwrap_or(Value::Null),
            ) else {
                return;
            };
            let key = match &p.progress_token.0 {
                NumberOrString::String(s) => s.to_string(),
                NumberOrString::Number(n) => n.to_string(),
            };
            let target = lock(&self.table)
                .progress
                .get(&key)
                .map(|t| (t.peer.clone(), t.token.clone()));
            if let Some((Some(peer), token)) = target {
                p.progress_token = token;
                tokio::spawn(async move {
                    let _ = peer.notify_progress(p).await;
                });
            }
            return;
        }
        if method == "notifications/cancelled" {
            return;
        }
        let Ok(n) = serde_json::from_value::<ServerNotification>(msg) else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let peers = lock(&self.table).peers.clone();
        for peer in peers {
            let n = n.clone();
            tokio::spawn(async move {
                let _ = peer.send_notification(n).await;
            });
        }
    }

    fn on_stderr(&self, bytes: &[u8]) {
        let mut s = lock(&self.stderr);
        let tail = &bytes[bytes.len().saturating_sub(STDERR_TAIL)..];
        s.extend(tail);
        while s.len() > STDERR_TAIL {
            s.pop_front();
        }
    }
}

/// Writes queued lines to the process's stdin, several per agent request when they queue up.
async fn write_loop(up: Arc<Upstream>, mut rx: mpsc::Receiver<Vec<u8>>) {
    loop {
        let first = tokio::select! {
            l = rx.recv() => l,
            _ = up.stop.cancelled() => None,
        };
        let Some(mut buf) = first else { return };
        while buf.len() < (1 << 20) {
            match rx.try_recv() {
                Ok(l) => buf.extend_from_slice(&l),
                Err(_) => break,
            }
        }
        if let Err(e) = up.agent.process_stdin(&up.proc_id, &buf[..], false).await {
            // Usually the process has exited: give the reader a moment to report that (with
            // its exit code and stderr), which says more than a closed pipe.
            tokio::select! {
                _ = up.stop.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => up.fail(Gone::Stdin(e.to_string())),
            }
            return;
        }
    }
}

/// Frames stdout into lines, keeping at most [`MAX_LINE`] bytes of one.
#[derive(Default)]
struct Framer {
    buf: Vec<u8>,
    /// Dropping the rest of an over-long line; its first bytes are kept to find its id.
    skipping: Option<Vec<u8>>,
}

impl Framer {
    fn push(&mut self, up: &Upstream, mut chunk: &[u8]) {
        while !chunk.is_empty() {
            let nl = chunk.iter().position(|b| *b == b'\n');
            let (part, rest) = match nl {
                Some(i) => (&chunk[..i], Some(&chunk[i + 1..])),
                None => (chunk, None),
            };
            if self.skipping.is_none() && self.buf.len() + part.len() > MAX_LINE {
                let mut head = std::mem::take(&mut self.buf);
                head.extend_from_slice(&part[..part.len().min(256)]);
                head.truncate(256);
                self.skipping = Some(head);
            } else if self.skipping.is_none() {
                self.buf.extend_from_slice(part);
            }
            match rest {
                Some(r) => {
                    if let Some(head) = self.skipping.take() {
                        overlong(up, &head);
                    } else {
                        let line = std::mem::take(&mut self.buf);
                        up.on_line(&line);
                    }
                    chunk = r;
                }
                None => break,
            }
        }
    }
}

/// An over-long line: if it starts like an answer to a request in flight, that request
/// gets an error saying so instead of waiting for its deadline.
fn overlong(up: &Upstream, head: &[u8]) {
    up.dropped.fetch_add(1, Ordering::Relaxed);
    let id = id_of_head(head);
    tracing::debug!(proc = %up.proc_id, ?id, "an MCP server wrote a line over the limit");
    if let Some(tx) = id.and_then(|id| lock(&up.table).pending.remove(&id)) {
        let _ = tx.send(Err(bridge_error(format!(
            "the MCP server's answer is over {} MiB, the bridge's limit for one message",
            MAX_LINE >> 20
        ))));
    }
}

/// The id of a message from its first bytes (`"id": 42`), if it shows there.
fn id_of_head(head: &[u8]) -> Option<u64> {
    let text = String::from_utf8_lossy(head);
    let i = text.find("\"id\"")?;
    let rest = text[i + 4..].trim_start().strip_prefix(':')?.trim_start();
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse::<u64>().ok()
}

/// Follows the process's output until it ends; then the bridge is gone.
async fn read_loop(up: Arc<Upstream>) {
    let (tx, mut rx) = mpsc::channel::<(Chan, Vec<u8>)>(32);
    let follow = up.agent.process_output(&up.proc_id, true, tx);
    tokio::pin!(follow);
    let mut framer = Framer::default();
    let mut end = None;
    loop {
        tokio::select! {
            chunk = rx.recv() => match chunk {
                Some((Chan::Stderr, b)) => up.on_stderr(&b),
                Some((_, b)) => framer.push(&up, &b),
                None => break,
            },
            r = &mut follow, if end.is_none() => end = Some(r),
            _ = up.stop.cancelled() => return,
        }
    }
    let end = match end {
        Some(e) => e,
        None => follow.await,
    };
    let gone = match end {
        Ok(info) => {
            let code = info
                .result
                .as_ref()
                .map(|r| match r.exit_code {
                    Some(c) => format!(" with exit code {c}"),
                    None => format!(" ({:?})", r.reason),
                })
                .unwrap_or_default();
            let tail = up.stderr_tail();
            let stderr = if tail.is_empty() {
                String::new()
            } else {
                format!("; its stderr ends with: {tail}")
            };
            Gone::Exited { code, stderr }
        }
        Err(e) => Gone::Link(e.to_string()),
    };
    up.fail(gone);
}

#[cfg(test)]
mod tests {
    use super::id_of_head;

    #[test]
    fn an_overlong_lines_id_is_found_in_its_head() {
        assert_eq!(
            id_of_head(br#"{"jsonrpc":"2.0","id": 42,"result":{"content":"aaaa"#),
            Some(42)
        );
        assert_eq!(id_of_head(br#"{"jsonrpc":"2.0","result":{"id":"x"#), None);
        assert_eq!(id_of_head(b"garbage"), None);
    }
}
