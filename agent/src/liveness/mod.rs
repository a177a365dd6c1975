//! Liveness: a plugin stays registered only while something serves its socket.
//!
//! A plugin that crashes, is OOM-killed or SIGKILLed leaves its socket file behind; kubelet keeps
//! it registered for as long as the file stays (node-driver-registrar issues 139 and 206), and
//! handlers keep routing work to a dead endpoint. Here every registration learns who serves the
//! socket from the registration connection itself: `SO_PEERCRED` (pid, uid, gid of the process
//! that called `listen()`) and `SO_PEERPIDFD`, a pidfd for that process taken by the kernel from
//! the socket (no pid-reuse race, and it works across pid namespaces). The pidfd becomes readable
//! when the process exits, which wakes the agent: no timer, no polling. A process serving many
//! sockets is waited on once (one pidfd, one task), and its exit is checked for each of them.
//!
//! An exit is not yet proof. A listening socket outlives its process when it was handed on (a
//! fork, fd passing, socket activation), so one connect attempt decides:
//! - refused (or the listener is gone with the socket file left behind): the plugin is
//!   **unserved**, reported to the executor as a [`Loss`], which deregisters it;
//! - accepted: the listener lives on in other processes, which the socket's credentials cannot
//!   name (they are the `listen()` caller's). Liveness follows the listening socket, not a
//!   process: [`holders`] finds the processes holding a descriptor of it (from `/proc`), and
//!   their exits are watched in the server's place; the first to exit makes one connect decide
//!   again (and the holders are found again while it still accepts). An idle holder that never
//!   accepts still serves: the kernel queues connections for it. No holder found (a listener in
//!   flight between processes): the registration stays until the socket changes, as before.
//!
//! A registration restored from a previous agent (`persist`) has no registration connection. The
//! previous agent recorded its server's pid and pidfs inode (Linux 6.9+), and while that process
//! runs (the pid opens a pidfd with the same inode) the registration waits on it again, with no
//! connection to the plugin; otherwise one bare connect learns the server (no RPC, so the plugin
//! is not "called"). Both find sockets whose server died while no agent ran.
//!
//! With the eBPF source the kernel adds two hints ([`Liveness::kernel_hint`]): a registered
//! plugin's listening socket was released or shut down (fentry: its last reference dropped,
//! whoever held it, which covers the death of a process it was handed to; syscall tracepoints: a
//! `close()` of one of its descriptors, which covers a listener closed while its process lives
//! on; both: a `shutdown()` of it, after which every connect is refused though the process keeps
//! the descriptor), checked with the same connect; and a bound socket started listening, which
//! moves an unserved socket on at once.
//!
//! This room imports only `state` (the socket identity a probe checks first) and the leaf `kernel`
//! (the pidfd calls, shared with its feature probe); the executor owns
//! the [`Liveness`] and is what a [`Loss`] is reported to.

mod holders;
mod loss;
mod server;
mod unserved;
pub use loss::{LearnedBy, Loss, Probe, accepts, probe};
pub use server::Server;
use server::{DisplayPid, exited, pidfd_open, pidfs_inode};
pub use unserved::Unserved;

use crate::state::SocketId;
use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use uuid::Uuid;

/// Restored registrations whose server is learned at once (one connect each): enough to finish
/// ten thousand in well under a second, few enough not to flood plugins with connections.
const CONCURRENT_ATTACHES: usize = 64;

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
type OnHintsLost = Box<dyn Fn() + Send + Sync>;

/// A registration whose server is known (or being learned). It stays until the registration is
/// deregistered or lost, also after its server's exit was decided (a handed-on listener), so the
/// kernel's hints about its socket still find it.
struct Watch {
    generation: Uuid,
    socket: SocketId,
    /// A task of this registration's own: learning a restored registration's server, checking
    /// a server with no pidfd, or waiting on a pidfd that names no process identity.
    task: Option<AbortHandle>,
    /// The server process whose exit this registration waits for, shared with every other
    /// socket it serves (see [`Processes`]).
    process: Option<u64>,
}

/// One exit watch per server process, however many sockets it serves: a device-plugin manager
/// or a test harness serving thousands holds one pidfd in the agent and one waiting task, not
/// one of each per socket (at 10,000 registrations from two processes, the per-registration
/// tasks were 9.5 MB of the agent's 30 MB of heap, and 10,000 descriptors).
struct ProcessWatch {
    task: AbortHandle,
    /// Registrations whose `process` names this one; the watch ends with the last.
    registrations: usize,
}

/// Keyed by the process's pidfs inode ([`Server::identity`]).
type Processes = HashMap<u64, ProcessWatch>;

/// The registrations and server processes watched, under one lock.
#[derive(Default)]
struct Watches {
    /// Keyed by the desired state's allocation of the path, shared with the watch's task.
    by_path: HashMap<Arc<Path>, Watch, crate::state::PathHasher>,
    processes: Processes,
}

impl Watches {
    /// Puts `watch` in for `path`, and returns the tasks to abort (the replaced watch's own
    /// task, a process watch nothing waits on any more) once the lock is released.
    fn insert(&mut self, path: Arc<Path>, watch: Watch) -> Vec<AbortHandle> {
        match self.by_path.insert(path, watch) {
            Some(old) => self.release(old),
            None => Vec::new(),
        }
    }

    /// Removes `path`'s watch when it is of registration `generation`; returns what to abort.
    fn remove(&mut self, path: &Path, generation: Uuid) -> Vec<AbortHandle> {
        let ours = self
            .by_path
            .get(path)
            .is_some_and(|w| w.generation == generation);
        match ours.then(|| self.by_path.remove(path)).flatten() {
            Some(old) => self.release(old),
            None => Vec::new(),
        }
    }

    /// What a watch that ends leaves to abort: its own task, and its process's watch when it was
    /// the last registration waiting on it.
    fn release(&mut self, old: Watch) -> Vec<AbortHandle> {
        let mut abort: Vec<AbortHandle> = old.task.into_iter().collect();
        if let Some(id) = old.process
            && let Some(process) = self.processes.get_mut(&id)
        {
            process.registrations -= 1;
            if process.registrations == 0
                && let Some(process) = self.processes.remove(&id)
            {
                abort.push(process.task);
            }
        }
        abort
    }
}

fn abort_all(tasks: Vec<AbortHandle>) {
    for task in tasks {
        task.abort();
    }
}

/// The servers being watched, one per registered path; see the module docs.
pub struct Liveness {
    watches: Mutex<Watches>,
    on_loss: OnceLock<OnLoss>,
    on_listen: OnceLock<OnListen>,
    on_hints_lost: OnceLock<OnHintsLost>,
    attaches: Arc<Semaphore>,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            watches: Mutex::new(Watches::default()),
            on_loss: OnceLock::new(),
            on_listen: OnceLock::new(),
            on_hints_lost: OnceLock::new(),
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

    /// Where it is said that the kernel's hints were lost (set once, by the executor): the
    /// "started listening" ones among them never come.
    pub fn on_hints_lost(&self, report: impl Fn() + Send + Sync + 'static) {
        let _ = self.on_hints_lost.set(Box::new(report));
    }

    /// The source lost hints (an overflow: the watcher rescans).
    pub fn hints_lost(&self) {
        if let Some(report) = self.on_hints_lost.get() {
            report();
        }
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
        let identity = server.identity();
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
        let Some(id) = identity else {
            // No process identity (a kernel before pidfs): this registration waits on its own.
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
                // Boxed: a registered plugin's task waits on its pidfd for as long as it lives,
                // and should cost that wait's few bytes, not the connect's.
                Box::pin(this.decide(&owned, generation, socket, since, pid)).await;
            });
            return;
        };
        self.join_process(path, generation, socket, (id, server.pid), || Some(pidfd));
    }

    /// Puts `path`'s registration on the exit watch of process `id`, shared with every other
    /// registration it serves; the first one starts the wait, on the pidfd `pidfd` gives. False,
    /// and nothing put in, when that gives none.
    fn join_process(
        self: &Arc<Self>,
        path: Arc<Path>,
        generation: Uuid,
        socket: SocketId,
        (id, pid): (u64, Option<u32>),
        pidfd: impl FnOnce() -> Option<OwnedFd>,
    ) -> bool {
        let watch = Watch {
            generation,
            socket,
            task: None,
            process: Some(id),
        };
        let abort = {
            let mut watches = self.lock();
            match watches.processes.get_mut(&id) {
                // Already watched for another socket: `pidfd` is not called (a pidfd it holds
                // is closed unused).
                Some(process) => process.registrations += 1,
                None => {
                    let Some(pidfd) = pidfd() else { return false };
                    let this = Arc::downgrade(self);
                    let task = tokio::spawn(process_exit(this, id, pidfd, pid));
                    let process = ProcessWatch {
                        task: task.abort_handle(),
                        registrations: 1,
                    };
                    watches.processes.insert(id, process);
                }
            }
            watches.insert(path, watch)
        };
        abort_all(abort);
        true
    }

    /// Watches the server of a restored registration. The previous agent's record of it
    /// (`known`: its pid and pidfs inode) is enough while that process runs: the pid opens a
    /// pidfd with the same inode (which names one process for as long as the machine runs, so a
    /// reused pid does not pass), and the registration waits on it as it did before the restart,
    /// without a connection to the plugin (a restart of an agent serving 1,000 plugins made 1,000
    /// connects, and their accepts held up the registrations of the plugins that came meanwhile).
    /// Otherwise one bare connect learns the server; a refused one is a loss at once.
    pub fn attach(
        self: &Arc<Self>,
        path: Arc<Path>,
        generation: Uuid,
        socket: SocketId,
        known: Option<(u32, u64)>,
    ) {
        if let Some((pid, id)) = known {
            let same_process =
                || pidfd_open(pid).filter(|pidfd| pidfs_inode(pidfd.as_fd()) == Some(id));
            if self.join_process(
                path.clone(),
                generation,
                socket,
                (id, Some(pid)),
                same_process,
            ) {
                tracing::debug!(socket_path = %path.display(), server = %DisplayPid(Some(pid)), found_by = "record", "the restored plugin's server, watched for its exit");
                return;
            }
        }
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
                        tracing::debug!(socket_path = %owned.display(), %server, found_by = "connect", "the restored plugin's server, watched for its exit");
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
        let Some((generation, socket)) = self
            .lock()
            .by_path
            .get(path)
            .map(|w| (w.generation, w.socket))
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
        self.lock().by_path.len()
    }

    /// Server processes whose exit is being waited for (one pidfd each).
    pub fn processes(&self) -> usize {
        self.lock().processes.len()
    }

    /// A server whose exit cannot be watched (no pidfd): one connect says whether it is gone
    /// already (it died between the connection and the pidfd); served, nothing more is known.
    async fn check_unwatchable(
        self: &Arc<Self>,
        path: &Path,
        generation: Uuid,
        socket: SocketId,
        pid: Option<u32>,
    ) {
        match probe(path, socket).await.0 {
            Probe::Refused => self.lost(
                path,
                generation,
                LearnedBy::ConnectProbe,
                Instant::now(),
                format!(
                    "its server ({}) was gone before its exit could be watched, and nothing listens on the socket",
                    DisplayPid(pid)
                ),
            ),
            // The process that listened is gone (or cannot be watched): whoever holds the
            // listener now serves it.
            Probe::Served => self.follow_holders(path, generation, socket, pid).await,
            Probe::Replaced => {}
        }
    }

    /// The server of `path`'s registration exited: one connect decides.
    async fn decide(
        self: &Arc<Self>,
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
            Probe::Served => self.follow_holders(path, generation, socket, pid).await,
            Probe::Replaced => {
                tracing::debug!(socket_path = %path.display(), "the plugin's server exited and its socket went or was replaced: the watcher sees to it")
            }
        }
    }

    /// `path`'s socket still accepts connections though the process that listened (`gone`) is
    /// gone: the processes holding its listener serve it, and the first of them to exit makes one
    /// connect decide again. Nothing is watched when none is found (see the module docs).
    async fn follow_holders(
        self: &Arc<Self>,
        path: &Path,
        generation: Uuid,
        socket: SocketId,
        gone: Option<u32>,
    ) {
        let owned = path.to_path_buf();
        let holders = tokio::task::spawn_blocking(move || holders::holding(&owned, socket))
            .await
            .unwrap_or_default();
        if holders.is_empty() {
            tracing::info!(
                socket_path = %path.display(), server = %DisplayPid(gone),
                "the plugin's server exited but its socket still accepts connections, and no process holds its listener that the agent can see (in flight between processes?): it stays registered until the socket changes"
            );
            return;
        }
        let pids: Vec<u32> = holders.iter().map(|h| h.pid).collect();
        tracing::info!(
            socket_path = %path.display(), server = %DisplayPid(gone), holders = ?pids,
            "the plugin's listener lives on in other processes (handed on: fork, fd passing or socket activation): their exits are watched in its server's place"
        );
        let this = Arc::downgrade(self);
        let path: Arc<Path> = Arc::from(path);
        let owned = path.clone();
        self.spawn_watch_of(path, generation, socket, async move {
            let exits = holders.into_iter().map(|holder| {
                let pid = holder.pid;
                Box::pin(async move { (exited(holder.pidfd).await, pid) })
            });
            let ((waited, pid), _, _) = futures::future::select_all(exits).await;
            if let Err(e) = waited {
                tracing::warn!(socket_path = %owned.display(), error = %e, "cannot wait on the plugin listener's holder: its exit goes unnoticed");
                return;
            }
            let since = Instant::now();
            let Some(this) = this.upgrade() else { return };
            this.decide_again(owned, generation, socket, since, pid).await;
        });
    }

    /// [`decide`](Self::decide) after a holder's exit, as a named future type: deciding may
    /// follow holders again, whose task awaits this.
    fn decide_again(
        self: Arc<Self>,
        path: Arc<Path>,
        generation: Uuid,
        socket: SocketId,
        since: Instant,
        pid: u32,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move {
            self.decide(&path, generation, socket, since, Some(pid))
                .await;
        })
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

    /// Removes the watch of `path`'s `generation` and stops its task, and its process's when
    /// nothing else waits on it (a newer registration's watch is left alone). A task ending
    /// itself this way ends at its next await, or returns.
    fn end(&self, path: &Path, generation: Uuid) {
        let abort = self.lock().remove(path, generation);
        abort_all(abort);
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
        self.spawn_watch_if(path, generation, socket, task, false);
    }

    /// [`spawn_watch`](Self::spawn_watch) for a registration already watched: nothing is put in
    /// when the path's watch is gone or of another registration by now (what ran meanwhile
    /// decided).
    fn spawn_watch_of(
        &self,
        path: Arc<Path>,
        generation: Uuid,
        socket: SocketId,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        self.spawn_watch_if(path, generation, socket, task, true);
    }

    fn spawn_watch_if(
        &self,
        path: Arc<Path>,
        generation: Uuid,
        socket: SocketId,
        task: impl std::future::Future<Output = ()> + Send + 'static,
        only_if_current: bool,
    ) {
        let abort = {
            let mut watches = self.lock();
            let current = watches
                .by_path
                .get(&path)
                .is_some_and(|w| w.generation == generation);
            if only_if_current && !current {
                return;
            }
            let task = tokio::spawn(task);
            let watch = Watch {
                generation,
                socket,
                task: Some(task.abort_handle()),
                process: None,
            };
            watches.insert(path, watch)
        };
        // The same registration's attach hands over to its watch from inside the old task;
        // aborting that task only ends it after this call returns.
        abort_all(abort);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Watches> {
        self.watches.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Waits for the exit of server process `id`, then decides for every registration it served
/// (one connect each, all at once).
async fn process_exit(this: Weak<Liveness>, id: u64, pidfd: OwnedFd, pid: Option<u32>) {
    if let Err(e) = exited(pidfd).await {
        tracing::warn!(server = %DisplayPid(pid), error = %e, "cannot wait on a plugin server's pidfd: its exit goes unnoticed");
        return;
    }
    let since = Instant::now();
    let Some(this) = this.upgrade() else { return };
    let served: Vec<(Arc<Path>, Uuid, SocketId)> = {
        let mut watches = this.lock();
        watches.processes.remove(&id);
        watches
            .by_path
            .iter_mut()
            .filter(|(_, w)| w.process == Some(id))
            .map(|(path, w)| {
                w.process = None;
                (path.clone(), w.generation, w.socket)
            })
            .collect()
    };
    let decisions = served
        .iter()
        .map(|(path, generation, socket)| this.decide(path, *generation, *socket, since, pid));
    futures::future::join_all(decisions).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::EntryKind;
    use std::io;
    use std::io::{BufRead, BufReader};
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};

    /// A process of its own serving sockets; killed and reaped when dropped, also when a test
    /// fails.
    struct ServingProcess(Child);

    impl ServingProcess {
        fn exit(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    impl Drop for ServingProcess {
        fn drop(&mut self) {
            self.exit();
        }
    }

    /// A process of its own listening on `count` sockets in a new directory, returned once all
    /// listen (dropped in reverse: the process ends before its directory goes).
    fn serve(count: usize) -> (tempfile::TempDir, Vec<PathBuf>, ServingProcess) {
        let dir = tempfile::tempdir().expect("tempdir");
        let paths: Vec<PathBuf> = (0..count)
            .map(|i| dir.path().join(format!("plugin-{i}.sock")))
            .collect();
        let script = "import socket, sys, time\n\
                      held = []\n\
                      for path in sys.argv[1:]:\n\
                      \x20   s = socket.socket(socket.AF_UNIX)\n\
                      \x20   s.bind(path)\n\
                      \x20   s.listen()\n\
                      \x20   held.append(s)\n\
                      print('ready', flush=True)\n\
                      time.sleep(600)\n";
        let mut process = ServingProcess(
            Command::new("python3")
                .arg("-c")
                .arg(script)
                .args(&paths)
                .stdout(Stdio::piped())
                .spawn()
                .expect("start python3"),
        );
        let mut line = String::new();
        let stdout = process.0.stdout.as_mut().expect("stdout");
        BufReader::new(stdout).read_line(&mut line).expect("read");
        assert_eq!(line.trim(), "ready");
        (dir, paths, process)
    }

    /// Registers `path` as the executor does: its server from a connection's credentials.
    fn watch(liveness: &Arc<Liveness>, path: &Path) -> Option<Uuid> {
        let connection = std::os::unix::net::UnixStream::connect(path).expect("connect");
        let server = Server::of(connection.as_fd()).expect("credentials");
        server.identity()?;
        let Ok(EntryKind::Socket(socket)) = EntryKind::of(path) else {
            panic!("{} is not a socket", path.display());
        };
        let generation = Uuid::new_v4();
        liveness.watch(Arc::from(path), generation, socket, server);
        Some(generation)
    }

    /// One process serving several sockets is one pidfd and one waiting task; a registration
    /// that ends leaves it to the others, and its exit ends every registration still on it.
    #[tokio::test]
    async fn a_process_serving_many_sockets_is_one_exit_watch_that_ends_them_all() {
        let (_dir, paths, mut server) = serve(3);
        let liveness = Arc::new(Liveness::default());
        let (tx, mut losses) = tokio::sync::mpsc::unbounded_channel();
        liveness.on_loss(move |loss| {
            let _ = tx.send(loss);
        });
        let mut generations = Vec::new();
        for path in &paths {
            let Some(generation) = watch(&liveness, path) else {
                eprintln!("skipped: pidfds name no process identity on this kernel (before 6.9)");
                return;
            };
            generations.push(generation);
        }
        assert_eq!((liveness.watched(), liveness.processes()), (3, 1));

        liveness.forget(&paths[2], generations[2]);
        assert_eq!((liveness.watched(), liveness.processes()), (2, 1));

        server.exit();
        let mut lost = Vec::new();
        for _ in 0..2 {
            let loss = tokio::time::timeout(Duration::from_secs(10), losses.recv())
                .await
                .expect("the server's exit is reported")
                .expect("liveness alive");
            assert_eq!(loss.learned_by, LearnedBy::Pidfd);
            lost.push((loss.path, loss.generation));
        }
        lost.sort();
        assert_eq!(
            lost,
            vec![
                (paths[0].clone(), generations[0]),
                (paths[1].clone(), generations[1])
            ]
        );
        assert_eq!((liveness.watched(), liveness.processes()), (0, 0));
        assert!(
            losses.try_recv().is_err(),
            "the forgotten registration is not reported"
        );
    }

    /// A restored registration whose server the previous agent recorded (pid and pidfs inode)
    /// waits on that process again at once, with no connection to the plugin, and learns of its
    /// exit as before; a record whose inode is not the pid's process now (a reused pid) is not
    /// trusted: one connect learns the server.
    #[tokio::test]
    async fn a_restored_registration_rejoins_its_recorded_server_without_a_connect() {
        let socket_of = |path: &Path| match EntryKind::of(path) {
            Ok(EntryKind::Socket(socket)) => socket,
            other => panic!("{} is not a socket: {other:?}", path.display()),
        };
        let liveness = Arc::new(Liveness::default());
        let (tx, mut losses) = tokio::sync::mpsc::unbounded_channel();
        liveness.on_loss(move |loss| {
            let _ = tx.send(loss);
        });

        // Served by another process, recorded by "the previous agent" from its connection.
        let (_dir, paths, mut server) = serve(1);
        let recorded = {
            let connection = std::os::unix::net::UnixStream::connect(&paths[0]).expect("connect");
            Server::of(connection.as_fd()).expect("credentials")
        };
        let (Some(pid), Some(identity)) = (recorded.pid, recorded.identity()) else {
            eprintln!("skipped: pidfds name no process identity on this kernel (before 6.9)");
            return;
        };
        let served = Uuid::new_v4();
        let path: Arc<Path> = Arc::from(paths[0].as_path());
        liveness.attach(path, served, socket_of(&paths[0]), Some((pid, identity)));
        // Joined in the call itself: no task, no connect.
        assert_eq!((liveness.watched(), liveness.processes()), (1, 1));

        // Served by this process, which can see whether anything connected.
        let here = tempfile::tempdir().expect("tempdir");
        let own = here.path().join("own.sock");
        let listener = std::os::unix::net::UnixListener::bind(&own).expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let me = std::process::id();
        let my_identity = pidfd_open(me)
            .and_then(|pidfd| pidfs_inode(pidfd.as_fd()))
            .expect("pidfs names this process too");
        liveness.attach(
            Arc::from(own.as_path()),
            Uuid::new_v4(),
            socket_of(&own),
            Some((me, my_identity)),
        );
        assert_eq!((liveness.watched(), liveness.processes()), (2, 2));

        // A record of a process gone, whose pid was reused (by this process): the pid opens a
        // pidfd of another inode.
        let reused = here.path().join("reused.sock");
        let reused_listener = tokio::net::UnixListener::bind(&reused).expect("bind");
        liveness.attach(
            Arc::from(reused.as_path()),
            Uuid::new_v4(),
            socket_of(&reused),
            Some((me, u64::MAX)),
        );
        tokio::time::timeout(Duration::from_secs(10), reused_listener.accept())
            .await
            .expect("the server is learned with a connect")
            .expect("accept");
        assert_eq!(
            listener.accept().map_err(|e| e.kind()).err(),
            Some(io::ErrorKind::WouldBlock),
            "a recorded server that still runs is not connected to"
        );

        server.exit();
        let loss = tokio::time::timeout(Duration::from_secs(10), losses.recv())
            .await
            .expect("the recorded server's exit is reported")
            .expect("liveness alive");
        assert_eq!(
            (&*loss.path, loss.generation, loss.learned_by),
            (paths[0].as_path(), served, LearnedBy::Pidfd)
        );
    }

    /// When the last registration served by a process ends, so does the wait on its exit (its
    /// pidfd is closed): nothing is held for a process no registration names.
    #[tokio::test]
    async fn the_last_registration_of_a_process_ends_the_wait_on_its_exit() {
        let (_dir, paths, server) = serve(2);
        let liveness = Arc::new(Liveness::default());
        let Some(first) = watch(&liveness, &paths[0]) else {
            eprintln!("skipped: pidfds name no process identity on this kernel (before 6.9)");
            return;
        };
        let second = watch(&liveness, &paths[1]).expect("identity");
        // Re-registering a path on the same process replaces its watch, not the process's.
        let again = watch(&liveness, &paths[1]).expect("identity");
        assert_ne!(second, again);
        assert_eq!((liveness.watched(), liveness.processes()), (2, 1));
        liveness.forget(&paths[1], second);
        assert_eq!(liveness.watched(), 2, "an older generation ends nothing");
        liveness.forget(&paths[1], again);
        liveness.forget(&paths[0], first);
        assert_eq!((liveness.watched(), liveness.processes()), (0, 0));
        drop(server);
    }
}
