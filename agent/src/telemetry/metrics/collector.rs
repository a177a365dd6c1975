//! The metrics read from the agent's state when scraped (plugins by state, handlers, the event
//! source's counters, kernel features, build): computed per scrape, so the data flow never pays
//! for them, and derived as the admin API derives them.

use crate::event_source::EventSource;
use crate::handler::HandlerRegistry;
use crate::state::verdict::Reason;
use crate::state::view::{PluginState, PluginStatus, StateView};
use crate::telemetry::WatcherStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Metrics computed from the agent's state when scraped, so the data flow never pays for them.
pub struct StateCollector {
    /// Desired state (kubelet's `desired_state_of_world`), actual state (`actual_state_of_world`)
    /// and the backoff table: each plugin's state comes from [`StateView`], as in the admin API.
    pub state: StateView,
    /// Handlers, for `handler_up`.
    pub handlers: Arc<HandlerRegistry>,
    /// Watcher counters (hints received, watched directories).
    pub watcher: Arc<WatcherStats>,
    /// The event source, for its own counters.
    pub source: Arc<dyn EventSource>,
    /// What the kernel gives, for `plugin_agent_kernel_features`.
    pub kernel: Arc<crate::kernel::KernelFeatures>,
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
        let plugins = self.state.all(tokio::time::Instant::now());
        self.encode_plugins(&mut encoder, &plugins)?;
        encode_problems(&mut encoder, &plugins)?;
        self.encode_handlers(&mut encoder)?;
        self.encode_source(&mut encoder)?;
        self.encode_kernel(&mut encoder)?;
        encode_build(&mut encoder)
    }
}

impl StateCollector {
    /// Kubelet's `plugin_manager_total_plugins`, and `plugin_agent_plugins` by type and state.
    fn encode_plugins(
        &self,
        encoder: &mut DescriptorEncoder,
        plugins: &[PluginStatus],
    ) -> Result<(), std::fmt::Error> {
        let series = |path: &std::path::Path, state: &str| {
            (
                vec![
                    ("socket_path", path_label(path)),
                    ("state", state.to_string()),
                ],
                ConstGauge::new(1),
            )
        };
        let kubelet: Vec<(Pairs, ConstGauge)> = plugins
            .iter()
            .filter(|p| p.desired.is_some())
            .map(|p| series(&p.path, "desired_state_of_world"))
            .chain(
                plugins
                    .iter()
                    .filter(|p| p.registered.is_some())
                    .map(|p| series(&p.path, "actual_state_of_world")),
            )
            .collect();
        family(
            encoder,
            "plugin_manager_total_plugins",
            "Number of plugins in Plugin Manager (kubelet-compatible: one series per socket and state)",
            MetricType::Gauge,
            kubelet,
        )?;
        family(
            encoder,
            "plugin_agent_plugins",
            "Plugin sockets by plugin type and state (registered, observed, deregistering, pending, backing_off, unserved).",
            MetricType::Gauge,
            self.plugins_by_state(plugins)
                .into_iter()
                .map(|((t, state), n)| {
                    (
                        vec![("type", t), ("state", state.to_string())],
                        ConstGauge::new(n),
                    )
                }),
        )
    }

    /// Plugins counted by (type, state). The type is known once registered or observed, and
    /// is then one of a bounded set ([`Self::type_label`]); before that it is `unknown`. Every handler's `registered`
    /// series and the `unknown` pending, backing-off, unserved and rejected series exist at zero, so dashboards see
    /// them before the first plugin.
    fn plugins_by_state(&self, plugins: &[PluginStatus]) -> BTreeMap<(String, &'static str), i64> {
        let mut by_state = BTreeMap::new();
        for (t, _) in self.handlers.list() {
            by_state.insert((t, PluginState::Registered.label()), 0);
        }
        by_state.insert(("unknown".into(), PluginState::Pending.label()), 0);
        by_state.insert(("unknown".into(), PluginState::BackingOff.label()), 0);
        by_state.insert(("unknown".into(), PluginState::Unserved.label()), 0);
        // A refused plugin's type is what it claimed, not a handler's: it stays `unknown`.
        by_state.insert(("unknown".into(), PluginState::Rejected.label()), 0);
        for plugin in plugins {
            let plugin_type = plugin.registered.as_ref().map_or_else(
                || "unknown".to_string(),
                |r| self.type_label(&r.plugin.plugin_type),
            );
            *by_state
                .entry((plugin_type, plugin.state.label()))
                .or_default() += 1;
        }
        by_state
    }

    /// A plugin type as a label value: a type a handler is configured for, or one kubelet
    /// knows, is itself; any other is `other`. An observed plugin's type is whatever it
    /// answered, and a thousand plugins answering a thousand types must not make a thousand
    /// series.
    fn type_label(&self, plugin_type: &str) -> String {
        if KUBELET_TYPES.contains(&plugin_type) || self.handlers.get(plugin_type).is_some() {
            plugin_type.to_string()
        } else {
            "other".to_string()
        }
    }

    /// `plugin_agent_handler_up`.
    fn encode_handlers(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        family(
            encoder,
            "plugin_agent_handler_up",
            "1 when the handler for a plugin type was reachable at its last contact.",
            MetricType::Gauge,
            self.handlers.list().into_iter().map(|(t, handler)| {
                let up = handler.health().map(|h| *h.borrow()).unwrap_or(true);
                (vec![("type", t)], ConstGauge::new(i64::from(up)))
            }),
        )
    }

    /// The event source's counters and identity, and the watched directories.
    fn encode_source(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let source = self.source.kind();
        let source_label = || vec![("source", source.as_str().to_string())];
        let stats = self.source.stats();
        family(
            encoder,
            "plugin_agent_event_source_events",
            "Hints the event source delivered to the watcher.",
            MetricType::Counter,
            [(
                source_label(),
                ConstCounter::new(self.watcher.hints.load(Ordering::Relaxed)),
            )],
        )?;
        family(
            encoder,
            "plugin_agent_event_source_dropped_events",
            "Events the kernel side of the event source could not deliver (each one leads to a rescan).",
            MetricType::Counter,
            [(source_label(), ConstCounter::new(stats.dropped))],
        )?;
        if let Some(size) = stats.ring_buffer_size_bytes {
            family(
                encoder,
                "plugin_agent_event_source_ring_buffer_size_bytes",
                "Size of the eBPF ring buffer.",
                MetricType::Gauge,
                [(source_label(), ConstGauge::new(clamp(size)))],
            )?;
        }
        if let Some(restored) = stats.pins_restored {
            family(
                encoder,
                "plugin_agent_event_source_pins_restored",
                "Times the source's pinned eBPF programs and maps were found removed or replaced (by another process) and pinned again.",
                MetricType::Counter,
                [(source_label(), ConstCounter::new(restored))],
            )?;
        }
        if let Some(incomplete) = stats.name_table_incomplete {
            family(
                encoder,
                "plugin_agent_event_source_name_table_incomplete",
                "1 when more sockets are in the tree than the eBPF name table keeps room for: the names of the rest are left out, and a removal by a path of several components is placed by its parent directory's name.",
                MetricType::Gauge,
                [(source_label(), ConstGauge::new(i64::from(incomplete)))],
            )?;
        }
        if let Some(used) = stats.ring_buffer_used_bytes {
            family(
                encoder,
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
        info.encode_info(&source_label())
    }
}

impl StateCollector {
    /// `plugin_agent_kernel_features`: one series per feature (a fixed set), its availability a
    /// label, so a dashboard counts the nodes whose kernels lack one.
    fn encode_kernel(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        family(
            encoder,
            "plugin_agent_kernel_features",
            "Kernel features the agent uses (btf, ring_buffer, fentry, pidfd, so_peerpidfd, pidfs) and whether this kernel has each (true, false, unknown); a missing one degrades that feature only.",
            MetricType::Gauge,
            self.kernel.features.iter().map(|f| {
                (
                    vec![
                        ("feature", f.name.to_string()),
                        ("available", f.availability.as_str().to_string()),
                    ],
                    ConstGauge::new(1),
                )
            }),
        )
    }
}

/// `plugin_agent_build_info`.
/// `plugin_agent_plugin_problems{reason}`: plugins by the reason of a problem (`explain`'s
/// verdict, `state::verdict`), every reason of the closed list at zero or more.
fn encode_problems(
    encoder: &mut DescriptorEncoder,
    plugins: &[PluginStatus],
) -> Result<(), std::fmt::Error> {
    let mut by_reason: BTreeMap<&'static str, i64> = Reason::ALL
        .iter()
        .filter(|r| r.is_problem())
        .map(|r| (r.label(), 0))
        .collect();
    for plugin in plugins.iter().filter(|p| p.reason.is_problem()) {
        *by_reason.entry(plugin.reason.label()).or_default() += 1;
    }
    family(
        encoder,
        "plugin_agent_plugin_problems",
        "Plugin sockets with a problem, by reason (the verdict of `plugin-agent explain`; a closed list).",
        MetricType::Gauge,
        by_reason
            .into_iter()
            .map(|(reason, n)| (vec![("reason", reason.to_string())], ConstGauge::new(n))),
    )
}

fn encode_build(encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let mut info = encoder.encode_descriptor(
        "plugin_agent_build",
        "The agent's version, and whether it was built with the eBPF source.",
        None,
        MetricType::Info,
    )?;
    info.encode_info(&vec![
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        ("ebpf", cfg!(ebpf_object).to_string()),
    ])
}

fn clamp(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The plugin types kubelet's plugin manager has handlers for.
const KUBELET_TYPES: [&str; 3] = ["CSIPlugin", "DevicePlugin", "DRAPlugin"];

/// A socket path as a label value, one to one: valid UTF-8 as it is (a backslash doubled), any
/// byte that is not as `\xNN`. (`to_string_lossy` made every invalid byte U+FFFD, so two
/// sockets whose names differ only there were one series twice: an exposition a strict scraper
/// rejects whole.)
fn path_label(path: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    if let Ok(text) = std::str::from_utf8(bytes)
        && !text.contains('\\')
    {
        return text.to_string();
    }
    let mut label = String::with_capacity(bytes.len() + 8);
    for chunk in bytes.utf8_chunks() {
        label.push_str(&chunk.valid().replace('\\', "\\\\"));
        for byte in chunk.invalid() {
            label.push_str(&format!("\\x{byte:02x}"));
        }
    }
    label
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn socket_path_labels_are_one_to_one() {
        use std::os::unix::ffi::OsStrExt;
        let label =
            |bytes: &[u8]| path_label(std::path::Path::new(std::ffi::OsStr::from_bytes(bytes)));
        let names: [&[u8]; 5] = [
            b"/r/a\xff",
            b"/r/a\xff.sock",
            b"/r/a\\xff.sock",
            b"/r/a\xfe.sock",
            b"/r/a.sock",
        ];
        let labels: BTreeSet<String> = names.iter().map(|n| label(n)).collect();
        assert_eq!(labels.len(), names.len(), "{labels:?}");
        assert_eq!(label(b"/r/a.sock"), "/r/a.sock");
        assert_eq!(label(b"/r/a\xff.sock"), "/r/a\\xff.sock");
    }
}
