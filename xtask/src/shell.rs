//! Running commands with their command line echoed, so a CI log reads as a script.

use anyhow::{Context, bail};
use std::path::PathBuf;
use std::process::Command;

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(PathBuf::from)
        .unwrap_or(manifest_dir)
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set, else the workspace's `target`.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|dir| {
            if dir.is_absolute() {
                dir
            } else {
                workspace_root().join(dir)
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// Prints the command, runs it, and fails with its exit status if it fails.
pub fn run(command: &mut Command) -> anyhow::Result<()> {
    eprintln!("xtask: $ {}", display(command));
    let status = command
        .status()
        .with_context(|| format!("cannot start {}", display(command)))?;
    if !status.success() {
        bail!("{} failed: {status}", display(command));
    }
    Ok(())
}

/// The cargo that invoked xtask (rustup's stable proxy), for userspace builds.
pub fn cargo() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command.current_dir(workspace_root());
    command
}

/// A command as a shell would read it, environment first.
pub fn display(command: &Command) -> String {
    let envs: Vec<String> = command
        .get_envs()
        .filter_map(|(k, v)| v.map(|v| format!("{}={}", k.to_string_lossy(), v.to_string_lossy())))
        .filter(|kv| !kv.starts_with("PATH=") && !kv.starts_with("CARGO_ENCODED_RUSTFLAGS="))
        .collect();
    let args: Vec<String> = command
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mut parts = envs;
    parts.push(command.get_program().to_string_lossy().into_owned());
    parts.extend(args);
    parts.join(" ")
}
