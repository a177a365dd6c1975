//! The benchmark's markdown: one row per scenario and mode, then the targets, met or not.

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
        "| scenario | mode | plugins | registered | lost | stale | dup | reg p50 | reg p99 | reg max | all registered | dereg p50 | dereg p99 | agent CPU s | RSS MiB (loaded / idle / peak) | idle wake-ups/s |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in results {
        let (scenario, mode) = (
            r["scenario"].as_str().unwrap_or("?"),
            r["mode"].as_str().unwrap_or("?"),
        );
        if let Some(error) = r["error"].as_str() {
            let _ = writeln!(
                out,
                "| {scenario} | {mode} | error: {} |||||||||||||||",
                error.replace('|', "/")
            );
            continue;
        }
        let t = &r["totals"];
        let (reg, dereg) = (&t["registration"], &t["deregistration"]);
        let _ = writeln!(
            out,
            "| {scenario} | {mode} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {:.2} | {} / {} / {} | {:.2} |",
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
            mib(&r["agent_load"]["rss_kib"]),
            mib(&r["agent_idle"]["rss_kib"]),
            mib(&r["agent_idle"]["rss_peak_kib"]),
            r["agent_idle"]["wakeups_per_s"].as_f64().unwrap_or(0.0),
        );
    }
    restarts(results, &mut out);
    out.push_str(
        "\n### Targets (latency, loss, CPU, memory and wake-ups per mode)\n\n| target | mode | measured | met |\n|---|---|---|---|\n",
    );
    for r in results.iter().filter(|r| r["error"].is_null()) {
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
         | scenario | mode | stop ms | start ms | gap ms | survivors | plugin calls to survivors | handler calls for survivors |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let t = &r["totals"]["restart"];
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {:.1} | {} | {} | {} |",
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
        "restart" | "restart-kill" => {
            let restart = &t["restart"];
            out.push((
                "restart: every plugin registered, none lost",
                format!("{}/{}, lost {}", t["registered"], t["plugins"], t["lost"]),
                t["registered"] == t["plugins"] && n(&t["lost"]) == 0,
            ));
            let calls = n(&restart["survivor_plugin_calls"])
                .saturating_add(n(&restart["survivor_handler_calls"]));
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
        _ => {}
    }
    out
}
