//! The reconcile queue: the paths whose desired or actual state changed since the reconciler last
//! looked, and the wake-up that goes with them.
//!
//! It lives with the caches it describes: the watcher marks paths when desired state changes, the
//! executor when an operation ends or a backoff expires, the handler registry's subscribers when a
//! handler comes or goes; the reconciler takes what is marked. Marks coalesce, so a burst of
//! changes costs one pass.
//!
//! Paths are taken in the order they were first marked: the order the kernel reported the
//! changes. A pass starts its registrations in that order and the executor's slots admit them
//! first come, first served, so in a burst the plugin that listened first registers first. (A
//! hashed set started them in hash order: with eBPF, whose ring delivers a burst's binds in a few
//! large batches, the median plugin waited for half the burst.)

use super::PathKey;
use indexmap::IndexSet;
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
    paths: IndexSet<PathKey<PathBuf>, super::PathHasher>,
}

/// What the reconciler should look at.
#[derive(Debug, PartialEq, Eq)]
pub enum Work {
    /// Every desired and every registered path.
    Everything,
    /// Just these, in the order they were first marked (each once).
    Paths(Vec<PathBuf>),
}

impl ReconcileQueue {
    /// `path` changed: look at it soon.
    pub fn mark(&self, path: PathBuf) {
        self.lock().paths.insert(PathKey(path));
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
            let paths = std::mem::take(&mut dirty.paths);
            Work::Paths(paths.into_iter().map(|path| path.0).collect())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_taken_in_the_order_they_were_first_marked() {
        let queue = ReconcileQueue::default();
        let paths: Vec<PathBuf> = (0..1000)
            .map(|i| PathBuf::from(format!("/r/p-{i}.sock")))
            .collect();
        for path in &paths {
            queue.mark(path.clone());
        }
        // Marked again: keeps its place.
        queue.mark(paths[0].clone());
        let Some(Work::Paths(taken)) = queue.take() else {
            panic!("paths were marked");
        };
        assert!(taken.iter().eq(paths.iter()), "first come, first taken");
        assert_eq!(queue.take(), None);
        queue.mark(paths[1].clone());
        queue.mark_all();
        assert_eq!(queue.take(), Some(Work::Everything));
    }
}
