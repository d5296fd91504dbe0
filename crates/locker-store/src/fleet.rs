//! The fleet's rows: its certificate authority, one-time join tokens, and the nodes that
//! joined with them (issue 25, `FLEET.md` §4.2 "Enrollment" and §4.5 "Detection").
//!
//! Owns: the records and the rules every store keeps for them. The SQL lives in each
//! store's `fleet` module; the certificates and the HTTP live in the server's `fleet` room.
//!
//! Rules:
//! - A join token is stored as its SHA-256 only, is redeemed at most once, and never after
//!   it expires. Redeeming it and inserting the node are one transaction: a refused join
//!   (name taken) leaves the token unused, a replayed one inserts nothing. The one retry
//!   allowed: the same token, before it expires, with the same public key (a node whose
//!   answer was lost, or that died before writing its identity) gets the node it made,
//!   unchanged; anyone else gets `already used`.
//! - Liveness is the store's clock (Postgres: the database's, so replicas on hosts with
//!   skewed clocks agree), in milliseconds since the Unix epoch.
//! - A heartbeat counts only for the node's current epoch and while it is `ready`: a node
//!   declared dead (its epoch moved on) must ask to return before it counts again.

use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};

/// The fleet's CA: its certificate (PEM) and its private key sealed by the server's
/// secrets key (never stored in clear). One per database, made once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetCaRecord {
    pub cert_pem: String,
    pub key_sealed: Vec<u8>,
    /// RFC 3339 UTC.
    pub created_at: String,
}

/// A one-time join token: only its hash is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinTokenRecord {
    pub id: String,
    /// SHA-256 of the clear token.
    pub token_hash: Vec<u8>,
    /// RFC 3339 UTC.
    pub created_at: String,
    pub expires_unix: i64,
    /// When it was redeemed, and by which node; `None` while unused.
    pub used_unix: Option<i64>,
    pub node_id: Option<String>,
}

/// Whether a node counts for placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Heartbeating within its lease.
    Ready,
    /// Its lease ran out and the sweeper declared it dead (its epoch moved on).
    Dead,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Ready => "ready",
            NodeState::Dead => "dead",
        }
    }

    pub fn parse(s: &str) -> Result<NodeState> {
        match s {
            "ready" => Ok(NodeState::Ready),
            "dead" => Ok(NodeState::Dead),
            other => Err(StoreError::Invalid(format!("unknown node state {other:?}"))),
        }
    }
}

/// A node of the fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRecord {
    pub id: String,
    /// Unique in the fleet: `[a-z0-9][a-z0-9-]{0,62}` (the host's name by default).
    pub name: String,
    /// Where the node's own listener answers (`host:port`), as the node advertised it.
    pub address: String,
    /// SHA-256 (hex) of the client certificate the fleet CA signed for it at join: the only
    /// certificate its calls are accepted with.
    pub cert_sha256: String,
    /// That certificate (PEM), and the public key it was signed over (hex of the P-256
    /// point the node sent): a join retried with the same token and key gets them back.
    pub cert_pem: String,
    pub public_key: String,
    /// Bumped each time the node is declared dead; every call about its sandboxes carries it.
    pub epoch: i64,
    pub state: NodeState,
    /// RFC 3339 UTC.
    pub joined_at: String,
    /// The store's clock at its last heartbeat, and until when its lease runs (ms).
    pub heartbeat_ms: i64,
    pub lease_until_ms: i64,
    /// Its last heartbeat's report (JSON: capacity, usage, template digests, warm slots).
    pub report: String,
    /// What the sandboxes placed on it at this epoch reserve (memory, slots): written only
    /// by placement, in the transaction that inserts or removes a placement; 0 again when
    /// the node is declared dead (its sandboxes are lost with it).
    pub reserved_memory_mb: i64,
    pub reserved_slots: i64,
    /// An operator cordoned it (`locker fleet cordon`): placement puts no new sandbox on
    /// it; what runs there keeps running. Written only by [`crate::Store::cordon_node`].
    pub cordoned: bool,
}

/// Where a sandbox placed on a fleet node is in its life, as the control plane sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementState {
    /// Reserved on the node; the node has not answered the create yet.
    Starting,
    /// The node made it (`sandbox_id` set).
    Placed,
    /// Its node was declared dead, or removed, after it was placed: it is gone with it.
    Lost,
}

impl PlacementState {
    pub fn as_str(self) -> &'static str {
        match self {
            PlacementState::Starting => "starting",
            PlacementState::Placed => "placed",
            PlacementState::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Result<PlacementState> {
        match s {
            "starting" => Ok(PlacementState::Starting),
            "placed" => Ok(PlacementState::Placed),
            "lost" => Ok(PlacementState::Lost),
            other => Err(StoreError::Invalid(format!(
                "unknown placement state {other:?}"
            ))),
        }
    }
}

/// A sandbox placed on a fleet node: which node, at which of its epochs, what it reserved
/// there, and the sandbox as the node last described it. Rules: a placement is inserted in
/// the transaction that reserves its memory and slot on the node (`WHERE epoch = $e AND
/// reserved + r <= capacity`), and removed in the one that gives them back; a node's death
/// makes its placements `lost` and its reservations 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementRecord {
    /// `pl_…`: the sandbox has no id until the node made it.
    pub id: String,
    pub sandbox_id: Option<String>,
    pub tenant: String,
    pub node_id: String,
    /// The node's epoch when it was placed: every call about it carries this.
    pub epoch: i64,
    pub memory_mb: i64,
    pub state: PlacementState,
    /// The store's clock when it was placed (ms), then when its node's sandbox was
    /// recorded (`set_placed`): reconciliation counts a sandbox's absence from its node's
    /// reports from then.
    pub created_ms: i64,
    /// The sandbox as the node last answered it (the API's JSON), `{}` before.
    pub view: String,
}

/// Checks a node name: the tenant name rule (DNS-label-like, lower case).
pub fn validate_node_name(name: &str) -> Result<()> {
    crate::model::validate_tenant_name(name).map_err(|_| {
        StoreError::Invalid(format!(
            "node name {name:?} is not valid: use 1 to 63 of a-z, 0-9 and '-', starting \
             with a letter or digit (--name)"
        ))
    })
}

/// Why a join was refused, in words for the node's operator (the server answers 403).
pub(crate) fn refused_token(why: &str) -> StoreError {
    StoreError::NotFound(format!(
        "join token refused: {why}; mint a new one with `locker fleet token` on a control host"
    ))
}

/// The message of a taken node name's `Conflict` (the server answers 409).
pub(crate) fn name_taken(name: &str) -> String {
    format!(
        "a node named {name:?} is already in the fleet: join with another --name, or remove \
         the old one first (`locker fleet remove {name}`)"
    )
}
