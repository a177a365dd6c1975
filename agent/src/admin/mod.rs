//! The operator API (`pluginagent.v1.Agent`) on a Unix socket: the agent serves it
//! ([`server`]), `plugin-agent list|watch|status|handler` call it ([`client`]).
//!
//! Access control is the socket's: mode 0600 in a directory the agent creates 0700, and every call
//! checks the caller's credentials (`SO_PEERCRED`): only root or the agent's own user may use it.

mod checks;
pub mod client;
mod convert;
mod event_feed;
mod explain;
mod served;
pub mod server;

/// Default admin socket path.
pub const DEFAULT_SOCKET: &str = "/run/plugin-agent/agent.sock";

/// Largest admin request accepted (requests are a plugin type and a target).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;
