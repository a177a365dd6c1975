//! The agent as a process: one per runtime directory, its handlers made from their targets, the
//! admin API bound before the start and served after it, capabilities dropped once the event
//! source is attached, SIGHUP's policy reload, and SIGINT/SIGTERM's graceful stop. The command
//! line (`cli::run`) only parses flags and the configuration file into [`RunSettings`].

use super::config::AgentConfig;
use super::running::RunningAgent;
use crate::admin;
use crate::handler::{self, HandlerRegistry};
use crate::mode::Mode;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Everything `run` needs, after merging flags over the config file over defaults.
#[derive(Debug)]
pub struct RunSettings {
    /// The agent's configuration.
    pub agent: AgentConfig,
    /// Handlers by type.
    pub handlers: BTreeMap<String, String>,
    /// Where to serve the admin API (None: not served).
    pub admin_socket: Option<PathBuf>,
    /// Keep every capability after start.
    pub keep_capabilities: bool,
}

/// Runs the agent of `settings` until SIGINT or SIGTERM.
pub async fn run(settings: RunSettings) -> anyhow::Result<()> {
    // One agent per runtime directory, checked before anything starts (see `runtime_dir`).
    let _lock = settings
        .admin_socket
        .as_deref()
        .map(crate::runtime_dir::lock)
        .transpose()?;
    say_mode(&settings);
    // Bound before the agent starts (see `admin::server::bind`); an admin socket that cannot be
    // bound is logged and the agent runs without one, as it would without `--admin-socket`.
    let admin_listener = settings.admin_socket.as_deref().and_then(|socket| {
        admin::server::bind(socket)
            .inspect_err(|e| tracing::error!(error = format!("{e:#}"), "no admin API"))
            .ok()
    });
    let handlers = handlers_of(&settings.handlers)?;
    let agent = RunningAgent::start(settings.agent, handlers).await?;
    drop_capabilities(settings.keep_capabilities);
    let admin_cancel = CancellationToken::new();
    let admin = admin_listener.map(|listener| {
        let service = admin::server::AdminService::new(agent.served());
        let cancel = admin_cancel.clone();
        tokio::spawn(async move {
            if let Err(e) = admin::server::serve(listener, service, cancel).await {
                tracing::error!(error = format!("{e:#}"), "admin API stopped");
            }
        })
    });
    let reloads = tokio::spawn(reload_policy_on_sighup(
        agent.policy_reloader(super::ReloadTrigger::Sighup),
    ));
    let result = agent.run_until(shutdown_signal()).await;
    reloads.abort();
    admin_cancel.cancel();
    if let Some(admin) = admin {
        // Its connections end with the cancel (see `serving`); the bound is a backstop.
        let _ = tokio::time::timeout(Duration::from_millis(600), admin).await;
    }
    result
}

/// The handler registry of `targets` (plugin type -> target).
fn handlers_of(targets: &BTreeMap<String, String>) -> anyhow::Result<Arc<HandlerRegistry>> {
    let handlers = Arc::new(HandlerRegistry::default());
    for (plugin_type, target) in targets {
        let handler = handler::from_target(target).map_err(anyhow::Error::msg)?;
        tracing::info!(plugin_type = %plugin_type, handler = %target, "handler configured");
        handlers.insert(plugin_type, handler);
    }
    Ok(handlers)
}

/// Drops the capabilities the start needed, unless `keep` (`--keep-capabilities`).
fn drop_capabilities(keep: bool) {
    if keep {
        tracing::warn!("--keep-capabilities: running with every capability the agent started with");
        return;
    }
    match crate::privileges::drop_after_start() {
        Ok(dropped) => {
            tracing::info!(kept = ?dropped.kept, dropped = dropped.dropped, "capabilities dropped after start")
        }
        Err(e) => tracing::warn!(
            error = format!("{e:#}"),
            "could not drop capabilities; running with those it has"
        ),
    }
}

/// Logs the mode, why, and what conflicts with it: observe mode with handlers configured (they
/// are not used), and register mode on a directory a running kubelet also watches (both would
/// call the plugins, and a plugin hears two answers).
fn say_mode(settings: &RunSettings) {
    let mode = settings.agent.executor.mode;
    let plugin_dir = &settings.agent.plugin_dir;
    match mode {
        Mode::Observe { .. } if settings.handlers.is_empty() => tracing::info!(
            %mode, plugin_dir = %plugin_dir.display(),
            "no handler configured: observing (never Notify, never a handler); configure a handler and --mode register on a directory the agent owns to register plugins"
        ),
        Mode::Observe { .. } => tracing::warn!(
            %mode, handlers = settings.handlers.len(),
            "observe mode: the configured handlers are not used"
        ),
        Mode::Register => {
            tracing::info!(%mode, plugin_dir = %plugin_dir.display(), "registering plugins");
            let kubelets = crate::kubelet::running(std::path::Path::new("/proc"));
            if let Some(kubelet) = crate::kubelet::watching(&kubelets, plugin_dir) {
                tracing::warn!(
                    kubelet_pid = kubelet.pid,
                    kubelet_plugins_registry = %kubelet.plugins_registry.display(),
                    plugin_dir = %plugin_dir.display(),
                    "register mode on a directory a running kubelet also watches: both will call each plugin's NotifyRegistrationStatus and plugins will hear two answers (node-driver-registrar exits on a Notify(false)); use --mode observe beside kubelet"
                );
            }
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: finishing running operations"),
        _ = int.recv() => tracing::info!("SIGINT: finishing running operations"),
    }
    crate::shutdown::begin();
}

/// SIGHUP reads the policy again (as `plugin-agent policy reload`); a policy that does not load
/// is logged and changes nothing.
async fn reload_policy_on_sighup(reloader: super::PolicyReloader) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        return;
    };
    while hangups.recv().await.is_some() {
        tracing::info!("SIGHUP: reloading the policy");
        let reloader = reloader.clone();
        // The reload logs its outcome either way.
        let _ = tokio::task::spawn_blocking(move || reloader.reload()).await;
    }
}
