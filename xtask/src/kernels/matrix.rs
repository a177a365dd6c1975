//! What `cargo xtask kernels` runs: the kernels (one row per kernel and architecture), the test
//! suites run in each guest, and the hook families.

use crate::vm::Arch;

/// One kernel of the matrix.
#[derive(Clone, Copy)]
pub struct Row {
    /// The kernel series as people name it.
    pub series: &'static str,
    pub arch: Arch,
    /// The Debian suite whose current kernel of that series is booted.
    pub suite: &'static str,
    /// `linux-image-<abi>-<flavour>`'s `<abi>` starts with this.
    pub abi_prefix: &'static str,
    /// Which nodes run this series.
    pub nodes: &'static str,
}

/// The matrix. 5.15 and 6.8 (Ubuntu 22.04 and 24.04) are not in Debian's archive; 5.10 and 6.1
/// bound them on each side for the features the agent uses (docs/kernels.md).
pub const MATRIX: &[Row] = &[
    Row {
        series: "5.10",
        arch: Arch::X86_64,
        suite: "bullseye",
        abi_prefix: "5.10.0-",
        nodes: "Debian 11, Amazon Linux 2",
    },
    Row {
        series: "6.1",
        arch: Arch::X86_64,
        suite: "bookworm",
        abi_prefix: "6.1.0-",
        nodes: "Debian 12, Amazon Linux 2023",
    },
    Row {
        series: "6.12",
        arch: Arch::X86_64,
        suite: "trixie",
        abi_prefix: "6.12.",
        nodes: "Debian 13",
    },
    Row {
        series: "5.10",
        arch: Arch::Arm64,
        suite: "bullseye",
        abi_prefix: "5.10.0-",
        nodes: "Debian 11, Amazon Linux 2 (Graviton)",
    },
    Row {
        series: "6.12",
        arch: Arch::Arm64,
        suite: "trixie",
        abi_prefix: "6.12.",
        nodes: "Debian 13 (Graviton, Ampere)",
    },
];

impl Row {
    pub fn label(&self) -> String {
        format!("{}-{}", self.series, self.arch.debian())
    }
}

/// A test suite run in each guest.
pub struct Suite {
    pub label: &'static str,
    pub package: &'static str,
    pub test: &'static str,
    /// Test name filter.
    pub filter: &'static str,
    /// Tests left out under emulation (see `vm_test::RUNS`): they time the agent's 1 s `GetInfo`
    /// deadline against ten plugins starting at once.
    pub skip: &'static [&'static str],
    /// Run once per loadable hook family (the kernel suite), or once with the agent choosing.
    /// In CI, a per-family suite runs on the family the agent would pick (the probe loads both).
    pub per_family: bool,
    /// Part of the CI subset.
    pub ci: bool,
    /// Tests run at once in the guest: the kernel suite's tests are independent (each loads its
    /// own programs, which is most of its time under emulation); the agent's end-to-end tests
    /// time plugins and run one at a time.
    pub threads: u32,
}

/// The kernel suite on every family (the liveness hints among its programs' reports), then the
/// agent end to end (real agent, plugins, handler) with the family the agent picks itself. The
/// agent's liveness end to end runs in `vm-test` (6.1) and on the host: what it adds over the
/// kernel suite's release and listen reports is not kernel-specific.
pub const SUITES: &[Suite] = &[
    Suite {
        label: "ebpf_source",
        package: "plugin-agent",
        test: "ebpf_source",
        filter: "",
        skip: &[],
        per_family: true,
        ci: true,
        threads: 2,
    },
    Suite {
        label: "discovery",
        package: "plugin-agent-tests",
        test: "discovery",
        filter: "ebpf::",
        skip: &["registers_a_plugin_that_binds_before_it_serves_as_soon_as_it_serves"],
        per_family: false,
        ci: false,
        threads: 1,
    },
];

/// The hook families, as `PLUGIN_AGENT_EBPF_HOOKS` and the probe name them.
pub const FAMILIES: &[&str] = &["fentry", "tracepoints"];

/// Whether `suite` is in the run (CI's share, or everything). Every suite runs on both
/// architectures.
pub fn in_run(suite: &Suite, ci: bool) -> bool {
    !ci || suite.ci
}
