//! The OpenTelemetry pipeline: spans from the executor and the watcher, batched and exported over
//! OTLP/gRPC to a collector. Off unless asked for.
//!
//! ```text
//! discovery spans (telemetry::discovery) ─────────────────────────────────┐
//! operations' spans (register, dial, GetInfo, ..., built when it ends) ───┤
//!                                                                         v
//!       head sampler + tail rule (telemetry::sampling): which traces go on
//!       (spans are built only for traces that will be exported)
//!                                                                         v
//!       encoded into its batch's bytes as it ends (encode.rs), in a bounded queue
//!       (OTEL_BSP_MAX_QUEUE_SIZE, default 2048 spans; full: span dropped)
//!                                                                         v
//!       export task on the agent's tokio runtime (batch.rs) ─> OTLP/gRPC ─> collector
//! ```
//!
//! On when `--otlp-endpoint` is given, or when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
//! turn it off again. The other standard variables: `OTEL_EXPORTER_OTLP_{TRACES_,}{TIMEOUT,
//! HEADERS,COMPRESSION,INSECURE}` and `OTEL_BSP_*` ([`config`]), `OTEL_TRACES_SAMPLER{,_ARG}`
//! (the head sampler; failed and slow operations are exported whatever it says, see
//! [`super::sampling`]), `OTEL_SERVICE_NAME` (default `plugin-agent`) and
//! `OTEL_RESOURCE_ATTRIBUTES` (read by the OpenTelemetry SDK).
//!
//! The SDK builds the spans (its tracer, sampler and span processor interface); the export is
//! the agent's own (`encode.rs`, `batch.rs`): the OTLP exporter crate's conversion of every span
//! into protobuf structs cost a traced burst more than the rest of tracing together.
//!
//! A collector that is down never slows registration: ending a span only appends it to the
//! queue, the export runs in its own task with the exporter's timeout, and a full queue drops
//! spans. [`install`] must be called inside the agent's tokio runtime, where the task runs.

mod batch;
mod config;
mod encode;

use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub use encode::SpanRecord;

/// The installed exporter's queue, for the spans the agent encodes itself.
static SENDER: OnceLock<batch::Sender> = OnceLock::new();

/// Exports `span` (a trace the head sampler or the tail rule decided to export), when the
/// pipeline is installed.
pub fn export(span: &SpanRecord<'_>) {
    if let Some(sender) = SENDER.get() {
        sender.send(span);
    }
}

/// Exports the SDK's `span`, built and held before its trace was kept, as sampled.
pub fn export_sdk_span(span: opentelemetry_sdk::trace::SpanData) {
    if let Some(sender) = SENDER.get() {
        sender.send_sdk(&span);
    }
}

/// Set once the pipeline is installed: whether spans are worth making. Process-wide, as the
/// tracer provider is.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The instrumentation scope of every span the agent makes (its tracer's name).
pub const SCOPE: &str = "plugin-agent";

/// The agent's tracer, from the installed provider.
pub fn tracer() -> opentelemetry::global::BoxedTracer {
    opentelemetry::global::tracer(SCOPE)
}

/// How long shutdown waits to flush the last spans, so a dead collector cannot hold up exit.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(3);

/// Whether traces are exported (see the module docs).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Whether the operator asked for traces: `endpoint` from `--otlp-endpoint`, else the standard
/// environment variables.
pub fn wanted(endpoint: Option<&str>) -> bool {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
    {
        return false;
    }
    endpoint.is_some()
        || env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
        || env("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
}

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
    let processor = batch::BatchProcessor::new(config::from_env(endpoint)?)?;
    // Installed once per process (the agent's `run`); the tracer provider is as global.
    let _ = SENDER.set(processor.sender());
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("plugin-agent");
    }
    // Every span is recorded; the head sampler and the tail rule decide what is exported.
    let provider = SdkTracerProvider::builder()
        .with_sampler(super::sampling::RecordEverything::from_env())
        .with_span_processor(super::sampling::TailProcessor::new(processor))
        .with_resource(resource.build())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Traces { provider })
}
