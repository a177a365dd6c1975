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

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};

mod matrix;
mod results;

use crate::vm::{self, Arch};
use crate::{build, build_ebpf, cross_test, deps, shell};
use matrix::{FAMILIES, MATRIX, Row, SUITES, Suite, in_run};
use results::{RowResult, table};

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
    /// The probe only, no suite (CI's newest end; a program change checked through every
    /// kernel's verifier in minutes).
    #[arg(long)]
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
            probe_only: options.probe_only || (options.ci && i > 0 && i + 1 == rows.len()),
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
