//! What the host can hold: the defaults of the per-tenant memory and disk quotas (its RAM,
//! the size of the data dir's filesystem), and the admission of a disk grant (a sandbox's
//! `disk_mb`, a volume's `size_mb`, a run's machine) against the space free on that
//! filesystem now, less a reserve the store and the server keep for themselves.
//!
//! Disks and volumes are sparse images, so a grant costs nothing until it is filled; a
//! grant larger than what is free could never be filled, and a tenant's grants together
//! are bounded by its disk quota (counted by the store, see `lifecycle::launch` and
//! `volumes::create`). Owns none of the images themselves.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::error::ApiError;

/// The smallest and the largest reserve kept free on the data dir's filesystem.
const RESERVE_MB: (u64, u64) = (256, 4096);

/// The size and free space of a filesystem, in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space {
    pub size_mb: u64,
    /// Free for an unprivileged writer (`f_bavail`).
    pub free_mb: u64,
}

impl Space {
    /// The space of the filesystem holding `path` (or its nearest existing parent: the
    /// data dir may not exist yet when the quotas' defaults are computed).
    pub fn of(path: &Path) -> std::io::Result<Space> {
        let mut p = path;
        while !p.exists() {
            p = p.parent().unwrap_or(Path::new("/"));
        }
        let st = locker_sys::fs::statvfs(p)?;
        let mb = |blocks: libc::fsblkcnt_t| ((blocks as u128 * st.f_frsize as u128) >> 20) as u64;
        Ok(Space {
            size_mb: mb(st.f_blocks),
            free_mb: mb(st.f_bavail),
        })
    }

    /// What is kept free whatever is asked: 5% of the filesystem, within [`RESERVE_MB`].
    pub fn reserve_mb(&self) -> u64 {
        (self.size_mb / 20).clamp(RESERVE_MB.0, RESERVE_MB.1)
    }

    /// What one new grant may be at most now.
    pub fn grantable_mb(&self) -> u64 {
        self.free_mb.saturating_sub(self.reserve_mb())
    }
}

/// The host's RAM in MiB (`MemTotal`), if it can be read.
pub fn host_memory_mb() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib >> 10)
}

/// Refuses a grant of `want_mb` (`what`: "`disk_mb`", "`size_mb`", a run's disk) that the
/// data dir's filesystem could not hold now: 422 with the free space and what to do.
pub fn admit_disk(data_dir: &Path, what: &str, want_mb: u64) -> Result<(), ApiError> {
    let space = Space::of(data_dir)
        .map_err(|e| ApiError::internal(format!("reading the free disk space: {e}")))?;
    if want_mb <= space.grantable_mb() {
        return Ok(());
    }
    Err(ApiError::unprocessable(format!(
        "{what} of {want_mb} MB is more than this host can hold: its data filesystem has {} MB free, \
         of which {} MB stay in reserve, so at most {} MB can be granted now; ask for less, or \
         ask the operator to free space on the host",
        space.free_mb,
        space.reserve_mb(),
        space.grantable_mb()
    )))
}

/// Disk granted to creates in progress whose records are not stored yet (a volume's
/// filesystem is made before its record), per tenant: the quota counts them too.
#[derive(Debug, Default)]
pub struct Pending(Arc<Mutex<HashMap<String, u64>>>);

/// A pending grant, counted until dropped.
#[derive(Debug)]
pub struct PendingGrant {
    map: Arc<Mutex<HashMap<String, u64>>>,
    tenant: String,
    mb: u64,
}

impl Pending {
    /// The MiB pending for `tenant`.
    pub fn of(&self, tenant: &str) -> u64 {
        self.0
            .lock()
            .expect("pending grants")
            .get(tenant)
            .copied()
            .unwrap_or(0)
    }

    /// Counts `mb` for `tenant` until the grant is dropped.
    pub fn hold(&self, tenant: &str, mb: u64) -> PendingGrant {
        *self
            .0
            .lock()
            .expect("pending grants")
            .entry(tenant.to_owned())
            .or_default() += mb;
        PendingGrant {
            map: self.0.clone(),
            tenant: tenant.to_owned(),
            mb,
        }
    }
}

impl Drop for PendingGrant {
    fn drop(&mut self) {
        let mut m = self.map.lock().expect("pending grants");
        if let Some(n) = m.get_mut(&self.tenant) {
            *n = n.saturating_sub(self.mb);
            if *n == 0 {
                m.remove(&self.tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_dirs_space_is_read_from_the_nearest_existing_parent() {
        let s = Space::of(Path::new("/tmp/does/not/exist/yet")).unwrap();
        assert!(s.size_mb > 0 && s.free_mb <= s.size_mb, "{s:?}");
        assert_eq!(s.size_mb, Space::of(Path::new("/tmp")).unwrap().size_mb);
    }

    #[test]
    fn the_reserve_is_bounded_and_a_grant_past_free_space_is_refused() {
        let s = Space {
            size_mb: 1_000_000,
            free_mb: 50_000,
        };
        assert_eq!(s.reserve_mb(), 4096);
        assert_eq!(s.grantable_mb(), 45_904);
        let tiny = Space {
            size_mb: 1000,
            free_mb: 100,
        };
        assert_eq!(tiny.reserve_mb(), 256);
        assert_eq!(tiny.grantable_mb(), 0);
        let e = admit_disk(Path::new("/tmp"), "`disk_mb`", u64::MAX >> 21).unwrap_err();
        assert_eq!(e.status.as_u16(), 422);
        assert!(
            e.message.contains("`disk_mb`") && e.message.contains("MB free"),
            "{}",
            e.message
        );
        admit_disk(Path::new("/tmp"), "`disk_mb`", 1).unwrap();
    }

    #[test]
    fn pending_grants_count_until_dropped() {
        let p = Pending::default();
        let a = p.hold("t", 100);
        let b = p.hold("t", 50);
        assert_eq!((p.of("t"), p.of("u")), (150, 0));
        drop(a);
        assert_eq!(p.of("t"), 50);
        drop(b);
        assert_eq!(p.of("t"), 0);
        assert!(p.0.lock().unwrap().is_empty());
    }

    #[test]
    fn the_hosts_ram_is_known() {
        assert!(host_memory_mb().unwrap() > 0);
    }
}
