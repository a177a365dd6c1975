//! What the agent does with the plugins it discovers: register them (kubelet's job, on a
//! directory the agent owns) or only observe them (beside kubelet, which owns
//! `plugins_registry` on every node and notifies its plugins itself).
//!
//! In observe mode the agent discovers sockets exactly as in register mode, may ask each plugin
//! `GetInfo` (kubelet's deadlines), and never calls `NotifyRegistrationStatus` nor a handler: a
//! second `Notify` would make plugins flip between kubelet's answer and the agent's
//! (node-driver-registrar exits on any `Notify(false)`). States, `list`, `watch`, metrics and
//! traces work the same; a plugin's state is `observed` instead of `registered`.

use std::fmt;
use std::time::Duration;

/// How long after a socket's creation an observer leaves kubelet to call it first, when it cannot
/// see kubelet's call: kubelet's reconciler dials a new socket within its 1 s period.
pub const KUBELET_FIRST: Duration = Duration::from_secs(3);

/// See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// GetInfo, the handler's Validate and Register, Notify; DeRegister when the socket goes.
    #[default]
    Register,
    /// Discover and describe; never Notify, never a handler.
    Observe {
        /// Whether plugins are asked GetInfo.
        contact: Contact,
    },
}

/// Whether observe mode talks to plugins at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Contact {
    /// Ask each plugin `GetInfo` once per socket, so `list` shows its type, name and endpoint,
    /// but never before kubelet: once kubelet's first connect is seen (eBPF records it), or once
    /// [`KUBELET_FIRST`] has passed since the socket was made (other sources, or no kubelet). A
    /// plugin that serves one connection and closes its listener (a hostile probe found one)
    /// served the agent instead of kubelet, and never registered.
    #[default]
    AfterKubelet,
    /// Ask each plugin `GetInfo` as soon as its socket is found (plugins that answer any number
    /// of callers only).
    GetInfo,
    /// Never connect to a plugin socket: only the socket files are shown.
    Never,
}

impl Mode {
    /// True in observe mode.
    pub fn observes(self) -> bool {
        matches!(self, Mode::Observe { .. })
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Register => f.write_str("register"),
            Mode::Observe {
                contact: Contact::AfterKubelet,
            } => f.write_str("observe (GetInfo only, after kubelet's)"),
            Mode::Observe {
                contact: Contact::GetInfo,
            } => f.write_str("observe (GetInfo only)"),
            Mode::Observe {
                contact: Contact::Never,
            } => f.write_str("observe (no contact with plugins)"),
        }
    }
}
