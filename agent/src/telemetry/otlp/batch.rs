//! The batch span processor: finished spans are encoded into their batch's bytes as they end,
//! and one task on the agent's runtime sends full batches, and the last partial one when it is
//! due, to the collector over OTLP/gRPC.
//!
//! ```text
//! span ends (any thread) ─> encode::span_entry ─> lock: append to the newest batch
//!                                                 (queue full: dropped, counted)
//!      first span of an idle queue, or a batch now full ─> wake the export task (once)
//! export task: idle ─> woken ─> full batches sent at once; the partial one when the oldest
//!              queued span has waited OTEL_BSP_SCHEDULE_DELAY ─> queue empty: idle again
//! ```
//!
//! The task is woken once per batch, not per span (the SDK's processor took a channel message
//! per span, and a wake-up with it), and an idle agent has no timer running: the delay starts
//! with the first span queued. A collector that is down or slow costs the registration path
//! nothing: ending a span is an append under a short lock, and when the queue is full the span
//! is dropped and counted (a warning says how many, at most every ten seconds).

use super::config::{BatchConfig, ExportConfig};
use super::encode::{self, Envelope};
use bytes::{Bytes, BytesMut};
use opentelemetry::Context;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The gRPC method spans are sent to.
const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// Most one warning about dropped spans or failed exports per this long.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Room made for a batch's bytes up front, per span: about what a span of the agent's takes.
const SPAN_BYTES_HINT: usize = 256;

/// One export request's spans, encoded.
#[derive(Debug)]
struct Batch {
    spans: BytesMut,
    count: usize,
    /// When its first span was queued: it is due a delay after.
    started: Instant,
}

#[derive(Debug, Default)]
struct Queue {
    /// Oldest first; every batch but the newest is full.
    batches: VecDeque<Batch>,
    /// Spans in all batches.
    queued: usize,
    /// Spans dropped because the queue was full, since the last warning.
    dropped: u64,
    /// Set by shutdown: the task sends everything, then says so here.
    closing: Option<std::sync::mpsc::Sender<()>>,
    /// Shutdown was asked for: nothing more is queued.
    closed: bool,
    /// Set by force_flush: the task sends everything queued now, then says so.
    flushing: Vec<std::sync::mpsc::Sender<()>>,
}

#[derive(Debug)]
struct Shared {
    config: BatchConfig,
    queue: Mutex<Queue>,
    wake: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // Appends and takes of whole batches: a poisoned queue is still consistent.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues one span, written straight into its batch; true when the export task should be
    /// woken.
    fn push(&self, entry: &encode::Entry<'_>) -> bool {
        let max_batch = self.config.max_export_batch_size;
        let mut queue = self.lock();
        if queue.closed {
            return false;
        }
        if queue.queued >= self.config.max_queue_size {
            queue.dropped += 1;
            return false;
        }
        let idle = queue.queued == 0;
        let batch = match queue.batches.back_mut() {
            Some(batch) if batch.count < max_batch => batch,
            _ => {
                queue.batches.push_back(Batch {
                    spans: BytesMut::with_capacity(max_batch * SPAN_BYTES_HINT),
                    count: 0,
                    started: Instant::now(),
                });
                queue.batches.back_mut().expect("just pushed")
            }
        };
        batch.spans.reserve(entry.len());
        entry.put(&mut batch.spans);
        batch.count += 1;
        let full = batch.count == max_batch;
        queue.queued += 1;
        idle || full
    }

    /// The oldest batch, if it is full, or if `any` (due, flushing, closing).
    fn take(&self, any: bool) -> Option<Batch> {
        let mut queue = self.lock();
        let front = queue.batches.front()?;
        if !any && front.count < self.config.max_export_batch_size {
            return None;
        }
        let batch = queue.batches.pop_front()?;
        queue.queued -= batch.count;
        Some(batch)
    }

    /// Queues one span and wakes the export task when it should be.
    fn send(&self, entry: &encode::Entry<'_>) {
        if self.push(entry) {
            self.wake.notify_one();
        }
    }

    /// When the oldest batch is due, if any span is queued.
    fn due(&self) -> Option<Instant> {
        let delay = self.config.scheduled_delay;
        self.lock().batches.front().map(|b| b.started + delay)
    }
}

/// Sends encoded batches to the collector.
struct Client {
    grpc: tonic::client::Grpc<tonic::transport::Channel>,
    config: ExportConfig,
    envelope: Envelope,
    last_warning: Option<Instant>,
    failing: bool,
}

impl Client {
    async fn send(&mut self, batch: Batch) {
        let request = self.envelope.request(&batch.spans);
        let timeout = self.config.timeout;
        let result = tokio::time::timeout(timeout, self.call(request)).await;
        let error = match result {
            Ok(Ok(response)) => {
                self.recovered();
                match response.partial_success {
                    Some(p) if p.rejected_spans > 0 || !p.error_message.is_empty() => {
                        tracing::warn!(
                            rejected_spans = p.rejected_spans,
                            message = p.error_message,
                            "the trace collector rejected spans"
                        );
                    }
                    _ => {}
                }
                return;
            }
            Ok(Err(status)) => format!("{}: {}", status.code(), status.message()),
            Err(_) => format!("no answer within {timeout:?}"),
        };
        self.failed(batch.count, &error);
    }

    async fn call(&mut self, request: Bytes) -> Result<ExportTraceServiceResponse, tonic::Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("collector unreachable: {e}")))?;
        let mut request = tonic::Request::new(request);
        *request.metadata_mut() = self.config.headers.clone();
        request.set_timeout(self.config.timeout);
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(EXPORT_PATH);
        let response = self.grpc.unary(request, path, RawCodec).await?;
        Ok(response.into_inner())
    }

    fn failed(&mut self, spans: usize, error: &str) {
        let due = self
            .last_warning
            .is_none_or(|at| at.elapsed() >= WARN_EVERY);
        if !self.failing || due {
            tracing::warn!(
                endpoint = self.config.endpoint,
                spans,
                error,
                "trace export failed: spans dropped"
            );
            self.last_warning = Some(Instant::now());
        }
        self.failing = true;
    }

    fn recovered(&mut self) {
        if self.failing {
            tracing::info!(endpoint = self.config.endpoint, "trace export works again");
            self.failing = false;
        }
    }
}

/// Held by the export task: when it ends (its own end, or the runtime's), whoever waits for a
/// flush or a shutdown stops waiting.
struct TaskGone(Arc<Shared>);

impl Drop for TaskGone {
    fn drop(&mut self) {
        let mut queue = self.0.lock();
        queue.closing = None;
        queue.flushing.clear();
    }
}

/// The export task (see the module docs).
async fn run(shared: Arc<Shared>, mut client: Client) {
    let _gone = TaskGone(shared.clone());
    let mut last_drop_warning: Option<Instant> = None;
    loop {
        // Idle until a span is queued (or shutdown, or a flush).
        shared.wake.notified().await;
        loop {
            while let Some(batch) = shared.take(false) {
                client.send(batch).await;
            }
            let (closing, flushing) = {
                let mut queue = shared.lock();
                let dropped = std::mem::take(&mut queue.dropped);
                if dropped > 0 && last_drop_warning.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                    tracing::warn!(
                        dropped,
                        "trace queue full (OTEL_BSP_MAX_QUEUE_SIZE): spans dropped"
                    );
                    last_drop_warning = Some(Instant::now());
                } else {
                    queue.dropped += dropped;
                }
                (queue.closing.take(), std::mem::take(&mut queue.flushing))
            };
            if closing.is_some() || !flushing.is_empty() {
                while let Some(batch) = shared.take(true) {
                    client.send(batch).await;
                }
                for done in flushing {
                    let _ = done.send(());
                }
                if let Some(done) = closing {
                    let _ = done.send(());
                    return;
                }
            }
            let Some(due) = shared.due() else {
                break;
            };
            tokio::select! {
                () = shared.wake.notified() => {}
                () = tokio::time::sleep_until(due.into()) => {
                    if let Some(batch) = shared.take(true) {
                        client.send(batch).await;
                    }
                }
            }
        }
    }
}

/// The processor the tracer provider hands finished spans to (behind the tail rule).
#[derive(Debug)]
pub struct BatchProcessor {
    shared: Arc<Shared>,
    /// Until the provider gives the resource ([`SpanProcessor::set_resource`]), which starts the
    /// export task.
    pending: Mutex<Option<Pending>>,
}

#[derive(Debug)]
struct Pending {
    config: ExportConfig,
    channel: tonic::transport::Channel,
    runtime: tokio::runtime::Handle,
}

impl BatchProcessor {
    /// A processor sending to `config.endpoint`; its task starts on the current tokio runtime
    /// once the provider gives it the resource. The connection is made when the first batch is
    /// sent (and again after it breaks).
    pub fn new(config: ExportConfig) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        let channel = tonic::transport::Endpoint::from_shared(config.endpoint.clone())
            .with_context(|| format!("invalid OTLP endpoint {:?}", config.endpoint))?
            .timeout(config.timeout)
            .connect_lazy();
        let runtime = tokio::runtime::Handle::try_current()
            .context("the trace exporter needs the agent's tokio runtime")?;
        Ok(BatchProcessor {
            shared: Arc::new(Shared {
                config: config.batch,
                queue: Mutex::new(Queue::default()),
                wake: Notify::new(),
            }),
            pending: Mutex::new(Some(Pending {
                config,
                channel,
                runtime,
            })),
        })
    }

    /// Asks the task to send what is queued, waiting at most `timeout`; `closing` stops it after.
    fn drain(&self, timeout: Duration, closing: bool) -> OTelSdkResult {
        let (done, drained) = std::sync::mpsc::channel();
        // Never started (no resource given): nothing can be sent, nobody to wait for.
        let started = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none();
        {
            let mut queue = self.shared.lock();
            if closing {
                if queue.closed {
                    return Err(OTelSdkError::AlreadyShutdown);
                }
                queue.closed = true;
                queue.closing = Some(done);
            } else {
                queue.flushing.push(done);
            }
        }
        if !started {
            return Ok(());
        }
        self.shared.wake.notify_one();
        match drained.recv_timeout(timeout) {
            Ok(()) => Ok(()),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(OTelSdkError::Timeout(timeout)),
            // The task is gone (the runtime ended): see `TaskGone`.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Ok(()),
        }
    }
}

/// A processor's queue, for spans that do not come through the SDK (see
/// `telemetry::sampling::OperationTrace`).
#[derive(Debug, Clone)]
pub struct Sender(Arc<Shared>);

impl Sender {
    /// Queues the agent's `span`.
    pub fn send(&self, span: &encode::SpanRecord<'_>) {
        self.0.send(&encode::Entry::record(span));
    }

    /// Queues the SDK's `span` as its processor would.
    pub fn send_sdk(&self, span: &SpanData) {
        self.0.send(&encode::Entry::sdk(span));
    }
}

impl BatchProcessor {
    /// Its queue, for spans that do not come through the SDK.
    pub fn sender(&self) -> Sender {
        Sender(self.shared.clone())
    }
}

impl SpanProcessor for BatchProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if span.span_context.is_sampled() {
            self.shared.send(&encode::Entry::sdk(&span));
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.drain(Duration::from_secs(10), false)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.drain(timeout, true)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        let Some(pending) = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        else {
            return;
        };
        let mut grpc = tonic::client::Grpc::new(pending.channel);
        if pending.config.gzip {
            grpc = grpc.send_compressed(tonic::codec::CompressionEncoding::Gzip);
        }
        let client = Client {
            grpc,
            envelope: Envelope::new(resource, encode::SCOPE),
            config: pending.config,
            last_warning: None,
            failing: false,
        };
        pending.runtime.spawn(run(self.shared.clone(), client));
    }
}

/// The gRPC codec of an export: the request's bytes as they are, the response decoded by prost.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Bytes;
    type Decode = ExportTraceServiceResponse;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Self::Error> {
        use bytes::BufMut as _;
        dst.put(item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = ExportTraceServiceResponse;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Self::Item>, Self::Error> {
        use prost::Message as _;
        ExportTraceServiceResponse::decode(src)
            .map(Some)
            .map_err(|e| tonic::Status::internal(format!("malformed export response: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
        TraceService, TraceServiceServer,
    };
    use std::borrow::Cow;
    use std::time::SystemTime;
    use tokio::sync::mpsc;

    /// What the collector got in one request: span names, and the `x-tenant` header.
    type Received = (Vec<String>, Option<String>);

    struct Collector(mpsc::UnboundedSender<Received>);

    #[tonic::async_trait]
    impl TraceService for Collector {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            let tenant = request
                .metadata()
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let names = request
                .into_inner()
                .resource_spans
                .into_iter()
                .flat_map(|r| r.scope_spans)
                .flat_map(|s| s.spans)
                .map(|s| s.name)
                .collect();
            let _ = self.0.send((names, tenant));
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        }
    }

    /// A collector on a loopback port that takes gzip; its endpoint and what it receives.
    async fn collector() -> (String, mpsc::UnboundedReceiver<Received>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = mpsc::unbounded_channel();
        let service = TraceServiceServer::new(Collector(tx))
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (format!("http://{addr}"), rx)
    }

    fn config(endpoint: String, batch: BatchConfig) -> ExportConfig {
        let mut headers = tonic::metadata::MetadataMap::new();
        headers.insert("x-tenant", "node-1".parse().expect("ascii"));
        ExportConfig {
            endpoint,
            headers,
            timeout: Duration::from_secs(10),
            gzip: true,
            batch,
        }
    }

    fn span(name: &str, sampled: bool) -> SpanData {
        let mut span = SpanData {
            span_context: SpanContext::new(
                TraceId::from(1_u128),
                SpanId::from(2_u64),
                if sampled {
                    TraceFlags::SAMPLED
                } else {
                    TraceFlags::default()
                },
                false,
                Default::default(),
            ),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: Cow::Owned(name.to_owned()),
            start_time: SystemTime::now(),
            end_time: SystemTime::now(),
            attributes: vec![],
            dropped_attributes_count: 0,
            events: Default::default(),
            links: Default::default(),
            status: Status::Unset,
            instrumentation_scope: Default::default(),
        };
        span.attributes.push(opentelemetry::KeyValue::new("k", "v"));
        span
    }

    fn started(config: ExportConfig) -> BatchProcessor {
        let mut processor = BatchProcessor::new(config).expect("valid");
        processor.set_resource(&opentelemetry_sdk::Resource::builder_empty().build());
        processor
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn full_batches_go_at_once_and_the_partial_one_when_it_is_due() {
        let (endpoint, mut received) = collector().await;
        let delay = Duration::from_millis(300);
        let processor = started(config(
            endpoint,
            BatchConfig {
                max_queue_size: 100,
                scheduled_delay: delay,
                max_export_batch_size: 3,
            },
        ));
        let start = Instant::now();
        for i in 0..7 {
            processor.on_end(span(&format!("s{i}"), true));
        }
        processor.on_end(span("not sampled", false));
        let mut got = Vec::new();
        for _ in 0..3 {
            let (names, tenant) = received.recv().await.expect("a request");
            assert_eq!(tenant.as_deref(), Some("node-1"), "headers are sent");
            got.push((names, start.elapsed()));
        }
        let names: Vec<Vec<String>> = got.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(
            names,
            [vec!["s0", "s1", "s2"], vec!["s3", "s4", "s5"], vec!["s6"]],
            "in order, in batches of three, unsampled spans left out"
        );
        assert!(got[2].1 >= delay, "the partial batch waited for its delay");
        tokio::task::spawn_blocking(move || {
            processor.shutdown_with_timeout(Duration::from_secs(5))
        })
        .await
        .expect("joined")
        .expect("shut down");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_sends_what_is_queued_and_happens_once() {
        let (endpoint, mut received) = collector().await;
        let processor = started(config(
            endpoint,
            BatchConfig {
                max_queue_size: 100,
                scheduled_delay: Duration::from_secs(3600),
                max_export_batch_size: 50,
            },
        ));
        processor.on_end(span("a", true));
        processor.on_end(span("b", true));
        let processor = Arc::new(processor);
        let closing = processor.clone();
        tokio::task::spawn_blocking(move || closing.shutdown_with_timeout(Duration::from_secs(5)))
            .await
            .expect("joined")
            .expect("flushed");
        let (names, _) = received.recv().await.expect("flushed at shutdown");
        assert_eq!(names, ["a", "b"]);
        let again = processor.clone();
        let second = tokio::task::spawn_blocking(move || {
            again.shutdown_with_timeout(Duration::from_secs(1))
        })
        .await
        .expect("joined");
        assert!(matches!(second, Err(OTelSdkError::AlreadyShutdown)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_drops_new_spans_and_counts_them() {
        // No resource given: the task never starts, as with a collector that never answers.
        let processor = BatchProcessor::new(config(
            "http://127.0.0.1:9".into(),
            BatchConfig {
                max_queue_size: 4,
                scheduled_delay: Duration::from_secs(3600),
                max_export_batch_size: 2,
            },
        ))
        .expect("valid");
        for i in 0..10 {
            processor.on_end(span(&format!("s{i}"), true));
        }
        {
            let queue = processor.shared.lock();
            assert_eq!(queue.queued, 4);
            assert_eq!(queue.dropped, 6);
            assert_eq!(queue.batches.len(), 2, "two full batches of two");
        }
        // No task to wait for: shutdown does not wait out its budget for one.
        let result = tokio::task::spawn_blocking(move || {
            processor.shutdown_with_timeout(Duration::from_millis(1))
        })
        .await
        .expect("joined");
        assert!(result.is_ok(), "{result:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_collector_that_is_down_costs_the_spans_not_the_agent() {
        // A port nothing listens on: every export fails; spans are dropped, ending one is not
        // held up, and shutdown returns within its budget.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
        drop(listener);
        let processor = Arc::new(started(config(
            endpoint,
            BatchConfig {
                max_queue_size: 10,
                scheduled_delay: Duration::from_millis(10),
                max_export_batch_size: 2,
            },
        )));
        for i in 0..100 {
            processor.on_end(span(&format!("s{i}"), true));
        }
        let closing = processor.clone();
        let result = tokio::task::spawn_blocking(move || {
            closing.shutdown_with_timeout(Duration::from_secs(5))
        })
        .await
        .expect("joined");
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(
            processor.shared.lock().queued,
            0,
            "what could not be sent is gone"
        );
    }
}
