//! One agent per runtime directory: an exclusive lock next to the admin socket.
//!
//! Why: the admin server replaces a stale socket file at start. Without a lock, a second
//! `plugin-agent run` with the same `--admin-socket` unlinked the live agent's socket (the first
//! agent never noticed), and both then registered the same plugins with the same handlers. The
//! lock is taken before anything else starts, so the second agent fails at once and says who
//! holds it. It is an `flock(2)` on `<socket dir>/plugin-agent.lock`: the kernel releases it when
//! the holder exits, however it exits, so a crashed agent never leaves a lock behind.

use anyhow::Context;
use nix::fcntl::{Flock, FlockArg};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The lock file's name, in the admin socket's directory.
pub const LOCK_FILE: &str = "plugin-agent.lock";

/// The held lock; released when dropped (or when the process exits).
#[derive(Debug)]
pub struct RuntimeDirLock {
    _lock: Flock<std::fs::File>,
    path: PathBuf,
}

impl RuntimeDirLock {
    /// Where the lock file is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Creates the admin socket's directory (0700) if needed and locks it for this process, or fails
/// naming the running agent.
pub fn lock(admin_socket: &Path) -> anyhow::Result<RuntimeDirLock> {
    match try_lock(admin_socket)? {
        Ok(lock) => Ok(lock),
        Err(Held { holder, lock_file }) => anyhow::bail!(
            "another plugin-agent (pid {holder}) is running with admin socket {}: it holds {}; \
             stop it first, or give this one its own --admin-socket",
            admin_socket.display(),
            lock_file.display()
        ),
    }
}

/// A runtime directory another process has locked: an agent runs with it.
#[derive(Debug)]
pub struct Held {
    /// The holder's pid as it wrote it, or "unknown".
    pub holder: String,
    pub lock_file: PathBuf,
}

/// [`lock`], telling a running agent (`Ok(Err(..))`) from a failure to lock at all.
pub fn try_lock(admin_socket: &Path) -> anyhow::Result<Result<RuntimeDirLock, Held>> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = admin_socket
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create runtime directory {}", dir.display()))?;
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .with_context(|| format!("cannot open lock file {}", path.display()))?;
    let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            return Ok(Err(Held {
                holder: if holder.is_empty() { "unknown" } else { holder }.to_owned(),
                lock_file: path,
            }));
        }
        Err((_, errno)) => {
            return Err(std::io::Error::from(errno))
                .with_context(|| format!("cannot lock {}", path.display()));
        }
    };
    // The holder's pid, for the message above; the lock, not this content, is what counts.
    let _ = lock.set_len(0);
    let _ = lock.rewind();
    let _ = write!(lock, "{}", std::process::id());
    Ok(Ok(RuntimeDirLock { _lock: lock, path }))
}

/// Whether an agent runs with the runtime directory whose lock file is `lock_file` (a path that
/// may lead into another mount namespace through `/proc/<pid>/root`), without creating anything:
/// a missing file is no agent; a file that cannot be opened or locked counts as one running.
pub fn is_held(lock_file: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(lock_file)
    {
        Ok(file) => file,
        Err(e) => return e.kind() != std::io::ErrorKind::NotFound,
    };
    // A shared lock conflicts with the running agent's exclusive one, and is let go at once.
    Flock::lock(file, FlockArg::LockSharedNonblock).is_err()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_directory_is_refused_and_names_the_holder() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("run/agent.sock");
        let first = lock(&socket).expect("first lock");
        assert!(first.path().ends_with(LOCK_FILE));
        let error = lock(&socket).expect_err("second lock refused");
        let text = format!("{error:#}");
        assert!(text.contains(&std::process::id().to_string()), "{text}");
        assert!(is_held(first.path()));
        let lock_file = first.path().to_path_buf();
        drop(first);
        assert!(!is_held(&lock_file));
        assert!(!is_held(&dir.path().join("no-such/plugin-agent.lock")));
        lock(&socket).expect("free again once the holder let go");
    }
}
