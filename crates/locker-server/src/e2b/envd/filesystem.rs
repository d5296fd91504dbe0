//! envd's `filesystem.Filesystem` service onto the agent's file operations (the same ones
//! Locker's files API uses, so paths resolve inside the machine's root whatever they say)
//! and its inotify watches (`Request::Watch`): `WatchDir` streams them; `CreateWatcher`
//! keeps one running here, its events buffered (bounded) until `GetWatcherEvents` takes
//! them. A watcher ends with its sandbox (the agent's stream ends), with `RemoveWatcher`,
//! or when its sandbox is no longer live when one is next created.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, LazyLock, Mutex};

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use locker_proto::{FsEvent, FsOp};
use locker_types::{Entry, EntryType};
use serde::Deserialize;
use serde_json::{json, Value};

use super::connect::{
    self, stream_error, stream_response, unary_ok, Code, ConnectError, Envelopes, Shape,
};
use super::resolve_path;
use crate::e2b::Target;
use crate::failed::result;
use crate::lifecycle::live_of;
use crate::state::{new_id, AppState, Busy};

/// The most events a watcher keeps between two `GetWatcherEvents`; past it the oldest go.
const MAX_BUFFERED_EVENTS: usize = 10_000;
/// The most watchers (`CreateWatcher`) one sandbox may hold at once.
const MAX_WATCHERS_PER_SANDBOX: usize = 64;
/// How long `GetWatcherEvents` waits for a batch already received from the agent to be
/// buffered (its entries are stat'ed in the machine first, with `include_entry`).
const SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Deserialize, Default)]
#[serde(default)]
struct PathRequest {
    path: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct MoveRequest {
    source: String,
    destination: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ListDirRequest {
    path: String,
    #[serde(deserialize_with = "connect::pj::opt_u32")]
    depth: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WatchRequest {
    path: String,
    recursive: bool,
    #[serde(alias = "include_entry")]
    include_entry: bool,
    #[serde(alias = "allow_network_mounts")]
    allow_network_mounts: bool,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WatcherIdRequest {
    #[serde(alias = "watcher_id")]
    watcher_id: String,
}

pub(super) async fn serve(app: AppState, t: Target, method: String, req: Request) -> Response {
    let shape = match method.as_str() {
        "WatchDir" => Shape::ServerStream,
        "Stat" | "MakeDir" | "Move" | "ListDir" | "Remove" | "CreateWatcher"
        | "GetWatcherEvents" | "RemoveWatcher" => Shape::Unary,
        _ => {
            return ConnectError::new(
                Code::Unimplemented,
                format!(
                    "filesystem.Filesystem/{method} does not exist: the service has Stat, \
                     MakeDir, Move, ListDir, Remove, WatchDir, CreateWatcher, \
                     GetWatcherEvents and RemoveWatcher"
                ),
            )
            .into_response()
        }
    };
    let (timeout, user) = match super::rpc_headers(req.headers(), shape, &t) {
        Ok(h) => h,
        Err(refused) => return refused,
    };
    let keepalive = super::keepalive_interval(req.headers());
    let body = req.into_body();
    if shape == Shape::ServerStream {
        return watch_dir(app, t, user, keepalive, body)
            .await
            .unwrap_or_else(stream_error);
    }
    let call = unary(app, t, user, &method, body);
    let r = match timeout {
        Some(d) => tokio::time::timeout(d, call).await.unwrap_or_else(|_| {
            Err(ConnectError::new(
                Code::DeadlineExceeded,
                format!("filesystem.Filesystem/{method} did not finish within Connect-Timeout-Ms"),
            ))
        }),
        None => call.await,
    };
    r.unwrap_or_else(|e| e.into_response())
}

fn path_of(user: &str, p: &str, field: &str) -> Result<String, ConnectError> {
    if p.is_empty() {
        return Err(ConnectError::invalid(format!("`{field}` is required")));
    }
    resolve_path(user, p).map_err(|e| ConnectError::invalid(format!("`{field}`: {e}")))
}

/// `-rwxr-xr-x`, as Go's `FileMode.String()` writes it for the kinds E2B shows.
fn permissions(kind: EntryType, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        EntryType::Dir => 'd',
        EntryType::Symlink => 'L',
        _ => '-',
    });
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// The machine's user and group names (its `/etc/passwd` and `/etc/group`), for the
/// `owner` and `group` of envd's `EntryInfo`; read once per call that shows entries. An id
/// without a name shows as its number, as `ls -l` does.
#[derive(Default)]
struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl Names {
    async fn of(agent: &locker_runtime::agent::AgentClient) -> Names {
        Names {
            users: ids_of(agent, "/etc/passwd").await,
            groups: ids_of(agent, "/etc/group").await,
        }
    }

    fn user(&self, id: Option<u32>) -> String {
        id.map(|i| self.users.get(&i).cloned().unwrap_or_else(|| i.to_string()))
            .unwrap_or_default()
    }

    fn group(&self, id: Option<u32>) -> String {
        id.map(|i| self.groups.get(&i).cloned().unwrap_or_else(|| i.to_string()))
            .unwrap_or_default()
    }
}

/// `name:x:id:…` lines of a passwd or group file in the machine, its first 1 MiB (the
/// machine's root writes it: nothing in it is trusted past that bound); none when it
/// cannot be read.
async fn ids_of(agent: &locker_runtime::agent::AgentClient, path: &str) -> HashMap<u32, String> {
    let mut text = Vec::new();
    if let Ok((_, mut r)) = agent.read_file(path).await {
        while let Ok(Some(chunk)) = r.next_chunk().await {
            text.extend_from_slice(&chunk);
            if text.len() >= 1 << 20 {
                break;
            }
        }
    }
    let mut ids = HashMap::new();
    for line in String::from_utf8_lossy(&text).lines() {
        let mut f = line.split(':');
        if let (Some(name), Some(_), Some(Ok(id))) = (f.next(), f.next(), f.next().map(str::parse)) {
            if !name.is_empty() {
                ids.entry(id).or_insert_with(|| name.to_owned());
            }
        }
    }
    ids
}

/// An entry as envd's `EntryInfo` (ProtoJSON: `size` is an int64, so a string): a
/// symlink's `symlinkTarget` as an absolute path, a file's user `metadata`.
fn entry_json(e: &Entry, names: &Names) -> Value {
    let kind = match e.kind {
        EntryType::Dir => "FILE_TYPE_DIRECTORY",
        EntryType::Symlink => "FILE_TYPE_SYMLINK",
        EntryType::File => "FILE_TYPE_FILE",
        EntryType::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let mut v = json!({
        "name": e.name,
        "type": kind,
        "path": e.path,
        "size": e.size.to_string(),
        "mode": e.mode & 0o7777,
        "permissions": permissions(e.kind, e.mode),
        "owner": names.user(e.uid),
        "group": names.group(e.gid),
        "modifiedTime": e.mtime,
    });
    if let Some(t) = &e.target {
        let abs = if t.starts_with('/') {
            t.clone()
        } else {
            format!("{}/{t}", super::parent_of(&e.path))
        };
        v["symlinkTarget"] = json!(resolve_path("root", &abs).unwrap_or(abs));
    }
    if !e.metadata.is_empty() {
        v["metadata"] = json!(e.metadata);
    }
    v
}

/// The most links [`followed`] follows, as the kernel (`ELOOP` past it).
const MAX_LINKS: usize = 40;

/// `e` as envd's `Stat` describes a symlink: the name and path of the link, with what the
/// link resolves to (its type, size, mode, owner, time and metadata) and that path as its
/// `target`. A link that does not resolve (dangling, a loop) is described as the link.
async fn followed(agent: &locker_runtime::agent::AgentClient, e: Entry) -> Entry {
    if e.kind != EntryType::Symlink {
        return e;
    }
    let mut cur = e.clone();
    for _ in 0..MAX_LINKS {
        if cur.kind != EntryType::Symlink {
            return Entry {
                name: e.name,
                path: e.path,
                target: Some(cur.path),
                ..cur
            };
        }
        let Some(t) = cur.target.as_deref() else {
            return e;
        };
        let next = if t.starts_with('/') {
            t.to_owned()
        } else {
            format!("{}/{t}", super::parent_of(&cur.path))
        };
        let Ok(next) = resolve_path("root", &next) else {
            return e;
        };
        match agent.stat(&next).await {
            Ok(n) => cur = n,
            Err(_) => return e,
        }
    }
    e
}

async fn busy(app: &AppState, t: &Target) -> Result<Busy, ConnectError> {
    Ok(live_of(app, &t.caller, &t.live.id).await?)
}

async fn unary(
    app: AppState,
    t: Target,
    user: String,
    method: &str,
    body: axum::body::Body,
) -> Result<Response, ConnectError> {
    match method {
        "Stat" => {
            let m: PathRequest = connect::read_unary("filesystem.StatRequest", body).await?;
            let path = path_of(&user, &m.path, "path")?;
            let live = busy(&app, &t).await?;
            let e = result(&app, &live, live.machine.agent.stat(&path).await).await?;
            let e = followed(&live.machine.agent, e).await;
            let names = Names::of(&live.machine.agent).await;
            Ok(unary_ok(&json!({"entry": entry_json(&e, &names)})))
        }
        "MakeDir" => {
            let m: PathRequest = connect::read_unary("filesystem.MakeDirRequest", body).await?;
            let path = path_of(&user, &m.path, "path")?;
            let live = busy(&app, &t).await?;
            let agent = &live.machine.agent;
            if let Ok(e) = agent.stat(&path).await {
                let what = if e.kind == EntryType::Dir {
                    "directory"
                } else {
                    "file"
                };
                return Err(ConnectError::new(
                    Code::AlreadyExists,
                    format!("{what} {path} already exists"),
                ));
            }
            let made = super::missing_dirs(agent, &path, true).await;
            let e = result(&app, &live, agent.mkdir(&path).await).await?;
            let r = super::give_to(agent, &user, &made).await;
            result(&app, &live, r).await?;
            // Stat again: the directory now belongs to the call's user.
            let e = agent.stat(&path).await.unwrap_or(e);
            let names = Names::of(agent).await;
            Ok(unary_ok(&json!({"entry": entry_json(&e, &names)})))
        }
        "Move" => {
            let m: MoveRequest = connect::read_unary("filesystem.MoveRequest", body).await?;
            let from = path_of(&user, &m.source, "source")?;
            let to = path_of(&user, &m.destination, "destination")?;
            let live = busy(&app, &t).await?;
            let e = result(&app, &live, live.machine.agent.rename(&from, &to).await).await?;
            let names = Names::of(&live.machine.agent).await;
            Ok(unary_ok(&json!({"entry": entry_json(&e, &names)})))
        }
        "ListDir" => {
            let m: ListDirRequest = connect::read_unary("filesystem.ListDirRequest", body).await?;
            let path = path_of(&user, &m.path, "path")?;
            let depth = m.depth.unwrap_or(1).clamp(1, 64);
            let live = busy(&app, &t).await?;
            let agent = &live.machine.agent;
            let dir = result(&app, &live, agent.stat(&path).await).await?;
            if dir.kind != EntryType::Dir {
                return Err(ConnectError::invalid(format!(
                    "path {path} is not a directory"
                )));
            }
            let entries = result(&app, &live, agent.list(&path, depth).await).await?;
            let names = Names::of(agent).await;
            let list: Vec<Value> = entries.iter().map(|e| entry_json(e, &names)).collect();
            Ok(unary_ok(&json!({"entries": list})))
        }
        "Remove" => {
            let m: PathRequest = connect::read_unary("filesystem.RemoveRequest", body).await?;
            let path = path_of(&user, &m.path, "path")?;
            if path == "/" {
                return Err(ConnectError::invalid(
                    "refusing to remove the machine's root",
                ));
            }
            let live = busy(&app, &t).await?;
            match live.machine.agent.remove(&path, true).await {
                Ok(()) => Ok(unary_ok(&json!({}))),
                // As envd's `os.RemoveAll`: a path that is not there is removed already.
                Err(locker_runtime::agent::AgentClientError::Agent(e))
                    if e.code == locker_proto::ErrorCode::NotFound =>
                {
                    Ok(unary_ok(&json!({})))
                }
                Err(e) => Err(crate::failed::check(&app, &live, e).await.into()),
            }
        }
        "CreateWatcher" => {
            let m: WatchRequest =
                connect::read_unary("filesystem.CreateWatcherRequest", body).await?;
            let path = path_of(&user, &m.path, "path")?;
            let live = busy(&app, &t).await?;
            let id = create_watcher(&app, &live, path, m).await?;
            Ok(unary_ok(&json!({"watcherId": id})))
        }
        "GetWatcherEvents" => {
            let m: WatcherIdRequest =
                connect::read_unary("filesystem.GetWatcherEventsRequest", body).await?;
            let w = watcher(&t, &m.watcher_id)?;
            // A batch the agent already sent is the caller's too (a poll right after a
            // write must see the write's events): wait for the one being described.
            let _ = tokio::time::timeout(SETTLE, w.settled()).await;
            let events: Vec<Value> = w.events.lock().expect("events lock").drain(..).collect();
            let failed = w.failed.lock().expect("failed lock").clone();
            if events.is_empty() {
                if let Some(e) = failed {
                    return Err(e);
                }
            }
            Ok(unary_ok(&json!({"events": events})))
        }
        "RemoveWatcher" => {
            let m: WatcherIdRequest =
                connect::read_unary("filesystem.RemoveWatcherRequest", body).await?;
            let w = watcher(&t, &m.watcher_id)?;
            w.task.abort();
            WATCHERS
                .lock()
                .expect("watchers lock")
                .remove(&m.watcher_id);
            Ok(unary_ok(&json!({})))
        }
        _ => unreachable!("dispatched above"),
    }
}

/// An inotify watch's events as envd's `FilesystemEvent`s; `name` is relative to the
/// watched directory.
/// Shows a write through `/files` as envd's in-place write shows (`CREATE`, `WRITE`, then
/// `CHMOD` from the ownership): the agent writes a file whole or not at all, into a
/// temporary `.<name>.<hex>.locker-tmp` beside it that it then renames over the name, so
/// inotify reports the temporary file's events and the rename. Events on the temporary
/// name are reported on the file's own name, its mode change and the rename are left out,
/// and so is the `CREATE` the rename lands as. Differs from envd: a file written over
/// shows a `CREATE` too.
#[derive(Default)]
struct TempWrites {
    /// Names whose temporary file was renamed and whose landing is still to come.
    landing: std::collections::HashSet<String>,
}

impl TempWrites {
    /// The events of `batch` as envd would report them.
    fn translate(&mut self, batch: Vec<FsEvent>) -> Vec<FsEvent> {
        let mut out = Vec::with_capacity(batch.len());
        for e in batch {
            match temp_target(&e.name) {
                Some(target) => match e.op {
                    FsOp::Create | FsOp::Write => out.push(FsEvent {
                        name: target,
                        op: e.op,
                    }),
                    FsOp::Rename => {
                        if self.landing.len() < 1024 {
                            self.landing.insert(target);
                        }
                    }
                    FsOp::Chmod | FsOp::Remove => {}
                },
                None if e.op == FsOp::Create && self.landing.remove(&e.name) => {}
                None => out.push(e),
            }
        }
        out
    }
}

/// The file a name of the agent's temporary files (`[dir/].<name>.<16 hex>.locker-tmp`)
/// stands for: `[dir/]<name>`.
fn temp_target(name: &str) -> Option<String> {
    let (dir, base) = match name.rsplit_once('/') {
        Some((d, b)) => (Some(d), b),
        None => (None, name),
    };
    let rest = base.strip_prefix('.')?.strip_suffix(".locker-tmp")?;
    let (file, hex) = rest.rsplit_once('.')?;
    if file.is_empty() || hex.len() < 8 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(match dir {
        Some(d) => format!("{d}/{file}"),
        None => file.to_owned(),
    })
}

fn event_json(e: &FsEvent) -> Value {
    let kind = match e.op {
        FsOp::Create => "EVENT_TYPE_CREATE",
        FsOp::Write => "EVENT_TYPE_WRITE",
        FsOp::Remove => "EVENT_TYPE_REMOVE",
        FsOp::Rename => "EVENT_TYPE_RENAME",
        FsOp::Chmod => "EVENT_TYPE_CHMOD",
    };
    json!({"name": e.name, "type": kind})
}

/// A batch of events (under the watched directory `dir`) as envd's `FilesystemEvent`s;
/// with `include_entry`, each with the `entry` of what it names when that can be stat'ed
/// (not a removed one, nor one renamed away), as envd 0.6.3 sends.
async fn events_json(
    agent: &locker_runtime::agent::AgentClient,
    dir: &str,
    batch: &[FsEvent],
    include_entry: bool,
) -> Vec<Value> {
    let names = if include_entry && !batch.is_empty() {
        Some(Names::of(agent).await)
    } else {
        None
    };
    let mut out = Vec::with_capacity(batch.len());
    for e in batch {
        let mut v = event_json(e);
        if let Some(names) = &names {
            if e.op != FsOp::Remove {
                if let Ok(en) = agent.stat(&format!("{dir}/{}", e.name)).await {
                    v["entry"] = entry_json(&en, names);
                }
            }
        }
        out.push(v);
    }
    out
}

async fn open_watch(
    app: &AppState,
    live: &Busy,
    path: &str,
    m: &WatchRequest,
) -> Result<locker_runtime::agent::WatchStream, ConnectError> {
    // Network mounts are watched as any directory: inotify reports what the machine's
    // kernel sees of them (changes made elsewhere may not show), as envd warns.
    let _ = m.allow_network_mounts;
    let agent = &live.machine.agent;
    let dir = result(app, live, agent.stat(path).await).await?;
    if dir.kind != EntryType::Dir {
        return Err(ConnectError::invalid(format!(
            "path {path} is not a directory"
        )));
    }
    let r = agent.watch(path, m.recursive).await;
    Ok(result(app, live, r).await?)
}

async fn watch_dir(
    app: AppState,
    t: Target,
    user: String,
    keepalive: std::time::Duration,
    body: axum::body::Body,
) -> Result<Response, ConnectError> {
    let m: WatchRequest = Envelopes::new(body)
        .single("filesystem.WatchDirRequest")
        .await?;
    let path = path_of(&user, &m.path, "path")?;
    let live = busy(&app, &t).await?;
    let mut w = open_watch(&app, &live, &path, &m).await?;
    let (out, resp) = stream_response();
    let include = m.include_entry;
    tokio::spawn(async move {
        let agent = live.machine.agent.clone();
        let _live = live;
        if !out.send(&json!({"start": {}})).await {
            return;
        }
        // A `keepalive` message after each `keepalive` without one, as envd sends.
        let idle = tokio::time::sleep(keepalive);
        tokio::pin!(idle);
        let mut temp = TempWrites::default();
        loop {
            tokio::select! {
                next = w.next() => match next {
                    Ok(Some(events)) => {
                        let events = temp.translate(events);
                        for e in events_json(&agent, &path, &events, include).await {
                            if !out.send(&json!({"filesystem": e})).await {
                                return;
                            }
                        }
                        idle.as_mut().reset(tokio::time::Instant::now() + keepalive);
                    }
                    Ok(None) => return out.end(None).await,
                    Err(e) => {
                        let e: ConnectError = crate::error::ApiError::from(e).into();
                        return out.end(Some(e)).await;
                    }
                },
                () = &mut idle => {
                    if !out.send(&json!({"keepalive": {}})).await {
                        return;
                    }
                    idle.as_mut().reset(tokio::time::Instant::now() + keepalive);
                }
                _ = out.closed() => return,
            }
        }
    });
    Ok(resp)
}

/// A watcher made by `CreateWatcher`.
struct Watcher {
    sandbox: String,
    tenant: String,
    events: Arc<Mutex<VecDeque<Value>>>,
    /// Whether a batch received from the agent is being described (not yet buffered).
    busy: Arc<tokio::sync::watch::Sender<bool>>,
    /// Why its watch ended, if it did with an error.
    failed: Arc<Mutex<Option<ConnectError>>>,
    task: tokio::task::AbortHandle,
}

static WATCHERS: LazyLock<Mutex<HashMap<String, Watcher>>> = LazyLock::new(Default::default);

fn watcher(t: &Target, id: &str) -> Result<WatcherView, ConnectError> {
    let map = WATCHERS.lock().expect("watchers lock");
    match map.get(id) {
        Some(w) if w.sandbox == t.live.id && w.tenant == t.caller.tenant => Ok(WatcherView {
            events: w.events.clone(),
            busy: w.busy.subscribe(),
            failed: w.failed.clone(),
            task: w.task.clone(),
        }),
        _ => Err(ConnectError::not_found(format!("watcher {id:?} not found"))),
    }
}

struct WatcherView {
    events: Arc<Mutex<VecDeque<Value>>>,
    busy: tokio::sync::watch::Receiver<bool>,
    failed: Arc<Mutex<Option<ConnectError>>>,
    task: tokio::task::AbortHandle,
}

impl WatcherView {
    /// Returns once no batch is between the agent and the buffer.
    async fn settled(&self) {
        let _ = self.busy.clone().wait_for(|busy| !busy).await;
    }
}

async fn create_watcher(
    app: &AppState,
    live: &Busy,
    path: String,
    m: WatchRequest,
) -> Result<String, ConnectError> {
    // Forget the watchers of sandboxes that are no longer live here.
    let live_ids: Vec<String> = app.live.read().await.keys().cloned().collect();
    {
        let mut map = WATCHERS.lock().expect("watchers lock");
        map.retain(|_, w| {
            let keep = live_ids.contains(&w.sandbox);
            if !keep {
                w.task.abort();
            }
            keep
        });
        let mine = map.values().filter(|w| w.sandbox == live.id).count();
        if mine >= MAX_WATCHERS_PER_SANDBOX {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!(
                    "sandbox {} already has {MAX_WATCHERS_PER_SANDBOX} watchers: remove some with RemoveWatcher",
                    live.id
                ),
            ));
        }
    }
    let mut w = open_watch(app, live, &path, &m).await?;
    let events: Arc<Mutex<VecDeque<Value>>> = Arc::default();
    let failed: Arc<Mutex<Option<ConnectError>>> = Arc::default();
    let busy = Arc::new(tokio::sync::watch::channel(false).0);
    let (ev2, failed2, busy2) = (events.clone(), failed.clone(), busy.clone());
    let agent = live.machine.agent.clone();
    let include = m.include_entry;
    let task = tokio::spawn(async move {
        let mut temp = TempWrites::default();
        loop {
            match w.next().await {
                Ok(Some(batch)) => {
                    busy2.send_replace(true);
                    let batch = temp.translate(batch);
                    let batch = events_json(&agent, &path, &batch, include).await;
                    let mut q = ev2.lock().expect("events lock");
                    for e in batch {
                        if q.len() >= MAX_BUFFERED_EVENTS {
                            q.pop_front();
                        }
                        q.push_back(e);
                    }
                    drop(q);
                    busy2.send_replace(false);
                }
                Ok(None) => return,
                Err(e) => {
                    let e: ConnectError = crate::error::ApiError::from(e).into();
                    *failed2.lock().expect("failed lock") = Some(e);
                    return;
                }
            }
        }
    });
    let id = new_id("w_");
    WATCHERS.lock().expect("watchers lock").insert(
        id.clone(),
        Watcher {
            sandbox: live.id.clone(),
            tenant: live.tenant.clone(),
            events,
            busy,
            failed,
            task: task.abort_handle(),
        },
    );
    Ok(id)
}

#[cfg(test)]
mod tests {
    #[test]
    fn permissions_read_like_go() {
        use locker_types::EntryType;
        assert_eq!(super::permissions(EntryType::File, 0o644), "-rw-r--r--");
        assert_eq!(super::permissions(EntryType::Dir, 0o755), "drwxr-xr-x");
    }

    /// A write through `/files` (temporary file, its mode, the rename, the ownership)
    /// reads as envd's in-place write; other events pass unchanged.
    #[test]
    fn temporary_files_read_as_writes_in_place() {
        use locker_proto::{FsEvent, FsOp};
        let ev = |name: &str, op| FsEvent {
            name: name.into(),
            op,
        };
        let tmp = "d/.a.txt.0123456789abcdef.locker-tmp";
        let mut t = super::TempWrites::default();
        let got = t.translate(vec![
            ev(tmp, FsOp::Create),
            ev(tmp, FsOp::Write),
            ev(tmp, FsOp::Chmod),
            ev(tmp, FsOp::Rename),
            ev("d/a.txt", FsOp::Create),
            ev("d/a.txt", FsOp::Chmod),
            ev("d/b", FsOp::Create),
            ev(".hidden", FsOp::Write),
            ev(".x.locker-tmp", FsOp::Create),
        ]);
        assert_eq!(
            got,
            vec![
                ev("d/a.txt", FsOp::Create),
                ev("d/a.txt", FsOp::Write),
                ev("d/a.txt", FsOp::Chmod),
                ev("d/b", FsOp::Create),
                ev(".hidden", FsOp::Write),
                ev(".x.locker-tmp", FsOp::Create),
            ]
        );
        // A later create of the same name (not a landing) is reported.
        assert_eq!(
            t.translate(vec![ev("d/a.txt", FsOp::Create)]),
            vec![ev("d/a.txt", FsOp::Create)]
        );
    }
}
