//! End-to-end tests of a server killed with SIGKILL and started again on its data dir: it
//! adopts the machines that kept running, with their files, env and processes, and forgets
//! (leaving nothing of) one that died while it was down.
//!
//! Each test kills and restarts a server, so each starts its own. Run as root after
//! `scripts/setup build`: `cargo test --release -p locker-tests --test server -- restart::`.

use std::time::Duration;

use locker_tests::answers::{ids, running_in, sandbox, sandbox_id, start_process};
use locker_tests::server::Server;
use locker_tests::{traces_of, wait_for};
use serde_json::json;

#[test]
fn a_killed_server_adopts_its_running_sandboxes_on_restart() {
    let mut srv = Server::start();
    let api = srv.api();
    let keep = sandbox_id(
        &api.create_sandbox(&json!({"metadata": {"role": "keep"}, "env": {"KEPT_ENV": "yes"}})),
    );
    api.write_file(&keep, "/root/notes.txt", b"written before the crash")
        .expect(200, "write");
    let p = start_process(&api, &keep, &json!({"cmd": ["sleep", "987"]}));

    srv.kill9();
    assert!(
        !traces_of(&keep, &srv.machine_dir(&keep)).is_empty(),
        "the machine outlives the server"
    );
    srv.restart();
    let api = srv.api();
    let v = sandbox(&api, &keep);
    assert_eq!(
        (&v["state"], &v["metadata"]),
        (&json!("running"), &json!({"role": "keep"})),
        "{v}"
    );
    assert_eq!(
        api.read_file(&keep, "/root/notes.txt").body,
        b"written before the crash",
        "the file survived"
    );
    assert_eq!(
        api.sh(&keep, "echo $KEPT_ENV"),
        "yes\n",
        "the sandbox's env survived"
    );
    assert!(
        running_in(&api, &keep, "sleep 987"),
        "its processes kept running"
    );
    let procs = api
        .get(&format!("/v1/sandboxes/{keep}/processes"))
        .expect(200, "processes after the restart");
    assert!(
        ids(&procs, "processes").contains(&p),
        "the background process is still listed: {procs}"
    );
    api.write_file(&keep, "/root/after.txt", b"after")
        .expect(200, "write after the restart");
    assert_eq!(
        api.delete(&format!("/v1/sandboxes/{keep}")).status,
        204,
        "delete the adopted sandbox"
    );
    let traces = traces_of(&keep, &srv.machine_dir(&keep));
    assert!(
        traces.is_empty(),
        "an adopted sandbox leaves nothing behind when deleted: {traces:?}"
    );
}

#[test]
fn a_sandbox_whose_machine_died_while_the_server_was_down_is_gone_after_restart() {
    let mut srv = Server::start();
    let api = srv.api();
    let keep = sandbox_id(&api.create_sandbox(&json!({"metadata": {"role": "keep"}})));
    let lost = sandbox_id(&api.create_sandbox(&json!({"metadata": {"role": "lost"}})));

    srv.kill9();
    // Its PID 1, the agent, is killed, which takes every process of its PID namespace along.
    let state = locker_runtime::jail::JailState::load(&srv.machine_dir(&lost))
        .expect("the lost machine's state");
    assert!(
        locker_runtime::jail::is_alive(&state),
        "the lost machine runs before it is killed"
    );
    // SAFETY: kill with a pid read from the machine's own state file.
    unsafe { libc::kill(state.agent_pid, libc::SIGKILL) };
    wait_for(Duration::from_secs(5), "the killed machine is dead", || {
        (!locker_runtime::jail::is_alive(&state)).then_some(())
    });

    srv.restart();
    let api = srv.api();
    api.get(&format!("/v1/sandboxes/{lost}")).expect_error(
        404,
        "not_found",
        "a sandbox whose machine died while the server was down",
    );
    assert_eq!(
        ids(&api.get("/v1/sandboxes").expect(200, "list"), "sandboxes"),
        vec![keep.clone()]
    );
    assert!(
        traces_of(&lost, &srv.machine_dir(&lost)).is_empty(),
        "nothing is left of the dead machine"
    );
}
