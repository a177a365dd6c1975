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
use std::sync::{Arc, Mutex};
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
    /// Live [`Held`] guards: marks wait for the last one to wake the reconciler.
    holds: usize,
    /// Something was marked while held.
    wake_held: bool,
    /// Marks held since the reconciler was last woken.
    held_marks: usize,
}

/// Most marks held back before the reconciler is woken anyway: a burst's batch of a thousand
/// new sockets starts registering while the watcher is still looking at the rest, on the other
/// CPU, as it did without the hold.
const MOST_HELD_MARKS: usize = 64;

/// Holds the reconciler's wake-up for the marks made while it lives, and wakes it once when it
/// drops (see [`ReconcileQueue::hold`]).
#[derive(Debug)]
pub struct Held(Arc<ReconcileQueue>);

impl Drop for Held {
    fn drop(&mut self) {
        let wake = {
            let mut dirty = self.0.lock();
            dirty.holds = dirty.holds.saturating_sub(1);
            let wake = dirty.holds == 0 && std::mem::take(&mut dirty.wake_held);
            if wake {
                dirty.held_marks = 0;
            }
            wake
        };
        if wake {
            self.0.wake.notify_one();
        }
    }
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
        let mut dirty = self.lock();
        dirty.paths.insert(PathKey(path));
        self.wake_unless_held(dirty);
    }

    /// Anything may have changed: look at everything.
    pub fn mark_all(&self) {
        let mut dirty = self.lock();
        dirty.everything = true;
        self.wake_unless_held(dirty);
    }

    /// Until the guard drops, marks wake the reconciler once, then (or every
    /// [`MOST_HELD_MARKS`]). The watcher holds it over a batch of hints (never across an await):
    /// a plugin's bind and listen reported together are then reconciled with the listen known,
    /// where a reconciler woken by the bind's mark, on the other CPU, started the registration
    /// first and had it wait for the listen (a second wake-up of its own), and a batch's marks
    /// cost one wake-up.
    pub fn hold(self: &Arc<Self>) -> Held {
        self.lock().holds += 1;
        Held(self.clone())
    }

    fn wake_unless_held(&self, mut dirty: std::sync::MutexGuard<'_, Dirty>) {
        if dirty.holds > 0 {
            dirty.wake_held = true;
            dirty.held_marks += 1;
            if dirty.held_marks < MOST_HELD_MARKS {
                return;
            }
            dirty.held_marks = 0;
            dirty.wake_held = false;
        }
        drop(dirty);
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

    /// Marks made while held wake the reconciler once, when the last guard drops, and not before.
    #[tokio::test]
    async fn held_marks_wake_the_reconciler_once_when_released() {
        let queue = Arc::new(ReconcileQueue::default());
        let outer = queue.hold();
        let inner = queue.hold();
        queue.mark(PathBuf::from("/r/a.sock"));
        queue.mark(PathBuf::from("/r/b.sock"));
        drop(inner);
        let woken = |queue: Arc<ReconcileQueue>| async move {
            tokio::time::timeout(std::time::Duration::ZERO, queue.changed())
                .await
                .is_ok()
        };
        assert!(!woken(queue.clone()).await, "still held by the outer guard");
        drop(outer);
        assert!(
            woken(queue.clone()).await,
            "woken when the last guard dropped"
        );
        assert!(!woken(queue.clone()).await, "one wake-up for the batch");
        assert_eq!(
            queue.take(),
            Some(Work::Paths(vec![
                PathBuf::from("/r/a.sock"),
                PathBuf::from("/r/b.sock")
            ]))
        );
        // Not held: a mark wakes at once.
        queue.mark(PathBuf::from("/r/c.sock"));
        assert!(woken(queue.clone()).await);
        // Held, a burst's marks still wake the reconciler every MOST_HELD_MARKS.
        let held = queue.hold();
        for i in 1..MOST_HELD_MARKS {
            queue.mark(PathBuf::from(format!("/r/burst-{i}.sock")));
        }
        assert!(!woken(queue.clone()).await, "fewer than the most held");
        queue.mark(PathBuf::from("/r/burst-last.sock"));
        assert!(woken(queue.clone()).await, "the most held reached");
        queue.mark(PathBuf::from("/r/after.sock"));
        drop(held);
        assert!(woken(queue.clone()).await, "the mark since, when released");
        drop(queue.hold());
        assert!(!woken(queue).await, "nothing marked while held: no wake-up");
    }
}
