//! The process serving a plugin's socket, as the registration connection's credentials name it
//! (`SO_PEERCRED`, `SO_PEERPIDFD`), and how its pidfd and pidfs identity are had.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// The process serving a plugin's socket, as the registration connection's credentials name it.
#[derive(Debug)]
pub struct Server {
    /// In the agent's pid namespace; `None` when the server is outside it (the kernel says 0).
    pub pid: Option<u32>,
    pub uid: u32,
    pub gid: u32,
    /// Readable once the process has exited; `None` when the kernel could not give one (the
    /// process exited already, or a kernel before 6.5 and a pid not visible here).
    pub(super) pidfd: Option<OwnedFd>,
    /// See [`identity`](Self::identity); read once, with the pidfd (admission and liveness
    /// both ask for it).
    identity: Option<u64>,
}

impl Server {
    /// The server at the other end of `connection` (a connected Unix stream).
    pub fn of(connection: BorrowedFd<'_>) -> io::Result<Server> {
        let cred =
            nix::sys::socket::getsockopt(&connection, nix::sys::socket::sockopt::PeerCredentials)
                .map_err(io::Error::from)?;
        let pid = u32::try_from(cred.pid()).ok().filter(|pid| *pid > 0);
        let pidfd = match peer_pidfd(connection) {
            PeerPidfd::Given(pidfd) => Some(pidfd),
            // The process that listened is gone (its listener handed on, or inherited by a
            // child): its pid may name another process by now, so it is not opened.
            PeerPidfd::ListenerGone => None,
            PeerPidfd::Unsupported => pid.and_then(pidfd_open),
        };
        let identity = pidfd.as_ref().and_then(|pidfd| pidfs_inode(pidfd.as_fd()));
        Ok(Server {
            pid,
            uid: cred.uid(),
            gid: cred.gid(),
            pidfd,
            identity,
        })
    }

    /// The kernel's handle on the server process, while it has one: what makes reading the
    /// process's `/proc` entries by pid safe against a recycled pid (see
    /// `provenance::Resolver::server`).
    pub fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(AsFd::as_fd)
    }

    /// Whether the agent can be woken by this server's exit.
    pub fn watchable(&self) -> bool {
        self.pidfd.is_some()
    }

    /// The process's identity for as long as the machine runs: its pidfd's inode on pidfs
    /// (Linux 6.9+: one inode per process, never reused). `None` on older kernels (pidfds are
    /// anonymous inodes there, all alike) or without a pidfd.
    pub fn identity(&self) -> Option<u64> {
        self.identity
    }
}

/// `pidfd`'s inode when it lives on pidfs (see [`Server::identity`]).
pub(super) fn pidfs_inode(pidfd: BorrowedFd<'_>) -> Option<u64> {
    if !crate::kernel::on_pidfs(pidfd).ok()? {
        return None;
    }
    nix::sys::stat::fstat(pidfd).ok().map(|stat| stat.st_ino)
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "pid {pid} uid {} gid {}", self.uid, self.gid),
            None => write!(
                f,
                "a process outside the agent's pid namespace, uid {} gid {}",
                self.uid, self.gid
            ),
        }
    }
}

/// What `SO_PEERPIDFD` gave for a connection.
pub(super) enum PeerPidfd {
    Given(OwnedFd),
    /// The kernel has no process for the peer any more (`EINVAL`/`ESRCH`/`ENODATA`): the
    /// process that called `listen` exited, though its listener lives on in another (kernels
    /// 6.5 to 6.15; since 6.16 the kernel gives a pidfd of the reaped process instead, which
    /// `provenance::Resolver::server` finds no longer holding its pid).
    ListenerGone,
    /// A kernel before 6.5 (`ENOPROTOOPT`).
    Unsupported,
}

/// `SO_PEERPIDFD` (Linux 6.5): the kernel's own pidfd for the peer, immune to pid reuse.
pub(super) fn peer_pidfd(connection: BorrowedFd<'_>) -> PeerPidfd {
    match crate::kernel::peer_pidfd(connection) {
        Ok(pidfd) => PeerPidfd::Given(pidfd),
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => PeerPidfd::Unsupported,
        Err(_) => PeerPidfd::ListenerGone,
    }
}

/// `pidfd_open(2)`, for kernels without `SO_PEERPIDFD`. The pid is `SO_PEERCRED`'s, the process
/// that called `listen`: if it exited and its listener lives on in another process, the pid may
/// name an unrelated process by now, and this opens that one. Kernels since 6.5 never take this
/// path (docs/operations.md, "What each kernel gives").
pub(super) fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    crate::kernel::pidfd_open(libc::pid_t::try_from(pid).ok()?).ok()
}

/// Waits for the process behind `pidfd` to exit.
pub(super) async fn exited(pidfd: OwnedFd) -> io::Result<()> {
    // SAFETY: the pidfd is owned by the AsyncFd and closed only when it is dropped, after its
    // registration is removed.
    let fd = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
        .map_err(|e| io::Error::other(e.to_string()))?;
    let _ready = fd.readable().await?;
    Ok(())
}

/// A pid for a log line, or what stands for one the agent cannot see.
pub(super) struct DisplayPid(pub(super) Option<u32>);

impl std::fmt::Display for DisplayPid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(pid) => write!(f, "pid {pid}"),
            None => f.write_str("pid unknown here"),
        }
    }
}
