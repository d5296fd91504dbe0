//! PID 1's set-up of a jail, before it becomes the machine's root: its cgroup namespace,
//! its disk and overlay root, the overlays and binds it is given, its pseudo-filesystems,
//! its `/dev`, its `/tmp`, and the pivot. Each step is a function named for what it makes;
//! [`machine_setup`] runs them in order.
//!
//! It runs only in PID 1 of a new jail, still the host's root in the host's user namespace
//! (the mounts need it), inside the machine's new mount namespace: nothing it mounts is
//! visible on the host. It does not drop privileges or execute the agent (see
//! [`super::shim`]).

use std::fs;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::shim::Entered;
use super::spec::JailSpec;
use super::{step, JailError};
use crate::cgroup::MachineCgroup;
use crate::machine::mounts::{mount_overlay, mount_run_layers, target_rel};
use crate::machine::Scratch;
use crate::sys;

/// The paths of a machine's set-up, in its directory (the set-up runs there).
struct Layers {
    /// The machine's directory.
    dir: PathBuf,
    /// The machine's disk, canonical ids: its writable layer (`upper`, `work`).
    disk: PathBuf,
    /// The disk id-mapped into the machine.
    mapped: PathBuf,
    /// The template, id-mapped read-only.
    lower: PathBuf,
    /// The machine's root, the overlay of both.
    root: PathBuf,
}

impl Layers {
    fn of(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            disk: dir.join("disk"),
            mapped: dir.join("disk-mapped"),
            lower: dir.join("lower"),
            root: dir.join("root"),
        }
    }

    /// A path inside the machine's root.
    fn r(&self, p: &str) -> PathBuf {
        self.root.join(p)
    }
}

/// Builds the machine's root and pivots into it. Returns the agent's write descriptor on
/// the machine's `/proc/meminfo` view (see [`crate::view`]).
pub(super) fn machine_setup(
    spec: &JailSpec,
    cg: &MachineCgroup,
    entered: Entered,
    fill: Option<&crate::disk::Fill>,
    cpus: Option<&[usize]>,
    userns: &OwnedFd,
) -> Result<OwnedFd, JailError> {
    let dir = &spec.dir;
    if entered == Entered::Forked {
        enter_cgroup_namespace(cg)?;
    }
    sys::make_mounts_private().map_err(step("make mounts private"))?;
    // Every overlay is mounted from paths relative to here: its options show in the
    // machine's mount table, and must name nothing of the host.
    std::env::set_current_dir(dir).map_err(step(format!("enter {}", dir.display())))?;
    let l = Layers::of(dir);
    mount_disk(spec, &l, fill)?;
    mount_root(spec, &l, userns)?;
    mount_overlays(spec, &l.root, userns)?;
    mount_binds(spec, &l.root, userns)?;
    mount_proc(&l)?;
    let view = mount_sys(&l, cg, cpus)?;
    mount_dev(&l, spec)?;
    mount_tmp(&l, spec)?;
    sys::sethostname(&spec.hostname).map_err(step("set the hostname"))?;
    sys::loopback_up().map_err(step("bring up loopback"))?;
    if entered == Entered::Cloned {
        delegate_controllers(cg)?;
    }
    pivot(&l)?;
    Ok(view)
}

/// Enters the machine's cgroup, then gives the machine a cgroup namespace rooted there. On
/// v2 the namespace root must be the machine's own cgroup (not its `init` leaf): with the
/// usual `nsdelegate` mount option a process may only move processes inside its
/// namespace, and the agent moves each command into a sibling of `init`. So: enter the
/// machine's cgroup, unshare, step into `init`, and only then enable the controllers for
/// its children (v2 allows no process in a cgroup that delegates controllers).
fn enter_cgroup_namespace(cg: &MachineCgroup) -> Result<(), JailError> {
    for (_, d) in cg.dirs() {
        fs::write(d.join("cgroup.procs"), "0").map_err(step("enter the cgroup"))?;
    }
    sys::unshare(libc::CLONE_NEWCGROUP).map_err(step("unshare the cgroup namespace"))?;
    if cg.layout().version == crate::cgroup::Version::V2 {
        for (_, d) in cg.dirs() {
            fs::write(d.join("init/cgroup.procs"), "0").map_err(step("enter the init cgroup"))?;
        }
        delegate_controllers(cg)?;
    }
    Ok(())
}

/// On v2, once PID 1 is in `init`: enables the controllers for the machine's children (the
/// commands' cgroups), which v2 allows only once no process is left in the machine's own
/// cgroup. A PID 1 cloned there ([`Entered::Cloned`]) may still find the helper that
/// cloned it in that cgroup (it only reports PID 1's pid and exits), so a busy answer is
/// retried.
fn delegate_controllers(cg: &MachineCgroup) -> Result<(), JailError> {
    const WAIT: std::time::Duration = std::time::Duration::from_secs(2);
    let started = std::time::Instant::now();
    for (_, d) in cg.dirs() {
        loop {
            match fs::write(d.join("cgroup.subtree_control"), "+memory +pids +cpu") {
                Ok(()) => break,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && started.elapsed() < WAIT => {
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
                Err(e) => return Err(step("delegate the controllers")(e)),
            }
        }
    }
    Ok(())
}

/// Adds a loop device the machine's images are attached to to its directory's
/// [`crate::machine::LOOPS`] list (`first`: a new list), so that its teardown waits for those
/// devices alone instead of reading every loop device on the host.
fn note_loop(dir: &Path, dev: &Path, first: bool) -> Result<(), JailError> {
    use std::io::Write;
    let mut f = fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(!first)
        .truncate(first)
        .open(dir.join(crate::machine::LOOPS))
        .map_err(step("note the machine's loop devices"))?;
    writeln!(f, "{}", dev.display()).map_err(step("note the machine's loop devices"))
}

/// Mounts the machine's disk (quota = its size), or a tmpfs in its place
/// ([`Scratch::Memory`]), which holds its writable layer, and
/// makes the mount points its template may lack. The disk stores canonical ids (root = 0)
/// and reaches the overlay through an id-mapped mount, so a disk image (a snapshot) can
/// start a machine with any uid range.
fn mount_disk(
    spec: &JailSpec,
    l: &Layers,
    fill: Option<&crate::disk::Fill>,
) -> Result<(), JailError> {
    for d in [&l.disk, &l.mapped, &l.lower, &l.root] {
        fs::create_dir_all(d).map_err(step(format!("create {}", d.display())))?;
    }
    match spec.scratch {
        Scratch::Disk => {
            let (dev, lo) = sys::loop_attach(&l.dir.join("disk.img"))
                .map_err(step("attach the disk to a loop device"))?;
            note_loop(&l.dir, &dev, true)?;
            // An empty disk attached first is filled now (see `disk::place_blank`); whatever
            // the device's page cache read meanwhile (a udev probe) is dropped before the mount.
            if let Some(fill) = fill {
                fill.run().map_err(step("fill the disk from its blank"))?;
                sys::flush_buffers(&lo).map_err(step("drop the disk's stale buffers"))?;
            }
            sys::mount(
                dev.to_str(),
                &l.disk,
                Some("ext4"),
                libc::MS_NODEV | libc::MS_NOSUID,
                None,
            )
            .map_err(step("mount the disk"))?;
        }
        Scratch::Memory => {
            // No loop device: an empty list, so the teardown waits for none (and does not
            // look through the host's).
            fs::write(l.dir.join(crate::machine::LOOPS), "")
                .map_err(step("note the machine's loop devices"))?;
            let size_mb = scratch_mb(spec);
            sys::mount(
                Some("scratch"),
                &l.disk,
                Some("tmpfs"),
                libc::MS_NODEV | libc::MS_NOSUID,
                Some(&format!("mode=0755,size={size_mb}m")),
            )
            .map_err(step("mount the writable layer's tmpfs"))?;
        }
    }
    for d in [l.disk.join("upper"), l.disk.join("work")] {
        fs::create_dir_all(&d).map_err(step("create the writable layer"))?;
    }
    // Mount points a template may lack (a minimal root filesystem without /proc, /sys,
    // /dev or /tmp) are made in the writable layer here, on the raw disk, where ids are
    // canonical: through the overlay the host's root is not mapped and mkdir fails with
    // EOVERFLOW.
    for (p, mode) in [
        ("proc", 0o555),
        ("sys", 0o555),
        ("dev", 0o755),
        ("tmp", 0o1777),
    ] {
        let upper = l.disk.join("upper").join(p);
        if fs::symlink_metadata(spec.template_rootfs.join(p)).is_err()
            && fs::symlink_metadata(&upper).is_err()
        {
            fs::create_dir(&upper).map_err(step(format!("create the mount point /{p}")))?;
            fs::set_permissions(&upper, fs::Permissions::from_mode(mode))
                .map_err(step(format!("create the mount point /{p}")))?;
        }
    }
    Ok(())
}

/// Mounts the machine's root: the template (id-mapped, read-only) under the layers of the
/// snapshot it starts from, if any (each read-only), under the disk's writable layer
/// (id-mapped).
fn mount_root(spec: &JailSpec, l: &Layers, userns: &OwnedFd) -> Result<(), JailError> {
    sys::idmapped_bind(&l.disk, &l.mapped, userns.as_raw_fd(), false)
        .map_err(step("id-map the disk"))?;
    sys::idmapped_bind(&spec.template_rootfs, &l.lower, userns.as_raw_fd(), true)
        .map_err(step("id-map the template"))?;
    let mut lowers = mount_layers(l, userns)?;
    lowers.push("lower".into());
    mount_overlay(
        Path::new(&lowers.join(":")),
        Path::new("disk-mapped/upper"),
        Path::new("disk-mapped/work"),
        &l.root,
        libc::MS_NODEV,
        // Every upper file holds its data (no metadata-only copy-up, whatever the host's
        // default): a snapshot of this layer must stand alone as another machine's lower.
        ",metacopy=off",
        spec.uid_base,
    )
    .map_err(step("mount the overlay root"))
}

/// Mounts each layer image the machine stands on (`layers/<n>.img`, a snapshot's stack,
/// top first): a read-only loop device (ext4 then writes nothing, not even its orphan
/// list), the filesystem read-only at `layer<n>-raw`, its `upper` tree id-mapped read-only
/// at `layer<n>`. Returns those names, top first, for the overlay's `lowerdir`. A former
/// upper tree works as a lower layer: overlayfs honours its whiteouts and opaque
/// directories there. Nothing here is visible on the host, and it all goes with the
/// machine's mount namespace (the loop devices detach themselves).
fn mount_layers(l: &Layers, userns: &OwnedFd) -> Result<Vec<String>, JailError> {
    let mut names = Vec::new();
    for (i, img) in crate::disk::machine_layers(&l.dir).iter().enumerate() {
        let (raw, name) = (l.dir.join(format!("layer{i}-raw")), format!("layer{i}"));
        let mapped = l.dir.join(&name);
        for d in [&raw, &mapped] {
            fs::create_dir_all(d).map_err(step(format!("create {}", d.display())))?;
        }
        let (dev, lo) = sys::loop_attach_read_only(img)
            .map_err(step(format!("attach the layer {name} to a loop device")))?;
        note_loop(&l.dir, &dev, false)?;
        sys::mount(
            dev.to_str(),
            &raw,
            Some("ext4"),
            libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOSUID,
            None,
        )
        .map_err(step(format!("mount the layer {name}")))?;
        drop(lo);
        sys::idmapped_bind(&raw.join("upper"), &mapped, userns.as_raw_fd(), true)
            .map_err(step(format!("id-map the layer {name}")))?;
        names.push(name);
    }
    Ok(names)
}

/// Mounts a fresh `/proc`, with the host-wide files a machine has no business reading
/// covered by `/dev/null`.
fn mount_proc(l: &Layers) -> Result<(), JailError> {
    mkdir(&l.r("proc"))?;
    sys::mount(Some("proc"), &l.r("proc"), Some("proc"), NODEV, None)
        .map_err(step("mount /proc"))?;
    for p in [
        "proc/keys",
        "proc/timer_list",
        "proc/kcore",
        "proc/sched_debug",
        "proc/sysrq-trigger",
    ] {
        if l.r(p).exists() {
            let _ = sys::bind(Path::new("/dev/null"), &l.r(p), libc::MS_RDONLY);
        }
    }
    Ok(())
}

/// Mounts `/sys` read-only, the machine's own cgroup at `/sys/fs/cgroup`, and the view of
/// its CPUs and memory (see [`crate::view`]), whose write descriptor it returns. What
/// would name host files (loop devices' backing files, firmware) is hidden.
fn mount_sys(l: &Layers, cg: &MachineCgroup, cpus: Option<&[usize]>) -> Result<OwnedFd, JailError> {
    mkdir(&l.r("sys"))?;
    sys::mount(
        Some("sysfs"),
        &l.r("sys"),
        Some("sysfs"),
        NODEV | libc::MS_RDONLY,
        None,
    )
    .map_err(step("mount /sys"))?;
    sys::mount(
        Some("cgroup-root"),
        &l.r("sys/fs/cgroup"),
        Some("tmpfs"),
        NODEV,
        Some("mode=755,size=64k"),
    )
    .map_err(step("mount /sys/fs/cgroup"))?;
    for (host, inside) in cg.binds() {
        mkdir(&l.root.join(&inside))?;
        sys::bind(&host, &l.root.join(&inside), 0)
            .map_err(step(format!("bind the cgroup {}", host.display())))?;
    }
    let view = crate::view::mount(&l.dir, &l.root, cpus)?;
    // The host's loop devices name their backing files (every machine's disk image, every
    // volume's) in sysfs, and `mount` would show them: the machine sees no block device.
    for hidden in ["sys/devices/virtual/block", "sys/firmware"] {
        if l.r(hidden).exists() {
            let _ = sys::mount(
                Some("none"),
                &l.r(hidden),
                Some("tmpfs"),
                NODEV | libc::MS_RDONLY,
                Some("size=4k"),
            );
        }
    }
    Ok(view)
}

/// Mounts a minimal `/dev`: the harmless host devices bound in, a private `devpts`, a
/// sized `/dev/shm`, and the usual links.
fn mount_dev(l: &Layers, spec: &JailSpec) -> Result<(), JailError> {
    let dev = l.r("dev");
    mkdir(&dev)?;
    sys::mount(
        Some("dev"),
        &dev,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=755,size=64k"),
    )
    .map_err(step("mount /dev"))?;
    for d in ["null", "zero", "full", "random", "urandom", "tty"] {
        let t = dev.join(d);
        fs::File::create(&t).map_err(step(format!("create /dev/{d}")))?;
        sys::bind(&Path::new("/dev").join(d), &t, 0).map_err(step(format!("bind /dev/{d}")))?;
    }
    mkdir(&l.r("dev/pts"))?;
    sys::mount(
        Some("devpts"),
        &l.r("dev/pts"),
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )
    .map_err(step("mount /dev/pts"))?;
    mkdir(&l.r("dev/shm"))?;
    let (_, shm_mb) = tmpfs_sizes(spec.memory_mb);
    sys::mount(
        Some("shm"),
        &l.r("dev/shm"),
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&format!("{},size={shm_mb}m", owned_by_root(spec))),
    )
    .map_err(step("mount /dev/shm"))?;
    for (link, to) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(to, dev.join(link))
            .map_err(step(format!("link /dev/{link}")))?;
    }
    Ok(())
}

/// Mounts `/tmp`, a tmpfs sized from the machine's memory.
fn mount_tmp(l: &Layers, spec: &JailSpec) -> Result<(), JailError> {
    mkdir(&l.r("tmp"))?;
    let (tmp_mb, _) = tmpfs_sizes(spec.memory_mb);
    sys::mount(
        Some("tmp"),
        &l.r("tmp"),
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&format!("{},size={tmp_mb}m", owned_by_root(spec))),
    )
    .map_err(step("mount /tmp"))
}

/// Pivots into the machine's root, in a mount namespace of its own so pivoting does not
/// move the shim's root.
fn pivot(l: &Layers) -> Result<(), JailError> {
    sys::unshare(libc::CLONE_NEWNS).map_err(step("unshare the mount namespace"))?;
    std::env::set_current_dir(&l.root).map_err(step("enter the root"))?;
    sys::pivot_to_cwd().map_err(step("pivot into the root"))
}

/// The flags of the pseudo-filesystems no program runs from.
const NODEV: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;

fn mkdir(p: &Path) -> Result<(), JailError> {
    fs::create_dir_all(p).map_err(step(format!("create {}", p.display())))
}

/// tmpfs options making its root directory the machine's root's, world-writable, sticky.
fn owned_by_root(spec: &JailSpec) -> String {
    let base = spec.uid_base;
    format!("mode=1777,uid={base},gid={base}")
}

/// The sizes of `/tmp` and `/dev/shm` (MiB) of a machine with `memory_mb` of memory.
/// tmpfs pages are charged to the machine's memory and cannot be reclaimed (no swap):
/// together /tmp (half the memory) and /dev/shm (a quarter, at most 64 MiB) leave a
/// quarter for the processes, so filling them ends in ENOSPC, not in an OOM kill.
fn tmpfs_sizes(memory_mb: u64) -> (u64, u64) {
    ((memory_mb / 2).clamp(8, 1024), (memory_mb / 4).clamp(4, 64))
}

/// The size of a writable layer in memory ([`Scratch::Memory`], MiB): as `/tmp`'s, half the
/// memory, and never more than the disk it stands for.
fn scratch_mb(spec: &JailSpec) -> u64 {
    tmpfs_sizes(spec.memory_mb).0.min(spec.disk_mb.max(8))
}

/// Binds `spec.binds` into the machine's root (see [`crate::machine::BindMount`]).
fn mount_binds(spec: &JailSpec, root: &Path, userns: &OwnedFd) -> Result<(), JailError> {
    for b in &spec.binds {
        let target = root.join(target_rel(&b.target)?);
        // Created as the machine's root, so the directory is root's inside.
        sys::with_fs_ids(spec.uid_base, || fs::create_dir_all(&target))
            .and_then(|r| r)
            .map_err(step(format!("create {}", b.target.display())))?;
        sys::idmapped_bind(&b.source, &target, userns.as_raw_fd(), b.read_only).map_err(step(
            format!("bind {} at {}", b.source.display(), b.target.display()),
        ))?;
    }
    Ok(())
}

/// Mounts `spec.mounts` in the machine's root (see [`crate::machine::OverlayMount`]). Runs
/// in the machine's directory: the layers are named relative to it.
fn mount_overlays(spec: &JailSpec, root: &Path, userns: &OwnedFd) -> Result<(), JailError> {
    for (i, m) in spec.mounts.iter().enumerate() {
        let p = m.parts()?;
        let lower = PathBuf::from(format!("mnt{i}-lower"));
        let rw_at = PathBuf::from(format!("mnt{i}-rw"));
        for d in [&lower, &rw_at] {
            fs::create_dir_all(d).map_err(step(format!("create {}", d.display())))?;
        }
        sys::idmapped_bind(&m.lower, &lower, userns.as_raw_fd(), true)
            .map_err(step(format!("id-map {}", m.lower.display())))?;
        sys::idmapped_bind(p.rw, &rw_at, userns.as_raw_fd(), false)
            .map_err(step(format!("id-map {}", p.rw.display())))?;
        mount_overlay_at(
            &lower,
            &rw_at.join(p.upper),
            &rw_at.join(p.work),
            &root.join(p.rel),
            &m.target,
            spec.uid_base,
        )?;
    }
    Ok(())
}

/// Mounts the overlay `lower` + `upper` (+ `work`) at `target` with the machine's
/// filesystem ids (`base`), creating `target` as the machine's root.
pub(super) fn mount_overlay_at(
    lower: &Path,
    upper: &Path,
    work: &Path,
    target: &Path,
    shown: &Path,
    base: u32,
) -> Result<(), JailError> {
    sys::with_fs_ids(base, || fs::create_dir_all(target))
        .and_then(|r| r)
        .map_err(step(format!("create {}", shown.display())))?;
    mount_run_layers(
        lower,
        upper,
        work,
        target,
        libc::MS_NODEV | libc::MS_NOSUID,
        base,
    )
    .map_err(step(format!("mount the overlay at {}", shown.display())))
}
