//! Jails on a pure cgroup v2 layout, for real. This host gives machines cgroup v1 (a hybrid
//! layout: cpu, memory, pids and freezer on v1); most users' hosts are pure v2. A microVM
//! guest of Locker runs its own kernel, whose agent mounts only cgroup2 (cpu, memory and
//! pids enabled at its root, nothing on v1; the nested server then mounts its named,
//! controller-less v1 hierarchy for `favordynmods`, as it does on a user's v2 host where
//! the kernel has v1 built in): the test hands a `locker` binary, the static agent and the
//! guest kernel's loop module into one, gives the guest's read-only template disk to a
//! nested `locker serve` as its `default` template, and drives jails there over HTTP
//! (`data/cgroup_v2_guest.py`): the machine's cgroup and what it delegates, the commands'
//! cgroups, the memory limit, a timeout killing a `setsid` tree, a stray cgroup removed,
//! CPU counted, and a delete leaving no cgroup and no loop device; then serverless runs
//! on a volume (btrfs: the guest kernel's module and the host's `mkfs.btrfs` handed in
//! too): each run's machine in its cgroup, its limit, its change committed, no cgroup
//! left. Everything lives in the microVM, which the server destroys with the sandbox.
//! About two minutes under TCG.

use std::path::{Path, PathBuf};
use std::time::Duration;

use locker_tests::server::Server;
use locker_tests::{agent_bin, cache_dir, locker_bin};
use serde_json::json;

/// The file uploaded for `bin`: a copy without debug information when `strip` is at hand
/// (the release build carries ~200 MB of it; the guest needs none).
fn slim(bin: &Path, dir: &Path) -> Vec<u8> {
    let out = dir.join(bin.file_name().expect("a file name"));
    let stripped = std::process::Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(&out)
        .arg(bin)
        .status()
        .is_ok_and(|s| s.success());
    std::fs::read(if stripped { &out } else { bin }).expect("read a binary")
}

/// The guest kernel's module `name` (`loop`, `btrfs`, ...), if it is one (it may be built in).
fn module(name: &str) -> Option<PathBuf> {
    let root = locker_runtime::vm::kernel_dir().join("modules");
    let (plain, packed) = (format!("{name}.ko"), format!("{name}.ko."));
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).ok()?.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == plain || n.starts_with(&packed))
            {
                return Some(p);
            }
        }
    }
    None
}

#[test]
fn jails_on_a_pure_cgroup_v2_layout_keep_their_limits_and_leave_nothing() {
    let s = Server::start_with(&["--vm-pool", "0", "--warm-pool", "0"]);
    let api = s.api().with_timeout(Duration::from_secs(900));
    let sb = api.create_sandbox(&json!({
        "runtime": "microvm", "memory_mb": 2048, "disk_mb": 4096, "cpus": 2, "ttl_s": 3600
    }));
    let id = sb["id"].as_str().expect("an id").to_owned();

    let tmp = locker_tests::TempDir::new("locker-cgroup-v2");
    let put = |path: &str, data: &[u8]| {
        api.write_file(&id, path, data)
            .expect(200, &format!("upload {path}"));
    };
    put("/opt/l/locker", &slim(&locker_bin(), tmp.path()));
    put("/opt/l/locker-agent", &slim(&agent_bin(), tmp.path()));
    put(
        "/opt/l/guest.py",
        include_str!("data/cgroup_v2_guest.py").as_bytes(),
    );
    let digest = std::fs::read_to_string(cache_dir().join("templates/names/default"))
        .expect("the default template is built")
        .trim()
        .to_owned();
    let meta = std::fs::read(
        cache_dir()
            .join("templates")
            .join(&digest)
            .join("meta.json"),
    )
    .expect("the default template's meta.json");
    put("/opt/l/meta.json", &meta);
    // The loop module, and btrfs with what it needs (volumes), loaded in this order with
    // finit_module(2) (313; a compressed module with MODULE_INIT_COMPRESSED_FILE).
    let mut loads = Vec::new();
    for name in [
        "loop",
        "xor",
        "raid6_pq",
        "zstd_compress",
        "libcrc32c",
        "btrfs",
    ] {
        let Some(m) = module(name) else {
            continue; // built in
        };
        let file = m.file_name().unwrap().to_string_lossy().into_owned();
        put(&format!("/opt/l/{file}"), &std::fs::read(&m).unwrap());
        let flags = if file.ends_with(".ko") { 0 } else { 4 };
        loads.push(format!(
            "python3 -c \"import ctypes,os,sys; fd=os.open('/opt/l/{file}',os.O_RDONLY); \
             sys.exit(ctypes.CDLL(None).syscall(313, fd, b'', {flags}) != 0)\""
        ));
    }
    let load = if loads.is_empty() {
        "true".to_owned()
    } else {
        loads.join(" && ")
    };
    // Volumes are btrfs images: mkfs.btrfs from the host (its libraries are in the template).
    let mkfs = locker_runtime::doctor::which("mkfs.btrfs").expect("btrfs-progs on the host");
    put("/usr/local/sbin/mkfs.btrfs", &std::fs::read(mkfs).unwrap());
    // The small shim of the same build, beside `locker` as installed.
    let shim = locker_runtime::node::find_shim(&locker_bin());
    let shim_arg = if shim != locker_bin() {
        put("/opt/l/locker-jail", &slim(&shim, tmp.path()));
        " /opt/l/locker-jail"
    } else {
        ""
    };

    // The guest: cgroup v2 only, the loop module in, the template disk as `default`.
    let t = format!("/var/cache/locker/templates/{digest}");
    let setup = format!(
        "set -e; chmod +x /opt/l/locker* /usr/local/sbin/mkfs.btrfs; \
         grep -q ' /sys/fs/cgroup cgroup2 ' /proc/mounts; \
         ! grep -q ' cgroup ' /proc/mounts; \
         {load}; test -e /dev/loop-control; \
         mkdir -p {t}/rootfs /var/cache/locker/templates/names; \
         cp /opt/l/meta.json {t}/; mount -o ro /dev/vda {t}/rootfs; \
         echo {digest} > /var/cache/locker/templates/names/default; \
         cd /root && LOCKER_API_KEY=k_nested_v2 LOCKER_AGENT_BIN=/opt/l/locker-agent \
         nohup /opt/l/locker serve --listen 127.0.0.1:7000 --data-dir /root/d \
         --warm-pool 0 --vm-pool 0 > /root/serve.log 2>&1 &"
    );
    let r = api.exec(&id, &json!({ "shell": setup, "timeout_ms": 120_000 }));
    assert_eq!(r["exit_code"], 0, "guest setup: {r}");

    let r = api.exec(
        &id,
        &json!({ "shell": format!("python3 /opt/l/guest.py k_nested_v2{shim_arg} 2>&1; e=$?; \
                 [ $e = 0 ] || tail -40 /root/serve.log; exit $e"),
                 "timeout_ms": 600_000 }),
    );
    let out = r["stdout"].as_str().unwrap_or_default();
    eprintln!("{out}");
    assert_eq!(r["exit_code"], 0, "jails on cgroup v2 in the guest: {out}");
    assert!(out.trim_end().ends_with("ok"), "{out}");

    api.delete(&format!("/v1/sandboxes/{id}"))
        .expect(204, "delete the microVM");
}
