//! Volumes in microVMs: a serverless run of `true` on a volume in a microVM beside the same
//! run in a jail, and file I/O through a volume mounted in a microVM sandbox (FUSE over a
//! virtio-serial port to the host's file server) beside the same in a jail sandbox (a bind
//! mount of the volume), with the microVM's own disk (`/root`, its block device) as the
//! reference for what FUSE costs.
//!
//! One server ([`Server`], with its default pools) and one volume serve every row. The
//! microVM runs are paced: before each, the bench waits (not counted) until the server's
//! microVM pool holds a ready machine again, and after each it checks whether the run took
//! that machine, so every sample says whether it came from the pool. The I/O rows time
//! their steps inside the machine (bash's `$EPOCHREALTIME`), one `exec` per iteration.
//! Everything it makes (sandboxes, the volume, bases of new shapes) is deleted after it.

use std::path::Path;
use std::time::{Duration, Instant};

use locker_runtime::vm::{self, VmState};
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

use crate::microvm::{bases, delete, ms, post, subdirs, want};
use crate::stats::{percentile, Row};
use crate::{check_stop, Args};

const RUN_VM: &str = "microVM run true on a volume: whole call (HTTP, pooled microVM)";
const RUN_JAIL: &str = "jail run true on a volume: whole call (HTTP, same server)";

/// The microVMs' memory (the other microVM rows' size, so the base is usually there).
const VM_MEMORY_MB: u64 = 256;
/// The file the I/O rows write and read back.
const MIB: u32 = 64;
/// The small files the I/O rows create.
const FILES: u32 = 1000;
/// Measured iterations of each I/O row (after one smaller warm-up iteration).
const IO_REPS: usize = 3;

/// Where an I/O row writes: a volume mounted in a microVM or a jail, or the microVM's disk.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Fuse,
    Jail,
    Disk,
}

impl Place {
    fn label(self) -> &'static str {
        match self {
            Place::Fuse => "microVM, volume via FUSE",
            Place::Jail => "jail, volume bind mount",
            Place::Disk => "microVM, own disk /root",
        }
    }
    fn dir(self) -> &'static str {
        match self {
            Place::Fuse => "/workspace/bench-vm",
            Place::Jail => "/workspace/bench-jail",
            Place::Disk => "/root/bench-disk",
        }
    }
    fn write(self) -> String {
        format!("write {MIB} MiB (dd conv=fsync): {}", self.label())
    }
    fn read(self) -> String {
        // The jail may not drop caches: its row says what it read in its notes.
        let after = if self == Place::Jail {
            ""
        } else {
            " after drop_caches"
        };
        format!("read {MIB} MiB back{after}: {}", self.label())
    }
    fn small(self) -> String {
        format!("create {FILES} small files: {}", self.label())
    }
}

/// One iteration in the machine: write, drop the caches if allowed, read back, create the
/// small files; prints the five `$EPOCHREALTIME` marks and whether the caches were dropped.
const SCRIPT: &str = r#"set -e
d=$1; mib=$2; n=$3
rm -rf "$d"; mkdir -p "$d/s"; sync
a=$EPOCHREALTIME
dd if=/dev/zero of="$d/f" bs=1M count="$mib" conv=fsync status=none
b=$EPOCHREALTIME
sync
if echo 3 2>/dev/null >/proc/sys/vm/drop_caches; then dropped=1; else dropped=0; fi
c=$EPOCHREALTIME
dd if="$d/f" of=/dev/null bs=1M status=none
e=$EPOCHREALTIME
for i in $(seq "$n"); do echo x > "$d/s/$i"; done
g=$EPOCHREALTIME
rm -rf "$d"
echo "$a $b $c $e $g $dropped"
"#;

/// One iteration's figures: write MB/s, read MB/s, small files ms, caches dropped, and the
/// exec's whole HTTP time (ms).
struct Io {
    write: f64,
    read: f64,
    small: f64,
    dropped: bool,
    wall: f64,
}

fn io_once(api: &Api, sb: &str, place: Place, mib: u32, files: u32) -> Result<Io, String> {
    let path = format!("/v1/sandboxes/{sb}/exec");
    let body = json!({
        "cmd": ["bash", "-c", SCRIPT, "bash", place.dir(), mib.to_string(), files.to_string()],
        "timeout_ms": 120000,
    });
    let t0 = Instant::now();
    let r = want(&path, post(api, &path, &body)?, 200)?;
    let wall = ms(t0);
    if r["exit_code"] != 0 {
        return Err(format!(
            "the I/O script failed in {}: {}",
            place.label(),
            r["stderr"].as_str().unwrap_or_default().trim()
        ));
    }
    let out = r["stdout"].as_str().unwrap_or_default();
    let f: Vec<f64> = out
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let [a, b, c, e, g, dropped] = f[..] else {
        return Err(format!("the I/O script printed {out:?}"));
    };
    let mb = f64::from(mib) * 1_048_576.0 / 1e6;
    Ok(Io {
        write: mb / (b - a),
        read: mb / (e - c),
        small: (g - e) * 1e3,
        dropped: dropped == 1.0,
        wall,
    })
}

/// The state of a microVM machine directory, when its QEMU runs.
fn live_vm(dir: &Path) -> Option<VmState> {
    VmState::load(dir).filter(vm::is_alive)
}

/// The microVMs the server's pool holds: machines under `<data>/sandboxes` with a live QEMU
/// that are none of `ours` (the only sandboxes this server has).
fn waiting(srv: &Server, ours: &[String]) -> Vec<VmState> {
    subdirs(&srv.data_dir.join("sandboxes"))
        .iter()
        .filter(|d| {
            d.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !ours.iter().any(|o| o == n))
        })
        .filter_map(|d| live_vm(d))
        .collect()
}

/// Whether a microVM is being torn down (its directory there, its QEMU gone).
fn tearing_down(srv: &Server) -> bool {
    ["sandboxes", "pool"]
        .iter()
        .flat_map(|d| subdirs(&srv.data_dir.join(d)))
        .any(|d| vm::is_vm_dir(&d) && live_vm(&d).is_none())
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces) in parentheses.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Waits (up to 60 s) until the pool holds a microVM that is ready, no machine is being
/// torn down, and the waiting QEMUs are idle (under 10% of a CPU over 200 ms: the pool's
/// restore and warm-up commands are done). The id of the waiting machine.
fn wait_for_pool(srv: &Server, ours: &[String]) -> Result<String, String> {
    let t0 = Instant::now();
    // Clock ticks in the 200 ms window.
    let window = 0.2 * clk_tck();
    loop {
        check_stop().map_err(|e| e.to_string())?;
        if t0.elapsed() > Duration::from_secs(60) {
            return Err(
                "the server's microVM pool held no ready machine within 60 s of the last run"
                    .into(),
            );
        }
        let w = waiting(srv, ours);
        if w.is_empty() || tearing_down(srv) {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        let before: Vec<Option<u64>> = w.iter().map(|s| cpu_ticks(s.pid)).collect();
        std::thread::sleep(Duration::from_millis(200));
        let idle = w.iter().zip(&before).all(|(s, b)| {
            matches!((b, cpu_ticks(s.pid)), (Some(b), Some(a)) if (a.saturating_sub(*b) as f64) < window * 0.1)
        });
        if idle {
            return Ok(w[0].id.clone());
        }
    }
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Whether the machine that waited in the pool (`id`) was taken: its QEMU goes within 5 s
/// of the answer (a run stops its machine before answering; a machine left waiting stays).
fn was_taken(srv: &Server, id: &str) -> bool {
    let dir = srv.data_dir.join("sandboxes").join(id);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if live_vm(&dir).is_none() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// (client wall ms, the server's queue_ms) of one run of `true` on `vol`.
fn run_true(api: &Api, vol: &str, runtime: &str) -> Result<(f64, f64), String> {
    let path = format!("/v1/volumes/{vol}/run");
    let mut body = json!({"cmd": ["true"], "runtime": runtime});
    if runtime == "microvm" {
        body["memory_mb"] = json!(VM_MEMORY_MB);
    }
    let t0 = Instant::now();
    let r = want(&path, post(api, &path, &body)?, 200)?;
    let wall = ms(t0);
    if r["exit_code"] != 0 {
        return Err(format!("`true` in a {runtime} run did not exit 0: {r}"));
    }
    Ok((wall, r["timings"]["queue_ms"].as_f64().unwrap_or(f64::NAN)))
}

fn create(api: &Api, body: &Value) -> Result<String, String> {
    let v = want("/v1/sandboxes", post(api, "/v1/sandboxes", body)?, 201)?;
    Ok(v["id"].as_str().unwrap_or_default().to_owned())
}

pub fn rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let bases_before = bases();
    let srv = Server::start();
    let api = srv.api();
    let vol = want(
        "/v1/volumes",
        post(
            &api,
            "/v1/volumes",
            &json!({"name": "bench-vm-volumes", "size_mb": 1024}),
        )
        .map_err(anyhow::Error::msg)?,
        201,
    )
    .map_err(anyhow::Error::msg)?;
    let vol = vol["id"].as_str().unwrap_or_default().to_owned();
    let r = measure(args, &srv, &api, &vol, rows);
    delete(&api, &format!("/v1/volumes/{vol}"));
    drop(srv);
    // The bases this group booted for shapes no machine had are not wanted after it.
    for b in bases().difference(&bases_before) {
        let _ = std::fs::remove_dir_all(b);
        let _ = std::fs::remove_file(b.with_extension("lock"));
    }
    r
}

fn measure(
    args: &Args,
    srv: &Server,
    api: &Api,
    vol: &str,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let n = args.creates().min(15);
    // Jail runs first, one after another as in the runs group, before any microVM exists.
    let mut jail = Vec::with_capacity(n);
    for i in 0..1 + n {
        check_stop()?;
        let (w, _) = run_true(api, vol, "jail").map_err(anyhow::Error::msg)?;
        if i > 0 {
            jail.push(w);
        }
    }
    println!("  {RUN_JAIL}: p50 {:.1} ms", percentile(&jail, 50.0));
    rows.push(Row::new(RUN_JAIL, "ms", jail, 1).note("POST /v1/volumes/{id}/run {\"cmd\":[\"true\"],\"runtime\":\"jail\"} until answered, one at a time, on the same server and volume as the microVM runs (default shape, 512 MB; the server's warm pool of jails, --warm-pool 2)"));

    // The first microVM run: it makes the pool's shape known (and the base, if this host
    // has none of the shape yet); it is the warm-up.
    check_stop()?;
    let probe = run_true(api, vol, "microvm");
    let vm_ok = match probe {
        Ok(_) => true,
        Err(e) => {
            let why = format!("a microVM run on a volume failed: {e}");
            println!("  skipped: {why}");
            rows.push(Row::skipped(RUN_VM, &why));
            false
        }
    };
    if vm_ok {
        let (mut wall, mut queue, mut pooled, mut waits) = (vec![], vec![], 0, vec![]);
        for _ in 0..n {
            let t = Instant::now();
            let id = wait_for_pool(srv, &[]).map_err(anyhow::Error::msg)?;
            waits.push(t.elapsed().as_secs_f64());
            let (w, q) = run_true(api, vol, "microvm").map_err(anyhow::Error::msg)?;
            wall.push(w);
            queue.push(q);
            pooled += usize::from(was_taken(srv, &id));
        }
        println!(
            "  {RUN_VM}: p50 {:.1} ms ({pooled} of {n} from the pool)",
            percentile(&wall, 50.0)
        );
        rows.push(
            Row::new(RUN_VM, "ms", wall, 1)
                .note(format!("POST /v1/volumes/{{id}}/run {{\"cmd\":[\"true\"],\"runtime\":\"microvm\",\"memory_mb\":{VM_MEMORY_MB}}} until answered, one at a time: a ready microVM taken from the server's pool (--vm-pool 1) is served the run's copy-on-write layer of the volume (a file server, a FUSE mount in the guest), runs `true`, is stopped, the changes are listed and committed (none)"))
                .note(format!("before each run the bench waited (not counted; p50 {:.1} s) until the pool held a ready machine again, idle, with no machine being torn down; {pooled} of {n} runs took the waiting machine (its QEMU was gone after the answer) and {} restored a fresh one; the server's timings.queue_ms (arrival until the command was handed to the machine) p50 {:.1} / max {:.1} ms", percentile(&waits, 50.0), n - pooled, percentile(&queue, 50.0), percentile(&queue, 100.0)))
                .vs(RUN_JAIL)
                .vs(crate::runs::TOTAL),
        );
    }
    check_stop()?;
    io_rows(srv, api, vol, vm_ok, rows)
}

fn io_rows(
    srv: &Server,
    api: &Api,
    vol: &str,
    vm_ok: bool,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let mount = json!([{"volume": vol, "path": "/workspace"}]);
    let jail_sb =
        create(api, &json!({"runtime": "jail", "volumes": mount})).map_err(anyhow::Error::msg)?;
    let vm_sb = if vm_ok {
        create(
            api,
            &json!({"runtime": "microvm", "memory_mb": VM_MEMORY_MB, "volumes": mount}),
        )
    } else {
        Err("a microVM run on a volume failed (see the run row)".to_owned())
    };
    let r = (|| -> anyhow::Result<()> {
        let mut places = vec![(Place::Jail, jail_sb.clone())];
        match &vm_sb {
            Ok(id) => {
                places.insert(0, (Place::Fuse, id.clone()));
                places.push((Place::Disk, id.clone()));
                // The pool refills after the create took its machine: let it finish first.
                wait_for_pool(srv, std::slice::from_ref(id)).map_err(anyhow::Error::msg)?;
            }
            Err(e) => {
                for p in [Place::Fuse, Place::Disk] {
                    for name in [p.write(), p.read(), p.small()] {
                        rows.push(Row::skipped(
                            name,
                            format!("no microVM sandbox with a volume: {e}"),
                        ));
                    }
                }
            }
        }
        // A smaller warm-up iteration (under TCG a process's first run translates its
        // code), then the measured ones, the places taking turns.
        let mut got: Vec<Vec<Io>> = places.iter().map(|_| Vec::new()).collect();
        for i in 0..=IO_REPS {
            for (k, (place, sb)) in places.iter().enumerate() {
                check_stop()?;
                let (mib, files) = if i == 0 { (8, 100) } else { (MIB, FILES) };
                let io = io_once(api, sb, *place, mib, files).map_err(anyhow::Error::msg)?;
                if i > 0 {
                    got[k].push(io);
                }
            }
        }
        // By operation: the FUSE row (with the ratios), the jail's, the microVM disk's.
        let mut by_place: Vec<std::vec::IntoIter<Row>> = places
            .iter()
            .zip(got)
            .map(|((place, _), ios)| io_place_rows(*place, &ios).into_iter())
            .collect();
        for _ in 0..3 {
            rows.extend(by_place.iter_mut().filter_map(Iterator::next));
        }
        Ok(())
    })();
    delete(api, &format!("/v1/sandboxes/{jail_sb}"));
    if let Ok(id) = &vm_sb {
        delete(api, &format!("/v1/sandboxes/{id}"));
    }
    r
}

/// The write, read and small-files rows of one place.
fn io_place_rows(place: Place, ios: &[Io]) -> Vec<Row> {
    let pick = |f: fn(&Io) -> f64| ios.iter().map(f).collect::<Vec<f64>>();
    let (write, read, small) = (pick(|i| i.write), pick(|i| i.read), pick(|i| i.small));
    let walls = pick(|i| i.wall);
    let dropped = ios.iter().filter(|i| i.dropped).count();
    let dir = place.dir();
    let how = match place {
        Place::Fuse => "a microVM sandbox (256 MB) with the volume at /workspace: the guest's FUSE mount, its requests over a virtio-serial port to the host's file server, which works on the volume's filesystem",
        Place::Jail => "a jail sandbox with the same volume at /workspace: a bind mount of the volume's filesystem",
        Place::Disk => "the same microVM sandbox's own disk, the reference for what FUSE costs: /root is in the guest's root, an overlay whose writable layer is ext4 on the machine's virtio block disk (an image file on the host)",
    };
    let common = format!(
        "{how}; timed in the machine with bash's $EPOCHREALTIME, one exec of a script per iteration (the places take turns); {IO_REPS} iterations after one warm-up iteration of 8 MiB and 100 files; the whole exec (HTTP) p50 {:.0} ms",
        percentile(&walls, 50.0)
    );
    let cache = if dropped == ios.len() {
        "`echo 3 > /proc/sys/vm/drop_caches` in the machine before reading: the machine's page cache was emptied (the host's page cache, which holds the volume's and the disk image's pages, was not)".to_owned()
    } else if dropped == 0 {
        "the machine may not drop caches (`echo 3 > /proc/sys/vm/drop_caches` refused): the read is served from the host's page cache (the file was just written)".to_owned()
    } else {
        format!("caches dropped in {dropped} of {} iterations", ios.len())
    };
    // The FUSE rows carry the ratios: to the jail's bind mount and to the microVM's disk.
    let vs = |mut r: Row, name: fn(Place) -> String| {
        if place == Place::Fuse {
            r = r.vs(&name(Place::Jail)).vs(&name(Place::Disk));
        }
        r
    };
    println!(
        "  {}: write {:.1} MB/s, read {:.1} MB/s, {FILES} files {:.0} ms",
        place.label(),
        percentile(&write, 50.0),
        percentile(&read, 50.0),
        percentile(&small, 50.0)
    );
    vec![
        vs(
            Row::new(place.write(), "MB/s", write, 1).note(format!(
                "dd if=/dev/zero of={dir}/f bs=1M count={MIB} conv=fsync (MB = 10^6 bytes; ratios of MB/s rows are of throughputs: below 1 is slower); {common}"
            )),
            Place::write,
        ),
        vs(
            Row::new(place.read(), "MB/s", read, 1).note(format!(
                "dd if={dir}/f of=/dev/null bs=1M after the write and `sync`; {cache}; {common}"
            )),
            Place::read,
        ),
        vs(
            Row::new(place.small(), "ms", small, 1).note(format!(
                "for i in $(seq {FILES}); do echo x > {dir}/s/$i; done (no sync); {common}"
            )),
            Place::small,
        ),
    ]
}
