//! `cargo xtask lint`: formatting and clippy with warnings denied, as CI enforces them, and the
//! architecture checks (`cargo xtask architecture`). Every step runs, so one run lists every
//! failure.

use crate::{architecture, build, build_ebpf, shell};

/// Runs `cargo fmt --check`, `cargo clippy --workspace --all-targets -- -D warnings` (with the eBPF
/// object embedded when it has been built, so the eBPF-only code is linted too), then the
/// architecture checks; fails naming every step that failed.
pub fn lint() -> anyhow::Result<()> {
    let mut failed = Vec::new();
    if let Err(e) = shell::run(shell::cargo().args(["fmt", "--all", "--check"])) {
        eprintln!("xtask: lint: {e:#}");
        failed.push("cargo fmt --check");
    }
    let mut clippy = shell::cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    let object = build_ebpf::object_path(true);
    if object.is_file() {
        build::with_ebpf_object(&mut clippy, &object);
    }
    if let Err(e) = shell::run(&mut clippy) {
        eprintln!("xtask: lint: {e:#}");
        failed.push("cargo clippy");
    }
    if let Err(e) = architecture::check() {
        eprintln!("xtask: lint: {e:#}");
        failed.push("cargo xtask architecture");
    }
    match failed.is_empty() {
        true => Ok(()),
        false => anyhow::bail!("lint failed: {}", failed.join(", ")),
    }
}
