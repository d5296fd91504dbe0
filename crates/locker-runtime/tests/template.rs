//! Templates, for real: digests, spec validation, imports into a private cache, builds with
//! mmdebstrap that fail or succeed, concurrent builds of one digest, and recovery from an
//! interrupted build.
//!
//! Needs root, GNU tar with xz and zstd, util-linux, mmdebstrap and access to
//! deb.debian.org. Every test uses its own cache directory and removes it, even when it
//! fails; none touches /var/cache/locker.

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use locker_runtime::template::{
    default_spec, NoProgress, Progress, TemplateError, TemplateSpec, TemplateStore,
};

/// A private cache directory, unmounted and removed when dropped.
struct TempCache {
    dir: PathBuf,
}

impl TempCache {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("locker-test-{tag}-{}", std::process::id()));
        cleanup(&dir);
        fs::create_dir_all(&dir).unwrap();
        TempCache {
            dir: dir.canonicalize().unwrap(),
        }
    }

    fn store(&self) -> TemplateStore {
        TemplateStore::open(self.dir.join("cache")).unwrap()
    }

    fn templates(&self) -> PathBuf {
        self.dir.join("cache/templates")
    }

    /// Entries of templates/ other than the fixed `names` and `.locks`.
    fn template_entries(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.templates())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n != "names" && n != ".locks")
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempCache {
    fn drop(&mut self) {
        cleanup(&self.dir);
    }
}

fn mounts_under(dir: &Path) -> Vec<String> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let prefix = dir.to_str().unwrap();
    let mut v: Vec<String> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(prefix))
        .map(str::to_string)
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.len()));
    v
}

fn cleanup(dir: &Path) {
    for m in mounts_under(dir) {
        let _ = Command::new("umount").arg("-l").arg(&m).status();
    }
    let _ = fs::remove_dir_all(dir);
}

/// Records step names and checks every fraction is within 0..=1.
#[derive(Default)]
struct Steps {
    names: Vec<String>,
    finished: Option<bool>,
}

impl Progress for Steps {
    fn step(&mut self, name: &str, fraction: f64) {
        assert!((0.0..=1.0).contains(&fraction), "{name}: {fraction}");
        self.names.push(name.to_string());
    }
    fn fraction(&mut self, fraction: f64) {
        assert!((0.0..=1.0).contains(&fraction), "{fraction}");
    }
    fn finish(&mut self, ok: bool) {
        assert!(self.finished.is_none(), "finish is called once");
        self.finished = Some(ok);
    }
}

fn spec(name: &str, packages: &[&str], run: &[&str]) -> TemplateSpec {
    TemplateSpec {
        name: name.into(),
        base: "debian:bookworm".into(),
        packages: packages.iter().map(|s| s.to_string()).collect(),
        run: run.iter().map(|s| s.to_string()).collect(),
    }
}

/// A small root filesystem tarball made with `tar` from a temp dir.
fn make_tarball(dir: &Path, file_name: &str, compress: &str, marker: &str) -> PathBuf {
    let src = dir.join(format!("src-{file_name}"));
    fs::create_dir_all(src.join("etc")).unwrap();
    fs::create_dir_all(src.join("bin")).unwrap();
    fs::write(
        src.join("etc/os-release"),
        format!("ID=locker-test\nMARKER={marker}\n"),
    )
    .unwrap();
    fs::write(src.join("bin/hello"), "#!/bin/sh\necho hello\n").unwrap();
    fs::set_permissions(src.join("bin/hello"), fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("hello", src.join("bin/hi")).unwrap();
    let out = dir.join(file_name);
    let mut cmd = Command::new("tar");
    if !compress.is_empty() {
        cmd.arg(compress);
    }
    let ok = cmd
        .arg("-cf")
        .arg(&out)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .status()
        .unwrap();
    assert!(ok.success());
    out
}

#[test]
fn digest_ignores_the_name_and_package_order() {
    let a = spec("a", &["jq", "curl"], &["echo one", "echo two"]);
    let b = spec("b", &["curl", "jq", "jq"], &["echo one", "echo two"]);
    assert_eq!(
        a.digest(),
        b.digest(),
        "names and package order must not matter"
    );
    assert_eq!(a.digest().len(), 64);
    assert!(a
        .digest()
        .bytes()
        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    let swapped = spec("a", &["jq", "curl"], &["echo two", "echo one"]);
    assert_ne!(a.digest(), swapped.digest(), "run steps run in order");
    assert_ne!(
        a.digest(),
        spec("a", &["jq"], &["echo one", "echo two"]).digest()
    );
    // Pinned: changing how a spec is hashed (or SPEC_FORMAT) must be a deliberate act,
    // since every cache on every host would rebuild.
    assert_eq!(
        default_spec().digest(),
        "91cd7d95baf02d0fa69e85243acd253fc2d083dae2e7e1b3d6a71d71d09815cf"
    );
}

#[test]
fn spec_validation_says_what_to_fix() {
    let err = |json: &str| TemplateSpec::from_json(json).unwrap_err().to_string();
    assert!(err(r#"{"name":"x","pakages":["jq"]}"#).contains("unknown field `pakages`"));
    assert!(err(r#"{"packages":["jq"]}"#).contains("missing field `name`"));
    let base = err(r#"{"name":"x","base":"ubuntu:jammy"}"#);
    assert!(
        base.contains("ubuntu:jammy") && base.contains("debian:bookworm"),
        "{base}"
    );
    assert!(err(r#"{"name":"Bad Name"}"#).contains("invalid template name"));
    assert!(err(r#"{"name":"x","packages":["jq; rm -rf /"]}"#).contains("not a Debian package"));
    assert!(err(r#"{"name":"x","run":["  "]}"#).contains("run step 1 is empty"));
    let ok = TemplateSpec::from_json(r#"{"name":"py","packages":["python3"]}"#).unwrap();
    assert_eq!(ok.base, "debian:bookworm");
    assert!(ok.run.is_empty());
    // The store refuses invalid specs before doing anything.
    let cache = TempCache::new("invalid");
    let bad = spec("x", &["jq"], &[]);
    let bad = TemplateSpec {
        base: "alpine:3".into(),
        ..bad
    };
    let e = cache.store().build(&bad, &mut NoProgress).unwrap_err();
    assert!(matches!(e, TemplateError::UnsupportedBase(_)), "{e}");
    assert!(cache.template_entries().is_empty());
}

#[test]
fn import_extracts_lists_and_resolves() {
    let cache = TempCache::new("import");
    let store = cache.store();
    let gz = make_tarball(&cache.dir, "a.tar.gz", "-z", "one");
    let t = store.import("tiny", &gz, &mut NoProgress).unwrap();
    assert_eq!(t.name, "tiny");
    assert_eq!(t.rootfs, cache.templates().join(&t.digest).join("rootfs"));
    assert!(t.packages.is_empty());
    assert!(t.size_bytes > 0);
    let os = fs::read_to_string(t.rootfs.join("etc/os-release")).unwrap();
    assert!(os.contains("MARKER=one"));
    let hello = fs::metadata(t.rootfs.join("bin/hello")).unwrap();
    assert_eq!(hello.permissions().mode() & 0o777, 0o755);
    assert_eq!(
        fs::read_link(t.rootfs.join("bin/hi")).unwrap(),
        Path::new("hello")
    );
    // The standard directories a machine needs are there even if the tarball lacked them.
    let mode = |p: &str| fs::metadata(t.rootfs.join(p)).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode("tmp"), 0o1777);
    assert_eq!(mode("var/tmp"), 0o1777);
    assert_eq!(mode("root"), 0o700);

    // Found by name, full digest, sha256: form and a 12-digit prefix.
    for key in [
        "tiny".to_string(),
        t.digest.clone(),
        format!("sha256:{}", t.digest),
        t.digest[..12].to_string(),
    ] {
        assert_eq!(
            store.resolve(&key).unwrap().unwrap().digest,
            t.digest,
            "{key}"
        );
    }
    assert!(store.resolve("nope").unwrap().is_none());
    assert!(
        store.resolve(&t.digest[..8]).unwrap().is_none(),
        "short prefixes do not match"
    );

    // The same bytes under another name share the build and return at once.
    let started = Instant::now();
    let mut steps = Steps::default();
    let t2 = store.import("tiny2", &gz, &mut steps).unwrap();
    assert_eq!(t2.digest, t.digest);
    assert!(
        !steps.names.iter().any(|s| s.contains("extracting")),
        "{:?}",
        steps.names
    );
    assert_eq!(steps.finished, Some(true));
    assert!(started.elapsed().as_secs() < 5);
    let list = store.list().unwrap();
    let rows: Vec<(&str, &str)> = list
        .iter()
        .map(|t| (t.name.as_str(), t.digest.as_str()))
        .collect();
    assert_eq!(
        rows,
        vec![("tiny", t.digest.as_str()), ("tiny2", t.digest.as_str())]
    );
    let meta = fs::read_to_string(cache.templates().join(&t.digest).join("meta.json")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
    assert_eq!(meta["names"], serde_json::json!(["tiny", "tiny2"]));
    assert_eq!(meta["digest"], t.digest.as_str());
    assert!(meta["created_at"].as_str().unwrap().ends_with('Z'));

    // xz and zstd work too; importing new bytes as "tiny" moves the name.
    for (file, flag) in [("b.tar.xz", "-J"), ("c.tar.zst", "--zstd"), ("d.tar", "")] {
        let path = make_tarball(&cache.dir, file, flag, file);
        let moved = store.import("tiny", &path, &mut NoProgress).unwrap();
        assert_ne!(moved.digest, t.digest);
        let os = fs::read_to_string(moved.rootfs.join("etc/os-release")).unwrap();
        assert!(os.contains(&format!("MARKER={file}")), "{file}");
        assert_eq!(store.resolve("tiny").unwrap().unwrap().digest, moved.digest);
    }
    let first = store.resolve(&t.digest).unwrap().unwrap();
    assert_eq!(first.name, "tiny2", "the first import is now only tiny2's");
    let meta = fs::read_to_string(cache.templates().join(&t.digest).join("meta.json")).unwrap();
    assert!(!meta.contains("\"tiny\""), "{meta}");
    // The xz and zstd imports are no longer named: they list with an empty name.
    let list = store.list().unwrap();
    assert_eq!(list.len(), 4);
    assert_eq!(list.iter().filter(|t| t.name.is_empty()).count(), 2);
    assert!(cache
        .template_entries()
        .iter()
        .all(|e| !e.starts_with(".tmp")));
}

#[test]
fn a_bad_tarball_fails_and_leaves_nothing() {
    let cache = TempCache::new("badtar");
    let store = cache.store();
    let junk = cache.dir.join("junk.tar");
    fs::write(&junk, "this is not a tar archive\n".repeat(100)).unwrap();
    let mut steps = Steps::default();
    let e = store
        .import("junk", &junk, &mut steps)
        .unwrap_err()
        .to_string();
    assert!(e.contains("give a tar archive"), "{e}");
    assert_eq!(steps.finished, Some(false));
    assert!(
        cache.template_entries().is_empty(),
        "{:?}",
        cache.template_entries()
    );
    assert!(store.resolve("junk").unwrap().is_none());
    assert!(store.list().unwrap().is_empty());
}

#[test]
fn concurrent_imports_of_one_tarball_extract_once() {
    let cache = TempCache::new("concurrent-import");
    let tarball = make_tarball(&cache.dir, "same.tar.gz", "-z", "same");
    let results: Vec<(String, bool)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let store = cache.store();
                let tarball = tarball.clone();
                s.spawn(move || {
                    let mut steps = Steps::default();
                    let t = store
                        .import(&format!("same-{i}"), &tarball, &mut steps)
                        .unwrap();
                    (
                        t.digest,
                        steps.names.iter().any(|n| n.contains("extracting")),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results.iter().all(|r| r.0 == results[0].0));
    assert_eq!(
        results.iter().filter(|r| r.1).count(),
        1,
        "exactly one extracts"
    );
    assert_eq!(cache.template_entries(), vec![results[0].0.clone()]);
    assert_eq!(cache.store().list().unwrap().len(), 4);
}

/// An interrupted build (process killed mid-way) leaves `.tmp-<digest>-<pid>` behind,
/// possibly with something still mounted in it. The next listing unmounts and removes it
/// once nobody holds its lock, without deleting what was mounted there.
#[test]
fn an_interrupted_build_is_cleaned_up_once_its_lock_is_free() {
    let cache = TempCache::new("stale");
    let store = cache.store();
    let digest = "ab".repeat(32);
    let stale = cache.templates().join(format!(".tmp-{digest}-4000000"));
    fs::create_dir_all(stale.join("rootfs/mnt")).unwrap();
    fs::write(stale.join("rootfs/half-written"), "x").unwrap();
    let precious = cache.dir.join("precious");
    fs::create_dir_all(&precious).unwrap();
    fs::write(precious.join("keep-me"), "data").unwrap();
    let ok = Command::new("mount")
        .arg("--bind")
        .arg(&precious)
        .arg(stale.join("rootfs/mnt"))
        .status()
        .unwrap();
    assert!(ok.success());

    // While another process holds the digest's lock, the directory is a build in progress.
    let lock = cache.templates().join(format!(".locks/{digest}.lock"));
    // One process (sh, then sleep) holds the lock, so killing it frees the lock.
    let mut holder = Command::new("sh")
        .args([
            "-c",
            "exec 9>\"$0\" && flock 9 && echo held && exec sleep 60",
        ])
        .arg(&lock)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "held\n");
    store.list().unwrap();
    assert!(
        stale.join("rootfs/half-written").exists(),
        "a held lock means in progress"
    );
    holder.kill().unwrap();
    holder.wait().unwrap();

    assert!(store.list().unwrap().is_empty());
    assert!(!stale.exists(), "the interrupted build is gone");
    assert!(mounts_under(&cache.templates()).is_empty());
    assert_eq!(
        fs::read_to_string(precious.join("keep-me")).unwrap(),
        "data"
    );
}

#[test]
fn a_build_with_a_missing_package_fails_and_leaves_nothing() {
    let cache = TempCache::new("missing-pkg");
    let store = cache.store();
    let bad = spec("broken", &["jq", "locker-no-such-package"], &[]);
    let mut steps = Steps::default();
    let e = store.build(&bad, &mut steps).unwrap_err().to_string();
    assert!(
        e.contains("Unable to locate package locker-no-such-package"),
        "{e}"
    );
    assert_eq!(steps.finished, Some(false));
    assert!(
        cache.template_entries().is_empty(),
        "{:?}",
        cache.template_entries()
    );
    assert!(mounts_under(&cache.dir).is_empty());
    assert!(store.resolve("broken").unwrap().is_none());
}

#[test]
fn a_failing_run_step_fails_the_build_and_leaves_nothing() {
    let cache = TempCache::new("failing-step");
    let store = cache.store();
    let bad = spec(
        "broken",
        &[],
        &["echo first", "echo about to fail; exit 3", "echo never"],
    );
    let e = store.build(&bad, &mut NoProgress).unwrap_err().to_string();
    assert!(
        e.contains("run step 2") && e.contains("exit status 3"),
        "{e}"
    );
    assert!(
        e.contains("about to fail"),
        "the step's last output line is kept: {e}"
    );
    assert!(
        cache.template_entries().is_empty(),
        "{:?}",
        cache.template_entries()
    );
    assert!(mounts_under(&cache.dir).is_empty());
}

/// One real (small) build, started twice at once under two names: built once, run steps
/// executed as root with /proc only during the step, leftovers of the host and of apt
/// removed, and a third build returns at once.
#[test]
fn a_small_build_runs_steps_and_builds_once_under_concurrency() {
    let cache = TempCache::new("small-build");
    let run = [
        "echo built-by-locker > /etc/locker-test",
        "test -r /proc/self/status && echo proc-ok > /root/proc-during-step",
        // Survives the step's shell unless the step's namespace takes it down.
        "cp /bin/sleep /usr/local/bin/lkr-sleeper && (lkr-sleeper 600 &)",
    ];
    let started = Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = ["small-a", "small-b"]
            .into_iter()
            .map(|name| {
                let store = cache.store();
                let spec = spec(name, &[], &run);
                s.spawn(move || {
                    let mut steps = Steps::default();
                    let t = store.build(&spec, &mut steps).unwrap();
                    (t, steps)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    eprintln!("small build took {:?}", started.elapsed());
    let (a, b) = (&results[0].0, &results[1].0);
    assert_eq!(a.digest, b.digest);
    assert_eq!((a.name.as_str(), b.name.as_str()), ("small-a", "small-b"));
    let built = results
        .iter()
        .filter(|r| r.1.names.iter().any(|n| n == "installing packages"));
    assert_eq!(built.count(), 1, "one digest, one build");
    assert_eq!(cache.template_entries(), vec![a.digest.clone()]);

    let root = &a.rootfs;
    let read = |p: &str| fs::read_to_string(root.join(p)).unwrap_or_default();
    assert_eq!(read("etc/locker-test"), "built-by-locker\n");
    assert_eq!(read("root/proc-during-step"), "proc-ok\n");
    assert_eq!(
        fs::read_dir(root.join("proc")).unwrap().count(),
        0,
        "/proc is unmounted"
    );
    assert!(mounts_under(&cache.dir).is_empty());
    let sleepers = Command::new("pgrep")
        .args(["-x", "lkr-sleeper"])
        .output()
        .unwrap();
    assert!(
        sleepers.stdout.is_empty(),
        "a step's leftover processes die with it"
    );
    assert!(root.join("bin/sh").exists() && root.join("usr/bin/apt-get").exists());
    assert!(
        !root.join("etc/resolv.conf").exists(),
        "nothing of the host's DNS setup"
    );
    assert!(!root.join("usr/sbin/policy-rc.d").exists());
    assert_eq!(read("etc/hostname"), "locker\n");
    let lists: Vec<_> = fs::read_dir(root.join("var/lib/apt/lists"))
        .unwrap()
        .collect();
    assert_eq!(lists.len(), 1, "only lists/partial is left");
    // No manual pages: at most the links alternatives make to pages that were filtered out.
    let pages: Vec<_> = fs::read_dir(root.join("usr/share/man"))
        .unwrap()
        .flatten()
        .flat_map(|section| fs::read_dir(section.path()).into_iter().flatten().flatten())
        .filter(|page| !page.file_type().unwrap().is_symlink())
        .map(|page| page.path())
        .collect();
    assert!(pages.is_empty(), "no manual pages: {pages:?}");
    let mode = fs::metadata(root.join("tmp")).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o1777);

    let again = Instant::now();
    let t = cache
        .store()
        .build(&spec("small-c", &[], &run), &mut NoProgress)
        .unwrap();
    assert_eq!(t.digest, a.digest);
    assert!(
        again.elapsed().as_secs() < 2,
        "an existing digest returns at once"
    );
    assert_eq!(cache.store().list().unwrap().len(), 3);
}
