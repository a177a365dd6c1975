//! Progress lines for whoever drives the load generator (`cargo xtask bench` turns them into a
//! progress bar): `{"progress":{"phase":..,"done":..,"total":..}}` on stdout, at most ten a
//! second. The final result is the one line without a `progress` key.

use std::io::Write;
use std::time::{Duration, Instant};

/// Throttled progress reporting.
pub struct Progress {
    last: Option<Instant>,
}

impl Progress {
    /// Reports nothing yet.
    pub fn new() -> Self {
        Progress { last: None }
    }

    /// `done` of `total` in `phase` (printed unless one was printed less than 100 ms ago).
    pub fn set(&mut self, phase: &str, done: u64, total: u64) {
        if self
            .last
            .is_some_and(|at| at.elapsed() < Duration::from_millis(100))
            && done < total
        {
            return;
        }
        self.last = Some(Instant::now());
        let line = serde_json::json!({"progress": {"phase": phase, "done": done, "total": total}});
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}
