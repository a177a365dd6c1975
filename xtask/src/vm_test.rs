//! `cargo xtask vm-test`: the eBPF source's tests on fentry/fexit, which the build machine's kernel
//! refuses, on Debian's current stock kernel in a virtual machine (`vm` boots it).
//!
//! ```text
//! apt: qemu-system-x86, busybox-static, linux-image-<Debian's current>-amd64 (downloaded, not installed)
//!   -> target/vm-test/: vmlinuz + initramfs (busybox, the 9p modules, vm_init.sh)
//!   -> qemu (TCG), the host's / shared over 9p -> RUNS, each with PLUGIN_AGENT_EBPF_HOOKS=<family>:
//!      ebpf_source on fentry; the agent's eBPF discovery, upstream (kubelet scenario) and
//!      liveness e2e tests on fentry; source selection on auto
//!   -> target/vm-test/<run>.status (the test binary's exit code)
//! ```
//!
//! The build machine's kernel refuses fentry/fexit (EPERM), so on it only the tracepoint programs
//! run. Debian's stock kernel allows fentry/fexit, and is older (6.1): its verifier lacks bounds
//! tracking that newer ones have, and its structs differ. Running the kernel suite and the agent's
//! end-to-end tests there proves the fentry/fexit programs pass a real verifier and do what the
//! agent needs. `cargo xtask kernels` covers the other kernels (5.10 to 6.12, arm64 too) and both
//! families on each; CI runs its two x86_64 ends after this stage.
//!
//! The guest runs under TCG (software emulation) by default: it needs no nested virtualisation,
//! which many CI machines lack or, like the build machine (a PVM host), provide only for
//! special guests.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::{build, build_ebpf, deps, shell, vm};

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
    /// Tests at once: the kernel suite's are independent (each loads its own programs, most of
    /// its time under emulation); the end-to-end ones time plugins and run alone.
    threads: u32,
}

/// The tracepoint family's suites run on the host's kernel and on 5.10 (`kernels --ci`, where the
/// agent picks them), and on 6.1 in `cargo xtask kernels`; fentry/fexit can run only in guests,
/// so the agent's end-to-end tests that hinge on events (real agent, plugins, handlers) run on
/// them here.
const RUNS: &[Run] = &[
    Run {
        label: "ebpf_source-fentry",
        package: "plugin-agent",
        test: "ebpf_source",
        family: "fentry",
        filter: "",
        skip: &[],
        threads: 2,
    },
    Run {
        label: "discovery-fentry",
        package: "plugin-agent-tests",
        test: "discovery",
        family: "fentry",
        filter: "ebpf::",
        skip: &["registers_a_plugin_that_binds_before_it_serves_as_soon_as_it_serves"],
        threads: 1,
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
        threads: 1,
    },
    Run {
        label: "liveness-fentry",
        package: "plugin-agent-tests",
        test: "liveness",
        family: "fentry",
        filter: "ebpf",
        skip: &[],
        threads: 1,
    },
    Run {
        label: "source_selection-auto",
        package: "plugin-agent-tests",
        test: "source_selection",
        family: "auto",
        filter: "",
        skip: &[],
        threads: 1,
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
    /// Only these runs, by label (`ebpf_source-fentry`, `discovery-fentry`, ...); default all.
    #[arg(long = "run")]
    pub runs: Vec<String>,
    /// Only the tests whose names contain this, in the runs chosen (instead of each run's filter).
    #[arg(long)]
    pub filter: Option<String>,
    /// Run each chosen run this many times in the one boot (a flaky or timing-dependent test
    /// proven several times); a run fails if any repetition fails.
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
}

const DEFAULT_ACCEL: &str = "tcg,thread=multi";
const DEFAULT_TIMEOUT_SECS: u64 = 1500;

impl Default for Options {
    fn default() -> Self {
        Options {
            kernel_package: None,
            accel: DEFAULT_ACCEL.into(),
            timeout_secs: DEFAULT_TIMEOUT_SECS,
            runs: Vec::new(),
            filter: None,
            repeat: 1,
        }
    }
}

/// Boots the kernel and runs [`RUNS`]; fails unless every run passed.
pub fn vm_test(options: &Options) -> anyhow::Result<()> {
    let runs: Vec<&Run> = RUNS
        .iter()
        .filter(|run| options.runs.is_empty() || options.runs.iter().any(|l| l == run.label))
        .collect();
    if let Some(unknown) = options
        .runs
        .iter()
        .find(|label| !RUNS.iter().any(|run| run.label == label.as_str()))
    {
        let labels: Vec<&str> = RUNS.iter().map(|run| run.label).collect();
        bail!("--run {unknown}: no such run ({})", labels.join(", "));
    }
    deps::install_missing()?;
    deps::install_apt_packages(deps::VM_TEST_APT_PACKAGES)?;
    let dir = shell::workspace_root().join("target/vm-test");
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let package = match &options.kernel_package {
        Some(package) => package.clone(),
        None => debian_kernel_package()?,
    };
    let kernel = vm::unpack_kernel(&dir, &package, || apt_download(&dir, &package))?;
    let initramfs = vm::make_initramfs(&dir, &kernel, Path::new("/bin/busybox"))?;
    let binaries = build_suites(&runs)?;

    for run in &runs {
        let _ = fs::remove_file(vm::status_file(&dir, run.label));
    }
    let script = dir.join("guest.sh");
    fs::write(&script, guest_script(&runs, &binaries, &dir, options))
        .with_context(|| format!("write {}", script.display()))?;

    eprintln!(
        "xtask: vm-test: booting {package} ({}) under {}; {} test runs",
        kernel.vmlinuz.display(),
        options.accel,
        runs.len()
    );
    vm::Boot {
        arch: vm::Arch::X86_64,
        kernel: &kernel,
        initramfs: &initramfs,
        script: &script,
        shell: None,
        accel: &options.accel,
        timeout_secs: options.timeout_secs,
    }
    .run();

    let mut failed = Vec::new();
    for run in &runs {
        let label = run.label;
        match vm::status(&dir, label).as_deref() {
            Some("0") => eprintln!("xtask: vm-test: {label}: passed on {package}"),
            Some(code) => failed.push(format!("{label}: the tests exited with {code}")),
            None => failed.push(format!("{label}: the guest never finished it")),
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

/// `apt-get download`s `package` (of the machine's own release) into `dir`.
fn apt_download(dir: &Path, package: &str) -> anyhow::Result<PathBuf> {
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
    fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with(&format!("{package}_")) && name.ends_with(".deb")
        })
        .with_context(|| format!("apt-get download left no {package}_*.deb"))
}

/// Builds the eBPF object, the agent and test-plugin binaries the tests start, and the test
/// binary of every run in `runs`; returns their paths in the order of `runs`.
fn build_suites(runs: &[&Run]) -> anyhow::Result<Vec<PathBuf>> {
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    build::agent_and_test_bins(Some(&object), false)?;
    runs.iter()
        .map(|run| vm::test_executable(&object, vm::Arch::X86_64, run.package, run.test))
        .collect()
}

/// The script the guest runs: every run in order (each `options.repeat` times), each exit code
/// (the first failure's) written to its status file.
fn guest_script(runs: &[&Run], binaries: &[PathBuf], dir: &Path, options: &Options) -> String {
    let mut script = format!(
        "cd {root}\nexport CI=true TMPDIR=/dev/shm RUST_BACKTRACE=1\n",
        root = shell::workspace_root().display()
    );
    let repeats: Vec<String> = (1..=options.repeat.max(1)).map(|i| i.to_string()).collect();
    for (run, binary) in runs.iter().zip(binaries) {
        let skip: String = run.skip.iter().map(|t| format!(" --skip {t}")).collect();
        script.push_str(&format!(
            "status=0\n\
             for repeat in {repeats}; do\n\
             echo \"vm-test: {label} ($repeat)\"\n\
             PLUGIN_AGENT_EBPF_HOOKS={family} {binary} --test-threads {threads} {filter}{skip}\n\
             rc=$?; [ $status -eq 0 ] && status=$rc\n\
             done\n\
             echo $status > {status}\n",
            repeats = repeats.join(" "),
            label = run.label,
            threads = run.threads,
            family = run.family,
            binary = binary.display(),
            filter = options.filter.as_deref().unwrap_or(run.filter),
            status = vm::status_file(dir, run.label).display(),
        ));
    }
    script
}
