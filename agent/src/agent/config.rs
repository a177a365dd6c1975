//! What the agent is started with: one value the CLI, the tests and the benchmarks fill in.

use crate::config::PolicySource;
use crate::event_source::{SourceChoice, SourceOptions};
use crate::executor::ExecutorConfig;
use crate::reconciler::ReconcileMode;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Everything the agent needs to run.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The registration directory to watch, recursively.
    pub plugin_dir: PathBuf,
    /// Which event source to use.
    pub source: SourceChoice,
    /// Source tuning.
    pub source_options: SourceOptions,
    /// Event-driven, or kubelet's 1 s polling loop (for comparison).
    pub reconcile_mode: ReconcileMode,
    /// Quiet before the safety pass in event mode (see `reconciler`).
    pub safety_period: Duration,
    /// Timeouts and concurrency of operations.
    pub executor: ExecutorConfig,
    /// Where to serve `/metrics`, `/healthz` and `/readyz`; none: not served.
    pub metrics_addr: Option<SocketAddr>,
    /// Where the actual state is kept across restarts (see `persist`); none: nothing is.
    pub state_file: Option<PathBuf>,
    /// Ignore the state file at start: register every plugin again, as kubelet does.
    pub reregister_on_restart: bool,
    /// Who may register what; read at start (an error fails it) and on every reload.
    pub policy: PolicySource,
    /// Complete each socket's creator and server from `/proc` (command, cgroup, pod); off: only
    /// what the kernel reports (see `provenance`).
    pub provenance: bool,
}

impl AgentConfig {
    /// Kubelet-compatible defaults for `plugin_dir`.
    pub fn new(plugin_dir: PathBuf) -> Self {
        AgentConfig {
            plugin_dir,
            source: SourceChoice::Auto,
            source_options: SourceOptions::default(),
            reconcile_mode: ReconcileMode::Event,
            safety_period: Duration::from_secs(30),
            executor: ExecutorConfig::default(),
            metrics_addr: None,
            state_file: None,
            reregister_on_restart: false,
            policy: PolicySource::default(),
            provenance: true,
        }
    }
}
