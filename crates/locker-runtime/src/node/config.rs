//! Where a node finds the programs it runs: the `locker` binary (the jail's shim, the file
//! server) and the static `locker-agent`. It starts nothing.

use std::fs;
use std::path::{Path, PathBuf};

use super::NodeError;

/// Where a node keeps things and which programs it runs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The `locker` binary that runs `__jail-init`.
    pub init_exe: PathBuf,
    /// The static `locker-agent` binary.
    pub agent_exe: PathBuf,
}

impl NodeConfig {
    /// The current executable as init, and the agent found by [`find_agent`].
    pub fn from_current_exe() -> Result<Self, NodeError> {
        let init_exe = std::env::current_exe().map_err(NodeError::NoInitExe)?;
        let agent_exe = find_agent(&init_exe).ok_or(NodeError::NoAgent)?;
        Ok(Self {
            init_exe,
            agent_exe,
        })
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
