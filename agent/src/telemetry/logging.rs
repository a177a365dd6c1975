//! The `tracing` subscriber: where log lines and spans go.
//!
//! ```text
//! tracing events and spans ─┬─> fmt layer (stderr; text or JSON; filter: --log-level, else RUST_LOG, else info)
//!                           └─> OpenTelemetry layer (when traces are on; filter: plugin_agent at info,
//!                               outside operations the head sampler did not sample)
//! ```
//!
//! The two layers filter separately, so `--log-level warn` quiets the log without emptying the
//! traces. While traces are on, every line logged inside a span carries that span's `trace_id`
//! and `span_id` ([`WithTraceIds`]): the join from a trace (or a metric exemplar) to its lines. Log lines about a plugin carry `socket_path` (and `plugin_name`, `plugin_type` once the
//! plugin has said who it is) from the executor's operation spans: JSON lines list them under
//! `span` and `spans`, text lines in the span prefix.
//!
//! Text lines escape every control character in field values and span fields ([`text_fields`]):
//! plugin names, types, endpoints, socket paths and error texts come from plugins and handlers,
//! and a raw newline would forge a log line, an escape sequence drive a terminal. JSON lines need
//! no such help (JSON escapes control characters) and stay exact.

use super::otlp::{self, Traces};
use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::{FilterExt as _, Targets};
use tracing_subscriber::prelude::*;
use tracing_subscriber::{EnvFilter, Layer};

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber. `level` is `--log-level` (RUST_LOG when `None`);
/// `otlp_endpoint` is `--otlp-endpoint`. With `traces_allowed` (the `run` command), traces are
/// exported when [`otlp::wanted`] says so; if their pipeline cannot be built the agent runs
/// without them and says why. Must run inside the tokio runtime when traces may be on. Returns
/// the trace pipeline and the log writer, to shut down (flush) at exit.
///
/// Log lines go to stderr through a non-blocking writer: a background thread writes them, and
/// when it falls behind (a slow journald or container log pipe) lines are dropped rather than
/// blocking the agent's threads, which would stall registrations until their deadlines expire.
pub fn init(
    format: Format,
    level: Option<&str>,
    otlp_endpoint: Option<&str>,
    traces_allowed: bool,
) -> Logging {
    let filter = match level {
        Some(level) => EnvFilter::new(level),
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
    };
    let (writer, log_flush) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_BUFFER_LINES)
        .finish(std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(writer);
    let fmt = match format {
        Format::Text => {
            let event_format = WithTraceIds {
                inner: tracing_subscriber::fmt::format(),
                json: false,
            };
            fmt.fmt_fields(text_fields())
                .event_format(event_format)
                .with_filter(filter)
                .boxed()
        }
        Format::Json => {
            let event_format = WithTraceIds {
                inner: tracing_subscriber::fmt::format()
                    .json()
                    .flatten_event(true)
                    .with_current_span(true),
                json: true,
            };
            fmt.json()
                .event_format(event_format)
                .with_filter(filter)
                .boxed()
        }
    };
    let (traces, failure) = if traces_allowed && otlp::wanted(otlp_endpoint) {
        match otlp::install(otlp_endpoint) {
            Ok(traces) => (Some(traces), None),
            Err(e) => (None, Some(format!("{e:#}"))),
        }
    } else {
        (None, None)
    };
    let otel = traces.as_ref().map(|traces| {
        tracing_opentelemetry::layer()
            .with_tracer(traces.tracer.clone())
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            // Busy and idle time per span: clock reads and bookkeeping on every poll of every
            // instrumented future, for two attributes nothing here reads (cargo xtask bench
            // burst: about half of what tracing cost the agent).
            .with_tracked_inactivity(false)
            .with_filter(otel_filter())
    });
    tracing_subscriber::registry().with(fmt).with(otel).init();
    match (&traces, failure) {
        (Some(_), _) => tracing::info!(
            endpoint = otlp_endpoint.unwrap_or("from OTEL_EXPORTER_OTLP_*"),
            "exporting traces over OTLP/gRPC"
        ),
        (None, Some(error)) => tracing::warn!(%error, "traces are off"),
        (None, None) => {}
    }
    Logging { traces, log_flush }
}

/// What the OpenTelemetry layer sees: the agent's spans at `info`, outside operations the head
/// sampler did not sample (their spans are built only if the tail rule keeps them, see
/// `sampling::Unsampled`). Asked for every span: a `filter_fn` is asked once per call site and
/// its answer cached, so the first operation to reach a call site would decide for all.
fn otel_filter<S>() -> impl tracing_subscriber::layer::Filter<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    Targets::new()
        .with_target("plugin_agent", LevelFilter::INFO)
        .and(tracing_subscriber::filter::dynamic_filter_fn(|_, _| {
            super::sampling::traced_here()
        }))
}

/// The text format's field formatter: the default's `name=value` layout (the message bare), with
/// every control character escaped (see the module docs).
pub fn text_fields()
-> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + Send + Sync + 'static {
    use tracing_subscriber::field::MakeExt;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = format!("{value:?}");
        let text = crate::text::escape(&text);
        if field.name() == "message" {
            write!(writer, "{text}")
        } else {
            write!(writer, "{}={text}", field.name())
        }
    })
    .delimited(" ")
}

/// An event format that adds the trace and span IDs of the OpenTelemetry span the line was
/// logged in, so a trace ID from a dashboard exemplar finds the lines: JSON lines get
/// `"trace_id"` and `"span_id"` fields, text lines end with ` trace_id=… span_id=…`. Lines
/// outside a traced span (and every line while traces are off) are written as `inner` writes
/// them.
struct WithTraceIds<F> {
    inner: F,
    json: bool,
}

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for WithTraceIds<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        use opentelemetry::trace::TraceContextExt as _;
        // The span the line is logged in: tracing-opentelemetry makes its context current on
        // entry (a thread-local read, no lock).
        let ids = opentelemetry::Context::map_current(|cx| {
            let span = cx.span();
            let sc = span.span_context();
            sc.is_valid().then(|| (sc.trace_id(), sc.span_id()))
        });
        let Some((trace_id, span_id)) = ids else {
            return self.inner.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.inner.format_event(
            ctx,
            tracing_subscriber::fmt::format::Writer::new(&mut line),
            event,
        )?;
        let body = line.strip_suffix('\n').unwrap_or(&line);
        if self.json {
            match body.strip_prefix('{') {
                Some(rest) if rest != "}" => writeln!(
                    writer,
                    "{{\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\",{rest}"
                ),
                _ => writeln!(writer, "{body}"),
            }
        } else {
            writeln!(writer, "{body} trace_id={trace_id} span_id={span_id}")
        }
    }
}

/// Log lines buffered for the writer thread before new ones are dropped. The buffer is allocated
/// whole at start (32 bytes a line): 8,192 lines is 256 KiB, and several seconds of a 10,000-plugin
/// burst at `info` (one line per registration outcome).
const LOG_BUFFER_LINES: usize = 8 * 1024;

/// What [`init`] set up; [`Logging::shutdown`] flushes it at exit.
pub struct Logging {
    traces: Option<Traces>,
    log_flush: tracing_appender::non_blocking::WorkerGuard,
}

impl Logging {
    /// Exports the remaining spans and writes the remaining log lines.
    pub fn shutdown(self) {
        if let Some(traces) = self.traces {
            traces.shutdown();
        }
        drop(self.log_flush);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Names of the spans a layer saw.
    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<Vec<&'static str>>>);

    impl<S: tracing::Subscriber> Layer<S> for Seen {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            _id: &tracing::span::Id,
            _ctx: tracing_subscriber::layer::Context<'_, S>,
        ) {
            self.0.lock().expect("lock").push(attrs.metadata().name());
        }
    }

    #[test]
    fn the_opentelemetry_layer_skips_unsampled_operations_each_time_not_per_call_site() {
        let seen = Seen::default();
        let subscriber =
            tracing_subscriber::registry().with(seen.clone().with_filter(otel_filter()));
        tracing::subscriber::with_default(subscriber, || {
            let step = |unsampled: bool| {
                let _in = unsampled.then(|| super::super::sampling::unsampled_for_tests().attach());
                let _span = tracing::info_span!("register").entered();
            };
            // The call site is first reached inside an unsampled operation, then outside one.
            step(true);
            step(false);
            step(true);
        });
        assert_eq!(*seen.0.lock().expect("lock"), ["register"]);
    }
}
