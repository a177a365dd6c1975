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

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use agent_ebpf::{DirKey, NameHolder, NameKey};
use anyhow::Context;
use aya::maps::{HashMap as BpfHashMap, MapData, MapError};
use tokio::sync::Notify;

use super::name_holders::{DirIndex, NameHolders, NameTable};
use crate::event_source::{Entry, WatchedDir};

/// The name table: the kernel's map, whose entries also say which watched directory holds each
/// name, and what userspace keeps beside it (see [`NameHolders`]).
///
/// The kernel reports a name-only event with the id of the path's parent component when it found
/// that component in the table (see `agent_ebpf::Event::parent`), so the watcher looks for the
/// entry only in the watched directories so named instead of in every one. Ids start at 1 (0 is
/// "none": sockets, and directories until one is announced as such).
///
/// The table holds the names of the entries in the tree, no more: a name leaves it when the last
/// entry carrying it does (`forget_name`). Names of sockets that came and went (a storm of
/// short-lived sockets) never enter it, because the kernel does not add a bound socket's name:
/// the watcher announces an entry, then looks at it (see
/// [`crate::event_source::EventSource::entry_present`]), so a removal made before the announcement
/// is seen by that look, and every one after it is matched by name. Before this, every bound
/// name went in and the table filled every 16,384 names, and each time the reader cleared it
/// (16,384 map deletions while events waited) and asked for a full rescan: the storm's tail.
struct Names {
    map: NameTable,
    holders: NameHolders,
    next_id: u32,
    /// What the kernel's table holds, when a walk can know it without a lookup per name.
    fresh: Fresh,
}

/// What the kernel's table is known to hold (userspace is its only writer), so that a walk's
/// names need no lookup each: after a start (a new table, or an adopted one emptied) the first
/// walk finds every socket name new. 10,000 sockets there were 10,000 `bpf` lookups (each
/// failing) before their batched insertion.
enum Fresh {
    /// Sockets of `walked`, inserted by walks, and at most the names in `others` (announced one
    /// by one: directories, sockets an event found). A name of `walked` not in `others` is in
    /// the table only as that directory's socket, if at all, so inserting it again changes
    /// nothing (and calls it new: the caller looks at it once more).
    Known {
        walked: Option<DirIndex>,
        others: HashSet<Box<[u8]>>,
    },
    /// Anything: every name is looked up.
    Mixed,
}

/// Names announced one by one that [`Fresh::Known`] keeps apart before it gives up.
const MOST_OTHERS: usize = 1024;

impl Fresh {
    /// What a table taken over holds: read once.
    fn of(map: &NameTable) -> Fresh {
        match map.keys().next() {
            None => Fresh::Known {
                walked: None,
                others: HashSet::new(),
            },
            Some(_) => Fresh::Mixed,
        }
    }

    /// Whether a walk of `dir` may insert `name` without looking it up.
    fn needs_no_lookup(&self, dir: DirIndex, name: &[u8]) -> bool {
        match self {
            Fresh::Known { walked, others } => {
                walked.is_none_or(|walked| walked == dir) && !others.contains(name)
            }
            Fresh::Mixed => false,
        }
    }

    /// `name` was announced one by one (it may have gone in, or taken an id).
    fn announced(&mut self, name: &[u8]) {
        if let Fresh::Known { others, .. } = self {
            if others.len() < MOST_OTHERS {
                others.insert(name.into());
            } else {
                *self = Fresh::Mixed;
            }
        }
    }

    /// A walk of `dir` inserted names.
    fn walked(&mut self, dir: DirIndex) {
        if let Fresh::Known { walked, .. } = self {
            match walked {
                None => *walked = Some(dir),
                Some(walked) if *walked == dir => {}
                Some(_) => *self = Fresh::Mixed,
            }
        }
    }
}

/// Gives `name` (`key`, in the table as `holder`) an id the kernel reports it by when it is a
/// path's parent component. The key is overwritten in place (no new element), so this fails only
/// on a kernel error; the name then stays without an id, and a record naming it as a parent
/// carries none (the watcher looks in every watched directory, as for any unknown parent).
fn assign_id(names: &mut Names, key: &NameKey, name: &[u8], holder: NameHolder) {
    let id = names.next_id;
    if names
        .map
        .insert(key, NameHolder { id, ..holder }, 0)
        .is_ok()
    {
        names.took_id(name, id);
    }
}

impl Names {
    /// `name` went into the table with the next id: the one after it is next.
    fn took_id(&mut self, name: &[u8], id: u32) {
        self.next_id = id.wrapping_add(1).max(1);
        self.holders.named(name, id);
    }
}

/// `BPF_NOEXIST`: an update that only inserts.
const BPF_NOEXIST: u64 = 1;

/// The name table is full: the reader clears it and asks for a rescan, which refills it.
#[derive(Debug)]
pub struct NamesFull;

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
        names: NameTable,
        watched_capacity: u32,
    ) -> Self {
        Filters {
            watched: Mutex::new(watched),
            names: Mutex::new(Names {
                fresh: Fresh::of(&names),
                map: names,
                holders: NameHolders::default(),
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
        lock(&self.names).holders.unwatched(&key);
    }

    /// Lets the kernel match a later removal of `name` from `dir` by a multi-component path (and,
    /// for a directory, name it as a path's parent).
    ///
    /// Returns whether the name is new in `dir` (the caller then looks at
    /// the entry, or withdraws the name when it announced it before looking and found nothing:
    /// the withdrawal then takes back exactly this announcement), or [`NamesFull`]; the reader is
    /// then told to clear the table and ask for a rescan.
    pub fn remember_name(
        &self,
        dir: &WatchedDir,
        name: &OsStr,
        entry: Entry,
    ) -> Result<bool, NamesFull> {
        let Some(key) = NameKey::new(name.as_bytes()) else {
            return Ok(false);
        };
        let mut guard = lock(&self.names);
        let names = &mut *guard;
        let dir = names.holders.dir(Self::key(dir));
        let name = name.as_bytes();
        names.fresh.announced(name);
        // Most names are new to the table: inserting it is one syscall, and only a name it has
        // already is looked up.
        let id = match entry {
            Entry::Directory => names.next_id,
            Entry::Socket => 0,
        };
        match names
            .map
            .insert(key, NameHolders::new_holder(dir, id), BPF_NOEXIST)
        {
            Ok(()) => {
                if id != 0 {
                    names.took_id(name, id);
                }
                return Ok(true);
            }
            Err(MapError::SyscallError(error))
                if error.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                if let Some(held) = names.holders.hold(&names.map, &key, name, dir) {
                    if entry == Entry::Directory && held.entry.id == 0 {
                        assign_id(names, &key, name, held.entry);
                    }
                    return Ok(held.new_here);
                }
            }
            Err(_) => {}
        }
        // Full, or gone between the insertion and the lookup (only a kernel error takes a name
        // out): not remembered, and the reader is told.
        self.names_overflowed.store(true, Ordering::Release);
        self.overflow.notify_one();
        Err(NamesFull)
    }

    /// [`remember_name`](Self::remember_name) for sockets `names` of `dir`, the new ones
    /// written to the kernel's table in batches (see `batched`). Returns, name by name, whether
    /// it was new in `dir`; [`NamesFull`] when some did not fit (those are not remembered; the reader is
    /// told, as for one name).
    pub fn remember_sockets(
        &self,
        dir: &WatchedDir,
        names: &[&OsStr],
    ) -> Result<Vec<bool>, NamesFull> {
        let mut guard = lock(&self.names);
        let Names {
            map,
            holders,
            fresh,
            ..
        } = &mut *guard;
        let dir = holders.dir(Self::key(dir));
        let mut new = vec![false; names.len()];
        let mut to_insert: Vec<(usize, (NameKey, NameHolder))> = Vec::new();
        for (index, name) in names.iter().enumerate() {
            let Some(key) = NameKey::new(name.as_bytes()) else {
                continue;
            };
            let held = if fresh.needs_no_lookup(dir, name.as_bytes()) {
                None
            } else {
                holders.hold(map, &key, name.as_bytes(), dir)
            };
            match held {
                Some(held) => new[index] = held.new_here,
                // A socket's name carries no id (a socket is never a path's parent).
                None => to_insert.push((index, (key, NameHolders::new_holder(dir, 0)))),
            }
        }
        let entries: Vec<(NameKey, NameHolder)> =
            to_insert.iter().map(|(_, entry)| *entry).collect();
        let inserted = super::batched::insert(map, &entries);
        if inserted > 0 {
            fresh.walked(dir);
        }
        for (index, _) in &to_insert[..inserted] {
            new[*index] = true;
        }
        if inserted < to_insert.len() {
            self.names_overflowed.store(true, Ordering::Release);
            self.overflow.notify_one();
            return Err(NamesFull);
        }
        Ok(new)
    }

    /// The entry `name` in `dir` is gone: the name leaves the table once no watched directory
    /// holds an entry so named; an entry not yet announced that carries it is looked at again
    /// when it is (see [`Names`]).
    pub fn forget_name(&self, dir: &WatchedDir, name: &OsStr) {
        let Some(key) = NameKey::new(name.as_bytes()) else {
            return;
        };
        let mut guard = lock(&self.names);
        let Names { map, holders, .. } = &mut *guard;
        let dir = holders.known_dir(&Self::key(dir));
        holders.release(map, &key, name.as_bytes(), dir);
    }

    /// The name the kernel's id `id` stands for (see [`Names`]).
    pub fn name_of(&self, id: u64) -> Option<OsString> {
        let id = u32::try_from(id).ok().filter(|id| *id != 0)?;
        lock(&self.names)
            .holders
            .name_of(id)
            .map(|name| OsStr::from_bytes(name).to_os_string())
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
        super::batched::empty(&mut names.map);
        names.fresh = Fresh::of(&names.map);
        names.holders.clear();
    }

    /// The agent's path of the watched directory with kernel identity `key`.
    pub fn path_of(&self, key: &DirKey) -> Option<PathBuf> {
        lock(&self.paths).get(key).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::super::batched::tests::{hash_map, name_table};
    use super::*;

    fn filters() -> Option<Filters> {
        Some(Filters::new(hash_map(8)?, name_table(64)?, 8))
    }

    fn dir(ino: u64) -> WatchedDir {
        WatchedDir {
            path: PathBuf::from(format!("/plugins/{ino}")),
            dev: 1,
            ino,
        }
    }

    fn names(list: &[&'static str]) -> Vec<&'static OsStr> {
        list.iter().map(|name| OsStr::new(*name)).collect()
    }

    /// The kernel's entry for `name`.
    fn entry(filters: &Filters, name: &str) -> Option<NameHolder> {
        let key = NameKey::new(name.as_bytes())?;
        lock(&filters.names).map.get(&key, 0).ok()
    }

    #[test]
    fn a_first_walk_inserts_without_lookups_and_keeps_what_was_announced_alone() {
        let Some(filters) = filters() else {
            return;
        };
        let (root, other) = (dir(1), dir(2));
        // The walk announces the directory `sub` (of `root`) on its own: it takes an id.
        assert!(matches!(
            filters.remember_name(&root, OsStr::new("sub"), Entry::Directory),
            Ok(true)
        ));
        let sub = entry(&filters, "sub").expect("announced");
        assert_ne!(sub.id, 0);
        // A socket named like that directory, in the directory walked next, is looked up: the
        // directory's entry keeps its id and its holder.
        let found = filters.remember_sockets(&other, &names(&["a.sock", "sub"]));
        assert_eq!(found.ok(), Some(vec![true, true]));
        assert_eq!(entry(&filters, "sub"), Some(sub));
        assert!(matches!(
            lock(&filters.names).fresh,
            Fresh::Known {
                walked: Some(_),
                ..
            }
        ));
        // The same directory's next chunk: new names go in unlooked; one it has is its own.
        let found = filters.remember_sockets(&other, &names(&["b.sock", "a.sock"]));
        assert_eq!(found.ok(), Some(vec![true, true]));
        let other_index = entry(&filters, "a.sock").expect("inserted").dir;
        assert_eq!(entry(&filters, "b.sock").map(|e| e.dir), Some(other_index));
        assert_eq!(entry(&filters, "a.sock").map(|e| e.id), Some(0));
        // Another directory's walk looks its names up: `a.sock` stays `other`'s entry, and is
        // new in `root`; from then on every walk looks names up.
        let found = filters.remember_sockets(&root, &names(&["a.sock", "c.sock"]));
        assert_eq!(found.ok(), Some(vec![true, true]));
        assert_eq!(entry(&filters, "a.sock").map(|e| e.dir), Some(other_index));
        assert!(matches!(lock(&filters.names).fresh, Fresh::Mixed));
        let found = filters.remember_sockets(&other, &names(&["a.sock", "d.sock"]));
        assert_eq!(found.ok(), Some(vec![false, true]));
        // Both holders have to go before the name leaves the table.
        filters.forget_name(&other, OsStr::new("a.sock"));
        assert!(entry(&filters, "a.sock").is_some());
        filters.forget_name(&root, OsStr::new("a.sock"));
        assert_eq!(entry(&filters, "a.sock"), None);
        // Emptied (after an overflow), the table is known again.
        filters.forget_names();
        assert!(matches!(
            lock(&filters.names).fresh,
            Fresh::Known { walked: None, .. }
        ));
    }
}
