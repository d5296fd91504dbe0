//! The host side of the agent channel: [`AgentClient`] speaks `locker-proto` to the
//! `locker-agent` inside one machine over a unix stream socket.
//!
//! This room owns the connection (connect with retry, the `Hello` exchange), the one reader
//! task that demultiplexes frames onto streams, the one writer task every frame goes through,
//! and flow control. It owns no policy: what to run, how long to wait and what an error means
//! for an HTTP caller belong to the runtime and the server.
//!
//! Flow control: each stream has a window of [`INITIAL_WINDOW`] bytes per direction. Data
//! *to* the agent waits for credit ([`StreamSender::send_data`]); data *from* the agent is
//! credited back only when its consumer takes it, so a slow consumer (an HTTP client reading
//! slowly) slows only its own stream, and the reader task never waits on anyone.
//!
//! Hostile agents: the machine's side is untrusted (its root user can replace the agent). A
//! frame that does not decode, data beyond the window, credit never earned, or a flood of
//! messages drops the connection; nothing the agent sends can panic the host or make it hold
//! unbounded memory. A list answer is counted while it arrives and refused past
//! [`MAX_LIST_ENTRIES`] / [`MAX_LIST_BYTES`] ([`AgentClientError::TooLarge`]).
//!
//! Deadlines: a stopped agent (a command can stop it) must not hang its caller. A call
//! without a timeout of its own waits at most [`CALL_DEADLINE`] for each message (one that
//! may do much disk work first, [`SLOW_CALL_DEADLINE`]); an exec
//! waits its command's `timeout_ms` plus [`EXEC_GRACE`], and then again at most
//! `EXEC_GRACE` between messages (so a slow HTTP client reading a long output is not cut).
//! Past a deadline the call fails with [`AgentClientError::Unresponsive`]; what that means
//! for the machine (failed, killed) is the caller's policy. Long-lived streams opened with
//! [`AgentClient::open`] (a terminal, a followed output) have no deadline.
//!
//! Rooms: `conn` (connecting, the `Hello` exchange, the reader task whose
//! `dispatch` routes every frame, the writer task), `stream` ([`AgentStream`],
//! [`StreamSender`]: one request's frames, credit both ways, cancel on drop), and one room
//! per family of calls: `control` (ping, refresh, network and share set-up, flush,
//! usage), `exec` (a command to its end), `processes` (background processes) and `files`
//! (files, directories, tar, listings).

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use locker_proto::{AgentError, EndBody, Frame, Request, INITIAL_WINDOW};
use tokio::sync::{mpsc, Semaphore};

mod conn;
mod control;
mod exec;
mod files;
mod processes;
mod stream;

use conn::{lock, Inner, Slot};
pub use files::{FileReader, ListStream, WatchStream};
pub use processes::Following;
pub use stream::{AgentStream, StreamEvent, StreamSender};

/// What can go wrong talking to an agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentClientError {
    /// The connection is gone (the machine stopped, the agent died, or it was dropped for a
    /// protocol error); open a new one.
    #[error("the connection to the agent was lost: {0}")]
    ConnectionLost(String),
    /// The agent sent something the protocol does not allow.
    #[error("the agent broke the protocol: {0}")]
    Protocol(String),
    /// The agent refused or failed the request; its code says how (not found, conflict...).
    #[error("the agent refused the request: {0}")]
    Agent(#[from] AgentError),
    /// Waiting for the agent took longer than allowed.
    #[error("timed out: {0}")]
    Timeout(String),
    /// Reading the caller's data to send (a file body, stdin) failed.
    #[error("reading the data to send to the agent failed: {0}")]
    Input(#[source] io::Error),
    /// The agent did not answer within its deadline: it is stopped, hung or hostile. The
    /// connection may still be open, but the machine cannot be trusted to answer again.
    #[error("the agent did not answer within {0:?}: the machine's agent is stopped or broken")]
    Unresponsive(Duration),
    /// The answer is larger than the host accepts (see [`MAX_LIST_ENTRIES`]); nothing more
    /// of it was read.
    #[error("{0}")]
    TooLarge(String),
}

pub use locker_proto::{MAX_LIST_BYTES, MAX_LIST_ENTRIES, MAX_LIST_PROCESSES};

/// How long a call without a timeout of its own (stat, list, mkdir, a file's next chunk...)
/// waits for the agent's next message. An honest agent answers these in milliseconds; a
/// minute covers a machine under heavy load or a slow disk.
pub const CALL_DEADLINE: Duration = Duration::from_secs(60);

/// How long a call that may do much disk work before its one answer may take: a `Flush`
/// (every dirty page of the machine), a recursive remove (a tree of a million files), the
/// fsync of a file just written.
pub const SLOW_CALL_DEADLINE: Duration = Duration::from_secs(300);

/// How long after its command's `timeout_ms` an exec waits for the agent's result (the
/// agent kills the command's tree at the timeout and answers at once; the grace covers a
/// loaded host, or a microVM emulated by TCG), and then at most between two messages.
/// Missing it destroys the sandbox's machine, so it errs on the long side.
pub const EXEC_GRACE: Duration = Duration::from_secs(10);

type Result<T, E = AgentClientError> = std::result::Result<T, E>;

/// A connection to one machine's agent. Cheap to clone; all clones share the connection,
/// which lives while any clone or any open stream does.
#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("peer", &self.inner.peer)
            .finish()
    }
}

impl AgentClient {
    /// The agent's self-description from its `Hello` (`locker-agent 0.1.0`).
    pub fn peer(&self) -> &str {
        &self.inner.peer
    }

    /// Whether the agent's `Hello` named `feature` (an agent of an earlier release names
    /// none): requests that need one are sent only then.
    pub fn has_feature(&self, feature: &str) -> bool {
        self.inner.features.iter().any(|f| f == feature)
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.inner.shared.is_closed.load(Ordering::Acquire)
    }

    /// Completes when the connection is gone, with why (the agent died, closed it or broke
    /// the protocol). Holds no reference to the connection, so a watcher does not keep it
    /// open.
    pub fn closed(&self) -> impl Future<Output = String> + Send + 'static {
        let mut rx = self.inner.shared.closed_tx.subscribe();
        let shared = Arc::downgrade(&self.inner.shared);
        async move {
            let _ = rx.wait_for(|c| *c).await;
            shared
                .upgrade()
                .and_then(|s| lock(&s.closed).clone())
                .unwrap_or_else(|| "the connection was closed".into())
        }
    }

    /// Opens a stream with any request. Dropping the stream before its end cancels it.
    pub fn open(&self, req: Request) -> Result<AgentStream> {
        let id = loop {
            let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                break id;
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let credit = Arc::new(Semaphore::new(INITIAL_WINDOW as usize));
        let unacked = Arc::new(AtomicUsize::new(0));
        let queued = Arc::new(AtomicUsize::new(0));
        {
            let mut streams = lock(&self.inner.shared.streams);
            if self.is_closed() {
                return Err(self.inner.shared.lost());
            }
            streams.insert(
                id,
                Slot {
                    tx,
                    credit: credit.clone(),
                    unacked: unacked.clone(),
                    queued: queued.clone(),
                },
            );
        }
        let stream = AgentStream {
            sender: StreamSender {
                id,
                inner: self.inner.clone(),
                credit,
            },
            rx,
            unacked,
            queued,
            ended: false,
        };
        self.inner.send(&Frame::Open { stream: id, req })?;
        Ok(stream)
    }

    /// Runs a request that answers with only an `End`; an agent error becomes `Err`.
    async fn call(&self, req: Request) -> Result<EndBody> {
        self.call_within(req, CALL_DEADLINE).await
    }

    async fn call_within(&self, req: Request, deadline: Duration) -> Result<EndBody> {
        let mut s = self.open(req)?;
        tokio::time::timeout(deadline, s.finish())
            .await
            .map_err(|_| AgentClientError::Unresponsive(deadline))?
    }
}

fn unexpected(what: &str, body: &EndBody) -> AgentClientError {
    let kind = match body {
        EndBody::Ok => "ok",
        EndBody::Pong => "pong",
        EndBody::Exec(_) => "exec",
        EndBody::Spawned { .. } => "spawned",
        EndBody::Processes(_) => "processes",
        EndBody::Process(_) => "process",
        EndBody::Entry(_) => "entry",
        EndBody::Entries(_) => "entries",
        EndBody::Extracted { .. } => "extracted",
        EndBody::Usage(_) => "usage",
        EndBody::Ports(_) => "ports",
        EndBody::Error(_) => "error",
    };
    AgentClientError::Protocol(format!("a {what} request ended with a {kind} reply"))
}
