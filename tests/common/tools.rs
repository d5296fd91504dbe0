//! Installing and running outside clients (Python packages from PyPI, npm packages) for the
//! tests that drive Locker with them.

use std::path::PathBuf;
use std::process::Command;

/// The cargo target directory, where test tool installs are cached.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::root().join("target"))
}

/// Whether a failed pip install's log says the registry could not be reached.
pub fn pypi_unreachable(log: &str) -> bool {
    [
        "Network is unreachable",
        "Temporary failure in name resolution",
        "Failed to establish a new connection",
        "Max retries exceeded",
        "Could not find a version that satisfies",
    ]
    .iter()
    .any(|m| log.contains(m))
}

/// Runs `cmd` to its end: whether it succeeded, and its stdout and stderr together.
pub fn run_logged(cmd: &mut Command) -> (bool, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), log)
}
