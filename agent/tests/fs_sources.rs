//! The fanotify and inotify sources against the running kernel.
//!
//! Every scenario runs its filesystem actions in a child process (this test binary re-executed,
//! see [`helper_process_performs_filesystem_actions`]): fanotify drops events caused by the agent's
//! own pid, and the test process *is* the agent here. Each step ends with the child creating a
//! sentinel file in a second watched directory; events are collected until the sentinel's arrives,
//! so a step asserts exactly what was reported without sleeping.
//!
//! fanotify normally needs CAP_SYS_ADMIN (Linux >= 5.13 also allows an unprivileged group with a
//! bounded queue): when a group cannot be opened, the fanotify tests skip with a message, or fail
//! when `CI=true`.

use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use plugin_agent::event_source::fanotify::{self, FanotifyOptions};
use plugin_agent::event_source::inotify;
use plugin_agent::event_source::{EventSource, FsEvent, Observed, SourceKind, WatchedDir};
use tempfile::TempDir;
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Environment variable carrying the actions for the helper process.
const ACTIONS_ENV: &str = "FS_SOURCES_ACTIONS";

/// How long one step may take before the test gives up (a guard, not a wait).
const STEP_TIMEOUT: Duration = Duration::from_secs(20);

/// A filesystem action, performed by the helper process.
#[derive(Debug, Clone)]
enum Action {
    Bind(PathBuf),
    Unlink(PathBuf),
    Mkdir(PathBuf),
    Rmdir(PathBuf),
    Rename(PathBuf, PathBuf),
    Touch(PathBuf),
    /// Create `count` empty files named `f<i>` in a directory.
    TouchMany(PathBuf, usize),
}

impl Action {
    fn encode(&self) -> String {
        let p = |p: &Path| p.to_str().expect("test paths are UTF-8").to_string();
        match self {
            Action::Bind(a) => format!("bind\t{}", p(a)),
            Action::Unlink(a) => format!("unlink\t{}", p(a)),
            Action::Mkdir(a) => format!("mkdir\t{}", p(a)),
            Action::Rmdir(a) => format!("rmdir\t{}", p(a)),
            Action::Rename(a, b) => format!("rename\t{}\t{}", p(a), p(b)),
            Action::Touch(a) => format!("touch\t{}", p(a)),
            Action::TouchMany(a, n) => format!("touch_many\t{}\t{n}", p(a)),
        }
    }

    fn perform_encoded(line: &str) {
        let fields: Vec<&str> = line.split('\t').collect();
        let result = match fields[..] {
            ["bind", a] => UnixListener::bind(a).map(drop),
            ["unlink", a] => std::fs::remove_file(a),
            ["mkdir", a] => std::fs::create_dir(a),
            ["rmdir", a] => std::fs::remove_dir(a),
            ["rename", a, b] => std::fs::rename(a, b),
            ["touch", a] => std::fs::File::create(a).map(drop),
            ["touch_many", a, n] => (0..n.parse::<usize>().expect("count")).try_for_each(|i| {
                std::fs::File::create(Path::new(a).join(format!("f{i}"))).map(drop)
            }),
            _ => panic!("unknown action {line:?}"),
        };
        if let Err(error) = result {
            panic!("{line:?}: {error}");
        }
    }
}

/// Not a scenario: the body of the helper process. Does nothing unless started by [`act`].
#[test]
fn helper_process_performs_filesystem_actions() {
    if let Ok(actions) = std::env::var(ACTIONS_ENV) {
        actions.lines().for_each(Action::perform_encoded);
    }
}

/// Runs `actions` in a child process, in order, and waits for it; returns its pid.
fn act(actions: &[Action]) -> u32 {
    let script: Vec<String> = actions.iter().map(Action::encode).collect();
    let mut helper = Command::new(std::env::current_exe().expect("test binary path"))
        .args([
            "--exact",
            "helper_process_performs_filesystem_actions",
            "--test-threads=1",
            "--quiet",
        ])
        .env(ACTIONS_ENV, script.join("\n"))
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn helper process");
    let pid = helper.id();
    let status = helper.wait().expect("wait for the helper process");
    assert!(status.success(), "helper process failed on {actions:?}");
    pid
}

/// `event` without who made it, once that is checked: a source that names a process for a
/// creation must name `helper`, which made every change of a step (fanotify gives its pid;
/// inotify names nobody).
fn made_by(event: FsEvent, helper: u32) -> FsEvent {
    match event {
        FsEvent::Created { path, observed } => {
            if let Some(by) = observed.by {
                assert_eq!(
                    by.pid,
                    helper,
                    "{} was created by the helper",
                    path.display()
                );
            }
            FsEvent::Created {
                path,
                observed: Observed {
                    by: None,
                    ..observed
                },
            }
        }
        other => other,
    }
}

fn created(path: impl Into<PathBuf>) -> FsEvent {
    FsEvent::Created {
        path: path.into(),
        observed: Observed::default(),
    }
}

fn removed(path: impl Into<PathBuf>) -> FsEvent {
    FsEvent::Removed {
        path: path.into(),
        observed: Observed::default(),
    }
}

/// A source watching a scratch directory and a sentinel directory, with its event channel.
struct Harness {
    source: Box<dyn EventSource>,
    events: mpsc::Receiver<FsEvent>,
    /// The directory under test.
    dir: TempDir,
    /// Where steps end with a sentinel file; watched, but only sentinels happen there.
    sentinels: TempDir,
    /// A directory outside the watched ones, for moves in and out.
    outside: TempDir,
    steps: usize,
    _stop: DropGuard,
}

impl Harness {
    async fn open(
        kind: SourceKind,
        root: &Path,
        capacity: usize,
        bounded_fanotify: bool,
    ) -> Option<Self> {
        let (sink, events) = mpsc::channel(capacity);
        let cancel = CancellationToken::new();
        let source: Box<dyn EventSource> = match kind {
            SourceKind::Inotify => {
                Box::new(inotify::open(sink, cancel.clone()).expect("inotify opens"))
            }
            SourceKind::Fanotify => {
                let options = FanotifyOptions {
                    unlimited_queue: !bounded_fanotify,
                };
                match fanotify::open_with(sink, cancel.clone(), options) {
                    Ok(source) => Box::new(source),
                    Err(error) => {
                        let reason = format!("fanotify unavailable: {error:#}");
                        if std::env::var("CI").as_deref() == Ok("true") {
                            panic!("{reason} (CI=true: privileged tests must run)");
                        }
                        eprintln!("skipping: {reason}");
                        return None;
                    }
                }
            }
            SourceKind::Ebpf => unreachable!("not tested here"),
        };
        let harness = Harness {
            source,
            events,
            dir: scratch_dir(root),
            sentinels: scratch_dir(root),
            outside: scratch_dir(root),
            steps: 0,
            _stop: cancel.drop_guard(),
        };
        harness.watch(harness.dir.path());
        harness.watch(harness.sentinels.path());
        Some(harness)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn watch(&self, path: &Path) {
        let dir = WatchedDir::stat(path).expect("stat watched dir");
        self.source.watch(&dir).expect("watch");
    }

    /// Performs `actions` then a sentinel in a child process and returns everything reported
    /// before the sentinel's creation.
    async fn step(&mut self, actions: &[Action]) -> Vec<FsEvent> {
        self.steps += 1;
        let sentinel = self
            .sentinels
            .path()
            .join(format!("sentinel-{}", self.steps));
        let mut all = actions.to_vec();
        all.push(Action::Touch(sentinel.clone()));
        let helper = act(&all);
        let seen = self.collect_until(|ev| made_by(ev.clone(), helper) == created(&sentinel));
        seen.await
            .into_iter()
            .map(|ev| made_by(ev, helper))
            .collect()
    }

    /// Receives until `last` matches (excluded from the result).
    async fn collect_until(&mut self, last: impl Fn(&FsEvent) -> bool) -> Vec<FsEvent> {
        let mut seen = Vec::new();
        loop {
            match tokio::time::timeout(STEP_TIMEOUT, self.events.recv()).await {
                Ok(Some(ev)) if last(&ev) => return seen,
                Ok(Some(ev)) => seen.push(ev),
                Ok(None) => panic!("source closed the channel; got {seen:?}"),
                Err(_) => panic!("timed out; got {seen:?}"),
            }
        }
    }
}

/// Where scratch directories go: a tmpfs when there is one and the default temp dir (ext4 on a
/// typical node), so every scenario runs on both kinds of filesystem fanotify handles differently
/// (file handle encodings, fsid).
fn scratch_roots() -> Vec<PathBuf> {
    let mut roots = vec![std::env::temp_dir()];
    let shm = PathBuf::from("/dev/shm");
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    if shm.is_dir() && dev(&shm) != dev(&roots[0]) {
        roots.push(shm);
    }
    roots
}

fn scratch_dir(root: &Path) -> TempDir {
    tempfile::Builder::new()
        .prefix("fs-sources-")
        .tempdir_in(root)
        .expect("temp dir")
}

// ---- scenarios, shared by both sources ----

async fn socket_bound_then_unlinked(kind: SourceKind, root: &Path) {
    let Some(mut h) = Harness::open(kind, root, 64, false).await else {
        return;
    };
    let sock = h.path("a.sock");
    assert_eq!(
        h.step(&[Action::Bind(sock.clone())]).await,
        [created(&sock)]
    );
    assert_eq!(
        h.step(&[Action::Unlink(sock.clone())]).await,
        [removed(&sock)]
    );
}

async fn subdirectory_created_then_removed(kind: SourceKind, root: &Path) {
    let Some(mut h) = Harness::open(kind, root, 64, false).await else {
        return;
    };
    let sub = h.path("sub");
    assert_eq!(h.step(&[Action::Mkdir(sub.clone())]).await, [created(&sub)]);
    assert_eq!(h.step(&[Action::Rmdir(sub.clone())]).await, [removed(&sub)]);
}

async fn socket_renamed_into_within_and_out_of_dir(kind: SourceKind, root: &Path) {
    let Some(mut h) = Harness::open(kind, root, 64, false).await else {
        return;
    };
    let out_b = h.outside.path().join("b.sock");
    let out_c = h.outside.path().join("c.sock");
    let (b, c) = (h.path("b.sock"), h.path("c.sock"));
    let into = h
        .step(&[
            Action::Bind(out_b.clone()),
            Action::Rename(out_b, b.clone()),
        ])
        .await;
    assert_eq!(into, [created(&b)], "moved into the watched dir");
    let within = h.step(&[Action::Rename(b.clone(), c.clone())]).await;
    assert_eq!(within, [removed(&b), created(&c)], "renamed inside");
    let out = h.step(&[Action::Rename(c.clone(), out_c)]).await;
    assert_eq!(out, [removed(&c)], "moved out of the watched dir");
}

async fn watched_directory_removed_itself(kind: SourceKind, root: &Path) {
    let Some(mut h) = Harness::open(kind, root, 64, false).await else {
        return;
    };
    let dir = h.dir.path().to_path_buf();
    assert_eq!(h.step(&[Action::Rmdir(dir.clone())]).await, [removed(&dir)]);
}

async fn watched_subdirectory_moved_reports_old_and_new_paths(kind: SourceKind, root: &Path) {
    let Some(mut h) = Harness::open(kind, root, 64, false).await else {
        return;
    };
    let (sub, moved) = (h.path("sub"), h.path("moved"));
    assert_eq!(h.step(&[Action::Mkdir(sub.clone())]).await, [created(&sub)]);
    h.watch(&sub);
    let events = h.step(&[Action::Rename(sub.clone(), moved.clone())]).await;
    // The parent's moved-from/moved-to, then the sub-directory's own move.
    assert_eq!(events, [removed(&sub), created(&moved), removed(&sub)]);
}

async fn unwatched_directory_is_silent(kind: SourceKind, root: &Path) {
    let Some(mut h) = Harness::open(kind, root, 64, false).await else {
        return;
    };
    let dir = WatchedDir::stat(h.dir.path()).expect("stat");
    h.source.unwatch(&dir);
    assert_eq!(h.step(&[Action::Bind(h.path("x.sock"))]).await, []);
    // Unwatching twice, or something never watched, is harmless.
    h.source.unwatch(&dir);
}

async fn kernel_queue_overflow_becomes_rescan(kind: SourceKind, root: &Path) {
    // A one-slot channel that nobody reads while the helper floods the directory: the reader
    // blocks on delivery, the kernel queue fills and overflows.
    let Some(mut h) = Harness::open(kind, root, 1, true).await else {
        return;
    };
    let described = h.source.describe();
    assert!(described.contains("bounded"), "{described}");
    // Default queues hold 16384 events; the reader may hold one batch (4096) in memory.
    act(&[Action::TouchMany(h.dir.path().to_path_buf(), 40_000)]);
    let before = h
        .collect_until(|ev| matches!(ev, FsEvent::Rescan { .. }))
        .await;
    assert!(
        before.len() < 40_000,
        "a rescan arrives instead of every event ({} events first)",
        before.len()
    );
}

// ---- inotify ----

#[tokio::test]
async fn inotify_reports_socket_bound_then_unlinked() {
    for root in scratch_roots() {
        socket_bound_then_unlinked(SourceKind::Inotify, &root).await;
    }
}

#[tokio::test]
async fn inotify_reports_subdirectory_created_then_removed() {
    for root in scratch_roots() {
        subdirectory_created_then_removed(SourceKind::Inotify, &root).await;
    }
}

#[tokio::test]
async fn inotify_reports_socket_renamed_into_within_and_out_of_dir() {
    for root in scratch_roots() {
        socket_renamed_into_within_and_out_of_dir(SourceKind::Inotify, &root).await;
    }
}

#[tokio::test]
async fn inotify_reports_watched_directory_removed_itself() {
    for root in scratch_roots() {
        watched_directory_removed_itself(SourceKind::Inotify, &root).await;
    }
}

#[tokio::test]
async fn inotify_reports_watched_subdirectory_moved_with_old_and_new_paths() {
    for root in scratch_roots() {
        watched_subdirectory_moved_reports_old_and_new_paths(SourceKind::Inotify, &root).await;
    }
}

#[tokio::test]
async fn inotify_is_silent_for_unwatched_directory() {
    for root in scratch_roots() {
        unwatched_directory_is_silent(SourceKind::Inotify, &root).await;
    }
}

#[tokio::test]
async fn inotify_queue_overflow_becomes_rescan() {
    for root in scratch_roots() {
        kernel_queue_overflow_becomes_rescan(SourceKind::Inotify, &root).await;
    }
}

// ---- fanotify ----

#[tokio::test]
async fn fanotify_reports_socket_bound_then_unlinked() {
    for root in scratch_roots() {
        socket_bound_then_unlinked(SourceKind::Fanotify, &root).await;
    }
}

#[tokio::test]
async fn fanotify_reports_subdirectory_created_then_removed() {
    for root in scratch_roots() {
        subdirectory_created_then_removed(SourceKind::Fanotify, &root).await;
    }
}

#[tokio::test]
async fn fanotify_reports_socket_renamed_into_within_and_out_of_dir() {
    for root in scratch_roots() {
        socket_renamed_into_within_and_out_of_dir(SourceKind::Fanotify, &root).await;
    }
}

#[tokio::test]
async fn fanotify_reports_watched_directory_removed_itself() {
    for root in scratch_roots() {
        watched_directory_removed_itself(SourceKind::Fanotify, &root).await;
    }
}

#[tokio::test]
async fn fanotify_reports_watched_subdirectory_moved_with_old_and_new_paths() {
    for root in scratch_roots() {
        watched_subdirectory_moved_reports_old_and_new_paths(SourceKind::Fanotify, &root).await;
    }
}

#[tokio::test]
async fn fanotify_is_silent_for_unwatched_directory() {
    for root in scratch_roots() {
        unwatched_directory_is_silent(SourceKind::Fanotify, &root).await;
    }
}

#[tokio::test]
async fn fanotify_bounded_queue_overflow_becomes_rescan() {
    for root in scratch_roots() {
        kernel_queue_overflow_becomes_rescan(SourceKind::Fanotify, &root).await;
    }
}

#[tokio::test]
async fn fanotify_does_not_report_the_agents_own_activity() {
    let Some(mut h) = Harness::open(SourceKind::Fanotify, &std::env::temp_dir(), 64, false).await
    else {
        return;
    };
    // This process is the agent: its changes are dropped, the helper's are not.
    let own = h.path("own.sock");
    UnixListener::bind(&own).expect("bind");
    std::fs::create_dir(h.path("own-dir")).expect("mkdir");
    std::fs::remove_file(&own).expect("unlink");
    let theirs = h.path("theirs.sock");
    assert_eq!(
        h.step(&[Action::Bind(theirs.clone())]).await,
        [created(&theirs)]
    );
}

#[tokio::test]
async fn fanotify_describes_an_unlimited_queue_when_allowed() {
    let Some(h) = Harness::open(SourceKind::Fanotify, &std::env::temp_dir(), 64, false).await
    else {
        return;
    };
    let described = h.source.describe();
    assert!(described.contains("FAN_REPORT_DFID_NAME"), "{described}");
    assert!(described.contains("2 directory inode marks"), "{described}");
    // As root the queue is unlimited; otherwise the fallback is named.
    assert!(
        described.contains("unlimited queue") || described.contains("EPERM"),
        "{described}"
    );
}
