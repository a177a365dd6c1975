//! The fanotify reader task: drains the group, resolves each record's directory handle to a
//! watched directory, and turns records into [`FsEvent`]s for the watcher (a queue overflow or a
//! record that does not parse into a rescan).

use std::ffi::OsStr;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::handles::{DirHandle, DirTable, Group, lock};
use super::records;
use crate::event_source::{FsEvent, Observed};
use crate::provenance::Actor;

/// Most events turned into [`FsEvent`]s before they are handed on, so that a flood is read in
/// bounded batches rather than all at once.
const MAX_BATCH: usize = 4096;

/// One `read(2)` worth of events; the largest event (metadata + handle + name) is well below this.
const READ_BUF: usize = 64 * 1024;

/// The task that drains the group and feeds the watcher.
pub(super) struct Reader {
    pub(super) group: Arc<AsyncFd<Group>>,
    pub(super) dirs: Arc<Mutex<DirTable>>,
    pub(super) sink: mpsc::Sender<FsEvent>,
    pub(super) own_pid: i32,
}

impl Reader {
    pub(super) async fn run(self, stop: CancellationToken) {
        let mut buf = vec![0u8; READ_BUF];
        let mut batch = Vec::new();
        loop {
            let mut ready = tokio::select! {
                _ = stop.cancelled() => return,
                ready = self.group.readable() => match ready {
                    Ok(ready) => ready,
                    Err(error) => {
                        self.fail(&stop, format!("fanotify fd cannot be polled: {error}")).await;
                        return;
                    }
                },
            };
            // Drain what is readable now, up to a batch; `try_io` clears readiness on EAGAIN.
            while batch.len() < MAX_BATCH {
                match ready.try_io(|group| {
                    nix::unistd::read(group.get_ref().0.as_fd(), &mut buf).map_err(io::Error::from)
                }) {
                    Ok(Ok(0)) => break,
                    Ok(Ok(n)) => self.interpret(&buf[..n], &mut batch),
                    Ok(Err(error)) if error.kind() == io::ErrorKind::Interrupted => continue,
                    Ok(Err(error)) => {
                        drop(ready);
                        self.fail(&stop, format!("reading the fanotify fd failed: {error}"))
                            .await;
                        return;
                    }
                    Err(_would_block) => break,
                }
            }
            drop(ready);
            for event in batch.drain(..) {
                if !deliver(&self.sink, &stop, event).await {
                    return;
                }
            }
        }
    }

    /// Turns one read's worth of records into events, appending to `out`.
    fn interpret(&self, buf: &[u8], out: &mut Vec<FsEvent>) {
        let mut dirs = lock(&self.dirs);
        for event in records::Events::new(buf) {
            let event = match event {
                Ok(event) => event,
                Err(malformed) => {
                    tracing::error!(%malformed, "malformed fanotify event; rescanning");
                    out.push(FsEvent::Rescan {
                        reason: format!("malformed fanotify event: {malformed}"),
                    });
                    continue;
                }
            };
            if event.mask & libc::FAN_Q_OVERFLOW != 0 {
                tracing::warn!("fanotify queue overflowed; rescanning");
                out.push(FsEvent::Rescan {
                    reason: "fanotify queue overflowed".to_string(),
                });
                continue;
            }
            // The agent's own filesystem activity is not reported, but still keeps the table right.
            let own = event.pid == self.own_pid;
            let Some(record) = event.dir else {
                tracing::debug!(
                    mask = event.mask,
                    "fanotify event without a directory record"
                );
                continue;
            };
            let key = DirHandle {
                fsid: record.fsid,
                handle_type: record.handle_type,
                handle: record.handle.to_vec(),
            };
            let Some(dir) = dirs.by_handle.get(&key) else {
                // A directory unwatched (or moved out of the tree) with events still queued.
                tracing::trace!(
                    mask = event.mask,
                    "fanotify event for an unwatched directory"
                );
                continue;
            };
            match record.name {
                None | Some(b".") => {
                    if !own && event.mask & (libc::FAN_DELETE_SELF | libc::FAN_MOVE_SELF) != 0 {
                        out.push(removed(dir.path.clone()));
                    }
                    if event.mask & libc::FAN_DELETE_SELF != 0 {
                        // The inode is gone and took the mark with it.
                        dirs.by_handle.remove(&key);
                    }
                }
                Some(name) if records::is_entry_name(name) => {
                    if !own {
                        let path = dir.path.join(OsStr::from_bytes(name));
                        entry_events(event.mask, path, by_pid(event.pid), out);
                    }
                }
                Some(name) => {
                    let name = String::from_utf8_lossy(name);
                    tracing::error!(%name, "impossible entry name from fanotify; rescanning");
                    out.push(FsEvent::Rescan {
                        reason: format!("fanotify reported an impossible entry name {name:?}"),
                    });
                }
            }
        }
    }

    /// The reader cannot go on: say so and ask for a rescan so nothing read so far is lost.
    async fn fail(&self, stop: &CancellationToken, reason: String) {
        tracing::error!(%reason, "fanotify reader stopped; no further events from this source");
        deliver(&self.sink, stop, FsEvent::Rescan { reason }).await;
    }
}

/// The events for a change to the entry at `path`. A mask saying both "appeared" and "gone" is
/// several events fanotify merged without keeping their order: `Removed` then `Created`, so a
/// watcher that takes them literally still ends on what its stat of `path` finds.
fn entry_events(mask: u64, path: PathBuf, by: Option<Actor>, out: &mut Vec<FsEvent>) {
    let appeared = mask & (libc::FAN_CREATE | libc::FAN_MOVED_TO) != 0;
    let gone = mask & (libc::FAN_DELETE | libc::FAN_MOVED_FROM) != 0;
    match (gone, appeared) {
        (true, true) => {
            out.push(removed(path.clone()));
            out.push(created(path, by));
        }
        (true, false) => out.push(removed(path)),
        (false, true) => out.push(created(path, by)),
        (false, false) => {}
    }
}

/// fanotify's one fact about who made a change: the pid (0 when the kernel withholds it, for an
/// unprivileged group, or the process is in no pid namespace the agent can see).
fn by_pid(pid: i32) -> Option<Actor> {
    let pid = u32::try_from(pid).ok().filter(|pid| *pid > 0)?;
    Some(Actor {
        pid,
        ..Actor::default()
    })
}

fn created(path: PathBuf, by: Option<Actor>) -> FsEvent {
    FsEvent::Created {
        path,
        observed: Observed {
            by,
            ..Observed::default()
        },
    }
}

fn removed(path: PathBuf) -> FsEvent {
    FsEvent::Removed {
        path,
        observed: Observed::default(),
    }
}

/// Sends with back-pressure; false when the reader should stop (cancelled or watcher gone).
async fn deliver(sink: &mpsc::Sender<FsEvent>, stop: &CancellationToken, event: FsEvent) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        sent = sink.send(event) => sent.is_ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events_for(mask: u64) -> Vec<FsEvent> {
        let mut out = Vec::new();
        entry_events(mask, PathBuf::from("/r/a.sock"), None, &mut out);
        out
    }

    #[test]
    fn create_and_moved_to_are_created() {
        let want = [created("/r/a.sock".into(), None)];
        assert_eq!(events_for(libc::FAN_CREATE), want);
        assert_eq!(events_for(libc::FAN_MOVED_TO), want);
        assert_eq!(events_for(libc::FAN_CREATE | libc::FAN_ONDIR), want);
    }

    #[test]
    fn delete_and_moved_from_are_removed() {
        let want = [removed("/r/a.sock".into())];
        assert_eq!(events_for(libc::FAN_DELETE), want);
        assert_eq!(events_for(libc::FAN_MOVED_FROM), want);
    }

    #[test]
    fn merged_create_and_delete_are_removed_then_created() {
        let want = [
            removed("/r/a.sock".into()),
            created("/r/a.sock".into(), None),
        ];
        assert_eq!(events_for(libc::FAN_CREATE | libc::FAN_DELETE), want);
        assert_eq!(events_for(libc::FAN_MOVED_FROM | libc::FAN_MOVED_TO), want);
    }

    #[test]
    fn other_bits_alone_report_nothing() {
        assert_eq!(events_for(libc::FAN_ONDIR), []);
    }
}
