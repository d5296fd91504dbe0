//! The microVM assets in a cache shared by several servers of different builds (two
//! checkouts, an upgrade in progress): one server's initramfs must not vanish under another.
//!
//! The only test of this binary: it points `LOCKER_CACHE_DIR` at a temporary cache.

use std::fs;

use locker_runtime::vm::Assets;
use locker_tests::{agent_bin, TempDir};

#[test]
fn servers_of_two_builds_keep_each_others_initramfs_and_a_lost_one_is_rebuilt() {
    let tmp = TempDir::new("vm-assets");
    let cache = tmp.0.join("cache");
    fs::create_dir_all(&cache).unwrap();
    // The host's kernel, found before the cache moves. This binary holds one test, so no
    // other thread reads the environment while it changes.
    let kernel_dir = locker_runtime::vm::kernel_dir();
    std::env::set_var("LOCKER_VM_KERNEL_DIR", &kernel_dir);
    std::env::set_var("LOCKER_CACHE_DIR", &cache);

    // Two agent builds: the same bytes, one with a byte more (never booted here).
    let agent_a = tmp.0.join("agent-a");
    let agent_b = tmp.0.join("agent-b");
    fs::copy(agent_bin(), &agent_a).unwrap();
    let mut bytes = fs::read(&agent_a).unwrap();
    bytes.push(0);
    fs::write(&agent_b, &bytes).unwrap();

    let a = Assets::prepare(&agent_a).expect("prepare build A");
    let b = Assets::prepare(&agent_b).expect("prepare build B");
    assert_ne!(a.initrd, b.initrd, "two builds, two initramfs files");
    assert!(
        a.initrd.exists(),
        "build B's start removed build A's initramfs {}",
        a.initrd.display()
    );
    assert!(b.initrd.exists());

    // Lost anyway (removed by hand, or by an older server): the next start builds it again.
    let before = fs::read(&a.initrd).unwrap();
    fs::remove_file(&a.initrd).unwrap();
    a.ensure_initrd().expect("rebuild the initramfs");
    assert_eq!(
        fs::read(&a.initrd).unwrap(),
        before,
        "the same initramfs again"
    );

    // But not from an agent that changed since the server started: its bases hold the old.
    fs::write(&agent_a, b"not the agent this server started with").unwrap();
    fs::remove_file(&a.initrd).unwrap();
    let err = a
        .ensure_initrd()
        .expect_err("a changed agent is refused")
        .to_string();
    assert!(err.contains("restart locker serve"), "{err}");
    assert!(!a.initrd.exists());
}
