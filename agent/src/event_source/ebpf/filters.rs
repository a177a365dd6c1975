//! The in-kernel filters the watcher steers: which directories are watched, which names exist.
//!
//! ```text
//! watcher --watch/unwatch--> Filters --WATCHED map--> kernel programs (filter by parent identity)
//!         --entry_present--> Filters --NAMES map----> kernel programs (filter multi-component unlinks)
//! reader  --path_of(DirKey)--> the watched directory's path, to turn an event into an FsEvent
//! ```
//!
//! The BPF maps speak the kernel's identity (`s_dev` encoding); the paths are the agent's. Both
//! halves live here so they are updated together: a directory's path is known before the kernel can
//! report anything in it.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use agent_ebpf::{DirKey, NameKey};
use anyhow::Context;
use aya::maps::{HashMap as BpfHashMap, MapData};
use tokio::sync::Notify;

use crate::event_source::WatchedDir;

/// The name table and userspace's ids for its names.
///
/// The kernel reports a name-only event with the id of the path's parent component when it found
/// that component in the table (see `agent_ebpf::Event::parent`), so the watcher looks for the
/// entry only in the watched directories so named instead of in every one. Ids start at 1 (0 is
/// "none", which the kernel's own insertions carry until the watcher announces the name).
struct Names {
    map: BpfHashMap<MapData, NameKey, u32>,
    ids: HashMap<OsString, u32>,
    by_id: HashMap<u32, OsString>,
    next_id: u32,
}

/// The watched-directory and name filters, shared by the source (writer) and its reader.
pub struct Filters {
    watched: Mutex<BpfHashMap<MapData, DirKey, u8>>,
    names: Mutex<Names>,
    paths: Mutex<HashMap<DirKey, PathBuf>>,
    watched_capacity: u32,
    /// Set when `entry_present` could not record a name; the reader clears the map and rescans.
    names_overflowed: AtomicBool,
    overflow: Notify,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave these maps half-updated in a way that matters:
    // the worst case is an entry the kernel still filters on, which over-reports.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Filters {
    /// Takes the two filter maps from the loaded object.
    pub fn new(
        watched: BpfHashMap<MapData, DirKey, u8>,
        names: BpfHashMap<MapData, NameKey, u32>,
        watched_capacity: u32,
    ) -> Self {
        Filters {
            watched: Mutex::new(watched),
            names: Mutex::new(Names {
                map: names,
                ids: HashMap::new(),
                by_id: HashMap::new(),
                next_id: 1,
            }),
            paths: Mutex::new(HashMap::new()),
            watched_capacity,
            names_overflowed: AtomicBool::new(false),
            overflow: Notify::new(),
        }
    }

    /// The kernel identity of `dir`.
    pub fn key(dir: &WatchedDir) -> DirKey {
        DirKey {
            dev: DirKey::kernel_dev(dir.dev),
            ino: dir.ino,
        }
    }

    /// Starts reporting changes in `dir`; in effect for every syscall that enters after this returns.
    pub fn watch(&self, dir: &WatchedDir) -> anyhow::Result<()> {
        let key = Self::key(dir);
        lock(&self.paths).insert(key, dir.path.clone());
        let inserted = lock(&self.watched).insert(key, 0, 0);
        if let Err(err) = inserted {
            lock(&self.paths).remove(&key);
            return Err(err).with_context(|| {
                format!(
                    "cannot add {} to the eBPF watched-directory map (capacity {})",
                    dir.path.display(),
                    self.watched_capacity
                )
            });
        }
        Ok(())
    }

    /// Stops reporting changes in `dir`.
    pub fn unwatch(&self, dir: &WatchedDir) {
        let key = Self::key(dir);
        // Absent keys are fine: the watcher may unwatch what failed to watch.
        let _ = lock(&self.watched).remove(&key);
        lock(&self.paths).remove(&key);
    }

    /// Lets the kernel match a later removal of `name` by a multi-component path.
    ///
    /// Returns false when the map is full; the reader is then told to clear it and ask for a rescan.
    pub fn remember_name(&self, name: &OsStr) -> bool {
        let Some(key) = NameKey::new(name.as_bytes()) else {
            return true;
        };
        let mut names = lock(&self.names);
        if names.ids.contains_key(name) {
            return true;
        }
        let id = names.next_id;
        // Overwrites the kernel's own insertion of the name (id 0) with userspace's id.
        if names.map.insert(key, id, 0).is_ok() {
            names.next_id = id.wrapping_add(1).max(1);
            names.ids.insert(name.to_os_string(), id);
            names.by_id.insert(id, name.to_os_string());
            return true;
        }
        self.names_overflowed.store(true, Ordering::Release);
        self.overflow.notify_one();
        false
    }

    /// The name the kernel's id `id` stands for (see [`Names`]).
    pub fn name_of(&self, id: u64) -> Option<OsString> {
        let id = u32::try_from(id).ok().filter(|id| *id != 0)?;
        lock(&self.names).by_id.get(&id).cloned()
    }

    /// Resolves when `remember_name` found the map full (the reader waits on this).
    pub async fn names_overflow(&self) {
        self.overflow.notified().await;
    }

    /// Whether `remember_name` found the map full since the last call.
    pub fn take_names_overflow(&self) -> bool {
        self.names_overflowed.swap(false, Ordering::AcqRel)
    }

    /// Empties the name map (after it filled up); the rescan that follows re-adds what exists.
    pub fn forget_names(&self) {
        let mut names = lock(&self.names);
        let keys: Vec<NameKey> = names.map.keys().filter_map(Result::ok).collect();
        for key in keys {
            let _ = names.map.remove(&key);
        }
        names.ids.clear();
        names.by_id.clear();
    }

    /// The agent's path of the watched directory with kernel identity `key`.
    pub fn path_of(&self, key: &DirKey) -> Option<PathBuf> {
        lock(&self.paths).get(key).cloned()
    }
}
