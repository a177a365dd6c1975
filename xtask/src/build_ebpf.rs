//! `cargo xtask build-ebpf`: compiles `agent-ebpf` for `bpfel-unknown-none`.
//!
//! Uses Debian's `/usr/bin/cargo` + `/usr/bin/rustc` (rustc-web 1.96, which ships a prebuilt `core`
//! for the BPF targets) rather than rustup's toolchains, which lack `rust-src` here. rustup's
//! `~/.cargo/bin` goes last in PATH so its `rustc` proxy cannot shadow Debian's, while `bpf-linker`
//! (installed there) is still found. `RUSTC_BOOTSTRAP=aya_ebpf` allows the one nightly feature
//! aya-ebpf uses, for that crate only.

use crate::shell;
use anyhow::{Context, bail};
use std::path::PathBuf;
use std::process::Command;

/// Options for the eBPF build.
#[derive(clap::Args, Default)]
pub struct Options {
    /// Build the debug profile instead of release (verifier-unfriendly; for inspection only).
    #[arg(long)]
    pub debug: bool,
}

/// The eBPF object's path for a profile.
pub fn object_path(release: bool) -> PathBuf {
    let profile = if release { "release" } else { "debug" };
    shell::workspace_root()
        .join("target/ebpf/bpfel-unknown-none")
        .join(profile)
        .join("agent-ebpf")
}

/// Builds the object and returns its path.
pub fn build(options: &Options) -> anyhow::Result<PathBuf> {
    for tool in ["/usr/bin/cargo", "/usr/bin/rustc"] {
        if !std::path::Path::new(tool).exists() {
            bail!("{tool} is missing: run `cargo xtask deps` (installs rustc-web and cargo-web)");
        }
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let rustflags = [
        r#"--cfg=bpf_target_arch="x86_64""#,
        "-Cdebuginfo=2",
        "-Clink-arg=--btf",
    ]
    .join("\x1f");
    let mut command = Command::new("/usr/bin/cargo");
    command
        .current_dir(shell::workspace_root())
        .env_clear()
        .env("PATH", format!("/usr/bin:/bin:{home}/.cargo/bin"))
        .env("HOME", &home)
        .env("RUSTC", "/usr/bin/rustc")
        .env("RUSTC_BOOTSTRAP", "aya_ebpf")
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags)
        .args([
            "build",
            "-p",
            "agent-ebpf",
            "--bin",
            "agent-ebpf",
            "--target",
            "bpfel-unknown-none",
        ])
        .args(["--target-dir", "target/ebpf"]);
    if let Some(cargo_home) = std::env::var_os("CARGO_HOME") {
        command.env("CARGO_HOME", cargo_home);
    }
    if !options.debug {
        command.arg("--release");
    }
    shell::run(&mut command).context("building the eBPF object (is `cargo xtask deps` done?)")?;
    let object = object_path(!options.debug);
    if !object.is_file() {
        bail!(
            "the eBPF build succeeded but {} is missing",
            object.display()
        );
    }
    eprintln!("xtask: eBPF object: {}", object.display());
    Ok(object)
}
