//! End-to-end tests of a sandbox's files through the API: bytes and odd names round trip,
//! list, stat, mkdir, move and delete, bad paths refused with the error shape, no path
//! reaching the host's files, and a 1 GiB file streaming in constant server memory.
//!
//! The tests share one `locker serve` (see `locker_tests::shared`); those that touch only
//! paths under a directory of their own share one sandbox, the others (symlinks in /root,
//! deleting /) have their own; the 1 GiB stream measures the server's memory and starts a
//! server of its own.
//! Run as root after `scripts/setup build`: `cargo test --release -p locker-tests --test server -- files::`.

use std::io::Read;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use locker_tests::answers::{entry_names, now_s, parse_time, refused, sandbox_id};
use locker_tests::server::{enc, rss_kib, Api, Server};
use locker_tests::shared::{Borrowed, SharedSandbox, Tenant};
use locker_tests::streams::{pattern_fill, Pattern};
use locker_tests::TempDir;
use serde_json::json;

/// A tenant with one sandbox: the tenant, its client, the sandbox id.
fn sandbox_of_its_own() -> (Tenant, Api, String) {
    let t = Tenant::new();
    let sb = t.sandbox(&json!({}));
    let api = t.api();
    (t, api, sb)
}

static SHARED: OnceLock<SharedSandbox> = OnceLock::new();

/// The sandbox the tests share that touch only paths under a directory of their own:
/// the borrow, its tenant's client, the sandbox id.
fn shared_sandbox() -> (Borrowed, Api, String) {
    let b = SharedSandbox::borrow(&SHARED, &json!({}));
    let (api, sb) = (b.api.clone(), b.id.clone());
    (b, api, sb)
}

/// The route `files{route}?path=…` of sandbox `sb`.
fn f(sb: &str, route: &str, path: &str) -> String {
    format!("/v1/sandboxes/{sb}/files{route}?path={}", enc(path))
}

/// A file name with spaces, non-ASCII and URL characters.
const ODD_NAME: &str = "ünï cödé ☃ #1 ?&=+%.bin";

/// [`ODD_NAME`] in a directory with a space, under `root`.
fn odd(root: &str) -> String {
    format!("{root}/odd dir/{ODD_NAME}")
}

/// The tree `{root}/tree`: `a/b/c` made by mkdir, a file at each depth (holding its own
/// path), and a symlink `link`. Returns `{root}/tree`.
fn make_tree(api: &Api, sb: &str, root: &str) -> String {
    let tree = format!("{root}/tree");
    let d = api
        .post(
            &format!("/v1/sandboxes/{sb}/files/mkdir"),
            &json!({"path": format!("{tree}/a/b/c")}),
        )
        .expect(200, "mkdir");
    assert_eq!(
        (&d["path"], &d["type"]),
        (&json!(format!("{tree}/a/b/c")), &json!("dir")),
        "{d}"
    );
    for p in ["top.txt", "a/one.txt", "a/b/two.txt", "a/b/c/three.txt"] {
        let p = format!("{tree}/{p}");
        api.put(&f(sb, "", &p), p.as_bytes().to_vec())
            .expect(200, &p);
    }
    api.sh(sb, &format!("ln -s top.txt {tree}/link"));
    tree
}

/// The paths `names` under `dir`.
fn under(dir: &str, names: &[&str]) -> Vec<String> {
    names.iter().map(|n| format!("{dir}/{n}")).collect()
}

/// Writes the empty file `{root}/empty` and returns its path.
fn make_empty(api: &Api, sb: &str, root: &str) -> String {
    let p = format!("{root}/empty");
    assert_eq!(
        api.put(&f(sb, "", &p), Vec::new()).expect(200, "empty")["size"],
        0
    );
    p
}

#[test]
fn binary_content_under_an_odd_name_round_trips_with_its_mode() {
    let (_b, api, sb) = shared_sandbox();
    let odd = odd("/tmp/round-trip");
    let data: Vec<u8> = (0..4096u32)
        .map(|i| (i % 256) as u8)
        .chain(b"\r\n\0end".iter().copied())
        .collect();
    let e = api
        .put(&format!("{}&mode=0640", f(&sb, "", &odd)), data.clone())
        .expect(200, "PUT an odd name");
    assert_eq!(e["path"], odd.as_str(), "{e}");
    assert_eq!(e["name"], "ünï cödé ☃ #1 ?&=+%.bin");
    assert_eq!(
        (&e["type"], &e["size"], &e["mode"]),
        (&json!("file"), &json!(data.len()), &json!(0o640)),
        "{e}"
    );
    parse_time(e["mtime"].as_str().expect("mtime"));
    let got = api.get(&f(&sb, "", &odd));
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(
        got.headers
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/octet-stream")
    );
    assert!(
        got.body == data,
        "the bytes come back unchanged ({} vs {} bytes)",
        got.body.len(),
        data.len()
    );
    assert_eq!(
        api.get(&f(&sb, "/stat", &odd)).expect(200, "stat"),
        e,
        "stat shows the PUT's entry"
    );
    assert_eq!(
        api.get(&f(&sb, "/stat", "/tmp/round-trip/odd dir"))
            .expect(200, "stat a dir")["type"],
        "dir"
    );
}

#[test]
fn overwriting_truncates_and_an_empty_file_is_a_file() {
    let (_b, api, sb) = shared_sandbox();
    let odd = odd("/tmp/overwrite");
    api.put(&f(&sb, "", &odd), vec![7u8; 4096])
        .expect(200, "write");
    api.put(&f(&sb, "", &odd), b"short".to_vec())
        .expect(200, "overwrite");
    assert_eq!(api.get(&f(&sb, "", &odd)).body, b"short");
    let empty = make_empty(&api, &sb, "/tmp/overwrite");
    assert_eq!(api.get(&f(&sb, "", &empty)).body, b"");
}

#[test]
fn exec_sees_what_the_api_wrote_and_the_other_way_round() {
    let (_b, api, sb) = shared_sandbox();
    api.put(&f(&sb, "", &odd("/tmp/both-ways")), b"short".to_vec())
        .expect(200, "write");
    assert_eq!(
        api.sh(&sb, "cat '/tmp/both-ways/odd dir/ünï cödé ☃ #1 ?&=+%.bin'"),
        "short"
    );
    api.sh(&sb, "printf 'from exec' > /root/made-by-exec");
    assert_eq!(
        api.get(&f(&sb, "", "/root/made-by-exec")).body,
        b"from exec"
    );
}

#[test]
fn mkdir_makes_parents_and_list_goes_to_the_asked_depth() {
    let (_b, api, sb) = shared_sandbox();
    let tree = make_tree(&api, &sb, "/tmp/list");
    let l1 = api.get(&f(&sb, "/list", &tree)).expect(200, "list");
    assert_eq!(
        entry_names(&l1),
        under(&tree, &["a", "link", "top.txt"]),
        "depth 1 is the default"
    );
    let kinds: Vec<(String, String)> = l1["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().expect("name").into(),
                e["type"].as_str().expect("type").into(),
            )
        })
        .collect();
    assert!(
        kinds.contains(&("a".into(), "dir".into()))
            && kinds.contains(&("link".into(), "symlink".into()))
            && kinds.contains(&("top.txt".into(), "file".into())),
        "{kinds:?}"
    );
    let l2 = api
        .get(&format!("{}&depth=2", f(&sb, "/list", &tree)))
        .expect(200, "list depth 2");
    assert_eq!(
        entry_names(&l2),
        under(&tree, &["a", "a/b", "a/one.txt", "link", "top.txt"])
    );
    let l3 = api
        .get(&format!("{}&depth=3", f(&sb, "/list", &tree)))
        .expect(200, "list depth 3");
    assert_eq!(
        entry_names(&l3),
        under(
            &tree,
            &[
                "a",
                "a/b",
                "a/b/c",
                "a/b/two.txt",
                "a/one.txt",
                "link",
                "top.txt"
            ]
        )
    );
}

#[test]
fn a_bad_list_depth_is_a_400() {
    let (_b, api, sb) = shared_sandbox();
    let tree = make_tree(&api, &sb, "/tmp/bad-depth");
    for depth in ["0", "17", "-1", "deep"] {
        refused(
            &api.get(&format!("{}&depth={depth}", f(&sb, "/list", &tree))),
            400,
            "bad_request",
            "depth",
            &format!("depth={depth}"),
        );
    }
}

#[test]
fn move_renames_a_file_and_a_missing_source_is_a_404() {
    let (_b, api, sb) = shared_sandbox();
    let tree = make_tree(&api, &sb, "/tmp/move");
    let (top, moved) = (format!("{tree}/top.txt"), format!("{tree}/a/moved.txt"));
    let m = api
        .post(
            &format!("/v1/sandboxes/{sb}/files/move"),
            &json!({"from": &top, "to": &moved}),
        )
        .expect(200, "move");
    assert_eq!(
        (&m["path"], &m["type"]),
        (&json!(&moved), &json!("file")),
        "{m}"
    );
    api.get(&f(&sb, "", &top))
        .expect_error(404, "not_found", "the old name after a move");
    assert_eq!(api.get(&f(&sb, "", &moved)).body, top.as_bytes());
    api.post(
        &format!("/v1/sandboxes/{sb}/files/move"),
        &json!({"from": "/tmp/move/nothing", "to": "/tmp/move/x"}),
    )
    .expect_error(404, "not_found", "moving a missing file");
}

#[test]
fn delete_removes_a_file_and_a_directory_only_when_recursive() {
    let (_b, api, sb) = shared_sandbox();
    let tree = make_tree(&api, &sb, "/tmp/delete");
    let one = format!("{tree}/a/one.txt");
    assert_eq!(api.delete(&f(&sb, "", &one)).status, 204);
    api.get(&f(&sb, "/stat", &one))
        .expect_error(404, "not_found", "a deleted file");
    let r = api.delete(&f(&sb, "", &tree));
    assert!(
        (400..500).contains(&r.status),
        "a non-empty directory without recursive=true is refused: {} {}",
        r.status,
        r.text()
    );
    r.expect_error(
        r.status,
        if r.status == 409 {
            "conflict"
        } else {
            "bad_request"
        },
        "delete a non-empty dir",
    );
    assert_eq!(
        api.get(&f(&sb, "/stat", &format!("{tree}/a/b/c/three.txt")))
            .status,
        200,
        "a refused delete removes nothing"
    );
    assert_eq!(
        api.delete(&format!("{}&recursive=true", f(&sb, "", &tree)))
            .status,
        204,
        "recursive delete"
    );
    api.get(&f(&sb, "/stat", &tree))
        .expect_error(404, "not_found", "a recursively deleted dir");
    api.delete(&f(&sb, "", &tree))
        .expect_error(404, "not_found", "deleting a missing path");
}

#[test]
fn deleting_the_root_is_refused_and_leaves_it_intact() {
    let (_t, api, sb) = sandbox_of_its_own();
    refused(
        &api.delete(&f(&sb, "", "/")),
        400,
        "bad_request",
        "/",
        "deleting /",
    );
    assert_eq!(
        api.sh(&sb, "ls / | wc -l")
            .trim()
            .parse::<u32>()
            .map(|n| n > 5),
        Ok(true),
        "/ is intact"
    );
}

#[test]
fn a_missing_path_is_a_404_and_a_directory_is_not_a_file() {
    let (_b, api, sb) = shared_sandbox();
    api.get(&f(&sb, "", "/tmp/missing"))
        .expect_error(404, "not_found", "GET a missing file");
    api.get(&f(&sb, "/stat", "/tmp/missing"))
        .expect_error(404, "not_found", "stat a missing file");
    api.get(&f(&sb, "/list", "/tmp/missing"))
        .expect_error(404, "not_found", "list a missing dir");
    api.get(&f(&sb, "", "/tmp"))
        .expect_error(400, "bad_request", "GET a directory");
}

#[test]
fn relative_empty_and_nul_paths_are_a_400_naming_the_path() {
    let (_b, api, sb) = shared_sandbox();
    for (what, q) in [
        ("relative", "tmp/x"),
        ("relative dots", "../etc/passwd"),
        ("empty", ""),
    ] {
        let at = |route: &str| f(&sb, route, q);
        refused(
            &api.get(&at("")),
            400,
            "bad_request",
            "path",
            &format!("GET a {what} path"),
        );
        refused(
            &api.put(&at(""), b"x".to_vec()),
            400,
            "bad_request",
            "path",
            &format!("PUT a {what} path"),
        );
        refused(
            &api.get(&at("/stat")),
            400,
            "bad_request",
            "path",
            &format!("stat a {what} path"),
        );
        refused(
            &api.delete(&at("")),
            400,
            "bad_request",
            "path",
            &format!("delete a {what} path"),
        );
    }
    refused(
        &api.get(&format!("/v1/sandboxes/{sb}/files?path=/tmp/a%00b")),
        400,
        "bad_request",
        "NUL",
        "a NUL in a path",
    );
    refused(
        &api.put(
            &format!("/v1/sandboxes/{sb}/files?path=/tmp/a%00b"),
            b"x".to_vec(),
        ),
        400,
        "bad_request",
        "NUL",
        "a NUL in a PUT path",
    );
    refused(
        &api.get(&format!("/v1/sandboxes/{sb}/files")),
        400,
        "bad_request",
        "path",
        "no path",
    );
}

#[test]
fn an_unknown_parameter_or_a_non_octal_mode_is_a_400() {
    let (_b, api, sb) = shared_sandbox();
    let empty = make_empty(&api, &sb, "/tmp/params");
    refused(
        &api.get(&format!("{}&colour=red", f(&sb, "", &empty))),
        400,
        "bad_request",
        "colour",
        "an unknown parameter",
    );
    refused(
        &api.put(
            &format!("{}&mode=rwx", f(&sb, "", "/tmp/params/m")),
            b"x".to_vec(),
        ),
        400,
        "bad_request",
        "mode",
        "a non-octal mode",
    );
}

#[test]
fn mkdir_and_move_refuse_relative_paths_and_unknown_fields() {
    let (_b, api, sb) = shared_sandbox();
    let empty = make_empty(&api, &sb, "/tmp/refusals");
    let mkdir = format!("/v1/sandboxes/{sb}/files/mkdir");
    let mv = format!("/v1/sandboxes/{sb}/files/move");
    for (path, body, needle, what) in [
        (
            &mkdir,
            json!({"path": "rel"}),
            "path",
            "mkdir a relative path",
        ),
        (
            &mkdir,
            json!({"path": "/tmp/refusals/x", "parents": true}),
            "parents",
            "mkdir: an unknown field",
        ),
        (
            &mv,
            json!({"from": &empty, "to": "rel"}),
            "to",
            "move to a relative path",
        ),
        (
            &mv,
            json!({"from": "rel", "to": "/tmp/refusals/x"}),
            "from",
            "move from a relative path",
        ),
        (&mv, json!({"from": &empty}), "to", "move without `to`"),
    ] {
        refused(&api.post(path, &body), 400, "bad_request", needle, what);
    }
}

#[test]
fn a_file_as_a_parent_directory_is_refused() {
    let (_b, api, sb) = shared_sandbox();
    let empty = make_empty(&api, &sb, "/tmp/parent");
    let r = api.put(&f(&sb, "", &format!("{empty}/child")), b"x".to_vec());
    assert!(
        (400..500).contains(&r.status),
        "a file as a parent directory is refused: {} {}",
        r.status,
        r.text()
    );
}

/// A secret file in a host directory that does not exist inside the sandbox, and symlinks
/// in the sandbox's `/root` that point at it every way a path can: the host dir, the
/// secret's path, and the secret itself.
fn host_secret_and_links(api: &Api, sb: &str) -> (TempDir, String, String) {
    let host = TempDir::new("locker-host-secret");
    let hdir = host.path().display().to_string();
    let secret_path = format!("{hdir}/secret.txt");
    let token = format!("host-secret-{}", now_s());
    std::fs::write(&secret_path, &token).expect("write the host secret");
    api.sh(
        sb,
        &format!(
            "cd /root && ln -s {secret_path} abs && ln -s ../../../../../../../..{secret_path} rel && ln -s /root/abs chain && \
             ln -s / rootlink && ln -s {hdir} dirlink && ln -s /proc/1/root procroot && ln -s {hdir}/written.txt wlink && \
             ln -s ../../../../../../../..{hdir} reldir"
        ),
    );
    (host, secret_path, token)
}

#[test]
fn no_file_path_reads_a_host_file() {
    let (_t, api, sb) = sandbox_of_its_own();
    let (_host, secret_path, token) = host_secret_and_links(&api, &sb);
    let reads = [
        secret_path.clone(),
        format!("/../../../../../..{secret_path}"),
        format!("/tmp/../../..{secret_path}"),
        "/root/abs".into(),
        "/root/rel".into(),
        "/root/chain".into(),
        format!("/root/rootlink{secret_path}"),
        "/root/dirlink/secret.txt".into(),
        "/root/reldir/secret.txt".into(),
        format!("/root/procroot{secret_path}"),
        format!("/proc/self/root{secret_path}"),
        format!("/proc/1/root{secret_path}"),
        format!("/proc/1/cwd/../../../..{secret_path}"),
    ];
    for p in &reads {
        for route in ["", "/stat", "/list"] {
            let r = api.get(&f(&sb, route, p));
            // A symlink's own entry names its target (`"target": ".../secret.txt"`): that
            // is the sandbox's text; an entry *of* the host's file would be named after it.
            assert!(
                !r.text().contains(&token) && !r.text().contains("\"name\":\"secret.txt\""),
                "GET files{route} {p} showed the host's file: {}",
                r.text()
            );
            if route.is_empty() {
                assert!(
                    matches!(r.status, 400 | 404),
                    "GET {p}: 400 or 404, never the host's file: {} {}",
                    r.status,
                    r.text()
                );
            }
        }
    }
}

#[test]
fn no_file_route_writes_moves_or_deletes_on_the_host() {
    let (_t, api, sb) = sandbox_of_its_own();
    let (host, secret_path, token) = host_secret_and_links(&api, &sb);
    let hdir = host.path().display().to_string();
    let hostile = |p: &str| f(&sb, "", p);
    let writes = [
        format!("{hdir}/written.txt"),
        format!("/../../../../..{hdir}/written.txt"),
        "/root/wlink".into(),
        format!("/root/rootlink{hdir}/written.txt"),
        "/root/dirlink/written.txt".into(),
        "/root/reldir/written.txt".into(),
    ];
    for p in &writes {
        let _ = api.put(&hostile(p), b"pwned".to_vec());
    }
    let mkdir = format!("/v1/sandboxes/{sb}/files/mkdir");
    let mv = format!("/v1/sandboxes/{sb}/files/move");
    let _ = api.post(&mkdir, &json!({"path": "/root/dirlink/made"}));
    let _ = api.post(
        &mkdir,
        &json!({"path": format!("/root/rootlink{hdir}/made2")}),
    );
    api.put(&hostile("/tmp/mover"), b"pwned".to_vec())
        .expect(200, "a file to move");
    let _ = api.post(
        &mv,
        &json!({"from": "/tmp/mover", "to": "/root/dirlink/moved"}),
    );
    let _ = api.post(
        &mv,
        &json!({"from": "/root/dirlink/secret.txt", "to": "/tmp/stolen"}),
    );
    let _ = api.delete(&hostile("/root/dirlink/secret.txt"));
    let _ = api.delete(&format!(
        "{}&recursive=true",
        hostile(&format!("/root/rootlink{hdir}"))
    ));
    let _ = api.delete(&format!("{}&recursive=true", hostile("/root/reldir")));

    let mut on_host: Vec<String> = std::fs::read_dir(host.path())
        .expect("the host dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    on_host.sort();
    assert_eq!(
        on_host,
        ["secret.txt"],
        "the sandbox's file API wrote into the host's directory"
    );
    assert_eq!(
        std::fs::read_to_string(&secret_path).expect("the host secret"),
        token,
        "the host secret is unchanged"
    );
    let stolen = api.get(&hostile("/tmp/stolen"));
    assert!(
        !stolen.text().contains(&token),
        "the host secret was moved into the sandbox"
    );
}

#[test]
fn a_one_gib_file_streams_through_the_server_in_constant_memory() {
    const SIZE: u64 = 1 << 30;
    // A server of its own: its memory is measured.
    let srv = Server::start();
    let api = srv.api();
    let sb = sandbox_id(&api.create_sandbox(&json!({"disk_mb": 3000})));
    // Warm the server's paths up with a small round trip, then measure.
    api.write_file(&sb, "/root/small", &[7u8; 1 << 20])
        .expect(200, "a small file");
    assert_eq!(api.read_file(&sb, "/root/small").body.len(), 1 << 20);
    let pid = srv.pid();
    let base = rss_kib(pid);
    assert!(base > 0, "the server's VmRSS is readable");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_kib(pid));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        })
    };

    let t0 = Instant::now();
    let body = ureq::SendBody::from_owned_reader(Pattern { pos: 0, len: SIZE });
    let e = api
        .put(
            &format!("/v1/sandboxes/{sb}/files?path=/root/big.bin"),
            body,
        )
        .expect(200, "PUT 1 GiB");
    assert_eq!(e["size"], SIZE, "{e}");
    let put_s = t0.elapsed();

    let t1 = Instant::now();
    let (status, headers, mut r) = api
        .open(
            "GET",
            &format!("/v1/sandboxes/{sb}/files?path=/root/big.bin"),
            &[],
            (),
        )
        .expect("GET 1 GiB");
    assert_eq!(status, 200);
    assert_eq!(
        headers.get("x-locker-size").and_then(|v| v.to_str().ok()),
        Some(SIZE.to_string().as_str())
    );
    let (mut got, mut buf, mut want) = (0u64, vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = r.read(&mut buf).expect("read the body");
        if n == 0 {
            break;
        }
        pattern_fill(got, &mut want[..n]);
        assert!(
            buf[..n] == want[..n],
            "the bytes at offset {got}..{} differ from what was written",
            got + n as u64
        );
        got += n as u64;
    }
    assert_eq!(got, SIZE, "the whole file came back");
    let get_s = t1.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.join().expect("sampler").max(rss_kib(pid));
    let growth_mib = peak.saturating_sub(base) / 1024;
    eprintln!(
        "1 GiB: PUT {put_s:?}, GET {get_s:?}; server VmRSS {} MiB -> peak {} MiB",
        base / 1024,
        peak / 1024
    );
    assert!(
        growth_mib < 100,
        "the server's memory grew by {growth_mib} MiB while streaming 1 GiB (limit 100 MiB)"
    );
    assert_eq!(
        api.delete(&format!("/v1/sandboxes/{sb}/files?path=/root/big.bin"))
            .status,
        204
    );
}
