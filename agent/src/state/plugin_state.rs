//! Where a plugin socket stands ([`PluginState`]): derived in `view`, read by the verdict and
//! every view; a file of its own so both import it and neither imports the other.

/// Where a plugin socket stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PluginState {
    /// Desired and not registered; an attempt runs or is about to (a retry whose backoff expired
    /// included), or its socket is bound and not listening yet, within its wait for that.
    Pending,
    /// Desired, not registered, and its last attempt failed: no attempt before the backoff ends.
    BackingOff,
    /// Registered with its handler from the socket that is desired now.
    Registered,
    /// Observe mode: described (GetInfo, unless contact is off) from the socket that is desired
    /// now; no handler and no Notify.
    Observed,
    /// Registered from a socket that is no longer desired (gone or re-created) or no longer
    /// served: the deregistration runs or is about to.
    Deregistering,
    /// Desired, and nothing serves it (its server exited, or it refuses connections): not
    /// registered, and not retried until the socket changes (see `liveness`).
    Unserved,
    /// Desired, and the policy refuses it (see `policy`): not registered, and not retried until
    /// the socket or the policy changes.
    Rejected,
}

impl PluginState {
    /// The `state` label of metrics.
    pub fn label(self) -> &'static str {
        match self {
            PluginState::Pending => "pending",
            PluginState::BackingOff => "backing_off",
            PluginState::Registered => "registered",
            PluginState::Observed => "observed",
            PluginState::Deregistering => "deregistering",
            PluginState::Unserved => "unserved",
            PluginState::Rejected => "rejected",
        }
    }
}
