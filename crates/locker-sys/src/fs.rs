//! Path-level file helpers every crate needs once: atomic writes, synced directories, tree
//! removal, whole-file locks, times, the filesystem type and device nodes. Paths are host
//! paths the caller trusts (its own data directory); a machine's files go through [`crate::fd`].

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{check_int, cstr};

/// How far [`write_atomic`] makes a write last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Through a power loss: the file and its directory are fsynced (metadata, journals).
    Disk,
    /// Through the writer's death only (the page cache keeps it): no fsync, for files on a
    /// hot path whose life ends with the host's (a running machine's state).
    PageCache,
}

/// Replaces `path` with `bytes` whole or not at all: written to a unique temporary name
/// beside it (mode 0644), then renamed over it. On an error the temporary file is removed
/// and `path` is as it was.
pub fn write_atomic(path: &Path, bytes: &[u8], durability: Durability) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    // Unique per write: threads of one process may write the same name at once.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".tmp-{name}-{}-{n}", std::process::id()));
    let write = || -> io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(fs::Permissions::from_mode(0o644))?;
        if durability == Durability::Disk {
            f.sync_all()?;
        }
        fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    match durability {
        Durability::Disk => fsync_dir(dir),
        Durability::PageCache => Ok(()),
    }
}

/// Flushes the directory `dir` itself (the names in it: a rename, a new or removed file).
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Removes the file or tree at `path`; nothing there is fine. Symlinks are removed, never
/// followed. Directories without write or search permission for the caller (a build's
/// read-only module cache, a test's `chmod 0555`) are made writable first, so a non-root
/// caller can remove what it created. It does not unmount: a tree with mounts under it
/// loses the mounted files too, so callers that may have mounts check first.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            let top = File::open(path)?;
            make_writable(&top)?;
            match fs::remove_dir_all(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        }
        Err(e) => Err(e),
    }
}

/// Adds `u+rwx` to the directory `dir` and every directory under it, walking by fd
/// (`O_NOFOLLOW`, so a symlink swapped in leads nowhere).
fn make_writable(dir: &File) -> io::Result<()> {
    let st = crate::fd::fstat(dir.as_raw_fd())?;
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        return Ok(());
    }
    if st.st_mode & 0o700 != 0o700 {
        crate::fd::fchmod(dir.as_raw_fd(), (st.st_mode | 0o700) & 0o7777)?;
    }
    let listing = crate::fd::openat(dir.as_raw_fd(), c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    for name in crate::fd::read_dir_names(listing)? {
        let st = crate::fd::lstatat(dir.as_raw_fd(), &name)?;
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
            let sub = crate::fd::openat(dir.as_raw_fd(), &name, flags, 0)?;
            make_writable(&File::from(sub))?;
        }
    }
    Ok(())
}

/// Takes an exclusive `flock(2)` on `file`, waiting for it if `wait`; `Ok(false)` if `wait`
/// is false and someone holds it. Released when the file closes.
pub fn flock(file: &File, wait: bool) -> io::Result<bool> {
    let op = if wait {
        libc::LOCK_EX
    } else {
        libc::LOCK_EX | libc::LOCK_NB
    };
    flock_op(file, op)
}

/// Takes a shared `flock(2)` on `file`, waiting for it (an exclusive holder goes first);
/// released when the file closes.
pub fn lock_shared(file: &File) -> io::Result<()> {
    flock_op(file, libc::LOCK_SH).map(drop)
}

fn flock_op(file: &File, op: libc::c_int) -> io::Result<bool> {
    loop {
        // SAFETY: flock on a file descriptor this `File` owns; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// Takes an exclusive POSIX record lock on the whole of `file` for this *process*
/// (`fcntl(F_SETLK)`, never waiting); `Ok(false)` if another process holds it.
///
/// Unlike [`flock`], the lock belongs to the process, not to the open file: a child
/// forked while it is held shares the descriptor but not the lock, so the lock is free
/// the moment this process dies, whatever its children (one between fork and exec, one
/// that inherited the descriptor) still hold. The price: closing *any* descriptor of the
/// file in this process drops the lock, so keep exactly one open.
pub fn lock_for_process(file: &File) -> io::Result<bool> {
    // SAFETY: an all-zero flock struct is valid; the fields that matter are set below.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = 0;
    l.l_len = 0; // to the end of the file, however long it grows
    loop {
        // SAFETY: fcntl on a descriptor this `File` owns with a live flock struct.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLK, &l) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EACCES | libc::EAGAIN) => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// Takes an exclusive `flock(2)` on `file`, waiting for it; released when the file closes.
pub fn lock_exclusive(file: &File) -> io::Result<()> {
    flock(file, true).map(drop)
}

/// Flushes the whole filesystem holding `file` to disk (`syncfs(2)`).
pub fn syncfs(file: &File) -> io::Result<()> {
    crate::fd::syncfs(file.as_raw_fd())
}

/// Sets the access and modification times of `path` itself (a symlink is not followed).
pub fn set_times_nofollow(path: &Path, atime: (i64, i64), mtime: (i64, i64)) -> io::Result<()> {
    let p = cstr(path)?;
    let ts = [
        libc::timespec {
            tv_sec: atime.0,
            tv_nsec: atime.1,
        },
        libc::timespec {
            tv_sec: mtime.0,
            tv_nsec: mtime.1,
        },
    ];
    crate::fd::set_times_at(libc::AT_FDCWD, &p, &ts)
}

/// The filesystem type (`f_type` of `statfs(2)`) of the filesystem holding `path`
/// (which needs no permission on `path` itself, unlike opening it).
pub fn fs_type(path: &Path) -> io::Result<i64> {
    let p = cstr(path)?;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: the kernel fills `st` on success, which is the only case we read it; `p` is
    // a NUL-terminated path alive for the call.
    check_int(unsafe { libc::statfs(p.as_ptr(), st.as_mut_ptr()) })?;
    // SAFETY: initialized by the successful call above.
    let st = unsafe { st.assume_init() };
    // `f_type`'s width differs between libcs and architectures.
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64)
}

/// `statvfs(3)` of the filesystem holding `path`: its size and free blocks.
pub fn statvfs(path: &Path) -> io::Result<libc::statvfs> {
    let p = cstr(path)?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: statvfs writes a statvfs into `st` and reads the NUL-terminated path we own.
    check_int(unsafe { libc::statvfs(p.as_ptr(), st.as_mut_ptr()) })?;
    // SAFETY: initialized by the successful call above.
    Ok(unsafe { st.assume_init() })
}

/// `mknod(2)`: a device node, FIFO or (`S_IFCHR` with device 0) an overlayfs whiteout.
pub fn mknod(path: &Path, mode: libc::mode_t, dev: libc::dev_t) -> io::Result<()> {
    let p = cstr(path)?;
    // SAFETY: a NUL-terminated path we own; integers otherwise.
    check_int(unsafe { libc::mknod(p.as_ptr(), mode, dev) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn scratch(what: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("locker-sys-{what}-{}", std::process::id()));
        let _ = remove_tree(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    /// Forks a child that runs `f` and leaves with its result as exit code (0 = true);
    /// returns the child's pid.
    fn in_child(f: impl FnOnce() -> bool) -> libc::pid_t {
        // SAFETY: the child only opens a file, takes a lock or reads a pipe, and leaves
        // with _exit (glibc keeps malloc usable in a forked child).
        let pid = unsafe { crate::proc::fork() }.unwrap();
        if pid == 0 {
            crate::proc::exit_now(if f() { 0 } else { 1 });
        }
        pid
    }

    fn exit_code(pid: libc::pid_t) -> i32 {
        let st = crate::proc::waitpid(pid).unwrap();
        assert!(libc::WIFEXITED(st), "{st:#x}");
        libc::WEXITSTATUS(st)
    }

    #[test]
    fn a_process_lock_excludes_other_processes_but_not_after_its_holder_lets_go() {
        let d = scratch("plock");
        let path = d.join("serve.lock");
        let open = || {
            fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .unwrap()
        };
        let held = open();
        assert!(lock_for_process(&held).unwrap());
        // Another process cannot take it.
        let other = in_child(|| !lock_for_process(&open()).unwrap());
        assert_eq!(exit_code(other), 0, "a second process took a held lock");
        // A child forked while it is held keeps the descriptor alive (as one between fork
        // and exec does) ...
        let (r, w) = crate::fd::pipe().unwrap();
        let (rfd, wfd) = (r.as_raw_fd(), w.as_raw_fd());
        let inheritor = in_child(move || {
            let mut b = [0u8; 1];
            // SAFETY: the child's copies of the pipe's ends; it reads until the parent
            // closes the write end (the child's own copy closed first).
            unsafe {
                libc::close(wfd);
                libc::read(rfd, b.as_mut_ptr().cast(), 1);
            }
            true
        });
        drop(r);
        // ... yet once the holder lets go (a process that dies closes its descriptors),
        // the next process takes the lock at once.
        drop(held);
        let next = in_child(|| lock_for_process(&open()).unwrap());
        let took = exit_code(next);
        drop(w);
        assert_eq!(exit_code(inheritor), 0);
        assert_eq!(
            took, 0,
            "the lock stayed held by a child that inherited the descriptor"
        );
        remove_tree(&d).unwrap();
    }

    #[test]
    fn write_atomic_replaces_and_leaves_no_temp_file_on_error() {
        let d = scratch("atomic");
        let f = d.join("meta.json");
        write_atomic(&f, b"one", Durability::Disk).unwrap();
        write_atomic(&f, b"two", Durability::PageCache).unwrap();
        assert_eq!(fs::read(&f).unwrap(), b"two");
        assert_eq!(
            fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o644
        );
        // A directory in the way: the rename fails after the temporary file was written.
        let blocked = d.join("blocked");
        fs::create_dir(&blocked).unwrap();
        fs::write(blocked.join("x"), b"").unwrap();
        let e = write_atomic(&blocked, b"three", Durability::Disk).unwrap_err();
        assert!(e.raw_os_error().is_some(), "{e}");
        let names: Vec<_> = fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        let mut names = names;
        names.sort();
        assert_eq!(names, ["blocked", "meta.json"], "a temporary file stayed");
        remove_tree(&d).unwrap();
    }

    #[test]
    fn remove_tree_removes_read_only_dirs_and_keeps_symlink_targets() {
        let d = scratch("rmtree");
        let keep = d.join("keep");
        fs::create_dir(&keep).unwrap();
        fs::write(keep.join("precious"), b"x").unwrap();
        let t = d.join("tree");
        fs::create_dir_all(t.join("a/b")).unwrap();
        fs::write(t.join("a/b/f"), b"x").unwrap();
        std::os::unix::fs::symlink(&keep, t.join("a/link")).unwrap();
        for p in [t.join("a/b"), t.join("a")] {
            fs::set_permissions(&p, fs::Permissions::from_mode(0o555)).unwrap();
        }
        remove_tree(&t).unwrap();
        assert!(!t.exists());
        assert!(keep.join("precious").exists(), "a symlink was followed");
        remove_tree(&t).unwrap();
        remove_tree(&d).unwrap();
    }

    /// Set to a tree's path, [`removes_the_tree_named_in_the_environment`] removes it.
    const REMOVE_ENV: &str = "LOCKER_SYS_TEST_REMOVE";

    #[test]
    fn removes_the_tree_named_in_the_environment() {
        // A helper for the test below (run as another user); a no-op in a normal run.
        if let Some(t) = std::env::var_os(REMOVE_ENV) {
            remove_tree(Path::new(&t)).unwrap();
            assert!(!Path::new(&t).exists());
        }
    }

    #[test]
    fn remove_tree_of_a_read_only_tree_as_another_user() {
        use std::os::unix::process::CommandExt;
        // Root passes every permission check, so the fallback only runs for other users:
        // this test binary removes, as nobody, a tree nobody owns with read-only dirs.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let d = scratch("rmtree-user");
        let t = d.join("tree");
        fs::create_dir_all(t.join("a/b")).unwrap();
        fs::write(t.join("a/b/f"), b"x").unwrap();
        let nobody = 65534;
        for p in [&d, &t, &t.join("a"), &t.join("a/b"), &t.join("a/b/f")] {
            std::os::unix::fs::chown(p, Some(nobody), Some(nobody)).unwrap();
        }
        for p in [t.join("a/b"), t.join("a")] {
            fs::set_permissions(&p, fs::Permissions::from_mode(0o555)).unwrap();
        }
        // A copy of this binary that nobody can reach: the checkout may sit under a
        // directory only root may enter (a `mktemp -d` clone is 0700).
        let exe = d.join("test-binary");
        fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
        let out = std::process::Command::new(&exe)
            .args([
                "--exact",
                "fs::tests::removes_the_tree_named_in_the_environment",
            ])
            .env(REMOVE_ENV, &t)
            .uid(nobody)
            .gid(nobody)
            .output()
            .unwrap();
        let ok = out.status.success();
        remove_tree(&d).unwrap();
        assert!(ok, "{}", String::from_utf8_lossy(&out.stdout));
    }
}
