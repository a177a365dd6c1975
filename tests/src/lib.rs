//! End-to-end test harness: the real `plugin-agent` binary against real plugin processes over
//! real Unix sockets.
//!
//! ```text
//! test --AgentProcess--> plugin-agent run --plugin-dir <PluginDir> --source <Source> --handler T=accept-all
//!      --PluginProcess--> example-plugin --socket <PluginDir>/x.sock  (kubelet's pluginregistration API)
//!      <-- awaits the agent's admin events (`watch`), `list`/`status`, plugin and handler JSON
//!          events (never sleeps for an outcome); reads the agent's log only where it is the feature
//! ```
//!
//! Every scenario runs once per event source ([`per_source!`]); sources this machine or this
//! build cannot run are skipped with a message, except under `CI=true`, where they fail.
//! Processes and directories are RAII guards: a failing test leaves nothing behind.
//!
//! Running:
//! - `cargo xtask test` (what CI runs): builds the eBPF object and the workspace with it, then
//!   `cargo test --workspace`, which also builds `target/debug/plugin-agent` (the agent package
//!   has integration tests, so Cargo builds its binary).
//! - By hand: `cargo build -p plugin-agent && cargo test -p plugin-agent-tests` (a plain
//!   `cargo test -p plugin-agent-tests` does not rebuild the agent: build it first). Without the
//!   eBPF object the `ebpf::` cases skip; without root the `fanotify::` and `ebpf::` cases skip.
//! - Against another binary: `PLUGIN_AGENT_BIN=/path/to/plugin-agent cargo test -p plugin-agent-tests`.
//! - One scenario, all sources: `cargo test -p plugin-agent-tests -- registers_plugins_at_depth`.

pub mod admin;
pub mod agent;
pub mod cgroup;
pub mod container;
pub mod env;
pub mod events;
pub mod fake_plugin;
pub mod handler;
pub mod host;
pub mod http;
pub mod otlp;
pub mod plugin;
pub mod procfs;
pub mod seen;

pub use agent::{AgentOptions, AgentProcess, logs};
pub use env::{PluginDir, Source};
pub use events::{Line, Mark};
pub use plugin::{PluginOptions, PluginProcess};

use std::time::Duration;

/// Upper bound for anything event-driven (a registration, a deregistration): generous, since it
/// only limits how long a broken run hangs; passing runs take milliseconds.
pub const EVENT_TIMEOUT: Duration = Duration::from_secs(20);

/// Generates one `#[tokio::test]` per event source for each scenario function
/// `async fn scenario(source: Source)` named, in modules `inotify`, `fanotify` and `ebpf`, so the
/// test list reads `inotify::registers_plugins_at_depth_0_1_and_2`, and so on.
///
/// Attributes before a name apply to all three tests (`#[ignore = "agent bug: ..."]`); a
/// trailing `[ebpf: #[ignore = "..."]]` applies to the eBPF test only, for a gap of that source.
#[macro_export]
macro_rules! per_source {
    ($($(#[$attr:meta])* $scenario:ident $([ebpf: #[$ebpf_attr:meta]])?),* $(,)?) => {
        $crate::per_source!(@module inotify, Inotify, $($(#[$attr])* $scenario),*);
        $crate::per_source!(@module fanotify, Fanotify, $($(#[$attr])* $scenario),*);
        $crate::per_source!(@module ebpf, Ebpf, $($(#[$attr])* $(#[$ebpf_attr])? $scenario),*);
    };
    (@module $module:ident, $source:ident, $($(#[$attr:meta])* $scenario:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                $(#[$attr])*
                async fn $scenario() {
                    super::$scenario($crate::Source::$source).await
                }
            )*
        }
    };
}

/// Options for an `example-plugin` serving at `socket`; usable from this package's integration
/// tests, which are the only crates that know where Cargo put the binary.
#[macro_export]
macro_rules! plugin {
    ($socket:expr) => {
        $crate::PluginOptions::new(env!("CARGO_BIN_EXE_example-plugin"), $socket)
    };
}

/// An example plugin of type `DRAPlugin` named `name`, serving `v1.DRAPlugin` at
/// `dir/<name>.sock`: a DRA driver, the plugin whose handler the restart and pin tests follow.
#[macro_export]
macro_rules! dra_plugin {
    ($dir:expr, $name:expr) => {
        $crate::plugin!($dir.path(&format!("{}.sock", $name)))
            .plugin_type("DRAPlugin")
            .name($name)
            .arg("--versions")
            .arg("v1.DRAPlugin")
            .spawn()
    };
}

/// The usual start of an end-to-end scenario: the test's own name, a fresh plugin directory, and
/// the agent watching it with `source` and default options (`CSIPlugin=accept-all`).
pub struct Scenario {
    /// The test's name, from [`test_name`].
    pub test: String,
    /// The plugin directory (removed when dropped).
    pub dir: PluginDir,
    /// The agent (stopped when dropped).
    pub agent: AgentProcess,
}

impl Scenario {
    /// Starts the scenario; `None` when `source` cannot run here and the test was skipped (under
    /// `CI=true` that fails instead). Call it from the test's own body (see [`test_name`]).
    pub async fn start(source: Source) -> Option<Scenario> {
        let test = test_name();
        let dir = PluginDir::new();
        let agent = AgentProcess::start_default(&test, source, &dir.root()).await?;
        Some(Scenario { test, dir, agent })
    }
}

/// The running test's own name (`inotify::registers_plugins_at_depth_0_1_and_2` for a
/// [`per_source!`] scenario), for skips, failure messages and log-reader threads: taken from the
/// test itself, so it cannot drift from the function's name. libtest runs each test on a thread
/// named after it, and a `#[tokio::test]` polls its body on that thread; call this from the
/// test's own body (a spawned task runs elsewhere, on a thread of another name).
pub fn test_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("unnamed-test")
        .to_string()
}

#[cfg(test)]
mod tests {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn test_name_is_the_running_tests_own() {
        assert_eq!(
            super::test_name(),
            "tests::test_name_is_the_running_tests_own"
        );
    }
}
