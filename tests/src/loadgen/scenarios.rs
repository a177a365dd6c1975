//! The load shapes. Each one only creates and removes sockets (through the workers, and noise from
//! this process) and waits on the ledger; measuring is the summary's job.

use crate::admin;
use crate::agent::AgentUnderTest;
use crate::ledger::{Restart, SharedLedger};
use crate::plugins::now_ns;
use crate::progress::Progress;
use crate::workers::WorkerPool;
use anyhow::Context;
use nix::sys::signal::Signal;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// One plugin at a time: create, wait for its Notify(true), next.
    Sequential,
    /// `count` plugins as fast as they can be created; wait for all.
    Burst,
    /// `rate` plugins/s for `duration`, each living `lifetime`.
    Churn,
    /// `noise-pairs` non-plugin sockets bound and unlinked at full speed, `count` real plugins
    /// spread through them.
    Storm,
    /// Churn, with the agent stopped (SIGTERM) and started again half-way.
    Restart,
    /// Churn, with the agent killed (SIGKILL: a crash, an OOM kill) and started again half-way.
    RestartKill,
    /// A burst against a handler that takes `handler-delay` per call (the example DRA handler).
    SlowHandler,
    /// A burst of plugins that bind, then serve only `serve-delay` later.
    BindBeforeServe,
    /// `count` example plugins (their own processes), registered; each then hands its listening
    /// socket to a child and exits (SIGUSR1: socket activation's shape). Nothing may be
    /// deregistered while the children serve (`early_deregistrations`); afterwards the children
    /// are killed and the sockets removed.
    Handoff,
    /// `count` plugins, each in its own worker process (run with `--workers` > `count`),
    /// registered; then each worker SIGKILLed in turn, its socket left behind (a crash, an OOM
    /// kill), and its deregistration awaited. Its "stop" is the kill.
    Crash,
}

/// Scenario sizes and bounds.
#[derive(Debug, Clone, clap::Args)]
pub struct Params {
    /// Plugins (sequential, burst, storm's real plugins, slow-handler, bind-before-serve).
    #[arg(long, default_value_t = 100)]
    pub count: u64,
    /// Churn: plugins created per second.
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    /// Churn: how long each plugin lives.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub lifetime: Duration,
    /// Churn: how long plugins keep being created.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Storm: non-plugin socket create/unlink pairs.
    #[arg(long, default_value_t = 200_000)]
    pub noise_pairs: u64,
    /// Bind-before-serve: time between bind and serve.
    #[arg(long, default_value = "300ms", value_parser = humantime::parse_duration)]
    pub serve_delay: Duration,
    /// Slow-handler: the handler's delay per call.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    pub handler_delay: Duration,
    /// Give up waiting for all plugins to register after this long.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

/// What a scenario drives.
pub struct Ctx<'a> {
    pub pool: &'a mut WorkerPool,
    pub ledger: &'a SharedLedger,
    pub progress: &'a mut Progress,
    pub plugin_dir: &'a Path,
    /// Taken by the restart scenario while it restarts the agent, and given back.
    pub agent: &'a mut Option<AgentUnderTest>,
    /// Next plugin id (0 is the warm-up plugin).
    pub next_id: u64,
    /// What plugins announce (for the scenarios that start their own plugin processes).
    pub announce: &'a crate::plugins::Announce,
}

impl Ctx<'_> {
    fn id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }
}

/// Runs `scenario`; returns when its load is over (plugins may still be registering).
pub async fn run(scenario: Scenario, p: &Params, ctx: &mut Ctx<'_>) -> anyhow::Result<()> {
    match scenario {
        Scenario::Sequential => sequential(p, ctx).await,
        Scenario::Burst | Scenario::SlowHandler => burst(p, ctx, Duration::ZERO).await,
        Scenario::BindBeforeServe => burst(p, ctx, p.serve_delay).await,
        Scenario::Churn => churn(p, ctx, None).await,
        Scenario::Restart => churn(p, ctx, Some(Signal::SIGTERM)).await,
        Scenario::RestartKill => churn(p, ctx, Some(Signal::SIGKILL)).await,
        Scenario::Storm => storm(p, ctx).await,
        Scenario::Crash => crash(p, ctx).await,
        Scenario::Handoff => handoff(p, ctx).await,
    }
}

/// How long the agent is watched after the last hand-off: every parent's exit reaches it in
/// milliseconds (its pidfd), so a false deregistration would land well within this.
const HANDOFF_WATCH: Duration = Duration::from_secs(2);

async fn handoff(p: &Params, ctx: &mut Ctx<'_>) -> anyhow::Result<()> {
    let exe = std::env::current_exe()
        .context("locating loadgen")?
        .with_file_name("example-plugin");
    let mut parents = Vec::new();
    let children = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    for _ in 0..p.count {
        let id = ctx.id();
        let socket = ctx.plugin_dir.join(crate::plugins::socket_name(id));
        let mut child = tokio::process::Command::new(&exe)
            .arg("--socket")
            .arg(&socket)
            .args(["--type", &ctx.announce.plugin_type])
            .args(["--name", &format!("loadgen-{id}")])
            .args(["--versions", &ctx.announce.versions.join(",")])
            .arg("--hand-off")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        let stdout = child.stdout.take().context("plugin stdout")?;
        tokio::spawn(follow_example_plugin(
            id,
            stdout,
            ctx.ledger.clone(),
            children.clone(),
        ));
        parents.push((id, socket, child));
    }
    let all = ctx
        .ledger
        .wait_for(p.timeout, |l| {
            parents
                .iter()
                .all(|(id, _, _)| l.plugins.get(id).is_some_and(|r| !r.notified.is_empty()))
        })
        .await;
    anyhow::ensure!(all, "not every plugin registered within {:?}", p.timeout);
    for (n, (_, _, parent)) in parents.iter_mut().enumerate() {
        if let Some(pid) = parent.id() {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            nix::sys::signal::kill(pid, Signal::SIGUSR1).context("SIGUSR1 a plugin")?;
        }
        parent.wait().await.context("waiting for a plugin's exit")?;
        ctx.progress.set("handoff", n as u64 + 1, p.count);
    }
    tokio::time::sleep(HANDOFF_WATCH).await;
    // Over: the children go, and their sockets with them. Every plugin stops serving at the
    // first kill (an agent that sees a child's exit at once deregisters its plugin before the
    // loop has reached the last kill, and that is not early).
    let stopped_ns = now_ns();
    for pid in children.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL);
    }
    for (id, socket, _) in &parents {
        let _ = std::fs::remove_file(socket);
        ctx.ledger.report(crate::plugins::Report::Stopped {
            id: *id,
            at_ns: stopped_ns,
        });
    }
    Ok(())
}

/// Turns an example plugin's event lines into ledger reports, and notes the child it hands off to.
async fn follow_example_plugin(
    id: u64,
    stdout: tokio::process::ChildStdout,
    ledger: SharedLedger,
    children: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
) {
    use tokio::io::AsyncBufReadExt as _;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    // The child a plugin hands off to prints its own `serving`: the plugin's first is the one.
    let mut served = false;
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        let at_ns = event["at_ns"].as_u64().unwrap_or_else(now_ns);
        match event["event"].as_str() {
            Some("serving") if !served => {
                served = true;
                ledger.report(crate::plugins::Report::Serving {
                    id,
                    bound_ns: at_ns,
                    serving_ns: at_ns,
                });
            }
            Some("notify") => ledger.report(crate::plugins::Report::Notified {
                id,
                registered: event["registered"].as_bool().unwrap_or(false),
                at_ns,
            }),
            Some("handed_off") => {
                if let Some(child) = event["child"].as_u64().and_then(|c| u32::try_from(c).ok()) {
                    children
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(child);
                }
            }
            _ => {}
        }
    }
}

/// How long a crashed plugin's deregistration is awaited before the next crash; once one is not
/// noticed at all (kubelet's way, the polling mode), the rest are not awaited.
const CRASH_NOTICE_BOUND: Duration = Duration::from_secs(2);

async fn crash(p: &Params, ctx: &mut Ctx<'_>) -> anyhow::Result<()> {
    let ids: Vec<u64> = (0..p.count).map(|_| ctx.id()).collect();
    for id in &ids {
        ctx.pool.start(*id, Duration::ZERO).await?;
    }
    ctx.pool.flush().await?;
    let all = ctx
        .ledger
        .wait_for(p.timeout, |l| {
            ids.iter()
                .all(|id| l.plugins.get(id).is_some_and(|r| !r.notified.is_empty()))
        })
        .await;
    anyhow::ensure!(all, "not every plugin registered within {:?}", p.timeout);
    let mut noticed = true;
    for (n, id) in ids.iter().enumerate() {
        ctx.ledger.report(crate::plugins::Report::Stopped {
            id: *id,
            at_ns: now_ns(),
        });
        ctx.pool.kill_worker_of(*id)?;
        if noticed {
            noticed = ctx
                .ledger
                .wait_for(CRASH_NOTICE_BOUND, |l| {
                    l.plugins
                        .get(id)
                        .is_some_and(|r| !r.deregistered_events.is_empty())
                })
                .await;
        }
        ctx.progress.set("crash", n as u64 + 1, p.count);
    }
    Ok(())
}

async fn sequential(p: &Params, ctx: &mut Ctx<'_>) -> anyhow::Result<()> {
    for i in 1..=p.count {
        let id = ctx.id();
        ctx.pool.start(id, Duration::ZERO).await?;
        ctx.pool.flush().await?;
        let done = ctx
            .ledger
            .wait_for(p.timeout, |l| {
                l.plugins.get(&id).is_some_and(|r| !r.notified.is_empty())
            })
            .await;
        anyhow::ensure!(
            done,
            "plugin {id} was not registered within {:?}",
            p.timeout
        );
        ctx.progress.set("sequential", i, p.count);
    }
    Ok(())
}

async fn burst(p: &Params, ctx: &mut Ctx<'_>, serve_delay: Duration) -> anyhow::Result<()> {
    for i in 1..=p.count {
        let id = ctx.id();
        ctx.pool.start(id, serve_delay).await?;
        // Hand work to the workers as it is produced, not all at the end.
        if i % 256 == 0 {
            ctx.pool.flush().await?;
            ctx.progress.set("creating", i, p.count);
        }
    }
    ctx.pool.flush().await
}

/// `restart`: the signal that stops the agent half-way (then started again), if any.
async fn churn(p: &Params, ctx: &mut Ctx<'_>, restart: Option<Signal>) -> anyhow::Result<()> {
    let rate = p.rate.max(0.001);
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    // Keep the rate: ticks missed while the process was busy are caught up.
    ticker.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let start = Instant::now();
    let end = start + p.duration;
    let total = (rate * p.duration.as_secs_f64()) as u64;
    let mut due: VecDeque<(Instant, u64)> = VecDeque::new();
    let mut restarting = None;
    let mut created = 0;
    loop {
        let now = ticker.tick().await;
        while due.front().is_some_and(|(at, _)| *at <= now) {
            if let Some((_, id)) = due.pop_front() {
                ctx.pool.stop(id).await?;
            }
        }
        if now < end {
            let id = ctx.id();
            ctx.pool.start(id, Duration::ZERO).await?;
            due.push_back((now + p.lifetime, id));
            created += 1;
        } else if due.is_empty() {
            break;
        }
        ctx.pool.flush().await?;
        // The floor (no agent) has nothing to restart: its survivors need nothing.
        if let Some(signal) = restart
            && restarting.is_none()
            && now >= start + p.duration / 2
            && let Some(agent) = ctx.agent.take()
        {
            restarting = Some(tokio::spawn(restart_agent(
                agent,
                ctx.ledger.clone(),
                signal,
            )));
        }
        if created % 100 == 0 {
            ctx.progress.set("churn", created.min(total), total);
        }
    }
    if let Some(task) = restarting {
        *ctx.agent = Some(task.await.context("restart task")??);
    }
    Ok(())
}

/// Stops the agent with `signal` and starts it again, keeping the ledger's up intervals, its
/// restart record and the admin stream's lifetime current.
async fn restart_agent(
    mut agent: AgentUnderTest,
    ledger: SharedLedger,
    signal: Signal,
) -> anyhow::Result<AgentUnderTest> {
    let signalled_ns = now_ns();
    if let Some(last) = ledger.lock().agent_up.last_mut() {
        last.1 = Some(signalled_ns);
    }
    let cpu_ms = |agent: &AgentUnderTest| {
        agent
            .pid()
            .and_then(|pid| crate::procfs::sample(pid).ok())
            .map_or(0, |s| s.cpu_ms())
    };
    let signalled_agent_cpu_ms = cpu_ms(&agent);
    let reaped_before = crate::procfs::reaped_children_cpu_ms();
    agent.stop_with(signal).await?;
    let stopped_agent_cpu_ms =
        crate::procfs::reaped_children_cpu_ms().saturating_sub(reaped_before);
    let spawned_ns = now_ns();
    agent.start().await?;
    let ready_ns = now_ns();
    let ready_agent_cpu_ms = cpu_ms(&agent);
    {
        let mut ledger = ledger.lock();
        ledger.lifetime += 1;
        ledger.restarts.push(Restart {
            signalled_ns,
            spawned_ns,
            ready_ns,
            phases: None,
            stopped_agent_cpu_ms,
            signalled_agent_cpu_ms,
            ready_agent_cpu_ms,
        });
    }
    admin::follow(&agent.admin_socket, ledger.clone()).await?;
    if let Some(phases) = agent.start_phases() {
        let ledger = ledger.clone();
        tokio::spawn(async move {
            if let Ok(phases) = phases.await
                && let Some(restart) = ledger.lock().restarts.last_mut()
            {
                restart.phases = Some(phases);
            }
        });
    }
    ledger.lock().agent_up.push((now_ns(), None));
    Ok(agent)
}

/// Non-plugin sockets: bound (datagram: no listener, never a plugin) and unlinked at once.
fn noise_path(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("noise-{n}.sock"))
}

async fn storm(p: &Params, ctx: &mut Ctx<'_>) -> anyhow::Result<()> {
    let pairs = p.noise_pairs.max(1);
    let every = (pairs / p.count.max(1)).max(1);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<u64>(1024);
    let dir = ctx.plugin_dir.to_path_buf();
    let count = p.count;
    // Full speed: a blocking thread doing nothing but bind + unlink, asking for a real plugin
    // every `every` pairs.
    let noise = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let mut real = 0;
        for n in 0..pairs {
            let path = noise_path(&dir, n);
            let socket = std::os::unix::net::UnixDatagram::bind(&path)
                .with_context(|| format!("binding {}", path.display()))?;
            std::fs::remove_file(&path)?;
            drop(socket);
            if n % every == every / 2 && real < count {
                real += 1;
                if tx.blocking_send(n).is_err() {
                    break;
                }
            }
        }
        Ok(())
    });
    let mut started = 0;
    while let Some(n) = rx.recv().await {
        let id = ctx.id();
        ctx.pool.start(id, Duration::ZERO).await?;
        ctx.pool.flush().await?;
        started += 1;
        ctx.progress.set("storm", n, pairs);
    }
    noise.await.context("noise thread")??;
    while started < p.count {
        let id = ctx.id();
        ctx.pool.start(id, Duration::ZERO).await?;
        started += 1;
    }
    ctx.pool.flush().await
}
