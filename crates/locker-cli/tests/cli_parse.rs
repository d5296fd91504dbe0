//! The client commands as a user meets them before any server is involved: what a usage
//! mistake says and exits with, and what every command says when no server listens.
//! (Runs against the real server live in the end-to-end suite.)

use std::process::{Command, Output, Stdio};

/// A URL on which nothing listens: a port bound once, learned, and released.
fn dead_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("http://127.0.0.1:{port}")
}

fn locker(args: &[&str], url: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_locker"))
        .args(args)
        .env("LOCKER_URL", url)
        .env_remove("LOCKER_API_KEY")
        .env_remove("LOCKER_ADMIN_KEY")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn every_client_command_names_the_unreachable_server_in_one_line() {
    let url = dead_url();
    let want =
        format!("locker: cannot reach the Locker server at {url}: is `locker serve` running?\n");
    let commands: &[&[&str]] = &[
        &["sandbox", "create", "--template", "default"],
        &["sandbox", "list", "--state", "running"],
        &["sandbox", "get", "sb_1"],
        &["exec", "sb_1", "--", "echo", "hi"],
        &["exec", "--json", "sb_1", "--shell", "echo hi"],
        &["shell", "sb_1"],
        &["files", "get", "sb_1", "/etc/hosts"],
        &["files", "put", "sb_1", "-", "/root/x"],
        &["files", "ls", "sb_1", "/root"],
        &["files", "rm", "-r", "sb_1", "/root/x"],
        &["files", "mkdir", "sb_1", "/root/d"],
        &["files", "mv", "sb_1", "/a", "/b"],
        &["files", "stat", "sb_1", "/a"],
        &["calls", "--limit", "5"],
        &["usage"],
    ];
    for args in commands {
        let o = locker(args, &url);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert_eq!(stderr(&o), want, "{args:?}");
        assert!(o.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn sandbox_rm_reports_each_failure_and_exits_1() {
    let url = dead_url();
    let o = locker(&["sandbox", "rm", "sb_1", "sb_2"], &url);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stderr(&o).lines().count(), 2, "{}", stderr(&o));
}

#[test]
fn admin_commands_ask_for_the_admin_key_first() {
    let url = dead_url();
    for args in [
        &["tenant", "create", "team-b"][..],
        &["key", "create", "--tenant", "team-b"],
        &["key", "revoke", "key_1"],
    ] {
        let o = locker(args, &url);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(
            stderr(&o).starts_with("locker: LOCKER_ADMIN_KEY is not set"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
}

#[test]
fn usage_mistakes_exit_2() {
    let url = dead_url();
    let cases: &[&[&str]] = &[
        &["exec", "sb_1"],
        &["exec", "sb_1", "--shell", "true", "--", "ls"],
        &["sandbox", "create", "--env", "NOEQUALS"],
        &["sandbox", "create", "--network", "some"],
        &["sandbox", "create", "--volume", "vol_1:relative"],
        &["sandbox", "rm"],
        &["files", "put", "sb_1", "a", "/b", "--mode", "999"],
        &["key", "create"],
    ];
    for args in cases {
        let o = locker(args, &url);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
    // Checked by the request's own validation, before any connection is tried.
    let o = locker(&["exec", "sb_1", "--cwd", "relative", "--", "ls"], &url);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o),
        "locker: `cwd` must be an absolute path, got \"relative\"\n"
    );
    let o = locker(&["sandbox", "list"], "https://example.invalid");
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("plain http:// only"), "{}", stderr(&o));
}

#[test]
fn exec_takes_the_command_with_or_without_a_double_dash() {
    // Flags before the command are the CLI's; everything from the command on is its own.
    // With no server, parsing succeeds and the run fails to connect (exit 1, not 2).
    let url = dead_url();
    for args in [
        &["exec", "sb_1", "--cwd", "/w", "ls", "-la", "--json"][..],
        &["exec", "sb_1", "--", "ls", "-la"],
        &["exec", "-e", "A=1", "sb_1", "--", "--weird-program"],
    ] {
        let o = locker(args, &url);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn files_put_of_a_missing_local_file_says_so() {
    let url = dead_url();
    let o = locker(
        &["files", "put", "sb_1", "/surely/not/here.txt", "/root/x"],
        &url,
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("locker: cannot open /surely/not/here.txt: "),
        "{}",
        stderr(&o)
    );
}
