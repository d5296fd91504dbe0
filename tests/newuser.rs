//! A new user's first hour (`shared/reports/newuser-2.md`), each reproduction a test
//! against the real server and the real `locker` binary.
//!
//! Bytes stay bytes: binary output reaches every client unchanged (`stdout_b64` in the
//! ExecResult, `data_b64` in NDJSON chunks, raw bytes on `locker exec`'s stdout), and piped
//! stdin streams into the command as it comes (`yes | locker exec SB -- head -1` returns at
//! once; a stream larger than any request body passes through).

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

fn sandbox(api: &Api) -> String {
    api.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// `locker ARGS…` against `s`, with `stdin` as its standard input.
fn locker(s: &Server, args: &[&str], stdin: Stdio) -> Command {
    let mut c = Command::new(locker_tests::locker_bin());
    c.args(args)
        .env("LOCKER_URL", &s.url)
        .env("LOCKER_API_KEY", &s.api_key)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Waits for a `locker` child's output. Registered first: the tests' orphan reaper
/// (`become_subreaper`) reaps zombies named `locker` that no test waits for itself.
fn output_of(mut c: Command) -> std::process::Output {
    let child = c.spawn().unwrap();
    locker_tests::register_child(child.id());
    child.wait_with_output().unwrap()
}

/// Spawns a `locker` child that the test waits for itself (see [`output_of`]).
fn spawned(mut c: Command) -> std::process::Child {
    let child = c.spawn().unwrap();
    locker_tests::register_child(child.id());
    child
}

fn sha256_hex(data: &[u8]) -> String {
    let mut c = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(data).unwrap();
    let out = c.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

/// Whether a process named `comm` runs in the sandbox.
fn running(api: &Api, id: &str, comm: &str) -> bool {
    let script = format!("cat /proc/[0-9]*/comm 2>/dev/null | grep -cx {comm} || true");
    api.sh(id, &script).trim() != "0"
}

fn b64(v: &Value) -> Vec<u8> {
    locker_types::base64::decode(v.as_str().expect("a base64 string")).unwrap()
}

#[test]
fn binary_output_reaches_every_client_unchanged() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    let inside = api.sh(&id, "sha256sum /usr/bin/ls | cut -d' ' -f1");
    let inside = inside.trim();

    // The CLI writes the raw bytes (it streams NDJSON chunks, `data_b64` where not text).
    let out = output_of(locker(
        &s,
        &["exec", &id, "--", "cat", "/usr/bin/ls"],
        Stdio::null(),
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        sha256_hex(&out.stdout),
        inside,
        "locker exec corrupted binary stdout"
    );

    // The ExecResult carries the bytes in `stdout_b64` when they are not UTF-8.
    let r = api.exec(
        &id,
        &json!({"shell": "head -c 4000 /usr/bin/ls; printf 'err\\377' >&2", "max_output_bytes": 65536}),
    );
    let head = api.sh(&id, "head -c 4000 /usr/bin/ls | sha256sum | cut -d' ' -f1");
    assert_eq!(sha256_hex(&b64(&r["stdout_b64"])), head.trim());
    assert_eq!(b64(&r["stderr_b64"]), b"err\xff");
    // Text output has no `_b64` twin.
    let t = api.exec(&id, &json!({"cmd": ["echo", "plain ☃"]}));
    assert_eq!(t["stdout"], "plain ☃\n");
    assert!(t.get("stdout_b64").is_none(), "{t}");

    // NDJSON chunks: the concatenated bytes equal the file.
    let body = json!({"cmd": ["cat", "/usr/bin/ls"]}).to_string();
    let resp = api.request(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        &[
            ("Accept", "application/x-ndjson"),
            ("Content-Type", "application/json"),
        ],
        body.as_str(),
    );
    let mut got = Vec::new();
    for line in resp.text().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        if v["type"] == "stdout" {
            match v.get("data_b64") {
                Some(b) => got.extend(b64(b)),
                None => got.extend(v["data"].as_str().unwrap().as_bytes()),
            }
        }
    }
    assert_eq!(sha256_hex(&got), inside);

    // The CLI's `--json` keeps them too.
    let out = output_of(locker(
        &s,
        &[
            "exec",
            "--json",
            &id,
            "--",
            "head",
            "-c",
            "100",
            "/usr/bin/ls",
        ],
        Stdio::null(),
    ));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(b64(&v["stdout_b64"]).len(), 100);
}

#[test]
fn piped_stdin_streams_into_the_command_as_it_comes() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);

    // `yes | locker exec SB -- head -1` returns at once (stdin is endless).
    let t = Instant::now();
    let mut yes = Command::new("yes").stdout(Stdio::piped()).spawn().unwrap();
    let out = output_of(locker(
        &s,
        &["exec", &id, "--", "head", "-1"],
        Stdio::from(yes.stdout.take().unwrap()),
    ));
    let _ = yes.kill();
    let _ = yes.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"y\n");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );

    // The command starts before stdin ends: it sees the first line while we still write.
    let mut c = spawned(locker(
        &s,
        &[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "read a; echo got-$a; cat >/dev/null; echo end",
        ],
        Stdio::piped(),
    ));
    let mut w = c.stdin.take().unwrap();
    w.write_all(b"first\n").unwrap();
    w.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = false;
    while Instant::now() < deadline {
        if running(&api, &id, "cat") {
            seen = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(seen, "the command did not start while stdin was open");
    drop(w);
    let out = c.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "got-first\nend\n");

    // More than a request body may hold (64 MiB a request; 1 MiB of JSON): 100 MiB of
    // bytes pass through, counted and hashed inside, without the CLI holding them.
    let dir = locker_tests::TempDir::new("stdin");
    let data = dir.path().join("data");
    let ok = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "head -c 104857600 /dev/urandom > {}",
            data.display()
        ))
        .status()
        .unwrap();
    assert!(ok.success());
    let want = Command::new("sha256sum").arg(&data).output().unwrap();
    let want = String::from_utf8_lossy(&want.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    let mut cat = Command::new("cat")
        .arg(&data)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = output_of(locker(
        &s,
        &[
            "exec",
            "--timeout-ms",
            "300000",
            &id,
            "--",
            "sh",
            "-c",
            "tee /tmp/in | sha256sum | cut -d' ' -f1; wc -c < /tmp/in",
        ],
        Stdio::from(cat.stdout.take().unwrap()),
    ));
    let _ = cat.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(want.as_str()));
    assert_eq!(lines.next().map(str::trim), Some("104857600"));

    // A small regular file still works (it travels inside the request).
    std::fs::write(dir.path().join("small"), b"abc\xff").unwrap();
    let out = output_of(locker(
        &s,
        &["exec", &id, "--", "od", "-An", "-tx1"],
        Stdio::from(std::fs::File::open(dir.path().join("small")).unwrap()),
    ));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "61 62 63 ff");
}

#[test]
fn an_interrupted_streamed_exec_kills_its_command() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    let c = spawned(locker(
        &s,
        &[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "cat > /dev/null & exec sleep 600",
        ],
        Stdio::piped(),
    ));
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && !running(&api, &id, "sleep") {
        std::thread::sleep(Duration::from_millis(100));
    }
    // SIGINT, as a user's Ctrl-C would arrive.
    let ok = Command::new("kill")
        .args(["-INT", &c.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let out = c.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if !running(&api, &id, "sleep") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the command outlived its interrupted exec"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The README's quick tour, run as written (one bash, `set -eu`, as typed at a prompt: no
/// pipefail, so `yes | …` is not a failure) in a fresh directory
/// against a fresh server: the first thing a newcomer does must work. The `export` of the
/// URL and key is the test's own (its server's); `locker shell` reads the end of stdin and
/// leaves.
#[test]
fn the_readme_tour_runs_as_written() {
    let readme = std::fs::read_to_string(locker_tests::root().join("README.md")).unwrap();
    let tour = readme
        .split("## Quick tour")
        .nth(1)
        .and_then(|t| t.split("```sh\n").nth(1))
        .and_then(|t| t.split("```").next())
        .expect("README.md has a ```sh block under ## Quick tour");
    let script: String = tour
        .lines()
        .filter(|l| !l.starts_with("export LOCKER_"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(script.contains("locker sandbox create"), "{script}");
    let s = Server::start();
    let dir = locker_tests::TempDir::new("tour");
    let bin_dir = locker_tests::locker_bin().parent().unwrap().to_owned();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .args(["-eu", "-c", &script])
        .current_dir(dir.path())
        .env("PATH", path)
        .env("LOCKER_URL", &s.url)
        .env("LOCKER_API_KEY", &s.api_key)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "the tour failed:\n{script}\nstdout:\n{o}\nstderr:\n{e}"
    );
    assert!(
        o.contains("42\n") && o.contains("hello from app.py\n"),
        "{o}"
    );
    assert!(o.contains("y\ny\n"), "{o}");
    assert!(o.contains("hello from app.py"), "{o}");
}

fn vol_put(api: &Api, vol: &str, path: &str, data: &[u8]) {
    let p = format!(
        "/v1/volumes/{vol}/files?path={}",
        locker_tests::server::enc(path)
    );
    api.put(&p, data).expect(200, "upload");
}

fn vol_get(api: &Api, vol: &str, path: &str) -> (u16, Vec<u8>) {
    let p = format!(
        "/v1/volumes/{vol}/files?path={}",
        locker_tests::server::enc(path)
    );
    let r = api.get(&p);
    (r.status, r.body)
}

/// Newuser bug 5: a volume snapshot was a dead end (no list, read, restore or delete).
#[test]
fn volume_snapshots_can_be_listed_forked_restored_and_deleted() {
    let s = Server::start();
    let api = s.api();
    api.post("/v1/volumes", &json!({"name": "repo"}))
        .expect(201, "create a volume");
    vol_put(&api, "repo", "/a.txt", b"one");
    let snap = api
        .post("/v1/volumes/repo/snapshots", &json!({}))
        .expect(201, "snapshot");
    let snap_id = snap["id"].as_str().unwrap().to_owned();
    vol_put(&api, "repo", "/a.txt", b"two");
    vol_put(&api, "repo", "/b.txt", b"later");

    // Listed, by name.
    let list = api.get("/v1/volumes/repo/snapshots").expect(200, "list");
    assert_eq!(list["snapshots"][0]["id"], snap_id.as_str(), "{list}");

    // Read through a fork of the snapshot.
    api.post(
        "/v1/volumes/repo/fork",
        &json!({"name": "old", "snapshot": snap_id}),
    )
    .expect(201, "fork from a snapshot");
    assert_eq!(vol_get(&api, "old", "/a.txt"), (200, b"one".to_vec()));
    assert_eq!(vol_get(&api, "old", "/b.txt").0, 404);

    // Restored: refused while a sandbox mounts the volume, then the tree goes back.
    let sb = api.create_sandbox(&json!({"volumes": [{"volume": "repo", "path": "/workspace"}]}));
    let sb = sb["id"].as_str().unwrap().to_owned();
    api.post("/v1/volumes/repo/restore", &json!({"snapshot": snap_id}))
        .expect_error(409, "conflict", "restore while mounted");
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the sandbox");
    let v = api
        .post("/v1/volumes/repo/restore", &json!({"snapshot": snap_id}))
        .expect(200, "restore");
    assert_eq!(v["name"], "repo");
    assert_eq!(vol_get(&api, "repo", "/a.txt"), (200, b"one".to_vec()));
    assert_eq!(vol_get(&api, "repo", "/b.txt").0, 404);
    // The volume keeps working after the restore (files API and a run).
    vol_put(&api, "repo", "/c.txt", b"after");
    let r = api
        .post(
            "/v1/volumes/repo/run",
            &json!({"shell": "cat a.txt c.txt", "commit": "never"}),
        )
        .expect(200, "run after restore");
    assert_eq!(r["stdout"], "oneafter", "{r}");

    // Another volume's snapshot id is not this volume's.
    api.post("/v1/volumes", &json!({"name": "other"}))
        .expect(201, "create another");
    api.post("/v1/volumes/other/restore", &json!({"snapshot": snap_id}))
        .expect_error(404, "not_found", "a snapshot of another volume");

    // Deleted: gone from the list and from disk.
    api.delete(&format!("/v1/volumes/repo/snapshots/{snap_id}"))
        .expect(204, "delete the snapshot");
    let list = api.get("/v1/volumes/repo/snapshots").expect(200, "list");
    assert_eq!(list["snapshots"], json!([]));
    api.delete(&format!("/v1/volumes/repo/snapshots/{snap_id}"))
        .expect_error(404, "not_found", "delete twice");
    let left = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ls -d {}/volumes/*/fs/snapshots/{snap_id} 2>/dev/null | wc -l",
            s.data_dir.display()
        ))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&left.stdout).trim(), "0");
}

/// Newuser bug 6: `locker calls --volume NAME` silently listed nothing.
#[test]
fn calls_of_a_volume_are_found_by_its_name() {
    let s = Server::start();
    let api = s.api();
    api.post("/v1/volumes", &json!({"name": "repo"}))
        .expect(201, "create a volume");
    api.post("/v1/volumes/repo/run", &json!({"cmd": ["true"]}))
        .expect(200, "run");
    let by_name = api.get("/v1/calls?volume_id=repo").expect(200, "calls");
    assert_eq!(by_name["calls"].as_array().unwrap().len(), 1, "{by_name}");
    api.get("/v1/calls?volume_id=nosuch")
        .expect_error(404, "not_found", "an unknown volume name");
    let out = output_of(locker(&s, &["calls", "--volume", "repo"], Stdio::null()));
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("call_"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Newuser bug 7: a template without `/proc`, `/dev`, `/sys` (a minimal root filesystem)
/// failed every create with a 500 (EOVERFLOW making `/proc` through the overlay). The
/// runtime now makes the mount points it needs. The template lives in a cache of its own,
/// removed with the test.
#[test]
fn a_template_without_proc_dev_or_sys_starts() {
    let cache = locker_tests::TempDir::new("mini-cache");
    let work = locker_tests::TempDir::new("mini-root");
    let root = work.path().join("rootfs");
    // /bin/sh (dash) and the libraries it loads, /etc/passwd: nothing else.
    let ldd = Command::new("ldd").arg("/bin/dash").output().unwrap();
    let mut files = vec![std::path::PathBuf::from("/bin/dash")];
    for l in String::from_utf8_lossy(&ldd.stdout).lines() {
        if let Some(p) = l.split_whitespace().find(|w| w.starts_with('/')) {
            files.push(p.into());
        }
    }
    for f in &files {
        let to = if f.as_os_str() == "/bin/dash" {
            root.join("bin/sh")
        } else {
            root.join(f.strip_prefix("/").unwrap())
        };
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(f, &to).unwrap();
    }
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::create_dir_all(root.join("root")).unwrap();
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    assert!(!root.join("proc").exists() && !root.join("dev").exists());
    let tarball = work.path().join("mini.tar.gz");
    let ok = Command::new("tar")
        .arg("-C")
        .arg(&root)
        .arg("-czf")
        .arg(&tarball)
        .arg(".")
        .status()
        .unwrap();
    assert!(ok.success());
    let mut import = Command::new(locker_tests::locker_bin());
    import
        .args(["template", "import", "mini"])
        .arg(&tarball)
        .env("LOCKER_CACHE_DIR", cache.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = output_of(import);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let cache_arg = cache.path().display().to_string();
    let s = Server::start_with(&["--cache-dir", &cache_arg]);
    let api = s.api();
    let sb = api.create_sandbox(&json!({"template": "mini"}));
    let id = sb["id"].as_str().unwrap();
    let r = api.exec(
        id,
        &json!({"cmd": ["/bin/sh", "-c", "echo hi; cd /proc/self && cd /tmp && echo > /dev/null && echo ok"]}),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["stdout"], "hi\nok\n", "{r}");
}

/// Newuser friction 3: no interactive exec. `locker exec -it SB -- python3` and `locker
/// shell SB -- CMD` give the command a terminal, driven here through a real
/// pseudo-terminal (`script`), keys typed ahead included; `-t` takes `--cwd` and `--env`
/// and leaves with the command's code.
#[test]
fn exec_it_and_shell_with_a_command_run_in_a_terminal() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    let bin = locker_tests::locker_bin().display().to_string();
    let through_pty = |cmd: String| {
        let mut c = Command::new("bash");
        c.arg("-c")
            .arg(format!(
                "printf 'print(6*7)\\nexit()\\n' | script -qec {} /dev/null",
                shell_quote(&cmd)
            ))
            .env("LOCKER_URL", &s.url)
            .env("LOCKER_API_KEY", &s.api_key)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        output_of(c)
    };
    for cmd in [
        format!("{bin} exec -it {id} -- python3"),
        format!("{bin} shell {id} -- python3"),
    ] {
        let out = through_pty(cmd.clone());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{cmd}: {text}");
        assert!(
            text.contains(">>> ") && text.contains("\n42"),
            "{cmd}: {text}"
        );
    }
    let out = output_of(locker(
        &s,
        &[
            "exec",
            "-t",
            "--cwd",
            "/tmp",
            "-e",
            "A=b c",
            &id,
            "--",
            "sh",
            "-c",
            "echo \"$A\" $(pwd); tty; exit 3",
        ],
        Stdio::null(),
    ));
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{text}\n{err}");
    assert!(
        text.contains("b c /tmp") && text.contains("/dev/pts/"),
        "{text}"
    );
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}
