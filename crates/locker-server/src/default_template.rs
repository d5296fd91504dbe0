//! The template `default` at start: the contract says it exists once the server has
//! started, so a server on a host without it builds it in the background (progress in the
//! log) unless told not to, and creates meanwhile answer 503 "being built since …" instead
//! of "unknown template". When the build cannot run (no root, no mmdebstrap, no mirror)
//! the log says why and which command builds it.
//!
//! Owns only that state and the answer for a missing template; the build itself is
//! `locker_runtime::template`'s, and this room never deletes or replaces a template.

use std::sync::Mutex;

use locker_runtime::template::{Progress, DEFAULT_TEMPLATE};

use crate::error::ApiError;
use crate::state::{now_s, AppState};

/// The command that builds the default template by hand.
const BUILD_CMD: &str = "sudo locker template build default";

/// Where the default template stands on this server.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum State {
    /// Built when the server started, or nothing was asked of this room.
    #[default]
    Unknown,
    /// Building since this RFC 3339 time.
    Building(String),
    /// Missing, with the reason it was not built and what to run.
    Missing(String),
}

/// The shared state (one per server).
#[derive(Debug, Default)]
pub struct DefaultTemplate {
    state: Mutex<State>,
}

impl DefaultTemplate {
    pub fn state(&self) -> State {
        self.state.lock().expect("default template lock").clone()
    }

    fn set(&self, s: State) {
        *self.state.lock().expect("default template lock") = s;
    }
}

/// At start: if `default` is not built, build it in the background (`build`) or warn.
pub fn ensure(app: &AppState, build: bool) {
    match app.templates.resolve(DEFAULT_TEMPLATE) {
        Ok(Some(_)) => return,
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the template cache");
            return;
        }
    }
    let cache = app.templates.cache_dir().display().to_string();
    if !build {
        let why = format!(
            "the template `default` is not built in {cache} (--no-template-build): run `{BUILD_CMD}`"
        );
        tracing::warn!("{why}; creates without a template fail until then");
        app.default_template.set(State::Missing(why));
        return;
    }
    let since = locker_types::rfc3339(now_s());
    app.default_template.set(State::Building(since));
    tracing::info!(
        cache = %cache,
        "the template `default` is not built: building it in the background (Debian bookworm, a few minutes; creates answer 503 until it is done)"
    );
    let app = app.clone();
    tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        match app.templates.ensure_default(&mut LogProgress::default()) {
            Ok(t) => {
                tracing::info!(
                    digest = %t.digest,
                    seconds = started.elapsed().as_secs(),
                    "the template `default` is built"
                );
                app.default_template.set(State::Unknown);
            }
            Err(e) => {
                let why = format!(
                    "building the template `default` failed: {e}; fix that and run `{BUILD_CMD}` (or `scripts/setup`)"
                );
                tracing::warn!("{why}");
                app.default_template.set(State::Missing(why));
            }
        }
    });
}

/// The answer for a template this host has not built: 503 while `default` is being
/// built, else how to build it.
pub fn unknown(app: &AppState, name: &str) -> ApiError {
    if name == DEFAULT_TEMPLATE {
        match app.default_template.state() {
            State::Building(since) => {
                return ApiError::unavailable(format!(
                    "the default template is being built since {since} (the server started without it); try again in a minute"
                ))
            }
            State::Missing(why) => return ApiError::bad_request(format!("unknown template \"default\": {why}")),
            State::Unknown => {}
        }
    }
    crate::sandboxes::unknown_template(name)
}

/// Build progress as log lines: each step once, and the fraction at most every 10%.
#[derive(Default)]
struct LogProgress {
    last_tenth: i64,
}

impl Progress for LogProgress {
    fn step(&mut self, name: &str, fraction: f64) {
        tracing::info!(
            step = name,
            percent = (fraction * 100.0).round(),
            "building the template `default`"
        );
    }

    fn fraction(&mut self, fraction: f64) {
        let tenth = (fraction * 10.0).floor() as i64;
        if tenth > self.last_tenth {
            self.last_tenth = tenth;
            tracing::info!(percent = tenth * 10, "building the template `default`");
        }
    }
}
