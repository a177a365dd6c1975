//! Name hints (an entry a source could name but not place: an eBPF tracepoint saw a rename or an
//! `unlink` by a path it cannot resolve in the kernel) are checked together, once per batch, but
//! each keeps what its own record said: two sockets moved into the tree by two processes in the
//! same batch each name their own creator and carry their own timestamp, and so do two sockets
//! of the same name moved into two directories.
//!
//! ```text
//! NameChanged(a.sock, by 101) + NameChanged(b.sock, by 202) --one batch--> watcher
//!     --look at each name in every watched directory--> desired: a.sock by 101, b.sock by 202
//! ```

use plugin_agent::event_source::{EventSource, FsEvent, Observed, SourceKind, WatchedDir};
use plugin_agent::notifications::NotificationBus;
use plugin_agent::provenance::{Actor, Creator};
use plugin_agent::state::desired::DesiredState;
use plugin_agent::state::queue::ReconcileQueue;
use plugin_agent::telemetry::Telemetry;
use plugin_agent::watcher::Watcher;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Reports nothing by itself: the test sends its hints.
struct QuietSource;

impl EventSource for QuietSource {
    fn kind(&self) -> SourceKind {
        SourceKind::Ebpf
    }
    fn describe(&self) -> String {
        "a source whose hints the test sends".into()
    }
    fn watch(&self, _dir: &WatchedDir) -> anyhow::Result<()> {
        Ok(())
    }
    fn unwatch(&self, _dir: &WatchedDir) {}
}

fn by(pid: u32, kernel_ns: u64) -> Observed {
    Observed {
        kernel_ns: Some(kernel_ns),
        read_ns: None,
        by: Some(Actor {
            pid,
            uid: Some(pid),
            gid: Some(pid),
            comm: None,
            cgroup_id: None,
        }),
    }
}

#[tokio::test]
async fn name_hints_of_one_batch_each_keep_their_own_creator_and_timestamp() {
    let base = tempfile::Builder::new()
        .prefix("pa-hints-")
        .tempdir()
        .expect("tempdir");
    let root = base.path().join("plugins");
    std::fs::create_dir_all(root.join("d1")).expect("mkdir");
    std::fs::create_dir_all(root.join("d2")).expect("mkdir");
    let (a, b) = (root.join("a.sock"), root.join("b.sock"));
    let (d1, d2) = (root.join("d1/csi.sock"), root.join("d2/csi.sock"));

    let (hints, rx) = mpsc::channel(16);
    for (name, parent, observed) in [
        ("a.sock", None, by(101, 1_000)),
        ("b.sock", None, by(202, 2_000)),
        ("csi.sock", Some("d1"), by(303, 3_000)),
        ("csi.sock", Some("d2"), by(404, 4_000)),
    ] {
        hints
            .try_send(FsEvent::NameChanged {
                name: name.into(),
                parent: parent.map(Into::into),
                observed,
            })
            .expect("room in the channel");
    }
    let desired = Arc::new(DesiredState::default());
    let watcher = Watcher::new(
        root.clone(),
        Arc::new(QuietSource),
        desired.clone(),
        Arc::new(ReconcileQueue::default()),
        NotificationBus::default(),
        Telemetry::new(SourceKind::Ebpf),
    );
    // The sockets appear after the first walk (which would have found them itself) and before
    // the hints are handled; the channel then ends, which stops the watcher.
    let listeners = Arc::new(Mutex::new(Vec::new()));
    let paths = [a.clone(), b.clone(), d1.clone(), d2.clone()];
    let bound = listeners.clone();
    let hints = Mutex::new(Some(hints));
    let ended = watcher
        .run(rx, CancellationToken::new(), move || {
            for path in paths {
                let listener = std::os::unix::net::UnixListener::bind(path).expect("bind");
                bound.lock().expect("lock").push(listener);
            }
            hints.lock().expect("lock").take();
        })
        .await;
    assert!(ended.is_err(), "the watcher stops when its source does");

    for (path, pid, kernel_ns) in [
        (&a, 101, 1_000),
        (&b, 202, 2_000),
        (&d1, 303, 3_000),
        (&d2, 404, 4_000),
    ] {
        let entry = desired.get(path).expect("desired");
        match entry.creator {
            Creator::Recorded(actor) => assert_eq!(actor.pid, pid, "{}", path.display()),
            other => panic!("{}: creator {other:?}", path.display()),
        }
        assert_eq!(entry.kernel_ns, Some(kernel_ns), "{}", path.display());
        assert!(entry.by_event, "{}", path.display());
    }
    assert_eq!(listeners.lock().expect("lock").len(), 4);
}
