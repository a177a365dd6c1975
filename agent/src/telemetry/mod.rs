//! Telemetry: what the data flow tells operators, read off it at each stage.
//!
//! ```text
//! event source ─> watcher ──────────────> executor ───────────────> handler / plugin
//!     │   (hints, drops)  │ discovery            │ register / deregister spans,
//!     │                   v                      v operation outcomes, handler latency
//!     └──> metrics  <─ discovery (trace roots) ─> metrics ──> /metrics (Prometheus text)
//!                                                  spans  ──> OTLP/gRPC collector (batched)
//! desired / actual state, handlers, source counters ─(read at scrape time)─> /metrics
//! agent readiness ─> /healthz, /readyz
//! ```
//!
//! - [`discovery`]: how and when each socket was found; the root span of its operations and the
//!   `source` label of its registration latency.
//! - [`metrics`]: the metrics recorded as things happen, and those read from state at scrape time
//!   (kubelet's `plugin_manager_total_plugins` among them).
//! - [`http`]: the loopback HTTP server for `/metrics`, `/healthz` and `/readyz`.
//! - [`otlp`]: the OpenTelemetry pipeline that exports spans over OTLP/gRPC, off by default.
//! - [`logging`]: the `tracing` subscriber: human or JSON logs, plus the OTLP layer when enabled.
//!
//! Nothing here can slow registration: metric updates are atomic adds, spans are queued to a
//! bounded batch exporter that drops when its collector is away, and state gauges are computed by
//! the scraper's request, not by the data flow.

pub mod discovery;
pub mod exposition;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod otlp;
pub mod sampling;
pub mod traces;
mod watcher_stats;

use crate::event_source::{RescanReason, SourceKind};
use crate::provenance::Contact;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

pub use watcher_stats::WatcherStats;

/// The telemetry the watcher and the executor write to; one per agent, shared.
#[derive(Debug)]
pub struct Telemetry {
    /// Metrics recorded as things happen.
    pub metrics: metrics::Metrics,
    /// Discovery records: trace roots and latency labels per socket path.
    pub discovery: discovery::Discoveries,
    /// The watcher's counters, read by status and metrics.
    pub watcher: Arc<WatcherStats>,
}

impl Telemetry {
    /// Telemetry for an agent fed by `source`. Spans are made when the OTLP pipeline is
    /// installed ([`otlp::enabled`]); metrics always.
    pub fn new(source: SourceKind) -> Arc<Telemetry> {
        Arc::new(Telemetry {
            metrics: metrics::Metrics::default(),
            discovery: discovery::Discoveries::new(source, otlp::enabled()),
            watcher: Arc::default(),
        })
    }

    /// The socket at `path` was first contacted by another process (see
    /// `provenance::Contact`), `after_creation` the socket's creation when an event timed it: its
    /// span in the socket's trace, and that time.
    pub fn first_contact(&self, path: &Path, contact: &Contact, after_creation: Option<Duration>) {
        let exemplar = self.discovery.first_contact(path, contact, after_creation);
        if let Some(after) = after_creation {
            self.metrics.first_contact(after, exemplar);
        }
    }

    /// The watcher walked the whole tree for `reason`: counted in status (all rescans, and those
    /// caused by loss) and in metrics by reason class.
    pub fn rescan(&self, reason: &RescanReason) {
        self.watcher.rescans.fetch_add(1, Ordering::Relaxed);
        if reason.is_loss() {
            self.watcher.loss_rescans.fetch_add(1, Ordering::Relaxed);
        }
        self.metrics.rescan(reason);
    }
}
