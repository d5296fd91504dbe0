//! The TypeScript SDK (`sdk/typescript`, npm package `locker-sandbox`) end to end: its
//! `node --test` suite (`sdk/typescript/test/`) against a real `locker serve` — sandboxes
//! (create, get, list with filters, exec's typed result with timeouts as results, TTL,
//! network and metadata, pause and resume, snapshots and forks, `await using`), streaming
//! exec and its cancellation by an `AbortSignal` (the command is killed in the machine),
//! background processes and streamed stdin, files as text, bytes, streams and tar archives,
//! volumes and runs with each commit mode, ports and preview URLs, the terminal (PTY),
//! MCP servers in a sandbox, templates, call records and usage, typed errors and GET-only
//! retries, what `npm pack` ships, every operation of the server's `/openapi.json` covered
//! or explained, docs/sdks.md's parity table checked against the CLI, the Python SDK, this
//! package and the MCP server — the frameworks' doors with the frameworks' real packages
//! and scripted stand-ins for the model (Anthropic's SDK and tool loop, the Vercel AI SDK's
//! `generateText`, the OpenAI Agents SDK's `SandboxAgent` on `LockerSandboxClient`), one
//! sandbox per hosted-loop session, and the examples (seed 002's, the frameworks', the
//! session worker) run as programs; plus `tsc --noEmit` over the examples. A second test
//! runs `test/template/` (code contexts and the doors' `run_code`) after building the
//! `code-interpreter` template.
//!
//! The package's devDependencies (`typescript`, `@types/node`, the frameworks) are
//! installed with `npm ci` into `sdk/typescript/node_modules` (ignored by git) on first use; when the npm registry
//! is unreachable the test is skipped with a message saying so; any other failure fails it.
//! Node itself comes from the distribution (`scripts/setup test`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use locker_tests::become_subreaper;
use locker_tests::server::Server;
use locker_tests::tools::{npm_unreachable, run_logged};

fn package() -> PathBuf {
    locker_tests::root().join("sdk/typescript")
}

/// Node's major version, failing the test with what to run when Node is missing or older
/// than 18 (the first with a global `fetch`).
fn node_major() -> u32 {
    let out = Command::new("node").arg("--version").output().unwrap_or_else(|e| {
        panic!("node is not installed ({e}): `scripts/setup test` installs it (Debian's nodejs and npm)")
    });
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let major: u32 = v
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("node --version said {v:?}"));
    assert!(
        major >= 18,
        "node {v} is too old: the SDK needs Node 18 or later (fetch)"
    );
    major
}

/// `sdk/typescript/node_modules` with the locked devDependencies, or None (with a message)
/// when the npm registry is unreachable.
fn dev_dependencies(pkg: &Path) -> Option<()> {
    // The tests of this binary run at once: one npm ci in the package at a time (a second
    // one would delete the first's node_modules under it).
    static NPM: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = NPM.lock().unwrap_or_else(|e| e.into_inner());
    let tsc = pkg.join("node_modules/typescript/bin/tsc");
    let types = pkg.join("node_modules/@types/node/package.json");
    // npm ci writes this copy of the lock last; an older install of another lock is redone.
    let installed_lock = pkg.join("node_modules/.package-lock.json");
    let current = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if tsc.exists()
        && types.exists()
        && current(&installed_lock) >= current(&pkg.join("package-lock.json"))
    {
        return Some(());
    }
    let started = Instant::now();
    let (installed, log) = run_logged(Command::new("npm").current_dir(pkg).args([
        "ci",
        "--no-audit",
        "--no-fund",
        "--ignore-scripts",
    ]));
    if !installed {
        if npm_unreachable(&log) {
            eprintln!("SKIP: the TypeScript SDK's devDependencies cannot be installed, the npm registry is unreachable:\n{log}");
            return None;
        }
        panic!("npm ci in sdk/typescript failed:\n{log}");
    }
    eprintln!("npm ci took {:?}", started.elapsed());
    assert!(tsc.exists(), "no typescript after npm ci:\n{log}");
    Some(())
}

/// Runs the package's TypeScript compiler with `project`; fails the test with its output.
fn tsc(pkg: &Path, project: &str) {
    let (ok, log) = run_logged(Command::new("node").current_dir(pkg).args([
        "node_modules/typescript/bin/tsc",
        "-p",
        project,
    ]));
    assert!(ok, "tsc -p {project} failed:\n{log}");
}

/// The flags that give `node` a global `WebSocket` (for the PTY), or None when it has none
/// (Node 18, 20 before 20.10): the terminal test is then skipped, and only it.
fn websocket_flags() -> Option<Vec<&'static str>> {
    let has = |flags: &[&str]| {
        Command::new("node")
            .args(flags)
            .args([
                "-e",
                "process.exit(typeof WebSocket === 'function' ? 0 : 1)",
            ])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if has(&[]) {
        Some(vec![])
    } else if has(&["--experimental-websocket"]) {
        Some(vec!["--experimental-websocket"])
    } else {
        None
    }
}

/// The package built and type-checked (with its tests and examples), or None when the npm
/// registry cannot be reached for its devDependencies.
fn built_package() -> Option<PathBuf> {
    let pkg = package();
    dev_dependencies(&pkg)?;
    let started = Instant::now();
    tsc(&pkg, "tsconfig.json");
    tsc(&pkg, "tsconfig.test.json");
    // The examples type-check on their own (tsc --noEmit), against the built declarations.
    tsc(&pkg, "tsconfig.examples.json");
    eprintln!(
        "tsc (package, tests, examples) took {:?}",
        started.elapsed()
    );
    Some(pkg)
}

/// The `.test.js` files of `dir` (under the package), sorted.
fn test_files(pkg: &Path, dir: &str) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(pkg.join(dir))
        .unwrap_or_else(|e| panic!("tsc wrote {dir}: {e}"))
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".test.js"))
        .map(|n| format!("{dir}/{n}"))
        .collect();
    files.sort();
    files
}

/// Runs `files` with `node --test` against `srv`: node's TAP counts (pass, skipped) once
/// nothing failed, was cancelled or left to do.
fn node_test(pkg: &Path, srv: &Server, files: &[String], flags: &[&str], major: u32) -> (u32, u32) {
    let started = Instant::now();
    let (ok, log) = run_logged(
        Command::new("node")
            .current_dir(pkg)
            .args(flags)
            .args(["--test", "--test-reporter=tap"])
            .args(files)
            .env("LOCKER_URL", &srv.url)
            .env("LOCKER_API_KEY", &srv.api_key)
            .env("LOCKER_BIN", locker_tests::locker_bin())
            .env("OPENAI_AGENTS_DISABLE_TRACING", "1")
            .env_remove("OPENAI_API_KEY")
            .env_remove("ANTHROPIC_API_KEY")
            .env_remove("NODE_OPTIONS"),
    );
    eprintln!("node {major} --test took {:?}:\n{log}", started.elapsed());
    assert!(ok, "the TypeScript SDK's tests failed:\n{log}");
    let count = |what: &str| -> u32 {
        log.lines()
            .find_map(|l| l.strip_prefix(&format!("# {what} ")))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no `# {what}` line in node's TAP output:\n{log}"))
    };
    assert_eq!(count("fail"), 0, "{log}");
    assert_eq!(count("todo"), 0, "{log}");
    assert_eq!(count("cancelled"), 0, "{log}");
    (count("pass"), count("skipped"))
}

#[test]
fn typescript_sdk_node_tests_against_a_real_server() {
    become_subreaper();
    let major = node_major();
    let Some(pkg) = built_package() else {
        return;
    };
    let files = test_files(&pkg, "build/test");
    assert!(files.len() >= 16, "the suite's files: {files:?}");

    let ws = websocket_flags();
    if ws.is_none() {
        eprintln!("SKIP (one test): node {major} has no WebSocket, so the terminal test cannot run; Node 22, or 20.10+, runs it");
    }
    // A memory quota well under the largest sandbox the API takes, so that a test can go past it.
    let srv = Server::start_with(&["--quota-memory-mb", "16384"]);
    let (pass, skipped) = node_test(&pkg, &srv, &files, &ws.clone().unwrap_or_default(), major);
    assert!(pass >= 66, "every test ran: {pass} passed");
    let skips = if ws.is_some() { 0 } else { 1 };
    assert_eq!(
        skipped, skips,
        "no test skipped but the terminal's without a WebSocket"
    );
}

/// The code interpreter through the SDK (`sdk/typescript/test/template/`): needs the
/// `code-interpreter` template, built here once per host as tests/code.rs does (about 6
/// minutes the first time, then cached), so it runs apart from the main suite.
#[test]
fn typescript_sdk_code_contexts_on_the_code_interpreter_template() {
    become_subreaper();
    let major = node_major();
    let Some(pkg) = built_package() else {
        return;
    };
    let started = Instant::now();
    let (built, log) = run_logged(Command::new(locker_tests::locker_bin()).args([
        "template",
        "build",
        "code-interpreter",
    ]));
    assert!(
        built,
        "building the code-interpreter template failed:\n{log}"
    );
    eprintln!(
        "the code-interpreter template is ready ({:?})",
        started.elapsed()
    );
    let files = test_files(&pkg, "build/test/template");
    assert!(!files.is_empty(), "the template tests: {files:?}");
    let srv = Server::start();
    let (pass, skipped) = node_test(&pkg, &srv, &files, &[], major);
    assert!(pass >= 5, "every test ran: {pass} passed");
    assert_eq!(skipped, 0);
}
