//! Many plugins at once: a `plugin-host` process serving N kubelet plugins (see
//! `src/bin/plugin-host.rs`), whose notifications the test counts.
//!
//! Dropping it closes its stdin, which stops every plugin and removes their sockets; it is killed
//! if it does not exit promptly.

use crate::events::{EventLog, Line, Mark, WaitError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `plugin-host`.
#[derive(Debug)]
pub struct PluginHost {
    child: Child,
    stdin: Option<ChildStdin>,
    events: EventLog,
}

impl PluginHost {
    /// Starts `bin` (the test's `env!("CARGO_BIN_EXE_plugin-host")`) serving `count` plugins in
    /// `dir` with extra `flags`, and waits until they all listen.
    pub async fn start(
        bin: impl Into<PathBuf>,
        dir: &Path,
        count: usize,
        flags: &[&str],
    ) -> PluginHost {
        let mut child = Command::new(bin.into())
            .arg("--dir")
            .arg(dir)
            .args(["--count", &count.to_string()])
            .args(flags)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start plugin-host");
        let stdout = child.stdout.take().expect("stdout is piped");
        let stdin = child.stdin.take();
        let host = PluginHost {
            child,
            stdin,
            events: EventLog::read_from(stdout, format!("plugin-host-{}", dir.display())),
        };
        host.wait_for_count(
            Mark(0),
            1,
            "plugins serving",
            Duration::from_secs(60),
            |l| l.event() == "serving",
        )
        .await;
        host
    }

    /// Its notification log.
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// The current end of its log.
    pub fn mark(&self) -> Mark {
        self.events.mark()
    }

    /// How many distinct plugins printed Notify(true) since `mark`.
    pub fn notified_since(&self, mark: Mark) -> usize {
        self.events
            .matching_since(mark, |l| {
                l.event() == "notify" && l.flag("registered") == Some(true)
            })
            .iter()
            .filter_map(|l| l.field("socket"))
            .collect::<std::collections::HashSet<String>>()
            .len()
    }

    /// Waits until `n` distinct sockets were told `registered=true` after `mark`.
    pub async fn wait_registered(&self, mark: Mark, n: usize, timeout: Duration) -> Duration {
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // The mark is taken before counting: a line that lands between the two is then waited
            // past, not missed (the last notifications arriving there left this wait asleep until
            // its deadline, with every plugin in fact notified).
            let next = self.events.mark();
            let notified: std::collections::HashSet<String> = self
                .events
                .matching_since(mark, |l| {
                    l.event() == "notify" && l.flag("registered") == Some(true)
                })
                .iter()
                .filter_map(|l| l.field("socket"))
                .collect();
            if notified.len() >= n {
                return started.elapsed();
            }
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.events.wait_for(next, remaining, |_| true).await {
                Ok(_) => {}
                Err(e) => panic!(
                    "{} of {n} plugins registered after {:?} ({e:?}); plugin-host said:\n{}",
                    notified.len(),
                    started.elapsed(),
                    self.events.tail(20)
                ),
            }
        }
    }

    /// Sends one command line (`churn 20`, `pause`).
    pub fn command(&mut self, line: &str) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{line}");
            let _ = stdin.flush();
        }
    }

    /// Stops churning and returns every socket served now.
    pub async fn pause(&mut self) -> Vec<PathBuf> {
        let mark = self.mark();
        self.command("pause");
        let live = self
            .wait_for_count(mark, 1, "the live list", Duration::from_secs(30), |l| {
                l.event() == "live"
            })
            .await;
        live[0]
            .0
            .get("sockets")
            .and_then(serde_json::Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(PathBuf::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    async fn wait_for_count(
        &self,
        mark: Mark,
        n: usize,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Line) -> bool,
    ) -> Vec<Line> {
        match self.events.wait_for_count(mark, n, timeout, pred).await {
            Ok(lines) => lines,
            Err(WaitError::Timeout | WaitError::Closed) => panic!(
                "plugin-host: waiting for {what} (limit {timeout:?}):\n{}",
                self.events.tail(20)
            ),
        }
    }
}

impl Drop for PluginHost {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
