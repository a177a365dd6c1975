//! What an operation reports when it ends: the outcome counter, the latency (with the trace as
//! an exemplar when that trace is exported), the outcome on the operation's span, and the tail
//! rule's mark (failed or slow: export this trace even if the head sampler did not pick it).
//! Telemetry is a sink: nothing here decides anything about the operation.
//!
//! No operation builds OpenTelemetry spans while it runs (`sampling::OperationTrace`): what is
//! written on its `tracing` span here (which the log shows) is written on its trace too, its
//! steps are recorded there, and when it ends its spans are built if its trace is exported.

use super::failure::RegisterFailure;
use crate::event_source::monotonic_now_ns;
use crate::provenance::Provenance;
use crate::registration::StepTimer;
use crate::state::actual::RegisteredPlugin;
use crate::state::backoff::{BackoffTable, FailureKind};
use crate::state::desired::DesiredPlugin;
use crate::telemetry::Telemetry;
use crate::telemetry::metrics::TraceExemplar;
use crate::telemetry::sampling::{self, OperationTrace};
use std::time::Duration;
use tokio::time::Instant;

/// The exemplar for an observation made in the operation running here: its trace and span IDs
/// when the trace is exported (sampled, or `kept` by the tail rule), so every exemplar leads to a
/// trace.
pub fn exemplar(kept: bool) -> Option<TraceExemplar> {
    let operation = OperationTrace::current()?;
    let cx = operation.span_context();
    sampling::exported(cx, kept)
        .then(|| TraceExemplar::of(cx))
        .flatten()
}

/// The exemplar for a step named `name`, with its span's `attributes`, that ended after `took`:
/// the step is recorded in the operation's trace, and the exemplar names the span it is exported
/// as.
pub fn step_exemplar(
    name: &'static str,
    took: Duration,
    failed: bool,
    attributes: impl FnOnce() -> Vec<opentelemetry::KeyValue>,
) -> Option<TraceExemplar> {
    let kept = sampling::tail_reason(failed, took).is_some();
    let operation = OperationTrace::current()?;
    let step = operation.step(name, took, failed, attributes());
    sampling::exported(&step, kept)
        .then(|| TraceExemplar::of(&step))
        .flatten()
}

/// Records every plugin call step in `telemetry`'s metrics, with the step's span (current when
/// the registration room reports it) as the exemplar; a failed or slow step's trace is exported
/// by the tail rule, so its exemplar leads to it.
pub fn step_timer(telemetry: std::sync::Arc<crate::telemetry::Telemetry>) -> StepTimer {
    StepTimer::new(move |step, took, ok| {
        let exemplar = step_exemplar(step.span_name(), took, !ok, Vec::new);
        let outcome = if ok { "ok" } else { "error" };
        telemetry
            .metrics
            .plugin_call(step.label(), outcome, took, exemplar);
    })
}

/// The span of the operation `name` on `path`, made by `make` (for the log), and the context to
/// run it in when traces are on: its `sampling::OperationTrace`'s, under its socket's discovery,
/// with the span's first `fields`.
pub fn operation_span(
    telemetry: &crate::telemetry::Telemetry,
    name: &'static str,
    path: &std::path::Path,
    make: impl FnOnce() -> tracing::Span,
    fields: impl FnOnce() -> Vec<(&'static str, opentelemetry::Value)>,
) -> (tracing::Span, Option<opentelemetry::Context>) {
    let span = make();
    let Some(root) = telemetry.discovery.parent_of(path) else {
        return (span, None);
    };
    let Some((cx, operation)) = OperationTrace::start(name, root) else {
        return (span, None);
    };
    operation.record("socket_path", path.to_string_lossy().into_owned());
    for (key, value) in fields() {
        operation.record(key, value);
    }
    (span, Some(cx))
}

/// Runs `operation` in `context` (its trace's, from [`operation_span`]), if any; without a
/// trace, as it is (no context is attached to the tasks that run operations, so there is none
/// to carry, and attaching one on every poll cost more than the rest of the span handling).
/// One future either way (a `match` over two awaits made it twice the operation's size, and a
/// registration waiting for its socket to listen holds it all along).
pub fn in_context<F: std::future::Future>(
    context: Option<opentelemetry::Context>,
    operation: F,
) -> futures::future::Either<opentelemetry::trace::WithContext<F>, F> {
    use futures::future::Either;
    use opentelemetry::trace::FutureExt as _;
    match context {
        Some(context) => Either::Left(operation.with_context(context)),
        None => Either::Right(operation),
    }
}

/// Writes `value` as the operation span's field `key` (the log's), and on its trace.
pub fn record(span: &tracing::Span, key: &'static str, value: &str) {
    span.record(key, value);
    if let Some(operation) = OperationTrace::current() {
        operation.record(key, value.to_string());
    }
}

/// [`record`] for a number.
pub fn record_number(span: &tracing::Span, key: &'static str, value: i64) {
    span.record(key, value);
    if let Some(operation) = OperationTrace::current() {
        operation.record(key, value);
    }
}

/// Ends the operation's trace, `failed` after `took`: the tail rule's mark (on the log's span
/// too), and its spans built if its trace is exported. Says whether the tail rule kept it.
fn mark_tail(span: &tracing::Span, failed: bool, took: Duration) -> bool {
    let reason = sampling::tail_reason(failed, took);
    if let Some(reason) = reason {
        span.record(sampling::TAIL_FIELD, reason);
    }
    if let Some(operation) = OperationTrace::current() {
        operation.finish(reason, failed);
    }
    reason.is_some()
}

/// Records a finished registration attempt: operation outcome, latency since the socket's
/// discovery (its kernel event when timestamped), and the outcome on the `register` span;
/// `took` is the operation's own time, for the tail rule. The span's trace ends with
/// [`RegisterEnded::finish`], once what the outcome changed is recorded and the socket's reason
/// (its verdict) is known.
pub fn register_ended(
    telemetry: &Telemetry,
    source: &'static str,
    desired: &DesiredPlugin,
    result: &Result<RegisteredPlugin, RegisterFailure>,
    took: Duration,
) -> RegisterEnded {
    let outcome = result
        .as_ref()
        .map_or_else(RegisterFailure::outcome, |_| "success");
    let metrics = &telemetry.metrics;
    metrics.operation("register", outcome);
    let span = tracing::Span::current();
    record(&span, "outcome", outcome);
    if let Err(error) = result {
        record(&span, "error", &error.to_string());
    }
    // A socket waiting to listen is not a failure, and its attempt not the registration.
    let waiting = matches!(outcome, "waiting_to_listen" | "waiting_for_kubelet");
    let failed = result.is_err() && !waiting;
    let kept = sampling::tail_reason(failed, took).is_some();
    // A socket that vanished mid-attempt is not a registration that failed: no latency.
    if outcome != "socket_gone" && !waiting {
        let latency = desired
            .kernel_ns
            .map(|ns| Duration::from_nanos(monotonic_now_ns().saturating_sub(ns)))
            .or_else(|| desired.seen_at.elapsed().ok())
            .unwrap_or_default();
        metrics.registration(source, result.is_ok(), latency, exemplar(kept));
    }
    RegisterEnded { failed, took }
}

/// A registration whose trace is still open (see [`register_ended`]).
#[must_use]
pub struct RegisterEnded {
    failed: bool,
    took: Duration,
}

/// The span field (and trace attribute) that carries the socket's reason; a failed operation's
/// span status says it too.
pub const REASON_FIELD: &str = "plugin_agent.reason";

impl RegisterEnded {
    /// Ends the operation's trace with the socket's `reason` (its verdict, `state::verdict`).
    pub fn finish(self, reason: Option<&'static str>) {
        let span = tracing::Span::current();
        if let Some(reason) = reason {
            record(&span, REASON_FIELD, reason);
        }
        mark_tail(&span, self.failed, self.took);
    }
}

/// Records, when `socket` at `path` was deregistered for being unserved, the time from
/// learning its server was gone to the end of its DeRegister.
pub fn unserved_deregistered(
    telemetry: &Telemetry,
    backoff: &BackoffTable,
    path: &std::path::Path,
    socket: crate::state::SocketId,
) {
    let Some(backoff) = backoff.get(path, socket) else {
        return;
    };
    if let FailureKind::Unserved { learned_by, since } = backoff.kind {
        telemetry
            .metrics
            .unserved_deregistered(learned_by, since.elapsed(), exemplar(false));
    }
}

/// Records a finished deregistration (started at `started`) on the metrics and the
/// `deregister` span.
pub fn deregister_ended(
    telemetry: &Telemetry,
    outcome: &'static str,
    error: Option<&str>,
    started: Instant,
) {
    let took = started.elapsed();
    telemetry.metrics.operation("deregister", outcome);
    let span = tracing::Span::current();
    record(&span, "outcome", outcome);
    if let Some(error) = error {
        record(&span, "error", error);
    }
    let kept = mark_tail(&span, error.is_some(), took);
    telemetry
        .metrics
        .deregistration(outcome, took, exemplar(kept));
}

/// Puts a socket's provenance on the operation's span, named by OpenTelemetry's semantic
/// conventions: `process.*`, `container.id` and `k8s.pod.uid` describe the server (the process
/// the plugin is); the creator, which the conventions have no name for, is
/// `plugin_agent.creator.*`.
pub fn record_provenance(span: &tracing::Span, provenance: &Provenance) {
    if let Some(server) = provenance.server.as_deref() {
        record_process(span, &SERVER_KEYS, server);
        if let Some(cgroup) = server.cgroup.as_deref() {
            if let Some(id) = &cgroup.container_id {
                record(span, "container.id", id);
            }
            if let Some(uid) = &cgroup.pod_uid {
                record(span, "k8s.pod.uid", uid);
            }
        }
    }
    match provenance.creator.process() {
        Some(creator) => record_process(span, &CREATOR_KEYS, creator),
        None => {
            let why = provenance.creator.unknown_because().unwrap_or_default();
            record(span, "plugin_agent.creator.unknown", why);
        }
    }
}

/// The span fields one process is recorded under.
struct ProcessKeys {
    pid: &'static str,
    command: &'static str,
    uid: &'static str,
    cgroup: &'static str,
}

const SERVER_KEYS: ProcessKeys = ProcessKeys {
    pid: "process.pid",
    command: "process.executable.name",
    uid: "process.user.id",
    cgroup: "process.linux.cgroup",
};

const CREATOR_KEYS: ProcessKeys = ProcessKeys {
    pid: "plugin_agent.creator.pid",
    command: "plugin_agent.creator.executable.name",
    uid: "plugin_agent.creator.user.id",
    cgroup: "plugin_agent.creator.linux.cgroup",
};

fn record_process(span: &tracing::Span, keys: &ProcessKeys, process: &crate::provenance::Process) {
    if let Some(pid) = process.pid {
        record_number(span, keys.pid, i64::from(pid));
    }
    if let Some(command) = &process.command {
        record(span, keys.command, command);
    }
    if let Some(uid) = process.uid {
        record_number(span, keys.uid, i64::from(uid));
    }
    if let Some(path) = process.cgroup_path() {
        record(span, keys.cgroup, path);
    }
}

/// A registration's server and creator, for its log line.
pub fn describe(provenance: Option<&Provenance>) -> (String, String) {
    let Some(provenance) = provenance else {
        return ("unknown".into(), "unknown".into());
    };
    let server = provenance
        .server
        .as_deref()
        .map_or_else(|| "unknown".into(), ToString::to_string);
    let creator = match provenance.creator.process() {
        Some(creator) => creator.to_string(),
        None => format!(
            "unknown: {}",
            provenance.creator.unknown_because().unwrap_or_default()
        ),
    };
    (server, creator)
}
