//! A started agent: its stages assembled, its first walk awaited, its tasks run until a stop,
//! and the policy reloads it takes from SIGHUP and the admin API.

use super::config::AgentConfig;
use super::policy_reload::{PolicyReloader, ReloadTrigger};
use super::stages::Stages;
use crate::admin::server::{StartPhases, StartReport};
use crate::event_source::{self, SourceKind, SourceStart};
use crate::executor::OperationExecutor;
use crate::handler::HandlerRegistry;
use crate::notifications::NotificationBus;
use crate::operations::Runner;
use crate::persist::RestoreReport;
use crate::policy::Policy;
use crate::state::actual::ActualState;
use crate::state::desired::DesiredState;
use crate::state::view::StateView;
use crate::telemetry::Telemetry;
use crate::telemetry::metrics::StateCollector;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// When this process started: set first thing in `main` (`mark_process_start`), so a start's
/// first phase covers parsing, logging and the runtime too. Unset (an agent started inside a test
/// or another program): the start is timed from `RunningAgent::start`.
static PROCESS_START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Records now as the process's start; only the first call counts.
pub fn mark_process_start() {
    let _ = PROCESS_START.set(Instant::now());
}

/// Where a start's time went, reported once, when the first walk is done: from then on every
/// event is handled as it comes (with adopted eBPF pins, what the kernel recorded while no agent
/// ran first). One log line (`agent started`, milliseconds per phase) that the benchmark's
/// restart rows report, and status's `start_phases`, which an operator reads after a restart or
/// an upgrade.
struct StartClock {
    /// Process start (or `RunningAgent::start`) to opening the event source: command line,
    /// logging, runtime, lock, handlers, policy.
    began: Instant,
    source_opening: Instant,
    /// The source open: a load (BTF, verifier, attach) or an adoption of pinned programs; the
    /// fanotify or inotify group made.
    source_open: Instant,
    /// Metrics served and the previous agent's state read back (`persist`).
    restored: Instant,
}

impl StartClock {
    /// Logs the phases and returns them; `walked` is when the first walk finished.
    fn report(&self, walked: Instant, source: SourceKind) -> StartPhases {
        let phases = StartPhases {
            setup: self.source_opening.saturating_duration_since(self.began),
            event_source: self
                .source_open
                .saturating_duration_since(self.source_opening),
            state: self.restored.saturating_duration_since(self.source_open),
            first_walk: walked.saturating_duration_since(self.restored),
        };
        let ms = |took: std::time::Duration| (took.as_secs_f64() * 1e4).round() / 10.0;
        info!(
            %source,
            took_ms = ms(phases.took()),
            setup_ms = ms(phases.setup),
            event_source_ms = ms(phases.event_source),
            state_ms = ms(phases.state),
            first_walk_ms = ms(phases.first_walk),
            "agent started: first walk done, events handled as they come"
        );
        phases
    }

    /// What the watcher calls once the start walk is done: the phases reported (the log line,
    /// status's `start_phases`), then readiness told.
    fn on_walked(
        self,
        report: Arc<StartReport>,
        source: SourceKind,
        ready: watch::Sender<bool>,
    ) -> impl FnOnce() + Send + 'static {
        move || {
            let _ = report.phases.set(self.report(Instant::now(), source));
            let _ = ready.send(true);
        }
    }
}

/// Hints (`FsEvent`s) buffered between the source and the watcher. When full, the source waits and the
/// kernel-side queue absorbs the burst (and reports loss if it overflows).
const HINT_CHANNEL: usize = 16 * 1024;

/// A started agent: handles to its state for the CLI, the admin API and tests.
pub struct RunningAgent {
    /// Sockets found under the tree.
    pub desired: Arc<DesiredState>,
    /// Plugins registered with handlers.
    pub actual: Arc<ActualState>,
    /// Handlers by type; may be changed while running.
    pub handlers: Arc<HandlerRegistry>,
    /// The operation executor (scheduling).
    pub executor: Arc<OperationExecutor>,
    /// The operations it runs (admission, journal, policy reloads).
    runner: Arc<Runner>,
    /// The event source in use.
    pub source: SourceKind,
    /// What the source attached, for operators.
    pub source_description: String,
    /// What the kernel gives the agent (found once at start).
    pub kernel: Arc<crate::kernel::KernelFeatures>,
    /// Becomes true once the first full scan is done.
    pub ready: watch::Receiver<bool>,
    /// Discovery and registration notifications, for the admin API and tests.
    pub notifications: NotificationBus,
    /// Metrics, trace roots and watcher counters (rescans, loss, watched directories) that the
    /// watcher and executor record into.
    pub telemetry: Arc<Telemetry>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (the bound address: port 0 resolved).
    pub metrics_addr: Option<SocketAddr>,
    /// The configuration it runs with.
    pub config: AgentConfig,
    /// When it started.
    pub started_at: std::time::SystemTime,
    /// What the node says, for the verdicts (`state::verdict`).
    circumstances: Arc<crate::state::verdict::Circumstances>,
    /// How it started (the source, the restore; the phases once the first walk is done).
    pub start: Arc<StartReport>,
    /// Who serves each registered plugin, for `list`.
    liveness: Arc<crate::liveness::Liveness>,
    cancel: CancellationToken,
    tasks: tokio::task::JoinSet<anyhow::Result<()>>,
    /// The state on disk, flushed last: after running operations ended, so it says what they did.
    journal: Option<Arc<crate::persist::Journal>>,
}

impl RunningAgent {
    /// Opens the event source, starts the watcher and reconciler, and returns at once.
    /// `handlers` is the initial handler set (it can change later).
    pub async fn start(
        config: AgentConfig,
        handlers: Arc<HandlerRegistry>,
    ) -> anyhow::Result<RunningAgent> {
        let began = PROCESS_START.get().copied().unwrap_or_else(Instant::now);
        let policy = Policy::compile(&config.policy.rules()?)?;
        let cancel = CancellationToken::new();
        let source_opening = Instant::now();
        let (hints_tx, hints_rx) = mpsc::channel(HINT_CHANNEL);
        let (source, source_description, source_start) =
            open_source(&config, hints_tx, &cancel).await?;
        let source_open = Instant::now();
        let source_kind = source.kind();
        let kernel = Arc::new(crate::kernel::probe(source.fentry()));
        kernel.log();

        let stages = Stages::assemble(&config, &handlers, source.clone(), &cancel);
        // A source that breaks while running (pins removed by someone else) says so where
        // status and /readyz look, until it has mended itself.
        let watcher_stats = stages.telemetry.watcher.clone();
        source.report_problems_to(Box::new(move |problem| {
            watcher_stats.health.condition("event source", problem);
        }));
        stages.admit_with(policy);

        let (ready_tx, ready) = watch::channel(false);

        let mut tasks = tokio::task::JoinSet::new();
        let metrics_addr = match config.metrics_addr {
            Some(addr) => {
                let collector = stages.collector(&handlers, source, kernel.clone());
                let served = (&*stages.telemetry, ready.clone(), cancel.clone());
                serve_metrics(addr, collector, served, &mut tasks).await?
            }
            None => None,
        };
        let (journal, restore) = config
            .state_file
            .as_ref()
            .map(|file| carry_on(&config, file, &stages, &handlers, ready.clone()))
            .unzip();
        let clock = StartClock {
            began,
            source_opening,
            source_open,
            restored: Instant::now(),
        };
        let start = Arc::new(StartReport {
            source: source_start,
            restore,
            ..StartReport::default()
        });
        let (reconciler, watcher) = (stages.reconciler, stages.watcher);
        let reconciler_cancel = cancel.clone();
        tasks.spawn(async move {
            reconciler.run(reconciler_cancel).await;
            Ok(())
        });
        let walked = clock.on_walked(start.clone(), source_kind, ready_tx);
        let watcher_cancel = cancel.clone();
        tasks.spawn(async move { watcher.run(hints_rx, watcher_cancel, walked).await });
        Ok(RunningAgent {
            desired: stages.desired,
            actual: stages.actual,
            handlers,
            executor: stages.executor,
            runner: stages.runner,
            source: source_kind,
            source_description,
            kernel,
            ready,
            notifications: stages.notifications,
            telemetry: stages.telemetry,
            circumstances: stages.circumstances,
            metrics_addr,
            config,
            started_at: std::time::SystemTime::now(),
            start,
            liveness: stages.liveness,
            cancel,
            tasks,
            journal,
        })
    }

    /// The tables a plugin's state is derived from, for the admin API and tests.
    pub fn state_view(&self) -> StateView {
        StateView {
            desired: self.desired.clone(),
            actual: self.actual.clone(),
            backoff: self.executor.backoffs(),
            circumstances: self.circumstances.clone(),
        }
    }

    /// What the admin API serves of this agent.
    pub fn served(&self) -> crate::admin::server::Served {
        let mode = self.config.executor.mode;
        crate::admin::server::Served {
            state: self.state_view(),
            handlers: self.handlers.clone(),
            notifications: self.notifications.clone(),
            stats: self.telemetry.watcher.clone(),
            status: crate::admin::server::AgentStatus {
                source: self.source.to_string(),
                sees_contacts: self.source.reports_contacts(),
                source_description: self.source_description.clone(),
                plugin_dir: self.config.plugin_dir.display().to_string(),
                reconcile_mode: format!("{:?}", self.config.reconcile_mode).to_lowercase(),
                mode: mode.to_string(),
                started_at: self.started_at,
                kernel: self.kernel.clone(),
                metrics_addr: self.metrics_addr,
                start: self.start.clone(),
            },
            observes: mode.observes(),
            policy: Arc::new(self.policy_reloader(ReloadTrigger::AdminApi)),
            liveness: self.liveness.clone(),
        }
    }

    /// What reads the policy again and applies it, for `trigger` (`plugin-agent policy
    /// reload`, SIGHUP).
    pub fn policy_reloader(&self, trigger: ReloadTrigger) -> PolicyReloader {
        PolicyReloader::new(
            self.config.policy.clone(),
            self.runner.clone(),
            self.notifications.clone(),
            trigger,
        )
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
        if let Some(journal) = &self.journal {
            journal.flush();
        }
    }
}

/// Opens `config`'s event source, sending its hints to `hints`; the source, what it attached
/// (with the sources `--source auto` passed over, and why) and how it started, for operators.
async fn open_source(
    config: &AgentConfig,
    hints: mpsc::Sender<crate::event_source::FsEvent>,
    cancel: &CancellationToken,
) -> anyhow::Result<(
    Arc<dyn crate::event_source::EventSource>,
    String,
    SourceStart,
)> {
    let event_source::Opened {
        source,
        passed_over,
        start,
    } = event_source::open(
        config.source,
        hints,
        cancel.child_token(),
        &config.source_options,
    )
    .await?;
    let description = match passed_over.is_empty() {
        true => source.describe(),
        false => format!(
            "{}; passed over {}",
            source.describe(),
            passed_over.join("; ")
        ),
    };
    info!(source = %source.kind(), attached = %description, plugin_dir = %config.plugin_dir.display(), "event source open");
    Ok((source, description, start))
}

/// Puts back what the previous agent registered (unless told not to) and hands the executor the
/// journal that records what finishes from now on; returns it and what was put back.
fn carry_on(
    config: &AgentConfig,
    file: &std::path::Path,
    stages: &Stages,
    handlers: &HandlerRegistry,
    mut walked: watch::Receiver<bool>,
) -> (Arc<crate::persist::Journal>, RestoreReport) {
    if config.reregister_on_restart {
        info!(state_file = %file.display(), "--reregister-on-restart: registering every plugin found again");
    }
    let (journal, entries) = crate::persist::Journal::open(
        file,
        &config.plugin_dir,
        config.reregister_on_restart,
        stages.actual.clone(),
    );
    let report = crate::persist::Restore {
        desired: &stages.desired,
        actual: &stages.actual,
        handlers,
        observing: matches!(config.executor.mode, crate::mode::Mode::Observe { .. }),
    }
    .apply(entries);
    let stats = stages.telemetry.watcher.clone();
    journal.report_problems_to(Box::new(move |problem| {
        stats.health.condition("state file", problem);
    }));
    journal.restored();
    if report != RestoreReport::default() {
        info!(
            state_file = %file.display(),
            restored = report.restored,
            handler_changed = report.handler_changed,
            interrupted = report.interrupted,
            "carrying on from the previous agent's state: unchanged plugins are not called again"
        );
    }
    let journal = Arc::new(journal);
    stages.runner.keep_journal(journal.clone());
    // Restored registrations have no registration connection to learn their servers from: the
    // servers the previous agent recorded are found again by pid (else one connect each learns
    // them), after the first walk, which decides what changed while no agent ran. A server that
    // exited meanwhile is found then (its pidfd is readable at once, or the connect refused).
    let runner = stages.runner.clone();
    tokio::spawn(async move {
        if walked.wait_for(|walked| *walked).await.is_ok() {
            runner.watch_restored();
        }
    });
    (journal, report)
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` as one of the agent's `tasks`, and
/// returns the bound address (port 0 resolved). Metrics are never a reason not to register
/// plugins: an address that cannot be bound is reported and the agent runs without them.
async fn serve_metrics(
    addr: SocketAddr,
    collector: StateCollector,
    (telemetry, ready, cancel): (&Telemetry, watch::Receiver<bool>, CancellationToken),
    tasks: &mut tokio::task::JoinSet<anyhow::Result<()>>,
) -> anyhow::Result<Option<SocketAddr>> {
    let metrics = &telemetry.metrics;
    let registry = (metrics.registry(collector), metrics.renders());
    let watcher = telemetry.watcher.clone();
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(e) => {
            warn!(addr = %addr, error = %e, "cannot serve metrics and health; running without them");
            return Ok(None);
        }
    };
    let bound = listener.local_addr()?;
    info!(addr = %bound, "serving /metrics, /healthz and /readyz");
    tasks.spawn(async move {
        crate::telemetry::http::serve(listener, registry, ready, watcher, cancel).await
    });
    Ok(Some(bound))
}
