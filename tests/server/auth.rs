//! End-to-end tests of keys and tenants: every /v1 route wants a valid key, admin routes
//! want the admin key, tenants never see each other, a revoked key stops at once, and keys
//! are never stored in clear.
//!
//! The tests share one `locker serve` (see `locker_tests::shared`), each with tenants of
//! its own (the tests of refused requests share the sandbox they try to change); a server without an admin key, and the key a server generates at its first
//! start, need servers of their own. Run as root after `scripts/setup build`:
//! `cargo test --release -p locker-tests --test server -- auth::`.

use std::sync::OnceLock;

use locker_tests::answers::{
    assert_not_in_files, ids, refused, sandbox, sandbox_routes, start_process, tenant_routes,
};
use locker_tests::server::{Api, Resp, Server};
use locker_tests::shared::{shared, LogOnFailure, Tenant};
use locker_tests::streams::ws_connect;
use serde_json::json;

/// An id no sandbox has.
const MISSING: &str = "sb_00000000deadbeef";

/// A tenant with a sandbox (metadata `owner`), a file `/tmp/keep.txt` in it and a running
/// `sleep`, that requests with a wrong key or of another tenant try to change.
struct Victim {
    tenant: Tenant,
    sb: String,
    proc: String,
}

static VICTIM: OnceLock<Victim> = OnceLock::new();

/// The victim the tests of refused requests share (made on first use), and the guard that
/// prints the server's log if the test fails.
fn victim() -> (&'static Victim, LogOnFailure) {
    let v = VICTIM.get_or_init(|| {
        let tenant = Tenant::new();
        let api = tenant.api();
        let sb = tenant.sandbox(&json!({"metadata": {"owner": tenant.name}}));
        api.write_file(&sb, "/tmp/keep.txt", b"kept")
            .expect(200, "write a file");
        let proc = start_process(&api, &sb, &json!({"cmd": ["sleep", "3600"]}));
        Victim { tenant, sb, proc }
    });
    (v, LogOnFailure)
}

/// Asserts that nothing a refused request asked for happened to the sandbox of
/// [`a_sandbox_with_work`].
#[track_caller]
fn assert_untouched(t: &Tenant, sb: &str, proc: &str) {
    let api = t.api();
    let v = sandbox(&api, sb);
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["metadata"], json!({"owner": t.name}), "{v}");
    assert_eq!(
        api.get("/v1/sandboxes").expect(200, "list")["sandboxes"]
            .as_array()
            .map(Vec::len),
        Some(1),
        "no sandbox was created or deleted"
    );
    assert_eq!(api.read_file(sb, "/tmp/keep.txt").body, b"kept");
    api.read_file(sb, "/tmp/pwned").expect_error(
        404,
        "not_found",
        "no command ran, no file was written",
    );
    let p = api
        .get(&format!("/v1/sandboxes/{sb}/processes/{proc}"))
        .expect(200, "the process");
    assert_eq!(p["state"], "running", "the process was not signalled: {p}");
}

/// Opens sandbox `sb`'s terminal with `key` (which must be refused: its status and body),
/// and writes to process `proc`'s stdin with `api` (its answer).
fn terminal_and_stdin(api: &Api, key: Option<&str>, sb: &str, proc: &str) -> ((u16, String), Resp) {
    let Err(handshake) = ws_connect(&api.base, key, &format!("/v1/sandboxes/{sb}/pty")) else {
        panic!("the terminal of {sb} opened")
    };
    let stdin = api.request(
        "POST",
        &format!("/v1/sandboxes/{sb}/processes/{proc}/stdin"),
        &[],
        b"x".to_vec(),
    );
    (handshake, stdin)
}

#[test]
fn every_v1_route_refuses_a_missing_or_wrong_key_and_does_nothing() {
    let (v, _log) = victim();
    let (t, sb, proc) = (&v.tenant, &v.sb, &v.proc);
    let srv = t.srv;
    let admin_key = srv.admin_key.clone().expect("admin key");
    let bad_headers: Vec<(&str, Option<String>)> = vec![
        ("no Authorization header", None),
        ("a wrong key", Some(format!("Bearer {}x", t.key))),
        ("the admin key", Some(format!("Bearer {admin_key}"))),
        ("an empty Bearer", Some("Bearer ".into())),
        ("Basic auth", Some(format!("Basic {}", t.key))),
        ("the key without Bearer", Some(t.key.clone())),
    ];
    let anon = srv.anon();
    let routes = tenant_routes()
        .into_iter()
        .chain(sandbox_routes(sb, proc, "/tmp/keep.txt"));
    for call in routes {
        for (what, header) in &bad_headers {
            let auth: Vec<(&str, &str)> = header
                .iter()
                .map(|h| ("Authorization", h.as_str()))
                .collect();
            call.send(&anon, &auth, None).expect_error(
                401,
                "unauthorized",
                &format!("{} {} with {what}", call.method, call.path),
            );
        }
    }
    assert_untouched(t, sb, proc);
}

#[test]
fn the_terminal_and_stdin_refuse_a_missing_key_too() {
    let (v, _log) = victim();
    let (t, sb, proc) = (&v.tenant, &v.sb, &v.proc);
    let ((status, body), stdin) = terminal_and_stdin(&t.srv.anon(), None, sb, proc);
    assert_eq!(status, 401, "the PTY without a key: {body}");
    stdin.expect_error(401, "unauthorized", "stdin without a key");
    assert_untouched(t, sb, proc);
}

#[test]
fn admin_routes_want_the_admin_key_and_nothing_else() {
    let t = Tenant::new();
    t.api()
        .post("/v1/tenants", &json!({"name": "team-x"}))
        .expect_error(401, "unauthorized", "a tenant key on an admin route");
    t.srv
        .anon()
        .post("/v1/tenants", &json!({"name": "team-x"}))
        .expect_error(401, "unauthorized", "no key on an admin route");
    t.api()
        .delete(&format!(
            "/v1/keys/{}",
            t.key_id.as_deref().expect("key id")
        ))
        .expect_error(401, "unauthorized", "revoking with a tenant key");
    t.api()
        .get("/v1/sandboxes")
        .expect(200, "the key a tenant key tried to revoke still works");
}

#[test]
fn a_bad_tenant_body_is_a_400_naming_the_field() {
    let admin = shared().admin();
    refused(
        &admin.post("/v1/tenants", &json!({"name": "team-x", "bogus": 1})),
        400,
        "bad_request",
        "bogus",
        "an unknown field",
    );
    refused(
        &admin.post("/v1/tenants", &json!({"name": 7})),
        400,
        "bad_request",
        "name",
        "a wrong type",
    );
    admin
        .post("/v1/tenants", &json!({"name": "Not A Name!"}))
        .expect_error(400, "bad_request", "an invalid tenant name");
}

#[test]
fn a_new_tenant_gets_a_key_and_an_existing_name_is_a_409() {
    let srv = shared();
    let name = locker_tests::unique("team-b");
    let created = srv
        .admin()
        .post("/v1/tenants", &json!({ "name": name }))
        .expect(201, "create a tenant");
    assert_eq!(created["tenant"], name.as_str());
    let key = created["api_key"].as_str().expect("api_key");
    let key_id = created["key_id"].as_str().expect("key_id");
    assert!(key.starts_with("lk_"), "API keys start with lk_: {key}");
    assert!(
        key_id.starts_with("key_"),
        "key ids start with key_: {key_id}"
    );
    srv.api_with(key)
        .get("/v1/sandboxes")
        .expect(200, "the new key works");
    srv.admin()
        .post("/v1/tenants", &json!({ "name": name }))
        .expect_error(409, "conflict", "a tenant that exists");
}

#[test]
fn a_tenant_lists_only_its_own_sandboxes() {
    let (a, b) = (Tenant::new(), Tenant::new());
    let sa = a.sandbox(&json!({"metadata": {"owner": "a"}}));
    let sb = b.sandbox(&json!({"metadata": {"owner": "b"}}));
    assert_eq!(
        ids(
            &a.api().get("/v1/sandboxes").expect(200, "list a"),
            "sandboxes"
        ),
        vec![sa]
    );
    assert_eq!(
        ids(
            &b.api().get("/v1/sandboxes").expect(200, "list b"),
            "sandboxes"
        ),
        vec![sb]
    );
}

#[test]
fn another_tenants_sandbox_answers_exactly_like_a_missing_one() {
    let (v, _log) = victim();
    let (a, sa, a_proc) = (&v.tenant, &v.sb, &v.proc);
    let b = Tenant::new();
    let bapi = b.api();
    let theirs = sandbox_routes(sa, a_proc, "/tmp/keep.txt");
    let missing = sandbox_routes(MISSING, a_proc, "/tmp/keep.txt");
    for (call, nobody) in theirs.iter().zip(&missing) {
        let (method, path) = (call.method, &call.path);
        let on_theirs = call.send(&bapi, &[], None).expect_error(
            404,
            "not_found",
            &format!("b: {method} {path} on a's sandbox"),
        );
        let on_nothing = call.send(&bapi, &[], Some(&nobody.path)).expect_error(
            404,
            "not_found",
            &format!("b: {method} {}", nobody.path),
        );
        assert_eq!(
            on_theirs.replace(sa.as_str(), "ID"),
            on_nothing.replace(MISSING, "ID"),
            "{method} {path}: another tenant's sandbox must be indistinguishable from a missing one"
        );
    }
    let ((status, body), stdin) = terminal_and_stdin(&bapi, Some(&b.key), sa, a_proc);
    assert_eq!(status, 404, "b opening a's terminal: {body}");
    stdin.expect_error(404, "not_found", "b writing to a's process");
    assert_untouched(a, sa, a_proc);
}

#[test]
fn a_tenant_sees_none_of_another_tenants_calls() {
    let (a, b) = (Tenant::new(), Tenant::new());
    let sa = a.sandbox(&json!({}));
    let a_call = a.api().exec(&sa, &json!({"shell": "echo a"}))["call_id"]
        .as_str()
        .expect("call_id")
        .to_owned();
    let bapi = b.api();
    let b_calls = bapi.get("/v1/calls").expect(200, "b's calls");
    assert_eq!(b_calls["calls"], json!([]), "b sees none of a's calls");
    let b_calls = bapi
        .get(&format!("/v1/calls?sandbox_id={sa}"))
        .expect(200, "b's calls of a's sandbox");
    assert_eq!(
        b_calls["calls"],
        json!([]),
        "b sees none of a's calls, even by sandbox id"
    );
    assert!(
        a.api().get("/v1/calls").text().contains(&a_call),
        "a sees its own call"
    );
}

#[test]
fn a_second_key_works_and_a_revoked_key_stops_at_once() {
    let b = Tenant::new();
    let admin = b.srv.admin();
    let bapi = b.api();
    let sb = b.sandbox(&json!({}));
    let k2 = admin
        .post_empty(&format!("/v1/tenants/{}/keys", b.name))
        .expect(201, "a second key of the tenant");
    assert_eq!(k2["tenant"], b.name.as_str());
    let b2 = b.srv.api_with(k2["api_key"].as_str().expect("api_key"));
    let list =
        |api: &Api, what: &str| ids(&api.get("/v1/sandboxes").expect(200, what), "sandboxes");
    assert_eq!(
        list(&b2, "the second key lists the tenant's"),
        vec![sb.clone()]
    );
    admin
        .post_empty("/v1/tenants/no-such-team/keys")
        .expect_error(404, "not_found", "a key of an unknown tenant");
    let key_id = b.key_id.as_deref().expect("key id");
    Tenant::new()
        .api()
        .delete(&format!("/v1/keys/{key_id}"))
        .expect_error(401, "unauthorized", "revoking with another tenant's key");
    assert_eq!(
        admin.delete(&format!("/v1/keys/{key_id}")).status,
        204,
        "revoke the first key"
    );
    bapi.get("/v1/sandboxes").expect_error(
        401,
        "unauthorized",
        "a revoked key, right after revoking",
    );
    bapi.post(
        &format!("/v1/sandboxes/{sb}/exec"),
        &json!({"shell": "true"}),
    )
    .expect_error(401, "unauthorized", "exec with a revoked key");
    assert_eq!(list(&b2, "the other key still works"), vec![sb.clone()]);
    admin.delete(&format!("/v1/keys/{key_id}")).expect_error(
        404,
        "not_found",
        "revoking a revoked key",
    );
    assert_eq!(b2.delete(&format!("/v1/sandboxes/{sb}")).status, 204);
}

#[test]
fn keys_are_stored_hashed() {
    let t = Tenant::new();
    let srv = t.srv;
    let sb = t.sandbox(&json!({}));
    t.api().exec(&sb, &json!({"shell": "true"}));
    let k2 = srv
        .admin()
        .post_empty(&format!("/v1/tenants/{}/keys", t.name))
        .expect(201, "a second key")["api_key"]
        .as_str()
        .expect("api_key")
        .to_owned();
    let key_id = t.key_id.as_deref().expect("key id");
    assert_eq!(
        srv.admin().delete(&format!("/v1/keys/{key_id}")).status,
        204
    );
    assert_not_in_files(&srv.data_dir, &[&srv.api_key, &t.key, &k2]);
    srv.api_with(&k2)
        .delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete with the second key");
}

#[test]
fn without_an_admin_key_the_admin_routes_do_not_exist() {
    // A server of its own, started without LOCKER_ADMIN_KEY.
    let srv = Server::without_admin(&[]);
    srv.api()
        .post("/v1/tenants", &json!({"name": "x"}))
        .expect_error(404, "not_found", "admin routes without an admin key");
}

#[test]
fn without_an_api_key_the_first_start_generates_one_and_prints_it_once() {
    let mut srv = Server::generating_key();
    let key = srv.api_key.clone();
    assert!(
        key.starts_with("lk_") && key.len() >= 20,
        "a generated key: {key:?}"
    );
    assert_eq!(
        srv.log_text().matches("(shown only now").count(),
        1,
        "the key is printed at the first start"
    );
    assert_eq!(
        srv.api()
            .get("/v1/sandboxes")
            .expect(200, "the generated key works")["sandboxes"],
        json!([])
    );
    srv.restart();
    assert_eq!(
        srv.log_text().matches("(shown only now").count(),
        1,
        "a restart prints no key (and makes no new one):\n{}",
        srv.log_text()
    );
    srv.api()
        .get("/v1/sandboxes")
        .expect(200, "the generated key works after a restart");
    assert_not_in_files(&srv.data_dir, &[&key]);
}
