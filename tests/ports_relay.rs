//! The port proxy's relayed path (the front's own HTTP/1.1, bodies moved by Locker between
//! the client's socket and the jail's in reads that grow to 4 MiB), through the real server
//! and a real jail:
//! a gigabyte both ways at once arrives whole and in order, a connection stays alive across
//! large downloads, large and chunked uploads and small answers, a client that stops
//! reading mid-body or cuts its upload costs the server nothing it keeps (its connection
//! slot into the machine comes back: more cuts than the per-sandbox limit, then a normal
//! request), and a stalled reader does not make the server grow. Each server cleans up.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use locker_tests::server::{enc, rss_kib, Api, Server};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const SRV: &str = include_str!("data/ports_srv.py");
const PORT: u16 = 8000;
const MIB: u64 = 1 << 20;

/// A sandbox running `data/ports_srv.py` on `PORT`, started with `&`.
fn serving(api: &Api) -> String {
    let id = api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    api.put(
        &format!("/v1/sandboxes/{id}/files?path={}", enc("/root/srv.py")),
        SRV.as_bytes(),
    )
    .expect(200, "upload the server");
    let r = api.exec(
        &id,
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
    id
}

fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandboxes/{id}/ports/{PORT}{rest}")
}

/// A kept-alive client connection to the server.
struct Client {
    w: TcpStream,
    r: BufReader<TcpStream>,
    host: String,
    key: String,
}

/// An answer's status and lowercased head lines.
struct Head {
    status: u16,
    lines: Vec<String>,
}

impl Head {
    fn get(&self, name: &str) -> Option<&str> {
        self.lines.iter().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k == name).then(|| v.trim())
        })
    }

    fn length(&self) -> u64 {
        self.get("content-length")
            .unwrap_or_else(|| panic!("no content-length in {:?}", self.lines))
            .parse()
            .unwrap()
    }
}

impl Client {
    fn to(s: &Server) -> Client {
        let w = TcpStream::connect(s.addr).unwrap();
        w.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        Client {
            r: BufReader::with_capacity(1 << 20, w.try_clone().unwrap()),
            w,
            host: s.addr.to_string(),
            key: s.api_key.clone(),
        }
    }

    fn send_head(&mut self, method: &str, target: &str, extra: &str) {
        write!(
            self.w,
            "{method} {target} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n{extra}\r\n",
            self.host, self.key
        )
        .unwrap();
    }

    fn head(&mut self) -> Head {
        let mut first = String::new();
        self.r.read_line(&mut first).unwrap();
        let status = first
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line: {first:?}"));
        let mut lines = Vec::new();
        loop {
            let mut l = String::new();
            self.r.read_line(&mut l).unwrap();
            let l = l.trim_end().to_ascii_lowercase();
            if l.is_empty() {
                break;
            }
            lines.push(l);
        }
        Head { status, lines }
    }

    /// Reads a `Content-Length` body: (bytes, sha256).
    fn body(&mut self, head: &Head) -> (u64, String) {
        let n = head.length();
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut left = n;
        while left > 0 {
            let k = self.r.read(&mut buf[..left.min(1 << 20) as usize]).unwrap();
            assert!(k > 0, "the body ended {left} bytes short of {n}");
            h.update(&buf[..k]);
            left -= k as u64;
        }
        (n, hex(&h.finalize()))
    }

    fn json(&mut self, head: &Head) -> Value {
        let mut b = vec![0u8; head.length() as usize];
        self.r.read_exact(&mut b).unwrap();
        serde_json::from_slice(&b).unwrap()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Fills `buf` from a xorshift generator: data whose order a checksum sees.
fn fill(state: &mut u64, buf: &mut [u8]) {
    for c in buf.chunks_mut(8) {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        c.copy_from_slice(&state.to_le_bytes()[..c.len()]);
    }
}

#[test]
fn a_gigabyte_goes_both_ways_at_once_through_the_relayed_path_whole_and_in_order() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api);
    let mut c = Client::to(&s);
    c.send_head("GET", &path(&id, "/echo"), "");
    let h = c.head();
    assert_eq!(h.status, 200);
    c.json(&h);
    let before = rss_kib(s.pid());

    let n = 1024 * MIB;
    c.send_head(
        "POST",
        &path(&id, "/echostream"),
        &format!("Content-Length: {n}\r\n"),
    );
    let mut w = c.w.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let (mut state, mut h) = (0x9e37_79b9_7f4a_7c15u64, Sha256::new());
        let mut buf = vec![0u8; MIB as usize];
        for _ in 0..n / MIB {
            fill(&mut state, &mut buf);
            h.update(&buf);
            w.write_all(&buf).unwrap();
        }
        hex(&h.finalize())
    });
    let h = c.head();
    assert_eq!(h.status, 200, "{:?}", h.lines);
    let (got, sum) = c.body(&h);
    let sent = writer.join().unwrap();
    assert_eq!(got, n);
    assert_eq!(sum, sent, "the echo differs from what was sent");
    let grew = rss_kib(s.pid()).saturating_sub(before);
    eprintln!("1 GiB each way; server RSS grew {grew} KiB");
    assert!(grew < 32 * 1024, "the server grew {grew} KiB");

    // The same connection goes on.
    c.send_head("GET", &path(&id, "/echo?after=gigabyte"), "");
    let h = c.head();
    assert_eq!(h.status, 200);
    assert_eq!(c.json(&h)["path"], "/echo?after=gigabyte");
}

#[test]
fn a_connection_stays_alive_across_large_downloads_uploads_and_small_answers() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api);
    let mut c = Client::to(&s);
    for round in 0..3 {
        // A large download, read to its exact end.
        c.send_head("GET", &path(&id, &format!("/big?n={}", 8 * MIB)), "");
        let h = c.head();
        assert_eq!(h.status, 200, "{:?}", h.lines);
        assert!(h.get("connection").is_none(), "{:?}", h.lines);
        let zeros = {
            let mut z = Sha256::new();
            z.update(vec![0u8; (8 * MIB) as usize]);
            hex(&z.finalize())
        };
        assert_eq!(c.body(&h), (8 * MIB, zeros), "round {round}");

        // A large upload with Content-Length.
        let mut up = vec![0u8; (4 * MIB) as usize];
        fill(&mut (round + 1), &mut up);
        c.send_head(
            "POST",
            &path(&id, "/upload"),
            &format!("Content-Length: {}\r\n", up.len()),
        );
        c.w.write_all(&up).unwrap();
        let h = c.head();
        assert_eq!(h.status, 200);
        let v = c.json(&h);
        assert_eq!(v["length"], up.len(), "{v}");
        assert_eq!(v["sha256"], hex(&Sha256::digest(&up)), "{v}");

        // A chunked upload: chunks passed on as they came, big ones moved past the scanner.
        c.send_head(
            "POST",
            &path(&id, "/upload"),
            "Transfer-Encoding: chunked\r\n",
        );
        let mut whole = Vec::new();
        for size in [1usize, 100 * 1024, 300 * 1024] {
            let piece = &up[..size];
            write!(c.w, "{size:x};x=y\r\n").unwrap();
            c.w.write_all(piece).unwrap();
            c.w.write_all(b"\r\n").unwrap();
            whole.extend_from_slice(piece);
        }
        c.w.write_all(b"0\r\nX-Trailer: 1\r\n\r\n").unwrap();
        let h = c.head();
        assert_eq!(h.status, 200);
        let v = c.json(&h);
        assert_eq!(v["length"], whole.len(), "{v}");
        assert_eq!(v["sha256"], hex(&Sha256::digest(&whole)), "{v}");

        // A small answer, with the body riding with the head.
        c.send_head("GET", &path(&id, &format!("/echo?round={round}")), "");
        let h = c.head();
        assert_eq!(h.status, 200);
        assert!(h.get("date").is_some(), "{:?}", h.lines);
        assert_eq!(c.json(&h)["path"], format!("/echo?round={round}"));

        // An error answered on the same connection (nothing listens on port 9).
        write!(
            c.w,
            "GET /v1/sandboxes/{id}/ports/9/ HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n\r\n",
            c.host, c.key
        )
        .unwrap();
        let h = c.head();
        assert_eq!(h.status, 502);
        let v = c.json(&h);
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("nothing listens on port 9"),
            "{v}"
        );
    }
}

#[test]
fn clients_that_stop_reading_or_cut_their_upload_leave_nothing_behind() {
    let s = Server::start();
    let api = s.api();
    let id = serving(&api);

    // A reader that stalls mid-gigabyte: the rest waits in the machine, not in the server.
    let before = rss_kib(s.pid());
    let mut c = Client::to(&s);
    c.send_head("GET", &path(&id, &format!("/big?n={}", 1024 * MIB)), "");
    let h = c.head();
    assert_eq!(h.status, 200);
    let mut buf = vec![0u8; MIB as usize];
    c.r.read_exact(&mut buf).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let grew = rss_kib(s.pid()).saturating_sub(before);
    eprintln!("a stalled reader: server RSS grew {grew} KiB");
    assert!(grew < 16 * 1024, "the server grew {grew} KiB");
    drop(c);

    // More readers that leave mid-body than the sandbox has connections (256): each gives
    // its connection into the machine back.
    let limit = 256;
    for i in 0..limit + 20 {
        let mut tries = 0;
        loop {
            let mut c = Client::to(&s);
            c.send_head("GET", &path(&id, &format!("/big?n={}", 64 * MIB)), "");
            let h = c.head();
            if h.status == 200 {
                let mut buf = vec![0u8; 256 * 1024];
                c.r.read_exact(&mut buf).unwrap();
                break;
            }
            // A slot still being given back by the one just before: not a leak, unless it
            // stays.
            assert_eq!(h.status, 429, "cut download {i}: {:?}", h.lines);
            tries += 1;
            assert!(tries < 50, "cut download {i}: slots are not given back");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    // Uploads cut by their client mid-body, large and small.
    for n in [64 * MIB, 32 * 1024] {
        let mut c = Client::to(&s);
        c.send_head(
            "POST",
            &path(&id, "/upload"),
            &format!("Content-Length: {n}\r\n"),
        );
        c.w.write_all(&vec![5u8; (n / 2) as usize]).unwrap();
        drop(c);
    }

    locker_tests::wait_for(Duration::from_secs(10), "the port after the cuts", || {
        let mut c = Client::to(&s);
        c.send_head("GET", &path(&id, "/echo"), "");
        let h = c.head();
        (h.status == 200).then(|| c.json(&h))
    });
    let grew = rss_kib(s.pid()).saturating_sub(before);
    eprintln!(
        "after {} cut downloads and 2 cut uploads: server RSS grew {grew} KiB",
        limit + 20
    );
    assert!(grew < 32 * 1024, "the server grew {grew} KiB");
}
