//! Templates from OCI images (issue 20, points 1 and 2, "Hostile images"), with real
//! components only: Debian's `docker-registry` (the CNCF distribution server) on a free
//! loopback port with its own config and storage, a second one behind htpasswd basic auth,
//! an image that `umoci` makes from a small busybox rootfs and `skopeo` pushes, and
//! archives `skopeo` writes. An image pulled with `locker template pull` becomes a sandbox
//! that runs with the image's files at its working directory; the same image imported as
//! a docker or OCI archive through `PUT /v1/templates/{name}/image` (the CLI's `template
//! import` with a server) is the same template. Hostile archives go through the API and are
//! refused with a 400 or 413 that names the problem, leaving no template, no build
//! directory and nothing outside; a registry that lies about a digest, answers garbage or
//! stalls (a tiny Python server) is refused with a registry error. Everything the test
//! starts dies with it.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use locker_tests::images::{free_port, make_image, skopeo_copy, wait_listening, Proc, Registry};
use locker_tests::server::Server;
use locker_tests::{cache_dir, locker_bin, unique, TempDir};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The tests of this file share the host's template cache and look for leftovers in it:
/// one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn locker(args: &[&str], stdin: Option<&str>, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(locker_bin());
    cmd.args(args)
        .envs(env.iter().copied())
        .env_remove("LOCKER_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("locker runs");
    // The tests' reaper of orphaned machine shims takes zombies named `locker` that no
    // test registered: this one is waited for here.
    locker_tests::register_child(child.id());
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `.tmp-*` build directories in the template cache.
fn build_dirs() -> Vec<String> {
    fs::read_dir(cache_dir().join("templates"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".tmp-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Removes the names this test gave, whatever happened, and the layer chains only they
/// stood on (unnamed step templates, which the step cache would otherwise keep).
struct Names(Vec<String>);

impl Drop for Names {
    fn drop(&mut self) {
        use locker_runtime::template::{StepCacheLimits, TemplateStore};
        let Ok(store) = TemplateStore::open(cache_dir()) else {
            return;
        };
        let templates = cache_dir().join("templates");
        let parent_of = |d: &str| -> Option<String> {
            let meta: Value =
                serde_json::from_slice(&fs::read(templates.join(d).join("meta.json")).ok()?)
                    .ok()?;
            meta["parent"]
                .as_str()
                .filter(|p| !p.is_empty())
                .map(str::to_string)
        };
        let mut ours = std::collections::HashSet::new();
        for n in &self.0 {
            if let Ok(Some(t)) = store.resolve(n) {
                let mut up = parent_of(&t.digest);
                while let Some(p) = up {
                    up = parent_of(&p);
                    ours.insert(p);
                }
            }
            let _ = store.remove(n, |_| false);
        }
        let others = fs::read_dir(&templates)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|d| d.len() == 64 && !ours.contains(d))
                    .collect()
            })
            .unwrap_or_default();
        let none = StepCacheLimits {
            max_count: 0,
            max_bytes: 0,
            max_age: Duration::ZERO,
        };
        let _ = store.prune_steps(none, &others);
    }
}

#[test]
fn an_image_pulled_or_imported_becomes_a_sandbox() {
    let _serial = serial();
    let dir = TempDir::new("locker-oci");
    let image = make_image(dir.path());
    let reg = Registry::start(&dir.path().join("reg"), None);
    let private = Registry::start(&dir.path().join("reg-auth"), Some(("agent", "s3cret")));
    let reference = format!("{}/test/busybox:1", reg.host);
    skopeo_copy(
        &format!("oci:{image}"),
        &format!("docker://{reference}"),
        &[],
    );
    let private_ref = format!("{}/private/busybox:1", private.host);
    skopeo_copy(
        &format!("oci:{image}"),
        &format!("docker://{private_ref}"),
        &["--dest-creds", "agent:s3cret"],
    );
    let pulled = unique("oci-pulled");
    let from_docker = unique("oci-docker");
    let from_oci = unique("oci-archive");
    let from_private = unique("oci-private");
    let _names = Names(vec![
        pulled.clone(),
        from_docker.clone(),
        from_oci.clone(),
        from_private.clone(),
    ]);

    // Pull over plain HTTP from the loopback registry.
    let out = locker(
        &[
            "template",
            "pull",
            &pulled,
            &reference,
            "--plain-http",
            &reg.host,
            "--json",
        ],
        None,
        &[],
    );
    assert!(out.status.success(), "pull: {}", text(&out));
    let t: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(t["config"]["env"]["GREETING"], "hello-from-config", "{t}");
    assert_eq!(t["config"]["workdir"], "/srv/app", "{t}");
    assert_eq!(t["config"]["start_cmd"], json!(["/bin/sh"]), "{t}");
    let digest = t["digest"].as_str().unwrap().to_owned();
    assert!(
        Path::new(t["rootfs"].as_str().unwrap())
            .join("etc/greeting")
            .is_file(),
        "{t}"
    );

    // A sandbox from it runs the image's busybox, with its files at its working directory
    // and its config's environment (the template's RunConfig, applied at create).
    let s = Server::start();
    let api = s.api();
    let sb = api.create_sandbox(&json!({ "template": pulled }));
    let id = sb["id"].as_str().unwrap();
    let r = api.exec(
        id,
        &json!({ "shell": "cat /etc/greeting; cat data.txt; busybox | head -1 | cut -c1-7; echo $GREETING; pwd" }),
    );
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(
        r["stdout"], "hello from the image\napp data\nBusyBox\nhello-from-config\n/srv/app\n",
        "{r}"
    );
    api.delete(&format!("/v1/sandboxes/{id}"));

    // The same image as a docker archive and as an OCI archive, through the server: the
    // same template (its digest stands for the image config).
    let docker_tar = dir.path().join("docker.tar");
    let oci_tar = dir.path().join("oci.tar");
    skopeo_copy(
        &format!("oci:{image}"),
        &format!("docker-archive:{}:test/busybox:1", docker_tar.display()),
        &[],
    );
    skopeo_copy(
        &format!("oci:{image}"),
        &format!("oci-archive:{}:t", oci_tar.display()),
        &[],
    );
    let env = [("LOCKER_API_KEY", s.api_key.as_str())];
    for (name, tar) in [(&from_docker, &docker_tar), (&from_oci, &oci_tar)] {
        let out = locker(
            &[
                "template",
                "import",
                name,
                tar.to_str().unwrap(),
                "--json",
                "--url",
                &s.url,
            ],
            None,
            &env,
        );
        assert!(
            out.status.success(),
            "import {}: {}",
            tar.display(),
            text(&out)
        );
        let t: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(t["name"], name.as_str(), "{t}");
        assert_eq!(
            t["digest"],
            digest.as_str(),
            "same image, same template: {t}"
        );
        assert!(t.get("rootfs").is_none(), "no host path over the API: {t}");
    }

    // Basic auth: refused without credentials, pulled with them (the same image again).
    let out = locker(
        &[
            "template",
            "pull",
            &from_private,
            &private_ref,
            "--plain-http",
            &private.host,
        ],
        None,
        &[],
    );
    assert!(!out.status.success());
    assert!(text(&out).contains("registry"), "{}", text(&out));
    let out = locker(
        &[
            "template",
            "pull",
            &from_private,
            &private_ref,
            "--plain-http",
            &private.host,
            "--username",
            "agent",
            "--json",
        ],
        Some("s3cret\n"),
        &[],
    );
    assert!(out.status.success(), "pull with auth: {}", text(&out));
    let t: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(t["digest"], digest.as_str());
    assert!(build_dirs().is_empty(), "{:?}", build_dirs());
}

// Hostile archives through the API.

/// One tar entry with raw header bytes (any name fits, `..` included).
fn entry(out: &mut Vec<u8>, name: &str, kind: u8, data: &[u8], size: Option<u64>, link: &str) {
    let mut h = tar::Header::new_gnu();
    {
        let g = h.as_gnu_mut().unwrap();
        g.name[..name.len()].copy_from_slice(name.as_bytes());
        g.linkname[..link.len()].copy_from_slice(link.as_bytes());
    }
    h.set_entry_type(tar::EntryType::new(kind));
    h.set_size(size.unwrap_or(data.len() as u64));
    h.set_mode(0o644);
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
    let mut d = data.to_vec();
    d.resize(d.len().div_ceil(512) * 512, 0);
    out.extend_from_slice(&d);
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// A docker-save archive of one layer.
fn docker_archive(layer: &[u8], compressed: Option<&[u8]>) -> Vec<u8> {
    let config = json!({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", sha(layer))]},
    })
    .to_string();
    let config_name = format!("{}.json", sha(config.as_bytes()));
    let manifest = json!([{"Config": config_name, "Layers": ["l/layer.tar"]}]).to_string();
    let mut out = Vec::new();
    entry(
        &mut out,
        "manifest.json",
        b'0',
        manifest.as_bytes(),
        None,
        "",
    );
    entry(&mut out, &config_name, b'0', config.as_bytes(), None, "");
    entry(
        &mut out,
        "l/layer.tar",
        b'0',
        compressed.unwrap_or(layer),
        None,
        "",
    );
    out.extend_from_slice(&[0u8; 1024]);
    out
}

fn tar_of(build: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::new();
    build(&mut out);
    out.extend_from_slice(&[0u8; 1024]);
    out
}

#[test]
fn hostile_archives_are_refused_through_the_api_and_leave_nothing() {
    let _serial = serial();
    let outside = TempDir::new("locker-oci-outside");
    let target = outside.path().join("secret");
    fs::write(&target, "host").unwrap();
    let s = Server::start_with_env(
        &[],
        &[
            ("LOCKER_IMAGE_MAX_UNPACKED_BYTES", "67108864"),
            ("LOCKER_IMAGE_MAX_DOWNLOAD_BYTES", "33554432"),
        ],
    );
    let api = s.api();
    let out_dir = outside.path().display().to_string();
    let zeros = vec![0u8; 8 << 20];
    let bomb_layer = tar_of(|t| {
        for i in 0..16 {
            entry(t, &format!("z{i}"), b'0', &zeros, None, "");
        }
    });
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&bomb_layer).unwrap();
    let bomb_gz = gz.finish().unwrap();
    let mut huge = Vec::new();
    entry(&mut huge, "huge", b'0', b"", Some(10 << 30), "");
    huge.extend_from_slice(&[0u8; 1024]);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "dotdot",
            docker_archive(
                &tar_of(|t| entry(t, "../../escape", b'0', b"x", None, "")),
                None,
            ),
            400,
            "climbs out",
        ),
        (
            "symlink-then-file",
            docker_archive(
                &tar_of(|t| {
                    entry(t, "out", b'2', b"", None, &out_dir);
                    entry(t, "out/pwned", b'0', b"x", None, "");
                }),
                None,
            ),
            400,
            "symlink whose target is not in the image",
        ),
        (
            "hardlink",
            docker_archive(
                &tar_of(|t| entry(t, "stolen", b'1', b"", None, target.to_str().unwrap())),
                None,
            ),
            400,
            "not in the image",
        ),
        (
            "device",
            docker_archive(&tar_of(|t| entry(t, "dev/sda", b'4', b"", None, "")), None),
            400,
            "device node",
        ),
        ("sparse-10g", docker_archive(&huge, None), 413, "limit"),
        (
            "bomb",
            docker_archive(&bomb_layer, Some(&bomb_gz)),
            413,
            "limit",
        ),
        (
            "not-an-image",
            tar_of(|t| entry(t, "etc/passwd", b'0', b"root", None, "")),
            400,
            "not an image archive",
        ),
        (
            "too-big-body",
            vec![0u8; 40 << 20],
            413,
            "over the image limit",
        ),
    ];
    let before: Vec<String> = list_templates(&api);
    for (what, body, status, needle) in cases {
        let name = unique("oci-hostile");
        let _names = Names(vec![name.clone()]);
        let started = Instant::now();
        let r = api.put(&format!("/v1/templates/{name}/image"), &body[..]);
        let msg = r.expect_error(
            status,
            if status == 400 {
                "bad_request"
            } else {
                "payload_too_large"
            },
            what,
        );
        assert!(msg.contains(needle), "{what}: {msg}");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{what} took {:?}",
            started.elapsed()
        );
        assert!(build_dirs().is_empty(), "{what}: {:?}", build_dirs());
        assert_eq!(list_templates(&api), before, "{what}: no template appeared");
        let names: Vec<_> = fs::read_dir(outside.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{what}: nothing written outside: {names:?}");
        assert_eq!(fs::read_to_string(&target).unwrap(), "host");
    }
    let uploads = s.data_dir.join("uploads");
    let left: Vec<_> = fs::read_dir(&uploads)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "uploads left behind: {left:?}");
    // Names Locker builds itself are not for importing.
    api.put("/v1/templates/default/image", &b"x"[..])
        .expect_error(409, "conflict", "import over default");
}

fn list_templates(api: &locker_tests::server::Api) -> Vec<String> {
    let v = api.get("/v1/templates").expect(200, "list templates");
    let mut names: Vec<String> = v["templates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| format!("{}={}", t["name"], t["digest"]))
        .collect();
    names.sort();
    names
}

// Registries that lie, answer garbage or stall: a tiny server speaking just enough of the
// distribution API.
const FAKE_REGISTRY: &str = r#"
import hashlib, http.server, json, sys, time
mode = sys.argv[2]
config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}).encode()
manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "size": len(config),
               "digest": "sha256:" + hashlib.sha256(config).hexdigest()}, "layers": []}).encode()
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path == "/v2/":
            self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers(); return
        if mode == "stall":
            time.sleep(600); return
        body = manifest if mode == "lying" else b"\x00garbage{{{"
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        self.send_header("Docker-Content-Digest", "sha256:" + "0" * 64)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"#;

#[test]
fn lying_garbage_and_stalling_registries_are_refused() {
    let _serial = serial();
    let cache = TempDir::new("locker-oci-cache");
    for (mode, needle, within) in [
        ("lying", "registry", 20),
        ("garbage", "registry", 20),
        ("stall", "registry", 100),
    ] {
        let port = free_port();
        let mut child = Command::new("python3")
            .args(["-c", FAKE_REGISTRY, &port.to_string(), mode])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 runs");
        wait_listening(port, &mut child, "the fake registry listens");
        let _p = Proc(child);
        let host = format!("127.0.0.1:{port}");
        let started = Instant::now();
        let out = locker(
            &[
                "template",
                "pull",
                "liar",
                &format!("{host}/x/y:1"),
                "--plain-http",
                &host,
            ],
            None,
            &[("LOCKER_CACHE_DIR", cache.path().to_str().unwrap())],
        );
        assert!(!out.status.success(), "{mode}: {}", text(&out));
        let t = text(&out);
        assert!(t.contains(needle), "{mode}: {t}");
        assert!(
            started.elapsed() < Duration::from_secs(within),
            "{mode} took {:?}",
            started.elapsed()
        );
        let templates: Vec<PathBuf> = fs::read_dir(cache.path().join("templates"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| !p.ends_with("names") && !p.ends_with(".locks"))
            .collect();
        assert!(templates.is_empty(), "{mode}: {templates:?}");
    }
}

/// zstd layers (`application/vnd.oci.image.layer.v1.tar+zstd`), as `skopeo copy
/// --dest-compress-format zstd` pushes them: pulled and unpacked into the same template as
/// the gzip push of the same image (the config, and so the digest, are the same).
/// `locker template pull NAME REFERENCE` from a plain-HTTP registry into the template cache
/// `cache`: the template's JSON and the command's whole output.
fn pull_into(cache: &Path, name: &str, reference: &str, host: &str) -> (Value, String) {
    let out = locker(
        &[
            "template",
            "pull",
            name,
            reference,
            "--plain-http",
            host,
            "--json",
        ],
        None,
        &[("LOCKER_CACHE_DIR", cache.to_str().unwrap())],
    );
    assert!(out.status.success(), "pull {reference}: {}", text(&out));
    (serde_json::from_slice(&out.stdout).unwrap(), text(&out))
}

#[test]
fn a_zstd_image_is_pulled_like_a_gzip_one() {
    let _serial = serial();
    let dir = TempDir::new("locker-oci-zstd");
    let image = make_image(dir.path());
    let reg = Registry::start(&dir.path().join("reg"), None);
    let gz_ref = format!("{}/test/gz:1", reg.host);
    let zst_ref = format!("{}/test/zst:1", reg.host);
    // zstd first, recompressing (skopeo would otherwise reuse the gzip blob it has).
    skopeo_copy(
        &format!("oci:{image}"),
        &format!("docker://{zst_ref}"),
        &["--dest-compress", "--dest-compress-format", "zstd"],
    );
    skopeo_copy(&format!("oci:{image}"), &format!("docker://{gz_ref}"), &[]);
    let raw = Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false"])
        .arg(format!("docker://{zst_ref}"))
        .output()
        .unwrap();
    let manifest: Value = serde_json::from_slice(&raw.stdout).unwrap();
    assert_eq!(
        manifest["layers"][0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+zstd",
        "skopeo pushed zstd: {manifest}"
    );
    let mut digests = Vec::new();
    for reference in [&zst_ref, &gz_ref] {
        let cache = TempDir::new("locker-oci-zstd-cache");
        let (t, _) = pull_into(cache.path(), "z", reference, &reg.host);
        let rootfs = Path::new(t["rootfs"].as_str().unwrap());
        assert_eq!(
            fs::read_to_string(rootfs.join("etc/greeting")).unwrap(),
            "hello from the image\n"
        );
        assert!(rootfs.join("bin/busybox").is_file());
        digests.push(t["digest"].as_str().unwrap().to_string());
    }
    assert_eq!(digests[0], digests[1], "one image, one template");
}

/// Issue 20, point 5: an image's layers are stored once by digest. Image B is image A plus
/// one layer; once A is pulled, pulling B fetches only B's own layer (A's layer blob is
/// corrupted in the registry first, so fetching it would fail the digest check), and A's
/// files are the same inodes in both templates.
#[test]
fn an_image_on_a_pulled_base_fetches_only_its_own_layers_and_shares_the_base() {
    use std::os::unix::fs::MetadataExt;
    let _serial = serial();
    let dir = TempDir::new("locker-oci-chain");
    let image = make_image(dir.path());
    let layout = image.rsplit_once(':').unwrap().0.to_string();
    let bundle = dir.path().join("bundle-b");
    let unpack = Command::new("umoci")
        .args(["unpack", "--image", &image])
        .arg(&bundle)
        .status()
        .unwrap();
    assert!(unpack.success(), "umoci unpack");
    fs::write(bundle.join("rootfs/etc/extra"), "from image b\n").unwrap();
    let repack = Command::new("umoci")
        .args(["repack", "--image", &format!("{layout}:b")])
        .arg(&bundle)
        .status()
        .unwrap();
    assert!(repack.success(), "umoci repack");
    let reg = Registry::start(&dir.path().join("reg"), None);
    let (a_ref, b_ref) = (
        format!("{}/test/base:1", reg.host),
        format!("{}/test/on-base:1", reg.host),
    );
    skopeo_copy(&format!("oci:{image}"), &format!("docker://{a_ref}"), &[]);
    skopeo_copy(
        &format!("oci:{layout}:b"),
        &format!("docker://{b_ref}"),
        &[],
    );
    let cache = TempDir::new("locker-oci-chain-cache");
    let pull = |name: &str, reference: &str| pull_into(cache.path(), name, reference, &reg.host);
    let (a, _) = pull("a", &a_ref);

    // B's manifest lists A's layer, then its own.
    let raw = Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false"])
        .arg(format!("docker://{b_ref}"))
        .output()
        .unwrap();
    let manifest: Value = serde_json::from_slice(&raw.stdout).unwrap();
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2, "{manifest}");
    let base = layers[0]["digest"].as_str().unwrap();
    let hexd = base.strip_prefix("sha256:").unwrap();
    let blob = dir
        .path()
        .join("reg/storage/docker/registry/v2/blobs/sha256")
        .join(&hexd[..2])
        .join(hexd)
        .join("data");
    let len = fs::metadata(&blob)
        .expect("the base layer's blob in the registry")
        .len();
    fs::write(&blob, vec![b'x'; len as usize]).unwrap();

    let (b, log) = pull("b", &b_ref);
    assert!(log.contains("stored already"), "{log}");
    let (ra, rb) = (
        Path::new(a["rootfs"].as_str().unwrap()),
        Path::new(b["rootfs"].as_str().unwrap()),
    );
    assert_eq!(
        fs::read_to_string(rb.join("etc/extra")).unwrap(),
        "from image b\n"
    );
    assert_eq!(
        fs::read_to_string(rb.join("etc/greeting")).unwrap(),
        "hello from the image\n"
    );
    assert!(!ra.join("etc/extra").exists());
    let ino = |p: PathBuf| fs::metadata(&p).unwrap().ino();
    assert_eq!(
        ino(ra.join("bin/busybox")),
        ino(rb.join("bin/busybox")),
        "the base layer's files are stored once"
    );
    // A fresh cache has to fetch the base layer, and the corrupted blob is refused.
    let fresh = TempDir::new("locker-oci-chain-fresh");
    let out = locker(
        &["template", "pull", "b", &b_ref, "--plain-http", &reg.host],
        None,
        &[("LOCKER_CACHE_DIR", fresh.path().to_str().unwrap())],
    );
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(base), "{}", text(&out));
}
