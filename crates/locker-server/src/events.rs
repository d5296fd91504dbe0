//! Lifecycle events: what happened to a tenant's sandboxes, runs and templates, as one
//! ordered stream per server (`GET /v1/events`, webhooks).
//!
//! This room owns the event types, their ids and order, their delivery (the SSE route,
//! webhooks, their signatures and retries) and their storage. Every other room only calls
//! [`Events::emit`] at the moment a thing happened (after the store says so), never waits
//! on delivery, and never reads events back.
//!
//! Skeleton (session 9): emit fans out in memory only; durability, `Last-Event-ID`, the
//! route and webhooks come with issue 23.

use serde::Serialize;

/// What happened (`type` on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Kind {
    #[serde(rename = "sandbox.created")]
    SandboxCreated,
    #[serde(rename = "sandbox.paused")]
    SandboxPaused,
    #[serde(rename = "sandbox.resumed")]
    SandboxResumed,
    #[serde(rename = "sandbox.expired")]
    SandboxExpired,
    #[serde(rename = "sandbox.deleted")]
    SandboxDeleted,
    #[serde(rename = "sandbox.failed")]
    SandboxFailed,
    #[serde(rename = "sandbox.snapshotted")]
    SandboxSnapshotted,
    #[serde(rename = "sandbox.forked")]
    SandboxForked,
    #[serde(rename = "run.committed")]
    RunCommitted,
    #[serde(rename = "template.built")]
    TemplateBuilt,
    #[serde(rename = "template.failed")]
    TemplateFailed,
}

/// One event as delivered.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    /// `evt_…`, increasing in emit order.
    pub id: String,
    #[serde(rename = "type")]
    pub kind: Kind,
    /// RFC 3339, UTC.
    pub at: String,
    pub tenant: String,
    /// The sandbox, run, volume or template it is about.
    pub subject: String,
    pub data: serde_json::Value,
}

/// The server's event stream.
pub struct Events {
    tx: tokio::sync::broadcast::Sender<Event>,
    seq: std::sync::atomic::AtomicU64,
}

impl Default for Events {
    fn default() -> Self {
        Self {
            tx: tokio::sync::broadcast::channel(1024).0,
            seq: Default::default(),
        }
    }
}

impl Events {
    /// Records that `kind` happened to `subject` of `tenant`. Never blocks on delivery.
    pub fn emit(&self, tenant: &str, kind: Kind, subject: &str, data: serde_json::Value) {
        let n = self.seq.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        let _ = self.tx.send(Event {
            id: format!("evt_{n:016}"),
            kind,
            at: locker_types::rfc3339(crate::ids::now_s()),
            tenant: tenant.to_owned(),
            subject: subject.to_owned(),
            data,
        });
    }

    /// Every event emitted from now on.
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Event> {
        self.tx.subscribe()
    }
}
