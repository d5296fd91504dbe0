//! Secrets that never enter a machine: a tenant's API keys and tokens, stored sealed, put
//! into requests by the egress proxy on their way out.
//!
//! Owns: the `/v1/secrets` routes, sealing and opening values ([`Sealer`], ChaCha20-Poly1305
//! under the server's key, with the tenant and the name as associated data so that a sealed
//! value cannot be moved to another row), the placeholders a machine's environment gets
//! instead of values ([`placeholder`]), and arming a machine for them ([`arm`]: its CA in its
//! trust store, its secrets known to the egress proxy), what a snapshot keeps of them
//! (names and placeholders, [`save_for_snapshot`]), and the allowlists of the sandboxes that
//! hold a secret whose hosts change. It does not touch packets or TLS:
//! the egress room (`egress::intercept`) finds placeholders and swaps values in; it asks
//! this room for a value with [`Secrets::value_for`] at each new connection, so a rotation
//! takes effect for new connections.
//!
//! A value is never logged, never put in an error message, a call record, a snapshot or a
//! metric, and never written to disk in clear: the store keeps only the sealed bytes, and
//! a response never carries a value.
//!
//! The key: `LOCKER_SECRETS_KEY` (64 hex digits or base64 of 32 bytes) when set, else
//! `<data-dir>/secrets.key`, made at first start with mode 0600. Losing the key loses every
//! secret (they must be created again); a different key cannot open them.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{post, put};
use axum::Router;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use locker_store::{SecretRecord, Store};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::Json;
use crate::ids::{decode_hex, hex};
use crate::state::{now_s, AppState};

/// The environment variable that holds the key.
pub const KEY_ENV: &str = "LOCKER_SECRETS_KEY";
/// The key file in the data dir when [`KEY_ENV`] is not set.
pub const KEY_FILE: &str = "secrets.key";
/// The most bytes one value holds.
pub const MAX_VALUE: usize = 8 << 10;
/// The most hosts one secret names.
pub const MAX_HOSTS: usize = 16;
/// Every placeholder starts so: `locker-secret-<name>-<32 hex digits>`.
pub const PLACEHOLDER_PREFIX: &str = "locker-secret-";
/// The format byte that starts every sealed value.
const SEAL_V1: u8 = 1;
const NONCE_LEN: usize = 12;

/// Why the key could not be had.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("{KEY_ENV} must be 64 hex digits or the base64 of 32 bytes (make one with `openssl rand -hex 32`)")]
    BadEnv,
    #[error("the secrets key file {0} must hold 64 hex digits; it holds something else (restore it from a backup, or move it away to start with no secrets)")]
    BadFile(std::path::PathBuf),
    #[error("reading or making the secrets key file {0}: {1}")]
    Io(std::path::PathBuf, std::io::Error),
    #[error("the kernel's random source failed: {0}")]
    Random(String),
}

/// Seals and opens values under the server's key.
pub struct Sealer {
    aead: ChaCha20Poly1305,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer(..)")
    }
}

impl Sealer {
    /// The sealer of the key in [`KEY_ENV`], or of the key file in `data_dir` (made now,
    /// mode 0600, when missing).
    pub fn load(data_dir: &Path) -> Result<Sealer, KeyError> {
        if let Ok(v) = std::env::var(KEY_ENV) {
            let key = decode_key(v.trim()).ok_or(KeyError::BadEnv)?;
            return Ok(Sealer::new(&key));
        }
        let path = data_dir.join(KEY_FILE);
        match std::fs::read_to_string(&path) {
            Ok(s) => {
                let key = decode_hex(s.trim())
                    .and_then(|k| <[u8; 32]>::try_from(k).ok())
                    .ok_or_else(|| KeyError::BadFile(path.clone()))?;
                Ok(Sealer::new(&key))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut key = [0u8; 32];
                locker_store::fill_random(&mut key).map_err(|e| KeyError::Random(e.to_string()))?;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(|e| KeyError::Io(path.clone(), e))?;
                f.write_all(format!("{}\n", hex(&key)).as_bytes())
                    .and_then(|()| f.sync_all())
                    .map_err(|e| KeyError::Io(path.clone(), e))?;
                tracing::info!(path = %path.display(), "made the secrets key (back it up: losing it loses every secret)");
                Ok(Sealer::new(&key))
            }
            Err(e) => Err(KeyError::Io(path, e)),
        }
    }

    pub fn new(key: &[u8; 32]) -> Sealer {
        Sealer {
            aead: ChaCha20Poly1305::new(Key::from_slice(key)),
        }
    }

    /// `value` sealed for secret `name` of `tenant`.
    pub fn seal(&self, tenant: &str, name: &str, value: &[u8]) -> Result<Vec<u8>, String> {
        let mut nonce = [0u8; NONCE_LEN];
        locker_store::fill_random(&mut nonce).map_err(|e| e.to_string())?;
        let aad = aad(tenant, name);
        let ct = self
            .aead
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: value,
                    aad: &aad,
                },
            )
            .map_err(|_| "sealing a secret failed".to_owned())?;
        let mut out = Vec::with_capacity(1 + NONCE_LEN + ct.len());
        out.push(SEAL_V1);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        Ok(out)
    }

    /// The value sealed for secret `name` of `tenant`; `None` if it was sealed under
    /// another key, for another row, or was changed.
    pub fn open(&self, tenant: &str, name: &str, sealed: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < 1 + NONCE_LEN || sealed[0] != SEAL_V1 {
            return None;
        }
        let aad = aad(tenant, name);
        self.aead
            .decrypt(
                Nonce::from_slice(&sealed[1..1 + NONCE_LEN]),
                Payload {
                    msg: &sealed[1 + NONCE_LEN..],
                    aad: &aad,
                },
            )
            .ok()
    }
}

fn aad(tenant: &str, name: &str) -> Vec<u8> {
    let mut a = b"locker-secret-v1\0".to_vec();
    a.extend_from_slice(tenant.as_bytes());
    a.push(0);
    a.extend_from_slice(name.as_bytes());
    a
}

/// 64 hex digits, or standard base64 (padded or not) of 32 bytes.
fn decode_key(s: &str) -> Option<[u8; 32]> {
    if s.len() == 64 {
        if let Some(k) = decode_hex(s) {
            return k.try_into().ok();
        }
    }
    locker_types::base64::decode(s).ok()?.try_into().ok()
}

pub mod remote;

/// The secrets service: the sealer and the store; on a joined node, the copies of what
/// control holds ([`remote`]) instead.
pub struct Secrets {
    sealer: Sealer,
    store: Arc<dyn Store>,
    remote: std::sync::OnceLock<remote::Copies>,
}

/// What a machine's create needs of a secret: where its placeholder goes and its hosts.
pub struct Meta {
    pub env: String,
    pub hosts: Vec<String>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secrets(..)")
    }
}

/// A secret's value with the hosts it may go to, as the egress proxy asks for it.
pub struct Opened {
    pub name: String,
    pub hosts: Vec<String>,
    pub value: Vec<u8>,
}

impl Secrets {
    pub fn new(sealer: Sealer, store: Arc<dyn Store>) -> Arc<Secrets> {
        Arc::new(Secrets {
            sealer,
            store,
            remote: std::sync::OnceLock::new(),
        })
    }

    /// Makes this a joined node's service: secrets are control's, fetched with `fetch`.
    pub fn set_remote(&self, fetch: remote::Fetch) {
        if self.remote.set(remote::Copies::new(fetch)).is_err() {
            tracing::warn!("the secrets' control plane was set twice: the first kept");
        }
    }

    /// A stored secret's value under this server's key (control answering a node).
    pub fn open(&self, rec: &SecretRecord) -> Option<Vec<u8>> {
        self.sealer.open(&rec.tenant, &rec.name, &rec.sealed)
    }

    /// Makes sure the secrets `names` of `tenant` can be read here without waiting: on a
    /// joined node, fetches the copies it lacks (503 when control cannot be reached); a
    /// server with the store reads it at each use.
    pub async fn ensure(&self, tenant: &str, names: &[String]) -> Result<(), ApiError> {
        let Some(r) = self.remote.get() else {
            return Ok(());
        };
        r.ensure(tenant, names).await.map_err(|e| {
            ApiError::unavailable(format!(
                "this node gets secrets from the fleet's control plane, which did not answer \
                 ({e}): retry"
            ))
        })
    }

    /// Secret `name` of `tenant` as a create needs it (on a joined node: its copy, which
    /// [`Secrets::ensure`] fetched).
    pub fn meta(&self, tenant: &str, name: &str) -> Result<Option<Meta>, ApiError> {
        if let Some(r) = self.remote.get() {
            return Ok(r.get(tenant, name).map(|c| Meta {
                env: c.env,
                hosts: c.hosts,
            }));
        }
        Ok(self.store.get_secret(tenant, name)?.map(|r| Meta {
            env: r.env,
            hosts: r.hosts,
        }))
    }

    /// A joined node's copies fetched again: rotations and deletions reach its machines,
    /// and a secret's new hosts join the allowlists of the sandboxes holding it. Nothing
    /// on a server with the store.
    pub async fn refresh(app: &AppState) {
        let Some(r) = app.secrets.remote.get() else {
            return;
        };
        match r.refresh().await {
            Ok(grown) => {
                for (k, hosts) in grown {
                    widen_allowlists(app, &k.tenant, &k.name, &hosts).await;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "the secrets' copies could not be fetched again: kept as they are")
            }
        }
    }

    /// The current value of secret `name` of `tenant` if `host` is one of its hosts now
    /// (it may have been rotated or deleted since the machine got its placeholder).
    pub fn value_for(&self, tenant: &str, name: &str, host: &str) -> Option<Opened> {
        if let Some(r) = self.remote.get() {
            let c = r.get(tenant, name)?;
            return c.hosts.iter().any(|h| h == host).then(|| Opened {
                name: name.to_owned(),
                hosts: c.hosts,
                value: c.value,
            });
        }
        let rec = match self.store.get_secret(tenant, name) {
            Ok(Some(r)) => r,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(secret = name, error = %e, "reading a secret failed");
                return None;
            }
        };
        if !rec.hosts.iter().any(|h| h == host) {
            return None;
        }
        let Some(value) = self.sealer.open(tenant, name, &rec.sealed) else {
            tracing::warn!(
                secret = name,
                "a secret does not open under this server's key (was the key changed?)"
            );
            return None;
        };
        Some(Opened {
            name: rec.name,
            hosts: rec.hosts,
            value,
        })
    }

    /// Whether secret `name` of `tenant` names `host` now.
    pub fn has_host(&self, tenant: &str, name: &str, host: &str) -> bool {
        if let Some(r) = self.remote.get() {
            return r
                .get(tenant, name)
                .is_some_and(|c| c.hosts.iter().any(|h| h == host));
        }
        matches!(self.store.get_secret(tenant, name), Ok(Some(r)) if r.hosts.iter().any(|h| h == host))
    }
}

/// A new placeholder for secret `name`: `locker-secret-<name>-<32 hex digits>`, random per
/// machine and secret, shaped like a key so that clients that check a key's shape loosely
/// send it.
pub fn placeholder(name: &str) -> String {
    let mut r = [0u8; 16];
    if let Err(e) = locker_store::fill_random(&mut r) {
        panic!("{e}: Locker needs the kernel's random source to make placeholders");
    }
    format!("{PLACEHOLDER_PREFIX}{name}-{}", hex(&r))
}

/// The secret name of a placeholder, if `s` is one.
pub fn placeholder_name(s: &str) -> Option<&str> {
    let rest = s.strip_prefix(PLACEHOLDER_PREFIX)?;
    let (name, random) = rest.rsplit_once('-')?;
    (random.len() == 32
        && random.bytes().all(|b| b.is_ascii_hexdigit())
        && locker_store::validate_secret_name(name).is_ok())
    .then_some(name)
}

/// Where a machine finds the egress CA: the system store (appended to), and the CA alone.
pub const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
pub const CA_FILE: &str = "/usr/local/share/ca-certificates/locker-egress-ca.crt";

/// A create's `secrets` resolved: each secret's env variable gets a new placeholder, the
/// trust variables point at the machine's store, and the secrets' hosts join the policy.
/// `network` is the checked policy; `explicit` says whether the caller gave one (with
/// none given, secrets make it `allow` with their hosts). Errors are 400s and 404s that
/// name the secret.
pub fn resolve(
    app: &AppState,
    tenant: &str,
    names: &[String],
    env: &mut BTreeMap<String, String>,
    network: &mut Value,
    explicit: bool,
) -> Result<(), ApiError> {
    resolve_keeping(app, tenant, names, &[], env, network, explicit)
}

/// [`resolve`], with the placeholders of `keep` (`(name, placeholder)`, a snapshot's: see
/// [`for_snapshot`]) given again to their secrets instead of new ones, so that what the
/// snapshot's disk and memory hold keeps working.
pub fn resolve_keeping(
    app: &AppState,
    tenant: &str,
    names: &[String],
    keep: &[(String, String)],
    env: &mut BTreeMap<String, String>,
    network: &mut Value,
    explicit: bool,
) -> Result<(), ApiError> {
    if let Some((k, _)) = env.iter().find(|(_, v)| placeholder_name(v).is_some()) {
        return Err(ApiError::bad_request(format!(
            "`env` {k}: a value shaped like a secret's placeholder (`{PLACEHOLDER_PREFIX}…`) is Locker's to give: name the secret in `secrets` instead"
        )));
    }
    if names.is_empty() {
        return Ok(());
    }
    if names.len() > 32 {
        return Err(ApiError::bad_request("`secrets` names at most 32 secrets"));
    }
    let egress = network
        .get("egress")
        .and_then(Value::as_str)
        .unwrap_or("none");
    match egress {
        "allow" => {}
        "none" if !explicit => *network = json!({"egress": "allow", "allow": []}),
        other => {
            return Err(ApiError::bad_request(format!(
                "`secrets` need egress `allow` (the secrets' hosts join its list), not `{other}`: under `none` nothing leaves the machine, and under `all` connections do not pass the proxy that puts values in"
            )))
        }
    }
    let mut hosts: Vec<String> = Vec::new();
    for (i, name) in names.iter().enumerate() {
        if names[..i].contains(name) {
            return Err(ApiError::bad_request(format!(
                "`secrets` names {name:?} twice"
            )));
        }
        let rec = app.secrets.meta(tenant, name)?.ok_or_else(|| {
            ApiError::not_found(format!(
                "secret {name:?} does not exist: create it with POST /v1/secrets (`locker secret create`)"
            ))
        })?;
        if let Some(v) = env.get(&rec.env) {
            return Err(ApiError::bad_request(match placeholder_name(v) {
                Some(other) => format!(
                    "secrets {other:?} and {name:?} both use env variable {}: give one another with PUT /v1/secrets/{name}",
                    rec.env
                ),
                None => format!(
                    "`env` sets {} and secret {name:?} puts its placeholder there: leave it out of `env`",
                    rec.env
                ),
            }));
        }
        let kept = keep
            .iter()
            .find(|(n, p)| n == name && placeholder_name(p) == Some(name.as_str()));
        env.insert(
            rec.env.clone(),
            kept.map_or_else(|| placeholder(name), |(_, p)| p.clone()),
        );
        for h in rec.hosts {
            if !hosts.contains(&h) {
                hosts.push(h);
            }
        }
    }
    env.insert("SSL_CERT_FILE".into(), SYSTEM_BUNDLE.into());
    env.insert("REQUESTS_CA_BUNDLE".into(), SYSTEM_BUNDLE.into());
    env.insert("NODE_EXTRA_CA_CERTS".into(), CA_FILE.into());
    let mut list: Vec<Value> = network
        .get("allow")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for h in hosts {
        if !list.iter().any(|v| v.as_str() == Some(h.as_str())) {
            list.push(Value::String(h));
        }
    }
    let (_, norm) = crate::egress::Allowlist::parse(&list).map_err(ApiError::bad_request)?;
    *network = json!({"egress": "allow", "allow": norm});
    Ok(())
}

/// The secrets whose placeholders are in a machine's environment: `(name, placeholder)`.
pub fn bound(env: &BTreeMap<String, String>) -> Vec<(String, String)> {
    env.values()
        .filter_map(|v| placeholder_name(v).map(|n| (n.to_owned(), v.clone())))
        .collect()
}

/// The file in a snapshot's directory that names the secrets of the sandbox it was taken
/// from, with their placeholders (never a value: values live only in the store, sealed).
pub const SNAPSHOT_FILE: &str = "secrets.json";

/// Notes in snapshot directory `dir` the secrets whose placeholders `env` holds (nothing
/// without secrets).
pub fn save_for_snapshot(dir: &Path, env: &BTreeMap<String, String>) -> Result<(), String> {
    let secrets = bound(env);
    if secrets.is_empty() {
        return Ok(());
    }
    let list: Vec<Value> = secrets
        .iter()
        .map(|(n, p)| json!({"name": n, "placeholder": p}))
        .collect();
    let path = dir.join(SNAPSHOT_FILE);
    std::fs::write(&path, json!({ "secrets": list }).to_string())
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

/// The secrets a snapshot in `dir` was taken with: `(name, placeholder)`, none if its file is
/// missing (a snapshot without secrets, or one taken before snapshots kept them).
pub fn for_snapshot(dir: &Path) -> Result<Vec<(String, String)>, ApiError> {
    let path = dir.join(SNAPSHOT_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(ApiError::internal(format!(
                "reading {}: {e}",
                path.display()
            )))
        }
    };
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::internal(format!("{}: {e}", path.display())))?;
    Ok(v["secrets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| {
            let (n, p) = (s["name"].as_str()?, s["placeholder"].as_str()?);
            (placeholder_name(p) == Some(n)).then(|| (n.to_owned(), p.to_owned()))
        })
        .collect())
}

/// After secret `name` of `tenant` was given `hosts`: every running (or paused) sandbox that
/// holds its placeholder gets those hosts in its allowlist, stored in its record, so that
/// its egress follows the secret. Hosts only join: one the secret no longer names stays in
/// the list (the caller may have allowed it for itself) but gets no value any more, as
/// interception asks the secret's hosts at each connection. Failures are logged: the
/// secret's change stands.
async fn widen_allowlists(app: &AppState, tenant: &str, name: &str, hosts: &[String]) {
    // One policy change at a time, as `sandboxes::change_network` does.
    let _guard = app.create_lock.lock().await;
    let holders: Vec<Arc<crate::state::Live>> = app
        .live
        .read()
        .await
        .values()
        .filter(|l| l.tenant == tenant && bound(&l.env).iter().any(|(n, _)| n == name))
        .cloned()
        .collect();
    for l in holders {
        let mut rec = match app.store.get_sandbox_any(&l.id) {
            Ok(Some(r)) => r,
            _ => continue,
        };
        if rec.network.get("egress").and_then(Value::as_str) != Some("allow") {
            continue;
        }
        let mut list: Vec<Value> = rec
            .network
            .get("allow")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let before = list.len();
        for h in hosts {
            if !list.iter().any(|v| v.as_str() == Some(h.as_str())) {
                list.push(Value::String(h.clone()));
            }
        }
        if list.len() == before {
            continue;
        }
        let network = match crate::egress::Allowlist::parse(&list) {
            Ok((_, norm)) => json!({"egress": "allow", "allow": norm}),
            Err(e) => {
                tracing::warn!(sandbox = %l.id, secret = name, error = %e, "a secret's new hosts do not fit the sandbox's allowlist");
                continue;
            }
        };
        match app
            .egress
            .apply(&app.node, &l.machine, &l.id, tenant, &network)
            .await
        {
            Ok(()) => {
                rec.network = network;
                if let Err(e) = app.store.update_sandbox(&rec) {
                    tracing::warn!(sandbox = %l.id, error = %e, "storing a sandbox's widened allowlist failed");
                }
            }
            Err(e) => {
                tracing::warn!(sandbox = %l.id, secret = name, error = %e, "giving a sandbox its secret's new hosts failed")
            }
        }
    }
}

/// Arms machine `m` (known to egress as `key`) of `tenant` for the secrets whose
/// placeholders its environment holds: a new CA, trusted inside the machine, and the
/// placeholders known to the proxy. Nothing to do without secrets.
pub async fn arm(
    app: &AppState,
    m: &locker_runtime::node::Machine,
    key: &str,
    tenant: &str,
    env: &BTreeMap<String, String>,
) -> Result<(), String> {
    let secrets = bound(env);
    if secrets.is_empty() {
        return Ok(());
    }
    let ca = crate::egress::ca::MachineCa::new(key)?;
    install_ca(m, &ca.pem).await?;
    app.egress.arm(key, tenant, secrets, Arc::new(ca));
    Ok(())
}

const CA_BEGIN: &str = "# locker-egress-ca begin\n";
const CA_END: &str = "# locker-egress-ca end\n";

/// Puts the CA in the machine's system store (replacing an earlier Locker block) and in a
/// file of its own.
async fn install_ca(m: &locker_runtime::node::Machine, pem: &str) -> Result<(), String> {
    let mut bundle = String::new();
    if let Ok((_, mut r)) = m.agent.read_file(SYSTEM_BUNDLE).await {
        let mut bytes = Vec::new();
        while let Ok(Some(c)) = r.next_chunk().await {
            bytes.extend_from_slice(&c);
            if bytes.len() > 16 << 20 {
                break;
            }
        }
        bundle = String::from_utf8_lossy(&bytes).into_owned();
    }
    if let (Some(a), Some(b)) = (bundle.find(CA_BEGIN), bundle.find(CA_END)) {
        if a < b {
            bundle.replace_range(a..b + CA_END.len(), "");
        }
    }
    if !bundle.is_empty() && !bundle.ends_with('\n') {
        bundle.push('\n');
    }
    bundle.push_str(CA_BEGIN);
    bundle.push_str(pem);
    bundle.push_str(CA_END);
    for dir in ["/etc/ssl/certs", "/usr/local/share/ca-certificates"] {
        let _ = m.agent.mkdir(dir).await;
    }
    m.agent
        .write_file(SYSTEM_BUNDLE, Some(0o644), bundle.as_bytes())
        .await
        .map_err(|e| format!("writing the machine's trust store {SYSTEM_BUNDLE}: {e}"))?;
    m.agent
        .write_file(CA_FILE, Some(0o644), pem.as_bytes())
        .await
        .map_err(|e| format!("writing the machine's egress CA {CA_FILE}: {e}"))?;
    Ok(())
}

// ---- routes ----

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/secrets", post(create).get(list))
        .route(
            "/v1/secrets/{name}",
            put(rotate).delete(remove).get(get_one),
        )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    name: String,
    value: String,
    hosts: Vec<String>,
    env: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RotateBody {
    value: Option<String>,
    hosts: Option<Vec<String>>,
    env: Option<String>,
}

/// A secret as the API shows it: never its value.
fn view(r: &SecretRecord) -> Value {
    json!({
        "name": r.name,
        "hosts": r.hosts,
        "env": r.env,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
    })
}

fn check_value(v: &str) -> Result<(), ApiError> {
    if v.is_empty() || v.len() > MAX_VALUE {
        return Err(ApiError::bad_request(format!(
            "`value` must hold 1 to {MAX_VALUE} bytes"
        )));
    }
    // It goes into HTTP headers: visible ASCII and spaces only.
    if !v.bytes().all(|b| (0x20..0x7f).contains(&b) || b == b'\t') {
        return Err(ApiError::bad_request(
            "`value` must be printable ASCII (it is sent in HTTP headers): no line breaks or control characters",
        ));
    }
    Ok(())
}

fn check_hosts(hosts: &[String]) -> Result<Vec<String>, ApiError> {
    if hosts.is_empty() || hosts.len() > MAX_HOSTS {
        return Err(ApiError::bad_request(format!(
            "`hosts` must name 1 to {MAX_HOSTS} hosts (like api.openai.com)"
        )));
    }
    let mut out: Vec<String> = Vec::new();
    for (i, h) in hosts.iter().enumerate() {
        let n = crate::egress::normalize_name(h);
        if n.contains('*') || n.contains('/') || n.parse::<std::net::IpAddr>().is_ok() {
            return Err(ApiError::bad_request(format!(
                "`hosts[{i}]` {h:?}: a secret's host is one exact name like api.openai.com (no wildcards or addresses)"
            )));
        }
        crate::egress::Allowlist::parse(&[Value::String(n.clone())])
            .map_err(|e| ApiError::bad_request(format!("`hosts[{i}]`: {e}")))?;
        if !out.contains(&n) {
            out.push(n);
        }
    }
    Ok(out)
}

fn check_env_name(e: &str) -> Result<(), ApiError> {
    let ok = !e.is_empty()
        && e.len() <= 128
        && !e.as_bytes()[0].is_ascii_digit()
        && e.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !ok {
        return Err(ApiError::bad_request(format!(
            "`env` {e:?}: an environment variable's name like OPENAI_API_KEY (letters, digits, `_`, not starting with a digit)"
        )));
    }
    if [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS",
        "PATH",
        "HOME",
    ]
    .contains(&e)
    {
        return Err(ApiError::bad_request(format!(
            "`env` {e}: Locker sets that variable itself; pick another name"
        )));
    }
    Ok(())
}

async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Json(b): Json<CreateBody>,
) -> Result<impl IntoResponse, ApiError> {
    locker_store::validate_secret_name(&b.name)?;
    check_value(&b.value)?;
    let hosts = check_hosts(&b.hosts)?;
    check_env_name(&b.env)?;
    let sealed = app
        .secrets
        .sealer
        .seal(&caller.tenant, &b.name, b.value.as_bytes())
        .map_err(ApiError::internal)?;
    let now = locker_types::rfc3339(now_s());
    let rec = SecretRecord {
        tenant: caller.tenant.clone(),
        name: b.name,
        hosts,
        env: b.env,
        sealed,
        created_at: now.clone(),
        updated_at: now,
    };
    app.store.insert_secret(&rec)?;
    Ok((StatusCode::CREATED, axum::Json(view(&rec))))
}

async fn list(State(app): State<AppState>, caller: Caller) -> Result<impl IntoResponse, ApiError> {
    let recs = app.store.list_secrets(&caller.tenant)?;
    Ok(axum::Json(
        json!({ "secrets": recs.iter().map(view).collect::<Vec<_>>() }),
    ))
}

fn lookup(app: &AppState, caller: &Caller, name: &str) -> Result<SecretRecord, ApiError> {
    app.store
        .get_secret(&caller.tenant, name)?
        .ok_or_else(|| ApiError::not_found(format!("secret {name:?} does not exist")))
}

async fn get_one(
    State(app): State<AppState>,
    caller: Caller,
    UrlPath(name): UrlPath<String>,
) -> Result<impl IntoResponse, ApiError> {
    Ok(axum::Json(view(&lookup(&app, &caller, &name)?)))
}

async fn rotate(
    State(app): State<AppState>,
    caller: Caller,
    UrlPath(name): UrlPath<String>,
    Json(b): Json<RotateBody>,
) -> Result<impl IntoResponse, ApiError> {
    if b.value.is_none() && b.hosts.is_none() && b.env.is_none() {
        return Err(ApiError::bad_request(
            "give `value`, `hosts` or `env` (or several) to change",
        ));
    }
    let mut rec = lookup(&app, &caller, &name)?;
    if let Some(v) = &b.value {
        check_value(v)?;
        rec.sealed = app
            .secrets
            .sealer
            .seal(&caller.tenant, &name, v.as_bytes())
            .map_err(ApiError::internal)?;
    }
    if let Some(h) = &b.hosts {
        rec.hosts = check_hosts(h)?;
    }
    if let Some(e) = b.env {
        check_env_name(&e)?;
        rec.env = e;
    }
    rec.updated_at = locker_types::rfc3339(now_s());
    if !app.store.update_secret(&rec)? {
        return Err(ApiError::not_found(format!(
            "secret {name:?} does not exist"
        )));
    }
    if b.hosts.is_some() {
        widen_allowlists(&app, &caller.tenant, &name, &rec.hosts).await;
    }
    Ok(axum::Json(view(&rec)))
}

async fn remove(
    State(app): State<AppState>,
    caller: Caller,
    UrlPath(name): UrlPath<String>,
) -> Result<impl IntoResponse, ApiError> {
    if !app.store.delete_secret(&caller.tenant, &name)? {
        return Err(ApiError::not_found(format!(
            "secret {name:?} does not exist"
        )));
    }
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_values_open_only_for_their_row_and_key() {
        let s = Sealer::new(&[7u8; 32]);
        let sealed = s.seal("t1", "openai", b"sk-live-123").unwrap();
        assert!(!sealed.windows(11).any(|w| w == b"sk-live-123"));
        assert_eq!(s.open("t1", "openai", &sealed).unwrap(), b"sk-live-123");
        assert!(s.open("t2", "openai", &sealed).is_none(), "another tenant");
        assert!(s.open("t1", "github", &sealed).is_none(), "another name");
        assert!(Sealer::new(&[8u8; 32])
            .open("t1", "openai", &sealed)
            .is_none());
        let mut bad = sealed.clone();
        let l = bad.len();
        bad[l - 1] ^= 1;
        assert!(s.open("t1", "openai", &bad).is_none(), "tampered");
        assert_ne!(
            sealed,
            s.seal("t1", "openai", b"sk-live-123").unwrap(),
            "fresh nonce"
        );
    }

    #[test]
    fn keys_decode_from_hex_and_base64() {
        let hex_key = "00".repeat(31) + "ff";
        assert_eq!(decode_key(&hex_key).unwrap()[31], 0xff);
        // base64 of 32 bytes 0..32
        let b64 = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
        let k = decode_key(b64).unwrap();
        assert_eq!(k[0], 0);
        assert_eq!(k[31], 31);
        assert!(decode_key("short").is_none());
        assert!(decode_key(&"zz".repeat(32)).is_none());
    }

    #[test]
    fn placeholders_name_their_secret() {
        let p = placeholder("open-ai_2");
        assert_eq!(placeholder_name(&p), Some("open-ai_2"));
        assert_ne!(p, placeholder("open-ai_2"));
        assert_eq!(placeholder_name("locker-secret-x-123"), None);
        assert_eq!(placeholder_name("sk-123"), None);
    }

    #[test]
    fn snapshots_keep_names_and_placeholders_only() {
        let dir = std::env::temp_dir().join(format!("locker-secsnap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = placeholder("openai");
        let mut env = BTreeMap::new();
        env.insert("OPENAI_API_KEY".to_owned(), p.clone());
        env.insert("PLAIN".to_owned(), "x".to_owned());
        save_for_snapshot(&dir, &env).unwrap();
        assert_eq!(
            for_snapshot(&dir).unwrap(),
            vec![("openai".to_owned(), p.clone())]
        );
        // An entry whose placeholder is not its name's is dropped.
        std::fs::write(
            dir.join(SNAPSHOT_FILE),
            json!({"secrets": [{"name": "github", "placeholder": p}]}).to_string(),
        )
        .unwrap();
        assert!(for_snapshot(&dir).unwrap().is_empty());
        // No secrets, no file; a snapshot without the file has none.
        std::fs::remove_file(dir.join(SNAPSHOT_FILE)).unwrap();
        env.remove("OPENAI_API_KEY");
        save_for_snapshot(&dir, &env).unwrap();
        assert!(!dir.join(SNAPSHOT_FILE).exists());
        assert!(for_snapshot(&dir).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_key_file_is_made_once_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("locker-seckey-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let _ = std::fs::remove_file(dir.join(KEY_FILE));
        if std::env::var_os(KEY_ENV).is_some() {
            return;
        }
        let a = Sealer::load(&dir).unwrap();
        let mode = std::fs::metadata(dir.join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let sealed = a.seal("t", "n", b"v").unwrap();
        let b = Sealer::load(&dir).unwrap();
        assert_eq!(b.open("t", "n", &sealed).unwrap(), b"v");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
