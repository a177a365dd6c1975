//! The latency plot: one CDF per mode for a scenario, written as plain SVG (no plotting
//! dependency): x is registration latency on a log scale, y the share of plugins registered
//! within it.

use serde_json::Value;
use std::fmt::Write;
use std::path::Path;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 140.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 50.0;
/// The x axis, log10 of milliseconds: 0.1 ms to 10 s.
const X_MIN: f64 = -1.0;
const X_MAX: f64 = 4.0;
const COLORS: [&str; 4] = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a"];

fn x_of(us: f64) -> f64 {
    let log = (us.max(1.0) / 1000.0).log10().clamp(X_MIN, X_MAX);
    LEFT + (log - X_MIN) / (X_MAX - X_MIN) * (WIDTH - LEFT - RIGHT)
}

fn y_of(percent: f64) -> f64 {
    TOP + (1.0 - percent / 100.0) * (HEIGHT - TOP - BOTTOM)
}

/// Writes `latency-<scenario>.svg` in `dir` from the results of `scenario` among `results`.
pub fn write_cdf(dir: &Path, scenario: &str, results: &[Value]) -> anyhow::Result<()> {
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="18" font-size="14">{scenario}: listen -> Notify(true) latency (CDF)</text>"#
    );
    for decade in (X_MIN as i32)..=(X_MAX as i32) {
        let x = x_of(10f64.powi(decade) * 1000.0);
        let label = match decade {
            -1 => "0.1 ms".to_owned(),
            0..=2 => format!("{} ms", 10i64.pow(decade as u32)),
            d => format!("{} s", 10i64.pow(d as u32 - 3)),
        };
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{label}</text>"##,
            HEIGHT - BOTTOM,
            HEIGHT - BOTTOM + 16.0
        );
    }
    for percent in [0, 50, 90, 99, 100] {
        let y = y_of(f64::from(percent));
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{percent} %</text>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            y + 4.0
        );
    }
    let runs = results
        .iter()
        .filter(|r| r["scenario"].as_str() == Some(scenario) && r["error"].is_null());
    for (i, r) in runs.enumerate() {
        let color = COLORS[i % COLORS.len()];
        let cdf = r["totals"]["registration"]["cdf_us"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let points: Vec<String> = cdf
            .iter()
            .enumerate()
            .filter_map(|(q, us)| {
                us.as_f64()
                    .map(|us| format!("{:.1},{:.1}", x_of(us), y_of((q + 1) as f64)))
            })
            .collect();
        if points.is_empty() {
            continue;
        }
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            points.join(" ")
        );
        let y = TOP + 20.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            WIDTH - RIGHT + 10.0,
            WIDTH - RIGHT + 30.0,
            WIDTH - RIGHT + 36.0,
            y + 4.0,
            r["mode"].as_str().unwrap_or("?")
        );
    }
    svg.push_str("</svg>\n");
    std::fs::write(dir.join(format!("latency-{scenario}.svg")), svg)?;
    Ok(())
}
