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

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(deploy("grafana-dashboard.json")).expect("dashboard");
    serde_json::from_str(&text).expect("dashboard is JSON")
}

/// Every target of the dashboard with its panel, for the data source of type `kind`.
fn targets_of(dashboard: &serde_json::Value, kind: &str) -> Vec<(String, serde_json::Value)> {
    let mut targets = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            if target["datasource"]["type"] == kind {
                let title = panel["title"].as_str().unwrap_or_default().to_string();
                targets.push((title, target.clone()));
            }
        }
    }
    targets
}

/// Every Prometheus query of the dashboard, with Grafana's variables replaced by values PromQL
/// accepts.
fn dashboard_queries() -> Vec<String> {
    let mut queries = Vec::new();
    {
        for (_, target) in targets_of(&dashboard(), "prometheus") {
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

/// The histograms whose buckets carry a trace exemplar (see `telemetry::metrics`).
const WITH_EXEMPLARS: &[&str] = &[
    "plugin_agent_registration_duration_seconds_bucket",
    "plugin_agent_deregistration_duration_seconds_bucket",
    "plugin_agent_handler_call_duration_seconds_bucket",
    "plugin_agent_plugin_call_duration_seconds_bucket",
    "plugin_agent_unserved_deregistration_seconds_bucket",
    "plugin_agent_first_contact_seconds_bucket",
];

/// From a latency panel to the trace behind a point: every query of a histogram with exemplars
/// asks for them, and the provisioned Prometheus source links the exemplars' label (`trace_id`,
/// the agent's) to the trace source the dashboard's `traces` variable selects.
#[test]
fn latency_panels_show_exemplars_that_link_to_the_trace_data_source() {
    let dashboard = dashboard();
    let mut with = 0;
    for (title, target) in targets_of(&dashboard, "prometheus") {
        let expr = target["expr"].as_str().expect("expr");
        if metric_names(expr)
            .iter()
            .any(|name| WITH_EXEMPLARS.contains(&name.as_str()))
        {
            assert_eq!(
                target["exemplar"], true,
                "{title}: `{expr}` hides exemplars"
            );
            with += 1;
        }
    }
    assert!(with >= 6, "only {with} latency queries");

    let traces = dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
        .iter()
        .find(|v| v["name"] == "traces")
        .expect("a trace data-source variable");
    assert_eq!(traces["type"], "datasource");
    let text = std::fs::read_to_string(deploy("grafana-datasources.yaml")).expect("datasources");
    let provisioned: serde_norway::Value = serde_norway::from_str(&text).expect("YAML");
    let sources = provisioned["datasources"].as_sequence().expect("sources");
    let prometheus = sources
        .iter()
        .find(|s| s["type"] == "prometheus")
        .expect("a Prometheus source");
    let link = &prometheus["jsonData"]["exemplarTraceIdDestinations"][0];
    // What the agent's exemplars look like in the exposition Prometheus scrapes.
    use plugin_agent::telemetry::metrics::HexId;
    let metrics = plugin_agent::telemetry::metrics::Metrics::default();
    metrics.first_contact(
        std::time::Duration::from_millis(5),
        Some(plugin_agent::telemetry::metrics::TraceExemplar {
            trace_id: HexId::of(&0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736_u128.to_be_bytes()),
            span_id: HexId::of(&0x00f0_67aa_0ba9_02b7_u64.to_be_bytes()),
        }),
    );
    let labels =
        plugin_agent::telemetry::metrics::render(&metrics.registry_without_state()).expect("text");
    let label = link["name"].as_str().expect("the exemplar label");
    assert!(
        labels.contains(&format!("# {{{label}=\"4bf92f3577b34da6a3ce929d0e0e4736\"")),
        "the link follows `{label}`, the agent's exemplars are:\n{labels}"
    );
    let uid = link["datasourceUid"].as_str().expect("a trace source uid");
    let backend = sources
        .iter()
        .find(|s| s["uid"].as_str() == Some(uid))
        .expect("the linked trace source is provisioned");
    assert_eq!(
        backend["type"].as_str(),
        traces["query"].as_str(),
        "the dashboard's traces variable selects the linked backend's type"
    );
}

/// The slowest-registrations panel asks the trace source for `register` spans by attributes the
/// agent sets on them (`observability::traces_of_a_registration_...` checks them on real spans).
#[test]
fn the_slowest_registrations_panel_queries_what_register_spans_carry() {
    const REGISTER_ATTRIBUTES: &[&str] = &[
        "socket_path",
        "plugin_name",
        "plugin_type",
        "event_source",
        "attempt",
        "outcome",
    ];
    let dashboard = dashboard();
    let targets = targets_of(&dashboard, "tempo");
    assert!(!targets.is_empty(), "no panel reads the trace source");
    for (title, target) in targets {
        let query = target["query"].as_str().expect("a TraceQL query");
        assert!(query.contains("name = \"register\""), "{title}: {query}");
        for attribute in query.split("span.").skip(1) {
            let name: String = attribute
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            assert!(
                REGISTER_ATTRIBUTES.contains(&name.as_str()),
                "{title}: register spans carry no `{name}`"
            );
        }
    }
}
