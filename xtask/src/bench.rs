//! `cargo xtask bench [scenario]`: mass socket churn against every event source and kubelet-like
//! polling, side by side in one run (this machine is shared and noisy: only ratios within a run
//! mean much).
//!
//! Builds a release `plugin-agent` with the eBPF object embedded, then for each scenario and mode
//! runs `loadgen run` (which starts its own agent with that mode's flags, drives the scenario and
//! measures; see tests/src/bin/loadgen.rs), showing its progress as a bar. Results go to
//! target/bench/: `results.json` (everything), `results.md` (table and targets), one
//! `latency-<scenario>.svg` CDF plot per scenario, and one CSV per run with every plugin's
//! latencies.

mod floor;
mod report;
mod svg;

use crate::{build, build_ebpf, deps, shell};
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Options for the benchmark.
#[derive(clap::Args)]
pub struct Options {
    /// Scenario to run; none: all of them, sized to finish in about 15 minutes (churn for 20 s
    /// instead of 60 s: run `cargo xtask bench churn` for the 60 s target).
    #[arg(value_enum)]
    pub scenario: Option<Scenario>,
    /// Modes to run (default: ebpf, fanotify, inotify, polling). Also ebpf-no-provenance and
    /// fanotify-no-provenance (`--provenance false`), for what provenance costs.
    #[arg(long, value_delimiter = ',')]
    pub modes: Vec<String>,
    /// Runs of every scenario in every mode, interleaved (round r starts at the r-th mode, so no
    /// mode always runs first or right after the same one); each row is then the median of its
    /// rounds, metric by metric, and results.json keeps every round. One round's row moves with
    /// what else this shared machine does; a median of three says which differences are real.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=9))]
    pub rounds: u32,
    /// Extra arguments for every `loadgen run` (e.g. `--count=20000`, `--duration=120s`), after
    /// the scenario's own defaults, so they win.
    #[arg(long = "loadgen-arg", allow_hyphen_values = true)]
    pub loadgen_args: Vec<String>,
    /// A kubelet plugin-manager harness (run as `PATH --plugin-dir DIR`; none is committed): run
    /// it side by side, as the mode `kubelet`, in every scenario.
    #[arg(long)]
    pub kubelet_harness: Option<std::path::PathBuf>,
}

/// A scenario, as loadgen names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    Sequential,
    Burst,
    Churn,
    Storm,
    Restart,
    RestartKill,
    SlowHandler,
    BindBeforeServe,
    Crash,
    Handoff,
}

impl Scenario {
    const ALL: [Scenario; 10] = [
        Scenario::Sequential,
        Scenario::Burst,
        Scenario::Churn,
        Scenario::Storm,
        Scenario::Restart,
        Scenario::RestartKill,
        Scenario::SlowHandler,
        Scenario::BindBeforeServe,
        Scenario::Crash,
        Scenario::Handoff,
    ];

    /// loadgen's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Sequential => "sequential",
            Scenario::Burst => "burst",
            Scenario::Churn => "churn",
            Scenario::Storm => "storm",
            Scenario::Restart => "restart",
            Scenario::RestartKill => "restart-kill",
            Scenario::SlowHandler => "slow-handler",
            Scenario::BindBeforeServe => "bind-before-serve",
            Scenario::Crash => "crash",
            Scenario::Handoff => "handoff",
        }
    }

    /// loadgen arguments: the target sizes, shortened where a full run of every
    /// scenario would take too long (`in_all`).
    fn loadgen_args(self, in_all: bool) -> Vec<&'static str> {
        match self {
            Scenario::Sequential => vec!["--count", "30"],
            Scenario::Burst => vec!["--count", "10000"],
            Scenario::Churn if in_all => vec!["--rate", "1000", "--duration", "20s"],
            Scenario::Churn => vec!["--rate", "1000", "--duration", "60s"],
            Scenario::Storm => vec!["--count", "100", "--noise-pairs", "200000"],
            Scenario::Restart | Scenario::RestartKill => {
                vec!["--rate", "500", "--duration", "20s"]
            }
            Scenario::SlowHandler => vec!["--count", "200", "--handler-delay", "50ms"],
            Scenario::BindBeforeServe => vec!["--count", "200", "--serve-delay", "300ms"],
            // One worker process per plugin (ids 1..=100 on workers 1..=100; the warm-up
            // plugin, id 0, on worker 0).
            Scenario::Crash => vec!["--count", "100", "--workers", "101"],
            Scenario::Handoff => vec!["--count", "100"],
        }
    }
}

/// An agent configuration compared.
struct Mode {
    name: &'static str,
    agent_args: &'static [&'static str],
    /// For loadgen itself (`--otlp-sink`: a trace receiver for the agent).
    loadgen_args: &'static [&'static str],
    /// Environment for loadgen and the agent it starts (the standard OpenTelemetry sampler).
    env: &'static [(&'static str, &'static str)],
    /// Run when no `--modes` are given (the others are for a question of their own).
    by_default: bool,
}

use floor::MODE as FLOOR;
/// The kubelet harness's mode: run only with `--kubelet-harness`, which names the binary.
const KUBELET: &str = "kubelet";

const MODES: &[Mode] = &[
    // The least CPU the same registrations can cost: two RPCs per plugin and nothing else, told
    // of each plugin directly (issue 49; tests/src/loadgen/floor.rs).
    Mode {
        name: FLOOR,
        agent_args: &[],
        loadgen_args: &["--floor"],
        env: &[],
        by_default: true,
    },
    // kubelet's plugin manager in a harness (`--kubelet-harness PATH`; loadgen's `harness`).
    Mode {
        name: KUBELET,
        agent_args: &[],
        loadgen_args: &[],
        env: &[],
        by_default: false,
    },
    Mode {
        name: "ebpf",
        agent_args: &["--source", "ebpf"],
        loadgen_args: &[],
        env: &[],
        by_default: true,
    },
    Mode {
        name: "fanotify",
        agent_args: &["--source", "fanotify"],
        loadgen_args: &[],
        env: &[],
        by_default: true,
    },
    Mode {
        name: "inotify",
        agent_args: &["--source", "inotify"],
        loadgen_args: &[],
        env: &[],
        by_default: true,
    },
    Mode {
        name: "polling",
        agent_args: &["--source", "inotify", "--reconcile-mode", "polling"],
        loadgen_args: &[],
        env: &[],
        by_default: true,
    },
    // What provenance (the /proc reads naming each socket's creator and server) costs: the
    // same sources with it off (`cargo xtask bench burst --modes ebpf,ebpf-no-provenance,...`).
    Mode {
        name: "ebpf-no-provenance",
        agent_args: &["--source", "ebpf", "--provenance", "false"],
        loadgen_args: &[],
        env: &[],
        by_default: false,
    },
    Mode {
        name: "fanotify-no-provenance",
        agent_args: &["--source", "fanotify", "--provenance", "false"],
        loadgen_args: &[],
        env: &[],
        by_default: false,
    },
    // What tracing costs (issue 21): every operation's trace exported over OTLP to a receiver
    // in loadgen, with the exemplars that come with it (`--modes ebpf,ebpf-traced`).
    Mode {
        name: "ebpf-traced",
        agent_args: &["--source", "ebpf"],
        loadgen_args: &["--otlp-sink"],
        env: &[],
        by_default: false,
    },
    Mode {
        name: "fanotify-traced",
        agent_args: &["--source", "fanotify"],
        loadgen_args: &["--otlp-sink"],
        env: &[],
        by_default: false,
    },
    // The same with one trace in ten sampled at the head (the tail rule still exports failed and
    // slow operations): what tracing costs as a busy node would run it.
    Mode {
        name: "ebpf-traced-sampled",
        agent_args: &["--source", "ebpf"],
        loadgen_args: &["--otlp-sink"],
        env: SAMPLE_ONE_IN_TEN,
        by_default: false,
    },
    Mode {
        name: "fanotify-traced-sampled",
        agent_args: &["--source", "fanotify"],
        loadgen_args: &["--otlp-sink"],
        env: SAMPLE_ONE_IN_TEN,
        by_default: false,
    },
];

/// The standard sampler variables for one trace in ten.
const SAMPLE_ONE_IN_TEN: &[(&str, &str)] = &[
    ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
    ("OTEL_TRACES_SAMPLER_ARG", "0.1"),
];

/// Builds (release, eBPF embedded), runs every scenario in every mode, writes the results.
pub fn bench(options: &Options) -> anyhow::Result<()> {
    deps::install_missing()?;
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    build::agent_and_test_bins(Some(&object), true)?;

    let root = shell::workspace_root();
    let release = root.join("target/release");
    warn_about_pinned_programs(&release);
    let out_dir = root.join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let scenarios: Vec<Scenario> = match options.scenario {
        Some(s) => vec![s],
        None => Scenario::ALL.to_vec(),
    };
    let modes: Vec<&Mode> = MODES
        .iter()
        .filter(|m| match m.name {
            FLOOR => true,
            KUBELET => options.kubelet_harness.is_some(),
            _ if options.modes.is_empty() => m.by_default,
            _ => options.modes.iter().any(|n| n == m.name),
        })
        .collect();
    let command = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
    let rounds = options.rounds as usize;
    let mut results = Vec::new();
    for scenario in &scenarios {
        let mut runs: Vec<Vec<serde_json::Value>> = vec![Vec::new(); modes.len()];
        for round in 0..rounds {
            for i in (0..modes.len()).map(|i| (i + round) % modes.len()) {
                let mode = modes[i];
                let mut args: Vec<String> = scenario
                    .loadgen_args(options.scenario.is_none())
                    .into_iter()
                    .map(String::from)
                    .collect();
                args.extend(options.loadgen_args.iter().cloned());
                if let (KUBELET, Some(harness)) = (mode.name, &options.kubelet_harness) {
                    args.push(format!("--kubelet-harness={}", harness.display()));
                }
                let suffix = if rounds > 1 {
                    format!("-round{}", round + 1)
                } else {
                    String::new()
                };
                let csv = out_dir.join(format!("{}-{}{suffix}.csv", scenario.name(), mode.name));
                let result = match run_one(&release, mode, *scenario, &args, &csv) {
                    Ok(result) => result,
                    Err(e) => {
                        eprintln!("xtask: bench: {} {}: {e:#}", scenario.name(), mode.name);
                        serde_json::json!({
                            "mode": mode.name, "scenario": scenario.name(), "error": format!("{e:#}")
                        })
                    }
                };
                runs[i].push(result);
            }
        }
        results.extend(runs.into_iter().map(report::median_of_rounds));
        svg::write_cdf(&out_dir, scenario.name(), &results)?;
    }
    floor::add_ratios(&mut results);
    let json = out_dir.join("results.json");
    std::fs::write(&json, serde_json::to_string_pretty(&results)?)?;
    let markdown = report::markdown(&results, &format!("cargo xtask {command}"));
    std::fs::write(out_dir.join("results.md"), &markdown)?;
    println!("{markdown}");
    eprintln!("xtask: bench: results in {}", out_dir.display());
    Ok(())
}

/// Pinned eBPF programs stay attached after their agent is gone (that is what makes a restart
/// invisible), and a killed test run leaves its set behind: each one runs on every traced syscall
/// of every process, in every row of every mode. Each run's own set is removed by loadgen.
fn warn_about_pinned_programs(release: &Path) {
    let root = Path::new("/sys/fs/bpf/plugin-agent");
    let sets = std::fs::read_dir(root).map_or(0, |dir| dir.flatten().count());
    if sets > 0 {
        eprintln!(
            "xtask: bench: {sets} pinned program set(s) under {} are attached and tax every row; \
             `{} cleanup --all` removes them (no agent may be running)",
            root.display(),
            release.join("plugin-agent").display()
        );
    }
}

/// One scenario in one mode: loadgen's progress lines drive a bar; its last line is the result.
fn run_one(
    release: &Path,
    mode: &Mode,
    scenario: Scenario,
    args: &[String],
    csv: &Path,
) -> anyhow::Result<serde_json::Value> {
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>28} [{elapsed_precise}] {bar:30} {pos:>7}/{len:7} {msg}",
        )
        .context("progress bar template")?,
    );
    bar.set_prefix(format!("{} {}", scenario.name(), mode.name));
    bar.set_message("starting the agent");
    bar.enable_steady_tick(Duration::from_millis(200));
    let mut child = Command::new(release.join("loadgen"))
        .args(["run", "--scenario", scenario.name(), "--label", mode.name])
        .arg("--agent")
        .arg(release.join("plugin-agent"))
        .arg("--per-plugin-out")
        .arg(csv)
        .args(mode.loadgen_args)
        .envs(mode.env.iter().copied())
        .args(args)
        .arg("--")
        // The agent's default concurrency (256 operations): on 2 cores more buys no throughput
        // (a registration is ~0.1 ms of CPU) and costs memory (each running one holds a
        // connection with its HTTP/2 buffers), which glibc then keeps as fragmentation.
        .args(mode.agent_args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting loadgen")?;
    let stdout = child.stdout.take().context("loadgen stdout")?;
    let mut result = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) else {
            bar.println(format!("loadgen: {line}"));
            continue;
        };
        match value.get("progress") {
            Some(p) => {
                bar.set_length(p["total"].as_u64().unwrap_or(1).max(1));
                bar.set_position(p["done"].as_u64().unwrap_or(0));
                bar.set_message(p["phase"].as_str().unwrap_or("").to_owned());
            }
            None => result = Some(value),
        }
    }
    let status = child.wait()?;
    bar.finish_and_clear();
    match result {
        Some(result) if status.success() => {
            eprintln!("{}", report::one_line(&result));
            Ok(result)
        }
        _ => anyhow::bail!("loadgen failed: {status}"),
    }
}
