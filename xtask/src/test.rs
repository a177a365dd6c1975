//! `cargo xtask test`: everything CI checks, from a bare machine: install what is missing, build the
//! eBPF object and the workspace with it embedded, lint, and run every test (privileged ones too).
//!
//! The host stage is followed by the same build once more, which must compile nothing (a no-op
//! build is seconds; a contributor pays it before every command). Then `cargo xtask cross-test` runs the agent's unit tests built for arm64 under qemu-user, and
//! `cargo xtask vm-test` the eBPF tests on Debian's stock kernel in a VM, on both hook families
//! (`--no-vm` skips both; a test filter in the cargo arguments does too).
//!
//! Before the host stage, `cargo xtask manifests` validates the manifests in `deploy/` against
//! the Kubernetes API schemas and installs the kustomize the container tests
//! (`tests/tests/container.rs`: the DaemonSet in runc) render the register overlay with.
//!
//! Privileged tests (eBPF load, fanotify) skip with a printed reason when they cannot run (not root,
//! no eBPF built in); with `CI=true` they fail instead, so CI can never pass without running them.

use crate::{build, build_ebpf, cross_test, deps, kernels, lint, manifests, shell, vm_test};

/// Options for the test run.
#[derive(clap::Args, Default)]
pub struct Options {
    /// Skip `cargo xtask lint`.
    #[arg(long)]
    pub no_lint: bool,
    /// Skip `cargo xtask cross-test` and `vm-test` (arm64 unit tests, and the eBPF tests on a
    /// second kernel: about 14 minutes under emulation).
    #[arg(long)]
    pub no_vm: bool,
    /// Extra arguments for `cargo test` (e.g. a test name filter after `--`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub cargo_args: Vec<String>,
}

/// Runs the whole suite.
pub fn test(options: &Options) -> anyhow::Result<()> {
    let stages_after_host = !options.no_vm && options.cargo_args.is_empty();
    // Every package of every stage, resolved and installed before the first build: a plan apt
    // cannot carry out fails in the first minute, not after the host suite.
    timed("set-up", || {
        deps::deps(&deps::Options {
            all: stages_after_host,
            check: false,
        })
    })?;
    // The manifests against the API schemas, and the kustomize the container tests render the
    // register overlay with.
    let manifests = timed("manifests", manifests::manifests);
    let host = timed("host", || {
        let object = build_ebpf::build(&build_ebpf::Options::default())?;
        if !options.no_lint {
            lint::lint()?;
        }
        let mut command = shell::cargo();
        command
            .args(["test", "--workspace", "--no-fail-fast"])
            .args(&options.cargo_args);
        build::with_ebpf_object(&mut command, &object);
        if let Ok(Some(kustomize)) = manifests::standalone_kustomize() {
            command.env("PLUGIN_AGENT_KUSTOMIZE", kustomize);
        }
        shell::run(&mut command)
    });
    let host = manifests.and(host);
    // The contributor loop's floor: the same build again, nothing changed, compiles nothing (only
    // when the build was the whole workspace's: a package selection builds other units).
    let whole_workspace = options.cargo_args.first().is_none_or(|arg| arg == "--");
    let host = if whole_workspace {
        let no_op = timed("no-op build", || {
            build::check_no_op(&["test", "--workspace", "--no-run"])
        });
        host.and(no_op)
    } else {
        host
    };
    // The other architecture and the second kernel run even when a host test failed: their
    // results say whether a failure is tied to one of them.
    if !stages_after_host {
        return host;
    }
    let arm64 = timed("arm64", cross_test::cross_test);
    let vm = timed("VM", || vm_test::vm_test(&vm_test::Options::default()));
    let ends = timed("kernel matrix ends", || {
        kernels::kernels(&kernels::Options::ci())
    });
    host.and(arm64).and(vm).and(ends)
}

/// Runs one stage and prints its wall time, so a CI log says where the run's time went, and the
/// disk free for the build before it starts, so a log that ends in a linker's bus error or
/// "No space left on device" says why at once.
fn timed(stage: &str, run: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
    let target = shell::workspace_root().join("target");
    if let Some(free) = free_bytes(&target).or_else(|| free_bytes(&shell::workspace_root())) {
        eprintln!(
            "xtask: test: stage {stage}: {:.1} GiB free for the build",
            free as f64 / f64::from(1u32 << 30)
        );
    }
    let started = std::time::Instant::now();
    let result = run();
    let took = started.elapsed().as_secs();
    let verdict = if result.is_ok() { "passed" } else { "FAILED" };
    eprintln!(
        "xtask: test: stage {stage} {verdict} in {}m {:02}s",
        took / 60,
        took % 60
    );
    result
}

/// Bytes an unprivileged writer may still use on the filesystem holding `path`.
fn free_bytes(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `stat` is written by the call before it is read.
    if unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `stat`.
    let stat = unsafe { stat.assume_init() };
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}
