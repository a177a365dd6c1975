//! Worker processes: the coordinator spreads plugins over a few copies of `loadgen` (the
//! `worker` subcommand), so thousands of gRPC servers do not share one process and the load
//! generator is not the bottleneck it measures.
//!
//! Protocol, one line each way per message:
//! - coordinator -> worker (stdin): `start <id> <serve_delay_ms>`, `stop <id>`; end of input stops
//!   every plugin and ends the worker;
//! - worker -> coordinator (stdout): [`Report::to_line`].

use crate::plugins::{Announce, PluginHost, Report};
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

/// Runs a worker: obeys stdin, reports on stdout, until stdin closes.
pub async fn serve(dir: PathBuf, announce: Announce) -> anyhow::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Report>();
    let writer = tokio::spawn(async move {
        let mut out = BufWriter::new(tokio::io::stdout());
        while let Some(report) = rx.recv().await {
            let mut line = report.to_line();
            line.push('\n');
            if out.write_all(line.as_bytes()).await.is_err() {
                return;
            }
            // Batch while reports queue up; flush as soon as none is waiting.
            if rx.is_empty() && out.flush().await.is_err() {
                return;
            }
        }
        let _ = out.flush().await;
    });
    let mut host = PluginHost::new(dir, announce, tx);
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let mut words = line.split_whitespace();
        match (
            words.next(),
            words.next().and_then(|w| w.parse::<u64>().ok()),
        ) {
            (Some("start"), Some(id)) => {
                let delay_ms = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
                host.start(id, Duration::from_millis(delay_ms));
            }
            (Some("stop"), Some(id)) => host.stop(id),
            _ => anyhow::bail!("worker: cannot parse command {line:?}"),
        }
    }
    host.stop_all();
    drop(host);
    let _ = writer.await;
    Ok(())
}

/// The coordinator's handle on its workers.
pub struct WorkerPool {
    workers: Vec<(Child, BufWriter<ChildStdin>)>,
    /// Workers SIGKILLed (the crash scenario): told nothing more.
    killed: std::collections::HashSet<usize>,
}

impl WorkerPool {
    /// Spawns `count` workers hosting plugins in `dir`; their reports arrive on `reports`.
    pub fn spawn(
        count: usize,
        dir: &Path,
        announce: &Announce,
        reports: mpsc::UnboundedSender<Report>,
    ) -> anyhow::Result<WorkerPool> {
        let exe = std::env::current_exe().context("locating the loadgen binary")?;
        let mut workers = Vec::new();
        for _ in 0..count.max(1) {
            let mut child = Command::new(&exe)
                .arg("worker")
                .arg("--plugin-dir")
                .arg(dir)
                .args(["--plugin-type", &announce.plugin_type])
                .args(["--versions", &announce.versions.join(",")])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .context("spawning a loadgen worker")?;
            let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
                anyhow::bail!("worker pipes missing");
            };
            let reports = reports.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if let Some(report) = Report::parse(&line) {
                        let _ = reports.send(report);
                    }
                }
            });
            workers.push((child, BufWriter::new(stdin)));
        }
        Ok(WorkerPool {
            workers,
            killed: std::collections::HashSet::new(),
        })
    }

    fn index(&self, id: u64) -> usize {
        (id % self.workers.len() as u64) as usize
    }

    fn worker(&mut self, id: u64) -> &mut BufWriter<ChildStdin> {
        let index = self.index(id);
        &mut self.workers[index].1
    }

    /// SIGKILLs the worker that hosts plugin `id` (and whatever else it hosts): a crash, its
    /// sockets left behind. Nothing is sent to it afterwards.
    pub fn kill_worker_of(&mut self, id: u64) -> anyhow::Result<()> {
        let index = self.index(id);
        self.workers[index]
            .0
            .start_kill()
            .context("SIGKILL a worker")?;
        self.killed.insert(index);
        Ok(())
    }

    /// Queues: start plugin `id`, serving after `serve_delay`. Sent at the next [`Self::flush`].
    pub async fn start(&mut self, id: u64, serve_delay: Duration) -> anyhow::Result<()> {
        anyhow::ensure!(
            !self.killed.contains(&self.index(id)),
            "plugin {id}'s worker was killed"
        );
        let line = format!("start {id} {}\n", serve_delay.as_millis());
        self.worker(id).write_all(line.as_bytes()).await?;
        Ok(())
    }

    /// Queues: stop plugin `id`. Sent at the next [`Self::flush`].
    pub async fn stop(&mut self, id: u64) -> anyhow::Result<()> {
        if self.killed.contains(&self.index(id)) {
            return Ok(());
        }
        let line = format!("stop {id}\n");
        self.worker(id).write_all(line.as_bytes()).await?;
        Ok(())
    }

    /// Sends what is queued to every worker.
    pub async fn flush(&mut self) -> anyhow::Result<()> {
        for (index, (_, stdin)) in self.workers.iter_mut().enumerate() {
            if !self.killed.contains(&index) {
                stdin.flush().await?;
            }
        }
        Ok(())
    }

    /// Closes the workers' input (each stops its plugins and exits) and waits for them.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.flush().await?;
        for (mut child, stdin) in self.workers.drain(..) {
            drop(stdin);
            child.wait().await?;
        }
        Ok(())
    }
}
