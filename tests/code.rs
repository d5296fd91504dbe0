//! The code interpreter through the real server (issue 18, API.md "Code contexts"): real
//! Jupyter kernels in real jails of the `code-interpreter` template, in each of its
//! languages (Python, JavaScript, TypeScript, bash, R, Java). State and imports
//! persist, charts come back as PNG and DataFrames as HTML, exceptions as errors with
//! their traceback; a timeout interrupts and keeps the state, restart clears it, a kernel
//! that dies is reported and replaced, floods are capped, other sandboxes' and tenants'
//! contexts are 404, and user code that kills the driver breaks neither the sandbox nor the
//! server. Every test runs on the binary's shared server with a tenant of its own, whose
//! sandboxes are deleted when the test ends, passed or failed.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use locker_tests::server::Api;
use locker_tests::shared::Tenant;
use locker_tests::{locker_bin, register_child};
use serde_json::{json, Value};

/// Builds the `code-interpreter` template once per host (a no-op when it is cached).
fn template() {
    locker_tests::code_interpreter_template();
}

/// A tenant with one sandbox of the `code-interpreter` template.
fn code_sandbox() -> (Tenant, Api, String) {
    template();
    let t = Tenant::new();
    let api = t.api();
    let id = t.sandbox(&json!({ "template": "code-interpreter" }));
    (t, api, id)
}

fn new_context(api: &Api, id: &str, body: &Value) -> String {
    let c = api
        .post(&format!("/v1/sandboxes/{id}/contexts"), body)
        .expect(201, "create a context");
    assert!(c["id"].as_str().unwrap().starts_with("ctx_"), "{c}");
    assert!(c["created_at"].as_str().unwrap().ends_with('Z'), "{c}");
    c["id"].as_str().unwrap().to_owned()
}

#[track_caller]
fn run(api: &Api, id: &str, body: &Value) -> Value {
    api.post(&format!("/v1/sandboxes/{id}/code"), body)
        .expect(200, &format!("run {body}"))
}

#[track_caller]
fn run_in(api: &Api, id: &str, ctx: &str, code: &str) -> Value {
    run(api, id, &json!({ "context": ctx, "code": code }))
}

#[test]
fn state_and_imports_persist_between_cells_of_a_context() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({ "language": "python" }));
    let a = run_in(&api, &id, &ctx, "import math\nx = 41");
    assert_eq!(a["reason"], "finished", "{a}");
    assert_eq!(a["error"], Value::Null, "{a}");
    let b = run_in(&api, &id, &ctx, "print(math.sqrt(16))\nx + 1");
    assert_eq!(b["stdout"], "4.0\n", "{b}");
    assert_eq!(b["results"][0]["is_main_result"], true, "{b}");
    assert_eq!(b["results"][0]["text"], "42", "{b}");
    assert!(
        b["execution_count"].as_i64().unwrap() > a["execution_count"].as_i64().unwrap(),
        "execution counts grow: {a} {b}"
    );
    assert!(b["timings"]["total_ms"].as_f64().unwrap() > 0.0, "{b}");

    // No context: the sandbox's default Python context, made on first use and kept.
    run(&api, &id, &json!({ "code": "y = 'kept'" }));
    let c = run(&api, &id, &json!({ "code": "y" }));
    assert_eq!(c["results"][0]["text"], "'kept'", "{c}");
    let other = run_in(&api, &id, &ctx, "'y' in globals()");
    assert_eq!(
        other["results"][0]["text"], "False",
        "contexts are apart: {other}"
    );

    let list = api
        .get(&format!("/v1/sandboxes/{id}/contexts"))
        .expect(200, "list contexts");
    let ids: Vec<&str> = list["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&ctx.as_str()), "{list}");
    assert!(ids.contains(&"ctx_default_python"), "{list}");
}

#[test]
fn a_context_has_its_working_directory_and_environment() {
    let (_t, api, id) = code_sandbox();
    api.sh(&id, "mkdir -p /srv/work");
    let ctx = new_context(
        &api,
        &id,
        &json!({ "cwd": "/srv/work", "env": { "GREETING": "hello" } }),
    );
    let r = run_in(
        &api,
        &id,
        &ctx,
        "import os\nprint(os.getcwd(), os.environ['GREETING'])",
    );
    assert_eq!(r["stdout"], "/srv/work hello\n", "{r}");
    // A cell's own env is set for that cell only.
    let r = run(
        &api,
        &id,
        &json!({ "context": ctx, "code": "print(os.environ.get('ONCE'))", "env": { "ONCE": "1" } }),
    );
    assert_eq!(r["stdout"], "1\n", "{r}");
    let r = run_in(&api, &id, &ctx, "print(os.environ.get('ONCE'))");
    assert_eq!(r["stdout"], "None\n", "{r}");
    let bad = api.post(
        &format!("/v1/sandboxes/{id}/contexts"),
        &json!({ "cwd": "/no/such/dir" }),
    );
    bad.expect_error(400, "bad_request", "a cwd that does not exist");
}

/// Base64 of a PNG: its signature, a non-empty IHDR and IEND at the end.
fn png_size(b64: &str) -> (u32, u32, Vec<u8>) {
    let bytes = locker_types::base64::decode(b64).expect("the png is base64");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR");
    let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!(&bytes[bytes.len() - 8..bytes.len() - 4], b"IEND");
    (w, h, bytes)
}

#[test]
fn a_chart_comes_back_as_a_decodable_png_and_a_dataframe_as_html() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    let shown = run_in(
        &api,
        &id,
        &ctx,
        "import matplotlib.pyplot as plt\nplt.plot(range(100))\nplt.show()",
    );
    assert_eq!(shown["reason"], "finished", "{shown}");
    let pngs: Vec<&Value> = shown["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["png"].is_string())
        .collect();
    assert_eq!(pngs.len(), 1, "plt.show() gives one PNG: {shown}");
    let (w, h, bytes) = png_size(pngs[0]["png"].as_str().unwrap());
    assert!(w > 100 && h > 100, "{w}x{h}");
    // Beside it, the chart's data in E2B's schema (Locker's display extensions).
    let chart = &pngs[0]["chart"];
    assert_eq!(chart["type"], "line", "{chart}");
    let points = chart["elements"][0]["points"].as_array().unwrap();
    assert_eq!(points.len(), 100, "{chart}");
    assert_eq!(points[99], json!([99.0, 99.0]), "{chart}");

    // A figure left at the end of a cell comes back too.
    let left = run_in(
        &api,
        &id,
        &ctx,
        "fig, ax = plt.subplots()\nax.bar([1, 2], [3, 4])",
    );
    assert!(
        left["results"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["png"].is_string()),
        "a figure left at the end: {left}"
    );

    // The PNG decodes: Pillow in another context opens every pixel of the bytes we got.
    let put = api.write_file(&id, "/tmp/chart.png", &bytes);
    assert!(put.status < 300, "write the png back: {}", put.text());
    let check = run(
        &api,
        &id,
        &json!({ "code": "from PIL import Image\nim = Image.open('/tmp/chart.png')\nim.load()\nprint(im.format, im.size)" }),
    );
    assert_eq!(check["stdout"], format!("PNG ({w}, {h})\n"), "{check}");

    let df = run_in(
        &api,
        &id,
        &ctx,
        "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})",
    );
    let main = &df["results"][0];
    assert_eq!(main["is_main_result"], true, "{df}");
    assert!(main["html"].as_str().unwrap().contains("<table"), "{df}");
    assert!(main["text"].as_str().unwrap().contains('a'), "{df}");
    assert_eq!(main["data"], json!({"a": [1, 2], "b": ["x", "y"]}), "{df}");
    // The extensions leave nothing in the user's namespace and nothing on plain values.
    let clean = run_in(&api, &id, &ctx, "[n for n in globals() if 'locker' in n]");
    assert_eq!(clean["results"][0]["text"], "[]", "{clean}");
    let plain = run_in(&api, &id, &ctx, "1 + 1");
    assert_eq!(plain["results"][0], json!({"is_main_result": true, "text": "2"}), "{plain}");
    // PIL's Image.save(path) also shows the image.
    let saved = run_in(
        &api,
        &id,
        &ctx,
        "from PIL import Image\nImage.new('RGB', (8, 8), 'red').save('/tmp/red.png')",
    );
    assert!(saved["results"][0]["png"].is_string(), "{saved}");

    let rich = run_in(
        &api,
        &id,
        &ctx,
        "from IPython.display import display, Markdown, Latex, JSON, SVG\n\
         display(Markdown('**hi**'))\ndisplay(Latex(r'$x^2$'))\ndisplay(JSON({'k': 1}))\n\
         display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"1\" height=\"1\"></svg>'))",
    );
    let r = rich["results"].as_array().unwrap();
    assert_eq!(r.len(), 4, "{rich}");
    assert_eq!(r[0]["markdown"], "**hi**", "{rich}");
    assert_eq!(r[1]["latex"], "$x^2$", "{rich}");
    assert_eq!(r[2]["json"]["k"], 1, "{rich}");
    assert!(r[3]["svg"].as_str().unwrap().contains("<svg"), "{rich}");
    assert!(r.iter().all(|x| x["is_main_result"] == false), "{rich}");
}

#[test]
fn an_exception_is_an_error_with_its_traceback() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    let r = run_in(&api, &id, &ctx, "def f():\n    1 / 0\nprint('before')\nf()");
    assert_eq!(r["reason"], "error", "{r}");
    assert_eq!(r["stdout"], "before\n", "{r}");
    assert_eq!(r["error"]["name"], "ZeroDivisionError", "{r}");
    assert_eq!(r["error"]["value"], "division by zero", "{r}");
    let tb = r["error"]["traceback"].as_str().unwrap();
    assert!(tb.contains("f()") && tb.contains("1 / 0"), "{tb}");
    assert!(!tb.contains('\u{1b}'), "no terminal colours: {tb:?}");

    let syntax = run_in(&api, &id, &ctx, "def (:");
    assert_eq!(syntax["error"]["name"], "SyntaxError", "{syntax}");
    // sys.exit() is an exception in a kernel: the context lives on.
    let exit = run_in(&api, &id, &ctx, "import sys\nz = 5\nsys.exit(3)");
    assert_eq!(exit["error"]["name"], "SystemExit", "{exit}");
    let after = run_in(&api, &id, &ctx, "z");
    assert_eq!(after["results"][0]["text"], "5", "{after}");
}

#[test]
fn a_timeout_interrupts_the_kernel_and_the_next_cell_sees_earlier_variables() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    run_in(&api, &id, &ctx, "kept = 'yes'");
    let started = Instant::now();
    let r = run(
        &api,
        &id,
        &json!({ "context": ctx, "code": "import time\nprint('start', flush=True)\nwhile True: time.sleep(0.1)", "timeout_ms": 1500 }),
    );
    let took = started.elapsed();
    assert_eq!(r["reason"], "timeout", "{r}");
    assert_eq!(r["stdout"], "start\n", "{r}");
    assert!(r["error"]["name"].is_string(), "{r}");
    assert!(
        took < Duration::from_secs(10),
        "interrupted promptly: {took:?}"
    );
    let next = run_in(&api, &id, &ctx, "kept");
    assert_eq!(next["results"][0]["text"], "'yes'", "{next}");

    // An explicit interrupt stops a running cell the same way.
    let (api2, id2, ctx2) = (api.clone(), id.clone(), ctx.clone());
    let long = std::thread::spawn(move || {
        run(
            &api2,
            &id2,
            &json!({ "context": ctx2, "code": "import time\ntime.sleep(60)" }),
        )
    });
    std::thread::sleep(Duration::from_secs(2));
    let i = api
        .post_empty(&format!("/v1/sandboxes/{id}/contexts/{ctx}/interrupt"))
        .expect(200, "interrupt");
    assert_eq!(i["interrupted"], true, "{i}");
    let r = long.join().unwrap();
    assert_eq!(r["reason"], "interrupted", "{r}");
    assert_eq!(r["error"]["name"], "KeyboardInterrupt", "{r}");
    let next = run_in(&api, &id, &ctx, "kept");
    assert_eq!(next["results"][0]["text"], "'yes'", "{next}");
}

/// One language of the `code-interpreter` template as the next test drives it.
struct Language {
    name: &'static str,
    /// Sets `x` to 41.
    set: &'static str,
    /// Shows `x + 1`, as (`text` of the first result | `stdout`, what it is).
    get: (&'static str, &'static str, &'static str),
    /// Prints `hi` and a newline.
    print: &'static str,
    /// Fails, with this error name.
    fail: (&'static str, &'static str),
    /// Never ends by itself.
    busy: &'static str,
    /// Shows the cell's variable CELL_VAR, as `get`.
    env: (&'static str, &'static str, &'static str),
}

const LANGUAGES: &[Language] = &[
    Language {
        name: "javascript",
        set: "let x = 41",
        get: ("x + 1", "text", "42"),
        print: "console.log('hi')",
        fail: ("null.f()", "TypeError"),
        busy: "while (true) {}",
        env: ("process.env.CELL_VAR", "text", "it's $HOME"),
    },
    Language {
        name: "typescript",
        set: "let x: number = 41",
        get: ("const y: number = x + 1; y", "text", "42"),
        print: "console.log('hi' as string)",
        fail: ("throw new RangeError('r')", "RangeError"),
        busy: "for (;;) {}",
        env: ("process.env.CELL_VAR as string", "text", "it's $HOME"),
    },
    Language {
        name: "bash",
        set: "x=41",
        get: ("echo $((x + 1))", "stdout", "42\n"),
        print: "echo hi",
        fail: ("false", "ExitStatus"),
        busy: "while true; do :; done",
        env: ("echo \"$CELL_VAR\"", "stdout", "it's $HOME\n"),
    },
    Language {
        name: "r",
        set: "x <- 41",
        get: ("x + 1", "text", "[1] 42"),
        print: "cat('hi\\n')",
        fail: ("stop('boom')", "ERROR"),
        busy: "repeat {}",
        env: ("Sys.getenv('CELL_VAR')", "text", "[1] \"it's $HOME\""),
    },
    Language {
        name: "java",
        set: "int x = 41;",
        get: ("x + 1", "text", "42"),
        print: "System.out.println(\"hi\");",
        fail: ("Integer.parseInt(\"z\")", "NumberFormatException"),
        busy: "while (true) {}",
        env: ("System.getProperty(\"CELL_VAR\")", "text", "it's $HOME"),
    },
];

#[track_caller]
fn shows(r: &Value, (field, want): (&str, &str), what: &str) {
    let got = match field {
        "text" => &r["results"][0]["text"],
        _ => &r[field],
    };
    assert_eq!(got, want, "{what}: {r}");
}

/// JavaScript, TypeScript, bash and Java on Locker's own kernels, R on Debian's IRkernel:
/// the languages of E2B's code-interpreter template, all in Locker's, none installed by
/// the test. Each keeps its state, prints, fails with its error's name, takes a cell's own
/// environment, and is interrupted by a timeout with its state kept; a language whose
/// runtime is gone from the sandbox is refused with what to install.
#[test]
fn every_language_of_the_template_keeps_state_prints_fails_and_stops_on_timeout() {
    let (_t, api, id) = code_sandbox();
    for l in LANGUAGES {
        let what = |w: &str| format!("{}: {w}", l.name);
        let started = Instant::now();
        let ctx = new_context(&api, &id, &json!({ "language": l.name, "cwd": "/tmp" }));
        let set = run_in(&api, &id, &ctx, l.set);
        assert_eq!(set["reason"], "finished", "{}: {set}", l.name);
        shows(&run_in(&api, &id, &ctx, l.get.0), (l.get.1, l.get.2), &what("state"));
        let p = run_in(&api, &id, &ctx, l.print);
        assert_eq!(p["stdout"], "hi\n", "{}: {p}", l.name);
        assert_eq!(p["results"], json!([]), "{}: {p}", l.name);
        let f = run_in(&api, &id, &ctx, l.fail.0);
        assert_eq!(f["reason"], "error", "{}: {f}", l.name);
        assert_eq!(f["error"]["name"], l.fail.1, "{}: {f}", l.name);
        let e = run(
            &api,
            &id,
            &json!({ "context": ctx, "code": l.env.0, "env": { "CELL_VAR": "it's $HOME" } }),
        );
        shows(&e, (l.env.1, l.env.2), &what("a cell's env"));
        let t0 = Instant::now();
        let slow = run(
            &api,
            &id,
            &json!({ "context": ctx, "code": l.busy, "timeout_ms": 1500 }),
        );
        assert_eq!(slow["reason"], "timeout", "{}: {slow}", l.name);
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{}: interrupted in {:?}",
            l.name,
            t0.elapsed()
        );
        let after = run_in(&api, &id, &ctx, l.get.0);
        shows(&after, (l.get.1, l.get.2), &what("the state after the timeout"));
        eprintln!("{}: {:.1} s", l.name, started.elapsed().as_secs_f64());
        // Its kernel ends: the five together would not fit the sandbox's 512 MB.
        let d = api.delete(&format!("/v1/sandboxes/{id}/contexts/{ctx}"));
        assert_eq!(d.status, 204, "{}", d.text());
    }
    // Locker's Java kernel runs on the sandbox's JShell: without it, what to install.
    let r = api.exec(&id, &json!({ "shell": "rm /usr/bin/jshell", "user": "root" }));
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_no_kernel(&api, &id, "java", "openjdk-17-jdk-headless");
}

#[test]
fn restart_clears_state_and_delete_ends_the_context() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    run_in(&api, &id, &ctx, "gone = 1");
    let r = api
        .post_empty(&format!("/v1/sandboxes/{id}/contexts/{ctx}/restart"))
        .expect(200, "restart");
    assert_eq!(r["id"], ctx.as_str(), "{r}");
    let after = run_in(&api, &id, &ctx, "'gone' in globals()");
    assert_eq!(after["results"][0]["text"], "False", "{after}");
    assert_eq!(after["execution_count"], 1, "{after}");

    let d = api.delete(&format!("/v1/sandboxes/{id}/contexts/{ctx}"));
    assert_eq!(d.status, 204, "{}", d.text());
    api.post(
        &format!("/v1/sandboxes/{id}/code"),
        &json!({ "context": ctx, "code": "1" }),
    )
    .expect_error(404, "not_found", "a deleted context");
    api.delete(&format!("/v1/sandboxes/{id}/contexts/{ctx}"))
        .expect_error(404, "not_found", "deleted twice");
    let list = api
        .get(&format!("/v1/sandboxes/{id}/contexts"))
        .expect(200, "list");
    assert!(!list.to_string().contains(&ctx), "{list}");
}

#[test]
fn a_dying_kernel_is_reported_and_the_next_cell_starts_a_fresh_one() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    run_in(&api, &id, &ctx, "lost = 1");
    let r = run_in(
        &api,
        &id,
        &ctx,
        "import os\nprint('bye', flush=True)\nos._exit(1)",
    );
    assert_eq!(r["reason"], "context_died", "{r}");
    assert_eq!(r["error"]["name"], "ContextDied", "{r}");
    let next = run_in(&api, &id, &ctx, "'lost' in globals()");
    assert_eq!(next["reason"], "finished", "{next}");
    assert_eq!(
        next["results"][0]["text"], "False",
        "a fresh kernel: {next}"
    );
    // The sandbox itself is untouched.
    assert_eq!(api.sh(&id, "echo ok"), "ok\n");
}

#[test]
fn an_output_flood_is_capped_with_head_and_tail() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    let r = run(
        &api,
        &id,
        &json!({ "context": ctx, "code": "print('HEAD')\nfor i in range(3000): print('x' * 1000)\nprint('TAIL')" }),
    );
    let out = r["stdout"].as_str().unwrap();
    assert!(out.len() < 70_000, "capped: {} bytes", out.len());
    assert!(out.starts_with("HEAD\n"), "head kept");
    assert!(out.ends_with("TAIL\n"), "tail kept");
    assert!(out.contains("bytes omitted"), "says what was cut");
    assert_eq!(r["stdout_truncated"], true, "{}", r["stdout_truncated"]);
    // A flood that never ends is cut by its timeout, and the context still answers.
    let r = run(
        &api,
        &id,
        &json!({ "context": ctx, "code": "while True: print('x' * 10000)", "timeout_ms": 2000, "max_output_bytes": 4096 }),
    );
    assert_eq!(r["reason"], "timeout", "{}", r["reason"]);
    assert!(r["stdout"].as_str().unwrap().len() < 6000);
    let next = run_in(&api, &id, &ctx, "1 + 1");
    assert_eq!(next["results"][0]["text"], "2", "{next}");
}

#[test]
fn a_context_of_another_sandbox_or_tenant_is_not_found() {
    let (t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    let other = t.sandbox(&json!({ "template": "code-interpreter" }));
    api.post(
        &format!("/v1/sandboxes/{other}/code"),
        &json!({ "context": ctx, "code": "1" }),
    )
    .expect_error(404, "not_found", "a context of another sandbox");
    api.post_empty(&format!("/v1/sandboxes/{other}/contexts/{ctx}/restart"))
        .expect_error(404, "not_found", "restart another sandbox's context");
    let stranger = Tenant::new();
    let sapi = stranger.api();
    sapi.post(
        &format!("/v1/sandboxes/{id}/code"),
        &json!({ "context": ctx, "code": "1" }),
    )
    .expect_error(404, "not_found", "another tenant's sandbox");
    sapi.delete(&format!("/v1/sandboxes/{id}/contexts/{ctx}"))
        .expect_error(404, "not_found", "another tenant's context");
    sapi.get(&format!("/v1/sandboxes/{id}/contexts"))
        .expect_error(404, "not_found", "another tenant's list");
    // The owner's context is untouched.
    let r = run_in(&api, &id, &ctx, "1");
    assert_eq!(r["results"][0]["text"], "1", "{r}");
}

#[test]
fn killing_the_driver_from_user_code_breaks_neither_the_sandbox_nor_the_server() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    let r = api.post(
        &format!("/v1/sandboxes/{id}/code"),
        &json!({ "context": ctx, "code": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)" }),
    );
    // The cell's driver died under it: an answer that says so (502), not a hang.
    assert!(
        r.status == 502 || r.status == 200,
        "{} {}",
        r.status,
        r.text()
    );
    // Its context went with it: 404 once a new driver answers. Until then (a busy host may
    // still be tearing the old one down) the answer is the 502 that says to retry.
    locker_tests::wait_for(Duration::from_secs(30), "a 404 for the lost context", || {
        let gone = api.post(
            &format!("/v1/sandboxes/{id}/code"),
            &json!({ "context": ctx, "code": "1" }),
        );
        match gone.status {
            502 => None,
            _ => Some(gone.expect_error(404, "not_found", "a context whose driver was killed")),
        }
    });
    let fresh = new_context(&api, &id, &json!({}));
    let r = run_in(&api, &id, &fresh, "40 + 2");
    assert_eq!(r["results"][0]["text"], "42", "{r}");
    assert_eq!(api.sh(&id, "echo alive"), "alive\n");
    api.get("/healthz").expect(200, "the server is fine");

    // Someone else's server on the driver's port: a clear error, never a hang or a crash.
    let impostor = r#"import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 49999))
s.listen()
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(b'HTTP/1.0 200 OK\r\n\r\n{"type": "stdout", "text": 5}\n')
    c.close()
"#;
    let put = api.write_file(&id, "/root/impostor.py", impostor.as_bytes());
    assert!(put.status < 300, "{}", put.text());
    api.sh(&id, "pkill -9 -f 'python3 - --star[t]'; sleep 0.5; (python3 /root/impostor.py > /dev/null 2>&1 &); sleep 1");
    let r = api.post(&format!("/v1/sandboxes/{id}/code"), &json!({ "code": "1" }));
    let msg = r.expect_error(502, "bad_gateway", "an impostor on the driver's port");
    assert!(msg.contains("driver"), "{msg}");
    api.get("/healthz").expect(200, "the server is fine");
}

#[test]
fn cells_stream_as_ndjson_with_the_execution_last() {
    let (_t, api, id) = code_sandbox();
    let (status, _, body) = api
        .open(
            "POST",
            &format!("/v1/sandboxes/{id}/code"),
            &[("Accept", "application/x-ndjson"), ("Content-Type", "application/json")],
            json!({ "code": "import sys, time\nprint('one', flush=True)\ntime.sleep(1)\nprint('two', file=sys.stderr)\n1/0" }).to_string(),
        )
        .expect("stream a cell");
    assert_eq!(status, 200);
    let started = Instant::now();
    let mut lines = Vec::new();
    let mut first_at = None;
    for line in BufReader::new(body).lines() {
        let v: Value = serde_json::from_str(&line.unwrap()).unwrap();
        first_at.get_or_insert(started.elapsed());
        lines.push(v);
    }
    let kinds: Vec<&str> = lines.iter().map(|l| l["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["stdout", "stderr", "error", "execution"],
        "{lines:?}"
    );
    assert_eq!(lines[0]["text"], "one\n");
    assert_eq!(lines[2]["name"], "ZeroDivisionError");
    let last = &lines[3];
    assert_eq!(last["reason"], "error", "{last}");
    assert_eq!(last["stdout"], "one\n", "{last}");
    assert!(
        first_at.unwrap() < Duration::from_millis(900),
        "stdout came before the cell's end"
    );
}

#[test]
fn two_cells_at_once_on_one_context_run_in_arrival_order() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    run_in(&api, &id, &ctx, "order = []");
    let (a_api, a_id, a_ctx) = (api.clone(), id.clone(), ctx.clone());
    let first = std::thread::spawn(move || {
        run_in(
            &a_api,
            &a_id,
            &a_ctx,
            "import time\ntime.sleep(1.5)\norder.append('first')",
        )
    });
    std::thread::sleep(Duration::from_millis(400));
    let second = run_in(&api, &id, &ctx, "order.append('second')\norder");
    first.join().unwrap();
    assert_eq!(
        second["results"][0]["text"], "['first', 'second']",
        "{second}"
    );
}

#[test]
fn a_sandbox_without_a_jupyter_kernel_says_which_template_to_use() {
    let t = Tenant::new();
    let api = t.api();
    let id = t.sandbox(&json!({}));
    let msg = api
        .post(&format!("/v1/sandboxes/{id}/code"), &json!({ "code": "1" }))
        .expect_error(409, "conflict", "code on the default template");
    assert!(msg.contains("code-interpreter"), "{msg}");
    let msg = api
        .post(&format!("/v1/sandboxes/{id}/contexts"), &json!({}))
        .expect_error(409, "conflict", "a context on the default template");
    assert!(msg.contains("code-interpreter"), "{msg}");
    let list = api
        .get(&format!("/v1/sandboxes/{id}/contexts"))
        .expect(200, "no contexts");
    assert_eq!(list["contexts"], json!([]));
}

#[test]
fn bad_code_requests_get_clear_errors() {
    let (_t, api, id) = code_sandbox();
    let path = format!("/v1/sandboxes/{id}/code");
    for (body, needle) in [
        (json!({ "code": "1", "language": "cobol" }), "language"),
        (json!({ "code": "1", "timeout_ms": 0 }), "timeout_ms"),
        (
            json!({ "code": "1", "max_output_bytes": 1u64 << 40 }),
            "max_output_bytes",
        ),
        (json!({ "code": "1", "cwd": "/" }), "cwd"),
        (json!({ "context": "ctx_x" }), "code"),
        (json!({ "code": "1", "env": { "A=B": "c" } }), "env"),
    ] {
        let msg = api
            .post(&path, &body)
            .expect_error(400, "bad_request", &body.to_string());
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    api.post(&path, &json!({ "code": "1", "context": "../etc" }))
        .expect_error(404, "not_found", "a malformed context id");
    let ctx = new_context(&api, &id, &json!({}));
    let msg = api
        .post(
            &path,
            &json!({ "code": "1", "context": ctx, "language": "bash" }),
        )
        .expect_error(400, "bad_request", "a language other than the context's");
    assert!(msg.contains("python"), "{msg}");
    api.post(
        &format!("/v1/sandboxes/{id}/contexts"),
        &json!({ "cwd": "relative" }),
    )
    .expect_error(400, "bad_request", "a relative cwd");
}

#[test]
fn the_driver_port_is_hidden_from_the_port_list_and_the_proxy() {
    let (_t, api, id) = code_sandbox();
    run(&api, &id, &json!({ "code": "1" }));
    let ports = api
        .get(&format!("/v1/sandboxes/{id}/ports"))
        .expect(200, "ports");
    assert!(!ports.to_string().contains("49999"), "{ports}");
    api.get(&format!("/v1/sandboxes/{id}/ports/49999/health"))
        .expect_error(404, "not_found", "the driver through the proxy");
}

fn locker_code(t: &Tenant, args: &[&str], stdin: Option<&str>) -> std::process::Output {
    use std::io::Write;
    let mut c = std::process::Command::new(locker_bin());
    c.arg("code")
        .args(args)
        .env("LOCKER_URL", &t.srv.url)
        .env("LOCKER_API_KEY", &t.key)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().expect("start `locker code`");
    register_child(child.id());
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

#[test]
fn the_cli_runs_code_and_files_and_saves_charts() {
    let (t, _api, id) = code_sandbox();
    let out = locker_code(&t, &[&id, "n = 20\nprint(n + 1)\nn * 2"], None);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "21\n40\n");

    let dir = locker_tests::TempDir::new("code-cli");
    let script = dir.path().join("script.py");
    std::fs::write(
        &script,
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nprint('n was', n)\n",
    )
    .unwrap();
    let images = dir.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let out = locker_code(
        &t,
        &[
            &id,
            "-f",
            script.to_str().unwrap(),
            "--save-images",
            images.to_str().unwrap(),
        ],
        None,
    );
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("n was 20\n"),
        "the default context kept n: {text}"
    );
    let png = std::fs::read(images.join("result-1.png")).expect("the chart was saved");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");

    let out = locker_code(&t, &[&id, "-f", "-"], Some("raise ValueError('bad input')"));
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ValueError: bad input"),
        "{out:?}"
    );
}

#[test]
fn the_python_sdk_runs_code_and_drives_the_seeds_run_code_tool_loop() {
    template();
    let t = Tenant::new();
    let script = locker_tests::root().join("sdk/python/tests/test_code.py");
    let mut c = std::process::Command::new("python3");
    c.arg(&script)
        .env("LOCKER_URL", &t.srv.url)
        .env("LOCKER_API_KEY", &t.key)
        .env("LOCKER_CODE_TEMPLATE", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = c.spawn().expect("start python3");
    register_child(child.id());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "sdk/python/tests/test_code.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("ok test_the_seeds_run_code_tool_loop_with_a_scripted_model"),
        "{said}"
    );
}

#[test]
fn the_mcp_run_code_tool_keeps_state_between_calls() {
    let (t, _api, id) = code_sandbox();
    let meta = json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {}});
    let call = |args: Value| -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                          "params": {"name": "run_code", "arguments": args, "_meta": meta}});
        let agent = locker_tests::server::agent(Duration::from_secs(120));
        let mut resp = agent
            .post(format!("{}/mcp", t.srv.url))
            .header("Accept", "application/json, text/event-stream")
            .header("Content-Type", "application/json")
            .header("MCP-Protocol-Version", "2026-07-28")
            .header("Mcp-Method", "tools/call")
            .header("Mcp-Name", "run_code")
            .header("Authorization", format!("Bearer {}", t.key))
            .send(body.to_string())
            .expect("POST /mcp");
        let text = resp.body_mut().read_to_string().unwrap();
        let json_text = text
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or(&text)
            .to_owned();
        let v: Value = serde_json::from_str(&json_text).unwrap_or_else(|e| panic!("{e}: {text}"));
        v["result"]["structuredContent"].clone()
    };
    let a = call(json!({"sandbox_id": id, "code": "import statistics\nvals = [1, 2, 3, 4]"}));
    assert_eq!(a["reason"], "finished", "{a}");
    let b = call(json!({"sandbox_id": id, "code": "print(statistics.mean(vals))\nlen(vals)"}));
    assert_eq!(b["stdout"], "2.5\n", "{b}");
    assert_eq!(b["result"], "4", "{b}");
    let c = call(
        json!({"sandbox_id": id, "code": "import matplotlib.pyplot as plt\nplt.plot(vals)\nplt.show()\nint('x')"}),
    );
    assert_eq!(c["images"], 1, "{c}");
    assert_eq!(c["error"]["name"], "ValueError", "{c}");
}

/// The bench rows of issue 18 (`bench/code_interpreter.py`), printed, not asserted: run with
/// `--ignored code_interpreter_figures --nocapture`.
#[test]
#[ignore = "a measurement: run it by name"]
fn code_interpreter_figures() {
    template();
    let t = Tenant::new();
    let mut c = std::process::Command::new("python3");
    c.arg(locker_tests::root().join("bench/code_interpreter.py"))
        .env("LOCKER_URL", &t.srv.url)
        .env("LOCKER_API_KEY", &t.key)
        .env("PYTHONDONTWRITEBYTECODE", "1");
    let child = c.spawn().expect("start python3");
    register_child(child.id());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
}

#[test]
fn a_cell_that_corrupts_connection_files_or_leaves_a_child_running_breaks_nothing() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    let r = run_in(
        &api,
        &id,
        &ctx,
        "import glob, os, subprocess\n\
         from ipykernel import get_connection_file\n\
         files = glob.glob(os.path.join(os.path.dirname(get_connection_file()), '*.json'))\n\
         for f in files: open(f, 'w').write('garbage')\n\
         child = subprocess.Popen(['sleep', '300'])\n\
         print(len(files) > 0, child.pid > 0)",
    );
    assert_eq!(r["stdout"], "True True\n", "{r}");
    let next = run_in(&api, &id, &ctx, "child.poll() is None");
    assert_eq!(
        next["results"][0]["text"], "True",
        "the child outlives its cell: {next}"
    );
    // The context restarts (a new connection file), and other contexts start.
    api.post_empty(&format!("/v1/sandboxes/{id}/contexts/{ctx}/restart"))
        .expect(200, "restart after corrupted connection files");
    let r = run_in(&api, &id, &ctx, "1 + 1");
    assert_eq!(r["results"][0]["text"], "2", "{r}");
    let other = new_context(&api, &id, &json!({}));
    let r = run_in(&api, &id, &other, "2 + 2");
    assert_eq!(r["results"][0]["text"], "4", "{r}");
}

/// Prints how many seconds ago the cell's kernel process started (from /proc).
const KERNEL_AGE: &str = "import os\n\
    with open('/proc/self/stat') as f: ticks = int(f.read().rsplit(')', 1)[1].split()[19])\n\
    with open('/proc/uptime') as f: up = float(f.read().split()[0])\n\
    print(round(up - ticks / os.sysconf('SC_CLK_TCK'), 3))";

#[test]
fn a_new_sandboxs_first_context_takes_a_kernel_started_before_the_sandbox() {
    template();
    let t = Tenant::new();
    let api = t.api();
    // The first create of the template's shape puts it in demand; the warm pool then keeps a
    // jail with its driver and a spare kernel ready. Other tests take pooled jails too, so
    // this one tries until it gets one.
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let asked = Instant::now();
        // With a network policy: a pooled jail gets its network when it is taken.
        let id =
            t.sandbox(&json!({ "template": "code-interpreter", "network": { "egress": "all" } }));
        // A context with a working directory and an environment of its own: a spare kernel
        // taken is moved there.
        let ctx = new_context(
            &api,
            &id,
            &json!({ "cwd": "/tmp", "env": { "LOCKER_WARM": "yes" } }),
        );
        let r = run_in(
            &api,
            &id,
            &ctx,
            &format!("{KERNEL_AGE}\nprint(os.getcwd(), os.environ.get('LOCKER_WARM'))"),
        );
        let took = asked.elapsed().as_secs_f64();
        let out = r["stdout"].as_str().unwrap_or_default().to_owned();
        let mut lines = out.lines();
        let age: f64 = lines.next().unwrap_or("").parse().expect("a kernel's age");
        assert_eq!(
            lines.next(),
            Some("/tmp yes"),
            "the context's cwd and env: {r}"
        );
        if age > took + 0.05 {
            eprintln!(
                "a pooled kernel: create + context + cell {took:.3} s, kernel {age:.1} s old"
            );
            let resolver = run_in(&api, &id, &ctx, "print(open('/etc/resolv.conf').read())");
            assert!(
                resolver["stdout"]
                    .as_str()
                    .unwrap()
                    .contains("Written by Locker"),
                "the policy's resolver, seen from the pooled kernel: {resolver}"
            );
            // Only one spare: the sandbox's next context starts its own kernel.
            let r = run(&api, &id, &json!({ "code": KERNEL_AGE }));
            let fresh: f64 = r["stdout"].as_str().unwrap().trim().parse().unwrap();
            assert!(
                fresh < age,
                "a second context's kernel is new: {fresh} vs {age}"
            );
            let list = api
                .get(&format!("/v1/sandboxes/{id}/contexts"))
                .expect(200, "list contexts");
            assert_eq!(
                list["contexts"].as_array().unwrap().len(),
                2,
                "the spare is no context of its own: {list}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no sandbox came with a kernel started before it (last: {took:.3} s, kernel {age:.3} s old)"
        );
        api.delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete a sandbox that was not pooled");
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// Prints the kernel's identity: its connection key, its session id and a first draw of
/// its random generator (the three things a kernel restored from a shared memory image
/// would have in common with every other).
const KERNEL_IDENTITY: &str = "import json as __j, random as __r\n\
    from ipykernel import get_connection_file as __f\n\
    print(__j.load(open(__f()))['key'], get_ipython().kernel.session.session, __r.getrandbits(64))";

/// Creates microVM sandboxes of `body` until one's first cell (the default context) runs in
/// a kernel started before the sandbox was asked for; the others are deleted. Returns its
/// id, the time from the create to the cell's answer, and the kernel's age.
fn pooled_microvm(t: &Tenant, api: &Api, body: &Value) -> (String, f64, f64) {
    // Under TCG on a busy host a microVM's kernel takes minutes to start (cold or pooled).
    let deadline = Instant::now() + Duration::from_secs(1200);
    loop {
        let asked = Instant::now();
        let id = t.sandbox(body);
        let r = run(
            api,
            &id,
            &json!({ "code": KERNEL_AGE, "timeout_ms": 600_000 }),
        );
        let took = asked.elapsed().as_secs_f64();
        let age: f64 = r["stdout"]
            .as_str()
            .unwrap_or("")
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("a kernel's age: {r}"));
        if age > took + 0.05 {
            return (id, took, age);
        }
        assert!(
            Instant::now() < deadline,
            "no microVM came with a kernel started before it (last: {took:.3} s, kernel {age:.3} s old)"
        );
        api.delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete a sandbox that was not pooled");
        std::thread::sleep(Duration::from_secs(2));
    }
}

#[test]
fn a_new_microvms_first_cell_takes_a_kernel_of_its_own_started_before_the_sandbox() {
    template();
    let t = Tenant::new();
    let api = t.api().with_timeout(Duration::from_secs(900));
    // A shape of its own (768 MB), so that other tests' microVMs do not take its pooled ones.
    // The first create puts the shape in demand; the pool then keeps a microVM restored,
    // warmed, with the driver and a spare kernel started in it.
    let body = json!({ "template": "code-interpreter", "runtime": "microvm", "memory_mb": 768 });
    let (a, took, age) = pooled_microvm(&t, &api, &body);
    eprintln!("a pooled microVM kernel: create + first cell {took:.3} s, kernel {age:.1} s old");
    let (b, took_b, age_b) = pooled_microvm(&t, &api, &body);
    eprintln!("another: create + first cell {took_b:.3} s, kernel {age_b:.1} s old");
    // Each has its own kernel: connection key, session and random state.
    let ids: Vec<String> = [&a, &b]
        .iter()
        .map(|id| {
            let r = run(&api, id, &json!({ "code": KERNEL_IDENTITY }));
            let out = r["stdout"].as_str().unwrap().trim().to_owned();
            assert_eq!(out.split(' ').count(), 3, "{r}");
            out
        })
        .collect();
    for (x, y) in ids[0].split(' ').zip(ids[1].split(' ')) {
        assert_ne!(x, y, "two pooled kernels share an identity: {ids:?}");
    }
    // Nothing leaks between them, and state persists in each.
    run(&api, &a, &json!({ "code": "leak = 'only in a'" }));
    let other = run(&api, &b, &json!({ "code": "leak" }));
    assert_eq!(other["error"]["name"], "NameError", "{other}");
    let same = run(&api, &a, &json!({ "code": "leak" }));
    assert_eq!(same["results"][0]["text"], "'only in a'", "{same}");
    // A sandbox with an environment of its own gets no pooled kernel (its kernels start
    // with it), and still runs cells.
    let asked = Instant::now();
    let with_env = t.sandbox(&json!({
        "template": "code-interpreter", "runtime": "microvm", "memory_mb": 768,
        "env": { "LOCKER_OWN": "1" },
    }));
    let r = run(
        &api,
        &with_env,
        &json!({
            "code": format!("{KERNEL_AGE}\nprint(os.environ['LOCKER_OWN'])"),
            "timeout_ms": 600_000,
        }),
    );
    let out = r["stdout"].as_str().unwrap().to_owned();
    let (age, own) = out.split_once('\n').unwrap();
    let age: f64 = age.parse().unwrap();
    assert!(
        age < asked.elapsed().as_secs_f64(),
        "its kernel started after its create: {age}"
    );
    assert_eq!(own, "1\n", "the sandbox's env in its kernel: {r}");
}

#[test]
fn cells_are_recorded_in_the_call_records() {
    let (_t, api, id) = code_sandbox();
    let ctx = new_context(&api, &id, &json!({}));
    run(
        &api,
        &id,
        &json!({ "context": ctx, "code": "print('recorded')", "env": { "SECRET_NAME": "hidden-value" } }),
    );
    let failed = run_in(&api, &id, &ctx, "1/0");
    assert_eq!(failed["reason"], "error", "{failed}");
    // NDJSON cells too.
    let (status, _, body) = api
        .open(
            "POST",
            &format!("/v1/sandboxes/{id}/code"),
            &[
                ("Accept", "application/x-ndjson"),
                ("Content-Type", "application/json"),
            ],
            json!({ "context": ctx, "code": "import time; time.sleep(5)", "timeout_ms": 500 })
                .to_string(),
        )
        .expect("stream a cell");
    assert_eq!(status, 200);
    let last = BufReader::new(body).lines().last().unwrap().unwrap();
    assert!(last.contains("\"execution\""), "{last}");
    // Records are written in the background.
    let deadline = Instant::now() + Duration::from_secs(10);
    let calls = loop {
        let got = api
            .get(&format!("/v1/calls?sandbox_id={id}"))
            .expect(200, "list calls");
        let code: Vec<Value> = got["calls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["kind"] == "code")
            .cloned()
            .collect();
        if code.len() >= 3 || Instant::now() > deadline {
            break code;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(calls.len(), 3, "{calls:?}");
    let text = serde_json::to_string(&calls).unwrap();
    assert!(
        !text.contains("hidden-value"),
        "env values are never recorded"
    );
    // Newest first.
    assert_eq!(
        calls[0]["command"],
        json!([ctx, "import time; time.sleep(5)"])
    );
    assert_eq!(calls[0]["result"]["reason"], "timeout", "{}", calls[0]);
    assert_eq!(calls[1]["command"][1], "1/0");
    assert_eq!(calls[1]["result"]["exit_code"], 1, "{}", calls[1]);
    assert_eq!(calls[2]["env_keys"], json!(["SECRET_NAME"]), "{}", calls[2]);
    assert_eq!(calls[2]["result"]["exit_code"], 0, "{}", calls[2]);
    assert_eq!(calls[2]["result"]["stdout"], "", "no output is recorded");
    assert_eq!(calls[2]["result"]["stdout_bytes"], 9, "{}", calls[2]);
    assert_eq!(calls[2]["runtime"], "jail");
    assert!(calls[2]["id"].as_str().unwrap().starts_with("call_"));
}

#[test]
fn a_200_mb_dataframe_renders_capped_and_the_context_goes_on() {
    template();
    let t = Tenant::new();
    let api = t.api();
    let id = t.sandbox(&json!({ "template": "code-interpreter", "memory_mb": 1536 }));
    let ctx = new_context(&api, &id, &json!({}));
    // pandas' display options cut the rendering of a large frame to its first and last rows.
    let r = run_in(
        &api,
        &id,
        &ctx,
        "import numpy as np, pandas as pd\n\
         big = pd.DataFrame(np.zeros((3_300_000, 8)))\n\
         print(big.memory_usage().sum() > 200e6)\n\
         big",
    );
    assert_eq!(r["reason"], "finished", "{r}");
    assert_eq!(r["stdout"], "True\n", "{r}");
    let res = &r["results"][0];
    assert!(
        res["text"]
            .as_str()
            .unwrap()
            .contains("[3300000 rows x 8 columns]"),
        "{res}"
    );
    assert!(res["html"].as_str().unwrap().contains("<table"), "{res}");
    let size = serde_json::to_string(&r).unwrap().len();
    assert!(size < 100_000, "the answer is small: {size} bytes");
    // Rendered whole (the caller lifted pandas' limits): the text is capped at
    // max_output_bytes with its head and tail kept, and an HTML table over the result cap
    // (8 MiB) is left out and said so.
    let r = run(
        &api,
        &id,
        &json!({
            "context": ctx,
            "code": "pd.set_option('display.max_rows', None)\n\
                     pd.DataFrame(np.arange(320_000.0).reshape(80_000, 4) + 0.123456)",
            "max_output_bytes": 65536,
            "timeout_ms": 300_000,
        }),
    );
    assert_eq!(r["reason"], "finished", "{}", r["error"]);
    let res = &r["results"][0];
    assert_eq!(res["truncated"], true, "{}", res["truncated"]);
    assert!(res.get("html").is_none(), "the 11 MB table is left out");
    let text = res["text"].as_str().unwrap();
    assert!(text.len() < 70_000, "{}", text.len());
    assert!(text.contains("bytes omitted"), "says what was cut");
    assert!(text.contains("0.123456"), "the head is kept");
    assert!(text.contains("\n79999 "), "the tail (the last row) is kept");
    // The kernel and the sandbox are fine.
    let next = run_in(&api, &id, &ctx, "big.shape");
    assert_eq!(next["results"][0]["text"], "(3300000, 8)", "{next}");
    assert_eq!(api.sh(&id, "echo ok"), "ok\n");
}

#[test]
fn a_microvm_sandbox_runs_cells_and_keeps_state() {
    template();
    let t = Tenant::new();
    let api = t.api().with_timeout(Duration::from_secs(600));
    let id = t.sandbox(
        &json!({ "template": "code-interpreter", "runtime": "microvm", "memory_mb": 1024 }),
    );
    let ctx = new_context(&api, &id, &json!({}));
    let a = run_in(&api, &id, &ctx, "import numpy as np\nx = np.arange(4)");
    assert_eq!(a["reason"], "finished", "{a}");
    let b = run_in(&api, &id, &ctx, "int(x.sum())");
    assert_eq!(b["results"][0]["text"], "6", "{b}");
}

#[test]
fn a_fork_of_a_microvm_sandbox_carries_its_contexts_and_a_jails_starts_without_them() {
    template();
    let t = Tenant::new();
    let api = t.api().with_timeout(Duration::from_secs(600));
    for runtime in ["microvm", "jail"] {
        let id = t.sandbox(
            &json!({ "template": "code-interpreter", "runtime": runtime, "memory_mb": 1024 }),
        );
        let ctx = new_context(&api, &id, &json!({}));
        run_in(&api, &id, &ctx, "x = 'from the parent'");
        let forked = api
            .post(&format!("/v1/sandboxes/{id}/fork"), &json!({ "count": 1 }))
            .expect(201, "fork");
        let child = forked["sandboxes"][0]["id"].as_str().unwrap().to_owned();
        let r = api.post(
            &format!("/v1/sandboxes/{child}/code"),
            &json!({ "context": ctx, "code": "x" }),
        );
        if runtime == "microvm" {
            let r = r.expect(200, "the parent's context in the fork");
            assert_eq!(r["results"][0]["text"], "'from the parent'", "{r}");
            // The two are apart from then on.
            run_in(&api, &child, &ctx, "x = 'the child'");
            let p = run_in(&api, &id, &ctx, "x");
            assert_eq!(p["results"][0]["text"], "'from the parent'", "{p}");
        } else {
            r.expect(
                404,
                "a jail's fork has no contexts: its memory is not copied",
            );
            let fresh = run(&api, &child, &json!({ "code": "1 + 1" }));
            assert_eq!(fresh["results"][0]["text"], "2", "{fresh}");
        }
    }
}

/// The wheels of bash_kernel and of its one dependency the template lacks (`filetype`;
/// `pexpect` and `ipykernel` are Debian's, in the template), from PyPI (`pip download` on
/// the host, kept in the target dir), for a sandbox to install; None when PyPI is
/// unreachable.
/// A context in `language` is refused (400) while the sandbox has no kernel for it, and
/// the answer says how to get one (it contains `hint`).
#[track_caller]
fn assert_no_kernel(api: &Api, id: &str, language: &str, hint: &str) {
    let no = api
        .post(
            &format!("/v1/sandboxes/{id}/contexts"),
            &json!({ "language": language }),
        )
        .expect_error(400, "bad_request", &format!("a {language} context without a kernel"));
    assert!(no.contains(hint), "{no}");
}

/// Hands a kernel's `files` (path in the sandbox, bytes) in through the files API (machines
/// reach no registry here) and runs `install` as root to register its kernelspec.
#[track_caller]
fn install_kernel(api: &Api, id: &str, files: &[(String, Vec<u8>)], install: &str) {
    for (path, bytes) in files {
        let put = api.write_file(id, path, bytes);
        assert!((200..300).contains(&put.status), "upload {path}: {}", put.text());
    }
    let r = api.exec(id, &json!({ "shell": install, "user": "root" }));
    assert_eq!(r["exit_code"], 0, "install the kernel: {r}");
}

fn bash_kernel_wheels() -> Option<Vec<(String, Vec<u8>)>> {
    use locker_tests::tools::{pypi_unreachable, run_logged, target_dir};
    let dir = target_dir().join("code/bash-kernel");
    let wheels = || -> Vec<(String, std::path::PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.ends_with(".whl").then_some((name, e.path()))
            })
            .collect()
    };
    if wheels().len() < 2 {
        let (ok, log) = run_logged(std::process::Command::new("python3").args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--dest",
            dir.to_str().expect("utf-8 path"),
            "bash_kernel",
            "filetype",
        ]));
        if !ok {
            if pypi_unreachable(&log) {
                eprintln!("SKIP: bash_kernel cannot be downloaded, PyPI is unreachable:\n{log}");
                return None;
            }
            panic!("pip download bash_kernel filetype failed:\n{log}");
        }
    }
    let found = wheels();
    assert_eq!(found.len(), 2, "pip left two wheels: {found:?}");
    Some(
        found
            .into_iter()
            .map(|(name, path)| (name, std::fs::read(path).expect("read a wheel")))
            .collect(),
    )
}

/// The command line of the process that runs a bash cell's shell (its kernel).
const KERNEL_CMDLINE: &str = "tr '\\0' ' ' < /proc/$PPID/cmdline";

#[test]
fn a_bash_context_runs_on_bash_kernel_installed_from_pypi_which_wins() {
    let (_t, api, id) = code_sandbox();
    // Before: Locker's own bash kernel serves.
    let own = new_context(&api, &id, &json!({ "language": "bash" }));
    let parent = run_in(&api, &id, &own, KERNEL_CMDLINE);
    assert!(
        !parent["stdout"].as_str().unwrap().contains("bash_kernel"),
        "{parent}"
    );
    let Some(wheels) = bash_kernel_wheels() else {
        return;
    };
    let files: Vec<(String, Vec<u8>)> = wheels
        .into_iter()
        .map(|(name, wheel)| (format!("/tmp/{name}"), wheel))
        .collect();
    install_kernel(
        &api,
        &id,
        &files,
        "pip install --quiet --break-system-packages --no-index --no-deps /tmp/*.whl \
         && python3 -m bash_kernel.install --sys-prefix",
    );
    let ctx = new_context(
        &api,
        &id,
        &json!({ "language": "bash", "cwd": "/tmp", "env": { "CTX_VAR": "from the context" } }),
    );
    // An installed kernel named `bash` wins over Locker's own.
    let parent = run_in(&api, &id, &ctx, KERNEL_CMDLINE);
    assert!(
        parent["stdout"].as_str().unwrap().contains("bash_kernel"),
        "{parent}"
    );
    // State (shell variables, the working directory) persists between cells.
    let a = run_in(&api, &id, &ctx, "x=41\necho \"$PWD $CTX_VAR\"");
    assert_eq!(a["reason"], "finished", "{a}");
    assert_eq!(a["stdout"], "/tmp from the context\n", "{a}");
    let b = run_in(&api, &id, &ctx, "cd /etc; echo $((x + 1))");
    assert_eq!(b["stdout"], "42\n", "{b}");
    assert_eq!(run_in(&api, &id, &ctx, "pwd")["stdout"], "/etc\n");
    // A cell's env holds for that cell only, quotes and all.
    let c = run(
        &api,
        &id,
        &json!({ "context": ctx, "code": "echo \"$CELL_VAR\"", "env": { "CELL_VAR": "it's $HOME" } }),
    );
    assert_eq!(c["stdout"], "it's $HOME\n", "{c}");
    let d = run_in(&api, &id, &ctx, "echo ${CELL_VAR-unset}");
    assert_eq!(d["stdout"], "unset\n", "{d}");
    let bad = api
        .post(
            &format!("/v1/sandboxes/{id}/code"),
            &json!({ "context": ctx, "code": "true", "env": { "NOT-A-NAME": "1" } }),
        )
        .expect_error(400, "bad_request", "an env name bash cannot set");
    assert!(bad.contains("NOT-A-NAME"), "{bad}");
    // A timeout interrupts the command; the shell keeps its variables.
    let t0 = Instant::now();
    let slow = run(
        &api,
        &id,
        &json!({ "context": ctx, "code": "sleep 60", "timeout_ms": 1000 }),
    );
    assert_eq!(slow["reason"], "timeout", "{slow}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{slow}");
    let e = run_in(&api, &id, &ctx, "echo $x");
    assert_eq!(e["stdout"], "41\n", "{e}");
    // The language is the context's: a Python cell there is refused.
    let wrong = api
        .post(
            &format!("/v1/sandboxes/{id}/code"),
            &json!({ "context": ctx, "code": "1", "language": "python" }),
        )
        .expect_error(400, "bad_request", "python in a bash context");
    assert!(wrong.contains("runs bash"), "{wrong}");
}

/// Deno's binary from npm (`@deno/linux-x64-glibc`, the package `deno` installs), fetched
/// on the host once; None (the test skips, saying why) when npm is unreachable.
fn deno_binary() -> Option<Vec<u8>> {
    let bin = "node_modules/@deno/linux-x64-glibc/deno";
    let dir = locker_tests::tools::npm_package("deno-npm", "deno@2.9.6", bin)?;
    Some(std::fs::read(dir.join(bin)).expect("read the deno binary"))
}

#[test]
fn a_javascript_context_runs_on_denos_kernel_installed_from_npm_which_wins() {
    let (_t, api, id) = code_sandbox();
    // Before: Locker's own JavaScript kernel (on Node) serves.
    let own = new_context(&api, &id, &json!({ "language": "javascript" }));
    let which = run_in(&api, &id, &own, "typeof Deno");
    assert_eq!(which["results"][0]["text"], "undefined", "{which}");
    let Some(deno) = deno_binary() else {
        return;
    };
    install_kernel(
        &api,
        &id,
        &[("/usr/local/bin/deno".to_owned(), deno)],
        "chmod 755 /usr/local/bin/deno && deno jupyter --install --name javascript",
    );
    let ctx = new_context(
        &api,
        &id,
        &json!({ "language": "javascript", "cwd": "/tmp" }),
    );
    let a = run_in(
        &api,
        &id,
        &ctx,
        "let x = 41; console.log('hi from deno'); console.error('to stderr')",
    );
    assert_eq!(a["reason"], "finished", "{a}");
    assert_eq!(a["stdout"], "hi from deno\n", "{a}");
    assert_eq!(a["stderr"], "to stderr\n", "{a}");
    // State persists, and every cell has its result (Deno's kernel now and then publishes
    // a result after its idle status: the driver listens a moment longer for it).
    for i in 0..15 {
        let b = run_in(&api, &id, &ctx, "x + 1");
        assert_eq!(b["results"][0]["text"], "42", "cell {i}: {b}");
        assert_eq!(b["results"][0]["is_main_result"], true, "{b}");
    }
    // Plain text without colour codes; HTML displays; top-level await; the context's cwd.
    let o = run_in(&api, &id, &ctx, "({ a: 1, b: [1, 2] })");
    assert_eq!(o["results"][0]["text"], "{ a: 1, b: [ 1, 2 ] }", "{o}");
    let h = run_in(&api, &id, &ctx, "Deno.jupyter.html`<b>bold</b>`");
    assert_eq!(h["results"][0]["html"], "<b>bold</b>", "{h}");
    let w = run_in(
        &api,
        &id,
        &ctx,
        "await new Promise((r) => setTimeout(r, 10)); Deno.cwd()",
    );
    assert!(
        w["results"][0]["text"].as_str().unwrap_or("").contains("/tmp"),
        "{w}"
    );
    // An exception is an error with its name and message; the context goes on.
    let e = run_in(&api, &id, &ctx, "throw new TypeError('boom')");
    assert_eq!(e["reason"], "error", "{e}");
    assert_eq!(e["error"]["name"], "TypeError", "{e}");
    assert_eq!(e["error"]["value"], "boom", "{e}");
    assert_eq!(run_in(&api, &id, &ctx, "x * 2")["results"][0]["text"], "82");
    // Deno's kernel does not stop a cell on an interrupt: a timeout restarts it (after a
    // short grace, not the Python kernel's 15 s), says so, and the context goes on empty.
    let t0 = Instant::now();
    let slow = run(
        &api,
        &id,
        &json!({ "context": ctx, "code": "while (true) {}", "timeout_ms": 1000 }),
    );
    assert_eq!(slow["reason"], "timeout", "{slow}");
    assert_eq!(slow["error"]["name"], "KernelRestarted", "{slow}");
    assert!(t0.elapsed() < Duration::from_secs(12), "{:?} {slow}", t0.elapsed());
    let gone = run_in(&api, &id, &ctx, "typeof x");
    assert_eq!(gone["results"][0]["text"], "\"undefined\"", "{gone}");
    assert_eq!(run_in(&api, &id, &ctx, "1 + 1")["results"][0]["text"], "2");
    // A JavaScript cell's own env is set in `process.env` for it (Deno has Node's `process`).
    let e = run(
        &api,
        &id,
        &json!({ "context": ctx, "code": "process.env.CELL_VAR", "env": { "CELL_VAR": "only here" } }),
    );
    assert_eq!(e["results"][0]["text"], "\"only here\"", "{e}");
    let after = run_in(&api, &id, &ctx, "process.env.CELL_VAR ?? 'unset'");
    assert_eq!(after["results"][0]["text"], "\"unset\"", "{after}");
}
