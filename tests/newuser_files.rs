//! Directories through the files API (`shared/reports/newuser-2.md`, step 27, friction 5,
//! missing 8, bug 9): a directory goes up and comes back as a tar archive streamed through
//! the files route (`Accept`/`Content-Type: application/x-tar` or `?format=tar`), with
//! `locker files put -r` / `get -r` (and the same under `locker volume files`), for a
//! sandbox and a volume. Hostile archives are refused with the entry named, and nothing
//! they hold lands outside the target directory; a 300 MB tree streams both ways while the
//! server's memory stays small. Each test drives the real `locker` binary against a real
//! server, and raw HTTP for the archives no honest client makes.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use locker_tests::server::{rss_kib, Api, Server};
use locker_tests::TempDir;
use serde_json::{json, Value};

fn sandbox(api: &Api) -> String {
    api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn volume(api: &Api, name: &str, size_mb: u64) -> String {
    let v = api
        .post("/v1/volumes", &json!({"name": name, "size_mb": size_mb}))
        .expect(201, "create a volume");
    v["id"].as_str().unwrap().to_owned()
}

/// `locker ARGS…`, through a shell that waits for it: a `locker` that exits at once
/// would otherwise be a zombie the tests' orphan reaper may take before it is registered.
fn locker_cmd(args: &[&str]) -> Command {
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg("\"$0\" \"$@\"")
        .arg(locker_tests::locker_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// `locker ARGS…` against `s`.
fn locker(s: &Server, args: &[&str]) -> Command {
    let mut c = locker_cmd(args);
    c.env("LOCKER_URL", &s.url)
        .env("LOCKER_API_KEY", &s.api_key);
    c
}

/// Waits for a child's output (registered, as every test here does).
fn output_of(mut c: Command) -> std::process::Output {
    let child = c.spawn().unwrap();
    locker_tests::register_child(child.id());
    child.wait_with_output().unwrap()
}

#[track_caller]
fn ok(out: &std::process::Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(data);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Deterministic bytes that do not compress (xorshift), `n` of them.
fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

fn set_mtime(p: &Path, secs: u64) {
    let t = std::time::UNIX_EPOCH + Duration::from_secs(secs);
    fs::File::open(p)
        .unwrap()
        .set_times(fs::FileTimes::new().set_modified(t))
        .unwrap();
}

/// A tree with binary files (one with a name past 100 bytes), an empty directory, a nested
/// directory of another mode, an executable, relative and dangling absolute symlinks.
fn sample_tree(root: &Path) {
    let w = |rel: &str, data: &[u8], mode: u32| {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, data).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        set_mtime(&p, 1_600_000_000 + data.len() as u64);
    };
    w("bin/blob.bin", &noise(1, 3 << 20), 0o644);
    w("bin/zeros.bin", &vec![0u8; 70_000], 0o600);
    w(
        "bin/tool.sh",
        b"#!/bin/sh\necho \xff\xfe binary-ish\n",
        0o755,
    );
    w("a/b/c/deep.txt", b"deep\n", 0o640);
    w(&format!("long/{}", "n".repeat(150)), &noise(2, 5000), 0o644);
    w("empty-file", b"", 0o644);
    fs::create_dir_all(root.join("empty-dir")).unwrap();
    fs::set_permissions(root.join("a/b"), fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink("bin/blob.bin", root.join("link-rel")).unwrap();
    std::os::unix::fs::symlink("/nonexistent/elsewhere", root.join("link-abs")).unwrap();
    std::os::unix::fs::symlink("../bin", root.join("a/up")).unwrap();
}

/// What a tree holds: per relative path, its type, mode and content hash (files, with
/// mtime), target (symlinks).
fn manifest(root: &Path) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let md = fs::symlink_metadata(&p).unwrap();
            let mode = md.mode() & 0o7777;
            let v = if md.file_type().is_symlink() {
                format!("link -> {}", fs::read_link(&p).unwrap().display())
            } else if md.is_dir() {
                stack.push(p.clone());
                format!("dir {mode:o}")
            } else {
                format!(
                    "file {mode:o} {} mtime {}",
                    sha256_hex(&fs::read(&p).unwrap()),
                    md.mtime()
                )
            };
            m.insert(rel, v);
        }
    }
    m
}

/// Sends `sample_tree` up with `put -r` and back with `get -r` through `prefix` (`files`
/// or `volume files`) to `target`; the tree comes back identical.
fn round_trip(s: &Server, prefix: &[&str], target: &str, remote: &str) -> Value {
    let local = TempDir::new("tar-up");
    let src = local.path().join("src");
    fs::create_dir(&src).unwrap();
    sample_tree(&src);
    let mut args: Vec<&str> = prefix.to_vec();
    let src_s = src.display().to_string();
    args.extend(["put", "-r", target, &src_s, remote, "--json"]);
    let up = ok(&output_of(locker(s, &args)), "put -r");
    let answer: Value = serde_json::from_str(&up).unwrap_or_else(|e| panic!("{e}: {up}"));
    assert_eq!(answer["type"], "dir", "{answer}");
    assert_eq!(answer["path"], remote, "{answer}");
    let want = manifest(&src);
    assert_eq!(
        answer["entries"].as_u64(),
        Some(want.len() as u64),
        "{answer}"
    );

    let back = local.path().join("back");
    let back_s = back.display().to_string();
    let mut args: Vec<&str> = prefix.to_vec();
    args.extend(["get", "-r", target, remote, &back_s]);
    ok(&output_of(locker(s, &args)), "get -r");
    assert_eq!(
        manifest(&back),
        want,
        "the tree came back different from what went up"
    );
    answer
}

#[test]
fn a_directory_goes_up_and_comes_back_as_tar() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    round_trip(&s, &["files"], &id, "/root/tree");
    // Inside the machine the tree is the real thing: bytes, modes, links.
    let inside = api.sh(
        &id,
        "cd /root/tree && sha256sum bin/blob.bin | cut -d' ' -f1; stat -c %a bin/tool.sh a/b; \
         readlink link-rel; cat a/up/../a/b/c/deep.txt; ./bin/tool.sh | wc -c",
    );
    let lines: Vec<&str> = inside.lines().collect();
    assert_eq!(lines[0], sha256_hex(&noise(1, 3 << 20)), "{inside}");
    assert_eq!(&lines[1..3], ["755", "700"], "{inside}");
    assert_eq!(lines[3], "bin/blob.bin", "{inside}");
    assert_eq!(lines[4], "deep", "{inside}");

    // Raw HTTP: the Accept header asks for a tar as `?format=tar` does.
    let r = api.request(
        "GET",
        &format!("/v1/sandboxes/{id}/files?path=/root/tree/a"),
        &[("Accept", "application/x-tar")],
        (),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.headers.get("content-type").unwrap().to_str().unwrap(),
        "application/x-tar"
    );
    let names = tar_names(&r.body);
    assert!(names.contains(&"b/c/deep.txt".to_string()), "{names:?}");
    assert!(names.contains(&"up".to_string()), "{names:?}");

    // An upload by Content-Type, into a directory that does not exist yet.
    let body = tar_of(&[record(b"x/y.txt", b'0', b"", b"hello")]);
    let put = api.request(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/srv/new/dir"),
        &[("Content-Type", "application/x-tar")],
        &body[..],
    );
    let v = put.expect(200, "tar by Content-Type");
    assert_eq!(
        (v["entries"].as_u64(), v["bytes"].as_u64()),
        (Some(1), Some(5)),
        "{v}"
    );
    assert_eq!(api.sh(&id, "cat /srv/new/dir/x/y.txt"), "hello");

    // Streaming the other way: a tar on stdout (`-`) is a tar of the same tree.
    let out = output_of(locker(&s, &["files", "get", "-r", &id, "/root/tree", "-"]));
    ok(&out, "get -r to stdout");
    assert!(tar_names(&out.stdout).contains(&"bin/blob.bin".to_string()));
}

#[test]
fn a_volume_directory_goes_up_and_comes_back_as_tar() {
    let s = Server::start();
    let api = s.api();
    let vol = volume(&api, "trees", 256);
    let answer = round_trip(&s, &["volume", "files"], "trees", "/in/tree");
    assert!(answer["bytes"].as_u64().unwrap() > 3 << 20, "{answer}");
    // It is in the volume's live tree on the host, and a sandbox that mounts it sees it.
    let live = s
        .data_dir
        .join("volumes")
        .join(&vol)
        .join("fs/live/in/tree");
    assert_eq!(
        fs::read_link(live.join("link-rel")).unwrap(),
        Path::new("bin/blob.bin")
    );
    let used = api.get(&format!("/v1/volumes/{vol}")).expect(200, "volume");
    assert!(
        used["used_bytes"].as_u64().unwrap_or(u64::MAX) >= 3 << 20,
        "the volume counts what the archive wrote: {used}"
    );

    // A tar larger than the volume's size is refused as any write past it: 413.
    let small = volume(&api, "small", 16);
    let big = tar_of(&[record(b"big.bin", b'0', b"", &noise(3, 40 << 20))]);
    let r = api.request(
        "PUT",
        &format!("/v1/volumes/{small}/files?path=/d&format=tar"),
        &[],
        &big[..],
    );
    let msg = r.expect_error(413, "payload_too_large", "a tar past the volume's size");
    assert!(msg.contains("full"), "{msg}");
    let _ = small;
}

/// One ustar record: a header for `name` of type `kind` (with `link`), then `data`.
fn record(name: &[u8], kind: u8, link: &[u8], data: &[u8]) -> Vec<u8> {
    record_sized(name, kind, link, data, data.len() as u64)
}

fn record_sized(name: &[u8], kind: u8, link: &[u8], data: &[u8], size: u64) -> Vec<u8> {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name);
    let octal = |h: &mut [u8; 512], at: usize, len: usize, v: u64| {
        let s = format!("{v:0w$o}", w = len - 1);
        h[at..at + len - 1].copy_from_slice(s.as_bytes());
    };
    octal(&mut h, 100, 8, 0o644);
    octal(&mut h, 108, 8, 0);
    octal(&mut h, 116, 8, 0);
    octal(&mut h, 124, 12, size);
    octal(&mut h, 136, 12, 1_700_000_000);
    h[156] = kind;
    h[157..157 + link.len()].copy_from_slice(link);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
    h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    let mut v = h.to_vec();
    v.extend_from_slice(data);
    v.resize(v.len().div_ceil(512) * 512, 0);
    v
}

fn tar_of(records: &[Vec<u8>]) -> Vec<u8> {
    let mut v: Vec<u8> = records.concat();
    v.extend(vec![0u8; 1024]);
    v
}

/// The names in a tar archive (ustar names and GNU long names).
fn tar_names(t: &[u8]) -> Vec<String> {
    let mut names = Vec::new();
    let mut at = 0;
    let mut long: Option<String> = None;
    while at + 512 <= t.len() && t[at..at + 512].iter().any(|b| *b != 0) {
        let h = &t[at..at + 512];
        let field = |a: usize, n: usize| {
            let f = &h[a..a + n];
            String::from_utf8_lossy(&f[..f.iter().position(|b| *b == 0).unwrap_or(n)]).into_owned()
        };
        let size = u64::from_str_radix(field(124, 12).trim(), 8).unwrap() as usize;
        let data = &t[at + 512..at + 512 + size];
        if h[156] == b'L' {
            long = Some(
                String::from_utf8_lossy(data)
                    .trim_end_matches('\0')
                    .to_string(),
            );
        } else {
            let n = long.take().unwrap_or_else(|| field(0, 100));
            names.push(n.trim_end_matches('/').to_string());
        }
        at += 512 + size.div_ceil(512) * 512;
    }
    names
}

/// The archives no honest client makes, each with what its refusal must say.
fn hostile_tars() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let x = b"pwned\n";
    vec![
        (
            "an absolute path",
            tar_of(&[record(b"/etc/locker-pwned", b'0', b"", x)]),
            "absolute",
        ),
        (
            "a .. path",
            tar_of(&[record(b"../../locker-pwned", b'0', b"", x)]),
            "..",
        ),
        (
            "a .. inside a path",
            tar_of(&[record(b"ok/../../../locker-pwned", b'0', b"", x)]),
            "..",
        ),
        (
            "a character device",
            tar_of(&[record(b"null2", b'3', b"", b"")]),
            "device",
        ),
        ("a FIFO", tar_of(&[record(b"pipe", b'6', b"", b"")]), "FIFO"),
        (
            "a write through the archive's own absolute symlink",
            tar_of(&[
                record(b"a", b'2', b"/etc", b""),
                record(b"a/locker-pwned", b'0', b"", x),
            ]),
            "a/locker-pwned",
        ),
        (
            "a write through the archive's own relative symlink out",
            tar_of(&[
                record(b"b", b'2', b"../../../../../../etc", b""),
                record(b"b/locker-pwned", b'0', b"", x),
            ]),
            "b/locker-pwned",
        ),
        (
            "a directory through a symlink out",
            tar_of(&[
                record(b"c", b'2', b"/", b""),
                record(b"c/locker-pwned-dir/", b'5', b"", b""),
            ]),
            "c/locker-pwned-dir",
        ),
        (
            "a hardlink to an absolute path",
            tar_of(&[record(b"h", b'1', b"/etc/passwd", b"")]),
            "absolute",
        ),
        (
            "a hardlink out with ..",
            tar_of(&[record(b"h", b'1', b"../../../etc/passwd", b"")]),
            "..",
        ),
        (
            "a hardlink through a symlink out",
            tar_of(&[
                record(b"s", b'2', b"/etc", b""),
                record(b"h", b'1', b"s/passwd", b""),
            ]),
            "\"h\"",
        ),
        ("not a tar", noise(9, 4096), "malformed"),
        (
            "a 5 GiB long name",
            {
                let mut t = record_sized(b"././@LongLink", b'L', b"", &[], 5 << 30);
                t.extend(vec![b'n'; 1 << 20]);
                t
            },
            "extension record",
        ),
    ]
}

/// Sends every hostile archive to `files` (a files route) into `dir`; each is a 400
/// whose message says what was wrong.
fn refuse_all(api: &Api, files: &str, dir: &str) {
    for (what, body, says) in hostile_tars() {
        let r = api.request(
            "PUT",
            &format!("{files}?path={dir}&format=tar"),
            &[],
            &body[..],
        );
        let msg = r.expect_error(400, "bad_request", what);
        assert!(
            msg.contains(says),
            "{what}: the message should say {says:?}: {msg}"
        );
    }
}

#[test]
fn hostile_tars_are_refused_and_contained() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    let probe = "sha256sum /etc/passwd | cut -c1-16; ls -d /etc/locker-pwned* /locker-pwned* \
                 /root/locker-pwned* /root/x/locker-pwned* 2>/dev/null | wc -l";
    let before = api.sh(&id, probe);
    assert!(before.ends_with("0\n"), "{before}");
    refuse_all(&api, &format!("/v1/sandboxes/{id}/files"), "/root/x/y");
    assert_eq!(
        api.sh(&id, probe),
        before,
        "a hostile archive wrote outside its directory"
    );
    // The machine still works, and what the refused archives could legally make stayed
    // inside: the symlinks are links in /root/x/y, never followed.
    assert_eq!(api.sh(&id, "readlink /root/x/y/a"), "/etc\n");

    // Links that stay inside are fine: a symlink to a sibling, written through, and a
    // hardlink to an entry before it.
    let good = tar_of(&[
        record(b"sub/", b'5', b"", b""),
        record(b"to-sub", b'2', b"sub", b""),
        record(b"to-sub/f", b'0', b"", b"inside\n"),
        record(b"hard", b'1', b"sub/f", b""),
    ]);
    let r = api.request(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/root/good&format=tar"),
        &[],
        &good[..],
    );
    r.expect(200, "links that stay inside");
    assert_eq!(
        api.sh(&id, "cat /root/good/sub/f; stat -c %h /root/good/hard"),
        "inside\n2\n"
    );

    // The same for a volume, whose agent runs on the host: nothing lands on the host.
    let vol = volume(&api, "hostile", 64);
    let host_passwd = sha256_hex(&fs::read("/etc/passwd").unwrap());
    refuse_all(&api, &format!("/v1/volumes/{vol}/files"), "/x/y");
    assert_eq!(sha256_hex(&fs::read("/etc/passwd").unwrap()), host_passwd);
    for p in ["/etc/locker-pwned", "/locker-pwned", "/locker-pwned-dir"] {
        assert!(!Path::new(p).exists(), "{p} appeared on the host");
    }
    let vdir = s.data_dir.join("volumes").join(&vol);
    let found = Command::new("find")
        .arg(&vdir)
        .args(["-name", "locker-pwned*"])
        .output()
        .unwrap();
    assert!(
        found.stdout.is_empty(),
        "found in the volume's directory: {}",
        String::from_utf8_lossy(&found.stdout)
    );
}

#[test]
fn a_directory_without_the_tar_ask_is_refused_with_a_hint() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    let r = api.get(&format!("/v1/sandboxes/{id}/files?path=/etc"));
    let msg = r.expect_error(400, "bad_request", "GET of a directory");
    for hint in ["application/x-tar", "format=tar", "-r"] {
        assert!(msg.contains(hint), "the 400 should mention {hint:?}: {msg}");
    }
    let r = api.get(&format!("/v1/sandboxes/{id}/files?path=/etc&format=zip"));
    let msg = r.expect_error(400, "bad_request", "an unknown format");
    assert!(msg.contains("tar"), "{msg}");
    // A file is not a directory to tar.
    let r = api.get(&format!(
        "/v1/sandboxes/{id}/files?path=/etc/hostname&format=tar"
    ));
    r.expect_error(400, "bad_request", "a tar of a file");

    let out = output_of(locker(&s, &["files", "get", &id, "/etc", "/tmp"]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("-r"), "{err}");
    // And the local side: `put` of a directory without -r says to pass it.
    let d = TempDir::new("tar-dir");
    let out = output_of(locker(
        &s,
        &[
            "files",
            "put",
            &id,
            &d.path().display().to_string(),
            "/root/d",
        ],
    ));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("put -r"));
    // `rm` of a non-empty directory says which flag removes it all.
    api.sh(&id, "mkdir -p /root/full && touch /root/full/f");
    let out = output_of(locker(&s, &["files", "rm", &id, "/root/full"]));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("-r"));
}

/// The `Arguments:` lines of a help text, each with its description (empty if none).
fn arguments(help: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut inside = false;
    for l in help.lines() {
        if l.starts_with("Arguments:") {
            inside = true;
            continue;
        }
        if inside && !l.starts_with("  ") {
            inside = false;
        }
        let t = l.trim_start();
        if inside && (t.starts_with('<') || t.starts_with('[')) && l.len() - t.len() == 2 {
            let end = t.find(['>', ']']).unwrap() + 1;
            out.push((t[..end].to_string(), t[end..].trim().to_string()));
        }
    }
    out
}

#[test]
fn help_texts_name_the_volume_and_describe_every_argument() {
    let help = |args: &[&str]| {
        let mut a = args.to_vec();
        a.push("--help");
        ok(&output_of(locker_cmd(&a)), &args.join(" "))
    };
    for cmd in ["get", "put", "ls", "rm", "mkdir", "mv", "stat"] {
        for prefix in [&["files"][..], &["volume", "files"][..]] {
            let mut args = prefix.to_vec();
            args.push(cmd);
            let h = help(&args);
            let list = arguments(&h);
            assert!(!list.is_empty(), "{args:?}: {h}");
            for (name, text) in &list {
                assert!(
                    !text.is_empty(),
                    "{args:?}: {name} has no description:\n{h}"
                );
            }
            if prefix.len() == 2 {
                assert_eq!(list[0].0, "<VOLUME>", "{args:?}:\n{h}");
                assert!(
                    !h.to_lowercase().contains("sandbox"),
                    "{args:?} speaks of a sandbox:\n{h}"
                );
            } else {
                assert_eq!(list[0].0, "<SANDBOX>", "{args:?}:\n{h}");
            }
        }
    }
    for cmd in ["get", "put", "rm"] {
        let h = help(&["files", cmd]);
        let line = h
            .lines()
            .find(|l| l.contains("-r, --recursive"))
            .unwrap_or_else(|| panic!("files {cmd} has no -r:\n{h}"));
        assert!(line.trim().len() > "-r, --recursive".len() + 4, "{line}");
    }
}

#[test]
fn a_tar_past_the_sandbox_disk_is_413_like_a_file() {
    let s = Server::start();
    let api = s.api();
    let id = api.create_sandbox(&json!({"disk_mb": 64}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let big = noise(5, 100 << 20);
    let file = api.request(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/root/one.bin"),
        &[],
        &big[..],
    );
    file.expect_error(413, "payload_too_large", "a file past the disk");
    let tar = tar_of(&[
        record(b"small.txt", b'0', b"", b"fits\n"),
        record(b"big.bin", b'0', b"", &big),
    ]);
    let r = api.request(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/root/t&format=tar"),
        &[],
        &tar[..],
    );
    let msg = r.expect_error(413, "payload_too_large", "a tar past the disk");
    assert!(msg.contains("big.bin"), "names the entry: {msg}");
    // The entry before stays, the one that did not fit leaves nothing behind.
    assert_eq!(
        api.sh(&id, "cat /root/t/small.txt; ls -A /root/t | wc -l"),
        "fits\n1\n"
    );
}

/// A tree of `files` files of `each` bytes.
fn big_tree(root: &Path, files: usize, each: usize) {
    for i in 0..files {
        let dir = root.join(format!("d{}", i % 4));
        fs::create_dir_all(&dir).unwrap();
        let mut f = fs::File::create(dir.join(format!("f{i}.bin"))).unwrap();
        f.write_all(&noise(100 + i as u64, each)).unwrap();
    }
}

/// The server's peak RSS (KiB) while `f` runs, sampled every 20 ms.
fn peak_rss_during<T>(pid: u32, f: impl FnOnce() -> T) -> (T, u64) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let sampler = std::thread::spawn(move || {
        let mut peak = 0;
        while !s2.load(std::sync::atomic::Ordering::SeqCst) {
            peak = peak.max(rss_kib(pid));
            std::thread::sleep(Duration::from_millis(20));
        }
        peak
    });
    let r = f();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    (r, sampler.join().unwrap())
}

#[test]
fn a_300_mb_tree_streams_both_ways_in_little_server_memory() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    let local = TempDir::new("tar-big");
    let src: PathBuf = local.path().join("src");
    big_tree(&src, 30, 10 << 20);
    let total_mb = 300.0;
    let base = rss_kib(s.pid());
    let src_s = src.display().to_string();

    let t = Instant::now();
    let (out, up_peak) = peak_rss_during(s.pid(), || {
        output_of(locker(
            &s,
            &["files", "put", "-r", &id, &src_s, "/root/big", "--json"],
        ))
    });
    let up_s = t.elapsed().as_secs_f64();
    let v: Value = serde_json::from_str(&ok(&out, "put -r 300 MB")).unwrap();
    assert_eq!(v["bytes"].as_u64(), Some(300 << 20), "{v}");

    let back = local.path().join("back");
    let back_s = back.display().to_string();
    let t = Instant::now();
    let (out, down_peak) = peak_rss_during(s.pid(), || {
        output_of(locker(
            &s,
            &["files", "get", "-r", &id, "/root/big", &back_s],
        ))
    });
    let down_s = t.elapsed().as_secs_f64();
    ok(&out, "get -r 300 MB");
    eprintln!(
        "300 MB tree: up {up_s:.1} s ({:.0} MB/s), down {down_s:.1} s ({:.0} MB/s); \
         server RSS {} MiB before, peak {} MiB up, {} MiB down",
        total_mb / up_s,
        total_mb / down_s,
        base >> 10,
        up_peak >> 10,
        down_peak >> 10
    );
    assert_eq!(
        manifest(&back),
        manifest(&src),
        "the big tree came back different"
    );
    for peak in [up_peak, down_peak] {
        assert!(
            peak < base + (64 << 10),
            "the server's RSS grew from {base} KiB to {peak} KiB moving a 300 MB tree"
        );
    }
}
