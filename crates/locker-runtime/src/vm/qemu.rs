//! QEMU processes: the machine's shape, its arguments, and the spawn into the machine's
//! uid, cgroup and network namespace.

use std::fs;
use std::io::{self};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};

use super::accel::*;
use super::assets::*;
use super::*;
use crate::cgroup::{c_paths, enter_cgroup};

/// A microVM's size and devices. VMs restored from one base share it exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub memory_mb: u64,
    pub vcpus: u32,
    pub disk_mb: u64,
    /// Whether it has a network device (machines with a network policy other than `none`).
    #[serde(default)]
    pub net: bool,
}

impl Shape {
    /// The shape of a machine with `cpus` cores (rounded up to whole vCPUs).
    pub fn new(memory_mb: u64, cpus: f64, disk_mb: u64) -> Self {
        Self {
            memory_mb,
            vcpus: (cpus.ceil() as u32).clamp(1, 64),
            disk_mb,
            net: false,
        }
    }

    /// The same shape with or without a network device.
    pub fn with_net(self, net: bool) -> Self {
        Self { net, ..self }
    }
}

/// How one QEMU process is to be started.
pub(super) struct Launch<'a> {
    /// The machine's directory: QEMU puts `agent.sock`, `qmp.sock`, `console.log` there.
    pub(super) dir: &'a Path,
    /// The writable disk's images, top first: the machine's own (raw `disk.img`, or a
    /// qcow2 overlay `disk.qcow2`), then the read-only layers beneath an overlay (see
    /// [`disk_args`]).
    pub(super) disk: &'a [PathBuf],
    pub(super) template_image: &'a Path,
    /// The guest RAM file.
    pub(super) ram: &'a Path,
    /// Shared (a base being booted) or a private copy-on-write map (every other VM).
    pub(super) share: bool,
    /// Device state to restore from (becomes fd 3).
    pub(super) incoming: Option<fs::File>,
    /// Run as this uid and gid (none: as the caller, for a base).
    pub(super) uid: Option<u32>,
    pub(super) cgroup_procs: Vec<PathBuf>,
    /// The network device's backend (a machine of a shape with one). A base of such a
    /// shape has none: QEMU, as root in its own empty namespace, makes its tap itself.
    pub(super) net: Option<NetDev>,
}

/// The fd a machine's QEMU finds its tap on (fd 3 is the incoming state).
pub(super) const TAP_FD: RawFd = 4;

/// The RAM QEMU `qemu` (its version) gives a guest of `shape`, in MB: its memory, except that a guest of exactly
/// 2048 MB gets 2049 from QEMU 10 on. That QEMU loads the initramfs at the very top of the
/// first 2 GiB (the kernel's limit for it), and when RAM ends right there, across the page
/// its firmware reserves at the top of RAM: the initramfs's tail reads back wrong (a
/// module's signature rejected, "virtio-blk missing headers"). QEMU 7.2 keeps it below.
pub(super) fn ram_mb(qemu: (u32, u32), shape: Shape) -> u64 {
    if shape.memory_mb == 2048 && qemu >= (10, 0) {
        2049
    } else {
        shape.memory_mb
    }
}

pub(super) fn qemu_args(a: &Assets, shape: Shape, l: &Launch) -> Vec<String> {
    let d = |n: &str| l.dir.join(n).display().to_string();
    let mem = ram_mb(a.qemu_version, shape);
    let ram = if l.share {
        format!(
            "memory-backend-file,id=mem,size={mem}M,mem-path={},share=on",
            l.ram.display()
        )
    } else if a.ram_readonly() {
        format!(
            "memory-backend-file,id=mem,size={mem}M,mem-path={},share=off,readonly=on,rom=off",
            l.ram.display()
        )
    } else {
        format!(
            "memory-backend-file,id=mem,size={mem}M,mem-path={},share=off",
            l.ram.display()
        )
    };
    let accel = match a.accel {
        Accel::Kvm => "kvm".to_owned(),
        Accel::Tcg => format!("tcg,tb-size={TCG_TB_MB}"),
    };
    let mut v: Vec<String> = vec![
        "-M".into(),
        "microvm,rtc=on,memory-backend=mem".into(),
        "-accel".into(),
        accel,
        "-cpu".into(),
        if a.accel == Accel::Kvm { "host".into() } else { "max".into() },
        "-m".into(),
        format!("{mem}M"),
        "-smp".into(),
        shape.vcpus.to_string(),
        "-object".into(),
        ram,
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        "-serial".into(),
        format!("file:{}", d("console.log")),
        "-kernel".into(),
        a.kernel.display().to_string(),
        "-initrd".into(),
        a.initrd.display().to_string(),
        "-append".into(),
        format!(
            "console=ttyS0 quiet panic=-1 reboot=t rdinit=/init tsc_early_khz={} tsc=reliable LOCKER_VM=1",
            a.tsc_khz
        ),
        "-drive".into(),
        format!("id=template,file={},format=raw,if=none,readonly=on", l.template_image.display()),
        "-device".into(),
        "virtio-blk-device,drive=template".into(),
    ];
    v.extend(disk_args(l.disk));
    let rest: Vec<String> = vec![
        "-device".into(),
        "virtio-blk-device,drive=disk".into(),
        "-device".into(),
        "virtio-serial-device".into(),
        "-chardev".into(),
        format!(
            "socket,id=agent,path={},server=on,wait=off",
            d("agent.sock")
        ),
        "-device".into(),
        format!("virtserialport,chardev=agent,name={PORT_NAME}"),
        // Volumes: FUSE requests to the host's file server (see [`crate::vm_fs`]).
        "-chardev".into(),
        format!("socket,id=fs,path={},server=on,wait=off", d(FS_SOCKET)),
        "-device".into(),
        format!(
            "virtserialport,chardev=fs,name={}",
            locker_proto::fs_frame::PORT_NAME
        ),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", d("qmp.sock")),
        "-sandbox".into(),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
    ];
    v.extend(rest);
    if shape.net {
        let backend = if l.net.is_some() {
            format!("fd={TAP_FD}")
        } else {
            "ifname=tap0,script=no,downscript=no".to_owned()
        };
        v.push("-netdev".into());
        v.push(format!("tap,id=net0,{backend},vhost=off"));
        v.push("-device".into());
        v.push("virtio-net-device,netdev=net0".into());
    }
    if l.incoming.is_some() {
        // Deferred: `x-ignore-shared` must be set before the state is read (see
        // [`Qmp::ignore_shared`]); the state itself comes on fd 3.
        v.push("-incoming".into());
        v.push("defer".into());
    }
    v
}

/// The writable disk as explicit `-blockdev` nodes, given its images top first: the top
/// node (`disk`, the device's) writable, every layer beneath it read-only, each with the
/// format driver its file name says ([`crate::disk::Format`]) and each qcow2 node's
/// `backing` set to the node below (`null` at the bottom), so QEMU neither probes a format
/// nor opens a backing file an image's header names. Bottom first: a node is defined
/// before the one that names it. JSON, so paths need no escaping.
pub(super) fn disk_args(chain: &[PathBuf]) -> Vec<String> {
    use crate::disk::Format;
    let name = |i: usize| {
        if i == 0 {
            "disk".to_owned()
        } else {
            format!("layer{}", i - 1)
        }
    };
    let mut v = Vec::new();
    for (i, path) in chain.iter().enumerate().rev() {
        let top = i == 0;
        let mut file = json!({"driver": "file", "filename": path});
        let mut node = json!({"node-name": name(i)});
        if top {
            file["discard"] = json!("unmap");
            node["discard"] = json!("unmap");
        } else {
            file["read-only"] = json!(true);
            node["read-only"] = json!(true);
        }
        match Format::of(path) {
            Some(Format::Qcow2) => {
                node["driver"] = json!("qcow2");
                node["backing"] = if i + 1 < chain.len() {
                    json!(name(i + 1))
                } else {
                    Value::Null
                };
            }
            // Anything else is raw: only the host names these files ([`crate::disk`]
            // checks a stack before it gets here).
            _ => node["driver"] = json!("raw"),
        }
        node["file"] = file;
        v.push("-blockdev".into());
        v.push(node.to_string());
    }
    v
}

/// Starts QEMU: in the machine's cgroup, in the machine's network namespace (or a new,
/// empty one), as `uid`.
pub(super) fn spawn_qemu(
    a: &Assets,
    shape: Shape,
    l: Launch,
) -> Result<tokio::process::Child, VmError> {
    a.ensure_initrd()?;
    let log = fs::File::create(l.dir.join("qemu.log")).map_err(setup("create qemu.log"))?;
    let log2 = log.try_clone().map_err(setup("dup qemu.log"))?;
    let mut cmd = std::process::Command::new(&a.qemu);
    cmd.args(qemu_args(a, shape, &l))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
    let procs = c_paths(&l.cgroup_procs);
    let incoming: Option<RawFd> = l.incoming.as_ref().map(|f| f.as_raw_fd());
    // The tap above fd 4, so that putting the incoming state on 3 cannot clobber it.
    let tap: Option<fs::File> = match &l.net {
        Some(n) => Some(dup_above(&n.tap, TAP_FD + 1).map_err(setup("dup the tap's fd"))?),
        None => None,
    };
    let (netns, tap_fd) = (
        l.net.as_ref().map(|n| n.netns.as_raw_fd()),
        tap.as_ref().map(|t| t.as_raw_fd()),
    );
    let uid = l.uid;
    // SAFETY: only async-signal-safe calls (open, write, close, unshare, setns, dup2,
    // set*id, prctl) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            for p in &procs {
                enter_cgroup(p)?;
            }
            let entered = match netns {
                Some(fd) => libc::setns(fd, libc::CLONE_NEWNET),
                None => libc::unshare(libc::CLONE_NEWNET),
            };
            if entered != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some(fd) = incoming {
                // dup2 onto itself would keep close-on-exec set: clear it instead.
                let r = if fd == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0)
                } else {
                    libc::dup2(fd, 3)
                };
                if r < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(fd) = tap_fd {
                if libc::dup2(fd, TAP_FD) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(uid) = uid {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setresgid(uid, uid, uid) != 0
                    || libc::setresuid(uid, uid, uid) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn()
        .map_err(setup(format!("start {}", a.qemu.display())))?;
    drop(l.incoming);
    drop(tap);
    Ok(child)
}

/// A close-on-exec duplicate of `f` numbered `min` or above.
pub(super) fn dup_above(f: &fs::File, min: RawFd) -> io::Result<fs::File> {
    locker_sys::proc::dup_above(f.as_raw_fd(), min).map(fs::File::from)
}

/// The tail of a QEMU's log and console, for error messages.
pub(super) fn logs_of(dir: &Path) -> String {
    let tail = |n: &str| {
        let t = fs::read(dir.join(n)).unwrap_or_default();
        let s = String::from_utf8_lossy(&t[t.len().saturating_sub(600)..]).into_owned();
        s.trim().to_owned()
    };
    format!(
        "qemu: {:?}; console: {:?}",
        tail("qemu.log"),
        tail("console.log")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_of_2_gib_gets_a_mb_more_from_qemu_10() {
        let shape = |mb| Shape::new(mb, 1.0, 2048);
        assert_eq!(ram_mb((10, 0), shape(2048)), 2049);
        assert_eq!(ram_mb((7, 2), shape(2048)), 2048);
        assert_eq!(ram_mb((10, 0), shape(2047)), 2047);
        assert_eq!(ram_mb((10, 0), shape(4096)), 4096);
    }

    #[test]
    fn a_disk_chain_names_every_format_and_backing_itself() {
        let args = disk_args(&[
            PathBuf::from("/m/disk.qcow2"),
            PathBuf::from("/m/layers/0.qcow2"),
            PathBuf::from("/m/layers/1.img"),
        ]);
        let nodes: Vec<Value> = args
            .chunks(2)
            .map(|c| {
                assert_eq!(c[0], "-blockdev");
                serde_json::from_str(&c[1]).unwrap()
            })
            .collect();
        // Bottom first: each node exists before the one that names it.
        assert_eq!(
            nodes[0],
            json!({"node-name": "layer1", "driver": "raw", "read-only": true,
                   "file": {"driver": "file", "filename": "/m/layers/1.img", "read-only": true}})
        );
        assert_eq!(
            nodes[1],
            json!({"node-name": "layer0", "driver": "qcow2", "read-only": true, "backing": "layer1",
                   "file": {"driver": "file", "filename": "/m/layers/0.qcow2", "read-only": true}})
        );
        assert_eq!(
            nodes[2],
            json!({"node-name": "disk", "driver": "qcow2", "discard": "unmap", "backing": "layer0",
                   "file": {"driver": "file", "filename": "/m/disk.qcow2", "discard": "unmap"}})
        );
        // A machine restored from a base: one raw node; a qcow2 image alone backs nothing.
        let raw: Value =
            serde_json::from_str(&disk_args(&[PathBuf::from("/m/disk.img")])[1]).unwrap();
        assert_eq!(raw["driver"], "raw");
        assert!(raw.get("backing").is_none());
        let alone: Value =
            serde_json::from_str(&disk_args(&[PathBuf::from("/m/disk.qcow2")])[1]).unwrap();
        assert_eq!(alone["backing"], Value::Null);
    }
}
