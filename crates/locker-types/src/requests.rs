//! The request bodies of the sandbox and run routes (`docs/api.md`): `POST /v1/sandboxes`
//! ([`CreateSandbox`]), `PATCH /v1/sandboxes/{id}` ([`PatchSandbox`]), `POST
//! /v1/volumes/{id}/run` ([`RunRequest`]), and the values inside them: [`RuntimeChoice`]
//! and [`Runtime`], [`NetworkPolicy`], [`VolumeMount`], [`CommitMode`].
//!
//! Shapes only, as everywhere in this crate: a body that does not parse is refused with a
//! message that names the field and what to write instead (the API answers it as a 400).
//! Rules that need the host (limits, quotas, whether a runtime or an egress policy works
//! here, which volumes exist, what an allowlist entry means) are the server's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::ExecRequest;

/// The runtime a request names: `auto` (the default) lets the server choose.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum RuntimeChoice {
    #[default]
    Auto,
    Jail,
    Microvm,
    /// Named by the contract, not available in this version (the server answers 503).
    Gvisor,
}

impl TryFrom<String> for RuntimeChoice {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "auto" => Ok(Self::Auto),
            "jail" => Ok(Self::Jail),
            "microvm" => Ok(Self::Microvm),
            "gvisor" => Ok(Self::Gvisor),
            other => Err(format!(
                "unknown runtime {other:?}: use auto, jail, microvm or gvisor"
            )),
        }
    }
}

/// The runtime a machine runs in, once chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Runtime {
    Jail,
    Microvm,
}

impl Runtime {
    /// Its name in the API and in records (`jail`, `microvm`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Jail => "jail",
            Self::Microvm => "microvm",
        }
    }
}

impl std::fmt::Display for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A machine's egress policy (`network`): `{"egress": "none"}` (the default), `{"egress":
/// "all"}`, or `{"egress": "allow", "allow": [domains and IPv4 CIDRs]}`. The entries of an
/// allowlist are checked and normalized by the server.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Value", into = "Value")]
pub enum NetworkPolicy {
    #[default]
    None,
    All,
    Allow(Vec<Value>),
}

impl NetworkPolicy {
    /// Whether the machine gets a network at all (anything but `none`).
    pub fn has_egress(&self) -> bool {
        !matches!(self, Self::None)
    }

    /// The policy as the API shows it (and records keep it).
    pub fn to_value(&self) -> Value {
        match self {
            Self::None => json!({"egress": "none"}),
            Self::All => json!({"egress": "all"}),
            Self::Allow(list) => json!({"egress": "allow", "allow": list}),
        }
    }
}

impl From<NetworkPolicy> for Value {
    fn from(p: NetworkPolicy) -> Value {
        p.to_value()
    }
}

impl TryFrom<Value> for NetworkPolicy {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        let obj = v
            .as_object()
            .ok_or("`network` must be an object like {\"egress\": \"none\"}")?;
        if let Some(k) = obj.keys().find(|k| *k != "egress" && *k != "allow") {
            return Err(format!(
                "unknown field `{k}` in `network`: expected `egress` and `allow`"
            ));
        }
        match obj.get("egress").and_then(Value::as_str) {
            Some("none" | "all") if obj.contains_key("allow") => {
                Err("`allow` only goes with {\"egress\": \"allow\"}".into())
            }
            Some("none") => Ok(Self::None),
            Some("all") => Ok(Self::All),
            Some("allow") => match obj.get("allow").and_then(Value::as_array) {
                Some(list) => Ok(Self::Allow(list.clone())),
                None => Err("`network.allow` is required with {\"egress\": \"allow\"}: a list of domains (`pypi.org`, `*.github.com`) and IPv4 CIDRs (`10.0.0.0/8`)".into()),
            },
            Some(other) => Err(format!(
                "`network.egress` must be none, all or allow, got {other:?}"
            )),
            None => Err("`network.egress` is required: none, all or allow".into()),
        }
    }
}

/// The most volumes one sandbox mounts.
pub const MAX_VOLUME_MOUNTS: usize = 16;

/// A volume a sandbox mounts: `{"volume": id or name, "path": "/abs", "read_only": bool}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeMount {
    /// A volume's id or name.
    pub volume: String,
    /// Where it appears in the machine (default `/workspace`); checked by the server.
    pub path: String,
    pub read_only: bool,
}

impl VolumeMount {
    /// The mount at index `i` of a body's `volumes`; messages name `volumes[i]`.
    fn parse(i: usize, v: &Value) -> Result<Self, String> {
        let o = v.as_object().ok_or_else(|| {
            format!("`volumes[{i}]` must be an object like {{\"volume\": \"vol_…\", \"path\": \"/workspace\"}}")
        })?;
        if let Some(k) = o
            .keys()
            .find(|k| !["volume", "path", "read_only"].contains(&k.as_str()))
        {
            return Err(format!(
                "unknown field `{k}` in `volumes[{i}]`: expected volume, path, read_only"
            ));
        }
        let volume = o
            .get("volume")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("`volumes[{i}].volume` is required: a volume id or name"))?;
        let path = match o.get("path") {
            None => "/workspace",
            Some(p) => p
                .as_str()
                .ok_or_else(|| format!("`volumes[{i}].path` must be a string"))?,
        };
        let read_only = match o.get("read_only") {
            None => false,
            Some(b) => b
                .as_bool()
                .ok_or_else(|| format!("`volumes[{i}].read_only` must be true or false"))?,
        };
        Ok(Self {
            volume: volume.to_owned(),
            path: path.to_owned(),
            read_only,
        })
    }
}

/// A body's `volumes`: at most [`MAX_VOLUME_MOUNTS`], each a [`VolumeMount`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<Value>")]
pub struct VolumeMounts(pub Vec<VolumeMount>);

impl TryFrom<Vec<Value>> for VolumeMounts {
    type Error = String;
    fn try_from(list: Vec<Value>) -> Result<Self, String> {
        if list.len() > MAX_VOLUME_MOUNTS {
            return Err(format!(
                "`volumes` holds at most {MAX_VOLUME_MOUNTS} mounts"
            ));
        }
        let mounts = list
            .iter()
            .enumerate()
            .map(|(i, v)| VolumeMount::parse(i, v))
            .collect::<Result<_, _>>()?;
        Ok(Self(mounts))
    }
}

/// The body of `POST /v1/sandboxes`. Every field may be left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volumes: Option<VolumeMounts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Secrets by name: the machine's env gets a placeholder for each, and the egress
    /// proxy puts the value in requests to the secret's hosts only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

/// The body of `PATCH /v1/sandboxes/{id}`: what may change on a live sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatchSandbox {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// When a run's changes are applied to its volume (`commit`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", try_from = "String")]
pub enum CommitMode {
    /// Whatever the command's exit code (the default).
    #[default]
    Always,
    /// Only if it exited 0 and no other commit touched the same paths meanwhile.
    OnSuccess,
    /// Never: the changes are listed only.
    Never,
}

impl TryFrom<String> for CommitMode {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "always" => Ok(Self::Always),
            "on_success" => Ok(Self::OnSuccess),
            "never" => Ok(Self::Never),
            other => Err(format!(
                "`commit` must be always, on_success or never, got {other:?}"
            )),
        }
    }
}

impl CommitMode {
    /// Whether changes are applied after a command that exited with `exit_code`, given
    /// whether they conflict with a commit made since the run's view was taken.
    pub fn applies(self, exit_code: Option<i32>, conflicts: bool) -> bool {
        match self {
            Self::Always => true,
            Self::OnSuccess => exit_code == Some(0) && !conflicts,
            Self::Never => false,
        }
    }
}

/// The body of `POST /v1/volumes/{id}/run`: an exec body ([`ExecRequest`]'s fields, listed
/// again because serde's `flatten` drops `deny_unknown_fields`) plus the run's machine and
/// its commit. [`RunRequest::split`] gives the exec part as an [`ExecRequest`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRequest {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdin_b64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mount_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commit: Option<CommitMode>,
    /// Secrets by name, as a sandbox's create takes them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

/// What a run asks for besides its command.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunMachine {
    pub template: Option<String>,
    pub runtime: Option<RuntimeChoice>,
    pub cpus: Option<f64>,
    pub memory_mb: Option<u64>,
    pub network: Option<NetworkPolicy>,
    pub mount_path: Option<String>,
    pub commit: Option<CommitMode>,
    pub secrets: Vec<String>,
}

impl RunRequest {
    /// The command (as an exec body) and the rest.
    pub fn split(self) -> (ExecRequest, RunMachine) {
        let exec = ExecRequest {
            cmd: self.cmd,
            shell: self.shell,
            cwd: self.cwd,
            env: self.env,
            stdin: self.stdin,
            stdin_b64: self.stdin_b64,
            timeout_ms: self.timeout_ms,
            max_output_bytes: self.max_output_bytes,
            user: self.user,
        };
        let machine = RunMachine {
            template: self.template,
            runtime: self.runtime,
            cpus: self.cpus,
            memory_mb: self.memory_mb,
            network: self.network,
            mount_path: self.mount_path,
            commit: self.commit,
            secrets: self.secrets,
        };
        (exec, machine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create(v: Value) -> Result<CreateSandbox, String> {
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    #[test]
    fn network_policies_parse_with_messages_that_say_what_to_write() {
        let ok = |v: Value| create(json!({ "network": v })).unwrap().network.unwrap();
        assert_eq!(ok(json!({"egress": "none"})), NetworkPolicy::None);
        assert_eq!(ok(json!({"egress": "all"})), NetworkPolicy::All);
        assert_eq!(
            ok(json!({"egress": "allow", "allow": ["pypi.org"]})),
            NetworkPolicy::Allow(vec![json!("pypi.org")])
        );
        let bad = |v: Value| create(json!({ "network": v })).unwrap_err();
        assert!(bad(json!("none")).contains("`network` must be an object"));
        assert!(bad(json!({"egress": "none", "proxy": 1})).contains("unknown field `proxy`"));
        assert!(bad(json!({"egress": "all", "allow": []})).contains("only goes with"));
        assert!(bad(json!({"egress": "allow"})).contains("`network.allow` is required"));
        assert!(bad(json!({"egress": "sideways"})).contains("\"sideways\""));
        assert!(bad(json!({})).contains("`network.egress` is required"));
        assert_eq!(
            serde_json::to_value(NetworkPolicy::All).unwrap(),
            json!({"egress": "all"})
        );
    }

    #[test]
    fn volume_mounts_name_the_entry_at_fault() {
        let c = create(
            json!({"volumes": [{"volume": "v"}, {"volume": "w", "path": "/d", "read_only": true}]}),
        )
        .unwrap();
        let m = c.volumes.unwrap().0;
        assert_eq!(m[0].path, "/workspace");
        assert!(m[1].read_only && m[1].path == "/d");
        let bad = |v: Value| create(json!({ "volumes": [v] })).unwrap_err();
        assert!(
            bad(json!({"volume": "v", "mode": 1})).contains("unknown field `mode` in `volumes[0]`")
        );
        assert!(bad(json!({})).contains("`volumes[0].volume` is required"));
        assert!(bad(json!({"volume": "v", "read_only": "yes"})).contains("true or false"));
        assert!(bad(json!("v")).contains("`volumes[0]` must be an object"));
        let many: Vec<Value> = (0..17).map(|_| json!({"volume": "v"})).collect();
        assert!(create(json!({ "volumes": many }))
            .unwrap_err()
            .contains("at most 16"));
    }

    #[test]
    fn runtimes_and_commit_modes_refuse_unknown_names_by_listing_the_known() {
        let c = create(json!({"runtime": "microvm"})).unwrap();
        assert_eq!(c.runtime, Some(RuntimeChoice::Microvm));
        assert!(create(json!({"runtime": "qemu"}))
            .unwrap_err()
            .contains("use auto, jail, microvm or gvisor"));
        let r: Result<RunRequest, _> = serde_json::from_value(json!({"commit": "sometimes"}));
        assert!(r
            .unwrap_err()
            .to_string()
            .contains("always, on_success or never"));
        assert!(
            create(json!({"bogus": 1})).is_err(),
            "unknown fields are refused"
        );
        assert!(
            create(json!([])).is_err(),
            "a body is an object, not an array"
        );
        assert!(serde_json::from_value::<RunRequest>(json!([])).is_err());
        assert!(serde_json::from_value::<PatchSandbox>(json!([])).is_err());
        let r: Result<RunRequest, _> = serde_json::from_value(json!({"shell": "x", "bogus": 1}));
        assert!(r.is_err(), "unknown fields are refused in runs too");
    }

    #[test]
    fn a_run_splits_into_its_command_and_its_machine() {
        let r: RunRequest = serde_json::from_value(json!({
            "shell": "make", "env": {"A": "1"}, "timeout_ms": 5, "cpus": 2.0,
            "commit": "on_success", "runtime": "jail"
        }))
        .unwrap();
        let (exec, m) = r.split();
        assert_eq!(exec.shell.as_deref(), Some("make"));
        assert_eq!(exec.env["A"], "1");
        assert_eq!(exec.timeout_ms, Some(5));
        assert_eq!(m.cpus, Some(2.0));
        assert_eq!(m.commit, Some(CommitMode::OnSuccess));
        assert_eq!(m.runtime, Some(RuntimeChoice::Jail));
        assert!(CommitMode::OnSuccess.applies(Some(0), false));
        assert!(!CommitMode::OnSuccess.applies(Some(0), true));
        assert!(!CommitMode::OnSuccess.applies(Some(1), false));
        assert!(CommitMode::Always.applies(None, true));
        assert!(!CommitMode::Never.applies(Some(0), false));
    }
}
