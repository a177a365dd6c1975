//! Load generator: starts a `plugin-agent` under test, hosts thousands of real kubelet plugins
//! (each serving `pluginregistration` on its own socket) in a few worker processes, drives a
//! scenario, and measures what the agent did and what it cost.
//!
//! ```text
//! loadgen run --scenario churn --agent target/release/plugin-agent -- --source ebpf
//!   coordinator ── stdin: start/stop ──> workers (copies of loadgen: `loadgen worker`)
//!        ^  <───── stdout: serving/notified/stopped (wall clock ns) ──'
//!        '──── admin API WatchEvents / ListPlugins ──── plugin-agent ── /proc/<pid>: CPU, RSS, wake-ups
//! ```
//!
//! Scenarios are in `scenarios`, measures in `summary`. stdout carries progress lines, then one
//! JSON object: the result. Each phase:
//! 1. start the agent (and, for `slow-handler`, the example DRA handler it calls);
//! 2. one warm-up plugin must register: the agent watches; the CPU/wake-up baseline is read;
//! 3. the scenario's load; then wait (bounded) until every live plugin is registered;
//! 4. idle: once the agent's threads have been still for 200 ms (at most 2 s), nothing changes
//!    for `--idle`; CPU, wake-ups and RSS with all plugins registered;
//! 5. every plugin goes away; wait (bounded by `--stale-bound`) for deregistrations, then ask
//!    the agent what it still lists (stale).

#[path = "../loadgen/admin.rs"]
mod admin;
#[path = "../loadgen/agent.rs"]
mod agent;
#[path = "../loadgen/floor.rs"]
mod floor;
#[path = "../loadgen/harness.rs"]
mod harness;
#[path = "../loadgen/ledger.rs"]
mod ledger;
#[path = "../loadgen/plugins.rs"]
mod plugins;
#[path = "../loadgen/procfs.rs"]
mod procfs;
#[path = "../loadgen/progress.rs"]
mod progress;
#[path = "../loadgen/scenarios.rs"]
mod scenarios;
#[path = "../loadgen/subject.rs"]
mod subject;
#[path = "../loadgen/summary.rs"]
mod summary;
#[path = "../loadgen/workers.rs"]
mod workers;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ledger::SharedLedger;
use plugins::{Announce, now_ns};
use progress::Progress;
use scenarios::{Params, Scenario};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::AsyncBufReadExt;

#[derive(Parser, Debug)]
#[command(
    about = "Mass plugin churn against plugin-agent: latency, loss, duplicates, cost",
    // A later `--count` wins over an earlier one (xtask appends overrides to its defaults).
    args_override_self = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start an agent, run a scenario against it, print the result as JSON.
    Run(Box<RunArgs>),
    /// The floor: registers the plugins a coordinator names, with nothing else (internal:
    /// spawned by `run --floor`; see `floor`).
    Floor {
        #[arg(long)]
        plugin_dir: PathBuf,
    },
    /// Host plugins for a coordinator (internal: spawned by `run`).
    Worker {
        #[arg(long)]
        plugin_dir: PathBuf,
        #[arg(long)]
        plugin_type: String,
        #[arg(long, value_delimiter = ',')]
        versions: Vec<String>,
    },
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// What to run.
    #[arg(long, value_enum)]
    scenario: Scenario,
    /// The `plugin-agent` binary.
    #[arg(long)]
    agent: PathBuf,
    /// A name for this agent configuration, copied into the result (`ebpf`, `polling`...).
    #[arg(long, default_value = "agent")]
    label: String,
    /// Worker processes hosting the plugins.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Where the plugin directory, admin socket and agent log go (default: a fresh temporary
    /// directory, removed afterwards).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Write one CSV row per plugin here.
    #[arg(long)]
    per_plugin_out: Option<PathBuf>,
    /// Quiet period measured after the load (CPU, wake-ups, RSS with every plugin registered).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    idle: Duration,
    /// A plugin gone longer than this and still registered is stale.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    stale_bound: Duration,
    /// A plugin alive this long while the agent is up and never registered is lost.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    lost_bound: Duration,
    /// Export the agent's traces to a receiver in this process (`--otlp-endpoint`), counting the
    /// spans it gets: what tracing (and the exemplars that come with it) costs the agent.
    #[arg(long)]
    otlp_sink: bool,
    /// A shell command run, and waited for, after the warm-up and before the load, with the
    /// agent's pid in `$AGENT_PID`: a profiler's start (`callgrind_control -i on $AGENT_PID`).
    #[arg(long)]
    before_load: Option<String>,
    /// The same once every plugin is registered (before the idle window), and again once
    /// everything is removed: a profiler's dump (`callgrind_control -d load $AGENT_PID`).
    #[arg(long)]
    after_load: Option<String>,
    /// Run the floor instead of the agent (`--agent` and the agent's arguments are then unused):
    /// the least CPU the same registrations can cost (issue 49; see `floor`).
    #[arg(long, conflicts_with = "kubelet_harness")]
    floor: bool,
    /// Run this kubelet plugin-manager harness instead of the agent, as `PATH --plugin-dir DIR`
    /// (see `harness`; none is committed).
    #[arg(long)]
    kubelet_harness: Option<PathBuf>,
    #[command(flatten)]
    params: Params,
    /// Arguments for `plugin-agent run` (`--source ebpf`, `--reconcile-mode polling`...).
    #[arg(last = true)]
    agent_args: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    raise_nofile_limit();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Worker {
            plugin_dir,
            plugin_type,
            versions,
        } => runtime.block_on(workers::serve(
            plugin_dir,
            Announce {
                plugin_type,
                versions,
            },
        )),
        Command::Floor { plugin_dir } => runtime.block_on(floor::serve(plugin_dir)),
        Command::Run(args) => {
            let result = runtime.block_on(run(&args))?;
            println!("{result}");
            Ok(())
        }
    }
}

/// Thousands of sockets need thousands of descriptors: soft limit up to the hard limit.
fn raise_nofile_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// Removes the temporary work directory when the run ends, whichever way.
struct WorkDir {
    path: PathBuf,
    remove: bool,
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

async fn run(args: &RunArgs) -> anyhow::Result<serde_json::Value> {
    let work = WorkDir::for_run(args)?;
    let plugin_dir = work.path.join("plugins");
    std::fs::create_dir_all(&plugin_dir)?;

    let mut agent_args = args.agent_args.clone();
    let (announce, _handler) = handler_for(args, &work.path, &mut agent_args).await?;
    let spans = otlp_sink(args.otlp_sink, &mut agent_args).await?;

    let (ledger, reports_tx) = ledger_fed_by_workers();
    let mut pool = workers::WorkerPool::spawn(args.workers, &plugin_dir, &announce, reports_tx)?;

    let (mut agent_slot, other) =
        subject::start(args, &plugin_dir, &work.path, agent_args, &ledger).await?;
    ledger.lock().agent_up.push((now_ns(), None));
    let pid = subject::pid(agent_slot.as_ref(), other.as_ref())?;

    // Warm-up: proves the agent watches the directory before anything is measured.
    warm_up(&mut pool, &ledger).await?;
    subject::hook(args.before_load.as_deref(), pid).await?;
    let before = procfs::sample(pid)?;

    let mut progress = Progress::new();
    let mut ctx = scenarios::Ctx {
        pool: &mut pool,
        ledger: &ledger,
        progress: &mut progress,
        plugin_dir: &plugin_dir,
        agent: &mut agent_slot,
        next_id: 1,
        announce: &announce,
    };
    let load_started = now_ns();
    scenarios::run(args.scenario, &args.params, &mut ctx).await?;
    let created = ctx.next_id;
    let pid = subject::pid(agent_slot.as_ref(), other.as_ref()).context("after the scenario")?;

    // Everything alive should register; the wait is bounded and the shortfall is measured.
    wait_registered(&ledger, created, args.params.timeout, &mut progress).await;
    let loaded = procfs::sample(pid)?;
    let load_usage = load_usage(&before, &loaded, &ledger);
    subject::hook(args.after_load.as_deref(), pid).await?;

    let (idle, settle) = measure_idle(pid, args.idle, &mut progress).await?;

    // Everything goes away; deregistrations are awaited up to the stale bound.
    progress.set("removing", 0, 1);
    let before_removal = procfs::sample(pid)?;
    remove_all(&mut pool, &ledger, created, args.stale_bound, &mut progress).await?;
    let removal_usage = procfs::sample(pid)?.since(&before_removal);
    subject::hook(args.after_load.as_deref(), pid).await?;
    let still = match &agent_slot {
        Some(agent) => admin::registered_now(&agent.admin_socket).await?,
        None => subject::other_holds(&ledger),
    };
    let end_ns = now_ns();
    pool.shutdown().await?;
    if let Some(mut agent) = agent_slot {
        agent.stop().await?;
        cleanup(&args.agent, &agent.admin_socket, &plugin_dir);
    }
    subject::stop(other).await?;

    let totals = {
        let l = ledger.lock();
        summary::summarize(
            &l,
            1..created,
            &still,
            args.lost_bound.as_nanos() as u64,
            end_ns,
            args.per_plugin_out.as_deref(),
        )?
    };
    Ok(serde_json::json!({
        "mode": args.label,
        "scenario": clap::ValueEnum::to_possible_value(&args.scenario)
            .map(|v| v.get_name().to_owned()),
        "params": format!("{:?}", args.params),
        "workers": args.workers,
        "load_ms": (end_ns.saturating_sub(load_started)) / 1_000_000,
        "totals": totals,
        "agent_load": load_usage,
        "restart_cpu": restart_cpu(&before, &loaded, &ledger),
        // Everything going away (the stale bound's wait included): the deregistrations' cost.
        "agent_removal": removal_usage,
        "agent_idle": idle,
        "idle_settle_ms": settle.as_millis() as u64,
        // Received by --otlp-sink once the stopped agent flushed (null: traces off).
        "spans_exported": spans.map(|n| n.load(std::sync::atomic::Ordering::Relaxed)),
    }))
}

/// With `sink`, points the agent at an OTLP receiver of this process (`--otlp-endpoint` added to
/// `agent_args`) and returns the count of spans it received.
async fn otlp_sink(
    sink: bool,
    agent_args: &mut Vec<String>,
) -> anyhow::Result<Option<std::sync::Arc<std::sync::atomic::AtomicU64>>> {
    let spans = match sink {
        true => {
            let (endpoint, mut received) = plugin_agent_tests::otlp::receiver().await?;
            agent_args.extend(["--otlp-endpoint".into(), endpoint]);
            let count = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let counted = count.clone();
            tokio::spawn(async move {
                while received.recv().await.is_some() {
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
            Some(count)
        }
        false => None,
    };
    Ok(spans)
}

/// The eBPF agent leaves its programs pinned for the next one (and its state file); this run's
/// tree is going, so they go too.
fn cleanup(agent: &Path, admin_socket: &Path, plugin_dir: &Path) {
    let _ = std::process::Command::new(agent)
        .arg("--admin-socket")
        .arg(admin_socket)
        .args(["cleanup", "--plugin-dir"])
        .arg(plugin_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

/// Starts the example DRA handler (`dra-handler`, beside this binary) with `--delay`; returns it
/// (killed on drop) and its `unix://` target once it listens.
async fn start_slow_handler(
    work: &Path,
    delay: Duration,
) -> anyhow::Result<(tokio::process::Child, String)> {
    let exe = std::env::current_exe()?;
    let binary = exe.with_file_name("dra-handler");
    let target = format!("unix://{}", work.join("handler.sock").display());
    let mut child = tokio::process::Command::new(&binary)
        .args(["--listen", &target, "--delay"])
        .arg(humantime::format_duration(delay).to_string())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let stdout = child.stdout.take().context("handler stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    loop {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .context("the handler did not listen within 30 s")??
            .context("the handler exited")?;
        if line.contains("\"listening\"") {
            break;
        }
    }
    // Its per-call lines are not needed: drain them so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, target))
}

impl WorkDir {
    /// `--work-dir` (kept), or a new temporary directory (removed when the run ends).
    fn for_run(args: &RunArgs) -> anyhow::Result<WorkDir> {
        Ok(match &args.work_dir {
            Some(path) => WorkDir {
                path: path.clone(),
                remove: false,
            },
            None => WorkDir {
                path: tempfile::Builder::new()
                    .prefix("loadgen-")
                    .tempdir()?
                    .keep(),
                remove: true,
            },
        })
    }
}

/// The handler the scenario needs, added to `agent_args`: the slow example DRA handler for
/// `slow-handler`, the built-in `accept-all` otherwise; returns what plugins announce, and the
/// handler process (killed on drop) if one was started.
async fn handler_for(
    args: &RunArgs,
    work: &Path,
    agent_args: &mut Vec<String>,
) -> anyhow::Result<(Announce, Option<tokio::process::Child>)> {
    Ok(if args.scenario == Scenario::SlowHandler {
        let (handler, target) = start_slow_handler(work, args.params.handler_delay).await?;
        agent_args.extend(["--handler".into(), format!("DRAPlugin={target}")]);
        let announce = Announce {
            plugin_type: "DRAPlugin".into(),
            versions: vec!["v1.DRAPlugin".into()],
        };
        (announce, Some(handler))
    } else {
        agent_args.extend(["--handler".into(), "CSIPlugin=accept-all".into()]);
        let announce = Announce {
            plugin_type: "CSIPlugin".into(),
            versions: vec!["1.0.0".into()],
        };
        (announce, None)
    })
}

/// Registers one plugin first: proves the agent watches the directory before anything is
/// measured.
async fn warm_up(pool: &mut workers::WorkerPool, ledger: &SharedLedger) -> anyhow::Result<()> {
    pool.start(0, Duration::ZERO).await?;
    pool.flush().await?;
    let warm = ledger
        .wait_for(Duration::from_secs(60), |l| {
            l.plugins.get(&0).is_some_and(|r| !r.notified.is_empty())
        })
        .await;
    anyhow::ensure!(warm, "the warm-up plugin was not registered within 60 s");
    Ok(())
}

/// Waits (at most `timeout`) until every plugin alive is registered; the shortfall is measured
/// afterwards, not here.
async fn wait_registered(
    ledger: &SharedLedger,
    created: u64,
    timeout: Duration,
    progress: &mut Progress,
) {
    let alive = |l: &ledger::Ledger| {
        (1..created)
            .filter(|id| {
                // Not yet reported serving counts as waiting too; gone or failed to start does not.
                !l.plugins.get(id).is_some_and(|r| {
                    r.stopped_ns.is_some() || !r.notified.is_empty() || r.error.is_some()
                })
            })
            .count()
    };
    let deadline = tokio::time::Instant::now() + timeout;
    while !ledger
        .check_every(Duration::from_millis(50), Duration::from_millis(200), |l| {
            alive(l) == 0
        })
        .await
        && tokio::time::Instant::now() < deadline
    {
        let registered = ledger.lock().registered as u64;
        progress.set("registering", registered.min(created - 1), created - 1);
    }
}

/// Stops every plugin still running and waits (at most `stale_bound`) for the deregistrations of
/// those registered in the agent's current lifetime.
async fn remove_all(
    pool: &mut workers::WorkerPool,
    ledger: &SharedLedger,
    created: u64,
    stale_bound: Duration,
    progress: &mut Progress,
) -> anyhow::Result<()> {
    let to_stop: Vec<u64> = {
        let l = ledger.lock();
        (0..created)
            .filter(|id| l.plugins.get(id).is_some_and(|r| r.stopped_ns.is_none()))
            .collect()
    };
    for id in &to_stop {
        pool.stop(*id).await?;
    }
    pool.flush().await?;
    let expected: Vec<u64> = {
        let l = ledger.lock();
        (0..created)
            .filter(|id| {
                l.plugins
                    .get(id)
                    .is_some_and(|r| r.registered_events.iter().any(|(lt, _)| *lt == l.lifetime))
            })
            .collect()
    };
    ledger
        .check_every(Duration::from_millis(50), stale_bound, |l| {
            expected.iter().all(|id| {
                l.plugins.get(id).is_some_and(|r| {
                    r.stopped_ns
                        .is_some_and(|s| r.deregistered_events.iter().any(|&d| d + 1_000_000 >= s))
                })
            })
        })
        .await;
    let deregistered = ledger.lock().deregistered as u64;
    progress.set("removing", deregistered, expected.len() as u64);
    Ok(())
}

/// The ledger, and the channel the workers report into; a task moves each report into the
/// ledger as it arrives.
fn ledger_fed_by_workers() -> (
    SharedLedger,
    tokio::sync::mpsc::UnboundedSender<plugins::Report>,
) {
    let ledger = SharedLedger::default();
    let (reports_tx, mut reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let reports_ledger = ledger.clone();
    tokio::spawn(async move {
        while let Some(report) = reports_rx.recv().await {
            reports_ledger.report(report);
        }
    });
    (ledger, reports_tx)
}

/// The agent's cost over `window` with nothing happening. It begins once the agent has finished
/// what the load started (the last operations' tails, the source's backlog): no thread switched
/// for [`SETTLED`], or [`SETTLE_LIMIT`] after the load, whichever comes first, so a periodic
/// wake-up faster than that is still measured. Polling `/proc` is the point here (an outside view
/// of a process), and so is the timer that makes the quiet window.
async fn measure_idle(
    pid: u32,
    window: Duration,
    progress: &mut Progress,
) -> anyhow::Result<(procfs::Usage, Duration)> {
    progress.set("settling", 0, 1);
    let load_end = std::time::Instant::now();
    let mut last = procfs::sample(pid)?;
    let mut quiet_since = load_end;
    while quiet_since.elapsed() < SETTLED && load_end.elapsed() < SETTLE_LIMIT {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = procfs::sample(pid)?;
        if now.switches() != last.switches() {
            quiet_since = std::time::Instant::now();
        }
        last = now;
    }
    let settle = load_end.elapsed();
    progress.set("idle", 0, 1);
    let idle_start = procfs::sample(pid)?;
    tokio::time::sleep(window).await;
    Ok((procfs::sample(pid)?.since(&idle_start), settle))
}

/// How long the agent's threads must not switch before the idle window begins.
const SETTLED: Duration = Duration::from_millis(200);
/// The longest wait for that.
const SETTLE_LIMIT: Duration = Duration::from_secs(2);

/// The agent's use over the load. After a restart `before` and `loaded` are two processes'
/// readings: the load's CPU is then the old agent's from `before` to its exit (its whole life's,
/// read as it was reaped) and the new agent's whole life so far, its start included.
fn load_usage(
    before: &procfs::Sample,
    loaded: &procfs::Sample,
    ledger: &SharedLedger,
) -> procfs::Usage {
    let mut usage = loaded.since(before);
    let stopped: Vec<u64> = ledger
        .lock()
        .restarts
        .iter()
        .map(|r| r.stopped_agent_cpu_ms)
        .collect();
    if !stopped.is_empty() {
        usage.cpu_ms =
            stopped.iter().sum::<u64>().saturating_sub(before.cpu_ms()) + loaded.cpu_ms();
    }
    usage
}

/// The load's CPU across the first restart, phase by phase, ms: the old agent before the signal
/// and from the signal to its exit, the new agent to its admin API listening and after it.
fn restart_cpu(
    before: &procfs::Sample,
    loaded: &procfs::Sample,
    ledger: &SharedLedger,
) -> Option<serde_json::Value> {
    let ledger = ledger.lock();
    let r = ledger.restarts.first()?;
    Some(serde_json::json!({
        "old_running_ms": r.signalled_agent_cpu_ms.saturating_sub(before.cpu_ms()),
        "old_stopping_ms": r.stopped_agent_cpu_ms.saturating_sub(r.signalled_agent_cpu_ms),
        "new_starting_ms": r.ready_agent_cpu_ms,
        "new_running_ms": loaded.cpu_ms().saturating_sub(r.ready_agent_cpu_ms),
    }))
}
