//! MicroVM disks across snapshots, tested for real through the server: a child stands on
//! its snapshot's layers (hard links, no copy), a zero-copy point takes a running
//! machine's disk without a copy, and a microVM already on as many layers as a snapshot
//! may hold is snapshotted with its disk written out whole. (Split from `microvm.rs`,
//! whose one-at-a-time lock these tests keep: cargo runs test binaries one after another.)

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use locker_tests::server::Server;
use locker_tests::{become_subreaper, procs_naming, TempDir};
use serde_json::json;

/// One VM test at a time: TCG on two cores has no room for more.
static SERIAL: Mutex<()> = Mutex::new(());

/// Bytes a file really occupies (its allocated blocks), 0 if it is missing.
fn allocated(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).map(|m| m.blocks() * 512).unwrap_or(0)
}

/// A file's inode number (hard links share it).
fn ino(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .ino()
}

/// What machine `dir`'s QEMU has open as block nodes: (file name, format driver) of each
/// format node, asked over its QMP socket.
fn block_formats(dir: &Path) -> Vec<(String, String)> {
    use std::io::{BufRead, Write};
    let s = std::os::unix::net::UnixStream::connect(dir.join("qmp.sock")).expect("QMP");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut w = s.try_clone().expect("QMP socket");
    let mut r = std::io::BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).expect("QMP greeting");
    let mut nodes = serde_json::Value::Null;
    for cmd in ["qmp_capabilities", "query-named-block-nodes"] {
        writeln!(w, "{}", serde_json::json!({ "execute": cmd })).unwrap();
        loop {
            line.clear();
            assert!(
                r.read_line(&mut line).expect("QMP answer") > 0,
                "QMP closed"
            );
            let v: serde_json::Value = serde_json::from_str(&line).expect("QMP JSON");
            if let Some(e) = v.get("error") {
                panic!("QMP {cmd}: {e}");
            }
            if let Some(ret) = v.get("return") {
                nodes = ret.clone();
                break;
            }
        }
    }
    nodes
        .as_array()
        .expect("nodes")
        .iter()
        .filter(|n| n["drv"] != "file")
        .map(|n| {
            // A node QEMU was given its backing names itself `json:{…}` with its file in it.
            let file = n["file"].as_str().unwrap_or_default();
            let file = match file.strip_prefix("json:") {
                Some(j) => serde_json::from_str::<serde_json::Value>(j).expect("json: name")
                    ["file"]["filename"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                None => file.to_owned(),
            };
            (file, n["drv"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

/// The format QEMU opened `file` with in machine `dir` (panics if it has no such node).
fn format_of(dir: &Path, file: &Path) -> String {
    let nodes = block_formats(dir);
    let name = file.display().to_string();
    nodes
        .iter()
        .find(|(f, _)| *f == name)
        .map(|(_, d)| d.clone())
        .unwrap_or_else(|| panic!("no block node for {name}: {nodes:?}"))
}

/// The first KiB of a real qcow2 image whose header names a host file as its backing file:
/// what a guest could write onto its raw disk to be taken for a qcow2 image.
fn qcow2_header() -> Vec<u8> {
    let dir = TempDir::new("locker-qcow2-header");
    let img = dir.path().join("h.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "/etc/hostname",
            "-F",
            "raw",
        ])
        .arg(&img)
        .arg("1G")
        .status()
        .expect("qemu-img (apt-get install qemu-utils)");
    assert!(st.success());
    let mut h = std::fs::read(&img).unwrap();
    h.truncate(1024);
    assert_eq!(&h[..4], b"QFI\xfb");
    h
}

/// MicroVM children of a layered snapshot, through the real server: a child stands on its
/// snapshot's images (hard links: nothing of the parent's data copied) under a blank qcow2
/// overlay of its own; a snapshot of a child holds only what the child wrote (its overlay)
/// over the layers it stood on (`lower/`), so a grandchild sees both generations and their
/// memory. The host names each layer's format: a guest that writes a qcow2 header onto
/// its raw disk changes nothing of how its snapshot's children open it.
#[test]
fn microvm_children_of_a_snapshot_stand_on_its_layers() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    become_subreaper();
    let srv = Server::start_with(&["--vm-pool", "0"]);
    let api = srv.api();
    let create = |body: serde_json::Value| -> (String, Duration) {
        let t = Instant::now();
        let sb = api.create_sandbox(&body);
        assert_eq!(sb["runtime"], "microvm", "{sb}");
        (sb["id"].as_str().unwrap().to_owned(), t.elapsed())
    };
    let snapshot = |sb: &str| -> (String, u64, Duration) {
        let t = Instant::now();
        let s = api
            .post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
            .expect(201, "snapshot");
        assert_eq!(s["has_memory"], true, "{s}");
        (
            s["id"].as_str().unwrap().to_owned(),
            s["size_bytes"].as_u64().unwrap(),
            t.elapsed(),
        )
    };
    let count = |sb: &str| -> u64 { api.sh(sb, "cat /dev/shm/n").trim().parse().unwrap() };
    let counts_on = |sb: &str| {
        let a = count(sb);
        std::thread::sleep(Duration::from_millis(500));
        let b = count(sb);
        assert!(a > 0 && b > a, "{sb}: the counter continues ({a} then {b})");
    };
    // The guest's writable disk is /dev/vdb (the template is vda), read past its page cache.
    let head_of_disk =
        "dd if=/dev/vdb bs=1024 count=1 iflag=direct 2>/dev/null | sha256sum | cut -c1-64";
    let mb = 1u64 << 20;

    let (parent, _) = create(json!({"runtime": "microvm", "memory_mb": 256}));
    // Snapshots are kept beside the sandboxes' machines (on one filesystem: hard links).
    let snaps = srv
        .machine_dir(&parent)
        .parent()
        .and_then(Path::parent)
        .expect("the sandboxes' directory")
        .join("snapshots");
    // A qcow2 header onto the start of the raw disk (ext4 leaves its first KiB unused).
    let header = qcow2_header();
    api.write_file(&parent, "/root/hdr", &header)
        .expect(200, "upload the header");
    api.sh(
        &parent,
        "dd if=/root/hdr of=/dev/vdb bs=1024 count=1 conv=notrunc oflag=direct 2>/dev/null && rm /root/hdr",
    );
    let header_sum = locker_tests::hex_sha256(&header);
    assert_eq!(api.sh(&parent, head_of_disk).trim(), header_sum);
    // 50 MB the parent writes (random: nothing compresses it or finds it zero), and a
    // counter in memory only. Caches dropped, so memory snapshots carry no copy of it.
    let big = api.sh(
        &parent,
        "head -c 50M /dev/urandom > /root/big && sync && sha256sum /root/big | cut -c1-64 && echo 3 > /proc/sys/vm/drop_caches",
    );
    api.post(
        &format!("/v1/sandboxes/{parent}/processes"),
        &json!({"shell": "n=0; while :; do n=$((n+1)); echo $n > /dev/shm/n.new; mv /dev/shm/n.new /dev/shm/n; sleep 0.1; done"}),
    )
    .expect(200, "counter");
    api.sh(&parent, "while [ ! -s /dev/shm/n ]; do sleep 0.05; done");

    let (s1, s1_size, took) = snapshot(&parent);
    let s1_dir = snaps.join(&s1);
    eprintln!(
        "parent's snapshot: {s1_size} bytes (disk {} allocated, memory {}) in {took:?}",
        allocated(&s1_dir.join("disk.img")),
        allocated(&s1_dir.join("memory"))
    );
    let (child, took) = create(json!({"from_snapshot": s1}));
    let c_dir = srv.machine_dir(&child);
    let c_own = allocated(&c_dir.join("disk.qcow2")) + allocated(&c_dir.join("disk.img"));
    eprintln!("child from it: created in {took:?}, its own disk {c_own} bytes allocated");
    assert_eq!(api.sh(&child, "sha256sum /root/big | cut -c1-64"), big);
    counts_on(&child);
    assert_eq!(
        api.sh(&child, head_of_disk).trim(),
        header_sum,
        "the child reads its disk's first KiB as the parent wrote it"
    );
    let more = api.sh(
        &child,
        "head -c 10M /dev/urandom > /root/more && sync && sha256sum /root/more | cut -c1-64 && echo 3 > /proc/sys/vm/drop_caches",
    );
    let (s2, s2_size, took) = snapshot(&child);
    let s2_dir = snaps.join(&s2);
    let s2_disk = allocated(&s2_dir.join("disk.qcow2")) + allocated(&s2_dir.join("disk.img"));
    eprintln!(
        "child's snapshot: {s2_size} bytes (disk {s2_disk}, memory {}) in {took:?}",
        allocated(&s2_dir.join("memory"))
    );
    let (grand, took) = create(json!({"from_snapshot": s2}));
    let g_dir = srv.machine_dir(&grand);
    let g_own = allocated(&g_dir.join("disk.qcow2")) + allocated(&g_dir.join("disk.img"));
    eprintln!("grandchild: created in {took:?}, its own disk {g_own} bytes allocated");
    assert_eq!(api.sh(&grand, "sha256sum /root/big | cut -c1-64"), big);
    assert_eq!(api.sh(&grand, "sha256sum /root/more | cut -c1-64"), more);
    counts_on(&grand);
    assert_eq!(api.sh(&grand, head_of_disk).trim(), header_sum);

    // Snapshots are root's alone; the layers QEMU reads, read-only to all.
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&snaps), 0o700);
    assert_eq!(mode(&c_dir.join("layers/0.img")), 0o444);
    // The parent's snapshot: its raw disk, named so by the host whatever its bytes say.
    assert!(s1_dir.join("disk.img").is_file());
    assert!(!s1_dir.join("disk.qcow2").exists());
    assert!(
        !s1_dir.join("lower").exists(),
        "the parent stood on no layer"
    );
    // The child: the snapshot's image linked (not copied) as its layer, a blank overlay
    // of its own that holds only what it wrote since.
    assert_eq!(
        ino(&c_dir.join("layers/0.img")),
        ino(&s1_dir.join("disk.img"))
    );
    assert!(!c_dir.join("disk.img").exists());
    assert!(
        c_own < 4 * mb,
        "the child's own disk holds no copy: {c_own}"
    );
    assert_eq!(format_of(&c_dir, &c_dir.join("layers/0.img")), "raw");
    assert_eq!(format_of(&c_dir, &c_dir.join("disk.qcow2")), "qcow2");
    // The child's snapshot: its overlay (what it wrote) over the layer it stood on.
    assert_eq!(
        ino(&s2_dir.join("lower/1.img")),
        ino(&s1_dir.join("disk.img"))
    );
    assert!(!s2_dir.join("disk.img").exists());
    assert!(
        (10 * mb..25 * mb).contains(&s2_disk),
        "the child's snapshot holds what the child wrote (10 MB), not the parent's 50 MB: {s2_disk}"
    );
    // Memory (over 100 MB of a 256 MB guest) is most of it; the layer beneath is not.
    assert_eq!(
        s2_size,
        s2_disk + allocated(&s2_dir.join("memory")),
        "size_bytes counts the snapshot's own layer and its memory"
    );
    // The grandchild: both layers linked, a blank overlay of its own.
    assert_eq!(
        ino(&g_dir.join("layers/0.qcow2")),
        ino(&s2_dir.join("disk.qcow2"))
    );
    assert_eq!(
        ino(&g_dir.join("layers/1.img")),
        ino(&s1_dir.join("disk.img"))
    );
    assert!(
        g_own < 4 * mb,
        "the grandchild's own disk holds no copy: {g_own}"
    );
    assert_eq!(format_of(&g_dir, &g_dir.join("layers/1.img")), "raw");
    assert_eq!(format_of(&g_dir, &g_dir.join("layers/0.qcow2")), "qcow2");

    // Deleting both snapshots moves nothing that stands on them.
    for s in [&s1, &s2] {
        api.delete(&format!("/v1/snapshots/{s}"))
            .expect(204, "delete a snapshot stood on");
    }
    assert!(!s1_dir.exists() && !s2_dir.exists());
    assert_eq!(api.sh(&grand, "sha256sum /root/big | cut -c1-64"), big);
    assert_eq!(api.sh(&child, "sha256sum /root/more | cut -c1-64"), more);
    let data = srv.machine_dir(&parent);
    let data = data.parent().unwrap();
    for id in [&grand, &child, &parent] {
        api.delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete");
    }
    assert!(procs_naming(data).is_empty(), "no QEMU left");
}

/// A memory snapshot of sandbox `sb` through the API: its id and `size_bytes`.
fn snapshot_of(api: &locker_tests::server::Api, sb: &str) -> (String, u64) {
    let s = api
        .post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
        .expect(201, "snapshot");
    assert_eq!(s["has_memory"], true, "{s}");
    (
        s["id"].as_str().unwrap().to_owned(),
        s["size_bytes"].as_u64().unwrap(),
    )
}

/// A sandbox started from snapshot `snap` through the API: its id.
fn child_of(api: &locker_tests::server::Api, snap: &str) -> String {
    api.create_sandbox(&serde_json::json!({ "from_snapshot": snap }))["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A machine's recorded disk chain (`disk.json`): the image it writes, then its layers.
fn chain_of(dir: &Path) -> Vec<String> {
    let c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("disk.json")).expect("disk.json")).unwrap();
    std::iter::once(&c["top"])
        .chain(c["layers"].as_array().unwrap())
        .map(|v| v.as_str().unwrap().to_owned())
        .collect()
}

/// The zero-copy point of a microVM snapshot, through the real server: the image a VM
/// wrote becomes its snapshot's own image (a hard link, read-only and root's from then
/// on) and the VM goes on on a blank qcow2 overlay above it, recorded in `disk.json`, so a
/// restarted server that adopts the VM takes its next point right; a child of a point
/// sees the VM as it was then; an image below the threshold is copied instead.
#[test]
fn microvm_snapshot_point_takes_the_disk_without_a_copy() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    become_subreaper();
    let mut srv = Server::start_with(&["--vm-pool", "0"]);
    let api = srv.api();
    let mb = 1u64 << 20;
    let vm = api.create_sandbox(&json!({"runtime": "microvm", "memory_mb": 256}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let dir = srv.machine_dir(&vm);
    let snaps = dir.parent().unwrap().parent().unwrap().join("snapshots");
    let sum = |api: &locker_tests::server::Api, sb: &str, f: &str| {
        api.sh(sb, &format!("sha256sum {f} | cut -c1-64"))
    };
    let big = api.sh(
        &vm,
        "head -c 50M /dev/urandom > /root/big && sync && sha256sum /root/big | cut -c1-64 && echo 3 > /proc/sys/vm/drop_caches",
    );
    let written = ino(&dir.join("disk.img"));
    let t = Instant::now();
    let (s1, size1) = snapshot_of(&api, &vm);
    eprintln!(
        "a point of 50 MB written: {size1} bytes in {:?}",
        t.elapsed()
    );
    let s1_dir = snaps.join(&s1);
    // The snapshot's image is the one the VM wrote: linked, not copied, read-only now.
    assert_eq!(ino(&s1_dir.join("disk.img")), written);
    let m = std::fs::metadata(dir.join("disk.img")).unwrap();
    assert_eq!((m.uid(), m.permissions().mode() & 0o777), (0, 0o444));
    assert_eq!(chain_of(&dir), ["disk-1.qcow2", "disk.img"]);
    assert_eq!(format_of(&dir, &dir.join("disk-1.qcow2")), "qcow2");
    assert_eq!(format_of(&dir, &dir.join("disk.img")), "raw");
    // The VM goes on, writing its new overlay only.
    let frozen = allocated(&dir.join("disk.img"));
    let after = api.sh(
        &vm,
        "head -c 40M /dev/urandom > /root/after && sync && sha256sum /root/after | cut -c1-64 && echo 3 > /proc/sys/vm/drop_caches",
    );
    assert_eq!(sum(&api, &vm, "/root/big"), big);
    assert_eq!(
        allocated(&dir.join("disk.img")),
        frozen,
        "the layer is not written"
    );
    let own = allocated(&dir.join("disk-1.qcow2"));
    assert!((40 * mb..48 * mb).contains(&own), "the overlay: {own}");
    // A child of the point sees the VM as it was then.
    let c = child_of(&api, &s1);
    assert_eq!(sum(&api, &c, "/root/big"), big);
    assert_eq!(api.sh(&c, "test -e /root/after || echo absent"), "absent\n");

    // The server dies; the next adopts the VM and knows its chain from the record.
    srv.restart();
    let api = srv.api();
    let (s2, _) = snapshot_of(&api, &vm);
    let s2_dir = snaps.join(&s2);
    assert_eq!(
        ino(&s2_dir.join("disk.qcow2")),
        ino(&dir.join("disk-1.qcow2"))
    );
    assert_eq!(ino(&s2_dir.join("lower/1.img")), written);
    assert_eq!(chain_of(&dir), ["disk-2.qcow2", "disk-1.qcow2", "disk.img"]);
    let g = child_of(&api, &s2);
    assert_eq!(sum(&api, &g, "/root/big"), big);
    assert_eq!(sum(&api, &g, "/root/after"), after);
    // Little written since: copied, and the VM's chain stays as it is.
    api.sh(&vm, "echo small > /root/small && sync");
    let (s3, _) = snapshot_of(&api, &vm);
    let s3_dir = snaps.join(&s3);
    assert_ne!(
        ino(&s3_dir.join("disk.qcow2")),
        ino(&dir.join("disk-2.qcow2"))
    );
    assert_eq!(
        ino(&s3_dir.join("lower/1.qcow2")),
        ino(&dir.join("disk-1.qcow2"))
    );
    assert_eq!(ino(&s3_dir.join("lower/2.img")), written);
    assert_eq!(chain_of(&dir), ["disk-2.qcow2", "disk-1.qcow2", "disk.img"]);
    let h = child_of(&api, &s3);
    assert_eq!(api.sh(&h, "cat /root/small"), "small\n");
    assert_eq!(sum(&api, &h, "/root/after"), after);

    // The VM and every snapshot gone: what stands on them stands.
    api.delete(&format!("/v1/sandboxes/{vm}"))
        .expect(204, "delete the VM");
    for s in [&s1, &s2, &s3] {
        api.delete(&format!("/v1/snapshots/{s}"))
            .expect(204, "delete a snapshot");
    }
    assert_eq!(sum(&api, &c, "/root/big"), big);
    assert_eq!(sum(&api, &g, "/root/after"), after);
    assert_eq!(sum(&api, &h, "/root/big"), big);
    let data = dir.parent().unwrap().to_owned();
    for id in [&c, &g, &h] {
        api.delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete");
    }
    assert!(procs_naming(&data).is_empty(), "no QEMU left");
}

/// A microVM on as many snapshot layers as a snapshot may hold (32: each generation of a
/// sandbox made from a snapshot of a sandbox made from a snapshot adds one, a live move
/// two) is still snapshotted: its disk is written out whole into the snapshot, whose child
/// stands on one layer and reads every generation's file; its memory (a process counting
/// in `/dev/shm`) comes along as always. Before, that snapshot was refused with a 409, and
/// such a microVM could no longer move to another node.
#[test]
fn microvm_past_the_layer_limit_is_snapshotted_whole() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    become_subreaper();
    let srv = Server::start_with(&["--vm-pool", "0"]);
    let api = srv.api();
    let mut sb = api.create_sandbox(&json!({"runtime": "microvm", "memory_mb": 256}))["id"]
        .as_str()
        .unwrap()
        .to_owned();
    api.post(
        &format!("/v1/sandboxes/{sb}/processes"),
        &json!({"shell": "n=0; while :; do n=$((n+1)); echo $n > /dev/shm/n.new; mv /dev/shm/n.new /dev/shm/n; sleep 0.1; done"}),
    )
    .expect(200, "counter");
    let mut prev: Option<String> = None;
    for level in 0..=32 {
        api.sh(&sb, &format!("echo {level} > /root/l{level}"));
        if level == 32 {
            // The flattening runs `qemu-img` as root: it never reads through the machine's
            // directory, which its QEMU owns. A symlink put where the image QEMU writes
            // was (as a compromised QEMU could) fails the snapshot and reads nothing through it.
            let dir = srv.machine_dir(&sb);
            let top = if dir.join("disk.json").exists() {
                dir.join(&chain_of(&dir)[0])
            } else {
                dir.join("disk.qcow2")
            };
            assert!(top.is_file(), "{}", top.display());
            let real = top.with_extension("real");
            std::fs::rename(&top, &real).unwrap();
            // Root's qcow2 elsewhere on the host (another machine's image, say).
            let other = TempDir::new("locker-other-image");
            let planted = other.path().join("other.qcow2");
            let made = std::process::Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2"])
                .arg(&planted)
                .arg("2G")
                .status()
                .unwrap();
            assert!(made.success());
            std::os::unix::fs::symlink(&planted, &top).unwrap();
            let r = api.post_empty(&format!("/v1/sandboxes/{sb}/snapshots"));
            std::fs::remove_file(&top).unwrap();
            std::fs::rename(&real, &top).unwrap();
            assert!(
                r.status >= 400,
                "a snapshot through a symlink: {}",
                r.text()
            );
            assert_eq!(api.sh(&sb, "cat /root/l0"), "0\n", "the machine runs on");
        }
        let (snap, _) = snapshot_of(&api, &sb);
        api.delete(&format!("/v1/sandboxes/{sb}"))
            .expect(204, "delete");
        if let Some(p) = prev.take() {
            api.delete(&format!("/v1/snapshots/{p}"))
                .expect(204, "delete the snapshot below");
        }
        sb = child_of(&api, &snap);
        let layers = std::fs::read_dir(srv.machine_dir(&sb).join("layers"))
            .unwrap()
            .count();
        // Generation `level + 1` stands on `level + 1` layers, until the 33rd snapshot
        // (level 32) wrote the disk out whole.
        let want = if level < 32 { level + 1 } else { 1 };
        assert_eq!(layers, want, "the child of level {level}'s snapshot");
        prev = Some(snap);
    }
    let want: String = (0..=32).map(|i| format!("{i}\n")).collect();
    let got = api.sh(&sb, "for i in $(seq 0 32); do cat /root/l$i; done");
    assert_eq!(
        got, want,
        "every generation's file through the flattened disk"
    );
    let a: u64 = api.sh(&sb, "cat /dev/shm/n").trim().parse().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let b: u64 = api.sh(&sb, "cat /dev/shm/n").trim().parse().unwrap();
    assert!(a > 0 && b > a, "the counter goes on ({a} then {b})");
    assert!(
        srv.log_text().contains("its disk was written out whole"),
        "the server says so"
    );
    let data = srv.machine_dir(&sb).parent().unwrap().to_owned();
    api.delete(&format!("/v1/sandboxes/{sb}"))
        .expect(204, "delete");
    api.delete(&format!("/v1/snapshots/{}", prev.unwrap()))
        .expect(204, "delete");
    assert!(procs_naming(&data).is_empty(), "no QEMU left");
}
