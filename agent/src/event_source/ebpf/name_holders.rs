//! Which watched directories hold an entry carrying each name the kernel matches removals by,
//! and the ids of the names that are directories.
//!
//! The kernel's table keys the names; this says when one may leave it (no watched directory holds
//! it any more) and whether an announcement is new in its directory (see
//! [`crate::event_source::EventSource::entry_present`]). A name's first holder is in the kernel's
//! own entry for it ([`NameHolder::dir`], which the programs do not read), so userspace keeps no
//! copy of the names: a burst of 10,000 plugins keeps 10,000 in the kernel's table and none here.
//! Before, userspace kept a row per name (a 22-byte inline name, the directory, the id): 0.54 MB
//! at 10,000 plugins, the one table an eBPF agent kept that a fanotify agent does not, bought
//! back with a map lookup (one `bpf` syscall) per name a walk announces that the table may hold
//! already (a new name announced alone is still one insertion: see `Filters::remember_name`; a
//! start's first walk looks nothing up: see `Fresh` there) and per removal of a name shared or
//! a directory's. What stays here is what is rare: the other directories holding a name
//! (`csi.sock` in every driver's directory) and the names of directories by id.
//!
//! A socket's name no other directory holds leaves the table by one deletion, without looking
//! its entry up first: its only holder is the kernel entry's, the directory letting go (see
//! [`NameHolders::release`]). A churn's removals were a lookup and a deletion each.

use std::collections::HashMap;

use agent_ebpf::{DirKey, NameHolder, NameKey};
use aya::maps::{HashMap as BpfHashMap, MapData};

/// The kernel's name table, as this module uses it.
pub type NameTable = BpfHashMap<MapData, NameKey, NameHolder>;

/// A watched directory's index: 4 bytes in every kernel entry instead of its 16-byte kernel
/// identity. Indices are never reused, so an entry left behind by a directory that was unwatched
/// cannot be taken for one of a directory watched later.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DirIndex(u32);

impl DirIndex {
    /// No directory's: indices start at 1.
    pub const NONE: DirIndex = DirIndex(0);
}

/// A name in the table: whether it was new in the directory announcing it, and its entry.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Held {
    /// The directory had no entry so named before.
    pub new_here: bool,
    /// The kernel's entry for the name, as it was before (`hold` changes only userspace's side).
    pub entry: NameHolder,
}

/// See the module documentation.
#[derive(Default)]
pub struct NameHolders {
    /// The directories other than the kernel entry's [`NameHolder::dir`] holding a name.
    also_in: HashMap<Box<[u8]>, Vec<DirIndex>>,
    /// Directory names only: a record names its path's parent component, never a socket.
    by_id: HashMap<u32, Box<[u8]>>,
    /// The names `by_id` holds, to tell a directory's name from a socket's without a lookup.
    ids: HashMap<Box<[u8]>, u32>,
    dirs: HashMap<DirKey, DirIndex>,
    next_dir: u32,
}

/// The kernel's entry for `key`. A lookup that fails for another reason than an absent key
/// counts as absent: the insertion that follows fails too, and the table is emptied and refilled
/// by a rescan (see `Filters`).
fn holder(table: &NameTable, key: &NameKey) -> Option<NameHolder> {
    table.get(key, 0).ok()
}

impl NameHolders {
    /// The index of the directory with kernel identity `key`, given on first use.
    pub fn dir(&mut self, key: DirKey) -> DirIndex {
        let next = &mut self.next_dir;
        *self.dirs.entry(key).or_insert_with(|| {
            *next = next.wrapping_add(1).max(1);
            DirIndex(*next)
        })
    }

    /// The index of the directory `key` if it has one; [`DirIndex::NONE`] (which holds nothing)
    /// if not.
    pub fn known_dir(&self, key: &DirKey) -> DirIndex {
        self.dirs.get(key).copied().unwrap_or(DirIndex::NONE)
    }

    /// The directory `key` is no longer watched: its index goes (see [`DirIndex`]).
    pub fn unwatched(&mut self, key: &DirKey) {
        self.dirs.remove(key);
        crate::memory::shrink_if_sparse(&mut self.dirs);
    }

    /// Records that `dir` holds an entry called `name` (`key`), when the table has the name.
    /// `None`: it has not ([`new_holder`](Self::new_holder) gives the entry to insert).
    pub fn hold(
        &mut self,
        table: &NameTable,
        key: &NameKey,
        name: &[u8],
        dir: DirIndex,
    ) -> Option<Held> {
        let holder = holder(table, key)?;
        let held = |new_here| Held {
            new_here,
            entry: holder,
        };
        if holder.dir == dir.0 {
            return Some(held(false));
        }
        if let Some(others) = self.also_in.get_mut(name) {
            if others.contains(&dir) {
                return Some(held(false));
            }
            others.push(dir);
            return Some(held(true));
        }
        self.also_in.insert(name.into(), vec![dir]);
        Some(held(true))
    }

    /// The kernel entry for a name new to the table, held in `dir`, with `id` (0: none). Insert
    /// it, then tell [`named`](Self::named) when the id is not 0.
    pub fn new_holder(dir: DirIndex, id: u32) -> NameHolder {
        NameHolder { id, dir: dir.0 }
    }

    /// The name `name` in the table has the id `id` now.
    pub fn named(&mut self, name: &[u8], id: u32) {
        if let Some(previous) = self.by_id.insert(id, name.into()) {
            self.ids.remove(&previous);
        }
        self.ids.insert(name.into(), id);
    }

    /// `dir` no longer holds `name` (`key`). The name leaves the kernel's table when no watched
    /// directory holds it any more (then true); another holder takes the entry's place when it
    /// was the entry's.
    ///
    /// A socket's name that no other directory holds is deleted without a lookup: `dir` holds
    /// it, so the kernel entry is `dir`'s. (`dir` holds every name the watcher takes back in it
    /// but one whose announcement was not kept, and the table is then marked incomplete, which
    /// has the kernel place removals by their parent directory's name: a name deleted that way
    /// while another directory held it loses no removal.)
    pub fn release(
        &mut self,
        table: &mut NameTable,
        key: &NameKey,
        name: &[u8],
        dir: DirIndex,
    ) -> bool {
        if dir == DirIndex::NONE {
            // An index is given on a directory's first announcement: this one holds nothing.
            return false;
        }
        if !self.also_in.contains_key(name) && !self.ids.contains_key(name) {
            // Absent keys are fine (`ENOENT`: not in the table).
            return table.remove(key).is_ok();
        }
        let Some(mut holder) = holder(table, key) else {
            return false;
        };
        let Some(others) = self.also_in.get_mut(name) else {
            if holder.dir != dir.0 {
                // Not held in `dir`: nothing changes.
                return false;
            }
            // Absent keys are fine: the lookup and the removal are both under the caller's lock,
            // so only a kernel error leaves the name, which then over-reports.
            let removed = table.remove(key).is_ok();
            if holder.id != 0
                && let Some(name) = self.by_id.remove(&holder.id)
            {
                self.ids.remove(&name);
                crate::memory::shrink_if_sparse(&mut self.by_id);
                crate::memory::shrink_if_sparse(&mut self.ids);
            }
            return removed;
        };
        if holder.dir == dir.0 {
            if let Some(next) = others.pop() {
                holder.dir = next.0;
                // A failed overwrite leaves the old holder, which keeps the name over-reported
                // until that directory's entry goes.
                let _ = table.insert(key, holder, 0);
            }
        } else {
            others.retain(|other| *other != dir);
        }
        if others.is_empty() {
            self.also_in.remove(name);
        }
        false
    }

    /// The name the id `id` stands for.
    pub fn name_of(&self, id: u32) -> Option<&[u8]> {
        self.by_id.get(&id).map(|name| &name[..])
    }

    /// Forgets every name (the kernel's table was emptied); directories keep their indices.
    pub fn clear(&mut self) {
        self.also_in = HashMap::new();
        self.by_id = HashMap::new();
        self.ids = HashMap::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_source::ebpf::batched::tests::name_table;

    fn key(ino: u64) -> DirKey {
        DirKey { dev: 1, ino }
    }

    fn name(name: &str) -> (NameKey, &[u8]) {
        (
            NameKey::new(name.as_bytes()).expect("a valid name"),
            name.as_bytes(),
        )
    }

    /// Inserts a name new to the table, as `Filters` does.
    fn insert(
        table: &mut NameTable,
        holders: &mut NameHolders,
        name: &str,
        dir: DirIndex,
        id: u32,
    ) {
        let (key, bytes) = self::name(name);
        table
            .insert(key, NameHolders::new_holder(dir, id), 0)
            .expect("room in the table");
        if id != 0 {
            holders.named(bytes, id);
        }
    }

    fn hold(
        table: &NameTable,
        holders: &mut NameHolders,
        name: &str,
        dir: DirIndex,
    ) -> Option<bool> {
        let (key, bytes) = self::name(name);
        holders
            .hold(table, &key, bytes, dir)
            .map(|held| held.new_here)
    }

    fn release(
        table: &mut NameTable,
        holders: &mut NameHolders,
        name: &str,
        dir: DirIndex,
    ) -> bool {
        let (key, bytes) = self::name(name);
        holders.release(table, &key, bytes, dir);
        table.get(&key, 0).is_ok()
    }

    #[test]
    fn the_kernel_entry_is_the_first_holder_and_the_only_copy_of_the_name() {
        let Some(mut table) = name_table(16) else {
            return;
        };
        let mut holders = NameHolders::default();
        let dir = holders.dir(key(1));
        let long = "ebs.csi.aws.com-reg.sock";
        assert_eq!(hold(&table, &mut holders, long, dir), None);
        insert(&mut table, &mut holders, long, dir, 0);
        assert_eq!(hold(&table, &mut holders, long, dir), Some(false));
        let (name_key, _) = name(long);
        assert_eq!(
            table.get(&name_key, 0).ok(),
            Some(NameHolder { id: 0, dir: 1 })
        );
        assert!(holders.also_in.is_empty() && holders.by_id.is_empty());
    }

    #[test]
    fn a_name_leaves_when_the_last_directory_holding_it_lets_go() {
        let Some(mut table) = name_table(16) else {
            return;
        };
        let mut holders = NameHolders::default();
        let (a, b, c) = (
            holders.dir(key(1)),
            holders.dir(key(2)),
            holders.dir(key(3)),
        );
        let (t, h) = (&mut table, &mut holders);
        insert(t, h, "csi.sock", a, 0);
        assert_eq!(hold(t, h, "csi.sock", b), Some(true));
        assert_eq!(hold(t, h, "csi.sock", c), Some(true));
        assert_eq!(hold(t, h, "csi.sock", b), Some(false));
        // The first holder goes first: another takes its place in the kernel's entry.
        assert!(release(t, h, "csi.sock", a));
        assert_ne!(t.get(&name("csi.sock").0, 0).map(|e| e.dir).ok(), Some(a.0));
        assert_eq!(hold(t, h, "csi.sock", a), Some(true));
        assert!(release(t, h, "csi.sock", a));
        // A directory that does not hold the name changes nothing.
        assert!(release(t, h, "csi.sock", a));
        assert!(release(t, h, "csi.sock", c));
        assert_eq!(hold(t, h, "csi.sock", b), Some(false));
        assert!(
            !release(t, h, "csi.sock", b),
            "the last holder takes the name out"
        );
        assert_eq!(hold(t, h, "csi.sock", b), None);
        assert!(h.also_in.is_empty());
        // Unknown names are not held anywhere.
        assert!(!release(t, h, "never.sock", b));
    }

    #[test]
    fn ids_name_directories_until_they_leave() {
        let Some(mut table) = name_table(16) else {
            return;
        };
        let mut holders = NameHolders::default();
        let a = holders.dir(key(1));
        let (t, h) = (&mut table, &mut holders);
        insert(t, h, "driver", a, 7);
        let (driver, _) = name("driver");
        assert_eq!(
            h.hold(t, &driver, b"driver", a),
            Some(Held {
                new_here: false,
                entry: NameHolder { id: 7, dir: a.0 }
            })
        );
        assert_eq!(h.name_of(7), Some(b"driver".as_slice()));
        assert!(!release(t, h, "driver", a));
        assert_eq!(h.name_of(7), None);
        assert!(
            h.ids.is_empty(),
            "a directory's name is forgotten with its id"
        );
        insert(t, h, "other", a, 8);
        h.clear();
        assert_eq!(h.name_of(8), None);
        assert_eq!(h.dir(key(1)), a, "a watched directory keeps its index");
    }

    /// A socket's name held by one directory goes in one deletion (no lookup): the kernel
    /// entry is that directory's. A directory that never announced anything holds nothing.
    #[test]
    fn a_sole_holder_lets_go_of_its_name() {
        let Some(mut table) = name_table(16) else {
            return;
        };
        let mut holders = NameHolders::default();
        let (a, b) = (holders.dir(key(1)), holders.dir(key(2)));
        let (t, h) = (&mut table, &mut holders);
        insert(t, h, "p.sock", a, 0);
        assert!(
            release(t, h, "p.sock", DirIndex::NONE),
            "no directory's index: stays"
        );
        assert!(!release(t, h, "p.sock", a), "its one holder takes it out");
        assert!(!release(t, h, "p.sock", a), "gone: nothing to take out");
        // Shared, it leaves with its last holder, whichever went first.
        insert(t, h, "q.sock", a, 0);
        assert_eq!(hold(t, h, "q.sock", b), Some(true));
        assert!(release(t, h, "q.sock", a));
        assert!(!release(t, h, "q.sock", b));
    }

    #[test]
    fn a_directory_watched_again_is_a_new_holder() {
        let Some(mut table) = name_table(16) else {
            return;
        };
        let mut holders = NameHolders::default();
        let first = holders.dir(key(1));
        let (t, h) = (&mut table, &mut holders);
        insert(t, h, "p.sock", first, 0);
        h.unwatched(&key(1));
        assert_eq!(h.known_dir(&key(1)), DirIndex::NONE);
        assert!(
            release(t, h, "p.sock", DirIndex::NONE),
            "held elsewhere: stays"
        );
        let again = h.dir(key(1));
        assert_ne!(first, again);
        assert_eq!(hold(t, h, "p.sock", again), Some(true));
    }
}
