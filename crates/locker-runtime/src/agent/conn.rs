//! The connection to one agent: connecting with retry, the `Hello` exchange, and the two
//! tasks every frame passes through. The writer batches queued frames into one write; the
//! reader decodes each frame and [`dispatch`] routes it to its stream, checking the
//! agent's side of flow control. Owns the connection's shared state ([`Shared`]); a
//! protocol breach here drops the whole connection, never panics.

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use locker_proto::{
    Chan, EndBody, Frame, Header, Hello, Reply, HEADER_LEN, INITIAL_WINDOW, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

use super::{AgentClient, AgentClientError, Result};

/// Frames a (restored) agent may send before its `Hello`; they are dropped.
const MAX_FRAMES_BEFORE_HELLO: usize = 256;

/// Most non-data messages that may wait unconsumed on one stream.
const MAX_QUEUED_MSGS: usize = 4096;

/// What the reader hands a stream.
pub(super) enum Event {
    Msg(Reply),
    Data(Chan, Vec<u8>),
    Eof(Chan),
    End(EndBody),
    Lost(String),
}

pub(super) struct Slot {
    pub(super) tx: mpsc::UnboundedSender<Event>,
    /// Outbound credit: permits are bytes we may still send.
    pub(super) credit: Arc<Semaphore>,
    /// Inbound bytes delivered but not yet taken by the consumer.
    pub(super) unacked: Arc<AtomicUsize>,
    /// Messages delivered but not yet taken.
    pub(super) queued: Arc<AtomicUsize>,
}

pub(super) struct Shared {
    pub(super) streams: Mutex<HashMap<u32, Slot>>,
    pub(super) closed: Mutex<Option<String>>,
    pub(super) is_closed: AtomicBool,
    /// Flips to `true` when the connection is gone, for [`AgentClient::closed`].
    pub(super) closed_tx: tokio::sync::watch::Sender<bool>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Marks the connection dead and tells every stream why.
    pub(super) fn fail(&self, why: String) {
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

    pub(super) fn lost(&self) -> AgentClientError {
        AgentClientError::ConnectionLost(
            lock(&self.closed)
                .clone()
                .unwrap_or_else(|| "closed".into()),
        )
    }
}

pub(super) struct Inner {
    pub(super) shared: Arc<Shared>,
    pub(super) out: mpsc::UnboundedSender<Vec<u8>>,
    pub(super) next_id: AtomicU32,
    pub(super) peer: String,
    /// The features the agent's `Hello` named.
    pub(super) features: Vec<String>,
    pub(super) reader: JoinHandle<()>,
    pub(super) writer: JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

impl Inner {
    pub(super) fn send(&self, f: &Frame) -> Result<()> {
        if self.shared.is_closed.load(Ordering::Acquire) {
            return Err(self.shared.lost());
        }
        let mut buf = Vec::new();
        f.encode(&mut buf)
            .map_err(|e| AgentClientError::Protocol(format!("cannot encode a frame: {e}")))?;
        self.out.send(buf).map_err(|_| self.shared.lost())
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
            features: Vec::new(),
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
        let (peer, features) = match first {
            Some(Frame::Hello(h)) if h.version == PROTOCOL_VERSION => (h.peer, h.features),
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
            features,
            reader,
            writer,
        };
        Ok(AgentClient {
            inner: Arc::new(inner),
        })
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
