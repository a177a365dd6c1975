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
//!       bounded queue (OTEL_BSP_MAX_QUEUE_SIZE, default 2048; full: span dropped)
//!                                                                         v
//!       batch task on the agent's tokio runtime ─> OTLP/gRPC ─> collector
//! ```
//!
//! On when `--otlp-endpoint` is given, or when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
//! turn it off again. The other standard variables are honoured by the OpenTelemetry crates:
//! `OTEL_EXPORTER_OTLP_{TRACES_,}{TIMEOUT,HEADERS,COMPRESSION}`, `OTEL_BSP_*`,
//! `OTEL_TRACES_SAMPLER{,_ARG}` (the head sampler; failed and slow operations are exported
//! whatever it says, see [`super::sampling`]), `OTEL_SERVICE_NAME` (default `plugin-agent`) and
//! `OTEL_RESOURCE_ATTRIBUTES`.
//!
//! A collector that is down never slows registration: ending a span only puts it in the queue,
//! the export runs in its own task with the exporter's timeout, and a full queue drops spans.
//! The batch processor runs on the agent's tokio runtime (the SDK's thread-based one cannot drive
//! tonic's connections), so [`install`] must be called inside that runtime.

use anyhow::Context as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{BatchConfigBuilder, SdkTracerProvider};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Set once the pipeline is installed: whether spans are worth making. Process-wide, as the
/// tracer provider is.
static ENABLED: AtomicBool = AtomicBool::new(false);

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
    /// Flushes queued spans (for at most a few seconds, and never past the SIGTERM deadline) and
    /// stops the exporter.
    pub fn shutdown(self) {
        // Within the SIGTERM deadline: what is left of it, less room for the runtime and the exit.
        // On its own thread: an exporter stuck in an export (a collector that accepts and never
        // answers) does not honour the timeout (it waited out its 10 s export deadline), so the
        // agent stops waiting at the budget and exits; the thread ends with the process.
        let budget = SHUTDOWN_FLUSH
            .min(crate::shutdown::remaining().saturating_sub(Duration::from_millis(750)));
        let provider = self.provider;
        let (done, flushed) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("otlp-flush".into())
            .spawn(move || {
                let _ = done.send(provider.shutdown_with_timeout(budget));
            });
        if spawned.is_err() {
            return;
        }
        match flushed.recv_timeout(budget + Duration::from_millis(20)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "trace exporter shutdown"),
            Err(_) => tracing::debug!(?budget, "trace flush cut at the shutdown deadline"),
        }
    }
}

/// Builds the exporter and batch processor, and makes the provider the global one (the discovery
/// spans use it). `endpoint` overrides the environment's. Must run inside the tokio runtime.
pub fn install(endpoint: Option<&str>) -> anyhow::Result<Traces> {
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic();
    if let Some(endpoint) = endpoint {
        exporter = exporter.with_endpoint(endpoint);
    }
    let exporter = exporter
        .build()
        .context("cannot set up the OTLP trace exporter")?;
    let processor =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .with_batch_config(BatchConfigBuilder::default().build())
        .build();
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("plugin-agent");
    }
    // Every span is recorded; the head sampler and the tail rule decide what is exported.
    let provider = SdkTracerProvider::builder()
        .with_sampler(super::sampling::RecordEverything::from_env())
        .with_id_generator(super::sampling::PresetIds::default())
        .with_span_processor(super::sampling::TailProcessor::new(processor))
        .with_resource(resource.build())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Traces { provider })
}
