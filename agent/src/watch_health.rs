//! What the watcher could not see, so that no blind spot is silent.
//!
//! ```text
//! watcher walk ──> WalkReport (unreadable directories, paths beyond PATH_MAX, a root that is no
//!                  directory) ──> log lines, plugin_agent_walk_errors_total, WatchHealth
//! WatchHealth ──> `plugin-agent status` (problems), `/readyz` (503 while nothing is watched)
//! the journal (persist) ──condition("state file")──> WatchHealth (503 while it cannot write)
//! ```
//!
//! Why a failed read keeps state: the safety pass converges desired state on what a walk found.
//! A directory that could not be read (EMFILE while something floods the agent's descriptors,
//! ENOMEM, EACCES after a `chmod`) was not found empty; treating it as empty deregistered live
//! plugins whose sockets were still there. So a failed read keeps what was known under that
//! directory until a walk reads it again; a socket that really went is reported by its event.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Longest path the kernel resolves in one call (`PATH_MAX`, with its terminating NUL).
pub const PATH_MAX: usize = libc::PATH_MAX as usize;

/// Problems shown to operators at most; the rest are counted.
const SHOWN: usize = 8;

/// What one walk could not read. Paths in `kept` (and everything below them) keep their previous
/// desired state and watches.
#[derive(Debug, Default)]
pub struct WalkReport {
    /// Directories and entries whose read failed for a reason other than "gone".
    pub kept: Vec<PathBuf>,
    /// Directories that could not be read, with the error.
    pub unreadable: Vec<(PathBuf, String)>,
    /// Directories and entries whose path exceeds [`PATH_MAX`]: never watched nor walked.
    pub too_long: Vec<PathBuf>,
}

impl WalkReport {
    /// True if `path` is at or below a path whose read failed.
    pub fn keeps(&self, path: &Path) -> bool {
        self.kept.iter().any(|k| path.starts_with(k))
    }

    /// Records that `path` could not be read because of `error`.
    pub fn failed(&mut self, path: &Path, error: &std::io::Error) {
        if is_too_long(path, error) {
            self.too_long.push(path.to_path_buf());
        } else {
            self.unreadable
                .push((path.to_path_buf(), error.to_string()));
        }
        self.kept.push(path.to_path_buf());
    }
}

/// True if `error` (for `path`) means the path is too long for the kernel to resolve.
pub fn is_too_long(path: &Path, error: &std::io::Error) -> bool {
    error.raw_os_error() == Some(libc::ENAMETOOLONG) || path.as_os_str().len() >= PATH_MAX
}

/// The watcher's blind spots after its last full walk, and what else keeps the agent from its
/// job (a state file it cannot write); read by status and `/readyz`.
#[derive(Debug, Default)]
pub struct WatchHealth {
    problems: Mutex<Problems>,
    /// Problems outside the walk, by what has them; each holds until its owner clears it.
    conditions: Mutex<std::collections::BTreeMap<&'static str, String>>,
}

/// A snapshot of [`WatchHealth`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Problems {
    /// Why the plugin directory itself is not watched (a symlink, a file, unreadable), if it is not.
    pub root: Option<String>,
    /// One line per blind spot (the first few), then how many more.
    pub lines: Vec<String>,
    /// One line per problem outside the walk (see [`WatchHealth::condition`]).
    pub conditions: Vec<String>,
}

impl WatchHealth {
    /// Replaces the problems with those of the walk that just ended.
    pub fn set(&self, root: Option<String>, report: &WalkReport) {
        let mut lines: Vec<String> = report
            .unreadable
            .iter()
            .map(|(dir, e)| format!("cannot read {}: {e}", dir.display()))
            .chain(report.too_long.iter().map(|p| {
                format!(
                    "path longer than PATH_MAX ({PATH_MAX} bytes), not watched: {}...",
                    crate::text::escape(&p.to_string_lossy().chars().take(120).collect::<String>())
                )
            }))
            .collect();
        let total = lines.len();
        if total > SHOWN {
            lines.truncate(SHOWN);
            lines.push(format!("and {} more", total - SHOWN));
        }
        *self.lock() = Problems {
            root,
            lines,
            conditions: Vec::new(),
        };
    }

    /// Says that `what` (e.g. "state file") has `problem` now, or none any more: shown by
    /// status, and `/readyz` fails while any is set.
    pub fn condition(&self, what: &'static str, problem: Option<String>) {
        let mut conditions = self.conditions.lock().unwrap_or_else(|p| p.into_inner());
        match problem {
            Some(problem) => conditions.insert(what, problem),
            None => conditions.remove(what),
        };
    }

    /// The problems now.
    pub fn get(&self) -> Problems {
        let mut problems = self.lock().clone();
        let conditions = self.conditions.lock().unwrap_or_else(|p| p.into_inner());
        problems.conditions = conditions
            .iter()
            .map(|(what, problem)| format!("{what}: {problem}"))
            .collect();
        problems
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Problems> {
        self.problems.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_read_keeps_everything_below_it_and_nothing_beside_it() {
        let mut report = WalkReport::default();
        let emfile = std::io::Error::from_raw_os_error(libc::EMFILE);
        report.failed(Path::new("/r/a"), &emfile);
        assert!(report.keeps(Path::new("/r/a")));
        assert!(report.keeps(Path::new("/r/a/x.sock")));
        assert!(!report.keeps(Path::new("/r/ab/x.sock")));
        assert!(!report.keeps(Path::new("/r/b.sock")));
        assert_eq!(report.unreadable.len(), 1);
    }

    #[test]
    fn too_long_paths_are_told_apart_from_unreadable_ones() {
        let mut report = WalkReport::default();
        let long = PathBuf::from(format!("/r/{}", "d/".repeat(PATH_MAX)));
        report.failed(
            &long,
            &std::io::Error::from_raw_os_error(libc::ENAMETOOLONG),
        );
        assert_eq!(report.too_long.len(), 1);
        assert!(report.unreadable.is_empty());
        let health = WatchHealth::default();
        health.set(None, &report);
        let problems = health.get();
        assert_eq!(problems.lines.len(), 1);
        assert!(problems.lines[0].contains("PATH_MAX"), "{problems:?}");
        assert!(problems.lines[0].len() < 300, "the line is bounded");
    }

    #[test]
    fn a_condition_holds_across_walks_until_its_owner_clears_it() {
        let health = WatchHealth::default();
        health.condition("state file", Some("cannot write /run/x: ENOSPC".into()));
        health.set(None, &WalkReport::default());
        assert_eq!(
            health.get().conditions,
            ["state file: cannot write /run/x: ENOSPC"]
        );
        health.condition("state file", None);
        assert!(health.get().conditions.is_empty());
    }
}
