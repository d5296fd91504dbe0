//! One stream of a connection: what the reader routed to it, received with credit
//! returned as it is consumed ([`AgentStream`]), and its sending half ([`StreamSender`]),
//! which waits for the agent's credit before each chunk. Dropping a stream before its
//! `End` cancels the operation in the machine.

use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use locker_proto::{Chan, Control, EndBody, Frame, PtySize, Reply, DATA_CHUNK};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{mpsc, Semaphore};

use super::conn::{lock, Event, Inner};
use super::{AgentClientError, Result, SLOW_CALL_DEADLINE};

/// One thing that came on a stream (see [`AgentStream::recv`]).
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    Msg(Reply),
    Data(Chan, Vec<u8>),
    Eof(Chan),
    /// The final frame; nothing follows it.
    End(EndBody),
}

/// The sending half of a stream: data (with flow control), end of data, control, cancel.
/// Cheap to clone, so one task can feed a stream while another reads it.
#[derive(Clone)]
pub struct StreamSender {
    pub(super) id: u32,
    pub(super) inner: Arc<Inner>,
    pub(super) credit: Arc<Semaphore>,
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
    pub(super) sender: StreamSender,
    pub(super) rx: mpsc::UnboundedReceiver<Event>,
    pub(super) unacked: Arc<AtomicUsize>,
    pub(super) queued: Arc<AtomicUsize>,
    pub(super) ended: bool,
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

    pub(super) async fn recv_raw(&mut self) -> Result<Option<StreamEvent>> {
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
    pub(super) fn ack(&self, chan: Chan, n: usize) {
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

    pub(super) fn lost(&self) -> AgentClientError {
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

/// Sends everything `data` yields on `chan`, then `Eof` on `end_chan`, while watching for the
/// stream's `End` (which may come early, e.g. an error before all data was sent). With
/// `deadline`, the agent must take each chunk (return credit) within it, and answer within
/// [`SLOW_CALL_DEADLINE`] after the last (it syncs the file): a file write, which only the
/// agent's disk slows. Without, a reader inside the machine sets the pace (a process's
/// stdin).
pub(super) async fn upload(
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
