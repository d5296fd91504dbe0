//! What a machine may reach: the egress [`Policy`] and the IPv4 networks ([`Cidr`]) an
//! `allow` policy lists.
//!
//! Pure values: parsing, masking, containment and merging. Nothing here touches the host;
//! the API's JSON shape of a policy is the server's, the rulesets made from one are
//! [`super::rules`]'s.

use std::net::Ipv4Addr;

/// What a machine's link lets through beyond the host's static rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// No link at all: loopback only.
    None,
    /// Everything but the never-reachable set; DNS queries to the host end go to the
    /// server's responder on `dns_port`.
    All { dns_port: u16 },
    /// Only the `cidrs` directly; every other TCP connection goes to the server's proxy on
    /// `proxy_port`, every DNS query to its responder on `dns_port`, nothing else leaves.
    Allow {
        cidrs: Vec<Cidr>,
        proxy_port: u16,
        dns_port: u16,
    },
}

/// An IPv4 network, `addr/prefix` (the address masked to the prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n` or a single address (`/32`); the address is masked to `n` bits.
    /// `n` is written as a plain decimal, like each of the address's numbers: a sign
    /// (`/+8`, which `u8`'s own parser takes), a leading zero (`/08`) or anything else is
    /// not a CIDR, so a network is read only as it is written.
    pub fn parse(s: &str) -> Option<Cidr> {
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => {
                let decimal =
                    !p.is_empty() && p.len() <= 2 && p.bytes().all(|b| b.is_ascii_digit());
                if !decimal || (p.len() > 1 && p.starts_with('0')) {
                    return None;
                }
                (a, p.parse::<u8>().ok().filter(|p| *p <= 32)?)
            }
            None => (s, 32),
        };
        let addr: Ipv4Addr = a.parse().ok()?;
        Some(Cidr {
            addr: Ipv4Addr::from(u32::from(addr) & Self::mask(p)),
            prefix: p,
        })
    }

    fn mask(prefix: u8) -> u32 {
        if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix)
        }
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask(self.prefix) == u32::from(self.addr)
    }

    /// Whether `other` lies wholly inside this network.
    pub fn covers(&self, other: &Cidr) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// `cidrs` without duplicates or networks inside another (nftables refuses overlapping
/// intervals in one set).
pub fn merge_cidrs(cidrs: &[Cidr]) -> Vec<Cidr> {
    let mut v: Vec<Cidr> = cidrs.to_vec();
    v.sort_by_key(|c| (c.prefix, c.addr));
    let mut out: Vec<Cidr> = Vec::new();
    for c in v {
        if !out.iter().any(|o| o.covers(&c)) {
            out.push(c);
        }
    }
    out.sort();
    out
}

/// The networks as the body of an nftables set: `a/n, b/m`.
pub(super) fn join(cidrs: &[Cidr]) -> String {
    cidrs
        .iter()
        .map(Cidr::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> Cidr {
        Cidr::parse(s).unwrap_or_else(|| panic!("{s} parses"))
    }

    #[test]
    fn cidrs_parse_mask_and_merge() {
        let n = c("10.1.2.3/8");
        assert_eq!(n.to_string(), "10.0.0.0/8");
        assert!(n.contains(Ipv4Addr::new(10, 200, 0, 1)));
        assert!(!n.contains(Ipv4Addr::new(11, 0, 0, 1)));
        assert_eq!(c("1.2.3.4").to_string(), "1.2.3.4/32");
        assert!(c("0.0.0.0/0").contains(Ipv4Addr::new(8, 8, 8, 8)));
        for bad in [
            "1.2.3.4/33",
            "1.2.3/8",
            "example.com",
            "::1/128",
            "1.2.3.4/",
        ] {
            assert!(Cidr::parse(bad).is_none(), "{bad}");
        }
        let merged = merge_cidrs(&[
            c("10.1.0.0/16"),
            c("10.0.0.0/8"),
            c("192.168.1.1"),
            c("10.0.0.0/8"),
        ]);
        assert_eq!(join(&merged), "10.0.0.0/8, 192.168.1.1/32");
    }

    #[test]
    fn bad_cidrs_are_refused_whole() {
        for bad in [
            "",
            "/",
            "/8",
            "1.2.3.4/-1",
            "1.2.3.4/+8",
            "1.2.3.4/8/8",
            "1.2.3.4 /8",
            " 1.2.3.4/8",
            "1.2.3.4/ 8",
            "1.2.3.256/8",
            "1.2.3.4.5/8",
            "01.2.3.4/8",
            "1.2.3.4/256",
            "1.2.3.4/1000",
            "1.2.3.4:80",
            "10.0.0.0-10.0.0.255",
            "0x0a.0.0.0/8",
            "1.2.3.4/08",
            "1.2.3.4/00",
            "1.2.3.4/008",
        ] {
            assert_eq!(Cidr::parse(bad), None, "{bad:?} must not parse");
        }
    }

    #[test]
    fn prefix_edges_mask_and_contain_exactly() {
        assert_eq!(c("10.0.0.0/0").prefix, 0);
        assert_eq!(c("10.0.0.0/10").prefix, 10);
        let all = c("203.0.113.9/0");
        assert_eq!(all.to_string(), "0.0.0.0/0");
        assert!(all.contains(Ipv4Addr::BROADCAST) && all.contains(Ipv4Addr::UNSPECIFIED));
        let one = c("203.0.113.9/32");
        assert!(one.contains(Ipv4Addr::new(203, 0, 113, 9)));
        assert!(!one.contains(Ipv4Addr::new(203, 0, 113, 8)));
        let odd = c("203.0.113.9/31");
        assert_eq!(odd.to_string(), "203.0.113.8/31");
        assert!(odd.contains(Ipv4Addr::new(203, 0, 113, 8)));
        assert!(odd.contains(Ipv4Addr::new(203, 0, 113, 9)));
        assert!(!odd.contains(Ipv4Addr::new(203, 0, 113, 10)));
        assert_eq!(c("255.255.255.255/1").to_string(), "128.0.0.0/1");
    }

    #[test]
    fn covers_means_wholly_inside() {
        assert!(c("10.0.0.0/8").covers(&c("10.1.0.0/16")));
        assert!(c("10.0.0.0/8").covers(&c("10.0.0.0/8")));
        assert!(!c("10.1.0.0/16").covers(&c("10.0.0.0/8")));
        assert!(!c("10.0.0.0/8").covers(&c("11.0.0.0/16")));
        assert!(c("0.0.0.0/0").covers(&c("1.2.3.4")));
    }

    #[test]
    fn merging_keeps_disjoint_networks_sorted_and_drops_the_covered() {
        assert!(merge_cidrs(&[]).is_empty());
        let merged = merge_cidrs(&[
            c("192.168.0.0/24"),
            c("10.0.0.1"),
            c("192.168.0.128/25"),
            c("172.16.0.0/12"),
            c("10.0.0.1/32"),
        ]);
        assert_eq!(join(&merged), "10.0.0.1/32, 172.16.0.0/12, 192.168.0.0/24");
        assert_eq!(
            join(&merge_cidrs(&[c("1.2.3.4"), c("0.0.0.0/0")])),
            "0.0.0.0/0"
        );
    }
}
