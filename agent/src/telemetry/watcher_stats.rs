//! The watcher's counters ([`WatcherStats`]): written by the watcher, read by the admin API's
//! status and by the metrics collector. They sit in a leaf file of their own so that the
//! collector reads them without importing the `telemetry` module that owns the metrics.

use std::sync::atomic::AtomicU64;

/// Watcher counters, written by the watcher and read by the admin API's status and by metrics.
/// They live here, not in the watcher, so that readers need not import the watcher.
#[derive(Debug, Default)]
pub struct WatcherStats {
    /// Full walks of the tree, start and safety passes included.
    pub rescans: AtomicU64,
    /// Full walks finished (status's readiness: the start walk is the first).
    pub walks_completed: AtomicU64,
    /// Rescans caused by events the source lost (overflow, ring buffer drops, a reader stopping).
    pub loss_rescans: AtomicU64,
    /// Directories watched now.
    pub watched_dirs: AtomicU64,
    /// Hints received from the event source.
    pub hints: AtomicU64,
    /// What the last full walk could not see (status, `/readyz`).
    pub health: crate::watch_health::WatchHealth,
}
