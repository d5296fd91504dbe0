//! The typed request bodies through the real server: what a run's call record says about
//! its runtime, and bad bodies of creates, changes and runs answered with a 400 that names
//! the field and what to write instead (the shapes now live in `locker_types::requests`).
//! Every test starts its own server, which cleans up its machines when it drops.

use locker_tests::become_subreaper;
use locker_tests::server::{Resp, Server};
use serde_json::{json, Value};

fn refused(r: &Resp, status: u16, code: &str, needles: &[&str], what: &str) {
    let msg = r.expect_error(status, code, what);
    for n in needles {
        assert!(
            msg.contains(n),
            "{what}: the message should say `{n}`: {msg:?}"
        );
    }
}

/// The call record of `call` on volume `vol`.
fn record_of(api: &locker_tests::server::Api, vol: &str, call: &Value) -> Value {
    let calls = api
        .get(&format!("/v1/calls?volume_id={vol}"))
        .expect(200, "calls");
    calls["calls"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == *call)
        .unwrap_or_else(|| panic!("no record of {call} in {calls}"))
        .clone()
}

#[test]
fn a_run_records_the_runtime_it_ran_in() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let vol = api
        .post("/v1/volumes", &json!({"name": "rt", "size_mb": 64}))
        .expect(201, "create a volume")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let run = |body: Value| {
        api.post(&format!("/v1/volumes/{vol}/run"), &body)
            .expect(200, &format!("run {body}"))
    };
    let jail = run(json!({"shell": "echo j > j.txt"}));
    assert_eq!(jail["exit_code"], 0, "{jail}");
    assert_eq!(record_of(&api, &vol, &jail["call_id"])["runtime"], "jail");
    let vm = run(json!({"runtime": "microvm", "memory_mb": 256, "shell": "echo v > v.txt"}));
    assert_eq!(vm["exit_code"], 0, "{vm}");
    assert_eq!(vm["changes"]["committed"], true, "{vm}");
    let rec = record_of(&api, &vol, &vm["call_id"]);
    assert_eq!(
        rec["runtime"], "microvm",
        "a microVM run's record must say so: {rec}"
    );
}

#[test]
fn bad_bodies_name_the_field_and_what_to_write() {
    become_subreaper();
    let srv = Server::start();
    let api = srv.api();
    let create = [
        (
            json!({"runtime": "qemu"}),
            vec!["qemu", "auto, jail, microvm or gvisor"],
        ),
        (json!({"runtime": 5}), vec!["runtime"]),
        (
            json!({"network": "none"}),
            vec!["`network` must be an object"],
        ),
        (
            json!({"network": {"egress": "none", "proxy": "x"}}),
            vec!["unknown field `proxy` in `network`"],
        ),
        (
            json!({"network": {"egress": "all", "allow": ["pypi.org"]}}),
            vec!["`allow` only goes with"],
        ),
        (
            json!({"network": {"egress": "allow"}}),
            vec!["`network.allow` is required"],
        ),
        (
            json!({"network": {"egress": "sideways"}}),
            vec!["`network.egress` must be none, all or allow", "sideways"],
        ),
        (json!({"network": {}}), vec!["`network.egress` is required"]),
        (
            json!({"network": {"egress": "allow", "allow": ["*"]}}),
            vec!["network.allow[0]", "egress"],
        ),
        (
            json!({"volumes": [{"volume": "v", "mode": "rw"}]}),
            vec!["unknown field `mode` in `volumes[0]`"],
        ),
        (
            json!({"volumes": [{"path": "/w"}]}),
            vec!["`volumes[0].volume` is required"],
        ),
        (
            json!({"volumes": [{"volume": "v", "read_only": "yes"}]}),
            vec!["`volumes[0].read_only` must be true or false"],
        ),
        (
            json!({"volumes": ["v"]}),
            vec!["`volumes[0]` must be an object"],
        ),
        (json!({"bogus": 1}), vec!["bogus"]),
    ];
    for (body, needles) in &create {
        refused(
            &api.post("/v1/sandboxes", body),
            400,
            "bad_request",
            needles,
            &format!("POST /v1/sandboxes {body}"),
        );
    }
    refused(
        &api.post("/v1/sandboxes", &json!({"runtime": "gvisor"})),
        503,
        "unavailable",
        &["gvisor"],
        "gvisor",
    );

    let vol = api
        .post("/v1/volumes", &json!({"name": "bodies"}))
        .expect(201, "create a volume")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let run = [
        (
            json!({"shell": "true", "commit": "sometimes"}),
            vec!["`commit` must be always, on_success or never", "sometimes"],
        ),
        (
            json!({"shell": "true", "runtime": "qemu"}),
            vec!["auto, jail, microvm or gvisor"],
        ),
        (
            json!({"shell": "true", "network": {"egress": "sideways"}}),
            vec!["`network.egress`"],
        ),
        (json!({"shell": "true", "bogus": 1}), vec!["bogus"]),
        (json!({"shell": "true", "cmd": ["true"]}), vec!["not both"]),
    ];
    for (body, needles) in &run {
        refused(
            &api.post(&format!("/v1/volumes/{vol}/run"), body),
            400,
            "bad_request",
            needles,
            &format!("POST run {body}"),
        );
    }

    let sb = api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    refused(
        &api.patch(
            &format!("/v1/sandboxes/{sb}"),
            &json!({"network": {"egress": "allow"}}),
        ),
        400,
        "bad_request",
        &["`network.allow` is required"],
        "patch a bad network",
    );
    refused(
        &api.patch(&format!("/v1/sandboxes/{sb}"), &json!({"ttl_s": 5})),
        400,
        "bad_request",
        &["ttl_s"],
        "patch an unknown field",
    );
    // The list's query: repeated metadata keys, percent-decoding, unknown names refused.
    refused(
        &api.get("/v1/sandboxes?colour=red"),
        400,
        "bad_request",
        &["unknown query parameter \"colour\""],
        "an unknown query parameter",
    );
    api.patch(
        &format!("/v1/sandboxes/{sb}"),
        &json!({"metadata": {"team": "a b"}}),
    )
    .expect(200, "set metadata");
    let l = api
        .get("/v1/sandboxes?metadata.team=a%20b&state=running")
        .expect(200, "list by metadata");
    assert_eq!(l["sandboxes"].as_array().unwrap().len(), 1, "{l}");
    let l = api
        .get("/v1/sandboxes?metadata.team=a+b&metadata.team=other")
        .expect(200, "list by two values of one key");
    assert_eq!(l["sandboxes"].as_array().unwrap().len(), 0, "{l}");
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete");
}
