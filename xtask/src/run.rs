//! `cargo xtask run`: installs what is missing, builds (release), and runs the agent in the
//! foreground, by default on kubelet's registration directory.

use crate::{build, build_ebpf, deps, shell};
use std::process::Command;

/// Options for running the agent.
#[derive(clap::Args)]
pub struct Options {
    /// Arguments for `plugin-agent run` (default: `--plugin-dir /var/lib/kubelet/plugins_registry`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

/// Builds and runs the agent; returns when it exits.
pub fn run(options: Options) -> anyhow::Result<()> {
    deps::install_missing()?;
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    let mut cargo = shell::cargo();
    cargo.args([
        "build",
        "--release",
        "-p",
        "plugin-agent",
        "--bin",
        "plugin-agent",
    ]);
    build::with_ebpf_object(&mut cargo, &object);
    build::run_reporting(&mut cargo)?;

    let binary = shell::workspace_root().join("target/release/plugin-agent");
    let mut agent = Command::new(binary);
    agent.arg("run");
    if options.args.is_empty() {
        agent.args(["--plugin-dir", "/var/lib/kubelet/plugins_registry"]);
    } else {
        agent.args(&options.args);
    }
    shell::run(&mut agent)
}
