//! Handlers under test: `dra-handler` processes (a real `pluginagent.v1.PluginHandler` server),
//! whose JSON call log (`{"call":"validate"|"register"|"deregister","name":..,"endpoint":..}`)
//! the test awaits and inspects.
//!
//! Killed on drop, so a failed test leaves no handler running.

use crate::events::{EventLog, Line, Mark, WaitError};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `dra-handler`.
#[derive(Debug)]
pub struct HandlerProcess {
    child: Child,
    events: EventLog,
    target: String,
}

impl HandlerProcess {
    /// Starts `bin` (the test's `env!("CARGO_BIN_EXE_dra-handler")`) listening on the Unix socket
    /// `socket` with extra `flags`, and waits until it listens.
    pub async fn start(bin: impl Into<PathBuf>, socket: &Path, flags: &[&str]) -> HandlerProcess {
        let target = format!("unix://{}", socket.display());
        let mut child = Command::new(bin.into())
            .args(["--listen", &target])
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start dra-handler");
        let stdout = child.stdout.take().expect("stdout is piped");
        let events = EventLog::read_from(stdout, format!("handler-{}", socket.display()));
        let handler = HandlerProcess {
            child,
            events,
            target,
        };
        handler
            .wait_for_count(
                Mark(0),
                1,
                "the handler listens",
                Duration::from_secs(10),
                |l| l.field_is("event", "listening"),
            )
            .await;
        handler
    }

    /// `unix:///...`, for `--handler TYPE=TARGET`.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The call log.
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// The current end of the call log.
    pub fn mark(&self) -> Mark {
        self.events.mark()
    }

    /// Calls of `kind` after `mark`.
    pub fn calls_since(&self, mark: Mark, kind: &str) -> Vec<Line> {
        self.events
            .matching_since(mark, |l| l.field_is("call", kind))
    }

    /// Waits for `n` lines after `mark` matching `pred`; panics with the log tail otherwise.
    pub async fn wait_for_count(
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
                "waiting for {n} x {what} (limit {timeout:?}); handler said:\n{}",
                self.events.tail(30)
            ),
        }
    }

    /// Kills the handler (a crash: its socket stays behind until it is started again).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for HandlerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
