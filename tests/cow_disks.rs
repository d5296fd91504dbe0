//! Locker's XFS image for sandboxes' disks and snapshots (`locker_runtime::cow_disks`,
//! issue 20 point 5): on a data dir that cannot reflink, a server started with the
//! default `--cow-disks auto` on a fresh data dir makes `<data-dir>/disks.xfs`, mounts it
//! at `<data-dir>/disks`, and keeps machines and snapshots there, so a fork of a sandbox
//! with data written shares its blocks instead of copying them. The image is adopted by a
//! restarted server, mounted again after it was unmounted (a reboot), and never made for a
//! data dir that already holds sandboxes. The harness removes it with the data dir.

use std::path::Path;

use locker_runtime::cow_disks;
use locker_tests::become_subreaper;
use locker_tests::server::Server;
use serde_json::{json, Value};

fn id_of(v: &Value) -> String {
    v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id in {v}"))
        .to_owned()
}

/// Bytes in use on the filesystem mounted at `dir`.
fn used(dir: &Path) -> u64 {
    let out = std::process::Command::new("df")
        .args(["--output=used", "-B1"])
        .arg(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("df {}: {out:?}", dir.display()))
}

fn fstype(dir: &Path) -> String {
    let out = std::process::Command::new("findmnt")
        .args(["-n", "-o", "FSTYPE", "--mountpoint"])
        .arg(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn forks_share_blocks_on_lockers_xfs_image_which_survives_restarts_and_remounts() {
    become_subreaper();
    let mut srv = Server::start_with_env(&[], &[("LOCKER_COW_DISKS", "auto")]);
    let data = srv.data_dir.clone();
    if cow_disks::reflinks(&data) {
        eprintln!("the data dir's filesystem reflinks: no image to test here");
        return;
    }
    let mnt = data.join(cow_disks::MOUNT);
    let meta = std::fs::metadata(data.join(cow_disks::IMAGE)).expect("the image is made");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "root's alone");
    assert_eq!(fstype(&mnt), "xfs", "mounted at {}", mnt.display());
    assert!(cow_disks::reflinks(&mnt));
    assert!(
        !data.join("sandboxes").exists()
            || std::fs::read_dir(data.join("sandboxes"))
                .unwrap()
                .next()
                .is_none()
    );

    let api = srv.api();
    let sb = id_of(&api.create_sandbox(&json!({"memory_mb": 256, "disk_mb": 1024})));
    assert!(
        srv.machine_dir(&sb).starts_with(&mnt),
        "{}",
        srv.machine_dir(&sb).display()
    );
    api.sh(
        &sb,
        "head -c 100M /dev/urandom > /root/big && sha256sum /root/big > /root/sum && sync",
    );
    let before = used(&mnt);
    let forked = api
        .post(&format!("/v1/sandboxes/{sb}/fork"), &json!({"count": 3}))
        .expect(201, "fork");
    let kids: Vec<String> = forked["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(id_of)
        .collect();
    let grown = used(&mnt).saturating_sub(before);
    assert!(
        grown < 40 << 20,
        "a fork of a sandbox with 100 MB written took {grown} bytes: its blocks were copied"
    );
    for k in &kids {
        assert_eq!(
            api.sh(k, "sha256sum -c /root/sum >/dev/null && echo ok"),
            "ok\n"
        );
    }
    // Writes after the point are each sandbox's own.
    api.sh(&sb, "echo parent > /root/after");
    assert_eq!(
        api.sh(&kids[0], "cat /root/after 2>/dev/null || echo none"),
        "none\n"
    );

    // A snapshot shares blocks too, and outlives a restart of the server.
    let snap = api
        .post_empty(&format!("/v1/sandboxes/{sb}/snapshots"))
        .expect(201, "snapshot");
    let snap_id = id_of(&snap);
    assert!(
        snap["size_bytes"].as_u64().unwrap() > 100 << 20,
        "the snapshot holds the data: {snap}"
    );
    srv.restart();
    let api = srv.api();
    assert_eq!(
        api.sh(&kids[1], "sha256sum -c /root/sum >/dev/null && echo ok"),
        "ok\n"
    );
    for id in kids.iter().chain([&sb]) {
        api.delete(&format!("/v1/sandboxes/{id}"))
            .expect(204, "delete");
    }

    // A reboot: nothing runs, the image is unmounted; the next start mounts it again.
    srv.kill9();
    cow_disks::unmount(&data).unwrap();
    assert_eq!(fstype(&mnt), "", "unmounted");
    srv.restart();
    assert_eq!(fstype(&mnt), "xfs", "mounted again at start");
    let api = srv.api();
    let child = id_of(&api.create_sandbox(&json!({"from_snapshot": snap_id})));
    assert_eq!(
        api.sh(&child, "sha256sum -c /root/sum >/dev/null && echo ok"),
        "ok\n"
    );
    api.delete(&format!("/v1/sandboxes/{child}"))
        .expect(204, "delete");
}

#[test]
fn a_data_dir_that_already_holds_sandboxes_keeps_them_where_they_are() {
    become_subreaper();
    // Made by a server told not to make the image…
    let mut srv = Server::start();
    let data = srv.data_dir.clone();
    if cow_disks::reflinks(&data) {
        return;
    }
    let api = srv.api();
    let sb = id_of(&api.create_sandbox(&json!({"memory_mb": 128})));
    api.sh(&sb, "echo kept > /root/f");
    // …and restarted with the default: its sandbox stays on the data dir, no image.
    srv.set_env(&[("LOCKER_COW_DISKS", "auto")]);
    srv.restart();
    assert!(!data.join(cow_disks::IMAGE).exists());
    assert!(srv.machine_dir(&sb).starts_with(data.join("sandboxes")));
    assert_eq!(srv.api().sh(&sb, "cat /root/f"), "kept\n");
    let log = srv.log_text();
    assert!(
        log.contains("made before Locker's XFS image"),
        "the log says why"
    );
}
