//! Ports inside a machine, from the host: the list of listening TCP ports, and a tunnel to
//! one of them as an ordinary async byte stream (`AsyncRead + AsyncWrite`) that an HTTP
//! client, a WebSocket relay or a plain copy can drive.
//!
//! The tunnel is one stream of the agent connection (`Request::Connect`): the agent
//! connects to the port on the machine's loopback, so this adds no route or address to the
//! machine and works the same for jails and microVMs. Flow control is the stream's credit in
//! both directions: a slow reader here stops the machine's sender after one window, and a
//! machine that stops reading stops our writes. This room knows nothing of HTTP, tenants or
//! preview domains (the server's port proxy does).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use locker_proto::{Chan, EndBody, ErrorCode, PortInfo, Reply, Request, DATA_CHUNK};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::agent::{
    AgentClient, AgentClientError, AgentStream, StreamEvent, StreamSender, CALL_DEADLINE,
};

/// Why a port could not be listed or reached.
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// Nothing listens on the port in the machine (the agent's words say which addresses).
    #[error("{0}")]
    NotListening(String),
    /// The agent of this machine predates ports (a sandbox adopted from an earlier release).
    #[error(
        "this sandbox's agent is older than port forwarding: recreate the sandbox to use ports"
    )]
    Unsupported,
    #[error(transparent)]
    Agent(#[from] AgentClientError),
    /// The machine has this many connections from the proxy open already.
    #[error(
        "{0} connections to the machine's ports are open already (the limit per sandbox): \
         close some (kept-alive connections, WebSockets) and retry"
    )]
    Busy(usize),
    /// The host could not make the connection (entering the jail's namespace, a thread).
    #[error("connecting into the machine: {0}")]
    Dial(std::io::Error),
}

fn classify(e: AgentClientError) -> PortError {
    match &e {
        AgentClientError::Agent(a) if a.code == ErrorCode::NotFound => {
            PortError::NotListening(a.message.clone())
        }
        // An agent that does not know the request drops the connection or refuses the frame.
        AgentClientError::Protocol(m) | AgentClientError::ConnectionLost(m)
            if m.contains("unknown variant") =>
        {
            PortError::Unsupported
        }
        _ => PortError::Agent(e),
    }
}

/// The first answer on a stream: a message, or its `End` (an error `End` as the error).
async fn answer(s: &mut AgentStream, what: &str) -> Result<StreamEvent, PortError> {
    loop {
        match s.recv_within(CALL_DEADLINE).await.map_err(classify)? {
            Some(StreamEvent::End(EndBody::Error(e))) => {
                return Err(classify(AgentClientError::Agent(e)))
            }
            Some(ev @ (StreamEvent::Msg(_) | StreamEvent::End(_))) => return Ok(ev),
            Some(_) => {}
            None => {
                return Err(PortError::Agent(AgentClientError::ConnectionLost(format!(
                    "{what} ended without an answer"
                ))))
            }
        }
    }
}

fn unexpected(what: &str, ev: &StreamEvent) -> PortError {
    PortError::Agent(AgentClientError::Protocol(format!(
        "{what} answered {ev:?}"
    )))
}

/// The TCP ports listening in the machine now, by port then address.
pub async fn list(client: &AgentClient) -> Result<Vec<PortInfo>, PortError> {
    let mut s = client.open(Request::ListPorts).map_err(classify)?;
    match answer(&mut s, "ListPorts").await? {
        StreamEvent::End(EndBody::Ports(p)) => Ok(p),
        other => Err(unexpected("ListPorts", &other)),
    }
}

/// Opens a tunnel to `port` on the machine's loopback.
pub async fn connect(client: &AgentClient, port: u16) -> Result<Tunnel, PortError> {
    let mut stream = client.open(Request::Connect { port }).map_err(classify)?;
    match answer(&mut stream, "Connect").await? {
        StreamEvent::Msg(Reply::Connected { address }) => {
            let sender = stream.sender();
            Ok(Tunnel {
                stream,
                sender,
                address,
                pending: Vec::new(),
                at: 0,
                read_done: false,
                write: None,
            })
        }
        other => Err(unexpected("Connect", &other)),
    }
}

type Write = Pin<Box<dyn Future<Output = Result<usize, AgentClientError>> + Send>>;

/// A byte stream to a port in the machine. Dropping it closes the connection there.
pub struct Tunnel {
    stream: AgentStream,
    sender: StreamSender,
    /// The machine-side address it reached (`127.0.0.1:8000` or `[::1]:8000`).
    pub address: String,
    /// Received and not yet read.
    pending: Vec<u8>,
    at: usize,
    read_done: bool,
    /// A write waiting for the agent's credit.
    write: Option<Write>,
}

fn io_err(e: AgentClientError) -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, e.to_string())
}

impl AsyncRead for Tunnel {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if self.at < self.pending.len() {
                let n = buf.remaining().min(self.pending.len() - self.at);
                let at = self.at;
                buf.put_slice(&self.pending[at..at + n]);
                self.at += n;
                return Poll::Ready(Ok(()));
            }
            if self.read_done {
                return Poll::Ready(Ok(()));
            }
            match std::task::ready!(self.stream.poll_recv(cx)) {
                Ok(Some(StreamEvent::Data(Chan::Stdout, bytes))) => {
                    self.pending = bytes;
                    self.at = 0;
                }
                Ok(Some(StreamEvent::Eof(Chan::Stdout))) | Ok(Some(StreamEvent::End(_))) => {
                    self.read_done = true;
                }
                Ok(Some(_)) => {}
                Ok(None) => self.read_done = true,
                Err(e) => return Poll::Ready(Err(io_err(e))),
            }
        }
    }
}

impl AsyncWrite for Tunnel {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.write.is_none() {
            // A caller retries with the same bytes after `Pending`, so the first chunk of
            // this buffer is what the stored write sends.
            let chunk = buf[..buf.len().min(DATA_CHUNK)].to_vec();
            let sender = self.sender.clone();
            self.write = Some(Box::pin(async move {
                sender.send_data(Chan::Stdin, &chunk).await?;
                Ok(chunk.len())
            }));
        }
        let done = std::task::ready!(self
            .write
            .as_mut()
            .map(|w| w.as_mut().poll(cx))
            .unwrap_or(Poll::Ready(Ok(0))));
        self.write = None;
        Poll::Ready(done.map_err(io_err))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Every write that returned `Ready` is on the connection already; a write waiting
        // for credit returned `Pending`, so it is not the caller's yet.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.sender.send_eof(Chan::Stdin).map_err(io_err))
    }
}
