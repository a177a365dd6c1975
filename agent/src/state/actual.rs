//! Actual state of the world: plugins registered with a handler, keyed by socket path.
//!
//! Written only by the operation executor: an entry is added *before* the handler's `Register` (so
//! a socket deleted during registration becomes a deregistration) and removed before the handler's
//! `DeRegister`. Read by the reconciler, and by operators through the admin API and metrics.

use super::SocketId;
use crate::handler::{Plugin, PluginHandler};
use std::collections::{BTreeSet, HashMap};
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
    /// handler for its type changed since.
    pub handler: Arc<dyn PluginHandler>,
    /// When the entry was added.
    pub registered_at: SystemTime,
    /// A newer socket registered the same plugin (type and name) since: removing this socket must
    /// not deregister the plugin (the handler contract's re-registration rule).
    pub superseded: bool,
}

impl std::fmt::Debug for RegisteredPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredPlugin")
            .field("generation", &self.generation)
            .field("socket", &self.socket)
            .field("plugin", &self.plugin)
            .field("superseded", &self.superseded)
            .finish_non_exhaustive()
    }
}

/// The cache itself; cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct ActualState {
    plugins: Mutex<Plugins>,
}

/// Entries by path, and the paths of each plugin (type, name): completing a registration marks
/// the plugin's other sockets superseded by looking at just those, not at every entry (a burst of
/// 10,000 registrations would otherwise compare 50 million entries).
///
/// Memory per registered plugin is what the entry holds plus a table slot and an index element:
/// entries are boxed (a table grows to a power of two, so inline ~300-byte entries cost up to
/// twice that each); the path is one allocation shared by the key, the index and the desired
/// state's entry; the name index is an ordered set of (hash of (type, name), path), its candidates
/// checked on use, so it holds no allocation per plugin besides its B-tree nodes.
#[derive(Debug, Default)]
struct Plugins {
    by_path: HashMap<Arc<Path>, Box<RegisteredPlugin>>,
    by_name: BTreeSet<(u64, Arc<Path>)>,
}

/// Hash of (plugin type, plugin name): the name index's key.
fn key_of(plugin: &Plugin) -> u64 {
    use std::hash::{BuildHasher as _, Hash as _, Hasher as _};
    let mut hasher = NAME_HASH.build_hasher();
    plugin.plugin_type.hash(&mut hasher);
    plugin.name.hash(&mut hasher);
    hasher.finish()
}

/// Fixed keys: the index lives in one process and a collision only adds a candidate to check.
const NAME_HASH: std::hash::BuildHasherDefault<std::collections::hash_map::DefaultHasher> =
    std::hash::BuildHasherDefault::new();

impl Plugins {
    fn insert(&mut self, path: Arc<Path>, entry: RegisteredPlugin) {
        let key = key_of(&entry.plugin);
        // An entry already there keeps its key: take the same allocation for the index.
        let path = match self.by_path.remove_entry(&*path) {
            Some((old_path, old)) => {
                self.by_name
                    .remove(&(key_of(&old.plugin), old_path.clone()));
                old_path
            }
            None => path,
        };
        self.by_name.insert((key, path.clone()));
        self.by_path.insert(path, Box::new(entry));
    }

    fn remove(&mut self, path: &Path) -> Option<RegisteredPlugin> {
        let (path, entry) = self.by_path.remove_entry(path)?;
        self.by_name.remove(&(key_of(&entry.plugin), path));
        crate::memory::shrink_if_sparse(&mut self.by_path);
        Some(*entry)
    }

    /// Paths indexed under `key` (a hash: check the candidates).
    fn candidates(&self, key: u64) -> impl Iterator<Item = &Arc<Path>> {
        let from: Arc<Path> = Arc::from(Path::new(""));
        self.by_name
            .range((key, from)..)
            .take_while(move |(k, _)| *k == key)
            .map(|(_, p)| p)
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
    ) -> RegisteredPlugin {
        let entry = RegisteredPlugin {
            generation,
            socket,
            plugin,
            handler,
            registered_at: SystemTime::now(),
            superseded: false,
        };
        self.lock().insert(path.into(), entry.clone());
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

    /// Kubelet's `PluginExistsWithCorrectUUID`: registered, and for this generation.
    pub fn is_registered(&self, path: &Path, generation: Uuid) -> bool {
        self.lock()
            .by_path
            .get(path)
            .is_some_and(|entry| entry.generation == generation)
    }

    /// The registration at `path` completed: every *other* socket's registration of the same
    /// plugin type and name is now superseded by it.
    pub fn supersede_others(&self, path: &Path) {
        let plugins = &mut *self.lock();
        let Some(newest) = plugins.by_path.get(path) else {
            return;
        };
        let (key, plugin_type, name) = (
            key_of(&newest.plugin),
            newest.plugin.plugin_type.clone(),
            newest.plugin.name.clone(),
        );
        let others: Vec<Arc<Path>> = plugins
            .candidates(key)
            .filter(|other| other.as_os_str() != path.as_os_str())
            .cloned()
            .collect();
        for other_path in others {
            if let Some(other) = plugins.by_path.get_mut(&other_path)
                && other.plugin.plugin_type == plugin_type
                && other.plugin.name == name
            {
                other.superseded = true;
            }
        }
    }

    /// Every registered path and its entry, in no particular order.
    pub fn snapshot(&self) -> Vec<(PathBuf, RegisteredPlugin)> {
        self.lock()
            .by_path
            .iter()
            .map(|(p, e)| (p.to_path_buf(), (**e).clone()))
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
    fn newer_socket_with_same_name_supersedes_older() {
        let state = ActualState::default();
        let (v1, v2) = (Path::new("/r/v1.sock"), Path::new("/r/v2.sock"));
        state.add(
            v1,
            Uuid::new_v4(),
            id(1),
            plugin("foo", "/r/v1.sock"),
            Arc::new(AcceptAll),
        );
        state.supersede_others(v1);
        state.add(
            v2,
            Uuid::new_v4(),
            id(2),
            plugin("foo", "/r/v2.sock"),
            Arc::new(AcceptAll),
        );
        state.add(
            Path::new("/r/bar.sock"),
            Uuid::new_v4(),
            id(3),
            plugin("bar", "/r/bar.sock"),
            Arc::new(AcceptAll),
        );
        state.supersede_others(v2);
        assert!(state.get(v1).expect("v1").superseded);
        assert!(!state.get(v2).expect("v2").superseded);
        assert!(!state.get(Path::new("/r/bar.sock")).expect("bar").superseded);
    }

    #[test]
    fn removed_and_replaced_entries_leave_the_name_index() {
        let state = ActualState::default();
        let (a, b) = (Path::new("/r/a.sock"), Path::new("/r/b.sock"));
        let first = state.add(
            a,
            Uuid::new_v4(),
            id(1),
            plugin("foo", "/r/a.sock"),
            Arc::new(AcceptAll),
        );
        // Re-registration at the same path under another name: the old name no longer points here.
        state.add(
            a,
            Uuid::new_v4(),
            id(2),
            plugin("bar", "/r/a.sock"),
            Arc::new(AcceptAll),
        );
        assert!(state.remove(a, first.generation).is_none());
        let second = state.add(
            b,
            Uuid::new_v4(),
            id(3),
            plugin("foo", "/r/b.sock"),
            Arc::new(AcceptAll),
        );
        state.supersede_others(b);
        assert!(
            !state.get(a).expect("a").superseded,
            "a is bar now, not foo"
        );
        state.remove(b, second.generation);
        let current = state.get(a).expect("a").generation;
        state.remove(a, current);
        assert!(state.is_empty());
        assert!(state.lock().by_name.is_empty());
    }

    #[test]
    fn one_path_allocation_serves_key_index_and_caller() {
        let state = ActualState::default();
        let path: Arc<Path> = Arc::from(Path::new("/r/a.sock"));
        state.add(
            path.clone(),
            Uuid::new_v4(),
            id(1),
            plugin("foo", "/r/a.sock"),
            Arc::new(AcceptAll),
        );
        // Re-adding with another allocation of the same path keeps the first one.
        state.add(
            Path::new("/r/a.sock"),
            Uuid::new_v4(),
            id(2),
            plugin("foo", "/r/a.sock"),
            Arc::new(AcceptAll),
        );
        let plugins = state.lock();
        let (key, _) = plugins.by_path.get_key_value(&*path).expect("entry");
        assert!(Arc::ptr_eq(key, &path));
        assert_eq!(plugins.by_name.len(), 1);
        assert!(plugins.by_name.iter().all(|(_, p)| Arc::ptr_eq(p, &path)));
        // The caller's handle, the key and the index element: nothing else holds the path.
        assert_eq!(Arc::strong_count(&path), 3);
    }

    #[test]
    fn same_name_on_many_paths_are_all_candidates() {
        let state = ActualState::default();
        let paths: Vec<String> = (0..5).map(|i| format!("/r/{i}.sock")).collect();
        for (i, p) in paths.iter().enumerate() {
            state.add(
                Path::new(p),
                Uuid::new_v4(),
                id(i as u64),
                plugin("foo", p),
                Arc::new(AcceptAll),
            );
        }
        state.supersede_others(Path::new("/r/4.sock"));
        for p in &paths[..4] {
            assert!(state.get(Path::new(p)).expect("entry").superseded);
        }
        assert!(!state.get(Path::new("/r/4.sock")).expect("4").superseded);
    }
}
