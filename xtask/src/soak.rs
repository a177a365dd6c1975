//! `cargo xtask soak`: a bounded soak of the real agent under churn and injected faults, ending
//! with the two numbers that matter: plugins lost (must be 0) and memory (must be flat).
//!
//! ```text
//! plugin-host (N DRA plugins, churning R/s) --+
//! bad plugins (hang, lie), noise files -------+--> registry dir <-- plugin-agent --> dra-handler
//! faults, round robin every --fault-every:        (SIGKILL+restart    (SIGKILL+restart)
//!   agent SIGKILL/restart (first half only), handler SIGKILL/restart, a hung plugin or a flood
//!   of 300 half-sent requests to the metrics port from uid 65534 (in turn), a lying plugin,
//!   noise in turn: 500 files, a tree 1,000 directories deep, 1,000 directories, 300 stale sockets,
//!   5 s of a bind/unlink flood
//! RSS of the agent sampled from /proc every second: never above 64 MiB, flat in the second half
//! end: churn paused, bad plugins stopped -> `plugin-agent list` must equal the live sockets,
//!      all registered
//! ```
//!
//! Agent kills happen in the first half only, so the second half measures the memory of one
//! agent under the same churn and other faults: flat means its RSS at the end is within 16 MiB
//! of its RSS at the start of that half. Logs of every process are kept in the run directory.

use crate::processes::{Guard, Run, rss_kib, target_dir};
use crate::{build, build_ebpf};
use anyhow::{Context, bail};
use std::collections::BTreeSet;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Options for the soak.
#[derive(clap::Args)]
pub struct Options {
    /// How long to churn (at most 10 minutes).
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub duration: Duration,
    /// Event source for the agent.
    #[arg(long, default_value = "auto")]
    pub source: String,
    /// Plugins served at any time.
    #[arg(long, default_value_t = 200)]
    pub plugins: usize,
    /// Plugins replaced per second.
    #[arg(long, default_value_t = 20.0)]
    pub churn: f64,
    /// Seconds between injected faults.
    #[arg(long, default_value_t = 10)]
    pub fault_every: u64,
}

/// `90s`, `5m`, `1m30s`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let mut total = 0u64;
    let mut number = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            number.push(c);
            continue;
        }
        let n: u64 = number
            .parse()
            .map_err(|_| format!("bad duration {text:?}"))?;
        number.clear();
        total += match c {
            's' => n,
            'm' => n * 60,
            'h' => n * 3600,
            _ => return Err(format!("bad unit {c:?} in {text:?}")),
        };
    }
    if !number.is_empty() {
        total += number
            .parse::<u64>()
            .map_err(|_| format!("bad duration {text:?}"))?;
    }
    Ok(Duration::from_secs(total))
}

/// The plugin host: its stdin for commands, and the `live` answers its reader thread passes on.
struct Host {
    guard: Guard,
    stdin: ChildStdin,
    live: mpsc::Receiver<Vec<PathBuf>>,
}

impl Host {
    fn start(run: &Run, count: usize) -> anyhow::Result<Host> {
        let mut child = Command::new(run.bin.join("plugin-host"))
            .arg("--dir")
            .arg(&run.registry)
            .args(["--count", &count.to_string()])
            .args(["--type", "DRAPlugin", "--versions", "v1.DRAPlugin"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(run.log("plugin-host.log")?)
            .spawn()
            .context("starting plugin-host")?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = child.stdout.take().context("stdout")?;
        let (tx, live) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if value["event"] == "live" {
                    let sockets = value["sockets"]
                        .as_array()
                        .map(|a| {
                            a.iter()
                                .filter_map(|s| s.as_str().map(PathBuf::from))
                                .collect()
                        })
                        .unwrap_or_default();
                    let _ = tx.send(sockets);
                }
            }
        });
        Ok(Host {
            guard: Guard(child),
            stdin,
            live,
        })
    }

    fn command(&mut self, line: &str) -> anyhow::Result<()> {
        writeln!(self.stdin, "{line}")?;
        Ok(self.stdin.flush()?)
    }
}

/// RSS samples of one agent instance.
#[derive(Default)]
struct Memory {
    start: Option<u64>,
    end: u64,
    max: u64,
}

impl Memory {
    fn sample(&mut self, kib: u64) {
        self.start.get_or_insert(kib);
        self.end = kib;
        self.max = self.max.max(kib);
    }
}

/// Builds the agent and test binaries (with the eBPF object when it has been built), then soaks.
pub fn soak(options: &Options) -> anyhow::Result<()> {
    if options.duration > Duration::from_secs(600) {
        bail!("--duration is at most 10 minutes");
    }
    let object = build_ebpf::object_path(true);
    let object = object.is_file().then_some(object.as_path());
    if object.is_none() {
        eprintln!(
            "xtask: soak: no eBPF object (cargo xtask build-ebpf): --source auto will not use eBPF"
        );
    }
    build::agent_and_test_bins(object, false)?;

    let dir = std::env::temp_dir().join(format!("plugin-agent-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let run = Run::new(target_dir().join("debug"), dir.clone(), &options.source)?;
    eprintln!(
        "xtask: soak: {:?} in {} (logs there)",
        options.duration,
        dir.display()
    );
    let result = soak_in(&run, options);
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn soak_in(run: &Run, options: &Options) -> anyhow::Result<()> {
    let mut churn = Churn::start(run)?;
    let mut host = Host::start(run, options.plugins)?;
    host.command(&format!("churn {}", options.churn))?;
    churn.run(options)?;

    eprintln!(
        "xtask: soak: churn paused; stopping misbehaving plugins, removing noise, checking convergence"
    );
    host.command("pause")?;
    let live: BTreeSet<PathBuf> = host
        .live
        .recv_timeout(Duration::from_secs(30))
        .context("plugin-host did not list its live plugins")?
        .into_iter()
        .collect();
    for mut b in churn.bad.drain(..) {
        b.terminate();
    }
    // The last noise round's stale sockets are sockets in the tree, listed (and failing) as
    // they should be: gone with their directory before the end state is compared.
    let _ = std::fs::remove_dir_all(run.registry.join(format!("noise-{}", churn.noise_round)));
    let end = converge(run, live);
    if let Some(kib) = rss_kib(churn.agent.pid()) {
        churn.last_memory.sample(kib);
    }
    let verdict = report(options, &churn, &end);
    let Host {
        mut guard, stdin, ..
    } = host;
    drop(stdin);
    guard.terminate();
    if !verdict.missing.is_empty() || !verdict.extra.is_empty() {
        bail!(
            "plugins lost: missing {:?}, extra {:?} (logs in {})",
            verdict.missing,
            verdict.extra,
            run.dir.display()
        );
    }
    if !verdict.flat {
        bail!(
            "agent memory grew by {:.1} MiB in the second half",
            verdict.growth_kib as f64 / 1024.0
        );
    }
    if verdict.max_kib > RSS_CEILING_KIB {
        bail!(
            "agent RSS reached {:.1} MiB, above the {} MiB ceiling",
            verdict.max_kib as f64 / 1024.0,
            RSS_CEILING_KIB / 1024
        );
    }
    Ok(())
}

/// The churn phase: the agent and handler it kills and restarts, the misbehaving plugins it
/// starts, the noise it writes, and the agent's memory it samples meanwhile.
struct Churn<'a> {
    run: &'a Run,
    agent: Guard,
    handler: Guard,
    bad: Vec<Guard>,
    /// Faults injected, by kind: agent kill, handler kill, hung plugin, lying plugin, noise.
    counts: [usize; 5],
    fault: usize,
    noise_round: usize,
    agent_restarts: usize,
    /// Of the hung-plugin faults (kind 2), every other one is a flood of the metrics port.
    floods: usize,
    first_memory: Memory,
    last_memory: Memory,
}

impl<'a> Churn<'a> {
    /// Starts the handler and the agent.
    fn start(run: &'a Run) -> anyhow::Result<Churn<'a>> {
        let handler = run.start_handler()?;
        let agent = run.start_agent()?;
        Ok(Churn {
            run,
            agent,
            handler,
            bad: Vec::new(),
            counts: [0; 5],
            fault: 0,
            noise_round: 0,
            agent_restarts: 0,
            floods: 0,
            first_memory: Memory::default(),
            last_memory: Memory::default(),
        })
    }

    /// Injects a fault every `--fault-every` and samples memory every second, for `--duration`.
    fn run(&mut self, options: &Options) -> anyhow::Result<()> {
        let started = Instant::now();
        let half = options.duration / 2;
        let fault_every = Duration::from_secs(options.fault_every.max(1));
        let mut next_fault = started + fault_every;
        let mut last_sample = Instant::now();
        while started.elapsed() < options.duration {
            std::thread::sleep(Duration::from_millis(250));
            if last_sample.elapsed() >= Duration::from_secs(1) {
                last_sample = Instant::now();
                self.sample_memory(started.elapsed() >= half);
            }
            if Instant::now() < next_fault {
                continue;
            }
            next_fault += fault_every;
            let mut kind = self.fault % 5;
            self.fault += 1;
            if kind == 0 && started.elapsed() + fault_every >= half {
                kind = 4; // no agent kills in the memory half: noise instead
            }
            self.counts[kind] += 1;
            self.inject(kind, started.elapsed())?;
            // Keep at most a few misbehaving plugins alive: each holds a failed entry.
            while self.bad.len() > 4 {
                self.bad.remove(0).terminate();
            }
        }
        Ok(())
    }

    /// Samples the agent's RSS: into the first instance's record until it is first restarted,
    /// and into the second half's record once `second_half`.
    fn sample_memory(&mut self, second_half: bool) {
        if let Some(kib) = rss_kib(self.agent.pid()) {
            if self.agent_restarts == 0 {
                self.first_memory.sample(kib);
            }
            if second_half {
                self.last_memory.sample(kib);
            }
        }
    }

    /// Injects one fault of `kind` (see [`Churn::counts`]).
    fn inject(&mut self, kind: usize, elapsed: Duration) -> anyhow::Result<()> {
        let run = self.run;
        let fault = self.fault;
        match kind {
            0 => {
                eprintln!(
                    "xtask: soak: {:>4}s SIGKILL the agent, start it again",
                    elapsed.as_secs()
                );
                self.agent.kill();
                self.agent = run.start_agent()?;
                self.agent_restarts += 1;
            }
            1 => {
                eprintln!(
                    "xtask: soak: {:>4}s SIGKILL the handler, start it again",
                    elapsed.as_secs()
                );
                self.handler.kill();
                self.handler = run.start_handler()?;
            }
            2 if (fault / 5).is_multiple_of(2) => {
                eprintln!(
                    "xtask: soak: {:>4}s 300 slow connections to the metrics port",
                    elapsed.as_secs()
                );
                self.bad.push(run.start_flood(300, Stdio::null())?);
                self.floods += 1;
            }
            2 => {
                self.bad.push(
                    run.start_bad_plugin(&format!("hang-{fault}.sock"), &["--get-info-hang"])?,
                );
            }
            3 => {
                let lie: &[&str] = match fault % 3 {
                    0 => &["--huge-name-bytes", "1000000"],
                    1 => &["--versions-count", "5000"],
                    _ => &["--mode", "non-grpc"],
                };
                self.bad
                    .push(run.start_bad_plugin(&format!("lie-{fault}.sock"), lie)?);
            }
            _ => {
                let old = run.registry.join(format!("noise-{}", self.noise_round));
                let _ = std::fs::remove_dir_all(&old);
                self.noise_round += 1;
                let new = run.registry.join(format!("noise-{}", self.noise_round));
                std::fs::create_dir_all(&new)?;
                let noise = Noise::ALL[self.noise_round % Noise::ALL.len()];
                eprintln!(
                    "xtask: soak: {:>4}s noise: {}",
                    elapsed.as_secs(),
                    noise.describe()
                );
                noise.make(&new)?;
            }
        }
        Ok(())
    }
}

/// What a noise round leaves in the registry: nothing a plugin, all of it work for the agent.
#[derive(Clone, Copy)]
enum Noise {
    /// 500 regular files.
    Files,
    /// A chain of 1,000 nested directories.
    DeepTree,
    /// 1,000 sibling directories.
    ManyDirs,
    /// 300 sockets bound and closed, like plugins that crashed.
    StaleSockets,
    /// Two threads binding and unlinking sockets as fast as they can for 5 s.
    SocketFlood,
}

impl Noise {
    const ALL: [Noise; 5] = [
        Noise::Files,
        Noise::DeepTree,
        Noise::ManyDirs,
        Noise::StaleSockets,
        Noise::SocketFlood,
    ];

    fn describe(self) -> &'static str {
        match self {
            Noise::Files => "500 files",
            Noise::DeepTree => "a tree 1,000 directories deep",
            Noise::ManyDirs => "1,000 directories",
            Noise::StaleSockets => "300 stale sockets",
            Noise::SocketFlood => "5 s of sockets bound and unlinked by 2 threads",
        }
    }

    fn make(self, dir: &std::path::Path) -> anyhow::Result<()> {
        match self {
            Noise::Files => {
                for i in 0..500 {
                    std::fs::write(dir.join(format!("f{i}")), b"noise")?;
                }
            }
            Noise::DeepTree => {
                let mut path = dir.to_path_buf();
                for _ in 0..1000 {
                    path.push("d");
                    std::fs::create_dir(&path)?;
                }
            }
            Noise::ManyDirs => {
                for i in 0..1000 {
                    std::fs::create_dir(dir.join(format!("d{i}")))?;
                }
            }
            Noise::StaleSockets => {
                for i in 0..300 {
                    // Closed when dropped: the file stays and refuses connections.
                    drop(std::os::unix::net::UnixListener::bind(
                        dir.join(format!("stale-{i}.sock")),
                    )?);
                }
            }
            Noise::SocketFlood => {
                for t in 0..2 {
                    let base = dir.join(format!("flood-{t}"));
                    // Ends by itself; a round that removes the directory meanwhile only makes
                    // its binds fail.
                    std::thread::spawn(move || {
                        let started = Instant::now();
                        let mut made = 0u64;
                        while started.elapsed() < Duration::from_secs(5) {
                            let path = base.with_extension(format!("{}.sock", made % 64));
                            drop(std::os::unix::net::UnixListener::bind(&path));
                            let _ = std::fs::remove_file(&path);
                            made += 1;
                        }
                    });
                }
            }
        }
        Ok(())
    }
}

/// What the agent lists once churn stopped, against the plugins alive then.
struct End {
    live: BTreeSet<PathBuf>,
    listed: BTreeSet<PathBuf>,
    registered: BTreeSet<PathBuf>,
    converged_in: Duration,
}

/// Waits (at most 2 minutes) until the agent lists exactly the live plugins, all registered.
fn converge(run: &Run, live: BTreeSet<PathBuf>) -> End {
    let converging = Instant::now();
    let deadline = converging + Duration::from_secs(120);
    let (listed, registered) = loop {
        let entries = run.list().unwrap_or_default();
        let listed: BTreeSet<PathBuf> = entries.iter().map(|(p, _)| p.clone()).collect();
        let registered: BTreeSet<PathBuf> = entries
            .iter()
            .filter(|(_, s)| s == "registered")
            .map(|(p, _)| p.clone())
            .collect();
        if (listed == live && registered == live) || Instant::now() > deadline {
            break (listed, registered);
        }
        // Polling the operator API is this harness's convergence check (an operator's view).
        std::thread::sleep(Duration::from_millis(500));
    };
    End {
        live,
        listed,
        registered,
        converged_in: converging.elapsed(),
    }
}

/// The soak's verdict: plugins missing or extra at the end, the second half's memory growth, and
/// the highest RSS either instance reached.
struct Verdict {
    missing: Vec<PathBuf>,
    extra: Vec<PathBuf>,
    growth_kib: i64,
    flat: bool,
    max_kib: u64,
}

/// The most the agent may ever be resident (issue 22: the DaemonSet's limit is 128 MiB; the
/// agent stays within half of it under every fault the soak injects).
const RSS_CEILING_KIB: u64 = 64 * 1024;

/// Prints the faults, the end state and the memory, and returns the verdict.
fn report(options: &Options, churn: &Churn, end: &End) -> Verdict {
    let missing: Vec<PathBuf> = end.live.difference(&end.registered).cloned().collect();
    let extra: Vec<PathBuf> = end.listed.difference(&end.live).cloned().collect();
    let mib = |kib: u64| kib as f64 / 1024.0;
    let (first_memory, last_memory, counts, floods) = (
        &churn.first_memory,
        &churn.last_memory,
        churn.counts,
        churn.floods,
    );
    let growth = last_memory.end as i64 - last_memory.start.unwrap_or(0) as i64;
    let flat = growth < 16 * 1024;
    println!(
        "soak: {:?}, source {}, {} plugins, churn {}/s",
        options.duration, options.source, options.plugins, options.churn
    );
    println!(
        "faults: {} agent SIGKILL+restart, {} handler SIGKILL+restart, {} hung plugins, {} metrics floods (300 slow connections), {} lying plugins, {} noise rounds (files, deep tree, directories, stale sockets, socket flood in turn)",
        counts[0],
        counts[1],
        counts[2] - floods,
        floods,
        counts[3],
        counts[4]
    );
    println!(
        "end: {} live plugins, {} listed, {} registered, {} missing, {} extra; converged {:.1}s after churn stopped",
        end.live.len(),
        end.listed.len(),
        end.registered.len(),
        missing.len(),
        extra.len(),
        end.converged_in.as_secs_f64()
    );
    println!(
        "agent RSS, first instance: start {:.1} MiB, end {:.1} MiB, max {:.1} MiB",
        mib(first_memory.start.unwrap_or(0)),
        mib(first_memory.end),
        mib(first_memory.max)
    );
    println!(
        "agent RSS, second half (one instance): start {:.1} MiB, end {:.1} MiB, max {:.1} MiB, growth {:+.1} MiB ({})",
        mib(last_memory.start.unwrap_or(0)),
        mib(last_memory.end),
        mib(last_memory.max),
        growth as f64 / 1024.0,
        if flat { "flat" } else { "GROWING" }
    );
    Verdict {
        missing,
        extra,
        growth_kib: growth,
        flat,
        max_kib: first_memory.max.max(last_memory.max),
    }
}
