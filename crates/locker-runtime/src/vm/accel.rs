//! Which accelerator a host gets: KVM when a guest kernel boots under it, QEMU's TCG
//! emulator otherwise, and why.

use std::fs;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::assets::*;

/// How guest code is run: hardware virtualization or QEMU's emulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// Which accelerator microVMs get here and why: `LOCKER_VM_ACCEL` if set, else KVM when
/// `/dev/kvm` opens and is not PVM-based (standard guest kernels hang under PVM), else TCG.
pub fn accel() -> (Accel, String) {
    match std::env::var("LOCKER_VM_ACCEL").as_deref() {
        Ok("kvm") => return (Accel::Kvm, "LOCKER_VM_ACCEL=kvm".into()),
        Ok("tcg") => return (Accel::Tcg, "LOCKER_VM_ACCEL=tcg".into()),
        _ => {}
    }
    if !Path::new("/dev/kvm").exists() {
        return (Accel::Tcg, "/dev/kvm is missing (no VT-x/AMD-V or nested virtualization): microVMs are emulated by TCG, which is slow and NOT a security boundary".into());
    }
    if Path::new("/sys/module/kvm_pvm").exists() {
        return (Accel::Tcg, "/dev/kvm is PVM-based (kvm_pvm): standard guest kernels hang under it, so microVMs are emulated by TCG, which is for correctness only and NOT a security boundary".into());
    }
    if fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return (Accel::Tcg, "/dev/kvm cannot be opened (permissions?): microVMs are emulated by TCG, which is NOT a security boundary".into());
    }
    match kvm_boots() {
        Ok(ms) => (Accel::Kvm, format!("/dev/kvm is usable and a standard guest kernel booted under it in {ms} ms: microVMs run under KVM")),
        Err(why) => (Accel::Tcg, format!("/dev/kvm opens but a standard guest kernel did not boot under it ({why}): microVMs are emulated by TCG, which is NOT a security boundary")),
    }
}

/// Proves a standard guest kernel boots under KVM on this host: QEMU boots the guest kernel
/// (no root filesystem) until it panics looking for one and exits. The verdict is cached
/// per kernel and QEMU in `$LOCKER_CACHE_DIR/vm/kvm-probe-*`.
pub(super) fn kvm_boots() -> Result<u64, String> {
    let kernel = kernel_dir().join("vmlinuz");
    let qemu = crate::doctor::which("qemu-system-x86_64").ok_or("QEMU is not installed")?;
    let klen = fs::metadata(&kernel)
        .map_err(|_| "no guest kernel to try".to_owned())?
        .len();
    let qlen = fs::metadata(&qemu).map(|m| m.len()).unwrap_or(0);
    let dir = cache_dir().join("vm");
    let verdict = dir.join(format!("kvm-probe-{klen:x}-{qlen:x}"));
    if let Ok(v) = fs::read_to_string(&verdict) {
        return match v.strip_prefix("ok ") {
            Some(ms) => Ok(ms.trim().parse().unwrap_or(0)),
            None => Err(v.trim().to_owned()),
        };
    }
    let _ = fs::create_dir_all(&dir);
    let log = dir.join(format!(".kvm-probe-{}.log", std::process::id()));
    let t0 = Instant::now();
    let r = (|| {
        let out = fs::File::create(&log).map_err(|e| e.to_string())?;
        let mut child = std::process::Command::new(&qemu)
            .args([
                "-M",
                "microvm,rtc=on",
                "-accel",
                "kvm",
                "-cpu",
                "host",
                "-m",
                "128",
            ])
            .args([
                "-nodefaults",
                "-no-user-config",
                "-display",
                "none",
                "-no-reboot",
                "-serial",
                "stdio",
            ])
            .arg("-kernel")
            .arg(&kernel)
            .args(["-append", "console=ttyS0 panic=-1 reboot=t"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start QEMU: {e}"))?;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if t0.elapsed() > Duration::from_secs(20) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err("the guest hung for 20 s".to_owned());
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => return Err(e.to_string()),
            }
        }
        let text = fs::read_to_string(&log).unwrap_or_default();
        if text.contains("Kernel panic") || text.contains("VFS") {
            Ok(t0.elapsed().as_millis() as u64)
        } else {
            Err("QEMU exited before the guest kernel finished booting".to_owned())
        }
    })();
    let _ = fs::remove_file(&log);
    let _ = fs::write(
        &verdict,
        match &r {
            Ok(ms) => format!("ok {ms}"),
            Err(e) => e.clone(),
        },
    );
    r
}
