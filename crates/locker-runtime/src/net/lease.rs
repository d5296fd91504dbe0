//! Subnet leases: which /30 of [`RANGE`](super::RANGE) a machine holds, host-wide.
//!
//! A lease is a file `SLOTS_DIR/<slot>` made with `create_new` (so two servers never take
//! the same slot) holding the owning machine's directory, and the machine's own record of
//! it, `<dir>/net.json`. Owns the addresses and names derived from a slot; it does not
//! create links or rules.

use std::fs;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{NetError, SLOTS_DIR, VM_NETNS_PREFIX};

const RANGE_BASE: u32 = 0x6460_0000; // 100.96.0.0
/// /12 in /30s.
pub(super) const SLOTS: u32 = 1 << 18;

/// A machine's network as written to `<dir>/net.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetLease {
    pub slot: u32,
}

impl NetLease {
    /// The host end's interface name.
    pub fn link(&self) -> String {
        format!("lk{}", self.slot)
    }
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::from(RANGE_BASE + self.slot * 4 + 1)
    }
    pub fn machine_ip(&self) -> Ipv4Addr {
        Ipv4Addr::from(RANGE_BASE + self.slot * 4 + 2)
    }
    /// The name of a microVM's network namespace (under `/run/netns`).
    pub fn netns_name(&self) -> String {
        format!("{VM_NETNS_PREFIX}{}", self.slot)
    }
    /// The path of a microVM's network namespace.
    pub fn netns(&self) -> PathBuf {
        Path::new("/run/netns").join(self.netns_name())
    }
    /// Reads a machine's lease from its directory.
    pub fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&fs::read(dir.join("net.json")).ok()?).ok()
    }
    /// Records the lease in the machine's directory.
    pub(super) fn store(&self, dir: &Path) -> Result<(), NetError> {
        fs::write(
            dir.join("net.json"),
            serde_json::to_vec(self).expect("lease serializes"),
        )
        .map_err(NetError::io("write net.json"))
    }
}

/// Leases a free subnet slot for the machine whose directory is `owner`.
pub(super) fn lease_slot(owner: &Path) -> Result<u32, NetError> {
    fs::create_dir_all(SLOTS_DIR).map_err(NetError::io(format!("create {SLOTS_DIR}")))?;
    let mut r = [0u8; 4];
    crate::sys::random_bytes(&mut r);
    let start = u32::from_le_bytes(r) % SLOTS;
    for i in 0..SLOTS {
        let slot = (start + i) % SLOTS;
        let f = Path::new(SLOTS_DIR).join(slot.to_string());
        match fs::OpenOptions::new().write(true).create_new(true).open(&f) {
            Ok(mut file) => {
                let _ = file.write_all(owner.as_os_str().as_encoded_bytes());
                return Ok(slot);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(NetError::io(format!("lease a subnet in {SLOTS_DIR}"))(e)),
        }
    }
    Err(NetError::NoSubnet)
}

/// Frees a subnet lease; whether its file is gone.
pub(super) fn release_slot(slot: u32) -> bool {
    match fs::remove_file(Path::new(SLOTS_DIR).join(slot.to_string())) {
        Ok(()) => true,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_a_slot() {
        let l = NetLease { slot: 0 };
        assert_eq!(l.host_ip(), Ipv4Addr::new(100, 96, 0, 1));
        assert_eq!(l.machine_ip(), Ipv4Addr::new(100, 96, 0, 2));
        let l = NetLease { slot: SLOTS - 1 };
        assert_eq!(l.machine_ip(), Ipv4Addr::new(100, 111, 255, 254));
        assert!(l.link().len() <= 15);
        assert!(l.netns_name().len() <= 15 + VM_NETNS_PREFIX.len());
        let l = NetLease { slot: 5 };
        assert_eq!(l.netns(), Path::new("/run/netns/locker-lk5"));
    }

    #[test]
    fn every_slot_lies_in_the_range() {
        let range = super::super::Cidr::parse(super::super::RANGE).unwrap();
        for slot in [0, 1, SLOTS / 2, SLOTS - 1] {
            let l = NetLease { slot };
            assert!(range.contains(l.host_ip()) && range.contains(l.machine_ip()));
        }
    }

    #[test]
    fn a_lease_round_trips_through_its_directory() {
        let dir = std::env::temp_dir().join(format!("locker-net-lease-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        assert_eq!(NetLease::load(&dir), None);
        NetLease { slot: 77 }.store(&dir).unwrap();
        assert_eq!(NetLease::load(&dir), Some(NetLease { slot: 77 }));
        fs::write(dir.join("net.json"), b"{\"slot\":").unwrap();
        assert_eq!(NetLease::load(&dir), None, "a torn file is no lease");
        fs::remove_dir_all(&dir).unwrap();
    }
}
