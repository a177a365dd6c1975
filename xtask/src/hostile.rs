//! `cargo xtask hostile`: the hostile-node cases of issues 22 and 44, one at a time, against the
//! release agent on each event source, each ending with the figures the issue's targets name.
//!
//! ```text
//! per case and source: fresh directory, dra-handler, agent (release), one live plugin registered
//!   -> the attack starts (directories, a bind/unlink flood, stale sockets, a metrics flood, ...)
//!   -> a canary plugin starts; its own clock times listen() -> Notify(true)
//!   -> the live plugin must still be registered, never deregistered
//!   -> a partial HTTP request and an idle admin connection are left open; SIGTERM timed to exit
//!   -> the agent's peak RSS (VmHWM)
//! ```
//!
//! The targets (issue 22): the canary registered within 50 ms (eBPF, fanotify) or 100 ms
//! (inotify), no live plugin deregistered, SIGTERM done within 5 s, RSS at most 64 MiB. A row
//! that misses one says so; the command fails if any does. The soak (`cargo xtask soak`) mixes
//! the same faults into churn for minutes; this runs each alone so its figure is its own.

mod cases;

use crate::processes::{Guard, Run, rss_kib, target_dir};
use crate::{build, build_ebpf, shell};
use anyhow::{Context, bail};
use cases::Case;
use std::io::{BufRead, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Options for the hostile cases.
#[derive(clap::Args)]
pub struct Options {
    /// Event sources to run every case on, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "ebpf,fanotify,inotify")]
    pub sources: Vec<String>,
    /// Cases to run, comma separated (default: all): dirs, flood, stale, metrics, deep, mount,
    /// pins, names.
    #[arg(long, value_delimiter = ',')]
    pub cases: Vec<String>,
}

/// Where one case's processes and files are.
struct Setup {
    run: Run,
}

impl std::ops::Deref for Setup {
    type Target = Run;
    fn deref(&self) -> &Run {
        &self.run
    }
}

impl Setup {
    fn new(bin: &Path, base: &Path, case: Case, source: &str) -> anyhow::Result<Setup> {
        let dir = base.join(format!("{}-{source}", case.name()));
        std::fs::create_dir_all(&dir)?;
        Ok(Setup {
            run: Run::new(bin.to_path_buf(), dir, source)?,
        })
    }

    /// Waits (at most 30 s) for `/readyz` to answer 200.
    fn wait_ready(&self, agent: &mut Guard) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok((200, _)) = http_get(self.metrics, "/readyz") {
                return Ok(());
            }
            if let Ok(Some(status)) = agent.0.try_wait() {
                bail!(
                    "the agent exited ({status}) before it was ready; log: {}",
                    self.dir.join("agent.log").display()
                );
            }
            if Instant::now() > deadline {
                bail!("the agent was not ready within 30 s");
            }
            // The harness polls the agent's readiness endpoint, as a kubelet probe does.
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A plugin of `name` at `socket`, its events read on a thread.
    fn start_plugin(&self, socket: &Path, name: &str) -> anyhow::Result<Plugin> {
        let mut child = Command::new(self.bin.join("example-plugin"))
            .arg("--socket")
            .arg(socket)
            .args([
                "--type",
                "DRAPlugin",
                "--versions",
                "v1.DRAPlugin",
                "--name",
            ])
            .arg(name)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(self.log("plugins.log")?)
            .spawn()
            .context("starting example-plugin")?;
        let stdout = child.stdout.take().context("stdout")?;
        let (tx, events) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(value) = serde_json::from_str::<serde_json::Value>(&line)
                    && tx.send(value).is_err()
                {
                    break;
                }
            }
        });
        Ok(Plugin {
            _guard: Guard(child),
            events,
            listening_ns: None,
        })
    }

    /// The state `plugin-agent list` gives the entry at `socket`.
    fn listed_state(&self, socket: &Path) -> Option<String> {
        self.list()?
            .into_iter()
            .find(|(path, _)| path == socket)
            .map(|(_, state)| state)
    }

    /// Deregistrations of `name` the handler answered.
    fn deregistrations_of(&self, name: &str) -> usize {
        let log = std::fs::read_to_string(self.dir.join("handler.log")).unwrap_or_default();
        log.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["call"] == "deregister" && v["name"] == name)
            .count()
    }
}

/// A running example plugin and what it printed.
struct Plugin {
    _guard: Guard,
    events: mpsc::Receiver<serde_json::Value>,
    listening_ns: Option<u64>,
}

impl Plugin {
    /// Waits for `Notify(true)`; returns the time from the plugin's `listen()` to it, by the
    /// plugin's own clock.
    fn registered_after_listen(&mut self, within: Duration) -> anyhow::Result<Duration> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let event = self
                .events
                .recv_timeout(left)
                .map_err(|_| anyhow::anyhow!("not registered within {within:?}"))?;
            let at_ns = event["at_ns"].as_u64().unwrap_or_default();
            match event["event"].as_str() {
                Some("listening") => self.listening_ns = Some(at_ns),
                Some("notify") if event["registered"] == true => {
                    let listening = self.listening_ns.context("notified before listening")?;
                    return Ok(Duration::from_nanos(at_ns.saturating_sub(listening)));
                }
                _ => {}
            }
        }
    }
}

/// `GET path` on `addr` with a 5 s limit: the status code and how long the answer took.
fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, Duration)> {
    let started = Instant::now();
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head)?;
    let code = std::str::from_utf8(&head[9..12])
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, started.elapsed()))
}

/// What keeps an attack going; stopped (threads joined, processes killed) when dropped.
#[derive(Default)]
struct Attack {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    processes: Vec<Guard>,
    listeners: Vec<std::os::unix::net::UnixListener>,
    /// A mount point to unmount at the end.
    mount: Option<PathBuf>,
    /// What the attack itself measured, for the row's note.
    note: String,
    /// The attack runs at least until then before the agent is stopped and measured.
    until: Option<Instant>,
}

impl Drop for Attack {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for listener in &self.listeners {
            // SAFETY: shutdown(2) on a descriptor this struct owns; it wakes the blocked accept.
            unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR) };
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        if let Some(mount) = &self.mount
            && !Command::new("umount")
                .arg(mount)
                .status()
                .is_ok_and(|s| s.success())
        {
            let _ = Command::new("umount").arg("-l").arg(mount).status();
        }
    }
}

/// Starts `case`'s attack on the agent of `setup`.
fn attack(case: Case, setup: &Setup) -> anyhow::Result<Attack> {
    let mut attack = Attack::default();
    let registry = &setup.registry;
    match case {
        Case::Dirs => {
            let dirs = registry.join("dirs");
            std::fs::create_dir(&dirs)?;
            for i in 0..1000 {
                std::fs::create_dir(dirs.join(format!("d{i}")))?;
            }
        }
        Case::Flood => flood(registry, &mut attack)?,
        Case::Stale => stale(registry, &mut attack)?,
        Case::Metrics => {
            // From uid 65534 (the case runs as root): an unprivileged process on the node.
            let mut flood = setup.start_flood(1000, Stdio::piped())?;
            let stdout = flood.0.stdout.take().context("stdout")?;
            attack.processes.push(flood);
            let mut line = String::new();
            std::io::BufReader::new(stdout).read_line(&mut line)?;
            let scrape = http_get(setup.metrics, "/metrics");
            attack.note = match scrape {
                Ok((code, took)) => format!("scrape during it: {code} in {took:.1?}"),
                Err(e) => format!("scrape during it: {e}"),
            };
        }
        Case::Deep => {
            deep_tree(&registry.join("deep"), 2039)?;
            // Twenty safety passes over it.
            std::thread::sleep(Duration::from_secs(20));
        }
        Case::Mount => {
            let sub = registry.join("mnt");
            std::fs::create_dir(&sub)?;
            shell::run(
                Command::new("mount")
                    .args(["-t", "tmpfs", "hostile"])
                    .arg(&sub),
            )?;
            attack.mount = Some(sub);
        }
        Case::Pins => {
            let other = setup.dir.join("other-instance");
            std::fs::create_dir_all(&other)?;
            shell::run(
                Command::new(setup.bin.join("plugin-agent"))
                    .arg("--admin-socket")
                    .arg(other.join("admin.sock"))
                    .args(["cleanup", "--all", "--force"]),
            )?;
        }
        Case::Names => {
            let names = registry.join("names");
            std::fs::create_dir(&names)?;
            for i in 0..17_000 {
                drop(std::os::unix::net::UnixListener::bind(
                    names.join(format!("n{i}.sock")),
                )?);
            }
            // The quiet the issue measured the rescans in.
            std::thread::sleep(Duration::from_secs(30));
        }
    }
    Ok(attack)
}

/// [`Case::Flood`]: two threads binding and removing sockets as fast as they can, for 30 s; the
/// canary starts 5 s into it.
fn flood(registry: &Path, attack: &mut Attack) -> anyhow::Result<()> {
    let flood = registry.join("flood");
    std::fs::create_dir(&flood)?;
    for t in 0..2 {
        let stop = attack.stop.clone();
        let base = flood.join(format!("f{t}"));
        attack.threads.push(std::thread::spawn(move || {
            let mut made = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let path = base.with_extension(format!("{}.sock", made % 64));
                let _ = std::fs::remove_file(&path);
                drop(std::os::unix::net::UnixListener::bind(&path));
                let _ = std::fs::remove_file(&path);
                made += 1;
            }
        }));
    }
    // The canary starts 5 s into a flood of 30 s, as in the issue's report.
    attack.until = Some(Instant::now() + Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(5));
    Ok(())
}

/// [`Case::Stale`]: 1,000 sockets nobody listens on and 300 whose listener accepts and closes.
fn stale(registry: &Path, attack: &mut Attack) -> anyhow::Result<()> {
    let stale = registry.join("stale");
    std::fs::create_dir(&stale)?;
    for i in 0..1000 {
        drop(std::os::unix::net::UnixListener::bind(
            stale.join(format!("s{i}.sock")),
        )?);
    }
    for i in 0..300 {
        let listener = std::os::unix::net::UnixListener::bind(stale.join(format!("h{i}.sock")))?;
        let accepting = listener.try_clone()?;
        attack.listeners.push(listener);
        let stop = attack.stop.clone();
        attack.threads.push(std::thread::spawn(move || {
            while let Ok((stream, _)) = accepting.accept() {
                drop(stream);
                if stop.load(Ordering::Relaxed) {
                    break;
                }
            }
        }));
    }
    Ok(())
}

/// A chain of `depth` directories under `top`, made relative to the last one (its full path
/// is longer than PATH_MAX, which no path-taking call accepts).
fn deep_tree(top: &Path, depth: usize) -> anyhow::Result<()> {
    std::fs::create_dir(top)?;
    let mut parent = std::fs::File::open(top)?;
    for _ in 1..depth {
        // SAFETY: mkdirat(2) with a descriptor we own and a NUL-terminated name.
        if unsafe { libc::mkdirat(parent.as_raw_fd(), c"d".as_ptr(), 0o755) } != 0 {
            return Err(std::io::Error::last_os_error()).context("mkdirat");
        }
        // SAFETY: openat(2) likewise; the descriptor returned is owned by the File below.
        let fd = unsafe {
            libc::openat(
                parent.as_raw_fd(),
                c"d".as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("openat");
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        parent = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    }
    Ok(())
}

/// One case on one source, measured.
struct Row {
    case: Case,
    source: String,
    registered: Result<Duration, String>,
    live_deregistered: usize,
    live_state: String,
    sigterm: Duration,
    peak_kib: u64,
    note: String,
}

impl Row {
    fn target(&self) -> Duration {
        if self.source == "inotify" {
            Duration::from_millis(100)
        } else {
            Duration::from_millis(50)
        }
    }

    /// The targets this row misses.
    fn misses(&self) -> Vec<String> {
        let mut misses = Vec::new();
        match &self.registered {
            Ok(took) if *took <= self.target() => {}
            Ok(took) => misses.push(format!("registered in {took:.1?} > {:?}", self.target())),
            Err(e) => misses.push(format!("canary: {e}")),
        }
        if self.live_deregistered > 0 || self.live_state != "registered" {
            misses.push(format!(
                "live plugin {} ({} deregistrations)",
                self.live_state, self.live_deregistered
            ));
        }
        if self.sigterm > Duration::from_secs(5) {
            misses.push(format!("SIGTERM took {:.1?}", self.sigterm));
        }
        if self.peak_kib > 64 * 1024 {
            misses.push(format!("peak RSS {} MiB", self.peak_kib / 1024));
        }
        misses
    }
}

/// VmHWM of `pid` in KiB.
fn peak_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .or_else(|| rss_kib(pid))
        .unwrap_or(0)
}

fn run_case(bin: &Path, base: &Path, case: Case, source: &str) -> anyhow::Result<Row> {
    let setup = Setup::new(bin, base, case, source)?;
    let _handler = setup.start_handler()?;
    let mut agent = setup.start_agent_with(case.agent_flags())?;
    setup.wait_ready(&mut agent)?;
    let live_socket = setup.registry.join("live.sock");
    let mut live = setup.start_plugin(&live_socket, "live.example.com")?;
    live.registered_after_listen(Duration::from_secs(30))
        .context("the live plugin did not register before the attack")?;

    let attack = attack(case, &setup)?;
    let canary_socket = match case {
        Case::Mount => setup.registry.join("mnt/canary.sock"),
        _ => setup.registry.join("canary.sock"),
    };
    let mut canary = setup.start_plugin(&canary_socket, "canary.example.com")?;
    let registered = canary
        .registered_after_listen(Duration::from_secs(60))
        .map_err(|e| format!("{e:#}"));
    let live_state = setup
        .listed_state(&live_socket)
        .unwrap_or_else(|| "not listed".into());
    let live_deregistered = setup.deregistrations_of("live.example.com");

    if let Some(until) = attack.until {
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
    }
    // One partial request and one idle admin connection held open across SIGTERM.
    let mut partial = std::net::TcpStream::connect(setup.metrics)?;
    partial.write_all(b"GET /metrics HTTP/1.1\r\n")?;
    let _idle_admin = std::os::unix::net::UnixStream::connect(&setup.admin)?;
    let peak_kib = peak_kib(agent.pid());
    let terminating = Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(agent.pid() as i32, libc::SIGTERM) };
    let _ = agent.0.wait();
    let sigterm = terminating.elapsed();
    let note = attack.note.clone();
    // The plugins first: the canary of the mount case keeps its file system busy.
    drop(canary);
    drop(live);
    drop(attack);
    Ok(Row {
        case,
        source: source.to_string(),
        registered,
        live_deregistered,
        live_state,
        sigterm,
        peak_kib,
        note,
    })
}

/// Builds the release agent and test binaries, then runs every chosen case on every source.
pub fn hostile(options: &Options) -> anyhow::Result<()> {
    let cases: Vec<Case> = if options.cases.is_empty() {
        Case::ALL.to_vec()
    } else {
        options
            .cases
            .iter()
            .map(|name| {
                Case::ALL
                    .into_iter()
                    .find(|c| c.name() == name)
                    .with_context(|| format!("no case {name:?}"))
            })
            .collect::<anyhow::Result<_>>()?
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the hostile cases need root (eBPF, fanotify, mounts, uid 65534)");
    }
    let object = build_ebpf::object_path(true);
    let object = object.is_file().then_some(object.as_path());
    if object.is_none() && options.sources.iter().any(|s| s == "ebpf") {
        bail!("no eBPF object: run `cargo xtask build-ebpf` first");
    }
    build::agent_and_test_bins(object, true)?;
    let bin = target_dir().join("release");
    let base = std::env::temp_dir().join(format!("plugin-agent-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&base)?;
    let mut rows = Vec::new();
    for &case in &cases {
        for source in &options.sources {
            eprintln!("xtask: hostile: {} on {source}", case.describe());
            let row = run_case(&bin, &base, case, source)
                .with_context(|| format!("case {} on {source}", case.name()))?;
            rows.push(row);
        }
    }
    let missed = report(&rows);
    if missed {
        bail!("targets missed (logs in {})", base.display());
    }
    let _ = std::fs::remove_dir_all(&base);
    Ok(())
}

/// Prints the table; returns whether any row missed a target.
fn report(rows: &[Row]) -> bool {
    println!(
        "| case | source | canary registered (listen -> Notify) | live plugin | SIGTERM | peak RSS MiB | before (issue 22) | notes |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut missed = false;
    for row in rows {
        let misses = row.misses();
        missed |= !misses.is_empty();
        let registered = match &row.registered {
            Ok(took) => format!("{:.1} ms", took.as_secs_f64() * 1000.0),
            Err(e) => e.clone(),
        };
        let mut notes = row.note.clone();
        if !misses.is_empty() {
            if !notes.is_empty() {
                notes.push_str("; ");
            }
            notes.push_str(&format!("MISSED: {}", misses.join(", ")));
        }
        println!(
            "| {} | {} | {registered} | {}, {} deregistrations | {:.0} ms | {:.1} | {} | {notes} |",
            row.case.describe(),
            row.source,
            row.live_state,
            row.live_deregistered,
            row.sigterm.as_secs_f64() * 1000.0,
            row.peak_kib as f64 / 1024.0,
            row.case.before(),
        );
    }
    missed
}
