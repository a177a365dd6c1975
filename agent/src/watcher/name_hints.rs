//! The name hints of one batch (an entry a source could name but not place), gathered by the
//! watcher's loop and checked together by `Watcher::check_names` (in `names.rs`): a leaf both the
//! loop (`mod.rs`) and the check import, so neither imports the other for it.

use crate::event_source::Observed;
use std::collections::HashMap;
use std::ffi::OsString;
use std::path::Path;

/// The name hints of one batch: names the source placed in a directory of a known name, by that
/// name, and names that may be in any watched directory; each with what its latest hint recorded
/// (when, and by whom). A hint keeps its own: two sockets moved in by two processes in one batch
/// each keep their creator (and their removal's timestamp), not the batch's first hint's, and so
/// does `csi.sock` moved into two drivers' directories.
#[derive(Default)]
pub(super) struct NameHints {
    pub(super) in_dirs_named: HashMap<OsString, HashMap<OsString, Observed>>,
    pub(super) anywhere: HashMap<OsString, Observed>,
}

impl NameHints {
    pub(super) fn add(&mut self, name: OsString, parent: Option<OsString>, observed: Observed) {
        // The latest: the look that follows sees the state the latest change left.
        match parent {
            Some(parent) => {
                self.in_dirs_named
                    .entry(parent)
                    .or_default()
                    .insert(name, observed);
            }
            None => {
                self.anywhere.insert(name, observed);
            }
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.in_dirs_named.is_empty() && self.anywhere.is_empty()
    }

    /// What the latest hint naming `path` said of its change: one with `path`'s parent directory's
    /// name, else one without a parent (nothing for a path no hint named).
    pub(super) fn observed_for(&self, path: &Path) -> Observed {
        let Some(name) = path.file_name() else {
            return Observed::default();
        };
        path.parent()
            .and_then(Path::file_name)
            .and_then(|parent| self.in_dirs_named.get(parent))
            .and_then(|names| names.get(name))
            .or_else(|| self.anywhere.get(name))
            .copied()
            .unwrap_or_default()
    }
}
