//! The `locker` CLI as a new user meets it (`shared/reports/newuser-2.md`, issue 15): the
//! API's background processes, TTL and network changes reachable from the CLI, one output
//! style for every create, flags before the subcommand, help texts that say each default,
//! `usage --since` in the forms people type, `run` saying why nothing was committed, and
//! local commands failing in the same one `locker:` line as client commands. Each test
//! drives the real `locker` binary against a real server.

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

/// `locker ARGS…` against `s` with the key in the environment; stdin is `/dev/null`.
fn locker(s: &Server, args: &[&str]) -> Command {
    let mut c = bare(args);
    c.env("LOCKER_URL", &s.url)
        .env("LOCKER_API_KEY", &s.api_key);
    c
}

/// `locker ARGS…` with neither `LOCKER_URL` nor `LOCKER_API_KEY` set.
fn bare(args: &[&str]) -> Command {
    let mut c = Command::new(locker_tests::locker_bin());
    c.args(args)
        .env_remove("LOCKER_URL")
        .env_remove("LOCKER_API_KEY")
        .env_remove("LOCKER_ADMIN_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Runs a `locker` child to its end. Registered first: the tests' orphan reaper reaps
/// zombies named `locker` that no test waits for itself.
fn output_of(mut c: Command) -> Output {
    let child = c.spawn().unwrap();
    locker_tests::register_child(child.id());
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `locker ARGS…` and expects success; returns its stdout.
fn ok(s: &Server, args: &[&str]) -> String {
    let out = output_of(locker(s, args));
    assert!(
        out.status.success(),
        "locker {args:?} failed ({:?}):\nstdout: {}\nstderr: {}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs `locker ARGS… --json` (the flag where a script would put it) and parses stdout.
fn ok_json(s: &Server, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = ok(s, &all);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("locker {all:?}: not JSON ({e}): {out}"))
}

/// `locker … --help` (no server needed).
fn help(args: &[&str]) -> String {
    let mut all = args.to_vec();
    all.push("--help");
    let out = output_of(bare(&all));
    assert!(out.status.success(), "{all:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

fn sandbox(api: &Api, body: &Value) -> String {
    api.create_sandbox(body)["id"].as_str().unwrap().to_owned()
}

/// The single id a create printed: the whole stdout is `<prefix>…\n`.
fn the_id(out: &str, prefix: &str) -> String {
    let id = out
        .strip_suffix('\n')
        .unwrap_or_else(|| panic!("no newline: {out:?}"));
    assert!(
        id.starts_with(prefix)
            && id.len() > prefix.len()
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
        "expected one {prefix}… id alone, got {out:?}"
    );
    id.to_owned()
}

fn secs_until(rfc3339: &Value) -> i64 {
    let at = locker_types::parse_rfc3339(rfc3339.as_str().expect("a time")).expect("RFC 3339");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    at - now
}

#[test]
fn a_background_process_is_started_followed_waited_for_and_killed_from_the_cli() {
    let s = Server::start();
    let api = s.api();
    let sb = sandbox(&api, &json!({}));

    // Started in the background: the id alone on stdout, at once.
    let t = Instant::now();
    let out = ok(
        &s,
        &[
            "exec",
            "--background",
            &sb,
            "--",
            "sh",
            "-c",
            "echo one; sleep 2; echo two >&2; echo three; exit 7",
        ],
    );
    let p1 = the_id(&out, "proc_");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );

    // `ps` and `process list` show it running.
    let table = ok(&s, &["ps", &sb]);
    let row = table
        .lines()
        .find(|l| l.starts_with(&p1))
        .unwrap_or_else(|| panic!("{p1} not in:\n{table}"));
    assert!(row.contains("running") && row.contains("sh -c"), "{row}");
    let listed = ok_json(&s, &["process", "list", &sb]);
    assert!(
        listed["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["id"] == p1.as_str()),
        "{listed}"
    );

    // `logs -f` replays from the start, follows, and returns when it ends.
    let out = output_of(locker(&s, &["process", "logs", &sb, &p1, "-f"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "one\nthree\n");
    assert_eq!(text(&out.stderr), "two\n");

    // `wait` leaves with the command's code; `logs` without -f replays what was kept.
    let out = output_of(locker(&s, &["process", "wait", &sb, &p1]));
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert_eq!(ok(&s, &["process", "logs", &sb, &p1]), "one\nthree\n");
    let got = ok_json(&s, &["process", "get", &sb, &p1]);
    assert_eq!(got["state"], "exited", "{got}");
    assert_eq!(got["result"]["exit_code"], 7, "{got}");

    // `kill` ends a long one; `wait` then says how (128 + SIGKILL).
    let p2 = the_id(
        &ok(&s, &["exec", "--background", &sb, "--", "sleep", "300"]),
        "proc_",
    );
    assert_eq!(
        ok(&s, &["process", "kill", &sb, &p2, "--signal", "KILL"]),
        format!("{p2}\n")
    );
    let out = output_of(locker(&s, &["process", "wait", &sb, &p2]));
    assert_eq!(out.status.code(), Some(137), "{}", text(&out.stderr));
    // The default signal is SIGTERM (143).
    let p3 = the_id(
        &ok(&s, &["exec", "--background", &sb, "--", "sleep", "300"]),
        "proc_",
    );
    ok(&s, &["process", "kill", &sb, &p3]);
    let out = output_of(locker(&s, &["process", "wait", &sb, &p3]));
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));

    // Its stdin stays open for `process stdin` (`--close` ends it).
    let p4 = the_id(
        &ok(
            &s,
            &[
                "exec",
                "--background",
                &sb,
                "--",
                "sh",
                "-c",
                "tr a-z A-Z; echo done",
            ],
        ),
        "proc_",
    );
    let mut c = locker(&s, &["process", "stdin", &sb, &p4, "--close"]);
    c.stdin(Stdio::piped());
    let mut child = c.spawn().unwrap();
    locker_tests::register_child(child.id());
    child.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = output_of(locker(&s, &["process", "wait", &sb, &p4]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(ok(&s, &["process", "logs", &sb, &p4]), "HELLO\ndone\n");

    // `attach`: its output, our stdin into it, its exit code.
    let p5 = the_id(
        &ok(
            &s,
            &[
                "exec",
                "--background",
                &sb,
                "--",
                "sh",
                "-c",
                "echo ready; tr a-z A-Z; exit 4",
            ],
        ),
        "proc_",
    );
    let mut c = locker(&s, &["process", "attach", &sb, &p5]);
    c.stdin(Stdio::piped());
    let mut child = c.spawn().unwrap();
    locker_tests::register_child(child.id());
    child.stdin.take().unwrap().write_all(b"shout\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "ready\nSHOUT\n");

    // Mistakes are one clear line.
    let out = output_of(locker(&s, &["process", "wait", &sb, "proc_nope"]));
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("locker: ") && err.contains("proc_nope") && err.contains("404"),
        "{err}"
    );
    let out = output_of(locker(
        &s,
        &["process", "kill", &sb, &p2, "--signal", "NOPE"],
    ));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("unknown signal"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn sandbox_ttl_moves_its_expiry_from_now() {
    let s = Server::start();
    let api = s.api();
    let sb = sandbox(&api, &json!({"ttl_s": 600}));
    let before = secs_until(&api.get(&format!("/v1/sandboxes/{sb}")).json()["expires_at"]);
    assert!((590..=600).contains(&before), "{before}");

    let out = ok(&s, &["sandbox", "ttl", &sb, "7200"]);
    assert!(out.starts_with(&sb) && out.contains("expires"), "{out}");
    let left = secs_until(&api.get(&format!("/v1/sandboxes/{sb}")).json()["expires_at"]);
    assert!((7190..=7200).contains(&left), "{left}");

    // A duration with a unit, and --json for scripts.
    let v = ok_json(&s, &["sandbox", "ttl", &sb, "2h"]);
    assert_eq!(v["id"], sb.as_str());
    assert_eq!(v["ttl_s"], 7200);
    let v = ok_json(&s, &["sandbox", "ttl", &sb, "90m"]);
    assert!((5390..=5400).contains(&secs_until(&v["expires_at"])), "{v}");

    // Bad input is refused before anything changes.
    let out = output_of(locker(&s, &["sandbox", "ttl", &sb, "soon"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = output_of(locker(&s, &["sandbox", "ttl", &sb, "0"]));
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("ttl_s"), "{}", text(&out.stderr));
}

#[test]
fn sandbox_network_changes_the_policy_the_machine_lives_under() {
    let s = Server::start();
    locker_tests::egress::wait_egress_ok(&s);
    let api = s.api();
    let sb = sandbox(&api, &json!({}));
    let probe = "test -e /etc/resolv.conf && echo resolv; ls /sys/class/net | grep -vx lo | wc -l";
    assert_eq!(
        api.sh(&sb, probe).trim(),
        "0",
        "a `none` machine has no link"
    );

    // none → all: the machine gets its link and its resolver.
    let out = ok(&s, &["sandbox", "network", &sb, "all"]);
    assert!(out.contains("all"), "{out}");
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{sb}")).json()["network"]["egress"],
        "all"
    );
    let seen = api.sh(&sb, probe);
    assert!(seen.starts_with("resolv\n"), "{seen}");
    assert_ne!(seen.lines().last(), Some("0"), "{seen}");

    // allow: the create flag's syntax, normalized by the server and shown as such.
    let out = ok(
        &s,
        &[
            "sandbox",
            "network",
            &sb,
            "allow:pypi.org,*.GitHub.com,10.1.2.3/24",
        ],
    );
    assert!(
        out.contains("pypi.org") && out.contains("*.github.com") && out.contains("10.1.2.0/24"),
        "{out}"
    );
    let v = api.get(&format!("/v1/sandboxes/{sb}")).json();
    assert_eq!(
        v["network"],
        json!({"egress": "allow", "allow": ["pypi.org", "*.github.com", "10.1.2.0/24"]}),
        "{v}"
    );
    let v = ok_json(&s, &["sandbox", "network", &sb, "none"]);
    assert_eq!(v["network"]["egress"], "none", "{v}");

    // The server's refusals come back as one line; a typo is a usage error.
    let out = output_of(locker(&s, &["sandbox", "network", &sb, "allow:*"]));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).starts_with("locker: "),
        "{}",
        text(&out.stderr)
    );
    let out = output_of(locker(&s, &["sandbox", "network", &sb, "everything"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

#[test]
fn every_create_prints_one_id_and_gets_read_like_text() {
    let s = Server::start();
    let api = s.api();

    // VOL=$(locker volume create x) captures the id alone; `volume get` shows it.
    let vol = the_id(&ok(&s, &["volume", "create", "cli-x"]), "vol_");
    let got = ok(&s, &["volume", "get", "cli-x"]);
    assert!(
        got.contains(&vol)
            && got
                .lines()
                .any(|l| l.starts_with("name:") && l.ends_with("cli-x")),
        "{got}"
    );
    assert!(
        got.contains("10G"),
        "the size limit is shown in the size style: {got}"
    );
    assert_eq!(ok_json(&s, &["volume", "get", &vol])["name"], "cli-x");
    let out = output_of(locker(&s, &["volume", "get", "nope"]));
    assert_eq!(out.status.code(), Some(1));

    // `--volume NAME` alone mounts it at /workspace, as the API does.
    let sb = the_id(&ok(&s, &["sandbox", "create", "--volume", "cli-x"]), "sb_");
    api.sh(&sb, "echo hi > /workspace/from-sandbox");
    assert_eq!(
        ok(
            &s,
            &["volume", "files", "get", "cli-x", "/from-sandbox", "-"]
        ),
        "hi\n"
    );

    // `sandbox get` shows the mount as text, not JSON.
    let got = ok(&s, &["sandbox", "get", &sb]);
    assert!(!got.contains('{') && !got.contains('"'), "{got}");
    let line = got
        .lines()
        .find(|l| l.starts_with("volumes:"))
        .unwrap_or_else(|| panic!("{got}"));
    assert!(
        line.contains("cli-x") && line.contains("/workspace"),
        "{line}"
    );

    // Every other create: a snapshot, a fork, a volume snapshot, a volume fork.
    let snap = the_id(&ok(&s, &["sandbox", "snapshot", &sb]), "snap_");
    ok(&s, &["sandbox", "rm", &sb]);
    the_id(&ok(&s, &["volume", "snapshot", "cli-x"]), "snap_");
    the_id(&ok(&s, &["volume", "fork", "cli-x", "cli-y"]), "vol_");
    let sb2 = the_id(
        &ok(&s, &["sandbox", "create", "--from-snapshot", &snap]),
        "sb_",
    );
    the_id(&ok(&s, &["sandbox", "fork", &sb2]), "sb_");

    // Sizes in one style (as `ls -h` and `volume list` write them).
    let snaps = ok(&s, &["snapshot", "list"]);
    let row = snaps
        .lines()
        .find(|l| l.starts_with(&snap))
        .unwrap_or_else(|| panic!("{snaps}"));
    assert!(!row.contains(" MB") && !row.contains(" kB"), "{row}");
    let size = row.split_whitespace().nth(3).unwrap();
    assert!(
        size.chars().next().unwrap().is_ascii_digit()
            && size
                .trim_end_matches(['K', 'M', 'G'])
                .parse::<f64>()
                .is_ok(),
        "{row}"
    );
}

#[test]
fn global_flags_go_before_the_subcommand_and_the_key_has_a_flag() {
    let s = Server::start();
    let api = s.api();
    let sb = sandbox(&api, &json!({}));

    // --json, --url and --api-key before the subcommand, with nothing in the environment.
    let out = output_of(bare(&[
        "--json",
        "--url",
        &s.url,
        "--api-key",
        &s.api_key,
        "sandbox",
        "list",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("locker --json sandbox list is JSON");
    assert!(
        v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["id"] == sb.as_str()),
        "{v}"
    );
    // Also in their `=` form, and after the subcommand as before.
    let url = format!("--url={}", s.url);
    let key = format!("--api-key={}", s.api_key);
    let out = output_of(bare(&[&url, &key, "exec", &sb, "--", "echo", "hi"]));
    assert_eq!(text(&out.stdout), "hi\n", "{}", text(&out.stderr));
    let out = output_of(bare(&[
        "sandbox",
        "list",
        "--url",
        &s.url,
        "--api-key",
        &s.api_key,
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    // The flag wins over the environment; a wrong key names both ways to give one.
    let out = output_of(locker(&s, &["--api-key", "lk_wrong", "sandbox", "list"]));
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("LOCKER_API_KEY") && err.contains("--api-key"),
        "{err}"
    );
    // A local command takes its own flags from before its name too.
    let out = output_of(bare(&["--json", "doctor", "--data-dir", "/tmp"]));
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("locker --json doctor: {e}: {}", text(&out.stderr)));
    assert!(v.get("runtimes").is_some(), "{v}");

    // Every client command's help names the key's flag and variable.
    for cmd in [
        &["sandbox"][..],
        &["sandbox", "create"],
        &["exec"],
        &["run"],
        &["shell"],
        &["files"],
        &["volume"],
        &["process"],
        &["ps"],
        &["port"],
        &["calls"],
        &["usage"],
        &["snapshot"],
    ] {
        let h = help(cmd);
        assert!(
            h.contains("--api-key") && h.contains("LOCKER_API_KEY"),
            "{cmd:?}:\n{h}"
        );
        assert!(
            h.contains("--url") && h.contains("LOCKER_URL"),
            "{cmd:?}:\n{h}"
        );
    }
    let h = help(&[]);
    for f in ["--json", "--url", "--api-key", "LOCKER_API_KEY"] {
        assert!(h.contains(f), "locker --help lacks {f}:\n{h}");
    }

    // A usage mistake's usage line does not read as if --url were required.
    let out = output_of(locker(&s, &["exec", &sb]));
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    let usage = err
        .lines()
        .find(|l| l.starts_with("Usage:"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(!usage.contains("--url"), "{usage}");
}

#[test]
fn help_texts_say_every_default_and_offer_only_what_is_served() {
    let h = help(&["exec"]);
    assert!(h.contains("60000") && h.contains("one minute"), "{h}");
    assert!(h.contains("--background"), "{h}");
    assert!(
        h.contains("65536"),
        "--max-output-bytes names its default:\n{h}"
    );
    // `shell --json` meant nothing.
    assert!(!help(&["shell"]).contains("--json"));

    let h = help(&["sandbox", "create"]);
    assert!(!h.contains("gvisor"), "{h}");
    for default in ["1800", "512", "2048", "default", "/workspace", "auto"] {
        assert!(
            h.contains(default),
            "sandbox create --help lacks {default}:\n{h}"
        );
    }
    let out = output_of(bare(&["sandbox", "create", "--runtime", "gvisor"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("microvm"),
        "{}",
        text(&out.stderr)
    );

    assert!(
        help(&["calls"]).contains("100"),
        "calls --limit names its default"
    );
    assert!(help(&["volume", "create"]).contains("10240"));
    let h = help(&["usage"]);
    assert!(h.contains("24h") && h.contains("2026-12-01"), "{h}");
}

#[test]
fn usage_since_takes_dates_and_durations() {
    let s = Server::start();
    let api = s.api();
    let sb = sandbox(&api, &json!({}));
    api.sh(&sb, "true");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;

    // The text names the moment counted from; --json is the server's answer.
    let since_of = |args: &[&str]| -> i64 {
        let out = ok(&s, args);
        let line = out
            .lines()
            .find(|l| l.starts_with("since:"))
            .unwrap_or_else(|| panic!("{args:?}: {out}"));
        let t = line.split_whitespace().nth(1).unwrap();
        locker_types::parse_rfc3339(t).unwrap_or_else(|| panic!("{line}"))
    };
    assert!((since_of(&["usage", "--since", "24h"]) - (now - 86_400)).abs() <= 5);
    assert!((since_of(&["usage", "--since", "7d"]) - (now - 7 * 86_400)).abs() <= 5);
    assert!((since_of(&["usage", "--since", "30m"]) - (now - 1800)).abs() <= 5);
    assert_eq!(since_of(&["usage", "--since", "2026-12-01"]), 1_796_083_200);
    assert_eq!(
        since_of(&["usage", "--since", "2026-12-01T00:00:00Z"]),
        1_796_083_200
    );
    assert_eq!(since_of(&["usage", "--since", "1796083200"]), 1_796_083_200);
    let v = ok_json(&s, &["usage", "--since", "24h"]);
    assert!(v["execs"].as_u64().unwrap() >= 1, "{v}");
    // A start in the future counts nothing.
    let v = ok_json(&s, &["usage", "--since", "2999-01-01"]);
    assert_eq!(v["execs"], 0, "{v}");

    let out = output_of(locker(&s, &["usage", "--since", "soon"]));
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("24h") && err.contains("2026-12-01"), "{err}");
}

#[test]
fn run_says_why_the_changes_were_not_committed() {
    let s = Server::start();
    ok(&s, &["volume", "create", "cli-run"]);

    let out = output_of(locker(
        &s,
        &[
            "run",
            "--volume",
            "cli-run",
            "--commit",
            "never",
            "--",
            "sh",
            "-c",
            "echo x > f",
        ],
    ));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("+ /f"), "{err}");
    let why = err
        .lines()
        .find(|l| l.contains("not committed"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(why.contains("never"), "{why}");

    let out = output_of(locker(
        &s,
        &[
            "run",
            "--volume",
            "cli-run",
            "--commit",
            "on_success",
            "--",
            "sh",
            "-c",
            "echo x > g; exit 3",
        ],
    ));
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let why = err
        .lines()
        .find(|l| l.contains("not committed"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        why.contains("exited 3") && why.contains("on_success"),
        "{why}"
    );

    // Committed: no such line.
    let out = output_of(locker(
        &s,
        &["run", "--volume", "cli-run", "--", "sh", "-c", "echo y > h"],
    ));
    assert_eq!(out.status.code(), Some(0));
    assert!(
        !text(&out.stderr).contains("not committed"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn local_commands_fail_in_one_locker_line_like_client_commands() {
    let dir = locker_tests::TempDir::new("cli-local");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"name": "x", "base": "alpine:3.19"}"#).unwrap();
    let cache = dir.path().join("cache");
    for args in [
        vec!["template", "build", "--file", bad.to_str().unwrap()],
        vec!["template", "build", "--file", "/nonexistent/spec.json"],
    ] {
        let out = output_of({
            let mut c = bare(&args);
            c.env("RUST_BACKTRACE", "1").env("LOCKER_CACHE_DIR", &cache);
            c
        });
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = text(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("locker: "), "{args:?}: {err}");
        assert!(
            !err.contains("Error:") && !err.contains("backtrace"),
            "{err}"
        );
    }
}

#[test]
fn ports_get_preview_urls_a_browser_opens_and_open_and_close_from_the_cli() {
    let s = Server::start();
    // `sandbox create` prints the id alone on stdout and the preview URL on stderr.
    let out = output_of(locker(&s, &["sandbox", "create"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let sb = the_id(&text(&out.stdout), "sb_");
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("preview: http://{{port}}-{sb}.localhost:")),
        "{err}"
    );
    let got = ok(&s, &["sandbox", "get", &sb]);
    assert!(
        got.contains("preview_url:") && got.contains("lpt_"),
        "{got}"
    );
    let token = ok_json(&s, &["sandbox", "get", &sb])["preview_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let port = s.url.rsplit_once(':').unwrap().1;

    // A private port's URL carries the token; --bare does not.
    let url = ok(&s, &["port", "url", &sb, "8000", "/app?x=1"]);
    assert_eq!(
        url.trim(),
        format!("http://8000-{sb}.localhost:{port}/app?x=1&locker_token={token}")
    );
    let bare_url = ok(&s, &["port", "url", &sb, "8000", "--bare"]);
    assert_eq!(
        bare_url.trim(),
        format!("http://8000-{sb}.localhost:{port}/")
    );

    // open / close flip the port; a public port's URL needs no token.
    let opened = ok(&s, &["port", "open", &sb, "8000"]);
    assert_eq!(
        opened.trim(),
        format!("port 8000 is public: http://8000-{sb}.localhost:{port}/")
    );
    api_serving_check(&s, &sb);
    assert_eq!(
        ok(&s, &["port", "url", &sb, "8000"]).trim(),
        format!("http://8000-{sb}.localhost:{port}/")
    );
    assert_eq!(
        ok(&s, &["port", "close", &sb, "8000"]).trim(),
        "port 8000 is private"
    );
    let out = output_of(locker(&s, &["port", "open", &sb, "0"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

/// A server on port 8000 of `sb`, so that `locker port url` sees whether it is public.
fn api_serving_check(s: &Server, sb: &str) {
    let api = s.api();
    api.sh(
        sb,
        "cd /tmp && (python3 -m http.server 8000 >/dev/null 2>&1 &)",
    );
    locker_tests::wait_for(Duration::from_secs(30), "port 8000 to listen", || {
        let v = api
            .get(&format!("/v1/sandboxes/{sb}/ports"))
            .expect(200, "ports");
        v["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["port"] == 8000)
            .map(|p| assert_eq!(p["public"], true, "{v}"))
    });
}
