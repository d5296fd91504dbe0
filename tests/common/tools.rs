//! Installing and running outside clients (Python packages from PyPI, npm packages) for the
//! tests that drive Locker with them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

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

/// Whether a failed npm command's log says the registry could not be reached.
pub fn npm_unreachable(log: &str) -> bool {
    [
        "ENOTFOUND",
        "EAI_AGAIN",
        "ECONNREFUSED",
        "ETIMEDOUT",
        "ENETUNREACH",
        "ECONNRESET",
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

/// The venv's python with `mcp` importable, or None (with a message) when PyPI is
/// unreachable.
pub fn python_mcp() -> Option<PathBuf> {
    python_venv(
        "mcp-py",
        &["mcp>=2.3,<3"],
        "import mcp, mcp.client.streamable_http; from mcp import Client",
    )
}

/// A venv in `target/<dir>/venv` with `packages` installed (pip specs), made once; its
/// python, or None (with a message) when PyPI is unreachable. `probe` is Python code that
/// succeeds once the packages are importable.
pub fn python_venv(dir: &str, packages: &[&str], probe: &str) -> Option<PathBuf> {
    // Tests run in parallel; one of them makes a venv, the others wait.
    static SETUP: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = SETUP.lock().unwrap_or_else(|e| e.into_inner());
    let venv = target_dir().join(dir).join("venv");
    let py = venv.join("bin/python");
    let ok = |py: &Path| {
        Command::new(py)
            .args(["-c", probe])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ok(&py) {
        return Some(py);
    }
    let (made, log) = run_logged(Command::new("python3").args(["-m", "venv"]).arg(&venv));
    assert!(made, "python3 -m venv {}: {log}", venv.display());
    let started = Instant::now();
    let (installed, log) = run_logged(
        Command::new(&py)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(packages),
    );
    if !installed {
        if pypi_unreachable(&log) {
            eprintln!("SKIP: {packages:?} cannot be installed, PyPI is unreachable:\n{log}");
            return None;
        }
        panic!("pip install {packages:?} failed:\n{log}");
    }
    eprintln!("installed {packages:?} in {:?}", started.elapsed());
    assert!(ok(&py), "{probe:?} fails after pip install {packages:?}");
    Some(py)
}

/// E2B's Python SDKs, unmodified, from PyPI: the newest `e2b` and `e2b-code-interpreter`.
pub fn python_e2b() -> Option<PathBuf> {
    python_venv(
        "e2b-py",
        &["e2b", "e2b-code-interpreter"],
        "import e2b, e2b_code_interpreter",
    )
}

/// An older E2B Python SDK (2.x before 2.51, which still creates with `POST /sandboxes`).
pub fn python_e2b_old() -> Option<PathBuf> {
    python_venv("e2b-py-old", &["e2b==2.50.0"], "import e2b")
}

/// Installs an npm package into `target/<dir>` once (without install scripts: one of them
/// installs git hooks into the enclosing checkout); its directory, or None (with a message)
/// when npm is unreachable.
pub fn npm_package(dir: &str, spec: &str, probe: &str) -> Option<PathBuf> {
    let dir = target_dir().join(dir);
    if dir.join(probe).exists() {
        return Some(dir);
    }
    std::fs::create_dir_all(&dir).expect("create the npm dir");
    let (installed, log) = run_logged(Command::new("npm").current_dir(&dir).args([
        "install",
        "--no-audit",
        "--no-fund",
        "--silent",
        "--ignore-scripts",
        spec,
    ]));
    if !installed {
        if [
            "ENOTFOUND",
            "EAI_AGAIN",
            "ECONNREFUSED",
            "ETIMEDOUT",
            "network",
        ]
        .iter()
        .any(|m| log.contains(m))
        {
            eprintln!("SKIP: {spec} cannot be installed, npm is unreachable:\n{log}");
            return None;
        }
        panic!("npm install {spec} failed:\n{log}");
    }
    assert!(
        dir.join(probe).exists(),
        "no {probe} after npm install {spec}"
    );
    Some(dir)
}
