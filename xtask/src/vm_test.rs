//! `cargo xtask vm-test`: the eBPF source's kernel tests on another kernel, in a virtual machine,
//! once per hook family.
//!
//! ```text
//! apt: qemu-system-x86, busybox-static, linux-image-<Debian's current>-amd64 (downloaded, not installed)
//!   -> target/vm-test/: vmlinuz + initramfs (busybox, the 9p modules, vm_init.sh)
//!   -> qemu (TCG), the host's / shared over 9p -> RUNS, each with PLUGIN_AGENT_EBPF_HOOKS=<family>:
//!      ebpf_source on fentry and on tracepoints; the agent's eBPF discovery, upstream (kubelet
//!      scenario) and liveness e2e tests on fentry; source selection on auto
//!   -> target/vm-test/<run>.status (the test binary's exit code)
//! ```
//!
//! The build machine's kernel refuses fentry/fexit (EPERM), so on it only the tracepoint programs
//! run. Debian's stock kernel allows fentry/fexit, and is older (6.1): its verifier lacks bounds
//! tracking that newer ones have, and its structs differ. Running the same suite there proves the
//! fentry/fexit programs pass a real verifier and report what the tests expect, and that the
//! tracepoint programs and the BTF offsets are not tied to the build machine's kernel.
//!
//! The guest runs under TCG (software emulation) by default: it needs no nested virtualisation,
//! which many CI machines lack or, like the build machine (a PVM host), provide only for
//! special guests.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::{build, build_ebpf, deps, shell};

/// Debian packages the guest needs: the emulator, and busybox for the initramfs.
pub const APT_PACKAGES: &[&str] = &["qemu-system-x86", "busybox-static"];

/// Kernel modules the guest loads to mount the host's root over virtio 9p.
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

/// One test binary run in the guest.
struct Run {
    /// Names the run and its status file.
    label: &'static str,
    /// The integration test (`cargo test -p <package> --test <test>`).
    package: &'static str,
    test: &'static str,
    /// `PLUGIN_AGENT_EBPF_HOOKS`: `fentry` or `tracepoints` make the family mandatory, so a run
    /// cannot pass on the other one; `auto` lets the agent choose.
    family: &'static str,
    /// Test name filter.
    filter: &'static str,
    /// Tests left out: they time the agent's 1 s `GetInfo` deadline against plugins starting
    /// (ten at once, or just after listening), which emulation slows by an order of magnitude;
    /// they say nothing about the hooks and run on the host.
    skip: &'static [&'static str],
}

/// The tracepoint family's end-to-end tests run on the host's kernel; fentry/fexit can run only
/// here, so the agent's end-to-end tests that hinge on events (real agent, plugins, handlers) run
/// on them too.
const RUNS: &[Run] = &[
    Run {
        label: "ebpf_source-fentry",
        package: "plugin-agent",
        test: "ebpf_source",
        family: "fentry",
        filter: "",
        skip: &[],
    },
    Run {
        label: "ebpf_source-tracepoints",
        package: "plugin-agent",
        test: "ebpf_source",
        family: "tracepoints",
        filter: "",
        skip: &[],
    },
    Run {
        label: "discovery-fentry",
        package: "plugin-agent-tests",
        test: "discovery",
        family: "fentry",
        filter: "ebpf::",
        skip: &["registers_a_plugin_that_binds_before_it_serves_as_soon_as_it_serves"],
    },
    Run {
        label: "upstream-fentry",
        package: "plugin-agent-tests",
        test: "upstream",
        family: "fentry",
        filter: "ebpf::",
        skip: &[
            "registers_10_sockets_that_exist_before_the_agent_starts",
            "tracks_10_plugins_with_the_same_name_on_different_sockets",
        ],
    },
    Run {
        label: "liveness-fentry",
        package: "plugin-agent-tests",
        test: "liveness",
        family: "fentry",
        filter: "ebpf",
        skip: &[],
    },
    Run {
        label: "source_selection-auto",
        package: "plugin-agent-tests",
        test: "source_selection",
        family: "auto",
        filter: "",
        skip: &[],
    },
];

/// Options for the VM test run.
#[derive(clap::Args)]
pub struct Options {
    /// Debian kernel package to boot (default: the one `linux-image-amd64` depends on).
    #[arg(long)]
    pub kernel_package: Option<String>,
    /// QEMU accelerator: `tcg` works everywhere; `kvm` where nested virtualisation does.
    #[arg(long, default_value = DEFAULT_ACCEL)]
    pub accel: String,
    /// Give up on the guest after this many seconds.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_SECS)]
    pub timeout_secs: u64,
}

const DEFAULT_ACCEL: &str = "tcg,thread=multi";
const DEFAULT_TIMEOUT_SECS: u64 = 1500;

impl Default for Options {
    fn default() -> Self {
        Options {
            kernel_package: None,
            accel: DEFAULT_ACCEL.into(),
            timeout_secs: DEFAULT_TIMEOUT_SECS,
        }
    }
}

/// Boots the kernel and runs [`RUNS`]; fails unless every run passed.
pub fn vm_test(options: &Options) -> anyhow::Result<()> {
    deps::install_missing()?;
    deps::install_apt_packages(APT_PACKAGES)?;
    let dir = shell::workspace_root().join("target/vm-test");
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let package = match &options.kernel_package {
        Some(package) => package.clone(),
        None => debian_kernel_package()?,
    };
    let kernel = unpack_kernel(&dir, &package)?;
    let initramfs = make_initramfs(&dir, &kernel)?;
    let binaries = build_suites()?;

    for run in RUNS {
        let _ = fs::remove_file(dir.join(format!("{}.status", run.label)));
    }
    let script = dir.join("guest.sh");
    fs::write(&script, guest_script(&binaries, &dir))
        .with_context(|| format!("write {}", script.display()))?;

    eprintln!(
        "xtask: vm-test: booting {package} ({}) under {}; {} test runs",
        kernel.vmlinuz.display(),
        options.accel,
        RUNS.len()
    );
    let mut qemu = Command::new("timeout");
    qemu.arg(options.timeout_secs.to_string())
        .arg("qemu-system-x86_64")
        .args([
            "-accel",
            &options.accel,
            "-cpu",
            "max",
            "-smp",
            "2",
            "-m",
            "2G",
        ])
        .args(["-nographic", "-no-reboot", "-kernel"])
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initramfs)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 quiet panic=-1 vmtest={}",
            script.display()
        ))
        .args([
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,multidevs=remap",
        ]);
    // The console is the suite's output; qemu's own exit status says nothing about the tests.
    let _ = shell::run(&mut qemu);

    let mut failed = Vec::new();
    for run in RUNS {
        let label = run.label;
        let status = fs::read_to_string(dir.join(format!("{label}.status")));
        match status.as_deref().map(str::trim) {
            Ok("0") => eprintln!("xtask: vm-test: {label}: passed on {package}"),
            Ok(code) => failed.push(format!("{label}: the tests exited with {code}")),
            Err(_) => failed.push(format!("{label}: the guest never finished it")),
        }
    }
    if !failed.is_empty() {
        bail!("vm-test on {package}: {}", failed.join("; "));
    }
    Ok(())
}

/// The kernel package Debian's `linux-image-amd64` currently points at.
fn debian_kernel_package() -> anyhow::Result<String> {
    let out = Command::new("apt-cache")
        .args(["depends", "linux-image-amd64"])
        .output()
        .context("run apt-cache")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.trim().strip_prefix("Depends: "))
        .find(|name| name.starts_with("linux-image-"))
        .map(str::to_owned)
        .context("apt-cache knows no linux-image-amd64 (run apt-get update)")
}

/// An unpacked kernel package.
struct Kernel {
    vmlinuz: PathBuf,
    /// `lib/modules/<release>/kernel` inside the unpacked package.
    modules: PathBuf,
}

/// Downloads (once) and unpacks the kernel package under `dir`, without installing it.
fn unpack_kernel(dir: &Path, package: &str) -> anyhow::Result<Kernel> {
    let root = dir.join(package);
    if !root.join("boot").is_dir() {
        let download = || {
            shell::run(
                Command::new("apt-get")
                    // The download lands in the target directory, which apt's sandbox user
                    // may not be able to write.
                    .args(["download", "-q", "-o", "APT::Sandbox::User=root", package])
                    .current_dir(dir),
            )
        };
        if download().is_err() {
            // Package lists older than the mirror: refresh them once.
            shell::run(Command::new("apt-get").args(["update", "-q"]))?;
            download()?;
        }
        let deb = fs::read_dir(dir)?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .find(|path| {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                name.starts_with(&format!("{package}_")) && name.ends_with(".deb")
            })
            .with_context(|| format!("apt-get download left no {package}_*.deb"))?;
        shell::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        fs::remove_file(&deb).with_context(|| format!("remove {}", deb.display()))?;
    }
    let release = package.trim_start_matches("linux-image-");
    let kernel = Kernel {
        vmlinuz: root.join(format!("boot/vmlinuz-{release}")),
        modules: root.join(format!("lib/modules/{release}/kernel")),
    };
    if !kernel.vmlinuz.is_file() {
        bail!("{package} has no {}", kernel.vmlinuz.display());
    }
    Ok(kernel)
}

/// Writes the initramfs: busybox, the 9p modules and `vm_init.sh` as `/init`.
fn make_initramfs(dir: &Path, kernel: &Kernel) -> anyhow::Result<PathBuf> {
    let tree = dir.join("initramfs");
    let _ = fs::remove_dir_all(&tree);
    for sub in ["bin", "modules", "mnt", "proc", "sys", "dev"] {
        fs::create_dir_all(tree.join(sub))?;
    }
    fs::copy("/bin/busybox", tree.join("bin/busybox")).context("copy /bin/busybox")?;
    for module in MODULES {
        let found = find_file(&kernel.modules, &format!("{module}.ko"))
            .with_context(|| format!("the kernel package has no {module}.ko"))?;
        fs::copy(&found, tree.join("modules").join(format!("{module}.ko")))?;
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

fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    for entry in fs::read_dir(dir).ok()?.filter_map(Result::ok) {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_file(&path, name) {
                return Some(found);
            }
        } else if path.file_name().is_some_and(|n| n == name) {
            return Some(path);
        }
    }
    None
}

/// Builds the eBPF object, the agent and test-plugin binaries the tests start, and every test
/// binary in [`RUNS`]; returns their paths in the order of [`RUNS`].
fn build_suites() -> anyhow::Result<Vec<PathBuf>> {
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    build::agent_and_test_bins(Some(&object), false)?;
    RUNS.iter()
        .map(|run| test_executable(&object, run.package, run.test))
        .collect()
}

/// Builds integration test `test` of `package` and returns its executable's path.
fn test_executable(object: &Path, package: &str, test: &str) -> anyhow::Result<PathBuf> {
    let mut command = shell::cargo();
    command.args(["test", "-p", package, "--test", test, "--no-run"]);
    command.arg("--message-format=json");
    build::with_ebpf_object(&mut command, object);
    eprintln!("xtask: $ cargo test -p {package} --test {test} --no-run");
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

/// The script the guest runs: every run in order, each exit code written to its status file.
fn guest_script(binaries: &[PathBuf], dir: &Path) -> String {
    let mut script = format!(
        "cd {root}\nexport CI=true TMPDIR=/dev/shm RUST_BACKTRACE=1\n",
        root = shell::workspace_root().display()
    );
    for (run, binary) in RUNS.iter().zip(binaries) {
        let skip: String = run.skip.iter().map(|t| format!(" --skip {t}")).collect();
        script.push_str(&format!(
            "echo 'vm-test: {label}'\n\
             PLUGIN_AGENT_EBPF_HOOKS={family} {binary} --test-threads 1 {filter}{skip}\n\
             echo $? > {status}\n",
            label = run.label,
            family = run.family,
            binary = binary.display(),
            filter = run.filter,
            status = dir.join(format!("{}.status", run.label)).display(),
        ));
    }
    script
}
