//! Issue 25's drain rows: what `locker fleet drain` costs per sandbox, and how long a
//! microVM's guest stops while it moves: moved live (QEMU's pre-copy migration,
//! `LOCKER_CARRY_LIVE=1` on the nodes) beside the same kind of microVM moved cold
//! (`LOCKER_CARRY_LIVE=0` on the nodes: frozen, from a snapshot) in the same run, and a jail (cold: its disk) each time.
//!
//! The fabric is the tests' (`locker_tests::fabric`): two `locker node` processes in
//! network namespaces on a private bridge, joined to a `locker serve` on a real PostgreSQL
//! cluster of this process. Each round drains the node the sandboxes are on, so they go
//! back and forth. The guest's stop is read from its own clock, logged every 20 ms
//! (`locker_tests::GUEST_CLOCK`): the longest gap around the move. There is no peer to
//! compare with here (no other self-hosted sandbox moves a running microVM between hosts);
//! the rows compare the two ways of moving. A third sandbox, a microVM with a volume whose
//! guest appends its clock to a file of the volume through a descriptor it keeps open,
//! moves with its volume each round: how long its volume writes wait (its mounts are
//! held from the start of the move until the new node runs it) is the longest gap in that
//! file.
//!
//! Owns the server, the nodes, the namespaces and the database it makes (guards remove
//! them).

use std::time::Duration;

use anyhow::{bail, Context};
use locker_tests::fabric::{Fabric, NodeProc};
use locker_tests::server::{Api, Server};
use serde_json::{json, Value};

use crate::stats::Row;
use crate::{check_stop, Args};

const JAIL: &str = "fleet drain: a jail moved (cold: its disk), whole move";
const VM_LIVE: &str = "fleet drain: a 256 MB microVM moved live, whole move";
const VM_COLD: &str = "fleet drain: a 256 MB microVM moved cold, whole move";
const STOP_LIVE: &str = "fleet drain: its guest stopped, moved live";
const STOP_COLD: &str = "fleet drain: its guest stopped, moved cold";
const VOL_LIVE: &str = "fleet drain: a microVM with a volume moved live, whole move";
const VOL_COLD: &str = "fleet drain: a microVM with a volume moved cold, whole move";
const VOL_STOP_LIVE: &str = "fleet drain: its volume writes waited, moved live";
const VOL_STOP_COLD: &str = "fleet drain: its volume writes waited, moved cold";

/// The guest's clock appended every 20 ms to a file of its volume through a descriptor
/// kept open (fd 4), as [`locker_tests::GUEST_CLOCK`] does in memory.
const VOLUME_CLOCK: &str = "mkfifo /dev/shm/v; exec 3<>/dev/shm/v; exec 4>>/mnt/v/t; \
    while :; do echo $EPOCHREALTIME >&4; read -t 0.02 -u 3; done";

/// What one way of moving measured.
#[derive(Default)]
struct Moves {
    jail: Vec<f64>,
    vm: Vec<f64>,
    stop: Vec<f64>,
    /// The microVM with a volume: its whole moves, and the longest gap of its volume clock.
    vol_vm: Vec<f64>,
    vol_stop: Vec<f64>,
    /// Each microVM move's steps, as the drain reported them.
    steps: Vec<Value>,
}

pub fn rows(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let rounds = args.iterations.unwrap_or(5).clamp(1, 20);
    let fab = Fabric::new(2);
    let srv = crate::fleet::control_server(&fab)?;
    let live = moves(&fab, &srv, rounds, true)?;
    let cold = moves(&fab, &srv, rounds, false)?;
    let steps = |m: &Moves| {
        m.steps
            .iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (live_steps, cold_steps) = (steps(&live), steps(&cold));
    rows.push(Row::new(JAIL, "ms", live.jail.iter().chain(&cold.jail).copied().collect(), 0).note("a jail of 256 MB: reserve on the other node, freeze and snapshot, the bundle piped through the control server, release, start, the placement switched (`steps` in the drain's report)"));
    rows.push(
        Row::new(VM_LIVE, "ms", live.vm, 0)
            .vs(VM_COLD)
            .note(format!("the same steps, the copy a live migration while the guest runs (QEMU pre-copy into the stream); steps: {}", live_steps)),
    );
    rows.push(
        Row::new(VM_COLD, "ms", cold.vm, 0)
            .note(format!("`LOCKER_CARRY_LIVE=0` on both nodes: frozen, snapshot (memory and disk), bundle, release, restore; steps: {}", cold_steps)),
    );
    rows.push(
        Row::new(STOP_LIVE, "ms", live.stop, 0)
            .vs(STOP_COLD)
            .note("the longest gap in the guest's clock (logged every 20 ms by a bash loop of builtins) around the move: QEMU's last copy, the overlay, the release and the new node's restore"),
    );
    rows.push(
        Row::new(STOP_COLD, "ms", cold.stop, 0)
            .note("the same gap moved cold: from the freeze until the new node's restore ran it"),
    );
    rows.push(
        Row::new(VOL_LIVE, "ms", live.vol_vm, 0)
            .vs(VOL_COLD)
            .note("a 256 MB microVM mounting a 64 MB volume, moved live with it: its mounts held, the file server's table in the bundle, the volume sent between the release and the start"),
    );
    rows.push(Row::new(VOL_COLD, "ms", cold.vol_vm, 0).note("the same, moved cold"));
    rows.push(
        Row::new(VOL_STOP_LIVE, "ms", live.vol_stop, 0)
            .vs(VOL_STOP_COLD)
            .note("the longest gap in the clock its guest appends to a file of the volume through a descriptor kept open (every 20 ms): the hold, from the start of the move until the new node's file server took the table in and the guest ran"),
    );
    rows.push(Row::new(VOL_STOP_COLD, "ms", cold.vol_stop, 0).note("the same, moved cold"));
    Ok(())
}

/// `rounds` drains back and forth between two nodes started with `LOCKER_CARRY_LIVE` on
/// (`live`) or off, of one jail and one microVM.
fn moves(fab: &Fabric, srv: &Server, rounds: usize, live: bool) -> anyhow::Result<Moves> {
    let (admin, api) = (srv.admin(), srv.api());
    let mut nodes = Vec::new();
    for (i, name) in ["a", "b"].iter().enumerate() {
        let t = admin
            .post("/v1/fleet/tokens", &json!({"ttl_s": 600}))
            .expect(201, "mint a join token");
        let mut n = NodeProc::new(i, &format!("{name}{}", if live { "" } else { "-cold" }));
        n.env.push((
            "LOCKER_CARRY_LIVE".into(),
            if live { "1" } else { "0" }.into(),
        ));
        n.start(
            fab,
            Some((
                t["url"].as_str().context("url")?,
                t["token"].as_str().context("token")?,
            )),
            4,
        );
        nodes.push(n);
    }
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    wait(60, "the nodes alive", || {
        let l = admin.get("/v1/fleet/nodes").json()["nodes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        names.iter().all(|name| {
            l.iter()
                .any(|n| n["name"] == name.as_str() && n["alive"] == true)
        })
    })?;
    let cordon = |name: &str, on: bool| {
        let verb = if on { "cordon" } else { "uncordon" };
        admin
            .post(&format!("/v1/fleet/nodes/{name}/{verb}"), &json!({}))
            .expect(200, verb);
    };
    // Both sandboxes on the first node.
    cordon(&names[1], true);
    let made = |body: Value| -> anyhow::Result<String> {
        let r = api.post("/v1/sandboxes", &body);
        if r.status != 201 {
            bail!("create: {}", r.text());
        }
        Ok(r.json()["id"].as_str().context("id")?.to_owned())
    };
    let jail = made(json!({"runtime": "jail", "ttl_s": 900, "memory_mb": 256}))?;
    let vm = made(json!({"runtime": "microvm", "ttl_s": 900, "memory_mb": 256}))?;
    api.post(
        &format!("/v1/sandboxes/{vm}/processes"),
        &json!({"cmd": ["bash", "-c", locker_tests::GUEST_CLOCK]}),
    )
    .expect(200, "the guest's clock");
    let volume = format!("drain-{}", if live { "live" } else { "cold" });
    let v = api.post("/v1/volumes", &json!({"name": volume, "size_mb": 64}));
    if v.status != 201 {
        bail!("volume: {}", v.text());
    }
    let vol_vm = made(json!({"runtime": "microvm", "ttl_s": 900, "memory_mb": 256,
                             "volumes": [{"volume": volume, "path": "/mnt/v"}]}))?;
    api.post(
        &format!("/v1/sandboxes/{vol_vm}/processes"),
        &json!({"cmd": ["bash", "-c", VOLUME_CLOCK]}),
    )
    .expect(200, "the volume's clock");
    let mut out = Moves::default();
    for k in 0..rounds {
        check_stop()?;
        let (from, to) = (&names[k % 2], &names[(k + 1) % 2]);
        cordon(to, false);
        let asked = locker_tests::unix_ns();
        let r = admin.post(&format!("/v1/fleet/nodes/{from}/drain"), &json!({}));
        let report = r.json();
        let moved = report["moved"].as_array().cloned().unwrap_or_default();
        if r.status != 200 || moved.len() != 3 {
            bail!("drain {from}: {}", r.text());
        }
        for m in moved {
            let ms = m["ms"].as_f64().unwrap_or(f64::NAN);
            if m["sandbox"] == jail.as_str() {
                out.jail.push(ms);
            } else if m["sandbox"] == vol_vm.as_str() {
                out.vol_vm.push(ms);
            } else {
                out.vm.push(ms);
                out.steps.push(m["steps"].clone());
            }
        }
        let log = answered(&api, &vm, "cat /dev/shm/t")?;
        out.stop
            .push(locker_tests::guest_stop(&log, asked).1 as f64);
        let log = answered(&api, &vol_vm, "tail -n 2000 /mnt/v/t")?;
        out.vol_stop
            .push(locker_tests::guest_stop(&log, asked).1 as f64);
    }
    for id in [&jail, &vm, &vol_vm] {
        api.delete(&format!("/v1/sandboxes/{id}"));
    }
    api.delete(&format!("/v1/volumes/{volume}"));
    drop(nodes);
    for name in &names {
        admin.delete(&format!("/v1/fleet/nodes/{name}"));
    }
    Ok(out)
}

/// What `shell` printed in sandbox `id`, once it answers (it just moved).
fn answered(api: &Api, id: &str, shell: &str) -> anyhow::Result<String> {
    let mut got = None;
    wait(30, "the moved sandbox answering", || {
        let r = api.post(
            &format!("/v1/sandboxes/{id}/exec"),
            &json!({"shell": shell}),
        );
        if r.status == 200 {
            got = r.json()["stdout"].as_str().map(str::to_owned);
        }
        got.is_some()
    })?;
    got.context("stdout")
}

fn wait(secs: u64, what: &str, mut ok: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !ok() {
        if std::time::Instant::now() > deadline {
            bail!("{what}: not within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
