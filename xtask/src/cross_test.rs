//! `cargo xtask cross-test`: the agent built for arm64 (aarch64), the kernel object embedded, and its
//! unit tests run under qemu-user.
//!
//! arm64 nodes are common, and their syscall table differs: no `unlink`, `rmdir`, `mknod`, `mkdir`
//! or `rename`, only the `*at` forms, so the tracepoint list and the syscall numbers the programs
//! match must follow the architecture (the loader's tests check both ways). The eBPF object itself
//! is the same bytes on every architecture. Loading the programs into arm64 kernels is
//! `cargo xtask kernels`' (Debian's 5.10 and 6.12 under qemu-system-aarch64), which runs the
//! binaries this builds.

use std::process::Command;

use anyhow::Context;

use crate::{build, build_ebpf, deps, shell};

pub const TARGET: &str = "aarch64-unknown-linux-gnu";

/// Builds for arm64 and runs the agent's unit tests under qemu-user.
pub fn cross_test() -> anyhow::Result<()> {
    deps::install_missing()?;
    deps::install_apt_packages(deps::CROSS_TEST_APT_PACKAGES)?;
    add_rust_target()?;
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    let mut command = shell::cargo();
    command.args(["test", "-p", "plugin-agent", "--lib", "--target", TARGET]);
    cross_env(&mut command);
    build::with_ebpf_object(&mut command, &object);
    shell::run(&mut command)
}

/// The linker, runner and flags of an arm64 build. Binaries are linked statically: an arm64 guest
/// (`cargo xtask kernels`) runs them from the host's tree, where no arm64 C library is at the
/// paths a dynamic binary asks for; qemu-user runs them alike. One set of flags, so the unit tests
/// and the guest's binaries share one build.
pub fn cross_env(command: &mut Command) {
    command
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
            "aarch64-linux-gnu-gcc",
        )
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
            "qemu-aarch64 -L /usr/aarch64-linux-gnu",
        )
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
            "-C target-feature=+crt-static",
        );
}

/// `rustup target add`, unless the standard library for arm64 is already there.
pub fn add_rust_target() -> anyhow::Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("run rustup")?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|line| line.trim() == TARGET)
    {
        eprintln!("xtask: deps: rust target {TARGET} present");
        return Ok(());
    }
    eprintln!("xtask: deps: adding rust target {TARGET}");
    shell::run(Command::new("rustup").args(["target", "add", TARGET]))
}
