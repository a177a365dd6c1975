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

use crate::apt_plan::{self, Installed, Origin};
use crate::shell;
use anyhow::{Context, bail};
use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// Debian packages the eBPF build needs, `prometheus` (the server and `promtool`) for the
/// observability tests, and for the container tests an OCI runtime (`runc`) and the
/// containers-common seccomp profile (`RuntimeDefault`).
pub const APT_PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    "llvm-22-dev",
    "prometheus",
    "runc",
    "golang-github-containers-common",
];

/// `cargo xtask cross-test`'s: the cross linker and C library, and qemu-user to run the tests.
/// The stages' package sets are kept here, beside the installer, so that `deps --all` needs
/// none of the stages (each stage installs its own set through [`install_apt_packages`]).
pub const CROSS_TEST_APT_PACKAGES: &[&str] = &[
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    "qemu-user",
];

/// `cargo xtask vm-test`'s guest: the emulator, and busybox for the initramfs.
pub const VM_TEST_APT_PACKAGES: &[&str] = &["qemu-system-x86", "busybox-static"];

/// Every guest of `cargo xtask kernels`: x86_64's emulator and busybox (the host's serves it),
/// and the tools that fetch kernels of other releases.
pub const KERNELS_APT_PACKAGES: &[&str] =
    &["qemu-system-x86", "busybox-static", "curl", "xz-utils"];

/// And for its arm64 guests: their emulator (the binaries are cross-built, see `cross_test`).
pub const KERNELS_ARM64_APT_PACKAGES: &[&str] = &["qemu-system-arm"];

/// bpf-linker version known to work with rustc-web 1.96 / LLVM 22.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Options for `cargo xtask deps`.
#[derive(clap::Args, Default)]
pub struct Options {
    /// Also the packages of the arm64 and VM stages of `cargo xtask test`.
    #[arg(long)]
    pub all: bool,
    /// Resolve the install plan with `apt-get install -s` and install nothing.
    #[arg(long)]
    pub check: bool,
}

/// `cargo xtask deps`.
pub fn deps(options: &Options) -> anyhow::Result<()> {
    let mut sets = vec![APT_PACKAGES];
    if options.all {
        sets.extend([
            CROSS_TEST_APT_PACKAGES,
            VM_TEST_APT_PACKAGES,
            KERNELS_APT_PACKAGES,
        ]);
    }
    for set in sets {
        if options.check {
            check_apt_packages(set)?;
        } else {
            install_apt_packages(set)?;
        }
    }
    if !options.check {
        install_bpf_linker()?;
    }
    Ok(())
}

/// Installs every missing prerequisite of the build and the host tests.
pub fn install_missing() -> anyhow::Result<()> {
    install_apt_packages(APT_PACKAGES)?;
    install_bpf_linker()?;
    Ok(())
}

/// Installs the Debian packages that are not installed yet, each from a suite that agrees with
/// what the machine already has (see [`apt_plan`]): the plan is chosen and said, simulated with
/// `apt-get install -s`, refused if it would remove or downgrade anything, and only then carried out.
pub fn install_apt_packages(packages: &[&str]) -> anyhow::Result<()> {
    apply_apt_plan(packages, Mode::Install)
}

/// Resolves the install plan for `packages` with `apt-get install -s` and installs nothing
/// (`cargo xtask deps --check`). It may add the suite the plan needs to apt's sources, since apt
/// cannot resolve against a suite it does not know.
pub fn check_apt_packages(packages: &[&str]) -> anyhow::Result<()> {
    apply_apt_plan(packages, Mode::Check)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Install,
    Check,
}

fn apply_apt_plan(packages: &[&str], mode: Mode) -> anyhow::Result<()> {
    let missing: Vec<String> = packages
        .iter()
        .filter(|p| !apt_installed(p))
        .map(|p| (*p).to_owned())
        .collect();
    if missing.is_empty() {
        eprintln!("xtask: deps: apt packages present: {}", packages.join(" "));
        return Ok(());
    }
    if !is_root() {
        bail!(
            "installing {} needs root (apt-get); run as root or install them",
            missing.join(" ")
        );
    }
    let codename = debian_codename()?;
    let installed = installed_family_members()?;
    let groups = group_by_origin(&missing, &installed, &codename);
    for (origin, members) in &groups {
        match origin {
            Origin::Default => eprintln!(
                "xtask: deps: {} from {codename} (no installed package asks for another suite)",
                members.join(" ")
            ),
            Origin::Suite { suite, because } => {
                eprintln!("xtask: deps: {} from {suite}: {because}", members.join(" "));
                ensure_suite_in_sources(suite, &codename)?;
            }
        }
    }
    refresh_package_lists()?;
    for (origin, members) in &groups {
        simulate(origin, members, &installed, &codename)?;
        if mode == Mode::Install {
            eprintln!(
                "xtask: deps: installing apt packages: {}",
                members.join(" ")
            );
            shell::run(&mut apt_install(origin, members, false))?;
        }
    }
    Ok(())
}

/// Missing packages grouped by the suite they come from, in a stable order.
fn group_by_origin(
    missing: &[String],
    installed: &[Installed],
    codename: &str,
) -> Vec<(Origin, Vec<String>)> {
    let mut groups: Vec<(Origin, Vec<String>)> = Vec::new();
    for package in missing {
        let origin = apt_plan::family_of(package)
            .map(|family| apt_plan::origin_for(family, installed, codename))
            .unwrap_or(Origin::Default);
        match groups.iter_mut().find(|(o, _)| *o == origin) {
            Some((_, members)) => members.push(package.clone()),
            None => groups.push((origin, vec![package.clone()])),
        }
    }
    groups
}

/// `apt-get install -s`, then the plan's verdict: fails with the conflict and its fix when apt
/// cannot resolve it, or when it would remove or downgrade an installed package.
fn simulate(
    origin: &Origin,
    packages: &[String],
    installed: &[Installed],
    codename: &str,
) -> anyhow::Result<()> {
    let mut command = apt_install(origin, packages, true);
    eprintln!("xtask: deps: resolving the plan: {command:?}");
    let out = command.output().context("run apt-get install -s")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let simulation = apt_plan::parse_simulation(&text);
    if !out.status.success() || !simulation.conflicts.is_empty() {
        if simulation.conflicts.is_empty() {
            bail!(
                "apt-get install -s {} failed ({}):\n{text}",
                packages.join(" "),
                out.status
            );
        }
        bail!(
            "{}",
            apt_plan::Diagnosis {
                packages,
                origin,
                conflicts: &simulation.conflicts,
                installed,
                codename,
            }
        );
    }
    let refusals = apt_plan::refusals(&simulation, is_downgrade);
    if !refusals.is_empty() {
        bail!(
            "refusing to install {}: {} (xtask never removes or downgrades what the image \
             installed; `apt-get install -s {}` shows the plan)",
            packages.join(" "),
            refusals.join("; "),
            packages.join(" ")
        );
    }
    eprintln!(
        "xtask: deps: plan resolves: {} to install (with dependencies), none removed or \
         downgraded",
        simulation.installs.len()
    );
    Ok(())
}

fn apt_install(origin: &Origin, packages: &[String], simulate: bool) -> Command {
    let mut command = Command::new("apt-get");
    // Wait for a lock held by another apt (unattended-upgrades, a parallel build) instead of
    // failing at once.
    command.args(["install", "-y", "-q", "--no-install-recommends"]);
    command.args(["-o", "DPkg::Lock::Timeout=300"]);
    if simulate {
        command.arg("-s");
    }
    command
        .args(origin.target_release_args())
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive");
    command
}

/// True once this process ran `apt-get update` after the last change to apt's sources.
static LISTS_FRESH: AtomicBool = AtomicBool::new(false);

/// `apt-get update`, once per xtask run unless the sources changed since.
fn refresh_package_lists() -> anyhow::Result<()> {
    if LISTS_FRESH.load(Ordering::Relaxed) {
        return Ok(());
    }
    shell::run(Command::new("apt-get").args(["update", "-q"]))?;
    LISTS_FRESH.store(true, Ordering::Relaxed);
    Ok(())
}

/// `dpkg --compare-versions NEW lt OLD`.
fn is_downgrade(old: &str, new: &str) -> bool {
    Command::new("dpkg")
        .args(["--compare-versions", new, "lt", old])
        .status()
        .map(|status| status.success())
        .unwrap_or(false)
}

/// The installed members of every package family whose members must agree.
fn installed_family_members() -> anyhow::Result<Vec<Installed>> {
    let patterns: Vec<String> = apt_plan::FAMILIES
        .iter()
        .map(|family| format!("{}*", family.prefix))
        .collect();
    // dpkg-query exits 1 when a pattern matches nothing; its output is still what we want.
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Abbrev}|${Package}|${Version}\n"])
        .args(&patterns)
        .output()
        .context("run dpkg-query")?;
    Ok(apt_plan::parse_installed(&String::from_utf8_lossy(
        &out.stdout,
    )))
}

/// `VERSION_CODENAME` from /etc/os-release (`bookworm`).
fn debian_codename() -> anyhow::Result<String> {
    let text = fs::read_to_string("/etc/os-release").context("read /etc/os-release")?;
    text.lines()
        .find_map(|line| line.strip_prefix("VERSION_CODENAME="))
        .map(|value| value.trim_matches('"').to_owned())
        .filter(|value| !value.is_empty())
        .context("/etc/os-release names no VERSION_CODENAME; is this Debian?")
}

/// Where xtask records a suite it added, so a later run sees it and never adds it twice.
fn sources_file(suite: &str) -> PathBuf {
    PathBuf::from(format!(
        "/etc/apt/sources.list.d/plugin-agent-{suite}.sources"
    ))
}

/// Adds `suite` to apt's sources unless apt already knows it, from the same mirror and keyring as
/// the release itself. Backports are `NotAutomatic`: apt takes from them only what is asked for
/// with `-t`, so adding the suite changes no other package.
fn ensure_suite_in_sources(suite: &str, codename: &str) -> anyhow::Result<()> {
    let policy = Command::new("apt-cache")
        .arg("policy")
        .output()
        .context("run apt-cache policy")?;
    let known = String::from_utf8_lossy(&policy.stdout)
        .lines()
        .any(|line| line.contains(&format!(" {suite}/")));
    if known {
        eprintln!("xtask: deps: apt source for {suite} present");
        return Ok(());
    }
    let (uri, keyring) = debian_mirror(codename);
    let path = sources_file(suite);
    eprintln!(
        "xtask: deps: adding {suite} to apt's sources ({}, {uri})",
        path.display()
    );
    let mut stanza = format!("Types: deb\nURIs: {uri}\nSuites: {suite}\nComponents: main\n");
    if let Some(keyring) = keyring {
        stanza.push_str(&format!("Signed-By: {keyring}\n"));
    }
    fs::write(&path, stanza).with_context(|| format!("write {}", path.display()))?;
    LISTS_FRESH.store(false, Ordering::Relaxed);
    Ok(())
}

/// The mirror URI and keyring of the release's own apt source (deb822 `*.sources` or one-line
/// `sources.list`), or Debian's defaults.
fn debian_mirror(codename: &str) -> (String, Option<String>) {
    let mut files: Vec<PathBuf> = fs::read_dir("/etc/apt/sources.list.d")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "sources"))
        .collect();
    files.sort();
    for path in &files {
        let Ok(text) = fs::read_to_string(path) else {
            continue;
        };
        if let Some(found) = apt_plan::mirror_in_deb822(&text, codename) {
            return found;
        }
    }
    if let Ok(text) = fs::read_to_string("/etc/apt/sources.list")
        && let Some(uri) = apt_plan::mirror_in_one_line(&text, codename)
    {
        return (uri, None);
    }
    (
        "http://deb.debian.org/debian".into(),
        Some("/usr/share/keyrings/debian-archive-keyring.gpg".into()),
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
