//! What envd keeps of its own and Locker's rooms do not: the defaults `/init` sets (more
//! environment, the default user, the default working directory) and the tags `Start`
//! gives processes. Kept per sandbox in the server's memory (a restarted server starts
//! without them, as a restarted envd does); a sandbox's entry goes when the sandbox is no
//! longer on this server (checked whenever an entry is made).

use std::collections::{BTreeMap, HashMap};
use std::sync::{LazyLock, Mutex};

use crate::state::AppState;

/// The most tagged processes one sandbox keeps tags of: the oldest go first.
const MAX_TAGS: usize = 4096;

/// What `/init` set for one sandbox.
#[derive(Clone, Default)]
pub(super) struct Defaults {
    /// Environment every process `Start` runs gets, under the `Start`'s own `envs`.
    pub env: BTreeMap<String, String>,
    /// The user of calls that name none (else E2B's `user`).
    pub user: Option<String>,
    /// The working directory of processes started without `cwd` (else the user's home).
    pub workdir: Option<String>,
}

#[derive(Default)]
struct Sandbox {
    defaults: Defaults,
    /// Tags by the agent's process id, in the order they were given.
    tags: Vec<(String, String)>,
}

static STATE: LazyLock<Mutex<HashMap<String, Sandbox>>> = LazyLock::new(Default::default);

/// Forgets the sandboxes no longer on this server (killed, gone past their timeout).
async fn prune(app: &AppState) {
    let live: std::collections::HashSet<String> = app.live.read().await.keys().cloned().collect();
    STATE
        .lock()
        .expect("envd state lock")
        .retain(|id, _| live.contains(id));
}

/// The defaults of sandbox `id` (empty ones until `/init` sets some).
pub(super) fn defaults(id: &str) -> Defaults {
    STATE
        .lock()
        .expect("envd state lock")
        .get(id)
        .map(|s| s.defaults.clone())
        .unwrap_or_default()
}

/// `/init`: merges `env` into the sandbox's, and replaces the user and working directory
/// when given.
pub(super) async fn init(
    app: &AppState,
    id: &str,
    env: BTreeMap<String, String>,
    user: Option<String>,
    workdir: Option<String>,
) {
    prune(app).await;
    let mut map = STATE.lock().expect("envd state lock");
    let d = &mut map.entry(id.to_owned()).or_default().defaults;
    d.env.extend(env);
    if user.is_some() {
        d.user = user;
    }
    if workdir.is_some() {
        d.workdir = workdir;
    }
}

/// Tags the process `proc_id` (the agent's id) of sandbox `id`.
pub(super) async fn tag(app: &AppState, id: &str, proc_id: &str, tag: &str) {
    prune(app).await;
    let mut map = STATE.lock().expect("envd state lock");
    let tags = &mut map.entry(id.to_owned()).or_default().tags;
    if tags.len() >= MAX_TAGS {
        tags.remove(0);
    }
    tags.push((proc_id.to_owned(), tag.to_owned()));
}

/// The tags of sandbox `id`'s processes, by the agent's process id; with `keep`, the tags
/// of processes not in it are forgotten (they ended and left the agent's table).
pub(super) fn tags(id: &str, keep: Option<&dyn Fn(&str) -> bool>) -> HashMap<String, String> {
    let mut map = STATE.lock().expect("envd state lock");
    let Some(s) = map.get_mut(id) else {
        return HashMap::new();
    };
    if let Some(keep) = keep {
        s.tags.retain(|(p, _)| keep(p));
    }
    s.tags.iter().cloned().collect()
}
