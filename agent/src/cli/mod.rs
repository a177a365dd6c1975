//! The `plugin-agent` command line: `run` starts the agent; `list`, `watch`, `status`,
//! `explain`, `handler` and `policy` talk to a running agent through its admin socket; `completions` prints shell
//! completions.
//!
//! One file per subcommand, as bpfman's CLI: this file holds the clap definitions and the
//! dispatch; [`run`] merges flags, the configuration file and defaults and runs the agent;
//! [`list`], [`watch`], [`status`], [`handler`] and [`policy`] are admin API clients; [`render`] holds the
//! output helpers they share (tables, JSON/YAML, timestamps), [`output`] the `-o` format and stdout.

/// `println!` for what the operator commands print: a reader that goes away early
/// (`plugin-agent list | head`) ends the command quietly, as it ends any Unix tool, instead of the
/// panic `println!` raises on a broken pipe.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` likewise (see [`out!`]).
macro_rules! out_raw {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!($($arg)*))
    };
}

mod cleanup;
mod explain;
mod handler;
mod list;
mod output;
mod policy;
mod probe;
mod render;
pub mod run;
mod status;
mod watch;

use crate::admin;
use crate::config::ConfigFile;
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

pub use handler::HandlerCommand;
pub use output::Output;
pub(crate) use output::write_stdout;
pub use run::{DEFAULT_PLUGIN_DIR, RunArgs, RunSettings};

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

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Watch the plugin directory and register plugins until SIGINT/SIGTERM.
    #[command(after_help = "Examples:\n  \
        plugin-agent run\n  \
        plugin-agent run --handler CSIPlugin=accept-all --handler DRAPlugin=unix:///run/dra.sock\n  \
        plugin-agent run --source inotify --reconcile-mode polling   # behave like kubelet")]
    Run(Box<RunArgs>),
    /// List every plugin socket: state, name, type, endpoint, versions, errors, next retry.
    #[command(
        after_help = "Examples:\n  plugin-agent list\n  plugin-agent list --wide\n  plugin-agent list -o yaml"
    )]
    List {
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
        /// In the table, who serves and who created each socket, who first connected to it (eBPF:
        /// kubelet, beside it), and its pod or cgroup.
        #[arg(long)]
        wide: bool,
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
    /// Why a plugin is or is not registered: the verdict, the timeline the agent observed for its
    /// socket, and checks (each passed or failed, with the fix).
    #[command(after_help = "Examples:\n  \
        plugin-agent explain /var/lib/kubelet/plugins_registry/csi.example.com-reg.sock\n  \
        plugin-agent explain csi.example.com        # the driver name GetInfo announced\n  \
        plugin-agent explain csi.example.com -o json")]
    Explain {
        /// A socket path, a plugin (driver) name, or a socket's file name.
        target: String,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Add or remove a handler in the running agent.
    #[command(subcommand)]
    Handler(HandlerCommand),
    /// The running agent's policy (who may register what).
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Remove what the agent leaves behind on purpose so that a restart is invisible: the
    /// pinned eBPF programs (which detaches them) and the state file. For uninstalling; a
    /// restart or an upgrade needs neither removed. Refused while the agent of this admin
    /// socket runs; other agents' pins are kept while they run.
    #[command(after_help = "Examples:\n  \
        plugin-agent cleanup                       # the default plugin directory's\n  \
        plugin-agent cleanup --plugin-dir /var/lib/kubelet/plugins_registry\n  \
        plugin-agent cleanup --all                 # every stopped agent's pins")]
    Cleanup {
        /// The watched tree whose pins go [default: /var/lib/kubelet/plugins_registry].
        #[arg(long, conflicts_with = "all")]
        plugin_dir: Option<PathBuf>,
        /// Every tree's pins (all of /sys/fs/bpf/plugin-agent) whose agents do not run.
        #[arg(long)]
        all: bool,
        /// Remove running agents' pins too (they hold their programs and pin them again).
        #[arg(long)]
        force: bool,
    },
    /// What this node's kernel gives the agent, without running it: each kernel feature it uses
    /// (and what it does without one), and each eBPF hook family loaded through the verifier,
    /// attached and detached again. Needs the privileges of `run` (root, or CAP_BPF and
    /// CAP_PERFMON); fails when no hook family loads.
    #[command(after_help = "Examples:\n  plugin-agent probe\n  plugin-agent probe -o json")]
    Probe {
        /// Output format (`json` is one line).
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Print shell completions.
    #[command(
        after_help = "Example:\n  plugin-agent completions bash > /etc/bash_completion.d/plugin-agent"
    )]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// `plugin-agent policy ...`.
#[derive(Subcommand, Debug)]
pub enum PolicyCommand {
    /// Read the configuration file's [[policy]] rules again and apply them to every socket
    /// (as SIGHUP does): registered plugins the new policy refuses are deregistered, refused ones
    /// are tried again. A file that does not parse changes nothing; the error says where.
    #[command(after_help = "Example:\n  plugin-agent policy reload")]
    Reload,
}

/// `plugin-agent run`. Settings left out come from `--config`, then from the defaults shown.
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
            run::run(args.resolve(file, admin_socket.clone())?).await
        }
        Command::List { output, wide } => list::list(&socket(), output, wide).await,
        Command::Watch { output } => watch::watch(&socket(), output).await,
        Command::Status { output } => status::status(&socket(), output).await,
        Command::Explain { target, output } => explain::explain(&socket(), &target, output).await,
        Command::Handler(command) => handler::execute(&socket(), command).await,
        Command::Policy(PolicyCommand::Reload) => policy::reload(&socket()).await,
        Command::Cleanup {
            plugin_dir,
            all,
            force,
        } => cleanup::cleanup(plugin_dir, all, force, &socket()),
        Command::Probe { output } => probe::probe(output),
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "plugin-agent", &mut script);
            out_raw!("{}", String::from_utf8_lossy(&script));
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::run::parse_handler;
    use super::*;
    use crate::event_source::SourceChoice;
    use std::time::Duration;

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
