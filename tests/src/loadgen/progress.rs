//! Progress lines for whoever drives the load generator (`cargo xtask bench` turns them into a
//! progress bar): `{"progress":{"phase":..,"done":..,"total":..}}` on stdout, at most ten a
//! second, and always when a phase begins. The final result is the one line without a `progress`
//! key.

use std::io::Write;
use std::time::{Duration, Instant};

/// Throttled progress reporting.
pub struct Progress {
    last: Option<Instant>,
    phase: String,
}

impl Progress {
    /// Reports nothing yet.
    pub fn new() -> Self {
        Progress {
            last: None,
            phase: String::new(),
        }
    }

    /// `done` of `total` in `phase` (printed unless one of the same phase was printed less than
    /// 100 ms ago: whoever watches can tell when a phase begins and ends).
    pub fn set(&mut self, phase: &str, done: u64, total: u64) {
        if self
            .last
            .is_some_and(|at| at.elapsed() < Duration::from_millis(100))
            && done < total
            && phase == self.phase
        {
            return;
        }
        self.last = Some(Instant::now());
        if phase != self.phase {
            phase.clone_into(&mut self.phase);
        }
        let line = serde_json::json!({"progress": {"phase": phase, "done": done, "total": total}});
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}
