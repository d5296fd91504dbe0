//! The DNS responder of machines with a network: every DNS query a machine sends (to the
//! host end, its `/etc/resolv.conf` nameserver; under `allow`, to any address) arrives
//! here. A name the machine's policy allows is resolved on the host (the operator's pins
//! first) and answered with its IPv4 addresses that a machine may reach; any other name
//! is answered NXDOMAIN and counted for the machine's call records. Only the question of
//! a plain query over UDP is read (no compression in it, one question); AAAA and other
//! types of an allowed name get an empty answer (machines have IPv4 only).
//!
//! Queries being resolved at once are capped per machine, per tenant and in all
//! ([`super::limits::Caps::DNS`]); past a cap the answer is SERVFAIL at once, so one
//! machine's slow names fail its own lookups, not every tenant's.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;

use super::limits::{Caps, Permit};
use super::{forbidden, Egress};
/// Answers' time to live: short, so a policy change shows soon.
const TTL_S: u32 = 30;
/// Addresses one answer carries at most (it stays under 512 bytes).
const MAX_ANSWERS: usize = 16;

pub const NOERROR: u8 = 0;
pub const FORMERR: u8 = 1;
pub const SERVFAIL: u8 = 2;
pub const NXDOMAIN: u8 = 3;
pub const NOTIMP: u8 = 4;

const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;

/// Answers machines' queries for the life of the server.
pub async fn serve(eg: Arc<Egress>, sock: Arc<UdpSocket>) {
    let mut buf = vec![0u8; 1500];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "egress DNS: receive failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let SocketAddr::V4(p) = peer else { continue };
        let Some(entry) = eg.entry(*p.ip()) else {
            continue;
        };
        let q = match parse_query(&buf[..n]) {
            Ok(q) => q,
            Err(Some(resp)) => {
                let _ = sock.send_to(&resp, peer).await;
                continue;
            }
            Err(None) => continue,
        };
        let Ok(permit) = Permit::take(
            &Caps::DNS,
            &entry.held.dns,
            &entry.tenant.dns,
            &eg.total.dns,
        ) else {
            let _ = sock.send_to(&response(&q, SERVFAIL, &[]), peer).await;
            continue;
        };
        let (eg, sock) = (eg.clone(), sock.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let rule = entry.rule();
            let resp = if !rule.allows_name(&q.name) {
                // Reverse lookups are noise, not attempts to reach anything.
                if !q.name.ends_with(".arpa") {
                    entry.deny(q.name.clone(), "DNS: not in the allowlist");
                }
                response(&q, NXDOMAIN, &[])
            } else if q.qtype != TYPE_A {
                response(&q, NOERROR, &[])
            } else {
                match eg.resolve(&q.name).await {
                    Ok(addrs) => {
                        let v4: Vec<Ipv4Addr> = addrs
                            .into_iter()
                            .filter(|a| !forbidden(*a))
                            .filter_map(|a| match a {
                                IpAddr::V4(a) => Some(a),
                                IpAddr::V6(_) => None,
                            })
                            .take(MAX_ANSWERS)
                            .collect();
                        response(&q, NOERROR, &v4)
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "egress DNS: resolution failed");
                        response(&q, SERVFAIL, &[])
                    }
                }
            };
            let _ = sock.send_to(&resp, peer).await;
        });
    }
}

/// One question of a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    /// The query's flags (opcode and RD are echoed).
    pub flags: u16,
    /// Lowercase, dot-separated, no final dot.
    pub name: String,
    pub qtype: u16,
    /// The question's bytes as sent (echoed in the answer).
    pub question: Vec<u8>,
}

/// Reads a query. `Err(Some(answer))`: an error answer to send back (FORMERR, NOTIMP);
/// `Err(None)`: not worth an answer (a response, or too short to carry an id).
pub fn parse_query(b: &[u8]) -> Result<Query, Option<Vec<u8>>> {
    if b.len() < 12 {
        return Err(None);
    }
    let id = u16::from_be_bytes([b[0], b[1]]);
    let flags = u16::from_be_bytes([b[2], b[3]]);
    if flags & 0x8000 != 0 {
        return Err(None);
    }
    let header_only = |rcode: u8| {
        let mut r = Vec::with_capacity(12);
        r.extend(id.to_be_bytes());
        r.extend((0x8000 | (flags & 0x7900) | 0x0080 | rcode as u16).to_be_bytes());
        r.extend([0u8; 8]);
        r
    };
    let opcode = (flags >> 11) & 0xf;
    if opcode != 0 {
        return Err(Some(header_only(NOTIMP)));
    }
    if u16::from_be_bytes([b[4], b[5]]) != 1 {
        return Err(Some(header_only(FORMERR)));
    }
    let mut i = 12;
    let mut labels: Vec<String> = Vec::new();
    loop {
        let Some(&len) = b.get(i) else {
            return Err(Some(header_only(FORMERR)));
        };
        i += 1;
        if len == 0 {
            break;
        }
        // No compression pointers (0xc0) or extended labels in a question.
        if len & 0xc0 != 0 || i + len as usize > b.len() {
            return Err(Some(header_only(FORMERR)));
        }
        let label = &b[i..i + len as usize];
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        i += len as usize;
    }
    if i + 4 > b.len() || i - 12 > 255 {
        return Err(Some(header_only(FORMERR)));
    }
    let qtype = u16::from_be_bytes([b[i], b[i + 1]]);
    let qclass = u16::from_be_bytes([b[i + 2], b[i + 3]]);
    if qclass != CLASS_IN {
        return Err(Some(header_only(NOTIMP)));
    }
    Ok(Query {
        id,
        flags,
        name: labels.join("."),
        qtype,
        question: b[12..i + 4].to_vec(),
    })
}

/// The answer to `q`: `rcode`, and an A record per address.
pub fn response(q: &Query, rcode: u8, addrs: &[Ipv4Addr]) -> Vec<u8> {
    let mut r = Vec::with_capacity(12 + q.question.len() + addrs.len() * 16);
    r.extend(q.id.to_be_bytes());
    // QR, the query's opcode and RD, RA, the rcode.
    r.extend((0x8000 | (q.flags & 0x7900) | 0x0080 | rcode as u16).to_be_bytes());
    r.extend(1u16.to_be_bytes());
    r.extend((addrs.len() as u16).to_be_bytes());
    r.extend([0u8; 4]);
    r.extend(&q.question);
    for a in addrs {
        r.extend([0xc0, 0x0c]); // the question's name
        r.extend(TYPE_A.to_be_bytes());
        r.extend(CLASS_IN.to_be_bytes());
        r.extend(TTL_S.to_be_bytes());
        r.extend(4u16.to_be_bytes());
        r.extend(a.octets());
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut b = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            b.push(l.len() as u8);
            b.extend(l.as_bytes());
        }
        b.push(0);
        b.extend(qtype.to_be_bytes());
        b.extend(1u16.to_be_bytes());
        b
    }

    #[test]
    fn queries_parse_and_answers_carry_the_addresses() {
        let q = parse_query(&query("Allowed.TEST", 1)).unwrap();
        assert_eq!(
            (q.id, q.name.as_str(), q.qtype),
            (0x1234, "allowed.test", 1)
        );
        let r = response(&q, NOERROR, &[Ipv4Addr::new(198, 18, 0, 1)]);
        assert_eq!(&r[..2], &[0x12, 0x34]);
        assert_eq!(r[2] & 0x80, 0x80, "a response");
        assert_eq!(r[2] & 0x01, 0x01, "RD echoed");
        assert_eq!(r[3] & 0x0f, NOERROR);
        assert_eq!(u16::from_be_bytes([r[6], r[7]]), 1, "one answer");
        assert_eq!(&r[r.len() - 4..], &[198, 18, 0, 1]);
        let nx = response(&q, NXDOMAIN, &[]);
        assert_eq!(nx[3] & 0x0f, NXDOMAIN);
        assert_eq!(u16::from_be_bytes([nx[6], nx[7]]), 0);
    }

    #[test]
    fn bad_queries_get_errors_or_nothing() {
        assert_eq!(parse_query(&[0; 5]), Err(None));
        let mut resp = query("a.test", 1);
        resp[2] |= 0x80;
        assert_eq!(parse_query(&resp), Err(None));
        let mut ptr = query("a.test", 1);
        ptr[12] = 0xc0;
        let e = parse_query(&ptr).unwrap_err().unwrap();
        assert_eq!(e[3] & 0x0f, FORMERR);
        let cut = query("a.test", 1);
        let e = parse_query(&cut[..cut.len() - 3]).unwrap_err().unwrap();
        assert_eq!(e[3] & 0x0f, FORMERR);
        let mut notify = query("a.test", 1);
        notify[2] = 0x20; // opcode 4
        let e = parse_query(&notify).unwrap_err().unwrap();
        assert_eq!(e[3] & 0x0f, NOTIMP);
    }
}
