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
//!
//! Of the slots, fewer may be dialling at once (connecting, HTTP/2's handshake, `GetInfo` until
//! it is slow): that is where a registration holds a connection and waits on the plugin's CPU,
//! not on a handler. See [`Slot::dialling`].
//!
//! Two lanes: sockets a walk found (the start's, a safety pass's) may hold at most three
//! quarters of the slots, and wait in a list of their own; sockets an event reported (a plugin
//! that just appeared) and deregistrations take the rest, and their listed paths are handed back
//! first. With 100,000 dead sockets in the tree at start, a plugin made after the first walk
//! waited 25 s behind their dials; it now finds a slot free at once.

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
    /// What walk-found operations must hold besides a slot: three quarters of the slots.
    scan_lane: Arc<Semaphore>,
    /// Permits to dial: see [`Slot::dialling`].
    dials: Arc<Semaphore>,
    /// The agent's shutdown: no slot is handed out once it fires, so no operation starts.
    stop: CancellationToken,
}

impl Slots {
    /// A pool of `count` slots (at least one), `dials` of which (at least one) may be dialling
    /// at once, that hands out none once `stop` fires.
    pub fn new(count: usize, dials: usize, stop: CancellationToken) -> Self {
        let count = count.max(1);
        Slots {
            pool: Arc::new(Semaphore::new(count)),
            scan_lane: Arc::new(Semaphore::new((count - count / 4).max(1))),
            dials: Arc::new(Semaphore::new(dials.max(1))),
            stop,
        }
    }

    /// Waits for a free slot in `lane`; `None` once the agent is stopping (operations still
    /// waiting for a slot end there).
    pub async fn acquire(&self, lane: Lane) -> Option<Slot> {
        let lane = match lane {
            Lane::Prompt => None,
            Lane::Scan => Some(self.scan_lane.clone()),
        };
        let lane_permit = match &lane {
            Some(lane) => Some(
                crate::shutdown::unless_stopping(&self.stop, lane.clone().acquire_owned())
                    .await?
                    .ok()?,
            ),
            None => None,
        };
        let permit = self.pool.clone().acquire_owned();
        let permit = crate::shutdown::unless_stopping(&self.stop, permit)
            .await?
            .ok()?;
        Some(Slot {
            pool: self.pool.clone(),
            permit: Some(permit),
            lane,
            lane_permit,
            dials: self.dials.clone(),
            dialling: false,
            dial: None,
            listened: None,
        })
    }

    /// Slots free now.
    #[cfg(test)]
    fn available(&self) -> usize {
        self.pool.available_permits()
    }
}

/// Which operations a slot is for (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// A socket an event reported, or a deregistration: first.
    Prompt,
    /// A socket a walk found: at most three quarters of the slots.
    Scan,
}

/// Registrations waiting for their first slot, at most `bound` of them; past that a
/// path waits in its lane's list, and each registration that gets its slot hands the next one
/// back to the reconciler (the prompt lane's first).
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
    /// The prompt lane's listed paths, handed back before `deferred`'s.
    prompt: std::collections::VecDeque<PathBuf>,
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
                prompt: std::collections::VecDeque::new(),
                deferred: std::collections::VecDeque::new(),
                listed: std::collections::HashSet::new(),
            }),
        }
    }

    /// Whether a registration of `path` (in `lane`) may wait for a slot now (it must then call
    /// [`Backlog::left`] once, when it stops waiting); if not, `path` is listed.
    pub fn admit(&self, path: &Path, lane: Lane) -> bool {
        let mut waiting = self.lock();
        if waiting.tasks < self.bound {
            waiting.tasks += 1;
            return true;
        }
        if waiting.listed.insert(path.to_path_buf()) {
            match lane {
                Lane::Prompt => waiting.prompt.push_back(path.to_path_buf()),
                Lane::Scan => waiting.deferred.push_back(path.to_path_buf()),
            }
        }
        false
    }

    /// An admitted registration stopped waiting (it got its slot, or never will); returns the
    /// listed path whose turn it is, if any (the prompt lane's first).
    pub fn left(&self) -> Option<PathBuf> {
        let mut waiting = self.lock();
        waiting.tasks = waiting.tasks.saturating_sub(1);
        let next = match waiting.prompt.pop_front() {
            Some(next) => next,
            None => waiting.deferred.pop_front()?,
        };
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
        let prompt = waiting.prompt.len().min(self.bound);
        let mut next: Vec<PathBuf> = waiting.prompt.drain(..prompt).collect();
        let turn = waiting.deferred.len().min(self.bound - prompt);
        next.extend(waiting.deferred.drain(..turn));
        for path in &next {
            waiting.listed.remove(path);
        }
        next
    }

    /// Paths listed now.
    #[cfg(test)]
    pub fn listed(&self) -> usize {
        let waiting = self.lock();
        waiting.prompt.len() + waiting.deferred.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One operation's slot, released when dropped.
pub struct Slot {
    pool: Arc<Semaphore>,
    permit: Option<OwnedSemaphorePermit>,
    /// The walk-found lane's share, held with the slot (and given back with it in pauses).
    lane: Option<Arc<Semaphore>>,
    lane_permit: Option<OwnedSemaphorePermit>,
    dials: Arc<Semaphore>,
    /// Inside [`Slot::dialling`]: a dial permit is held, but for long pauses.
    dialling: bool,
    dial: Option<OwnedSemaphorePermit>,
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

    /// Runs `dial` (connecting to the plugin and asking for its `PluginInfo`) holding one of the
    /// pool's dial permits, given back with the slot in a long pause and taken again after it.
    ///
    /// A registration's connection costs ~30 KB of HTTP/2 state and buffers (the write buffer
    /// alone is 16 KiB, fixed in `h2`). In a burst, every slot was taken by a registration
    /// waiting for a plugin busy on the same CPUs to answer `GetInfo`: 256 connections at once,
    /// the agent's peak 1.25 x its memory with 10,000 plugins registered. Fewer slots bound that,
    /// at the same throughput (the plugins' CPU sets it), but also bound the registrations that
    /// wait for a slow handler, which need no CPU (64 slots: a 100 ms handler's registration p99
    /// 1.8 x). A bound on dialling alone takes the first without the second. A plugin that has
    /// not answered within [`crate::registration::SLOW_ANSWER`] (a quarter of the 1 s deadline)
    /// waits without the permit: hung plugins hold the permits no longer, in share, than they
    /// held the slots before.
    pub async fn dialling<T>(&mut self, dial: impl AsyncFnOnce(&mut Slot) -> T) -> T {
        self.dialling = true;
        self.dial = self.dials.clone().acquire_owned().await.ok();
        let dialled = dial(self).await;
        self.dialling = false;
        self.dial = None;
        dialled
    }
}

impl Slot {
    /// Takes the lane's share (if it has one) and a slot again, after a wait without them.
    async fn take_slot_again(&mut self) {
        if let Some(lane) = &self.lane
            && self.lane_permit.is_none()
        {
            self.lane_permit = lane.clone().acquire_owned().await.ok();
        }
        if self.permit.is_none() {
            self.permit = self.pool.clone().acquire_owned().await.ok();
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
                self.dial = None;
                self.permit = None;
                self.lane_permit = None;
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
            self.take_slot_again().await;
            if self.dialling && self.dial.is_none() {
                self.dial = self.dials.clone().acquire_owned().await.ok();
            }
        })
    }

    /// The plugin is slow to answer (or hung): its wait needs no dial permit.
    fn answer_slow(&mut self) {
        self.dial = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pausing_operation_lets_another_take_its_slot() {
        let slots = Slots::new(1, 1, CancellationToken::new());
        let mut waiting = slots.acquire(Lane::Scan).await.expect("open");
        assert_eq!(slots.available(), 0);
        let pause = tokio::spawn(async move {
            waiting.pause(Duration::from_millis(50)).await;
            waiting
        });
        // While the first pauses, a second operation gets the only slot.
        let second = slots.acquire(Lane::Scan).await.expect("open");
        drop(second);
        let waiting = pause.await.expect("pause task");
        assert_eq!(slots.available(), 0, "the pause took its slot back");
        drop(waiting);
        assert_eq!(slots.available(), 1);
    }

    /// Walk-found operations hold at most three quarters of the slots: with every one of them
    /// taken, a prompt operation (a plugin an event reported) gets a slot at once, and its listed
    /// path is handed back before theirs.
    #[tokio::test]
    async fn a_prompt_operation_finds_a_slot_free_however_many_walk_found_ones_wait() {
        let slots = Slots::new(4, 4, CancellationToken::new());
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(slots.acquire(Lane::Scan).await.expect("open"));
        }
        let fourth_scan = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire(Lane::Scan).await.is_some() }
        });
        tokio::task::yield_now().await;
        assert!(
            !fourth_scan.is_finished(),
            "the scan lane is full at 3 of 4"
        );
        let prompt = tokio::time::timeout(Duration::from_secs(5), slots.acquire(Lane::Prompt))
            .await
            .expect("a prompt slot at once");
        assert!(prompt.is_some());
        drop(held);
        assert!(fourth_scan.await.expect("task"));

        let backlog = Backlog::new(1);
        assert!(backlog.admit(Path::new("/p/scan-0"), Lane::Scan));
        assert!(!backlog.admit(Path::new("/p/scan-1"), Lane::Scan));
        assert!(!backlog.admit(Path::new("/p/new"), Lane::Prompt));
        assert_eq!(
            backlog.left(),
            Some(PathBuf::from("/p/new")),
            "prompt first"
        );
        assert_eq!(
            backlog.refill(),
            [PathBuf::from("/p/scan-1")],
            "then the walk's"
        );
    }

    #[test]
    fn past_the_bound_paths_are_listed_once_and_handed_back_in_order() {
        let backlog = Backlog::new(2);
        assert!(backlog.admit(Path::new("/p/a"), Lane::Scan));
        assert!(backlog.admit(Path::new("/p/b"), Lane::Scan));
        assert!(
            !backlog.admit(Path::new("/p/c"), Lane::Scan),
            "past the bound"
        );
        assert!(!backlog.admit(Path::new("/p/d"), Lane::Scan));
        assert!(
            !backlog.admit(Path::new("/p/c"), Lane::Scan),
            "listed already"
        );
        assert!(!backlog.admit(Path::new("/p/e"), Lane::Scan));
        assert!(!backlog.admit(Path::new("/p/f"), Lane::Scan));
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
        assert!(backlog.admit(Path::new("/p/e"), Lane::Scan));
        assert!(backlog.admit(Path::new("/p/f"), Lane::Scan));
        assert!(!backlog.admit(Path::new("/p/g"), Lane::Scan));
    }

    #[tokio::test]
    async fn no_slot_is_handed_out_once_the_agent_stops() {
        let stop = CancellationToken::new();
        let slots = Slots::new(1, 1, stop.clone());
        let held = slots.acquire(Lane::Scan).await.expect("open");
        let waiting = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire(Lane::Scan).await.is_some() }
        });
        stop.cancel();
        assert!(
            !waiting.await.expect("task"),
            "a waiter got a slot after stop"
        );
        drop(held);
        assert!(
            slots.acquire(Lane::Scan).await.is_none(),
            "a slot was handed out after stop"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn dialling_is_bounded_apart_from_the_slots_and_a_long_pause_gives_its_permit_back() {
        let slots = Slots::new(3, 1, CancellationToken::new());
        let (entered_tx, mut entered) = tokio::sync::mpsc::unbounded_channel();
        // Each dialler says when it dials, pauses as long as it is told, and says when it is on.
        let dialler = |name: &'static str| {
            let slots = slots.clone();
            let entered = entered_tx.clone();
            let (go, told) = tokio::sync::oneshot::channel::<Duration>();
            let task = tokio::spawn(async move {
                let mut slot = slots.acquire(Lane::Scan).await.expect("open");
                slot.dialling(async |slot: &mut Slot| {
                    entered.send(name).expect("test alive");
                    slot.pause(told.await.expect("told")).await;
                    entered.send(name).expect("test alive");
                })
                .await;
            });
            (go, task)
        };
        let (go_first, first) = dialler("first");
        assert_eq!(entered.recv().await, Some("first"));
        let (go_second, second) = dialler("second");
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        // Both hold a slot (a third is free); one dials, the second waits for the permit.
        assert_eq!(slots.available(), 1, "both took a slot");
        assert!(entered.try_recv().is_err(), "two dialled with one permit");
        // A short pause keeps the permit; the second gets it when the first's dial ends.
        go_first
            .send(Duration::from_millis(1))
            .expect("first waits");
        assert_eq!(entered.recv().await, Some("first"), "the first went on");
        first.await.expect("first");
        assert_eq!(entered.recv().await, Some("second"));
        // The second's long pause gives its slot and its permit back, and takes both again after.
        let (go_third, third) = dialler("third");
        go_second
            .send(Duration::from_secs(5))
            .expect("second waits");
        assert_eq!(
            entered.recv().await,
            Some("third"),
            "the permit was kept through a long pause"
        );
        go_third.send(Duration::ZERO).expect("third waits");
        assert_eq!(entered.recv().await, Some("third"));
        third.await.expect("third");
        assert_eq!(entered.recv().await, Some("second"), "the pause ended");
        second.await.expect("second");
        assert_eq!(slots.available(), 3);
        assert_eq!(slots.dials.available_permits(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_answer_gives_the_dial_permit_to_another_dial() {
        let slots = Slots::new(2, 1, CancellationToken::new());
        let mut slow = slots.acquire(Lane::Scan).await.expect("open");
        let (slow_told, told) = tokio::sync::oneshot::channel::<()>();
        let (asked, mut dialled) = tokio::sync::mpsc::unbounded_channel();
        let waiting = tokio::spawn(async move {
            slow.dialling(async |slot: &mut Slot| {
                asked.send(()).expect("test alive");
                told.await.expect("told");
                slot.answer_slow();
                // Still waiting for the slow plugin's answer.
                std::future::pending::<()>().await;
            })
            .await;
        });
        dialled.recv().await.expect("the slow one dials");
        let other = tokio::spawn({
            let slots = slots.clone();
            async move {
                let mut slot = slots.acquire(Lane::Scan).await.expect("open");
                slot.dialling(async |_: &mut Slot| ()).await;
            }
        });
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!other.is_finished(), "two dialled with one permit");
        slow_told.send(()).expect("slow waits");
        tokio::time::timeout(Duration::from_secs(1), other)
            .await
            .expect("the other dialled beside a slow answer")
            .expect("task");
        waiting.abort();
    }

    /// Paused, unnotified: this pause runs its full length (paused clock: no real wait).
    #[tokio::test(start_paused = true)]
    async fn a_pause_ends_when_the_kernel_reports_the_listen() {
        let slots = Slots::new(1, 1, CancellationToken::new());
        let listened = Arc::new(Notify::new());
        let mut slot = slots
            .acquire(Lane::Scan)
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
        let slots = Slots::new(1, 1, CancellationToken::new());
        let mut slot = slots.acquire(Lane::Scan).await.expect("open");
        let other = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire(Lane::Scan).await.is_some() }
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
