//! The warm jail pool of runs: ready jails, per shape, waiting for a run to claim one (see
//! [`Pool`]), and the turns runs' machines take to be torn down.
//!
//! It holds narrow handles (the node, its own directory), not the server's state: it knows
//! no tenants, volumes or requests, and the run's layer is mounted by the caller
//! (`Node::attach`). It must not be used for sandboxes (their microVMs have `vm_pool`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use locker_runtime::machine::Scratch;
use locker_runtime::node::{Attach, Machine, MachineSpec, Node};
use locker_runtime::template::Template;

use crate::ids::new_id;
use crate::limits::PIDS;

/// Ids of warm machines start with this (their directories are `<data-dir>/pool/<id>`).
const POOL_PREFIX: &str = "pool_";

/// Where warm machines (and runs' machines) live under a data dir.
pub fn pool_dir(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("pool")
}

/// Warm machines for runs, per shape (template, CPUs, memory; one runtime today): ready
/// jails waiting for a run to claim one. A run takes one, gets its volume layer mounted
/// into it (`Node::attach`), runs, and the machine is destroyed: never reused for another
/// call. A background task keeps `target` machines ready for each shape in demand: the
/// default shape (the `default` template, 1 CPU, 512 MB) from the start, and every shape a
/// run asked for (up to [`MAX_SHAPES`], the least recently used dropped first).
pub struct Pool {
    target: usize,
    node: Arc<Node>,
    /// Where its machines' directories are ([`pool_dir`]).
    dir: PathBuf,
    /// The disk of every machine it makes (a run's machine disk).
    disk_mb: u64,
    shapes: std::sync::Mutex<Vec<JailShape>>,
    retired: std::sync::Mutex<Vec<Machine>>,
    wake: tokio::sync::Notify,
    /// Turns to destroy a run's machine (see [`DESTROYS_AT_ONCE`]).
    destroying: tokio::sync::Semaphore,
    /// The runs getting their machine now ([`Pool::starting`]).
    starting: StartGate,
    /// Set by [`Pool::drain`]: the refill task makes no more machines and ends.
    closing: std::sync::atomic::AtomicBool,
    /// The refill task, for [`Pool::drain`] to wait for.
    refill: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// How long a stop waits for a machine being made (or torn down) to be done.
const DRAIN_WAIT: Duration = Duration::from_secs(30);

/// Runs' machines torn down at once, at most; the others wait for a turn (their layers no
/// longer change: nothing but the agent is left in them, or nothing at all).
const DESTROYS_AT_ONCE: usize = 2;

/// How long a finished run's teardown waits, at most, for the runs getting their machine
/// to have got it (under a burst, the teardowns then follow the starts instead of taking
/// the CPU from them; a steady stream of runs never defers a teardown longer than this).
const DESTROY_DEFER: Duration = Duration::from_secs(2);

/// A count of runs getting their machine, that teardowns wait on.
struct StartGate(tokio::sync::watch::Sender<usize>);

impl Default for StartGate {
    fn default() -> Self {
        Self(tokio::sync::watch::Sender::new(0))
    }
}

impl StartGate {
    fn enter(&self) -> Starting<'_> {
        self.0.send_modify(|n| *n += 1);
        Starting(self)
    }

    /// Returns once no run is getting its machine, or after `max`.
    async fn none_within(&self, max: Duration) {
        let mut rx = self.0.subscribe();
        let _ = tokio::time::timeout(max, rx.wait_for(|n| *n == 0)).await;
    }
}

/// A run getting its machine (see [`Pool::starting`]).
pub struct Starting<'a>(&'a StartGate);

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        self.0 .0.send_modify(|n| *n -= 1);
    }
}

/// One shape kept warm (a jail's: template, CPUs, memory; not `vm_pool::VmShape`).
struct JailShape {
    template: Template,
    cpus: f64,
    memory_mb: u64,
    ready: Vec<Machine>,
}

impl JailShape {
    fn is(&self, digest: &str, cpus: f64, memory_mb: u64) -> bool {
        self.template.digest == digest && self.cpus == cpus && self.memory_mb == memory_mb
    }
}

/// Shapes kept warm at once.
pub const MAX_SHAPES: usize = 4;

impl Pool {
    /// A pool of `target` machines per shape (0: none; runs start their own), made by
    /// `node` in `dir`, each with `disk_mb` of disk.
    pub fn new(target: usize, node: Arc<Node>, dir: PathBuf, disk_mb: u64) -> Self {
        Self {
            target,
            node,
            dir,
            disk_mb,
            shapes: Default::default(),
            retired: Default::default(),
            wake: tokio::sync::Notify::new(),
            destroying: tokio::sync::Semaphore::new(DESTROYS_AT_ONCE),
            starting: StartGate::default(),
            closing: Default::default(),
            refill: Default::default(),
        }
    }

    fn is_closing(&self) -> bool {
        self.closing.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A warm machine of this shape, if one is ready; either way the shape is now in
    /// demand and the refill task is woken.
    pub fn claim(&self, template: &Template, cpus: f64, memory_mb: u64) -> Option<Machine> {
        if self.target == 0 {
            return None;
        }
        let mut shapes = self.shapes.lock().expect("pool");
        let got = match shapes
            .iter()
            .position(|s| s.is(&template.digest, cpus, memory_mb))
        {
            Some(i) => {
                // Most recently used last.
                let mut shape = shapes.remove(i);
                let m = shape.ready.pop();
                shapes.push(shape);
                m
            }
            None => {
                shapes.push(JailShape {
                    template: template.clone(),
                    cpus,
                    memory_mb,
                    ready: Vec::new(),
                });
                None
            }
        };
        let extra = shapes.len().saturating_sub(MAX_SHAPES);
        let dropped: Vec<JailShape> = shapes.drain(..extra).collect();
        drop(shapes);
        self.wake.notify_one();
        for s in dropped {
            self.retire(s.ready);
        }
        got
    }

    /// Machines no shape wants any more: the refill task destroys them.
    fn retire(&self, machines: Vec<Machine>) {
        self.retired.lock().expect("pool").extend(machines);
        self.wake.notify_one();
    }

    /// How many machines are ready now, all shapes.
    pub fn len(&self) -> usize {
        self.shapes
            .lock()
            .expect("pool")
            .iter()
            .map(|s| s.ready.len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first shape short of machines, if any.
    fn wanting(&self) -> Option<(Template, f64, u64)> {
        let shapes = self.shapes.lock().expect("pool");
        shapes
            .iter()
            .rev()
            .find(|s| s.ready.len() < self.target)
            .map(|s| (s.template.clone(), s.cpus, s.memory_mb))
    }

    /// Keeps the pool full, in the background, until [`Pool::drain`]; `default` (the
    /// template `default`, if this host has it) is in demand from the start.
    pub fn spawn_refill(self: &Arc<Self>, default: Option<Template>) {
        if self.target == 0 {
            return;
        }
        let pool = self.clone();
        let task = tokio::spawn(async move {
            match default {
                Some(t) => {
                    let _ = pool.claim(&t, POOL_CPUS, POOL_MEMORY_MB);
                }
                None => tracing::warn!("no `default` template: warm machines follow demand only"),
            }
            while !pool.is_closing() {
                let retired: Vec<_> = std::mem::take(&mut *pool.retired.lock().expect("pool"));
                for m in retired {
                    let _ = pool.node.destroy(&m).await;
                }
                while let Some((t, cpus, memory_mb)) = pool.wanting() {
                    if pool.is_closing() {
                        break;
                    }
                    let id = new_id(POOL_PREFIX);
                    let spec = MachineSpec {
                        id: id.clone(),
                        dir: pool.dir.join(&id),
                        template_rootfs: t.rootfs.clone(),
                        cpus,
                        memory_mb,
                        disk_mb: pool.disk_mb,
                        pids: PIDS,
                    };
                    // A run's machine keeps nothing it writes outside its volume: its
                    // layer lives in memory (no disk image to make and delete per run).
                    let attach = Attach {
                        scratch: Scratch::Memory,
                        ..Default::default()
                    };
                    match pool.node.create_attached(spec, attach).await {
                        Ok(m) => {
                            let mut shapes = pool.shapes.lock().expect("pool");
                            match shapes.iter_mut().find(|s| s.is(&t.digest, cpus, memory_mb)) {
                                Some(s) => s.ready.push(m),
                                None => {
                                    drop(shapes);
                                    pool.retire(vec![m]);
                                }
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "could not warm a machine for runs");
                            // Five seconds before the next try, unless a stop comes.
                            for _ in 0..50 {
                                if pool.is_closing() {
                                    break;
                                }
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    }
                }
                if !pool.is_closing() {
                    pool.wake.notified().await;
                }
            }
        });
        *self.refill.lock().expect("pool") = Some(task);
    }

    /// A turn to destroy a run's machine: once no run is getting its machine (or after
    /// [`DESTROY_DEFER`]), a few at a time, so that under a burst the teardowns of finished
    /// runs do not take the CPU from the runs still starting.
    pub async fn destroy_turn(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        self.starting.none_within(DESTROY_DEFER).await;
        self.destroying.acquire().await.ok()
    }

    /// Counts a run as getting its machine until the guard is dropped (when its command
    /// starts, or it failed).
    pub fn starting(&self) -> Starting<'_> {
        self.starting.enter()
    }

    /// Destroys every warm machine (at shutdown), after the refill task finished the
    /// machine it was making and the teardowns of runs' machines in flight are done.
    pub async fn drain(&self) {
        self.closing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.wake.notify_one();
        let task = self.refill.lock().expect("pool").take();
        if let Some(mut task) = task {
            if tokio::time::timeout(DRAIN_WAIT, &mut task).await.is_err() {
                tracing::warn!("a warm machine was still being made at shutdown: left to the next start's clean-up");
                task.abort();
            }
        }
        if tokio::time::timeout(
            DRAIN_WAIT,
            self.destroying.acquire_many(DESTROYS_AT_ONCE as u32),
        )
        .await
        .is_err()
        {
            tracing::warn!("runs' machines were still being torn down at shutdown: left to the next start's clean-up");
        }
        let mut all: Vec<_> = self
            .shapes
            .lock()
            .expect("pool")
            .iter_mut()
            .flat_map(|s| std::mem::take(&mut s.ready))
            .collect();
        all.append(&mut self.retired.lock().expect("pool"));
        for m in all {
            let _ = self.node.destroy(&m).await;
        }
    }
}

const POOL_CPUS: f64 = 1.0;
const POOL_MEMORY_MB: u64 = 512;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[tokio::test]
    async fn a_teardown_waits_for_the_runs_starting_but_never_longer_than_its_bound() {
        let gate = StartGate::default();
        let t = Instant::now();
        gate.none_within(Duration::from_secs(5)).await;
        assert!(
            t.elapsed() < Duration::from_millis(50),
            "none starting: at once"
        );

        let a = gate.enter();
        let b = gate.enter();
        let waiting = gate.none_within(Duration::from_secs(5));
        tokio::pin!(waiting);
        let early = tokio::time::timeout(Duration::from_millis(100), &mut waiting).await;
        assert!(early.is_err(), "returned while two runs were starting");
        drop(a);
        let early = tokio::time::timeout(Duration::from_millis(100), &mut waiting).await;
        assert!(early.is_err(), "returned while one run was starting");
        drop(b);
        let t = Instant::now();
        waiting.await;
        assert!(t.elapsed() < Duration::from_millis(50));

        let _held = gate.enter();
        let t = Instant::now();
        gate.none_within(Duration::from_millis(200)).await;
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(190) && took < Duration::from_secs(2),
            "bounded: {took:?}"
        );
    }
}
