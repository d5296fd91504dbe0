//! A joined node's secrets (`locker node`): the fleet's control plane holds them (sealed in
//! the fleet's store, under a key no node has); a node keeps in memory a copy of each
//! secret its machines use, fetched from control over the node's mutual TLS
//! (`fleet::wire::SECRETS`) when a machine first needs it, and fetched again every beat
//! while it is in use, so that a rotation reaches the node within about a second and a
//! deleted secret stops being put in. Copies are never written to disk, and one unused for
//! [`KEEP`] is dropped (fetched again at its next use).
//!
//! Owns the copies and their refresh; not the fetch itself (the member's connection to
//! control, given as a [`Fetch`]), and not what the copies are used for (the secrets room's
//! lookups, the egress room's proxy).

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::fleet::wire::{SecretCopy, SecretKey};

/// How long a copy no machine used is kept.
pub const KEEP: Duration = Duration::from_secs(600);

/// Asks control for the secrets named: those the node may have, as they are now.
pub type Fetch = Arc<
    dyn Fn(Vec<SecretKey>) -> Pin<Box<dyn Future<Output = Result<Vec<SecretCopy>, String>> + Send>>
        + Send
        + Sync,
>;

/// A secret as this node's machines use it.
#[derive(Clone)]
pub struct Copy {
    pub env: String,
    pub hosts: Vec<String>,
    pub value: Vec<u8>,
}

struct Kept {
    /// `None`: control answered without it (deleted, or not this node's to have).
    copy: Option<Copy>,
    used: Instant,
}

/// The copies of one node.
pub struct Copies {
    fetch: Fetch,
    kept: Mutex<HashMap<SecretKey, Kept>>,
}

fn key(tenant: &str, name: &str) -> SecretKey {
    SecretKey {
        tenant: tenant.to_owned(),
        name: name.to_owned(),
    }
}

impl Copies {
    pub fn new(fetch: Fetch) -> Copies {
        Copies {
            fetch,
            kept: Mutex::default(),
        }
    }

    /// The copy of secret `name` of `tenant`, if this node holds one (marked used).
    pub fn get(&self, tenant: &str, name: &str) -> Option<Copy> {
        let mut kept = self.kept.lock().expect("secret copies");
        let k = kept.get_mut(&key(tenant, name))?;
        k.used = Instant::now();
        k.copy.clone()
    }

    /// Fetches the secrets of `tenant` named in `names` that this node holds no copy of.
    pub async fn ensure(&self, tenant: &str, names: &[String]) -> Result<(), String> {
        let missing: Vec<SecretKey> = {
            let kept = self.kept.lock().expect("secret copies");
            names
                .iter()
                .map(|n| key(tenant, n))
                .filter(|k| kept.get(k).is_none_or(|k| k.copy.is_none()))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let got = (self.fetch)(missing.clone()).await?;
        self.take(missing, got);
        Ok(())
    }

    /// Fetches every copy in use again (rotations, new hosts, deletions), and drops those
    /// unused for [`KEEP`]. The secrets whose hosts grew, with their new hosts, for the
    /// caller to widen its machines' allowlists.
    pub async fn refresh(&self) -> Result<Vec<(SecretKey, Vec<String>)>, String> {
        let asked: Vec<SecretKey> = {
            let mut kept = self.kept.lock().expect("secret copies");
            kept.retain(|_, k| k.used.elapsed() < KEEP);
            kept.keys().cloned().collect()
        };
        let mut grown = Vec::new();
        for chunk in asked.chunks(crate::fleet::wire::SECRETS_MAX) {
            let got = (self.fetch)(chunk.to_vec()).await?;
            {
                let kept = self.kept.lock().expect("secret copies");
                for c in &got {
                    let before = kept
                        .get(&key(&c.tenant, &c.name))
                        .and_then(|k| k.copy.as_ref());
                    if let Some(b) = before {
                        if c.hosts.iter().any(|h| !b.hosts.contains(h)) {
                            grown.push((key(&c.tenant, &c.name), c.hosts.clone()));
                        }
                    }
                }
            }
            self.take(chunk.to_vec(), got);
        }
        Ok(grown)
    }

    /// Keeps what control answered for `asked`: each one answered as it is, each one left
    /// out as gone.
    fn take(&self, asked: Vec<SecretKey>, got: Vec<SecretCopy>) {
        let mut kept = self.kept.lock().expect("secret copies");
        let now = Instant::now();
        for k in asked {
            let used = kept.get(&k).map_or(now, |k| k.used);
            kept.insert(k, Kept { copy: None, used });
        }
        for c in got {
            let Ok(value) = locker_types::base64::decode(&c.value_b64) else {
                tracing::warn!(secret = %c.name, "control sent a secret whose value is not base64: left out");
                continue;
            };
            let k = key(&c.tenant, &c.name);
            let used = kept.get(&k).map_or(now, |k| k.used);
            kept.insert(
                k,
                Kept {
                    copy: Some(Copy {
                        env: c.env,
                        hosts: c.hosts,
                        value,
                    }),
                    used,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(tenant: &str, name: &str, hosts: &[&str], value: &[u8]) -> SecretCopy {
        SecretCopy {
            tenant: tenant.into(),
            name: name.into(),
            env: "TOKEN".into(),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            value_b64: locker_types::base64::encode(value),
        }
    }

    #[tokio::test]
    async fn copies_follow_control_and_fetch_only_what_is_missing() {
        // What "control" holds, and how many times it was asked.
        let held: Arc<Mutex<Vec<SecretCopy>>> = Arc::new(Mutex::new(vec![copy(
            "t",
            "gh",
            &["api.github.com"],
            b"v1",
        )]));
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (h, n) = (held.clone(), calls.clone());
        let c = Copies::new(Arc::new(move |wanted: Vec<SecretKey>| {
            n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let all = h.lock().unwrap().clone();
            Box::pin(async move {
                Ok(all
                    .into_iter()
                    .filter(|c| wanted.contains(&key(&c.tenant, &c.name)))
                    .collect())
            })
        }));
        assert!(c.get("t", "gh").is_none());
        c.ensure("t", &["gh".into()]).await.unwrap();
        assert_eq!(c.get("t", "gh").unwrap().value, b"v1");
        c.ensure("t", &["gh".into()]).await.unwrap();
        assert_eq!(
            calls.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "held: not asked again"
        );
        // Another tenant's secret of the same name is another secret.
        c.ensure("u", &["gh".into()]).await.unwrap();
        assert!(c.get("u", "gh").is_none());
        // A rotation with a new host reaches the copy at the next refresh, and says so.
        *held.lock().unwrap() = vec![copy("t", "gh", &["api.github.com", "github.com"], b"v2")];
        let grown = c.refresh().await.unwrap();
        assert_eq!(c.get("t", "gh").unwrap().value, b"v2");
        assert_eq!(grown.len(), 1);
        assert_eq!(grown[0].1, ["api.github.com", "github.com"]);
        // Deleted at control: gone here at the next refresh.
        held.lock().unwrap().clear();
        c.refresh().await.unwrap();
        assert!(c.get("t", "gh").is_none());
    }
}
