//! The machine layer both runtimes stand on: what a machine's directory records, how any
//! machine is stopped and torn down, the mounts a machine is given, and host-wide slot
//! leases.
//!
//! - [`state`]: [`MachineState`], a jail's or a microVM's record, read back from its
//!   directory (adoption, teardown).
//! - [`teardown`]: [`destroy`], [`stop`], [`cleanup_orphans`]: whatever the runtime, a
//!   machine's processes die with its cgroup, and its directory, network and uid lease go.
//! - [`mounts`]: [`BindMount`], [`OverlayMount`] (the shapes the server asks for) and the
//!   one place an overlay is mounted.
//! - [`slots`]: [`Slots`], a lease on a numbered host resource (uid ranges) as a lock file.
//!
//! It does not start machines (see [`crate::jail`] and [`crate::vm`]) and does not talk to
//! their agents (see [`crate::agent`]); [`crate::node`] puts the pieces together.

pub mod mounts;
pub mod slots;
pub mod state;
pub mod teardown;

pub use mounts::{blank_disks_dir, BindMount, OverlayMount};
pub use slots::{SlotError, Slots};
pub use state::MachineState;
pub use teardown::{cleanup_orphans, destroy, stop, TeardownError};
pub(crate) use teardown::{cmdline, is_running};

/// Where a jail's writable root layer (everything it writes outside its volumes, `/tmp`
/// and `/dev/shm`) lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scratch {
    /// A sparse ext4 image of `disk_mb` on a loop device: its own quota, independent of
    /// memory, and snapshots (the image is the snapshot). A sandbox's.
    #[default]
    Disk,
    /// A tmpfs in the machine's mount namespace, sized like `/tmp` (half the memory, at
    /// most `disk_mb`): its pages are charged to the machine's memory and go with it. No
    /// image to place, fill, attach, mount, unmount, detach or delete: what a run's
    /// machine, thrown away after one command, is spared (see docs/benchmarks.md). Needs
    /// id-mapped tmpfs mounts (Linux 6.3); elsewhere [`crate::node::Node`] gives a disk.
    Memory,
}

/// The file in a jail's directory that lists the loop devices its shim attached its images
/// to (`/dev/loopN`, a line each): its teardown waits for those to detach.
pub const LOOPS: &str = "loops";
