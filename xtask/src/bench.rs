//! `cargo xtask bench`: registration latency, every event source and kubelet-like polling, side
//! by side in one run (this machine is shared and noisy: only ratios within a run mean much).
//!
//! For each mode it starts a release `plugin-agent` on a fresh directory with the accept-all
//! handler, runs the `loadgen` scenarios against it (listen -> NotifyRegistrationStatus(true)),
//! and stops it. Results: a table on stdout and `target/bench/registration.json`.

use crate::{build, build_ebpf, deps, shell};
use anyhow::{Context, bail};
use std::process::{Command, Stdio};

/// Options for the benchmark.
#[derive(clap::Args)]
pub struct Options {
    /// Plugins in the sequential scenario.
    #[arg(long, default_value_t = 100)]
    pub sequential: usize,
    /// Plugins in the burst scenario.
    #[arg(long, default_value_t = 1000)]
    pub burst: usize,
    /// Modes to run (default: all). ebpf, fanotify, inotify, polling.
    #[arg(long, value_delimiter = ',')]
    pub modes: Vec<String>,
}

struct Mode {
    name: &'static str,
    agent_args: &'static [&'static str],
}

const MODES: &[Mode] = &[
    Mode {
        name: "ebpf",
        agent_args: &["--source", "ebpf"],
    },
    Mode {
        name: "fanotify",
        agent_args: &["--source", "fanotify"],
    },
    Mode {
        name: "inotify",
        agent_args: &["--source", "inotify"],
    },
    Mode {
        name: "polling",
        agent_args: &["--source", "inotify", "--reconcile-mode", "polling"],
    },
];

/// Builds (release, eBPF embedded), runs every mode, prints and writes the results.
pub fn bench(options: &Options) -> anyhow::Result<()> {
    deps::install_missing()?;
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    let mut cargo = shell::cargo();
    cargo.args([
        "build",
        "--release",
        "-p",
        "plugin-agent",
        "-p",
        "plugin-agent-tests",
        "--bins",
    ]);
    build::with_ebpf_object(&mut cargo, &object);
    shell::run(&mut cargo)?;

    let release = shell::workspace_root().join("target/release");
    let out_dir = shell::workspace_root().join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let mut results = Vec::new();
    for mode in MODES
        .iter()
        .filter(|m| options.modes.is_empty() || options.modes.iter().any(|n| n == m.name))
    {
        for (scenario, count) in [("sequential", options.sequential), ("burst", options.burst)] {
            eprintln!("xtask: bench: {} {scenario} x{count}", mode.name);
            match run_one(&release, mode, scenario, count) {
                Ok(result) => {
                    results.push(serde_json::json!({ "mode": mode.name, "result": result }))
                }
                Err(e) => {
                    eprintln!("xtask: bench: {} {scenario}: {e:#}", mode.name);
                    results.push(serde_json::json!({ "mode": mode.name, "scenario": scenario, "error": format!("{e:#}") }));
                }
            }
        }
    }
    let path = out_dir.join("registration.json");
    std::fs::write(&path, serde_json::to_string_pretty(&results)?)?;
    println!("| mode | scenario | plugins | p50 ms | p99 ms | max ms | all notified ms |");
    println!("|---|---|---|---|---|---|---|");
    for r in &results {
        let mode = r["mode"].as_str().unwrap_or("?");
        let res = &r["result"];
        if res.is_null() {
            println!(
                "| {mode} | {} | error: {} | | | | |",
                r["scenario"], r["error"]
            );
            continue;
        }
        let ms = |key: &str| {
            res[key]
                .as_f64()
                .map(|us| format!("{:.2}", us / 1000.0))
                .unwrap_or_default()
        };
        println!(
            "| {mode} | {} | {} | {} | {} | {} | {} |",
            res["scenario"].as_str().unwrap_or("?"),
            res["registered"],
            ms("p50_us"),
            ms("p99_us"),
            ms("max_us"),
            ms("total_us")
        );
    }
    eprintln!("xtask: bench: results in {}", path.display());
    Ok(())
}

fn run_one(
    release: &std::path::Path,
    mode: &Mode,
    scenario: &str,
    count: usize,
) -> anyhow::Result<serde_json::Value> {
    let dir = std::env::temp_dir().join(format!(
        "plugin-agent-bench-{}-{scenario}-{}",
        mode.name,
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let mut agent = Command::new(release.join("plugin-agent"))
        .args(["--log-level", "warn", "run", "--plugin-dir"])
        .arg(&dir)
        .args([
            "--handler",
            "CSIPlugin=accept-all",
            "--max-concurrent",
            "1024",
        ])
        .args(mode.agent_args)
        .stdin(Stdio::null())
        .spawn()
        .context("starting plugin-agent")?;
    let output = Command::new(release.join("loadgen"))
        .args(["--plugin-dir"])
        .arg(&dir)
        .args(["--scenario", scenario, "--count", &count.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .context("running loadgen");
    let _ = agent.kill();
    let _ = agent.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let output = output?;
    if !output.status.success() {
        bail!("loadgen failed: {}", output.status);
    }
    let line = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("loadgen printed {line:?}"))
}
