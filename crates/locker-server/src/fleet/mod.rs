//! Fleet mode (issue 25, `FLEET.md`): nodes on other hosts join this control plane, and it
//! keeps track of whether they are alive.
//!
//! What exists today is enrollment and liveness (`FLEET.md` §4.2 "Enrollment", §4.5
//! "Detection" and "Mass false death"); placement of sandboxes on remote nodes and routing
//! to them come next:
//! - `pki`: the fleet CA (kept in the store, its key sealed), node certificates, the TLS of
//!   both ends;
//! - `wire`: the bodies node and control exchange;
//! - `control`: this server's side: the control listener (`--fleet-listen`, HTTP/2 with
//!   TLS; client certificates from the fleet CA), join, heartbeats, returns; the admin
//!   routes (`/v1/fleet/…`: mint a join token, list and remove nodes); the lease sweeper;
//! - `member`: a node's side (`locker node`): join with a token, keep its identity, beat
//!   every [`HEARTBEAT`], fence itself and return when the fleet declared it dead;
//! - `local`: `locker serve --node local`, this server's own node in the fleet's table.
//!
//! It owns the fleet's certificates and sockets. The rows are the store's (`locker_store`'s
//! `fleet` rules); machines stay the runtime's: nothing here starts, stops or kills one. A
//! node never kills anything because it cannot reach the control plane.

pub mod control;
pub mod local;
pub mod member;
pub mod node;
pub mod pki;
pub mod placement;
pub mod route;
pub mod wire;

use std::time::Duration;

/// How often a node beats.
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// How long one beat keeps a node alive (three missed beats).
pub const LEASE: Duration = Duration::from_secs(3);
/// How often the sweeper looks for expired leases.
pub const SWEEP: Duration = Duration::from_millis(250);
/// A join token's life when the admin gives none, and the longest one allowed.
pub const TOKEN_TTL: Duration = Duration::from_secs(3600);
pub const TOKEN_TTL_MAX: Duration = Duration::from_secs(7 * 24 * 3600);
/// The prefix of a join token (`lkj_<CA pin>_<secret>`).
pub const TOKEN_PREFIX: &str = "lkj_";

/// A join token's parts: the pin of the CA the node must find at the URL, and the whole
/// token (what the control plane hashes). `None` if it is not shaped like one.
pub fn token_pin(token: &str) -> Option<&str> {
    let rest = token.strip_prefix(TOKEN_PREFIX)?;
    let (pin, secret) = rest.split_once('_')?;
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    (pin.len() == pki::PIN_HEX && hex(pin) && secret.len() >= 32 && hex(secret)).then_some(pin)
}
