//! The watcher announces a socket's name to the source before it looks at the socket (announce,
//! then look), so its own look is the one after the announcement; a name announced for an entry
//! the look does not find a socket is withdrawn. A walk announces what it reads, a directory's
//! sockets at once; an event's creation announces the path it names. Tested with a source that
//! keeps a name table the way the eBPF source's kernel table is kept, and that changes the tree at
//! the moment it is told of the names, as a plugin racing the watcher would.
//!
//! ```text
//! tree --readdir--> walk --sockets_present--> RecordingSource (table; unlinks one, swaps one)
//!                        --look--> desired state <--hint of the unlink, after the walk--
//! Created hint --> watcher --entry_present--> RecordingSource (table; binds the socket)
//!                          --look--> desired state
//! ```

use plugin_agent::event_source::{Entry, EventSource, FsEvent, Observed, SourceKind, WatchedDir};
use plugin_agent::notifications::NotificationBus;
use plugin_agent::state::desired::DesiredState;
use plugin_agent::state::queue::ReconcileQueue;
use plugin_agent::telemetry::Telemetry;
use plugin_agent::watcher::Watcher;
use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What the source does to the tree when the walk announces the sockets of the root.
struct Race {
    /// Unlinked once announced: the source reports it, as the kernel reports an unlink of a name
    /// in its table.
    unlinked: PathBuf,
    /// Replaced by a regular file once announced: the walk's look finds no socket.
    swapped: PathBuf,
}

struct RecordingSource {
    root: PathBuf,
    /// (directory, name) pairs announced and not withdrawn: the source's name table.
    table: Mutex<BTreeSet<(PathBuf, OsString)>>,
    /// How many times a socket was announced one by one (not with the rest of its directory).
    one_by_one: Mutex<usize>,
    race: Mutex<Option<Race>>,
    /// Bound by the source when the watcher announces its name (one by one).
    bind_when_announced: Option<PathBuf>,
    bound: Mutex<Vec<std::os::unix::net::UnixListener>>,
    /// The watcher's channel; taken away after the first walk, which ends the watcher once it
    /// has handled what was sent.
    hints: Mutex<Option<mpsc::Sender<FsEvent>>>,
}

impl EventSource for RecordingSource {
    fn kind(&self) -> SourceKind {
        SourceKind::Ebpf
    }
    fn describe(&self) -> String {
        "a source that records announcements".into()
    }
    fn watch(&self, _dir: &WatchedDir) -> anyhow::Result<()> {
        Ok(())
    }
    fn unwatch(&self, _dir: &WatchedDir) {}
    fn entry_present(&self, dir: &WatchedDir, name: &OsStr, entry: Entry) -> bool {
        if entry == Entry::Socket {
            *self.one_by_one.lock().expect("lock") += 1;
        }
        let path = dir.path.join(name);
        if self.bind_when_announced.as_ref() == Some(&path) {
            let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
            self.bound.lock().expect("lock").push(listener);
        }
        self.table
            .lock()
            .expect("lock")
            .insert((dir.path.clone(), name.to_os_string()))
    }
    fn sockets_present(&self, dir: &WatchedDir, names: &[&OsStr]) -> Vec<bool> {
        let new = {
            let mut table = self.table.lock().expect("lock");
            names
                .iter()
                .map(|name| table.insert((dir.path.clone(), name.to_os_string())))
                .collect()
        };
        if dir.path == self.root
            && let Some(race) = self.race.lock().expect("lock").take()
        {
            std::fs::remove_file(&race.unlinked).expect("unlink");
            if let Some(hints) = &*self.hints.lock().expect("lock") {
                hints
                    .try_send(FsEvent::Removed {
                        path: race.unlinked,
                        observed: Observed::default(),
                    })
                    .expect("room in the channel");
            }
            std::fs::remove_file(&race.swapped).expect("unlink");
            std::fs::write(&race.swapped, b"no longer a socket").expect("write");
        }
        new
    }
    fn entry_absent(&self, dir: &WatchedDir, name: &OsStr) {
        self.table
            .lock()
            .expect("lock")
            .remove(&(dir.path.clone(), name.to_os_string()));
    }
}

/// Runs a watcher of `root` with `source`: its first walk, then the hints in `rx`, then the end
/// of the channel (the source gives its sender up after the walk), which stops the watcher: the
/// sync point. Returns the desired state it left.
async fn watch_once(
    root: &std::path::Path,
    source: &Arc<RecordingSource>,
    rx: mpsc::Receiver<FsEvent>,
) -> Arc<DesiredState> {
    let desired = Arc::new(DesiredState::default());
    let watcher = Watcher::new(
        root.to_path_buf(),
        source.clone(),
        desired.clone(),
        Arc::new(ReconcileQueue::default()),
        NotificationBus::default(),
        Telemetry::new(SourceKind::Ebpf),
    );
    let after_walk = source.clone();
    let ended = watcher
        .run(rx, CancellationToken::new(), move || {
            after_walk.hints.lock().expect("lock").take();
        })
        .await;
    assert!(ended.is_err(), "the watcher stops when its source does");
    desired
}

#[tokio::test]
async fn a_walk_announces_before_it_looks_and_withdraws_what_it_did_not_find() {
    let base = tempfile::Builder::new()
        .prefix("pa-walk-")
        .tempdir()
        .expect("tempdir");
    let root = base.path().join("plugins");
    std::fs::create_dir_all(root.join("sub")).expect("mkdir");
    // More sockets than one batch of the walk (256), so the root is announced in several.
    let mut listeners = Vec::new();
    for i in 0..300 {
        let path = root.join(format!("p-{i}.sock"));
        listeners.push(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
    }
    listeners.push(std::os::unix::net::UnixListener::bind(root.join("sub/s.sock")).expect("bind"));
    std::fs::write(root.join("file"), b"not a socket").expect("write");

    let (hints, rx) = mpsc::channel(16);
    let source = Arc::new(RecordingSource {
        root: root.clone(),
        table: Mutex::default(),
        one_by_one: Mutex::default(),
        race: Mutex::new(Some(Race {
            unlinked: root.join("p-7.sock"),
            swapped: root.join("p-8.sock"),
        })),
        bind_when_announced: None,
        bound: Mutex::default(),
        hints: Mutex::new(Some(hints)),
    });
    // The first walk, then the removal the source reported during it.
    let desired = watch_once(&root, &source, rx).await;

    let expected: BTreeSet<PathBuf> = (0..300)
        .filter(|i| *i != 7 && *i != 8)
        .map(|i| root.join(format!("p-{i}.sock")))
        .chain([root.join("sub/s.sock")])
        .collect();
    let held: BTreeSet<PathBuf> = desired.snapshot().into_iter().map(|(p, _)| p).collect();
    assert_eq!(held, expected, "desired state is the sockets in the tree");
    // The name table holds the names of what is in the tree: no socket that went while the walk
    // looked, no regular file; the sub-directory's name (it is a path's parent) and its socket.
    let table = source.table.lock().expect("lock").clone();
    let sockets_named: BTreeSet<PathBuf> = table
        .iter()
        .map(|(dir, name)| dir.join(name))
        .filter(|path| path.extension().is_some_and(|e| e == "sock"))
        .collect();
    assert_eq!(
        sockets_named, expected,
        "the table names the sockets in the tree"
    );
    assert!(
        table.contains(&(root.clone(), OsString::from("sub"))),
        "{table:?}"
    );
    assert_eq!(
        *source.one_by_one.lock().expect("lock"),
        0,
        "every socket was announced with its directory's, before the walk looked at it"
    );
    drop(listeners);
}

#[tokio::test]
async fn a_created_path_is_announced_before_it_is_looked_at() {
    let base = tempfile::Builder::new()
        .prefix("pa-created-")
        .tempdir()
        .expect("tempdir");
    let root = base.path().join("plugins");
    std::fs::create_dir_all(&root).expect("mkdir");
    let early = root.join("early.sock");
    let _early = std::os::unix::net::UnixListener::bind(&early).expect("bind");
    // Bound by the source at the moment its name is announced: only a look made after the
    // announcement finds it.
    let late = root.join("late.sock");
    // Never there: announced, looked at, withdrawn.
    let never = root.join("never.sock");

    let (hints, rx) = mpsc::channel(16);
    for path in [&late, &never, &early] {
        hints
            .try_send(FsEvent::Created {
                path: path.clone(),
                observed: Observed::default(),
            })
            .expect("room in the channel");
    }
    let source = Arc::new(RecordingSource {
        root: root.clone(),
        table: Mutex::default(),
        one_by_one: Mutex::default(),
        race: Mutex::new(None),
        bind_when_announced: Some(late.clone()),
        bound: Mutex::default(),
        hints: Mutex::new(Some(hints)),
    });
    // The first walk, then the hints sent before it.
    let desired = watch_once(&root, &source, rx).await;

    let expected = BTreeSet::from([early.clone(), late.clone()]);
    let held: BTreeSet<PathBuf> = desired.snapshot().into_iter().map(|(p, _)| p).collect();
    assert_eq!(held, expected, "desired state is the sockets in the tree");
    let table: BTreeSet<PathBuf> = source
        .table
        .lock()
        .expect("lock")
        .iter()
        .map(|(dir, name)| dir.join(name))
        .filter(|path| path.extension().is_some_and(|e| e == "sock"))
        .collect();
    assert_eq!(table, expected, "the table names the sockets in the tree");
    assert_eq!(
        source.bound.lock().expect("lock").len(),
        1,
        "the late socket was bound when its name was announced, and found by the look after"
    );
}
