//! The runner: what the executor's [`OperationRunner`] calls, and what is set on it at start
//! (admission, journal, first contacts) and asked of it while the agent runs (a policy reload,
//! the restored registrations' servers).

use super::admission::{Admission, PolicyReload};
use super::failed::Failures;
use super::failure::{RegisterFailure, Rejection};
use super::handler_calls::HandlerCalls;
use super::records::Records;
use super::report;
use crate::event_source::monotonic_now_ns;
use crate::executor::{Ended, ExecutorConfig, Operation, OperationRunner, Registration, Slot};
use crate::handler::{HandlerRegistry, Plugin};
use crate::liveness::{Liveness, Server, Unserved};
use crate::mode::Mode;
use crate::notifications::{AgentEvent, EventKind, NotificationBus};
use crate::policy::Policy;
use crate::provenance::Resolver;
use crate::state::actual::{ActualState, RegisteredPlugin};
use crate::state::backoff::BackoffTable;
use crate::state::desired::{DesiredPlugin, DesiredState};
use crate::state::queue::ReconcileQueue;
use crate::telemetry::Telemetry;
use crate::telemetry::discovery::Via;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::field::Empty;
use tracing::{Instrument, debug, info, info_span};

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
    /// [`crate::mode::Contact::AfterKubelet`]); unset: no first contact is ever known.
    pub(super) contacts: OnceLock<Arc<DesiredState>>,
    /// Records each plugin call's steps (dial, GetInfo, Notify) in the metrics.
    pub(super) steps: crate::registration::StepTimer,
    /// The agent's shutdown: a dial not answered yet is dropped.
    pub(super) cancel: CancellationToken,
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
            contacts: OnceLock::new(),
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

    /// Reads first contacts from `desired`, where the watcher records them (observe mode).
    pub fn watch_contacts(&self, desired: Arc<DesiredState>) {
        let _ = self.contacts.set(desired);
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

    /// The `register` span of `registration` (for the log), and the context to run it in when
    /// traces are on (see `telemetry::sampling::OperationTrace`).
    fn register_span(
        &self,
        registration: &Registration,
        source: &'static str,
    ) -> (tracing::Span, Option<opentelemetry::Context>) {
        let Registration {
            path,
            desired,
            attempt,
            queued,
            ..
        } = registration;
        let attempt = *attempt;
        let slot_wait_ms = queued.elapsed().as_millis() as u64;
        let make = || {
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
        };
        let fields = || {
            vec![
                ("generation", desired.generation.to_string().into()),
                ("event_source", source.into()),
                ("attempt", i64::from(attempt).into()),
                ("slot_wait_ms", (slot_wait_ms as i64).into()),
            ]
        };
        let telemetry = &self.failures.telemetry;
        report::operation_span(telemetry, "register", path, make, fields)
    }

    /// Runs the mode's steps; what they found, as the report and the failure records want it.
    async fn steps(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        slot: &mut Slot,
        found: Option<tokio::net::UnixStream>,
    ) -> (Result<Plugin, RegisterFailure>, Option<Server>) {
        // Boxed where awaited: this future lives as long as the operation (through every pause
        // of a socket that does not listen yet), the steps only while they run.
        match self.config.mode {
            Mode::Register => Box::pin(self.run_register(path, desired, slot, found)).await,
            Mode::Observe { contact } => {
                Box::pin(self.run_observe(path, desired, slot, found, contact)).await
            }
        }
        .map_or_else(|e| (Err(e), None), |(plugin, server)| (Ok(plugin), server))
    }

    /// A registration that succeeded (`started` when it got its slot): its socket's failures
    /// cleared, then recorded, its server watched, and reported.
    fn registered(
        &self,
        desired: &DesiredPlugin,
        plugin: Plugin,
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
        let provenance = self.records.registered(path, desired);
        let (served_by, created_by) = report::describe(provenance.as_ref());
        if let Some(server) = server {
            debug!(%server, "the plugin's server, watched for its exit");
            self.liveness.watch(
                desired.path.clone(),
                desired.generation,
                desired.socket,
                server,
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

impl OperationRunner for Runner {
    /// A registration: its span, its steps, and what its outcome changes. The span's and the
    /// trace's making stay out of the future, which a registration waiting for its socket to
    /// listen holds all along (it was 7.7 KB, 16,000 of them waiting behind bind-only sockets).
    fn register(self: Arc<Self>, registration: Registration) -> Operation<Ended> {
        let via = match registration.desired.by_event {
            true => Via::Event,
            false => Via::Scan,
        };
        let source = self.failures.telemetry.discovery.label(via);
        let (span, context) = self.register_span(&registration, source);
        let operation = async move {
            let started = Instant::now();
            let Registration {
                path,
                desired,
                mut slot,
                queued,
                found,
                ..
            } = registration;
            let (result, server) = self.steps(&path, &desired, &mut slot, found).await;
            if matches!(result, Err(RegisterFailure::ShuttingDown)) {
                debug!("registration abandoned before the plugin answered: shutting down");
                return Ended::Done;
            }
            // The operation's time counts from its request: waiting for a slot is part of what
            // is slow.
            let telemetry = &self.failures.telemetry;
            report::register_ended(telemetry, source, &desired, &result, queued.elapsed());
            match result {
                Ok(plugin) => {
                    self.registered(&desired, plugin, server, started);
                    Ended::Done
                }
                Err(error) => self.failures.record(&path, &desired, error),
            }
        }
        .instrument(span);
        Box::pin(report::in_context(context, operation))
    }

    fn deregister(
        self: Arc<Self>,
        path: PathBuf,
        registered: RegisteredPlugin,
        slot: Slot,
        requested: Instant,
    ) -> Operation<()> {
        Box::pin(async move {
            let _slot = slot;
            let plugin = &registered.plugin;
            let make = || {
                info_span!(
                    "deregister", socket_path = %path.display(), plugin_name = %plugin.name,
                    plugin_type = %plugin.plugin_type, outcome = Empty, error = Empty,
                    tail_kept = Empty
                )
            };
            let fields = || {
                vec![
                    ("plugin_name", plugin.name.clone().into()),
                    ("plugin_type", plugin.plugin_type.clone().into()),
                ]
            };
            let telemetry = &self.failures.telemetry;
            let (span, context) =
                report::operation_span(telemetry, "deregister", &path, make, fields);
            let operation = self
                .run_deregister(&path, registered, requested)
                .instrument(span);
            Box::pin(report::in_context(context, operation)).await;
        })
    }
}
