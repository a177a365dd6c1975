//! The benchmark's markdown: one row per scenario and mode, then the issue's targets, met or not.

use super::floor;

use serde_json::Value;
use std::fmt::Write;

fn ms(us: &Value) -> String {
    us.as_f64()
        .map(|us| format!("{:.1}", us / 1000.0))
        .unwrap_or_default()
}

fn mib(kib: &Value) -> String {
    kib.as_f64()
        .map(|k| format!("{:.1}", k / 1024.0))
        .unwrap_or_default()
}

/// One row from a scenario's rounds in one mode: every number (and every element of a number
/// array, such as the latency CDF) is the median of the rounds that finished, strings are the
/// first round's, and `rounds` keeps each round as it was. A single round is returned as it is;
/// when none finished, the first error stands for them.
pub fn median_of_rounds(mut rounds: Vec<Value>) -> Value {
    if rounds.len() == 1 {
        return rounds.remove(0);
    }
    let finished: Vec<&Value> = rounds.iter().filter(|r| r["error"].is_null()).collect();
    let Some(first) = finished.first() else {
        return rounds.into_iter().next().unwrap_or(Value::Null);
    };
    let mut row = median(first, &finished);
    if let Value::Object(fields) = &mut row {
        fields.insert(
            "rounds_failed".into(),
            (rounds.len() - finished.len()).into(),
        );
        fields.insert("rounds".into(), Value::Array(rounds));
    }
    row
}

/// The median of `all` wherever `shape` (one of them) has a number; `shape`'s value elsewhere.
fn median(shape: &Value, all: &[&Value]) -> Value {
    match shape {
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .map(|(key, value)| {
                    let same: Vec<&Value> = all.iter().map(|v| &v[key.as_str()]).collect();
                    (key.clone(), median(value, &same))
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(
            items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    let same: Vec<&Value> = all.iter().filter_map(|v| v.get(i)).collect();
                    median(item, &same)
                })
                .collect(),
        ),
        Value::Number(_) => {
            let mut numbers: Vec<f64> = all.iter().filter_map(|v| v.as_f64()).collect();
            numbers.sort_by(f64::total_cmp);
            let middle = match numbers.len() {
                0 => return shape.clone(),
                n if n % 2 == 1 => numbers[n / 2],
                n => (numbers[n / 2 - 1] + numbers[n / 2]) / 2.0,
            };
            // Counts stay whole numbers (the tables compare them as such).
            if all.iter().all(|v| v.is_u64()) {
                Value::from(middle.round() as u64)
            } else {
                Value::from(middle)
            }
        }
        other => other.clone(),
    }
}

/// One line per finished run, for the terminal.
pub fn one_line(r: &Value) -> String {
    let t = &r["totals"];
    format!(
        "{} {}: {}/{} registered, lost {}, stale {}, duplicates {}, p50 {} ms, p99 {} ms, agent CPU {} ms, idle {:.2} wake-ups/s",
        r["scenario"].as_str().unwrap_or("?"),
        r["mode"].as_str().unwrap_or("?"),
        t["registered"],
        t["plugins"],
        t["lost"],
        t["stale"],
        t["duplicates"],
        ms(&t["registration"]["p50_us"]),
        ms(&t["registration"]["p99_us"]),
        r["agent_load"]["cpu_ms"],
        r["agent_idle"]["wakeups_per_s"].as_f64().unwrap_or(0.0),
    )
}

/// The results table and the targets check; `command` reproduces the run.
pub fn markdown(results: &[Value], command: &str) -> String {
    let mut out = String::new();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let _ = writeln!(
        out,
        "Command: `{command}` ({cpus} CPUs, kernel {}). Latencies in ms; registration is \
         listen -> Notify(true), deregistration is unlink -> the agent's `deregistered` event.\n",
        kernel.trim()
    );
    out.push_str(
        "| scenario | mode | plugins | registered | lost | stale | dup | reg p50 | reg p99 | reg max | all registered | dereg p50 | dereg p99 | agent CPU s | CPU µs / reg (x floor) | RSS MiB (loaded / idle / peak) | idle wake-ups/s |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in results {
        let (scenario, mode) = (
            r["scenario"].as_str().unwrap_or("?"),
            r["mode"].as_str().unwrap_or("?"),
        );
        if let Some(error) = r["error"].as_str() {
            let _ = writeln!(
                out,
                "| {scenario} | {mode} | error: {} ||||||||||||||||",
                error.replace('|', "/")
            );
            continue;
        }
        let t = &r["totals"];
        let (reg, dereg) = (&t["registration"], &t["deregistration"]);
        let _ = writeln!(
            out,
            "| {scenario} | {mode} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {:.2} | {} | {} / {} / {} | {:.2} |",
            t["plugins"],
            t["registered"],
            t["lost"],
            t["stale"],
            t["duplicates"],
            ms(&reg["p50_us"]),
            ms(&reg["p99_us"]),
            ms(&reg["max_us"]),
            t["all_registered_ms"].as_f64().unwrap_or(0.0),
            ms(&dereg["p50_us"]),
            ms(&dereg["p99_us"]),
            r["agent_load"]["cpu_ms"].as_f64().unwrap_or(0.0) / 1000.0,
            floor::column(r),
            mib(&r["agent_load"]["rss_kib"]),
            mib(&r["agent_idle"]["rss_kib"]),
            mib(&r["agent_idle"]["rss_peak_kib"]),
            r["agent_idle"]["wakeups_per_s"].as_f64().unwrap_or(0.0),
        );
    }
    if let Some(rounds) = results.iter().find_map(|r| r["rounds"].as_array()) {
        let _ = writeln!(
            out,
            "\nEach row is the median of {} interleaved rounds, metric by metric (every round is \
             in results.json).",
            rounds.len()
        );
    }
    restarts(results, &mut out);
    floor::section(results, &mut out);
    against_fanotify(results, &mut out);
    out.push_str(
        "\n### Targets (latency, loss, CPU, memory and wake-ups per mode)\n\n| target | mode | measured | met |\n|---|---|---|---|\n",
    );
    // The floor and a kubelet harness are references, not the agent these targets are for.
    let agents = results.iter().filter(|r| {
        r["error"].is_null() && !matches!(r["mode"].as_str(), Some(floor::MODE | "kubelet"))
    });
    for r in agents {
        for (target, measured, met) in targets(r) {
            let _ = writeln!(
                out,
                "| {target} | {} | {measured} | {} |",
                r["mode"].as_str().unwrap_or("?"),
                if met { "yes" } else { "**no**" }
            );
        }
    }
    out
}

/// The restart scenarios' own table: how long no agent watched, and whom the new one bothered.
fn restarts(results: &[Value], out: &mut String) {
    let rows: Vec<&Value> = results
        .iter()
        .filter(|r| r["totals"]["restart"].is_object())
        .collect();
    if rows.is_empty() {
        return;
    }
    out.push_str(
        "\n### Restarts (signal -> old agent gone -> new agent listening; survivors: registered before, serving after)\n\n\
         The new agent's own account of its start, from its log (`agent started`): process start -> \
         first walk done (events handled as they come from then on), and its phases: setup (command \
         line, logging, runtime, handlers), event source (eBPF: adoption of the pinned programs), \
         state (the previous agent's, read back) and the first walk (with rounds, each the median \
         of its own). The load's CPU by phase (loadgen's `restart_cpu`): the old agent running until \
         the signal and stopping after it, the new agent starting until its admin API listens and \
         running after.\n\n\
         | scenario | mode | stop ms | start ms | gap ms | survivors | plugin calls to survivors | handler calls for survivors | started in ms (setup / source / state / walk) | CPU s: old running / stopping, new starting / running |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let t = &r["totals"]["restart"];
        let phases = &t["start_phases"];
        let phase = |name: &str| phases[name].as_f64().unwrap_or(0.0);
        let started = if phases.is_object() {
            format!(
                "{:.1} ({:.1} / {:.1} / {:.1} / {:.1})",
                phase("took_ms"),
                phase("setup_ms"),
                phase("event_source_ms"),
                phase("state_ms"),
                phase("first_walk_ms"),
            )
        } else {
            "not reported".to_string()
        };
        let cpu = &r["restart_cpu"];
        let seconds = |name: &str| cpu[name].as_f64().unwrap_or(0.0) / 1000.0;
        let by_phase = if cpu.is_object() {
            format!(
                "{:.2} / {:.2}, {:.2} / {:.2}",
                seconds("old_running_ms"),
                seconds("old_stopping_ms"),
                seconds("new_starting_ms"),
                seconds("new_running_ms"),
            )
        } else {
            "not reported".to_string()
        };
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {started} | {by_phase} |",
            r["scenario"].as_str().unwrap_or("?"),
            r["mode"].as_str().unwrap_or("?"),
            t["stop_ms"].as_f64().unwrap_or(0.0),
            t["start_ms"].as_f64().unwrap_or(0.0),
            t["gap_ms"].as_f64().unwrap_or(0.0),
            t["survivors"],
            t["survivor_plugin_calls"],
            t["survivor_handler_calls"],
        );
    }
}

/// The eBPF ring buffer's size (agent-ebpf's `EVENTS`): memory the eBPF source maps that no other
/// source has, and that the RSS comparison allows it.
const RING_KIB: f64 = 2048.0;

/// What the eBPF source must beat fanotify on, row by row (lower is better for each): the
/// field's path in a result, its column, and how many of its unit make a difference this
/// machine's noise cannot (a 0.1 ms p50 is not a lead).
const AGAINST_FANOTIFY: &[(&[&str], &str, f64)] = &[
    (&["totals", "registration", "p50_us"], "reg p50", 1000.0),
    (&["totals", "registration", "p99_us"], "reg p99", 1000.0),
    (&["totals", "deregistration", "p50_us"], "dereg p50", 1000.0),
    (&["totals", "deregistration", "p99_us"], "dereg p99", 1000.0),
    (&["agent_load", "cpu_ms"], "agent CPU", 100.0),
    (&["agent_idle", "rss_kib"], "RSS - ring", 512.0),
    (&["agent_idle", "rss_peak_kib"], "peak RSS - ring", 512.0),
    (&["agent_idle", "wakeups_per_s"], "idle wake-ups/s", 0.5),
];

fn field(r: &Value, path: &[&str]) -> Option<f64> {
    path.iter().try_fold(r, |v, key| v.get(*key))?.as_f64()
}

/// eBPF against fanotify, scenario by scenario, and issue 16's targets that compare the two.
fn against_fanotify(results: &[Value], out: &mut String) {
    let row = |scenario: &str, mode: &str| {
        results.iter().find(|r| {
            r["scenario"].as_str() == Some(scenario)
                && r["mode"].as_str() == Some(mode)
                && r["error"].is_null()
        })
    };
    let mut scenarios: Vec<&str> = results
        .iter()
        .filter_map(|r| r["scenario"].as_str())
        .collect();
    scenarios.dedup();
    let pairs: Vec<(&str, &Value, &Value)> = scenarios
        .into_iter()
        .filter_map(|s| Some((s, row(s, "ebpf")?, row(s, "fanotify")?)))
        .collect();
    if pairs.is_empty() {
        return;
    }
    comparison(&pairs, out);
    issue_16_targets(&pairs, out);
}

/// eBPF against fanotify (same scenario, same run): which is behind on what.
fn comparison(pairs: &[(&str, &Value, &Value)], out: &mut String) {
    out.push_str(
        "\n### eBPF against fanotify (eBPF / fanotify; RSS less the eBPF ring's 2 MiB; **behind**: \
         worse by more than 1 ms, 0.1 s of CPU, 0.5 MiB or 0.5 wake-ups/s)\n\n| scenario |",
    );
    for (_, column, _) in AGAINST_FANOTIFY {
        let _ = write!(out, " {column} |");
    }
    out.push_str(" eBPF behind on |\n|---|");
    out.push_str(&"---|".repeat(AGAINST_FANOTIFY.len() + 1));
    out.push('\n');
    for (scenario, ebpf, fanotify) in pairs {
        let _ = write!(out, "| {scenario} |");
        let mut behind = Vec::new();
        for (path, column, margin) in AGAINST_FANOTIFY {
            let (Some(mut e), Some(f)) = (field(ebpf, path), field(fanotify, path)) else {
                out.push_str(" |");
                continue;
            };
            let (shown_e, shown_f) = match path[path.len() - 1] {
                "p50_us" | "p99_us" => (format!("{:.1}", e / 1000.0), format!("{:.1}", f / 1000.0)),
                "cpu_ms" => (format!("{:.2}", e / 1000.0), format!("{:.2}", f / 1000.0)),
                "rss_kib" | "rss_peak_kib" => {
                    e -= RING_KIB;
                    (format!("{:.1}", e / 1024.0), format!("{:.1}", f / 1024.0))
                }
                _ => (format!("{e:.2}"), format!("{f:.2}")),
            };
            let lost = e - f > *margin;
            if lost {
                behind.push(*column);
            }
            let _ = write!(
                out,
                " {}{shown_e} / {shown_f}{} |",
                if lost { "**" } else { "" },
                if lost { "**" } else { "" }
            );
        }
        let _ = writeln!(
            out,
            " {} |",
            if behind.is_empty() {
                "none".to_owned()
            } else {
                behind.join(", ")
            }
        );
    }
}

/// Issue 16's targets that compare eBPF with fanotify.
fn issue_16_targets(pairs: &[(&str, &Value, &Value)], out: &mut String) {
    out.push_str("\n### Issue 16's targets (eBPF, against fanotify in the same run)\n\n| target | measured | met |\n|---|---|---|\n");
    let p99 = |r: &Value| field(r, &["totals", "registration", "p99_us"]).unwrap_or(f64::MAX);
    for (scenario, ebpf, fanotify) in pairs {
        let mut target = |name: String, measured: String, met: bool| {
            let _ = writeln!(
                out,
                "| {name} | {measured} | {} |",
                if met { "yes" } else { "**no**" }
            );
        };
        match *scenario {
            "storm" => {
                let (e, f) = (p99(ebpf), p99(fanotify));
                target(
                    "storm: eBPF p99 <= 1.5 x fanotify's".into(),
                    format!("{:.1} vs {:.1} ms", e / 1000.0, f / 1000.0),
                    e <= 1.5 * f,
                );
                let idle = field(ebpf, &["agent_idle", "wakeups_per_s"]).unwrap_or(f64::MAX);
                target(
                    "storm: eBPF idle wake-ups 0".into(),
                    format!("{idle:.2}/s"),
                    idle == 0.0,
                );
            }
            "restart" | "restart-kill" => {
                let (e, f) = (p99(ebpf), p99(fanotify));
                target(
                    format!("{scenario}: eBPF p99 <= fanotify's"),
                    format!("{:.1} vs {:.1} ms", e / 1000.0, f / 1000.0),
                    e <= f,
                );
            }
            "burst" => {
                let rss = |r: &Value| field(r, &["agent_idle", "rss_kib"]).unwrap_or(f64::MAX);
                let peak = field(ebpf, &["agent_idle", "rss_peak_kib"]).unwrap_or(f64::MAX);
                let (e, f) = (rss(ebpf), rss(fanotify));
                target(
                    "burst: eBPF RSS with 10,000 registered <= fanotify's + ring".into(),
                    format!(
                        "{:.1} vs {:.1} + {:.0} MiB",
                        e / 1024.0,
                        f / 1024.0,
                        RING_KIB / 1024.0
                    ),
                    e <= f + RING_KIB,
                );
                target(
                    "burst: eBPF peak RSS <= 1.2 x loaded".into(),
                    format!("{:.1} / {:.1} MiB", peak / 1024.0, e / 1024.0),
                    peak <= 1.2 * e,
                );
            }
            _ => {}
        }
    }
}

/// The targets a result speaks to: (target, what was measured, met).
fn targets(r: &Value) -> Vec<(&'static str, String, bool)> {
    let t = &r["totals"];
    let n = |v: &Value| v.as_u64().unwrap_or(u64::MAX);
    let p99 = n(&t["registration"]["p99_us"]);
    let clean = n(&t["lost"]) == 0 && n(&t["stale"]) == 0 && n(&t["duplicates"]) == 0;
    let idle = r["agent_idle"]["wakeups_per_s"]
        .as_f64()
        .unwrap_or(f64::MAX);
    let mut out = Vec::new();
    match r["scenario"].as_str().unwrap_or("") {
        "churn" => out.push((
            "churn 1,000/s: 0 lost/stale/dup, p99 <= 20 ms",
            format!(
                "lost {} stale {} dup {}, p99 {} ms",
                t["lost"],
                t["stale"],
                t["duplicates"],
                ms(&t["registration"]["p99_us"])
            ),
            clean && p99 <= 20_000,
        )),
        "burst" => {
            let all = t["all_registered_ms"].as_f64().unwrap_or(f64::MAX);
            // Steady state: the end of the idle window, 10,000 registered and nothing running
            // (the "loaded" sample is taken as the last registration lands).
            let rss = r["agent_idle"]["rss_kib"].as_u64().unwrap_or(u64::MAX);
            out.push((
                "burst 10,000 all registered <= 3 s",
                format!("{}/{} in {:.0} ms", t["registered"], t["plugins"], all),
                t["registered"] == t["plugins"] && all <= 3000.0,
            ));
            out.push((
                "RSS <= 30 MiB with 10,000 registered",
                format!("{} MiB", mib(&r["agent_idle"]["rss_kib"])),
                rss <= 30 * 1024,
            ));
            out.push((
                "idle <= 1 wake-up/s (10,000 registered)",
                format!("{idle:.2}/s"),
                idle <= 1.0,
            ));
        }
        "storm" => out.push((
            "storm 200,000 pairs: all 100 registered, p99 <= 50 ms",
            format!(
                "{}/{}, p99 {} ms",
                t["registered"],
                t["plugins"],
                ms(&t["registration"]["p99_us"])
            ),
            t["registered"] == t["plugins"] && p99 <= 50_000,
        )),
        "crash" => {
            let dereg = n(&t["deregistration"]["p99_us"]);
            let all = t["deregistration"]["n"] == t["plugins"];
            out.push((
                "crash: 100 SIGKILLed, all deregistered, death -> DeRegister p99 <= 25 ms",
                format!(
                    "{}/{} deregistered, p99 {} ms",
                    t["deregistration"]["n"],
                    t["plugins"],
                    ms(&t["deregistration"]["p99_us"])
                ),
                all && dereg <= 25_000,
            ));
        }
        "handoff" => out.push((
            "handoff: 100 listeners handed to a child, parent exits: 0 deregistered, all registered",
            format!(
                "{}/{} registered, {} deregistered while served",
                t["registered"], t["plugins"], t["early_deregistrations"]
            ),
            t["registered"] == t["plugins"] && n(&t["early_deregistrations"]) == 0,
        )),
        "restart" | "restart-kill" => restart_targets(t, &mut out),
        _ => {}
    }
    out
}

/// A restart's targets: everything registered, nothing called again, a quick start.
fn restart_targets(t: &Value, out: &mut Vec<(&'static str, String, bool)>) {
    let n = |v: &Value| v.as_u64().unwrap_or(u64::MAX);
    let restart = &t["restart"];
    out.push((
        "restart: every plugin registered, none lost",
        format!("{}/{}, lost {}", t["registered"], t["plugins"], t["lost"]),
        t["registered"] == t["plugins"] && n(&t["lost"]) == 0,
    ));
    let calls =
        n(&restart["survivor_plugin_calls"]).saturating_add(n(&restart["survivor_handler_calls"]));
    out.push((
        "restart: zero plugin and handler calls for unchanged plugins",
        format!("{calls} calls for {} survivors", restart["survivors"]),
        calls == 0,
    ));
    let start = restart["start_ms"].as_f64().unwrap_or(f64::MAX);
    out.push((
        "restart: agent start to discovery running <= 50 ms",
        format!("{start:.1} ms"),
        start <= 50.0,
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restart row's table line carries the load's CPU by phase, in seconds.
    #[test]
    fn a_restart_row_shows_its_cpu_by_phase() {
        let row = serde_json::json!({
            "scenario": "restart",
            "mode": "ebpf",
            "totals": {"restart": {"stop_ms": 20.0, "start_ms": 19.0, "gap_ms": 40.0,
                "survivors": 980, "survivor_plugin_calls": 0, "survivor_handler_calls": 0}},
            "restart_cpu": {"old_running_ms": 3800, "old_stopping_ms": 20,
                "new_starting_ms": 10, "new_running_ms": 4340},
        });
        let mut out = String::new();
        restarts(&[row], &mut out);
        let line = out
            .lines()
            .find(|l| l.starts_with("| restart | ebpf |"))
            .expect("the row's line");
        assert!(
            line.ends_with("| not reported | 3.80 / 0.02, 0.01 / 4.34 |"),
            "{line}"
        );
    }
}
