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
//! spans. [`super::traces::install`] must be called inside the agent's tokio runtime, where the
//! task runs.

mod batch;
mod config;
mod encode;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

pub use batch::BatchProcessor;
pub use encode::{SCOPE, SpanRecord};

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

/// The agent's tracer, from the installed provider.
pub fn tracer() -> opentelemetry::global::BoxedTracer {
    opentelemetry::global::tracer(SCOPE)
}

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

/// Builds the exporter and its batch processor from the environment (`endpoint` overrides it),
/// and makes its queue the one [`export`] sends to. Must run inside the tokio runtime.
pub fn start(endpoint: Option<&str>) -> anyhow::Result<BatchProcessor> {
    let processor = BatchProcessor::new(config::from_env(endpoint)?)?;
    // Installed once per process (the agent's `run`); the tracer provider is as global.
    let _ = SENDER.set(processor.sender());
    Ok(processor)
}

/// Marks the pipeline installed: from now on spans are worth making ([`enabled`]).
pub fn mark_enabled() {
    ENABLED.store(true, Ordering::Relaxed);
}
