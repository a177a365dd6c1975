//! The `plugin-agent` binary: parses the command line, sets up logging (and, for `run`, trace
//! export), runs the command.

use clap::Parser;
use plugin_agent::cli::{self, Cli, Command, LogFormat};
use plugin_agent::telemetry::logging;

fn main() -> std::process::ExitCode {
    // The eBPF loader's short-lived children: one reads the kernel's BTF, one loads and pins
    // the programs (see their module docs).
    use plugin_agent::event_source::ebpf;
    match std::env::args_os()
        .nth(1)
        .as_deref()
        .and_then(|arg| arg.to_str())
    {
        Some(ebpf::KERNEL_LAYOUT_CHILD_ARG) => return ebpf::kernel_layout_child_main(),
        Some(ebpf::LOAD_CHILD_ARG) => return ebpf::load_child_main(),
        _ => {}
    }
    plugin_agent::agent::mark_process_start();
    let cli = Cli::parse();
    raise_nofile_limit();
    ignore_file_size_signal();
    plugin_agent::memory::limit_arenas();
    let runtime = match plugin_agent::runtime::build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("plugin-agent: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // The trace exporter's batch task lives on the runtime: set up logging inside it.
    let logging = {
        let _runtime = runtime.enter();
        let format = match cli.log_format {
            LogFormat::Text => logging::Format::Text,
            LogFormat::Json => logging::Format::Json,
        };
        let otlp_endpoint = match &cli.command {
            Command::Run(args) => args.otlp_endpoint_or_configured(),
            _ => None,
        };
        if let Command::Run(args) = &cli.command {
            plugin_agent::telemetry::sampling::set_keep_slower_than(
                args.trace_keep_slower_than
                    .unwrap_or(plugin_agent::telemetry::sampling::DEFAULT_KEEP_SLOWER_THAN),
            );
        }
        // Only `run` exports traces; the operator commands just log.
        let traces_wanted = matches!(cli.command, Command::Run(_));
        logging::init(
            format,
            cli.log_level.as_deref(),
            otlp_endpoint.as_deref().filter(|_| traces_wanted),
            traces_wanted,
        )
    };
    let result = runtime.block_on(cli::execute(cli));
    let code = match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "plugin-agent failed");
            std::process::ExitCode::FAILURE
        }
    };
    logging.shutdown();
    // Tasks still running past the shutdown deadline are dropped, not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_millis(250));
    code
}

/// A file-size limit (`RLIMIT_FSIZE`, from a unit file, a shell or `prlimit`) reached while
/// writing the state file is that write's error (EFBIG), which fails the registration being
/// recorded and says why, not a SIGXFSZ that kills the agent and every registration with it.
fn ignore_file_size_signal() {
    // SAFETY: SIG_IGN installs no handler code; done before any thread is started.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Raises the soft open-file limit to the hard limit. Each registration holds a connection to
/// its plugin while it runs (up to `--max-concurrent` at once), on top of the event source's
/// descriptors; a soft limit of 1024 (systemd's default) would turn a burst of plugins into
/// `EMFILE` failures and backoff. The hard limit is the operator's bound and is left alone.
fn raise_nofile_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed to them. A failure
    // leaves the limit as it was (logging is not set up yet; EMFILE would then say so per plugin).
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
