//! Pruning the step cache: the unnamed templates that build steps leave behind
//! ([`TemplateStore::make_layer`]), kept so that a rebuild starts at its first changed
//! step, and bounded here by count, size and age ([`StepCacheLimits`]).
//!
//! A step template is needed, and never removed, while a name points at it or at a
//! template made on it (its `parent` chain: a named template's rebuild finds its steps,
//! and a template may one day stand on its parent's files), or while the caller says it or
//! a template made on it is in use (a sandbox, a snapshot). Among the rest, those unused
//! for longer than the age limit go, then the least recently used until the step templates
//! are within the count and size limits. "Used" is the last time a build found the step in
//! the cache ([`TemplateStore::touch`]) or made it.
//!
//! The caller must make sure no build runs meanwhile: a build's steps are neither named
//! nor in a sandbox while it runs. This room does not know about builds or sandboxes.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::time::{Duration, SystemTime};

use super::fsutil::*;
use super::*;

/// Bounds on the step cache (step templates no name needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCacheLimits {
    /// Step templates kept at most (needed ones count but are never removed).
    pub max_count: usize,
    /// Their disk space at most (bytes, as each was measured when made).
    pub max_bytes: u64,
    /// Unneeded step templates unused for longer than this go whatever the rest.
    pub max_age: Duration,
}

/// Environment variables that override [`StepCacheLimits::default`].
pub const STEP_CACHE_MAX_COUNT_ENV: &str = "LOCKER_STEP_CACHE_MAX_COUNT";
/// See [`STEP_CACHE_MAX_COUNT_ENV`] (bytes).
pub const STEP_CACHE_MAX_BYTES_ENV: &str = "LOCKER_STEP_CACHE_MAX_BYTES";
/// See [`STEP_CACHE_MAX_COUNT_ENV`] (seconds).
pub const STEP_CACHE_MAX_AGE_ENV: &str = "LOCKER_STEP_CACHE_MAX_AGE_S";

impl Default for StepCacheLimits {
    fn default() -> Self {
        StepCacheLimits {
            max_count: 200,
            max_bytes: 20 << 30,
            max_age: Duration::from_secs(14 * 24 * 3600),
        }
    }
}

impl StepCacheLimits {
    /// The defaults, each overridden by its environment variable when that holds a number
    /// (0 allowed: keep none that is not needed).
    pub fn from_env() -> Self {
        let read = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let d = Self::default();
        StepCacheLimits {
            max_count: read(STEP_CACHE_MAX_COUNT_ENV).map_or(d.max_count, |n| n as usize),
            max_bytes: read(STEP_CACHE_MAX_BYTES_ENV).unwrap_or(d.max_bytes),
            max_age: read(STEP_CACHE_MAX_AGE_ENV).map_or(d.max_age, Duration::from_secs),
        }
    }
}

/// What a prune removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Digests of the step templates removed, least recently used first.
    pub removed: Vec<String>,
    /// Their disk space (bytes).
    pub bytes: u64,
    /// Step templates left, and their disk space.
    pub kept: usize,
    pub kept_bytes: u64,
}

impl TemplateStore {
    /// Marks template `digest` used now (best effort: the step cache's age counts from
    /// here).
    pub fn touch(&self, digest: &str) {
        if !is_digest(digest) {
            return;
        }
        let path = self.templates.join(digest).join("meta.json");
        if let Ok(f) = fs::File::options().write(true).open(&path) {
            let _ = f.set_modified(SystemTime::now());
        }
    }

    /// Removes step templates that nothing needs, as the module doc says, until the rest
    /// are within `limits`; `in_use` holds the digests sandboxes and snapshots stand on.
    pub fn prune_steps(
        &self,
        limits: StepCacheLimits,
        in_use: &HashSet<String>,
    ) -> Result<Pruned, TemplateError> {
        let named = self.names_by_digest()?;
        let mut parents: BTreeMap<String, Option<String>> = BTreeMap::new();
        let mut steps = Vec::new();
        for d in self.built_digests()? {
            let Some(meta) = self.read_meta(&d)? else {
                continue;
            };
            if meta.parent.is_some() {
                let used = fs::metadata(self.templates.join(&d).join("meta.json"))
                    .and_then(|m| m.modified())
                    .unwrap_or(SystemTime::UNIX_EPOCH);
                steps.push((used, d.clone(), meta.size_bytes));
            }
            parents.insert(d, meta.parent);
        }
        let mut needed: HashSet<String> = HashSet::new();
        let mut stack: Vec<String> = named.keys().chain(in_use.iter()).cloned().collect();
        while let Some(d) = stack.pop() {
            if let Some(Some(p)) = parents.get(&d) {
                stack.push(p.clone());
            }
            needed.insert(d);
        }
        let mut count = steps.len();
        let mut bytes: u64 = steps.iter().map(|s| s.2).sum();
        steps.retain(|(_, d, _)| !needed.contains(d));
        steps.sort();
        let now = SystemTime::now();
        let mut out = Pruned::default();
        for (used, digest, size) in steps {
            let old = now.duration_since(used).unwrap_or_default() > limits.max_age;
            if !old && count <= limits.max_count && bytes <= limits.max_bytes {
                break;
            }
            // Never wait for a lock here: one held is a build of this digest, or a process
            // forked while it was held (a machine's shim inherits the descriptor), which
            // may hold it for its whole life; such a step is left for a later prune.
            let lock = self.open_lock(&digest)?;
            if !matches!(crate::sys::flock(&lock, false), Ok(true)) {
                continue;
            }
            // Named meanwhile (a name is written into the metadata under this lock first).
            if self
                .read_meta(&digest)?
                .is_none_or(|m| !m.names.is_empty())
            {
                continue;
            }
            remove_tree(&self.templates.join(&digest))?;
            count -= 1;
            bytes = bytes.saturating_sub(size);
            out.bytes += size;
            out.removed.push(digest);
        }
        out.kept = count;
        out.kept_bytes = bytes;
        Ok(out)
    }
}
