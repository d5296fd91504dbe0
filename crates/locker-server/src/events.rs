//! Lifecycle events: what happened to a tenant's sandboxes, runs and templates, as one
//! ordered, durable stream per server (`GET /v1/events`, webhooks).
//!
//! This room owns the event types, their ids and order, their storage (through the
//! store's `events` table, pruned to [`RETENTION_S`] and [`RETENTION_MAX`]), their delivery
//! (the SSE route, webhooks, their signatures and retries) and the webhook routes. Every
//! other room only calls [`Events::emit`] at the moment a thing happened (after the store
//! says so), never waits on delivery, and never reads events back. It must not touch
//! sandboxes, machines or any other room's state.
//!
//! Order: an event's id is its store `seq`; [`Events::emit`] stores and broadcasts under one
//! lock, so the live broadcast is in id order. A stream subscribes to the broadcast before
//! it reads the store, then skips what it already sent: no gap, no duplicate.
//!
//! Webhooks: one task per webhook walks the tenant's events after the webhook's stored
//! cursor, in order, and moves the cursor once an event was delivered (or given up on
//! after [`ATTEMPTS`] tries); a restart resumes from the cursor, so pending deliveries
//! survive it. A receiver that hangs holds only its own task (each try has
//! [`DELIVERY_TIMEOUT`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::Router;
use bytes::Bytes;
use locker_store::{EventRecord, Store, WebhookRecord};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::{Json, Query};
use crate::state::AppState;

/// Events older than this are pruned (7 days).
pub const RETENTION_S: i64 = 7 * 24 * 3600;
/// At most this many events are kept.
pub const RETENTION_MAX: u64 = 100_000;
/// Tries of one delivery before it is given up.
pub const ATTEMPTS: u32 = 10;
/// The wait before the first retry; doubled after each, up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(500);
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How long one try may take (connect, send, answer).
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Webhooks one tenant may have.
pub const MAX_WEBHOOKS: usize = 20;
/// An SSE comment this often keeps idle streams open through proxies.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

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
    #[serde(rename = "sandbox.lost")]
    SandboxLost,
    #[serde(rename = "sandbox.moved")]
    SandboxMoved,
    #[serde(rename = "sandbox.restarted")]
    SandboxRestarted,
    #[serde(rename = "run.committed")]
    RunCommitted,
    #[serde(rename = "template.built")]
    TemplateBuilt,
    #[serde(rename = "template.failed")]
    TemplateFailed,
}

impl Kind {
    pub const ALL: [Kind; 14] = [
        Kind::SandboxCreated,
        Kind::SandboxPaused,
        Kind::SandboxResumed,
        Kind::SandboxExpired,
        Kind::SandboxDeleted,
        Kind::SandboxFailed,
        Kind::SandboxSnapshotted,
        Kind::SandboxForked,
        Kind::SandboxLost,
        Kind::SandboxMoved,
        Kind::SandboxRestarted,
        Kind::RunCommitted,
        Kind::TemplateBuilt,
        Kind::TemplateFailed,
    ];

    /// Its `type` on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Kind::SandboxCreated => "sandbox.created",
            Kind::SandboxPaused => "sandbox.paused",
            Kind::SandboxResumed => "sandbox.resumed",
            Kind::SandboxExpired => "sandbox.expired",
            Kind::SandboxDeleted => "sandbox.deleted",
            Kind::SandboxFailed => "sandbox.failed",
            Kind::SandboxSnapshotted => "sandbox.snapshotted",
            Kind::SandboxForked => "sandbox.forked",
            Kind::SandboxLost => "sandbox.lost",
            Kind::SandboxMoved => "sandbox.moved",
            Kind::SandboxRestarted => "sandbox.restarted",
            Kind::RunCommitted => "run.committed",
            Kind::TemplateBuilt => "template.built",
            Kind::TemplateFailed => "template.failed",
        }
    }

    fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// One event as delivered.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    /// `evt_…`, increasing in emit order (its store `seq`, zero-padded).
    pub id: String,
    #[serde(skip)]
    pub seq: u64,
    #[serde(rename = "type")]
    pub kind: Kind,
    /// RFC 3339, UTC.
    pub at: String,
    pub tenant: String,
    /// The sandbox, run, volume or template it is about.
    pub subject: String,
    pub data: Value,
}

/// The wire id of event `seq`.
pub fn event_id(seq: u64) -> String {
    format!("evt_{seq:016}")
}

/// The `seq` of a wire id (`evt_…` or the bare number).
fn parse_event_id(s: &str) -> Option<u64> {
    let s = s.trim();
    s.strip_prefix("evt_").unwrap_or(s).parse().ok()
}

impl Event {
    fn of(r: EventRecord) -> Option<Event> {
        Some(Event {
            id: event_id(r.seq),
            seq: r.seq,
            kind: Kind::parse(&r.kind)?,
            at: locker_types::rfc3339(r.at_unix),
            tenant: r.tenant,
            subject: r.subject,
            data: serde_json::from_str(&r.data).unwrap_or(Value::Null),
        })
    }
}

/// Which types a webhook or stream wants: exact names, `group.*`, or `*`.
#[derive(Debug, Clone)]
struct Filter(Vec<String>);

impl Filter {
    /// Checks each pattern names a known type or group.
    fn parse(patterns: &[String]) -> Result<Filter, String> {
        if patterns.is_empty() {
            return Err(
                "`events` must name at least one event type (`sandbox.*`, `run.committed`, `*`)"
                    .into(),
            );
        }
        for p in patterns {
            let ok = p == "*"
                || Kind::parse(p).is_some()
                || p.strip_suffix(".*").is_some_and(|g| {
                    Kind::ALL
                        .iter()
                        .any(|k| k.name().split('.').next() == Some(g))
                });
            if !ok {
                let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                return Err(format!(
                    "unknown event type {p:?}: use one of {}, a group (`sandbox.*`, `run.*`, `template.*`) or `*`",
                    names.join(", ")
                ));
            }
        }
        Ok(Filter(patterns.to_vec()))
    }

    fn wants(&self, kind: Kind) -> bool {
        let name = kind.name();
        self.0.iter().any(|p| {
            p == "*"
                || p == name
                || p.strip_suffix(".*")
                    .is_some_and(|g| name.split('.').next() == Some(g))
        })
    }
}

/// A webhook's delivery figures since this server started (not persisted).
#[derive(Debug, Default, Clone, Serialize)]
struct HookStatus {
    delivered: u64,
    failed_attempts: u64,
    given_up: u64,
    last_error: Option<String>,
}

/// The server's event stream.
pub struct Events {
    store: Arc<dyn Store>,
    /// Held across store and broadcast, so the broadcast is in `seq` order.
    order: Mutex<()>,
    tx: tokio::sync::broadcast::Sender<Event>,
    /// The newest `seq`: webhook tasks wait on it.
    latest: tokio::sync::watch::Sender<u64>,
    hooks: Mutex<HashMap<String, tokio::task::AbortHandle>>,
    status: Arc<Mutex<HashMap<String, HookStatus>>>,
    /// Set when the server stops: open streams end, so the stop need not wait for them.
    closing: tokio::sync::watch::Sender<bool>,
}

impl Events {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            order: Mutex::new(()),
            tx: tokio::sync::broadcast::channel(1024).0,
            latest: tokio::sync::watch::channel(0).0,
            hooks: Default::default(),
            status: Default::default(),
            closing: tokio::sync::watch::channel(false).0,
        }
    }

    /// Ends every open event stream (the server is stopping; clients resume from their
    /// last id at the next start).
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// Records that `kind` happened to `subject` of `tenant`: stored, then broadcast to
    /// streams and webhooks. Never blocks on delivery (one small insert).
    pub fn emit(&self, tenant: &str, kind: Kind, subject: &str, data: Value) {
        let at = crate::ids::now_s();
        let _order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        let seq = match self
            .store
            .insert_event(tenant, kind.name(), subject, &data.to_string(), at)
        {
            Ok(seq) => seq,
            Err(e) => {
                tracing::error!(error = %e, kind = kind.name(), subject, "cannot store an event: it is lost");
                return;
            }
        };
        let _ = self.tx.send(Event {
            id: event_id(seq),
            seq,
            kind,
            at: locker_types::rfc3339(at),
            tenant: tenant.to_owned(),
            subject: subject.to_owned(),
            data,
        });
        self.latest.send_replace(seq);
    }

    /// Takes a fleet node's events into this stream (stored once each, see
    /// `Store::take_node_events`), then broadcasts the new ones, in order with [`Events::emit`];
    /// the fleet's cursor for the node. Blocking (the store's call).
    pub fn take_from_node(
        &self,
        node_id: &str,
        events: &[EventRecord],
    ) -> Result<u64, locker_store::StoreError> {
        let _order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        let (cursor, stored) = self.store.take_node_events(node_id, events)?;
        let mut latest = None;
        for r in stored {
            latest = Some(r.seq);
            let Some(kind) = Kind::parse(&r.kind) else {
                continue;
            };
            let _ = self.tx.send(Event {
                id: event_id(r.seq),
                seq: r.seq,
                kind,
                at: locker_types::rfc3339(r.at_unix),
                tenant: r.tenant,
                subject: r.subject,
                data: serde_json::from_str(&r.data).unwrap_or(Value::Null),
            });
        }
        if let Some(seq) = latest {
            self.latest.send_replace(seq);
        }
        Ok(cursor)
    }

    /// Every event emitted from now on.
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Event> {
        self.tx.subscribe()
    }

    fn start_hook(&self, hook: WebhookRecord) {
        let id = hook.id.clone();
        let task = tokio::spawn(deliver_all(
            self.store.clone(),
            self.latest.subscribe(),
            self.status.clone(),
            hook,
        ));
        if let Some(old) = self
            .hooks
            .lock()
            .expect("hooks lock")
            .insert(id, task.abort_handle())
        {
            old.abort();
        }
    }

    fn stop_hook(&self, id: &str) {
        if let Some(t) = self.hooks.lock().expect("hooks lock").remove(id) {
            t.abort();
        }
        self.status.lock().expect("status lock").remove(id);
    }
}

/// At start: a delivery task per stored webhook, and the pruning of old events.
pub fn spawn(app: AppState) {
    match app.store.list_webhooks(None) {
        Ok(hooks) => {
            match app.store.latest_event_seq() {
                Ok(s) => {
                    app.events.latest.send_replace(s);
                }
                Err(e) => tracing::error!(error = %e, "cannot read the newest event's id"),
            }
            for h in hooks {
                app.events.start_hook(h);
            }
        }
        Err(e) => tracing::error!(error = %e, "cannot read webhooks: none delivers"),
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(600));
        loop {
            tick.tick().await;
            let before = crate::ids::now_s() - RETENTION_S;
            match app.store.prune_events(before, RETENTION_MAX) {
                Ok(0) => {}
                Ok(n) => tracing::info!(pruned = n, "pruned old events"),
                Err(e) => tracing::warn!(error = %e, "cannot prune events"),
            }
        }
    });
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/events", get(stream))
        .route("/v1/webhooks", get(list_hooks).post(create_hook))
        .route("/v1/webhooks/{id}", delete(delete_hook))
}

// ---- the SSE stream ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamQuery {
    /// Comma-separated type patterns.
    types: Option<String>,
    /// Where to resume when the client cannot send `Last-Event-ID` (`0`: from the oldest
    /// kept event).
    after: Option<String>,
}

fn sse_frame(e: &Event) -> Bytes {
    let body = serde_json::to_string(e).unwrap_or_default();
    Bytes::from(format!(
        "id: {}\nevent: {}\ndata: {body}\n\n",
        e.id,
        e.kind.name()
    ))
}

/// `GET /v1/events`: the tenant's events as server-sent events, from `Last-Event-ID` (or
/// `?after=`) if given, else from now; live afterwards, with a keep-alive comment.
async fn stream(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Query(q): Query<StreamQuery>,
) -> Result<Response, ApiError> {
    let filter = match &q.types {
        None => Filter(vec!["*".into()]),
        Some(t) => {
            let pats: Vec<String> = t
                .split(',')
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect();
            Filter::parse(&pats).map_err(|e| ApiError::bad_request(format!("`types`: {e}")))?
        }
    };
    let resume = match headers.get("last-event-id") {
        Some(v) => Some(v.to_str().ok().and_then(parse_event_id).ok_or_else(|| {
            ApiError::bad_request("`Last-Event-ID` must be an event id (`evt_…`) this stream sent")
        })?),
        None => match &q.after {
            Some(a) => Some(parse_event_id(a).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "`after` must be an event id (`evt_…`) or 0, got {a:?}"
                ))
            })?),
            None => None,
        },
    };
    // Subscribe before reading the store: whatever is stored after this is broadcast to us.
    let mut rx = app.events.subscribe();
    let mut last = match resume {
        Some(s) => s,
        None => *app.events.latest.borrow(),
    };
    let (tx, mut out) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
    let store = app.store.clone();
    let tenant = caller.tenant.clone();
    let mut closing = app.events.closing.subscribe();
    tokio::spawn(async move {
        if tx
            .send(Ok(Bytes::from_static(b": locker events\n\n")))
            .await
            .is_err()
        {
            return;
        }
        let mut keep_alive = tokio::time::interval(KEEP_ALIVE);
        keep_alive.tick().await;
        let mut backlog = true;
        loop {
            if backlog {
                // From the store: everything of the tenant after `last`.
                loop {
                    let page = match store.events_after(Some(&tenant), last, 500) {
                        Ok(p) => p,
                        Err(e) => {
                            tracing::warn!(error = %e, "event stream: cannot read the store");
                            return;
                        }
                    };
                    let n = page.len();
                    for r in page {
                        last = r.seq;
                        if let Some(e) = Event::of(r).filter(|e| filter.wants(e.kind)) {
                            if tx.send(Ok(sse_frame(&e))).await.is_err() {
                                return;
                            }
                        }
                    }
                    if n < 500 {
                        break;
                    }
                }
                backlog = false;
            }
            tokio::select! {
                r = rx.recv() => match r {
                    Ok(e) => {
                        if e.tenant != tenant || e.seq <= last {
                            continue;
                        }
                        last = e.seq;
                        if filter.wants(e.kind) && tx.send(Ok(sse_frame(&e))).await.is_err() {
                            return;
                        }
                    }
                    // Fell behind the broadcast: catch up from the store.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => backlog = true,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                },
                _ = keep_alive.tick() => {
                    if tx.send(Ok(Bytes::from_static(b": keep-alive\n\n"))).await.is_err() {
                        return;
                    }
                }
                () = tx.closed() => return,
                _ = closing.changed() => return,
            }
        }
    });
    let body =
        axum::body::Body::from_stream(futures_util::stream::poll_fn(move |cx| out.poll_recv(cx)));
    Ok(Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .header("x-accel-buffering", "no")
        .body(body)
        .expect("a valid response"))
}

// ---- webhook routes ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewWebhook {
    url: String,
    events: Vec<String>,
    secret: String,
}

/// Checks a webhook URL: absolute `http` or `https`, with a host, no credentials.
fn check_url(url: &str) -> Result<axum::http::Uri, String> {
    if url.len() > 2048 {
        return Err("`url` is longer than 2048 bytes".into());
    }
    let uri: axum::http::Uri = url.parse().map_err(|e| {
        format!("`url` is not a URL ({e}): give an absolute http:// or https:// URL")
    })?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => {
            return Err(format!(
                "`url` must start with http:// or https://, got {url:?}"
            ))
        }
    }
    let auth = uri.authority().ok_or("`url` has no host")?;
    if auth.as_str().contains('@') {
        return Err(
            "`url` must not hold credentials (user:password@): sign with `secret` instead".into(),
        );
    }
    if auth.host().is_empty() {
        return Err("`url` has no host".into());
    }
    Ok(uri)
}

fn hook_view(h: &WebhookRecord, status: Option<&HookStatus>) -> Value {
    json!({
        "id": h.id,
        "url": h.url,
        "events": h.events,
        "created_at": locker_types::rfc3339(h.created_unix),
        "delivered_through": (h.cursor > 0).then(|| event_id(h.cursor)),
        "status": status.cloned().unwrap_or_default(),
    })
}

async fn create_hook(
    State(app): State<AppState>,
    caller: Caller,
    Json(body): Json<NewWebhook>,
) -> Result<impl IntoResponse, ApiError> {
    check_url(&body.url).map_err(ApiError::bad_request)?;
    Filter::parse(&body.events).map_err(ApiError::bad_request)?;
    if body.secret.len() < 8 || body.secret.len() > 512 {
        return Err(ApiError::bad_request(
            "`secret` must be 8 to 512 bytes: deliveries are signed with it (HMAC-SHA256)",
        ));
    }
    if app.store.list_webhooks(Some(&caller.tenant))?.len() >= MAX_WEBHOOKS {
        return Err(ApiError::quota(format!(
            "a tenant may have {MAX_WEBHOOKS} webhooks: delete one first"
        )));
    }
    let rec = app.store.insert_webhook(&WebhookRecord {
        id: locker_store::new_id("wh"),
        tenant: caller.tenant.clone(),
        url: body.url,
        events: body.events,
        secret: body.secret,
        created_unix: crate::ids::now_s(),
        cursor: 0,
    })?;
    app.events.start_hook(rec.clone());
    Ok((StatusCode::CREATED, axum::Json(hook_view(&rec, None))))
}

async fn list_hooks(
    State(app): State<AppState>,
    caller: Caller,
) -> Result<impl IntoResponse, ApiError> {
    let hooks = app.store.list_webhooks(Some(&caller.tenant))?;
    let status = app.events.status.lock().expect("status lock").clone();
    let items: Vec<Value> = hooks
        .iter()
        .map(|h| hook_view(h, status.get(&h.id)))
        .collect();
    Ok(axum::Json(json!({ "webhooks": items })))
}

async fn delete_hook(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    if !app.store.delete_webhook(&caller.tenant, &id)? {
        return Err(ApiError::not_found(format!("no webhook {id}")));
    }
    app.events.stop_hook(&id);
    Ok(StatusCode::NO_CONTENT)
}

// ---- deliveries ----

/// `t=<unix>,v1=<hex HMAC-SHA256 of "<unix>.<body>">`.
pub fn signature(secret: &[u8], t: i64, body: &[u8]) -> String {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("HMAC takes any key");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let sum = mac.finalize().into_bytes();
    let hex: String = sum.iter().map(|b| format!("{b:02x}")).collect();
    format!("t={t},v1={hex}")
}

/// One webhook's task: its tenant's events after its cursor, in order, forever.
async fn deliver_all(
    store: Arc<dyn Store>,
    mut latest: tokio::sync::watch::Receiver<u64>,
    status: Arc<Mutex<HashMap<String, HookStatus>>>,
    hook: WebhookRecord,
) {
    let Ok(filter) = Filter::parse(&hook.events) else {
        tracing::warn!(webhook = %hook.id, "webhook with unknown event types: not delivered");
        return;
    };
    let Ok(uri) = check_url(&hook.url) else {
        tracing::warn!(webhook = %hook.id, "webhook with a bad URL: not delivered");
        return;
    };
    let mut cursor = hook.cursor;
    loop {
        // Mark seen before reading, so an event stored meanwhile wakes us again.
        latest.borrow_and_update();
        let page = match store.events_after(Some(&hook.tenant), cursor, 100) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(webhook = %hook.id, error = %e, "cannot read events");
                tokio::time::sleep(Duration::from_secs(5)).await;
                continue;
            }
        };
        if page.is_empty() {
            if latest.changed().await.is_err() {
                return;
            }
            continue;
        }
        for r in page {
            let seq = r.seq;
            if let Some(e) = Event::of(r).filter(|e| filter.wants(e.kind)) {
                deliver_one(&hook, &uri, &e, &status).await;
            }
            cursor = seq;
            if let Err(e) = store.set_webhook_cursor(&hook.id, cursor) {
                tracing::warn!(webhook = %hook.id, error = %e, "cannot store the webhook's cursor");
            }
        }
    }
}

/// Delivers one event, retrying with backoff up to [`ATTEMPTS`] tries.
async fn deliver_one(
    hook: &WebhookRecord,
    uri: &axum::http::Uri,
    e: &Event,
    status: &Mutex<HashMap<String, HookStatus>>,
) {
    let body = Bytes::from(serde_json::to_vec(e).unwrap_or_default());
    let mut wait = FIRST_BACKOFF;
    for attempt in 1..=ATTEMPTS {
        let t = crate::ids::now_s();
        let sig = signature(hook.secret.as_bytes(), t, &body);
        let r = tokio::time::timeout(DELIVERY_TIMEOUT, post(uri, body.clone(), &sig, e)).await;
        let err = match r {
            Ok(Ok(code)) if (200..300).contains(&code) => {
                status
                    .lock()
                    .expect("status lock")
                    .entry(hook.id.clone())
                    .or_default()
                    .delivered += 1;
                return;
            }
            Ok(Ok(code)) => format!("answered {code}"),
            Ok(Err(e)) => e,
            Err(_) => format!("no answer within {} s", DELIVERY_TIMEOUT.as_secs()),
        };
        {
            let mut st = status.lock().expect("status lock");
            let s = st.entry(hook.id.clone()).or_default();
            s.failed_attempts += 1;
            s.last_error = Some(format!(
                "{} (event {}, try {attempt}): {err}",
                hook.url, e.id
            ));
            if attempt == ATTEMPTS {
                s.given_up += 1;
            }
        }
        if attempt == ATTEMPTS {
            tracing::warn!(webhook = %hook.id, event = %e.id, error = %err, "webhook delivery given up");
            return;
        }
        tracing::debug!(webhook = %hook.id, event = %e.id, attempt, error = %err, "webhook delivery failed; retrying");
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(MAX_BACKOFF);
    }
}

/// POSTs `body` to `uri`; the answer's status.
async fn post(uri: &axum::http::Uri, body: Bytes, sig: &str, e: &Event) -> Result<u16, String> {
    let https = uri.scheme_str() == Some("https");
    let host = uri.host().unwrap_or_default();
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let addr = tokio::net::lookup_host((bare, port))
        .await
        .map_err(|e| format!("resolving {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))?;
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let req = axum::http::Request::post(path)
        .header("host", uri.authority().map_or(host, |a| a.as_str()))
        .header("content-type", "application/json")
        .header(
            "user-agent",
            concat!("locker-webhooks/", env!("CARGO_PKG_VERSION")),
        )
        .header("locker-signature", sig)
        .header("locker-event-id", &e.id)
        .header("locker-event-type", e.kind.name())
        .body(http_body_util::Full::new(body))
        .map_err(|e| e.to_string())?;
    if https {
        let name = rustls::pki_types::ServerName::try_from(bare.to_owned())
            .map_err(|e| format!("{host} is not a TLS server name: {e}"))?;
        let tls = tokio_rustls::TlsConnector::from(tls_config()?)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {host}: {e}"))?;
        send(tls, req).await
    } else {
        send(tcp, req).await
    }
}

async fn send<I>(
    io: I,
    req: axum::http::Request<http_body_util::Full<Bytes>>,
) -> Result<u16, String>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|e| format!("HTTP: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("sending: {e}"))?;
    Ok(resp.status().as_u16())
}

/// TLS for `https` webhooks: the host's trusted roots.
fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    static CFG: std::sync::OnceLock<Result<Arc<rustls::ClientConfig>, String>> =
        std::sync::OnceLock::new();
    CFG.get_or_init(|| {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(c);
        }
        if roots.is_empty() {
            return Err("this host has no trusted root certificates for https webhooks".into());
        }
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(Arc::new(cfg))
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_take_names_groups_and_star() {
        let f = Filter::parse(&["sandbox.*".into(), "run.committed".into()]).unwrap();
        assert!(f.wants(Kind::SandboxDeleted));
        assert!(f.wants(Kind::RunCommitted));
        assert!(!f.wants(Kind::TemplateBuilt));
        assert!(Filter::parse(&["*".into()])
            .unwrap()
            .wants(Kind::TemplateFailed));
        assert!(Filter::parse(&["sandbox.exploded".into()]).is_err());
        assert!(Filter::parse(&["nope.*".into()]).is_err());
        assert!(Filter::parse(&[]).is_err());
    }

    #[test]
    fn urls_are_http_or_https_without_credentials() {
        assert!(check_url("http://127.0.0.1:8080/hook").is_ok());
        assert!(check_url("https://example.com/x?y=1").is_ok());
        assert!(check_url("ftp://example.com/").is_err());
        assert!(check_url("/relative").is_err());
        assert!(check_url("http://user:pw@example.com/").is_err());
    }

    #[test]
    fn signature_is_hmac_sha256_of_t_dot_body() {
        // Python: hmac.new(b"Jefe", b'1700000000.{"a":1}', sha256).hexdigest()
        assert_eq!(
            signature(b"Jefe", 1_700_000_000, br#"{"a":1}"#),
            "t=1700000000,v1=fa5f6481efc59da48b19c9dc10196c9953e5651f8304b3a318b6b87d70272e0a"
        );
        assert_eq!(parse_event_id("evt_0000000000000042"), Some(42));
        assert_eq!(parse_event_id("7"), Some(7));
        assert_eq!(parse_event_id("evt_x"), None);
    }
}
