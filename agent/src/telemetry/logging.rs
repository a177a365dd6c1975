//! The `tracing` subscriber: where log lines and spans go.
//!
//! ```text
//! tracing events and spans ──> fmt layer (stderr; text or JSON; filter: --log-level, else RUST_LOG, else info)
//! ```
//!
//! Traces are not made from `tracing` spans: an operation's spans are built from its
//! `sampling::OperationTrace` when it ends (see there), so `--log-level` filters the log only
//! and never the traces. While traces are on, every line logged inside an operation (or another
//! span with a trace, `unserved`) carries its `trace_id` and `span_id` ([`WithTraceIds`], read
//! from the OpenTelemetry context the executor runs it in): the join from a trace (or a metric
//! exemplar) to its lines. Log lines about a plugin carry `socket_path` (and `plugin_name`,
//! `plugin_type` once the plugin has said who it is) from the executor's operation spans: JSON
//! lines list them under `span` and `spans`, text lines in the span prefix.
//!
//! Text lines escape every control character in field values and span fields ([`text_fields`]):
//! plugin names, types, endpoints, socket paths and error texts come from plugins and handlers,
//! and a raw newline would forge a log line, an escape sequence drive a terminal. JSON lines need
//! no such help (JSON escapes control characters) and stay exact.

use super::otlp;
use super::traces::{self, Traces};
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
        match traces::install(otlp_endpoint) {
            Ok(traces) => (Some(traces), None),
            Err(e) => (None, Some(format!("{e:#}"))),
        }
    } else {
        (None, None)
    };
    tracing_subscriber::registry().with(fmt).init();
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

/// An event format that adds the trace and span IDs of the OpenTelemetry context the line was
/// logged in (an operation's, see `sampling::OperationTrace`), so a trace ID from a dashboard
/// exemplar finds the lines: JSON lines get `"trace_id"` and `"span_id"` fields, text lines end
/// with ` trace_id=… span_id=…`. Lines outside a traced context (and every line while traces are
/// off) are written as `inner` writes them.
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
        // The operation the line is logged in: the executor runs it in its trace's context (a
        // thread-local read, no lock).
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

    /// What the log layer wrote.
    #[derive(Clone, Default)]
    struct Written(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Written {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The lines a log layer (JSON when `json`, else text) writes for one line logged inside an
    /// operation (`span`) and one outside.
    fn lines_in_and_out_of_an_operation(json: bool, span: SpanContext) -> Vec<String> {
        let written = Written::default();
        let sink = written.clone();
        let fmt = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer(move || sink.clone());
        let fmt = if json {
            fmt.json()
                .event_format(WithTraceIds {
                    inner: tracing_subscriber::fmt::format().json().flatten_event(true),
                    json: true,
                })
                .boxed()
        } else {
            fmt.event_format(WithTraceIds {
                inner: tracing_subscriber::fmt::format(),
                json: false,
            })
            .boxed()
        };
        let subscriber = tracing_subscriber::registry().with(fmt);
        tracing::subscriber::with_default(subscriber, || {
            {
                let _in = super::super::sampling::operation_for_tests(span).attach();
                tracing::info!("inside");
            }
            tracing::info!("outside");
        });
        let text = String::from_utf8(written.0.lock().expect("lock").clone()).expect("utf-8");
        text.lines().map(str::to_string).collect()
    }

    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    #[test]
    fn lines_logged_inside_an_operation_carry_its_trace_and_span_ids() {
        let span = SpanContext::new(
            TraceId::from(0x0af7651916cd43dd8448eb211c80319c_u128),
            SpanId::from(0xb7ad6b7169203331_u64),
            TraceFlags::default(),
            false,
            TraceState::default(),
        );
        let json = lines_in_and_out_of_an_operation(true, span.clone());
        assert_eq!(json.len(), 2, "{json:?}");
        let inside: serde_json::Value = serde_json::from_str(&json[0]).expect("JSON");
        assert_eq!(inside["trace_id"], "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(inside["span_id"], "b7ad6b7169203331");
        assert_eq!(inside["message"], "inside");
        let outside: serde_json::Value = serde_json::from_str(&json[1]).expect("JSON");
        assert!(outside.get("trace_id").is_none(), "{outside}");
        let text = lines_in_and_out_of_an_operation(false, span);
        assert!(
            text[0]
                .ends_with(" trace_id=0af7651916cd43dd8448eb211c80319c span_id=b7ad6b7169203331"),
            "{text:?}"
        );
        assert!(!text[1].contains("trace_id="), "{text:?}");
    }
}
