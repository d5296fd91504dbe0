//! The drop guard of a machine's start: whatever step fails, or wherever its future is
//! dropped, nothing of the half-made machine stays. It tears down only through
//! [`crate::machine`].

use std::path::PathBuf;

use super::{MachineSpec, NodeError};
use crate::cgroup::Layout;
use crate::machine::{self, slots};

/// Tears down a machine whose start failed or was given up (its future dropped): its
/// processes, cgroup, directory and uid lease. [`Unwind::check`] does it before handing
/// the error on; a start cancelled at any await point gets it from `Drop`, on the blocking
/// pool, since nothing is left to await it.
pub(super) struct Unwind {
    id: String,
    dir: PathBuf,
    uid_base: u32,
    layout: Layout,
    armed: bool,
}

impl Unwind {
    pub(super) fn new(spec: &MachineSpec, uid_base: u32, layout: &Layout) -> Self {
        Self {
            id: spec.id.clone(),
            dir: spec.dir.clone(),
            uid_base,
            layout: layout.clone(),
            armed: true,
        }
    }

    /// Passes a start's outcome on: a success disarms the guard, a failure tears the
    /// machine down first.
    pub(super) async fn check<T>(mut self, r: Result<T, NodeError>) -> Result<T, NodeError> {
        self.armed = false;
        if r.is_err() {
            let _ = tokio::task::spawn_blocking(self.teardown()).await;
        }
        r
    }

    fn teardown(&self) -> impl FnOnce() + Send + 'static {
        let (id, dir, layout, base) = (
            self.id.clone(),
            self.dir.clone(),
            self.layout.clone(),
            self.uid_base,
        );
        move || {
            if let Err(e) = machine::destroy(&id, &dir, &layout) {
                tracing::warn!(machine = %id, error = %e, "cannot tear down a machine that failed to start");
            }
            // A start that failed before the machine recorded itself leaves its lease.
            slots::release_uid_range(base, &dir);
        }
    }
}

impl Drop for Unwind {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let teardown = self.teardown();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(teardown)),
            Err(_) => teardown(),
        }
    }
}
