//! Where a new sandbox goes (`FLEET.md` §4.4), and keeping placements true afterwards.
//!
//! Choosing reads an in-memory table of the nodes (refreshed from the store at most every
//! [`TABLE_TTL`], and after a lost race) and locks nothing:
//! - **filter**: the node is ready, its lease runs, and its reservations plus this
//!   sandbox fit its slots and memory (the capacity its last heartbeat reported);
//!   nodes that hold the sandbox's template are preferred when any fits (locality);
//! - **score**: the fuller of its slots and memory after this sandbox (lower is better);
//! - **choose**: best of [`BEST_OF`] fitting nodes drawn at random (the power of two
//!   choices: concurrent creators spread instead of all picking the same emptiest node).
//!
//! The commit is the store's `place`: one transaction that reserves on the node only while
//! the reservation fits (`WHERE epoch = $e AND reserved + r <= capacity`) and inserts the
//! placement; a creator that lost the race chooses again, at most [`ATTEMPTS`] times, then
//! answers 429. Then the create itself (`route`) and `set_placed`: two transactions a create.
//!
//! Afterwards: [`lose`] marks lost the placements of nodes declared dead or removed (with
//! a `sandbox.lost` event each), and [`reconcile`] gives back the reservations of
//! sandboxes their node no longer reports (ended there: TTL, failure) and of creates a
//! control replica never finished.

use std::time::{Duration, Instant};

use locker_store::{NodeRecord, NodeState, PlacementRecord, PlacementState};
use serde_json::json;

use super::wire::Report;
use crate::error::ApiError;
use crate::ids::new_id;
use crate::state::AppState;

/// How long the node table is used before it is read again.
pub const TABLE_TTL: Duration = Duration::from_millis(500);
/// Fitting nodes drawn per choice.
pub const BEST_OF: usize = 2;
/// Choices a create makes before it answers 429 (each after a lost race).
pub const ATTEMPTS: usize = 4;
/// How often the sweeper reconciles placements with what nodes report.
pub const RECONCILE: Duration = Duration::from_secs(5);
/// A sandbox absent from its node's report this long after it was placed has ended there.
const ABSENT_AFTER_MS: i64 = 10_000;
/// A sandbox a node runs without a placement, seen this long apart, is an orphan.
pub const ORPHAN_AFTER: Duration = Duration::from_secs(10);
/// A placement whose create never finished (its replica died) is given back after this.
const STARTING_FOR_MS: i64 = 10 * 60_000;
/// A create its node neither runs nor made this long after its placement never reached the
/// node (its control replica died first, or the node restarted): its reservation goes back.
/// Longer than a create takes to reach a node (connect and TLS: 5 s each at most).
pub const CREATE_GRACE_MS: i64 = 15_000;

/// The nodes as last read, with the store's clock at that read.
#[derive(Debug, Default)]
pub struct Table {
    read: Option<Instant>,
    clock_ms: i64,
    nodes: Vec<NodeRecord>,
}

impl Table {
    /// The store's clock now, as estimated from the last read.
    fn now_ms(&self) -> i64 {
        self.clock_ms
            + self
                .read
                .map_or(0, |r| i64::try_from(r.elapsed().as_millis()).unwrap_or(0))
    }
}

/// What a sandbox asks of a node.
#[derive(Debug, Clone)]
pub struct Ask {
    pub memory_mb: i64,
    /// The sandbox's disk (MiB): a node must be able to grant it (its report).
    pub disk_mb: u64,
    /// Its template's digest, when known: nodes that have it are preferred.
    pub template_digest: Option<String>,
    /// The one node it may go to (a create bound to this server's host: its volumes,
    /// secrets or snapshots live here).
    pub only: Option<String>,
    /// A sandbox carried from another node (a drain, a restart elsewhere): only a node that
    /// holds its template will do (it starts from a snapshot of it, never pulls).
    pub carried: bool,
}

/// A node's capacity, from its last report.
fn capacity(n: &NodeRecord) -> Option<(i64, i64, Report)> {
    let r: Report = serde_json::from_str(&n.report).ok()?;
    Some((i64::from(r.slots), i64::try_from(r.memory_mb).ok()?, r))
}

/// Whether node `n` is alive at the store's time `now_ms`: ready, its lease running.
pub fn alive(n: &NodeRecord, now_ms: i64) -> bool {
    n.state == NodeState::Ready && n.lease_until_ms >= now_ms
}

/// How full `n` is with `ask` placed on it (0 empty, 1 full), or `None` if it does not
/// fit, is not alive or is cordoned.
fn fit(n: &NodeRecord, ask: &Ask, now_ms: i64) -> Option<(f64, bool)> {
    if !alive(n, now_ms) || n.cordoned {
        return None;
    }
    if ask.only.as_ref().is_some_and(|only| *only != n.id) {
        return None;
    }
    let (slots, memory, report) = capacity(n)?;
    if ask.carried
        && ask
            .template_digest
            .as_ref()
            .is_some_and(|d| !report.templates.contains(d))
    {
        return None;
    }
    let (s, m) = (n.reserved_slots + 1, n.reserved_memory_mb + ask.memory_mb);
    if s > slots || m > memory || slots == 0 || memory == 0 {
        return None;
    }
    if report.disk_grantable_mb.is_some_and(|g| ask.disk_mb > g) {
        return None;
    }
    let score = (s as f64 / slots as f64).max(m as f64 / memory as f64);
    let local = ask
        .template_digest
        .as_ref()
        .is_some_and(|d| report.templates.contains(d));
    Some((score, local))
}

/// When nodes have room for `ask` but none the disk it asks for: the most disk any of
/// them can grant now (MiB). `None` when some node fits, or none would even with its disk.
fn short_of_disk(nodes: &[NodeRecord], ask: &Ask, now_ms: i64) -> Option<u64> {
    let no_disk = Ask {
        disk_mb: 0,
        ..ask.clone()
    };
    let open: Vec<&NodeRecord> = nodes
        .iter()
        .filter(|n| fit(n, &no_disk, now_ms).is_some())
        .collect();
    if open.is_empty() || open.iter().any(|n| fit(n, ask, now_ms).is_some()) {
        return None;
    }
    Some(
        open.iter()
            .filter_map(|n| capacity(n)?.2.disk_grantable_mb)
            .max()
            .unwrap_or(0),
    )
}

/// Best of [`BEST_OF`] random fitting nodes (those with the template first); `None` when
/// none fits.
pub fn choose<'a>(
    nodes: &'a [NodeRecord],
    ask: &Ask,
    now_ms: i64,
    pick: &mut impl FnMut(usize) -> usize,
) -> Option<&'a NodeRecord> {
    let fitting: Vec<(&NodeRecord, f64, bool)> = nodes
        .iter()
        .filter_map(|n| fit(n, ask, now_ms).map(|(s, l)| (n, s, l)))
        .collect();
    let with_template: Vec<_> = fitting.iter().filter(|f| f.2).copied().collect();
    let pool = if with_template.is_empty() {
        fitting
    } else {
        with_template
    };
    if pool.is_empty() {
        return None;
    }
    // BEST_OF distinct nodes, drawn without replacement (a partial shuffle).
    let mut order: Vec<usize> = (0..pool.len()).collect();
    let k = BEST_OF.min(pool.len());
    for i in 0..k {
        let j = i + pick(pool.len() - i);
        order.swap(i, j);
    }
    order[..k]
        .iter()
        .map(|&i| (pool[i].0, pool[i].1))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(n, _)| n)
}

/// A random index below `n` (the choice's draw).
fn draw(n: usize) -> usize {
    let mut b = [0u8; 8];
    let _ = locker_store::fill_random(&mut b);
    (u64::from_le_bytes(b) % n.max(1) as u64) as usize
}

/// The node table, read again when older than [`TABLE_TTL`] or when `fresh`.
pub async fn nodes(app: &AppState, fresh: bool) -> Result<(Vec<NodeRecord>, i64), ApiError> {
    let c = app.fleet.as_ref().expect("fleet control");
    {
        let t = c.table.lock().expect("table");
        if !fresh && t.read.is_some_and(|r| r.elapsed() < TABLE_TTL) {
            return Ok((t.nodes.clone(), t.now_ms()));
        }
    }
    let store = app.store.clone();
    let (nodes, clock_ms) = tokio::task::spawn_blocking(move || {
        Ok::<_, locker_store::StoreError>((store.list_nodes()?, store.clock_ms()?))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let mut t = c.table.lock().expect("table");
    *t = Table {
        read: Some(Instant::now()),
        clock_ms,
        nodes: nodes.clone(),
    };
    Ok((nodes, clock_ms))
}

/// Drops the cached node table: the next placement reads the store (a change made here,
/// like a cordon, counts at once on this replica).
pub fn forget_nodes(app: &AppState) {
    if let Some(c) = app.fleet.as_ref() {
        c.table.lock().expect("table").read = None;
    }
}

/// The nodes whose sandboxes have rows in the fleet's own store: control replicas' own
/// nodes (`--node local`). Lists and quotas read those sandboxes from their rows, and only
/// the others' from placements.
pub fn row_nodes(nodes: &[NodeRecord]) -> std::collections::HashSet<String> {
    nodes
        .iter()
        .filter(|n| super::local::is_own_node(n))
        .map(|n| n.id.clone())
        .collect()
}

/// Reserves room for a sandbox of `tenant` on a node: the placement (state `starting`) and
/// the node it is on. 429 when no node has room.
pub async fn place(
    app: &AppState,
    tenant: &str,
    ask: &Ask,
) -> Result<(PlacementRecord, NodeRecord), ApiError> {
    let mut fresh = false;
    let (mut seen, mut cordoned) = (0, 0);
    for _ in 0..ATTEMPTS {
        let (nodes, now_ms) = nodes(app, fresh).await?;
        seen = nodes.len();
        cordoned = nodes.iter().filter(|n| n.cordoned).count();
        let Some(node) = choose(&nodes, ask, now_ms, &mut draw).cloned() else {
            if let Some(most) = short_of_disk(&nodes, ask, now_ms) {
                // As one host answers a disk it cannot hold (`capacity::admit_disk`).
                return Err(ApiError::unprocessable(format!(
                    "`disk_mb` of {} MB is more than any node of the fleet can hold now: the \
                     most one can grant is {most} MB (its free space less its reserve); ask for \
                     less, or ask the operator to free space on the nodes",
                    ask.disk_mb
                )));
            }
            if fresh {
                break;
            }
            // The table may be behind (a node just freed room): read it once more.
            fresh = true;
            continue;
        };
        let Some((slots, memory, _)) = capacity(&node) else {
            fresh = true;
            continue;
        };
        let p = PlacementRecord {
            id: new_id("pl_"),
            sandbox_id: None,
            tenant: tenant.to_owned(),
            node_id: node.id.clone(),
            epoch: node.epoch,
            memory_mb: ask.memory_mb,
            state: PlacementState::Starting,
            created_ms: 0,
            view: "{}".into(),
        };
        let store = app.store.clone();
        let placed = tokio::task::spawn_blocking(move || store.place(&p, slots, memory))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
        match placed {
            Some(p) => return Ok((p, node)),
            // Lost the race (or the node moved on): choose again from a fresh table.
            None => fresh = true,
        }
    }
    let cordoned = match cordoned {
        0 => String::new(),
        n => format!(", {n} of them cordoned"),
    };
    Err(ApiError::quota(format!(
        "no capacity: no node of the fleet ({seen} known{cordoned}) has a free slot and {} MB \
         of memory for this sandbox now; retry shortly, or add nodes (`locker fleet token`)",
        ask.memory_mb
    )))
}

/// Gives a placement's reservation back (a create that failed, a sandbox deleted or gone).
pub async fn unplace(app: &AppState, placement_id: &str) {
    let (store, id) = (app.store.clone(), placement_id.to_owned());
    match tokio::task::spawn_blocking(move || store.unplace(&id)).await {
        Ok(Ok(Some(p))) => {
            if let (Some(c), Some(sb)) = (app.fleet.as_ref(), p.sandbox_id.as_deref()) {
                c.routes.forget(sb);
            }
        }
        Ok(Ok(None)) => {}
        Ok(Err(e)) => {
            tracing::warn!(placement = %placement_id, error = %e, "cannot give a placement back")
        }
        Err(e) => {
            tracing::warn!(placement = %placement_id, error = %e, "cannot give a placement back")
        }
    }
}

/// Marks lost the placements of nodes declared dead or removed, and says so (an event
/// each, for the sandbox's tenant).
pub async fn lose(app: &AppState) {
    let store = app.store.clone();
    let lost = match tokio::task::spawn_blocking(move || {
        Ok::<_, locker_store::StoreError>((store.lose_placements()?, store.list_nodes()?))
    })
    .await
    {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => {
            return tracing::warn!(error = %e, "cannot mark the placements of dead nodes lost")
        }
        Err(e) => {
            return tracing::warn!(error = %e, "cannot mark the placements of dead nodes lost")
        }
    };
    let (lost, nodes) = lost;
    for p in lost {
        let name = nodes
            .iter()
            .find(|n| n.id == p.node_id)
            .map_or("(removed)", |n| n.name.as_str());
        if let Some(c) = app.fleet.as_ref() {
            if let Some(sb) = &p.sandbox_id {
                c.routes.forget(sb);
            }
        }
        let subject = p.sandbox_id.clone().unwrap_or_else(|| p.id.clone());
        tracing::warn!(sandbox = %subject, node = %p.node_id, "sandbox lost with its node");
        if p.sandbox_id.is_some() {
            app.events.emit(
                &p.tenant,
                crate::events::Kind::SandboxLost,
                &subject,
                json!({"node": p.node_id, "node_name": name}),
            );
        }
    }
}

/// Ends the lost sandboxes of joined nodes whose TTL has passed (`expires_at` in the view
/// their node last answered; `nodes` as the sweeper read them): the placement goes (only
/// while still lost: a restart elsewhere that switched it first keeps it) with a
/// `sandbox.expired` event, as the node
/// itself would have ended it. The sandbox's record is in the dead node's own store, which
/// destroys its copy should it return (no placement names it). A control replica's own
/// node's lost sandboxes are rows of this store: `lifecycle`'s reaper ends those.
pub async fn expire_lost(app: &AppState, nodes: &[NodeRecord]) {
    let store = app.store.clone();
    let now = crate::state::now_s();
    let rows = row_nodes(nodes);
    let ended = tokio::task::spawn_blocking(move || {
        let mut ended = Vec::new();
        for p in store.list_placements(None, None)? {
            let Some(sb) = p.sandbox_id.as_deref() else {
                continue;
            };
            if p.state != PlacementState::Lost || rows.contains(&p.node_id) {
                continue;
            }
            let view: serde_json::Value = serde_json::from_str(&p.view).unwrap_or_default();
            let due = view["expires_at"]
                .as_str()
                .and_then(locker_types::parse_rfc3339)
                .is_some_and(|at| at <= now);
            // A removed replica's node is in no list: its row, if any, is the reaper's.
            if !due || store.get_sandbox_any(sb)?.is_some() {
                continue;
            }
            if let Some(gone) = store.unplace_lost(&p.id)? {
                ended.push(gone);
            }
        }
        Ok::<_, locker_store::StoreError>(ended)
    })
    .await;
    let ended = match ended {
        Ok(Ok(e)) => e,
        Ok(Err(e)) => return tracing::warn!(error = %e, "cannot end the expired lost sandboxes"),
        Err(e) => return tracing::warn!(error = %e, "cannot end the expired lost sandboxes"),
    };
    for p in ended {
        let sb = p.sandbox_id.unwrap_or_default();
        if let Some(c) = app.fleet.as_ref() {
            c.routes.forget(&sb);
        }
        tracing::info!(sandbox = %sb, node = %p.node_id, "a sandbox lost with its node expired (TTL): its placement ended");
        app.events.emit(
            &p.tenant,
            crate::events::Kind::SandboxExpired,
            &sb,
            json!({"usage": null, "node": p.node_id}),
        );
    }
}

/// Gives back the reservations of sandboxes their (live) node no longer reports, and of
/// creates never finished.
pub async fn reconcile(app: &AppState, nodes: &[NodeRecord]) {
    let store = app.store.clone();
    let placements =
        match tokio::task::spawn_blocking(move || store.list_placements(None, None)).await {
            Ok(Ok(p)) => p,
            _ => return,
        };
    for p in &placements {
        let Some(n) = nodes.iter().find(|n| n.id == p.node_id) else {
            continue;
        };
        if n.state != NodeState::Ready || n.epoch != p.epoch {
            continue;
        }
        let gone = match (&p.state, &p.sandbox_id) {
            (PlacementState::Placed, Some(sb)) => {
                let reported = capacity(n).map(|(_, _, r)| r.sandbox_ids.contains(sb));
                reported == Some(false) && n.heartbeat_ms - p.created_ms > ABSENT_AFTER_MS
            }
            (PlacementState::Starting, _) => {
                let age = n.heartbeat_ms - p.created_ms;
                match capacity(n).map(|(_, _, r)| r) {
                    Some(r) if r.made.contains_key(&p.id) => {
                        finish(app, n, p, &r.made[&p.id]).await;
                        false
                    }
                    Some(r) if !r.creating.contains(&p.id) => age > CREATE_GRACE_MS,
                    _ => age > STARTING_FOR_MS,
                }
            }
            _ => false,
        };
        if gone {
            tracing::info!(placement = %p.id, sandbox = ?p.sandbox_id, node = %n.name, "the node no longer runs this sandbox: its reservation is given back");
            unplace(app, &p.id).await;
        }
    }
    // The same read: a placement just given back named a sandbox its node no longer
    // reports, so it cannot make that sandbox look placed.
    orphans(app, nodes, &placements).await;
}

/// Records the sandbox node `n` made for placement `p` (still `starting`: the control
/// replica that asked for it went away before recording it), with its view as the node
/// shows it now; the placement goes back if the node no longer has it.
async fn finish(app: &AppState, n: &NodeRecord, p: &PlacementRecord, sb: &str) {
    if p.created_ms > n.heartbeat_ms - CREATE_GRACE_MS {
        // Its replica may still be recording it.
        return;
    }
    match super::route::view_on_node(app, n, p, sb).await {
        Ok(Some(view)) => {
            let (store, pid, sb2) = (app.store.clone(), p.id.clone(), sb.to_owned());
            if let Ok(Ok(true)) =
                tokio::task::spawn_blocking(move || store.set_placed(&pid, &sb2, &view)).await
            {
                tracing::info!(placement = %p.id, sandbox = %sb, node = %n.name, "recorded a sandbox whose create's control replica went away");
            }
        }
        Ok(None) => unplace(app, &p.id).await,
        Err(e) => {
            tracing::warn!(placement = %p.id, sandbox = %sb, node = %n.name, error = %e, "cannot read a sandbox made for an unfinished create: retrying")
        }
    }
}

/// Sandboxes a remote node runs that no placement names: a create whose control plane
/// died (or gave up) after the node made it. One is destroyed on its node when a second
/// reconciliation, [`ORPHAN_AFTER`] or more after the first, still finds it without a
/// placement (a create in flight records its placement within milliseconds). Control
/// replicas' own nodes (this server's and the others', `--node local`) are never asked:
/// their sandboxes are rows of this store, placed or not (one made before the fleet had a
/// node is a one-host sandbox, not an orphan).
async fn orphans(app: &AppState, nodes: &[NodeRecord], placements: &[PlacementRecord]) {
    let Some(c) = app.fleet.as_ref() else {
        return;
    };
    if placements.is_empty() && nodes.is_empty() {
        return;
    }
    let local = c.local_node_id();
    let mut seen: Vec<(String, String)> = Vec::new();
    for n in nodes {
        if n.state != NodeState::Ready
            || Some(n.id.as_str()) == local.as_deref()
            || super::local::is_own_node(n)
        {
            continue;
        }
        let Some((_, _, report)) = capacity(n) else {
            continue;
        };
        for sb in report.sandbox_ids {
            // Named by a placement on this node, or made for one still being recorded
            // (`finish`). A copy left on the node a sandbox moved away from (a drain whose
            // last call to it failed) is an orphan too.
            let known = placements.iter().any(|p| {
                (p.sandbox_id.as_deref() == Some(sb.as_str()) && p.node_id == n.id)
                    || report.made.get(&p.id) == Some(&sb)
            });
            if !known {
                seen.push((n.id.clone(), sb));
            }
        }
    }
    let now = Instant::now();
    let due: Vec<(String, String)> = {
        let mut suspects = c.orphans.lock().expect("orphans");
        suspects.retain(|k, _| seen.contains(k));
        for k in &seen {
            suspects.entry(k.clone()).or_insert(now);
        }
        suspects
            .iter()
            .filter(|(_, first)| now.duration_since(**first) >= ORPHAN_AFTER)
            .map(|(k, _)| k.clone())
            .collect()
    };
    for (node_id, sb) in due {
        let Some(n) = nodes.iter().find(|n| n.id == node_id) else {
            continue;
        };
        match super::route::destroy_orphan(app, n, &sb).await {
            Ok(()) => {
                tracing::warn!(sandbox = %sb, node = %n.name, "destroyed a sandbox no placement names (a create the control plane never finished)");
                c.orphans.lock().expect("orphans").remove(&(node_id, sb));
            }
            Err(e) => {
                tracing::warn!(sandbox = %sb, node = %n.name, error = %e, "cannot destroy an orphan sandbox: retrying at the next reconciliation")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(
        id: &str,
        slots: u32,
        memory_mb: u64,
        reserved: (i64, i64),
        templates: &[&str],
    ) -> NodeRecord {
        let report = Report {
            slots,
            memory_mb,
            templates: templates.iter().map(|t| t.to_string()).collect(),
            ..Report::default()
        };
        NodeRecord {
            id: id.into(),
            name: id.into(),
            address: String::new(),
            cert_sha256: String::new(),
            cert_pem: String::new(),
            public_key: String::new(),
            epoch: 1,
            state: NodeState::Ready,
            joined_at: String::new(),
            heartbeat_ms: 0,
            lease_until_ms: 10_000,
            report: serde_json::to_string(&report).unwrap(),
            reserved_slots: reserved.0,
            cordoned: false,
            reserved_memory_mb: reserved.1,
        }
    }

    fn ask(mb: i64, digest: Option<&str>) -> Ask {
        Ask {
            memory_mb: mb,
            disk_mb: 2048,
            template_digest: digest.map(str::to_owned),
            only: None,
            carried: false,
        }
    }

    /// A node whose report says it can grant `grantable` MiB of disk (`None`: an older
    /// node that does not say).
    fn with_disk(mut n: NodeRecord, grantable: Option<u64>) -> NodeRecord {
        let mut r: Report = serde_json::from_str(&n.report).unwrap();
        r.disk_grantable_mb = grantable;
        n.report = serde_json::to_string(&r).unwrap();
        n
    }

    #[test]
    fn a_node_that_cannot_grant_the_disk_is_not_chosen_and_the_shortfall_is_told() {
        let mut pick = |_n: usize| 0;
        let small = with_disk(node("small", 4, 8192, (0, 0), &[]), Some(1000));
        let big = with_disk(node("big", 4, 8192, (3, 0), &[]), Some(50_000));
        let nodes = vec![small, big];
        assert_eq!(
            choose(&nodes, &ask(256, None), 0, &mut pick).unwrap().id,
            "big"
        );
        assert_eq!(short_of_disk(&nodes, &ask(256, None), 0), None);
        // No node can grant 60 000 MB: the most one can is told.
        let huge = Ask {
            disk_mb: 60_000,
            ..ask(256, None)
        };
        assert!(choose(&nodes, &huge, 0, &mut pick).is_none());
        assert_eq!(short_of_disk(&nodes, &huge, 0), Some(50_000));
        // A node with no room at all is not a disk shortfall: that is "no capacity".
        let full = vec![with_disk(node("full", 1, 8192, (1, 0), &[]), Some(90_000))];
        assert_eq!(short_of_disk(&full, &ask(256, None), 0), None);
        // An older node that does not report its disk is left to its own check.
        let old = vec![with_disk(node("old", 4, 8192, (0, 0), &[]), None)];
        assert_eq!(choose(&old, &huge, 0, &mut pick).unwrap().id, "old");
    }

    #[test]
    fn full_dead_expired_and_cordoned_nodes_are_never_chosen() {
        let mut dead = node("dead", 8, 8192, (0, 0), &[]);
        dead.state = NodeState::Dead;
        let mut late = node("late", 8, 8192, (0, 0), &[]);
        late.lease_until_ms = 500;
        let mut cordoned = node("cordoned", 8, 8192, (0, 0), &[]);
        cordoned.cordoned = true;
        let nodes = vec![
            node("full-slots", 2, 8192, (2, 0), &[]),
            node("full-memory", 8, 1024, (1, 800), &[]),
            dead,
            late,
            cordoned,
        ];
        let mut i = 0;
        let mut pick = |n: usize| {
            i += 1;
            i % n
        };
        assert!(choose(&nodes, &ask(256, None), 1000, &mut pick).is_none());
    }

    #[test]
    fn the_emptier_of_the_draw_wins_and_templates_are_preferred() {
        let nodes = vec![
            node("busy", 4, 8192, (3, 0), &[]),
            node("idle", 4, 8192, (0, 0), &[]),
        ];
        let mut pick = |_n: usize| 0;
        assert_eq!(
            choose(&nodes, &ask(256, None), 0, &mut pick).unwrap().id,
            "idle"
        );
        // Only "busy" has the template: it is chosen while it fits.
        let nodes = vec![
            node("busy", 4, 8192, (3, 0), &["sha256:t"]),
            node("idle", 4, 8192, (0, 0), &[]),
        ];
        assert_eq!(
            choose(&nodes, &ask(256, Some("sha256:t")), 0, &mut pick)
                .unwrap()
                .id,
            "busy"
        );
        let nodes = vec![
            node("busy", 4, 8192, (4, 0), &["sha256:t"]),
            node("idle", 4, 8192, (0, 0), &[]),
        ];
        assert_eq!(
            choose(&nodes, &ask(256, Some("sha256:t")), 0, &mut pick)
                .unwrap()
                .id,
            "idle"
        );
    }
}
