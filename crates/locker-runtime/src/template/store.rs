//! The cache itself: finding, listing, naming, locking and removing templates.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::fsutil::*;
use super::progress::*;
use super::spec::*;
use super::*;

/// `templates/<digest>/meta.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Meta {
    pub(super) format: u32,
    pub(super) digest: String,
    pub(super) names: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) spec: Option<TemplateSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) imported_from: Option<PathBuf>,
    pub(super) size_bytes: u64,
    pub(super) created_at: String,
    pub(super) packages: Vec<String>,
    #[serde(default)]
    pub(super) config: RunConfig,
    /// The image it was made from: `reference@manifest-digest` or the archive's path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) image: Option<String>,
    /// For a build step's template ([`TemplateStore::make_layer`]): the template it was
    /// made on. Its presence marks a step template, which the step cache's pruning may
    /// remove once nothing needs it (see `prune`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) parent: Option<String>,
}

impl Meta {
    pub(super) fn new(
        digest: &str,
        name: &str,
        spec: Option<TemplateSpec>,
        imported_from: Option<PathBuf>,
        packages: Vec<String>,
    ) -> Self {
        Meta {
            format: META_FORMAT,
            digest: digest.to_string(),
            names: vec![name.to_string()],
            spec,
            imported_from,
            size_bytes: 0,
            created_at: String::new(),
            packages,
            config: RunConfig::default(),
            image: None,
            parent: None,
        }
    }
}

/// The template cache: find, list, build and import templates.
#[derive(Debug, Clone)]
pub struct TemplateStore {
    pub(super) cache_dir: PathBuf,
    pub(super) templates: PathBuf,
}

impl TemplateStore {
    /// Opens (creating if needed) the cache at `cache_dir`.
    pub fn open(cache_dir: impl Into<PathBuf>) -> Result<Self, TemplateError> {
        let cache_dir: PathBuf = cache_dir.into();
        let templates = cache_dir.join("templates");
        for dir in [templates.join("names"), templates.join(".locks")] {
            fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
        }
        // Mount points in /proc/self/mountinfo are canonical; stale cleanup compares them.
        let cache_dir = cache_dir
            .canonicalize()
            .map_err(io_err("cannot resolve", &cache_dir))?;
        let templates = cache_dir.join("templates");
        Ok(TemplateStore {
            cache_dir,
            templates,
        })
    }

    /// Opens the cache named by `LOCKER_CACHE_DIR`, or [`DEFAULT_CACHE_DIR`].
    pub fn from_env() -> Result<Self, TemplateError> {
        match std::env::var_os(CACHE_DIR_ENV) {
            Some(dir) if !dir.is_empty() => Self::open(PathBuf::from(dir)),
            _ => Self::open(DEFAULT_CACHE_DIR),
        }
    }

    /// The cache directory (canonical).
    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    /// Finds a template by name, by full digest (with or without `sha256:`), or by a
    /// digest prefix of at least 12 hex digits. Names win over digest prefixes.
    pub fn resolve(&self, name_or_digest: &str) -> Result<Option<Template>, TemplateError> {
        if validate_name(name_or_digest).is_ok() {
            if let Some(digest) = self.name_target(name_or_digest)? {
                return self.load(&digest, name_or_digest);
            }
        }
        let hexpart = name_or_digest
            .strip_prefix("sha256:")
            .unwrap_or(name_or_digest);
        if hexpart.len() < 12 || hexpart.len() > 64 || !hexpart.bytes().all(is_lower_hex) {
            return Ok(None);
        }
        let matches: Vec<String> = self
            .built_digests()?
            .into_iter()
            .filter(|d| d.starts_with(hexpart))
            .collect();
        match matches.as_slice() {
            [] => Ok(None),
            [digest] => {
                let names = self.names_by_digest()?;
                let name = names
                    .get(digest)
                    .and_then(|n| n.first())
                    .cloned()
                    .unwrap_or_default();
                self.load(digest, &name)
            }
            _ => Err(TemplateError::Ambiguous(name_or_digest.to_string())),
        }
    }

    /// The digests of the built templates, sorted: one directory read, nothing cleaned and
    /// no metadata read (what a fleet node reports every heartbeat).
    pub fn digests(&self) -> Result<Vec<String>, TemplateError> {
        self.built_digests()
    }

    /// Every built template: one entry per name, plus one with an empty name for each
    /// digest no name points at; sorted by name, then digest. Removes what interrupted
    /// builds left behind first.
    pub fn list(&self) -> Result<Vec<Template>, TemplateError> {
        self.clean_stale();
        let names = self.names_by_digest()?;
        let mut out = Vec::new();
        for digest in self.built_digests()? {
            let empty = vec![String::new()];
            for name in names.get(&digest).unwrap_or(&empty) {
                if let Some(t) = self.load(&digest, name)? {
                    out.push(t);
                }
            }
        }
        out.sort_by(|a, b| {
            (a.name.is_empty(), &a.name, &a.digest).cmp(&(b.name.is_empty(), &b.name, &b.digest))
        });
        Ok(out)
    }

    /// Writes the metadata, syncs, and renames a finished build into place.
    pub(super) fn commit(
        &self,
        tmp: TmpDir,
        mut meta: Meta,
        progress: &mut dyn Progress,
    ) -> Result<(), TemplateError> {
        progress.step("measuring and saving", 0.97);
        meta.size_bytes = disk_usage(&tmp.path.join("rootfs"))?;
        meta.created_at = locker_types::rfc3339(unix_now());
        write_json_atomic(&tmp.path.join("meta.json"), &meta)?;
        // The rename publishes the tree: its contents must be on disk before it.
        let dir = File::open(&tmp.path).map_err(io_err("cannot open", &tmp.path))?;
        sys::syncfs(&dir).map_err(io_err("cannot sync", &tmp.path))?;
        let dest = self.templates.join(&meta.digest);
        fs::rename(&tmp.path, &dest).map_err(io_err("cannot move the build into", &dest))?;
        tmp.disarm();
        fsync_dir(&self.templates)?;
        progress.step("done", 1.0);
        Ok(())
    }

    pub(super) fn is_built(&self, digest: &str) -> bool {
        self.templates.join(digest).join("meta.json").is_file()
    }

    pub(super) fn read_meta(&self, digest: &str) -> Result<Option<Meta>, TemplateError> {
        let dir = self.templates.join(digest);
        let path = dir.join("meta.json");
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("cannot read", &path)(e)),
        };
        let meta: Meta = serde_json::from_str(&text).map_err(|e| TemplateError::Corrupt {
            path: path.clone(),
            dir: dir.clone(),
            detail: e.to_string(),
        })?;
        if meta.digest != digest {
            return Err(TemplateError::Corrupt {
                path,
                dir,
                detail: format!("it names digest {}", meta.digest),
            });
        }
        Ok(Some(meta))
    }

    pub(super) fn load(&self, digest: &str, name: &str) -> Result<Option<Template>, TemplateError> {
        Ok(self.read_meta(digest)?.map(|m| Template {
            name: name.to_string(),
            digest: m.digest,
            rootfs: self.templates.join(digest).join("rootfs"),
            size_bytes: m.size_bytes,
            created_at: m.created_at,
            packages: m.packages,
            config: m.config,
        }))
    }

    pub(super) fn must_load(&self, digest: &str, name: &str) -> Result<Template, TemplateError> {
        self.load(digest, name)?.ok_or_else(|| TemplateError::Io {
            what: "template vanished while in use",
            path: self.templates.join(digest),
            err: io::ErrorKind::NotFound.into(),
        })
    }

    /// Removes the name `name` (not a digest). When no other name points at its template
    /// any more and `keep(digest)` is false, deletes the built template's files too.
    /// `None` if no such name; else whether the files were deleted. Callers check that no
    /// machine uses the template first: its files are the lower layer of their root.
    pub fn remove(
        &self,
        name: &str,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Option<bool>, TemplateError> {
        validate_name(name)?;
        let Some(digest) = self.name_target(name)? else {
            return Ok(None);
        };
        let path = self.names_dir().join(name);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(io_err("cannot remove", &path)(e))
            }
            _ => {}
        }
        self.edit_names(&digest, |names| names.retain(|n| n != name))?;
        if self.names_by_digest()?.contains_key(&digest) || keep(&digest) {
            return Ok(Some(false));
        }
        let _lock = self.lock(&digest, &mut NoProgress)?;
        remove_tree(&self.templates.join(&digest))?;
        Ok(Some(true))
    }

    /// The spec a template was built from, if it was built (not imported).
    pub fn spec_of(&self, template: &Template) -> Result<Option<TemplateSpec>, TemplateError> {
        Ok(self.read_meta(&template.digest)?.and_then(|m| m.spec))
    }

    pub(super) fn built_digests(&self) -> Result<Vec<String>, TemplateError> {
        let mut out = Vec::new();
        let entries =
            fs::read_dir(&self.templates).map_err(io_err("cannot list", &self.templates))?;
        for entry in entries {
            let entry = entry.map_err(io_err("cannot list", &self.templates))?;
            if let Some(name) = entry.file_name().to_str() {
                if is_digest(name) && self.is_built(name) {
                    out.push(name.to_string());
                }
            }
        }
        out.sort();
        Ok(out)
    }

    pub(super) fn names_dir(&self) -> PathBuf {
        self.templates.join("names")
    }

    pub(super) fn name_target(&self, name: &str) -> Result<Option<String>, TemplateError> {
        let path = self.names_dir().join(name);
        match fs::read_to_string(&path) {
            Ok(s) if is_digest(s.trim()) => Ok(Some(s.trim().to_string())),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("cannot read", &path)(e)),
        }
    }

    pub(super) fn names_by_digest(&self) -> Result<BTreeMap<String, Vec<String>>, TemplateError> {
        let dir = self.names_dir();
        let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for entry in fs::read_dir(&dir).map_err(io_err("cannot list", &dir))? {
            let entry = entry.map_err(io_err("cannot list", &dir))?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if validate_name(&name).is_err() {
                continue;
            }
            if let Some(digest) = self.name_target(&name)? {
                map.entry(digest).or_default().push(name);
            }
        }
        for names in map.values_mut() {
            names.sort();
        }
        Ok(map)
    }

    /// Points `name` at `digest`, keeping the `names` lists in both metadata files true.
    /// Takes each digest's lock in turn, never two at once.
    pub(super) fn set_name(&self, name: &str, digest: &str) -> Result<(), TemplateError> {
        let old = self.name_target(name)?;
        self.edit_names(digest, |names| {
            if !names.iter().any(|n| n == name) {
                names.push(name.to_string());
                names.sort();
            }
        })?;
        if old.as_deref() != Some(digest) {
            let path = self.names_dir().join(name);
            write_atomic(&path, format!("{digest}\n").as_bytes())?;
        }
        if let Some(old) = old.filter(|o| o != digest) {
            self.edit_names(&old, |names| names.retain(|n| n != name))?;
        }
        Ok(())
    }

    pub(super) fn edit_names(
        &self,
        digest: &str,
        edit: impl FnOnce(&mut Vec<String>),
    ) -> Result<(), TemplateError> {
        let _lock = self.lock(digest, &mut NoProgress)?;
        let Some(mut meta) = self.read_meta(digest)? else {
            return Ok(());
        };
        let before = meta.names.clone();
        edit(&mut meta.names);
        if meta.names != before {
            write_json_atomic(&self.templates.join(digest).join("meta.json"), &meta)?;
        }
        Ok(())
    }

    pub(super) fn lock_path(&self, digest: &str) -> PathBuf {
        self.templates.join(".locks").join(format!("{digest}.lock"))
    }

    pub(super) fn open_lock(&self, digest: &str) -> Result<File, TemplateError> {
        let path = self.lock_path(digest);
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&path)
            .map_err(io_err("cannot open lock", &path))
    }

    /// Takes `digest`'s lock, waiting (and saying so) while another process holds it.
    pub(super) fn lock(
        &self,
        digest: &str,
        progress: &mut dyn Progress,
    ) -> Result<Lock, TemplateError> {
        let file = self.open_lock(digest)?;
        let path = self.lock_path(digest);
        if !sys::flock(&file, false).map_err(io_err("cannot lock", &path))? {
            progress.step("waiting for another build of this template", 0.0);
            sys::flock(&file, true).map_err(io_err("cannot lock", &path))?;
        }
        Ok(Lock { file })
    }

    /// Removes what interrupted builds left behind: `.tmp-<digest>-*` directories whose
    /// lock nobody holds (unmounting anything still mounted under them first). Failures
    /// are logged, not returned: a leftover must not stop a listing.
    pub(super) fn clean_stale(&self) {
        let Ok(entries) = fs::read_dir(&self.templates) else {
            return;
        };
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(name) = file_name.to_str() else {
                continue;
            };
            let Some(digest) = name.strip_prefix(".tmp-").and_then(|r| r.get(..64)) else {
                continue;
            };
            if !is_digest(digest) {
                continue;
            }
            let Ok(file) = self.open_lock(digest) else {
                continue;
            };
            if !matches!(sys::flock(&file, false), Ok(true)) {
                continue;
            }
            let path = entry.path();
            match remove_tree(&path) {
                Ok(()) => {
                    tracing::info!(path = %path.display(), "removed an interrupted template build")
                }
                Err(e) => tracing::warn!("cannot remove interrupted build: {e}"),
            }
        }
        // Interrupted name writes: `.tmp-<name>-<pid>-<n>` whose process is gone.
        let Ok(entries) = fs::read_dir(self.names_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(pid) = file_name
                .to_str()
                .and_then(|n| n.strip_prefix(".tmp-"))
                .and_then(|n| n.rsplit('-').nth(1))
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

/// A held flock(2) on a digest; released when dropped (and when every child that
/// inherited it has exited).
pub(super) struct Lock {
    pub(super) file: File,
}

/// A build directory that removes itself unless the build reached its rename.
pub(super) struct TmpDir {
    pub(super) path: PathBuf,
    pub(super) armed: bool,
}

impl TmpDir {
    pub(super) fn create(templates: &Path, digest: &str) -> Result<Self, TemplateError> {
        let path = templates.join(format!(".tmp-{digest}-{}", std::process::id()));
        // Left by an earlier process with our pid; we hold the lock, so it is stale.
        if path.exists() {
            remove_tree(&path)?;
        }
        fs::create_dir(&path).map_err(io_err("cannot create", &path))?;
        Ok(TmpDir { path, armed: true })
    }

    pub(super) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = remove_tree(&self.path) {
                tracing::warn!("cannot remove failed build: {e}");
            }
        }
    }
}
