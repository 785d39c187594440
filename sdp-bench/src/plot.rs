//! A small SVG chart: throughput and ping-pong latency against message size, one line per
//! transport and mode, log scales.

use std::fmt::Write;

use crate::net::Row;

const W: f64 = 520.0;
const H: f64 = 320.0;
const M: f64 = 60.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
];

fn panel(
    out: &mut String,
    x0: f64,
    title: &str,
    unit: &str,
    rows: &[Row],
    get: fn(&Row) -> Option<f64>,
) {
    let pts: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|r| get(r).filter(|v| *v > 0.0).map(|v| (r.size as f64, v)))
        .collect();
    let _ = write!(
        out,
        r#"<g transform="translate({x0},0)"><text x="{}" y="20" text-anchor="middle" font-size="14">{title}</text>"#,
        W / 2.0
    );
    if pts.is_empty() {
        out.push_str("</g>");
        return;
    }
    let (xmin, xmax) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.0), a.1.max(p.0)));
    let (ymin, ymax) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.1), a.1.max(p.1)));
    let (lx0, lx1) = (xmin.log10(), xmax.log10().max(xmin.log10() + 1e-9));
    let (ly0, ly1) = (
        ymin.log10().floor(),
        ymax.log10().ceil().max(ymin.log10().floor() + 1.0),
    );
    let sx = |x: f64| M + (x.log10() - lx0) / (lx1 - lx0) * (W - 2.0 * M);
    let sy = |y: f64| H - M + -(y.log10() - ly0) / (ly1 - ly0) * (H - 2.0 * M);
    let _ = write!(
        out,
        r#"<rect x="{M}" y="{M}" width="{}" height="{}" fill="none" stroke="gray"/>"#,
        W - 2.0 * M,
        H - 2.0 * M
    );
    for e in (ly0 as i32)..=(ly1 as i32) {
        let y = sy(10f64.powi(e));
        let _ = write!(
            out,
            r#"<line x1="{M}" x2="{}" y1="{y}" y2="{y}" stroke="lightgray"/><text x="{}" y="{}" font-size="10" text-anchor="end">1e{e}</text>"#,
            W - M,
            M - 4.0,
            y + 3.0
        );
    }
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    sizes.sort();
    sizes.dedup();
    for s in sizes {
        let x = sx(s as f64);
        let label = if s >= 1 << 20 {
            format!("{}M", s >> 20)
        } else if s >= 1024 {
            format!("{}K", s >> 10)
        } else {
            s.to_string()
        };
        let _ = write!(
            out,
            r#"<text x="{x}" y="{}" font-size="10" text-anchor="middle">{label}</text>"#,
            H - M + 14.0
        );
    }
    let _ = write!(
        out,
        r#"<text x="{}" y="{}" font-size="11" text-anchor="middle">message size (bytes); y: {unit}</text>"#,
        W / 2.0,
        H - M + 32.0
    );
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        let key = format!("{} {}", r.transport, r.mode);
        if let Some(v) = get(r).filter(|v| *v > 0.0) {
            match series.iter_mut().find(|s| s.0 == key) {
                Some(s) => s.1.push((r.size as f64, v)),
                None => series.push((key, vec![(r.size as f64, v)])),
            }
        }
    }
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let path: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = write!(
            out,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        let _ = write!(
            out,
            r#"<text x="{}" y="{}" font-size="11" fill="{c}">{name}</text>"#,
            M + 6.0,
            M + 14.0 + 13.0 * i as f64
        );
    }
    out.push_str("</g>");
}

/// The chart for `rows`.
pub fn svg(rows: &[Row]) -> String {
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{H}" font-family="sans-serif">"#,
        2.0 * W
    );
    panel(&mut out, 0.0, "stream throughput", "bytes/s", rows, |r| {
        r.bytes_per_sec
    });
    panel(
        &mut out,
        W,
        "ping-pong round trip p50",
        "microseconds",
        rows,
        |r| r.p50_us,
    );
    out.push_str("</svg>\n");
    out
}
