//! Issue 49's floor: every mode's CPU per registration and per plugin lifecycle, against the
//! floor's in the same scenario of the same run (the floor: loadgen's `floor`, two RPCs per
//! plugin and nothing else, told of each plugin directly), and against kubelet's plugin manager
//! when a harness ran beside them.
//!
//! - per registration: CPU during the load / plugins registered. In churn and the restarts the
//!   load window holds the plugins' deregistrations too (each lives 2 s within it);
//! - per lifecycle: CPU during the load and the removal (everything going away, the stale
//!   bound's wait included) / plugins created.
//!
//! CPU comes from `/proc/<pid>/stat` in ticks of 10 ms: a ratio is given only when the floor
//! spent at least [`MIN_FLOOR_MS`].

use serde_json::{Value, json};
use std::fmt::Write;

/// The floor's mode: run in every scenario, whatever `--modes` says, as every mode's CPU is
/// read against it.
pub const MODE: &str = "floor";
use MODE as FLOOR;

/// Below this the floor's ticks are too few for a ratio (10 % of its CPU or more per tick).
const MIN_FLOOR_MS: f64 = 100.0;

/// Issue 49's target: agent CPU per registration at most this many times the floor's.
const TARGET_X_FLOOR: f64 = 1.5;

/// Issue 49's target: kubelet's plugin manager at least this many times the agent's CPU.
const TARGET_X_KUBELET: f64 = 5.0;

fn ms(r: &Value, usage: &str) -> Option<f64> {
    r[usage]["cpu_ms"].as_f64()
}

/// CPU per registration and per lifecycle, µs (`None` when nothing registered).
fn per_plugin(r: &Value) -> Option<(f64, f64)> {
    let registered = r["totals"]["registered"].as_f64().filter(|n| *n > 0.0)?;
    let plugins = r["totals"]["plugins"].as_f64().filter(|n| *n > 0.0)?;
    let load = ms(r, "agent_load")?;
    let removal = ms(r, "agent_removal").unwrap_or(0.0);
    Some((
        load * 1000.0 / registered,
        (load + removal) * 1000.0 / plugins,
    ))
}

/// Adds `cpu` to every finished row: its CPU per registration and per lifecycle, the floor's of
/// the same scenario, and the ratios (null where the floor's CPU is too small to divide by).
pub fn add_ratios(results: &mut [Value]) {
    let floors: Vec<(String, Value)> = results
        .iter()
        .filter(|r| r["mode"].as_str() == Some(FLOOR) && r["error"].is_null())
        .filter_map(|r| Some((r["scenario"].as_str()?.to_owned(), r.clone())))
        .collect();
    for r in results.iter_mut().filter(|r| r["error"].is_null()) {
        let Some((reg, life)) = per_plugin(r) else {
            continue;
        };
        let floor = floors
            .iter()
            .find(|(s, _)| r["scenario"].as_str() == Some(s))
            .map(|(_, f)| f);
        let floor_cpu = floor.and_then(|f| {
            let cpu = ms(f, "agent_load")? + ms(f, "agent_removal").unwrap_or(0.0);
            Some((cpu >= MIN_FLOOR_MS).then_some(per_plugin(f)?))
        });
        let (f_reg, f_life) = floor_cpu.flatten().unzip();
        r["cpu"] = json!({
            "per_registration_us": reg,
            "per_lifecycle_us": life,
            "floor_per_registration_us": f_reg,
            "floor_per_lifecycle_us": f_life,
            "x_floor_registration": f_reg.map(|f| reg / f),
            "x_floor_lifecycle": f_life.map(|f| life / f),
        });
    }
}

/// `12.3 x` or `-`.
fn times(v: &Value) -> String {
    v.as_f64().map_or("-".into(), |x| format!("{x:.2} x"))
}

/// The column of the main table: CPU per registration, µs, and its ratio to the floor's.
pub fn column(r: &Value) -> String {
    let cpu = &r["cpu"];
    match cpu["per_registration_us"].as_f64() {
        Some(us) => format!("{us:.0} ({})", times(&cpu["x_floor_registration"])),
        None => "-".into(),
    }
}

/// The floor's table and issue 49's targets.
pub fn section(results: &[Value], out: &mut String) {
    let rows: Vec<&Value> = results.iter().filter(|r| r["cpu"].is_object()).collect();
    if rows.is_empty() {
        return;
    }
    out.push_str(
        "\n### CPU per plugin against the floor (issue 49; floor: two RPCs per plugin, nothing else)\n\n\
         Per registration: CPU during the load / plugins registered (churn and restarts: the load \
         holds the deregistrations too); per lifecycle: load + removal / plugins created. CPU in \
         10 ms ticks: no ratio when the floor spent under 0.1 s.\n\n\
         | scenario | mode | CPU µs / registration | floor's | x floor | CPU µs / lifecycle | floor's | x floor |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    let us = |v: &Value| v.as_f64().map_or("-".into(), |x| format!("{x:.0}"));
    for r in &rows {
        let cpu = &r["cpu"];
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r["scenario"].as_str().unwrap_or("?"),
            r["mode"].as_str().unwrap_or("?"),
            us(&cpu["per_registration_us"]),
            us(&cpu["floor_per_registration_us"]),
            times(&cpu["x_floor_registration"]),
            us(&cpu["per_lifecycle_us"]),
            us(&cpu["floor_per_lifecycle_us"]),
            times(&cpu["x_floor_lifecycle"]),
        );
    }
    targets(&rows, out);
}

/// Issue 49's targets: each agent mode within 1.5 x the floor; kubelet 5 x the agent.
fn targets(rows: &[&Value], out: &mut String) {
    out.push_str("\n### Issue 49's targets\n\n| target | measured | met |\n|---|---|---|\n");
    let agents = rows
        .iter()
        .filter(|r| !matches!(r["mode"].as_str(), Some(FLOOR | "kubelet" | "polling")));
    for r in agents {
        let (scenario, mode) = (
            r["scenario"].as_str().unwrap_or("?"),
            r["mode"].as_str().unwrap_or("?"),
        );
        let Some(x) = r["cpu"]["x_floor_registration"].as_f64() else {
            continue;
        };
        let _ = writeln!(
            out,
            "| {scenario} {mode}: CPU per registration <= {TARGET_X_FLOOR} x the floor's | {x:.2} x | {} |",
            if x <= TARGET_X_FLOOR { "yes" } else { "**no**" }
        );
        let kubelet = rows.iter().find(|k| {
            k["mode"].as_str() == Some("kubelet") && k["scenario"].as_str() == Some(scenario)
        });
        let per_reg = |r: &Value| r["cpu"]["per_registration_us"].as_f64();
        if let (Some(k), Some(a)) = (kubelet.and_then(|k| per_reg(k)), per_reg(r)) {
            let _ = writeln!(
                out,
                "| {scenario} {mode}: kubelet's CPU >= {TARGET_X_KUBELET} x the agent's | {:.2} x | {} |",
                k / a,
                if k / a >= TARGET_X_KUBELET {
                    "yes"
                } else {
                    "**no**"
                }
            );
        }
    }
}
