//! The agent's state, as in kubelet's plugin manager, and what is derived from it:
//!
//! - [`desired`]: what the filesystem says should be registered (written by the watcher);
//! - [`actual`]: what is registered with a handler (written by the operation executor);
//! - [`backoff`]: which socket instances failed and when they may be tried again (written by the
//!   executor);
//! - [`queue`]: which paths changed since the reconciler last looked (marked by the watcher, the
//!   executor and handler changes; taken by the reconciler);
//! - [`view`]: a plugin's state (pending, backing off, registered, ...) derived from the three
//!   tables in one place, for the admin API, the CLI and metrics;
//! - [`verdict`]: why a plugin is or is not registered (`explain`'s verdict, the `reason` of
//!   every view), derived from the same tables and what the node says;
//! - [`safety_pass`]: the safety pass's request to the watcher, and what its parts cost (the
//!   next pass waits until that is a small share of the CPU).
//!
//! The reconciler compares desired and actual state and asks the executor to close the gap. This
//! room imports nothing from the data flow's stages (only `handler`'s plugin types and `memory`),
//! so every stage and every view can import it.

/// The hasher of the tables keyed by socket path (desired, actual, backoff, queue, the executor's
/// claims and waits, liveness): std's SipHash fed a path component by component cost 30,000
/// instructions per registration, an eighth of the agent's (callgrind; docs/benchmarks.md,
/// "Where a registration's CPU goes"). foldhash is seeded at random per process, so which paths
/// collide cannot be chosen in advance by whoever creates sockets in the tree.
pub type PathHasher = foldhash::fast::RandomState;

pub use path_key::{PathKey, PathMap};

pub mod actual;
pub mod backoff;
pub mod desired;
pub mod path_key;
pub mod plugin_state;
pub mod queue;
pub mod safety_pass;
pub mod verdict;
pub mod view;

use std::ffi::CStr;
use std::os::fd::{AsRawFd as _, BorrowedFd};
use std::path::Path;

/// Who a socket is, beyond where it is: a socket re-created at the same path is a different plugin
/// instance, and must be re-registered and get a fresh backoff.
///
/// `(dev, ino)` alone is not enough: ext4 hands a freed inode number to the next new file at once,
/// and its birth time ticks only every few milliseconds, so a socket re-created quickly has the
/// same number and birth time. The file handle (`name_to_handle_at`) carries the inode's
/// generation, which ext4, tmpfs, xfs and btrfs draw at random for every new inode: it tells the
/// two apart. Birth time is kept for filesystems without file handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct SocketId {
    /// `st_dev` of the filesystem holding the socket.
    pub dev: u64,
    /// `st_ino` of the socket inode.
    pub ino: u64,
    /// `statx` birth time in nanoseconds since the epoch, when the filesystem reports it (an
    /// `i64` lasts until 2262, and keeps this key, held per socket, at 48 bytes).
    pub birth_ns: Option<i64>,
    /// Hash of the file handle (inode number and generation), when the filesystem exports handles;
    /// stable across builds (FNV-1a), as it is kept in the state file.
    pub handle: Option<u64>,
}

impl SocketId {
    /// When the socket was bound, where the file system records it.
    pub fn born(&self) -> Option<std::time::SystemTime> {
        let ns = u64::try_from(self.birth_ns?).ok()?;
        Some(std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns))
    }
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
        use nix::NixPath as _;
        // The path with its NUL on the stack (nix's copy, under 1 KiB), not a `CString`: two
        // looks per plugin, an allocation each.
        path.with_nix_path(|c_path| Self::at(nix::fcntl::AT_FDCWD, c_path))
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains NUL")
            })?
    }

    /// Looks at `name` in the open directory `dir` without following a final symlink: one
    /// lookup, where a path costs one per component (a walk of a deep tree is linear in its
    /// size this way, not quadratic).
    pub fn at(dir: BorrowedFd<'_>, name: &CStr) -> std::io::Result<EntryKind> {
        use nix::sys::stat::SFlag;
        let stx = statx(dir, name)?;
        let mode =
            SFlag::from_bits_truncate(libc::mode_t::from(stx.stx_mode) & SFlag::S_IFMT.bits());
        let dev = libc::makedev(stx.stx_dev_major, stx.stx_dev_minor);
        Ok(match mode {
            SFlag::S_IFSOCK => {
                let birth_ns = (stx.stx_mask & libc::STATX_BTIME != 0).then(|| {
                    stx.stx_btime
                        .tv_sec
                        .saturating_mul(1_000_000_000)
                        .saturating_add(i64::from(stx.stx_btime.tv_nsec))
                });
                EntryKind::Socket(SocketId {
                    dev,
                    ino: stx.stx_ino,
                    birth_ns,
                    handle: file_handle_hash(dir, name),
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

/// Hash of the entry's file handle, which includes the inode generation; `None` when the
/// filesystem has no file handles (or the entry vanished meanwhile).
fn file_handle_hash(dir: BorrowedFd<'_>, name: &CStr) -> Option<u64> {
    /// `struct file_handle` with room for the largest handle (`MAX_HANDLE_SZ`).
    #[repr(C)]
    struct FileHandle {
        handle_bytes: u32,
        handle_type: i32,
        f_handle: [u8; 128],
    }
    let mut handle = FileHandle {
        handle_bytes: 128,
        handle_type: 0,
        f_handle: [0; 128],
    };
    let mut mount_id: libc::c_int = 0;
    // SAFETY: `dir` is an open descriptor (or AT_FDCWD) and `name` NUL-terminated; handle has
    // handle_bytes of room after its header, as the syscall requires; mount_id is writable.
    // AT_SYMLINK_FOLLOW is not given: the entry itself.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut handle as *mut FileHandle,
            &mut mount_id as *mut libc::c_int,
            0,
        )
    };
    if rc != 0 {
        return None;
    }
    let len = (handle.handle_bytes as usize).min(handle.f_handle.len());
    Some(fnv1a(&[
        &handle.handle_type.to_le_bytes(),
        &handle.f_handle[..len],
    ]))
}

/// 64-bit FNV-1a over `parts`: a hash that stays the same across builds and Rust releases (the
/// standard library's `DefaultHasher` does not promise that), because socket identities are kept
/// in the state file across agent restarts and upgrades (`persist`).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    parts
        .iter()
        .flat_map(|part| part.iter())
        .fold(OFFSET, |hash, byte| {
            (hash ^ u64::from(*byte)).wrapping_mul(PRIME)
        })
}

fn statx(dir: BorrowedFd<'_>, name: &CStr) -> std::io::Result<libc::statx> {
    let mut stx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `dir` is an open descriptor (or AT_FDCWD), `name` NUL-terminated, and stx points
    // to writable statx storage.
    let rc = unsafe {
        libc::statx(
            dir.as_raw_fd(),
            name.as_ptr(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::fd::AsFd as _;

    /// Issue 44, item 7: a tree of 100,000 dead sockets holds one desired entry and one held
    /// backoff entry per socket; at 272 and 240 bytes (an `i128` birth time aligning the key to
    /// 16, a policy refusal's provenance and an unused first contact inline) they were ~60 MB of
    /// the agent's 158 MB there. What each socket keeps stays this small.
    #[test]
    fn what_the_agent_keeps_per_socket_stays_small() {
        use std::mem::size_of;
        assert_eq!(size_of::<SocketId>(), 48);
        // 192: 184, and 8 for when the socket was first seen listening (boxed, as its first
        // contact: a dead socket's entry holds no more than the pointer).
        assert!(size_of::<desired::DesiredPlugin>() <= 192);
        assert!(size_of::<backoff::Backoff>() <= 96);
        assert!(size_of::<backoff::FailureKind>() <= 32);
    }

    #[test]
    fn handle_hash_is_fnv1a_so_it_stays_the_same_across_builds() {
        // Published FNV-1a 64 test vectors: an identity kept in the state file must not change
        // with the compiler.
        assert_eq!(fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(&[b"a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(&[b"fo", b"obar"]), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn an_entry_looked_up_in_its_directory_is_what_its_path_says() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("p.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::os::unix::fs::symlink("p.sock", dir.path().join("link")).expect("symlink");
        let opened = std::fs::File::open(dir.path()).expect("open");
        for name in ["p.sock", "sub", "link"] {
            let c_name = CString::new(name).expect("name");
            let at = EntryKind::at(opened.as_fd(), &c_name).expect("at");
            let of = EntryKind::of(&dir.path().join(name)).expect("of");
            assert_eq!(at, of, "{name}");
        }
        let c_name = CString::new("p.sock").expect("name");
        match EntryKind::at(opened.as_fd(), &c_name).expect("at") {
            EntryKind::Socket(id) => assert!(id.handle.is_some() || id.birth_ns.is_some()),
            other => panic!("a socket looked up as {other:?}"),
        }
        let c_name = CString::new("link").expect("name");
        assert_eq!(
            EntryKind::at(opened.as_fd(), &c_name).expect("at"),
            EntryKind::Other,
            "a symlink to a socket is not followed"
        );
    }
}
