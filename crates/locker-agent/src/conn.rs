//! One host connection: the `Hello` exchange, the reader that demultiplexes frames onto
//! streams, the writer lock, and credit-based flow control in both directions.
//!
//! Threads: the connection's reader (the thread `serve` runs on) only ever dispatches. It never
//! writes and never waits on a stream, so a stalled stream cannot stall the connection. Each
//! stream runs on its own thread; writes go through one lock per connection, one whole frame
//! at a time.
//!
//! Flow control (see `locker_proto`): the window is per stream and direction. Outbound, a
//! stream's producer blocks in [`Stream::data`] until the host has returned credit. Inbound,
//! data the host sends beyond the window it was given is a protocol violation and drops the
//! connection; consumers hand credit back with [`Stream::credit`] as they use the data.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use locker_proto::{
    read_frame, AgentError, Chan, Control, EndBody, ErrorCode, Frame, Hello, Reply, Request,
    DATA_CHUNK, INITIAL_WINDOW, MAX_PAYLOAD, PROTOCOL_VERSION,
};

use crate::Agent;

/// The stream was cancelled by the host or its connection is gone: stop producing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone;

/// Something the host sent on an open stream.
#[derive(Debug)]
pub enum Inbound {
    Data(Chan, Vec<u8>),
    Eof(Chan),
    Control(Control),
}

/// The outcome of waiting for inbound frames.
#[derive(Debug)]
pub enum Recv {
    Item(Inbound),
    Timeout,
    Gone,
}

/// One connection to the host.
pub struct Conn {
    /// A unix stream socket, or a microVM's virtio-serial port (read and written alike).
    sock: File,
    writer: Mutex<File>,
    streams: Mutex<HashMap<u32, Arc<Stream>>>,
    closed: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Conn {
    fn write(&self, f: &Frame) -> Result<(), Gone> {
        let mut buf = Vec::new();
        if let Err(e) = f.encode(&mut buf) {
            eprintln!("locker-agent: cannot encode a frame: {e}");
            return Err(Gone);
        }
        let mut w = lock(&self.writer);
        // Checked under the writer lock: once `close` returned, nothing more is written
        // (a virtio port outlives its connection and carries the next one).
        if self.closed.load(Ordering::Acquire) {
            return Err(Gone);
        }
        if w.write_all(&buf).is_err() {
            drop(w);
            self.close();
            return Err(Gone);
        }
        Ok(())
    }

    /// Drops the connection: every stream on it is cancelled.
    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // A virtio port answers ENOTSOCK, which is fine.
        let _ = locker_sys::fd::shutdown(self.sock.as_raw_fd());
        // Wait out a write in progress.
        drop(lock(&self.writer));
        let streams: Vec<Arc<Stream>> = lock(&self.streams).drain().map(|(_, s)| s).collect();
        for s in streams {
            s.cancel();
        }
    }
}

struct StreamState {
    inbox: VecDeque<Inbound>,
    inbox_bytes: usize,
    credit: u64,
    cancelled: bool,
    ended: bool,
    watchers: Vec<Box<dyn FnOnce() + Send>>,
}

/// One open stream: what its handler thread uses to talk to the host.
pub struct Stream {
    pub id: u32,
    /// When the host's `Open` arrived.
    pub opened: Instant,
    conn: Arc<Conn>,
    state: Mutex<StreamState>,
    cond: Condvar,
}

impl Stream {
    /// Sends a non-final message.
    pub fn msg(&self, msg: Reply) -> Result<(), Gone> {
        if lock(&self.state).ended {
            return Err(Gone);
        }
        self.conn.write(&Frame::Msg {
            stream: self.id,
            msg,
        })
    }

    /// Sends bytes on a channel, in chunks, each only once the host has given credit for it.
    /// Blocks while the host's consumer is behind; returns `Gone` if the stream is cancelled.
    pub fn data(&self, chan: Chan, mut bytes: &[u8]) -> Result<(), Gone> {
        while !bytes.is_empty() {
            let n = {
                let mut st = lock(&self.state);
                loop {
                    if st.cancelled || st.ended {
                        return Err(Gone);
                    }
                    if st.credit > 0 {
                        break;
                    }
                    st = self.cond.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                let n = bytes.len().min(DATA_CHUNK).min(st.credit as usize);
                st.credit -= n as u64;
                n
            };
            self.conn.write(&Frame::Data {
                stream: self.id,
                chan,
                bytes: bytes[..n].to_vec(),
            })?;
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Says that nothing more comes on `chan` (the stream itself stays open).
    pub fn eof(&self, chan: Chan) -> Result<(), Gone> {
        if lock(&self.state).ended {
            return Err(Gone);
        }
        self.conn.write(&Frame::Eof {
            stream: self.id,
            chan,
        })
    }

    /// Hands `n` bytes of credit back to the host after consuming its data.
    pub fn credit(&self, chan: Chan, n: usize) {
        if n == 0 || lock(&self.state).ended {
            return;
        }
        let _ = self.conn.write(&Frame::Credit {
            stream: self.id,
            chan,
            bytes: n as u32,
        });
    }

    /// Sends the final frame; the stream is dead afterwards. A body too large for one frame is
    /// replaced by an error saying so.
    pub fn end(&self, body: EndBody) {
        {
            let mut st = lock(&self.state);
            if st.ended {
                return;
            }
            st.ended = true;
            st.inbox.clear();
            self.cond.notify_all();
        }
        lock(&self.conn.streams).remove(&self.id);
        let frame = Frame::End {
            stream: self.id,
            body,
        };
        let mut probe = Vec::new();
        if frame.encode(&mut probe).is_err() {
            let err = AgentError::new(ErrorCode::Internal, "the reply does not fit in one frame");
            let _ = self.conn.write(&Frame::End {
                stream: self.id,
                body: EndBody::Error(err),
            });
            return;
        }
        let _ = self.conn.write(&frame);
    }

    /// Ends the stream with an error.
    pub fn fail(&self, err: AgentError) {
        self.end(EndBody::Error(err));
    }

    /// Waits for the next thing the host sent (up to `timeout`, or forever).
    pub fn recv(&self, timeout: Option<Duration>) -> Recv {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = lock(&self.state);
        loop {
            if let Some(item) = st.inbox.pop_front() {
                if let Inbound::Data(_, b) = &item {
                    st.inbox_bytes -= b.len();
                }
                return Recv::Item(item);
            }
            if st.cancelled || st.ended {
                return Recv::Gone;
            }
            match deadline {
                None => st = self.cond.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Recv::Timeout;
                    }
                    st = self
                        .cond
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }

    /// Whether the host cancelled the stream or the connection is gone.
    pub fn is_cancelled(&self) -> bool {
        lock(&self.state).cancelled
    }

    /// Runs `f` once when the stream is cancelled (at once if it already is).
    pub fn on_cancel(&self, f: impl FnOnce() + Send + 'static) {
        let mut st = lock(&self.state);
        if st.cancelled {
            drop(st);
            f();
        } else {
            st.watchers.push(Box::new(f));
        }
    }

    fn cancel(&self) {
        let watchers = {
            let mut st = lock(&self.state);
            st.cancelled = true;
            self.cond.notify_all();
            std::mem::take(&mut st.watchers)
        };
        for w in watchers {
            w();
        }
    }

    /// Queues inbound data; false if the host overran the window it was given.
    fn deliver(&self, item: Inbound) -> bool {
        let mut st = lock(&self.state);
        if st.ended {
            return true;
        }
        if let Inbound::Data(_, b) = &item {
            st.inbox_bytes += b.len();
            if st.inbox_bytes > INITIAL_WINDOW as usize {
                return false;
            }
        }
        st.inbox.push_back(item);
        self.cond.notify_all();
        true
    }

    fn add_credit(&self, n: u32) {
        let mut st = lock(&self.state);
        st.credit = st.credit.saturating_add(u64::from(n));
        self.cond.notify_all();
    }
}

/// Serves one connection until it ends; never panics on anything the host sends.
pub fn serve(agent: Arc<Agent>, sock: File) {
    serve_conn(agent, sock, None);
}

/// Serves one connection on a microVM's virtio port. A `Hello` from the host in the middle
/// of it means a new host is on the other end (the VM was restored from a snapshot taken
/// while connected): the connection ends and that `Hello` is returned, to start the next
/// one with (`host_hello`).
pub fn serve_port(agent: Arc<Agent>, port: File, host_hello: Option<Hello>) -> Option<Hello> {
    serve_conn(agent, port, host_hello.map(Some).or(Some(None)))
}

/// `port`: `None` for a socket; `Some(hello)` for a port, with the host's `Hello` if it
/// already came.
fn serve_conn(agent: Arc<Agent>, sock: File, port: Option<Option<Hello>>) -> Option<Hello> {
    let writer = sock.try_clone().ok()?;
    let mut reader = sock.try_clone().ok()?;
    let conn = Arc::new(Conn {
        sock,
        writer: Mutex::new(writer),
        streams: Mutex::new(HashMap::new()),
        closed: AtomicBool::new(false),
    });
    let hello = Hello {
        version: PROTOCOL_VERSION,
        peer: format!("locker-agent {}", env!("CARGO_PKG_VERSION")),
        features: vec![
            locker_proto::FEATURE_SPAWN_FOLLOW.into(),
            locker_proto::FEATURE_FILE_METADATA.into(),
            locker_proto::FEATURE_SHARE_HOLD.into(),
        ],
    };
    if conn.write(&Frame::Hello(hello)).is_err() {
        return None;
    }
    let is_port = port.is_some();
    let mut scratch = Vec::with_capacity(64 * 1024);
    let first = match port.flatten() {
        Some(h) => Ok(Some(Frame::Hello(h))),
        None => read_frame(&mut reader, &mut scratch),
    };
    match first {
        Ok(Some(Frame::Hello(h))) if h.version == PROTOCOL_VERSION => {}
        Ok(Some(Frame::Hello(h))) => {
            eprintln!(
                "locker-agent: host {:?} speaks protocol {}, this agent {PROTOCOL_VERSION}",
                h.peer, h.version
            );
            conn.close();
            return None;
        }
        Ok(None) => {
            conn.close();
            return None;
        }
        Ok(Some(other)) => {
            eprintln!(
                "locker-agent: dropping a connection whose first frame is not Hello: {:?}",
                kind_of(&other)
            );
            conn.close();
            return None;
        }
        Err(e) => {
            eprintln!("locker-agent: dropping a connection: {e}");
            conn.close();
            return None;
        }
    }
    let read_all =
        std::panic::AssertUnwindSafe(|| read_loop(agent, &conn, reader, scratch, is_port));
    let next = match std::panic::catch_unwind(read_all) {
        Ok(next) => next,
        Err(_) => {
            eprintln!("locker-agent: a connection reader failed; dropping the connection");
            None
        }
    };
    conn.close();
    next
}

/// Reads and routes frames until the connection ends or breaks the protocol; on a port, a
/// new host's `Hello` ends it too and is returned.
fn read_loop(
    agent: Arc<Agent>,
    conn: &Arc<Conn>,
    mut reader: File,
    mut scratch: Vec<u8>,
    is_port: bool,
) -> Option<Hello> {
    loop {
        // Keep the reusable buffer from holding on to a large payload forever.
        if scratch.capacity() > 2 * DATA_CHUNK {
            scratch = Vec::with_capacity(DATA_CHUNK);
        }
        let frame = match read_frame(&mut reader, &mut scratch) {
            Ok(Some(Frame::Hello(h))) if is_port => return Some(h),
            Ok(Some(f)) => f,
            Ok(None) => return None,
            Err(e) => {
                if !conn.closed.load(Ordering::Acquire) {
                    eprintln!("locker-agent: dropping a connection: {e}");
                }
                return None;
            }
        };
        if let Err(why) = dispatch(&agent, conn, frame) {
            eprintln!("locker-agent: dropping a connection: {why}");
            return None;
        }
    }
}

fn kind_of(f: &Frame) -> &'static str {
    match f {
        Frame::Hello(_) => "hello",
        Frame::Open { .. } => "open",
        Frame::Msg { .. } => "msg",
        Frame::Data { .. } => "data",
        Frame::Eof { .. } => "eof",
        Frame::Credit { .. } => "credit",
        Frame::Control { .. } => "control",
        Frame::Cancel { .. } => "cancel",
        Frame::End { .. } => "end",
    }
}

fn stream_of(conn: &Conn, id: u32) -> Option<Arc<Stream>> {
    lock(&conn.streams).get(&id).cloned()
}

/// Routes one frame. Frames for streams that already ended are dropped quietly: the host may
/// send credit or stdin before it has seen the `End`.
fn dispatch(agent: &Arc<Agent>, conn: &Arc<Conn>, frame: Frame) -> Result<(), String> {
    match frame {
        Frame::Open { stream, req } => {
            if stream == 0 {
                return Err("open on stream 0".into());
            }
            let s = Arc::new(Stream {
                id: stream,
                opened: Instant::now(),
                conn: conn.clone(),
                state: Mutex::new(StreamState {
                    inbox: VecDeque::new(),
                    inbox_bytes: 0,
                    credit: u64::from(INITIAL_WINDOW),
                    cancelled: false,
                    ended: false,
                    watchers: Vec::new(),
                }),
                cond: Condvar::new(),
            });
            {
                let mut streams = lock(&conn.streams);
                if streams.contains_key(&stream) {
                    return Err(format!("stream {stream} opened twice"));
                }
                streams.insert(stream, s.clone());
            }
            let agent = agent.clone();
            let worker = s.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("stream-{stream}"))
                .stack_size(512 * 1024)
                .spawn(move || handle_guarded(&agent, &worker, req));
            if let Err(e) = spawned {
                s.fail(AgentError::new(
                    ErrorCode::Busy,
                    format!(
                        "the machine cannot start another thread ({e}): it is out of processes \
                         or memory; end some of its processes and retry"
                    ),
                ));
            }
        }
        Frame::Data {
            stream,
            chan,
            bytes,
        } => {
            if bytes.len() > MAX_PAYLOAD {
                return Err("oversized data".into());
            }
            if let Some(s) = stream_of(conn, stream) {
                if !s.deliver(Inbound::Data(chan, bytes)) {
                    return Err(format!(
                        "the host overran the flow-control window of stream {stream}"
                    ));
                }
            }
        }
        Frame::Eof { stream, chan } => {
            if let Some(s) = stream_of(conn, stream) {
                s.deliver(Inbound::Eof(chan));
            }
        }
        Frame::Control { stream, ctl } => {
            if let Some(s) = stream_of(conn, stream) {
                s.deliver(Inbound::Control(ctl));
            }
        }
        Frame::Credit { stream, bytes, .. } => {
            if let Some(s) = stream_of(conn, stream) {
                s.add_credit(bytes);
            }
        }
        Frame::Cancel { stream } => {
            if let Some(s) = stream_of(conn, stream) {
                s.cancel();
            }
        }
        other @ (Frame::Hello(_) | Frame::Msg { .. } | Frame::End { .. }) => {
            return Err(format!(
                "the host sent a {} frame, which only the agent may send",
                kind_of(&other)
            ));
        }
    }
    Ok(())
}

/// Runs [`handle`], turning a panic (a bug) into an `Internal` error for the host instead of a
/// stream that never ends; the agent keeps serving.
fn handle_guarded(agent: &Arc<Agent>, s: &Arc<Stream>, req: Request) {
    let run = std::panic::AssertUnwindSafe(|| handle(agent, s, req));
    if let Err(panic) = std::panic::catch_unwind(run) {
        let what = panic
            .downcast_ref::<&str>()
            .map(|m| m.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        s.fail(AgentError::new(
            ErrorCode::Internal,
            format!("the agent failed: {what}"),
        ));
    }
}

/// Runs one request to its `End`.
fn handle(agent: &Arc<Agent>, s: &Arc<Stream>, req: Request) {
    match req {
        Request::Ping => s.end(EndBody::Pong),
        Request::Exec(spec) => crate::exec::run_exec(agent, s, spec),
        Request::Spawn(spec) => crate::procs::spawn(agent, s, spec, false),
        Request::SpawnFollow(spec) => crate::procs::spawn(agent, s, spec, true),
        Request::ListProcesses => crate::procs::list(agent, s),
        Request::GetProcess { id } => crate::procs::get(agent, s, &id),
        Request::ResizeProcess { id, size } => crate::procs::resize(agent, s, &id, size),
        Request::ProcessOutput { id, follow } => crate::procs::output(agent, s, &id, follow),
        Request::ProcessStdin { id } => crate::procs::stdin(agent, s, &id),
        Request::SignalProcess { id, signal } => crate::procs::signal(agent, s, &id, signal),
        Request::ReadFile { path } => crate::files::read_file(agent, s, &path),
        Request::WriteFile {
            path,
            mode,
            metadata,
        } => crate::files::write_file(agent, s, &path, mode, &metadata),
        Request::ReadTar { path } => crate::archive::read_tar(agent, s, &path),
        Request::WriteTar { path } => crate::archive::write_tar(agent, s, &path),
        Request::List { path, depth } => crate::files::list(agent, s, &path, depth),
        Request::Stat { path } => crate::files::stat(agent, s, &path),
        Request::Mkdir { path } => crate::files::mkdir(agent, s, &path),
        Request::Chown { path, user } => crate::files::chown(agent, s, &path, &user),
        Request::Move { from, to } => crate::files::rename(agent, s, &from, &to),
        Request::Remove { path, recursive } => crate::files::remove(agent, s, &path, recursive),
        Request::Refresh {
            unix_ns,
            entropy,
            hostname,
        } => match crate::sys::refresh(unix_ns, &entropy, &hostname) {
            Ok(()) => s.end(EndBody::Ok),
            Err(e) => s.fail(AgentError::new(
                ErrorCode::Internal,
                format!("setting the clock and entropy: {e}"),
            )),
        },
        Request::ConfigureNet {
            interface,
            address,
            prefix,
            gateway,
        } => match crate::sys::configure_net(&interface, address, prefix, gateway) {
            Ok(()) => s.end(EndBody::Ok),
            Err(e) => s.fail(AgentError::new(
                ErrorCode::Internal,
                format!("configuring {interface}: {e}"),
            )),
        },
        Request::MountShare {
            channel,
            target,
            read_only,
        } => match crate::share::mount(channel, &target, read_only) {
            Ok(()) => s.end(EndBody::Ok),
            Err(e) => s.fail(AgentError::new(
                ErrorCode::Internal,
                format!("mounting the volume at {target}: {e}"),
            )),
        },
        Request::HoldShares { hold: true } => match crate::share::hold() {
            Ok(()) => s.end(EndBody::Ok),
            Err(e) => s.fail(AgentError::new(ErrorCode::Busy, e.to_string())),
        },
        Request::HoldShares { hold: false } => {
            crate::share::release();
            s.end(EndBody::Ok)
        }
        Request::ListPorts => crate::ports::list(s),
        Request::Watch { path, recursive } => crate::watch::watch(agent, s, &path, recursive),
        Request::Connect { port } => crate::ports::connect(agent, s, port),
        Request::Flush => {
            locker_sys::host::sync();
            s.end(EndBody::Ok);
        }
        Request::MachineUsage => {
            let m = agent.cgroups.parent_usage();
            let (cpu_ms, peak) = crate::sys::self_usage();
            s.end(EndBody::Usage(locker_types::Usage {
                cpu_ms: m.cpu_ms.unwrap_or(cpu_ms),
                peak_memory_bytes: m.peak_memory_bytes.unwrap_or(peak),
            }));
        }
    }
}
