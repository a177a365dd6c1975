//! `cargo xtask build`: the eBPF object first, then the workspace with it embedded
//! (`PLUGIN_AGENT_EBPF_OBJ` tells agent/build.rs where the object is).

use crate::{build_ebpf, shell};
use std::path::Path;

/// Options for the full build.
#[derive(clap::Args, Default)]
pub struct Options {
    /// Build the userspace crates in release mode.
    #[arg(long)]
    pub release: bool,
}

/// Builds the eBPF object and the whole workspace.
pub fn build(options: &Options) -> anyhow::Result<()> {
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    let mut command = shell::cargo();
    command.args(["build", "--workspace", "--all-targets"]);
    if options.release {
        command.arg("--release");
    }
    with_ebpf_object(&mut command, &object);
    shell::run(&mut command)
}

/// Builds the agent and the test binaries the end-to-end runs start (plugins, handlers, loadgen),
/// with the eBPF object embedded when there is one.
pub fn agent_and_test_bins(object: Option<&Path>, release: bool) -> anyhow::Result<()> {
    let mut command = shell::cargo();
    command.args([
        "build",
        "-p",
        "plugin-agent",
        "-p",
        "plugin-agent-tests",
        "--bins",
    ]);
    if release {
        command.arg("--release");
    }
    if let Some(object) = object {
        with_ebpf_object(&mut command, object);
    }
    shell::run(&mut command)
}

/// Points a cargo invocation at the eBPF object so the agent embeds it.
pub fn with_ebpf_object(command: &mut std::process::Command, object: &Path) {
    command.env("PLUGIN_AGENT_EBPF_OBJ", object);
}
