//! Limits on the agent's own servers (the metrics HTTP port and the admin gRPC socket), so that
//! no client, privileged or not, can exhaust the agent's descriptors or memory, or hold up its
//! shutdown.
//!
//! ```text
//! listener ──Gate::admit──> at most `max_connections` open; when full, the next connection is
//!                           accepted and the open one quiet for longest is closed to make room
//!                           (the others wait in the kernel's accept queue: no descriptor, no memory)
//!          ──Guarded io──>  closed after `idle` without a byte either way, when evicted, and at
//!                           once when the server's stop token fires (shutdown ends every connection)
//! ```
//!
//! Eviction is what keeps a scrape answered during a flood of slow connections: a waiting queue
//! made the scraper wait behind every slow client for their idle time, and a per-address limit
//! does not help where the scraper and the flood share the node's loopback address. A scrape in
//! progress is the connection that moved most recently, so it is the last one closed; a flood
//! has to keep `max_connections` connections busier than a scrape to close one.
//!
//! Where a server knows its peers (the admin socket: the peer process, from `SO_PEERCRED`), the
//! connection closed is the quietest of the peer holding the most: an operator's `watch` is long
//! and quiet between events, and a process opening a thousand `watch` streams closed it (broken
//! pipe) on its way through the limit; now the flood closes its own connections.
//!
//! Why here and not in each server: hyper (HTTP/1) bounds header reads but not a client that stops
//! reading its response; tonic (HTTP/2) has no idle-connection timeout, and its graceful shutdown
//! waits for every connection, preface-only and idle ones included. A byte-level wrapper bounds
//! all of them the same way. The connection caps are far below the descriptor limit (see
//! [`cap`]), so a flood of connections never starves plugin dials or directory reads.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Limits of one server.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// A connection with no byte read or written for this long is closed.
    pub idle: Duration,
}

/// The metrics server: Prometheus and kubelet probes use one or two connections each; 32 leaves
/// room for several scrapers while staying far from the descriptor limit. A scrape is one request
/// answered at once, so 10 s without progress is a client that is not reading.
pub const METRICS: Limits = Limits {
    max_connections: 32,
    idle: Duration::from_secs(10),
};

/// The admin socket (root or the agent's user only): a few operators' `list` and `watch`. Idle
/// is measured on bytes, and HTTP/2 keepalive pings every [`ADMIN_KEEPALIVE`] keep a live
/// `watch` busy, so only a peer that stopped answering is closed.
pub const ADMIN: Limits = Limits {
    max_connections: 16,
    idle: Duration::from_secs(60),
};

/// HTTP/2 keepalive ping interval on the admin socket (see [`ADMIN`]): long enough that a
/// `watch` costs an idle agent one ping round trip (about seven thread wake-ups) every 45 s, and
/// short enough that the ping and its answer (10 s allowed) move bytes before the 60 s idle limit.
/// (At 20 s, the ping of the load generator's own `watch` was the idle wake-ups the benchmarks
/// reported after a load.)
pub const ADMIN_KEEPALIVE: Duration = Duration::from_secs(45);

/// Descriptors kept free for the work that matters (plugin dials, directory reads, the event
/// source): a server never has more than 1/8 of the soft `RLIMIT_NOFILE` in connections.
pub fn cap(wanted: usize) -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct passed to it.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
    } else {
        1024
    };
    wanted.min(soft / 8).max(1)
}

/// Admits connections up to a server's limit and wraps each in a [`Guarded`] stream.
pub struct Gate {
    slots: Arc<Semaphore>,
    limits: Limits,
    stop: CancellationToken,
    server: &'static str,
    open: Arc<OpenConnections>,
}

/// The admitted connections, for eviction: when each last moved a byte, and how to close it.
#[derive(Default)]
struct OpenConnections {
    epoch: std::sync::OnceLock<Instant>,
    by_id: Mutex<HashMap<u64, Arc<Activity>>>,
    next_id: AtomicU64,
}

struct Activity {
    /// Nanoseconds from the gate's epoch to the last byte read or written.
    last_progress_ns: AtomicU64,
    evict: CancellationToken,
    /// Who is at the other end, as the server tells peers apart (0 for all where it cannot).
    peer: u64,
}

impl OpenConnections {
    /// `at` as nanoseconds from the first connection's admission.
    fn ns_at(&self, at: Instant) -> u64 {
        let epoch = *self.epoch.get_or_init(|| at);
        u64::try_from(at.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Activity>>> {
        self.by_id.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, evict: CancellationToken, peer: u64) -> (u64, Arc<Activity>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let activity = Arc::new(Activity {
            last_progress_ns: AtomicU64::new(self.ns_at(Instant::now())),
            evict,
            peer,
        });
        self.lock().insert(id, activity.clone());
        (id, activity)
    }

    /// Closes, for a newcomer from `peer`, the connection quiet for longest of the peer holding
    /// the most (the newcomer's own among those tied; not one already closing); whether there
    /// was one.
    fn evict_for(&self, peer: u64) -> bool {
        let open = self.lock();
        let live = || open.values().filter(|a| !a.evict.is_cancelled());
        let mut held: HashMap<u64, usize> = HashMap::new();
        for activity in live() {
            *held.entry(activity.peer).or_default() += 1;
        }
        let Some(most) = held.values().copied().max() else {
            return false;
        };
        let busiest = |a: &&Arc<Activity>| held.get(&a.peer) == Some(&most);
        let own_tied = held.get(&peer) == Some(&most);
        let victim = live()
            .filter(busiest)
            .filter(|a| !own_tied || a.peer == peer)
            .min_by_key(|a| a.last_progress_ns.load(Ordering::Relaxed));
        match victim {
            Some(activity) => {
                activity.evict.cancel();
                true
            }
            None => false,
        }
    }
}

impl Gate {
    /// A gate for `server` (named in log lines) with `limits` (the connection count capped by
    /// [`cap`]); `stop` ends every admitted connection and the accepting.
    pub fn new(server: &'static str, limits: Limits, stop: CancellationToken) -> Gate {
        let limits = Limits {
            max_connections: cap(limits.max_connections),
            ..limits
        };
        Gate {
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            stop,
            server,
            open: Arc::default(),
        }
    }

    /// Waits for a connection from `accept` and admits it, closing the open connection quiet
    /// for longest of the peer holding the most first if the server is full (`peer` names a
    /// connection's peer; one value for all where they cannot be told apart); `None` once `stop`
    /// fired. Accept errors are logged and retried after a pause (EMFILE leaves the connection
    /// queued, so retrying at once would spin). One call at a time: a full server holds one
    /// connection beyond its limit, while the one it evicted closes.
    pub async fn admit<S, F, Fut>(
        &self,
        mut accept: F,
        peer: impl Fn(&S) -> u64,
    ) -> Option<Guarded<S>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = io::Result<S>>,
    {
        loop {
            let accepted = tokio::select! {
                biased;
                _ = self.stop.cancelled() => return None,
                accepted = accept() => accepted,
            };
            match accepted {
                Ok(stream) => {
                    let peer = peer(&stream);
                    let permit = match self.slots.clone().try_acquire_owned() {
                        Ok(permit) => permit,
                        Err(_) => {
                            if self.open.evict_for(peer) {
                                tracing::debug!(
                                    server = self.server,
                                    "connection limit reached: closing the quietest connection of the peer holding the most"
                                );
                            }
                            tokio::select! {
                                biased;
                                _ = self.stop.cancelled() => return None,
                                permit = self.slots.clone().acquire_owned() => permit.ok()?,
                            }
                        }
                    };
                    let evict = self.stop.child_token();
                    let (id, activity) = self.open.add(evict.clone(), peer);
                    let slot = Slot {
                        _permit: permit,
                        id,
                        open: self.open.clone(),
                        activity,
                    };
                    return Some(Guarded::new(
                        stream,
                        self.limits.idle,
                        slot,
                        evict,
                        &self.stop,
                    ));
                }
                Err(e) if transient(&e) => continue,
                Err(e) => {
                    tracing::warn!(server = self.server, error = %e, "cannot accept a connection; retrying in 100 ms");
                    tokio::select! {
                        _ = self.stop.cancelled() => return None,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
            }
        }
    }

    /// The connection limit in force.
    pub fn max_connections(&self) -> usize {
        self.limits.max_connections
    }
}

/// Errors about one connection that the next `accept` does not repeat.
fn transient(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// A connection's place in its server: the semaphore permit, and its entry among the open
/// connections (removed when the connection is dropped).
struct Slot {
    _permit: OwnedSemaphorePermit,
    id: u64,
    open: Arc<OpenConnections>,
    activity: Arc<Activity>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.lock().remove(&self.id);
    }
}

/// A connection that ends after `idle` without progress, when evicted for a newer one, or when
/// its server stops; it holds its server's connection slot until dropped.
pub struct Guarded<S> {
    inner: S,
    idle: Duration,
    idle_timer: Pin<Box<Sleep>>,
    /// Fires on eviction and on the server's stop (a child of the stop token).
    ended: Pin<Box<WaitForCancellationFutureOwned>>,
    stop: CancellationToken,
    slot: Slot,
}

impl<S> Guarded<S> {
    fn new(
        inner: S,
        idle: Duration,
        slot: Slot,
        ended: CancellationToken,
        stop: &CancellationToken,
    ) -> Self {
        Guarded {
            inner,
            idle,
            idle_timer: Box::pin(tokio::time::sleep(idle)),
            ended: Box::pin(ended.cancelled_owned()),
            stop: stop.clone(),
            slot,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// An error if the connection must end now (stopping, or idle too long); registers the
    /// caller's waker with both, so a connection waiting for its peer is woken to end.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.ended.as_mut().poll(cx).is_ready() {
            let why = if self.stop.is_cancelled() {
                "the agent is shutting down"
            } else {
                "the server is full and this connection was quiet for longest"
            };
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, why));
        }
        if self.idle_timer.as_mut().poll(cx).is_ready() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection idle too long",
            ));
        }
        Ok(())
    }

    fn progressed(&mut self) {
        let now = Instant::now();
        self.idle_timer.as_mut().reset(now + self.idle);
        let at = self.slot.open.ns_at(now);
        self.slot
            .activity
            .last_progress_ns
            .store(at, Ordering::Relaxed);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.check(cx)?;
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.progressed();
        }
        poll
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(poll, Poll::Ready(Ok(n)) if n > 0) {
            self.progressed();
        }
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check(cx)?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Guarded<tokio::net::UnixStream> {
    type ConnectInfo = tonic::transport::server::UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn pair_gate(limits: Limits, stop: &CancellationToken) -> Gate {
        Gate::new("test", limits, stop.clone())
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_is_closed_after_the_idle_time() {
        let stop = CancellationToken::new();
        let gate = pair_gate(
            Limits {
                max_connections: 4,
                idle: Duration::from_secs(10),
            },
            &stop,
        );
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut once = Some(ours);
        let mut conn = gate
            .admit(
                || std::future::ready(once.take().ok_or_else(|| io::Error::other("once"))),
                |_| 0,
            )
            .await
            .expect("admitted");
        // Paused time: the read waits for the peer until the idle timer fires.
        let mut buf = [0u8; 8];
        let error = conn.read(&mut buf).await.expect_err("idle connection ends");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test(start_paused = true)]
    async fn progress_keeps_a_connection_open_and_stop_ends_it() {
        let stop = CancellationToken::new();
        let gate = pair_gate(
            Limits {
                max_connections: 4,
                idle: Duration::from_secs(10),
            },
            &stop,
        );
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut once = Some(ours);
        let mut conn = gate
            .admit(
                || std::future::ready(once.take().ok_or_else(|| io::Error::other("once"))),
                |_| 0,
            )
            .await
            .expect("admitted");
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(6)).await;
            theirs.write_all(b"x").await.expect("write");
            let mut buf = [0u8; 1];
            conn.read_exact(&mut buf)
                .await
                .expect("still open after 6 s quiet");
        }
        stop.cancel();
        let mut buf = [0u8; 1];
        let error = conn.read(&mut buf).await.expect_err("stopped");
        assert_eq!(error.kind(), io::ErrorKind::ConnectionAborted);
    }

    /// Issue 44, item 7: a process opening a thousand admin connections (`watch` streams)
    /// closed the operator's own `watch`, the quietest. The newcomer now closes the quietest
    /// connection of the peer holding the most: the flood's own.
    #[tokio::test(start_paused = true)]
    async fn a_flood_from_one_peer_closes_its_own_connections_not_another_peer_s() {
        let stop = CancellationToken::new();
        let gate = Arc::new(pair_gate(
            Limits {
                max_connections: 3,
                idle: Duration::from_secs(600),
            },
            &stop,
        ));
        let admit = |gate: &Arc<Gate>, peer: u64| {
            let gate = gate.clone();
            let (ours, theirs) = tokio::io::duplex(64);
            let mut once = Some(ours);
            let admitted = tokio::spawn(async move {
                gate.admit(
                    || std::future::ready(once.take().ok_or_else(|| io::Error::other("once"))),
                    move |_| peer,
                )
                .await
                .expect("admitted")
            });
            (admitted, theirs)
        };
        const OPERATOR: u64 = 1;
        const FLOOD: u64 = 2;
        // The operator's `watch`: first, and quiet from then on.
        let (operator, _operator_peer) = admit(&gate, OPERATOR);
        let mut operator = operator.await.expect("task");
        let mut flood = Vec::new();
        for _ in 0..2 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (conn, peer) = admit(&gate, FLOOD);
            flood.push((conn.await.expect("task"), peer));
        }
        // Full: each newcomer of the flood closes the flood's quietest, ten times over.
        let mut buf = [0u8; 1];
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (newcomer, peer) = admit(&gate, FLOOD);
            let (mut oldest, _oldest_peer) = flood.remove(0);
            let error = oldest.read(&mut buf).await.expect_err("evicted");
            assert_eq!(error.kind(), io::ErrorKind::ConnectionAborted);
            drop(oldest);
            flood.push((newcomer.await.expect("admitted"), peer));
        }
        let mut operator_peer = _operator_peer;
        operator_peer.write_all(b"x").await.expect("write");
        operator
            .read_exact(&mut buf)
            .await
            .expect("the operator's connection stays open");
        stop.cancel();
    }

    /// Issue 22: a scrape waited behind every slow connection of a flood for their idle time.
    #[tokio::test(start_paused = true)]
    async fn a_connection_beyond_the_limit_closes_the_one_quiet_for_longest() {
        let stop = CancellationToken::new();
        let gate = Arc::new(pair_gate(
            Limits {
                max_connections: 2,
                idle: Duration::from_secs(60),
            },
            &stop,
        ));
        let admit = |gate: &Arc<Gate>| {
            let gate = gate.clone();
            let (ours, theirs) = tokio::io::duplex(64);
            let mut once = Some(ours);
            let admitted = tokio::spawn(async move {
                gate.admit(
                    || std::future::ready(once.take().ok_or_else(|| io::Error::other("once"))),
                    |_| 0,
                )
                .await
                .expect("admitted")
            });
            (admitted, theirs)
        };
        let (quiet, _quiet_peer) = admit(&gate);
        let mut quiet = quiet.await.expect("task");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (busy, mut busy_peer) = admit(&gate);
        let mut busy = busy.await.expect("task");
        // The first connection to be admitted moves a byte after the second: the second is now
        // the one quiet for longest.
        tokio::time::sleep(Duration::from_secs(1)).await;
        busy_peer.write_all(b"x").await.expect("write");
        let mut buf = [0u8; 1];
        busy.read_exact(&mut buf).await.expect("read");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (newcomer, _newcomer_peer) = admit(&gate);
        let error = quiet.read(&mut buf).await.expect_err("evicted");
        assert_eq!(error.kind(), io::ErrorKind::ConnectionAborted);
        assert!(error.to_string().contains("quiet for longest"), "{error}");
        assert!(
            !newcomer.is_finished(),
            "admitted before the evicted one closed"
        );
        drop(quiet);
        let _newcomer = newcomer.await.expect("admitted once the quiet one closed");
        busy_peer.write_all(b"y").await.expect("write");
        busy.read_exact(&mut buf)
            .await
            .expect("the busy connection stays open");

        stop.cancel();
        let error = busy.read(&mut buf).await.expect_err("stopped");
        assert!(error.to_string().contains("shutting down"), "{error}");
        assert!(
            gate.admit(|| std::future::ready(Ok(tokio::io::duplex(8).0)), |_| 0)
                .await
                .is_none(),
            "nothing is admitted after stop"
        );
    }
}
