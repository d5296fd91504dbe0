//! What the jail's helper processes are told: the shim's [`JailSpec`] (`<dir>/jail.json`)
//! and the attach's [`AttachSpec`]. Plain data; it runs nothing.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::machine::{BindMount, OverlayMount, Scratch};

/// Everything the shim needs to build one machine (written as `<dir>/jail.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JailSpec {
    pub id: String,
    /// The template's root filesystem (never written to).
    pub template_rootfs: PathBuf,
    /// The machine's own directory on the host; created by [`start`], removed by [`destroy`].
    pub dir: PathBuf,
    pub uid_base: u32,
    pub cpus: f64,
    pub memory_mb: u64,
    pub pids: u64,
    pub disk_mb: u64,
    /// Where the machine's writable layer lives: a disk image of `disk_mb`, or memory.
    #[serde(default)]
    pub scratch: Scratch,
    /// Read-only layers between the template and the machine's own (always blank) disk,
    /// top first: a snapshot's layer stack (see [`crate::disk::stack_of`]). The shim
    /// links them into `<dir>/layers/` and the machine mounts each image read-only, its
    /// `upper` tree id-mapped, as a lower layer of its overlay root.
    #[serde(default)]
    pub layers: Vec<PathBuf>,
    /// The (static) agent binary, executed inside the machine.
    pub agent_path: PathBuf,
    pub hostname: String,
    /// Extra overlay mounts (a volume under a run's private copy-on-write layer), mounted
    /// in the machine's root before it pivots.
    #[serde(default)]
    pub mounts: Vec<OverlayMount>,
    /// Host directories bound into the machine (a volume's live tree), id-mapped.
    #[serde(default)]
    pub binds: Vec<BindMount>,
}

/// What `jail::attach` mounts into a running machine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttachSpec {
    pub agent_pid: i32,
    pub uid_base: u32,
    pub mount: OverlayMount,
}
