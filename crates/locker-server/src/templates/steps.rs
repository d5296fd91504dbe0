//! Running a planned build: each step that writes the root filesystem becomes a template
//! of its own in the cache, keyed by the digest of its input, so a rebuild finds every
//! step before the first changed one already made and starts there.
//!
//! A step's digest hashes the previous step's digest, the step as planned (its command,
//! environment, ARGs it sees, working directory and user), and for `COPY` the content of
//! the copied files; a chain that starts at the base template's digest. `RUN` starts a
//! jail machine on the previous step's root filesystem with the build's network policy
//! (default none), runs the command, and makes the step's tree from the parent's
//! hard-linked tree with the machine's writable layer written over it
//! (`locker_runtime::template::{link_tree, apply_upper}`). `COPY` writes context files
//! over the linked tree; `WORKDIR` makes the directory when it is missing. The last step
//! gives the result its run config (a template of its own when that differs from the
//! last written step's).
//!
//! This room owns no route and no record: `builds` reports, `mod.rs` names the result.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use locker_proto::{Chan, ExecSpec};
use locker_runtime::node::MachineSpec;
use locker_runtime::template::{
    apply_upper, copy_into, link_tree, resolve_in_root, RunConfig, Template, TemplateError,
};
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use tokio::sync::mpsc;

use super::builds::Build;
use super::dockerfile::Step;
use crate::state::{new_id, App};

/// What a step digest stands for; change it when the way a step is made changes.
const STEP_FORMAT: &str = "locker-build-step-v1";
/// How long one RUN may take.
const RUN_TIMEOUT_MS: u64 = 60 * 60 * 1000;
/// A RUN machine's shape.
const RUN_CPUS: f64 = 2.0;
const RUN_MEMORY_MB: u64 = 4096;
const RUN_DISK_MB: u64 = 8192;
/// Output of one RUN kept for its result (the log streams all of it).
const RUN_OUTPUT_BYTES: u64 = 1 << 20;
/// Paths of a machine's writable layer that are the machine's, not the step's.
const MACHINE_PATHS: &[&str] = &[
    "etc/resolv.conf",
    "etc/hostname",
    "etc/hosts",
    // The agent's spill files of command output (`LOCKER_OUTPUT_DIR`).
    "var/tmp/locker",
];

/// Everything a build needs besides its steps.
pub struct Job {
    pub tenant: String,
    pub network: Value,
    /// The uploaded context (extracted), for COPY.
    pub context: Option<PathBuf>,
    /// How the build resolves a FROM: a template the tenant may use, or `None`.
    pub base: Template,
    /// Fields of the request that override the Dockerfile's config.
    pub config: RunConfig,
}

/// Runs `steps` (the first one, a FROM, already resolved into `job.base`) and returns the
/// finished template (under no name yet).
pub async fn run(
    app: &Arc<App>,
    build: &Build,
    job: &Job,
    steps: &[(usize, String, Step)],
) -> Result<Template, String> {
    let total = steps.len();
    let started = Instant::now();
    let mut cur = job.base.clone();
    let mut chain = digest_of(&[STEP_FORMAT.as_bytes(), b"from", cur.digest.as_bytes()]);
    let mut bytes = 0u64;
    build.progress(1, total, 0);
    build.log(format!(
        "step 1/{total}: {}: {}",
        steps[0].1,
        short(&cur.digest)
    ));
    for (i, (line, text, step)) in steps.iter().enumerate().skip(1) {
        let n = i + 1;
        let extra = match step {
            Step::Copy { srcs, .. } => {
                let ctx = job.context.as_deref().ok_or_else(|| {
                    format!("line {line}: COPY needs a context: upload one (POST /v1/templates/contexts) and pass `context_id`")
                })?;
                let (ctx, srcs) = (ctx.to_owned(), srcs.clone());
                blocking(move || hash_sources(&ctx, &srcs))
                    .await?
                    .map_err(|e| format!("line {line}: {e}"))?
            }
            _ => String::new(),
        };
        let planned = serde_json::to_string(step).expect("a step serializes");
        chain = digest_of(&[chain.as_bytes(), planned.as_bytes(), extra.as_bytes()]);
        if !step.writes() {
            build.log(format!("step {n}/{total}: {text}"));
            build.progress(n, total, bytes);
            continue;
        }
        if let Step::Workdir { path } = step {
            let exists = resolve_in_root(&cur.rootfs, path, true).is_ok_and(|p| p.is_dir());
            if exists {
                build.log(format!("step {n}/{total}: {text}: exists"));
                build.progress(n, total, bytes);
                continue;
            }
        }
        if let Some(t) = app
            .templates
            .by_digest(&chain)
            .map_err(|e| format!("reading templates: {e}"))?
        {
            build.log(format!("step {n}/{total}: {text}: cached"));
            build.progress(n, total, bytes);
            app.templates.touch(&t.digest);
            cur = t;
            continue;
        }
        build.log(format!("step {n}/{total}: {text}: running"));
        let t0 = Instant::now();
        let made = match step {
            Step::Run {
                argv,
                env,
                workdir,
                user,
            } => run_step(
                app,
                build,
                job,
                &cur,
                &chain,
                argv,
                env,
                workdir,
                user.as_deref(),
            )
            .await
            .map_err(|e| format!("line {line}: {text}: {e}"))?,
            Step::Copy {
                srcs,
                dest,
                chown,
                chmod,
            } => {
                let ctx = job.context.clone().expect("checked above");
                let (parent, srcs, dest, chown, chmod) = (
                    cur.clone(),
                    srcs.clone(),
                    dest.clone(),
                    chown.clone(),
                    *chmod,
                );
                let (store, digest, packages) =
                    (app.templates.clone(), chain.clone(), cur.packages.clone());
                let mut copied = 0u64;
                let t = blocking(move || {
                    store
                        .make_layer(&digest, &parent.digest, packages, RunConfig::default(), |rootfs| {
                            link_tree(&parent.rootfs, rootfs)
                                .map_err(io("linking the parent's tree"))?;
                            copied = copy_step(&ctx, rootfs, &srcs, &dest, chown.as_deref(), chmod)
                                .map_err(|e| TemplateError::BuildFailed {
                                    step: "COPY".into(),
                                    detail: e,
                                })?;
                            Ok(())
                        })
                        .map(|t| (t, copied))
                })
                .await?
                .map_err(|e| format!("line {line}: {text}: {e}"))?;
                bytes += t.1;
                t.0
            }
            Step::Workdir { path } => {
                let (parent, path) = (cur.clone(), path.clone());
                let (store, digest, packages) =
                    (app.templates.clone(), chain.clone(), cur.packages.clone());
                blocking(move || {
                    store.make_layer(&digest, &parent.digest, packages, RunConfig::default(), |rootfs| {
                        link_tree(&parent.rootfs, rootfs)
                            .map_err(io("linking the parent's tree"))?;
                        let at = resolve_in_root(rootfs, &path, true)
                            .map_err(io("resolving the working directory"))?;
                        make_dirs(rootfs, &at).map_err(io("making the working directory"))?;
                        Ok(())
                    })
                })
                .await?
                .map_err(|e| format!("line {line}: {text}: {e}"))?
            }
            Step::From { .. } | Step::Config { .. } => unreachable!("handled above"),
        };
        build.log(format!(
            "step {n}/{total}: done in {:.1}s",
            t0.elapsed().as_secs_f64()
        ));
        build.progress(n, total, bytes);
        cur = made;
    }
    // The result: the last written tree with the build's run config.
    let config = merge_config(&job.base.config, &job.config);
    if config == cur.config {
        build.log(format!("built in {:.1}s", started.elapsed().as_secs_f64()));
        return Ok(cur);
    }
    let cfg_json = serde_json::to_string(&config).expect("a config serializes");
    let digest = digest_of(&[chain.as_bytes(), b"config", cfg_json.as_bytes()]);
    let (store, parent) = (app.templates.clone(), cur.clone());
    let t = blocking(move || {
        store.make_layer(&digest, &parent.digest, parent.packages.clone(), config, |rootfs| {
            link_tree(&parent.rootfs, rootfs).map_err(io("linking the last step's tree"))
        })
    })
    .await?
    .map_err(|e| format!("saving the template: {e}"))?;
    build.log(format!("built in {:.1}s", started.elapsed().as_secs_f64()));
    Ok(t)
}

/// `over`'s fields over `base`'s: its environment added, the rest replaced when set.
pub fn merge_config(base: &RunConfig, over: &RunConfig) -> RunConfig {
    let mut c = base.clone();
    c.env.extend(over.env.clone());
    c.labels.extend(over.labels.clone());
    if over.workdir.is_some() {
        c.workdir = over.workdir.clone();
    }
    if over.user.is_some() {
        c.user = over.user.clone();
    }
    if over.start_cmd.is_some() {
        c.start_cmd = over.start_cmd.clone();
    }
    if over.ready_cmd.is_some() {
        c.ready_cmd = over.ready_cmd.clone();
    }
    for p in &over.exposed_ports {
        if !c.exposed_ports.contains(p) {
            c.exposed_ports.push(*p);
        }
    }
    c
}

/// One RUN: a machine on `parent`, the command, and the step's tree made from the
/// machine's writable layer. The machine goes whatever happens.
#[allow(clippy::too_many_arguments)]
async fn run_step(
    app: &Arc<App>,
    build: &Build,
    job: &Job,
    parent: &Template,
    digest: &str,
    argv: &[String],
    env: &[(String, String)],
    workdir: &str,
    user: Option<&str>,
) -> Result<Template, String> {
    let id = new_id("bld_");
    let mspec = MachineSpec {
        id: id.clone(),
        dir: crate::pool::pool_dir(&app.cfg.data_dir).join(&id),
        template_rootfs: parent.rootfs.clone(),
        cpus: RUN_CPUS,
        memory_mb: RUN_MEMORY_MB,
        disk_mb: RUN_DISK_MB,
        pids: crate::limits::PIDS,
    };
    let m = app
        .node
        .create(mspec)
        .await
        .map_err(|e| format!("starting the build machine failed: {e}"))?;
    let result = async {
        if crate::limits::has_egress(&job.network) {
            app.egress
                .apply(&app.node, &m, &id, &job.tenant, &job.network)
                .await
                .map_err(|e| format!("giving the build machine its network: {e}"))?;
        }
        let spec = ExecSpec {
            call_id: id.clone(),
            argv: argv.to_vec(),
            cwd: Some(workdir.to_string()),
            env: job
                .base
                .config
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .filter(|(k, _)| !env.iter().any(|(e, _)| e == k))
                .chain(env.iter().cloned())
                .collect(),
            stdin: false,
            timeout_ms: Some(RUN_TIMEOUT_MS),
            max_output_bytes: RUN_OUTPUT_BYTES,
            user: user.map(str::to_string),
            stream_output: true,
            pty: None,
            kill_jobs: true,
        };
        let (tx, mut rx) = mpsc::channel::<(Chan, Vec<u8>)>(64);
        let exec = m.agent.exec(spec, None, Some(tx));
        tokio::pin!(exec);
        let mut partial: Vec<u8> = Vec::new();
        let res = loop {
            tokio::select! {
                r = &mut exec => break r,
                Some((_, bytes)) = rx.recv() => log_lines(build, &mut partial, &bytes),
            }
        };
        while let Ok((_, bytes)) = rx.try_recv() {
            log_lines(build, &mut partial, &bytes);
        }
        if !partial.is_empty() {
            build.log(String::from_utf8_lossy(&partial).into_owned());
        }
        let res = res.map_err(|e| format!("the build machine failed: {e}"))?;
        if res.exit_code != Some(0) {
            return Err(match (res.exit_code, &res.signal) {
                (Some(c), _) => format!("the command exited with code {c}"),
                (None, Some(s)) => format!("the command was ended by {s}"),
                _ => format!("the command ended: {:?}", res.reason),
            });
        }
        let upper = m
            .upper_dir()
            .ok_or("the build machine has no writable layer on the host")?;
        let (store, digest, parent) = (app.templates.clone(), digest.to_string(), parent.clone());
        blocking(move || {
            store.make_layer(
                &digest,
                &parent.digest,
                parent.packages.clone(),
                RunConfig::default(),
                |rootfs| {
                    link_tree(&parent.rootfs, rootfs).map_err(io("linking the parent's tree"))?;
                    apply_upper(&upper, rootfs, MACHINE_PATHS)
                        .map_err(io("applying the command's changes"))?;
                    Ok(())
                },
            )
        })
        .await?
        .map_err(|e| format!("saving the step: {e}"))
    }
    .await;
    if let Err(e) = app.node.destroy(&m).await {
        tracing::warn!(machine = %id, "cannot destroy a build machine: {e}");
    }
    app.egress.forget(&id);
    result
}

fn log_lines(build: &Build, partial: &mut Vec<u8>, bytes: &[u8]) {
    partial.extend_from_slice(bytes);
    while let Some(i) = partial.iter().position(|b| *b == b'\n') {
        let line: Vec<u8> = partial.drain(..=i).collect();
        build.log(String::from_utf8_lossy(&line[..line.len() - 1]).into_owned());
    }
    // A line without an end is cut at 8 KiB so one never holds the log back.
    if partial.len() > 8192 {
        build.log(String::from_utf8_lossy(partial).into_owned());
        partial.clear();
    }
}

/// The sources of a COPY in the context: each path, or the matches of a `*`/`?` pattern in
/// its last component; each must exist and stay inside the context.
pub fn expand_sources(ctx: &Path, srcs: &[String]) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for s in srcs {
        let (dir, last) = match s.trim_end_matches('/').rsplit_once('/') {
            Some((d, l)) => (d, l),
            None => ("", s.trim_end_matches('/')),
        };
        if dir.contains(['*', '?', '[']) {
            return Err(format!(
                "{s:?}: patterns are supported in the last path component only"
            ));
        }
        if last.contains(['*', '?']) {
            let base = resolve_in_root(ctx, &format!("/{dir}"), true)
                .map_err(|e| format!("{s:?}: {e}"))?;
            let mut names: Vec<String> = std::fs::read_dir(&base)
                .map_err(|e| format!("{s:?}: {e}"))?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| glob(last.as_bytes(), n.as_bytes()))
                .collect();
            names.sort();
            if names.is_empty() {
                return Err(format!("{s:?} matches nothing in the context"));
            }
            out.extend(names.into_iter().map(|n| base.join(n)));
            continue;
        }
        let p = resolve_in_root(ctx, &format!("/{s}"), true).map_err(|e| format!("{s:?}: {e}"))?;
        if p.symlink_metadata().is_err() {
            return Err(format!("{s:?} is not in the context"));
        }
        out.push(p);
    }
    Ok(out)
}

fn glob(p: &[u8], s: &[u8]) -> bool {
    match (p.first(), s.first()) {
        (None, None) => true,
        (Some(b'*'), _) => glob(&p[1..], s) || (!s.is_empty() && glob(p, &s[1..])),
        (Some(b'?'), Some(_)) => glob(&p[1..], &s[1..]),
        (Some(a), Some(b)) if a == b => glob(&p[1..], &s[1..]),
        _ => false,
    }
}

/// The content hash of a COPY's sources: names, types, modes, symlink targets and bytes.
fn hash_sources(ctx: &Path, srcs: &[String]) -> Result<String, String> {
    let mut h = Sha256::new();
    for p in expand_sources(ctx, srcs)? {
        hash_tree(&p, &p, &mut h).map_err(|e| format!("reading the context: {e}"))?;
        h.update(b"\0next\0");
    }
    Ok(locker_sys::hex::encode(&h.finalize()))
}

fn hash_tree(root: &Path, p: &Path, h: &mut Sha256) -> std::io::Result<()> {
    let m = p.symlink_metadata()?;
    let rel = p.strip_prefix(root).unwrap_or(p);
    h.update(rel.as_os_str().as_encoded_bytes());
    h.update(format!("\0{:o}\0", m.mode()).as_bytes());
    if m.file_type().is_symlink() {
        h.update(std::fs::read_link(p)?.as_os_str().as_encoded_bytes());
    } else if m.is_file() {
        let mut f = std::fs::File::open(p)?;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    } else if m.is_dir() {
        let mut names: Vec<_> = std::fs::read_dir(p)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<_>>()?;
        names.sort();
        for n in names {
            hash_tree(root, &p.join(n), h)?;
        }
    }
    h.update(b"\0");
    Ok(())
}

/// Writes a COPY's sources into `rootfs` as Docker does: a directory's contents go into
/// the destination; a file goes to the destination path, or into it when it is a
/// directory or ends in `/`. Returns the bytes copied.
fn copy_step(
    ctx: &Path,
    rootfs: &Path,
    srcs: &[String],
    dest: &str,
    chown: Option<&str>,
    chmod: Option<u32>,
) -> Result<u64, String> {
    let sources = expand_sources(ctx, srcs)?;
    let owner = chown.map(|c| owner_of(rootfs, c)).transpose()?;
    let into_dir = dest.ends_with('/') || sources.len() > 1;
    let target =
        resolve_in_root(rootfs, dest, true).map_err(|e| format!("destination {dest}: {e}"))?;
    let target_is_dir = target.symlink_metadata().is_ok_and(|m| m.is_dir());
    let mut bytes = 0;
    for src in &sources {
        let m = src
            .symlink_metadata()
            .map_err(|e| format!("{}: {e}", src.display()))?;
        let to = if m.is_dir() {
            target.clone()
        } else if into_dir || target_is_dir {
            target.join(src.file_name().unwrap_or_default())
        } else {
            target.clone()
        };
        let parent = to.parent().unwrap_or(rootfs);
        make_dirs(rootfs, parent).map_err(|e| format!("destination {dest}: {e}"))?;
        if !m.is_dir() || to.symlink_metadata().is_ok_and(|t| !t.is_dir()) {
            remove_existing(&to).map_err(|e| format!("destination {dest}: {e}"))?;
        }
        bytes += copy_into(src, &to, owner, chmod).map_err(|e| format!("copying: {e}"))?;
    }
    Ok(bytes)
}

fn remove_existing(p: &Path) -> std::io::Result<()> {
    match p.symlink_metadata() {
        Err(_) => Ok(()),
        Ok(m) if m.is_dir() => locker_sys::fs::remove_tree(p),
        Ok(_) => std::fs::remove_file(p),
    }
}

/// Makes `dir` (inside `rootfs`, already resolved) and its missing parents, owned by root
/// with mode 0755. A parent that is not a directory is an error.
fn make_dirs(rootfs: &Path, dir: &Path) -> std::io::Result<()> {
    let rel = dir.strip_prefix(rootfs).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "a path outside the tree")
    })?;
    let mut at = rootfs.to_path_buf();
    for c in rel.components() {
        at.push(c);
        match at.symlink_metadata() {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!(
                        "/{} is not a directory",
                        at.strip_prefix(rootfs).unwrap_or(&at).display()
                    ),
                ))
            }
            Err(_) => {
                std::fs::create_dir(&at)?;
                std::os::unix::fs::lchown(&at, Some(0), Some(0))?;
            }
        }
    }
    Ok(())
}

/// `user[:group]` (names or numbers) as ids of the tree's `/etc/passwd` and `/etc/group`.
fn owner_of(rootfs: &Path, spec: &str) -> Result<(u32, u32), String> {
    let (user, group) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let table = |file: &str| -> BTreeMap<String, (u32, u32)> {
        let path = resolve_in_root(rootfs, file, true).unwrap_or_default();
        let text = std::fs::read_to_string(path).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                let id = f.get(2)?.parse().ok()?;
                let gid = f.get(3).and_then(|g| g.parse().ok()).unwrap_or(id);
                Some((f[0].to_string(), (id, gid)))
            })
            .collect()
    };
    let (uid, primary) = match user.parse::<u32>() {
        Ok(n) => (n, n),
        Err(_) => *table("/etc/passwd")
            .get(user)
            .ok_or_else(|| format!("--chown: no user {user:?} in the image's /etc/passwd"))?,
    };
    let gid = match group {
        None => primary,
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => {
                table("/etc/group")
                    .get(g)
                    .ok_or_else(|| format!("--chown: no group {g:?} in the image's /etc/group"))?
                    .0
            }
        },
    };
    if uid >= 65_536 || gid >= 65_536 {
        return Err("--chown: ids inside a machine are below 65536".into());
    }
    Ok((uid, gid))
}

fn digest_of(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    locker_sys::hex::encode(&h.finalize())
}

fn short(d: &str) -> &str {
    d.get(..12).unwrap_or(d)
}

fn io(what: &'static str) -> impl Fn(std::io::Error) -> TemplateError {
    move |e| TemplateError::BuildFailed {
        step: what.into(),
        detail: e.to_string(),
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("a build task failed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        assert!(glob(b"*.py", b"a.py"));
        assert!(!glob(b"*.py", b"a.pyc"));
        assert!(glob(b"a?c*", b"abcdef"));
    }

    #[test]
    fn sources_stay_in_the_context() {
        let d = std::env::temp_dir().join(format!("locker-ctx-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("src")).unwrap();
        std::fs::write(d.join("src/a.py"), "a").unwrap();
        std::fs::write(d.join("src/b.txt"), "b").unwrap();
        std::os::unix::fs::symlink("/etc", d.join("out")).unwrap();
        let got = expand_sources(&d, &["src/*.py".into()]).unwrap();
        assert_eq!(got, vec![d.join("src/a.py")]);
        // `../../etc/passwd` and a symlink to /etc both stay under the context.
        assert!(expand_sources(&d, &["../../etc/passwd".into()]).is_err());
        assert!(expand_sources(&d, &["out/passwd".into()]).is_err());
        let h1 = hash_sources(&d, &["src".into()]).unwrap();
        std::fs::write(d.join("src/b.txt"), "changed").unwrap();
        assert_ne!(h1, hash_sources(&d, &["src".into()]).unwrap());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
