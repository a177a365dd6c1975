//! Liveness: a plugin stays registered only while something serves its socket.
//!
//! A plugin that crashes, is OOM-killed or SIGKILLed leaves its socket file behind; kubelet keeps
//! it registered for as long as the file stays (node-driver-registrar issues 139 and 206), and
//! handlers keep routing work to a dead endpoint. Here every registration learns who serves the
//! socket from the registration connection itself: `SO_PEERCRED` (pid, uid, gid of the process
//! that called `listen()`) and `SO_PEERPIDFD`, a pidfd for that process taken by the kernel from
//! the socket (no pid-reuse race, and it works across pid namespaces). The pidfd becomes readable
//! when the process exits, which wakes the agent: no timer, no polling.
//!
//! An exit is not yet proof. A listening socket outlives its process when it was handed on (a
//! fork, fd passing, socket activation), so one connect attempt decides:
//! - refused (or the listener is gone with the socket file left behind): the plugin is
//!   **unserved**, reported to the executor as a [`Loss`], which deregisters it;
//! - accepted: the listener lives on in another process, which the socket's credentials cannot
//!   name (they are the `listen()` caller's). The registration stays; what ends it from then on is
//!   the socket's next change (or, with the eBPF source, the kernel's report of its release).
//!
//! A registration restored from a previous agent (`persist`) has no registration connection: its
//! server is learned with one bare connect (no RPC, so the plugin is not "called"), which also
//! finds sockets whose server died while no agent ran.
//!
//! With the eBPF source the kernel adds two hints ([`Liveness::kernel_hint`]): a registered
//! plugin's listening socket was released (fentry: its last reference dropped, whoever held it,
//! which covers the death of a process it was handed to; syscall tracepoints: a `close()` of one
//! of its descriptors, which covers a listener closed while its process lives on), checked with
//! the same connect; and a bound socket started listening, which moves an unserved socket on at
//! once.
//!
//! This room imports only `state` (the socket identity a probe checks first); the executor owns
//! the [`Liveness`] and is what a [`Loss`] is reported to.

use crate::state::{EntryKind, SocketId};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Semaphore;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use uuid::Uuid;

/// Restored registrations whose server is learned at once (one connect each): enough to finish
/// ten thousand in well under a second, few enough not to flood plugins with connections.
const CONCURRENT_ATTACHES: usize = 64;

/// The process serving a plugin's socket, as the registration connection's credentials name it.
#[derive(Debug)]
pub struct Server {
    /// In the agent's pid namespace; `None` when the server is outside it (the kernel says 0).
    pub pid: Option<u32>,
    pub uid: u32,
    pub gid: u32,
    /// Readable once the process has exited; `None` when the kernel could not give one (the
    /// process exited already, or a kernel before 6.5 and a pid not visible here).
    pidfd: Option<OwnedFd>,
}

impl Server {
    /// The server at the other end of `connection` (a connected Unix stream).
    pub fn of(connection: BorrowedFd<'_>) -> io::Result<Server> {
        let cred =
            nix::sys::socket::getsockopt(&connection, nix::sys::socket::sockopt::PeerCredentials)
                .map_err(io::Error::from)?;
        let pid = u32::try_from(cred.pid()).ok().filter(|pid| *pid > 0);
        let pidfd = peer_pidfd(connection).or_else(|| pid.and_then(pidfd_open));
        Ok(Server {
            pid,
            uid: cred.uid(),
            gid: cred.gid(),
            pidfd,
        })
    }

    /// Whether the agent can be woken by this server's exit.
    pub fn watchable(&self) -> bool {
        self.pidfd.is_some()
    }

    /// The process's identity for as long as the machine runs: its pidfd's inode on pidfs
    /// (Linux 6.9+: one inode per process, never reused). `None` on older kernels (pidfds are
    /// anonymous inodes there, all alike) or without a pidfd.
    pub fn identity(&self) -> Option<u64> {
        /// `PID_FS_MAGIC`.
        const PIDFS_MAGIC: i64 = 0x5049_4446;
        let pidfd = self.pidfd.as_ref()?;
        let fs = nix::sys::statfs::fstatfs(pidfd).ok()?;
        if fs.filesystem_type().0 as i64 != PIDFS_MAGIC {
            return None;
        }
        nix::sys::stat::fstat(pidfd).ok().map(|stat| stat.st_ino)
    }
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "pid {pid} uid {} gid {}", self.uid, self.gid),
            None => write!(
                f,
                "a process outside the agent's pid namespace, uid {} gid {}",
                self.uid, self.gid
            ),
        }
    }
}

/// `SO_PEERPIDFD` (Linux 6.5): the kernel's own pidfd for the peer, immune to pid reuse.
fn peer_pidfd(connection: BorrowedFd<'_>) -> Option<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `fd`, which is that large.
    let rc = unsafe {
        libc::getsockopt(
            connection.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&raw mut fd).cast(),
            &raw mut len,
        )
    };
    // SAFETY: on success the kernel installed a new descriptor that nothing else owns.
    (rc == 0 && fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `pidfd_open(2)`, for kernels without `SO_PEERPIDFD`; racy against pid reuse only between the
/// connection and this call (a few microseconds), which the connect probe after an exit covers.
fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    let fd = libc::c_int::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: a new descriptor that nothing else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// How a liveness loss was learned: the `learned_by` label of metrics, spans and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LearnedBy {
    /// The server's pidfd said it exited, and a connect attempt was refused.
    Pidfd,
    /// A connect attempt was refused without a known server exit: a socket found at start (or
    /// restored) that nothing listens on.
    ConnectProbe,
    /// The kernel reported a descriptor of the listening socket closed (eBPF), and a connect
    /// attempt was refused.
    KernelRelease,
}

impl LearnedBy {
    pub fn label(self) -> &'static str {
        match self {
            LearnedBy::Pidfd => "pidfd",
            LearnedBy::ConnectProbe => "connect_probe",
            LearnedBy::KernelRelease => "kernel_release",
        }
    }
}

/// A registered plugin found unserved.
#[derive(Debug, Clone)]
pub struct Loss {
    pub path: PathBuf,
    /// The registration it ends (a newer one at the path is not touched).
    pub generation: Uuid,
    pub learned_by: LearnedBy,
    /// What was found, for operators.
    pub reason: String,
    /// When the agent learned the server was gone (its exit, or the refused connect).
    pub since: Instant,
}

/// What one connect attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// Something accepts connections (or will: its backlog is full).
    Served,
    /// Nothing listens on the socket.
    Refused,
    /// The path no longer holds this socket: the watcher sees to it.
    Replaced,
}

async fn probe(path: &Path, socket: SocketId) -> (Probe, Option<tokio::net::UnixStream>) {
    if !matches!(EntryKind::of(path), Ok(EntryKind::Socket(id)) if id == socket) {
        return (Probe::Replaced, None);
    }
    match tokio::net::UnixStream::connect(path).await {
        Ok(stream) => (Probe::Served, Some(stream)),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => (Probe::Refused, None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => (Probe::Replaced, None),
        // A full backlog (EAGAIN) is a listener; a permission error says nothing about one.
        Err(e) => {
            tracing::debug!(socket_path = %path.display(), error = %e, "liveness probe inconclusive: counted as served");
            (Probe::Served, None)
        }
    }
}

/// Whether something accepts connections on `socket` at `path` now (one connect); false also
/// when the path no longer holds that socket.
pub async fn accepts(path: &Path, socket: SocketId) -> bool {
    probe(path, socket).await.0 == Probe::Served
}

/// Waits for the process behind `pidfd` to exit.
async fn exited(pidfd: OwnedFd) -> io::Result<()> {
    // SAFETY: the pidfd is owned by the AsyncFd and closed only when it is dropped, after its
    // registration is removed.
    let fd = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
        .map_err(|e| io::Error::other(e.to_string()))?;
    let _ready = fd.readable().await?;
    Ok(())
}

/// When a kernel-reported close of a listener is checked: at once, and again shortly after in
/// case the kernel had not released the socket yet when the agent connected (a close can leave
/// the last `fput` to the return to user space).
const RELEASE_CHECKS: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_millis(1),
    Duration::from_millis(5),
];

type OnLoss = Box<dyn Fn(Loss) + Send + Sync>;
type OnListen = Box<dyn Fn(&Path) + Send + Sync>;

/// A registration whose server is known (or being learned). It stays until the registration is
/// deregistered or lost, also after its pidfd task ended (a handed-on listener), so the kernel's
/// hints about its socket still find it.
struct Watch {
    generation: Uuid,
    socket: SocketId,
    /// Waiting for the server's exit (or, for a restored registration, learning the server).
    task: Option<AbortHandle>,
}

/// The servers being watched, one per registered path; see the module docs.
pub struct Liveness {
    /// Keyed by the desired state's allocation of the path, shared with the watch's task.
    watches: Mutex<HashMap<Arc<Path>, Watch>>,
    on_loss: OnceLock<OnLoss>,
    on_listen: OnceLock<OnListen>,
    attaches: Arc<Semaphore>,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            watches: Mutex::new(HashMap::new()),
            on_loss: OnceLock::new(),
            on_listen: OnceLock::new(),
            attaches: Arc::new(Semaphore::new(CONCURRENT_ATTACHES)),
        }
    }
}

impl Liveness {
    /// Where losses are reported (set once, by the executor).
    pub fn on_loss(&self, report: impl Fn(Loss) + Send + Sync + 'static) {
        let _ = self.on_loss.set(Box::new(report));
    }

    /// Where the kernel's "started listening" hints go (set once, by the executor).
    pub fn on_listen(&self, report: impl Fn(&Path) + Send + Sync + 'static) {
        let _ = self.on_listen.set(Box::new(report));
    }

    /// Watches `server` for the registration `generation` of the socket `socket` at `path`,
    /// replacing any watch of the path. Call from within the runtime.
    pub fn watch(
        self: &Arc<Self>,
        path: Arc<Path>,
        generation: Uuid,
        socket: SocketId,
        server: Server,
    ) {
        let Some(pidfd) = server.pidfd else {
            // Gone already (it died since the connection was made), or a kernel that gives no
            // pidfd for it: one connect now says which it matters for.
            tracing::debug!(socket_path = %path.display(), server = %DisplayPid(server.pid), "no pidfd for the plugin's server: its exit cannot be watched; checking once now");
            let this = Arc::downgrade(self);
            let owned = path.clone();
            let pid = server.pid;
            self.spawn_watch(path, generation, socket, async move {
                let Some(this) = this.upgrade() else { return };
                this.check_unwatchable(&owned, generation, socket, pid)
                    .await;
            });
            return;
        };
        let this = Arc::downgrade(self);
        let owned = path.clone();
        let pid = server.pid;
        self.spawn_watch(path, generation, socket, async move {
            if let Err(e) = exited(pidfd).await {
                tracing::warn!(socket_path = %owned.display(), error = %e, "cannot wait on the plugin server's pidfd: its exit goes unnoticed");
                return;
            }
            let since = Instant::now();
            let Some(this) = this.upgrade() else { return };
            // Boxed: a registered plugin's task waits on its pidfd for as long as it lives, and
            // should cost that wait's few bytes, not the connect's.
            Box::pin(this.decide(&owned, generation, socket, since, pid)).await;
        });
    }

    /// Learns the server of a restored registration with one bare connect, and watches it; a
    /// refused connect is a loss at once.
    pub fn attach(self: &Arc<Self>, path: Arc<Path>, generation: Uuid, socket: SocketId) {
        let this = Arc::downgrade(self);
        let owned = path.clone();
        let permits = self.attaches.clone();
        self.spawn_watch(path, generation, socket, async move {
            let Ok(_permit) = permits.acquire_owned().await else {
                return;
            };
            let (found, stream) = probe(&owned, socket).await;
            let Some(this) = this.upgrade() else { return };
            match (found, stream) {
                (Probe::Refused, _) => this.lost(
                    &owned,
                    generation,
                    LearnedBy::ConnectProbe,
                    Instant::now(),
                    "nothing listens on the socket (connection refused) after the agent restarted"
                        .into(),
                ),
                (Probe::Served, Some(stream)) => match Server::of(stream.as_fd()) {
                    // The watch replaces this task's entry: same path and generation.
                    Ok(server) => {
                        tracing::debug!(socket_path = %owned.display(), %server, "the restored plugin's server, watched for its exit");
                        this.watch(owned.clone(), generation, socket, server);
                    }
                    Err(e) => {
                        tracing::debug!(socket_path = %owned.display(), error = %e, "cannot read the restored plugin's server credentials")
                    }
                },
                _ => {}
            }
        });
    }

    /// The kernel's hint (eBPF source) about the socket at `path`: it started `listening`, or
    /// (not `listening`) its listener was released (see the module docs). A release is checked with a
    /// connect when the path's plugin is registered; refused, it is a loss.
    pub fn kernel_hint(self: &Arc<Self>, path: &Path, listening: bool) {
        if listening {
            if let Some(report) = self.on_listen.get() {
                report(path);
            }
            return;
        }
        let Some((generation, socket)) = self.lock().get(path).map(|w| (w.generation, w.socket))
        else {
            return;
        };
        let this = Arc::downgrade(self);
        let path = path.to_path_buf();
        tokio::spawn(async move {
            let since = Instant::now();
            for pause in RELEASE_CHECKS {
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
                match probe(&path, socket).await.0 {
                    Probe::Served => continue,
                    Probe::Replaced => return,
                    Probe::Refused => {
                        if let Some(this) = this.upgrade() {
                            this.lost(
                                &path,
                                generation,
                                LearnedBy::KernelRelease,
                                since,
                                "its listening socket was closed (reported by the kernel) and nothing listens on it".into(),
                            );
                        }
                        return;
                    }
                }
            }
            tracing::debug!(socket_path = %path.display(), "a descriptor of the plugin's listener was closed, but it still accepts connections: another descriptor holds it");
        });
    }

    /// Stops watching the server of `path`'s registration `generation` (it is being
    /// deregistered); a newer registration's watch is left alone.
    pub fn forget(&self, path: &Path, generation: Uuid) {
        self.end(path, generation);
    }

    /// Registrations being watched now.
    pub fn watched(&self) -> usize {
        self.lock().len()
    }

    /// A server whose exit cannot be watched (no pidfd): one connect says whether it is gone
    /// already (it died between the connection and the pidfd); served, nothing more is known.
    async fn check_unwatchable(
        &self,
        path: &Path,
        generation: Uuid,
        socket: SocketId,
        pid: Option<u32>,
    ) {
        if probe(path, socket).await.0 == Probe::Refused {
            self.lost(
                path,
                generation,
                LearnedBy::ConnectProbe,
                Instant::now(),
                format!(
                    "its server ({}) was gone before its exit could be watched, and nothing listens on the socket",
                    DisplayPid(pid)
                ),
            );
        }
    }

    /// The server of `path`'s registration exited: one connect decides.
    async fn decide(
        &self,
        path: &Path,
        generation: Uuid,
        socket: SocketId,
        since: Instant,
        pid: Option<u32>,
    ) {
        let (found, _stream) = probe(path, socket).await;
        match found {
            Probe::Refused => self.lost(
                path,
                generation,
                LearnedBy::Pidfd,
                since,
                format!(
                    "its server ({}) exited and nothing listens on the socket",
                    DisplayPid(pid)
                ),
            ),
            Probe::Served => tracing::info!(
                socket_path = %path.display(), server = %DisplayPid(pid),
                "the plugin's server exited but its socket still accepts connections (handed on: fork, fd passing or socket activation): it stays registered until the socket changes"
            ),
            Probe::Replaced => {
                tracing::debug!(socket_path = %path.display(), "the plugin's server exited and its socket went or was replaced: the watcher sees to it")
            }
        }
    }

    fn lost(
        &self,
        path: &Path,
        generation: Uuid,
        learned_by: LearnedBy,
        since: Instant,
        reason: String,
    ) {
        // Whatever else watches this registration (its pidfd, after a kernel-reported close)
        // has nothing left to learn.
        self.end(path, generation);
        if let Some(report) = self.on_loss.get() {
            report(Loss {
                path: path.to_path_buf(),
                generation,
                learned_by,
                reason,
                since,
            });
        }
    }

    /// Removes the watch of `path`'s `generation` and stops its task (a newer registration's
    /// watch is left alone). A task ending itself this way ends at its next await, or returns.
    fn end(&self, path: &Path, generation: Uuid) {
        let ended = {
            let mut watches = self.lock();
            if watches
                .get(path)
                .is_some_and(|w| w.generation == generation)
            {
                watches.remove(path)
            } else {
                None
            }
        };
        if let Some(task) = ended.and_then(|w| w.task) {
            task.abort();
        }
    }

    /// Runs `task` as the watch of `path`'s registration `generation`, replacing any watch of the
    /// path. The entry is in place before the task can run (the lock is held across the spawn):
    /// a task that finishes at once (a server gone already) ends its own entry, not one put in
    /// after it, and an attach that hands over to a pidfd watch cannot be put back over it.
    fn spawn_watch(
        &self,
        path: Arc<Path>,
        generation: Uuid,
        socket: SocketId,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let old = {
            let mut watches = self.lock();
            let task = tokio::spawn(task);
            let watch = Watch {
                generation,
                socket,
                task: Some(task.abort_handle()),
            };
            watches.insert(path, watch)
        };
        // The same registration's attach hands over to its watch from inside the old task;
        // aborting that task only ends it after this call returns.
        if let Some(task) = old.and_then(|w| w.task) {
            task.abort();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<Path>, Watch>> {
        self.watches.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct DisplayPid(Option<u32>);

impl std::fmt::Display for DisplayPid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(pid) => write!(f, "pid {pid}"),
            None => f.write_str("pid unknown here"),
        }
    }
}
