//! Operation executor: schedules registrations and deregistrations, one at a time per socket
//! path; the steps of each are the runner's (the `operations` room), behind [`OperationRunner`].
//!
//! ```text
//! reconciler --Scheduler--> executor: backoff? claim the path, wait for a slot
//!                                      --OperationRunner--> operations: the steps
//!                           <-- Ended: done, held, retry at, wait to listen (timers: `waits`)
//! ```
//!
//! Guarantees: never two operations for one socket path at once (the second is refused with
//! [`Start::AlreadyRunning`], as kubelet's `IsAlreadyExists`); at most `max_concurrent`
//! operations in total, so a storm of broken plugins queues rather than exhausting the agent, a
//! quarter of them dialling plugins (see [`Slot::dialling`]), and at most four registrations
//! per slot wait for one as tasks, the rest of a burst as listed paths (see
//! [`slots::Backlog`]). Every plugin and handler call has a deadline (the runner's), so a hung
//! plugin or handler holds one slot for a bounded time and never blocks other plugins.
//!
//! Every finished operation, and every backoff expiry, marks its path in the [`ReconcileQueue`],
//! which wakes the reconciler: no polling.
//!
//! The room, as kubelet splits its `operationexecutor` (the runner is its operation generator):
//! - this file: whether an operation may start (claims, backoff), the concurrency limit, and
//!   what happens when one ends ([`Ended`]: release, the retry timer);
//! - [`claims`]: the one-operation-per-path map (kubelet's `nestedpendingoperations`);
//! - [`slots`]: the concurrency limit, its lanes, the dial permits and the backlog;
//! - [`waits`]: one timer per path, and the looks at sockets not listening yet;
//! - [`runner`]: the seam to the operations ([`OperationRunner`], [`Registration`], [`Ended`]).
//!
//! It imports the state room (backoff table, reconcile queue), `liveness` (its reports, and the
//! unserved bookkeeping), the handler registry (a new handler releases what waited for it) and
//! telemetry; nothing imports it but the reconciler, the operations and the assembly (`agent`).

mod claims;
mod runner;
pub mod slots;
mod waits;

use crate::handler::HandlerRegistry;
use crate::liveness::{Liveness, Unserved};
use crate::mode::Mode;
use crate::registration::Timeouts;
use crate::state::SocketId;
use crate::state::actual::RegisteredPlugin;
use crate::state::backoff::{BackoffTable, ListenReleased};
use crate::state::desired::{DesiredPlugin, DesiredState};
use crate::state::queue::ReconcileQueue;
use crate::state::safety_pass::SafetyPass;
use crate::telemetry::Telemetry;
use claims::Claims;
pub use claims::OperationKind;
pub use runner::{Ended, Operation, OperationRunner, Registration};
pub use slots::Slot;
use slots::{Backlog, Lane, Slots};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;
use waits::Waits;

/// Deadlines for handler calls.
#[derive(Debug, Clone, Copy)]
pub struct HandlerTimeouts {
    /// `ValidatePlugin` (kubelet's DRA handler allows 45 s).
    pub validate: Duration,
    /// `RegisterPlugin` (45 s).
    pub register: Duration,
    /// `DeRegisterPlugin` (10 s).
    pub deregister: Duration,
}

impl Default for HandlerTimeouts {
    fn default() -> Self {
        HandlerTimeouts {
            validate: Duration::from_secs(45),
            register: Duration::from_secs(45),
            deregister: Duration::from_secs(10),
        }
    }
}

/// Executor settings.
#[derive(Debug, Clone, Copy)]
pub struct ExecutorConfig {
    /// Plugin call deadlines.
    pub plugin_timeouts: Timeouts,
    /// Handler call deadlines.
    pub handler_timeouts: HandlerTimeouts,
    /// Operations running at once, all sockets together.
    pub max_concurrent: usize,
    /// Register (kubelet's job) or only observe (see [`crate::mode`]).
    pub mode: Mode,
    /// Whether the event source reports a socket's `listen` (eBPF): a socket waiting to listen
    /// then waits for that report instead of being looked at again and again.
    pub listens_reported: bool,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            plugin_timeouts: Timeouts::default(),
            handler_timeouts: HandlerTimeouts::default(),
            max_concurrent: 256,
            mode: Mode::Register,
            listens_reported: false,
        }
    }
}

/// Expected outcomes of asking for an operation; none of them is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The operation runs now.
    Started,
    /// An operation for this path is running; the path is looked at again when it ends.
    AlreadyRunning(OperationKind),
    /// The socket failed recently; it is looked at again when the backoff expires.
    BackingOff { until: Instant },
    /// Too many registrations wait for a slot already: the path is looked at again when its
    /// turn comes (see [`slots::Backlog`]).
    Deferred,
}

/// Registrations waiting for a slot, per slot, before further ones wait as a listed path.
const WAITING_PER_SLOT: usize = 4;

/// Slots per dial permit: a quarter of the operations may be dialling a plugin and waiting for
/// its `PluginInfo` at once (see [`Slot::dialling`]).
const SLOTS_PER_DIAL: usize = 4;

/// What the reconciler asks of the executor: the seam that lets it be tested without one.
pub trait Scheduler: Send + Sync + 'static {
    /// Starts registering the plugin at `path` unless an operation for it runs or it backs off.
    fn register(self: &Arc<Self>, path: &Path, desired: DesiredPlugin) -> Start;
    /// Starts deregistering `registered` from `path` unless an operation for it runs.
    fn deregister(self: &Arc<Self>, path: &Path, registered: RegisteredPlugin) -> Start;
    /// Whether nothing serves the socket `socket` at `path`, or the policy refuses it: its
    /// registration is ended, and it is not registered again until it (or the policy) changes.
    fn is_held(&self, path: &Path, socket: SocketId) -> bool;
    /// The socket at `path` left the tree: forget its backoff and its timer.
    fn forget(&self, path: &Path);
    /// The reconciler finished a pass (see [`slots::Backlog::refill`]).
    fn after_pass(&self);
    /// The safety pass is due: look at the unserved sockets again (see
    /// [`Unserved::recheck`]).
    fn recheck_unserved(self: &Arc<Self>, safety: &Arc<SafetyPass>);
}

/// What the executor is built over, besides its runner.
pub struct ExecutorParts {
    /// The backoff table it reads before an operation and its waits write.
    pub backoff: Arc<BackoffTable>,
    /// Desired state, where a look that finds a socket listening records it.
    pub desired: Arc<DesiredState>,
    /// Told about every finished operation and expired backoff, to wake the reconciler.
    pub queue: Arc<ReconcileQueue>,
    /// Reports losses, listens and lost hints to the executor.
    pub liveness: Arc<Liveness>,
    /// The unserved bookkeeping (losses, the safety pass's look).
    pub unserved: Arc<Unserved>,
    /// Adding a handler releases the plugins that were waiting for it (subscribed here).
    pub handlers: Arc<HandlerRegistry>,
    /// Retries and discovery records.
    pub telemetry: Arc<Telemetry>,
}

/// See the module docs.
pub struct OperationExecutor {
    runner: Arc<dyn OperationRunner>,
    backoff: Arc<BackoffTable>,
    queue: Arc<ReconcileQueue>,
    claims: Arc<Claims>,
    slots: Slots,
    backlog: Backlog,
    waits: Arc<Waits>,
    unserved: Arc<Unserved>,
    telemetry: Arc<Telemetry>,
    tasks: TaskTracker,
}

impl OperationExecutor {
    /// Runs `runner`'s operations over `parts` as `config` bounds them; `cancel` stops slots and
    /// timers, and running operations finish (see [`Self::drain`]).
    pub fn new(
        runner: Arc<dyn OperationRunner>,
        parts: ExecutorParts,
        config: &ExecutorConfig,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        let tasks = TaskTracker::new();
        let slots = config.max_concurrent;
        let executor = Arc::new(OperationExecutor {
            runner,
            backoff: parts.backoff.clone(),
            queue: parts.queue.clone(),
            claims: Claims::new(parts.queue.clone()),
            slots: Slots::new(slots, slots.div_ceil(SLOTS_PER_DIAL), cancel.clone()),
            backlog: Backlog::new(slots.saturating_mul(WAITING_PER_SLOT)),
            waits: Waits::new(
                parts.backoff,
                parts.desired,
                parts.queue,
                config.listens_reported,
                tasks.clone(),
                cancel,
            ),
            unserved: parts.unserved,
            telemetry: parts.telemetry,
            tasks,
        });
        executor.listen_to(&parts.liveness, &parts.handlers);
        executor
    }

    /// Subscribes to what ends a wait: `liveness`'s losses, listens and lost hints, and
    /// `handlers`' changes.
    fn listen_to(self: &Arc<Self>, liveness: &Liveness, handlers: &HandlerRegistry) {
        let weak = Arc::downgrade(self);
        liveness.on_loss(move |loss| {
            if let Some(executor) = weak.upgrade()
                && let Some(path) = executor.unserved.lost(loss)
            {
                executor.waits.cancel(&path);
            }
        });
        let weak = Arc::downgrade(self);
        liveness.on_listen(move |path| {
            if let Some(executor) = weak.upgrade() {
                executor.listened(path);
            }
        });
        let weak = Arc::downgrade(self);
        liveness.on_hints_lost(move || {
            if let Some(executor) = weak.upgrade() {
                executor.hints_lost();
            }
        });
        let weak = Arc::downgrade(self);
        handlers.subscribe(move |plugin_type| {
            if let Some(executor) = weak.upgrade() {
                for path in executor.backoff.release_waiting_for(plugin_type) {
                    executor.queue.mark(path);
                }
                // A removed or replaced handler changes nothing registered; a new one may be
                // what a plugin in backoff for another reason needs too, so look at everything.
                executor.queue.mark_all();
            }
        });
    }

    /// The kernel reported a `listen` on `path` (eBPF source).
    fn listened(&self, path: &Path) {
        // A registration dialling a socket that refused (bound, not listening yet) retries on
        // a timer; the kernel's word ends its wait, so it registers within a millisecond of
        // the listen rather than up to 50 ms after it.
        self.claims.listened(path);
        // A listen is reported for every plugin, and almost none has a socket backing off: the
        // socket's identity (a `statx` and a `name_to_handle_at`) is read only when one does. A
        // wait recorded after this look takes the claim's report itself (`wait_to_listen`).
        if self.backoff.is_empty() {
            return;
        }
        // Whatever socket is at the path now is the one that listens.
        let Ok(crate::state::EntryKind::Socket(socket)) = crate::state::EntryKind::of(path) else {
            return;
        };
        match self.backoff.release_on_listen(path, socket) {
            ListenReleased::Nothing => {}
            ListenReleased::Unserved => {
                let reported = crate::liveness::ServedBy::KernelListen;
                self.unserved.served_again(path.to_path_buf(), reported);
            }
            ListenReleased::Waiting => {
                debug!(socket_path = %path.display(), "a socket waiting to listen listens (reported by the kernel)");
                self.queue.mark(path.to_path_buf());
            }
        }
    }

    /// The event source's hints were lost (it rescans): the listens among them too, so every
    /// socket waiting to listen is looked at again now.
    pub fn hints_lost(&self) {
        for path in self.backoff.release_waiting_to_listen() {
            self.queue.mark(path);
        }
    }

    /// A registration of `desired` at `path` may run: it waits for a slot in its lane (as a
    /// small future: the operation's own state is allocated once it may run, so thousands of
    /// sockets queued behind a storm of dead ones cost bytes each, not kilobytes), runs, and
    /// what it ended with is done before its claim is released.
    fn spawn_registration(
        self: &Arc<Self>,
        path: &Path,
        desired: DesiredPlugin,
        lane: Lane,
        claim: claims::InFlight,
        attempt: u32,
    ) {
        let this = self.clone();
        let path = path.to_path_buf();
        self.tasks.spawn(async move {
            // A first attempt of a socket the kernel reported bound: its listen first.
            if attempt == 1 {
                this.waits
                    .until_listen_reported(&desired, claim.listened())
                    .await;
            }
            // Shutdown starts no operation: those still waiting for a slot end here.
            let queued = Instant::now();
            let slot = this.slots.acquire(lane).await;
            this.left_backlog();
            let Some(slot) = slot else {
                return;
            };
            let socket = desired.socket;
            let registration = Registration {
                found: this.waits.take_found(&path, socket),
                slot: slot.waking_on(claim.listened()),
                path,
                desired,
                attempt,
                queued,
            };
            let path = registration.path.clone();
            let ended = this.runner.clone().register(registration).await;
            this.ended(&path, socket, ended);
            drop(claim);
        });
    }

    /// What a registration of `socket` at `path` ended with, done while it still holds the path.
    fn ended(self: &Arc<Self>, path: &Path, socket: SocketId, ended: Ended) {
        match ended {
            Ended::Done => {}
            Ended::Held => self.waits.cancel(path),
            Ended::RetryAt(at) => self.waits.look_again_at(path, at),
            Ended::WaitToListen { until, reason } => {
                let claims = &self.claims;
                self.waits
                    .wait_to_listen(path, socket, until, reason, || claims.listen_reported(path));
            }
        }
    }

    /// A registration stopped waiting for its slot: the next listed path is looked at again.
    fn left_backlog(&self) {
        if let Some(next) = self.backlog.left() {
            self.queue.mark(next);
        }
    }

    /// The backoff table this executor reads and its runner writes, for the views that derive a
    /// plugin's state ([`crate::state::view::StateView`]).
    pub fn backoffs(&self) -> Arc<BackoffTable> {
        self.backoff.clone()
    }

    /// Whether an operation for `path` is running.
    pub fn is_running(&self, path: &Path) -> bool {
        self.claims.is_claimed(path)
    }

    /// Waits for running operations to finish (graceful shutdown); no new ones start after.
    pub async fn drain(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Scheduler for OperationExecutor {
    fn register(self: &Arc<Self>, path: &Path, desired: DesiredPlugin) -> Start {
        let first_contact = desired.first_contact.is_some();
        let now = Instant::now();
        let attempt = match self
            .backoff
            .attempt(path, desired.socket, now, first_contact)
        {
            Ok(attempt) => attempt,
            Err(until) => return Start::BackingOff { until },
        };
        // A socket an event reported goes before the sockets a walk found (see `slots`).
        let lane = if desired.by_event {
            Lane::Prompt
        } else {
            Lane::Scan
        };
        if !self.backlog.admit(path, lane) {
            return Start::Deferred;
        }
        let claim = match self.claims.claim(path, OperationKind::Register) {
            Ok(claim) => claim,
            Err(running) => {
                self.left_backlog();
                return Start::AlreadyRunning(running);
            }
        };
        if attempt > 1 {
            self.telemetry.metrics.retry();
        }
        self.spawn_registration(path, desired, lane, claim, attempt);
        Start::Started
    }

    fn deregister(self: &Arc<Self>, path: &Path, registered: RegisteredPlugin) -> Start {
        let claim = match self.claims.claim(path, OperationKind::Deregister) {
            Ok(claim) => claim,
            Err(running) => return Start::AlreadyRunning(running),
        };
        let this = self.clone();
        let path = path.to_path_buf();
        let requested = Instant::now();
        self.tasks.spawn(async move {
            let _claim = claim;
            // As for a registration: waiting for a slot costs a small future.
            let Some(slot) = this.slots.acquire(Lane::Prompt).await else {
                return;
            };
            this.runner
                .clone()
                .deregister(path, registered, slot, requested)
                .await;
        });
        Start::Started
    }

    fn is_held(&self, path: &Path, socket: SocketId) -> bool {
        self.backoff.is_held(path, socket)
    }

    fn forget(&self, path: &Path) {
        self.backoff.forget_path(path);
        self.waits.forget(path);
        self.telemetry.discovery.forget(path);
    }

    fn after_pass(&self) {
        for next in self.backlog.refill() {
            self.queue.mark(next);
        }
    }

    fn recheck_unserved(self: &Arc<Self>, safety: &Arc<SafetyPass>) {
        if let Some(look) = self.unserved.recheck(safety) {
            self.tasks.spawn(look);
        }
    }
}

#[cfg(test)]
mod tests {
    // The executor against a fake runner: each operation the executor starts tells the test, and
    // ends when the test says how it ended, so ordering, the one operation per path, the slots,
    // backoff timers and their cancellation are checked without a plugin or a handler.

    use super::*;
    use crate::event_source::SourceKind;
    use crate::notifications::NotificationBus;
    use crate::state::actual::ActualState;
    use crate::state::backoff::FailureKind;
    use crate::state::desired::DesiredState;
    use crate::state::queue::Work;
    use std::path::PathBuf;
    use std::sync::Mutex;
    use tokio::sync::{mpsc, oneshot};

    /// An operation the executor started: its path, its kind, and how the test ends it.
    struct Running {
        path: PathBuf,
        kind: OperationKind,
        end: oneshot::Sender<Ended>,
    }

    /// Tells the test of every operation, and waits for the test to end it.
    struct FakeRunner {
        started: mpsc::UnboundedSender<Running>,
        /// Operations running now, and the most at once.
        running: Mutex<(usize, usize)>,
    }

    impl FakeRunner {
        fn operation(self: Arc<Self>, path: PathBuf, kind: OperationKind) -> Operation<Ended> {
            Box::pin(async move {
                {
                    let mut running = self.running.lock().expect("running");
                    running.0 += 1;
                    running.1 = running.1.max(running.0);
                }
                let (end, ended) = oneshot::channel();
                let told = self.started.send(Running { path, kind, end });
                let ended = match told {
                    Ok(()) => ended.await.unwrap_or(Ended::Done),
                    Err(_) => Ended::Done,
                };
                self.running.lock().expect("running").0 -= 1;
                ended
            })
        }
    }

    impl OperationRunner for FakeRunner {
        fn register(self: Arc<Self>, registration: Registration) -> Operation<Ended> {
            // A socket named `waiting*` does not listen yet: its dial pauses (an hour, unless the
            // kernel reports its listen) before the operation goes on.
            let waits = registration
                .path
                .file_name()
                .is_some_and(|name| name.to_string_lossy().starts_with("waiting"));
            let operation = self.operation(registration.path, OperationKind::Register);
            // The slot is held for as long as the operation runs.
            let mut slot = registration.slot;
            Box::pin(async move {
                if waits {
                    crate::registration::Pause::pause(&mut slot, Duration::from_secs(3600)).await;
                }
                let ended = operation.await;
                drop(slot);
                ended
            })
        }

        fn deregister(
            self: Arc<Self>,
            path: PathBuf,
            _registered: RegisteredPlugin,
            slot: Slot,
            _requested: Instant,
        ) -> Operation<()> {
            let operation = self.operation(path, OperationKind::Deregister);
            Box::pin(async move {
                operation.await;
                drop(slot);
            })
        }
    }

    struct Harness {
        executor: Arc<OperationExecutor>,
        liveness: Arc<Liveness>,
        runner: Arc<FakeRunner>,
        started: mpsc::UnboundedReceiver<Running>,
        desired: Arc<DesiredState>,
        actual: Arc<ActualState>,
        backoff: Arc<BackoffTable>,
        queue: Arc<ReconcileQueue>,
        cancel: CancellationToken,
    }

    impl Harness {
        /// An executor of `slots` slots over a fake runner.
        fn new(slots: usize) -> Self {
            let (tx, started) = mpsc::unbounded_channel();
            let runner = Arc::new(FakeRunner {
                started: tx,
                running: Mutex::default(),
            });
            let (actual, backoff, queue) = (Arc::default(), Arc::default(), Arc::default());
            let desired: Arc<DesiredState> = Arc::default();
            let telemetry = Telemetry::new(SourceKind::Ebpf);
            let unserved = Unserved::new(
                Arc::clone(&actual),
                Arc::clone(&backoff),
                Arc::clone(&queue),
                NotificationBus::default(),
                telemetry.clone(),
            );
            let liveness = Arc::new(Liveness::default());
            let parts = ExecutorParts {
                backoff: Arc::clone(&backoff),
                desired: Arc::clone(&desired),
                queue: Arc::clone(&queue),
                liveness: liveness.clone(),
                unserved,
                handlers: Arc::default(),
                telemetry,
            };
            let config = ExecutorConfig {
                max_concurrent: slots,
                listens_reported: true,
                ..ExecutorConfig::default()
            };
            let cancel = CancellationToken::new();
            let executor = OperationExecutor::new(runner.clone(), parts, &config, cancel.clone());
            Harness {
                executor,
                liveness,
                runner,
                started,
                desired,
                actual,
                backoff,
                queue,
                cancel,
            }
        }

        /// The desired entry of a socket found at `name` (by a walk unless `by_event`).
        fn desired(&self, name: &str, by_event: bool) -> DesiredPlugin {
            let path = path(name);
            let socket = crate::state::SocketId {
                dev: 1,
                ino: name.len() as u64 + 100 * u64::from(name.as_bytes()[0]),
                birth_ns: None,
                handle: None,
            };
            self.desired
                .add_observed(&path, socket, None, by_event, None)
                .expect("desired");
            self.desired.get(&path).expect("desired")
        }

        /// A registration of `name` to deregister.
        fn registered(&self, name: &str) -> RegisteredPlugin {
            let desired = self.desired(name, true);
            let plugin = crate::handler::Plugin {
                plugin_type: "CSIPlugin".into(),
                name: name.into(),
                endpoint: String::new(),
                supported_versions: Vec::new(),
                socket_path: path(name).display().to_string(),
            };
            self.actual.add(
                desired.path.clone(),
                desired.generation,
                desired.socket,
                plugin,
                Arc::new(crate::handler::accept_all::AcceptAll),
                crate::provenance::Provenance::default(),
            )
        }

        async fn next(&mut self) -> Running {
            tokio::time::timeout(Duration::from_secs(60), self.started.recv())
                .await
                .expect("an operation started")
                .expect("the executor is alive")
        }

        /// Whether `name` is among the paths marked since the last look.
        fn marked(&self, name: &str) -> bool {
            match self.queue.take() {
                Some(Work::Paths(paths)) => paths.contains(&path(name)),
                Some(Work::Everything) => true,
                None => false,
            }
        }
    }

    fn path(name: &str) -> PathBuf {
        PathBuf::from(format!("/plugins/{name}.sock"))
    }

    /// Lets every task that can run, run (the paused clock does not move).
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn one_operation_per_path_and_the_path_is_looked_at_again_when_it_ends() {
        let mut h = Harness::new(4);
        let desired = h.desired("a", true);
        assert_eq!(
            h.executor.register(&path("a"), desired.clone()),
            Start::Started
        );
        let running = h.next().await;
        assert_eq!(
            (running.path.clone(), running.kind),
            (path("a"), OperationKind::Register)
        );
        assert!(h.executor.is_running(&path("a")));
        assert_eq!(
            h.executor.register(&path("a"), desired.clone()),
            Start::AlreadyRunning(OperationKind::Register),
            "a second registration of the path"
        );
        let registered = h.registered("a");
        assert_eq!(
            h.executor.deregister(&path("a"), registered),
            Start::AlreadyRunning(OperationKind::Register),
            "a deregistration while the registration runs"
        );
        // Another path runs beside it.
        let other = h.desired("b", true);
        assert_eq!(h.executor.register(&path("b"), other), Start::Started);
        assert_eq!(h.next().await.path, path("b"));
        assert!(!h.marked("a"), "marked before its operation ended");
        running.end.send(Ended::Done).expect("running");
        tokio::time::timeout(Duration::from_secs(60), async {
            while h.executor.is_running(&path("a")) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the claim was released");
        assert!(h.marked("a"), "the path was not looked at again");
        assert_eq!(h.executor.register(&path("a"), desired), Start::Started);
        assert_eq!(h.next().await.path, path("a"));
    }

    /// One slot: operations run one after the other, in the order they were asked for, and a
    /// deregistration (prompt lane) waits for the slot too.
    #[tokio::test]
    async fn operations_beyond_the_slots_wait_and_run_in_order() {
        let mut h = Harness::new(1);
        for name in ["a", "b", "c"] {
            let desired = h.desired(name, true);
            assert_eq!(h.executor.register(&path(name), desired), Start::Started);
        }
        let registered = h.registered("d");
        assert_eq!(
            h.executor.deregister(&path("d"), registered),
            Start::Started
        );
        let mut order = Vec::new();
        for _ in 0..4 {
            let running = h.next().await;
            settle().await;
            assert!(h.started.try_recv().is_err(), "two operations in one slot");
            order.push((running.path.clone(), running.kind));
            running.end.send(Ended::Done).expect("running");
        }
        assert_eq!(
            order,
            [
                (path("a"), OperationKind::Register),
                (path("b"), OperationKind::Register),
                (path("c"), OperationKind::Register),
                (path("d"), OperationKind::Deregister),
            ]
        );
        assert_eq!(
            h.runner.running.lock().expect("running").1,
            1,
            "most at once"
        );
    }

    /// A failed attempt's backoff (recorded by the runner) is honoured: no operation before it
    /// ends, the path is looked at again when it does, and forgetting the socket cancels that.
    #[tokio::test(start_paused = true)]
    async fn a_backoff_is_honoured_and_its_timer_cancelled_when_the_socket_goes() {
        let mut h = Harness::new(2);
        for name in ["a", "b"] {
            let desired = h.desired(name, true);
            assert_eq!(
                h.executor.register(&path(name), desired.clone()),
                Start::Started
            );
            let running = h.next().await;
            // What the runner does with a failure: the backoff first, then its end.
            let backoff = h.backoff.fail(
                &path(name),
                desired.socket,
                "refused".into(),
                FailureKind::Other,
                Instant::now(),
            );
            running
                .end
                .send(Ended::RetryAt(backoff.retry_at))
                .expect("running");
            settle().await;
            assert!(matches!(
                h.executor.register(&path(name), desired),
                Start::BackingOff { until } if until == backoff.retry_at
            ));
        }
        h.queue.take();
        h.executor.forget(&path("b"));
        let until = h
            .backoff
            .get(&path("a"), h.desired.get(&path("a")).expect("a").socket);
        let until = until.expect("a backs off").retry_at;
        tokio::time::sleep_until(until + Duration::from_millis(1)).await;
        settle().await;
        match h.queue.take() {
            Some(Work::Paths(paths)) => assert_eq!(
                paths.into_iter().collect::<Vec<_>>(),
                [path("a")],
                "only the socket still there is looked at again"
            ),
            other => panic!("the backoff's end marked {other:?}"),
        }
        let desired = h.desired.get(&path("a")).expect("a");
        assert_eq!(h.executor.register(&path("a"), desired), Start::Started);
        assert_eq!(h.next().await.path, path("a"));
    }

    /// A held socket (unserved, refused) is not retried by time: an earlier timer is cancelled.
    #[tokio::test(start_paused = true)]
    async fn a_held_socket_has_no_timer() {
        let mut h = Harness::new(1);
        let desired = h.desired("a", true);
        h.executor.register(&path("a"), desired.clone());
        let running = h.next().await;
        let retry_at = Instant::now() + Duration::from_secs(1);
        running.end.send(Ended::RetryAt(retry_at)).expect("running");
        settle().await;
        assert_eq!(h.executor.waits.pending(), 1);
        h.executor.register(&path("a"), desired);
        let running = h.next().await;
        running.end.send(Ended::Held).expect("running");
        settle().await;
        assert_eq!(
            h.executor.waits.pending(),
            0,
            "the held socket's timer runs on"
        );
        h.queue.take();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!h.marked("a"), "a held socket was looked at again by time");
    }

    /// Shutdown starts nothing: a registration still waiting for its slot never runs, and the
    /// drain waits for the one that runs.
    #[tokio::test]
    async fn shutdown_starts_no_waiting_operation_and_drain_waits_for_running_ones() {
        let mut h = Harness::new(1);
        for name in ["a", "b"] {
            let desired = h.desired(name, true);
            assert_eq!(h.executor.register(&path(name), desired), Start::Started);
        }
        let running = h.next().await;
        h.cancel.cancel();
        let executor = h.executor.clone();
        let drained = tokio::spawn(async move { executor.drain().await });
        settle().await;
        assert!(!drained.is_finished(), "drained while an operation runs");
        running.end.send(Ended::Done).expect("running");
        drained.await.expect("drain");
        assert!(
            h.started.try_recv().is_err(),
            "an operation started after shutdown"
        );
    }

    /// A `listen` the kernel reports (liveness's hint) ends the pause of the registration that
    /// holds the path, and only that one.
    #[tokio::test]
    async fn a_listen_the_kernel_reports_ends_the_pause_of_the_registration_of_its_path() {
        let mut h = Harness::new(2);
        for name in ["waiting-a", "waiting-b"] {
            let desired = h.desired(name, true);
            assert_eq!(h.executor.register(&path(name), desired), Start::Started);
        }
        settle().await;
        h.liveness.kernel_hint(&path("elsewhere"), true);
        h.liveness.kernel_hint(&path("waiting-b"), true);
        let running = h.next().await;
        assert_eq!(
            running.path,
            path("waiting-b"),
            "the listen woke another operation"
        );
        settle().await;
        assert!(
            h.started.try_recv().is_err(),
            "a pause ended without its listen"
        );
        running.end.send(Ended::Done).expect("running");
    }

    /// The eBPF source reported the socket's bind: its registration dials once the kernel
    /// reports its `listen` (a dial before would be refused), at once if the listen is known
    /// already, and after [`waits::FIRST_LISTEN_WAIT`] if no report comes (a lost one, or a
    /// socket that never listens: the dial then says so).
    #[tokio::test(start_paused = true)]
    async fn a_socket_whose_bind_the_kernel_reported_is_dialled_once_its_listen_is_reported() {
        let mut h = Harness::new(4);
        fn bound(desired: &DesiredState, name: &str) -> DesiredPlugin {
            let socket = crate::state::SocketId {
                dev: 1,
                ino: 100 + u64::from(name.as_bytes()[0]),
                birth_ns: None,
                handle: None,
            };
            desired
                .add_observed(&path(name), socket, Some(1_000), true, None)
                .expect("desired");
            desired.get(&path(name)).expect("desired")
        }
        // Reported after the registration was asked for.
        let started = Instant::now();
        let desired = bound(&h.desired, "a");
        assert_eq!(h.executor.register(&path("a"), desired), Start::Started);
        settle().await;
        assert!(h.started.try_recv().is_err(), "dialled before its listen");
        h.executor.listened(&path("a"));
        let running = h.next().await;
        assert_eq!(running.path, path("a"));
        assert_eq!(
            started.elapsed(),
            Duration::ZERO,
            "waited for more than the report"
        );
        running.end.send(Ended::Done).expect("running");
        // Reported before: no wait.
        let desired = bound(&h.desired, "b");
        let listening = crate::state::desired::Listening {
            at: std::time::SystemTime::now(),
            seen_by: crate::state::desired::ListenSeen::KernelReport,
        };
        assert!(
            h.desired
                .record_listening(&path("b"), None, Some(2_000), listening)
        );
        assert_eq!(h.executor.register(&path("b"), desired), Start::Started);
        assert_eq!(h.next().await.path, path("b"));
        assert_eq!(
            started.elapsed(),
            Duration::ZERO,
            "waited for a known listen"
        );
        // Never reported: dialled after the wait.
        let desired = bound(&h.desired, "c");
        assert_eq!(h.executor.register(&path("c"), desired), Start::Started);
        assert_eq!(h.next().await.path, path("c"));
        assert_eq!(started.elapsed(), waits::FIRST_LISTEN_WAIT);
        // Found by a walk (no bind reported): dialled at once.
        let walked = Instant::now();
        let desired = h.desired("d", false);
        assert_eq!(h.executor.register(&path("d"), desired), Start::Started);
        assert_eq!(h.next().await.path, path("d"));
        assert_eq!(walked.elapsed(), Duration::ZERO);
    }
}
