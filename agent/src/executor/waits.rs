//! Waits without an operation: one timer per path (a backoff's end, a wait for kubelet, the
//! next look at a socket not listening yet), cancelled when the socket leaves the tree or is
//! held, and the looks themselves where no source reports a `listen`.
//!
//! A storm of short-lived sockets that fail (not plugins) would otherwise leave thousands of
//! timers that wake the idle agent long after the sockets are gone.

use crate::liveness::Probe;
use crate::state::backoff::{BackoffTable, ListenReleased};
use crate::state::desired::{DesiredPlugin, DesiredState, ListenSeen, Listening};
use crate::state::queue::ReconcileQueue;
use crate::state::{PathMap, SocketId};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

/// How long a registration of a socket whose bind the kernel reported waits for the report of
/// its `listen` before it dials anyway (see [`Waits::until_listen_reported`]): past the eBPF
/// reader's batch delay (2 ms), the longest a report rides along when the reader is busy.
pub const FIRST_LISTEN_WAIT: Duration = Duration::from_millis(5);

/// See the module docs.
pub struct Waits {
    /// Pending timers by path.
    timers: Mutex<PathMap<PathBuf, CancellationToken>>,
    /// Connections a look at a socket waiting to listen made, for its registration's first try.
    found: Mutex<PathMap<PathBuf, (SocketId, tokio::net::UnixStream)>>,
    backoff: Arc<BackoffTable>,
    /// Where a look that finds a socket listening records when (`explain`'s timeline).
    desired: Arc<DesiredState>,
    queue: Arc<ReconcileQueue>,
    /// Whether the event source reports a socket's `listen` (eBPF): then no look is made.
    listens_reported: bool,
    /// The executor's: timers and looks end with it, and its drain waits for them.
    tasks: TaskTracker,
    cancel: CancellationToken,
}

impl Waits {
    /// Timers and looks spawned on `tasks`, stopped by `cancel`, that mark `queue`.
    pub fn new(
        backoff: Arc<BackoffTable>,
        desired: Arc<DesiredState>,
        queue: Arc<ReconcileQueue>,
        listens_reported: bool,
        tasks: TaskTracker,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        Arc::new(Waits {
            timers: Mutex::new(PathMap::default()),
            found: Mutex::new(PathMap::default()),
            backoff,
            desired,
            queue,
            listens_reported,
            tasks,
            cancel,
        })
    }

    /// Returns once the kernel has reported the `listen` of `desired`'s socket, or after
    /// [`FIRST_LISTEN_WAIT`], when the kernel reported its bind (the eBPF source): a plugin binds
    /// and then listens, and the source often reports the bind before the listen has happened.
    /// A dial then is refused and retried (a socket, a connect, a `statx` and a file handle, a
    /// timer: ~0.4 per plugin under churn); waiting for the report, which the kernel side sends
    /// at once (see `wake_flags_when` in agent-ebpf), dials once. `listened` is the path's claim's
    /// (`claims::InFlight::listened`): a report since the claim was made is its permit; one
    /// before it is in the desired state. Without a slot: nothing is held meanwhile.
    pub async fn until_listen_reported(
        &self,
        desired: &DesiredPlugin,
        listened: Arc<tokio::sync::Notify>,
    ) {
        let bind_reported = self.listens_reported && desired.kernel_ns.is_some();
        if !bind_reported || desired.listening.is_some() {
            return;
        }
        if self
            .desired
            .listening_known(&desired.path, desired.generation)
        {
            return;
        }
        let _ = tokio::time::timeout(FIRST_LISTEN_WAIT, listened.notified()).await;
    }

    /// Looks at `path` again at `at`, replacing an earlier timer.
    pub fn look_again_at(self: &Arc<Self>, path: &Path, at: Instant) {
        let cancel = self.replace_timer(path);
        let this = self.clone();
        let path = path.to_path_buf();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep_until(at) => {
                    this.lock_timers().remove(&path);
                    this.queue.mark(path);
                }
                _ = cancel.cancelled() => {}
            }
        });
    }

    /// Cancels `path`'s timer, if any (its socket is held: nothing retries it by time).
    pub fn cancel(&self, path: &Path) {
        if let Some(timer) = self.lock_timers().remove(path) {
            timer.cancel();
        }
    }

    /// The socket at `path` left the tree: no timer, no connection kept for it.
    pub fn forget(&self, path: &Path) {
        lock(&self.found).remove(path);
        self.cancel(path);
    }

    /// The connection a look made to `socket` at `path` when it found it listening, if any.
    pub fn take_found(&self, path: &Path, socket: SocketId) -> Option<tokio::net::UnixStream> {
        match lock(&self.found).remove(path) {
            Some((of, stream)) if of == socket => Some(stream),
            _ => None,
        }
    }

    /// The socket `socket` at `path` refuses connections (bound, not listening yet) and may
    /// listen until `until`: it waits without an operation, for the kernel's report of its
    /// listen or its next look (see `state::backoff`). Not a failure: no event, no warning.
    /// `listen_reported` takes a report that reached the path's operation after its last
    /// refused connect.
    pub fn wait_to_listen(
        self: &Arc<Self>,
        path: &Path,
        socket: SocketId,
        until: Instant,
        reason: String,
        listen_reported: impl FnOnce() -> bool,
    ) {
        let now = Instant::now();
        let reason = format!("{reason}: waiting for it to listen");
        let backoff =
            self.backoff
                .wait_to_listen(path, socket, until, self.listens_reported, reason, now);
        // A listen reported after the attempt's last refused connect found no wait to end:
        // it is one now (recorded first, so a report racing with this is not lost either).
        if listen_reported()
            && self.backoff.release_on_listen(path, socket) == ListenReleased::Waiting
        {
            self.queue.mark(path.to_path_buf());
            return;
        }
        debug!(socket_path = %path.display(), next_look_in = ?backoff.retry_at.saturating_duration_since(now), until_unserved_in = ?until.saturating_duration_since(now), "socket not listening yet: waiting for its listen");
        if self.listens_reported {
            self.look_again_at(path, backoff.retry_at);
        } else {
            self.look_for_listen(path, socket, backoff.retry_at, until);
        }
    }

    /// Where no listen is reported: looks at the socket (one connect) at each of its wait's
    /// looks, without an operation (an operation per look cost ~60 us, a connect ~5 us: 17,000
    /// sockets waiting at once took both cores), until it listens or its wait ends; then its
    /// registration runs, on the connection the look made.
    fn look_for_listen(
        self: &Arc<Self>,
        path: &Path,
        socket: SocketId,
        first: Instant,
        until: Instant,
    ) {
        let cancel = self.replace_timer(path);
        let this = self.clone();
        let path = path.to_path_buf();
        self.tasks.spawn(async move {
            let mut at = first;
            loop {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = cancel.cancelled() => return,
                }
                if Instant::now() >= until {
                    break;
                }
                match crate::liveness::probe(&path, socket).await {
                    (Probe::Refused, _) => {
                        match this
                            .backoff
                            .listen_look_refused(&path, socket, Instant::now())
                        {
                            Some(next) => at = next,
                            None => break,
                        }
                    }
                    (Probe::Served, connected) => {
                        let listening = Listening {
                            at: std::time::SystemTime::now(),
                            seen_by: ListenSeen::Look,
                        };
                        this.desired
                            .record_listening(&path, Some(socket), None, listening);
                        if let Some(stream) = connected {
                            lock(&this.found).insert(path.clone(), (socket, stream));
                        }
                        this.backoff.release_on_listen(&path, socket);
                        break;
                    }
                    (Probe::Replaced, _) => break,
                }
            }
            this.lock_timers().remove(&path);
            this.queue.mark(path);
        });
    }

    /// The token of `path`'s timer from now on: an earlier timer of the path is cancelled (one
    /// timer per path, whatever it waits for).
    fn replace_timer(&self, path: &Path) -> CancellationToken {
        let cancel = self.cancel.child_token();
        if let Some(previous) = self
            .lock_timers()
            .insert(path.to_path_buf(), cancel.clone())
        {
            previous.cancel();
        }
        cancel
    }

    /// Paths with a pending timer.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.lock_timers().len()
    }

    fn lock_timers(&self) -> std::sync::MutexGuard<'_, PathMap<PathBuf, CancellationToken>> {
        lock(&self.timers)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
