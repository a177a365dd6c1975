//! The shutdown deadline: SIGTERM ends the agent within [`DEADLINE`], whatever is open.
//!
//! ```text
//! SIGTERM ──> discovery and reconciliation stop (no new operation is started from here on)
//!         ──> operations waiting for a slot, and dials not yet answered, end at once
//!         ──> operations already talking to a handler get until OPERATIONS_GRACE
//!         ──> every open metrics and admin connection is ended (`serving`)
//!         ──> the last spans are flushed in what is left of DEADLINE, the process exits
//! ```
//!
//! Why a deadline and not "wait for everything": a connection or a plugin that never finishes
//! would otherwise hold the agent (and its pod's termination) for as long as it likes. An
//! operation cut at the deadline is, for the handler, the same as a SIGKILL: the next agent
//! registers the plugin again, which handlers take as a refresh (docs/operations.md).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// SIGTERM to exit, at most.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// How long running operations may take to finish after SIGTERM; the rest of [`DEADLINE`] is for
/// closing connections and the runtime.
pub const OPERATIONS_GRACE: Duration = Duration::from_secs(4);

/// When the stop signal arrived (set once, by `run`).
static BEGAN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// The stop signal arrived: from now on [`remaining`] counts down.
pub fn begin() {
    let _ = BEGAN.set(Instant::now());
}

/// What is left of [`DEADLINE`] since [`begin`] (all of it before, for an exit without a signal).
pub fn remaining() -> Duration {
    BEGAN
        .get()
        .map_or(DEADLINE, |began| DEADLINE.saturating_sub(began.elapsed()))
}

/// Runs `work` unless `stop` fires first (then `None`: the work is dropped where it waits).
pub fn unless_stopping<F: Future>(stop: &CancellationToken, work: F) -> UnlessStopping<'_, F> {
    UnlessStopping {
        stopped: stop.cancelled(),
        work,
    }
}

pin_project_lite::pin_project! {
    /// [`unless_stopping`]: `work` polled where it lies, after the stop. (As an `async fn` over
    /// `select!`, the work was moved twice more before its first poll, and a registration's dial
    /// is kilobytes of future.)
    pub struct UnlessStopping<'a, F> {
        #[pin]
        stopped: WaitForCancellationFuture<'a>,
        #[pin]
        work: F,
    }
}

impl<F: Future> Future for UnlessStopping<'_, F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if this.stopped.poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        this.work.poll(cx).map(Some)
    }
}

/// Waits for `work` until `deadline`; says what was cut short if it did not finish.
pub async fn until(deadline: Instant, what: &str, work: impl Future<Output = ()>) {
    if tokio::time::timeout_at(deadline, work).await.is_err() {
        tracing::warn!(
            what,
            "shutdown deadline reached; ending what is still running"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_is_not_started_once_stopping() {
        let stop = CancellationToken::new();
        stop.cancel();
        let ran = unless_stopping(&stop, async { true }).await;
        assert_eq!(ran, None);
    }

    #[tokio::test(start_paused = true)]
    async fn work_ends_where_it_waits_when_the_stop_comes_and_runs_to_its_end_otherwise() {
        let stop = CancellationToken::new();
        assert_eq!(unless_stopping(&stop, async { 7 }).await, Some(7));
        let stopping = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            stopping.cancel();
        });
        let started = Instant::now();
        let waited = unless_stopping(&stop, std::future::pending::<()>()).await;
        assert_eq!((waited, started.elapsed()), (None, Duration::from_secs(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn until_returns_at_the_deadline() {
        let started = Instant::now();
        until(
            started + Duration::from_secs(4),
            "test",
            std::future::pending(),
        )
        .await;
        assert_eq!(started.elapsed(), Duration::from_secs(4));
    }
}
