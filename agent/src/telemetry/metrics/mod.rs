//! Metrics: Prometheus exposition of the data flow, recorded where things happen and read from the
//! caches when scraped.
//!
//! ```text
//! executor ──record──> operations, registration latency, retries, backoff, handler call latency
//! watcher  ──record──> rescans by reason
//! scrape ──> StateCollector reads state::view (desired, actual, backoff: each plugin's state,
//!            derived as the admin API derives it), handlers, watcher and source counters
//!        ──> plugin_manager_total_plugins (kubelet's gauge), plugins by type and state, ...
//! ```
//!
//! Naming follows Prometheus rules: a `plugin_agent_` prefix, base units (`_seconds`, `_bytes`),
//! `_total` on counters, `_info` on constant info metrics. Label values come from small fixed sets
//! (outcome, kind, call, reason class, event source) or from operator-configured handler types;
//! never from error text or anything a plugin announces. The one exception is kubelet's
//! `plugin_manager_total_plugins{socket_path,state}`, kept as it is so kubelet dashboards work
//! unchanged; it has one series per socket per state, as in kubelet.

mod collector;

pub use collector::StateCollector;

use crate::event_source::{RescanReason, SourceKind};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, RwLock};
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

/// The label set of plugin call step latency.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginCallLabels {
    /// `dial`, `get_info` or `notify`.
    pub call: &'static str,
    /// `ok` or `error`.
    pub outcome: &'static str,
}

/// The label set of rescans.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RescanLabels {
    /// `start`, `periodic`, `root_removed`, `mounts_changed` or `event_loss`.
    pub reason: &'static str,
}

/// The label set of walk errors.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WalkErrorLabels {
    /// `unreadable`, `too_long` or `root_not_directory`.
    pub kind: &'static str,
}

/// The label set of liveness losses.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LivenessLabels {
    /// How the loss was learned: `pidfd`, `kernel_release` or `connect_probe`.
    pub learned_by: &'static str,
}

/// The label set of policy refusals.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    /// The refusing rule's `id` (or `#N`, its place in the list): operators name their rules,
    /// so the set is as small as their policy.
    pub rule: String,
}

/// The label set of deregistration latency.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeregistrationLabels {
    /// `success`, `superseded`, `handler_error` or `not_registered`.
    pub outcome: &'static str,
}

/// An OpenMetrics exemplar of a latency observation: the trace (and span) of the operation it
/// measured, so a dashboard goes from a latency bucket to that trace. 63 characters of labels,
/// within OpenMetrics' 128.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TraceExemplar {
    /// 32 lowercase hex digits (W3C trace context).
    pub trace_id: HexId<32>,
    /// 16 lowercase hex digits.
    pub span_id: HexId<16>,
}

impl TraceExemplar {
    /// The exemplar of the span `cx`, if it is valid (traces on).
    pub fn of(cx: &opentelemetry::trace::SpanContext) -> Option<TraceExemplar> {
        cx.is_valid().then(|| TraceExemplar {
            trace_id: HexId::of(&cx.trace_id().to_bytes()),
            span_id: HexId::of(&cx.span_id().to_bytes()),
        })
    }
}

/// An ID as its `N` lowercase hex digits, what the IDs' `Display` writes, held inline: an
/// exemplar costs no allocation and no formatting machinery (which cost a traced burst a tenth
/// of its tracing).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub struct HexId<const N: usize>([u8; N]);

impl<const N: usize> HexId<N> {
    /// The digits of `bytes` (`N / 2` of them; more are left out, fewer leave zeroes).
    pub fn of(bytes: &[u8]) -> Self {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [b'0'; N];
        for (pair, b) in hex.chunks_exact_mut(2).zip(bytes) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0x0f)];
        }
        HexId(hex)
    }

    /// The digits.
    pub fn as_str(&self) -> &str {
        // Only ASCII digits are ever written.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl<const N: usize> prometheus_client::encoding::EncodeLabelValue for HexId<N> {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

type ExemplarHistogram = HistogramWithExemplars<TraceExemplar>;
type HistogramFamily<L> = Family<L, ExemplarHistogram, fn() -> ExemplarHistogram>;

fn latency_histogram() -> ExemplarHistogram {
    // 500 µs .. ~75 s: event-driven registrations take milliseconds, a retried one up to minutes.
    HistogramWithExemplars::new(exponential_buckets(0.0005, 2.5, 14))
}

fn handler_histogram() -> ExemplarHistogram {
    // 100 µs .. ~26 s: in-process handlers answer in microseconds, remote ones in milliseconds.
    HistogramWithExemplars::new(exponential_buckets(0.0001, 4.0, 10))
}

/// Observes `value` into `histogram`, with `exemplar` (and the time, so the dashboard places it
/// where it happened rather than at the scrape) when there is one.
fn observe(histogram: &ExemplarHistogram, value: Duration, exemplar: Option<TraceExemplar>) {
    let at = exemplar.as_ref().map(|_| std::time::SystemTime::now());
    histogram.observe(value.as_secs_f64(), exemplar, at);
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
    deregistration_duration: HistogramFamily<DeregistrationLabels>,
    retries: Counter,
    backoff_delay: Histogram,
    handler_calls: HistogramFamily<HandlerCallLabels>,
    rescans: Family<RescanLabels, Counter>,
    walk_errors: Family<WalkErrorLabels, Counter>,
    liveness_losses: Family<LivenessLabels, Counter>,
    unserved_deregistration: HistogramFamily<LivenessLabels>,
    policy_rejections: Family<PolicyLabels, Counter>,
    first_contact: ExemplarHistogram,
    plugin_calls: HistogramFamily<PluginCallLabels>,
    metrics_renders: Counter,
    /// The series every registration observes, by label set (see [`Handles`]).
    hot: Arc<HotSeries>,
}

/// Handles on the series of the families each registration and deregistration observes.
#[derive(Debug, Default)]
struct HotSeries {
    operations: Handles<OperationLabels, Counter>,
    registration_duration: Handles<LatencyLabels, ExemplarHistogram>,
    deregistration_duration: Handles<DeregistrationLabels, ExemplarHistogram>,
    handler_calls: Handles<HandlerCallLabels, ExemplarHistogram>,
    plugin_calls: Handles<PluginCallLabels, ExemplarHistogram>,
}

/// A family's series by label set, in a map hashed with foldhash: the family's own map hashes
/// its label sets with SipHash, which cost more than the observation itself (~2,000
/// instructions of every registration's 8 observations). A series is still made in the family
/// by its first observation, so what is exposed does not change; this keeps a handle on it (a
/// handle shares the series: families never drop one here).
#[derive(Debug)]
struct Handles<L, M>(RwLock<HashMap<L, M, foldhash::fast::RandomState>>);

impl<L, M> Default for Handles<L, M> {
    fn default() -> Self {
        Handles(RwLock::new(HashMap::default()))
    }
}

impl<L: Clone + Hash + Eq, M: Clone> Handles<L, M> {
    /// The series of `family` labelled `labels`, made there if it is not yet.
    fn of<C: MetricConstructor<M>>(&self, family: &Family<L, M, C>, labels: &L) -> M {
        let known = self.0.read().unwrap_or_else(|p| p.into_inner());
        if let Some(series) = known.get(labels) {
            return series.clone();
        }
        drop(known);
        let series = family.get_or_create(labels).clone();
        self.0
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(labels.clone(), series.clone());
        series
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            operations: Family::default(),
            registration_duration: Family::new_with_constructor(latency_histogram),
            deregistration_duration: Family::new_with_constructor(latency_histogram),
            retries: Counter::default(),
            metrics_renders: Counter::default(),
            backoff_delay: backoff_histogram(),
            handler_calls: Family::new_with_constructor(handler_histogram),
            rescans: Family::default(),
            walk_errors: Family::default(),
            liveness_losses: Family::default(),
            policy_rejections: Family::default(),
            unserved_deregistration: Family::new_with_constructor(latency_histogram),
            first_contact: latency_histogram(),
            plugin_calls: Family::new_with_constructor(handler_histogram),
            hot: Arc::default(),
        }
    }
}

impl Metrics {
    /// An operation ended with `outcome` (`success` or a reason class).
    pub fn operation(&self, kind: &'static str, outcome: &'static str) {
        let labels = OperationLabels { kind, outcome };
        self.hot.operations.of(&self.operations, &labels).inc();
    }

    /// A registration attempt ended; `latency` runs from the socket's discovery (its kernel event
    /// when timestamped) to the end of the attempt. `exemplar`: the attempt's trace, when it is
    /// exported.
    pub fn registration(
        &self,
        source: &'static str,
        success: bool,
        latency: Duration,
        exemplar: Option<TraceExemplar>,
    ) {
        let outcome = if success { "success" } else { "failure" };
        let labels = LatencyLabels { source, outcome };
        let series = self
            .hot
            .registration_duration
            .of(&self.registration_duration, &labels);
        observe(&series, latency, exemplar);
    }

    /// A deregistration ended with `outcome` after `took`; `exemplar` as for registrations.
    pub fn deregistration(
        &self,
        outcome: &'static str,
        took: Duration,
        exemplar: Option<TraceExemplar>,
    ) {
        let labels = DeregistrationLabels { outcome };
        let series = self
            .hot
            .deregistration_duration
            .of(&self.deregistration_duration, &labels);
        observe(&series, took, exemplar);
    }

    /// A registration attempt started for a socket that failed before.
    pub fn retry(&self) {
        self.retries.inc();
    }

    /// The count of `/metrics` renderings, for the metrics server to increment (scrapes share
    /// them, see `telemetry::http`).
    pub fn renders(&self) -> Counter {
        self.metrics_renders.clone()
    }

    /// A failed registration backs off for `delay`.
    pub fn backoff(&self, delay: Duration) {
        self.backoff_delay.observe(delay.as_secs_f64());
    }

    /// A handler call for `plugin_type` took `took` and ended with `outcome`; `exemplar`: the
    /// call's span, when its trace is exported.
    pub fn handler_call(
        &self,
        plugin_type: &str,
        call: &'static str,
        outcome: &'static str,
        took: Duration,
        exemplar: Option<TraceExemplar>,
    ) {
        let labels = HandlerCallLabels {
            r#type: plugin_type.to_string(),
            call,
            outcome,
        };
        let series = self.hot.handler_calls.of(&self.handler_calls, &labels);
        observe(&series, took, exemplar);
    }

    /// The watcher walked the whole tree; counted by the reason's class (never its text).
    pub fn rescan(&self, reason: &RescanReason) {
        self.rescans
            .get_or_create(&RescanLabels {
                reason: reason.class(),
            })
            .inc();
    }

    /// A walk could not read something (`kind`: `unreadable`, `too_long`,
    /// `root_not_directory`); what was known there was kept.
    pub fn walk_error(&self, kind: &'static str) {
        self.walk_errors
            .get_or_create(&WalkErrorLabels { kind })
            .inc();
    }

    /// A plugin was found unserved (its server exited, or its socket refused connections).
    pub fn liveness_loss(&self, learned_by: &'static str) {
        self.liveness_losses
            .get_or_create(&LivenessLabels { learned_by })
            .inc();
    }

    /// The policy refused a plugin (at registration, or a registered one on reload).
    pub fn policy_rejection(&self, rule: &str) {
        self.policy_rejections
            .get_or_create(&PolicyLabels {
                rule: rule.to_string(),
            })
            .inc();
    }

    /// An unserved plugin's DeRegister finished `took` after the agent learned its server was
    /// gone.
    pub fn unserved_deregistered(
        &self,
        learned_by: &'static str,
        took: Duration,
        exemplar: Option<TraceExemplar>,
    ) {
        observe(
            &self
                .unserved_deregistration
                .get_or_create(&LivenessLabels { learned_by }),
            took,
            exemplar,
        );
    }

    /// A step of a call to a plugin (`call`: `dial`, `get_info`, `notify`) took `took` and
    /// ended with `outcome` (`ok`, `error`); `exemplar`: the step's span, when its trace is
    /// exported.
    pub fn plugin_call(
        &self,
        call: &'static str,
        outcome: &'static str,
        took: Duration,
        exemplar: Option<TraceExemplar>,
    ) {
        let labels = PluginCallLabels { call, outcome };
        let series = self.hot.plugin_calls.of(&self.plugin_calls, &labels);
        observe(&series, took, exemplar);
    }

    /// A plugin socket was first contacted by another process `after` its creation (eBPF);
    /// `exemplar`: its `first_contact` span, when traces are exported.
    pub fn first_contact(&self, after: Duration, exemplar: Option<TraceExemplar>) {
        observe(&self.first_contact, after, exemplar);
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
            "deregistration_duration_seconds",
            "Time from the start of a deregistration (its socket's removal noticed) to its end, by outcome",
            self.deregistration_duration.clone(),
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
            "plugin_call_duration_seconds",
            "Steps of the calls to plugins: dial (connect, waiting for a bound socket to listen), GetInfo and NotifyRegistrationStatus, by call and outcome",
            self.plugin_calls.clone(),
        );
        agent.register(
            "liveness_losses",
            "Plugins found unserved (their server exited, or their socket refused connections), by how it was learned",
            self.liveness_losses.clone(),
        );
        agent.register(
            "policy_rejections",
            "Plugins the policy refused (not registered, or deregistered on a reload), by rule",
            self.policy_rejections.clone(),
        );
        agent.register(
            "unserved_deregistration_seconds",
            "Time from learning a plugin's server was gone to the end of its handler's DeRegister, by how it was learned",
            self.unserved_deregistration.clone(),
        );
        agent.register(
            "first_contact_seconds",
            "Time from a plugin socket's creation (its kernel event) to the first connect by another process than the agent (kubelet's first GetInfo, beside it); eBPF only",
            self.first_contact.clone(),
        );
        agent.register(
            "rescans",
            "Full walks of the plugin directory, by reason class",
            self.rescans.clone(),
        );
        agent.register(
            "metrics_renders",
            "Renderings of /metrics (scrapes that arrive while one is made share the next)",
            self.metrics_renders.clone(),
        );
        agent.register(
            "walk_errors",
            "Directories and paths a walk could not read (what was known there is kept), by kind",
            self.walk_errors.clone(),
        );
        registry
    }
}

/// Renders `registry` as OpenMetrics text, exemplars included.
pub fn render(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry)?;
    Ok(text)
}

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of [`render_prometheus`]'s output.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders `registry` in the Prometheus text format (0.0.4), for scrapers that do not ask for
/// OpenMetrics: no exemplars, no `# EOF`, and the metadata named as that format names it.
pub fn render_prometheus(registry: &Registry) -> Result<String, std::fmt::Error> {
    Ok(super::exposition::to_prometheus_text(&render(registry)?))
}

/// Every metric name the agent exports (as Prometheus stores them), for dashboards and rules
/// checks.
pub const EXPORTED: &[&str] = &[
    "plugin_manager_total_plugins",
    "plugin_agent_plugin_problems",
    "plugin_agent_operations_total",
    "plugin_agent_registration_duration_seconds_bucket",
    "plugin_agent_registration_duration_seconds_sum",
    "plugin_agent_registration_duration_seconds_count",
    "plugin_agent_deregistration_duration_seconds_bucket",
    "plugin_agent_deregistration_duration_seconds_sum",
    "plugin_agent_deregistration_duration_seconds_count",
    "plugin_agent_registration_retries_total",
    "plugin_agent_backoff_delay_seconds_bucket",
    "plugin_agent_backoff_delay_seconds_sum",
    "plugin_agent_backoff_delay_seconds_count",
    "plugin_agent_handler_call_duration_seconds_bucket",
    "plugin_agent_handler_call_duration_seconds_sum",
    "plugin_agent_handler_call_duration_seconds_count",
    "plugin_agent_plugin_call_duration_seconds_bucket",
    "plugin_agent_plugin_call_duration_seconds_sum",
    "plugin_agent_plugin_call_duration_seconds_count",
    "plugin_agent_liveness_losses_total",
    "plugin_agent_policy_rejections_total",
    "plugin_agent_unserved_deregistration_seconds_bucket",
    "plugin_agent_unserved_deregistration_seconds_sum",
    "plugin_agent_unserved_deregistration_seconds_count",
    "plugin_agent_first_contact_seconds_bucket",
    "plugin_agent_first_contact_seconds_sum",
    "plugin_agent_first_contact_seconds_count",
    "plugin_agent_rescans_total",
    "plugin_agent_walk_errors_total",
    "plugin_agent_plugins",
    "plugin_agent_handler_up",
    "plugin_agent_event_source_events_total",
    "plugin_agent_event_source_dropped_events_total",
    "plugin_agent_event_source_ring_buffer_size_bytes",
    "plugin_agent_event_source_ring_buffer_used_bytes",
    "plugin_agent_event_source_pins_restored_total",
    "plugin_agent_event_source_name_table_incomplete",
    "plugin_agent_watched_directories",
    "plugin_agent_event_source_info",
    "plugin_agent_kernel_features",
    "plugin_agent_build_info",
    "plugin_agent_metrics_renders_total",
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
    use crate::event_source::EventSource;
    use crate::event_source::{SourceStats, WatchedDir};
    use crate::handler::HandlerRegistry;
    use crate::state::actual::ActualState;
    use crate::state::backoff::BackoffTable;
    use crate::state::desired::DesiredState;
    use crate::state::view::StateView;
    use crate::telemetry::WatcherStats;
    use std::collections::BTreeSet;
    use std::sync::Arc;

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
                pins_restored: Some(1),
                name_table_incomplete: Some(true),
            }
        }
    }

    fn rendered() -> String {
        let telemetry = crate::telemetry::Telemetry::new(SourceKind::Ebpf);
        let actual = Arc::new(ActualState::default());
        let handlers = Arc::new(HandlerRegistry::default());
        handlers.insert("CSIPlugin", Arc::new(crate::handler::accept_all::AcceptAll));
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
        m.registration(
            "ebpf",
            true,
            Duration::from_millis(3),
            Some(TraceExemplar {
                trace_id: HexId::of(&0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736_u128.to_be_bytes()),
                span_id: HexId::of(&0x00f0_67aa_0ba9_02b7_u64.to_be_bytes()),
            }),
        );
        m.deregistration("success", Duration::from_millis(2), None);
        m.retry();
        m.backoff(Duration::from_millis(500));
        m.handler_call(
            "CSIPlugin",
            "validate",
            "ok",
            Duration::from_micros(40),
            None,
        );
        m.rescan(&RescanReason::Start);
        m.walk_error("unreadable");
        m.liveness_loss("pidfd");
        m.policy_rejection("csi-drivers");
        m.unserved_deregistered("pidfd", Duration::from_millis(3), None);
        m.first_contact(Duration::from_millis(900), None);
        m.plugin_call("get_info", "ok", Duration::from_micros(300), None);
        let registry = m.registry(StateCollector {
            state: StateView {
                desired,
                actual,
                backoff: Arc::new(BackoffTable::default()),
                circumstances: Arc::default(),
            },
            handlers,
            watcher: Arc::new(WatcherStats::default()),
            source: Arc::new(RingSource),
            kernel: Arc::new(crate::kernel::probe(crate::kernel::FentryFinding::NotTried)),
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
    fn latency_buckets_carry_the_trace_of_an_exported_operation_as_an_exemplar() {
        let text = rendered();
        let bucket = text
            .lines()
            .find(|l| {
                l.starts_with("plugin_agent_registration_duration_seconds_bucket")
                    && l.contains(" # {")
            })
            .unwrap_or_else(|| panic!("no exemplar in:\n{text}"));
        assert!(
            bucket.contains(
                "# {trace_id=\"4bf92f3577b34da6a3ce929d0e0e4736\",span_id=\"00f067aa0ba902b7\"} 0.003"
            ),
            "{bucket}"
        );
        assert_eq!(
            text.matches(" # {").count(),
            1,
            "only the observation with a trace has one"
        );
    }

    #[test]
    fn an_exemplar_names_its_span_as_w3c_trace_context_does() {
        use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
        for (trace, span) in [
            (
                0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736_u128,
                0x00f0_67aa_0ba9_02b7_u64,
            ),
            (1, u64::MAX),
            (u128::MAX, 0x10),
        ] {
            let cx = SpanContext::new(
                TraceId::from(trace),
                SpanId::from(span),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            );
            let exemplar = TraceExemplar::of(&cx).expect("valid");
            assert_eq!(exemplar.trace_id.as_str(), cx.trace_id().to_string());
            assert_eq!(exemplar.span_id.as_str(), cx.span_id().to_string());
        }
        assert_eq!(TraceExemplar::of(&SpanContext::empty_context()), None);
    }

    #[test]
    fn rescan_reasons_are_reduced_to_classes() {
        let m = Metrics::default();
        m.rescan(&RescanReason::EventLoss(
            "fanotify queue overflow: 12 events lost".into(),
        ));
        m.rescan(&RescanReason::Periodic);
        let text = render(&m.registry_without_state()).expect("renders");
        assert!(text.contains("plugin_agent_rescans_total{reason=\"event_loss\"} 1"));
        assert!(text.contains("plugin_agent_rescans_total{reason=\"periodic\"} 1"));
        assert!(!text.contains("overflow"));
    }
}
