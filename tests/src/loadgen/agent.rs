//! The agent under test: a `plugin-agent run` child process the load generator starts, restarts
//! (the restart scenario) and stops, with a private admin socket and metrics port.

use anyhow::Context;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// How long the agent may take to serve its admin API (the eBPF verifier alone takes seconds).
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long it may take to finish running operations on SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// See the module docs.
pub struct AgentUnderTest {
    binary: PathBuf,
    plugin_dir: PathBuf,
    extra_args: Vec<String>,
    /// The admin socket, for `WatchEvents` and `ListPlugins`.
    pub admin_socket: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// The running agent's start phases, once its log reports them (after its first walk).
    phases: Option<tokio::sync::oneshot::Receiver<StartPhases>>,
}

/// Where an agent's start went, from its `agent started` log line (milliseconds).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct StartPhases {
    /// Process start -> first walk done (events handled as they come from then on).
    pub took_ms: f64,
    /// Command line, logging, runtime, lock, handlers, policy.
    pub setup_ms: f64,
    /// The event source open: an eBPF load, or an adoption of pinned programs.
    pub event_source_ms: f64,
    /// Metrics served, the previous agent's state read back.
    pub state_ms: f64,
    /// The first walk of the plugin directory.
    pub first_walk_ms: f64,
}

impl AgentUnderTest {
    /// `binary run --plugin-dir plugin_dir extra_args...`; its log goes to `work_dir/agent.log`.
    pub fn new(
        binary: PathBuf,
        plugin_dir: PathBuf,
        work_dir: &Path,
        extra_args: Vec<String>,
    ) -> Self {
        AgentUnderTest {
            binary,
            plugin_dir,
            extra_args,
            admin_socket: work_dir.join("admin.sock"),
            log: work_dir.join("agent.log"),
            child: None,
            phases: None,
        }
    }

    /// The running agent's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }

    /// Starts the agent and returns once its admin API listens (it says so in its JSON log).
    pub async fn start(&mut self) -> anyhow::Result<()> {
        let port = free_port()?;
        let mut child = Command::new(&self.binary)
            .args(["--log-format", "json", "--log-level"])
            .arg("warn,plugin_agent::admin=info,plugin_agent::agent=info")
            .arg("--admin-socket")
            .arg(&self.admin_socket)
            .args(["run", "--plugin-dir"])
            .arg(&self.plugin_dir)
            .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        let stderr = child.stderr.take().context("agent stderr missing")?;
        let mut log = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .await
            .with_context(|| format!("opening {}", self.log.display()))?;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (phases_tx, phases_rx) = tokio::sync::oneshot::channel();
        self.phases = Some(phases_rx);
        // Copies the log to a file (read after a failed run), says when the admin API is up and
        // what the start's phases were.
        tokio::spawn(async move {
            let mut ready_tx = Some(ready_tx);
            let mut phases_tx = Some(phases_tx);
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("admin API listening")
                    && let Some(tx) = ready_tx.take()
                {
                    let _ = tx.send(());
                }
                if line.contains("\"agent started")
                    && let Ok(phases) = serde_json::from_str::<StartPhases>(&line)
                    && let Some(tx) = phases_tx.take()
                {
                    let _ = tx.send(phases);
                }
                let _ = log.write_all(line.as_bytes()).await;
                let _ = log.write_all(b"\n").await;
            }
        });
        self.child = Some(child);
        match tokio::time::timeout(START_TIMEOUT, ready_rx).await {
            Ok(Ok(())) => Ok(()),
            _ => anyhow::bail!(
                "the agent did not serve its admin API within {START_TIMEOUT:?}; see {}",
                self.log.display()
            ),
        }
    }

    /// The running agent's start phases, when its log reports them (an agent that exits first,
    /// or one older than the report, never does: the receiver then fails).
    pub fn start_phases(&mut self) -> Option<tokio::sync::oneshot::Receiver<StartPhases>> {
        self.phases.take()
    }

    /// SIGTERM, then waits (kills it after [`STOP_TIMEOUT`]).
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        self.stop_with(nix::sys::signal::Signal::SIGTERM).await
    }

    /// Sends `signal` (SIGTERM: a clean stop; SIGKILL: a crash), then waits (kills it after
    /// [`STOP_TIMEOUT`]).
    pub async fn stop_with(&mut self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if let Some(pid) = child.id() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal);
        }
        if tokio::time::timeout(STOP_TIMEOUT, child.wait())
            .await
            .is_err()
        {
            child.kill().await?;
        }
        Ok(())
    }
}

/// A TCP port free now on 127.0.0.1 (for `--metrics-addr`: one agent per port).
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
