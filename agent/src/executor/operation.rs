//! The steps of one operation (kubelet's operation generator): what a registration and a
//! deregistration do, in order, and how a failure is rolled back and described. Scheduling (when
//! an operation may run) is the room's `mod.rs`; recording outcomes is `observe.rs`.

use super::OperationExecutor;
use super::admission::Rejection;
use super::observe::{record, record_number};
use super::slots::Slot;
use crate::handler::{HandlerError, Plugin};
use crate::liveness::Server;
use crate::notifications::{AgentEvent, EventKind};
use crate::provenance::Provenance;
use crate::registration::{OnInvalid, PluginCallError, PluginConnection};
use crate::state::actual::RegisteredPlugin;
use crate::state::desired::DesiredPlugin;
use plugin_agent_proto::pluginregistration::PluginInfo;
use std::path::Path;
use std::time::Duration;
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{Instrument, debug, info, info_span, warn};

/// Why a registration failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum RegisterFailure {
    #[error(transparent)]
    Plugin(#[from] PluginCallError),
    #[error("no handler registered for plugin type: {plugin_type} at socket {socket}")]
    NoHandler { plugin_type: String, socket: String },
    /// Observe mode: kubelet has not contacted the socket yet, and may until `until`; the
    /// agent does not call a plugin before kubelet (see `mode::KUBELET_FIRST`). Not a failure.
    #[error("waiting for kubelet's first contact")]
    WaitingForKubelet { until: Instant },
    /// The agent began shutting down before the plugin answered: no outcome to report.
    #[error("the agent is shutting down")]
    ShuttingDown,
    /// The policy refuses the plugin (see `policy`).
    #[error("{}", .0.refusal)]
    Rejected(Box<Rejection>),
    /// The registration could not be recorded in the state file before the handler's Register
    /// (kubernetes issue 136462): nothing was told to the handler.
    #[error("cannot record the registration in the agent's state file: {0}")]
    NotRecorded(String),
    #[error("{message}")]
    Handler {
        message: String,
        unavailable: bool,
        plugin_type: String,
        outcome: &'static str,
    },
}

impl RegisterFailure {
    /// The failure's reason class: the bounded `outcome` of metrics and spans (error text, which
    /// a plugin or handler controls, never becomes a label).
    pub(super) fn outcome(&self) -> &'static str {
        match self {
            RegisterFailure::Plugin(PluginCallError::SocketGone(_)) => "socket_gone",
            RegisterFailure::Plugin(PluginCallError::Dial { .. }) => "dial_error",
            RegisterFailure::Plugin(PluginCallError::NotListening { .. }) => "not_listening",
            RegisterFailure::Plugin(PluginCallError::NotListeningYet { .. }) => "waiting_to_listen",
            RegisterFailure::Plugin(
                PluginCallError::GetInfo(_) | PluginCallError::GetInfoTimeout(_),
            ) => "get_info_error",
            RegisterFailure::Plugin(PluginCallError::InvalidInfo(_)) => "invalid_info",
            RegisterFailure::Plugin(PluginCallError::Notify(_)) => "notify_error",
            RegisterFailure::NoHandler { .. } => "no_handler",
            RegisterFailure::WaitingForKubelet { .. } => "waiting_for_kubelet",
            RegisterFailure::ShuttingDown => "shutting_down",
            RegisterFailure::Rejected(_) => "rejected_by_policy",
            RegisterFailure::NotRecorded(_) => "state_not_recorded",
            RegisterFailure::Handler { outcome, .. } => outcome,
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

    /// The name of the call's span.
    fn span_name(self) -> &'static str {
        match self {
            HandlerCall::Validate => "ValidatePlugin",
            HandlerCall::Register => "RegisterPlugin",
            HandlerCall::Deregister => "DeRegisterPlugin",
        }
    }

    fn span(self, plugin_type: &str) -> tracing::Span {
        match self {
            HandlerCall::Validate => {
                info_span!("ValidatePlugin", plugin_type, error = Empty)
            }
            HandlerCall::Register => {
                info_span!("RegisterPlugin", plugin_type, error = Empty)
            }
            HandlerCall::Deregister => {
                info_span!("DeRegisterPlugin", plugin_type, error = Empty)
            }
        }
    }
}

impl OperationExecutor {
    pub(super) async fn run_register(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        slot: &mut Slot,
    ) -> Result<(Plugin, Option<Server>), RegisterFailure> {
        // Every step is boxed where it is awaited: a future is as large as its largest step, and
        // an operation that waits (for a slot, or in a dial's pauses) should cost that wait's
        // few bytes, not the HTTP/2 connection's and the handler call's kilobytes.
        let (mut connection, info) = self
            .dial_for_info(path, desired, slot, OnInvalid::Notify)
            .await?;
        let plugin = plugin_of(path, info);
        let span = tracing::Span::current();
        super::observe::record(&span, "plugin_name", &plugin.name);
        super::observe::record(&span, "plugin_type", &plugin.plugin_type);
        debug!(plugin_name = %plugin.name, plugin_type = %plugin.plugin_type, "GetInfo answered");
        let provenance = match self.admit_described(desired, connection.server(), &plugin) {
            Ok(provenance) => provenance,
            Err(rejected) => {
                Box::pin(notify_failure(
                    &mut connection,
                    &rejected.refusal.to_string(),
                ))
                .await;
                return Err(RegisterFailure::Rejected(rejected));
            }
        };

        let Some(handler) = self.handlers.get(&plugin.plugin_type) else {
            let error = RegisterFailure::NoHandler {
                plugin_type: plugin.plugin_type.clone(),
                socket: plugin.socket_path.clone(),
            };
            Box::pin(notify_failure(&mut connection, &error.to_string())).await;
            return Err(error);
        };
        let _name = self
            .name_locks
            .lock(&plugin.plugin_type, &plugin.name)
            .await;
        let timeouts = self.config.handler_timeouts;

        if let Err(e) = Box::pin(self.call_handler(
            HandlerCall::Validate,
            &plugin.plugin_type,
            handler.validate(&plugin),
            timeouts.validate,
        ))
        .await
        {
            let error = handler_error(HandlerCall::Validate, e, &plugin);
            Box::pin(notify_failure(&mut connection, &error.to_string())).await;
            return Err(error);
        }
        let entry = self.actual.add(
            desired.path.clone(),
            desired.generation,
            desired.socket,
            plugin.clone(),
            handler.clone(),
            provenance,
        );
        if let Err(e) = self.journal_begin(path, &entry) {
            self.actual.remove(path, entry.generation);
            let error = RegisterFailure::NotRecorded(e);
            Box::pin(notify_failure(&mut connection, &error.to_string())).await;
            return Err(error);
        }
        if let Err(e) = Box::pin(self.call_handler(
            HandlerCall::Register,
            &plugin.plugin_type,
            handler.register(&plugin),
            timeouts.register,
        ))
        .await
        {
            let error = handler_error(HandlerCall::Register, e, &plugin);
            Box::pin(notify_failure(&mut connection, &error.to_string())).await;
            Box::pin(self.roll_back(path, &entry)).await;
            return Err(error);
        }
        if let Err(e) = Box::pin(
            connection
                .notify_redialing(path, desired.socket, true, "", slot)
                .instrument(info_span!("NotifyRegistrationStatus", registered = true)),
        )
        .await
        {
            Box::pin(self.roll_back(path, &entry)).await;
            return Err(e.into());
        }
        Ok((plugin, connection.take_server()))
    }

    /// Dials the plugin at `path` and asks for its `PluginInfo`, holding one of the slots' dial
    /// permits meanwhile (see [`Slot::dialling`]). Until the plugin has answered, nothing was told
    /// to anyone, so shutdown drops the dial: [`RegisterFailure::ShuttingDown`].
    pub(super) async fn dial_for_info(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
        slot: &mut Slot,
        on_invalid: OnInvalid,
    ) -> Result<(PluginConnection, PluginInfo), RegisterFailure> {
        let answer = slot.dialling(async |slot: &mut Slot| {
            PluginConnection::get_info(
                path,
                desired.socket,
                self.found_listening(path, desired.socket),
                self.plugin_timeouts(path, desired),
                slot,
                on_invalid,
                &self.steps,
            )
            .await
        });
        match Box::pin(crate::shutdown::unless_stopping(&self.cancel, answer)).await {
            Some(answer) => Ok(answer?),
            None => Err(RegisterFailure::ShuttingDown),
        }
    }

    /// The plugin call deadlines for `desired` at `path`, with what is left of its wait to
    /// listen: the rest of a wait under way, else the whole one counted from the socket's birth
    /// where the file system records it (a socket bound longer ago than that and refusing is
    /// not waited for: a tree of 100,000 dead sockets cost ~6 connects and a slot-second
    /// each), and a socket found by a walk is waited for only briefly (see
    /// [`super::LISTEN_WAIT_AFTER_WALK`]).
    pub(super) fn plugin_timeouts(
        &self,
        path: &Path,
        desired: &DesiredPlugin,
    ) -> crate::registration::Timeouts {
        let mut timeouts = self.config.plugin_timeouts;
        let now = Instant::now();
        timeouts.listen = match self.backoff.waiting_to_listen_until(path, desired.socket) {
            Some(until) => until.saturating_duration_since(now),
            None => {
                let wait = if desired.by_event {
                    timeouts.listen
                } else {
                    timeouts.listen.min(super::LISTEN_WAIT_AFTER_WALK)
                };
                wait.saturating_sub(age(desired.socket))
            }
        };
        timeouts
    }

    /// Undoes a registration whose last steps failed: actual state, then the handler.
    async fn roll_back(&self, path: &Path, entry: &RegisteredPlugin) {
        if self.take_registered(path, entry.generation).is_none() {
            return;
        }
        let Some(handler) = &entry.handler else {
            return;
        };
        if let Err(e) = self
            .call_handler(
                HandlerCall::Deregister,
                &entry.plugin.plugin_type,
                handler.deregister(&entry.plugin),
                self.config.handler_timeouts.deregister,
            )
            .await
        {
            warn!(plugin_name = %entry.plugin.name, error = %e, "rollback: handler deregistration failed");
        }
        self.deregistered(path, entry.generation);
    }

    pub(super) async fn run_deregister(
        &self,
        path: &Path,
        registered: RegisteredPlugin,
        started: Instant,
    ) {
        // Every registered socket is deregistered with its own endpoint, also when another
        // socket of the same name registered since (a DRA driver's rolling update, kubelet
        // 1.33+): the handler tells its instances apart by endpoint.
        self.liveness.forget(path, registered.generation);
        let Some(entry) = self.take_registered(path, registered.generation) else {
            self.observe_deregister("not_registered", None, started);
            return;
        };
        let mut event = AgentEvent::new(EventKind::Deregistered, path);
        event.plugin = Some(entry.plugin.clone());
        let Some(handler) = entry.handler.clone() else {
            // Observed only: no handler knows it.
            info!("observed plugin's socket removed");
            self.deregistered(path, registered.generation);
            event.detail = Some("observed: no handler to tell".into());
            self.notifications.publish(event);
            self.observe_deregister("observed", None, started);
            return;
        };
        let _name = self
            .name_locks
            .lock(&entry.plugin.plugin_type, &entry.plugin.name)
            .await;
        let told = self
            .call_handler(
                HandlerCall::Deregister,
                &entry.plugin.plugin_type,
                handler.deregister(&entry.plugin),
                self.config.handler_timeouts.deregister,
            )
            .await;
        // Done either way (the handler was told, or failed to listen and is not asked again),
        // and recorded before it is reported: a kill after the report loses nothing.
        self.deregistered(path, registered.generation);
        match told {
            Ok(()) => {
                info!("plugin deregistered");
                self.observe_deregister("success", None, started);
                self.observe_unserved_deregistered(path, registered.socket);
            }
            Err(e) => {
                warn!(error = %e, "handler failed to deregister plugin");
                self.observe_deregister("handler_error", Some(&e.message), started);
                event.error = Some(e.message);
            }
        }
        self.notifications.publish(event);
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
        // A failed or slow call makes its operation failed or slow: its trace is exported.
        let took = started.elapsed();
        let exemplar =
            super::observe::step_exemplar(call.span_name(), took, result.is_err(), || {
                let mut attributes = vec![opentelemetry::KeyValue::new(
                    "plugin_type",
                    plugin_type.to_string(),
                )];
                if let Err(e) = &result {
                    attributes.push(opentelemetry::KeyValue::new("error", e.message.clone()));
                }
                attributes
            });
        self.telemetry
            .metrics
            .handler_call(plugin_type, call.label(), outcome, took, exemplar);
        if let Err(e) = &result {
            span.record("error", e.message.as_str());
        }
        result
    }
}

fn handler_error(call: HandlerCall, error: HandlerError, plugin: &Plugin) -> RegisterFailure {
    let (what, rejected) = match call {
        HandlerCall::Validate => ("plugin validation failed", "validation_rejected"),
        _ => ("plugin registration failed", "registration_rejected"),
    };
    RegisterFailure::Handler {
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

/// Puts a socket's provenance on the operation's span, named by OpenTelemetry's semantic
/// conventions: `process.*`, `container.id` and `k8s.pod.uid` describe the server (the process
/// the plugin is); the creator, which the conventions have no name for, is
/// `plugin_agent.creator.*`.
pub(super) fn record_provenance(span: &tracing::Span, provenance: &Provenance) {
    if let Some(server) = provenance.server.as_deref() {
        record_process(span, &SERVER_KEYS, server);
        if let Some(cgroup) = server.cgroup.as_deref() {
            if let Some(id) = &cgroup.container_id {
                record(span, "container.id", id);
            }
            if let Some(uid) = &cgroup.pod_uid {
                record(span, "k8s.pod.uid", uid);
            }
        }
    }
    match provenance.creator.process() {
        Some(creator) => record_process(span, &CREATOR_KEYS, creator),
        None => {
            let why = provenance.creator.unknown_because().unwrap_or_default();
            record(span, "plugin_agent.creator.unknown", why);
        }
    }
}

/// The span fields one process is recorded under.
struct ProcessKeys {
    pid: &'static str,
    command: &'static str,
    uid: &'static str,
    cgroup: &'static str,
}

const SERVER_KEYS: ProcessKeys = ProcessKeys {
    pid: "process.pid",
    command: "process.executable.name",
    uid: "process.user.id",
    cgroup: "process.linux.cgroup",
};

const CREATOR_KEYS: ProcessKeys = ProcessKeys {
    pid: "plugin_agent.creator.pid",
    command: "plugin_agent.creator.executable.name",
    uid: "plugin_agent.creator.user.id",
    cgroup: "plugin_agent.creator.linux.cgroup",
};

fn record_process(span: &tracing::Span, keys: &ProcessKeys, process: &crate::provenance::Process) {
    if let Some(pid) = process.pid {
        record_number(span, keys.pid, i64::from(pid));
    }
    if let Some(command) = &process.command {
        record(span, keys.command, command);
    }
    if let Some(uid) = process.uid {
        record_number(span, keys.uid, i64::from(uid));
    }
    if let Some(path) = process.cgroup_path() {
        record(span, keys.cgroup, path);
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
