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
use crate::state::desired::DesiredPlugin;
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
use tracing::{debug, info};
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
        // Whatever socket is at the path now is the one that listens.
        let Ok(crate::state::EntryKind::Socket(socket)) = crate::state::EntryKind::of(path) else {
            return;
        };
        match self.backoff.release_on_listen(path, socket) {
            ListenReleased::Nothing => {}
            ListenReleased::Unserved => {
                info!(socket_path = %path.display(), "an unserved socket started listening (reported by the kernel): registering it");
                self.queue.mark(path.to_path_buf());
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
        if let Some(until) = self
            .backoff
            .blocked_until(path, desired.socket, now, first_contact)
        {
            return Start::BackingOff { until };
        }
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
        let attempt = self
            .backoff
            .get(path, desired.socket)
            .map_or(1, |b| b.failures + 1);
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
mod tests;
