//! Why a registration failed, and the bounded class of each reason that metrics and spans carry.

use crate::handler::Plugin;
use crate::policy::Refusal;
use crate::provenance::Provenance;
use crate::registration::PluginCallError;
use tokio::time::Instant;

/// Why a registration failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterFailure {
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
    pub fn outcome(&self) -> &'static str {
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

/// A plugin the policy refused, with what it said it is and who made and serves its socket.
#[derive(Debug)]
pub struct Rejection {
    pub refusal: Refusal,
    pub plugin: Plugin,
    pub provenance: Provenance,
}
