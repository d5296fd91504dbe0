//! Host-wide leases on numbered resources (a machine's uid range today), one lock file per
//! slot: `<dir>/<n>`, created exclusively and naming its owner (a machine's directory).
//! Files rather than memory, so several servers (and test runs) on one host never hand
//! out the same slot, and a server that restarts finds its machines' leases.
//!
//! Generic on purpose: a [`Slots`] is a directory, a count and the words its errors use,
//! so the subnet leases of [`crate::net`] (today its own `lease_slot`) can move onto it.
//! It knows nothing of what a slot stands for; the one instance it names is the machines'
//! uid ranges ([`uid_ranges`]), which both runtimes use (a jail's user namespace, a
//! microVM's QEMU uid).

use std::fs;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a new lease is kept even if its owner's directory does not exist yet (the
/// machine is being created).
const GRACE: Duration = Duration::from_secs(60);

/// Ids per machine user namespace.
pub const UID_RANGE: u32 = 65_536;
/// The first slot's uid base is `FIRST_SLOT * UID_RANGE`, well above any host account.
const FIRST_SLOT: u32 = 16;
/// How many uid ranges (machines) one host can hand out.
pub const UID_SLOTS: u32 = 60_000;
/// Where uid-range leases live, host-wide.
const UID_SLOTS_DIR: &str = "/run/locker/uid-slots";

/// The host's uid ranges, one per machine.
pub fn uid_ranges() -> Slots {
    Slots::new(UID_SLOTS_DIR, UID_SLOTS, "uid range")
}

/// The uid base of allocation slot `slot` (0-based).
pub fn uid_base(slot: u32) -> u32 {
    (FIRST_SLOT + slot) * UID_RANGE
}

/// Ends the lease `owner` (a machine's directory) holds on the range starting at
/// `uid_base`.
pub fn release_uid_range(uid_base: u32, owner: &Path) {
    if let Some(slot) = (uid_base / UID_RANGE).checked_sub(FIRST_SLOT) {
        uid_ranges().release(slot, owner);
    }
}

/// A failed lease.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("no free {what}: {count} machines already exist on this host")]
    Full { what: &'static str, count: u32 },
    #[error("lease a {what} in {}: {source}", dir.display())]
    Io {
        what: &'static str,
        dir: PathBuf,
        source: io::Error,
    },
}

/// One kind of numbered host resource, leased through lock files in `dir`.
#[derive(Debug, Clone)]
pub struct Slots {
    dir: PathBuf,
    count: u32,
    /// What a slot is, for errors ("uid range").
    what: &'static str,
}

impl Slots {
    pub fn new(dir: impl Into<PathBuf>, count: u32, what: &'static str) -> Self {
        Self {
            dir: dir.into(),
            count,
            what,
        }
    }

    /// How many slots there are.
    pub fn count(&self) -> u32 {
        self.count
    }

    fn file(&self, slot: u32) -> PathBuf {
        self.dir.join(slot.to_string())
    }

    /// Leases a free slot for `owner` (a machine's directory). A lease is taken over only
    /// when it is stale: older than [`GRACE`] and its owner's directory is gone (a crash
    /// between lease and start, or a data dir wiped). Whatever the runtime, a machine's
    /// directory lives exactly as long as the machine, so the check holds for jails and
    /// microVMs alike.
    pub fn lease(&self, owner: &Path) -> Result<u32, SlotError> {
        let io_err = |source| SlotError::Io {
            what: self.what,
            dir: self.dir.clone(),
            source,
        };
        fs::create_dir_all(&self.dir).map_err(io_err)?;
        // Start somewhere random so concurrent allocators rarely race for the same file.
        let mut r = [0u8; 4];
        crate::sys::random_bytes(&mut r);
        let start = u32::from_le_bytes(r) % self.count;
        for i in 0..self.count {
            let slot = (start + i) % self.count;
            let f = self.file(slot);
            match fs::OpenOptions::new().write(true).create_new(true).open(&f) {
                Ok(mut file) => {
                    let _ = file.write_all(owner.as_os_str().as_encoded_bytes());
                    return Ok(slot);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    // A stale lease is removed for the next allocator: taking it over here
                    // would race with another one doing the same.
                    if self.is_stale(slot) {
                        let _ = fs::remove_file(&f);
                    }
                }
                Err(e) => return Err(io_err(e)),
            }
        }
        Err(SlotError::Full {
            what: self.what,
            count: self.count,
        })
    }

    /// The directory that holds `slot`, if it is leased.
    pub fn owner(&self, slot: u32) -> Option<PathBuf> {
        let b = fs::read(self.file(slot)).ok()?;
        Some(PathBuf::from(std::ffi::OsStr::from_bytes(&b)))
    }

    /// Whether the lease on `slot` may be taken over (see [`Slots::lease`]).
    pub fn is_stale(&self, slot: u32) -> bool {
        let old = fs::metadata(self.file(slot))
            .and_then(|m| m.modified())
            .map(|t| t.elapsed().unwrap_or_default() > GRACE)
            .unwrap_or(false);
        old && self.owner(slot).is_some_and(|o| !o.exists())
    }

    /// Ends `owner`'s lease on `slot`; a lease someone else holds now is left alone.
    pub fn release(&self, slot: u32, owner: &Path) {
        if self.owner(slot).as_deref() == Some(owner) {
            let _ = fs::remove_file(self.file(slot));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    /// A scratch directory, removed on drop (also when the test fails).
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Self {
            let p = std::env::temp_dir().join(format!("locker-slots-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).unwrap();
            Self(p)
        }
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Makes the lease on `slot` look older than the grace period.
    fn age(s: &Slots, slot: u32) {
        let f = fs::File::options().write(true).open(s.file(slot)).unwrap();
        f.set_modified(SystemTime::now() - 2 * GRACE).unwrap();
    }

    #[test]
    fn a_microvms_uid_lease_is_not_taken_over_while_the_machine_lives() {
        let tmp = Scratch::new("vm");
        let slots = Slots::new(tmp.path().join("slots"), 1, "uid range");
        // A microVM's directory, as `vm::start` leaves it: `vm.json`, no `jail.json`.
        let vm = tmp.path().join("machines/vm1");
        fs::create_dir_all(&vm).unwrap();
        fs::write(vm.join("vm.json"), b"{}").unwrap();
        let slot = slots.lease(&vm).unwrap();
        age(&slots, slot);
        let jail = tmp.path().join("machines/jail1");
        assert!(
            matches!(slots.lease(&jail), Err(SlotError::Full { .. })),
            "a running microVM's uid range was handed to another machine"
        );
        assert_eq!(slots.owner(slot).as_deref(), Some(vm.as_path()));

        // Once the machine's directory is gone, its lease is stale and freed.
        fs::remove_dir_all(&vm).unwrap();
        assert!(
            slots.lease(&jail).is_err(),
            "the stale lease is removed first"
        );
        assert_eq!(slots.lease(&jail).unwrap(), slot);
    }

    #[test]
    fn uid_ranges_map_to_slots_and_back() {
        assert_eq!(uid_base(0), 16 * UID_RANGE);
        let s = uid_ranges();
        assert_eq!(s.count(), UID_SLOTS);
        // A uid base below the first slot is no lease: nothing is released.
        release_uid_range(0, Path::new("/nonexistent"));
    }

    #[test]
    fn a_release_ends_only_the_owners_lease() {
        let tmp = Scratch::new("release");
        let slots = Slots::new(tmp.path().join("slots"), 4, "uid range");
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        let sa = slots.lease(&a).unwrap();
        slots.release(sa, &b);
        assert_eq!(slots.owner(sa).as_deref(), Some(a.as_path()));
        slots.release(sa, &a);
        assert_eq!(slots.owner(sa), None);
    }
}
