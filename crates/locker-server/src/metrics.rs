//! Prometheus metrics, hand-rolled: a few counters and histograms rendered as text.
//!
//! Owns the numbers behind `GET /metrics`. Recording is a handful of atomic adds on the
//! hot path (no locks except the first time a label set appears).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

/// Upper bounds of latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

/// One histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    /// Sum in microseconds (atomics hold integers).
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        for (i, b) in BUCKETS.iter().enumerate() {
            if seconds <= *b {
                self.counts[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {}",
                self.counts[i].load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(
            out,
            "{name}_sum{braces} {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count{braces} {n}");
    }
}

/// A family of histograms keyed by a label string.
#[derive(Debug, Default)]
struct Family {
    by_label: RwLock<BTreeMap<String, std::sync::Arc<Histogram>>>,
}

impl Family {
    fn get(&self, labels: &str) -> std::sync::Arc<Histogram> {
        if let Some(h) = self.by_label.read().expect("metrics lock").get(labels) {
            return h.clone();
        }
        self.by_label
            .write()
            .expect("metrics lock")
            .entry(labels.to_owned())
            .or_default()
            .clone()
    }
}

/// Every metric of the server.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Family,
    requests_total: Mutex<BTreeMap<String, u64>>,
    /// Exec and run: the whole call.
    pub exec_seconds: Histogram,
    /// From a request's arrival to its command's process having started.
    pub exec_wait_seconds: Histogram,
    pub sandbox_create_seconds: Histogram,
    cpu_ms_by_tenant: Mutex<BTreeMap<String, u64>>,
    pub calls_dropped: AtomicU64,
    /// Time splits of the sandboxes that ended while this server ran, by tenant (the live
    /// ones are added at each render).
    retired: Mutex<BTreeMap<String, TimeTotals>>,
}

/// A tenant's sandboxes' time split, machine CPU and gaps between calls.
#[derive(Debug, Default, Clone)]
pub struct TimeTotals {
    pub active_ms: u64,
    pub idle_ms: u64,
    pub paused_ms: u64,
    pub cpu_ms: u64,
    /// Per bucket of `state::GAP_BOUNDS` (and `+Inf`), not cumulative.
    pub gaps: Vec<u64>,
    pub gap_sum_ms: u64,
}

impl TimeTotals {
    /// Adds one sandbox's figures.
    pub fn add(&mut self, t: &locker_store::SandboxTimes, cpu_ms: u64) {
        self.active_ms += t.active_ms;
        self.idle_ms += t.idle_ms;
        self.paused_ms += t.paused_ms;
        self.cpu_ms += cpu_ms;
        if self.gaps.len() < t.call_gaps.len() {
            self.gaps.resize(t.call_gaps.len(), 0);
        }
        for (g, n) in self.gaps.iter_mut().zip(&t.call_gaps) {
            *g += n;
        }
        self.gap_sum_ms += t.call_gap_sum_ms;
    }
}

impl Metrics {
    /// Records one HTTP request (`route` is the matched path template).
    pub fn request(&self, method: &str, route: &str, status: u16, seconds: f64) {
        let labels = format!("method=\"{method}\",route=\"{route}\"");
        self.requests.get(&labels).observe(seconds);
        let key = format!("{labels},status=\"{status}\"");
        *self
            .requests_total
            .lock()
            .expect("metrics lock")
            .entry(key)
            .or_default() += 1;
    }

    pub fn add_cpu(&self, tenant: &str, cpu_ms: u64) {
        *self
            .cpu_ms_by_tenant
            .lock()
            .expect("metrics lock")
            .entry(tenant.to_owned())
            .or_default() += cpu_ms;
    }

    /// Keeps the figures of a sandbox that ended, so the tenant's counters do not go back.
    pub fn retire(&self, tenant: &str, t: &locker_store::SandboxTimes, cpu_ms: u64) {
        self.retired
            .lock()
            .expect("metrics lock")
            .entry(tenant.to_owned())
            .or_default()
            .add(t, cpu_ms);
    }

    /// The time splits of the sandboxes that ended while this server ran, by tenant.
    pub fn retired_totals(&self) -> BTreeMap<String, TimeTotals> {
        self.retired.lock().expect("metrics lock").clone()
    }

    /// The text exposition format; `sandboxes` are counts by state, `live` the live
    /// sandboxes' time splits by tenant.
    pub fn render(
        &self,
        sandboxes: &BTreeMap<String, u64>,
        live: &BTreeMap<String, TimeTotals>,
    ) -> String {
        let mut out = String::new();
        let mut times = self.retired.lock().expect("metrics lock").clone();
        for (t, l) in live {
            let e = times.entry(t.clone()).or_default();
            e.active_ms += l.active_ms;
            e.idle_ms += l.idle_ms;
            e.paused_ms += l.paused_ms;
            e.cpu_ms += l.cpu_ms;
            if e.gaps.len() < l.gaps.len() {
                e.gaps.resize(l.gaps.len(), 0);
            }
            for (g, n) in e.gaps.iter_mut().zip(&l.gaps) {
                *g += n;
            }
            e.gap_sum_ms += l.gap_sum_ms;
        }
        render_times(&mut out, &times);
        out.push_str("# HELP locker_http_request_duration_seconds HTTP request latency by route.\n# TYPE locker_http_request_duration_seconds histogram\n");
        for (labels, h) in self.requests.by_label.read().expect("metrics lock").iter() {
            h.render(&mut out, "locker_http_request_duration_seconds", labels);
        }
        out.push_str("# HELP locker_http_requests_total HTTP requests by route and status.\n# TYPE locker_http_requests_total counter\n");
        for (labels, n) in self.requests_total.lock().expect("metrics lock").iter() {
            let _ = writeln!(out, "locker_http_requests_total{{{labels}}} {n}");
        }
        out.push_str("# HELP locker_exec_duration_seconds Exec calls, request to result.\n# TYPE locker_exec_duration_seconds histogram\n");
        self.exec_seconds
            .render(&mut out, "locker_exec_duration_seconds", "");
        out.push_str("# HELP locker_exec_wait_seconds Wait before a command starts (queue + start).\n# TYPE locker_exec_wait_seconds histogram\n");
        self.exec_wait_seconds
            .render(&mut out, "locker_exec_wait_seconds", "");
        out.push_str("# HELP locker_sandbox_create_seconds Sandbox creation latency.\n# TYPE locker_sandbox_create_seconds histogram\n");
        self.sandbox_create_seconds
            .render(&mut out, "locker_sandbox_create_seconds", "");
        out.push_str(
            "# HELP locker_sandboxes Sandboxes by state.\n# TYPE locker_sandboxes gauge\n",
        );
        for (state, n) in sandboxes {
            let _ = writeln!(out, "locker_sandboxes{{state=\"{state}\"}} {n}");
        }
        out.push_str("# HELP locker_cpu_seconds_total CPU time used by commands, by tenant.\n# TYPE locker_cpu_seconds_total counter\n");
        for (t, ms) in self.cpu_ms_by_tenant.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                out,
                "locker_cpu_seconds_total{{tenant=\"{t}\"}} {}",
                *ms as f64 / 1000.0
            );
        }
        let _ = writeln!(
            out,
            "# HELP locker_call_records_dropped_total Call records dropped because the writer fell behind.\n# TYPE locker_call_records_dropped_total counter\nlocker_call_records_dropped_total {}",
            self.calls_dropped.load(Ordering::Relaxed)
        );
        out
    }
}

/// The sandboxes' time split, idle fraction, machine CPU and call gaps, by tenant.
fn render_times(out: &mut String, times: &BTreeMap<String, TimeTotals>) {
    out.push_str("# HELP locker_sandbox_seconds_total Sandboxes' up time by phase: a call in flight (active), up with none (idle), frozen (paused).\n# TYPE locker_sandbox_seconds_total counter\n");
    for (t, x) in times {
        for (phase, ms) in [
            ("active", x.active_ms),
            ("idle", x.idle_ms),
            ("paused", x.paused_ms),
        ] {
            let _ = writeln!(
                out,
                "locker_sandbox_seconds_total{{tenant=\"{t}\",phase=\"{phase}\"}} {}",
                ms as f64 / 1000.0
            );
        }
    }
    out.push_str("# HELP locker_sandbox_idle_fraction Idle time over active and idle time of the tenant's sandboxes.\n# TYPE locker_sandbox_idle_fraction gauge\n");
    for (t, x) in times {
        let up = x.active_ms + x.idle_ms;
        let f = if up == 0 {
            0.0
        } else {
            x.idle_ms as f64 / up as f64
        };
        let _ = writeln!(out, "locker_sandbox_idle_fraction{{tenant=\"{t}\"}} {f}");
    }
    out.push_str("# HELP locker_sandbox_cpu_seconds_total CPU time used by sandboxes' machines (cgroup), by tenant.\n# TYPE locker_sandbox_cpu_seconds_total counter\n");
    for (t, x) in times {
        let _ = writeln!(
            out,
            "locker_sandbox_cpu_seconds_total{{tenant=\"{t}\"}} {}",
            x.cpu_ms as f64 / 1000.0
        );
    }
    out.push_str("# HELP locker_sandbox_call_gap_seconds Gaps between one call's end and the next call's start on a sandbox.\n# TYPE locker_sandbox_call_gap_seconds histogram\n");
    for (t, x) in times {
        let mut acc = 0;
        for (i, b) in crate::state::GAP_BOUNDS.iter().enumerate() {
            acc += x.gaps.get(i).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "locker_sandbox_call_gap_seconds_bucket{{tenant=\"{t}\",le=\"{b}\"}} {acc}"
            );
        }
        let n: u64 = x.gaps.iter().sum();
        let _ = writeln!(
            out,
            "locker_sandbox_call_gap_seconds_bucket{{tenant=\"{t}\",le=\"+Inf\"}} {n}\nlocker_sandbox_call_gap_seconds_sum{{tenant=\"{t}\"}} {}\nlocker_sandbox_call_gap_seconds_count{{tenant=\"{t}\"}} {n}",
            x.gap_sum_ms as f64 / 1000.0
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = super::Metrics::default();
        m.exec_seconds.observe(0.0015);
        m.exec_seconds.observe(0.3);
        let t = m.render(&Default::default(), &Default::default());
        assert!(t.contains("locker_exec_duration_seconds_bucket{le=\"0.001\"} 0"));
        assert!(t.contains("locker_exec_duration_seconds_bucket{le=\"0.002\"} 1"));
        assert!(t.contains("locker_exec_duration_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(t.contains("locker_exec_duration_seconds_count 2"));
    }
}
