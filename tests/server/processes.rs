//! End-to-end tests of background processes and the terminal: a process starts at once,
//! takes stdin, replays and follows its output, ends by a signal, and is refused with the
//! error shape when unknown; the terminal runs a shell over a WebSocket, resizes, reports
//! its exit, and ends its processes when the client goes away.
//!
//! The tests share one `locker serve` (see `locker_tests::shared`) and one sandbox on it,
//! each with processes and terminals of its own. Run as root after `scripts/setup build`:
//! `cargo test --release -p locker-tests --test server -- processes::`.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use locker_tests::answers::{assert_listed, refused, running_in, start_process, wait_process_end};
use locker_tests::server::Api;
use locker_tests::shared::{Borrowed, SharedSandbox, Tenant};
use locker_tests::streams::{
    first_line, read_exit_frame, read_ndjson, read_until, stream_text, ws_connect, Terminal,
};
use locker_tests::wait_for;
use serde_json::{json, Value};

static SHARED: OnceLock<SharedSandbox> = OnceLock::new();

/// The sandbox these tests share (each starts processes and terminals of its own in it):
/// the borrow, its tenant's client, the sandbox id.
fn shared_sandbox() -> (Borrowed, Api, String) {
    let b = SharedSandbox::borrow(&SHARED, &json!({}));
    let (api, sb) = (b.api.clone(), b.id.clone());
    (b, api, sb)
}

/// The shell of [`echo_process`]: echoes its stdin lines, `eof` on stderr, exits 4.
const ECHO: &str = "echo start; while read l; do echo got:$l; done; echo eof >&2; exit 4";

/// Starts [`ECHO`], writes `one` then `two` with end of file to its stdin, and waits for
/// its end: its id and record.
fn echo_process(api: &Api, sb: &str) -> (String, Value) {
    let base = format!("/v1/sandboxes/{sb}/processes");
    let p = start_process(api, sb, &json!({ "shell": ECHO }));
    assert_eq!(
        api.request("POST", &format!("{base}/{p}/stdin"), &[], b"one\n".to_vec())
            .status,
        200
    );
    assert_eq!(
        api.request(
            "POST",
            &format!("{base}/{p}/stdin?close=true"),
            &[],
            b"two\n".to_vec()
        )
        .status,
        200
    );
    let done = wait_process_end(api, sb, &p, "the process ends after its stdin closed");
    (p, done)
}

#[test]
fn a_process_starts_at_once_with_an_id_and_a_pid_and_is_listed_running() {
    let (_b, api, sb) = shared_sandbox();
    let base = format!("/v1/sandboxes/{sb}/processes");
    let t0 = Instant::now();
    let p = api
        .post(&base, &json!({ "shell": ECHO }))
        .expect(200, "start");
    assert!(t0.elapsed() < Duration::from_secs(5));
    let p1 = p["id"].as_str().expect("id").to_owned();
    assert!(p1.starts_with("proc_"), "{p}");
    assert!(p["pid"].as_u64().is_some_and(|n| n > 0), "{p}");
    let listed = api.get(&base).expect(200, "list");
    let mine = listed["processes"]
        .as_array()
        .expect("processes")
        .iter()
        .find(|x| x["id"] == p1.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("listed: {listed}"));
    assert_eq!(mine["state"], "running", "{mine}");
    let got = api.get(&format!("{base}/{p1}")).expect(200, "get");
    assert_eq!(
        (&got["state"], &got["result"]),
        (&json!("running"), &Value::Null),
        "{got}"
    );
}

#[test]
fn stdin_bodies_reach_a_process_and_close_ends_its_input() {
    let (_b, api, sb) = shared_sandbox();
    let (p, done) = echo_process(&api, &sb);
    assert_eq!(done["state"], "exited", "{done}");
    let res = &done["result"];
    assert_eq!(
        (&res["exit_code"], &res["reason"]),
        (&json!(4), &json!("exited")),
        "{res}"
    );
    assert_eq!(
        (&res["stdout"], &res["stderr"]),
        (&json!("start\ngot:one\ngot:two\n"), &json!("eof\n"))
    );
    assert_listed(&api, &sb, &p);
}

#[test]
fn the_output_of_an_ended_process_replays_from_the_start_with_the_result_last() {
    let (_b, api, sb) = shared_sandbox();
    let (p, _) = echo_process(&api, &sb);
    let (status, _, r) = api
        .open(
            "GET",
            &format!("/v1/sandboxes/{sb}/processes/{p}/output"),
            &[],
            (),
        )
        .expect("output");
    assert_eq!(status, 200);
    let lines = read_ndjson(r, Instant::now());
    assert_eq!(stream_text(&lines, "stdout"), "start\ngot:one\ngot:two\n");
    assert_eq!(stream_text(&lines, "stderr"), "eof\n");
    let last = &lines.last().expect("lines").1;
    assert_eq!(
        (&last["type"], &last["exit_code"]),
        (&json!("result"), &json!(4)),
        "{last}"
    );
}

#[test]
fn follow_streams_live_output_until_a_signal_ends_the_process() {
    let (_b, api, sb) = shared_sandbox();
    let base = format!("/v1/sandboxes/{sb}/processes");
    let p = start_process(
        &api,
        &sb,
        &json!({"shell": "trap 'echo term; exit 7' TERM; echo ready; while true; do sleep 0.05; done"}),
    );
    let (status, _, r) = api
        .open("GET", &format!("{base}/{p}/output?follow=true"), &[], ())
        .expect("follow");
    assert_eq!(status, 200);
    let (line, r) = first_line(r);
    let v: Value = serde_json::from_str(&line).expect("json");
    assert_eq!(
        (&v["type"], &v["data"]),
        (&json!("stdout"), &json!("ready\n")),
        "the first line is live output: {v}"
    );
    assert_eq!(
        api.get(&format!("{base}/{p}")).expect(200, "get")["state"],
        "running"
    );
    api.post(&format!("{base}/{p}/signal"), &json!({"signal": "SIGTERM"}))
        .expect(200, "SIGTERM");
    let rest = read_ndjson(r, Instant::now());
    assert!(
        stream_text(&rest, "stdout").contains("term\n"),
        "the trap ran: {rest:?}"
    );
    let last = &rest.last().expect("a result").1;
    assert_eq!(
        (&last["type"], &last["exit_code"]),
        (&json!("result"), &json!(7)),
        "{last}"
    );
    assert_listed(&api, &sb, &p);
}

#[test]
fn a_killing_signal_by_number_leaves_no_exit_code_and_names_the_signal() {
    let (_b, api, sb) = shared_sandbox();
    let p = start_process(&api, &sb, &json!({"cmd": ["sleep", "100"]}));
    api.post(
        &format!("/v1/sandboxes/{sb}/processes/{p}/signal"),
        &json!({"signal": 9}),
    )
    .expect(200, "signal 9");
    let v = wait_process_end(&api, &sb, &p, "sleep dies of SIGKILL");
    let res = &v["result"];
    assert_eq!(
        (&res["exit_code"], &res["signal"]),
        (&Value::Null, &json!("SIGKILL")),
        "{v}"
    );
    assert!(
        res["reason"] == "killed" || res["reason"] == "signaled",
        "{v}"
    );
    assert_listed(&api, &sb, &p);
}

#[test]
fn stdin_in_the_start_body_is_written_then_closed() {
    let (_b, api, sb) = shared_sandbox();
    let p = start_process(
        &api,
        &sb,
        &json!({"cmd": ["cat"], "stdin": "from the body"}),
    );
    let v = wait_process_end(&api, &sb, &p, "cat ends");
    assert_eq!(v["result"]["stdout"], "from the body");
    assert_listed(&api, &sb, &p);
}

#[test]
fn a_bad_signal_or_process_body_is_a_400() {
    let (_b, api, sb) = shared_sandbox();
    let base = format!("/v1/sandboxes/{sb}/processes");
    let p = start_process(&api, &sb, &json!({"cmd": ["sleep", "100"]}));
    let signal = format!("{base}/{p}/signal");
    refused(
        &api.post(&signal, &json!({"signal": "SIGNOPE"})),
        400,
        "bad_request",
        "signal",
        "an unknown signal",
    );
    refused(
        &api.post(&signal, &json!({"signal": 0})),
        400,
        "bad_request",
        "signal",
        "signal 0",
    );
    refused(
        &api.post(&signal, &json!({})),
        400,
        "bad_request",
        "signal",
        "no signal",
    );
    refused(
        &api.post(&base, &json!({"cmd": "sleep"})),
        400,
        "bad_request",
        "cmd",
        "a bad process body",
    );
}

#[test]
fn an_unknown_process_is_a_404_on_every_route() {
    let (_b, api, sb) = shared_sandbox();
    let base = format!("/v1/sandboxes/{sb}/processes");
    for missing in ["proc_00000000deadbeef", "not-a-proc", "proc_..%2F..%2Fetc"] {
        api.get(&format!("{base}/{missing}"))
            .expect_error(404, "not_found", "an unknown process");
        api.get(&format!("{base}/{missing}/output")).expect_error(
            404,
            "not_found",
            "the output of an unknown process",
        );
        api.request(
            "POST",
            &format!("{base}/{missing}/stdin"),
            &[],
            b"x".to_vec(),
        )
        .expect_error(404, "not_found", "stdin of an unknown process");
        api.post(
            &format!("{base}/{missing}/signal"),
            &json!({"signal": "KILL"}),
        )
        .expect_error(404, "not_found", "signal to an unknown process");
    }
}

/// Opens the terminal of the shared sandbox at `query` (`?cols=…` or empty).
fn terminal(b: &Borrowed, query: &str) -> Terminal {
    ws_connect(
        &b.srv.url,
        Some(&b.key),
        &format!("/v1/sandboxes/{}/pty{query}", b.id),
    )
    .unwrap_or_else(|(s, b)| panic!("open the terminal: {s} {b}"))
}

/// Types `line` into the terminal.
fn type_in(ws: &mut Terminal, line: &str) {
    ws.send(tungstenite::Message::binary(line.as_bytes().to_vec()))
        .expect("send");
}

#[test]
fn the_terminal_runs_typed_input_in_a_shell() {
    let (b, _, _) = shared_sandbox();
    let mut ws = terminal(&b, "");
    let mut seen = String::new();
    // `$((40+2))` shows 42 only if the shell evaluated it.
    type_in(&mut ws, "echo hi-$((40+2))\n");
    read_until(&mut ws, "hi-42", &mut seen);
}

#[test]
fn the_terminal_takes_its_size_from_the_query_and_resizes() {
    let (b, _, _) = shared_sandbox();
    let mut ws = terminal(&b, "?cols=120&rows=30");
    let mut seen = String::new();
    type_in(&mut ws, "stty size\n");
    read_until(&mut ws, "30 120", &mut seen);
    ws.send(tungstenite::Message::text(r#"{"resize":[100,40]}"#))
        .expect("resize");
    type_in(&mut ws, "stty size\n");
    read_until(&mut ws, "40 100", &mut seen);
}

#[test]
fn exit_in_the_terminal_sends_an_exit_frame_with_its_code() {
    let (b, _, _) = shared_sandbox();
    let mut ws = terminal(&b, "");
    let mut seen = String::new();
    type_in(&mut ws, "exit 5\n");
    let exit = read_exit_frame(&mut ws, &mut seen);
    assert_eq!(exit["exit_code"], 5, "{exit}");
}

#[test]
fn a_terminal_client_that_goes_away_ends_its_shell_and_processes() {
    let (b, api, sb) = shared_sandbox();
    let mut ws = terminal(&b, "");
    let mut seen = String::new();
    type_in(&mut ws, "echo go; sleep 4.321\n");
    read_until(&mut ws, "go\r\n", &mut seen);
    wait_for(
        Duration::from_secs(3),
        "the terminal's command runs",
        || running_in(&api, &sb, "sleep 4.321").then_some(()),
    );
    drop(ws);
    wait_for(
        Duration::from_secs(3),
        "closing the WebSocket ends the terminal's processes",
        || (!running_in(&api, &sb, "sleep 4.321")).then_some(()),
    );
}

#[test]
fn a_terminal_on_a_missing_sandbox_is_refused_at_the_handshake() {
    let t = Tenant::new();
    let Err((status, body)) = ws_connect(
        &t.srv.url,
        Some(&t.key),
        "/v1/sandboxes/sb_00000000deadbeef/pty",
    ) else {
        panic!("refused")
    };
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("not_found"), "{body}");
}
