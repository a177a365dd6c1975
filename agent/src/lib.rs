//! plugin-agent: discovers kubelet plugin registration sockets with kernel-fed events and registers
//! the plugins with their handlers. The modules follow the data flow of `shared/DESIGN.md`:
//!
//! ```text
//! event_source -> watcher -> state::desired -> reconciler -> executor -> registration (plugin gRPC)
//!                                                                   \-> handler (by plugin type)
//!                                                      state::actual <-/
//! ```

pub mod event_source;
