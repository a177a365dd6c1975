//! The steps of a registration (kubelet's operation generator): dial, GetInfo, admission, the
//! handler's validation, actual state and the journal, the handler's Register, Notify; how a
//! failure is rolled back; and, in observe mode, the one step that differs (`observe_mode`).
//! When an operation may run is the executor's; what its outcome means is `failed.rs`.

use super::failure::RegisterFailure;
use super::handler_calls::HandlerCall;
use super::report::record;
use super::runner::Runner;
use crate::executor::Slot;
use crate::handler::{Plugin, PluginHandler};
use crate::liveness::Server;
use crate::provenance::Provenance;
use crate::registration::{OnInvalid, PluginConnection, Step, StepTimer};
use crate::state::actual::RegisteredPlugin;
use crate::state::backoff::Answered;
use crate::state::desired::{DesiredPlugin, ListenSeen, Listening};
use plugin_agent_proto::pluginregistration::PluginInfo;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::{Instrument, debug, info_span, warn};

/// How long a socket found by a walk (not seen being created) may refuse connections before it
/// counts as unserved: long enough for a plugin caught between its bind and its listen, short
/// enough that a dead plugin's socket left from before a reboot is reported at once.
const LISTEN_WAIT_AFTER_WALK: Duration = Duration::from_secs(1);

impl Runner {
    pub(super) async fn run_register(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        slot: &mut Slot,
        found: Option<tokio::net::UnixStream>,
        answered: &mut Option<Answered>,
    ) -> Result<(RegisteredPlugin, Option<Server>), RegisterFailure> {
        // Every step is boxed where it is awaited: a future is as large as its largest step, and
        // an operation that waits (for a slot, or in a dial's pauses) should cost that wait's
        // few bytes, not the HTTP/2 connection's and the handler call's kilobytes. The steps
        // after the plugin answered share one box: one runs at a time.
        let (connection, plugin, provenance) =
            Box::pin(self.describe(path, desired, slot, found)).await?;
        let described_at = std::time::SystemTime::now();
        let steps = self.register_described(path, desired, slot, connection, &plugin, provenance);
        match Box::pin(steps).await {
            Ok(registered) => Ok(registered),
            Err(error) => {
                // Kept with a failure after GetInfo (`explain` by driver name, its timeline).
                *answered = Some(Answered {
                    at: described_at,
                    plugin,
                });
                Err(error)
            }
        }
    }

    /// The steps after a valid `GetInfo` answer: the handler's validation, actual state and
    /// the journal, the handler's Register, Notify(true); a failure is told to the plugin and
    /// rolled back. Returns the actual-state entry and who serves the socket.
    async fn register_described(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        slot: &mut Slot,
        mut connection: PluginConnection,
        plugin: &Plugin,
        provenance: Provenance,
    ) -> Result<(RegisteredPlugin, Option<Server>), RegisterFailure> {
        let Some(handler) = self.handlers.get(&plugin.plugin_type) else {
            let error = RegisterFailure::NoHandler {
                plugin_type: plugin.plugin_type.clone(),
                socket: plugin.socket_path.clone(),
            };
            notify_failure(&mut connection, &error.to_string()).await;
            return Err(error);
        };
        // Every handler call about this plugin, the rollback's too, one at a time.
        let _name = self.calls.one_at_a_time(plugin).await;
        let validated = self.validate_and_record(path, desired, plugin, &handler, provenance);
        let entry = match validated.await {
            Ok(entry) => entry,
            Err(error) => {
                notify_failure(&mut connection, &error.to_string()).await;
                return Err(error);
            }
        };
        let call = HandlerCall::Register;
        let registered = self
            .calls
            .call(call, &plugin.plugin_type, handler.register(plugin));
        if let Err(e) = registered.await {
            let error = call.failure(e, plugin);
            notify_failure(&mut connection, &error.to_string()).await;
            Box::pin(self.roll_back(path, &entry)).await;
            return Err(error);
        }
        if let Err(e) = connection
            .notify_redialing(path, desired.socket, true, "", slot)
            .instrument(info_span!("NotifyRegistrationStatus", registered = true))
            .await
        {
            Box::pin(self.roll_back(path, &entry)).await;
            return Err(e.into());
        }
        Ok((entry, connection.take_server()))
    }

    /// Dials the plugin, asks what it is, and whether the policy lets it register (a refusal
    /// is told to the plugin here).
    async fn describe(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        slot: &mut Slot,
        found: Option<tokio::net::UnixStream>,
    ) -> Result<(PluginConnection, Plugin, Provenance), RegisterFailure> {
        let (mut connection, info) = self
            .dial_for_info(path, desired, slot, found, OnInvalid::Notify)
            .await?;
        let plugin = plugin_of(path, info);
        record_plugin(&plugin);
        debug!(plugin_name = %plugin.name, plugin_type = %plugin.plugin_type, "GetInfo answered");
        let server = connection.server();
        match self.admission.admit_described(desired, server, &plugin) {
            Ok(provenance) => Ok((connection, plugin, provenance)),
            Err(rejected) => {
                let said = rejected.refusal.to_string();
                Box::pin(notify_failure(&mut connection, &said)).await;
                Err(RegisterFailure::Rejected(rejected))
            }
        }
    }

    /// The handler's validation, then actual state and the journal, written before its
    /// Register: a delete meanwhile becomes a deregistration, and a kill is carried on.
    async fn validate_and_record(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        plugin: &Plugin,
        handler: &Arc<dyn PluginHandler>,
        provenance: Provenance,
    ) -> Result<RegisteredPlugin, RegisterFailure> {
        let call = HandlerCall::Validate;
        let validated = self
            .calls
            .call(call, &plugin.plugin_type, handler.validate(plugin));
        if let Err(e) = Box::pin(validated).await {
            return Err(call.failure(e, plugin));
        }
        let entry = self.actual.add(
            desired.path.clone(),
            desired.generation,
            desired.socket,
            plugin.clone(),
            handler.clone(),
            provenance,
        );
        if let Err(e) = self.records.begin(path, &entry) {
            self.actual.remove(path, entry.generation);
            return Err(RegisterFailure::NotRecorded(e));
        }
        Ok(entry)
    }

    /// Dials the plugin at `path` (on `found`, a connection a look made, if any) and asks for
    /// its `PluginInfo`, holding one of the slots' dial permits meanwhile (see
    /// [`Slot::dialling`]). Until the plugin has answered, nothing was told to anyone, so
    /// shutdown drops the dial: [`RegisterFailure::ShuttingDown`].
    pub(super) async fn dial_for_info(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        slot: &mut Slot,
        found: Option<tokio::net::UnixStream>,
        on_invalid: OnInvalid,
    ) -> Result<(PluginConnection, PluginInfo), RegisterFailure> {
        let steps = self.steps_recording_listen(desired);
        let answer = slot.dialling(async |slot: &mut Slot| {
            PluginConnection::get_info(
                path,
                desired.socket,
                found,
                self.plugin_timeouts(path, desired),
                slot,
                on_invalid,
                &steps,
            )
            .await
        });
        // Not boxed: this future is the step's own (`describe`'s box, observe mode's).
        match crate::shutdown::unless_stopping(&self.cancel, answer).await {
            Some(answer) => Ok(answer?),
            None => Err(RegisterFailure::ShuttingDown),
        }
    }

    /// The step timer of a dial of `desired`, recording the socket listening when the dial
    /// reaches it, if no listen of it is known yet (`explain`'s timeline).
    fn steps_recording_listen(&self, desired: &DesiredPlugin) -> StepTimer {
        let (None, Some(table)) = (&desired.listening, self.desired.get()) else {
            return self.steps.clone();
        };
        let (table, path, socket) = (table.clone(), desired.path.clone(), desired.socket);
        self.steps.also(move |step, _, ok| {
            if step == Step::Dial && ok {
                let listening = Listening {
                    at: std::time::SystemTime::now(),
                    seen_by: ListenSeen::Dial,
                };
                table.record_listening(&path, Some(socket), None, listening);
            }
        })
    }

    /// The plugin call deadlines for `desired` at `path`, with what is left of its wait to
    /// listen: the rest of a wait under way, else the whole one counted from the socket's birth
    /// where the file system records it (a socket bound longer ago than that and refusing is
    /// not waited for: a tree of 100,000 dead sockets cost ~6 connects and a slot-second
    /// each), and a socket found by a walk is waited for only briefly (see
    /// [`LISTEN_WAIT_AFTER_WALK`]).
    fn plugin_timeouts(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
    ) -> crate::registration::Timeouts {
        let mut timeouts = self.config.plugin_timeouts;
        let now = Instant::now();
        let backoff = &self.failures.backoff;
        timeouts.listen = match backoff.waiting_to_listen_until(path, desired.socket) {
            Some(until) => until.saturating_duration_since(now),
            None => {
                let wait = if desired.by_event {
                    timeouts.listen
                } else {
                    timeouts.listen.min(LISTEN_WAIT_AFTER_WALK)
                };
                wait.saturating_sub(age(desired.socket))
            }
        };
        timeouts
    }

    /// Undoes a registration whose last steps failed: actual state, then the handler.
    async fn roll_back(&self, path: &Path, entry: &RegisteredPlugin) {
        if self.records.take(path, entry.generation).is_none() {
            return;
        }
        let Some(handler) = &entry.handler else {
            return;
        };
        let plugin = &entry.plugin;
        let told = self
            .calls
            .call(
                HandlerCall::Deregister,
                &plugin.plugin_type,
                handler.deregister(plugin),
            )
            .await;
        if let Err(e) = told {
            warn!(plugin_name = %plugin.name, error = %e, "rollback: handler deregistration failed");
        }
        self.records.deregistered(path, entry.generation);
    }
}

/// Puts what GetInfo said the plugin is on the operation's span.
pub(super) fn record_plugin(plugin: &Plugin) {
    let span = tracing::Span::current();
    record(&span, "plugin_name", &plugin.name);
    record(&span, "plugin_type", &plugin.plugin_type);
}

/// The plugin as handlers see it, from its GetInfo answer: an empty endpoint means the
/// registration socket itself, as in kubelet.
pub(super) fn plugin_of(path: &Path, info: PluginInfo) -> Plugin {
    let socket_path = path.to_string_lossy().into_owned();
    Plugin {
        endpoint: if info.endpoint.is_empty() {
            socket_path.clone()
        } else {
            info.endpoint
        },
        plugin_type: info.r#type,
        name: info.name,
        supported_versions: info.supported_versions,
        socket_path,
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

/// How long ago `socket` was bound, as its birth time says (zero when the file system does not
/// record one, or the clock was set back since).
fn age(socket: crate::state::SocketId) -> Duration {
    socket
        .born()
        .and_then(|born| std::time::SystemTime::now().duration_since(born).ok())
        .unwrap_or_default()
}
