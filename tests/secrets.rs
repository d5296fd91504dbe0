//! Secrets that never enter the machine, end to end: the API never shows a value and the
//! store file never holds one in clear; a sandbox's env holds a placeholder; the egress
//! proxy puts the value into requests to the secret's host only (curl over HTTP/1.1 and
//! HTTP/2, Python, Node's fetch, the URL query, a WebSocket upgrade), verified upstream
//! against a test CA given by `--egress-ca`; bodies, other hosts, plain HTTP, a forged
//! SNI and a proxy CONNECT never get the value; rotation applies to new connections;
//! call records say `secrets_used` and `secret_misuse`; the server's log never holds the
//! value. The test hosts are Node servers (`data/secrets_echo.js`) in network namespaces
//! of their own, removed on drop. Run as root.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use locker_tests::egress::{ns_listens, wait_egress_ok, wire_namespace};
use locker_tests::server::{Api, Server};
use locker_tests::{become_subreaper, register_child, TempDir};
use serde_json::{json, Value};

/// A test CA and one server certificate for `names`, made with the openssl CLI.
struct Pki {
    dir: TempDir,
}

impl Pki {
    fn new(names: &[&str]) -> Pki {
        let dir = TempDir::new("ltsecpki");
        let d = dir.path();
        let san: Vec<String> = names.iter().map(|n| format!("DNS:{n}")).collect();
        std::fs::write(
            d.join("ext.cnf"),
            format!("subjectAltName={}\n", san.join(",")),
        )
        .unwrap();
        let key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
        for cmd in [
            format!("req -x509 {key} -keyout ca.key -out ca.pem -days 2 -subj /CN=locker-secrets-test-ca"),
            format!("req {key} -keyout srv.key -out srv.csr -subj /CN={}", names[0]),
            "x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out srv.pem -days 2 -extfile ext.cnf".to_owned(),
        ] {
            let out = Command::new("openssl")
                .args(cmd.split(' '))
                .current_dir(d)
                .output()
                .expect("run openssl");
            assert!(out.status.success(), "openssl {cmd}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Pki { dir }
    }
    fn path(&self, f: &str) -> PathBuf {
        self.dir.path().join(f)
    }
}

/// An echo host (`data/secrets_echo.js`) in a network namespace of its own.
struct EchoHost {
    ns: String,
    link: String,
    addr: Ipv4Addr,
    child: Option<std::process::Child>,
    log: PathBuf,
    _dir: TempDir,
}

impl EchoHost {
    fn start(name: &str, pki: &Pki, values: &[&str; 2]) -> EchoHost {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let ns = format!("ltsec-{pid}-{n}");
        let link = format!("ls{}x{n}", pid % 100_000);
        let third = (((pid % 60) * 4 + n) % 256) as u8;
        let (srv, host) = (
            Ipv4Addr::new(198, 19, third, 1),
            Ipv4Addr::new(198, 19, third, 2),
        );
        let dir = TempDir::new("ltsecho");
        let mut h = EchoHost {
            ns: ns.clone(),
            link: link.clone(),
            addr: srv,
            child: None,
            log: dir.path().join("requests.log"),
            _dir: dir,
        };
        wire_namespace(&ns, &link, host, srv);
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/secrets_echo.js");
        std::fs::write(&h.log, "").unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &ns, "node"])
            .arg(&script)
            .arg(srv.to_string())
            .arg(name)
            .arg(pki.path("srv.pem"))
            .arg(pki.path("srv.key"))
            .arg(&h.log)
            .env("SECRET_VALUE_1", values[0])
            .env("SECRET_VALUE_2", values[1])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start node (the test host)");
        register_child(child.id());
        h.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while !(ns_listens(&ns, 443) && ns_listens(&ns, 8443) && ns_listens(&ns, 80)) {
            assert!(Instant::now() < deadline, "the echo host listens");
            std::thread::sleep(Duration::from_millis(50));
        }
        h
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for EchoHost {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.link])
            .output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

fn random_value(tag: &str) -> String {
    let mut b = [0u8; 12];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("sk-test-{tag}-{hex}")
}

fn json_put(api: &Api, path: &str, body: &Value) -> locker_tests::server::Resp {
    api.request(
        "PUT",
        path,
        &[("Content-Type", "application/json")],
        body.to_string(),
    )
}

/// The JSON line an echo host answered, from a command's stdout.
fn echo(out: &str) -> Value {
    let line = out
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no answer from the echo host: {out:?}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

/// Runs `script` in the sandbox; its stdout and its call id (asserting exit 0).
fn sh(api: &Api, id: &str, script: &str) -> (String, String) {
    let r = api.exec(id, &json!({ "shell": script, "timeout_ms": 30000 }));
    assert_eq!(r["exit_code"], 0, "{script}: {r}");
    (
        r["stdout"].as_str().unwrap_or_default().to_owned(),
        r["call_id"].as_str().unwrap_or_default().to_owned(),
    )
}

/// The record of call `call_id` (records are written in batches: waits for it).
fn record(api: &Api, sandbox: &str, call_id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let calls = api
            .get(&format!("/v1/calls?sandbox_id={sandbox}&limit=200"))
            .json();
        if let Some(c) = calls["calls"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["id"] == call_id)
        {
            return c.clone();
        }
        assert!(Instant::now() < deadline, "no record of call {call_id}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The files directly in the data dir (the database, its journal, the key) that hold
/// `needle`.
fn files_hold(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("the data dir").flatten() {
        let p = e.path();
        if p.is_file() {
            if let Ok(b) = std::fs::read(&p) {
                if b.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                    out.push(p);
                }
            }
        }
    }
    out
}

#[test]
fn the_api_never_shows_a_value_and_checks_what_it_is_given() {
    let srv = Server::start();
    let api = srv.api();
    let value = random_value("api");
    let made = api
        .post(
            "/v1/secrets",
            &json!({"name": "example", "value": value, "hosts": ["API.Example.test."], "env": "EXAMPLE_KEY"}),
        )
        .expect(201, "create a secret");
    assert_eq!(made["hosts"], json!(["api.example.test"]));
    assert!(!made.to_string().contains(&value));
    let list = api.get("/v1/secrets").expect(200, "list");
    assert_eq!(list["secrets"][0]["name"], "example");
    assert_eq!(list["secrets"][0]["env"], "EXAMPLE_KEY");
    assert!(!list.to_string().contains(&value));
    assert!(!api
        .get("/v1/secrets/example")
        .expect(200, "get")
        .to_string()
        .contains(&value));
    api.post(
        "/v1/secrets",
        &json!({"name": "example", "value": "x", "hosts": ["a.test"], "env": "X"}),
    )
    .expect(409, "a second secret by that name");
    for (bad, why) in [
        (
            json!({"name": "Bad Name", "value": "x", "hosts": ["a.test"], "env": "X"}),
            "name",
        ),
        (
            json!({"name": "b", "value": "", "hosts": ["a.test"], "env": "X"}),
            "empty value",
        ),
        (
            json!({"name": "b", "value": "a\nb", "hosts": ["a.test"], "env": "X"}),
            "line break",
        ),
        (
            json!({"name": "b", "value": "x", "hosts": [], "env": "X"}),
            "no hosts",
        ),
        (
            json!({"name": "b", "value": "x", "hosts": ["*.a.test"], "env": "X"}),
            "wildcard",
        ),
        (
            json!({"name": "b", "value": "x", "hosts": ["10.0.0.1"], "env": "X"}),
            "address",
        ),
        (
            json!({"name": "b", "value": "x", "hosts": ["a.test"], "env": "1X"}),
            "env",
        ),
        (
            json!({"name": "b", "value": "x", "hosts": ["a.test"], "env": "SSL_CERT_FILE"}),
            "env",
        ),
        (
            json!({"name": "b", "value": "x", "hosts": ["a.test"], "env": "X", "extra": 1}),
            "field",
        ),
    ] {
        api.post("/v1/secrets", &bad).expect(400, why);
    }
    // Rotation: value, hosts, env; never echoed.
    let value2 = random_value("api2");
    let r = json_put(
        &api,
        "/v1/secrets/example",
        &json!({"value": value2, "hosts": ["b.test"]}),
    )
    .expect(200, "rotate");
    assert_eq!(r["hosts"], json!(["b.test"]));
    assert!(!r.to_string().contains(&value2));
    json_put(&api, "/v1/secrets/example", &json!({})).expect(400, "nothing to change");
    json_put(&api, "/v1/secrets/nope", &json!({"value": "x"})).expect(404, "no such secret");
    // Sandboxes: `none` with secrets, unknown secrets and placeholder-shaped env are refused.
    api.post(
        "/v1/sandboxes",
        &json!({"secrets": ["example"], "network": {"egress": "none"}}),
    )
    .expect(400, "secrets under none");
    api.post(
        "/v1/sandboxes",
        &json!({"secrets": ["example"], "network": {"egress": "all"}}),
    )
    .expect(400, "secrets under all");
    api.post("/v1/sandboxes", &json!({"secrets": ["nope"]}))
        .expect(404, "an unknown secret");
    api.post(
        "/v1/sandboxes",
        &json!({"env": {"X": "locker-secret-example-0123456789abcdef0123456789abcdef"}}),
    )
    .expect(400, "a forged placeholder");
    // Another tenant sees none of it.
    let (other, _) = srv.create_tenant("sec-other");
    assert_eq!(
        other.get("/v1/secrets").expect(200, "list")["secrets"],
        json!([])
    );
    other
        .get("/v1/secrets/example")
        .expect(404, "another tenant's secret");
    // The key file is 0600; the value is nowhere on disk in clear, nor in the log.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(srv.data_dir.join("secrets.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    for v in [&value, &value2] {
        assert_eq!(
            files_hold(&srv.data_dir, v),
            Vec::<PathBuf>::new(),
            "a value in clear"
        );
        assert!(
            !srv.log_text().contains(v.as_str()),
            "a value in the server log"
        );
    }
    api.delete("/v1/secrets/example").expect(204, "delete");
    api.delete("/v1/secrets/example")
        .expect(404, "delete twice");
}

#[test]
fn values_reach_only_their_hosts_through_the_proxy() {
    become_subreaper();
    let v1 = random_value("one");
    let v2 = random_value("two");
    let pki = Pki::new(&["api.secret.test", "other.test"]);
    let a = EchoHost::start("a", &pki, &[&v1, &v2]);
    let b = EchoHost::start("b", &pki, &[&v1, &v2]);
    let ca = pki.path("ca.pem").display().to_string();
    let pin_a = format!("api.secret.test={}", a.addr);
    let pin_b = format!("other.test={}", b.addr);
    let srv = Server::start_with(&[
        "--egress-ca",
        &ca,
        "--egress-resolve",
        &pin_a,
        "--egress-resolve",
        &pin_b,
    ]);
    wait_egress_ok(&srv);
    let api = srv.api();
    api.post(
        "/v1/secrets",
        &json!({"name": "example", "value": v1, "hosts": ["api.secret.test"], "env": "EXAMPLE_KEY"}),
    )
    .expect(201, "create a secret");
    let sb = api.create_sandbox(&json!({
        "secrets": ["example"],
        "network": {"egress": "allow", "allow": ["other.test"]},
    }));
    let id = sb["id"].as_str().unwrap().to_owned();
    assert_eq!(
        sb["network"],
        json!({"egress": "allow", "allow": ["other.test", "api.secret.test"]}),
        "the secret's host joins the allowlist"
    );
    api.write_file(
        &id,
        "/tmp/test-ca.pem",
        &std::fs::read(pki.path("ca.pem")).unwrap(),
    )
    .expect(200, "the test CA (for other.test, passed through)");

    let (env, _) = sh(&api, &id, "printf %s \"$EXAMPLE_KEY\"");
    assert!(
        env.starts_with("locker-secret-example-"),
        "a placeholder: {env}"
    );
    let placeholder = env.clone();

    // curl, HTTP/1.1 and HTTP/2: the host sees the value, in a header and in the query.
    let (out, curl_call) = sh(
        &api,
        &id,
        "curl -sS -m 10 --http1.1 -w '\\nHTTP/%{http_version}\\n' -H \"Authorization: Bearer $EXAMPLE_KEY\" \"https://api.secret.test/h1?key=$EXAMPLE_KEY\"",
    );
    assert!(
        out.contains("HTTP/1.1"),
        "the machine spoke HTTP/1.1: {out}"
    );
    let e = echo(&out);
    assert_eq!(e["headers"]["authorization"], "Bearer [value-1]", "{e}");
    assert_eq!(e["url"], "/h1?key=[value-1]");
    let (out, _) = sh(
        &api,
        &id,
        "curl -sS -m 10 --http2 -w '\\nHTTP/%{http_version}\\n' -H \"Authorization: Bearer $EXAMPLE_KEY\" -d \"body $EXAMPLE_KEY\" https://api.secret.test/h2",
    );
    assert!(
        out.contains("HTTP/2"),
        "the machine spoke HTTP/2 with the proxy: {out}"
    );
    let e = echo(&out);
    assert_eq!(e["version"], "2.0", "and the proxy with the host: {e}");
    assert_eq!(e["headers"]["authorization"], "Bearer [value-1]");
    assert_eq!(
        e["body"],
        format!("body {placeholder}"),
        "bodies are never changed"
    );

    // Keep-alive: two requests on one connection, both swapped.
    let (out, _) = sh(
        &api,
        &id,
        "curl -sS -m 10 --http1.1 -H \"Authorization: Bearer $EXAMPLE_KEY\" https://api.secret.test/k1 https://api.secret.test/k2 -w '\\n%{num_connects}\\n'",
    );
    assert_eq!(out.matches("Bearer [value-1]").count(), 2, "{out}");

    // Python (urllib) and Node's fetch.
    let (out, _) = sh(
        &api,
        &id,
        "python3 -c \"import os,urllib.request as u; r=u.Request('https://api.secret.test/py', headers={'Authorization': 'Bearer '+os.environ['EXAMPLE_KEY']}); print(u.urlopen(r, timeout=10).read().decode())\"",
    );
    assert_eq!(echo(&out)["headers"]["authorization"], "Bearer [value-1]");
    let (out, _) = sh(
        &api,
        &id,
        "node -e \"fetch('https://api.secret.test/node', {headers: {Authorization: 'Bearer ' + process.env.EXAMPLE_KEY}}).then(r => r.text()).then(t => console.log(t))\"",
    );
    assert_eq!(echo(&out)["headers"]["authorization"], "Bearer [value-1]");

    // WebSocket: the upgrade carries the value; bytes then pass both ways.
    let ws = r#"
import os, socket, ssl
ctx = ssl.create_default_context()
s = ctx.wrap_socket(socket.create_connection(('api.secret.test', 8443), timeout=10), server_hostname='api.secret.test')
s.sendall(('GET /ws HTTP/1.1\r\nHost: api.secret.test:8443\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer ' + os.environ['EXAMPLE_KEY'] + '\r\n\r\n').encode())
head = b''
while b'\r\n\r\n' not in head:
    head += s.recv(4096)
print(head.decode().split('\r\n')[0])
for l in head.decode().split('\r\n'):
    if l.lower().startswith('x-authorization-seen'):
        print(l)
s.sendall(b'ping over the upgrade')
print(s.recv(4096).decode())
"#;
    api.write_file(&id, "/tmp/ws.py", ws.as_bytes())
        .expect(200, "ws client");
    let (out, _) = sh(&api, &id, "python3 /tmp/ws.py");
    assert!(out.contains("101"), "{out}");
    assert!(
        out.to_lowercase()
            .contains("x-authorization-seen: bearer [value-1]"),
        "{out}"
    );
    assert!(out.contains("PING OVER THE UPGRADE"), "{out}");

    // Another host gets the placeholder (passed through by SNI, checked with the test CA).
    let (out, _) = sh(
        &api,
        &id,
        "curl -sS -m 10 --cacert /tmp/test-ca.pem -H \"Authorization: Bearer $EXAMPLE_KEY\" https://other.test/x",
    );
    assert_eq!(
        echo(&out)["headers"]["authorization"],
        format!("Bearer {placeholder}")
    );
    // Plain HTTP to the right host: never the value, and noted as misuse.
    let (out, http_call) = sh(
        &api,
        &id,
        "curl -sS -m 10 -H \"Authorization: Bearer $EXAMPLE_KEY\" http://api.secret.test/plain",
    );
    assert_eq!(
        echo(&out)["headers"]["authorization"],
        format!("Bearer {placeholder}")
    );
    // A forged SNI aimed at the other host's address reaches the secret's own host.
    let (out, _) = sh(
        &api,
        &id,
        &format!("curl -sS -m 10 --resolve api.secret.test:443:{} -H \"Authorization: Bearer $EXAMPLE_KEY\" https://api.secret.test/forged", b.addr),
    );
    assert_eq!(
        echo(&out)["server"],
        "a",
        "the proxy dials the name, not the address"
    );
    // A proxy CONNECT through the other host never makes the proxy send the value there.
    let r = api.exec(
        &id,
        &json!({"shell": "curl -sS -m 10 -p -x http://other.test:80 -H \"Authorization: Bearer $EXAMPLE_KEY\" https://api.secret.test/connect", "timeout_ms": 30000}),
    );
    assert!(
        !r["stdout"]
            .as_str()
            .unwrap_or_default()
            .contains("[value-1]"),
        "{r}"
    );

    // Rotation applies to new connections.
    json_put(&api, "/v1/secrets/example", &json!({"value": v2})).expect(200, "rotate");
    let (out, _) = sh(
        &api,
        &id,
        "curl -sS -m 10 -H \"Authorization: Bearer $EXAMPLE_KEY\" https://api.secret.test/rotated",
    );
    assert_eq!(echo(&out)["headers"]["authorization"], "Bearer [value-2]");

    // Only the secret's host ever received a value.
    assert!(
        a.log().contains(&v1) && a.log().contains(&v2),
        "{}",
        a.log()
    );
    let blog = b.log();
    assert!(
        !blog.contains(&v1) && !blog.contains(&v2),
        "the other host got a value: {blog}"
    );
    assert!(blog.contains(&placeholder));

    // The machine never holds the value: env, files, processes' environments and command
    // lines. The checker gets each value in two halves, so that no command line (its own
    // included) holds it whole.
    let scan = r#"
import os, sys
needle = (sys.argv[1] + sys.argv[2]).encode()
me = str(os.getpid())
hits = []
for pid in os.listdir('/proc'):
    if not pid.isdigit() or pid == me:
        continue
    for f in ('environ', 'cmdline'):
        try:
            if needle in open(f'/proc/{pid}/{f}', 'rb').read():
                hits.append(f'/proc/{pid}/{f}')
        except OSError:
            pass
for top in ('/etc', '/root', '/tmp', '/home', '/usr/local', '/workspace'):
    for d, _, files in os.walk(top):
        for f in files:
            p = os.path.join(d, f)
            try:
                if os.path.isfile(p) and needle in open(p, 'rb').read():
                    hits.append(p)
            except OSError:
                pass
print(len(hits), hits)
"#;
    api.write_file(&id, "/tmp/scan.py", scan.as_bytes())
        .expect(200, "the scanner");
    for v in [&v1, &v2] {
        let (a, b) = v.split_at(v.len() / 2);
        let (out, _) = sh(&api, &id, &format!("python3 /tmp/scan.py '{a}' '{b}'"));
        assert_eq!(out.trim(), "0 []", "the value inside the machine");
        let (out, _) = sh(&api, &id, &format!("env | grep -c -- '{a}' || true"));
        assert_eq!(out.trim(), "0");
    }

    // Call records.
    let rec = record(&api, &id, &curl_call);
    assert_eq!(
        rec["secrets_used"],
        json!([{"name": "example", "host": "api.secret.test"}]),
        "{rec}"
    );
    assert!(!rec.to_string().contains(&v1));
    let rec = record(&api, &id, &http_call);
    assert_eq!(
        rec["secret_misuse"],
        json!([{"name": "example", "destination": "http://api.secret.test"}]),
        "{rec}"
    );

    // A run gets the same.
    let vol = api
        .post("/v1/volumes", &json!({"name": "secvol"}))
        .expect(201, "volume");
    let run = api
        .post(
            &format!("/v1/volumes/{}/run", vol["id"].as_str().unwrap()),
            &json!({"shell": "curl -sS -m 10 -H \"Authorization: Bearer $EXAMPLE_KEY\" https://api.secret.test/run", "secrets": ["example"]}),
        )
        .expect(200, "a run with a secret");
    assert_eq!(
        echo(run["stdout"].as_str().unwrap())["headers"]["authorization"],
        "Bearer [value-2]",
        "{run}"
    );

    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete");
    for v in [&v1, &v2] {
        assert!(
            !srv.log_text().contains(v.as_str()),
            "a value in the server log"
        );
        assert_eq!(
            files_hold(&srv.data_dir, v),
            Vec::<PathBuf>::new(),
            "a value on disk"
        );
    }
}
