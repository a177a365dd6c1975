//! Actual state of the world: plugins registered with a handler, keyed by socket path.
//!
//! Written only by the operation executor: an entry is added *before* the handler's `Register` (so
//! a socket deleted during registration becomes a deregistration) and removed before the handler's
//! `DeRegister`. Read by the reconciler, and by operators through the admin API and metrics.

use super::SocketId;
use crate::handler::{Plugin, PluginHandler};
use crate::provenance::Provenance;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;
use uuid::Uuid;

/// A plugin the agent registered (or is registering) with a handler.
#[derive(Clone)]
pub struct RegisteredPlugin {
    /// The desired-state generation this registration is for.
    pub generation: Uuid,
    /// Identity of the socket it was registered from.
    pub socket: SocketId,
    /// What GetInfo said, with the endpoint defaulted and the socket path added.
    pub plugin: Plugin,
    /// The handler it was registered with; deregistration goes to the same one even if the
    /// handler for its type changed since. `None`: observed only (observe mode), no handler knows
    /// it and none is told when it goes.
    pub handler: Option<Arc<dyn PluginHandler>>,
    /// When the entry was added.
    pub registered_at: SystemTime,
    /// Who created the socket and who served the registration.
    pub provenance: Provenance,
    /// Restored from a registration the previous agent began and did not finish (it stopped
    /// between the handler's `Register` and the plugin's Notify): the handler may hold it, the
    /// plugin may not know. The reconciler registers it again while its socket is the one
    /// desired, and deregisters it once it is not.
    pub interrupted: bool,
}

/// What the reconciler reads of a registration (see `view::next`): which socket instance it is
/// of, and whether a kill interrupted it. Read in place: a registration's entry is not copied
/// to decide that it needs nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    pub generation: Uuid,
    pub socket: SocketId,
    pub interrupted: bool,
}

impl RegisteredPlugin {
    /// See [`Registered`].
    pub fn summary(&self) -> Registered {
        Registered {
            generation: self.generation,
            socket: self.socket,
            interrupted: self.interrupted,
        }
    }
}

impl std::fmt::Debug for RegisteredPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredPlugin")
            .field("generation", &self.generation)
            .field("socket", &self.socket)
            .field("plugin", &self.plugin)
            .field("interrupted", &self.interrupted)
            .finish_non_exhaustive()
    }
}

/// The cache itself; cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct ActualState {
    plugins: Mutex<Plugins>,
}

/// Entries by path. Several sockets may carry one plugin name at once (a DRA driver's rolling
/// update, kubelet 1.33+): each is its own entry, registered and deregistered with its own
/// endpoint; the index by name only finds them (`explain` by driver name, and a duplicate
/// driver's verdict), so neither costs a pass over every plugin.
///
/// Memory per registered plugin is what the entry holds plus a table slot: entries are boxed (a
/// table grows to a power of two, so inline ~300-byte entries cost up to twice that each); the
/// path is one allocation shared by the key and the desired state's entry.
#[derive(Debug, Default)]
struct Plugins {
    by_path: super::PathMap<Arc<Path>, Box<RegisteredPlugin>>,
    /// The paths registered under each plugin name (`PluginInfo.name`), usually one.
    by_name: HashMap<Box<str>, smallvec::SmallVec<[Arc<Path>; 1]>, super::PathHasher>,
}

impl Plugins {
    fn insert(&mut self, path: Arc<Path>, entry: RegisteredPlugin) {
        // An entry already there keeps its key (and its allocation).
        let path = match self.by_path.remove_entry(&path) {
            Some((old_path, old)) => {
                self.unindex(&old_path, &old.plugin.name);
                old_path
            }
            None => path,
        };
        self.by_name
            .entry(entry.plugin.name.as_str().into())
            .or_default()
            .push(path.clone());
        self.by_path.insert(path, Box::new(entry));
    }

    fn remove(&mut self, path: &Path) -> Option<RegisteredPlugin> {
        let (key, entry) = self.by_path.remove_entry(path)?;
        self.unindex(&key, &entry.plugin.name);
        self.by_path.shrink_if_sparse();
        Some(*entry)
    }

    fn unindex(&mut self, path: &Path, name: &str) {
        if let Some(paths) = self.by_name.get_mut(name) {
            paths.retain(|p| &**p != path);
            if paths.is_empty() {
                self.by_name.remove(name);
            }
        }
    }
}

/// See [`ActualState::hold`].
pub struct Held<'a>(std::sync::MutexGuard<'a, Plugins>);

impl Held<'_> {
    /// The entry for `path`.
    pub fn get(&self, path: &Path) -> Option<&RegisteredPlugin> {
        self.0.by_path.get(path).map(|entry| &**entry)
    }

    /// Every registered path and its entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&Path, &RegisteredPlugin)> {
        self.0
            .by_path
            .iter()
            .map(|(path, entry)| (&**path, &**entry))
    }
}

impl ActualState {
    /// Records a registration for `path` (replacing any entry there) and returns it. Give the
    /// desired state's `Arc<Path>` to share its allocation.
    pub fn add(
        &self,
        path: impl Into<Arc<Path>>,
        generation: Uuid,
        socket: SocketId,
        plugin: Plugin,
        handler: Arc<dyn PluginHandler>,
        provenance: Provenance,
    ) -> RegisteredPlugin {
        self.insert(
            path.into(),
            generation,
            socket,
            plugin,
            Some(handler),
            provenance,
        )
    }

    /// Records a plugin the agent observes (observe mode: no handler, no Notify), replacing any
    /// entry at `path`, and returns it.
    pub fn add_observed(
        &self,
        path: impl Into<Arc<Path>>,
        generation: Uuid,
        socket: SocketId,
        plugin: Plugin,
        provenance: Provenance,
    ) -> RegisteredPlugin {
        self.insert(path.into(), generation, socket, plugin, None, provenance)
    }

    fn insert(
        &self,
        path: Arc<Path>,
        generation: Uuid,
        socket: SocketId,
        plugin: Plugin,
        handler: Option<Arc<dyn PluginHandler>>,
        provenance: Provenance,
    ) -> RegisteredPlugin {
        let entry = RegisteredPlugin {
            generation,
            socket,
            plugin,
            handler,
            registered_at: SystemTime::now(),
            provenance,
            interrupted: false,
        };
        self.restore(path, entry)
    }

    /// Records an entry as a previous agent left it (see `persist`): the same generation and
    /// registration time, and the handler of today's registry that it was registered with.
    pub fn restore(&self, path: Arc<Path>, entry: RegisteredPlugin) -> RegisteredPlugin {
        self.lock().insert(path, entry.clone());
        entry
    }

    /// Removes the entry for `path` if it is the registration of `generation`; returns it.
    pub fn remove(&self, path: &Path, generation: Uuid) -> Option<RegisteredPlugin> {
        let mut plugins = self.lock();
        match plugins.by_path.get(path) {
            Some(entry) if entry.generation == generation => plugins.remove(path),
            _ => None,
        }
    }

    /// The entry for `path`.
    pub fn get(&self, path: &Path) -> Option<RegisteredPlugin> {
        self.lock().by_path.get(path).map(|entry| (**entry).clone())
    }

    /// [`Registered`] of the entry for `path`, without copying the entry.
    pub fn summary(&self, path: &Path) -> Option<Registered> {
        self.lock().by_path.get(path).map(|entry| entry.summary())
    }

    /// Kubelet's `PluginExistsWithCorrectUUID`: registered, and for this generation.
    pub fn is_registered(&self, path: &Path, generation: Uuid) -> bool {
        self.lock()
            .by_path
            .get(path)
            .is_some_and(|entry| entry.generation == generation)
    }

    /// Actual state held still while something is written from it (`persist`'s snapshot):
    /// entries are read in place, none copied. Registrations wait meanwhile: keep it short.
    pub fn hold(&self) -> Held<'_> {
        Held(self.lock())
    }

    /// Every registered path and its entry, in no particular order.
    pub fn snapshot(&self) -> Vec<(PathBuf, RegisteredPlugin)> {
        self.lock()
            .by_path
            .iter()
            .map(|(p, e)| (p.to_path_buf(), (**e).clone()))
            .collect()
    }

    /// The entries registered under the plugin name `name`, with their paths (a lookup, not a
    /// pass over every plugin).
    pub fn named(&self, name: &str) -> Vec<(PathBuf, RegisteredPlugin)> {
        let plugins = self.lock();
        let Some(paths) = plugins.by_name.get(name) else {
            return Vec::new();
        };
        paths
            .iter()
            .filter_map(|p| {
                let entry = plugins.by_path.get(p)?;
                Some((p.to_path_buf(), (**entry).clone()))
            })
            .collect()
    }

    /// The other sockets registered with `plugin`'s type and name than the one at `path`, with
    /// when each was registered: a lookup by name that copies no entry (every watch event's
    /// reason asks, and the name is almost always the plugin's alone).
    pub fn others_named(&self, path: &Path, plugin: &Plugin) -> Vec<(PathBuf, SystemTime)> {
        let plugins = self.lock();
        let Some(paths) = plugins.by_name.get(plugin.name.as_str()) else {
            return Vec::new();
        };
        paths
            .iter()
            .filter(|other| &***other != path)
            .filter_map(|other| {
                let entry = plugins.by_path.get(other)?;
                (entry.plugin.plugin_type == plugin.plugin_type)
                    .then(|| (other.to_path_buf(), entry.registered_at))
            })
            .collect()
    }

    /// Every registered path (the table's own allocations, shared).
    pub fn paths(&self) -> Vec<Arc<Path>> {
        self.lock().by_path.keys().cloned().collect()
    }

    /// The registered paths for which `keep` holds (without cloning the rest).
    pub fn paths_where(&self, keep: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
        self.lock()
            .by_path
            .keys()
            .filter(|p| keep(p))
            .map(|p| p.to_path_buf())
            .collect()
    }

    /// Number of registered plugins.
    pub fn len(&self) -> usize {
        self.lock().by_path.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Plugins> {
        // Single inserts/removes: a poisoned map is still consistent.
        self.plugins
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::accept_all::AcceptAll;

    fn plugin(name: &str, socket: &str) -> Plugin {
        Plugin {
            plugin_type: "CSIPlugin".into(),
            name: name.into(),
            endpoint: socket.into(),
            supported_versions: vec!["1.0.0".into()],
            socket_path: socket.into(),
        }
    }

    fn id(ino: u64) -> SocketId {
        SocketId {
            dev: 1,
            ino,
            birth_ns: None,
            handle: None,
        }
    }

    #[test]
    fn registered_with_right_generation_is_found() {
        let state = ActualState::default();
        let generation = Uuid::new_v4();
        state.add(
            Path::new("/r/a.sock"),
            generation,
            id(1),
            plugin("a", "/r/a.sock"),
            Arc::new(AcceptAll),
            crate::provenance::Provenance::default(),
        );
        assert!(state.is_registered(Path::new("/r/a.sock"), generation));
    }

    #[test]
    fn lookup_by_wrong_generation_is_false() {
        let state = ActualState::default();
        state.add(
            Path::new("/r/a.sock"),
            Uuid::new_v4(),
            id(1),
            plugin("a", "/r/a.sock"),
            Arc::new(AcceptAll),
            crate::provenance::Provenance::default(),
        );
        assert!(!state.is_registered(Path::new("/r/a.sock"), Uuid::new_v4()));
        assert!(!state.is_registered(Path::new("/r/other.sock"), Uuid::new_v4()));
    }

    #[test]
    fn remove_only_removes_the_named_generation() {
        let state = ActualState::default();
        let generation = Uuid::new_v4();
        state.add(
            Path::new("/r/a.sock"),
            generation,
            id(1),
            plugin("a", "/r/a.sock"),
            Arc::new(AcceptAll),
            crate::provenance::Provenance::default(),
        );
        assert!(
            state
                .remove(Path::new("/r/a.sock"), Uuid::new_v4())
                .is_none()
        );
        assert!(state.remove(Path::new("/r/a.sock"), generation).is_some());
        assert!(state.is_empty());
    }

    #[test]
    fn sockets_of_one_name_are_separate_registrations_with_their_own_endpoints() {
        let state = ActualState::default();
        let (v1, v2) = (Path::new("/r/v1.sock"), Path::new("/r/v2.sock"));
        let first = state.add(
            v1,
            Uuid::new_v4(),
            id(1),
            plugin("foo", "/r/v1.sock"),
            Arc::new(AcceptAll),
            crate::provenance::Provenance::default(),
        );
        let second = state.add(
            v2,
            Uuid::new_v4(),
            id(2),
            plugin("foo", "/r/v2.sock"),
            Arc::new(AcceptAll),
            crate::provenance::Provenance::default(),
        );
        // Removing the older one gives back its own endpoint and leaves the newer one registered.
        let removed = state.remove(v1, first.generation).expect("v1");
        assert_eq!(removed.plugin.endpoint, "/r/v1.sock");
        assert!(state.is_registered(v2, second.generation));
        assert_eq!(state.len(), 1);
    }

    #[test]
    fn one_path_allocation_serves_key_and_caller() {
        let state = ActualState::default();
        let path: Arc<Path> = Arc::from(Path::new("/r/a.sock"));
        state.add(
            path.clone(),
            Uuid::new_v4(),
            id(1),
            plugin("foo", "/r/a.sock"),
            Arc::new(AcceptAll),
            crate::provenance::Provenance::default(),
        );
        // Re-adding with another allocation of the same path keeps the first one.
        state.add(
            Path::new("/r/a.sock"),
            Uuid::new_v4(),
            id(2),
            plugin("foo", "/r/a.sock"),
            Arc::new(AcceptAll),
            crate::provenance::Provenance::default(),
        );
        let plugins = state.lock();
        let (key, _) = plugins.by_path.get_key_value(&path).expect("entry");
        assert!(Arc::ptr_eq(key, &path));
        // The caller's handle, the key and the name index (the same allocation): nothing else
        // holds the path.
        assert_eq!(Arc::strong_count(&path), 3);
        assert!(Arc::ptr_eq(&plugins.by_name["foo"][0], &path));
    }
}
