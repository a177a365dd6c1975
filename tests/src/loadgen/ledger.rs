//! The ledger: everything observed during a run, from the plugins' side (worker reports) and the
//! agent's side (admin events), on one wall clock. Scenarios wait on it for conditions ("all
//! registered", "all deregistered") instead of sleeping, and the summary is computed from it.

use crate::plugins::Report;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// One plugin instance (one socket identity: every instance has its own path).
#[derive(Debug, Default, Clone)]
pub struct PluginRecord {
    /// Socket bound.
    pub bound_ns: u64,
    /// Listening and serving (latency is measured from here).
    pub serving_ns: Option<u64>,
    /// Socket unlinked.
    pub stopped_ns: Option<u64>,
    /// Every `Notify(true)` the plugin received.
    pub notified: Vec<u64>,
    /// `Notify(false)` count.
    pub rejected: u32,
    /// Admin `registered` events, with the agent lifetime (0, 1 after a restart...) they came in.
    pub registered_events: Vec<(u32, u64)>,
    /// Admin `deregistered` events.
    pub deregistered_events: Vec<u64>,
    /// Start failure, if any.
    pub error: Option<String>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct Ledger {
    /// By plugin id.
    pub plugins: HashMap<u64, PluginRecord>,
    /// Agent lifetime the admin stream currently follows (bumped on each restart).
    pub lifetime: u32,
    /// Intervals when the agent was up (ready to watch), `[from, to)`; `to` open while running.
    pub agent_up: Vec<(u64, Option<u64>)>,
    /// Events the admin stream dropped because this subscriber fell behind.
    pub admin_lagged: u64,
    /// Plugins whose first `Notify(true)` has arrived.
    pub registered: usize,
    /// Plugins stopped whose `deregistered` event has arrived.
    pub deregistered: usize,
    /// The restart scenarios' agent restarts.
    pub restarts: Vec<Restart>,
    /// With `loadgen run --floor`: the floor's input, told of every plugin that listens (`+ id`)
    /// or goes (`- id`) as the report arrives (see `floor`).
    pub floor: Option<tokio::sync::mpsc::UnboundedSender<String>>,
}

/// One agent restart, on the ledger's clock.
#[derive(Debug, Clone, Copy)]
pub struct Restart {
    /// The signal was sent to the old agent.
    pub signalled_ns: u64,
    /// The old agent was gone; the new one was spawned.
    pub spawned_ns: u64,
    /// The new agent's admin API listened.
    pub ready_ns: u64,
    /// The new agent's start, phase by phase (once its log said).
    pub phases: Option<super::agent::StartPhases>,
    /// The old agent's CPU over its whole life, ms, read as it was reaped: the load's CPU is the
    /// old agent's from the load's start to its exit plus the new one's.
    pub stopped_agent_cpu_ms: u64,
    /// The old agent's CPU when it was signalled, ms: `stopped_agent_cpu_ms` less this is what
    /// its shutdown cost.
    pub signalled_agent_cpu_ms: u64,
    /// The new agent's CPU when its admin API listened, ms: what its start cost.
    pub ready_agent_cpu_ms: u64,
}

/// The ledger shared by the report and admin tasks and the scenario.
#[derive(Clone, Default)]
pub struct SharedLedger {
    inner: Arc<(Mutex<Ledger>, Notify)>,
}

impl SharedLedger {
    /// Locks the ledger.
    pub fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.inner.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn changed(&self) {
        self.inner.1.notify_waiters();
    }

    /// Records a worker report.
    pub fn report(&self, report: Report) {
        {
            let mut ledger = self.lock();
            match report {
                Report::Serving {
                    id,
                    bound_ns,
                    serving_ns,
                } => {
                    let record = ledger.plugins.entry(id).or_default();
                    record.bound_ns = bound_ns;
                    record.serving_ns = Some(serving_ns);
                    if let Some(floor) = &ledger.floor {
                        let _ = floor.send(format!("+ {id}\n"));
                    }
                }
                Report::Notified {
                    id,
                    registered,
                    at_ns,
                } => {
                    let record = ledger.plugins.entry(id).or_default();
                    if registered {
                        record.notified.push(at_ns);
                        if record.notified.len() == 1 {
                            ledger.registered += 1;
                        }
                    } else {
                        record.rejected += 1;
                    }
                }
                Report::Stopped { id, at_ns } => {
                    if let Some(floor) = &ledger.floor {
                        let _ = floor.send(format!("- {id}\n"));
                    }
                    let record = ledger.plugins.entry(id).or_default();
                    record.stopped_ns = Some(at_ns);
                    if !record.deregistered_events.is_empty() {
                        // The event beat the report (both are asynchronous).
                        ledger.deregistered += 1;
                    }
                }
                Report::Failed { id, error } => {
                    ledger.plugins.entry(id).or_default().error = Some(error);
                }
            }
        }
        self.changed();
    }

    /// Tells the floor (see `floor`) of every plugin that listens or goes from now on; `None`
    /// stops telling it (its input then closes).
    pub fn tell_floor(&self, floor: Option<tokio::sync::mpsc::UnboundedSender<String>>) {
        self.lock().floor = floor;
    }

    /// Records an admin `registered` event for plugin `id`.
    pub fn admin_registered(&self, id: u64, at_ns: u64) {
        {
            let mut ledger = self.lock();
            let lifetime = ledger.lifetime;
            ledger
                .plugins
                .entry(id)
                .or_default()
                .registered_events
                .push((lifetime, at_ns));
        }
        self.changed();
    }

    /// Records an admin `deregistered` event for plugin `id`.
    pub fn admin_deregistered(&self, id: u64, at_ns: u64) {
        {
            let mut ledger = self.lock();
            let record = ledger.plugins.entry(id).or_default();
            record.deregistered_events.push(at_ns);
            if record.deregistered_events.len() == 1 && record.stopped_ns.is_some() {
                ledger.deregistered += 1;
            }
        }
        self.changed();
    }

    /// Records that the admin stream lost `n` events.
    pub fn admin_lagged(&self, n: u64) {
        self.lock().admin_lagged += n;
    }

    /// Waits until `done(ledger)` holds or `deadline` passes; true when it holds.
    pub async fn wait_until(&self, deadline: Instant, done: impl Fn(&Ledger) -> bool) -> bool {
        loop {
            let notified = self.inner.1.notified();
            tokio::pin!(notified);
            // Registered before the check, so no change between check and wait is missed.
            notified.as_mut().enable();
            if done(&self.lock()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return done(&self.lock());
            }
        }
    }

    /// Waits for `done` at most `timeout`.
    pub async fn wait_for(&self, timeout: Duration, done: impl Fn(&Ledger) -> bool) -> bool {
        self.wait_until(Instant::now() + timeout, done).await
    }

    /// Checks `done` every `period` until it holds or `timeout` passes; true when it holds. For
    /// conditions that cost a walk over every plugin: re-checking them on each of thousands of
    /// changes would make the load generator the bottleneck it is measuring.
    pub async fn check_every(
        &self,
        period: Duration,
        timeout: Duration,
        done: impl Fn(&Ledger) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if done(&self.lock()) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(period).await;
        }
    }
}
