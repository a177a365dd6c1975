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
            anyhow::bail!(
                "another plugin-agent (pid {}) is running with admin socket {}: it holds {}; \
                 stop it first, or give this one its own --admin-socket",
                if holder.is_empty() { "unknown" } else { holder },
                admin_socket.display(),
                path.display()
            );
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
    Ok(RuntimeDirLock { _lock: lock, path })
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
        drop(first);
        lock(&socket).expect("free again once the holder let go");
    }
}
