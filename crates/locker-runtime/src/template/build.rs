//! Building a template: mmdebstrap into a temporary directory, the run steps inside it,
//! and the phases a build reports.

use std::fs::{self, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;

use super::fsutil::*;
use super::progress::*;
use super::spec::*;
use super::store::*;
use super::*;

impl TemplateStore {
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

    pub(super) fn build_unfinished(
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

    pub(super) fn build_locked(
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
}

pub(super) fn check_build_host() -> Result<(), TemplateError> {
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

pub(super) fn find_in_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// A command with a clean environment: PATH, HOME, a UTF-8 locale, and proxies.
pub(super) fn clean_command(program: &str) -> Command {
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

pub(super) fn run_mmdebstrap(
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
    // The man pages are filtered out, but some packages' scripts register theirs as
    // alternatives and fail without the directory (a JDK's `java.1.gz`); with it there,
    // alternatives leave their (dangling) links to the pages there. Not a new SPEC_FORMAT:
    // a spec that built before builds the same but for those links.
    cmd.arg("--setup-hook=mkdir -p \"$1/usr/share/man/man1\"");
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
pub(super) fn run_step(
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
pub(super) fn finish_built_rootfs(rootfs: &Path) -> Result<(), TemplateError> {
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
pub(super) fn ensure_standard_dirs(rootfs: &Path) -> Result<(), TemplateError> {
    ensure_dir(rootfs, "tmp", 0o1777)?;
    ensure_dir(rootfs, "var", 0o755)?;
    ensure_dir(rootfs, "var/tmp", 0o1777)?;
    ensure_dir(rootfs, "root", 0o700)
}

/// The path of `rel` inside `rootfs` if no component of it is a symlink (so that writing
/// there cannot land outside the root filesystem); `None` otherwise.
pub(super) fn contained(rootfs: &Path, rel: &str) -> Option<PathBuf> {
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
pub(super) fn ensure_dir(rootfs: &Path, rel: &str, mode: u32) -> Result<(), TemplateError> {
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
pub(super) fn clear_dir(rootfs: &Path, rel: &str) -> Result<(), TemplateError> {
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
pub(super) fn write_inside(
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

pub(super) fn remove_if_exists(path: &Path) -> Result<(), TemplateError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("cannot remove", path)(e)),
        _ => Ok(()),
    }
}

pub(super) fn spawn_error(tool: &'static str, e: io::Error) -> TemplateError {
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
pub(super) fn run_logged(
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

pub(super) fn describe_status(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => status.to_string(),
    }
}

/// What a line of `mmdebstrap --verbose` output means for the bar.
#[derive(Debug, PartialEq)]
pub(super) enum Event {
    Step(&'static str, f64),
    Fraction(f64),
}

/// Follows mmdebstrap's phases ("I: downloading packages with apt...") and, inside the
/// long ones, counts apt's "Get:", "Unpacking" and "Setting up" lines against the
/// "N newly installed" total, so the bar moves while packages install.
#[derive(Debug, Default)]
pub(super) struct MmdebstrapPhases {
    pub(super) phase: Option<usize>,
    pub(super) total: u64,
    pub(super) done: u64,
}

/// (prefix after "I: ", step name, start, end, events per package counted in the phase)
pub(super) const PHASES: &[(&str, &str, f64, f64, u64)] = &[
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
    pub(super) fn line(&mut self, line: &str) -> Option<Event> {
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
pub(super) fn newly_installed(line: &str) -> Option<u64> {
    let (before, _) = line.split_once(" newly installed")?;
    before.rsplit(' ').next()?.parse().ok()
}
