//! The safety pass's request to the watcher, and its share of the CPU.
//!
//! The safety pass (every `--safety-period`, 30 s, once the tree is quiet) walks the whole tree
//! and connects once to every unserved socket: what no event said is found there. Its cost grows
//! with the tree: with 100,000 dead sockets a pass took ~3.5 CPU s, 12% of a core for an agent
//! with nothing to do. Each part of a pass adds what it took here (the watcher its walk, the
//! executor its connects), and the next pass waits until the last one's cost is at most
//! [`CPU_SHARE`] of the time between them: every 30 s for an ordinary tree, every ~6 min at
//! 100,000 sockets, never more than [`MAX_STRETCH`] periods apart. Events, and the rescans a
//! loss or a mount asks for, are not delayed by it.
//!
//! ```text
//! reconciler: pass due --> request() --> watcher walks --> spent(walk)
//!                      \-> executor connects to unserved sockets --> spent(connects)
//! reconciler: at the pass, spacing(period) = max(period, spent / CPU_SHARE), at most MAX_STRETCH x period
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

/// At most this share of the time between two passes goes to a pass.
pub const CPU_SHARE: u32 = 100;
/// However costly, passes come at least every this many periods (10 min at the default 30 s).
pub const MAX_STRETCH: u32 = 20;

/// See the module docs.
#[derive(Debug, Default)]
pub struct SafetyPass {
    requested: Notify,
    spent_ns: AtomicU64,
}

impl SafetyPass {
    /// Asks the watcher for its walk (a stored permit: the request survives a busy watcher).
    pub fn request(&self) {
        self.requested.notify_one();
    }

    /// Returns when a walk was requested.
    pub async fn requested(&self) {
        self.requested.notified().await;
    }

    /// A part of a pass took `took`.
    pub fn spent(&self, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.spent_ns.fetch_add(nanos, Ordering::Relaxed);
    }

    /// How long to wait after a pass that starts now, for a configured `period`: the cost of
    /// the pass before it (counted once) times [`CPU_SHARE`], if that is longer.
    pub fn spacing(&self, period: Duration) -> Duration {
        let spent = Duration::from_nanos(self.spent_ns.swap(0, Ordering::Relaxed));
        spent
            .saturating_mul(CPU_SHARE)
            .clamp(period, period.saturating_mul(MAX_STRETCH))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_secs(30);

    #[test]
    fn a_cheap_pass_keeps_the_period_and_a_costly_one_stretches_it_to_its_share() {
        let pass = SafetyPass::default();
        pass.spent(Duration::from_millis(40));
        assert_eq!(pass.spacing(PERIOD), PERIOD);
        // 100,000 dead sockets: a 2.5 s walk and 1 s of connects.
        pass.spent(Duration::from_millis(2500));
        pass.spent(Duration::from_millis(1000));
        assert_eq!(pass.spacing(PERIOD), Duration::from_secs(350));
        // Counted once: a pass that cost nothing since.
        assert_eq!(pass.spacing(PERIOD), PERIOD);
        pass.spent(Duration::from_secs(3600));
        assert_eq!(pass.spacing(PERIOD), MAX_STRETCH * PERIOD);
    }
}
