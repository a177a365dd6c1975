//! The data flow's stages, wired together but not yet running, as `docs/architecture.md` draws
//! them: the caches, the reconcile queue, the bus and telemetry; liveness and its unserved
//! bookkeeping; the operations' runner, the executor that schedules it, the watcher and the
//! reconciler that asks the executor.

use super::config::AgentConfig;
use crate::event_source::EventSource;
use crate::executor::{ExecutorConfig, ExecutorParts, OperationExecutor};
use crate::handler::HandlerRegistry;
use crate::liveness::{Liveness, Unserved};
use crate::notifications::NotificationBus;
use crate::operations::{Runner, RunnerParts};
use crate::provenance::Resolver;
use crate::reconciler::Reconciler;
use crate::state::actual::ActualState;
use crate::state::backoff::BackoffTable;
use crate::state::desired::DesiredState;
use crate::state::queue::ReconcileQueue;
use crate::state::verdict::{Circumstances, Kubelet};
use crate::state::view::StateView;
use crate::telemetry::Telemetry;
use crate::watcher::Watcher;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// See the module docs.
pub(super) struct Stages {
    pub(super) desired: Arc<DesiredState>,
    pub(super) actual: Arc<ActualState>,
    pub(super) backoff: Arc<BackoffTable>,
    pub(super) notifications: NotificationBus,
    pub(super) telemetry: Arc<Telemetry>,
    pub(super) runner: Arc<Runner>,
    pub(super) executor: Arc<OperationExecutor>,
    pub(super) watcher: Watcher,
    pub(super) reconciler: Reconciler<OperationExecutor>,
    pub(super) provenance: Arc<Resolver>,
    /// What the node says, for every view's verdict (`state::verdict`).
    pub(super) circumstances: Arc<Circumstances>,
    /// Who serves each registered plugin, for `list`.
    pub(super) liveness: Arc<Liveness>,
}

/// The tables every stage shares.
struct Tables {
    desired: Arc<DesiredState>,
    actual: Arc<ActualState>,
    backoff: Arc<BackoffTable>,
    queue: Arc<ReconcileQueue>,
}

impl Stages {
    /// The tables a plugin's state is derived from, for metrics and the admin API.
    pub(super) fn state_view(&self) -> StateView {
        StateView {
            desired: self.desired.clone(),
            actual: self.actual.clone(),
            backoff: self.backoff.clone(),
            circumstances: self.circumstances.clone(),
        }
    }

    /// What the metrics read at scrape time: the plugins' states, the handlers, the watcher's
    /// counters, the source and the kernel's features.
    pub(super) fn collector(
        &self,
        handlers: &Arc<HandlerRegistry>,
        source: Arc<dyn EventSource>,
        kernel: Arc<crate::kernel::KernelFeatures>,
    ) -> crate::telemetry::metrics::StateCollector {
        crate::telemetry::metrics::StateCollector {
            state: self.state_view(),
            handlers: handlers.clone(),
            watcher: self.telemetry.watcher.clone(),
            source,
            kernel,
        }
    }

    /// Puts `policy` in force for the operations, with the agent's provenance resolver, and
    /// lets them read kubelet's first contacts.
    pub(super) fn admit_with(&self, policy: crate::policy::Policy) {
        if !policy.is_empty() {
            tracing::info!(rules = policy.len(), "policy in force");
        }
        self.runner.with_admission(self.provenance.clone(), policy);
        self.runner.watch_contacts(self.desired.clone());
        self.runner.derive_reasons_from(self.state_view());
    }

    /// Creates the caches and the stages over them (see the module docs).
    pub(super) fn assemble(
        config: &AgentConfig,
        handlers: &Arc<HandlerRegistry>,
        source: Arc<dyn EventSource>,
        cancel: &CancellationToken,
    ) -> Stages {
        let tables = Tables {
            desired: Arc::default(),
            actual: Arc::default(),
            backoff: Arc::default(),
            queue: Arc::default(),
        };
        let circumstances = Arc::new(Circumstances::new(
            config.executor.mode.observes(),
            source.kind().reports_contacts(),
            running_kubelets,
        ));
        // Events carry their socket's reason as it is when they are published.
        let notifications = NotificationBus::deriving_reasons(StateView {
            desired: tables.desired.clone(),
            actual: tables.actual.clone(),
            backoff: tables.backoff.clone(),
            circumstances: circumstances.clone(),
        });
        let telemetry = Telemetry::new(source.kind());
        let (runner, executor, liveness) = Self::operations(
            &tables,
            handlers,
            (&notifications, &telemetry),
            ExecutorConfig {
                listens_reported: source.kind().reports_listens(),
                ..config.executor
            },
            cancel,
        );
        let watcher = Watcher::new(
            config.plugin_dir.clone(),
            source,
            tables.desired.clone(),
            tables.queue.clone(),
            notifications.clone(),
            telemetry.clone(),
        )
        .with_liveness(liveness.clone());
        let reconciler = Reconciler::new(
            tables.desired.clone(),
            tables.actual.clone(),
            executor.clone(),
            tables.queue,
            config.reconcile_mode,
            config.safety_period,
            watcher.safety_pass(),
        );
        let provenance = Arc::new(if config.provenance {
            Resolver::default()
        } else {
            Resolver::kernel_only()
        });
        Stages {
            desired: tables.desired,
            actual: tables.actual,
            backoff: tables.backoff,
            notifications,
            telemetry,
            runner,
            executor,
            watcher,
            reconciler,
            provenance,
            circumstances,
            liveness,
        }
    }

    /// Liveness with its unserved bookkeeping, the operations' runner and the executor that
    /// schedules it, over `tables`.
    fn operations(
        tables: &Tables,
        handlers: &Arc<HandlerRegistry>,
        (notifications, telemetry): (&NotificationBus, &Arc<Telemetry>),
        config: ExecutorConfig,
        cancel: &CancellationToken,
    ) -> (Arc<Runner>, Arc<OperationExecutor>, Arc<Liveness>) {
        let liveness = Arc::new(Liveness::new(notifications.clone()));
        let unserved = Unserved::new(
            tables.actual.clone(),
            tables.backoff.clone(),
            tables.queue.clone(),
            notifications.clone(),
            telemetry.clone(),
        );
        let runner = Runner::new(
            RunnerParts {
                actual: tables.actual.clone(),
                handlers: handlers.clone(),
                backoff: tables.backoff.clone(),
                queue: tables.queue.clone(),
                liveness: liveness.clone(),
                unserved: unserved.clone(),
                notifications: notifications.clone(),
                telemetry: telemetry.clone(),
            },
            &config,
            cancel.child_token(),
        );
        let parts = ExecutorParts {
            backoff: tables.backoff.clone(),
            desired: tables.desired.clone(),
            queue: tables.queue.clone(),
            liveness: liveness.clone(),
            unserved,
            handlers: handlers.clone(),
            telemetry: telemetry.clone(),
        };
        let executor = OperationExecutor::new(runner.clone(), parts, &config, cancel.child_token());
        (runner, executor, liveness)
    }
}

/// The node's running kubelets, read from `/proc`, for the verdict's directory check.
fn running_kubelets() -> Vec<Kubelet> {
    crate::kubelet::running(std::path::Path::new("/proc"))
        .into_iter()
        .map(|k| Kubelet {
            pid: k.pid,
            plugins_registry: k.plugins_registry,
            root_dir_from: k.root_dir_from,
        })
        .collect()
}
