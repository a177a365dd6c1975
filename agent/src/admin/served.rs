//! What the admin API serves, handed over by the agent that assembles it: the admin room
//! imports no agent, so it can be read and tested with only the rooms below it.

use crate::handler::HandlerRegistry;
use crate::notifications::NotificationBus;
use crate::operations::PolicyReload;
use crate::state::view::StateView;
use crate::telemetry::WatcherStats;
use std::sync::Arc;
use std::time::SystemTime;

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
}
