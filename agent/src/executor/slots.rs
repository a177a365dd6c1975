//! Operation slots: the bound on how many registrations and deregistrations run at once, with a
//! way for an operation that only waits to step out of its slot.
//!
//! A socket that is bound but not listening (a crashed plugin's leftover, say) or a peer that has
//! not started serving is retried within the 10 s dial budget. Holding a slot through those
//! pauses let a few hundred stale sockets occupy every slot for their whole budget while good
//! plugins queued behind them (1,000 stale sockets: 28.5 s before a good plugin registered). The
//! pause gives the slot back and queues for one again afterwards; the semaphore is fair, so
//! operations that were waiting for a slot go first.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
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
}

impl Pause for Slot {
    /// Sleeps without the slot, then waits for one again. A closed pool ends the wait at once;
    /// the operation then finds its next step refused by the stopping agent.
    fn pause(&mut self, duration: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            self.permit = None;
            tokio::time::sleep(duration).await;
            self.permit = self.pool.clone().acquire_owned().await.ok();
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
}
