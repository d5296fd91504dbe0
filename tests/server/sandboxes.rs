//! End-to-end tests of a sandbox's life through the API: create (asked shape and defaults),
//! get, list and its filters, patch, TTL, pause and resume, idle pause, delete and expiry
//! leaving nothing on the host, bad create bodies, and quotas.
//!
//! The tests share one `locker serve` (see `locker_tests::shared`), each with a tenant of
//! its own; the check that refused creates leave no machine directory and the quotas (the
//! server's flags) start their own. Run as root after `scripts/setup build`:
//! `cargo test --release -p locker-tests --test server -- sandboxes::`.

use std::time::Duration;

use locker_tests::answers::{
    ids, now_s, parse_time, refuse_all, refused, sandbox, sandbox_id, start_process, state_of,
    wait_state, BadBody,
};
use locker_tests::server::{Api, Resp, Server};
use locker_tests::shared::Tenant;
use locker_tests::streams::post_oversized;
use locker_tests::{frozen, traces_of, wait_for};
use serde_json::{json, Value};

/// The create body of a sandbox with every field given.
fn red_body() -> Value {
    json!({
        "template": "default", "runtime": "auto", "cpus": 1, "memory_mb": 256, "disk_mb": 512, "ttl_s": 600,
        "env": {"GREETING": "hello from the sandbox"}, "network": {"egress": "none"},
        "metadata": {"team": "red", "n": "1"}
    })
}

/// The sorted ids the tenant's list answers with query `q`.
#[track_caller]
fn list(api: &Api, q: &str) -> Vec<String> {
    let mut v = ids(
        &api.get(&format!("/v1/sandboxes{q}"))
            .expect(200, &format!("list {q}")),
        "sandboxes",
    );
    v.sort();
    v
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[test]
fn a_sandbox_is_created_with_the_shape_and_times_it_asked_for() {
    let t = Tenant::new();
    let api = t.api();
    let before = now_s();
    let red = api.create_sandbox(&red_body());
    let id = sandbox_id(&red);
    assert_eq!(red["state"], "running", "{red}");
    assert_eq!(red["template"], "default");
    assert_eq!(red["runtime"], "jail", "auto resolves to the jail here");
    assert_eq!(red["cpus"].as_f64(), Some(1.0));
    assert_eq!(red["memory_mb"], 256);
    assert_eq!(red["disk_mb"], 512);
    assert_eq!(red["network"], json!({"egress": "none"}));
    assert_eq!(red["volumes"], json!([]));
    assert_eq!(red["metadata"], json!({"team": "red", "n": "1"}));
    let created = parse_time(red["created_at"].as_str().expect("created_at"));
    assert!(
        (before - 1..=now_s() + 1).contains(&created),
        "created_at is now: {red}"
    );
    assert_eq!(
        parse_time(red["expires_at"].as_str().expect("expires_at")),
        created + 600,
        "expires_at = created_at + ttl_s"
    );
    parse_time(red["last_active_at"].as_str().expect("last_active_at"));
    assert!(
        red["usage"]["cpu_ms"].is_u64() && red["usage"]["peak_memory_bytes"].is_u64(),
        "usage: {red}"
    );
    // The sandbox's env reaches every exec.
    assert_eq!(api.sh(&id, "echo $GREETING"), "hello from the sandbox\n");
}

#[test]
fn an_empty_create_body_gets_the_defaults() {
    let t = Tenant::new();
    let blue = t
        .api()
        .create_sandbox(&json!({"metadata": {"team": "blue"}}));
    sandbox_id(&blue);
    assert_eq!(
        (blue["cpus"].as_f64(), &blue["memory_mb"], &blue["disk_mb"]),
        (Some(1.0), &json!(512), &json!(2048)),
        "defaults: {blue}"
    );
    let ttl = parse_time(blue["expires_at"].as_str().expect("expires_at"))
        - parse_time(blue["created_at"].as_str().expect("created_at"));
    assert_eq!(ttl, 1800, "the default ttl_s is 1800");
    assert_eq!(
        blue["network"],
        json!({"egress": "none"}),
        "no network by default"
    );
}

#[test]
fn get_shows_what_create_answered() {
    let t = Tenant::new();
    let api = t.api();
    let red = api.create_sandbox(&red_body());
    let got = sandbox(&api, &sandbox_id(&red));
    for k in [
        "id",
        "state",
        "template",
        "runtime",
        "cpus",
        "memory_mb",
        "disk_mb",
        "network",
        "volumes",
        "metadata",
        "created_at",
        "expires_at",
    ] {
        assert_eq!(
            got[k], red[k],
            "GET shows the same `{k}` as the create answer"
        );
    }
}

#[test]
fn a_sandbox_that_does_not_exist_is_a_404() {
    Tenant::new()
        .api()
        .get("/v1/sandboxes/sb_00000000deadbeef")
        .expect_error(404, "not_found", "a sandbox that does not exist");
}

#[test]
fn list_filters_by_state_and_metadata() {
    let t = Tenant::new();
    let api = t.api();
    let red = t.sandbox(&json!({"metadata": {"team": "red", "n": "1"}}));
    let blue = t.sandbox(&json!({"metadata": {"team": "blue"}}));
    let both = sorted(vec![red.clone(), blue.clone()]);
    assert_eq!(list(&api, ""), both);
    assert_eq!(list(&api, "?state=running"), both);
    assert_eq!(list(&api, "?state=paused"), Vec::<String>::new());
    assert_eq!(list(&api, "?metadata.team=red"), vec![red.clone()]);
    assert_eq!(
        list(&api, "?metadata.team=red&metadata.n=1"),
        vec![red.clone()]
    );
    assert_eq!(
        list(&api, "?metadata.team=red&metadata.n=2"),
        Vec::<String>::new()
    );
    assert_eq!(
        list(&api, "?state=running&metadata.team=blue"),
        vec![blue.clone()]
    );
    assert_eq!(list(&api, "?metadata.team=green"), Vec::<String>::new());
    api.post_empty(&format!("/v1/sandboxes/{red}/pause"))
        .expect(200, "pause");
    assert_eq!(list(&api, "?state=paused"), vec![red]);
    assert_eq!(list(&api, "?state=running"), vec![blue]);
}

#[test]
fn list_refuses_an_unknown_state_or_parameter() {
    let api = Tenant::new().api();
    refused(
        &api.get("/v1/sandboxes?state=sleepy"),
        400,
        "bad_request",
        "state",
        "an unknown state filter",
    );
    refused(
        &api.get("/v1/sandboxes?colour=red"),
        400,
        "bad_request",
        "colour",
        "an unknown query parameter",
    );
}

#[test]
fn patch_replaces_the_metadata() {
    let t = Tenant::new();
    let api = t.api();
    let id = t.sandbox(&json!({"metadata": {"team": "red", "n": "1"}}));
    let p = api
        .patch(
            &format!("/v1/sandboxes/{id}"),
            &json!({"metadata": {"team": "green"}}),
        )
        .expect(200, "patch metadata");
    assert_eq!(p["metadata"], json!({"team": "green"}));
    assert_eq!(sandbox(&api, &id)["metadata"], json!({"team": "green"}));
    assert_eq!(list(&api, "?metadata.team=green"), vec![id.clone()]);
    assert_eq!(list(&api, "?metadata.team=red"), Vec::<String>::new());
}

#[test]
fn patch_checks_the_network_policy_and_a_refused_patch_changes_nothing() {
    let t = Tenant::new();
    let api = t.api();
    let id = t.sandbox(&json!({}));
    let path = format!("/v1/sandboxes/{id}");
    let p = api
        .patch(&path, &json!({"network": {"egress": "none"}}))
        .expect(200, "patch network");
    assert_eq!(p["network"], json!({"egress": "none"}));
    refused(
        &api.patch(
            &path,
            &json!({"network": {"egress": "allow", "allow": ["fd00:ec2::254"]}}),
        ),
        400,
        "bad_request",
        "IPv6",
        "an allowlist entry this version cannot enforce",
    );
    refused(
        &api.patch(&path, &json!({"bogus": 1})),
        400,
        "bad_request",
        "bogus",
        "patch: an unknown field",
    );
    refused(
        &api.patch(&path, &json!({"metadata": {"k": 1}})),
        400,
        "bad_request",
        "metadata",
        "patch: a wrong type",
    );
    assert_eq!(
        sandbox(&api, &id)["network"],
        json!({"egress": "none"}),
        "a refused patch changes nothing"
    );
}

#[test]
fn ttl_sets_expires_at_from_now() {
    let t = Tenant::new();
    let id = t.sandbox(&json!({}));
    let r = t
        .api()
        .post(&format!("/v1/sandboxes/{id}/ttl"), &json!({"ttl_s": 3600}))
        .expect(200, "set the ttl");
    let exp = parse_time(r["expires_at"].as_str().expect("expires_at"));
    assert!(
        (now_s() + 3598..=now_s() + 3601).contains(&exp),
        "expires_at = now + 3600: {r}"
    );
}

#[test]
fn a_bad_ttl_is_a_400_naming_ttl_s() {
    let t = Tenant::new();
    let id = t.sandbox(&json!({}));
    refuse_all(
        &t.api(),
        &format!("/v1/sandboxes/{id}/ttl"),
        &[
            (json!({"ttl_s": 0}), 400, "bad_request", "ttl_s"),
            (json!({"ttl_s": -5}), 400, "bad_request", "ttl_s"),
            (json!({}), 400, "bad_request", "ttl_s"),
        ],
    );
}

#[test]
fn pause_freezes_every_process_and_resume_thaws_them() {
    let t = Tenant::new();
    let api = t.api();
    let id = t.sandbox(&json!({}));
    start_process(
        &api,
        &id,
        &json!({"shell": "while true; do date +%s%N >> /tmp/ticks; sleep 0.02; done"}),
    );
    let p = api
        .post_empty(&format!("/v1/sandboxes/{id}/pause"))
        .expect(200, "pause");
    assert_eq!(p["state"], "paused");
    assert_eq!(state_of(&api, &id), "paused");
    assert_eq!(
        frozen(&id),
        Some(true),
        "the machine's cgroup is frozen on the host"
    );
    let r = api
        .post_empty(&format!("/v1/sandboxes/{id}/resume"))
        .expect(200, "resume");
    assert_eq!(r["state"], "running");
    assert_eq!(frozen(&id), Some(false), "thawed on the host");
    let ticks = || {
        api.sh(&id, "wc -l < /tmp/ticks")
            .trim()
            .parse::<u64>()
            .expect("a count")
    };
    let n = ticks();
    wait_for(
        Duration::from_secs(5),
        "the ticking process runs again after resume",
        || (ticks() > n).then_some(()),
    );
}

#[test]
fn a_call_on_a_paused_sandbox_thaws_it_first() {
    let t = Tenant::new();
    let api = t.api();
    let id = t.sandbox(&json!({}));
    api.post_empty(&format!("/v1/sandboxes/{id}/pause"))
        .expect(200, "pause");
    assert_eq!(frozen(&id), Some(true));
    assert_eq!(
        api.sh(&id, "echo thawed by a call"),
        "thawed by a call\n",
        "a call on a paused sandbox thaws it first"
    );
    assert_eq!(state_of(&api, &id), "running");
    assert_eq!(frozen(&id), Some(false));
}

#[test]
fn a_deleted_sandbox_running_or_paused_is_gone_and_leaves_nothing_on_the_host() {
    let t = Tenant::new();
    let api = t.api();
    let running = t.sandbox(&json!({}));
    let paused = t.sandbox(&json!({}));
    api.post_empty(&format!("/v1/sandboxes/{paused}/pause"))
        .expect(200, "pause");
    for sb in [&running, &paused] {
        assert_eq!(
            api.delete(&format!("/v1/sandboxes/{sb}")).status,
            204,
            "delete {sb}"
        );
        api.get(&format!("/v1/sandboxes/{sb}"))
            .expect_error(404, "not_found", "a deleted sandbox");
        api.delete(&format!("/v1/sandboxes/{sb}"))
            .expect_error(404, "not_found", "deleting twice");
        api.post(
            &format!("/v1/sandboxes/{sb}/exec"),
            &json!({"shell": "true"}),
        )
        .expect_error(404, "not_found", "exec in a deleted sandbox");
        let traces = traces_of(sb, &t.srv.machine_dir(sb));
        assert!(
            traces.is_empty(),
            "{sb} left traces on the host: {traces:?}"
        );
    }
    assert_eq!(list(&api, ""), Vec::<String>::new());
}

#[test]
fn a_sandbox_whose_ttl_passes_is_destroyed_even_when_paused() {
    let t = Tenant::new();
    let api = t.api();
    let short = t.sandbox(&json!({"ttl_s": 1}));
    api.post_empty(&format!("/v1/sandboxes/{short}/pause"))
        .expect(200, "pause the short-lived sandbox");
    wait_for(
        Duration::from_secs(6),
        "the server destroys a sandbox whose ttl passed",
        || (api.get(&format!("/v1/sandboxes/{short}")).status == 404).then_some(()),
    );
    let traces = wait_for(
        Duration::from_secs(3),
        "an expired sandbox leaves nothing on the host",
        || {
            let t = traces_of(&short, &t.srv.machine_dir(&short));
            t.is_empty().then_some(t)
        },
    );
    assert!(traces.is_empty());
}

#[test]
fn an_idle_sandbox_is_paused_after_idle_timeout_s() {
    let t = Tenant::new();
    let api = t.api();
    let sb = t.sandbox(&json!({"idle_timeout_s": 1}));
    assert_eq!(sandbox(&api, &sb)["idle_timeout_s"], 1);
    // Reading the sandbox's record is not a call on it: it must not keep it awake.
    wait_state(
        &api,
        &sb,
        "paused",
        Duration::from_secs(5),
        "a sandbox with idle_timeout_s=1 is paused after a second without calls",
    );
    assert_eq!(
        frozen(&sb),
        Some(true),
        "an idle-paused sandbox is frozen on the host"
    );
    assert_eq!(api.sh(&sb, "echo awake"), "awake\n", "a call wakes it");
    assert_eq!(state_of(&api, &sb), "running");
}

#[test]
fn idle_pause_never_fires_during_a_call() {
    let t = Tenant::new();
    let api = t.api();
    let sb = t.sandbox(&json!({"idle_timeout_s": 1}));
    // A long call in flight keeps it awake, whatever its CPU use.
    let long = {
        let (api, sb) = (api.clone(), sb.clone());
        std::thread::spawn(move || api.sh(&sb, "sleep 3; echo done"))
    };
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(state_of(&api, &sb), "running", "paused during a call");
    assert_eq!(long.join().expect("the call's thread"), "done\n");
}

#[test]
fn idle_pause_never_fires_while_processes_work_and_fires_once_quiet() {
    let t = Tenant::new();
    let api = t.api();
    let sb = t.sandbox(&json!({"idle_timeout_s": 1}));
    // A background process busy on the CPU keeps it awake with no call in flight.
    let spinner = start_process(&api, &sb, &json!({"shell": "while :; do :; done"}));
    std::thread::sleep(Duration::from_millis(3000));
    assert_eq!(
        state_of(&api, &sb),
        "running",
        "paused while its processes work"
    );
    assert_eq!(frozen(&sb), Some(false));
    api.post(
        &format!("/v1/sandboxes/{sb}/processes/{spinner}/signal"),
        &json!({"signal": "SIGKILL"}),
    )
    .expect(200, "kill the spinner");
    wait_state(
        &api,
        &sb,
        "paused",
        Duration::from_secs(6),
        "paused once quiet",
    );
}

/// Create bodies the server refuses, with the field each message names.
fn bad_create_bodies() -> Vec<BadBody> {
    vec![
        (json!({"bogus": 1}), 400, "bad_request", "bogus"),
        (
            json!({"memory_mb": "lots"}),
            400,
            "bad_request",
            "memory_mb",
        ),
        (json!({"memory_mb": 1}), 400, "bad_request", "memory_mb"),
        (json!({"disk_mb": -5}), 400, "bad_request", "disk_mb"),
        (json!({"disk_mb": 1.5}), 400, "bad_request", "disk_mb"),
        (json!({"cpus": -1}), 400, "bad_request", "cpus"),
        (json!({"cpus": "two"}), 400, "bad_request", "cpus"),
        (json!({"ttl_s": 0}), 400, "bad_request", "ttl_s"),
        (json!({"ttl_s": -3}), 400, "bad_request", "ttl_s"),
        (
            json!({"idle_timeout_s": 0}),
            400,
            "bad_request",
            "idle_timeout_s",
        ),
        (json!({"env": "A=B"}), 400, "bad_request", "env"),
        (json!({"env": {"A=B": "x"}}), 400, "bad_request", "env"),
        (
            json!({"metadata": {"k": 5}}),
            400,
            "bad_request",
            "metadata",
        ),
        (json!({"metadata": ["k"]}), 400, "bad_request", "metadata"),
        (
            json!({"template": "no-such-template"}),
            400,
            "bad_request",
            "no-such-template",
        ),
        (json!({"template": 5}), 400, "bad_request", "template"),
        (json!({"runtime": "qemu"}), 400, "bad_request", "qemu"),
        (json!({"runtime": "gvisor"}), 503, "unavailable", "gvisor"),
        (
            json!({"network": {"egress": "allow", "allow": ["*"]}}),
            400,
            "bad_request",
            "egress",
        ),
        (
            json!({"network": {"egress": "sideways"}}),
            400,
            "bad_request",
            "egress",
        ),
        (
            json!({"network": {"egress": "none", "proxy": "x"}}),
            400,
            "bad_request",
            "proxy",
        ),
        (json!({"network": "none"}), 400, "bad_request", "network"),
        (json!([]), 400, "bad_request", "body"),
    ]
}

/// Sends create bodies that are not JSON of the right type, and checks each is a 400.
#[track_caller]
fn refuse_malformed_creates(api: &Api) {
    let raw = |ctype: Option<&str>, body: &[u8]| {
        let h: Vec<(&str, &str)> = ctype.map(|c| ("Content-Type", c)).into_iter().collect();
        api.request("POST", "/v1/sandboxes", &h, body.to_vec())
    };
    raw(Some("application/json"), b"{\"cpus\": ").expect_error(
        400,
        "bad_request",
        "malformed JSON",
    );
    raw(None, b"{}").expect_error(400, "bad_request", "no Content-Type");
    raw(Some("text/plain"), b"{}").expect_error(400, "bad_request", "a non-JSON Content-Type");
}

/// Sends a 2 MiB create body and checks it is a 413.
#[track_caller]
fn refuse_an_oversized_create(srv: &Server, key: &str) {
    let big = serde_json::to_vec(&json!({"env": {"A": "x".repeat(2 << 20)}})).expect("json");
    let (status, body) = post_oversized(srv.addr, key, "/v1/sandboxes", &big);
    let r = Resp {
        status,
        headers: Default::default(),
        body: body.into_bytes(),
    };
    r.expect_error(413, "payload_too_large", "a 2 MiB JSON body");
}

#[track_caller]
fn assert_no_sandbox(api: &Api) {
    assert_eq!(
        api.get("/v1/sandboxes").expect(200, "list")["sandboxes"],
        json!([]),
        "a refused create made a sandbox"
    );
}

#[test]
fn a_bad_create_body_is_refused_naming_the_field() {
    let api = Tenant::new().api();
    refuse_all(&api, "/v1/sandboxes", &bad_create_bodies());
    assert_no_sandbox(&api);
}

#[test]
fn a_malformed_or_non_json_create_body_is_a_400() {
    let api = Tenant::new().api();
    refuse_malformed_creates(&api);
    assert_no_sandbox(&api);
}

#[test]
fn a_create_body_over_the_limit_is_a_413() {
    let t = Tenant::new();
    refuse_an_oversized_create(t.srv, &t.key);
    assert_no_sandbox(&t.api());
}

#[test]
fn refused_creates_leave_no_machine_directory_and_the_server_works_on() {
    // A server of its own: the machine directories of other tests' sandboxes would hide
    // one a refused create left.
    let srv = Server::start();
    let api = srv.api();
    refuse_all(&api, "/v1/sandboxes", &bad_create_bodies());
    refuse_malformed_creates(&api);
    refuse_an_oversized_create(&srv, &srv.api_key);
    assert_no_sandbox(&api);
    let dirs: Vec<_> = std::fs::read_dir(srv.data_dir.join("sandboxes"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        dirs.is_empty(),
        "refused creates left machine dirs: {dirs:?}"
    );
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    assert_eq!(api.sh(&sb, "echo ok"), "ok\n");
}

#[test]
fn quotas_answer_429_naming_the_quota() {
    let srv = Server::start_with(&["--quota-sandboxes", "2", "--quota-memory-mb", "1024"]);
    let api = srv.api();
    let a = sandbox_id(&api.create_sandbox(&json!({"memory_mb": 512})));
    refused(
        &api.post("/v1/sandboxes", &json!({"memory_mb": 600})),
        429,
        "quota_exceeded",
        "memory",
        "past the memory quota",
    );
    let b = sandbox_id(&api.create_sandbox(&json!({"memory_mb": 256})));
    let msg = api
        .post("/v1/sandboxes", &json!({"memory_mb": 64}))
        .expect_error(429, "quota_exceeded", "a third sandbox");
    assert!(
        msg.contains("sandboxes") && msg.contains('2'),
        "the message names the sandbox quota: {msg:?}"
    );
    // A paused sandbox still counts.
    api.post_empty(&format!("/v1/sandboxes/{a}/pause"))
        .expect(200, "pause");
    api.post("/v1/sandboxes", &json!({"memory_mb": 64}))
        .expect_error(429, "quota_exceeded", "a paused sandbox counts");
    // Deleting frees the slot.
    assert_eq!(api.delete(&format!("/v1/sandboxes/{b}")).status, 204);
    let c = sandbox_id(&api.create_sandbox(&json!({"memory_mb": 64})));
    assert_eq!(api.sh(&c, "echo fits"), "fits\n");
}
