//! The operator-facing files in `deploy/` against the metrics the agent exports:
//! `prometheus-rules.yml` passes `promtool check rules`; every query of `grafana-dashboard.json`
//! parses (promtool checks them as recording rules); and both name only metrics the agent
//! exports ([`plugin_agent::telemetry::metrics::EXPORTED`], itself checked against a real
//! exposition by the metrics module's tests).
//!
//! Needs `promtool` (Debian's `prometheus` package, installed by `cargo xtask deps`): skipped with
//! a message when it is absent, except under `CI=true`, where that fails.

use plugin_agent::telemetry::metrics::EXPORTED;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(file)
}

/// `promtool`, or `None` (after saying why) when the test must be skipped.
fn promtool(test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("promtool"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: promtool is missing (install Debian's prometheus package: cargo xtask deps)"
        );
        eprintln!("{test}: SKIPPED: promtool is not installed (apt-get install prometheus)");
    }
    found
}

fn check_rules(promtool: &Path, file: &Path) {
    let out = Command::new(promtool)
        .args(["check", "rules"])
        .arg(file)
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool check rules {}:\n{}{}",
        file.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every query of the dashboard, with Grafana's variables replaced by values PromQL accepts.
fn dashboard_queries() -> Vec<String> {
    let text = std::fs::read_to_string(deploy("grafana-dashboard.json")).expect("dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("a PromQL expr");
            queries.push(
                expr.replace("$__rate_interval", "5m")
                    .replace("$instance", ".*"),
            );
        }
    }
    queries
}

/// Metric names in a PromQL expression: identifiers with the agent's (or kubelet's) prefix.
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|word| word.starts_with("plugin_agent_") || word.starts_with("plugin_manager_"))
        .map(str::to_string)
        .collect()
}

fn rule_exprs() -> Vec<String> {
    let text = std::fs::read_to_string(deploy("prometheus-rules.yml")).expect("rules");
    let rules: serde_norway::Value = serde_norway::from_str(&text).expect("rules are YAML");
    let mut exprs = Vec::new();
    for group in rules["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            exprs.push(rule["expr"].as_str().expect("expr").to_string());
        }
    }
    exprs
}

#[test]
fn alerting_rules_pass_promtool_check() {
    let Some(promtool) = promtool("alerting_rules_pass_promtool_check") else {
        return;
    };
    check_rules(&promtool, &deploy("prometheus-rules.yml"));
}

#[test]
fn every_dashboard_query_parses() {
    let Some(promtool) = promtool("every_dashboard_query_parses") else {
        return;
    };
    let queries = dashboard_queries();
    assert!(queries.len() >= 10, "the dashboard lost its queries");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, query) in queries.iter().enumerate() {
        let quoted = serde_json::to_string(query).expect("quote");
        rules += &format!("      - record: dashboard:query_{i}\n        expr: {quoted}\n");
    }
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), rules).expect("write rules");
    check_rules(&promtool, file.path());
}

#[test]
fn dashboard_and_rules_name_only_exported_metrics() {
    let exported: BTreeSet<&str> = EXPORTED.iter().copied().collect();
    let mut used = BTreeSet::new();
    for expr in dashboard_queries().iter().chain(rule_exprs().iter()) {
        for name in metric_names(expr) {
            assert!(
                exported.contains(name.as_str()),
                "{name} (in `{expr}`) is not a metric the agent exports"
            );
            used.insert(name);
        }
    }
    for needed in [
        "plugin_manager_total_plugins",
        "plugin_agent_operations_total",
        "plugin_agent_registration_duration_seconds_bucket",
        "plugin_agent_rescans_total",
        "plugin_agent_event_source_dropped_events_total",
        "plugin_agent_handler_up",
    ] {
        assert!(used.contains(needed), "nothing shows {needed}");
    }
}
