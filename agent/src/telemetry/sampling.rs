//! Which traces are exported: the operator's head sampler, and the agent's tail rule that keeps
//! every failed or slow operation whatever the head sampler said.
//!
//! ```text
//! discovery ─> head sampler (OTEL_TRACES_SAMPLER{,_ARG}) ─ picked: exported at once
//!                                                        └ not: kept unbuilt (UnbuiltRoot)
//! operation ─> OperationTrace: IDs, attributes and steps' times recorded while it runs
//!   ends ────> sampled, or kept by the tail rule (failed, or slower than
//!              --trace-keep-slower-than: [`TAIL_FIELD`]) ─ its spans (its unbuilt root, and
//!              what its trace held, with them) ─> export queue (telemetry::otlp)
//!            └ neither: nothing made, what its trace held dropped
//! ```
//!
//! No operation makes a span while it runs ([`OperationTrace`]): the executor runs it in an
//! OpenTelemetry context that carries its trace and span IDs, so its log lines and exemplars name
//! them, and records its attributes and its steps' times; when it ends, its spans are written
//! with those IDs and times straight into the exporter's queue (`otlp::SpanRecord`, no SDK span
//! in between) if its trace is exported, and not at all otherwise. An exemplar is only
//! attached when the trace will be exported ([`exported`]), so a dashboard link never leads to a
//! trace the backend never got. The executor decides the tail rule once, where the outcome and
//! the duration are known: the exporter and the exemplars read the same decision.
//!
//! The only spans the OpenTelemetry SDK still builds are the rare ones outside operations
//! (`unserved`, `telemetry::discovery::Discoveries::event_span`). Under a root the head sampler
//! did not pick they are recorded, not sampled ([`RecordEverything`]), and the [`TailProcessor`]
//! holds them until an operation of their trace ends: exported with it (as sampled) if it is
//! kept, dropped if not. Held spans are bounded ([`MAX_HELD_TRACES`] traces of at most
//! [`MAX_HELD_SPANS`] spans), the oldest dropped past that.
//!
//! What this replaced, measured: spans built by `tracing-opentelemetry` from the `tracing` spans
//! as operations ran (its layer looked every span up on every enter and exit of every poll, and
//! every operation was recorded in full so that the tail rule could decide at its end) cost a
//! traced burst a fifth of the agent's CPU, sampled or not; building every discovery span so that
//! the tail rule could keep it cost another tenth; building the kept ones as SDK spans, for the
//! exporter crate to turn into protobuf structs, half of what tracing every operation cost.

use super::otlp::SpanRecord;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, Sampler, SamplingDecision, SamplingResult, ShouldSample, Span,
    SpanData, SpanProcessor,
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

/// The operation span field the executor records when the tail rule keeps an operation: its
/// value says why (`failed`, `slow`).
pub const TAIL_FIELD: &str = "tail_kept";

/// Traces held (not sampled, operation still running) before the oldest is dropped.
pub const MAX_HELD_TRACES: usize = 4096;

/// Spans held per trace; more are dropped (an operation has about ten).
pub const MAX_HELD_SPANS: usize = 64;

/// The default of `--trace-keep-slower-than`.
pub const DEFAULT_KEEP_SLOWER_THAN: Duration = Duration::from_millis(500);

/// `--trace-keep-slower-than` in nanoseconds; process-wide, as the tracer provider is.
static KEEP_SLOWER_THAN_NS: AtomicU64 = AtomicU64::new(500_000_000);

/// Sets the tail rule's threshold (`--trace-keep-slower-than`).
pub fn set_keep_slower_than(threshold: Duration) {
    let ns = u64::try_from(threshold.as_nanos()).unwrap_or(u64::MAX);
    KEEP_SLOWER_THAN_NS.store(ns, Ordering::Relaxed);
}

/// Why the tail rule keeps an operation that `failed` after `took`, if it does.
pub fn tail_reason(failed: bool, took: Duration) -> Option<&'static str> {
    let threshold = Duration::from_nanos(KEEP_SLOWER_THAN_NS.load(Ordering::Relaxed));
    if failed {
        Some("failed")
    } else if took >= threshold {
        Some("slow")
    } else {
        None
    }
}

/// Whether the span `cx` belongs to a trace that is exported: sampled by the head sampler, or
/// kept by the tail rule (`tail_kept`). Invalid contexts (traces off) are never exported.
pub fn exported(cx: &SpanContext, tail_kept: bool) -> bool {
    cx.is_valid() && (cx.is_sampled() || tail_kept)
}

/// The operator's head sampler: `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`, as the SDK
/// reads them; default `parentbased_always_on`.
pub fn head_sampler() -> Box<dyn ShouldSample> {
    opentelemetry_sdk::trace::Config::default().sampler
}

/// Whether `sampler` picks the new trace `trace`, whose root span is `name` (a discovery: the
/// head decision of its trace, taken before anything of it is exported).
pub fn head_samples(sampler: &dyn ShouldSample, trace: TraceId, name: &str) -> bool {
    sampler
        .should_sample(None, trace, name, &SpanKind::Internal, &[], &[])
        .decision
        == SamplingDecision::RecordAndSample
}

/// The operator's sampler ([`head_sampler`]), made to record what it would drop instead of
/// dropping it, so the tail rule can still keep it.
#[derive(Debug, Clone)]
pub struct RecordEverything {
    inner: Box<dyn ShouldSample>,
}

impl RecordEverything {
    /// The sampler the standard environment variables configure.
    pub fn from_env() -> Self {
        RecordEverything {
            inner: head_sampler(),
        }
    }

    /// Wraps `sampler` (for tests).
    pub fn new(sampler: Sampler) -> Self {
        RecordEverything {
            inner: Box::new(sampler),
        }
    }
}

impl ShouldSample for RecordEverything {
    fn should_sample(
        &self,
        parent_context: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[opentelemetry::trace::Link],
    ) -> SamplingResult {
        let mut result =
            self.inner
                .should_sample(parent_context, trace_id, name, span_kind, attributes, links);
        if result.decision == SamplingDecision::Drop {
            result.decision = SamplingDecision::RecordOnly;
        }
        result
    }
}

/// The span processor in front of the batch exporter (see the module docs).
#[derive(Debug)]
pub struct TailProcessor<P> {
    inner: P,
    held: Arc<Mutex<Held>>,
}

/// The installed tail processor's held spans, so an operation that is not exported can drop its
/// trace's (an `unserved` span under its discovery) at once instead of leaving them to the bound.
static HELD: OnceLock<Arc<Mutex<Held>>> = OnceLock::new();

fn lock_held(held: &Mutex<Held>) -> std::sync::MutexGuard<'_, Held> {
    // Inserts and removes of whole entries: a poisoned map is still consistent.
    held.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, Default)]
struct Held {
    traces: HashMap<TraceId, Vec<SpanData>>,
    /// Trace IDs in the order they were first held (some may be gone already).
    order: VecDeque<TraceId>,
}

impl Held {
    /// The spans held for `trace`, marked sampled (to be exported with the operation that keeps
    /// them: the backend sees one consistent trace).
    fn take(&mut self, trace: TraceId) -> Vec<SpanData> {
        let mut spans = self.traces.remove(&trace).unwrap_or_default();
        for span in &mut spans {
            let cx = &span.span_context;
            span.span_context = SpanContext::new(
                cx.trace_id(),
                cx.span_id(),
                cx.trace_flags() | TraceFlags::SAMPLED,
                cx.is_remote(),
                cx.trace_state().clone(),
            );
        }
        spans
    }

    fn hold(&mut self, span: SpanData) {
        let trace = span.span_context.trace_id();
        let spans = self.traces.entry(trace).or_insert_with(|| {
            self.order.push_back(trace);
            Vec::new()
        });
        if spans.len() < MAX_HELD_SPANS {
            spans.push(span);
        }
        while self.traces.len() > MAX_HELD_TRACES {
            match self.order.pop_front() {
                Some(oldest) => {
                    self.traces.remove(&oldest);
                }
                None => break,
            }
        }
        if self.order.len() > 2 * MAX_HELD_TRACES {
            let traces = &self.traces;
            self.order.retain(|t| traces.contains_key(t));
        }
    }
}

impl<P: SpanProcessor> TailProcessor<P> {
    /// Puts the tail rule in front of `inner` (the batch processor).
    pub fn new(inner: P) -> Self {
        let held = Arc::new(Mutex::new(Held::default()));
        // The first processor made is the installed one (tests make their own, unshared).
        let _ = HELD.set(held.clone());
        TailProcessor { inner, held }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        lock_held(&self.held)
    }
}

impl<P: SpanProcessor> SpanProcessor for TailProcessor<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if span.span_context.is_sampled() {
            self.inner.on_end(span);
        } else {
            self.lock().hold(span);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// A new random trace ID.
pub fn random_trace_id() -> TraceId {
    RandomIdGenerator::default().new_trace_id()
}

/// A new random span ID.
pub fn random_span_id() -> SpanId {
    RandomIdGenerator::default().new_span_id()
}

/// The root of a trace the head sampler did not pick (a socket's discovery): not built while it
/// happens, only when an operation under it is kept by the tail rule.
pub trait UnbuiltRoot: std::fmt::Debug + Send + Sync {
    /// Its span context (not sampled): the trace its operations belong to.
    fn span_context(&self) -> &SpanContext;

    /// Exports its spans, with the IDs and times it recorded, for the kept operation that asks;
    /// only the first call exports.
    fn build(&self);
}

/// What an operation's spans are children of: its socket's discovery.
#[derive(Debug, Clone)]
pub enum Root {
    /// Picked by the head sampler: exported when it happened.
    Built(SpanContext),
    /// Not picked: exported only if an operation under it is kept.
    Unbuilt(Arc<dyn UnbuiltRoot>),
}

impl Root {
    /// The root's span context.
    pub fn span_context(&self) -> &SpanContext {
        match self {
            Root::Built(cx) => cx,
            Root::Unbuilt(root) => root.span_context(),
        }
    }

    /// A context to start a span under the root; under an unbuilt one the span is recorded, not
    /// sampled, and exported with the trace if one of its operations is kept.
    pub fn context(&self) -> Context {
        Context::new().with_remote_span_context(self.span_context().clone())
    }
}

/// The context value that marks the operation running here (see [`OperationTrace`]).
#[derive(Clone, Debug)]
struct CurrentOperation(Arc<OperationTrace>);

/// A context inside an operation, for the logging layer's tests.
#[cfg(test)]
pub(crate) fn operation_for_tests(span: SpanContext) -> Context {
    let operation = Arc::new(OperationTrace {
        name: "register",
        root: Root::Built(SpanContext::empty_context()),
        span: span.clone(),
        started: SystemTime::now(),
        attributes: Mutex::new(Vec::new()),
        steps: Mutex::new(Vec::new()),
    });
    Context::new()
        .with_remote_span_context(span)
        .with_value(CurrentOperation(operation))
}

/// An operation's trace while it runs (a registration or deregistration attempt): what its spans
/// will say, kept until it ends, when they are built if its trace is exported (sampled at the
/// head, or kept by the tail rule), else dropped. No span is built while it runs: the executor
/// runs it in a context that carries its trace and span IDs, which its log lines and exemplars
/// name, and the spans exported later have those IDs.
#[derive(Debug)]
pub struct OperationTrace {
    name: &'static str,
    root: Root,
    span: SpanContext,
    started: SystemTime,
    /// In the order recorded; a later value of a key replaces an earlier one when built.
    attributes: Mutex<Vec<KeyValue>>,
    steps: Mutex<Vec<Step>>,
}

/// A step of an operation: a span to build if the operation's trace is exported.
#[derive(Debug)]
struct Step {
    name: &'static str,
    span: SpanId,
    started: SystemTime,
    ended: SystemTime,
    failed: bool,
    attributes: Vec<KeyValue>,
}

/// Most steps kept per operation (a registration has about six; a dial retried in a loop could
/// have more).
const MAX_STEPS: usize = 32;

/// Room made for an operation's steps and attributes up front (a registration's count), so
/// recording them does not grow the vectors step by step.
const STEPS_HINT: usize = 8;
const ATTRIBUTES_HINT: usize = 24;

impl OperationTrace {
    /// The operation `name` under `root`, and the context to run it in; `None` when traces are
    /// off. Its span is sampled when its root is.
    pub fn start(name: &'static str, root: Root) -> Option<(Context, Arc<OperationTrace>)> {
        if !super::otlp::enabled() {
            return None;
        }
        let parent = root.span_context();
        let span = SpanContext::new(
            parent.trace_id(),
            random_span_id(),
            parent.trace_flags(),
            false,
            TraceState::default(),
        );
        let operation = Arc::new(OperationTrace {
            name,
            root,
            span: span.clone(),
            started: SystemTime::now(),
            attributes: Mutex::new(Vec::with_capacity(ATTRIBUTES_HINT)),
            steps: Mutex::new(Vec::with_capacity(STEPS_HINT)),
        });
        let context = Context::new()
            .with_remote_span_context(span)
            .with_value(CurrentOperation(operation.clone()));
        Some((context, operation))
    }

    /// The operation running here, if any (and traces are on).
    pub fn current() -> Option<Arc<OperationTrace>> {
        Context::map_current(|cx| cx.get::<CurrentOperation>().map(|op| op.0.clone()))
    }

    /// The operation's span context (its trace, and the span ID it is exported with).
    pub fn span_context(&self) -> &SpanContext {
        &self.span
    }

    /// Sets the operation span's attribute `key` (recorded as it comes: the last value of each
    /// key is picked only when the span is built).
    pub fn record(&self, key: &'static str, value: impl Into<Value>) {
        let mut attributes = self.attributes.lock().unwrap_or_else(|p| p.into_inner());
        attributes.push(KeyValue::new(key, value.into()));
    }

    /// A step named `name` that just ended after `took`, with its span's `attributes`: its span
    /// context, for an exemplar.
    pub fn step(
        &self,
        name: &'static str,
        took: Duration,
        failed: bool,
        attributes: Vec<KeyValue>,
    ) -> SpanContext {
        let id = random_span_id();
        let ended = SystemTime::now();
        let mut steps = self.steps.lock().unwrap_or_else(|p| p.into_inner());
        if steps.len() < MAX_STEPS {
            steps.push(Step {
                name,
                span: id,
                started: ended.checked_sub(took).unwrap_or(ended),
                ended,
                failed,
                attributes,
            });
        }
        SpanContext::new(
            self.span.trace_id(),
            id,
            self.span.trace_flags(),
            false,
            TraceState::default(),
        )
    }

    /// The operation ended, `failed` or not; `kept` is the tail rule's reason, if it keeps it.
    /// Exported (sampled, or kept): its spans, with the IDs and times it recorded, go to the
    /// exporter's queue, with its unbuilt root and what its trace held. Not exported: nothing is
    /// made, and its trace's held spans are dropped.
    pub fn finish(&self, kept: Option<&'static str>, failed: bool) {
        let trace = self.span.trace_id();
        if !exported(&self.span, kept.is_some()) {
            if let Some(held) = HELD.get() {
                lock_held(held).traces.remove(&trace);
            }
            return;
        }
        if let Root::Unbuilt(root) = &self.root {
            root.build();
        }
        if let Some(held) = HELD.get() {
            let spans = lock_held(held).take(trace);
            spans.into_iter().for_each(super::otlp::export_sdk_span);
        }
        let recorded =
            std::mem::take(&mut *self.attributes.lock().unwrap_or_else(|p| p.into_inner()));
        let mut attributes = last_of_each_key(recorded);
        if let Some(reason) = kept {
            attributes.push(KeyValue::new(TAIL_FIELD, reason));
        }
        let operation = self.span.span_id();
        let steps = std::mem::take(&mut *self.steps.lock().unwrap_or_else(|p| p.into_inner()));
        for step in &steps {
            super::otlp::export(&SpanRecord {
                trace_id: trace,
                span_id: step.span,
                parent: operation,
                parent_is_remote: false,
                name: step.name,
                start: step.started,
                end: step.ended,
                attributes: &step.attributes,
                failed: step.failed,
            });
        }
        super::otlp::export(&SpanRecord {
            trace_id: trace,
            span_id: operation,
            parent: self.root.span_context().span_id(),
            parent_is_remote: true,
            name: self.name,
            start: self.started,
            end: SystemTime::now(),
            attributes: &attributes,
            failed,
        });
    }
}

/// `attributes` with each key once, at its last value, in the order of first appearance.
fn last_of_each_key(attributes: Vec<KeyValue>) -> Vec<KeyValue> {
    let mut unique: Vec<KeyValue> = Vec::with_capacity(attributes.len());
    for kv in attributes {
        match unique.iter_mut().find(|u| u.key == kv.key) {
            Some(u) => u.value = kv.value,
            None => unique.push(kv),
        }
    }
    unique
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use std::sync::Arc;

    /// What reaches the exporter.
    #[derive(Debug, Clone, Default)]
    struct Exported(Arc<Mutex<Vec<SpanData>>>);

    impl Exported {
        fn get_finished_spans(&self) -> Result<Vec<SpanData>, ()> {
            Ok(self.0.lock().expect("lock").clone())
        }
    }

    impl SpanProcessor for Exported {
        fn on_start(&self, _span: &mut Span, _cx: &Context) {}
        fn on_end(&self, span: SpanData) {
            self.0.lock().expect("lock").push(span);
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    fn provider(sampler: Sampler) -> (SdkTracerProvider, Exported, Arc<Mutex<Held>>) {
        let exporter = Exported::default();
        let processor = TailProcessor::new(exporter.clone());
        let held = processor.held.clone();
        let provider = SdkTracerProvider::builder()
            .with_sampler(RecordEverything::new(sampler))
            .with_span_processor(processor)
            .build();
        (provider, exporter, held)
    }

    fn names(exporter: &Exported) -> Vec<String> {
        let mut names: Vec<String> = exporter
            .get_finished_spans()
            .expect("spans")
            .into_iter()
            .map(|s| s.name.into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn spans_under_an_unsampled_root_are_held_for_their_trace_and_taken_sampled() {
        let (provider, exporter, held) = provider(Sampler::TraceIdRatioBased(0.0));
        let tracer = provider.tracer("test");
        let mut discovery = tracer.start("discovery");
        discovery.end();
        let trace = discovery.span_context().trace_id();
        assert!(!discovery.span_context().is_sampled());
        let root = Context::new().with_remote_span_context(discovery.span_context().clone());
        let mut unserved = tracer.start_with_context("unserved", &root);
        unserved.end();
        assert!(names(&exporter).is_empty(), "not sampled: held");
        let spans = lock_held(&held).take(trace);
        let mut taken: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
        taken.sort_unstable();
        assert_eq!(taken, ["discovery", "unserved"]);
        assert!(
            spans.iter().all(|s| s.span_context.is_sampled()),
            "taken as sampled"
        );
        assert!(lock_held(&held).take(trace).is_empty(), "taken once");
    }

    #[test]
    fn sampled_spans_go_straight_to_the_exporter() {
        let (provider, exporter, _) = provider(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)));
        let tracer = provider.tracer("test");
        let mut discovery = tracer.start("discovery");
        discovery.end();
        assert_eq!(names(&exporter), ["discovery"]);
    }

    #[test]
    fn held_traces_are_bounded() {
        let mut held = Held::default();
        let (provider, exporter, _) = provider(Sampler::AlwaysOn);
        let tracer = provider.tracer("test");
        let mut span = tracer.start("discovery");
        span.end();
        let template = exporter.get_finished_spans().expect("spans").remove(0);
        for i in 0..(MAX_HELD_TRACES as u128 + 10) {
            let mut span = template.clone();
            span.span_context = SpanContext::new(
                TraceId::from(i + 1),
                span.span_context.span_id(),
                TraceFlags::default(),
                false,
                Default::default(),
            );
            held.hold(span);
        }
        assert_eq!(held.traces.len(), MAX_HELD_TRACES);
        assert!(
            !held.traces.contains_key(&TraceId::from(1u128)),
            "oldest dropped"
        );
        assert!(held.order.len() <= 2 * MAX_HELD_TRACES);
    }

    #[test]
    fn a_kept_operation_s_attributes_are_each_key_at_its_last_value() {
        let recorded = vec![
            KeyValue::new("socket_path", "/r/a.sock"),
            KeyValue::new("outcome", "pending"),
            KeyValue::new("plugin_name", "a"),
            KeyValue::new("outcome", "success"),
        ];
        let built = last_of_each_key(recorded);
        assert_eq!(
            built,
            vec![
                KeyValue::new("socket_path", "/r/a.sock"),
                KeyValue::new("outcome", "success"),
                KeyValue::new("plugin_name", "a"),
            ]
        );
    }

    #[test]
    fn the_tail_rule_keeps_failures_and_slow_operations() {
        set_keep_slower_than(Duration::from_millis(500));
        assert_eq!(tail_reason(true, Duration::ZERO), Some("failed"));
        assert_eq!(tail_reason(false, Duration::from_secs(1)), Some("slow"));
        assert_eq!(tail_reason(false, Duration::from_millis(10)), None);
    }
}
