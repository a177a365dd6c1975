//! What an operation reports when it ends: the outcome counter, the registration latency since
//! discovery, and the outcome on the operation's span. Telemetry is a sink: nothing here decides
//! anything.

use super::OperationExecutor;
use super::operation::RegisterFailure;
use crate::event_source::monotonic_now_ns;
use crate::handler::Plugin;
use crate::state::desired::DesiredPlugin;
use std::time::Duration;

impl OperationExecutor {
    /// Records a finished registration attempt: operation outcome, latency since the socket's
    /// discovery (its kernel event when timestamped), and the outcome on the `register` span.
    pub(super) fn observe_register(
        &self,
        source: &'static str,
        desired: &DesiredPlugin,
        result: &Result<Plugin, RegisterFailure>,
    ) {
        let outcome = result
            .as_ref()
            .map_or_else(RegisterFailure::outcome, |_| "success");
        let metrics = &self.telemetry.metrics;
        metrics.operation("register", outcome);
        let span = tracing::Span::current();
        span.record("outcome", outcome);
        if let Err(error) = result {
            span.record("error", error.to_string());
            span.record("otel.status_code", "error");
        }
        // A socket that vanished mid-attempt is not a registration that failed: no latency.
        if outcome != "socket_gone" {
            let latency = desired
                .kernel_ns
                .map(|ns| Duration::from_nanos(monotonic_now_ns().saturating_sub(ns)))
                .or_else(|| desired.seen_at.elapsed().ok())
                .unwrap_or_default();
            metrics.registration(source, result.is_ok(), latency);
        }
    }

    /// Records a finished deregistration on the metrics and the `deregister` span.
    pub(super) fn observe_deregister(&self, outcome: &'static str, error: Option<&str>) {
        self.telemetry.metrics.operation("deregister", outcome);
        let span = tracing::Span::current();
        span.record("outcome", outcome);
        if let Some(error) = error {
            span.record("error", error);
            span.record("otel.status_code", "error");
        }
    }
}
