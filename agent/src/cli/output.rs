//! What every operator subcommand writes through: the output format flag (`-o`) and stdout
//! itself (the `out!` macros call [`write_stdout`]). A leaf of its own so the subcommand files
//! and `render` share it without importing the command line's `mod.rs`.

use clap::ValueEnum;

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

/// Writes to stdout; a closed pipe exits with success (nothing is left to say to anyone), any
/// other write error with failure, saying why on stderr.
pub(crate) fn write_stdout(text: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    match std::io::stdout().lock().write_fmt(text) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("plugin-agent: cannot write to stdout: {e}");
            std::process::exit(1);
        }
    }
}
