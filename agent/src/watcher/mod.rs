//! Watcher: turns event-source hints into desired state, checking each against the filesystem.
//!
//! ```text
//! FsEvent --> stat the path (the truth) --> socket:    desired add-or-update --> mark for reconcile
//!                                       --> directory: watch it, then walk it (recursively)
//!                                       --> gone:      desired remove (the whole subtree for a dir)
//! Rescan  --> walk the whole tree and converge desired state on it exactly
//! ```
//!
//! Rules (one set, applied the same at start, on events and on rescans):
//! - Only Unix domain sockets are plugins. Regular files, FIFOs, devices are ignored.
//! - Symlinks are ignored, to a socket or to a directory: a plugin creates its socket in the tree.
//!   Following them would let an entry outside the tree (whose removal no event reports) or a
//!   symlink loop into the desired state. Kubelet follows them; this is a deliberate difference.
//! - Names starting with `.` are ignored, files and directories alike, at start and on events
//!   (kubelet ignores them on events but walks dot-directories at start).
//! - Directories are watched *before* they are walked, so an entry created during the walk is
//!   seen either by the walk or by an event.
//! - If the root itself is removed, the agent re-creates it (mode 0755, as kubelet does at start),
//!   and rescans.
//! - A directory that cannot be read (permission denied, or a transient EMFILE/ENOMEM) is logged,
//!   counted and skipped; its siblings are not affected, and what was known under it is kept
//!   until a walk reads it again (a failed read is not an empty directory: see
//!   [`crate::watch_health`]). The same for a path beyond PATH_MAX, and for a plugin directory that
//!   is not a directory (swapped for a symlink): logged, shown by `status`, and `/readyz` fails.

use crate::event_source::{
    Entry, EventSource, FsEvent, Observed, RescanReason, WatchedDir, monotonic_now_ns,
};
use crate::notifications::{AgentEvent, EventKind, NotificationBus};
use crate::provenance::Contact;
use crate::state::EntryKind;
use crate::state::desired::{Change, DesiredState, ListenSeen, Listening};
use crate::state::queue::ReconcileQueue;
use crate::state::safety_pass::SafetyPass;
use crate::telemetry::Telemetry;
use crate::telemetry::discovery::{Found, Via, wall_time_of};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

mod dirs;
mod name_hints;
mod names;
mod walk;

use dirs::WatchedDirs;

use name_hints::NameHints;

/// Most events handled per wake-up before desired-state changes are published to the reconciler
/// (bounds latency under a storm while still batching).
const BATCH: usize = 1024;

/// See the module docs.
pub struct Watcher {
    root: PathBuf,
    source: Arc<dyn EventSource>,
    desired: Arc<DesiredState>,
    queue: Arc<ReconcileQueue>,
    /// Ordered by path, so a directory's subtree is one contiguous range (path order compares
    /// component by component): removing a directory costs its subtree, not the whole tree.
    dirs: WatchedDirs,
    /// The root's parent, watched only so that the root's own removal and re-creation are seen
    /// by every source (a source reports changes *inside* the directories it watches); events for
    /// the root's siblings are ignored.
    anchor: Option<WatchedDir>,
    /// Full re-walks asked for by the reconciler's safety pass (a stored permit: never lost,
    /// even while the event channel is full).
    safety: Arc<SafetyPass>,
    notifications: NotificationBus,
    telemetry: Arc<Telemetry>,
    /// Where the source's hints about who serves a socket go (`FsEvent::Serving`).
    liveness: Option<Arc<crate::liveness::Liveness>>,
}

impl Watcher {
    /// - `root`: the registration directory (kubelet: `/var/lib/kubelet/plugins_registry`);
    /// - `source`: where hints come from; the watcher tells it which directories to watch;
    /// - `desired`: filled here;
    /// - `queue`: told about every path whose desired state changed;
    /// - `notifications`: discoveries, removals and rescans are published there;
    /// - `telemetry`: each discovery and removal is recorded there (the root of the operation's
    ///   trace), each rescan, hint and watched directory counted.
    pub fn new(
        root: PathBuf,
        source: Arc<dyn EventSource>,
        desired: Arc<DesiredState>,
        queue: Arc<ReconcileQueue>,
        notifications: NotificationBus,
        telemetry: Arc<Telemetry>,
    ) -> Self {
        Watcher {
            root,
            source,
            desired,
            queue,
            dirs: WatchedDirs::default(),
            anchor: None,
            safety: Arc::default(),
            notifications,
            telemetry,
            liveness: None,
        }
    }

    /// Hands the source's serving hints (a socket's `listen`, its listener's `close`) to
    /// `liveness`; without it they are ignored.
    pub fn with_liveness(mut self, liveness: Arc<crate::liveness::Liveness>) -> Self {
        self.liveness = Some(liveness);
        self
    }

    /// Where the reconciler's safety pass asks for a full re-walk, and learns what the walks cost.
    pub fn safety_pass(&self) -> Arc<SafetyPass> {
        self.safety.clone()
    }

    /// Creates the root if missing, watches and walks it, then follows the source's `hints` until `cancel`.
    /// `on_ready` is called after the first full scan, before it is reported (counted for
    /// status, the `walked` event): whoever sees the start walk's end sees what `on_ready` did.
    pub async fn run(
        mut self,
        mut hints: mpsc::Receiver<FsEvent>,
        cancel: CancellationToken,
        on_ready: impl FnOnce(),
    ) -> anyhow::Result<()> {
        // Opened before the first walk: a mount between the two is a change it reports.
        let mut mounts = match crate::mounts::MountWatch::open(&self.root) {
            Ok(mounts) => Some(mounts),
            Err(e) => {
                warn!(error = %e, "cannot follow mounts (/proc/self/mountinfo): a file system mounted in the plugin directory is found by the next safety pass");
                None
            }
        };
        let started = std::time::Instant::now();
        let walk = self.walk_tree(RescanReason::Start);
        self.safety.spent(started.elapsed());
        on_ready();
        self.walked(walk);
        let mut batch = Vec::with_capacity(BATCH);
        let safety = self.safety.clone();
        loop {
            let mount_change = async {
                match mounts.as_mut() {
                    Some(mounts) => mounts.changed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                () = safety.requested() => {
                    let started = std::time::Instant::now();
                    self.rescan(RescanReason::Periodic);
                    safety.spent(started.elapsed());
                    continue;
                }
                changed = mount_change => {
                    match changed {
                        Ok(()) => self.rescan(RescanReason::MountsChanged),
                        Err(e) => {
                            warn!(error = %e, "stopped following mounts: a file system mounted in the plugin directory is found by the next safety pass");
                            mounts = None;
                        }
                    }
                    continue;
                }
                received = hints.recv_many(&mut batch, BATCH) => {
                    if received == 0 {
                        anyhow::bail!("event source {} stopped", self.source.kind());
                    }
                }
            }
            self.handle_batch(&mut batch);
        }
    }

    /// One wake-up's hints, in the order that makes each cheap: the checks of created and
    /// removed paths, the batch's name hints together, a rescan if one was asked for, then the
    /// listeners closed and the first contacts.
    fn handle_batch(&mut self, batch: &mut Vec<FsEvent>) {
        let _one_wake_up = self.queue.hold();
        self.telemetry
            .watcher
            .hints
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        // A rescan in the batch covers every hint beside it: each was committed before the
        // watcher received it, so before the walk. Checking them one by one first would
        // only delay the walk, which under a flood is what makes progress.
        let rescan = batch.iter().rev().find_map(|event| match event {
            FsEvent::Rescan { reason } => Some(RescanReason::EventLoss(reason.clone())),
            _ => None,
        });
        if rescan.is_some() {
            // Contacts describe sockets the walk will find: they are kept for after it.
            batch.retain(|event| matches!(event, FsEvent::Contacted { .. }));
        }
        let mut names = NameHints::default();
        let mut contacts = Vec::new();
        let mut releases = Vec::new();
        for event in batch.drain(..) {
            match event {
                FsEvent::Created { path, observed } => self.check_created(&path, observed),
                FsEvent::Removed { path, observed } => self.check(&path, observed),
                FsEvent::NameChanged {
                    name,
                    parent,
                    observed,
                } => {
                    // Name hints are checked once per batch, together: a burst of them (a
                    // `mkdir -p` of thousands by absolute path) costs one pass over the
                    // tree, not one per name.
                    names.add(name, parent, observed);
                }
                FsEvent::Rescan { .. } => {}
                FsEvent::Serving {
                    path,
                    listening,
                    observed,
                } => {
                    if listening && !self.desired.contains(&path) {
                        // Served now: also a socket the watcher may not know yet (bound in
                        // a directory not watched at the time). A known one was looked at
                        // when its bind was reported, and a socket bound there since has a
                        // bind event of its own: looking again would be a `statx` and a
                        // `name_to_handle_at` per plugin for nothing.
                        self.check_created(&path, observed);
                    }
                    if listening {
                        self.listened(&path, observed);
                        self.serving_hint(&path, true);
                    } else {
                        releases.push(path);
                    }
                }
                FsEvent::Contacted { path, observed } => contacts.push((path, observed)),
            }
        }
        if !names.is_empty() {
            self.check_names(&names);
        }
        if let Some(reason) = rescan {
            self.rescan(reason);
            if let Some(liveness) = &self.liveness {
                liveness.hints_lost();
            }
        }
        // After the removals beside them: a plugin going away unlinks its socket, then closes
        // its listener, and a socket already forgotten needs no check of who serves it (its
        // deregistration is under way). A storm's hundred removals were a hundred probe tasks
        // competing with their own deregistrations.
        for path in releases {
            if self.desired.contains(&path) {
                self.serving_hint(&path, false);
            }
        }
        // After every entry of the batch and any walk: the socket contacted is desired by now
        // if it is in the tree at all (its bind came before its first contact).
        for (path, observed) in contacts {
            self.first_contact(&path, observed);
        }
    }

    /// Passes the source's hint that `path`'s listener started (`listening`) or was closed to
    /// liveness, which decides whether anything still serves it.
    fn serving_hint(&self, path: &Path, listening: bool) {
        if let Some(liveness) = &self.liveness
            && path.starts_with(&self.root)
        {
            liveness.kernel_hint(path, listening);
        }
    }

    /// Records when the socket at `path` was first seen listening: the kernel's report of its
    /// `listen()` (`explain`'s timeline).
    fn listened(&self, path: &Path, observed: Observed) {
        let now = std::time::SystemTime::now();
        let at = observed
            .kernel_ns
            .map_or(now, |ns| wall_time_of(ns, monotonic_now_ns(), now));
        let listening = Listening {
            at,
            seen_by: ListenSeen::KernelReport,
        };
        self.desired
            .record_listening(path, None, observed.kernel_ns, listening);
    }

    /// Records who first connected to the socket at `path` (eBPF's `Contacted`, once per socket
    /// instance): `list` shows it, the event bus and telemetry time it from the socket's creation.
    fn first_contact(&self, path: &Path, observed: Observed) {
        let (Some(by), Some(kernel_ns)) = (observed.by, observed.kernel_ns) else {
            return;
        };
        let at = wall_time_of(kernel_ns, monotonic_now_ns(), std::time::SystemTime::now());
        let contact = Contact { by, kernel_ns, at };
        let Some(desired) = self.desired.record_contact(path, contact) else {
            return;
        };
        let after_creation = contact.after_creation(desired.kernel_ns);
        info!(
            socket_path = %path.display(),
            pid = by.pid,
            command = by.comm.map(|c| c.as_string()).unwrap_or_default(),
            after_creation = ?after_creation,
            "plugin socket first contacted"
        );
        self.telemetry.first_contact(path, &contact, after_creation);
        // Observe mode waits for this contact before it asks the plugin (see `executor`).
        self.queue.mark(path.to_path_buf());
        let mut event = AgentEvent::new(EventKind::FirstContact, path);
        event.at = at;
        event.contact = Some(contact);
        event.latency = after_creation;
        self.notifications.publish(event);
    }

    /// Looks at one path the source mentioned and updates state to match what is there.
    fn check(&mut self, path: &Path, observed: Observed) {
        if self.followed(path) {
            self.settle(path, EntryKind::of(path), observed);
        }
    }

    /// [`check`](Self::check) for a path the source says was created (or started listening):
    /// almost always a new socket. A path the watcher does not know yet is announced to the
    /// source before it is looked at, as a walk does, so that look is the one after the
    /// announcement: a plugin's socket costs one `statx` and one `name_to_handle_at`, not two of
    /// each (look, announce, look again). A name the look does not find a socket for is
    /// withdrawn.
    fn check_created(&mut self, path: &Path, observed: Observed) {
        if !self.followed(path) {
            return;
        }
        let unknown = !self.desired.contains(path) && !self.dirs.contains_key(path);
        if !unknown {
            self.settle(path, EntryKind::of(path), observed);
            return;
        }
        // Announced once: a name the source knew already (or a source that keeps none) would
        // be announced again, for nothing, on the way through `settle`.
        let new_to_source = self.announce(path, Entry::Socket);
        match EntryKind::of(path) {
            Ok(EntryKind::Socket(socket)) => {
                self.socket_announced(path, socket, observed, Via::Event, false)
            }
            other => {
                if new_to_source {
                    self.unannounce(path);
                }
                self.settle(path, other, observed);
            }
        }
    }

    /// Whether `path` is one the watcher follows. The root is, while it is the directory the
    /// watcher walked: when it was removed, or replaced (by a symlink, or by another directory),
    /// what was watched under it is gone, and only a full walk says what is watched now (`status`
    /// and `/readyz` learn of it there).
    fn followed(&mut self, path: &Path) -> bool {
        let is_root = match place(path, &self.root) {
            Place::NotFollowed => return false,
            Place::Root => true,
            Place::Below => false,
        };
        if is_root && !self.root_unchanged() {
            self.forget_dir(path);
            self.rescan(RescanReason::RootRemoved);
            return false;
        }
        true
    }

    /// Updates state to match what a look at `path` found.
    fn settle(&mut self, path: &Path, looked: std::io::Result<EntryKind>, observed: Observed) {
        match looked {
            Ok(EntryKind::Socket(socket)) => {
                self.socket_present(path, socket, observed, Via::Event)
            }
            Ok(EntryKind::Directory { .. }) => {
                self.forget_socket(path, observed, Via::Event);
                if !self.dirs.contains_key(path) {
                    self.add_tree(path);
                }
            }
            Ok(EntryKind::Other) => {
                self.forget_socket(path, observed, Via::Event);
                self.forget_dir(path);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget_socket(path, observed, Via::Event);
                self.forget_dir(path);
            }
            Err(e) => {
                warn!(path = %path.display(), error = %e, "cannot stat; leaving its state as it was")
            }
        }
    }

    fn socket_present(
        &mut self,
        path: &Path,
        socket: crate::state::SocketId,
        observed: Observed,
        via: Via,
    ) {
        let new_to_source = self.announce(path, Entry::Socket);
        self.socket_announced(path, socket, observed, via, new_to_source);
    }

    /// [`socket_present`](Self::socket_present) once the socket was announced to the source;
    /// `new_to_source`: the source did not know its name.
    fn socket_announced(
        &mut self,
        path: &Path,
        mut socket: crate::state::SocketId,
        observed: Observed,
        via: Via,
        new_to_source: bool,
    ) {
        if new_to_source {
            // The source did not know the name: a removal by a multi-component path before the
            // announcement went unreported, so look again now that any later one will be.
            match EntryKind::of(path) {
                Ok(EntryKind::Socket(now)) => socket = now,
                _ => {
                    self.unannounce(path);
                    self.check(path, observed);
                    return;
                }
            }
        }
        match self.desired.add_observed(
            path,
            socket,
            observed.kernel_ns,
            via == Via::Event,
            observed.by,
        ) {
            Ok(Change::Unchanged) => {}
            Ok(change) => {
                let found = match change {
                    Change::Replaced => Found::Replaced,
                    _ => Found::Created,
                };
                self.telemetry
                    .discovery
                    .record(path, found, via, observed.kernel_ns);
                let since_event = observed
                    .kernel_ns
                    .map(|ns| Duration::from_nanos(monotonic_now_ns().saturating_sub(ns)));
                // One info line per registration outcome is the executor's; discovery is detail
                // (also on the admin event stream).
                debug!(socket_path = %path.display(), ?change, ?since_event, "socket discovered");
                self.notifications
                    .publish(AgentEvent::new(EventKind::SocketDiscovered, path));
                self.queue.mark(path.to_path_buf());
            }
            Err(e) => warn!(socket_path = %path.display(), error = %e, "cannot record socket"),
        }
    }

    fn forget_socket(&mut self, path: &Path, observed: Observed, via: Via) {
        if self.desired.remove(path) {
            self.unannounce(path);
            self.telemetry
                .discovery
                .record(path, Found::Removed, via, observed.kernel_ns);
            let now = monotonic_now_ns();
            let since_event = observed
                .kernel_ns
                .map(|ns| Duration::from_nanos(now.saturating_sub(ns)));
            let since_read = observed
                .read_ns
                .map(|ns| Duration::from_nanos(now.saturating_sub(ns)));
            debug!(socket_path = %path.display(), ?since_event, ?since_read, "socket removed");
            self.notifications
                .publish(AgentEvent::new(EventKind::SocketRemoved, path));
            self.queue.mark(path.to_path_buf());
        }
    }

    fn forget_dir(&mut self, dir: &Path) {
        let gone = self.dirs.subtree(dir);
        // Sockets are only ever recorded from directories in `dirs` (a walk watches a directory
        // before it reads it; events come from watched directories; a rescan prunes both
        // together), so a path that was not a watched directory has no sockets below it. Every
        // removed socket comes through here: without this, each removal would scan the whole
        // desired state (deregistering 10,000 plugins: 50 million path comparisons).
        if gone.is_empty() {
            return;
        }
        // Names first, while every parent is still in `dirs` to say where they were.
        let sockets = self.desired.remove_under(dir);
        for path in gone.iter().chain(&sockets) {
            self.unannounce(path);
        }
        for path in &gone {
            if let Some(watched) = self.dirs.remove(path) {
                self.source.unwatch(&watched);
            }
            self.telemetry
                .watcher
                .watched_dirs
                .store(self.dirs.len() as u64, Ordering::Relaxed);
        }
        for path in sockets {
            self.telemetry
                .discovery
                .record(&path, Found::Removed, Via::Event, None);
            debug!(socket_path = %path.display(), "socket removed with its directory");
            self.notifications
                .publish(AgentEvent::new(EventKind::SocketRemoved, &path));
            self.queue.mark(path);
        }
    }

    /// Tells the source that an entry named like `path` exists in `path`'s (watched) directory.
    /// Sources that match removals by name in the kernel depend on it; a rescan re-announces
    /// everything, because a source whose name table overflowed asks for a rescan to refill it.
    /// True when the name was new to the source: the caller looks at the entry again.
    fn announce(&self, path: &Path, entry: Entry) -> bool {
        match (
            path.parent().and_then(|p| self.dirs.get(p)),
            path.file_name(),
        ) {
            (Some(dir), Some(name)) => self.source.entry_present(dir, name, entry),
            _ => false,
        }
    }

    /// Tells the source that the entry at `path` is gone, so its name can leave the source's
    /// table. Called while `path`'s directory is still in the watched set.
    fn unannounce(&self, path: &Path) {
        if let (Some(dir), Some(name)) = (
            path.parent().and_then(|p| self.dirs.get(p)),
            path.file_name(),
        ) {
            self.source.entry_absent(dir, name);
        }
    }
}

/// Where a path is, for the watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Outside the root, or an ignored name ([`ignored_name`]).
    NotFollowed,
    /// The root itself.
    Root,
    /// Below the root, and followed.
    Below,
}

/// Where `path` is relative to `root`. Read from the bytes when the path is the root's bytes,
/// a `/` and names none of which is empty or starts with `.` (every hint for an entry of the
/// tree: sources join a watched directory and a name); component by component otherwise, which
/// gives the same answer at ten times the cost (it was half of the watcher's part of a
/// registration).
fn place(path: &Path, root: &Path) -> Place {
    let raw = path.as_os_str().as_bytes();
    let root_raw = root.as_os_str().as_bytes();
    if let Some(rest) = raw.strip_prefix(root_raw) {
        if rest.is_empty() {
            return Place::Root;
        }
        let names = match root_raw.last() {
            Some(b'/') => Some(rest),
            _ => rest.strip_prefix(b"/"),
        };
        let plain_names = |names: &[u8]| {
            names
                .split(|b| *b == b'/')
                .all(|name| name.first().is_some_and(|first| *first != b'.'))
        };
        if names.is_some_and(plain_names) {
            return Place::Below;
        }
    }
    place_by_components(path, root)
}

/// [`place`], component by component.
fn place_by_components(path: &Path, root: &Path) -> Place {
    if !path.starts_with(root) || ignored_name(path, root) {
        Place::NotFollowed
    } else if path == root {
        Place::Root
    } else {
        Place::Below
    }
}

/// True for paths with a component below the root that starts with `.`, and for paths that are
/// not in plain form (a `.`, `..` or empty component anywhere, a trailing `/`): `Path::components`
/// drops those, so `root/link/.` or `root/link/` would pass as `root/link`, and `stat` of them
/// follows the symlink `link` out of the tree. Sources join a watched directory and an entry
/// name, so no real hint has one.
fn ignored_name(path: &Path, root: &Path) -> bool {
    // Below the root only: the root is the operator's, as given (a trailing `/` included).
    let raw = path.as_os_str().as_bytes();
    let below = raw.strip_prefix(root.as_os_str().as_bytes()).unwrap_or(raw);
    let dotted = below
        .split(|b| *b == b'/')
        .enumerate()
        .any(|(i, part)| (part.is_empty() && i > 0) || part == b"." || part == b"..");
    dotted
        || path
            .strip_prefix(root)
            .map(|rel| {
                rel.components()
                    .any(|c| c.as_os_str().as_bytes().first() == Some(&b'.'))
            })
            .unwrap_or(true)
}

/// Creates the root directory (and parents) with mode 0755 if it is missing.
pub fn ensure_root(root: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(root)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_names_below_root_are_ignored_anywhere_in_the_path() {
        let root = Path::new("/r");
        assert!(ignored_name(Path::new("/r/.tmp.sock"), root));
        assert!(ignored_name(Path::new("/r/.hidden/a.sock"), root));
        assert!(!ignored_name(Path::new("/r/a.sock"), root));
        assert!(!ignored_name(Path::new("/r/sub/a.b.sock"), root));
        assert!(!ignored_name(Path::new("/r"), root));
        assert!(ignored_name(Path::new("/elsewhere/a.sock"), root));
        for odd in ["/r/link/.", "/r/link/", "/r//a.sock", "/r/sub/../a.sock"] {
            assert!(ignored_name(Path::new(odd), root), "{odd}");
        }
        // A root given with a trailing slash is the operator's, not a hint's oddity.
        let slashed = Path::new("/r/");
        assert!(!ignored_name(Path::new("/r/"), slashed));
        assert!(!ignored_name(&slashed.join("a.sock"), slashed));
    }

    proptest::proptest! {
        /// Where a path is, read from its bytes, is what its components say, whatever the
        /// root's and the path's spelling.
        #[test]
        fn a_place_read_from_bytes_is_the_place_by_components(
            root in "/?[/.ab]{0,6}",
            below in "[/.ab]{0,10}",
        ) {
            let root = Path::new(&root);
            for path in [format!("{}{below}", root.display()), below.clone()] {
                let path = Path::new(&path);
                proptest::prop_assert_eq!(
                    place(path, root),
                    place_by_components(path, root),
                    "{:?} under {:?}", path, root
                );
            }
        }
    }

    #[test]
    fn a_place_is_read_from_the_bytes_of_a_hint() {
        for root in ["/r", "/r/"] {
            let root = Path::new(root);
            assert_eq!(place(Path::new("/r/a.sock"), root), Place::Below);
            assert_eq!(place(Path::new("/r/sub/a.sock"), root), Place::Below);
            assert_eq!(place(Path::new("/r/.a.sock"), root), Place::NotFollowed);
            assert_eq!(place(Path::new("/rx/a.sock"), root), Place::NotFollowed);
            assert_eq!(place(Path::new("/elsewhere"), root), Place::NotFollowed);
        }
        assert_eq!(place(Path::new("/r"), Path::new("/r")), Place::Root);
        assert_eq!(place(Path::new("/r/"), Path::new("/r")), Place::NotFollowed);
        assert_eq!(place(Path::new("/r/"), Path::new("/r/")), Place::Root);
    }
}
