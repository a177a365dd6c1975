//! `cargo xtask bench-sources`: the event sources themselves, eBPF vs fanotify vs inotify in one
//! run: detection latency at idle and sustained throughput under churn.
//!
//! It runs the ignored `bench_sources` test of `agent/tests/ebpf_source.rs` from a release build
//! (root needed, as for the sources), which for each source:
//! - idle: binds sockets 5 ms apart from a helper process and measures detection latency: kernel
//!   timestamp -> receipt (eBPF only: fanotify and inotify carry none), split into kernel ->
//!   reader (ring wake-up and the reader's scheduling) and reader -> receipt (the channel), and for
//!   every source the helper's `CLOCK_MONOTONIC` right after `bind` returned -> receipt (0 when
//!   the agent had the event before `bind` returned to the helper); eBPF also once more on a plain
//!   tokio runtime, side by side with the agent's (see `plugin_agent::runtime`); and the machine's
//!   floor: an eventfd wake-up 5 ms apart, writer and reader pinned to the same CPU or two;
//! - churn: runs 100,000 bind+unlink pairs from two processes while consuming, and measures
//!   events/s until an end sentinel arrives, with every rescan (recovered loss) and the kernel drop
//!   counter; meanwhile a third helper binds a socket every 2 ms, measured as above (latency under
//!   load).
//!
//! Results: a table on stdout and `target/bench/sources.json`, checked against the targets (p99
//! detection <= 100 us at idle, no loss that is not followed by a rescan, eBPF >= inotify events/s).

use crate::{build, build_ebpf, deps, shell};
use anyhow::Context;

/// Options for the sources benchmark.
#[derive(clap::Args)]
pub struct Options {
    /// Idle latency samples per source.
    #[arg(long, default_value_t = 500)]
    pub samples: u64,
    /// bind+unlink pairs per source, split over two processes.
    #[arg(long, default_value_t = 100_000)]
    pub pairs: u64,
}

/// p99 detection latency target at idle, microseconds.
const P99_TARGET_US: f64 = 100.0;

/// Builds (release, eBPF embedded), runs the benchmark test, prints and writes the results.
pub fn bench_sources(options: &Options) -> anyhow::Result<()> {
    deps::install_missing()?;
    let object = build_ebpf::build(&build_ebpf::Options::default())?;
    let out_dir = shell::workspace_root().join("target/bench");
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let out = out_dir.join("sources.json");
    let mut command = shell::cargo();
    command
        .args([
            "test",
            "--release",
            "-p",
            "plugin-agent",
            "--test",
            "ebpf_source",
        ])
        .args(["--", "--ignored", "--exact", "bench_sources", "--nocapture"])
        .env("BENCH_SOURCES_OUT", &out)
        .env("BENCH_SOURCES_SAMPLES", options.samples.to_string())
        .env("BENCH_SOURCES_PAIRS", options.pairs.to_string())
        // Privileged tests must run, not skip, in a benchmark.
        .env("CI", "true");
    build::with_ebpf_object(&mut command, &object);
    shell::run(&mut command)?;
    let text =
        std::fs::read_to_string(&out).with_context(|| format!("cannot read {}", out.display()))?;
    let report: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not the benchmark's JSON", out.display()))?;
    print_table(&report);
    eprintln!("xtask: results in {}", out.display());
    Ok(())
}

/// Throughput, loss and memory per source under churn, and the two targets.
fn print_throughput(rows: &[serde_json::Value]) {
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    println!(
        "{:<9} {:>14} {:>14} {:>9} {:>8} {:>10}",
        "source", "syscalls/s", "events recv/s", "rescans", "dropped", "RSS KiB"
    );
    for row in rows {
        println!(
            "{:<9} {:>14.0} {:>14.0} {:>9} {:>8} {:>10}",
            row["source"].as_str().unwrap_or("?"),
            f(&row["syscall_events_per_second"]),
            f(&row["events_received_per_second"]),
            row["rescans"],
            row["kernel_dropped"],
            row["rss_kib"],
        );
    }
    let by = |name: &str| rows.iter().find(|r| r["source"] == name);
    if let Some(ebpf) = by("ebpf") {
        let p99 = f(&ebpf["idle_latency"]["from_kernel_timestamp_us"]["p99"]);
        println!(
            "target p99 detection <= {P99_TARGET_US} us at idle (eBPF, kernel timestamp): {p99:.0} us {}",
            if p99 <= P99_TARGET_US {
                "met"
            } else {
                "MISSED"
            }
        );
        if let Some(inotify) = by("inotify") {
            let (e, i) = (
                f(&ebpf["syscall_events_per_second"]),
                f(&inotify["syscall_events_per_second"]),
            );
            println!(
                "target eBPF events/s >= inotify's: {e:.0} vs {i:.0} {}",
                if e >= i { "met" } else { "MISSED" }
            );
        }
    }
}

fn print_table(report: &serde_json::Value) {
    let rows = report["sources"].as_array().cloned().unwrap_or_default();
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let pair = |v: &serde_json::Value| {
        if v.is_null() {
            "-".to_string()
        } else {
            format!("{:.0}/{:.0}", f(&v["p50"]), f(&v["p99"]))
        }
    };
    println!("detection latency p50/p99 in us (kernel timestamp and reader hops: eBPF only)");
    println!(
        "{:<9} {:<7} {:>14} {:>14} {:>14} {:>14}",
        "source", "load", "return->recv", "kernel->recv", "kernel->reader", "reader->recv"
    );
    let latency_row = |source: &str, load: &str, latency: &serde_json::Value, note: &str| {
        println!(
            "{:<9} {:<7} {:>14} {:>14} {:>14} {:>14}{note}",
            source,
            load,
            pair(&latency["from_syscall_return_us"]),
            pair(&latency["from_kernel_timestamp_us"]),
            pair(&latency["kernel_to_reader_us"]),
            pair(&latency["reader_to_consumer_us"]),
        );
    };
    for row in &rows {
        let source = row["source"].as_str().unwrap_or("?");
        latency_row(source, "idle", &row["idle_latency"], "");
        latency_row(source, "churn", &row["loaded_latency"], "");
    }
    let plain = &report["ebpf_idle_latency_on_plain_tokio_runtime"];
    if !plain.is_null() {
        latency_row(
            "ebpf",
            "idle",
            plain,
            "   (plain tokio runtime, no short slice)",
        );
    }
    let floor = &report["wake_up_floor"];
    if !floor.is_null() {
        println!(
            "wake-up floor of this machine (eventfd, 5 ms apart): same CPU {}, other CPU {}",
            pair(&floor["same_cpu_us"]),
            pair(&floor["other_cpu_us"]),
        );
    }
    println!();
    print_throughput(&rows);
}
