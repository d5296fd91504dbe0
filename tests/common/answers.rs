//! Reading and checking the server's answers the way a client sees them: ids, times, the
//! error shape naming the field at fault, lists, a sandbox's state, background processes,
//! and the table of every keyed route on one sandbox.
//!
//! Plain helpers over [`Api`]: they start no server and own nothing that needs cleaning up.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::server::{Api, Resp};
use crate::wait_for;

/// Now, in Unix seconds.
pub fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

/// Parses the API's RFC 3339 UTC times (`2026-11-30T12:00:00Z`) to Unix seconds.
pub fn parse_time(s: &str) -> i64 {
    locker_types::parse_rfc3339(s).unwrap_or_else(|| panic!("not an RFC 3339 time: {s:?}"))
}

/// The id of a sandbox answer, checked to be a sandbox id.
#[track_caller]
pub fn sandbox_id(v: &Value) -> String {
    let id = v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id in {v}"))
        .to_owned();
    assert!(id.starts_with("sb_"), "sandbox ids start with sb_: {id}");
    id
}

/// The ids of the objects of list `key` of an answer, in order.
#[track_caller]
pub fn ids(list: &Value, key: &str) -> Vec<String> {
    list[key]
        .as_array()
        .unwrap_or_else(|| panic!("no `{key}` array in {list}"))
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_owned())
        .collect()
}

/// The sorted `path`s of a file listing's entries.
#[track_caller]
pub fn entry_names(v: &Value) -> Vec<String> {
    let mut n: Vec<String> = v["entries"]
        .as_array()
        .unwrap_or_else(|| panic!("entries: {v}"))
        .iter()
        .map(|e| e["path"].as_str().expect("path").to_owned())
        .collect();
    n.sort();
    n
}

/// Asserts an error answer with `status`/`code` whose message names `needle` (the field
/// at fault).
#[track_caller]
pub fn refused(r: &Resp, status: u16, code: &str, needle: &str, what: &str) {
    let msg = r.expect_error(status, code, what);
    assert!(
        msg.contains(needle),
        "{what}: the message should name `{needle}`: {msg:?}"
    );
}

/// A body that must be refused: the body, its status and code, and what the message names.
pub type BadBody = (Value, u16, &'static str, &'static str);

/// POSTs every body to `path` and checks each is refused as its row says.
#[track_caller]
pub fn refuse_all(api: &Api, path: &str, cases: &[BadBody]) {
    for (body, status, code, needle) in cases {
        let short: String = body.to_string().chars().take(80).collect();
        refused(
            &api.post(path, body),
            *status,
            code,
            needle,
            &format!("POST {path} {short}"),
        );
    }
}

/// Whether any process of the sandbox has `needle` in its command line.
pub fn running_in(api: &Api, sb: &str, needle: &str) -> bool {
    api.sh(sb, "ps -eo args")
        .lines()
        .any(|l| l.contains(needle))
}

/// The sandbox's record (200).
#[track_caller]
pub fn sandbox(api: &Api, sb: &str) -> Value {
    api.get(&format!("/v1/sandboxes/{sb}"))
        .expect(200, &format!("GET sandbox {sb}"))
}

/// The sandbox's `state`.
#[track_caller]
pub fn state_of(api: &Api, sb: &str) -> Value {
    sandbox(api, sb)["state"].clone()
}

/// Waits until the sandbox's state is `state`.
#[track_caller]
pub fn wait_state(api: &Api, sb: &str, state: &str, limit: Duration, what: &str) {
    wait_for(limit, what, || (state_of(api, sb) == state).then_some(()));
}

/// Starts a background process (200) and returns its id.
#[track_caller]
pub fn start_process(api: &Api, sb: &str, body: &Value) -> String {
    api.post(&format!("/v1/sandboxes/{sb}/processes"), body)
        .expect(200, &format!("start a process {body}"))["id"]
        .as_str()
        .expect("id")
        .to_owned()
}

/// Waits until the process has a result and returns its record.
#[track_caller]
pub fn wait_process_end(api: &Api, sb: &str, proc: &str, what: &str) -> Value {
    wait_for(Duration::from_secs(5), what, || {
        let v = api
            .get(&format!("/v1/sandboxes/{sb}/processes/{proc}"))
            .expect(200, "GET a process");
        (!v["result"].is_null()).then_some(v)
    })
}

/// Asserts that the process is in the sandbox's process list.
#[track_caller]
pub fn assert_listed(api: &Api, sb: &str, proc: &str) {
    let all = ids(
        &api.get(&format!("/v1/sandboxes/{sb}/processes"))
            .expect(200, "list the processes"),
        "processes",
    );
    assert!(all.iter().any(|p| p == proc), "{proc} is listed: {all:?}");
}

/// Asserts that no file directly in `dir` holds any of `secrets` in clear.
#[track_caller]
pub fn assert_not_in_files(dir: &Path, secrets: &[&str]) {
    for e in std::fs::read_dir(dir).expect("the data dir").flatten() {
        if !e.path().is_file() {
            continue;
        }
        let bytes = std::fs::read(e.path()).unwrap_or_default();
        for secret in secrets {
            let found = bytes.windows(secret.len()).any(|w| w == secret.as_bytes());
            assert!(!found, "{} holds a key in clear", e.path().display());
        }
    }
}

/// A request: method, path and JSON body.
pub struct Call {
    pub method: &'static str,
    pub path: String,
    pub body: Option<Value>,
}

impl Call {
    fn new(method: &'static str, path: String, body: Option<Value>) -> Call {
        Call { method, path, body }
    }

    /// Sends it with `Content-Type: application/json` and `headers`, at `path` (or
    /// [`Call::path`] when `None`).
    #[track_caller]
    pub fn send(&self, api: &Api, headers: &[(&str, &str)], path: Option<&str>) -> Resp {
        let mut h = vec![("Content-Type", "application/json")];
        h.extend_from_slice(headers);
        let body = self
            .body
            .as_ref()
            .map(|b| serde_json::to_vec(b).expect("json"))
            .unwrap_or_default();
        api.request(self.method, path.unwrap_or(&self.path), &h, body)
    }
}

/// Every keyed route on sandbox `sb` but the terminal and stdin, each with a body that
/// would leave a mark if it were obeyed (metadata `pwned`, a 1 s TTL, the file
/// `/tmp/pwned`, a killed `proc`, `file` gone or moved).
pub fn sandbox_routes(sb: &str, proc: &str, file: &str) -> Vec<Call> {
    let s = format!("/v1/sandboxes/{sb}");
    let p = format!("{s}/processes/{proc}");
    let pwn = json!({"shell": "touch /tmp/pwned"});
    vec![
        Call::new("GET", s.clone(), None),
        Call::new(
            "PATCH",
            s.clone(),
            Some(json!({"metadata": {"pwned": "yes"}})),
        ),
        Call::new("DELETE", s.clone(), None),
        Call::new("POST", format!("{s}/ttl"), Some(json!({"ttl_s": 1}))),
        Call::new("POST", format!("{s}/pause"), None),
        Call::new("POST", format!("{s}/resume"), None),
        Call::new("POST", format!("{s}/exec"), Some(pwn.clone())),
        Call::new("POST", format!("{s}/processes"), Some(pwn)),
        Call::new("GET", format!("{s}/processes"), None),
        Call::new("GET", p.clone(), None),
        Call::new("GET", format!("{p}/output"), None),
        Call::new(
            "POST",
            format!("{p}/signal"),
            Some(json!({"signal": "KILL"})),
        ),
        Call::new("GET", format!("{s}/files?path={file}"), None),
        Call::new("PUT", format!("{s}/files?path=/tmp/pwned"), None),
        Call::new("DELETE", format!("{s}/files?path={file}"), None),
        Call::new("GET", format!("{s}/files/list?path=/tmp"), None),
        Call::new("GET", format!("{s}/files/stat?path={file}"), None),
        Call::new(
            "POST",
            format!("{s}/files/mkdir"),
            Some(json!({"path": "/tmp/pwned"})),
        ),
        Call::new(
            "POST",
            format!("{s}/files/move"),
            Some(json!({"from": file, "to": "/tmp/pwned"})),
        ),
    ]
}

/// The keyed routes that are not on one sandbox (each a read, or a create that would show).
pub fn tenant_routes() -> Vec<Call> {
    vec![
        Call::new("GET", "/v1/sandboxes".into(), None),
        Call::new("POST", "/v1/sandboxes".into(), Some(json!({}))),
        Call::new("GET", "/v1/templates".into(), None),
        Call::new("GET", "/v1/calls".into(), None),
        Call::new("GET", "/v1/usage".into(), None),
    ]
}
