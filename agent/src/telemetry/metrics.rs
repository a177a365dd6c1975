//! Metrics: Prometheus exposition of the data flow, recorded where things happen and read from the
//! caches when scraped.
//!
//! ```text
//! executor ──record──> operations, registration latency, retries, backoff, handler call latency
//! watcher  ──record──> rescans by reason
//! scrape ──> StateCollector reads desired / actual state, handlers, watcher and source counters
//!        ──> plugin_manager_total_plugins (kubelet's gauge), plugins by type and state, ...
//! ```
//!
//! Naming follows Prometheus rules: a `plugin_agent_` prefix, base units (`_seconds`, `_bytes`),
//! `_total` on counters, `_info` on constant info metrics. Label values come from small fixed sets
//! (outcome, kind, call, reason class, event source) or from operator-configured handler types;
//! never from error text or anything a plugin announces. The one exception is kubelet's
//! `plugin_manager_total_plugins{socket_path,state}`, kept as it is so kubelet dashboards work
//! unchanged; it has one series per socket per state, as in kubelet.

use crate::event_source::{EventSource, SourceKind};
use crate::executor::OperationExecutor;
use crate::handler::HandlerRegistry;
use crate::state::actual::ActualState;
use crate::state::desired::DesiredState;
use crate::watcher::WatcherStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The label set of the operation metrics: kind (`register`, `deregister`) and outcome.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    /// `register` or `deregister`.
    pub kind: &'static str,
    /// `success`, or the failure's reason class (see [`crate::executor`]).
    pub outcome: &'static str,
}

/// The label set of registration latency.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LatencyLabels {
    /// How the socket was found: `ebpf`, `fanotify`, `inotify` or `scan`.
    pub source: &'static str,
    /// `success` or `failure`.
    pub outcome: &'static str,
}

/// The label set of handler call latency.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandlerCallLabels {
    /// The plugin type the handler serves (operator-configured, so bounded).
    pub r#type: String,
    /// `validate`, `register` or `deregister`.
    pub call: &'static str,
    /// `ok`, `rejected`, `unavailable` or `timeout`.
    pub outcome: &'static str,
}

/// The label set of rescans.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RescanLabels {
    /// `start`, `periodic`, `root_removed` or `event_loss`.
    pub reason: &'static str,
}

/// The label set of walk errors.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WalkErrorLabels {
    /// `unreadable`, `too_long` or `root_not_directory`.
    pub kind: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 500 µs .. ~75 s: event-driven registrations take milliseconds, a retried one up to minutes.
    Histogram::new(exponential_buckets(0.0005, 2.5, 14))
}

fn handler_histogram() -> Histogram {
    // 100 µs .. ~26 s: in-process handlers answer in microseconds, remote ones in milliseconds.
    Histogram::new(exponential_buckets(0.0001, 4.0, 10))
}

fn backoff_histogram() -> Histogram {
    // Kubelet's backoff steps: 0.5 s doubling to 122 s.
    Histogram::new([0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 122.0])
}

/// Metrics recorded as things happen. Cheap to update: atomics behind a map lookup.
#[derive(Debug, Clone)]
pub struct Metrics {
    operations: Family<OperationLabels, Counter>,
    registration_duration: HistogramFamily<LatencyLabels>,
    retries: Counter,
    backoff_delay: Histogram,
    handler_calls: HistogramFamily<HandlerCallLabels>,
    rescans: Family<RescanLabels, Counter>,
    walk_errors: Family<WalkErrorLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            operations: Family::default(),
            registration_duration: Family::new_with_constructor(latency_histogram),
            retries: Counter::default(),
            backoff_delay: backoff_histogram(),
            handler_calls: Family::new_with_constructor(handler_histogram),
            rescans: Family::default(),
            walk_errors: Family::default(),
        }
    }
}

impl Metrics {
    /// An operation ended with `outcome` (`success` or a reason class).
    pub fn operation(&self, kind: &'static str, outcome: &'static str) {
        self.operations
            .get_or_create(&OperationLabels { kind, outcome })
            .inc();
    }

    /// A registration attempt ended; `latency` runs from the socket's discovery (its kernel event
    /// when timestamped) to the end of the attempt.
    pub fn registration(&self, source: &'static str, success: bool, latency: Duration) {
        let outcome = if success { "success" } else { "failure" };
        self.registration_duration
            .get_or_create(&LatencyLabels { source, outcome })
            .observe(latency.as_secs_f64());
    }

    /// A registration attempt started for a socket that failed before.
    pub fn retry(&self) {
        self.retries.inc();
    }

    /// A failed registration backs off for `delay`.
    pub fn backoff(&self, delay: Duration) {
        self.backoff_delay.observe(delay.as_secs_f64());
    }

    /// A handler call for `plugin_type` took `took` and ended with `outcome`.
    pub fn handler_call(
        &self,
        plugin_type: &str,
        call: &'static str,
        outcome: &'static str,
        took: Duration,
    ) {
        self.handler_calls
            .get_or_create(&HandlerCallLabels {
                r#type: plugin_type.to_string(),
                call,
                outcome,
            })
            .observe(took.as_secs_f64());
    }

    /// The watcher walked the whole tree; `reason` is the watcher's free-text reason, reduced
    /// here to its class.
    pub fn rescan(&self, reason: &str) {
        let reason = match reason {
            "start" => "start",
            crate::watcher::PERIODIC_RESCAN => "periodic",
            "the root directory was removed" => "root_removed",
            _ => "event_loss",
        };
        self.rescans.get_or_create(&RescanLabels { reason }).inc();
    }

    /// A walk could not read something (`kind`: `unreadable`, `too_long`,
    /// `root_not_directory`); what was known there was kept.
    pub fn walk_error(&self, kind: &'static str) {
        self.walk_errors
            .get_or_create(&WalkErrorLabels { kind })
            .inc();
    }

    /// Registers these metrics and the scrape-time `state` ones in a registry for exposition.
    pub fn registry(&self, state: StateCollector) -> Registry {
        let mut registry = self.registry_without_state();
        registry.register_collector(Box::new(state));
        registry
    }

    /// A registry with only the recorded metrics (for tests, and embedders without state).
    pub fn registry_without_state(&self) -> Registry {
        let mut registry = Registry::default();
        let agent = registry.sub_registry_with_prefix("plugin_agent");
        agent.register(
            "operations",
            "Registration and deregistration operations, by kind and outcome (success or failure reason class)",
            self.operations.clone(),
        );
        agent.register(
            "registration_duration_seconds",
            "Time from a socket's discovery (its kernel event when timestamped) to the end of a registration attempt",
            self.registration_duration.clone(),
        );
        agent.register(
            "registration_retries",
            "Registration attempts for sockets whose previous attempt failed",
            self.retries.clone(),
        );
        agent.register(
            "backoff_delay_seconds",
            "Backoff applied after failed registrations",
            self.backoff_delay.clone(),
        );
        agent.register(
            "handler_call_duration_seconds",
            "Handler ValidatePlugin / RegisterPlugin / DeRegisterPlugin latency, by plugin type, call and outcome",
            self.handler_calls.clone(),
        );
        agent.register(
            "rescans",
            "Full walks of the plugin directory, by reason class",
            self.rescans.clone(),
        );
        agent.register(
            "walk_errors",
            "Directories and paths a walk could not read (what was known there is kept), by kind",
            self.walk_errors.clone(),
        );
        registry
    }
}

/// Renders `registry` as Prometheus/OpenMetrics text.
pub fn render(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry)?;
    Ok(text)
}

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Metrics computed from the agent's state when scraped, so the data flow never pays for them.
pub struct StateCollector {
    /// Desired state: kubelet's `desired_state_of_world`.
    pub desired: Arc<DesiredState>,
    /// Actual state: kubelet's `actual_state_of_world`.
    pub actual: Arc<ActualState>,
    /// Handlers, for `handler_up`.
    pub handlers: Arc<HandlerRegistry>,
    /// The executor, for the backoff of unregistered plugins.
    pub executor: Arc<OperationExecutor>,
    /// Watcher counters (hints received, watched directories).
    pub watcher: Arc<WatcherStats>,
    /// The event source, for its own counters.
    pub source: Arc<dyn EventSource>,
}

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateCollector")
            .field("source", &self.source.kind())
            .finish_non_exhaustive()
    }
}

/// Encodes one metric family whose samples are `(labels, value)` pairs.
fn family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    samples: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, value) in samples {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Labels as (name, value) pairs.
type Pairs = Vec<(&'static str, String)>;

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let desired = self.desired.snapshot();
        let actual = self.actual.snapshot();

        let mut kubelet: Vec<(Pairs, ConstGauge)> = Vec::new();
        for (path, _) in &desired {
            kubelet.push((
                vec![
                    ("socket_path", path.to_string_lossy().into_owned()),
                    ("state", "desired_state_of_world".into()),
                ],
                ConstGauge::new(1),
            ));
        }
        for (path, _) in &actual {
            kubelet.push((
                vec![
                    ("socket_path", path.to_string_lossy().into_owned()),
                    ("state", "actual_state_of_world".into()),
                ],
                ConstGauge::new(1),
            ));
        }
        family(
            &mut encoder,
            "plugin_manager_total_plugins",
            "Number of plugins in Plugin Manager (kubelet-compatible: one series per socket and state)",
            MetricType::Gauge,
            kubelet,
        )?;

        // Plugins by type and state. The type is known once registered (and then is a handler's
        // type: bounded); before that it is `unknown`.
        let handler_types: Vec<String> = self.handlers.list().into_iter().map(|(t, _)| t).collect();
        let mut by_state: BTreeMap<(String, &'static str), i64> = BTreeMap::new();
        for t in &handler_types {
            by_state.insert((t.clone(), "registered"), 0);
        }
        for (_, entry) in &actual {
            let state = if entry.superseded {
                "superseded"
            } else {
                "registered"
            };
            *by_state
                .entry((entry.plugin.plugin_type.clone(), state))
                .or_default() += 1;
        }
        let registered: std::collections::HashSet<_> = actual.iter().map(|(p, _)| p).collect();
        by_state.insert(("unknown".into(), "pending"), 0);
        by_state.insert(("unknown".into(), "backing_off"), 0);
        for (path, plugin) in &desired {
            if registered.contains(path) {
                continue;
            }
            let state = if self.executor.backoff_of(path, plugin).is_some() {
                "backing_off"
            } else {
                "pending"
            };
            *by_state.entry(("unknown".into(), state)).or_default() += 1;
        }
        family(
            &mut encoder,
            "plugin_agent_plugins",
            "Plugin sockets by plugin type and state (registered, superseded, pending, backing_off).",
            MetricType::Gauge,
            by_state.into_iter().map(|((t, state), n)| {
                (
                    vec![("type", t), ("state", state.to_string())],
                    ConstGauge::new(n),
                )
            }),
        )?;

        family(
            &mut encoder,
            "plugin_agent_handler_up",
            "1 when the handler for a plugin type was reachable at its last contact.",
            MetricType::Gauge,
            self.handlers.list().into_iter().map(|(t, handler)| {
                let up = handler.health().map(|h| *h.borrow()).unwrap_or(true);
                (vec![("type", t)], ConstGauge::new(i64::from(up)))
            }),
        )?;

        let source = self.source.kind();
        let source_label = || vec![("source", source.as_str().to_string())];
        let stats = self.source.stats();
        family(
            &mut encoder,
            "plugin_agent_event_source_events",
            "Hints the event source delivered to the watcher.",
            MetricType::Counter,
            [(
                source_label(),
                ConstCounter::new(self.watcher.hints.load(Ordering::Relaxed)),
            )],
        )?;
        family(
            &mut encoder,
            "plugin_agent_event_source_dropped_events",
            "Events the kernel side of the event source could not deliver (each one leads to a rescan).",
            MetricType::Counter,
            [(source_label(), ConstCounter::new(stats.dropped))],
        )?;
        if let Some(size) = stats.ring_buffer_size_bytes {
            family(
                &mut encoder,
                "plugin_agent_event_source_ring_buffer_size_bytes",
                "Size of the eBPF ring buffer.",
                MetricType::Gauge,
                [(source_label(), ConstGauge::new(clamp(size)))],
            )?;
        }
        if let Some(used) = stats.ring_buffer_used_bytes {
            family(
                &mut encoder,
                "plugin_agent_event_source_ring_buffer_used_bytes",
                "Bytes waiting in the eBPF ring buffer when scraped.",
                MetricType::Gauge,
                [(source_label(), ConstGauge::new(clamp(used)))],
            )?;
        }
        ConstGauge::new(clamp(self.watcher.watched_dirs.load(Ordering::Relaxed))).encode(
            encoder.encode_descriptor(
                "plugin_agent_watched_directories",
                "Directories of the plugin tree the event source watches.",
                None,
                MetricType::Gauge,
            )?,
        )?;
        let mut info = encoder.encode_descriptor(
            "plugin_agent_event_source",
            "The event source in use.",
            None,
            MetricType::Info,
        )?;
        info.encode_info(&source_label())?;
        let mut info = encoder.encode_descriptor(
            "plugin_agent_build",
            "The agent's version, and whether it was built with the eBPF source.",
            None,
            MetricType::Info,
        )?;
        info.encode_info(&vec![
            ("version", env!("CARGO_PKG_VERSION").to_string()),
            ("ebpf", cfg!(ebpf_object).to_string()),
        ])?;
        Ok(())
    }
}

fn clamp(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Every metric name the agent exports (as Prometheus stores them), for dashboards and rules
/// checks.
pub const EXPORTED: &[&str] = &[
    "plugin_manager_total_plugins",
    "plugin_agent_operations_total",
    "plugin_agent_registration_duration_seconds_bucket",
    "plugin_agent_registration_duration_seconds_sum",
    "plugin_agent_registration_duration_seconds_count",
    "plugin_agent_registration_retries_total",
    "plugin_agent_backoff_delay_seconds_bucket",
    "plugin_agent_backoff_delay_seconds_sum",
    "plugin_agent_backoff_delay_seconds_count",
    "plugin_agent_handler_call_duration_seconds_bucket",
    "plugin_agent_handler_call_duration_seconds_sum",
    "plugin_agent_handler_call_duration_seconds_count",
    "plugin_agent_rescans_total",
    "plugin_agent_walk_errors_total",
    "plugin_agent_plugins",
    "plugin_agent_handler_up",
    "plugin_agent_event_source_events_total",
    "plugin_agent_event_source_dropped_events_total",
    "plugin_agent_event_source_ring_buffer_size_bytes",
    "plugin_agent_event_source_ring_buffer_used_bytes",
    "plugin_agent_watched_directories",
    "plugin_agent_event_source_info",
    "plugin_agent_build_info",
];

/// Labels any exported `source` label takes, so tests can check boundedness.
pub fn source_labels() -> impl Iterator<Item = &'static str> {
    SourceKind::PREFERENCE
        .iter()
        .map(|k| k.as_str())
        .chain(["scan"])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_source::{SourceStats, WatchedDir};
    use crate::events::EventBus;
    use crate::executor::ExecutorConfig;
    use crate::reconciler::ReconcileQueue;
    use std::collections::BTreeSet;

    struct RingSource;
    impl EventSource for RingSource {
        fn kind(&self) -> SourceKind {
            SourceKind::Ebpf
        }
        fn describe(&self) -> String {
            "test".into()
        }
        fn watch(&self, _dir: &WatchedDir) -> anyhow::Result<()> {
            Ok(())
        }
        fn unwatch(&self, _dir: &WatchedDir) {}
        fn stats(&self) -> SourceStats {
            SourceStats {
                dropped: 3,
                ring_buffer_size_bytes: Some(4096),
                ring_buffer_used_bytes: Some(128),
            }
        }
    }

    fn rendered() -> String {
        let telemetry = crate::telemetry::Telemetry::new(SourceKind::Ebpf);
        let actual = Arc::new(ActualState::default());
        let handlers = Arc::new(HandlerRegistry::default());
        handlers.insert("CSIPlugin", Arc::new(crate::handler::accept_all::AcceptAll));
        let executor = OperationExecutor::new(
            actual.clone(),
            handlers.clone(),
            Arc::new(ReconcileQueue::default()),
            ExecutorConfig::default(),
            EventBus::default(),
            telemetry.clone(),
            tokio_util::sync::CancellationToken::new(),
        );
        let desired = Arc::new(DesiredState::default());
        desired
            .add_or_update(
                std::path::Path::new("/r/a.sock"),
                crate::state::SocketId {
                    dev: 1,
                    ino: 2,
                    birth_ns: None,
                    handle: None,
                },
                None,
            )
            .expect("desired");
        let m = &telemetry.metrics;
        m.operation("register", "success");
        m.registration("ebpf", true, Duration::from_millis(3));
        m.retry();
        m.backoff(Duration::from_millis(500));
        m.handler_call("CSIPlugin", "validate", "ok", Duration::from_micros(40));
        m.rescan("start");
        m.walk_error("unreadable");
        let registry = m.registry(StateCollector {
            desired,
            actual,
            handlers,
            executor,
            watcher: Arc::new(WatcherStats::default()),
            source: Arc::new(RingSource),
        });
        render(&registry).expect("renders")
    }

    #[test]
    fn every_exported_name_is_listed_and_every_listed_name_is_exported() {
        let text = rendered();
        let names: BTreeSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| l.split(['{', ' ']).next())
            .collect();
        let listed: BTreeSet<&str> = EXPORTED.iter().copied().collect();
        assert_eq!(names, listed, "rendered:\n{text}");
    }

    #[test]
    fn kubelet_gauge_has_one_series_per_socket_and_state() {
        let text = rendered();
        assert!(text.contains(
            "plugin_manager_total_plugins{socket_path=\"/r/a.sock\",state=\"desired_state_of_world\"} 1"
        ));
        assert!(text.contains("plugin_agent_plugins{type=\"unknown\",state=\"pending\"} 1"));
        assert!(text.contains("plugin_agent_event_source_dropped_events_total{source=\"ebpf\"} 3"));
    }

    #[test]
    fn rescan_reasons_are_reduced_to_classes() {
        let m = Metrics::default();
        m.rescan("fanotify queue overflow: 12 events lost");
        m.rescan(crate::watcher::PERIODIC_RESCAN);
        let text = render(&m.registry_without_state()).expect("renders");
        assert!(text.contains("plugin_agent_rescans_total{reason=\"event_loss\"} 1"));
        assert!(text.contains("plugin_agent_rescans_total{reason=\"periodic\"} 1"));
        assert!(!text.contains("overflow"));
    }
}
