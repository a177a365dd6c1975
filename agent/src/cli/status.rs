//! `plugin-agent status`: the event source, rescans, plugin counts and handler health.

use super::output::Output;
use super::render::{print_structured, timestamp};
use crate::admin;
use plugin_agent_proto::pluginagent::v1 as api;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Debug, serde::Serialize)]
struct StatusView {
    version: String,
    plugin_dir: String,
    source: String,
    source_description: String,
    reconcile_mode: String,
    mode: String,
    started_at: String,
    plugins_desired: u64,
    plugins_registered: u64,
    rescans: u64,
    loss_rescans: u64,
    watched_directories: u64,
    walks_completed: u64,
    problems: Vec<String>,
    handlers: Vec<HandlerView>,
    kernel: String,
    kernel_features: Vec<KernelFeatureView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    metrics_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    source_start: Option<SourceStartView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    restore: Option<RestoreView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    start_phases: Option<StartPhasesView>,
}

/// How the event source started (the wire's `SourceStart`).
#[derive(Debug, serde::Serialize)]
struct SourceStartView {
    how: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pins: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    object_hash: Option<String>,
    backlog_bytes: u64,
    open_ms: f64,
}

/// What the state file carried over (the wire's `Restore`).
#[derive(Debug, serde::Serialize)]
struct RestoreView {
    restored: u64,
    handler_changed: u64,
    interrupted: u64,
}

/// Where the start's time went (the wire's `StartPhases`).
#[derive(Debug, serde::Serialize)]
struct StartPhasesView {
    setup_ms: f64,
    event_source_ms: f64,
    state_ms: f64,
    first_walk_ms: f64,
    took_ms: f64,
}

#[derive(Debug, serde::Serialize)]
struct KernelFeatureView {
    feature: String,
    available: String,
    since: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    detail: String,
    without: String,
}

#[derive(Debug, serde::Serialize)]
struct HandlerView {
    plugin_type: String,
    target: String,
    healthy: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_error: Option<String>,
}

pub(super) async fn status(socket: &std::path::Path, output: Output) -> anyhow::Result<()> {
    let mut client = admin::client::connect(socket).await?;
    let s = client
        .get_status(api::GetStatusRequest {})
        .await?
        .into_inner();
    let started_unix_ms = s.started_unix_ms;
    let view = StatusView::from(s);
    if output != Output::Table {
        return print_structured(&view, output);
    }
    print_table(&view, started_unix_ms);
    Ok(())
}

impl From<api::AgentStatus> for StatusView {
    /// The agent's answer as shown: timestamps as text, empty errors as none.
    fn from(s: api::AgentStatus) -> Self {
        StatusView {
            version: s.version,
            plugin_dir: s.plugin_dir,
            source: s.source,
            source_description: s.source_description,
            reconcile_mode: s.reconcile_mode,
            mode: s.mode,
            started_at: timestamp(s.started_unix_ms),
            plugins_desired: s.plugins_desired,
            plugins_registered: s.plugins_registered,
            rescans: s.rescans,
            loss_rescans: s.loss_rescans,
            watched_directories: s.watched_directories,
            walks_completed: s.walks_completed,
            problems: s.problems,
            handlers: s
                .handlers
                .into_iter()
                .map(|h| HandlerView {
                    plugin_type: h.plugin_type,
                    target: h.target,
                    healthy: h.healthy,
                    last_error: (!h.last_error.is_empty()).then_some(h.last_error),
                })
                .collect(),
            kernel: s.kernel,
            kernel_features: s
                .kernel_features
                .into_iter()
                .map(|f| KernelFeatureView {
                    feature: f.feature,
                    available: f.available,
                    since: f.since,
                    detail: f.detail,
                    without: f.without,
                })
                .collect(),
            metrics_address: (!s.metrics_address.is_empty()).then_some(s.metrics_address),
            source_start: s.source_start.map(|start| SourceStartView {
                how: start.how,
                pins: (!start.pins.is_empty()).then_some(start.pins),
                object_hash: (!start.object_hash.is_empty()).then_some(start.object_hash),
                backlog_bytes: start.backlog_bytes,
                open_ms: start.open_ms,
            }),
            restore: s.restore.map(|r| RestoreView {
                restored: r.restored,
                handler_changed: r.handler_changed,
                interrupted: r.interrupted,
            }),
            start_phases: s.start_phases.map(|p| StartPhasesView {
                setup_ms: p.setup_ms,
                event_source_ms: p.event_source_ms,
                state_ms: p.state_ms,
                first_walk_ms: p.first_walk_ms,
                took_ms: p.took_ms,
            }),
        }
    }
}

/// The table `status` prints by default.
fn print_table(view: &StatusView, started_unix_ms: i64) {
    let uptime = SystemTime::now()
        .duration_since(UNIX_EPOCH + Duration::from_millis(started_unix_ms.max(0) as u64))
        .unwrap_or_default();
    out!(
        "plugin-agent {}  up {}",
        view.version,
        humantime::format_duration(Duration::from_secs(uptime.as_secs()))
    );
    out!("plugin dir:    {}", view.plugin_dir);
    out!(
        "event source:  {} ({})",
        view.source,
        view.source_description
    );
    print_start(view);
    out!("reconciler:    {}", view.reconcile_mode);
    out!("mode:          {}", view.mode);
    out!(
        "plugins:       {} found, {} registered",
        view.plugins_desired,
        view.plugins_registered
    );
    out!(
        "rescans:       {} ({} after event loss)",
        view.rescans,
        view.loss_rescans
    );
    out!("watching:      {} directories", view.watched_directories);
    let present: Vec<&str> = view
        .kernel_features
        .iter()
        .filter(|f| f.available == "true")
        .map(|f| f.feature.as_str())
        .collect();
    out!("kernel:        {}: has {}", view.kernel, present.join(" "));
    for f in view
        .kernel_features
        .iter()
        .filter(|f| f.available != "true")
    {
        let state = if f.available == "false" {
            "MISSING"
        } else {
            "unknown"
        };
        out!(
            "  {} {state} (Linux {}): {}; {}",
            f.feature,
            f.since,
            crate::text::escape(&f.detail),
            f.without
        );
    }
    for problem in &view.problems {
        out!("PROBLEM:       {}", crate::text::escape(problem));
    }
    out!("handlers:");
    for h in &view.handlers {
        let health = if h.healthy { "healthy" } else { "UNREACHABLE" };
        let error = h
            .last_error
            .as_deref()
            .map(|e| format!(" last error: {e}"))
            .unwrap_or_default();
        let line = format!(
            "  {:<16} {:<8} {}{}",
            h.plugin_type, health, h.target, error
        );
        out!("{}", crate::text::escape(&line));
    }
}

/// The table's lines about the start: how the source started, what the state file carried
/// over, and where metrics are served.
fn print_start(view: &StatusView) {
    if let Some(start) = &view.source_start {
        let mut line = format!("started:       source {}", start.how);
        if let Some(pins) = &start.pins {
            line += &format!(", pins {pins}");
        }
        if start.backlog_bytes > 0 {
            line += &format!(
                ", {} bytes recorded while no agent ran",
                start.backlog_bytes
            );
        }
        if let Some(p) = &view.start_phases {
            line += &format!(", ready in {} ms", p.took_ms);
        }
        out!("{}", crate::text::escape(&line));
    }
    if let Some(r) = view
        .restore
        .as_ref()
        .filter(|r| r.restored + r.handler_changed > 0)
    {
        out!(
            "carried on:    {} registrations ({} interrupted, {} handler changed)",
            r.restored,
            r.interrupted,
            r.handler_changed
        );
    }
    if let Some(addr) = &view.metrics_address {
        out!("metrics:       http://{addr}/metrics");
    }
}
