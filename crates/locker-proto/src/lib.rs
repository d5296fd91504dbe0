//! The host <-> agent protocol: one framed, multiplexed, versioned stream of frames over any
//! byte stream (a unix socket for the jail, virtio-serial for a microVM).
//!
//! This room owns the wire format and the meaning of every message. It owns no I/O policy:
//! the agent drives it with blocking threads ([`read_frame`], [`write_frame`]), the host with
//! tokio (it reads a [`Header`] then the payload and calls [`Frame::from_parts`]).
//!
//! # Wire format
//! Every frame is a 12-byte header followed by `len` payload bytes (little-endian):
//! ```text
//! u32 len      payload length, at most MAX_PAYLOAD
//! u32 stream   stream id (0 = the connection itself)
//! u8  kind     FrameKind
//! u8  chan     channel for Data/Eof frames (Chan), 0 otherwise
//! u16 zero     must be 0 (room for flags in a later version)
//! ```
//! Each side's first frame is `Hello` on stream 0 with its protocol version; a peer that
//! speaks another major version closes the connection.
//!
//! # Streams
//! The host opens a stream with `Open` (a JSON [`Request`]) on an id it has not used on this
//! connection. The agent answers with any number of `Msg` frames (JSON [`Reply`]), `Data`
//! frames on the stream's channels, and exactly one final `End` (JSON [`EndBody`]); after
//! `End` the stream id is dead. The host may send `Data`/`Eof` (stdin, file contents),
//! `Control` (a JSON [`Control`], e.g. a terminal resize) and `Cancel` (stop the operation:
//! kill the command's whole tree) on an open stream.
//!
//! # Flow control
//! `Data` in each direction of each stream is credit-based so one slow stream never blocks
//! the others: a sender may have at most [`INITIAL_WINDOW`] bytes unacknowledged; the
//! receiver returns credit with `Credit` frames (payload: u32 byte count) as it consumes.
//!
//! # Hostile input
//! The decoder treats every byte as untrusted: a bad header, an unknown kind, an oversized
//! length or a payload that is not the JSON it should be is an error, never a panic, and the
//! side that sees it drops the connection.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use locker_types::{Entry, ExecResult, Usage};
use serde::{Deserialize, Serialize};

/// The protocol's major version; both sides must agree.
pub const PROTOCOL_VERSION: u32 = 1;
/// Header size in bytes.
pub const HEADER_LEN: usize = 12;
/// The largest payload a frame may carry (1 MiB). Larger frames are rejected unread.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Bytes of `Data` a sender may have in flight on one stream direction before credit returns.
pub const INITIAL_WINDOW: u32 = 1 << 20;
/// The most entries one `List` answer may hold. Far past what a person or a model reads
/// (a checkout of the Linux kernel is about 80 000 files); the agent refuses a listing
/// that would pass it before sending any entry, and the host stops reading at it whatever
/// the agent does.
pub const MAX_LIST_ENTRIES: usize = 100_000;
/// The most bytes one `List` (or `ListProcesses`) answer may hold, counted with
/// [`entry_cost`]: about the size of its JSON. Bounds what the host holds for one answer.
pub const MAX_LIST_BYTES: usize = 64 << 20;
/// The most background processes one `ListProcesses` answer may describe.
pub const MAX_LIST_PROCESSES: usize = 100_000;

/// What an entry counts for against [`MAX_LIST_BYTES`]: its strings plus a fixed share
/// for the other fields and the JSON around them. Both sides count the same way.
pub fn entry_cost(e: &Entry) -> usize {
    let extra = e.target.as_ref().map_or(0, String::len)
        + e.metadata
            .iter()
            .map(|(k, v)| k.len() + v.len() + 8)
            .sum::<usize>();
    e.path.len() + e.name.len() + e.mtime.len() + 80 + extra
}
/// The size in which senders cut file and output data into `Data` frames.
pub const DATA_CHUNK: usize = 64 * 1024;

/// Errors of encoding or decoding frames.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("frame payload of {0} bytes exceeds the limit of {MAX_PAYLOAD}")]
    TooLarge(usize),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("unknown channel {0}")]
    UnknownChannel(u8),
    #[error("reserved header bits set")]
    Reserved,
    #[error("{kind:?} frame has a malformed payload: {detail}")]
    BadPayload { kind: FrameKind, detail: String },
    #[error("frame truncated: the stream ended inside a frame")]
    Truncated,
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Hello = 1,
    Open = 2,
    Msg = 3,
    Data = 4,
    Eof = 5,
    Credit = 6,
    Control = 7,
    Cancel = 8,
    End = 9,
}

impl FrameKind {
    fn from_u8(v: u8) -> Result<Self, ProtoError> {
        Ok(match v {
            1 => Self::Hello,
            2 => Self::Open,
            3 => Self::Msg,
            4 => Self::Data,
            5 => Self::Eof,
            6 => Self::Credit,
            7 => Self::Control,
            8 => Self::Cancel,
            9 => Self::End,
            other => return Err(ProtoError::UnknownKind(other)),
        })
    }
}

/// The byte channel a `Data` or `Eof` frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[repr(u8)]
pub enum Chan {
    /// Frames without a channel.
    None = 0,
    Stdin = 1,
    Stdout = 2,
    Stderr = 3,
    /// File contents (read or write) and terminal bytes.
    Bytes = 4,
}

impl Chan {
    fn from_u8(v: u8) -> Result<Self, ProtoError> {
        Ok(match v {
            0 => Self::None,
            1 => Self::Stdin,
            2 => Self::Stdout,
            3 => Self::Stderr,
            4 => Self::Bytes,
            other => return Err(ProtoError::UnknownChannel(other)),
        })
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub len: usize,
    pub stream: u32,
    pub kind: FrameKind,
    pub chan: Chan,
}

impl Header {
    /// Parses and checks a header; the payload length is validated before anything is read.
    pub fn parse(b: &[u8; HEADER_LEN]) -> Result<Self, ProtoError> {
        let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(ProtoError::TooLarge(len));
        }
        if b[10] != 0 || b[11] != 0 {
            return Err(ProtoError::Reserved);
        }
        Ok(Self {
            len,
            stream: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            kind: FrameKind::from_u8(b[8])?,
            chan: Chan::from_u8(b[9])?,
        })
    }
}

/// The first frame of each side.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u32,
    /// Free text naming the peer, e.g. `locker-agent 0.1.0`.
    pub peer: String,
    /// What an agent serves beyond the version's base set (e.g. [`FEATURE_SPAWN_FOLLOW`]):
    /// the host sends a request that needs a feature only to an agent that names it, so a
    /// host and an agent of different releases keep working together. Absent from the
    /// Hello of an agent (or host) of an earlier release.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

/// The agent serves [`Request::SpawnFollow`].
pub const FEATURE_SPAWN_FOLLOW: &str = "spawn_follow";

/// The agent keeps user metadata on files: [`Request::WriteFile`] takes `metadata`, and
/// entries carry `metadata` and a symlink's `target`.
pub const FEATURE_FILE_METADATA: &str = "file_metadata";

/// The agent serves [`Request::HoldShares`]: a microVM whose volumes are mounted can move.
pub const FEATURE_SHARE_HOLD: &str = "share_hold";

/// One frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    Hello(Hello),
    Open {
        stream: u32,
        req: Request,
    },
    Msg {
        stream: u32,
        msg: Reply,
    },
    Data {
        stream: u32,
        chan: Chan,
        bytes: Vec<u8>,
    },
    Eof {
        stream: u32,
        chan: Chan,
    },
    Credit {
        stream: u32,
        chan: Chan,
        bytes: u32,
    },
    Control {
        stream: u32,
        ctl: Control,
    },
    Cancel {
        stream: u32,
    },
    End {
        stream: u32,
        body: EndBody,
    },
}

/// How a user inside the machine is named: `root`, a name from its `/etc/passwd`, or a uid.
pub type UserSpec = String;

/// A command as the agent runs it: the host has already resolved `shell` into an argv.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecSpec {
    /// The call id the result will carry; also names the output spill files.
    pub call_id: String,
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    /// The complete environment besides the agent's defaults (PATH, HOME, ...).
    pub env: Vec<(String, String)>,
    /// Whether the host will send standard input as `Data` on [`Chan::Stdin`] (then `Eof`).
    /// Without it the command's stdin is `/dev/null`.
    pub stdin: bool,
    pub timeout_ms: Option<u64>,
    pub max_output_bytes: u64,
    pub user: Option<UserSpec>,
    /// Send output as `Data` frames while the command runs (streaming clients).
    pub stream_output: bool,
    /// Run on a pseudo-terminal (the PTY route): output comes on [`Chan::Bytes`].
    pub pty: Option<PtySize>,
    /// Whether what the command leaves running dies with it (serverless runs). Without it,
    /// processes the command started and left behind (`cmd &`, daemons) keep running in the
    /// machine after the command's end, as after `docker exec`. Sent only when true, so an
    /// agent of an earlier release (which rejects unknown fields) still takes every other spec.
    #[serde(default, skip_serializing_if = "is_false")]
    pub kill_jobs: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A terminal size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

/// A request that opens a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// `End(Pong)` at once; a liveness check.
    Ping,
    /// Run a command to its end. `Msg(Started)` when the process is up, output as `Data` if
    /// asked, then `End(Exec)`. `Cancel` kills its tree (`reason: killed`).
    Exec(ExecSpec),
    /// Start a background process; `End(Spawned)` at once.
    Spawn(ExecSpec),
    /// Start a background process and follow its output on the same stream (one round
    /// trip where `Spawn` then `ProcessOutput` take two): `Msg(Spawned)` at once, then as
    /// `ProcessOutput { follow: true }`. `Cancel` stops the following, not the process.
    /// Sent only to an agent whose `Hello` names [`FEATURE_SPAWN_FOLLOW`].
    SpawnFollow(ExecSpec),
    /// `End(Processes)`.
    ListProcesses,
    /// `End(Process)`.
    GetProcess { id: String },
    /// Resize the terminal of a background process started with `pty`. `End(Ok)`; a
    /// process without a terminal is `BadRequest`.
    ResizeProcess { id: String, size: PtySize },
    /// Replay a background process's output from its start as `Data`, then (with `follow`)
    /// what comes until it ends; `End(Process)`.
    ProcessOutput { id: String, follow: bool },
    /// The host sends `Data` on `Chan::Stdin` (and `Eof` to close the process's stdin);
    /// `End(Ok)` once all has been written. `Eof` on `Chan::Bytes` instead ends this request
    /// but leaves the process's stdin open for a later `ProcessStdin`.
    ProcessStdin { id: String },
    /// Send a signal (a number) to a background process's whole process group.
    SignalProcess { id: String, signal: i32 },
    /// Stream a file: `Msg(Entry)`, then `Data` on `Chan::Bytes`, then `End(Ok)`.
    ReadFile { path: String },
    /// Write a file from the host's `Data` on `Chan::Bytes` up to `Eof`; parents are created.
    /// The file appears whole or not at all (temporary name, then rename). `End(Entry)`.
    ///
    /// `metadata` becomes the file's extended attributes in the `user.e2b.` namespace (E2B's
    /// file metadata; the file is new, so it has no others of that namespace): sent only when
    /// not empty, and only to an agent whose `Hello` names [`FEATURE_FILE_METADATA`].
    WriteFile {
        path: String,
        mode: Option<u32>,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        metadata: BTreeMap<String, String>,
    },
    /// Stream a directory as a tar archive: `Msg(Entry)` of the directory, then the archive
    /// as `Data` on `Chan::Bytes` (regular files, directories, symlinks; paths relative to
    /// the directory), then `End(Ok)`.
    ReadTar { path: String },
    /// Extract the tar archive the host sends as `Data` on `Chan::Bytes` (up to `Eof`) into
    /// the directory `path` (created if missing). Nothing is written outside it whatever the
    /// archive holds; a refused entry ends the request with `BadRequest` (entries before it
    /// stay). `End(Extracted)`.
    WriteTar { path: String },
    /// `End(Entries)`; `depth` 1 lists the directory's own children.
    List { path: String, depth: u32 },
    /// `End(Entry)`; a symlink is described, not followed.
    Stat { path: String },
    /// `End(Entry)`; parents are created.
    Mkdir { path: String },
    /// `End(Entry)` of the destination.
    Move { from: String, to: String },
    /// Give `path` (a final link itself, not its target) to `user` and the user's primary
    /// group. `End(Ok)`.
    Chown { path: String, user: UserSpec },
    /// `End(Ok)`. A non-empty directory needs `recursive`.
    Remove { path: String, recursive: bool },
    /// The whole machine's CPU and peak memory so far: `End(Usage)`.
    MachineUsage,
    /// After a microVM is restored from a snapshot: set the wall clock to `unix_ns` and mix
    /// `entropy` into the kernel's random pool (reseeding it), so clones of one snapshot
    /// neither live in the past nor share random streams; set the hostname unless empty.
    /// `End(Ok)`.
    Refresh {
        unix_ns: u64,
        entropy: Vec<u8>,
        hostname: String,
    },
    /// Flush every filesystem of the machine to its disks (before a snapshot). `End(Ok)`.
    Flush,
    /// Watch a directory (and, `recursive`, the directories under it) with inotify:
    /// `Msg(Entry)` of the directory once it is watched, then batches of [`FsEvent`] as
    /// JSON arrays, one a line, as `Data` on `Chan::Stdout`, until `Cancel`; `End(Ok)` when
    /// the directory itself goes.
    Watch { path: String, recursive: bool },
    /// The TCP ports listening in the machine now: `End(Ports)`.
    ListPorts,
    /// A byte tunnel to `127.0.0.1:port` (else `[::1]:port`) in the machine, for the host's
    /// port proxy: `Msg(Connected)`, then the host's `Data` on `Chan::Stdin` goes to the
    /// connection and what it answers comes as `Data` on `Chan::Stdout`; `Eof` on either
    /// side half-closes that direction; `End(Ok)` once both are closed. Nothing listening:
    /// `End(Error(NotFound))`. `Cancel` closes the connection.
    Connect { port: u16 },
    /// In a microVM: mount a host tree at `target` (created if missing) through FUSE, its
    /// requests carried on the `org.locker.fs` virtio-serial port as frames of `channel`
    /// (see [`fs_frame`]); the host's file server for that port answers them. `End(Ok)`.
    MountShare {
        channel: u32,
        target: String,
        read_only: bool,
    },
    /// In a microVM: `hold` stops relaying the volume mounts' FUSE requests to the host
    /// (the guest's callers wait in its kernel) and answers once every request relayed
    /// before has its reply, so that the host's file server holds the whole state of the
    /// mounts and the VM can move with it; `End(Ok)`, or `Error(Busy)` when replies are
    /// still missing after a few seconds (the hold is lifted again). `hold: false` relays
    /// again (also what waited meanwhile). Sent only to an agent whose `Hello` names
    /// [`FEATURE_SHARE_HOLD`].
    HoldShares { hold: bool },
    /// In a microVM with a network device: give `interface` the IPv4 `address`/`prefix`
    /// (replacing the one it had), bring it and `lo` up and route everything via `gateway`
    /// (replacing any default route). `End(Ok)`.
    ConfigureNet {
        interface: String,
        address: std::net::Ipv4Addr,
        prefix: u8,
        gateway: std::net::Ipv4Addr,
    },
}

/// A non-final message on a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// The command's process exists; `start_ms` from `Open` to here.
    Started { pid: i32, start_ms: f64 },
    /// A `SpawnFollow`'s background process exists: its id and pid.
    Spawned { id: String, pid: i32 },
    /// The entry a `ReadFile` is about to stream.
    Entry(Entry),
    /// A batch of a long `List` answer (which would not fit in one frame); the final
    /// `End(Entries)` carries the last batch. The host concatenates them in order.
    Entries { entries: Vec<Entry> },
    /// A batch of a long `ListProcesses` answer; the final `End(Processes)` carries the last.
    Processes { processes: Vec<ProcessInfo> },
    /// A `Connect` reached its port; `address` is the one it connected to.
    Connected { address: String },
}

/// A change inside a watched directory; `name` is relative to it (empty: the kernel's
/// event queue overflowed and events were lost).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEvent {
    pub name: String,
    pub op: FsOp,
}

/// What happened to a watched entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsOp {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
}

/// A TCP port listening in the machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortInfo {
    pub port: u16,
    /// The address it listens on (`0.0.0.0`, `127.0.0.1`, `::`...).
    pub address: String,
    /// The listening process, where the agent could tell (its pid and name).
    pub pid: Option<i32>,
    pub process: Option<String>,
}

/// A host -> agent message on an open stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "ctl", rename_all = "snake_case", deny_unknown_fields)]
pub enum Control {
    Resize(PtySize),
}

/// The state of a background process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub id: String,
    pub pid: i32,
    pub argv: Vec<String>,
    /// `running` or `exited`.
    pub state: String,
    pub started_at: String,
    pub result: Option<ExecResult>,
    /// Whether it runs on a terminal (its output is the terminal's, on stdout). Absent
    /// from an agent of an earlier release.
    #[serde(default, skip_serializing_if = "is_false")]
    pub pty: bool,
    /// The working directory its spawn named (none: the user's home). Absent from an agent
    /// of an earlier release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The environment its spawn gave it, besides the agent's defaults (E2B's process
    /// list shows it; Locker's own routes leave the values out). Absent from an agent of
    /// an earlier release.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<(String, String)>,
}

/// Error classes the agent reports; the host maps them onto HTTP statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The caller's request cannot work as given (e.g. a directory where a file must be).
    BadRequest,
    NotFound,
    /// The target exists in a way that conflicts (e.g. a non-empty directory).
    Conflict,
    /// The machine ran out of space (disk, a file size limit) or the answer is larger than
    /// the protocol allows: the host answers 413.
    Exhausted,
    /// The machine is out of processes, threads, memory or file descriptors right now:
    /// the host answers 429; the same request may work once something in it ends.
    Busy,
    Internal,
}

/// An agent-side failure of a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentError {
    pub code: ErrorCode,
    pub message: String,
}

impl AgentError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

impl std::error::Error for AgentError {}

/// The final answer of a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum EndBody {
    Ok,
    Pong,
    Exec(Box<ExecResult>),
    Spawned {
        id: String,
        pid: i32,
    },
    Processes(Vec<ProcessInfo>),
    Process(Box<ProcessInfo>),
    Entry(Entry),
    Entries(Vec<Entry>),
    /// The answer of a `WriteTar`: the directory, the entries and file bytes written.
    Extracted {
        entry: Entry,
        entries: u64,
        bytes: u64,
    },
    Usage(Usage),
    Ports(Vec<PortInfo>),
    Error(AgentError),
}

impl Frame {
    /// The stream this frame belongs to (0 for `Hello`).
    pub fn stream(&self) -> u32 {
        match self {
            Frame::Hello(_) => 0,
            Frame::Open { stream, .. }
            | Frame::Msg { stream, .. }
            | Frame::Data { stream, .. }
            | Frame::Eof { stream, .. }
            | Frame::Credit { stream, .. }
            | Frame::Control { stream, .. }
            | Frame::Cancel { stream }
            | Frame::End { stream, .. } => *stream,
        }
    }

    /// Builds a frame from a checked header and its payload.
    pub fn from_parts(h: Header, payload: &[u8]) -> Result<Self, ProtoError> {
        if payload.len() != h.len {
            return Err(ProtoError::Truncated);
        }
        let json = |kind| {
            move |e: serde_json::Error| ProtoError::BadPayload {
                kind,
                detail: e.to_string(),
            }
        };
        let stream = h.stream;
        let no_chan = |f: Frame| -> Result<Frame, ProtoError> {
            if h.chan != Chan::None {
                return Err(ProtoError::BadPayload {
                    kind: h.kind,
                    detail: "unexpected channel".into(),
                });
            }
            Ok(f)
        };
        match h.kind {
            FrameKind::Hello => {
                if stream != 0 {
                    return Err(ProtoError::BadPayload {
                        kind: h.kind,
                        detail: "hello off stream 0".into(),
                    });
                }
                no_chan(Frame::Hello(
                    serde_json::from_slice(payload).map_err(json(h.kind))?,
                ))
            }
            FrameKind::Open => no_chan(Frame::Open {
                stream,
                req: serde_json::from_slice(payload).map_err(json(h.kind))?,
            }),
            FrameKind::Msg => no_chan(Frame::Msg {
                stream,
                msg: serde_json::from_slice(payload).map_err(json(h.kind))?,
            }),
            FrameKind::Control => no_chan(Frame::Control {
                stream,
                ctl: serde_json::from_slice(payload).map_err(json(h.kind))?,
            }),
            FrameKind::End => no_chan(Frame::End {
                stream,
                body: serde_json::from_slice(payload).map_err(json(h.kind))?,
            }),
            FrameKind::Cancel => {
                if !payload.is_empty() {
                    return Err(ProtoError::BadPayload {
                        kind: h.kind,
                        detail: "cancel carries no payload".into(),
                    });
                }
                no_chan(Frame::Cancel { stream })
            }
            FrameKind::Data => Ok(Frame::Data {
                stream,
                chan: h.chan,
                bytes: payload.to_vec(),
            }),
            FrameKind::Eof => {
                if !payload.is_empty() {
                    return Err(ProtoError::BadPayload {
                        kind: h.kind,
                        detail: "eof carries no payload".into(),
                    });
                }
                Ok(Frame::Eof {
                    stream,
                    chan: h.chan,
                })
            }
            FrameKind::Credit => {
                let b: [u8; 4] = payload.try_into().map_err(|_| ProtoError::BadPayload {
                    kind: h.kind,
                    detail: format!("credit payload must be 4 bytes, got {}", payload.len()),
                })?;
                Ok(Frame::Credit {
                    stream,
                    chan: h.chan,
                    bytes: u32::from_le_bytes(b),
                })
            }
        }
    }

    /// Appends the encoded frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        let start = out.len();
        out.extend_from_slice(&[0u8; HEADER_LEN]);
        let (kind, chan) = match self {
            Frame::Hello(h) => (FrameKind::Hello, to_json(out, h)),
            Frame::Open { req, .. } => (FrameKind::Open, to_json(out, req)),
            Frame::Msg { msg, .. } => (FrameKind::Msg, to_json(out, msg)),
            Frame::Control { ctl, .. } => (FrameKind::Control, to_json(out, ctl)),
            Frame::End { body, .. } => (FrameKind::End, to_json(out, body)),
            Frame::Cancel { .. } => (FrameKind::Cancel, Chan::None),
            Frame::Data { chan, bytes, .. } => {
                out.extend_from_slice(bytes);
                (FrameKind::Data, *chan)
            }
            Frame::Eof { chan, .. } => (FrameKind::Eof, *chan),
            Frame::Credit { chan, bytes, .. } => {
                out.extend_from_slice(&bytes.to_le_bytes());
                (FrameKind::Credit, *chan)
            }
        };
        let len = out.len() - start - HEADER_LEN;
        if len > MAX_PAYLOAD {
            out.truncate(start);
            return Err(ProtoError::TooLarge(len));
        }
        let h = &mut out[start..start + HEADER_LEN];
        h[0..4].copy_from_slice(&(len as u32).to_le_bytes());
        h[4..8].copy_from_slice(&self.stream().to_le_bytes());
        h[8] = kind as u8;
        h[9] = chan as u8;
        Ok(())
    }

    /// Decodes one frame from the front of `buf`: `Ok(None)` if more bytes are needed,
    /// else the frame and how many bytes it used.
    pub fn decode(buf: &[u8]) -> Result<Option<(Frame, usize)>, ProtoError> {
        let Some(hb) = buf.get(..HEADER_LEN) else {
            return Ok(None);
        };
        let h = Header::parse(hb.try_into().expect("slice of HEADER_LEN"))?;
        let Some(payload) = buf.get(HEADER_LEN..HEADER_LEN + h.len) else {
            return Ok(None);
        };
        Ok(Some((Frame::from_parts(h, payload)?, HEADER_LEN + h.len)))
    }
}

fn to_json<T: Serialize>(out: &mut Vec<u8>, v: &T) -> Chan {
    // Serializing our own plain data types into a Vec cannot fail.
    serde_json::to_writer(&mut *out, v).expect("protocol types serialize");
    Chan::None
}

/// The frames of a microVM's file port (`org.locker.fs`): FUSE messages between the
/// guest's `/dev/fuse` and the host's file server, several mounts (channels) on one port.
/// A frame is `[u32 LE payload length][u32 LE channel][payload]`; the payload is exactly
/// one FUSE request (guest to host) or one FUSE reply (host to guest).
pub mod tar_guard;

pub mod fs_frame {
    /// The virtio-serial port's name.
    pub const PORT_NAME: &str = "org.locker.fs";
    pub const HEADER_LEN: usize = 8;
    /// The largest payload: a FUSE write of 1 MiB and its headers.
    pub const MAX_PAYLOAD: usize = (1 << 20) + 4096;

    /// The header of a frame of `len` payload bytes on `channel`.
    pub fn header(channel: u32, len: usize) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&(len as u32).to_le_bytes());
        h[4..].copy_from_slice(&channel.to_le_bytes());
        h
    }

    /// `(payload length, channel)` of a header; `None` when the length is over
    /// [`MAX_PAYLOAD`] (the stream cannot be trusted any more).
    pub fn parse_header(h: &[u8; HEADER_LEN]) -> Option<(usize, u32)> {
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let channel = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        (len <= MAX_PAYLOAD).then_some((len, channel))
    }
}

/// Reads one frame; `Ok(None)` on a clean end of stream between frames.
pub fn read_frame<R: Read>(r: &mut R, scratch: &mut Vec<u8>) -> Result<Option<Frame>, ProtoError> {
    let mut hb = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut hb[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(ProtoError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let h = Header::parse(&hb)?;
    scratch.clear();
    scratch.resize(h.len, 0);
    r.read_exact(scratch).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => ProtoError::Truncated,
        _ => ProtoError::Io(e),
    })?;
    Frame::from_parts(h, scratch).map(Some)
}

/// Encodes and writes one frame with a single `write_all`.
pub fn write_frame<W: Write>(w: &mut W, f: &Frame) -> Result<(), ProtoError> {
    let mut buf = Vec::new();
    f.encode(&mut buf)?;
    w.write_all(&buf)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(f: Frame) {
        let mut buf = Vec::new();
        f.encode(&mut buf).unwrap();
        let (g, used) = Frame::decode(&buf).unwrap().unwrap();
        assert_eq!(used, buf.len());
        assert_eq!(f, g);
        for cut in 0..buf.len() {
            assert!(
                Frame::decode(&buf[..cut]).unwrap().is_none(),
                "prefix {cut} must ask for more"
            );
        }
    }

    /// A `Hello` without features (an earlier release's) reads as none, and one without
    /// any is written as the earlier releases wrote it.
    #[test]
    fn hello_features_are_optional_both_ways() {
        let old: Hello = serde_json::from_str(r#"{"version":1,"peer":"locker-agent 0.1.0"}"#)
            .expect("an earlier release's Hello");
        assert!(old.features.is_empty());
        let none = Hello {
            version: 1,
            peer: "p".into(),
            features: Vec::new(),
        };
        assert_eq!(
            serde_json::to_string(&none).expect("json"),
            r#"{"version":1,"peer":"p"}"#
        );
    }

    #[test]
    fn every_kind_round_trips() {
        roundtrip(Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            peer: "t".into(),
            features: vec![FEATURE_SPAWN_FOLLOW.into()],
        }));
        roundtrip(Frame::Open {
            stream: 5,
            req: Request::SpawnFollow(ExecSpec {
                argv: vec!["true".into()],
                ..Default::default()
            }),
        });
        roundtrip(Frame::Msg {
            stream: 5,
            msg: Reply::Spawned {
                id: "proc_1".into(),
                pid: 4,
            },
        });
        roundtrip(Frame::Open {
            stream: 7,
            req: Request::Exec(ExecSpec {
                argv: vec!["true".into()],
                max_output_bytes: 10,
                ..Default::default()
            }),
        });
        roundtrip(Frame::Open {
            stream: 9,
            req: Request::Remove {
                path: "/x".into(),
                recursive: true,
            },
        });
        roundtrip(Frame::Msg {
            stream: 7,
            msg: Reply::Started {
                pid: 3,
                start_ms: 0.5,
            },
        });
        // Batches must be struct variants: serde cannot tag a newtype variant holding a list.
        let entry = Entry {
            path: "/a b".into(),
            name: "a b".into(),
            kind: locker_types::EntryType::File,
            size: 1,
            mode: 0o644,
            mtime: locker_types::rfc3339(0),
            uid: Some(1000),
            gid: Some(1000),
            target: None,
            metadata: [("author".to_owned(), "mish".to_owned())].into(),
        };
        roundtrip(Frame::Msg {
            stream: 7,
            msg: Reply::Entry(entry.clone()),
        });
        roundtrip(Frame::Msg {
            stream: 7,
            msg: Reply::Entries {
                entries: vec![entry.clone(), entry],
            },
        });
        let info = ProcessInfo {
            id: "proc_1".into(),
            pid: 9,
            argv: vec!["sleep".into()],
            state: "running".into(),
            started_at: locker_types::rfc3339(0),
            result: None,
            pty: false,
            cwd: Some("/w".into()),
            env: vec![("A".into(), "b".into())],
        };
        roundtrip(Frame::Msg {
            stream: 7,
            msg: Reply::Processes {
                processes: vec![info],
            },
        });
        roundtrip(Frame::Data {
            stream: 7,
            chan: Chan::Stdout,
            bytes: vec![0, 255, 10],
        });
        roundtrip(Frame::Eof {
            stream: 7,
            chan: Chan::Stdin,
        });
        roundtrip(Frame::Credit {
            stream: 7,
            chan: Chan::Stdout,
            bytes: 65536,
        });
        roundtrip(Frame::Control {
            stream: 7,
            ctl: Control::Resize(PtySize { cols: 80, rows: 24 }),
        });
        roundtrip(Frame::Cancel { stream: 7 });
        roundtrip(Frame::End {
            stream: 7,
            body: EndBody::Error(AgentError::new(ErrorCode::NotFound, "gone")),
        });
    }

    #[test]
    fn oversized_length_is_rejected_before_reading() {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&((MAX_PAYLOAD + 1) as u32).to_le_bytes());
        b[8] = FrameKind::Data as u8;
        assert!(matches!(Header::parse(&b), Err(ProtoError::TooLarge(_))));
        let big = Frame::Data {
            stream: 1,
            chan: Chan::Stdout,
            bytes: vec![0; MAX_PAYLOAD + 1],
        };
        let mut out = vec![1, 2, 3];
        assert!(big.encode(&mut out).is_err());
        assert_eq!(
            out,
            vec![1, 2, 3],
            "a failed encode leaves the buffer as it was"
        );
    }

    #[test]
    fn malformed_frames_are_errors() {
        let cases: Vec<Vec<u8>> = vec![
            vec![2, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, b'{', b'}'], // Open with an empty object
            vec![0, 0, 0, 0, 1, 0, 0, 0, 77, 0, 0, 0],            // unknown kind
            vec![0, 0, 0, 0, 1, 0, 0, 0, 4, 9, 0, 0],             // unknown channel
            vec![0, 0, 0, 0, 1, 0, 0, 0, 4, 2, 1, 0],             // reserved bits
            vec![1, 0, 0, 0, 1, 0, 0, 0, 6, 2, 0, 0, 9],          // short credit
            vec![1, 0, 0, 0, 1, 0, 0, 0, 8, 0, 0, 0, 9],          // cancel with payload
        ];
        for c in cases {
            assert!(Frame::decode(&c).is_err(), "{c:?} must be rejected");
        }
    }

    #[test]
    fn random_bytes_never_panic() {
        // A deterministic xorshift so failures reproduce; the fuzz target goes further.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let n = (next() % 64) as usize;
            let mut buf: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            if buf.len() >= HEADER_LEN && next() % 2 == 0 {
                let len = (buf.len() - HEADER_LEN) as u32;
                buf[0..4].copy_from_slice(&len.to_le_bytes());
                buf[8] = (next() % 10) as u8;
                buf[9] = (next() % 5) as u8;
                buf[10] = 0;
                buf[11] = 0;
            }
            let _ = Frame::decode(&buf);
            let _ = read_frame(&mut &buf[..], &mut Vec::new());
        }
    }

    #[test]
    fn read_frame_reports_truncation_and_clean_eof() {
        let mut buf = Vec::new();
        Frame::Cancel { stream: 1 }.encode(&mut buf).unwrap();
        Frame::Data {
            stream: 1,
            chan: Chan::Stdout,
            bytes: b"hi".to_vec(),
        }
        .encode(&mut buf)
        .unwrap();
        let mut r = &buf[..buf.len() - 1];
        let mut s = Vec::new();
        assert_eq!(
            read_frame(&mut r, &mut s).unwrap(),
            Some(Frame::Cancel { stream: 1 })
        );
        assert!(matches!(
            read_frame(&mut r, &mut s),
            Err(ProtoError::Truncated)
        ));
        assert!(read_frame(&mut &b""[..], &mut s).unwrap().is_none());
    }
}
