//! The reconcile queue: the paths whose desired or actual state changed since the reconciler last
//! looked, and the wake-up that goes with them.
//!
//! It lives with the caches it describes: the watcher marks paths when desired state changes, the
//! executor when an operation ends or a backoff expires, the handler registry's subscribers when a
//! handler comes or goes; the reconciler takes what is marked. Marks coalesce, so a burst of
//! changes costs one pass.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Mutex;
use tokio::sync::Notify;

/// Paths whose desired or actual state changed since the reconciler last looked.
#[derive(Debug, Default)]
pub struct ReconcileQueue {
    dirty: Mutex<Dirty>,
    wake: Notify,
}

#[derive(Debug, Default)]
struct Dirty {
    everything: bool,
    paths: HashSet<PathBuf>,
}

/// What the reconciler should look at.
#[derive(Debug, PartialEq, Eq)]
pub enum Work {
    /// Every desired and every registered path.
    Everything,
    /// Just these.
    Paths(HashSet<PathBuf>),
}

impl ReconcileQueue {
    /// `path` changed: look at it soon.
    pub fn mark(&self, path: PathBuf) {
        self.lock().paths.insert(path);
        self.wake.notify_one();
    }

    /// Anything may have changed: look at everything.
    pub fn mark_all(&self) {
        self.lock().everything = true;
        self.wake.notify_one();
    }

    /// Takes what is marked, leaving the queue empty.
    pub fn take(&self) -> Option<Work> {
        let mut dirty = self.lock();
        let work = if std::mem::take(&mut dirty.everything) {
            dirty.paths.clear();
            Work::Everything
        } else if dirty.paths.is_empty() {
            return None;
        } else {
            Work::Paths(std::mem::take(&mut dirty.paths))
        };
        Some(work)
    }

    /// Waits until something is marked (returns at once if something was marked since the last
    /// wait: wake-ups are never lost, and many marks coalesce into one wake-up).
    pub async fn changed(&self) {
        self.wake.notified().await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Dirty> {
        self.dirty
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
