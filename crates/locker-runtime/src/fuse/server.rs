//! The connection: frames in, replies out, one channel per export.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};

use locker_proto::fs_frame;

use super::carry::{Restored, Table};
use super::codec::*;
use super::ops::Channel;
use super::raw;
use super::wire::*;
use super::*;

/// Reads one frame into `payload`; `None` at end of stream between frames.
pub(super) fn read_frame(r: &mut impl BufRead, payload: &mut Vec<u8>) -> io::Result<Option<u32>> {
    loop {
        match r.fill_buf() {
            Ok([]) => return Ok(None),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let mut head = [0u8; fs_frame::HEADER_LEN];
    r.read_exact(&mut head)?;
    let Some((len, channel)) = fs_frame::parse_header(&head) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a frame of {} bytes: more than {MAX_PAYLOAD}",
                u32::get(&head)
            ),
        ));
    };
    payload.resize(len, 0);
    r.read_exact(payload)?;
    Ok(Some(channel))
}

/// Where a reply's `fuse_out_header` starts in the frame.
pub(super) const FRAME_HEAD: usize = fs_frame::HEADER_LEN;

/// Answers one request into `out` as a whole frame; false when it takes no reply (or has
/// no header to reply to).
pub(super) fn handle_frame(
    channels: &mut HashMap<u32, Channel>,
    channel: u32,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> bool {
    if payload.len() < InHeader::N {
        tracing::warn!(
            channel,
            len = payload.len(),
            "fuse: a request shorter than its header, dropped"
        );
        return false;
    }
    let h = InHeader::get(payload);
    out.clear();
    out.resize(FRAME_HEAD + OutHeader::N, 0);
    let result = match channels.get_mut(&channel) {
        None => Err(Errno(libc::ENODEV)),
        Some(ch) => body_of(&h, payload).and_then(|body| ch.dispatch(&h, body, out)),
    };
    if matches!(h.opcode, FORGET | BATCH_FORGET | INTERRUPT | NOTIFY_REPLY) {
        return false;
    }
    let error = match result {
        Ok(()) => 0,
        Err(Errno(e)) => {
            if e == libc::ENOSYS {
                tracing::debug!(channel, opcode = h.opcode, "fuse: not served");
            }
            out.truncate(FRAME_HEAD + OutHeader::N);
            -e
        }
    };
    let len = out.len() - FRAME_HEAD;
    out[..FRAME_HEAD].copy_from_slice(&fs_frame::header(channel, len));
    let mut head = Vec::with_capacity(OutHeader::N);
    OutHeader {
        len: len as u32,
        error,
        unique: h.unique,
    }
    .put(&mut head);
    out[FRAME_HEAD..FRAME_HEAD + OutHeader::N].copy_from_slice(&head);
    true
}

/// Serves FUSE requests arriving on `conn` until it reaches EOF (Ok) or fails.
///
/// Fails at once when an export's root cannot be opened or two exports share a channel,
/// later on a read or write error of `conn` or a frame bigger than [`MAX_PAYLOAD`].
pub fn serve(conn: UnixStream, exports: &[Export]) -> io::Result<()> {
    Server::open(exports)?.run(conn)
}

/// A server with its exports' roots and `/proc/self/fd` open: after [`Server::open`] it
/// needs no path of the host any more (its caller may unmount `/proc`).
pub struct Server {
    /// Shared with [`TableReader`]s (the file server's control socket); the serving loop
    /// takes the lock for one request at a time.
    channels: Arc<Mutex<HashMap<u32, Channel>>>,
    /// Every channel reopens files through this directory (its raw fd is theirs too).
    _proc_fd: OwnedFd,
}

impl Server {
    /// Opens `/proc/self/fd` and every export's root; fails when a root cannot be opened or
    /// two exports share a channel.
    pub fn open(exports: &[Export]) -> io::Result<Self> {
        let proc_fd = raw::open_dir(Path::new("/proc/self/fd"))?;
        let mut channels = HashMap::new();
        for e in exports {
            let ch = Channel::new(e, proc_fd.as_raw_fd())?;
            if channels.insert(e.channel, ch).is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("channel {} is exported twice", e.channel),
                ));
            }
        }
        Ok(Self {
            channels: Arc::new(Mutex::new(channels)),
            _proc_fd: proc_fd,
        })
    }

    /// [`Server::open`], then the nodes and handles of a carried table taken in
    /// (`super::carry`): what it brought back, and what it could not.
    pub fn open_carried(exports: &[Export], table: &Table) -> io::Result<(Self, Restored)> {
        let server = Self::open(exports)?;
        let mut all = Restored::default();
        {
            let mut channels = server.channels.lock().expect("channels");
            for t in &table.channels {
                let Some(ch) = channels.get_mut(&t.channel) else {
                    all.lost_nodes += t.nodes.len() as u64;
                    all.lost_handles += t.handles.len() as u64;
                    continue;
                };
                let r = ch.restore(t);
                all.nodes += r.nodes;
                all.handles += r.handles;
                all.lost_nodes += r.lost_nodes;
                all.lost_handles += r.lost_handles;
            }
        }
        Ok((server, all))
    }

    /// What reads this server's table from another thread while it serves.
    pub fn table_reader(&self) -> TableReader {
        TableReader(self.channels.clone())
    }

    /// Serves until `conn` reaches its end between frames, or its peer goes away while a
    /// reply is written (Ok), or it fails.
    pub fn run(self, conn: UnixStream) -> io::Result<()> {
        let mut reader = BufReader::with_capacity(256 * 1024, &conn);
        let mut writer = &conn;
        let mut payload = Vec::new();
        let mut reply = Vec::new();
        while let Some(channel) = read_frame(&mut reader, &mut payload)? {
            let answered = {
                let mut channels = self.channels.lock().expect("channels");
                handle_frame(&mut channels, channel, &payload, &mut reply)
            };
            if answered {
                match writer.write_all(&reply) {
                    Ok(()) => {}
                    // The guest's end closed with requests in flight (an unmount, a VM
                    // that stopped): nobody waits for the reply.
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                        ) =>
                    {
                        return Ok(())
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }
}

/// Reads a serving [`Server`]'s table (`super::carry`): meant for a moment when the guest
/// sends nothing (its relay holds), so that the table is the whole state.
#[derive(Clone)]
pub struct TableReader(Arc<Mutex<HashMap<u32, Channel>>>);

impl TableReader {
    pub fn table(&self) -> io::Result<Table> {
        let channels = self.0.lock().expect("channels");
        let mut t = Table::default();
        for (&id, ch) in channels.iter() {
            t.channels.push(ch.table(id)?);
        }
        t.channels.sort_by_key(|c| c.channel);
        Ok(t)
    }
}
