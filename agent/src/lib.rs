//! plugin-agent: discovers kubelet plugin registration sockets with kernel-fed events and registers
//! the plugins with their handlers. The modules follow the data flow (`docs/architecture.md` has
//! one paragraph per module: what it owns and what it may import):
//!
//! ```text
//! event_source -> watcher -> state::desired -> reconciler -> executor -> registration (plugin gRPC)
//!                               state::queue <-/                     \-> handler (by plugin type)
//!                         state::actual, state::backoff <-/
//! watcher, executor --> notifications (admin API events), telemetry (metrics, traces)
//! state::view (a plugin's state, derived once) --> admin API, metrics
//! ```
//! [`agent`] assembles them; [`cli`] is the `plugin-agent` command line. `cargo xtask modules`
//! prints the import graph and fails on a cycle.

pub mod admin;
pub mod agent;
pub mod cli;
pub mod config;
pub mod event_source;
pub mod executor;
pub mod handler;
pub mod kernel;
pub mod kubelet;
pub mod liveness;
pub mod memory;
pub mod mode;
pub mod mounts;
pub mod notifications;
pub mod operations;
pub mod persist;
pub mod policy;
pub mod privileges;
pub mod provenance;
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
