//! The bodies of the calls between a node and the control plane (`FLEET.md` §4.2), shared
//! by both sides so that they cannot drift. JSON over HTTP/2 with TLS. Fields a side does
//! not know are ignored, never refused: nodes and control replicas of different versions
//! meet during every rolling upgrade.
//!
//! - `POST /internal/nodes/register` ([`Join`] → [`Joined`]), no client certificate: the
//!   join token is the credential. 201; 400 bad body; 403 token refused; 409 name taken.
//! - `POST /internal/nodes/heartbeat` ([`Beat`] → [`BeatAnswer`]), the node's certificate.
//!   200; 409 [`Fenced`] when the node's epoch moved on (it was declared dead) or the node
//!   is dead; 401 without a certificate; 403 with another node's; 404 when it was removed.
//! - `POST /internal/nodes/return` ([`Return`] → [`BeatAnswer`]), the node's certificate: a
//!   node the sweeper declared dead comes back at its new epoch. 200; 409 when not dead.
//! - `POST /internal/nodes/events` ([`NodeEvents`] → [`EventsTaken`]), the node's
//!   certificate: the node's own lifecycle events, taken into the fleet's stream once
//!   each. 200 with the fleet's cursor for the node; 400 for more than [`EVENTS_MAX`].
//! - `POST /internal/nodes/secrets` ([`SecretsAsked`] → [`SecretCopies`]), the node's
//!   certificate: the current values of secrets its machines use (a secret of a tenant with
//!   no sandbox placed on the node and no volume homed there is left out, as is one that no
//!   longer exists). 200; 400 for more than [`SECRETS_MAX`]; 409 when the node is not alive.

use serde::{Deserialize, Serialize};

pub const REGISTER: &str = "/internal/nodes/register";
pub const HEARTBEAT: &str = "/internal/nodes/heartbeat";
pub const RETURN: &str = "/internal/nodes/return";
pub const EVENTS: &str = "/internal/nodes/events";
/// Events one call carries at most.
pub const EVENTS_MAX: usize = 500;
pub const SECRETS: &str = "/internal/nodes/secrets";
/// Secrets one call asks for at most.
pub const SECRETS_MAX: usize = 256;

/// The secrets a node asks for, by tenant and name.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SecretsAsked {
    pub node_id: String,
    pub wanted: Vec<SecretKey>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SecretKey {
    pub tenant: String,
    pub name: String,
}

/// The secrets asked for that the node may have, as they are now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SecretCopies {
    pub secrets: Vec<SecretCopy>,
}

/// A secret as a node's machines use it: where its placeholder goes, the hosts its value
/// may go to, and the value (base64). Kept in the node's memory only.
#[derive(Clone, Serialize, Deserialize)]
pub struct SecretCopy {
    pub tenant: String,
    pub name: String,
    pub env: String,
    pub hosts: Vec<String>,
    pub value_b64: String,
}

impl std::fmt::Debug for SecretCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretCopy({}/{}, ..)", self.tenant, self.name)
    }
}

/// A node's events after the cursor it knows, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeEvents {
    pub node_id: String,
    pub events: Vec<NodeEvent>,
}

/// One event of a node's own stream (its `seq` is the node's).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeEvent {
    pub seq: u64,
    pub tenant: String,
    pub kind: String,
    pub subject: String,
    pub data: serde_json::Value,
    pub at_unix: i64,
}

/// How far the fleet has the node's events (the node sends from there on).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventsTaken {
    pub cursor: u64,
}

/// What a node reports with each heartbeat (and at join).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Report {
    /// The Locker version the node runs.
    pub version: String,
    /// Capacity: CPUs, memory (MiB), disk free in its data dir (MiB), sandbox slots.
    pub cpus: u32,
    pub memory_mb: u64,
    pub disk_free_mb: u64,
    /// The most disk one new sandbox may be granted there now (free less the host's
    /// reserve, what its own create checks); `None` from nodes of versions that did not
    /// report it (placement then leaves their disk to their own check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_grantable_mb: Option<u64>,
    pub slots: u32,
    /// Usage: sandboxes it runs now.
    pub sandboxes: u32,
    /// Template digests in its cache (placement prefers a node that has the template).
    pub templates: Vec<String>,
    /// Warm machines ready to hand out.
    pub warm: u32,
    /// The sandboxes it runs (the control plane reconciles its placements with them).
    #[serde(default)]
    pub sandbox_ids: Vec<String>,
    /// Creates the control plane asked for that are still running here, by placement id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub creating: Vec<String>,
    /// Creates finished here lately: placement id → the sandbox made. The fleet's leader
    /// records one whose control replica died before it could (`placement::reconcile`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub made: std::collections::BTreeMap<String, String>,
    /// Volumes a move left in doubt here (its control replica went away after the home's
    /// gate was held, or with a copy at the target): the fleet says which are this node's
    /// ([`BeatAnswer::volumes_here`]; `volumes::handoff`). At most [`DOUBTS_MAX`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes_in_doubt: Vec<crate::volumes::handoff::VolumeKey>,
}

/// Volumes in doubt one heartbeat asks about at most.
pub const DOUBTS_MAX: usize = 64;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Join {
    pub token: String,
    pub name: String,
    /// Where the node's own listener answers (`host:port`).
    pub address: String,
    /// Hex of the node's public key (uncompressed P-256 point); its private key never
    /// leaves the node.
    pub public_key: String,
    pub report: Report,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Joined {
    pub node_id: String,
    pub epoch: i64,
    /// The node's client certificate, and the CA that signed it (PEM).
    pub cert_pem: String,
    pub ca_pem: String,
    pub heartbeat_ms: u64,
    pub lease_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Beat {
    pub node_id: String,
    pub epoch: i64,
    pub report: Report,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BeatAnswer {
    pub epoch: i64,
    pub lease_until_ms: i64,
    /// A return's answer: the sandboxes still the node's to serve at its new epoch (every
    /// other one it runs is destroyed). `None` in a heartbeat's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<Vec<String>>,
    /// The answer to `Report::volumes_in_doubt`: the ids of those whose record names this
    /// node as their home (the others are another's, or gone). `None` when none was asked
    /// or the store could not be read (the node asks again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes_here: Option<Vec<String>>,
}

/// The 409 of a heartbeat that does not count: the node's state and epoch as the fleet has
/// them, so that it can fence itself and ask to return.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fenced {
    pub message: String,
    pub state: String,
    pub epoch: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Return {
    pub node_id: String,
}
