//! The fanotify group's descriptor and the table of watched directories by the handle fanotify
//! reports them with: what the source fills (`watch`, `unwatch`) and the reader looks up. Their
//! own file so that the reader needs nothing of the source's `fanotify.rs`.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::{Mutex, MutexGuard};

use anyhow::Context as _;
use nix::errno::Errno;
use nix::sys::fanotify::Fanotify;

use crate::event_source::WatchedDir;

/// The group fd, in a form `AsyncFd` accepts.
pub(super) struct Group(pub(super) Fanotify);

impl AsRawFd for Group {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Locks the table, whatever a panicking holder left: its map stays consistent.
pub(super) fn lock(dirs: &Mutex<DirTable>) -> MutexGuard<'_, DirTable> {
    // A panic while holding the lock leaves a consistent map (single inserts/removes).
    dirs.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Watched directories by the identity fanotify reports them with.
#[derive(Debug, Default)]
pub(super) struct DirTable {
    pub(super) by_handle: HashMap<DirHandle, WatchedDir>,
}

/// A directory's identity in fanotify records: filesystem id plus file handle.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct DirHandle {
    pub(super) fsid: [u8; 8],
    pub(super) handle_type: i32,
    pub(super) handle: Vec<u8>,
}

impl DirHandle {
    /// The handle of the open directory `fd`, encoded the way fanotify encodes it.
    pub(super) fn of(fd: BorrowedFd<'_>) -> anyhow::Result<Self> {
        let statfs = nix::sys::statfs::fstatfs(fd).context("fstatfs")?;
        let fsid = statfs.filesystem_id();
        // SAFETY: `fsid_t` is two `c_int`s (8 bytes, no padding) whose fields libc keeps private;
        // the kernel reports the same 8 bytes in every fanotify record.
        let fsid: [u8; 8] = unsafe { std::mem::transmute::<libc::fsid_t, [u8; 8]>(fsid) };
        // AT_HANDLE_FID (Linux 6.5) asks for the same encoding fanotify uses even on filesystems
        // that cannot be NFS-exported; older kernels reject the flag and use the export encoding,
        // which is what fanotify used there too.
        let (handle_type, handle) =
            match name_to_handle(fd, libc::AT_EMPTY_PATH | libc::AT_HANDLE_FID) {
                Err(Errno::EINVAL) => name_to_handle(fd, libc::AT_EMPTY_PATH),
                other => other,
            }
            .map_err(|errno| match errno {
                Errno::EOPNOTSUPP => anyhow::anyhow!(
                    "name_to_handle_at: the filesystem does not support file handles"
                ),
                errno => anyhow::anyhow!("name_to_handle_at: {}", errno.desc().to_lowercase()),
            })?;
        Ok(DirHandle {
            fsid,
            handle_type,
            handle,
        })
    }
}

/// `name_to_handle_at(fd, "", flags)`: (handle type, handle bytes). nix does not wrap it.
fn name_to_handle(fd: BorrowedFd<'_>, flags: libc::c_int) -> Result<(i32, Vec<u8>), Errno> {
    /// `struct file_handle` with room for the largest handle the kernel hands out.
    #[repr(C)]
    struct HandleBuf {
        handle_bytes: libc::c_uint,
        handle_type: libc::c_int,
        f_handle: [u8; libc::MAX_HANDLE_SZ as usize],
    }
    let mut buf = HandleBuf {
        handle_bytes: libc::MAX_HANDLE_SZ as libc::c_uint,
        handle_type: 0,
        f_handle: [0; libc::MAX_HANDLE_SZ as usize],
    };
    let mut mount_id: libc::c_int = 0;
    // SAFETY: `buf` is a `struct file_handle` header followed by `handle_bytes` bytes of storage,
    // the path is a NUL-terminated empty string (AT_EMPTY_PATH: the handle of `fd` itself), and
    // `mount_id` is a valid out-pointer; all outlive the call.
    let rc = unsafe {
        libc::name_to_handle_at(
            fd.as_raw_fd(),
            c"".as_ptr(),
            (&raw mut buf).cast::<libc::file_handle>(),
            &raw mut mount_id,
            flags,
        )
    };
    Errno::result(rc)?;
    let len = (buf.handle_bytes as usize).min(buf.f_handle.len());
    Ok((buf.handle_type, buf.f_handle[..len].to_vec()))
}
