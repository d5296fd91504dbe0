//! The results as a Markdown table and an SVG chart of the latency distributions, beside
//! the JSON (`bench/results/<host>-<date>[…].{md,svg}`).
//!
//! Owns presentation only. The chart uses `plotters` with its SVG backend alone: no fonts
//! are loaded (text is left to the SVG viewer), no browser, no bitmap.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::stats::{fmt_num, percentile, Row};

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

/// A Markdown table of every row (skipped rows say why), under a header naming the host.
pub fn markdown(rows: &[Row], title: &str, header: &[String]) -> String {
    let mut out = format!("# {title}\n\n");
    for h in header {
        let _ = writeln!(out, "{h}  ");
    }
    out.push_str("\n| row | p50 | p95 | p99 | mean | n | unit | targets / ratios (p50 ÷ p50 of the peer, same run) |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---|---|\n");
    for r in rows {
        if let Some(why) = &r.skipped {
            let _ = writeln!(
                out,
                "| {} | – | – | – | – | 0 | | skipped: {} |",
                cell(&r.name),
                cell(why)
            );
            continue;
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(&r.name),
            fmt_num(r.p(50.0)),
            fmt_num(r.p(95.0)),
            fmt_num(r.p(99.0)),
            fmt_num(r.mean()),
            r.samples.len(),
            r.unit,
            cell(&r.extras(rows).join("; "))
        );
    }
    out
}

/// The rows the chart shows: times with at least one sample.
fn charted(rows: &[Row]) -> Vec<&Row> {
    rows.iter()
        .filter(|r| r.unit == "ms" && r.skipped.is_none() && !r.samples.is_empty())
        .collect()
}

/// The decade at or below `v` (and above, with `up`).
fn decade(v: f64, up: bool) -> f64 {
    let e = v.max(1e-3).log10();
    10f64.powf(if up { e.ceil() } else { e.floor() })
}

/// A tick label of the log axis: 0.1, 1, 10, 1000.
fn axis_num(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{}", (v * 1e6).round() / 1e6)
    }
}

/// One horizontal box per row on a log scale: whisker p5–p99, box p25–p75, a bar at p50,
/// a dot at p99, and the figures beside it. Whether there was anything to draw (rows in ms).
pub fn svg(rows: &[Row], title: &str, path: &Path) -> anyhow::Result<bool> {
    let shown = charted(rows);
    if shown.is_empty() {
        return Ok(false);
    }
    let k = shown.len();
    let lo = decade(
        shown.iter().map(|r| r.p(5.0)).fold(f64::INFINITY, f64::min) / 1.2,
        false,
    );
    let hi = decade(
        shown.iter().map(|r| r.p(99.0)).fold(0.0, f64::max) * 1.2,
        true,
    );
    let (w, h) = (1200u32, 110 + 24 * k as u32);
    let label_w = 430u32;
    let root = SVGBackend::new(path, (w, h)).into_drawing_area();
    let e = |e: DrawingAreaErrorKind<_>| anyhow!("drawing {}: {e:?}", path.display());
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 15))
        .margin(10)
        .margin_right(190)
        .x_label_area_size(45)
        .y_label_area_size(label_w)
        .build_cartesian_2d((lo..hi).log_scale(), -0.5f64..(k as f64 - 0.5))
        .map_err(e)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(k)
        .y_label_formatter(&|_| String::new())
        .x_desc("ms, log scale: box p25–p75, bar p50, whisker p5–p99, dot p99 (warm-up excluded); blue Locker, orange peers")
        .x_label_formatter(&|v| axis_num(*v))
        .draw()
        .map_err(e)?;
    let label =
        TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Right, VPos::Center));
    let figures =
        TextStyle::from(("sans-serif", 11).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, r) in shown.iter().enumerate() {
        let y = (k - 1 - i) as f64;
        let c = |p: f64| percentile(&r.samples, p).max(lo);
        let color = if r.name.starts_with("peer") {
            RGBColor(230, 140, 40)
        } else {
            RGBColor(50, 110, 200)
        };
        chart
            .draw_series([PathElement::new(
                vec![(c(5.0), y), (c(99.0), y)],
                BLACK.stroke_width(1),
            )])
            .map_err(e)?;
        chart
            .draw_series([Rectangle::new(
                [(c(25.0), y - 0.3), (c(75.0), y + 0.3)],
                color.mix(0.6).filled(),
            )])
            .map_err(e)?;
        chart
            .draw_series([PathElement::new(
                vec![(c(50.0), y - 0.38), (c(50.0), y + 0.38)],
                BLACK.stroke_width(2),
            )])
            .map_err(e)?;
        chart
            .draw_series([Circle::new((c(99.0), y), 3, BLACK.filled())])
            .map_err(e)?;
        let (x0, py) = chart.backend_coord(&(lo, y));
        root.draw(&Text::new(r.name.clone(), (x0 - 8, py), label.clone()))
            .map_err(e)?;
        let (x1, _) = chart.backend_coord(&(c(99.0), y));
        root.draw(&Text::new(
            format!(
                "p50 {} · p99 {} · n {}",
                fmt_num(r.p(50.0)),
                fmt_num(r.p(99.0)),
                r.samples.len()
            ),
            (x1 + 8, py),
            figures.clone(),
        ))
        .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_rows_and_skips() {
        let rows = vec![
            Row::new("a | b", "ms", vec![1.0, 2.0, 3.0], 1),
            Row::skipped("c", "not here"),
        ];
        let md = markdown(&rows, "t", &["host x".into()]);
        assert!(
            md.contains("| a \\| b | 2.00 | 3.00 | 3.00 | 2.00 | 3 | ms |"),
            "{md}"
        );
        assert!(
            md.contains("| c | – | – | – | – | 0 | | skipped: not here |"),
            "{md}"
        );
    }

    #[test]
    fn chart_is_an_svg() {
        let dir = locker_tests::TempDir::new("bench-svg");
        let p = dir.path().join("c.svg");
        let rows = vec![
            Row::new("x", "ms", (1..100).map(f64::from).collect(), 0),
            Row::new("peer y", "ms", vec![0.5, 0.7], 0),
            Row::new("count", "count", vec![3.0], 0),
        ];
        svg(&rows, "t", &p).expect("draw");
        let s = std::fs::read_to_string(&p).expect("read");
        assert!(
            s.starts_with("<svg") && s.contains(">\nx\n</text>") && s.contains("peer y"),
            "{s}"
        );
        assert!(!s.contains(">\ncount\n</text>"));
    }
}
