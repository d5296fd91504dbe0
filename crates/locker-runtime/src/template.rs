//! Templates: immutable root filesystems, built once from a spec and stored by digest.
//!
//! This room owns the template cache, `$LOCKER_CACHE_DIR/templates/` (default
//! `/var/cache/locker`), which every data dir on a host shares:
//!
//! ```text
//! templates/<digest>/rootfs/       the root filesystem, never changed once in place
//! templates/<digest>/meta.json     names, digest, spec, size, creation time, packages
//! templates/names/<name>           the digest a name points at (one line)
//! templates/.locks/<digest>.lock   flock(2) held by whoever builds <digest>
//! templates/.tmp-<digest>-<pid>/   a build in progress (or one that died)
//! ```
//!
//! A template is stored by the digest of its content, never by its name: the digest of a
//! spec hashes a canonical form of its base, packages and run steps together with
//! [`SPEC_FORMAT`], which names the build recipe, so two names with the same content share
//! one build, and changing how templates are made changes every digest. An imported
//! tarball's digest hashes its bytes with [`IMPORT_FORMAT`].
//!
//! Why builds are safe to interrupt: a build writes into `.tmp-<digest>-<pid>` while it
//! holds that digest's lock, and renames the finished directory into place only after its
//! metadata and contents are synced, so `templates/<digest>/` exists only when complete.
//! The lock also makes two concurrent builds of one digest build once: the second waits,
//! then finds the first's result. Children (mmdebstrap, tar) inherit the lock and die with
//! the builder, so a lock that is free means nobody writes into a `.tmp-*` directory any
//! more; the next build or listing unmounts whatever is left mounted there and removes it.
//!
//! Run steps execute as root inside the new root filesystem, in their own mount and pid
//! namespaces (`unshare --root --mount-proc`): `/proc` exists only for the step, and every
//! process a step leaves behind dies with it.
//!
//! This room does not mount templates for machines, own sandboxes, or know about the
//! database: runtimes take [`Template::rootfs`] and use it read-only.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, IsTerminal, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// Where templates live when `LOCKER_CACHE_DIR` is not set.
pub const DEFAULT_CACHE_DIR: &str = "/var/cache/locker";
/// The environment variable that moves the cache.
pub const CACHE_DIR_ENV: &str = "LOCKER_CACHE_DIR";
/// The name of the template built from [`default_spec`].
pub const DEFAULT_TEMPLATE: &str = "default";
/// The only base a spec may name for now.
pub const DEFAULT_BASE: &str = "debian:bookworm";
/// The build recipe a spec digest stands for. Change it whenever the way a spec becomes a
/// root filesystem changes (variant, mirrors, dpkg filters, finishing touches), so that
/// old builds are not mistaken for new ones.
pub const SPEC_FORMAT: &str = "locker-template-spec-v1 mmdebstrap-minbase-bookworm";
/// What an import digest stands for: these bytes, extracted as-is.
pub const IMPORT_FORMAT: &str = "locker-template-import-v1";

/// The packages of the default template: enough for an agent to run Python, Node and git.
pub const DEFAULT_PACKAGES: &[&str] = &[
    "python3",
    "python3-pip",
    "python3-venv",
    "git",
    "curl",
    "ca-certificates",
    "procps",
    "iproute2",
    "nodejs",
    "npm",
    "less",
    "jq",
];

const META_FORMAT: u32 = 1;
const DEBIAN_SOURCES: &[&str] = &[
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
];
/// Documentation and translations nobody reads inside a machine; copyright files stay.
const DPKG_FILTERS: &[&str] = &[
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
];
const STEP_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Environment variables passed from the host to mmdebstrap and run steps (mirror access).
const PASSED_ENV: &[&str] = &[
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
];

/// What went wrong with a template; every message says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("invalid template name {name:?}: {why}")]
    InvalidName { name: String, why: &'static str },
    #[error("invalid template spec: {0}")]
    InvalidSpec(String),
    #[error("unsupported base {0:?}: only \"debian:bookworm\" is supported for now")]
    UnsupportedBase(String),
    #[error("{tool} not found: {fix}")]
    ToolMissing {
        tool: &'static str,
        fix: &'static str,
    },
    #[error("building templates needs root (mmdebstrap's root mode, chroot): run as root")]
    NotRoot,
    #[error("{step} failed: {detail}")]
    BuildFailed { step: String, detail: String },
    #[error("{0:?} matches more than one template digest: give more characters")]
    Ambiguous(String),
    #[error("template metadata {path} is unreadable ({detail}): remove {dir} and build again")]
    Corrupt {
        path: PathBuf,
        dir: PathBuf,
        detail: String,
    },
    #[error("{what} {path}: {err}")]
    Io {
        what: &'static str,
        path: PathBuf,
        err: io::Error,
    },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> TemplateError + 'a {
    move |err| TemplateError::Io {
        what,
        path: path.to_path_buf(),
        err,
    }
}

/// What to build: a base, apt packages, and shell steps run as root inside the result.
///
/// The JSON form is the spec file `locker template build --file` reads; unknown fields are
/// refused so that a typo does not silently build something else.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateSpec {
    /// The name the template is found by; not part of its digest.
    pub name: String,
    /// The distribution it starts from; only `debian:bookworm` for now.
    #[serde(default = "default_base")]
    pub base: String,
    /// Debian packages to install on top of the minimal system.
    #[serde(default)]
    pub packages: Vec<String>,
    /// Shell scripts (`/bin/sh -c`), run in order as root inside the new root filesystem.
    #[serde(default)]
    pub run: Vec<String>,
}

fn default_base() -> String {
    DEFAULT_BASE.to_string()
}

/// The canonical content of a spec: what its digest hashes.
#[derive(Serialize)]
struct CanonicalSpec<'a> {
    format: &'a str,
    base: &'a str,
    packages: Vec<&'a str>,
    run: &'a [String],
}

impl TemplateSpec {
    /// Reads a spec from its JSON form and validates it.
    pub fn from_json(text: &str) -> Result<Self, TemplateError> {
        let spec: Self =
            serde_json::from_str(text).map_err(|e| TemplateError::InvalidSpec(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Checks the name, base, package names and run steps.
    pub fn validate(&self) -> Result<(), TemplateError> {
        validate_name(&self.name)?;
        if self.base != DEFAULT_BASE {
            return Err(TemplateError::UnsupportedBase(self.base.clone()));
        }
        for p in &self.packages {
            validate_package(p)?;
        }
        for (i, step) in self.run.iter().enumerate() {
            if step.trim().is_empty() {
                return Err(TemplateError::InvalidSpec(format!(
                    "run step {} is empty",
                    i + 1
                )));
            }
            if step.contains('\0') {
                return Err(TemplateError::InvalidSpec(format!(
                    "run step {} contains a NUL byte",
                    i + 1
                )));
            }
        }
        Ok(())
    }

    /// The content digest (64 hex digits): sha256 of the canonical form, which sorts and
    /// de-duplicates packages (apt does not care about their order) but keeps run steps in
    /// order, and leaves the name out.
    pub fn digest(&self) -> String {
        let mut packages: Vec<&str> = self.packages.iter().map(String::as_str).collect();
        packages.sort_unstable();
        packages.dedup();
        let canonical = CanonicalSpec {
            format: SPEC_FORMAT,
            base: &self.base,
            packages,
            run: &self.run,
        };
        let bytes = serde_json::to_vec(&canonical).expect("a spec always serializes");
        hex(&Sha256::digest(&bytes))
    }
}

/// The spec of the `default` template: Debian bookworm with Python, Node, git and the
/// usual command-line tools.
pub fn default_spec() -> TemplateSpec {
    TemplateSpec {
        name: DEFAULT_TEMPLATE.to_string(),
        base: DEFAULT_BASE.to_string(),
        packages: DEFAULT_PACKAGES.iter().map(|p| p.to_string()).collect(),
        run: Vec::new(),
    }
}

/// Checks a template name: `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn validate_name(name: &str) -> Result<(), TemplateError> {
    let bad = |why| {
        Err(TemplateError::InvalidName {
            name: name.to_string(),
            why,
        })
    };
    let Some(first) = name.bytes().next() else {
        return bad("it is empty");
    };
    if name.len() > 63 {
        return bad("it is longer than 63 characters");
    }
    if !(first.is_ascii_lowercase() || first.is_ascii_digit()) {
        return bad("it must start with a lowercase letter or a digit");
    }
    let ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b);
    if !name.bytes().all(ok) {
        return bad("use only lowercase letters, digits, '.', '_' and '-'");
    }
    Ok(())
}

/// Checks a Debian package name (Debian Policy 5.6.1): `[a-z0-9][a-z0-9+.-]+`.
fn validate_package(p: &str) -> Result<(), TemplateError> {
    let ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+.-".contains(&b);
    let first_ok = p
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if p.len() < 2 || p.len() > 128 || !first_ok || !p.bytes().all(ok) {
        return Err(TemplateError::InvalidSpec(format!(
            "{p:?} is not a Debian package name (lowercase letters, digits, '+', '-', '.'; \
             at least two characters, starting with a letter or digit)"
        )));
    }
    Ok(())
}

/// A built template, as runtimes see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    /// The name it was found by; empty for a digest no name points at.
    pub name: String,
    /// Its content digest (64 hex digits).
    pub digest: String,
    /// Its root filesystem: read-only for everyone.
    pub rootfs: PathBuf,
    /// Disk space the root filesystem takes (hard links counted once).
    pub size_bytes: u64,
    /// When it was built or imported (RFC 3339, UTC).
    pub created_at: String,
    /// The packages its spec asked for (empty for imports).
    pub packages: Vec<String>,
}

/// `templates/<digest>/meta.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Meta {
    format: u32,
    digest: String,
    names: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    spec: Option<TemplateSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    imported_from: Option<PathBuf>,
    size_bytes: u64,
    created_at: String,
    packages: Vec<String>,
}

impl Meta {
    fn new(
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
        }
    }
}

/// Where a build or import reports how far it got.
pub trait Progress {
    /// A new step began (`name` is for a person); `fraction` is the whole job's
    /// completion, from 0.0 to 1.0.
    fn step(&mut self, name: &str, fraction: f64);
    /// The job moved inside the current step.
    fn fraction(&mut self, fraction: f64);
    /// One line of a tool's output (mmdebstrap, apt, a run step, tar).
    fn output(&mut self, _line: &str) {}
    /// The job ended, well or not (called once by [`TemplateStore::build`] and
    /// [`TemplateStore::import`], also when they return at once).
    fn finish(&mut self, _ok: bool) {}
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Default)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn step(&mut self, _name: &str, _fraction: f64) {}
    fn fraction(&mut self, _fraction: f64) {}
}

/// A [`Progress`] on standard error: a bar redrawn in place when stderr is a terminal,
/// one line per step otherwise.
#[derive(Debug)]
pub struct StderrProgress {
    tty: bool,
    verbose: bool,
    step: String,
    fraction: f64,
    drawn: Option<Instant>,
    started: Instant,
}

impl StderrProgress {
    /// `verbose` also prints every line of the tools' output.
    pub fn new(verbose: bool) -> Self {
        StderrProgress {
            tty: io::stderr().is_terminal(),
            verbose,
            step: String::new(),
            fraction: 0.0,
            drawn: None,
            started: Instant::now(),
        }
    }

    fn draw(&mut self, force: bool) {
        if !self.tty {
            return;
        }
        if !force
            && self
                .drawn
                .is_some_and(|t| t.elapsed() < Duration::from_millis(80))
        {
            return;
        }
        self.drawn = Some(Instant::now());
        const WIDTH: usize = 28;
        let filled = ((self.fraction * WIDTH as f64).round() as usize).min(WIDTH);
        let step: String = self.step.chars().take(60).collect();
        let secs = self.started.elapsed().as_secs();
        eprint!(
            "\r\x1b[2K[{}{}] {:>3}% {:>3}s {step}",
            "#".repeat(filled),
            " ".repeat(WIDTH - filled),
            (self.fraction * 100.0).floor() as u32,
            secs
        );
        let _ = io::stderr().flush();
    }
}

impl Progress for StderrProgress {
    fn step(&mut self, name: &str, fraction: f64) {
        self.step = name.to_string();
        self.fraction = fraction.clamp(0.0, 1.0);
        if self.tty {
            self.draw(true);
        } else {
            eprintln!("[{:>3}%] {name}", (self.fraction * 100.0).floor() as u32);
        }
    }

    fn fraction(&mut self, fraction: f64) {
        self.fraction = fraction.clamp(0.0, 1.0);
        self.draw(false);
    }

    fn output(&mut self, line: &str) {
        if self.verbose {
            if self.tty {
                eprint!("\r\x1b[2K");
            }
            eprintln!("  {line}");
            self.draw(true);
        }
    }

    fn finish(&mut self, ok: bool) {
        if self.tty {
            if ok {
                self.fraction = 1.0;
            }
            self.draw(true);
            eprintln!();
        }
    }
}

/// The template cache: find, list, build and import templates.
#[derive(Debug, Clone)]
pub struct TemplateStore {
    cache_dir: PathBuf,
    templates: PathBuf,
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

    /// Builds `spec` (or returns at once if its digest is already built) and points its
    /// name at the result.
    pub fn build(
        &self,
        spec: &TemplateSpec,
        progress: &mut dyn Progress,
    ) -> Result<Template, TemplateError> {
        let result = self.build_unfinished(spec, progress);
        progress.finish(result.is_ok());
        result
    }

    fn build_unfinished(
        &self,
        spec: &TemplateSpec,
        progress: &mut dyn Progress,
    ) -> Result<Template, TemplateError> {
        spec.validate()?;
        let digest = spec.digest();
        self.clean_stale();
        if self.is_built(&digest) {
            self.set_name(&spec.name, &digest)?;
            return self.must_load(&digest, &spec.name);
        }
        check_build_host()?;
        let lock = self.lock(&digest, progress)?;
        if !self.is_built(&digest) {
            self.build_locked(spec, &digest, &lock, progress)?;
        }
        drop(lock);
        self.set_name(&spec.name, &digest)?;
        self.must_load(&digest, &spec.name)
    }

    /// Builds the `default` template from [`default_spec`] unless it is already built.
    pub fn ensure_default(&self, progress: &mut dyn Progress) -> Result<Template, TemplateError> {
        self.build(&default_spec(), progress)
    }

    /// Imports a root filesystem tarball (plain, gzip, bzip2, xz or zstd) as template
    /// `name`. Its digest is that of the tarball's bytes; importing the same bytes again
    /// only adds the name.
    pub fn import(
        &self,
        name: &str,
        tarball: &Path,
        progress: &mut dyn Progress,
    ) -> Result<Template, TemplateError> {
        let result = self.import_unfinished(name, tarball, progress);
        progress.finish(result.is_ok());
        result
    }

    fn import_unfinished(
        &self,
        name: &str,
        tarball: &Path,
        progress: &mut dyn Progress,
    ) -> Result<Template, TemplateError> {
        validate_name(name)?;
        progress.step("hashing the tarball", 0.0);
        let digest = hash_file(tarball)?;
        self.clean_stale();
        if !self.is_built(&digest) {
            let lock = self.lock(&digest, progress)?;
            if !self.is_built(&digest) {
                self.import_locked(name, tarball, &digest, &lock, progress)?;
            }
        }
        self.set_name(name, &digest)?;
        self.must_load(&digest, name)
    }

    fn build_locked(
        &self,
        spec: &TemplateSpec,
        digest: &str,
        lock: &Lock,
        progress: &mut dyn Progress,
    ) -> Result<(), TemplateError> {
        let tmp = TmpDir::create(&self.templates, digest)?;
        let rootfs = tmp.path.join("rootfs");
        // mmdebstrap takes the first 80% (93% without run steps) of the bar.
        let mm_share = if spec.run.is_empty() { 0.93 } else { 0.80 };
        run_mmdebstrap(spec, &rootfs, lock, progress, mm_share)?;
        let steps = spec.run.len().max(1) as f64;
        for (i, step) in spec.run.iter().enumerate() {
            let at = mm_share + (0.95 - mm_share) * i as f64 / steps;
            progress.step(
                &format!("run step {}/{}: {}", i + 1, spec.run.len(), one_line(step)),
                at,
            );
            run_step(&rootfs, i, step, lock, progress)?;
        }
        progress.step("cleaning up the root filesystem", 0.95);
        finish_built_rootfs(&rootfs)?;
        let mut packages = spec.packages.clone();
        packages.sort_unstable();
        packages.dedup();
        let meta = Meta::new(digest, &spec.name, Some(spec.clone()), None, packages);
        self.commit(tmp, meta, progress)
    }

    fn import_locked(
        &self,
        name: &str,
        tarball: &Path,
        digest: &str,
        lock: &Lock,
        progress: &mut dyn Progress,
    ) -> Result<(), TemplateError> {
        let tmp = TmpDir::create(&self.templates, digest)?;
        let rootfs = tmp.path.join("rootfs");
        fs::create_dir(&rootfs).map_err(io_err("cannot create", &rootfs))?;
        progress.step("extracting the tarball", 0.05);
        extract_tarball(tarball, &rootfs, digest, lock, progress)?;
        ensure_standard_dirs(&rootfs)?;
        let source = tarball
            .canonicalize()
            .unwrap_or_else(|_| tarball.to_path_buf());
        let meta = Meta::new(digest, name, None, Some(source), Vec::new());
        self.commit(tmp, meta, progress)
    }

    /// Writes the metadata, syncs, and renames a finished build into place.
    fn commit(
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

    fn is_built(&self, digest: &str) -> bool {
        self.templates.join(digest).join("meta.json").is_file()
    }

    fn read_meta(&self, digest: &str) -> Result<Option<Meta>, TemplateError> {
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

    fn load(&self, digest: &str, name: &str) -> Result<Option<Template>, TemplateError> {
        Ok(self.read_meta(digest)?.map(|m| Template {
            name: name.to_string(),
            digest: m.digest,
            rootfs: self.templates.join(digest).join("rootfs"),
            size_bytes: m.size_bytes,
            created_at: m.created_at,
            packages: m.packages,
        }))
    }

    fn must_load(&self, digest: &str, name: &str) -> Result<Template, TemplateError> {
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

    fn built_digests(&self) -> Result<Vec<String>, TemplateError> {
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

    fn names_dir(&self) -> PathBuf {
        self.templates.join("names")
    }

    fn name_target(&self, name: &str) -> Result<Option<String>, TemplateError> {
        let path = self.names_dir().join(name);
        match fs::read_to_string(&path) {
            Ok(s) if is_digest(s.trim()) => Ok(Some(s.trim().to_string())),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("cannot read", &path)(e)),
        }
    }

    fn names_by_digest(&self) -> Result<BTreeMap<String, Vec<String>>, TemplateError> {
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
    fn set_name(&self, name: &str, digest: &str) -> Result<(), TemplateError> {
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

    fn edit_names(
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

    fn lock_path(&self, digest: &str) -> PathBuf {
        self.templates.join(".locks").join(format!("{digest}.lock"))
    }

    fn open_lock(&self, digest: &str) -> Result<File, TemplateError> {
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
    fn lock(&self, digest: &str, progress: &mut dyn Progress) -> Result<Lock, TemplateError> {
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
    fn clean_stale(&self) {
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
struct Lock {
    file: File,
}

/// A build directory that removes itself unless the build reached its rename.
struct TmpDir {
    path: PathBuf,
    armed: bool,
}

impl TmpDir {
    fn create(templates: &Path, digest: &str) -> Result<Self, TemplateError> {
        let path = templates.join(format!(".tmp-{digest}-{}", std::process::id()));
        // Left by an earlier process with our pid; we hold the lock, so it is stale.
        if path.exists() {
            remove_tree(&path)?;
        }
        fs::create_dir(&path).map_err(io_err("cannot create", &path))?;
        Ok(TmpDir { path, armed: true })
    }

    fn disarm(mut self) {
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

fn check_build_host() -> Result<(), TemplateError> {
    if !sys::is_root() {
        return Err(TemplateError::NotRoot);
    }
    if find_in_path("mmdebstrap").is_none() {
        return Err(TemplateError::ToolMissing {
            tool: "mmdebstrap",
            fix: "apt-get install mmdebstrap",
        });
    }
    if find_in_path("unshare").is_none() {
        return Err(TemplateError::ToolMissing {
            tool: "unshare",
            fix: "apt-get install util-linux",
        });
    }
    Ok(())
}

fn find_in_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// A command with a clean environment: PATH, HOME, a UTF-8 locale, and proxies.
fn clean_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_clear()
        .env("PATH", STEP_PATH)
        .env("HOME", "/root")
        .env("LC_ALL", "C.UTF-8")
        .env("DEBIAN_FRONTEND", "noninteractive");
    for var in PASSED_ENV {
        if let Some(v) = std::env::var_os(var) {
            cmd.env(var, v);
        }
    }
    cmd.stdin(Stdio::null());
    cmd
}

fn run_mmdebstrap(
    spec: &TemplateSpec,
    rootfs: &Path,
    lock: &Lock,
    progress: &mut dyn Progress,
    share: f64,
) -> Result<(), TemplateError> {
    let mut cmd = clean_command("mmdebstrap");
    cmd.args([
        "--verbose",
        "--mode=root",
        "--format=directory",
        "--variant=minbase",
    ])
    .arg("--aptopt=APT::Install-Recommends \"false\"");
    for filter in DPKG_FILTERS {
        cmd.arg(format!("--dpkgopt={filter}"));
    }
    if !spec.packages.is_empty() {
        cmd.arg(format!("--include={}", spec.packages.join(",")));
    }
    cmd.arg("bookworm").arg(rootfs).args(DEBIAN_SOURCES);
    progress.step("starting mmdebstrap", 0.0);
    let mut phases = MmdebstrapPhases::default();
    let mut errors = Vec::new();
    let (status, tail) = run_logged(cmd, "mmdebstrap", lock, libc::SIGTERM, &mut |line| {
        progress.output(line);
        if let Some(e) = line.strip_prefix("E: ") {
            errors.push(e.to_string());
        }
        match phases.line(line) {
            Some(Event::Step(name, f)) => progress.step(name, f * share),
            Some(Event::Fraction(f)) => progress.fraction(f * share),
            None => {}
        }
    })?;
    if !status.success() {
        // apt's first error names the cause ("Unable to locate package x"); the rest
        // repeat it with more noise.
        let detail = errors
            .first()
            .cloned()
            .or_else(|| tail.last().cloned())
            .unwrap_or_default();
        return Err(TemplateError::BuildFailed {
            step: format!("mmdebstrap ({})", describe_status(status)),
            detail: format!(
                "{detail} (fix the spec's packages, or check the network to deb.debian.org)"
            ),
        });
    }
    Ok(())
}

/// Runs one step as root inside `rootfs`, in fresh mount and pid namespaces.
fn run_step(
    rootfs: &Path,
    index: usize,
    step: &str,
    lock: &Lock,
    progress: &mut dyn Progress,
) -> Result<(), TemplateError> {
    // Name resolution for apt and pip during the step; no service may start.
    let host_resolv = fs::read("/etc/resolv.conf").unwrap_or_default();
    let resolv = write_inside(rootfs, "etc", "resolv.conf", &host_resolv, 0o644)?;
    let policy = match contained(rootfs, "usr/sbin/policy-rc.d") {
        Some(p) if fs::symlink_metadata(&p).is_err() => write_inside(
            rootfs,
            "usr/sbin",
            "policy-rc.d",
            b"#!/bin/sh\nexit 101\n",
            0o755,
        )?,
        _ => None,
    };
    let mut cmd = clean_command("unshare");
    cmd.args([
        "--mount",
        "--propagation=private",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
    ])
    .arg(format!("--root={}", rootfs.display()))
    .args(["--wd=/", "--", "/bin/sh", "-c", step]);
    let result = run_logged(cmd, "unshare", lock, libc::SIGKILL, &mut |line| {
        progress.output(line)
    });
    for path in policy.iter().chain(resolv.iter()) {
        remove_if_exists(path)?;
    }
    let (status, tail) = result?;
    if !status.success() {
        let last = tail.last().map(|l| format!(": {l}")).unwrap_or_default();
        return Err(TemplateError::BuildFailed {
            step: format!("run step {} `{}`", index + 1, one_line(step)),
            detail: format!("{}{last}", describe_status(status)),
        });
    }
    Ok(())
}

/// Finishing touches for a built root filesystem: nothing of the host, no caches.
fn finish_built_rootfs(rootfs: &Path) -> Result<(), TemplateError> {
    // mmdebstrap copies the host's resolv.conf and hostname in; a runtime provides its own.
    if let Some(etc) = contained(rootfs, "etc") {
        remove_if_exists(&etc.join("resolv.conf"))?;
        if fs::symlink_metadata(etc.join("hosts")).is_err() {
            let hosts = b"127.0.0.1\tlocalhost locker\n::1\tlocalhost ip6-localhost ip6-loopback\n";
            write_inside(rootfs, "etc", "hosts", hosts, 0o644)?;
        }
    }
    write_inside(rootfs, "etc", "hostname", b"locker\n", 0o644)?;
    for dir in [
        "var/lib/apt/lists",
        "var/cache/apt",
        "root/.cache",
        "tmp",
        "var/tmp",
    ] {
        clear_dir(rootfs, dir)?;
    }
    // apt expects these to exist; clearing removed them.
    for (dir, mode) in [
        ("var/lib/apt/lists/partial", 0o700),
        ("var/cache/apt/archives", 0o755),
        ("var/cache/apt/archives/partial", 0o700),
    ] {
        ensure_dir(rootfs, dir, mode)?;
    }
    ensure_standard_dirs(rootfs)
}

/// `/tmp`, `/var/tmp` (sticky, world-writable) and `/root` (private) exist.
fn ensure_standard_dirs(rootfs: &Path) -> Result<(), TemplateError> {
    ensure_dir(rootfs, "tmp", 0o1777)?;
    ensure_dir(rootfs, "var", 0o755)?;
    ensure_dir(rootfs, "var/tmp", 0o1777)?;
    ensure_dir(rootfs, "root", 0o700)
}

/// The path of `rel` inside `rootfs` if no component of it is a symlink (so that writing
/// there cannot land outside the root filesystem); `None` otherwise.
fn contained(rootfs: &Path, rel: &str) -> Option<PathBuf> {
    let mut path = rootfs.to_path_buf();
    for comp in Path::new(rel).components() {
        let Component::Normal(c) = comp else {
            return None;
        };
        path.push(c);
        if fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            return None;
        }
    }
    Some(path)
}

/// Creates `rel` with `mode` unless it exists; leaves symlinks and non-directories alone.
fn ensure_dir(rootfs: &Path, rel: &str, mode: u32) -> Result<(), TemplateError> {
    let Some(path) = contained(rootfs, rel) else {
        return Ok(());
    };
    match fs::symlink_metadata(&path) {
        Ok(_) => Ok(()),
        Err(_) => {
            fs::create_dir(&path).map_err(io_err("cannot create", &path))?;
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                .map_err(io_err("cannot chmod", &path))
        }
    }
}

/// Removes everything inside `rel` (not `rel` itself), never following a symlink.
fn clear_dir(rootfs: &Path, rel: &str) -> Result<(), TemplateError> {
    let Some(path) = contained(rootfs, rel) else {
        return Ok(());
    };
    let Ok(entries) = fs::read_dir(&path) else {
        return Ok(());
    };
    for entry in entries {
        let entry = entry.map_err(io_err("cannot list", &path))?;
        let p = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        let r = if is_dir {
            fs::remove_dir_all(&p)
        } else {
            fs::remove_file(&p)
        };
        r.map_err(io_err("cannot remove", &p))?;
    }
    Ok(())
}

/// Replaces `dir/name` inside `rootfs` with a new file (a symlink there is removed, not
/// followed); does nothing and returns `None` if `dir` leads outside through a symlink.
fn write_inside(
    rootfs: &Path,
    dir: &str,
    name: &str,
    bytes: &[u8],
    mode: u32,
) -> Result<Option<PathBuf>, TemplateError> {
    let Some(dir) = contained(rootfs, dir) else {
        return Ok(None);
    };
    let path = dir.join(name);
    remove_if_exists(&path)?;
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&path)
        .map_err(io_err("cannot create", &path))?;
    f.write_all(bytes).map_err(io_err("cannot write", &path))?;
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io_err("cannot chmod", &path))?;
    Ok(Some(path))
}

fn remove_if_exists(path: &Path) -> Result<(), TemplateError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("cannot remove", path)(e)),
        _ => Ok(()),
    }
}

/// Streams `tarball` into `tar -x`, hashing it again on the way so that what lands in the
/// template is exactly what `digest` names.
fn extract_tarball(
    tarball: &Path,
    rootfs: &Path,
    digest: &str,
    lock: &Lock,
    progress: &mut dyn Progress,
) -> Result<(), TemplateError> {
    let mut file = File::open(tarball).map_err(io_err("cannot open", tarball))?;
    let total = file.metadata().map(|m| m.len()).unwrap_or(0).max(1);
    let mut magic = [0u8; 6];
    let n = read_full(&mut file, &mut magic).map_err(io_err("cannot read", tarball))?;
    let filter = compression_flag(&magic[..n]);
    let mut cmd = clean_command("tar");
    cmd.arg("--extract")
        .args(filter)
        .args(["--file=-", "--numeric-owner", "--same-owner"]);
    cmd.args(["--same-permissions", "--xattrs", "--xattrs-include=*"])
        .arg("--directory")
        .arg(rootfs);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    sys::die_with_parent(&mut cmd, lock.file.as_raw_fd(), libc::SIGKILL);
    let mut child = cmd.spawn().map_err(|e| spawn_error("tar", e))?;
    let stderr = child.stderr.take().expect("stderr is piped");
    let reader = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let mut hasher = Sha256::new();
    hasher.update(IMPORT_FORMAT.as_bytes());
    hasher.update(b"\n");
    let mut fed = stdin.write_all(&magic[..n]);
    hasher.update(&magic[..n]);
    let mut buf = vec![0u8; 1 << 20];
    let mut done = n as u64;
    loop {
        let k = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io_err("cannot read", tarball)(e));
            }
        };
        hasher.update(&buf[..k]);
        if fed.is_ok() {
            fed = stdin.write_all(&buf[..k]);
        }
        done += k as u64;
        progress.fraction(0.05 + 0.9 * done as f64 / total as f64);
    }
    drop(stdin);
    let status = child
        .wait()
        .map_err(io_err("cannot wait for tar on", tarball))?;
    let errors = reader.join().unwrap_or_default();
    for line in &errors {
        progress.output(line);
    }
    if !status.success() || fed.is_err() {
        let detail = errors
            .first()
            .cloned()
            .unwrap_or_else(|| describe_status(status));
        return Err(TemplateError::BuildFailed {
            step: format!("extracting {}", tarball.display()),
            detail: format!("{detail} (give a tar archive: plain, gzip, bzip2, xz or zstd)"),
        });
    }
    if hex(&hasher.finalize()) != digest {
        return Err(TemplateError::BuildFailed {
            step: format!("importing {}", tarball.display()),
            detail: "the file changed while it was being imported: import it again".into(),
        });
    }
    Ok(())
}

fn compression_flag(magic: &[u8]) -> Option<&'static str> {
    match magic {
        [0x1f, 0x8b, ..] => Some("--gzip"),
        [b'B', b'Z', b'h', ..] => Some("--bzip2"),
        [0xfd, b'7', b'z', b'X', b'Z', 0x00, ..] => Some("--xz"),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Some("--zstd"),
        _ => None,
    }
}

fn read_full(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The import digest of a file: sha256 of [`IMPORT_FORMAT`], a newline, and its bytes.
fn hash_file(path: &Path) -> Result<String, TemplateError> {
    let mut file = File::open(path).map_err(io_err("cannot open", path))?;
    let mut hasher = Sha256::new();
    hasher.update(IMPORT_FORMAT.as_bytes());
    hasher.update(b"\n");
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => hasher.update(&buf[..k]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("cannot read", path)(e)),
        }
    }
    Ok(hex(&hasher.finalize()))
}

fn spawn_error(tool: &'static str, e: io::Error) -> TemplateError {
    if e.kind() == io::ErrorKind::NotFound {
        let fix = match tool {
            "mmdebstrap" => "apt-get install mmdebstrap",
            "tar" => "apt-get install tar",
            _ => "apt-get install util-linux",
        };
        TemplateError::ToolMissing { tool, fix }
    } else {
        TemplateError::Io {
            what: "cannot start",
            path: PathBuf::from(tool),
            err: e,
        }
    }
}

/// Runs `cmd`, handing every line of its stdout and stderr to `on_line` on this thread.
/// The child inherits `lock` and gets `death_signal` if this thread dies. Returns the exit
/// status and the last lines of output.
fn run_logged(
    mut cmd: Command,
    tool: &'static str,
    lock: &Lock,
    death_signal: libc::c_int,
    on_line: &mut dyn FnMut(&str),
) -> Result<(ExitStatus, Vec<String>), TemplateError> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    sys::die_with_parent(&mut cmd, lock.file.as_raw_fd(), death_signal);
    let mut child: Child = cmd.spawn().map_err(|e| spawn_error(tool, e))?;
    let (tx, rx) = mpsc::channel::<String>();
    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    .map(|stream| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stream);
            let mut buf = Vec::new();
            while matches!(reader.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
                let line = String::from_utf8_lossy(&buf);
                if tx
                    .send(line.trim_end_matches(['\n', '\r']).to_string())
                    .is_err()
                {
                    break;
                }
                buf.clear();
            }
        })
    })
    .collect();
    drop(tx);
    let mut tail: std::collections::VecDeque<String> = std::collections::VecDeque::new();
    for line in rx {
        on_line(&line);
        if tail.len() == 20 {
            tail.pop_front();
        }
        tail.push_back(line);
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child.wait().map_err(|e| TemplateError::Io {
        what: "cannot wait for",
        path: PathBuf::from(tool),
        err: e,
    })?;
    Ok((status, tail.into()))
}

fn describe_status(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => status.to_string(),
    }
}

/// What a line of `mmdebstrap --verbose` output means for the bar.
#[derive(Debug, PartialEq)]
enum Event {
    Step(&'static str, f64),
    Fraction(f64),
}

/// Follows mmdebstrap's phases ("I: downloading packages with apt...") and, inside the
/// long ones, counts apt's "Get:", "Unpacking" and "Setting up" lines against the
/// "N newly installed" total, so the bar moves while packages install.
#[derive(Debug, Default)]
struct MmdebstrapPhases {
    phase: Option<usize>,
    total: u64,
    done: u64,
}

/// (prefix after "I: ", step name, start, end, events per package counted in the phase)
const PHASES: &[(&str, &str, f64, f64, u64)] = &[
    (
        "running apt-get update",
        "updating package lists",
        0.00,
        0.04,
        0,
    ),
    (
        "downloading packages",
        "downloading essential packages",
        0.04,
        0.12,
        1,
    ),
    (
        "extracting archives",
        "extracting essential packages",
        0.12,
        0.18,
        0,
    ),
    (
        "installing essential packages",
        "installing essential packages",
        0.18,
        0.35,
        2,
    ),
    (
        "installing remaining packages",
        "installing packages",
        0.35,
        0.97,
        3,
    ),
    (
        "cleaning package lists",
        "cleaning apt caches",
        0.97,
        1.00,
        0,
    ),
];

impl MmdebstrapPhases {
    fn line(&mut self, line: &str) -> Option<Event> {
        if let Some(info) = line.strip_prefix("I: ") {
            let i = PHASES.iter().position(|p| info.starts_with(p.0))?;
            self.phase = Some(i);
            self.done = 0;
            return Some(Event::Step(PHASES[i].1, PHASES[i].2));
        }
        let i = self.phase?;
        if let Some(n) = newly_installed(line) {
            self.total = n;
            return None;
        }
        let counted = line.starts_with("Get:")
            || line.starts_with("Unpacking ")
            || line.starts_with("Setting up ");
        let (_, _, start, end, per) = PHASES[i];
        if !counted || per == 0 || self.total == 0 {
            return None;
        }
        self.done += 1;
        let within = (self.done as f64 / (self.total * per) as f64).min(0.99);
        Some(Event::Fraction(start + (end - start) * within))
    }
}

/// `0 upgraded, 69 newly installed, 0 to remove and 0 not upgraded.` → 69.
fn newly_installed(line: &str) -> Option<u64> {
    let (before, _) = line.split_once(" newly installed")?;
    before.rsplit(' ').next()?.parse().ok()
}

/// Disk space of a tree in bytes, counting each hard-linked inode once.
fn disk_usage(root: &Path) -> Result<u64, TemplateError> {
    let mut total = 0u64;
    let mut seen = HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).map_err(io_err("cannot list", &dir))? {
            let entry = entry.map_err(io_err("cannot list", &dir))?;
            let meta = entry
                .metadata()
                .map_err(io_err("cannot stat", &entry.path()))?;
            if meta.nlink() > 1 && !meta.is_dir() && !seen.insert((meta.dev(), meta.ino())) {
                continue;
            }
            total += meta.blocks() * 512;
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    Ok(total)
}

/// Unmounts everything mounted at or under `path`, then removes it.
fn remove_tree(path: &Path) -> Result<(), TemplateError> {
    let mounts = mounts_under(path);
    for m in &mounts {
        if let Err(e) = sys::umount_detach(m) {
            tracing::warn!(mount = %m.display(), "cannot unmount: {e}");
        }
    }
    if let Some(m) = mounts_under(path).first() {
        // Removing across a mount point would delete the mounted filesystem's files.
        return Err(TemplateError::Io {
            what: "refusing to remove a build with a mount still under it:",
            path: m.clone(),
            err: io::ErrorKind::ResourceBusy.into(),
        });
    }
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("cannot remove", path)(e)),
        _ => Ok(()),
    }
}

/// Mount points at or under `path` in this mount namespace, deepest first.
fn mounts_under(path: &Path) -> Vec<PathBuf> {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape_mountinfo(m)))
        .filter(|m| m.starts_with(path))
        .collect();
    out.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    out.dedup();
    out
}

/// Undoes the octal escapes (`\040` for a space) of /proc/self/mountinfo.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn write_json_atomic(path: &Path, value: &impl Serialize) -> Result<(), TemplateError> {
    let mut bytes = serde_json::to_vec_pretty(value).expect("metadata always serializes");
    bytes.push(b'\n');
    write_atomic(path, &bytes)
}

/// Writes `bytes` to a temporary name beside `path`, fsyncs, renames, fsyncs the directory.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TemplateError> {
    let dir = path.parent().expect("an absolute path");
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    // Unique per write: threads of one process may write the same name at once.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".tmp-{name}-{}-{n}", std::process::id()));
    let write = || -> io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(fs::Permissions::from_mode(0o644))?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&tmp);
        return Err(io_err("cannot write", path)(e));
    }
    fsync_dir(dir)
}

fn fsync_dir(dir: &Path) -> Result<(), TemplateError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("cannot sync", dir))
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn is_lower_hex(b: u8) -> bool {
    b.is_ascii_digit() || (b'a'..=b'f').contains(&b)
}

fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(is_lower_hex)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn one_line(s: &str) -> String {
    let first = s
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let mut out: String = first.chars().take(50).collect();
    if out.len() < first.len() || s.trim().lines().count() > 1 {
        out.push('…');
    }
    out
}

/// The few system calls this room needs, each wrapped once.
mod sys {
    use std::ffi::CString;
    use std::fs::File;
    use std::io;
    use std::os::fd::{AsRawFd, RawFd};
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;
    use std::path::Path;
    use std::process::Command;

    /// Takes an exclusive flock(2); `Ok(false)` if `wait` is false and someone holds it.
    pub fn flock(file: &File, wait: bool) -> io::Result<bool> {
        let op = if wait {
            libc::LOCK_EX
        } else {
            libc::LOCK_EX | libc::LOCK_NB
        };
        loop {
            // SAFETY: flock on a file descriptor this `File` owns; no memory is involved.
            if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
                return Ok(true);
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EWOULDBLOCK) => return Ok(false),
                _ => return Err(e),
            }
        }
    }

    /// Detaches the mount at `path` (MNT_DETACH: gone from the tree now, freed when unused).
    pub fn umount_detach(path: &Path) -> io::Result<()> {
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Flushes the whole filesystem holding `file` to disk.
    pub fn syncfs(file: &File) -> io::Result<()> {
        // SAFETY: syncfs on a file descriptor this `File` owns.
        if unsafe { libc::syncfs(file.as_raw_fd()) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    pub fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() == 0 }
    }

    /// Makes the child of `cmd` get `signal` when the spawning thread dies, and keep
    /// `keep_fd` (a held flock) open across exec, so that the lock stays held for as long
    /// as the child may still write into the build directory.
    ///
    /// The death signal follows the *thread* that spawns: spawn from a thread that waits
    /// for the child (as every caller here does).
    pub fn die_with_parent(cmd: &mut Command, keep_fd: RawFd, signal: libc::c_int) {
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (prctl, getppid, fcntl), allocating nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    // The parent died before prctl took effect.
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                if libc::fcntl(keep_fd, libc::F_SETFD, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_pattern() {
        for ok in ["default", "a", "0", "py3.11_x-y", &"a".repeat(63)] {
            assert!(validate_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Default",
            ".x",
            "-x",
            "_x",
            "a/b",
            "a b",
            "é",
            &"a".repeat(64),
        ] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn packages_follow_debian_policy() {
        for ok in ["jq", "g++", "python3.11", "libc6-dev", "0ad"] {
            assert!(validate_package(ok).is_ok(), "{ok}");
        }
        for bad in ["a", "Jq", "-x", "x;rm", "x y", "x=1.0", "x/bookworm", ""] {
            assert!(validate_package(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn mmdebstrap_phases_move_the_bar() {
        let mut p = MmdebstrapPhases::default();
        assert_eq!(p.line("I: automatically chosen mode: root"), None);
        assert_eq!(
            p.line("I: downloading packages with apt..."),
            Some(Event::Step("downloading essential packages", 0.04))
        );
        assert_eq!(
            p.line("0 upgraded, 4 newly installed, 0 to remove and 0 not upgraded."),
            None
        );
        let Some(Event::Fraction(f)) =
            p.line("Get:1 http://deb.debian.org/debian bookworm/main amd64 x")
        else {
            panic!("Get: lines count");
        };
        assert!((f - 0.06).abs() < 1e-9, "{f}");
        assert!(matches!(
            p.line("I: installing essential packages..."),
            Some(Event::Step(_, _))
        ));
        assert_eq!(p.line("Selecting previously unselected package x."), None);
        assert!(
            matches!(p.line("Unpacking x (1.0) ..."), Some(Event::Fraction(f)) if f > 0.18 && f < 0.35)
        );
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo(r"/a\040b/c\134d"), "/a b/c\\d");
        assert_eq!(unescape_mountinfo(r"/plain\04"), r"/plain\04");
    }

    #[test]
    fn compression_is_detected_by_magic() {
        assert_eq!(compression_flag(&[0x1f, 0x8b, 8, 0, 0, 0]), Some("--gzip"));
        assert_eq!(
            compression_flag(&[0xfd, b'7', b'z', b'X', b'Z', 0]),
            Some("--xz")
        );
        assert_eq!(
            compression_flag(&[0x28, 0xb5, 0x2f, 0xfd, 0, 0]),
            Some("--zstd")
        );
        assert_eq!(compression_flag(b"BZh91A"), Some("--bzip2"));
        assert_eq!(compression_flag(b"etc/\0\0"), None);
    }
}
