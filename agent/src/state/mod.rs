//! The two caches of the data flow, as in kubelet's plugin manager:
//!
//! - [`desired`]: what the filesystem says should be registered (written by the watcher);
//! - [`actual`]: what is registered with a handler (written by the operation executor).
//!
//! The reconciler compares them and asks the executor to close the gap.

pub mod actual;
pub mod desired;

use std::path::Path;

/// Who a socket is, beyond where it is: a socket re-created at the same path is a different plugin
/// instance, and must be re-registered and get a fresh backoff.
///
/// `(dev, ino)` alone is not enough on filesystems that reuse inode numbers at once (ext4), so the
/// birth time is part of the identity when the filesystem reports one (ext4, tmpfs, xfs, btrfs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct SocketId {
    /// `st_dev` of the filesystem holding the socket.
    pub dev: u64,
    /// `st_ino` of the socket inode.
    pub ino: u64,
    /// `statx` birth time in nanoseconds since the epoch, when the filesystem reports it.
    pub birth_ns: Option<i128>,
}

/// What `lstat` found at a path under the watched tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A Unix domain socket: a plugin candidate.
    Socket(SocketId),
    /// A directory: watched and walked.
    Directory { dev: u64, ino: u64 },
    /// A symlink, regular file, FIFO, device...: ignored (see the watcher's rules).
    Other,
}

impl EntryKind {
    /// Looks at `path` without following a final symlink.
    pub fn of(path: &Path) -> std::io::Result<EntryKind> {
        use nix::sys::stat::SFlag;
        let stx = statx(path)?;
        let mode =
            SFlag::from_bits_truncate(libc::mode_t::from(stx.stx_mode) & SFlag::S_IFMT.bits());
        let dev = libc::makedev(stx.stx_dev_major, stx.stx_dev_minor);
        Ok(match mode {
            SFlag::S_IFSOCK => {
                let birth_ns = (stx.stx_mask & libc::STATX_BTIME != 0).then(|| {
                    i128::from(stx.stx_btime.tv_sec) * 1_000_000_000
                        + i128::from(stx.stx_btime.tv_nsec)
                });
                EntryKind::Socket(SocketId {
                    dev,
                    ino: stx.stx_ino,
                    birth_ns,
                })
            }
            SFlag::S_IFDIR => EntryKind::Directory {
                dev,
                ino: stx.stx_ino,
            },
            _ => EntryKind::Other,
        })
    }
}

fn statx(path: &Path) -> std::io::Result<libc::statx> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let mut stx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: c_path is a valid NUL-terminated string and stx points to writable statx storage.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c_path.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW | libc::AT_STATX_SYNC_AS_STAT,
            libc::STATX_TYPE | libc::STATX_INO | libc::STATX_BTIME,
            stx.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statx returned 0, so the kernel filled the struct.
    Ok(unsafe { stx.assume_init() })
}
