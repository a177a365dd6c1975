//! Assembles the data flow of `docs/architecture.md` from a configuration and runs it; and, in
//! [`run`], the process around it (handlers, admin API, capabilities, signals).
//!
//! ```text
//! event source -> watcher -> desired state -> reconciler -> executor -> operations -> handlers
//!                                                              actual state <-/
//! ```

mod config;
mod policy_reload;
mod process;
mod running;
mod stages;

pub use config::AgentConfig;
pub use policy_reload::{PolicyReloader, ReloadTrigger};
pub use process::{RunSettings, run};
pub use running::{RunningAgent, mark_process_start};
