//! Exponential backoff for failed operations, keyed by socket *identity*.
//!
//! Kubelet keys its backoff by socket path, so a plugin that re-creates its socket after a failure
//! can wait minutes (node-driver-registrar issue 206). Here the key is the path plus the socket
//! instance: a new socket starts fresh, a broken one backs off 500 ms, 1 s, 2 s ... up to 2 m 2 s.
//!
//! One exception, before the chain: a plugin that has just started serving and misses GetInfo's
//! 1 s deadline (busy starting up: kubernetes issue 127457) is asked again after
//! [`QUICK_RETRY_DELAY`], at most [`QUICK_RETRIES`] times, before it is treated as broken.
//!
//! And one entry that is not a failure: a socket that refuses connections (bound, not listening
//! yet) waits here for its listen ([`FailureKind::WaitingToListen`]), released by the kernel's
//! report of it or looked at again after [`LISTEN_POLL_FIRST`], doubling to [`LISTEN_POLL_MAX`],
//! by sources that do not report listens. An entry costs ~200 bytes where the attempt held open
//! through the wait cost ~6 KB.

use super::SocketId;
use super::path_key::{BySocket, PathKey};
use crate::handler::Plugin;
use crate::policy::Refusal;
use crate::provenance::Provenance;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Kubelet's `initialDurationBeforeRetry`.
pub const INITIAL_DELAY: Duration = Duration::from_millis(500);
/// Kubelet's `maxDurationBeforeRetry` (2 m 2 s).
pub const MAX_DELAY: Duration = Duration::from_secs(122);
/// The pause before asking a slow new plugin again.
pub const QUICK_RETRY_DELAY: Duration = Duration::from_millis(100);
/// Quick retries of a slow new plugin before the backoff chain starts.
pub const QUICK_RETRIES: u32 = 3;
/// First look again at a socket waiting to listen, where no listen is reported.
pub const LISTEN_POLL_FIRST: Duration = Duration::from_millis(8);
/// Longest wait between two looks at a socket waiting to listen, where no listen is reported
/// (kubelet's reconciler looks once a second).
pub const LISTEN_POLL_MAX: Duration = Duration::from_secs(1);

/// Why the last attempt failed, as far as retry policy cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureKind {
    /// No handler for this plugin type, or its handler is unreachable: the plugin is not at
    /// fault, and is retried as soon as a handler is added or comes back, not only on backoff.
    WaitingForHandler { plugin_type: String },
    /// GetInfo's deadline passed on a plugin that has just started serving: retried quickly
    /// ([`QUICK_RETRY_DELAY`]) for its first [`QUICK_RETRIES`] failures, then as any failure.
    SlowNewPlugin,
    /// Nothing serves the socket (see `liveness`): not retried at all until the socket changes
    /// (a new socket is a new key; a removal or rename forgets the path).
    Unserved {
        /// How it was learned: `pidfd`, `kernel_release`, `connect_probe`.
        learned_by: &'static str,
        /// When it was learned (the server's exit, or the refused connect).
        since: Instant,
    },
    /// The policy refuses the plugin (see `policy`): like an unserved socket, not retried
    /// until the socket changes, or the policy does.
    Rejected {
        /// What refused it.
        refusal: Arc<Refusal>,
        /// What the plugin said it is.
        plugin: Arc<Plugin>,
        /// Who made and serves the socket, as the policy saw them (boxed: every held socket's
        /// entry is as large as the largest kind).
        provenance: Box<Provenance>,
    },
    /// Not a failure: the socket refuses connections (bound, not listening yet) and may listen
    /// until `until`, when it counts as unserved. Released by the kernel's report of its listen.
    WaitingToListen {
        /// The end of its wait.
        until: Instant,
    },
    /// Not a failure: observe mode waits for kubelet to contact the socket first, until
    /// `until` (see `mode::KUBELET_FIRST`); a contact recorded in desired state ends the wait.
    WaitingForKubelet {
        /// The end of its wait.
        until: Instant,
    },
    /// GetInfo answered what no handler should see (an empty type or name, oversized fields):
    /// retried as any failure; `explain`'s `invalid_info`.
    InvalidInfo,
    /// The socket's mode and owner refused the agent's connect (`EACCES`): retried as any
    /// failure (a chmod fixes it); `explain`'s `socket_permissions`.
    PermissionDenied,
    /// The handler refused the plugin (its Validate or Register failed): retried as any
    /// failure; `explain`'s `handler_refused`.
    HandlerRefused,
    /// Anything else.
    Other,
}

impl FailureKind {
    pub fn is_unserved(&self) -> bool {
        matches!(self, FailureKind::Unserved { .. })
    }

    pub fn is_rejected(&self) -> bool {
        matches!(self, FailureKind::Rejected { .. })
    }

    /// Held until the socket changes (never retried by time): unserved or rejected.
    pub fn is_held(&self) -> bool {
        self.is_unserved() || self.is_rejected()
    }

    /// Waiting for its socket to listen (not a failure).
    pub fn is_waiting_to_listen(&self) -> bool {
        matches!(self, FailureKind::WaitingToListen { .. })
    }

    /// Waiting for its socket to listen or for kubelet's first contact: not a failure, the
    /// plugin is pending.
    pub fn is_waiting(&self) -> bool {
        matches!(
            self,
            FailureKind::WaitingToListen { .. } | FailureKind::WaitingForKubelet { .. }
        )
    }
}

/// What a socket's listen released in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenReleased {
    Nothing,
    /// An unserved mark: the socket serves again.
    Unserved,
    /// A wait for its first listen.
    Waiting,
}

/// A plugin's valid GetInfo answer, kept with the failure that came after it (no handler, the
/// handler refused, Notify failed): `explain` finds the socket by the driver name it announced
/// and shows the answer. One per socket instance, gone with its entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answered {
    /// When the answer came.
    pub at: std::time::SystemTime,
    pub plugin: Plugin,
}

/// How far "never" is for an unserved socket's `retry_at` (a representable instant that no
/// agent lives to see).
const NEVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The backoff of one socket instance.
#[derive(Debug, Clone)]
pub struct Backoff {
    /// Failures in a row.
    pub failures: u32,
    /// Delay applied after the last failure.
    pub delay: Duration,
    /// No new attempt before this instant.
    pub retry_at: Instant,
    /// The last error, for operators (exactly its length: one is kept per failed socket, and
    /// a tree of dead sockets has one per socket).
    pub last_error: Box<str>,
    /// Retry-policy class of the last error.
    pub kind: FailureKind,
    /// The plugin's last valid GetInfo answer, when a failure came after one.
    pub answered: Option<Arc<Answered>>,
}

impl Backoff {
    /// What the plugin said it is, as far as known: the refused plugin, else the answer kept.
    pub fn plugin(&self) -> Option<&Plugin> {
        match &self.kind {
            FailureKind::Rejected { plugin, .. } => Some(plugin),
            _ => self.answered.as_ref().map(|a| &a.plugin),
        }
    }
}

type Key = (PathKey<PathBuf>, SocketId);

/// All backoffs, keyed by (path, socket identity).
#[derive(Debug, Default)]
pub struct BackoffTable {
    entries: Mutex<hashbrown::HashMap<Key, Backoff, super::PathHasher>>,
}

/// The key of `socket` at `path`, to put an entry in.
fn key(path: &Path, socket: SocketId) -> Key {
    (PathKey(path.to_path_buf()), socket)
}

impl BackoffTable {
    /// When the next attempt for this socket may start, if it is backing off now. A wait for
    /// kubelet's first contact ends with the contact (`contacted`).
    pub fn blocked_until(
        &self,
        path: &Path,
        socket: SocketId,
        now: Instant,
        contacted: bool,
    ) -> Option<Instant> {
        let entries = self.lock();
        let backoff = entries.get(&BySocket(path, socket))?;
        if contacted && matches!(backoff.kind, FailureKind::WaitingForKubelet { .. }) {
            return None;
        }
        (backoff.retry_at > now).then_some(backoff.retry_at)
    }

    /// Whether an attempt at this socket may start at `now`: `Err` with when it may while it
    /// backs off (as [`Self::blocked_until`]), else the attempt's number (1 for a socket that
    /// never failed). One lookup, where the two questions were two.
    pub fn attempt(
        &self,
        path: &Path,
        socket: SocketId,
        now: Instant,
        contacted: bool,
    ) -> Result<u32, Instant> {
        let entries = self.lock();
        let Some(backoff) = entries.get(&BySocket(path, socket)) else {
            return Ok(1);
        };
        let contact_ends_it =
            contacted && matches!(backoff.kind, FailureKind::WaitingForKubelet { .. });
        if !contact_ends_it && backoff.retry_at > now {
            return Err(backoff.retry_at);
        }
        Ok(backoff.failures + 1)
    }

    /// Records a failure and returns the backoff now in force.
    pub fn fail(
        &self,
        path: &Path,
        socket: SocketId,
        error: String,
        kind: FailureKind,
        now: Instant,
    ) -> Backoff {
        let mut entries = self.lock();
        let entry = entries.entry(key(path, socket));
        match entry {
            hashbrown::hash_map::Entry::Occupied(mut occupied) => {
                let b = occupied.get_mut();
                b.delay = if kind == FailureKind::SlowNewPlugin && b.failures < QUICK_RETRIES {
                    QUICK_RETRY_DELAY
                } else if b.delay < INITIAL_DELAY {
                    // The chain starts where kubelet's does, after the quick retries.
                    INITIAL_DELAY
                } else {
                    (b.delay * 2).min(MAX_DELAY)
                };
                b.failures += 1;
                b.retry_at = now + b.delay;
                b.last_error = error.into_boxed_str();
                b.kind = kind;
                b.clone()
            }
            hashbrown::hash_map::Entry::Vacant(vacant) => {
                let delay = if kind == FailureKind::SlowNewPlugin {
                    QUICK_RETRY_DELAY
                } else {
                    INITIAL_DELAY
                };
                vacant
                    .insert(Backoff {
                        failures: 1,
                        delay,
                        retry_at: now + delay,
                        last_error: error.into_boxed_str(),
                        kind,
                        answered: None,
                    })
                    .clone()
            }
        }
    }

    /// Records that nothing serves this socket, or the policy refuses it (`kind`): no retry
    /// until it changes. Replaces a backoff.
    pub fn hold(
        &self,
        path: &Path,
        socket: SocketId,
        reason: String,
        kind: FailureKind,
    ) -> Backoff {
        debug_assert!(kind.is_held());
        let previous = self.get(path, socket);
        let backoff = Backoff {
            failures: previous.as_ref().map_or(0, |b| b.failures) + 1,
            delay: NEVER,
            retry_at: Instant::now() + NEVER,
            last_error: reason.into_boxed_str(),
            kind,
            answered: previous.and_then(|b| b.answered),
        };
        self.lock().insert(key(path, socket), backoff.clone());
        backoff
    }

    /// The socket refuses connections and may listen until `until`: records the wait, replacing
    /// a failure's backoff, and returns it. Its next look is at `until` where the kernel reports
    /// listens (`listens_reported`), else after a poll delay doubling from [`LISTEN_POLL_FIRST`]
    /// to [`LISTEN_POLL_MAX`]. Not a failure: the failure count is kept as it was.
    pub fn wait_to_listen(
        &self,
        path: &Path,
        socket: SocketId,
        until: Instant,
        listens_reported: bool,
        reason: String,
        now: Instant,
    ) -> Backoff {
        let mut entries = self.lock();
        let previous = entries.get(&BySocket(path, socket));
        let failures = previous.map_or(0, |b| b.failures);
        let delay = match previous {
            Some(b) if b.kind.is_waiting_to_listen() => (b.delay * 2).min(LISTEN_POLL_MAX),
            _ => LISTEN_POLL_FIRST,
        };
        let retry_at = if listens_reported {
            until
        } else {
            (now + delay).min(until)
        };
        let backoff = Backoff {
            failures,
            delay,
            retry_at,
            last_error: reason.into_boxed_str(),
            kind: FailureKind::WaitingToListen { until },
            answered: previous.and_then(|b| b.answered.clone()),
        };
        entries.insert(key(path, socket), backoff.clone());
        backoff
    }

    /// A look at a socket waiting to listen found it still refusing at `now`: the next look is
    /// later (doubling, as [`Self::wait_to_listen`]); `None` if it no longer waits.
    pub fn listen_look_refused(
        &self,
        path: &Path,
        socket: SocketId,
        now: Instant,
    ) -> Option<Instant> {
        let mut entries = self.lock();
        let backoff = entries.get_mut(&BySocket(path, socket))?;
        let FailureKind::WaitingToListen { until } = backoff.kind else {
            return None;
        };
        backoff.delay = (backoff.delay * 2).min(LISTEN_POLL_MAX);
        backoff.retry_at = (now + backoff.delay).min(until);
        Some(backoff.retry_at)
    }

    /// Observe mode waits for kubelet's first contact with the socket until `until`: records
    /// the wait (the next look is then, or at the contact) and returns it. Not a failure.
    pub fn wait_for_kubelet(
        &self,
        path: &Path,
        socket: SocketId,
        until: Instant,
        reason: String,
    ) -> Backoff {
        let mut entries = self.lock();
        let previous = entries.get(&BySocket(path, socket));
        let backoff = Backoff {
            failures: previous.map_or(0, |b| b.failures),
            delay: Duration::ZERO,
            retry_at: until,
            last_error: reason.into_boxed_str(),
            kind: FailureKind::WaitingForKubelet { until },
            answered: previous.and_then(|b| b.answered.clone()),
        };
        entries.insert(key(path, socket), backoff.clone());
        backoff
    }

    /// Lifts the unserved mark, or the wait to listen, of `socket` at `path` (it started
    /// listening); says which it was. One lookup: a listen is reported for every plugin, and
    /// the table may hold 100,000 dead sockets.
    pub fn release_on_listen(&self, path: &Path, socket: SocketId) -> ListenReleased {
        let mut entries = self.lock();
        let key = BySocket(path, socket);
        let released = match entries.get(&key).map(|b| &b.kind) {
            Some(FailureKind::Unserved { .. }) => ListenReleased::Unserved,
            Some(FailureKind::WaitingToListen { .. }) => ListenReleased::Waiting,
            _ => return ListenReleased::Nothing,
        };
        entries.remove(&key);
        released
    }

    /// Lifts every wait to listen (the listens reported may have been lost); returns their
    /// paths, to be looked at again.
    pub fn release_waiting_to_listen(&self) -> Vec<PathBuf> {
        self.release_where(FailureKind::is_waiting_to_listen)
    }

    /// Lifts every policy refusal (the policy changed); returns their paths, to be tried again.
    pub fn release_rejected(&self) -> Vec<PathBuf> {
        self.release_where(FailureKind::is_rejected)
    }

    /// Lifts every backoff whose kind `lifted` says; returns their paths.
    fn release_where(&self, lifted: impl Fn(&FailureKind) -> bool) -> Vec<PathBuf> {
        let mut released = Vec::new();
        self.lock().retain(|(path, _), backoff| {
            let lift = lifted(&backoff.kind);
            if lift {
                released.push(path.0.clone());
            }
            !lift
        });
        released
    }

    /// Every socket marked unserved now, with its path.
    pub fn unserved_sockets(&self) -> Vec<(PathBuf, SocketId)> {
        self.lock()
            .iter()
            .filter(|(_, b)| b.kind.is_unserved())
            .map(|((path, socket), _)| (path.0.clone(), *socket))
            .collect()
    }

    /// Whether nothing serves this socket (see [`Self::unserved`]).
    pub fn is_unserved(&self, path: &Path, socket: SocketId) -> bool {
        self.lock()
            .get(&BySocket(path, socket))
            .is_some_and(|b| b.kind.is_unserved())
    }

    /// The end of this socket's wait to listen, if it waits.
    pub fn waiting_to_listen_until(&self, path: &Path, socket: SocketId) -> Option<Instant> {
        match self.lock().get(&BySocket(path, socket))?.kind {
            FailureKind::WaitingToListen { until } => Some(until),
            _ => None,
        }
    }

    /// Whether this socket is held (unserved or rejected): a registration of it is ended.
    pub fn is_held(&self, path: &Path, socket: SocketId) -> bool {
        self.lock()
            .get(&BySocket(path, socket))
            .is_some_and(|b| b.kind.is_held())
    }

    /// Whether no socket backs off now: most of the time, so a caller may skip reading a
    /// socket's identity before asking about it.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Forgets the socket's failures (success, or the socket is gone).
    pub fn reset(&self, path: &Path, socket: SocketId) {
        let mut entries = self.lock();
        // Most sockets never failed: no key to hash.
        if !entries.is_empty() {
            entries.remove(&BySocket(path, socket));
        }
    }

    /// Forgets every backoff of `path` (its socket is gone from the tree).
    pub fn forget_path(&self, path: &Path) {
        self.lock().retain(|(p, _), _| p.0 != path);
    }

    /// Lifts the backoff of every plugin that failed only for lack of a (reachable) `plugin_type`
    /// handler;
    /// returns their paths so they can be retried now.
    pub fn release_waiting_for(&self, plugin_type: &str) -> Vec<PathBuf> {
        self.release_where(
            |kind| matches!(kind, FailureKind::WaitingForHandler { plugin_type: t } if t == plugin_type),
        )
    }

    /// The backoff of a socket, for status reporting.
    pub fn get(&self, path: &Path, socket: SocketId) -> Option<Backoff> {
        self.lock().get(&BySocket(path, socket)).cloned()
    }

    /// Keeps `answered`, the GetInfo answer of the failed socket `socket` at `path`, with its
    /// failure (nothing when it has none).
    pub fn answered(&self, path: &Path, socket: SocketId, answered: Arc<Answered>) {
        if let Some(backoff) = self.lock().get_mut(&BySocket(path, socket)) {
            backoff.answered = Some(answered);
        }
    }

    /// The paths of failed sockets whose plugins said they are `name`: refused by the policy, or
    /// failed after a valid GetInfo (`explain` by a name no registered plugin carries: one pass
    /// over the failed sockets, not the tree).
    pub fn named(&self, name: &str) -> Vec<PathBuf> {
        self.lock()
            .iter()
            .filter(|(_, b)| b.plugin().is_some_and(|plugin| plugin.name == name))
            .map(|((path, _), _)| path.0.clone())
            .collect()
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, hashbrown::HashMap<Key, Backoff, super::PathHasher>> {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(ino: u64) -> SocketId {
        SocketId {
            dev: 1,
            ino,
            birth_ns: None,
            handle: None,
        }
    }

    /// A failed plugin's GetInfo answer stays with its socket's entry through later failures,
    /// holds and waits, finds it by name, and goes with the entry.
    #[test]
    fn a_failed_plugins_answer_is_kept_with_its_socket_and_found_by_name() {
        let table = BackoffTable::default();
        let now = Instant::now();
        let path = Path::new("/r/a.sock");
        let kind = FailureKind::WaitingForHandler {
            plugin_type: "CSIPlugin".into(),
        };
        table.fail(path, id(1), "no handler".into(), kind, now);
        let plugin = Plugin {
            plugin_type: "CSIPlugin".into(),
            name: "a.example.com".into(),
            endpoint: String::new(),
            supported_versions: vec!["1.0.0".into()],
            socket_path: path.display().to_string(),
        };
        let answered = Arc::new(Answered {
            at: std::time::SystemTime::now(),
            plugin,
        });
        table.answered(path, id(1), answered.clone());
        table.fail(path, id(1), "x".into(), FailureKind::Other, now);
        let unserved = FailureKind::Unserved {
            learned_by: "pidfd",
            since: now,
        };
        table.hold(path, id(1), "gone".into(), unserved);
        let kept = table.get(path, id(1)).and_then(|b| b.answered);
        assert_eq!(kept, Some(answered));
        assert_eq!(table.named("a.example.com"), vec![path.to_path_buf()]);
        assert!(table.named("b.example.com").is_empty());
        table.forget_path(path);
        assert!(table.named("a.example.com").is_empty());
    }

    #[test]
    fn a_slow_new_plugin_is_retried_quickly_three_times_then_enters_the_chain() {
        let table = BackoffTable::default();
        let now = Instant::now();
        let path = Path::new("/r/a.sock");
        let delays: Vec<Duration> = (0..6)
            .map(|_| {
                table
                    .fail(path, id(1), "x".into(), FailureKind::SlowNewPlugin, now)
                    .delay
            })
            .collect();
        let quick = QUICK_RETRY_DELAY;
        assert_eq!(
            delays,
            [
                quick,
                quick,
                quick,
                INITIAL_DELAY,
                INITIAL_DELAY * 2,
                INITIAL_DELAY * 4
            ]
        );
        // Any other failure after a quick retry starts the chain.
        let other = Path::new("/r/b.sock");
        table.fail(other, id(2), "x".into(), FailureKind::SlowNewPlugin, now);
        let next = table.fail(other, id(2), "x".into(), FailureKind::Other, now);
        assert_eq!(next.delay, INITIAL_DELAY);
    }

    #[test]
    fn a_socket_waiting_to_listen_is_looked_at_again_doubling_to_a_second_or_waits_for_the_kernel()
    {
        let table = BackoffTable::default();
        let now = Instant::now();
        let until = now + Duration::from_secs(10);
        let path = Path::new("/r/bound.sock");
        let looks: Vec<Duration> = (0..10)
            .map(|_| {
                table
                    .wait_to_listen(path, id(1), until, false, "x".into(), now)
                    .retry_at
                    - now
            })
            .collect();
        assert_eq!(looks[0], LISTEN_POLL_FIRST);
        assert_eq!(looks[1], LISTEN_POLL_FIRST * 2);
        assert_eq!(looks[9], LISTEN_POLL_MAX);
        // Not a failure: no attempt count, no retry.
        assert_eq!(table.get(path, id(1)).map(|b| b.failures), Some(0));
        assert_eq!(table.waiting_to_listen_until(path, id(1)), Some(until));
        // Near its end, the next look is the end.
        let late = until - Duration::from_millis(3);
        assert_eq!(
            table
                .wait_to_listen(path, id(1), until, false, "x".into(), late)
                .retry_at,
            until
        );
        // Where the kernel reports listens, the one look is at the end of the wait.
        let reported = Path::new("/r/reported.sock");
        let wait = table.wait_to_listen(reported, id(2), until, true, "x".into(), now);
        assert_eq!(wait.retry_at, until);
        // The report releases it, and only it.
        assert_eq!(
            table.release_on_listen(reported, id(2)),
            ListenReleased::Waiting
        );
        assert_eq!(
            table.release_on_listen(reported, id(2)),
            ListenReleased::Nothing
        );
        assert!(table.blocked_until(path, id(1), now, false).is_some());
        // Lost reports release every wait.
        assert_eq!(table.release_waiting_to_listen(), vec![path.to_path_buf()]);
        assert!(table.blocked_until(path, id(1), now, false).is_none());
    }

    #[test]
    fn a_wait_for_kubelet_ends_at_its_deadline_or_at_the_contact() {
        let table = BackoffTable::default();
        let now = Instant::now();
        let until = now + Duration::from_secs(3);
        let path = Path::new("/r/observed.sock");
        table.wait_for_kubelet(path, id(1), until, "x".into());
        assert_eq!(table.blocked_until(path, id(1), now, false), Some(until));
        assert_eq!(table.blocked_until(path, id(1), now, true), None);
        assert!(table.get(path, id(1)).is_some_and(|b| b.kind.is_waiting()));
        // A listen does not end it.
        assert_eq!(
            table.release_on_listen(path, id(1)),
            ListenReleased::Nothing
        );
    }

    #[test]
    fn delays_double_from_500ms_and_cap_at_2m2s() {
        let table = BackoffTable::default();
        let now = Instant::now();
        let path = Path::new("/r/a.sock");
        let delays: Vec<Duration> = (0..12)
            .map(|_| {
                table
                    .fail(path, id(1), "x".into(), FailureKind::Other, now)
                    .delay
            })
            .collect();
        assert_eq!(delays[0], Duration::from_millis(500));
        assert_eq!(delays[1], Duration::from_secs(1));
        assert_eq!(delays[2], Duration::from_secs(2));
        assert_eq!(delays[8], Duration::from_secs(122));
        assert_eq!(delays[11], MAX_DELAY);
        assert_eq!(
            table.blocked_until(path, id(1), now, false),
            Some(now + MAX_DELAY)
        );
    }

    #[test]
    fn recreated_socket_at_same_path_starts_fresh() {
        let table = BackoffTable::default();
        let now = Instant::now();
        let path = Path::new("/r/a.sock");
        for _ in 0..5 {
            table.fail(path, id(1), "x".into(), FailureKind::Other, now);
        }
        assert!(table.blocked_until(path, id(1), now, false).is_some());
        assert_eq!(table.blocked_until(path, id(2), now, false), None);
        assert_eq!(
            table
                .fail(path, id(2), "x".into(), FailureKind::Other, now)
                .delay,
            INITIAL_DELAY
        );
    }

    #[test]
    fn success_resets_backoff() {
        let table = BackoffTable::default();
        let now = Instant::now();
        let path = Path::new("/r/a.sock");
        table.fail(path, id(1), "x".into(), FailureKind::Other, now);
        table.reset(path, id(1));
        assert_eq!(table.blocked_until(path, id(1), now, false), None);
        assert_eq!(
            table
                .fail(path, id(1), "x".into(), FailureKind::Other, now)
                .delay,
            INITIAL_DELAY
        );
    }

    #[test]
    fn handler_added_releases_only_plugins_waiting_for_its_type() {
        let table = BackoffTable::default();
        let now = Instant::now();
        let dra = FailureKind::WaitingForHandler {
            plugin_type: "DRAPlugin".into(),
        };
        let csi = FailureKind::WaitingForHandler {
            plugin_type: "CSIPlugin".into(),
        };
        table.fail(
            Path::new("/r/dra.sock"),
            id(1),
            "no handler".into(),
            dra,
            now,
        );
        table.fail(
            Path::new("/r/csi.sock"),
            id(2),
            "no handler".into(),
            csi,
            now,
        );
        table.fail(
            Path::new("/r/bad.sock"),
            id(3),
            "boom".into(),
            FailureKind::Other,
            now,
        );
        assert_eq!(
            table.release_waiting_for("DRAPlugin"),
            vec![PathBuf::from("/r/dra.sock")]
        );
        assert_eq!(
            table.blocked_until(Path::new("/r/dra.sock"), id(1), now, false),
            None
        );
        assert!(
            table
                .blocked_until(Path::new("/r/csi.sock"), id(2), now, false)
                .is_some()
        );
        assert!(
            table
                .blocked_until(Path::new("/r/bad.sock"), id(3), now, false)
                .is_some()
        );
    }
}
