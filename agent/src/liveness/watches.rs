//! The registrations and server processes liveness watches, under one lock: one entry per
//! registered path, one exit watch per server process however many sockets it serves, and what
//! each watch that ends leaves to abort.

use super::served::Known;
use crate::state::SocketId;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use tokio::task::AbortHandle;
use uuid::Uuid;

/// A registration whose server is known (or being learned). It stays until the registration is
/// deregistered or lost, also after its server's exit was decided (a handed-on listener), so the
/// kernel's hints about its socket still find it.
pub(super) struct Watch {
    pub(super) generation: Uuid,
    pub(super) socket: SocketId,
    /// A task of this registration's own: learning a restored registration's server, checking
    /// a server with no pidfd, or waiting on a pidfd that names no process identity.
    pub(super) task: Option<AbortHandle>,
    /// The server process whose exit this registration waits for, shared with every other
    /// socket it serves (see [`Processes`]).
    pub(super) process: Option<u64>,
    /// Who serves it, and how that was learned (`list` shows it).
    pub(super) known: Known,
}

/// One exit watch per server process, however many sockets it serves: a device-plugin manager
/// or a test harness serving thousands holds one pidfd in the agent and one waiting task, not
/// one of each per socket (at 10,000 registrations from two processes, the per-registration
/// tasks were 9.5 MB of the agent's 30 MB of heap, and 10,000 descriptors).
pub(super) struct ProcessWatch {
    pub(super) task: AbortHandle,
    /// Registrations whose `process` names this one; the watch ends with the last.
    pub(super) registrations: usize,
}

/// Keyed by the process's pidfs inode ([`super::Server::identity`]).
pub(super) type Processes = HashMap<u64, ProcessWatch>;

/// The registrations and server processes watched, under one lock.
#[derive(Default)]
pub(super) struct Watches {
    /// Keyed by the desired state's allocation of the path, shared with the watch's task.
    pub(super) by_path: crate::state::PathMap<Arc<Path>, Watch>,
    pub(super) processes: Processes,
}

impl Watches {
    /// Puts `watch` in for `path`, and returns the tasks to abort (the replaced watch's own
    /// task, a process watch nothing waits on any more) once the lock is released.
    pub(super) fn insert(&mut self, path: Arc<Path>, watch: Watch) -> Vec<AbortHandle> {
        match self.by_path.insert(path, watch) {
            Some(old) => self.release(old),
            None => Vec::new(),
        }
    }

    /// Removes `path`'s watch when it is of registration `generation`; returns what to abort.
    pub(super) fn remove(&mut self, path: &Path, generation: Uuid) -> Vec<AbortHandle> {
        let ours = self
            .by_path
            .get(path)
            .is_some_and(|w| w.generation == generation);
        match ours.then(|| self.by_path.remove(path)).flatten() {
            Some(old) => self.release(old),
            None => Vec::new(),
        }
    }

    /// What a watch that ends leaves to abort: its own task, and its process's watch when it was
    /// the last registration waiting on it.
    fn release(&mut self, old: Watch) -> Vec<AbortHandle> {
        let mut abort: Vec<AbortHandle> = old.task.into_iter().collect();
        if let Some(id) = old.process
            && let Some(process) = self.processes.get_mut(&id)
        {
            process.registrations -= 1;
            if process.registrations == 0
                && let Some(process) = self.processes.remove(&id)
            {
                abort.push(process.task);
            }
        }
        abort
    }
}

/// Aborts `tasks` (once the lock that found them is released).
pub(super) fn abort_all(tasks: Vec<AbortHandle>) {
    for task in tasks {
        task.abort();
    }
}
