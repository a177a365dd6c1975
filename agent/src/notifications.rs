//! Notifications: what the watcher and the executor did, published as [`AgentEvent`]s for whoever
//! watches (the admin API's `WatchEvents` stream, `plugin-agent watch`, load generators measuring
//! deregistration). Not to be confused with the event source's `FsEvent`s, which are the hints
//! *into* the data flow; these come *out* of it.
//!
//! A broadcast channel: publishing never blocks the data flow; a subscriber that falls behind
//! loses the oldest events and is told how many (`Lagged`). Events travel as `Arc`s: the channel
//! preallocates every slot, and a slot of a pointer is a tenth of a slot of an event, so the
//! channel holds four times the events in less memory (see [`CAPACITY`]).
//!
//! An event about a socket carries the socket's reason (`state::verdict`) as it was when the
//! event was published, stamped here from the agent's [`StateView`]: a watcher that reads late
//! sees each event's reason of its moment, not a later one on an older event.

use crate::handler::Plugin;
use crate::provenance::{Contact, Provenance};
use crate::state::verdict::Reason;
use crate::state::view::StateView;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::broadcast;

/// Events kept for slow subscribers before they lag. Removing 10,000 plugins at once publishes
/// 20,000 events in under half a second; with 4,096 a `watch` following them (the load
/// generator's, measuring deregistrations) lost 2,000-10,000 of them on 2 CPUs. The slots are
/// allocated up front: 16,384 pointer-sized slots take 0.6 MB, where 4,096 slots holding whole
/// events took 1.6 MB.
const CAPACITY: usize = 16_384;

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// A socket appeared under the tree (desired state add).
    SocketDiscovered,
    /// A socket left the tree (desired state remove).
    SocketRemoved,
    /// Registration completed: the plugin got Notify(true).
    Registered,
    /// Observe mode: the plugin was described (GetInfo, unless contact is off); nothing was
    /// told to it or to any handler.
    Observed,
    /// A registration attempt failed; `error` says why.
    RegistrationFailed,
    /// The plugin was deregistered from its handler.
    Deregistered,
    /// Nothing serves the plugin's socket (its server exited, or it refuses connections); `error`
    /// says what was found and how. A registered plugin is deregistered next.
    Unserved,
    /// The policy refuses the plugin; `error` is the refusal it was sent.
    Rejected,
    /// The watcher began walking the whole tree; `detail` says why.
    Rescan,
    /// The watcher finished walking the whole tree: `walk` says why and what it found. Desired
    /// state and the watched set are the walk's from here (the start walk's is the agent's
    /// readiness, as `/readyz` reports it).
    Walked,
    /// (eBPF) A process other than the agent connected to the socket for the first time:
    /// `contact` says who and when, `latency` how long after the socket's creation.
    FirstContact,
    /// Something serves the socket, and the agent learned it now: `serving` says how and who.
    Served,
    /// A registration attempt ended without an outcome (its socket vanished or was replaced,
    /// or the agent is stopping); `detail` says which. Not a failure (no `RegistrationFailed`).
    RegistrationAbandoned,
    /// The policy was read again and applied: `policy_reload` says what changed.
    PolicyReloaded,
    /// A policy reload was refused (`error`: where the file breaks); the policy in force stays.
    PolicyReloadFailed,
}

/// One event.
#[derive(Debug, Clone)]
pub struct AgentEvent {
    /// When it happened.
    pub at: SystemTime,
    /// What happened.
    pub kind: EventKind,
    /// The socket concerned (the root directory for rescans and walks, the configuration file
    /// for policy reloads).
    pub socket_path: PathBuf,
    /// The plugin, once GetInfo has answered.
    pub plugin: Option<Plugin>,
    /// The error, for failures.
    pub error: Option<String>,
    /// For registrations: from the kernel event (or discovery) to Notify(true).
    pub latency: Option<Duration>,
    /// Free-form detail (rescan reason...).
    pub detail: Option<String>,
    /// For registrations, observations and refusals: who created the socket and who serves it.
    pub provenance: Option<Provenance>,
    /// For first contacts: who connected, and when.
    pub contact: Option<Contact>,
    /// For finished walks: why, and what the tree held.
    pub walk: Option<Walk>,
    /// For `Served`: how the agent learned it, and which processes serve the socket.
    pub serving: Option<Serving>,
    /// For policy reloads: what asked for it, and what it changed.
    pub policy_reload: Option<PolicyReloadReport>,
    /// The socket's reason when the event was published (see the module docs); none for events
    /// about no socket, a removed one, or one the agent no longer knows.
    pub reason: Option<Reason>,
}

/// How the agent knows that something serves a socket (`Served`, and `list` for a registered
/// plugin).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Serving {
    /// `registration`, `record`, `connect_probe`, `holders`, `kernel_listen`, `safety_pass`:
    /// the labels of `liveness::ServedBy`.
    pub learned_by: &'static str,
    /// The processes whose exits the agent waits for in the plugin's place (none known yet: the
    /// registration that follows a listen learns them).
    pub pids: Vec<u32>,
}

/// A policy reload, as `PolicyReloaded` and `PolicyReloadFailed` report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PolicyReloadReport {
    /// `sighup` or `admin_api`.
    pub trigger: &'static str,
    /// Rules in force after it.
    pub rules: usize,
    /// Registered plugins the new policy refuses (deregistered).
    pub refused: usize,
    /// Plugins the old policy refused, tried again.
    pub retried: usize,
}

/// A finished full walk of the tree, as `Walked` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walk {
    /// Why the tree was walked (`start`, `periodic safety pass`, a loss, ...).
    pub reason: String,
    /// Directories watched after it.
    pub directories: u64,
    /// Sockets desired after it.
    pub sockets: u64,
    /// Desired sockets it no longer found (forgotten).
    pub removed: u64,
    /// Directories it could not read (their known sockets are kept; status says which).
    pub kept_unread: u64,
}

impl AgentEvent {
    /// An event about `socket_path`, now.
    pub fn new(kind: EventKind, socket_path: impl Into<PathBuf>) -> Self {
        AgentEvent {
            at: SystemTime::now(),
            kind,
            socket_path: socket_path.into(),
            plugin: None,
            error: None,
            latency: None,
            detail: None,
            provenance: None,
            contact: None,
            walk: None,
            serving: None,
            policy_reload: None,
            reason: None,
        }
    }
}

/// The publishing side; cheap to clone.
#[derive(Debug, Clone)]
pub struct NotificationBus {
    tx: broadcast::Sender<Arc<AgentEvent>>,
    /// Where events' reasons are derived from (none: events carry none).
    reasons: Option<StateView>,
}

impl Default for NotificationBus {
    fn default() -> Self {
        NotificationBus {
            tx: broadcast::channel(CAPACITY).0,
            reasons: None,
        }
    }
}

impl NotificationBus {
    /// A bus whose events about a socket carry its reason as `view` derives it when they are
    /// published.
    pub fn deriving_reasons(view: StateView) -> Self {
        NotificationBus {
            reasons: Some(view),
            ..NotificationBus::default()
        }
    }

    /// Publishes to current subscribers (none is fine, and then costs no allocation, nor the
    /// reason's derivation).
    pub fn publish(&self, mut event: AgentEvent) {
        if self.tx.receiver_count() > 0 {
            if let Some(view) = &self.reasons {
                event.reason = reason_now(view, &event);
            }
            let _ = self.tx.send(Arc::new(event));
        }
    }

    /// A new subscription, starting now.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<AgentEvent>> {
        self.tx.subscribe()
    }
}

/// The reason of the socket `event` is about, now: the one `list` shows (events about no
/// socket, a removed one, or one the agent no longer knows carry none).
fn reason_now(view: &StateView, event: &AgentEvent) -> Option<Reason> {
    let about_a_socket = !matches!(
        event.kind,
        EventKind::Rescan | EventKind::Walked | EventKind::SocketRemoved
    );
    if !about_a_socket || event.socket_path.as_os_str().is_empty() {
        return None;
    }
    let status = view.status(&event.socket_path, tokio::time::Instant::now());
    (status.desired.is_some() || status.registered.is_some()).then_some(status.reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::broadcast::error::TryRecvError;

    fn removed(i: usize) -> AgentEvent {
        AgentEvent::new(EventKind::SocketRemoved, format!("/plugins/p-{i}.sock"))
    }

    /// A watcher that reads nothing while 10,000 plugins go (two events each) loses none of the
    /// last `CAPACITY`, and is told exactly how many went before them.
    #[test]
    fn a_subscriber_that_falls_behind_keeps_the_newest_events_and_is_told_how_many_it_lost() {
        let bus = NotificationBus::default();
        let mut watch = bus.subscribe();
        let published = 20_000;
        for i in 0..published {
            bus.publish(removed(i));
        }
        assert_eq!(
            watch.try_recv().map(|e| e.socket_path.clone()),
            Err(TryRecvError::Lagged((published - CAPACITY) as u64))
        );
        let mut kept = 0;
        while let Ok(event) = watch.try_recv() {
            assert_eq!(
                event.socket_path,
                removed(published - CAPACITY + kept).socket_path
            );
            kept += 1;
        }
        assert_eq!(kept, CAPACITY);
    }
}
