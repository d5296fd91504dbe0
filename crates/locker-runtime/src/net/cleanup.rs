//! What a crash left of egress, removed host-wide: leases, links, namespaces and host
//! tables no machine holds any more.
//!
//! Touches only names Locker makes (`lk<slot>`, `locker-lk<slot>`, `ip locker_lk<slot>`,
//! an egress probe's `locker-probe-<pid>`) and never a lease younger than a minute nor a
//! probe whose process lives, so a machine being set up or a probe running by another
//! server on the same host is left alone.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::lease::{release_slot, NetLease};
use super::link::{delete_link, delete_netns, machine_links};
use super::nft::{delete_machine_table, machine_tables};
use super::{SLOTS_DIR, TABLE, VM_NETNS_PREFIX};

/// Removes what a crash left, host-wide: leases whose machine directory no longer holds
/// that lease (older than a minute, so a machine being set up is never touched) and links
/// `lk<slot>` with no lease. Returns the slots removed.
pub fn cleanup_stale() -> Vec<u32> {
    // First the probes of processes that are gone (a server killed while it probed): their
    // leases are released with them, not left for the rule below.
    for e in fs::read_dir("/run/netns").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let dead = name
            .strip_prefix(super::probe::PREFIX)
            .and_then(|p| p.parse::<u32>().ok())
            .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
        if dead && super::probe::remove(&name) {
            tracing::info!(namespace = %name, "removed what a killed server's egress probe left");
        }
    }
    let mut removed = Vec::new();
    for e in fs::read_dir(SLOTS_DIR).into_iter().flatten().flatten() {
        let Ok(slot) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let owner = PathBuf::from(std::ffi::OsString::from(
            String::from_utf8_lossy(&fs::read(e.path()).unwrap_or_default()).into_owned(),
        ));
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .map(|t| t.elapsed().unwrap_or_default() > Duration::from_secs(60))
            .unwrap_or(false);
        let held = NetLease::load(&owner).is_some_and(|l| l.slot == slot);
        // Counted only when every part is gone: without the rights to delete (not root)
        // nothing was removed, whatever was tried.
        if old && !held {
            let link = delete_link(&format!("lk{slot}"));
            let ns = delete_netns(&format!("{VM_NETNS_PREFIX}{slot}"));
            if link && ns && release_slot(slot) {
                removed.push(slot);
            }
        }
    }
    for link in machine_links() {
        let slot: u32 = link[2..].parse().unwrap_or(u32::MAX);
        if !leased(slot) && delete_link(&link) {
            removed.push(slot);
        }
    }
    for e in fs::read_dir("/run/netns").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(slot) = name
            .strip_prefix(VM_NETNS_PREFIX)
            .and_then(|d| d.parse::<u32>().ok())
        else {
            continue;
        };
        if !leased(slot) && delete_netns(&name) && !removed.contains(&slot) {
            removed.push(slot);
        }
    }
    for table in machine_tables() {
        let slot: u32 = table[TABLE.len() + 3..].parse().unwrap_or(u32::MAX);
        if !leased(slot) && delete_machine_table(&table) && !removed.contains(&slot) {
            removed.push(slot);
        }
    }
    removed
}

fn leased(slot: u32) -> bool {
    Path::new(SLOTS_DIR).join(slot.to_string()).exists()
}
