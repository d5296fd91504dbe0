//! The FUSE passthrough server of microVM volumes, tested for real on this host's kernel.
//!
//! Each test serves a fresh export over a socket pair, mounts `fuse` from `/dev/fuse` on a
//! mountpoint, and relays between the two the way a guest's agent does (frames on channel
//! 7), then works through the mountpoint with ordinary file calls and checks the export on
//! the host. The host kernel stands in for the guest's: same protocol, same
//! `default_permissions`. Run as root.
//!
//! A `Mount` guard unmounts and removes everything even when a test fails, and a watchdog
//! aborts the FUSE connection if a test hangs, so a wedged server fails the test instead.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use locker_runtime::fuse::{serve, Export, MAX_PAYLOAD};
use locker_tests::{unique, TempDir};

/// The channel the relay tags every frame with.
const CHANNEL: u32 = 7;
/// How long a test may run before the watchdog aborts its FUSE connection.
const WATCHDOG: Duration = Duration::from_secs(120);

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn errno_of<T: std::fmt::Debug>(r: io::Result<T>) -> i32 {
    r.expect_err("the call should fail")
        .raw_os_error()
        .unwrap_or(0)
}

/// A served export, mounted: `export` on the host, `mnt` as the guest would see it.
struct Mount {
    export: PathBuf,
    mnt: PathBuf,
    /// The FUSE connection's id (the minor of the mount's device).
    conn_id: u32,
    /// The relay's end of the socket pair.
    guest: UnixStream,
    relay_done: mpsc::Receiver<()>,
    served: mpsc::Receiver<io::Result<()>>,
    watchdog: Option<mpsc::Sender<()>>,
    torn_down: bool,
    _dir: TempDir,
}

impl Mount {
    fn new(read_only: bool) -> Mount {
        Self::with_export(read_only, |_| {})
    }

    /// Prepares the export with `setup` before it is served.
    fn with_export(read_only: bool, setup: impl FnOnce(&Path)) -> Mount {
        let dir = TempDir::new("fs-share");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let export = dir.path().join("export");
        let mnt = dir.path().join("mnt");
        fs::create_dir(&export).unwrap();
        fs::create_dir(&mnt).unwrap();
        fs::set_permissions(&export, fs::Permissions::from_mode(0o755)).unwrap();
        setup(&export);

        let (host, guest) = UnixStream::pair().unwrap();
        let exports = vec![Export {
            channel: CHANNEL,
            root: export.clone(),
            read_only,
        }];
        let (served_tx, served) = mpsc::channel();
        thread::spawn(move || {
            let _ = served_tx.send(serve(host, &exports));
        });

        let fuse = Arc::new(
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open("/dev/fuse")
                .expect("open /dev/fuse (run as root)"),
        );
        let data = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions",
            fuse.as_raw_fd()
        );
        let (src, fstype, data_c) = (
            CString::new("locker-fs-share-test").unwrap(),
            CString::new("fuse").unwrap(),
            CString::new(data).unwrap(),
        );
        let target = cpath(&mnt);
        // SAFETY: NUL-terminated strings alive for the call.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                data_c.as_ptr().cast(),
            )
        };
        assert_eq!(rc, 0, "mount fuse: {}", io::Error::last_os_error());
        // From here on the guard undoes the mount, whatever fails.
        let (relay_tx, relay_done) = mpsc::channel();
        let (wd_tx, wd_rx) = mpsc::channel::<()>();
        let m = Mount {
            // The mount's device names the connection; a stat through the mount would wait
            // for INIT, which the relay has not carried yet.
            conn_id: mount_dev(&mnt).map_or(u32::MAX, |d| libc::minor(d)),
            export,
            mnt,
            guest,
            relay_done,
            served,
            watchdog: Some(wd_tx),
            torn_down: false,
            _dir: dir,
        };
        relay(fuse, m.guest.try_clone().unwrap(), relay_tx);
        let conn_id = m.conn_id;
        thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = wd_rx.recv_timeout(WATCHDOG) {
                eprintln!(
                    "fs_share test: no end after {WATCHDOG:?}: aborting FUSE connection {conn_id}"
                );
                abort_connection(conn_id);
            }
        });
        m
    }

    fn m(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    fn h(&self, rel: &str) -> PathBuf {
        self.export.join(rel)
    }

    /// Unmounts, stops the relay and returns what `serve` returned.
    fn finish(mut self) -> io::Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> io::Result<()> {
        self.torn_down = true;
        let target = cpath(&self.mnt);
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        // The relay ends when the kernel ends the connection; abort it if that is late.
        if self
            .relay_done
            .recv_timeout(Duration::from_secs(5))
            .is_err()
        {
            abort_connection(self.conn_id);
            let _ = self.relay_done.recv_timeout(Duration::from_secs(5));
        }
        let _ = self.guest.shutdown(std::net::Shutdown::Both);
        drop(self.watchdog.take());
        self.served
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| Err(io::Error::other("serve did not end")))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if !self.torn_down {
            let _ = self.teardown();
        }
    }
}

/// The device of what is mounted at `mnt`, from /proc/self/mountinfo (a stat would go
/// through the FUSE mount).
fn mount_dev(mnt: &Path) -> Option<libc::dev_t> {
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = mnt.to_str()?;
    let line = info
        .lines()
        .rev()
        .find(|l| l.split(' ').nth(4) == Some(want))?;
    let (major, minor) = line.split(' ').nth(2)?.split_once(':')?;
    Some(libc::makedev(major.parse().ok()?, minor.parse().ok()?))
}

/// Aborts a FUSE connection (pending and future requests fail), through fusectl: the
/// host's if mounted, else one mounted for the purpose.
fn abort_connection(id: u32) {
    if fs::write(format!("/sys/fs/fuse/connections/{id}/abort"), "1").is_ok() {
        return;
    }
    let at = std::env::temp_dir().join(unique("fusectl"));
    if fs::create_dir(&at).is_err() {
        return;
    }
    let (src, target) = (CString::new("fusectl").unwrap(), cpath(&at));
    // SAFETY: NUL-terminated strings alive for the calls.
    unsafe {
        if libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            src.as_ptr(),
            0,
            std::ptr::null(),
        ) == 0
        {
            let _ = fs::write(at.join(id.to_string()).join("abort"), "1");
            libc::umount2(target.as_ptr(), libc::MNT_DETACH);
        }
    }
    let _ = fs::remove_dir(&at);
}

/// The guest agent's relay, in two threads: `/dev/fuse` to framed requests on `stream`,
/// framed replies to `/dev/fuse`. Says on `done` when the device side ends.
fn relay(fuse: Arc<File>, stream: UnixStream, done: mpsc::Sender<()>) {
    let (dev, mut out) = (fuse.clone(), stream.try_clone().unwrap());
    thread::spawn(move || {
        let mut buf = vec![0u8; MAX_PAYLOAD];
        loop {
            let n = match (&*dev).read(&mut buf) {
                Ok(n) => n,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::ENOENT)
                    ) =>
                {
                    continue
                }
                // ENODEV: unmounted or aborted.
                Err(_) => break,
            };
            let mut frame = Vec::with_capacity(8 + n);
            frame.extend_from_slice(&(n as u32).to_le_bytes());
            frame.extend_from_slice(&CHANNEL.to_le_bytes());
            frame.extend_from_slice(&buf[..n]);
            if out.write_all(&frame).is_err() {
                break;
            }
        }
        let _ = out.shutdown(std::net::Shutdown::Both);
        let _ = done.send(());
    });
    let mut input = stream;
    thread::spawn(move || loop {
        let mut head = [0u8; 8];
        if input.read_exact(&mut head).is_err() {
            break;
        }
        let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
        assert_eq!(u32::from_le_bytes(head[4..].try_into().unwrap()), CHANNEL);
        let mut payload = vec![0u8; len];
        if input.read_exact(&mut payload).is_err() {
            break;
        }
        match (&*fuse).write(&payload) {
            Ok(n) => assert_eq!(n, len, "a reply is written whole"),
            // The request was interrupted and is gone.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => {
                eprintln!("relay: writing a reply to /dev/fuse: {e}");
                break;
            }
        }
    });
}

/// FNV-1a, to compare big contents in one number.
fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &c| {
        (h ^ u64::from(c)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Bytes that are not a repeating pattern at any page size.
fn noise(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn files_are_written_read_appended_and_truncated() {
    let mnt = Mount::new(false);
    fs::write(mnt.m("small"), b"hello").unwrap();
    assert_eq!(fs::read(mnt.m("small")).unwrap(), b"hello");
    assert_eq!(fs::read(mnt.h("small")).unwrap(), b"hello");

    // 3 MiB: many 128 KiB writes and reads.
    let big = noise(3 << 20);
    fs::write(mnt.m("big"), &big).unwrap();
    let back = fs::read(mnt.m("big")).unwrap();
    assert_eq!(back.len(), big.len());
    assert_eq!(checksum(&back), checksum(&big));
    assert_eq!(checksum(&fs::read(mnt.h("big")).unwrap()), checksum(&big));

    // Appends land at the end, also after the host file grew underneath.
    let mut f = OpenOptions::new()
        .append(true)
        .open(mnt.m("small"))
        .unwrap();
    f.write_all(b", world").unwrap();
    drop(f);
    assert_eq!(fs::read(mnt.h("small")).unwrap(), b"hello, world");

    // Truncate down and up through an open file, and with O_TRUNC at open.
    let f = OpenOptions::new().write(true).open(mnt.m("big")).unwrap();
    f.set_len(10).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(fs::read(mnt.m("big")).unwrap(), &big[..10]);
    fs::OpenOptions::new()
        .write(true)
        .open(mnt.m("big"))
        .unwrap()
        .set_len(20_000)
        .unwrap();
    let grown = fs::read(mnt.h("big")).unwrap();
    assert_eq!((&grown[..10], grown.len()), (&big[..10], 20_000));
    assert!(grown[10..].iter().all(|&b| b == 0));
    File::create(mnt.m("big")).unwrap();
    assert_eq!(fs::metadata(mnt.h("big")).unwrap().len(), 0);

    // A new file keeps the mode asked for (less the umask the caller applied).
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(mnt.m("private"))
        .unwrap();
    let m = fs::metadata(mnt.h("private")).unwrap();
    assert_eq!((m.mode() & 0o7777, m.uid(), m.gid()), (0o600, 0, 0));
    assert_eq!(
        errno_of(
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(mnt.m("private"))
        ),
        libc::EEXIST
    );

    // fallocate, and a copy (copy_file_range on Linux).
    let f = OpenOptions::new()
        .write(true)
        .open(mnt.m("private"))
        .unwrap();
    // SAFETY: integers only.
    assert_eq!(unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, 1 << 20) }, 0);
    assert_eq!(fs::metadata(mnt.h("private")).unwrap().len(), 1 << 20);
    drop(f);
    fs::write(mnt.m("src"), &big[..200_000]).unwrap();
    fs::copy(mnt.m("src"), mnt.m("copy")).unwrap();
    assert_eq!(fs::read(mnt.h("copy")).unwrap(), &big[..200_000]);
    mnt.finish().unwrap();
}

#[test]
fn directories_are_made_listed_and_removed() {
    let mnt = Mount::new(false);
    fs::create_dir_all(mnt.m("a/b/c/d/e")).unwrap();
    assert!(mnt.h("a/b/c/d/e").is_dir());

    // More entries than one READDIR reply holds: the listing continues by offsets.
    fs::create_dir(mnt.m("many")).unwrap();
    let want: BTreeSet<String> = (0..400)
        .map(|i| format!("an-entry-with-a-fairly-long-name-{i:04}"))
        .collect();
    for n in &want {
        File::create(mnt.m("many").join(n)).unwrap();
    }
    let got: BTreeSet<String> = fs::read_dir(mnt.m("many"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(got, want);

    // telldir/seekdir: a listing resumed from a cookie mid-way is the same listing.
    let p = cpath(&mnt.m("many"));
    // SAFETY: a NUL-terminated path; the stream is used only until closedir.
    unsafe {
        let d = libc::opendir(p.as_ptr());
        assert!(!d.is_null());
        let next = |d: *mut libc::DIR| -> Option<String> {
            let e = libc::readdir(d);
            (!e.is_null()).then(|| {
                std::ffi::CStr::from_ptr((*e).d_name.as_ptr())
                    .to_string_lossy()
                    .into_owned()
            })
        };
        for _ in 0..150 {
            next(d).unwrap();
        }
        let mark = libc::telldir(d);
        let rest: Vec<String> = std::iter::from_fn(|| next(d)).collect();
        assert!(rest.len() > 200);
        libc::seekdir(d, mark);
        let again: Vec<String> = std::iter::from_fn(|| next(d)).collect();
        assert_eq!(again, rest);
        libc::rewinddir(d);
        assert_eq!(std::iter::from_fn(|| next(d)).count(), 402, "with . and ..");
        libc::closedir(d);
    }

    assert_eq!(errno_of(fs::remove_dir(mnt.m("many"))), libc::ENOTEMPTY);
    fs::remove_dir_all(mnt.m("many")).unwrap();
    assert!(!mnt.h("many").exists());
    fs::remove_dir(mnt.m("a/b/c/d/e")).unwrap();
    assert!(!mnt.h("a/b/c/d/e").exists());
    assert_eq!(errno_of(fs::remove_dir(mnt.m("a/b/c/d/e"))), libc::ENOENT);
    mnt.finish().unwrap();
}

#[test]
fn names_are_renamed_linked_and_unlinked() {
    let mnt = Mount::new(false);
    fs::write(mnt.m("a"), b"A").unwrap();
    fs::write(mnt.m("b"), b"B").unwrap();
    fs::rename(mnt.m("a"), mnt.m("b")).unwrap();
    assert_eq!(fs::read(mnt.h("b")).unwrap(), b"A");
    assert!(!mnt.h("a").exists());

    // RENAME_NOREPLACE onto an existing name fails; RENAME_EXCHANGE swaps.
    fs::write(mnt.m("c"), b"C").unwrap();
    let (b, c) = (cpath(&mnt.m("b")), cpath(&mnt.m("c")));
    let rename2 = |from: &CString, to: &CString, flags: u32| {
        // SAFETY: NUL-terminated paths.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                flags,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    assert_eq!(
        errno_of(rename2(&c, &b, libc::RENAME_NOREPLACE)),
        libc::EEXIST
    );
    rename2(&c, &b, libc::RENAME_EXCHANGE).unwrap();
    assert_eq!(fs::read(mnt.h("b")).unwrap(), b"C");
    assert_eq!(fs::read(mnt.h("c")).unwrap(), b"A");

    // Across directories.
    fs::create_dir(mnt.m("sub")).unwrap();
    fs::rename(mnt.m("c"), mnt.m("sub/moved")).unwrap();
    assert_eq!(fs::read(mnt.h("sub/moved")).unwrap(), b"A");

    // A hard link is the same inode under two names.
    fs::hard_link(mnt.m("sub/moved"), mnt.m("hard")).unwrap();
    let (x, y) = (
        fs::metadata(mnt.m("sub/moved")).unwrap(),
        fs::metadata(mnt.m("hard")).unwrap(),
    );
    assert_eq!((x.ino(), x.nlink()), (y.ino(), 2));
    assert_eq!(fs::metadata(mnt.h("hard")).unwrap().nlink(), 2);
    fs::remove_file(mnt.m("hard")).unwrap();
    assert!(!mnt.h("hard").exists());
    assert_eq!(fs::metadata(mnt.h("sub/moved")).unwrap().nlink(), 1);

    // Symlinks are stored as written, relative or absolute, and read back.
    std::os::unix::fs::symlink("sub/moved", mnt.m("rel")).unwrap();
    std::os::unix::fs::symlink("/nowhere/at/all", mnt.m("abs")).unwrap();
    assert_eq!(fs::read_link(mnt.m("rel")).unwrap(), Path::new("sub/moved"));
    assert_eq!(fs::read(mnt.m("rel")).unwrap(), b"A");
    assert!(fs::symlink_metadata(mnt.h("abs"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        fs::read_link(mnt.h("abs")).unwrap(),
        Path::new("/nowhere/at/all")
    );
    fs::remove_file(mnt.m("abs")).unwrap();
    assert!(fs::symlink_metadata(mnt.h("abs")).is_err());
    assert_eq!(errno_of(fs::remove_file(mnt.m("abs"))), libc::ENOENT);
    mnt.finish().unwrap();
}

#[test]
fn attributes_are_set_and_reported() {
    let mnt = Mount::new(false);
    fs::write(mnt.m("f"), b"data").unwrap();
    fs::set_permissions(mnt.m("f"), fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(fs::metadata(mnt.h("f")).unwrap().mode() & 0o7777, 0o640);
    assert_eq!(fs::metadata(mnt.m("f")).unwrap().mode() & 0o7777, 0o640);

    std::os::unix::fs::chown(mnt.m("f"), Some(1000), Some(1000)).unwrap();
    let m = fs::metadata(mnt.h("f")).unwrap();
    assert_eq!((m.uid(), m.gid()), (1000, 1000));
    // Set-id bits survive: the server chowns before it chmods.
    fs::set_permissions(mnt.m("f"), fs::Permissions::from_mode(0o4755)).unwrap();
    assert_eq!(fs::metadata(mnt.h("f")).unwrap().mode() & 0o7777, 0o4755);

    let when = UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    let f = OpenOptions::new().write(true).open(mnt.m("f")).unwrap();
    f.set_times(
        fs::FileTimes::new()
            .set_modified(when)
            .set_accessed(when + Duration::from_secs(5)),
    )
    .unwrap();
    drop(f);
    let m = fs::metadata(mnt.h("f")).unwrap();
    assert_eq!((m.mtime(), m.atime()), (1_000_000_000, 1_000_000_005));
    // utimensat(NULL): now.
    let p = cpath(&mnt.m("f"));
    // SAFETY: a NUL-terminated path and a null times pointer.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), std::ptr::null(), 0) };
    assert_eq!(rc, 0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!((fs::metadata(mnt.h("f")).unwrap().mtime() - now).abs() < 60);

    // statfs is the export's filesystem's.
    let stat = |p: &Path| {
        let c = cpath(p);
        // SAFETY: statvfs is plain integers, for which all zeroes is valid.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a NUL-terminated path and a statvfs we own.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
        s
    };
    let (a, b) = (stat(&mnt.mnt), stat(&mnt.export));
    assert_eq!(
        (a.f_blocks, a.f_frsize, a.f_files),
        (b.f_blocks, b.f_frsize, b.f_files)
    );
    mnt.finish().unwrap();
}

#[test]
fn what_a_user_creates_is_theirs_on_the_host() {
    let mnt = Mount::with_export(false, |e| {
        fs::create_dir(e.join("open")).unwrap();
        fs::set_permissions(e.join("open"), fs::Permissions::from_mode(0o777)).unwrap();
        // A set-group-id directory: what is made in it takes its group.
        fs::create_dir(e.join("shared")).unwrap();
        std::os::unix::fs::chown(e.join("shared"), Some(0), Some(4321)).unwrap();
        fs::set_permissions(e.join("shared"), fs::Permissions::from_mode(0o2777)).unwrap();
    });
    let script = "set -e; cd \"$1\"; \
        echo hi > open/file; mkdir open/dir; ln -s file open/sym; \
        echo hi > shared/file; mkdir shared/dir";
    let st = std::process::Command::new("sh")
        .args(["-c", script, "sh"])
        .arg(&mnt.mnt)
        .uid(1234)
        .gid(1234)
        .status()
        .unwrap();
    assert!(st.success(), "the user's script failed: {st}");
    for p in ["open/file", "open/dir", "open/sym"] {
        let m = fs::symlink_metadata(mnt.h(p)).unwrap();
        assert_eq!((m.uid(), m.gid()), (1234, 1234), "{p}");
    }
    let f = fs::metadata(mnt.h("shared/file")).unwrap();
    assert_eq!((f.uid(), f.gid()), (1234, 4321));
    let d = fs::metadata(mnt.h("shared/dir")).unwrap();
    assert_eq!((d.uid(), d.gid()), (1234, 4321));
    assert_ne!(
        d.mode() & libc::S_ISGID,
        0,
        "a directory keeps set-group-id"
    );
    // Another user's files are theirs to keep: the guest kernel checks, as on a disk.
    let st = std::process::Command::new("sh")
        .args(["-c", "echo x > \"$1\"", "sh"])
        .arg(mnt.m("open/file"))
        .uid(4444)
        .gid(4444)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!st.success());
    assert_eq!(fs::read(mnt.h("open/file")).unwrap(), b"hi\n");
    mnt.finish().unwrap();
}

#[test]
fn a_read_only_export_refuses_every_change() {
    let mnt = Mount::with_export(true, |e| {
        fs::write(e.join("f"), b"keep").unwrap();
        fs::create_dir(e.join("d")).unwrap();
    });
    assert_eq!(fs::read(mnt.m("f")).unwrap(), b"keep");
    assert_eq!(fs::read_dir(mnt.m("d")).unwrap().count(), 0);
    assert_eq!(errno_of(File::create(mnt.m("new"))), libc::EROFS);
    assert_eq!(errno_of(fs::write(mnt.m("f"), b"x")), libc::EROFS);
    assert_eq!(
        errno_of(OpenOptions::new().append(true).open(mnt.m("f"))),
        libc::EROFS
    );
    assert_eq!(errno_of(fs::create_dir(mnt.m("d2"))), libc::EROFS);
    assert_eq!(errno_of(fs::remove_file(mnt.m("f"))), libc::EROFS);
    assert_eq!(errno_of(fs::remove_dir(mnt.m("d"))), libc::EROFS);
    assert_eq!(errno_of(fs::rename(mnt.m("f"), mnt.m("g"))), libc::EROFS);
    assert_eq!(
        errno_of(fs::set_permissions(
            mnt.m("f"),
            fs::Permissions::from_mode(0o777)
        )),
        libc::EROFS
    );
    assert_eq!(
        errno_of(std::os::unix::fs::symlink("f", mnt.m("l"))),
        libc::EROFS
    );
    assert_eq!(errno_of(fs::hard_link(mnt.m("f"), mnt.m("h"))), libc::EROFS);
    assert_eq!(fs::read(mnt.h("f")).unwrap(), b"keep");
    assert_eq!(fs::read_dir(&mnt.export).unwrap().count(), 2);
    mnt.finish().unwrap();
}
