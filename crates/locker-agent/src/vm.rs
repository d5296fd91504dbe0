//! The agent as a microVM's init: what runs between the guest kernel and the first command.
//!
//! Inside a microVM the agent is `/init` of a small initramfs (the kernel starts it with
//! `LOCKER_VM=1` in its environment, from the kernel command line). [`init`] loads the
//! virtio modules listed in `/modules/order`, mounts the template's read-only disk
//! (`/dev/vda`) under the machine's writable disk (`/dev/vdb`, directories `upper` and `work`,
//! the same layout the jail runtime gives its disk images) as an overlay, moves into it and
//! mounts `/proc`, `/sys`, `/dev` and a cgroup2 hierarchy. [`serve_port`] then serves the
//! host over the virtio-serial port named [`PORT_NAME`]: one connection at a time, for as
//! long as the VM lives; when the host side goes away (the server restarted, or the VM is
//! about to be snapshotted) the connection ends and the agent waits for the next one.
//!
//! It owns nothing on the host and trusts nothing from it beyond the protocol.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Agent;

/// The virtio-serial port the host's QEMU exposes for the agent.
pub const PORT_NAME: &str = "org.locker.agent";

/// Whether this process is a microVM's init.
pub fn is_vm_init() -> bool {
    std::process::id() == 1 && std::env::var_os("LOCKER_VM").is_some()
}

fn mount(
    src: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> io::Result<()> {
    let _ = fs::create_dir_all(target);
    let data = (!data.is_empty()).then_some(data);
    locker_sys::mount::mount(Some(src), Path::new(target), Some(fstype), flags, data)
        .map_err(|e| io::Error::new(e.kind(), format!("mount {fstype} on {target}: {e}")))
}

/// Loads one kernel module file; one already loaded (or built in) is fine.
fn load_module(path: &Path) -> io::Result<()> {
    match locker_sys::host::load_module(&File::open(path)?) {
        Err(e) if e.raw_os_error() != Some(libc::EEXIST) => Err(io::Error::new(
            e.kind(),
            format!("load {}: {e}", path.display()),
        )),
        _ => Ok(()),
    }
}

fn wait_for(path: &str, limit: Duration) -> io::Result<()> {
    let t0 = Instant::now();
    while !Path::new(path).exists() {
        if t0.elapsed() > limit {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{path} did not appear within {limit:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Everything from the kernel's hand-over to a root filesystem the agent can serve.
/// Failing here leaves a VM that cannot be used: the caller powers it off.
pub fn init() -> io::Result<()> {
    mount("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755")?;
    mount(
        "proc",
        "/proc",
        "proc",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    )?;
    mount(
        "sysfs",
        "/sys",
        "sysfs",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    )?;
    let order = fs::read_to_string("/modules/order").unwrap_or_default();
    for name in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
        load_module(&Path::new("/modules").join(name))?;
    }
    wait_for("/dev/vda", Duration::from_secs(10))?;
    wait_for("/dev/vdb", Duration::from_secs(10))?;
    mount(
        "/dev/vda",
        "/lower",
        "ext4",
        libc::MS_RDONLY | libc::MS_NODEV,
        "",
    )?;
    mount(
        "/dev/vdb",
        "/layer",
        "ext4",
        libc::MS_NODEV | libc::MS_NOSUID,
        "",
    )?;
    for d in ["/layer/upper", "/layer/work"] {
        fs::create_dir_all(d)?;
    }
    mount(
        "overlay",
        "/newroot",
        "overlay",
        libc::MS_NODEV,
        "lowerdir=/lower,upperdir=/layer/upper,workdir=/layer/work",
    )?;
    // The initramfs cannot be pivoted away from: move the new root over `/` and chroot into
    // it (what switch_root does). The initramfs's files stay in memory; they are small.
    std::env::set_current_dir("/newroot")?;
    locker_sys::mount::move_to_root()?;
    std::env::set_current_dir("/")?;

    let nosuid = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount("proc", "/proc", "proc", nosuid, "")?;
    mount("sysfs", "/sys", "sysfs", nosuid, "")?;
    mount("cgroup2", "/sys/fs/cgroup", "cgroup2", nosuid, "")?;
    mount("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755")?;
    mount(
        "devpts",
        "/dev/pts",
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    )?;
    let _ = fs::remove_file("/dev/ptmx");
    std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx")?;
    mount(
        "shm",
        "/dev/shm",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=1777",
    )?;
    mount(
        "tmp",
        "/tmp",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=1777",
    )?;
    for (link, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let _ = std::os::unix::fs::symlink(to, Path::new("/dev").join(link));
    }
    if let Ok(h) = std::env::var("LOCKER_HOSTNAME") {
        let _ = locker_sys::host::sethostname(&h);
    }
    // `lo` is the only interface a machine with egress `none` has.
    let _ = locker_sys::net::loopback_up();
    // The console (the VM's serial port, `console.log` on the host) says how far it got.
    eprintln!("locker-agent: microVM ready");
    Ok(())
}

/// How long [`wait_for_host`] sleeps at most between looks at the port: a guard, should a
/// kernel not wake the port's waiters when the host connects (this guest's does).
const HOST_WAIT_GUARD_MS: i32 = 1000;

/// Whether the host side of port `fd` is connected (writable, no hang-up), looking once.
fn host_connected(fd: i32) -> bool {
    let mut p = [libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    }];
    matches!(locker_sys::fd::poll(&mut p, 0), Ok(n) if n > 0)
        && p[0].revents & libc::POLLHUP == 0
        && p[0].revents & libc::POLLOUT != 0
}

/// Waits until the host side of the port is connected.
///
/// While it is not (a server stopped or killed, a microVM waiting in a pool whose server is
/// gone), the port reads as hung up at once, so `poll` cannot sleep on it: this used to
/// poll and nap 2 ms in a loop, 500 guest wake-ups a second, which under TCG kept an idle
/// microVM at 10–20% of a host core until a server came back. It now sleeps in an
/// edge-triggered wait: the guest kernel wakes the port's waiters when the host connects
/// (virtio_console on `VIRTIO_CONSOLE_PORT_OPEN`), so the sleep ends at once then, and
/// otherwise only at the guard, once a second.
pub(crate) fn wait_for_host(fd: i32) {
    if host_connected(fd) {
        return;
    }
    let edges = locker_sys::fd::EdgeWait::new(fd);
    if let Err(e) = &edges {
        eprintln!("locker-agent: cannot watch the port for the host ({e}): looking every second");
    }
    while !host_connected(fd) {
        match &edges {
            Ok(w) => {
                let _ = w.wait(HOST_WAIT_GUARD_MS);
            }
            Err(_) => std::thread::sleep(Duration::from_millis(HOST_WAIT_GUARD_MS as u64)),
        }
    }
}

/// Serves the host over the virtio-serial port, one connection after another, forever.
pub fn serve_port(agent: Arc<Agent>) -> ! {
    let Some(path) = crate::share::find_port(PORT_NAME) else {
        eprintln!("locker-agent: no virtio port named {PORT_NAME}; powering off");
        power_off();
    };
    let port = match fs::OpenOptions::new().read(true).write(true).open(&path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("locker-agent: open {}: {e}; powering off", path.display());
            power_off();
        }
    };
    let mut host_hello = None;
    loop {
        if host_hello.is_none() {
            wait_for_host(port.as_raw_fd());
        }
        match port.try_clone() {
            Ok(conn) => {
                host_hello = crate::conn::serve_port(agent.clone(), conn, host_hello.take())
            }
            Err(e) => {
                eprintln!("locker-agent: dup the port: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Ends the VM (QEMU exits: it runs with `-no-reboot`).
pub fn power_off() -> ! {
    let e = locker_sys::host::power_off();
    eprintln!("locker-agent: power off: {e}");
    std::process::exit(1)
}
