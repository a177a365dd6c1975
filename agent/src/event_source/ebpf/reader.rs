//! The reader task: drains the ring buffer into the watcher's channel and turns losses into rescans.
//!
//! ```text
//! EVENTS ring buffer --(epoll via AsyncFd)--> drain --record::translate--> FsEvent --> sink
//! LOSSES counters (mapped) --read after every drain--> moved? --> FsEvent::Rescan
//! ```
//!
//! Wake-ups are batched by the kernel side (see `wake_flags_when` in agent-ebpf): an event is announced
//! at once only if the reader was last woken at least `batch_delay` ago, or when enough bytes are
//! queued; otherwise it rides along. So after every drain that found work the reader drains once
//! more `batch_delay` later, which bounds the latency of ridden-along events; a drain that finds
//! nothing ends the burst and the reader sleeps until the next epoll wake-up (no idle timers).
//! The follow-up is one timer moved later after each drain, not a new one each time: tokio
//! extends a registered timer's deadline in place, while registering a new one takes the timer
//! lock and, as it is the earliest, wakes the thread parked in `epoll_wait` to shorten its
//! timeout (measured: 1.2 such wake-ups per plugin lifecycle under churn at 500 a second).
//!
//! The reader is a task on the agent's runtime, not a thread of its own: the hand-over to the
//! watcher then stays on one worker (measured 8–9 µs p50), where a separate reader thread would
//! have to wake a tokio worker, often on another, idle CPU (tens of µs more; see
//! docs/operations.md, "Why the p99 <= 100 µs idle target is not met here").

use std::sync::Arc;
use std::time::Duration;

use agent_ebpf::loss;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc::Sender;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::filters::Filters;
use super::record;
use super::ring::Ring;
use super::stats::LossCounters;
use crate::event_source::{FsEvent, monotonic_now_ns};

/// Most records handled between two sends to the channel, so one drain holds bounded memory.
const MAX_BATCH: usize = 1024;

/// Most records drained in one pass before the loss counters are read. Under a sustained flood
/// the ring never empties; without this budget the reader would drain it for as long as the flood
/// lasts and only then see that records were lost, so the rescan that finds the plugins created
/// meanwhile would wait for the flood to end.
const DRAIN_BUDGET: usize = 8 * MAX_BATCH;

/// Everything the reader task owns.
pub struct Reader {
    /// The ring buffer the programs write [`agent_ebpf::Event`]s into.
    pub ring: Ring,
    /// The per-CPU loss counters the programs bump (shared with the source's stats).
    pub losses: Arc<LossCounters>,
    /// Filters, to map directory identities back to paths and to clear names after a loss.
    pub filters: Arc<Filters>,
    /// The watcher's channel.
    pub sink: Sender<FsEvent>,
    /// Fires when the agent (or the source) stops.
    pub cancel: CancellationToken,
    /// The kernel side's batching delay; the reader drains again this long after a busy drain.
    pub batch_delay: Duration,
}

/// The loss counters and what the reader has already reported of them.
struct Losses<'a> {
    counters: &'a LossCounters,
    seen: &'a mut [u64; loss::COUNT as usize],
}

/// Reads the loss counters and the name table's overflow flag after a drain; on any new loss,
/// tells the watcher to rescan (and empties a full name table, which the rescan refills).
/// Returns false when the watcher is gone.
async fn report_losses(
    losses: Losses<'_>,
    filters: &Filters,
    ring: &mut Ring,
    sink: &Sender<FsEvent>,
    cancel: &CancellationToken,
) -> Option<bool> {
    let ring_bytes = u32::try_from(ring.size()).unwrap_or(u32::MAX);
    let mut report = new_losses(losses.counters, losses.seen, ring_bytes);
    if filters.take_names_overflow() {
        report = Some(LossReport::merge(
            report,
            "a name found by the watcher did not fit the eBPF name table",
        ));
    }
    let Some(mut reason) = report else {
        return Some(false);
    };
    if reason.names_full {
        filters.forget_names();
    }
    // What is still queued was committed before the rescan's walk starts (the walk follows this
    // send), so the walk sees its effects: handling it would only delay the walk, which under a
    // flood is what makes progress.
    let (superseded, left_queued) = discard(ring);
    if superseded > 0 {
        reason.text.push_str(&format!(
            "; {superseded} queued events superseded by the rescan"
        ));
    }
    tracing::warn!(reason = %reason.text, "eBPF event source lost events; rescanning");
    let sent = send(
        sink,
        cancel,
        FsEvent::Rescan {
            reason: reason.text,
        },
    )
    .await;
    sent.then_some(left_queued)
}

impl Reader {
    /// Runs until cancelled or the watcher's channel closes.
    pub async fn run(self) {
        let Reader {
            ring,
            losses,
            filters,
            sink,
            cancel,
            batch_delay,
        } = self;
        // SAFETY: the ring owns its map fd, which stays open and refers to the same map for as
        // long as the ring lives, and the ring lives inside the AsyncFd.
        let registered = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) };
        let mut ring = match registered.map_err(|err| err.into_parts().1) {
            Ok(ring) => ring,
            Err(err) => {
                tracing::error!(error = %err, "cannot poll the eBPF ring buffer");
                let _ = sink
                    .send(FsEvent::Rescan {
                        reason: format!(
                            "eBPF event source stopped: cannot poll its ring buffer: {err}"
                        ),
                    })
                    .await;
                return;
            }
        };
        let mut seen_losses = [0u64; loss::COUNT as usize];
        let follow_up = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(follow_up);
        let mut following_up = false;
        let mut batch = Vec::with_capacity(MAX_BATCH);
        loop {
            let woken = tokio::select! {
                () = cancel.cancelled() => return,
                ready = ring.readable_mut() => match ready {
                    Ok(mut guard) => {
                        // Cleared before draining: a record committed during the drain re-arms it.
                        guard.clear_ready();
                        true
                    }
                    Err(err) => {
                        tracing::error!(error = %err, "polling the eBPF ring buffer failed");
                        return;
                    }
                },
                () = &mut follow_up, if following_up => false,
                () = filters.names_overflow() => false,
            };
            let mut drained = 0;
            let mut more = true;
            while more && drained < DRAIN_BUDGET {
                let (full, consumed) = drain(ring.get_mut(), &filters, &mut batch);
                (more, drained) = (full, drained + consumed);
                for event in batch.drain(..) {
                    if !send(&sink, &cancel, event).await {
                        return;
                    }
                }
            }
            let losses = Losses {
                counters: &losses,
                seen: &mut seen_losses,
            };
            match report_losses(losses, &filters, ring.get_mut(), &sink, &cancel).await {
                None => return,
                Some(left_queued) => more = more || left_queued,
            }
            let deadline = if more {
                // Stopped at the budget with records queued: come straight back for them.
                Some(Instant::now())
            } else {
                (woken || drained > 0).then(|| Instant::now() + batch_delay)
            };
            following_up = deadline.is_some();
            if let Some(deadline) = deadline {
                follow_up.as_mut().reset(deadline);
            }
        }
    }
}

/// Sends with back-pressure; false when the agent is stopping.
async fn send(sink: &Sender<FsEvent>, cancel: &CancellationToken, event: FsEvent) -> bool {
    // The channel almost always has room: skip the select and its cancellation future then.
    let event = match sink.try_send(event) {
        Ok(()) => return true,
        Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return false,
        Err(tokio::sync::mpsc::error::TrySendError::Full(event)) => event,
    };
    tokio::select! {
        () = cancel.cancelled() => false,
        sent = sink.send(event) => sent.is_ok(),
    }
}

/// Moves up to [`MAX_BATCH`] records into `batch`. Returns whether it stopped at the cap (more may
/// be queued) and how many records it consumed.
fn drain(ring: &mut Ring, filters: &Filters, batch: &mut Vec<FsEvent>) -> (bool, usize) {
    let mut consumed = 0;
    // One clock read per drain: what the reader adds to an event's latency starts here.
    let read_ns = Some(monotonic_now_ns());
    while consumed < MAX_BATCH {
        let Some(item) = ring.next() else {
            return (false, consumed);
        };
        consumed += 1;
        let Some(event) = record::decode(&item) else {
            tracing::warn!(len = item.len(), "ignoring a short eBPF ring-buffer record");
            continue;
        };
        drop(item);
        if let Some(mut fs_event) =
            record::translate(&event, |key| filters.path_of(key), |id| filters.name_of(id))
        {
            if let FsEvent::Created { observed, .. }
            | FsEvent::Removed { observed, .. }
            | FsEvent::NameChanged { observed, .. }
            | FsEvent::Serving { observed, .. }
            | FsEvent::Contacted { observed, .. } = &mut fs_event
            {
                observed.read_ns = read_ns;
            }
            batch.push(fs_event);
        }
    }
    (true, consumed)
}

/// Consumes, without reading them, at most one ring's worth of queued records (a bound, so a
/// flood that refills the ring as fast as it is emptied cannot keep the reader here). Returns
/// how many, and whether it stopped at the bound (more may be queued).
fn discard(ring: &mut Ring) -> (usize, bool) {
    // The smallest record: the event cut before its name (see `record::decode`), and its header.
    let smallest = std::mem::offset_of!(agent_ebpf::Event, name) + 8;
    let most = ring.size() / smallest;
    let mut discarded = 0;
    while discarded < most {
        if ring.next().is_none() {
            return (discarded, false);
        }
        discarded += 1;
    }
    (discarded, true)
}

/// Why a rescan is needed, if any loss counter moved since the last look.
struct LossReport {
    text: String,
    names_full: bool,
}

impl LossReport {
    /// Adds a name-table overflow seen in userspace to what the kernel counters said.
    fn merge(report: Option<LossReport>, names_full: &str) -> LossReport {
        match report {
            Some(report) => LossReport {
                text: format!("{}; {names_full}", report.text),
                names_full: true,
            },
            None => LossReport {
                text: names_full.to_string(),
                names_full: true,
            },
        }
    }
}

fn new_losses(
    losses: &LossCounters,
    seen: &mut [u64; loss::COUNT as usize],
    ring_buffer_bytes: u32,
) -> Option<LossReport> {
    let mut parts = Vec::new();
    let mut names_full = false;
    for (index, total) in (0..loss::COUNT).zip(losses.totals()) {
        let slot = &mut seen[index as usize];
        let lost = total.wrapping_sub(*slot);
        *slot = total;
        if lost == 0 {
            continue;
        }
        parts.push(match index {
            loss::RING_FULL => {
                format!("{lost} events lost: eBPF ring buffer ({ring_buffer_bytes} bytes) was full")
            }
            loss::PENDING_FULL => format!("{lost} syscalls not tracked: per-thread table was full"),
            loss::FEXIT_SKIPPED => format!(
                "{lost} VFS calls returned without their exit program: a trampoline was rebuilt \
                 while they ran"
            ),
            _ => {
                names_full = true;
                format!("{lost} names not recorded: eBPF name table was full")
            }
        });
    }
    (!parts.is_empty()).then(|| LossReport {
        text: parts.join("; "),
        names_full,
    })
}
