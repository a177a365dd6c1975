//! `cargo xtask build`: the eBPF object first, then the workspace with it embedded
//! (`PLUGIN_AGENT_EBPF_OBJ` tells agent/build.rs where the object is).
//!
//! A build with nothing changed must be a no-op: every command a contributor types starts with one.
//! Each build here says whether it compiled anything, and `cargo xtask test` fails if a second
//! build of an unchanged tree does ([`check_no_op`]).

use crate::{build_ebpf, shell};
use anyhow::{Context, bail};
use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};

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
    run_reporting(&mut command).map(|_| ())
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
    run_reporting(&mut command).map(|_| ())
}

/// Points a cargo invocation at the eBPF object so the agent embeds it.
pub fn with_ebpf_object(command: &mut Command, object: &Path) {
    command.env("PLUGIN_AGENT_EBPF_OBJ", object);
}

/// Runs a cargo build (`build`, `test --no-run`, ...) and returns the units it compiled (none:
/// everything was fresh), saying which. Diagnostics still reach the terminal as cargo renders them.
pub fn run_reporting(command: &mut Command) -> anyhow::Result<Vec<String>> {
    command
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped());
    eprintln!("xtask: $ {}", shell::display(command));
    let started = std::time::Instant::now();
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot start {}", shell::display(command)))?;
    let stdout = child.stdout.take().context("cargo's stdout is piped")?;
    let mut compiled = Vec::new();
    let mut fresh = 0usize;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's messages")?;
        let Ok(message) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        if message["fresh"] == true {
            fresh += 1;
        } else {
            compiled.push(unit_name(&message));
        }
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() {
        bail!("{} failed: {status}", shell::display(command));
    }
    let took = started.elapsed().as_secs_f64();
    if compiled.is_empty() {
        eprintln!("xtask: build: up to date ({fresh} units fresh, {took:.1} s)");
    } else {
        eprintln!(
            "xtask: build: compiled {} units in {took:.1} s ({fresh} fresh): {}",
            compiled.len(),
            shortened(&compiled)
        );
    }
    Ok(compiled)
}

/// A compiled unit as a person reads it: `package (target kind name)`.
fn unit_name(message: &serde_json::Value) -> String {
    let target = &message["target"];
    let package = message["package_id"].as_str().map_or("?", package_name);
    let kind = target["kind"][0].as_str().unwrap_or("?");
    let name = target["name"].as_str().unwrap_or("?");
    format!("{package} ({kind} {name})")
}

/// The package's name in a package id: `path+file:///w/agent#plugin-agent@0.1.0` (or
/// `...#0.1.0` when the directory is the name, or an older cargo's `name 0.1.0 (source)`).
fn package_name(id: &str) -> &str {
    match id.split_once('#') {
        Some((source, fragment)) => match fragment.split_once('@') {
            Some((name, _version)) => name,
            None => source.rsplit('/').next().unwrap_or(source),
        },
        None => id.split(' ').next().unwrap_or(id),
    }
}

/// Builds again what was just built, with nothing changed, and fails if cargo compiles anything:
/// the eBPF object must keep its bytes and its mtime, and nothing in the build may depend on
/// time. `cargo_args` are those of the build being checked (`test --workspace`, ...).
pub fn check_no_op(cargo_args: &[&str]) -> anyhow::Result<()> {
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    let mut command = shell::cargo();
    command.args(cargo_args);
    with_ebpf_object(&mut command, &object);
    let compiled = run_reporting(&mut command)?;
    if !compiled.is_empty() {
        bail!(
            "a second build with nothing changed compiled {} units ({}); \
             run it with CARGO_LOG=cargo::core::compiler::fingerprint=info to see why",
            compiled.len(),
            shortened(&compiled)
        );
    }
    Ok(())
}

/// The first few units' names, and how many more.
fn shortened(units: &[String]) -> String {
    const SHOWN: usize = 12;
    let mut text = units
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if units.len() > SHOWN {
        text.push_str(&format!(" and {} more", units.len() - SHOWN));
    }
    text
}
