//! The actual state on disk, so that a restarted agent knows what it registered.
//!
//! ```text
//! state::actual --changed--> writer (batched, atomic rename) --> <runtime dir>/state.json
//! start: state.json --load (format, root checked)--> restore --> state::desired + state::actual
//!        then the watcher's first walk: same socket instance: nothing happens;
//!                                       gone: deregistered once; replaced: deregistered, then
//!                                       registered; new: registered
//! ```
//!
//! Kubelet keeps its actual state in memory only, so every kubelet restart re-registers every
//! plugin (and, before 1.33, could not deregister what went while it was down). Here the file lives
//! in the runtime directory (`/run/plugin-agent` by default: a tmpfs, so it survives restarts of
//! the agent, not of the node, which restarts the plugins too). It is written whole to a temporary
//! file and renamed over the old one, so a crash mid-write leaves the previous version; writes are
//! batched ([`BATCH`]), so a crash can lose the last changes, which costs at most a repeated call
//! (a Register the handler already had, a DeRegister for a plugin already gone), never a missed one.
//! Anything unreadable (corrupt, another format, another tree) is a warning and today's behaviour:
//! everything found is registered again.

use crate::handler::{HandlerRegistry, Plugin, PluginHandler};
use crate::state::SocketId;
use crate::state::actual::ActualState;
use crate::state::desired::DesiredState;
use anyhow::Context;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The file's name in the runtime directory.
pub const FILE_NAME: &str = "state.json";

/// The format this agent writes and reads; another is ignored (with a warning), never guessed at.
pub const FORMAT: u32 = 1;

/// How long the writer waits after a change for more before it writes: a burst of 10,000
/// registrations is a few dozen writes, not 10,000.
pub const BATCH: Duration = Duration::from_millis(200);

/// What the file holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct StateFile {
    format: u32,
    /// The watched tree the entries are under: another tree's file is not this agent's.
    root: String,
    plugins: Vec<Entry>,
}

/// One registered (or, in observe mode, observed) plugin.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Entry {
    path: String,
    generation: String,
    dev: u64,
    ino: u64,
    birth_ns: Option<i128>,
    handle: Option<u64>,
    #[serde(rename = "type")]
    plugin_type: String,
    name: String,
    endpoint: String,
    versions: Vec<String>,
    /// The handler's description (its target) it was registered with; none when observed.
    handler: Option<String>,
    registered_at_unix_ms: u64,
}

/// A plugin a previous agent registered, as read from the file.
#[derive(Debug, Clone, PartialEq)]
pub struct Restored {
    pub path: PathBuf,
    pub generation: Uuid,
    pub socket: SocketId,
    pub plugin: Plugin,
    /// The handler's description; none: observed only.
    pub handler: Option<String>,
    pub registered_at: SystemTime,
}

/// Reads the file at `file` for the tree `root`. Every problem is logged and yields nothing to
/// restore: the agent then registers everything it finds, as after a reboot.
pub fn load(file: &Path, root: &Path) -> Vec<Restored> {
    let bytes = match std::fs::read(file) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!(state_file = %file.display(), "no state file: registering every plugin found");
            return Vec::new();
        }
        Err(e) => {
            tracing::warn!(state_file = %file.display(), error = %e, "cannot read the state file: registering every plugin found");
            return Vec::new();
        }
    };
    match parse(&bytes, root) {
        Ok(restored) => restored,
        Err(e) => {
            tracing::warn!(state_file = %file.display(), error = format!("{e:#}"), "ignoring the state file: registering every plugin found");
            Vec::new()
        }
    }
}

fn parse(bytes: &[u8], root: &Path) -> anyhow::Result<Vec<Restored>> {
    // The format first, alone: a later format may change everything else.
    #[derive(serde::Deserialize)]
    struct Format {
        format: u32,
    }
    let Format { format } = serde_json::from_slice(bytes).context("not a state file")?;
    anyhow::ensure!(
        format == FORMAT,
        "format {format}, this agent reads format {FORMAT}"
    );
    let file: StateFile = serde_json::from_slice(bytes).context("malformed state file")?;
    anyhow::ensure!(
        Path::new(&file.root) == root,
        "it is for {}, this agent watches {}",
        file.root,
        root.display()
    );
    file.plugins
        .into_iter()
        .map(|entry| {
            let generation = Uuid::parse_str(&entry.generation)
                .with_context(|| format!("bad generation for {}", entry.path))?;
            let path = PathBuf::from(&entry.path);
            anyhow::ensure!(
                path.starts_with(root),
                "entry {} is outside the tree",
                entry.path
            );
            Ok(Restored {
                generation,
                socket: SocketId {
                    dev: entry.dev,
                    ino: entry.ino,
                    birth_ns: entry.birth_ns,
                    handle: entry.handle,
                },
                plugin: Plugin {
                    plugin_type: entry.plugin_type,
                    name: entry.name,
                    endpoint: entry.endpoint,
                    supported_versions: entry.versions,
                    socket_path: entry.path,
                },
                handler: entry.handler,
                registered_at: SystemTime::UNIX_EPOCH
                    + Duration::from_millis(entry.registered_at_unix_ms),
                path,
            })
        })
        .collect()
}

/// How restoring went, for the start log line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Entries put back: their plugins are not called again if their sockets are unchanged.
    pub restored: usize,
    /// Entries whose handler is no longer the one configured for their type (or that were
    /// observed and the agent now registers, or the other way round): registered as new.
    pub handler_changed: usize,
}

/// What restoring needs to decide, per entry, whether today's agent carries on from it.
pub struct Restore<'a> {
    pub desired: &'a DesiredState,
    pub actual: &'a ActualState,
    pub handlers: &'a HandlerRegistry,
    /// Observe mode: entries are observations (no handler); register mode: registrations.
    pub observing: bool,
}

impl Restore<'_> {
    /// Puts `entries` back into desired and actual state (before the first walk).
    pub fn apply(&self, entries: Vec<Restored>) -> RestoreReport {
        let mut report = RestoreReport::default();
        for entry in entries {
            let handler = match self.handler_for(&entry) {
                Some(handler) => handler,
                None => {
                    report.handler_changed += 1;
                    continue;
                }
            };
            let path: Arc<Path> = Arc::from(entry.path.as_path());
            self.desired
                .restore(path.clone(), entry.generation, entry.socket);
            self.actual.restore(
                path,
                entry.generation,
                entry.socket,
                entry.plugin,
                handler,
                entry.registered_at,
            );
            report.restored += 1;
        }
        report
    }

    /// The handler `entry` is carried on with: `Some(None)` when observed (and observing),
    /// `Some(Some(h))` when today's handler for its type is the one it was registered with.
    #[allow(clippy::option_option)]
    fn handler_for(&self, entry: &Restored) -> Option<Option<Arc<dyn PluginHandler>>> {
        match (&entry.handler, self.observing) {
            (None, true) => Some(None),
            (Some(described), false) => self
                .handlers
                .get(&entry.plugin.plugin_type)
                .filter(|handler| handler.describe() == *described)
                .map(Some),
            _ => None,
        }
    }
}

/// Writes the actual state to `file` after every change (batched) until `cancel` fires, then
/// once more. A failed write is logged (once per run of failures) and retried on the next change.
pub async fn run_writer(
    file: PathBuf,
    root: PathBuf,
    actual: Arc<ActualState>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let mut failing = false;
    loop {
        tokio::select! {
            () = actual.changed() => {}
            () = cancel.cancelled() => break,
        }
        tokio::select! {
            () = tokio::time::sleep(BATCH) => {}
            () = cancel.cancelled() => break,
        }
        failing = write_logged(&file, &root, &actual, failing).await;
    }
    write_logged(&file, &root, &actual, failing).await;
    Ok(())
}

async fn write_logged(file: &Path, root: &Path, actual: &ActualState, failing: bool) -> bool {
    let (bytes, plugins) = match serialize(root, actual) {
        Ok(serialized) => serialized,
        Err(e) => {
            tracing::warn!(error = format!("{e:#}"), "cannot serialize the state file");
            return true;
        }
    };
    let target = file.to_path_buf();
    let written = tokio::task::spawn_blocking(move || write_atomically(&target, &bytes)).await;
    match written {
        Ok(Ok(())) => {
            tracing::debug!(state_file = %file.display(), plugins, "state file written");
            if failing {
                tracing::info!(state_file = %file.display(), "state file written again");
            }
            false
        }
        Ok(Err(e)) => {
            if !failing {
                tracing::warn!(state_file = %file.display(), error = format!("{e:#}"), "cannot write the state file: a restart will register every plugin again");
            }
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "state file writer task failed");
            true
        }
    }
}

/// The file's bytes, and how many plugins they hold.
fn serialize(root: &Path, actual: &ActualState) -> anyhow::Result<(Vec<u8>, usize)> {
    let root = root
        .to_str()
        .context("the plugin directory's path is not UTF-8")?
        .to_owned();
    let plugins = actual
        .snapshot()
        .into_iter()
        // A path that is not UTF-8 is left out: its plugin is registered again after a restart.
        .filter_map(|(path, entry)| {
            Some(Entry {
                path: path.to_str()?.to_owned(),
                generation: entry.generation.to_string(),
                dev: entry.socket.dev,
                ino: entry.socket.ino,
                birth_ns: entry.socket.birth_ns,
                handle: entry.socket.handle,
                plugin_type: entry.plugin.plugin_type,
                name: entry.plugin.name,
                endpoint: entry.plugin.endpoint,
                versions: entry.plugin.supported_versions,
                handler: entry.handler.map(|h| h.describe()),
                registered_at_unix_ms: entry
                    .registered_at
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            })
        })
        .collect::<Vec<_>>();
    let count = plugins.len();
    let bytes = serde_json::to_vec(&StateFile {
        format: FORMAT,
        root,
        plugins,
    })?;
    Ok((bytes, count))
}

/// Writes `bytes` to a temporary file beside `file`, syncs it and renames it over `file`: readers
/// (the next agent) see the old content or the new, never a mix.
fn write_atomically(file: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = file.with_extension("json.tmp");
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    out.write_all(bytes)
        .and_then(|()| out.sync_data())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, file)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), file.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::accept_all::AcceptAll;

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

    /// An actual state with two registered plugins, written and read back.
    fn round_trip(root: &Path) -> (Vec<u8>, ActualState) {
        let actual = ActualState::default();
        for (i, name) in ["a", "b"].iter().enumerate() {
            let path = root.join(format!("{name}.sock"));
            let path_text = path.display().to_string();
            actual.add(
                path,
                Uuid::new_v4(),
                socket(10 + i as u64),
                plugin(&path_text, name),
                Arc::new(AcceptAll),
            );
        }
        (serialize(root, &actual).expect("serializes").0, actual)
    }

    #[test]
    fn restores_what_it_wrote_into_desired_and_actual_state() {
        let root = Path::new("/var/lib/kubelet/plugins_registry");
        let (bytes, written) = round_trip(root);
        let entries = parse(&bytes, root).expect("parses");
        assert_eq!(entries.len(), 2);
        let (desired, actual, handlers) =
            (DesiredState::default(), ActualState::default(), registry());
        let report = Restore {
            desired: &desired,
            actual: &actual,
            handlers: &handlers,
            observing: false,
        }
        .apply(entries);
        assert_eq!(report.restored, 2);
        for (path, before) in written.snapshot() {
            let after = actual.get(&path).expect("restored");
            assert_eq!(after.generation, before.generation);
            assert_eq!(after.socket, before.socket);
            assert_eq!(after.plugin, before.plugin);
            let want = desired.get(&path).expect("desired too");
            assert_eq!(
                (want.generation, want.socket),
                (before.generation, before.socket)
            );
            // The same socket found by the first walk changes nothing.
            assert_eq!(
                desired.add_or_update(&path, before.socket, None),
                Ok(crate::state::desired::Change::Unchanged)
            );
        }
    }

    #[test]
    fn entries_of_another_handler_or_mode_are_not_restored() {
        let root = Path::new("/plugins");
        let (bytes, _) = round_trip(root);
        let (desired, actual) = (DesiredState::default(), ActualState::default());
        // No handler for the type any more.
        let none = HandlerRegistry::default();
        let restore = |handlers: &HandlerRegistry, observing| {
            Restore {
                desired: &desired,
                actual: &actual,
                handlers,
                observing,
            }
            .apply(parse(&bytes, root).expect("parses"))
        };
        assert_eq!(
            restore(&none, false),
            RestoreReport {
                restored: 0,
                handler_changed: 2
            }
        );
        // Registrations are not observations.
        assert_eq!(restore(&registry(), true).restored, 0);
        assert!(actual.is_empty() && desired.snapshot().is_empty());
    }

    #[test]
    fn corrupt_foreign_and_other_tree_files_restore_nothing_and_say_why() {
        let root = Path::new("/plugins");
        let (good, _) = round_trip(root);
        let cases: [(&[u8], &str); 5] = [
            (b"", "not a state file"),
            (b"{\"format\": 1, \"root\": ", "not a state file"),
            (b"{\"format\": 99, \"plugins\": 7}", "format 99"),
            (
                b"{\"format\": 1, \"root\": \"/plugins\", \"plugins\": 7}",
                "malformed",
            ),
            (&good[..good.len() / 2], "not a state file"),
        ];
        for (bytes, why) in cases {
            let error = format!("{:#}", parse(bytes, root).expect_err("refused"));
            assert!(error.contains(why), "{why}: {error}");
        }
        let error = format!(
            "{:#}",
            parse(&good, Path::new("/other")).expect_err("refused")
        );
        assert!(error.contains("this agent watches /other"), "{error}");
    }

    #[test]
    fn a_missing_or_unreadable_file_restores_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(load(&dir.path().join("absent.json"), Path::new("/plugins")).is_empty());
        let garbage = dir.path().join(FILE_NAME);
        std::fs::write(&garbage, b"\x00\xffnot json").expect("write");
        assert!(load(&garbage, Path::new("/plugins")).is_empty());
    }

    #[test]
    fn writes_replace_the_file_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join(FILE_NAME);
        let root = Path::new("/plugins");
        let (bytes, _) = round_trip(root);
        std::fs::write(&file, b"old content, longer than nothing at all").expect("write");
        write_atomically(&file, &bytes).expect("written");
        assert_eq!(std::fs::read(&file).expect("read"), bytes);
        assert!(!file.with_extension("json.tmp").exists());
        assert_eq!(load(&file, root).len(), 2);
    }

    #[tokio::test]
    async fn the_writer_writes_after_a_change_and_once_more_when_cancelled() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join(FILE_NAME);
        let root = PathBuf::from("/plugins");
        let actual = Arc::new(ActualState::default());
        let cancel = CancellationToken::new();
        let writer = tokio::spawn(run_writer(
            file.clone(),
            root.clone(),
            actual.clone(),
            cancel.clone(),
        ));
        actual.add(
            root.join("a.sock"),
            Uuid::new_v4(),
            socket(1),
            plugin("/plugins/a.sock", "a"),
            Arc::new(AcceptAll),
        );
        cancel.cancel();
        writer.await.expect("joined").expect("ran");
        assert_eq!(load(&file, &root).len(), 1);
    }
}
