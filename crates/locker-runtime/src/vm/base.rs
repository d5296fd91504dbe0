//! Bases: one VM per (assets, template, shape) booted once and saved; every machine of
//! that kind restores it. Stale bases are evicted.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::agent::AgentClient;

use super::assets::*;
use super::qemu::*;
use super::qmp::*;
use super::*;

/// A saved, booted VM every machine of its shape restores.
#[derive(Debug, Clone)]
pub struct Base {
    pub dir: PathBuf,
    pub shape: Shape,
    pub template_image: PathBuf,
}

impl Base {
    pub(super) fn ram(&self) -> PathBuf {
        self.dir.join("ram")
    }
    pub(super) fn state(&self) -> PathBuf {
        self.dir.join("state")
    }
    pub(super) fn disk(&self) -> PathBuf {
        self.dir.join("disk.img")
    }
}

/// The base for `template_rootfs` and `shape`: made now (a cold boot, seconds under TCG)
/// unless it exists. Concurrent callers (also in other processes) wait for one boot.
pub async fn ensure_base(
    a: &Assets,
    template_rootfs: &Path,
    shape: Shape,
) -> Result<Base, VmError> {
    let (a2, rootfs) = (a.clone(), template_rootfs.to_owned());
    let (image, key) =
        tokio::task::spawn_blocking(move || -> Result<(PathBuf, String), VmError> {
            let image = template_image(&rootfs)?;
            let mut h = Sha256::new();
            h.update(a2.digest.as_bytes());
            h.update(image.as_os_str().as_encoded_bytes());
            h.update(
                format!(
                    "{}-{}-{}{}",
                    shape.memory_mb,
                    shape.vcpus,
                    shape.disk_mb,
                    if shape.net { "-net" } else { "" }
                )
                .as_bytes(),
            );
            Ok((image, hex(&h.finalize()[..8])))
        })
        .await
        .map_err(task("template image"))??;
    let root = Path::new(BASE_DIR);
    fs::create_dir_all(root).map_err(setup(format!("create {BASE_DIR}")))?;
    let base = Base {
        dir: root.join(&key),
        shape,
        template_image: image,
    };
    if base.dir.join("ready").exists() {
        return Ok(base);
    }
    let lock_path = root.join(format!("{key}.lock"));
    let lock = tokio::task::spawn_blocking(move || lock_file(&lock_path))
        .await
        .map_err(task("base lock"))??;
    if base.dir.join("ready").exists() {
        return Ok(base);
    }
    let t0 = Instant::now();
    let tmp = root.join(format!("{key}.boot"));
    // A server killed in the middle of this boot left its QEMU behind (we hold the lock,
    // so nobody else boots this base now).
    kill_qemus_under(&tmp);
    let _ = fs::remove_dir_all(&tmp);
    let r = boot_base(a, &base, &tmp).await;
    if let Err(e) = r {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let _ = fs::remove_dir_all(&base.dir);
    fs::rename(&tmp, &base.dir).map_err(setup("install the base"))?;
    fs::write(base.dir.join("ready"), a.digest.as_bytes()).map_err(setup("mark the base ready"))?;
    evict_stale_bases(&a.digest);
    drop(lock);
    tracing::info!(base = %key, ms = t0.elapsed().as_millis() as u64, accel = a.accel.as_str(), "microVM base booted and saved");
    Ok(base)
}

/// Kills every process whose command line names `dir` (QEMUs of an interrupted base boot).
pub(super) fn kill_qemus_under(dir: &Path) {
    let needle = dir.as_os_str().as_encoded_bytes();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmdline.windows(needle.len()).any(|w| w == needle) {
            tracing::warn!(pid, dir = %dir.display(), "killing the QEMU of an interrupted base boot");
            let _ = crate::sys::kill(pid, libc::SIGKILL);
        }
    }
}

/// Removes bases made from other assets (an earlier agent, kernel or QEMU) over an hour
/// ago: this server never restores them, and their RAM files hold tmpfs memory. Machines still running from
/// one keep their private map of its RAM file; removing the file does not disturb them.
pub(super) fn evict_stale_bases(current: &str) {
    for e in fs::read_dir(BASE_DIR).into_iter().flatten().flatten() {
        let ready = e.path().join("ready");
        let Ok(made_by) = fs::read_to_string(&ready) else {
            continue;
        };
        // An hour's grace: another server on this host (another version) may still be
        // restoring from it.
        let old = fs::metadata(&ready)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() > Duration::from_secs(3600));
        if !made_by.is_empty() && made_by != current && old {
            tracing::info!(base = %e.path().display(), "removing a microVM base of older assets");
            let _ = fs::remove_dir_all(e.path());
            let _ = fs::remove_file(e.path().with_extension("lock"));
        }
    }
}

async fn boot_base(a: &Assets, base: &Base, dir: &Path) -> Result<(), VmError> {
    fs::create_dir_all(dir).map_err(setup(format!("create {}", dir.display())))?;
    let ram = dir.join("ram");
    let f = fs::File::create(&ram).map_err(setup("create the RAM file"))?;
    f.set_len(super::qemu::ram_mb(a.qemu_version, base.shape) << 20)
        .map_err(setup("size the RAM file"))?;
    drop(f);
    crate::disk::make_from_blank(
        &dir.join("disk.img"),
        base.shape.disk_mb,
        &crate::machine::blank_disks_dir(),
    )
    .map_err(setup("make the base's disk"))?;
    // The blank overlay of this disk size, made now (once per size on the host), so that
    // no machine started from a snapshot runs `qemu-img`. Without qemu-img only those fail.
    if let Err(e) = crate::disk::ensure_qcow2_blank(
        base.shape.disk_mb << 20,
        &crate::machine::blank_disks_dir(),
    ) {
        tracing::warn!(error = %e, "no blank qcow2 overlay: microVMs cannot start from snapshots");
    }
    let disk = [dir.join("disk.img")];
    let mut child = spawn_qemu(
        a,
        base.shape,
        Launch {
            dir,
            disk: &disk,
            template_image: &base.template_image,
            ram: &ram,
            share: true,
            incoming: None,
            uid: None,
            cgroup_procs: Vec::new(),
            net: None,
        },
    )?;
    let r = async {
        let agent = AgentClient::connect(&dir.join("agent.sock"), BOOT_TIMEOUT)
            .await
            .map_err(|e| VmError::Qemu {
                step: "the base VM did not start its agent",
                detail: format!("{e}; {}", logs_of(dir)),
            })?;
        // Warm the guest's page cache with what every first command touches (the shell,
        // the C library, the agent's exec path): each restored VM starts with it cached.
        let warm = locker_proto::ExecSpec {
            call_id: "warm-up".into(),
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                "/usr/bin/true; ls / >/dev/null; cat /etc/os-release >/dev/null".into(),
            ],
            max_output_bytes: 4096,
            timeout_ms: Some(60_000),
            ..Default::default()
        };
        let _ = agent.exec(warm, None, None).await;
        agent.flush().await?;
        drop(agent);
        // Let the guest see the host leave, so every restored VM starts out waiting for
        // its host rather than mid-connection.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (d, state) = (dir.to_owned(), dir.join("state"));
        tokio::task::spawn_blocking(move || -> Result<(), VmError> {
            let mut q = Qmp::connect(&d.join("qmp.sock"), Duration::from_secs(5))?;
            q.cmd("stop", json!({}))?;
            let out = fs::File::create(&state).map_err(setup("create the state file"))?;
            q.migrate_to(&out)?;
            out.sync_all().map_err(setup("sync the state file"))?;
            let _ = q.cmd("quit", json!({}));
            Ok(())
        })
        .await
        .map_err(task("base save"))?
    }
    .await;
    let _ = child.kill().await;
    r?;
    // Every VM maps the RAM file; none may change it (QEMU before 8.2 opens it read-write
    // even for a private map, so there it stays writable: see docs/security.md).
    let mode = if a.ram_readonly() { 0o444 } else { 0o666 };
    fs::set_permissions(&ram, fs::Permissions::from_mode(mode))
        .map_err(setup("chmod the RAM file"))?;
    for f in ["state", "disk.img"] {
        fs::set_permissions(dir.join(f), fs::Permissions::from_mode(0o444))
            .map_err(setup("chmod the base"))?;
    }
    for f in ["agent.sock", "qmp.sock"] {
        let _ = fs::remove_file(dir.join(f));
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(setup("chmod the base"))?;
    Ok(())
}
