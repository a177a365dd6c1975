//! The actual state on disk, so that a restarted agent knows what it registered.
//!
//! ```text
//! executor: registration begins (before handler Register) --begin-------> Journal --append--> state.journal
//!           registration done (handler Register, Notify)  --registered-->         (one line each)
//!           deregistration or rollback begins             --take--------> (out of actual state)
//!           deregistration or rollback done               --deregistered->
//!           every 1,024+ lines: actual state (held) --compact--> state.json (whole, atomic rename)
//! start: state.json + state.journal --open (format, tree checked)--> Restore --> state::desired +
//!        state::actual, then the watcher's first walk: same socket instance: nothing happens;
//!        gone: deregistered once; replaced: deregistered, then registered; new: registered
//! ```
//!
//! Kubelet keeps its actual state in memory only, so every kubelet restart re-registers every
//! plugin (and, before 1.33, could not deregister what went while it was down). Here the state lives
//! in the runtime directory (`/run/plugin-agent` by default: a tmpfs, so it survives restarts of
//! the agent, not of the node, which restarts the plugins too).
//!
//! A registration is recorded twice. When it begins, before the handler's `Register` (where
//! kubelet adds the plugin to its actual state of the world, for the same reason: a handler may
//! hold it from then on), as *unfinished*: a registration that cannot be recorded fails there,
//! before anyone was told anything, and is retried after its backoff (kubernetes issue 136462:
//! kubelet logged the failure and carried on). When it finished (the handler registered it and
//! the plugin was told), as done. A registration a kill interrupted is in the file unfinished, so
//! the next agent registers it again if its socket is unchanged (a repeated call, which handlers
//! take as a refresh; the plugin hears Notify it may have missed) and deregisters it if the socket
//! went meanwhile (the handler may hold it). A deregistration still running is still in the file,
//! so the next agent deregisters it again. None is ever missed. Each step is one line appended to
//! the journal with a single `write(2)`, before the operation goes on or reports itself done: a
//! SIGKILL right after loses nothing (the page cache has it). The journal is folded into the
//! snapshot, written whole to a temporary file and renamed over the old one, every 1,024 lines (or
//! the number of plugins, now or in the last snapshot, if more), and at exit. The snapshot is
//! written from actual state (held still meanwhile), the one copy of each plugin in memory; the
//! journal keeps only which registration each entry on disk is, and a copy of those whose
//! deregistration is under way (actual state lets go of a plugin as its deregistration begins).
//! Lines are serialized (serde_json, borrowing from actual state) into one buffer reused under the
//! journal's lock; snapshots straight into the file's buffer.
//! A start that read both files whole rewrites nothing (what it did not restore is appended as
//! removed); after a torn or unreadable file it writes them afresh. Anything unreadable (corrupt,
//! another format, another tree) is a warning and today's behaviour: everything found is
//! registered again; a torn last journal line (a kill mid-write) is skipped.

mod files;
mod format;
mod read;
mod restore;

pub use format::FORMAT;
pub use restore::{Restore, RestoreReport, Restored};

use crate::state::PathHasher;
use crate::state::actual::{ActualState, Held, RegisteredPlugin};
use anyhow::Context;
use files::{open_own_file, write_atomically};
use format::{Entry, Line};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use uuid::Uuid;

/// The snapshot's name in the runtime directory; the journal is beside it (`state.journal`).
pub const FILE_NAME: &str = "state.json";

/// Journal lines before the journal is folded into the snapshot: at least this many, and as many
/// as there are entries now or were in the last snapshot, so writing snapshots costs each line a
/// share of one entry's. (With entries now alone, 10,000 deregistrations rewrote a shrinking
/// snapshot at 5,000, 2,500, ... entries left, and every 1,024 lines at the end.)
const COMPACT_AFTER: usize = 1024;

/// What the journal knows of an entry on disk: which registration it is (`done` and `remove`
/// lines must match it) and whether it is unfinished. The entry's contents are actual state's, one
/// copy of each plugin in memory: a snapshot is written from there. Before, the journal kept each
/// entry's JSON besides (~600 bytes a plugin, 6.9 MB of the 22.5 MB in use with 10,000
/// registered, measured with glibc's `malloc_stats`).
struct Recorded {
    generation: Uuid,
    unfinished: bool,
    /// The plugin while its deregistration (or rollback) is under way: actual state no longer
    /// holds it, and a snapshot written before it finishes must (see [`Journal::take`]).
    leaving: Option<Box<RegisteredPlugin>>,
}

/// The snapshot as written (the same fields as [`format::StateFile`]).
#[derive(serde::Serialize)]
struct SnapshotOut<'a> {
    format: u32,
    root: &'a str,
    plugins: EntriesOut<'a>,
}

/// The entries on disk, serialized one at a time (no list of them first) from actual state as it
/// is held still, or from the copy kept of a deregistration under way.
struct EntriesOut<'a> {
    recorded: &'a HashMap<Box<str>, Recorded, PathHasher>,
    actual: &'a Held<'a>,
}

impl serde::Serialize for EntriesOut<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = serializer.serialize_seq(None)?;
        for (path, recorded) in self.recorded {
            let registered = self
                .actual
                .get(Path::new(&**path))
                .filter(|entry| entry.generation == recorded.generation)
                .or(recorded.leaving.as_deref());
            let Some(registered) = registered else {
                tracing::debug!(
                    socket_path = &**path,
                    "a recorded registration is in neither actual state nor a deregistration under way: left out of the snapshot"
                );
                continue;
            };
            let mut generation = Uuid::encode_buffer();
            let generation = registered
                .generation
                .hyphenated()
                .encode_lower(&mut generation);
            seq.serialize_element(&Entry::of(
                path,
                registered,
                generation,
                recorded.unfinished,
            ))?;
        }
        seq.end()
    }
}

/// The state on disk: what began and what finished, by path.
pub struct Journal {
    snapshot: PathBuf,
    journal: PathBuf,
    root: String,
    /// What the snapshot is written from.
    actual: Arc<ActualState>,
    inner: Mutex<Inner>,
    reporter: std::sync::OnceLock<ProblemReporter>,
}

struct Inner {
    /// By socket path (hashed as the other tables keyed by it are: foldhash, not SipHash).
    entries: HashMap<Box<str>, Recorded, PathHasher>,
    /// The line being written: one buffer, reused (a line is written whole with one `write(2)`, so
    /// nothing of it is left for the next).
    line: Vec<u8>,
    /// What the files held, by path, from `open` until [`Journal::restored`] takes it.
    on_disk: HashMap<String, Entry<'static>>,
    /// Journal lines on disk when both files were read whole (the snapshot parsed, every journal
    /// line with it): `on_disk` is then what they say until the start has restored, and what it
    /// did not restore is appended as removed. None: compact at start.
    read_whole: Option<usize>,
    /// Open for appending; none after a failure to open or write (the next compaction retries).
    log: Option<std::fs::File>,
    lines: usize,
    /// Entries the last snapshot held: with the entries now, how many lines the journal takes
    /// before the next (see [`COMPACT_AFTER`]).
    snapshot_len: usize,
    /// A write failed and was reported; the next success says so.
    failing: bool,
}

/// Told when the state file stops or starts again being written (status and `/readyz` show it).
pub type ProblemReporter = Box<dyn Fn(Option<String>) + Send + Sync>;

impl Journal {
    /// Reads the state at `snapshot` (and its journal) for the tree `root`, unless `ignore`; every
    /// problem is logged and yields nothing to restore. Returns the journal and what to restore;
    /// restore them into `actual`, then call [`Journal::restored`] before anything else.
    pub fn open(
        snapshot: &Path,
        root: &Path,
        ignore: bool,
        actual: Arc<ActualState>,
    ) -> (Journal, Vec<Restored>) {
        let journal = Journal {
            snapshot: snapshot.to_path_buf(),
            journal: snapshot.with_extension("journal"),
            root: root.display().to_string(),
            actual,
            inner: Mutex::new(Inner {
                entries: HashMap::default(),
                line: Vec::new(),
                on_disk: HashMap::new(),
                read_whole: None,
                log: None,
                lines: 0,
                snapshot_len: 0,
                failing: false,
            }),
            reporter: std::sync::OnceLock::new(),
        };
        if !ignore {
            let (entries, read_whole) = read::read(&journal.snapshot, &journal.journal, root);
            let mut inner = journal.lock();
            inner.on_disk = entries;
            inner.read_whole = read_whole;
        }
        let restored = journal
            .lock()
            .on_disk
            .values()
            .filter_map(|entry| match Restored::from_entry(entry.clone(), root) {
                Ok(restored) => Some(restored),
                Err(e) => {
                    tracing::warn!(state_file = %snapshot.display(), error = format!("{e:#}"), "ignoring a state file entry");
                    None
                }
            })
            .collect();
        (journal, restored)
    }

    /// Starts from exactly what was restored (entries of a changed handler are dropped). When the
    /// files were read whole, what was not restored is appended to the journal as removed (a
    /// few lines, not a rewrite of every plugin on the start's path); otherwise they are written
    /// afresh: a snapshot and an empty journal.
    pub fn restored(&self) {
        let mut inner = self.lock();
        let on_disk = std::mem::take(&mut inner.on_disk);
        inner.entries = self
            .actual
            .hold()
            .iter()
            .filter_map(|(path, registered)| {
                let recorded = Recorded {
                    generation: registered.generation,
                    unfinished: registered.interrupted,
                    leaving: None,
                };
                Some((Box::from(path.to_str()?), recorded))
            })
            .collect();
        let Some(lines) = inner.read_whole.take() else {
            let _ = self.compact(&mut inner);
            return;
        };
        match open_own_file(&self.journal, libc::O_WRONLY | libc::O_APPEND) {
            Ok(log) => {
                inner.log = Some(log);
                inner.lines = lines;
            }
            Err(_) => {
                let _ = self.compact(&mut inner);
                return;
            }
        }
        let inner = &mut *inner;
        for read in on_disk.into_values() {
            let kept = inner.entries.get(&*read.path);
            if kept.is_some_and(|kept| kept.generation.to_string() == read.generation) {
                continue;
            }
            let line = Line::Remove {
                path: &read.path,
                generation: &read.generation,
            };
            if Self::line(&mut inner.line, &line).is_ok() {
                let _ = self.append(inner);
            }
        }
    }

    /// A registration of `path` begins: recorded before the handler hears of it. An error means
    /// it is not on disk (and not in the next snapshot): the registration must not go on.
    pub fn begin(&self, path: &Path, registered: &RegisteredPlugin) -> Result<(), String> {
        let Some(key) = path.to_str() else {
            // Not recordable at all (not UTF-8): registered again after a restart, as ever.
            return Ok(());
        };
        let mut generation = Uuid::encode_buffer();
        let generation = registered
            .generation
            .hyphenated()
            .encode_lower(&mut generation);
        let entry = Entry::of(key, registered, generation, true);
        let mut inner = self.lock();
        let inner = &mut *inner;
        Self::line(&mut inner.line, &Line::Begin(&entry))?;
        let recorded = Recorded {
            generation: registered.generation,
            unfinished: true,
            leaving: None,
        };
        // A deregistration of the path still under way is no longer in the file after this line.
        let previous = match inner.entries.get_mut(key) {
            Some(slot) => Some(std::mem::replace(slot, recorded)),
            None => {
                inner.entries.insert(Box::from(key), recorded);
                None
            }
        };
        let written = self.append(inner);
        if written.is_err() {
            match (previous, inner.entries.get_mut(key)) {
                (Some(previous), Some(slot)) => *slot = previous,
                _ => drop(inner.entries.remove(key)),
            }
        }
        written
    }

    /// A registration of `path` finished: recorded before it reports itself done. A failure
    /// here is logged only: the entry stays unfinished on disk, which a restart registers again.
    pub fn registered(&self, path: &Path, registered: &RegisteredPlugin) {
        let Some(key) = path.to_str() else { return };
        let mut generation = Uuid::encode_buffer();
        let generation = &*registered
            .generation
            .hyphenated()
            .encode_lower(&mut generation);
        let mut inner = self.lock();
        let inner = &mut *inner;
        let recorded = Recorded {
            generation: registered.generation,
            unfinished: false,
            leaving: None,
        };
        let slot = inner.entries.get_mut(key);
        // Begun in the journal: only which one finished; else (observe mode) the whole entry.
        let written = if slot
            .as_ref()
            .is_some_and(|slot| slot.generation == registered.generation && slot.unfinished)
        {
            Self::line(
                &mut inner.line,
                &Line::Done {
                    path: key,
                    generation,
                },
            )
        } else {
            let entry = Entry::of(key, registered, generation, false);
            Self::line(&mut inner.line, &Line::Add(&entry))
        };
        match slot {
            Some(slot) => *slot = recorded,
            None => drop(inner.entries.insert(Box::from(key), recorded)),
        }
        if written.is_ok() {
            let _ = self.append(inner);
        }
    }

    /// Takes `path`'s registration `generation` out of actual state for its deregistration (or
    /// rollback); returns it. Until [`deregistered`](Self::deregistered) says it finished, its
    /// record stays on disk, and a snapshot written meanwhile holds it (from a copy kept here, as
    /// actual state no longer holds it): taken under the journal's lock, so no snapshot falls
    /// between.
    ///
    /// A copy, not the entry's JSON: a clone is its strings' few small allocations (~530
    /// instructions), where serializing it cost ~7,000 for a snapshot that rarely falls within the
    /// deregistration.
    pub fn take(&self, path: &Path, generation: Uuid) -> Option<RegisteredPlugin> {
        let mut inner = self.lock();
        let taken = self.actual.remove(path, generation)?;
        let recorded = path
            .to_str()
            .and_then(|key| inner.entries.get_mut(key))
            .filter(|recorded| recorded.generation == generation);
        // None: not on disk (not UTF-8, or never recorded), nothing to keep.
        if let Some(recorded) = recorded {
            recorded.leaving = Some(Box::new(taken.clone()));
        }
        Some(taken)
    }

    /// A deregistration of `path` (the registration of `generation`) finished.
    pub fn deregistered(&self, path: &Path, generation: Uuid) {
        let Some(key) = path.to_str() else { return };
        let mut inner = self.lock();
        let inner = &mut *inner;
        if inner
            .entries
            .get(key)
            .is_none_or(|e| e.generation != generation)
        {
            return;
        }
        inner.entries.remove(key);
        crate::memory::shrink_if_sparse(&mut inner.entries);
        let mut buffer = Uuid::encode_buffer();
        let generation = &*generation.hyphenated().encode_lower(&mut buffer);
        if Self::line(
            &mut inner.line,
            &Line::Remove {
                path: key,
                generation,
            },
        )
        .is_ok()
        {
            let _ = self.append(inner);
        }
    }

    /// Folds the journal into the snapshot (at exit).
    pub fn flush(&self) {
        let mut inner = self.lock();
        let _ = self.compact(&mut inner);
    }

    /// `line` as the journal holds it, JSON and its newline, into `buffer` (emptied first).
    fn line(buffer: &mut Vec<u8>, line: &Line<'_>) -> Result<(), String> {
        buffer.clear();
        serde_json::to_writer(&mut *buffer, line).map_err(|e| format!("cannot serialize: {e}"))?;
        buffer.push(b'\n');
        Ok(())
    }

    /// Records the line in `inner.line` (already applied to `entries`): appended to the journal,
    /// or, when the journal cannot take it, a snapshot that holds it. The error says why neither
    /// was written.
    fn append(&self, inner: &mut Inner) -> Result<(), String> {
        // One write(2) per line: a kill leaves it whole or not at all in practice, and a torn
        // line is skipped at the next start.
        let written = match inner.log.as_mut().map(|log| log.write_all(&inner.line)) {
            Some(Ok(())) => {
                inner.lines += 1;
                Ok(())
            }
            Some(Err(e)) => {
                inner.log = None;
                let error = format!("cannot append to {}: {e}", self.journal.display());
                self.failed(inner, &error);
                Err(error)
            }
            None => Err(format!(
                "{} is not open (an earlier write failed)",
                self.journal.display()
            )),
        };
        let compact_after = COMPACT_AFTER
            .max(inner.entries.len())
            .max(inner.snapshot_len);
        if inner.log.is_none() || inner.lines >= compact_after {
            let compacted = self.compact(inner);
            if written.is_err() {
                // The snapshot holds the line's change if it was written.
                return compacted.map_err(|e| match written {
                    Err(first) if first != e => format!("{first}; {e}"),
                    _ => e,
                });
            }
        }
        written
    }

    /// Writes the snapshot whole, from actual state held still meanwhile, then starts an empty
    /// journal.
    fn compact(&self, inner: &mut Inner) -> Result<(), String> {
        let written = write_atomically(&self.snapshot, |out| {
            let actual = self.actual.hold();
            let file = SnapshotOut {
                format: FORMAT,
                root: &self.root,
                plugins: EntriesOut {
                    recorded: &inner.entries,
                    actual: &actual,
                },
            };
            serde_json::to_writer(out, &file).map_err(std::io::Error::from)
        })
        .and_then(|()| {
            // A new empty file renamed over the old journal: nothing is written through a
            // symbolic link someone put there, nor into a file it names.
            write_atomically(&self.journal, |_| Ok(()))?;
            open_own_file(&self.journal, libc::O_WRONLY | libc::O_APPEND)
                .with_context(|| format!("cannot start {}", self.journal.display()))
        });
        match written {
            Ok(log) => {
                inner.log = Some(log);
                inner.lines = 0;
                inner.snapshot_len = inner.entries.len();
                tracing::debug!(state_file = %self.snapshot.display(), plugins = inner.entries.len(), "state file written");
                if std::mem::take(&mut inner.failing) {
                    tracing::info!(state_file = %self.snapshot.display(), "state file written again");
                    self.report(None);
                }
                Ok(())
            }
            Err(e) => {
                inner.log = None;
                let error = format!("{e:#}");
                self.failed(inner, &error);
                Err(error)
            }
        }
    }

    fn failed(&self, inner: &mut Inner, error: &str) {
        if !std::mem::replace(&mut inner.failing, true) {
            tracing::warn!(state_file = %self.snapshot.display(), error, "cannot write the state file: a restart will register every plugin again");
        }
        self.report(Some(format!(
            "cannot be written, so registrations fail until it can: {error}"
        )));
    }

    /// Reports the state file's problem (none: written again) to whoever asked for it.
    pub fn report_problems_to(&self, reporter: ProblemReporter) {
        let _ = self.reporter.set(reporter);
    }

    fn report(&self, problem: Option<String>) {
        if let Some(reporter) = self.reporter.get() {
            reporter(problem);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::files::MAX_FILE_BYTES;
    use super::*;
    use crate::handler::accept_all::AcceptAll;
    use crate::handler::{HandlerRegistry, Plugin};
    use crate::provenance::{Creator, Process, Provenance};
    use crate::state::SocketId;
    use crate::state::desired::DesiredState;
    use std::time::Duration;

    fn socket(ino: u64) -> SocketId {
        SocketId {
            dev: 1,
            ino,
            birth_ns: Some(1_700_000_000_000_000_000),
            handle: None,
        }
    }

    fn plugin(path: &str, name: &str) -> Plugin {
        Plugin {
            plugin_type: "CSIPlugin".into(),
            name: name.into(),
            endpoint: path.into(),
            supported_versions: vec!["1.0.0".into()],
            socket_path: path.into(),
        }
    }

    fn registry() -> Arc<HandlerRegistry> {
        let handlers = Arc::new(HandlerRegistry::default());
        handlers.insert("CSIPlugin", Arc::new(AcceptAll));
        handlers
    }

    /// A journal in a temporary directory for the tree `/plugins`, its snapshot path, and the
    /// actual state it writes snapshots from.
    fn journal(dir: &Path) -> (Journal, PathBuf, Arc<ActualState>) {
        let snapshot = dir.join(FILE_NAME);
        let actual = Arc::new(ActualState::default());
        let (journal, restored) =
            Journal::open(&snapshot, Path::new("/plugins"), false, actual.clone());
        assert!(restored.is_empty());
        (journal, snapshot, actual)
    }

    /// Registers `name` in `actual` and records it as finished.
    fn register(actual: &ActualState, journal: &Journal, name: &str, ino: u64) -> RegisteredPlugin {
        let (path, entry) = add(actual, name, ino);
        journal.registered(&path, &entry);
        entry
    }

    /// Adds `name` to `actual` as a registration does before the handler's Register.
    fn add(actual: &ActualState, name: &str, ino: u64) -> (PathBuf, RegisteredPlugin) {
        let path = PathBuf::from(format!("/plugins/{name}.sock"));
        let entry = actual.add(
            path.clone(),
            Uuid::new_v4(),
            socket(ino),
            plugin(&path.display().to_string(), name),
            Arc::new(AcceptAll),
            Provenance::default(),
        );
        (path, entry)
    }

    /// Leaves half a line at the journal's end, as a kill in the middle of a write would.
    fn tear_journal(snapshot: &Path) {
        let mut log = std::fs::OpenOptions::new()
            .append(true)
            .open(snapshot.with_extension("journal"))
            .expect("journal");
        log.write_all(b"{\"add\":{\"path\":\"/plugins/b.so")
            .expect("torn");
    }

    fn reopen(snapshot: &Path) -> Vec<Restored> {
        let actual = Arc::new(ActualState::default());
        Journal::open(snapshot, Path::new("/plugins"), false, actual).1
    }

    /// What a start would restore from `snapshot`: each plugin's name and whether a kill
    /// interrupted its registration, by name.
    fn reopen_interrupted(snapshot: &Path) -> Vec<(String, bool)> {
        let mut restored: Vec<(String, bool)> = reopen(snapshot)
            .into_iter()
            .map(|r| (r.plugin.name, r.interrupted))
            .collect();
        restored.sort();
        restored
    }

    #[test]
    fn what_finished_is_restored_into_desired_and_actual_state_without_a_flush() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        let a = register(&actual, &journal, "a", 10);
        let b = register(&actual, &journal, "b", 11);
        journal.deregistered(Path::new("/plugins/b.sock"), b.generation);
        // Killed here: no flush, only the journal's lines.
        drop(journal);
        let entries = reopen(&snapshot);
        assert_eq!(entries.len(), 1);
        let (desired, restored, handlers) =
            (DesiredState::default(), ActualState::default(), registry());
        let report = Restore {
            desired: &desired,
            actual: &restored,
            handlers: &handlers,
            observing: false,
        }
        .apply(entries);
        assert_eq!(report.restored, 1);
        let path = Path::new("/plugins/a.sock");
        let back = restored.get(path).expect("restored");
        assert_eq!(
            (back.generation, back.socket, &back.plugin),
            (a.generation, a.socket, &a.plugin)
        );
        // The same socket found by the first walk changes nothing.
        assert_eq!(
            desired.add_or_update(path, a.socket, None),
            Ok(crate::state::desired::Change::Unchanged)
        );
    }

    #[test]
    fn who_created_and_who_served_a_socket_survive_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        let cgroup = Arc::new(crate::provenance::Cgroup {
            path: "/kubepods/pod5c1d8a3e-2f4b-4c6d-9e8f-0a1b2c3d4e5f/x".into(),
            id: Some(42),
            pod_uid: Some("5c1d8a3e-2f4b-4c6d-9e8f-0a1b2c3d4e5f".into()),
            container_id: None,
        });
        let process = |pid| Process {
            pid: Some(pid),
            uid: Some(0),
            gid: Some(0),
            command: Some("driver".into()),
            cgroup: Some(cgroup.clone()),
            pidfs_ino: Some(u64::from(pid) + 1000),
        };
        let provenance = Provenance {
            creator: Creator::Known(Arc::new(process(7))),
            server: Some(Arc::new(process(8))),
        };
        let path = PathBuf::from("/plugins/a.sock");
        let entry = actual.add(
            path.clone(),
            Uuid::new_v4(),
            socket(10),
            plugin("/plugins/a.sock", "a"),
            Arc::new(AcceptAll),
            provenance.clone(),
        );
        journal.registered(&path, &entry);
        drop(journal);
        let restored = reopen(&snapshot);
        assert_eq!(restored.len(), 1);
        assert_eq!(restored[0].provenance, provenance);
        let (desired, actual, handlers) =
            (DesiredState::default(), ActualState::default(), registry());
        Restore {
            desired: &desired,
            actual: &actual,
            handlers: &handlers,
            observing: false,
        }
        .apply(restored);
        assert_eq!(
            desired.get(&path).map(|d| d.creator),
            Some(provenance.creator.clone())
        );
        assert_eq!(actual.get(&path).map(|r| r.provenance), Some(provenance));
    }

    #[test]
    fn a_registration_killed_before_its_register_is_not_restored_nor_a_deregistration_lost() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        let a = register(&actual, &journal, "a", 10);
        // Killed during b's Validate (not begun in the journal) and a's DeRegister.
        add(&actual, "b", 11);
        let taken = journal.take(Path::new("/plugins/a.sock"), a.generation);
        assert_eq!(taken.map(|a| a.generation), Some(a.generation));
        drop(journal);
        assert_eq!(
            reopen_interrupted(&snapshot),
            [("a".to_owned(), false)],
            "a is deregistered again, b registered as new"
        );
    }

    /// Snapshots are written from actual state, which a deregistration leaves as it begins: one
    /// written while it runs still holds the plugin (from what `take` kept), and one written
    /// while a registration is before its `begin` does not hold that one yet.
    #[test]
    fn a_snapshot_written_meanwhile_holds_what_is_on_disk_not_what_actual_state_holds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        let a = register(&actual, &journal, "a", 10);
        let (b_path, b) = add(&actual, "b", 11);
        journal.begin(&b_path, &b).expect("begin b");
        register(&actual, &journal, "c", 12);
        add(&actual, "d", 13);
        let a_path = Path::new("/plugins/a.sock");
        journal.take(a_path, a.generation).expect("a registered");
        journal.take(&b_path, b.generation).expect("b registered");
        assert!(actual.get(a_path).is_none() && actual.get(&b_path).is_none());
        journal.flush();
        let on_disk = [
            ("a".to_owned(), false),
            ("b".to_owned(), true),
            ("c".to_owned(), false),
        ];
        assert_eq!(reopen_interrupted(&snapshot), on_disk, "from the snapshot");
        // The deregistrations finish; the next snapshot leaves them out.
        journal.deregistered(a_path, a.generation);
        journal.deregistered(&b_path, b.generation);
        journal.flush();
        assert_eq!(reopen_interrupted(&snapshot), [("c".to_owned(), false)]);
        drop(journal);
        assert_eq!(reopen_interrupted(&snapshot), [("c".to_owned(), false)]);
    }

    /// A registration of a path whose deregistration is still under way replaces it on disk: the
    /// snapshot holds the new one (not the copy kept for the old one), and the old one's finish
    /// changes nothing.
    #[test]
    fn a_registration_begun_during_the_paths_deregistration_replaces_it_on_disk() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        let old = register(&actual, &journal, "a", 10);
        let path = Path::new("/plugins/a.sock");
        journal.take(path, old.generation).expect("registered");
        let (_, new) = add(&actual, "a", 11);
        journal.begin(path, &new).expect("begin");
        journal.flush();
        let generations = |snapshot: &Path| -> Vec<(Uuid, bool)> {
            reopen(snapshot)
                .into_iter()
                .map(|r| (r.generation, r.interrupted))
                .collect()
        };
        assert_eq!(generations(&snapshot), [(new.generation, true)]);
        journal.deregistered(path, old.generation);
        drop(journal);
        assert_eq!(
            generations(&snapshot),
            [(new.generation, true)],
            "the old one finishing undoes nothing"
        );
    }

    /// kubernetes issue 136462's other half: what a handler may hold is on disk before it is
    /// told, so a kill between Register and Notify loses nothing.
    #[test]
    fn a_registration_killed_after_it_began_is_restored_interrupted_until_it_finishes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        let (a_path, a) = add(&actual, "a", 10);
        journal.begin(&a_path, &a).expect("begin a");
        let (b_path, b) = add(&actual, "b", 11);
        journal.begin(&b_path, &b).expect("begin b");
        journal.registered(&b_path, &b);
        let (c_path, c) = add(&actual, "c", 12);
        journal.begin(&c_path, &c).expect("begin c");
        // c's Register failed: rolled back.
        journal.take(&c_path, c.generation).expect("c began");
        journal.deregistered(&c_path, c.generation);
        drop(journal);
        let want = [("a".to_owned(), true), ("b".to_owned(), false)];
        assert_eq!(reopen_interrupted(&snapshot), want, "from the journal");

        // The same through a snapshot (a start's compaction), and into actual state.
        let actual = Arc::new(ActualState::default());
        let (journal, entries) =
            Journal::open(&snapshot, Path::new("/plugins"), false, actual.clone());
        let (desired, handlers) = (DesiredState::default(), registry());
        let report = Restore {
            desired: &desired,
            actual: &actual,
            handlers: &handlers,
            observing: false,
        }
        .apply(entries);
        assert_eq!((report.restored, report.interrupted), (2, 1));
        journal.restored();
        journal.flush();
        drop(journal);
        assert_eq!(reopen_interrupted(&snapshot), want, "from the snapshot");
        let a = actual.get(&a_path).expect("a restored");
        assert!(a.interrupted);
    }

    /// kubernetes issue 136462: a registration that cannot be recorded is refused before its
    /// handler hears of it, and leaves nothing behind for a later write to persist.
    #[test]
    fn a_registration_that_cannot_be_recorded_fails_and_leaves_nothing_on_disk() {
        let dir = tempfile::tempdir().expect("tempdir");
        let snapshot = dir.path().join(FILE_NAME);
        // The journal cannot be opened: every write has to go through a snapshot, and so that
        // the snapshot fails too, its temporary file cannot be created.
        std::fs::create_dir(snapshot.with_extension("journal")).expect("a directory in the way");
        std::fs::create_dir(snapshot.with_extension("json.tmp")).expect("a directory in the way");
        let actual = Arc::new(ActualState::default());
        let (journal, _) = Journal::open(&snapshot, Path::new("/plugins"), false, actual.clone());
        let reported = Arc::new(Mutex::new(None));
        let to = reported.clone();
        journal.report_problems_to(Box::new(move |problem| *to.lock().expect("lock") = problem));
        journal.restored();
        let (path, entry) = add(&actual, "a", 10);
        let error = journal.begin(&path, &entry).expect_err("nowhere to write");
        assert!(
            error.contains("json.tmp") && error.contains("state.journal"),
            "the error names what failed: {error}"
        );
        let problem = reported.lock().expect("lock").clone();
        assert!(
            problem.as_deref().is_some_and(|p| p.contains("json.tmp")),
            "the failure is reported for status and /readyz: {problem:?}"
        );
        // Writable again: what failed is not in the next snapshot.
        std::fs::remove_dir(snapshot.with_extension("journal")).expect("rmdir");
        std::fs::remove_dir(snapshot.with_extension("json.tmp")).expect("rmdir");
        let (b_path, b) = add(&actual, "b", 11);
        journal.begin(&b_path, &b).expect("writable again");
        assert_eq!(
            *reported.lock().expect("lock"),
            None,
            "the problem is cleared"
        );
        drop(journal);
        let names: Vec<String> = reopen(&snapshot)
            .into_iter()
            .map(|r| r.plugin.name)
            .collect();
        assert_eq!(names, ["b"]);
    }

    #[test]
    fn compaction_keeps_the_state_and_empties_the_journal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        for i in 0..(COMPACT_AFTER as u64 + 10) {
            let entry = register(&actual, &journal, &format!("p{}", i % 20), i);
            if i % 3 == 0 {
                let path = Path::new(&entry.plugin.socket_path);
                journal.take(path, entry.generation).expect("registered");
                journal.deregistered(path, entry.generation);
            }
        }
        let lines = std::fs::read(snapshot.with_extension("journal"))
            .expect("journal")
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .count();
        assert!(lines < COMPACT_AFTER, "{lines} lines after compaction");
        let expected: usize = (0..20u64)
            .filter(|p| {
                // The last registration of each name, unless it was deregistered.
                let last = (0..(COMPACT_AFTER as u64 + 10))
                    .filter(|i| i % 20 == *p)
                    .max();
                last.is_some_and(|i| i % 3 != 0)
            })
            .count();
        journal.flush();
        assert_eq!(reopen(&snapshot).len(), expected);
    }

    #[test]
    fn a_torn_journal_line_is_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        register(&actual, &journal, "a", 10);
        drop(journal);
        tear_journal(&snapshot);
        assert_eq!(reopen(&snapshot).len(), 1);
    }

    /// Restores what `snapshot` holds with the CSI handler, as a start does; returns the journal
    /// the start carries on with and the restored plugins' names.
    fn start(snapshot: &Path) -> (Journal, Arc<ActualState>, Vec<String>) {
        let actual = Arc::new(ActualState::default());
        let (journal, entries) =
            Journal::open(snapshot, Path::new("/plugins"), false, actual.clone());
        let desired = DesiredState::default();
        Restore {
            desired: &desired,
            actual: &actual,
            handlers: &registry(),
            observing: false,
        }
        .apply(entries);
        journal.restored();
        let mut names: Vec<String> = actual
            .snapshot()
            .into_iter()
            .map(|(_, e)| e.plugin.name)
            .collect();
        names.sort();
        (journal, actual, names)
    }

    #[test]
    fn a_start_that_read_the_files_whole_rewrites_nothing_and_appends_what_it_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        register(&actual, &journal, "a", 10);
        journal.flush();
        register(&actual, &journal, "b", 11);
        // A plugin whose type has no handler at the next start: not restored.
        let path = PathBuf::from("/plugins/dra.sock");
        let mut dra = plugin("/plugins/dra.sock", "dra");
        dra.plugin_type = "DRAPlugin".into();
        let entry = actual.add(
            path.clone(),
            Uuid::new_v4(),
            socket(12),
            dra,
            Arc::new(AcceptAll),
            Provenance::default(),
        );
        journal.registered(&path, &entry);
        drop(journal);
        let before = std::fs::read(&snapshot).expect("snapshot");
        let journal_lines = |snapshot: &Path| -> Vec<String> {
            std::fs::read_to_string(snapshot.with_extension("journal"))
                .expect("journal")
                .lines()
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(journal_lines(&snapshot).len(), 2);

        let (journal, actual, names) = start(&snapshot);
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            std::fs::read(&snapshot).expect("snapshot"),
            before,
            "not rewritten"
        );
        let lines = journal_lines(&snapshot);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(
            lines[2].starts_with("{\"remove\":{\"path\":\"/plugins/dra.sock\""),
            "{lines:?}"
        );
        // What finishes next is appended after it, and the one after reads them all.
        register(&actual, &journal, "c", 13);
        drop(journal);
        assert_eq!(start(&snapshot).2, ["a", "b", "c"]);
    }

    #[test]
    fn a_start_after_a_torn_journal_line_writes_the_files_afresh() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        register(&actual, &journal, "a", 10);
        drop(journal);
        tear_journal(&snapshot);
        let (journal, actual, names) = start(&snapshot);
        assert_eq!(names, ["a"]);
        assert_eq!(
            std::fs::read(snapshot.with_extension("journal")).expect("journal"),
            b"",
            "compacted: the torn line is gone"
        );
        // Appended after it, the next line would have run into the torn one.
        register(&actual, &journal, "c", 13);
        drop(journal);
        assert_eq!(start(&snapshot).2, ["a", "c"]);
    }

    #[test]
    fn entries_of_another_handler_or_mode_are_not_restored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(dir.path());
        register(&actual, &journal, "a", 10);
        register(&actual, &journal, "b", 11);
        let (desired, restored) = (DesiredState::default(), ActualState::default());
        let restore = |handlers: &HandlerRegistry, observing| {
            Restore {
                desired: &desired,
                actual: &restored,
                handlers,
                observing,
            }
            .apply(reopen(&snapshot))
        };
        // No handler for the type any more.
        assert_eq!(
            restore(&HandlerRegistry::default(), false),
            RestoreReport {
                restored: 0,
                handler_changed: 2,
                interrupted: 0,
            }
        );
        // Registrations are not observations.
        assert_eq!(restore(&registry(), true).restored, 0);
        assert!(restored.is_empty() && desired.snapshot().is_empty());
    }

    /// The files are the agent's own: a state file that is a link (to a FIFO that would block
    /// the start forever, or to anything else), a FIFO, or larger than any state file restores
    /// nothing; a journal that is a link is replaced, never written through (the file it named
    /// keeps its bytes).
    #[test]
    fn links_fifos_and_oversized_files_restore_nothing_and_are_never_written_through() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let snapshot = dir.path().join(FILE_NAME);
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .expect("mkfifo");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"someone else's bytes").expect("write");

        // Each open must return, not block: run it on a thread and give up on it after 10 s.
        let open_in_time = |snapshot: PathBuf| {
            let (done, wait) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = done.send(reopen(&snapshot).len());
            });
            wait.recv_timeout(Duration::from_secs(10))
                .expect("the start does not block on the state file")
        };
        std::os::unix::fs::symlink(&fifo, &snapshot).expect("symlink");
        assert_eq!(open_in_time(snapshot.clone()), 0, "a link to a FIFO");
        std::fs::remove_file(&snapshot).expect("rm");
        nix::unistd::mkfifo(&snapshot, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .expect("mkfifo");
        assert_eq!(open_in_time(snapshot.clone()), 0, "a FIFO");
        std::fs::remove_file(&snapshot).expect("rm");

        // Valid JSON padded past the bound (sparse: no disk is spent) is refused unread.
        let (first, _, actual) = journal(dir.path());
        first.restored();
        register(&actual, &first, "a", 10);
        first.flush();
        drop(first);
        assert_eq!(reopen(&snapshot).len(), 1);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&snapshot)
            .expect("open");
        file.set_len(MAX_FILE_BYTES + 1).expect("grow");
        assert!(reopen(&snapshot).is_empty(), "larger than a state file");
        std::fs::remove_file(&snapshot).expect("rm");

        // The journal a link to another file: the agent's compaction replaces the link.
        let journal_path = snapshot.with_extension("journal");
        std::fs::remove_file(&journal_path).expect("rm");
        std::os::unix::fs::symlink(&victim, &journal_path).expect("symlink");
        let (second, _, actual) = journal(dir.path());
        second.restored();
        register(&actual, &second, "b", 11);
        second.flush();
        drop(second);
        assert_eq!(
            std::fs::read(&victim).expect("victim"),
            b"someone else's bytes",
            "nothing written through the link"
        );
        let kind = std::fs::symlink_metadata(&journal_path)
            .expect("journal")
            .file_type();
        assert!(kind.is_file() && !kind.is_fifo(), "the link was replaced");
        assert_eq!(reopen_interrupted(&snapshot), [("b".to_string(), false)]);
    }

    #[test]
    fn a_missing_or_unreadable_file_restores_nothing_and_ignore_reads_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(reopen(&dir.path().join("absent.json")).is_empty());
        let garbage = dir.path().join(FILE_NAME);
        std::fs::write(&garbage, b"\x00\xffnot json").expect("write");
        assert!(reopen(&garbage).is_empty());
        let other = tempfile::tempdir().expect("tempdir");
        let (journal, snapshot, actual) = journal(other.path());
        register(&actual, &journal, "a", 10);
        journal.flush();
        assert!(
            Journal::open(&snapshot, Path::new("/plugins"), true, actual)
                .1
                .is_empty()
        );
    }

    #[test]
    fn writes_replace_the_file_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join(FILE_NAME);
        std::fs::write(&file, b"old content, longer than nothing at all").expect("write");
        write_atomically(&file, |out| out.write_all(b"new")).expect("written");
        assert_eq!(std::fs::read(&file).expect("read"), b"new");
        assert!(!file.with_extension("json.tmp").exists());
    }
}
