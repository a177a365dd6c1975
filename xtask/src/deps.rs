//! `cargo xtask deps`: installs what a fresh Debian bookworm machine lacks, idempotently.
//!
//! - apt: `rustc-web`, `cargo-web` (rustc/cargo 1.96 at /usr/bin with LLVM 22),
//!   `libstd-rust-web-dev-bpf` (prebuilt core for bpfel-unknown-none: no `-Z build-std` needed),
//!   `llvm-22-dev` (the LLVM bpf-linker links against), `prometheus` (server and `promtool`, for
//!   the observability tests; the tests start their own instance on loopback and do not use the
//!   package's system service).
//! - `bpf-linker` 0.13.0 built by `cargo install` against LLVM 22.
//!
//! Each step checks first and prints either what it installs or that it is already there.

use crate::shell;
use anyhow::bail;
use std::process::Command;

/// Debian packages the eBPF build needs, and `prometheus` (the server and `promtool`) for the
/// observability tests.
pub const APT_PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    "llvm-22-dev",
    "prometheus",
];

/// bpf-linker version known to work with rustc-web 1.96 / LLVM 22.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Installs every missing prerequisite.
pub fn install_missing() -> anyhow::Result<()> {
    install_apt_packages(APT_PACKAGES)?;
    install_bpf_linker()?;
    Ok(())
}

/// Installs the Debian packages that are not installed yet (one `apt-get update` first).
pub fn install_apt_packages(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !apt_installed(p))
        .collect();
    if missing.is_empty() {
        eprintln!("xtask: deps: apt packages present: {}", packages.join(" "));
        return Ok(());
    }
    eprintln!(
        "xtask: deps: installing apt packages: {}",
        missing.join(" ")
    );
    if !is_root() {
        bail!(
            "installing {} needs root (apt-get); run as root or install them",
            missing.join(" ")
        );
    }
    shell::run(Command::new("apt-get").args(["update", "-q"]))?;
    shell::run(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn apt_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn install_bpf_linker() -> anyhow::Result<()> {
    let version = Command::new("bpf-linker").arg("--version").output();
    if let Ok(out) = version
        && String::from_utf8_lossy(&out.stdout).contains(BPF_LINKER_VERSION)
    {
        eprintln!("xtask: deps: bpf-linker {BPF_LINKER_VERSION} present");
        return Ok(());
    }
    eprintln!(
        "xtask: deps: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (about a minute)"
    );
    shell::run(
        shell::cargo()
            .args([
                "install",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
                "--locked",
            ])
            .args(["--no-default-features", "--features", "llvm-22"])
            .env("LLVM_PREFIX", "/usr/lib/llvm-22"),
    )
}

/// True when running as root (apt-get needs it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
