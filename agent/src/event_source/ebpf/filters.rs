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
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use agent_ebpf::{DirKey, NameKey};
use anyhow::Context;
use aya::maps::{HashMap as BpfHashMap, MapData};
use tokio::sync::Notify;

use crate::event_source::WatchedDir;

/// The watched-directory and name filters, shared by the source (writer) and its reader.
pub struct Filters {
    watched: Mutex<BpfHashMap<MapData, DirKey, u8>>,
    names: Mutex<BpfHashMap<MapData, NameKey, u8>>,
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
        names: BpfHashMap<MapData, NameKey, u8>,
        watched_capacity: u32,
    ) -> Self {
        Filters {
            watched: Mutex::new(watched),
            names: Mutex::new(names),
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
        if names.get(&key, 0).is_ok() || names.insert(key, 0, 0).is_ok() {
            return true;
        }
        self.names_overflowed.store(true, Ordering::Release);
        self.overflow.notify_one();
        false
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
        let keys: Vec<NameKey> = names.keys().filter_map(Result::ok).collect();
        for key in keys {
            let _ = names.remove(&key);
        }
    }

    /// The agent's path of the watched directory with kernel identity `key`.
    pub fn path_of(&self, key: &DirKey) -> Option<PathBuf> {
        lock(&self.paths).get(key).cloned()
    }
}
