//! Userspace's half of the name table: which watched directories hold an entry carrying each
//! name the kernel matches removals by, and the ids of the names that are directories.
//!
//! The kernel's map keys the names; this says when one may leave it (no watched directory holds
//! it any more) and whether an announcement is new in its directory (see
//! [`crate::event_source::EventSource::entry_present`]). It holds one row per name in the tree, so
//! a burst of 10,000 plugins keeps 10,000 here for as long as their sockets exist, and the row is
//! what that costs: 32 bytes (a name up to 22 bytes inline, a directory as a 4-byte index, an id),
//! 33 with the table's control byte. Before, a row carried the name in a 32-byte inline buffer and
//! the directory's 16-byte kernel identity in a one-element small vector: 65 bytes, 1.06 MB at
//! 10,000 plugins, the one table an eBPF agent keeps that a fanotify agent does not.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use agent_ebpf::DirKey;

/// A name's bytes: inline up to [`Name::INLINE`] (socket names almost always fit), boxed beyond.
/// 24 bytes either way.
#[derive(Clone)]
enum Name {
    Inline { len: u8, bytes: [u8; Name::INLINE] },
    Boxed(Box<[u8]>),
}

impl Name {
    const INLINE: usize = 22;

    fn new(name: &[u8]) -> Name {
        match u8::try_from(name.len()) {
            Ok(len) if name.len() <= Name::INLINE => {
                let mut bytes = [0; Name::INLINE];
                bytes[..name.len()].copy_from_slice(name);
                Name::Inline { len, bytes }
            }
            _ => Name::Boxed(name.into()),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            Name::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Name::Boxed(bytes) => bytes,
        }
    }
}

// Hashing and equality are the bytes', so a table keyed by `Name` is looked up by `&[u8]`.
impl Hash for Name {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Name) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Name {}

impl Borrow<[u8]> for Name {
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

/// Where a name is held: one watched directory (almost always; the others, for a name such as
/// `csi.sock` in every driver's directory, are in [`NameHolders::also_in`]) and its id, 0 until a
/// directory carries the name (a socket is never a path's parent, so its name needs no id).
#[derive(Clone, Copy)]
struct Holder {
    dir: DirIndex,
    id: u32,
}

/// A watched directory's index in this table: 4 bytes in every row instead of its 16-byte kernel
/// identity. Indices are never reused, so a row left behind by a directory that was unwatched
/// cannot be taken for one of a directory watched later.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DirIndex(u32);

impl DirIndex {
    /// No directory's: indices start at 1.
    pub const NONE: DirIndex = DirIndex(0);
}

/// See the module documentation.
#[derive(Default)]
pub struct NameHolders {
    holders: HashMap<Name, Holder>,
    /// The directories other than its [`Holder::dir`] holding a name.
    also_in: HashMap<Name, Vec<DirIndex>>,
    /// Directory names only: a record names its path's parent component, never a socket.
    by_id: HashMap<u32, Name>,
    dirs: HashMap<DirKey, DirIndex>,
    next_dir: u32,
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

    /// Records that `dir` holds an entry called `name`, when the name is known: whether it was
    /// new in `dir`. `None`: the name is not in the table ([`insert`](Self::insert) it).
    pub fn hold(&mut self, name: &[u8], dir: DirIndex) -> Option<bool> {
        let holder = self.holders.get(name)?;
        if holder.dir == dir {
            return Some(false);
        }
        if let Some(others) = self.also_in.get_mut(name) {
            if others.contains(&dir) {
                return Some(false);
            }
            others.push(dir);
            return Some(true);
        }
        self.also_in.insert(Name::new(name), vec![dir]);
        Some(true)
    }

    /// A name new to the table, held in `dir`, with `id` (0: none).
    pub fn insert(&mut self, name: &[u8], dir: DirIndex, id: u32) {
        self.holders.insert(Name::new(name), Holder { dir, id });
        if id != 0 {
            self.by_id.insert(id, Name::new(name));
        }
    }

    /// The id of a known `name` (0: none yet).
    pub fn id(&self, name: &[u8]) -> u32 {
        self.holders.get(name).map_or(0, |holder| holder.id)
    }

    /// Gives a known `name` the id `id`.
    pub fn set_id(&mut self, name: &[u8], id: u32) {
        if let Some(holder) = self.holders.get_mut(name) {
            holder.id = id;
            self.by_id.insert(id, Name::new(name));
        }
    }

    /// `dir` no longer holds `name`. True when another watched directory still does (the name
    /// stays in the kernel's table); false when none does, and the name is no longer known here.
    pub fn release(&mut self, name: &[u8], dir: DirIndex) -> bool {
        let Some(holder) = self.holders.get_mut(name) else {
            return false;
        };
        let Some(others) = self.also_in.get_mut(name) else {
            if holder.dir != dir {
                // Not held in `dir`: nothing changes.
                return true;
            }
            let id = holder.id;
            self.holders.remove(name);
            if id != 0 {
                self.by_id.remove(&id);
            }
            crate::memory::shrink_if_sparse(&mut self.holders);
            crate::memory::shrink_if_sparse(&mut self.by_id);
            return false;
        };
        if holder.dir == dir {
            if let Some(next) = others.pop() {
                holder.dir = next;
            }
        } else {
            others.retain(|other| *other != dir);
        }
        if others.is_empty() {
            self.also_in.remove(name);
        }
        true
    }

    /// The name the id `id` stands for.
    pub fn name_of(&self, id: u32) -> Option<&[u8]> {
        self.by_id.get(&id).map(Name::as_bytes)
    }

    /// Forgets every name (the kernel's table was emptied); directories keep their indices.
    pub fn clear(&mut self) {
        self.holders = HashMap::new();
        self.also_in = HashMap::new();
        self.by_id = HashMap::new();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.holders.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ino: u64) -> DirKey {
        DirKey { dev: 1, ino }
    }

    #[test]
    fn a_row_is_32_bytes_and_a_name_24() {
        assert_eq!(std::mem::size_of::<Name>(), 24);
        assert_eq!(std::mem::size_of::<(Name, Holder)>(), 32);
    }

    #[test]
    fn names_inline_and_boxed_compare_and_hash_as_their_bytes() {
        let mut holders = NameHolders::default();
        let dir = holders.dir(key(1));
        let short = b"p-1.sock".as_slice();
        let exact = [b'x'; Name::INLINE];
        let long = b"ebs.csi.aws.com-reg.sock".as_slice();
        for name in [short, &exact, long] {
            assert_eq!(Name::new(name).as_bytes(), name);
            assert_eq!(holders.hold(name, dir), None);
            holders.insert(name, dir, 0);
            assert_eq!(holders.hold(name, dir), Some(false));
        }
        assert!(matches!(Name::new(&exact), Name::Inline { .. }));
        assert!(matches!(Name::new(long), Name::Boxed(_)));
        assert_eq!(holders.len(), 3);
    }

    #[test]
    fn a_name_leaves_when_the_last_directory_holding_it_lets_go() {
        let mut holders = NameHolders::default();
        let (a, b, c) = (
            holders.dir(key(1)),
            holders.dir(key(2)),
            holders.dir(key(3)),
        );
        holders.insert(b"csi.sock", a, 0);
        assert_eq!(holders.hold(b"csi.sock", b), Some(true));
        assert_eq!(holders.hold(b"csi.sock", c), Some(true));
        assert_eq!(holders.hold(b"csi.sock", b), Some(false));
        // The first holder goes first: another takes its place.
        assert!(holders.release(b"csi.sock", a));
        assert_eq!(holders.hold(b"csi.sock", a), Some(true));
        assert!(holders.release(b"csi.sock", a));
        // A directory that does not hold the name changes nothing.
        assert!(holders.release(b"csi.sock", a));
        assert!(holders.release(b"csi.sock", c));
        assert_eq!(holders.hold(b"csi.sock", b), Some(false));
        assert!(!holders.release(b"csi.sock", b));
        assert_eq!(holders.hold(b"csi.sock", b), None);
        assert!(holders.also_in.is_empty());
        // Unknown names are not held anywhere.
        assert!(!holders.release(b"never.sock", b));
    }

    #[test]
    fn ids_name_directories_until_they_leave() {
        let mut holders = NameHolders::default();
        let a = holders.dir(key(1));
        holders.insert(b"driver", a, 7);
        holders.insert(b"p.sock", a, 0);
        assert_eq!(holders.id(b"p.sock"), 0);
        holders.set_id(b"p.sock", 8);
        assert_eq!(holders.name_of(7), Some(b"driver".as_slice()));
        assert_eq!(holders.name_of(8), Some(b"p.sock".as_slice()));
        assert!(!holders.release(b"driver", a));
        assert_eq!(holders.name_of(7), None);
        holders.clear();
        assert_eq!(holders.name_of(8), None);
        assert_eq!(
            holders.dir(key(1)),
            a,
            "a watched directory keeps its index"
        );
    }

    #[test]
    fn a_directory_watched_again_is_a_new_holder() {
        let mut holders = NameHolders::default();
        let first = holders.dir(key(1));
        holders.insert(b"p.sock", first, 0);
        holders.unwatched(&key(1));
        assert_eq!(holders.known_dir(&key(1)), DirIndex::NONE);
        assert!(
            holders.release(b"p.sock", DirIndex::NONE),
            "held elsewhere: stays"
        );
        let again = holders.dir(key(1));
        assert_ne!(first, again);
        assert_eq!(holders.hold(b"p.sock", again), Some(true));
    }
}
