//! The steps of a plugin call (dial, `GetInfo`, Notify), timed for whoever asked: the executor
//! records them as metrics with their span as exemplar, so this room imports no telemetry.

use std::sync::Arc;
use std::time::Duration;

/// A step of a plugin call, timed for whoever asked ([`StepTimer`]): each is its span's duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Connecting, including the wait for a bound socket to listen (the `dial` span).
    Dial,
    /// The `GetInfo` call (its span).
    GetInfo,
    /// A `NotifyRegistrationStatus` call (a broken connection's re-dial asks again: a second
    /// call).
    Notify,
}

impl Step {
    /// The `call` label of the step's latency metric.
    pub fn label(self) -> &'static str {
        match self {
            Step::Dial => "dial",
            Step::GetInfo => "get_info",
            Step::Notify => "notify",
        }
    }

    /// The name of the step's span.
    pub fn span_name(self) -> &'static str {
        match self {
            Step::Dial => "dial",
            Step::GetInfo => "GetInfo",
            Step::Notify => "NotifyRegistrationStatus",
        }
    }
}

/// Told how long each step of a connection's calls took and whether it succeeded, while the
/// step's span is current (the executor records the step with that span as its exemplar; this
/// room imports no telemetry). The default times nothing.
#[derive(Clone, Default)]
pub struct StepTimer(Option<Arc<RecordStep>>);

/// What a [`StepTimer`] calls: the step, how long it took, whether it succeeded.
type RecordStep = dyn Fn(Step, Duration, bool) + Send + Sync;

impl StepTimer {
    pub fn new(record: impl Fn(Step, Duration, bool) + Send + Sync + 'static) -> Self {
        StepTimer(Some(Arc::new(record)))
    }

    /// This timer, and `also` told of every step after it (a caller that wants one connection's
    /// steps for itself: the operations record a socket's first successful dial).
    pub fn also(&self, also: impl Fn(Step, Duration, bool) + Send + Sync + 'static) -> Self {
        let first = self.clone();
        StepTimer::new(move |step, took, ok| {
            first.record(step, took, ok);
            also(step, took, ok);
        })
    }

    pub(super) fn record(&self, step: Step, took: Duration, ok: bool) {
        if let Some(record) = &self.0 {
            record(step, took, ok);
        }
    }
}

impl std::fmt::Debug for StepTimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StepTimer").field(&self.0.is_some()).finish()
    }
}
