//! Assembles the data flow of DESIGN.md from a configuration and runs it.
//!
//! ```text
//! event source -> watcher -> desired state -> reconciler -> executor -> handlers
//!                                                   actual state <-/
//! ```

use crate::event_source::{self, SourceChoice, SourceKind, SourceOptions};
use crate::events::EventBus;
use crate::executor::{ExecutorConfig, OperationExecutor};
use crate::handler::HandlerRegistry;
use crate::reconciler::{ReconcileMode, ReconcileQueue, Reconciler};
use crate::state::actual::ActualState;
use crate::state::desired::DesiredState;
use crate::telemetry::Telemetry;
use crate::watcher::{Watcher, WatcherStats};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Events buffered between the source and the watcher. When full, the source waits and the
/// kernel-side queue absorbs the burst (and reports loss if it overflows).
const EVENT_CHANNEL: usize = 16 * 1024;

/// Everything the agent needs to run.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The registration directory to watch, recursively.
    pub plugin_dir: PathBuf,
    /// Which event source to use.
    pub source: SourceChoice,
    /// Source tuning.
    pub source_options: SourceOptions,
    /// Event-driven, or kubelet's 1 s polling loop (for comparison).
    pub reconcile_mode: ReconcileMode,
    /// Period of the safety pass in event mode.
    pub safety_period: Duration,
    /// Timeouts and concurrency of operations.
    pub executor: ExecutorConfig,
    /// Where to serve `/metrics`, `/healthz` and `/readyz`; none: not served.
    pub metrics_addr: Option<SocketAddr>,
}

impl AgentConfig {
    /// Kubelet-compatible defaults for `plugin_dir`.
    pub fn new(plugin_dir: PathBuf) -> Self {
        AgentConfig {
            plugin_dir,
            source: SourceChoice::Auto,
            source_options: SourceOptions::default(),
            reconcile_mode: ReconcileMode::Event,
            safety_period: Duration::from_secs(30),
            executor: ExecutorConfig::default(),
            metrics_addr: None,
        }
    }
}

/// A started agent: handles to its state for the CLI, the admin API and tests.
pub struct RunningAgent {
    /// Sockets found under the tree.
    pub desired: Arc<DesiredState>,
    /// Plugins registered with handlers.
    pub actual: Arc<ActualState>,
    /// Handlers by type; may be changed while running.
    pub handlers: Arc<HandlerRegistry>,
    /// The operation executor.
    pub executor: Arc<OperationExecutor>,
    /// The event source in use.
    pub source: SourceKind,
    /// What the source attached, for operators.
    pub source_description: String,
    /// Becomes true once the first full scan is done.
    pub ready: watch::Receiver<bool>,
    /// Discovery and registration events, for the admin API and tests.
    pub events: EventBus,
    /// Watcher counters (rescans, loss, watched directories).
    pub watcher_stats: Arc<WatcherStats>,
    /// Metrics and trace roots the watcher and executor record into.
    pub telemetry: Arc<Telemetry>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (the bound address: port 0 resolved).
    pub metrics_addr: Option<SocketAddr>,
    /// The configuration it runs with.
    pub config: AgentConfig,
    /// When it started.
    pub started_at: std::time::SystemTime,
    cancel: CancellationToken,
    tasks: tokio::task::JoinSet<anyhow::Result<()>>,
}

impl RunningAgent {
    /// Opens the event source, starts the watcher and reconciler, and returns at once.
    /// `handlers` is the initial handler set (it can change later).
    pub async fn start(
        config: AgentConfig,
        handlers: Arc<HandlerRegistry>,
    ) -> anyhow::Result<RunningAgent> {
        let cancel = CancellationToken::new();
        let (events_tx, events_rx) = mpsc::channel(EVENT_CHANNEL);
        let source = event_source::open(
            config.source,
            events_tx,
            cancel.child_token(),
            &config.source_options,
        )
        .await?;
        let source_kind = source.kind();
        let source_description = source.describe();
        info!(source = %source_kind, attached = %source_description, plugin_dir = %config.plugin_dir.display(), "event source open");

        let desired = Arc::new(DesiredState::default());
        let actual = Arc::new(ActualState::default());
        let queue = Arc::new(ReconcileQueue::default());
        let events = EventBus::default();
        let watcher_stats = Arc::new(WatcherStats::default());
        let telemetry = Telemetry::new(source_kind);
        let executor = OperationExecutor::new(
            actual.clone(),
            handlers.clone(),
            queue.clone(),
            config.executor,
            events.clone(),
            telemetry.clone(),
            cancel.child_token(),
        );
        let watcher = Watcher::new(
            config.plugin_dir.clone(),
            source.clone(),
            desired.clone(),
            queue.clone(),
            events.clone(),
            watcher_stats.clone(),
            telemetry.clone(),
        );
        let reconciler = Reconciler::new(
            desired.clone(),
            actual.clone(),
            executor.clone(),
            queue.clone(),
            config.reconcile_mode,
            config.safety_period,
            Some(watcher.rescan_requests()),
        );

        let (ready_tx, ready) = watch::channel(false);

        let mut tasks = tokio::task::JoinSet::new();
        let mut metrics_addr = None;
        if let Some(addr) = config.metrics_addr {
            // Metrics are never a reason not to register plugins: an address in use is reported
            // and the agent runs without them.
            match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => {
                    let bound = listener.local_addr()?;
                    let registry =
                        telemetry
                            .metrics
                            .registry(crate::telemetry::metrics::StateCollector {
                                desired: desired.clone(),
                                actual: actual.clone(),
                                handlers: handlers.clone(),
                                executor: executor.clone(),
                                watcher: watcher_stats.clone(),
                                source,
                            });
                    info!(addr = %bound, "serving /metrics, /healthz and /readyz");
                    let (ready, http_cancel) = (ready.clone(), cancel.clone());
                    let stats = watcher_stats.clone();
                    tasks.spawn(async move {
                        crate::telemetry::http::serve(listener, registry, ready, stats, http_cancel)
                            .await
                    });
                    metrics_addr = Some(bound);
                }
                Err(e) => {
                    warn!(addr = %addr, error = %e, "cannot serve metrics and health; running without them")
                }
            }
        }
        let reconciler_cancel = cancel.clone();
        tasks.spawn(async move {
            reconciler.run(reconciler_cancel).await;
            Ok(())
        });
        let watcher_cancel = cancel.clone();
        tasks.spawn(async move {
            watcher
                .run(events_rx, watcher_cancel, move || {
                    let _ = ready_tx.send(true);
                })
                .await
        });
        Ok(RunningAgent {
            desired,
            actual,
            handlers,
            executor,
            source: source_kind,
            source_description,
            ready,
            events,
            watcher_stats,
            telemetry,
            metrics_addr,
            config,
            started_at: std::time::SystemTime::now(),
            cancel,
            tasks,
        })
    }

    /// Waits for the first full scan of the plugin directory.
    pub async fn wait_ready(&mut self) {
        let _ = self.ready.wait_for(|ready| *ready).await;
    }

    /// Runs until `shutdown` resolves or a component fails; then stops discovery, lets running
    /// operations finish, and returns.
    pub async fn run_until(
        mut self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let result = tokio::select! {
            _ = shutdown => Ok(()),
            Some(done) = self.tasks.join_next() => match done {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(anyhow::anyhow!("agent task failed: {e}")),
            },
        };
        self.stop().await;
        result
    }

    /// Stops discovery and reconciliation and waits for running operations, for at most
    /// [`crate::shutdown::OPERATIONS_GRACE`] in all (what is left is ended with the process).
    pub async fn stop(&mut self) {
        self.cancel.cancel();
        let deadline = tokio::time::Instant::now() + crate::shutdown::OPERATIONS_GRACE;
        let tasks = async { while self.tasks.join_next().await.is_some() {} };
        crate::shutdown::until(deadline, "agent tasks", tasks).await;
        crate::shutdown::until(deadline, "running operations", self.executor.drain()).await;
    }
}
