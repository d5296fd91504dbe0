//! Many sandboxes at once: a burst of concurrent creates (time to first command under load)
//! and density (how much memory and disk an idle sandbox holds, so how many fit), each
//! beside `bwrap` doing the same on the same root filesystem.
//!
//! Owns the servers (the tests' [`Server`] guard deletes every sandbox and kills the server
//! on drop) and the `bwrap` processes it starts ([`Procs`] kills and waits for them on drop).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::Context;
use locker_tests::default_rootfs;
use locker_tests::server::{rss_kib, Api, Server};

use crate::host::meminfo_kib;
use crate::jail::bwrap;
use crate::server::{create, delete, http_exec, HTTP_CREATE_EXEC, HTTP_EXEC};
use crate::stats::{percentile, Row, Target};
use crate::{check_stop, stopping, Args};

pub const BURST_BWRAP: &str = "peer bwrap true (burst, all at once)";
const DENSITY_LOCKER: &str = "density Locker: memory per idle sandbox (accounted)";
const DENSITY_LOCKER_AVAIL: &str = "density Locker: MemAvailable drop per idle sandbox";
const DENSITY_BWRAP: &str = "density bwrap: memory per idle sandbox (accounted)";
const DENSITY_BWRAP_AVAIL: &str = "density bwrap: MemAvailable drop per idle sandbox";
const DENSITY_BWRAP_FIT: &str = "density bwrap: idle sandboxes that fit (extrapolated)";

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Runs `f(i)` for `i` in `0..n` on `n` threads released together by a barrier; returns the
/// results in order and the wall time from the release until the last one finished.
pub fn all_at_once<T: Send + 'static>(
    n: usize,
    f: impl Fn(usize) -> T + Send + Sync + 'static,
) -> (Vec<T>, f64) {
    let f = Arc::new(f);
    let gate = Arc::new(Barrier::new(n + 1));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (f, gate) = (f.clone(), gate.clone());
            std::thread::spawn(move || {
                gate.wait();
                f(i)
            })
        })
        .collect();
    gate.wait();
    let t0 = Instant::now();
    let out: Vec<T> = threads
        .into_iter()
        .map(|t| t.join().expect("a burst thread panicked"))
        .collect();
    (out, ms(t0))
}

/// `(successful latencies, error count, the first errors)` of a burst's outcomes.
fn split(outcomes: &[Result<f64, String>]) -> (Vec<f64>, usize, Vec<String>) {
    let ok: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.as_ref().ok().copied())
        .collect();
    let errs: Vec<String> = outcomes
        .iter()
        .filter_map(|o| o.as_ref().err().cloned())
        .collect();
    let first = errs.iter().take(3).cloned().collect();
    (ok, errs.len(), first)
}

/// The quota flags of a server that holds `n` default sandboxes (512 MB of memory and a
/// 2048 MB sparse disk each) at once. The disk quota counts each disk's full size, so the
/// default (the data dir's filesystem) would stop a fill of a thousand long before the
/// disk does.
pub fn big_quotas(n: usize) -> Vec<String> {
    let sandboxes = (n + 10).max(200);
    let mem = ((n as u64 + 10) * 512).max(200_000);
    let disk = ((n as u64 + 10) * 2048).max(500_000);
    vec![
        "--quota-sandboxes".into(),
        sandboxes.to_string(),
        "--quota-memory-mb".into(),
        mem.to_string(),
        "--quota-runs".into(),
        sandboxes.to_string(),
        "--quota-disk-mb".into(),
        disk.to_string(),
    ]
}

fn start_server(n: usize) -> Server {
    let q = big_quotas(n);
    let q: Vec<&str> = q.iter().map(String::as_str).collect();
    Server::start_with(&q)
}

/// The `bwrap` argv (after the program) of the peers: the default template read-only as
/// `/`, every namespace unshared, then `cmd`.
pub fn bwrap_argv(root: &str, extra: &[&str], cmd: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--unshare-all",
        "--die-with-parent",
        "--ro-bind",
        root,
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v.extend(cmd.iter().map(|s| s.to_string()));
    v
}

/// Spawns `prog argv` and waits for it; its wall time in ms, or why it failed.
pub fn spawn_wait(prog: &Path, argv: &[String]) -> Result<f64, String> {
    let t0 = Instant::now();
    let st = Command::new(prog)
        .args(argv)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("run {}: {e}", prog.display()))?;
    if !st.status.success() {
        return Err(format!(
            "{} failed ({}): {}",
            prog.display(),
            st.status,
            String::from_utf8_lossy(&st.stderr).trim()
        ));
    }
    Ok(ms(t0))
}

pub fn burst_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let n = args.burst.max(1);
    let srv = start_server(n);
    let api = srv.api();
    // Warm-up, excluded: the blank disk image of the size is cached and the server is warm.
    for _ in 0..args.create_warmup() {
        check_stop()?;
        let id = create(&api)?;
        http_exec(&api, &id)?;
        delete(&api, &id)?;
    }
    check_stop()?;
    let (url, key) = (srv.url.clone(), srv.api_key.clone());
    let (outcomes, wall) = all_at_once(n, move |_| {
        // One client (and connection) per thread, as n independent callers.
        let api = Api::new(&url, Some(&key));
        if stopping() {
            return (Err("interrupted".to_owned()), None);
        }
        let t0 = Instant::now();
        let id = match create(&api) {
            Ok(id) => id,
            Err(e) => return (Err(format!("create: {e:#}")), None),
        };
        match http_exec(&api, &id) {
            Ok(_) => (Ok(ms(t0)), Some(id)),
            Err(e) => (Err(format!("exec: {e:#}")), Some(id)),
        }
    });
    let ids: Vec<String> = outcomes.iter().filter_map(|o| o.1.clone()).collect();
    let outcomes: Vec<Result<f64, String>> = outcomes.into_iter().map(|o| o.0).collect();
    let (lat, errors, first) = split(&outcomes);
    // Delete them all at once too (timed), then nothing is left for the guard.
    let (url, key) = (srv.url.clone(), srv.api_key.clone());
    let del_ids = Arc::new(ids);
    let d = del_ids.clone();
    let (deletes, del_wall) = all_at_once(d.len(), move |i| {
        let api = Api::new(&url, Some(&key));
        let t0 = Instant::now();
        delete(&api, &d[i])
            .map(|()| ms(t0))
            .map_err(|e| format!("{e:#}"))
    });
    let (del_lat, del_errors, del_first) = split(&deletes);
    println!(
        "  burst of {n} create→exec at once: {} ok, {errors} errors, p50 {:.1} ms p99 {:.1} ms, all done in {wall:.0} ms; deleting them at once took {del_wall:.0} ms",
        lat.len(),
        percentile(&lat, 50.0),
        percentile(&lat, 99.0)
    );
    check_stop()?;

    // The peer: n bwrap starts at once on the same root filesystem.
    let root = default_rootfs();
    let root = root
        .to_str()
        .context("the template path is not UTF-8")?
        .to_owned();
    let peer = match bwrap() {
        Ok(b) => {
            let argv = bwrap_argv(&root, &[], &["true"]);
            for _ in 0..args.warmup {
                let _ = spawn_wait(&b, &argv);
            }
            let (o, peer_wall) = all_at_once(n, move |_| spawn_wait(&b, &argv));
            let (pl, pe, pf) = split(&o);
            println!(
                "  {BURST_BWRAP}: p50 {:.1} ms p99 {:.1} ms, all done in {peer_wall:.0} ms, {pe} errors",
                percentile(&pl, 50.0),
                percentile(&pl, 99.0)
            );
            let mut r = Row::new(BURST_BWRAP, "ms", pl, args.warmup).note(format!(
                "{n} threads released together, each spawning `bwrap --unshare-all … --ro-bind <default template> / … true` and waiting for it; all done in {peer_wall:.0} ms; {pe} errors"
            ));
            if !pf.is_empty() {
                r = r.note(format!("first errors: {}", pf.join(" | ")));
            }
            r
        }
        Err(e) => Row::skipped(BURST_BWRAP, e),
    };

    let tti = format!("burst TTI create→exec true ({n} at once)");
    let mut r = Row::new(tti.clone(), "ms", lat, args.create_warmup())
        .note(format!("{n} threads released together, one HTTP client each: POST /v1/sandboxes {{}} then POST exec true, each until answered; {errors} of {n} failed; server quotas {}", big_quotas(n).join(" ")))
        .note(format!("all {n} done {wall:.0} ms after the release (the `burst wall time` row); {} warm-up create→exec→delete before, excluded", args.create_warmup()))
        .vs(HTTP_CREATE_EXEC)
        .vs(BURST_BWRAP);
    if !first.is_empty() {
        r = r.note(format!("first errors: {}", first.join(" | ")));
    }
    rows.push(r);
    rows.push(
        Row::new(
            format!("burst wall time ({n} create→exec at once)"),
            "ms",
            vec![wall],
            0,
        )
        .note("from the release of the threads until the last sandbox ran `true`"),
    );
    let mut e = Row::new(
        format!("burst errors ({n} at once)"),
        "count",
        vec![errors as f64],
        0,
    )
    .note("creates or first execs that failed (expected 0)");
    if !first.is_empty() {
        e = e.note(format!("first errors: {}", first.join(" | ")));
    }
    rows.push(e);
    let mut d = Row::new(format!("burst HTTP delete ({} at once)", del_ids.len()), "ms", del_lat, 0)
        .note(format!("DELETE of every sandbox of the burst, all released together; all done in {del_wall:.0} ms; {del_errors} errors"));
    if !del_first.is_empty() {
        d = d.note(format!("first errors: {}", del_first.join(" | ")));
    }
    rows.push(d);
    rows.push(peer);
    drop(srv);
    Ok(())
}

/// What the host holds at one moment, in KiB: `MemAvailable`, and the kernel's memory that
/// cannot be reclaimed (`SUnreclaim` + `KernelStack` + `PageTables`), where namespaces,
/// mounts, sockets and kernel threads of idle sandboxes live.
#[derive(Debug, Clone, Copy)]
struct Mem {
    avail: f64,
    kernel: f64,
}

/// The median of 5 readings 100 ms apart, after the host settled for `settle`.
fn mem_reading(settle: Duration) -> Mem {
    std::thread::sleep(settle);
    let (mut a, mut k) = (Vec::new(), Vec::new());
    for i in 0..5 {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
        a.push(meminfo_kib("MemAvailable") as f64);
        k.push(
            (meminfo_kib("SUnreclaim") + meminfo_kib("KernelStack") + meminfo_kib("PageTables"))
                as f64,
        );
    }
    a.sort_by(f64::total_cmp);
    k.sort_by(f64::total_cmp);
    Mem {
        avail: a[2],
        kernel: k[2],
    }
}

/// Reads a number from a cgroup file.
fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// Memory of machine `id`'s own cgroup in bytes: (all of it, the kernel's part of it).
/// v1: `memory.usage_in_bytes` and `memory.kmem.usage_in_bytes` of its cgroup under `memory`;
/// v2: `memory.current` and the `kernel` line of its `memory.stat`.
fn cgroup_memory(id: &str) -> Option<(u64, u64)> {
    let v1 = locker_tests::machine_cgroup(Path::new("/sys/fs/cgroup/memory"), id);
    if let Some((v1, all)) =
        v1.and_then(|d| read_u64(&d.join("memory.usage_in_bytes")).map(|a| (d, a)))
    {
        return Some((
            all,
            read_u64(&v1.join("memory.kmem.usage_in_bytes")).unwrap_or(0),
        ));
    }
    let v2 = locker_tests::machine_cgroup(Path::new("/sys/fs/cgroup"), id)?;
    let all = read_u64(&v2.join("memory.current"))?;
    let kernel = std::fs::read_to_string(v2.join("memory.stat"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("kernel ")?.trim().parse().ok())
        .unwrap_or(0);
    Some((all, kernel))
}

/// Bytes allocated on disk under `dir`, counting only files on `dir`'s own file system (a
/// machine's mounts, its root overlay and its loop-mounted disk, are not descended into).
fn allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fn walk(d: &Path, dev: u64, total: &mut u64) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            if m.dev() != dev {
                continue;
            }
            *total += m.blocks() * 512;
            if m.is_dir() {
                walk(&e.path(), dev, total);
            }
        }
    }
    let Ok(m) = dir.symlink_metadata() else {
        return 0;
    };
    let mut total = 0;
    walk(dir, m.dev(), &mut total);
    total
}

/// Free bytes of the file system holding `dir`.
fn free_bytes(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return 0;
    };
    // SAFETY: statvfs fills the zeroed struct we own from a valid C string.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return 0;
    }
    s.f_bavail as u64 * s.f_frsize as u64
}

/// The steps density fills the host in: `n` items in up to 10 steps.
fn steps(n: usize) -> Vec<usize> {
    let k = n.clamp(1, 10);
    (0..k).map(|i| (n * (i + 1)) / k - (n * i) / k).collect()
}

/// Per-item drop of MemAvailable (MB) of each step: the drop over the step divided by the
/// items it added.
fn per_item_mb(readings: &[Mem], sizes: &[usize]) -> Vec<f64> {
    readings
        .windows(2)
        .zip(sizes)
        .filter(|(_, &k)| k > 0)
        .map(|(w, &k)| (w[0].avail - w[1].avail) / 1024.0 / k as f64)
        .collect()
}

/// How many items of `per_mb` fit in `avail_mb` (NaN when the figure is not positive).
fn fit(avail_mb: f64, per_mb: f64) -> f64 {
    if per_mb > 0.0 {
        (avail_mb / per_mb).floor()
    } else {
        f64::NAN
    }
}

/// A host filled with idle items, step by step: the readings before and after each step.
struct Fill {
    readings: Vec<Mem>,
    sizes: Vec<usize>,
}

impl Fill {
    fn n(&self) -> usize {
        self.sizes.iter().sum()
    }
    fn first(&self) -> Mem {
        self.readings[0]
    }
    fn last(&self) -> Mem {
        self.readings[self.readings.len() - 1]
    }
    /// MemAvailable before the fill, MB.
    fn avail0_mb(&self) -> f64 {
        self.first().avail / 1024.0
    }
    /// The MemAvailable drop of each step per item, MB.
    fn drops(&self) -> Vec<f64> {
        per_item_mb(&self.readings, &self.sizes)
    }
    /// The whole fill's MemAvailable drop, MB.
    fn total_drop_mb(&self) -> f64 {
        (self.first().avail - self.last().avail) / 1024.0
    }
    /// Growth of the kernel's unreclaimable memory per item over the fill, MB.
    fn kernel_each_mb(&self) -> f64 {
        (self.last().kernel - self.first().kernel) / 1024.0 / self.n().max(1) as f64
    }
}

/// Host processes of each machine outside its cgroup (the shim, `locker __jail-init
/// <data>/sandboxes/<id>/jail.json`): their PSS in KiB, by machine id.
fn shim_pss_kib(machines: &Path) -> std::collections::HashMap<String, u64> {
    let prefix = machines.to_string_lossy().into_owned() + "/";
    let mut out = std::collections::HashMap::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        let Some(rest) = cmd.split('\0').find_map(|a| a.strip_prefix(&prefix)) else {
            continue;
        };
        let id = rest.split('/').next().unwrap_or_default().to_owned();
        *out.entry(id).or_default() += pss_kib(pid);
    }
    out
}

/// How long density watches its idle sandboxes' CPU.
const IDLE_WINDOW: Duration = Duration::from_secs(5);

/// CPU used over an idle window, each as a share of one core (%).
struct IdleCpu {
    server_pct: f64,
    shims_pct: f64,
    machines_pct: f64,
}

/// Watches the server `pid`, the shims of the machines under `machines` and the cgroups of
/// `ids` for `window` and says how much CPU each used.
fn idle_cpu(pid: u32, machines: &Path, ids: &[String], window: Duration) -> IdleCpu {
    let shims = |prefix: &str| -> f64 {
        procs_naming(prefix)
            .into_iter()
            .map(|p| proc_cpu_ms(p as u32))
            .sum()
    };
    let prefix = machines.to_string_lossy().into_owned() + "/";
    let cgroups = || -> f64 { ids.iter().filter_map(|id| cgroup_cpu_ms(id)).sum() };
    let (s0, h0, c0) = (proc_cpu_ms(pid), shims(&prefix), cgroups());
    let t0 = Instant::now();
    std::thread::sleep(window);
    let (s1, h1, c1) = (proc_cpu_ms(pid), shims(&prefix), cgroups());
    let wall = ms(t0);
    let pct = |a: f64, b: f64| 100.0 * (b - a).max(0.0) / wall;
    IdleCpu {
        server_pct: pct(s0, s1),
        shims_pct: pct(h0, h1),
        machines_pct: pct(c0, c1),
    }
}

/// User + system CPU time of a process so far, in ms (0 when it is gone).
pub fn proc_cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the command name.
    (ticks(11) + ticks(12)) * 1e3 / hz
}

/// Processes with an argument that starts with `prefix`.
fn procs_naming(prefix: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmd)
            .split('\0')
            .any(|a| a.starts_with(prefix))
        {
            out.push(pid);
        }
    }
    out
}

/// CPU used so far by machine `id`'s cgroup in ms: `cpuacct.usage` of its cgroup under
/// `cpuacct` (v1), or `usage_usec` of its `cpu.stat` (v2).
fn cgroup_cpu_ms(id: &str) -> Option<f64> {
    let root = Path::new("/sys/fs/cgroup");
    for v1 in ["cpuacct", "cpu,cpuacct"] {
        let ns = locker_tests::machine_cgroup(&root.join(v1), id)
            .and_then(|d| read_u64(&d.join("cpuacct.usage")));
        if let Some(ns) = ns {
            return Some(ns as f64 / 1e6);
        }
    }
    std::fs::read_to_string(locker_tests::machine_cgroup(root, id)?.join("cpu.stat"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|us| us / 1e3)
}

/// How many files process `pid` has open.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

const NOISE: &str = "the host is shared: other work moves MemAvailable too (by tens of MB while other sessions build or test), so per-step drops of a few MB per sandbox are near the noise; the accounted rows are the figure to read";

pub fn density_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let n = args.density.max(1);
    let srv = start_server(n);
    let api = srv.api();
    // Warm-up, excluded: the blank disk image is cached, the server's allocator is warm.
    for _ in 0..args.create_warmup() {
        let id = create(&api)?;
        http_exec(&api, &id)?;
        delete(&api, &id)?;
    }
    let rss0 = rss_kib(srv.pid());
    let mut fill = Fill {
        readings: vec![mem_reading(Duration::from_millis(1000))],
        sizes: steps(n),
    };
    let mut ids = Vec::with_capacity(n);
    let t0 = Instant::now();
    for k in fill.sizes.clone() {
        for _ in 0..k {
            check_stop()?;
            let id = create(&api)?;
            http_exec(&api, &id)?;
            ids.push(id);
        }
        fill.readings.push(mem_reading(Duration::from_millis(500)));
    }
    let fill_s = t0.elapsed().as_secs_f64();
    let machines = srv.data_dir.join("sandboxes");
    let shims = shim_pss_kib(&machines);
    let kernel_each = fill.kernel_each_mb();
    let (mut cg, mut cg_kernel, mut shim, mut accounted) = (vec![], vec![], vec![], vec![]);
    for id in &ids {
        let (all, kmem) = cgroup_memory(id).unwrap_or((0, 0));
        let (all, kmem) = (all as f64 / 1048576.0, kmem as f64 / 1048576.0);
        let s = shims.get(id).copied().unwrap_or(0) as f64 / 1024.0;
        cg.push(all);
        cg_kernel.push(kmem);
        shim.push(s);
        accounted.push(all - kmem + s + kernel_each);
    }
    let disk_mb: Vec<f64> = ids
        .iter()
        .map(|id| allocated_bytes(&machines.join(id)) as f64 / 1048576.0)
        .collect();
    let rss1 = rss_kib(srv.pid());
    let fds = open_fds(srv.pid());
    let free_disk_mb = free_bytes(&srv.data_dir) as f64 / 1048576.0;
    // What the idle sandboxes cost while nothing happens: CPU over an idle window.
    let idle = idle_cpu(srv.pid(), &machines, &ids, IDLE_WINDOW);
    // A sandbox in use among the idle ones: HTTP exec on one of them.
    let busy = &ids[ids.len() / 2];
    for _ in 0..args.warmup {
        check_stop()?;
        http_exec(&api, busy)?;
    }
    let mut exec_ms = Vec::with_capacity(args.fast());
    for _ in 0..args.fast() {
        check_stop()?;
        let t = Instant::now();
        http_exec(&api, busy)?;
        exec_ms.push(ms(t));
    }
    let t_del = Instant::now();
    for id in &ids {
        check_stop()?;
        delete(&api, id)?;
    }
    let del_s = t_del.elapsed().as_secs_f64();
    let back = mem_reading(Duration::from_millis(1000));
    drop(srv);

    let acc50 = percentile(&accounted, 50.0);
    let disk50 = percentile(&disk_mb, 50.0);
    let avail0 = fill.avail0_mb();
    let (by_mem, by_disk) = (fit(avail0, acc50), fit(free_disk_mb, disk50));
    let drops = fill.drops();
    println!(
        "  {n} idle sandboxes: {acc50:.2} MB each accounted (cgroup {:.2} + shim PSS {:.2} + kernel {kernel_each:.2}), MemAvailable drop p50 {:.2} MB each ({:.0} MB in all), disk {disk50:.2} MB each; ~{by_mem} would fit in memory, ~{by_disk} on disk (extrapolated)",
        percentile(&cg, 50.0) - percentile(&cg_kernel, 50.0),
        percentile(&shim, 50.0),
        percentile(&drops, 50.0),
        fill.total_drop_mb()
    );
    let how = format!("{n} idle sandboxes (default template, 512 MB limit, created over HTTP and `true` run once each) filled in {} steps in {fill_s:.1} s; figures read after 0.5 s of settling, medians of 5 readings", fill.sizes.len());
    rows.push(
        Row::new(DENSITY_LOCKER, "MB", accounted, args.create_warmup())
            .note(format!("accounted per sandbox: its cgroup's memory less the kernel part (p50 {:.2} MB) + PSS of its shim outside the cgroup (locker __jail-init, p50 {:.2} MB) + its share of the growth of the kernel's unreclaimable memory (SUnreclaim + KernelStack + PageTables: {kernel_each:.2} MB each: namespaces, mounts, the loop device and ext4 journal threads, sockets)", percentile(&cg, 50.0) - percentile(&cg_kernel, 50.0), percentile(&shim, 50.0)))
            .note(&how)
            .note("page cache of its disk image (reclaimable) is not counted")
            .vs(DENSITY_BWRAP),
    );
    rows.push(
        Row::new("density Locker: cgroup memory per idle sandbox", "MB", cg, 0)
            .note(format!("each machine's own cgroup (memory.usage_in_bytes on v1, memory.current on v2, of locker/<id>): its processes (the agent is PID 1), the page cache they touched and kernel memory charged to it (p50 {:.2} MB)", percentile(&cg_kernel, 50.0))),
    );
    rows.push(
        Row::new(DENSITY_LOCKER_AVAIL, "MB", drops, args.create_warmup())
            .note(format!("drop of MemAvailable (/proc/meminfo) per sandbox in each step; {:.0} MB over the whole fill ({:.2} MB each); {:.0} MB came back after deleting them", fill.total_drop_mb(), fill.total_drop_mb() / n as f64, (back.avail - fill.last().avail) / 1024.0))
            .note(&how)
            .note(NOISE)
            .vs(DENSITY_BWRAP_AVAIL),
    );
    rows.push(
        Row::new("density Locker: disk per idle sandbox", "MB", disk_mb, 0)
            .note("blocks allocated under each sandbox's machine directory on the data dir's file system (its 2048 MB sparse disk image, state files; mounts not descended into)"),
    );
    rows.push(
        Row::new("density Locker: server RSS per idle sandbox", "KiB", vec![(rss1 as f64 - rss0 as f64) / n as f64], 0)
            .note(format!("VmRSS of locker serve with {n} idle sandboxes ({rss1} KiB) minus before them ({rss0} KiB), divided by {n}")),
    );
    println!(
        "  with {n} idle: server {:.2}% of a core, shims {:.2}%, machines {:.2}% over {} s; server RSS {rss1} KiB, {fds} fds; HTTP exec on one p50 {:.2} ms p99 {:.2} ms; {n} deletes took {del_s:.1} s",
        idle.server_pct,
        idle.shims_pct,
        idle.machines_pct,
        IDLE_WINDOW.as_secs(),
        percentile(&exec_ms, 50.0),
        percentile(&exec_ms, 99.0)
    );
    rows.push(
        Row::new(format!("density Locker: HTTP exec true on one of {n} idle"), "ms", exec_ms, args.warmup)
            .note(format!("POST exec `true` over HTTP, one after another, on one sandbox while the other {} sandboxes of the fill idle", n - 1))
            .target(Target::P99(20.0))
            .vs(HTTP_EXEC),
    );
    rows.push(
        Row::new(format!("density Locker: CPU of the server with {n} idle"), "%", vec![idle.server_pct], 0)
            .note(format!("utime + stime of locker serve over {} s while {n} sandboxes idle and no call is made, as a share of one core; its RSS then {rss1} KiB, {fds} open fds", IDLE_WINDOW.as_secs())),
    );
    rows.push(
        Row::new(format!("density Locker: CPU of {n} idle sandboxes"), "%", vec![idle.shims_pct + idle.machines_pct], 0)
            .note(format!("over the same {} s: the shims (locker __jail-init, outside the cgroups: {:.3}%) + every machine's cgroup (cpuacct: the agent and anything it runs: {:.3}%), all {n} together, as a share of one core; {:.4}% per sandbox", IDLE_WINDOW.as_secs(), idle.shims_pct, idle.machines_pct, (idle.shims_pct + idle.machines_pct) / n as f64)),
    );
    let bound = if by_disk < by_mem { "disk" } else { "memory" };
    rows.push(
        Row::new("density Locker: idle sandboxes that fit (extrapolated)", "count", vec![by_mem.min(by_disk)], 0)
            .note(format!("an extrapolation from {n} measured, not a measurement: memory {avail0:.0} MB available before / {acc50:.2} MB accounted per sandbox → {by_mem}; disk {free_disk_mb:.0} MB free on the data dir's file system / {disk50:.2} MB per sandbox → {by_disk}; {bound} binds first. Memory limits are ceilings, not reservations; the tenant quota (default 100 sandboxes), PIDs, loop devices and CPU are not considered")),
    );
    check_stop()?;
    bwrap_density(n, rows)
}

/// `bwrap … sleep infinity` processes, killed and waited for on drop.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        // Each sandbox's processes first (bwrap as its PID 1, then `sleep`): the outer bwrap
        // then reaps its child and exits, so nothing is orphaned to this process (a child
        // subreaper, whose orphan reaper only takes `locker` shims).
        let all = ppids();
        for c in &self.0 {
            for p in tree(c.id() as i32, &all).into_iter().skip(1) {
                // SAFETY: kill with a pid read from /proc; at worst the process is gone.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
        for c in &mut self.0 {
            let deadline = Instant::now() + Duration::from_secs(2);
            loop {
                match c.try_wait() {
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Ok(None) => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    _ => break,
                }
            }
        }
    }
}

/// Parent pid of every process on the host.
fn ppids() -> Vec<(i32, i32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        out.push((pid, ppid));
    }
    out
}

/// `pid` and all its descendants.
fn tree(pid: i32, all: &[(i32, i32)]) -> Vec<i32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(all.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out
}

/// Proportional set size of a process in KiB (`Pss` of `smaps_rollup`).
fn pss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The same density for `bwrap`: idle sandboxes are `bwrap … sleep infinity` process trees.
fn bwrap_density(n: usize, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let names = [DENSITY_BWRAP, DENSITY_BWRAP_AVAIL, DENSITY_BWRAP_FIT];
    let skip = |rows: &mut Vec<Row>, why: String| {
        for name in names {
            rows.push(Row::skipped(name, why.clone()));
        }
    };
    let b = match bwrap() {
        Ok(b) => b,
        Err(e) => {
            skip(rows, e);
            return Ok(());
        }
    };
    let (fill, pss) = match measure_bwrap_density(&b, n) {
        Ok(r) => r,
        Err(e) => {
            // An interruption stops the run; anything else skips the peer.
            check_stop()?;
            skip(rows, format!("{e:#}"));
            return Ok(());
        }
    };
    let kernel_each = fill.kernel_each_mb();
    let accounted: Vec<f64> = pss.iter().map(|p| p + kernel_each).collect();
    let acc50 = percentile(&accounted, 50.0);
    let drops = fill.drops();
    let by_mem = fit(fill.avail0_mb(), acc50);
    println!(
        "  {n} idle bwrap: {acc50:.2} MB each accounted (PSS {:.2} + kernel {kernel_each:.2}), MemAvailable drop p50 {:.2} MB each; ~{by_mem} would fit (extrapolated)",
        percentile(&pss, 50.0),
        percentile(&drops, 50.0)
    );
    let what = format!("{n} idle `bwrap --unshare-all --die-with-parent --ro-bind <default template> / --proc /proc --dev /dev sleep infinity`, filled in {} steps; no cgroup, no disk, no agent: nothing in it can take a command later", fill.sizes.len());
    rows.push(
        Row::new(DENSITY_BWRAP, "MB", accounted, 0)
            .note(format!("accounted per sandbox: PSS of the outer bwrap and its descendants (bwrap as PID 1, sleep; p50 {:.2} MB) + its share of the growth of the kernel's unreclaimable memory ({kernel_each:.2} MB each: namespaces, mounts)", percentile(&pss, 50.0)))
            .note(&what),
    );
    rows.push(
        Row::new(DENSITY_BWRAP_AVAIL, "MB", drops, 0)
            .note(format!(
                "drop of MemAvailable per bwrap in each step; {:.0} MB over the whole fill",
                fill.total_drop_mb()
            ))
            .note(&what)
            .note(NOISE),
    );
    rows.push(Row::new(DENSITY_BWRAP_FIT, "count", vec![by_mem], 0).note(format!(
        "an extrapolation from {n} measured: {:.0} MB available before / {acc50:.2} MB accounted per bwrap",
        fill.avail0_mb()
    )));
    Ok(())
}

/// The fill's readings and the PSS (MB) of each `bwrap` tree.
fn measure_bwrap_density(b: &Path, n: usize) -> anyhow::Result<(Fill, Vec<f64>)> {
    let root = default_rootfs();
    let root = root.to_str().context("the template path is not UTF-8")?;
    let argv = bwrap_argv(root, &[], &["sleep", "infinity"]);
    let mut procs = Procs(Vec::with_capacity(n));
    let mut fill = Fill {
        readings: vec![mem_reading(Duration::from_millis(1000))],
        sizes: steps(n),
    };
    for k in fill.sizes.clone() {
        for _ in 0..k {
            check_stop()?;
            let c = Command::new(b)
                .args(&argv)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("start bwrap")?;
            procs.0.push(c);
        }
        // Until every new tree runs its `sleep`.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let all = ppids();
            let ready = procs.0.iter().all(|c| {
                tree(c.id() as i32, &all)
                    .iter()
                    .any(|&p| comm(p) == "sleep")
            });
            if ready {
                break;
            }
            if Instant::now() > deadline {
                anyhow::bail!("bwrap … sleep infinity did not start within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        fill.readings.push(mem_reading(Duration::from_millis(500)));
    }
    let all = ppids();
    let pss: Vec<f64> = procs
        .0
        .iter()
        .map(|c| {
            tree(c.id() as i32, &all)
                .iter()
                .map(|&p| pss_kib(p))
                .sum::<u64>() as f64
                / 1024.0
        })
        .collect();
    drop(procs);
    Ok((fill, pss))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_add_up() {
        assert_eq!(steps(100), vec![10; 10]);
        assert_eq!(steps(3), vec![1, 1, 1]);
        assert_eq!(steps(25).iter().sum::<usize>(), 25);
    }

    #[test]
    fn per_item_memory_of_steps() {
        let m = |avail| Mem { avail, kernel: 0.0 };
        let r = [m(10240.0), m(9216.0), m(8192.0)];
        assert_eq!(per_item_mb(&r, &[2, 4]), vec![0.5, 0.25]);
    }

    #[test]
    fn burst_threads_all_run() {
        let (out, _) = all_at_once(8, |i| i * 2);
        assert_eq!(out, (0..8).map(|i| i * 2).collect::<Vec<_>>());
    }
}
