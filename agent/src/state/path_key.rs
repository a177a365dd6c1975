//! Socket paths as table keys, hashed in one write of their bytes.
//!
//! std hashes a `Path` component by component (a loop over its bytes looking for separators,
//! and one write per component, so that `/a//b` and `/a/b`, equal paths, hash alike): ~400
//! instructions for a plugin's socket path, and a registration looked paths up in the tables
//! some 25 times, and more when a table grew in a burst (each growth hashes every key again).
//! Here a path hashes as the bytes of its plain form (components joined by one `/`), in one
//! write: a path as the agent builds them (a watched directory joined with a name) is plain
//! already, which one pass over its bytes tells; any other is made plain first. Equality stays
//! `Path`'s, component by component (byte-equal paths compare in one `memcmp`), so a lookup
//! finds exactly what it found before.
//!
//! [`PathMap`] is the map of the tables keyed by socket path alone; [`ByPath`] and
//! [`BySocket`] look keys up by a borrowed path (and a socket), without a copy.

use super::{PathHasher, SocketId};
use hashbrown::Equivalent;
use std::hash::{Hash, Hasher};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

/// A socket path as a table key (`Arc<Path>` or `PathBuf`): equal as paths are, hashed by
/// [`hash_path`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PathKey<P>(pub P);

impl<P: AsRef<Path>> Hash for PathKey<P> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        hash_path(self.0.as_ref(), state);
    }
}

/// Looks a [`PathKey`] up by a borrowed path.
#[derive(Debug, Clone, Copy)]
pub struct ByPath<'a>(pub &'a Path);

impl Hash for ByPath<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        hash_path(self.0, state);
    }
}

impl<P: AsRef<Path>> Equivalent<PathKey<P>> for ByPath<'_> {
    fn equivalent(&self, key: &PathKey<P>) -> bool {
        self.0 == key.0.as_ref()
    }
}

/// Looks a `(PathKey, SocketId)` key up by a borrowed path and a socket: hashed as the tuple is
/// (its fields in order).
#[derive(Debug, Clone, Copy)]
pub struct BySocket<'a>(pub &'a Path, pub SocketId);

impl Hash for BySocket<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        hash_path(self.0, state);
        self.1.hash(state);
    }
}

impl<P: AsRef<Path>> Equivalent<(PathKey<P>, SocketId)> for BySocket<'_> {
    fn equivalent(&self, key: &(PathKey<P>, SocketId)) -> bool {
        self.1 == key.1 && self.0 == key.0.0.as_ref()
    }
}

/// Feeds `path` to `state` as the bytes of its plain form, in one write: equal paths (as
/// `Path`s compare, component by component) hash alike.
pub fn hash_path<H: Hasher>(path: &Path, state: &mut H) {
    let bytes = path.as_os_str().as_bytes();
    if is_plain(bytes) {
        state.write(bytes);
    } else {
        let plain: PathBuf = path.components().collect();
        state.write(plain.as_os_str().as_bytes());
    }
}

/// Whether `bytes` is a path's plain form, what its components joined by one `/` give back: no
/// empty component (`//`, a trailing `/`), and no `.` component but a first one (which
/// `Path::components` keeps). Any name starting with `.` after a `/` counts as not plain: such
/// a path is made plain the slow way, which gives the same bytes. One pass, no branch per byte.
fn is_plain(bytes: &[u8]) -> bool {
    let Some((_, rest)) = bytes.split_first() else {
        return true;
    };
    let odd = bytes.iter().zip(rest).fold(false, |odd, (a, b)| {
        odd | ((*a == b'/') & ((*b == b'/') | (*b == b'.')))
    });
    !odd && rest.last() != Some(&b'/')
}

/// A map keyed by socket path ([`PathKey`] over `K`, `Arc<Path>` or `PathBuf`), looked up by
/// `&Path`; its keys are handed out as `K`.
#[derive(Debug, Clone)]
pub struct PathMap<K, V> {
    map: hashbrown::HashMap<PathKey<K>, V, PathHasher>,
}

impl<K, V> Default for PathMap<K, V> {
    fn default() -> Self {
        PathMap {
            map: hashbrown::HashMap::with_hasher(PathHasher::default()),
        }
    }
}

impl<K: AsRef<Path> + Eq, V> PathMap<K, V> {
    pub fn get(&self, path: &Path) -> Option<&V> {
        self.map.get(&ByPath(path))
    }

    pub fn get_mut(&mut self, path: &Path) -> Option<&mut V> {
        self.map.get_mut(&ByPath(path))
    }

    pub fn get_key_value(&self, path: &Path) -> Option<(&K, &V)> {
        self.map
            .get_key_value(&ByPath(path))
            .map(|(k, v)| (&k.0, v))
    }

    pub fn contains_key(&self, path: &Path) -> bool {
        self.map.contains_key(&ByPath(path))
    }

    /// Puts `value` in at `key`; an entry there before keeps its key, and its value is returned.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.map.insert(PathKey(key), value)
    }

    pub fn remove(&mut self, path: &Path) -> Option<V> {
        self.remove_entry(path).map(|(_, v)| v)
    }

    pub fn remove_entry(&mut self, path: &Path) -> Option<(K, V)> {
        // As `get` does: an empty map has nothing to hash the path for.
        if self.map.is_empty() {
            return None;
        }
        self.map.remove_entry(&ByPath(path)).map(|(k, v)| (k.0, v))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.map.iter().map(|(k, v)| (&k.0, v))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&K, &mut V)> {
        self.map.iter_mut().map(|(k, v)| (&k.0, v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.map.keys().map(|k| &k.0)
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        self.map.retain(|k, v| keep(&k.0, v));
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.map.capacity()
    }

    /// Gives the map's spare room back after a burst of removals (as
    /// [`crate::memory::shrink_if_sparse`]).
    pub fn shrink_if_sparse(&mut self) {
        if self.map.capacity() > crate::memory::SHRINK_ABOVE
            && self.map.capacity() > 4 * self.map.len()
        {
            self.map.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::hash::BuildHasher as _;

    fn hash_of(path: &Path, hasher: &PathHasher) -> u64 {
        hasher.hash_one(ByPath(path))
    }

    #[test]
    fn paths_as_the_agent_builds_them_are_plain_and_odd_ones_are_not() {
        for plain in [
            "",
            "/",
            "/r/a.sock",
            "r/a",
            "./a",
            ".",
            "..",
            "../a",
            "/r/a.b/c",
        ] {
            assert!(is_plain(plain.as_bytes()), "{plain}");
        }
        for odd in [
            "//",
            "/r//a",
            "/r/",
            "/r/./a",
            "/r/.",
            "./",
            "/r/.hidden",
            "a/..",
        ] {
            assert!(!is_plain(odd.as_bytes()), "{odd}");
        }
    }

    #[test]
    fn a_key_is_found_by_any_spelling_of_its_path_and_only_by_it() {
        let mut map: PathMap<PathBuf, u32> = PathMap::default();
        map.insert(PathBuf::from("/r/sub/a.sock"), 1);
        for same in [
            "/r/sub/a.sock",
            "/r//sub/a.sock",
            "/r/./sub/a.sock",
            "/r/sub/a.sock/",
        ] {
            assert_eq!(map.get(Path::new(same)), Some(&1), "{same}");
        }
        for other in [
            "/r/sub/b.sock",
            "/r/a.sock",
            "r/sub/a.sock",
            "/r/sub/../sub/a.sock",
        ] {
            assert_eq!(map.get(Path::new(other)), None, "{other}");
        }
        let (key, _) = map
            .get_key_value(Path::new("/r//sub/a.sock"))
            .expect("found");
        assert_eq!(key.as_os_str(), "/r/sub/a.sock", "the key as it was put in");
    }

    proptest! {
        /// Equal paths (as `Path` compares them) hash alike, and a plain path's hash is that of
        /// its bytes: the fast way and the slow way agree.
        #[test]
        fn equal_paths_hash_alike(a in "[/.ab]{0,12}", b in "[/.ab]{0,12}") {
            let hasher = PathHasher::default();
            let (a, b) = (Path::new(&a), Path::new(&b));
            if a == b {
                prop_assert_eq!(hash_of(a, &hasher), hash_of(b, &hasher));
            }
            if is_plain(a.as_os_str().as_bytes()) {
                let plain: PathBuf = a.components().collect();
                prop_assert_eq!(plain.as_os_str(), a.as_os_str());
            }
        }
    }
}
