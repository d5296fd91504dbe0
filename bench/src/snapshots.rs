//! Snapshots, forks, pause and resume, measured over HTTP against a real server.
//!
//! The create-from-snapshot and fork rows run up to three times: on the default temporary
//! directory with disks kept on it (`--cow-disks off`; on ext4 a fork copies its point),
//! with Locker's own XFS image where that directory cannot reflink (`--cow-disks auto`,
//! the server's default; see `locker_runtime::cow_disks`), and on a throwaway XFS data dir
//! with reflinks (a loop-mounted image under /var/tmp). Everything mounted is unmounted
//! and removed by a guard or by the harness's server.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

use crate::stats::{Row, Target};
use crate::{check_stop, Args};

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn post(api: &Api, path: &str, body: &Value, want: u16) -> anyhow::Result<Value> {
    let r = api
        .try_request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            serde_json::to_vec(body)?.as_slice(),
        )
        .with_context(|| format!("POST {path}"))?;
    if r.status != want {
        bail!("POST {path}: HTTP {}: {}", r.status, r.text());
    }
    Ok(if r.body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&r.body)?
    })
}

fn delete(api: &Api, path: &str) -> anyhow::Result<()> {
    let r = api
        .try_request("DELETE", path, &[], ())
        .with_context(|| format!("DELETE {path}"))?;
    if r.status != 204 {
        bail!("DELETE {path}: HTTP {}: {}", r.status, r.text());
    }
    Ok(())
}

fn id(v: &Value) -> anyhow::Result<String> {
    Ok(v["id"].as_str().context("no id")?.to_owned())
}

/// A loop-mounted XFS filesystem with reflinks, removed on drop.
struct CowDir {
    img: PathBuf,
    mnt: PathBuf,
}

impl CowDir {
    fn new() -> anyhow::Result<Option<CowDir>> {
        if locker_runtime::doctor::which("mkfs.xfs").is_none() {
            return Ok(None);
        }
        let base = Path::new("/var/tmp").join(format!("locker-bench-xfs-{}", std::process::id()));
        let (img, mnt) = (base.with_extension("img"), base.clone());
        std::fs::create_dir_all(&mnt)?;
        let f = std::fs::File::create(&img)?;
        f.set_len(16 << 30)?;
        drop(f);
        let guard = CowDir {
            img: img.clone(),
            mnt: mnt.clone(),
        };
        let ok = Command::new("mkfs.xfs")
            .args(["-q", "-f", "-m", "reflink=1"])
            .arg(&img)
            .status()?
            .success()
            && Command::new("mount")
                .args(["-o", "loop"])
                .arg(&img)
                .arg(&mnt)
                .status()?
                .success();
        if !ok {
            bail!(
                "could not make an XFS filesystem with reflinks at {}",
                mnt.display()
            );
        }
        Ok(Some(guard))
    }
}

impl Drop for CowDir {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
        let _ = std::fs::remove_dir(&self.mnt);
        let _ = std::fs::remove_file(&self.img);
    }
}

/// Ten creates from the template at once (one thread each) until all ten answer, `n`
/// times: what a fork ×10 is measured against.
fn create_ten_row(api: &Api, n: usize, label: &str) -> anyhow::Result<Row> {
    let mut samples = Vec::new();
    for _ in 0..n {
        check_stop()?;
        let t = Instant::now();
        let made: Vec<anyhow::Result<String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..10)
                .map(|_| {
                    s.spawn(|| {
                        id(&post(
                            api,
                            "/v1/sandboxes",
                            &json!({"memory_mb": 256, "disk_mb": 1024}),
                            201,
                        )?)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a create thread panicked")))
                })
                .collect()
        });
        samples.push(ms(t));
        let mut first_err = None;
        for m in made {
            match m {
                Ok(c) => delete(api, &format!("/v1/sandboxes/{c}"))?,
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
    }
    Ok(Row::new(
        format!("create ×10 at once from the template ({label})"),
        "ms",
        samples,
        0,
    )
    .note(
        "ten POST /v1/sandboxes {\"memory_mb\":256,\"disk_mb\":1024} at once, one thread each, until all ten answer",
    ))
}

/// Fork ×10 of a sandbox that wrote 200 MB, `n` times; the children are deleted between.
fn fork_rows(api: &Api, n: usize, label: &str) -> anyhow::Result<Row> {
    // 1 GB disks: eleven of them fit the 16 GB XFS data dir's disk quota.
    let parent = id(&post(
        api,
        "/v1/sandboxes",
        &json!({"memory_mb": 256, "disk_mb": 1024}),
        201,
    )?)?;
    let r = post(
        api,
        &format!("/v1/sandboxes/{parent}/exec"),
        &json!({"shell": "head -c 200000000 /dev/urandom > /root/data && sync && echo ok"}),
        200,
    )?;
    if r["stdout"] != "ok\n" {
        bail!("writing 200 MB failed: {r}");
    }
    let mut samples = Vec::new();
    for _ in 0..n {
        check_stop()?;
        let t = Instant::now();
        let v = post(
            api,
            &format!("/v1/sandboxes/{parent}/fork"),
            &json!({"count": 10}),
            201,
        )?;
        samples.push(ms(t));
        for c in v["sandboxes"].as_array().context("no sandboxes")? {
            delete(api, &format!("/v1/sandboxes/{}", id(c)?))?;
        }
    }
    delete(api, &format!("/v1/sandboxes/{parent}"))?;
    Ok(Row::new(format!("fork ×10 of a sandbox with 200 MB written ({label})"), "ms", samples, 0)
        .note("POST /v1/sandboxes/{id}/fork {\"count\":10} until all ten answer; one frozen, flushed copy of the disk, then ten machines started from it concurrently, each on a blank disk over that copy as a shared read-only layer"))
}

/// Create→true from the template and from a snapshot of `sb` (after writing 20 MB in it).
fn create_rows(
    api: &Api,
    sb: &str,
    creates: usize,
    label: &str,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    post(
        api,
        &format!("/v1/sandboxes/{sb}/exec"),
        &json!({"shell": "head -c 20000000 /dev/urandom > /root/data"}),
        200,
    )?;
    let snap = id(&post(
        api,
        &format!("/v1/sandboxes/{sb}/snapshots"),
        &json!({}),
        201,
    )?)?;
    let (mut from_tpl, mut from_snap) = (vec![], vec![]);
    for i in 0..2 + creates {
        check_stop()?;
        for (body, out) in [
            (json!({}), &mut from_tpl),
            (json!({"from_snapshot": snap}), &mut from_snap),
        ] {
            let t = Instant::now();
            let c = id(&post(api, "/v1/sandboxes", &body, 201)?)?;
            post(
                api,
                &format!("/v1/sandboxes/{c}/exec"),
                &json!({"cmd": ["true"]}),
                200,
            )?;
            if i >= 2 {
                out.push(ms(t));
            }
            delete(api, &format!("/v1/sandboxes/{c}"))?;
        }
    }
    let tpl = format!("create→true from the template ({label})");
    rows.push(Row::new(tpl.clone(), "ms", from_tpl, 2));
    rows.push(
        Row::new(format!("create→true from a snapshot ({label})"), "ms", from_snap, 2)
            .note("the snapshot holds 20 MB of data; the new sandbox gets a blank disk over the snapshot's image, mounted read-only as a lower layer (nothing copied)")
            .vs(&tpl),
    );
    delete(api, &format!("/v1/snapshots/{snap}"))
}

pub fn snapshot_rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let srv = Server::start();
    let api = srv.api();
    let (warm, n) = (args.warmup, args.fast().min(100));

    // Pause and resume of a warm sandbox.
    let sb = id(&post(&api, "/v1/sandboxes", &json!({}), 201)?)?;
    post(
        &api,
        &format!("/v1/sandboxes/{sb}/processes"),
        &json!({"shell": "sleep 100000"}),
        200,
    )?;
    let (mut pause, mut resume) = (vec![], vec![]);
    for i in 0..warm + n {
        check_stop()?;
        let t = Instant::now();
        post(&api, &format!("/v1/sandboxes/{sb}/pause"), &json!({}), 200)?;
        let p = ms(t);
        let t = Instant::now();
        post(&api, &format!("/v1/sandboxes/{sb}/resume"), &json!({}), 200)?;
        if i >= warm {
            pause.push(p);
            resume.push(ms(t));
        }
    }
    rows.push(
        Row::new("pause (HTTP)", "ms", pause, warm)
            .note("cgroup freezer, waiting until frozen, state recorded")
            .target(Target::P50(20.0)),
    );
    rows.push(
        Row::new("resume (HTTP)", "ms", resume, warm)
            .note("thaw, state recorded")
            .target(Target::P50(20.0)),
    );

    // Create from the template versus from a snapshot.
    let fs = locker_runtime::doctor::check(&srv.data_dir).host;
    create_rows(
        &api,
        &sb,
        args.creates().min(30),
        &format!("{} data dir", fs.data_dir_fs),
        rows,
    )?;
    delete(&api, &format!("/v1/sandboxes/{sb}"))?;

    // Forks: plain copies on this host's temp dir (the harness's servers keep disks on
    // the data dir: `--cow-disks off`), then on Locker's own XFS image where the data dir
    // cannot reflink (the default), then on an XFS data dir.
    let forks = 3;
    let plain = if fs.copy_on_write == "reflink" || fs.copy_on_write == "btrfs-subvolume" {
        format!("{} data dir, {}", fs.data_dir_fs, fs.copy_on_write)
    } else {
        format!("{} data dir, copy", fs.data_dir_fs)
    };
    let ten = create_ten_row(&api, forks, &format!("{} data dir", fs.data_dir_fs))?;
    let ten_label = ten.name.clone();
    rows.push(ten);
    rows.push(
        fork_rows(&api, forks, &plain)?
            .vs(&ten_label)
            .note("target ≤ 1 s applies to a copy-on-write data dir"),
    );
    let image = !locker_runtime::cow_disks::reflinks(&srv.data_dir)
        && locker_runtime::cow_disks::support().is_ok();
    drop(srv);
    if image {
        let label = format!("{} data dir, Locker's XFS image", fs.data_dir_fs);
        let srv = Server::start_with_env(&[], &[("LOCKER_COW_DISKS", "auto")]);
        let api = srv.api();
        let sb = id(&post(&api, "/v1/sandboxes", &json!({}), 201)?)?;
        create_rows(&api, &sb, args.creates().min(30), &label, rows)?;
        delete(&api, &format!("/v1/sandboxes/{sb}"))?;
        let ten = create_ten_row(&api, forks, &label);
        let r = fork_rows(&api, forks, &label);
        drop(srv);
        let ten = ten?;
        let ten_label = ten.name.clone();
        rows.push(ten);
        rows.push(r?.vs(&ten_label).target(Target::P50(1000.0)));
    }
    match CowDir::new()? {
        None => rows.push(Row::skipped(
            "fork ×10 of a sandbox with 200 MB written (XFS reflink data dir)",
            "mkfs.xfs not found (apt-get install xfsprogs)",
        )),
        Some(cow) => {
            let old = std::env::var_os("TMPDIR");
            std::env::set_var("TMPDIR", &cow.mnt);
            let srv = Server::start();
            match old {
                Some(o) => std::env::set_var("TMPDIR", o),
                None => std::env::remove_var("TMPDIR"),
            }
            let api = srv.api();
            let sb = id(&post(&api, "/v1/sandboxes", &json!({}), 201)?)?;
            create_rows(
                &api,
                &sb,
                args.creates().min(30),
                "XFS reflink data dir",
                rows,
            )?;
            delete(&api, &format!("/v1/sandboxes/{sb}"))?;
            let ten = create_ten_row(&api, forks, "XFS reflink data dir");
            let r = fork_rows(&api, forks, "XFS reflink data dir");
            drop(srv);
            let ten = ten?;
            let ten_label = ten.name.clone();
            rows.push(ten);
            rows.push(r?.vs(&ten_label).target(Target::P50(1000.0)));
            drop(cow);
        }
    }
    Ok(())
}
