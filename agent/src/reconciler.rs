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
use crate::state::{PathHasher, PathKey};
use indexmap::IndexSet;
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
        // One wait for the cancellation, kept across wake-ups (a new one registered itself
        // with the token and left it again on every wake-up, thousands a second in a burst).
        let cancelled = cancel.cancelled();
        tokio::pin!(cancelled);
        loop {
            tokio::select! {
                () = &mut cancelled => return,
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
        match work {
            Work::Everything => {
                // In the order the sockets were found, as marked paths are (see `state::queue`).
                // The tables' own paths, shared: a pass over 100,000 sockets copied every entry
                // of both tables (~100 MB at once) to put paths in order.
                let mut desired = self.desired.paths_seen();
                desired.sort_by_key(|(_, seen)| *seen);
                let mut all: IndexSet<PathKey<Arc<Path>>, PathHasher> =
                    desired.into_iter().map(|(path, _)| PathKey(path)).collect();
                all.extend(self.actual.paths().into_iter().map(PathKey));
                trace!(paths = all.len(), "reconciling");
                for path in &all {
                    self.reconcile_path(&path.0);
                }
            }
            Work::Paths(paths) => {
                trace!(paths = paths.len(), "reconciling");
                for path in &paths {
                    self.reconcile_path(path);
                }
            }
        }
        self.scheduler.after_pass();
    }

    /// Asks for what `path` needs next (see `state::view::next`). Decided on the entries read
    /// in place (one lookup in each table); an entry is copied only for the operation it needs.
    fn reconcile_path(&self, path: &Path) {
        let registered = self.actual.summary(path);
        let desired = self.desired.instance_of(path);
        let socket = match registered {
            Some(registered) => Some(registered.socket),
            None => desired.map(|(_, socket)| socket),
        };
        let held = socket.is_some_and(|socket| self.scheduler.is_held(path, socket));
        match crate::state::view::next(desired.map(|(generation, _)| generation), registered, held)
        {
            Next::Keep | Next::Hold => {}
            Next::Deregister => {
                if let Some(registered) = self.actual.get(path) {
                    let outcome = self.scheduler.deregister(path, registered);
                    debug!(socket_path = %path.display(), ?outcome, "unregister");
                }
            }
            Next::Register => {
                if let Some(desired) = self.desired.get(path) {
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

#[cfg(test)]
mod against_a_fake_scheduler {
    use super::*;
    use crate::executor::Start;
    use crate::handler::Plugin;
    use crate::handler::accept_all::AcceptAll;
    use crate::state::SocketId;
    use crate::state::actual::RegisteredPlugin;
    use crate::state::desired::DesiredPlugin;
    use std::collections::HashSet;
    use std::path::PathBuf;
    use std::sync::Mutex;
    use tokio::sync::mpsc;
    use uuid::Uuid;

    /// What the reconciler asked.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Asked {
        Register(PathBuf, Uuid),
        Deregister(PathBuf, Uuid),
        Forget(PathBuf),
        AfterPass,
        RecheckUnserved,
    }

    /// Records what it is asked, says a socket is held when its path is in `held`, and starts
    /// nothing.
    struct FakeScheduler {
        asked: mpsc::UnboundedSender<Asked>,
        held: Mutex<HashSet<PathBuf>>,
    }

    impl Scheduler for FakeScheduler {
        fn register(self: &Arc<Self>, path: &Path, desired: DesiredPlugin) -> Start {
            let asked = Asked::Register(path.to_path_buf(), desired.generation);
            self.asked.send(asked).expect("test alive");
            Start::Started
        }

        fn deregister(self: &Arc<Self>, path: &Path, registered: RegisteredPlugin) -> Start {
            let asked = Asked::Deregister(path.to_path_buf(), registered.generation);
            self.asked.send(asked).expect("test alive");
            Start::Started
        }

        fn is_held(&self, path: &Path, _socket: SocketId) -> bool {
            self.held.lock().expect("held").contains(path)
        }

        fn forget(&self, path: &Path) {
            let asked = Asked::Forget(path.to_path_buf());
            self.asked.send(asked).expect("test alive");
        }

        fn after_pass(&self) {
            self.asked.send(Asked::AfterPass).expect("test alive");
        }

        fn recheck_unserved(self: &Arc<Self>, _safety: &Arc<SafetyPass>) {
            self.asked.send(Asked::RecheckUnserved).expect("test alive");
        }
    }

    struct Harness {
        desired: Arc<DesiredState>,
        actual: Arc<ActualState>,
        queue: Arc<ReconcileQueue>,
        scheduler: Arc<FakeScheduler>,
        asked: mpsc::UnboundedReceiver<Asked>,
        safety_period: Duration,
    }

    impl Harness {
        fn new(safety_period: Duration) -> Self {
            let (tx, asked) = mpsc::unbounded_channel();
            Harness {
                desired: Arc::default(),
                actual: Arc::default(),
                queue: Arc::default(),
                scheduler: Arc::new(FakeScheduler {
                    asked: tx,
                    held: Mutex::default(),
                }),
                asked,
                safety_period,
            }
        }

        fn reconciler(&self) -> Reconciler<FakeScheduler> {
            Reconciler::new(
                self.desired.clone(),
                self.actual.clone(),
                self.scheduler.clone(),
                self.queue.clone(),
                ReconcileMode::Event,
                self.safety_period,
                Arc::default(),
            )
        }

        /// A socket desired at `name`; its generation.
        fn desire(&self, name: &str, ino: u64) -> Uuid {
            let path = path(name);
            let socket = SocketId {
                dev: 1,
                ino,
                birth_ns: None,
                handle: None,
            };
            self.desired
                .add_or_update(&path, socket, None)
                .expect("desired");
            self.desired.get(&path).expect("desired").generation
        }

        /// Registered at `name` from the socket desired there now (or, if none, a gone one).
        fn register(&self, name: &str, interrupted: bool) -> Uuid {
            let path = path(name);
            let desired = self.desired.get(&path);
            let plugin = Plugin {
                plugin_type: "CSIPlugin".into(),
                name: name.into(),
                endpoint: String::new(),
                supported_versions: Vec::new(),
                socket_path: path.display().to_string(),
            };
            let mut entry = self.actual.add(
                Arc::from(path.as_path()),
                desired.as_ref().map_or_else(Uuid::new_v4, |d| d.generation),
                desired.map_or(
                    SocketId {
                        dev: 1,
                        ino: 999,
                        birth_ns: None,
                        handle: None,
                    },
                    |d| d.socket,
                ),
                plugin,
                Arc::new(AcceptAll),
                crate::provenance::Provenance::default(),
            );
            entry.interrupted = interrupted;
            self.actual
                .restore(Arc::from(path.as_path()), entry)
                .generation
        }

        fn asked(&mut self) -> Vec<Asked> {
            let mut asked = Vec::new();
            while let Ok(one) = self.asked.try_recv() {
                asked.push(one);
            }
            asked
        }
    }

    fn path(name: &str) -> PathBuf {
        PathBuf::from(format!("/plugins/{name}.sock"))
    }

    /// Every row of `state::view::next`, as the reconciler acts on it, in one pass: re-created,
    /// gone and held registrations are deregistered, new and interrupted ones registered, and a
    /// current registration, a held unregistered socket and an unknown path ask for nothing
    /// but their forgetting.
    #[test]
    fn a_pass_asks_for_what_each_path_needs_and_nothing_else() {
        let mut h = Harness::new(Duration::from_secs(30));
        let new = h.desire("new", 1);
        let current = h.desire("current", 2);
        h.register("current", false);
        let old = h.register("recreated", false);
        let recreated = h.desire("recreated", 3);
        assert_ne!(old, recreated);
        let gone = h.register("gone", false);
        let interrupted = h.desire("interrupted", 4);
        h.register("interrupted", true);
        h.desire("dead", 5);
        let unserved = h.desire("unserved", 6);
        h.register("unserved", false);
        for held in ["dead", "unserved"] {
            h.scheduler.held.lock().expect("held").insert(path(held));
        }
        let paths = [
            "new",
            "current",
            "recreated",
            "gone",
            "interrupted",
            "dead",
            "unserved",
            "unknown",
        ];
        let work = Work::Paths(paths.iter().map(|name| path(name)).collect());
        h.reconciler().reconcile(work);
        assert_eq!(
            h.asked(),
            [
                Asked::Register(path("new"), new),
                Asked::Deregister(path("recreated"), old),
                Asked::Deregister(path("gone"), gone),
                Asked::Register(path("interrupted"), interrupted),
                Asked::Deregister(path("unserved"), unserved),
                Asked::Forget(path("unknown")),
                Asked::AfterPass,
            ]
        );
        let _ = current;
    }

    /// A pass over everything takes desired sockets in the order they were found, then the
    /// registrations no longer desired.
    #[test]
    fn a_pass_over_everything_goes_in_discovery_order() {
        let mut h = Harness::new(Duration::from_secs(30));
        let gone = h.register("z-gone", false);
        let first = h.desire("b-first", 1);
        let second = h.desire("a-second", 2);
        h.reconciler().reconcile(Work::Everything);
        assert_eq!(
            h.asked(),
            [
                Asked::Register(path("b-first"), first),
                Asked::Register(path("a-second"), second),
                Asked::Deregister(path("z-gone"), gone),
                Asked::AfterPass,
            ]
        );
    }

    /// The running reconciler wakes on a marked path (no polling), and the safety pass asks
    /// for the unserved sockets' look and for everything.
    #[tokio::test(start_paused = true)]
    async fn a_marked_path_wakes_it_and_the_safety_pass_looks_at_everything() {
        let mut h = Harness::new(Duration::from_secs(30));
        let cancel = CancellationToken::new();
        let running = tokio::spawn(h.reconciler().run(cancel.clone()));
        let generation = h.desire("new", 1);
        h.queue.mark(path("new"));
        assert_eq!(
            h.asked.recv().await,
            Some(Asked::Register(path("new"), generation))
        );
        assert_eq!(h.asked.recv().await, Some(Asked::AfterPass));
        // Quiet for the safety period: the pass runs (the paused clock jumps to it).
        assert_eq!(h.asked.recv().await, Some(Asked::RecheckUnserved));
        assert_eq!(
            h.asked.recv().await,
            Some(Asked::Register(path("new"), generation)),
            "the pass looks at every desired socket"
        );
        cancel.cancel();
        running.await.expect("reconciler");
    }
}
