//! The nftables rulesets of egress, as pure text.
//!
//! Each function here turns a lease and a [`Policy`] into the exact text `nft -f -` is
//! given; nothing here runs a program or touches the host ([`super::nft`] installs them).
//! Every ruleset but the machine's own host table under `none` first declares and deletes
//! its table, so installing it replaces any earlier one in one atomic transaction.

use super::lease::NetLease;
use super::policy::{join, Policy};
use super::{NEVER_V4, RANGE, REDIRECT_MARK, TABLE};

/// The host-wide ruleset (static: no per-machine state, so concurrent servers replacing
/// it write the same thing).
pub(super) fn host_ruleset() -> String {
    format!(
        "table inet {TABLE} {{}}
delete table inet {TABLE}
table inet {TABLE} {{
  chain input {{
    type filter hook input priority -10; policy accept;
    iifname \"lk*\" ct mark {REDIRECT_MARK:#x} ct status dnat accept
    iifname \"lk*\" drop
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname \"lk*\" meta nfproto ipv6 drop
    iifname \"lk*\" ip daddr {{ {NEVER_V4} }} drop
    iifname \"lk*\" ip saddr != {RANGE} drop
    oifname \"lk*\" ct state established,related accept
    oifname \"lk*\" drop
    iifname \"lk*\" accept
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr {RANGE} oifname != \"lk*\" masquerade
  }}
}}
"
    )
}

/// The ruleset inside a machine's network namespace (defence in depth; the host's rules
/// hold without it), replacing any earlier one atomically.
pub(super) fn machine_ruleset(l: &NetLease, policy: &Policy) -> String {
    let host = l.host_ip();
    let dns = match policy {
        Policy::None => String::new(),
        _ => format!("ip daddr {host} udp dport 53 accept\n    "),
    };
    let allow = match policy {
        Policy::Allow { cidrs, .. } => {
            let mut r = String::new();
            if !cidrs.is_empty() {
                r += &format!("ip daddr {{ {} }} accept\n    ", join(cidrs));
            }
            r + "meta l4proto tcp accept\n    udp dport 53 accept\n    drop\n"
        }
        _ => String::new(),
    };
    format!(
        "table inet {TABLE} {{}}
delete table inet {TABLE}
table inet {TABLE} {{
  chain output {{
    type filter hook output priority 0; policy accept;
    oifname \"lo\" accept
    meta nfproto ipv6 drop
    {dns}ip daddr {{ {NEVER_V4}, {host} }} drop
    {allow}
  }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname \"lo\" accept
    ct state established,related accept
    drop
  }}
}}
"
    )
}

/// The ruleset inside a microVM's network namespace: a `bridge` table over the frames its
/// guest sends through the tap (the namespace's own stack carries none of them). The
/// same checks as [`machine_ruleset`]'s output chain, plus the guest's source address
/// (its root can change it, unlike a jail's). Replaces any earlier one atomically.
pub(super) fn vm_bridge_ruleset(l: &NetLease, policy: &Policy) -> String {
    let (host, m) = (l.host_ip(), l.machine_ip());
    let body = match policy {
        Policy::None => "drop\n".to_owned(),
        _ => {
            let mut r = format!(
                "ether type arp accept
    ether type != ip drop
    ip saddr != {m} drop
    ip daddr {host} udp dport 53 accept
    ip daddr {{ {NEVER_V4}, {host} }} drop
"
            );
            if let Policy::Allow { cidrs, .. } = policy {
                if !cidrs.is_empty() {
                    r += &format!("    ip daddr {{ {} }} accept\n", join(cidrs));
                }
                r += "    ip protocol tcp accept\n    udp dport 53 accept\n    drop\n";
            }
            r
        }
    };
    format!(
        "table bridge {TABLE} {{}}
delete table bridge {TABLE}
table bridge {TABLE} {{
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname != \"tap0\" accept
    {body}  }}
}}
"
    )
}

/// A microVM's own host table under `none`: its link stays, nothing crosses it.
pub(super) fn host_closed_ruleset(l: &NetLease) -> String {
    let (link, t) = (l.link(), machine_table(l));
    format!(
        "table ip {t} {{}}
delete table ip {t}
table ip {t} {{
  chain forward {{
    type filter hook forward priority -5; policy accept;
    iifname \"{link}\" drop
  }}
}}
"
    )
}

/// The name of a machine's own table on the host (family `ip`).
pub(super) fn machine_table(l: &NetLease) -> String {
    format!("{TABLE}_{}", l.link())
}

/// The machine's own table on the host: where its DNS queries and (under `allow`) its TCP
/// connections go, and (under `allow`) the drop of everything else not to an allowed
/// CIDR. Replaces any earlier one atomically; `None` for [`Policy::None`].
pub(super) fn host_machine_ruleset(l: &NetLease, policy: &Policy) -> Option<String> {
    let (link, m, h, t) = (l.link(), l.machine_ip(), l.host_ip(), machine_table(l));
    let mark = format!("ct mark set {REDIRECT_MARK:#x}");
    let (nat, forward) = match policy {
        Policy::None => return None,
        Policy::All { dns_port } => (
            format!("iifname \"{link}\" ip saddr {m} ip daddr {h} udp dport 53 {mark} redirect to :{dns_port}\n"),
            String::new(),
        ),
        Policy::Allow {
            cidrs,
            proxy_port,
            dns_port,
        } => {
            let mut nat =
                format!("iifname \"{link}\" ip saddr {m} udp dport 53 {mark} redirect to :{dns_port}\n");
            let forward = if cidrs.is_empty() {
                format!("iifname \"{link}\" drop")
            } else {
                let set = join(cidrs);
                nat += &format!("    iifname \"{link}\" ip daddr {{ {set} }} return\n");
                format!("iifname \"{link}\" ip daddr != {{ {set} }} drop")
            };
            nat += &format!(
                "    iifname \"{link}\" ip saddr {m} meta l4proto tcp {mark} redirect to :{proxy_port}\n"
            );
            (
                nat,
                format!(
                    "  chain forward {{
    type filter hook forward priority -5; policy accept;
    {forward}
  }}
"
                ),
            )
        }
    };
    Some(format!(
        "table ip {t} {{}}
delete table ip {t}
table ip {t} {{
  chain prerouting {{
    type nat hook prerouting priority -100; policy accept;
    {nat}  }}
{forward}}}
"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::Cidr;

    const NEVER: &str =
        "169.254.0.0/16, 100.96.0.0/12, 127.0.0.0/8, 0.0.0.0/8, 224.0.0.0/4, 255.255.255.255";

    fn lease() -> NetLease {
        NetLease { slot: 5 }
    }

    fn allow(cidrs: &[&str]) -> Policy {
        Policy::Allow {
            cidrs: cidrs.iter().map(|c| Cidr::parse(c).unwrap()).collect(),
            proxy_port: 4000,
            dns_port: 5353,
        }
    }

    #[test]
    fn the_host_table_is_static_and_replaces_itself() {
        let want = format!(
            r#"table inet locker {{}}
delete table inet locker
table inet locker {{
  chain input {{
    type filter hook input priority -10; policy accept;
    iifname "lk*" ct mark 0x4c4b0045 ct status dnat accept
    iifname "lk*" drop
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname "lk*" meta nfproto ipv6 drop
    iifname "lk*" ip daddr {{ {NEVER} }} drop
    iifname "lk*" ip saddr != 100.96.0.0/12 drop
    oifname "lk*" ct state established,related accept
    oifname "lk*" drop
    iifname "lk*" accept
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr 100.96.0.0/12 oifname != "lk*" masquerade
  }}
}}
"#
        );
        assert_eq!(host_ruleset(), want);
    }

    #[test]
    fn a_jail_under_allow_sends_only_dns_tcp_and_the_allowed_networks() {
        let want = format!(
            r#"table inet locker {{}}
delete table inet locker
table inet locker {{
  chain output {{
    type filter hook output priority 0; policy accept;
    oifname "lo" accept
    meta nfproto ipv6 drop
    ip daddr 100.96.0.21 udp dport 53 accept
    ip daddr {{ {NEVER}, 100.96.0.21 }} drop
    ip daddr {{ 10.0.0.0/8, 198.18.0.0/24 }} accept
    meta l4proto tcp accept
    udp dport 53 accept
    drop

  }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname "lo" accept
    ct state established,related accept
    drop
  }}
}}
"#
        );
        assert_eq!(
            machine_ruleset(&lease(), &allow(&["10.0.0.0/8", "198.18.0.0/24"])),
            want
        );
    }

    #[test]
    fn a_jail_under_all_drops_only_the_never_set_and_the_host() {
        let r = machine_ruleset(&lease(), &Policy::All { dns_port: 5353 });
        let output = format!(
            "    ip daddr 100.96.0.21 udp dport 53 accept\n    ip daddr {{ {NEVER}, 100.96.0.21 }} drop\n    \n  }}\n  chain input"
        );
        assert!(r.contains(&output), "{r}");
        assert!(!r.contains("l4proto"), "{r}");
        let none = machine_ruleset(&lease(), &Policy::None);
        assert!(!none.contains("udp dport 53"), "no DNS under none: {none}");
    }

    #[test]
    fn the_host_table_of_a_jail_under_allow_steers_to_the_server() {
        let want = r#"table ip locker_lk5 {}
delete table ip locker_lk5
table ip locker_lk5 {
  chain prerouting {
    type nat hook prerouting priority -100; policy accept;
    iifname "lk5" ip saddr 100.96.0.22 udp dport 53 ct mark set 0x4c4b0045 redirect to :5353
    iifname "lk5" ip daddr { 198.18.0.0/24 } return
    iifname "lk5" ip saddr 100.96.0.22 meta l4proto tcp ct mark set 0x4c4b0045 redirect to :4000
  }
  chain forward {
    type filter hook forward priority -5; policy accept;
    iifname "lk5" ip daddr != { 198.18.0.0/24 } drop
  }
}
"#;
        assert_eq!(
            host_machine_ruleset(&lease(), &allow(&["198.18.0.0/24"])).as_deref(),
            Some(want)
        );
        let empty = host_machine_ruleset(&lease(), &allow(&[])).unwrap();
        assert!(
            empty.contains("  chain forward {\n    type filter hook forward priority -5; policy accept;\n    iifname \"lk5\" drop\n  }\n"),
            "{empty}"
        );
        assert!(!empty.contains("return"), "{empty}");
    }

    #[test]
    fn the_host_table_of_a_jail_under_all_redirects_dns_only() {
        let want = r#"table ip locker_lk5 {}
delete table ip locker_lk5
table ip locker_lk5 {
  chain prerouting {
    type nat hook prerouting priority -100; policy accept;
    iifname "lk5" ip saddr 100.96.0.22 ip daddr 100.96.0.21 udp dport 53 ct mark set 0x4c4b0045 redirect to :5353
  }
}
"#;
        assert_eq!(
            host_machine_ruleset(&lease(), &Policy::All { dns_port: 5353 }).as_deref(),
            Some(want)
        );
        assert_eq!(host_machine_ruleset(&lease(), &Policy::None), None);
    }

    #[test]
    fn a_microvm_bridge_checks_the_guest_frames() {
        let want = format!(
            r#"table bridge locker {{}}
delete table bridge locker
table bridge locker {{
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname != "tap0" accept
    ether type arp accept
    ether type != ip drop
    ip saddr != 100.96.0.22 drop
    ip daddr 100.96.0.21 udp dport 53 accept
    ip daddr {{ {NEVER}, 100.96.0.21 }} drop
    ip daddr {{ 198.18.0.0/24 }} accept
    ip protocol tcp accept
    udp dport 53 accept
    drop
  }}
}}
"#
        );
        assert_eq!(
            vm_bridge_ruleset(&lease(), &allow(&["198.18.0.0/24"])),
            want
        );
        let all = vm_bridge_ruleset(&lease(), &Policy::All { dns_port: 1 });
        assert!(
            all.ends_with(&format!(
                "    ip daddr {{ {NEVER}, 100.96.0.21 }} drop\n  }}\n}}\n"
            )),
            "{all}"
        );
    }

    #[test]
    fn a_microvm_under_none_keeps_its_link_closed_both_sides() {
        let bridge = vm_bridge_ruleset(&lease(), &Policy::None);
        assert!(
            bridge.ends_with("    iifname != \"tap0\" accept\n    drop\n  }\n}\n"),
            "{bridge}"
        );
        let want = r#"table ip locker_lk5 {}
delete table ip locker_lk5
table ip locker_lk5 {
  chain forward {
    type filter hook forward priority -5; policy accept;
    iifname "lk5" drop
  }
}
"#;
        assert_eq!(host_closed_ruleset(&lease()), want);
        assert_eq!(machine_table(&lease()), "locker_lk5");
    }
}
