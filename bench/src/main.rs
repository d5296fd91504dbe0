//! `locker-bench`: how fast Locker is on this host, beside its peers, in one run.
//!
//! Measures the jail runtime directly (create a machine and run `true`, exec in a warm
//! machine, destroy), the same start done by peers on the same root filesystem (`bwrap`,
//! gVisor's `runsc` when installed, a plain host spawn), and the HTTP server (exec, create,
//! the CLI, and a soak of many sandboxes running commands at once). Prints a table of
//! p50/p95/p99 with the targets and ratios, and writes every sample to
//! `bench/results/<host>-<date>.json`.
//!
//! A benchmark reports; it never fails because a number is bad. It exits non-zero only when
//! it could not measure (a missing binary, a machine that did not start). Everything it
//! starts is cleaned up by guards, also on Ctrl-C (the handler only raises a flag).
//! Run it through `bench/run`, which builds the release binaries first.

mod code;
mod fleet;
mod fleet_drain;
mod fleet_volumes;
mod host;
mod http1;
mod images;
mod jail;
mod jobs;
mod microvm;
mod ports;
mod report;
mod runs;
mod scale;
mod sdk;
mod secrets;
mod server;
mod snapshots;
mod stats;
mod ui;
mod vm_volumes;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context};
use clap::Parser;

use crate::stats::Row;

/// Benchmarks of Locker on this host (run as root; see docs/benchmarks.md).
#[derive(Parser, Debug, Clone)]
#[command(name = "locker-bench")]
pub struct Args {
    /// Groups to run, comma-separated: jail, peers, server, burst, density, runs, snapshots,
    /// microvm, microvm-volumes, ports, jobs, code, soak, images, sdk, secrets, ui (default: all).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Measured iterations of every row (default: 200 for fast operations, 50 for creates).
    #[arg(long)]
    pub iterations: Option<usize>,
    /// Measured iterations of create rows (default: --iterations, else 50).
    #[arg(long)]
    pub create_iterations: Option<usize>,
    /// Warm-up iterations before each fast row (not counted); creates use a fifth of this.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// How long the soak runs.
    #[arg(long, default_value_t = 30)]
    pub soak_seconds: u64,
    /// How many sandboxes the soak runs commands in at once (one thread each).
    #[arg(long, default_value_t = 50)]
    pub soak_sandboxes: usize,
    /// Sandboxes created at once in the burst (and serverless runs at once).
    #[arg(long, default_value_t = 100)]
    pub burst: usize,
    /// Idle sandboxes (and idle bwrap peers) the density rows fill the host with.
    #[arg(long, default_value_t = 100)]
    pub density: usize,
    /// The kernel the QEMU microvm peer boots (default: the newest /boot/vmlinuz-*).
    #[arg(long)]
    pub qemu_kernel: Option<PathBuf>,
    /// QEMU's accelerator for the microvm peer: tcg (emulation) or kvm.
    #[arg(long, default_value = "tcg")]
    pub qemu_accel: String,
    /// Measured boots of the QEMU microvm peer (after one warm-up boot).
    #[arg(long, default_value_t = 5)]
    pub qemu_boots: usize,
    /// Small requests of the ports rows (each through the proxy and directly).
    #[arg(long, default_value_t = 1000)]
    pub port_requests: usize,
    /// Size of the ports rows' download, in MiB (through the proxy and directly).
    #[arg(long, default_value_t = 1024)]
    pub download_mib: u64,
    /// Measured downloads each way of the ports rows (alternating direct and proxied).
    #[arg(long, default_value_t = 3)]
    pub downloads: usize,
    /// Measured pause/wake cycles of the ports rows (after one warm-up cycle).
    #[arg(long, default_value_t = 20)]
    pub wake_cycles: usize,
    /// Seconds between the code group's pooled microVM creates (not counted): the pool
    /// restores a machine and starts its kernel meanwhile, which takes tens of seconds
    /// under TCG (a few on KVM).
    #[arg(long, default_value_t = 40)]
    pub code_vm_gap_s: u64,
    /// Idle sandboxes the ui group fills one tenant with before it lists them and loads
    /// the dashboard's sandboxes page (needs 10 GiB of memory available above 300).
    #[arg(long, default_value_t = 1000)]
    pub ui_sandboxes: usize,
    /// Cold loads of the dashboard per tenant in the ui group (headless Chromium).
    #[arg(long, default_value_t = 10)]
    pub ui_loads: usize,
    /// Where the results (JSON, Markdown, SVG) go.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results"))]
    pub out_dir: PathBuf,
    /// Measure the kernel's default cgroup move path, what a freshly booted host gives
    /// without Locker's setting: neither the bench nor the servers it starts set
    /// `favordynmods`. Only meaningful where nothing has set it since the host booted
    /// (`locker doctor` says; any `locker serve` without --no-favordynmods sets it).
    #[arg(long)]
    pub no_favordynmods: bool,
}

const GROUPS: [&str; 20] = [
    "jail",
    "peers",
    "server",
    "burst",
    "density",
    "runs",
    "snapshots",
    "microvm",
    "microvm-volumes",
    "ports",
    "jobs",
    "code",
    "soak",
    "images",
    "sdk",
    "secrets",
    "ui",
    "fleet",
    "fleet-volumes",
    "fleet-drain",
];

impl Args {
    pub fn fast(&self) -> usize {
        self.iterations.unwrap_or(200).max(1)
    }
    pub fn creates(&self) -> usize {
        self.create_iterations
            .or(self.iterations)
            .unwrap_or(50)
            .max(1)
    }
    pub fn create_warmup(&self) -> usize {
        (self.warmup / 5).max(usize::from(self.warmup > 0))
    }
    fn wants(&self, g: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == g)
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

/// Whether Ctrl-C (or SIGTERM) asked the run to stop.
pub fn stopping() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Fails when a stop was asked, so `?` unwinds through the guards.
pub fn check_stop() -> anyhow::Result<()> {
    if stopping() {
        bail!("interrupted: cleaning up");
    }
    Ok(())
}

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// The first SIGINT/SIGTERM raises [`STOP`]; the handler then resets itself, so a second
/// Ctrl-C kills the process at once (skipping clean-up, as the user asked twice).
fn install_signal_handler() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a handler that only stores to an atomic, which is
        // async-signal-safe; SA_RESETHAND restores the default after the first delivery.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = libc::SA_RESETHAND;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

fn main() {
    match run() {
        Ok(()) => {}
        Err(e) => {
            // Everything the run started was cleaned up by its guards before this point.
            eprintln!("locker-bench: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    for o in &args.only {
        if !GROUPS.contains(&o.as_str()) {
            bail!("unknown group {o:?} in --only: use {}", GROUPS.join(", "));
        }
    }
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        bail!("locker-bench starts machines and must run as root (sudo bench/run)");
    }
    install_signal_handler();
    locker_tests::become_subreaper();
    // As `locker serve` does at start, so the rows through the node and those through a
    // server measure the same host (see locker_runtime::cgroup::MoveMode).
    if args.no_favordynmods {
        // Before any thread starts; the servers the rows start inherit it.
        std::env::set_var("LOCKER_NO_FAVORDYNMODS", "true");
    } else if let Err(e) = locker_runtime::cgroup::favor_dynamic_moves() {
        println!("warning: cgroup moves stay on the kernel's default path: {e}");
    }

    let info = host::Info::collect();
    println!("{}", info.describe());
    let locker = locker_tests::locker_bin();
    if locker.components().any(|c| c.as_os_str() == "debug") {
        println!(
            "warning: {} is a debug build; numbers will be pessimistic (use bench/run)",
            locker.display()
        );
    }
    println!(
        "iterations: {} (fast) / {} (creates), after {} / {} warm-up iterations that are excluded from every figure\n",
        args.fast(),
        args.creates(),
        args.warmup,
        args.create_warmup()
    );

    let mut rows: Vec<Row> = Vec::new();
    let started = std::time::Instant::now();
    let mark = host::CpuMark::now();
    let result = run_groups(&args, &mut rows);
    let (host_busy, own) = mark.since(info.nproc);
    let wall_s = started.elapsed().as_secs_f64();
    if !rows.is_empty() {
        rows.push(
            Row::new("host CPU busy during the run", "%", vec![host_busy], 0)
                .note(format!("all CPUs, all processes; this run's own process tree (bench, servers, machines once reaped) about {own:.0}%, the rest ({:.0}%) other work on the host; {}", host_busy - own, info.describe())),
        );
    }
    if let Err(e) = &result {
        eprintln!("\nlocker-bench stopped early: {e:#}");
    }
    if rows.is_empty() {
        return result;
    }
    // Described again: the load average now covers the run.
    let after = host::Info::collect();
    println!("\n{}", after.describe());
    println!("n = measured iterations; warm-up iterations are excluded. Times in ms. Ratios compare p50s measured in this run.\n");
    print!("{}", stats::table(&rows));
    println!("\nthe run took {wall_s:.0} s");
    // A run that stopped early never overwrites a complete one.
    let partial = if result.is_err() { "-partial" } else { "" };
    // A run of some groups never overwrites a full run either.
    let subset = if args.only.is_empty() {
        String::new()
    } else {
        format!("-{}", args.only.join("+"))
    };
    // Not Path::with_extension: a host name may hold dots.
    let stem = format!("{}-{}{subset}{partial}", info.hostname, info.date);
    let file = |ext: &str| args.out_dir.join(format!("{stem}.{ext}"));
    let path = file("json");
    stats::write_json(&rows, &path).with_context(|| format!("write {}", path.display()))?;
    let title = format!("Locker benchmarks: {} {}", info.hostname, info.date);
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let header = vec![
        after.describe(),
        format!(
            "`bench/run {}`: {wall_s:.0} s{}; groups: {}",
            argv.join(" "),
            if result.is_err() { ", stopped early" } else { "" },
            if args.only.is_empty() { "all".to_owned() } else { args.only.join(", ") }
        ),
        "n = measured iterations; warm-up iterations are excluded from every figure (how many, per row, in the JSON notes). Times in ms; percentiles nearest-rank; ratios compare p50s measured in this run. Every sample and the notes on what each row times: the JSON file beside this one.".to_owned(),
    ];
    let md = file("md");
    std::fs::write(&md, report::markdown(&rows, &title, &header))
        .with_context(|| format!("write {}", md.display()))?;
    let svg = file("svg");
    let chart = if report::svg(&rows, &format!("{title}: latency distributions"), &svg)? {
        format!("; chart to {}", svg.display())
    } else {
        String::new()
    };
    println!(
        "\nsamples written to {}; table to {}{chart}",
        path.display(),
        md.display()
    );
    result
}

fn run_groups(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    if args.wants("jail") || args.wants("peers") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        if args.wants("jail") {
            println!("== jail: machines started directly through the node ==");
            rt.block_on(jail::jail_rows(args, rows))?;
        }
        if args.wants("peers") {
            println!("== peers: the same start by other tools on this host ==");
            jail::peer_rows(args, rows)?;
        }
    }
    if args.wants("server") {
        println!("== server: `locker serve` over HTTP, and the CLI ==");
        server::server_rows(args, rows)?;
    }
    if args.wants("burst") {
        check_stop()?;
        println!(
            "== burst: {} sandboxes created at once, each until its first command is done ==",
            args.burst
        );
        scale::burst_rows(args, rows)?;
    }
    if args.wants("density") {
        check_stop()?;
        println!(
            "== density: {} idle sandboxes, then {} idle bwrap ==",
            args.density, args.density
        );
        scale::density_rows(args, rows)?;
    }
    if args.wants("runs") {
        check_stop()?;
        println!("== runs: serverless runs on a volume, beside a fresh bwrap per call ==");
        runs::run_rows(args, rows)?;
    }
    if args.wants("snapshots") {
        println!("== snapshots: pause, resume, create from a snapshot, fork ==");
        snapshots::snapshot_rows(args, rows)?;
    }
    if args.wants("microvm") {
        check_stop()?;
        println!("== microvm: Locker's microVM runtime, and a plain QEMU microvm boot ==");
        microvm::microvm_rows(args, rows)?;
    }
    if args.wants("microvm-volumes") {
        check_stop()?;
        println!("== microvm-volumes: runs on a volume and file I/O through a volume, microVM beside jail ==");
        vm_volumes::rows(args, rows)?;
    }
    if args.wants("ports") {
        check_stop()?;
        println!("== ports: the path proxy beside a direct connection into the machine's network namespace ==");
        ports::port_rows(args, rows)?;
    }
    if args.wants("jobs") {
        check_stop()?;
        println!("== jobs: an exec that leaves a job running, beside one that does not ==");
        jobs::job_rows(args, rows)?;
    }
    if args.wants("code") {
        check_stop()?;
        println!("== code: the code interpreter's cells, first cells with and without a pre-started kernel ==");
        code::code_rows(args, rows)?;
    }
    if args.wants("images") {
        check_stop()?;
        println!("== images: pull and unpack of a 100 MB image from a loopback registry, beside skopeo + umoci ==");
        images::image_rows(args, rows)?;
    }
    if args.wants("sdk") {
        check_stop()?;
        println!("== sdk: exec through the TypeScript SDK beside a raw fetch, and bursts of 100 parallel execs ==");
        sdk::sdk_rows(args, rows)?;
    }
    if args.wants("secrets") {
        check_stop()?;
        println!("== secrets: HTTPS through the egress proxy with a secret put in (intercepted) beside passed through by SNI ==");
        secrets::rows(args, rows)?;
    }
    if args.wants("ui") {
        check_stop()?;
        println!(
            "== ui: the dashboard with {} sandboxes: the list answer, whole and paged, and the sandboxes page loaded cold in Chromium ==",
            args.ui_sandboxes
        );
        ui::rows(args, rows)?;
    }
    if args.wants("fleet") {
        check_stop()?;
        println!("== fleet: nodes in network namespaces joining a server on Postgres: joins, heartbeats, failure detection ==");
        fleet::rows(args, rows)?;
    }
    if args.wants("fleet-volumes") {
        check_stop()?;
        println!("== fleet-volumes: `locker volume move` between two servers on Postgres, beside a bare btrfs send | receive ==");
        fleet_volumes::rows(args, rows)?;
    }
    if args.wants("fleet-drain") {
        check_stop()?;
        println!("== fleet-drain: sandboxes drained back and forth between two nodes: a jail, a microVM moved live and moved cold ==");
        fleet_drain::rows(args, rows)?;
    }
    if args.wants("soak") {
        check_stop()?;
        println!(
            "== soak: {} sandboxes running `true` in a loop for {} s ==",
            args.soak_sandboxes, args.soak_seconds
        );
        server::soak_rows(args, rows)?;
    }
    Ok(())
}
