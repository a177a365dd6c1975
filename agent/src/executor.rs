//! Operation executor: runs registrations and deregistrations, one at a time per socket path.
//!
//! ```text
//! register:   dial -> GetInfo -> handler by type -> validate -> actual state add -> register -> Notify(true)
//!             any failure -> Notify(false, reason), roll back, back off (keyed by socket identity)
//! deregister: actual state remove -> handler deregister (unless a newer socket superseded it)
//! ```
//!
//! Guarantees: never two operations for one socket path at once (the second is refused with
//! [`Start::AlreadyRunning`], as kubelet's `IsAlreadyExists`); never two handler calls for one
//! plugin name at once; at most `max_concurrent` operations in total, so a storm of broken plugins
//! queues rather than exhausting the agent. Every plugin and handler call has a deadline, so a hung
//! plugin or handler holds one slot for a bounded time and never blocks other plugins.
//!
//! Every finished operation, and every backoff expiry, marks its path in the [`ReconcileQueue`],
//! which wakes the reconciler: no polling.

use crate::backoff::{BackoffTable, FailureKind};
use crate::event_source::monotonic_now_ns;
use crate::events::{AgentEvent, EventBus, EventKind};
use crate::handler::{HandlerError, HandlerRegistry, Plugin};
use crate::reconciler::ReconcileQueue;
use crate::registration::{PluginConnection, RegistrationError, Timeouts};
use crate::state::actual::{ActualState, RegisteredPlugin};
use crate::state::desired::DesiredPlugin;
use crate::telemetry::Telemetry;
use crate::telemetry::discovery::Via;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::field::Empty;
use tracing::{Instrument, debug, info, info_span, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

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
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            plugin_timeouts: Timeouts::default(),
            handler_timeouts: HandlerTimeouts::default(),
            max_concurrent: 256,
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
}

/// Why a registration failed.
#[derive(Debug, thiserror::Error)]
enum RegisterError {
    #[error(transparent)]
    Plugin(#[from] RegistrationError),
    #[error("no handler registered for plugin type: {plugin_type} at socket {socket}")]
    NoHandler { plugin_type: String, socket: String },
    /// The agent began shutting down before the plugin answered: no outcome to report.
    #[error("the agent is shutting down")]
    ShuttingDown,
    #[error("{message}")]
    Handler {
        message: String,
        unavailable: bool,
        plugin_type: String,
        outcome: &'static str,
    },
}

impl RegisterError {
    /// The failure's reason class: the bounded `outcome` of metrics and spans (error text, which
    /// a plugin or handler controls, never becomes a label).
    fn outcome(&self) -> &'static str {
        match self {
            RegisterError::Plugin(RegistrationError::SocketGone(_)) => "socket_gone",
            RegisterError::Plugin(RegistrationError::Dial { .. }) => "dial_error",
            RegisterError::Plugin(RegistrationError::GetInfo(_)) => "get_info_error",
            RegisterError::Plugin(RegistrationError::InvalidInfo(_)) => "invalid_info",
            RegisterError::Plugin(RegistrationError::Notify(_)) => "notify_error",
            RegisterError::NoHandler { .. } => "no_handler",
            RegisterError::ShuttingDown => "shutting_down",
            RegisterError::Handler { outcome, .. } => outcome,
        }
    }
}

/// A handler call, for span names, metric labels and error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HandlerCall {
    Validate,
    Register,
    Deregister,
}

impl HandlerCall {
    fn label(self) -> &'static str {
        match self {
            HandlerCall::Validate => "validate",
            HandlerCall::Register => "register",
            HandlerCall::Deregister => "deregister",
        }
    }

    fn span(self, plugin_type: &str) -> tracing::Span {
        match self {
            HandlerCall::Validate => {
                info_span!(
                    "ValidatePlugin",
                    plugin_type,
                    error = Empty,
                    otel.status_code = Empty
                )
            }
            HandlerCall::Register => {
                info_span!(
                    "RegisterPlugin",
                    plugin_type,
                    error = Empty,
                    otel.status_code = Empty
                )
            }
            HandlerCall::Deregister => {
                info_span!(
                    "DeRegisterPlugin",
                    plugin_type,
                    error = Empty,
                    otel.status_code = Empty
                )
            }
        }
    }
}

/// See the module docs.
pub struct OperationExecutor {
    actual: Arc<ActualState>,
    handlers: Arc<HandlerRegistry>,
    queue: Arc<ReconcileQueue>,
    config: ExecutorConfig,
    in_flight: Mutex<HashMap<PathBuf, OperationKind>>,
    backoff: BackoffTable,
    slots: Arc<Semaphore>,
    name_locks: NameLocks,
    tasks: TaskTracker,
    events: EventBus,
    telemetry: Arc<Telemetry>,
    cancel: CancellationToken,
    trimmer: crate::memory::Trimmer,
    /// Pending backoff retries by path, cancelled when the socket leaves the tree: a storm of
    /// short-lived sockets that fail (not plugins) would otherwise leave thousands of timers that
    /// wake the idle agent long after the sockets are gone.
    retry_timers: Mutex<HashMap<PathBuf, CancellationToken>>,
}

impl OperationExecutor {
    /// - `actual`: written here, before the handler's Register and before its DeRegister;
    /// - `handlers`: looked up by the plugin type GetInfo returns; adding one releases the plugins
    ///   that were waiting for it (subscribed here);
    /// - `queue`: told about every finished operation and expired backoff, to wake the reconciler;
    /// - `events`: where registrations, failures and deregistrations are published;
    /// - `telemetry`: operation outcomes, latencies and handler calls are recorded there, and
    ///   each operation's span is made a child of its socket's discovery;
    /// - `cancel`: stops backoff timers; running operations finish (see [`Self::drain`]).
    pub fn new(
        actual: Arc<ActualState>,
        handlers: Arc<HandlerRegistry>,
        queue: Arc<ReconcileQueue>,
        config: ExecutorConfig,
        events: EventBus,
        telemetry: Arc<Telemetry>,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        let executor = Arc::new(OperationExecutor {
            actual,
            handlers: handlers.clone(),
            queue,
            config,
            in_flight: Mutex::new(HashMap::new()),
            backoff: BackoffTable::default(),
            slots: Arc::new(Semaphore::new(config.max_concurrent.max(1))),
            name_locks: NameLocks::default(),
            tasks: TaskTracker::new(),
            events,
            telemetry,
            cancel,
            trimmer: crate::memory::Trimmer::default(),
            retry_timers: Mutex::new(HashMap::new()),
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
        if let Some(until) = self
            .backoff
            .blocked_until(path, desired.socket, Instant::now())
        {
            return Start::BackingOff { until };
        }
        let claim = match self.claim(path, OperationKind::Register) {
            Ok(claim) => claim,
            Err(running) => return Start::AlreadyRunning(running),
        };
        let this = self.clone();
        let path = path.to_path_buf();
        let attempt = self
            .backoff
            .get(&path, desired.socket)
            .map_or(1, |b| b.failures + 1);
        if attempt > 1 {
            self.telemetry.metrics.retry();
        }
        let source = self.telemetry.discovery.label(if desired.by_event {
            Via::Event
        } else {
            Via::Scan
        });
        let span = info_span!(
            "register", socket_path = %path.display(), generation = %desired.generation,
            plugin_name = Empty, plugin_type = Empty, event_source = source, attempt,
            outcome = Empty, error = Empty, otel.status_code = Empty
        );
        if let Some(parent) = self.telemetry.discovery.parent_of(&path) {
            let _ = span.set_parent(parent);
        }
        self.tasks.spawn(
            async move {
                let _claim = claim;
                // Shutdown starts no operation: those still waiting for a slot end here.
                let slot = this.slots.clone().acquire_owned();
                let Some(Ok(_slot)) = crate::shutdown::unless_stopping(&this.cancel, slot).await else { return };
                let started = Instant::now();
                let result = this.run_register(&path, &desired).await;
                if matches!(result, Err(RegisterError::ShuttingDown)) {
                    debug!("registration abandoned before the plugin answered: shutting down");
                    return;
                }
                this.observe_register(source, &desired, &result);
                match result {
                    Ok(plugin) => {
                        this.backoff.reset(&path, desired.socket);
                        let since_event = desired.kernel_ns.map(|ns| {
                            Duration::from_nanos(monotonic_now_ns().saturating_sub(ns))
                        });
                        info!(
                            plugin_name = %plugin.name, plugin_type = %plugin.plugin_type, endpoint = %plugin.endpoint,
                            took = ?started.elapsed(), since_kernel_event = ?since_event, "plugin registered"
                        );
                        let mut event = AgentEvent::new(EventKind::Registered, &path);
                        event.latency = since_event
                            .or_else(|| desired.seen_at.elapsed().ok());
                        event.plugin = Some(plugin);
                        this.events.publish(event);
                    }
                    Err(error) => this.failed(&path, &desired, error),
                }
            }
            .instrument(span),
        );
        Start::Started
    }

    /// Starts deregistering `registered` from `path` unless an operation for it runs.
    pub fn deregister(self: &Arc<Self>, path: &Path, registered: RegisteredPlugin) -> Start {
        let claim = match self.claim(path, OperationKind::Deregister) {
            Ok(claim) => claim,
            Err(running) => return Start::AlreadyRunning(running),
        };
        let this = self.clone();
        let path = path.to_path_buf();
        let span = info_span!(
            "deregister", socket_path = %path.display(), plugin_name = %registered.plugin.name,
            plugin_type = %registered.plugin.plugin_type, outcome = Empty, error = Empty,
            otel.status_code = Empty
        );
        if let Some(parent) = self.telemetry.discovery.parent_of(&path) {
            let _ = span.set_parent(parent);
        }
        self.tasks.spawn(
            async move {
                let _claim = claim;
                let slot = this.slots.clone().acquire_owned();
                let Some(Ok(_slot)) = crate::shutdown::unless_stopping(&this.cancel, slot).await
                else {
                    return;
                };
                this.run_deregister(&path, registered).await;
            }
            .instrument(span),
        );
        Start::Started
    }

    /// The socket at `path` left the tree: forget its backoff.
    pub fn forget(&self, path: &Path) {
        self.backoff.forget_path(path);
        self.telemetry.discovery.forget(path);
        if let Some(timer) = self.lock_retry_timers().remove(path) {
            timer.cancel();
        }
    }

    /// The backoff of a socket, for status reporting.
    pub fn backoff_of(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
    ) -> Option<crate::backoff::Backoff> {
        self.backoff.get(path, desired.socket)
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

    async fn run_register(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
    ) -> Result<Plugin, RegisterError> {
        // Until the plugin has answered, nothing was told to anyone: shutdown may drop the dial.
        let answer = PluginConnection::get_info(path, desired.socket, self.config.plugin_timeouts);
        let Some(answer) = crate::shutdown::unless_stopping(&self.cancel, answer).await else {
            return Err(RegisterError::ShuttingDown);
        };
        let (mut connection, info) = answer?;
        let socket_path = path.to_string_lossy().into_owned();
        let plugin = Plugin {
            endpoint: if info.endpoint.is_empty() {
                socket_path.clone()
            } else {
                info.endpoint
            },
            plugin_type: info.r#type,
            name: info.name,
            supported_versions: info.supported_versions,
            socket_path,
        };
        let span = tracing::Span::current();
        span.record("plugin_name", plugin.name.as_str());
        span.record("plugin_type", plugin.plugin_type.as_str());
        debug!(plugin_name = %plugin.name, plugin_type = %plugin.plugin_type, "GetInfo answered");

        let Some(handler) = self.handlers.get(&plugin.plugin_type) else {
            let error = RegisterError::NoHandler {
                plugin_type: plugin.plugin_type.clone(),
                socket: plugin.socket_path.clone(),
            };
            notify_failure(&mut connection, &error.to_string()).await;
            return Err(error);
        };
        let _name = self
            .name_locks
            .lock(&plugin.plugin_type, &plugin.name)
            .await;
        let timeouts = self.config.handler_timeouts;

        if let Err(e) = self
            .call_handler(
                HandlerCall::Validate,
                &plugin.plugin_type,
                handler.validate(&plugin),
                timeouts.validate,
            )
            .await
        {
            let error = handler_error(HandlerCall::Validate, e, &plugin);
            notify_failure(&mut connection, &error.to_string()).await;
            return Err(error);
        }
        let entry = self.actual.add(
            desired.path.clone(),
            desired.generation,
            desired.socket,
            plugin.clone(),
            handler.clone(),
        );
        if let Err(e) = self
            .call_handler(
                HandlerCall::Register,
                &plugin.plugin_type,
                handler.register(&plugin),
                timeouts.register,
            )
            .await
        {
            let error = handler_error(HandlerCall::Register, e, &plugin);
            notify_failure(&mut connection, &error.to_string()).await;
            self.roll_back(path, &entry).await;
            return Err(error);
        }
        if let Err(e) = connection
            .notify(true, "")
            .instrument(info_span!("NotifyRegistrationStatus", registered = true))
            .await
        {
            self.roll_back(path, &entry).await;
            return Err(e.into());
        }
        self.actual.supersede_others(path);
        Ok(plugin)
    }

    /// Undoes a registration whose last steps failed: actual state, then the handler.
    async fn roll_back(&self, path: &Path, entry: &RegisteredPlugin) {
        if self.actual.remove(path, entry.generation).is_none() {
            return;
        }
        if let Err(e) = self
            .call_handler(
                HandlerCall::Deregister,
                &entry.plugin.plugin_type,
                entry.handler.deregister(&entry.plugin),
                self.config.handler_timeouts.deregister,
            )
            .await
        {
            warn!(plugin_name = %entry.plugin.name, error = %e, "rollback: handler deregistration failed");
        }
    }

    async fn run_deregister(&self, path: &Path, registered: RegisteredPlugin) {
        // Take the current entry: it may have been marked superseded since the reconciler looked.
        let Some(entry) = self.actual.remove(path, registered.generation) else {
            self.observe_deregister("not_registered", None);
            return;
        };
        let mut event = AgentEvent::new(EventKind::Deregistered, path);
        event.plugin = Some(entry.plugin.clone());
        if entry.superseded {
            info!(
                "socket removed; plugin was re-registered from a newer socket, so it stays registered"
            );
            event.detail = Some("superseded by a newer socket: handler not called".into());
            self.events.publish(event);
            self.observe_deregister("superseded", None);
            return;
        }
        let _name = self
            .name_locks
            .lock(&entry.plugin.plugin_type, &entry.plugin.name)
            .await;
        match self
            .call_handler(
                HandlerCall::Deregister,
                &entry.plugin.plugin_type,
                entry.handler.deregister(&entry.plugin),
                self.config.handler_timeouts.deregister,
            )
            .await
        {
            Ok(()) => {
                info!("plugin deregistered");
                self.observe_deregister("success", None);
            }
            Err(e) => {
                warn!(error = %e, "handler failed to deregister plugin");
                self.observe_deregister("handler_error", Some(&e.message));
                event.error = Some(e.message);
            }
        }
        self.events.publish(event);
    }

    fn failed(self: &Arc<Self>, path: &Path, desired: &DesiredPlugin, error: RegisterError) {
        let kind = match &error {
            RegisterError::NoHandler { plugin_type, .. }
            | RegisterError::Handler {
                unavailable: true,
                plugin_type,
                ..
            } => FailureKind::WaitingForHandler {
                plugin_type: plugin_type.clone(),
            },
            _ => FailureKind::Other,
        };
        // A socket that vanished (or was replaced) is not a failed registration: no event, no
        // warning. Usually its removal reaches the watcher at once and forget() drops the retry.
        // But if the watcher missed it, desired state still names this socket instance, and
        // retrying at once would spin (every attempt ends here immediately): it backs off like a
        // failure until the watcher's next rescan corrects desired state.
        let vanished = matches!(
            error,
            RegisterError::Plugin(RegistrationError::SocketGone(_))
        );
        if !vanished {
            let mut event = AgentEvent::new(EventKind::RegistrationFailed, path);
            event.error = Some(error.to_string());
            self.events.publish(event);
        }
        let backoff = self.backoff.fail(
            path,
            desired.socket,
            error.to_string(),
            kind,
            Instant::now(),
        );
        self.telemetry.metrics.backoff(backoff.delay);
        if vanished {
            debug!(%error, retry_in = ?backoff.delay, "socket vanished during registration");
        } else {
            warn!(%error, failures = backoff.failures, retry_in = ?backoff.delay, "plugin registration failed");
        }
        let cancel = self.cancel.child_token();
        if let Some(previous) = self
            .lock_retry_timers()
            .insert(path.to_path_buf(), cancel.clone())
        {
            previous.cancel();
        }
        let this = self.clone();
        let path = path.to_path_buf();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep_until(backoff.retry_at) => {
                    this.lock_retry_timers().remove(&path);
                    this.queue.mark(path);
                }
                _ = cancel.cancelled() => {}
            }
        });
    }

    /// Records a finished registration attempt: operation outcome, latency since the socket's
    /// discovery (its kernel event when timestamped), and the outcome on the `register` span.
    fn observe_register(
        &self,
        source: &'static str,
        desired: &DesiredPlugin,
        result: &Result<Plugin, RegisterError>,
    ) {
        let outcome = result
            .as_ref()
            .map_or_else(RegisterError::outcome, |_| "success");
        let metrics = &self.telemetry.metrics;
        metrics.operation("register", outcome);
        let span = tracing::Span::current();
        span.record("outcome", outcome);
        if let Err(error) = result {
            span.record("error", error.to_string());
            span.record("otel.status_code", "error");
        }
        // A socket that vanished mid-attempt is not a registration that failed: no latency.
        if outcome != "socket_gone" {
            let latency = desired
                .kernel_ns
                .map(|ns| Duration::from_nanos(monotonic_now_ns().saturating_sub(ns)))
                .or_else(|| desired.seen_at.elapsed().ok())
                .unwrap_or_default();
            metrics.registration(source, result.is_ok(), latency);
        }
    }

    /// Records a finished deregistration on the metrics and the `deregister` span.
    fn observe_deregister(&self, outcome: &'static str, error: Option<&str>) {
        self.telemetry.metrics.operation("deregister", outcome);
        let span = tracing::Span::current();
        span.record("outcome", outcome);
        if let Some(error) = error {
            span.record("error", error);
            span.record("otel.status_code", "error");
        }
    }

    /// Calls a handler with a deadline, in a span named for the call, recording its latency by
    /// plugin type (a handler's type: bounded), call and outcome.
    async fn call_handler(
        &self,
        call: HandlerCall,
        plugin_type: &str,
        future: impl std::future::Future<Output = Result<(), HandlerError>>,
        deadline: Duration,
    ) -> Result<(), HandlerError> {
        let span = call.span(plugin_type);
        let started = Instant::now();
        let answer = tokio::time::timeout(deadline, future)
            .instrument(span.clone())
            .await;
        let (outcome, result) = match answer {
            Ok(Ok(())) => ("ok", Ok(())),
            Ok(Err(e)) if e.unavailable => ("unavailable", Err(e)),
            Ok(Err(e)) => ("rejected", Err(e)),
            Err(_) => (
                "timeout",
                Err(HandlerError::rejected(format!(
                    "handler did not answer within {deadline:?}"
                ))),
            ),
        };
        self.telemetry
            .metrics
            .handler_call(plugin_type, call.label(), outcome, started.elapsed());
        if let Err(e) = &result {
            span.record("error", e.message.as_str());
            span.record("otel.status_code", "error");
        }
        result
    }

    /// Claims `path` for one operation, or says which operation holds it.
    fn claim(
        self: &Arc<Self>,
        path: &Path,
        kind: OperationKind,
    ) -> Result<InFlight, OperationKind> {
        let mut in_flight = self.lock_in_flight();
        if let Some(running) = in_flight.get(path) {
            return Err(*running);
        }
        in_flight.insert(path.to_path_buf(), kind);
        Ok(InFlight {
            executor: self.clone(),
            path: path.to_path_buf(),
        })
    }

    fn finish(&self, path: &Path) {
        let idle = {
            let mut in_flight = self.lock_in_flight();
            in_flight.remove(path);
            in_flight.is_empty()
        };
        self.queue.mark(path.to_path_buf());
        // After a burst, give what its operations freed back to the kernel (see `memory`).
        self.trimmer.finished(idle);
    }

    fn lock_retry_timers(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, CancellationToken>> {
        self.retry_timers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_in_flight(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, OperationKind>> {
        self.in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn handler_error(call: HandlerCall, error: HandlerError, plugin: &Plugin) -> RegisterError {
    let (what, rejected) = match call {
        HandlerCall::Validate => ("plugin validation failed", "validation_rejected"),
        _ => ("plugin registration failed", "registration_rejected"),
    };
    RegisterError::Handler {
        message: format!("{what}: {}", error.message),
        unavailable: error.unavailable,
        plugin_type: plugin.plugin_type.clone(),
        outcome: if error.unavailable {
            "handler_unavailable"
        } else {
            rejected
        },
    }
}

/// An operation's claim on its socket path. Released when the operation ends, however it ends (a
/// panic included: otherwise the path would stay claimed and no pass would ever retry it), and
/// the path is then looked at again.
struct InFlight {
    executor: Arc<OperationExecutor>,
    path: PathBuf,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.executor.finish(&self.path);
    }
}

async fn notify_failure(connection: &mut PluginConnection, reason: &str) {
    let notified = connection
        .notify(false, reason)
        .instrument(info_span!("NotifyRegistrationStatus", registered = false))
        .await;
    if let Err(e) = notified {
        debug!(error = %e, "could not tell the plugin it was not registered");
    }
}

/// One async lock per (plugin type, name): handler calls for one plugin are strictly sequential.
#[derive(Default)]
struct NameLocks {
    locks: Mutex<HashMap<PluginKey, Arc<tokio::sync::Mutex<()>>>>,
}

/// (plugin type, plugin name).
type PluginKey = (String, String);

impl NameLocks {
    async fn lock(&self, plugin_type: &str, name: &str) -> NameGuard<'_> {
        let key = (plugin_type.to_string(), name.to_string());
        let lock = self.map().entry(key.clone()).or_default().clone();
        let guard = lock.clone().lock_owned().await;
        NameGuard {
            locks: self,
            key,
            lock,
            guard: Some(guard),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<PluginKey, Arc<tokio::sync::Mutex<()>>>> {
        self.locks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Releases the name lock, and drops the map entry when nobody else holds or waits for it.
struct NameGuard<'a> {
    locks: &'a NameLocks,
    key: PluginKey,
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for NameGuard<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut map = self.locks.map();
        // Held by the map, by `self.lock`, and by nobody else: no waiter, so the entry can go.
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(&self.key);
        }
    }
}
