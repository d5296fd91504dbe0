//! The node layer: what turns a template into a running machine and talks to its agent.
//!
//! Rooms:
//! - [`node`]: the machines of a host, either runtime: create, adopt, destroy, egress,
//!   snapshots. The server's one door into this crate.
//! - [`machine`]: what both runtimes share: a machine's recorded state (`MachineState`),
//!   teardown and orphan clean-up, bind and overlay mounts, uid-range leases (`Slots`).
//! - [`jail`]: the namespace runtime (user, mount, pid, net, ipc, uts, cgroup namespaces):
//!   `spec`, `shim`, `setup` (PID 1's root in named steps), `attach`; with [`seccomp`]
//!   (the commands' filter), [`cgroup`] (v1 and v2 limits, freezing, accounting) and
//!   [`view`] (what a jail sees of its own CPUs and memory).
//! - [`vm`]: the microVM runtime (QEMU `microvm`, restored from booted snapshots): `accel`,
//!   `assets`, `qemu`, `qmp`, `base`; [`vm_fs`] is the per-VM file server process and
//!   [`fuse`] the FUSE passthrough server it runs.
//! - [`agent`]: the host side of the agent channel (tokio; speaks `locker-proto`): `conn`
//!   (connect, `Hello`, the reader's dispatch and the writer), `stream` (one request's
//!   frames and credit), and the calls by family: `control`, `exec`, `processes`, `files`.
//! - [`ports`]: the TCP ports listening in a machine, and tunnels to them over the agent
//!   channel (the way in for the server's port proxy; no route into or out of the machine).
//! - [`template`]: building, importing and finding templates (root filesystems by digest).
//! - [`disk`]: a machine's writable disk (an ext4 image per machine, from blank images);
//!   [`cow_disks`]: where disks and snapshots live so they share blocks on any host (an
//!   XFS image of Locker's own on a data dir that cannot reflink).
//! - [`net`]: network egress of machines, enforced outside them: `policy` (the policy and
//!   its CIDRs), `rules` (the nftables rulesets as text), `lease` (subnets), `nft` (running
//!   the tools, installing a ruleset), `link` (veth, tap, namespaces), `attach` (the ordered
//!   steps and their undoing), `cleanup`, `probe`.
//! - Volumes: [`commit`] (a run's changes, journalled and applied all or nothing), [`volume_fs`] (a volume's storage: btrfs images, snapshots, forks),
//!   [`tree`] (directory trees measured and copied copy-on-write) and [`host_agent`] (an
//!   agent on the host serving a volume's files with no machine).
//! - [`doctor`]: what works on this host and why.
//! - `sys`: the `locker-sys` calls the rooms above make, re-exported under one name (the
//!   calls and their `unsafe` live in that crate, each with its invariant).
//!
//! This crate knows nothing of HTTP, tenants or the database: the server owns those.

pub mod agent;
pub mod cgroup;
pub mod commit;
pub mod cow_disks;
pub mod dial;
pub mod disk;
pub mod doctor;
pub mod fuse;
pub mod host_agent;
pub mod jail;
pub mod machine;
pub mod net;
pub mod node;
pub mod ports;
pub mod seccomp;
mod sys;
pub mod template;
pub mod tree;
pub mod view;
pub mod vm;
pub mod vm_fs;
pub mod volume_fs;
