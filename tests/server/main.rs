//! End-to-end tests of `locker serve`: the real binary, real machines, plain HTTP, one
//! module per feature of the contract in `docs/api.md`, checked from the outside the way a
//! client sees it: status codes, the error shape, the typed ExecResult, streams that arrive
//! as output is produced, files that never leave the sandbox's root, tenants that never
//! see each other, a killed server that finds its machines again.
//!
//! The modules' tests share one server (`locker_tests::shared`: started on first use, shut
//! down when this binary exits, passed or failed), each test with a tenant of its own, so
//! they run side by side without seeing each other; a few modules share one sandbox among
//! tests that only run commands or touch paths of their own in it. Tests that need a fresh
//! server (a restart, a kill, flags, server-wide counters, measured memory) start their
//! own [`locker_tests::server::Server`]. Nothing outlives the binary: no machine, mount,
//! cgroup or process (`fixture` checks it).
//!
//! Run as root after `scripts/setup build` (release binaries and the default template):
//! `cargo test --release -p locker-tests --test server`, or one module with a filter such
//! as `-- exec::`.

mod auth;
mod conventions;
mod exec;
mod files;
mod fixture;
mod processes;
mod records;
mod restart;
mod sandboxes;
