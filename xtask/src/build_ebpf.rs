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

fn profile(release: bool) -> &'static str {
    if release { "release" } else { "debug" }
}

/// Where cargo leaves the linked object (with its DWARF), for a profile.
fn linked_path(release: bool) -> PathBuf {
    shell::workspace_root()
        .join("target/ebpf/bpfel-unknown-none")
        .join(profile(release))
        .join("agent-ebpf")
}

/// The object the agent embeds (stripped of DWARF), for a profile: a file of its own, rewritten
/// only when its bytes change, because the agent's build script reruns when its mtime moves, and
/// that rebuilds the agent and every test binary above it (minutes) for an unchanged object.
pub fn object_path(release: bool) -> PathBuf {
    shell::workspace_root()
        .join("target/ebpf/embed")
        .join(profile(release))
        .join("agent-ebpf.o")
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
    let linked = linked_path(!options.debug);
    if !linked.is_file() {
        bail!(
            "the eBPF build succeeded but {} is missing",
            linked.display()
        );
    }
    let object = object_path(!options.debug);
    let stripped = strip_dwarf(&linked)?;
    if std::fs::read(&object).is_ok_and(|embedded| embedded == stripped) {
        eprintln!("xtask: eBPF object: {} (up to date)", object.display());
        return Ok(object);
    }
    let directory = object.parent().context("the object's path has a parent")?;
    std::fs::create_dir_all(directory)
        .with_context(|| format!("creating {}", directory.display()))?;
    let temporary = object.with_extension("writing");
    std::fs::write(&temporary, &stripped)
        .with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, &object)
        .with_context(|| format!("replacing {}", object.display()))?;
    eprintln!("xtask: eBPF object: {} (changed)", object.display());
    Ok(object)
}

/// The object without its DWARF sections (and their relocations).
///
/// bpf-linker derives the object's BTF from DWARF, so the build needs `-Cdebuginfo=2`; but the
/// loader reads only the programs, maps and BTF, and the agent embeds the object: the DWARF was
/// three quarters of its 840 KB, parsed at every load and resident in every agent's memory. The
/// linked file is left as cargo wrote it (cargo copies it there again on every build).
fn strip_dwarf(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    use object::build::elf::SectionData;
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut builder = object::build::elf::Builder::read(&*data)
        .with_context(|| format!("{} is not an ELF object", path.display()))?;
    let mut removed = 0usize;
    for section in builder.sections.iter_mut() {
        let name = section.name.as_slice();
        if [&b".debug"[..], b".rel.debug", b".rela.debug"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
        {
            section.delete = true;
            removed += 1;
        }
    }
    if removed == 0 {
        return Ok(data);
    }
    builder.delete_orphans();
    // LLVM keeps section names in the symbol string table; the writer wants a table of its own.
    if !builder
        .sections
        .iter()
        .any(|section| matches!(section.data, SectionData::SectionString))
    {
        let names = builder.sections.add();
        names.name = b".shstrtab"[..].into();
        names.sh_type = object::elf::SHT_STRTAB;
        names.sh_addralign = 1;
        names.data = SectionData::SectionString;
    }
    let mut stripped = Vec::new();
    builder
        .write(&mut stripped)
        .with_context(|| format!("writing {} without DWARF", path.display()))?;
    eprintln!(
        "xtask: eBPF object: {removed} DWARF sections removed ({} -> {} bytes)",
        data.len(),
        stripped.len()
    );
    Ok(stripped)
}
