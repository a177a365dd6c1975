//! The `plugin-agent` command line: `run` starts the agent; `list`, `watch`, `status` and
//! `handler` talk to a running agent through its admin socket; `completions` prints shell
//! completions.

use crate::admin;
use crate::agent::{AgentConfig, RunningAgent};
use crate::config::ConfigFile;
use crate::event_source::{SourceChoice, SourceOptions};
use crate::executor::{ExecutorConfig, HandlerTimeouts};
use crate::handler::{self, HandlerRegistry};
use crate::reconciler::ReconcileMode;
use crate::registration::Timeouts;
use crate::telemetry;
use anyhow::Context;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use plugin_agent_proto::pluginagent::v1 as api;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
detection and rescans, so registration takes milliseconds and no plugin is lost.",
    after_help = "Examples:\n  \
        plugin-agent run --handler CSIPlugin=unix:///run/csi-handler.sock\n  \
        plugin-agent run --config /etc/plugin-agent/plugin-agent.toml\n  \
        plugin-agent list -o json\n  \
        plugin-agent watch\n  \
        plugin-agent handler add DRAPlugin unix:///run/dra-handler.sock"
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

    /// The admin API socket (served by `run`, used by the other commands).
    #[arg(long, global = true, env = "PLUGIN_AGENT_ADMIN_SOCKET")]
    pub admin_socket: Option<PathBuf>,
}

/// Log output format.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Output format of the operator commands.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Output {
    /// A table (list) or text (status, watch).
    Table,
    /// JSON.
    Json,
    /// YAML.
    Yaml,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Watch the plugin directory and register plugins until SIGINT/SIGTERM.
    #[command(after_help = "Examples:\n  \
        plugin-agent run\n  \
        plugin-agent run --handler CSIPlugin=accept-all --handler DRAPlugin=unix:///run/dra.sock\n  \
        plugin-agent run --source inotify --reconcile-mode polling   # behave like kubelet")]
    Run(Box<RunArgs>),
    /// List every plugin socket: state, name, type, endpoint, versions, errors, next retry.
    #[command(after_help = "Examples:\n  plugin-agent list\n  plugin-agent list -o yaml")]
    List {
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Follow discovery and registration events as they happen (Ctrl-C to stop).
    Watch {
        /// Output format (`table` prints one line per event).
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Event source and hooks in use, loss and rescans, handler health, versions.
    Status {
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Add or remove a handler in the running agent.
    #[command(subcommand)]
    Handler(HandlerCommand),
    /// Print shell completions.
    #[command(
        after_help = "Example:\n  plugin-agent completions bash > /etc/bash_completion.d/plugin-agent"
    )]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// `plugin-agent handler ...`.
#[derive(Subcommand, Debug)]
pub enum HandlerCommand {
    /// Install or replace the handler for a plugin type; waiting plugins register at once.
    #[command(
        after_help = "Example:\n  plugin-agent handler add DRAPlugin unix:///run/dra-handler.sock"
    )]
    Add {
        /// Plugin type, e.g. CSIPlugin, DevicePlugin, DRAPlugin.
        plugin_type: String,
        /// `accept-all`, `unix:///path.sock` or `http://host:port`.
        target: String,
    },
    /// Remove the handler for a plugin type (registered plugins stay until their sockets go).
    Remove {
        /// Plugin type.
        plugin_type: String,
    },
}

/// `plugin-agent run`. Settings left out come from `--config`, then from the defaults shown.
#[derive(Args, Debug, Default)]
pub struct RunArgs {
    /// TOML configuration file (see deploy/plugin-agent.toml); flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Registration directory to watch, recursively; created 0755 if missing
    /// [default: /var/lib/kubelet/plugins_registry].
    #[arg(long)]
    pub plugin_dir: Option<PathBuf>,

    /// A handler for a plugin type, as TYPE=TARGET; TARGET is `accept-all` (built in: accept and
    /// log), `unix:///path.sock` or `http://host:port` (a pluginagent.v1.PluginHandler server).
    /// Repeat for several types.
    #[arg(long = "handler", value_name = "TYPE=TARGET", value_parser = parse_handler)]
    pub handlers: Vec<(String, String)>,

    /// Event source: auto picks eBPF, else fanotify, else inotify, and logs why [default: auto].
    #[arg(long, value_parser = parse_source)]
    pub source: Option<SourceChoice>,

    /// event: react to every change; polling: kubelet's 1 s reconciler loop [default: event].
    #[arg(long, value_enum)]
    pub reconcile_mode: Option<ReconcileMode>,

    /// Period of the safety pass (full reconcile and re-walk) in event mode [default: 30s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub safety_period: Option<Duration>,

    /// Registration and deregistration operations running at once [default: 256].
    #[arg(long)]
    pub max_concurrent: Option<usize>,

    /// eBPF ring buffer size in bytes, a power of two [default: 2097152].
    #[arg(long)]
    pub ring_buffer_bytes: Option<usize>,

    /// Handler ValidatePlugin/RegisterPlugin deadline [default: 45s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub handler_timeout: Option<Duration>,

    /// Handler DeRegisterPlugin deadline [default: 10s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub deregister_timeout: Option<Duration>,

    /// Do not serve the admin API.
    #[arg(long)]
    pub no_admin: bool,

    /// Serve Prometheus `/metrics`, `/healthz` and `/readyz` on this address
    /// [default: 127.0.0.1:9464].
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,

    /// Do not serve metrics and health endpoints.
    #[arg(long, conflicts_with = "metrics_addr")]
    pub no_metrics: bool,

    /// Export traces over OTLP/gRPC to this collector, e.g. `http://127.0.0.1:4317`. Off by
    /// default; `OTEL_EXPORTER_OTLP_ENDPOINT` (and the other `OTEL_*` variables) work too.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,

    /// Keep all capabilities after start instead of dropping all but CAP_DAC_OVERRIDE and
    /// CAP_DAC_READ_SEARCH once the event source is attached (for debugging).
    #[arg(long)]
    pub keep_capabilities: bool,
}

fn parse_handler(value: &str) -> Result<(String, String), String> {
    let (plugin_type, target) = value
        .split_once('=')
        .ok_or_else(|| format!("expected TYPE=TARGET, got {value:?}"))?;
    if plugin_type.is_empty() {
        return Err("empty plugin type".into());
    }
    if target != "accept-all" {
        handler::grpc::Address::parse(target)?;
    }
    Ok((plugin_type.to_string(), target.to_string()))
}

fn parse_source(value: &str) -> Result<SourceChoice, String> {
    value.parse()
}

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

impl RunArgs {
    /// `--otlp-endpoint`, else the config file's `otlp_endpoint` (read early: tracing is set up
    /// before the agent starts). A config file that cannot be read is reported by `run` itself.
    pub fn otlp_endpoint_or_configured(&self) -> Option<String> {
        self.otlp_endpoint.clone().or_else(|| {
            let path = self.config.as_ref()?;
            ConfigFile::load(path).ok()?.otlp_endpoint
        })
    }

    /// Merges flags over `file` over kubelet-compatible defaults.
    pub fn resolve(
        self,
        file: ConfigFile,
        admin_socket: Option<PathBuf>,
    ) -> anyhow::Result<RunSettings> {
        let plugin_dir = self
            .plugin_dir
            .or(file.plugin_dir)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_PLUGIN_DIR));
        let mut agent = AgentConfig::new(plugin_dir);
        agent.source = match (self.source, file.source) {
            (Some(source), _) => source,
            (None, Some(text)) => text
                .parse()
                .map_err(anyhow::Error::msg)
                .context("config: source")?,
            (None, None) => SourceChoice::Auto,
        };
        agent.reconcile_mode = match (self.reconcile_mode, file.reconcile_mode) {
            (Some(mode), _) => mode,
            (None, Some(text)) => ReconcileMode::from_str(&text, true)
                .map_err(anyhow::Error::msg)
                .context("config: reconcile_mode")?,
            (None, None) => ReconcileMode::Event,
        };
        agent.safety_period = self
            .safety_period
            .or(file.safety_period)
            .unwrap_or(agent.safety_period);
        agent.source_options = SourceOptions {
            ring_buffer_bytes: self
                .ring_buffer_bytes
                .or(file.ring_buffer_bytes)
                .unwrap_or(0),
        };
        let t = &file.timeouts;
        let plugin_defaults = Timeouts::default();
        let handler_defaults = HandlerTimeouts::default();
        agent.executor = ExecutorConfig {
            plugin_timeouts: Timeouts {
                dial: t.dial.unwrap_or(plugin_defaults.dial),
                get_info: t.get_info.unwrap_or(plugin_defaults.get_info),
                notify: t.notify.unwrap_or(plugin_defaults.notify),
            },
            handler_timeouts: HandlerTimeouts {
                validate: self
                    .handler_timeout
                    .or(t.validate)
                    .unwrap_or(handler_defaults.validate),
                register: self
                    .handler_timeout
                    .or(t.register)
                    .unwrap_or(handler_defaults.register),
                deregister: self
                    .deregister_timeout
                    .or(t.deregister)
                    .unwrap_or(handler_defaults.deregister),
            },
            max_concurrent: self
                .max_concurrent
                .or(file.max_concurrent)
                .unwrap_or(ExecutorConfig::default().max_concurrent),
        };
        let metrics_addr = self.metrics_addr.or(file.metrics_addr);
        agent.metrics_addr =
            (!self.no_metrics).then(|| metrics_addr.unwrap_or(telemetry::http::DEFAULT_ADDR));
        let mut handlers = file.handlers;
        for (plugin_type, target) in &handlers {
            parse_handler(&format!("{plugin_type}={target}"))
                .map_err(anyhow::Error::msg)
                .context("config: handlers")?;
        }
        handlers.extend(self.handlers);
        let admin_socket = (!self.no_admin).then(|| {
            admin_socket
                .or(file.admin_socket)
                .unwrap_or_else(|| PathBuf::from(admin::DEFAULT_SOCKET))
        });
        Ok(RunSettings {
            agent,
            handlers,
            admin_socket,
            keep_capabilities: self.keep_capabilities,
        })
    }
}

/// Runs a command to completion.
pub async fn execute(cli: Cli) -> anyhow::Result<()> {
    let admin_socket = cli.admin_socket;
    let socket = || {
        admin_socket
            .clone()
            .unwrap_or_else(|| PathBuf::from(admin::DEFAULT_SOCKET))
    };
    match cli.command {
        Command::Run(args) => {
            let file = match &args.config {
                Some(path) => ConfigFile::load(path)?,
                None => ConfigFile::default(),
            };
            run(args.resolve(file, admin_socket.clone())?).await
        }
        Command::List { output } => list(&socket(), output).await,
        Command::Watch { output } => watch(&socket(), output).await,
        Command::Status { output } => status(&socket(), output).await,
        Command::Handler(HandlerCommand::Add {
            plugin_type,
            target,
        }) => {
            let mut client = admin::client::connect(&socket()).await?;
            client
                .add_handler(api::AddHandlerRequest {
                    plugin_type: plugin_type.clone(),
                    target: target.clone(),
                })
                .await?;
            println!("handler for {plugin_type} is now {target}");
            Ok(())
        }
        Command::Handler(HandlerCommand::Remove { plugin_type }) => {
            let mut client = admin::client::connect(&socket()).await?;
            let removed = client
                .remove_handler(api::RemoveHandlerRequest {
                    plugin_type: plugin_type.clone(),
                })
                .await?
                .into_inner()
                .removed;
            println!(
                "{}",
                if removed {
                    format!("handler for {plugin_type} removed")
                } else {
                    format!("no handler for {plugin_type}")
                }
            );
            Ok(())
        }
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "plugin-agent",
                &mut std::io::stdout(),
            );
            Ok(())
        }
    }
}

/// `plugin-agent run`, until SIGINT or SIGTERM.
pub async fn run(settings: RunSettings) -> anyhow::Result<()> {
    // One agent per runtime directory, checked before anything starts (see `runtime_dir`).
    let _lock = settings
        .admin_socket
        .as_deref()
        .map(crate::runtime_dir::lock)
        .transpose()?;
    let handlers = Arc::new(HandlerRegistry::default());
    for (plugin_type, target) in &settings.handlers {
        let handler = handler::from_target(target).map_err(anyhow::Error::msg)?;
        tracing::info!(plugin_type = %plugin_type, handler = %target, "handler configured");
        handlers.insert(plugin_type, handler);
    }
    let agent = RunningAgent::start(settings.agent, handlers).await?;
    if settings.keep_capabilities {
        tracing::warn!("--keep-capabilities: running with every capability the agent started with");
    } else {
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
    let admin_cancel = tokio_util::sync::CancellationToken::new();
    let admin = settings.admin_socket.map(|socket| {
        let service = admin::server::AdminService::new(&agent);
        let cancel = admin_cancel.clone();
        tokio::spawn(async move {
            if let Err(e) = admin::server::serve(&socket, service, cancel).await {
                tracing::error!(error = format!("{e:#}"), "admin API stopped");
            }
        })
    });
    let result = agent.run_until(shutdown_signal()).await;
    admin_cancel.cancel();
    if let Some(admin) = admin {
        // Its connections end with the cancel (see `serving`); the bound is a backstop.
        let _ = tokio::time::timeout(std::time::Duration::from_millis(600), admin).await;
    }
    result
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

/// A plugin socket as `list` prints it.
#[derive(Debug, serde::Serialize)]
struct PluginRow {
    socket_path: String,
    state: String,
    #[serde(rename = "type")]
    plugin_type: String,
    name: String,
    endpoint: String,
    supported_versions: Vec<String>,
    socket_dev: u64,
    socket_ino: u64,
    registered_at: Option<String>,
    last_error: Option<String>,
    next_retry: Option<String>,
    failures: u32,
}

impl From<api::PluginEntry> for PluginRow {
    fn from(e: api::PluginEntry) -> Self {
        let plugin = e.plugin.unwrap_or_default();
        let state = api::PluginState::try_from(e.state).unwrap_or(api::PluginState::Unspecified);
        PluginRow {
            socket_path: e.socket_path,
            state: state
                .as_str_name()
                .trim_start_matches("PLUGIN_STATE_")
                .to_lowercase(),
            plugin_type: plugin.r#type,
            name: plugin.name,
            endpoint: plugin.endpoint,
            supported_versions: plugin.supported_versions,
            socket_dev: e.socket_dev,
            socket_ino: e.socket_ino,
            registered_at: (e.registered_unix_ms > 0).then(|| timestamp(e.registered_unix_ms)),
            last_error: (!e.last_error.is_empty()).then_some(e.last_error),
            next_retry: (e.next_retry_unix_ms > 0).then(|| timestamp(e.next_retry_unix_ms)),
            failures: e.failures,
        }
    }
}

fn timestamp(unix_ms: i64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(unix_ms.max(0) as u64))
        .to_string()
}

fn print_structured<T: serde::Serialize>(value: &T, output: Output) -> anyhow::Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(value)?),
        Output::Yaml => print!("{}", serde_norway::to_string(value)?),
        Output::Table => unreachable!("tables are printed by each command"),
    }
    Ok(())
}

async fn list(socket: &std::path::Path, output: Output) -> anyhow::Result<()> {
    let mut client = admin::client::connect(socket).await?;
    let rows: Vec<PluginRow> = client
        .list_plugins(api::ListPluginsRequest {})
        .await?
        .into_inner()
        .plugins
        .into_iter()
        .map(PluginRow::from)
        .collect();
    if output != Output::Table {
        return print_structured(&rows, output);
    }
    let table: Vec<[String; 6]> = rows
        .iter()
        .map(|r| {
            let note = match (&r.last_error, &r.next_retry) {
                (Some(e), Some(at)) => format!("retry {at}: {e}"),
                (Some(e), None) => e.clone(),
                _ => r
                    .registered_at
                    .clone()
                    .map(|at| format!("since {at}"))
                    .unwrap_or_default(),
            };
            [
                r.socket_path.clone(),
                r.state.clone(),
                r.plugin_type.clone(),
                r.name.clone(),
                r.supported_versions.join(","),
                note,
            ]
        })
        .collect();
    print_table(
        &["SOCKET", "STATE", "TYPE", "NAME", "VERSIONS", "NOTE"],
        &table,
    );
    Ok(())
}

fn print_table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) {
    // Cells hold what plugins announce: no control character reaches the terminal.
    let rows: Vec<[String; N]> = rows
        .iter()
        .map(|row| {
            row.clone()
                .map(|cell| crate::text::escape(&cell).into_owned())
        })
        .collect();
    let rows = rows.as_slice();
    let mut widths: [usize; N] = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// An event as `watch` prints it.
#[derive(Debug, serde::Serialize)]
struct EventRow {
    time: String,
    kind: String,
    socket_path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    plugin: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_us: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

async fn watch(socket: &std::path::Path, output: Output) -> anyhow::Result<()> {
    let mut client = admin::client::connect(socket).await?;
    let mut stream = client
        .watch_events(api::WatchEventsRequest {})
        .await?
        .into_inner();
    // The agent subscribed before it answered: from here no event is missed. Said on stderr so
    // scripts (and tests) can start acting once the stream is live, without polluting stdout.
    eprintln!("watching events of {}", socket.display());
    while let Some(event) = stream.message().await? {
        let kind = api::EventKind::try_from(event.kind).unwrap_or(api::EventKind::Unspecified);
        let row = EventRow {
            time: humantime::format_rfc3339_micros(
                UNIX_EPOCH + Duration::from_nanos(event.time_unix_nanos.max(0) as u64),
            )
            .to_string(),
            kind: kind
                .as_str_name()
                .trim_start_matches("EVENT_KIND_")
                .to_lowercase(),
            socket_path: event.socket_path,
            plugin: event.plugin.map(|p| format!("{}/{}", p.r#type, p.name)),
            error: (!event.error.is_empty()).then_some(event.error),
            latency_us: (event.latency_us > 0).then_some(event.latency_us),
            detail: (!event.detail.is_empty()).then_some(event.detail),
        };
        match output {
            Output::Json => println!("{}", serde_json::to_string(&row)?),
            Output::Yaml => print!("---\n{}", serde_norway::to_string(&row)?),
            Output::Table => {
                let mut line = format!("{} {:<20} {}", row.time, row.kind, row.socket_path);
                if let Some(p) = &row.plugin {
                    line += &format!(" plugin={p}");
                }
                if let Some(l) = row.latency_us {
                    line += &format!(" latency={:.3}ms", l as f64 / 1000.0);
                }
                if let Some(e) = &row.error {
                    line += &format!(" error={e:?}");
                }
                if let Some(d) = &row.detail {
                    line += &format!(" ({d})");
                }
                println!("{}", crate::text::escape(&line));
            }
        }
    }
    Ok(())
}

#[derive(Debug, serde::Serialize)]
struct StatusView {
    version: String,
    plugin_dir: String,
    source: String,
    source_description: String,
    reconcile_mode: String,
    started_at: String,
    plugins_desired: u64,
    plugins_registered: u64,
    rescans: u64,
    loss_rescans: u64,
    watched_directories: u64,
    problems: Vec<String>,
    handlers: Vec<HandlerView>,
}

#[derive(Debug, serde::Serialize)]
struct HandlerView {
    plugin_type: String,
    target: String,
    healthy: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_error: Option<String>,
}

async fn status(socket: &std::path::Path, output: Output) -> anyhow::Result<()> {
    let mut client = admin::client::connect(socket).await?;
    let s = client
        .get_status(api::GetStatusRequest {})
        .await?
        .into_inner();
    let view = StatusView {
        version: s.version,
        plugin_dir: s.plugin_dir,
        source: s.source,
        source_description: s.source_description,
        reconcile_mode: s.reconcile_mode,
        started_at: timestamp(s.started_unix_ms),
        plugins_desired: s.plugins_desired,
        plugins_registered: s.plugins_registered,
        rescans: s.rescans,
        loss_rescans: s.events_lost,
        watched_directories: s.watched_directories,
        problems: s.problems,
        handlers: s
            .handlers
            .into_iter()
            .map(|h| HandlerView {
                plugin_type: h.plugin_type,
                target: h.target,
                healthy: h.healthy,
                last_error: (!h.last_error.is_empty()).then_some(h.last_error),
            })
            .collect(),
    };
    if output != Output::Table {
        return print_structured(&view, output);
    }
    let uptime = SystemTime::now()
        .duration_since(UNIX_EPOCH + Duration::from_millis(s.started_unix_ms.max(0) as u64))
        .unwrap_or_default();
    println!(
        "plugin-agent {}  up {}",
        view.version,
        humantime::format_duration(Duration::from_secs(uptime.as_secs()))
    );
    println!("plugin dir:    {}", view.plugin_dir);
    println!(
        "event source:  {} ({})",
        view.source, view.source_description
    );
    println!("reconciler:    {}", view.reconcile_mode);
    println!(
        "plugins:       {} found, {} registered",
        view.plugins_desired, view.plugins_registered
    );
    println!(
        "rescans:       {} ({} after event loss)",
        view.rescans, view.loss_rescans
    );
    println!("watching:      {} directories", view.watched_directories);
    for problem in &view.problems {
        println!("PROBLEM:       {}", crate::text::escape(problem));
    }
    println!("handlers:");
    for h in &view.handlers {
        let health = if h.healthy { "healthy" } else { "UNREACHABLE" };
        let error = h
            .last_error
            .as_deref()
            .map(|e| format!(" last error: {e}"))
            .unwrap_or_default();
        let line = format!(
            "  {:<16} {:<8} {}{}",
            h.plugin_type, health, h.target, error
        );
        println!("{}", crate::text::escape(&line));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handler_argument_parses_type_and_target() {
        assert_eq!(
            parse_handler("CSIPlugin=accept-all"),
            Ok(("CSIPlugin".into(), "accept-all".into()))
        );
        assert_eq!(
            parse_handler("DRAPlugin=unix:///run/d.sock"),
            Ok(("DRAPlugin".into(), "unix:///run/d.sock".into()))
        );
        assert!(parse_handler("CSIPlugin").is_err());
        assert!(parse_handler("=accept-all").is_err());
        assert!(parse_handler("CSIPlugin=magic").is_err());
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_override_config_file_which_overrides_defaults() {
        let file = ConfigFile::parse(
            "plugin_dir = \"/from/file\"\nsource = \"inotify\"\nmax_concurrent = 7\n[handlers]\nCSIPlugin = \"accept-all\"\nDRAPlugin = \"accept-all\"\n[timeouts]\nvalidate = \"3s\"",
        )
        .expect("config");
        let args = RunArgs {
            plugin_dir: Some("/from/flag".into()),
            handlers: vec![("DRAPlugin".into(), "unix:///run/dra.sock".into())],
            ..RunArgs::default()
        };
        let settings = args.resolve(file, None).expect("resolves");
        assert_eq!(settings.agent.plugin_dir, PathBuf::from("/from/flag"));
        assert_eq!(
            settings.agent.source,
            SourceChoice::Only(crate::event_source::SourceKind::Inotify)
        );
        assert_eq!(settings.agent.executor.max_concurrent, 7);
        assert_eq!(
            settings.agent.executor.handler_timeouts.validate,
            Duration::from_secs(3)
        );
        assert_eq!(
            settings.agent.executor.handler_timeouts.register,
            Duration::from_secs(45)
        );
        assert_eq!(
            settings.handlers.get("DRAPlugin").map(String::as_str),
            Some("unix:///run/dra.sock")
        );
        assert_eq!(
            settings.handlers.get("CSIPlugin").map(String::as_str),
            Some("accept-all")
        );
        assert_eq!(
            settings.admin_socket,
            Some(PathBuf::from(admin::DEFAULT_SOCKET))
        );
    }

    #[test]
    fn bad_config_values_are_reported() {
        let file = ConfigFile::parse("[handlers]\nCSIPlugin = \"ftp://x\"").expect("parses");
        assert!(RunArgs::default().resolve(file, None).is_err());
        let file = ConfigFile::parse("source = \"kprobe\"").expect("parses");
        assert!(RunArgs::default().resolve(file, None).is_err());
    }
}
