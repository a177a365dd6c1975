//! The operations: what a registration and a deregistration do, step by step, and what their
//! outcomes mean for the socket (kubelet's operation generator). The executor schedules them
//! through [`crate::executor::OperationRunner`], which [`Runner`] implements; nothing here
//! decides when an operation runs.
//!
//! ```text
//! register:   dial -> GetInfo -> admission (provenance, policy) -> handler by type -> validate
//!             -> actual state add + journal -> register -> Notify(true) -> liveness watch
//!             any failure -> Notify(false, reason), roll back, record it (`failed`)
//! deregister: liveness forget -> actual state remove (journal) -> handler deregister (name,
//!             this socket's endpoint)
//! ```
//!
//! Files, each importing only those listed before it (no cycle, also in what calls what):
//! - `failure`: why a registration failed ([`RegisterFailure`]) and its bounded outcome class;
//! - `report`: what an operation reports to telemetry (outcome counters, latency, span fields);
//! - `handler_calls`: handler calls with deadlines, one at a time per plugin (type, name);
//! - `records`: actual state written through the journal (`persist`);
//! - `admission`: who serves a described plugin, and whether the policy lets it register;
//! - `failed`: what a failure means for the socket's backoff (held, waiting, retried), recorded
//!   before it is reported;
//! - `runner`: the [`Runner`] and what it is built over; what the agent asks of it (admission and
//!   journal at start, a policy reload, the restored registrations' servers) and the report of
//!   a success;
//! - `register`, `observe_mode`, `deregister`: the steps, as methods of the [`Runner`];
//! - `seam`: [`crate::executor::OperationRunner`] for the [`Runner`]: an operation's span, its
//!   steps, what its outcome changes.

mod admission;
mod deregister;
mod failed;
mod failure;
mod handler_calls;
mod observe_mode;
mod records;
mod register;
mod report;
mod runner;
mod seam;

pub use admission::PolicyReload;
pub use failure::RegisterFailure;
pub use runner::{Runner, RunnerParts};
