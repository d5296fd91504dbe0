//! What the template tests share: Debian's `docker-registry` on a free loopback port (with
//! htpasswd basic auth when asked), a small busybox image that `umoci` makes and `skopeo`
//! copies, and a private template cache holding a hard-linked copy of the host's `default`
//! (so a test's step templates never reach the host's cache).

use std::fs;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use crate::server::Server;

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `cmd` and panics with its output unless it succeeds.
pub fn run(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A child process killed and reaped when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn wait_listening(port: u16, child: &mut Child, what: &str) {
    crate::wait_for(Duration::from_secs(20), what, || {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what}: exited with {status}");
        }
        TcpStream::connect(("127.0.0.1", port)).ok().map(drop)
    });
}

/// Debian's docker-registry on a free loopback port, its config and storage in `dir`.
pub struct Registry {
    pub host: String,
    _proc: Proc,
}

impl Registry {
    pub fn start(dir: &Path, basic_auth: Option<(&str, &str)>) -> Registry {
        fs::create_dir_all(dir.join("storage")).unwrap();
        let port = free_port();
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.join("storage").display()
        );
        if let Some((user, pass)) = basic_auth {
            let out = run(
                Command::new("htpasswd").args(["-Bbn", user, pass]),
                "htpasswd (apt-get install apache2-utils)",
            );
            fs::write(dir.join("htpasswd"), &out.stdout).unwrap();
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: locker-test\n    path: {}\n",
                dir.join("htpasswd").display()
            ));
        }
        fs::write(dir.join("config.yml"), config).unwrap();
        let mut child = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.join("registry.log")).unwrap())
            .spawn()
            .expect("docker-registry runs (apt-get install docker-registry)");
        wait_listening(port, &mut child, "the registry listens");
        Registry {
            host: format!("127.0.0.1:{port}"),
            _proc: Proc(child),
        }
    }
}

/// An OCI layout `dir/oci:t` made by umoci: busybox as /bin/sh, a file, a working directory,
/// an environment variable, and an account `app` (uid 1000) in `/etc/passwd`.
pub fn make_image(dir: &Path) -> String {
    let layout = dir.join("oci");
    let image = format!("{}:t", layout.display());
    run(
        Command::new("umoci")
            .args(["init", "--layout"])
            .arg(&layout),
        "umoci init (apt-get install umoci)",
    );
    run(
        Command::new("umoci").args(["new", "--image", &image]),
        "umoci new",
    );
    let bundle = dir.join("bundle");
    run(
        Command::new("umoci")
            .args(["unpack", "--image", &image])
            .arg(&bundle),
        "umoci unpack",
    );
    let rootfs = bundle.join("rootfs");
    for d in ["bin", "etc", "srv/app", "tmp", "home/app"] {
        fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    fs::copy("/bin/busybox", rootfs.join("bin/busybox"))
        .expect("busybox (apt-get install busybox-static)");
    std::os::unix::fs::symlink("busybox", rootfs.join("bin/sh")).unwrap();
    fs::write(rootfs.join("etc/greeting"), "hello from the image\n").unwrap();
    fs::write(
        rootfs.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n",
    )
    .unwrap();
    fs::write(rootfs.join("etc/group"), "root:x:0:\napp:x:1000:\n").unwrap();
    fs::write(rootfs.join("srv/app/data.txt"), "app data\n").unwrap();
    run(
        Command::new("umoci")
            .args(["repack", "--image", &image])
            .arg(&bundle),
        "umoci repack",
    );
    run(
        Command::new("umoci").args([
            "config",
            "--image",
            &image,
            "--config.env",
            "GREETING=hello-from-config",
            "--config.env",
            "PATH=/bin",
            "--config.workingdir",
            "/srv/app",
            "--config.cmd",
            "/bin/sh",
        ]),
        "umoci config",
    );
    image
}

pub fn skopeo_copy(from: &str, to: &str, extra: &[&str]) {
    run(
        Command::new("skopeo")
            .args([
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
                "--src-tls-verify=false",
            ])
            .args(extra)
            .arg(from)
            .arg(to),
        &format!("skopeo copy {from} {to} (apt-get install skopeo)"),
    );
}

/// A private template cache with `default` in it; removed when dropped.
pub struct Cache(pub PathBuf);

impl Cache {
    pub fn new() -> Cache {
        let host = crate::cache_dir();
        let dir = host
            .parent()
            .expect("the cache has a parent")
            .join(crate::unique("locker-build-test"));
        let digest = fs::read_to_string(host.join("templates/names/default"))
            .expect("the default template is built (scripts/setup build)")
            .trim()
            .to_string();
        fs::create_dir_all(dir.join("templates/names")).unwrap();
        let st = Command::new("cp")
            .arg("-al")
            .arg(host.join("templates").join(&digest))
            .arg(dir.join("templates").join(&digest))
            .status()
            .unwrap();
        assert!(st.success(), "cp -al of the default template");
        // Its metadata gets names written: a copy of its own, not the host's inode.
        let meta = dir.join("templates").join(&digest).join("meta.json");
        let text = fs::read(&meta).unwrap();
        fs::remove_file(&meta).unwrap();
        fs::write(&meta, text).unwrap();
        fs::write(dir.join("templates/names/default"), format!("{digest}\n")).unwrap();
        Cache(dir)
    }

    pub fn server(&self) -> Server {
        self.server_with_env(&[])
    }

    /// A server on this cache with extra environment variables.
    pub fn server_with_env(&self, env: &[(&str, &str)]) -> Server {
        Server::start_with_env(&["--cache-dir", self.0.to_str().unwrap()], env)
    }

    /// Template directories in the cache (digests), sorted.
    pub fn digests(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.0.join("templates"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.len() == 64)
            .collect();
        v.sort();
        v
    }

    /// How many templates the cache holds.
    pub fn templates(&self) -> usize {
        self.digests().len()
    }
}

impl Default for Cache {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
