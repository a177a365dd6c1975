//! Operation slots: the bound on how many registrations and deregistrations run at once, with a
//! way for an operation that only waits to step out of its slot.
//!
//! A socket that is bound but not listening (a crashed plugin's leftover, say) or a peer that has
//! not started serving is retried within the 10 s dial budget. Holding a slot through those
//! pauses let a few hundred stale sockets occupy every slot for their whole budget while good
//! plugins queued behind them (1,000 stale sockets: 28.5 s before a good plugin registered). A
//! pause (past the first few milliseconds) gives the slot back and queues for one again
//! afterwards; the semaphore is fair, so operations that were waiting for a slot go first. A
//! pause ends early when the kernel reports the socket's `listen()` (eBPF source).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::PoisonError;
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::registration::Pause;

/// The pool of slots.
#[derive(Clone)]
pub struct Slots {
    pool: Arc<Semaphore>,
    /// The agent's shutdown: no slot is handed out once it fires, so no operation starts.
    stop: CancellationToken,
}

impl Slots {
    /// A pool of `count` slots (at least one) that hands out none once `stop` fires.
    pub fn new(count: usize, stop: CancellationToken) -> Self {
        Slots {
            pool: Arc::new(Semaphore::new(count.max(1))),
            stop,
        }
    }

    /// Waits for a free slot; `None` once the agent is stopping (operations still waiting for a
    /// slot end there).
    pub async fn acquire(&self) -> Option<Slot> {
        let permit = self.pool.clone().acquire_owned();
        let permit = crate::shutdown::unless_stopping(&self.stop, permit)
            .await?
            .ok()?;
        Some(Slot {
            pool: self.pool.clone(),
            permit: Some(permit),
            listened: None,
        })
    }

    /// Slots free now.
    #[cfg(test)]
    fn available(&self) -> usize {
        self.pool.available_permits()
    }
}

/// Registrations waiting for their first slot, at most `bound` of them; past that a
/// path waits in a list, and each registration that gets its slot hands the next one back to
/// the reconciler.
///
/// A waiting registration is a task (its future holds the socket's desired entry, its claim and
/// its place in the semaphore's queue: ~700 bytes); a burst that the eBPF source reports faster
/// than the plugins answer had ~7,000 of them at once (10,000 plugins created in 0.6 s, ~4,500
/// registered a second), which set the agent's peak memory. A listed path costs its bytes, and
/// it is looked at again with the desired state of then (a socket gone meanwhile is never dialled).
/// In order: what waits in the semaphore goes first (it is fair), then the list, front first.
pub struct Backlog {
    bound: usize,
    inner: std::sync::Mutex<Waiting>,
}

struct Waiting {
    tasks: usize,
    deferred: std::collections::VecDeque<PathBuf>,
    listed: std::collections::HashSet<PathBuf>,
}

impl Backlog {
    /// At most `bound` (at least one) registrations waiting for a slot.
    pub fn new(bound: usize) -> Self {
        Backlog {
            bound: bound.max(1),
            inner: std::sync::Mutex::new(Waiting {
                tasks: 0,
                deferred: std::collections::VecDeque::new(),
                listed: std::collections::HashSet::new(),
            }),
        }
    }

    /// Whether a registration of `path` may wait for a slot now (it must then call
    /// [`Backlog::left`] once, when it stops waiting); if not, `path` is listed.
    pub fn admit(&self, path: &Path) -> bool {
        let mut waiting = self.lock();
        if waiting.tasks < self.bound {
            waiting.tasks += 1;
            return true;
        }
        if waiting.listed.insert(path.to_path_buf()) {
            waiting.deferred.push_back(path.to_path_buf());
        }
        false
    }

    /// An admitted registration stopped waiting (it got its slot, or never will); returns the
    /// listed path whose turn it is, if any.
    pub fn left(&self) -> Option<PathBuf> {
        let mut waiting = self.lock();
        waiting.tasks = waiting.tasks.saturating_sub(1);
        let next = waiting.deferred.pop_front()?;
        waiting.listed.remove(&next);
        Some(next)
    }

    /// After a reconcile pass: when nothing waits for a slot any more, the next `bound` listed
    /// paths (a path handed back by [`Backlog::left`] may not have been registered after all,
    /// gone or registered meanwhile, and then nothing else would hand the others on). At most
    /// `bound` at a time, so each listed path is handed back once, not once per pass.
    pub fn refill(&self) -> Vec<PathBuf> {
        let mut waiting = self.lock();
        if waiting.tasks > 0 {
            return Vec::new();
        }
        let turn = waiting.deferred.len().min(self.bound);
        let next: Vec<PathBuf> = waiting.deferred.drain(..turn).collect();
        for path in &next {
            waiting.listed.remove(path);
        }
        next
    }

    /// Paths listed now.
    #[cfg(test)]
    pub fn listed(&self) -> usize {
        self.lock().deferred.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One operation's slot, released when dropped.
pub struct Slot {
    pool: Arc<Semaphore>,
    permit: Option<OwnedSemaphorePermit>,
    /// Ends a pause early: the kernel reported that the socket listens now.
    listened: Option<Arc<Notify>>,
}

impl Slot {
    /// The same slot, whose pauses end as soon as `listened` is notified (or were notified since
    /// the last pause): the dial they wait to retry would now succeed.
    pub fn waking_on(self, listened: Arc<Notify>) -> Self {
        Slot {
            listened: Some(listened),
            ..self
        }
    }
}

/// Pauses up to this long keep the slot: a plugin caught between its bind and its listen (the
/// eBPF source sees the bind first and often dials that early) listens within microseconds, and a
/// registration that gave its slot back for that would queue again behind every other one waiting
/// (a burst of 10,000: behind thousands). Longer pauses (a socket still refusing after the first
/// three retries, 7 ms) give it back, so stale sockets never hold up good plugins.
const KEEP_SLOT_FOR: Duration = Duration::from_millis(4);

impl Pause for Slot {
    /// Sleeps, without the slot unless the pause is short, then waits for one again. A closed
    /// pool ends the wait at once; the operation then finds its next step refused by the
    /// stopping agent.
    fn pause(&mut self, duration: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            if duration > KEEP_SLOT_FOR {
                self.permit = None;
            }
            match &self.listened {
                Some(listened) => {
                    tokio::select! {
                        () = tokio::time::sleep(duration) => {}
                        () = listened.notified() => {}
                    }
                }
                None => tokio::time::sleep(duration).await,
            }
            if self.permit.is_none() {
                self.permit = self.pool.clone().acquire_owned().await.ok();
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pausing_operation_lets_another_take_its_slot() {
        let slots = Slots::new(1, CancellationToken::new());
        let mut waiting = slots.acquire().await.expect("open");
        assert_eq!(slots.available(), 0);
        let pause = tokio::spawn(async move {
            waiting.pause(Duration::from_millis(50)).await;
            waiting
        });
        // While the first pauses, a second operation gets the only slot.
        let second = slots.acquire().await.expect("open");
        drop(second);
        let waiting = pause.await.expect("pause task");
        assert_eq!(slots.available(), 0, "the pause took its slot back");
        drop(waiting);
        assert_eq!(slots.available(), 1);
    }

    #[test]
    fn past_the_bound_paths_are_listed_once_and_handed_back_in_order() {
        let backlog = Backlog::new(2);
        assert!(backlog.admit(Path::new("/p/a")));
        assert!(backlog.admit(Path::new("/p/b")));
        assert!(!backlog.admit(Path::new("/p/c")), "past the bound");
        assert!(!backlog.admit(Path::new("/p/d")));
        assert!(!backlog.admit(Path::new("/p/c")), "listed already");
        assert!(!backlog.admit(Path::new("/p/e")));
        assert!(!backlog.admit(Path::new("/p/f")));
        assert_eq!(backlog.listed(), 4, "each path listed once");
        // While something waits, a pass hands nothing back: waiting ones do, one each.
        assert!(backlog.refill().is_empty());
        assert_eq!(backlog.left(), Some(PathBuf::from("/p/c")));
        assert_eq!(backlog.left(), Some(PathBuf::from("/p/d")));
        // Nothing waits (c and d were not registered after all): a pass hands back the next
        // ones, at most the bound.
        assert_eq!(
            backlog.refill(),
            [PathBuf::from("/p/e"), PathBuf::from("/p/f")]
        );
        assert_eq!(backlog.listed(), 0);
        assert!(backlog.refill().is_empty());
        // Admitted again, up to the bound.
        assert!(backlog.admit(Path::new("/p/e")));
        assert!(backlog.admit(Path::new("/p/f")));
        assert!(!backlog.admit(Path::new("/p/g")));
    }

    #[tokio::test]
    async fn no_slot_is_handed_out_once_the_agent_stops() {
        let stop = CancellationToken::new();
        let slots = Slots::new(1, stop.clone());
        let held = slots.acquire().await.expect("open");
        let waiting = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire().await.is_some() }
        });
        stop.cancel();
        assert!(
            !waiting.await.expect("task"),
            "a waiter got a slot after stop"
        );
        drop(held);
        assert!(
            slots.acquire().await.is_none(),
            "a slot was handed out after stop"
        );
    }

    /// Paused, unnotified: this pause runs its full length (paused clock: no real wait).
    #[tokio::test(start_paused = true)]
    async fn a_pause_ends_when_the_kernel_reports_the_listen() {
        let slots = Slots::new(1, CancellationToken::new());
        let listened = Arc::new(Notify::new());
        let mut slot = slots
            .acquire()
            .await
            .expect("open")
            .waking_on(listened.clone());
        let long = Duration::from_secs(3600);

        // Reported while the operation waits: the wait ends then, not an hour later.
        let started = tokio::time::Instant::now();
        let pause = tokio::spawn(async move {
            slot.pause(long).await;
            slot
        });
        tokio::task::yield_now().await;
        listened.notify_one();
        let mut slot = pause.await.expect("pause task");
        assert!(started.elapsed() < long, "the pause ran its full length");

        // Reported between two waits (the dial was refused just before the listen): the next
        // wait does not start.
        listened.notify_one();
        let started = tokio::time::Instant::now();
        slot.pause(long).await;
        assert!(
            started.elapsed() < long,
            "a listen reported before the pause was lost"
        );

        // Nothing reported: the pause is the dial's backoff, as without the kernel's word.
        let started = tokio::time::Instant::now();
        slot.pause(Duration::from_millis(50)).await;
        assert_eq!(started.elapsed(), Duration::from_millis(50));
        assert_eq!(
            slots.available(),
            0,
            "the slot was taken back after each pause"
        );
    }

    /// A pause for a plugin between its bind and its listen keeps the slot, so the registration
    /// does not queue again behind everything that waits for one.
    #[tokio::test(start_paused = true)]
    async fn a_short_pause_keeps_the_slot() {
        let slots = Slots::new(1, CancellationToken::new());
        let mut slot = slots.acquire().await.expect("open");
        let other = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire().await.is_some() }
        });
        tokio::task::yield_now().await;
        slot.pause(Duration::from_millis(1)).await;
        assert!(
            !other.is_finished(),
            "another operation took the slot during a short pause"
        );
        drop(slot);
        assert!(other.await.expect("task"), "the slot was not handed on");
    }
}
