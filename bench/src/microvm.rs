//! microVMs: Locker's microVM runtime (cold boot to first command, and create from a
//! snapshot) when the server offers it, and a plain QEMU `microvm` boot as the peer.
//!
//! The server is asked at run time (`POST /v1/sandboxes {"runtime":"microvm"}`); a server
//! that refuses gives skipped rows with its answer. QEMU is never installed by the bench:
//! without `qemu-system-x86_64` or a kernel image the peer row is skipped with what to
//! install. Owns its server (the [`Server`] guard) and each QEMU process ([`Qemu`] kills it
//! on drop).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

use crate::jail::which;
use crate::stats::{percentile, Row};
use crate::{check_stop, Args};

const COLD: &str = "microVM create→true, cold boot (first sandbox of its shape, HTTP)";
const BASE: &str = "microVM create→true, restored from the booted base (HTTP, --vm-pool 0)";
const POOL: &str = "microVM create→true, a ready microVM from the pool (HTTP, --vm-pool 1)";
const RESTORE: &str = "microVM create→true from a memory snapshot (HTTP)";
const MEMORY: &str = "microVM memory per idle sandbox (QEMU PSS)";
const IDLE_CPU: &str = "microVM idle CPU per sandbox (QEMU)";
const QEMU: &str = "peer QEMU microvm kernel boot";

pub(crate) fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

pub(crate) fn post(api: &Api, path: &str, body: &Value) -> Result<(u16, Value, String), String> {
    let r = api
        .try_request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            serde_json::to_vec(body).expect("json").as_slice(),
        )
        .map_err(|e| format!("POST {path}: {e}"))?;
    let text = r.text();
    let v = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    Ok((r.status, v, text))
}

pub(crate) fn want(path: &str, got: (u16, Value, String), status: u16) -> Result<Value, String> {
    if got.0 != status {
        return Err(format!("POST {path}: HTTP {}: {}", got.0, got.2.trim()));
    }
    Ok(got.1)
}

pub(crate) fn delete(api: &Api, path: &str) {
    let _ = api.try_request("DELETE", path, &[], ());
}

/// create (with `body`) → exec `true` answered, `n` times after `warm`; each sandbox is
/// deleted before the next, and `pause` (not counted) waited after each.
fn create_true_paced(
    api: &Api,
    body: &Value,
    warm: usize,
    n: usize,
    pause: Duration,
) -> Result<Vec<f64>, String> {
    let mut s = Vec::with_capacity(n);
    for i in 0..warm + n {
        check_stop().map_err(|e| e.to_string())?;
        std::thread::sleep(pause);
        let t0 = Instant::now();
        let v = want("/v1/sandboxes", post(api, "/v1/sandboxes", body)?, 201)?;
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        let path = format!("/v1/sandboxes/{id}/exec");
        let r = post(api, &path, &json!({"cmd": ["true"]}));
        let t = ms(t0);
        delete(api, &format!("/v1/sandboxes/{id}"));
        want(&path, r?, 200)?;
        if i >= warm {
            s.push(t);
        }
    }
    Ok(s)
}

fn create_true(api: &Api, body: &Value, warm: usize, n: usize) -> Result<Vec<f64>, String> {
    create_true_paced(api, body, warm, n, Duration::ZERO)
}

pub fn microvm_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let bases_before = bases();
    // Without the pool: every create restores the base (the pool is measured after).
    let srv = Server::start_with(&["--vm-pool", "0"]);
    let api = srv.api();
    let body = json!({"runtime": "microvm", "memory_mb": 256});
    let probe = post(&api, "/v1/sandboxes", &body).map_err(anyhow::Error::msg)?;
    if probe.0 != 201 {
        let why = format!(
            "Locker's microVM runtime is not available: POST /v1/sandboxes {{\"runtime\":\"microvm\"}} answered HTTP {}: {}",
            probe.0,
            probe.1["error"]["message"].as_str().unwrap_or(probe.2.trim())
        );
        println!("  skipped: {why}");
        for r in [COLD, BASE, POOL, RESTORE, MEMORY, IDLE_CPU] {
            rows.push(Row::skipped(r, &why));
        }
    } else {
        if let Some(id) = probe.1["id"].as_str() {
            delete(&api, &format!("/v1/sandboxes/{id}"));
        }
        let (warm, n) = (args.create_warmup(), args.creates().min(20));
        // A cold boot: every new shape (here a new memory size) boots its base once.
        let cold: Result<Vec<f64>, String> = (0..3u64)
            .map(|i| {
                create_true(
                    &api,
                    &json!({"runtime": "microvm", "memory_mb": 300 + i}),
                    0,
                    1,
                )
                .map(|v| v[0])
            })
            .collect();
        match cold {
            Ok(s) => {
                println!("  {COLD}: p50 {:.0} ms", percentile(&s, 50.0));
                rows.push(Row::new(COLD, "ms", s, 0).note("each with a memory size no sandbox had: the base VM boots (kernel, initramfs, agent), is saved, then restored; no warm-up").vs(QEMU));
            }
            Err(e) => rows.push(Row::skipped(COLD, e)),
        }
        check_stop()?;
        match create_true(&api, &body, warm, n) {
            Ok(s) => {
                println!("  {BASE}: p50 {:.1} ms", percentile(&s, 50.0));
                rows.push(Row::new(BASE, "ms", s, warm).note("POST /v1/sandboxes {\"runtime\":\"microvm\"} then exec true answered, one at a time: QEMU maps the base's RAM copy-on-write and loads its device state").vs(COLD).vs(crate::server::HTTP_CREATE_EXEC));
            }
            Err(e) => rows.push(Row::skipped(BASE, e)),
        }
        check_stop()?;
        {
            let pooled = Server::start();
            let papi = pooled.api();
            // The first create of the shape fills the pool; each later one takes a ready
            // microVM, and the bench waits (not counted) for the pool to refill.
            let r = create_true(&papi, &body, 0, 1).and_then(|_| {
                create_true_paced(&papi, &body, warm, n, Duration::from_millis(1500))
            });
            match r {
                Ok(s) => {
                    println!("  {POOL}: p50 {:.1} ms", percentile(&s, 50.0));
                    rows.push(Row::new(POOL, "ms", s, warm).note("the server keeps one restored microVM per shape with a first command already run (so TCG has translated the exec path); a create takes it and refreshes its clock, entropy and name; 1.5 s between creates (not counted) lets the pool refill").vs(COLD).vs(BASE));
                }
                Err(e) => rows.push(Row::skipped(POOL, e)),
            }
        }
        check_stop()?;
        rows.push(match restore(&api, warm, n) {
            Ok(s) => Row::new(RESTORE, "ms", s, warm).note("a microVM sandbox snapshotted once with its memory, then POST /v1/sandboxes {\"from_snapshot\":…} and exec true answered, one at a time").vs(BASE),
            Err(e) => Row::skipped(RESTORE, e),
        });
        check_stop()?;
        match idle_memory(&api, &srv, 4) {
            Ok((pss, cpu)) => {
                println!("  {IDLE_CPU}: p50 {:.2}% of a core", percentile(&cpu, 50.0));
                rows.push(Row::new(MEMORY, "MB", pss, 0).note("4 idle 256 MB microVM sandboxes restored from one base; proportional set size of each QEMU (shared base pages split between them)"));
                rows.push(Row::new(IDLE_CPU, "%", cpu, 0).note(format!("the same 4 idle microVM sandboxes, 2 s after their creates: utime + stime of each QEMU over {} s of doing nothing, as a share of one core ({}; the guest kernel's idle ticks and QEMU's main loop)", IDLE_WINDOW.as_secs(), locker_runtime::vm::accel().0.as_str())));
            }
            Err(e) => {
                rows.push(Row::skipped(MEMORY, e.clone()));
                rows.push(Row::skipped(IDLE_CPU, e));
            }
        }
    }
    drop(srv);
    // The bases this run booted for its cold-boot shapes are not wanted after it.
    for b in bases().difference(&bases_before) {
        let _ = std::fs::remove_dir_all(b);
        let _ = std::fs::remove_file(b.with_extension("lock"));
    }
    check_stop()?;
    rows.push(qemu_row(args));
    Ok(())
}

/// The microVM bases on this host (`/run/locker/vm-base/<key>`).
pub(crate) fn bases() -> std::collections::BTreeSet<PathBuf> {
    subdirs(Path::new(locker_runtime::vm::BASE_DIR))
        .into_iter()
        .collect()
}

/// The directories in `dir` (none when it cannot be read).
pub(crate) fn subdirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect()
}

/// How long the idle CPU of microVMs is watched.
const IDLE_WINDOW: Duration = Duration::from_secs(10);

/// PSS in MB of each QEMU of `n` idle microVM sandboxes, and the CPU each used over
/// [`IDLE_WINDOW`] of doing nothing, in % of one core.
fn idle_memory(api: &Api, srv: &Server, n: usize) -> Result<(Vec<f64>, Vec<f64>), String> {
    let mut ids = Vec::new();
    let r = (|| {
        for _ in 0..n {
            let v = want(
                "/v1/sandboxes",
                post(
                    api,
                    "/v1/sandboxes",
                    &json!({"runtime": "microvm", "memory_mb": 256}),
                )?,
                201,
            )?;
            ids.push(v["id"].as_str().unwrap_or_default().to_owned());
        }
        std::thread::sleep(Duration::from_secs(2));
        let mut pss = Vec::new();
        let mut pids = Vec::new();
        for id in &ids {
            let dir = srv.machine_dir(id);
            let state: Value = serde_json::from_slice(
                &std::fs::read(dir.join("vm.json")).map_err(|e| e.to_string())?,
            )
            .map_err(|e| e.to_string())?;
            let pid = state["pid"].as_i64().unwrap_or(0);
            let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
                .map_err(|e| e.to_string())?;
            let kib: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix("Pss:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .ok_or("no Pss in smaps_rollup")?;
            pss.push(kib / 1024.0);
            pids.push(pid as u32);
        }
        let before: Vec<f64> = pids.iter().map(|&p| crate::scale::proc_cpu_ms(p)).collect();
        let t0 = Instant::now();
        std::thread::sleep(IDLE_WINDOW);
        let wall = ms(t0);
        let cpu = pids
            .iter()
            .zip(before)
            .map(|(&p, b)| 100.0 * (crate::scale::proc_cpu_ms(p) - b).max(0.0) / wall)
            .collect();
        Ok((pss, cpu))
    })();
    for id in &ids {
        delete(api, &format!("/v1/sandboxes/{id}"));
    }
    r
}

fn restore(api: &Api, warm: usize, n: usize) -> Result<Vec<f64>, String> {
    let v = want(
        "/v1/sandboxes",
        post(
            api,
            "/v1/sandboxes",
            &json!({"runtime": "microvm", "memory_mb": 256}),
        )?,
        201,
    )?;
    let sb = v["id"].as_str().unwrap_or_default().to_owned();
    let path = format!("/v1/sandboxes/{sb}/snapshots");
    let snap = want(&path, post(api, &path, &json!({}))?, 201);
    delete(api, &format!("/v1/sandboxes/{sb}"));
    let snap = snap?["id"].as_str().unwrap_or_default().to_owned();
    let r = create_true(api, &json!({"from_snapshot": snap}), warm, n);
    delete(api, &format!("/v1/snapshots/{snap}"));
    r
}

/// A QEMU process killed and reaped on drop.
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The kernel to boot: `--qemu-kernel`, else the newest `/boot/vmlinuz-*`.
fn kernel(args: &Args) -> Option<PathBuf> {
    if let Some(k) = &args.qemu_kernel {
        return Some(k.clone());
    }
    let mut ks: Vec<PathBuf> = std::fs::read_dir("/boot")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz"))
        })
        .collect();
    ks.sort();
    ks.pop()
}

/// Boots `kernel` in a QEMU `microvm` machine until it gives up on finding a root file
/// system and QEMU exits (`panic=-1` reboots at once, `-no-reboot` turns that into an
/// exit): the guest kernel's whole boot, no user space. The wall time, or why it failed.
fn boot_once(qemu: &Path, kernel: &Path, accel: &str, log: &Path) -> Result<f64, String> {
    // The console goes to a file: a pipe nobody reads while it boots could fill and stall it.
    let f = std::fs::File::create(log).map_err(|e| format!("create {}: {e}", log.display()))?;
    let f2 = f.try_clone().map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let child = Command::new(qemu)
        // The RTC on and the TSC given: without them the guest's clock calibration can
        // stall for minutes under TCG.
        .args([
            "-M",
            "microvm,rtc=on",
            "-accel",
            accel,
            "-m",
            "256",
            "-smp",
            "1",
        ])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .args(["-serial", "stdio", "-kernel"])
        .arg(kernel)
        .args([
            "-append",
            &format!(
                "console=ttyS0 panic=-1 reboot=t tsc_early_khz={} tsc=reliable",
                locker_runtime::vm::host_khz()
            ),
        ])
        .stdin(Stdio::null())
        .stdout(f)
        .stderr(f2)
        .spawn()
        .map_err(|e| format!("start {}: {e}", qemu.display()))?;
    let mut q = Qemu(child);
    let deadline = t0 + Duration::from_secs(120);
    loop {
        match q.0.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() > deadline => {
                return Err("the guest did not finish booting within 120 s (under KVM a standard kernel may hang on a PVM host: use --qemu-accel tcg)".into())
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(format!("wait for qemu: {e}")),
        }
    }
    let t = ms(t0);
    let out = String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned();
    // The boot ran until the kernel looked for its root (or init): anything else is a
    // failed start (a wrong kernel, a QEMU without microvm).
    if !(out.contains("Kernel panic") || out.contains("VFS") || out.contains("init")) {
        let tail: String = out
            .chars()
            .rev()
            .take(400)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        return Err(format!(
            "qemu exited without the guest kernel reaching its root file system: {}",
            tail.trim()
        ));
    }
    Ok(t)
}

fn qemu_row(args: &Args) -> Row {
    let Some(qemu) = which("qemu-system-x86_64") else {
        return Row::skipped(QEMU, "qemu-system-x86_64 is not installed on this host (not installed by the bench: apt-get install -y qemu-system-x86, plus a kernel image such as linux-image-amd64, or pass --qemu-kernel PATH)");
    };
    let Some(k) = kernel(args) else {
        return Row::skipped(QEMU, "no kernel image: pass --qemu-kernel PATH (a bzImage) or install one to /boot (apt-get install -y linux-image-amd64)");
    };
    let accel = args.qemu_accel.as_str();
    let (warm, n) = (1, args.qemu_boots.max(1));
    let tmp = locker_tests::TempDir::new("locker-bench-qemu");
    let log = tmp.path().join("console.log");
    let mut s = Vec::with_capacity(n);
    for i in 0..warm + n {
        if crate::stopping() {
            break;
        }
        match boot_once(&qemu, &k, accel, &log) {
            Ok(t) if i >= warm => s.push(t),
            Ok(_) => {}
            Err(e) => return Row::skipped(QEMU, e),
        }
    }
    println!("  {QEMU}: p50 {:.0} ms ({accel})", percentile(&s, 50.0));
    let kvm = if accel == "tcg" {
        "TCG (emulation): on this kind of host /dev/kvm is PVM and standard kernels hang under it; where real KVM exists, --qemu-accel kvm"
    } else {
        "KVM"
    };
    Row::new(QEMU, "ms", s, warm).note(format!(
        "qemu-system-x86_64 -M microvm,rtc=on -accel {accel} -m 256 -smp 1 -nodefaults -display none -serial stdio -no-reboot -kernel {} -append 'console=ttyS0 panic=-1 reboot=t tsc_early_khz=<host kHz> tsc=reliable', no initrd, no root: from QEMU's start until the kernel finished booting, found no root file system and QEMU exited; {kvm}; no snapshot restore (a plain QEMU has no fast restore path here)",
        k.display()
    ))
}
