//! Usage over time (`GET /v1/usage/series`): each tenant's active, idle and paused time and
//! the CPU its machines used, minute by minute, for the dashboard's charts.
//!
//! This room owns the samples. Every [`INTERVAL`] a task reads each tenant's running
//! totals (its sandboxes that ended while this server ran, kept by `metrics`, plus its live
//! ones') and keeps them, at most [`KEEP`] per tenant, in memory only: a restart starts a
//! new series (the totals of `/v1/usage` are durable; this history is not, and says since
//! when it runs). An answer is the differences between consecutive samples, the last one
//! running up to the moment of the request. A total never goes back: each sample is at
//! least the one before it (a sandbox between its removal from the live map and its
//! retirement would otherwise dip out and come back as a spike).
//!
//! It must not touch sandboxes or the store; it only reads what `metrics` and the live
//! map already hold.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use axum::extract::State;
use axum::routing::get;
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::Query;
use crate::metrics::TimeTotals;
use crate::state::AppState;

/// How often the totals are sampled.
pub const INTERVAL: Duration = Duration::from_secs(60);
/// Samples kept per tenant (24 hours).
pub const KEEP: usize = 24 * 60;

/// A tenant's running totals at one moment (`at`: Unix milliseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Sample {
    at: i64,
    active_ms: u64,
    idle_ms: u64,
    paused_ms: u64,
    cpu_ms: u64,
}

impl Sample {
    fn of(at: i64, t: &TimeTotals) -> Sample {
        Sample {
            at,
            active_ms: t.active_ms,
            idle_ms: t.idle_ms,
            paused_ms: t.paused_ms,
            cpu_ms: t.cpu_ms,
        }
    }

    /// This sample, no total below `prev`'s.
    fn at_least(self, prev: &Sample) -> Sample {
        Sample {
            at: self.at,
            active_ms: self.active_ms.max(prev.active_ms),
            idle_ms: self.idle_ms.max(prev.idle_ms),
            paused_ms: self.paused_ms.max(prev.paused_ms),
            cpu_ms: self.cpu_ms.max(prev.cpu_ms),
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    by_tenant: HashMap<String, VecDeque<Sample>>,
    /// When the last sample was taken: a tenant first seen later had nothing before it.
    last_tick: Option<i64>,
}

/// The samples of every tenant.
#[derive(Debug, Default)]
pub struct Series(Mutex<Inner>);

impl Series {
    /// Records every tenant's totals at `at`.
    fn record(&self, at: i64, totals: &BTreeMap<String, TimeTotals>) {
        let mut inner = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let last_tick = inner.last_tick;
        for (tenant, t) in totals {
            let q = inner.by_tenant.entry(tenant.clone()).or_default();
            if q.is_empty() {
                // Not in the last sample: its totals were zero then.
                if let Some(prev) = last_tick {
                    q.push_back(Sample {
                        at: prev,
                        ..Default::default()
                    });
                }
            }
            let s = Sample::of(at, t);
            let s = q.back().map_or(s, |p| s.at_least(p));
            q.push_back(s);
            while q.len() > KEEP {
                q.pop_front();
            }
        }
        inner.last_tick = Some(at);
    }

    /// `tenant`'s samples, oldest first, then `now`.
    fn with_now(&self, tenant: &str, now: Sample) -> Vec<Sample> {
        let inner = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<Sample> = match inner.by_tenant.get(tenant) {
            Some(q) => q.iter().copied().collect(),
            None => inner
                .last_tick
                .map(|at| Sample {
                    at,
                    ..Default::default()
                })
                .into_iter()
                .collect(),
        };
        let now = v.last().map_or(now, |p| now.at_least(p));
        if v.last().is_none_or(|p| p.at < now.at) {
            v.push(now);
        }
        v
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Every tenant's totals now (or only `tenant`'s).
async fn totals(app: &AppState, tenant: Option<&str>) -> BTreeMap<String, TimeTotals> {
    let mut t = app.metrics.retired_totals();
    if let Some(only) = tenant {
        t.retain(|k, _| k == only);
    }
    let live: Vec<_> = app
        .live
        .read()
        .await
        .values()
        .filter(|l| tenant.is_none_or(|only| l.tenant == only))
        .cloned()
        .collect();
    for l in live {
        t.entry(l.tenant.clone())
            .or_default()
            .add(&l.times(), l.machine.usage().cpu_ms);
    }
    t
}

/// At start: a sample now and every [`INTERVAL`] after.
pub fn spawn(app: AppState) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let t = totals(&app, None).await;
            app.usage_series.record(now_ms(), &t);
        }
    });
}

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/usage/series", get(series))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SeriesQuery {
    /// Only the intervals that end after this (RFC 3339 or Unix seconds).
    since: Option<String>,
}

fn rfc3339_ms(ms: i64) -> String {
    locker_types::rfc3339(ms.div_euclid(1000))
}

/// `GET /v1/usage/series`: the caller's tenant's time split and CPU per interval.
async fn series(
    State(app): State<AppState>,
    caller: Caller,
    Query(q): Query<SeriesQuery>,
) -> Result<axum::Json<Value>, ApiError> {
    let since_ms = match &q.since {
        None => i64::MIN,
        Some(s) => {
            s.parse::<i64>()
                .ok()
                .or_else(|| locker_types::parse_rfc3339(s))
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "`since` must be an RFC 3339 time (2026-01-31T00:00:00Z) or Unix seconds, got {s:?}"
                    ))
                })?
                * 1000
        }
    };
    let now = totals(&app, Some(&caller.tenant)).await;
    let now = Sample::of(
        now_ms(),
        now.get(&caller.tenant).unwrap_or(&TimeTotals::default()),
    );
    let samples = app.usage_series.with_now(&caller.tenant, now);
    let secs = |ms: u64| ms as f64 / 1000.0;
    let intervals: Vec<Value> = samples
        .windows(2)
        .filter(|w| w[1].at > since_ms)
        .map(|w| {
            let (a, b) = (w[0], w[1]);
            json!({
                "from": rfc3339_ms(a.at),
                "to": rfc3339_ms(b.at),
                "seconds": (b.at - a.at) as f64 / 1000.0,
                "active_s": secs(b.active_ms - a.active_ms),
                "idle_s": secs(b.idle_ms - a.idle_ms),
                "paused_s": secs(b.paused_ms - a.paused_ms),
                "cpu_ms": b.cpu_ms - a.cpu_ms,
            })
        })
        .collect();
    Ok(axum::Json(json!({
        "tenant": caller.tenant,
        "interval_s": INTERVAL.as_secs(),
        "since": samples.first().map(|s| rfc3339_ms(s.at)),
        "intervals": intervals,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(active: u64, idle: u64, paused: u64, cpu: u64) -> TimeTotals {
        TimeTotals {
            active_ms: active,
            idle_ms: idle,
            paused_ms: paused,
            cpu_ms: cpu,
            ..Default::default()
        }
    }

    #[test]
    fn samples_never_go_back_and_late_tenants_start_at_zero() {
        let s = Series::default();
        let mut t = BTreeMap::new();
        t.insert("a".to_owned(), totals(100, 200, 0, 5));
        s.record(1_000, &t);
        // A dip (a sandbox between the live map and its retirement) is held level.
        t.insert("a".to_owned(), totals(50, 250, 0, 4));
        t.insert("b".to_owned(), totals(10, 0, 0, 1));
        s.record(61_000, &t);
        let a = s.with_now("a", Sample::of(62_000, &totals(400, 300, 10, 9)));
        assert_eq!(a.len(), 3);
        assert_eq!((a[1].active_ms, a[1].idle_ms, a[1].cpu_ms), (100, 250, 5));
        assert_eq!(a[2].active_ms, 400);
        // `b` appeared after the first sample: zero then.
        let b = s.with_now("b", Sample::of(62_000, &totals(10, 0, 0, 1)));
        assert_eq!(
            b.iter().map(|x| x.at).collect::<Vec<_>>(),
            [1_000, 61_000, 62_000]
        );
        assert_eq!(b[0].active_ms, 0);
        // A tenant never sampled: from the last sample on.
        let c = s.with_now("c", Sample::of(70_000, &totals(3, 4, 0, 0)));
        assert_eq!(c.iter().map(|x| x.at).collect::<Vec<_>>(), [61_000, 70_000]);
    }

    #[test]
    fn at_most_keep_samples() {
        let s = Series::default();
        let mut t = BTreeMap::new();
        t.insert("a".to_owned(), totals(1, 1, 1, 1));
        for i in 0..(KEEP as i64 + 10) {
            s.record(i * 60_000, &t);
        }
        let v = s.with_now("a", Sample::of(i64::MAX, &totals(1, 1, 1, 1)));
        assert_eq!(v.len(), KEEP + 1);
    }
}
