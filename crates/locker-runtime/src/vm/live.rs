//! A running machine carried out live (QEMU's pre-copy migration): the guest goes on while
//! its disk and memory leave, and stops only for the last copy of what it changed since.
//!
//! What leaves is a memory snapshot's directory, written as it is sent (the host keeps it:
//! if the move fails after the machine is gone, the machine starts again from it), in two
//! steps:
//! 1. [`prepare_out`]: a zero-copy point ([`super::stack::point`], the guest stopped for
//!    the switch alone, milliseconds) makes everything the machine wrote so far a read-only
//!    layer; every layer is linked into the directory (`lower/1.<ext>`, …) and may be sent
//!    while the guest runs on, writing into its new blank overlay;
//! 2. [`migrate_out`]: QEMU migrates into a pipe while the guest runs: a first pass over
//!    all its RAM, then passes over the pages dirtied meanwhile, until what is left fits
//!    in [`DOWNTIME_MS`] at the rate the pipe is read; then QEMU stops the guest, sends the
//!    rest and its device state, and flushes the overlay. Every byte is written to
//!    `memory` in the directory and handed to the caller's sink (whose pace is the
//!    migration's bandwidth). A guest that dirties memory faster than it can leave is
//!    not moved live: once [`PRECOPY_MAX`] (`LOCKER_CARRY_LIVE_MAX_S`) has passed or the
//!    stream has grown to [`STREAM_FACTOR`] times its RAM the migration is cancelled (the
//!    guest runs on) and the move fails, to be made cold (see `watch`). The
//!    overlay (what the guest wrote since the point) is copied as the snapshot's own
//!    image.
//!
//! The stream is a migration stream like a snapshot's `memory` file, with some pages sent
//! more than once (a later copy overrides an earlier one): a machine restores from the
//! directory as from any memory snapshot ([`super::start`]), on another node or here.
//!
//! After [`migrate_out`] the machine's QEMU holds the guest stopped (`postmigrate`), its
//! images given up; [`super::ensure_running`] lets it run on where it was (a move that
//! failed). Owns no policy: whether a move is live and where it goes are the caller's.

use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::qmp::Qmp;
use super::stack::{self, Chain};
use super::{setup, VmError, VmState};

/// The guest's longest stop QEMU aims for at the switch, in ms (at the rate measured).
pub const DOWNTIME_MS: u64 = 100;
/// The longest the guest runs while its memory leaves before the host stops it, by
/// default (`LOCKER_CARRY_LIVE_MAX_S`).
pub const PRECOPY_MAX: Duration = Duration::from_secs(30);

/// [`PRECOPY_MAX`], or `LOCKER_CARRY_LIVE_MAX_S` seconds (0 to 3600).
fn precopy_max() -> Duration {
    std::env::var("LOCKER_CARRY_LIVE_MAX_S")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&s| s <= 3600)
        .map_or(PRECOPY_MAX, Duration::from_secs)
}
/// The stream's size, in multiples of the guest's RAM, past which the host stops it.
pub const STREAM_FACTOR: u64 = 3;
/// The bandwidth QEMU may use (its default is 32 MiB/s): the sink's pace limits it.
const MAX_BANDWIDTH: u64 = 1 << 34;
/// Bytes of the state file written back at a time while it is written.
const WRITEBACK: u64 = 32 << 20;
/// Bytes read from QEMU at a time.
const CHUNK: usize = 1 << 20;

/// A machine whose point was taken for a live move: the chain it writes now.
#[derive(Debug, Clone)]
pub struct Outgoing {
    chain: Chain,
}

/// What a live migration measured (QEMU's figures where it gives them).
#[derive(Debug, Clone, Copy, Default)]
pub struct LiveStats {
    /// The guest's stop on this side until QEMU finished: QEMU's own measure of its last
    /// copy, or, when the host had to stop the guest, from that stop.
    pub downtime_ms: u64,
    /// From `migrate` until QEMU finished.
    pub total_ms: u64,
    /// Bytes of the stream.
    pub bytes: u64,
    /// Passes over dirty memory QEMU made.
    pub passes: u64,
    /// From QEMU's end until the snapshot directory was whole (the memory on disk, the
    /// image copied): part of the guest's stop.
    pub finish_ms: u64,
}

/// Step 1 (see the module doc): the point, and the layers linked into `dir` (a snapshot
/// directory, closed to all but root) as `lower/1.<ext>`, …, with the network mark a
/// snapshot of this shape has (`nic_mark`). `None` when the machine's chain has no room
/// for another layer: the caller moves it cold.
pub fn prepare_out(
    s: &VmState,
    dir: &Path,
    nic_mark: Option<&str>,
) -> Result<Option<Outgoing>, VmError> {
    let chain = Chain::load(&s.dir).map_err(setup("read the machine's disk chain"))?;
    if chain.layers.len() + 3 > crate::disk::MAX_LAYERS {
        return Ok(None);
    }
    let layers = chain.layer_paths(&s.dir);
    if !layers.is_empty() {
        crate::disk::check_vm_stack(&layers).map_err(setup("check the machine's layers"))?;
    }
    let (name, node) = stack::prepare_point(&s.dir, s.uid, &chain)?;
    let mut q = Qmp::connect(&s.dir.join("qmp.sock"), Duration::from_secs(5))?;
    q.cmd("stop", json!({}))?;
    let moved = stack::point(&mut q, &s.dir, &chain, &name, &node);
    let cont = q.cmd("cont", json!({}));
    let moved = moved?;
    cont?;
    let Some(chain) = moved else {
        return Ok(None);
    };
    crate::disk::link_vm_stack(
        &chain.layer_paths(&s.dir),
        &dir.join(crate::disk::SNAPSHOT_LOWERS),
        1,
    )
    .map_err(setup("record the machine's layers"))?;
    if let Some(mark) = nic_mark {
        fs::write(dir.join(mark), b"").map_err(setup("mark the snapshot"))?;
    }
    s.mark_memory(dir)?;
    Ok(Some(Outgoing { chain }))
}

/// The name the image the guest writes now gets in the snapshot directory.
pub fn own_image_name(out: &Outgoing) -> String {
    stack::snapshot_name(Path::new(&out.chain.top))
}

/// Step 2 (see the module doc): migrates the running machine into `dir/memory` and `sink`,
/// then copies the image it wrote since the point into `dir` ([`own_image_name`]). The
/// guest is left stopped. Returns what QEMU measured and the copied image's path.
pub fn migrate_out(
    s: &VmState,
    dir: &Path,
    out: &Outgoing,
    sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
) -> Result<(LiveStats, PathBuf), VmError> {
    let t0 = Instant::now();
    let mut q = Qmp::connect(&s.dir.join("qmp.sock"), Duration::from_secs(5))?;
    q.ignore_shared()?;
    q.cmd(
        "migrate-set-parameters",
        json!({"max-bandwidth": MAX_BANDWIDTH, "downtime-limit": DOWNTIME_MS}),
    )?;
    let (r, w) = locker_sys::fd::pipe().map_err(setup("make the migration's pipe"))?;
    let mut memory =
        fs::File::create(dir.join("memory")).map_err(setup("create the state file"))?;
    q.cmd_fd("getfd", json!({"fdname": "live"}), Some(w.as_raw_fd()))?;
    drop(w);
    let sent = AtomicU64::new(0);
    let reader_failed = AtomicBool::new(false);
    let most = STREAM_FACTOR * (s.shape.memory_mb << 20);
    // QEMU's side is watched beside; the stream is read here, into the caller's sink.
    let (stats, read) = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            let stats = watch(&mut q, t0, &sent, most, &reader_failed);
            if stats.is_err() {
                let _ = q.cmd("migrate_cancel", json!({}));
            }
            stats
        });
        let mut pipe = fs::File::from(r);
        let mut buf = vec![0u8; CHUNK];
        let read = (|| loop {
            let n = match pipe.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            memory.write_all(&buf[..n])?;
            let before = sent.fetch_add(n as u64, Ordering::Relaxed);
            // Written back as it comes, so that the sync at the end (in the guest's stop)
            // has little left to do.
            if (before + n as u64) / WRITEBACK > before / WRITEBACK {
                let from = before / WRITEBACK * WRITEBACK;
                locker_sys::fd::start_writeback(&memory, from, WRITEBACK);
            }
            sink(&buf[..n])?;
        })();
        if read.is_err() {
            reader_failed.store(true, Ordering::Relaxed);
        }
        // Closing the pipe's end fails QEMU's next write: the migration ends.
        drop(pipe);
        let stats = watcher.join().unwrap_or_else(|_| {
            Err(VmError::Qemu {
                step: "the live migration",
                detail: "its watcher panicked".into(),
            })
        });
        (stats, read)
    });
    let mut stats = match (stats, read) {
        (Ok(st), Ok(())) => st,
        (Err(e), _) => return Err(e),
        (Ok(_), Err(e)) => return Err(setup("send the guest's memory")(e)),
    };
    let t_done = Instant::now();
    stats.bytes = sent.load(Ordering::Relaxed);
    memory.sync_all().map_err(setup("sync the state file"))?;
    // QEMU flushed and let go of the overlay at the end: copy what the guest wrote.
    let own = dir.join(own_image_name(out));
    crate::disk::copy_ephemeral(&out.chain.top_path(&s.dir), &own)
        .map_err(setup("copy the disk's overlay"))?;
    let f = fs::File::open(&own).map_err(setup("open the overlay's copy"))?;
    f.sync_all().map_err(setup("sync the overlay's copy"))?;
    fs::set_permissions(&own, fs::Permissions::from_mode(0o444))
        .map_err(setup("chmod the overlay's copy"))?;
    crate::disk::vm_stack_of(&dir.join("disk.img")).map_err(setup("check the snapshot"))?;
    stats.finish_ms = t_done.elapsed().as_millis() as u64;
    Ok((stats, own))
}

/// Follows the migration until QEMU finished it; stops the guest when it will not converge
/// (see the module doc).
fn watch(
    q: &mut Qmp,
    t0: Instant,
    sent: &AtomicU64,
    most: u64,
    reader_failed: &AtomicBool,
) -> Result<LiveStats, VmError> {
    q.cmd("migrate", json!({"uri": "fd:live"}))?;
    let mut unfilled = 0;
    let limit = precopy_max();
    loop {
        let st = q.cmd("query-migrate", json!({}))?;
        let n = |k: &str| st.get(k).and_then(Value::as_u64).unwrap_or(0);
        match st.get("status").and_then(Value::as_str) {
            // QEMU says "completed" a moment before it has filled in its times.
            Some("completed") if n("total-time") == 0 && unfilled < 100 => {
                unfilled += 1;
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Some("completed") => {
                return Ok(LiveStats {
                    downtime_ms: n("downtime"),
                    total_ms: n("total-time"),
                    bytes: 0,
                    passes: st["ram"]["dirty-sync-count"].as_u64().unwrap_or(0),
                    finish_ms: 0,
                })
            }
            Some("failed") | Some("cancelled") => {
                let why = st.get("error-desc").and_then(Value::as_str).unwrap_or(
                    if reader_failed.load(Ordering::Relaxed) {
                        "the receiver went away"
                    } else {
                        "no reason given"
                    },
                );
                return Err(VmError::Qemu {
                    step: "the live migration failed",
                    detail: why.to_owned(),
                });
            }
            _ => {}
        }
        if t0.elapsed() > limit || sent.load(Ordering::Relaxed) > most {
            // Given up, not forced to an end: a guest stopped for the rest of a pre-copy
            // that had not converged (by a `stop` from here, or by QEMU's own stop-and-copy
            // with no downtime limit) came up on the new node with memory that did not
            // match, about one move in ten here (a `cat` that segfaulted, an agent that
            // never answered; QEMU 7.2, TCG). The move fails, the guest runs on, and its
            // node moves it cold (frozen, all of its memory in one pass) from then on.
            tracing::info!(
                elapsed_ms = t0.elapsed().as_millis() as u64,
                sent = sent.load(Ordering::Relaxed),
                "the guest dirties memory faster than it leaves: the live move is given up"
            );
            return Err(VmError::Qemu {
                step: "the live migration",
                detail: format!(
                    "the guest dirties memory faster than it leaves ({} MB sent in {} s): it \
                     moves cold",
                    sent.load(Ordering::Relaxed) >> 20,
                    t0.elapsed().as_secs()
                ),
            });
        }
        if t0.elapsed() > PRECOPY_MAX * 10 {
            return Err(VmError::Qemu {
                step: "the live migration",
                detail: format!("not done after {} s", t0.elapsed().as_secs()),
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
