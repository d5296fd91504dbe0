//! Network egress, end to end: `none` reaches nothing, `all` reaches a server the test
//! starts on the host in a namespace of its own (these hosts have no internet) but never
//! the metadata address, the host itself or another machine; `allow` reaches allowed names
//! only, by HTTP and by TLS (a test CA), and never a bare address, another name, or an
//! allowed name's forged SNI aimed at another address; DNS answers allowed names only;
//! refusals land in the call record; a policy change applies to a running sandbox; runs
//! get egress too; destroy leaves no link, rule or lease. Run as root.

use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;
use std::time::{Duration, Instant};

use locker_tests::become_subreaper;
use locker_tests::egress::*;
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

#[test]
fn none_reaches_nothing_and_all_reaches_only_the_outside() {
    become_subreaper();
    let net = TestNet::start();
    let srv = Server::start();
    wait_egress_ok(&srv);
    let api = srv.api();
    let host_listener = TcpListener::bind("0.0.0.0:0").expect("a listener on the host");
    let hport = host_listener.local_addr().unwrap().port();
    let locker_port = srv.addr.port();
    let server = net.addr.to_string();

    // none: loopback only, reaches nothing.
    let none = api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        api.sh(&none, "ls /sys/class/net | tr '\\n' ' '").trim(),
        "lo",
        "egress none: loopback only"
    );
    assert!(lease(&srv, &none).is_none(), "egress none: no lease");
    assert_eq!(reach(&api, &none, &server, net.port), "FAILED");

    // all: reaches the test server, not the metadata address nor the host.
    let t = Instant::now();
    let all = api.create_sandbox(&json!({"network": {"egress": "all"}}));
    eprintln!("create with egress all: {:?}", t.elapsed());
    assert_eq!(all["network"], json!({"egress": "all"}));
    let all = all["id"].as_str().unwrap().to_owned();
    let (_, link, mip) = lease(&srv, &all).expect("egress all: a lease");
    assert!(Path::new("/sys/class/net").join(&link).exists(), "its veth");
    let gw = gateway(&mip);
    assert_eq!(
        reach(&api, &all, &server, net.port),
        GREETING,
        "the test server"
    );
    for (addr, port, what) in [
        ("169.254.169.254", 80, "the metadata address"),
        (gw.as_str(), locker_port, "Locker's port on the host end"),
        (gw.as_str(), hport, "a host listener on the host end"),
        (
            host_address().as_str(),
            hport,
            "a host listener on the uplink",
        ),
        (
            host_address().as_str(),
            locker_port,
            "Locker's port on the uplink",
        ),
    ] {
        assert_eq!(
            reach(&api, &all, addr, port),
            "FAILED",
            "{what} ({addr}:{port})"
        );
    }

    // Another machine with egress all: neither reaches the other.
    let other = api.create_sandbox(&json!({"network": {"egress": "all"}}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (_, _, oip) = lease(&srv, &other).expect("a lease");
    assert_ne!(oip, mip);
    let api2 = srv.api();
    let other2 = other.clone();
    let listener = std::thread::spawn(move || {
        api2.exec(
            &other2,
            &json!({"shell": "timeout 4 python3 -c 'import socket; s=socket.socket(); s.bind((\"0.0.0.0\", 7000)); s.listen(); s.accept(); print(\"ACCEPTED\")' || echo NOTHING"}),
        )
    });
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(reach(&api, &all, &oip, 7000), "FAILED", "another machine");
    let got = listener.join().unwrap();
    assert!(
        got["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains("NOTHING"),
        "the other machine saw no connection: {got}"
    );
    // A policy that cannot be enforced as written is refused, not approximated.
    for bad in [
        json!({"egress": "allow"}),
        json!({"egress": "allow", "allow": ["*"]}),
        json!({"egress": "allow", "allow": ["fd00:ec2::254"]}),
        json!({"egress": "all", "allow": ["a.test"]}),
    ] {
        let r = api.post("/v1/sandboxes", &json!({ "network": bad }));
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
    }
}

#[test]
fn policy_change_applies_to_a_running_sandbox_and_destroy_leaves_nothing() {
    become_subreaper();
    let net = TestNet::start();
    let srv = Server::start();
    wait_egress_ok(&srv);
    let api = srv.api();
    let server = net.addr.to_string();
    let id = api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(reach(&api, &id, &server, net.port), "FAILED");

    let t = Instant::now();
    let p = api
        .patch(
            &format!("/v1/sandboxes/{id}"),
            &json!({"network": {"egress": "all"}}),
        )
        .expect(200, "patch to all");
    eprintln!("patch none -> all: {:?}", t.elapsed());
    assert_eq!(p["network"], json!({"egress": "all"}));
    assert_eq!(
        reach(&api, &id, &server, net.port),
        GREETING,
        "all after the patch"
    );
    let (slot, link, mip) = lease(&srv, &id).expect("a lease after the patch");

    api.patch(
        &format!("/v1/sandboxes/{id}"),
        &json!({"network": {"egress": "none"}}),
    )
    .expect(200, "patch to none");
    assert_eq!(
        reach(&api, &id, &server, net.port),
        "FAILED",
        "none after the patch"
    );
    assert!(
        !Path::new("/sys/class/net").join(&link).exists(),
        "veth removed"
    );
    assert!(
        !Path::new("/run/locker/net-slots")
            .join(slot.to_string())
            .exists(),
        "lease released"
    );
    assert_eq!(
        api.sh(&id, "ls /sys/class/net | tr '\\n' ' '").trim(),
        "lo",
        "back to loopback only"
    );

    // Again to all, then destroy: no link, no lease, no rule naming its address.
    api.patch(
        &format!("/v1/sandboxes/{id}"),
        &json!({"network": {"egress": "all"}}),
    )
    .expect(200, "patch to all again");
    let (slot, link, mip2) = lease(&srv, &id).expect("a lease");
    let _ = mip;
    assert_eq!(reach(&api, &id, &server, net.port), GREETING);
    let t = Instant::now();
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete");
    eprintln!("destroy with egress all: {:?}", t.elapsed());
    assert!(
        !Path::new("/sys/class/net").join(&link).exists(),
        "veth removed"
    );
    assert!(
        !Path::new("/run/locker/net-slots")
            .join(slot.to_string())
            .exists(),
        "lease released"
    );
    assert!(
        !nft_ruleset().contains(&mip2),
        "no rule names the machine's address"
    );
    assert!(!srv.machine_dir(&id).exists());
}

/// `--egress-resolve` pins for the tests' names: `allowed.test` and `x.wild.test` at `a`,
/// `other.test` at `b`, `meta.test` at the metadata address.
fn pins(a: &TestNet, b: &TestNet) -> Vec<String> {
    [
        format!("allowed.test={}", a.addr),
        format!("x.wild.test={}", a.addr),
        format!("other.test={}", b.addr),
        "meta.test=169.254.169.254".to_owned(),
    ]
    .into_iter()
    .flat_map(|p| ["--egress-resolve".to_owned(), p])
    .collect()
}

fn start_pinned(a: &TestNet, b: &TestNet) -> Server {
    let args = pins(a, b);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start_with(&args)
}

#[test]
fn allow_reaches_allowed_names_by_http_and_tls_and_nothing_else() {
    become_subreaper();
    let pki = Pki::new();
    let a = TestNet::start_with(Some(&pki));
    let b = TestNet::start();
    let srv = start_pinned(&a, &b);
    wait_egress_ok(&srv);
    let api = srv.api();
    let (aip, bip) = (a.addr.to_string(), b.addr.to_string());
    let t = Instant::now();
    let sb = api.create_sandbox(&json!({"network": {"egress": "allow",
        "allow": ["Allowed.test.", "*.wild.test", "meta.test", "allowed.test"]}}));
    eprintln!("create with egress allow: {:?}", t.elapsed());
    assert_eq!(
        sb["network"],
        json!({"egress": "allow", "allow": ["allowed.test", "*.wild.test", "meta.test"]}),
        "the policy, normalized"
    );
    let id = sb["id"].as_str().unwrap().to_owned();
    api.write_file(&id, "/tmp/ca.pem", &pki.ca())
        .expect(200, "the test CA");

    // DNS answers the allowed names, and only them.
    assert_eq!(
        api.sh(&id, "getent hosts allowed.test | cut -d' ' -f1")
            .trim(),
        aip
    );
    assert_eq!(
        api.sh(&id, "getent hosts x.wild.test | cut -d' ' -f1")
            .trim(),
        aip,
        "a wildcard's subdomain"
    );
    let (code, out, _, dns_call) = run_sh(&api, &id, "getent hosts other.test");
    assert_ne!(code, 0, "other.test must not resolve: {out}");
    for name in ["wild.test", "meta.test"] {
        let (code, out, _, _) = run_sh(&api, &id, &format!("getent hosts {name}"));
        assert_ne!(code, 0, "{name} must not resolve: {out}");
    }
    let (_, out, _, _) = run_sh(
        &api,
        &id,
        "python3 -c \"import socket\ntry:\n  socket.gethostbyname('other.test'); print('RESOLVED')\nexcept OSError as e: print('REFUSED', e)\"",
    );
    assert!(out.starts_with("REFUSED"), "python: {out}");

    // The allowed name by HTTP and by TLS (checked against the test CA).
    assert_eq!(
        api.sh(&id, "curl -sS -m 5 http://allowed.test/").trim(),
        a.name
    );
    assert_eq!(
        api.sh(&id, "curl -sS -m 5 http://x.wild.test/").trim(),
        a.name
    );
    assert_eq!(
        api.sh(
            &id,
            "curl -sS -m 5 --cacert /tmp/ca.pem https://allowed.test/who"
        )
        .trim(),
        format!("tls-{}", a.name)
    );

    // Another name, even with its address given: refused, by HTTP and by TLS.
    let (_, out, _, other_call) = run_sh(
        &api,
        &id,
        &format!("curl -sS -m 5 --resolve other.test:80:{bip} http://other.test/"),
    );
    assert!(
        out.contains(&format!("egress to other.test {REFUSED}")),
        "{out}"
    );
    let (code, out, err, _) = run_sh(
        &api,
        &id,
        &format!("curl -sS -m 5 -k --resolve other.test:443:{bip} https://other.test/"),
    );
    assert_ne!(code, 0, "TLS to another name: {out}");
    assert!(err.contains("alert") || err.contains("denied"), "{err}");

    // Bare addresses, even the allowed server's: refused.
    let (_, out, _, ip_call) = run_sh(&api, &id, &format!("curl -sS -m 5 http://{bip}/"));
    assert!(
        out.contains(&format!("egress to {bip}:80 {REFUSED}")),
        "{out}"
    );
    let (_, out, _, _) = run_sh(&api, &id, &format!("curl -sS -m 5 http://{aip}/"));
    assert!(
        out.contains(REFUSED),
        "the allowed server by address: {out}"
    );
    let (code, _, _, _) = run_sh(&api, &id, &format!("curl -sS -m 5 -k https://{bip}/"));
    assert_ne!(code, 0, "TLS without SNI to an address");
    assert_ne!(
        reach(&api, &id, &bip, 8080),
        GREETING,
        "raw TCP names nothing"
    );

    // An allowed name forged onto another address (SNI or Host): the proxy dials the
    // name, so only the allowed server answers.
    assert_eq!(
        api.sh(
            &id,
            &format!(
                "curl -sS -m 5 --cacert /tmp/ca.pem --resolve allowed.test:443:{bip} https://allowed.test/who"
            )
        )
        .trim(),
        format!("tls-{}", a.name),
        "forged SNI"
    );
    assert_eq!(
        api.sh(
            &id,
            &format!("curl -sS -m 5 --resolve allowed.test:80:{bip} http://allowed.test/")
        )
        .trim(),
        a.name,
        "forged Host"
    );
    // An allowed name that resolves to the metadata address reaches nothing.
    let (_, out, _, _) = run_sh(
        &api,
        &id,
        &format!("curl -sS -m 5 --resolve meta.test:80:{bip} http://meta.test/"),
    );
    assert!(
        out.contains(&format!("egress to meta.test {REFUSED}")),
        "{out}"
    );
    assert_eq!(b.hits(), 0, "nothing ever reached the other server");

    // The never-reachable set holds under `allow` too.
    let gw = gateway(&lease(&srv, &id).expect("a lease").2);
    for (addr, port) in [
        ("169.254.169.254", 80),
        (gw.as_str(), srv.addr.port()),
        ("127.0.0.1", srv.addr.port()),
    ] {
        assert_ne!(reach(&api, &id, addr, port), GREETING, "{addr}:{port}");
    }
    let (_, out, _, _) = run_sh(
        &api,
        &id,
        &format!("curl -sS -m 5 http://{gw}:{}/healthz", srv.addr.port()),
    );
    assert!(!out.contains("status"), "Locker's port: {out}");

    // What was refused is in the call records.
    let q = format!("sandbox_id={id}");
    assert_eq!(denied_of(&api, &q, &dns_call), ["other.test"]);
    assert_eq!(denied_of(&api, &q, &other_call), ["other.test"]);
    assert_eq!(denied_of(&api, &q, &ip_call), [format!("{bip}:80")]);

    // Proxy overhead: sequential HTTP requests and a 64 MiB download through the proxy,
    // then the same with egress `all` (names still answered by the server's DNS, TCP
    // forwarded directly). Printed, not asserted: a measurement.
    api.write_file(
        &id,
        "/tmp/requests.py",
        br#"import socket, time
n, fails, t = 50, [], time.time()
for i in range(n):
    try:
        s = socket.create_connection(("allowed.test", 80), timeout=5)
        s.sendall(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        if not s.recv(4096):
            fails.append("empty answer")
        s.close()
    except OSError as e:
        fails.append(repr(e))
print((time.time() - t) / n * 1000)
print(fails)
"#,
    )
    .expect(200, "the request loop");
    let measure = |api: &Api| -> (f64, f64) {
        let out = api.sh(&id, "python3 /tmp/requests.py");
        let (ms, fails) = out.split_once('\n').unwrap();
        assert_eq!(fails.trim(), "[]", "every request answered");
        let r = api.exec(
            &id,
            &json!({"shell": "curl -sS -o /dev/null -w '%{speed_download}' http://allowed.test/big"}),
        );
        assert_eq!(r["exit_code"], 0, "the download: {r}");
        let bps: f64 = r["stdout"].as_str().unwrap().trim().parse().unwrap();
        (ms.trim().parse().unwrap(), bps / (1 << 20) as f64)
    };
    let (p_ms, p_mib) = measure(&api);
    api.patch(
        &format!("/v1/sandboxes/{id}"),
        &json!({"network": {"egress": "all"}}),
    )
    .expect(200, "patch to all");
    let (d_ms, d_mib) = measure(&api);
    eprintln!(
        "HTTP request (connect, resolve, answer): allow (proxied) {p_ms:.2} ms, all (direct) {d_ms:.2} ms; \
         64 MiB download: allow {p_mib:.0} MiB/s, all {d_mib:.0} MiB/s"
    );
}

#[test]
fn allow_policy_changes_apply_to_a_running_sandbox() {
    become_subreaper();
    let a = TestNet::start();
    let b = TestNet::start();
    let srv = start_pinned(&a, &b);
    wait_egress_ok(&srv);
    let api = srv.api();
    let (aip, bip) = (a.addr.to_string(), b.addr.to_string());
    let id = api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let patch = |network: Value| {
        let t = Instant::now();
        let r = api
            .patch(
                &format!("/v1/sandboxes/{id}"),
                &json!({ "network": network }),
            )
            .expect(200, &format!("patch to {network}"));
        eprintln!("patch to {network}: {:?}", t.elapsed());
        assert_eq!(r["network"], network);
    };
    let http = |name_or_ip: &str| -> String {
        run_sh(&api, &id, &format!("curl -sS -m 5 http://{name_or_ip}/")).1
    };

    patch(json!({"egress": "allow", "allow": ["allowed.test"]}));
    assert_eq!(http("allowed.test").trim(), a.name);
    assert!(http(&bip).contains(REFUSED));
    assert_ne!(reach(&api, &id, &bip, 8080), GREETING);

    // A CIDR lets its addresses through directly, any port, no name needed.
    let bnet = Ipv4Addr::from(u32::from(b.addr) & !3);
    patch(json!({"egress": "allow", "allow": ["allowed.test", format!("{bnet}/30")]}));
    assert_eq!(reach(&api, &id, &bip, 8080), GREETING, "the allowed CIDR");
    assert_eq!(http(&bip).trim(), b.name);
    assert_ne!(reach(&api, &id, &aip, 8080), GREETING, "outside the CIDR");

    // An empty list: nothing resolves, nothing connects.
    patch(json!({"egress": "allow", "allow": []}));
    let (code, _, _, _) = run_sh(&api, &id, "getent hosts allowed.test");
    assert_ne!(code, 0, "allowed.test no longer resolves");
    let out = run_sh(
        &api,
        &id,
        &format!("curl -sS -m 5 --resolve allowed.test:80:{aip} http://allowed.test/"),
    )
    .1;
    assert!(out.contains(REFUSED), "{out}");
    assert_ne!(reach(&api, &id, &bip, 8080), GREETING);

    // all: everything outside, names answered by the server's DNS too.
    patch(json!({"egress": "all"}));
    assert_eq!(reach(&api, &id, &bip, 8080), GREETING);
    assert_eq!(
        api.sh(&id, "getent hosts allowed.test | cut -d' ' -f1")
            .trim(),
        aip
    );
    assert_eq!(http("allowed.test").trim(), a.name);

    patch(json!({"egress": "allow", "allow": ["allowed.test"]}));
    let (slot, link, mip) = lease(&srv, &id).expect("a lease");
    assert!(
        nft_ruleset().contains(&format!("table ip locker_{link}")),
        "the machine's host table"
    );
    patch(json!({"egress": "none"}));
    assert_eq!(reach(&api, &id, &aip, 8080), "FAILED");
    assert_eq!(api.sh(&id, "ls /sys/class/net | tr '\\n' ' '").trim(), "lo");
    let rules = nft_ruleset();
    assert!(
        !rules.contains(&format!("locker_{link}")) && !rules.contains(&mip),
        "no rule of the machine is left"
    );
    assert!(!Path::new("/run/locker/net-slots")
        .join(slot.to_string())
        .exists());

    // Back to allow and destroy: nothing left either.
    patch(json!({"egress": "allow", "allow": ["allowed.test"]}));
    let (slot, link, mip) = lease(&srv, &id).expect("a lease");
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete");
    let rules = nft_ruleset();
    assert!(!rules.contains(&format!("locker_{link}")) && !rules.contains(&mip));
    assert!(!Path::new("/sys/class/net").join(&link).exists());
    assert!(!Path::new("/run/locker/net-slots")
        .join(slot.to_string())
        .exists());
}

/// Leases (in `/run/locker/net-slots`) held by machines under `dir`.
fn leases_under(dir: &Path) -> Vec<String> {
    std::fs::read_dir("/run/locker/net-slots")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path()).is_ok_and(|owner| Path::new(&owner).starts_with(dir))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn runs_get_egress_and_their_refusals_are_recorded() {
    become_subreaper();
    let a = TestNet::start();
    let b = TestNet::start();
    let srv = start_pinned(&a, &b);
    wait_egress_ok(&srv);
    let api = srv.api();
    let bip = b.addr.to_string();
    let vol = api
        .post("/v1/volumes", &json!({"name": "egress-runs"}))
        .expect(201, "a volume")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let run = |body: Value| -> Value {
        let t = Instant::now();
        let r = api
            .post(&format!("/v1/volumes/{vol}/run"), &body)
            .expect(200, &format!("run {body}"));
        eprintln!("run with network {}: {:?}", body["network"], t.elapsed());
        r
    };
    let raw = format!(
        "timeout 2 bash -c 'exec 3<>/dev/tcp/{bip}/8080 && head -n1 <&3' 2>/dev/null || echo FAILED"
    );

    let r = run(json!({
        "shell": format!("{raw}; curl -sS -m 5 http://allowed.test/; curl -sS -m 5 --resolve other.test:80:{bip} http://other.test/"),
        "network": {"egress": "allow", "allow": ["allowed.test"]},
    }));
    let out = r["stdout"].as_str().unwrap();
    assert!(out.contains(&a.name), "the allowed name: {r}");
    assert!(
        out.contains(&format!("egress to other.test {REFUSED}")),
        "{r}"
    );
    assert!(!out.contains(GREETING), "a bare address: {r}");
    let call = r["call_id"].as_str().unwrap();
    let mut denied = denied_of(&api, &format!("volume_id={vol}"), call);
    denied.sort();
    assert_eq!(denied, [format!("{bip}:8080"), "other.test".to_owned()]);

    let r = run(json!({"shell": raw.clone(), "network": {"egress": "all"}}));
    assert!(r["stdout"].as_str().unwrap().contains(GREETING), "{r}");
    let r = run(json!({"shell": raw.clone()}));
    assert!(
        r["stdout"].as_str().unwrap().contains("FAILED"),
        "none: {r}"
    );
    assert_eq!(b.hits(), 1, "only the `all` run reached the other server");

    // Run machines give their network back when they are destroyed (after the answer).
    let deadline = Instant::now() + Duration::from_secs(15);
    while !leases_under(&srv.data_dir).is_empty() {
        assert!(
            Instant::now() < deadline,
            "leases left: {:?}",
            leases_under(&srv.data_dir)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A server killed while it probed egress left its probe's namespace (named after its
/// pid) and the directory holding the probe's subnet lease; the next server's start
/// removes both with the rest of a crash's networks.
#[test]
fn a_killed_servers_egress_probe_leaves_nothing_after_the_next_start() {
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    let name = format!("locker-probe-{pid}");
    let ns = Path::new("/run/netns").join(&name);
    let owner = Path::new("/run/locker").join(&name);
    struct Cleanup(String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &self.0])
                .status();
            let _ = std::fs::remove_dir_all(Path::new("/run/locker").join(&self.0));
        }
    }
    let _cleanup = Cleanup(name.clone());
    let made = std::process::Command::new("ip")
        .args(["netns", "add", &name])
        .status()
        .unwrap();
    assert!(made.success());
    std::fs::create_dir_all(&owner).unwrap();
    let srv = Server::start();
    wait_egress_ok(&srv);
    assert!(!ns.exists(), "{} is still there", ns.display());
    assert!(!owner.exists(), "{} is still there", owner.display());
    assert!(
        srv.log_text().contains(&name),
        "the server says what it removed:\n{}",
        srv.log_text()
    );
}
