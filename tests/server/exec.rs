//! End-to-end tests of exec: the typed ExecResult (exit code, signal, timeout, output caps,
//! timings), how a command is given (argv, shell, cwd, env, stdin, user), bad bodies, the
//! NDJSON stream that arrives as output is produced and kills its command when closed, and
//! calls in flight when their sandbox is deleted.
//!
//! The tests share one `locker serve` (see `locker_tests::shared`); those that only run
//! commands share one sandbox, the delete under calls in flight has its own. Run as root after `scripts/setup build`:
//! `cargo test --release -p locker-tests --test server -- exec::`.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use locker_tests::answers::{refuse_all, running_in, start_process, BadBody};
use locker_tests::server::Api;
use locker_tests::shared::{Borrowed, SharedSandbox, Tenant};
use locker_tests::streams::{exec_stream, first_line, read_ndjson, stream_text, NDJSON};
use locker_tests::{traces_of, wait_for};
use serde_json::{json, Value};

/// A tenant with one sandbox (created with `body`): the tenant, its client, the sandbox id.
fn sandbox_of_its_own(body: Value) -> (Tenant, Api, String) {
    let t = Tenant::new();
    let sb = t.sandbox(&body);
    let api = t.api();
    (t, api, sb)
}

static SHARED: OnceLock<SharedSandbox> = OnceLock::new();

/// The sandbox the tests that only run commands share (with an env of its own): the
/// borrow, its tenant's client, the sandbox id.
fn shared_sandbox() -> (Borrowed, Api, String) {
    let b = SharedSandbox::borrow(
        &SHARED,
        &json!({"env": {"FROM_SANDBOX": "s1", "OVERRIDE": "sandbox"}}),
    );
    let (api, sb) = (b.api.clone(), b.id.clone());
    (b, api, sb)
}

/// The stdout of an exec.
#[track_caller]
fn out(api: &Api, sb: &str, body: Value) -> String {
    api.exec(sb, &body)["stdout"]
        .as_str()
        .expect("stdout")
        .to_owned()
}

#[test]
fn a_failing_command_is_a_200_with_its_exit_code_and_its_output_apart() {
    let (_b, api, sb) = shared_sandbox();
    let r = api.exec(&sb, &json!({"shell": "echo out; echo err >&2; exit 3"}));
    assert!(
        r["call_id"]
            .as_str()
            .is_some_and(|c| c.starts_with("call_")),
        "{r}"
    );
    assert_eq!(r["exit_code"], 3, "{r}");
    assert_eq!(r["signal"], Value::Null);
    assert_eq!(r["reason"], "exited");
    assert_eq!(
        (r["stdout"].as_str(), r["stderr"].as_str()),
        (Some("out\n"), Some("err\n"))
    );
    assert_eq!(
        (&r["stdout_truncated"], &r["stderr_truncated"]),
        (&json!(false), &json!(false))
    );
    assert_eq!(
        (&r["stdout_bytes"], &r["stderr_bytes"]),
        (&json!(4), &json!(4))
    );
    assert_eq!(r["output_path"], Value::Null);
    assert_eq!(r["changes"], Value::Null);
    let t = &r["timings"];
    for k in ["queue_ms", "start_ms", "run_ms", "total_ms"] {
        assert!(t[k].as_f64().is_some_and(|v| v >= 0.0), "timings.{k}: {r}");
    }
    assert!(
        t["total_ms"].as_f64() >= t["run_ms"].as_f64(),
        "total covers run: {t}"
    );
    assert!(
        r["usage"]["cpu_ms"].is_u64() && r["usage"]["peak_memory_bytes"].is_u64(),
        "{r}"
    );
}

#[test]
fn argv_runs_without_a_shell_and_cwd_sets_the_directory() {
    let (_b, api, sb) = shared_sandbox();
    assert_eq!(
        out(
            &api,
            &sb,
            json!({"cmd": ["printf", "%s|", "a b", "c'd", "$HOME"]})
        ),
        "a b|c'd|$HOME|"
    );
    assert_eq!(
        out(&api, &sb, json!({"cmd": ["pwd"], "cwd": "/tmp"})),
        "/tmp\n"
    );
}

#[test]
fn the_calls_env_goes_over_the_sandboxes() {
    let (_b, api, sb) = shared_sandbox();
    assert_eq!(
        out(
            &api,
            &sb,
            json!({"shell": "echo $FROM_SANDBOX $OVERRIDE $K", "env": {"OVERRIDE": "call", "K": "v"}})
        ),
        "s1 call v\n"
    );
}

#[test]
fn stdin_and_raw_stdin_reach_the_command() {
    let (_b, api, sb) = shared_sandbox();
    assert_eq!(
        out(&api, &sb, json!({"cmd": ["cat"], "stdin": "hello\nworld"})),
        "hello\nworld"
    );
    assert_eq!(
        out(
            &api,
            &sb,
            json!({"cmd": ["od", "-An", "-tx1"], "stdin_b64": "AP8Q"})
        )
        .trim(),
        "00 ff 10"
    );
}

#[test]
fn commands_run_as_root_unless_a_user_is_given() {
    let (_b, api, sb) = shared_sandbox();
    assert_eq!(
        out(&api, &sb, json!({"cmd": ["id", "-u"]})),
        "0\n",
        "root by default"
    );
    assert_eq!(
        out(&api, &sb, json!({"cmd": ["id", "-u"], "user": "nobody"})),
        "65534\n"
    );
}

#[test]
fn a_missing_program_is_the_commands_failure_with_127() {
    let (_b, api, sb) = shared_sandbox();
    let r = api.exec(&sb, &json!({"cmd": ["/no/such/program"]}));
    assert_eq!(
        (r["exit_code"].as_i64(), r["reason"].as_str()),
        (Some(127), Some("exited")),
        "a missing program is the command's failure: {r}"
    );
    assert!(
        r["stderr"]
            .as_str()
            .is_some_and(|s| s.contains("/no/such/program")),
        "{r}"
    );
}

#[test]
fn a_signal_ends_a_command_with_no_exit_code_and_the_signals_name() {
    let (_b, api, sb) = shared_sandbox();
    let r = api.exec(&sb, &json!({"shell": "kill -SEGV $$"}));
    assert_eq!(
        (&r["reason"], &r["signal"], &r["exit_code"]),
        (&json!("signaled"), &json!("SIGSEGV"), &Value::Null),
        "{r}"
    );
}

#[test]
fn a_timeout_keeps_the_output_so_far_and_kills_the_whole_tree() {
    let (_b, api, sb) = shared_sandbox();
    // setsid and double forks too.
    let started = Instant::now();
    let r = api.exec(&sb, &json!({"shell": "echo before; (setsid sleep 31 >/dev/null 2>&1 &); (sleep 32 >/dev/null 2>&1 &); sleep 33", "timeout_ms": 700}));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the timeout was enforced: {:?}",
        started.elapsed()
    );
    assert_eq!(
        (&r["reason"], &r["exit_code"]),
        (&json!("timeout"), &Value::Null),
        "{r}"
    );
    assert_eq!(
        r["stdout"], "before\n",
        "the output until the kill is kept: {r}"
    );
    assert!(
        r["timings"]["run_ms"]
            .as_f64()
            .is_some_and(|ms| (650.0..5000.0).contains(&ms)),
        "run_ms ≈ timeout_ms: {r}"
    );
    wait_for(
        Duration::from_secs(3),
        "every process of a timed-out command is gone (sleep 31/32/33)",
        || {
            let ps = api.sh(&sb, "ps -eo args");
            (!ps.contains("sleep 31") && !ps.contains("sleep 32") && !ps.contains("sleep 33"))
                .then_some(())
        },
    );
}

#[test]
fn the_output_cap_keeps_the_head_and_tail_and_the_whole_stream_in_output_path() {
    let (_b, api, sb) = shared_sandbox();
    let r = api.exec(&sb, &json!({"shell": "printf HEAD; head -c 300000 /dev/zero | tr '\\0' x; printf TAIL; echo small >&2", "max_output_bytes": 1000}));
    assert_eq!(r["exit_code"], 0, "{r}");
    let so = r["stdout"].as_str().expect("stdout");
    assert_eq!(r["stdout_truncated"], true);
    assert_eq!(r["stdout_bytes"], 300_008);
    assert!(
        so.starts_with("HEADxxx") && so.ends_with("xxxTAIL"),
        "head and tail are kept: {}…{}",
        &so[..20],
        &so[so.len() - 20..]
    );
    assert!(
        so.contains("bytes omitted]"),
        "a marker line says what was cut: {so}"
    );
    assert!(
        so.len() < 1000 + 200,
        "at most max_output_bytes plus the marker: {} bytes",
        so.len()
    );
    assert_eq!(
        (&r["stderr"], &r["stderr_truncated"]),
        (&json!("small\n"), &json!(false)),
        "the cap is per stream"
    );
    let path = r["output_path"]
        .as_str()
        .unwrap_or_else(|| panic!("a truncated result names output_path: {r}"));
    let full = api.read_file(&sb, path);
    assert_eq!(
        full.status,
        200,
        "output_path is readable through the files API: {}",
        full.text()
    );
    assert_eq!(full.body.len(), 300_008);
    assert!(full.body.starts_with(b"HEADxxx") && full.body.ends_with(b"xxxTAIL"));
}

#[test]
fn the_default_output_cap_is_64_kib_per_stream() {
    let (_b, api, sb) = shared_sandbox();
    let r = api.exec(
        &sb,
        &json!({"shell": "head -c 100000 /dev/zero | tr '\\0' y"}),
    );
    assert_eq!(
        (&r["stdout_truncated"], &r["stdout_bytes"]),
        (&json!(true), &json!(100_000))
    );
    assert!(
        r["stdout"].as_str().expect("stdout").len() <= 65_536 + 200,
        "the default cap is 65536"
    );
}

#[test]
fn a_malformed_exec_body_is_refused_naming_the_field() {
    let (_b, api, sb) = shared_sandbox();
    let t = |extra: Value| {
        let mut b = json!({"shell": "true"});
        b.as_object_mut()
            .expect("an object")
            .extend(extra.as_object().expect("an object").clone());
        b
    };
    let bad: Vec<BadBody> = vec![
        (json!({}), 400, "bad_request", "cmd"),
        (json!({"cmd": "ls"}), 400, "bad_request", "cmd"),
        (json!({"cmd": []}), 400, "bad_request", "cmd"),
        (
            json!({"cmd": ["ls"], "shell": "ls"}),
            400,
            "bad_request",
            "shell",
        ),
        (t(json!({"bogus": true})), 400, "bad_request", "bogus"),
        (
            t(json!({"timeout_ms": -1})),
            400,
            "bad_request",
            "timeout_ms",
        ),
        (
            t(json!({"timeout_ms": 0})),
            400,
            "bad_request",
            "timeout_ms",
        ),
        (
            t(json!({"timeout_ms": "soon"})),
            400,
            "bad_request",
            "timeout_ms",
        ),
        (
            t(json!({"max_output_bytes": 0})),
            400,
            "bad_request",
            "max_output_bytes",
        ),
        (
            t(json!({"max_output_bytes": -10})),
            400,
            "bad_request",
            "max_output_bytes",
        ),
        (
            t(json!({"max_output_bytes": 1u64 << 40})),
            400,
            "bad_request",
            "max_output_bytes",
        ),
        (t(json!({"cwd": "tmp"})), 400, "bad_request", "cwd"),
        (
            t(json!({"cwd": "/no/such/dir"})),
            400,
            "bad_request",
            "/no/such/dir",
        ),
        (t(json!({"env": {"A": 1}})), 400, "bad_request", "env"),
        (
            t(json!({"stdin": "a", "stdin_b64": "YQ=="})),
            400,
            "bad_request",
            "stdin",
        ),
        (
            t(json!({"stdin_b64": "***"})),
            400,
            "bad_request",
            "stdin_b64",
        ),
        (
            t(json!({"user": "no-such-user"})),
            400,
            "bad_request",
            "no-such-user",
        ),
        (
            json!({"cmd": ["cat"], "stdin": "z".repeat(900 << 10)}),
            413,
            "payload_too_large",
            "stdin",
        ),
    ];
    refuse_all(&api, &format!("/v1/sandboxes/{sb}/exec"), &bad);
}

#[test]
fn exec_in_a_missing_sandbox_is_a_404() {
    Tenant::new()
        .api()
        .post(
            "/v1/sandboxes/sb_00000000deadbeef/exec",
            &json!({"shell": "true"}),
        )
        .expect_error(404, "not_found", "exec in a missing sandbox");
}

#[test]
fn exec_streams_ndjson_lines_as_the_output_arrives() {
    let (_b, api, sb) = shared_sandbox();
    let t0 = Instant::now();
    let (status, headers, reader) = exec_stream(
        &api,
        &sb,
        &json!({"shell": "echo first; echo warn >&2; sleep 2; echo second"}),
    );
    assert_eq!(status, 200);
    let ctype = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    assert!(
        ctype.starts_with("application/x-ndjson"),
        "content type: {ctype}"
    );
    let lines = read_ndjson(reader, t0);
    let (last_t, last) = lines.last().expect("at least the result line").clone();
    assert_eq!(
        last["type"], "result",
        "the last line is the result: {last}"
    );
    assert_eq!(
        lines.iter().filter(|(_, v)| v["type"] == "result").count(),
        1,
        "one result line"
    );
    for (_, v) in &lines[..lines.len() - 1] {
        assert!(
            v["type"] == "stdout" || v["type"] == "stderr",
            "output lines are stdout or stderr: {v}"
        );
        assert!(v["data"].is_string(), "{v}");
    }
    let (first_t, _) = lines
        .iter()
        .find(|(_, v)| {
            v["type"] == "stdout" && v["data"].as_str().is_some_and(|d| d.contains("first"))
        })
        .expect("a stdout line with `first`");
    // `first` must arrive while the command sleeps, not with the result two seconds later.
    assert!(
        last_t >= *first_t + Duration::from_millis(1500),
        "`first` arrived at {first_t:?}, the result at {last_t:?}: the output was not streamed as it came"
    );
    assert_eq!(stream_text(&lines, "stdout"), "first\nsecond\n");
    assert_eq!(stream_text(&lines, "stderr"), "warn\n");
    assert_eq!(
        (&last["exit_code"], &last["stdout"], &last["stderr"]),
        (&json!(0), &json!("first\nsecond\n"), &json!("warn\n")),
        "{last}"
    );
    assert!(last["call_id"]
        .as_str()
        .is_some_and(|c| c.starts_with("call_")));
}

#[test]
fn a_bad_body_asking_for_ndjson_is_a_plain_error_answer() {
    let (_b, api, sb) = shared_sandbox();
    let bad = serde_json::to_vec(&json!({"shell": "true", "timeout_ms": 0})).expect("json");
    api.request("POST", &format!("/v1/sandboxes/{sb}/exec"), &NDJSON, bad)
        .expect_error(
            400,
            "bad_request",
            "a bad body with Accept: application/x-ndjson",
        );
}

#[test]
fn closing_the_ndjson_stream_kills_the_command() {
    let (b, api, sb) = shared_sandbox();
    let t0 = Instant::now();
    // A client of its own, so dropping it closes the connection (nothing pools it).
    let one_off = Api::new(&b.srv.url, Some(&b.key));
    let (status, _, reader) = exec_stream(
        &one_off,
        &sb,
        &json!({"shell": "echo started; sleep 3.217; touch /tmp/close-marker"}),
    );
    assert_eq!(status, 200);
    let (first, lines) = first_line(reader);
    assert!(first.contains("started"), "{first}");
    assert!(
        running_in(&api, &sb, "sleep 3.217"),
        "the command runs while the stream is open"
    );
    drop(lines);
    drop(one_off);
    wait_for(
        Duration::from_secs(3),
        "the command dies when its NDJSON stream is closed",
        || (!running_in(&api, &sb, "sleep 3.217")).then_some(()),
    );
    if let Some(rest) = Duration::from_millis(3700).checked_sub(t0.elapsed()) {
        std::thread::sleep(rest);
    }
    api.read_file(&sb, "/tmp/close-marker").expect_error(
        404,
        "not_found",
        "the killed command never ran its last step",
    );
}

#[test]
fn deleting_a_sandbox_ends_its_running_calls_as_killed() {
    let (t, api, sb) = sandbox_of_its_own(json!({}));
    let plain = {
        let (api, path) = (api.clone(), format!("/v1/sandboxes/{sb}/exec"));
        std::thread::spawn(move || api.post(&path, &json!({"shell": "sleep 31.5"})))
    };
    let (status, _, stream) =
        exec_stream(&api, &sb, &json!({"shell": "echo streaming; sleep 32.5"}));
    assert_eq!(status, 200);
    let (first, stream) = first_line(stream);
    assert!(first.contains("streaming"), "{first}");
    let p = start_process(&api, &sb, &json!({"shell": "echo bg; sleep 33.5"}));
    let (status, _, follow) = api
        .open(
            "GET",
            &format!("/v1/sandboxes/{sb}/processes/{p}/output?follow=true"),
            &[],
            (),
        )
        .expect("follow");
    assert_eq!(status, 200);
    wait_for(Duration::from_secs(5), "all three commands run", || {
        let ps = api.sh(&sb, "ps -eo args");
        ["sleep 31.5", "sleep 32.5", "sleep 33.5"]
            .iter()
            .all(|c| ps.contains(c))
            .then_some(())
    });

    let t0 = Instant::now();
    assert_eq!(
        api.delete(&format!("/v1/sandboxes/{sb}")).status,
        204,
        "delete with calls in flight"
    );
    // A killed command is a 200 that says so, not a platform error.
    let r = plain.join().expect("the exec thread");
    let v = r.expect(200, "an exec whose sandbox was deleted under it");
    assert_eq!(
        (&v["reason"], &v["exit_code"]),
        (&json!("killed"), &Value::Null),
        "{v}"
    );
    let rest = read_ndjson(stream, t0);
    let last = &rest
        .last()
        .unwrap_or_else(|| panic!("the stream ends with a result line: {rest:?}"))
        .1;
    assert_eq!(
        (&last["type"], &last["reason"]),
        (&json!("result"), &json!("killed")),
        "{last}"
    );
    let _ = read_ndjson(follow, t0);
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "every call ended promptly: {:?}",
        t0.elapsed()
    );
    let traces = traces_of(&sb, &t.srv.machine_dir(&sb));
    assert!(traces.is_empty(), "{traces:?}");
    // The killed calls are on record.
    let calls = api
        .get(&format!("/v1/calls?sandbox_id={sb}"))
        .expect(200, "calls");
    let reasons: Vec<&Value> = calls["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .filter(|c| {
            c["command"][2]
                .as_str()
                .is_some_and(|c| c.contains("sleep 3"))
        })
        .map(|c| &c["result"]["reason"])
        .collect();
    assert_eq!(reasons, [&json!("killed"), &json!("killed")], "{calls}");
}
