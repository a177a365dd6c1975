//! Actual state written through the journal (see `persist`): a registration is recorded as it
//! begins (before the handler's Register) and when it finished, a deregistration takes its
//! entry out as it begins and is recorded when it finished. Without a journal, only actual state
//! is written and nothing outlives the agent.

use crate::persist::Journal;
use crate::provenance::Provenance;
use crate::state::actual::{ActualState, RegisteredPlugin};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use uuid::Uuid;

/// See the module docs.
pub struct Records {
    actual: Arc<ActualState>,
    journal: OnceLock<Arc<Journal>>,
}

impl Records {
    /// Records in `actual` only, until [`Records::keep_journal`].
    pub fn new(actual: Arc<ActualState>) -> Self {
        Records {
            actual,
            journal: OnceLock::new(),
        }
    }

    /// Records operations in `journal` from now on.
    pub fn keep_journal(&self, journal: Arc<Journal>) {
        let _ = self.journal.set(journal);
    }

    /// A registration of `entry` is about to reach its handler: journalled first (if a journal
    /// is kept); an error means it must not go on.
    pub fn begin(&self, path: &Path, entry: &RegisteredPlugin) -> Result<(), String> {
        match self.journal.get() {
            Some(journal) => journal.begin(path, entry),
            None => Ok(()),
        }
    }

    /// The registration `entry` (as [`Records::begin`] was given it) finished: journalled (if a
    /// journal is kept) unless its entry left actual state meanwhile; returns who made and
    /// serves the socket, for its report. (Entries are replaced, never changed in place: the
    /// operation's copy is the recorded entry, and is not copied again.)
    pub fn registered(&self, path: &Path, entry: &RegisteredPlugin) -> Option<Provenance> {
        if !self.actual.is_registered(path, entry.generation) {
            return None;
        }
        if let Some(journal) = self.journal.get() {
            journal.registered(path, entry);
        }
        Some(entry.provenance.clone())
    }

    /// Takes `path`'s registration `generation` out of actual state for its deregistration or
    /// rollback, through the journal when one is kept (its record stays on disk until
    /// [`Records::deregistered`]; see `persist::Journal::take`).
    pub fn take(&self, path: &Path, generation: Uuid) -> Option<RegisteredPlugin> {
        match self.journal.get() {
            Some(journal) => journal.take(path, generation),
            None => self.actual.remove(path, generation),
        }
    }

    /// A deregistration of `path` (the registration of `generation`) finished.
    pub fn deregistered(&self, path: &Path, generation: Uuid) {
        if let Some(journal) = self.journal.get() {
            journal.deregistered(path, generation);
        }
    }
}
