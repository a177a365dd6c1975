//! What a failed registration means for its socket: the backoff class of each failure (a
//! handler missing, a plugin just started, a socket gone, anything else), the holds (unserved,
//! refused by the policy) and the waits (to listen, for kubelet), recorded before the failure
//! is reported, so a watcher that reacts to the event by asking `list` reads what it carries.
//! The executor then only schedules what this returns ([`Ended`]).

use super::failure::{RegisterFailure, Rejection};
use crate::executor::Ended;
use crate::liveness::{LearnedBy, Unserved};
use crate::notifications::{AgentEvent, EventKind, NotificationBus};
use crate::registration::PluginCallError;
use crate::state::SocketId;
use crate::state::backoff::{Answered, BackoffTable, FailureKind, QUICK_RETRIES};
use crate::state::desired::DesiredPlugin;
use crate::telemetry::Telemetry;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, warn};

/// How long after its socket was discovered a plugin that misses GetInfo's deadline counts as
/// just started (busy starting up) rather than hung: it gets quick retries (see `state::backoff`).
const QUICK_RETRY_WINDOW: Duration = Duration::from_secs(30);

/// Records failures (see the module docs).
pub struct Failures {
    pub backoff: Arc<BackoffTable>,
    pub unserved: Arc<Unserved>,
    pub notifications: NotificationBus,
    pub telemetry: Arc<Telemetry>,
}

impl Failures {
    /// Records `error`, the failure of a registration of `desired` at `path`, and says what the
    /// executor does next.
    /// `answered` is the plugin's valid GetInfo answer, when the failure came after one.
    pub fn record(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        error: RegisterFailure,
        answered: Option<Answered>,
    ) -> Ended {
        match error {
            RegisterFailure::Rejected(rejected) => {
                self.rejected(path, desired.socket, *rejected);
                Ended::Held
            }
            RegisterFailure::Plugin(PluginCallError::NotListening { .. }) => {
                let reason = error.to_string();
                let since = Instant::now();
                let learned_by = LearnedBy::ConnectProbe;
                self.unserved
                    .record(path, desired.socket, None, learned_by, since, reason);
                Ended::Held
            }
            RegisterFailure::Plugin(PluginCallError::NotListeningYet { until, .. }) => {
                Ended::WaitToListen {
                    until,
                    reason: error.to_string(),
                }
            }
            RegisterFailure::WaitingForKubelet { until } => {
                // Not a failure either: the first contact (the watcher looks at the path again
                // when it records one) or `until` ends it.
                self.backoff
                    .wait_for_kubelet(path, desired.socket, until, error.to_string());
                Ended::RetryAt(until)
            }
            RegisterFailure::ShuttingDown => Ended::Done,
            error => self.backed_off(path, desired, error, answered),
        }
    }

    /// A failure retried after a backoff: its class, its record, its report.
    fn backed_off(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        error: RegisterFailure,
        answered: Option<Answered>,
    ) -> Ended {
        let kind = class_of(&error, desired);
        // A socket that vanished (or was replaced) is not a failed registration: no failure
        // event, no warning (the attempt's end is told as abandoned). Usually its removal reaches the watcher at once and forget() drops the retry.
        // But if the watcher missed it, desired state still names this socket instance, and
        // retrying at once would spin (every attempt ends here immediately): it backs off like a
        // failure until the watcher's next rescan corrects desired state.
        let vanished = matches!(
            error,
            RegisterFailure::Plugin(PluginCallError::SocketGone(_))
        );
        let reason = self.reason(path, desired, &error, &kind);
        let backoff = self
            .backoff
            .fail(path, desired.socket, reason, kind, Instant::now());
        if let Some(answered) = answered {
            self.backoff
                .answered(path, desired.socket, Arc::new(answered));
        }
        // Published once the failure is recorded, so a watcher that reacts by asking `list`
        // reads the error the event carries.
        if vanished {
            self.abandoned(
                path,
                format!("the socket vanished or was replaced: {error}"),
            );
        } else {
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
        Ended::RetryAt(backoff.retry_at)
    }

    /// A registration at `path` ended without an outcome, `why` (its socket vanished, the agent
    /// stops): no failure, but a watcher learns that the attempt is over.
    pub fn abandoned(&self, path: &Path, why: String) {
        let mut event = AgentEvent::new(EventKind::RegistrationAbandoned, path);
        event.detail = Some(why);
        self.notifications.publish(event);
    }

    /// What `list` says of the failure: a slow new plugin's quick retries say so.
    fn reason(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        error: &RegisterFailure,
        kind: &FailureKind,
    ) -> String {
        if *kind != FailureKind::SlowNewPlugin {
            return error.to_string();
        }
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
    }

    /// The policy refuses the plugin at `path`: held until the socket or the policy changes.
    pub fn rejected(&self, path: &Path, socket: SocketId, rejected: Rejection) {
        let Rejection {
            refusal,
            plugin,
            provenance,
        } = rejected;
        let said = refusal.to_string();
        self.telemetry.metrics.policy_rejection(&refusal.rule);
        warn!(rule = %refusal.rule, reason = %refusal.reason, server = %refusal.server.as_deref().map(ToString::to_string).unwrap_or_default(), "plugin rejected by policy: not registered until its socket or the policy changes");
        let kind = FailureKind::Rejected {
            refusal: Arc::new(refusal),
            plugin: Arc::new(plugin.clone()),
            provenance: Box::new(provenance.clone()),
        };
        self.backoff.hold(path, socket, said.clone(), kind);
        let mut event = AgentEvent::new(EventKind::Rejected, path);
        event.error = Some(said);
        event.plugin = Some(plugin);
        event.provenance = Some(provenance);
        self.notifications.publish(event);
    }
}

/// The backoff class of a failure: which is retried when (see `state::backoff`).
fn class_of(error: &RegisterFailure, desired: &DesiredPlugin) -> FailureKind {
    match error {
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
        RegisterFailure::Plugin(PluginCallError::InvalidInfo(_)) => FailureKind::InvalidInfo,
        RegisterFailure::Plugin(PluginCallError::Dial { denied: true, .. }) => {
            FailureKind::PermissionDenied
        }
        RegisterFailure::Handler { .. } => FailureKind::HandlerRefused,
        _ => FailureKind::Other,
    }
}
