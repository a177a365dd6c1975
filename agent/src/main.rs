//! The `plugin-agent` binary: parses the command line, sets up logging (and, for `run`, trace
//! export), runs the command.

use clap::Parser;
use plugin_agent::cli::{self, Cli, Command, LogFormat};
use plugin_agent::telemetry::logging;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("plugin-agent: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // The trace exporter's batch task lives on the runtime: set up logging inside it.
    let traces = {
        let _runtime = runtime.enter();
        let format = match cli.log_format {
            LogFormat::Text => logging::Format::Text,
            LogFormat::Json => logging::Format::Json,
        };
        let otlp_endpoint = match &cli.command {
            Command::Run(args) => args.otlp_endpoint_or_configured(),
            _ => None,
        };
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
    if let Some(traces) = traces {
        traces.shutdown();
    }
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "plugin-agent failed");
            std::process::ExitCode::FAILURE
        }
    }
}
