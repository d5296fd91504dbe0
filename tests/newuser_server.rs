//! A new user's first hour (`shared/reports/newuser-2.md`), the server's side: background
//! processes that live as long as their sandbox, their true timings, what an id that is
//! gone says, what `locker serve` prints, what `locker doctor` claims, templates (the
//! missing default, removal), and the bounded spill of truncated outputs.

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

fn start_process(api: &Api, id: &str, body: &Value) -> String {
    api.post(&format!("/v1/sandboxes/{id}/processes"), body)
        .expect(200, "start a background process")["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn process(api: &Api, id: &str, proc_id: &str) -> Value {
    api.get(&format!("/v1/sandboxes/{id}/processes/{proc_id}"))
        .expect(200, "get a process")
}

/// `locker ARGS…` with the test's agent binary, output captured; registered with the tests'
/// orphan reaper, which otherwise reaps children named `locker` that no test waits for.
fn output_of(mut c: Command) -> std::process::Output {
    c.env("LOCKER_AGENT_BIN", locker_tests::agent_bin())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = c.spawn().unwrap();
    locker_tests::register_child(child.id());
    child.wait_with_output().unwrap()
}

#[test]
fn a_background_process_runs_past_a_minute_without_a_timeout() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    let t0 = Instant::now();
    let p = start_process(&api, &id, &json!({"cmd": ["sleep", "100"]}));
    // Exec's default is 60 s; a background process has none.
    std::thread::sleep(Duration::from_secs(66).saturating_sub(t0.elapsed()));
    let info = process(&api, &id, &p);
    assert_eq!(info["state"], "running", "killed at exec's default: {info}");
    api.post(
        &format!("/v1/sandboxes/{id}/processes/{p}/signal"),
        &json!({"signal": "KILL"}),
    )
    .expect(200, "kill it");

    // An explicit timeout longer than exec's hour is a background process's right (up to
    // the longest a sandbox may live); exec keeps its bound.
    let long = start_process(
        &api,
        &id,
        &json!({"cmd": ["sleep", "1000"], "timeout_ms": 7_200_000}),
    );
    assert_eq!(process(&api, &id, &long)["state"], "running");
    let too_long = api.post(
        &format!("/v1/sandboxes/{id}/processes"),
        &json!({"cmd": ["true"], "timeout_ms": 31u64 * 24 * 3600 * 1000}),
    );
    let msg = too_long.expect_error(400, "bad_request", "a timeout past the longest TTL");
    assert!(msg.contains("2592000000"), "{msg}");
    let exec = api.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"cmd": ["true"], "timeout_ms": 7_200_000}),
    );
    let msg = exec.expect_error(400, "bad_request", "exec past an hour");
    assert!(msg.contains("background process"), "{msg}");
    // An explicit timeout still ends one.
    let short = start_process(
        &api,
        &id,
        &json!({"cmd": ["sleep", "100"], "timeout_ms": 500}),
    );
    let end = locker_tests::wait_for(Duration::from_secs(20), "the timeout", || {
        let i = process(&api, &id, &short);
        (i["state"] == "exited").then_some(i)
    });
    assert_eq!(end["result"]["reason"], "timeout", "{end}");
}

#[test]
fn a_background_process_reports_its_queue_and_total_times() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    let p = start_process(&api, &id, &json!({"shell": "sleep 1; echo done"}));
    let info = locker_tests::wait_for(Duration::from_secs(20), "the process ends", || {
        let i = process(&api, &id, &p);
        (i["state"] == "exited").then_some(i)
    });
    let check = |t: &Value, what: &str| {
        let (q, st, run, total) = (
            t["queue_ms"].as_f64().unwrap(),
            t["start_ms"].as_f64().unwrap(),
            t["run_ms"].as_f64().unwrap(),
            t["total_ms"].as_f64().unwrap(),
        );
        assert!(q > 0.0, "{what}: queue_ms {t}");
        assert!(run >= 1000.0, "{what}: run_ms {t}");
        assert!(total >= q + st + run - 0.01, "{what}: total_ms {t}");
        assert!(total < run + 5000.0, "{what}: total_ms {t}");
    };
    check(&info["result"]["timings"], "GET");
    let list = api
        .get(&format!("/v1/sandboxes/{id}/processes"))
        .expect(200, "list");
    let mine = list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == p.as_str())
        .unwrap()
        .clone();
    check(&mine["result"]["timings"], "list");
    let out = api
        .get(&format!("/v1/sandboxes/{id}/processes/{p}/output"))
        .text();
    let last: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(last["type"], "result", "{out}");
    check(&last["timings"], "output");
    // The call record carries the same timings.
    let call = locker_tests::wait_for(Duration::from_secs(10), "the call record", || {
        let calls = api
            .get(&format!("/v1/calls?sandbox_id={id}"))
            .expect(200, "calls");
        calls["calls"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["kind"] == "process")
            .cloned()
    });
    check(&call["result"]["timings"], "call record");
}

#[test]
fn a_gone_sandbox_says_when_it_expired_or_was_deleted() {
    let s = Server::start();
    let api = s.api();
    let short = api.create_sandbox(&json!({"ttl_s": 2}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let deleted = sandbox(&api);
    api.delete(&format!("/v1/sandboxes/{deleted}"))
        .expect(204, "delete");
    let msg = locker_tests::wait_for(Duration::from_secs(30), "the TTL reaper", || {
        let r = api.get(&format!("/v1/sandboxes/{short}"));
        (r.status == 404).then(|| r.expect_error(404, "not_found", "expired"))
    });
    assert!(msg.contains("expired at 20"), "{msg}");
    // Every route that takes the id answers the same.
    for (method, path) in [
        ("POST", format!("/v1/sandboxes/{short}/exec")),
        ("GET", format!("/v1/sandboxes/{short}/files?path=/")),
        ("GET", format!("/v1/sandboxes/{short}/processes")),
        ("DELETE", format!("/v1/sandboxes/{short}")),
    ] {
        let r = api.request(
            method,
            &path,
            &[("Content-Type", "application/json")],
            br#"{"cmd":["true"]}"#.to_vec(),
        );
        let m = r.expect_error(404, "not_found", &path);
        assert!(m.contains("expired at"), "{path}: {m}");
    }
    let m = api
        .get(&format!("/v1/sandboxes/{deleted}"))
        .expect_error(404, "not_found", "deleted");
    assert!(m.contains("was deleted at 20"), "{m}");
    let m = api
        .post(
            &format!("/v1/sandboxes/{deleted}/exec"),
            &json!({"cmd": ["true"]}),
        )
        .expect_error(404, "not_found", "deleted");
    assert!(m.contains("was deleted at"), "{m}");
    // A typo is still a typo, and another tenant learns nothing.
    let m = api
        .get("/v1/sandboxes/sb_nope")
        .expect_error(404, "not_found", "typo");
    assert!(m.contains("does not exist"), "{m}");
    let (other, _) = s.create_tenant("tomb-other");
    let m = other.get(&format!("/v1/sandboxes/{deleted}")).expect_error(
        404,
        "not_found",
        "another tenant",
    );
    assert!(m.contains("does not exist"), "{m}");
}

/// A `locker serve` started by a test with stdout and stderr apart; stopped on drop.
struct Serve {
    child: std::process::Child,
    dir: locker_tests::TempDir,
}

impl Serve {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Serve {
        locker_tests::become_subreaper();
        let dir = locker_tests::TempDir::new("locker-serve-out");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut c = Command::new(locker_tests::locker_bin());
        c.arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--warm-pool", "0", "--vm-pool", "0"])
            .args(args)
            .env("LOCKER_AGENT_BIN", locker_tests::agent_bin())
            .env_remove("LOCKER_API_KEY")
            .env_remove("NO_COLOR")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.path().join("out")).unwrap())
            .stderr(std::fs::File::create(dir.path().join("err")).unwrap());
        let child = c.spawn().unwrap();
        locker_tests::register_child(child.id());
        Serve { child, dir }
    }

    fn out(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("out")).unwrap_or_default()
    }

    fn err(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("err")).unwrap_or_default()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SAFETY: a signal to our own child, which we have not waited for yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

#[test]
fn serve_prints_the_lines_to_export_on_stdout_and_no_colour_into_a_file() {
    let s = Serve::start(&[], &[]);
    let line = locker_tests::wait_for(Duration::from_secs(30), "the key", || {
        s.out()
            .lines()
            .find(|l| {
                l.trim_start()
                    .starts_with("export LOCKER_URL=http://127.0.0.1:")
            })
            .map(str::to_owned)
    });
    assert!(line.contains(" LOCKER_API_KEY=lk_"), "{line}");
    locker_tests::wait_for(Duration::from_secs(30), "ready", || {
        s.err().contains("locker serve ready").then_some(())
    });
    let (err, out) = (s.err(), s.out());
    assert!(
        !err.contains("\u{1b}["),
        "colour codes in a log file:\n{err}"
    );
    assert!(!err.contains("lk_"), "the key went to the log:\n{err}");
    assert!(!out.contains("INFO"), "log lines on stdout:\n{out}");
    // The printed line is the one to paste: it works.
    let url = line
        .split("LOCKER_URL=")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    let key = line.split("LOCKER_API_KEY=").nth(1).unwrap().trim();
    let api = Api::new(url, Some(key));
    api.get("/v1/sandboxes")
        .expect(200, "the printed key works");
}

fn as_nobody(args: &[&str]) -> Command {
    let mut c = Command::new("setpriv");
    c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"])
        .arg(locker_tests::locker_bin())
        .args(args);
    c
}

#[test]
fn doctor_and_serve_tell_a_non_root_user_the_truth() {
    let dir = locker_tests::TempDir::new("locker-nobody");
    let missing = dir.path().join("not/yet/data");
    let out = output_of(as_nobody(&[
        "doctor",
        "--json",
        "--data-dir",
        missing.to_str().unwrap(),
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{e}: {text} {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(v["runtimes"]["jail"]["ok"], false, "{v}");
    assert!(
        v["runtimes"]["jail"]["detail"]
            .as_str()
            .unwrap()
            .contains("not root"),
        "{v}"
    );
    assert_eq!(v["host"]["data_dir_exists"], false, "{v}");
    let out = output_of(as_nobody(&[
        "doctor",
        "--data-dir",
        missing.to_str().unwrap(),
    ]));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("does not exist yet"), "{table}");
    assert!(!table.contains("jail      yes"), "{table}");
    assert!(table.contains("copy-on-write     "), "{table}");
    assert!(!table.contains("copy-on-write     copy\n"), "{table}");

    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let t0 = Instant::now();
    let out = output_of(as_nobody(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
    ]));
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "serve as nobody started: {so} {se}");
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert!(se.contains("needs root"), "{se}");
    assert!(
        !so.contains("lk_") && !se.contains("lk_"),
        "printed a key: {so} {se}"
    );
    assert!(!se.contains("removed stale machine networks"), "{se}");
}

#[test]
fn doctor_checks_the_default_template_and_the_build_tools() {
    let empty = locker_tests::TempDir::new("locker-cache-empty");
    let out = output_of({
        let mut c = Command::new(locker_tests::locker_bin());
        c.args(["doctor", "--json", "--cache-dir"])
            .arg(empty.path());
        c
    });
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["templates"]["default_built"], false, "{v}");
    assert!(
        v["templates"]["detail"]
            .as_str()
            .unwrap()
            .contains("locker template build default"),
        "{v}"
    );
    for tool in ["mkfs.ext4", "mmdebstrap", "btrfs-progs"] {
        assert_eq!(v["templates"]["tools"][tool]["ok"], true, "{tool}: {v}");
    }
    // Read only: a missing cache is reported, not created.
    assert!(!empty.path().join("templates").exists());
    let out = output_of({
        let mut c = Command::new(locker_tests::locker_bin());
        c.args(["doctor", "--cache-dir"])
            .arg(locker_tests::cache_dir());
        c
    });
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("`default` built"), "{table}");
    assert!(table.contains("mmdebstrap yes"), "{table}");
}

/// An empty template cache whose `default` build lock the test holds.
fn cache_with_held_build_lock() -> (locker_tests::TempDir, std::fs::File, String) {
    let cache = locker_tests::TempDir::new("locker-cache-building");
    let digest = locker_runtime::template::default_spec().digest();
    let locks = cache.path().join("templates/.locks");
    std::fs::create_dir_all(&locks).unwrap();
    let lock = std::fs::File::create(locks.join(format!("{digest}.lock"))).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file we own.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    (cache, lock, digest)
}

#[test]
fn a_server_without_the_default_template_builds_it_and_says_so_meanwhile() {
    let shared = locker_tests::cache_dir().join("templates");
    let (cache, lock, digest) = cache_with_held_build_lock();
    assert!(
        shared.join(&digest).join("meta.json").is_file(),
        "the shared cache has no default template of this spec"
    );
    let s = Server::start_with(&[
        "--cache-dir",
        cache.path().to_str().unwrap(),
        "--warm-pool",
        "0",
        "--vm-pool",
        "0",
    ]);
    let api = s.api();
    let r = api.post("/v1/sandboxes", &json!({}));
    let msg = r.expect_error(503, "unavailable", "create while default builds");
    assert!(
        msg.contains("the default template is being built since 20") && msg.contains("try again"),
        "{msg}"
    );
    assert!(
        s.log_text().contains("building it in the background"),
        "{}",
        s.log_text()
    );
    // The build (waiting on the test's lock) finds the template built once it may go on:
    // the shared cache's copy stands in for a real mmdebstrap run.
    std::os::unix::fs::symlink(
        shared.join(&digest),
        cache.path().join("templates").join(&digest),
    )
    .unwrap();
    drop(lock);
    locker_tests::wait_for(Duration::from_secs(60), "the build ends", || {
        s.log_text()
            .contains("the template `default` is built")
            .then_some(())
    });
    let id = sandbox(&api);
    assert_eq!(api.sh(&id, "echo ok").trim(), "ok");
}

#[test]
fn a_server_told_not_to_build_warns_and_creates_say_what_to_run() {
    let cache = locker_tests::TempDir::new("locker-cache-nobuild");
    let s = Server::start_with(&[
        "--cache-dir",
        cache.path().to_str().unwrap(),
        "--no-template-build",
        "--warm-pool",
        "0",
        "--vm-pool",
        "0",
    ]);
    let log = locker_tests::wait_for(Duration::from_secs(10), "the warning", || {
        let l = s.log_text();
        l.contains("WARN").then_some(l)
    });
    assert!(log.contains("locker template build default"), "{log}");
    let msg = s.api().post("/v1/sandboxes", &json!({})).expect_error(
        400,
        "bad_request",
        "create without default",
    );
    assert!(msg.contains("locker template build default"), "{msg}");
}

#[test]
fn a_template_is_removed_through_the_server_but_not_while_in_use() {
    let s = Server::start_with(&["--warm-pool", "0", "--vm-pool", "0"]);
    let api = s.api();
    let name = format!("rm-test-{}", std::process::id());
    // A second name of the default template: removing it must keep the files.
    let store = locker_runtime::template::TemplateStore::open(locker_tests::cache_dir()).unwrap();
    let def = store.resolve("default").unwrap().unwrap();
    let names = locker_tests::cache_dir().join("templates/names");
    std::fs::write(names.join(&name), format!("{}\n", def.digest)).unwrap();
    struct Unname(std::path::PathBuf);
    impl Drop for Unname {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _unname = Unname(names.join(&name));
    let id = api.create_sandbox(&json!({"template": name}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let cli = |args: &[&str]| {
        let mut c = Command::new(locker_tests::locker_bin());
        c.args(args)
            .env("LOCKER_URL", &s.url)
            .env("LOCKER_API_KEY", &s.api_key);
        output_of(c)
    };
    let out = cli(&["template", "rm", &name]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "removed while in use");
    assert!(err.contains(&format!("in use by sandbox {id}")), "{err}");
    let m = api
        .delete("/v1/templates/default")
        .expect_error(409, "conflict", "default");
    assert!(m.contains("rebuild it"), "{m}");
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete");
    let (other, _) = s.create_tenant("tpl-other");
    // Templates are per tenant: another tenant's is answered like a missing one.
    other.delete(&format!("/v1/templates/{name}")).expect_error(
        404,
        "not_found",
        "another tenant's template",
    );
    let out = cli(&["template", "rm", &name]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!names.join(&name).exists());
    assert!(
        store.resolve("default").unwrap().is_some(),
        "the files another name points at stay"
    );
    let m = api
        .delete(&format!("/v1/templates/{name}"))
        .expect_error(404, "not_found", "again");
    assert!(m.contains("template list"), "{m}");
}

#[test]
fn truncated_outputs_leave_a_bounded_number_of_files_in_the_machine() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api);
    let mut last = String::new();
    for _ in 0..40 {
        let r = api.exec(
            &id,
            &json!({"shell": "head -c 20000 /dev/zero | tr '\\0' x", "max_output_bytes": 100}),
        );
        assert_eq!(r["stdout_truncated"], true, "{r}");
        last = r["output_path"].as_str().unwrap().to_owned();
    }
    let n: usize = api
        .sh(&id, "ls /var/tmp/locker | grep -c '^call_' || true")
        .trim()
        .parse()
        .unwrap();
    assert!(n <= 32, "{n} spill files kept");
    // The newest is there, whole.
    let size = api.sh(&id, &format!("stat -c %s {last}"));
    assert_eq!(size.trim(), "20000");
}

/// A freshly booted host makes every move of a process into a cgroup wait an RCU grace
/// period after a quiet spell (8-20 ms here: every create, and every exec after a pause).
/// `locker serve` puts moves on the kernel's fast path at start (`favordynmods`, a named
/// cgroup v1 hierarchy it leaves mounted), and `locker doctor` says which path the host has.
#[test]
fn serve_puts_cgroup_moves_on_the_fast_path_and_doctor_says_so() {
    let _s = Server::start();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let favoring = info.lines().find(|l| {
        l.split_once(" - ").is_some_and(|(_, post)| {
            let mut f = post.split_whitespace();
            let fstype = f.next().unwrap_or("");
            let opts = f.nth(1).unwrap_or("");
            fstype.starts_with("cgroup") && opts.split(',').any(|o| o == "favordynmods")
        })
    });
    assert!(
        favoring.is_some(),
        "no cgroup mount with favordynmods after a server start:\n{info}"
    );
    let out = output_of({
        let mut c = Command::new(locker_tests::locker_bin());
        c.args(["doctor", "--json"]);
        c
    });
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["host"]["cgroup_moves"], "favored", "{v}");
    assert!(
        v["host"]["cgroup_moves_detail"]
            .as_str()
            .unwrap()
            .contains("favordynmods"),
        "{v}"
    );
}

/// A machine's shim is a fresh process per machine: the server starts it from the small
/// `locker-jail` of its own build (beside `locker`), not from the whole `locker`, and
/// `locker doctor` says which. The suite's build has both (`scripts/setup`).
#[test]
fn machines_start_from_the_small_shim_of_the_same_build_and_doctor_says_so() {
    let srv = Server::start();
    let api = srv.api();
    let id = sandbox(&api);
    assert_eq!(api.sh(&id, "echo up"), "up\n");
    let state: Value =
        serde_json::from_slice(&std::fs::read(srv.machine_dir(&id).join("state.json")).unwrap())
            .unwrap();
    let shim = state["shim_pid"].as_i64().unwrap();
    let exe = std::fs::read_link(format!("/proc/{shim}/exe")).unwrap();
    let beside = locker_tests::locker_bin().with_file_name("locker-jail");
    assert_eq!(exe, beside, "the machine's shim runs {exe:?}");
    let out = output_of({
        let mut c = Command::new(locker_tests::locker_bin());
        c.args(["doctor", "--json"]);
        c
    });
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let said = v["host"]["jail_shim"].as_str().unwrap();
    assert!(
        said.starts_with(beside.to_str().unwrap()) && said.contains("same build"),
        "{v}"
    );
}
