//! The runner: what the executor's [`OperationRunner`] calls, and what is set on it at start
//! (admission, journal, first contacts) and asked of it while the agent runs (a policy reload,
//! the restored registrations' servers).

use super::admission::{Admission, PolicyReload};
use super::failed::Failures;
use super::failure::Rejection;
use super::handler_calls::HandlerCalls;
use super::records::Records;
use super::report;
use crate::event_source::monotonic_now_ns;
use crate::executor::ExecutorConfig;
use crate::handler::HandlerRegistry;
use crate::liveness::{Liveness, ServedBy, Server, Unserved};
use crate::notifications::{AgentEvent, EventKind, NotificationBus};
use crate::policy::Policy;
use crate::provenance::Resolver;
use crate::state::actual::{ActualState, RegisteredPlugin};
use crate::state::backoff::BackoffTable;
use crate::state::desired::{DesiredPlugin, DesiredState};
use crate::state::queue::ReconcileQueue;
use crate::telemetry::Telemetry;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

/// What the runner is built over.
pub struct RunnerParts {
    /// Written before the handler's Register and before its DeRegister.
    pub actual: Arc<ActualState>,
    /// Looked up by the plugin type GetInfo returns.
    pub handlers: Arc<HandlerRegistry>,
    /// Where each outcome is recorded for the socket (the executor reads it).
    pub backoff: Arc<BackoffTable>,
    /// Marked for what a reload or a restore changes.
    pub queue: Arc<ReconcileQueue>,
    /// Watches each registered plugin's server.
    pub liveness: Arc<Liveness>,
    /// Where a socket nothing serves is recorded.
    pub unserved: Arc<Unserved>,
    /// Where registrations, failures and deregistrations are published.
    pub notifications: NotificationBus,
    /// Outcomes, latencies and handler calls; each operation's span is a child of its socket's
    /// discovery.
    pub telemetry: Arc<Telemetry>,
}

/// See the module docs.
pub struct Runner {
    pub(super) config: ExecutorConfig,
    pub(super) actual: Arc<ActualState>,
    pub(super) handlers: Arc<HandlerRegistry>,
    queue: Arc<ReconcileQueue>,
    pub(super) records: Records,
    pub(super) admission: Admission,
    pub(super) calls: HandlerCalls,
    /// Failures' records, and the backoff table, bus and telemetry they write.
    pub(super) failures: Failures,
    pub(super) liveness: Arc<Liveness>,
    /// Desired state, read in observe mode for kubelet's first contact (see
    /// [`crate::mode::Contact::AfterKubelet`]), and where a dial that reached a socket records
    /// it listening; unset: no first contact is ever known, no listen recorded.
    pub(super) desired: OnceLock<Arc<DesiredState>>,
    /// Records each plugin call's steps (dial, GetInfo, Notify) in the metrics.
    pub(super) steps: crate::registration::StepTimer,
    /// The agent's shutdown: a dial not answered yet is dropped.
    pub(super) cancel: CancellationToken,
    /// The tables and circumstances a socket's reason is derived from, for the span of each
    /// registration (set at start; unset: no reason is recorded).
    verdicts: OnceLock<crate::state::view::StateView>,
}

impl Runner {
    /// The steps of operations over `parts`, with `config`'s deadlines and mode.
    pub fn new(
        parts: RunnerParts,
        config: &ExecutorConfig,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        let telemetry = parts.telemetry;
        Arc::new(Runner {
            config: *config,
            records: Records::new(parts.actual.clone()),
            actual: parts.actual,
            handlers: parts.handlers,
            queue: parts.queue,
            admission: Admission::default(),
            calls: HandlerCalls::new(config.handler_timeouts, telemetry.clone()),
            failures: Failures {
                backoff: parts.backoff,
                unserved: parts.unserved,
                notifications: parts.notifications,
                telemetry: telemetry.clone(),
            },
            liveness: parts.liveness,
            desired: OnceLock::new(),
            verdicts: OnceLock::new(),
            steps: report::step_timer(telemetry),
            cancel,
        })
    }

    /// Uses `provenance` (the agent's resolver) and `policy`; set before the first operation.
    pub fn with_admission(&self, provenance: Arc<Resolver>, policy: Policy) {
        self.admission.set(provenance, policy);
    }

    /// Records operations in `journal` from now on (see `persist`).
    pub fn keep_journal(&self, journal: Arc<crate::persist::Journal>) {
        self.records.keep_journal(journal);
    }

    /// Derives each registration's reason (its span's) from `view`.
    pub fn derive_reasons_from(&self, view: crate::state::view::StateView) {
        let _ = self.verdicts.set(view);
    }

    /// The reason of the socket at `path` now (see `state::verdict`).
    pub(super) fn reason_of(&self, path: &std::path::Path) -> Option<&'static str> {
        let view = self.verdicts.get()?;
        Some(
            view.status(path, tokio::time::Instant::now())
                .reason
                .label(),
        )
    }

    /// Reads first contacts from `desired`, where the watcher records them (observe mode), and
    /// records there when a dial first reached a socket.
    pub fn watch_contacts(&self, desired: Arc<DesiredState>) {
        let _ = self.desired.set(desired);
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

    /// Puts `policy` in force and applies it to every plugin: registered ones it refuses are
    /// held (the reconciler deregisters them), refused ones are tried again.
    pub fn reload_policy(&self, policy: Policy) -> PolicyReload {
        let mut reload = PolicyReload {
            rules: policy.len(),
            ..PolicyReload::default()
        };
        self.admission.put_in_force(policy);
        // Refusals of the old policy first: the plugins refused below are refused by this one.
        for path in self.failures.backoff.release_rejected() {
            reload.retried += 1;
            self.queue.mark(path);
        }
        for (path, entry) in self.actual.snapshot() {
            let plugin = &entry.plugin;
            let verdict =
                self.admission
                    .check(&plugin.plugin_type, &plugin.name, &entry.provenance);
            if let Err(refusal) = verdict {
                reload.refused += 1;
                let rejected = Rejection {
                    refusal,
                    plugin: entry.plugin,
                    provenance: entry.provenance,
                };
                self.failures.rejected(&path, entry.socket, rejected);
                self.queue.mark(path);
            }
        }
        info!(
            rules = reload.rules,
            refused = reload.refused,
            retried = reload.retried,
            "policy reloaded"
        );
        reload
    }

    /// A registration that succeeded (`started` when it got its slot), its actual-state `entry`:
    /// its socket's failures cleared, then recorded, its server watched, and reported.
    pub(super) fn registered(
        &self,
        desired: &DesiredPlugin,
        entry: RegisteredPlugin,
        server: Option<Server>,
        started: Instant,
    ) {
        let path: &Path = &desired.path;
        self.failures.backoff.reset(path, desired.socket);
        let since_event = desired
            .kernel_ns
            .map(|ns| Duration::from_nanos(monotonic_now_ns().saturating_sub(ns)));
        let (kind, said) = if self.config.mode.observes() {
            (EventKind::Observed, "plugin observed")
        } else {
            (EventKind::Registered, "plugin registered")
        };
        // Recorded before it is reported: a kill after the report loses nothing.
        let provenance = self.records.registered(path, &entry);
        let plugin = entry.plugin;
        let (served_by, created_by) = report::describe(provenance.as_ref());
        if let Some(server) = server {
            debug!(%server, "the plugin's server, watched for its exit");
            self.liveness.watch(
                desired.path.clone(),
                desired.generation,
                desired.socket,
                (server, ServedBy::Registration),
            );
        }
        info!(
            plugin_name = %plugin.name, plugin_type = %plugin.plugin_type, endpoint = %plugin.endpoint,
            server = %served_by, creator = %created_by, took = ?started.elapsed(), since_kernel_event = ?since_event, "{said}"
        );
        let mut event = AgentEvent::new(kind, path);
        event.latency = since_event.or_else(|| desired.seen_at.elapsed().ok());
        event.plugin = Some(plugin);
        event.provenance = provenance;
        self.failures.notifications.publish(event);
    }
}
