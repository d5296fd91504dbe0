//! The jail measured directly (the node, as the server uses it), the phases of its start
//! that can be timed from outside, and peers doing the same start on the same root
//! filesystem.
//!
//! Owns the machines and child processes it starts: each machine sits in a [`MachineGuard`]
//! that destroys it when dropped, whatever went wrong.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use locker_proto::ExecSpec;
use locker_runtime::node::{Machine, MachineSpec, Node, NodeConfig};
use locker_tests::{agent_bin, default_rootfs, locker_bin, unique, TempDir};

use crate::stats::{percentile, tail_note, Row, Target};
use crate::{check_stop, Args};

pub const CREATE_TRUE: &str = "jail create→true";
pub const EXEC_TRUE: &str = "jail exec true (warm)";
pub const BWRAP: &str = "peer bwrap true";
pub const HOST_SPAWN: &str = "peer host spawn true";

/// A machine destroyed on drop unless [`MachineGuard::destroyed`] was called.
struct MachineGuard<'a> {
    node: &'a Node,
    machine: Option<Machine>,
}

impl MachineGuard<'_> {
    fn m(&self) -> &Machine {
        self.machine.as_ref().expect("a machine until destroyed")
    }

    /// The machine was destroyed the normal way; nothing is left to do.
    fn destroyed(mut self) {
        self.machine = None;
    }
}

impl Drop for MachineGuard<'_> {
    fn drop(&mut self) {
        if let Some(m) = self.machine.take() {
            if let Err(e) = locker_runtime::machine::destroy(&m.id, &m.dir, self.node.layout()) {
                eprintln!("cleanup: destroying machine {} failed: {e}", m.id);
            }
        }
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn true_spec() -> ExecSpec {
    ExecSpec {
        call_id: unique("bench").replace('-', "_"),
        argv: vec!["true".into()],
        max_output_bytes: 65_536,
        timeout_ms: Some(30_000),
        ..Default::default()
    }
}

/// The spec the brief fixes: the default template, 1 CPU, 512 MB, a 2048 MB disk.
fn spec(dir: &Path, rootfs: &Path) -> MachineSpec {
    let id = unique("bench").replace('-', "_");
    MachineSpec {
        id: id.clone(),
        dir: dir.join(&id),
        template_rootfs: rootfs.to_owned(),
        cpus: 1.0,
        memory_mb: 512,
        disk_mb: 2048,
        pids: 1024,
    }
}

async fn exec_true(m: &Machine) -> anyhow::Result<locker_types::ExecResult> {
    let r = m
        .agent
        .exec(true_spec(), None, None)
        .await
        .with_context(|| format!("exec `true` in {}", m.id))?;
    if r.exit_code != Some(0) {
        bail!("`true` in machine {} did not exit 0: {r:?}", m.id);
    }
    Ok(r)
}

pub async fn jail_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let node = Node::new(NodeConfig {
        init_exe: locker_bin(),
        shim_exe: locker_runtime::node::find_shim(&locker_bin()),
        agent_exe: agent_bin(),
    })
    .context("a node on this host (run as root, cgroups mounted)")?;
    let rootfs = default_rootfs();
    let tmp = TempDir::new("locker-bench-jail");
    let machines = tmp.path().join("machines");

    // Create → first command → destroy, one machine at a time.
    let (warm, n) = (args.create_warmup(), args.creates());
    let (mut create, mut create_true, mut first, mut destroy) = (vec![], vec![], vec![], vec![]);
    for i in 0..warm + n {
        check_stop()?;
        let t0 = Instant::now();
        let m = node
            .create(spec(&machines, &rootfs))
            .await
            .context("create a machine")?;
        let t_created = ms(t0);
        let g = MachineGuard {
            node: &node,
            machine: Some(m),
        };
        let t1 = Instant::now();
        exec_true(g.m()).await?;
        let (t_first, t_total) = (ms(t1), ms(t0));
        let t2 = Instant::now();
        node.destroy(g.m()).await.context("destroy a machine")?;
        let t_destroy = ms(t2);
        g.destroyed();
        if i >= warm {
            create.push(t_created);
            first.push(t_first);
            create_true.push(t_total);
            destroy.push(t_destroy);
        }
    }
    println!(
        "  {CREATE_TRUE}: p50 {:.2} ms (create {:.2} + first exec {:.2}), destroy p50 {:.2} ms",
        percentile(&create_true, 50.0),
        percentile(&create, 50.0),
        percentile(&first, 50.0),
        percentile(&destroy, 50.0)
    );
    rows.push(
        Row::new(CREATE_TRUE, "ms", create_true, warm)
            .note("Node::create (default template, 1 cpu, 512 MB, 2048 MB disk) + AgentClient::exec([\"true\"]) done, one machine at a time")
            .note("includes spawning the shim (locker __jail-init), user ns, cgroup, the 2048 MB disk (a copy of the cached blank ext4 image; mkfs only for the first machine of a size, in the warm-up), loop attach + mounts, agent exec and connect")
            .note("namespaces only: KVM or TCG emulation does not matter for the jail")
            .target(Target::P50(15.0))
            .vs(BWRAP),
    );
    rows.push(
        Row::new("jail create (Node::create)", "ms", create, warm)
            .note("until the agent answered Hello; part of the row above"),
    );
    rows.push(
        Row::new("jail first exec true", "ms", first, warm)
            .note("the first command in a new machine; part of the row above"),
    );
    rows.push(Row::new("jail destroy", "ms", destroy, warm).note("Node::destroy: SIGKILL PID 1, empty and remove the cgroup, wait for the shim and the loop device to go, rm -r the machine dir (disk image)"));

    // Creates in a row, none destroyed in between (a server filling up): the kernel's
    // asynchronous teardown of the previous machine does not overlap these.
    check_stop()?;
    let k = n.min(25);
    let mut kept = Vec::with_capacity(k);
    let mut in_a_row = Vec::with_capacity(k);
    for _ in 0..k {
        check_stop()?;
        let t0 = Instant::now();
        let m = node
            .create(spec(&machines, &rootfs))
            .await
            .context("create a machine")?;
        let g = MachineGuard {
            node: &node,
            machine: Some(m),
        };
        exec_true(g.m()).await?;
        in_a_row.push(ms(t0));
        kept.push(g);
    }
    for g in kept {
        node.destroy(g.m()).await.context("destroy a machine")?;
        g.destroyed();
    }
    println!(
        "  {CREATE_TRUE}, {k} in a row without destroys: p50 {:.2} ms",
        percentile(&in_a_row, 50.0)
    );
    rows.push(
        Row::new(format!("{CREATE_TRUE} ({k} kept, no destroy between)"), "ms", in_a_row, 0)
            .note("the same create + first exec, but machines are kept and destroyed only after the last one: no teardown of the previous machine runs beside the create")
            .target(Target::P50(15.0))
            .vs(BWRAP),
    );

    // Exec in one warm machine.
    check_stop()?;
    let (warm, n) = (args.warmup, args.fast());
    let m = node
        .create(spec(&machines, &rootfs))
        .await
        .context("create a machine")?;
    let g = MachineGuard {
        node: &node,
        machine: Some(m),
    };
    let (mut exec, mut agent_start, mut agent_run) = (vec![], vec![], vec![]);
    for i in 0..warm + n {
        check_stop()?;
        let t0 = Instant::now();
        let r = exec_true(g.m()).await?;
        let t = ms(t0);
        if i >= warm {
            exec.push(t);
            agent_start.push(r.timings.start_ms);
            agent_run.push(r.timings.run_ms);
        }
    }
    node.destroy(g.m()).await.context("destroy a machine")?;
    g.destroyed();
    let (s50, r50) = (percentile(&agent_start, 50.0), percentile(&agent_run, 50.0));
    let tail = tail_note(&exec, &agent_start);
    println!(
        "  {EXEC_TRUE}: p50 {:.2} ms (agent-reported start {s50:.2} + run {r50:.2})",
        percentile(&exec, 50.0)
    );
    rows.push(
        Row::new(EXEC_TRUE, "ms", exec, warm)
            .note("AgentClient::exec([\"true\"]) round trip over the agent socket, client on a 2-worker tokio runtime")
            .note(format!("agent-reported p50: start {s50:.2} ms (cgroup + fork/exec) + run {r50:.2} ms; the rest is the socket, framing and wake-ups"))
            .note(tail)
            .target(Target::P50(2.0))
            .vs(HOST_SPAWN),
    );

    // Phases of a start that can be timed from outside, on the same files.
    check_stop()?;
    rows.extend(disk_rows(tmp.path(), args)?);
    rows.push(cgroup_move_row(args)?);
    // What the node starts a machine's shim from: `locker-jail` of the same build, else
    // `locker` itself (through the alias: see `locker_alias`).
    let shim = locker_runtime::node::find_shim(&locker_bin());
    let size_mb = std::fs::metadata(&shim).map(|m| m.len() >> 20).unwrap_or(0);
    let (exe, arg) = if shim == locker_bin() {
        (locker_alias(tmp.path())?, "--version")
    } else {
        (shim.clone(), "--build-id")
    };
    let name = shim.file_name().unwrap_or_default().to_string_lossy();
    let note = format!("fork+exec+exit of the {size_mb} MB {name} binary the shim runs as ({arg}): the floor of the shim's own start");
    rows.push(spawn_row(
        "phase spawn the shim's binary",
        &exe,
        &[arg],
        args,
        &note,
    )?);
    Ok(())
}

/// A symlink `dir/locker-cli` to the `locker` binary, for runs of the CLI by the bench. The
/// tests' orphan reaper (this process is a child subreaper) reaps zombie children whose
/// command name is `locker` (orphaned shims); a CLI child exec'd under that name could be
/// reaped before `wait` sees it (ECHILD). Exec'd through this link its name is `locker-cli`.
pub fn locker_alias(dir: &Path) -> anyhow::Result<PathBuf> {
    let p = dir.join("locker-cli");
    if !p.exists() {
        std::os::unix::fs::symlink(locker_bin(), &p)
            .with_context(|| format!("symlink {}", p.display()))?;
    }
    Ok(p)
}

/// The machine's disk as the shim makes it: a copy of the cached blank image of that size
/// (`disk::make_from_blank`), and what making that blank costs once per size (`disk::make`,
/// i.e. `mkfs.ext4`). Both through the runtime's own functions.
fn disk_rows(dir: &Path, args: &Args) -> anyhow::Result<Vec<Row>> {
    let (warm, n) = (args.create_warmup(), args.creates());
    let img = dir.join("phase-disk.img");
    let blanks = locker_runtime::machine::blank_disks_dir();
    let (mut copy, mut mkfs) = (vec![], vec![]);
    for i in 0..warm + n {
        check_stop()?;
        let _ = std::fs::remove_file(&img);
        let t0 = Instant::now();
        locker_runtime::disk::make_from_blank(&img, 2048, &blanks)
            .context("make a disk from the blank image")?;
        let t_copy = ms(t0);
        std::fs::remove_file(&img)?;
        let t0 = Instant::now();
        locker_runtime::disk::make(&img, 2048).context("mkfs.ext4 a disk image")?;
        let t_mkfs = ms(t0);
        std::fs::remove_file(&img)?;
        if i >= warm {
            copy.push(t_copy);
            mkfs.push(t_mkfs);
        }
    }
    let how = if reflinks(dir, &blanks) {
        "reflink (FICLONE) works here"
    } else {
        "no reflink here: a sparse copy of the allocated extents, then fsync"
    };
    Ok(vec![
        Row::new("phase disk from blank 2048 MB", "ms", copy, warm)
            .note(format!("disk::make_from_blank as at every machine start: a copy of {}/blank-ext4-2048m.img; {how}", blanks.display())),
        Row::new("phase mkfs.ext4 2048 MB", "ms", mkfs, warm)
            .note("disk::make (truncate + mkfs.ext4 with the runtime's flags): paid once per disk size, when the blank image is made"),
    ])
}

/// Whether a reflink copy from the blank images' directory to `dir` works.
fn reflinks(dir: &Path, blanks: &Path) -> bool {
    let (a, b) = (
        blanks.join(format!(".bench-reflink-{}", std::process::id())),
        dir.join("reflink-probe"),
    );
    let ok = std::fs::write(&a, b"x").is_ok()
        && matches!(
            locker_runtime::disk::copy(&a, &b),
            Ok(locker_runtime::disk::CopyKind::Reflink)
        );
    let _ = std::fs::remove_file(&a);
    let _ = std::fs::remove_file(&b);
    ok
}

/// Moving a new process into a new cgroup after the host's cgroups were quiet for 50 ms,
/// as a machine's PID 1 does at every start: the first such move pays for an RCU grace
/// period (the kernel's `cgroup_threadgroup_rwsem` write side); later ones in quick
/// succession are cheap, which is why warm execs do not show it.
fn cgroup_move_row(args: &Args) -> anyhow::Result<Row> {
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let parent = if v2 {
        PathBuf::from("/sys/fs/cgroup")
    } else {
        PathBuf::from("/sys/fs/cgroup/pids")
    };
    let (warm, n) = (args.create_warmup(), args.creates());
    let mut s = vec![];
    for i in 0..warm + n {
        check_stop()?;
        std::thread::sleep(std::time::Duration::from_millis(50));
        let dir = parent.join(unique("locker-bench-cg"));
        std::fs::create_dir(&dir)
            .with_context(|| format!("create the cgroup {}", dir.display()))?;
        let moved = time_first_move(&dir.join("cgroup.procs"));
        // The child is reaped, but the kernel may list it for a moment longer.
        for _ in 0..100 {
            if std::fs::remove_dir(&dir).is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let t = moved?;
        if i >= warm {
            s.push(t);
        }
    }
    let what = if v2 {
        "cgroup v2"
    } else {
        "cgroup v1 (pids hierarchy; the first controller written pays, the others are ~0.02 ms)"
    };
    Ok(Row::new("phase first cgroup move", "ms", s, warm).note(format!("write(\"0\") to cgroup.procs of a new cgroup by a fresh child, 50 ms after the last move, {what}")))
}

/// Forks a child that moves itself into the cgroup whose `cgroup.procs` is `procs` and
/// reports how long the write took.
fn time_first_move(procs: &Path) -> anyhow::Result<f64> {
    use std::io::Read;
    use std::os::fd::{AsRawFd, FromRawFd};
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(procs)
        .with_context(|| format!("open {}", procs.display()))?;
    let mut p = [0i32; 2];
    // SAFETY: pipe2 fills the two-int array we own.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        bail!("pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: fresh descriptors from pipe2, each owned once.
    let (mut r, w) = unsafe {
        (
            std::fs::File::from_raw_fd(p[0]),
            std::fs::File::from_raw_fd(p[1]),
        )
    };
    // SAFETY: the child only calls async-signal-safe functions (clock_gettime, write,
    // _exit) on descriptors opened before the fork, so forking a threaded process is sound.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: as above; the buffers live on the child's stack.
        unsafe {
            let mut t0: libc::timespec = std::mem::zeroed();
            let mut t1: libc::timespec = std::mem::zeroed();
            libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t0);
            let ok = libc::write(f.as_raw_fd(), b"0".as_ptr().cast(), 1) == 1;
            libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t1);
            let ns: i64 = if ok {
                (t1.tv_sec - t0.tv_sec) * 1_000_000_000 + (t1.tv_nsec - t0.tv_nsec)
            } else {
                -1
            };
            libc::write(w.as_raw_fd(), (&ns as *const i64).cast(), 8);
            libc::_exit(0);
        }
    }
    if pid < 0 {
        bail!("fork: {}", std::io::Error::last_os_error());
    }
    drop(w);
    drop(f);
    let mut b = [0u8; 8];
    let got = r.read_exact(&mut b);
    let mut status = 0;
    // SAFETY: waiting for the child forked above.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    got.context("read the child's timing")?;
    let ns = i64::from_ne_bytes(b);
    if ns < 0 {
        bail!("the child could not move itself into {}", procs.display());
    }
    Ok(ns as f64 / 1e6)
}

/// Spawning a program and waiting for it, `n` times.
fn spawn_row(
    name: &str,
    prog: &Path,
    argv: &[&str],
    args: &Args,
    note: &str,
) -> anyhow::Result<Row> {
    let (warm, n) = (args.warmup, args.fast());
    let mut s = vec![];
    for i in 0..warm + n {
        check_stop()?;
        let t0 = Instant::now();
        let st = Command::new(prog)
            .args(argv)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .with_context(|| format!("run {}", prog.display()))?;
        if !st.success() {
            bail!("{} {argv:?} failed: {st}", prog.display());
        }
        if i >= warm {
            s.push(ms(t0));
        }
    }
    Ok(Row::new(name, "ms", s, warm).note(note))
}

pub(crate) fn which(prog: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(prog))
            .find(|p| p.is_file())
    })
}

/// bwrap, installed with apt-get when missing (as the brief allows).
pub(crate) fn bwrap() -> Result<PathBuf, String> {
    if let Some(p) = which("bwrap") {
        return Ok(p);
    }
    println!("  bwrap is missing: apt-get install -y bubblewrap");
    let st = Command::new("apt-get")
        .args(["install", "-y", "bubblewrap"])
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("apt-get: {e}"))?;
    if !st.success() {
        return Err(format!("apt-get install -y bubblewrap failed ({st})"));
    }
    which("bwrap").ok_or_else(|| "bwrap still not on PATH after installing bubblewrap".into())
}

pub fn peer_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let rootfs = default_rootfs();
    let root = rootfs
        .to_str()
        .context("the template path is not UTF-8")?
        .to_owned();
    match bwrap() {
        Ok(b) => {
            let argv = [
                "--unshare-all",
                "--die-with-parent",
                "--ro-bind",
                &root,
                "/",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "true",
            ];
            let r = spawn_row(BWRAP, &b, &argv, args, "bwrap --unshare-all --die-with-parent --ro-bind <default template> / --proc /proc --dev /dev true; no cgroup, no disk, no seccomp, no agent")?;
            println!("  {BWRAP}: p50 {:.2} ms", r.p(50.0));
            rows.push(r);
        }
        Err(e) => rows.push(Row::skipped(BWRAP, e)),
    }
    check_stop()?;
    match which("runsc") {
        Some(runsc) => {
            let r = spawn_row(
                "peer gVisor runsc do true",
                &runsc,
                &["--network=none", "do", "true"],
                args,
                "runsc --network=none do true: the host's root filesystem, gVisor's default platform (ptrace/systrap), no network like Locker's default egress",
            )?;
            println!("  peer gVisor runsc do true: p50 {:.2} ms", r.p(50.0));
            rows.push(r.vs(BWRAP));
        }
        None => rows.push(Row::skipped(
            "peer gVisor runsc do true",
            "runsc is not installed on this host (not installed by the bench)",
        )),
    }
    check_stop()?;
    let t = which("true").context("`true` is not on PATH")?;
    let r = spawn_row(
        HOST_SPAWN,
        &t,
        &[],
        args,
        "fork+exec+wait of /usr/bin/true on the host, no isolation: the floor of any exec",
    )?;
    println!("  {HOST_SPAWN}: p50 {:.2} ms", r.p(50.0));
    rows.push(r);
    Ok(())
}
