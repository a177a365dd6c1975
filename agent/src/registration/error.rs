//! How talking to a plugin fails: each variant is a different next step for the executor (wait
//! for the socket to change, wait for its listen, back off, or count the plugin unserved).

use std::path::PathBuf;
use std::time::Duration;
use tokio::time::Instant;

/// Why talking to a plugin failed.
#[derive(Debug, thiserror::Error)]
pub enum PluginCallError {
    /// The socket vanished, or was replaced by another socket (which gets its own registration).
    #[error("socket {0} no longer exists or was replaced")]
    SocketGone(PathBuf),
    /// Nothing listened on the socket (connections refused) for as long as it was waited for:
    /// the socket is unserved, not a broken plugin.
    #[error("nothing listens on {path}: connection refused for {elapsed:?}")]
    NotListening { path: PathBuf, elapsed: Duration },
    /// The socket refuses connections (bound, not listening yet) and may still listen until
    /// `until`: the attempt ends, and the wait goes on without it (see the module docs).
    #[error("{path} refuses connections (bound, not listening yet)")]
    NotListeningYet { path: PathBuf, until: Instant },
    /// Could not connect within the dial timeout.
    #[error("dial {path}: {reason} (after {elapsed:?})")]
    Dial {
        path: PathBuf,
        reason: String,
        elapsed: Duration,
        /// The socket's mode and owner refused the agent (`EACCES`): a chmod, not a retry,
        /// fixes it (what `explain` says).
        denied: bool,
    },
    /// GetInfo failed.
    #[error("GetInfo: {0}")]
    GetInfo(String),
    /// GetInfo's deadline passed, on a connection where the plugin had spoken (so it serves, but
    /// is hung, or slow: busy starting up, say).
    #[error("GetInfo: no answer within {0:?}")]
    GetInfoTimeout(Duration),
    /// GetInfo answered something no handler should see.
    #[error("invalid PluginInfo: {0}")]
    InvalidInfo(String),
    /// NotifyRegistrationStatus failed (transport or the plugin returned an error).
    #[error("NotifyRegistrationStatus: {0}")]
    Notify(String),
}
