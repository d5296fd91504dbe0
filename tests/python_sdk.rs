//! The Python SDK (`sdk/python`, package `locker`) end to end: its pytest suite
//! (`sdk/python/tests/`) against a real `locker serve` — the HTTP client, Anthropic's bash
//! and text editor handlers, the portable function tools and OpenAI's shell tool, the agent
//! loop against scripted stand-in models (parallel tool calls, a failing tool, an endless
//! loop stopped by the iteration cap, truncation into a file), the background-process
//! tools and descriptions that follow the sandbox's network policy, snapshots, network and
//! metadata changes, `examples/python_agent.py` against a stand-in of the Messages API
//! (`locker.testing`), `--offline` and `--help`, and `pip install` from the checkout
//! (distribution `locker-sandbox`), which must leave the checkout clean.
//!
//! pytest and the SDK (`pip install -e sdk/python`) go into `target/python-sdk/venv` on
//! first use; when PyPI is unreachable the test is skipped with a message saying so; any
//! other failure fails it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use locker_tests::become_subreaper;
use locker_tests::server::Server;
use locker_tests::tools::{pypi_unreachable as unreachable, run_logged, target_dir};

/// The venv's python with pytest, the OpenAI Agents SDK and this checkout's SDK importable, or None (with a
/// message) when PyPI is unreachable.
fn python_sdk() -> Option<PathBuf> {
    let venv = target_dir().join("python-sdk/venv");
    let py = venv.join("bin/python");
    let src = locker_tests::root().join("sdk/python/src");
    // Importable, from this checkout (an editable install of another one would not do), and
    // under the distribution name `locker-sandbox` (an older install was named `locker`).
    let check = format!(
        "import pytest, locker, agents.sandbox, os, sys, importlib.metadata as m; m.version('locker-sandbox'); sys.exit(0 if os.path.realpath(locker.__file__).startswith(os.path.realpath({:?})) else 1)",
        src.to_str().expect("utf-8 path")
    );
    let ok = |py: &Path| {
        Command::new(py)
            .args(["-c", &check])
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ok(&py) {
        return Some(py);
    }
    if !py.exists() {
        let (made, log) = run_logged(Command::new("python3").args(["-m", "venv"]).arg(&venv));
        assert!(made, "python3 -m venv {}: {log}", venv.display());
    }
    let started = Instant::now();
    // An install under the old name would shadow or confuse the new one; its absence is fine.
    let _ = run_logged(Command::new(&py).args([
        "-m",
        "pip",
        "uninstall",
        "--quiet",
        "--yes",
        "locker",
    ]));
    let (installed, log) = run_logged(
        Command::new(&py)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "pytest>=7",
                // The OpenAI Agents SDK, for `locker.openai_agents` (its SandboxClient) and its test.
                "openai-agents>=0.24",
                "-e",
            ])
            .arg(locker_tests::root().join("sdk/python")),
    );
    if !installed {
        if unreachable(&log) {
            eprintln!("SKIP: pytest and the SDK cannot be installed, PyPI is unreachable:\n{log}");
            return None;
        }
        panic!("pip install pytest -e sdk/python failed:\n{log}");
    }
    eprintln!("installed pytest and the SDK in {:?}", started.elapsed());
    assert!(
        ok(&py),
        "pytest or this checkout's `locker` is not importable after pip install"
    );
    Some(py)
}

#[test]
fn python_sdk_pytest_against_a_real_server() {
    become_subreaper();
    let Some(py) = python_sdk() else { return };
    let srv = Server::start();
    let started = Instant::now();
    let (ok, log) = run_logged(
        Command::new(&py)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"])
            .arg(locker_tests::root().join("sdk/python/tests"))
            // The code contexts' tests need the code-interpreter template: tests/code.rs
            // builds it and runs that file itself.
            .arg("--ignore")
            .arg(locker_tests::root().join("sdk/python/tests/test_code.py"))
            .current_dir(locker_tests::root().join("sdk/python"))
            .env("LOCKER_URL", &srv.url)
            .env("LOCKER_API_KEY", &srv.api_key)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("ANTHROPIC_API_KEY")
            .env_remove("ANTHROPIC_BASE_URL"),
    );
    eprintln!("pytest took {:?}:\n{log}", started.elapsed());
    assert!(ok, "the Python SDK's tests failed:\n{log}");
    assert!(
        log.contains(" passed") && !log.contains("skipped") && !log.contains("SKIPPED"),
        "every test ran (none skipped):\n{log}"
    );
}
