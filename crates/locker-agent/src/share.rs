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

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use locker_proto::fs_frame;

/// The port, once opened: its writing end (shared by the mounts' threads) and the mounts'
/// `/dev/fuse` files by channel.
struct Port {
    out: Mutex<File>,
    mounts: Mutex<HashMap<u32, Arc<File>>>,
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
    let (src, tgt, fstype, data) = (
        cstr("locker-volume")?,
        cstr(target)?,
        cstr("fuse")?,
        cstr(&data)?,
    );
    port.mounts
        .lock()
        .expect("mounts")
        .insert(channel, dev.clone());
    // SAFETY: valid NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        port.mounts.lock().expect("mounts").remove(&channel);
        return Err(e);
    }
    let p2 = port.clone();
    std::thread::Builder::new()
        .name(format!("share-{channel}"))
        .spawn(move || requests(&p2, channel, &dev))?;
    Ok(())
}

fn cstr(s: &str) -> io::Result<std::ffi::CString> {
    std::ffi::CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Relays one mount's requests to the host until the mount goes away.
fn requests(port: &Port, channel: u32, dev: &File) {
    // The kernel hands out one request per read and wants room for the largest write.
    let mut buf = vec![0u8; fs_frame::MAX_PAYLOAD + fs_frame::HEADER_LEN];
    loop {
        // SAFETY: reading into our own buffer past the header's room.
        let n = unsafe {
            libc::read(
                dev.as_raw_fd(),
                buf[fs_frame::HEADER_LEN..].as_mut_ptr().cast(),
                buf.len() - fs_frame::HEADER_LEN,
            )
        };
        if n < 0 {
            match io::Error::last_os_error().raw_os_error() {
                // Interrupted, or a request that was aborted before we read it.
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                // Unmounted (ENODEV), or anything else: this mount is done.
                _ => break,
            }
        }
        let n = n as usize;
        buf[..fs_frame::HEADER_LEN].copy_from_slice(&fs_frame::header(channel, n));
        let mut out = port.out.lock().expect("port");
        if let Err(e) = out.write_all(&buf[..fs_frame::HEADER_LEN + n]) {
            eprintln!("locker-agent: writing to the file port: {e}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    port.mounts.lock().expect("mounts").remove(&channel);
}

/// Hands the host's replies to their mounts, for as long as the VM lives.
fn replies(port: &Port, mut reader: File) {
    let mut payload = Vec::new();
    loop {
        let mut h = [0u8; fs_frame::HEADER_LEN];
        if read_full(&mut reader, &mut h).is_err() {
            wait_for_host(&reader);
            continue;
        }
        let Some((len, channel)) = fs_frame::parse_header(&h) else {
            // A broken stream: only the host writes here, so it restarted mid-frame.
            // What is left of this connection is garbage; wait for the next one.
            wait_for_host(&reader);
            continue;
        };
        payload.resize(len, 0);
        if read_full(&mut reader, &mut payload).is_err() {
            wait_for_host(&reader);
            continue;
        }
        let dev = port.mounts.lock().expect("mounts").get(&channel).cloned();
        if let Some(dev) = dev {
            // One write per reply. ENOENT: the request was interrupted meanwhile.
            // SAFETY: writing our own buffer.
            unsafe { libc::write(dev.as_raw_fd(), payload.as_ptr().cast(), payload.len()) };
        }
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
