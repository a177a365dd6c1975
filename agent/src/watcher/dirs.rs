//! The watched-directory set: by path for the lookups every hint makes (its parent's, to
//! announce its name to the source), and in path order for a directory's subtree.
//!
//! A `BTreeMap` keyed by path was both, but each of its lookups compared paths component by
//! component (~500 instructions a lookup, three per new plugin); the hashed lookup is a tenth of
//! that, and the order is kept beside it for what needs it (a removed directory's subtree, the
//! walk's and the name hints' passes over every directory), sharing each path's allocation.

use crate::event_source::WatchedDir;
use crate::state::PathMap;
use std::collections::BTreeSet;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// See the module docs.
#[derive(Default)]
pub(super) struct WatchedDirs {
    by_path: PathMap<Arc<Path>, WatchedDir>,
    /// The same paths, in path order (component by component): a directory's subtree is one
    /// contiguous range.
    ordered: BTreeSet<Arc<Path>>,
}

impl WatchedDirs {
    pub(super) fn get(&self, path: &Path) -> Option<&WatchedDir> {
        self.by_path.get(path)
    }

    pub(super) fn contains_key(&self, path: &Path) -> bool {
        self.by_path.contains_key(path)
    }

    /// Watches `path` as `dir`; returns what it was watched as before.
    pub(super) fn insert(&mut self, path: &Path, dir: WatchedDir) -> Option<WatchedDir> {
        if let Some(old) = self.by_path.get_mut(path) {
            return Some(std::mem::replace(old, dir));
        }
        let path: Arc<Path> = Arc::from(path);
        self.ordered.insert(path.clone());
        self.by_path.insert(path, dir);
        None
    }

    pub(super) fn remove(&mut self, path: &Path) -> Option<WatchedDir> {
        let (path, dir) = self.by_path.remove_entry(path)?;
        self.ordered.remove(&path);
        Some(dir)
    }

    pub(super) fn len(&self) -> usize {
        self.by_path.len()
    }

    /// Every watched path, in path order.
    pub(super) fn keys(&self) -> impl Iterator<Item = &Path> {
        self.ordered.iter().map(|path| &**path)
    }

    /// `dir` and every watched directory below it.
    pub(super) fn subtree(&self, dir: &Path) -> Vec<PathBuf> {
        self.ordered
            .range::<Path, _>((Bound::Included(dir), Bound::Unbounded))
            .take_while(|path| path.starts_with(dir))
            .map(|path| path.to_path_buf())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watched(ino: u64) -> WatchedDir {
        WatchedDir {
            path: PathBuf::new(),
            dev: 1,
            ino,
        }
    }

    #[test]
    fn a_subtree_is_the_directory_and_what_is_below_it_in_path_order() {
        let mut dirs = WatchedDirs::default();
        for (ino, path) in [
            "/r", "/r/a", "/r/a-b", "/r/a/x", "/r/a/x/y", "/r/ab", "/r/b",
        ]
        .iter()
        .enumerate()
        {
            assert_eq!(dirs.insert(Path::new(path), watched(ino as u64)), None);
        }
        assert_eq!(
            dirs.subtree(Path::new("/r/a")),
            [
                PathBuf::from("/r/a"),
                PathBuf::from("/r/a/x"),
                PathBuf::from("/r/a/x/y")
            ]
        );
        assert!(dirs.subtree(Path::new("/r/c")).is_empty());
        // Watched again under another identity: one entry, the new identity.
        assert_eq!(dirs.insert(Path::new("/r/a"), watched(9)), Some(watched(1)));
        assert_eq!(dirs.get(Path::new("/r/a")), Some(&watched(9)));
        assert_eq!(dirs.len(), 7);
        assert_eq!(dirs.remove(Path::new("/r/a")), Some(watched(9)));
        assert!(!dirs.contains_key(Path::new("/r/a")));
        assert_eq!(dirs.keys().count(), 6);
        assert!(dirs.keys().is_sorted());
    }
}
