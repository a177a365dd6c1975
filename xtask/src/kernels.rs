//! `cargo xtask kernels`: the eBPF source on the kernels nodes run (5.10 to 6.12, x86_64 and
//! arm64), each booted in QEMU from Debian's own kernel packages.
//!
//! ```text
//! MATRIX (series, arch, Debian suite)
//!   -> the suite's Packages index (cached a day) -> newest linux-image-<series>-<arch> -> .deb
//!      (cached unpacked in target/kernels/) ; arm64 also busybox-static:arm64
//!   -> agent, plugins and test binaries built for the arch (arm64: static, cross-linked)
//!   -> one boot per kernel: `plugin-agent probe -o json` (what the kernel gives, each hook
//!      family loaded and verified), then SUITES on each family the probe found loadable
//!   -> target/kernels/<row>/{probe.json, <suite>.log, <suite>.status}
//!   -> one table (stdout and docs/kernels.md)
//! ```
//!
//! The packages come from the same Debian mirror apt uses, fetched by URL: no suite is added to
//! the machine's apt sources to get a kernel of another release.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};

use crate::vm::{self, Arch};
use crate::{build, build_ebpf, cross_test, deps, shell};

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
    fn label(&self) -> String {
        format!("{}-{}", self.series, self.arch.debian())
    }
}

/// A test suite run in each guest.
struct Suite {
    label: &'static str,
    package: &'static str,
    test: &'static str,
    /// Test name filter.
    filter: &'static str,
    /// Tests left out under emulation (see `vm_test::RUNS`): they time the agent's 1 s `GetInfo`
    /// deadline against ten plugins starting at once.
    skip: &'static [&'static str],
    /// Run once per loadable hook family (the kernel suite), or once with the agent choosing.
    /// In CI, a per-family suite runs on the family the agent would pick (the probe loads both).
    per_family: bool,
    /// Part of the CI subset.
    ci: bool,
    /// Tests run at once in the guest: the kernel suite's tests are independent (each loads its
    /// own programs, which is most of its time under emulation); the agent's end-to-end tests
    /// time plugins and run one at a time.
    threads: u32,
}

/// The kernel suite on every family (the liveness hints among its programs' reports), then the
/// agent end to end (real agent, plugins, handler) with the family the agent picks itself. The
/// agent's liveness end to end runs in `vm-test` (6.1) and on the host: what it adds over the
/// kernel suite's release and listen reports is not kernel-specific.
const SUITES: &[Suite] = &[
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
const FAMILIES: &[&str] = &["fentry", "tracepoints"];

/// Options for `cargo xtask kernels`.
#[derive(clap::Args, Clone)]
pub struct Options {
    /// Rows to run, by arch (`x86_64`, `arm64`), series (`5.10`) or both (`5.10-arm64`); default
    /// every row.
    #[arg(long = "only")]
    pub only: Vec<String>,
    /// CI's share: the oldest and newest x86_64 kernels, the probe (both families verified and
    /// attached) on both, and the kernel suite on the family the agent picks on the oldest (the
    /// newest's pick, fentry, runs its kernel suite on 6.1 in `cargo xtask vm-test`, every CI run).
    #[arg(long)]
    pub ci: bool,
    /// The probe only, no suite (CI's newest end).
    #[arg(skip)]
    pub probe_only: bool,
    /// QEMU accelerator.
    #[arg(long, default_value = "tcg,thread=multi")]
    pub accel: String,
    /// Give up on one guest after this many seconds.
    #[arg(long, default_value_t = 2400)]
    pub timeout_secs: u64,
    /// Leave docs/kernels.md as it is (the table is printed all the same).
    #[arg(long)]
    pub no_docs: bool,
    /// Run only these suites (`ebpf_source`, `discovery`), keeping the row's other suites' last
    /// results (a fix to one suite re-run without the others).
    #[arg(long = "suite")]
    pub suites: Vec<String>,
    /// Boot nothing: the table of every row's last recorded run (`target/kernels/<row>/`), for
    /// rows run at different times with `--only`.
    #[arg(long, conflicts_with_all = ["only", "ci"])]
    pub table: bool,
}

impl Options {
    /// What `cargo xtask test` runs: [`Options::ci`]'s rows and suites, the docs left alone.
    pub fn ci() -> Self {
        Options {
            only: Vec::new(),
            ci: true,
            accel: "tcg,thread=multi".into(),
            timeout_secs: 1200,
            no_docs: true,
            suites: Vec::new(),
            table: false,
            probe_only: false,
        }
    }
}

/// Runs the chosen rows, prints the table, and fails unless every row passed.
pub fn kernels(options: &Options) -> anyhow::Result<()> {
    let dir = shell::workspace_root().join("target/kernels");
    if options.table {
        let results: Vec<RowResult> = MATRIX
            .iter()
            .map(|row| RowResult::recorded(row, &dir))
            .collect();
        return report(&results, options);
    }
    let rows = chosen_rows(options)?;
    if let Some(unknown) = options
        .suites
        .iter()
        .find(|name| !SUITES.iter().any(|suite| suite.label == name.as_str()))
    {
        bail!("--suite {unknown}: no such suite (ebpf_source, discovery)");
    }
    deps::install_missing()?;
    deps::install_apt_packages(deps::KERNELS_APT_PACKAGES)?;
    if rows.iter().any(|row| row.arch == Arch::Arm64) {
        deps::install_apt_packages(deps::KERNELS_ARM64_APT_PACKAGES)?;
        deps::install_apt_packages(deps::CROSS_TEST_APT_PACKAGES)?;
    }
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let mirror = debian_mirror();
    let object = build_ebpf::build(&build_ebpf::Options::default())?;

    let mut results = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let started = std::time::Instant::now();
        let row_options = Options {
            probe_only: options.ci && i > 0 && i + 1 == rows.len(),
            ..options.clone()
        };
        let result = run_row(&row_options, &dir, &mirror, &object, row);
        let took = started.elapsed();
        match result {
            Ok(result) => results.push(result),
            Err(err) => results.push(RowResult::broken(row, format!("{err:#}"), took)),
        }
    }
    report(&results, options)
}

/// Prints the table (and writes it to docs/kernels.md); fails unless every row passed.
fn report(results: &[RowResult], options: &Options) -> anyhow::Result<()> {
    let table = table(results);
    println!("{table}");
    if !options.no_docs && !options.ci {
        write_docs(&table, options)?;
    }
    let failed: Vec<String> = results
        .iter()
        .filter(|r| !r.passed())
        .map(|r| format!("{}: {}", r.row.label(), r.failure()))
        .collect();
    if !failed.is_empty() {
        bail!("kernels: {}", failed.join("; "));
    }
    Ok(())
}

fn chosen_rows(options: &Options) -> anyhow::Result<Vec<Row>> {
    if options.ci {
        let x86: Vec<&Row> = MATRIX.iter().filter(|r| r.arch == Arch::X86_64).collect();
        let (Some(oldest), Some(newest)) = (x86.first(), x86.last()) else {
            bail!("the matrix has no x86_64 kernel");
        };
        return Ok(vec![**oldest, **newest]);
    }
    let rows: Vec<Row> = MATRIX
        .iter()
        .filter(|row| {
            options.only.is_empty()
                || options.only.iter().any(|want| {
                    want == row.series
                        || want == row.arch.uname()
                        || want == row.arch.debian()
                        || *want == row.label()
                })
        })
        .copied()
        .collect();
    if rows.is_empty() {
        bail!("--only {:?} names no row of the matrix", options.only);
    }
    Ok(rows)
}

/// Boots one kernel and reads back what its guest recorded.
fn run_row(
    options: &Options,
    dir: &Path,
    mirror: &str,
    object: &Path,
    row: &Row,
) -> anyhow::Result<RowResult> {
    let started = std::time::Instant::now();
    let arch = row.arch;
    let cache = dir.join("cache");
    fs::create_dir_all(&cache)?;
    let index = packages_index(&cache, mirror, row.suite, arch)?;
    let package = newest_kernel(&index, row)?;
    let kernel = vm::unpack_kernel(&cache, &package.name, || download(&cache, mirror, &package))?;
    let busybox = match arch {
        Arch::X86_64 => PathBuf::from("/bin/busybox"),
        Arch::Arm64 => arm64_busybox(&cache, mirror)?,
    };
    let work = dir.join(row.label());
    if options.suites.is_empty() {
        let _ = fs::remove_dir_all(&work);
    } else {
        // Only the chosen suites' results go; the others' stay for the table.
        for entry in fs::read_dir(&work).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if options
                .suites
                .iter()
                .any(|suite| name.starts_with(&format!("{suite}-")))
            {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
    fs::create_dir_all(&work)?;
    let initramfs = vm::make_initramfs(&work, &kernel, &busybox)?;
    let binaries = build_for(object, arch, options)?;
    let script = work.join("guest.sh");
    fs::write(&script, guest_script(&work, &binaries, options.ci))?;
    eprintln!(
        "xtask: kernels: booting {} {} ({}) under {}",
        package.name,
        package.version,
        arch.uname(),
        options.accel
    );
    vm::Boot {
        arch,
        kernel: &kernel,
        initramfs: &initramfs,
        script: &script,
        shell: (arch != Arch::X86_64).then_some(busybox.as_path()),
        accel: &options.accel,
        timeout_secs: options.timeout_secs,
    }
    .run();
    let package = format!("{} {}", package.name, package.version);
    let took = started.elapsed();
    let record = serde_json::json!({ "package": package, "took_secs": took.as_secs(), "ci": options.ci, "suites": options.suites, "probe_only": options.probe_only });
    fs::write(work.join("row.json"), record.to_string())?;
    Ok(RowResult::read(
        row,
        &package,
        &work,
        (options.ci, &options.suites, options.probe_only),
        took,
    ))
}

/// Whether `suite` is in the run (CI's share, or everything). Every suite runs on both
/// architectures.
fn in_run(suite: &Suite, ci: bool) -> bool {
    !ci || suite.ci
}

/// The agent, plugin and handler binaries the tests start, and each suite's test binary.
struct Binaries {
    agent: PathBuf,
    suites: Vec<(&'static Suite, PathBuf)>,
}

fn build_for(object: &Path, arch: Arch, options: &Options) -> anyhow::Result<Binaries> {
    if arch != Arch::X86_64 {
        cross_test::add_rust_target()?;
    }
    let mut command = shell::cargo();
    command.args([
        "build",
        "-p",
        "plugin-agent",
        "-p",
        "plugin-agent-tests",
        "--bins",
    ]);
    vm::cross(&mut command, arch);
    build::with_ebpf_object(&mut command, object);
    build::run_reporting(&mut command)?;
    let profile_dir = match arch.cross_target() {
        Some(target) => shell::target_dir().join(target).join("debug"),
        None => shell::target_dir().join("debug"),
    };
    let suites = SUITES
        .iter()
        .filter(|suite| in_run(suite, options.ci) && !options.probe_only)
        .filter(|suite| {
            options.suites.is_empty() || options.suites.iter().any(|s| s == suite.label)
        })
        .map(|suite| {
            vm::test_executable(object, arch, suite.package, suite.test).map(|exe| (suite, exe))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(Binaries {
        agent: profile_dir.join("plugin-agent"),
        suites,
    })
}

/// The guest's script: the probe, then each suite, each run's output in a log and its exit code
/// in a status file. A family the probe could not load is not run (its row says why).
fn guest_script(work: &Path, binaries: &Binaries, ci: bool) -> String {
    let probe = work.join("probe.json");
    let mut script = format!(
        "cd {root}\n\
         export CI=true TMPDIR=/dev/shm RUST_BACKTRACE=1\n\
         echo \"kernels: $(uname -r) $(uname -m)\"\n\
         {agent} probe -o json > {probe} 2> {probe_err}\n\
         if grep -q '\"family\":\"fentry\",\"loaded\":true' {probe}; then picked=fentry; \
         else picked=tracepoints; fi\n",
        root = shell::workspace_root().display(),
        agent = binaries.agent.display(),
        probe = probe.display(),
        probe_err = work.join("probe.stderr").display(),
    );
    for (suite, binary) in &binaries.suites {
        let skip: String = suite.skip.iter().map(|t| format!(" --skip {t}")).collect();
        let families: &[&str] = if suite.per_family {
            FAMILIES
        } else {
            &["auto"]
        };
        for family in families {
            let label = format!("{}-{family}", suite.label);
            let run = format!(
                "{{ PLUGIN_AGENT_EBPF_HOOKS={family} {binary} --test-threads {threads} {filter}{skip}; \
                 echo $? > {status}; }} 2>&1 | tee {log}\n",
                threads = suite.threads,
                binary = binary.display(),
                filter = suite.filter,
                status = vm::status_file(work, &label).display(),
                log = work.join(format!("{label}.log")).display(),
            );
            script.push_str(&format!("echo 'kernels: {label}'\n"));
            if *family == "auto" {
                script.push_str(&run);
            } else if ci {
                script.push_str(&format!("if [ $picked = {family} ]; then\n{run}fi\n"));
            } else {
                // The probe prints each family compactly as `"family":"<name>","loaded":<bool>`.
                script.push_str(&format!(
                    "if grep -q '\"family\":\"{family}\",\"loaded\":true' {probe}; then\n{run}fi\n",
                    probe = probe.display(),
                ));
            }
        }
    }
    script
}

/// What one row's guest recorded.
struct RowResult {
    row: Row,
    package: String,
    /// The probe's report, when the guest got that far.
    probe: Option<serde_json::Value>,
    /// (run label, exit code or None when it never ran, tests passed, tests failed)
    runs: Vec<SuiteRun>,
    /// Set when the row could not even boot.
    broken: Option<String>,
    /// CI's share was run (see [`Options::ci`]).
    ci: bool,
    took: Duration,
}

struct SuiteRun {
    label: String,
    family: String,
    status: Option<String>,
    passed: usize,
    failed: usize,
}

impl RowResult {
    fn broken(row: &Row, why: String, took: Duration) -> Self {
        RowResult {
            row: *row,
            package: String::new(),
            probe: None,
            runs: Vec::new(),
            broken: Some(why),
            ci: false,
            took,
        }
    }

    /// A row's last recorded run, if it has one.
    fn recorded(row: &Row, dir: &Path) -> Self {
        let work = dir.join(row.label());
        let record = fs::read_to_string(work.join("row.json"))
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok());
        match record {
            Some(record) => RowResult::read(
                row,
                record["package"].as_str().unwrap_or_default(),
                &work,
                (
                    record["ci"] == true,
                    &serde_json::from_value::<Vec<String>>(record["suites"].clone())
                        .unwrap_or_default(),
                    record["probe_only"] == true,
                ),
                Duration::from_secs(record["took_secs"].as_u64().unwrap_or_default()),
            ),
            None => RowResult::broken(row, "not run yet".into(), Duration::ZERO),
        }
    }

    /// The row's results in `work`. `run`: whether CI's share was run, the suites chosen (none:
    /// all; a suite not chosen counts only when an earlier run left its results), and whether the
    /// probe alone ran.
    fn read(
        row: &Row,
        package: &str,
        work: &Path,
        run: (bool, &[String], bool),
        took: Duration,
    ) -> Self {
        let (ci, chosen, probe_only) = run;
        let probe = fs::read_to_string(work.join("probe.json"))
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok());
        let mut runs = Vec::new();
        for suite in SUITES
            .iter()
            .filter(|suite| in_run(suite, ci) && !probe_only)
        {
            let families: &[&str] = if suite.per_family {
                FAMILIES
            } else {
                &["auto"]
            };
            let chosen = chosen.is_empty() || chosen.iter().any(|name| name == suite.label);
            let left = families
                .iter()
                .any(|family| vm::status(work, &format!("{}-{family}", suite.label)).is_some());
            if !chosen && !left {
                continue;
            }
            for family in families {
                let label = format!("{}-{family}", suite.label);
                let log = fs::read_to_string(work.join(format!("{label}.log"))).unwrap_or_default();
                let (passed, failed) = test_counts(&log);
                runs.push(SuiteRun {
                    status: vm::status(work, &label),
                    label,
                    family: (*family).to_owned(),
                    passed,
                    failed,
                });
            }
        }
        RowResult {
            row: *row,
            package: package.to_owned(),
            probe,
            runs,
            broken: None,
            ci,
            took,
        }
    }

    /// The probe's report of one family.
    fn family(&self, family: &str) -> Option<&serde_json::Value> {
        self.probe.as_ref()?["families"]
            .as_array()?
            .iter()
            .find(|f| f["family"] == family)
    }

    fn loaded(&self, family: &str) -> bool {
        self.family(family).is_some_and(|f| f["loaded"] == true)
    }

    /// A row passes when the probe ran, at least one family loaded, and every run that should
    /// have run (each loadable family's, and the agent's own) ran and passed.
    fn passed(&self) -> bool {
        self.broken.is_none()
            && self.probe.is_some()
            && FAMILIES.iter().any(|f| self.loaded(f))
            && self
                .runs
                .iter()
                .all(|run| !self.expected(run) || run.status.as_deref() == Some("0"))
    }

    /// Whether `run` should have run: the agent's own choice always; a family's run where the
    /// family loads (in CI, only the family the agent picks).
    fn expected(&self, run: &SuiteRun) -> bool {
        run.family == "auto"
            || (self.loaded(&run.family)
                && (!self.ci || self.chosen() == Some(run.family.as_str())))
    }

    fn failure(&self) -> String {
        if let Some(why) = &self.broken {
            return why.clone();
        }
        if self.probe.is_none() {
            return "the probe reported nothing (see probe.stderr)".into();
        }
        if !FAMILIES.iter().any(|f| self.loaded(f)) {
            return "no hook family loaded".into();
        }
        self.runs
            .iter()
            .filter(|run| self.expected(run) && run.status.as_deref() != Some("0"))
            .map(|run| match &run.status {
                Some(code) => format!("{} exited {code}", run.label),
                None => format!("{} never finished", run.label),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `test result: ok. 28 passed; 0 failed; ...` lines, summed.
fn test_counts(log: &str) -> (usize, usize) {
    let mut passed = 0;
    let mut failed = 0;
    for line in log.lines() {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            continue;
        };
        for part in rest.split(['.', ';']) {
            let mut words = part.split_whitespace();
            match (words.next().map(str::parse::<usize>), words.next()) {
                (Some(Ok(n)), Some("passed")) => passed += n,
                (Some(Ok(n)), Some("failed")) => failed += n,
                _ => {}
            }
        }
    }
    (passed, failed)
}

/// The matrix as one Markdown table: one line per kernel and hook family.
fn table(results: &[RowResult]) -> String {
    let mut out = String::from(
        "| kernel | arch | hook family | programs loaded | verifier (insns, load) | suites passed/failed | what fell back |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for result in results {
        let kernel = result
            .probe
            .as_ref()
            .and_then(|p| p["kernel"].as_str())
            .map_or_else(|| result.package.clone(), str::to_owned);
        if let Some(why) = &result.broken {
            let _ = writeln!(
                out,
                "| {} | {} | - | - | - | did not boot | {} |",
                result.row.series,
                result.row.arch.uname(),
                why.replace('|', "/").replace('\n', " ")
            );
            continue;
        }
        for family in FAMILIES {
            family_row(&mut out, result, family, &kernel);
        }
    }
    out.push('\n');
    for result in results {
        let _ = writeln!(
            out,
            "- {} {}: {} as on {}; boot and suites {} s under emulation.",
            result.row.series,
            result.row.arch.uname(),
            if result.package.is_empty() {
                "no package"
            } else {
                &result.package
            },
            result.row.nodes,
            result.took.as_secs()
        );
    }
    out
}

/// One row of the table: what `family` did on `result`'s kernel.
fn family_row(out: &mut String, result: &RowResult, family: &'static str, kernel: &str) {
    let report = result.family(family);
    let programs = report
        .and_then(|f| f["programs"].as_array())
        .map(|p| p.len())
        .unwrap_or(0);
    let insns: u64 = report
        .and_then(|f| f["programs"].as_array())
        .map(|p| p.iter().filter_map(|p| p["verified_insns"].as_u64()).sum())
        .unwrap_or(0);
    let load_ms = report.and_then(|f| f["load_ms"].as_f64()).unwrap_or(0.0);
    let verifier = if !result.loaded(family) {
        "-".to_owned()
    } else if insns > 0 {
        format!("{insns}, {load_ms:.0} ms")
    } else {
        format!("not reported (< 5.16), {load_ms:.0} ms")
    };
    let suites: Vec<String> = result
        .runs
        .iter()
        .filter(|run| {
            run.family == family || (run.family == "auto" && result.chosen() == Some(family))
        })
        .map(|run| match &run.status {
            Some(code) if code == "0" => format!("{} {}/0", run.label, run.passed),
            Some(_) => format!("{} {}/{} FAILED", run.label, run.passed, run.failed),
            None if result.expected(run) => {
                format!("{} never finished", run.label)
            }
            None => format!("{} not run", run.label),
        })
        .collect();
    let fell_back = if result.loaded(family) {
        result.degraded()
    } else {
        let why = report
            .and_then(|f| f["error"].as_str())
            .unwrap_or("no report");
        format!("{family} unavailable: {}", why.replace('|', "/"))
    };
    let _ = writeln!(
        out,
        "| {kernel} | {} | {family} | {} | {verifier} | {} | {fell_back} |",
        result.row.arch.uname(),
        if result.loaded(family) {
            programs.to_string()
        } else {
            "0".into()
        },
        if suites.is_empty() {
            "-".to_owned()
        } else {
            suites.join("; ")
        },
    );
}

impl RowResult {
    /// The family the agent picks on its own (`auto`).
    fn chosen(&self) -> Option<&'static str> {
        FAMILIES.iter().copied().find(|f| self.loaded(f))
    }

    /// The kernel features other than fentry the probe found missing.
    fn degraded(&self) -> String {
        let missing: Vec<String> = self
            .probe
            .as_ref()
            .and_then(|p| p["features"].as_array())
            .map(|features| {
                // fentry has its own row; the others by name (docs/operations.md says what
                // each costs).
                features
                    .iter()
                    .filter(|f| f["available"] == "false" && f["feature"] != "fentry")
                    .map(|f| format!("no {}", f["feature"].as_str().unwrap_or("?")))
                    .collect()
            })
            .unwrap_or_default();
        if missing.is_empty() {
            "nothing".into()
        } else {
            missing.join("; ")
        }
    }
}

fn write_docs(table: &str, options: &Options) -> anyhow::Result<()> {
    let path = shell::workspace_root().join("docs/kernels.md");
    let text = fs::read_to_string(&path).unwrap_or_default();
    const BEGIN: &str = "<!-- kernels:begin -->";
    const END: &str = "<!-- kernels:end -->";
    let (Some(begin), Some(end)) = (text.find(BEGIN), text.find(END)) else {
        bail!(
            "{} has no {BEGIN} ... {END} section for the table",
            path.display()
        );
    };
    let command = if options.table {
        "cargo xtask kernels --only <row> for each row, then cargo xtask kernels --table".to_owned()
    } else if options.only.is_empty() {
        "cargo xtask kernels".to_owned()
    } else {
        format!(
            "cargo xtask kernels --only {}",
            options.only.join(" --only ")
        )
    };
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let section = format!("{BEGIN}\n`{command}`, {date}:\n\n{table}{END}");
    let updated = format!("{}{section}{}", &text[..begin], &text[end + END.len()..]);
    fs::write(&path, updated).with_context(|| format!("write {}", path.display()))
}

/// The Debian mirror apt uses (its first `deb.debian.org`-like URI), else Debian's CDN.
fn debian_mirror() -> String {
    let mut sources = String::new();
    for file in [
        "/etc/apt/sources.list",
        "/etc/apt/sources.list.d/debian.sources",
    ] {
        sources.push_str(&fs::read_to_string(file).unwrap_or_default());
        sources.push('\n');
    }
    sources
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            line.strip_prefix("URIs:")
                .map(|uris| {
                    uris.split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_owned()
                })
                .or_else(|| {
                    line.strip_prefix("deb ")
                        .and_then(|rest| rest.split_whitespace().find(|w| w.contains("://")))
                        .map(str::to_owned)
                })
        })
        .find(|uri| uri.ends_with("/debian") || uri.ends_with("/debian/"))
        .map(|uri| uri.trim_end_matches('/').to_owned())
        .unwrap_or_else(|| "http://deb.debian.org/debian".into())
}

/// The suite's `Packages` index for `arch`, fetched at most once a day.
fn packages_index(cache: &Path, mirror: &str, suite: &str, arch: Arch) -> anyhow::Result<String> {
    let file = cache.join(format!("Packages-{suite}-{}", arch.debian()));
    let fresh = fs::metadata(&file)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|m| SystemTime::now().duration_since(m).ok())
        .is_some_and(|age| age < Duration::from_secs(24 * 3600));
    if !fresh {
        let url = format!(
            "{mirror}/dists/{suite}/main/binary-{}/Packages.xz",
            arch.debian()
        );
        let xz = file.with_extension("xz.partial");
        eprintln!("xtask: kernels: fetching {url}");
        fetch(&url, &xz)?;
        let out = Command::new("xz")
            .arg("-dc")
            .arg(&xz)
            .output()
            .context("run xz")?;
        if !out.status.success() {
            bail!("xz -dc {url}: {}", String::from_utf8_lossy(&out.stderr));
        }
        fs::write(&file, out.stdout)?;
        let _ = fs::remove_file(&xz);
    }
    fs::read_to_string(&file).with_context(|| format!("read {}", file.display()))
}

fn fetch(url: &str, to: &Path) -> anyhow::Result<()> {
    shell::run(
        Command::new("curl")
            .args(["-fsSL", "--retry", "3", "-o"])
            .arg(to)
            .arg(url),
    )
}

/// A package in an index.
struct Package {
    name: String,
    version: String,
    filename: String,
}

/// The index's stanzas, as (name, version, filename).
fn stanzas(index: &str) -> impl Iterator<Item = Package> + '_ {
    index.split("\n\n").filter_map(|stanza| {
        let field = |key: &str| {
            stanza
                .lines()
                .find_map(|line| line.strip_prefix(key))
                .map(|v| v.trim().to_owned())
        };
        Some(Package {
            name: field("Package:")?,
            version: field("Version:")?,
            filename: field("Filename:")?,
        })
    })
}

/// The newest `linux-image-<abi>-<arch>` of the row's series (the generic flavour: not `cloud`,
/// whose configuration drops drivers, nor `rt`), by Debian's version order.
fn newest_kernel(index: &str, row: &Row) -> anyhow::Result<Package> {
    let suffix = format!("-{}", row.arch.debian());
    let mut best: Option<Package> = None;
    for package in stanzas(index) {
        let Some(abi) = package
            .name
            .strip_prefix("linux-image-")
            .and_then(|rest| rest.strip_suffix(&suffix))
        else {
            continue;
        };
        if !abi.starts_with(row.abi_prefix) || abi.contains("-rt") || abi.contains("-cloud") {
            continue;
        }
        if best
            .as_ref()
            .is_none_or(|b| version_newer(&package.version, &b.version))
        {
            best = Some(package);
        }
    }
    best.with_context(|| {
        format!(
            "{} has no linux-image-{}*{suffix}",
            row.suite, row.abi_prefix
        )
    })
}

fn version_newer(a: &str, b: &str) -> bool {
    Command::new("dpkg")
        .args(["--compare-versions", a, "gt", b])
        .status()
        .is_ok_and(|s| s.success())
}

/// Downloads a package into `cache`, saying what it fetches.
fn download(cache: &Path, mirror: &str, package: &Package) -> anyhow::Result<PathBuf> {
    let deb = cache.join(format!("{}_{}.deb", package.name, package.version));
    fetch(&format!("{mirror}/{}", package.filename), &deb)?;
    Ok(deb)
}

/// busybox for an arm64 guest, from bookworm's `busybox-static` for arm64.
fn arm64_busybox(cache: &Path, mirror: &str) -> anyhow::Result<PathBuf> {
    let busybox = cache.join("busybox-arm64");
    if busybox.is_file() {
        return Ok(busybox);
    }
    let index = packages_index(cache, mirror, "bookworm", Arch::Arm64)?;
    let package = stanzas(&index)
        .find(|p| p.name == "busybox-static")
        .context("bookworm has no busybox-static for arm64")?;
    let deb = download(cache, mirror, &package)?;
    let unpacked = cache.join("busybox-arm64.unpacked");
    let _ = fs::remove_dir_all(&unpacked);
    shell::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
    fs::copy(unpacked.join("bin/busybox"), &busybox).context("copy the arm64 busybox")?;
    let _ = fs::remove_dir_all(&unpacked);
    let _ = fs::remove_file(&deb);
    Ok(busybox)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_test_result_line() {
        let log = "test result: ok. 28 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out\n\
                   test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 5 filtered out\n";
        assert_eq!(test_counts(log), (31, 1));
    }

    #[test]
    fn picks_the_newest_generic_kernel_of_the_series() {
        let index = "Package: linux-image-5.10.0-30-amd64\nVersion: 5.10.218-1\nFilename: a.deb\n\n\
                     Package: linux-image-5.10.0-32-amd64\nVersion: 5.10.223-1\nFilename: b.deb\n\n\
                     Package: linux-image-5.10.0-32-cloud-amd64\nVersion: 5.10.223-1\nFilename: c.deb\n\n\
                     Package: linux-image-5.10.0-33-rt-amd64\nVersion: 5.10.230-1\nFilename: d.deb\n";
        let row = MATRIX[0];
        let package = newest_kernel(index, &row).expect("a kernel");
        assert_eq!(package.name, "linux-image-5.10.0-32-amd64");
        assert_eq!(package.filename, "b.deb");
    }
}
