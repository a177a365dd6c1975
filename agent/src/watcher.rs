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
    EventSource, FsEvent, Observed, RescanReason, WatchedDir, monotonic_now_ns,
};
use crate::notifications::{AgentEvent, EventKind, NotificationBus};
use crate::state::EntryKind;
use crate::state::desired::{Change, DesiredState};
use crate::state::queue::ReconcileQueue;
use crate::telemetry::Telemetry;
use crate::telemetry::discovery::{Found, Via};
use crate::watch_health::WalkReport;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsStr;
use std::ffi::OsString;
use std::ops::Bound;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Most events handled per wake-up before desired-state changes are published to the reconciler
/// (bounds latency under a storm while still batching).
const BATCH: usize = 1024;

/// Up to this many distinct name hints in a batch are checked by `stat` in every watched
/// directory; more, by one read of each directory (see `Watcher::check_names`).
const FEW_NAMES: usize = 4;

/// The name hints of one batch: names the source placed in a directory of a known name, by that
/// name, and names that may be in any watched directory.
#[derive(Default)]
struct NameHints {
    in_dirs_named: HashMap<OsString, HashSet<OsString>>,
    anywhere: HashSet<OsString>,
}

impl NameHints {
    fn add(&mut self, name: OsString, parent: Option<OsString>) {
        match parent {
            Some(parent) => {
                self.in_dirs_named.entry(parent).or_default().insert(name);
            }
            None => {
                self.anywhere.insert(name);
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.in_dirs_named.is_empty() && self.anywhere.is_empty()
    }
}

/// See the module docs.
pub struct Watcher {
    root: PathBuf,
    source: Arc<dyn EventSource>,
    desired: Arc<DesiredState>,
    queue: Arc<ReconcileQueue>,
    /// Ordered by path, so a directory's subtree is one contiguous range (path order compares
    /// component by component): removing a directory costs its subtree, not the whole tree.
    dirs: BTreeMap<PathBuf, WatchedDir>,
    /// The root's parent, watched only so that the root's own removal and re-creation are seen
    /// by every source (a source reports changes *inside* the directories it watches); events for
    /// the root's siblings are ignored.
    anchor: Option<WatchedDir>,
    /// Full re-walks asked for by the reconciler's safety pass (a stored permit: never lost,
    /// even while the event channel is full).
    rescan_requests: Arc<tokio::sync::Notify>,
    notifications: NotificationBus,
    telemetry: Arc<Telemetry>,
    /// When the first name hint of the batch being handled was observed.
    names_observed: Observed,
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
            dirs: BTreeMap::new(),
            anchor: None,
            rescan_requests: Arc::default(),
            notifications,
            telemetry,
            names_observed: Observed::default(),
        }
    }

    /// Where the reconciler's safety pass asks for a full re-walk.
    pub fn rescan_requests(&self) -> Arc<tokio::sync::Notify> {
        self.rescan_requests.clone()
    }

    /// Creates the root if missing, watches and walks it, then follows the source's `hints` until `cancel`.
    /// `on_ready` is called after the first full scan.
    pub async fn run(
        mut self,
        mut hints: mpsc::Receiver<FsEvent>,
        cancel: CancellationToken,
        on_ready: impl FnOnce(),
    ) -> anyhow::Result<()> {
        self.rescan(RescanReason::Start);
        on_ready();
        let mut batch = Vec::with_capacity(BATCH);
        let rescan_requests = self.rescan_requests.clone();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                _ = rescan_requests.notified() => {
                    self.rescan(RescanReason::Periodic);
                    continue;
                }
                received = hints.recv_many(&mut batch, BATCH) => {
                    if received == 0 {
                        anyhow::bail!("event source {} stopped", self.source.kind());
                    }
                }
            }
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
                batch.clear();
            }
            let mut names = NameHints::default();
            for event in batch.drain(..) {
                match event {
                    FsEvent::Created { path, observed } | FsEvent::Removed { path, observed } => {
                        self.check(&path, observed)
                    }
                    FsEvent::NameChanged {
                        name,
                        parent,
                        observed,
                    } => {
                        // Name hints are checked once per batch, together: a burst of them (a
                        // `mkdir -p` of thousands by absolute path) costs one pass over the
                        // tree, not one per name. Their timestamps only time discovery, which
                        // the first hint of the batch does well enough.
                        if names.is_empty() {
                            self.names_observed = observed;
                        }
                        names.add(name, parent);
                    }
                    FsEvent::Rescan { .. } => {}
                }
            }
            if !names.is_empty() {
                self.check_names(&names);
            }
            if let Some(reason) = rescan {
                self.rescan(reason);
            }
        }
    }

    /// Looks at one path the source mentioned and updates state to match what is there.
    fn check(&mut self, path: &Path, observed: Observed) {
        if !path.starts_with(&self.root) || ignored_name(path, &self.root) {
            return;
        }
        if path == self.root && !self.root_unchanged() {
            // The root was removed, or replaced (by a symlink, or by another directory): what was
            // watched under it is gone, and only a full walk says what is watched now (`status`
            // and `/readyz` learn of it there).
            self.forget_dir(path);
            self.rescan(RescanReason::RootRemoved);
            return;
        }
        match EntryKind::of(path) {
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

    /// Each of `names` changed in some watched directory, which the source could not name.
    ///
    /// A name whose parent directory's name the source knows is checked only in the watched
    /// directories so named: one `stat` each, usually one in all. The others may be anywhere. A
    /// few of those are checked by one `stat` per watched directory each; many, by reading every
    /// watched directory once and looking at the entries with those names, plus every known socket
    /// or directory with those names (which may be gone). Either way the cost is linear in the
    /// tree, where a `stat` per name and directory would be quadratic (a thousand new directories
    /// by absolute path: a million `stat` calls).
    fn check_names(&mut self, names: &NameHints) {
        let observed = self.names_observed;
        // The anchor too: the name may be the root's own.
        let dirs: Vec<PathBuf> = self
            .dirs
            .keys()
            .chain(self.anchor.iter().map(|a| &a.path))
            .cloned()
            .collect();
        let mut candidates: Vec<PathBuf> = Vec::new();
        for dir in &dirs {
            if let Some(parents) = dir.file_name().and_then(|n| names.in_dirs_named.get(n)) {
                candidates.extend(parents.iter().map(|name| dir.join(name)));
            }
        }
        let anywhere: Vec<&OsString> = names
            .anywhere
            .iter()
            .filter(|name| !name.as_bytes().contains(&b'/'))
            .collect();
        if anywhere.len() <= FEW_NAMES {
            for name in anywhere {
                candidates.extend(dirs.iter().map(|dir| dir.join(name)));
            }
        } else {
            candidates.extend(self.entries_named(&anywhere, &dirs));
        }
        candidates.sort();
        candidates.dedup();
        for path in candidates {
            self.check(&path, observed);
        }
    }

    /// Every path in `dirs` with one of `names`, and every known one (which may be gone).
    fn entries_named(&self, names: &[&OsString], dirs: &[PathBuf]) -> Vec<PathBuf> {
        let wanted: HashSet<&OsStr> = names.iter().map(|name| name.as_os_str()).collect();
        let has_wanted_name =
            |path: &Path| path.file_name().is_some_and(|name| wanted.contains(name));
        let mut found: Vec<PathBuf> = self.desired.paths_where(has_wanted_name);
        found.extend(
            self.dirs
                .keys()
                .filter(|path| has_wanted_name(path))
                .cloned(),
        );
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(dir) else {
                // Gone or unreadable: its own event or the next rescan settles it.
                continue;
            };
            found.extend(
                entries
                    .flatten()
                    .filter(|entry| wanted.contains(entry.file_name().as_os_str()))
                    .map(|entry| entry.path()),
            );
        }
        found
    }

    fn socket_present(
        &mut self,
        path: &Path,
        socket: crate::state::SocketId,
        observed: Observed,
        via: Via,
    ) {
        match self
            .desired
            .add_observed(path, socket, observed.kernel_ns, via == Via::Event)
        {
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
                self.announce(path);
                self.queue.mark(path.to_path_buf());
            }
            Err(e) => warn!(socket_path = %path.display(), error = %e, "cannot record socket"),
        }
    }

    fn forget_socket(&mut self, path: &Path, observed: Observed, via: Via) {
        if self.desired.remove(path) {
            self.telemetry
                .discovery
                .record(path, Found::Removed, via, observed.kernel_ns);
            let since_event = observed
                .kernel_ns
                .map(|ns| Duration::from_nanos(monotonic_now_ns().saturating_sub(ns)));
            debug!(socket_path = %path.display(), ?since_event, "socket removed");
            self.notifications
                .publish(AgentEvent::new(EventKind::SocketRemoved, path));
            self.queue.mark(path.to_path_buf());
        }
    }

    /// Watches `dir` and everything below it, then records the sockets found.
    fn add_tree(&mut self, dir: &Path) {
        let mut found = Vec::new();
        let mut seen_dirs = HashSet::new();
        let mut report = WalkReport::default();
        self.walk(dir, &mut found, &mut seen_dirs, &mut report);
        for (path, socket) in found {
            self.socket_present(&path, socket, Observed::default(), Via::Event);
        }
    }

    /// Watch-then-walk of one directory, recursively. Collects sockets into `found`, the
    /// directories visited into `seen_dirs`, and what could not be read into `report` (each
    /// logged and counted here).
    fn walk(
        &mut self,
        dir: &Path,
        found: &mut Vec<(PathBuf, crate::state::SocketId)>,
        seen_dirs: &mut HashSet<PathBuf>,
        report: &mut WalkReport,
    ) {
        let watched = match WatchedDir::stat(dir) {
            Ok(watched) => watched,
            Err(e) if gone(&e) => {
                debug!(dir = %dir.display(), error = %e, "directory vanished before it could be watched");
                return;
            }
            Err(e) => {
                self.unreadable(dir, &e, report);
                return;
            }
        };
        // A directory replaced by another at the same path (re-created, mounted over) is watched
        // by its new identity.
        if self.dirs.get(dir) != Some(&watched) {
            if let Some(old) = self.dirs.remove(dir) {
                self.source.unwatch(&old);
            }
            if let Err(e) = self.source.watch(&watched) {
                warn!(dir = %dir.display(), error = %e, "cannot watch directory; relying on rescans for it");
            }
            self.dirs.insert(dir.to_path_buf(), watched);
            self.telemetry
                .watcher
                .watched_dirs
                .store(self.dirs.len() as u64, Ordering::Relaxed);
        }
        // Every walk re-announces the directory, like every rescan re-announces every socket.
        self.announce(dir);
        seen_dirs.insert(dir.to_path_buf());
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                self.unreadable(dir, &e, report);
                return;
            }
        };
        for entry in entries {
            let path = match entry {
                Ok(entry) => entry.path(),
                Err(e) => {
                    // Part of the directory was read: the rest is unknown, so all of it is kept.
                    self.unreadable(dir, &e, report);
                    return;
                }
            };
            if ignored_name(&path, &self.root) {
                continue;
            }
            match EntryKind::of(&path) {
                Ok(EntryKind::Socket(socket)) => found.push((path, socket)),
                Ok(EntryKind::Directory { .. }) => self.walk(&path, found, seen_dirs, report),
                Ok(EntryKind::Other) => {}
                Err(e) if gone(&e) => {}
                Err(e) => self.unreadable(&path, &e, report),
            }
        }
    }

    /// `path` could not be read: logged, counted, and its previous state kept (see the module
    /// docs).
    fn unreadable(&self, path: &Path, error: &std::io::Error, report: &mut WalkReport) {
        report.failed(path, error);
        if crate::watch_health::is_too_long(path, error) {
            self.telemetry.metrics.walk_error("too_long");
            warn!(
                path_bytes = path.as_os_str().len(),
                path_start = %crate::text::escape(&path.to_string_lossy().chars().take(200).collect::<String>()),
                "path longer than PATH_MAX: neither watched nor walked; sockets below it are not discovered"
            );
        } else {
            self.telemetry.metrics.walk_error("unreadable");
            warn!(dir = %path.display(), error = %error, known_kept = true, "cannot read directory; its plugins are not discovered");
        }
    }

    fn forget_dir(&mut self, dir: &Path) {
        let gone: Vec<PathBuf> = self
            .dirs
            .range::<Path, _>((Bound::Included(dir), Bound::Unbounded))
            .map(|(path, _)| path)
            .take_while(|path| path.starts_with(dir))
            .cloned()
            .collect();
        for path in &gone {
            if let Some(watched) = self.dirs.remove(path) {
                self.source.unwatch(&watched);
            }
            self.telemetry
                .watcher
                .watched_dirs
                .store(self.dirs.len() as u64, Ordering::Relaxed);
        }
        // Sockets are only ever recorded from directories in `dirs` (a walk watches a directory
        // before it reads it; events come from watched directories; a rescan prunes both
        // together), so a path that was not a watched directory has no sockets below it. Every
        // removed socket comes through here: without this, each removal would scan the whole
        // desired state (deregistering 10,000 plugins: 50 million path comparisons).
        if gone.is_empty() {
            return;
        }
        for path in self.desired.remove_under(dir) {
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
    fn announce(&self, path: &Path) {
        if let (Some(dir), Some(name)) = (
            path.parent().and_then(|p| self.dirs.get(p)),
            path.file_name(),
        ) {
            self.source.entry_present(dir, name);
        }
    }

    /// Watches the root's parent (once) and tells the source the root's name is present there.
    fn watch_anchor(&mut self) {
        if self.anchor.is_none()
            && let Some(parent) = self.root.parent().filter(|p| !p.as_os_str().is_empty())
        {
            match WatchedDir::stat(parent) {
                Ok(anchor) => match self.source.watch(&anchor) {
                    Ok(()) => self.anchor = Some(anchor),
                    Err(e) => {
                        debug!(dir = %parent.display(), error = %e, "cannot watch the root's parent; root removal is found by rescans")
                    }
                },
                Err(e) => {
                    debug!(dir = %parent.display(), error = %e, "cannot stat the root's parent")
                }
            }
        }
        if let (Some(anchor), Some(name)) = (&self.anchor, self.root.file_name()) {
            self.source.entry_present(anchor, name);
        }
    }

    /// Walks the whole tree and makes desired state and the watched set equal to it.
    fn rescan(&mut self, reason: RescanReason) {
        self.telemetry.rescan(&reason);
        let mut event = AgentEvent::new(EventKind::Rescan, &self.root);
        event.detail = Some(reason.to_string());
        self.notifications.publish(event);
        if let Err(e) = ensure_root(&self.root) {
            warn!(root = %self.root.display(), error = %e, "cannot create the plugin directory");
        }
        self.watch_anchor();
        let root_problem = self.root_problem();
        let mut found = Vec::new();
        let mut seen_dirs = HashSet::new();
        let mut report = WalkReport::default();
        self.walk(&self.root.clone(), &mut found, &mut seen_dirs, &mut report);
        self.telemetry.watcher.health.set(root_problem, &report);
        // What could not be read keeps its watches and sockets: a failed read is no empty
        // directory (see the module docs).
        let stale_dirs: Vec<PathBuf> = self
            .dirs
            .keys()
            .filter(|d| !seen_dirs.contains(*d) && !report.keeps(d))
            .cloned()
            .collect();
        for dir in stale_dirs {
            if let Some(watched) = self.dirs.remove(&dir) {
                self.source.unwatch(&watched);
            }
            self.telemetry
                .watcher
                .watched_dirs
                .store(self.dirs.len() as u64, Ordering::Relaxed);
        }
        let present: HashSet<PathBuf> = found.iter().map(|(p, _)| p.clone()).collect();
        let mut removed = 0;
        for (path, _) in self.desired.snapshot() {
            if !present.contains(&path) && !report.keeps(&path) {
                self.forget_socket(&path, Observed::default(), Via::Scan);
                removed += 1;
            }
        }
        let before = self.desired.len();
        for (path, socket) in found {
            // Unchanged sockets too: a source that lost its name table asks for this rescan.
            self.announce(&path);
            self.socket_present(&path, socket, Observed::default(), Via::Scan);
        }
        let level_info =
            reason == RescanReason::Start || removed > 0 || self.desired.len() != before;
        if level_info {
            info!(
                reason = %reason,
                dirs = self.dirs.len(),
                sockets = self.desired.len(),
                removed,
                kept_unread = report.kept.len(),
                "scanned plugin directory"
            );
        } else {
            debug!(
                reason = %reason,
                dirs = self.dirs.len(),
                sockets = self.desired.len(),
                "scanned plugin directory"
            );
        }
    }
}

impl Watcher {
    /// True if the root is the directory being watched as the root (same identity).
    fn root_unchanged(&self) -> bool {
        match (WatchedDir::stat(&self.root), self.dirs.get(&self.root)) {
            (Ok(now), Some(watched)) => (now.dev, now.ino) == (watched.dev, watched.ino),
            _ => false,
        }
    }

    /// Why the plugin directory is not a directory the agent can watch, if it is not: logged at
    /// every full walk while it lasts (a symlink swapped in for the directory would otherwise
    /// leave nothing watched and nothing said).
    fn root_problem(&self) -> Option<String> {
        let problem = match std::fs::symlink_metadata(&self.root) {
            Ok(meta) if meta.is_dir() => return None,
            Ok(meta) if meta.file_type().is_symlink() => {
                "the plugin directory is a symlink (symlinks are never followed): nothing is watched".to_string()
            }
            Ok(_) => "the plugin directory is not a directory: nothing is watched".to_string(),
            Err(e) if gone(&e) => return None,
            Err(e) => format!("cannot stat the plugin directory: {e}"),
        };
        self.telemetry.metrics.walk_error("root_not_directory");
        warn!(root = %self.root.display(), problem = %problem, "plugin directory not watched");
        Some(problem)
    }
}

/// True if `error` means the entry is not there (any more): a walk then simply does not find it.
fn gone(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
    )
}

/// True for paths with a component below the root that starts with `.`.
fn ignored_name(path: &Path, root: &Path) -> bool {
    path.strip_prefix(root)
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
    }
}
