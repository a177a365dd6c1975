//! `cargo xtask lint`: formatting and clippy with warnings denied, as CI enforces them, and the
//! agent's module graph free of cycles (`cargo xtask modules`).

use crate::{build, build_ebpf, modules, shell};

/// Runs `cargo fmt --check`, `cargo clippy --workspace --all-targets -- -D warnings` (with the eBPF
/// object embedded when it has been built, so the eBPF-only code is linted too), then the
/// module-cycle check.
pub fn lint() -> anyhow::Result<()> {
    shell::run(shell::cargo().args(["fmt", "--all", "--check"]))?;
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
    shell::run(&mut clippy)?;
    modules::check()
}
