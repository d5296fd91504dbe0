//! Moving a volume between joined nodes (`POST /v1/volumes/{id}/move {"node"}` on a volume
//! whose home is a `locker node`): control drives it and relays both streams; the nodes'
//! steps, and what each does when control goes away half way, are `volumes::handoff`'s.
//!
//! The switch is one statement on the fleet's record (`Store::move_volume`, only if the
//! home is still the old node), made after the target serves its copy and while the old
//! home holds the volume's gate, and only within half the shorter of the two nodes' waits
//! after the hold was asked for: past that, a node may have asked the fleet and been told
//! the volume is the old home's, and the move is given up instead. A failure before the
//! switch leaves the volume where it was (the home told to `stay`, the target to drop its
//! copy); after it, the volume is the target's, and a node control could not tell finds out
//! with its heartbeats.
//!
//! Owns the order of the steps and the switch. Not the nodes' steps, not the routing of
//! other calls about the volume (`volumes`).

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use locker_store::{NodeRecord, NodeState, VolumeRecord};
use serde::Deserialize;
use serde_json::json;

use super::{call_node, call_node_with, placement};
use crate::error::ApiError;
use crate::state::AppState;
use crate::volumes::handoff::{Held, RECORD_HEADER};
use crate::volumes::moving::RECEIVE_PATH;

/// How long a stream of the volume's files may take (the first copy: the whole volume).
const COPIED: Duration = Duration::from_secs(600);
/// How long a step that is no stream may take (the hold waits for writes in flight).
const STEP: Duration = Duration::from_secs(120);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveBody {
    node: String,
}

/// The move of `rec`, whose home is joined node `home`, to the node the body names: the
/// volume's view once moved (its `node` the target's id).
pub(super) async fn move_joined(
    app: &AppState,
    rec: &VolumeRecord,
    home: &NodeRecord,
    body: Body,
) -> Response {
    let asked = match axum::body::to_bytes(body, 64 << 10).await {
        Ok(b) => serde_json::from_slice::<MoveBody>(&b).map_err(|e| {
            ApiError::bad_request(format!(
                "the move's body is {{\"node\": NAME}} (a node of GET /v1/fleet/nodes): {e}"
            ))
        }),
        Err(e) => Err(ApiError::bad_request(format!("the move's body: {e}"))),
    };
    let done = match asked {
        Ok(a) => match target(app, home, &a.node).await {
            Ok(to) if to.id == home.id => view_on(app, rec, home).await,
            Ok(to) => {
                let started = Instant::now();
                let moved = run(app, rec, home, &to).await;
                if moved.is_ok() {
                    tracing::info!(volume = %rec.id, from = %home.name, to = %to.name, ms = started.elapsed().as_millis() as u64, "volume moved between joined nodes");
                }
                match moved {
                    Ok(()) => view_on(app, rec, &to).await,
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    done.unwrap_or_else(IntoResponse::into_response)
}

/// A drain's move of volume `rec` off node `from`: to the node that can grant the most disk
/// (as a new volume's home is chosen), which is answered.
pub async fn move_off(
    app: &AppState,
    rec: &VolumeRecord,
    from: &NodeRecord,
) -> Result<NodeRecord, ApiError> {
    let (nodes, now_ms) = placement::nodes(app, true).await?;
    let others: Vec<&NodeRecord> = nodes.iter().filter(|n| n.id != from.id).collect();
    let to = super::volumes::home_for(&others, rec.size_mb, now_ms)
        .cloned()
        .ok_or_else(|| {
            ApiError::quota(format!(
                "no other node is alive and open with {} MB of disk to grant",
                rec.size_mb
            ))
        })?;
    between(app, rec, from, &to).await?;
    Ok(to)
}

/// Moves volume `rec` from its home `from` to `to` (no sandbox mounting it on `from`):
/// between control replicas' own nodes the home does (`volumes::moving`, asked on its node
/// listener as a caller's move is); otherwise control drives it ([`run`]). On `Ok` the
/// fleet's record names `to`.
pub async fn between(
    app: &AppState,
    rec: &VolumeRecord,
    from: &NodeRecord,
    to: &NodeRecord,
) -> Result<(), ApiError> {
    match (
        crate::fleet::local::is_own_node(from),
        crate::fleet::local::is_own_node(to),
    ) {
        (false, false) => run(app, rec, from, to).await,
        (true, true) => {
            let path = format!("/v1/volumes/{}/move", rec.id);
            let body = Body::from(json!({ "node": to.id }).to_string());
            let extra = vec![(
                axum::http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )];
            let r = call_node_with(
                app,
                from,
                &rec.tenant,
                (Method::POST, &path),
                extra,
                body,
                Some(COPIED),
            )
            .await
            .map_err(|e| ApiError::bad_gateway(format!("node {}: {e}", from.name)))?;
            if r.status().is_success() {
                return Ok(());
            }
            let (status, text) = answer(r).await;
            Err(refused(from, "move", status, &text))
        }
        // One of each: control relays the streams, as between joined nodes; the replica's
        // side keeps its records in the fleet's store (`volumes::handoff`).
        _ => run(app, rec, from, to).await,
    }
}

/// The node a move names: another node, alive and open.
async fn target(app: &AppState, home: &NodeRecord, name: &str) -> Result<NodeRecord, ApiError> {
    let (nodes, now_ms) = placement::nodes(app, false).await?;
    let n = nodes
        .into_iter()
        .find(|n| n.name == name || n.id == name)
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "no node {name:?} in the fleet (`GET /v1/fleet/nodes` lists them)"
            ))
        })?;
    if n.id == home.id {
        return Ok(n);
    }
    if n.state != NodeState::Ready || !placement::alive(&n, now_ms) {
        return Err(ApiError::unavailable(format!(
            "node {} is not alive now: move the volume when it is back",
            n.name
        )));
    }
    if n.cordoned {
        return Err(ApiError::conflict(format!(
            "node {} is cordoned: it takes no new work (uncordon it, or name another)",
            n.name
        )));
    }
    Ok(n)
}

/// The volume's view as its home `n` answers it, with `node` (its id) and `X-Locker-Node`.
async fn view_on(app: &AppState, rec: &VolumeRecord, n: &NodeRecord) -> Result<Response, ApiError> {
    let path = format!("/v1/volumes/{}", rec.id);
    let r = call_node(
        app,
        n,
        &rec.tenant,
        (Method::GET, &path),
        Body::empty(),
        Some(STEP),
    )
    .await
    .map_err(|e| ApiError::bad_gateway(format!("node {}: {e}", n.name)))?;
    let (status, text) = answer(r).await;
    let mut view: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ApiError::bad_gateway(format!("node {} answered {status}: {e}", n.name)))?;
    if status != StatusCode::OK {
        return Ok((status, axum::Json(view)).into_response());
    }
    view["node"] = json!(n.id);
    let mut out = axum::Json(view).into_response();
    if let Ok(v) = HeaderValue::from_str(&n.name) {
        out.headers_mut().insert("x-locker-node", v);
    }
    Ok(out)
}

async fn answer(r: Response) -> (StatusCode, String) {
    let status = r.status();
    let b = axum::body::to_bytes(r.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    (status, String::from_utf8_lossy(&b).into_owned())
}

/// A node's refusal as the caller's error: a 4xx/503 passed on as the node said it, any
/// other failure a 502 naming the node and the step.
fn refused(n: &NodeRecord, step: &str, status: StatusCode, text: &str) -> ApiError {
    let message = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| text.to_owned());
    if status.is_client_error() || status == StatusCode::SERVICE_UNAVAILABLE {
        ApiError::new(status, message)
    } else {
        ApiError::bad_gateway(format!(
            "node {} failed the move's {step} ({status}): {message}",
            n.name
        ))
    }
}

/// Control's calls of one move: each a stage on a node's [`RECEIVE_PATH`].
struct Stages<'a> {
    app: &'a AppState,
    rec: &'a VolumeRecord,
    /// The fleet's record of the volume, for a joined target ([`RECORD_HEADER`]).
    record: HeaderValue,
}

impl Stages<'_> {
    /// `stage` on node `n` (with the volume's record when `with_record`): its answer when
    /// it is `want`, else the stage's error.
    async fn call(
        &self,
        n: &NodeRecord,
        (method, stage): (Method, &str),
        (with_record, body): (bool, Body),
        (want, wait): (StatusCode, Duration),
    ) -> Result<Response, ApiError> {
        let path = format!("{RECEIVE_PATH}{}?stage={stage}", self.rec.id);
        let extra = match with_record {
            true => vec![(HeaderName::from_static(RECORD_HEADER), self.record.clone())],
            false => Vec::new(),
        };
        let r = call_node_with(
            self.app,
            n,
            &self.rec.tenant,
            (method, &path),
            extra,
            body,
            Some(wait),
        )
        .await
        .map_err(|e| {
            ApiError::bad_gateway(format!("node {} at the move's {stage}: {e}", n.name))
        })?;
        if r.status() == want {
            return Ok(r);
        }
        let (status, text) = answer(r).await;
        Err(refused(n, stage, status, &text))
    }

    /// [`Stages::call`] of a `POST` with no body, answered `want`.
    async fn post(
        &self,
        n: &NodeRecord,
        stage: &str,
        want: StatusCode,
    ) -> Result<Response, ApiError> {
        let wait = if stage == "send" { COPIED } else { STEP };
        self.call(
            n,
            (Method::POST, stage),
            (false, Body::empty()),
            (want, wait),
        )
        .await
    }
}

/// The steps of `volumes::handoff`'s module doc, from `from` to `to` (alive; at least one a
/// joined node; no sandbox on `from` mounting the volume); on `Ok` the fleet's record names
/// `to`.
async fn run(
    app: &AppState,
    rec: &VolumeRecord,
    from: &NodeRecord,
    to: &NodeRecord,
) -> Result<(), ApiError> {
    let record = serde_json::to_string(rec)
        .ok()
        .and_then(|j| HeaderValue::from_str(&j).ok())
        .ok_or_else(|| ApiError::internal(format!("volume {}'s record as a header", rec.id)))?;
    let s = Stages { app, rec, record };
    // 1. The first copy, the volume in use meanwhile.
    let sent = s.post(from, "send", StatusCode::OK).await?;
    let steps = async {
        let first = (true, sent.into_body());
        s.call(
            to,
            (Method::PUT, "first"),
            first,
            (StatusCode::CREATED, COPIED),
        )
        .await?;
        // 2. The hold: writes wait from here.
        let asked_hold = Instant::now();
        let held = answer(s.post(from, "hold", StatusCode::OK).await?).await.1;
        let held: Held = serde_json::from_str(&held)
            .map_err(|e| ApiError::bad_gateway(format!("node {}'s hold: {e}", from.name)))?;
        // 3. What changed since the first copy.
        let last = s.post(from, "send-last", StatusCode::OK).await?;
        let stage = format!("last&point={}", held.point);
        let caught = (false, last.into_body());
        s.call(
            to,
            (Method::PUT, &stage),
            caught,
            (StatusCode::CREATED, STEP),
        )
        .await?;
        // 4. The target serves its copy, still marked.
        let body = serde_json::to_vec(&json!({"snapshots": held.snapshots}))
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let open = (true, Body::from(body));
        let opened = s
            .call(
                to,
                (Method::POST, "open"),
                open,
                (StatusCode::CREATED, STEP),
            )
            .await?;
        let opened: serde_json::Value =
            serde_json::from_str(&answer(opened).await.1).unwrap_or_default();
        let wait_ms = opened["wait_ms"].as_u64().unwrap_or(0).min(held.wait_ms);
        Ok::<(Instant, u64), ApiError>((asked_hold, wait_ms))
    }
    .await;
    let (asked_hold, wait_ms) = match steps {
        Ok(s) => s,
        Err(e) => {
            give_up(app, rec, from, to).await;
            return Err(e);
        }
    };
    // 5. The switch, while no node can have asked the fleet yet.
    if asked_hold.elapsed() >= Duration::from_millis(wait_ms / 2) {
        give_up(app, rec, from, to).await;
        return Err(ApiError::unavailable(format!(
            "volume {}'s move took longer than its nodes wait ({} ms held): it stays on node \
             {}; retry when they are less busy",
            rec.name,
            asked_hold.elapsed().as_millis(),
            from.name
        )));
    }
    let (store, r, (a, b)) = (
        app.store.clone(),
        rec.clone(),
        (from.id.clone(), to.id.clone()),
    );
    let switched =
        tokio::task::spawn_blocking(move || store.move_volume(&r.tenant, &r.id, &a, &b, &[]))
            .await
            .map_err(|e| ApiError::internal(e.to_string()));
    match switched {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => {
            give_up(app, rec, from, to).await;
            return Err(ApiError::conflict(format!(
                "volume {} changed homes or went away during the move",
                rec.name
            )));
        }
        // Not known whether it switched: the nodes ask the fleet with their heartbeats.
        Ok(Err(e)) => {
            return Err(ApiError::unavailable(format!(
                "volume {}'s move may or may not have switched ({e}): its nodes settle it \
                 with the fleet's record within a minute; read the volume then",
                rec.name
            )))
        }
        Err(e) => return Err(e),
    }
    for (n, stage) in [(to, "confirm"), (from, "moved")] {
        if let Err(e) = s.post(n, stage, StatusCode::NO_CONTENT).await {
            tracing::warn!(volume = %rec.id, node = %n.name, stage, error = %e.message, "a node did not take the end of a switched move: it settles it with its heartbeats");
        }
    }
    Ok(())
}

/// A move that did not switch: the home goes on as before, the target drops its copy
/// (best effort: each node gives up by itself after its wait).
async fn give_up(app: &AppState, rec: &VolumeRecord, from: &NodeRecord, to: &NodeRecord) {
    let base = format!("{RECEIVE_PATH}{}", rec.id);
    let stay = format!("{base}?stage=stay");
    let calls = [
        (from, Method::POST, stay.as_str()),
        (to, Method::DELETE, base.as_str()),
    ];
    for (n, method, path) in calls {
        let done = call_node(
            app,
            n,
            &rec.tenant,
            (method, path),
            Body::empty(),
            Some(STEP),
        )
        .await;
        if !matches!(&done, Ok(r) if r.status().is_success()) {
            tracing::warn!(volume = %rec.id, node = %n.name, "a node did not take the end of a failed move: it settles it after its wait");
        }
    }
}
