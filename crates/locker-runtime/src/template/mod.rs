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
//! tarball's digest hashes its bytes with [`IMPORT_FORMAT`]; an image's hashes its config
//! digest with [`IMAGE_FORMAT`].
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
//!
//! Rooms: `spec` (a spec and its digest), `store` (the cache: names, metadata, locks),
//! `build` (mmdebstrap and run steps), `extract` (importing a tarball), `image` (OCI images
//! from a registry or an archive, unpacked layer by layer), `layer` (step templates made
//! on a parent's tree), `prune` (bounding the step cache), `progress` (what a build
//! reports), `fsutil` (this room's errors around `locker-sys`'s atomic writes and tree
//! removal, and the mounts under a path); its system calls are `crate::sys`'s.

mod build;
mod extract;
mod fsutil;
mod image;
mod layer;
mod progress;
mod prune;
mod spec;
mod store;
#[cfg(test)]
mod tests;

pub use image::{
    ImageLimits, ImageSource, RegistryAuth, IMAGE_FORMAT, MAX_DOWNLOAD_ENV, MAX_UNPACKED_ENV,
};
pub use layer::{apply_upper, copy_into, link_tree, resolve_in_root, Applied};
pub use progress::{NoProgress, Progress, StderrProgress};
pub use prune::{
    Pruned, StepCacheLimits, STEP_CACHE_MAX_AGE_ENV, STEP_CACHE_MAX_BYTES_ENV,
    STEP_CACHE_MAX_COUNT_ENV,
};
pub use spec::{builtin_spec, code_interpreter_spec, default_spec, validate_name, TemplateSpec};
pub use store::TemplateStore;

use serde::{Deserialize, Serialize};
use std::io;

use crate::sys;
use std::path::{Path, PathBuf};

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
    "sudo",
];

/// The user E2B's SDKs run commands as unless told otherwise (and Locker's `user` option
/// can name): `user`, uid 1000, home `/home/user`, passwordless `sudo`.
pub const DEFAULT_USER: &str = "user";
/// The build step of the default templates that makes [`DEFAULT_USER`]'s account.
pub const DEFAULT_USER_STEP: &str =
    "useradd --create-home --shell /bin/bash --uid 1000 --user-group user \
&& printf 'user ALL=(ALL:ALL) NOPASSWD: ALL\\n' > /etc/sudoers.d/user \
&& chmod 0440 /etc/sudoers.d/user";

/// The name of the template built from [`code_interpreter_spec`].
pub const CODE_INTERPRETER_TEMPLATE: &str = "code-interpreter";
/// What the `code-interpreter` template adds to [`DEFAULT_PACKAGES`]: a Jupyter kernel for
/// Python (the code interpreter's contexts) and the usual data libraries, R's kernel, and
/// what Locker's own kernels run on besides bash and Node (TypeScript's compiler, a JDK with
/// JShell), all Debian's own: the languages of E2B's code-interpreter template.
pub const CODE_INTERPRETER_PACKAGES: &[&str] = &[
    "python3-ipykernel",
    "python3-jupyter-client",
    "node-typescript",
    "r-cran-irkernel",
    "openjdk-17-jdk-headless",
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
    "python3-scipy",
    "python3-requests",
    "python3-pil",
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
    /// An image (archive, manifest, config or layer) that is malformed or hostile.
    #[error("bad image: {0}")]
    BadImage(String),
    /// An image over the size limits.
    #[error("image too big: {0}")]
    ImageTooBig(String),
    /// The registry could not be reached, refused, or sent something that does not check.
    #[error("registry: {0}")]
    Registry(String),
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
    /// How sandboxes made from it start: environment, working directory, user, start and
    /// ready commands (an image's config, a Dockerfile's `ENV`/`WORKDIR`/`USER`/`CMD`, or
    /// a build request's fields); empty for package templates.
    #[serde(default)]
    pub config: RunConfig,
}

/// What a template asks of the sandboxes made from it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunConfig {
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub env: std::collections::BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// A user name or `uid[:gid]` inside the template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Started in the background when a sandbox starts (an image's entrypoint + cmd).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<Vec<String>>,
    /// Run until it succeeds before the sandbox counts as `running`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exposed_ports: Vec<u16>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
}
