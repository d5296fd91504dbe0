//! Template builds over the API (issue 20, points 3 and 4; API.md "Templates (extended)"):
//! a Dockerfile `FROM default` with RUN, COPY from an uploaded context, ENV, WORKDIR,
//! USER, CMD and a ready command; a sandbox from it sees its environment, working
//! directory and user, and its start command serving; a rebuild after changing one line
//! reruns from that line only (the log says which steps were cached) and a fully cached
//! rebuild takes under a second; `?follow=true` streams logs, progress, then the result;
//! templates are per tenant; a template in use is not removed; at most two builds of a
//! tenant run at once; a restart fails the builds it interrupted; bad Dockerfiles,
//! hostile contexts and bad bodies are clear 4xx answers that leave nothing behind.
//!
//! Each test runs its server on a private template cache holding a hard-linked copy of
//! the host's `default` (so its step templates never reach the host's cache), removed at
//! the end.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use locker_tests::images::Cache;
use locker_tests::server::Api;
use serde_json::{json, Value};

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(locker_tests::unique(tag));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `dir` as a tar archive (GNU tar), entries relative to it.
fn tar_of(dir: &Path) -> Vec<u8> {
    let out = Command::new("tar")
        .args(["-cf", "-", "-C"])
        .arg(dir)
        .arg(".")
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout
}

/// An archive made by Python's tarfile from a script (for entries tar will not make).
fn crafted_tar(script: &str) -> Vec<u8> {
    let code = format!(
        "import io, sys, tarfile\nbuf = io.BytesIO()\nt = tarfile.open(fileobj=buf, mode='w')\n\
         def add(name, data=b'x', **kw):\n    i = tarfile.TarInfo(name)\n    \
         [setattr(i, k, v) for k, v in kw.items()]\n    i.size = len(data) if i.isreg() else 0\n    \
         t.addfile(i, io.BytesIO(data) if i.isreg() else None)\n\
         {script}\nt.close()\nsys.stdout.buffer.write(buf.getvalue())\n"
    );
    let out = Command::new("python3")
        .args(["-c", &code])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn upload_context(api: &Api, tar: Vec<u8>) -> String {
    let v = api
        .request(
            "POST",
            "/v1/templates/contexts",
            &[("Content-Type", "application/x-tar")],
            tar,
        )
        .expect(201, "upload a build context");
    v["context_id"].as_str().unwrap().to_string()
}

/// Starts a build (202) and returns its id.
fn start_build(api: &Api, body: &Value) -> String {
    let v = api.post("/v1/templates", body).expect(202, "start a build");
    let id = v["build_id"].as_str().unwrap().to_string();
    assert!(id.starts_with("tpl_"), "{v}");
    id
}

/// Follows a build to its end: every NDJSON event.
fn follow(api: &Api, id: &str) -> Vec<Value> {
    let (status, _, body) = api
        .with_timeout(Duration::from_secs(900))
        .open(
            "GET",
            &format!("/v1/templates/builds/{id}?follow=true"),
            &[],
            (),
        )
        .unwrap();
    assert_eq!(status, 200);
    BufReader::new(body)
        .lines()
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect()
}

fn logs(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["type"] == "log")
        .map(|e| e["line"].as_str().unwrap().to_string())
        .collect()
}

/// The result event, which must come last and say `succeeded`.
fn succeeded(events: &[Value]) -> Value {
    let last = events.last().expect("events");
    assert_eq!(last["type"], "result", "the last event is the result");
    assert_eq!(
        last["state"],
        "succeeded",
        "the build failed: {last}\n{}",
        logs(events).join("\n")
    );
    last["template"].clone()
}

/// The numbers of the steps the log says were cached.
fn cached_steps(events: &[Value]) -> Vec<usize> {
    logs(events)
        .iter()
        .filter(|l| l.ends_with(": cached"))
        .filter_map(|l| l.strip_prefix("step ")?.split('/').next()?.parse().ok())
        .collect()
}

fn ran_steps(events: &[Value]) -> Vec<usize> {
    logs(events)
        .iter()
        .filter(|l| l.ends_with(": running"))
        .filter_map(|l| l.strip_prefix("step ")?.split('/').next()?.parse().ok())
        .collect()
}

const DOCKERFILE: &str = r#"# a comment
FROM default
ARG GREETING=hello
RUN echo "$GREETING from the build" > /opt/greeting && \
    mkdir -p /srv
COPY app/ /srv/app/
ENV APP_MODE=test \
    APP_PORT=8123
WORKDIR /srv/app
RUN chown -R user:user /srv/app && echo one > /srv/app/built.txt
USER user
CMD ["/bin/sh", "-c", "exec python3 -m http.server $APP_PORT --bind 127.0.0.1"]
"#;

#[test]
fn dockerfile_build_sandbox_and_cache() {
    let cache = Cache::new();
    let srv = cache.server();
    let api = srv.api();
    let ctx_dir = tempdir("ctx");
    std::fs::create_dir_all(ctx_dir.join("app")).unwrap();
    std::fs::write(ctx_dir.join("app/hello.txt"), "hello from the context\n").unwrap();
    let ctx = upload_context(&api, tar_of(&ctx_dir));
    let body = |dockerfile: &str| {
        json!({
            "name": "web",
            "from": {"dockerfile": dockerfile, "context_id": ctx},
            "ready_cmd": "curl -sf http://127.0.0.1:8123/hello.txt >/dev/null",
        })
    };

    // The first build runs every step; the stream is logs and progress, then the result.
    let id = start_build(&api, &body(DOCKERFILE));
    let events = follow(&api, &id);
    let t = succeeded(&events);
    assert!(events
        .iter()
        .any(|e| e["type"] == "progress" && e["steps"] == 9));
    assert_eq!(ran_steps(&events), vec![3, 4, 7], "{:#?}", logs(&events));
    assert_eq!(t["name"], "web");
    assert_eq!(t["workdir"], "/srv/app");
    assert_eq!(t["user"], "user");
    assert_eq!(t["env"]["APP_MODE"], "test");
    let got = api
        .get(&format!("/v1/templates/builds/{id}"))
        .expect(200, "build state");
    assert_eq!(got["state"], "succeeded");
    assert_eq!(
        api.get("/v1/templates/web").expect(200, "get")["digest"],
        t["digest"]
    );

    // A sandbox from it: env, workdir, user, and the start command serving (the create
    // answered only once the ready command succeeded).
    let sb = api.create_sandbox(&json!({"template": "web"}));
    let sb = sb["id"].as_str().unwrap().to_string();
    let out = api.sh(
        &sb,
        "echo \"$APP_MODE $(id -un) $(pwd)\"; cat /opt/greeting built.txt",
    );
    assert_eq!(
        out, "test user /srv/app\nhello from the build\none\n",
        "env, user, workdir and the build's files"
    );
    let served = api.sh(&sb, "curl -sf http://127.0.0.1:8123/hello.txt");
    assert_eq!(served, "hello from the context\n");
    // An exec that names its own cwd and user still gets them.
    let r = api.exec(
        &sb,
        &json!({"shell": "id -un; pwd", "cwd": "/tmp", "user": "root"}),
    );
    assert_eq!(r["stdout"], "root\n/tmp\n");

    // In use: not removed.
    api.delete("/v1/templates/web")
        .expect_error(409, "conflict", "delete a template in use");

    // One changed line reruns from that line only.
    let changed = DOCKERFILE.replace("echo one >", "echo two >");
    let events = follow(&api, &start_build(&api, &body(&changed)));
    succeeded(&events);
    assert_eq!(cached_steps(&events), vec![3, 4], "{:#?}", logs(&events));
    assert_eq!(ran_steps(&events), vec![7], "{:#?}", logs(&events));

    // A fully cached rebuild: under a second from the POST to the result.
    let t0 = Instant::now();
    let events = follow(&api, &start_build(&api, &body(&changed)));
    let took = t0.elapsed();
    succeeded(&events);
    assert_eq!(cached_steps(&events), vec![3, 4, 7], "{:#?}", logs(&events));
    assert!(ran_steps(&events).is_empty());
    eprintln!("fully cached rebuild: {:.3} s", took.as_secs_f64());
    assert!(
        took < Duration::from_secs(1),
        "a cached rebuild took {took:?}"
    );

    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the sandbox");
    assert_eq!(api.delete("/v1/templates/web").status, 204);
    api.get("/v1/templates/web")
        .expect_error(404, "not_found", "removed");
    let _ = std::fs::remove_dir_all(&ctx_dir);
}

#[test]
fn bad_inputs_are_clear_4xx_and_leave_nothing() {
    let cache = Cache::new();
    let srv = cache.server();
    let api = srv.api();
    let before = cache.templates();
    let df = |text: &str| json!({"name": "bad", "from": {"dockerfile": text}});

    let m = api
        .post(
            "/v1/templates",
            &df("FROM default\nRUN true\n\nHEALTHCHECK CMD true\n"),
        )
        .expect_error(400, "bad_request", "an unsupported instruction");
    assert!(m.contains("line 4") && m.contains("HEALTHCHECK"), "{m}");
    let m = api
        .post(
            "/v1/templates",
            &df("FROM default\nRUN true \\\n  && true\nFROBNICATE\n"),
        )
        .expect_error(400, "bad_request", "an unknown instruction");
    assert!(m.contains("line 4") && m.contains("FROBNICATE"), "{m}");
    let m = api
        .post("/v1/templates", &df("FROM default\nCOPY a /a\n"))
        .expect_error(400, "bad_request", "COPY without a context");
    assert!(m.contains("line 2") && m.contains("context"), "{m}");
    let m = api
        .post(
            "/v1/templates",
            &df("FROM default\nADD https://example.com/x /x\n"),
        )
        .expect_error(400, "bad_request", "ADD from a URL");
    assert!(m.contains("URL"), "{m}");
    let m = api
        .post(
            "/v1/templates",
            &json!({"name": "bad", "from": {"dockerfile": "FROM default\nCOPY a /a\n", "context_id": "ctx_nope"}}),
        )
        .expect_error(404, "not_found", "an unknown context");
    assert!(m.contains("ctx_nope"), "{m}");
    let m = api
        .request(
            "POST",
            "/v1/templates",
            &[("Content-Type", "application/json")],
            &b"{\"name\": \"bad\", \"from\": "[..],
        )
        .expect_error(400, "bad_request", "bad JSON");
    assert!(m.contains("JSON"), "{m}");
    api.post(
        "/v1/templates",
        &json!({"name": "bad", "from": {"template": "default", "image": "x"}}),
    )
    .expect_error(400, "bad_request", "two sources");
    api.post(
        "/v1/templates",
        &json!({"name": "Bad Name", "from": {"template": "default"}}),
    )
    .expect_error(400, "bad_request", "a bad name");
    api.post(
        "/v1/templates",
        &json!({"name": "default", "from": {"template": "default"}}),
    )
    .expect_error(409, "conflict", "a shared name");
    api.post(
        "/v1/templates",
        &json!({"name": "x", "from": {"template": "default"}, "packages": ["jq"]}),
    )
    .expect_error(400, "bad_request", "packages without a network");

    // COPY of a path outside the context: refused before any build.
    let ctx_dir = tempdir("ctx-bad");
    std::fs::write(ctx_dir.join("ok.txt"), "ok").unwrap();
    let ctx = upload_context(&api, tar_of(&ctx_dir));
    for src in ["../../../etc/passwd", "/etc/passwd", "missing.txt"] {
        let m = api
            .post(
                "/v1/templates",
                &json!({"name": "bad", "from": {"dockerfile": format!("FROM default\nCOPY {src} /x\n"), "context_id": ctx}}),
            )
            .expect_error(400, "bad_request", "COPY out of the context");
        assert!(m.contains("line 2"), "{m}");
    }

    // Hostile contexts: refused, nothing kept.
    let hostile = [
        ("a ../ path", "add('../evil')"),
        ("an absolute path", "add('/etc/evil')"),
        (
            "a file through a symlink",
            "add('link', type=tarfile.SYMTYPE, linkname='/tmp')\nadd('link/evil')",
        ),
        (
            "a device node",
            "add('dev', type=tarfile.CHRTYPE, devmajor=1, devminor=3)",
        ),
        (
            "a hard link out",
            "add('h', type=tarfile.LNKTYPE, linkname='../../etc/passwd')",
        ),
    ];
    for (what, script) in hostile {
        let r = api.request(
            "POST",
            "/v1/templates/contexts",
            &[("Content-Type", "application/x-tar")],
            crafted_tar(script),
        );
        r.expect_error(400, "bad_request", what);
    }
    assert!(!Path::new("/tmp/evil").exists() && !Path::new("/etc/evil").exists());
    // A context over the limit: 413, and nothing kept.
    let huge = vec![0u8; (256 << 20) + 4096];
    api.request(
        "POST",
        "/v1/templates/contexts",
        &[("Content-Type", "application/x-tar")],
        huge,
    )
    .expect_error(413, "payload_too_large", "a huge context");
    let kept: Vec<_> = std::fs::read_dir(srv.data_dir.join("template-contexts"))
        .unwrap()
        .flat_map(|t| std::fs::read_dir(t.unwrap().path()).unwrap())
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(kept, vec![ctx.clone()], "only the good context is kept");
    assert_eq!(cache.templates(), before, "no template was made");

    // A RUN that fails: the build fails naming its line, and no template appears.
    let id = start_build(
        &api,
        &json!({"name": "fails", "from": {"dockerfile": "FROM default\nRUN echo before; exit 3\n"}}),
    );
    let events = follow(&api, &id);
    let last = events.last().unwrap();
    assert_eq!(last["state"], "failed", "{last}");
    let err = last["error"].as_str().unwrap();
    assert!(err.contains("line 2") && err.contains("code 3"), "{err}");
    assert!(logs(&events).iter().any(|l| l == "before"));
    api.get("/v1/templates/fails")
        .expect_error(404, "not_found", "no template");
    assert_eq!(cache.templates(), before, "no half-made template");
    let _ = std::fs::remove_dir_all(&ctx_dir);
}

#[test]
fn tenants_limits_and_restart() {
    let cache = Cache::new();
    let mut srv = cache.server();
    let api = srv.api();
    let (b, _) = srv.create_tenant(&locker_tests::unique("team"));
    let build = |api: &Api, name: &str, run: &str| {
        start_build(
            api,
            &json!({"name": name, "from": {"template": "default"}, "run": [run], "env": {"WHO": name}}),
        )
    };
    // The same name in two tenants: two templates, each seen only by its tenant.
    let a1 = build(&api, "mine", "echo a > /who");
    let b1 = build(&b, "mine", "echo b > /who");
    succeeded(&follow(&api, &a1));
    succeeded(&follow(&b, &b1));
    b.get(&format!("/v1/templates/builds/{a1}")).expect_error(
        404,
        "not_found",
        "another tenant's build",
    );
    let names = |api: &Api| -> Vec<String> {
        api.get("/v1/templates").expect(200, "list")["templates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(names(&b).contains(&"mine".to_string()) && names(&b).contains(&"default".to_string()));
    assert!(
        !names(&b).iter().any(|n| n.contains('.')),
        "{:?}",
        names(&b)
    );
    let sa = api.create_sandbox(&json!({"template": "mine"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let sb = b.create_sandbox(&json!({"template": "mine"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(api.sh(&sa, "cat /who; echo $WHO"), "a\nmine\n");
    assert_eq!(b.sh(&sb, "cat /who"), "b\n");
    b.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete");
    assert_eq!(b.delete("/v1/templates/mine").status, 204);
    b.get("/v1/templates/mine")
        .expect_error(404, "not_found", "b's is gone");
    api.get("/v1/templates/mine").expect(200, "a's stays");
    b.delete("/v1/templates/code-interpreter")
        .expect_error(403, "forbidden", "a shared one");
    api.delete(&format!("/v1/sandboxes/{sa}"))
        .expect(204, "delete");

    // Two builds of a tenant at once; the third waits, queued.
    let ids: Vec<String> = (0..3)
        .map(|i| build(&api, &format!("slow{i}"), &format!("sleep 4; echo {i}")))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let states = loop {
        let s: Vec<String> = ids
            .iter()
            .map(|id| {
                api.get(&format!("/v1/templates/builds/{id}"))
                    .expect(200, "state")["state"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        if s.iter().filter(|x| *x == "running").count() == 2 || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        states.iter().filter(|x| *x == "running").count(),
        2,
        "{states:?}"
    );
    assert_eq!(
        states.iter().filter(|x| *x == "queued").count(),
        1,
        "{states:?}"
    );
    for id in &ids {
        succeeded(&follow(&api, id));
    }

    // A restart fails the build it interrupted, and says why.
    let id = build(&api, "cut", "sleep 60");
    let deadline = Instant::now() + Duration::from_secs(30);
    while api
        .get(&format!("/v1/templates/builds/{id}"))
        .expect(200, "state")["state"]
        != "running"
    {
        assert!(Instant::now() < deadline, "the build never ran");
        std::thread::sleep(Duration::from_millis(100));
    }
    srv.kill9();
    srv.restart();
    let api = srv.api();
    let v = api
        .get(&format!("/v1/templates/builds/{id}"))
        .expect(200, "after the restart");
    assert_eq!(v["state"], "failed", "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("server stopped"),
        "{v}"
    );
    let events = follow(&api, &id);
    assert_eq!(events.last().unwrap()["state"], "failed");
}

#[test]
fn python_sdk_builds_lists_and_deletes() {
    let cache = Cache::new();
    let srv = cache.server();
    let ctx = tempdir("py-ctx");
    std::fs::write(ctx.join("data.txt"), "from python\n").unwrap();
    let script = format!(
        r#"
import locker, sys
c = locker.Client({url:?}, {key:?})
seen = []
t = c.templates.build("pyt", dockerfile="FROM default\nCOPY data.txt /data.txt\nENV FROM_SDK=1\n",
                      context={ctx:?}, on_event=seen.append)
assert t["name"] == "pyt" and t["env"]["FROM_SDK"] == "1", t
assert any(e["type"] == "log" for e in seen) and any(e["type"] == "progress" for e in seen), seen
assert "pyt" in [x["name"] for x in c.templates.list()]
assert c.templates.get("pyt")["digest"] == t["digest"]
sb = c.sandboxes.create(template="pyt")
r = sb.exec(shell="cat /data.txt; echo $FROM_SDK")
assert r.stdout == "from python\n1\n", r
sb.delete()
try:
    c.templates.build("pyt2", dockerfile="FROM default\nRUN exit 7\n")
    sys.exit("a failing build did not raise")
except locker.BuildFailed as e:
    assert "code 7" in e.error, e.error
c.templates.delete("pyt")
try:
    c.templates.get("pyt")
    sys.exit("a deleted template is still there")
except locker.LockerError as e:
    assert e.status == 404
print("ok")
"#,
        url = srv.url,
        key = srv.api_key,
        ctx = ctx.to_str().unwrap(),
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .env("PYTHONPATH", locker_tests::root().join("sdk/python/src"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
    let _ = std::fs::remove_dir_all(&ctx);
}

/// A Dockerfile `FROM` an image in a loopback registry behind basic auth (issue 20's "a
/// Dockerfile build FROM that image"): RUN, COPY, ENV, WORKDIR and USER on the image's
/// busybox; the image's own config (its environment) under the Dockerfile's; refused
/// without the credentials; a sandbox from the result; a fully cached rebuild.
#[test]
fn dockerfile_from_a_registry_image() {
    use locker_tests::images::{make_image, skopeo_copy, Registry};
    let dir = locker_tests::TempDir::new("locker-df-image");
    let image = make_image(dir.path());
    let reg = Registry::start(&dir.path().join("reg"), Some(("builder", "s3cret")));
    let reference = format!("{}/private/busybox:1", reg.host);
    skopeo_copy(
        &format!("oci:{image}"),
        &format!("docker://{reference}"),
        &["--dest-creds", "builder:s3cret"],
    );
    let cache = Cache::new();
    let srv = cache.server_with_env(&[("LOCKER_PLAIN_HTTP_REGISTRIES", reg.host.as_str())]);
    let api = srv.api();
    let ctx_dir = tempdir("ctx-image");
    std::fs::create_dir_all(ctx_dir.join("app")).unwrap();
    std::fs::write(ctx_dir.join("app/hello.txt"), "hello from the context\n").unwrap();
    let ctx = upload_context(&api, tar_of(&ctx_dir));
    let dockerfile = format!(
        "FROM {reference}\n\
         RUN echo \"built on $GREETING\" > /built.txt\n\
         COPY app/ /srv/app/\n\
         ENV MODE=image\n\
         WORKDIR /srv/work\n\
         RUN chown -R 1000:1000 /srv/work /srv/app /home/app && echo $MODE > mode.txt\n\
         USER app\n\
         RUN id -u > /srv/work/uid.txt && touch /home/app/as-app\n"
    );
    let body = |auth: bool| {
        let mut from = json!({"dockerfile": dockerfile, "context_id": ctx});
        if auth {
            from["auth"] = json!({"username": "builder", "password": "s3cret"});
        }
        json!({"name": "from-image", "from": from})
    };

    // Without the credentials the pull is refused and the build fails saying so.
    let events = follow(&api, &start_build(&api, &body(false)));
    let last = events.last().unwrap();
    assert_eq!(last["state"], "failed", "{last}");
    let err = last["error"].as_str().unwrap();
    assert!(err.contains("registry"), "{err}");
    api.get("/v1/templates/from-image")
        .expect_error(404, "not_found", "no template without auth");

    let events = follow(&api, &start_build(&api, &body(true)));
    let t = succeeded(&events);
    assert_eq!(ran_steps(&events), vec![2, 3, 5, 6, 8], "{:#?}", logs(&events));
    assert_eq!(t["workdir"], "/srv/work", "{t}");
    assert_eq!(t["user"], "app", "{t}");
    assert_eq!(t["env"]["MODE"], "image", "{t}");
    assert_eq!(t["env"]["GREETING"], "hello-from-config", "the image's env: {t}");

    let sb = api.create_sandbox(&json!({"template": "from-image"}));
    let sb = sb["id"].as_str().unwrap().to_string();
    let out = api.sh(
        &sb,
        "cat /built.txt mode.txt uid.txt /srv/app/hello.txt; pwd; id -u; echo $MODE; ls /home/app",
    );
    assert_eq!(
        out,
        "built on hello-from-config\nimage\n1000\nhello from the context\n/srv/work\n1000\nimage\nas-app\n",
        "the image's files and config, the Dockerfile's steps"
    );
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the sandbox");

    // A fully cached rebuild: the image is only resolved again (its manifest and config),
    // every step is found.
    let t0 = Instant::now();
    let events = follow(&api, &start_build(&api, &body(true)));
    let took = t0.elapsed();
    let again = succeeded(&events);
    assert_eq!(again["digest"], t["digest"]);
    assert_eq!(
        cached_steps(&events),
        vec![2, 3, 5, 6, 8],
        "{:#?}",
        logs(&events)
    );
    eprintln!("fully cached rebuild from a registry image: {:.3} s", took.as_secs_f64());
    assert!(
        took < Duration::from_secs(2),
        "a cached rebuild took {took:?}"
    );
    let _ = std::fs::remove_dir_all(&ctx_dir);
}

/// A sandbox of a template with a ready command reads `starting`, and takes no calls,
/// until the command succeeds (API.md: states starting/running/…); one whose ready command
/// never succeeds within the server's ready timeout fails its create with a 422 that
/// names the command and its last output, and leaves no machine, no record in the list
/// and nothing on the host.
#[test]
fn a_sandbox_is_starting_until_its_ready_command_succeeds() {
    let cache = Cache::new();
    let srv = cache.server_with_env(&[("LOCKER_READY_TIMEOUT_S", "5")]);
    let api = srv.api();
    let build = |name: &str, start: &str, ready: &str| {
        succeeded(&follow(
            &api,
            &start_build(
                &api,
                &json!({"name": name, "from": {"template": "default"},
                        "start_cmd": start, "ready_cmd": ready}),
            ),
        ));
    };
    build(
        "slow-ready",
        "sleep 3; touch /tmp/ready; exec sleep 1000",
        "test -f /tmp/ready",
    );
    build("never-ready", "exec sleep 1000", "echo not yet; exit 1");

    let creating = {
        let api = api.clone();
        std::thread::spawn(move || {
            api.post("/v1/sandboxes", &json!({"template": "slow-ready"}))
                .expect(201, "create a sandbox that gets ready")
        })
    };
    let seen = locker_tests::wait_for(Duration::from_secs(60), "the sandbox listed", || {
        api.get("/v1/sandboxes").expect(200, "list")["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["template"] == "slow-ready")
            .cloned()
    });
    let id = seen["id"].as_str().unwrap().to_string();
    assert_eq!(seen["state"], "starting", "listed while not ready: {seen}");
    let got = api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get");
    if !creating.is_finished() {
        assert_eq!(got["state"], "starting", "{got}");
        let m = api
            .post(
                &format!("/v1/sandboxes/{id}/exec"),
                &json!({"shell": "true"}),
            )
            .expect_error(409, "conflict", "a call while starting");
        assert!(m.contains("starting"), "{m}");
    }
    let created = creating.join().unwrap();
    assert_eq!(created["id"], id.as_str());
    assert_eq!(created["state"], "running", "{created}");
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}")).expect(200, "get")["state"],
        "running"
    );
    assert_eq!(api.sh(&id, "ls /tmp/ready"), "/tmp/ready\n");
    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete");

    // Never ready: the create fails after the timeout and leaves nothing.
    let machines = |srv: &locker_tests::server::Server| -> Vec<String> {
        std::fs::read_dir(srv.data_dir.join("sandboxes"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let before = machines(&srv);
    let t0 = Instant::now();
    let m = api
        .post("/v1/sandboxes", &json!({"template": "never-ready"}))
        .expect_error(422, "unprocessable", "a sandbox that never gets ready");
    let took = t0.elapsed();
    assert!(
        m.contains("ready command") && m.contains("not yet") && m.contains("5 s"),
        "{m}"
    );
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(40),
        "{took:?}"
    );
    let listed = api.get("/v1/sandboxes").expect(200, "list");
    assert!(
        !listed["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["template"] == "never-ready"),
        "{listed}"
    );
    assert_eq!(machines(&srv), before, "no machine directory left");
    let id = m
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .find(|w| w.starts_with("sb_"))
        .unwrap_or_else(|| panic!("the message names the sandbox: {m}"))
        .to_string();
    let traces = locker_tests::traces_of(&id, &srv.data_dir.join("sandboxes").join(&id));
    assert!(traces.is_empty(), "{id}: {traces:?}");
    let gone = api
        .post(&format!("/v1/sandboxes/{id}/exec"), &json!({"shell": "true"}))
        .expect_error(404, "not_found", "the failed sandbox is gone");
    assert!(gone.contains("ready command"), "{gone}");
}

/// The step cache is bounded (`LOCKER_STEP_CACHE_MAX_COUNT` 0 here: keep no step nothing
/// needs), but never loses a step of a named template (its rebuild stays cached) nor one a
/// sandbox stands on, with its parents; what a failed build or a replaced version left goes
/// once nothing uses it.
#[test]
fn the_step_cache_is_pruned_but_never_what_is_named_or_in_use() {
    let cache = Cache::new();
    let srv = cache.server_with_env(&[("LOCKER_STEP_CACHE_MAX_COUNT", "0")]);
    let api = srv.api();
    let df = |first: &str| {
        json!({"name": "keep", "from": {"dockerfile":
            format!("FROM default\nRUN echo {first} > /a\nRUN echo 2 > /b\n")}})
    };
    let base = cache.digests();
    let without = |all: &[String], gone: &[String]| -> Vec<String> {
        all.iter().filter(|d| !gone.contains(d)).cloned().collect()
    };
    let v1 = succeeded(&follow(&api, &start_build(&api, &df("1"))));
    let v1_steps = without(&cache.digests(), &base);
    assert_eq!(v1_steps.len(), 2, "two RUN steps: {v1_steps:?}");
    assert!(v1_steps.contains(&v1["digest"].as_str().unwrap().to_string()));
    let sb = api.create_sandbox(&json!({"template": "keep"}))["id"]
        .as_str()
        .unwrap()
        .to_string();

    // A new version: the old one is nameless now, but a sandbox stands on it.
    let v2 = succeeded(&follow(&api, &start_build(&api, &df("X"))));
    assert_ne!(v2["digest"], v1["digest"]);
    let now = cache.digests();
    let v2_steps = without(&now, &[base.clone(), v1_steps.clone()].concat());
    assert_eq!(v2_steps.len(), 2, "{now:?}");
    for d in &v1_steps {
        assert!(now.contains(d), "a step the sandbox stands on was pruned");
    }
    assert_eq!(api.sh(&sb, "cat /a /b"), "1\n2\n");
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete the sandbox");

    // A failed build leaves a step nothing needs: it goes when the build ends, and so do
    // the old version's steps, no longer used.
    let events = follow(
        &api,
        &start_build(
            &api,
            &json!({"name": "broken", "from": {"dockerfile": "FROM default\nRUN echo ok > /ok\nRUN exit 1\n"}}),
        ),
    );
    assert_eq!(events.last().unwrap()["state"], "failed");
    let mut want = [base.clone(), v2_steps.clone()].concat();
    want.sort();
    let deadline = Instant::now() + Duration::from_secs(20);
    while cache.digests() != want {
        assert!(
            Instant::now() < deadline,
            "the step cache was not pruned: {:?}, want {want:?} (v1 {v1_steps:?}, v2 {v2_steps:?})\n{}",
            cache.digests(),
            srv.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The named template's steps were kept: its rebuild is fully cached.
    let events = follow(&api, &start_build(&api, &df("X")));
    succeeded(&events);
    assert_eq!(cached_steps(&events), vec![2, 3], "{:#?}", logs(&events));
    assert_eq!(cache.digests(), want);
}
