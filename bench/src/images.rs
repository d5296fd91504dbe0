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

use anyhow::{bail, Context};
use locker_tests::locker_bin;

use crate::stats::Row;
use crate::{check_stop, Args};

const LOCKER: &str = "images locker template pull (100 MB image, loopback registry)";
const PEER: &str = "images skopeo copy + umoci unpack (same image)";
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
    Ok(())
}
