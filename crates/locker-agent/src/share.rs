//! Host trees (volumes) mounted in a microVM guest: FUSE mounts whose requests travel to
//! the host's file server over the `org.locker.fs` virtio-serial port.
//!
//! This room owns the guest's end of that port and the `/dev/fuse` connections of the
//! mounts. It only relays: every request the kernel queues on a mount's `/dev/fuse` goes to
//! the host whole, in a frame naming the mount's channel (`locker_proto::fs_frame`), and
//! every reply from the host is written back to that mount's `/dev/fuse` whole. It does
//! not look inside the messages: the host answers them, and the guest's kernel checks
//! permissions itself (`default_permissions`). Each mount has a thread reading its
//! `/dev/fuse`; one thread reads the port and hands replies to the mounts.
//!
//! **Holding** ([`hold`]): before its VM moves, the host asks the relay to send nothing
//! more and waits until every request it sent has its reply. The host's file server then
//! holds the whole state of the mounts (their nodes and open files, which it hands to the
//! server on the new host), and nothing is in flight in the port, whose host end is
//! about to be another server's. Requests read meanwhile wait here, in the guest's memory,
//! and go to whichever server is connected when the hold is lifted ([`release`]). The
//! relay counts what is in flight by each request's `unique`: the replies it reads carry
//! it back.

use std::collections::HashMap;
use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use locker_proto::fs_frame;

/// The port, once opened: its writing end (shared by the mounts' threads) and the mounts
/// by channel.
struct Port {
    out: Mutex<File>,
    mounts: Mutex<HashMap<u32, Mount>>,
    flight: Mutex<Flight>,
    /// Signalled when a reply lands or a hold is lifted.
    changed: Condvar,
}

/// What the relay sent and has no reply for yet, and whether it is held.
#[derive(Default)]
struct Flight {
    /// `(channel, unique)` of every request sent that awaits a reply.
    sent: HashSet<(u32, u64)>,
    held: bool,
}

/// One FUSE mount: its `/dev/fuse` and its connection's number under
/// `/sys/fs/fuse/connections` (to abort it when the host's server goes away).
#[derive(Clone)]
struct Mount {
    dev: Arc<File>,
    conn: Option<u64>,
}

static PORT: OnceLock<Arc<Port>> = OnceLock::new();

/// The port, opened (and its reading thread started) on first use.
fn port() -> io::Result<Arc<Port>> {
    if let Some(p) = PORT.get() {
        return Ok(p.clone());
    }
    let path = find_port(fs_frame::PORT_NAME).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("no virtio port named {}", fs_frame::PORT_NAME),
        )
    })?;
    let file = fs::OpenOptions::new().read(true).write(true).open(&path)?;
    let reader = file.try_clone()?;
    let p = Arc::new(Port {
        out: Mutex::new(file),
        mounts: Mutex::new(HashMap::new()),
        flight: Mutex::new(Flight::default()),
        changed: Condvar::new(),
    });
    // Two first mounts racing: the loser's port is dropped before its thread starts.
    if PORT.set(p.clone()).is_err() {
        return Ok(PORT.get().expect("set").clone());
    }
    let p2 = p.clone();
    std::thread::Builder::new()
        .name("share-port".into())
        .spawn(move || replies(&p2, reader))?;
    Ok(p)
}

/// The device node of the virtio-serial port named `name`.
pub fn find_port(name: &str) -> Option<PathBuf> {
    let t0 = Instant::now();
    loop {
        for e in fs::read_dir("/sys/class/virtio-ports")
            .into_iter()
            .flatten()
            .flatten()
        {
            if fs::read_to_string(e.path().join("name")).is_ok_and(|n| n.trim() == name) {
                return Some(Path::new("/dev").join(e.file_name()));
            }
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Mounts the tree the host serves on `channel` at `target`.
pub fn mount(channel: u32, target: &str, read_only: bool) -> io::Result<()> {
    if !target.starts_with('/') || target == "/" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("the target must be an absolute path other than /, got {target:?}"),
        ));
    }
    if !crate::vm::is_vm_init() {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "volumes are mounted this way in microVMs only",
        ));
    }
    let port = port()?;
    if port.mounts.lock().expect("mounts").contains_key(&channel) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("channel {channel} is mounted already"),
        ));
    }
    fs::create_dir_all(target)?;
    let dev = Arc::new(
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")?,
    );
    let data = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions",
        dev.as_raw_fd()
    );
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if read_only {
        flags |= libc::MS_RDONLY;
    }
    port.mounts.lock().expect("mounts").insert(
        channel,
        Mount {
            dev: dev.clone(),
            conn: None,
        },
    );
    let mounted = locker_sys::mount::mount(
        Some("locker-volume"),
        Path::new(target),
        Some("fuse"),
        flags,
        Some(&data),
    );
    if let Err(e) = mounted {
        port.mounts.lock().expect("mounts").remove(&channel);
        return Err(e);
    }
    if let Some(m) = port.mounts.lock().expect("mounts").get_mut(&channel) {
        m.conn = connection_of(target);
    }
    let p2 = port.clone();
    std::thread::Builder::new()
        .name(format!("share-{channel}"))
        .spawn(move || requests(&p2, channel, &dev))?;
    Ok(())
}

/// The FUSE connection number of the mount at `target` (its device's minor number), read
/// from `/proc/self/mountinfo`: a `stat` would be a request to the server.
fn connection_of(target: &str) -> Option<u64> {
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.get(4) == Some(&target))
            .then(|| f.get(2)?.split(':').nth(1)?.parse().ok())
            .flatten()
    })
}

/// Fails every request of every mount at once, now and later (`ENOTCONN`): the host's
/// server went away, and a new one would know none of their nodes.
fn abort_all(port: &Port) {
    // Aborted requests get no reply from anyone: nothing is in flight any more.
    port.flight.lock().expect("flight").sent.clear();
    port.changed.notify_all();
    let _ = fs::create_dir_all(CONNECTIONS);
    let mounted = fs::read_dir(CONNECTIONS).is_ok_and(|mut d| d.next().is_some());
    if !mounted {
        let target = Path::new(CONNECTIONS);
        let _ = locker_sys::mount::mount(Some("fusectl"), target, Some("fusectl"), 0, None);
    }
    for m in port.mounts.lock().expect("mounts").values() {
        if let Some(c) = m.conn {
            let _ = fs::write(format!("{CONNECTIONS}/{c}/abort"), "1");
        }
    }
}

const CONNECTIONS: &str = "/sys/fs/fuse/connections";

/// FUSE requests that get no reply.
const FUSE_FORGET: u32 = 2;
const FUSE_INTERRUPT: u32 = 36;
const FUSE_BATCH_FORGET: u32 = 42;

/// Answers the request in `req` with `-errno` (one it could not send to the host).
fn fail_request(dev: &File, req: &[u8], errno: i32) {
    if req.len() < 16 {
        return;
    }
    let opcode = u32::from_le_bytes([req[4], req[5], req[6], req[7]]);
    if matches!(opcode, FUSE_FORGET | FUSE_INTERRUPT | FUSE_BATCH_FORGET) {
        return;
    }
    let mut out = [0u8; 16];
    out[..4].copy_from_slice(&16u32.to_le_bytes());
    out[4..8].copy_from_slice(&(-errno).to_le_bytes());
    out[8..16].copy_from_slice(&req[8..16]);
    let _ = locker_sys::fd::write(dev.as_raw_fd(), &out);
}

/// Relays one mount's requests to the host until the mount goes away.
fn requests(port: &Port, channel: u32, dev: &File) {
    // The kernel hands out one request per read and wants room for the largest write.
    let mut buf = vec![0u8; fs_frame::MAX_PAYLOAD + fs_frame::HEADER_LEN];
    loop {
        // Into the buffer past the header's room (interruptions are retried inside).
        let n = match locker_sys::fd::read(dev.as_raw_fd(), &mut buf[fs_frame::HEADER_LEN..]) {
            Ok(n) => n,
            // A request that was aborted before we read it.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::ENOENT)) => {
                continue
            }
            // Unmounted (ENODEV), or anything else: this mount is done.
            Err(_) => break,
        };
        let req = &buf[fs_frame::HEADER_LEN..fs_frame::HEADER_LEN + n];
        let awaited = awaits_reply(req).map(|unique| (channel, unique));
        {
            // Held: this request waits here until the hold is lifted; else it is counted
            // in flight before it is written, so that a hold never misses it.
            let mut f = port.flight.lock().expect("flight");
            while f.held {
                f = port.changed.wait(f).expect("flight");
            }
            if let Some(k) = awaited {
                f.sent.insert(k);
            }
        }
        buf[..fs_frame::HEADER_LEN].copy_from_slice(&fs_frame::header(channel, n));
        let sent = port
            .out
            .lock()
            .expect("port")
            .write_all(&buf[..fs_frame::HEADER_LEN + n]);
        if let Err(e) = sent {
            eprintln!("locker-agent: writing to the file port: {e}");
            if let Some(k) = awaited {
                landed(port, k);
            }
            fail_request(
                dev,
                &buf[fs_frame::HEADER_LEN..fs_frame::HEADER_LEN + n],
                libc::EIO,
            );
        }
    }
    port.mounts.lock().expect("mounts").remove(&channel);
}

/// Hands the host's replies to their mounts, for as long as the VM lives. When the host's
/// server goes away (the port's end of stream), the mounts it served are aborted.
fn replies(port: &Port, mut reader: File) {
    let mut payload = Vec::new();
    // The server connected before the first mount was asked for; wait until the guest's
    // side of the port knows it, so that an end of stream means it left.
    wait_for_host(&reader);
    loop {
        let mut h = [0u8; fs_frame::HEADER_LEN];
        let ok = read_full(&mut reader, &mut h).is_ok()
            && match fs_frame::parse_header(&h) {
                Some((len, channel)) => {
                    payload.resize(len, 0);
                    read_full(&mut reader, &mut payload).is_ok() && {
                        let m = port.mounts.lock().expect("mounts").get(&channel).cloned();
                        if let Some(m) = m {
                            // One write per reply. ENOENT: the request was interrupted.
                            let _ = locker_sys::fd::write(m.dev.as_raw_fd(), &payload);
                        }
                        // Delivered: a hold waiting on it may answer.
                        if let Some(unique) = payload.get(8..16) {
                            let unique = u64::from_le_bytes(unique.try_into().expect("8 bytes"));
                            landed(port, (channel, unique));
                        }
                        true
                    }
                }
                // Only the host writes here: a bad header is a broken server.
                None => false,
            };
        if !ok {
            eprintln!("locker-agent: the host's file server went away; aborting the volume mounts");
            abort_all(port);
            wait_for_host(&reader);
        }
    }
}

/// The `unique` of a request that gets a reply (`None`: a FORGET, BATCH_FORGET or
/// INTERRUPT, or no header).
fn awaits_reply(req: &[u8]) -> Option<u64> {
    let opcode = u32::from_le_bytes(req.get(4..8)?.try_into().ok()?);
    if matches!(opcode, FUSE_FORGET | FUSE_INTERRUPT | FUSE_BATCH_FORGET) {
        return None;
    }
    Some(u64::from_le_bytes(req.get(8..16)?.try_into().ok()?))
}

/// The request `k` has its reply (or never will).
fn landed(port: &Port, k: (u32, u64)) {
    let mut f = port.flight.lock().expect("flight");
    if f.sent.remove(&k) && f.sent.is_empty() {
        port.changed.notify_all();
    }
}

/// How long [`hold`] waits for the replies of what was sent before it.
const HOLD_WAIT: Duration = Duration::from_secs(10);

/// Stops relaying requests and waits until every request sent has its reply. Fails (the
/// hold lifted again) when some are still missing after [`HOLD_WAIT`]. Without mounts
/// (the port never opened) there is nothing to hold.
pub fn hold() -> io::Result<()> {
    let Some(port) = PORT.get() else {
        return Ok(());
    };
    let deadline = Instant::now() + HOLD_WAIT;
    let mut f = port.flight.lock().expect("flight");
    f.held = true;
    while !f.sent.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let n = f.sent.len();
            f.held = false;
            port.changed.notify_all();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{n} volume requests still had no reply from the host after {HOLD_WAIT:?}"),
            ));
        }
        f = port.changed.wait_timeout(f, left).expect("flight").0;
    }
    Ok(())
}

/// Relays requests again, those that waited during the hold first.
pub fn release() {
    if let Some(port) = PORT.get() {
        port.flight.lock().expect("flight").held = false;
        port.changed.notify_all();
    }
}

/// Reads exactly `buf.len()` bytes; an end of stream (the host is not connected) is an
/// error.
fn read_full(r: &mut File, buf: &mut [u8]) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Waits until the host side of the port is connected.
fn wait_for_host(f: &File) {
    crate::vm::wait_for_host(f.as_raw_fd());
}
