//! End-to-end tests of the conventions every client meets first: health, the OpenAPI
//! document, metrics, the template list, and the error shape of unknown routes and wrong
//! methods.
//!
//! The tests share one `locker serve` (see `locker_tests::shared`), each with a tenant of
//! its own; the metrics token (a flag) starts a server of its own. Run as root after `scripts/setup build`:
//! `cargo test --release -p locker-tests --test server -- conventions::`.

use std::sync::Mutex;

use locker_tests::answers::{refused, sandbox_id};
use locker_tests::server::Server;
use locker_tests::shared::{shared, Tenant};
use serde_json::json;

/// Every route of the contract's sandbox, exec, process, file, record and admin sections.
const CONTRACT_ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/sandboxes"),
    ("get", "/v1/sandboxes"),
    ("get", "/v1/sandboxes/{id}"),
    ("patch", "/v1/sandboxes/{id}"),
    ("delete", "/v1/sandboxes/{id}"),
    ("post", "/v1/sandboxes/{id}/ttl"),
    ("post", "/v1/sandboxes/{id}/pause"),
    ("post", "/v1/sandboxes/{id}/resume"),
    ("post", "/v1/sandboxes/{id}/exec"),
    ("post", "/v1/sandboxes/{id}/processes"),
    ("get", "/v1/sandboxes/{id}/processes"),
    ("get", "/v1/sandboxes/{id}/processes/{proc}"),
    ("get", "/v1/sandboxes/{id}/processes/{proc}/output"),
    ("post", "/v1/sandboxes/{id}/processes/{proc}/stdin"),
    ("post", "/v1/sandboxes/{id}/processes/{proc}/signal"),
    ("get", "/v1/sandboxes/{id}/pty"),
    ("get", "/v1/sandboxes/{id}/files"),
    ("put", "/v1/sandboxes/{id}/files"),
    ("delete", "/v1/sandboxes/{id}/files"),
    ("get", "/v1/sandboxes/{id}/files/list"),
    ("get", "/v1/sandboxes/{id}/files/stat"),
    ("post", "/v1/sandboxes/{id}/files/mkdir"),
    ("post", "/v1/sandboxes/{id}/files/move"),
    ("get", "/v1/templates"),
    ("get", "/v1/calls"),
    ("get", "/v1/usage"),
    ("post", "/v1/tenants"),
    ("post", "/v1/tenants/{name}/keys"),
    ("delete", "/v1/keys/{key_id}"),
    ("get", "/healthz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
];

/// Held by every test of this binary that GETs /v1/templates with a valid key, so the
/// metrics test counts its own request alone on the shared server.
static TEMPLATES: Mutex<()> = Mutex::new(());

#[test]
fn health_needs_no_key_and_reports_each_runtime_and_the_accelerator() {
    // The jail runtime works here; the microVM works (setup installs QEMU and the guest
    // kernel) or says why not, and the accelerator is named.
    let h = shared().anon().get("/healthz").expect(200, "GET /healthz");
    assert_eq!(h["status"], "ok", "{h}");
    assert_eq!(h["runtimes"]["jail"], "ok", "{h}");
    let micro = h["runtimes"]["microvm"]
        .as_str()
        .unwrap_or_else(|| panic!("runtimes.microvm is reported: {h}"));
    assert!(
        micro == "ok" || micro.len() > "unavailable: ".len() && micro.starts_with("unavailable: "),
        "microvm works or says why not: {micro:?}"
    );
    let accel = h["virtualization"]["accel"].as_str().unwrap_or_default();
    assert!(accel == "kvm" || accel == "tcg", "{h}");
    assert!(
        !h["virtualization"]["detail"]
            .as_str()
            .unwrap_or_default()
            .is_empty(),
        "{h}"
    );
}

#[test]
fn the_openapi_document_needs_no_key_and_lists_every_contract_route() {
    let o = shared()
        .anon()
        .get("/openapi.json")
        .expect(200, "GET /openapi.json");
    assert!(
        o["openapi"].as_str().is_some_and(|v| v.starts_with("3.")),
        "an OpenAPI 3 document: {}",
        o["openapi"]
    );
    for (method, path) in CONTRACT_ROUTES {
        let op = &o["paths"][path][method];
        assert!(op.is_object(), "/openapi.json documents {method} {path}");
        let keyed = path.starts_with("/v1/");
        assert_eq!(
            op.get("security").is_some(),
            keyed,
            "{method} {path}: security is declared exactly on /v1 routes"
        );
    }
    let schema = &o["components"]["schemas"]["Error"];
    assert!(schema.is_object(), "the error shape is in the document");
}

#[test]
fn the_default_template_is_listed_with_its_digest_and_size() {
    let t = {
        let _only = TEMPLATES.lock().unwrap_or_else(|e| e.into_inner());
        Tenant::new()
            .api()
            .get("/v1/templates")
            .expect(200, "GET /v1/templates")
    };
    let def = t["templates"]
        .as_array()
        .expect("templates")
        .iter()
        .find(|t| t["name"] == "default")
        .cloned()
        .unwrap_or_else(|| panic!("the default template is listed: {t}"));
    assert!(
        def["digest"].as_str().is_some_and(|d| !d.is_empty()),
        "{def}"
    );
    assert!(def["size_bytes"].as_u64().is_some_and(|n| n > 0), "{def}");
}

#[test]
fn metrics_need_no_key_and_count_requests_by_route_and_status() {
    let srv = shared();
    let tenant = Tenant::new();
    let templates_counted = |text: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(
                    "locker_http_requests_total{method=\"GET\",route=\"/v1/templates\",status=\"200\"} ",
                )
            })
            .map(|n| n.trim().parse::<u64>().expect("a count"))
    };
    srv.anon().get("/healthz").expect(200, "GET /healthz");
    let (before, m) = {
        let _only = TEMPLATES.lock().unwrap_or_else(|e| e.into_inner());
        let before = templates_counted(&srv.anon().get("/metrics").text()).unwrap_or(0);
        tenant
            .api()
            .get("/v1/templates")
            .expect(200, "GET /v1/templates");
        (before, srv.anon().get("/metrics"))
    };
    assert_eq!(m.status, 200, "GET /metrics: {}", m.text());
    let ctype = m
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    assert!(
        ctype.starts_with("text/plain"),
        "metrics are Prometheus text: {ctype}"
    );
    let text = m.text();
    assert_eq!(
        templates_counted(&text),
        Some(before + 1),
        "requests are counted by route and status, one by one:\n{text}"
    );
    let health = text
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "locker_http_requests_total{method=\"GET\",route=\"/healthz\",status=\"200\"} ",
            )
        })
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(health.is_some_and(|n| n >= 1), "{text}");
    assert!(
        text.contains("# TYPE locker_exec_duration_seconds histogram"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE locker_sandbox_create_seconds histogram"),
        "{text}"
    );
}

#[test]
fn an_unknown_route_is_a_404_with_the_error_shape() {
    refused(
        &shared().anon().get("/v2/nothing"),
        404,
        "not_found",
        "route",
        "an unknown route",
    );
}

#[test]
fn a_wrong_method_is_a_405_with_the_error_shape() {
    let r = Tenant::new().api().request("PUT", "/v1/sandboxes", &[], ());
    assert_eq!(
        r.status,
        405,
        "PUT /v1/sandboxes is a wrong method: {}",
        r.text()
    );
    r.expect_error(405, "method_not_allowed", "a wrong method");
}

#[test]
fn with_a_metrics_token_metrics_want_it_and_count_paused_sandboxes() {
    // A server of its own: its flag, and a gauge of every tenant's sandboxes.
    let srv = Server::start_with(&["--metrics-token", "metrics-secret"]);
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({})));
    api.post_empty(&format!("/v1/sandboxes/{sb}/pause"))
        .expect(200, "pause");
    srv.anon()
        .get("/metrics")
        .expect_error(401, "unauthorized", "/metrics without the token");
    srv.anon()
        .with_key(Some("wrong"))
        .get("/metrics")
        .expect_error(401, "unauthorized", "/metrics with a wrong token");
    let m = srv.anon().with_key(Some("metrics-secret")).get("/metrics");
    assert_eq!(m.status, 200, "/metrics with the token: {}", m.text());
    assert!(
        m.text().contains("locker_sandboxes{state=\"paused\"} 1"),
        "{}",
        m.text()
    );
}
