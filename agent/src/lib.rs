//! plugin-agent: discovers kubelet plugin registration sockets with kernel-fed events and registers
//! the plugins with their handlers. The modules follow the data flow of `shared/DESIGN.md`:
//!
//! ```text
//! event_source -> watcher -> state::desired -> reconciler -> executor -> registration (plugin gRPC)
//!                                                                   \-> handler (by plugin type)
//!                                                      state::actual <-/
//! ```
//! [`agent`] assembles them; [`cli`] is the `plugin-agent` command line.

pub mod admin;
pub mod agent;
pub mod backoff;
pub mod cli;
pub mod config;
pub mod event_source;
pub mod events;
pub mod executor;
pub mod handler;
pub mod memory;
pub mod privileges;
pub mod reconciler;
pub mod registration;
pub mod runtime;
pub mod runtime_dir;
pub mod serving;
pub mod shutdown;
pub mod state;
pub mod telemetry;
pub mod text;
pub mod unix_channel;
pub mod watch_health;
pub mod watcher;
