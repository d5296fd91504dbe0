//! End-to-end tests of what the server keeps of calls: the call records (newest first, by
//! sandbox, without env values or output), usage per tenant, and the exec metrics.
//!
//! The tests share one `locker serve` (see `locker_tests::shared`), each with a tenant of
//! its own (the listing tests share one with four calls), but for the usage test, the one
//! test of this binary on tenant `default`; the metrics of
//! running sandboxes count the whole server and start their own. Run as root after
//! `scripts/setup build`: `cargo test --release -p locker-tests --test server -- records::`.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use locker_tests::answers::{now_s, parse_time, refused, sandbox_id, start_process};
use locker_tests::server::{enc, Api, Server};
use locker_tests::shared::{LogOnFailure, Tenant};
use locker_tests::streams::{exec_stream, read_ndjson};
use locker_tests::wait_for;
use serde_json::{json, Value};

/// An env value no record may show.
const SECRET: &str = "s3cr3t-value-42";

/// Four calls of a tenant: three in one sandbox (a shell with cwd and env, a failing argv,
/// a streamed one), then one in another sandbox.
struct FourCalls {
    sb: String,
    /// The create answer of `sb`.
    sbv: Value,
    r1: Value,
    r2: Value,
    streamed: Value,
    other: Value,
}

impl FourCalls {
    fn make(api: &Api) -> FourCalls {
        let sbv = api.create_sandbox(&json!({}));
        let sb = sandbox_id(&sbv);
        let other_sb = sandbox_id(&api.create_sandbox(&json!({})));
        let r1 = api.exec(
            &sb,
            &json!({"shell": "echo hi", "cwd": "/tmp", "env": {"SECRET_NAME": SECRET}}),
        );
        let r2 = api.exec(&sb, &json!({"cmd": ["false"]}));
        let (status, _, r) = exec_stream(api, &sb, &json!({"cmd": ["echo", "streamed"]}));
        assert_eq!(status, 200);
        let streamed = read_ndjson(r, Instant::now())
            .last()
            .expect("result")
            .1
            .clone();
        let other = api.exec(&other_sb, &json!({"cmd": ["true"]}));
        FourCalls {
            sb,
            sbv,
            r1,
            r2,
            streamed,
            other,
        }
    }
}

static FOUR: OnceLock<(Tenant, FourCalls)> = OnceLock::new();

/// The four calls the listing tests share, on a tenant of their own (made on first use),
/// and the guard that prints the server's log if the test fails.
fn four_calls() -> (&'static Tenant, &'static FourCalls, LogOnFailure) {
    let (t, c) = FOUR.get_or_init(|| {
        let t = Tenant::new();
        let c = FourCalls::make(&t.api());
        (t, c)
    });
    (t, c, LogOnFailure)
}

fn call_id(v: &Value) -> String {
    v["call_id"].as_str().expect("call_id").to_owned()
}

/// The record of call `id` in a list of calls.
#[track_caller]
fn record(calls: &Value, id: &str) -> Value {
    calls["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no record of {id}: {calls}"))
        .clone()
}

#[test]
fn the_calls_of_a_sandbox_are_listed_newest_first() {
    let (t, c, _log) = four_calls();
    let api = t.api();
    let calls = api
        .get(&format!("/v1/calls?sandbox_id={}", c.sb))
        .expect(200, "calls of a sandbox");
    let got: Vec<String> = calls["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .map(|c| c["id"].as_str().expect("id").to_owned())
        .collect();
    assert_eq!(
        got,
        [call_id(&c.streamed), call_id(&c.r2), call_id(&c.r1)],
        "this sandbox's calls, newest first"
    );
}

#[test]
fn a_call_record_keeps_the_command_and_context_but_no_env_value_or_output() {
    let (t, c, _log) = four_calls();
    let api = t.api();
    let resp = api.get(&format!("/v1/calls?sandbox_id={}", c.sb));
    let calls = resp.expect(200, "calls of a sandbox");
    assert!(
        !resp.text().contains(SECRET),
        "env values never appear in call records"
    );
    let rec = record(&calls, &call_id(&c.r1));
    assert_eq!(rec["command"], json!(["/bin/sh", "-c", "echo hi"]), "{rec}");
    assert_eq!(rec["cwd"], "/tmp");
    assert_eq!(rec["env_keys"], json!(["SECRET_NAME"]));
    assert_eq!(rec["sandbox_id"], c.sb.as_str());
    assert_eq!(rec["template_digest"], c.sbv["template_digest"]);
    assert!(
        rec["template_digest"]
            .as_str()
            .is_some_and(|d| !d.is_empty()),
        "{rec}"
    );
    assert_eq!(rec["runtime"], "jail");
    assert!(
        rec["key_id"]
            .as_str()
            .is_some_and(|k| k.starts_with("key_")),
        "the caller's key id: {rec}"
    );
    assert_eq!(rec["key_id"].as_str(), t.key_id.as_deref(), "{rec}");
    assert_eq!(rec["egress_denied"], json!([]));
    assert_eq!(rec["result"]["call_id"], call_id(&c.r1).as_str());
    assert_eq!(
        (&rec["result"]["exit_code"], &rec["result"]["stdout_bytes"]),
        (&json!(0), &json!(3))
    );
    assert_eq!(
        (&rec["result"]["stdout"], &rec["result"]["stderr"]),
        (&json!(""), &json!("")),
        "records keep no output bodies"
    );
    parse_time(rec["created_at"].as_str().expect("created_at"));
    let rec2 = record(&calls, &call_id(&c.r2));
    assert_eq!(
        (&rec2["command"], &rec2["result"]["exit_code"]),
        (&json!(["false"]), &json!(1)),
        "{rec2}"
    );
}

#[test]
fn the_calls_of_a_tenant_are_listed_newest_first_up_to_a_limit() {
    let (t, c, _log) = four_calls();
    let api = t.api();
    let all = api.get("/v1/calls").expect(200, "all calls");
    assert_eq!(
        all["calls"].as_array().map(Vec::len),
        Some(4),
        "every call of the tenant: {all}"
    );
    assert_eq!(
        all["calls"][0]["id"],
        call_id(&c.other).as_str(),
        "newest first"
    );
    let one = api.get("/v1/calls?limit=1").expect(200, "limit=1");
    assert_eq!(one["calls"].as_array().map(Vec::len), Some(1));
}

#[test]
fn a_bad_calls_query_is_a_400_and_an_unknown_sandbox_has_no_calls() {
    let api = Tenant::new().api();
    refused(
        &api.get("/v1/calls?limit=0"),
        400,
        "bad_request",
        "limit",
        "limit=0",
    );
    refused(
        &api.get("/v1/calls?limit=many"),
        400,
        "bad_request",
        "limit",
        "limit=many",
    );
    refused(
        &api.get("/v1/calls?sandbox=x"),
        400,
        "bad_request",
        "sandbox",
        "an unknown parameter",
    );
    assert_eq!(
        api.get("/v1/calls?sandbox_id=sb_00000000deadbeef")
            .expect(200, "calls of nothing")["calls"],
        json!([])
    );
}

#[test]
fn a_background_process_is_recorded_once_it_ends() {
    let t = Tenant::new();
    let api = t.api();
    let sb = t.sandbox(&json!({}));
    start_process(&api, &sb, &json!({"cmd": ["echo", "bg"]}));
    wait_for(
        Duration::from_secs(5),
        "the background process's record",
        || {
            let c = api
                .get(&format!("/v1/calls?sandbox_id={sb}"))
                .expect(200, "calls");
            c["calls"]
                .as_array()
                .expect("calls")
                .iter()
                .any(|c| c["command"] == json!(["echo", "bg"]))
                .then_some(())
        },
    );
}

#[test]
fn usage_counts_the_tenants_execs_and_since_filters_them() {
    let t = Tenant::default_tenant();
    let api = t.api();
    let sb = t.sandbox(&json!({}));
    for _ in 0..4 {
        api.exec(&sb, &json!({"cmd": ["true"]}));
    }
    let u = api.get("/v1/usage").expect(200, "usage");
    assert_eq!(u["tenant"], "default");
    assert!(
        u["execs"].as_u64().is_some_and(|n| n >= 4),
        "execs counts every exec: {u}"
    );
    assert_eq!(u["runs"], 0, "{u}");
    assert!(u["cpu_ms"].is_u64() && u["sandbox_seconds"].is_u64(), "{u}");
    let later = api
        .get(&format!("/v1/usage?since={}", enc("2100-01-01T00:00:00Z")))
        .expect(200, "usage since the future");
    assert_eq!(later["execs"], 0, "{later}");
    let unix = api
        .get(&format!("/v1/usage?since={}", now_s() + 3600))
        .expect(200, "usage since unix seconds");
    assert_eq!(unix["execs"], 0, "{unix}");
    refused(
        &api.get("/v1/usage?since=yesterday"),
        400,
        "bad_request",
        "since",
        "a bad since",
    );
}

#[test]
fn metrics_count_the_execs_and_the_running_sandboxes() {
    // A server of its own: the gauge counts every tenant's sandboxes.
    let srv = Server::start();
    let api = srv.api();
    FourCalls::make(&api);
    let m = srv.anon().get("/metrics").text();
    let count = m
        .lines()
        .find_map(|l| l.strip_prefix("locker_exec_duration_seconds_count "))
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(
        count.is_some_and(|n| n >= 4),
        "locker_exec_duration_seconds_count counts the execs:\n{m}"
    );
    assert!(m.contains("locker_sandboxes{state=\"running\"} 2"), "{m}");
}
