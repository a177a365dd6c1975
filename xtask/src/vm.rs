//! A Linux guest in QEMU that runs test binaries from the host's tree: what `vm-test` (Debian's
//! stock kernel) and `kernels` (the matrix of kernels nodes run) share.
//!
//! ```text
//! kernel .deb (downloaded, unpacked, never installed) -> vmlinuz + the 9p modules
//! busybox (the host's, or the arm64 package's) + vm_init.sh as /init -> initramfs.cpio
//! qemu-system-<arch> (TCG) -> /init mounts the host's / over 9p, chroots into it,
//!   runs a script that writes each run's exit code to a status file in the host's tree
//! ```
//!
//! The guest sees the workspace, its target directory and the toolchain at their host paths, so a
//! test binary finds the agent and plugin binaries cargo built beside it. An arm64 guest cannot run
//! the host's x86_64 shell: its script runs under the arm64 busybox, and its binaries are linked
//! statically (no arm64 C library at the host's paths).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::{build, shell};

/// A machine architecture the guest can be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    X86_64,
    Arm64,
}

impl Arch {
    /// Debian's name for it (package names, archive paths).
    pub fn debian(self) -> &'static str {
        match self {
            Arch::X86_64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }

    /// The name `uname -m` gives.
    pub fn uname(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Arm64 => "aarch64",
        }
    }

    /// The rustc target to build for, when it is not the host's.
    pub fn cross_target(self) -> Option<&'static str> {
        match self {
            Arch::X86_64 => None,
            Arch::Arm64 => Some(crate::cross_test::TARGET),
        }
    }

    /// The emulator, its machine and CPU, and the kernel's console.
    fn qemu(self) -> (&'static str, &'static [&'static str], &'static str) {
        match self {
            Arch::X86_64 => ("qemu-system-x86_64", &["-cpu", "max"], "ttyS0"),
            // `pauth-impdef`: the architected pointer-authentication algorithm is the slowest
            // part of emulating `max`; the implementation-defined one is what makes TCG usable.
            Arch::Arm64 => (
                "qemu-system-aarch64",
                &["-machine", "virt", "-cpu", "max,pauth-impdef=on"],
                "ttyAMA0",
            ),
        }
    }
}

/// Kernel modules the guest loads to mount the host's root over virtio 9p. Which exist depends on
/// the release (`netfs` arrived in 5.13, the split virtio PCI modules in 5.14/5.16, `fscache` folded
/// into `netfs` later) and on the flavour (some are built in): each is loaded if the package has it.
const MODULES: &[&str] = &[
    "virtio",
    "virtio_ring",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "netfs",
    "fscache",
    "9pnet",
    "9pnet_virtio",
    "9p",
];

/// The modules without which there is no 9p mount: each must be a module or built in.
const REQUIRED_MODULES: &[&str] = &["9pnet_virtio", "9p"];

/// An unpacked kernel package.
pub struct Kernel {
    /// The package it came from (`linux-image-6.1.0-50-amd64`).
    pub package: String,
    pub vmlinuz: PathBuf,
    /// `lib/modules/<release>` inside the unpacked package.
    pub modules: PathBuf,
}

/// Unpacks `deb` (a kernel image package) into `dir/<package>` unless that was done already.
pub fn unpack_kernel(
    dir: &Path,
    package: &str,
    deb: impl FnOnce() -> anyhow::Result<PathBuf>,
) -> anyhow::Result<Kernel> {
    let root = dir.join(package);
    if !root.join("boot").is_dir() {
        let deb = deb()?;
        let partial = dir.join(format!("{package}.partial"));
        let _ = fs::remove_dir_all(&partial);
        shell::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&partial))?;
        fs::rename(&partial, &root).with_context(|| format!("rename to {}", root.display()))?;
        fs::remove_file(&deb).with_context(|| format!("remove {}", deb.display()))?;
    }
    let boot = root.join("boot");
    let vmlinuz = fs::read_dir(&boot)
        .with_context(|| format!("read {}", boot.display()))?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| {
            path.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .with_context(|| format!("{package} has no boot/vmlinuz-*"))?;
    let release = vmlinuz
        .file_name()
        .map(|n| {
            n.to_string_lossy()
                .trim_start_matches("vmlinuz-")
                .to_owned()
        })
        .unwrap_or_default();
    // Packages built for a merged /usr (trixie on) keep the modules under usr/.
    let modules = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|dir| root.join(dir).join(&release))
        .find(|dir| dir.is_dir())
        .with_context(|| format!("{package} has no lib/modules/{release}"))?;
    Ok(Kernel {
        package: package.to_owned(),
        modules,
        vmlinuz,
    })
}

/// Writes `dir/initramfs.cpio`: `busybox`, the 9p modules (decompressed: busybox's insmod reads
/// plain ELF) and `vm_init.sh` as `/init`.
pub fn make_initramfs(dir: &Path, kernel: &Kernel, busybox: &Path) -> anyhow::Result<PathBuf> {
    let tree = dir.join("initramfs");
    let _ = fs::remove_dir_all(&tree);
    for sub in ["bin", "modules", "mnt", "proc", "sys", "dev"] {
        fs::create_dir_all(tree.join(sub))?;
    }
    fs::copy(busybox, tree.join("bin/busybox"))
        .with_context(|| format!("copy {}", busybox.display()))?;
    let builtin = fs::read_to_string(kernel.modules.join("modules.builtin")).unwrap_or_default();
    for module in MODULES {
        let target = tree.join("modules").join(format!("{module}.ko"));
        if let Some(found) = find_module(&kernel.modules.join("kernel"), module) {
            copy_module(&found, &target)?;
        } else if REQUIRED_MODULES.contains(module) && !is_builtin(&builtin, module) {
            bail!(
                "{} has neither {module}.ko nor a built-in {module}",
                kernel.package
            );
        }
    }
    let init = tree.join("init");
    fs::write(&init, include_str!("vm_init.sh"))?;
    fs::set_permissions(&init, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let image = dir.join("initramfs.cpio");
    shell::run(Command::new("sh").current_dir(&tree).arg("-c").arg(format!(
        "find . | busybox cpio -o -H newc > {}",
        image.display()
    )))?;
    Ok(image)
}

fn is_builtin(modules_builtin: &str, module: &str) -> bool {
    modules_builtin.lines().any(|line| {
        let file = line.rsplit('/').next().unwrap_or(line);
        file.trim_end_matches(".ko").replace('-', "_") == module
    })
}

/// `<module>.ko`, `.ko.xz` or `.ko.zst` anywhere under `dir`.
fn find_module(dir: &Path, module: &str) -> Option<PathBuf> {
    for entry in fs::read_dir(dir).ok()?.filter_map(Result::ok) {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_module(&path, module) {
                return Some(found);
            }
            continue;
        }
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if [".ko", ".ko.xz", ".ko.zst"]
            .iter()
            .any(|ext| name.strip_suffix(ext) == Some(module))
        {
            return Some(path);
        }
    }
    None
}

fn copy_module(found: &Path, target: &Path) -> anyhow::Result<()> {
    let name = found.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        Some("xz")
    } else if name.ends_with(".zst") {
        Some("zstd")
    } else {
        None
    };
    match tool {
        None => fs::copy(found, target)
            .map(|_| ())
            .with_context(|| format!("copy {name}")),
        Some(tool) => {
            let out = Command::new(tool)
                .args(["-dc"])
                .arg(found)
                .output()
                .with_context(|| format!("run {tool} -dc {name}"))?;
            if !out.status.success() {
                bail!(
                    "{tool} -dc {name} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            fs::write(target, out.stdout).with_context(|| format!("write {}", target.display()))
        }
    }
}

/// One boot of a kernel with a script to run inside.
pub struct Boot<'a> {
    pub arch: Arch,
    pub kernel: &'a Kernel,
    pub initramfs: &'a Path,
    /// The script the guest runs, at its host path.
    pub script: &'a Path,
    /// For a guest that cannot run the host's `/bin/sh`: a shell of its architecture, at its host
    /// path (`busybox`, run as `busybox sh`).
    pub shell: Option<&'a Path>,
    pub accel: &'a str,
    pub timeout_secs: u64,
}

impl Boot<'_> {
    /// Boots the guest and waits for it to power off (or for the timeout). The console is the
    /// suites' output; qemu's own exit status says nothing about them.
    pub fn run(&self) {
        let (qemu_binary, machine, console) = self.arch.qemu();
        let mut append = format!(
            "console={console} quiet panic=-1 vmtest={}",
            self.script.display()
        );
        if let Some(shell) = self.shell {
            append.push_str(&format!(" vmshell={}", shell.display()));
        }
        let mut qemu = Command::new("timeout");
        qemu.arg(self.timeout_secs.to_string())
            .arg(qemu_binary)
            .args(["-accel", self.accel])
            .args(machine)
            .args(["-smp", "2", "-m", "2G"])
            .args(["-nographic", "-no-reboot", "-kernel"])
            .arg(&self.kernel.vmlinuz)
            .arg("-initrd")
            .arg(self.initramfs)
            .arg("-append")
            .arg(append)
            .args([
                "-virtfs",
                "local,path=/,mount_tag=hostroot,security_model=none,multidevs=remap",
            ]);
        let _ = shell::run(&mut qemu);
    }
}

/// Builds integration test `test` of `package` (for `arch`) and returns its executable's path.
pub fn test_executable(
    object: &Path,
    arch: Arch,
    package: &str,
    test: &str,
) -> anyhow::Result<PathBuf> {
    let mut command = shell::cargo();
    command.args(["test", "-p", package, "--test", test, "--no-run"]);
    command.arg("--message-format=json");
    cross(&mut command, arch);
    build::with_ebpf_object(&mut command, object);
    eprintln!("xtask: $ {}", shell::display(&command));
    let out = command.output().context("run cargo test --no-run")?;
    if !out.status.success() {
        bail!(
            "building test {test} of {package} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["target"]["name"] == test)
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("cargo reported no executable for test {test}"))
}

/// Makes a cargo command build for `arch` (nothing for the host's).
pub fn cross(command: &mut Command, arch: Arch) {
    if let Some(target) = arch.cross_target() {
        command.args(["--target", target]);
        crate::cross_test::cross_env(command);
    }
}

/// The exit code a run's status file records, if the guest got that far.
pub fn status(dir: &Path, label: &str) -> Option<String> {
    fs::read_to_string(status_file(dir, label))
        .ok()
        .map(|s| s.trim().to_owned())
}

pub fn status_file(dir: &Path, label: &str) -> PathBuf {
    dir.join(format!("{label}.status"))
}
