//! Jobs that outlive their exec (issue 17, API.md "Jobs that outlive their exec"): an exec
//! returns when its own command exits and what it left running keeps running in the
//! sandbox, still writing, still serving; a timeout or a caller's kill still takes the whole
//! tree; a serverless run's machine ends with its command. Jail and microVM, through the real
//! server. Each test's server cleans up its machines on drop.

use std::time::{Duration, Instant};

use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

fn sandbox(api: &Api, body: &Value) -> String {
    api.create_sandbox(body)["id"].as_str().unwrap().to_owned()
}

/// The exit code of `script` in the sandbox.
fn status(api: &Api, id: &str, script: &str) -> i64 {
    api.exec(id, &json!({ "shell": script }))["exit_code"]
        .as_i64()
        .unwrap()
}

/// Lines in /root/t, polled until it has at least `n`.
fn lines_at_least(api: &Api, id: &str, n: u64) -> u64 {
    locker_tests::wait_for(Duration::from_secs(20), "the job to keep writing", || {
        let got: u64 = api
            .sh(id, "wc -l < /root/t 2>/dev/null || echo 0")
            .trim()
            .parse()
            .unwrap();
        (got >= n).then_some(got)
    })
}

/// The new user's exact reproduction (issue 17): a `nohup … &` loop started by one exec is
/// still writing when the next ones look.
fn a_job_keeps_writing_after_its_exec(body: Value) {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api, &body);
    let t0 = Instant::now();
    let r = api.exec(
        &id,
        &json!({"shell": "nohup sh -c 'while true; do date >> /root/t; sleep 0.1; done' &"}),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the exec waited for its job: {:?}",
        t0.elapsed()
    );
    let first = lines_at_least(&api, &id, 3);
    let later = lines_at_least(&api, &id, first + 5);
    assert!(later > first, "{first} then {later}");
    // Deleting the sandbox ends its jobs with it (the server's drop checks no machine is left).
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete the sandbox");
}

#[test]
fn a_job_left_by_an_exec_keeps_running_in_a_jail() {
    a_job_keeps_writing_after_its_exec(json!({}));
}

#[test]
fn a_job_left_by_an_exec_keeps_running_in_a_microvm() {
    a_job_keeps_writing_after_its_exec(json!({"runtime": "microvm", "memory_mb": 256}));
}

#[test]
fn an_exec_returns_when_its_command_exits_while_its_job_holds_the_output_pipes() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api, &json!({}));
    // The job writes to the exec's own stdout for ever: the exec must not wait for it to
    // close the pipe, and the job must not die of a closed pipe once the exec is over.
    let t0 = Instant::now();
    let r = api.exec(
        &id,
        &json!({"shell": "(while :; do echo tick; sleep 0.05; done) & echo $! > /tmp/ticker; echo started",
                "timeout_ms": 30000}),
    );
    let took = t0.elapsed();
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["reason"], "exited", "{r}");
    assert!(r["stdout"].as_str().unwrap().contains("started"), "{r}");
    assert!(took < Duration::from_secs(2), "took {took:?}: {r}");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        status(&api, &id, "kill -0 $(cat /tmp/ticker)"),
        0,
        "the job died after its exec (SIGPIPE?)"
    );
    // Its later output is not part of any result.
    let next = api.exec(&id, &json!({"shell": "echo next"}));
    assert_eq!(next["stdout"], "next\n", "{next}");
    // `sleep 100 &` costs the exec nothing: it returns as fast as the same exec without it.
    let time = |script: &str| {
        let mut v: Vec<Duration> = (0..15)
            .map(|_| {
                let t = Instant::now();
                let r = api.exec(&id, &json!({ "shell": script }));
                assert_eq!(r["stdout"], "ok\n", "{r}");
                t.elapsed()
            })
            .collect();
        v.sort();
        v[v.len() / 2]
    };
    let plain = time("echo ok");
    let with_job = time("sleep 100 & echo ok");
    assert!(
        with_job < plain + Duration::from_millis(50),
        "p50 with a job {with_job:?}, without {plain:?}"
    );
}

#[test]
fn a_server_started_with_an_ampersand_answers_later_execs() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api, &json!({}));
    // http.server logs every request to stderr, the exec's pipe: it must keep serving after
    // its exec is over.
    let r = api.exec(
        &id,
        &json!({"shell": "cd /tmp && python3 -m http.server 8765 --bind 127.0.0.1 &"}),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    let get = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8765/').status)\"";
    locker_tests::wait_for(Duration::from_secs(20), "the server to listen", || {
        let r = api.exec(&id, &json!({ "shell": get }));
        (r["exit_code"] == 0).then_some(())
    });
    for _ in 0..5 {
        assert_eq!(api.sh(&id, get), "200\n");
    }
}

#[test]
fn a_timeout_and_a_callers_kill_still_take_the_whole_tree() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api, &json!({}));
    let r = api.exec(
        &id,
        &json!({"shell": "sleep 300 & echo $! > /tmp/p1; sleep 300", "timeout_ms": 500}),
    );
    assert_eq!(r["reason"], "timeout", "{r}");
    assert_ne!(
        status(&api, &id, "kill -0 $(cat /tmp/p1)"),
        0,
        "a timed-out exec's job survived"
    );

    let p = api
        .post(
            &format!("/v1/sandboxes/{id}/processes"),
            &json!({"shell": "sleep 300 & echo $! > /tmp/p2; wait"}),
        )
        .expect(200, "start a background process")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    locker_tests::wait_for(Duration::from_secs(10), "the pid file", || {
        (status(&api, &id, "test -s /tmp/p2") == 0).then_some(())
    });
    api.post(
        &format!("/v1/sandboxes/{id}/processes/{p}/signal"),
        &json!({"signal": "KILL"}),
    )
    .expect(200, "kill it");
    locker_tests::wait_for(Duration::from_secs(10), "the tree to die", || {
        (status(&api, &id, "kill -0 $(cat /tmp/p2)") != 0).then_some(())
    });
}

#[test]
fn a_run_ends_what_its_command_left_running_before_the_commit() {
    let s = Server::start();
    let api = s.api();
    let vol = api
        .post("/v1/volumes", &json!({"name": "jobs"}))
        .expect(201, "create a volume")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = api
        .post(
            &format!("/v1/volumes/{vol}/run"),
            &json!({"shell": "(sleep 1; echo late > late.txt) & echo ok"}),
        )
        .expect(200, "run");
    assert_eq!(r["stdout"], "ok\n", "{r}");
    assert_eq!(r["changes"]["committed"], true, "{r}");
    std::thread::sleep(Duration::from_secs(2));
    api.get(&format!("/v1/volumes/{vol}/files?path=/late.txt"))
        .expect_error(404, "not_found", "a run's job wrote after its commit");
}

#[test]
fn hundreds_of_jobs_leave_the_machine_serving() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api, &json!({}));
    // More jobs holding pipes than the agent drains at once (512 pipes): the rest are closed,
    // and the agent keeps serving.
    for i in 0..300 {
        let r = api.exec(&id, &json!({"shell": "sleep 300 & echo ok"}));
        assert_eq!(r["stdout"], "ok\n", "exec {i}: {r}");
    }
    let n: u64 = api
        .sh(&id, "ps -e -o comm= | grep -c '^sleep$' || true")
        .trim()
        .parse()
        .unwrap();
    assert!(n >= 300, "{n} sleeps running");
    let t0 = Instant::now();
    assert_eq!(api.sh(&id, "echo fine"), "fine\n");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
}

/// A command's cgroup left frozen (cgroup v1: the agent freezes a command's own cgroup to
/// kill its tree, and may die before it thaws it, as when the machine is destroyed) must not
/// keep the machine's processes alive: a frozen task never acts on SIGKILL, and PID 1's
/// namespace teardown then waits for it forever. Deleting the sandbox ends everything.
#[test]
fn a_command_cgroup_left_frozen_does_not_outlive_its_sandbox() {
    let root = std::path::Path::new("/sys/fs/cgroup/freezer/locker");
    if !root.is_dir() {
        eprintln!("no cgroup v1 freezer here: cgroup v2 kills frozen tasks itself");
        return;
    }
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api, &json!({}));
    api.sh(id.as_str(), "nohup sleep 1000 >/dev/null 2>&1 &");
    let dir = locker_tests::machine_cgroup(root.parent().unwrap(), &id).expect("its cgroup");
    let frozen: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && !std::fs::read_to_string(p.join("cgroup.procs"))
                    .unwrap_or_default()
                    .trim()
                    .is_empty()
        })
        .collect();
    assert!(
        !frozen.is_empty(),
        "the job's command cgroup under {}",
        dir.display()
    );
    for p in &frozen {
        std::fs::write(p.join("freezer.state"), "FROZEN").unwrap();
    }
    let t = Instant::now();
    let r = api.delete(&format!("/v1/sandboxes/{id}"));
    assert_eq!(r.status, 204, "{r:?}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "delete took {:?}",
        t.elapsed()
    );
    locker_tests::wait_for(
        Duration::from_secs(10),
        "the machine's cgroup to go",
        || (!dir.exists()).then_some(()),
    );
}
