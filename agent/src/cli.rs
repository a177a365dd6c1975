//! The `plugin-agent` command line.

use crate::agent::{AgentConfig, RunningAgent};
use crate::event_source::{SourceChoice, SourceOptions};
use crate::executor::ExecutorConfig;
use crate::handler::HandlerRegistry;
use crate::handler::accept_all::AcceptAll;
use crate::reconciler::ReconcileMode;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Kubelet's plugin registration directory.
pub const DEFAULT_PLUGIN_DIR: &str = "/var/lib/kubelet/plugins_registry";

#[derive(Parser, Debug)]
#[command(
    name = "plugin-agent",
    version,
    about = "Registers kubelet plugins (CSI, device plugins, DRA) with their handlers, fed by eBPF events",
    long_about = "plugin-agent watches a plugin registration directory, as kubelet's plugin manager does, \
and registers every plugin that serves kubelet's pluginregistration API on a Unix socket there with the \
handler for its type. Discovery is event-driven (eBPF ring buffer, else fanotify, else inotify) with loss \
detection and rescans, so registration takes milliseconds and no plugin is lost."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "PLUGIN_AGENT_LOG_FORMAT")]
    pub log_format: LogFormat,

    /// Log filter, e.g. `info` or `plugin_agent=debug` (RUST_LOG is used when this is not given).
    #[arg(long, global = true)]
    pub log_level: Option<String>,
}

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Watch the plugin directory and register plugins until SIGINT/SIGTERM.
    #[command(after_help = "Examples:\n  \
        plugin-agent run\n  \
        plugin-agent run --plugin-dir /var/lib/kubelet/plugins_registry --handler CSIPlugin=accept-all\n  \
        plugin-agent run --source inotify --reconcile-mode polling   # behave like kubelet")]
    Run(RunArgs),
}

/// `plugin-agent run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Registration directory to watch (recursively); created with mode 0755 if missing.
    #[arg(long, default_value = DEFAULT_PLUGIN_DIR)]
    pub plugin_dir: PathBuf,

    /// A handler for a plugin type, as TYPE=HANDLER. HANDLER is `accept-all` (built in: accept and
    /// log). Repeat for several types. Plugins of a type without a handler are told so and retried
    /// when one is added.
    #[arg(long = "handler", value_name = "TYPE=HANDLER", value_parser = parse_handler)]
    pub handlers: Vec<HandlerSpec>,

    /// Event source: auto picks eBPF, else fanotify, else inotify, and logs why.
    #[arg(long, default_value = "auto", value_parser = parse_source)]
    pub source: SourceChoice,

    /// event: react to every change; polling: kubelet's 1 s reconciler loop (for comparison).
    #[arg(long, value_enum, default_value_t = ReconcileMode::Event)]
    pub reconcile_mode: ReconcileMode,

    /// Period of the safety pass (full reconcile and re-walk) in event mode.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub safety_period: Duration,

    /// Registration and deregistration operations running at once.
    #[arg(long, default_value_t = 256)]
    pub max_concurrent: usize,

    /// eBPF ring buffer size in bytes (power of two).
    #[arg(long, default_value_t = 4 << 20)]
    pub ring_buffer_bytes: usize,
}

/// A `--handler TYPE=HANDLER` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerSpec {
    /// Plugin type it handles.
    pub plugin_type: String,
    /// What handles it.
    pub target: HandlerTarget,
}

/// Where a handler lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandlerTarget {
    /// The built-in accept-all handler.
    AcceptAll,
}

fn parse_handler(value: &str) -> Result<HandlerSpec, String> {
    let (plugin_type, target) = value
        .split_once('=')
        .ok_or_else(|| format!("expected TYPE=HANDLER, got {value:?}"))?;
    if plugin_type.is_empty() {
        return Err("empty plugin type".into());
    }
    let target = match target {
        "accept-all" => HandlerTarget::AcceptAll,
        other => return Err(format!("unknown handler {other:?}: expected accept-all")),
    };
    Ok(HandlerSpec {
        plugin_type: plugin_type.to_string(),
        target,
    })
}

fn parse_source(value: &str) -> Result<SourceChoice, String> {
    value.parse()
}

/// Runs `plugin-agent run` until SIGINT or SIGTERM.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let handlers = Arc::new(HandlerRegistry::default());
    for spec in &args.handlers {
        match spec.target {
            HandlerTarget::AcceptAll => handlers.insert(&spec.plugin_type, Arc::new(AcceptAll)),
        }
    }
    let config = AgentConfig {
        plugin_dir: args.plugin_dir,
        source: args.source,
        source_options: SourceOptions {
            ring_buffer_bytes: args.ring_buffer_bytes,
        },
        reconcile_mode: args.reconcile_mode,
        safety_period: args.safety_period,
        executor: ExecutorConfig {
            max_concurrent: args.max_concurrent,
            ..ExecutorConfig::default()
        },
    };
    let agent = RunningAgent::start(config, handlers).await?;
    agent.run_until(shutdown_signal()).await
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handler_argument_parses_type_and_target() {
        assert_eq!(
            parse_handler("CSIPlugin=accept-all"),
            Ok(HandlerSpec {
                plugin_type: "CSIPlugin".into(),
                target: HandlerTarget::AcceptAll
            })
        );
        assert!(parse_handler("CSIPlugin").is_err());
        assert!(parse_handler("=accept-all").is_err());
        assert!(parse_handler("CSIPlugin=magic").is_err());
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
