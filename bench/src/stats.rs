//! Rows of results: samples, their percentiles, the printed table and the JSON file.
//!
//! Owns summarising and presenting numbers; it runs nothing. Percentiles are nearest-rank
//! on the measured samples only (warm-up iterations never enter a [`Row`]).

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

/// A promise a row is held to (printed beside it, never enforced).
#[derive(Debug, Clone, Copy)]
pub enum Target {
    P50(f64),
    P99(f64),
    /// A floor rather than a ceiling (throughput, a share of a peer's).
    P50AtLeast(f64),
}

/// One measured quantity.
#[derive(Debug, Clone)]
pub struct Row {
    pub name: String,
    pub unit: &'static str,
    pub samples: Vec<f64>,
    pub notes: String,
    /// Warm-up iterations run before the samples (0 for counters and gauges).
    pub warmup: usize,
    pub targets: Vec<Target>,
    /// Other rows' names this one is compared with (ratio of p50s), peers of the same run.
    pub peers: Vec<String>,
    /// Why the row has no samples.
    pub skipped: Option<String>,
}

impl Row {
    pub fn new(
        name: impl Into<String>,
        unit: &'static str,
        samples: Vec<f64>,
        warmup: usize,
    ) -> Row {
        Row {
            name: name.into(),
            unit,
            samples,
            notes: String::new(),
            warmup,
            targets: Vec::new(),
            peers: Vec::new(),
            skipped: None,
        }
    }

    /// A row that could not be measured on this host, and why.
    pub fn skipped(name: impl Into<String>, why: impl Into<String>) -> Row {
        let why = why.into();
        let mut r = Row::new(name, "ms", Vec::new(), 0);
        r.notes = format!("skipped: {why}");
        r.skipped = Some(why);
        r
    }

    pub fn note(mut self, n: impl AsRef<str>) -> Row {
        if !self.notes.is_empty() {
            self.notes.push_str("; ");
        }
        self.notes.push_str(n.as_ref());
        self
    }

    pub fn target(mut self, t: Target) -> Row {
        self.targets.push(t);
        self
    }

    /// Compares this row with another row of the run (a ratio of p50s); may be repeated.
    pub fn vs(mut self, peer: &str) -> Row {
        self.peers.push(peer.to_owned());
        self
    }

    pub fn p(&self, pct: f64) -> f64 {
        percentile(&self.samples, pct)
    }

    pub fn mean(&self) -> f64 {
        if self.samples.is_empty() {
            return f64::NAN;
        }
        self.samples.iter().sum::<f64>() / self.samples.len() as f64
    }

    /// The verdicts on its targets, then its ratio to each peer row measured in this run.
    pub fn extras(&self, rows: &[Row]) -> Vec<String> {
        let mut extra = self.verdicts();
        for peer in &self.peers {
            // A peer not measured in this run (a subset, a skipped peer) gives no ratio.
            if let Some(p) = rows
                .iter()
                .find(|x| &x.name == peer && x.skipped.is_none() && !x.samples.is_empty())
            {
                let (a, b) = (self.p(50.0), p.p(50.0));
                // A ratio of figures that are not both positive (a drop of memory that
                // other work on the host turned negative) means nothing.
                if a > 0.0 && b > 0.0 {
                    extra.push(format!("{}× {peer}", fmt_ratio(a / b)));
                } else {
                    extra.push(format!("no ratio to {peer} (a p50 ≤ 0)"));
                }
            }
        }
        extra
    }

    /// "met" or "MISSED by X (Y×)" for each target.
    fn verdicts(&self) -> Vec<String> {
        self.targets
            .iter()
            .map(|t| {
                let (label, want, got) = match *t {
                    Target::P50(w) => ("p50", w, self.p(50.0)),
                    Target::P99(w) => ("p99", w, self.p(99.0)),
                    Target::P50AtLeast(w) => {
                        let got = self.p(50.0);
                        return if got >= w {
                            format!("p50 ≥ {} {}: met", fmt_num(w), self.unit)
                        } else {
                            format!(
                                "p50 ≥ {} {}: MISSED by {} {} ({:.2}× of it)",
                                fmt_num(w),
                                self.unit,
                                fmt_num(w - got),
                                self.unit,
                                got / w
                            )
                        };
                    }
                };
                if got <= want {
                    format!("{label} ≤ {} {}: met", fmt_num(want), self.unit)
                } else {
                    format!(
                        "{label} ≤ {} {}: MISSED by {} {} ({:.1}×)",
                        fmt_num(want),
                        self.unit,
                        fmt_num(got - want),
                        self.unit,
                        got / want
                    )
                }
            })
            .collect()
    }
}

/// Nearest-rank percentile (NaN for no samples).
pub fn percentile(samples: &[f64], pct: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((pct / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// Where the slowest calls spent their time: how many of the calls over 8 ms had an
/// agent-reported start (cgroup + fork/exec in the machine) over 8 ms as well.
pub fn tail_note(lat: &[f64], starts: &[f64]) -> String {
    let slow: Vec<usize> = (0..lat.len()).filter(|&i| lat[i] > 8.0).collect();
    let slow_start = slow
        .iter()
        .filter(|&&i| starts.get(i).is_some_and(|s| *s > 8.0))
        .count();
    format!(
        "agent-reported start p50 {:.2} / p99 {:.2} ms; {} of {} calls took over 8 ms, {slow_start} of them in the agent's start",
        percentile(starts, 50.0),
        percentile(starts, 99.0),
        slow.len(),
        lat.len()
    )
}

/// A ratio: one decimal, two below 1 (0.05×, not 0.1×).
fn fmt_ratio(v: f64) -> String {
    if v < 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}")
    }
}

pub fn fmt_num(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The table printed at the end of a run.
pub fn table(rows: &[Row]) -> String {
    let width = rows
        .iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(10)
        .max(10);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<width$}  {:>9}  {:>9}  {:>9}  {:>9}  {:>6}  {:<5}  targets / ratios",
        "row", "p50", "p95", "p99", "mean", "n", "unit"
    );
    let _ = writeln!(out, "{}", "-".repeat(width + 72));
    for r in rows {
        if let Some(why) = &r.skipped {
            let _ = writeln!(out, "{:<width$}  skipped: {why}", r.name);
            continue;
        }
        let extra = r.extras(rows);
        let _ = writeln!(
            out,
            "{:<width$}  {:>9}  {:>9}  {:>9}  {:>9}  {:>6}  {:<5}  {}",
            r.name,
            fmt_num(r.p(50.0)),
            fmt_num(r.p(95.0)),
            fmt_num(r.p(99.0)),
            fmt_num(r.mean()),
            r.samples.len(),
            r.unit,
            extra.join("; ")
        );
    }
    out
}

#[derive(Serialize)]
struct JsonRow<'a> {
    name: &'a str,
    unit: &'a str,
    samples: Vec<f64>,
    p50: Option<f64>,
    p95: Option<f64>,
    p99: Option<f64>,
    mean: Option<f64>,
    notes: String,
}

fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some((v * 1000.0).round() / 1000.0)
}

/// Writes the rows as a JSON array of `{name, unit, samples, p50, p95, p99, mean, notes}`,
/// one row per line, so a new result diffs row by row.
pub fn write_json(rows: &[Row], path: &Path) -> std::io::Result<()> {
    let items: Vec<JsonRow> = rows
        .iter()
        .map(|r| {
            let mut notes = r.notes.clone();
            if r.warmup > 0 {
                notes = format!("{} warm-up iterations excluded; {notes}", r.warmup);
            }
            let verdicts = r.verdicts();
            let ratios = r.extras(rows).split_off(verdicts.len());
            for v in verdicts {
                notes.push_str("; target ");
                notes.push_str(&v);
            }
            for v in ratios {
                notes.push_str("; vs peer (p50 ÷ p50): ");
                notes.push_str(&v);
            }
            JsonRow {
                name: &r.name,
                unit: r.unit,
                // Rounded to microseconds: finer digits are noise here, and they bloat the file.
                samples: r
                    .samples
                    .iter()
                    .map(|v| (v * 1000.0).round() / 1000.0)
                    .collect(),
                p50: finite(r.p(50.0)),
                p95: finite(r.p(95.0)),
                p99: finite(r.p(99.0)),
                mean: finite(r.mean()),
                notes,
            }
        })
        .collect();
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let lines: Vec<String> = items
        .iter()
        .map(|i| serde_json::to_string(i).expect("rows serialize"))
        .collect();
    std::fs::write(path, format!("[\n{}\n]\n", lines.join(",\n")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&s, 50.0), 50.0);
        assert_eq!(percentile(&s, 99.0), 99.0);
        assert_eq!(percentile(&s, 100.0), 100.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn verdicts_say_by_how_much() {
        let r = Row::new("x", "ms", vec![20.0; 10], 0).target(Target::P50(15.0));
        assert_eq!(
            r.verdicts(),
            vec!["p50 ≤ 15.00 ms: MISSED by 5.00 ms (1.3×)".to_owned()]
        );
        let r = Row::new("x", "ms", vec![1.0; 10], 0).target(Target::P50(2.0));
        assert_eq!(r.verdicts(), vec!["p50 ≤ 2.00 ms: met".to_owned()]);
        let r = Row::new("x", "%", vec![40.0], 0).target(Target::P50AtLeast(50.0));
        assert_eq!(
            r.verdicts(),
            vec!["p50 ≥ 50.00 %: MISSED by 10.00 % (0.80× of it)".to_owned()]
        );
        let r = Row::new("x", "%", vec![60.0], 0).target(Target::P50AtLeast(50.0));
        assert_eq!(r.verdicts(), vec!["p50 ≥ 50.00 %: met".to_owned()]);
    }
}
