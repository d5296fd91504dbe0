//! Where a node finds the programs it runs: the `locker` binary (the microVM's file
//! server), the jail's shim (`locker-jail`, else `locker` again) and the static
//! `locker-agent`. It starts nothing but `locker-jail --build-id`, once.

use std::fs;
use std::path::{Path, PathBuf};

use super::NodeError;

/// Where a node keeps things and which programs it runs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The `locker` binary (`__vm-fs`, the microVMs' file server).
    pub init_exe: PathBuf,
    /// What runs a jail's shim (`<shim_exe> __jail-init <spec>`): see [`find_shim`].
    pub shim_exe: PathBuf,
    /// The static `locker-agent` binary.
    pub agent_exe: PathBuf,
}

impl NodeConfig {
    /// The current executable as init, the shim found by [`find_shim`] and the agent
    /// found by [`find_agent`].
    pub fn from_current_exe() -> Result<Self, NodeError> {
        let init_exe = std::env::current_exe().map_err(NodeError::NoInitExe)?;
        let agent_exe = find_agent(&init_exe).ok_or(NodeError::NoAgent)?;
        Ok(Self {
            shim_exe: find_shim(&init_exe),
            init_exe,
            agent_exe,
        })
    }
}

/// The program a jail's shim runs as: `$LOCKER_JAIL_BIN` or `locker-jail` beside `exe`,
/// if it says it is built from the same shim code as this process
/// ([`crate::jail::SHIM_BUILD`], asked with `--build-id`); else `exe` itself, which
/// runs `__jail-init` too.
///
/// `locker-jail` holds the shim and nothing else, so it starts in about half the CPU
/// time of the full `locker` (0.6 against 1.5 ms: a fiftieth of the relocations, a fifth
/// of the page faults), once per machine. One from another build (a stale binary left
/// in a target directory, a partial copy) is never used: its idea of the jail's spec
/// could differ from the server's.
pub fn find_shim(exe: &Path) -> PathBuf {
    let candidate = std::env::var_os("LOCKER_JAIL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| exe.with_file_name("locker-jail"));
    if !candidate.is_file() {
        return exe.to_owned();
    }
    let said = std::process::Command::new(&candidate)
        .arg("--build-id")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    match said {
        Ok(o)
            if o.status.success()
                && o.stdout.trim_ascii() == crate::jail::SHIM_BUILD.as_bytes() =>
        {
            candidate
        }
        _ => {
            tracing::warn!(
                shim = %candidate.display(),
                "not the same build as this locker: jails start with `locker __jail-init` instead (rebuild both: cargo build --release -p locker-cli -p locker-jail)"
            );
            exe.to_owned()
        }
    }
}

/// Finds the agent: `$LOCKER_AGENT_BIN`, the static build in the cargo target directory
/// above `exe`, beside `exe`, or `/usr/local/lib/locker/locker-agent`. Only a statically
/// linked binary qualifies: the agent runs inside any root filesystem, with or without a
/// C library (a plain `cargo build` leaves a dynamic `locker-agent` beside `locker`).
pub fn find_agent(exe: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("LOCKER_AGENT_BIN") {
        return Some(PathBuf::from(p));
    }
    let mut candidates = Vec::new();
    for dir in exe.ancestors().skip(1).take(4) {
        for profile in ["release", "debug"] {
            candidates.push(
                dir.join("x86_64-unknown-linux-gnu")
                    .join(profile)
                    .join("locker-agent"),
            );
        }
        candidates.push(dir.join("locker-agent"));
    }
    candidates.push(PathBuf::from("/usr/local/lib/locker/locker-agent"));
    candidates.into_iter().find(|p| is_static_elf(p))
}

/// Whether `path` is an ELF executable without a program interpreter (statically linked).
pub fn is_static_elf(path: &Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = fs::File::open(path) else {
        return false;
    };
    let mut h = [0u8; 64];
    if f.read_exact(&mut h).is_err() || &h[..4] != b"\x7fELF" || h[4] != 2 {
        return false;
    }
    let phoff = u64::from_le_bytes(h[0x20..0x28].try_into().expect("8 bytes"));
    let phentsize = u16::from_le_bytes([h[0x36], h[0x37]]) as usize;
    let phnum = u16::from_le_bytes([h[0x38], h[0x39]]) as usize;
    if phentsize < 4 || phnum > 256 || f.seek(SeekFrom::Start(phoff)).is_err() {
        return false;
    }
    let mut ph = vec![0u8; phentsize * phnum];
    if f.read_exact(&mut ph).is_err() {
        return false;
    }
    const PT_INTERP: u32 = 3;
    !ph.chunks(phentsize)
        .any(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]]) == PT_INTERP)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_shim_of_another_build_is_never_used() {
        let dir = std::env::temp_dir().join(format!("locker-shim-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("locker");
        let shim = dir.join("locker-jail");
        // None beside it: the exe itself.
        assert_eq!(super::find_shim(&exe), exe);
        let write = |id: &str| {
            use std::os::unix::fs::PermissionsExt;
            // Written elsewhere and renamed in: a file being written cannot be executed.
            let tmp = dir.join("shim.tmp");
            std::fs::write(&tmp, format!("#!/bin/sh\necho {id}\n")).unwrap();
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::fs::rename(&tmp, &shim).unwrap();
        };
        write("0123456789abcdef");
        assert_eq!(
            super::find_shim(&exe),
            exe,
            "another build's shim was taken"
        );
        write(crate::jail::SHIM_BUILD);
        assert_eq!(super::find_shim(&exe), shim);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn static_binaries_are_told_apart() {
        let me = std::env::current_exe().unwrap();
        assert!(
            !super::is_static_elf(&me),
            "test binaries are dynamically linked"
        );
        assert!(!super::is_static_elf(std::path::Path::new("/etc/passwd")));
        if std::path::Path::new("/sbin/ldconfig").exists() {
            assert!(
                super::is_static_elf(std::path::Path::new("/sbin/ldconfig")),
                "Debian's ldconfig is static"
            );
        }
    }
}
