//! Types shared by the kernel programs and the agent: the ring-buffer event record, map keys and the
//! kernel struct offsets that userspace resolves from BTF at load time.
//!
//! ```text
//! agent (userspace)                               kernel programs (programs/)
//!   resolve KernelOffsets from BTF  --CONFIG-->   read task/file/dentry fields at those offsets
//!   WATCHED[DirKey] / NAMES[NameKey] --maps-->    filter by parent identity, or by entry name
//!   reader  <--EVENTS ring buffer-- Event <--     successful bind / unlink under a watched dir
//!   reader  <--LOSSES per-CPU counters--          any event that could not be recorded
//! ```
//!
//! Everything here is `#[repr(C)]`, `Copy`, and free of padding the two sides could disagree on, so
//! the agent reads the kernel's bytes as these types directly. The `user` feature adds `aya::Pod`.
#![no_std]

/// Bytes of an entry name, including the terminating NUL (`NAME_MAX + 1`).
pub const NAME_LEN: usize = 256;

/// Bytes of a task's command name, including the terminating NUL (`TASK_COMM_LEN`).
pub const COMM_LEN: usize = 16;

/// Bytes of the per-CPU buffer a syscall's path argument is copied into (`PATH_MAX`).
pub const PATH_BUF_LEN: usize = 4096;

/// Names of the maps and the global in the kernel object; the loader looks them up by these.
pub mod names {
    /// Ring buffer of [`crate::Event`]s.
    pub const EVENTS: &str = "EVENTS";
    /// Hash of watched directories, [`crate::DirKey`] -> `u8` (unused).
    pub const WATCHED: &str = "WATCHED";
    /// Hash of entry names present under the watched tree, [`crate::NameKey`] -> `u8` (unused).
    pub const NAMES: &str = "NAMES";
    /// Per-CPU array of `u64` loss counters, indexed by [`crate::loss`].
    pub const LOSSES: &str = "LOSSES";
    /// The [`crate::Config`] global.
    pub const CONFIG: &str = "CONFIG";
    /// `Array<u32>`, indexed by [`crate::agent`]: the agent's tgid, whose own filesystem activity
    /// is not reported back (0 reports everyone), and whether the name table is incomplete.
    /// Written by every agent that loads or adopts the programs.
    pub const AGENT: &str = "AGENT";
    /// `LruHashMap<u64, u64>`: per thread (`pid_tgid`), the traced VFS calls entered and not left
    /// (fentry/fexit family only; see [`crate::loss::FEXIT_SKIPPED`]). Sized by the loader.
    pub const IN_FLIGHT: &str = "IN_FLIGHT";
    /// `Array<[u8; META_BYTES]>`, one entry: what the loader computed (object hash, settings,
    /// hooks), for the next agent deciding whether to adopt the pinned programs. Never read by
    /// the programs.
    pub const META: &str = "META";
}

/// Size of the `META` map's one value.
pub const META_BYTES: usize = 4096;

/// Indexes into the `LOSSES` per-CPU counter array: why an event could not be recorded.
pub mod loss {
    /// `bpf_ringbuf_reserve` failed: the ring buffer was full.
    pub const RING_FULL: u32 = 0;
    /// The per-thread table that carries a syscall's arguments from entry to exit was full.
    pub const PENDING_FULL: u32 = 1;
    /// Not counted any more (the agent is the name table's one writer and handles a full table
    /// itself); the index stays so the counter array keeps its layout.
    pub const NAMES_FULL: u32 = 2;
    /// Calls of the traced VFS functions that returned without running their fexit programs:
    /// the function's BPF trampoline was rebuilt (a program attached to it or detached) while
    /// they ran, and the kernel sends calls still inside the old image past its fexit programs.
    /// Counted when the thread's syscall returns with such a call left in `IN_FLIGHT`.
    pub const FEXIT_SKIPPED: u32 = 3;
    /// Number of counters. The agent never reads a `LOSSES` map laid out with another count: a
    /// pinned set is adopted only when its object's hash is this object's.
    pub const COUNT: u32 = 4;
}

/// What happened, in [`Event::kind`].
pub mod kind {
    /// An `AF_UNIX` socket was bound to a filesystem path (`bind` returned 0).
    pub const BIND: u32 = 1;
    /// A directory entry was removed (`unlink`, `unlinkat`, `rmdir` returned 0).
    pub const REMOVE: u32 = 2;
    /// A socket inode or a directory was created (`mknod`/`mknodat` of `S_IFSOCK`, `mkdir`,
    /// `mkdirat` returned 0).
    pub const CREATE: u32 = 3;
    /// A bound `AF_UNIX` socket started listening (`listen` returned 0): it is served now.
    pub const LISTEN: u32 = 4;
    /// A listening `AF_UNIX` socket was released: its last reference dropped (fentry on
    /// `unix_release`), or one of its descriptors closed (`close` returned 0: the listener is gone
    /// unless another descriptor still holds it). The agent checks with a connect either way.
    pub const RELEASE: u32 = 5;
    /// A process other than the agent connected to a path-bound `AF_UNIX` socket of a watched
    /// directory (`connect` returned 0): reported once per socket instance, for its first
    /// contact (kubelet's first `GetInfo`, when the agent observes beside it). The caller is
    /// the process that connected, not the socket's creator.
    pub const CONNECT: u32 = 6;
}

/// How precisely the event locates the entry, in [`Event::scope`].
/// The slots of the `AGENT` map.
pub mod agent {
    /// The agent's tgid.
    pub const TGID: u32 = 0;
    /// Non-zero once a socket name did not fit `NAMES` (the agent keeps room for directories'
    /// names): a removal by a multi-component path whose name `NAMES` lacks is then reported
    /// when its parent component is a known name, as a hint to look in the directories so
    /// named. Without this, the agent emptied the table and rescanned, and with more sockets
    /// than the table holds it rescanned for ever.
    pub const NAMES_INCOMPLETE: u32 = 1;
    /// The map's size.
    pub const SLOTS: u32 = 2;
}

pub mod scope {
    /// [`crate::Event::parent`] is the identity of the directory holding the entry.
    pub const EXACT: u32 = 1;
    /// Only the name is known (the path had several components and cannot be resolved in BPF); the
    /// entry was matched by name against `NAMES`, so it may be in any watched directory, or none.
    pub const NAME_ONLY: u32 = 2;
    /// Parked only, never in the ring: a removal by a path of several components, reported as
    /// [`NAME_ONLY`] when its syscall returns if its name is in `NAMES` then. Deciding at entry
    /// lost removals: the agent announces a name it found and then looks at the entry again, and
    /// an `unlink` that entered before the announcement but removed the entry after the look
    /// went unreported, leaving a socket the agent believed present.
    pub const NAME_IF_KNOWN: u32 = 3;
}

/// Identity of a directory as the kernel sees it: `super_block.s_dev` and `inode.i_ino`.
///
/// `dev` is in the kernel's internal encoding (`major << 20 | minor`), not userspace `st_dev`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DirKey {
    /// `s_dev` of the directory's super block.
    pub dev: u64,
    /// Inode number of the directory.
    pub ino: u64,
}

impl DirKey {
    /// Converts a userspace `st_dev` (glibc `makedev` encoding) to the kernel's `s_dev` encoding.
    pub const fn kernel_dev(st_dev: u64) -> u64 {
        let major = ((st_dev >> 8) & 0xfff) | ((st_dev >> 32) & !0xfff);
        let minor = (st_dev & 0xff) | ((st_dev >> 12) & !0xff);
        ((major & 0xfff) << 20) | (minor & 0xf_ffff)
    }
}

/// An entry name, NUL-padded to [`NAME_LEN`] bytes so it can key a BPF hash map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NameKey {
    /// The name's bytes followed by NULs.
    pub bytes: [u8; NAME_LEN],
}

impl NameKey {
    /// The key for `name`, or `None` if it is empty or longer than `NAME_MAX` (no such entry can
    /// exist, so nothing needs matching).
    pub fn new(name: &[u8]) -> Option<Self> {
        if name.is_empty() || name.len() >= NAME_LEN || name.contains(&0) {
            return None;
        }
        let mut bytes = [0; NAME_LEN];
        bytes[..name.len()].copy_from_slice(name);
        Some(NameKey { bytes })
    }
}

/// A `NAMES` value: what userspace knows of the name. The programs read `id` only; `dir` is
/// userspace's bookkeeping, kept here so that userspace holds no copy of the table's names.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NameHolder {
    /// Userspace's id for a name that is a directory's, reported as a name-only event's parent
    /// (0: none).
    pub id: u32,
    /// Userspace's index of a watched directory holding an entry so named (0: none).
    pub dir: u32,
}

/// One record in the ring buffer: a successful syscall that changed an entry under the tree.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Event {
    /// One of [`kind`].
    pub kind: u32,
    /// One of [`scope`].
    pub scope: u32,
    /// Thread-group id (the process id, in the initial pid namespace) that made the call.
    pub tgid: u32,
    /// Bytes of `name` before the first NUL.
    pub name_len: u32,
    /// The caller's uid (`bpf_get_current_uid_gid`, in the initial user namespace).
    pub uid: u32,
    /// The caller's gid.
    pub gid: u32,
    /// `bpf_ktime_get_ns()` (`CLOCK_MONOTONIC`) when the syscall returned.
    pub ktime_ns: u64,
    /// The caller's cgroup v2 id (`bpf_get_current_cgroup_id`: its cgroup directory's inode).
    pub cgroup_id: u64,
    /// The caller's command name (`task_struct.comm`), NUL-padded.
    pub comm: [u8; COMM_LEN],
    /// The directory holding the entry, when `scope` is [`scope::EXACT`]. When it is
    /// [`scope::NAME_ONLY`], `dev` is 0 and `ino` is the `NAMES` value's id (userspace's id for the
    /// name) of the path's parent component if the kernel matched it there, else 0: a hint of
    /// which watched directories to look in.
    pub parent: DirKey,
    /// The entry's name.
    pub name: NameKey,
}

/// Where one kernel struct member lives: its byte offset in the struct that holds it.
///
/// Offsets of members reached through embedded structs (`file.f_path.dentry`) are summed, so every
/// field here is one `bpf_probe_read_kernel` away from the pointer named before the dot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    /// `task_struct.files` (`struct files_struct *`).
    pub task_files: u32,
    /// `task_struct.fs` (`struct fs_struct *`).
    pub task_fs: u32,
    /// `files_struct.fdt` (`struct fdtable *`).
    pub files_fdt: u32,
    /// `fdtable.max_fds` (`unsigned int`).
    pub fdtable_max_fds: u32,
    /// `fdtable.fd` (`struct file **`).
    pub fdtable_fd: u32,
    /// `file.private_data` (`struct socket *` for a socket).
    pub file_private_data: u32,
    /// `file.f_path.dentry`.
    pub file_dentry: u32,
    /// `socket.sk` (`struct sock *`).
    pub socket_sk: u32,
    /// `sock.__sk_common.skc_family` (`unsigned short`).
    pub sock_family: u32,
    /// `sock.__sk_common.skc_state` (`unsigned char`; `TCP_LISTEN` for a listening socket).
    pub sock_state: u32,
    /// `unix_sock.peer` (`struct sock *`): after a `connect`, the server's end of the connection
    /// (stream: the not-yet-accepted socket, which shares the listener's path; datagram: the
    /// bound socket itself).
    pub unix_sock_peer: u32,
    /// `inode.i_mode` (`umode_t`, `u16`).
    pub inode_mode: u32,
    /// `unix_sock.path.dentry`: the dentry a bound `AF_UNIX` socket lives at.
    pub unix_sock_dentry: u32,
    /// `fs_struct.pwd.dentry`.
    pub fs_pwd_dentry: u32,
    /// `dentry.d_parent`.
    pub dentry_parent: u32,
    /// `dentry.d_name.len` (`u32`).
    pub dentry_name_len: u32,
    /// `dentry.d_name.name` (`const unsigned char *`).
    pub dentry_name: u32,
    /// `dentry.d_inode`.
    pub dentry_inode: u32,
    /// `dentry.d_sb`.
    pub dentry_sb: u32,
    /// `inode.i_ino` (`unsigned long`).
    pub inode_ino: u32,
    /// `inode.i_generation` (`u32`): with the number, tells a socket bound again at a name from
    /// the one before it (filesystems draw it at random per inode).
    pub inode_generation: u32,
    /// `super_block.s_dev` (`dev_t`, `u32`).
    pub sb_dev: u32,
    /// `inode.i_nlink` (`unsigned int`): 0 once the inode's last name is unlinked.
    pub inode_nlink: u32,
}

impl KernelOffsets {
    /// All zero: what the object carries until the loader sets the resolved offsets.
    pub const UNSET: KernelOffsets = KernelOffsets {
        task_files: 0,
        task_fs: 0,
        files_fdt: 0,
        fdtable_max_fds: 0,
        fdtable_fd: 0,
        file_private_data: 0,
        file_dentry: 0,
        socket_sk: 0,
        sock_family: 0,
        sock_state: 0,
        unix_sock_peer: 0,
        inode_mode: 0,
        unix_sock_dentry: 0,
        fs_pwd_dentry: 0,
        dentry_parent: 0,
        dentry_name_len: 0,
        dentry_name: 0,
        dentry_inode: 0,
        dentry_sb: 0,
        inode_ino: 0,
        inode_generation: 0,
        sb_dev: 0,
        inode_nlink: 0,
    };
}

/// The running architecture's numbers of the path syscalls, which one program attached to all of
/// their `sys_enter_*` tracepoints tells apart by `__syscall_nr`. Userspace fills them from its own
/// (same-architecture) libc, so the object carries no architecture's table; a syscall the
/// architecture does not have (`unlink` on arm64) is -1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyscallNumbers {
    /// `unlink`.
    pub unlink: i32,
    /// `rmdir`.
    pub rmdir: i32,
    /// `unlinkat`.
    pub unlinkat: i32,
    /// `mknod`.
    pub mknod: i32,
    /// `mknodat`.
    pub mknodat: i32,
    /// `mkdir`.
    pub mkdir: i32,
    /// `mkdirat`.
    pub mkdirat: i32,
    /// `rename`.
    pub rename: i32,
    /// `renameat`.
    pub renameat: i32,
    /// `renameat2`.
    pub renameat2: i32,
}

impl SyscallNumbers {
    /// None known: the programs match no path syscall until the loader sets them.
    pub const UNSET: SyscallNumbers = SyscallNumbers {
        unlink: -1,
        rmdir: -1,
        unlinkat: -1,
        mknod: -1,
        mknodat: -1,
        mkdir: -1,
        mkdirat: -1,
        rename: -1,
        renameat: -1,
        renameat2: -1,
    };
}

impl Default for SyscallNumbers {
    fn default() -> Self {
        Self::UNSET
    }
}

/// Where the VFS functions the fentry/fexit programs hook keep what those programs read: argument
/// positions (counted from 0) and `struct renamedata` offsets. Their signatures change between
/// kernels (an idmap argument was added in 5.12, `vfs_mkdir` returns a dentry since 6.15, renames
/// take a `struct renamedata *`), so userspace resolves them from the running kernel's BTF like
/// [`KernelOffsets`]; a kernel where one cannot be resolved does not get the fentry programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VfsArgs {
    /// `vfs_unlink`'s `struct dentry *` argument.
    pub unlink_dentry: u32,
    /// `vfs_rmdir`'s `struct dentry *` argument.
    pub rmdir_dentry: u32,
    /// `vfs_mkdir`'s `struct dentry *` argument.
    pub mkdir_dentry: u32,
    /// 1 when `vfs_mkdir` returns a `struct dentry *` (or an `ERR_PTR`) instead of an `int`.
    pub mkdir_returns_ptr: u32,
    /// `vfs_mknod`'s `struct dentry *` argument (unix `bind` creates its inode through it).
    pub mknod_dentry: u32,
    /// `vfs_mknod`'s `umode_t mode` argument.
    pub mknod_mode: u32,
    /// `vfs_rename`'s `struct renamedata *` argument.
    pub rename_data: u32,
    /// `renamedata.old_dentry`.
    pub renamedata_old_dentry: u32,
    /// `renamedata.new_dentry`.
    pub renamedata_new_dentry: u32,
    /// `renamedata.flags` (`unsigned int`: `RENAME_EXCHANGE`, `RENAME_NOREPLACE`, ...).
    pub renamedata_flags: u32,
    /// Where each function's return value is in an fexit program's context: after its
    /// arguments, so at its parameter count. Read there rather than with `bpf_get_func_ret`,
    /// which arrived in 5.17: the 5.10 verifier refuses that helper.
    pub unlink_ret: u32,
    pub rmdir_ret: u32,
    pub mkdir_ret: u32,
    pub mknod_ret: u32,
    pub rename_ret: u32,
    /// Padding, zero (keeps the size a multiple of 8, as `Config` needs without implicit padding).
    pub _pad: u32,
}

/// Everything the programs need from userspace at load time, set as one read-only global.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Where to find kernel struct members on the running kernel.
    pub offsets: KernelOffsets,
    /// Padding, zero (keeps the layout explicit: the u64s after it stay aligned).
    pub _pad: [u32; 1],
    /// Wake the reader as soon as this many bytes are queued.
    pub wakeup_bytes: u64,
    /// Wake the reader for an event if it was last woken this many nanoseconds ago or earlier; events
    /// closer together ride along and the reader collects them after at most this delay.
    pub batch_ns: u64,
    /// Which `__syscall_nr` is which path syscall.
    pub syscalls: SyscallNumbers,
    /// Argument positions and offsets for the fentry/fexit programs (unused by the tracepoints).
    pub vfs: VfsArgs,
}

impl Config {
    /// What the object carries until the loader sets it; the programs report nothing with it
    /// (`batch_ns` 0 wakes the reader for every event, which is the safe default).
    pub const UNSET: Config = Config {
        offsets: KernelOffsets::UNSET,
        _pad: [0; 1],
        wakeup_bytes: 0,
        batch_ns: 0,
        syscalls: SyscallNumbers::UNSET,
        vfs: VfsArgs {
            unlink_dentry: 0,
            rmdir_dentry: 0,
            mkdir_dentry: 0,
            mkdir_returns_ptr: 0,
            mknod_dentry: 0,
            mknod_mode: 0,
            rename_data: 0,
            renamedata_old_dentry: 0,
            renamedata_new_dentry: 0,
            renamedata_flags: 0,
            unlink_ret: 0,
            rmdir_ret: 0,
            mkdir_ret: 0,
            mknod_ret: 0,
            rename_ret: 0,
            _pad: 0,
        },
    };
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: all of these are `#[repr(C)]`, `Copy`, contain only integers and byte arrays, and have
    // no implicit padding, so every bit pattern is a valid value.
    unsafe impl aya::Pod for super::DirKey {}
    unsafe impl aya::Pod for super::NameKey {}
    unsafe impl aya::Pod for super::NameHolder {}
    unsafe impl aya::Pod for super::Event {}
    unsafe impl aya::Pod for super::KernelOffsets {}
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::SyscallNumbers {}
    unsafe impl aya::Pod for super::VfsArgs {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_dev_moves_minor_below_bit_20() {
        // 254:0 (virtio disk) is st_dev 0xfe00, s_dev 0xfe00000.
        assert_eq!(DirKey::kernel_dev(0xfe00), 0xfe0_0000);
        // 8:17 is st_dev 0x811.
        assert_eq!(DirKey::kernel_dev(0x811), (8 << 20) | 17);
        // Minors above 255 keep their low byte at bit 0 and the rest from bit 20: 18:300.
        let st_dev = (0x12u64 << 8) | (0x2c) | ((0x1u64) << 12 << 8);
        assert_eq!(DirKey::kernel_dev(st_dev), (0x12 << 20) | 0x12c);
    }

    #[test]
    fn layout_has_no_implicit_padding() {
        assert_eq!(
            core::mem::size_of::<Event>(),
            6 * 4 + 8 + 8 + COMM_LEN + 16 + NAME_LEN
        );
        assert_eq!(core::mem::size_of::<KernelOffsets>(), 23 * 4);
        assert_eq!(core::mem::size_of::<SyscallNumbers>(), 10 * 4);
        assert_eq!(core::mem::size_of::<VfsArgs>(), 16 * 4);
        assert_eq!(
            core::mem::size_of::<Config>(),
            23 * 4 + 4 + 16 + 10 * 4 + 16 * 4
        );
    }

    #[test]
    fn name_key_rejects_what_no_entry_can_be_called() {
        assert!(NameKey::new(b"").is_none());
        assert!(NameKey::new(&[b'a'; NAME_LEN]).is_none());
        assert!(NameKey::new(b"a\0b").is_none());
        let key = NameKey::new(b"x.sock").map(|k| k.bytes);
        assert_eq!(key.map(|b| &b[..7] == b"x.sock\0"), Some(true));
    }
}
