//! How much of the server machines may hold through the egress service: proxied
//! connections and DNS queries in flight, counted per machine, per tenant and in all, so
//! that one machine or one tenant can neither take the file descriptors the API needs nor
//! make every tenant's DNS fail. Also the server's file limit those caps come from, and the
//! rate limit of the lines refusals write to the log (a refusal is a machine's doing, so
//! its log lines must not be a lever either).
//!
//! Owns counting and the file limit only: sockets stay with the proxy and the responder.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Proxied connections one machine may hold open at once, on a host with many files.
pub const MAX_CONNS_PER_MACHINE: usize = 512;
/// At most one refusal line per machine this often; the ones in between are counted.
pub const LOG_EVERY: Duration = Duration::from_secs(5);

/// Caps of one resource at each level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub machine: usize,
    pub tenant: usize,
    pub total: usize,
}

impl Caps {
    /// Proxied connections for a server whose file limit is `nofile`. A connection holds
    /// up to two descriptors (the machine's and the upstream's), and all of them together
    /// at most half the limit: the API, the store, volumes and machines keep the other
    /// half. One tenant gets a quarter of that, one machine at most
    /// [`MAX_CONNS_PER_MACHINE`] of its tenant's share.
    pub fn proxy(nofile: u64) -> Caps {
        let total = usize::try_from(nofile / 4).unwrap_or(usize::MAX).max(16);
        let tenant = (total / 4).max(4);
        Caps {
            machine: tenant.min(MAX_CONNS_PER_MACHINE),
            tenant,
            total,
        }
    }

    /// DNS queries being resolved at once: a machine's slow names stall its own lookups
    /// (and at worst its tenant's), never every tenant's.
    pub const DNS: Caps = Caps {
        machine: 32,
        tenant: 128,
        total: 256,
    };
}

/// One level's count of what is held now.
pub type Count = Arc<AtomicUsize>;

/// The level whose cap refused a new connection or query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    Machine,
    Tenant,
    All,
}

impl Full {
    /// Why, in the words of a log line or a call record.
    pub fn why(self) -> &'static str {
        match self {
            Full::Machine => "too many open at once for this machine",
            Full::Tenant => "too many open at once for this tenant",
            Full::All => "too many open at once on this server",
        }
    }
}

/// One unit held at every level until dropped.
#[derive(Debug)]
pub struct Permit {
    held: [Count; 3],
    /// Some level is more than three quarters full: whoever holds this should not wait
    /// long for a slow client.
    pub near_cap: bool,
}

impl Permit {
    /// Takes one unit at each level, or none at all when a level is at its cap.
    pub fn take(
        caps: &Caps,
        machine: &Count,
        tenant: &Count,
        total: &Count,
    ) -> Result<Permit, Full> {
        let levels = [
            (machine, caps.machine, Full::Machine),
            (tenant, caps.tenant, Full::Tenant),
            (total, caps.total, Full::All),
        ];
        let mut near_cap = false;
        for (i, (count, cap, full)) in levels.iter().enumerate() {
            let was = count.fetch_add(1, Ordering::SeqCst);
            if was >= *cap {
                for (c, _, _) in &levels[..=i] {
                    c.fetch_sub(1, Ordering::SeqCst);
                }
                return Err(*full);
            }
            near_cap |= (was + 1) * 4 > cap * 3;
        }
        Ok(Permit {
            held: [machine.clone(), tenant.clone(), total.clone()],
            near_cap,
        })
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        for c in &self.held {
            c.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Lets one log line through per [`LOG_EVERY`] and counts the rest.
#[derive(Debug, Default)]
pub struct LogGate(Mutex<(Option<Instant>, u64)>);

impl LogGate {
    /// `Some(n)` when a line may be written now (`n`: lines held back since the last one).
    pub fn pass(&self, now: Instant) -> Option<u64> {
        let mut s = self.0.lock().expect("log gate");
        match s.0 {
            Some(last) if now.saturating_duration_since(last) < LOG_EVERY => {
                s.1 += 1;
                None
            }
            _ => {
                let held = s.1;
                *s = (Some(now), 0);
                Some(held)
            }
        }
    }

    /// Lines held back since the last one written (and forgets them).
    pub fn take_held(&self) -> u64 {
        std::mem::take(&mut self.0.lock().expect("log gate").1)
    }
}

/// Raises this process's soft limit of open files to its hard limit (the kernel's
/// `nr_open` when the hard limit is unlimited) and returns the soft limit in force.
/// Service managers start processes with 1024, which a few machines' idle connections
/// would use up.
pub fn raise_nofile() -> u64 {
    use locker_sys::proc::{nofile_limit, set_nofile_limit};
    let (before, hard) = match nofile_limit() {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "reading the open files limit failed; assuming 1024");
            return 1024;
        }
    };
    let mut soft = before;
    let mut want = hard;
    if want == libc::RLIM_INFINITY {
        want = std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 20);
    }
    if want > soft {
        match set_nofile_limit(want, hard) {
            Ok(()) => soft = want,
            Err(e) => {
                tracing::warn!(error = %e, soft = before, hard, "raising the open files limit failed")
            }
        }
    }
    tracing::info!(
        nofile = soft,
        was = before,
        "open files limit (soft, raised to the hard limit)"
    );
    soft
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count() -> Count {
        Arc::new(AtomicUsize::new(0))
    }

    #[test]
    fn proxy_caps_keep_half_the_file_limit_for_the_server() {
        for nofile in [1024u64, 4096, 20_000, 524_288, 1 << 20] {
            let c = Caps::proxy(nofile);
            assert!(2 * c.total as u64 <= nofile / 2, "{nofile}: {c:?}");
            assert!(
                c.machine <= c.tenant && c.tenant < c.total,
                "{nofile}: {c:?}"
            );
            assert!(c.machine <= MAX_CONNS_PER_MACHINE);
        }
        assert_eq!(
            Caps::proxy(1024),
            Caps {
                machine: 64,
                tenant: 64,
                total: 256
            }
        );
        assert_eq!(Caps::proxy(524_288).machine, MAX_CONNS_PER_MACHINE);
    }

    #[test]
    fn each_level_refuses_at_its_cap_and_a_refusal_holds_nothing() {
        let caps = Caps {
            machine: 3,
            tenant: 5,
            total: 8,
        };
        let total = count();
        let (ta, tb) = (count(), count());
        let (m1, m2, m3) = (count(), count(), count());
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(Permit::take(&caps, &m1, &ta, &total).unwrap());
        }
        assert_eq!(
            Permit::take(&caps, &m1, &ta, &total).unwrap_err(),
            Full::Machine
        );
        held.push(Permit::take(&caps, &m2, &ta, &total).unwrap());
        held.push(Permit::take(&caps, &m2, &ta, &total).unwrap());
        // Tenant a is at its cap: its other machine is refused, tenant b is not.
        assert_eq!(
            Permit::take(&caps, &m2, &ta, &total).unwrap_err(),
            Full::Tenant
        );
        assert_eq!(m2.load(Ordering::SeqCst), 2, "a refusal holds nothing");
        let sixth = Permit::take(&caps, &m3, &tb, &total).unwrap();
        assert!(!sixth.near_cap, "6 of 8 in all is three quarters, not more");
        held.push(sixth);
        let seventh = Permit::take(&caps, &m3, &tb, &total).unwrap();
        assert!(seventh.near_cap, "7 of 8 in all is near the cap");
        held.push(seventh);
        held.push(Permit::take(&caps, &m3, &tb, &total).unwrap());
        assert_eq!(
            Permit::take(&caps, &m3, &tb, &total).unwrap_err(),
            Full::Machine
        );
        // All 8 are held: a machine and a tenant under their own caps are refused too.
        let m4 = count();
        assert_eq!(
            Permit::take(&caps, &m4, &tb, &total).unwrap_err(),
            Full::All
        );
        assert_eq!(total.load(Ordering::SeqCst), 8);
        held.clear();
        for c in [&total, &ta, &tb, &m1, &m2, &m3, &m4] {
            assert_eq!(c.load(Ordering::SeqCst), 0, "all given back");
        }
        let first = Permit::take(&caps, &m1, &ta, &total).unwrap();
        assert!(!first.near_cap);
    }

    #[test]
    fn one_machines_slow_dns_leaves_other_tenants_their_queries() {
        let caps = Caps::DNS;
        let total = count();
        let slow_tenant = count();
        // A tenant's machines each send queries that never resolve.
        let machines: Vec<Count> = (0..10).map(|_| count()).collect();
        let mut held = Vec::new();
        for m in &machines {
            while let Ok(p) = Permit::take(&caps, m, &slow_tenant, &total) {
                held.push(p);
            }
        }
        assert_eq!(held.len(), caps.tenant, "the tenant's share, no more");
        assert!(total.load(Ordering::SeqCst) < caps.total);
        // Another tenant's machine still resolves, up to its own cap.
        let (other, om) = (count(), count());
        for _ in 0..caps.machine {
            held.push(Permit::take(&caps, &om, &other, &total).expect("another tenant's query"));
        }
    }

    #[test]
    fn the_log_gate_lets_one_line_through_per_period_and_counts_the_rest() {
        let g = LogGate::default();
        let t0 = Instant::now();
        assert_eq!(g.pass(t0), Some(0));
        for i in 1..100 {
            assert_eq!(g.pass(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(g.pass(t0 + LOG_EVERY), Some(99));
        assert_eq!(g.pass(t0 + LOG_EVERY), None);
        assert_eq!(g.take_held(), 1);
        assert_eq!(g.take_held(), 0);
    }

    #[test]
    fn the_soft_file_limit_is_raised_to_the_hard_one() {
        let n = raise_nofile();
        let (soft, hard) = locker_sys::proc::nofile_limit().unwrap();
        assert_eq!(soft, n);
        assert!(hard == libc::RLIM_INFINITY || soft == hard);
    }
}
