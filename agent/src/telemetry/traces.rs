//! Installing the trace pipeline: the OTLP exporter ([`super::otlp`]) behind the head sampler and
//! the tail rule ([`super::sampling`]), as the process's tracer provider, and flushing it at
//! shutdown. It sits beside both so that the sampling, which exports through `otlp`, and the
//! exporter, which knows nothing of sampling, do not import each other.

use super::otlp;
use super::sampling;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::time::Duration;

/// How long shutdown waits to flush the last spans, so a dead collector cannot hold up exit.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(3);

/// The installed pipeline; [`Traces::shutdown`] flushes what is queued.
#[derive(Debug)]
pub struct Traces {
    provider: SdkTracerProvider,
}

impl Traces {
    /// Sends the queued spans (for at most a few seconds, and never past the SIGTERM deadline)
    /// and stops the exporter: a collector that accepts and never answers does not hold up exit.
    pub fn shutdown(self) {
        // Within the SIGTERM deadline: what is left of it, less room for the runtime and the exit.
        let budget = SHUTDOWN_FLUSH
            .min(crate::shutdown::remaining().saturating_sub(Duration::from_millis(750)));
        if let Err(e) = self.provider.shutdown_with_timeout(budget) {
            tracing::debug!(error = %e, ?budget, "trace flush at shutdown");
        }
    }
}

/// Builds the exporter and batch processor, and makes the provider the global one (the discovery
/// spans use it). `endpoint` overrides the environment's. Must run inside the tokio runtime.
pub fn install(endpoint: Option<&str>) -> anyhow::Result<Traces> {
    let processor = otlp::start(endpoint)?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("plugin-agent");
    }
    // Every span is recorded; the head sampler and the tail rule decide what is exported.
    let provider = SdkTracerProvider::builder()
        .with_sampler(sampling::RecordEverything::from_env())
        .with_span_processor(sampling::TailProcessor::new(processor))
        .with_resource(resource.build())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    otlp::mark_enabled();
    Ok(Traces { provider })
}
