//! Hostile paths and names, fuzzed: whatever an event source reports (paths outside the root,
//! `..` and `.` components, dot-names, arbitrary bytes, names with `/`, odd things to statx), the
//! watcher never panics and its desired state stays exactly the plugin sockets in the tree.
//!
//! ```text
//! proptest --arbitrary FsEvents--> channel --> the real Watcher (fake source) --> DesiredState
//!                                                                  == sockets actually in the tree
//! ```

use plugin_agent::event_source::{EventSource, FsEvent, Observed, SourceKind, WatchedDir};
use plugin_agent::notifications::NotificationBus;
use plugin_agent::state::EntryKind;
use plugin_agent::state::desired::DesiredState;
use plugin_agent::state::queue::ReconcileQueue;
use plugin_agent::telemetry::Telemetry;
use plugin_agent::watcher::Watcher;
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A source that reports nothing by itself: the test feeds the events.
struct FedSource;

impl EventSource for FedSource {
    fn kind(&self) -> SourceKind {
        SourceKind::Inotify
    }
    fn describe(&self) -> String {
        "events fed by the test".into()
    }
    fn watch(&self, _dir: &WatchedDir) -> anyhow::Result<()> {
        Ok(())
    }
    fn unwatch(&self, _dir: &WatchedDir) {}
}

/// A tree with the things a hostile node has in it, next to two real plugin sockets.
struct Tree {
    _base: tempfile::TempDir,
    root: PathBuf,
    outside: PathBuf,
    _listeners: Vec<std::os::unix::net::UnixListener>,
}

impl Tree {
    fn new() -> Tree {
        let base = tempfile::Builder::new()
            .prefix("pa-fuzz-")
            .tempdir()
            .expect("tempdir");
        let root = base.path().join("r");
        let outside = base.path().join("outside");
        for d in [&root, &root.join("sub"), &root.join(".hidden"), &outside] {
            std::fs::create_dir_all(d).expect("mkdir");
        }
        let bind = |p: PathBuf| std::os::unix::net::UnixListener::bind(p).expect("bind");
        let listeners = vec![
            bind(root.join("a.sock")),
            bind(root.join("sub/b.sock")),
            bind(root.join(".dot.sock")),
            bind(root.join(".hidden/c.sock")),
            bind(outside.join("o.sock")),
        ];
        std::os::unix::fs::symlink(outside.join("o.sock"), root.join("link.sock")).expect("ln");
        std::os::unix::fs::symlink(&outside, root.join("outside-dir")).expect("ln");
        std::os::unix::fs::symlink("loop", root.join("loop")).expect("ln");
        std::fs::write(root.join("file"), b"not a socket").expect("write");
        Tree {
            _base: base,
            root,
            outside,
            _listeners: listeners,
        }
    }

    /// The sockets the watcher must hold, whatever it is told.
    fn plugins(&self) -> BTreeSet<PathBuf> {
        [self.root.join("a.sock"), self.root.join("sub/b.sock")]
            .into_iter()
            .collect()
    }
}

/// A path component a hostile or buggy source could produce.
fn component() -> impl Strategy<Value = OsString> {
    prop_oneof![
        Just(OsString::from("..")),
        Just(OsString::from(".")),
        Just(OsString::from("")),
        Just(OsString::from("a.sock")),
        Just(OsString::from("sub")),
        Just(OsString::from("b.sock")),
        Just(OsString::from(".dot.sock")),
        Just(OsString::from(".hidden")),
        Just(OsString::from("link.sock")),
        Just(OsString::from("outside-dir")),
        Just(OsString::from("loop")),
        Just(OsString::from("file")),
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(OsString::from_vec),
    ]
}

/// Where a hinted path starts: the root, the directory next to it, or `/`.
#[derive(Debug, Clone, Copy)]
enum Base {
    Root,
    Outside,
    Slash,
}

/// An event, described independently of the temp directory the tree lands in.
#[derive(Debug, Clone)]
enum Hint {
    Created(Base, Vec<OsString>),
    Removed(Base, Vec<OsString>),
    Name(OsString),
    Rescan,
}

fn base() -> impl Strategy<Value = Base> {
    prop_oneof![Just(Base::Root), Just(Base::Outside), Just(Base::Slash)]
}

fn hint() -> impl Strategy<Value = Hint> {
    let parts = || proptest::collection::vec(component(), 0..5);
    prop_oneof![
        (base(), parts()).prop_map(|(b, p)| Hint::Created(b, p)),
        (base(), parts()).prop_map(|(b, p)| Hint::Removed(b, p)),
        component().prop_map(Hint::Name),
        Just(Hint::Rescan),
    ]
}

impl Tree {
    fn path(&self, base: Base, parts: Vec<OsString>) -> PathBuf {
        let mut path = match base {
            Base::Root => self.root.clone(),
            Base::Outside => self.outside.clone(),
            Base::Slash => PathBuf::from("/"),
        };
        path.extend(parts);
        path
    }

    fn event(&self, hint: Hint) -> FsEvent {
        let observed = Observed::default();
        match hint {
            Hint::Created(b, p) => FsEvent::Created {
                path: self.path(b, p),
                observed,
            },
            Hint::Removed(b, p) => FsEvent::Removed {
                path: self.path(b, p),
                observed,
            },
            Hint::Name(name) => FsEvent::NameChanged {
                name,
                parent: None,
                observed,
            },
            Hint::Rescan => FsEvent::Rescan {
                reason: "fuzz".into(),
            },
        }
    }
}

/// Runs the real watcher over `tree` with `events`, then returns its desired state.
fn watch(tree: &Tree, events: Vec<FsEvent>) -> BTreeSet<PathBuf> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let desired = Arc::new(DesiredState::default());
        let watcher = Watcher::new(
            tree.root.clone(),
            Arc::new(FedSource),
            desired.clone(),
            Arc::new(ReconcileQueue::default()),
            NotificationBus::default(),
            Telemetry::new(SourceKind::Inotify),
        );
        let (tx, rx) = mpsc::channel(events.len() + 1);
        for event in events {
            tx.send(event).await.expect("send");
        }
        // Closing the channel ends the run once every event is handled (the sync point).
        drop(tx);
        let ended = watcher.run(rx, CancellationToken::new(), || {}).await;
        assert!(ended.is_err(), "the watcher stops when its source does");
        desired.snapshot().into_iter().map(|(p, _)| p).collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Any sequence of hints, true or false, inside the tree or not: desired state is exactly
    /// the two plugin sockets (no dot-name, symlink, file, or socket outside the root).
    #[test]
    fn arbitrary_hints_leave_desired_state_equal_to_the_sockets_in_the_tree(
        hints in proptest::collection::vec(hint(), 0..40)
    ) {
        let tree = Tree::new();
        let events = hints.into_iter().map(|h| tree.event(h)).collect();
        prop_assert_eq!(watch(&tree, events), tree.plugins());
    }

    /// statx of any path (NUL bytes, over-long, non-UTF-8, through symlinks) is an answer or an
    /// error, never a panic; a symlink is never a socket or a directory.
    #[test]
    fn statx_of_any_path_answers_or_errs(parts in proptest::collection::vec(component(), 0..6)) {
        let tree = Tree::new();
        let mut path = tree.root.clone();
        for part in parts {
            path.push(part);
        }
        let kind = EntryKind::of(&path);
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            prop_assert!(matches!(kind, Ok(EntryKind::Other)), "{:?}: {:?}", path, kind);
        }
    }
}
