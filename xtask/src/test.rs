//! `cargo xtask test`: everything CI checks, from a bare machine: install what is missing, build the
//! eBPF object and the workspace with it embedded, lint, and run every test (privileged ones too).
//!
//! Privileged tests (eBPF load, fanotify) skip with a printed reason when they cannot run (not root,
//! no eBPF built in); with `CI=true` they fail instead, so CI can never pass without running them.

use crate::{build, build_ebpf, deps, lint, shell};

/// Options for the test run.
#[derive(clap::Args, Default)]
pub struct Options {
    /// Skip `cargo xtask lint`.
    #[arg(long)]
    pub no_lint: bool,
    /// Extra arguments for `cargo test` (e.g. a test name filter after `--`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub cargo_args: Vec<String>,
}

/// Runs the whole suite.
pub fn test(options: &Options) -> anyhow::Result<()> {
    deps::install_missing()?;
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    if !options.no_lint {
        lint::lint()?;
    }
    let mut command = shell::cargo();
    command
        .args(["test", "--workspace", "--no-fail-fast"])
        .args(&options.cargo_args);
    build::with_ebpf_object(&mut command, &object);
    shell::run(&mut command)
}
