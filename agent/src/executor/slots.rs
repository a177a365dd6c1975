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
use std::pin::Pin;
use std::sync::Arc;
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
