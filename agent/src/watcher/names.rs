//! Name hints: an entry a source could name but not place (an eBPF tracepoint saw a path it
//! cannot resolve in the kernel), checked against the tree at a cost linear in it.
//!
//! A hint that carries its parent directory's name is checked only in the watched directories so
//! named. Hints without one are gathered per batch and checked together (see
//! [`Watcher::check_names`]).

use super::Watcher;
use super::name_hints::NameHints;
use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Up to this many distinct name hints in a batch are checked by `stat` in every watched
/// directory; more, by one read of each directory (see `Watcher::check_names`).
const FEW_NAMES: usize = 4;

impl Watcher {
    /// Each of `names` changed in some watched directory, which the source could not name.
    ///
    /// A name whose parent directory's name the source knows is checked only in the watched
    /// directories so named: one `stat` each, usually one in all. The others may be anywhere. A
    /// few of those are checked by one `stat` per watched directory each; many, by reading every
    /// watched directory once and looking at the entries with those names, plus every known socket
    /// or directory with those names (which may be gone). Either way the cost is linear in the
    /// tree, where a `stat` per name and directory would be quadratic (a thousand new directories
    /// by absolute path: a million `stat` calls).
    pub(super) fn check_names(&mut self, names: &NameHints) {
        // The anchor too: the name may be the root's own.
        let dirs: Vec<PathBuf> = self
            .dirs
            .keys()
            .chain(self.anchor.iter().map(|a| a.path.as_path()))
            .map(Path::to_path_buf)
            .collect();
        let mut candidates: Vec<PathBuf> = Vec::new();
        for dir in &dirs {
            if let Some(parents) = dir.file_name().and_then(|n| names.in_dirs_named.get(n)) {
                candidates.extend(parents.keys().map(|name| dir.join(name)));
            }
        }
        let anywhere: Vec<&OsString> = names
            .anywhere
            .keys()
            .filter(|name| !name.as_bytes().contains(&b'/'))
            .collect();
        if anywhere.len() <= FEW_NAMES {
            for name in anywhere {
                candidates.extend(dirs.iter().map(|dir| dir.join(name)));
            }
        } else {
            candidates.extend(self.entries_named(&anywhere, &dirs));
        }
        // By bytes: `Path`'s order compares component by component (7,000-15,000 instructions
        // a removal in a batch of 1,000); any order will do, equal paths only need to meet.
        candidates.sort_unstable_by(|a, b| a.as_os_str().cmp(b.as_os_str()));
        candidates.dedup();
        for path in candidates {
            let observed = names.observed_for(&path);
            self.check(&path, observed);
        }
    }

    /// Every path in `dirs` with one of `names`, and every known one (which may be gone).
    fn entries_named(&self, names: &[&OsString], dirs: &[PathBuf]) -> Vec<PathBuf> {
        let wanted: HashSet<&OsStr> = names.iter().map(|name| name.as_os_str()).collect();
        let has_wanted_name =
            |path: &Path| path.file_name().is_some_and(|name| wanted.contains(name));
        let mut found: Vec<PathBuf> = self.desired.paths_where(has_wanted_name);
        found.extend(
            self.dirs
                .keys()
                .filter(|path| has_wanted_name(path))
                .map(Path::to_path_buf),
        );
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(dir) else {
                // Gone or unreadable: its own event or the next rescan settles it.
                continue;
            };
            found.extend(
                entries
                    .flatten()
                    .filter(|entry| wanted.contains(entry.file_name().as_os_str()))
                    .map(|entry| entry.path()),
            );
        }
        found
    }
}
