//! fentry/fexit on the VFS: the preferred family, where the kernel allows it.
//!
//! These see the dentry an operation acts on, so every path form (relative, `..`, chroot,
//! another mount namespace, a multi-component path into a directory just created) lands on the
//! parent's identity with no path scan and no name table. Unix `bind` creates its inode with
//! `vfs_mknod(S_IFSOCK)`, so one program covers `bind` and `mknod`. Argument positions and
//! `struct renamedata` offsets come from the running kernel's BTF ([`VfsArgs`](agent_ebpf::VfsArgs)).
//!
//! Every traced call is counted in by an fentry program and out by its fexit, first thing and
//! whatever the call did ([`in_flight`](super::in_flight)): a call whose fexit the kernel
//! skipped (its trampoline rebuilt meanwhile) is a counted loss, not a silent one.
//!
//! The build machine's kernel refuses fentry/fexit (EPERM) and the loader falls back to the
//! tracepoints there (and says why); `cargo xtask vm-test` runs these on Debian's 6.1.

use agent_ebpf::{kind, scope};
use aya_ebpf::EbpfContext;
use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use aya_ebpf::macros::{fentry, fexit};
use aya_ebpf::programs::{FEntryContext, FExitContext};

use super::in_flight::{entered, left};
use super::kernel::{RENAME_EXCHANGE, S_IFMT, S_IFSOCK, func_arg, kptr, kread, offset};
use super::maps::{PENDING, scratch_slot};
use super::report::{
    Caller, is_agent, park, read_name, report_below_watched, report_dentry, report_parked,
    watched_parent,
};

/// A traced function's argument position (or `struct renamedata` offset) from CONFIG.vfs.
macro_rules! vfs {
    ($field:ident) => {
        // SAFETY: see `offset!`.
        unsafe {
            ::core::ptr::read_volatile(::core::ptr::addr_of!(
                $crate::programs::kernel::CONFIG.vfs.$field
            ))
        }
    };
}

/// The traced function's return value, from the context slot after its `slot` arguments
/// (the trampoline stores it there for fexit programs on every kernel that has them;
/// `bpf_get_func_ret`, which `FExitContext::ret` calls, arrived only in 5.17).
#[inline(always)]
fn func_ret(ctx: *mut core::ffi::c_void, slot: u32) -> Option<u64> {
    func_arg(ctx, slot)
}

/// Whether an `int`-returning VFS function succeeded (0; the upper half of the register is
/// not defined for an `int`).
fn int_ok(ret: Option<u64>) -> bool {
    matches!(ret, Some(r) if r as u32 == 0)
}

/// Counts a `vfs_mknod` call in (see [`in_flight`](super::in_flight)).
#[fentry(function = "vfs_mknod")]
pub fn vfs_mknod_enter(_ctx: FEntryContext) -> u32 {
    entered();
    0
}

/// A socket inode created: `bind` of a unix socket to a path, or `mknod(S_IFSOCK)`.
#[fexit(function = "vfs_mknod")]
pub fn vfs_mknod_exit(ctx: FExitContext) -> u32 {
    left();
    let _ = try_vfs_mknod_exit(&ctx);
    0
}

fn try_vfs_mknod_exit(ctx: &FExitContext) -> Option<()> {
    if is_agent() || !int_ok(func_ret(ctx.as_ptr(), vfs!(mknod_ret))) {
        return None;
    }
    let mode = func_arg(ctx.as_ptr(), vfs!(mknod_mode))?;
    if mode & S_IFMT != S_IFSOCK {
        return None;
    }
    let dentry = func_arg(ctx.as_ptr(), vfs!(mknod_dentry))? as usize;
    report_below_watched(dentry, kind::CREATE)
}

/// Counts a `vfs_mkdir` call in.
#[fentry(function = "vfs_mkdir")]
pub fn vfs_mkdir_enter(_ctx: FEntryContext) -> u32 {
    entered();
    0
}

/// A directory created: joins the watched set at once (`mkdir -p a/b/c` reports `a`).
#[fexit(function = "vfs_mkdir")]
pub fn vfs_mkdir_exit(ctx: FExitContext) -> u32 {
    left();
    let _ = try_vfs_mkdir_exit(&ctx);
    0
}

fn try_vfs_mkdir_exit(ctx: &FExitContext) -> Option<()> {
    if is_agent() {
        return None;
    }
    let ret = func_ret(ctx.as_ptr(), vfs!(mkdir_ret));
    let dentry = if vfs!(mkdir_returns_ptr) != 0 {
        // The new directory's dentry (which may not be the argument's, then released), or an
        // ERR_PTR (the top 4095 values).
        match ret {
            Some(r) if r != 0 && r < (-4095i64) as u64 => r as usize,
            _ => return None,
        }
    } else if int_ok(ret) {
        func_arg(ctx.as_ptr(), vfs!(mkdir_dentry))? as usize
    } else {
        return None;
    };
    report_below_watched(dentry, kind::CREATE)
}

/// Counts a `vfs_unlink` call in.
#[fentry(function = "vfs_unlink")]
pub fn vfs_unlink_enter(_ctx: FEntryContext) -> u32 {
    entered();
    0
}

/// An entry unlinked.
#[fexit(function = "vfs_unlink")]
pub fn vfs_unlink_exit(ctx: FExitContext) -> u32 {
    left();
    let _ = try_vfs_removal_exit(&ctx, vfs!(unlink_dentry), vfs!(unlink_ret));
    0
}

/// Counts a `vfs_rmdir` call in.
#[fentry(function = "vfs_rmdir")]
pub fn vfs_rmdir_enter(_ctx: FEntryContext) -> u32 {
    entered();
    0
}

/// A directory removed.
#[fexit(function = "vfs_rmdir")]
pub fn vfs_rmdir_exit(ctx: FExitContext) -> u32 {
    left();
    let _ = try_vfs_removal_exit(&ctx, vfs!(rmdir_dentry), vfs!(rmdir_ret));
    0
}

fn try_vfs_removal_exit(ctx: &FExitContext, dentry_arg: u32, ret_slot: u32) -> Option<()> {
    if is_agent() || !int_ok(func_ret(ctx.as_ptr(), ret_slot)) {
        return None;
    }
    // The dentry is negative now, but keeps its parent and name.
    let dentry = func_arg(ctx.as_ptr(), dentry_arg)? as usize;
    let parent = watched_parent(dentry)?;
    report_dentry(dentry, parent, kind::REMOVE)
}

/// Before a rename: counts the call in, and parks the source's directory and name, which the
/// move overwrites, for the thread until [`vfs_rename_exit`].
#[fentry(function = "vfs_rename")]
pub fn vfs_rename_enter(ctx: FEntryContext) -> u32 {
    entered();
    let _ = try_vfs_rename_enter(&ctx);
    0
}

fn try_vfs_rename_enter(ctx: &FEntryContext) -> Option<()> {
    if is_agent() {
        return None;
    }
    let rd = func_arg(ctx.as_ptr(), vfs!(rename_data))? as usize;
    let old = kptr(rd, vfs!(renamedata_old_dentry) as usize)?;
    let flags = kread::<u32>(rd, vfs!(renamedata_flags) as usize)?;
    let parent = watched_parent(old)?;
    // SAFETY: this program run holds no other reference into the scratch slot.
    let event = &mut unsafe { scratch_slot() }?.event;
    let name = kptr(old, offset!(dentry_name))?;
    event.name_len = read_name(event, name)? as u32;
    // The source of a RENAME_EXCHANGE is replaced, not removed (the watcher stats it anyway).
    event.kind = if u64::from(flags) & RENAME_EXCHANGE != 0 {
        kind::CREATE
    } else {
        kind::REMOVE
    };
    event.scope = scope::EXACT;
    event.parent = parent;
    // SAFETY: `event` is this program run's per-CPU scratch record.
    unsafe { Caller::current().stamp(event) };
    park(&PENDING, event);
    Some(())
}

/// After a rename: the parked source, if it succeeded, and the target, which the source's
/// dentry now is (`d_move` gave it the target's parent and name).
#[fexit(function = "vfs_rename")]
pub fn vfs_rename_exit(ctx: FExitContext) -> u32 {
    left();
    let succeeded = int_ok(func_ret(ctx.as_ptr(), vfs!(rename_ret)));
    let thread = bpf_get_current_pid_tgid();
    report_parked(&PENDING, thread, succeeded);
    if succeeded && !is_agent() {
        let _ = try_vfs_rename_target(&ctx);
    }
    0
}

fn try_vfs_rename_target(ctx: &FExitContext) -> Option<()> {
    let rd = func_arg(ctx.as_ptr(), vfs!(rename_data))? as usize;
    let moved = kptr(rd, vfs!(renamedata_old_dentry) as usize)?;
    report_below_watched(moved, kind::CREATE)
}
