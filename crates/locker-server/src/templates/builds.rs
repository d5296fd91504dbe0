//! Template builds as the API sees them: queued, running, succeeded or failed; their log
//! and progress as NDJSON events that any number of followers read from the start; at most
//! `--quota-template-builds` running at once per tenant (the rest wait, queued); their
//! records in the store, so a restart tells the builds it interrupted that they failed.
//!
//! Owns the in-memory table of this server's builds and the per-tenant slots. It does not
//! know what a build does (`steps` does) or how a request becomes one (`mod.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::sync::{watch, Semaphore};

use crate::state::{now_s, App};

/// Events kept per build for followers; past it, log lines are dropped (the count said).
const MAX_EVENTS: usize = 20_000;
/// Log lines kept in a build's stored record.
const RECORD_LOG_LINES: usize = 200;
/// Builds one tenant may have queued or running at once; more are refused (429).
pub const MAX_PENDING: usize = 32;

/// A build's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Queued,
    Running,
    Succeeded,
    Failed,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Queued => "queued",
            State::Running => "running",
            State::Succeeded => "succeeded",
            State::Failed => "failed",
        }
    }

    pub fn is_done(self) -> bool {
        matches!(self, State::Succeeded | State::Failed)
    }
}

/// This server's builds, and each tenant's slots.
#[derive(Debug, Default)]
pub struct Builds {
    map: Mutex<HashMap<String, Arc<Build>>>,
    slots: Mutex<HashMap<String, Arc<Semaphore>>>,
    configs: Mutex<HashMap<String, Arc<locker_runtime::template::RunConfig>>>,
    /// Held shared by each running build, exclusively by a prune of the step cache (a
    /// running build's steps are neither named nor in a sandbox yet).
    gate: tokio::sync::RwLock<()>,
}

/// One build.
#[derive(Debug)]
pub struct Build {
    pub id: String,
    pub tenant: String,
    /// The template's name as its tenant knows it.
    pub name: String,
    inner: Mutex<Inner>,
    seen: watch::Sender<usize>,
}

#[derive(Debug)]
struct Inner {
    state: State,
    events: Vec<Value>,
    dropped: u64,
    log_tail: std::collections::VecDeque<String>,
    error: Option<String>,
    template: Option<Value>,
    created_at: String,
    finished_at: Option<String>,
    step: usize,
    steps: usize,
}

impl Builds {
    /// See the field `gate`.
    pub fn gate(&self) -> &tokio::sync::RwLock<()> {
        &self.gate
    }

    /// Registers a new queued build of `tenant`, refusing one past [`MAX_PENDING`].
    pub fn start(&self, id: &str, tenant: &str, name: &str) -> Result<Arc<Build>, String> {
        let mut map = self.map.lock().expect("builds lock");
        let pending = map
            .values()
            .filter(|b| b.tenant == tenant && !b.state().is_done())
            .count();
        if pending >= MAX_PENDING {
            return Err(format!(
                "tenant {tenant} has {pending} template builds queued or running (at most {MAX_PENDING}): wait for some to finish"
            ));
        }
        // Finished builds stay readable from the store; memory keeps the unfinished ones
        // and the latest finished ones.
        if map.len() > 4 * MAX_PENDING {
            let mut done: Vec<_> = map
                .values()
                .filter(|b| b.state().is_done())
                .map(|b| b.id.clone())
                .collect();
            done.sort();
            for id in done.iter().take(done.len().saturating_sub(2 * MAX_PENDING)) {
                map.remove(id);
            }
        }
        let b = Arc::new(Build {
            id: id.to_string(),
            tenant: tenant.to_string(),
            name: name.to_string(),
            inner: Mutex::new(Inner {
                state: State::Queued,
                events: Vec::new(),
                dropped: 0,
                log_tail: Default::default(),
                error: None,
                template: None,
                created_at: locker_types::rfc3339(now_s()),
                finished_at: None,
                step: 0,
                steps: 0,
            }),
            seen: watch::channel(0).0,
        });
        map.insert(id.to_string(), b.clone());
        Ok(b)
    }

    /// This server's build `id` of `tenant`.
    pub fn get(&self, tenant: &str, id: &str) -> Option<Arc<Build>> {
        self.map
            .lock()
            .expect("builds lock")
            .get(id)
            .filter(|b| b.tenant == tenant)
            .cloned()
    }

    /// The tenant's slots: `per_tenant` builds run at once.
    pub fn slots(&self, tenant: &str, per_tenant: u64) -> Arc<Semaphore> {
        self.slots
            .lock()
            .expect("slots lock")
            .entry(tenant.to_string())
            .or_insert_with(|| {
                Arc::new(Semaphore::new(
                    usize::try_from(per_tenant.max(1)).unwrap_or(1),
                ))
            })
            .clone()
    }

    /// The run config of template `digest`, read by `read` the first time.
    pub fn config_of(
        &self,
        digest: &str,
        read: impl FnOnce() -> locker_runtime::template::RunConfig,
    ) -> Arc<locker_runtime::template::RunConfig> {
        if let Some(c) = self.configs.lock().expect("configs lock").get(digest) {
            return c.clone();
        }
        let c = Arc::new(read());
        self.configs
            .lock()
            .expect("configs lock")
            .insert(digest.to_string(), c.clone());
        c
    }

    /// Whether a build of `tenant` is making template `name` now.
    pub fn building(&self, tenant: &str, name: &str) -> bool {
        self.map
            .lock()
            .expect("builds lock")
            .values()
            .any(|b| b.tenant == tenant && b.name == name && !b.state().is_done())
    }
}

impl Build {
    pub fn state(&self) -> State {
        self.inner.lock().expect("build lock").state
    }

    fn push(&self, inner: &mut Inner, ev: Value) {
        if inner.events.len() >= MAX_EVENTS && ev["type"] == "log" {
            inner.dropped += 1;
            return;
        }
        inner.events.push(ev);
        self.seen.send_replace(inner.events.len());
    }

    /// A log line.
    pub fn log(&self, line: impl Into<String>) {
        let line: String = line.into();
        let mut inner = self.inner.lock().expect("build lock");
        if inner.log_tail.len() >= RECORD_LOG_LINES {
            inner.log_tail.pop_front();
        }
        inner.log_tail.push_back(line.clone());
        self.push(&mut inner, json!({"type": "log", "line": line}));
    }

    /// Progress: step `step` of `steps` (1-based), `bytes` written so far.
    pub fn progress(&self, step: usize, steps: usize, bytes: u64) {
        let mut inner = self.inner.lock().expect("build lock");
        inner.step = step;
        inner.steps = steps;
        self.push(
            &mut inner,
            json!({"type": "progress", "step": step, "steps": steps, "bytes": bytes}),
        );
    }

    /// Now running.
    pub fn running(&self, app: &App) {
        self.inner.lock().expect("build lock").state = State::Running;
        self.save(app);
    }

    /// Finished: `Ok(template)` or `Err(why)`. The result event goes last.
    pub fn finish(&self, app: &App, result: Result<Value, String>) {
        {
            let mut inner = self.inner.lock().expect("build lock");
            let (state, template, error) = match result {
                Ok(t) => (State::Succeeded, Some(t), None),
                Err(e) => (State::Failed, None, Some(e)),
            };
            inner.state = state;
            inner.template = template.clone();
            inner.error = error.clone();
            inner.finished_at = Some(locker_types::rfc3339(now_s()));
            let mut ev = json!({"type": "result", "state": state.as_str(), "template": template});
            if let Some(e) = error {
                ev["error"] = json!(e);
            }
            self.push(&mut inner, ev);
        }
        self.save(app);
    }

    /// The build as JSON: the answer of `GET /v1/templates/builds/{id}` and its record.
    pub fn to_json(&self) -> Value {
        let inner = self.inner.lock().expect("build lock");
        json!({
            "build_id": self.id,
            "name": self.name,
            "state": inner.state.as_str(),
            "error": inner.error,
            "template": inner.template,
            "created_at": inner.created_at,
            "finished_at": inner.finished_at,
            "step": inner.step,
            "steps": inner.steps,
            "log": inner.log_tail,
            "log_dropped": inner.dropped,
        })
    }

    /// Writes the record to the store (a failure is logged: the build goes on).
    pub fn save(&self, app: &App) {
        let mut v = self.to_json();
        // Whose build it is, when servers share the store: only that one fails it after a
        // restart (see [`fail_interrupted`]). Never shown (see [`shown`]).
        v[HOST_FIELD] = json!(app.host_id);
        let state = v["state"].as_str().unwrap_or("failed").to_string();
        if let Err(e) = app
            .store
            .put_template_build(&self.id, &self.tenant, &state, &v.to_string())
        {
            tracing::warn!(build = %self.id, "cannot record the template build: {e}");
        }
    }

    /// Events from index `from` on, and whether the build has finished with them.
    pub fn events_from(&self, from: usize) -> (Vec<Value>, bool) {
        let inner = self.inner.lock().expect("build lock");
        let evs = inner.events.get(from..).unwrap_or_default().to_vec();
        let done = inner.state.is_done() && from + evs.len() >= inner.events.len();
        (evs, done)
    }

    /// Waits until there are more than `n` events (or the build is dropped).
    pub async fn wait_past(&self, n: usize) {
        let mut rx = self.seen.subscribe();
        let _ = rx.wait_for(|len| *len > n).await;
    }
}

/// At start: the builds a stopped server left queued or running failed, and say so.
/// The field of a build's record that names the server running it.
const HOST_FIELD: &str = "_host";

/// A build's record as the API shows it (without the fields only servers read).
pub fn shown(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.remove(HOST_FIELD);
    }
    v
}

pub fn fail_interrupted(app: &App) {
    let unfinished = match app.store.unfinished_template_builds() {
        Ok(u) => u,
        Err(e) => {
            tracing::warn!("cannot read unfinished template builds: {e}");
            return;
        }
    };
    for (tenant, record) in unfinished {
        let Ok(mut v) = serde_json::from_str::<Value>(&record) else {
            continue;
        };
        // Another server's build (a control replica sharing the store) runs there.
        if v[HOST_FIELD].as_str().is_some_and(|h| h != app.host_id) {
            continue;
        }
        let Some(id) = v["build_id"].as_str().map(str::to_string) else {
            continue;
        };
        v["state"] = json!("failed");
        v["error"] = json!("the server stopped during this build: start it again");
        v["finished_at"] = json!(locker_types::rfc3339(now_s()));
        if let Err(e) = app
            .store
            .put_template_build(&id, &tenant, "failed", &v.to_string())
        {
            tracing::warn!(build = %id, "cannot record the interrupted template build: {e}");
        } else {
            tracing::info!(build = %id, %tenant, "a template build was interrupted by a restart: marked failed");
        }
    }
}
