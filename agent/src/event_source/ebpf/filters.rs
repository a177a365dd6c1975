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
use aya::maps::{Array, HashMap as BpfHashMap, MapData, MapError};
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
    /// Names in the kernel's table (userspace is its only writer).
    len: usize,
    /// How many of them sockets may take: the rest is kept for directories, whose names the
    /// kernel needs to place a removal by a multi-component path (see [`Filters::remember_sockets`]).
    socket_room: usize,
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

/// Sockets may fill the name table but for this share of it (a quarter), kept for directories.
const DIRECTORY_SHARE: usize = 4;

/// A directory's name did not fit the name table (its room for sockets is kept apart, so only
/// more directories than that room hold): the reader clears it and asks for a rescan, which
/// refills it.
#[derive(Debug)]
pub struct NamesFull;

/// The sizes the maps were made with.
#[derive(Debug, Clone, Copy)]
pub struct Capacities {
    pub watched: u32,
    pub names: u32,
}

/// The watched-directory and name filters, shared by the source (writer) and its reader.
pub struct Filters {
    watched: Mutex<BpfHashMap<MapData, DirKey, u8>>,
    names: Mutex<Names>,
    paths: Mutex<HashMap<DirKey, PathBuf>>,
    watched_capacity: u32,
    /// Set when `entry_present` could not record a directory's name; the reader clears the map
    /// and rescans.
    names_overflowed: AtomicBool,
    overflow: Notify,
    /// The programs' `AGENT` map, whose `NAMES_INCOMPLETE` slot says that socket names were left
    /// out of the table.
    agent: Mutex<Array<MapData, u32>>,
    /// Whether that slot is set: some sockets' names are not in the table.
    incomplete: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave these maps half-updated in a way that matters:
    // the worst case is an entry the kernel still filters on, which over-reports.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Filters {
    /// Takes the two filter maps and the agent's map from the loaded object.
    pub fn new(
        watched: BpfHashMap<MapData, DirKey, u8>,
        names: NameTable,
        agent: Array<MapData, u32>,
        capacities: Capacities,
    ) -> Self {
        let capacity = capacities.names as usize;
        Filters {
            watched: Mutex::new(watched),
            names: Mutex::new(Names {
                fresh: Fresh::of(&names),
                len: names.keys().count(),
                map: names,
                holders: NameHolders::default(),
                next_id: 1,
                socket_room: capacity - capacity / DIRECTORY_SHARE,
            }),
            paths: Mutex::new(HashMap::new()),
            watched_capacity: capacities.watched,
            names_overflowed: AtomicBool::new(false),
            overflow: Notify::new(),
            agent: Mutex::new(agent),
            incomplete: AtomicBool::new(false),
        }
    }

    /// Some socket names were left out of the table: the kernel reports a removal of a name it
    /// lacks when the path's parent component is a known name (see `agent::NAMES_INCOMPLETE`).
    fn names_incomplete(&self) {
        if self.incomplete.swap(true, Ordering::AcqRel) {
            return;
        }
        match lock(&self.agent).set(agent_ebpf::agent::NAMES_INCOMPLETE, 1, 0) {
            Ok(()) => tracing::warn!(
                "more sockets in the tree than the eBPF name table keeps room for: the names of the rest are not kept, and a removal by a path of several components is placed by its parent directory's name instead (no rescans; raise the table with more sockets than this)"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot mark the eBPF name table incomplete: rescanning instead");
                self.incomplete.store(false, Ordering::Release);
                self.names_overflowed.store(true, Ordering::Release);
                self.overflow.notify_one();
            }
        }
    }

    /// Whether socket names were left out of the table (see `names_incomplete`).
    pub fn names_left_out(&self) -> bool {
        self.incomplete.load(Ordering::Acquire)
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
        let room = match entry {
            Entry::Directory => true,
            Entry::Socket => names.len < names.socket_room,
        };
        let inserted = room.then(|| {
            names
                .map
                .insert(key, NameHolders::new_holder(dir, id), BPF_NOEXIST)
        });
        let in_table = match inserted {
            Some(Ok(())) => {
                names.len += 1;
                if id != 0 {
                    names.took_id(name, id);
                }
                return Ok(true);
            }
            Some(Err(MapError::SyscallError(error))) => {
                error.io_error.raw_os_error() == Some(libc::EEXIST)
            }
            Some(Err(_)) => false,
            // No room for a socket's name: the table may hold it already (another directory's).
            None => true,
        };
        if in_table && let Some(held) = names.holders.hold(&names.map, &key, name, dir) {
            if entry == Entry::Directory && held.entry.id == 0 {
                assign_id(names, &key, name, held.entry);
            }
            return Ok(held.new_here);
        }
        if entry == Entry::Socket {
            // Not kept: the kernel places its removal by the parent's name from now on.
            drop(guard);
            self.names_incomplete();
            return Ok(false);
        }
        // Full, or gone between the insertion and the lookup (only a kernel error takes a name
        // out): not remembered, and the reader is told.
        self.names_overflowed.store(true, Ordering::Release);
        self.overflow.notify_one();
        Err(NamesFull)
    }

    /// [`remember_name`](Self::remember_name) for sockets `names` of `dir`, the new ones
    /// written to the kernel's table in batches (see `batched`). Returns, name by name, whether
    /// it was new in `dir`. Sockets take at most the table's socket room; the names that do not
    /// fit are not kept, and the kernel is told the table is incomplete (a removal by a path of
    /// several components is then placed by its parent directory's name): more sockets than the
    /// table holds cost nothing more, where emptying the table and rescanning did it again and
    /// again.
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
            len,
            socket_room,
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
        let room = socket_room.saturating_sub(*len).min(to_insert.len());
        let entries: Vec<(NameKey, NameHolder)> =
            to_insert[..room].iter().map(|(_, entry)| *entry).collect();
        let inserted = super::batched::insert(map, &entries);
        *len += inserted;
        if inserted > 0 {
            fresh.walked(dir);
        }
        for (index, _) in &to_insert[..inserted] {
            new[*index] = true;
        }
        if inserted < to_insert.len() {
            drop(guard);
            self.names_incomplete();
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
        let Names {
            map, holders, len, ..
        } = &mut *guard;
        let dir = holders.known_dir(&Self::key(dir));
        if holders.release(map, &key, name.as_bytes(), dir) {
            *len = len.saturating_sub(1);
        }
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
        names.len = 0;
    }

    /// The agent's path of the watched directory with kernel identity `key`.
    pub fn path_of(&self, key: &DirKey) -> Option<PathBuf> {
        lock(&self.paths).get(key).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::super::batched::tests::{array_u32, hash_map, name_table};
    use super::*;

    fn filters_of(names: u32) -> Option<Filters> {
        let capacities = Capacities { watched: 8, names };
        Some(Filters::new(
            hash_map(8)?,
            name_table(names)?,
            array_u32(agent_ebpf::agent::SLOTS)?,
            capacities,
        ))
    }

    fn filters() -> Option<Filters> {
        filters_of(64)
    }

    /// Issue 44, item 7: more sockets than the table's room made the reader empty the table and
    /// rescan, which filled it again: a rescan loop for as long as they existed. Now the names
    /// that do not fit are left out, the kernel is told the table is incomplete, directories
    /// keep their room, and nothing asks for a rescan.
    #[test]
    fn sockets_beyond_the_table_s_room_are_left_out_without_a_rescan() {
        let Some(filters) = filters_of(8) else {
            return;
        };
        let incomplete = |filters: &Filters| {
            lock(&filters.agent)
                .get(&agent_ebpf::agent::NAMES_INCOMPLETE, 0)
                .expect("the slot")
        };
        let root = dir(1);
        assert_eq!(incomplete(&filters), 0);
        let many: Vec<String> = (0..10).map(|i| format!("s{i}.sock")).collect();
        let many: Vec<&OsStr> = many.iter().map(OsStr::new).collect();
        let found = filters.remember_sockets(&root, &many).expect("no overflow");
        assert_eq!(
            found.iter().filter(|new| **new).count(),
            6,
            "the socket room of 8"
        );
        assert_eq!(incomplete(&filters), 1);
        assert!(matches!(
            filters.remember_name(&root, OsStr::new("one-more.sock"), Entry::Socket),
            Ok(false)
        ));
        // Directories still fit, and take ids.
        assert!(matches!(
            filters.remember_name(&root, OsStr::new("sub"), Entry::Directory),
            Ok(true)
        ));
        assert_ne!(entry(&filters, "sub").map(|e| e.id), Some(0));
        assert!(!filters.take_names_overflow(), "no rescan asked");
        // Names that leave make room for others (the directory took a place of the eight).
        filters.forget_name(&root, OsStr::new("s0.sock"));
        assert!(matches!(
            filters.remember_name(&root, OsStr::new("late.sock"), Entry::Socket),
            Ok(false)
        ));
        filters.forget_name(&root, OsStr::new("s1.sock"));
        assert!(matches!(
            filters.remember_name(&root, OsStr::new("late.sock"), Entry::Socket),
            Ok(true)
        ));
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
