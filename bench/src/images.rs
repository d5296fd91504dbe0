//! Issue 20's image row: pulling and unpacking a ~100 MB image from a loopback registry
//! (Debian's `docker-registry`), `locker template pull` into a fresh cache each time, beside
//! `skopeo copy` into an OCI layout followed by `umoci unpack` of the same image, in the
//! same run, interleaved. Throughput is the image's compressed layer bytes over the wall
//! time of the whole pull (MB/s, higher is better).
//!
//! Owns the registry, the image and the caches it makes (all under one scratch directory,
//! removed at the end, also on failure); never touches the host's template cache.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::io::{BufRead, BufReader};

use anyhow::{bail, Context};
use locker_tests::images::Cache;
use locker_tests::locker_bin;
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

use crate::server::delete;
use crate::stats::{Row, Target};
use crate::{check_stop, Args};

const LOCKER: &str = "images locker template pull (100 MB image, loopback registry)";
const PEER: &str = "images skopeo copy + umoci unpack (same image)";
const ON_BASE: &str = "images pull of an image on a stored base (the 100 MB image + 1 MB layer)";
const ON_BASE_FRESH: &str = "images pull of the same image into an empty cache";
const REBUILD: &str = "images cached Dockerfile rebuild, FROM default (POST to result)";
const REBUILD_IMAGE: &str = "images cached Dockerfile rebuild, FROM the registry image";
const FIRST_IMAGE: &str = "images create → first command, image template";
const FIRST_DEFAULT: &str = "images create → first command, default template";
/// Incompressible bytes in the image (random files), so the layer is ~100 MB compressed.
const PAYLOAD_MB: usize = 100;

/// A scratch directory and the registry started in it, both gone when dropped.
struct Scratch {
    dir: PathBuf,
    registry: Option<Child>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(mut c) = self.registry.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| what.to_owned())?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The image, as an OCI layout `dir/oci:t`: busybox and `PAYLOAD_MB` of random files.
fn make_image(dir: &Path) -> anyhow::Result<String> {
    let layout = dir.join("oci");
    let image = format!("{}:t", layout.display());
    run(
        Command::new("umoci")
            .args(["init", "--layout"])
            .arg(&layout),
        "umoci init",
    )?;
    run(
        Command::new("umoci").args(["new", "--image", &image]),
        "umoci new",
    )?;
    let bundle = dir.join("bundle");
    run(
        Command::new("umoci")
            .args(["unpack", "--image", &image])
            .arg(&bundle),
        "umoci unpack",
    )?;
    let rootfs = bundle.join("rootfs");
    fs::create_dir_all(rootfs.join("bin"))?;
    fs::create_dir_all(rootfs.join("data"))?;
    fs::copy("/bin/busybox", rootfs.join("bin/busybox")).context("busybox-static")?;
    for applet in ["sh", "true"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))?;
    }
    let mut random = fs::File::open("/dev/urandom")?;
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..PAYLOAD_MB {
        random.read_exact(&mut buf)?;
        fs::write(rootfs.join(format!("data/{i}.bin")), &buf)?;
    }
    run(
        Command::new("umoci")
            .args(["repack", "--image", &image])
            .arg(&bundle),
        "umoci repack",
    )?;
    fs::remove_dir_all(&bundle)?;
    Ok(image)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn secs(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}

pub fn image_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    for tool in ["docker-registry", "skopeo", "umoci", "busybox"] {
        if !have(tool) {
            let why = format!("{tool} is not installed (scripts/setup test installs docker-registry, skopeo, umoci, busybox-static)");
            rows.push(Row::skipped(LOCKER, why.clone()));
            rows.push(Row::skipped(PEER, why));
            return Ok(());
        }
    }
    let dir = std::env::temp_dir().join(format!("locker-bench-images-{}", std::process::id()));
    fs::create_dir_all(&dir)?;
    let mut s = Scratch {
        dir: dir.clone(),
        registry: None,
    };
    let image = make_image(&dir)?;
    let port = free_port()?;
    let host = format!("127.0.0.1:{port}");
    fs::create_dir_all(dir.join("storage"))?;
    fs::write(
        dir.join("registry.yml"),
        format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {host}\n",
            dir.join("storage").display()
        ),
    )?;
    s.registry = Some(
        Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("registry.yml"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("docker-registry")?,
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(&host).is_err() {
        if Instant::now() > deadline {
            bail!("the registry did not listen on {host}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let reference = format!("{host}/bench/big:1");
    run(
        Command::new("skopeo")
            .args(["copy", "--quiet", "--dest-tls-verify=false"])
            .arg(format!("oci:{image}"))
            .arg(format!("docker://{reference}")),
        "skopeo copy (push)",
    )?;
    let layer_bytes: u64 = {
        let blobs = dir.join("storage/docker/registry/v2/blobs");
        let mut total = 0;
        let mut stack = vec![blobs];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d)?.flatten() {
                let m = e.metadata()?;
                if m.is_dir() {
                    stack.push(e.path());
                } else {
                    total += m.len();
                }
            }
        }
        total
    };
    let mb = layer_bytes as f64 / 1e6;
    println!("  image {reference}: {mb:.1} MB in the registry");

    let n = args.iterations.unwrap_or(3).clamp(1, 10);
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for i in 0..n + 1 {
        check_stop()?;
        let cache = dir.join(format!("cache-{i}"));
        let t = Instant::now();
        run(
            Command::new(locker_bin())
                .args(["template", "pull", "big", &reference, "--plain-http", &host])
                .env("LOCKER_CACHE_DIR", &cache)
                .stderr(Stdio::piped()),
            "locker template pull",
        )?;
        let a = secs(t);
        let layout = dir.join(format!("peer-{i}"));
        let t = Instant::now();
        run(
            Command::new("skopeo")
                .args(["copy", "--quiet", "--src-tls-verify=false"])
                .arg(format!("docker://{reference}"))
                .arg(format!("oci:{}:t", layout.display())),
            "skopeo copy (pull)",
        )?;
        run(
            Command::new("umoci")
                .args(["unpack", "--image", &format!("{}:t", layout.display())])
                .arg(dir.join(format!("bundle-{i}"))),
            "umoci unpack",
        )?;
        let b = secs(t);
        // The first round warms the page cache of the registry's blobs; it is not counted.
        if i > 0 {
            ours.push(mb / a);
            theirs.push(mb / b);
        }
        for p in [cache, layout, dir.join(format!("bundle-{i}"))] {
            let _ = fs::remove_dir_all(p);
        }
    }
    let how = format!(
        "{mb:.1} MB of gzip layers (busybox and {PAYLOAD_MB} MiB of random files) pushed by skopeo to Debian's docker-registry on loopback; each round pulls into a fresh cache; one warm-up round; higher is better"
    );
    rows.push(
        Row::new(LOCKER, "MB/s", ours, 1)
            .note(&how)
            .note("locker template pull: oci-client over plain HTTP, digests checked, layers unpacked while the next downloads, diff_ids checked")
            .vs(PEER),
    );
    rows.push(
        Row::new(PEER, "MB/s", theirs, 1)
            .note(&how)
            .note("skopeo copy docker://… oci:… then umoci unpack (Debian's), in the same rounds"),
    );
    check_stop()?;
    on_base_rows(&dir, &image, &host, &reference, n, rows)?;
    check_stop()?;
    server_rows(args, rows, &reference, &host)
}

/// An image that is the big one plus a 1 MB layer: pulled where the big one is stored (its
/// layers are not fetched again: `template::image::chain`) and into an empty cache.
fn on_base_rows(
    dir: &Path,
    image: &str,
    host: &str,
    base: &str,
    n: usize,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let layout = image.rsplit_once(':').map_or(image, |(l, _)| l).to_string();
    let bundle = dir.join("bundle-on-base");
    run(
        Command::new("umoci")
            .args(["unpack", "--image", image])
            .arg(&bundle),
        "umoci unpack",
    )?;
    let extra: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    fs::write(bundle.join("rootfs/extra.bin"), extra)?;
    run(
        Command::new("umoci")
            .args(["repack", "--image", &format!("{layout}:on")])
            .arg(&bundle),
        "umoci repack",
    )?;
    let _ = fs::remove_dir_all(&bundle);
    let reference = format!("{host}/bench/on-base:1");
    run(
        Command::new("skopeo")
            .args(["copy", "--quiet", "--dest-tls-verify=false"])
            .arg(format!("oci:{layout}:on"))
            .arg(format!("docker://{reference}")),
        "skopeo copy (push)",
    )?;
    let pull = |cache: &Path, name: &str, r: &str| -> anyhow::Result<f64> {
        let t = Instant::now();
        run(
            Command::new(locker_bin())
                .args(["template", "pull", name, r, "--plain-http", host])
                .env("LOCKER_CACHE_DIR", cache)
                .stderr(Stdio::piped()),
            "locker template pull",
        )?;
        Ok(secs(t) * 1e3)
    };
    let (mut stored, mut fresh) = (Vec::new(), Vec::new());
    for i in 0..n + 1 {
        check_stop()?;
        let (a, b) = (dir.join(format!("on-a-{i}")), dir.join(format!("on-b-{i}")));
        pull(&a, "big", base)?;
        let x = pull(&a, "on-base", &reference)?;
        let y = pull(&b, "on-base", &reference)?;
        if i > 0 {
            stored.push(x);
            fresh.push(y);
        }
        for p in [a, b] {
            let _ = fs::remove_dir_all(p);
        }
    }
    rows.push(
        Row::new(ON_BASE, "ms", stored, 1)
            .note("locker template pull of an image whose first layer is stored as the 100 MB image's: only its own 1 MB layer is fetched and unpacked over a hard-linked copy of the stored tree")
            .vs(ON_BASE_FRESH),
    );
    rows.push(
        Row::new(ON_BASE_FRESH, "ms", fresh, 1)
            .note("the same pull into an empty cache: every layer fetched and unpacked"),
    );
    Ok(())
}

fn post(api: &Api, path: &str, body: &Value) -> anyhow::Result<locker_tests::server::Resp> {
    api.try_request(
        "POST",
        path,
        &[("Content-Type", "application/json")],
        serde_json::to_vec(body)?,
    )
    .with_context(|| format!("POST {path}"))
}

/// A build over the API, followed to its end: the events, or why it failed.
fn build(api: &Api, body: &Value) -> anyhow::Result<Vec<Value>> {
    let r = post(api, "/v1/templates", body)?;
    if r.status != 202 {
        bail!("POST /v1/templates: HTTP {}: {}", r.status, r.text());
    }
    let id = r.json()["build_id"].as_str().unwrap_or_default().to_owned();
    let (status, _, body) = api
        .with_timeout(Duration::from_secs(900))
        .open(
            "GET",
            &format!("/v1/templates/builds/{id}?follow=true"),
            &[],
            (),
        )
        .context("following the build")?;
    if status != 200 {
        bail!("following build {id}: HTTP {status}");
    }
    let events: Vec<Value> = BufReader::new(body)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect();
    match events.last() {
        Some(e) if e["state"] == "succeeded" => Ok(events),
        e => bail!("build {id} did not succeed: {e:?}"),
    }
}

/// Create → first command (`/bin/true`) of `template`, ms; the sandbox deleted after
/// (not counted).
fn first_command(api: &Api, template: &str) -> anyhow::Result<f64> {
    let t = Instant::now();
    let r = post(
        api,
        "/v1/sandboxes",
        &json!({"template": template, "runtime": "jail"}),
    )?;
    if r.status != 201 {
        bail!("create from {template}: HTTP {}: {}", r.status, r.text());
    }
    let id = r.json()["id"].as_str().unwrap_or_default().to_owned();
    let e = post(
        api,
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"cmd": ["/bin/true"]}),
    )?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    delete(api, &id)?;
    if e.status != 200 || e.json()["exit_code"] != 0 {
        bail!("/bin/true in {template}: HTTP {}: {}", e.status, e.text());
    }
    Ok(ms)
}

/// The server-side rows: cached Dockerfile rebuilds (FROM `default`, FROM the registry
/// image) and create → first command from the image's template beside `default`'s, on a
/// server with no warm pools and a private template cache.
fn server_rows(
    args: &Args,
    rows: &mut Vec<Row>,
    reference: &str,
    host: &str,
) -> anyhow::Result<()> {
    let cache = Cache::new();
    let srv = Server::start_with_env(
        &[
            "--cache-dir",
            cache.0.to_str().unwrap_or_default(),
            "--warm-pool",
            "0",
            "--vm-pool",
            "0",
        ],
        &[("LOCKER_PLAIN_HTTP_REGISTRIES", host)],
    );
    let api = srv.api();
    let n = args.iterations.unwrap_or(10).clamp(1, 50);
    let steps = "RUN echo one > /one\nENV MODE=bench\nWORKDIR /srv/work\nRUN echo two > two.txt\n";
    let mut timings = Vec::new();
    for (name, from) in [("bench-df", "default"), ("bench-df-image", reference)] {
        let body = json!({"name": name, "from": {"dockerfile": format!("FROM {from}\n{steps}")}});
        build(&api, &body)?;
        let mut samples = Vec::new();
        for _ in 0..n {
            check_stop()?;
            let t = Instant::now();
            let events = build(&api, &body)?;
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
            let ran = events
                .iter()
                .filter(|e| e["line"].as_str().is_some_and(|l| l.ends_with(": running")))
                .count();
            if ran > 0 {
                bail!("a rebuild of {name} ran {ran} steps: the step cache missed");
            }
        }
        timings.push(samples);
    }
    let image_samples = timings.pop().unwrap_or_default();
    let default_samples = timings.pop().unwrap_or_default();
    let how = "POST /v1/templates with a Dockerfile (FROM, 2 RUN, ENV, WORKDIR) built once before, then GET …/builds/{id}?follow=true to the result: every step found in the step cache";
    rows.push(
        Row::new(REBUILD, "ms", default_samples, 0)
            .note(how)
            .target(Target::P50(1000.0)),
    );
    rows.push(
        Row::new(REBUILD_IMAGE, "ms", image_samples, 0)
            .note(how)
            .note("the image's manifest and config are fetched again from the loopback registry (a tag may have moved), its layers are not")
            .target(Target::P50(1000.0))
            .vs(REBUILD),
    );

    // The image itself as a template (the 100 MB one), and create → first command from it
    // beside `default`, interleaved.
    build(
        &api,
        &json!({"name": "bench-image", "from": {"image": reference}}),
    )?;
    let warm = args.create_warmup().max(1);
    let (mut img, mut def) = (Vec::new(), Vec::new());
    for _ in 0..args.creates().min(30) + warm {
        check_stop()?;
        img.push(first_command(&api, "bench-image")?);
        def.push(first_command(&api, "default")?);
    }
    let how = "POST /v1/sandboxes {\"template\": …, \"runtime\": \"jail\"} then exec /bin/true, on a server with no warm pool (--warm-pool 0 --vm-pool 0), interleaved; the sandbox deleted after (not counted)";
    rows.push(
        Row::new(FIRST_IMAGE, "ms", img, warm)
            .note(how)
            .note("the template pulled from the loopback registry: busybox and 100 MiB of random files")
            .vs(FIRST_DEFAULT),
    );
    rows.push(Row::new(FIRST_DEFAULT, "ms", def, warm).note(how));
    drop(srv);
    Ok(())
}
