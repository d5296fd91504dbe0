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

use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use locker_proto::{
    AgentError, Chan, Control, EndBody, ExecSpec, Frame, Header, Hello, ProcessInfo, PtySize,
    Reply, Request, DATA_CHUNK, HEADER_LEN, INITIAL_WINDOW, PROTOCOL_VERSION,
};
use locker_types::{Entry, ExecResult, Usage};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader, ReadBuf};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

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

/// Frames a (restored) agent may send before its `Hello`; they are dropped.
const MAX_FRAMES_BEFORE_HELLO: usize = 256;

/// Most non-data messages that may wait unconsumed on one stream.
const MAX_QUEUED_MSGS: usize = 4096;

/// What the reader hands a stream.
enum Event {
    Msg(Reply),
    Data(Chan, Vec<u8>),
    Eof(Chan),
    End(EndBody),
    Lost(String),
}

/// One thing that came on a stream (see [`AgentStream::recv`]).
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    Msg(Reply),
    Data(Chan, Vec<u8>),
    Eof(Chan),
    /// The final frame; nothing follows it.
    End(EndBody),
}

struct Slot {
    tx: mpsc::UnboundedSender<Event>,
    /// Outbound credit: permits are bytes we may still send.
    credit: Arc<Semaphore>,
    /// Inbound bytes delivered but not yet taken by the consumer.
    unacked: Arc<AtomicUsize>,
    /// Messages delivered but not yet taken.
    queued: Arc<AtomicUsize>,
}

struct Shared {
    streams: Mutex<HashMap<u32, Slot>>,
    closed: Mutex<Option<String>>,
    is_closed: AtomicBool,
    /// Flips to `true` when the connection is gone, for [`AgentClient::closed`].
    closed_tx: tokio::sync::watch::Sender<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Marks the connection dead and tells every stream why.
    fn fail(&self, why: String) {
        {
            let mut c = lock(&self.closed);
            if c.is_some() {
                return;
            }
            *c = Some(why.clone());
            self.is_closed.store(true, Ordering::Release);
        }
        self.closed_tx.send_replace(true);
        let slots: Vec<Slot> = lock(&self.streams).drain().map(|(_, s)| s).collect();
        for s in slots {
            s.credit.close();
            let _ = s.tx.send(Event::Lost(why.clone()));
        }
    }

    fn lost(&self) -> AgentClientError {
        AgentClientError::ConnectionLost(
            lock(&self.closed)
                .clone()
                .unwrap_or_else(|| "closed".into()),
        )
    }
}

struct Inner {
    shared: Arc<Shared>,
    out: mpsc::UnboundedSender<Vec<u8>>,
    next_id: AtomicU32,
    peer: String,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

impl Inner {
    fn send(&self, f: &Frame) -> Result<()> {
        if self.shared.is_closed.load(Ordering::Acquire) {
            return Err(self.shared.lost());
        }
        let mut buf = Vec::new();
        f.encode(&mut buf)
            .map_err(|e| AgentClientError::Protocol(format!("cannot encode a frame: {e}")))?;
        self.out.send(buf).map_err(|_| self.shared.lost())
    }
}

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

async fn read_one(r: &mut (impl AsyncRead + Unpin)) -> Result<Option<Frame>> {
    let mut hb = [0u8; HEADER_LEN];
    match r.read_exact(&mut hb).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(AgentClientError::ConnectionLost(e.to_string())),
    }
    let h = Header::parse(&hb).map_err(|e| AgentClientError::Protocol(e.to_string()))?;
    let mut payload = vec![0u8; h.len];
    r.read_exact(&mut payload)
        .await
        .map_err(|e| AgentClientError::ConnectionLost(format!("inside a frame: {e}")))?;
    Frame::from_parts(h, &payload)
        .map(Some)
        .map_err(|e| AgentClientError::Protocol(e.to_string()))
}

impl AgentClient {
    /// Connects to the agent listening at `path`, retrying until it accepts or `timeout`
    /// passes (a machine's agent may still be starting), then exchanges `Hello`.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<AgentClient> {
        let deadline = tokio::time::Instant::now() + timeout;
        let sock = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(e) => {
                    if tokio::time::Instant::now() + Duration::from_millis(10) >= deadline {
                        return Err(AgentClientError::Timeout(format!(
                            "the agent at {} did not accept within {timeout:?} (last error: {e})",
                            path.display()
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        let (read, mut write) = sock.into_split();
        let mut read = BufReader::with_capacity(128 * 1024, read);
        let hello = Hello {
            version: PROTOCOL_VERSION,
            peer: format!("locker-runtime {}", env!("CARGO_PKG_VERSION")),
        };
        let mut buf = Vec::new();
        Frame::Hello(hello)
            .encode(&mut buf)
            .map_err(|e| AgentClientError::Protocol(e.to_string()))?;
        write
            .write_all(&buf)
            .await
            .map_err(|e| AgentClientError::ConnectionLost(e.to_string()))?;
        // A microVM restored from a snapshot taken mid-connection may still flush frames
        // of its old connection before it answers: skip a bounded number of them.
        let first = tokio::time::timeout_at(deadline, async {
            for _ in 0..MAX_FRAMES_BEFORE_HELLO {
                match read_one(&mut read).await? {
                    Some(Frame::Hello(h)) => return Ok(Some(Frame::Hello(h))),
                    Some(_) => continue,
                    None => return Ok(None),
                }
            }
            Err(AgentClientError::Protocol(
                "the agent sent too many frames before Hello".into(),
            ))
        })
        .await
        .map_err(|_| {
            AgentClientError::Timeout(format!("no Hello from the agent within {timeout:?}"))
        })??;
        let peer = match first {
            Some(Frame::Hello(h)) if h.version == PROTOCOL_VERSION => h.peer,
            Some(Frame::Hello(h)) => {
                return Err(AgentClientError::Protocol(format!(
                    "agent {:?} speaks protocol version {}, this host {PROTOCOL_VERSION}",
                    h.peer, h.version
                )))
            }
            Some(_) => {
                return Err(AgentClientError::Protocol(
                    "the agent's first frame is not Hello".into(),
                ))
            }
            None => {
                return Err(AgentClientError::ConnectionLost(
                    "the agent closed the connection at Hello".into(),
                ))
            }
        };
        let shared = Arc::new(Shared {
            streams: Mutex::new(HashMap::new()),
            closed: Mutex::new(None),
            is_closed: AtomicBool::new(false),
            closed_tx: tokio::sync::watch::channel(false).0,
        });
        let (out, out_rx) = mpsc::unbounded_channel();
        let writer = tokio::spawn(write_loop(write, out_rx, shared.clone()));
        let reader = tokio::spawn(read_loop(read, shared.clone()));
        let inner = Inner {
            shared,
            out,
            next_id: AtomicU32::new(1),
            peer,
            reader,
            writer,
        };
        Ok(AgentClient {
            inner: Arc::new(inner),
        })
    }

    /// The agent's self-description from its `Hello` (`locker-agent 0.1.0`).
    pub fn peer(&self) -> &str {
        &self.inner.peer
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

    /// A liveness check.
    pub async fn ping(&self) -> Result<()> {
        match self.call(Request::Ping).await? {
            EndBody::Pong => Ok(()),
            other => Err(unexpected("Ping", &other)),
        }
    }

    /// After a microVM restore: sets the guest's clock, entropy and hostname.
    pub async fn refresh(&self, unix_ns: u64, entropy: Vec<u8>, hostname: String) -> Result<()> {
        let req = Request::Refresh {
            unix_ns,
            entropy,
            hostname,
        };
        match self.call(req).await? {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("Refresh", &other)),
        }
    }

    /// Gives a microVM guest's `interface` its address and default route (see
    /// [`Request::ConfigureNet`]).
    pub async fn configure_net(
        &self,
        interface: &str,
        address: std::net::Ipv4Addr,
        prefix: u8,
        gateway: std::net::Ipv4Addr,
    ) -> Result<()> {
        let req = Request::ConfigureNet {
            interface: interface.to_owned(),
            address,
            prefix,
            gateway,
        };
        match self.call(req).await? {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("ConfigureNet", &other)),
        }
    }

    /// In a microVM: mounts the host tree served on `channel` at `target` (see
    /// [`Request::MountShare`]).
    pub async fn mount_share(&self, channel: u32, target: &str, read_only: bool) -> Result<()> {
        let req = Request::MountShare {
            channel,
            target: target.to_owned(),
            read_only,
        };
        match self.call(req).await? {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("MountShare", &other)),
        }
    }

    /// Flushes every filesystem of the machine to its disks.
    pub async fn flush(&self) -> Result<()> {
        match self.call_within(Request::Flush, SLOW_CALL_DEADLINE).await? {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("Flush", &other)),
        }
    }

    /// Runs a command to its end. `stdin` is fed to it then closed (without it, stdin is
    /// `/dev/null`). With `output`, stdout and stderr chunks are sent there as they come (and
    /// `spec.stream_output` is set); the agent is only given credit for more as `output`
    /// accepts them. Dropping the future before it completes kills the command's tree.
    pub async fn exec(
        &self,
        mut spec: ExecSpec,
        stdin: Option<Vec<u8>>,
        output: Option<mpsc::Sender<(Chan, Vec<u8>)>>,
    ) -> Result<ExecResult> {
        spec.stdin = stdin.is_some();
        spec.stream_output = output.is_some();
        let first = spec
            .timeout_ms
            .map(|t| Duration::from_millis(t).saturating_add(EXEC_GRACE));
        let mut stream = self.open(Request::Exec(spec))?;
        let sender = stream.sender();
        let feed = async move {
            if let Some(data) = stdin {
                if sender.send_data(Chan::Stdin, &data).await.is_ok() {
                    let _ = sender.send_eof(Chan::Stdin);
                }
            }
            std::future::pending::<()>().await
        };
        let read = async {
            // One timer for the whole call. When it fires, the exec fails only if nothing
            // came since it was last armed; otherwise it is re-armed for EXEC_GRACE. The
            // per-message cost is one counter increment.
            let far = Duration::from_secs(100 * 365 * 24 * 3600);
            let timer = tokio::time::sleep(first.unwrap_or(far));
            tokio::pin!(timer);
            let (mut seen, mut armed_at) = (0u64, 0u64);
            loop {
                let ev = tokio::select! {
                    biased;
                    ev = stream.recv_raw() => ev?,
                    _ = &mut timer, if first.is_some() => {
                        if seen == armed_at {
                            return Err(AgentClientError::Unresponsive(
                                first.unwrap_or(far),
                            ));
                        }
                        armed_at = seen;
                        timer.as_mut().reset(tokio::time::Instant::now() + EXEC_GRACE);
                        continue;
                    }
                };
                seen += 1;
                match ev {
                    Some(StreamEvent::Data(chan, bytes)) => {
                        let n = bytes.len();
                        if let Some(tx) = &output {
                            // A receiver that went away just means nobody watches any more.
                            let _ = tx.send((chan, bytes)).await;
                        }
                        stream.ack(chan, n);
                    }
                    Some(StreamEvent::End(EndBody::Exec(r))) => return Ok(*r),
                    Some(StreamEvent::End(EndBody::Error(e))) => {
                        return Err(AgentClientError::Agent(e))
                    }
                    Some(StreamEvent::End(other)) => return Err(unexpected("Exec", &other)),
                    Some(StreamEvent::Msg(_) | StreamEvent::Eof(_)) => {}
                    None => {
                        return Err(AgentClientError::ConnectionLost(
                            "stream ended without a result".into(),
                        ))
                    }
                }
            }
        };
        tokio::select! {
            r = read => r,
            _ = feed => unreachable!("the stdin feeder never completes"),
        }
    }

    /// Starts a background process: its id (`proc_…`) and pid. With `spec.stdin` its stdin is
    /// a pipe fed by [`process_stdin`](Self::process_stdin); without, `/dev/null`.
    pub async fn spawn(&self, spec: ExecSpec) -> Result<(String, i32)> {
        match self.call(Request::Spawn(spec)).await? {
            EndBody::Spawned { id, pid } => Ok((id, pid)),
            other => Err(unexpected("Spawn", &other)),
        }
    }

    /// Every background process the agent remembers, running or ended.
    pub async fn list_processes(&self) -> Result<Vec<ProcessInfo>> {
        let mut s = self.open(Request::ListProcesses)?;
        let mut all = Vec::new();
        let mut bytes = 0usize;
        let mut take = |batch: Vec<ProcessInfo>, all: &mut Vec<ProcessInfo>| {
            for p in batch {
                bytes += process_cost(&p);
                if all.len() >= MAX_LIST_PROCESSES || bytes > MAX_LIST_BYTES {
                    return Err(AgentClientError::TooLarge(format!(
                        "the machine's list of background processes passed {MAX_LIST_PROCESSES} \
                         processes or {} MiB; signal or wait for some of them",
                        MAX_LIST_BYTES >> 20
                    )));
                }
                all.push(p);
            }
            Ok(())
        };
        loop {
            match s.recv_within(CALL_DEADLINE).await? {
                Some(StreamEvent::Msg(Reply::Processes { processes })) => {
                    take(processes, &mut all)?
                }
                Some(StreamEvent::End(EndBody::Processes(batch))) => {
                    take(batch, &mut all)?;
                    return Ok(all);
                }
                Some(StreamEvent::End(EndBody::Error(e))) => return Err(e.into()),
                Some(StreamEvent::End(other)) => return Err(unexpected("ListProcesses", &other)),
                Some(_) => {}
                None => return Err(s.lost()),
            }
        }
    }

    /// One background process, with its result once it has ended.
    pub async fn get_process(&self, id: &str) -> Result<ProcessInfo> {
        match self.call(Request::GetProcess { id: id.into() }).await? {
            EndBody::Process(p) => Ok(*p),
            other => Err(unexpected("GetProcess", &other)),
        }
    }

    /// Replays a background process's output from its start into `output`, then (with
    /// `follow`) what comes until it ends; returns its state at the end of the replay.
    pub async fn process_output(
        &self,
        id: &str,
        follow: bool,
        output: mpsc::Sender<(Chan, Vec<u8>)>,
    ) -> Result<ProcessInfo> {
        let mut s = self.open(Request::ProcessOutput {
            id: id.into(),
            follow,
        })?;
        loop {
            match s.recv_raw().await? {
                Some(StreamEvent::Data(chan, bytes)) => {
                    let n = bytes.len();
                    let _ = output.send((chan, bytes)).await;
                    s.ack(chan, n);
                }
                Some(StreamEvent::End(EndBody::Process(p))) => return Ok(*p),
                Some(StreamEvent::End(EndBody::Error(e))) => return Err(e.into()),
                Some(StreamEvent::End(other)) => return Err(unexpected("ProcessOutput", &other)),
                Some(_) => {}
                None => return Err(s.lost()),
            }
        }
    }

    /// Writes `data` to a background process's stdin; with `close` its stdin is closed
    /// afterwards (the process sees end of file).
    pub async fn process_stdin(
        &self,
        id: &str,
        data: impl AsyncRead + Unpin,
        close: bool,
    ) -> Result<()> {
        let s = self.open(Request::ProcessStdin { id: id.into() })?;
        let end_chan = if close { Chan::Stdin } else { Chan::Bytes };
        match upload(s, Chan::Stdin, data, end_chan, None).await? {
            EndBody::Ok => Ok(()),
            EndBody::Error(e) => Err(e.into()),
            other => Err(unexpected("ProcessStdin", &other)),
        }
    }

    /// Sends a signal (a number, e.g. `libc::SIGTERM`) to a background process's whole tree.
    pub async fn signal_process(&self, id: &str, signal: i32) -> Result<()> {
        match self
            .call(Request::SignalProcess {
                id: id.into(),
                signal,
            })
            .await?
        {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("SignalProcess", &other)),
        }
    }

    /// Opens a file for streaming: its entry, and a reader of its bytes (an [`AsyncRead`],
    /// or chunk by chunk with [`FileReader::next_chunk`]).
    pub async fn read_file(&self, path: &str) -> Result<(Entry, FileReader)> {
        self.read_stream(Request::ReadFile { path: path.into() }, "ReadFile")
            .await
    }

    /// Opens a directory for streaming as a tar archive: its entry, and a reader of the
    /// archive's bytes.
    pub async fn read_tar(&self, path: &str) -> Result<(Entry, FileReader)> {
        self.read_stream(Request::ReadTar { path: path.into() }, "ReadTar")
            .await
    }

    /// Streams a tar archive from `data` into the directory `path` (created if missing);
    /// returns the directory's entry and the entries and file bytes written.
    pub async fn write_tar(
        &self,
        path: &str,
        data: impl AsyncRead + Unpin,
    ) -> Result<(Entry, u64, u64)> {
        let s = self.open(Request::WriteTar { path: path.into() })?;
        match upload(s, Chan::Bytes, data, Chan::Bytes, Some(CALL_DEADLINE)).await? {
            EndBody::Extracted {
                entry,
                entries,
                bytes,
            } => Ok((entry, entries, bytes)),
            EndBody::Error(e) => Err(e.into()),
            other => Err(unexpected("WriteTar", &other)),
        }
    }

    async fn read_stream(&self, req: Request, what: &str) -> Result<(Entry, FileReader)> {
        let mut s = self.open(req)?;
        loop {
            match s.recv_within(CALL_DEADLINE).await? {
                Some(StreamEvent::Msg(Reply::Entry(e))) => {
                    return Ok((
                        e,
                        FileReader {
                            stream: s,
                            buf: Vec::new(),
                            pos: 0,
                            done: false,
                            timer: Box::pin(tokio::time::sleep(CALL_DEADLINE)),
                            waiting: false,
                        },
                    ))
                }
                Some(StreamEvent::End(EndBody::Error(e))) => return Err(e.into()),
                Some(StreamEvent::End(other)) => return Err(unexpected(what, &other)),
                Some(_) => {}
                None => return Err(s.lost()),
            }
        }
    }

    /// Streams `data` into a file (never whole in memory). The file appears whole or not at
    /// all; parents are created; `mode` defaults to the old file's, else 0644.
    pub async fn write_file(
        &self,
        path: &str,
        mode: Option<u32>,
        data: impl AsyncRead + Unpin,
    ) -> Result<Entry> {
        let s = self.open(Request::WriteFile {
            path: path.into(),
            mode,
        })?;
        match upload(s, Chan::Bytes, data, Chan::Bytes, Some(CALL_DEADLINE)).await? {
            EndBody::Entry(e) => Ok(e),
            EndBody::Error(e) => Err(e.into()),
            other => Err(unexpected("WriteFile", &other)),
        }
    }

    /// The entries under a directory, `depth` levels down (1: its own children), at most
    /// [`MAX_LIST_ENTRIES`] and [`MAX_LIST_BYTES`] of them.
    pub async fn list(&self, path: &str, depth: u32) -> Result<Vec<Entry>> {
        let mut l = self.list_stream(path, depth)?;
        let mut all = Vec::new();
        while let Some(batch) = l.next_batch().await? {
            all.extend(batch);
        }
        Ok(all)
    }

    /// Like [`list`](Self::list), batch by batch as they arrive, so a caller can pass a
    /// large answer on without holding it whole. The bounds are counted here.
    pub fn list_stream(&self, path: &str, depth: u32) -> Result<ListStream> {
        let stream = self.open(Request::List {
            path: path.into(),
            depth,
        })?;
        Ok(ListStream {
            stream,
            path: path.to_owned(),
            depth,
            entries: 0,
            bytes: 0,
            done: false,
        })
    }

    /// Describes a path (a symlink itself, not its target).
    pub async fn stat(&self, path: &str) -> Result<Entry> {
        self.entry_call("Stat", Request::Stat { path: path.into() })
            .await
    }

    /// Creates a directory and its parents.
    pub async fn mkdir(&self, path: &str) -> Result<Entry> {
        self.entry_call("Mkdir", Request::Mkdir { path: path.into() })
            .await
    }

    /// Renames `from` to `to` (the files API's move); returns the destination's entry.
    pub async fn rename(&self, from: &str, to: &str) -> Result<Entry> {
        self.entry_call(
            "Move",
            Request::Move {
                from: from.into(),
                to: to.into(),
            },
        )
        .await
    }

    /// Removes a file, link or empty directory; a non-empty directory needs `recursive`.
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<()> {
        match self
            .call_within(
                Request::Remove {
                    path: path.into(),
                    recursive,
                },
                SLOW_CALL_DEADLINE,
            )
            .await?
        {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("Remove", &other)),
        }
    }

    /// The whole machine's CPU time and peak memory so far.
    pub async fn machine_usage(&self) -> Result<Usage> {
        match self.call(Request::MachineUsage).await? {
            EndBody::Usage(u) => Ok(u),
            other => Err(unexpected("MachineUsage", &other)),
        }
    }

    async fn entry_call(&self, what: &str, req: Request) -> Result<Entry> {
        match self.call(req).await? {
            EndBody::Entry(e) => Ok(e),
            other => Err(unexpected(what, &other)),
        }
    }
}

/// What a process counts for against [`MAX_LIST_BYTES`]: its strings plus a fixed share
/// for the rest (a result's output bodies are empty in a list).
fn process_cost(p: &ProcessInfo) -> usize {
    let result = p
        .result
        .as_ref()
        .map_or(0, |r| 512 + r.stdout.len() + r.stderr.len());
    p.id.len() + p.state.len() + p.argv.iter().map(|a| a.len() + 4).sum::<usize>() + result + 96
}

/// A `List` answer arriving batch by batch (see [`AgentClient::list_stream`]).
#[derive(Debug)]
pub struct ListStream {
    stream: AgentStream,
    path: String,
    depth: u32,
    entries: usize,
    bytes: usize,
    done: bool,
}

impl ListStream {
    /// The next batch; `None` after the last. Past the bounds: `TooLarge`, and the stream is
    /// dropped (cancelled) without reading further.
    pub async fn next_batch(&mut self) -> Result<Option<Vec<Entry>>> {
        if self.done {
            return Ok(None);
        }
        let batch = loop {
            match self.stream.recv_within(CALL_DEADLINE).await? {
                Some(StreamEvent::Msg(Reply::Entries { entries })) => break entries,
                Some(StreamEvent::End(EndBody::Entries(batch))) => {
                    self.done = true;
                    break batch;
                }
                Some(StreamEvent::End(EndBody::Error(e))) => return Err(e.into()),
                Some(StreamEvent::End(other)) => return Err(unexpected("List", &other)),
                Some(_) => {}
                None => return Err(self.stream.lost()),
            }
        };
        self.entries += batch.len();
        self.bytes += batch.iter().map(locker_proto::entry_cost).sum::<usize>();
        if self.entries > MAX_LIST_ENTRIES || self.bytes > MAX_LIST_BYTES {
            self.done = true;
            let _ = self.stream.cancel();
            return Err(AgentClientError::TooLarge(format!(
                "the listing of {} at depth {} has more than {MAX_LIST_ENTRIES} entries or {} MiB: \
                 list a subdirectory or use a smaller depth",
                self.path,
                self.depth,
                MAX_LIST_BYTES >> 20
            )));
        }
        Ok(Some(batch))
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

/// Sends everything `data` yields on `chan`, then `Eof` on `end_chan`, while watching for the
/// stream's `End` (which may come early, e.g. an error before all data was sent). With
/// `deadline`, the agent must take each chunk (return credit) within it, and answer within
/// [`SLOW_CALL_DEADLINE`] after the last (it syncs the file): a file write, which only the
/// agent's disk slows. Without, a reader inside the machine sets the pace (a process's
/// stdin).
async fn upload(
    mut stream: AgentStream,
    chan: Chan,
    mut data: impl AsyncRead + Unpin,
    end_chan: Chan,
    deadline: Option<Duration>,
) -> Result<EndBody> {
    let sender = stream.sender();
    let send = async {
        let mut buf = vec![0u8; DATA_CHUNK];
        loop {
            let n = data.read(&mut buf).await.map_err(AgentClientError::Input)?;
            if n == 0 {
                break;
            }
            match deadline {
                Some(d) => tokio::time::timeout(d, sender.send_data(chan, &buf[..n]))
                    .await
                    .map_err(|_| AgentClientError::Unresponsive(d))??,
                None => sender.send_data(chan, &buf[..n]).await?,
            }
        }
        sender.send_eof(end_chan)
    };
    let recv = async {
        loop {
            match stream.recv().await? {
                Some(StreamEvent::End(b)) => return Ok(b),
                Some(_) => {}
                None => {
                    return Err(AgentClientError::ConnectionLost(
                        "stream ended without a reply".into(),
                    ))
                }
            }
        }
    };
    tokio::pin!(send);
    tokio::pin!(recv);
    let mut sent = false;
    loop {
        tokio::select! {
            r = &mut send, if !sent => {
                sent = true;
                // A local read failure aborts the upload (dropping the stream cancels it, so
                // the agent discards the partial file); a send failure means the stream ended
                // or the connection died, which `recv` reports.
                if let Err(e @ (AgentClientError::Input(_) | AgentClientError::Unresponsive(_))) = r {
                    return Err(e);
                }
                if deadline.is_some() {
                    return tokio::time::timeout(SLOW_CALL_DEADLINE, &mut recv)
                        .await
                        .map_err(|_| AgentClientError::Unresponsive(SLOW_CALL_DEADLINE))?;
                }
            }
            b = &mut recv => return b,
        }
    }
}

/// The sending half of a stream: data (with flow control), end of data, control, cancel.
/// Cheap to clone, so one task can feed a stream while another reads it.
#[derive(Clone)]
pub struct StreamSender {
    id: u32,
    inner: Arc<Inner>,
    credit: Arc<Semaphore>,
}

impl StreamSender {
    /// Sends bytes on a channel, waiting for credit from the agent as needed.
    pub async fn send_data(&self, chan: Chan, bytes: &[u8]) -> Result<()> {
        for chunk in bytes.chunks(DATA_CHUNK) {
            let permit = self
                .credit
                .acquire_many(chunk.len() as u32)
                .await
                .map_err(|_| AgentClientError::ConnectionLost("the stream has ended".into()))?;
            permit.forget();
            self.inner.send(&Frame::Data {
                stream: self.id,
                chan,
                bytes: chunk.to_vec(),
            })?;
        }
        Ok(())
    }

    /// Ends a channel (stdin: the command sees end of file; a file upload: complete).
    pub fn send_eof(&self, chan: Chan) -> Result<()> {
        self.inner.send(&Frame::Eof {
            stream: self.id,
            chan,
        })
    }

    /// Sends a control message (a terminal resize).
    pub fn control(&self, ctl: Control) -> Result<()> {
        self.inner.send(&Frame::Control {
            stream: self.id,
            ctl,
        })
    }

    /// Resizes the stream's terminal.
    pub fn resize(&self, size: PtySize) -> Result<()> {
        self.control(Control::Resize(size))
    }

    /// Asks the agent to stop the operation (kill the command's tree).
    pub fn cancel(&self) -> Result<()> {
        self.inner.send(&Frame::Cancel { stream: self.id })
    }
}

/// An open stream: receive what the agent sends; send through [`AgentStream::sender`] (or
/// the same methods here). Dropping it before its `End` cancels the operation.
pub struct AgentStream {
    sender: StreamSender,
    rx: mpsc::UnboundedReceiver<Event>,
    unacked: Arc<AtomicUsize>,
    queued: Arc<AtomicUsize>,
    ended: bool,
}

impl std::fmt::Debug for AgentStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentStream")
            .field("id", &self.sender.id)
            .field("ended", &self.ended)
            .finish()
    }
}

impl AgentStream {
    /// The stream id on its connection.
    pub fn id(&self) -> u32 {
        self.sender.id
    }

    /// A handle for sending on this stream from another task.
    pub fn sender(&self) -> StreamSender {
        self.sender.clone()
    }

    /// The next event; `Ok(None)` after the `End` was returned. Data is credited back to the
    /// agent as it is returned here, so a consumer that stops calling `recv` stops the agent's
    /// producer after one window.
    pub async fn recv(&mut self) -> Result<Option<StreamEvent>> {
        poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Like [`recv`](Self::recv) for use in `poll` code.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<StreamEvent>>> {
        let ev = std::task::ready!(self.poll_recv_raw(cx));
        if let Ok(Some(StreamEvent::Data(chan, b))) = &ev {
            self.ack(*chan, b.len());
        }
        Poll::Ready(ev)
    }

    /// Like [`recv`](Self::recv), failing with `Unresponsive` if nothing comes within
    /// `deadline`.
    pub async fn recv_within(&mut self, deadline: Duration) -> Result<Option<StreamEvent>> {
        tokio::time::timeout(deadline, self.recv())
            .await
            .map_err(|_| AgentClientError::Unresponsive(deadline))?
    }

    async fn recv_raw(&mut self) -> Result<Option<StreamEvent>> {
        poll_fn(|cx| self.poll_recv_raw(cx)).await
    }

    /// The next event without returning credit for data: the caller calls [`ack`](Self::ack)
    /// once the data is truly consumed.
    fn poll_recv_raw(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<StreamEvent>>> {
        if self.ended {
            return Poll::Ready(Ok(None));
        }
        let Some(ev) = std::task::ready!(self.rx.poll_recv(cx)) else {
            self.ended = true;
            return Poll::Ready(Err(self.sender.inner.shared.lost()));
        };
        Poll::Ready(match ev {
            Event::Data(chan, b) => Ok(Some(StreamEvent::Data(chan, b))),
            Event::Msg(m) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                Ok(Some(StreamEvent::Msg(m)))
            }
            Event::Eof(c) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                Ok(Some(StreamEvent::Eof(c)))
            }
            Event::End(b) => {
                self.ended = true;
                Ok(Some(StreamEvent::End(b)))
            }
            Event::Lost(why) => {
                self.ended = true;
                Err(AgentClientError::ConnectionLost(why))
            }
        })
    }

    /// Returns credit for `n` consumed bytes of `chan`.
    fn ack(&self, chan: Chan, n: usize) {
        if n == 0 {
            return;
        }
        self.unacked.fetch_sub(n, Ordering::AcqRel);
        if !self.ended {
            let _ = self.sender.inner.send(&Frame::Credit {
                stream: self.sender.id,
                chan,
                bytes: n as u32,
            });
        }
    }

    /// Waits for the `End`, dropping any data; an agent error becomes `Err`.
    pub async fn finish(&mut self) -> Result<EndBody> {
        loop {
            match self.recv().await? {
                Some(StreamEvent::End(EndBody::Error(e))) => return Err(e.into()),
                Some(StreamEvent::End(b)) => return Ok(b),
                Some(_) => {}
                None => {
                    return Err(AgentClientError::Protocol(
                        "the stream already ended".into(),
                    ))
                }
            }
        }
    }

    /// Sends bytes on a channel (see [`StreamSender::send_data`]).
    pub async fn send_data(&self, chan: Chan, bytes: &[u8]) -> Result<()> {
        self.sender.send_data(chan, bytes).await
    }

    /// Ends a channel.
    pub fn send_eof(&self, chan: Chan) -> Result<()> {
        self.sender.send_eof(chan)
    }

    /// Resizes the stream's terminal.
    pub fn resize(&self, size: PtySize) -> Result<()> {
        self.sender.resize(size)
    }

    /// Asks the agent to stop the operation; its `End` still follows.
    pub fn cancel(&self) -> Result<()> {
        self.sender.cancel()
    }

    fn lost(&self) -> AgentClientError {
        self.sender.inner.shared.lost()
    }
}

impl Drop for AgentStream {
    fn drop(&mut self) {
        let id = self.sender.id;
        let inner = &self.sender.inner;
        if !self.ended && !inner.shared.is_closed.load(Ordering::Acquire) {
            let _ = inner.send(&Frame::Cancel { stream: id });
        }
        lock(&inner.shared.streams).remove(&id);
    }
}

/// The bytes of a file being read from the agent.
pub struct FileReader {
    stream: AgentStream,
    buf: Vec<u8>,
    pos: usize,
    done: bool,
    /// [`CALL_DEADLINE`] for the next chunk, armed when the reader starts waiting for it
    /// (time the consumer spends elsewhere does not count).
    timer: Pin<Box<tokio::time::Sleep>>,
    waiting: bool,
}

impl std::fmt::Debug for FileReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileReader")
            .field("stream", &self.stream)
            .field("done", &self.done)
            .finish()
    }
}

impl FileReader {
    /// The next chunk of the file, `None` at its end.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>> {
        if self.pos < self.buf.len() {
            let rest = self.buf.split_off(self.pos);
            self.buf.clear();
            self.pos = 0;
            return Ok(Some(rest));
        }
        poll_fn(|cx| self.poll_chunk(cx)).await
    }

    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Vec<u8>>>> {
        loop {
            if self.done {
                return Poll::Ready(Ok(None));
            }
            if !self.waiting {
                self.waiting = true;
                self.timer
                    .as_mut()
                    .reset(tokio::time::Instant::now() + CALL_DEADLINE);
            }
            let ev = match self.stream.poll_recv(cx) {
                Poll::Ready(ev) => ev,
                Poll::Pending => {
                    std::task::ready!(self.timer.as_mut().poll(cx));
                    self.done = true;
                    return Poll::Ready(Err(AgentClientError::Unresponsive(CALL_DEADLINE)));
                }
            };
            match ev {
                Ok(Some(StreamEvent::Data(_, b))) if !b.is_empty() => {
                    self.waiting = false;
                    return Poll::Ready(Ok(Some(b)));
                }
                Ok(Some(StreamEvent::End(EndBody::Ok))) | Ok(None) => self.done = true,
                Ok(Some(StreamEvent::End(EndBody::Error(e)))) => {
                    self.done = true;
                    return Poll::Ready(Err(e.into()));
                }
                Ok(Some(StreamEvent::End(other))) => {
                    self.done = true;
                    return Poll::Ready(Err(unexpected("ReadFile", &other)));
                }
                Ok(Some(_)) => {}
                Err(e) => {
                    self.done = true;
                    return Poll::Ready(Err(e));
                }
            }
        }
    }
}

impl AsyncRead for FileReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.pos >= this.buf.len() {
            match std::task::ready!(this.poll_chunk(cx)) {
                Ok(Some(b)) => {
                    this.buf = b;
                    this.pos = 0;
                }
                Ok(None) => return Poll::Ready(Ok(())),
                Err(e) => return Poll::Ready(Err(io::Error::other(e))),
            }
        }
        let n = out.remaining().min(this.buf.len() - this.pos);
        out.put_slice(&this.buf[this.pos..this.pos + n]);
        this.pos += n;
        Poll::Ready(Ok(()))
    }
}

async fn write_loop(
    mut w: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
    shared: Arc<Shared>,
) {
    while let Some(first) = rx.recv().await {
        // Batch what is already queued into one write.
        let mut buf = first;
        while buf.len() < 256 * 1024 {
            match rx.try_recv() {
                Ok(more) => buf.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        if let Err(e) = w.write_all(&buf).await {
            shared.fail(format!("writing to the agent failed: {e}"));
            return;
        }
    }
    let _ = w.shutdown().await;
}

async fn read_loop(mut r: BufReader<OwnedReadHalf>, shared: Arc<Shared>) {
    let why = loop {
        match read_one(&mut r).await {
            Ok(Some(f)) => {
                if let Err(why) = dispatch(&shared, f) {
                    break why;
                }
            }
            Ok(None) => break "the agent closed the connection".to_string(),
            Err(e) => break e.to_string(),
        }
    };
    shared.fail(why);
}

/// Routes one frame from the agent; `Err` drops the connection.
fn dispatch(shared: &Shared, f: Frame) -> Result<(), String> {
    let streams = lock(&shared.streams);
    match f {
        Frame::Data {
            stream,
            chan,
            bytes,
        } => {
            let Some(slot) = streams.get(&stream) else {
                return Ok(());
            };
            let n = bytes.len();
            if slot.unacked.fetch_add(n, Ordering::AcqRel) + n > INITIAL_WINDOW as usize {
                return Err(format!(
                    "the agent overran the flow-control window of stream {stream}"
                ));
            }
            let _ = slot.tx.send(Event::Data(chan, bytes));
        }
        Frame::Msg { stream, msg } => queue_msg(&streams, stream, Event::Msg(msg))?,
        Frame::Eof { stream, chan } => queue_msg(&streams, stream, Event::Eof(chan))?,
        Frame::Credit { stream, bytes, .. } => {
            let Some(slot) = streams.get(&stream) else {
                return Ok(());
            };
            if slot.credit.is_closed() {
                return Ok(());
            }
            if slot
                .credit
                .available_permits()
                .saturating_add(bytes as usize)
                > INITIAL_WINDOW as usize
            {
                return Err(format!(
                    "the agent returned credit it was never given on stream {stream}"
                ));
            }
            slot.credit.add_permits(bytes as usize);
        }
        Frame::End { stream, body } => {
            drop(streams);
            if let Some(slot) = lock(&shared.streams).remove(&stream) {
                slot.credit.close();
                let _ = slot.tx.send(Event::End(body));
            }
        }
        Frame::Hello(_) => return Err("a second Hello".into()),
        Frame::Open { .. } | Frame::Control { .. } | Frame::Cancel { .. } => {
            return Err("the agent sent a frame only the host may send".into())
        }
    }
    Ok(())
}

fn queue_msg(streams: &HashMap<u32, Slot>, stream: u32, ev: Event) -> Result<(), String> {
    let Some(slot) = streams.get(&stream) else {
        return Ok(());
    };
    if slot.queued.fetch_add(1, Ordering::AcqRel) >= MAX_QUEUED_MSGS {
        return Err(format!("the agent flooded stream {stream} with messages"));
    }
    let _ = slot.tx.send(ev);
    Ok(())
}
