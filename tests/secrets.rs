//! Secrets that never enter the machine, end to end: the API never shows a value and the
//! store file never holds one in clear; a sandbox's env holds a placeholder; the egress
//! proxy puts the value into requests to the secret's host only (curl over HTTP/1.1 and
//! HTTP/2, Python, Node's fetch, the URL query, a WebSocket upgrade), verified upstream
//! against a test CA given by `--egress-ca`; bodies, other hosts, plain HTTP, a forged
//! SNI and a proxy CONNECT never get the value; rotation applies to new connections;
//! call records say `secrets_used` and `secret_misuse`; the server's log never holds the
//! value; Python `requests` (Debian's, handed in from the host) works, and while its client
//! lives no process's environment or memory in the machine holds the value. A microVM goes
//! through the same proxy. Forks, snapshots and E2B-style creates keep secrets by name, and
//! a secret's new hosts join the running sandboxes' allowlists. The test hosts are Node
//! servers (`data/secrets_echo.js`) in network namespaces of their own, removed on drop.
//! Run as root.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use locker_tests::become_subreaper;
use locker_tests::echo::{secret_value, EchoHost, Pki};
use locker_tests::egress::wait_egress_ok;
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

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
    let r = api.exec(id, &json!({ "shell": script, "timeout_ms": 120000 }));
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
    let value = secret_value("api");
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
    let value2 = secret_value("api2");
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

/// Two echo hosts (`a` serves the secret's names, `b` another), a server that trusts their
/// CA and pins their names, and secret `example` (value `v1`, host `api.secret.test`, env
/// `EXAMPLE_KEY`).
struct World {
    // Dropped in this order: the server (and its sandboxes) first.
    srv: Server,
    a: EchoHost,
    b: EchoHost,
    pki: Pki,
    v1: String,
    v2: String,
}

impl World {
    fn new() -> World {
        become_subreaper();
        let v1 = secret_value("one");
        let v2 = secret_value("two");
        let pki = Pki::new(&["api.secret.test", "api2.secret.test", "other.test"]);
        let a = EchoHost::start("a", &pki, &[&v1, &v2]);
        let b = EchoHost::start("b", &pki, &[&v1, &v2]);
        let ca = pki.path("ca.pem").display().to_string();
        let pins = [
            format!("api.secret.test={}", a.addr),
            format!("api2.secret.test={}", a.addr),
            format!("other.test={}", b.addr),
        ];
        let srv = Server::start_with(&[
            "--egress-ca",
            &ca,
            "--egress-resolve",
            &pins[0],
            "--egress-resolve",
            &pins[1],
            "--egress-resolve",
            &pins[2],
        ]);
        wait_egress_ok(&srv);
        srv.api()
            .post(
                "/v1/secrets",
                &json!({"name": "example", "value": v1, "hosts": ["api.secret.test"], "env": "EXAMPLE_KEY"}),
            )
            .expect(201, "create a secret");
        World {
            srv,
            a,
            b,
            pki,
            v1,
            v2,
        }
    }

    /// A sandbox of `runtime` with secret `example`, allowed `other.test` too, with the test
    /// CA at /tmp/test-ca.pem (for other.test, passed through): its id and placeholder.
    fn sandbox(&self, runtime: &str) -> (String, String) {
        let api = self.srv.api();
        let sb = api.create_sandbox(&json!({
            "runtime": runtime,
            "memory_mb": 512,
            "secrets": ["example"],
            "network": {"egress": "allow", "allow": ["other.test"]},
        }));
        assert_eq!(sb["runtime"], runtime, "{sb}");
        let id = sb["id"].as_str().unwrap().to_owned();
        assert_eq!(
            sb["network"],
            json!({"egress": "allow", "allow": ["other.test", "api.secret.test"]}),
            "the secret's host joins the allowlist"
        );
        api.write_file(
            &id,
            "/tmp/test-ca.pem",
            &std::fs::read(self.pki.path("ca.pem")).unwrap(),
        )
        .expect(200, "the test CA (for other.test, passed through)");
        // Also on the disk, which forks and snapshots keep (/tmp is memory in a jail).
        sh(&api, &id, "cp /tmp/test-ca.pem /root/test-ca.pem");
        let (ph, _) = sh(&api, &id, "printf %s \"$EXAMPLE_KEY\"");
        assert!(
            ph.starts_with("locker-secret-example-"),
            "a placeholder: {ph}"
        );
        (id, ph)
    }
}

/// The directory of Debian's python3-requests and what it imports, on this host.
const DIST: &str = "/usr/lib/python3/dist-packages";
const REQUESTS_PKGS: [&str; 6] = [
    "requests",
    "urllib3",
    "idna",
    "charset_normalizer",
    "chardet",
    "certifi",
];

/// Hands Debian's `requests` (and what it imports) from this host into the machine at
/// /opt/pyreq (machines reach no package index; host and template are both Debian 12 with
/// Python 3.11). `scripts/setup test` installs python3-requests.
fn hand_in_requests(api: &Api, id: &str) {
    let have: Vec<&str> = REQUESTS_PKGS
        .iter()
        .copied()
        .filter(|p| Path::new(DIST).join(p).is_dir())
        .collect();
    assert!(
        have.contains(&"requests") && have.contains(&"urllib3"),
        "Debian's python3-requests is installed on this host (apt-get install python3-requests; scripts/setup test does)"
    );
    let tar = Command::new("tar")
        .args(["-C", DIST, "--exclude=__pycache__", "-cf", "-"])
        .args(&have)
        .output()
        .expect("run tar");
    assert!(
        tar.status.success(),
        "tar: {}",
        String::from_utf8_lossy(&tar.stderr)
    );
    api.request(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/opt/pyreq"),
        &[("Content-Type", "application/x-tar")],
        tar.stdout,
    )
    .expect(200, "requests into the machine");
}

/// A Python client that sends `EXAMPLE_KEY` with Debian's `requests` (from /opt/pyreq),
/// prints where `requests` came from and the answers, then stays alive holding its session
/// (and its kept-alive connection) until the scan is done.
const CLIENT_PY: &str = r#"
import os, sys, time, requests
print('requests', requests.__version__, requests.__file__, flush=True)
s = requests.Session()
r = s.get('https://api.secret.test/requests', headers={'Authorization': 'Bearer ' + os.environ['EXAMPLE_KEY']}, timeout=20)
print(r.text.strip(), flush=True)
r = s.get('https://api.secret.test/requests-again', headers={'Authorization': 'Bearer ' + os.environ['EXAMPLE_KEY']}, timeout=20)
print('again', r.status_code, flush=True)
sys.stdin.read()
"#;

/// Scans the machine for the value, given in two halves (so that no command line, its own
/// included, holds it whole): every other process's environment, command line and readable
/// memory (`/proc/PID/mem`: what a core dump of it would hold), and the files under the
/// usual places. With `spawn` as its fourth argument it first starts [`CLIENT_PY`] as its
/// child (a descendant's memory is readable whatever the kernel's ptrace policy) and scans
/// while the client lives. Prints JSON: the hits, how many processes' memory it read, the
/// client's output, how many bytes of the client's memory it read and whether they hold
/// the placeholder (the third argument): the proof that the scan sees what a process holds.
const SCAN_PY: &str = r#"
import json, os, subprocess, sys
needle = (sys.argv[1] + sys.argv[2]).encode()
probe = sys.argv[3].encode()
client, client_out = None, []
if sys.argv[4] == 'spawn':
    client = subprocess.Popen([sys.executable, '/tmp/client.py'], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in client.stdout:
        client_out.append(line.rstrip('\n'))
        if line.startswith('again') or line.startswith('Traceback'):
            break
me = str(os.getpid())
keep = max(len(needle), len(probe))
hits, read, client_bytes, client_probe = [], 0, 0, False
CHUNK = 8 << 20
for pid in os.listdir('/proc'):
    if not pid.isdigit() or pid == me:
        continue
    for f in ('environ', 'cmdline'):
        try:
            if needle in open(f'/proc/{pid}/{f}', 'rb').read():
                hits.append(f'/proc/{pid}/{f}')
        except OSError:
            pass
    try:
        maps = open(f'/proc/{pid}/maps').read().splitlines()
        mem = open(f'/proc/{pid}/mem', 'rb', 0)
    except OSError:
        continue
    n, has_probe = 0, False
    for line in maps:
        parts = line.split()
        if 'r' not in parts[1] or (len(parts) > 5 and parts[5] in ('[vvar]', '[vvar_vclock]', '[vsyscall]')):
            continue
        a, b = (int(x, 16) for x in parts[0].split('-'))
        tail = b''
        while a < b:
            try:
                mem.seek(a)
                data = mem.read(min(CHUNK, b - a))
            except (OSError, ValueError, OverflowError):
                break
            if not data:
                break
            block = tail + data
            if needle in block:
                hits.append(f'/proc/{pid}/mem {parts[0]} {parts[5] if len(parts) > 5 else ""}')
            if probe in block:
                has_probe = True
            tail = block[-keep:]
            n += len(data)
            a += len(data)
    mem.close()
    if n:
        read += 1
    if client is not None and pid == str(client.pid):
        client_bytes, client_probe = n, has_probe
for top in ('/etc', '/root', '/tmp', '/home', '/opt', '/usr/local', '/workspace'):
    for d, _, files in os.walk(top):
        for f in files:
            p = os.path.join(d, f)
            try:
                if os.path.isfile(p) and needle in open(p, 'rb').read():
                    hits.append(p)
            except OSError:
                pass
if client is not None:
    client.kill()
    client.wait()
print(json.dumps({'hits': hits, 'processes_read': read, 'client_out': client_out, 'client_bytes': client_bytes, 'client_placeholder': client_probe}))
"#;

/// Runs the scanner in sandbox `id` for `value`: its JSON.
fn scan(api: &Api, id: &str, value: &str, placeholder: &str, spawn: bool) -> Value {
    let (a, b) = value.split_at(value.len() / 2);
    let mode = if spawn { "spawn" } else { "none" };
    let (out, _) = sh(
        api,
        id,
        &format!("PYTHONPATH=/opt/pyreq python3 /tmp/scan.py '{a}' '{b}' '{placeholder}' {mode}"),
    );
    let r: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(r["hits"], json!([]), "the value inside the machine: {r}");
    let (out, _) = sh(api, id, &format!("env | grep -c -- '{a}' || true"));
    assert_eq!(out.trim(), "0");
    r
}

/// Python `requests` in the machine ([`CLIENT_PY`]): the host gets the value, the machine
/// only the mask; then, while the client lives, no process's environment or memory (the
/// client's included) and no file holds `value`.
fn requests_then_scan(api: &Api, id: &str, placeholder: &str, value: &str) {
    hand_in_requests(api, id);
    api.write_file(id, "/tmp/client.py", CLIENT_PY.as_bytes())
        .expect(200, "the client");
    api.write_file(id, "/tmp/scan.py", SCAN_PY.as_bytes())
        .expect(200, "the scanner");
    let r = scan(api, id, value, placeholder, true);
    let out: Vec<&str> = r["client_out"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        out.first()
            .is_some_and(|l| l.starts_with("requests 2.") && l.contains("/opt/pyreq/requests/")),
        "Debian's requests was used: {r}"
    );
    let e = echo(&out.join("\n"));
    assert_eq!(e["headers"]["authorization"], "Bearer [value-1]", "{e}");
    assert!(out.contains(&"again 200"), "{r}");
    assert!(
        r["client_bytes"].as_u64().unwrap_or(0) > 1 << 20,
        "the client's memory was read: {r}"
    );
    assert_eq!(
        r["client_placeholder"], true,
        "the scan finds what the client holds (its placeholder): {r}"
    );
}

/// Only the secret's host ever received a value; the other one saw the placeholder.
fn only_a_got_values(w: &World, placeholder: &str) {
    let blog = w.b.log();
    assert!(
        !blog.contains(&w.v1) && !blog.contains(&w.v2),
        "the other host got a value: {blog}"
    );
    assert!(blog.contains(placeholder), "{blog}");
}

/// Neither the server's log nor a file in its data dir holds a value.
fn nowhere_on_the_host(w: &World) {
    for v in [&w.v1, &w.v2] {
        assert!(
            !w.srv.log_text().contains(v.as_str()),
            "a value in the server log"
        );
        assert_eq!(
            files_hold(&w.srv.data_dir, v),
            Vec::<PathBuf>::new(),
            "a value on disk"
        );
    }
}

#[test]
fn values_reach_only_their_hosts_through_the_proxy() {
    let w = World::new();
    let (v1, v2) = (w.v1.clone(), w.v2.clone());
    let api = w.srv.api();
    let (id, placeholder) = w.sandbox("jail");

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
        &format!("curl -sS -m 10 --resolve api.secret.test:443:{} -H \"Authorization: Bearer $EXAMPLE_KEY\" https://api.secret.test/forged", w.b.addr),
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

    // Python `requests`, then no process's environment or memory (the live client's
    // included) and no file holds the value.
    requests_then_scan(&api, &id, &placeholder, &v1);

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
        w.a.log().contains(&v1) && w.a.log().contains(&v2),
        "{}",
        w.a.log()
    );
    only_a_got_values(&w, &placeholder);

    // The machine never holds the rotated value either.
    scan(&api, &id, &v2, &placeholder, false);

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
    nowhere_on_the_host(&w);
}

/// A microVM goes through the same proxy as a jail: its placeholder is swapped for the
/// value towards the secret's host only (curl, Python `requests`), its processes'
/// environments and memory and its files never hold the value, and its call records say
/// where the secret went.
#[test]
fn a_microvm_gets_values_through_the_same_proxy() {
    let w = World::new();
    let api = w.srv.api();
    let (id, placeholder) = w.sandbox("microvm");
    let (out, call) = sh(
        &api,
        &id,
        "curl -sS -m 20 --http2 -w '\\nHTTP/%{http_version}\\n' -H \"Authorization: Bearer $EXAMPLE_KEY\" \"https://api.secret.test/vm?key=$EXAMPLE_KEY\"",
    );
    let e = echo(&out);
    assert_eq!(e["headers"]["authorization"], "Bearer [value-1]", "{e}");
    assert_eq!(e["url"], "/vm?key=[value-1]");
    assert!(out.contains("HTTP/2"), "HTTP/2 with the proxy: {out}");
    let (out, _) = sh(
        &api,
        &id,
        "curl -sS -m 20 --cacert /tmp/test-ca.pem -H \"Authorization: Bearer $EXAMPLE_KEY\" https://other.test/vm",
    );
    assert_eq!(
        echo(&out)["headers"]["authorization"],
        format!("Bearer {placeholder}")
    );
    requests_then_scan(&api, &id, &placeholder, &w.v1);
    let rec = record(&api, &id, &call);
    assert_eq!(
        rec["secrets_used"],
        json!([{"name": "example", "host": "api.secret.test"}]),
        "{rec}"
    );
    only_a_got_values(&w, &placeholder);
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete");
    nowhere_on_the_host(&w);
}

/// `curl` with `key` (`$EXAMPLE_KEY`, or a placeholder read from a file) to `url` in sandbox
/// `id`, trusting the machine's store (intercepted hosts) and the test CA (hosts passed
/// through): the authorization header the echo host saw (values masked).
fn auth_seen(api: &Api, id: &str, url: &str, key: &str) -> String {
    let (out, _) = sh(
        api,
        id,
        &format!("cat /etc/ssl/certs/ca-certificates.crt /root/test-ca.pem > /tmp/both.pem && curl -sS -m 10 --cacert /tmp/both.pem -H \"Authorization: Bearer {key}\" {url}"),
    );
    echo(&out)["headers"]["authorization"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Forks, snapshots and E2B-style creates keep a sandbox's secrets by name (the same
/// placeholders, values put in by the proxy), the snapshot never holds a value, and a
/// secret's new hosts join the allowlists of the running sandboxes that hold it.
#[test]
fn forks_snapshots_and_new_hosts_follow_the_secret() {
    let w = World::new();
    let api = w.srv.api();
    let (id, placeholder) = w.sandbox("jail");
    // A file on the sandbox's disk holds the placeholder, as an agent's config file would.
    sh(&api, &id, "printf %s \"$EXAMPLE_KEY\" > /root/key.txt");

    // A fork: the same placeholder, armed for the child.
    let forks = api
        .post(&format!("/v1/sandboxes/{id}/fork"), &json!({"count": 1}))
        .expect(201, "fork");
    let child = forks["sandboxes"][0]["id"].as_str().unwrap().to_owned();
    let (env, _) = sh(&api, &child, "printf %s \"$EXAMPLE_KEY\"");
    assert_eq!(env, placeholder, "the fork keeps the placeholder");
    assert_eq!(
        auth_seen(&api, &child, "https://api.secret.test/fork", "$EXAMPLE_KEY"),
        "Bearer [value-1]"
    );

    // A snapshot: its record and its files hold no value; a sandbox from it, created with
    // neither `secrets` nor `network`, gets the secret back by name.
    let snap = api
        .post(&format!("/v1/sandboxes/{id}/snapshots"), &json!({}))
        .expect(201, "snapshot");
    let snap_id = snap["id"].as_str().unwrap().to_owned();
    let listed = api.get("/v1/snapshots").expect(200, "snapshots");
    assert!(!listed.to_string().contains(&w.v1), "{listed}");
    let snap_dir = w.srv.data_dir.join("snapshots").join(&snap_id);
    let kept =
        std::fs::read_to_string(snap_dir.join("secrets.json")).expect("the snapshot's secrets");
    assert!(
        kept.contains("\"example\"") && !kept.contains(&w.v1),
        "{kept}"
    );
    let grep = Command::new("grep")
        .args(["-rlaF", &w.v1])
        .arg(&snap_dir)
        .output()
        .expect("grep");
    assert!(
        grep.stdout.is_empty(),
        "a value in the snapshot: {}",
        String::from_utf8_lossy(&grep.stdout)
    );
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete the source");
    let from = api.create_sandbox(&json!({"from_snapshot": snap_id}));
    let from_id = from["id"].as_str().unwrap().to_owned();
    assert_eq!(
        from["network"],
        json!({"egress": "allow", "allow": ["api.secret.test"]}),
        "{from}"
    );
    api.write_file(
        &from_id,
        "/root/test-ca.pem",
        &std::fs::read(w.pki.path("ca.pem")).unwrap(),
    )
    .expect(200, "the test CA");
    let (env, _) = sh(&api, &from_id, "printf %s \"$EXAMPLE_KEY\"");
    assert_eq!(env, placeholder, "the snapshot's placeholder comes back");
    assert_eq!(
        auth_seen(
            &api,
            &from_id,
            "https://api.secret.test/from-snapshot",
            "$(cat /root/key.txt)"
        ),
        "Bearer [value-1]",
        "the placeholder on the snapshot's disk works"
    );
    // A secret deleted since: the create says which.
    api.post(
        "/v1/secrets",
        &json!({"name": "gone", "value": "sk-gone", "hosts": ["other.test"], "env": "GONE_KEY"}),
    )
    .expect(201, "a second secret");
    let g = api.create_sandbox(&json!({"secrets": ["gone"]}));
    let g_id = g["id"].as_str().unwrap().to_owned();
    let g_snap = api
        .post(&format!("/v1/sandboxes/{g_id}/snapshots"), &json!({}))
        .expect(201, "snapshot");
    api.delete("/v1/secrets/gone")
        .expect(204, "delete the secret");
    let r = api
        .post(
            "/v1/sandboxes",
            &json!({"from_snapshot": g_snap["id"].clone()}),
        )
        .expect(404, "a snapshot's secret deleted since");
    assert!(
        r.to_string().contains("gone") && r.to_string().contains("does not exist"),
        "{r}"
    );

    // New hosts: the running sandboxes that hold the secret get them in their allowlists
    // (stored), and requests there get the value; a host dropped stays allowed but gets
    // only the placeholder.
    json_put(
        &api,
        "/v1/secrets/example",
        &json!({"hosts": ["api.secret.test", "api2.secret.test"]}),
    )
    .expect(200, "new hosts");
    for sb in [&child, &from_id] {
        let v = api.get(&format!("/v1/sandboxes/{sb}")).expect(200, "get");
        assert!(
            v["network"]["allow"]
                .as_array()
                .unwrap()
                .contains(&json!("api2.secret.test")),
            "{v}"
        );
        assert_eq!(
            auth_seen(
                &api,
                sb,
                "https://api2.secret.test/new-host",
                "$EXAMPLE_KEY"
            ),
            "Bearer [value-1]"
        );
    }
    json_put(
        &api,
        "/v1/secrets/example",
        &json!({"hosts": ["api2.secret.test"]}),
    )
    .expect(200, "a host dropped");
    assert_eq!(
        auth_seen(
            &api,
            &child,
            "https://api.secret.test/dropped",
            "$EXAMPLE_KEY"
        ),
        format!("Bearer {placeholder}"),
        "a host the secret no longer names gets the placeholder"
    );

    // An E2B-style create names secrets in metadata `locker.secrets`.
    let out = Command::new(locker_tests::locker_bin())
        .args(["key", "create", "--tenant", "default", "--e2b", "--json"])
        .env("LOCKER_URL", &w.srv.url)
        .env(
            "LOCKER_ADMIN_KEY",
            w.srv.admin_key.as_deref().expect("admin key"),
        )
        .output()
        .expect("run locker key create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key: Value = serde_json::from_slice(&out.stdout).unwrap();
    let key = key["api_key"].as_str().unwrap().to_owned();
    w.srv.remember_key(&key);
    let e2b = |body: Value| {
        Api::new(&w.srv.url, None).request(
            "POST",
            "/sandboxes",
            &[("Content-Type", "application/json"), ("X-API-KEY", &key)],
            body.to_string().into_bytes(),
        )
    };
    let r = e2b(json!({"templateID": "base", "metadata": {"locker.secrets": "example"}}));
    assert_eq!(r.status, 400, "secrets without an allowlist: {}", r.text());
    assert!(r.text().contains("egress `allow`"), "{}", r.text());
    let r = e2b(json!({
        "templateID": "base",
        "metadata": {"locker.secrets": "example"},
        "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["other.test"]},
    }));
    assert_eq!(r.status, 201, "{}", r.text());
    let e2b_id = serde_json::from_slice::<Value>(&r.body).unwrap()["sandboxID"]
        .as_str()
        .unwrap()
        .to_owned();
    api.write_file(
        &e2b_id,
        "/root/test-ca.pem",
        &std::fs::read(w.pki.path("ca.pem")).unwrap(),
    )
    .expect(200, "the test CA");
    assert_eq!(
        auth_seen(
            &api,
            &e2b_id,
            "https://api2.secret.test/e2b",
            "$EXAMPLE_KEY"
        ),
        "Bearer [value-1]"
    );
    let blog = w.b.log();
    assert!(!blog.contains(&w.v1), "the other host got a value: {blog}");
    nowhere_on_the_host(&w);
}
