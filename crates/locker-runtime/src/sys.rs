//! The system calls the runtime's rooms use, by the names they call them: a list of
//! re-exports from `locker-sys`, where each one is written once with its invariant.
//!
//! Kept as a module of its own (rather than `use locker_sys as sys` at the crate root) so
//! that `crate::sys::<fn>` stays one flat namespace for the jail, node, net and vm rooms
//! while `locker-sys` is split by concern, and so this list says at a glance which
//! system calls the runtime makes. It holds no `unsafe` and must not grow any: a new call
//! goes into `locker-sys` and is re-exported here.

pub use locker_sys::fd::pipe;
pub use locker_sys::fs::{flock, lock_exclusive, set_times_nofollow, syncfs};
pub use locker_sys::host::{is_root, sethostname};
pub use locker_sys::ioctl::{flush_buffers, loop_attach, loop_attach_read_only, set_topdir};
pub use locker_sys::mount::{
    attach_tree, bind, idmapped_bind, idmapped_tree, make_mounts_private, mount, pivot_to_cwd,
    umount, umount_detach,
};
pub use locker_sys::net::loopback_up;
pub use locker_sys::proc::{
    affinity, clone_into_cgroup, die_with_parent, execveat, fork, keep_fds, kill, pidfd_open,
    pidfd_wait_exit, restrict_capabilities, set_no_new_privs, setns, unshare, waitpid, with_fs_ids,
};
pub use locker_sys::random::random_bytes;
