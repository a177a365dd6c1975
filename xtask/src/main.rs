//! Build automation for plugin-agent: `cargo xtask <command>`.
//!
//! The agent is ordinary Rust built by rustup's stable cargo; its eBPF object is not: it is built by
//! Debian's rustc-web (which ships a prebuilt `core` for `bpfel-unknown-none`) and linked by
//! bpf-linker, then embedded into the agent. These commands make that two-toolchain build one step
//! and install what a fresh machine lacks. See ../shared/ebpf-toolchain.md for why.

mod apt_plan;
mod architecture;
mod bench;
mod bench_sources;
mod build;
mod build_ebpf;
mod cross_test;
mod deps;
mod hostile;
mod kernels;
mod lint;
mod manifests;
mod processes;
mod run;
mod shell;
mod soak;
mod test;
mod vm;
mod vm_test;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "xtask",
    about = "Build, install-prerequisites, run and test plugin-agent"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what is missing (apt packages, bpf-linker), idempotently, saying what it does;
    /// each apt install is resolved with `apt-get install -s` first, from the suite that agrees
    /// with what the machine has.
    Deps(deps::Options),
    /// Build the eBPF object with Debian's rustc-web and bpf-linker.
    BuildEbpf(build_ebpf::Options),
    /// Build the eBPF object, then the workspace with the object embedded.
    Build(build::Options),
    /// Install what is missing, build, and run the agent (default: on /var/lib/kubelet/plugins_registry).
    Run(run::Options),
    /// Install what is missing, build everything, check formatting and lints, run every test.
    Test(test::Options),
    /// `cargo fmt --check`, `cargo clippy -D warnings` over the workspace, and the architecture
    /// checks (`cargo xtask architecture`); lists every failure, stopping at none.
    Lint,
    /// The agent's rooms against xtask/src/architecture/rooms.rs, import cycles at every level of
    /// the agent's and xtask's modules, size limits, and docs/architecture.md's generated section:
    /// prints the rooms and the longest functions, then every finding.
    #[command(alias = "modules")]
    Architecture(architecture::Options),
    /// Every Kubernetes manifest in deploy/ (raw, and each kustomization rendered by kustomize)
    /// against the API schemas of Kubernetes 1.30 to the newest kubernetes-validate ships,
    /// strict; installs kubernetes-validate and kustomize when missing.
    Manifests,
    /// Registration latency per event source and kubelet-like polling, side by side.
    Bench(bench::Options),
    /// Event sources alone: detection latency and throughput, eBPF vs fanotify vs inotify.
    BenchSources(bench_sources::Options),
    /// The agent built for arm64 with the kernel object, its unit tests run under qemu-user.
    CrossTest,
    /// eBPF tests in a VM on Debian's stock kernel: the source's on fentry/fexit (which this
    /// machine's kernel refuses) and on tracepoints, the agent's end-to-end ones on fentry/fexit.
    VmTest(vm_test::Options),
    /// The eBPF suites on the kernels nodes run (5.10, 6.1, 6.12; x86_64 and arm64), each booted
    /// in QEMU from Debian's packages; prints the table and writes it to docs/kernels.md.
    Kernels(kernels::Options),
    /// Churn plus injected faults for a bounded time; ends with zero plugins lost and flat memory.
    Soak(soak::Options),
    /// Issue 22's hostile-node cases one at a time on each source (release agent): the canary's
    /// registration time, live plugins kept, SIGTERM time and peak RSS against the targets.
    Hostile(hostile::Options),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Deps(options) => deps::deps(&options),
        Command::BuildEbpf(options) => build_ebpf::build(&options).map(|_| ()),
        Command::Build(options) => build::build(&options),
        Command::Run(options) => run::run(options),
        Command::Test(options) => test::test(&options),
        Command::Lint => lint::lint(),
        Command::Architecture(options) => architecture::architecture(&options),
        Command::Manifests => manifests::manifests(),
        Command::Bench(options) => bench::bench(&options),
        Command::BenchSources(options) => bench_sources::bench_sources(&options),
        Command::Soak(options) => soak::soak(&options),
        Command::Hostile(options) => hostile::hostile(&options),
        Command::VmTest(options) => vm_test::vm_test(&options),
        Command::Kernels(options) => kernels::kernels(&options),
        Command::CrossTest => cross_test::cross_test(),
    }
}
