//! The port proxy under hostile machines and bad input, through the real server and real
//! jails (issue 17, "Bad input and hostile machines"): a port that accepts and never answers
//! is cut at the answer deadline (a slow upload is not), malformed and huge answer heads are
//! 502s, gigabytes stream through without the server growing (also to a client that stops
//! reading), a server that closes mid-body leaves the client a visibly cut answer, a flood of
//! connections meets a clear per-sandbox limit while the sandbox and its neighbours keep
//! working, bad ports and climbing paths sent by a client that does not normalise get 400s,
//! and no address leads from one sandbox to another's ports. Each server cleans up.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use locker_tests::egress::{gateway, host_address, lease, reach, wait_egress_ok};
use locker_tests::server::{enc, rss_kib, Api, Server};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const SRV: &str = include_str!("data/ports_srv.py");
const PORT: u16 = 8000;
const MIB: u64 = 1 << 20;

/// A sandbox running `data/ports_srv.py` on `PORT`, started with `&` (a job of its exec).
fn serving(api: &Api, body: &Value) -> String {
    let id = api.create_sandbox(body)["id"].as_str().unwrap().to_owned();
    start_server(api, &id);
    id
}

fn start_server(api: &Api, id: &str) {
    api.put(
        &format!("/v1/sandboxes/{id}/files?path={}", enc("/root/srv.py")),
        SRV.as_bytes(),
    )
    .expect(200, "upload the server");
    let r = api.exec(
        id,
        &json!({"shell": format!("python3 /root/srv.py {PORT} >/root/srv.log 2>&1 &")}),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    locker_tests::wait_for(Duration::from_secs(30), "the port to be listed", || {
        let ports = api
            .get(&format!("/v1/sandboxes/{id}/ports"))
            .expect(200, "list ports");
        ports["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["port"] == PORT)
            .then_some(())
    });
}

fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandboxes/{id}/ports/{PORT}{rest}")
}

/// An answer read off the wire: status, head, and the body bytes as they came (until the
/// server closed the connection).
struct Raw {
    status: u16,
    head: String,
    body: Vec<u8>,
}

/// Sends `req` as written (no client normalises its path) and reads until the server
/// closes the connection.
fn raw(addr: &str, req: &[u8]) -> Raw {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c.write_all(req).unwrap();
    let mut all = Vec::new();
    // A reset after the answer (a body the server did not read) still leaves the answer.
    let _ = c.read_to_end(&mut all);
    parse(&all)
}

fn parse(all: &[u8]) -> Raw {
    let end = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer head in {:?}", String::from_utf8_lossy(all)));
    let head = String::from_utf8_lossy(&all[..end]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head}"));
    Raw {
        status,
        head,
        body: all[end + 4..].to_vec(),
    }
}

fn get_raw(s: &Server, target: &str) -> Raw {
    raw(
        &s.addr.to_string(),
        format!(
            "GET {target} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
            s.addr, s.api_key
        )
        .as_bytes(),
    )
}

fn message_of(r: &Raw) -> String {
    let v: Value = serde_json::from_slice(&r.body).unwrap_or_else(|_| {
        panic!(
            "a JSON error: {} {:?}",
            r.head,
            String::from_utf8_lossy(&r.body)
        )
    });
    v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn a_port_that_never_answers_is_cut_at_the_deadline_but_a_slow_upload_is_not() {
    let s = Server::start_with_env(&[], &[("LOCKER_PORT_ANSWER_DEADLINE_MS", "1500")]);
    let api = s.api();
    let id = serving(&api, &json!({}));

    let t = Instant::now();
    let m =
        api.get(&path(&id, "/hang"))
            .expect_error(502, "bad_gateway", "a port that never answers");
    let took = t.elapsed();
    eprintln!("a silent port was cut after {took:?}");
    assert!(m.contains("sent no response within 1500 ms"), "{m}");
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(8),
        "cut after {took:?}"
    );
    // Slower than nothing, faster than the deadline: served.
    api.get(&path(&id, "/echo?ms=700"))
        .expect(200, "an answer within the deadline");

    // An upload that takes three deadlines, its server answering once it has it all: the
    // deadline counts from the request's last byte, so it is served.
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        c,
        "POST {} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        path(&id, "/upload"),
        s.addr,
        s.api_key
    )
    .unwrap();
    let piece = vec![7u8; 64 * 1024];
    for _ in 0..6 {
        write!(c, "{:x}\r\n", piece.len()).unwrap();
        c.write_all(&piece).unwrap();
        c.write_all(b"\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(800));
    }
    c.write_all(b"0\r\n\r\n").unwrap();
    let mut all = Vec::new();
    let _ = c.read_to_end(&mut all);
    let r = parse(&all);
    assert_eq!(
        r.status,
        200,
        "{} {:?}",
        r.head,
        String::from_utf8_lossy(&r.body)
    );
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["length"], 6 * 64 * 1024, "{v}");

    // A port that never reads the upload and never answers: cut all the same, though the
    // client is still sending.
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        c,
        "POST {} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        path(&id, "/hang"),
        s.addr,
        s.api_key,
        64 * MIB
    )
    .unwrap();
    let mut w = c.try_clone().unwrap();
    let t = Instant::now();
    let writer = std::thread::spawn(move || {
        let chunk = vec![1u8; MIB as usize];
        for _ in 0..64 {
            if w.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    let mut all = Vec::new();
    let _ = c.read_to_end(&mut all);
    let r = parse(&all);
    let took = t.elapsed();
    eprintln!("a port that never read the upload was cut, its connection closed, after {took:?}");
    assert_eq!(r.status, 502, "{}", r.head);
    // Cut is cut: the upload does not go on trickling into the machine behind the 502.
    assert!(
        took < Duration::from_secs(10),
        "the connection stayed open {took:?}"
    );
    assert!(
        message_of(&r).contains("no response within"),
        "{}",
        message_of(&r)
    );
    // Unblocks the writer however the server left the connection.
    let _ = c.shutdown(std::net::Shutdown::Both);
    let _ = writer.join();
    api.get(&path(&id, "/echo"))
        .expect(200, "the port after the cuts");
}

#[test]
fn malformed_and_huge_answer_heads_get_502_and_the_server_stays_small() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api, &json!({}));
    api.get(&path(&id, "/echo")).expect(200, "warm up");
    let before = rss_kib(s.pid());
    for (route, what) in [
        ("/garbage", "not HTTP"),
        ("/hugeheaders", "20,000 headers of 1 KB"),
        ("/hugeline", "one header of 10 MB"),
    ] {
        let m = api
            .get(&path(&id, route))
            .expect_error(502, "bad_gateway", what);
        eprintln!("{what}: {m}");
        assert!(
            m.contains("did not answer with valid HTTP/1"),
            "{what}: {m}"
        );
        assert!(m.contains(&format!("port {PORT} in sandbox {id}")), "{m}");
    }
    let grew = rss_kib(s.pid()).saturating_sub(before);
    eprintln!("server RSS grew {grew} KiB over the bad heads");
    assert!(grew < 32 * 1024, "the server grew {grew} KiB");
    api.get(&path(&id, "/echo"))
        .expect(200, "the port after bad heads");
}

/// Reads `body` to its end, sampling the server's RSS every 64 MiB: (bytes, seconds, the
/// largest RSS seen in KiB).
fn drain(mut body: impl Read, pid: u32) -> (u64, f64, u64) {
    let t = Instant::now();
    let mut buf = vec![0u8; 1 << 20];
    let (mut got, mut next, mut peak) = (0u64, 0u64, 0u64);
    loop {
        let n = body.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        got += n as u64;
        if got >= next {
            peak = peak.max(rss_kib(pid));
            next += 64 * MIB;
        }
    }
    (got, t.elapsed().as_secs_f64(), peak)
}

fn mb_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / 1e6 / secs
}

/// A body of `n` bytes made while it is sent (never held whole), hashed as it goes.
struct Pattern {
    left: u64,
    at: u64,
    hash: Sha256,
}

impl Read for Pattern {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (buf.len() as u64).min(self.left) as usize;
        for (i, b) in buf[..n].iter_mut().enumerate() {
            *b = ((self.at + i as u64) % 251) as u8;
        }
        self.hash.update(&buf[..n]);
        self.at += n as u64;
        self.left -= n as u64;
        Ok(n)
    }
}

#[test]
fn gigabytes_stream_through_the_proxy_without_the_server_growing() {
    let s = Server::start();
    let api = s.api().with_timeout(Duration::from_secs(600));
    let id = serving(&api, &json!({"memory_mb": 1024}));
    api.get(&path(&id, "/echo")).expect(200, "warm up");
    let pid = s.pid();
    let before = rss_kib(pid);

    // 2 GiB down, read as fast as the client can.
    let n = 2048 * MIB;
    let (status, _, body) = api
        .open("GET", &path(&id, &format!("/big?n={n}")), &[], ())
        .unwrap();
    assert_eq!(status, 200);
    let (got, secs, peak) = drain(body, pid);
    assert_eq!(got, n, "the whole 2 GiB");
    eprintln!(
        "jail download: {} MiB in {secs:.1} s = {:.0} MB/s; server RSS {before} KiB before, peak {peak} KiB",
        n / MIB,
        mb_s(n, secs)
    );
    assert!(
        peak.saturating_sub(before) < 64 * 1024,
        "the server grew from {before} to {peak} KiB during a download"
    );

    // A client that stops reading: the tunnel holds one window, not the answer.
    let (status, _, mut body) = api
        .open("GET", &path(&id, &format!("/big?n={n}")), &[], ())
        .unwrap();
    assert_eq!(status, 200);
    let mut first = vec![0u8; MIB as usize];
    body.read_exact(&mut first).unwrap();
    let at_stop = rss_kib(pid);
    std::thread::sleep(Duration::from_secs(4));
    let later = rss_kib(pid);
    eprintln!("a stalled download: server RSS {at_stop} KiB at the stop, {later} KiB 4 s later");
    assert!(
        later.saturating_sub(before) < 64 * 1024,
        "the server buffered for a client that stopped reading: {before} -> {later} KiB"
    );
    drop(body);

    // 256 MiB up, made while it is sent, checked by the machine's server.
    let mut up = Pattern {
        left: 256 * MIB,
        at: 0,
        hash: Sha256::new(),
    };
    let t = Instant::now();
    let r = api
        .request(
            "POST",
            &path(&id, "/upload"),
            &[],
            ureq::SendBody::from_reader(&mut up),
        )
        .expect(200, "a 256 MiB upload");
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(r["length"], 256 * MIB, "{r}");
    let want: String = up
        .hash
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(r["sha256"], want, "{r}");
    let after = rss_kib(pid);
    eprintln!(
        "jail upload: 256 MiB in {secs:.1} s = {:.0} MB/s; server RSS {after} KiB after",
        mb_s(256 * MIB, secs)
    );
    assert!(
        after.saturating_sub(before) < 64 * 1024,
        "the server grew from {before} to {after} KiB over an upload"
    );
    api.get(&path(&id, "/echo"))
        .expect(200, "the port after the big bodies");
}

#[test]
fn a_server_that_closes_mid_body_leaves_the_client_a_visibly_cut_answer() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api, &json!({}));

    // Announced 10 MiB, sent 1 MiB: the client gets the length and fewer bytes, then the
    // connection closes; it is never told the answer was whole.
    let r = get_raw(&s, &path(&id, &format!("/cut?n={}&at={}", 10 * MIB, MIB)));
    assert_eq!(r.status, 200, "{}", r.head);
    assert!(
        r.head
            .to_ascii_lowercase()
            .contains(&format!("content-length: {}", 10 * MIB)),
        "{}",
        r.head
    );
    assert!(
        (r.body.len() as u64) < 10 * MIB,
        "got {} bytes of a cut answer",
        r.body.len()
    );

    // Chunked and cut: no last chunk reaches the client.
    let r = get_raw(&s, &path(&id, "/cutchunked"));
    assert_eq!(r.status, 200, "{}", r.head);
    assert!(
        r.head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{}",
        r.head
    );
    assert!(
        !r.body.ends_with(b"0\r\n\r\n"),
        "a cut answer ended like a whole one ({} bytes)",
        r.body.len()
    );
    api.get(&path(&id, "/echo"))
        .expect(200, "the port after cut answers");
}

/// Opens a raw upgraded connection to the test server's `/raw`: the connection, or the
/// status and message of the refusal.
fn upgraded(s: &Server, id: &str) -> Result<TcpStream, (u16, String)> {
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        c,
        "GET {} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nConnection: Upgrade\r\nUpgrade: raw\r\n\r\n",
        path(id, "/raw"),
        s.addr,
        s.api_key
    )
    .unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match c.read(&mut b) {
            Ok(1) => head.push(b[0]),
            _ => break,
        }
    }
    let r = parse(&head);
    if r.status == 101 {
        return Ok(c);
    }
    let len = r
        .head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse::<usize>().unwrap())
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    c.read_exact(&mut body).unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Err((
        r.status,
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    ))
}

#[test]
fn a_flood_of_connections_meets_a_clear_limit_and_the_sandbox_and_its_neighbours_keep_working() {
    let s = Server::start();
    let api = s.api();
    let a = serving(&api, &json!({}));
    let b = serving(&api, &json!({}));
    let before = rss_kib(s.pid());

    let t = Instant::now();
    let mut open = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..520 {
        match upgraded(&s, &a) {
            Ok(c) => open.push(c),
            Err(e) => refused.push(e),
        }
    }
    eprintln!(
        "520 connections in {:?}: {} open, {} refused; first refusal: {:?}",
        t.elapsed(),
        open.len(),
        refused.len(),
        refused.first()
    );
    // The sandbox under the flood still starts processes, and a neighbour is served.
    let r = api.exec(
        &a,
        &json!({"shell": "for i in $(seq 200); do sleep 2 & done; wait; echo ok", "timeout_ms": 60000}),
    );
    assert_eq!(r["exit_code"], 0, "200 processes in a flooded sandbox: {r}");
    assert_eq!(open.len(), 256, "the limit per sandbox");
    for (status, m) in &refused {
        assert_eq!(*status, 429, "{m}");
        assert!(m.contains("256 connections to the machine's ports"), "{m}");
    }
    let t = Instant::now();
    api.get(&path(&b, "/echo"))
        .expect(200, "another sandbox's port under the flood");
    eprintln!("a neighbour's request under the flood: {:?}", t.elapsed());

    // Four fast senders on open connections, each pushing 64 MiB and reading its echo.
    let t = Instant::now();
    let senders: Vec<_> = open
        .iter()
        .take(4)
        .map(|c| {
            let mut w = c.try_clone().unwrap();
            let mut r = c.try_clone().unwrap();
            std::thread::spawn(move || {
                let writer = std::thread::spawn(move || {
                    let chunk = vec![5u8; 256 * 1024];
                    for _ in 0..256 {
                        w.write_all(&chunk).unwrap();
                    }
                });
                let mut buf = vec![0u8; 1 << 20];
                let mut got = 0u64;
                while got < 64 * MIB {
                    let n = r.read(&mut buf).unwrap();
                    assert!(n > 0, "the echo ended at {got}");
                    got += n as u64;
                }
                writer.join().unwrap();
                got
            })
        })
        .collect();
    let mut peak = 0;
    while senders.iter().any(|h| !h.is_finished()) {
        peak = peak.max(rss_kib(s.pid()));
        std::thread::sleep(Duration::from_millis(100));
    }
    for h in senders {
        assert_eq!(h.join().unwrap(), 64 * MIB);
    }
    eprintln!(
        "4 x 64 MiB echoed in {:?}; server RSS {before} KiB before the flood, peak {peak} KiB",
        t.elapsed()
    );
    assert!(
        peak.saturating_sub(before) < 128 * 1024,
        "the server grew from {before} to {peak} KiB under the flood"
    );

    // Closed, their places come back.
    drop(open);
    locker_tests::wait_for(Duration::from_secs(20), "the places to come back", || {
        (api.get(&path(&a, "/echo")).status == 200).then_some(())
    });
    let back: Vec<_> = (0..10).map(|_| upgraded(&s, &a)).collect();
    assert!(back.iter().all(|c| c.is_ok()), "after the flood");
}

#[test]
fn bad_ports_and_climbing_paths_from_a_raw_client_get_400_and_strangers_get_404() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api, &json!({}));

    for bad in ["0", "65536", "-1", "abc", "99999999999"] {
        let r = get_raw(&s, &format!("/v1/sandboxes/{id}/ports/{bad}/x"));
        assert_eq!(r.status, 400, "port {bad}: {}", r.head);
        assert!(message_of(&r).contains("1 to 65535"), "{}", message_of(&r));
    }
    for climb in [
        "/../../../v1/sandboxes",
        "/..",
        "/a/../../b",
        "/./x",
        "/%2e%2e/x",
        "/%2E%2e/%2e%2E/x",
        "/.%2e/x",
        "/a/..%2f..%2fb",
        "/a%2Fb",
        "/a%2fb",
        "/a%5cb",
        "/a%5C..%5Cb",
    ] {
        let r = get_raw(&s, &path(&id, climb));
        assert_eq!(r.status, 400, "{climb}: {}", r.head);
        let m = message_of(&r);
        assert!(
            m.contains("`.` or `..` segments") || m.contains("encoded slashes"),
            "{climb}: {m}"
        );
    }
    // A path that merely contains dots is not climbing.
    let r = get_raw(&s, &path(&id, "/a..b/.well-known/x.y"));
    assert_eq!(r.status, 200, "{}", r.head);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["path"], "/a..b/.well-known/x.y", "{v}");

    let m = api
        .get(&format!("/v1/sandboxes/{id}/ports/9/"))
        .expect_error(502, "bad_gateway", "a port nothing listens on");
    assert!(m.contains("nothing listens on port 9"), "{m}");

    let (other, _) = s.create_tenant("other");
    other
        .get(&path(&id, "/echo"))
        .expect_error(404, "not_found", "another tenant's sandbox");
    let r = raw(
        &s.addr.to_string(),
        format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            path(&id, "/echo"),
            s.addr
        )
        .as_bytes(),
    );
    assert_eq!(r.status, 401, "no key: {}", r.head);
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete");
    api.get(&path(&id, "/echo"))
        .expect_error(404, "not_found", "a deleted sandbox's port");
    api.get("/v1/sandboxes/sb_doesnotexist/ports/8000/")
        .expect_error(404, "not_found", "a sandbox that never was");
}

/// What an HTTP request for `target` to `addr:port` from inside sandbox `id` gets back
/// (nothing when no connection is made). The target sandbox's server would answer with a
/// `sha256`, Locker's API with `unauthorized` (the machine has no key).
fn http_probe(api: &Api, id: &str, addr: &str, port: u16, target: &str) -> String {
    let r = api.exec(
        id,
        &json!({"shell": format!(
            "timeout 4 bash -c 'exec 3<>/dev/tcp/{addr}/{port} && \
             printf \"GET {target} HTTP/1.0\\r\\nHost: {addr}\\r\\n\\r\\n\" >&3 && \
             timeout 2 cat <&3' 2>&1; true"
        )}),
    );
    r["stdout"].as_str().unwrap_or_default().to_owned()
}

/// The machine's network as it sees it: links, addresses, routes.
fn network_of(api: &Api, id: &str) -> String {
    api.sh(
        id,
        "ls /sys/class/net; cat /proc/net/route /proc/net/ipv6_route /proc/net/if_inet6 2>/dev/null; \
         grep -A1 -E '^ *\\|--' /proc/net/fib_trie 2>/dev/null | sort -u",
    )
}

#[test]
fn no_address_leads_from_one_sandbox_to_another_sandboxs_port() {
    let s = Server::start();
    wait_egress_ok(&s);
    let api = s.api();
    let locker_port = s.addr.port();
    let host = host_address();

    // The target: a sandbox with egress `all` (a link and an address), serving on 0.0.0.0.
    let b = serving(&api, &json!({"network": {"egress": "all"}}));
    let (_, _, bip) = lease(&s, &b).expect("egress all: a lease");
    let bgw = gateway(&bip);
    // The probe sees the target's server where it is reachable: from the target itself.
    let own = http_probe(&api, &b, "127.0.0.1", PORT, &path(&b, "/echo"));
    assert!(own.contains("sha256"), "the probe reaches a server: {own}");

    for net in [
        json!({"egress": "none"}),
        json!({"egress": "all"}),
        json!({"egress": "allow", "allow": ["example.test"]}),
    ] {
        let a = api.create_sandbox(&json!({ "network": net }))["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let mut targets = vec![
            ("127.0.0.1".to_owned(), PORT, "its own loopback"),
            (bip.clone(), PORT, "the other sandbox's address"),
            (bgw.clone(), PORT, "the other sandbox's gateway"),
            (host.clone(), PORT, "the host's uplink"),
            (host.clone(), locker_port, "Locker's API port on the uplink"),
        ];
        if let Some((_, _, aip)) = lease(&s, &a) {
            let agw = gateway(&aip);
            targets.push((agw.clone(), PORT, "its own gateway"));
            targets.push((agw, locker_port, "Locker's API port on its gateway"));
        }
        for (addr, port, what) in &targets {
            // With `allow` every TCP connection lands on Locker's egress proxy, which then
            // refuses an address; with `none` and `all` not even the connection is made.
            if net["egress"] != "allow" {
                assert_eq!(
                    reach(&api, &a, addr, *port),
                    "FAILED",
                    "egress {net}: {what} ({addr}:{port})"
                );
            }
            let got = http_probe(&api, &a, addr, *port, &path(&b, "/echo"));
            eprintln!(
                "egress {net}: {what} ({addr}:{port}): {:?}",
                got.lines().next()
            );
            assert!(
                !got.contains("sha256") && !got.contains("unauthorized"),
                "egress {net}: {what} ({addr}:{port}) answered: {got}"
            );
        }

        // The way in adds no way out: the machine's links, addresses and routes are the
        // same before and after a request through the proxy.
        start_server(&api, &a);
        let seen = network_of(&api, &a);
        api.get(&path(&a, "/echo"))
            .expect(200, "a request through the proxy");
        assert_eq!(
            network_of(&api, &a),
            seen,
            "egress {net}: the network changed"
        );
        if net["egress"] == "none" {
            assert_eq!(
                api.sh(&a, "ls /sys/class/net | tr '\\n' ' '").trim(),
                "lo",
                "egress none: loopback only"
            );
        }
        api.delete(&format!("/v1/sandboxes/{a}"))
            .expect(204, "delete");
    }
    // The target was reachable all along, through the proxy only.
    api.get(&path(&b, "/echo"))
        .expect(200, "the target through the proxy");
}
