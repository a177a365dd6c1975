//! What liveness reports: a registered plugin found unserved (`Loss`, and how it was learned),
//! and the one connect that tells a listener from nothing.

use std::io;
use std::path::{Path, PathBuf};

use tokio::time::Instant;
use uuid::Uuid;

use crate::state::{EntryKind, SocketId};

/// How a liveness loss was learned: the `learned_by` label of metrics, spans and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LearnedBy {
    /// The server's pidfd said it exited, and a connect attempt was refused.
    Pidfd,
    /// A connect attempt was refused without a known server exit: a socket found at start (or
    /// restored) that nothing listens on.
    ConnectProbe,
    /// The kernel reported a descriptor of the listening socket closed (eBPF), and a connect
    /// attempt was refused.
    KernelRelease,
}

impl LearnedBy {
    pub fn label(self) -> &'static str {
        match self {
            LearnedBy::Pidfd => "pidfd",
            LearnedBy::ConnectProbe => "connect_probe",
            LearnedBy::KernelRelease => "kernel_release",
        }
    }
}

/// A registered plugin found unserved.
#[derive(Debug, Clone)]
pub struct Loss {
    pub path: PathBuf,
    /// The registration it ends (a newer one at the path is not touched).
    pub generation: Uuid,
    pub learned_by: LearnedBy,
    /// What was found, for operators.
    pub reason: String,
    /// When the agent learned the server was gone (its exit, or the refused connect).
    pub since: Instant,
}

/// What one connect attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// Something accepts connections (or will: its backlog is full).
    Served,
    /// Nothing listens on the socket.
    Refused,
    /// The path no longer holds this socket: the watcher sees to it.
    Replaced,
}

/// One connect to `socket` at `path`: what it found, and the connection when one was made.
pub async fn probe(path: &Path, socket: SocketId) -> (Probe, Option<tokio::net::UnixStream>) {
    if !matches!(EntryKind::of(path), Ok(EntryKind::Socket(id)) if id == socket) {
        return (Probe::Replaced, None);
    }
    match tokio::net::UnixStream::connect(path).await {
        Ok(stream) => (Probe::Served, Some(stream)),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => (Probe::Refused, None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => (Probe::Replaced, None),
        // A full backlog (EAGAIN) is a listener; a permission error says nothing about one.
        Err(e) => {
            tracing::debug!(socket_path = %path.display(), error = %e, "liveness probe inconclusive: counted as served");
            (Probe::Served, None)
        }
    }
}

/// Whether something accepts connections on `socket` at `path` now (one connect); false also
/// when the path no longer holds that socket.
pub async fn accepts(path: &Path, socket: SocketId) -> bool {
    probe(path, socket).await.0 == Probe::Served
}
