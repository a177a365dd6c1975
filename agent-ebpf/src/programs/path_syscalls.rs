//! The path syscalls on tracepoints: unlink, unlinkat, rmdir, mknod(at) of sockets, mkdir(at)
//! (one path argument) and rename, renameat, renameat2 (a second path), where fentry is refused.
//!
//! The source of a rename is classified by `path_enter` like a removal; the target by
//! `rename_target_enter` on the same tracepoints, so each program scans one path. The sides meet
//! at exit (`path_exit`), where a target reported only because its source was in the tree is
//! emitted if the source was.

use core::ptr::{addr_of, read_volatile};

use agent_ebpf::{Event, kind, scope};
use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use aya_ebpf::macros::{map, tracepoint};
use aya_ebpf::maps::HashMap;
use aya_ebpf::programs::TracePointContext;

use super::kernel::{
    RENAME_EXCHANGE, S_IFMT, S_IFSOCK, cwd_dentry, dir_key, fd_file, kptr, offset,
};
use super::maps::{NAMES, PENDING, Scratch, WATCHED, scratch_slot};
use super::path_scan::{last_component, name_only_parent, parent_known};
use super::report::{Caller, is_agent, park, report_parked};
use super::syscall::{arg_dfd, arg_u64, returned_zero, sys, syscall_nr};

const AT_FDCWD: i64 = -100;

/// The target of a rename parked like PENDING (the source goes in PENDING).
#[map]
static PENDING_TARGET: HashMap<u64, Event> = HashMap::with_max_entries(4096, 0);

/// The target of a rename by a multi-component path to a new name: reported only if the
/// source was in the tree (a move within it).
#[map]
static PENDING_IF_SOURCE: HashMap<u64, Event> = HashMap::with_max_entries(4096, 0);

/// What a path syscall does to the tree, and so how a path that cannot be resolved is handled.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PathOp {
    /// An entry goes (`unlink`, `rmdir`): a multi-component path is matched by name in NAMES.
    Remove,
    /// A socket inode appears (`mknod S_IFSOCK`): rare enough to report any path by name.
    CreateSocket,
    /// A directory appears (`mkdir`): common system-wide, so a multi-component path is reported
    /// only when its parent component is a name in NAMES (a watched directory's, plausibly).
    /// A socket later bound inside a new directory is found by the bind programs' walk up to
    /// the watched ancestor in any case.
    CreateDir,
    /// The target of a rename: any path is classified, and the caller decides whether a
    /// name-only target is reported (see `rename_target_enter`).
    MoveTo,
}

/// The first path argument of every path syscall this object watches, in one program.
///
/// One program on all ten `sys_enter_*` tracepoints, told apart by `__syscall_nr`, rather than
/// one per syscall: the path scan is what the verifier spends its time on, and this way it is
/// verified once (plus once in [`rename_target_enter`]) instead of ten times.
#[tracepoint]
pub fn path_enter(ctx: TracePointContext) -> u32 {
    let _ = try_path_enter(&ctx);
    0
}

fn try_path_enter(ctx: &TracePointContext) -> Option<()> {
    if is_agent() {
        return None;
    }
    let nr = syscall_nr(ctx)?;
    let (dfd, path, op, flags) = if sys!(nr, unlink) || sys!(nr, rmdir) {
        (AT_FDCWD, arg_u64(ctx, 0)?, PathOp::Remove, 0)
    } else if sys!(nr, unlinkat) {
        (arg_dfd(ctx, 0)?, arg_u64(ctx, 1)?, PathOp::Remove, 0)
    } else if sys!(nr, mknod) {
        if arg_u64(ctx, 1)? & S_IFMT != S_IFSOCK {
            return None;
        }
        (AT_FDCWD, arg_u64(ctx, 0)?, PathOp::CreateSocket, 0)
    } else if sys!(nr, mknodat) {
        if arg_u64(ctx, 2)? & S_IFMT != S_IFSOCK {
            return None;
        }
        (arg_dfd(ctx, 0)?, arg_u64(ctx, 1)?, PathOp::CreateSocket, 0)
    } else if sys!(nr, mkdir) {
        (AT_FDCWD, arg_u64(ctx, 0)?, PathOp::CreateDir, 0)
    } else if sys!(nr, mkdirat) {
        (arg_dfd(ctx, 0)?, arg_u64(ctx, 1)?, PathOp::CreateDir, 0)
    } else if sys!(nr, rename) {
        (AT_FDCWD, arg_u64(ctx, 0)?, PathOp::Remove, 0)
    } else if sys!(nr, renameat) {
        (arg_dfd(ctx, 0)?, arg_u64(ctx, 1)?, PathOp::Remove, 0)
    } else if sys!(nr, renameat2) {
        (
            arg_dfd(ctx, 0)?,
            arg_u64(ctx, 1)?,
            PathOp::Remove,
            arg_u64(ctx, 4)?,
        )
    } else {
        return None;
    };
    // SAFETY: this program run holds no other reference into the scratch slot.
    let scratch = unsafe { scratch_slot() }?;
    let (dfd, path, op) = forget_origin(scratch, dfd, path, op);
    classify(scratch, dfd, path, op)?;
    // The source of a RENAME_EXCHANGE is replaced, not removed: reported as a creation (the
    // watcher stats what is there now).
    if flags & RENAME_EXCHANGE != 0 {
        scratch.event.kind = kind::CREATE;
    }
    park(&PENDING, &scratch.event);
    Some(())
}

/// Passes the dispatch's results through memory, so the verifier meets one unknown `(dfd,
/// path, op)` at the path scan instead of a separately explored constant per syscall.
#[inline(always)]
fn forget_origin(scratch: &mut Scratch, dfd: i64, path: u64, op: PathOp) -> (i64, u64, PathOp) {
    scratch.dfd = dfd;
    scratch.path_ptr = path;
    scratch.op = op as u64;
    // SAFETY: plain fields of the scratch slot, just written.
    let (dfd, path, op) = unsafe {
        (
            read_volatile(addr_of!(scratch.dfd)),
            read_volatile(addr_of!(scratch.path_ptr)),
            read_volatile(addr_of!(scratch.op)),
        )
    };
    let op = match op {
        x if x == PathOp::CreateSocket as u64 => PathOp::CreateSocket,
        x if x == PathOp::CreateDir as u64 => PathOp::CreateDir,
        x if x == PathOp::MoveTo as u64 => PathOp::MoveTo,
        _ => PathOp::Remove,
    };
    (dfd, path, op)
}

/// Decides whether `op` on `path` (relative to `dfd`) concerns the tree and fills
/// `scratch.event` if so.
#[inline(always)]
fn classify(scratch: &mut Scratch, dfd: i64, path: u64, op: PathOp) -> Option<()> {
    scratch.parent_id = 0;
    let single = last_component(scratch, path)?;
    if single {
        // "name": its parent is the start directory, which the kernel can name exactly.
        let start = if dfd == AT_FDCWD {
            cwd_dentry()?
        } else {
            kptr(fd_file(dfd as u64)?, offset!(file_dentry))?
        };
        let parent = dir_key(start)?;
        // SAFETY: presence check only.
        unsafe { WATCHED.get(&parent) }?;
        scratch.event.scope = scope::EXACT;
        scratch.event.parent = parent;
    } else {
        // "dir/name" or "/abs/name": only names can be checked.
        match op {
            // Reported or not when the syscall returns (see `scope::NAME_IF_KNOWN`); the
            // parent component's id, when NAMES has it, is not a filter but where userspace
            // looks: one `stat` in the watched directories so named instead of a read of
            // every watched directory (a churn's removals by absolute path, in batches).
            PathOp::Remove | PathOp::CreateSocket => {
                let _ = parent_known(scratch);
            }
            // `rename_target_enter` looks the parent up itself when it needs to.
            PathOp::MoveTo => {}
            PathOp::CreateDir => {
                if !parent_known(scratch) {
                    return None;
                }
            }
        }
        scratch.event.scope = if op == PathOp::Remove {
            scope::NAME_IF_KNOWN
        } else {
            scope::NAME_ONLY
        };
        scratch.event.parent = name_only_parent(scratch);
    }
    let event = &mut scratch.event;
    event.kind = if op == PathOp::Remove {
        kind::REMOVE
    } else {
        kind::CREATE
    };
    // SAFETY: `event` is this program run's per-CPU scratch record.
    unsafe { Caller::current().stamp(event) };
    Some(())
}

/// The target of a rename appears (with `RENAME_EXCHANGE` too: the source's entry lands there).
/// A multi-component target is reported by name if the name is known (it replaces an entry),
/// if its parent component is a known name (a move into a watched directory from anywhere,
/// to a new name), or, decided at exit, if the source was in the tree (a move within it).
#[tracepoint]
pub fn rename_target_enter(ctx: TracePointContext) -> u32 {
    let _ = try_rename_target_enter(&ctx);
    0
}

fn try_rename_target_enter(ctx: &TracePointContext) -> Option<()> {
    if is_agent() {
        return None;
    }
    let nr = syscall_nr(ctx)?;
    let (dfd, new) = if sys!(nr, rename) {
        (AT_FDCWD, arg_u64(ctx, 1)?)
    } else if sys!(nr, renameat) || sys!(nr, renameat2) {
        (arg_dfd(ctx, 2)?, arg_u64(ctx, 3)?)
    } else {
        return None;
    };
    // SAFETY: this program run holds no other reference into the scratch slot.
    let scratch = unsafe { scratch_slot() }?;
    let (dfd, new, _) = forget_origin(scratch, dfd, new, PathOp::MoveTo);
    classify(scratch, dfd, new, PathOp::MoveTo)?;
    // SAFETY: presence check only.
    let known = unsafe { NAMES.get(&scratch.event.name) }.is_some();
    if scratch.event.scope == scope::EXACT || known || parent_known(scratch) {
        if scratch.event.scope == scope::NAME_ONLY {
            scratch.event.parent = name_only_parent(scratch);
        }
        park(&PENDING_TARGET, &scratch.event);
    } else {
        park(&PENDING_IF_SOURCE, &scratch.event);
    }
    Some(())
}

/// Reports the parked path events of this thread if its syscall succeeded.
#[tracepoint]
pub fn path_exit(ctx: TracePointContext) -> u32 {
    let succeeded = returned_zero(&ctx);
    let thread = bpf_get_current_pid_tgid();
    let source_in_tree = report_parked(&PENDING, thread, succeeded);
    report_parked(&PENDING_TARGET, thread, succeeded);
    report_parked(&PENDING_IF_SOURCE, thread, succeeded && source_in_tree);
    0
}
