//! What the admin API serves, handed over by the agent that assembles it: the admin room
//! imports no agent, so it can be read and tested with only the rooms below it.

use crate::event_source::SourceStart;
use crate::handler::HandlerRegistry;
use crate::liveness::Liveness;
use crate::notifications::NotificationBus;
use crate::operations::PolicyReload;
use crate::persist::RestoreReport;
use crate::state::view::StateView;
use crate::telemetry::WatcherStats;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

/// Reads the policy again and applies it to every socket (`ReloadPolicy`); the agent gives it.
pub trait PolicyReloading: Send + Sync + 'static {
    /// What changed, or why the policy did not load (the policy in force stays).
    fn reload(&self) -> anyhow::Result<PolicyReload>;
}

/// What the admin API serves (see the module docs).
pub struct Served {
    /// The tables a plugin's state is derived from.
    pub state: StateView,
    /// Handlers by type; `AddHandler` and `RemoveHandler` change them.
    pub handlers: Arc<HandlerRegistry>,
    /// The events `WatchEvents` streams.
    pub notifications: NotificationBus,
    /// The watcher's counters and health, for status.
    pub stats: Arc<WatcherStats>,
    /// What does not change while the agent runs, for status.
    pub status: AgentStatus,
    /// Observe mode uses no handler: adding one is refused rather than silently ignored.
    pub observes: bool,
    /// Reads the policy again.
    pub policy: Arc<dyn PolicyReloading>,
    /// Who serves each registered plugin, and how the agent learned it (`list`).
    pub liveness: Arc<Liveness>,
}

/// What status says of the agent that does not change while it runs.
#[derive(Clone)]
pub struct AgentStatus {
    /// The event source in use.
    pub source: String,
    /// Whether the event source reports connections (eBPF): what `list` says of an unknown
    /// first contact.
    pub sees_contacts: bool,
    /// What the source attached.
    pub source_description: String,
    /// The watched tree.
    pub plugin_dir: String,
    /// `event` or `polling`.
    pub reconcile_mode: String,
    /// Register or observe.
    pub mode: String,
    /// When the agent started.
    pub started_at: SystemTime,
    /// What the kernel gives the agent.
    pub kernel: Arc<crate::kernel::KernelFeatures>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (none: they are not).
    pub metrics_addr: Option<SocketAddr>,
    /// How the agent started.
    pub start: Arc<StartReport>,
}

/// How this agent started, for status: how the source started and what the state file carried
/// over are known once the agent runs; where the start's time went, once the start walk is done.
#[derive(Debug, Default)]
pub struct StartReport {
    /// How the event source started (a load, an adoption of pinned programs).
    pub source: SourceStart,
    /// What the state file carried over; none without a state file.
    pub restore: Option<RestoreReport>,
    /// Set once, when the start walk is done.
    pub phases: OnceLock<StartPhases>,
}

/// Where a start's time went, from the process's start to the end of the start walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartPhases {
    /// Command line, logging, runtime, lock, handlers, policy.
    pub setup: Duration,
    /// The event source opened: a load, or an adoption of pinned programs.
    pub event_source: Duration,
    /// Metrics served and the previous agent's state read back.
    pub state: Duration,
    /// The start walk.
    pub first_walk: Duration,
}

impl StartPhases {
    /// The whole start.
    pub fn took(&self) -> Duration {
        self.setup + self.event_source + self.state + self.first_walk
    }
}
