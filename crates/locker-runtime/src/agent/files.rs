//! Files in a machine: streaming reads ([`FileReader`]) and writes, tar in and out,
//! bounded listings ([`ListStream`]), stat, mkdir, move, remove.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use locker_proto::{Chan, EndBody, Reply, Request};
use locker_types::Entry;
use tokio::io::{AsyncRead, ReadBuf};

use super::stream::upload;
use super::{
    unexpected, AgentClient, AgentClientError, AgentStream, Result, StreamEvent, CALL_DEADLINE,
    MAX_LIST_BYTES, MAX_LIST_ENTRIES, SLOW_CALL_DEADLINE,
};

impl AgentClient {
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
        self.write_file_with_metadata(path, mode, std::collections::BTreeMap::new(), data)
            .await
    }

    /// [`write_file`](Self::write_file), the new file given user `metadata` (E2B's file
    /// metadata: extended attributes in the `user.e2b.` namespace). An agent that does not
    /// keep metadata ([`locker_proto::FEATURE_FILE_METADATA`]) gets none to keep: asked for
    /// some, it is `Unsupported`.
    pub async fn write_file_with_metadata(
        &self,
        path: &str,
        mode: Option<u32>,
        metadata: std::collections::BTreeMap<String, String>,
        data: impl AsyncRead + Unpin,
    ) -> Result<Entry> {
        if !metadata.is_empty() && !self.has_feature(locker_proto::FEATURE_FILE_METADATA) {
            return Err(AgentClientError::Agent(locker_proto::AgentError::new(
                locker_proto::ErrorCode::BadRequest,
                "this machine's agent is of an earlier release and keeps no file metadata \
                 (restart the sandbox on the current release)",
            )));
        }
        let s = self.open(Request::WriteFile {
            path: path.into(),
            mode,
            metadata,
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

    /// Watches a directory with inotify in the machine (see `Request::Watch`): ready once
    /// the agent has set its watches; events come from [`WatchStream::next`]. Dropping it
    /// ends the watch.
    pub async fn watch(&self, path: &str, recursive: bool) -> Result<WatchStream> {
        let mut stream = self.open(Request::Watch {
            path: path.into(),
            recursive,
        })?;
        loop {
            match stream.recv_within(SLOW_CALL_DEADLINE).await? {
                Some(StreamEvent::Msg(Reply::Entry(_))) => {
                    return Ok(WatchStream {
                        stream,
                        buf: Vec::new(),
                    })
                }
                Some(StreamEvent::End(EndBody::Error(e))) => return Err(e.into()),
                Some(StreamEvent::End(other)) => return Err(unexpected("Watch", &other)),
                Some(_) => {}
                None => return Err(stream.lost()),
            }
        }
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

    /// Gives `path` (a final link itself) to `user` and the user's primary group.
    pub async fn chown(&self, path: &str, user: &str) -> Result<()> {
        match self
            .call(Request::Chown {
                path: path.into(),
                user: user.into(),
            })
            .await?
        {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("Chown", &other)),
        }
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

    async fn entry_call(&self, what: &str, req: Request) -> Result<Entry> {
        match self.call(req).await? {
            EndBody::Entry(e) => Ok(e),
            other => Err(unexpected(what, &other)),
        }
    }
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

/// An inotify watch in the machine.
pub struct WatchStream {
    stream: AgentStream,
    /// A line of events not yet complete (the agent's batches may span frames).
    buf: Vec<u8>,
}

/// The longest line of events the host takes (a batch is far smaller).
const MAX_EVENT_LINE: usize = 1 << 20;

impl WatchStream {
    /// The next batch of events; `None` once the watched directory is gone. Waits as long
    /// as nothing changes.
    pub async fn next(&mut self) -> Result<Option<Vec<locker_proto::FsEvent>>> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return serde_json::from_slice(&line[..i]).map(Some).map_err(|e| {
                    AgentClientError::Protocol(format!("a watch sent a bad event line: {e}"))
                });
            }
            match self.stream.recv().await? {
                Some(StreamEvent::Data(_, bytes)) => {
                    self.buf.extend_from_slice(&bytes);
                    if self.buf.len() > MAX_EVENT_LINE {
                        return Err(AgentClientError::Protocol(
                            "a watch sent an event line over 1 MiB".into(),
                        ));
                    }
                }
                Some(StreamEvent::End(EndBody::Error(e))) => return Err(e.into()),
                Some(StreamEvent::End(_)) | None => return Ok(None),
                Some(_) => {}
            }
        }
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
