//! The node layer: what turns a template into a running machine and talks to its agent.
//!
//! Rooms:
//! - [`template`]: building, importing and finding templates (root filesystems by digest).
//! - [`agent`]: the host side of the agent channel (tokio; speaks `locker-proto`).
//! - [`jail`]: the namespace runtime (user, mount, pid, net, ipc, uts, cgroup namespaces).
//! - [`cgroup`]: cgroup v1 and v2 limits, freezing and accounting for machines.
//! - [`doctor`]: what works on this host and why.
//! - [`fuse`]: the host side of a microVM's volume mounts (a FUSE passthrough server).
//! - [`host_agent`]: an agent on the host serving a volume's files with no machine.
//! - [`tree`]: directory trees of volumes: measured, and copied copy-on-write.
//! - [`vm`]: the microVM runtime (QEMU `microvm`, restored from booted snapshots).
//! - [`vm_fs`]: volumes in microVMs: the per-VM file server process.
//! - [`view`]: what a jail sees of its own CPUs and memory (pinning, `/proc/meminfo`).
//! - [`net`]: network egress of machines (veth, subnet leases, nftables), enforced outside them.
//!
//! This crate knows nothing of HTTP, tenants or the database: the server owns those.

pub mod agent;
pub mod cgroup;
pub mod disk;
pub mod doctor;
pub mod fuse;
pub mod host_agent;
pub mod jail;
pub mod net;
pub mod node;
pub mod seccomp;
mod sys;
pub mod template;
pub mod tree;
pub mod view;
pub mod vm;
pub mod vm_fs;
pub mod volume_fs;
