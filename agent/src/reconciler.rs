//! Reconciler: closes the gap between desired and actual state, woken by every change.
//!
//! Kubelet's reconciler wakes every second and walks both caches, which is where its ~1 s
//! registration latency comes from. Here the watcher, the executor (operation finished, backoff
//! expired) and the handler registry mark the paths that changed in a [`ReconcileQueue`], and the
//! reconciler looks at just those, at once. A slow pass over everything is the safety net, and
//! also asks the watcher to re-walk the tree: it runs once nothing has changed for the safety
//! period (default 30 s), and at the latest twice that long after the previous one. A walk while
//! the tree is busy finds what the events are delivering anyway, and costs the CPU they need; a
//! walk of a settled tree compares the tree with settled state, so a difference it finds is one
//! the events missed. An agent that has just finished a burst therefore does not wake for it in
//! the next seconds (a fixed period from start-up walked wherever in the quiet the phase put it),
//! and an idle node is walked every period as before.
//!
//! Per path, what to do is `state::view::next`'s, the rule the views' states are derived from
//! too: unregistrations come first (a registered plugin whose socket is no longer desired, is
//! desired with a different generation (socket re-created), or is no longer served
//! (`liveness`) or refused (`policy`), is deregistered); the registration of the new socket
//! follows when that operation has finished (the executor allows one operation per path, and
//! marks the path again when it ends). Operations are asked of a [`Scheduler`]: the executor,
//! or in tests a fake that records what it was asked.

use crate::executor::Scheduler;
use crate::state::actual::ActualState;
use crate::state::desired::DesiredState;
use crate::state::queue::{ReconcileQueue, Work};
use crate::state::safety_pass::SafetyPass;
use crate::state::view::Next;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
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
pub struct Reconciler<S: Scheduler> {
    desired: Arc<DesiredState>,
    actual: Arc<ActualState>,
    scheduler: Arc<S>,
    queue: Arc<ReconcileQueue>,
    mode: ReconcileMode,
    safety_period: Duration,
    safety: Arc<SafetyPass>,
}

impl<S: Scheduler> Reconciler<S> {
    /// - `desired`, `actual`: the caches compared;
    /// - `scheduler`: runs the operations (one per path, with backoff);
    /// - `queue`: the marked paths, and the wake-up;
    /// - `mode`, `safety_period`: event-driven with a full pass every `safety_period`, or kubelet's
    ///   1 s polling loop;
    /// - `safety`: where each safety pass asks the watcher for a full re-walk, and learns what
    ///   the last pass cost (see `state::safety_pass`).
    pub fn new(
        desired: Arc<DesiredState>,
        actual: Arc<ActualState>,
        scheduler: Arc<S>,
        queue: Arc<ReconcileQueue>,
        mode: ReconcileMode,
        safety_period: Duration,
        safety: Arc<SafetyPass>,
    ) -> Self {
        Reconciler {
            desired,
            actual,
            scheduler,
            queue,
            mode,
            safety_period,
            safety,
        }
    }

    /// Runs until `cancel` fires.
    pub async fn run(self, cancel: CancellationToken) {
        match self.mode {
            ReconcileMode::Event => self.run_on_changes(cancel).await,
            ReconcileMode::Polling => self.run_polling(cancel).await,
        }
    }

    /// Woken by every change; the safety pass follows [`SafetySchedule`].
    async fn run_on_changes(self, cancel: CancellationToken) {
        let mut schedule = SafetySchedule::new(self.safety_period, Instant::now());
        let pass = tokio::time::sleep_until(schedule.due());
        tokio::pin!(pass);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.queue.changed() => {}
                _ = &mut pass => {
                    let now = Instant::now();
                    schedule.passed(now, self.safety.spacing(self.safety_period));
                    pass.set(tokio::time::sleep_until(schedule.due()));
                    self.queue.mark_all();
                    self.scheduler.recheck_unserved(&self.safety);
                    self.safety.request();
                }
            }
            if let Some(work) = self.queue.take() {
                // The pass's own `mark_all` is not a change; what it finds comes back as paths.
                if matches!(work, Work::Paths(_)) && schedule.changed(Instant::now()) {
                    // A new timer, not `reset`: tokio moves a deadline later lazily, leaving the
                    // entry at the old time, and the runtime wakes there for nothing (in the
                    // quiet after a burst, which is what this schedule is for).
                    pass.set(tokio::time::sleep_until(schedule.due()));
                }
                self.reconcile(work);
            }
        }
    }

    /// Kubelet's loop: a full pass every second, deaf to wake-ups.
    async fn run_polling(self, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(KUBELET_LOOP_PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await; // the first tick is immediate
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => self.queue.mark_all(),
            }
            if let Some(work) = self.queue.take() {
                self.reconcile(work);
            }
        }
    }

    /// One pass over `work`: unregister what is no longer desired (or re-created), then register
    /// what is desired and not registered. Never blocks: operations run in the executor.
    pub fn reconcile(&self, work: Work) {
        let paths: Vec<Arc<Path>> = match work {
            Work::Everything => {
                // In the order the sockets were found, as marked paths are (see `state::queue`).
                // The tables' own paths, shared: a pass over 100,000 sockets copied every entry
                // of both tables (~100 MB at once) to put paths in order.
                let mut desired = self.desired.paths_seen();
                desired.sort_by_key(|(_, seen)| *seen);
                let mut all: indexmap::IndexSet<Arc<Path>> =
                    desired.into_iter().map(|(p, _)| p).collect();
                all.extend(self.actual.paths());
                all.into_iter().collect()
            }
            Work::Paths(paths) => paths.into_iter().map(Arc::from).collect(),
        };
        trace!(paths = paths.len(), "reconciling");
        for path in paths {
            self.reconcile_path(&path);
        }
        self.scheduler.after_pass();
    }

    /// Asks for what `path` needs next (see `state::view::next`).
    fn reconcile_path(&self, path: &Path) {
        let registered = self.actual.get(path);
        let socket = match &registered {
            Some(registered) => Some(registered.socket),
            None => self.desired.socket_of(path),
        };
        let held = socket.is_some_and(|socket| self.scheduler.is_held(path, socket));
        // Held and not registered: nothing to do until the socket changes, decided without
        // copying its entry (most of a tree of dead sockets).
        let desired = match registered.is_none() && held {
            true => None,
            false => self.desired.get(path),
        };
        match crate::state::view::next(
            desired.as_ref().map(|d| d.generation),
            registered.as_ref(),
            held,
        ) {
            Next::Keep | Next::Hold => {}
            Next::Deregister => {
                if let Some(registered) = registered {
                    let outcome = self.scheduler.deregister(path, registered);
                    debug!(socket_path = %path.display(), ?outcome, "unregister");
                }
            }
            Next::Register => {
                if let Some(desired) = desired {
                    let outcome = self.scheduler.register(path, desired);
                    debug!(socket_path = %path.display(), ?outcome, "register");
                }
            }
            Next::Forget => self.scheduler.forget(path),
        }
    }
}

/// When the safety pass is due: `period` after the last change, and not before `spacing` after
/// the previous pass (the period, or longer when passes are costly: see `state::safety_pass`),
/// and never later than `2 × spacing` after it, so that a tree that never settles is still
/// walked.
#[derive(Debug)]
struct SafetySchedule {
    period: Duration,
    spacing: Duration,
    last_pass: Instant,
    due: Instant,
}

impl SafetySchedule {
    /// How much later a change must push the pass before the timer is moved: a busy reconciler
    /// (thousands of wake-ups a second in a burst) moves it about once a second, and the pass
    /// may run up to this much before `period` of quiet has passed.
    const SLACK: Duration = Duration::from_secs(1);

    /// The start-up walk counts as the first pass.
    fn new(period: Duration, started: Instant) -> Self {
        SafetySchedule {
            period,
            spacing: period,
            last_pass: started,
            due: started + period,
        }
    }

    fn due(&self) -> Instant {
        self.due
    }

    /// A pass ran at `now`; the next is `spacing` later (at least the period).
    fn passed(&mut self, now: Instant, spacing: Duration) {
        self.spacing = spacing.max(self.period);
        self.last_pass = now;
        self.due = now + self.spacing;
    }

    /// Something changed at `now`; true if the due time moved.
    fn changed(&mut self, now: Instant) -> bool {
        let wanted = (now + self.period)
            .max(self.last_pass + self.spacing)
            .min(self.last_pass + 2 * self.spacing);
        if wanted < self.due + Self::SLACK {
            return false;
        }
        self.due = wanted;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_secs(30);

    #[test]
    fn a_quiet_tree_is_walked_every_period() {
        let start = Instant::now();
        let mut schedule = SafetySchedule::new(PERIOD, start);
        assert_eq!(schedule.due(), start + PERIOD);
        schedule.passed(start + PERIOD, PERIOD);
        assert_eq!(schedule.due(), start + 2 * PERIOD);
    }

    #[test]
    fn a_costly_pass_spaces_the_next_and_changes_do_not_bring_it_closer() {
        let start = Instant::now();
        let mut schedule = SafetySchedule::new(PERIOD, start);
        schedule.passed(start + PERIOD, 10 * PERIOD);
        assert_eq!(schedule.due(), start + 11 * PERIOD);
        // A change long after the pass: a period of quiet is not enough, the spacing holds.
        schedule.changed(start + 2 * PERIOD);
        assert_eq!(schedule.due(), start + 11 * PERIOD);
        // Changes until just before it: the pass waits for quiet, at most twice the spacing.
        let mut now = start + 10 * PERIOD;
        while now < start + 30 * PERIOD {
            schedule.changed(now);
            now += Duration::from_secs(1);
        }
        assert_eq!(schedule.due(), start + 21 * PERIOD);
    }

    #[test]
    fn the_pass_waits_for_a_period_of_quiet_after_the_last_change() {
        let start = Instant::now();
        let mut schedule = SafetySchedule::new(PERIOD, start);
        // A burst from 20 s to 27 s: the pass that was due at 30 s waits until 57 s.
        for ms in (20_000..=27_000).step_by(10) {
            schedule.changed(start + Duration::from_millis(ms));
        }
        let due = schedule.due();
        assert!(
            due > start + Duration::from_secs(56) && due <= start + Duration::from_secs(57),
            "due {:?} after start",
            due - start
        );
    }

    #[test]
    fn a_tree_that_never_settles_is_walked_every_two_periods() {
        let start = Instant::now();
        let mut schedule = SafetySchedule::new(PERIOD, start);
        let mut now = start;
        let mut passes = Vec::new();
        while now < start + 5 * PERIOD {
            if now >= schedule.due() {
                schedule.passed(now, PERIOD);
                passes.push(now - start);
            }
            schedule.changed(now);
            now += Duration::from_millis(100);
        }
        assert_eq!(
            passes,
            [2 * PERIOD, 4 * PERIOD],
            "passes under constant change"
        );
    }

    #[test]
    fn changes_move_the_timer_about_once_a_second() {
        let start = Instant::now();
        let mut schedule = SafetySchedule::new(PERIOD, start);
        // A change every millisecond for 10 s.
        let moves = (0..=10_000)
            .filter(|ms| schedule.changed(start + Duration::from_millis(*ms)))
            .count();
        assert_eq!(moves, 10, "timer moves in 10 s of changes");
    }
}
