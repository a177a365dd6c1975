//! The inotify event source: the interface kubelet uses, kept as the fallback every kernel has.
//!
//! ```text
//! kernel inotify queue --read--> (watch descriptor, name) --wd table--> FsEvent --> watcher
//! ```
//!
//! One watch per watched directory; the table maps each watch descriptor back to the directory's
//! path so that (wd, name) becomes a path.
//!
//! What the kernel does and how it maps onto [`FsEvent`]:
//! - `IN_CREATE` / `IN_MOVED_TO` -> [`FsEvent::Created`]; `IN_DELETE` / `IN_MOVED_FROM` ->
//!   [`FsEvent::Removed`], for any kind of entry (the watcher stats it).
//! - `IN_DELETE_SELF` / `IN_MOVE_SELF` -> `Removed` for the watched directory itself.
//! - `IN_IGNORED` (the watch is gone: removed by us, or its directory deleted) drops the table
//!   entry.
//! - `IN_Q_OVERFLOW` (more than `fs.inotify.max_queued_events` unread) and `IN_UNMOUNT` (the
//!   filesystem under a watched directory went away) -> [`FsEvent::Rescan`].
//!
//! Limits: inotify does not say which process made a change, so unlike the other sources this one
//! reports the agent's own activity too (harmless: the watcher stats and finds nothing new).
//! Watches are added by path; the directory's identity is checked right after, so a directory
//! swapped in between is reported as an error rather than watched silently.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::Context as _;
use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{EventSource, FsEvent, Observed, SourceKind, WatchedDir};

/// Events asked for on every watched directory.
fn watch_mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
        | AddWatchFlags::IN_DONT_FOLLOW
}

/// Most events turned into [`FsEvent`]s before they are handed on, so that a flood is read in
/// bounded batches rather than all at once.
const MAX_BATCH: usize = 4096;

/// Opens an inotify source.
///
/// `sink` receives the events (with back-pressure); the reader task stops when `cancel` fires or
/// the returned source is dropped. Must be called inside a tokio runtime.
pub fn open(
    sink: mpsc::Sender<FsEvent>,
    cancel: CancellationToken,
) -> anyhow::Result<InotifySource> {
    tokio::runtime::Handle::try_current()
        .context("the inotify source must be opened inside a tokio runtime")?;
    let inotify =
        Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).map_err(|errno| {
            let hint = match errno {
                Errno::EMFILE => "; too many inotify instances (fs.inotify.max_user_instances)",
                Errno::ENOSYS => "; the kernel is built without inotify",
                _ => "",
            };
            anyhow::anyhow!("inotify_init1: {}{hint}", errno.desc().to_lowercase())
        })?;
    // SAFETY: `InotifyFd` owns the fd (inside `Inotify`), never replaces it, and closes it only
    // when dropped together with the `AsyncFd`; `as_raw_fd` always returns that same fd.
    let fd = unsafe { AsyncFd::register_with_interest(InotifyFd(inotify), Interest::READABLE) }
        .map_err(|e| anyhow::anyhow!("cannot register the inotify fd with tokio: {e}"))?;
    let shared = Arc::new(Shared {
        fd,
        watches: Mutex::new(HashMap::new()),
    });
    let stop = cancel.child_token();
    tokio::spawn(Reader::new(Arc::clone(&shared), sink).run(stop.clone()));
    Ok(InotifySource {
        shared,
        max_queued_events: std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
            .ok()
            .and_then(|s| s.trim().parse().ok()),
        _stop: stop.drop_guard(),
    })
}

/// An inotify instance with one watch per watched directory and the task that reads it.
pub struct InotifySource {
    shared: Arc<Shared>,
    max_queued_events: Option<u64>,
    /// Stops the reader when the source is dropped (the agent's token stops it too).
    _stop: DropGuard,
}

/// What the source and its reader share: the fd and the watch table.
struct Shared {
    fd: AsyncFd<InotifyFd>,
    watches: Mutex<HashMap<WatchDescriptor, WatchedDir>>,
}

impl Shared {
    fn inotify(&self) -> &Inotify {
        &self.fd.get_ref().0
    }

    fn watches(&self) -> MutexGuard<'_, HashMap<WatchDescriptor, WatchedDir>> {
        // A panic while holding the lock leaves a consistent map (single inserts/removes).
        self.watches
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The inotify fd, in a form `AsyncFd` accepts.
struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

impl EventSource for InotifySource {
    fn kind(&self) -> SourceKind {
        SourceKind::Inotify
    }

    fn describe(&self) -> String {
        let watches = self.shared.watches().len();
        let queue = match self.max_queued_events {
            Some(n) => format!("queue bounded at {n} events (fs.inotify.max_queued_events)"),
            None => "bounded queue (fs.inotify.max_queued_events)".to_string(),
        };
        format!(
            "inotify, {watches} directory watches (create, delete, moved from/to, delete/move \
             self), {queue}; overflow -> rescan; the agent's own changes are reported too"
        )
    }

    fn watch(&self, dir: &WatchedDir) -> anyhow::Result<()> {
        // Hold the table while adding so the reader never sees a wd it cannot resolve.
        let mut watches = self.shared.watches();
        let wd = self
            .shared
            .inotify()
            .add_watch(dir.path.as_path(), watch_mask())
            .map_err(|errno| {
                let hint = match errno {
                    Errno::ENOSPC => "; watch limit reached (fs.inotify.max_user_watches)",
                    Errno::ENOTDIR => "; not a directory",
                    _ => "",
                };
                anyhow::anyhow!(
                    "inotify_add_watch {}: {}{hint}",
                    dir.path.display(),
                    errno.desc().to_lowercase()
                )
            })?;
        let same = std::fs::symlink_metadata(&dir.path)
            .map(|meta| meta.dev() == dir.dev && meta.ino() == dir.ino)
            .unwrap_or(false);
        if !same {
            // Drop the watch we just added, unless that inode was already watched for its own
            // path. A failure leaves a watch whose events resolve to no table entry and are dropped.
            if !watches.contains_key(&wd)
                && let Err(errno) = self.shared.inotify().rm_watch(wd)
            {
                tracing::debug!(dir = %dir.path.display(), %errno, "inotify_rm_watch failed");
            }
            anyhow::bail!(
                "{} was replaced by another directory before it could be watched",
                dir.path.display()
            );
        }
        // The same inode always gets the same wd: a directory re-watched under a new path
        // (moved within the tree) simply updates its entry.
        watches.insert(wd, dir.clone());
        tracing::debug!(dir = %dir.path.display(), wd = wd.as_raw(), "inotify watch added");
        Ok(())
    }

    fn unwatch(&self, dir: &WatchedDir) {
        let mut watches = self.shared.watches();
        let Some(wd) = watches
            .iter()
            .find_map(|(wd, watched)| (watched == dir).then_some(*wd))
        else {
            return; // never watched, already gone, or re-watched under another path
        };
        watches.remove(&wd);
        // EINVAL: the kernel already dropped the watch (directory deleted); nothing to do.
        if let Err(errno) = self.shared.inotify().rm_watch(wd)
            && errno != Errno::EINVAL
        {
            tracing::debug!(dir = %dir.path.display(), %errno, "inotify_rm_watch failed");
        }
    }
}

/// The task that drains the inotify fd and feeds the watcher.
struct Reader {
    shared: Arc<Shared>,
    sink: mpsc::Sender<FsEvent>,
}

impl Reader {
    fn new(shared: Arc<Shared>, sink: mpsc::Sender<FsEvent>) -> Self {
        Reader { shared, sink }
    }

    async fn run(self, stop: CancellationToken) {
        let mut batch = Vec::new();
        loop {
            let mut ready = tokio::select! {
                _ = stop.cancelled() => return,
                ready = self.shared.fd.readable() => match ready {
                    Ok(ready) => ready,
                    Err(error) => {
                        self.fail(&stop, format!("inotify fd cannot be polled: {error}")).await;
                        return;
                    }
                },
            };
            // Drain what is readable now, up to a batch; `try_io` clears readiness on EAGAIN.
            while batch.len() < MAX_BATCH {
                match ready.try_io(|fd| fd.get_ref().0.read_events().map_err(io::Error::from)) {
                    Ok(Ok(events)) if events.is_empty() => break,
                    Ok(Ok(events)) => self.interpret(events, &mut batch),
                    Ok(Err(error)) if error.kind() == io::ErrorKind::Interrupted => continue,
                    Ok(Err(error)) => {
                        drop(ready);
                        self.fail(&stop, format!("reading the inotify fd failed: {error}"))
                            .await;
                        return;
                    }
                    Err(_would_block) => break,
                }
            }
            drop(ready);
            for event in batch.drain(..) {
                let delivered = tokio::select! {
                    _ = stop.cancelled() => false,
                    sent = self.sink.send(event) => sent.is_ok(),
                };
                if !delivered {
                    return;
                }
            }
        }
    }

    /// Turns kernel events into [`FsEvent`]s, appending to `out`, and keeps the table current.
    fn interpret(&self, events: Vec<InotifyEvent>, out: &mut Vec<FsEvent>) {
        let mut watches = self.shared.watches();
        for event in events {
            let mask = event.mask;
            if mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                tracing::warn!("inotify queue overflowed; rescanning");
                out.push(FsEvent::Rescan {
                    reason: "inotify queue overflowed".to_string(),
                });
                continue;
            }
            let Some(dir) = watches.get(&event.wd) else {
                // A watch removed by unwatch() with events still queued.
                tracing::trace!(wd = event.wd.as_raw(), "inotify event for an unwatched wd");
                continue;
            };
            if mask.contains(AddWatchFlags::IN_UNMOUNT) {
                tracing::warn!(
                    dir = %dir.path.display(),
                    "filesystem unmounted under a watched directory; rescanning"
                );
                out.push(FsEvent::Rescan {
                    reason: format!("filesystem unmounted under {}", dir.path.display()),
                });
            }
            if mask.intersects(AddWatchFlags::IN_DELETE_SELF | AddWatchFlags::IN_MOVE_SELF) {
                out.push(removed(dir.path.clone()));
            }
            if let Some(name) = &event.name {
                let name = name.as_bytes();
                if !is_entry_name(name) {
                    let name = String::from_utf8_lossy(name);
                    tracing::error!(%name, "impossible entry name from inotify; rescanning");
                    out.push(FsEvent::Rescan {
                        reason: format!("inotify reported an impossible entry name {name:?}"),
                    });
                } else {
                    let path = dir.path.join(OsStr::from_bytes(name));
                    if mask.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
                        out.push(created(path));
                    } else if mask
                        .intersects(AddWatchFlags::IN_DELETE | AddWatchFlags::IN_MOVED_FROM)
                    {
                        out.push(removed(path));
                    }
                }
            }
            if mask.contains(AddWatchFlags::IN_IGNORED) {
                watches.remove(&event.wd);
            }
        }
    }

    /// The reader cannot go on: say so and ask for a rescan so nothing read so far is lost.
    async fn fail(&self, stop: &CancellationToken, reason: String) {
        tracing::error!(%reason, "inotify reader stopped; no further events from this source");
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = self.sink.send(FsEvent::Rescan { reason }) => {}
        }
    }
}

/// A name the kernel could report for an entry of a directory: one path component. inotify pads
/// names with NULs, which nix strips.
fn is_entry_name(name: &[u8]) -> bool {
    !name.is_empty() && name != b"." && name != b".." && !name.contains(&b'/')
}

fn created(path: PathBuf) -> FsEvent {
    FsEvent::Created {
        path,
        observed: Observed::default(),
    }
}

fn removed(path: PathBuf) -> FsEvent {
    FsEvent::Removed {
        path,
        observed: Observed::default(),
    }
}
