//! Desired state of the world: every socket the watcher found under the tree, keyed by path.
//!
//! Written by the watcher, read by the reconciler. Each add of a new socket instance gets a fresh
//! generation (kubelet's UUID), which is how the reconciler tells "the same registered plugin" from
//! "a socket re-created at the same path" that must be registered again.

use super::SocketId;
use crate::provenance::{Actor, Contact, Creator};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;
use uuid::Uuid;

/// A socket that should be registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredPlugin {
    /// The socket path: the same allocation as the state's key, shared with the actual state's
    /// entry once registered (one copy of each path per plugin, not one per table).
    pub path: Arc<Path>,
    /// New on every add of a new socket instance at this path.
    pub generation: Uuid,
    /// The socket's identity when it was seen.
    pub socket: SocketId,
    /// When the watcher saw it.
    pub seen_at: SystemTime,
    /// `CLOCK_MONOTONIC` ns of the kernel event that led to it, for latency accounting.
    pub kernel_ns: Option<u64>,
    /// Found through an event of the agent's source (else by a scan): the `event_source` label.
    pub by_event: bool,
    /// Who created it (see `provenance`).
    pub creator: Creator,
    /// The first process other than the agent to connect to it (eBPF only), once one has (boxed:
    /// most sockets never have one, and every entry would carry its 80 bytes).
    pub first_contact: Option<Box<Contact>>,
    /// When it was first seen listening, and how (one per socket instance, never replaced;
    /// boxed: a dead socket's entry keeps only the pointer).
    pub listening: Option<Box<Listening>>,
}

/// When a socket was first seen listening (`explain`'s timeline).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listening {
    pub at: SystemTime,
    pub seen_by: ListenSeen,
}

/// How a socket was seen listening: the kernel's report of its `listen()` (eBPF), else the
/// agent's first connect to it that succeeded (later than the `listen()` by up to a look's or a
/// registration's wait).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenSeen {
    /// The eBPF source's report of its `listen()`.
    KernelReport,
    /// The look at a socket waiting to listen (sources that do not report listens).
    Look,
    /// A registration's dial.
    Dial,
}

impl ListenSeen {
    /// How it was seen, as the timeline says it.
    pub fn describe(self) -> &'static str {
        match self {
            ListenSeen::KernelReport => "the kernel's report of its listen()",
            ListenSeen::Look => "the agent's first connect that succeeded: its look for a listen",
            ListenSeen::Dial => "the agent's first connect that succeeded: a registration's dial",
        }
    }
}

/// What [`DesiredState::add_or_update`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// A path not desired before.
    Added,
    /// A path already desired, now with a different socket instance: new generation.
    Replaced,
    /// The same socket instance seen again (a duplicate or merged event): nothing changed.
    Unchanged,
}

/// Errors from the desired state.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DesiredStateError {
    /// Kubelet's `socket path is empty`.
    #[error("socket path is empty")]
    EmptyPath,
}

/// The cache itself; cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct DesiredState {
    /// Entries boxed: a table keeps room for up to twice its entries, and while it grows, its
    /// old table too; at 10,000 sockets unboxed entries made that 3.1 MB held and 1.6 MB more at
    /// the last growth, with a burst's registrations in flight (0.4 and 0.2 MB, plus 1.9 MB of
    /// entries, boxed).
    plugins: Mutex<super::PathMap<Arc<Path>, Box<DesiredPlugin>>>,
}

impl DesiredState {
    /// Records the socket at `path`, found by a scan; a different instance than the one
    /// recorded gets a new generation, the same instance changes nothing.
    pub fn add_or_update(
        &self,
        path: &Path,
        socket: SocketId,
        kernel_ns: Option<u64>,
    ) -> Result<Change, DesiredStateError> {
        self.add_observed(path, socket, kernel_ns, false, None)
    }

    /// [`Self::add_or_update`], saying whether an event of the source (`by_event`) or a scan
    /// found the socket, and who the event says made it. An event naming the creator of a
    /// socket a walk found first adds the creator without changing anything else.
    pub fn add_observed(
        &self,
        path: &Path,
        socket: SocketId,
        kernel_ns: Option<u64>,
        by_event: bool,
        creator: Option<Actor>,
    ) -> Result<Change, DesiredStateError> {
        if path.as_os_str().is_empty() {
            return Err(DesiredStateError::EmptyPath);
        }
        let mut plugins = self.lock();
        let (change, path) = match plugins.get_mut(path) {
            Some(existing) if existing.socket == socket => {
                if let (Some(creator), None) = (creator, existing.creator.pid()) {
                    existing.creator = Creator::Recorded(creator);
                }
                return Ok(Change::Unchanged);
            }
            Some(existing) => (Change::Replaced, existing.path.clone()),
            None => (Change::Added, Arc::from(path)),
        };
        let creator = match creator {
            Some(actor) => Creator::Recorded(actor),
            None if by_event => Creator::NotReported,
            None => Creator::FoundByWalk,
        };
        let plugin = DesiredPlugin {
            path: path.clone(),
            generation: Uuid::new_v4(),
            socket,
            seen_at: SystemTime::now(),
            kernel_ns,
            by_event,
            creator,
            first_contact: None,
            listening: None,
        };
        plugins.insert(path, Box::new(plugin));
        Ok(change)
    }

    /// Records the first contact of the socket desired at `path`; returns the entry as it is
    /// now, or `None` when no socket is desired there or its first contact is known already (the
    /// kernel reports each instance once; a second report would be of an older instance).
    pub fn record_contact(&self, path: &Path, contact: Contact) -> Option<DesiredPlugin> {
        let mut plugins = self.lock();
        let plugin = plugins.get_mut(path)?;
        if plugin.first_contact.is_some() {
            return None;
        }
        plugin.first_contact = Some(Box::new(contact));
        let now = DesiredPlugin::clone(plugin);
        drop(plugins);
        Some(now)
    }

    /// Records that the socket desired at `path` listens, unless a first listen is known: of the
    /// instance `socket` (a connect's), or (`listened_ns`, a kernel report's `CLOCK_MONOTONIC`
    /// time) of the instance desired then, not one created after the report. The kernel's report
    /// replaces a connect's (a registration's dial can reach the socket before the watcher reads
    /// the report of its `listen()`, which is the earlier and exact time). Returns whether it was
    /// recorded.
    pub fn record_listening(
        &self,
        path: &Path,
        socket: Option<SocketId>,
        listened_ns: Option<u64>,
        listening: Listening,
    ) -> bool {
        let mut plugins = self.lock();
        let Some(plugin) = plugins.get_mut(path) else {
            return false;
        };
        let other_socket = socket.is_some_and(|socket| socket != plugin.socket);
        let created_after = matches!((listened_ns, plugin.kernel_ns), (Some(l), Some(c)) if l < c);
        let known = plugin.listening.as_ref().is_some_and(|known| {
            known.seen_by == ListenSeen::KernelReport
                || listening.seen_by != ListenSeen::KernelReport
        });
        if known || other_socket || created_after {
            return false;
        }
        plugin.listening = Some(Box::new(listening));
        true
    }

    /// Whether the socket instance `generation` desired at `path` is known to listen (a look
    /// under the lock, no copy).
    pub fn listening_known(&self, path: &Path, generation: Uuid) -> bool {
        self.lock()
            .get(path)
            .is_some_and(|now| now.generation == generation && now.listening.is_some())
    }

    /// Whether the socket instance `generation` desired at `path` has had its first contact (a
    /// look under the lock, no copy).
    pub fn contacted_since(&self, path: &Path, generation: Uuid) -> bool {
        self.lock()
            .get(path)
            .is_some_and(|now| now.generation == generation && now.first_contact.is_some())
    }

    /// Records the socket a previous agent registered at `path`, with that agent's generation,
    /// before this agent's first walk (see `persist`): the walk finding the same socket instance
    /// then changes nothing, so the plugin is neither re-registered nor deregistered; a walk that
    /// does not find it removes it, and one that finds another instance replaces it.
    pub fn restore(&self, path: Arc<Path>, generation: Uuid, socket: SocketId, creator: Creator) {
        let plugin = DesiredPlugin {
            path: path.clone(),
            generation,
            socket,
            seen_at: SystemTime::now(),
            kernel_ns: None,
            by_event: false,
            creator,
            // Not carried across restarts: the programs report each instance's first contact
            // once, to whichever agent reads the ring then.
            first_contact: None,
            listening: None,
        };
        self.lock().insert(path, Box::new(plugin));
    }

    /// Forgets `path`; returns whether it was desired.
    pub fn remove(&self, path: &Path) -> bool {
        let mut plugins = self.lock();
        let removed = plugins.remove(path).is_some();
        plugins.shrink_if_sparse();
        removed
    }

    /// Forgets every path at or below `dir`; returns the paths removed.
    pub fn remove_under(&self, dir: &Path) -> Vec<PathBuf> {
        let mut plugins = self.lock();
        let gone: Vec<PathBuf> = plugins
            .keys()
            .filter(|p| p.starts_with(dir))
            .map(|p| p.to_path_buf())
            .collect();
        for path in &gone {
            plugins.remove(path.as_path());
        }
        plugins.shrink_if_sparse();
        gone
    }

    /// The entry for `path`, if desired.
    pub fn get(&self, path: &Path) -> Option<DesiredPlugin> {
        self.lock().get(path).map(|d| DesiredPlugin::clone(d))
    }

    /// The socket instance desired at `path`, without copying its entry.
    pub fn socket_of(&self, path: &Path) -> Option<SocketId> {
        self.lock().get(path).map(|d| d.socket)
    }

    /// The generation and socket instance desired at `path`, without copying its entry.
    pub fn instance_of(&self, path: &Path) -> Option<(Uuid, SocketId)> {
        self.lock().get(path).map(|d| (d.generation, d.socket))
    }

    /// Every desired path (the table's own allocations, shared) with when it was seen: what a
    /// full reconciliation orders by, without copying 100,000 entries to sort them.
    pub fn paths_seen(&self) -> Vec<(Arc<Path>, SystemTime)> {
        self.lock()
            .iter()
            .map(|(path, d)| (path.clone(), d.seen_at))
            .collect()
    }

    /// Whether `path` is desired.
    pub fn contains(&self, path: &Path) -> bool {
        self.lock().contains_key(path)
    }

    /// Every desired path and its entry, in no particular order.
    pub fn snapshot(&self) -> Vec<(PathBuf, DesiredPlugin)> {
        self.lock()
            .iter()
            .map(|(p, d)| (p.to_path_buf(), DesiredPlugin::clone(d)))
            .collect()
    }

    /// The desired paths for which `keep` holds (without cloning the rest).
    pub fn paths_where(&self, keep: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
        self.lock()
            .keys()
            .filter(|p| keep(p))
            .map(|p| p.to_path_buf())
            .collect()
    }

    /// Number of desired sockets.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when nothing is desired.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, super::PathMap<Arc<Path>, Box<DesiredPlugin>>> {
        // A panic while holding the lock cannot leave the map half-updated (single inserts/removes),
        // so a poisoned lock is still consistent.
        self.plugins
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

    /// The first listen of a socket instance is kept (the kernel's report over a connect's); a
    /// connect of another instance and a kernel report older than the socket's creation are not.
    #[test]
    fn the_first_listen_of_the_desired_socket_is_recorded_once() {
        let state = DesiredState::default();
        let path = Path::new("/r/a.sock");
        state
            .add_observed(path, id(1), Some(1_000), true, None)
            .expect("desired");
        let at = |secs: u64, seen_by| Listening {
            at: std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs),
            seen_by,
        };
        assert!(!state.record_listening(path, Some(id(2)), None, at(1, ListenSeen::Dial)));
        let before = at(2, ListenSeen::KernelReport);
        assert!(!state.record_listening(path, None, Some(999), before));
        assert!(state.record_listening(path, Some(id(1)), None, at(3, ListenSeen::Dial)));
        assert!(!state.record_listening(path, Some(id(1)), None, at(4, ListenSeen::Look)));
        // The kernel's report replaces a connect's, and is never replaced.
        assert!(state.record_listening(path, None, Some(1_001), at(3, ListenSeen::KernelReport)));
        assert!(!state.record_listening(path, None, Some(1_002), at(5, ListenSeen::KernelReport)));
        assert!(!state.record_listening(path, Some(id(1)), None, at(4, ListenSeen::Dial)));
        let kept = state.get(path).and_then(|d| d.listening);
        assert_eq!(kept.as_deref(), Some(&at(3, ListenSeen::KernelReport)));
        // A new instance at the path starts without one.
        state.add_or_update(path, id(3), None).expect("desired");
        assert_eq!(state.get(path).and_then(|d| d.listening), None);
    }

    #[test]
    fn add_new_plugin_is_desired_with_a_generation() {
        let state = DesiredState::default();
        assert_eq!(
            state.add_or_update(Path::new("/r/a.sock"), id(1), None),
            Ok(Change::Added)
        );
        let entry = state.get(Path::new("/r/a.sock")).expect("desired");
        assert_eq!(entry.socket, id(1));
        assert!(!entry.generation.is_nil());
        assert_eq!(state.len(), 1);
    }

    #[test]
    fn add_existing_path_with_new_socket_changes_generation() {
        let state = DesiredState::default();
        state
            .add_or_update(Path::new("/r/a.sock"), id(1), None)
            .expect("add");
        let first = state
            .get(Path::new("/r/a.sock"))
            .expect("desired")
            .generation;
        assert_eq!(
            state.add_or_update(Path::new("/r/a.sock"), id(2), None),
            Ok(Change::Replaced)
        );
        let second = state
            .get(Path::new("/r/a.sock"))
            .expect("desired")
            .generation;
        assert_ne!(first, second);
        assert_eq!(state.len(), 1);
    }

    #[test]
    fn add_same_socket_again_keeps_generation() {
        let state = DesiredState::default();
        state
            .add_or_update(Path::new("/r/a.sock"), id(1), None)
            .expect("add");
        let first = state
            .get(Path::new("/r/a.sock"))
            .expect("desired")
            .generation;
        assert_eq!(
            state.add_or_update(Path::new("/r/a.sock"), id(1), None),
            Ok(Change::Unchanged)
        );
        assert_eq!(
            state
                .get(Path::new("/r/a.sock"))
                .expect("desired")
                .generation,
            first
        );
    }

    #[test]
    fn add_empty_path_is_rejected() {
        let state = DesiredState::default();
        assert_eq!(
            state.add_or_update(Path::new(""), id(1), None),
            Err(DesiredStateError::EmptyPath)
        );
        assert!(state.is_empty());
    }

    #[test]
    fn remove_plugin_forgets_it() {
        let state = DesiredState::default();
        state
            .add_or_update(Path::new("/r/a.sock"), id(1), None)
            .expect("add");
        assert!(state.remove(Path::new("/r/a.sock")));
        assert!(!state.remove(Path::new("/r/a.sock")));
        assert!(state.is_empty());
    }

    #[test]
    fn remove_under_directory_forgets_only_that_subtree() {
        let state = DesiredState::default();
        for (i, p) in ["/r/a/x.sock", "/r/a/b/y.sock", "/r/ab.sock", "/r/z.sock"]
            .iter()
            .enumerate()
        {
            state
                .add_or_update(Path::new(p), id(i as u64), None)
                .expect("add");
        }
        let mut gone = state.remove_under(Path::new("/r/a"));
        gone.sort();
        assert_eq!(
            gone,
            vec![PathBuf::from("/r/a/b/y.sock"), PathBuf::from("/r/a/x.sock")]
        );
        assert!(state.contains(Path::new("/r/ab.sock")));
        assert_eq!(state.len(), 2);
    }

    #[test]
    fn entry_shares_its_key_and_remembers_how_it_was_found() {
        let state = DesiredState::default();
        state
            .add_observed(Path::new("/r/a.sock"), id(1), None, true, None)
            .expect("add");
        let first = state.get(Path::new("/r/a.sock")).expect("desired");
        assert_eq!(&*first.path, Path::new("/r/a.sock"));
        assert!(first.by_event);
        // A replacement keeps the key's allocation (one copy of the path per socket).
        state
            .add_or_update(Path::new("/r/a.sock"), id(2), None)
            .expect("replace");
        let second = state.get(Path::new("/r/a.sock")).expect("desired");
        assert!(Arc::ptr_eq(&first.path, &second.path));
        assert!(!second.by_event, "found by a scan this time");
        let lock = state.lock();
        let (key, _) = lock.get_key_value(Path::new("/r/a.sock")).expect("key");
        assert!(Arc::ptr_eq(key, &second.path));
    }

    #[test]
    fn table_shrinks_after_a_burst_of_removals() {
        let state = DesiredState::default();
        let paths: Vec<PathBuf> = (0..1000)
            .map(|i| PathBuf::from(format!("/r/{i}.sock")))
            .collect();
        for (i, p) in paths.iter().enumerate() {
            state.add_or_update(p, id(i as u64), None).expect("add");
        }
        let full = state.lock().capacity();
        for p in &paths[..990] {
            assert!(state.remove(p));
        }
        assert_eq!(state.len(), 10);
        assert!(state.lock().capacity() < full / 4);
    }
}
