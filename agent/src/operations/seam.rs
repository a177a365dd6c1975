//! The executor's seam, as the runner implements it: an operation's span and trace context,
//! its steps (the mode's), and what its outcome changes. The steps are methods of the
//! [`Runner`] in `register.rs`, `observe_mode.rs` and `deregister.rs`; this file calls them.

use super::failure::RegisterFailure;
use super::report;
use super::runner::Runner;
use crate::executor::{Ended, Operation, OperationRunner, Registration, Slot};
use crate::liveness::Server;
use crate::mode::Mode;
use crate::state::actual::RegisteredPlugin;
use crate::state::backoff::Answered;
use crate::state::desired::DesiredPlugin;
use crate::telemetry::discovery::Via;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{Instrument, debug, info_span};

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
        let (span, context) = register_span(&self, &registration, source);
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
            let mut answered = None;
            let (result, server) =
                steps(&self, &path, &desired, &mut slot, found, &mut answered).await;
            if matches!(result, Err(RegisterFailure::ShuttingDown)) {
                debug!("registration abandoned before the plugin answered: shutting down");
                let why = "the agent is stopping: abandoned before the plugin answered";
                self.failures.abandoned(&path, why.into());
                return Ended::Done;
            }
            // The operation's time counts from its request: waiting for a slot is part of what
            // is slow.
            let telemetry = &self.failures.telemetry;
            let report =
                report::register_ended(telemetry, source, &desired, &result, queued.elapsed());
            let ended = match result {
                Ok(entry) => {
                    self.registered(&desired, entry, server, started);
                    Ended::Done
                }
                Err(error) => self.failures.record(&path, &desired, error, answered),
            };
            report.finish(self.reason_of(&path));
            ended
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

/// The `register` span of `registration` (for the log), and the context to run it in when
/// traces are on (see `telemetry::sampling::OperationTrace`).
fn register_span(
    runner: &Runner,
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
            outcome = Empty, error = Empty, tail_kept = Empty, plugin_agent.reason = Empty,
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
    let telemetry = &runner.failures.telemetry;
    report::operation_span(telemetry, "register", path, make, fields)
}

/// Runs the mode's steps; what they found, as the report and the failure records want it
/// (the plugin's actual-state entry; `answered`: the plugin's valid GetInfo answer, kept with a
/// failure after it).
async fn steps(
    runner: &Runner,
    path: &Path,
    desired: &DesiredPlugin,
    slot: &mut Slot,
    found: Option<tokio::net::UnixStream>,
    answered: &mut Option<Answered>,
) -> (Result<RegisteredPlugin, RegisterFailure>, Option<Server>) {
    // Boxed where awaited: this future lives as long as the operation (through every pause
    // of a socket that does not listen yet), the steps only while they run.
    match runner.config.mode {
        Mode::Register => Box::pin(runner.run_register(path, desired, slot, found, answered)).await,
        Mode::Observe { contact } => {
            Box::pin(runner.run_observe(path, desired, slot, found, contact)).await
        }
    }
    .map_or_else(|e| (Err(e), None), |(entry, server)| (Ok(entry), server))
}
