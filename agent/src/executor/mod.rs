//! Operation executor: runs registrations and deregistrations, one at a time per socket path.
//!
//! ```text
//! register:   dial -> GetInfo -> handler by type -> validate -> actual state add -> register -> Notify(true)
//!             any failure -> Notify(false, reason), roll back, back off (keyed by socket identity)
//! deregister: actual state remove -> handler deregister (name, this socket's endpoint)
//! ```
//!
//! Guarantees: never two operations for one socket path at once (the second is refused with
//! [`Start::AlreadyRunning`], as kubelet's `IsAlreadyExists`); never two handler calls for one
//! plugin name at once; at most `max_concurrent` operations in total, so a storm of broken plugins
//! queues rather than exhausting the agent, a quarter of them dialling plugins (see
//! [`slots::Slot::dialling`]), and at most four registrations per slot wait for one as tasks, the
//! rest of a burst as listed paths (see [`slots::Backlog`]). Every plugin and handler call has a
//! deadline, so a hung plugin or handler holds one slot for a bounded time and never blocks other
//! plugins.
//!
//! Every finished operation, and every backoff expiry, marks its path in the [`ReconcileQueue`],
//! which wakes the reconciler: no polling.
//!
//! The room, as kubelet splits its `operationexecutor`:
//! - this file: scheduling. Whether an operation may start (claims, backoff), the concurrency
//!   limit, and what happens when one ends (release, backoff, the retry timer);
//! - [`claims`]: the one-operation-per-path map and the per-plugin-name locks (kubelet's
//!   `nestedpendingoperations`);
//! - [`operation`]: the steps of a registration and a deregistration (kubelet's
//!   `operation_generator.go`);
//! - [`observe`]: what an operation reports to telemetry (outcome counters, latency, span fields).
//!
//! It imports the state room (caches, backoff table, reconcile queue), the plugin client
//! (`registration`), the handlers, the event bus and the telemetry sink; nothing imports it but
//! the reconciler and the assembly (`agent`).

mod admission;
mod claims;
mod observe;
mod observe_mode;
mod operation;
mod slots;

use crate::event_source::monotonic_now_ns;
use crate::handler::HandlerRegistry;
use crate::liveness::{LearnedBy, Liveness, Loss};
use crate::mode::Mode;
use crate::notifications::{AgentEvent, EventKind, NotificationBus};
use crate::registration::{PluginCallError, Timeouts};
use crate::state::actual::{ActualState, RegisteredPlugin};
use crate::state::backoff::{BackoffTable, FailureKind, ListenReleased, QUICK_RETRIES};
use crate::state::desired::DesiredPlugin;
use crate::state::queue::ReconcileQueue;
use crate::telemetry::Telemetry;
use crate::telemetry::discovery::Via;
pub use admission::PolicyReload;
use claims::NameLocks;
use opentelemetry::KeyValue;
use operation::RegisterFailure;
use slots::Slots;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::field::Empty;
use tracing::{Instrument, debug, info, info_span, warn};

/// How long a socket found by a walk (not seen being created) may refuse connections before it
/// counts as unserved: long enough for a plugin caught between its bind and its listen, short
/// enough that a dead plugin's socket left from before a reboot is reported at once.
const LISTEN_WAIT_AFTER_WALK: Duration = Duration::from_secs(1);

/// How long after its socket was discovered a plugin that misses GetInfo's deadline counts as
/// just started (busy starting up) rather than hung: it gets quick retries (see `state::backoff`).
const QUICK_RETRY_WINDOW: Duration = Duration::from_secs(30);

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

/// Kind of operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperationKind {
    /// Registering the socket's plugin.
    Register,
    /// Deregistering it.
    Deregister,
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
/// its `PluginInfo` at once (see [`slots::Slot::dialling`]).
const SLOTS_PER_DIAL: usize = 4;

/// See the module docs.
pub struct OperationExecutor {
    actual: Arc<ActualState>,
    handlers: Arc<HandlerRegistry>,
    queue: Arc<ReconcileQueue>,
    config: ExecutorConfig,
    in_flight: Mutex<HashMap<PathBuf, claims::Claim>>,
    backoff: Arc<BackoffTable>,
    slots: Slots,
    backlog: slots::Backlog,
    /// A safety pass's look at unserved sockets is running (see `recheck_unserved`).
    rechecking: std::sync::atomic::AtomicBool,
    name_locks: NameLocks,
    tasks: TaskTracker,
    notifications: NotificationBus,
    telemetry: Arc<Telemetry>,
    cancel: CancellationToken,
    trimmer: crate::memory::Trimmer,
    /// Pending backoff retries by path, cancelled when the socket leaves the tree: a storm of
    /// short-lived sockets that fail (not plugins) would otherwise leave thousands of timers that
    /// wake the idle agent long after the sockets are gone.
    retry_timers: Mutex<HashMap<PathBuf, CancellationToken>>,
    /// Connections a look at a socket waiting to listen made (see
    /// [`Self::look_for_listen`]), for its registration's first try.
    found_listening: Mutex<HashMap<PathBuf, (crate::state::SocketId, tokio::net::UnixStream)>>,
    /// Where finished registrations and deregistrations are recorded for the next agent (see
    /// `persist`); unset: nothing outlives this one.
    journal: std::sync::OnceLock<Arc<crate::persist::Journal>>,
    /// Desired state, read in observe mode for kubelet's first contact (see
    /// [`crate::mode::Contact::AfterKubelet`]); unset: no first contact is ever known.
    contacts: std::sync::OnceLock<Arc<crate::state::desired::DesiredState>>,
    /// The servers of registered plugins, watched for their exit.
    liveness: Arc<Liveness>,
    /// Who serves each plugin, and whether the policy lets it register.
    admission: admission::Admission,
    /// Records each plugin call's steps (dial, GetInfo, Notify) in the metrics.
    steps: crate::registration::StepTimer,
}

impl OperationExecutor {
    /// - `actual`: written here, before the handler's Register and before its DeRegister;
    /// - `handlers`: looked up by the plugin type GetInfo returns; adding one releases the plugins
    ///   that were waiting for it (subscribed here);
    /// - `queue`: told about every finished operation and expired backoff, to wake the reconciler;
    /// - `notifications`: where registrations, failures and deregistrations are published;
    /// - `telemetry`: operation outcomes, latencies and handler calls are recorded there, and
    ///   each operation's span is made a child of its socket's discovery;
    /// - `cancel`: stops backoff timers; running operations finish (see [`Self::drain`]).
    pub fn new(
        actual: Arc<ActualState>,
        handlers: Arc<HandlerRegistry>,
        queue: Arc<ReconcileQueue>,
        config: ExecutorConfig,
        notifications: NotificationBus,
        telemetry: Arc<Telemetry>,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        let steps = observe::step_timer(telemetry.clone());
        let executor = Arc::new(OperationExecutor {
            actual,
            handlers: handlers.clone(),
            queue,
            config,
            in_flight: Mutex::new(HashMap::new()),
            backoff: Arc::default(),
            slots: Slots::new(
                config.max_concurrent,
                config.max_concurrent.div_ceil(SLOTS_PER_DIAL),
                cancel.clone(),
            ),
            backlog: slots::Backlog::new(config.max_concurrent.saturating_mul(WAITING_PER_SLOT)),
            rechecking: std::sync::atomic::AtomicBool::new(false),
            name_locks: NameLocks::default(),
            tasks: TaskTracker::new(),
            notifications,
            telemetry,
            cancel,
            trimmer: crate::memory::Trimmer::default(),
            retry_timers: Mutex::new(HashMap::new()),
            found_listening: Mutex::new(HashMap::new()),
            journal: std::sync::OnceLock::new(),
            contacts: std::sync::OnceLock::new(),
            liveness: Arc::default(),
            admission: admission::Admission::default(),
            steps,
        });
        let weak = Arc::downgrade(&executor);
        executor.liveness.on_loss(move |loss| {
            if let Some(executor) = weak.upgrade() {
                executor.unserved(loss);
            }
        });
        let weak = Arc::downgrade(&executor);
        executor.liveness.on_listen(move |path| {
            let Some(executor) = weak.upgrade() else {
                return;
            };
            // A registration dialling a socket that refused (bound, not listening yet) retries
            // on a timer; the kernel's word ends its wait, so it registers within a millisecond
            // of the listen rather than up to 50 ms after it.
            executor.listened(path);
            // Whatever socket is at the path now is the one that listens.
            let Ok(crate::state::EntryKind::Socket(socket)) = crate::state::EntryKind::of(path)
            else {
                return;
            };
            match executor.backoff.release_on_listen(path, socket) {
                ListenReleased::Nothing => {}
                ListenReleased::Unserved => {
                    info!(socket_path = %path.display(), "an unserved socket started listening (reported by the kernel): registering it");
                    executor.queue.mark(path.to_path_buf());
                }
                ListenReleased::Waiting => {
                    debug!(socket_path = %path.display(), "a socket waiting to listen listens (reported by the kernel)");
                    executor.queue.mark(path.to_path_buf());
                }
            }
        });
        let weak = Arc::downgrade(&executor);
        executor.liveness.on_hints_lost(move || {
            if let Some(executor) = weak.upgrade() {
                executor.hints_lost();
            }
        });
        let weak = Arc::downgrade(&executor);
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
        executor
    }

    /// Starts registering the plugin at `path` unless an operation for it runs or it backs off.
    pub fn register(self: &Arc<Self>, path: &Path, desired: DesiredPlugin) -> Start {
        if let Some(until) = self.backoff.blocked_until(
            path,
            desired.socket,
            Instant::now(),
            desired.first_contact.is_some(),
        ) {
            return Start::BackingOff { until };
        }
        // A socket an event reported goes before the sockets a walk found (see `slots`).
        let lane = if desired.by_event {
            slots::Lane::Prompt
        } else {
            slots::Lane::Scan
        };
        if !self.backlog.admit(path, lane) {
            return Start::Deferred;
        }
        let claim = match self.claim(path, OperationKind::Register) {
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
        let this = self.clone();
        let path = path.to_path_buf();
        self.tasks.spawn(async move {
            // Shutdown starts no operation: those still waiting for a slot end here. Waiting
            // costs only this small future: the operation's own state (span, connection, the
            // calls' futures) is allocated once it may run, so thousands of sockets queued
            // behind a storm of dead ones cost bytes each, not kilobytes.
            let queued = Instant::now();
            let slot = this.slots.acquire(lane).await;
            this.left_backlog();
            let Some(slot) = slot else {
                return;
            };
            let slot = slot.waking_on(claim.listened());
            let _claim = claim;
            this.clone()
                .register_in_slot(path, desired, slot, attempt, queued)
                .await;
        });
        Start::Started
    }

    /// A registration stopped waiting for its slot: the next listed path is looked at again.
    fn left_backlog(&self) {
        if let Some(next) = self.backlog.left() {
            self.queue.mark(next);
        }
    }

    /// The reconciler finished a pass: if no registration waits for a slot, the next listed
    /// paths are looked at again (see [`slots::Backlog::refill`]).
    pub fn after_pass(&self) {
        for next in self.backlog.refill() {
            self.queue.mark(next);
        }
    }

    /// A registration that holds its slot: its span, its steps, and what its outcome changes.
    /// Built here and boxed once: the span's and the trace's making stays out of the future,
    /// which a registration waiting for its socket to listen holds all along (it was 7.7 KB,
    /// 16,000 of them waiting behind bind-only sockets).
    fn register_in_slot(
        self: Arc<Self>,
        path: PathBuf,
        desired: DesiredPlugin,
        mut slot: slots::Slot,
        attempt: u32,
        queued: Instant,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        let source = self.telemetry.discovery.label(if desired.by_event {
            Via::Event
        } else {
            Via::Scan
        });
        // The operation runs in its trace's OpenTelemetry context (see
        // `telemetry::sampling::OperationTrace`).
        let slot_wait_ms = queued.elapsed().as_millis() as u64;
        let (span, context) = observe::operation_span(
            &self.telemetry,
            "register",
            &path,
            || {
                info_span!(
                    "register", socket_path = %path.display(), generation = %desired.generation,
                    plugin_name = Empty, plugin_type = Empty, event_source = source, attempt,
                    slot_wait_ms,
                    outcome = Empty, error = Empty, tail_kept = Empty,
                    process.pid = Empty, process.executable.name = Empty, process.user.id = Empty,
                    process.linux.cgroup = Empty, container.id = Empty, k8s.pod.uid = Empty,
                    plugin_agent.creator.pid = Empty, plugin_agent.creator.executable.name = Empty,
                    plugin_agent.creator.user.id = Empty, plugin_agent.creator.linux.cgroup = Empty,
                    plugin_agent.creator.unknown = Empty
                )
            },
            || {
                vec![
                    ("generation", desired.generation.to_string().into()),
                    ("event_source", source.into()),
                    ("attempt", i64::from(attempt).into()),
                    ("slot_wait_ms", (slot_wait_ms as i64).into()),
                ]
            },
        );
        let this = self;
        let operation = async move {
            let started = Instant::now();
            // Boxed where awaited: this future lives as long as the operation (through every
            // pause of a socket that does not listen yet), the steps only while they run.
            let (result, server) = match this.config.mode {
                Mode::Register => Box::pin(this.run_register(&path, &desired, &mut slot)).await,
                Mode::Observe { contact } => {
                    Box::pin(this.run_observe(&path, &desired, &mut slot, contact)).await
                }
            }
            .map_or_else(|e| (Err(e), None), |(plugin, server)| (Ok(plugin), server));
            if matches!(result, Err(RegisterFailure::ShuttingDown)) {
                debug!("registration abandoned before the plugin answered: shutting down");
                return;
            }
            // The operation's time counts from its request: waiting for a slot is part of what
            // is slow.
            this.observe_register(source, &desired, &result, queued.elapsed());
            match result {
                Ok(plugin) => {
                    this.backoff.reset(&path, desired.socket);
                    let since_event = desired
                        .kernel_ns
                        .map(|ns| Duration::from_nanos(monotonic_now_ns().saturating_sub(ns)));
                    let (kind, said) = if this.config.mode.observes() {
                        (EventKind::Observed, "plugin observed")
                    } else {
                        (EventKind::Registered, "plugin registered")
                    };
                    // Recorded before it is reported: a kill after the report loses nothing.
                    let provenance = this.journal_registered(&path, &desired);
                    let (served_by, created_by) = describe(provenance.as_ref());
                    if let Some(server) = server {
                        debug!(%server, "the plugin's server, watched for its exit");
                        this.liveness
                            .watch(desired.path.clone(), desired.generation, desired.socket, server);
                    }
                    info!(
                        plugin_name = %plugin.name, plugin_type = %plugin.plugin_type, endpoint = %plugin.endpoint,
                        server = %served_by, creator = %created_by, took = ?started.elapsed(), since_kernel_event = ?since_event, "{said}"
                    );
                    let mut event = AgentEvent::new(kind, &path);
                    event.latency = since_event.or_else(|| desired.seen_at.elapsed().ok());
                    event.plugin = Some(plugin);
                    event.provenance = provenance;
                    this.notifications.publish(event);
                }
                Err(error) => this.failed(&path, &desired, error),
            }
        }
        .instrument(span);
        Box::pin(observe::in_context(context, operation))
    }

    /// A registration of `desired` finished: journalled (if a journal is kept); returns who
    /// made and serves the socket, for its report.
    fn journal_registered(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
    ) -> Option<crate::provenance::Provenance> {
        let entry = self
            .actual
            .get(path)
            .filter(|e| e.generation == desired.generation)?;
        if let Some(journal) = self.journal.get() {
            journal.registered(path, &entry);
        }
        Some(entry.provenance)
    }

    /// A registration of `entry` is about to reach its handler: journalled first (if a journal
    /// is kept); an error means it must not go on.
    fn journal_begin(&self, path: &Path, entry: &RegisteredPlugin) -> Result<(), String> {
        match self.journal.get() {
            Some(journal) => journal.begin(path, entry),
            None => Ok(()),
        }
    }

    /// Records operations in `journal` from now on (see `persist`).
    pub fn keep_journal(&self, journal: Arc<crate::persist::Journal>) {
        let _ = self.journal.set(journal);
    }

    /// Reads first contacts from `desired`, where the watcher records them (observe mode).
    pub fn watch_contacts(&self, desired: Arc<crate::state::desired::DesiredState>) {
        let _ = self.contacts.set(desired);
    }

    /// Takes `path`'s registration `generation` out of actual state for its deregistration or
    /// rollback, through the journal when one is kept (its record stays on disk until
    /// [`deregistered`](Self::deregistered); see `persist::Journal::take`).
    fn take_registered(&self, path: &Path, generation: uuid::Uuid) -> Option<RegisteredPlugin> {
        match self.journal.get() {
            Some(journal) => journal.take(path, generation),
            None => self.actual.remove(path, generation),
        }
    }

    /// A deregistration of `path` (the registration of `generation`) finished.
    fn deregistered(&self, path: &Path, generation: uuid::Uuid) {
        if let Some(journal) = self.journal.get() {
            journal.deregistered(path, generation);
        }
    }

    /// Starts deregistering `registered` from `path` unless an operation for it runs.
    pub fn deregister(self: &Arc<Self>, path: &Path, registered: RegisteredPlugin) -> Start {
        let claim = match self.claim(path, OperationKind::Deregister) {
            Ok(claim) => claim,
            Err(running) => return Start::AlreadyRunning(running),
        };
        let this = self.clone();
        let path = path.to_path_buf();
        let created = Instant::now();
        self.tasks.spawn(async move {
            let _claim = claim;
            // As for a registration: waiting for a slot costs a small future.
            let Some(_slot) = this.slots.acquire(slots::Lane::Prompt).await else {
                return;
            };
            let plugin = &registered.plugin;
            let (span, context) = observe::operation_span(
                &this.telemetry,
                "deregister",
                &path,
                || {
                    info_span!(
                        "deregister", socket_path = %path.display(), plugin_name = %plugin.name,
                        plugin_type = %plugin.plugin_type, outcome = Empty, error = Empty,
                        tail_kept = Empty
                    )
                },
                || {
                    vec![
                        ("plugin_name", plugin.name.clone().into()),
                        ("plugin_type", plugin.plugin_type.clone().into()),
                    ]
                },
            );
            let operation = this
                .run_deregister(&path, registered, created)
                .instrument(span);
            Box::pin(observe::in_context(context, operation)).await;
        });
        Start::Started
    }

    /// Who serves each registered plugin; the watcher hands it the kernel's hints.
    pub fn liveness(&self) -> Arc<Liveness> {
        self.liveness.clone()
    }

    /// Carries on from registrations restored from a previous agent, once the first walk said
    /// which sockets are still there: watches the servers of the finished ones (the server the
    /// previous agent recorded, while that process runs; else one bare connect learns it, and a
    /// refused one is unserved at once), and runs again those a kill interrupted (the walk
    /// already queued those whose sockets went).
    pub fn watch_restored(&self) {
        for (path, entry) in self.actual.snapshot() {
            if entry.interrupted {
                self.queue.mark(path);
            } else {
                let server = entry.provenance.server.as_deref();
                let known = server.and_then(|s| Some((s.pid?, s.pidfs_ino?)));
                self.liveness
                    .attach(Arc::from(path), entry.generation, entry.socket, known);
            }
        }
    }

    /// The safety pass's look at unserved sockets: one connect each, and a socket that accepts
    /// again (it started listening, and no kernel hint said so: another source, or a hint lost
    /// with the events of an overflow) is registered. Nothing else ever retries them.
    ///
    /// One task, a few connects at a time: a task per socket at once was 100,000 tasks and
    /// connects with 100,000 dead sockets in the tree (the agent's resident set up by ~90 MB for
    /// the length of each pass). A pass still running when the next is due is not doubled.
    /// What the connects took is added to `safety`'s cost of this pass.
    pub fn recheck_unserved(self: &Arc<Self>, safety: &Arc<crate::state::safety_pass::SafetyPass>) {
        use futures::StreamExt;
        /// Connects in flight at once.
        const AT_ONCE: usize = 32;
        if self
            .rechecking
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        let unserved = self.backoff.unserved_sockets();
        let this = self.clone();
        let safety = safety.clone();
        self.tasks.spawn(async move {
            let started = Instant::now();
            futures::stream::iter(unserved)
                .for_each_concurrent(AT_ONCE, |(path, socket)| {
                    let this = &this;
                    async move {
                        if crate::liveness::accepts(&path, socket).await
                            && this.backoff.release_on_listen(&path, socket)
                                == ListenReleased::Unserved
                        {
                            info!(socket_path = %path.display(), "an unserved socket accepts connections again (safety pass): registering it");
                            this.queue.mark(path);
                        }
                    }
                })
                .await;
            safety.spent(started.elapsed());
            this.rechecking
                .store(false, std::sync::atomic::Ordering::Release);
        });
    }

    /// Whether nothing serves the socket `socket` at `path`, or the policy refuses it: its
    /// registration is ended, and it is not registered again until it (or the policy) changes.
    pub fn is_held(&self, path: &Path, socket: crate::state::SocketId) -> bool {
        self.backoff.is_held(path, socket)
    }

    /// A registered plugin's server is gone (see `liveness`): record it, and let the reconciler
    /// deregister it.
    fn unserved(self: &Arc<Self>, loss: Loss) {
        let Some(registered) = self
            .actual
            .get(&loss.path)
            .filter(|r| r.generation == loss.generation)
        else {
            return;
        };
        let span = info_span!(
            "unserved", socket_path = %loss.path.display(), plugin_name = %registered.plugin.name,
            plugin_type = %registered.plugin.plugin_type, learned_by = loss.learned_by.label(),
            reason = %loss.reason
        );
        // Its span in the socket's trace, and its log line in that span.
        let traced = self.telemetry.discovery.event_span(
            &loss.path,
            "unserved",
            vec![
                KeyValue::new("socket_path", loss.path.display().to_string()),
                KeyValue::new("plugin_name", registered.plugin.name.clone()),
                KeyValue::new("plugin_type", registered.plugin.plugin_type.clone()),
                KeyValue::new("learned_by", loss.learned_by.label()),
                KeyValue::new("reason", loss.reason.clone()),
            ],
        );
        let _in_trace = traced.map(opentelemetry::Context::attach);
        let _in_span = span.enter();
        self.record_unserved(
            &loss.path,
            registered.socket,
            Some(registered.plugin),
            loss.learned_by,
            loss.since,
            loss.reason,
        );
        self.queue.mark(loss.path);
    }

    /// Nothing serves `socket` at `path`: no retry until it changes.
    fn record_unserved(
        &self,
        path: &Path,
        socket: crate::state::SocketId,
        plugin: Option<crate::handler::Plugin>,
        learned_by: LearnedBy,
        since: Instant,
        reason: String,
    ) {
        let kind = FailureKind::Unserved {
            learned_by: learned_by.label(),
            since,
        };
        let said = format!("unserved ({}): {reason}", learned_by.label());
        self.backoff.hold(path, socket, said.clone(), kind);
        if let Some(timer) = self.lock_retry_timers().remove(path) {
            timer.cancel();
        }
        self.telemetry.metrics.liveness_loss(learned_by.label());
        warn!(learned_by = learned_by.label(), %reason, "plugin unserved: not registered until its socket changes");
        let mut event = AgentEvent::new(EventKind::Unserved, path);
        event.error = Some(said);
        event.plugin = plugin;
        self.notifications.publish(event);
    }

    /// The socket at `path` left the tree: forget its backoff.
    pub fn forget(&self, path: &Path) {
        self.backoff.forget_path(path);
        self.lock_found_listening().remove(path);
        self.telemetry.discovery.forget(path);
        if let Some(timer) = self.lock_retry_timers().remove(path) {
            timer.cancel();
        }
    }

    /// The backoff table this executor writes, for the views that derive a plugin's state
    /// ([`crate::state::view::StateView`]).
    pub fn backoffs(&self) -> Arc<BackoffTable> {
        self.backoff.clone()
    }

    /// Whether an operation for `path` is running.
    pub fn is_running(&self, path: &Path) -> bool {
        self.lock_in_flight().contains_key(path)
    }

    /// Waits for running operations to finish (graceful shutdown); no new ones start after.
    pub async fn drain(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }

    fn failed(self: &Arc<Self>, path: &Path, desired: &DesiredPlugin, error: RegisterFailure) {
        if let RegisterFailure::Rejected(rejected) = error {
            return self.record_rejected(path, desired.socket, *rejected);
        }
        if let RegisterFailure::Plugin(PluginCallError::NotListening { .. }) = &error {
            let since = Instant::now();
            let reason = error.to_string();
            self.record_unserved(
                path,
                desired.socket,
                None,
                LearnedBy::ConnectProbe,
                since,
                reason,
            );
            return;
        }
        if let RegisterFailure::Plugin(PluginCallError::NotListeningYet { until, .. }) = &error {
            return self.wait_to_listen(path, desired, *until, error.to_string());
        }
        if let RegisterFailure::WaitingForKubelet { until } = error {
            // Not a failure either: the first contact (the watcher looks at the path again
            // when it records one) or `until` ends it.
            self.backoff
                .wait_for_kubelet(path, desired.socket, until, error.to_string());
            return self.look_again_at(path, until);
        }
        let kind = match &error {
            RegisterFailure::NoHandler { plugin_type, .. }
            | RegisterFailure::Handler {
                unavailable: true,
                plugin_type,
                ..
            } => FailureKind::WaitingForHandler {
                plugin_type: plugin_type.clone(),
            },
            RegisterFailure::Plugin(PluginCallError::GetInfoTimeout(_))
                if desired
                    .seen_at
                    .elapsed()
                    .is_ok_and(|age| age < QUICK_RETRY_WINDOW) =>
            {
                FailureKind::SlowNewPlugin
            }
            _ => FailureKind::Other,
        };
        // A socket that vanished (or was replaced) is not a failed registration: no event, no
        // warning. Usually its removal reaches the watcher at once and forget() drops the retry.
        // But if the watcher missed it, desired state still names this socket instance, and
        // retrying at once would spin (every attempt ends here immediately): it backs off like a
        // failure until the watcher's next rescan corrects desired state.
        let vanished = matches!(
            error,
            RegisterFailure::Plugin(PluginCallError::SocketGone(_))
        );
        // A slow new plugin's quick retries say so where operators look (`list`'s last error).
        let reason = if kind == FailureKind::SlowNewPlugin {
            let failed_before = self
                .backoff
                .get(path, desired.socket)
                .map_or(0, |b| b.failures);
            if failed_before < QUICK_RETRIES {
                format!(
                    "{error} (a plugin that just started serving: quick retry {} of {QUICK_RETRIES})",
                    failed_before + 1
                )
            } else {
                error.to_string()
            }
        } else {
            error.to_string()
        };
        let backoff = self
            .backoff
            .fail(path, desired.socket, reason, kind, Instant::now());
        // Published once the failure is recorded, so a watcher that reacts by asking `list`
        // reads the error the event carries.
        if !vanished {
            let mut event = AgentEvent::new(EventKind::RegistrationFailed, path);
            event.error = Some(error.to_string());
            self.notifications.publish(event);
        }
        self.telemetry.metrics.backoff(backoff.delay);
        if vanished {
            debug!(%error, retry_in = ?backoff.delay, "socket vanished during registration");
        } else {
            warn!(%error, failures = backoff.failures, retry_in = ?backoff.delay, "plugin registration failed");
        }
        self.look_again_at(path, backoff.retry_at);
    }

    /// The socket at `path` refuses connections (bound, not listening yet) and may listen until
    /// `until`: it waits without an operation, for the kernel's report of its listen or its
    /// next look (see `state::backoff`). Not a failure: no event, no warning.
    fn wait_to_listen(
        self: &Arc<Self>,
        path: &Path,
        desired: &DesiredPlugin,
        until: Instant,
        reason: String,
    ) {
        let now = Instant::now();
        let reason = format!("{reason}: waiting for it to listen");
        let backoff = self.backoff.wait_to_listen(
            path,
            desired.socket,
            until,
            self.config.listens_reported,
            reason,
            now,
        );
        // A listen reported after the attempt's last refused connect found no wait to end:
        // it is one now (recorded first, so a report racing with this is not lost either).
        if self.listen_reported_to_claim(path)
            && self.backoff.release_on_listen(path, desired.socket) == ListenReleased::Waiting
        {
            self.queue.mark(path.to_path_buf());
            return;
        }
        debug!(next_look_in = ?backoff.retry_at.saturating_duration_since(now), until_unserved_in = ?until.saturating_duration_since(now), "socket not listening yet: waiting for its listen");
        if self.config.listens_reported {
            self.look_again_at(path, backoff.retry_at);
        } else {
            self.look_for_listen(path, desired.socket, backoff.retry_at, until);
        }
    }

    /// Where no listen is reported: looks at the socket (one connect) at each of its wait's
    /// looks, without an operation (an operation per look cost ~60 us, a connect ~5 us: 17,000
    /// sockets waiting at once took both cores), until it listens or its wait ends; then its
    /// registration runs, on the connection the look made.
    fn look_for_listen(
        self: &Arc<Self>,
        path: &Path,
        socket: crate::state::SocketId,
        first: Instant,
        until: Instant,
    ) {
        use crate::liveness::Probe;
        let cancel = self.replace_timer(path);
        let this = self.clone();
        let path = path.to_path_buf();
        self.tasks.spawn(async move {
            let mut at = first;
            loop {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = cancel.cancelled() => return,
                }
                if Instant::now() >= until {
                    break;
                }
                match crate::liveness::probe(&path, socket).await {
                    (Probe::Refused, _) => {
                        match this
                            .backoff
                            .listen_look_refused(&path, socket, Instant::now())
                        {
                            Some(next) => at = next,
                            None => break,
                        }
                    }
                    (Probe::Served, connected) => {
                        if let Some(stream) = connected {
                            this.lock_found_listening()
                                .insert(path.clone(), (socket, stream));
                        }
                        this.backoff.release_on_listen(&path, socket);
                        break;
                    }
                    (Probe::Replaced, _) => break,
                }
            }
            this.lock_retry_timers().remove(&path);
            this.queue.mark(path);
        });
    }

    /// The connection a look made to `socket` at `path` when it found it listening, if any.
    fn found_listening(
        &self,
        path: &Path,
        socket: crate::state::SocketId,
    ) -> Option<tokio::net::UnixStream> {
        let mut found = self.lock_found_listening();
        match found.remove(path) {
            Some((of, stream)) if of == socket => Some(stream),
            _ => None,
        }
    }

    fn lock_found_listening(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<PathBuf, (crate::state::SocketId, tokio::net::UnixStream)>>
    {
        self.found_listening
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Looks at `path` again at `at` (a backoff's end), replacing an earlier timer.
    fn look_again_at(self: &Arc<Self>, path: &Path, at: Instant) {
        let cancel = self.replace_timer(path);
        let this = self.clone();
        let path = path.to_path_buf();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep_until(at) => {
                    this.lock_retry_timers().remove(&path);
                    this.queue.mark(path);
                }
                _ = cancel.cancelled() => {}
            }
        });
    }

    /// The event source's hints were lost (it rescans): the listens among them too, so every
    /// socket waiting to listen is looked at again now.
    pub fn hints_lost(&self) {
        for path in self.backoff.release_waiting_to_listen() {
            self.queue.mark(path);
        }
    }

    /// The token of `path`'s timer from now on: an earlier timer of the path is cancelled (one
    /// timer per path, whatever it waits for).
    fn replace_timer(&self, path: &Path) -> CancellationToken {
        let cancel = self.cancel.child_token();
        if let Some(previous) = self
            .lock_retry_timers()
            .insert(path.to_path_buf(), cancel.clone())
        {
            previous.cancel();
        }
        cancel
    }

    fn lock_retry_timers(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, CancellationToken>> {
        self.retry_timers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A registration's server and creator, for its log line.
fn describe(provenance: Option<&crate::provenance::Provenance>) -> (String, String) {
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
