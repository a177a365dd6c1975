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
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

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
    #[error("{message}")]
    Handler {
        message: String,
        unavailable: bool,
        plugin_type: String,
    },
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
    cancel: CancellationToken,
}

impl OperationExecutor {
    /// - `actual`: written here, before the handler's Register and before its DeRegister;
    /// - `handlers`: looked up by the plugin type GetInfo returns; adding one releases the plugins
    ///   that were waiting for it (subscribed here);
    /// - `queue`: told about every finished operation and expired backoff, to wake the reconciler;
    /// - `events`: where registrations, failures and deregistrations are published;
    /// - `cancel`: stops backoff timers; running operations finish (see [`Self::drain`]).
    pub fn new(
        actual: Arc<ActualState>,
        handlers: Arc<HandlerRegistry>,
        queue: Arc<ReconcileQueue>,
        config: ExecutorConfig,
        events: EventBus,
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
            cancel,
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
        if let Err(running) = self.claim(path, OperationKind::Register) {
            return Start::AlreadyRunning(running);
        }
        let this = self.clone();
        let path = path.to_path_buf();
        let span =
            info_span!("register", socket_path = %path.display(), generation = %desired.generation);
        self.tasks.spawn(
            async move {
                let Ok(_slot) = this.slots.clone().acquire_owned().await else { return };
                let started = Instant::now();
                match this.run_register(&path, &desired).await {
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
                this.finish(&path);
            }
            .instrument(span),
        );
        Start::Started
    }

    /// Starts deregistering `registered` from `path` unless an operation for it runs.
    pub fn deregister(self: &Arc<Self>, path: &Path, registered: RegisteredPlugin) -> Start {
        if let Err(running) = self.claim(path, OperationKind::Deregister) {
            return Start::AlreadyRunning(running);
        }
        let this = self.clone();
        let path = path.to_path_buf();
        let span = info_span!(
            "deregister", socket_path = %path.display(), plugin_name = %registered.plugin.name,
            plugin_type = %registered.plugin.plugin_type
        );
        self.tasks.spawn(
            async move {
                let Ok(_slot) = this.slots.clone().acquire_owned().await else {
                    return;
                };
                this.run_deregister(&path, registered).await;
                this.finish(&path);
            }
            .instrument(span),
        );
        Start::Started
    }

    /// The socket at `path` left the tree: forget its backoff.
    pub fn forget(&self, path: &Path) {
        self.backoff.forget_path(path);
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
        let (mut connection, info) =
            PluginConnection::get_info(path, desired.socket, self.config.plugin_timeouts).await?;
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

        if let Err(e) = call_handler(handler.validate(&plugin), timeouts.validate).await {
            let error = handler_error("plugin validation failed", e, &plugin);
            notify_failure(&mut connection, &error.to_string()).await;
            return Err(error);
        }
        let entry = self.actual.add(
            path,
            desired.generation,
            desired.socket,
            plugin.clone(),
            handler.clone(),
        );
        if let Err(e) = call_handler(handler.register(&plugin), timeouts.register).await {
            let error = handler_error("plugin registration failed", e, &plugin);
            notify_failure(&mut connection, &error.to_string()).await;
            self.roll_back(path, &entry).await;
            return Err(error);
        }
        if let Err(e) = connection.notify(true, "").await {
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
        if let Err(e) = call_handler(
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
            return;
        }
        let _name = self
            .name_locks
            .lock(&entry.plugin.plugin_type, &entry.plugin.name)
            .await;
        match call_handler(
            entry.handler.deregister(&entry.plugin),
            self.config.handler_timeouts.deregister,
        )
        .await
        {
            Ok(()) => info!("plugin deregistered"),
            Err(e) => {
                warn!(error = %e, "handler failed to deregister plugin");
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
        if matches!(
            error,
            RegisterError::Plugin(RegistrationError::SocketGone(_))
        ) {
            debug!(%error, "socket vanished during registration");
            return;
        }
        let mut event = AgentEvent::new(EventKind::RegistrationFailed, path);
        event.error = Some(error.to_string());
        self.events.publish(event);
        let backoff = self.backoff.fail(
            path,
            desired.socket,
            error.to_string(),
            kind,
            Instant::now(),
        );
        warn!(%error, failures = backoff.failures, retry_in = ?backoff.delay, "plugin registration failed");
        let queue = self.queue.clone();
        let cancel = self.cancel.clone();
        let path = path.to_path_buf();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep_until(backoff.retry_at) => queue.mark(path),
                _ = cancel.cancelled() => {}
            }
        });
    }

    fn claim(&self, path: &Path, kind: OperationKind) -> Result<(), OperationKind> {
        let mut in_flight = self.lock_in_flight();
        if let Some(running) = in_flight.get(path) {
            return Err(*running);
        }
        in_flight.insert(path.to_path_buf(), kind);
        Ok(())
    }

    fn finish(&self, path: &Path) {
        self.lock_in_flight().remove(path);
        self.queue.mark(path.to_path_buf());
    }

    fn lock_in_flight(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, OperationKind>> {
        self.in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn handler_error(what: &str, error: HandlerError, plugin: &Plugin) -> RegisterError {
    RegisterError::Handler {
        message: format!("{what}: {}", error.message),
        unavailable: error.unavailable,
        plugin_type: plugin.plugin_type.clone(),
    }
}

async fn notify_failure(connection: &mut PluginConnection, reason: &str) {
    if let Err(e) = connection.notify(false, reason).await {
        debug!(error = %e, "could not tell the plugin it was not registered");
    }
}

async fn call_handler(
    call: impl std::future::Future<Output = Result<(), HandlerError>>,
    deadline: Duration,
) -> Result<(), HandlerError> {
    match tokio::time::timeout(deadline, call).await {
        Ok(result) => result,
        Err(_) => Err(HandlerError::rejected(format!(
            "handler did not answer within {deadline:?}"
        ))),
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
