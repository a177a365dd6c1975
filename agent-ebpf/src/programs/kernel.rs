//! Reading the kernel: CONFIG (the offsets the agent resolved from BTF), kernel memory at those
//! offsets, the current task's descriptors and directories, and the one walk every socket program
//! shares: descriptor -> file -> socket -> sock -> the bound path's dentry.

use core::ptr::read_volatile;

use agent_ebpf::{Config, DirKey};
use aya_ebpf::helpers::bpf_probe_read_kernel;
use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_get_current_task, bpf_ktime_get_ns};

/// Offsets, own tgid and wake-up policy; set by the loader (see [`Config`]).
#[unsafe(no_mangle)]
pub(super) static CONFIG: Config = Config::UNSET;

pub(super) const AF_UNIX: u16 = 1;
pub(super) const RENAME_EXCHANGE: u64 = 2;
pub(super) const S_IFMT: u64 = 0o170000;
pub(super) const S_IFSOCK: u64 = 0o140000;
/// `TCP_LISTEN`, the state of a listening socket (unix sockets reuse the TCP states).
pub(super) const TCP_LISTEN: u8 = 10;

/// The offset of a kernel struct member, from CONFIG.
macro_rules! offset {
    ($field:ident) => {
        // SAFETY: CONFIG is a plain static; the volatile read stops the compiler from folding
        // the zero it is initialised with, since the loader rewrites it.
        unsafe {
            ::core::ptr::read_volatile(::core::ptr::addr_of!(
                $crate::programs::kernel::CONFIG.offsets.$field
            )) as usize
        }
    };
}
pub(super) use offset;

pub(super) fn config_u64(field: *const u64) -> u64 {
    // SAFETY: `field` points into CONFIG; see `offset!`.
    unsafe { read_volatile(field) }
}

/// Reads a `T` at `base + offset` in kernel memory.
#[inline(always)]
pub(super) fn kread<T>(base: usize, offset: usize) -> Option<T> {
    // SAFETY: bpf_probe_read_kernel checks the address and fails instead of faulting.
    unsafe { bpf_probe_read_kernel((base + offset) as *const T) }.ok()
}

/// Reads a non-null kernel pointer at `base + offset`.
#[inline(always)]
pub(super) fn kptr(base: usize, offset: usize) -> Option<usize> {
    kread::<usize>(base, offset).filter(|&p| p != 0)
}

/// The current task (`struct task_struct *`).
fn current_task() -> usize {
    // SAFETY: a helper without arguments, valid in every tracing program.
    unsafe { bpf_get_current_task() as usize }
}

/// `CLOCK_MONOTONIC` now, in nanoseconds.
pub(super) fn now_ns() -> u64 {
    // SAFETY: a helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

pub(super) fn current_tgid() -> u32 {
    (bpf_get_current_pid_tgid() >> 32) as u32
}

/// The kernel identity of the directory `dentry` names.
pub(super) fn dir_key(dentry: usize) -> Option<DirKey> {
    let inode = kptr(dentry, offset!(dentry_inode))?;
    let ino = kread::<u64>(inode, offset!(inode_ino))?;
    let sb = kptr(dentry, offset!(dentry_sb))?;
    let dev = kread::<u32>(sb, offset!(sb_dev))?;
    Some(DirKey {
        dev: u64::from(dev),
        ino,
    })
}

/// The current task's `struct file *` for descriptor `fd`.
pub(super) fn fd_file(fd: u64) -> Option<usize> {
    let task = current_task();
    let files = kptr(task, offset!(task_files))?;
    let fdt = kptr(files, offset!(files_fdt))?;
    let max_fds = kread::<u32>(fdt, offset!(fdtable_max_fds))?;
    if fd >= u64::from(max_fds) {
        return None;
    }
    let table = kptr(fdt, offset!(fdtable_fd))?;
    kptr(table, fd as usize * 8)
}

/// The current task's working directory.
pub(super) fn cwd_dentry() -> Option<usize> {
    let task = current_task();
    let fs = kptr(task, offset!(task_fs))?;
    kptr(fs, offset!(fs_pwd_dentry))
}

/// The `AF_UNIX` sock (`struct sock *`) of the socket file `file`, `None` for another family.
/// `file` must be a socket's: its `private_data` is read as a `struct socket *`.
#[inline(always)]
pub(super) fn unix_sock_of_file(file: usize) -> Option<usize> {
    let socket = kptr(file, offset!(file_private_data))?;
    unix_sock(socket)
}

/// The `AF_UNIX` sock of `socket` (`struct socket *`), `None` for another family.
#[inline(always)]
pub(super) fn unix_sock(socket: usize) -> Option<usize> {
    let sk = kptr(socket, offset!(socket_sk))?;
    (kread::<u16>(sk, offset!(sock_family))? == AF_UNIX).then_some(sk)
}

/// The `AF_UNIX` sock behind descriptor `fd` of the current task, which a `bind` or `connect`
/// on it just succeeded on (so the file is a socket's).
#[inline(always)]
pub(super) fn fd_unix_sock(fd: u32) -> Option<usize> {
    unix_sock_of_file(fd_file(u64::from(fd))?)
}

/// The dentry a unix sock is bound to (`unix_sock.path.dentry`); `None` for unbound and abstract
/// sockets, which have none.
#[inline(always)]
pub(super) fn bound_dentry(sk: usize) -> Option<usize> {
    kptr(sk, offset!(unix_sock_dentry))
}

/// Whether the unix sock `sk` listens.
#[inline(always)]
pub(super) fn is_listening(sk: usize) -> Option<bool> {
    Some(kread::<u8>(sk, offset!(sock_state))? == TCP_LISTEN)
}

/// The path-bound `AF_UNIX` socket behind descriptor `fd` of the current task: its dentry in
/// the tree, and whether it listens. `None` for anything else (the common case, decided by the
/// inode's mode before anything socket-specific is read).
#[inline(always)]
pub(super) fn bound_unix_socket(fd: u64) -> Option<(usize, bool)> {
    let file = fd_file(fd)?;
    let file_dentry = kptr(file, offset!(file_dentry))?;
    let inode = kptr(file_dentry, offset!(dentry_inode))?;
    let mode = kread::<u16>(inode, offset!(inode_mode))?;
    if u64::from(mode) & S_IFMT != S_IFSOCK {
        return None;
    }
    let sk = unix_sock_of_file(file)?;
    let dentry = bound_dentry(sk)?;
    Some((dentry, is_listening(sk)?))
}

/// Whether the socket inode at `dentry` still has a name. A plugin going away unlinks its
/// socket, then closes its listener: that release says nothing the removal did not, and as a
/// second prompt record per plugin it cost the agent a wake-up and a hand-over in the middle
/// of its deregistrations. The bound socket holds its dentry, which stays positive after the
/// unlink, its inode's `i_nlink` 0.
#[inline(always)]
pub(super) fn still_linked(dentry: usize) -> bool {
    kptr(dentry, offset!(dentry_inode))
        .and_then(|inode| kread::<u32>(inode, offset!(inode_nlink)))
        .is_some_and(|links| links != 0)
}

/// Argument `n` of the traced function (fentry/fexit), read with a helper from the program's
/// context (an array of u64 on the trampoline's stack) so it is a plain number to the verifier:
/// `n` comes from CONFIG, and offset arithmetic on it follows.
#[inline(always)]
pub(super) fn func_arg(ctx: *mut core::ffi::c_void, n: u32) -> Option<u64> {
    if n >= 12 {
        return None;
    }
    let slot = (ctx as *const u64).wrapping_add((n & 15) as usize);
    // SAFETY: bpf_probe_read_kernel fails instead of faulting; `slot` is within the context.
    unsafe { bpf_probe_read_kernel(slot) }.ok()
}
