//! The shared server fixture itself (`locker_tests::shared`): when a test binary whose
//! tests share a server exits, even after a failing test, nothing of that server is left:
//! no process, machine, mount, cgroup or data dir.
//!
//! The check runs a test of this binary in a child process (the binary itself, filtered to
//! one ignored test) that fails on purpose on the shared server, then looks at the host.
//! Run as root after `scripts/setup build`:
//! `cargo test --release -p locker-tests --test server -- fixture::`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use locker_tests::server::{destroy_machines, stop_volume_agents};
use locker_tests::shared::Tenant;
use locker_tests::{become_subreaper, register_child, traces_of, wait_for, TempDir};
use serde_json::{json, Value};

/// Where the child test writes what it made (set only for the child).
const REPORT: &str = "LOCKER_TESTS_SHARED_REPORT";

#[test]
#[ignore = "run in a child process by a_failing_test_leaves_nothing_of_the_shared_server"]
fn fails_on_purpose_on_the_shared_server() {
    let Some(report) = std::env::var_os(REPORT) else {
        return;
    };
    let t = Tenant::new();
    let sb = t.sandbox(&json!({}));
    locker_tests::answers::start_process(&t.api(), &sb, &json!({"cmd": ["sleep", "600"]}));
    let made = json!({
        "server_pid": t.srv.pid(),
        "data_dir": t.srv.data_dir,
        "sandbox": sb,
        "machine_dir": t.srv.machine_dir(&sb),
    });
    std::fs::write(&report, made.to_string()).expect("write the report");
    panic!("this test fails on purpose, with a sandbox running on the shared server");
}

fn alive(pid: u64) -> bool {
    // A zombie counts as gone: its parent, the child binary, has exited.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

#[test]
fn a_failing_test_leaves_nothing_of_the_shared_server() {
    // A server the child left behind would be reparented here, to be reaped.
    become_subreaper();
    let dir = TempDir::new("locker-shared-child");
    let report = dir.path().join("report.json");
    let child = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "fixture::fails_on_purpose_on_the_shared_server",
            "--exact",
            "--ignored",
            "--test-threads=1",
        ])
        .env(REPORT, &report)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the child test");
    register_child(child.id());
    let out = child.wait_with_output().expect("the child test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() && text.contains("fails on purpose"),
        "the child test failed as it should: {}\n{text}",
        out.status
    );
    let made: Value = serde_json::from_slice(&std::fs::read(&report).expect("the report"))
        .unwrap_or_else(|e| panic!("the child's report ({e}):\n{text}"));
    let pid = made["server_pid"].as_u64().expect("server_pid");
    let sb = made["sandbox"].as_str().expect("sandbox");
    let machine_dir = Path::new(made["machine_dir"].as_str().expect("machine_dir"));
    let data_dir = made["data_dir"].as_str().expect("data_dir");
    let mut left = Vec::new();
    if alive(pid) {
        left.push(format!("the server process {pid}"));
    }
    left.extend(traces_of(sb, machine_dir));
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    left.extend(
        mounts
            .lines()
            .filter(|l| l.contains(data_dir))
            .map(|l| format!("mount: {l}")),
    );
    if Path::new(data_dir).exists() {
        left.push(format!("the data dir {data_dir}"));
    }
    if !left.is_empty() {
        clean_up_after_a_broken_fixture(pid, Path::new(data_dir));
    }
    assert!(
        left.is_empty(),
        "the shared server outlived its binary: {left:#?}\n{text}"
    );
}

/// What the fixture should have done, so a failing check leaves nothing either: the
/// server killed (an orphan of the child binary, now reaped here), its machines and
/// volumes destroyed, its directory removed.
fn clean_up_after_a_broken_fixture(pid: u64, data_dir: &Path) {
    // SAFETY: kill with the pid of the server the child reported; it was alive just now.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    wait_for(Duration::from_secs(10), "the leftover server dies", || {
        (!alive(pid)).then_some(())
    });
    destroy_machines(&data_dir.join("sandboxes"));
    destroy_machines(&data_dir.join("pool"));
    stop_volume_agents(&data_dir.join("volumes"));
    if let Some(dir) = data_dir.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}
