//! Walks: watch-then-walk of a directory and its subtree, and the full rescan that makes desired
//! state and the watched set equal to the tree.

use super::{Watcher, ensure_root};
use crate::event_source::{Entry, Observed, RescanReason, WatchedDir};
use crate::notifications::{AgentEvent, EventKind, Walk};
use crate::state::EntryKind;
use crate::telemetry::discovery::Via;
use crate::watch_health::WalkReport;
use nix::dir::Type;
use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, OFlag, openat};
use nix::sys::stat::{Mode, fstat};
use std::collections::HashSet;
use std::ffi::OsString;
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tracing::{debug, info, warn};

impl Watcher {
    /// Watches `dir` and everything below it, then records the sockets found.
    pub(super) fn add_tree(&mut self, dir: &Path) {
        let mut found = Vec::new();
        let mut seen_dirs = HashSet::new();
        let mut report = WalkReport::default();
        self.walk(dir, &mut found, &mut seen_dirs, &mut report);
        self.sockets_found(found, Via::Event);
    }

    /// Records the sockets a walk found. Those it announced to the source before looking at them
    /// need no second look; the others (a file system that does not say an entry's type in the
    /// directory) are announced now, a directory's at once, and the new ones looked at again.
    fn sockets_found(&mut self, found: Vec<FoundSocket>, via: Via) {
        let mut rest = found.as_slice();
        while let Some(first) = rest.first() {
            if first.announced {
                self.socket_announced(&first.path, first.socket, Observed::default(), via, false);
                rest = &rest[1..];
                continue;
            }
            let parent = first.path.parent();
            let together = rest
                .iter()
                .take_while(|found| !found.announced && found.path.parent() == parent)
                .count();
            let (group, after) = rest.split_at(together);
            let new_to_source = match parent.and_then(|parent| self.dirs.get(parent)) {
                Some(dir) => {
                    let names: Vec<&std::ffi::OsStr> = group
                        .iter()
                        .map(|found| found.path.file_name().unwrap_or_default())
                        .collect();
                    self.source.sockets_present(dir, &names)
                }
                None => vec![false; group.len()],
            };
            for (found, new) in group.iter().zip(new_to_source) {
                self.socket_announced(&found.path, found.socket, Observed::default(), via, new);
            }
            rest = after;
        }
    }

    /// Watch-then-walk of `dir` and its subtree. Collects sockets into `found`, the directories
    /// visited into `seen_dirs` (as bytes: hashing a `Path` parses it into components, a cost
    /// per directory as deep as the directory is), and what could not be read into `report` (each logged and
    /// counted here).
    ///
    /// Iterative, and each directory is read to the end and closed before any directory below
    /// it is opened: a recursive walk holds one open directory stream (glibc gives each a
    /// 32 KiB buffer) and one stack frame per level, so a tree 2,000 levels deep cost 64 MiB and
    /// 2,000 descriptors per pass, and a deep enough one would overflow the thread's stack.
    ///
    /// Every lookup is relative to the directory it is in (an `O_PATH` descriptor, shared by the
    /// sub-directories still to visit): a lookup by path resolves every component again, so a
    /// safety pass over a tree 2,039 levels deep cost ~0.5 s of CPU, during which events waited.
    /// The descriptors held are those of directories with sub-directories still to visit: one
    /// or two for a chain, at most the tree's depth, which PATH_MAX bounds (2,048 levels: the
    /// walk does not go below it); the agent raises its descriptor limit to the hard one at
    /// start.
    pub(super) fn walk(
        &mut self,
        dir: &Path,
        found: &mut Vec<FoundSocket>,
        seen_dirs: &mut HashSet<OsString>,
        report: &mut WalkReport,
    ) {
        let mut pending = vec![Pending {
            path: dir.to_path_buf(),
            parent: None,
        }];
        while let Some(dir) = pending.pop() {
            let before = pending.len();
            if self.walk_one(&dir, found, &mut pending, report) {
                seen_dirs.insert(dir.path.into_os_string());
            }
            // Visit sub-directories in the order they were read.
            pending[before..].reverse();
        }
    }

    /// Watches and reads one directory: sockets go to `found`, sub-directories to `pending`.
    /// False if the directory was not there (or could not be stat'ed) to be watched.
    fn walk_one(
        &mut self,
        pending_dir: &Pending,
        found: &mut Vec<FoundSocket>,
        pending: &mut Vec<Pending>,
        report: &mut WalkReport,
    ) -> bool {
        let dir = pending_dir.path.as_path();
        let (watched, handle) = match open_dir(pending_dir) {
            Ok(opened) => opened,
            Err(e) if gone(&e) => {
                debug!(dir = %dir.display(), error = %e, "directory vanished before it could be watched");
                return false;
            }
            Err(e) => {
                self.unreadable(dir, &e, report);
                return false;
            }
        };
        self.watch_dir(dir, &watched);
        self.announce_dir(pending_dir);
        let opened = Arc::new(Opened {
            fd: handle,
            watched,
        });
        let mut entries = match nix::dir::Dir::openat(
            &opened.fd,
            c".",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(entries) => entries,
            Err(Errno::ENOENT) => {
                // Gone between the stat and the read (perhaps before the announcement, unseen).
                self.forget_dir(dir);
                return false;
            }
            Err(e) => {
                self.unreadable(dir, &std::io::Error::from(e), report);
                return true;
            }
        };
        // Read in chunks: each chunk's sockets are announced to the source together, then
        // looked at (announce, then look: the walk's own look is the one after the
        // announcement, so no second one is needed).
        let mut chunk = Vec::with_capacity(WALK_CHUNK);
        for entry in entries.iter() {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    // Part of the directory was read: the rest is unknown, so all of it is kept.
                    self.look_at(&opened, dir, &mut chunk, found, pending, report);
                    self.unreadable(dir, &std::io::Error::from(e), report);
                    return true;
                }
            };
            let name = entry.file_name();
            // Below a directory already walked, only the entry's own name can make it ignored.
            if name.to_bytes().first() == Some(&b'.') {
                continue;
            }
            let separator = usize::from(!dir.as_os_str().as_bytes().ends_with(b"/"));
            let joined = dir.as_os_str().len() + separator + name.to_bytes().len();
            if joined >= crate::watch_health::PATH_MAX {
                // Out of reach by path (dials, handlers, kubelet): reported as such.
                let path = dir.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
                let too_long = std::io::Error::from_raw_os_error(libc::ENAMETOOLONG);
                self.unreadable(&path, &too_long, report);
                continue;
            }
            // The directory entry's type saves a lookup for all but sockets (and file systems
            // that do not fill it in).
            let file_type = entry.file_type();
            if matches!(file_type, Some(t) if t != Type::Directory && t != Type::Socket) {
                continue;
            }
            chunk.push((name.to_owned(), file_type));
            if chunk.len() == WALK_CHUNK {
                self.look_at(&opened, dir, &mut chunk, found, pending, report);
            }
        }
        self.look_at(&opened, dir, &mut chunk, found, pending, report);
        true
    }

    /// Watches `dir` by its identity `watched`, unless it already is: a directory replaced by
    /// another at the same path (re-created, mounted over) is watched by its new identity.
    fn watch_dir(&mut self, dir: &Path, watched: &WatchedDir) {
        if self.dirs.get(dir) != Some(watched) {
            if let Some(old) = self.dirs.remove(dir) {
                self.source.unwatch(&old);
            }
            if let Err(e) = self.source.watch(watched) {
                warn!(dir = %dir.display(), error = %e, "cannot watch directory; relying on rescans for it");
            }
            self.dirs.insert(dir, watched.clone());
            self.telemetry
                .watcher
                .watched_dirs
                .store(self.dirs.len() as u64, Ordering::Relaxed);
        }
    }

    /// Announces the directory about to be read to the source.
    fn announce_dir(&mut self, pending_dir: &Pending) {
        let dir = pending_dir.path.as_path();
        // Every walk re-announces the directory, like every rescan re-announces every socket;
        // announced before it is read, so a removal after the read is matched by name.
        match (&pending_dir.parent, dir.file_name()) {
            (Some(parent), Some(name)) => {
                self.source
                    .entry_present(&parent.watched, name, Entry::Directory);
            }
            _ => {
                self.announce(dir, Entry::Directory);
            }
        }
    }

    /// Announces the sockets among `chunk` (entries of `dir`, read from it with their types) to
    /// the source at once, then looks at every entry: sockets go to `found`, sub-directories to
    /// `pending`. A name announced for an entry the look does not find a socket is withdrawn.
    fn look_at(
        &mut self,
        opened: &Arc<Opened>,
        dir: &Path,
        chunk: &mut Vec<(std::ffi::CString, Option<Type>)>,
        found: &mut Vec<FoundSocket>,
        pending: &mut Vec<Pending>,
        report: &mut WalkReport,
    ) {
        let sockets: Vec<&std::ffi::OsStr> = chunk
            .iter()
            .filter(|(_, file_type)| *file_type == Some(Type::Socket))
            .map(|(name, _)| std::ffi::OsStr::from_bytes(name.to_bytes()))
            .collect();
        if !sockets.is_empty() {
            self.source.sockets_present(&opened.watched, &sockets);
        }
        for (name, file_type) in chunk.drain(..) {
            let announced = file_type == Some(Type::Socket);
            let name_os = std::ffi::OsStr::from_bytes(name.to_bytes());
            let path = dir.join(name_os);
            let kind = match file_type {
                Some(Type::Directory) => None,
                _ => Some(EntryKind::at(opened.fd.as_fd(), &name)),
            };
            let not_a_socket = || {
                if announced {
                    self.source.entry_absent(&opened.watched, name_os);
                }
            };
            match kind {
                None | Some(Ok(EntryKind::Directory { .. })) => {
                    not_a_socket();
                    pending.push(Pending {
                        path,
                        parent: Some(opened.clone()),
                    });
                }
                Some(Ok(EntryKind::Socket(socket))) => found.push(FoundSocket {
                    path,
                    socket,
                    announced,
                }),
                Some(Ok(EntryKind::Other)) => not_a_socket(),
                Some(Err(e)) if gone(&e) => not_a_socket(),
                // Its previous state is kept, and so is its name.
                Some(Err(e)) => self.unreadable(&path, &e, report),
            }
        }
    }

    /// `path` could not be read: logged, counted, and its previous state kept (see the module
    /// docs).
    pub(super) fn unreadable(&self, path: &Path, error: &std::io::Error, report: &mut WalkReport) {
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

    /// Watches the root's parent (once) and tells the source the root's name is present there.
    pub(super) fn watch_anchor(&mut self) {
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
            self.source.entry_present(anchor, name, Entry::Directory);
        }
    }

    /// Walks the whole tree and makes desired state and the watched set equal to it.
    pub(super) fn rescan(&mut self, reason: RescanReason) {
        let walk = self.walk_tree(reason);
        self.walked(walk);
    }

    /// [`rescan`](Self::rescan) but for its report (`walked`): what the walk found.
    pub(super) fn walk_tree(&mut self, reason: RescanReason) -> Walk {
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
        // What could not be read keeps its watches and sockets: a failed read is no empty
        // directory (see the module docs).
        let stale_dirs: Vec<PathBuf> = self
            .dirs
            .keys()
            .filter(|d| !seen_dirs.contains(d.as_os_str()) && !report.keeps(d))
            .map(Path::to_path_buf)
            .collect();
        // The desired paths the walk did not find (copying no entry: a safety pass over 100,000
        // sockets copied every one, ~30 MB at a time, to compare paths).
        let gone = {
            let present: HashSet<&Path> = found.iter().map(|found| found.path.as_path()).collect();
            self.desired
                .paths_where(|path| !present.contains(path) && !report.keeps(path))
        };
        let removed = gone.len();
        for path in gone {
            self.forget_socket(&path, Observed::default(), Via::Scan);
        }
        for dir in &stale_dirs {
            self.unannounce(dir);
        }
        for dir in stale_dirs {
            if let Some(watched) = self.dirs.remove(&dir) {
                self.source.unwatch(&watched);
            }
            self.telemetry
                .watcher
                .watched_dirs
                .store(self.dirs.len() as u64, Ordering::Relaxed);
        }
        let before = self.desired.len();
        // Announces unchanged sockets too: a source that lost its name table asks for this rescan.
        self.sockets_found(found, Via::Scan);
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
        // Last: whoever sees the walk's problems (status, /readyz) then sees the watched set and
        // desired state it left, not the ones before it.
        self.telemetry.watcher.health.set(root_problem, &report);
        Walk {
            reason: reason.to_string(),
            directories: self.dirs.len() as u64,
            sockets: self.desired.len() as u64,
            removed: removed as u64,
            kept_unread: report.kept.len() as u64,
        }
    }

    /// Says a walk finished: counted for status before the event, so a client that subscribed
    /// and then read status sees it one way or the other.
    pub(super) fn walked(&self, walk: Walk) {
        let stats = &self.telemetry.watcher;
        stats.walks_completed.fetch_add(1, Ordering::Release);
        let mut event = AgentEvent::new(EventKind::Walked, &self.root);
        event.walk = Some(walk);
        self.notifications.publish(event);
    }

    /// True if the root is the directory being watched as the root (same identity).
    pub(super) fn root_unchanged(&self) -> bool {
        match (WatchedDir::stat(&self.root), self.dirs.get(&self.root)) {
            (Ok(now), Some(watched)) => (now.dev, now.ino) == (watched.dev, watched.ino),
            _ => false,
        }
    }

    /// Why the plugin directory is not a directory the agent can watch, if it is not: logged at
    /// every full walk while it lasts (a symlink swapped in for the directory would otherwise
    /// leave nothing watched and nothing said).
    pub(super) fn root_problem(&self) -> Option<String> {
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
pub(super) fn gone(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
    )
}

/// Entries of a directory read before they are looked at: their sockets are announced to the
/// source in one call (256 names: one `BPF_MAP_UPDATE_BATCH`).
const WALK_CHUNK: usize = 256;

/// A socket a walk found.
pub(super) struct FoundSocket {
    path: PathBuf,
    socket: crate::state::SocketId,
    /// Announced to the source before the walk looked at it: that look was the one after the
    /// announcement.
    announced: bool,
}

/// A directory still to walk, with its parent to look it up in (the walk's first directory has
/// none: it is looked up by its path).
struct Pending {
    path: PathBuf,
    parent: Option<Arc<Opened>>,
}

/// A directory being walked: its `O_PATH` descriptor, shared by its sub-directories still to
/// visit, and its identity, which they are announced in.
struct Opened {
    fd: OwnedFd,
    watched: WatchedDir,
}

/// Opens `dir` (`O_PATH`, following no symlink) and stats it: its identity, and the descriptor
/// its entries are looked up in. A symlink or a file is not a directory, as `lstat` says.
fn open_dir(dir: &Pending) -> std::io::Result<(WatchedDir, OwnedFd)> {
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let opened = match (&dir.parent, dir.path.file_name()) {
        (Some(parent), Some(name)) => openat(&parent.fd, name, flags, Mode::empty()),
        _ => openat(AT_FDCWD, dir.path.as_path(), flags, Mode::empty()),
    };
    let handle = match opened {
        Ok(handle) => handle,
        Err(Errno::ENOTDIR | Errno::ELOOP) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("{} is not a directory", dir.path.display()),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    let stat = fstat(&handle)?;
    let watched = WatchedDir {
        path: dir.path.clone(),
        dev: stat.st_dev,
        ino: stat.st_ino,
    };
    Ok((watched, handle))
}
