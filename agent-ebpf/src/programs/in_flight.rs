//! fexit programs the kernel skipped: counted, so that their events' loss is a rescan.
//!
//! When any BPF program is attached to or detached from a traced VFS function (a second agent,
//! another tool), the kernel rebuilds the function's trampoline, and a call already inside the
//! function returns through the old image without running its fexit programs
//! (kernel/bpf/trampoline.c, `bpf_tramp_image_put`); no counter of the kernel's moves. So every
//! call is counted in and out, per thread, and a count left when the thread's syscall returns is
//! a call whose fexit did not run:
//!
//! ```text
//! fentry vfs_{mknod,mkdir,unlink,rmdir,rename}  --> IN_FLIGHT[thread] += 1   (every call)
//! fexit  vfs_{mknod,mkdir,unlink,rmdir,rename}  --> IN_FLIGHT[thread] -= 1   (first thing, every call)
//! sys_exit_{bind,mknod(at),mkdir(at),unlink(at),rmdir,rename(at,at2),io_uring_enter}
//!     IN_FLIGHT[thread] = n != 0 --> LOSSES[FEXIT_SKIPPED] += n, IN_FLIGHT[thread] = 0
//! ```
//!
//! A count, not a flag: a call may nest in another of the same thread (overlayfs unlinks in
//! its upper layer from inside `vfs_unlink`). Entries are updated in place and never deleted
//! (a thread's next call finds its entry; an insert and a delete per call cost twice the
//! time): the map is an LRU, and the one blind spot this leaves is an entry evicted while its
//! call is inside the function and its fexit then skipped, which takes as many other threads
//! making calls meanwhile as the map holds (the loader sizes it). Threads that never pass a
//! syscall exit (kernel threads, io_uring's workers) are not checked: docs/operations.md.

use agent_ebpf::loss;
use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use aya_ebpf::macros::{map, tracepoint};
use aya_ebpf::maps::LruHashMap;
use aya_ebpf::programs::TracePointContext;

use super::report::{count_loss, count_losses};

/// Sized by the loader (`names::IN_FLIGHT`): a single entry where the fentry family is not
/// tried. The entry of a thread is only ever touched by that thread's own programs, one at a
/// time.
#[map]
static IN_FLIGHT: LruHashMap<u64, u64> = LruHashMap::with_max_entries(65536, 0);

/// A traced call entered (fentry): one more in flight for this thread.
#[inline(always)]
pub(super) fn entered() {
    let thread = bpf_get_current_pid_tgid();
    match IN_FLIGHT.get_ptr_mut(thread) {
        // SAFETY: this thread's own entry (see `IN_FLIGHT`); an aligned u64.
        Some(count) => unsafe { *count = (*count).wrapping_add(1) },
        // An LRU insert makes room by evicting; failing, the call cannot be followed to its
        // exit: a loss of its own kind (a rescan), not a silent one.
        None => {
            if IN_FLIGHT.insert(thread, 1, 0).is_err() {
                count_loss(loss::PENDING_FULL);
            }
        }
    }
}

/// A traced call left (fexit): one fewer in flight, never below zero (a call that entered
/// before the fentry program was attached is not counted in).
#[inline(always)]
pub(super) fn left() {
    if let Some(count) = IN_FLIGHT.get_ptr_mut(bpf_get_current_pid_tgid()) {
        // SAFETY: as in `entered`.
        unsafe {
            if *count != 0 {
                *count -= 1;
            }
        }
    }
}

/// At the exit of every syscall that reaches the traced functions from a user thread: what is
/// still in flight returned without its fexit programs.
#[tracepoint]
pub fn in_flight_check(_ctx: TracePointContext) -> u32 {
    if let Some(count) = IN_FLIGHT.get_ptr_mut(bpf_get_current_pid_tgid()) {
        // SAFETY: as in `entered`.
        let skipped = unsafe { *count };
        if skipped != 0 {
            // SAFETY: as in `entered`.
            unsafe { *count = 0 };
            count_losses(loss::FEXIT_SKIPPED, skipped);
        }
    }
    0
}
