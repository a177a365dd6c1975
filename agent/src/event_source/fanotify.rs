//! The fanotify event source: directory-entry events from a fanotify group.
//!
//! ```text
//! kernel fanotify queue --read--> records::Events --resolve dir handle--> FsEvent --> watcher
//! ```
//!
//! The group is created with `FAN_CLASS_NOTIF | FAN_REPORT_DFID_NAME`: every event names the
//! directory it happened in by *file handle* (plus the filesystem id) and the entry by name, and
//! carries the pid of the process that caused it. [`FanotifySource::watch`] puts one inode mark on
//! each watched directory and records that directory's handle (`name_to_handle_at`), so the reader
//! can turn (handle, name) back into a path without opening anything.
//!
//! What the kernel does and how it maps onto [`FsEvent`]:
//! - `FAN_CREATE` / `FAN_MOVED_TO` (files, sockets, and directories through `FAN_ONDIR`) ->
//!   [`FsEvent::Created`]; `FAN_DELETE` / `FAN_MOVED_FROM` -> [`FsEvent::Removed`].
//! - fanotify merges a new event into an unread one for the same (directory, name, pid), OR-ing
//!   the masks, so one event can say "created and deleted" without saying in which order. Such an
//!   event becomes `Removed` followed by `Created`: the watcher stats the path, so whatever the
//!   order was, what it finds is the truth.
//! - `FAN_DELETE_SELF` / `FAN_MOVE_SELF` on a watched directory -> `Removed` for that directory.
//! - `FAN_Q_OVERFLOW` -> [`FsEvent::Rescan`]. The queue is unbounded when the kernel allows
//!   `FAN_UNLIMITED_QUEUE`; otherwise it holds `fs.fanotify.max_queued_events` events.
//! - Events caused by the agent's own process are dropped (the trait's promise).
//! - A record that does not parse is logged and turned into a `Rescan`, never a panic.
//!
//! Limits: a mark lives on the inode, so a watched directory moved *out* of the tree keeps its mark
//! until it is deleted or the agent exits (its events are dropped: its handle is no longer in the
//! table). Needs Linux >= 5.9 (`FAN_REPORT_DFID_NAME`) and a filesystem that can encode file
//! handles (ext4, xfs, btrfs, tmpfs do). `CAP_SYS_ADMIN` is what the agent normally has; since
//! Linux 5.13 an unprivileged group works too, but only with the bounded queue (the kernel then
//! reports other processes' pids as 0 and still reports ours, so the own-pid filter holds).

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::fanotify::{EventFFlags, Fanotify, InitFlags, MarkFlags, MaskFlags};
use nix::sys::stat::Mode;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{EventSource, FsEvent, SourceKind, WatchedDir};

mod handles;
mod reader;
mod records;

use handles::{DirHandle, DirTable, Group, lock};
use reader::Reader;

/// How the fanotify group is set up; [`open`] uses the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FanotifyOptions {
    /// Ask for `FAN_UNLIMITED_QUEUE` (retrying without it if refused). Tests turn it off to make
    /// the kernel queue overflow on purpose.
    pub unlimited_queue: bool,
}

impl Default for FanotifyOptions {
    fn default() -> Self {
        FanotifyOptions {
            unlimited_queue: true,
        }
    }
}

/// Events asked for on every watched directory: entry changes (with `FAN_ONDIR`, also for
/// sub-directories) and the directory's own removal or move.
fn mark_mask() -> MaskFlags {
    MaskFlags::FAN_CREATE
        | MaskFlags::FAN_DELETE
        | MaskFlags::FAN_MOVED_FROM
        | MaskFlags::FAN_MOVED_TO
        | MaskFlags::FAN_DELETE_SELF
        | MaskFlags::FAN_MOVE_SELF
        | MaskFlags::FAN_ONDIR
}

/// Opens a fanotify source with the default options (unbounded queue when allowed).
///
/// `sink` receives the events (with back-pressure); the reader task stops when `cancel` fires or
/// the returned source is dropped. Must be called inside a tokio runtime.
pub fn open(
    sink: mpsc::Sender<FsEvent>,
    cancel: CancellationToken,
) -> anyhow::Result<FanotifySource> {
    open_with(sink, cancel, FanotifyOptions::default())
}

/// Opens a fanotify source with explicit [`FanotifyOptions`]; see [`open`].
pub fn open_with(
    sink: mpsc::Sender<FsEvent>,
    cancel: CancellationToken,
    options: FanotifyOptions,
) -> anyhow::Result<FanotifySource> {
    tokio::runtime::Handle::try_current()
        .context("the fanotify source must be opened inside a tokio runtime")?;
    let (group, queue) = init_group(options.unlimited_queue)?;
    // SAFETY: `Group` owns the fd (inside `Fanotify`), never replaces it, and closes it only when
    // dropped together with the `AsyncFd`; `as_raw_fd` always returns that same fd.
    let group = unsafe { AsyncFd::register_with_interest(Group(group), Interest::READABLE) }
        .map_err(|e| anyhow::anyhow!("cannot register the fanotify fd with tokio: {e}"))?;
    let group = Arc::new(group);
    let dirs = Arc::new(Mutex::new(DirTable::default()));
    let stop = cancel.child_token();
    let reader = Reader {
        group: Arc::clone(&group),
        dirs: Arc::clone(&dirs),
        sink,
        own_pid: i32::try_from(std::process::id()).unwrap_or(i32::MAX),
    };
    tokio::spawn(reader.run(stop.clone()));
    Ok(FanotifySource {
        group,
        dirs,
        queue,
        _stop: stop.drop_guard(),
    })
}

/// A fanotify group with one inode mark per watched directory and the task that reads it.
pub struct FanotifySource {
    group: Arc<AsyncFd<Group>>,
    dirs: Arc<Mutex<DirTable>>,
    queue: QueueLimit,
    /// Stops the reader when the source is dropped (the agent's token stops it too).
    _stop: DropGuard,
}

/// What bounds the kernel queue, for `describe()`.
#[derive(Debug, Clone)]
enum QueueLimit {
    Unlimited,
    /// Bounded by `fs.fanotify.max_queued_events`; `why` says whether we asked for more.
    Bounded {
        max_events: Option<u64>,
        why: &'static str,
    },
}

fn init_group(unlimited: bool) -> anyhow::Result<(Fanotify, QueueLimit)> {
    let base = InitFlags::FAN_CLASS_NOTIF
        | InitFlags::FAN_CLOEXEC
        | InitFlags::FAN_NONBLOCK
        // nix does not name the FID reporting flags; the bits are the kernel's.
        | InitFlags::from_bits_retain(libc::FAN_REPORT_DFID_NAME);
    let event_flags = EventFFlags::O_RDONLY | EventFFlags::O_CLOEXEC;
    let bounded = |why| QueueLimit::Bounded {
        max_events: read_sysctl("/proc/sys/fs/fanotify/max_queued_events"),
        why,
    };
    if unlimited {
        match Fanotify::init(base | InitFlags::FAN_UNLIMITED_QUEUE, event_flags) {
            Ok(group) => return Ok((group, QueueLimit::Unlimited)),
            Err(Errno::EPERM) => {
                tracing::warn!(
                    "fanotify_init refused FAN_UNLIMITED_QUEUE (EPERM); using the bounded queue, \
                     overflow will trigger rescans"
                );
                let group = Fanotify::init(base, event_flags).map_err(init_error)?;
                return Ok((group, bounded("FAN_UNLIMITED_QUEUE refused: EPERM")));
            }
            Err(e) => return Err(init_error(e)),
        }
    }
    let group = Fanotify::init(base, event_flags).map_err(init_error)?;
    Ok((group, bounded("bounded queue requested")))
}

fn init_error(errno: Errno) -> anyhow::Error {
    let refusal;
    let hint = match errno {
        Errno::EPERM => {
            use crate::kernel::permission_refusal;
            use caps::Capability::CAP_SYS_ADMIN;
            refusal = format!(
                "; {} (Linux >= 5.13 also allows an unprivileged fanotify group)",
                permission_refusal("fanotify_init(2)", &[CAP_SYS_ADMIN], None)
            );
            refusal.as_str()
        }
        Errno::EINVAL => "; the kernel lacks FAN_REPORT_DFID_NAME (needs Linux >= 5.9)",
        Errno::ENOSYS => "; the kernel is built without fanotify",
        Errno::EMFILE => "; too many fanotify groups (fs.fanotify.max_user_groups)",
        _ => "",
    };
    anyhow::anyhow!("fanotify_init: {}{hint}", errno.desc().to_lowercase())
}

fn read_sysctl(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl EventSource for FanotifySource {
    fn kind(&self) -> SourceKind {
        SourceKind::Fanotify
    }

    fn describe(&self) -> String {
        let marks = lock(&self.dirs).by_handle.len();
        let queue = match &self.queue {
            QueueLimit::Unlimited => "unlimited queue".to_string(),
            QueueLimit::Bounded { max_events, why } => match max_events {
                Some(n) => format!("queue bounded at {n} events ({why}); overflow -> rescan"),
                None => format!("bounded queue ({why}); overflow -> rescan"),
            },
        };
        format!(
            "fanotify FAN_CLASS_NOTIF|FAN_REPORT_DFID_NAME, {marks} directory inode marks \
             (create, delete, moved from/to, delete/move self, dirs included), {queue}"
        )
    }

    fn watch(&self, dir: &WatchedDir) -> anyhow::Result<()> {
        let fd = open_dir(dir)?;
        let handle = DirHandle::of(fd.as_fd())
            .with_context(|| format!("cannot get a file handle for {}", dir.path.display()))?;
        // Record the handle before marking, under the lock, so the first event finds it.
        let mut dirs = lock(&self.dirs);
        let previous = dirs.by_handle.insert(handle.clone(), dir.clone());
        let marked = self.group.get_ref().0.mark(
            MarkFlags::FAN_MARK_ADD | MarkFlags::FAN_MARK_ONLYDIR,
            mark_mask(),
            fd.as_fd(),
            None::<&Path>,
        );
        if let Err(errno) = marked {
            match previous {
                Some(previous) => dirs.by_handle.insert(handle, previous),
                None => dirs.by_handle.remove(&handle),
            };
            return Err(mark_error(errno, &dir.path));
        }
        tracing::debug!(dir = %dir.path.display(), "fanotify mark added");
        Ok(())
    }

    fn unwatch(&self, dir: &WatchedDir) {
        let mut dirs = lock(&self.dirs);
        let before = dirs.by_handle.len();
        dirs.by_handle.retain(|_, watched| watched != dir);
        if dirs.by_handle.len() == before {
            return; // never watched, already gone, or re-watched under another path
        }
        // The mark is removed through the path while it still names the same directory; a
        // directory that was deleted lost its mark with its inode, one moved away keeps it.
        if let Ok(fd) = open_dir(dir) {
            let removed = self.group.get_ref().0.mark(
                MarkFlags::FAN_MARK_REMOVE | MarkFlags::FAN_MARK_ONLYDIR,
                mark_mask(),
                fd.as_fd(),
                None::<&Path>,
            );
            if let Err(errno) = removed {
                tracing::debug!(dir = %dir.path.display(), %errno, "fanotify mark removal failed");
            }
        }
    }
}

/// Opens `dir` without following a symlink and checks it is still the directory the watcher
/// stat'ed (a directory replaced in between is an error, not a silent watch on the wrong inode).
/// `O_RDONLY` rather than `O_PATH`: fanotify_mark rejects `O_PATH` descriptors.
fn open_dir(dir: &WatchedDir) -> anyhow::Result<OwnedFd> {
    let fd = nix::fcntl::open(
        dir.path.as_path(),
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("cannot open directory {}", dir.path.display()))?;
    let st = nix::sys::stat::fstat(&fd)
        .with_context(|| format!("cannot stat directory {}", dir.path.display()))?;
    if st.st_dev != dir.dev || st.st_ino != dir.ino {
        anyhow::bail!(
            "{} was replaced by another directory before it could be watched",
            dir.path.display()
        );
    }
    Ok(fd)
}

fn mark_error(errno: Errno, path: &Path) -> anyhow::Error {
    let hint = match errno {
        Errno::ENODEV | Errno::EOPNOTSUPP | Errno::EXDEV => {
            "; the filesystem cannot report file handles to fanotify"
        }
        Errno::ENOSPC => "; too many marks (fs.fanotify.max_user_marks)",
        _ => "",
    };
    anyhow::anyhow!(
        "fanotify_mark {}: {}{hint}",
        path.display(),
        errno.desc().to_lowercase()
    )
}
