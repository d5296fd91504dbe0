//! What a machine sees of its own resources (`shared/reports/newuser-2.md`, step 46):
//! `nproc`, `os.cpu_count()`, `free` and `/proc/meminfo` inside a jail tell the sandbox's
//! limits, not the host's, so `make -j$(nproc)`, JVMs and wheel builds size themselves to
//! the machine they run in. Real server, real jails (and one real microVM under TCG).

use std::time::{Duration, Instant};

use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

fn sandbox(api: &Api, body: Value) -> String {
    api.create_sandbox(&body)["id"]
        .as_str()
        .expect("a sandbox id")
        .to_owned()
}

/// A `/proc/meminfo` field in kB.
fn meminfo_kb(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k == key).then(|| v.split_whitespace().next()?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("no {key} in /proc/meminfo:\n{text}"))
}

/// The "total" column of `free -m`'s "Mem:" line.
fn free_total_mb(free: &str) -> u64 {
    free.lines()
        .find_map(|l| l.strip_prefix("Mem:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no Mem: line in `free -m`:\n{free}"))
}

/// The CPUs a machine's commands may run on (`Cpus_allowed_list` of a command).
fn allowed_cpus(api: &Api, id: &str) -> String {
    api.sh(id, "grep Cpus_allowed_list /proc/self/status | cut -f2")
        .trim()
        .to_owned()
}

#[test]
fn a_one_cpu_jail_counts_one_cpu_everywhere_it_is_asked() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api, json!({"cpus": 1, "memory_mb": 512}));
    assert_eq!(api.sh(&id, "nproc").trim(), "1", "nproc in a cpus=1 jail");
    assert_eq!(
        api.sh(&id, "getconf _NPROCESSORS_ONLN").trim(),
        "1",
        "sysconf(_SC_NPROCESSORS_ONLN) in a cpus=1 jail"
    );
    let py = api.sh(
        &id,
        "python3 -c 'import os;print(len(os.sched_getaffinity(0)), os.cpu_count())'",
    );
    assert_eq!(
        py.trim(),
        "1 1",
        "affinity and os.cpu_count() in a cpus=1 jail"
    );
    // The online list names the very CPU the machine runs on, so a program that pins its
    // threads to the listed CPUs stays where the machine was placed.
    let online = api.sh(&id, "cat /sys/devices/system/cpu/online");
    assert_eq!(online.trim(), allowed_cpus(&api, &id), "online = allowed");
    // A fraction of a CPU still needs a whole one; 1.5 needs two.
    let half = sandbox(&api, json!({"cpus": 0.5, "memory_mb": 256}));
    assert_eq!(api.sh(&half, "nproc").trim(), "1", "nproc with cpus=0.5");
    let host = std::thread::available_parallelism().map_or(1, |n| n.get());
    if host >= 2 {
        let two = sandbox(&api, json!({"cpus": 1.5, "memory_mb": 256}));
        let py = api.sh(
            &two,
            "nproc; python3 -c 'import os;print(len(os.sched_getaffinity(0)), os.cpu_count())'",
        );
        assert_eq!(py, "2\n2 2\n", "a cpus=1.5 jail counts two CPUs");
    }
}

#[test]
fn a_jail_with_as_many_cpus_as_the_host_sees_them_all_and_one_cpu_jails_spread() {
    let s = Server::start();
    let api = s.api();
    let host = std::thread::available_parallelism().map_or(1, |n| n.get());
    let all = sandbox(&api, json!({"cpus": host as f64, "memory_mb": 256}));
    let py = api.sh(
        &all,
        "nproc; python3 -c 'import os;print(len(os.sched_getaffinity(0)), os.cpu_count())'",
    );
    assert_eq!(py, format!("{host}\n{host} {host}\n"), "cpus = the host's");
    if host < 2 {
        return;
    }
    // Machines are placed round-robin over the host's CPUs: one-CPU machines started one
    // after the other do not pile up on one CPU (pinned there, they could not move away).
    // Twice as many as needed: other servers on this host advance the same cursor.
    let k = host.min(4);
    let ones: Vec<String> = (0..2 * k)
        .map(|_| sandbox(&api, json!({"cpus": 1, "memory_mb": 256})))
        .collect();
    let mut placed: Vec<String> = ones.iter().map(|id| allowed_cpus(&api, id)).collect();
    placed.sort();
    placed.dedup();
    assert!(
        placed.len() >= k,
        "{} one-CPU machines started in a row use at least {k} CPUs: {placed:?}",
        2 * k
    );
}

#[test]
fn free_and_meminfo_show_the_memory_limit_and_follow_what_the_machine_uses() {
    let s = Server::start();
    let api = s.api();
    let id = sandbox(&api, json!({"cpus": 1, "memory_mb": 512}));
    let free = api.sh(&id, "free -m");
    let total = free_total_mb(&free);
    assert!(
        (500..=512).contains(&total),
        "`free -m` shows the 512 MiB limit, not the host's memory:\n{free}"
    );
    let before = api.sh(&id, "cat /proc/meminfo");
    assert_eq!(meminfo_kb(&before, "MemTotal"), 512 * 1024, "{before}");
    eprintln!("in a cpus=1, memory_mb=512 jail:\n$ free -m\n{free}$ cat /proc/meminfo\n{before}");
    let avail_before = meminfo_kb(&before, "MemAvailable");
    assert!(
        avail_before > 300 * 1024 && avail_before <= 512 * 1024,
        "an idle 512 MiB machine has most of it available:\n{before}"
    );
    assert!(meminfo_kb(&before, "MemFree") <= avail_before, "{before}");
    // While a command holds 200 MiB, MemAvailable (read by that very command, later in its
    // life) is down by about as much.
    let during = api.sh(
        &id,
        "python3 -c '\nimport time\na = bytearray(200 << 20)\nfor i in range(0, len(a), 4096): a[i] = 1\n\
         time.sleep(1.5)\nprint(open(\"/proc/meminfo\").read())'",
    );
    let avail_during = meminfo_kb(&during, "MemAvailable");
    assert!(
        avail_during + 180 * 1024 <= avail_before,
        "MemAvailable drops by the 200 MiB a command holds: {avail_before} kB before, \
         {avail_during} kB during:\n{during}"
    );
    assert!(
        meminfo_kb(&during, "AnonPages") >= 190 * 1024,
        "the 200 MiB show as anonymous memory:\n{during}"
    );
    // Memory the machine keeps (a 200 MiB file in /tmp, a tmpfs) shows too: the view is
    // rewritten every 200 ms while a command runs, and when one starts. Its breakdown
    // (Shmem) comes from the cgroup's memory.stat, which the kernel flushes lazily (up to
    // about 2 s late on 6.x), so that part is polled.
    let kept = api.sh(
        &id,
        "head -c 200M /dev/zero > /tmp/blob && sleep 1 && grep -E '^(MemAvailable|Shmem):' /proc/meminfo",
    );
    assert!(
        meminfo_kb(&kept, "MemAvailable") + 180 * 1024 <= avail_before,
        "a 200 MiB file in /tmp is memory not available: {avail_before} kB before:\n{kept}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let kept = api.sh(&id, "grep -E '^Shmem:' /proc/meminfo");
        if meminfo_kb(&kept, "Shmem") >= 190 * 1024 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the 200 MiB file shows as Shmem: {kept}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // And it comes back once the memory is given back.
    api.sh(&id, "rm /tmp/blob");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let after = api.sh(&id, "cat /proc/meminfo");
        let avail = meminfo_kb(&after, "MemAvailable");
        if avail + 50 * 1024 >= avail_before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "MemAvailable comes back after rm: {avail_before} kB before, {avail} kB now"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn no_command_can_rewrite_its_machines_view_nor_another_machines() {
    let s = Server::start();
    let api = s.api();
    let a = sandbox(&api, json!({"cpus": 1, "memory_mb": 512}));
    let b = sandbox(&api, json!({"cpus": 1, "memory_mb": 768}));
    for (path, data) in [
        ("/proc/meminfo", "MemTotal: 1 kB"),
        ("/sys/devices/system/cpu/online", "0-63"),
    ] {
        let r = api.exec(&a, &json!({ "shell": format!("echo '{data}' > {path}") }));
        assert_ne!(r["exit_code"], 0, "writing {path} must fail: {r}");
        for how in [
            format!("chmod 666 {path}"),
            format!("umount {path}"),
            format!("umount -l {path}"),
            format!("mount -o remount,rw {path}"),
            format!("mount --bind /tmp {path}"),
        ] {
            let r = api.exec(
                &a,
                &json!({ "shell": format!("{how} && echo '{data}' > {path}") }),
            );
            assert_ne!(r["exit_code"], 0, "`{how}` then a write must fail: {r}");
        }
    }
    // Nor through the files API, which runs as the machine's root.
    assert!(
        api.write_file(&a, "/proc/meminfo", b"MemTotal: 1 kB\n")
            .status
            >= 400,
        "the files API cannot write /proc/meminfo"
    );
    // The view's mounts are read-only and name nothing of the host.
    let table = api.sh(
        &a,
        "grep -E ' /proc/meminfo | /sys/devices/system/cpu/online ' /proc/self/mountinfo",
    );
    let host = std::thread::available_parallelism().map_or(1, |n| n.get());
    // A one-CPU host pins nothing, so it has no `online` view.
    assert_eq!(
        table.lines().count(),
        if host > 1 { 2 } else { 1 },
        "{table}"
    );
    let data_dir = s.machine_dir(&a);
    let data_dir = data_dir
        .parent()
        .and_then(|p| p.parent())
        .expect("a data dir");
    for line in table.lines() {
        assert!(line.contains(" ro,"), "read-only: {line}");
        assert!(
            !line.contains(&*data_dir.to_string_lossy()) && !line.contains(&a),
            "names the host: {line}"
        );
    }
    let view_a = api.sh(&a, "cat /proc/meminfo");
    assert_eq!(meminfo_kb(&view_a, "MemTotal"), 512 * 1024, "{view_a}");
    let view_b = api.sh(&b, "cat /proc/meminfo");
    assert_eq!(meminfo_kb(&view_b, "MemTotal"), 768 * 1024, "{view_b}");
    assert_eq!(api.sh(&a, "nproc").trim(), "1");
    // Widening its own affinity gives a command its own view, not more CPU time (the
    // cgroup's quota stays) and nothing of another machine's.
    api.exec(
        &a,
        &json!({"shell": "python3 -c 'import os;os.sched_setaffinity(0, range(os.cpu_count()))'"}),
    );
    assert_eq!(api.sh(&b, "nproc").trim(), "1");
    assert_eq!(api.sh(&a, "nproc").trim(), "1", "a later command of a");
    // Nor does widening the agent's (same uid): each command is pinned as it starts.
    api.exec(
        &a,
        &json!({"shell": format!("python3 -c 'import os;os.sched_setaffinity(1, range({host}))'")}),
    );
    assert_eq!(
        api.sh(&a, "nproc").trim(),
        "1",
        "a command after one widened PID 1's affinity"
    );
}

#[test]
fn a_microvm_guest_counts_its_own_vcpus_and_memory() {
    let s = Server::start();
    let api = s.api();
    let h = api.get("/healthz").json();
    if h["runtimes"]["microvm"] != "ok" {
        eprintln!("skipped: the microVM runtime is not usable here: {h}");
        return;
    }
    let id = sandbox(
        &api,
        json!({"runtime": "microvm", "cpus": 1, "memory_mb": 256}),
    );
    let out = api.sh(&id, "nproc; free -m; cat /proc/meminfo");
    assert_eq!(out.lines().next(), Some("1"), "{out}");
    let total = free_total_mb(&out);
    assert!(
        (160..=256).contains(&total),
        "a 256 MiB guest's `free -m` total (the guest kernel keeps some):\n{out}"
    );
}
