//! Ready microVMs: restored from their base, warmed, waiting to become sandboxes.
//!
//! Restoring a microVM takes about a tenth of a second, and under TCG its first command pays
//! again for translating the guest's exec path (a new QEMU process starts with an empty
//! translation cache). This room keeps, per shape (template, cpus, memory, disk) that has
//! been asked for, up to `size` machines already restored, with one command already run in
//! them, so a create takes one and only refreshes its clock and entropy. A pooled machine is
//! made under a fresh sandbox id in the sandboxes directory, so taking it needs no renaming:
//! the sandbox gets the machine's id. Machines are never shared or reused: one taken is the
//! sandbox's from then on, and the pool makes a new one in the background.
//!
//! Jails of a template with Jupyter's Python kernel (`ipykernel` and `jupyter_client`, like
//! `code-interpreter`) are kept here too, in shapes of their own ([`Flavor::CodeJail`]): a jail
//! is made in ~15 ms, but the code interpreter's driver and a kernel take a second or more to
//! start, so a pooled one has both started (`code::prestart`) and the sandbox's first
//! Python context takes the waiting kernel. A jail is only pooled for such a template, and
//! only with nothing a pooled machine could not have had: no volumes, no environment of its
//! own (a jail's network policy is applied after it is taken, as to any new jail).
//!
//! MicroVMs of such a template get the same ([`Flavor::CodeVm`]): restored, warmed, and then
//! the driver and a spare kernel started in the guest, so the first cell of a microVM sandbox
//! pays no kernel start either. The kernel is started in each pooled machine after its
//! restore (whose refresh gave it its own clock and entropy), not kept in the template's
//! memory base: a kernel in the base would be restored into every machine of the template
//! (code or not) with the same connection key, session id and random state. It is pooled
//! only for a sandbox with no environment of its own (the driver, and every kernel it starts,
//! gets the sandbox's environment at its start); one with an environment gets a plain
//! pooled microVM.
//!
//! Only microVMs with nothing attached at restore (no snapshot, egress `none`) come from the
//! pool; volumes are served to a machine after it is taken (a sandbox's, or a run's). Pooled
//! machines belong to no tenant (no record): a server that stops destroys them (after the
//! fillers in flight are done: they make no more once a stop began), and one killed leaves
//! them to the next start's orphan clean-up.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use locker_runtime::node::{Attach, Machine, MachineSpec, Node, RuntimeKind};

use crate::ids::new_id;
use crate::limits::PIDS;

/// Machines of one shape are interchangeable (a microVM's, or a jail's with its code
/// driver: template, CPUs, memory, disk; not the run pool's `pool::JailShape`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VmShape {
    pub template_digest: String,
    pub cpus_milli: u64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub flavor: Flavor,
}

/// What a pooled machine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flavor {
    /// A restored microVM with a first command run.
    Microvm,
    /// A jail with the code interpreter's driver and a spare Python kernel started.
    CodeJail,
    /// A restored microVM with a first command run, then its code driver and a spare Python
    /// kernel started (see the module doc).
    CodeVm,
}

impl VmShape {
    /// A microVM's shape.
    pub fn new(template_digest: &str, cpus: f64, memory_mb: u64, disk_mb: u64) -> Self {
        Self {
            template_digest: template_digest.to_owned(),
            cpus_milli: (cpus * 1000.0).round() as u64,
            memory_mb,
            disk_mb,
            flavor: Flavor::Microvm,
        }
    }

    /// A jail's with a kernel ready (see the module doc).
    pub fn code_jail(template_digest: &str, cpus: f64, memory_mb: u64, disk_mb: u64) -> Self {
        Self {
            flavor: Flavor::CodeJail,
            ..Self::new(template_digest, cpus, memory_mb, disk_mb)
        }
    }

    /// A microVM's with a kernel ready (see the module doc).
    pub fn code_vm(template_digest: &str, cpus: f64, memory_mb: u64, disk_mb: u64) -> Self {
        Self {
            flavor: Flavor::CodeVm,
            ..Self::new(template_digest, cpus, memory_mb, disk_mb)
        }
    }
}

/// Whether a template's root filesystem has Python's `ipykernel` and `jupyter_client` in one
/// of the places Debian's `python3` imports from (its packages', or pip's under /usr/local).
pub fn has_jupyter_kernel(rootfs: &std::path::Path) -> bool {
    let mut dirs = vec![rootfs.join("usr/lib/python3/dist-packages")];
    for base in ["usr/local/lib", "usr/lib"] {
        if let Ok(entries) = std::fs::read_dir(rootfs.join(base)) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("python3") {
                    dirs.push(e.path().join("dist-packages"));
                    dirs.push(e.path().join("site-packages"));
                }
            }
        }
    }
    let has = |module: &str| {
        dirs.iter()
            .any(|d| d.join(module).join("__init__.py").is_file())
    };
    has("ipykernel") && has("jupyter_client")
}

/// The pool (see the module doc).
#[derive(Debug)]
pub struct VmPool {
    size: usize,
    /// Makes and destroys its machines.
    node: Arc<Node>,
    /// Where its machines' directories are: the sandboxes directory, so a machine taken
    /// is already where a sandbox's is.
    dir: PathBuf,
    ready: Mutex<HashMap<VmShape, Vec<Machine>>>,
    filling: Mutex<HashSet<VmShape>>,
    /// Whether each template (by digest) has a Jupyter kernel ([`has_jupyter_kernel`]).
    kernels: Mutex<HashMap<String, bool>>,
    /// The fillers started, and whether a stop began (then no filler starts or goes on).
    fillers: Mutex<Fillers>,
}

#[derive(Debug, Default)]
struct Fillers {
    closing: bool,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// How long a stop waits for a machine being made to be done.
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl VmPool {
    /// Up to `size` ready machines per shape (0: none, every create restores), made by
    /// `node` in `dir`.
    pub fn new(size: usize, node: Arc<Node>, dir: PathBuf) -> Self {
        Self {
            size,
            node,
            dir,
            ready: Default::default(),
            filling: Default::default(),
            kernels: Default::default(),
            fillers: Default::default(),
        }
    }

    /// Whether jails of this template are pooled with a kernel (asked once per template).
    pub fn pools_kernels(&self, digest: &str, rootfs: &std::path::Path) -> bool {
        if self.size == 0 {
            return false;
        }
        let mut known = self.kernels.lock().expect("pool lock");
        *known
            .entry(digest.to_owned())
            .or_insert_with(|| has_jupyter_kernel(rootfs))
    }

    /// A ready machine of `shape`, if one waits (alive: a dead one is dropped).
    pub fn take(&self, shape: &VmShape) -> Option<Machine> {
        let mut ready = self.ready.lock().expect("pool lock");
        let list = ready.get_mut(shape)?;
        while let Some(m) = list.pop() {
            if m.is_alive() {
                return Some(m);
            }
            tracing::warn!(machine = %m.id, "a pooled microVM died while waiting; dropped");
        }
        None
    }

    /// Puts back a machine taken but not used (the create failed before using it).
    pub fn put_back(&self, shape: VmShape, m: Machine) {
        self.ready
            .lock()
            .expect("pool lock")
            .entry(shape)
            .or_default()
            .push(m);
    }

    fn count(&self, shape: &VmShape) -> usize {
        self.ready
            .lock()
            .expect("pool lock")
            .get(shape)
            .map_or(0, Vec::len)
    }

    fn is_closing(&self) -> bool {
        self.fillers.lock().expect("pool lock").closing
    }

    /// Makes machines of `shape` in the background until `size` wait (one filler per shape).
    pub fn refill(self: &Arc<Self>, shape: VmShape, rootfs: PathBuf, cpus: f64) {
        let mut fillers = self.fillers.lock().expect("pool lock");
        if self.size == 0
            || fillers.closing
            || !self
                .filling
                .lock()
                .expect("pool lock")
                .insert(shape.clone())
        {
            return;
        }
        fillers.tasks.retain(|t| !t.is_finished());
        let pool = self.clone();
        fillers.tasks.push(tokio::spawn(async move {
            while pool.count(&shape) < pool.size && !pool.is_closing() {
                match pool.make(&shape, &rootfs, cpus).await {
                    Ok(m) if pool.is_closing() => {
                        let _ = pool.node.destroy(&m).await;
                    }
                    Ok(m) => pool.put_back(shape.clone(), m),
                    Err(e) => {
                        tracing::warn!(error = %e, "could not make a pooled microVM");
                        break;
                    }
                }
            }
            pool.filling.lock().expect("pool lock").remove(&shape);
        }));
    }

    /// Destroys every waiting machine (at shutdown), after the fillers in flight are done.
    pub async fn drain(&self) {
        let tasks = {
            let mut f = self.fillers.lock().expect("pool lock");
            f.closing = true;
            std::mem::take(&mut f.tasks)
        };
        for mut t in tasks {
            if tokio::time::timeout(DRAIN_WAIT, &mut t).await.is_err() {
                tracing::warn!("a pooled microVM was still being made at shutdown: left to the next start's clean-up");
                t.abort();
            }
        }
        let all: Vec<Machine> = self
            .ready
            .lock()
            .expect("pool lock")
            .drain()
            .flat_map(|(_, v)| v)
            .collect();
        for m in all {
            let _ = self.node.destroy(&m).await;
        }
    }

    /// One ready machine of `shape`'s flavor.
    async fn make(
        &self,
        shape: &VmShape,
        rootfs: &std::path::Path,
        cpus: f64,
    ) -> Result<Machine, String> {
        match shape.flavor {
            Flavor::Microvm => self.make_vm(shape, rootfs, cpus).await,
            Flavor::CodeJail => {
                let spec = self.spec(shape, rootfs, cpus);
                let m = self
                    .node
                    .create_attached(spec, Attach::default())
                    .await
                    .map_err(|e| e.to_string())?;
                self.with_kernel(m).await
            }
            Flavor::CodeVm => {
                let m = self.make_vm(shape, rootfs, cpus).await?;
                self.with_kernel(m).await
            }
        }
    }

    /// A new machine's spec for `shape`, with a fresh id.
    fn spec(&self, shape: &VmShape, rootfs: &std::path::Path, cpus: f64) -> MachineSpec {
        let id = new_id("sb_");
        MachineSpec {
            dir: self.dir.join(&id),
            id,
            template_rootfs: rootfs.to_owned(),
            cpus,
            memory_mb: shape.memory_mb,
            disk_mb: shape.disk_mb,
            pids: PIDS,
        }
    }

    /// `m` with the code driver and a spare kernel started in it (destroyed if they fail).
    async fn with_kernel(&self, m: Machine) -> Result<Machine, String> {
        if let Err(e) = crate::code::prestart(&m).await {
            let _ = self.node.destroy(&m).await;
            return Err(format!("starting a pooled machine's kernel: {e}"));
        }
        Ok(m)
    }

    /// One ready microVM: restored, with a first command run (the guest's exec path is then
    /// translated and cached, under TCG the larger part of a first command's time).
    async fn make_vm(
        &self,
        shape: &VmShape,
        rootfs: &std::path::Path,
        cpus: f64,
    ) -> Result<Machine, String> {
        let spec = self.spec(shape, rootfs, cpus);
        let m = self
            .node
            .create_attached(
                spec,
                Attach {
                    runtime: RuntimeKind::Microvm,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| e.to_string())?;
        let warm = locker_proto::ExecSpec {
            call_id: "pool-warm-up".into(),
            argv: vec!["/bin/sh".into(), "-c".into(), "true".into()],
            max_output_bytes: 4096,
            timeout_ms: Some(30_000),
            ..Default::default()
        };
        // A shell and a plain program: the two ways first commands come.
        let mut direct = warm.clone();
        direct.argv = vec!["true".into()];
        for spec in [warm, direct] {
            if let Err(e) = m.agent.exec(spec, None, None).await {
                let _ = self.node.destroy(&m).await;
                return Err(format!("warming a pooled microVM: {e}"));
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_has_a_jupyter_kernel_when_both_modules_import() {
        let root = std::env::temp_dir().join(new_id("vm-pool-test-"));
        let module = |dir: &str, name: &str| {
            let d = root.join(dir).join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("__init__.py"), "").unwrap();
        };
        assert!(!has_jupyter_kernel(&root), "an empty root");
        module("usr/lib/python3/dist-packages", "ipykernel");
        assert!(!has_jupyter_kernel(&root), "ipykernel alone");
        // pip's place in Debian counts too.
        module("usr/local/lib/python3.11/dist-packages", "jupyter_client");
        assert!(has_jupyter_kernel(&root));
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(
            VmShape::code_jail("d", 1.0, 512, 2048).flavor,
            Flavor::CodeJail
        );
        assert_ne!(
            VmShape::code_jail("d", 1.0, 512, 2048),
            VmShape::new("d", 1.0, 512, 2048),
            "a code jail's shape is not a microVM's"
        );
        assert_ne!(
            VmShape::code_vm("d", 1.0, 512, 2048),
            VmShape::new("d", 1.0, 512, 2048),
            "a microVM with a kernel is not a plain microVM"
        );
        assert_ne!(
            VmShape::code_vm("d", 1.0, 512, 2048),
            VmShape::code_jail("d", 1.0, 512, 2048)
        );
    }
}
