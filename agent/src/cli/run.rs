//! `plugin-agent run`: the settings from flags, the configuration file and defaults (flags win),
//! handed to the agent (`agent::run`), which assembles and runs the process.

use crate::admin;
use crate::agent::AgentConfig;
pub use crate::agent::RunSettings;
use crate::config::{ConfigFile, PolicySource};
use crate::event_source::{SourceChoice, SourceOptions};
use crate::executor::{ExecutorConfig, HandlerTimeouts};
use crate::handler;
use crate::mode::{Contact, Mode};
use crate::policy::RuleFile;
use crate::reconciler::ReconcileMode;
use crate::registration::Timeouts;
use crate::telemetry;
use anyhow::Context;
use clap::{Args, ValueEnum};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

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

    /// register: GetInfo, handlers, Notify (kubelet's job, on a directory the agent owns);
    /// observe: discover and describe, never Notify, never a handler (beside kubelet)
    /// [default: register when a handler is configured, else observe].
    #[arg(long, value_enum)]
    pub mode: Option<ModeChoice>,

    /// In observe mode, whether plugins are asked GetInfo: after kubelet first called them (or 3 s
    /// after their socket was made), at once, or never [default: after-kubelet].
    #[arg(long, value_enum)]
    pub observe_contact: Option<Contact>,

    /// Event source: auto picks eBPF, else fanotify, else inotify, and logs why [default: auto].
    #[arg(long, value_parser = parse_source)]
    pub source: Option<SourceChoice>,

    /// event: react to every change; polling: kubelet's 1 s reconciler loop [default: event].
    #[arg(long, value_enum)]
    pub reconcile_mode: Option<ReconcileMode>,

    /// Quiet before the safety pass (full reconcile and re-walk) in event mode; it runs at least
    /// every twice this long, and a costly pass is spaced to 1% of a CPU [default: 30s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub safety_period: Option<Duration>,

    /// Registration and deregistration operations running at once [default: 256]; a quarter of
    /// them may be dialling plugins (connect, GetInfo) at once.
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

    /// Export the trace of every operation slower than this (and of every failed one) even when
    /// `OTEL_TRACES_SAMPLER` did not sample it [default: 500ms].
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub trace_keep_slower_than: Option<Duration>,

    /// Do not pin the eBPF programs in bpffs: they detach when the agent exits, and the next
    /// agent loads them again (and misses what happens in between).
    #[arg(long)]
    pub no_ebpf_pins: bool,

    /// After a restart, register every plugin again (kubelet's behaviour) instead of carrying
    /// on from the previous agent's state file: for handlers that keep nothing across restarts.
    #[arg(long)]
    pub reregister_on_restart: bool,

    /// Policy for the simple case, one rule for every plugin after the configuration file's
    /// `[[policy]]` rules: the serving process's uid must be one of these. Repeatable.
    #[arg(long = "policy-allow-uid", value_name = "UID")]
    pub policy_allow_uids: Vec<u32>,

    /// As --policy-allow-uid, for the serving process's gid.
    #[arg(long = "policy-allow-gid", value_name = "GID")]
    pub policy_allow_gids: Vec<u32>,

    /// As --policy-allow-uid, a glob on the serving process's cgroup v2 path (`*` matches `/`
    /// too), e.g. '/kubepods.slice/*'.
    #[arg(long = "policy-allow-cgroup", value_name = "GLOB")]
    pub policy_allow_cgroups: Vec<String>,

    /// As --policy-allow-uid: a socket's creator must be in its server's cgroup.
    #[arg(long)]
    pub policy_same_cgroup: bool,

    /// Complete each socket's creator and server from /proc (command, cgroup, pod, container)
    /// [default: true]; false keeps only what the kernel reports.
    #[arg(long, value_name = "BOOL")]
    pub provenance: Option<bool>,

    /// Keep all capabilities after start instead of dropping all but CAP_DAC_OVERRIDE once the
    /// event source is attached (for debugging).
    #[arg(long)]
    pub keep_capabilities: bool,
}

/// Kubelet's plugin registration directory.
pub const DEFAULT_PLUGIN_DIR: &str = "/var/lib/kubelet/plugins_registry";

/// `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeChoice {
    /// GetInfo, handlers, Notify.
    Register,
    /// Never Notify, never a handler.
    Observe,
}

pub(super) fn parse_handler(value: &str) -> Result<(String, String), String> {
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
        let executor = self.executor_config(&file);
        let policy = self.policy_source(self.flag_rule())?;
        let plugin_dir = self
            .plugin_dir
            .clone()
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
        let pins = !self.no_ebpf_pins && file.ebpf_pins.unwrap_or(true);
        agent.source_options = SourceOptions {
            ring_buffer_bytes: self
                .ring_buffer_bytes
                .or(file.ring_buffer_bytes)
                .unwrap_or(0),
            ebpf_pins: None,
        };
        agent.executor = executor;
        let metrics_addr = self.metrics_addr.or(file.metrics_addr);
        agent.metrics_addr =
            (!self.no_metrics).then(|| metrics_addr.unwrap_or(telemetry::http::DEFAULT_ADDR));
        let mut handlers = file.handlers;
        for (plugin_type, target) in &handlers {
            parse_handler(&format!("{plugin_type}={target}"))
                .map_err(anyhow::Error::msg)
                .context("config: handlers")?;
        }
        handlers.extend(self.handlers.iter().cloned());
        agent.executor.mode = self.mode(file.mode.as_deref(), file.observe_contact, &handlers)?;
        let admin_socket = (!self.no_admin).then(|| {
            admin_socket
                .or(file.admin_socket)
                .unwrap_or_else(|| PathBuf::from(admin::DEFAULT_SOCKET))
        });
        in_runtime_dir(&mut agent, admin_socket.as_deref(), pins);
        agent.reregister_on_restart =
            self.reregister_on_restart || file.reregister_on_restart.unwrap_or(false);
        agent.provenance = self.provenance.or(file.provenance).unwrap_or(true);
        agent.policy = policy;
        Ok(RunSettings {
            agent,
            handlers,
            admin_socket,
            keep_capabilities: self.keep_capabilities,
        })
    }

    /// `--mode` over the file's `mode` (with `--observe-contact` over the file's): without
    /// either, observe when no handler is configured.
    fn mode(
        &self,
        file_mode: Option<&str>,
        file_contact: Option<Contact>,
        handlers: &BTreeMap<String, String>,
    ) -> anyhow::Result<Mode> {
        let mode_choice = match (self.mode, file_mode) {
            (Some(mode), _) => Some(mode),
            (None, Some(text)) => Some(
                ModeChoice::from_str(text, true)
                    .map_err(anyhow::Error::msg)
                    .context("config: mode")?,
            ),
            (None, None) => None,
        };
        let contact = self.observe_contact.or(file_contact).unwrap_or_default();
        Ok(match mode_choice {
            Some(ModeChoice::Register) => Mode::Register,
            Some(ModeChoice::Observe) => Mode::Observe { contact },
            // Nothing to register plugins with: telling every plugin "no handler" would fail
            // them on a node where kubelet registers them.
            None if handlers.is_empty() => Mode::Observe { contact },
            None => Mode::Register,
        })
    }

    /// Where the policy is read from, at start and on every reload: the configuration file
    /// (absolute, so a reload finds it whatever the directory is then), then `flag_rule`.
    fn policy_source(&self, flag_rule: Option<RuleFile>) -> anyhow::Result<PolicySource> {
        Ok(PolicySource {
            file: self
                .config
                .as_deref()
                .map(std::path::absolute)
                .transpose()?,
            flag_rule,
        })
    }

    /// The rule `--policy-*` make, if any: every plugin, after the file's rules.
    fn flag_rule(&self) -> Option<RuleFile> {
        let list = |values: &[u32]| (!values.is_empty()).then(|| values.to_vec());
        let rule = RuleFile {
            id: Some("command-line".into()),
            plugin_type: "*".into(),
            name: "*".into(),
            allow_uids: list(&self.policy_allow_uids),
            allow_gids: list(&self.policy_allow_gids),
            allow_cgroups: (!self.policy_allow_cgroups.is_empty())
                .then(|| self.policy_allow_cgroups.clone()),
            same_cgroup: self.policy_same_cgroup,
        };
        let any = rule.allow_uids.is_some()
            || rule.allow_gids.is_some()
            || rule.allow_cgroups.is_some()
            || rule.same_cgroup;
        any.then_some(rule)
    }

    /// Timeouts and concurrency of operations: flags over `file` over kubelet's values.
    fn executor_config(&self, file: &ConfigFile) -> ExecutorConfig {
        let t = &file.timeouts;
        let plugin_defaults = Timeouts::default();
        let handler_defaults = HandlerTimeouts::default();
        ExecutorConfig {
            plugin_timeouts: Timeouts {
                dial: t.dial.unwrap_or(plugin_defaults.dial),
                listen: t.dial.unwrap_or(plugin_defaults.listen),
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
            mode: Mode::Register,
            // Known once the source is open (see `agent`).
            listens_reported: false,
        }
    }
}

/// The state file and the eBPF pins of `agent`, in the runtime directory: the admin socket's,
/// which its lock makes this agent's own (see `runtime_dir`); without one, nothing is carried
/// across restarts and nothing is pinned (pins belong to an instance, named by the runtime
/// directory it holds the lock of: see `ebpf::pins`).
fn in_runtime_dir(agent: &mut AgentConfig, admin_socket: Option<&Path>, pins: bool) {
    let runtime_dir = admin_socket
        .and_then(Path::parent)
        .map(|dir| {
            if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            }
        })
        .and_then(|dir| std::path::absolute(dir).ok());
    agent.state_file = runtime_dir
        .as_deref()
        .map(|dir| dir.join(crate::persist::FILE_NAME));
    agent.source_options.ebpf_pins = runtime_dir.filter(|_| pins).and_then(|runtime_dir| {
        Some(crate::event_source::ebpf::PinOwner {
            tree: std::path::absolute(&agent.plugin_dir).ok()?,
            runtime_dir,
        })
    });
}

/// `plugin-agent run`: hands the settings to the agent, which runs until SIGINT or SIGTERM.
pub async fn run(settings: RunSettings) -> anyhow::Result<()> {
    crate::agent::run(settings).await
}
