//! A syscall tracepoint's record: its arguments at entry, its result at exit, and the
//! descriptor a socket syscall's entry parks for its exit.

use core::ptr::read_volatile;

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user};
use aya_ebpf::maps::HashMap;
use aya_ebpf::programs::TracePointContext;

use super::kernel::AF_UNIX;

/// Byte offset of syscall argument `n` in a `sys_enter_*` record (`struct syscall_trace_enter`:
/// an 8-byte common header, `int nr`, then `unsigned long args[6]`).
const fn arg(n: usize) -> usize {
    16 + 8 * n
}
/// Byte offset of the return value in a `sys_exit_*` record (`struct syscall_trace_exit`).
const RET: usize = 16;

/// Reads syscall argument `n`.
pub(super) fn arg_u64(ctx: &TracePointContext, n: usize) -> Option<u64> {
    // SAFETY: offsets within a sys_enter_* record.
    unsafe { ctx.read_at::<u64>(arg(n)) }.ok()
}

/// Reads a `dfd` argument (an `int`, sign-extended).
pub(super) fn arg_dfd(ctx: &TracePointContext, n: usize) -> Option<i64> {
    arg_u64(ctx, n).map(|v| i64::from(v as i32))
}

/// The syscall number of a `sys_enter_*` record (`__syscall_nr`, at offset 8 of every one).
pub(super) fn syscall_nr(ctx: &TracePointContext) -> Option<i32> {
    // SAFETY: offset within the sys_enter_* record.
    unsafe { ctx.read_at::<i32>(8) }.ok()
}

/// Whether `nr` is the syscall whose number the loader put at `field` of CONFIG.syscalls.
pub(super) fn is_syscall(nr: i32, field: *const i32) -> bool {
    // SAFETY: `field` points into CONFIG; see `offset!`.
    let expected = unsafe { read_volatile(field) };
    expected >= 0 && nr == expected
}

/// Whether `nr` is the syscall `name` (a field of CONFIG.syscalls).
macro_rules! sys {
    ($nr:expr, $name:ident) => {
        $crate::programs::syscall::is_syscall(
            $nr,
            ::core::ptr::addr_of!($crate::programs::kernel::CONFIG.syscalls.$name),
        )
    };
}
pub(super) use sys;

/// Whether the `sys_exit_*` record says the call returned 0.
#[inline(always)]
pub(super) fn returned_zero(ctx: &TracePointContext) -> bool {
    // SAFETY: offset within a sys_exit_* record.
    matches!(unsafe { ctx.read_at::<i64>(RET) }, Ok(0))
}

/// The descriptor this thread's `bind`, `listen` or `connect` entry parked in `pending`
/// (taken out here, whatever the result), if the syscall returned 0.
#[inline(always)]
pub(super) fn parked_fd_if_succeeded(
    pending: &HashMap<u64, u32>,
    ctx: &TracePointContext,
) -> Option<u32> {
    let thread = bpf_get_current_pid_tgid();
    // SAFETY: the value is copied out before the entry is removed.
    let fd = unsafe { pending.get(&thread) }.copied()?;
    let _ = pending.remove(&thread);
    // SAFETY: offset within a sys_exit_* record.
    (unsafe { ctx.read_at::<i64>(RET) }.ok()? == 0).then_some(fd)
}

/// The descriptor a `bind` or `connect` entry names (argument 0), if its address (arguments 1
/// and 2) is a filesystem `AF_UNIX` one.
#[inline(always)]
pub(super) fn unix_path_socket_fd(ctx: &TracePointContext) -> Option<u64> {
    let fd = arg_u64(ctx, 0)?;
    unix_path_address(arg_u64(ctx, 1)?, arg_u64(ctx, 2)?).then_some(fd)
}

/// Whether the `struct sockaddr *` of a `bind` or `connect` (user memory, `addrlen` bytes)
/// names a filesystem `AF_UNIX` address.
#[inline(always)]
fn unix_path_address(addr: u64, addrlen: u64) -> bool {
    // sa_family (2 bytes) and at least the first byte of sun_path.
    if addrlen < 3 {
        return false;
    }
    // SAFETY: bpf_probe_read_user fails instead of faulting on a bad address.
    let Ok(head) = (unsafe { bpf_probe_read_user(addr as *const [u8; 3]) }) else {
        return false;
    };
    // sun_path[0] == 0 is an abstract socket: no filesystem entry.
    u16::from_ne_bytes([head[0], head[1]]) == AF_UNIX && head[2] != 0
}
