//! Reconciler: closes the gap between desired and actual state, woken by every change.
//!
//! Kubelet's reconciler wakes every second and walks both caches, which is where its ~1 s
//! registration latency comes from. Here the watcher, the executor (operation finished, backoff
//! expired) and the handler registry mark the paths that changed in a [`ReconcileQueue`], and the
//! reconciler looks at just those, at once. A slow periodic pass over everything (default 30 s) is
//! the safety net, and also asks the watcher to re-walk the tree.
//!
//! Per path, unregistrations come first: a registered plugin whose socket is no longer desired, is
//! desired with a different generation (socket re-created), or is no longer served (`liveness`),
//! is deregistered; the registration
//! of the new socket follows when that operation has finished (the executor allows one operation
//! per path, and marks the path again when it ends).

use crate::executor::OperationExecutor;
use crate::state::actual::ActualState;
use crate::state::desired::DesiredState;
use crate::state::queue::{ReconcileQueue, Work};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, trace};

/// How the reconciler is driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReconcileMode {
    /// Woken by every change (the default).
    Event,
    /// Kubelet's behaviour: a full pass every second, deaf to wake-ups. For side-by-side benchmarks.
    Polling,
}

/// Kubelet's reconciler period, used by [`ReconcileMode::Polling`].
pub const KUBELET_LOOP_PERIOD: Duration = Duration::from_secs(1);

/// See the module docs.
pub struct Reconciler {
    desired: Arc<DesiredState>,
    actual: Arc<ActualState>,
    executor: Arc<OperationExecutor>,
    queue: Arc<ReconcileQueue>,
    mode: ReconcileMode,
    safety_period: Duration,
    rescan: Option<Arc<Notify>>,
}

impl Reconciler {
    /// - `desired`, `actual`: the caches compared;
    /// - `executor`: runs the operations (one per path, with backoff);
    /// - `queue`: the marked paths, and the wake-up;
    /// - `mode`, `safety_period`: event-driven with a full pass every `safety_period`, or kubelet's
    ///   1 s polling loop;
    /// - `rescan`: where to ask the watcher for a full re-walk on each safety pass (none in tests).
    pub fn new(
        desired: Arc<DesiredState>,
        actual: Arc<ActualState>,
        executor: Arc<OperationExecutor>,
        queue: Arc<ReconcileQueue>,
        mode: ReconcileMode,
        safety_period: Duration,
        rescan: Option<Arc<Notify>>,
    ) -> Self {
        Reconciler {
            desired,
            actual,
            executor,
            queue,
            mode,
            safety_period,
            rescan,
        }
    }

    /// Runs until `cancel` fires.
    pub async fn run(self, cancel: CancellationToken) {
        let period = match self.mode {
            ReconcileMode::Event => self.safety_period,
            ReconcileMode::Polling => KUBELET_LOOP_PERIOD,
        };
        let mut safety = tokio::time::interval(period);
        safety.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        safety.tick().await; // the first tick is immediate
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.queue.changed(), if self.mode == ReconcileMode::Event => {}
                _ = safety.tick() => {
                    self.queue.mark_all();
                    if self.mode == ReconcileMode::Event {
                        self.executor.recheck_unserved();
                    }
                    if self.mode == ReconcileMode::Event
                        && let Some(rescan) = &self.rescan
                    {
                        // A stored permit: the request survives a watcher that is busy now.
                        rescan.notify_one();
                    }
                }
            }
            if let Some(work) = self.queue.take() {
                self.reconcile(work);
            }
        }
    }

    /// One pass over `work`: unregister what is no longer desired (or re-created), then register
    /// what is desired and not registered. Never blocks: operations run in the executor.
    pub fn reconcile(&self, work: Work) {
        let paths: Vec<PathBuf> = match work {
            Work::Everything => {
                // In the order the sockets were found, as marked paths are (see `state::queue`).
                let mut desired = self.desired.snapshot();
                desired.sort_by_key(|(_, d)| d.seen_at);
                let mut all: indexmap::IndexSet<PathBuf> =
                    desired.into_iter().map(|(p, _)| p).collect();
                all.extend(self.actual.snapshot().into_iter().map(|(p, _)| p));
                all.into_iter().collect()
            }
            Work::Paths(paths) => paths.into_iter().collect(),
        };
        trace!(paths = paths.len(), "reconciling");
        for path in paths {
            let desired = self.desired.get(&path);
            let registered = self.actual.get(&path);
            if let Some(registered) = registered {
                let superseded =
                    desired.as_ref().map(|d| d.generation) != Some(registered.generation);
                if superseded || self.executor.is_held(&path, registered.socket) {
                    let outcome = self.executor.deregister(&path, registered);
                    debug!(socket_path = %path.display(), ?outcome, "unregister");
                    continue;
                }
                // A registration the previous agent began and did not finish is run again.
                if !registered.interrupted {
                    continue;
                }
            }
            match desired {
                Some(desired) => {
                    let outcome = self.executor.register(&path, desired);
                    debug!(socket_path = %path.display(), ?outcome, "register");
                }
                None => self.executor.forget(&path),
            }
        }
        self.executor.after_pass();
    }
}
